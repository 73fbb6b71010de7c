//! `gradsync-bench step`: the time of one training step (forward + backward + update) and the
//! GFLOP/s it reaches, for each device asked for, with PyTorch eager on the same shapes in the
//! same run when a Python with torch is given (`--python`): then every PyTorch row must be
//! there, and the run fails, naming why, when one cannot be measured.
//!
//! PyTorch's script makes its batch on the device once; gradsync copies the batch to the
//! device before every forward, as training does. So the step compared is the compute (forward,
//! backward, update) on a batch already there, and the copy is timed apart (`input ms`).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use gradsync_core::Engine;
use gradsync_core::data::{ClicksConfig, SyntheticConfig};
use gradsync_core::device::{CPU_CONV_VAR, Device, DeviceRequest, WINOGRAD_FROM, cpu_conv_products};
use gradsync_core::model::{Graph, Input, Layout, ModelSpec};
use gradsync_core::optim::SgdConfig;

use gradsync_compare::table::{Table, median};

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
/// step's GFLOP/s is read against on the CPU, unless a step of the run goes faster
/// ([`lift_cpu_peaks`]).
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
    let data = match spec.input {
        // Bags of ids for a sparse model: the built-in clicks over its table.
        Input::Bag { rows, .. } => ClicksConfig { train: batch, test: 1, rows }.generate(1),
        input => SyntheticConfig { train: batch, test: 1, dim: spec.input(), input, classes: spec.classes() }
            .generate(1),
    };
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
            Device::Cpu { threads } => {
                Some(cpu_arithmetic(spec, batch)? / (step_ms * 1e-3) / cpu_gemm_peak(threads)?)
            }
            Device::Cuda { .. } => engine.peak_fp32_flops().map(|peak| gflops * 1e9 / peak),
        },
    })
}

/// The floating-point operations the CPU performs for one step of `spec` at `batch`: the
/// model's count ([`Layout::step_flops`], every convolution as a direct one), less what
/// Winograd saves on the convolutions it computes ([`cpu_conv_products`]).
fn cpu_arithmetic(spec: &ModelSpec, batch: usize) -> anyhow::Result<f64> {
    let mut flops = Layout::new(spec).step_flops(batch);
    if spec.is_mlp() || spec.profile().is_some() {
        return Ok(flops);
    }
    for (w, outs) in Graph::new(spec)?.convolutions() {
        let macs = (outs * w.col_rows() * w.out_pixels() * batch) as f64;
        // Forward, input gradient and weight gradient (the first layer's input gradient is
        // never computed, and never by Winograd: 3 channels).
        flops -= 3.0 * 2.0 * macs * (1.0 - cpu_conv_products(&w)?);
    }
    Ok(flops)
}

/// How long one PyTorch configuration may take before the run gives up on it.
const TORCH_REPLY_LIMIT: Duration = Duration::from_secs(300);

/// One PyTorch process (`bench/pytorch/step.py`) for one device and thread count, serving
/// every configuration of the run: torch is imported and CUDA started once, not once a row.
/// Each request is the model's flags and the timing flags as one JSON line; each answer one
/// line of figures.
struct TorchStepper {
    child: Child,
    stdin: ChildStdin,
    replies: mpsc::Receiver<std::io::Result<String>>,
    /// Everything the process writes on stderr, once it has closed it.
    stderr: Option<std::thread::JoinHandle<String>>,
    device: String,
    threads: usize,
}

impl TorchStepper {
    fn start((python, script): (&Path, &Path), device: &str, threads: usize) -> anyhow::Result<Self> {
        let mut child = Command::new(python)
            .arg(script)
            .args(["--device", device, "--threads", &threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", python.display()))?;
        let (stdin, stdout, err) = match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
            (Some(i), Some(o), Some(e)) => (i, o, e),
            _ => anyhow::bail!("{}: no pipes to the PyTorch process", python.display()),
        };
        // Lines are read on threads of their own, so that a reply can be waited for with a
        // limit and stderr never fills its pipe.
        let (tx, replies) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut all = String::new();
            let _ = std::io::Read::read_to_string(&mut BufReader::new(err), &mut all);
            all
        });
        Ok(Self { child, stdin, replies, stderr: Some(stderr), device: device.to_string(), threads })
    }

    /// The process has stopped serving: wait for its exit, and say why with the last lines
    /// of its stderr.
    fn failed(&mut self) -> anyhow::Error {
        let _ = self.child.wait();
        let all = self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let lines: Vec<&str> = all.trim().lines().collect();
        anyhow::anyhow!("PyTorch step failed: {}", lines[lines.len().saturating_sub(20)..].join("\n"))
    }

    /// Time PyTorch eager on `spec` at `batch`.
    fn time(&mut self, spec: &ModelSpec, batch: usize, a: &StepArgs) -> anyhow::Result<StepFigure> {
        anyhow::ensure!(
            spec.table().is_none(),
            "{}: the PyTorch step reference draws dense random inputs, not bags of ids; time the \
             embedding model without --python (its exactness against PyTorch is checked by the \
             core tests' reference)",
            spec.label()
        );
        let mut args = crate::pytorch::model_args(spec);
        for (flag, v) in [("--batch", batch), ("--steps", a.steps), ("--warmup", a.warmup)] {
            args.extend([flag.to_string(), v.to_string()]);
        }
        let request = serde_json::to_string(&args)? + "\n";
        if self.stdin.write_all(request.as_bytes()).and_then(|()| self.stdin.flush()).is_err() {
            // Gone before the request: its stderr says why.
            return Err(self.failed());
        }
        let line = match self.replies.recv_timeout(TORCH_REPLY_LIMIT) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => anyhow::bail!("reading PyTorch's reply: {e}"),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                anyhow::bail!("PyTorch gave no figures within {} s", TORCH_REPLY_LIMIT.as_secs())
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(self.failed()),
        };
        parse_torch_reply(&line, &self.device, self.threads, spec, batch)
    }
}

impl Drop for TorchStepper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// PyTorch's figures from one reply line of `step.py`; a reply that used TF32 is refused (the
/// comparison is FP32 against FP32).
fn parse_torch_reply(
    line: &str,
    device: &str,
    threads: usize,
    spec: &ModelSpec,
    batch: usize,
) -> anyhow::Result<StepFigure> {
    let v: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("PyTorch printed no figures: {line:?}"))?;
    let tf32 = ["matmul", "cudnn"].map(|k| v["tf32"][k].as_bool());
    anyhow::ensure!(
        tf32.iter().all(Option::is_some),
        "PyTorch's reply does not say whether TF32 was allowed (an old step.py?): {line}"
    );
    anyhow::ensure!(
        tf32.iter().all(|t| *t == Some(false)),
        "PyTorch ran with TF32 allowed (matmul {:?}, cudnn {:?}); gradsync computes in FP32, so the \
         rows would not compare",
        tf32[0],
        tf32[1]
    );
    let field = |k: &str| v[k].as_f64().with_context(|| format!("PyTorch's reply lacks {k}: {line}"));
    let step_ms = field("step_ms")?;
    Ok(StepFigure {
        impl_: "pytorch".into(),
        device: device.into(),
        threads,
        model: spec.widths_str(),
        batch,
        step_ms,
        input_ms: 0.0,
        forward_ms: field("forward_ms")?,
        backward_ms: field("backward_ms")?,
        update_ms: field("update_ms")?,
        gflops: Layout::new(spec).step_flops(batch) / (step_ms * 1e6),
        peak_fraction: None,
    })
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
    let pytorch = match &a.python {
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
    // Every figure, with its ratio to PyTorch's where it has one; the table is drawn when all
    // are measured (a CPU's GEMM rate may be lifted by them: `lift_cpu_peaks`).
    let mut rows: Vec<(String, StepFigure, Option<f64>)> = Vec::new();
    // One PyTorch process per device, started at its first row.
    let mut steppers: Vec<Option<TorchStepper>> = devices.iter().map(|_| None).collect();
    for m in &a.model {
        let spec = ModelSpec::parse(m)?;
        for &batch in &a.batch {
            for (&dev, stepper) in devices.iter().zip(&mut steppers) {
                let (mut ours_rounds, mut torch_rounds) = (Vec::new(), Vec::new());
                for _ in 0..a.rounds.max(1) {
                    let ours = time_gradsync(dev, &spec, batch, a.warmup, a.steps)?;
                    if let Some((py, script)) = &pytorch {
                        let context = || {
                            format!(
                                "PyTorch row {} batch {batch} on {} ({} with {})",
                                spec.name,
                                dev.label(),
                                py.display(),
                                script.display()
                            )
                        };
                        if stepper.is_none() {
                            *stepper = Some(
                                TorchStepper::start((py, script.as_path()), &dev.label(), ours.threads)
                                    .with_context(context)?,
                            );
                        }
                        if let Some(s) = stepper.as_mut() {
                            torch_rounds.push(s.time(&spec, batch, a).with_context(context)?);
                        }
                    }
                    ours_rounds.push(ours);
                }
                let ours = median_round(ours_rounds).context("no gradsync round")?;
                let torch = median_round(torch_rounds).map(|mut t| {
                    // The same peak as gradsync's row, so both rows are read against one
                    // yardstick (on the CPU, PyTorch's arithmetic is the model's count).
                    t.peak_fraction = match dev {
                        Device::Cpu { threads } => {
                            cpu_gemm_peak(threads).ok().map(|peak| t.gflops * 1e9 / peak)
                        }
                        Device::Cuda { .. } => ours.peak_fraction.map(|p| p * t.gflops / ours.gflops),
                    };
                    t
                });
                let ratio = torch.as_ref().map(|t| t.step_ms / ours.step_ms);
                eprintln!(
                    "gradsync-bench step: {} batch {batch} on {}: gradsync {:.2} ms{}",
                    spec.name,
                    dev.label(),
                    ours.step_ms,
                    match (&torch, ratio) {
                        (Some(t), Some(r)) => format!(", PyTorch {:.2} ms ({r:.2}x)", t.step_ms),
                        _ => String::new(),
                    }
                );
                rows.push((spec.name.clone(), ours, ratio));
                rows.extend(torch.map(|t| (spec.name.clone(), t, None)));
            }
        }
    }
    let lifted = lift_cpu_peaks(&mut rows);
    for (name, fig, ratio) in &rows {
        table.row(vec![
            name.clone(),
            fig.batch.to_string(),
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
    }
    print!("{}", table.render());
    println!("vs torch: PyTorch's ms/step divided by gradsync's (above 1: gradsync is faster).");
    println!(
        "% peak: of the GPU's FP32 peak; on the CPU, of the GEMM rate its threads measured (1024x1024x1024 through \
         gradsync's CPU GEMM, best of three)."
    );
    println!(
        "GFLOP/s: the model's multiply-adds as a direct convolution counts them, over the step's time. gradsync's \
         CPU computes 3x3 convolutions of {WINOGRAD_FROM} channels or more by Winograd F(2x2, \
         3x3), 4/9 of those products ({CPU_CONV_VAR}): its % peak counts the arithmetic it did."
    );
    println!(
        "ms/step: forward, backward and update on a batch already on the device; input ms: gradsync's copy of \
         the batch to the device before it (PyTorch's batch stays there)."
    );
    for (threads, rate) in lifted {
        println!(
            "% peak at {threads} CPU threads: a step here ran faster than the calibration product, so the peak is \
             the fastest rate measured in this run, {:.1} GFLOP/s (a lower bound of the true peak).",
            rate / 1e9
        );
    }
    if let Some(path) = &a.json {
        let lines: Vec<String> =
            rows.iter().map(|(_, f, _)| serde_json::to_string(f).unwrap_or_default()).collect();
        std::fs::write(path, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A CPU's peak is what its threads were measured to reach; where a step of the run reached
/// more (a larger product than the calibration's runs faster), the fastest rate measured is
/// the peak instead, so that no row reads above 100%. Returns each thread count lifted, with
/// its new peak in FLOP/s.
fn lift_cpu_peaks(rows: &mut [(String, StepFigure, Option<f64>)]) -> Vec<(usize, f64)> {
    let mut lifted = Vec::new();
    let cpu = |f: &StepFigure| f.device == "cpu";
    let mut threads: Vec<usize> = rows.iter().filter(|(_, f, _)| cpu(f)).map(|(_, f, _)| f.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    for t in threads {
        let on = |f: &StepFigure| cpu(f) && f.threads == t;
        let best =
            rows.iter().filter(|(_, f, _)| on(f)).filter_map(|(_, f, _)| f.peak_fraction).fold(0.0, f64::max);
        if best <= 1.0 {
            continue;
        }
        let mut rate = 0.0;
        for (_, f, _) in rows.iter_mut().filter(|(_, f, _)| on(f)) {
            if let Some(p) = f.peak_fraction.as_mut() {
                *p /= best;
                if *p >= 1.0 {
                    rate = f.gflops * 1e9;
                }
            }
        }
        lifted.push((t, rate));
    }
    lifted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fig(device: &str, threads: usize, gflops: f64, peak_fraction: Option<f64>) -> StepFigure {
        StepFigure {
            impl_: "gradsync".into(),
            device: device.into(),
            threads,
            model: "8-8".into(),
            batch: 8,
            step_ms: 1.0,
            input_ms: 0.0,
            forward_ms: 0.3,
            backward_ms: 0.5,
            update_ms: 0.2,
            gflops,
            peak_fraction,
        }
    }

    /// A CPU row above its calibrated peak (16 threads on a product larger than the
    /// calibration's read 121% on a real machine) lifts that thread count's peak to it; other
    /// thread counts and the GPU keep theirs.
    #[test]
    fn no_cpu_row_reads_above_its_peak() {
        let mut rows: Vec<(String, StepFigure, Option<f64>)> = [
            fig("cpu", 16, 1200.0, Some(1.2)),
            fig("cpu", 16, 600.0, Some(0.6)),
            fig("cpu", 2, 100.0, Some(0.5)),
            fig("cuda:0", 0, 5000.0, Some(0.07)),
        ]
        .into_iter()
        .map(|f| ("m".to_string(), f, None))
        .collect();
        let lifted = lift_cpu_peaks(&mut rows);
        assert_eq!(lifted.len(), 1);
        assert_eq!(lifted[0].0, 16);
        assert!((lifted[0].1 - 1200e9).abs() < 1.0, "{lifted:?}");
        let fractions: Vec<f64> = rows.iter().filter_map(|(_, f, _)| f.peak_fraction).collect();
        for (got, want) in fractions.iter().zip([1.0, 0.5, 0.5, 0.07]) {
            assert!((got - want).abs() < 1e-12, "{fractions:?}");
        }
        assert!(lift_cpu_peaks(&mut rows).is_empty(), "lifted twice");
    }
}
