//! The default dataset: a deterministic, learnable classification task generated from the seed.
//!
//! Each class `c` has a random centroid `mu_c` (standard normal per dimension, scaled by
//! `SEPARATION / sqrt(dim)`); a sample is `mu_c + noise` with standard normal noise, its label
//! drawn uniformly. Two centroids then stand about `SEPARATION * sqrt(2)` noise deviations
//! apart whatever the dimension: classes overlap in every single input but are separable in
//! aggregate, so an MLP's loss falls steadily over a few hundred steps rather than in one, and
//! the best possible held-out accuracy is high but below 100%.

use super::{Dataset, Split};
use crate::error::{Error, Result};
use crate::model::Input;
use crate::rng::Rng;

/// Centroid spread: the expected distance between two centroids is `SEPARATION * sqrt(2)`
/// noise standard deviations.
const SEPARATION: f32 = 3.0;

/// Shape of the synthetic dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticConfig {
    /// Training samples.
    pub train: usize,
    /// Held-out samples.
    pub test: usize,
    /// Input width (values per sample).
    pub dim: usize,
    /// One sample's shape: flat (`dim` values) or an image of `dim` pixel values.
    pub input: Input,
    /// Classes.
    pub classes: usize,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig { train: 8192, test: 1024, dim: 784, input: Input::Flat(784), classes: 10 }
    }
}

impl SyntheticConfig {
    /// `""`, `N`, `N:DIM:CLASSES`, or `N:CxHxW:CLASSES` for images.
    pub fn parse(s: &str) -> Result<Self> {
        let mut c = SyntheticConfig::default();
        if s.is_empty() {
            return Ok(c);
        }
        let parts: Vec<&str> = s.split(':').collect();
        let num = |p: &str, what: &str| -> Result<usize> {
            p.parse::<usize>().ok().filter(|&v| v > 0).ok_or_else(|| {
                Error::invalid("data", format!("synthetic {what} '{p}' must be a positive integer"))
            })
        };
        match parts.as_slice() {
            [n] => c.train = num(n, "size")?,
            [n, d, k] => {
                c.train = num(n, "size")?;
                c.input = if d.contains('x') {
                    let sides = d.split('x').map(|p| num(p, "image side")).collect::<Result<Vec<_>>>()?;
                    let [channels, height, width] = sides[..] else {
                        return Err(Error::invalid(
                            "data",
                            format!("synthetic image shape '{d}' must be CxHxW, such as 3x32x32"),
                        ));
                    };
                    Input::Image { channels, height, width }
                } else {
                    Input::Flat(num(d, "dimension")?)
                };
                c.dim = c.input.len();
                c.classes = num(k, "class count")?;
            }
            _ => {
                return Err(Error::invalid(
                    "data",
                    format!(
                        "synthetic:'{s}' (expected synthetic:N, synthetic:N:DIM:CLASSES or synthetic:N:CxHxW:CLASSES)"
                    ),
                ));
            }
        }
        if c.classes < 2 {
            return Err(Error::invalid("data", "synthetic data needs at least 2 classes"));
        }
        c.test = (c.train / 8).clamp(64, 4096);
        Ok(c)
    }

    /// Generate the dataset for `seed`.
    pub fn generate(&self, seed: u64) -> Dataset {
        let mut rng = Rng::new(seed, 0xDA7A);
        let scale = SEPARATION / (self.dim as f32).sqrt();
        let centroids: Vec<f32> = (0..self.classes * self.dim).map(|_| scale * rng.normal()).collect();
        let split = |n: usize, stream: u64| {
            let mut rng = Rng::new(seed, stream);
            let mut x = Vec::with_capacity(n * self.dim);
            let mut y = Vec::with_capacity(n);
            for i in 0..n {
                let c = (i + rng.below(self.classes as u64) as usize) % self.classes;
                let mu = &centroids[c * self.dim..(c + 1) * self.dim];
                x.extend(mu.iter().map(|&m| m + rng.normal()));
                y.push(c as u32);
            }
            Split { x, y }
        };
        Dataset {
            name: "synthetic".into(),
            dim: self.dim,
            input: self.input,
            classes: self.classes,
            train: split(self.train, 0x7121),
            test: split(self.test, 0x7E57),
        }
    }
}
