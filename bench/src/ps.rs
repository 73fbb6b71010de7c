//! `gradsync-bench ps`: parameter-server push+pull throughput under BSP for a range of model
//! sizes, worker counts and shard counts, with four rows side by side (tonic's default HTTP/2
//! settings; tuned windows and frames through tonic's codec; gradsync's transport, the tuned
//! settings with the bulk RPCs framed directly; the same pushing then pulling instead of both at
//! once, [`Row`]), against the raw TCP bandwidth of the same machine measured in the same run
//! and the same traffic over plain sockets in the same topology (the machine's floor for it).
//!
//! Servers and workers run in this process (each on a tokio runtime of its own, as separate
//! processes would; real loopback sockets); each
//! step every worker pushes its whole gradient to every shard and pulls every shard back, as
//! `gradsync-worker --mode ps` does (under BSP both at once: the pull streams the next version
//! as the servers produce it). The bound for one BSP step is two directions of
//! `max(S/B, W*S/(K*B))` (BytePS): a worker's link moves `S` each way, and a shard's link
//! moves `W*S/K` each way.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use gradsync_core::heap::filled;
use gradsync_core::model::{Fingerprint, Layout, ModelSpec};
use gradsync_proto::tuning::Tuning;
use gradsync_server::{Config, ParamServer, ShardSpec};
use gradsync_worker::ps::{PsClient, SharedGrads};
use tokio::net::TcpListener;

use gradsync_compare::hosts::Hosts;
use gradsync_compare::net::{Cluster, Shape};
use gradsync_compare::rawtcp::{Yardstick, process_cpu_seconds};
use gradsync_compare::table::{Table, median, ratio_cell};

/// Flags of `gradsync-bench ps`.
#[derive(Debug, Clone, Args)]
pub struct PsBenchArgs {
    /// Parameter buffer sizes, MB.
    #[arg(long, default_value = "4,16,64,256", value_delimiter = ',')]
    pub sizes_mb: Vec<usize>,
    /// Worker counts.
    #[arg(long, default_value = "1,2,4", value_delimiter = ',')]
    pub workers: Vec<usize>,
    /// Shard counts.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub shards: Vec<usize>,
    /// Timed steps per configuration (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed steps first: the first steps fault in and first touch every buffer.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Seconds of each raw TCP measurement (three before every worker/shard group; the
    /// median is the group's raw figure).
    #[arg(long, default_value_t = 0.3)]
    pub raw_secs: f64,
    /// Skip the plain-sockets row (the same traffic over plain TCP sockets, no PS).
    #[arg(long)]
    pub no_plain: bool,
    /// Only gradsync's transport (skip tonic's defaults and tonic's codec).
    #[arg(long)]
    pub tuned_only: bool,
    /// Only this row (e.g. for `perf stat` of one configuration).
    #[arg(long, value_enum)]
    pub only: Option<Row>,
    /// Payload bytes per chunk message (and BSP block), for every transport (default: chosen
    /// from each shard's size, as `gradsync-server` chooses it).
    #[arg(long, value_parser = clap::value_parser!(u32).range(4..=(16 << 20)))]
    pub chunk_bytes: Option<u32>,
    /// Put every shard and every worker on an emulated host of its own, each host's link shaped
    /// to this many Gbit/s each way (network namespaces and tc: needs root and iproute2), as
    /// the bound's model has it. The raw figure is then one plain TCP stream from a worker's
    /// host to a shard's. Without it everything runs on loopback.
    #[arg(long, value_parser = positive_gbit)]
    pub link_gbit: Option<f64>,
    /// Interleaved rounds: every row of a group once per round, in order; the table shows the
    /// median over rounds, and each ratio (x plain, CPU x plain, vs default) as the median of
    /// the rounds' own ratios with the least and most (default: 3, or 1 with `--quick`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: Option<u32>,
    /// A smoke test: 4 MB, 1-2 workers, 1-2 shards, 2 steps.
    #[arg(long)]
    pub quick: bool,
}

pub(crate) fn positive_gbit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("'{s}' is not a positive rate in Gbit/s")),
    }
}

/// A row of the table: a transport, pipelined or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Row {
    /// tonic's HTTP/2 defaults and codec.
    Default,
    /// gradsync's windows and frames, tonic's codec.
    TunedCodec,
    /// gradsync's transport, push and pull at once (pipelined BSP).
    Tuned,
    /// gradsync's transport, push then pull.
    TunedSerial,
}

impl Row {
    fn setup(self) -> (Tuning, bool) {
        match self {
            Row::Default => (Tuning::tonic_defaults(), false),
            Row::TunedCodec => (Tuning::tonic_codec(), false),
            Row::Tuned => (Tuning::tuned(), false),
            Row::TunedSerial => (Tuning::tuned(), true),
        }
    }
}

/// One measured configuration.
#[derive(Debug, Clone)]
struct Figure {
    step_ms: f64,
    /// Median over steps of the slowest worker's push (server wait included), pull, and the
    /// longest time a server held a push for the barrier and the update.
    push_ms: f64,
    pull_ms: f64,
    wait_ms: f64,
    /// CPU time (user + system, every thread of this process) per timed step.
    cpu_ms: f64,
}

/// `d` such that a `d x d` layer (plus bias) holds about `mb` MB of f32.
fn spec_for(mb: usize) -> ModelSpec {
    let values = (mb << 20) / 4;
    let d = (values as f64).sqrt().floor().max(2.0) as usize;
    ModelSpec::parse(&format!("{d}-{d}")).unwrap_or_else(|_| unreachable!("two positive widths parse"))
}

/// One worker/shard group of the grid, and where it runs: shard `j` on host `j`, worker `i` on
/// host `first_worker + i`; each row runs `warmup` untimed steps, then `steps` timed ones.
#[derive(Clone, Copy)]
struct Group<'a> {
    workers: usize,
    shards: usize,
    warmup: usize,
    steps: usize,
    hosts: Hosts<'a>,
    first_worker: usize,
    /// Payload bytes per chunk for every shard and worker (`None`: from each shard's size).
    chunk: Option<usize>,
}

async fn measure(spec: &ModelSpec, g: Group<'_>, tuning: Tuning, serial: bool) -> anyhow::Result<Figure> {
    let Group { workers, shards, warmup, steps, hosts, first_worker, chunk } = g;
    let total = Layout::new(spec).len;
    let fp = Fingerprint::new(spec, 1).text;
    let mut addrs = Vec::new();
    let mut stops = Vec::new();
    let mut tasks = Vec::new();
    let mut procs = Vec::new();
    for k in 0..shards {
        let mut cfg = Config::new(spec.clone(), 1);
        cfg.shard = ShardSpec { index: k, count: shards };
        cfg.tuning = tuning;
        cfg.tuning.chunk_bytes = chunk.unwrap_or_else(|| cfg.shard.chunk_bytes(total));
        cfg.worker_timeout = Duration::from_secs(120);
        let server = ParamServer::new(cfg)?;
        let listener = hosts.listen(k)?;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        addrs.push(listener.local_addr()?.to_string());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(tx);
        // Each shard on a runtime of its own, as `gradsync-server` runs (one thread per core).
        let process = tokio::runtime::Runtime::new()?;
        tasks.push(process.spawn(server.serve(listener, async move {
            let _ = rx.await;
        })));
        procs.push(process);
    }
    // Each worker's steps on a runtime of its own with two threads, as `gradsync-worker --mode
    // ps` runs its client: one runtime for every process would give them fewer threads than
    // separate processes have, and on a loaded machine a smaller share of the cores than the
    // plain row's thread per socket end. On loopback its connections live there too (their
    // frames read and written by the same threads as the worker's), as in the worker.
    let worker_rts: Vec<tokio::runtime::Runtime> = (0..workers)
        .map(|_| tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build())
        .collect::<Result<_, _>>()?;
    let mut clients = Vec::new();
    // On emulated hosts each worker's connections live on a runtime on its host, kept until
    // the end of the group.
    let mut runtimes = Vec::new();
    for (r, rt) in worker_rts.iter().enumerate() {
        let addrs = addrs.clone();
        let connect = async move {
            let mut c = PsClient::connect(&addrs, None, Duration::from_secs(120), tuning).await?;
            c.set_chunk_bytes(chunk);
            anyhow::Ok(c)
        };
        let mut c = match hosts.runtime(first_worker + r)? {
            Some(host) => {
                let c = host.handle.spawn(connect).await.context("connecting on the worker's host")??;
                runtimes.push(host);
                c
            }
            None => rt.spawn(connect).await.context("connecting")??,
        };
        clients.push(c.register(r, workers, &fp, total).await.map(|_| c)?);
    }
    // Each worker's gradient in a buffer its pushes send from without copying, as
    // `gradsync-worker --mode ps` sends its engine's, both allocated as the engine's are.
    let mut state: Vec<_> = clients
        .into_iter()
        .map(|c| (c, SharedGrads::new(filled(total, 1e-4f32)), filled(total, 0f32)))
        .collect();
    let (mut times, mut push, mut pull, mut wait) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut cpu = f64::NAN;
    for step in 0..warmup + steps {
        if step == warmup {
            // Warm-up steps first touch every buffer; what a step costs is measured after.
            cpu = process_cpu_seconds();
        }
        let t = Instant::now();
        let handles: Vec<_> = state
            .drain(..)
            .zip(&worker_rts)
            .map(|((mut c, mut g, mut p), rt)| {
                rt.spawn(async move {
                    // Where the worker writes its next gradient: in place once the last push
                    // has let go of the buffer (a copy otherwise, counted).
                    g.make_mut();
                    let (push, pull) = if serial {
                        let push = c.push_from(&g).await?;
                        (push, c.pull(&mut p).await?)
                    } else {
                        c.exchange_into(&g, &mut p).await?
                    };
                    let phases = [push.ms, pull.ms, push.wait_ms];
                    anyhow::Ok(((c, g, p), phases))
                })
            })
            .collect();
        let mut slowest = [0.0f64; 3];
        for h in handles {
            let (s, phases) = h.await.context("worker task")??;
            state.push(s);
            for (m, p) in slowest.iter_mut().zip(phases) {
                *m = m.max(p);
            }
        }
        if step >= warmup {
            times.push(t.elapsed().as_secs_f64() * 1e3);
            push.push(slowest[0]);
            pull.push(slowest[1]);
            wait.push(slowest[2]);
        }
    }
    let cpu_ms = (process_cpu_seconds() - cpu) * 1e3 / steps as f64;
    let copies: u64 = state.iter().map(|(_, g, _)| g.copies()).sum();
    if copies > 0 {
        eprintln!("gradsync-bench ps: a gradient buffer was still held by a push {copies} times, and copied");
    }
    for (c, ..) in &mut state {
        c.deregister().await?;
    }
    drop(state);
    for s in stops {
        let _ = s.send(());
    }
    for t in tasks {
        t.await.context("server task")??;
    }
    drop(runtimes);
    // Dropping a runtime inside this one's context would panic; everything on them is done.
    for r in procs.into_iter().chain(worker_rts) {
        r.shutdown_background();
    }
    Ok(Figure {
        step_ms: median(&times),
        push_ms: median(&push),
        pull_ms: median(&pull),
        wait_ms: median(&wait),
        cpu_ms,
    })
}

/// The plain-sockets row: the step's traffic over plain TCP sockets in the same topology
/// ([`gradsync_compare::rawtcp::Exchange`]); push and pull run at once, so both are the step's time.
fn plain_tcp(bytes: usize, g: Group<'_>) -> anyhow::Result<Figure> {
    let mut exchange =
        gradsync_compare::rawtcp::Exchange::new(bytes, g.workers, g.shards, g.hosts, g.first_worker)?;
    let timed = exchange.run(g.warmup, g.steps)?;
    let ms = median(&timed.ms);
    Ok(Figure { step_ms: ms, push_ms: ms, pull_ms: ms, wait_ms: 0.0, cpu_ms: timed.cpu_ms })
}

/// A row of the table as it runs: its label, its transport's tuning (`None`: plain sockets)
/// and whether it pushes then pulls rather than both at once.
type Setup = (String, Option<Tuning>, bool);

/// Run the benchmark and print its table.
pub fn run(a: &PsBenchArgs) -> anyhow::Result<()> {
    let (sizes, workers, shards, warmup, steps) = if a.quick {
        (vec![4], vec![1, 2], vec![1, 2], 1, 2)
    } else {
        (a.sizes_mb.clone(), a.workers.clone(), a.shards.clone(), a.warmup, a.steps.max(1))
    };
    let raw_secs = if a.quick { 0.1 } else { a.raw_secs };
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 }) as usize;
    anyhow::ensure!(
        sizes.iter().all(|&s| s > 0) && workers.iter().all(|&w| w > 0) && shards.iter().all(|&k| k > 0),
        "--sizes-mb, --workers and --shards take positive numbers"
    );
    gradsync_core::heap::keep_freed_memory();
    gradsync_core::heap::single_arena();
    // Shards on the first hosts, workers on the hosts after them.
    let first_worker = shards.iter().copied().max().unwrap_or(1);
    let cluster = emulated(a, first_worker + workers.iter().copied().max().unwrap_or(1))?;
    let hosts = cluster.as_ref().map_or(Hosts::Loopback, Hosts::Emulated);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let chunk = a.chunk_bytes.map(|c| c as usize);
    let rows = setups(a, chunk);
    let mut table = header();
    for &mb in &sizes {
        let spec = spec_for(mb);
        let bytes = Layout::new(&spec).len as f64 * 4.0;
        for &k in &shards {
            for &w in &workers {
                let group = Group { workers: w, shards: k, warmup, steps, hosts, first_worker, chunk };
                // Every row once per round, in the same order, so that round `i` of each saw
                // the same machine; ratios are taken within a round.
                let mut raws = Vec::new();
                let mut figs: Vec<Vec<Figure>> = vec![Vec::new(); rows.len()];
                for _ in 0..rounds {
                    // Measured again before every round: on a shared machine the link's speed
                    // drifts over a run, and the ratios must compare like with like. The
                    // median of three, from a worker's host to a shard's, the push's direction
                    // (on loopback both are 127.0.0.1).
                    let d = Duration::from_secs_f64(raw_secs);
                    raws.push(Yardstick::measure(3, d, || hosts.pair(first_worker, 0))?.median());
                    for ((row, tuning, serial), figs) in rows.iter().zip(&mut figs) {
                        let fig = match tuning {
                            None => plain_tcp(bytes as usize, group),
                            Some(t) => rt.block_on(measure(&spec, group, *t, *serial)),
                        }
                        .with_context(|| format!("{mb} MB, {w} workers, {k} shards, {row}"))?;
                        figs.push(fig);
                        eprint!(".");
                    }
                }
                group_rows(&mut table, &rows, &figs, median(&raws), bytes, (w, k));
            }
        }
    }
    eprintln!();
    notes(a, rounds, &table);
    Ok(())
}

/// With `--link-gbit`, `n` emulated hosts with links shaped to that rate; none on loopback.
fn emulated(a: &PsBenchArgs, n: usize) -> anyhow::Result<Option<Cluster>> {
    let Some(gbit) = a.link_gbit else { return Ok(None) };
    gradsync_compare::net::available().context("--link-gbit")?;
    gradsync_compare::net::guard("gradsync-bench ps");
    let shape = Shape::at_rate(gbit * 1e9);
    Ok(Some(Cluster::create(n, shape).context("--link-gbit: making the emulated hosts")?))
}

/// The rows each round runs, in order: the plain-sockets row first (no transport), then
/// gradsync's (a serial row is the same transport without the pipelined step, for the
/// comparison in one run), each with `chunk` bytes a chunk when given.
fn setups(a: &PsBenchArgs, chunk: Option<usize>) -> Vec<Setup> {
    let rows = match (a.only, a.tuned_only) {
        (Some(r), _) => vec![r],
        (None, true) => vec![Row::TunedSerial, Row::Tuned],
        (None, false) => vec![Row::Default, Row::TunedCodec, Row::TunedSerial, Row::Tuned],
    };
    let plain = (!a.no_plain && a.only.is_none()).then(|| ("plain tcp".to_string(), None, false));
    plain
        .into_iter()
        .chain(rows.into_iter().map(Row::setup).map(|(mut t, serial)| {
            t.chunk_bytes = chunk.unwrap_or(t.chunk_bytes);
            let name = if serial { format!("{} serial", t.name) } else { t.name.to_string() };
            (name, Some(t), serial)
        }))
        .collect()
}

/// The table's columns.
fn header() -> Table {
    Table::new(&[
        "MB",
        "workers",
        "shards",
        "transport",
        "ms/step",
        "push ms",
        "(wait)",
        "pull ms",
        "GB/s",
        "raw GB/s",
        "x raw",
        "bound ms",
        "x bound",
        "x plain",
        "CPU ms",
        "CPU x plain",
        "vs default",
    ])
}

/// The rows of one group (`bytes` a model, `w` workers, `k` shards) from every round's figures
/// `figs` of each row of `rows`, against the raw link `raw` (bytes per second).
fn group_rows(
    table: &mut Table,
    rows: &[Setup],
    figs: &[Vec<Figure>],
    raw: f64,
    bytes: f64,
    (w, k): (usize, usize),
) {
    let bound_ms = 2.0 * (bytes / raw).max(w as f64 * bytes / (k as f64 * raw)) * 1e3;
    // Each round's ratio of `f` between row `i` and row `base`.
    let per_round = |i: usize, base: Option<usize>, f: fn(&Figure) -> f64| -> Vec<f64> {
        base.map_or_else(Vec::new, |b| figs[i].iter().zip(&figs[b]).map(|(x, y)| f(x) / f(y)).collect())
    };
    let plain = rows.iter().position(|r| r.1.is_none());
    let default = rows.iter().position(|r| r.1.is_some_and(|t| t.name == Tuning::tonic_defaults().name));
    for (i, (name, ..)) in rows.iter().enumerate() {
        let mid = |f: fn(&Figure) -> f64| median(&figs[i].iter().map(f).collect::<Vec<_>>());
        let step_ms = mid(|f| f.step_ms);
        let gbs = 2.0 * w as f64 * bytes / (step_ms * 1e6);
        let vs = |base: Option<usize>, f: fn(&Figure) -> f64| {
            if base == Some(i) { String::new() } else { ratio_cell(&per_round(i, base, f), "") }
        };
        // How many times faster than tonic's defaults, per round (gradsync's rows).
        let faster = match default {
            Some(d) if d != i && rows[i].1.is_some() => {
                let r: Vec<f64> = per_round(d, Some(i), |f| f.step_ms);
                ratio_cell(&r, "x")
            }
            _ => String::new(),
        };
        table.row(vec![
            format!("{:.1}", bytes / 1e6),
            w.to_string(),
            k.to_string(),
            name.clone(),
            format!("{step_ms:.1}"),
            format!("{:.1}", mid(|f| f.push_ms)),
            format!("{:.1}", mid(|f| f.wait_ms)),
            format!("{:.1}", mid(|f| f.pull_ms)),
            format!("{gbs:.2}"),
            format!("{:.2}", raw / 1e9),
            format!("{:.2}", gbs * 1e9 / raw),
            format!("{bound_ms:.1}"),
            format!("{:.2}", step_ms / bound_ms),
            vs(plain, |f| f.step_ms),
            format!("{:.1}", mid(|f| f.cpu_ms)),
            vs(plain, |f| f.cpu_ms),
            faster,
        ]);
    }
}

/// Print the links and rounds, `table`, and what its columns mean.
fn notes(a: &PsBenchArgs, rounds: usize, table: &Table) {
    let link = match a.link_gbit {
        None => "loopback (every shard and worker on 127.0.0.1)".to_string(),
        Some(g) => format!(
            "emulated hosts, one per shard and per worker, each link shaped to {g} Gbit/s each way; raw = one \
             plain TCP stream from a worker's host to a shard's"
        ),
    };
    println!("links: {link}");
    let rounds_note = match rounds {
        1 => "one round: every figure from a single run, ratios without spread (--rounds N to repeat)"
            .to_string(),
        n => format!(
            "median of {n} interleaved rounds (every row of a group once per round, in order); x plain, CPU x \
             plain and vs default: the median of the rounds' own ratios (least-most)"
        ),
    };
    println!("{rounds_note}");
    print!("{}", table.render());
    println!(
        "push, pull: the slowest worker's, median step, timed from the step's start (push and pull run at \
         once, except in `serial` rows: push, then pull, timed each); (wait): the longest a server held a push \
         after receiving it, for the barrier and the update's last block (part of push). GB/s: bytes pushed and pulled by all workers per second; raw GB/s: one plain TCP stream over \
         the links, the median of three measured just before each round of the row's group; x raw: GB/s over raw. bound: 2 x max(S/B, W*S/(K*B)) with \
         B the raw figure (the median of the rounds'). x bound: ms/step over the bound (1.0 is the \
         link's limit). x plain: ms/step over the plain tcp row's. CPU ms: CPU time (user + system, every thread of this process) per timed step (not the warm-up steps, which first touch the buffers); CPU x plain: over the plain row's, the extra work a row does for the same bytes (where the cores are the limit, x plain cannot fall below it). vs default: how much faster than tonic's defaults. Rows: plain tcp = the same bytes over plain \
         sockets in the same topology (a socket per worker, shard and direction, push and pull at once; no \
         framing, no update): the floor on this machine; default = tonic's HTTP/2 \
         defaults; tuned-codec = tuned windows and frames, messages through tonic's codec; tuned = the same \
         settings with the bulk RPCs framed straight over HTTP/2 (gradsync's transport); tuned serial = the same, \
         pushing then pulling rather than both at once. Chunks of {}.",
        match a.chunk_bytes {
            Some(c) => format!("{c} bytes"),
            None => "an eighth of the shard, 64 KiB to 1 MiB (gradsync-server's default)".into(),
        }
    );
}
