//! `gradsync-bench collective`: an nccl-tests-style table for all-reduce (size, time, algbw,
//! busbw, wrong values) from 8 B to 256 MB over 2 to 8 ranks, per backend and, for the TCP
//! backend, per transport (sockets only; `auto`, which on one host means shared memory),
//! beside the raw TCP bandwidth measured in the same run and PyTorch gloo on the same sizes.
//!
//! Every rank is a process of its own by default, gradsync's and gloo's alike, so the table
//! compares like with like: this binary starts itself once per rank (the hidden
//! `collective-rank` subcommand) and `bench/pytorch/allreduce.py` once per gloo rank. Rank 0
//! binds the rendezvous store first and prints where it listens; the other ranks are started
//! with that address (no sleeping, no port guessing). With `--threads` gradsync's ranks are
//! threads of this process instead (labelled so in the table; gloo stays in processes).
//! With `--link-gbit`, each rank runs on an emulated host of its own (a network namespace,
//! links shaped with tc; see [`gradsync_compare::net`]), so no two ranks share memory; with
//! `--ranks-per-host N` as well, ranks `0..N` share the first host, `N..2N` the second, and so
//! on (torchrun's numbering), and `--hierarchy off,auto` puts the flat socket ring beside the
//! hierarchical all-reduce (reduce inside each host, ring among the hosts' leaders, broadcast
//! inside) in the same rounds.
//!
//! Rounds are interleaved (every backend once per round, in turn) and each size's median over
//! rounds is reported, so a burst of other load on the machine touches every backend alike.
//! Definitions follow nccl-tests: algbw = S / t, busbw = algbw * 2(n-1)/n.
//!
//! Here: the timing of one rank, the threads mode, the rounds and the table. `measure.rs`:
//! what they are made of (the flags, a measured row, the machine's busy time, the series);
//! `processes.rs`: starting the ranks as processes (gradsync's and gloo's), on loopback or on
//! emulated hosts, and reading back what each measured; `plain.rs`: the bytes of a ring
//! all-reduce streamed over plain sockets, the yardstick row.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::Context;
use gradsync_core::device::Cuda;
use gradsync_worker::collective::{After, Collective, Hierarchy, Nccl, RingConfig, TcpComm, Transport, nccl};
use gradsync_worker::rendezvous::{RendezvousConfig, join_with_store};

use gradsync_compare::hosts::Hosts;
use gradsync_compare::net::{self, Cluster, Shape};
use gradsync_compare::rawtcp::Yardstick;
use gradsync_compare::table::{Table, median, spread};

mod measure;
mod plain;
mod processes;

use measure::{Busy, RANK_TIMEOUT, Ran, Row, Series, busbw, busy_per_gb, sizes, slowest};
pub use measure::{CollectiveArgs, RankArgs};

use processes::{Place, find_python, gloo, plain_processes, tcp_processes};

fn ring_config(
    chunk_kb: Option<usize>,
    socket_buffer_kb: usize,
    transport: Transport,
    hierarchy: Hierarchy,
) -> RingConfig {
    RingConfig {
        socket_buffer: (socket_buffer_kb > 0).then_some(socket_buffer_kb << 10),
        transport,
        hierarchy,
        timeout: RANK_TIMEOUT,
        ..RingConfig::default()
    }
    .with_chunk_kb(chunk_kb)
}

/// Rank `r`'s own contribution to the checked all-reduce at element `i`: varied along the
/// buffer (so that a chunk summed into the wrong place is caught), small integers (so that
/// every sum is exact).
fn input(r: usize, i: usize) -> f32 {
    ((r + 1) + (i * 7 + r * 3) % 13) as f32
}

/// Time all-reduce on one communicator (one rank): per size, check one reduction against the
/// expected sum, then time `iters` of them between barriers.
fn time_rank(
    c: &mut dyn Collective,
    sizes: &[usize],
    budget: usize,
    mut each: impl FnMut(&Row),
) -> anyhow::Result<Vec<Row>> {
    let (r, w) = (c.rank(), c.world_size());
    let mut rows = Vec::new();
    for &bytes in sizes {
        let n = bytes / 4;
        // As the training's gradient buffer is allocated (huge pages where it spans them).
        let mut buf: Vec<f32> = gradsync_core::heap::zeros(n);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = input(r, i);
        }
        c.all_reduce(&mut buf)?;
        let want = |i: usize| (0..w).map(|q| input(q, i)).sum::<f32>();
        let wrong = buf.iter().enumerate().filter(|&(i, &v)| v != want(i)).count();
        let iters = (budget / bytes.max(1)).clamp(3, 200);
        c.barrier()?;
        let (t, busy) = (Instant::now(), Busy::start(r));
        for _ in 0..iters {
            // Values grow (to infinity, eventually); adds cost the same either way.
            c.all_reduce(&mut buf)?;
        }
        let secs = t.elapsed().as_secs_f64() / iters as f64;
        let row = Row { bytes: n * 4, secs, wrong, busy: busy.per(iters) };
        each(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// `gradsync-bench collective-rank`: join the ring, say which transport it runs on, then time
/// every size, one JSON line each, flushed as they come.
pub fn run_rank(a: &RankArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let listener = if a.rank == 0 {
        let l = TcpListener::bind(&a.master).with_context(|| format!("binding the store at {}", a.master))?;
        let addr = l.local_addr()?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::json!({ "listening": addr.to_string() }))?;
        out.flush()?;
        Some((l, addr.to_string()))
    } else {
        None
    };
    let rc = RendezvousConfig {
        master: listener.as_ref().map_or_else(|| a.master.clone(), |(_, addr)| addr.clone()),
        rank: a.rank,
        world: a.world,
        fingerprint: "bench".into(),
        token: None,
        timeout: RANK_TIMEOUT,
        nccl: false,
        generation: 0,
    };
    let j = join_with_store(&rc, listener.map(|(l, _)| l))?;
    let print = |row: &Row| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", serde_json::to_string(row).unwrap_or_default());
        let _ = out.flush();
    };
    if a.plain {
        let right = j.mesh.addrs[(a.rank + 1) % a.world];
        let buffer = (a.socket_buffer_kb > 0).then_some(a.socket_buffer_kb << 10);
        let (mut tx, mut rx) = plain::connect(&j.listener, (a.rank, a.world), right, buffer, RANK_TIMEOUT)?;
        plain::time_rank(
            (&mut tx, &mut rx),
            (a.rank, a.world),
            &a.sizes,
            a.budget_bytes,
            RANK_TIMEOUT,
            print,
        )?;
        return Ok(());
    }
    let cfg = ring_config(a.chunk_kb, a.socket_buffer_kb, a.transport, a.hierarchy);
    let mut c = TcpComm::connect(j.listener, &j.mesh, cfg)?;
    let said = serde_json::json!({ "transport": c.transport().name(), "hosts": c.hosts(), "chunk_kb": c.chunk_bytes() >> 10 });
    println!("{said}");
    time_rank(&mut c, &a.sizes, a.budget_bytes, print)?;
    Ok(())
}

/// Run the TCP backend on `s`'s transport and hierarchy with `world` rank threads; the
/// slowest rank's time per size, and what the ranks ended up running.
fn tcp_threads(
    world: usize,
    sizes: &[usize],
    a: &CollectiveArgs,
    s: &Series,
) -> anyhow::Result<(Vec<Row>, Ran)> {
    let (transport, hierarchy) = (s.transport.unwrap_or_default(), s.hierarchy);
    let store = TcpListener::bind("127.0.0.1:0")?;
    let master = store.local_addr()?.to_string();
    let mut store = Some(store);
    let ring = ring_config(a.chunk_kb, a.socket_buffer_kb, transport, hierarchy);
    let per_rank: Vec<anyhow::Result<(Vec<Row>, Ran)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let rc = RendezvousConfig {
                    master: master.clone(),
                    rank,
                    world,
                    fingerprint: "bench".into(),
                    token: None,
                    timeout: RANK_TIMEOUT,
                    nccl: false,
                    generation: 0,
                };
                let (l, ring) = (if rank == 0 { store.take() } else { None }, ring.clone());
                s.spawn(move || -> anyhow::Result<(Vec<Row>, Ran)> {
                    let j = join_with_store(&rc, l)?;
                    let mut c = TcpComm::connect(j.listener, &j.mesh, ring)?;
                    let ran = Ran {
                        transport: c.transport(),
                        hosts: c.hosts(),
                        chunk_kb: Some(c.chunk_bytes() >> 10),
                    };
                    Ok((time_rank(&mut c, sizes, a.budget_bytes, |_| {})?, ran))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let mut ran = Ran { transport, hosts: None, chunk_kb: None };
    let mut all = Vec::new();
    for r in per_rank {
        let (rows, x) = r?;
        ran = x;
        all.push(rows);
    }
    Ok((slowest(all)?, ran))
}

/// NCCL at world size 1 (one GPU here): what the library costs with no peer, measured as
/// nccl-tests measures it. Each size's buffer lives in GPU memory: it is copied in once,
/// checked after one all-reduce, and then `iters` all-reduces are queued back to back on
/// NCCL's stream, with no copy to or from the host and no wait on the host in between; the
/// time is the GPU's, between two CUDA events recorded on that stream around them.
pub fn nccl_single(sizes: &[usize], budget: usize) -> anyhow::Result<Vec<Row>> {
    let id = nccl::unique_id()?;
    let mut c = Nccl::new(0, 0, 1, &id, Duration::from_secs(60))?;
    let stream = c.stream().clone();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let n = bytes / 4;
        let host: Vec<f32> = (0..n).map(|i| input(0, i)).collect();
        let mut buf = stream.zeros(n)?;
        stream.upload(&host, &mut buf, 0).context("copying the buffer to the GPU")?;
        let (ptr, _) = Cuda::raw_range(&buf, 0..n);
        // SAFETY: `buf` holds n values on this communicator's GPU and outlives every wait
        // below (an error returns only after the communicator was aborted and drained).
        unsafe { c.all_reduce_device_after(ptr, n, After::Stream(&stream)) }?;
        c.wait_all()?;
        let mut back = vec![0.0f32; n];
        stream.download(&buf, 0..n, &mut back).context("copying the result back")?;
        // One rank: the sum is its own input.
        let wrong = back.iter().enumerate().filter(|&(i, &v)| v != input(0, i)).count();
        let iters = (budget / bytes.max(1)).clamp(3, 200);
        let start = stream.record_timed().context("recording the start event")?;
        for _ in 0..iters {
            // SAFETY: as above.
            unsafe { c.all_reduce_device_after(ptr, n, After::Stream(&stream)) }?;
        }
        let end = stream.record_timed().context("recording the end event")?;
        c.wait_all()?;
        let ms = start.elapsed_ms(&end).context("reading the events' times")?;
        rows.push(Row { bytes: n * 4, secs: f64::from(ms) / 1e3 / iters as f64, wrong, busy: None });
    }
    Ok(rows)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MB", b >> 20),
        b if b >= 1 << 10 => format!("{} KB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Each series' times per round, by size (keyed by the round, so that a round one series
/// lost, a gloo run that failed, leaves no gap that would pair the others' rounds wrongly);
/// and the transport and all-reduce labels it ended up with.
#[derive(Default)]
struct Measured {
    secs: BTreeMap<usize, BTreeMap<usize, f64>>,
    busy: BTreeMap<usize, Vec<f64>>,
    wrong: BTreeMap<usize, usize>,
    label: String,
    path: String,
}

impl Measured {
    /// `rows` as measured in round `round`.
    fn add(&mut self, round: usize, rows: &[Row]) {
        for r in rows {
            self.secs.entry(r.bytes).or_default().insert(round, r.secs);
            if let Some(b) = r.busy {
                self.busy.entry(r.bytes).or_default().push(b);
            }
            *self.wrong.entry(r.bytes).or_default() += r.wrong;
        }
    }

    /// The median time per size over rounds.
    fn medians(&self) -> BTreeMap<usize, f64> {
        self.secs.iter().map(|(&b, v)| (b, median(&v.values().copied().collect::<Vec<_>>()))).collect()
    }

    /// The machine's busy core-seconds per GB moved between ranks for `bytes`, median over
    /// rounds, as a cell ("-" where nobody measured it).
    fn busy_cell(&self, bytes: usize, world: usize) -> String {
        self.busy
            .get(&bytes)
            .filter(|v| !v.is_empty())
            .and_then(|v| busy_per_gb(median(v), bytes, world))
            .map_or_else(|| "-".to_string(), |x| format!("{x:.2}"))
    }

    /// How many times faster than `base` each round ran `bytes` (the rounds interleave, so
    /// round `i` of both saw the same machine), over the rounds both have: median, least and
    /// most, `None` if they share none.
    fn speedup_over(&self, base: &Measured, bytes: usize) -> Option<(f64, f64, f64)> {
        let (mine, theirs) = (self.secs.get(&bytes)?, base.secs.get(&bytes)?);
        let r: Vec<f64> = mine.iter().filter_map(|(round, m)| theirs.get(round).map(|t| t / m)).collect();
        spread(&r)
    }
}

/// Run the benchmark and print its table.
pub fn run(a: &CollectiveArgs) -> anyhow::Result<()> {
    check(a)?;
    let per_host = a.ranks_per_host as usize;
    let sizes = sizes(a);
    let python = if a.no_gloo { None } else { find_python(a)? };
    let (yard, clusters) = yardstick(a, per_host)?;
    let raw = yard.median() / 1e9;
    let (ranks_as, link) = match (a.threads, a.link_gbit) {
        (true, _) => ("threads", "loopback".to_string()),
        (false, None) => ("processes", "loopback".to_string()),
        (false, Some(g)) if per_host > 1 => {
            ("processes", format!("emulated {g} Gbit/s hosts, {per_host} ranks each"))
        }
        (false, Some(g)) => ("processes", format!("emulated {g} Gbit/s hosts")),
    };
    println!("raw TCP, one stream ({link}), measured now: {}", yard.describe());
    let mut t = Table::new(&[
        "ranks",
        "ranks as",
        "backend",
        "transport",
        "all-reduce",
        "size",
        "time us",
        "algbw GB/s",
        "busbw GB/s",
        "busbw/raw",
        "of plain",
        "gloo busbw",
        "vs gloo",
        "vs flat ring",
        "#wrong",
        "CPU s/GB",
    ]);
    for &world in &a.ranks {
        let place = match clusters.get(&world) {
            Some(c) => Place::Emulated(c, per_host),
            None => Place::Loopback,
        };
        let rounds = measure_rounds(a, world, &sizes, place, python.as_ref())?;
        rounds.rows(&mut t, Shown { world, ranks_as, raw, rounds: a.rounds });
    }
    print!("{}", t.render());
    println!(
        "median of {} interleaved rounds; busbw = algbw * 2(n-1)/n (nccl-tests); busbw/raw: link \
         efficiency against one raw TCP stream; plain: plain sockets streaming the bytes a ring \
         all-reduce sends per rank (2(n-1)/n of the buffer) to the right neighbour while draining \
         as many from the left, nothing computed, one process per rank: what these sockets carry \
         in this topology with nothing else to do (a yardstick, not a bound: a library that moves \
         bytes better can pass it; its vs gloo: how far above gloo the bare sockets go); of \
         plain: busbw over plain's, median over rounds (least-most); vs gloo: our busbw over PyTorch gloo's, the \
         ratio of the medians, then the least and most of the rounds' own ratios (gloo's ranks are always \
         processes); vs flat ring: a hierarchical all-reduce's speed over the flat \
         ring's (--hierarchy off, same transport), median over rounds (least-most); ranks as: one process per rank, or threads of this \
         process; transport: what the TCP backend's ring ran on (tcp: sockets; auto (shm): shared \
         memory, chosen because every rank is on this host; in a hierarchical all-reduce, between \
         the ranks of one host); all-reduce: --hierarchy and what ran (ring: one flat ring; hier: \
         reduce inside each host, ring among one leader per host, broadcast inside); CPU s/GB: \
         core-seconds the whole machine was busy (/proc/stat: user, system, interrupts, every \
         process and the kernel's own threads) per GB an all-reduce moves between ranks \
         (2(n-1) x the buffer), median over rounds, measured by rank 0 over its timed loop: \
         where the ranks fill the cores, busbw follows it. nccl: buffers resident in GPU memory, \
         all-reduces queued back to back on NCCL's stream and timed by CUDA events around them \
         (nccl-tests' way; no host copy, no host wait in the timed loop).",
        a.rounds
    );
    Ok(())
}

/// The flags that do not go together, refused.
fn check(a: &CollectiveArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(
        !(a.threads && a.link_gbit.is_some()),
        "--threads and --link-gbit do not go together: emulated hosts need one process each"
    );
    anyhow::ensure!(
        a.ranks_per_host == 1 || a.link_gbit.is_some(),
        "--ranks-per-host {} needs --link-gbit: without emulated hosts every rank is on this one",
        a.ranks_per_host
    );
    Ok(())
}

/// The raw-TCP yardstick the table is read against: over loopback, or with `--link-gbit`
/// between two emulated hosts of the clusters made for each rank count (`per_host` ranks a
/// host), which are returned with it.
fn yardstick(a: &CollectiveArgs, per_host: usize) -> anyhow::Result<(Yardstick, BTreeMap<usize, Cluster>)> {
    let each = Duration::from_secs_f64(a.raw_secs);
    let mut clusters = BTreeMap::new();
    let yard = match a.link_gbit {
        None => Yardstick::loopback("127.0.0.1", 3, each)?,
        Some(gbit) => {
            net::guard("gradsync-bench collective");
            let shape = Shape::at_rate(gbit * 1e9);
            for &w in &a.ranks {
                clusters.insert(w, Cluster::create(w.div_ceil(per_host).max(2), shape)?);
            }
            let c = clusters.values().next().context("no rank counts")?;
            Yardstick::measure(3, each, || Hosts::Emulated(c).pair(0, 1))?
        }
    };
    Ok((yard, clusters))
}

/// The series `--backend` asks for with `world` ranks: the TCP backend once per transport and
/// hierarchy, NCCL at one rank where a GPU is there (said, and left out, otherwise).
fn series_for(a: &CollectiveArgs, world: usize) -> anyhow::Result<Vec<Series>> {
    let mut series: Vec<Series> = Vec::new();
    for b in &a.backend {
        match b.as_str() {
            "tcp" => series.extend(a.transport.iter().flat_map(|&t| {
                a.hierarchy.iter().map(move |&h| Series {
                    backend: b.clone(),
                    transport: Some(t),
                    hierarchy: h,
                })
            })),
            "nccl" => match nccl::available() {
                Err(e) => eprintln!("gradsync-bench collective: NCCL skipped ({world} ranks): {e}"),
                Ok(()) if world > 1 => eprintln!(
                    "gradsync-bench collective: NCCL with {world} ranks needs {world} GPUs \
                     (NCCL refuses two ranks on one GPU); measured at 1 rank only"
                ),
                Ok(()) => {
                    series.push(Series { backend: b.clone(), transport: None, hierarchy: Hierarchy::Off })
                }
            },
            other => anyhow::bail!("--backend {other}: expected tcp or nccl"),
        }
    }
    Ok(series)
}

/// What the rounds of one rank count measured: every series, gloo and plain sockets.
struct Rounds {
    series: Vec<Series>,
    measured: Vec<Measured>,
    gloo: Measured,
    plain: Measured,
}

/// Every round of `world` ranks placed by `place`: each series in turn, then plain sockets and
/// gloo (a gloo failure fails the benchmark only when its Python was given).
fn measure_rounds(
    a: &CollectiveArgs,
    world: usize,
    sizes: &[usize],
    place: Place,
    python: Option<&processes::Torch>,
) -> anyhow::Result<Rounds> {
    let series = series_for(a, world)?;
    let mut measured: Vec<Measured> = series.iter().map(|_| Measured::default()).collect();
    let mut gloo_m = Measured::default();
    let mut plain_m = Measured::default();
    let plain = !a.no_plain && a.backend.iter().any(|b| b == "tcp");
    for round in 0..a.rounds {
        for (s, m) in series.iter().zip(&mut measured) {
            let (rows, label, path) = measure_series(a, s, world, sizes, place)?;
            m.add(round, &rows);
            m.label = label;
            m.path = path;
        }
        if plain {
            plain_m.add(
                round,
                &plain_processes(world, sizes, a, place)
                    .with_context(|| format!("plain sockets, {world} ranks, round {round}"))?,
            );
        }
        if let Some(torch) = python {
            match gloo(torch, world, sizes, a, place) {
                Ok(rows) => gloo_m.add(round, &rows),
                Err(e) if torch.required => {
                    return Err(e.context(format!(
                        "gloo, {world} ranks, round {round} ({} with {})",
                        torch.python.display(),
                        torch.script.display()
                    )));
                }
                Err(e) => eprintln!("gradsync-bench collective: gloo, {world} ranks, round {round}: {e:#}"),
            }
        }
    }
    Ok(Rounds { series, measured, gloo: gloo_m, plain: plain_m })
}

/// One round of series `s`: its rows, the transport that ran (as asked, and what it became)
/// and the all-reduce's path (ring or hierarchy, chunk size).
fn measure_series(
    a: &CollectiveArgs,
    s: &Series,
    world: usize,
    sizes: &[usize],
    place: Place,
) -> anyhow::Result<(Vec<Row>, String, String)> {
    let (Some(tr), "tcp") = (s.transport, s.backend.as_str()) else {
        return Ok((nccl_single(sizes, a.budget_bytes)?, "-".to_string(), "-".to_string()));
    };
    let (rows, ran) =
        if a.threads { tcp_threads(world, sizes, a, s)? } else { tcp_processes(world, sizes, a, s, place)? };
    let label = if ran.transport == tr {
        tr.name().to_string()
    } else {
        format!("{} ({})", tr.name(), ran.transport.name())
    };
    let path = match ran.hosts {
        Some(h) => format!("{}: hier, {h} hosts", s.hierarchy.name()),
        None => format!("{}: ring", s.hierarchy.name()),
    };
    let path = match ran.chunk_kb {
        Some(kb) => format!("{path}, {kb} KiB chunks"),
        None => path,
    };
    Ok((rows, label, path))
}

/// How one rank count's rows are shown: its ranks, what they are, the raw link (GB/s) and the
/// rounds run.
#[derive(Clone, Copy)]
struct Shown<'a> {
    world: usize,
    ranks_as: &'a str,
    raw: f64,
    rounds: usize,
}

impl Rounds {
    /// The rows of every series, then gloo's and plain sockets': each beside gloo's busbw (for
    /// the plain row, how far above gloo the bare sockets go).
    fn rows(&self, t: &mut Table, how: Shown<'_>) {
        for (s, m) in self.series.iter().zip(&self.measured) {
            let ranks_as = if s.backend == "tcp" { how.ranks_as } else { "process" };
            let flat = self.flat_of(s, m);
            for (bytes, secs) in m.medians() {
                let vs_flat = flat
                    .and_then(|f| m.speedup_over(f, bytes))
                    .map(|(med, lo, hi)| format!("{med:.2}x ({lo:.2}-{hi:.2})"))
                    .unwrap_or_default();
                let cells = [ranks_as, &s.backend, &m.label, &m.path];
                t.row(self.cells(how, cells, m, bytes, secs, vs_flat));
            }
        }
        for (backend, m) in [("gloo", &self.gloo), ("plain", &self.plain)] {
            for (bytes, secs) in m.medians() {
                t.row(self.cells(how, ["processes", backend, "tcp", "-"], m, bytes, secs, String::new()));
            }
        }
    }

    /// One row of the table: `what` (ranks as, backend, transport, all-reduce), then the figures
    /// of `m` for `bytes` (median `secs`) and `vs_flat`.
    fn cells(
        &self,
        how: Shown<'_>,
        what: [&str; 4],
        m: &Measured,
        bytes: usize,
        secs: f64,
        vs_flat: String,
    ) -> Vec<String> {
        let world = how.world;
        let row = Row { bytes, secs, wrong: m.wrong.get(&bytes).copied().unwrap_or(0), busy: None };
        let bus = busbw(row.algbw(), world);
        let g = self.gloo_bus(bytes, world);
        vec![
            world.to_string(),
            what[0].to_string(),
            what[1].to_string(),
            what[2].to_string(),
            what[3].to_string(),
            human(row.bytes),
            format!("{:.1}", row.secs * 1e6),
            format!("{:.3}", row.algbw()),
            format!("{bus:.3}"),
            format!("{:.2}", bus / how.raw),
            self.of_plain(m, bytes),
            g.map(|g| format!("{g:.3}")).unwrap_or_default(),
            self.vs_gloo(m, bytes, bus, how),
            vs_flat,
            row.wrong.to_string(),
            m.busy_cell(bytes, world),
        ]
    }

    /// gloo's busbw for `bytes`, from its median time over rounds.
    fn gloo_bus(&self, bytes: usize, world: usize) -> Option<f64> {
        self.gloo.medians().get(&bytes).map(|&s| busbw(bytes as f64 / s / 1e9, world))
    }

    /// A row's busbw over plain sockets' in the same rounds, median (least-most), percent.
    fn of_plain(&self, m: &Measured, bytes: usize) -> String {
        m.speedup_over(&self.plain, bytes)
            .map(|(med, lo, hi)| format!("{:.0}% ({:.0}-{:.0})", med * 100.0, lo * 100.0, hi * 100.0))
            .unwrap_or_default()
    }

    /// A row's busbw over gloo's: the ratio of the medians, and beside it the least and most
    /// of the rounds' own ratios (none for gloo's own row, or after one round).
    fn vs_gloo(&self, m: &Measured, bytes: usize, bus: f64, how: Shown<'_>) -> String {
        let Some(g) = self.gloo_bus(bytes, how.world) else { return String::new() };
        match m.speedup_over(&self.gloo, bytes) {
            Some((_, lo, hi)) if how.rounds > 1 && !std::ptr::eq(m, &self.gloo) => {
                format!("{:.2}x ({lo:.2}-{hi:.2})", bus / g)
            }
            _ => format!("{:.2}x", bus / g),
        }
    }

    /// A hierarchical row's flat ring: the same backend and transport with --hierarchy off.
    fn flat_of(&self, s: &Series, m: &Measured) -> Option<&Measured> {
        let hier = m.path.contains("hier");
        self.series.iter().zip(&self.measured).find_map(|(f, fm)| {
            (hier && f.backend == s.backend && f.transport == s.transport && f.hierarchy == Hierarchy::Off)
                .then_some(fm)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(secs: f64) -> Vec<Row> {
        vec![Row { bytes: 64, secs, wrong: 0, busy: None }]
    }

    #[test]
    fn a_round_one_series_lost_is_left_out_of_the_pairs() {
        let (mut base, mut other) = (Measured::default(), Measured::default());
        for (round, secs) in [1.0, 2.0, 4.0].into_iter().enumerate() {
            base.add(round, &rows(secs));
        }
        // Round 1 failed for the other series: its rounds 0 and 2 pair with the base's 0 and 2.
        other.add(0, &rows(1.0));
        other.add(2, &rows(2.0));
        assert_eq!(other.speedup_over(&base, 64), Some((1.5, 1.0, 2.0)));
        assert_eq!(other.medians().get(&64), Some(&1.5));
        assert_eq!(other.speedup_over(&base, 128), None, "a size neither measured");
    }
}
