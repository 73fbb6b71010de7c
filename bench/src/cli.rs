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
    /// Compare two parameter files; fail beyond a tolerance.
    Diff(crate::diff::DiffArgs),
}
