//! gradsync's worker: the training loop and every way of synchronising gradients.
//!
//! # Layout
//! - [`cli`]: the flags of `gradsync-worker` (clap, with torchrun and Slurm variables).
//! - [`modes`]: the modes `gradsync-bench compare` compares, declared once: each one's name,
//!   the flags that make it, its servers, its wire, what it needs and its family.
//! - [`setup`]: from the flags to a run: the resolved [`setup::Run`] and the strategy its
//!   `--mode` names, each with its own typed configuration (the one match on the mode).
//! - [`train`]: the training loop, written once, in phases (start or resume, metrics header,
//!   step, evaluation, checkpoint, end); each step's batch, the progress shown, the saved model.
//! - [`strategy`]: the [`strategy::Strategy`] seam and one file per mode behind it; each mode
//!   owns what differs (its checkpoint and resumption, reading the next batch ahead).
//! - [`ps`]: the parameter-server client (`PsClient`: register, push, pull, heartbeat),
//!   its connections, bulk RPCs over HTTP/2 frames, and the engine's memory as their source
//!   and destination; `strategy::ps` drives it, `gradsync-bench ps` uses it directly.
//! - [`collective`]: collectives between ranks behind one trait: the host communicator
//!   (`comm`) running the algorithms (`ring`, `chain`, the hierarchical all-reduce in
//!   `hier`) over groups of ranks (`group`) and links (the TCP mesh in `tcp`, socket engines
//!   in `pump`, shared-memory rings between ranks of one host in `shm`), and NCCL; for tests,
//!   a simulated network under the same algorithms (`sim`).
//! - [`rendezvous`]: rank 0's store through which ranks exchange addresses and the NCCL id.
//! - [`resume`]: checkpoints of a run in progress (`--checkpoint`) and `--resume` from them.
//! - [`launch`]: `gradsync-worker launch`, torchrun's job: start the local ranks, prefix their
//!   output, stop them all if one fails, restart them from their checkpoints
//!   (`--max-restarts`).
//! - [`restarts`]: restarts agreed across nodes: the launchers' store, in node 0's launcher,
//!   numbering the run's generations so that every node's ranks restart together.
//! - [`supervise`]: `gradsync-worker supervise`, how a process runs on another host over ssh:
//!   secrets from stdin into its environment, its process group stopped when the connection
//!   closes.
//!
//! Errors: each library area returns its own thiserror enum, since they fail in different
//! words: the collectives and the rendezvous [`collective::CollectiveError`], the
//! parameter-server client [`ps::PsError`], the strategies [`strategy::StrategyError`] (which
//! wraps the others' as it drives them), each in the area's `error.rs`, and the checkpoints
//! [`resume::ResumeError`], beside the one file they live in. The subcommands' bodies are the
//! binary's edge: `train` (its flags checked in `cli` and `setup`, the loop in `train`), `launch`
//! with `restarts`, and `supervise` return `anyhow` errors, which [`main_with_args`] hands to
//! `main` to print with their sources.

pub mod cli;
pub mod collective;
pub mod launch;
pub mod modes;
pub mod ps;
pub mod rendezvous;
pub mod restarts;
pub mod resume;
pub mod setup;
pub mod strategy;
pub mod supervise;
pub mod train;

/// Parse the command line and run it; the binary's whole body.
pub fn main_with_args(cli: cli::Cli) -> anyhow::Result<()> {
    match cli.command {
        cli::Command::Train(args) => {
            train::train(*args)?;
            Ok(())
        }
        cli::Command::Launch(args) => {
            let worker = std::env::current_exe()?;
            launch::stop_on_signals();
            launch::launch(&args, &worker, std::sync::Arc::default())
        }
        cli::Command::Supervise(args) => std::process::exit(supervise::supervise(&args)?),
    }
}
