//! The CUDA backend against the CPU backend, on every device present.
//!
//! Each GPU test asks [`gpu_test`] where its body runs: in place on a machine with a real GPU;
//! elsewhere again in a child process against gradsync-testkit's fake CUDA (host memory with
//! every access checked, the project's own kernels compiled for the host, a reference SGEMM)
//! with the real NVRTC from NVIDIA's wheels, the fake's counters (kernel launches, GEMM calls,
//! allocations, none alive at exit) coming back to be checked here. Only when NVRTC cannot be
//! installed (no network) does a test print `SKIPPED (...)` and pass, and never under CI. The
//! CPU backend is the independent reference.
//!
//! Agreement measure, per tensor: `max_i |gpu_i - cpu_i| / max(max_i |cpu_i|, 1e-3)`, i.e. the
//! worst absolute difference relative to the tensor's largest magnitude (a plain per-element
//! relative error would blow up on the many gradients that are nearly zero).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ops::Range;

use gradsync_core::data::SyntheticConfig;
use gradsync_core::device::{
    Backend, ChannelSum, Cpu, Cuda, Device, DeviceRequest, NormConfig, Window, cuda,
};
use gradsync_core::model::{BucketPlan, Input, Layout, ModelSpec};
use gradsync_core::net::Net;
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

/// Compare every parameter tensor of `layout` between the two flat buffers, each relative to its
/// largest value or to a hundredth of the largest of all, whichever is more: a tensor whose
/// values are all but zero (a bias that a batch norm follows has a zero gradient in exact
/// arithmetic) is compared at that level, not on its rounding noise.
fn assert_tensors_agree(what: &str, layout: &Layout, cpu: &[f32], gpu: &[f32]) {
    let floor = 1e-2 * cpu.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    for t in &layout.params {
        let (a, b) = (&cpu[t.range.clone()], &gpu[t.range.clone()]);
        let largest = a.iter().fold(1e-3f64, |m, &v| m.max(f64::from(v).abs()));
        let d = rel_diff(a, b) * largest / largest.max(floor);
        assert!(d <= TOL, "{what}: {} differs by {d:.3e} (relative to its max)", t.name);
    }
}

/// A deterministic batch for `spec` (for a sparse model, bags of ids with repeats, empty slots
/// and weights).
fn batch(spec: &ModelSpec, rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(seed, 7);
    let x = match spec.input {
        Input::Bag { rows: table, slots } => gradsync_core::data::random_bags(table, slots, rows, &mut rng),
        _ => (0..rows * spec.input()).map(|_| rng.normal()).collect(),
    };
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
    /// After two more steps with a sparse model's table kept out of the buckets (its rows
    /// cleared and stepped by name).
    params_apart: Vec<f32>,
}

/// Forward, bucketed backward, accumulating backward, scale, update and an evaluation forward
/// on one device; every backend method is used on the way.
fn exercise<B: Backend>(backend: B, spec: &ModelSpec, x: &[f32], y: &[u32], cap: usize) -> Result<Outcome> {
    let mut mlp = Net::new(backend, spec.clone(), 42)?;
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
    // (Only for a sparse model: further steps carry a conv net's rounding, device by device,
    // past the tolerance.)
    let apart = plan.clone().without_table(mlp.layout());
    let more = if mlp.layout().table.is_some() { 2 } else { 0 };
    for _ in 0..more {
        mlp.forward(x, y, true)?;
        mlp.backward(&apart, false, &mut |_, _, _| {})?;
        mlp.update(&SgdConfig::default(), 1.0)?;
    }
    let mut params_apart = vec![0.0; n];
    mlp.read_params(0..n, &mut params_apart)?;
    mlp.backend().synchronize()?;
    Ok(Outcome {
        loss: first.loss,
        correct: first.correct,
        grads,
        grads_accumulated,
        buckets,
        params,
        eval_loss: after.loss,
        params_apart,
    })
}

/// The CPU and cuda:0 run the same model on the same batch and must agree on everything.
fn cpu_and_gpu_agree(test: &str, spec: &str, rows: usize, cap: usize) -> Result<()> {
    cpu_and_gpu_agree_on(test, &ModelSpec::parse(spec)?, rows, cap)
}

fn cpu_and_gpu_agree_on(test: &str, spec: &ModelSpec, rows: usize, cap: usize) -> Result<()> {
    let spec = spec.clone();
    let layout = Layout::new(&spec);
    let (x, y) = batch(&spec, rows, 3);
    // The reference, checked on its own so the harness is exercised even without a GPU.
    let cpu = exercise(Cpu::new(2)?, &spec, &x, &y, cap)?;
    assert!(cpu.buckets.len() > 1, "the plan should split the gradients into several buckets");
    let doubled: Vec<f32> = cpu.grads.iter().map(|g| 2.0 * g).collect();
    assert_tensors_agree("cpu: accumulating the same batch twice", &layout, &doubled, &cpu.grads_accumulated);
    // (A batch norm evaluates with running statistics that one batch has barely moved.)
    if spec.is_mlp() {
        assert!(cpu.eval_loss < cpu.loss, "cpu: one step on the batch should lower its loss");
    }

    let Some(ordinal) = gpu_or_skip(test, computed) else { return Ok(()) };
    let gpu = exercise(Cuda::new(ordinal)?, &spec, &x, &y, cap)?;

    let loss_diff = (cpu.loss - gpu.loss).abs() / cpu.loss.abs().max(1e-3);
    assert!(loss_diff <= TOL, "loss: cpu {} gpu {} ({loss_diff:.3e})", cpu.loss, gpu.loss);
    assert_eq!(cpu.correct, gpu.correct, "correct predictions");
    assert_eq!(cpu.buckets, gpu.buckets, "buckets handed out by backward");
    assert_tensors_agree("gradients", &layout, &cpu.grads, &gpu.grads);
    assert_tensors_agree("accumulated gradients", &layout, &cpu.grads_accumulated, &gpu.grads_accumulated);
    assert_tensors_agree("parameters after one update", &layout, &cpu.params, &gpu.params);
    assert_tensors_agree("parameters after two more", &layout, &cpu.params_apart, &gpu.params_apart);
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

/// The layer graph's kernels (convolutions with and without bias, 1x1 projections, batch
/// norm in training and evaluation, max and average pooling, flatten, residual adds) give the
/// CPU's results on the GPU.
#[test]
fn cpu_and_gpu_agree_on_conv_nets() -> Result<()> {
    let image = |channels, side| Input::Image { channels, height: side, width: side };
    let test = "cpu_and_gpu_agree_on_conv_nets";
    cpu_and_gpu_agree_on(test, &ModelSpec::parse("cnn8")?.fit(image(1, 8), 10)?, 6, 5_000)?;
    cpu_and_gpu_agree_on(test, &ModelSpec::parse("resnet20")?.fit(image(3, 8), 10)?, 4, 20_000)?;
    cpu_and_gpu_agree_on(test, &ModelSpec::parse("vgg11")?.fit(image(3, 16), 10)?, 8, 2_000_000)
}

/// The embedding bag's kernels (forward by sample, backward by row, the clearing of the rows a
/// step left, the lazy update of the rows named) give the CPU's results on the GPU, both
/// poolings, with the table handed out in a bucket and kept apart.
#[test]
fn cpu_and_gpu_agree_on_the_embedding_model() -> Result<()> {
    let test = "cpu_and_gpu_agree_on_the_embedding_model";
    for pool in ["mean", "sum"] {
        let spec = ModelSpec::parse(&format!("embedding:300:8:16:{pool}"))?
            .fit(Input::Bag { rows: 300, slots: 6 }, 4)?;
        cpu_and_gpu_agree_on(test, &spec, 24, 100)?;
    }
    Ok(())
}

/// A short local training run on `device`: the loss must fall.
fn loss_falls(device: Device) -> Result<()> {
    let data = SyntheticConfig {
        train: 1024,
        test: 64,
        dim: 256,
        input: gradsync_core::model::Input::Flat(256),
        classes: 8,
    }
    .generate(5);
    let spec = ModelSpec::parse("tiny")?.with_io(data.dim, data.classes);
    let mut engine = Engine::new(device, spec, 11)?;
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

/// `n` values from `seed`; with `special`, NaN, infinities and signed zeros at fixed places.
fn values(n: usize, seed: u64, special: bool) -> Vec<f32> {
    let mut rng = Rng::new(seed, 11);
    // Large buffers take a cheap hash instead of normal draws, to keep the test quick.
    let mut v: Vec<f32> = if n <= 1 << 20 {
        (0..n).map(|_| rng.normal()).collect()
    } else {
        let salt = rng.below(1 << 16);
        (0..n as u64).map(|i| ((i * 2_654_435_761 + salt) % 4001) as f32 / 1000.0 - 2.0).collect()
    };
    if special {
        for (i, s) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0].into_iter().enumerate() {
            // Spread over the buffer, so that large buffers have them in the grid-stride tail.
            if let Some(x) = v.get_mut((i * 7919 + n - 1 - i) % n.max(1)) {
                *x = s;
            }
        }
    }
    v
}

fn upload<B: Backend>(b: &B, v: &[f32]) -> Result<B::Buf> {
    let mut buf = b.zeros(v.len())?;
    b.write(&mut buf, 0, v)?;
    Ok(buf)
}

fn download<B: Backend>(b: &B, buf: &B::Buf, n: usize) -> Result<Vec<f32>> {
    let mut v = vec![0.0; n];
    b.read(buf, 0..n, &mut v)?;
    Ok(v)
}

/// Every backend method once on buffers of about `n` values; what each produced, by name.
/// Matrices are `n` rows by a few columns (one, above 2^20 values, to keep memory small).
fn every_method<B: Backend>(b: &B, n: usize, special: bool) -> Result<Vec<(String, Vec<f32>)>> {
    let mut out = Vec::new();
    let cols = if n > 1 << 20 { 1 } else { 3 };

    let mut v = upload(b, &values(n, 1, special))?;
    b.scale(B::view_mut(&mut v, 0..n), 0.37)?;
    out.push(("scale".into(), download(b, &v, n)?));
    drop(v);

    let a = upload(b, &values(n, 2, special))?;
    let mut dz = upload(b, &values(n, 3, special))?;
    b.relu_backward(B::view_mut(&mut dz, 0..n), B::view(&a, 0..n))?;
    out.push(("relu_backward".into(), download(b, &dz, n)?));
    drop((a, dz));

    let mut p = upload(b, &values(n, 4, special))?;
    let g = upload(b, &values(n, 5, special))?;
    let mut m = upload(b, &values(n, 6, false))?;
    let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 1e-4 };
    b.sgd(&cfg, B::view_mut(&mut p, 0..n), B::view(&g, 0..n), B::view_mut(&mut m, 0..n), 0.5)?;
    out.push(("sgd params".into(), download(b, &p, n)?));
    out.push(("sgd momentum".into(), download(b, &m, n)?));
    drop((p, g, m));

    for relu in [false, true] {
        let mut z = upload(b, &values(n * cols, 7, special))?;
        let bias = upload(b, &values(cols, 8, false))?;
        b.bias_act(B::view_mut(&mut z, 0..n * cols), B::view(&bias, 0..cols), n, cols, relu)?;
        out.push((format!("bias_act relu={relu}"), download(b, &z, n * cols)?));
    }

    // One thread per column on the GPU: n columns, few rows.
    let rows = cols;
    let dz = upload(b, &values(rows * n, 9, special))?;
    let mut db = upload(b, &values(n, 10, false))?;
    for accumulate in [true, false] {
        b.bias_grad(B::view_mut(&mut db, 0..n), B::view(&dz, 0..rows * n), rows, n, accumulate)?;
        out.push((format!("bias_grad accumulate={accumulate}"), download(b, &db, n)?));
    }
    drop((dz, db));
    // Tall: n rows of a few columns, summed in groups and groups of groups (backend.rs).
    let dz = upload(b, &values(n * cols, 14, special))?;
    let mut db = upload(b, &values(cols, 15, false))?;
    for accumulate in [true, false] {
        b.bias_grad(B::view_mut(&mut db, 0..cols), B::view(&dz, 0..n * cols), n, cols, accumulate)?;
        out.push((format!("bias_grad tall accumulate={accumulate}"), download(b, &db, cols)?));
    }
    drop((dz, db));

    let classes = cols + 1;
    let logits = upload(b, &values(n * classes, 11, special))?;
    let labels: Vec<u32> = (0..n).map(|i| (i % classes) as u32).collect();
    let mut on_device = None;
    b.write_labels(&mut on_device, &labels)?;
    let labels = on_device.expect("labels were written");
    let mut dl = b.zeros(n * classes)?;
    let (loss, correct) = b.softmax_xent(
        B::view(&logits, 0..n * classes),
        &labels,
        Some(B::view_mut(&mut dl, 0..n * classes)),
        n,
        classes,
        0.25,
    )?;
    out.push(("softmax_xent dlogits".into(), download(b, &dl, n * classes)?));
    out.push(("softmax_xent loss, correct".into(), vec![loss as f32, correct as f32]));
    drop((logits, labels, dl));

    // C (n x cols) = op(A) (n x k) op(B) (k x cols), every transpose, then accumulated.
    let k = cols + 2;
    let a = upload(b, &values(n * k, 12, special))?;
    let bm = upload(b, &values(k * cols, 13, false))?;
    let transposes: &[(bool, bool)] = if n > 1 << 20 {
        &[(false, false), (true, true)]
    } else {
        &[(false, false), (true, false), (false, true), (true, true)]
    };
    for &(ta, tb) in transposes {
        // C starts as NaN: without accumulate it must not be read.
        let mut c = upload(b, &vec![f32::NAN; n * cols])?;
        b.gemm(
            n,
            cols,
            k,
            B::view(&a, 0..n * k),
            ta,
            B::view(&bm, 0..k * cols),
            tb,
            B::view_mut(&mut c, 0..n * cols),
            false,
        )?;
        b.gemm(
            n,
            cols,
            k,
            B::view(&a, 0..n * k),
            ta,
            B::view(&bm, 0..k * cols),
            tb,
            B::view_mut(&mut c, 0..n * cols),
            true,
        )?;
        out.push((format!("gemm ta={ta} tb={tb}"), download(b, &c, n * cols)?));
    }
    // Convolutions' im2col and its adjoint col2im, for windows with and without padding and
    // stride, on odd images: 2 channels of 5x7, as many samples as make about n input values
    // (above 2^20 the 1x1 window alone, whose columns are smaller than its input).
    let windows: &[(usize, usize, usize)] =
        if n > 1 << 20 { &[(1, 2, 0)] } else { &[(3, 1, 1), (3, 2, 1), (1, 2, 0), (2, 2, 0)] };
    let samples = n.div_ceil(70);
    for &(kernel, stride, pad) in windows {
        let w = Window { channels: 2, height: 5, width: 7, kernel, stride, pad };
        let (len, cl) = (samples * 70, w.col_rows() * samples * w.out_pixels());
        let x = upload(b, &values(len, 16, special))?;
        let mut col = upload(b, &vec![f32::NAN; cl])?;
        b.im2col(B::view_mut(&mut col, 0..cl), B::view(&x, 0..len), &w, samples)?;
        out.push((format!("im2col k{kernel} s{stride} p{pad}"), download(b, &col, cl)?));
        let mut dx = upload(b, &values(len, 17, false))?;
        for accumulate in [true, false] {
            b.col2im(B::view_mut(&mut dx, 0..len), B::view(&col, 0..cl), &w, samples, accumulate)?;
            out.push((
                format!("col2im k{kernel} s{stride} p{pad} accumulate={accumulate}"),
                download(b, &dx, len)?,
            ));
        }
    }
    b.synchronize()?;
    Ok(out)
}

/// The GPU's values against the CPU's: NaN where the CPU has NaN, the same infinities, the
/// rest within `tol` of the largest finite magnitude.
fn assert_same_values(what: &str, cpu: &[f32], gpu: &[f32], tol: f64) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: lengths");
    let scale = cpu.iter().filter(|v| v.is_finite()).fold(1e-3f64, |m, &v| m.max(f64::from(v).abs()));
    for (i, (&c, &g)) in cpu.iter().zip(gpu).enumerate() {
        let ok = if c.is_nan() {
            g.is_nan()
        } else if c.is_infinite() {
            c == g
        } else {
            g.is_finite() && (f64::from(c) - f64::from(g)).abs() <= tol * scale
        };
        assert!(ok, "{what}: value {i} of {}: cpu {c} gpu {g}", cpu.len());
    }
}

/// Both devices run every method at `n`; the GPU must agree with the CPU everywhere.
fn methods_agree(ordinal: usize, n: usize, special: bool) -> Result<()> {
    let cpu = every_method(&Cpu::new(2)?, n, special)?;
    let gpu = every_method(&Cuda::new(ordinal)?, n, special)?;
    for ((what, c), (_, g)) in cpu.iter().zip(&gpu) {
        // GEMMs and the softmax's exponentials round differently on the GPU; the rest is the
        // same arithmetic in the same order; the bias gradient's sums, im2col and col2im agree to the bit.
        let tol = if what.starts_with("gemm") || what.starts_with("softmax") {
            TOL
        } else if what.starts_with("bias_grad") || what.starts_with("im2col") || what.starts_with("col2im") {
            0.0
        } else {
            1e-6
        };
        assert_same_values(&format!("{what}, n = {n}, special = {special}"), c, g, tol);
    }
    Ok(())
}

#[test]
fn every_method_matches_the_cpu_at_awkward_sizes() -> Result<()> {
    let Some(ordinal) = gpu_or_skip("every_method_matches_the_cpu_at_awkward_sizes", computed) else {
        return Ok(());
    };
    // Around warp and block sizes, and one past what one launch's grid covers
    // (65,536 blocks x 256 threads), so the grid-stride loops take a second lap.
    for n in [1, 31, 33, 255, 257, 65_536 * 256 + 3] {
        methods_agree(ordinal, n, false)?;
    }
    Ok(())
}

#[test]
fn nan_and_infinity_behave_as_on_the_cpu() -> Result<()> {
    let Some(ordinal) = gpu_or_skip("nan_and_infinity_behave_as_on_the_cpu", computed) else {
        return Ok(());
    };
    for n in [1, 33, 257] {
        methods_agree(ordinal, n, true)?;
    }
    Ok(())
}

#[test]
fn two_identical_gpu_runs_give_identical_bytes() -> Result<()> {
    let Some(ordinal) = gpu_or_skip("two_identical_gpu_runs_give_identical_bytes", computed) else {
        return Ok(());
    };
    let spec = ModelSpec::parse("13-33-17-5")?;
    let (x, y) = batch(&spec, 29, 3);
    let first = exercise(Cuda::new(ordinal)?, &spec, &x, &y, 200)?;
    let second = exercise(Cuda::new(ordinal)?, &spec, &x, &y, 200)?;
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(first.loss.to_bits(), second.loss.to_bits(), "loss");
    assert_eq!(bits(&first.grads), bits(&second.grads), "gradients");
    assert_eq!(bits(&first.grads_accumulated), bits(&second.grads_accumulated), "accumulated gradients");
    assert_eq!(bits(&first.params), bits(&second.params), "parameters");
    assert_eq!(first.eval_loss.to_bits(), second.eval_loss.to_bits(), "loss after the update");
    Ok(())
}

#[test]
fn a_many_step_gpu_run_allocates_only_at_the_start() -> Result<()> {
    let steps = 300;
    let bounded = |c: &Counters| {
        computed(c);
        // Parameters, gradients, momentum, activations and scratch: a fixed set, whatever the
        // number of steps; all of it freed at exit (the fake checks that too).
        assert!(
            c.allocations < 40,
            "{steps} steps made {} allocations: something allocates per step",
            c.allocations
        );
        assert_eq!(c.alive_at_exit, 0, "{c}");
    };
    let Some(ordinal) = gpu_or_skip("a_many_step_gpu_run_allocates_only_at_the_start", bounded) else {
        return Ok(());
    };
    let spec = ModelSpec::parse("tiny")?.with_io(32, 8);
    let mut engine = Engine::new(Device::Cuda { ordinal }, spec.clone(), 3)?;
    let cfg = SgdConfig::default();
    for step in 0..steps {
        let (x, y) = batch(&spec, 16, step as u64);
        engine.forward(&x, &y, true)?;
        engine.backward(false)?;
        engine.update(&cfg, 1.0)?;
    }
    engine.synchronize()?;
    Ok(())
}

/// On the fake CUDA only (a real GPU cannot be made newer than its NVRTC): a device whose
/// architecture NVRTC does not know gets PTX for the newest one NVRTC knows, which runs when
/// the driver reads that PTX version and fails with every attempt named when it does not.
fn newer_than_nvrtc(test: &str, driver: &str, body: impl FnOnce() -> Result<()>) -> Result<()> {
    let env =
        [("FAKE_CUDA_CC", std::ffi::OsStr::new("99.0")), ("FAKE_CUDA_DRIVER", std::ffi::OsStr::new(driver))];
    match gradsync_testkit::gpu_test_with_env(test, &env) {
        GpuRun::Here if std::env::var_os(gradsync_testkit::CHILD_ENV).is_some() => body(),
        GpuRun::Here => {
            eprintln!("{test}: needs the fake CUDA (a real GPU's architecture cannot be changed)");
            Ok(())
        }
        GpuRun::Fake(_) | GpuRun::Skipped => Ok(()),
    }
}

#[test]
fn a_device_newer_than_nvrtc_runs_ptx_when_the_driver_reads_it() -> Result<()> {
    // A CUDA 13.5 driver reads NVRTC 13.5's PTX.
    newer_than_nvrtc("a_device_newer_than_nvrtc_runs_ptx_when_the_driver_reads_it", "13050", || {
        let gpu = Cuda::new(0)?;
        let mut buf = gpu.zeros(3)?;
        gpu.write(&mut buf, 0, &[1.0, 2.0, 3.0])?;
        gpu.scale(Cuda::view_mut(&mut buf, 0..3), 2.0)?;
        let mut host = [0.0; 3];
        gpu.read(&buf, 0..3, &mut host)?;
        assert_eq!(host, [2.0, 4.0, 6.0]);
        Ok(())
    })
}

#[test]
fn kernels_that_load_nowhere_are_a_clear_error() -> Result<()> {
    // A CUDA 13.0 driver refuses NVRTC 13.5's PTX, and there is no cubin for sm_990.
    newer_than_nvrtc("kernels_that_load_nowhere_are_a_clear_error", "13000", || {
        let err = Cuda::new(0).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.contains("no kernel image loads on sm_990")
                && err.contains("PTX for compute_")
                && err.contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
                && err.contains("13.0 driver"),
            "{err}"
        );
        Ok(())
    })
}

/// The f32 bit patterns the half-precision kernels are checked on: every sign, exponent and
/// fp16 mantissa with the low bits at and around fp16's rounding point (which also puts
/// bf16's ties, `0x8000` below its mantissa, under every sign, exponent and mantissa);
/// values around fp16's subnormal range with a tie at every bit position; NaNs (quiet,
/// signalling, negative, with payloads), infinities, zeros, f32 subnormals and extremes; and
/// random patterns.
fn half_probe_bits() -> Vec<u32> {
    let mut v = Vec::new();
    for i in 0..1u32 << 19 {
        v.extend([0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff].map(|low| (i << 13) | low));
    }
    for sign in [0, 0x8000_0000u32] {
        // Biased exponents 98 to 114: below half the smallest fp16 subnormal, through the
        // subnormals, into the smallest normals.
        for exp in 98..=114u32 {
            for shift in 0..23 {
                for j in 0..8u32 {
                    let m = (j << shift) & 0x007f_ffff;
                    for man in [m, m.wrapping_sub(1) & 0x007f_ffff, (m + 1) & 0x007f_ffff] {
                        v.push(sign | (exp << 23) | man);
                    }
                }
            }
        }
    }
    v.extend([
        0x7fc0_0000,
        0xffc0_0000,
        0x7f80_0001,
        0x7fa0_0000,
        0xff80_2000,
        0x7fff_ffff,
        0x7f80_0000,
        0xff80_0000,
        0,
        0x8000_0000,
        1,
        0x8000_0001,
        0x007f_ffff,
        0x0080_0000,
        0x7f7f_ffff,
        0xff7f_ffff,
        65504f32.to_bits(),
        65519.99f32.to_bits(),
        65520f32.to_bits(),
    ]);
    let mut rng = Rng::new(5, 3);
    v.extend((0..100_000).map(|_| rng.next_u64() as u32));
    v
}

/// The half-precision kernels NCCL's fp16/bf16 all-reduce runs on (`HalfCast`) round every
/// probe value to exactly the bits of the host codec (`Half::encode`, which the TCP ring's
/// packing shares), and widen every one of the 65536 patterns of each format to exactly the
/// f32 bits of the host's `Half::decode`; scaled (by a third before rounding, by three after
/// widening, as an all-reduce over three ranks scales), exactly as the host's f32 multiply.
#[test]
fn half_kernels_round_and_widen_as_the_host_codec() -> Result<()> {
    use gradsync_core::compress::Half;
    let test = "half_kernels_round_and_widen_as_the_host_codec";
    let Some(ordinal) =
        gpu_or_skip(test, |c| assert_eq!(c.launches, 8, "two roundings and two widenings per format: {c}"))
    else {
        return Ok(());
    };
    let gpu = Cuda::new(ordinal)?;
    let stream = gpu.stream();
    // 16-bit values in device memory, two to an f32 slot (the first in the low bits).
    let pack = |v: &[u16]| -> Vec<f32> {
        v.chunks(2)
            .map(|p| f32::from_bits(u32::from(p[0]) | u32::from(p.get(1).copied().unwrap_or(0)) << 16))
            .collect()
    };
    let unpack = |slots: &[f32], n: usize| -> Vec<u16> {
        slots.iter().flat_map(|s| [s.to_bits() as u16, (s.to_bits() >> 16) as u16]).take(n).collect()
    };
    let probe: Vec<f32> = half_probe_bits().into_iter().map(f32::from_bits).collect();
    let n = probe.len();
    let src = upload(&gpu, &probe)?;
    let halves = gpu.zeros(n.div_ceil(2))?;
    let patterns: Vec<u16> = (0..=u16::MAX).collect();
    let all = upload(&gpu, &pack(&patterns))?;
    let widened = gpu.zeros(patterns.len())?;
    for (half, scale) in [Half::F16, Half::Bf16].into_iter().flat_map(|h| [(h, 1.0f32), (h, 3.0)]) {
        let name = format!("{} (scale {scale})", half.name());
        let (src_ptr, _) = Cuda::raw_range(&src, 0..n);
        let (dst_ptr, _) = Cuda::raw_range(&halves, 0..n.div_ceil(2));
        // SAFETY: `src` holds n f32 values and `halves` room for n u16 values, both alive
        // until the synchronous copy below has waited for the kernel.
        unsafe { gpu.half_cast().round(stream, src_ptr, dst_ptr, n, half, 1.0 / scale) }?;
        let got = unpack(&download(&gpu, &halves, n.div_ceil(2))?, n);
        let mut bytes = vec![0u8; 2 * n];
        let shares: Vec<f32> = probe.iter().map(|x| x * (1.0 / scale)).collect();
        half.encode(&shares, &mut bytes)?;
        let wrong: Vec<String> = got
            .iter()
            .zip(bytes.chunks_exact(2))
            .zip(&probe)
            .filter_map(|((g, b), x)| {
                let want = u16::from_le_bytes([b[0], b[1]]);
                (*g != want).then(|| format!("{:#010x} -> {g:#06x}, host {want:#06x}", x.to_bits()))
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "{name}: {} of {n} values rounded unlike the host: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );

        let (src_ptr, _) = Cuda::raw_range(&all, 0..patterns.len() / 2);
        let (dst_ptr, _) = Cuda::raw_range(&widened, 0..patterns.len());
        // SAFETY: `all` holds 65536 u16 values and `widened` as many f32, both alive until
        // the synchronous read below.
        unsafe { gpu.half_cast().widen(stream, src_ptr, dst_ptr, patterns.len(), half, scale) }?;
        let got = download(&gpu, &widened, patterns.len())?;
        let bytes: Vec<u8> = patterns.iter().flat_map(|p| p.to_le_bytes()).collect();
        let mut want = vec![0.0f32; patterns.len()];
        half.decode(&bytes, &mut want)?;
        want.iter_mut().for_each(|w| *w *= scale);
        for (p, (g, w)) in patterns.iter().zip(got.iter().zip(&want)) {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{name}: {p:#06x} widens to {g:e} ({:#010x}), the host to {w:e}",
                g.to_bits()
            );
        }
    }
    eprintln!("{test}: {n} values rounded and 65536 patterns widened, per format, as on the host");
    Ok(())
}

/// One backend operation, run on a `rows x cols` activation (a batch of `rows` samples through
/// a layer `cols` wide), and the dimensions its work grows with.
struct Shaped {
    name: &'static str,
    run: fn(&Cuda, usize, usize) -> Result<()>,
    /// The work grows with the batch (rows).
    batch: bool,
    /// The work grows with the layer width (cols).
    width: bool,
}

/// Fan-in of the layer whose parameters the optimiser-side operations touch.
const FAN_IN: usize = 64;
/// Side of the images the layer kernels' shapes are checked on.
const IMAGE: usize = 4;

/// The kernel-backed operations, each on fresh buffers of its shape.
const SHAPED: &[Shaped] = &[
    // An embedding bag of `rows` samples, four distinct ids each, over a table of `cols`-wide
    // rows: forward by sample, backward by the rows the batch named.
    Shaped {
        name: "bag_forward, bag_backward",
        run: |b, rows, cols| {
            let (ids, dim) = (4 * rows, cols);
            let mut off = None;
            b.write_labels(&mut off, &(0..=rows).map(|s| (4 * s) as u32).collect::<Vec<_>>())?;
            let mut named = None;
            b.write_labels(&mut named, &(0..ids as u32).collect::<Vec<_>>())?;
            let mut roff = None;
            b.write_labels(&mut roff, &(0..=ids as u32).collect::<Vec<_>>())?;
            let mut samples = None;
            b.write_labels(&mut samples, &(0..ids).map(|e| (e / 4) as u32).collect::<Vec<_>>())?;
            let (table, w, mut y, mut grad) =
                (b.zeros(ids * dim)?, b.zeros(ids)?, b.zeros(rows * dim)?, b.zeros(ids * dim)?);
            let (off, named, roff, samples) = (off.unwrap(), named.unwrap(), roff.unwrap(), samples.unwrap());
            let (tv, wv) = (Cuda::view(&table, 0..ids * dim), Cuda::view(&w, 0..ids));
            b.bag_forward(Cuda::view_mut(&mut y, 0..rows * dim), tv, &off, &named, wv, rows, dim)?;
            let dy = Cuda::view(&y, 0..rows * dim);
            b.bag_backward(
                Cuda::view_mut(&mut grad, 0..ids * dim),
                dy,
                &named,
                &roff,
                &samples,
                wv,
                ids,
                dim,
                false,
            )
        },
        batch: true,
        width: true,
    },
    // A table's lazy update and the clearing of its gradient, over `rows` named rows of `cols`.
    Shaped {
        name: "zero_rows, sgd_rows",
        run: |b, rows, cols| {
            let n = rows * cols;
            let mut named = None;
            b.write_labels(&mut named, &(0..rows as u32).rev().collect::<Vec<_>>())?;
            let named = named.unwrap();
            let (mut p, mut g, mut m) = (b.zeros(n)?, b.zeros(n)?, b.zeros(n)?);
            b.zero_rows(Cuda::view_mut(&mut g, 0..n), Some(&named), rows, cols)?;
            let cfg = SgdConfig::default();
            let (pv, gv, mv) =
                (Cuda::view_mut(&mut p, 0..n), Cuda::view(&g, 0..n), Cuda::view_mut(&mut m, 0..n));
            b.sgd_rows(&cfg, pv, gv, mv, Some(&named), rows, cols, 1.0)
        },
        batch: true,
        width: true,
    },
    // The layer graph's kernels, over images of IMAGE x IMAGE pixels: a fraction of the rows as
    // samples and of the columns as channels, so that the serial fake stays quick at the grown
    // shapes while the small shape still fills whole blocks.
    Shaped {
        name: "relu, add_into",
        run: |b, rows, cols| {
            let n = rows * cols;
            let (mut y, x) = (b.zeros(n)?, b.zeros(n)?);
            b.relu(Cuda::view_mut(&mut y, 0..n))?;
            b.add_into(Cuda::view_mut(&mut y, 0..n), Cuda::view(&x, 0..n), true)
        },
        batch: true,
        width: true,
    },
    Shaped {
        name: "swap_axes",
        run: |b, rows, cols| {
            let (n, c) = (rows / 32, cols / 32);
            let len = n * c * IMAGE * IMAGE;
            let (mut y, x) = (b.zeros(len)?, b.zeros(len)?);
            b.swap_axes(Cuda::view_mut(&mut y, 0..len), Cuda::view(&x, 0..len), n, c, IMAGE * IMAGE, false)
        },
        batch: true,
        width: true,
    },
    Shaped {
        name: "im2col, col2im",
        run: |b, rows, cols| {
            let (n, c) = (rows / 32, cols / 32);
            let w = Window { channels: c, height: IMAGE, width: IMAGE, kernel: 3, stride: 1, pad: 1 };
            let (len, cl) = (n * c * IMAGE * IMAGE, w.col_rows() * n * w.out_pixels());
            let (mut x, mut col) = (b.zeros(len)?, b.zeros(cl)?);
            b.im2col(Cuda::view_mut(&mut col, 0..cl), Cuda::view(&x, 0..len), &w, n)?;
            b.col2im(Cuda::view_mut(&mut x, 0..len), Cuda::view(&col, 0..cl), &w, n, false)
        },
        batch: true,
        width: true,
    },
    Shaped {
        name: "max_pool, max_pool_backward",
        run: |b, rows, cols| {
            let planes = (rows / 32) * (cols / 32);
            let w = Window { channels: planes, height: IMAGE, width: IMAGE, kernel: 2, stride: 2, pad: 0 };
            let (len, out) = (planes * IMAGE * IMAGE, planes * w.out_pixels());
            let (x, mut y, mut dx) = (b.zeros(len)?, b.zeros(out)?, b.zeros(len)?);
            b.max_pool(Cuda::view_mut(&mut y, 0..out), Cuda::view(&x, 0..len), &w)?;
            b.max_pool_backward(
                Cuda::view_mut(&mut dx, 0..len),
                Cuda::view(&y, 0..out),
                Cuda::view(&x, 0..len),
                &w,
                false,
            )
        },
        batch: true,
        width: true,
    },
    Shaped {
        name: "avg_pool, avg_pool_backward",
        run: |b, rows, cols| {
            let (n, c, p) = (rows / 8, cols / 8, IMAGE * IMAGE);
            let (mut x, mut y) = (b.zeros(n * c * p)?, b.zeros(n * c)?);
            b.avg_pool(Cuda::view_mut(&mut y, 0..n * c), Cuda::view(&x, 0..n * c * p), c, n, p)?;
            b.avg_pool_backward(Cuda::view_mut(&mut x, 0..n * c * p), Cuda::view(&y, 0..n * c), c, n, p, true)
        },
        batch: true,
        width: true,
    },
    // A batch norm's sums: one thread per (channel, group of the batch's values), so they grow
    // with both; then its elementwise passes.
    Shaped {
        name: "channel_sums, norm_apply, norm_backward",
        run: |b, rows, cols| {
            let (c, m) = (cols / 8, (rows / 8) * IMAGE * IMAGE);
            let (x, mut y, mut stats, affine) =
                (b.zeros(c * m)?, b.zeros(c * m)?, b.zeros(2 * c)?, b.zeros(2 * c)?);
            let (xv, sv) = (Cuda::view(&x, 0..c * m), Cuda::view(&affine, 0..c));
            b.channel_sums(
                Cuda::view_mut(&mut stats, 0..c),
                xv,
                ChannelSum::Dot { b: xv, center: sv },
                c,
                m,
            )?;
            b.norm_apply(
                Cuda::view_mut(&mut y, 0..c * m),
                xv,
                Cuda::view(&affine, 0..2 * c),
                Cuda::view(&affine, 0..2 * c),
                c,
                m,
            )?;
            let (mut dx, mut da) = (b.zeros(c * m)?, b.zeros(2 * c)?);
            let a = Cuda::view(&affine, 0..2 * c);
            b.norm_backward(
                Some(Cuda::view_mut(&mut dx, 0..c * m)),
                Some(Cuda::view_mut(&mut da, 0..2 * c)),
                xv,
                xv,
                a,
                a,
                a,
                c,
                m,
                m,
                false,
                false,
            )
        },
        batch: true,
        width: true,
    },
    // Per-channel statistics: one thread per channel.
    Shaped {
        name: "norm_stats",
        run: |b, _, cols| {
            let c = cols;
            let (mut saved, mut running) = (b.zeros(2 * c)?, b.zeros(2 * c)?);
            let (s, r) = (Cuda::view_mut(&mut saved, 0..2 * c), Cuda::view_mut(&mut running, 0..2 * c));
            b.norm_stats(s, r, c, 64, true, &NormConfig::DEFAULT)
        },
        batch: false,
        width: true,
    },
    Shaped {
        name: "bias_act",
        run: |b, rows, cols| {
            let mut z = b.zeros(rows * cols)?;
            let bias = b.zeros(cols)?;
            b.bias_act(Cuda::view_mut(&mut z, 0..rows * cols), Cuda::view(&bias, 0..cols), rows, cols, true)
        },
        batch: true,
        width: true,
    },
    Shaped {
        name: "relu_backward",
        run: |b, rows, cols| {
            let (mut dz, a) = (b.zeros(rows * cols)?, b.zeros(rows * cols)?);
            b.relu_backward(Cuda::view_mut(&mut dz, 0..rows * cols), Cuda::view(&a, 0..rows * cols))
        },
        batch: true,
        width: true,
    },
    Shaped {
        name: "bias_grad",
        run: |b, rows, cols| {
            let (mut db, dz) = (b.zeros(cols)?, b.zeros(rows * cols)?);
            b.bias_grad(Cuda::view_mut(&mut db, 0..cols), Cuda::view(&dz, 0..rows * cols), rows, cols, false)
        },
        batch: true,
        width: true,
    },
    // One thread per sample; its classes (a handful) are walked by that thread.
    Shaped {
        name: "softmax_xent",
        run: |b, rows, _| {
            let classes = 10;
            let logits = b.zeros(rows * classes)?;
            let mut labels = None;
            b.write_labels(&mut labels, &vec![3; rows])?;
            let mut dl = b.zeros(rows * classes)?;
            let labels = labels.expect("labels were written");
            let view = Some(Cuda::view_mut(&mut dl, 0..rows * classes));
            b.softmax_xent(Cuda::view(&logits, 0..rows * classes), &labels, view, rows, classes, 1.0)
                .map(|_| ())
        },
        batch: true,
        width: false,
    },
    // The optimiser and the gradient's scaling and half-precision casts work on parameters: a
    // layer's grow with its width, not with the batch.
    Shaped {
        name: "sgd",
        run: |b, _, cols| {
            let n = cols * FAN_IN;
            let (mut p, g, mut m) = (b.zeros(n)?, b.zeros(n)?, b.zeros(n)?);
            let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0 };
            b.sgd(&cfg, Cuda::view_mut(&mut p, 0..n), Cuda::view(&g, 0..n), Cuda::view_mut(&mut m, 0..n), 1.0)
        },
        batch: false,
        width: true,
    },
    Shaped {
        name: "scale",
        run: |b, _, cols| {
            let n = cols * FAN_IN;
            let mut v = b.zeros(n)?;
            b.scale(Cuda::view_mut(&mut v, 0..n), 0.5)
        },
        batch: false,
        width: true,
    },
    Shaped {
        name: "round_to_half, widen_half",
        run: |b, _, cols| {
            let n = cols * FAN_IN;
            let (wide, halves) = (b.zeros(n)?, b.zeros(n.div_ceil(2))?);
            let (w, _) = Cuda::raw_range(&wide, 0..n);
            let (h, _) = Cuda::raw_range(&halves, 0..n.div_ceil(2));
            let half = gradsync_core::compress::Half::F16;
            // SAFETY: both buffers live on this backend's stream until the synchronize below,
            // `wide` holds n f32 values and `halves` room for n 16-bit ones.
            unsafe {
                b.half_cast().round(b.stream(), w, h, n, half, 1.0)?;
                b.half_cast().widen(b.stream(), h, w, n, half, 1.0)?;
            }
            b.synchronize()
        },
        batch: false,
        width: true,
    },
];

/// The largest launch of each kernel among `launches`, in threads.
fn widest(launches: &[gradsync_testkit::Launch]) -> std::collections::BTreeMap<String, u64> {
    let mut m = std::collections::BTreeMap::new();
    for l in launches {
        let t = m.entry(l.kernel.clone()).or_insert(0);
        *t = (*t).max(l.threads());
    }
    m
}

/// On the fake CUDA, which records every launch's grid and block: each kernel's parallel work
/// grows with the batch and with the layer width wherever its data does. A kernel whose grid
/// stays put while its data grows (one thread per column walking every row, as `bias_grad`
/// once did: 1 to 4 blocks at batch 8192, about 1 ms a launch on an H200) leaves most of a GPU
/// idle, and fails here without a GPU. Every kernel of `cuda_kernels.cu` must be exercised, so a
/// new kernel cannot skip the check.
#[test]
fn kernel_grids_grow_with_the_batch_and_the_width() -> Result<()> {
    const TEST: &str = "kernel_grids_grow_with_the_batch_and_the_width";
    if !matches!(gpu_test(TEST), GpuRun::Here) {
        return Ok(());
    }
    let Some(log) = gradsync_testkit::WorkLog::here() else {
        eprintln!("{TEST}: needs the fake CUDA, which records launches (a real GPU does not)");
        return Ok(());
    };
    const GROWTH: usize = 16;
    // At least one whole block of columns, so that rounding up to a block hides no growth.
    let (rows, cols) = (256, 256);
    let gpu = Cuda::new(0)?;
    let mut launched = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for op in SHAPED {
        let at = |r: usize, c: usize| -> Result<std::collections::BTreeMap<String, u64>> {
            let mark = log.mark();
            (op.run)(&gpu, r, c)?;
            gpu.synchronize()?;
            Ok(widest(&log.launches_since(mark)))
        };
        let base = at(rows, cols)?;
        assert!(!base.is_empty(), "{}: launched no kernel", op.name);
        for (grows, dim, r, c) in
            [(op.batch, "batch", rows * GROWTH, cols), (op.width, "width", rows, cols * GROWTH)]
        {
            let grown = at(r, c)?;
            for (kernel, &threads) in &base {
                let after = grown.get(kernel).copied().unwrap_or(0);
                // Half the growth of the data at least (whole blocks round the small shape up).
                if grows && after < threads * (GROWTH as u64) / 2 {
                    failures.push(format!(
                        "{}: kernel {kernel} launches {threads} threads at {rows}x{cols} and {after} at {r}x{c}: \
                         its parallel work does not grow with the {dim}",
                        op.name
                    ));
                }
            }
        }
        launched.extend(base.into_keys());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let source = include_str!("../src/device/cuda_kernels.cu");
    for name in source.split("extern \"C\" __global__ void ").skip(1).filter_map(|s| s.split('(').next()) {
        assert!(launched.contains(name), "kernel {name} is not exercised by this test: add it to SHAPED");
    }
    Ok(())
}

/// On the fake CUDA, which logs every launch, GEMM, copy, allocation and synchronisation: what
/// one training step of a three-layer MLP costs the device once warm. Forward: a GEMM and a
/// bias (+ReLU) kernel per layer, the softmax, one synchronisation to read the loss, and the
/// batch's two copies in; backward: a weight GEMM per layer, an input GEMM and a ReLU kernel
/// per layer but the first, and the bias gradient's passes (two launches at 64 rows: one
/// group pass and the sum); the update: one `sgd` kernel. No allocation after the first step.
#[test]
fn a_warm_training_step_costs_what_its_layers_need() -> Result<()> {
    const TEST: &str = "a_warm_training_step_costs_what_its_layers_need";
    if !matches!(gpu_test(TEST), GpuRun::Here) {
        return Ok(());
    }
    let Some(log) = gradsync_testkit::WorkLog::here() else {
        eprintln!("{TEST}: counts are taken on the fake CUDA, which logs the work (a real GPU does not)");
        return Ok(());
    };
    use gradsync_testkit::{CopyKind, Work};
    let spec = ModelSpec::parse("64-128-128-10")?;
    let (x, y) = batch(&spec, 64, 3);
    let mut engine = Engine::new(Device::Cuda { ordinal: 0 }, spec, 1)?;
    let cfg = SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 1e-4 };
    let step = |e: &mut Engine| -> Result<()> {
        e.forward(&x, &y, true)?;
        e.backward(false)?;
        e.update(&cfg, 1.0)
    };
    step(&mut engine)?;
    engine.synchronize()?;
    let mark = log.mark();
    const STEPS: usize = 3;
    for _ in 0..STEPS {
        step(&mut engine)?;
    }
    let work = log.since(mark);
    let count = |f: &dyn Fn(&Work) -> bool| work.iter().filter(|w| f(w)).count() / STEPS;
    let launches = count(&|w| matches!(w, Work::Kernel(_)));
    let gemms = count(&|w| matches!(w, Work::Gemm));
    let allocs = count(&|w| matches!(w, Work::Alloc { .. }));
    let syncs = count(&|w| matches!(w, Work::Sync));
    let copies_in = count(&|w| matches!(w, Work::Copy { kind: CopyKind::HtoD, .. }));
    let copies_out = count(&|w| matches!(w, Work::Copy { kind: CopyKind::DtoH, .. }));
    eprintln!(
        "{TEST}: per warm step of 64-128-128-10 at batch 64: {launches} kernel launches, {gemms} GEMMs, \
         {syncs} synchronisations, {copies_in} copies in, {copies_out} out, {allocs} allocations"
    );
    assert_eq!(allocs, 0, "a warm step allocates nothing");
    assert_eq!(gemms, 3 + 3 + 2, "GEMMs: forward, weight gradients, input gradients");
    assert_eq!(launches, (3 + 1) + (3 * 2 + 2) + 1, "kernels: forward + softmax, backward, update");
    assert_eq!((copies_in, copies_out, syncs), (2, 1, 1), "the batch in, the loss out, one wait");
    Ok(())
}

/// Run `body` against the fake CUDA with `GRADSYNC_CUDA_LIBS` naming a folder of links to the
/// fake's cuBLAS (with its cuBLASLt when `with_lt`) and NCCL and to NVRTC: one folder holding
/// the whole set, or a set missing a piece. On a real GPU the machine's own libraries are used
/// instead, and only their consistency is checked.
fn with_libs_folder(
    test: &str,
    with_lt: bool,
    body: impl FnOnce(&std::path::Path) -> Result<()>,
) -> Result<()> {
    use gradsync_core::device::libs;
    if let Some(dir) = std::env::var_os(gradsync_testkit::CHILD_ENV).and(std::env::var_os(libs::ENV)) {
        return body(std::path::Path::new(&dir));
    }
    // A real GPU: its machine's own libraries, which need no NVRTC from the wheels.
    let real = |test: &str| -> Result<()> {
        let set = libs::load()?;
        eprintln!("{test}: a real GPU's libraries: {set}");
        assert_eq!(set.cublas.path.parent(), set.cublas_lt.path.parent(), "{set}");
        Ok(())
    };
    if cuda::probe(0).is_ok() {
        return real(test);
    }
    let tools = match gradsync_testkit::tools() {
        Ok(t) => t,
        Err(e) if !gradsync_testkit::in_ci() => {
            eprintln!("SKIPPED ({e}) [{test}]");
            return Ok(());
        }
        Err(e) => panic!("{test}: {e}"),
    };
    let dir = gradsync_testkit::Scratch::new("cuda-libs");
    let fake = gradsync_testkit::fake_cuda_dir();
    let mut targets = vec![fake.join("libcublas.so.13"), fake.join("libnccl.so.2")];
    if with_lt {
        targets.push(fake.join("libcublasLt.so.13"));
    }
    for e in std::fs::read_dir(&tools.lib_dir).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("libnvrtc") {
            targets.push(e.path());
        }
    }
    for t in &targets {
        std::os::unix::fs::symlink(t, dir.join(t.file_name().unwrap())).unwrap();
    }
    match gradsync_testkit::gpu_test_with_env(test, &[(libs::ENV, dir.as_os_str())]) {
        GpuRun::Here => real(test),
        GpuRun::Fake(_) | GpuRun::Skipped => Ok(()),
    }
}

#[test]
fn cuda_libraries_are_one_set_from_the_folder_given() -> Result<()> {
    with_libs_folder("cuda_libraries_are_one_set_from_the_folder_given", true, |dir| {
        drop(Cuda::new(0)?);
        let set = gradsync_core::device::libs::loaded().expect("loaded with the device");
        let nccl = set.nccl.as_ref().expect("the fake NCCL is in the folder");
        for lib in [&set.cublas, &set.cublas_lt, &set.nvrtc, nccl] {
            assert_eq!(lib.path.parent(), Some(dir), "{set}");
            assert!(lib.version.is_some(), "{set}");
        }
        // As the fake libraries report themselves.
        assert_eq!(set.cublas.version.as_deref(), Some("13.0.0"), "{set}");
        assert_eq!(set.cublas_lt.version.as_deref(), Some("13.0.0"), "{set}");
        Ok(())
    })
}

#[test]
fn a_folder_with_cublas_and_no_cublaslt_is_refused_by_name() -> Result<()> {
    with_libs_folder("a_folder_with_cublas_and_no_cublaslt_is_refused_by_name", false, |dir| {
        let e = Cuda::new(0).expect_err("a cuBLAS without its cuBLASLt is refused").to_string();
        assert!(e.contains(&dir.display().to_string()) && e.contains("libcublasLt"), "{e}");
        assert!(gradsync_core::device::libs::loaded().is_none());
        Ok(())
    })
}

/// A replayed model on every device: its buckets come out last layer first, hold the same
/// drawn gradients on the GPU (staged through pinned memory) as on the CPU, and a value a
/// communicator wrote and finished comes back into the engine's gradients.
#[test]
fn a_replayed_model_hands_out_the_same_gradients_on_every_device() -> Result<()> {
    use gradsync_core::profile::{Layer, Profile};
    let t = |name: &str, shape: &[usize]| (name.to_string(), shape.to_vec());
    let layer =
        |name: &str, tensors| Layer { name: name.into(), forward_ns: 100_000, backward_ns: 200_000, tensors };
    let profile = Profile {
        model: "toy".into(),
        batch: 8,
        device: "test".into(),
        estimated: false,
        layers: vec![
            layer("fc2", vec![t("fc2.bias", &[10]), t("fc2.weight", &[10, 300])]),
            layer("fc1", vec![t("fc1.bias", &[300]), t("fc1.weight", &[300, 129])]),
        ],
        optimizer_ns: 50_000,
        source: "test".into(),
    };
    let mut seen: Vec<(Vec<Range<usize>>, Vec<f32>)> = Vec::new();
    // A replay computes nothing on the device: what it does there is copies (the drawn
    // gradients in, each bucket out to pinned memory and its finished part back).
    let mut devices = vec![Device::Cpu { threads: 2 }];
    let copies = |c: &Counters| assert!(c.host_copies >= 5 && c.launches == 0 && c.gemms == 0, "{c}");
    if let Some(ordinal) =
        gpu_or_skip("a_replayed_model_hands_out_the_same_gradients_on_every_device", copies)
    {
        devices.push(Device::Cuda { ordinal });
    }
    for device in devices {
        let mut e = Engine::new(device, ModelSpec::replay(profile.clone()), 5)?;
        let n = e.layout().len;
        let plan = BucketPlan::with_cap(e.layout(), 3000);
        e.forward(&[0.0; 8], &[0; 8], true)?;
        let (mut ranges, mut got) = (Vec::new(), vec![0.0f32; n]);
        e.backward_buckets(&plan, false, &mut |b| {
            let mut h = b.into_host().expect("host");
            let r = h.range.clone();
            let v = h.values().expect("values");
            got[r.clone()].copy_from_slice(v);
            v[0] = 7.0;
            ranges.push(r);
            h.finish(0..1).expect("finish");
        })?;
        e.synchronize()?;
        let after = e.grads()?;
        for r in &ranges {
            assert_eq!(after[r.start], 7.0, "{}: a finished value did not come back", e.describe());
        }
        seen.push((ranges, got));
    }
    for (ranges, got) in &seen[1..] {
        assert_eq!(ranges, &seen[0].0);
        assert_eq!(got, &seen[0].1, "the GPU's replayed gradients are not the CPU's");
    }
    assert!(seen[0].0.windows(2).all(|w| w[0].start > w[1].start), "last layer first: {:?}", seen[0].0);
    Ok(())
}
