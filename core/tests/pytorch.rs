//! Every preset against PyTorch (`bench/pytorch/reference.py`, the same modules in PyTorch
//! eager): from the same initial state and the same batch, in training mode, the loss and every
//! parameter's gradient within 1e-4 (relative to the tensor's largest value, or to a hundredth
//! of the model's largest gradient where the tensor's is smaller), and after 20 SGD-momentum
//! steps (lr 0.01) every parameter and running statistic within 1e-3 (relative to the tensor's
//! largest value), or, for a conv net, within four times PyTorch's own spread where that is wider: the
//! larger distance after the same 20 steps between PyTorch's usual run (oneDNN on the CPU, cuDNN
//! on a GPU) and either its plain im2col-and-GEMM convolutions (`reference.py --plain-conv`) or
//! the same run in float64 (`--float64`, the trajectory float32 rounds away from). Rounding
//! carried through 20 steps grows; on an H200, at lr 0.05, resnet20's first batch-norm bias
//! parted from cuDNN's by 4.7e-3. The first step's loss and gradients allow no spread. On the
//! CPU, one thread.
//!
//! On a GPU (when one is present; `$GRADSYNC_PYTORCH_DEVICES=cpu,cuda` chooses), the same on
//! cuda:0 against PyTorch on the same GPU (TF32 off on both sides).
//!
//! PyTorch comes from `$GRADSYNC_TORCH_PYTHON`, else a virtual environment the test installs
//! into the cache once ([`gradsync_testkit::torch_python`]); where neither can be had, or it
//! lacks safetensors, the test says SKIPPED with the reason (under CI it fails). The scripts
//! are `$GRADSYNC_PYTORCH_DIR` (a copy of `bench/pytorch/`), else the source tree's.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use gradsync_core::Engine;
use gradsync_core::device::Device;
use gradsync_core::model::{Input, ModelSpec};
use gradsync_core::optim::SgdConfig;
use gradsync_core::rng::Rng;
use gradsync_core::state_dict::{self, Entry, Tensors, Values};
use gradsync_testkit::Scratch;

const STEPS: usize = 20;
const GRAD_TOL: f64 = 1e-4;
const PARAM_TOL: f64 = 1e-3;

fn script() -> PathBuf {
    std::env::var_os("GRADSYNC_PYTORCH_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/pytorch"), PathBuf::from)
        .join("reference.py")
}

/// The largest magnitude in `v`.
fn max_abs(v: &[f32]) -> f64 {
    v.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()))
}

/// `max|a - b| / max(max|b|, floor)`, `b` being PyTorch's. The floor keeps a tensor whose values
/// are all but zero (the gradient of a bias that a batch norm follows is zero in exact
/// arithmetic, rounding noise in both) from being compared on its noise alone.
fn rel_diff(ours: &[f32], theirs: &[f32], floor: f64) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    let scale = max_abs(theirs).max(floor).max(1e-12);
    ours.iter().zip(theirs).fold(0f64, |m, (&a, &b)| m.max((f64::from(a) - f64::from(b)).abs())) / scale
}

/// The reference's name and image arguments for `spec`.
fn reference_args(spec: &ModelSpec) -> Vec<String> {
    let (name, (c, h, w)) = match spec.input {
        Input::Flat(n) => (format!("mlp:{}", spec.widths_str()), (1, 1, n)),
        Input::Image { channels, height, width } => (spec.name.clone(), (channels, height, width)),
        Input::Bag { slots, .. } => {
            let token = spec.widths_str();
            (token.rsplit_once('/').map_or(token.clone(), |(m, _)| m.to_string()), (1, 1, 2 * slots))
        }
    };
    let mut args = vec!["--model".to_string(), name];
    for (flag, v) in [("--in-channels", c), ("--height", h), ("--width", w), ("--classes", spec.classes)] {
        args.extend([flag.to_string(), v.to_string()]);
    }
    args
}

fn check_against_pytorch(python: &Path, device: Device, spec: &ModelSpec, rows: usize) {
    let dir = Scratch::new("pytorch-reference");
    let mut engine = Engine::new(device, spec.clone(), 5).unwrap();
    let init = dir.join("init.safetensors");
    state_dict::save(&init, &engine.state_dict().unwrap(), &[]).unwrap();
    let mut rng = Rng::new(9, 3);
    let x: Vec<f32> = match spec.input {
        // Bags: a varying number of ids (repeats among them, slots left empty) with weights.
        Input::Bag { rows: table, slots } => gradsync_core::data::random_bags(table, slots, rows, &mut rng),
        _ => (0..rows * spec.input()).map(|_| rng.normal()).collect(),
    };
    let y: Vec<u32> = (0..rows).map(|_| rng.below(spec.classes() as u64) as u32).collect();
    let shape = match spec.input {
        Input::Flat(n) => vec![rows, n],
        Input::Bag { slots, .. } => vec![rows, 2 * slots],
        Input::Image { channels, height, width } => vec![rows, channels, height, width],
    };
    let batch: Tensors = [
        ("x".to_string(), Entry::f32(shape, x.clone())),
        (
            "y".to_string(),
            Entry { shape: vec![rows], values: Values::I64(y.iter().map(|&v| i64::from(v)).collect()) },
        ),
    ]
    .into_iter()
    .collect();
    let batch_file = dir.join("batch.safetensors");
    state_dict::save(&batch_file, &batch, &[]).unwrap();
    // A gentler rate than the default (0.05), on both sides: at 0.05 the descent drives the
    // loss of one batch of 8 to 1e-4 within 20 steps, where the gradients are small enough that
    // one ReLU whose input rounding puts on the other side of zero changes them by percents
    // (gradsync's direct convolutions and its column-matrix ones, each exact to 5e-6 at a step,
    // parted at resnet20's fifth step so: parameters 1.2e-7 apart, gradients 1.5e-2).
    let cfg = SgdConfig { lr: 0.01, ..SgdConfig::DEFAULT };
    // PyTorch from the same start: with its usual convolutions (cuDNN, oneDNN), and again, for
    // a conv net, with its plain ones (`--plain-conv`: im2col and GEMM, as gradsync's), whose
    // distance from the first after 20 steps is PyTorch's own spread.
    let reference = |file: &str, variant: Option<&str>| {
        let out = dir.join(file);
        let run = Command::new(python)
            .arg(script())
            .args(reference_args(spec))
            .arg("--init")
            .arg(&init)
            .arg("--batch")
            .arg(&batch_file)
            .arg("--out")
            .arg(&out)
            .args(["--steps", &STEPS.to_string(), "--threads", "1"])
            .args(["--device", if device.is_cuda() { "cuda" } else { "cpu" }])
            .args(["--lr", &cfg.lr.to_string(), "--momentum", &cfg.momentum.to_string()])
            .args(["--weight-decay", &cfg.weight_decay.to_string()])
            .args(variant)
            .output()
            .expect("run the PyTorch reference");
        assert!(
            run.status.success(),
            "{}: the reference failed: {}",
            spec.name,
            String::from_utf8_lossy(&run.stderr)
        );
        state_dict::load(&out).unwrap()
    };
    let theirs = reference("out.safetensors", None);
    let conv = !spec.is_mlp() && spec.table().is_none();
    let others = if conv {
        vec![
            reference("plain.safetensors", Some("--plain-conv")),
            reference("exact.safetensors", Some("--float64")),
        ]
    } else {
        Vec::new()
    };
    let get = |name: &str| {
        theirs.get(name).unwrap_or_else(|| panic!("{}: the reference wrote no {name}", spec.name))
    };

    // The first step: loss and every gradient.
    let first = engine.forward(&x, &y, true).unwrap();
    engine.backward(false).unwrap();
    let loss0 = f64::from(get("loss0").to_f32()[0]);
    assert!(
        (first.loss - loss0).abs() <= GRAD_TOL * loss0.abs().max(1.0),
        "{}: loss {} against PyTorch's {loss0}",
        spec.name,
        first.loss
    );
    let grads = engine.grads().unwrap();
    // Gradients below a hundredth of the model's largest are compared at that level.
    let floor = 1e-2 * max_abs(&grads);
    let mut worst_grad = (0.0, String::new());
    for t in &engine.layout().params {
        let d = rel_diff(&grads[t.range.clone()], &get(&format!("grad.{}", t.name)).to_f32(), floor);
        assert!(d <= GRAD_TOL, "{}: gradient of {} differs from PyTorch's by {d:.2e}", spec.name, t.name);
        if d > worst_grad.0 {
            worst_grad = (d, t.name.clone());
        }
    }
    // The rest of the steps, then every state entry.
    engine.update(&cfg, 1.0).unwrap();
    let mut losses = vec![first.loss];
    for _ in 1..STEPS {
        losses.push(engine.forward(&x, &y, true).unwrap().loss);
        engine.backward(false).unwrap();
        engine.update(&cfg, 1.0).unwrap();
    }
    let their_losses = get("losses").to_f32();
    let trajectory = || {
        losses
            .iter()
            .zip(&their_losses)
            .map(|(a, b)| format!("{a:.3e}/{b:.3e}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let ours = engine.state_dict().unwrap();
    let mut worst = (0.0, String::new());
    let mut widest = 0f64;
    for (name, entry) in &ours {
        let want = get(name).to_f32();
        let d = rel_diff(&entry.to_f32(), &want, 0.0);
        // Where PyTorch's other runs part from it by more than PARAM_TOL / 4 (rounding carried
        // through 20 steps of a chaotic descent), gradsync may part from it by four times that.
        let spread = others.iter().fold(0f64, |m, other| {
            let theirs =
                other.get(name).unwrap_or_else(|| panic!("a second reference wrote no {name}")).to_f32();
            m.max(rel_diff(&theirs, &want, 0.0))
        });
        widest = widest.max(spread);
        let tol = PARAM_TOL.max(4.0 * spread);
        assert!(
            d <= tol,
            "{}: {name} after {STEPS} steps differs from PyTorch's by {d:.2e} (allowed {tol:.1e}; PyTorch's \
             plain convolutions or float64 differ from its usual run by {spread:.2e}); losses (ours/PyTorch's): {}",
            spec.name,
            trajectory()
        );
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    eprintln!(
        "{} on {}: loss {:.6} vs {loss0:.6}; worst gradient {:.1e} ({}); after {STEPS} steps worst {:.1e} ({}){}",
        spec.label(),
        device.label(),
        first.loss,
        worst_grad.0,
        worst_grad.1,
        worst.0,
        worst.1,
        if conv { format!(", PyTorch's own spread {widest:.1e}") } else { String::new() }
    );
}

#[test]
fn every_preset_matches_pytorch() {
    const TEST: &str = "every_preset_matches_pytorch";
    let python = match gradsync_testkit::torch_python().and_then(|p| {
        let ok = Command::new(&p).args(["-c", "import torch, safetensors.torch"]).output();
        if ok.is_ok_and(|o| o.status.success()) {
            Ok(p)
        } else {
            Err(gradsync_testkit::Error::Tools(format!(
                "{} cannot import torch and safetensors",
                p.display()
            )))
        }
    }) {
        Ok(p) => p,
        Err(e) if !gradsync_testkit::in_ci() => {
            eprintln!("SKIPPED (no PyTorch: {e}) [{TEST}]");
            return;
        }
        Err(e) => panic!("CI must check the models against PyTorch, but it cannot be had: {e}"),
    };
    let image = |channels, side| Input::Image { channels, height: side, width: side };
    let cases = [
        ("32-64-10", Input::Flat(32), 10, 8),
        ("cnn8", image(1, 8), 10, 8),
        ("resnet20", image(3, 16), 10, 8),
        ("resnet18", image(3, 16), 10, 8),
        ("vgg11", image(3, 32), 10, 8),
        // The sparse model, both poolings: a table of 40 rows, so that 8 bags repeat rows.
        ("embedding:40:6:12:mean", Input::Bag { rows: 40, slots: 5 }, 3, 8),
        ("embedding:40:6:12:9:sum", Input::Bag { rows: 40, slots: 5 }, 3, 8),
    ];
    let asked = std::env::var("GRADSYNC_PYTORCH_DEVICES").ok();
    let wants = |d: &str| asked.as_deref().is_none_or(|a| a.split(',').any(|x| x == d));
    let mut devices = Vec::new();
    if wants("cpu") {
        devices.push(Device::Cpu { threads: 1 });
    }
    match gradsync_core::device::cuda::probe(0) {
        Ok(_) if wants("cuda") => devices.push(Device::Cuda { ordinal: 0 }),
        Ok(_) => {}
        Err(e) if asked.as_deref().is_some_and(|a| a.contains("cuda")) => panic!("cuda was asked for: {e}"),
        Err(e) => eprintln!("{TEST}: no GPU here ({e}); the CPU only"),
    }
    for device in devices {
        for (name, input, classes, rows) in cases {
            let spec = ModelSpec::parse(name).unwrap().fit(input, classes).unwrap();
            check_against_pytorch(&python, device, &spec, rows);
        }
    }
}
