//! `gradsync-bench step`: the time of one training step (forward + backward + update) and the
//! GFLOP/s it reaches, for each device asked for, with PyTorch eager on the same shapes in the
//! same run when a Python with torch is given (`--python`): then every PyTorch row must be
//! there, and the run fails, naming why, when one cannot be measured.
//!
//! PyTorch's script makes its batch on the device once; gradsync copies the batch to the
//! device before every forward, as training does. So the step compared is the compute (forward,
//! backward, update) on a batch already there, and the copy is timed apart (`input ms`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use gradsync_core::Engine;
use gradsync_core::data::SyntheticConfig;
use gradsync_core::device::{Device, DeviceRequest};
use gradsync_core::model::{Layout, ModelSpec};
use gradsync_core::optim::SgdConfig;

use crate::table::{Table, median};

/// Flags of `gradsync-bench step`.
#[derive(Debug, Clone, Args)]
pub struct StepArgs {
    /// Model presets or MLP widths (conv presets at their default input, 3x32x32 or 1x8x8).
    #[arg(long, default_value = "mnist", value_delimiter = ',')]
    pub model: Vec<String>,
    /// Batch sizes to time.
    #[arg(long, default_value = "128", value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// CPU thread counts to time.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Time the CPU at each of --threads (false: the GPU alone).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub cpu: bool,
    /// Also time CUDA device 0 when one can be used.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub gpu: bool,
    /// Timed steps per configuration (after warm-up).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Rounds per configuration, gradsync and PyTorch alternating, so drift on a noisy
    /// machine hits both; the median round is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Warm-up steps per configuration.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// A Python with torch: run the same model in PyTorch eager beside gradsync. Every PyTorch
    /// row must then be measured; the run fails when one cannot be.
    #[arg(long, env = "GRADSYNC_PYTHON")]
    pub python: Option<PathBuf>,
    /// The folder holding the PyTorch scripts (default: `pytorch/` beside this program, then
    /// the working directory's `bench/pytorch/`).
    #[arg(long, env = "GRADSYNC_PYTORCH_DIR")]
    pub pytorch_dir: Option<PathBuf>,
    /// Write the figures as JSON lines here too.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One timed configuration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepFigure {
    /// `gradsync` or `pytorch`.
    pub impl_: String,
    /// `cpu` or `cuda:0`.
    pub device: String,
    /// CPU threads (0 on the GPU).
    pub threads: usize,
    /// Model widths.
    pub model: String,
    /// Batch size.
    pub batch: usize,
    /// Median ms per step: forward, backward and update on a batch already on the device.
    pub step_ms: f64,
    /// Median ms copying the batch (inputs and labels) to the device before the step (0 for
    /// PyTorch, whose batch stays on the device).
    pub input_ms: f64,
    /// Median forward, backward and update ms.
    pub forward_ms: f64,
    /// Backward.
    pub backward_ms: f64,
    /// Update.
    pub update_ms: f64,
    /// GFLOP/s of the whole step.
    pub gflops: f64,
    /// Fraction of the device's peak: on a GPU its FP32 peak, on the CPU the GEMM rate its
    /// threads measured ([`cpu_gemm_peak`]).
    pub peak_fraction: Option<f64>,
}

/// The CPU's measured GEMM peak with `threads` threads, in FLOP/s: the best of three square
/// 1024 x 1024 x 1024 products through the CPU device's own GEMM, after one untimed. What a
/// step's GFLOP/s is read against on the CPU.
pub fn cpu_gemm_peak(threads: usize) -> anyhow::Result<f64> {
    use gradsync_core::device::{Backend, Cpu};
    // Measured once per thread count in a process.
    static MEASURED: std::sync::Mutex<Vec<(usize, f64)>> = std::sync::Mutex::new(Vec::new());
    let mut measured = MEASURED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(&(_, peak)) = measured.iter().find(|(t, _)| *t == threads) {
        return Ok(peak);
    }
    let cpu = Cpu::new(threads)?;
    let n = 1024;
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::INFINITY;
    for i in 0..4 {
        let t = Instant::now();
        cpu.gemm(n, n, n, &a, false, &a, false, &mut c, false)?;
        if i > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    let peak = 2.0 * (n * n * n) as f64 / best;
    measured.push((threads, peak));
    Ok(peak)
}

/// Time gradsync's step on `device`.
pub fn time_gradsync(
    device: Device,
    spec: &ModelSpec,
    batch: usize,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<StepFigure> {
    let data = SyntheticConfig {
        train: batch,
        test: 1,
        dim: spec.input(),
        input: spec.input,
        classes: spec.classes(),
    }
    .generate(1);
    let mut engine = Engine::new(device, spec.clone(), 1)?;
    let sgd = SgdConfig::default();
    let (mut input, mut f, mut b, mut u, mut total) = (vec![], vec![], vec![], vec![], vec![]);
    for i in 0..warmup + steps {
        let tl = Instant::now();
        engine.load_batch(&data.train.x, &data.train.y)?;
        engine.synchronize()?;
        let t0 = Instant::now();
        engine.forward_loaded(true)?;
        engine.synchronize()?;
        let t1 = Instant::now();
        engine.backward(false)?;
        engine.synchronize()?;
        let t2 = Instant::now();
        engine.update(&sgd, 1.0)?;
        engine.synchronize()?;
        let t3 = Instant::now();
        if i >= warmup {
            input.push((t0 - tl).as_secs_f64() * 1e3);
            f.push((t1 - t0).as_secs_f64() * 1e3);
            b.push((t2 - t1).as_secs_f64() * 1e3);
            u.push((t3 - t2).as_secs_f64() * 1e3);
            total.push((t3 - t0).as_secs_f64() * 1e3);
        }
    }
    let step_ms = median(&total);
    let gflops = Layout::new(spec).step_flops(batch) / (step_ms * 1e6);
    Ok(StepFigure {
        impl_: "gradsync".into(),
        device: device.label(),
        threads: match device {
            Device::Cpu { threads } => threads,
            Device::Cuda { .. } => 0,
        },
        model: spec.widths_str(),
        batch,
        step_ms,
        input_ms: median(&input),
        forward_ms: median(&f),
        backward_ms: median(&b),
        update_ms: median(&u),
        gflops,
        peak_fraction: match device {
            Device::Cpu { threads } => Some(gflops * 1e9 / cpu_gemm_peak(threads)?),
            Device::Cuda { .. } => engine.peak_fp32_flops().map(|peak| gflops * 1e9 / peak),
        },
    })
}

/// Time PyTorch eager through `script` (`bench/pytorch/step.py`).
fn time_pytorch(
    (python, script): (&Path, &Path),
    device: &str,
    threads: usize,
    spec: &ModelSpec,
    batch: usize,
    a: &StepArgs,
) -> anyhow::Result<StepFigure> {
    let out = Command::new(python)
        .arg(script)
        .args(["--device", device, "--threads", &threads.to_string()])
        .args(crate::pytorch::model_args(spec))
        .args([
            "--batch",
            &batch.to_string(),
            "--steps",
            &a.steps.to_string(),
            "--warmup",
            &a.warmup.to_string(),
        ])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "PyTorch step failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let mut fig: StepFigure = serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| {
            Some(StepFigure {
                impl_: "pytorch".into(),
                device: device.into(),
                threads,
                model: spec.widths_str(),
                batch,
                step_ms: v["step_ms"].as_f64()?,
                input_ms: 0.0,
                forward_ms: v["forward_ms"].as_f64()?,
                backward_ms: v["backward_ms"].as_f64()?,
                update_ms: v["update_ms"].as_f64()?,
                gflops: 0.0,
                peak_fraction: None,
            })
        })
        .context("PyTorch step printed no figures")?;
    fig.gflops = Layout::new(spec).step_flops(batch) / (fig.step_ms * 1e6);
    Ok(fig)
}

/// The round with the median step time.
fn median_round(mut rounds: Vec<StepFigure>) -> Option<StepFigure> {
    rounds.sort_by(|a, b| a.step_ms.total_cmp(&b.step_ms));
    let mid = rounds.len() / 2;
    rounds.into_iter().nth(mid)
}

/// Run the benchmark and print its table.
pub fn run(a: &StepArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.cpu || a.gpu, "--cpu false and --gpu false leave nothing to time");
    // The script is found before anything is timed: a PyTorch row asked for and impossible is
    // an error now, not a warning after minutes of work.
    let torch = match &a.python {
        Some(py) => Some((py.as_path(), crate::pytorch::find("step.py", a.pytorch_dir.as_deref())?)),
        None => None,
    };
    let mut devices: Vec<Device> =
        if a.cpu { a.threads.iter().map(|&t| Device::Cpu { threads: t }).collect() } else { Vec::new() };
    if a.gpu {
        match Device::resolve(DeviceRequest::Cuda(0), 0) {
            Ok(d) => devices.push(d),
            Err(e) if a.cpu => eprintln!("gradsync-bench step: GPU skipped: {e}"),
            Err(e) => anyhow::bail!("--cpu false, and the GPU cannot be used: {e}"),
        }
    }
    let mut table = Table::new(&[
        "model", "batch", "device", "threads", "impl", "ms/step", "input ms", "fwd ms", "bwd ms", "upd ms",
        "GFLOP/s", "% peak", "vs torch",
    ]);
    let mut figures = Vec::new();
    for m in &a.model {
        let spec = ModelSpec::parse(m)?;
        for &batch in &a.batch {
            for &dev in &devices {
                let (mut ours_rounds, mut torch_rounds) = (Vec::new(), Vec::new());
                for _ in 0..a.rounds.max(1) {
                    let ours = time_gradsync(dev, &spec, batch, a.warmup, a.steps)?;
                    if let Some((py, script)) = &torch {
                        let t = time_pytorch((py, script), &dev.label(), ours.threads, &spec, batch, a)
                            .with_context(|| {
                                format!(
                                    "PyTorch row {} batch {batch} on {} ({} with {})",
                                    spec.name,
                                    dev.label(),
                                    py.display(),
                                    script.display()
                                )
                            })?;
                        torch_rounds.push(t);
                    }
                    ours_rounds.push(ours);
                }
                let ours = median_round(ours_rounds).context("no gradsync round")?;
                let torch = median_round(torch_rounds).map(|mut t| {
                    // The same GPU's peak, so both rows are read against one yardstick.
                    t.peak_fraction = ours.peak_fraction.map(|p| p * t.gflops / ours.gflops);
                    t
                });
                for (fig, ratio) in
                    [(Some(&ours), torch.as_ref().map(|t| t.step_ms / ours.step_ms)), (torch.as_ref(), None)]
                {
                    let Some(fig) = fig else { continue };
                    table.row(vec![
                        spec.name.clone(),
                        batch.to_string(),
                        fig.device.clone(),
                        fig.threads.to_string(),
                        fig.impl_.clone(),
                        format!("{:.2}", fig.step_ms),
                        format!("{:.2}", fig.input_ms),
                        format!("{:.2}", fig.forward_ms),
                        format!("{:.2}", fig.backward_ms),
                        format!("{:.2}", fig.update_ms),
                        format!("{:.1}", fig.gflops),
                        fig.peak_fraction.map(|p| format!("{:.1}", 100.0 * p)).unwrap_or_default(),
                        ratio.map(|r| format!("{r:.2}x")).unwrap_or_default(),
                    ]);
                    figures.push(fig.clone());
                }
            }
        }
    }
    print!("{}", table.render());
    println!("vs torch: PyTorch's ms/step divided by gradsync's (above 1: gradsync is faster).");
    println!(
        "% peak: of the GPU's FP32 peak; on the CPU, of the GEMM rate its threads measured (1024x1024x1024 through \
         gradsync's CPU GEMM, best of three)."
    );
    println!(
        "ms/step: forward, backward and update on a batch already on the device; input ms: gradsync's copy of \
         the batch to the device before it (PyTorch's batch stays there)."
    );
    if let Some(path) = &a.json {
        let lines: Vec<String> =
            figures.iter().map(|f| serde_json::to_string(f).unwrap_or_default()).collect();
        std::fs::write(path, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
