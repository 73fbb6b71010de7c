//! gradsync's worker: the training loop and every way of synchronising gradients.
//!
//! # Layout
//! - [`cli`]: the flags of `gradsync-worker` (clap, with torchrun and Slurm variables).
//! - [`train`]: the training loop, written once: data, sampler, evaluation, metrics, saving.
//! - [`strategy`]: the [`strategy::Strategy`] seam and one file per mode behind it.

pub mod cli;
pub mod strategy;
pub mod train;

/// Parse the command line and run it; the binary's whole body.
pub fn main_with_args(cli: cli::Cli) -> anyhow::Result<()> {
    match cli.command {
        cli::Command::Train(args) => {
            train::train(*args)?;
            Ok(())
        }
    }
}
