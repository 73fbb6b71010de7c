//! The model in files: `--save` writes it and `--load` reads it, as a PyTorch state dict
//! (safetensors, with running statistics) or a gradsync checkpoint (parameters and momentum),
//! refusing another model's.

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::checkpoint::{Checkpoint, CheckpointHeader};
use gradsync_core::model::Fingerprint;
use gradsync_core::state_dict::is_state_dict;

/// Write the engine's state to `path`: as a PyTorch state dict in safetensors (parameters,
/// running statistics and `num_batches_tracked` under PyTorch's names; the fingerprint and step
/// in its metadata) when the path ends in `.safetensors`, else as a gradsync checkpoint
/// (parameters and momentum), which cannot hold batch-norm statistics.
pub fn save_params(
    engine: &Engine,
    path: &std::path::Path,
    fp: &Fingerprint,
    step: u64,
) -> anyhow::Result<()> {
    if is_state_dict(path) {
        let meta = [
            ("fingerprint", fp.text.clone()),
            ("step", step.to_string()),
            ("gradsync", gradsync_core::VERSION.into()),
        ];
        return gradsync_core::state_dict::save(path, &engine.state_dict()?, &meta).context("--save");
    }
    anyhow::ensure!(
        engine.layout().buffers_len == 0,
        "--save {}: this model has batch-norm statistics, which a gradsync checkpoint does not hold; \
         save it as a PyTorch state dict (a path ending in .safetensors)",
        path.display()
    );
    let n = engine.layout().len;
    let mut momentum = vec![0.0; n];
    engine.read_momentum(&mut momentum)?;
    Checkpoint {
        header: CheckpointHeader {
            fingerprint: fp.text.clone(),
            step,
            start: 0,
            end: n,
            has_momentum: true,
            version: gradsync_core::VERSION.into(),
        },
        params: engine.params()?,
        momentum: Some(momentum),
    }
    .save(path)
    .context("--save")?;
    Ok(())
}

/// Read parameters (and momentum) from `path`, refusing another model's: a gradsync checkpoint
/// by its fingerprint, a PyTorch state dict (`.safetensors`, from gradsync or from PyTorch's
/// `save_file(model.state_dict())`) by its tensors' names and shapes.
pub fn load_params(engine: &mut Engine, path: &std::path::Path, fp: &Fingerprint) -> anyhow::Result<()> {
    if is_state_dict(path) {
        let tensors = gradsync_core::state_dict::load(path).context("--load")?;
        let (params, buffers) =
            gradsync_core::state_dict::to_model(path, engine.layout(), &tensors).context("--load")?;
        engine.write_params(0, &params)?;
        if let Some(b) = buffers {
            engine.write_buffers(&b)?;
        }
        return Ok(());
    }
    let ck = Checkpoint::load(path).context("--load")?;
    fp.check(&ck.header.fingerprint).with_context(|| format!("--load {}", path.display()))?;
    anyhow::ensure!(
        ck.header.start == 0 && ck.header.end == engine.layout().len,
        "--load {}: holds parameters {}..{}, the model has {}",
        path.display(),
        ck.header.start,
        ck.header.end,
        engine.layout().len
    );
    engine.write_params(0, &ck.params)?;
    if let Some(m) = &ck.momentum {
        engine.write_momentum(m)?;
    }
    Ok(())
}
