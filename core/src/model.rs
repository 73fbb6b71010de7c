//! The model's shape: presets, the layer graph they build, the flat parameter layout, the
//! fingerprint and the deterministic initialisation.
//!
//! A model is a [`ModelSpec`] (an MLP's widths or a convolutional preset, fitted to the data's
//! input and classes). It builds a list of [`Layer`]s, a sequence with residual blocks, which
//! [`Graph::new`] compiles into the nodes [`crate::net`] runs and the [`Layout`] of every
//! parameter in ONE flat `f32` buffer (and, identically, every gradient in another). Tensors
//! follow PyTorch's modules: the same names, shapes and order as the reference models of
//! `bench/pytorch/models.py`, so a checkpoint maps name for name. Running batch-norm statistics
//! are buffers outside the gradient buffer. Buckets, shards and ring chunks elsewhere in
//! gradsync are plain ranges of the flat buffer.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::device::Window;
use crate::error::{Error, Result};
use crate::profile::{DeviceRate, Profile};
use crate::rng::Rng;

/// Named MLP presets: layer widths, input first and classes last.
pub const PRESETS: &[(&str, &[usize])] =
    &[("tiny", &[32, 64, 32, 8]), ("mnist", &[784, 1024, 1024, 10]), ("wide", &[784, 4096, 4096, 4096, 10])];

/// The convolutional presets, with what `--model --help` says of each.
pub const CONV_PRESETS: &[(&str, &str)] = &[
    ("resnet20", "He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks, 16-32-64 channels"),
    ("resnet18", "torchvision's ResNet-18, CIFAR stem (3x3 convolution, no max-pool), 64-512 channels"),
    ("vgg11", "VGG-11 with batch norm and the 4096-wide classifier (communication-heavy)"),
    ("cnn8", "a small conv net for the built-in 8x8 digits: 2 convolutions, a max-pool, 2 linear layers"),
];

/// The sparse model's preset name.
pub const EMBEDDING: &str = "embedding";
/// Its defaults: 2^20 rows (fitted to the data's ids unless given) of 16 values (64 MiB), one
/// hidden layer of 64, up to 40 ids per sample.
pub const EMBEDDING_ROWS: usize = 1 << 20;
/// The width of a row by default.
pub const EMBEDDING_DIM: usize = 16;
/// The hidden widths above the bag by default.
pub const EMBEDDING_HIDDEN: &[usize] = &[64];
/// Ids per sample at most, before the data says.
pub const EMBEDDING_SLOTS: usize = 40;

/// `--model`'s long help: what a model is, then every preset with its parameters, tensors and
/// forward FLOPs per sample at its default input (3x32x32 or 1x8x8 images, 10 classes), then
/// the profiles gradsync replays.
pub fn presets_help() -> String {
    let mut out = String::from(
        "Model: a preset below, MLP widths such as 784-256-10, or a model to replay. Input and classes are \
         fitted to --data (a conv net needs image data: digits, cifar10:DIR, mnist:DIR or \
         synthetic:N:CxHxW:K).\n",
    );
    let names = PRESETS.iter().map(|(n, _)| *n).chain(CONV_PRESETS.iter().map(|(n, _)| *n));
    for name in names {
        let Ok(spec) = ModelSpec::parse(name) else { continue };
        let layout = Layout::new(&spec);
        let what = CONV_PRESETS.iter().find(|(n, _)| *n == name).map_or("an MLP", |(_, d)| *d);
        out.push_str(&format!(
            "\n  {name:<9} {:>10} parameters in {:>2} tensors, {:>8.2} MFLOP/sample forward at {}: {what}",
            grouped(layout.len),
            layout.params.len(),
            layout.forward_flops_per_sample() / 1e6,
            spec.input,
        ));
    }
    if let Ok(spec) = ModelSpec::parse(EMBEDDING) {
        let layout = Layout::new(&spec);
        out.push_str(&format!(
            "\n\nSparse (bags of ids: clicks[:N[:ROWS]], libsvm:FILE):\n  {EMBEDDING:<9} {:>10} parameters in {:>2} \
             tensors at {} rows (fitted to the data's ids): an embedding bag of {EMBEDDING_DIM}-wide rows (mean of a \
             sample's ids; :sum to add them), then {EMBEDDING_HIDDEN:?} hidden; embedding:ROWS:DIM[:HIDDEN...][:sum|:mean] \
             sets them. A batch changes only the rows it names (lazy momentum; docs/models.md)",
            grouped(layout.len),
            layout.params.len(),
            grouped(EMBEDDING_ROWS),
        ));
    }
    out.push_str(
        "\n\nReplayed (speed only, no accuracy: each layer's compute is waited out, its gradients are real \
         buffers moved by the real communication; docs/replay.md):\n  profile:FILE a profile written by \
         bench/pytorch/profile_model.py (measured times)",
    );
    for (name, what) in crate::profile::BUILTINS {
        let p = crate::profile::builtin(name, crate::profile::DeviceRate::H100).expect("a built-in profile");
        out.push_str(&format!(
            "\n  {name:<9} {:>11} parameters in {:>3} tensors, estimated: {what}",
            grouped(p.parameters()),
            p.tensors()
        ));
    }
    out
}

/// What a reader is told a model is, from its shape token ([`ModelSpec::widths_str`], as
/// metrics headers record it): `MLP 784-1024-10`, `resnet20 (3x32x32, 10 classes)`.
pub fn label_of(token: &str) -> String {
    if let Some(rest) = token.strip_prefix(REPLAY_TOKEN) {
        let name = rest.split_once(':').map_or(rest, |(n, _)| n);
        return format!("{name} (replay)");
    }
    if let Some(rest) = token.strip_prefix("embedding:") {
        // embedding:ROWS:DIM[:HIDDEN...]:POOL/SLOTS-CLASSES
        let (model, shape) = rest.rsplit_once('/').unwrap_or((rest, ""));
        let parts: Vec<&str> = model.split(':').collect();
        let (rows, dim) = (parts.first().copied().unwrap_or("?"), parts.get(1).copied().unwrap_or("?"));
        let pool = parts.last().copied().unwrap_or("?");
        let (slots, classes) = shape.split_once('-').unwrap_or((shape, "?"));
        return format!("embedding {rows}x{dim} ({pool} of up to {slots} ids, {classes} classes)");
    }
    match token.split_once(':') {
        Some((preset, shape)) => match shape.rsplit_once('-') {
            Some((input, classes)) => format!("{preset} ({input}, {classes} classes)"),
            None => format!("{preset} ({shape})"),
        },
        None => format!("MLP {token}"),
    }
}

/// `1234567` as `1,234,567`.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One sample's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    /// A vector of this many values.
    Flat(usize),
    /// An image, `channels x height x width` (NCHW per sample).
    Image {
        /// Channels.
        channels: usize,
        /// Height in pixels.
        height: usize,
        /// Width in pixels.
        width: usize,
    },
    /// A bag of up to `slots` row ids of a table of `rows`, each with a weight: the sample's
    /// `slots` ids, then their `slots` weights (an empty slot has id -1 and weight 0). Ids are
    /// carried as `f32`, exact below 2^24 ([`MAX_BAG_ROWS`]).
    Bag {
        /// The ids' range: every id is below this.
        rows: usize,
        /// Ids per sample at most.
        slots: usize,
    },
}

/// The most rows a bag's ids may address: ids travel in the batch as `f32`, which holds every
/// integer below 2^24 exactly.
pub const MAX_BAG_ROWS: usize = 1 << 24;

impl Input {
    /// Values per sample.
    pub fn len(&self) -> usize {
        match *self {
            Input::Flat(n) => n,
            Input::Image { channels, height, width } => channels * height * width,
            Input::Bag { slots, .. } => 2 * slots,
        }
    }

    /// Whether a sample holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Display for Input {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Input::Flat(n) => write!(f, "{n}"),
            Input::Image { channels, height, width } => write!(f, "{channels}x{height}x{width}"),
            Input::Bag { rows, slots } => write!(f, "{slots} ids of {rows}"),
        }
    }
}

/// Which network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    /// Linear layers with ReLUs between them, these hidden widths.
    Mlp(Vec<usize>),
    /// He et al.'s CIFAR ResNet-20 (with 1x1 projection shortcuts).
    ResNet20,
    /// ResNet-18 with the CIFAR stem.
    ResNet18,
    /// VGG-11 with batch norm and a 4096-wide classifier.
    Vgg11,
    /// The small conv net for 8x8 images.
    Cnn8,
    /// A sparse model: an embedding bag (a table of `dim`-wide rows, each sample the sum or
    /// the mean of its ids' rows) under linear layers with ReLUs of these hidden widths.
    Embedding {
        /// The table's rows; `None` fits them to the data's ids ([`ModelSpec::fit`]).
        rows: Option<usize>,
        /// The width of a row.
        dim: usize,
        /// Hidden widths of the dense layers above the bag.
        hidden: Vec<usize>,
        /// Pool by the mean of a sample's (weighted) rows rather than their sum.
        mean: bool,
    },
    /// A model replayed from its profile: layers that wait out their compute.
    Replay(Box<Profile>),
}

/// How a replayed model's shape token starts (`replay:resnet50:1a2b3c4d`).
pub const REPLAY_TOKEN: &str = "replay:";

/// The model: its network, fitted to an input and a number of classes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The preset's name, or "custom".
    pub name: String,
    /// The network.
    pub arch: Arch,
    /// One sample's input.
    pub input: Input,
    /// Classes.
    pub classes: usize,
}

impl ModelSpec {
    /// A preset name (`tiny`, `mnist`, `wide`, `resnet20`, `resnet18`, `vgg11`, `cnn8`) or MLP
    /// widths such as `784-256-10`. A convolutional preset starts fitted to 3x32x32 images and
    /// 10 classes (`cnn8`: 1x8x8); [`ModelSpec::fit`] fits any preset to the data.
    pub fn parse(s: &str) -> Result<Self> {
        if let Some((name, w)) = PRESETS.iter().find(|(n, _)| *n == s) {
            return Ok(Self::mlp(name, w));
        }
        let cifar = Input::Image { channels: 3, height: 32, width: 32 };
        let conv = |arch, input| Ok(ModelSpec { name: s.to_string(), arch, input, classes: 10 });
        match s {
            "resnet20" => return conv(Arch::ResNet20, cifar),
            "resnet18" => return conv(Arch::ResNet18, cifar),
            "vgg11" => return conv(Arch::Vgg11, cifar),
            "cnn8" => return conv(Arch::Cnn8, Input::Image { channels: 1, height: 8, width: 8 }),
            _ => {}
        }
        if s == EMBEDDING || s.starts_with("embedding:") {
            return Self::embedding(s);
        }
        if let Some(path) = s.strip_prefix("profile:") {
            return Ok(Self::replay(Profile::load(std::path::Path::new(path))?));
        }
        if let Some(p) = crate::profile::builtin(s, DeviceRate::H100) {
            return Ok(Self::replay(p));
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
            return Ok(Self::mlp("custom", &widths));
        }
        let names: Vec<&str> = PRESETS
            .iter()
            .map(|(n, _)| *n)
            .chain(CONV_PRESETS.iter().map(|(n, _)| *n))
            .chain(crate::profile::BUILTINS.iter().map(|(n, _)| *n))
            .collect();
        Err(Error::invalid(
            "model",
            format!(
                "unknown preset '{s}' (presets: {}; or widths like 784-256-10, or profile:FILE)",
                names.join(", ")
            ),
        ))
    }

    /// `embedding[:ROWS:DIM[:HIDDEN...]][:sum|:mean]`: the sparse model, fitted to the data's
    /// ids unless ROWS is given (then the data's ids must lie below it).
    fn embedding(s: &str) -> Result<Self> {
        let bad = |why: String| {
            Error::invalid(
                "model",
                format!("'{s}': {why} (expected embedding[:ROWS:DIM[:HIDDEN...]][:sum|:mean])"),
            )
        };
        let mut parts: Vec<&str> = s.split(':').skip(1).collect();
        let mean = match parts.last().copied() {
            Some(pool @ ("sum" | "mean")) => {
                parts.pop();
                pool == "mean"
            }
            _ => true,
        };
        let num = |p: &str, what: &str| -> Result<usize> {
            p.parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| bad(format!("{what} '{p}' must be a positive integer")))
        };
        let (rows, dim, hidden) = match parts.as_slice() {
            [] => (None, EMBEDDING_DIM, EMBEDDING_HIDDEN.to_vec()),
            [_] => return Err(bad("give the rows and the width together".into())),
            [r, d] => (Some(num(r, "rows")?), num(d, "width")?, EMBEDDING_HIDDEN.to_vec()),
            [r, d, h @ ..] => (
                Some(num(r, "rows")?),
                num(d, "width")?,
                h.iter().map(|w| num(w, "hidden width")).collect::<Result<Vec<_>>>()?,
            ),
        };
        if let Some(r) = rows
            && r > MAX_BAG_ROWS
        {
            return Err(bad(format!("{r} rows is more than the {MAX_BAG_ROWS} ids a batch can carry")));
        }
        let data_rows = rows.unwrap_or(EMBEDDING_ROWS);
        Ok(ModelSpec {
            name: EMBEDDING.into(),
            arch: Arch::Embedding { rows, dim, hidden, mean },
            input: Input::Bag { rows: data_rows, slots: EMBEDDING_SLOTS },
            classes: 2,
        })
    }

    /// The sparse model's table, when it has one: rows and the width of a row.
    pub fn table(&self) -> Option<(usize, usize)> {
        match (&self.arch, self.input) {
            (Arch::Embedding { rows, dim, .. }, Input::Bag { rows: ids, .. }) => {
                Some((rows.unwrap_or(ids), *dim))
            }
            _ => None,
        }
    }

    /// A model replayed from `profile`.
    pub fn replay(profile: Profile) -> Self {
        // Its input and classes are those of the data it draws by default: one value per sample
        // and two classes, since a replayed step reads nothing but the batch's size.
        ModelSpec {
            name: profile.model.clone(),
            arch: Arch::Replay(Box::new(profile)),
            input: Input::Flat(1),
            classes: 2,
        }
    }

    /// The profile of a replayed model.
    pub fn profile(&self) -> Option<&Profile> {
        match &self.arch {
            Arch::Replay(p) => Some(p),
            _ => None,
        }
    }

    /// The model with `--device-tflops` and `--device-tbps` applied ([`ModelSpec::at_rate`],
    /// an H100's figure for the one not given); unchanged when neither is.
    pub fn with_rates(self, tflops: Option<f64>, tbps: Option<f64>) -> Result<Self> {
        if tflops.is_none() && tbps.is_none() {
            return Ok(self);
        }
        let h = DeviceRate::H100;
        self.at_rate(DeviceRate { tflops: tflops.unwrap_or(h.tflops), tbps: tbps.unwrap_or(h.tbps) })
    }

    /// A built-in profile's times estimated again at `rate` (`--device-tflops`,
    /// `--device-tbps`); a model that is not a built-in profile is refused, since its times
    /// are not estimates gradsync made.
    pub fn at_rate(self, rate: DeviceRate) -> Result<Self> {
        let rate = rate.checked()?;
        match &self.arch {
            Arch::Replay(p) if p.source.starts_with("built-in ") => {
                let p = crate::profile::builtin(&p.model, rate).expect("a built-in profile");
                Ok(Self::replay(p))
            }
            Arch::Replay(p) => Err(Error::invalid(
                "device-tflops",
                format!("applies to the built-in profiles, and {} holds its own times", p.source),
            )),
            _ => Err(Error::invalid(
                "device-tflops",
                format!("applies to a replayed model, and {} is trained for real", self.name),
            )),
        }
    }

    fn mlp(name: &str, widths: &[usize]) -> Self {
        let n = widths.len();
        ModelSpec {
            name: name.to_string(),
            arch: Arch::Mlp(widths[1..n - 1].to_vec()),
            input: Input::Flat(widths[0]),
            classes: widths[n - 1],
        }
    }

    /// The same network fitted to the data: its input and its classes. An MLP takes an image
    /// as its flattened pixels; a convolutional network needs an image and refuses flat data,
    /// naming both.
    pub fn fit(&self, input: Input, classes: usize) -> Result<Self> {
        if let Arch::Replay(_) = self.arch {
            // Replay reads no data: the batch only sets how many samples a step stands for.
            return Ok(self.clone());
        }
        let input = match (&self.arch, input) {
            (Arch::Embedding { rows: Some(r), .. }, Input::Bag { rows, .. }) if rows > *r => {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "the data's ids run to {rows}, past the {r} rows of the table; give at least {rows} \
                         rows, or leave ROWS out to fit the table to the data"
                    ),
                ));
            }
            (Arch::Embedding { .. }, i @ Input::Bag { .. }) => i,
            (Arch::Embedding { .. }, i) => {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "{} looks up rows by id and needs id data (clicks[:N], libsvm:FILE), but the data is \
                         {} values per sample",
                        self.name,
                        i.len()
                    ),
                ));
            }
            (_, Input::Bag { .. }) => {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "{} needs dense inputs, but the data is bags of ids (clicks, libsvm): train an \
                         embedding model on it",
                        self.name
                    ),
                ));
            }
            (Arch::Mlp(_), i) => Input::Flat(i.len()),
            (_, Input::Flat(n)) => {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "{} is a convolutional network and needs images (channels x height x width), but the \
                         data is flat ({n} values per sample); use image data such as digits, cifar10:DIR or \
                         synthetic:N:CxHxW:K, or an MLP",
                        self.name
                    ),
                ));
            }
            (_, image) => image,
        };
        let mut fitted = ModelSpec { input, classes, ..self.clone() };
        if let (Arch::Embedding { rows: rows @ None, .. }, Input::Bag { rows: ids, .. }) =
            (&mut fitted.arch, input)
        {
            // Fitted: the table's rows are the data's, from now on stated.
            *rows = Some(ids);
        }
        // Refuse now, by name, what would not build (an image too small for the network).
        Graph::new(&fitted)?;
        Ok(fitted)
    }

    /// The same spec with its input and class widths replaced (an MLP fitted to flat data).
    pub fn with_io(self, input: usize, classes: usize) -> Self {
        ModelSpec { input: Input::Flat(input), classes, ..self }
    }

    /// Values per input sample.
    pub fn input(&self) -> usize {
        self.input.len()
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// Whether the model is an MLP.
    pub fn is_mlp(&self) -> bool {
        matches!(self.arch, Arch::Mlp(_))
    }

    /// The shape as one token: an MLP's widths (`784-1024-10`), a preset's input and classes
    /// (`resnet20:3x32x32-10`).
    pub fn widths_str(&self) -> String {
        match &self.arch {
            Arch::Replay(p) => format!("{REPLAY_TOKEN}{}:{}", p.model, p.layout_tag()),
            Arch::Embedding { dim, hidden, mean, .. } => {
                let (rows, _) = self.table().unwrap_or_default();
                let slots = match self.input {
                    Input::Bag { slots, .. } => slots,
                    other => other.len(),
                };
                let hidden: String = hidden.iter().map(|h| format!(":{h}")).collect();
                let pool = if *mean { "mean" } else { "sum" };
                format!("{EMBEDDING}:{rows}:{dim}{hidden}:{pool}/{slots}-{}", self.classes)
            }
            Arch::Mlp(hidden) => std::iter::once(self.input.len())
                .chain(hidden.iter().copied())
                .chain(std::iter::once(self.classes))
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join("-"),
            _ => format!("{}:{}-{}", self.name, self.input, self.classes),
        }
    }

    /// The model a shape token names ([`ModelSpec::widths_str`]: `784-1024-10`,
    /// `resnet20:3x32x32-10`), as metrics headers and fingerprints record it.
    pub fn from_token(token: &str) -> Result<Self> {
        if let Some(rest) = token.strip_prefix(REPLAY_TOKEN) {
            let (name, tag) = rest.split_once(':').unwrap_or((rest, ""));
            return match crate::profile::builtin(name, DeviceRate::H100) {
                Some(p) if p.layout_tag() == tag => Ok(Self::replay(p)),
                _ => Err(Error::invalid(
                    "model",
                    format!(
                        "'{token}' is a model replayed from a profile file, which the token does not hold"
                    ),
                )),
            };
        }
        if let Some(rest) = token.strip_prefix("embedding:") {
            let bad = || {
                Error::invalid(
                    "model",
                    format!("'{token}' (expected embedding:ROWS:DIM:...:POOL/SLOTS-CLASSES)"),
                )
            };
            let (model, shape) = rest.rsplit_once('/').ok_or_else(bad)?;
            let (slots, classes) = shape.split_once('-').ok_or_else(bad)?;
            let (slots, classes) = (slots.parse().map_err(|_| bad())?, classes.parse().map_err(|_| bad())?);
            let spec = ModelSpec::parse(&format!("embedding:{model}"))?;
            let (rows, _) = spec.table().ok_or_else(bad)?;
            return spec.fit(Input::Bag { rows, slots }, classes);
        }
        let Some((preset, shape)) = token.split_once(':') else { return ModelSpec::parse(token) };
        let bad = || Error::invalid("model", format!("'{token}' (expected PRESET:CxHxW-CLASSES)"));
        let (input, classes) = shape.rsplit_once('-').ok_or_else(bad)?;
        let sides: Vec<usize> =
            input.split('x').map(|v| v.parse().map_err(|_| bad())).collect::<Result<_>>()?;
        let [channels, height, width] = sides[..] else { return Err(bad()) };
        let classes = classes.parse().map_err(|_| bad())?;
        ModelSpec::parse(preset)?.fit(Input::Image { channels, height, width }, classes)
    }

    /// What a reader is told the model is: `MLP 784-1024-10`, `resnet20 (3x32x32, 10 classes)`.
    pub fn label(&self) -> String {
        label_of(&self.widths_str())
    }

    /// The network as layers.
    pub fn layers(&self) -> Vec<Layer> {
        match &self.arch {
            Arch::Mlp(hidden) => {
                let mut layers = Vec::new();
                let widths: Vec<usize> =
                    hidden.iter().copied().chain(std::iter::once(self.classes)).collect();
                for (i, &w) in widths.iter().enumerate() {
                    layers.push(Layer::Linear { name: format!("{}", 2 * i), out: w });
                    if i + 1 < widths.len() {
                        layers.push(Layer::Relu);
                    }
                }
                layers
            }
            Arch::ResNet20 => resnet(&[(16, 3), (32, 3), (64, 3)], self.classes),
            Arch::ResNet18 => resnet(&[(64, 2), (128, 2), (256, 2), (512, 2)], self.classes),
            Arch::Vgg11 => vgg11(self.input, self.classes),
            Arch::Replay(_) => Vec::new(),
            Arch::Embedding { dim, hidden, mean, .. } => {
                let (rows, _) = self.table().unwrap_or_default();
                let mut layers =
                    vec![Layer::EmbeddingBag { name: "embedding".into(), rows, dim: *dim, mean: *mean }];
                let widths: Vec<usize> =
                    hidden.iter().copied().chain(std::iter::once(self.classes)).collect();
                for (i, &w) in widths.iter().enumerate() {
                    layers.push(Layer::Linear { name: format!("mlp.{}", 2 * i), out: w });
                    if i + 1 < widths.len() {
                        layers.push(Layer::Relu);
                    }
                }
                layers
            }
            Arch::Cnn8 => {
                let mut f = Vec::new();
                conv_bn_relu(&mut f, "features", 0, 32, false);
                conv_bn_relu(&mut f, "features", 3, 64, false);
                f.push(Layer::MaxPool { kernel: 2, stride: 2 });
                f.push(Layer::Flatten);
                f.push(Layer::Linear { name: "classifier.0".into(), out: 128 });
                f.push(Layer::Relu);
                f.push(Layer::Linear { name: "classifier.2".into(), out: self.classes });
                f
            }
        }
    }
}

/// `name.{at}` convolution (3x3, padding 1), `name.{at+1}` batch norm, ReLU.
fn conv_bn_relu(out: &mut Vec<Layer>, name: &str, at: usize, channels: usize, bias: bool) {
    out.push(Layer::Conv { name: format!("{name}.{at}"), out: channels, kernel: 3, stride: 1, pad: 1, bias });
    out.push(Layer::BatchNorm { name: format!("{name}.{}", at + 1) });
    out.push(Layer::Relu);
}

/// A CIFAR ResNet of basic blocks in torchvision's naming: `conv1`, `bn1`, `layerS.B.conv1`
/// ..., `layerS.0.downsample.{0,1}` where a block changes the stride or the width, `fc`.
fn resnet(stages: &[(usize, usize)], classes: usize) -> Vec<Layer> {
    let conv = |name: String, out, kernel, stride| Layer::Conv {
        name,
        out,
        kernel,
        stride,
        pad: kernel / 2,
        bias: false,
    };
    let mut layers =
        vec![conv("conv1".into(), stages[0].0, 3, 1), Layer::BatchNorm { name: "bn1".into() }, Layer::Relu];
    let mut width = stages[0].0;
    for (s, &(channels, blocks)) in stages.iter().enumerate() {
        for b in 0..blocks {
            let stride = if s > 0 && b == 0 { 2 } else { 1 };
            let p = format!("layer{}.{b}", s + 1);
            let body = vec![
                conv(format!("{p}.conv1"), channels, 3, stride),
                Layer::BatchNorm { name: format!("{p}.bn1") },
                Layer::Relu,
                conv(format!("{p}.conv2"), channels, 3, 1),
                Layer::BatchNorm { name: format!("{p}.bn2") },
            ];
            let shortcut = if stride != 1 || width != channels {
                vec![
                    conv(format!("{p}.downsample.0"), channels, 1, stride),
                    Layer::BatchNorm { name: format!("{p}.downsample.1") },
                ]
            } else {
                Vec::new()
            };
            layers.push(Layer::Residual { body, shortcut });
            layers.push(Layer::Relu);
            width = channels;
        }
    }
    layers.push(Layer::GlobalAvgPool);
    layers.push(Layer::Linear { name: "fc".into(), out: classes });
    layers
}

/// VGG-11 with batch norm in torchvision's `features.N` numbering; a max-pool whose input is
/// smaller than 2x2 is left out (its index kept), so images smaller than 32x32 still work.
fn vgg11(input: Input, classes: usize) -> Vec<Layer> {
    const CFG: [usize; 13] = [64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0];
    let (mut h, mut w) = match input {
        Input::Image { height, width, .. } => (height, width),
        Input::Flat(_) | Input::Bag { .. } => (0, 0),
    };
    let mut layers = Vec::new();
    let mut at = 0;
    for &c in &CFG {
        if c == 0 {
            if h >= 2 && w >= 2 {
                layers.push(Layer::MaxPool { kernel: 2, stride: 2 });
                (h, w) = (h / 2, w / 2);
            }
            at += 1;
        } else {
            conv_bn_relu(&mut layers, "features", at, c, true);
            at += 3;
        }
    }
    layers.push(Layer::Flatten);
    for (i, out) in [(0, 4096), (2, 4096), (4, classes)] {
        layers.push(Layer::Linear { name: format!("classifier.{i}"), out });
        if i < 4 {
            layers.push(Layer::Relu);
        }
    }
    layers
}

/// One layer of a network, as a model describes it (shapes follow from the input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layer {
    /// `y = x W^T + b` over flat inputs (`name.weight` `out x in`, `name.bias`).
    Linear {
        /// Prefix of its tensors' names.
        name: String,
        /// Output features.
        out: usize,
    },
    /// A 2-D convolution (`name.weight` `out x in x k x k`, `name.bias` when `bias`).
    Conv {
        /// Prefix of its tensors' names.
        name: String,
        /// Output channels.
        out: usize,
        /// Kernel side.
        kernel: usize,
        /// Stride.
        stride: usize,
        /// Zero padding on each side.
        pad: usize,
        /// Whether it adds a bias.
        bias: bool,
    },
    /// Batch norm over channels (`name.weight`, `name.bias`; buffers `name.running_mean`,
    /// `name.running_var`).
    BatchNorm {
        /// Prefix of its tensors' names.
        name: String,
    },
    /// An embedding bag (`name.weight`, `rows x dim`, drawn from N(0, 1) as PyTorch's): each
    /// sample's output is the weighted sum of its ids' rows, or that sum over the number of ids
    /// when `mean`. Reads a bag input; its gradient is nonzero only in the rows a batch names.
    EmbeddingBag {
        /// Prefix of its tensor's name.
        name: String,
        /// Rows of the table.
        rows: usize,
        /// Values per row.
        dim: usize,
        /// Mean rather than sum pooling.
        mean: bool,
    },
    /// `max(x, 0)`.
    Relu,
    /// Max pooling, square windows, no padding.
    MaxPool {
        /// Window side.
        kernel: usize,
        /// Stride.
        stride: usize,
    },
    /// The mean over each channel's pixels: an image becomes a vector of its channels.
    GlobalAvgPool,
    /// An image as a vector, in PyTorch's (channel, row, column) order.
    Flatten,
    /// `body(x) + shortcut(x)`; an empty shortcut is the identity.
    Residual {
        /// The main branch.
        body: Vec<Layer>,
        /// The projection, or nothing.
        shortcut: Vec<Layer>,
    },
}

/// How a node's backward treats the gradient of one of its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InputGrad {
    /// Not needed (the network's input).
    Skip,
    /// Overwrite it: this node is the first (in backward order) to reach that input.
    Write,
    /// Add to it: another consumer of the input has written it already.
    Add,
}

impl InputGrad {
    pub(crate) fn accumulate(self) -> bool {
        self == InputGrad::Add
    }
}

/// What one node computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Op {
    /// The loaded NCHW batch as CNHW.
    ToChannels { channels: usize, pixels: usize },
    /// A linear layer; `relu` fuses the ReLU that follows it.
    Linear { fan_in: usize, fan_out: usize, weight: Range<usize>, bias: Range<usize>, relu: bool },
    /// A convolution over `window`, `out` channels.
    Conv { window: Window, out: usize, weight: Range<usize>, bias: Option<Range<usize>> },
    /// Batch norm: `params` = weight | bias, `buffers` = running mean | var, `saved` = the
    /// batch's mean | invstd in the net's saved-statistics buffer.
    Norm { channels: usize, pixels: usize, params: Range<usize>, buffers: Range<usize>, saved: Range<usize> },
    /// ReLU in place.
    Relu,
    /// Max pooling over `window` (its `channels` are the image's; planes are channels x batch).
    MaxPool { window: Window },
    /// Global average pooling.
    AvgPool { channels: usize, pixels: usize },
    /// CNHW to `N x (C*H*W)`.
    Flatten { channels: usize, pixels: usize },
    /// `output = input + other`.
    Add { other: usize, other_grad: InputGrad },
    /// An embedding bag over the loaded batch of `slots` ids a sample: `table` is its rows.
    Bag { table: Range<usize>, dim: usize },
}

impl Op {
    /// What the node is, in a word (a measured profile's name for a layer without parameters).
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Op::ToChannels { .. } => "to-channels",
            Op::Linear { .. } => "linear",
            Op::Conv { .. } => "conv",
            Op::Norm { .. } => "batch-norm",
            Op::Relu => "relu",
            Op::MaxPool { .. } => "max-pool",
            Op::AvgPool { .. } => "avg-pool",
            Op::Flatten { .. } => "flatten",
            Op::Add { .. } => "add",
            Op::Bag { .. } => "embedding-bag",
        }
    }
}

/// One step of the compiled graph: `op` from activation slot `input` to slot `output`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) op: Op,
    pub(crate) input: usize,
    pub(crate) output: usize,
    pub(crate) input_grad: InputGrad,
}

/// One named tensor of the flat parameter (or buffer) vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// PyTorch's state-dict name (`layer1.0.conv1.weight`).
    pub name: String,
    /// PyTorch's shape.
    pub shape: Vec<usize>,
    /// Where it lies in the flat vector.
    pub range: Range<usize>,
    /// How it starts.
    pub init: Init,
}

/// A tensor's initial values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform in `[-bound, bound]` (PyTorch's default for linear and convolution layers),
    /// drawn from the generator of `layer`: tensors of one layer continue one stream.
    Uniform {
        /// `1 / sqrt(fan_in)`.
        bound: f32,
        /// The layer's index among the layers with parameters.
        layer: usize,
    },
    /// Every value this constant.
    Fill(f32),
    /// Standard normal (PyTorch's default for an embedding), from the generator of `layer`.
    Normal {
        /// The layer's index among the layers with parameters.
        layer: usize,
    },
}

/// A sparse model's table: the rows of an embedding bag within the flat buffer. Its gradient
/// is nonzero only in the rows a batch names, and the optimiser changes only those rows
/// (lazy momentum: a row's momentum waits while no batch names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Where it lies in the flat buffer.
    pub range: Range<usize>,
    /// Rows.
    pub rows: usize,
    /// Values per row.
    pub dim: usize,
}

impl Table {
    /// The flat range of row `r`.
    pub fn row(&self, r: usize) -> Range<usize> {
        let start = self.range.start + r * self.dim;
        start..start + self.dim
    }
}

impl Eq for Init {}

/// The flat layout of every parameter (and, identically, every gradient), and of the running
/// statistics that live beside them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The parameters, in PyTorch's `named_parameters()` order.
    pub params: Vec<Tensor>,
    /// Total number of parameters.
    pub len: usize,
    /// The buffers (running statistics), in state-dict order.
    pub buffers: Vec<Tensor>,
    /// Total number of buffer values.
    pub buffers_len: usize,
    /// A sparse model's table.
    pub table: Option<Table>,
    /// Gradient-ready units, descending (see [`Layout::backward_order`]).
    ready: Vec<Range<usize>>,
    /// Multiply-adds of one sample's forward pass, and those of layers whose input gradient
    /// backward skips (the first).
    macs: (u64, u64),
}

impl Layout {
    /// The layout of `spec` (a model that does not build has an empty layout; [`Graph::new`]
    /// says why).
    pub fn new(spec: &ModelSpec) -> Self {
        Graph::new(spec).map(|g| g.layout).unwrap_or_else(|_| Layout {
            params: Vec::new(),
            len: 0,
            buffers: Vec::new(),
            buffers_len: 0,
            table: None,
            ready: Vec::new(),
            macs: (0, 0),
        })
    }

    /// The ranges in the order backward produces gradients: last layer first; within a linear
    /// or convolution layer its bias, then its weight; a batch norm's weight and bias together.
    /// The ranges are contiguous and descending, so any prefix of this list is a suffix of the
    /// flat buffer, and a bucket that ends at one of them never splits a tensor.
    pub fn backward_order(&self) -> Vec<Range<usize>> {
        self.ready.clone()
    }

    /// Floating-point operations of one forward+backward pass for `batch` samples: 2 per
    /// multiply-add, three GEMMs per layer (forward, weight gradient, input gradient) except the
    /// input gradient of the first layer, which is never computed.
    pub fn step_flops(&self, batch: usize) -> f64 {
        2.0 * batch as f64 * (3 * self.macs.0 - self.macs.1) as f64
    }

    /// Floating-point operations of one sample's forward pass (2 per multiply-add).
    pub fn forward_flops_per_sample(&self) -> f64 {
        2.0 * self.macs.0 as f64
    }

    /// The parameter tensor named `name`.
    pub fn param(&self, name: &str) -> Option<&Tensor> {
        self.params.iter().find(|t| t.name == name)
    }
}

/// The shape of an activation: what the node that reads it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Flat(usize),
    Image { channels: usize, height: usize, width: usize },
    Bag { slots: usize },
}

impl Shape {
    fn len(self) -> usize {
        match self {
            Shape::Flat(n) => n,
            Shape::Image { channels, height, width } => channels * height * width,
            Shape::Bag { slots } => 2 * slots,
        }
    }
}

/// A compiled network: the nodes [`crate::net::Net`] runs, the size of each activation slot
/// per sample, and the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Graph {
    pub(crate) nodes: Vec<Node>,
    /// Values per sample of each activation slot; slot 0 is the loaded batch.
    pub(crate) slots: Vec<usize>,
    /// Whether backward needs each slot's gradient.
    pub(crate) slot_grads: Vec<bool>,
    /// Values of the saved batch-norm statistics.
    pub(crate) saved_len: usize,
    /// The layout of parameters and buffers.
    pub layout: Layout,
    /// A replayed model's layers (and no nodes).
    pub(crate) replay: Option<ReplayPlan>,
}

/// What [`crate::net::Net`] waits out for a replayed model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReplayPlan {
    /// Samples per step the times belong to.
    pub(crate) batch: usize,
    /// Each layer in backward order: forward and backward nanoseconds, and the tensors whose
    /// gradients it makes ready, in that order (descending ranges of the flat buffer).
    pub(crate) layers: Vec<(u64, u64, Vec<Range<usize>>)>,
    /// The optimiser step, nanoseconds.
    pub(crate) optimizer_ns: u64,
}

impl Graph {
    /// A replayed model: the tensors laid out so that the first gradient ready is the last in
    /// the flat buffer (as every model's is), each tensor a gradient-ready unit (so buckets
    /// close where they would in the model itself).
    fn replay(p: &Profile) -> Self {
        let mut params = Vec::new();
        let mut end = p.parameters();
        let mut layers = Vec::new();
        let mut ready = Vec::new();
        for (index, l) in p.layers.iter().enumerate() {
            let mut units = Vec::new();
            for (name, shape) in &l.tensors {
                let n: usize = shape.iter().product();
                let fan_in = if shape.len() > 1 { n / shape[0] } else { n };
                let init = Init::Uniform { bound: 1.0 / (fan_in as f32).sqrt(), layer: index };
                params.push(Tensor { name: name.clone(), shape: shape.clone(), range: end - n..end, init });
                units.push(end - n..end);
                end -= n;
            }
            ready.extend(units.iter().cloned());
            layers.push((l.forward_ns, l.backward_ns, units));
        }
        params.reverse();
        let len = p.parameters();
        Graph {
            nodes: Vec::new(),
            slots: vec![0],
            slot_grads: vec![false],
            saved_len: 0,
            layout: Layout {
                params,
                len,
                buffers: Vec::new(),
                buffers_len: 0,
                table: None,
                ready,
                macs: (0, 0),
            },
            replay: Some(ReplayPlan { batch: p.batch, layers, optimizer_ns: p.optimizer_ns }),
        }
    }
}

struct Builder {
    nodes: Vec<Node>,
    slots: Vec<Shape>,
    params: Vec<Tensor>,
    buffers: Vec<Tensor>,
    saved_len: usize,
    /// Layers with parameters so far (the initialisation streams).
    layers: usize,
    macs: u64,
    /// Multiply-adds of convolutions and linear layers reading the network's input.
    first_macs: u64,
    table: Option<Table>,
}

impl Builder {
    fn slot(&mut self, shape: Shape) -> usize {
        self.slots.push(shape);
        self.slots.len() - 1
    }

    fn tensor(list: &mut Vec<Tensor>, name: String, shape: Vec<usize>, init: Init) -> Range<usize> {
        let start = list.last().map_or(0, |t| t.range.end);
        let range = start..start + shape.iter().product::<usize>();
        list.push(Tensor { name, shape, range: range.clone(), init });
        range
    }

    fn param(&mut self, name: String, shape: Vec<usize>, init: Init) -> Range<usize> {
        Self::tensor(&mut self.params, name, shape, init)
    }

    fn node(&mut self, op: Op, input: usize, shape: Shape) -> usize {
        let output = self.slot(shape);
        self.nodes.push(Node { op, input, output, input_grad: InputGrad::Skip });
        output
    }

    fn image(&self, slot: usize, what: &str) -> Result<(usize, usize, usize)> {
        match self.slots[slot] {
            Shape::Image { channels, height, width } => Ok((channels, height, width)),
            other => Err(Error::invalid(
                "model",
                format!("{what} needs an image, but its input is a vector of {} values", other.len()),
            )),
        }
    }

    /// Add `layers` reading slot `x`; returns the slot of the last one's output.
    fn chain(&mut self, layers: &[Layer], mut x: usize) -> Result<usize> {
        for layer in layers {
            x = self.layer(layer, x)?;
        }
        Ok(x)
    }

    /// Add `layer` reading slot `x`; returns the slot of its output (`x` itself for a ReLU, and
    /// for a flatten of what is flat already). Each kind of layer is a step of its own below.
    fn layer(&mut self, layer: &Layer, x: usize) -> Result<usize> {
        match layer {
            Layer::EmbeddingBag { name, rows, dim, mean: _ } => self.embedding_bag(name, (*rows, *dim), x),
            Layer::Linear { name, out } => self.linear(name, *out, x),
            Layer::Conv { name, out, kernel, stride, pad, bias } => {
                self.conv(name, *out, (*kernel, *stride, *pad), *bias, x)
            }
            Layer::BatchNorm { name } => self.batch_norm(name, x),
            Layer::Relu => Ok(self.relu(x)),
            Layer::MaxPool { kernel, stride } => self.max_pool(*kernel, *stride, x),
            Layer::GlobalAvgPool => {
                let (channels, height, width) = self.image(x, "average pooling")?;
                Ok(self.node(Op::AvgPool { channels, pixels: height * width }, x, Shape::Flat(channels)))
            }
            Layer::Flatten => match self.slots[x] {
                Shape::Flat(_) | Shape::Bag { .. } => Ok(x),
                s @ Shape::Image { channels, height, width } => {
                    Ok(self.node(Op::Flatten { channels, pixels: height * width }, x, Shape::Flat(s.len())))
                }
            },
            Layer::Residual { body, shortcut } => self.residual(body, shortcut, x),
        }
    }

    /// Whether slot `x` holds the network's input (as loaded, or only turned to CNHW): a layer
    /// reading it counts its multiply-adds into `first_macs` too.
    fn reads_input(&self, x: usize) -> bool {
        x == 0
            || matches!(self.nodes.last(), Some(n) if n.output == x && matches!(n.op, Op::ToChannels { .. }))
    }

    /// An embedding bag `name` of `rows x dim`, reading the network's bags of ids.
    fn embedding_bag(&mut self, name: &str, (rows, dim): (usize, usize), x: usize) -> Result<usize> {
        let Shape::Bag { slots } = self.slots[x] else {
            return Err(Error::invalid("model", format!("{name}: an embedding bag reads bags of ids")));
        };
        if x != 0 || self.table.is_some() {
            return Err(Error::invalid(
                "model",
                format!("{name}: an embedding bag reads the network's input"),
            ));
        }
        let init = Init::Normal { layer: self.layers };
        self.layers += 1;
        let table = self.param(format!("{name}.weight"), vec![rows, dim], init);
        self.table = Some(Table { range: table.clone(), rows, dim });
        // A multiply-add per id and value, forward; backward the same once.
        let macs = (slots * dim) as u64;
        self.macs += macs;
        self.first_macs += macs;
        Ok(self.node(Op::Bag { table, dim }, x, Shape::Flat(dim)))
    }

    /// A linear layer `name` to `out` features, reading a vector.
    fn linear(&mut self, name: &str, out: usize, x: usize) -> Result<usize> {
        let reads_input = self.reads_input(x);
        let fan_in = match self.slots[x] {
            Shape::Flat(n) => n,
            Shape::Image { .. } | Shape::Bag { .. } => {
                return Err(Error::invalid(
                    "model",
                    format!("{name}: a linear layer needs a vector (flatten first)"),
                ));
            }
        };
        let init = Init::Uniform { bound: 1.0 / (fan_in as f32).sqrt(), layer: self.layers };
        self.layers += 1;
        let weight = self.param(format!("{name}.weight"), vec![out, fan_in], init);
        let bias = self.param(format!("{name}.bias"), vec![out], init);
        let macs = (fan_in * out) as u64;
        self.macs += macs;
        if reads_input {
            self.first_macs += macs;
        }
        Ok(self.node(Op::Linear { fan_in, fan_out: out, weight, bias, relu: false }, x, Shape::Flat(out)))
    }

    /// A convolution `name` to `out` channels with a square `kernel`, `stride` and `pad`
    /// (and a bias when `bias`), reading an image.
    fn conv(
        &mut self,
        name: &str,
        out: usize,
        (kernel, stride, pad): (usize, usize, usize),
        bias: bool,
        x: usize,
    ) -> Result<usize> {
        let reads_input = self.reads_input(x);
        let (channels, height, width) = self.image(x, name)?;
        if height + 2 * pad < kernel || width + 2 * pad < kernel || stride == 0 {
            return Err(Error::invalid(
                "model",
                format!("{name}: a {kernel}x{kernel} convolution does not fit a {height}x{width} input"),
            ));
        }
        let window = Window { channels, height, width, kernel, stride, pad };
        let fan_in = channels * kernel * kernel;
        let init = Init::Uniform { bound: 1.0 / (fan_in as f32).sqrt(), layer: self.layers };
        self.layers += 1;
        let weight = self.param(format!("{name}.weight"), vec![out, channels, kernel, kernel], init);
        let bias = bias.then(|| self.param(format!("{name}.bias"), vec![out], init));
        let macs = (out * fan_in * window.out_pixels()) as u64;
        self.macs += macs;
        if reads_input {
            self.first_macs += macs;
        }
        let shape = Shape::Image { channels: out, height: window.out_height(), width: window.out_width() };
        Ok(self.node(Op::Conv { window, out, weight, bias }, x, shape))
    }

    /// A batch norm `name` over an image's channels: its weight and bias, its running mean and
    /// variance, and room for the batch's mean and invstd.
    fn batch_norm(&mut self, name: &str, x: usize) -> Result<usize> {
        let (channels, height, width) = self.image(x, name)?;
        self.layers += 1;
        let weight = self.param(format!("{name}.weight"), vec![channels], Init::Fill(1.0));
        let bias = self.param(format!("{name}.bias"), vec![channels], Init::Fill(0.0));
        let mean =
            Self::tensor(&mut self.buffers, format!("{name}.running_mean"), vec![channels], Init::Fill(0.0));
        let var =
            Self::tensor(&mut self.buffers, format!("{name}.running_var"), vec![channels], Init::Fill(1.0));
        let saved = self.saved_len..self.saved_len + 2 * channels;
        self.saved_len += 2 * channels;
        let op = Op::Norm {
            channels,
            pixels: height * width,
            params: weight.start..bias.end,
            buffers: mean.start..var.end,
            saved,
        };
        let shape = self.slots[x];
        Ok(self.node(op, x, shape))
    }

    /// A ReLU on slot `x`, in place: fused into the linear layer that produced `x`, as the MLP
    /// always ran it, else a node of its own.
    fn relu(&mut self, x: usize) -> usize {
        if let Some(Node { op: Op::Linear { relu, .. }, output, .. }) = self.nodes.last_mut()
            && *output == x
            && !*relu
        {
            *relu = true;
            return x;
        }
        self.nodes.push(Node { op: Op::Relu, input: x, output: x, input_grad: InputGrad::Skip });
        x
    }

    /// A `kernel x kernel` max-pool with `stride`, reading an image.
    fn max_pool(&mut self, kernel: usize, stride: usize, x: usize) -> Result<usize> {
        let (channels, height, width) = self.image(x, "max-pool")?;
        if height < kernel || width < kernel || stride == 0 {
            return Err(Error::invalid(
                "model",
                format!("a {kernel}x{kernel} max-pool does not fit a {height}x{width} input"),
            ));
        }
        let window = Window { channels, height, width, kernel, stride, pad: 0 };
        let shape = Shape::Image { channels, height: window.out_height(), width: window.out_width() };
        Ok(self.node(Op::MaxPool { window }, x, shape))
    }

    /// A residual block: `body` and `shortcut` both read `x`, and their outputs are added.
    fn residual(&mut self, body: &[Layer], shortcut: &[Layer], x: usize) -> Result<usize> {
        let a = self.chain(body, x)?;
        let b = self.chain(shortcut, x)?;
        if self.slots[a] != self.slots[b] {
            return Err(Error::invalid(
                "model",
                format!("a residual block adds {:?} to {:?}", self.slots[a], self.slots[b]),
            ));
        }
        let shape = self.slots[a];
        Ok(self.node(Op::Add { other: b, other_grad: InputGrad::Skip }, a, shape))
    }
}

impl Graph {
    /// Each convolution's window and output channels, in forward order.
    pub fn convolutions(&self) -> Vec<(Window, usize)> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Conv { window, out, .. } => Some((*window, *out)),
                _ => None,
            })
            .collect()
    }

    /// Compile `spec`'s layers for its input; an error names a layer that does not fit.
    pub fn new(spec: &ModelSpec) -> Result<Self> {
        if let Arch::Replay(p) = &spec.arch {
            return Ok(Graph::replay(p));
        }
        let mut b = Builder {
            nodes: Vec::new(),
            slots: Vec::new(),
            params: Vec::new(),
            buffers: Vec::new(),
            saved_len: 0,
            layers: 0,
            macs: 0,
            first_macs: 0,
            table: None,
        };
        let mut x = match spec.input {
            Input::Flat(n) => b.slot(Shape::Flat(n)),
            Input::Image { channels, height, width } => b.slot(Shape::Image { channels, height, width }),
            Input::Bag { slots, .. } => b.slot(Shape::Bag { slots }),
        };
        if let Input::Image { channels, height, width } = spec.input {
            if spec.is_mlp() {
                b.slots[0] = Shape::Flat(channels * height * width);
            } else {
                x = b.node(Op::ToChannels { channels, pixels: height * width }, x, b.slots[0]);
            }
        }
        let out = b.chain(&spec.layers(), x)?;
        if b.slots[out] != Shape::Flat(spec.classes) {
            return Err(Error::invalid(
                "model",
                format!(
                    "{} ends in {:?}, not one score per class ({})",
                    spec.name, b.slots[out], spec.classes
                ),
            ));
        }
        let inputs =
            if b.nodes.first().is_some_and(|n| matches!(n.op, Op::ToChannels { .. })) { 2 } else { 1 };
        // A ReLU works in place: nothing before it may read what it overwrites.
        for (i, n) in b.nodes.iter().enumerate() {
            if n.op == Op::Relu {
                let early = b.nodes[..i].iter().any(|m| {
                    m.output != n.input
                        && (m.input == n.input || matches!(m.op, Op::Add { other, .. } if other == n.input))
                });
                if early || n.input < inputs {
                    return Err(Error::invalid(
                        "model",
                        "a ReLU overwrites an activation another layer reads",
                    ));
                }
            }
        }
        // Which node writes each input gradient first in backward (reverse) order.
        let mut written = vec![false; b.slots.len()];
        let mut mark = |slot: usize| {
            if slot < inputs {
                InputGrad::Skip
            } else if std::mem::replace(&mut written[slot], true) {
                InputGrad::Add
            } else {
                InputGrad::Write
            }
        };
        for n in b.nodes.iter_mut().rev() {
            if let Op::Add { other, other_grad } = &mut n.op {
                n.input_grad = mark(n.input);
                *other_grad = mark(*other);
            } else if n.op != Op::Relu && !matches!(n.op, Op::ToChannels { .. }) {
                n.input_grad = mark(n.input);
            }
        }
        let slot_grads = (0..b.slots.len()).map(|s| s >= inputs).collect();
        let mut ready = Vec::new();
        for n in b.nodes.iter().rev() {
            match &n.op {
                Op::Linear { weight, bias, .. } => ready.extend([bias.clone(), weight.clone()]),
                Op::Conv { weight, bias, .. } => ready.extend(bias.iter().cloned().chain([weight.clone()])),
                Op::Norm { params, .. } => ready.push(params.clone()),
                Op::Bag { table, .. } => ready.push(table.clone()),
                _ => {}
            }
        }
        let len = b.params.last().map_or(0, |t| t.range.end);
        let buffers_len = b.buffers.last().map_or(0, |t| t.range.end);
        let layout = Layout {
            params: b.params,
            len,
            buffers: b.buffers,
            buffers_len,
            table: b.table,
            ready,
            macs: (b.macs, b.first_macs),
        };
        Ok(Graph {
            nodes: b.nodes,
            slots: b.slots.iter().map(|s| s.len()).collect(),
            slot_grads,
            saved_len: b.saved_len,
            layout,
            replay: None,
        })
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

    /// The same plan without a sparse model's table (the first tensor, so the end of the last
    /// bucket): its gradient is then written in place and handed to nobody, for a strategy that
    /// moves only the rows a batch names. A model without a table keeps the whole plan.
    pub fn without_table(mut self, layout: &Layout) -> Self {
        if let Some(t) = &layout.table {
            self.buckets.retain_mut(|b| {
                b.start = b.start.max(t.range.end);
                b.start < b.end
            });
        }
        self
    }

    /// Whether the plan hands out a sparse model's table (every plan of a dense model does).
    pub fn covers_table(&self, layout: &Layout) -> bool {
        layout.table.as_ref().is_none_or(|t| self.buckets.iter().any(|b| b.start <= t.range.start))
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
        let arch = if spec.is_mlp() { "mlp:" } else { "" };
        Fingerprint { text: format!("{arch}{}:f32:seed={seed}", spec.widths_str()) }
    }

    /// The model it names (its seed aside).
    pub fn spec(&self) -> Result<ModelSpec> {
        let bad = || Error::invalid("fingerprint", format!("'{}' names no model gradsync knows", self.text));
        let (token, _) = self.text.rsplit_once(":f32:").ok_or_else(bad)?;
        ModelSpec::from_token(token.strip_prefix("mlp:").unwrap_or(token)).map_err(|_| bad())
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

/// Deterministic initial parameters: PyTorch's defaults for each module, weights and biases
/// of linear and convolution layers uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]` (one
/// generator per layer, seeded from `seed`, its weight drawn first), batch-norm weights 1 and
/// biases 0.
pub fn init_params(layout: &Layout, seed: u64) -> Vec<f32> {
    init_params_in(layout, seed, 0..layout.len)
}

/// `init_params(layout, seed)[range]`, without the rest: a parameter-server shard's values
/// cost its own range's memory, not the whole model's (eight shards of a 440 MB model each
/// zeroed and filled all of it). The generators still run from each layer's start, so every
/// value is the one the whole model would hold.
pub fn init_params_in(layout: &Layout, seed: u64, range: Range<usize>) -> Vec<f32> {
    assert!(range.start <= range.end && range.end <= layout.len, "{range:?} outside 0..{}", layout.len);
    let mut p: Vec<f32> = crate::heap::zeros(range.len());
    fill(&layout.params, &mut p, range.start, seed);
    p
}

/// The buffers' starting values: running means 0, running variances 1.
pub fn init_buffers(layout: &Layout) -> Vec<f32> {
    let mut b = vec![0.0; layout.buffers_len];
    fill(&layout.buffers, &mut b, 0, 0);
    b
}

/// Each tensor's initial values, where they fall in `out`, which holds the flat values from
/// `offset` on. A layer's generator is drawn through every value before the window's end
/// (the uniform stream runs on across a layer's tensors, its weight first), so a window's
/// values are the whole buffer's.
fn fill(tensors: &[Tensor], out: &mut [f32], offset: usize, seed: u64) {
    let end = offset + out.len();
    let mut stream: Option<(usize, Rng)> = None;
    // Tensors from the window's end on hold none of its values and feed no stream before it.
    for t in tensors.iter().filter(|t| t.range.start < end) {
        // The tensor's values in the window: flat indices lo..hi.
        let (lo, hi) = (t.range.start.max(offset), t.range.end.min(end));
        let mut put = |i: usize, v: f32| {
            if (lo..hi).contains(&i) {
                out[i - offset] = v;
            }
        };
        match t.init {
            Init::Fill(v) if lo < hi => out[lo - offset..hi - offset].fill(v),
            Init::Fill(_) => {}
            // A generator of its own: drawn only where the tensor meets the window.
            Init::Normal { layer } if lo < hi => {
                let mut rng = Rng::new(seed, 0x1417 + layer as u64);
                for i in t.range.start..hi {
                    put(i, rng.normal());
                }
            }
            Init::Normal { .. } => {}
            // The layer's stream runs on into its next tensor: drawn through the whole tensor.
            Init::Uniform { bound, layer } => {
                let rng = match &mut stream {
                    Some((l, rng)) if *l == layer => rng,
                    slot => &mut slot.insert((layer, Rng::new(seed, 0x1417 + layer as u64))).1,
                };
                for i in t.range.clone() {
                    put(i, rng.uniform_in(-bound, bound));
                }
            }
        }
    }
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
        assert_eq!(ModelSpec::parse("10-5-3").unwrap().widths_str(), "10-5-3");
    }

    /// Parameter and tensor counts as PyTorch's modules of `bench/pytorch/models.py` report
    /// them (`reference.py --describe`), and a conv net refusing flat data by name.
    #[test]
    fn conv_presets_have_pytorchs_sizes() {
        let image = |c, side| Input::Image { channels: c, height: side, width: side };
        for (name, input, params, tensors, buffers) in [
            ("resnet20", image(3, 32), 272_474, 65, 2 * 21),
            ("resnet20", image(1, 8), 272_186, 65, 2 * 21),
            ("resnet18", image(3, 32), 11_173_962, 62, 2 * 20),
            ("vgg11", image(3, 32), 28_149_514, 38, 2 * 8),
            ("vgg11", image(3, 8), 28_149_514, 38, 2 * 8),
            ("cnn8", image(1, 8), 151_402, 10, 2 * 2),
            ("cnn8", image(3, 32), 2_118_058, 10, 2 * 2),
        ] {
            let spec = ModelSpec::parse(name).unwrap().fit(input, 10).unwrap();
            let l = Layout::new(&spec);
            assert_eq!(
                (l.len, l.params.len(), l.buffers.len()),
                (params, tensors, buffers),
                "{name} at {input}"
            );
            let order = l.backward_order();
            assert_eq!(order.first().map(|r| r.end), Some(l.len), "{name}: backward starts at the top");
            assert!(order.windows(2).all(|w| w[0].start == w[1].end), "{name}: backward order is contiguous");
        }
        for name in ["tiny", "64-128-10", "resnet20", "cnn8", "vgg11"] {
            let spec = ModelSpec::parse(name).unwrap();
            assert_eq!(ModelSpec::from_token(&spec.widths_str()).unwrap().widths_str(), spec.widths_str());
            assert_eq!(Fingerprint::new(&spec, 3).spec().unwrap().widths_str(), spec.widths_str(), "{name}");
        }
        assert!(ModelSpec::from_token("resnet20:3x32-10").is_err());
        assert!(Fingerprint { text: "gpt:f32:seed=1".into() }.spec().is_err());
        let err = ModelSpec::parse("resnet20").unwrap().fit(Input::Flat(64), 10).unwrap_err().to_string();
        assert!(err.contains("resnet20") && err.contains("flat (64 values"), "{err}");
        let names: Vec<String> = Layout::new(&ModelSpec::parse("resnet20").unwrap())
            .params
            .iter()
            .take(4)
            .map(|t| t.name.clone())
            .collect();
        assert_eq!(names, ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight"]);
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

    /// A window of the initial parameters is the whole buffer's values there, wherever it
    /// starts and ends: inside a tensor, across a layer's weight and bias (one uniform
    /// stream), across batch-norm fills, or empty.
    #[test]
    fn a_window_of_the_initial_parameters_is_the_whole_buffers_values() {
        for model in ["tiny", "cnn8", "64-1024-10", "embedding:1000:8:16"] {
            let l = Layout::new(&ModelSpec::parse(model).unwrap());
            let whole = init_params(&l, 11);
            let n = l.len;
            let cuts = [0, 1, 7, n / 3, n / 2 + 5, n - 1, n];
            for &a in &cuts {
                for &b in cuts.iter().filter(|&&b| b >= a) {
                    assert_eq!(init_params_in(&l, 11, a..b), whole[a..b], "{model} {a}..{b}");
                }
            }
            for t in &l.params {
                let r = t.range.clone();
                assert_eq!(init_params_in(&l, 11, r.clone()), whole[r.clone()], "{model} {r:?}");
            }
        }
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
