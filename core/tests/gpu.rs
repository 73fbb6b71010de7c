//! The CUDA backend against the CPU backend, on every device present.
//!
//! Each GPU test asks [`cuda::probe`] first; on a machine without a usable GPU it prints
//! `SKIPPED (no GPU): <reason>` to stderr and passes, so the suite stays green everywhere and the
//! skip is visible (`cargo nextest run --success-output immediate`, or `cargo test --
//! --nocapture`). The CPU backend is the independent reference.
//!
//! Agreement measure, per tensor: `max_i |gpu_i - cpu_i| / max(max_i |cpu_i|, 1e-3)`, i.e. the
//! worst absolute difference relative to the tensor's largest magnitude (a plain per-element
//! relative error would blow up on the many gradients that are nearly zero).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ops::Range;

use gradsync_core::data::SyntheticConfig;
use gradsync_core::device::{Backend, Cpu, Cuda, Device, DeviceRequest, cuda};
use gradsync_core::mlp::Mlp;
use gradsync_core::model::{BucketPlan, Layout, ModelSpec};
use gradsync_core::optim::SgdConfig;
use gradsync_core::rng::Rng;
use gradsync_core::{Engine, Error, Result};
use gradsync_testkit::{Counters, GpuRun, gpu_test};

/// Agreement asked of the two devices, in the measure of the module docs.
const TOL: f64 = 1e-4;

/// The GPU to run `test`'s body on here (a real GPU, or the fake CUDA in the child process
/// [`gpu_test`] started), or `None` when the body does not run in this process: it already ran
/// against the fake CUDA in a child, whose counters `check` examines, or the test is skipped.
fn gpu_or_skip(test: &str, check: impl FnOnce(&Counters)) -> Option<usize> {
    match gpu_test(test) {
        GpuRun::Here => match cuda::probe(0) {
            Ok(name) => {
                eprintln!("{test}: running on cuda:0 ({name})");
                Some(0)
            }
            Err(e) => panic!("{test}: a GPU was expected here: {e}"),
        },
        GpuRun::Fake(counters) => {
            check(&counters);
            None
        }
        GpuRun::Skipped => None,
    }
}

/// The counters of a test that trains: kernels and GEMMs ran.
fn computed(c: &Counters) {
    assert!(c.launches > 0 && c.gemms > 0, "the GPU did no work: {c}");
}

/// Every device present: the CPU, then cuda:0 when it can be used.
fn devices(test: &str) -> Vec<Device> {
    let mut v = vec![Device::Cpu { threads: 2 }];
    if let Some(ordinal) = gpu_or_skip(test, computed) {
        v.push(Device::Cuda { ordinal });
    }
    v
}

/// `max|a - b| / max(max|a|, 1e-3)`, `a` being the reference.
fn rel_diff(reference: &[f32], other: &[f32]) -> f64 {
    assert_eq!(reference.len(), other.len(), "compared tensors differ in length");
    let scale = reference.iter().fold(1e-3f64, |m, &v| m.max(f64::from(v).abs()));
    let worst =
        reference.iter().zip(other).fold(0f64, |m, (&a, &b)| m.max((f64::from(a) - f64::from(b)).abs()));
    worst / scale
}

/// Compare every parameter tensor of `layout` between the two flat buffers.
fn assert_tensors_agree(what: &str, layout: &Layout, cpu: &[f32], gpu: &[f32]) {
    for (l, lr) in layout.layers.iter().enumerate() {
        for (name, r) in [("weight", &lr.weight), ("bias", &lr.bias)] {
            let d = rel_diff(&cpu[r.clone()], &gpu[r.clone()]);
            assert!(d <= TOL, "{what}: layer {l} {name} differs by {d:.3e} (relative to its max)");
        }
    }
}

/// A deterministic batch for `spec`.
fn batch(spec: &ModelSpec, rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(seed, 7);
    let x = (0..rows * spec.input()).map(|_| rng.normal()).collect();
    let y = (0..rows).map(|_| rng.below(spec.classes() as u64) as u32).collect();
    (x, y)
}

/// What one device computed in [`exercise`].
#[derive(Debug)]
struct Outcome {
    loss: f64,
    correct: u64,
    grads: Vec<f32>,
    grads_accumulated: Vec<f32>,
    buckets: Vec<(usize, Range<usize>)>,
    params: Vec<f32>,
    eval_loss: f64,
}

/// Forward, bucketed backward, accumulating backward, scale, update and an evaluation forward
/// on one device; every backend method is used on the way.
fn exercise<B: Backend>(backend: B, spec: &ModelSpec, x: &[f32], y: &[u32], cap: usize) -> Result<Outcome> {
    let mut mlp = Mlp::new(backend, spec.clone(), 42)?;
    let n = mlp.layout().len;
    let plan = BucketPlan::with_cap(mlp.layout(), cap);
    let first = mlp.forward(x, y, true)?;
    let mut buckets = Vec::new();
    mlp.backward(&plan, false, &mut |i, r, _view| buckets.push((i, r)))?;
    let mut grads = vec![0.0; n];
    mlp.read_grads(0..n, &mut grads)?;
    // The same batch again, added to the first: twice the gradient.
    mlp.backward(&plan, true, &mut |_, _, _| {})?;
    let mut grads_accumulated = vec![0.0; n];
    mlp.read_grads(0..n, &mut grads_accumulated)?;
    mlp.scale_grads(0.5)?;
    mlp.update(&SgdConfig::default(), 1.0)?;
    let mut params = vec![0.0; n];
    mlp.read_params(0..n, &mut params)?;
    let after = mlp.forward(x, y, false)?;
    mlp.backend().synchronize()?;
    Ok(Outcome {
        loss: first.loss,
        correct: first.correct,
        grads,
        grads_accumulated,
        buckets,
        params,
        eval_loss: after.loss,
    })
}

/// The CPU and cuda:0 run the same model on the same batch and must agree on everything.
fn cpu_and_gpu_agree(test: &str, spec: &str, rows: usize, cap: usize) -> Result<()> {
    let spec = ModelSpec::parse(spec)?;
    let layout = Layout::new(&spec);
    let (x, y) = batch(&spec, rows, 3);
    // The reference, checked on its own so the harness is exercised even without a GPU.
    let cpu = exercise(Cpu::new(2)?, &spec, &x, &y, cap)?;
    assert!(cpu.buckets.len() > 1, "the plan should split the gradients into several buckets");
    let doubled: Vec<f32> = cpu.grads.iter().map(|g| 2.0 * g).collect();
    assert_tensors_agree("cpu: accumulating the same batch twice", &layout, &doubled, &cpu.grads_accumulated);
    assert!(cpu.eval_loss < cpu.loss, "cpu: one step on the batch should lower its loss");

    let Some(ordinal) = gpu_or_skip(test, computed) else { return Ok(()) };
    let gpu = exercise(Cuda::new(ordinal)?, &spec, &x, &y, cap)?;

    let loss_diff = (cpu.loss - gpu.loss).abs() / cpu.loss.abs().max(1e-3);
    assert!(loss_diff <= TOL, "loss: cpu {} gpu {} ({loss_diff:.3e})", cpu.loss, gpu.loss);
    assert_eq!(cpu.correct, gpu.correct, "correct predictions");
    assert_eq!(cpu.buckets, gpu.buckets, "buckets handed out by backward");
    assert_tensors_agree("gradients", &layout, &cpu.grads, &gpu.grads);
    assert_tensors_agree("accumulated gradients", &layout, &cpu.grads_accumulated, &gpu.grads_accumulated);
    assert_tensors_agree("parameters after one update", &layout, &cpu.params, &gpu.params);
    let eval_diff = (cpu.eval_loss - gpu.eval_loss).abs() / cpu.eval_loss.abs().max(1e-3);
    assert!(eval_diff <= TOL, "loss after update: cpu {} gpu {}", cpu.eval_loss, gpu.eval_loss);
    eprintln!("{test}: loss {:.6} (cpu) vs {:.6} (gpu), all tensors within {TOL:e}", cpu.loss, gpu.loss);
    Ok(())
}

#[test]
fn cpu_and_gpu_agree_on_tiny() -> Result<()> {
    cpu_and_gpu_agree("cpu_and_gpu_agree_on_tiny", "tiny", 64, 1000)
}

#[test]
fn cpu_and_gpu_agree_on_odd_sizes() -> Result<()> {
    // Widths and batch that are multiples of nothing, to catch leading-dimension mistakes.
    cpu_and_gpu_agree("cpu_and_gpu_agree_on_odd_sizes", "13-33-17-5", 29, 200)
}

/// A short local training run on `device`: the loss must fall.
fn loss_falls(device: Device) -> Result<()> {
    let data = SyntheticConfig { train: 1024, test: 64, dim: 256, classes: 8 }.generate(5);
    let spec = ModelSpec::parse("tiny")?.with_io(data.dim, data.classes);
    let mut engine = Engine::new(device, spec, 11)?;
    assert_eq!(engine.is_cuda(), device.is_cuda());
    assert_eq!(engine.gpu_name().is_some(), device.is_cuda());
    let cfg = SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 1e-4 };
    let (rows, steps) = (64, 80);
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut losses = Vec::new();
    for step in 0..steps {
        let indices: Vec<usize> = (0..rows).map(|i| (step * rows + i) % data.train.len()).collect();
        data.gather(&indices, &mut x, &mut y);
        losses.push(engine.forward(&x, &y, true)?.loss);
        engine.backward(false)?;
        engine.update(&cfg, 1.0)?;
    }
    engine.synchronize()?;
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&losses[..4]), mean(&losses[steps - 4..]));
    assert!(losses.iter().all(|l| l.is_finite()), "{}: non-finite loss in {losses:?}", engine.describe());
    assert!(last < 0.5 * first, "{}: loss went from {first:.4} to {last:.4}", engine.describe());
    eprintln!("{}: loss {first:.4} -> {last:.4} in {steps} steps", engine.describe());
    Ok(())
}

#[test]
fn local_training_loss_falls_on_every_device() -> Result<()> {
    for device in devices("local_training_loss_falls_on_every_device") {
        loss_falls(device)?;
    }
    Ok(())
}

#[test]
fn asking_for_a_missing_gpu_is_a_clear_error() -> Result<()> {
    match cuda::probe(0) {
        Ok(_) => {
            // With a GPU the same request resolves; the error path is then covered by an
            // ordinal no machine has.
            assert_eq!(Device::resolve(DeviceRequest::Cuda(0), 1)?, Device::Cuda { ordinal: 0 });
            let err = Device::resolve(DeviceRequest::Cuda(1_000_000), 1).err();
            assert!(matches!(err, Some(Error::NoCuda(_))), "{err:?}");
        }
        Err(reason) => {
            eprintln!("no GPU here ({reason}); checking that asking for one fails cleanly");
            assert!(matches!(reason, Error::NoCuda(_)), "{reason}");
            let err = Device::resolve(DeviceRequest::Cuda(0), 1).err();
            let msg = err.as_ref().map(ToString::to_string).unwrap_or_default();
            assert!(matches!(err, Some(Error::NoCuda(_))), "{err:?}");
            assert!(msg.starts_with("CUDA unavailable:") && msg.len() > 20, "unclear message: {msg}");
            // Building on the GPU anyway fails the same way, without a panic.
            let spec = ModelSpec::parse("tiny")?;
            assert!(matches!(Engine::new(Device::Cuda { ordinal: 0 }, spec, 1), Err(Error::NoCuda(_))));
            assert!(matches!(Cuda::new(0), Err(Error::NoCuda(_))));
            // Auto falls back to the CPU.
            assert_eq!(Device::resolve(DeviceRequest::Auto, 3)?, Device::Cpu { threads: 3 });
        }
    }
    Ok(())
}

#[test]
fn gpu_views_are_bounds_checked_and_tied_to_their_backend() -> Result<()> {
    let test = "gpu_views_are_bounds_checked_and_tied_to_their_backend";
    let Some(ordinal) = gpu_or_skip(test, |c| assert_eq!(c.launches, 2, "two scale kernels: {c}")) else {
        return Ok(());
    };
    let gpu = Cuda::new(ordinal)?;
    let mut buf = gpu.zeros(10)?;
    let past_end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = Cuda::view(&buf, 4..11);
    }));
    assert!(past_end.is_err(), "a view past the buffer's end must be refused");

    // Split, scale each half differently, read back: the halves are where they should be.
    gpu.write(&mut buf, 0, &[1.0; 10])?;
    let (mut lo, mut hi) = Cuda::split_at(Cuda::view_mut(&mut buf, 2..10), 3);
    assert_eq!((lo.len(), hi.len()), (3, 5));
    assert_eq!(hi.device_ptr() - lo.device_ptr(), 3 * 4, "the upper half starts 3 floats after the lower");
    gpu.scale(lo.reborrow(), 2.0)?;
    gpu.scale(hi.reborrow(), 3.0)?;
    let mut host = [0.0f32; 10];
    gpu.read(&buf, 0..10, &mut host)?;
    assert_eq!(host, [1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0]);
    assert_eq!(Cuda::raw_range(&buf, 5..10).1, 5);

    // A second backend has its own stream: it must refuse the first one's buffers.
    let other = Cuda::new(ordinal)?;
    let refused = other.scale(Cuda::view_mut(&mut buf, 0..10), 2.0);
    assert!(matches!(refused, Err(Error::Cuda { .. })), "{refused:?}");
    Ok(())
}
