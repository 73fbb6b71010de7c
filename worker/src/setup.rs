//! From the flags to a run: [`Run::prepare`] resolves them once (rank, device, data,
//! optimiser, budget, files) and configures the strategy `--mode` names with its own typed
//! configuration ([`ModeConfig`]: the one match on the mode), and [`strategy`] builds it. The
//! flags stop here: neither the training loop nor any strategy sees one. Part of the `train`
//! subcommand's body, the binary's edge: a flag refused here is an `anyhow` error naming it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use gradsync_core::compress::Compression;
use gradsync_core::data::{DataSource, Dataset};
use gradsync_core::device::{Device, DeviceRequest};
use gradsync_core::dilation::{Dilation, Turns};
use gradsync_core::model::{Fingerprint, ModelSpec};
use gradsync_core::optim::{OptimiserArgs, SgdConfig};
use gradsync_core::trace::Trace;

use crate::cli::{DdpArgs, Mode, PsArgs, SlowRank, TrainArgs};
use crate::rendezvous::RendezvousConfig;
use crate::strategy::{
    Backend, Ddp, DdpConfig, Dp, DpConfig, Local, Ps, PsConfig, Shape, SparseGrads, Strategy, Zero1,
    Zero1Config,
};

/// Samples per step per worker when `--batch` is not given (and the model is not replayed).
pub const DEFAULT_BATCH: usize = 64;

/// Everything a run needs that the flags determine, resolved once.
pub struct Run {
    /// This process's rank.
    pub rank: usize,
    /// Number of worker processes (replicas in DP).
    pub world: usize,
    /// The resolved device.
    pub device: Device,
    /// CPU threads per process, as asked (0: one per core).
    pub threads: usize,
    /// The model, its input and class widths fitted to the data.
    pub model: ModelSpec,
    /// Where the data came from.
    pub source: DataSource,
    /// The data, loaded.
    pub data: Dataset,
    /// The augmentation of training batches, resolved for the data.
    pub augment: gradsync_core::data::Augment,
    /// The seed of the initial parameters and the data.
    pub seed: u64,
    /// The seed of the order the training data is drawn in.
    pub order_seed: u64,
    /// Whether the training data is shuffled each epoch.
    pub shuffle: bool,
    /// Whether the tail that does not fill every rank equally is dropped.
    pub drop_last: bool,
    /// Samples per step per worker (per replica in DP).
    pub batch: usize,
    /// How long to train.
    pub budget: Budget,
    /// When to evaluate on the held-out split.
    pub eval: Eval,
    /// This process's optimiser, defaults filled in.
    pub sgd: SgdConfig,
    /// The injected straggler, if any.
    pub slow: Option<SlowRank>,
    /// The run's time dilation (`--dilate`; [`gradsync_core::dilation`]).
    pub dilation: Dilation,
    /// The turns its compute phases take with other processes' (`--compute-turns`).
    pub turns: Option<Turns>,
    /// Where this process writes its metrics (`{rank}` replaced).
    pub metrics: Option<PathBuf>,
    /// Where this process writes its timeline (`{rank}` replaced).
    pub trace_path: Option<PathBuf>,
    /// Where rank 0 writes the trained parameters.
    pub save: Option<PathBuf>,
    /// The parameters to start from.
    pub load: Option<PathBuf>,
    /// Checkpoints of the run in progress (`--checkpoint`, `--checkpoint-every`,
    /// `--checkpoint-keep`, `--resume`); the strategy decides what they hold and where each
    /// rank's go.
    pub checkpoints: Option<crate::resume::Checkpoints>,
    /// Whether to print nothing but errors.
    pub quiet: bool,
    /// The timeline recorder (`--trace`; disabled without it). Strategies clone it to record
    /// their own spans (push, pull, wait, apply, each bucket's all-reduce).
    pub trace: Trace,
    /// The strategy `--mode` names, configured.
    pub mode: ModeConfig,
}

/// How long a run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// This many steps.
    Steps(u64),
    /// This many epochs over the training split.
    Epochs(u64),
}

/// When a run evaluates on the held-out split (and always after the last step, on rank 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eval {
    /// Rank 0 alone, every this many steps (0: only at the end).
    Steps(u64),
    /// Every rank, each time the samples seen by all workers together pass another multiple
    /// of this.
    Samples(u64),
}

/// The strategy `--mode` names, with its own typed configuration.
// Made once per process: the size of the hybrid's two configurations costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum ModeConfig {
    /// `--mode local`.
    Local,
    /// `--mode dp`.
    Dp(DpConfig),
    /// `--mode ps`.
    Ps(PsConfig),
    /// `--mode ddp`.
    Ddp(DdpConfig),
    /// `--mode zero1`.
    Zero1(Zero1Config),
    /// `--mode hybrid`: DDP for all but the table, the table's servers.
    Hybrid(DdpConfig, PsConfig),
}

impl ModeConfig {
    /// The mode's name, as in metrics and reports.
    pub fn name(&self) -> &'static str {
        match self {
            ModeConfig::Local => Mode::Local.name(),
            ModeConfig::Dp(_) => Mode::Dp.name(),
            ModeConfig::Ps(_) => Mode::Ps.name(),
            ModeConfig::Ddp(_) => Mode::Ddp.name(),
            ModeConfig::Zero1(_) => Mode::Zero1.name(),
            ModeConfig::Hybrid(..) => Mode::Hybrid.name(),
        }
    }

    /// Whether `--checkpoint` can hold this mode's run: `Ok` where rank 0's engine holds the
    /// whole state after a step (local training; DP's replica 0; DDP, whose ranks all hold the
    /// parameters, the momentum and rank 0's batch-norm statistics, broadcast each step) or the
    /// strategy gathers it for the checkpoint (ZeRO-1's momentum shards), else why not. Asked
    /// before any strategy is built, so no run waits on its peers to be told.
    ///
    /// With `--sync-every K`, a checkpoint written every `every` steps holds the run when `every`
    /// is a multiple of K: it is then written right after a synchronisation, when no gradient
    /// is left accumulating, and a resumed run's micro-steps count from there as the unbroken
    /// run's did.
    pub fn checkpoint_support(&self, every: u64) -> Result<(), String> {
        let between_steps = |c: &DdpConfig| {
            if !every.is_multiple_of(c.sync_every) {
                return Err(format!(
                    "--sync-every {} accumulates gradients between synchronisations, and a checkpoint \
                     holds none: give --checkpoint-every a multiple of {} (it is {every}), so that each \
                     checkpoint follows a synchronisation",
                    c.sync_every, c.sync_every
                ));
            }
            Ok(())
        };
        match self {
            ModeConfig::Local | ModeConfig::Dp(_) => Ok(()),
            ModeConfig::Ddp(c) => between_steps(c),
            ModeConfig::Zero1(c) => between_steps(&c.ddp),
            ModeConfig::Hybrid(..) => {
                Err("--mode hybrid's table lives on its servers, which keep their own \
                                           checkpoints (gradsync-server --checkpoint); a worker's would hold \
                                           only the rest of the model"
                    .into())
            }
            // The servers keep the parameters and momentum (gradsync-server --checkpoint); each
            // worker keeps its own data position and top-k residual.
            ModeConfig::Ps(_) => Ok(()),
        }
    }
}

impl Run {
    /// Resolve the flags: rank, device, data, the model's shape, the budget and the files,
    /// and configure the strategy `--mode` names (checked before any strategy meets its peers).
    pub fn prepare(args: TrainArgs) -> anyhow::Result<Run> {
        let (rank, world) = args.dist.resolve()?;
        let source = args
            .data
            .clone()
            .unwrap_or_else(|| DataSource::synthetic_for(args.model.input, args.model.classes()));
        let mut device = Device::resolve(args.device, args.threads).context("--device")?;
        if args.device == DeviceRequest::Auto && device.is_cuda() {
            // One GPU per rank on a node, as torchrun users expect: --device auto means
            // cuda:LOCAL_RANK.
            let local = args.dist.local();
            device = Device::resolve(DeviceRequest::Cuda(local), args.threads)
                .with_context(|| format!("--device auto with LOCAL_RANK {local}"))?;
        }
        let data = source.load(args.seed).with_context(|| format!("--data {source}"))?;
        let model = args
            .model
            .fit(data.input, data.classes)
            .context("--model")?
            .with_rates(args.device_tflops, args.device_tbps)?;
        let batch = args.batch.or(model.profile().map(|p| p.batch)).unwrap_or(DEFAULT_BATCH);
        let augment = args.augment.resolve(&data.name, data.input).context("--augment")?;
        if let Some(path) = &args.save {
            // Refused now, not after hours of training.
            anyhow::ensure!(
                gradsync_core::state_dict::is_state_dict(path)
                    || gradsync_core::model::Layout::new(&model).buffers_len == 0,
                "--save {}: {} has batch-norm statistics, which a gradsync checkpoint does not hold; save it as a \
                 PyTorch state dict (a path ending in .safetensors)",
                path.display(),
                model.name
            );
        }
        // One metrics and trace file per process: `{rank}` in a path becomes this rank, so one
        // launcher command line serves every child.
        let per_rank = |path: &Option<PathBuf>| match path.as_ref().and_then(|p| p.to_str()) {
            Some(text) if text.contains("{rank}") => Some(text.replace("{rank}", &rank.to_string()).into()),
            _ => path.clone(),
        };
        let trace_path = per_rank(&args.trace);
        let dilation = dilation(&args, &model, device)?;
        let turns = turns(&args, &model, dilation)?;
        let mut run = Run {
            rank,
            world,
            device,
            threads: args.threads,
            model,
            source,
            augment,
            data,
            seed: args.seed,
            order_seed: args.order_seed.unwrap_or(args.seed),
            shuffle: !args.no_shuffle,
            drop_last: args.drop_last,
            batch,
            budget: args.steps.map_or(Budget::Epochs(args.epochs as u64), Budget::Steps),
            eval: args.eval_samples.map_or(Eval::Steps(args.eval_every), Eval::Samples),
            sgd: args.optimiser.sgd(),
            slow: args.slow_rank,
            dilation,
            turns,
            metrics: per_rank(&args.metrics),
            trace: if trace_path.is_some() { Trace::new(rank) } else { Trace::disabled() },
            trace_path,
            save: args.save.clone(),
            load: args.load.clone(),
            checkpoints: args.checkpoint.as_ref().map(|dir| crate::resume::Checkpoints {
                dir: dir.clone(),
                every: args.checkpoint_every,
                keep: args.checkpoint_keep as usize,
                resume: args.resume,
            }),
            quiet: args.quiet,
            mode: ModeConfig::Local,
        };
        run.mode = mode_config(&args, &run)?;
        if run.checkpoints.is_some() {
            run.mode
                .checkpoint_support(args.checkpoint_every)
                .map_err(|why| anyhow::anyhow!("--checkpoint with --mode {}: {why}", run.mode.name()))?;
        }
        Ok(run)
    }

    /// The model's fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::new(&self.model, self.seed)
    }
}

/// The configuration of the strategy `args.mode` names, from its flags and the resolved
/// `run`, checked.
fn mode_config(args: &TrainArgs, run: &Run) -> anyhow::Result<ModeConfig> {
    let replicas = args.dp.replicas.unwrap_or(run.world);
    if let Some(slow) = args.slow_rank {
        slow.check(if args.mode == Mode::Dp { replicas } else { run.world })?;
    }
    // Compression is a property of the wire: modes without one (or not wired for it) refuse it.
    if args.mode == Mode::Hybrid {
        anyhow::ensure!(
            run.model.table().is_some(),
            "--mode hybrid puts a sparse model's embedding table on the servers, and {} has none; use \
             --mode ps or ddp",
            run.model.name
        );
        anyhow::ensure!(
            args.compress.is_none(),
            "--compress with --mode hybrid: the table's rows move as ids and f32 values; not compressed yet"
        );
    }
    if !args.compress.is_none() && !matches!(args.mode, Mode::Ps | Mode::Ddp) {
        anyhow::bail!(
            "--compress {} is for --mode ps and --mode ddp, not --mode {} (it compresses nothing)",
            args.compress,
            args.mode.name()
        );
    }
    if let Some((rows, dim)) = run.model.table()
        && args.mode == Mode::Zero1
    {
        anyhow::bail!(
            "--mode zero1 with {} ({rows} x {dim} table): an embedding table's rows are updated lazily, \
             only where a batch named them, which ZeRO-1's sharded update does not do yet; use --mode \
             local, dp, ps (rows pushed and pulled by id) or ddp (--sparse-grads dense|allgather)",
            run.model.name,
        );
    }
    if let Some((rows, dim)) = run.model.table()
        && args.mode == Mode::Ps
        && !args.compress.is_none()
    {
        anyhow::bail!(
            "--compress {} with {} ({rows} x {dim} table) in --mode ps: the table's rows move as ids and \
             f32 values, and the rest of the model is a few thousand values; push uncompressed",
            args.compress,
            run.model.name,
        );
    }
    Ok(match args.mode {
        Mode::Local => ModeConfig::Local,
        Mode::Dp => ModeConfig::Dp(DpConfig {
            replicas,
            device: run.device,
            spec: run.model.clone(),
            seed: run.seed,
            sgd: run.sgd,
            slow: args.slow_rank.map(|s| (s.rank, run.dilation.stretch(s.delay()))),
            fault: args.dp.fail_replica,
            trace: run.trace.clone(),
        }),
        Mode::Ps => {
            ModeConfig::Ps(PsConfig { optimiser: args.optimiser, ..ps_config(&args.ps, args.compress, run)? })
        }
        Mode::Ddp => ModeConfig::Ddp(ddp_config(&args.ddp, args.compress, run)?),
        Mode::Hybrid => {
            anyhow::ensure!(
                args.ddp.sparse_grads == SparseGrads::Dense,
                "--sparse-grads {} with --mode hybrid: the table's rows go to its servers",
                args.ddp.sparse_grads.name()
            );
            let mut ddp = ddp_config(&args.ddp, args.compress, run)?;
            anyhow::ensure!(
                ddp.sync_every == 1,
                "--mode hybrid pushes each step's rows: it needs --sync-every 1"
            );
            ddp.sparse_grads = SparseGrads::Servers;
            ModeConfig::Hybrid(ddp, ps_config(&args.ps, args.compress, run)?)
        }
        Mode::Zero1 => ModeConfig::Zero1(Zero1Config {
            ddp: ddp_config(&args.ddp, args.compress, run)?,
            // Every rank takes part in gathering what rank 0 saves.
            gather_momentum: args.save.is_some(),
        }),
    })
}

/// The strategy `run` is configured for, built (for DDP and ZeRO-1: its ranks met).
pub fn strategy(run: &Run) -> anyhow::Result<Box<dyn Strategy>> {
    Ok(match &run.mode {
        ModeConfig::Local => {
            Box::new(Local::new(run.sgd, Shape::processes(run.world, run.rank), run.trace.clone()))
        }
        ModeConfig::Dp(c) => Box::new(Dp::new(c.clone())?),
        ModeConfig::Ps(c) => Box::new(Ps::new(c.clone())?),
        ModeConfig::Ddp(c) => Box::new(Ddp::connect(c.clone())?),
        ModeConfig::Zero1(c) => Box::new(Zero1::connect(c.clone())?),
        ModeConfig::Hybrid(d, p) => Box::new(Ddp::connect_hybrid(d.clone(), p.clone())?),
    })
}

/// `--compute-turns`, where it can do something: a dilated run of a model trained for real
/// (a replay's compute is a wait, which needs no core; undilated there is no window to wait in).
fn turns(args: &TrainArgs, model: &ModelSpec, dilation: Dilation) -> anyhow::Result<Option<Turns>> {
    let Some(path) = &args.compute_turns else { return Ok(None) };
    let flag = format!("--{}", crate::cli::flag::COMPUTE_TURNS);
    anyhow::ensure!(
        !dilation.is_none(),
        "{flag} {} without --dilate: turns are taken inside a dilated phase's window, and undilated there is none",
        path.display()
    );
    anyhow::ensure!(
        model.profile().is_none(),
        "{flag} {} with a replayed model: its compute is a wait, which takes no core and so no turn",
        path.display()
    );
    Ok(Some(Turns::open(&flag, path)?))
}

/// `--dilate`, checked against what it can pace: a replayed model's waits on any device; a
/// model trained for real only on the CPU with one thread, whose CPU time is the phase's compute
/// (a GPU's kernels, or other threads' work, are not on the thread's clock).
fn dilation(args: &TrainArgs, model: &ModelSpec, device: Device) -> anyhow::Result<Dilation> {
    let d = Dilation::new("--dilate", args.dilate)?;
    if d.is_none() || model.profile().is_some() {
        return Ok(d);
    }
    anyhow::ensure!(
        !device.is_cuda(),
        "--dilate {} with --device {}: a model trained for real is dilated by its thread's CPU time, which          does not see a GPU's kernels (replay the model, --model profile:FILE, to dilate a GPU's compute)",
        args.dilate,
        device.label()
    );
    anyhow::ensure!(
        args.threads == 1,
        "--dilate {} needs --threads 1 for a model trained for real: each compute phase is made to last D          times the CPU time of the one thread that ran it",
        args.dilate
    );
    anyhow::ensure!(
        !args.ddp.sync_bn,
        "--dilate {} with --sync-bn: the forward pass's statistics exchange would be paced as if it were          compute",
        args.dilate
    );
    Ok(d)
}

/// The values of f32 gradient a bucket holds at least under `--bucket-mb MB` (MiB, as
/// PyTorch's `bucket_cap_mb`): what [`gradsync_core::model::BucketPlan::with_cap`] is given, by
/// DDP and ZeRO-1 here and by any prediction of their buckets.
pub fn bucket_values(mb: f64) -> usize {
    ((mb * (1 << 20) as f64) / 4.0).max(1.0) as usize
}

/// DDP's configuration (ZeRO-1's too) from the `--mode ddp` flags of `run`, checked.
fn ddp_config(d: &DdpArgs, compression: Compression, run: &Run) -> anyhow::Result<DdpConfig> {
    anyhow::ensure!(d.bucket_mb > 0.0 && d.bucket_mb.is_finite(), "--bucket-mb must be positive");
    anyhow::ensure!(d.sync_every >= 1, "--sync-every must be at least 1");
    if d.sync_bn {
        anyhow::ensure!(
            gradsync_core::model::Layout::new(&run.model).buffers_len > 0,
            "--sync-bn: {} has no batch norm to synchronise",
            run.model.name
        );
        anyhow::ensure!(d.sync_every == 1, "--sync-bn synchronises every forward: it needs --sync-every 1");
    }
    anyhow::ensure!(
        d.comm_timeout > 0.0 && d.comm_timeout.is_finite(),
        "--comm-timeout must be a positive number of seconds"
    );
    if d.sparse_grads == SparseGrads::Allgather {
        anyhow::ensure!(
            run.model.table().is_some(),
            "--sparse-grads allgather moves an embedding table's rows, and {} has none",
            run.model.name
        );
        anyhow::ensure!(
            d.sync_every == 1,
            "--sparse-grads allgather sends the rows of each step's batch: it needs --sync-every 1"
        );
    }
    Ok(DdpConfig {
        rendezvous: RendezvousConfig {
            master: d.master()?,
            rank: run.rank,
            world: run.world,
            fingerprint: run.fingerprint().text,
            token: d.ring_token.clone(),
            timeout: run.dilation.stretch(Duration::from_secs_f64(d.comm_timeout)),
            nccl: d.backend == Backend::Nccl,
            generation: launch_generation()?,
        },
        backend: d.backend,
        device: run.device,
        bucket_values: bucket_values(d.bucket_mb),
        sync_every: d.sync_every,
        overlap: !d.no_overlap,
        sync_bn: d.sync_bn,
        chunk_kb: d.chunk_kb,
        transport: d.transport,
        hierarchy: d.hierarchy,
        host_id: d.host_id.clone(),
        sgd: run.sgd,
        trace: run.trace.clone(),
        compression,
        sparse_grads: d.sparse_grads,
    })
}

/// PS mode's configuration from the `--mode ps` flags of `run`, checked.
fn ps_config(args: &PsArgs, compression: Compression, run: &Run) -> anyhow::Result<PsConfig> {
    anyhow::ensure!(
        args.rpc_timeout.is_finite() && args.rpc_timeout > 0.0 && args.rpc_timeout < 1e9,
        "--rpc-timeout {} must be a positive number of seconds",
        args.rpc_timeout
    );
    anyhow::ensure!(
        args.connect_timeout.is_finite() && (0.0..1e9).contains(&args.connect_timeout),
        "--connect-timeout {} must be 0 or a positive number of seconds",
        args.connect_timeout
    );
    if let Some(c) = args.chunk_bytes {
        anyhow::ensure!((4..=(64 << 20)).contains(&c), "--chunk-bytes {c} must be 4 bytes to 64 MiB");
    }
    Ok(PsConfig {
        servers: args.servers.clone(),
        token: args.token.clone(),
        rpc_timeout: run.dilation.stretch(Duration::from_secs_f64(args.rpc_timeout)),
        connect_wait: run.dilation.stretch(Duration::from_secs_f64(args.connect_timeout)),
        heartbeat: run.dilation.stretch(gradsync_proto::HEARTBEAT_INTERVAL),
        chunk_bytes: args.chunk_bytes,
        tls: args.tls_ca.clone().map(|ca| (ca, args.tls_domain.clone())),
        pipeline: !args.no_pipeline,
        rank: run.rank,
        world: run.world,
        fingerprint: run.fingerprint().text,
        trace: run.trace.clone(),
        compression,
        // Nothing to check unless the mode gives its flags (`--mode ps`); the hybrid's table
        // servers apply their own optimiser to the table alone.
        optimiser: OptimiserArgs::default(),
    })
}

/// The generation `gradsync-worker launch` (or torchrun) started this rank in: its
/// `TORCHELASTIC_RESTART_COUNT`, 0 outside a launcher.
fn launch_generation() -> anyhow::Result<u64> {
    match std::env::var("TORCHELASTIC_RESTART_COUNT") {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("TORCHELASTIC_RESTART_COUNT is '{v}', not a number of restarts")),
        Err(_) => Ok(0),
    }
}
