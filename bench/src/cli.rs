//! `gradsync-bench` subcommands.

use clap::{Parser, Subcommand};

/// gradsync benchmarks: figures printed side by side, never pass/fail.
#[derive(Debug, Parser)]
#[command(name = "gradsync-bench", version, about)]
pub struct Cli {
    /// Which benchmark.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Time per training step (forward + backward + update) and GFLOP/s per device.
    Step(crate::step::StepArgs),
    /// Each pass of a 3x3 convolution on the CPU by each way gradsync computes it: direct
    /// kernels, Winograd, column matrix.
    Conv(crate::convbench::ConvArgs),
    /// Run an experiment matrix (every mode x workers x models x batches x shards) with real
    /// server and worker processes, then write tables, charts and report.html.
    Compare(Box<gradsync_compare::CompareArgs>),
    /// Which configuration to train a model with on a cluster (ring or parameter server, how
    /// many servers, bucket size, compression): every one predicted, ranked, the pick and why.
    Advise(Box<gradsync_compare::advise::AdviseArgs>),
    /// The advisor's predictions against emulated clusters' runs (scripts/advisor-matrix.sh):
    /// each run's measured step beside the advisor's and the alpha-beta model's, the errors,
    /// and each group's pick against its fastest measured design.
    Validate(gradsync_compare::advise::ValidateArgs),
    /// Rebuild tables, charts and report.html from run directories (or any directories of
    /// metrics files, walked recursively).
    Plot(gradsync_compare::PlotArgs),
    /// All-reduce bandwidth per backend, size and rank count (nccl-tests style), beside raw
    /// TCP and PyTorch gloo.
    Collective(crate::collective::CollectiveArgs),
    /// One rank of `collective` in its own process (started by `collective`).
    #[command(hide = true)]
    CollectiveRank(crate::collective::RankArgs),
    /// How much of DDP's communication hides behind backward, from real DDP processes.
    Overlap(crate::overlap::OverlapArgs),
    /// Compare two parameter files; fail beyond a tolerance.
    Diff(crate::diff::DiffArgs),
    /// gradsync checkpoints (a worker's, or every parameter-server shard's) as one PyTorch
    /// state dict in safetensors.
    Export(crate::export::ExportArgs),
    /// Parameter-server push+pull throughput (BSP), tonic defaults vs tuned, against raw TCP.
    Ps(crate::ps::PsBenchArgs),
    /// The comparison's runs on an emulated cluster: one network namespace per host, links
    /// shaped with tc (rate, delay, loss); needs root and iproute2.
    Cluster(gradsync_compare::cluster::ClusterArgs),
    /// A replayed model (resnet50, vgg16, bert-base, gpt2, profile:FILE): its profile, and
    /// how faithfully one worker replays its compute.
    Replay(crate::replay::ReplayArgs),
    /// What `launch --max-restarts` costs: real DDP runs whose ranks are SIGKILLed at random
    /// steps, the time from each kill to the restart, the restored checkpoint and the next step.
    Restart(crate::restart::RestartArgs),
    /// One end of the raw-TCP yardstick between two hosts (`compare --hosts` starts both).
    #[command(hide = true)]
    RawtcpPeer(gradsync_compare::rawtcp::PeerArgs),
}
