//! Model profiles: a model gradsync does not train, described by what decides its
//! communication (its parameter tensors in the order backward makes their gradients ready, and
//! the compute each layer takes), so that every mode can replay it (docs/replay.md).
//!
//! A profile file is JSON (`"format": "gradsync-profile"`, `"version": 1`); see
//! [`ProfileFile`] for its fields. `bench/pytorch/profile_model.py` measures one from any
//! PyTorch module; [`builtin`] derives ResNet-50, VGG-16, BERT-base and GPT-2 from each layer's
//! FLOPs and bytes at a stated device rate ([`DeviceRate`]), labelled estimated.

mod builtin;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use builtin::{BUILTINS, DeviceRate, builtin};

/// The `format` field every profile file carries.
pub const FORMAT: &str = "gradsync-profile";

/// The profile format version this gradsync reads and writes.
pub const VERSION: u32 = 1;

/// A profile file as written: times in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFile {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The model's name (`resnet50`, `my-model`).
    pub model: String,
    /// Samples per step the times were taken at (per worker).
    pub batch: usize,
    /// The device the times belong to, in words.
    pub device: String,
    /// Whether the times are estimated (derived from FLOPs) rather than measured.
    pub estimated: bool,
    /// The layers in the order backward runs them (the last forward layer first).
    pub layers: Vec<FileLayer>,
    /// The optimiser step's time, milliseconds.
    #[serde(default)]
    pub optimizer_ms: f64,
    /// Anything the writer wants a reader to know (how it was measured).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// One layer of a [`ProfileFile`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLayer {
    /// The module's name (`layer1.0.conv1`).
    pub name: String,
    /// Its forward time at the profile's batch, milliseconds.
    pub forward_ms: f64,
    /// Its backward time, milliseconds.
    pub backward_ms: f64,
    /// Its parameter tensors in the order their gradients become ready (none for a layer
    /// without parameters: an activation, a pooling, attention scores).
    #[serde(default)]
    pub tensors: Vec<FileTensor>,
}

/// One parameter tensor of a [`FileLayer`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTensor {
    /// PyTorch's state-dict name.
    pub name: String,
    /// PyTorch's shape.
    pub shape: Vec<usize>,
}

/// A checked profile, times in nanoseconds (so that a model holding one compares exactly).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Profile {
    /// The model's name.
    pub model: String,
    /// Samples per step the times belong to.
    pub batch: usize,
    /// The device, in words.
    pub device: String,
    /// Whether the times are estimated.
    pub estimated: bool,
    /// Layers in backward order.
    pub layers: Vec<Layer>,
    /// The optimiser step, nanoseconds.
    pub optimizer_ns: u64,
    /// Where it came from: a built-in's name or the file's path.
    pub source: String,
}

/// One layer of a [`Profile`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    /// The module's name.
    pub name: String,
    /// Forward time at the profile's batch, nanoseconds.
    pub forward_ns: u64,
    /// Backward time, nanoseconds.
    pub backward_ns: u64,
    /// Parameter tensors, `(name, shape)`, in gradient-ready order.
    pub tensors: Vec<(String, Vec<usize>)>,
}

impl Profile {
    /// Read and check the profile file at `path`; an error names the file and what is wrong
    /// (the JSON's line and column for a syntax error).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid("model", format!("profile {}: {e}", path.display())))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parse and check a profile's JSON text; `source` names it in errors.
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let bad = |msg: String| Error::invalid("model", format!("profile {source}: {msg}"));
        let file: ProfileFile = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        Self::from_file(file, source)
    }

    /// Check a [`ProfileFile`] and convert its times.
    pub fn from_file(file: ProfileFile, source: &str) -> Result<Self> {
        let bad = |msg: String| Error::invalid("model", format!("profile {source}: {msg}"));
        if file.format != FORMAT {
            return Err(bad(format!("\"format\" is '{}', not '{FORMAT}'", file.format)));
        }
        if file.version != VERSION {
            return Err(bad(format!(
                "format version {} (this gradsync reads version {VERSION})",
                file.version
            )));
        }
        if file.model.trim().is_empty() || file.model.contains(char::is_whitespace) {
            return Err(bad(format!("\"model\" '{}' must be one word", file.model)));
        }
        if file.batch == 0 {
            return Err(bad("\"batch\" must be at least 1".into()));
        }
        let ns = |what: &str, ms: f64| -> Result<u64> {
            if ms.is_finite() && (0.0..=3.6e6).contains(&ms) {
                Ok((ms * 1e6).round() as u64)
            } else {
                Err(bad(format!("{what} is {ms} ms (expected a time from 0 to one hour)")))
            }
        };
        let mut names = std::collections::HashSet::new();
        let mut values = 0usize;
        let mut layers = Vec::with_capacity(file.layers.len());
        for (i, l) in file.layers.iter().enumerate() {
            let at = format!("layer {i} ('{}')", l.name);
            let mut tensors = Vec::with_capacity(l.tensors.len());
            for t in &l.tensors {
                if t.name.is_empty() || !names.insert(t.name.clone()) {
                    return Err(bad(format!("{at}: tensor name '{}' is empty or repeated", t.name)));
                }
                let n = t
                    .shape
                    .iter()
                    .try_fold(1usize, |acc, &d| acc.checked_mul(d).filter(|_| d > 0))
                    .filter(|_| !t.shape.is_empty())
                    .ok_or_else(|| bad(format!("{at}: tensor '{}' has shape {:?}", t.name, t.shape)))?;
                values = values
                    .checked_add(n)
                    .ok_or_else(|| bad("more parameters than this machine can address".into()))?;
                tensors.push((t.name.clone(), t.shape.clone()));
            }
            layers.push(Layer {
                name: l.name.clone(),
                forward_ns: ns(&format!("{at} forward_ms"), l.forward_ms)?,
                backward_ns: ns(&format!("{at} backward_ms"), l.backward_ms)?,
                tensors,
            });
        }
        if values == 0 {
            return Err(bad("no layer holds a parameter tensor".into()));
        }
        Ok(Profile {
            model: file.model,
            batch: file.batch,
            device: file.device,
            estimated: file.estimated,
            layers,
            optimizer_ns: ns("optimizer_ms", file.optimizer_ms)?,
            source: source.to_string(),
        })
    }

    /// The file form, times in milliseconds.
    pub fn to_file(&self, note: &str) -> ProfileFile {
        let ms = |ns: u64| ns as f64 / 1e6;
        ProfileFile {
            format: FORMAT.into(),
            version: VERSION,
            model: self.model.clone(),
            batch: self.batch,
            device: self.device.clone(),
            estimated: self.estimated,
            layers: self
                .layers
                .iter()
                .map(|l| FileLayer {
                    name: l.name.clone(),
                    forward_ms: ms(l.forward_ns),
                    backward_ms: ms(l.backward_ns),
                    tensors: l
                        .tensors
                        .iter()
                        .map(|(name, shape)| FileTensor { name: name.clone(), shape: shape.clone() })
                        .collect(),
                })
                .collect(),
            optimizer_ms: ms(self.optimizer_ns),
            note: note.into(),
        }
    }

    /// Parameters in all.
    pub fn parameters(&self) -> usize {
        self.layers.iter().flat_map(|l| &l.tensors).map(|(_, s)| s.iter().product::<usize>()).sum()
    }

    /// Parameter tensors in all.
    pub fn tensors(&self) -> usize {
        self.layers.iter().map(|l| l.tensors.len()).sum()
    }

    /// Forward and backward compute of one step at the profile's batch, nanoseconds.
    pub fn compute_ns(&self) -> (u64, u64) {
        self.layers.iter().fold((0, 0), |(f, b), l| (f + l.forward_ns, b + l.backward_ns))
    }

    /// Forward and backward milliseconds of one step of `batch` samples: the profile's times
    /// scaled in proportion (what a replay waits).
    pub fn step_ms(&self, batch: usize) -> (f64, f64) {
        let (f, b) = self.compute_ns();
        let at = |ns: u64| ns as f64 / 1e6 * batch as f64 / self.batch as f64;
        (at(f), at(b))
    }

    /// Whether the times of a step of `batch` samples are estimated: the profile's are, or they
    /// are scaled from another batch.
    pub fn estimated_at(&self, batch: usize) -> bool {
        self.estimated || batch != self.batch
    }

    /// A short tag of the tensor list (names and shapes; not the times), so that two processes
    /// replaying one model agree on its layout whatever rate each was told.
    pub fn layout_tag(&self) -> String {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for (name, shape) in self.layers.iter().flat_map(|l| &l.tensors) {
            let text = format!("{name}{shape:?};");
            for b in text.bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        format!("{:08x}", h >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> ProfileFile {
        ProfileFile {
            format: FORMAT.into(),
            version: VERSION,
            model: "toy".into(),
            batch: 8,
            device: "test".into(),
            estimated: false,
            layers: vec![
                FileLayer {
                    name: "fc2".into(),
                    forward_ms: 0.5,
                    backward_ms: 1.0,
                    tensors: vec![
                        FileTensor { name: "fc2.bias".into(), shape: vec![10] },
                        FileTensor { name: "fc2.weight".into(), shape: vec![10, 32] },
                    ],
                },
                FileLayer { name: "relu".into(), forward_ms: 0.1, backward_ms: 0.1, tensors: vec![] },
                FileLayer {
                    name: "fc1".into(),
                    forward_ms: 1.0,
                    backward_ms: 2.0,
                    tensors: vec![FileTensor { name: "fc1.weight".into(), shape: vec![32, 64] }],
                },
            ],
            optimizer_ms: 0.25,
            note: String::new(),
        }
    }

    #[test]
    fn a_profile_round_trips_through_its_file_form() {
        let p = Profile::from_file(file(), "t").unwrap();
        assert_eq!(p.parameters(), 10 + 320 + 2048);
        assert_eq!(p.tensors(), 3);
        assert_eq!(p.compute_ns(), (1_600_000, 3_100_000));
        let text = serde_json::to_string(&p.to_file("")).unwrap();
        assert_eq!(Profile::parse(&text, "t").unwrap(), p);
    }

    #[test]
    fn bad_profiles_are_refused_naming_what_is_wrong() {
        type Change = Box<dyn Fn(&mut ProfileFile)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|f| f.format = "other".into()), "\"format\" is 'other'"),
            (Box::new(|f| f.version = 2), "format version 2"),
            (Box::new(|f| f.batch = 0), "\"batch\" must be at least 1"),
            (Box::new(|f| f.layers[0].backward_ms = -1.0), "layer 0 ('fc2') backward_ms is -1 ms"),
            (Box::new(|f| f.layers[2].forward_ms = f64::NAN), "layer 2 ('fc1') forward_ms"),
            (
                Box::new(|f| f.layers[2].tensors[0].name = "fc2.bias".into()),
                "'fc2.bias' is empty or repeated",
            ),
            (
                Box::new(|f| f.layers[0].tensors[1].shape = vec![10, 0]),
                "tensor 'fc2.weight' has shape [10, 0]",
            ),
            (Box::new(|f| f.layers[0].tensors[1].shape = vec![]), "tensor 'fc2.weight' has shape []"),
            (Box::new(|f| f.layers.iter_mut().for_each(|l| l.tensors.clear())), "no layer holds a parameter"),
            (Box::new(|f| f.model = "two words".into()), "must be one word"),
        ];
        for (change, want) in cases {
            let mut f = file();
            change(&mut f);
            let err = Profile::from_file(f, "p.json").unwrap_err().to_string();
            assert!(err.contains("profile p.json") && err.contains(want), "{err} (wanted {want})");
        }
        let err =
            Profile::parse("{\"format\": \"gradsync-profile\",\n \"version\": 1, \"extra\": 0}", "x.json")
                .unwrap_err()
                .to_string();
        assert!(err.contains("x.json") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn the_layout_tag_follows_the_tensors_not_the_times() {
        let a = Profile::from_file(file(), "a").unwrap();
        let mut f = file();
        f.layers[0].backward_ms = 9.0;
        assert_eq!(Profile::from_file(f, "b").unwrap().layout_tag(), a.layout_tag());
        let mut f = file();
        f.layers[0].tensors[1].shape = vec![10, 33];
        assert_ne!(Profile::from_file(f, "c").unwrap().layout_tag(), a.layout_tag());
    }
}
