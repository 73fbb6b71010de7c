//! Command-line flags of `gradsync-worker`. Every flag that a launcher or scheduler sets also
//! reads its conventional environment variable (torchrun's and Slurm's names).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use gradsync_core::compress::Compression;
use gradsync_core::data::DataSource;
use gradsync_core::device::DeviceRequest;
use gradsync_core::model::ModelSpec;
use gradsync_core::optim::OptimiserArgs;

pub use crate::collective::{Hierarchy, Transport};
pub use crate::strategy::Backend;
use crate::strategy::{FaultKind, ReplicaFault, SparseGrads};

/// The long names of the `train` and `launch` flags another program writes (`gradsync-bench`
/// builds every worker's command line from these, and [`crate::modes`] each compared mode's):
/// one definition for this parser and those command lines, so a flag renamed here is renamed
/// there.
pub mod flag {
    use clap::ValueEnum;

    /// The flag named `long` with its value, as a command line writes them: `--long value`.
    pub fn opt(long: &str, value: impl std::fmt::Display) -> [String; 2] {
        [switch(long), value.to_string()]
    }

    /// The flag named `long` alone (a switch, or a flag whose value follows as an `OsStr`).
    pub fn switch(long: &str) -> String {
        format!("--{long}")
    }

    /// A value of a closed set (`--mode`, `--backend`...) as the parser spells it.
    pub fn choice(v: impl ValueEnum) -> String {
        v.to_possible_value().map_or_else(String::new, |p| p.get_name().to_string())
    }

    /// `--mode`.
    pub const MODE: &str = "mode";
    /// `--device`.
    pub const DEVICE: &str = "device";
    /// `--threads`.
    pub const THREADS: &str = "threads";
    /// `--model`.
    pub const MODEL: &str = "model";
    /// `--data`.
    pub const DATA: &str = "data";
    /// `--augment`.
    pub const AUGMENT: &str = "augment";
    /// `--batch`.
    pub const BATCH: &str = "batch";
    /// `--device-tflops`.
    pub const DEVICE_TFLOPS: &str = "device-tflops";
    /// `--dilate`.
    pub const DILATE: &str = "dilate";
    /// `--compute-turns`.
    pub const COMPUTE_TURNS: &str = "compute-turns";
    /// `--device-tbps`.
    pub const DEVICE_TBPS: &str = "device-tbps";
    /// `--steps`.
    pub const STEPS: &str = "steps";
    /// `--sparse-grads`.
    pub const SPARSE_GRADS: &str = "sparse-grads";
    /// `--epochs`.
    pub const EPOCHS: &str = "epochs";
    /// `--seed`.
    pub const SEED: &str = "seed";
    /// `--eval-samples`.
    pub const EVAL_SAMPLES: &str = "eval-samples";
    /// `--order-seed`.
    pub const ORDER_SEED: &str = "order-seed";
    /// `--compress`.
    pub const COMPRESS: &str = "compress";
    /// `--metrics`.
    pub const METRICS: &str = "metrics";
    /// `--trace`.
    pub const TRACE: &str = "trace";
    /// `--slow-rank`.
    pub const SLOW_RANK: &str = "slow-rank";
    /// `--checkpoint`.
    pub const CHECKPOINT: &str = "checkpoint";
    /// `--checkpoint-every`.
    pub const CHECKPOINT_EVERY: &str = "checkpoint-every";
    /// `--resume`.
    pub const RESUME: &str = "resume";
    /// `--replicas`.
    pub const REPLICAS: &str = "replicas";
    /// `--servers`.
    pub const SERVERS: &str = "servers";
    /// `--chunk-bytes`.
    pub const CHUNK_BYTES: &str = "chunk-bytes";
    /// `--backend`.
    pub const BACKEND: &str = "backend";
    /// `--bucket-mb`.
    pub const BUCKET_MB: &str = "bucket-mb";
    /// `--bucket-mb`'s default (PyTorch DDP's `bucket_cap_mb`).
    pub const DEFAULT_BUCKET_MB: f64 = 25.0;
    /// `--hierarchy`.
    pub const HIERARCHY: &str = "hierarchy";
    /// `--master-addr`.
    pub const MASTER_ADDR: &str = "master-addr";
    /// `--master-port`.
    pub const MASTER_PORT: &str = "master-port";
    /// `--transport`.
    pub const TRANSPORT: &str = "transport";
    /// `--rank`.
    pub const RANK: &str = "rank";
    /// `--world-size`.
    pub const WORLD_SIZE: &str = "world-size";
    /// `--local-rank`.
    pub const LOCAL_RANK: &str = "local-rank";
    /// `--tls-ca`.
    pub const TLS_CA: &str = "tls-ca";
    /// `--tls-domain`.
    pub const TLS_DOMAIN: &str = "tls-domain";
    /// `--eval-every`.
    pub const EVAL_EVERY: &str = "eval-every";
    /// `--quiet`.
    pub const QUIET: &str = "quiet";
    /// `--comm-timeout`.
    pub const COMM_TIMEOUT: &str = "comm-timeout";
    /// `--no-overlap`.
    pub const NO_OVERLAP: &str = "no-overlap";
    /// `launch --nproc-per-node`.
    pub const NPROC_PER_NODE: &str = "nproc-per-node";
    /// `launch --max-restarts`.
    pub const MAX_RESTARTS: &str = "max-restarts";
}

/// gradsync worker: trains the model locally, as DataParallel replicas, against parameter
/// servers, or in a DDP ring.
#[derive(Debug, Parser)]
#[command(name = "gradsync-worker", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train the model.
    Train(Box<TrainArgs>),
    /// Start this node's ranks of a distributed run (torchrun's job): sets RANK, WORLD_SIZE,
    /// LOCAL_RANK, MASTER_ADDR, MASTER_PORT, prefixes output with the rank, stops all ranks
    /// if one fails. Example: `launch --nproc-per-node 4 -- train --mode ddp`.
    Launch(LaunchArgs),
    /// Run one process for `gradsync-bench compare --hosts` (started over ssh): its
    /// environment's secrets read from stdin, its process group stopped when stdin ends.
    #[command(hide = true)]
    Supervise(crate::supervise::SuperviseArgs),
}

/// The variables a Kubeflow TrainJob's torch runtime sets for torchrun, under their `PET_`
/// names, and the flag of `gradsync-worker launch` each stands for: (variable, flag, the
/// launcher's own variable for that flag).
pub const PET_ENV: [(&str, &str, &str); 5] = [
    ("PET_NNODES", "--nnodes", "NNODES"),
    ("PET_NPROC_PER_NODE", "--nproc-per-node", "LOCAL_WORLD_SIZE"),
    ("PET_NODE_RANK", "--node-rank", "NODE_RANK"),
    ("PET_MASTER_ADDR", "--master-addr", "MASTER_ADDR"),
    ("PET_MASTER_PORT", "--master-port", "MASTER_PORT"),
];

/// `argv` with TrainJob's `PET_*` variables ([`PET_ENV`]) read as torchrun reads them, for a
/// `launch` command: each becomes its flag, placed right after `launch`, unless the command
/// line gives that flag or the launcher's own variable is set (a flag wins over a variable,
/// the launcher's own variable over a `PET_` one). Any other command is returned as it is.
pub fn with_pet_env(
    argv: Vec<std::ffi::OsString>,
    var: impl Fn(&str) -> Option<String>,
) -> Vec<std::ffi::OsString> {
    if argv.get(1).is_none_or(|a| a != "launch") {
        return argv;
    }
    // Flags after `--` belong to the ranks' command.
    let own = argv.iter().skip(2).take_while(|a| *a != "--").map(|a| a.to_string_lossy().into_owned());
    let given: Vec<String> = own.collect();
    let mut added = Vec::new();
    for (pet, flag, plain) in PET_ENV {
        let on_line = given.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        if let Some(v) = var(pet).filter(|_| !on_line && var(plain).is_none()) {
            added.push(std::ffi::OsString::from(format!("{flag}={v}")));
        }
    }
    let mut out = argv;
    out.splice(2..2, added);
    out
}

/// Flags of `gradsync-worker launch`.
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this node.
    #[arg(long = flag::NPROC_PER_NODE, default_value_t = 1, env = "LOCAL_WORLD_SIZE")]
    pub nproc_per_node: usize,
    /// Number of nodes in the run.
    #[arg(long, default_value_t = 1, env = "NNODES")]
    pub nnodes: usize,
    /// This node's index, from 0; its ranks are node_rank * nproc_per_node onwards.
    #[arg(long, default_value_t = 0, env = "NODE_RANK")]
    pub node_rank: usize,
    /// Address of rank 0's rendezvous store (the first node).
    #[arg(long = flag::MASTER_ADDR, default_value = "127.0.0.1", env = "MASTER_ADDR")]
    pub master_addr: String,
    /// Port of the rendezvous store; 0 picks a free one (one node only). With several nodes
    /// and `--max-restarts`, the launchers' store (node 0's launcher) listens here and hands
    /// the ranks a fresh port for each generation.
    #[arg(long = flag::MASTER_PORT, default_value_t = 29500, env = "MASTER_PORT")]
    pub master_port: u16,
    /// When a rank fails, stop the ranks and start them all again, up to this many times
    /// across the job (torchrun's --max-restarts); with several nodes, every node's launcher
    /// restarts its ranks together, agreed through node 0's launcher. A `train` command must
    /// keep checkpoints (`--checkpoint DIR`, on a file system every node shares): its ranks
    /// restart with `--resume`. 0: a failure ends the run.
    #[arg(long = flag::MAX_RESTARTS, default_value_t = 0)]
    pub max_restarts: u32,
    /// With several nodes and `--max-restarts`: seconds a node may take to register, or to
    /// come back for a restart, and a launcher may stay silent (heartbeats stopped) before the
    /// others give up, naming it.
    #[arg(long, default_value_t = 60.0, value_parser = parse_rdzv_timeout)]
    pub rdzv_timeout: f64,
    /// How often the launcher checks its ranks and a stop request, seconds (torchrun's
    /// --monitor-interval); an exit is seen the moment it happens in any case.
    #[arg(long, default_value_t = 0.1, value_parser = parse_interval)]
    pub monitor_interval: f64,
    /// What each rank runs: `train ...` (this worker) or any program and its arguments.
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

/// How gradients become an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// One process, one replica: the reference every other mode must match.
    Local,
    /// One process, several replicas; replica 0 gathers, updates and broadcasts.
    Dp,
    /// Workers push gradients to parameter servers and pull parameters back.
    Ps,
    /// Every rank keeps a replica; gradients are all-reduced in buckets during backward.
    Ddp,
    /// ZeRO stage 1: gradients reduce-scattered in buckets during backward, each rank updates
    /// its 1/n of the parameters with its 1/n of the optimiser state, parameters all-gathered.
    /// Takes DDP's flags.
    Zero1,
    /// A sparse model's embedding table on parameter servers (`--servers`, started with
    /// `--table-only`; rows pushed and pulled by id), the rest all-reduced among the workers
    /// as DDP does. Takes DDP's and the PS's flags.
    Hybrid,
}

impl Mode {
    /// The name used in metrics and reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Dp => "dp",
            Mode::Ps => "ps",
            Mode::Ddp => "ddp",
            Mode::Zero1 => "zero1",
            Mode::Hybrid => "hybrid",
        }
    }
}

/// Flags of `gradsync-worker train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Training mode.
    #[arg(long = flag::MODE, value_enum, default_value_t = Mode::Local, env = "GRADSYNC_MODE")]
    pub mode: Mode,
    /// Device: auto, cpu, cuda or cuda:N.
    #[arg(long = flag::DEVICE, default_value = "auto", value_parser = parse_device, env = "GRADSYNC_DEVICE")]
    pub device: DeviceRequest,
    /// CPU threads per process (0: one per core).
    #[arg(long = flag::THREADS, default_value_t = 0, env = "GRADSYNC_THREADS")]
    pub threads: usize,
    /// Model: a preset (tiny, mnist, wide, resnet20, resnet18, vgg11, cnn8), MLP widths such as
    /// 784-256-10, or the sparse embedding[:ROWS:DIM[:HIDDEN...]][:sum|:mean], fitted to the
    /// data; or a model to replay (resnet50, vgg16, bert-base, gpt2, profile:FILE): speed only,
    /// no accuracy.
    #[arg(long = flag::MODEL, default_value = "mnist", value_parser = parse_model,
          long_help = gradsync_core::model::presets_help())]
    pub model: ModelSpec,
    /// A built-in replayed model's compute estimated at this sustained TFLOP/s (default 400:
    /// an H100 SXM in bf16 at 40% of its 989 TFLOP/s peak).
    #[arg(long = flag::DEVICE_TFLOPS)]
    pub device_tflops: Option<f64>,
    /// A built-in replayed model's memory-bound layers at this bandwidth, TB/s (default 3.35,
    /// an H100 SXM's).
    #[arg(long = flag::DEVICE_TBPS)]
    pub device_tbps: Option<f64>,
    /// Data: digits (the built-in UCI handwritten digits, 1x8x8 images), synthetic[:N[:DIM:CLASSES]],
    /// synthetic:N:CxHxW:CLASSES (images), mnist:DIR, cifar10:DIR, or for the embedding model
    /// clicks[:N[:ROWS]] (built-in click logs with a planted ground truth) or libsvm:FILE.
    /// Without it, synthetic data shaped as the model's input (clicks for the embedding model).
    #[arg(long = flag::DATA, value_parser = parse_data)]
    pub data: Option<DataSource>,
    /// Training-time augmentation: auto (CIFAR-10: crop-flip, as the notes train it; else
    /// none), none, crop-flip (random crop of the image padded by 4 pixels, then a random
    /// horizontal flip) or crop-flip:PAD. Each sample's draw depends on the seed, the epoch and
    /// the sample alone, so every mode augments as single-process training does.
    #[arg(long = flag::AUGMENT, default_value = "auto", value_parser = parse_augment)]
    pub augment: gradsync_core::data::Augment,
    /// Samples per step per worker (per replica in DP mode) [default: 64; a replayed model's
    /// profile batch, its times scaled in proportion for another].
    #[arg(long = flag::BATCH, value_parser = parse_positive)]
    pub batch: Option<usize>,
    /// Stop after this many steps (default: run the epochs).
    #[arg(long = flag::STEPS)]
    pub steps: Option<u64>,
    /// Epochs over the training split.
    #[arg(long = flag::EPOCHS, default_value_t = 1, value_parser = parse_positive)]
    pub epochs: usize,
    /// The optimiser.
    #[command(flatten)]
    pub optimiser: OptimiserArgs,
    /// Seed for initialisation, data and shuffling.
    #[arg(long = flag::SEED, default_value_t = 42, env = "GRADSYNC_SEED")]
    pub seed: u64,
    /// Do not shuffle the training data.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Drop the tail of the dataset that does not fill every rank equally.
    #[arg(long)]
    pub drop_last: bool,
    /// Evaluate on the held-out split every N steps (0: only at the end).
    #[arg(long = flag::EVAL_EVERY, default_value_t = 50)]
    pub eval_every: u64,
    /// Evaluate on the held-out split every time the samples seen by all workers together
    /// pass another multiple of N (a cadence every mode shares whatever its batch per worker;
    /// replaces --eval-every). Every rank evaluates its own parameters at the same points, so
    /// synchronous ranks pause together; the time is recorded as `eval_ms` and kept out of
    /// the training clock (`train_ms`).
    #[arg(long = flag::EVAL_SAMPLES)]
    pub eval_samples: Option<u64>,
    /// Seed of the order in which the training data is drawn (default: --seed). Repeats of a
    /// run that differ only here start from the same parameters.
    #[arg(long = flag::ORDER_SEED)]
    pub order_seed: Option<u64>,
    /// Compress gradients on the wire: none, fp16, bf16 or topk:RATIO (the RATIO largest
    /// magnitudes, with error feedback; docs/compression.md), for --mode ps (the servers'
    /// --compress must match) and --mode ddp (fp16 and bf16 with either backend, topk with
    /// the TCP backend).
    #[arg(long = flag::COMPRESS, default_value = "none", env = "GRADSYNC_COMPRESS")]
    pub compress: Compression,
    /// Write per-step metrics (JSON lines) here; `{rank}` in the path becomes the rank.
    #[arg(long = flag::METRICS, env = "GRADSYNC_METRICS")]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome trace-event timeline (forward, backward, communication, update spans) of
    /// this process here; open it in Perfetto or chrome://tracing.
    #[arg(long = flag::TRACE, env = "GRADSYNC_TRACE")]
    pub trace: Option<PathBuf>,
    /// Write the trained model here (rank 0 only): a PyTorch state dict when the path ends in
    /// .safetensors (`model.load_state_dict(safetensors.torch.load_file(path))` loads it), else
    /// a gradsync checkpoint with the momentum (MLPs only).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Start from these parameters: a gradsync checkpoint (the fingerprint must match) or a
    /// PyTorch state dict in .safetensors (names and shapes must match).
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Keep checkpoints of the run in this folder (local training, DP, DDP and ZeRO-1, whose
    /// momentum shards are gathered for it; rank 0 writes): parameters and running statistics
    /// as a PyTorch state dict, the momentum, and the step, epoch and settings a resumed run
    /// needs; each written atomically.
    #[arg(long = flag::CHECKPOINT)]
    pub checkpoint: Option<PathBuf>,
    /// Write a checkpoint every N steps (with --checkpoint).
    #[arg(long = flag::CHECKPOINT_EVERY, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: u64,
    /// Keep the newest K checkpoints, removing older ones (with --checkpoint).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_keep: u64,
    /// Continue from the newest complete checkpoint in --checkpoint's folder (from the start
    /// when it holds none); a checkpoint of another model, world size, batch or optimiser is
    /// refused, naming the difference. The run then ends with the parameters an unbroken run
    /// would have.
    #[arg(long = flag::RESUME, requires = "checkpoint")]
    pub resume: bool,
    /// Print nothing but errors.
    #[arg(long = flag::QUIET, short)]
    pub quiet: bool,
    /// Run in dilated time (docs/cluster.md): every clock of the run D times slower, every
    /// figure recorded divided back by D. A replayed model waits D times its profile's times;
    /// a model trained for real (on the CPU with --threads 1) has each training compute phase
    /// last D times the CPU time it used; timeouts, heartbeats and --slow-rank stretch by D.
    /// What an emulated cluster (`gradsync-bench cluster --dilate`) gives every process,
    /// with its links at rate / D.
    #[arg(long = flag::DILATE, default_value_t = 1.0, value_parser = parse_dilation, env = "GRADSYNC_DILATE")]
    pub dilate: f64,
    /// With --dilate, a model trained for real: compute one phase at a time with every process
    /// given the same FILE (an exclusive lock on it is the turn), so that processes sharing
    /// cores compute as hosts of their own would, without one's caches and memory traffic
    /// stalling the other's (and its CPU time, which paces the phase, growing with it). The
    /// wait for a turn falls inside the phase's D-times-longer window; a phase it pushes past
    /// that window counts as under-dilated. What an emulated cluster gives its workers.
    #[arg(long = flag::COMPUTE_TURNS, value_name = "FILE", env = "GRADSYNC_COMPUTE_TURNS")]
    pub compute_turns: Option<PathBuf>,
    /// Inject a straggler: rank R (replica R in DP) sleeps MS milliseconds before every
    /// step's forward pass. Written as R:MS, e.g. 1:50; recorded in the metrics header.
    #[arg(long = flag::SLOW_RANK, value_parser = parse_slow_rank, env = "GRADSYNC_SLOW_RANK")]
    pub slow_rank: Option<SlowRank>,
    /// Distributed-run identity (DDP and PS).
    #[command(flatten)]
    pub dist: DistArgs,
    /// DataParallel flags.
    #[command(flatten)]
    pub dp: DpArgs,
    /// Parameter-server flags.
    #[command(flatten)]
    pub ps: PsArgs,
    /// DDP flags (ZeRO-1's too).
    #[command(flatten)]
    pub ddp: DdpArgs,
}

/// `--mode dp`.
#[derive(Debug, Clone, Args, Default)]
pub struct DpArgs {
    /// Replicas in the process (threads on the CPU; spread over the visible GPUs, several per
    /// GPU allowed). Defaults to --world-size.
    #[arg(long = flag::REPLICAS)]
    pub replicas: Option<usize>,
    /// Fault injection for the fault suite: replica K fails in step N, by panicking
    /// (`K:N:panic`) or as a failing device would, with an error (`K:N:error`). Hidden: a
    /// test's tool, not a training option.
    #[arg(long, hide = true, value_parser = parse_replica_fault, env = "GRADSYNC_DP_FAULT")]
    pub fail_replica: Option<ReplicaFault>,
}

fn parse_replica_fault(s: &str) -> Result<ReplicaFault, String> {
    let parts: Vec<&str> = s.split(':').map(str::trim).collect();
    let [k, n, kind] = parts[..] else {
        return Err(format!("'{s}': expected REPLICA:STEP:panic|error, e.g. 1:3:panic"));
    };
    let replica = k.parse().map_err(|e| format!("'{s}': replica '{k}': {e}"))?;
    let step = n.parse().map_err(|e| format!("'{s}': step '{n}': {e}"))?;
    let kind = match kind {
        "panic" => FaultKind::Panic,
        "error" => FaultKind::Error,
        other => return Err(format!("'{s}': kind '{other}': expected panic or error")),
    };
    Ok(ReplicaFault { replica, step, kind })
}

/// `--mode ps`.
#[derive(Debug, Clone, Args, Default)]
pub struct PsArgs {
    /// Parameter servers, host:port[,host:port...]: one per shard, in shard order.
    #[arg(long = flag::SERVERS, env = "GRADSYNC_SERVERS", value_delimiter = ',')]
    pub servers: Vec<String>,
    /// Shared secret sent with every request.
    #[arg(long, env = "GRADSYNC_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Seconds any one request to a server may take before the worker gives up.
    #[arg(long, default_value_t = 60.0)]
    pub rpc_timeout: f64,
    /// Seconds to wait for the servers to accept connections, retrying with back-off: a
    /// worker may start before its servers (0: one attempt).
    #[arg(long, default_value_t = 300.0, env = "GRADSYNC_CONNECT_TIMEOUT")]
    pub connect_timeout: f64,
    /// Payload bytes per pushed chunk (default: the size each server announces, chosen from
    /// its shard's size: pushes then line up with the blocks it steps and streams).
    #[arg(long = flag::CHUNK_BYTES)]
    pub chunk_bytes: Option<usize>,
    /// Talk TLS to the servers, trusting this CA certificate (PEM).
    #[arg(long = flag::TLS_CA, env = "GRADSYNC_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// The name the servers' certificates carry (default: the host in --servers).
    #[arg(long = flag::TLS_DOMAIN, requires = "tls_ca")]
    pub tls_domain: Option<String>,
    /// Under BSP, push the whole gradient and only then pull the parameters, rather than
    /// pulling the next version block by block while pushing (the pipelined step). For
    /// comparisons: on one host the two are level; over a link-bound network pipelining is
    /// faster (docs/ps.md).
    #[arg(long)]
    pub no_pipeline: bool,
}

/// `--mode ddp` and `--mode zero1`.
#[derive(Debug, Clone, Args, Default)]
pub struct DdpArgs {
    /// Collective backend.
    #[arg(long = flag::BACKEND, value_enum, default_value_t = Backend::Tcp)]
    pub backend: Backend,
    /// Gradient bucket size in MB (DDP's bucket_cap_mb).
    #[arg(long = flag::BUCKET_MB, default_value_t = flag::DEFAULT_BUCKET_MB)]
    pub bucket_mb: f64,
    /// Synchronise gradients every K steps, accumulating in between (DDP's no_sync).
    #[arg(long, default_value_t = 1)]
    pub sync_every: u64,
    /// How DDP moves an embedding model's table: dense (the whole table's gradient all-reduced
    /// with the other buckets, zeros included, as nn.EmbeddingBag under DDP) or allgather (the
    /// rows each rank's batch named, ids and values, all-gathered and summed, as DDP does with
    /// sparse=True).
    #[arg(long = flag::SPARSE_GRADS, value_enum, default_value_t = SparseGrads::Dense)]
    pub sparse_grads: SparseGrads,
    /// Address of rank 0's rendezvous store (MASTER_ADDR, else the first Slurm host).
    #[arg(long = flag::MASTER_ADDR, env = "MASTER_ADDR")]
    pub master_addr: Option<String>,
    /// Port of rank 0's rendezvous store.
    #[arg(long = flag::MASTER_PORT, env = "MASTER_PORT")]
    pub master_port: Option<u16>,
    /// Seconds any blocking collective or rendezvous call may wait before failing.
    #[arg(long = flag::COMM_TIMEOUT, default_value_t = 60.0)]
    pub comm_timeout: f64,
    /// Shared secret each side of every ring connection proves it knows (HMAC-SHA256
    /// challenge-response; never sent). Use a long random one.
    #[arg(long, env = "GRADSYNC_RING_TOKEN", hide_env_values = true)]
    pub ring_token: Option<String>,
    /// Ring chunk size in KiB: the unit of pipelining on the TCP ring. Default: 1024, or 256
    /// where a flat ring on sockets has more ranks on a machine than it has cores (every rank
    /// must be given the same).
    #[arg(long, value_parser = parse_positive)]
    pub chunk_kb: Option<usize>,
    /// How the TCP backend's ring reaches its neighbours: auto (shared memory when every rank
    /// is on this host and in this network namespace, else sockets), tcp, or shm (fail
    /// unless shared memory works). Every rank must be given the same value.
    #[arg(long = flag::TRANSPORT, value_enum, default_value_t = Transport::Auto, env = "GRADSYNC_TRANSPORT")]
    pub transport: Transport,
    /// Whether the TCP backend's all-reduce goes through the hosts when ranks share them:
    /// auto (reduce inside each host, ring among one leader per host, broadcast inside, when
    /// there are several hosts and one holds several ranks; else one flat ring), off (always
    /// the flat ring), on (always through the hosts). Hosts are told apart by boot id and
    /// network namespace. Every rank must be given the same value.
    #[arg(long = flag::HIERARCHY, value_enum, default_value_t = Hierarchy::Auto, env = "GRADSYNC_HIERARCHY")]
    pub hierarchy: Hierarchy,
    /// The host this rank counts as on, instead of the one it finds (boot id and network
    /// namespace), as NCCL's NCCL_HOSTID: ranks given the same value are one host to
    /// --hierarchy. Shared memory is still used only between ranks it reaches.
    #[arg(long, env = "GRADSYNC_HOST_ID")]
    pub host_id: Option<String>,
    /// Reduce each bucket after the whole backward pass instead of during it (to measure what
    /// overlap buys; GPU engines with --backend tcp always do this).
    #[arg(long = flag::NO_OVERLAP)]
    pub no_overlap: bool,
    /// Synchronised batch norm (PyTorch's SyncBatchNorm): each batch norm normalises with the
    /// mean and variance of every rank's batch together, all-reduced in forward, and its
    /// input gradient from sums all-reduced in backward with the gradient buckets, over the
    /// same backend (tcp on sockets or shared memory, flat or through the hosts, or nccl);
    /// training then matches one process with the combined batch. Without it each rank
    /// normalises with its own batch and rank 0's running statistics are broadcast every step
    /// (DDP's broadcast_buffers). Needs --sync-every 1.
    #[arg(long)]
    pub sync_bn: bool,
}

impl DdpArgs {
    /// The store's `host:port`: --master-addr / MASTER_ADDR, else the first host of Slurm's
    /// node list, else 127.0.0.1 for a single-node run; --master-port / MASTER_PORT, else
    /// 29500.
    pub fn master(&self) -> anyhow::Result<String> {
        let slurm = ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .and_then(|l| crate::rendezvous::first_slurm_host(&l));
        let host = self.master_addr.clone().or(slurm).unwrap_or_else(|| "127.0.0.1".into());
        let port = self.master_port.unwrap_or(29500);
        anyhow::ensure!(port != 0, "--master-port 0: every rank must know the store's port; use a fixed one");
        Ok(if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        })
    }
}

/// Who this process is in a distributed run: torchrun's flags and variables, or Slurm's.
#[derive(Debug, Clone, Args, Default)]
pub struct DistArgs {
    /// This process's rank (RANK, else SLURM_PROCID).
    #[arg(long = flag::RANK, env = "RANK")]
    pub rank: Option<usize>,
    /// Number of worker processes (WORLD_SIZE, else SLURM_NTASKS).
    #[arg(long = flag::WORLD_SIZE, env = "WORLD_SIZE")]
    pub world_size: Option<usize>,
    /// Rank within this node, which picks the GPU for `--device auto` (LOCAL_RANK, else
    /// SLURM_LOCALID).
    #[arg(long = flag::LOCAL_RANK, env = "LOCAL_RANK")]
    pub local_rank: Option<usize>,
}

impl DistArgs {
    /// (rank, world size), falling back to Slurm's variables, then to a single process.
    pub fn resolve(&self) -> anyhow::Result<(usize, usize)> {
        let slurm = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok());
        let rank = self.rank.or_else(|| slurm("SLURM_PROCID")).unwrap_or(0);
        let world = self.world_size.or_else(|| slurm("SLURM_NTASKS")).unwrap_or(1);
        anyhow::ensure!(world >= 1, "--world-size must be at least 1");
        anyhow::ensure!(rank < world, "--rank {rank} is not below --world-size {world}");
        Ok((rank, world))
    }

    /// The local rank (LOCAL_RANK, SLURM_LOCALID, else 0).
    pub fn local(&self) -> usize {
        self.local_rank
            .or_else(|| std::env::var("SLURM_LOCALID").ok().and_then(|v| v.parse().ok()))
            .unwrap_or(0)
    }
}

/// `--slow-rank R:MS`: the rank to delay and by how much per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowRank {
    /// The delayed rank (replica in DP).
    pub rank: usize,
    /// Milliseconds of delay before each step's forward pass.
    pub ms: u64,
}

impl SlowRank {
    /// The delay.
    pub fn delay(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.ms)
    }

    /// Refuse a rank that is not in a run of `world` ranks (replicas in DP).
    pub fn check(self, world: usize) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.rank < world,
            "--slow-rank {}:{}: rank {} is not below the world size {world}",
            self.rank,
            self.ms,
            self.rank
        );
        Ok(())
    }
}

fn parse_slow_rank(s: &str) -> Result<SlowRank, String> {
    let (r, ms) = s.split_once(':').ok_or_else(|| format!("'{s}': expected RANK:MS, e.g. 1:50"))?;
    let rank = r.trim().parse().map_err(|e| format!("'{s}': rank '{r}': {e}"))?;
    let ms = ms.trim().parse().map_err(|e| format!("'{s}': milliseconds '{ms}': {e}"))?;
    Ok(SlowRank { rank, ms })
}

/// A time-dilation factor, from 1 to [`gradsync_core::dilation::Dilation::MAX`].
pub fn parse_dilation(s: &str) -> Result<f64, String> {
    let d: f64 = s.trim().parse().map_err(|e| format!("'{s}': {e}"))?;
    gradsync_core::dilation::Dilation::new("--dilate", d).map(|d| d.factor()).map_err(|e| e.to_string())
}

fn parse_device(s: &str) -> Result<DeviceRequest, String> {
    s.parse().map_err(|e: gradsync_core::Error| e.to_string())
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.001..=60.0).contains(&v) => Ok(v),
        _ => Err(format!("'{s}' is not a number of seconds from 0.001 to 60")),
    }
}

fn parse_rdzv_timeout(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.1..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!("'{s}' is not a number of seconds from 0.1 to 86400")),
    }
}

fn parse_model(s: &str) -> Result<ModelSpec, String> {
    ModelSpec::parse(s).map_err(|e| e.to_string())
}

fn parse_augment(s: &str) -> Result<gradsync_core::data::Augment, String> {
    s.parse().map_err(|e: gradsync_core::Error| e.to_string())
}

fn parse_data(s: &str) -> Result<DataSource, String> {
    s.parse().map_err(|e: gradsync_core::Error| e.to_string())
}

fn parse_positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("'{s}': {e}")),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_trainjobs_pet_variables_stand_for_the_launchers_flags_unless_given() {
        use super::{Cli, Command, with_pet_env};
        use clap::Parser;
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let argv = |a: &[&str]| a.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        let pet: &'static [(&str, &str)] = &[
            ("PET_NNODES", "2"),
            ("PET_NPROC_PER_NODE", "4"),
            ("PET_NODE_RANK", "1"),
            ("PET_MASTER_ADDR", "job-node-0-0.job"),
            ("PET_MASTER_PORT", "29400"),
        ];
        let launch = |a: Vec<std::ffi::OsString>| match Cli::try_parse_from(a) {
            Ok(Cli { command: Command::Launch(l) }) => l,
            other => panic!("{other:?}"),
        };
        let l = launch(with_pet_env(
            argv(&["gradsync-worker", "launch", "--", "train", "--nnodes", "9"]),
            env(pet),
        ));
        assert_eq!((l.nnodes, l.nproc_per_node, l.node_rank), (2, 4, 1));
        assert_eq!((l.master_addr.as_str(), l.master_port), ("job-node-0-0.job", 29400));
        assert_eq!(l.cmd, ["train", "--nnodes", "9"], "the ranks' command is left alone");
        // A flag on the command line, or the launcher's own variable, wins.
        let with_own: &'static [(&str, &str)] =
            &[("PET_NODE_RANK", "1"), ("NODE_RANK", "3"), ("PET_NNODES", "4")];
        let a =
            with_pet_env(argv(&["gradsync-worker", "launch", "--nnodes", "5", "--", "train"]), env(with_own));
        assert_eq!(a, argv(&["gradsync-worker", "launch", "--nnodes", "5", "--", "train"]));
        // Another command is untouched.
        let t = argv(&["gradsync-worker", "train", "--mode", "local"]);
        assert_eq!(with_pet_env(t.clone(), env(pet)), t);
    }

    use clap::CommandFactory;

    /// `train --help` names every data source `--data` accepts, the README's default
    /// (`digits`) among them.
    #[test]
    fn the_data_help_names_every_source() {
        let mut cli = super::Cli::command();
        let train = cli.find_subcommand_mut("train").map(|c| c.render_long_help().to_string());
        let help = train.unwrap_or_default();
        let data = help.split("--data <DATA>").nth(1).unwrap_or_default();
        let data = data.split("\n  -").next().unwrap_or_default();
        for source in ["digits", "synthetic", "mnist:DIR", "cifar10:DIR"] {
            assert!(data.contains(source), "--data's help omits {source}:\n{data}");
        }
    }
}
