//! The command line of every mode: the only place in the comparison that writes the worker's
//! and the server's flags, each by the name the binary's own parser defines
//! (`gradsync_worker::cli::flag`, `gradsync_server::config::flag`,
//! `gradsync_core::optim::flag`) and each choice by its typed value. What makes each mode
//! (its `--mode`, ring, compression, servers) is its entry in the worker's table of compared
//! modes (`gradsync_worker::modes`); [`plan`] turns that entry into a [`Plan`]: the server
//! processes to start first (each printing `gradsync-server listening on ADDR` once it serves)
//! and a function from their addresses to the worker processes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use anyhow::Context;

use gradsync_core::optim::flag as of;
use gradsync_server::SyncMode;
use gradsync_server::config::flag as sf;
use gradsync_worker::cli::Mode;
use gradsync_worker::cli::flag::{self as wf, opt, switch};
use gradsync_worker::modes::Compared;

use super::local::Local;
use super::scenario::{RunSpec, Scenario};
use super::site::{Site, Slot};

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
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(&switch(sf::TRACE)));
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
    /// Its metrics file (where it runs).
    pub metrics: PathBuf,
    /// Where it runs.
    pub site: Arc<dyn Site>,
    /// Added to its environment: the run's tokens, never on a command line.
    pub env: Vec<(String, String)>,
}

/// Where a run's processes go.
#[derive(Debug, Clone, Default)]
pub enum Placement {
    /// Every process on this machine's loopback.
    #[default]
    Loopback,
    /// Server shard `i` on `servers[i]`, rank `r` on `workers[r]` (each list at least as long
    /// as the run needs): emulated hosts, or hosts reached over ssh.
    Hosts {
        /// One host per server shard.
        servers: Vec<Slot>,
        /// One host per worker rank.
        workers: Vec<Slot>,
    },
}

impl Placement {
    /// The address and site of server shard `i`.
    fn server(&self, i: usize) -> (String, Arc<dyn Site>) {
        self.slot(i, |servers, _| servers)
    }

    /// The address and site of worker rank `r`.
    fn worker(&self, r: usize) -> (String, Arc<dyn Site>) {
        self.slot(r, |_, workers| workers)
    }

    fn slot<'a>(
        &'a self,
        i: usize,
        list: fn(&'a [Slot], &'a [Slot]) -> &'a [Slot],
    ) -> (String, Arc<dyn Site>) {
        match self {
            Placement::Loopback => ("127.0.0.1".into(), Arc::new(Local)),
            Placement::Hosts { servers, workers } => match list(servers, workers) {
                [] => ("127.0.0.1".into(), Arc::new(Local)),
                l => {
                    let h = &l[i % l.len()];
                    (h.addr.clone(), h.site.clone())
                }
            },
        }
    }

    /// Where the processes write the files of the run directory `dir` (on other hosts, the
    /// same run's directory under the remote one).
    pub fn files_dir(&self, dir: &Path) -> PathBuf {
        self.worker(0).1.files_dir(dir)
    }

    /// Whether the run's processes listen on a network others can reach, so that each run
    /// needs tokens of its own.
    pub fn needs_tokens(&self) -> bool {
        matches!(self, Placement::Hosts { .. })
    }
}

/// The user's certificates for the parameter server's TLS (`compare --tls-cert --tls-key
/// --tls-ca`), at the same paths on every host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    /// The servers' certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA the workers trust (PEM).
    pub ca: PathBuf,
    /// The name the certificate carries, when not each server's address.
    pub domain: Option<String>,
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
    /// Added to every process's environment: the run's tokens (none on loopback).
    pub env: Vec<(String, String)>,
    /// The parameter server's TLS, when asked for.
    pub tls: Option<Tls>,
}

/// The variables the run's tokens travel in (read by both binaries' `--token` and the
/// worker's `--ring-token`).
pub const TOKEN_ENV: &str = "GRADSYNC_TOKEN";
/// See [`TOKEN_ENV`].
pub const RING_TOKEN_ENV: &str = "GRADSYNC_RING_TOKEN";

/// A fresh PS token and ring token for one run: 32 random bytes each from the operating
/// system, in hex.
pub fn fresh_tokens() -> anyhow::Result<Vec<(String, String)>> {
    let secret = || -> anyhow::Result<String> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("drawing a token: {e}"))?;
        Ok(b.iter().map(|x| format!("{x:02x}")).collect())
    };
    Ok(vec![(TOKEN_ENV.into(), secret()?), (RING_TOKEN_ENV.into(), secret()?)])
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
        a.extend(opt(wf::MODEL, &self.spec.model));
        a.extend(opt(wf::BATCH, batch));
        a.extend(opt(wf::SEED, s.seed));
        a.extend(opt(wf::ORDER_SEED, s.seed + self.spec.repeat as u64));
        a.extend(opt(wf::DEVICE, &s.device));
        a.extend(opt(wf::THREADS, s.threads));
        if let Some(t) = s.device_tflops {
            a.extend(opt(wf::DEVICE_TFLOPS, t));
        }
        if let Some(t) = s.device_tbps {
            a.extend(opt(wf::DEVICE_TBPS, t));
        }
        a.extend(optimiser(s));
        a.extend(opt(wf::METRICS, self.path(name, "jsonl").display()));
        if let Some(d) = &s.data {
            a.extend(opt(wf::DATA, d));
        }
        match (s.steps, s.epochs) {
            (Some(n), _) => a.extend(opt(wf::STEPS, n)),
            (None, Some(e)) => a.extend(opt(wf::EPOCHS, e)),
            (None, None) => {}
        }
        if let Some(e) = s.eval_samples {
            a.extend(opt(wf::EVAL_SAMPLES, e));
        }
        if self.spec.slow_ms > 0 {
            // Every process gets the flag; only the named rank (DP: replica) sleeps.
            a.extend(opt(wf::SLOW_RANK, format!("{}:{}", s.slow_rank, self.spec.slow_ms)));
        }
        if s.trace {
            a.extend(opt(wf::TRACE, self.path(&format!("trace-{name}"), "json").display()));
        }
        if self.spec.dilate > 1.0 {
            a.extend(opt(wf::DILATE, self.spec.dilate));
            if !self.spec.replayed() {
                // The run's ranks share these cores: computing one at a time, each phase's CPU
                // time is a host's of its own, not inflated by another's compute beside it.
                a.extend(opt(wf::COMPUTE_TURNS, self.path("compute", "turns").display()));
            }
        }
        if s.restarts() {
            // One folder for the run's workers: DDP's rank 0 writes the state every rank reads
            // back, each PS worker its own.
            a.extend(opt(wf::CHECKPOINT, self.dir.join("checkpoints").display()));
            a.extend(opt(wf::CHECKPOINT_EVERY, s.checkpoint_every));
        }
        a
    }

    /// The flags that make the run's mode (`--mode`, the ring's backend and transport,
    /// `--compress`, `--sparse-grads`), as the worker's table of compared modes gives them.
    fn mode_flags(&self) -> Vec<String> {
        let flags = self.spec.mode.compared().flags(self.scenario.topk_ratio);
        flags.into_iter().flat_map(|(long, value)| opt(long, value)).collect()
    }

    fn worker(&self, rank: usize, name: String, args: Vec<String>) -> ProcSpec {
        let site = self.placement.worker(rank).1;
        ProcSpec {
            metrics: self.path(&name, "jsonl"),
            name,
            program: self.bins.worker.clone(),
            args,
            site,
            env: self.env.clone(),
        }
    }
}

/// The plan for `ctx`'s mode, as its entry in the worker's table of compared modes
/// (`gradsync_worker::modes::COMPARED`) describes it: one process for local training and DP,
/// else its servers, then one process per rank with the flags that make the mode.
pub fn plan(ctx: &Ctx) -> anyhow::Result<Plan> {
    let mode = ctx.spec.mode.compared();
    match mode.mode {
        Mode::Local => Ok(local(ctx)),
        Mode::Dp => Ok(dp(ctx)),
        _ => ranks(ctx, mode),
    }
}

/// `gradsync-worker train --mode local`, with the whole global batch.
fn local(ctx: &Ctx) -> Plan {
    let mut args = ctx.worker_common("rank0", ctx.spec.global_batch);
    args.extend(ctx.mode_flags());
    let p = ctx.worker(0, "rank0".into(), args);
    Plan { servers: vec![], workers: Box::new(move |_| vec![p]) }
}

/// `gradsync-worker train --mode dp --replicas W`, one process, `--batch` per replica.
fn dp(ctx: &Ctx) -> Plan {
    let mut args = ctx.worker_common("rank0", ctx.spec.batch);
    args.extend(ctx.mode_flags());
    args.extend(opt(wf::REPLICAS, ctx.spec.workers));
    let p = ctx.worker(0, "rank0".into(), args);
    Plan { servers: vec![], workers: Box::new(move |_| vec![p]) }
}

/// `gradsync-server --shard I/K ...` per shard of the run (`--table-only` for the hybrid's
/// servers, which hold a sparse model's table alone).
fn servers(ctx: &Ctx, sync: SyncMode, table_only: bool) -> Vec<ProcSpec> {
    let s = &ctx.scenario;
    let k = ctx.spec.shards.max(1);
    (0..k)
        .map(|i| {
            let name = format!("server{i}");
            let (addr, site) = ctx.placement.server(i);
            let mut args = Vec::new();
            args.extend(opt(sf::LISTEN, format!("{addr}:0")));
            args.extend(opt(sf::SYNC, sync));
            args.extend(opt(sf::SHARD, format!("{i}/{k}")));
            args.extend(opt(sf::MODEL, &ctx.spec.model));
            args.extend(opt(sf::SEED, s.seed));
            args.extend(optimiser(s));
            args.extend(opt(sf::STALENESS_LR, s.staleness_lr.name()));
            args.extend(opt(sf::METRICS, ctx.path(&name, "jsonl").display()));
            if let Some(d) = &s.data {
                args.extend(opt(sf::DATA, d));
            }
            if let Some(c) = s.ps_chunk_bytes {
                args.extend(opt(sf::CHUNK_BYTES, c));
            }
            if ctx.spec.dilate > 1.0 {
                args.extend(opt(sf::DILATE, ctx.spec.dilate));
            }
            if let Some(c) = ctx.spec.mode.compress(s.topk_ratio) {
                args.extend(opt(sf::COMPRESS, c));
            }
            if s.trace && ctx.bins.server_trace {
                args.extend(opt(sf::TRACE, ctx.path(&format!("trace-{name}"), "json").display()));
            }
            if let Some(t) = &ctx.tls {
                args.extend(opt(sf::TLS_CERT, t.cert.display()));
                args.extend(opt(sf::TLS_KEY, t.key.display()));
            }
            if table_only {
                args.push(switch(sf::TABLE_ONLY));
            }
            ProcSpec {
                metrics: ctx.path(&name, "jsonl"),
                name,
                program: ctx.bins.server.clone(),
                args,
                site,
                env: ctx.env.clone(),
            }
        })
        .collect()
}

/// A mode of one process per rank: `gradsync-server --shard I/K ...` per shard when it runs
/// servers (`--table-only` where they hold the table alone), then `gradsync-worker train
/// --mode M ... --rank R --world-size W` per rank; ranks that form a ring also get `--local-rank
/// R --master-addr A --master-port P`, A rank 0's address and P a port free when picked (on
/// loopback; an emulated host's namespace has every port free), and ranks that reach servers
/// `--servers A,B`.
fn ranks(ctx: &Ctx, mode: &'static Compared) -> anyhow::Result<Plan> {
    let servers = match mode.servers {
        Some(s) => servers(ctx, s.sync.mode(ctx.scenario.ssp_staleness), s.table_only),
        None => Vec::new(),
    };
    let store = match mode.ring {
        Some(_) => {
            let (master, site) = ctx.placement.worker(0);
            Some((master, site.free_port().context("picking the rendezvous port")?))
        }
        None => None,
    };
    let ctx = ctx.clone();
    Ok(Plan {
        servers,
        workers: Box::new(move |addrs: &[String]| {
            (0..ctx.spec.workers)
                .map(|r| {
                    let name = format!("rank{r}");
                    let mut args = ctx.worker_common(&name, ctx.spec.batch);
                    args.extend(ctx.mode_flags());
                    args.extend(opt(wf::RANK, r));
                    args.extend(opt(wf::WORLD_SIZE, ctx.spec.workers));
                    if let Some((master, port)) = &store {
                        args.extend(opt(wf::LOCAL_RANK, r));
                        args.extend(opt(wf::MASTER_ADDR, master));
                        args.extend(opt(wf::MASTER_PORT, port));
                        if let Some(mb) = ctx.scenario.bucket_mb {
                            args.extend(opt(wf::BUCKET_MB, mb));
                        }
                    }
                    if mode.servers.is_some() {
                        args.extend(ps_client(&ctx, addrs));
                    }
                    ctx.worker(r, name, args)
                })
                .collect()
        }),
    })
}

/// A worker's flags for reaching the servers at `addrs`: the list, the chunk size, the CA.
fn ps_client(ctx: &Ctx, addrs: &[String]) -> Vec<String> {
    let mut args = opt(wf::SERVERS, addrs.join(",")).to_vec();
    if let Some(c) = ctx.scenario.ps_chunk_bytes {
        args.extend(opt(wf::CHUNK_BYTES, c));
    }
    if let Some(t) = &ctx.tls {
        args.extend(opt(wf::TLS_CA, t.ca.display()));
        if let Some(d) = &t.domain {
            args.extend(opt(wf::TLS_DOMAIN, d));
        }
    }
    args
}

/// The optimiser flags, which workers and servers share.
fn optimiser(s: &Scenario) -> Vec<String> {
    [opt(of::LR, s.lr), opt(of::MOMENTUM, s.momentum), opt(of::WEIGHT_DECAY, s.weight_decay)].concat()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::scenario::ModeKind;
    use gradsync_worker::cli::{Backend, Transport};
    use gradsync_worker::strategy::SparseGrads;

    fn ctx(mode: &str, extra: &str) -> Ctx {
        ctx_of(mode, "tiny", extra)
    }

    fn ctx_of(mode: &str, model: &str, extra: &str) -> Ctx {
        let scenario = Scenario::parse(
            &format!(
                "name='x'\nmodes=['{mode}']\nworkers=[2]\nmodels=['{model}']\nbatches=[8]\nsteps=3\n{extra}"
            ),
            "t",
        )
        .unwrap();
        let spec = scenario.expand().remove(0);
        let bins = Bins { worker: "w".into(), server: "s".into(), server_trace: true };
        Ctx { scenario, spec, dir: "d".into(), bins, placement: Placement::Loopback, env: vec![], tls: None }
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

    /// Every process of `ctx`'s plan, each parsed by its binary's own parser.
    fn parse_all(ctx: &Ctx) -> (Vec<gradsync_server::Cli>, Vec<gradsync_worker::cli::TrainArgs>) {
        use clap::Parser;
        let p = plan(ctx).unwrap();
        let servers: Vec<_> = p
            .servers
            .iter()
            .map(|s| {
                let argv = std::iter::once("gradsync-server".to_string()).chain(s.args.iter().cloned());
                gradsync_server::Cli::try_parse_from(argv)
                    .unwrap_or_else(|e| panic!("{}: {:?}: {e}", ctx.spec.id, s.args))
            })
            .collect();
        let addrs: Vec<String> = (0..servers.len()).map(|i| format!("127.0.0.1:{}", 5000 + i)).collect();
        let workers = (p.workers)(&addrs)
            .iter()
            .map(|w| {
                let argv = std::iter::once("gradsync-worker".to_string()).chain(w.args.iter().cloned());
                match gradsync_worker::cli::Cli::try_parse_from(argv) {
                    Ok(gradsync_worker::cli::Cli { command: gradsync_worker::cli::Command::Train(a) }) => *a,
                    Ok(other) => panic!("{}: {:?} is not a train command: {other:?}", ctx.spec.id, w.args),
                    Err(e) => panic!("{}: {:?}: {e}", ctx.spec.id, w.args),
                }
            })
            .collect();
        (servers, workers)
    }

    #[test]
    fn every_command_line_of_the_default_scenario_parses_with_the_binaries_own_parsers() {
        let scenario = Scenario::load(None).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for spec in scenario.expand() {
            seen.insert(spec.mode);
            let bins = Bins { worker: "w".into(), server: "s".into(), server_trace: true };
            let ctx = Ctx {
                scenario: scenario.clone(),
                spec,
                dir: "d".into(),
                bins,
                placement: Placement::Loopback,
                env: vec![],
                tls: None,
            };
            let (servers, workers) = parse_all(&ctx);
            let s = &ctx.scenario;
            let sgd = gradsync_core::optim::SgdConfig {
                lr: s.lr,
                momentum: s.momentum,
                weight_decay: s.weight_decay,
            };
            let batch = if ctx.spec.mode == ModeKind::Local { ctx.spec.global_batch } else { ctx.spec.batch };
            for w in &workers {
                assert_eq!(w.optimiser.sgd(), sgd, "{}", ctx.spec.id);
                assert_eq!((w.seed, w.batch, w.steps), (s.seed, Some(batch), s.steps), "{}", ctx.spec.id);
                assert_eq!(w.model.name, ctx.spec.model, "{}", ctx.spec.id);
            }
            for v in &servers {
                assert_eq!(v.args.optimiser.sgd(), sgd, "{}", ctx.spec.id);
                assert_eq!(v.args.staleness_lr, s.staleness_lr);
            }
            let expected_mode = match ctx.spec.mode {
                ModeKind::Local => Mode::Local,
                ModeKind::Dp => Mode::Dp,
                ModeKind::PsBsp | ModeKind::PsAsp | ModeKind::PsSsp => Mode::Ps,
                ModeKind::Zero1Tcp => Mode::Zero1,
                _ => Mode::Ddp,
            };
            assert!(workers.iter().all(|w| w.mode == expected_mode), "{}", ctx.spec.id);
            if let ModeKind::PsSsp = ctx.spec.mode {
                assert!(servers.iter().all(|v| v.args.sync == SyncMode::Ssp(s.ssp_staleness)));
            }
        }
        let modes: std::collections::BTreeSet<ModeKind> = scenario.modes.iter().copied().collect();
        assert_eq!(seen, modes);
    }

    #[test]
    fn every_mode_with_every_optional_flag_parses_with_the_binaries_own_parsers() {
        let extra = "trace = true\nps_chunk_bytes = 131072\nbucket_mb = 2.5\neval_samples = 64\n\
                     slow_ms = [0, 5]\nslow_rank = 1\nstaleness_lr = 'inverse'\n";
        for mode in ModeKind::ALL {
            // The table's modes on the sparse model and its data, the others on an MLP.
            let base = if mode.needs_table() {
                ctx_of(mode.label(), "embedding:4096:8", &format!("{extra}data = 'clicks:512:4096'"))
            } else {
                ctx(mode.label(), &format!("{extra}data = 'synthetic:256:16:4'"))
            };
            for spec in base.scenario.expand() {
                let ctx = Ctx { spec, ..base.clone() };
                let (servers, workers) = parse_all(&ctx);
                for w in &workers {
                    assert_eq!(
                        w.compress.is_none(),
                        ctx.spec.mode.compress(0.01).is_none(),
                        "{}",
                        ctx.spec.id
                    );
                    assert!(w.trace.is_some() && w.eval_samples == Some(64), "{}", ctx.spec.id);
                    assert_eq!(w.slow_rank.map(|s| s.ms), (ctx.spec.slow_ms > 0).then_some(5));
                }
                assert!(servers.iter().all(|s| s.args.chunk_bytes == Some(131072) && s.args.trace.is_some()));
            }
        }
    }

    /// The comparison's ways of moving a table start the processes their names promise, as
    /// the binaries' own parsers read them.
    #[test]
    fn each_sparse_mode_starts_what_its_name_says() {
        let model = "embedding:4096:8";
        let data = "data = 'clicks:512:4096'";
        for mode in [ModeKind::PsSparse, ModeKind::DdpDense, ModeKind::DdpAllgather, ModeKind::Hybrid] {
            let ctx = ctx_of(mode.label(), model, data);
            let (servers, workers) = parse_all(&ctx);
            assert_eq!(workers.len(), 2, "{mode}");
            let addrs: Vec<String> = (0..servers.len()).map(|i| format!("127.0.0.1:{}", 5000 + i)).collect();
            for w in &workers {
                assert_eq!(w.model.name, "embedding", "{mode}");
                match mode {
                    ModeKind::PsSparse => assert_eq!((w.mode, &w.ps.servers), (Mode::Ps, &addrs)),
                    ModeKind::DdpDense | ModeKind::DdpAllgather => {
                        let how = if mode == ModeKind::DdpDense {
                            SparseGrads::Dense
                        } else {
                            SparseGrads::Allgather
                        };
                        assert_eq!(
                            (w.mode, w.ddp.backend, w.ddp.transport, w.ddp.sparse_grads),
                            (Mode::Ddp, Backend::Tcp, Transport::Tcp, how)
                        );
                    }
                    _ => {
                        assert_eq!(
                            (w.mode, w.ddp.backend, w.ddp.transport),
                            (Mode::Hybrid, Backend::Tcp, Transport::Tcp)
                        );
                        assert_eq!(w.ps.servers, addrs, "the hybrid's ranks reach every table shard");
                    }
                }
            }
            // ps-sparse's servers hold the whole model; the hybrid's the table alone, under BSP.
            let want_servers = usize::from(mode.is_ps());
            assert_eq!(servers.len(), want_servers, "{mode}");
            for s in &servers {
                assert_eq!(s.args.sync, SyncMode::Bsp, "{mode}");
                assert_eq!(s.args.table_only, mode == ModeKind::Hybrid, "{mode}");
            }
        }
    }

    #[test]
    fn the_users_certificates_reach_servers_and_workers_and_tokens_no_command_line() {
        let tls =
            Tls { cert: "c.pem".into(), key: "k.pem".into(), ca: "ca.pem".into(), domain: Some("ps".into()) };
        let env = fresh_tokens().unwrap();
        let ctx = Ctx { tls: Some(tls), env: env.clone(), ..ctx("ps-bsp", "") };
        let (servers, workers) = parse_all(&ctx);
        let server = &servers[0].args;
        assert_eq!(
            (server.tls_cert.as_deref(), server.tls_key.as_deref()),
            (Some("c.pem".as_ref()), Some("k.pem".as_ref()))
        );
        for w in &workers {
            assert_eq!(
                (w.ps.tls_ca.as_deref(), w.ps.tls_domain.as_deref()),
                (Some("ca.pem".as_ref()), Some("ps"))
            );
        }
        let p = plan(&ctx).unwrap();
        let every = p.servers.iter().cloned().chain((p.workers)(&["a:1".to_string()]));
        for proc in every {
            assert_eq!(proc.env, env, "{}", proc.name);
            assert!(
                proc.args.iter().all(|a| !env.iter().any(|(_, t)| a.contains(t.as_str()))),
                "{:?}",
                proc.args
            );
        }
    }
}
