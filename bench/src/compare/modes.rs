//! The command line of every mode, one function per mode: the only place that knows the
//! worker's and the server's flags. Each returns a [`Plan`]: the server processes to start
//! first (each printing `gradsync-server listening on ADDR` once it serves) and a function
//! from their addresses to the worker processes.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Context;

use super::scenario::{ModeKind, RunSpec, Scenario};
use crate::net::HostSlot;

/// Where the binaries are.
#[derive(Debug, Clone)]
pub struct Bins {
    /// `gradsync-worker`.
    pub worker: PathBuf,
    /// `gradsync-server`.
    pub server: PathBuf,
    /// Whether this gradsync-server takes `--trace` (older builds do not; their servers then
    /// run without a timeline rather than failing).
    pub server_trace: bool,
}

impl Bins {
    /// In `dir`, else beside the running executable.
    pub fn find(dir: Option<&Path>) -> anyhow::Result<Bins> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => std::env::current_exe()
                .context("locating gradsync-bench")?
                .parent()
                .map(Path::to_path_buf)
                .context("gradsync-bench has no directory")?,
        };
        let server = dir.join("gradsync-server");
        let server_trace = Command::new(&server)
            .arg("--help")
            .stdin(Stdio::null())
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--trace"));
        let bins = Bins { worker: dir.join("gradsync-worker"), server, server_trace };
        anyhow::ensure!(
            bins.worker.is_file(),
            "{} not found (build it with `cargo build --release -p gradsync-worker -p gradsync-server`, \
             or pass --bin-dir)",
            bins.worker.display()
        );
        Ok(bins)
    }
}

/// One process to start.
#[derive(Debug, Clone)]
pub struct ProcSpec {
    /// `rank0`, `server1`: names its metrics, trace and log files.
    pub name: String,
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its metrics file.
    pub metrics: PathBuf,
    /// The network namespace it runs in (`ip netns exec`), when placed on an emulated host.
    pub netns: Option<String>,
}

/// Where a run's processes go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Placement {
    /// Every process on this machine's loopback.
    #[default]
    Loopback,
    /// Server shard `i` on `servers[i]`, rank `r` on `workers[r]` (each list at least as long
    /// as the run needs), each process inside its host's namespace.
    Hosts {
        /// One host per server shard.
        servers: Vec<HostSlot>,
        /// One host per worker rank.
        workers: Vec<HostSlot>,
    },
}

impl Placement {
    /// The address and namespace of server shard `i`.
    fn server(&self, i: usize) -> (String, Option<String>) {
        self.slot(i, |servers, _| servers)
    }

    /// The address and namespace of worker rank `r`.
    fn worker(&self, r: usize) -> (String, Option<String>) {
        self.slot(r, |_, workers| workers)
    }

    fn slot<'a>(
        &'a self,
        i: usize,
        list: fn(&'a [HostSlot], &'a [HostSlot]) -> &'a [HostSlot],
    ) -> (String, Option<String>) {
        match self {
            Placement::Loopback => ("127.0.0.1".into(), None),
            Placement::Hosts { servers, workers } => match list(servers, workers) {
                [] => ("127.0.0.1".into(), None),
                l => {
                    let h = &l[i % l.len()];
                    (h.addr.clone(), Some(h.netns.clone()))
                }
            },
        }
    }
}

/// The worker processes, given the servers' addresses in shard order.
pub type WorkersFn = Box<dyn FnOnce(&[String]) -> Vec<ProcSpec>>;

/// The processes of one run.
pub struct Plan {
    /// Started first; each must print its listening line.
    pub servers: Vec<ProcSpec>,
    /// Started once every server listens.
    pub workers: WorkersFn,
}

/// What every command line needs.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// The scenario.
    pub scenario: Scenario,
    /// The cell of the matrix.
    pub spec: RunSpec,
    /// The run's directory (metrics, traces, logs).
    pub dir: PathBuf,
    /// The binaries.
    pub bins: Bins,
    /// Where the processes run.
    pub placement: Placement,
}

impl Ctx {
    fn path(&self, name: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{name}.{ext}"))
    }

    /// The flags every worker takes: model, data, batch, budget, seed, optimiser, device,
    /// metrics and trace.
    fn worker_common(&self, name: &str, batch: usize) -> Vec<String> {
        let s = &self.scenario;
        let mut a = vec!["train".to_string()];
        a.extend(flags([
            ("--model", self.spec.model.clone()),
            ("--batch", batch.to_string()),
            ("--seed", s.seed.to_string()),
            ("--order-seed", (s.seed + self.spec.repeat as u64).to_string()),
            ("--device", s.device.clone()),
            ("--threads", s.threads.to_string()),
            ("--lr", s.lr.to_string()),
            ("--momentum", s.momentum.to_string()),
            ("--weight-decay", s.weight_decay.to_string()),
            ("--metrics", self.path(name, "jsonl").display().to_string()),
        ]));
        if let Some(d) = &s.data {
            a.extend(flags([("--data", d.clone())]));
        }
        match (s.steps, s.epochs) {
            (Some(n), _) => a.extend(flags([("--steps", n.to_string())])),
            (None, Some(e)) => a.extend(flags([("--epochs", e.to_string())])),
            (None, None) => {}
        }
        if let Some(e) = s.eval_samples {
            a.extend(flags([("--eval-samples", e.to_string())]));
        }
        if self.spec.slow_ms > 0 {
            // Every process gets the flag; only the named rank (DP: replica) sleeps.
            a.extend(flags([("--slow-rank", format!("{}:{}", s.slow_rank, self.spec.slow_ms))]));
        }
        if s.trace {
            a.extend(flags([("--trace", self.path(&format!("trace-{name}"), "json").display().to_string())]));
        }
        a
    }

    fn worker(&self, rank: usize, name: String, args: Vec<String>) -> ProcSpec {
        let netns = self.placement.worker(rank).1;
        ProcSpec { metrics: self.path(&name, "jsonl"), name, program: self.bins.worker.clone(), args, netns }
    }
}

/// The plan for `ctx`'s mode.
pub fn plan(ctx: &Ctx) -> anyhow::Result<Plan> {
    match ctx.spec.mode {
        ModeKind::Local => Ok(local(ctx)),
        ModeKind::Dp => Ok(dp(ctx)),
        ModeKind::PsBsp | ModeKind::PsBspFp16 | ModeKind::PsBspTopk => Ok(ps(ctx, "bsp".into())),
        ModeKind::PsAsp => Ok(ps(ctx, "asp".into())),
        ModeKind::PsSsp => Ok(ps(ctx, format!("ssp:{}", ctx.scenario.ssp_staleness))),
        ModeKind::DdpTcp | ModeKind::DdpTcpTopk | ModeKind::DdpTcpFp16 => ddp(ctx, "tcp", Some("tcp")),
        ModeKind::DdpShm => ddp(ctx, "tcp", Some("shm")),
        ModeKind::DdpNccl => ddp(ctx, "nccl", None),
        ModeKind::Zero1Tcp => ring(ctx, "zero1", "tcp", Some("tcp")),
    }
}

/// `gradsync-worker train --mode local`, with the whole global batch.
pub fn local(ctx: &Ctx) -> Plan {
    let mut args = ctx.worker_common("rank0", ctx.spec.global_batch);
    args.extend(flags([("--mode", "local".into())]));
    let p = ctx.worker(0, "rank0".into(), args);
    Plan { servers: vec![], workers: Box::new(move |_| vec![p]) }
}

/// `gradsync-worker train --mode dp --replicas W`, one process, `--batch` per replica.
pub fn dp(ctx: &Ctx) -> Plan {
    let mut args = ctx.worker_common("rank0", ctx.spec.batch);
    args.extend(flags([("--mode", "dp".into()), ("--replicas", ctx.spec.workers.to_string())]));
    let p = ctx.worker(0, "rank0".into(), args);
    Plan { servers: vec![], workers: Box::new(move |_| vec![p]) }
}

/// `gradsync-server --shard I/K ...` per shard, then `gradsync-worker train --mode ps
/// --servers A,B --rank R --world-size W` per worker.
pub fn ps(ctx: &Ctx, sync: String) -> Plan {
    let s = &ctx.scenario;
    let k = ctx.spec.shards.max(1);
    let servers = (0..k)
        .map(|i| {
            let name = format!("server{i}");
            let (addr, netns) = ctx.placement.server(i);
            let mut args = flags([
                ("--listen", format!("{addr}:0")),
                ("--sync", sync.clone()),
                ("--shard", format!("{i}/{k}")),
                ("--model", ctx.spec.model.clone()),
                ("--seed", s.seed.to_string()),
                ("--lr", s.lr.to_string()),
                ("--momentum", s.momentum.to_string()),
                ("--weight-decay", s.weight_decay.to_string()),
                ("--staleness-lr", s.staleness_lr.name().to_string()),
                ("--metrics", ctx.path(&name, "jsonl").display().to_string()),
            ]);
            if let Some(d) = &s.data {
                args.extend(flags([("--data", d.clone())]));
            }
            if let Some(c) = s.ps_chunk_bytes {
                args.extend(flags([("--chunk-bytes", c.to_string())]));
            }
            if let Some(c) = ctx.spec.mode.compress(s.topk_ratio) {
                args.extend(flags([("--compress", c)]));
            }
            if s.trace && ctx.bins.server_trace {
                args.extend(flags([(
                    "--trace",
                    ctx.path(&format!("trace-{name}"), "json").display().to_string(),
                )]));
            }
            ProcSpec {
                metrics: ctx.path(&name, "jsonl"),
                name,
                program: ctx.bins.server.clone(),
                args,
                netns,
            }
        })
        .collect();
    let ctx = ctx.clone();
    Plan {
        servers,
        workers: Box::new(move |addrs: &[String]| {
            (0..ctx.spec.workers)
                .map(|r| {
                    let name = format!("rank{r}");
                    let mut args = ctx.worker_common(&name, ctx.spec.batch);
                    args.extend(flags([
                        ("--mode", "ps".into()),
                        ("--servers", addrs.join(",")),
                        ("--rank", r.to_string()),
                        ("--world-size", ctx.spec.workers.to_string()),
                    ]));
                    if let Some(c) = ctx.scenario.ps_chunk_bytes {
                        args.extend(flags([("--chunk-bytes", c.to_string())]));
                    }
                    if let Some(c) = ctx.spec.mode.compress(ctx.scenario.topk_ratio) {
                        args.extend(flags([("--compress", c)]));
                    }
                    ctx.worker(r, name, args)
                })
                .collect()
        }),
    }
}

/// `gradsync-worker train --mode ddp --backend B [--transport T] --rank R --world-size W
/// --master-addr A --master-port P` per rank: A rank 0's address, P a port free when picked
/// (on loopback; an emulated host's namespace has every port free). The transport is always
/// named, never left to `auto`, so `ddp-tcp` is sockets even when every rank shares a host.
pub fn ddp(ctx: &Ctx, backend: &str, transport: Option<&str>) -> anyhow::Result<Plan> {
    ring(ctx, "ddp", backend, transport)
}

/// The ranks of a mode that meets over the rendezvous store and DDP's flags (`--mode ddp` or
/// `zero1`), with `backend` and `transport`.
fn ring(ctx: &Ctx, mode: &str, backend: &str, transport: Option<&str>) -> anyhow::Result<Plan> {
    let port = free_port()?;
    let master = ctx.placement.worker(0).0;
    let procs: Vec<ProcSpec> = (0..ctx.spec.workers)
        .map(|r| {
            let name = format!("rank{r}");
            let mut args = ctx.worker_common(&name, ctx.spec.batch);
            args.extend(flags([
                ("--mode", mode.into()),
                ("--backend", backend.into()),
                ("--rank", r.to_string()),
                ("--world-size", ctx.spec.workers.to_string()),
                ("--local-rank", r.to_string()),
                ("--master-addr", master.clone()),
                ("--master-port", port.to_string()),
            ]));
            if let Some(t) = transport {
                args.extend(flags([("--transport", t.into())]));
            }
            if let Some(mb) = ctx.scenario.bucket_mb {
                args.extend(flags([("--bucket-mb", mb.to_string())]));
            }
            if let Some(c) = ctx.spec.mode.compress(ctx.scenario.topk_ratio) {
                args.extend(flags([("--compress", c)]));
            }
            ctx.worker(r, name, args)
        })
        .collect();
    Ok(Plan { servers: vec![], workers: Box::new(move |_| procs) })
}

/// `--flag value` pairs as arguments.
fn flags<const N: usize>(pairs: [(&str, String); N]) -> Vec<String> {
    pairs.into_iter().flat_map(|(f, v)| [f.to_string(), v]).collect()
}

/// A loopback port nobody listens on now. Another process may take it before rank 0 binds
/// it; the run then fails with rank 0's bind error and is reported like any failure.
fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("picking a free port")?;
    Ok(l.local_addr()?.port())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ctx(mode: &str, extra: &str) -> Ctx {
        let scenario = Scenario::parse(
            &format!(
                "name='x'\nmodes=['{mode}']\nworkers=[2]\nmodels=['tiny']\nbatches=[8]\nsteps=3\n{extra}"
            ),
            "t",
        )
        .unwrap();
        let spec = scenario.expand().remove(0);
        let bins = Bins { worker: "w".into(), server: "s".into(), server_trace: true };
        Ctx { scenario, spec, dir: "d".into(), bins, placement: Placement::Loopback }
    }

    fn has(args: &[String], flag: &str, value: &str) -> bool {
        args.windows(2).any(|w| w[0] == flag && w[1] == value)
    }

    #[test]
    fn each_ring_mode_names_its_transport_and_the_ps_its_chunks_and_staleness_policy() {
        for (mode, transport) in [("ddp-tcp", "tcp"), ("ddp-shm", "shm")] {
            let p = plan(&ctx(mode, "")).unwrap();
            let w = (p.workers)(&[]);
            assert!(w.iter().all(|w| has(&w.args, "--transport", transport)), "{mode}: {:?}", w[0].args);
        }
        let p =
            plan(&ctx("ps-asp", "ps_chunk_bytes = 131072\nstaleness_lr = 'inverse'\nrepeats = 2")).unwrap();
        assert!(
            has(&p.servers[0].args, "--chunk-bytes", "131072")
                && has(&p.servers[0].args, "--staleness-lr", "inverse")
        );
        let w = (p.workers)(&["a:1".to_string()]);
        assert!(w.iter().all(|w| has(&w.args, "--chunk-bytes", "131072")));
        // The first repeat draws the data in the seed's own order.
        assert!(w.iter().all(|w| has(&w.args, "--order-seed", "42")));
    }
}
