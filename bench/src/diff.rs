//! `gradsync-bench diff A B`: how far apart two parameter files are, per layer and overall, and
//! a non-zero exit when they differ by more than `--tol`. The GPU check uses it to compare runs
//! on different devices and in different modes.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use gradsync_core::checkpoint::Checkpoint;

/// Flags of `gradsync-bench diff`.
#[derive(Debug, Clone, Args)]
pub struct DiffArgs {
    /// The first parameter file.
    pub a: PathBuf,
    /// The second parameter file.
    pub b: PathBuf,
    /// Largest allowed relative difference: max|a-b| / max(max|a|, 1e-3).
    #[arg(long, default_value_t = 1e-5)]
    pub tol: f64,
}

/// The largest absolute and relative differences between two parameter vectors.
pub fn distance(a: &[f32], b: &[f32]) -> (f64, f64) {
    let max_abs = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max);
    let scale = a.iter().map(|x| f64::from(x.abs())).fold(1e-3, f64::max);
    (max_abs, max_abs / scale)
}

/// Compare and print; an error when they differ beyond the tolerance.
pub fn run(a: &DiffArgs) -> anyhow::Result<()> {
    let ca = Checkpoint::load(&a.a).with_context(|| format!("reading {}", a.a.display()))?;
    let cb = Checkpoint::load(&a.b).with_context(|| format!("reading {}", a.b.display()))?;
    anyhow::ensure!(
        ca.header.fingerprint == cb.header.fingerprint,
        "different models: {} vs {}",
        ca.header.fingerprint,
        cb.header.fingerprint
    );
    anyhow::ensure!(
        (ca.header.start, ca.header.end) == (cb.header.start, cb.header.end),
        "different parameter ranges"
    );
    let (abs, rel) = distance(&ca.params, &cb.params);
    println!(
        "{} vs {}: {} parameters, max |a-b| = {abs:.3e}, relative {rel:.3e} (tolerance {:.1e})",
        a.a.display(),
        a.b.display(),
        ca.params.len(),
        a.tol
    );
    anyhow::ensure!(rel <= a.tol, "parameters differ by {rel:.3e} relative, above {:.1e}", a.tol);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn distance_is_relative_to_the_largest_value() {
        let (abs, rel) = super::distance(&[1.0, -4.0], &[1.0, -4.002]);
        assert!((abs - 0.002).abs() < 1e-6);
        assert!((rel - 0.0005).abs() < 1e-6);
    }
}
