//! `gradsync-bench export CHECKPOINT... --out PATH.safetensors`: gradsync's own parameter files
//! (a worker's `--save`, or every parameter-server shard's checkpoint) as one PyTorch state
//! dict. The model comes from the files' fingerprint; the shards must tile the flat buffer.
//! A server holds parameters only: a model with batch norm gets its initial running statistics,
//! and is told so (a worker's `--save PATH.safetensors` carries its own).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use gradsync_core::checkpoint::Checkpoint;
use gradsync_core::model::{Fingerprint, Layout, init_buffers};
use gradsync_core::state_dict;

/// Flags of `gradsync-bench export`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// gradsync checkpoints of one model: a whole one, or every shard's.
    #[arg(required = true)]
    pub checkpoints: Vec<PathBuf>,
    /// The PyTorch state dict to write (safetensors).
    #[arg(long)]
    pub out: PathBuf,
}

/// Stitch, convert, write.
pub fn run(a: &ExportArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        gradsync_core::state_dict::is_state_dict(&a.out),
        "--out {}: a PyTorch state dict is written as .safetensors",
        a.out.display()
    );
    let mut parts = a
        .checkpoints
        .iter()
        .map(|p| Checkpoint::load(p).with_context(|| format!("reading {}", p.display())).map(|c| (p, c)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let fingerprint = parts[0].1.header.fingerprint.clone();
    for (p, c) in &parts {
        anyhow::ensure!(
            c.header.fingerprint == fingerprint,
            "{} is another model ({}) than {} ({fingerprint})",
            p.display(),
            c.header.fingerprint,
            parts[0].0.display()
        );
    }
    let spec = Fingerprint { text: fingerprint.clone() }.spec()?;
    let layout = Layout::new(&spec);
    parts.sort_by_key(|(_, c)| c.header.start);
    let mut params = Vec::with_capacity(layout.len);
    for (p, c) in &parts {
        anyhow::ensure!(
            c.header.start == params.len(),
            "{} holds parameters {}..{}, but {} were expected next (a shard missing or given twice)",
            p.display(),
            c.header.start,
            c.header.end,
            params.len()
        );
        params.extend_from_slice(&c.params);
    }
    anyhow::ensure!(
        params.len() == layout.len,
        "the checkpoints hold parameters 0..{} of the model's {} (a shard missing)",
        params.len(),
        layout.len
    );
    let step = parts.iter().map(|(_, c)| c.header.step).max().unwrap_or(0);
    let tensors = state_dict::from_model(&layout, &params, &init_buffers(&layout), step);
    let meta = [("fingerprint", fingerprint.clone()), ("step", step.to_string())];
    state_dict::save(&a.out, &tensors, &meta)?;
    println!(
        "{}: {} ({} parameters in {} tensors, step {step}) from {} file(s)",
        a.out.display(),
        spec.label(),
        layout.len,
        layout.params.len(),
        parts.len()
    );
    if layout.buffers_len > 0 {
        println!(
            "note: gradsync checkpoints hold no batch-norm statistics; the file has the initial ones (means 0, \
             variances 1). A worker's --save PATH.safetensors carries its own."
        );
    }
    Ok(())
}
