//! Datasets and the distributed sampler.
//!
//! Every source yields the same in-memory [`Dataset`]: `f32` inputs, row-major, normalised, and
//! `u32` labels, split into a training and a held-out part.

mod augment;
mod cifar;
mod clicks;
mod digits;
mod libsvm;
mod mnist;
mod sampler;
mod synthetic;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use augment::Augment;
pub use clicks::{ClicksConfig, random_bags};
/// The built-in clicks' law of ids, for estimates of the rows a batch names.
pub use clicks::{IDS as CLICKS_IDS, ZIPF as CLICKS_ZIPF};
pub use sampler::DistributedSampler;
pub use synthetic::SyntheticConfig;

use crate::error::{Error, Result};
use crate::model::Input;

/// One split of a dataset, in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// Inputs, `len x dim`, row-major.
    pub x: Vec<f32>,
    /// Labels, each below `classes`.
    pub y: Vec<u32>,
}

impl Split {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether the split has no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
}

/// A dataset: training and held-out splits.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// A short name (`synthetic`, `mnist`, `cifar10`).
    pub name: String,
    /// Input width (values per sample).
    pub dim: usize,
    /// One sample's shape: an image (NCHW per sample) or a flat vector of `dim` values.
    pub input: Input,
    /// Number of classes.
    pub classes: usize,
    /// Training samples.
    pub train: Split,
    /// Held-out samples.
    pub test: Split,
}

impl Dataset {
    /// Copy the samples `indices` of the training split into `x` and `y` (cleared first).
    pub fn gather(&self, indices: &[usize], x: &mut Vec<f32>, y: &mut Vec<u32>) {
        x.clear();
        y.clear();
        for &i in indices {
            x.extend_from_slice(&self.train.x[i * self.dim..(i + 1) * self.dim]);
            y.push(self.train.y[i]);
        }
    }
}

/// Where the data comes from (`--data`).
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// The built-in synthetic classification task.
    Synthetic(SyntheticConfig),
    /// The built-in UCI handwritten digits (8x8 pixels, 10 classes; real data, fixed split).
    Digits,
    /// MNIST IDX files (raw or .gz) in a directory.
    Mnist(PathBuf),
    /// The CIFAR-10 binary version in a directory.
    Cifar10(PathBuf),
    /// The built-in click logs: bags of ids with a planted ground truth (sparse).
    Clicks(ClicksConfig),
    /// A LIBSVM text file: bags of `index:value` features (sparse).
    Libsvm(PathBuf),
}

impl FromStr for DataSource {
    type Err = Error;

    /// `digits`, `synthetic`, `synthetic:N` (training samples), `synthetic:N:DIM:CLASSES`,
    /// `synthetic:N:CxHxW:CLASSES` (images), `mnist:DIR`, `cifar10:DIR`.
    fn from_str(s: &str) -> Result<Self> {
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        match kind {
            "synthetic" => SyntheticConfig::parse(rest).map(DataSource::Synthetic),
            "digits" if rest.is_empty() => Ok(DataSource::Digits),
            "digits" => {
                Err(Error::invalid("data", format!("'{s}': digits is built in and takes no argument")))
            }
            "mnist" | "cifar10" if rest.is_empty() => {
                Err(Error::invalid("data", format!("'{s}': give the directory, as {kind}:DIR")))
            }
            "mnist" => Ok(DataSource::Mnist(PathBuf::from(rest))),
            "clicks" => ClicksConfig::parse(rest).map(DataSource::Clicks),
            "libsvm" if rest.is_empty() => {
                Err(Error::invalid("data", format!("'{s}': give the file, as libsvm:FILE")))
            }
            "libsvm" => Ok(DataSource::Libsvm(PathBuf::from(rest))),
            "cifar10" => Ok(DataSource::Cifar10(PathBuf::from(rest))),
            _ => Err(Error::invalid(
                "data",
                format!(
                    "'{s}' (expected digits, synthetic[:N[:DIM:CLASSES]], synthetic:N:CxHxW:CLASSES, mnist:DIR, \
                     cifar10:DIR, clicks[:N[:ROWS]] or libsvm:FILE)"
                ),
            )),
        }
    }
}

impl fmt::Display for DataSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSource::Synthetic(c) => write!(f, "synthetic:{}:{}:{}", c.train, c.input, c.classes),
            DataSource::Digits => f.write_str("digits"),
            DataSource::Mnist(p) => write!(f, "mnist:{}", p.display()),
            DataSource::Cifar10(p) => write!(f, "cifar10:{}", p.display()),
            DataSource::Clicks(c) => write!(f, "clicks:{}:{}", c.train, c.rows),
            DataSource::Libsvm(p) => write!(f, "libsvm:{}", p.display()),
        }
    }
}

impl DataSource {
    /// Load (or generate) the dataset; `seed` drives the synthetic generator.
    pub fn load(&self, seed: u64) -> Result<Dataset> {
        match self {
            DataSource::Synthetic(c) => Ok(c.generate(seed)),
            DataSource::Digits => digits::load(),
            DataSource::Mnist(dir) => mnist::load(dir),
            DataSource::Cifar10(dir) => cifar::load(dir),
            DataSource::Clicks(c) => Ok(c.generate(seed)),
            DataSource::Libsvm(path) => libsvm::load(path),
        }
    }

    /// A sample's shape and the number of classes, where the source states them without being
    /// loaded (a directory of MNIST files says its image size only when read).
    pub fn shape(&self) -> Option<(Input, usize)> {
        match self {
            DataSource::Synthetic(c) => Some((c.input, c.classes)),
            DataSource::Digits => Some((Input::Image { channels: 1, height: 8, width: 8 }, 10)),
            DataSource::Cifar10(_) => Some((Input::Image { channels: 3, height: 32, width: 32 }, 10)),
            DataSource::Clicks(c) => Some((c.input(), 2)),
            DataSource::Mnist(_) | DataSource::Libsvm(_) => None,
        }
    }

    /// The synthetic source with samples shaped `input` and `classes` classes (a model's); for
    /// bags of ids, the built-in clicks over that many ids.
    pub fn synthetic_for(input: Input, classes: usize) -> Self {
        if let Input::Bag { rows, .. } = input {
            return DataSource::Clicks(ClicksConfig { rows, ..ClicksConfig::default() });
        }
        DataSource::Synthetic(SyntheticConfig {
            dim: input.len(),
            input,
            classes,
            ..SyntheticConfig::default()
        })
    }
}

/// Read a whole file, naming it in any error.
fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// A directory that must exist.
fn require_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() { Ok(()) } else { Err(Error::file(dir, "no such directory")) }
}
