//! `gradsync-bench collective`: an nccl-tests-style table for all-reduce (size, time, algbw,
//! busbw, wrong values) from 8 B to 256 MB over 2 to 8 ranks, per backend and, for the TCP
//! backend, per transport (sockets only; `auto`, which here means shared memory), beside the
//! raw TCP bandwidth of the same machine measured in the same run, and PyTorch gloo on the
//! same sizes when a Python with torch is given.
//!
//! Ranks are threads of this process, each with its own communicator over real loopback
//! sockets and, on the shared-memory transport, its own mailbox in `/dev/shm` (the same code
//! path as separate processes: nothing is shared but the kernel and those files).
//! Definitions follow nccl-tests: algbw = S / t, busbw = algbw * 2(n-1)/n.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use gradsync_worker::collective::{Collective, Nccl, RingConfig, TcpComm, Transport, nccl};
use gradsync_worker::rendezvous::{RendezvousConfig, join_with_store};

use crate::table::Table;

/// Flags of `gradsync-bench collective`.
#[derive(Debug, Clone, Args)]
pub struct CollectiveArgs {
    /// Rank counts.
    #[arg(long, default_value = "2,4,8", value_delimiter = ',')]
    pub ranks: Vec<usize>,
    /// Backends: tcp, nccl (nccl needs one GPU per rank; skipped with a note otherwise).
    #[arg(long, default_value = "tcp,nccl", value_delimiter = ',')]
    pub backend: Vec<String>,
    /// Smallest buffer, bytes.
    #[arg(long, default_value_t = 8)]
    pub min_bytes: usize,
    /// Largest buffer, bytes.
    #[arg(long, default_value_t = 256 << 20)]
    pub max_bytes: usize,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 4)]
    pub factor: usize,
    /// Bytes to move per size (sets the iteration count: more for small buffers).
    #[arg(long, default_value_t = 512 << 20)]
    pub budget_bytes: usize,
    /// Transports of the TCP backend to measure, one row set each: tcp (sockets only), auto
    /// (shared memory between ranks of one host), shm.
    #[arg(long, value_enum, default_value = "tcp,auto", value_delimiter = ',', env = "GRADSYNC_TRANSPORT")]
    pub transport: Vec<Transport>,
    /// Ring chunk size, KiB.
    #[arg(long, default_value_t = 1024)]
    pub chunk_kb: usize,
    /// Socket buffer size to ask for, KiB (0: the kernel's autotuning).
    #[arg(long, default_value_t = 4096)]
    pub socket_buffer_kb: usize,
    /// Seconds of raw TCP measurement.
    #[arg(long, default_value_t = 2.0)]
    pub raw_secs: f64,
    /// A Python with torch: time gloo's all_reduce on the same sizes and rank counts.
    #[arg(long, env = "GRADSYNC_PYTHON")]
    pub python: Option<PathBuf>,
}

/// One measured row.
#[derive(Debug, Clone)]
struct Row {
    bytes: usize,
    secs: f64,
    wrong: usize,
}

impl Row {
    fn algbw(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
}

fn busbw(algbw: f64, n: usize) -> f64 {
    algbw * 2.0 * (n as f64 - 1.0) / n as f64
}

fn sizes(a: &CollectiveArgs) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes.max(4);
    while s <= a.max_bytes {
        v.push(s);
        s *= a.factor.max(2);
    }
    if v.last() != Some(&a.max_bytes) && a.max_bytes >= a.min_bytes {
        v.push(a.max_bytes);
    }
    v
}

/// Time all-reduce on one communicator (one rank): per size, check one reduction against the
/// expected sum, then time `iters` of them between barriers.
fn time_rank(c: &mut dyn Collective, sizes: &[usize], budget: usize) -> anyhow::Result<Vec<Row>> {
    let (r, w) = (c.rank(), c.world_size());
    let want = (w * (w + 1) / 2) as f32;
    let mut rows = Vec::new();
    for &bytes in sizes {
        let n = bytes / 4;
        let mut buf = vec![(r + 1) as f32; n];
        c.all_reduce(&mut buf)?;
        let wrong = buf.iter().filter(|&&v| v != want).count();
        let iters = (budget / bytes.max(1)).clamp(3, 200);
        c.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            // Values grow (to infinity, eventually); adds cost the same either way.
            c.all_reduce(&mut buf)?;
        }
        let secs = t.elapsed().as_secs_f64() / iters as f64;
        rows.push(Row { bytes: n * 4, secs, wrong });
    }
    Ok(rows)
}

/// Run the TCP backend on `transport` with `world` rank threads; the slowest rank's time per
/// size, and the transport the ranks ended up on.
fn tcp(
    world: usize,
    sizes: &[usize],
    a: &CollectiveArgs,
    transport: Transport,
) -> anyhow::Result<(Vec<Row>, Transport)> {
    let store = TcpListener::bind("127.0.0.1:0")?;
    let master = store.local_addr()?.to_string();
    let mut store = Some(store);
    let ring = RingConfig {
        chunk_bytes: a.chunk_kb << 10,
        socket_buffer: (a.socket_buffer_kb > 0).then_some(a.socket_buffer_kb << 10),
        transport,
        ..RingConfig::default()
    };
    let per_rank: Vec<anyhow::Result<(Vec<Row>, Transport)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let rc = RendezvousConfig {
                    master: master.clone(),
                    rank,
                    world,
                    fingerprint: "bench".into(),
                    token: None,
                    timeout: Duration::from_secs(120),
                    nccl: false,
                };
                let (l, ring) = (if rank == 0 { store.take() } else { None }, ring.clone());
                s.spawn(move || -> anyhow::Result<(Vec<Row>, Transport)> {
                    let j = join_with_store(&rc, l)?;
                    let mut c = TcpComm::connect(j.listener, &j.mesh, ring)?;
                    Ok((time_rank(&mut c, sizes, a.budget_bytes)?, c.transport()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let mut out: Option<Vec<Row>> = None;
    let mut used = transport;
    for rows in per_rank {
        let (rows, t) = rows?;
        used = t;
        out = Some(match out {
            None => rows,
            Some(acc) => acc
                .into_iter()
                .zip(rows)
                .map(|(x, y)| Row { bytes: x.bytes, secs: x.secs.max(y.secs), wrong: x.wrong + y.wrong })
                .collect(),
        });
    }
    Ok((out.context("no ranks")?, used))
}

/// NCCL at world size 1 (one GPU here): what the library costs with no peer.
fn nccl_single(sizes: &[usize], a: &CollectiveArgs) -> anyhow::Result<Vec<Row>> {
    let id = nccl::unique_id()?;
    let mut c = Nccl::new(0, 0, 1, &id, Duration::from_secs(60))?;
    time_rank(&mut c, sizes, a.budget_bytes)
}

/// gloo through `bench/pytorch/allreduce.py`: (bytes, seconds) per size.
fn gloo(
    python: &PathBuf,
    world: usize,
    sizes: &[usize],
    a: &CollectiveArgs,
) -> anyhow::Result<Vec<(usize, f64)>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/pytorch/allreduce.py");
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let out = Command::new(python)
        .args([script, "--world", &world.to_string(), "--sizes", &list.join(",")])
        .args(["--budget-bytes", &a.budget_bytes.to_string()])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "gloo benchmark failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)?;
            Ok((v["bytes"].as_u64().context("bytes")? as usize, v["seconds"].as_f64().context("seconds")?))
        })
        .collect()
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MB", b >> 20),
        b if b >= 1 << 10 => format!("{} KB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Run the benchmark and print its table.
pub fn run(a: &CollectiveArgs) -> anyhow::Result<()> {
    let sizes = sizes(a);
    let yard = crate::rawtcp::Yardstick::loopback("127.0.0.1", 3, Duration::from_secs_f64(a.raw_secs))?;
    let raw = yard.median() / 1e9;
    println!("raw loopback TCP, one stream, measured now: {}", yard.describe());
    let mut t = Table::new(&[
        "ranks",
        "backend",
        "transport",
        "size",
        "time us",
        "algbw GB/s",
        "busbw GB/s",
        "busbw/raw",
        "gloo busbw",
        "vs gloo",
        "#wrong",
    ]);
    for &world in &a.ranks {
        let torch = match &a.python {
            Some(py) => match gloo(py, world, &sizes, a) {
                Ok(v) => Some(v),
                Err(e) => {
                    eprintln!("gradsync-bench collective: gloo skipped: {e:#}");
                    None
                }
            },
            None => None,
        };
        let runs = a.backend.iter().flat_map(|b| {
            let per = if b == "tcp" { a.transport.clone() } else { vec![Transport::Auto] };
            per.into_iter().map(move |t| (b, t))
        });
        for (backend, transport) in runs {
            let (rows, label) = match backend.as_str() {
                "tcp" => {
                    let (rows, used) = tcp(world, &sizes, a, transport)?;
                    let label = if used == transport {
                        used.name().to_string()
                    } else {
                        format!("{} ({})", transport.name(), used.name())
                    };
                    (rows, label)
                }
                "nccl" => match nccl::available() {
                    Err(e) => {
                        eprintln!("gradsync-bench collective: NCCL skipped ({world} ranks): {e}");
                        continue;
                    }
                    Ok(()) if world > 1 => {
                        eprintln!(
                            "gradsync-bench collective: NCCL with {world} ranks needs {world} GPUs \
                             (NCCL refuses two ranks on one GPU); measured at 1 rank only"
                        );
                        continue;
                    }
                    Ok(()) => (nccl_single(&sizes, a)?, "-".to_string()),
                },
                other => anyhow::bail!("--backend {other}: expected tcp or nccl"),
            };
            for row in rows {
                let g = torch
                    .as_ref()
                    .and_then(|v| v.iter().find(|(b, _)| *b == row.bytes))
                    .map(|&(b, s)| busbw(b as f64 / s / 1e9, world));
                let bus = busbw(row.algbw(), world);
                t.row(vec![
                    world.to_string(),
                    backend.clone(),
                    label.clone(),
                    human(row.bytes),
                    format!("{:.1}", row.secs * 1e6),
                    format!("{:.3}", row.algbw()),
                    format!("{bus:.3}"),
                    format!("{:.2}", bus / raw),
                    g.map(|g| format!("{g:.3}")).unwrap_or_default(),
                    g.map(|g| format!("{:.2}x", bus / g)).unwrap_or_default(),
                    row.wrong.to_string(),
                ]);
            }
        }
    }
    print!("{}", t.render());
    println!(
        "busbw = algbw * 2(n-1)/n (nccl-tests); busbw/raw: link efficiency against one raw TCP stream; \
         vs gloo: our busbw over gloo's; transport: what the TCP backend's ring ran on (tcp: \
         loopback sockets; auto (shm): shared memory, chosen because every rank is on this host)."
    );
    Ok(())
}
