//! The raw TCP bandwidth of this machine, measured in the same run as every communication
//! benchmark so figures can be quoted as a ratio to it: one plain socket pair (or as many at
//! once as a run keeps busy), a sender streaming large writes, a receiver draining them, no
//! framing and no copies beyond the kernel's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use gradsync_core::heap::filled;

use crate::hosts::Hosts;

/// Bytes per write: large enough that syscall overhead is negligible.
const CHUNK: usize = 4 << 20;

/// The raw TCP yardstick every benchmark quotes its figures against: `rounds` separate
/// measurements of one plain stream (each about `each` long), kept whole so a report can show
/// their spread, since a single one can land on a burst of other load.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Yardstick {
    /// Each measurement, bytes per second, in the order taken.
    pub samples: Vec<f64>,
}

impl Yardstick {
    /// Measure between the two ends `pair` makes (a fresh connected sender and receiver each
    /// round: loopback, or one emulated host to another).
    pub fn measure(
        rounds: usize,
        each: Duration,
        mut pair: impl FnMut() -> anyhow::Result<(TcpStream, TcpStream)>,
    ) -> anyhow::Result<Yardstick> {
        let mut samples = Vec::with_capacity(rounds.max(1));
        for _ in 0..rounds.max(1) {
            let (tx, rx) = pair()?;
            samples.push(stream_rate(tx, rx, each)?);
        }
        Ok(Yardstick { samples })
    }

    /// [`Yardstick::measure`] over loopback (`ip`, normally 127.0.0.1).
    pub fn loopback(ip: &str, rounds: usize, each: Duration) -> anyhow::Result<Yardstick> {
        Yardstick::measure(rounds, each, || loopback_pair(ip))
    }

    /// What `streams` plain streams carry together over loopback (`ip`) when they all stream at
    /// once, as a run's many connections do: `rounds` measurements of the sum of their rates,
    /// each stream timed over the same span of about `each`.
    pub fn loopback_streams(
        ip: &str,
        streams: usize,
        rounds: usize,
        each: Duration,
    ) -> anyhow::Result<Yardstick> {
        anyhow::ensure!(streams > 0, "a yardstick needs at least one stream");
        let mut samples = Vec::with_capacity(rounds.max(1));
        for _ in 0..rounds.max(1) {
            let pairs = (0..streams).map(|_| loopback_pair(ip)).collect::<anyhow::Result<Vec<_>>>()?;
            let start = std::sync::Barrier::new(streams);
            let rates = std::thread::scope(|s| {
                let start = &start;
                let handles: Vec<_> = pairs
                    .into_iter()
                    .map(|(tx, rx)| {
                        s.spawn(move || {
                            start.wait();
                            stream_rate(tx, rx, each)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().map_err(|_| anyhow::anyhow!("a stream's thread panicked"))?)
                    .collect::<anyhow::Result<Vec<f64>>>()
            })?;
            samples.push(rates.iter().sum());
        }
        Ok(Yardstick { samples })
    }

    /// The median, bytes per second: the figure models are fitted to.
    pub fn median(&self) -> f64 {
        let mut v = self.samples.clone();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// The smallest and largest measurement, bytes per second.
    pub fn range(&self) -> (f64, f64) {
        let lo = self.samples.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.samples.iter().copied().fold(0.0, f64::max);
        (if lo.is_finite() { lo } else { 0.0 }, hi)
    }

    /// `median GB/s (min-max, n measurements)`, for tables and logs.
    pub fn describe(&self) -> String {
        let (lo, hi) = self.range();
        format!(
            "{:.2} GB/s (median of {}; {:.2}-{:.2})",
            self.median() / 1e9,
            self.samples.len(),
            lo / 1e9,
            hi / 1e9
        )
    }
}

/// A connected (sender, receiver) pair over loopback on `ip`.
fn loopback_pair(ip: &str) -> anyhow::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("binding {ip}:0"))?;
    let tx = TcpStream::connect_timeout(&listener.local_addr()?, Duration::from_secs(10))
        .context("connecting to the receiver")?;
    let (rx, _) = listener.accept().context("accepting the sender")?;
    Ok((tx, rx))
}

/// Stream large writes from `tx` to its peer `rx` for about `duration` (after a fifth of it
/// to warm up) and return the bytes per second: one plain socket pair, however connected
/// (loopback, or between emulated hosts).
pub fn stream_rate(mut tx: TcpStream, mut rx: TcpStream, duration: Duration) -> anyhow::Result<f64> {
    rx.set_read_timeout(Some(Duration::from_secs(30)))?;
    let receiver = std::thread::spawn(move || -> std::io::Result<u64> {
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0u64;
        loop {
            let n = rx.read(&mut buf)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
        }
    });
    let (sent, t) = pump(&mut tx, duration)?;
    let secs = t.elapsed().as_secs_f64();
    drop(tx);
    receiver.join().map_err(|_| anyhow::anyhow!("receiver thread panicked"))?.context("receiving")?;
    Ok(sent as f64 / secs)
}

/// Stream large writes on `tx` for a fifth of `duration` (the congestion window and socket
/// buffers grow), then for `duration`: the bytes of the timed part and when it began.
fn pump(tx: &mut TcpStream, duration: Duration) -> std::io::Result<(u64, Instant)> {
    tx.set_nodelay(true)?;
    tx.set_write_timeout(Some(Duration::from_secs(30)))?;
    let buf = vec![1u8; CHUNK];
    let warm = Instant::now();
    while warm.elapsed() < duration / 5 {
        tx.write_all(&buf)?;
    }
    let t = Instant::now();
    let mut sent = 0u64;
    while t.elapsed() < duration {
        tx.write_all(&buf)?;
        sent += CHUNK as u64;
    }
    tx.flush()?;
    Ok((sent, t))
}

/// One-way latency of a small message over a plain socket pair on `ip`: the median of `rounds`
/// 8-byte ping-pongs, halved. The cost model's per-message term `a`.
pub fn latency(ip: &str, rounds: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("binding {ip}:0"))?;
    let tx = TcpStream::connect_timeout(&listener.local_addr()?, Duration::from_secs(10))
        .context("connecting to the echo")?;
    let (rx, _) = listener.accept().context("accepting the pinger")?;
    latency_between(tx, rx, rounds)
}

/// [`latency`] between the two ends of a connected pair, however connected (loopback, or one
/// emulated host to another): `rx` echoes what `tx` sends.
pub fn latency_between(mut tx: TcpStream, mut rx: TcpStream, rounds: usize) -> anyhow::Result<f64> {
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        rx.set_nodelay(true)?;
        rx.set_read_timeout(Some(Duration::from_secs(30)))?;
        echo(&mut rx)
    });
    let pinged = ping(&mut tx, rounds);
    // The echo sees the end of the stream and returns, whether or not the pings all came back.
    drop(tx);
    echo.join().map_err(|_| anyhow::anyhow!("echo thread panicked"))?.context("echoing")?;
    pinged.context("pinging the echo")
}

/// Half the median round trip of `rounds` 8-byte messages that `tx`'s peer echoes (ten
/// more first, left out: they warm the caches and the scheduler), seconds.
fn ping(tx: &mut TcpStream, rounds: usize) -> std::io::Result<f64> {
    tx.set_nodelay(true)?;
    tx.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = [7u8; 8];
    let mut rtts = Vec::with_capacity(rounds);
    for i in 0..rounds.max(1) + 10 {
        let t = Instant::now();
        tx.write_all(&buf)?;
        tx.read_exact(&mut buf)?;
        if i >= 10 {
            rtts.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(crate::table::median(&rtts) / 2.0)
}

/// Flags of `gradsync-bench rawtcp-peer`: the yardstick between two hosts, one end on each
/// (`compare --hosts` starts both over ssh).
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// Serve as the far end at this address (`ADDR:0`: any port), printing
    /// `gradsync-bench listening on ADDR:PORT`: a sink for streams, an echo for pings.
    #[arg(long, conflicts_with = "to", required_unless_present = "to")]
    pub listen: Option<String>,
    /// Measure the link to the far end at this address; prints one JSON line
    /// (`{"samples": [bytes/s...], "latency_s": x}`).
    #[arg(long)]
    pub to: Option<String>,
    /// Bandwidth measurements.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Seconds each measurement streams.
    #[arg(long, default_value_t = 0.3)]
    pub seconds: f64,
    /// Small-message round trips timed.
    #[arg(long, default_value_t = 200)]
    pub pings: usize,
    /// Seconds the far end serves before it exits.
    #[arg(long, default_value_t = 120.0)]
    pub serve_s: f64,
}

/// What the measuring end of `rawtcp-peer` prints.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PeerReading {
    /// The bandwidth measurements, bytes per second.
    pub samples: Vec<f64>,
    /// One-way small-message latency, seconds.
    pub latency_s: f64,
}

/// A connection's first byte: what the far end does with it.
const SINK: u8 = b'B';
const ECHO: u8 = b'E';

/// Run `rawtcp-peer`.
pub fn run_peer(a: &PeerArgs) -> anyhow::Result<()> {
    if let Some(addr) = &a.listen {
        let listener = TcpListener::bind(addr.as_str()).with_context(|| format!("binding {addr}"))?;
        println!("gradsync-bench listening on {}", listener.local_addr()?);
        std::io::stdout().flush()?;
        let limit = Duration::from_secs_f64(a.serve_s.max(1.0));
        std::thread::spawn(move || {
            std::thread::sleep(limit);
            std::process::exit(0);
        });
        for conn in listener.incoming() {
            let s = conn.context("accepting")?;
            std::thread::spawn(move || serve_one(s));
        }
        return Ok(());
    }
    let to = a.to.as_deref().context("rawtcp-peer needs --listen or --to")?;
    let addr: std::net::SocketAddr = to.parse().with_context(|| format!("--to {to}: not ADDR:PORT"))?;
    let connect = |kind: u8| -> anyhow::Result<TcpStream> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
            .with_context(|| format!("connecting to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.write_all(&[kind])?;
        Ok(s)
    };
    let mut samples = Vec::new();
    for _ in 0..a.rounds.max(1) {
        let mut s = connect(SINK)?;
        let (sent, t) = pump(&mut s, Duration::from_secs_f64(a.seconds))?;
        s.shutdown(std::net::Shutdown::Write)?;
        // The far end answers with what it received once everything has arrived.
        let mut got = [0u8; 8];
        s.read_exact(&mut got).context("reading the sink's count")?;
        let secs = t.elapsed().as_secs_f64();
        anyhow::ensure!(u64::from_le_bytes(got) >= sent, "the far end received less than was sent");
        samples.push(sent as f64 / secs);
    }
    let latency_s = ping(&mut connect(ECHO)?, a.pings).context("pinging the far end")?;
    println!("{}", serde_json::to_string(&PeerReading { samples, latency_s })?);
    Ok(())
}

/// The far end of one connection: drain a stream and answer with its byte count, or echo
/// 8-byte messages, until the peer closes.
fn serve_one(mut s: TcpStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_nodelay(true)?;
    let mut kind = [0u8; 1];
    s.read_exact(&mut kind)?;
    if kind[0] == SINK {
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf)? {
                0 => return s.write_all(&total.to_le_bytes()),
                n => total += n as u64,
            }
        }
    }
    echo(&mut s)
}

/// Send back every 8-byte message until the peer closes.
fn echo(s: &mut TcpStream) -> std::io::Result<()> {
    let mut buf = [0u8; 8];
    loop {
        match s.read_exact(&mut buf) {
            Ok(()) => s.write_all(&buf)?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// One socket end of an [`Exchange`], on its own thread for the whole run: `io` once per
/// exchange, between two waits on `barrier`, timed on this thread (when it began and when it
/// ended). After an error it only keeps to the barriers (its peer's read then fails on its
/// timeout) and returns the error at the end.
fn socket_end<'scope, F>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    barrier: &'scope std::sync::Barrier,
    rounds: usize,
    mut io: F,
) -> std::thread::ScopedJoinHandle<'scope, std::io::Result<Vec<(Instant, Instant)>>>
where
    F: FnMut() -> std::io::Result<()> + Send + 'scope,
{
    scope.spawn(move || {
        let mut failed = None;
        let mut spans = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            barrier.wait();
            let t = Instant::now();
            if failed.is_none() {
                failed = io().err();
            }
            spans.push((t, Instant::now()));
            barrier.wait();
        }
        failed.map_or(Ok(spans), Err)
    })
}

/// Each round's milliseconds from the first socket end's start to the last one's end, over
/// every end's `(start, end)` per round. Timed by the ends themselves, not by the thread that
/// releases them: on a loaded machine that thread may run again only after most of the
/// exchange is done.
fn round_ms(ends: &[Vec<(Instant, Instant)>], rounds: usize) -> Vec<f64> {
    (0..rounds)
        .filter_map(|r| {
            let first = ends.iter().filter_map(|e| e.get(r)).map(|s| s.0).min()?;
            let last = ends.iter().filter_map(|e| e.get(r)).map(|s| s.1).max()?;
            Some((last - first).as_secs_f64() * 1e3)
        })
        .collect()
}

/// A parameter-server step's traffic moved by plain sockets, with no framing, no copies
/// beyond the kernel's and no update: the floor of what any transport can do with the same
/// bytes in the same topology on this machine.
///
/// `workers` workers each hold a `bytes`-byte gradient and parameter buffer; `shards` servers
/// each own a contiguous range of it. Every (worker, shard) pair has a socket for the push
/// and another for the pull, as gradsync's worker does. In one exchange every worker sends
/// each shard its range of the gradient (received into that shard's per-worker buffer) and
/// every shard sends each worker its range of the parameters (received in place), both
/// directions at once, one thread per socket end.
pub struct Exchange {
    /// Per pair (worker-major): the push socket (worker end, shard end) and the pull socket
    /// (shard end, worker end).
    pairs: Vec<[(TcpStream, TcpStream); 2]>,
    workers: usize,
    shards: usize,
    bytes: usize,
}

impl Exchange {
    /// Connect every pair through `hosts`: shard `j` on host `j`, worker `i` on host
    /// `first_worker + i`; each worker dials both of its sockets to a shard, as gradsync's does.
    pub fn new(
        bytes: usize,
        workers: usize,
        shards: usize,
        hosts: Hosts<'_>,
        first_worker: usize,
    ) -> anyhow::Result<Exchange> {
        let mut pairs = Vec::with_capacity(workers * shards);
        for p in 0..workers * shards {
            let (worker, shard) = (first_worker + p / shards, p % shards);
            let push = hosts.pair(worker, shard)?;
            let (at_worker, to_worker) = hosts.pair(worker, shard)?;
            pairs.push([push, (to_worker, at_worker)]);
        }
        Ok(Exchange { pairs, workers, shards, bytes })
    }

    /// Shard `k`'s byte range of a buffer.
    fn range(&self, k: usize) -> std::ops::Range<usize> {
        self.bytes * k / self.shards..self.bytes * (k + 1) / self.shards
    }

    /// Time `steps` exchanges after `warmup` more (which first touch the buffers): each one's
    /// milliseconds, and the CPU they took.
    pub fn run(&mut self, warmup: usize, steps: usize) -> anyhow::Result<Timed> {
        let (w, k) = (self.workers, self.shards);
        // Allocated as the parameter server's and the engine's buffers are (huge pages where
        // they span them), so the two rows differ in what they do, not in their memory.
        let grads: Vec<Vec<u8>> = (0..w).map(|_| filled(self.bytes, 1)).collect();
        let mut params: Vec<Vec<u8>> = (0..w).map(|_| filled(self.bytes, 0)).collect();
        let server_params: Vec<Vec<u8>> = (0..k).map(|j| filled(self.range(j).len(), 2)).collect();
        let mut received: Vec<Vec<u8>> = (0..w * k).map(|p| filled(self.range(p % k).len(), 0)).collect();
        let rounds = warmup + steps;
        let mut ends = Vec::with_capacity(4 * w * k);
        let mut cpu = f64::NAN;
        // One thread per socket end for the whole run (spawning them per exchange would add
        // about half a millisecond to a 16-thread exchange); a barrier starts and ends each.
        let barrier = std::sync::Barrier::new(4 * w * k + 1);
        std::thread::scope(|scope| -> anyhow::Result<()> {
            let ranges: Vec<_> = (0..k).map(|j| self.range(j)).collect();
            let mut dsts: Vec<&mut [u8]> = Vec::new();
            for p in params.iter_mut() {
                let mut rest = p.as_mut_slice();
                for r in &ranges {
                    let (mine, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
                    dsts.push(mine);
                    rest = tail;
                }
            }
            let barrier = &barrier;
            let mut handles = Vec::new();
            for (((pair, got), dst), p) in self.pairs.iter_mut().zip(&mut received).zip(dsts).zip(0..) {
                let (i, j) = (p / k, p % k);
                let [(push_tx, push_rx), (pull_tx, pull_rx)] = pair;
                let src = &grads[i][ranges[j].clone()];
                let back = &server_params[j][..];
                handles.push(socket_end(scope, barrier, rounds, move || push_tx.write_all(src)));
                handles.push(socket_end(scope, barrier, rounds, move || push_rx.read_exact(got)));
                handles.push(socket_end(scope, barrier, rounds, move || pull_tx.write_all(back)));
                handles.push(socket_end(scope, barrier, rounds, move || pull_rx.read_exact(dst)));
            }
            for round in 0..rounds {
                if round == warmup {
                    // Every socket thread waits at the barrier: nothing of the warm-up is left.
                    cpu = process_cpu_seconds();
                }
                barrier.wait();
                barrier.wait();
            }
            cpu = process_cpu_seconds() - cpu;
            for h in handles {
                ends.push(
                    h.join()
                        .map_err(|_| anyhow::anyhow!("a socket thread panicked"))?
                        .context("plain sockets")?,
                );
            }
            Ok(())
        })?;
        anyhow::ensure!(
            params.iter().flatten().all(|&b| b == 2) && received.iter().flatten().all(|&b| b == 1),
            "plain sockets delivered other bytes than were sent"
        );
        Ok(Timed { ms: round_ms(&ends, rounds).split_off(warmup), cpu_ms: cpu * 1e3 / steps.max(1) as f64 })
    }
}

/// What [`Exchange::run`] measured.
#[derive(Debug, Clone)]
pub struct Timed {
    /// Each timed exchange's milliseconds.
    pub ms: Vec<f64>,
    /// CPU milliseconds (user + system, every thread of the process) per timed exchange.
    pub cpu_ms: f64,
}

/// CPU seconds (user + system) this process has used, all threads.
pub fn process_cpu_seconds() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF always exists.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
    if rc != 0 {
        return f64::NAN;
    }
    // SAFETY: initialised by the successful call above.
    let u = unsafe { u.assume_init() };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Core-seconds the whole machine has spent busy (user, nice, system, interrupts; not idle,
/// I/O wait or steal) since boot, from `/proc/stat`: what a run costs, including the kernel's
/// work for it that no process is charged with (softirqs run by `ksoftirqd`, emulated links).
/// `None` where there is no `/proc/stat`.
pub fn machine_busy_seconds() -> Option<f64> {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    busy_from_stat(&std::fs::read_to_string("/proc/stat").ok()?, ticks as f64)
}

/// The busy seconds in `/proc/stat`'s text at `ticks` a second: the first (`cpu `) line's
/// user, nice, system, irq and softirq fields (guest time is inside user).
fn busy_from_stat(stat: &str, ticks: f64) -> Option<f64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line.split_whitespace().skip(1).map(str::parse).collect::<Result<_, _>>().ok()?;
    let busy = [0, 1, 2, 5, 6].iter().map(|&i| f.get(i).copied()).sum::<Option<u64>>()?;
    (ticks > 0.0).then(|| busy as f64 / ticks)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn busy_time_is_user_nice_system_irq_and_softirq() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let stat = "cpu  100 20 300 5000 70 8 9 400 50 0\ncpu0 50 10 150 2500 35 4 5 200 25 0\n";
        assert_eq!(super::busy_from_stat(stat, 100.0), Some(4.37));
        assert_eq!(super::busy_from_stat("cpu  1 2\n", 100.0), None, "a line too short");
        assert_eq!(super::busy_from_stat("intr 5\n", 100.0), None, "no cpu line");
        assert!(super::machine_busy_seconds().is_some_and(|b| b > 0.0), "this Linux machine has /proc/stat");
    }

    #[test]
    fn latency_is_small_and_positive() {
        let a = super::latency("127.0.0.1", 50).unwrap();
        assert!(a > 0.0 && a < 0.1, "loopback one-way latency {a} s");
    }

    #[test]
    fn exchange_moves_every_byte() {
        let mut x = super::Exchange::new(1 << 20, 2, 2, crate::hosts::Hosts::Loopback, 2).unwrap();
        let t = x.run(0, 2).unwrap();
        assert_eq!(t.ms.len(), 2);
        assert!(t.ms.iter().all(|ms| *ms > 0.0));
        assert!(t.cpu_ms > 0.0, "{t:?}");
    }

    /// The CPU of the timed exchanges leaves out the warm-up (here three exchanges, which also
    /// first touch the buffers) and the buffers' allocation: it fits in the cores over the
    /// timed exchange's own time.
    #[test]
    fn the_exchange_cpu_is_the_timed_exchanges_alone() {
        let mut x = super::Exchange::new(16 << 20, 1, 1, crate::hosts::Hosts::Loopback, 1).unwrap();
        let t = x.run(3, 1).unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(
            t.cpu_ms <= cores * t.ms[0] * 1.5 + 5.0,
            "{t:?}: more CPU than {cores} cores have in the exchange"
        );
    }

    /// A round spans from the earliest start to the latest end of any socket end, whatever
    /// order the ends ran in.
    #[test]
    fn a_round_spans_every_socket_end() {
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        let ends = vec![vec![(at(5), at(9)), (at(20), at(21))], vec![(at(2), at(4)), (at(22), at(30))]];
        let ms = super::round_ms(&ends, 2);
        assert_eq!(ms.len(), 2);
        assert!((ms[0] - 7.0).abs() < 1e-6 && (ms[1] - 10.0).abs() < 1e-6, "{ms:?}");
    }

    #[test]
    fn measures_something_positive() {
        let y = super::Yardstick::loopback("127.0.0.1", 3, std::time::Duration::from_millis(100)).unwrap();
        assert_eq!(y.samples.len(), 3);
        let (lo, hi) = y.range();
        assert!(lo > 1e6 && lo <= y.median() && y.median() <= hi, "{y:?}");
        assert!(y.describe().contains("median of 3"), "{}", y.describe());
        let even = super::Yardstick { samples: vec![4.0, 1.0, 3.0, 2.0] };
        assert_eq!((even.median(), even.range()), (2.5, (1.0, 4.0)));
    }

    /// Several streams at once: one sum per round, every stream's bytes counted.
    #[test]
    fn concurrent_streams_are_summed() {
        let d = std::time::Duration::from_millis(100);
        let y = super::Yardstick::loopback_streams("127.0.0.1", 3, 2, d).unwrap();
        assert_eq!(y.samples.len(), 2);
        assert!(y.range().0 > 1e6, "{y:?}");
        assert!(super::Yardstick::loopback_streams("127.0.0.1", 0, 1, d).is_err());
    }

    #[test]
    fn even_count_median() {
        let even = super::Yardstick { samples: vec![4.0, 1.0, 3.0, 2.0] };
        assert_eq!((even.median(), even.range()), (2.5, (1.0, 4.0)));
    }
}
