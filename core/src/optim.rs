//! SGD with momentum and weight decay, PyTorch's `torch.optim.SGD` semantics (dampening 0,
//! no Nesterov): `g = s*grad + wd*p; m = mu*m + g; p -= lr*m`. The momentum buffer starts at
//! zero, which gives PyTorch's first step (`m = g`) exactly.
//!
//! This host version serves the CPU device and the parameter server; the CUDA device runs the
//! same arithmetic as an NVRTC kernel.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// The long names of the optimiser's flags ([`OptimiserArgs`]), for programs that write
/// them (`gradsync-bench compare`).
pub mod flag {
    /// `--lr`.
    pub const LR: &str = "lr";
    /// `--momentum`.
    pub const MOMENTUM: &str = "momentum";
    /// `--weight-decay`.
    pub const WEIGHT_DECAY: &str = "weight-decay";
}

/// Optimiser hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum coefficient (0 disables).
    pub momentum: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
}

impl SgdConfig {
    /// The defaults of every command line that takes them (worker and server must agree: the
    /// server applies the updates a local run would).
    pub const DEFAULT: SgdConfig = SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 1e-4 };
}

/// The optimiser's flags, one definition for every command line that takes them
/// (`gradsync-worker train` and `gradsync-server`). Each is optional so a worker can leave the
/// choice to the parameter servers; [`OptimiserArgs::sgd`] fills in the defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, clap::Args)]
pub struct OptimiserArgs {
    /// Learning rate [default: 0.05]. Parameter servers apply their own: a PS worker leaves it
    /// out or gives the same value (a different one is an error naming both).
    #[arg(long = flag::LR)]
    pub lr: Option<f32>,
    /// SGD momentum [default: 0.9]; as --lr.
    #[arg(long = flag::MOMENTUM)]
    pub momentum: Option<f32>,
    /// L2 weight decay [default: 0.0001]; as --lr.
    #[arg(long = flag::WEIGHT_DECAY)]
    pub weight_decay: Option<f32>,
}

impl OptimiserArgs {
    /// The optimiser the flags ask for, defaults filled in.
    pub fn sgd(&self) -> SgdConfig {
        let d = SgdConfig::DEFAULT;
        SgdConfig {
            lr: self.lr.unwrap_or(d.lr),
            momentum: self.momentum.unwrap_or(d.momentum),
            weight_decay: self.weight_decay.unwrap_or(d.weight_decay),
        }
    }

    /// Refuse a flag that contradicts the optimiser `source` applies (`applied`): the
    /// source's values are the ones used, so a different flag would be recorded falsely.
    pub fn check(&self, applied: &SgdConfig, source: &str) -> crate::Result<()> {
        for (flag, given, used) in [
            ("--lr", self.lr, applied.lr),
            ("--momentum", self.momentum, applied.momentum),
            ("--weight-decay", self.weight_decay, applied.weight_decay),
        ] {
            if let Some(g) = given
                && g != used
            {
                return Err(crate::Error::invalid(
                    flag,
                    format!(
                        "{flag} {g} contradicts {source}, which apply {flag} {used}: leave the flag \
                         out (their value is used) or give the same value"
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig::DEFAULT
    }
}

/// How an asynchronous parameter server scales a stale gradient (ASP, SSP): a gradient computed
/// from parameters `s` versions old is applied with `lr / (s + 1)` under [`StalenessLr::Inverse`]
/// (staleness-aware asynchronous SGD, Zhang et al., IJCAI'16), which keeps ASP stable as workers
/// are added. The scale multiplies the gradient, so the momentum buffer holds scaled gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StalenessLr {
    /// Every gradient at the full learning rate, however stale.
    #[default]
    None,
    /// The learning rate divided by staleness + 1.
    Inverse,
}

impl StalenessLr {
    /// The gradient scale for a gradient `staleness` versions old.
    pub fn scale(self, staleness: u64) -> f32 {
        match self {
            StalenessLr::None => 1.0,
            StalenessLr::Inverse => 1.0 / (staleness as f32 + 1.0),
        }
    }

    /// The name used on command lines and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            StalenessLr::None => "none",
            StalenessLr::Inverse => "inverse",
        }
    }
}

impl std::str::FromStr for StalenessLr {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(StalenessLr::None),
            "inverse" => Ok(StalenessLr::Inverse),
            _ => Err(format!("'{s}' (expected none or inverse)")),
        }
    }
}

/// Values per parallel chunk: below this a rayon split costs more than it saves.
const CHUNK: usize = 1 << 15;

/// One SGD step over matching slices; `grad_scale` multiplies the gradient first (1/W to turn a
/// sum of W workers' gradients into their mean).
///
/// Chunks go to the current rayon pool; [`sgd_block`] is the same step on the calling thread.
pub fn sgd_step(cfg: &SgdConfig, params: &mut [f32], grads: &[f32], momentum: &mut [f32], grad_scale: f32) {
    check_lengths(params, grads, momentum);
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(momentum.par_chunks_mut(CHUNK))
        .for_each(|((p, g), m)| sgd_block(cfg, p, g, m, grad_scale));
}

/// [`sgd_step`] on the calling thread.
pub fn sgd_block(cfg: &SgdConfig, params: &mut [f32], grads: &[f32], momentum: &mut [f32], grad_scale: f32) {
    check_lengths(params, grads, momentum);
    for ((p, &g), m) in params.iter_mut().zip(grads).zip(momentum.iter_mut()) {
        (*p, *m) = sgd_one(cfg, *p, g, *m, grad_scale);
    }
}

/// [`sgd_block`] over one row of a sparse model's table, unless its gradient is all zero: then
/// the row and its momentum stay as they are (lazy momentum: a row no batch named waits).
/// Returns whether the row changed. The rule of every mode, so that each changes the same rows.
pub fn sgd_row(
    cfg: &SgdConfig,
    params: &mut [f32],
    grads: &[f32],
    momentum: &mut [f32],
    grad_scale: f32,
) -> bool {
    if grads.iter().all(|&g| g == 0.0) {
        return false;
    }
    sgd_block(cfg, params, grads, momentum, grad_scale);
    true
}

/// [`sgd_block`] reading the current parameters and momentum and writing the results elsewhere
/// (`next_params`, `next_momentum`) in the same pass, for an update that must not touch the
/// current values until it is committed (the parameter server's pipelined step). The same
/// arithmetic, so the same bits.
pub fn sgd_step_into(
    cfg: &SgdConfig,
    params: &[f32],
    grads: &[f32],
    momentum: &[f32],
    grad_scale: f32,
    next_params: &mut [f32],
    next_momentum: &mut [f32],
) {
    // Equal-length slices and an index: the bounds checks go and the loop vectorises.
    let n = params.len();
    let (grads, momentum) = (&grads[..n], &momentum[..n]);
    let (next_params, next_momentum) = (&mut next_params[..n], &mut next_momentum[..n]);
    for i in 0..n {
        (next_params[i], next_momentum[i]) = sgd_one(cfg, params[i], grads[i], momentum[i], grad_scale);
    }
}

/// One value's step, the one place the arithmetic is written: `(p, m)` after it.
#[inline(always)]
fn sgd_one(cfg: &SgdConfig, p: f32, g: f32, m: f32, grad_scale: f32) -> (f32, f32) {
    let g = grad_scale * g + cfg.weight_decay * p;
    let m = cfg.momentum * m + g;
    (p - cfg.lr * m, m)
}

fn check_lengths(params: &[f32], grads: &[f32], momentum: &[f32]) {
    assert_eq!(params.len(), grads.len(), "sgd_step: params and grads differ in length");
    assert_eq!(params.len(), momentum.len(), "sgd_step: params and momentum differ in length");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_pytorch_two_steps() {
        // torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01), p=1, grad=0.5 twice:
        // step 1: g=0.51, m=0.51, p=0.949; step 2: g=0.50949, m=0.96849, p=0.852151.
        let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
        let (mut p, mut m) = (vec![1.0f32], vec![0.0f32]);
        sgd_step(&cfg, &mut p, &[0.5], &mut m, 1.0);
        assert!((p[0] - 0.949).abs() < 1e-6);
        sgd_step(&cfg, &mut p, &[0.5], &mut m, 1.0);
        assert!((p[0] - 0.852151).abs() < 1e-6, "{}", p[0]);
    }

    #[test]
    fn step_into_equals_step_in_place() {
        let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
        let p: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let g: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos()).collect();
        let m: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.05).sin() * 0.1).collect();
        let (mut want_p, mut want_m) = (p.clone(), m.clone());
        sgd_step(&cfg, &mut want_p, &g, &mut want_m, 0.25);
        let (mut np, mut nm) = (vec![0.0; 1000], vec![0.0; 1000]);
        sgd_step_into(&cfg, &p, &g, &m, 0.25, &mut np, &mut nm);
        assert_eq!((np, nm), (want_p, want_m));
    }
}
