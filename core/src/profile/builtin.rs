//! The built-in profiles: ResNet-50, VGG-16, BERT-base and GPT-2 with PyTorch's exact tensor
//! lists (torchvision's `resnet50` and `vgg16`, Hugging Face's `BertModel` and `GPT2Model`),
//! and compute times estimated per layer from its FLOPs and the bytes it moves: a roofline,
//! `max(FLOPs / rate, bytes / bandwidth)`, at a stated [`DeviceRate`]. Activations count 2
//! bytes (bf16 mixed precision, where parameters and gradients stay f32, as PyTorch's autocast
//! keeps them); backward takes twice forward's FLOPs and bytes (input and weight gradients);
//! the optimiser step reads and writes 20 bytes per parameter (parameter, gradient, momentum).

use super::{Layer, Profile};
use crate::error::{Error, Result};

/// The built-in profiles, each with what `--model --help` says of it.
pub const BUILTINS: &[(&str, &str)] = &[
    ("resnet50", "torchvision ResNet-50, 224x224 images, batch 64 (compute-heavy, many small tensors)"),
    (
        "vgg16",
        "torchvision VGG-16, 224x224 images, batch 64 (communication-heavy: one 103 M-parameter fully connected layer)",
    ),
    ("bert-base", "Hugging Face BertModel (bert-base-uncased), 128-token sequences, batch 32"),
    (
        "gpt2",
        "Hugging Face GPT2Model (124 M), 1024-token sequences, batch 8, the output layer tied to the token embedding",
    ),
];

/// The device a built-in profile's times are estimated for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceRate {
    /// Sustained dense throughput of convolutions and matrix products, TFLOP/s.
    pub tflops: f64,
    /// Memory bandwidth, TB/s.
    pub tbps: f64,
}

impl DeviceRate {
    /// An NVIDIA H100 SXM in bf16 mixed precision: 40% of its 989 TFLOP/s dense BF16
    /// tensor-core peak (a model FLOPs utilisation large training runs report, e.g. PaLM's
    /// 46%) and its 3.35 TB/s of HBM3 bandwidth, both peaks from NVIDIA's H100 datasheet.
    pub const H100: DeviceRate = DeviceRate { tflops: 400.0, tbps: 3.35 };

    /// The rate in words, as profiles record it.
    pub fn describe(&self) -> String {
        let who = if *self == Self::H100 { "an H100 SXM in bf16 at 40% of peak: " } else { "" };
        format!("{who}{} TFLOP/s, {} TB/s", self.tflops, self.tbps)
    }

    /// Check a rate the user gave.
    pub fn checked(self) -> Result<Self> {
        let ok = |v: f64| v.is_finite() && v > 0.0 && v < 1e6;
        if !ok(self.tflops) {
            return Err(Error::invalid(
                "device-tflops",
                format!("{} (expected a positive rate)", self.tflops),
            ));
        }
        if !ok(self.tbps) {
            return Err(Error::invalid(
                "device-tbps",
                format!("{} (expected a positive bandwidth)", self.tbps),
            ));
        }
        Ok(self)
    }
}

/// The built-in profile `name` at `rate`, or `None` for a name that is not one.
pub fn builtin(name: &str, rate: DeviceRate) -> Option<Profile> {
    let (costs, batch) = match name {
        "resnet50" => (resnet50(), 64),
        "vgg16" => (vgg16(), 64),
        "bert-base" => (bert_base(128), 32),
        "gpt2" => (gpt2(1024), 8),
        _ => return None,
    };
    let at = |flops: f64, bytes: f64| {
        let s = (batch as f64 * flops / (rate.tflops * 1e12)).max(batch as f64 * bytes / (rate.tbps * 1e12));
        (s * 1e9).round() as u64
    };
    let layers: Vec<Layer> = costs
        .into_iter()
        .rev()
        .map(|c| Layer {
            forward_ns: at(c.flops, c.bytes),
            backward_ns: at(2.0 * c.flops, 2.0 * c.bytes),
            name: c.name,
            tensors: c.tensors,
        })
        .collect();
    let mut p = Profile {
        model: name.into(),
        batch,
        device: rate.describe(),
        estimated: true,
        layers,
        optimizer_ns: 0,
        source: format!("built-in {name}"),
    };
    p.optimizer_ns = (p.parameters() as f64 * 20.0 / (rate.tbps * 1e12) * 1e9).round() as u64;
    Some(p)
}

/// One layer's forward cost per sample, and its tensors in the order PyTorch's backward makes
/// them ready (a linear layer's or convolution's bias before its weight, a norm's weight before
/// its bias).
struct Cost {
    name: String,
    flops: f64,
    bytes: f64,
    tensors: Vec<(String, Vec<usize>)>,
}

/// Bytes per activation value (bf16).
const ACT: f64 = 2.0;

#[derive(Default)]
struct Costs(Vec<Cost>);

impl Costs {
    fn push(&mut self, name: impl Into<String>, flops: f64, bytes: f64, tensors: Vec<(String, Vec<usize>)>) {
        self.0.push(Cost { name: name.into(), flops, bytes, tensors });
    }

    /// A convolution `k x k`, `stride`, padding `k / 2`, over `side x side`; returns the output
    /// side.
    fn conv(
        &mut self,
        name: &str,
        (cin, cout): (usize, usize),
        k: usize,
        stride: usize,
        side: usize,
        bias: bool,
    ) -> usize {
        let out = (side + 2 * (k / 2) - k) / stride + 1;
        let flops = 2.0 * (k * k * cin * cout * out * out) as f64;
        let bytes = ACT * (cin * side * side + cout * out * out) as f64;
        let mut t = Vec::new();
        if bias {
            t.push((format!("{name}.bias"), vec![cout]));
        }
        t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
        self.push(name, flops, bytes, t);
        out
    }

    /// A batch norm (with the ReLU after it) over `c x side x side`.
    fn bn(&mut self, name: &str, c: usize, side: usize) {
        let n = (c * side * side) as f64;
        self.push(
            name,
            8.0 * n,
            ACT * 2.0 * n,
            vec![(format!("{name}.weight"), vec![c]), (format!("{name}.bias"), vec![c])],
        );
    }

    /// A layer norm over `tokens x d`.
    fn ln(&mut self, name: &str, tokens: usize, d: usize) {
        let n = (tokens * d) as f64;
        self.push(
            name,
            8.0 * n,
            ACT * 2.0 * n,
            vec![(format!("{name}.weight"), vec![d]), (format!("{name}.bias"), vec![d])],
        );
    }

    /// A linear layer over `tokens` rows, PyTorch's `[out, in]` weight (or Hugging Face
    /// Conv1D's `[in, out]` with `conv1d`).
    fn linear(&mut self, name: &str, tokens: usize, fan_in: usize, fan_out: usize, conv1d: bool) {
        let shape = if conv1d { vec![fan_in, fan_out] } else { vec![fan_out, fan_in] };
        self.push(
            name,
            2.0 * (tokens * fan_in * fan_out) as f64,
            ACT * (tokens * (fan_in + fan_out)) as f64,
            vec![(format!("{name}.bias"), vec![fan_out]), (format!("{name}.weight"), shape)],
        );
    }

    /// A layer without parameters moving `values` activations in and out.
    fn elementwise(&mut self, name: &str, values: usize) {
        self.push(name, values as f64, ACT * 2.0 * values as f64, Vec::new());
    }

    /// Attention scores and their weighted sum over `tokens` (all heads together).
    fn attention(&mut self, name: &str, tokens: usize, d: usize, heads: usize) {
        let flops = 4.0 * (tokens * tokens * d) as f64;
        let bytes = ACT * (3 * tokens * tokens * heads + 4 * tokens * d) as f64;
        self.push(name, flops, bytes, Vec::new());
    }
}

fn resnet50() -> Vec<Cost> {
    let mut c = Costs::default();
    let mut side = c.conv("conv1", (3, 64), 7, 2, 224, false);
    c.bn("bn1", 64, side);
    side = (side + 2 - 3) / 2 + 1;
    c.elementwise("maxpool", 64 * side * side);
    let mut cin = 64;
    for (stage, (width, blocks)) in [(64, 3), (128, 4), (256, 6), (512, 3)].into_iter().enumerate() {
        for b in 0..blocks {
            let stride = if b == 0 && stage > 0 { 2 } else { 1 };
            let p = format!("layer{}.{b}", stage + 1);
            c.conv(&format!("{p}.conv1"), (cin, width), 1, 1, side, false);
            c.bn(&format!("{p}.bn1"), width, side);
            let out = c.conv(&format!("{p}.conv2"), (width, width), 3, stride, side, false);
            c.bn(&format!("{p}.bn2"), width, out);
            c.conv(&format!("{p}.conv3"), (width, 4 * width), 1, 1, out, false);
            c.bn(&format!("{p}.bn3"), 4 * width, out);
            if b == 0 {
                c.conv(&format!("{p}.downsample.0"), (cin, 4 * width), 1, stride, side, false);
                c.bn(&format!("{p}.downsample.1"), 4 * width, out);
            }
            c.elementwise(&format!("{p}.add"), 4 * width * out * out);
            cin = 4 * width;
            side = out;
        }
    }
    c.elementwise("avgpool", cin * side * side);
    c.linear("fc", 1, cin, 1000, false);
    c.0
}

fn vgg16() -> Vec<Cost> {
    let mut c = Costs::default();
    let (mut side, mut cin, mut index) = (224, 3, 0);
    for v in [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0] {
        if v == 0 {
            side /= 2;
            c.elementwise(&format!("features.{index}"), cin * side * side);
            index += 1;
        } else {
            side = c.conv(&format!("features.{index}"), (cin, v), 3, 1, side, true);
            cin = v;
            index += 2;
        }
    }
    c.linear("classifier.0", 1, 512 * 7 * 7, 4096, false);
    c.linear("classifier.3", 1, 4096, 4096, false);
    c.linear("classifier.6", 1, 4096, 1000, false);
    c.0
}

fn bert_base(tokens: usize) -> Vec<Cost> {
    let (d, ff, heads) = (768, 3072, 12);
    let mut c = Costs::default();
    let e = "embeddings";
    c.push(
        e,
        (10 * tokens * d) as f64,
        ACT * (8 * tokens * d) as f64,
        vec![
            (format!("{e}.LayerNorm.weight"), vec![d]),
            (format!("{e}.LayerNorm.bias"), vec![d]),
            (format!("{e}.position_embeddings.weight"), vec![512, d]),
            (format!("{e}.token_type_embeddings.weight"), vec![2, d]),
            (format!("{e}.word_embeddings.weight"), vec![30522, d]),
        ],
    );
    for l in 0..12 {
        let p = format!("encoder.layer.{l}");
        for q in ["query", "key", "value"] {
            c.linear(&format!("{p}.attention.self.{q}"), tokens, d, d, false);
        }
        c.attention(&format!("{p}.attention.self"), tokens, d, heads);
        c.linear(&format!("{p}.attention.output.dense"), tokens, d, d, false);
        c.ln(&format!("{p}.attention.output.LayerNorm"), tokens, d);
        c.linear(&format!("{p}.intermediate.dense"), tokens, d, ff, false);
        c.linear(&format!("{p}.output.dense"), tokens, ff, d, false);
        c.ln(&format!("{p}.output.LayerNorm"), tokens, d);
    }
    c.linear("pooler.dense", 1, d, d, false);
    c.0
}

fn gpt2(tokens: usize) -> Vec<Cost> {
    let (d, ff, heads, vocab) = (768, 3072, 12, 50257);
    let mut c = Costs::default();
    // The token embedding's gradient is ready only when backward reaches the input, since the
    // output layer's weight is the same tensor.
    c.push(
        "embeddings",
        (2 * tokens * d) as f64,
        ACT * (3 * tokens * d) as f64,
        vec![("wpe.weight".into(), vec![1024, d]), ("wte.weight".into(), vec![vocab, d])],
    );
    for l in 0..12 {
        let p = format!("h.{l}");
        c.ln(&format!("{p}.ln_1"), tokens, d);
        c.linear(&format!("{p}.attn.c_attn"), tokens, d, 3 * d, true);
        c.attention(&format!("{p}.attn"), tokens, d, heads);
        c.linear(&format!("{p}.attn.c_proj"), tokens, d, d, true);
        c.ln(&format!("{p}.ln_2"), tokens, d);
        c.linear(&format!("{p}.mlp.c_fc"), tokens, d, ff, true);
        c.linear(&format!("{p}.mlp.c_proj"), tokens, ff, d, true);
    }
    c.ln("ln_f", tokens, d);
    c.push(
        "lm_head (tied to wte)",
        2.0 * (tokens * d * vocab) as f64,
        ACT * (tokens * (d + vocab)) as f64,
        Vec::new(),
    );
    c.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtins_hold_pytorchs_exact_parameter_counts() {
        for (name, params, tensors) in [
            ("resnet50", 25_557_032, 161),
            ("vgg16", 138_357_544, 32),
            ("bert-base", 109_482_240, 199),
            ("gpt2", 124_439_808, 148),
        ] {
            let p = builtin(name, DeviceRate::H100).unwrap();
            assert_eq!(p.parameters(), params, "{name}");
            assert_eq!(p.tensors(), tensors, "{name}");
            assert!(p.estimated);
        }
        assert!(builtin("resnet51", DeviceRate::H100).is_none());
    }

    #[test]
    fn gradients_are_ready_last_layer_first() {
        let p = builtin("resnet50", DeviceRate::H100).unwrap();
        let order: Vec<&str> = p.layers.iter().flat_map(|l| &l.tensors).map(|(n, _)| n.as_str()).collect();
        // As PyTorch's post-accumulate-grad hooks fire for torchvision's model.
        assert_eq!(&order[..4], ["fc.bias", "fc.weight", "layer4.2.bn3.weight", "layer4.2.bn3.bias"]);
        assert_eq!(order.last(), Some(&"conv1.weight"));
        let g = builtin("gpt2", DeviceRate::H100).unwrap();
        let last: Vec<&str> = g.layers.last().unwrap().tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(last, ["wpe.weight", "wte.weight"], "the tied embedding is ready last");
    }

    #[test]
    fn estimated_times_follow_the_rate() {
        let fast = builtin("vgg16", DeviceRate::H100).unwrap();
        let slow = builtin("vgg16", DeviceRate { tflops: 100.0, tbps: 3.35 }).unwrap();
        let (f, s) = (fast.compute_ns(), slow.compute_ns());
        // VGG-16's convolutions are compute-bound: a quarter of the rate, nearly four times the time.
        assert!(s.0 as f64 > 3.5 * f.0 as f64 && s.0 <= 4 * f.0 + 1000, "{f:?} {s:?}");
        assert_eq!(fast.layout_tag(), slow.layout_tag());
        // ResNet-50 forward is 4.1 GMAC per 224x224 image: 8.2 GFLOP x 64 at 400 TFLOP/s is
        // 1.31 ms when memory is never the limit; its batch norms and additions add to that.
        let flops_only = builtin("resnet50", DeviceRate { tflops: 400.0, tbps: 1e5 }).unwrap();
        let fwd_ms = flops_only.compute_ns().0 as f64 / 1e6;
        assert!((1.29..1.36).contains(&fwd_ms), "{fwd_ms}");
        let roofline = builtin("resnet50", DeviceRate::H100).unwrap().compute_ns().0 as f64 / 1e6;
        assert!(roofline > 1.5 * fwd_ms, "{roofline}");
        assert!(DeviceRate { tflops: 0.0, tbps: 1.0 }.checked().is_err());
        assert!(DeviceRate { tflops: 1.0, tbps: f64::NAN }.checked().is_err());
    }
}
