//! gradsync's micro-benchmarks, and `gradsync-bench`'s command line: the comparison's commands
//! (`compare`, `plot`, `cluster`, `advise`, `rawtcp-peer`) are [`gradsync_compare`]'s, the others this
//! crate's.
//!
//! # Layout
//! - [`cli`]: the subcommands of `gradsync-bench`.
//! - [`step`]: time of one forward+backward+update step, and GFLOP/s, per device, beside
//!   PyTorch eager when a Python with torch is given.
//! - [`convbench`]: each pass of one 3x3 convolution on the CPU by each way gradsync computes
//!   it (direct kernels, Winograd, column matrix).
//! - [`collective`]: all-reduce time, algbw and busbw per backend, size and rank count, one
//!   process per rank (gradsync's and gloo's alike), on loopback or emulated hosts, beside raw
//!   TCP and PyTorch gloo.
//! - [`overlap`]: the share of DDP's communication hidden behind backward, from real runs.
//! - [`replay`]: a replayed model's profile (`show`), and one worker's replay against its
//!   compute (`check`).
//! - [`restart`]: what `launch --max-restarts` costs, from real runs with ranks SIGKILLed.
//! - [`diff`]: how far apart two parameter files are.
//! - [`export`]: gradsync checkpoints (whole, or a parameter server's shards) as one PyTorch
//!   state dict.
//! - [`ps`]: parameter-server push+pull throughput for model sizes, workers and shards, tonic's
//!   default HTTP/2 settings beside the tuned ones, as a ratio to raw TCP.
//! - [`pytorch`]: where the PyTorch scripts are, found at run time beside the binary or in the
//!   working directory (`--pytorch-dir` overrides).

pub mod cli;
pub mod collective;
pub mod convbench;
pub mod diff;
pub mod export;
pub mod overlap;
pub mod ps;
pub mod pytorch;
pub mod replay;
pub mod restart;
pub mod step;

/// Run the parsed command line; the binary's whole body.
pub fn main_with_args(cli: cli::Cli) -> anyhow::Result<()> {
    match cli.command {
        cli::Command::Step(a) => step::run(&a),
        cli::Command::Conv(a) => convbench::run(&a),
        cli::Command::Compare(a) => gradsync_compare::run_compare(&a),
        cli::Command::Advise(a) => gradsync_compare::advise::run(&a),
        cli::Command::Validate(a) => gradsync_compare::advise::run_validate(&a),
        cli::Command::Plot(a) => gradsync_compare::run_plot(&a),
        cli::Command::Collective(a) => collective::run(&a),
        cli::Command::CollectiveRank(a) => collective::run_rank(&a),
        cli::Command::Overlap(a) => overlap::run(&a),
        cli::Command::Diff(a) => diff::run(&a),
        cli::Command::Export(a) => export::run(&a),
        cli::Command::Ps(a) => ps::run(&a),
        cli::Command::Cluster(a) => gradsync_compare::cluster::run(&a),
        cli::Command::Replay(a) => replay::run(&a),
        cli::Command::Restart(a) => restart::run(&a),
        cli::Command::RawtcpPeer(a) => gradsync_compare::rawtcp::run_peer(&a),
    }
}
