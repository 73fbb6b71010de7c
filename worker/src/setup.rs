//! From the flags to a run: [`Run`] resolves them once (rank, device, data, optimiser,
//! files), and [`strategy`] builds the strategy `--mode` names with its own typed
//! configuration. The one place that matches on the mode; neither the training loop nor any
//! strategy sees a flag.

use std::time::Duration;

use anyhow::Context;
use gradsync_core::data::{DataSource, Dataset};
use gradsync_core::device::{Device, DeviceRequest};
use gradsync_core::model::Fingerprint;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;

use crate::cli::{DdpArgs, Mode, PsArgs, TrainArgs};
use crate::rendezvous::RendezvousConfig;
use crate::strategy::{
    Backend, Ddp, DdpConfig, Dp, DpConfig, Local, Ps, PsConfig, Shape, Strategy, Zero1, Zero1Config,
};

/// Everything a run needs that the flags determine, resolved once.
pub struct Run {
    /// The flags.
    pub args: TrainArgs,
    /// This process's rank and the number of workers.
    pub rank: usize,
    /// Number of worker processes (replicas in DP).
    pub world: usize,
    /// The resolved device.
    pub device: Device,
    /// The data, loaded.
    pub data: Dataset,
    /// The optimiser settings.
    pub sgd: SgdConfig,
    /// The timeline recorder (`--trace`; disabled without it). Strategies clone it to record
    /// their own spans (push, pull, wait, apply, each bucket's all-reduce).
    pub trace: Trace,
}

impl Run {
    /// Resolve the flags: rank, device, data and the model's shape.
    pub fn prepare(mut args: TrainArgs) -> anyhow::Result<Run> {
        let (rank, world) = args.dist.resolve()?;
        let source = args
            .data
            .clone()
            .unwrap_or_else(|| DataSource::synthetic_for(args.model.input(), args.model.classes()));
        let mut device = Device::resolve(args.device, args.threads).context("--device")?;
        if args.device == DeviceRequest::Auto && device.is_cuda() {
            // One GPU per rank on a node, as torchrun users expect: --device auto means
            // cuda:LOCAL_RANK.
            let local = args.dist.local();
            device = Device::resolve(DeviceRequest::Cuda(local), args.threads)
                .with_context(|| format!("--device auto with LOCAL_RANK {local}"))?;
        }
        let data = source.load(args.seed).with_context(|| format!("--data {source}"))?;
        args.model = args.model.clone().with_io(data.dim, data.classes);
        args.data = Some(source);
        let sgd = args.optimiser.sgd();
        // One metrics and trace file per process: `{rank}` in a path becomes this rank, so one
        // launcher command line serves every child.
        for path in [&mut args.metrics, &mut args.trace] {
            if let Some(text) = path.as_ref().and_then(|p| p.to_str()).filter(|t| t.contains("{rank}")) {
                *path = Some(text.replace("{rank}", &rank.to_string()).into());
            }
        }
        let trace = if args.trace.is_some() { Trace::new(rank) } else { Trace::disabled() };
        Ok(Run { args, rank, world, device, data, sgd, trace })
    }

    /// The model's fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::new(&self.args.model, self.args.seed)
    }
}

/// The strategy `--mode` names, configured from the resolved flags.
pub fn strategy(run: &Run) -> anyhow::Result<Box<dyn Strategy>> {
    let args = &run.args;
    // Checked before any strategy meets its peers.
    let replicas = args.dp.replicas.unwrap_or(run.world);
    if let Some(slow) = args.slow_rank {
        slow.check(if args.mode == Mode::Dp { replicas } else { run.world })?;
    }
    // Compression is a property of the wire: modes without one (or not wired for it) refuse it.
    if !args.compress.is_none() && !matches!(args.mode, Mode::Ps | Mode::Ddp) {
        anyhow::bail!(
            "--compress {} is for --mode ps and --mode ddp, not --mode {} (it compresses nothing)",
            args.compress,
            args.mode.name()
        );
    }
    Ok(match args.mode {
        Mode::Local => {
            Box::new(Local::new(run.sgd, Shape::processes(run.world, run.rank), run.trace.clone()))
        }
        Mode::Dp => Box::new(Dp::new(DpConfig {
            replicas,
            device: run.device,
            spec: args.model.clone(),
            seed: args.seed,
            sgd: run.sgd,
            slow: args.slow_rank.map(|s| (s.rank, s.delay())),
            fault: args.dp.fail_replica,
            trace: run.trace.clone(),
        })?),
        Mode::Ps => Box::new(Ps::new(ps_config(&args.ps, run)?)?),
        Mode::Ddp => Box::new(Ddp::connect(ddp_config(&args.ddp, run)?)?),
        Mode::Zero1 => Box::new(Zero1::connect(Zero1Config {
            ddp: ddp_config(&args.ddp, run)?,
            // Every rank takes part in gathering what rank 0 saves.
            gather_momentum: args.save.is_some(),
        })?),
    })
}

/// DDP's configuration (ZeRO-1's too) from the `--mode ddp` flags of `run`, checked.
fn ddp_config(d: &DdpArgs, run: &Run) -> anyhow::Result<DdpConfig> {
    anyhow::ensure!(d.bucket_mb > 0.0 && d.bucket_mb.is_finite(), "--bucket-mb must be positive");
    anyhow::ensure!(d.sync_every >= 1, "--sync-every must be at least 1");
    anyhow::ensure!(
        d.comm_timeout > 0.0 && d.comm_timeout.is_finite(),
        "--comm-timeout must be a positive number of seconds"
    );
    Ok(DdpConfig {
        rendezvous: RendezvousConfig {
            master: d.master()?,
            rank: run.rank,
            world: run.world,
            fingerprint: run.fingerprint().text,
            token: d.ring_token.clone(),
            timeout: Duration::from_secs_f64(d.comm_timeout),
            nccl: d.backend == Backend::Nccl,
        },
        backend: d.backend,
        device: run.device,
        bucket_values: ((d.bucket_mb * (1 << 20) as f64) / 4.0).max(1.0) as usize,
        sync_every: d.sync_every,
        overlap: !d.no_overlap,
        chunk_kb: d.chunk_kb,
        transport: d.transport,
        hierarchy: d.hierarchy,
        sgd: run.sgd,
        trace: run.trace.clone(),
        compression: run.args.compress,
    })
}

/// PS mode's configuration from the `--mode ps` flags of `run`, checked.
fn ps_config(args: &PsArgs, run: &Run) -> anyhow::Result<PsConfig> {
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
        rpc_timeout: Duration::from_secs_f64(args.rpc_timeout),
        connect_wait: Duration::from_secs_f64(args.connect_timeout),
        chunk_bytes: args.chunk_bytes,
        tls: args.tls_ca.clone().map(|ca| (ca, args.tls_domain.clone())),
        pipeline: !args.no_pipeline,
        rank: run.rank,
        world: run.world,
        fingerprint: run.fingerprint().text,
        trace: run.trace.clone(),
        compression: run.args.compress,
    })
}
