//! The model's shape: layer widths, presets, the flat parameter layout, the fingerprint and the
//! deterministic initialisation.
//!
//! Every parameter lives in ONE flat `f32` buffer and every gradient in another of the same
//! layout. Layer `l` (input width `w[l]`, output width `w[l+1]`) owns two contiguous ranges,
//! its weight `W_l` (`w[l+1] x w[l]`, row-major, as `torch.nn.Linear`) followed by its bias
//! `b_l`. Buckets, shards and ring chunks elsewhere in gradsync are plain ranges of that buffer.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rng::Rng;

/// Named layer-width presets.
pub const PRESETS: &[(&str, &[usize])] =
    &[("tiny", &[32, 64, 32, 8]), ("mnist", &[784, 1024, 1024, 10]), ("wide", &[784, 4096, 4096, 4096, 10])];

/// The MLP's layer widths, input first and classes last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The preset's name, or "custom".
    pub name: String,
    /// `[input, hidden..., classes]`; at least two entries.
    pub widths: Vec<usize>,
}

impl ModelSpec {
    /// A preset name (`tiny`, `mnist`, `wide`) or explicit widths such as `784-256-10`.
    pub fn parse(s: &str) -> Result<Self> {
        if let Some((name, w)) = PRESETS.iter().find(|(n, _)| *n == s) {
            return Ok(ModelSpec { name: (*name).to_string(), widths: w.to_vec() });
        }
        if s.contains('-') {
            let widths = s
                .split('-')
                .map(|p| p.trim().parse::<usize>().ok().filter(|&w| w > 0))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::invalid("model", format!("'{s}': widths must be positive integers")))?;
            if widths.len() < 2 {
                return Err(Error::invalid("model", format!("'{s}': need at least 2 widths")));
            }
            return Ok(ModelSpec { name: "custom".into(), widths });
        }
        let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
        Err(Error::invalid(
            "model",
            format!("unknown preset '{s}' (presets: {}; or widths like 784-256-10)", names.join(", ")),
        ))
    }

    /// The same spec with its input and class widths replaced (to fit a dataset).
    pub fn with_io(mut self, input: usize, classes: usize) -> Self {
        let n = self.widths.len();
        self.widths[0] = input;
        self.widths[n - 1] = classes;
        self
    }

    /// Input width.
    pub fn input(&self) -> usize {
        self.widths[0]
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        *self.widths.last().unwrap_or(&0)
    }

    /// Widths as `784-1024-10`.
    pub fn widths_str(&self) -> String {
        self.widths.iter().map(|w| w.to_string()).collect::<Vec<_>>().join("-")
    }
}

/// Where one layer's parameters sit in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRange {
    /// Input width.
    pub fan_in: usize,
    /// Output width.
    pub fan_out: usize,
    /// The weight, `fan_out x fan_in`, row-major.
    pub weight: Range<usize>,
    /// The bias, `fan_out`.
    pub bias: Range<usize>,
}

/// The flat layout of every parameter (and, identically, every gradient).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Per layer, in forward order.
    pub layers: Vec<LayerRange>,
    /// Total number of parameters.
    pub len: usize,
}

impl Layout {
    /// The layout of `spec`.
    pub fn new(spec: &ModelSpec) -> Self {
        let mut off = 0;
        let layers = spec
            .widths
            .windows(2)
            .map(|w| {
                let (fan_in, fan_out) = (w[0], w[1]);
                let weight = off..off + fan_in * fan_out;
                let bias = weight.end..weight.end + fan_out;
                off = bias.end;
                LayerRange { fan_in, fan_out, weight, bias }
            })
            .collect();
        Layout { layers, len: off }
    }

    /// Every parameter tensor's range in the order backward produces gradients: the last
    /// layer's bias, its weight, then the layer before, down to the first weight. The ranges are
    /// contiguous and descending, so any prefix of this list is a suffix of the flat buffer.
    pub fn backward_order(&self) -> Vec<Range<usize>> {
        self.layers.iter().rev().flat_map(|l| [l.bias.clone(), l.weight.clone()]).collect()
    }

    /// Floating-point operations of one forward+backward pass for `batch` samples: 2 per
    /// multiply-add, three GEMMs per layer (forward, weight gradient, input gradient) except the
    /// input gradient of the first layer, which is never computed.
    pub fn step_flops(&self, batch: usize) -> f64 {
        let mac: f64 = self.layers.iter().map(|l| (l.fan_in * l.fan_out) as f64).sum();
        let first = self.layers.first().map_or(0.0, |l| (l.fan_in * l.fan_out) as f64);
        2.0 * batch as f64 * (3.0 * mac - first)
    }
}

/// Gradient buckets over the flat buffer, in backward order, aligned to parameter tensors as in
/// PyTorch DDP: a bucket closes once it holds at least `cap` values, so one large tensor can
/// make a bucket of its own and no tensor is ever split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// Bucket ranges, descending (the first bucket is the end of the buffer).
    pub buckets: Vec<Range<usize>>,
}

impl BucketPlan {
    /// One bucket holding everything (no overlap; local training, PS).
    pub fn whole(layout: &Layout) -> Self {
        BucketPlan { buckets: std::iter::once(0..layout.len).collect() }
    }

    /// Buckets of at least `cap_values` values each (the last may be smaller).
    pub fn with_cap(layout: &Layout, cap_values: usize) -> Self {
        let cap = cap_values.max(1);
        let mut buckets = Vec::new();
        let mut end = layout.len;
        for r in layout.backward_order() {
            if end - r.start >= cap {
                buckets.push(r.start..end);
                end = r.start;
            }
        }
        if end > 0 {
            buckets.push(0..end);
        }
        BucketPlan { buckets }
    }
}

/// What identifies a model for compatibility checks: the layer shapes, the dtype and the init
/// seed. Two processes may exchange parameters or gradients only if these match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// `mlp:784-1024-1024-10:f32:seed=42`: readable, so a mismatch says what differs.
    pub text: String,
}

impl Fingerprint {
    /// The fingerprint of `spec` initialised from `seed`.
    pub fn new(spec: &ModelSpec, seed: u64) -> Self {
        Fingerprint { text: format!("mlp:{}:f32:seed={seed}", spec.widths_str()) }
    }

    /// A 64-bit FNV-1a hash of the text, for compact wire formats.
    pub fn hash(&self) -> u64 {
        self.text
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
    }

    /// `Ok` if `other` is the same model, else [`Error::Fingerprint`].
    pub fn check(&self, other: &str) -> Result<()> {
        if self.text == other {
            Ok(())
        } else {
            Err(Error::Fingerprint { expected: self.text.clone(), found: other.to_string() })
        }
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Deterministic initial parameters: PyTorch `nn.Linear`'s default, weight and bias uniform in
/// `[-1/sqrt(fan_in), 1/sqrt(fan_in)]`, drawn layer by layer from `seed`.
pub fn init_params(layout: &Layout, seed: u64) -> Vec<f32> {
    let mut p: Vec<f32> = crate::heap::zeros(layout.len);
    for (i, l) in layout.layers.iter().enumerate() {
        let bound = 1.0 / (l.fan_in as f32).sqrt();
        let mut rng = Rng::new(seed, 0x1417 + i as u64);
        for v in &mut p[l.weight.start..l.bias.end] {
            *v = rng.uniform_in(-bound, bound);
        }
    }
    p
}

/// Part `k` of `0..len` split as evenly as possible into `parts`: the first `len % parts`
/// parts hold one value more, and parts may be empty when `len < parts`. The one way the flat
/// buffer is cut among ranks: parameter-server shards and collective segments alike.
pub fn segment(len: usize, parts: usize, k: usize) -> Range<usize> {
    let (q, r) = (len / parts, len % parts);
    let start = k * q + k.min(r);
    start..start + q + usize::from(k < r)
}

#[cfg(test)]
mod tests {
    #[test]
    fn segments_tile_the_range() {
        for len in [0, 1, 2, 7, 8, 9, 100] {
            for parts in 1..=8 {
                let mut end = 0;
                for k in 0..parts {
                    let s = super::segment(len, parts, k);
                    assert_eq!(s.start, end);
                    assert!(s.len() <= len / parts + 1);
                    end = s.end;
                }
                assert_eq!(end, len);
            }
        }
    }

    use super::*;

    #[test]
    fn presets_and_sizes() {
        let wide = ModelSpec::parse("wide").unwrap();
        assert!(Layout::new(&wide).len >= 30_000_000);
        let mnist = Layout::new(&ModelSpec::parse("mnist").unwrap());
        assert_eq!(mnist.len, 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10);
        assert!(ModelSpec::parse("nope").unwrap_err().to_string().contains("unknown preset 'nope'"));
        assert!(ModelSpec::parse("10-0-3").is_err());
        assert_eq!(ModelSpec::parse("10-5-3").unwrap().widths, vec![10, 5, 3]);
    }

    #[test]
    fn buckets_cover_in_backward_order() {
        let l = Layout::new(&ModelSpec::parse("mnist").unwrap());
        for cap in [1, 1000, 1 << 20, usize::MAX / 2] {
            let plan = BucketPlan::with_cap(&l, cap);
            let mut end = l.len;
            for b in &plan.buckets {
                assert_eq!(b.end, end);
                assert!(b.start < b.end);
                end = b.start;
            }
            assert_eq!(end, 0);
        }
        assert_eq!(BucketPlan::with_cap(&l, 1).buckets.len(), 6);
    }

    #[test]
    fn init_is_deterministic_and_seeded() {
        let l = Layout::new(&ModelSpec::parse("tiny").unwrap());
        assert_eq!(init_params(&l, 7), init_params(&l, 7));
        assert_ne!(init_params(&l, 7), init_params(&l, 8));
        let f = Fingerprint::new(&ModelSpec::parse("tiny").unwrap(), 7);
        assert!(f.check(&f.text).is_ok());
        assert!(f.check("mlp:1-2:f32:seed=7").is_err());
    }
}
