//! `gradsync-bench replay`: what a replayed model is (`show`: its tensors, compute and how
//! soon backward makes its bytes ready, and the profile file of a built-in), and how faithfully
//! gradsync replays it (`check`: real `gradsync-worker` processes with one worker, so no
//! communication, whose step time should be the profile's compute).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use clap::{Args, Subcommand};
use gradsync_core::device::DeviceRequest;
use gradsync_core::metrics::{Record, parse_line};
use gradsync_core::model::ModelSpec;
use gradsync_core::profile::Profile;
use gradsync_worker::cli::flag::{self as wf, opt, switch};

use gradsync_compare::table::{Table, median};

/// Flags of `gradsync-bench replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: ReplayCommand,
}

/// `replay show` or `replay check`.
#[derive(Debug, Clone, Subcommand)]
pub enum ReplayCommand {
    /// A replayed model's tensors and compute, and how early backward makes its bytes ready;
    /// `--out` writes its profile file (a built-in's, to read or edit).
    Show(ShowArgs),
    /// Replay models with one worker (no communication) and set each step's measured time
    /// beside the profile's compute; repeats with their range.
    Check(CheckArgs),
    /// Measure a model gradsync trains (an MLP or conv preset) on this machine's CPU into a
    /// profile file: each layer's forward and backward time, the optimiser's.
    Record(RecordArgs),
    /// The replay's honesty: a model gradsync trains, recorded into a profile, then trained
    /// for real and replayed in the same modes with the same workers (the comparison runner,
    /// real processes, repeats), step time and communication side by side.
    Honesty(HonestyArgs),
}

/// Flags of `replay record`.
#[derive(Debug, Clone, Args)]
pub struct RecordArgs {
    /// A model gradsync trains: a preset or MLP widths.
    #[arg(long, default_value = "mnist")]
    pub model: String,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// CPU threads (a worker's `--threads`).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Measured steps (after one warm-up); each time is the median.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Data shaping the model's input (default: synthetic data shaped for it, as a worker's).
    #[arg(long)]
    pub data: Option<String>,
    /// Write the profile here.
    #[arg(long)]
    pub out: PathBuf,
}

/// Flags of `replay honesty`.
#[derive(Debug, Clone, Args)]
pub struct HonestyArgs {
    /// A model gradsync trains.
    #[arg(long, default_value = "mnist")]
    pub model: String,
    /// Samples per step per worker.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Workers of every mode.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Modes (the comparison's names).
    #[arg(long, default_value = "ddp-tcp,ddp-shm,ps-bsp", value_delimiter = ',')]
    pub modes: Vec<gradsync_compare::scenario::ModeKind>,
    /// Steps per run.
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Runs per mode and model.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Keep the profile, scenario and runs here (default: a temporary directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run both sides on an emulated cluster in dilated time (`gradsync-bench cluster --dilate`,
    /// a factor or `auto`; needs root), so that the real run's compute, paced to D times its
    /// CPU time, no longer takes the cores its communication needs. Default: loopback,
    /// undilated.
    #[arg(long)]
    pub dilate: Option<gradsync_compare::scenario::Dilate>,
    /// With --dilate: the emulated link, Gbit/s.
    #[arg(long, default_value_t = 10.0)]
    pub rate_gbit: f64,
}

/// The device rate a built-in profile is estimated at.
#[derive(Debug, Clone, Args)]
pub struct RateArgs {
    /// Sustained TFLOP/s of convolutions and matrix products (default: an H100 SXM's).
    #[arg(long)]
    pub device_tflops: Option<f64>,
    /// Memory bandwidth, TB/s (default: an H100 SXM's).
    #[arg(long)]
    pub device_tbps: Option<f64>,
}

impl RateArgs {
    /// `model` (a built-in name or `profile:FILE`) at this rate, if one was given.
    fn profile(&self, model: &str) -> anyhow::Result<Profile> {
        let spec = ModelSpec::parse(model)
            .with_context(|| format!("--model {model}"))?
            .with_rates(self.device_tflops, self.device_tbps)?;
        spec.profile().cloned().ok_or_else(|| {
            anyhow::anyhow!(
                "{model} is trained for real, not replayed (resnet50, vgg16, bert-base, gpt2 or profile:FILE)"
            )
        })
    }

    /// The rate flags to pass a worker.
    fn flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(t) = self.device_tflops {
            out.extend(opt(wf::DEVICE_TFLOPS, t));
        }
        if let Some(b) = self.device_tbps {
            out.extend(opt(wf::DEVICE_TBPS, b));
        }
        out
    }
}

/// Flags of `replay show`.
#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// A built-in (resnet50, vgg16, bert-base, gpt2) or profile:FILE.
    pub model: String,
    /// The device rate.
    #[command(flatten)]
    pub rate: RateArgs,
    /// Write the profile file here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Flags of `replay check`.
#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Models to replay, comma-separated.
    #[arg(long, default_value = "resnet50,vgg16,bert-base,gpt2", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Steps per run (the first two left out as warm-up).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Runs per model.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The device rate.
    #[command(flatten)]
    pub rate: RateArgs,
    /// The gradsync-worker binary (default: next to this one).
    #[arg(long)]
    pub worker: Option<PathBuf>,
}

/// Run `gradsync-bench replay`.
pub fn run(a: &ReplayArgs) -> anyhow::Result<()> {
    match &a.command {
        ReplayCommand::Show(s) => show(s),
        ReplayCommand::Check(c) => check(c),
        ReplayCommand::Record(r) => record(r).map(|_| ()),
        ReplayCommand::Honesty(h) => honesty(h),
    }
}

/// Measure `a.model` on the CPU and write its profile; returns it.
fn record(a: &RecordArgs) -> anyhow::Result<Profile> {
    use gradsync_core::data::DataSource;
    let spec = ModelSpec::parse(&a.model).with_context(|| format!("--model {}", a.model))?;
    anyhow::ensure!(
        spec.profile().is_none(),
        "--model {}: a replayed model has no compute to measure",
        a.model
    );
    let source: DataSource = match &a.data {
        Some(d) => d.parse().map_err(|e| anyhow::anyhow!("--data {d}: {e}"))?,
        None => DataSource::synthetic_for(spec.input, spec.classes()),
    };
    let data = source.load(42).with_context(|| format!("--data {source}"))?;
    let spec = spec.fit(data.input, data.classes).context("--model")?;
    anyhow::ensure!(
        a.batch >= 1 && a.batch <= data.train.len(),
        "--batch {} must be from 1 to the data's {} samples",
        a.batch,
        data.train.len()
    );
    let (mut x, mut y) = (Vec::new(), Vec::new());
    data.gather(&(0..a.batch).collect::<Vec<_>>(), &mut x, &mut y);
    let device = gradsync_core::device::Device::Cpu { threads: a.threads };
    let mut engine = gradsync_core::Engine::new(device, spec, 42)?;
    let p = engine.record_profile(&x, &y, a.steps)?;
    let (f, b) = p.compute_ns();
    let note = format!(
        "measured by gradsync-bench replay record: {} on {} at batch {}, median of {} steps; {:.3} ms forward, \
         {:.3} ms backward, {:.3} ms optimiser",
        a.model,
        engine.describe(),
        a.batch,
        a.steps,
        ms(f),
        ms(b),
        ms(p.optimizer_ns)
    );
    let text = serde_json::to_string_pretty(&p.to_file(&note))?;
    std::fs::write(&a.out, text + "\n").with_context(|| format!("--out {}", a.out.display()))?;
    eprintln!("gradsync-bench replay record: {note}; written to {}", a.out.display());
    Ok(p)
}

fn honesty(a: &HonestyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.workers >= 2 && a.steps >= 3 && a.repeats >= 1,
        "--workers must be at least 2, --steps 3"
    );
    let tmp = tempfile::tempdir()?;
    let root = a.out.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&root).with_context(|| format!("--out {}", root.display()))?;
    let profile = root.join("profile.json");
    let p = record(&RecordArgs {
        model: a.model.clone(),
        batch: a.batch,
        threads: 1,
        steps: 20,
        data: None,
        out: profile.clone(),
    })?;
    let modes: Vec<String> = a.modes.iter().map(|m| format!("'{}'", m.label())).collect();
    let scenario = root.join("scenario.toml");
    std::fs::write(
        &scenario,
        format!(
            "name = 'honesty'\nmodes = [{}]\nworkers = [{}]\nmodels = ['{}', 'profile:{}']\nbatches = [{}]\n\
             shards = [1]\nsteps = {}\nrepeats = {}\nseed = 42\ndevice = 'cpu'\nthreads = 1\nrun_timeout_s = 300\n",
            modes.join(", "),
            a.workers,
            a.model,
            profile.display(),
            a.batch * a.workers,
            a.steps,
            a.repeats
        ),
    )?;
    let runs = root.join("compare");
    let me = std::env::current_exe()?;
    let mut cmd = Command::new(&me);
    match a.dilate {
        None => cmd.arg("compare").arg(&scenario),
        Some(d) => {
            anyhow::ensure!(a.rate_gbit > 0.0, "--rate-gbit must be positive");
            cmd.arg("cluster").arg(&scenario).args([
                "--rates",
                &a.rate_gbit.to_string(),
                "--dilate",
                &d.to_string(),
            ])
        }
    };
    let status =
        cmd.arg("--out").arg(&runs).status().with_context(|| format!("starting {}", me.display()))?;
    anyhow::ensure!(status.success(), "the comparison failed ({status}); its runs are in {}", runs.display());
    if a.dilate.is_some() && !runs.join("outcomes.jsonl").exists() {
        // `cluster` said why it skipped (no root, no iproute2).
        println!("replay honesty: SKIPPED: no emulated cluster here to dilate");
        return Ok(());
    }
    let c = gradsync_compare::results::collect(std::slice::from_ref(&runs), None)?;
    let replay_label = gradsync_core::model::label_of(&ModelSpec::replay(p).widths_str());
    let wire = match a.dilate {
        None => "on this machine's loopback".to_string(),
        Some(_) => {
            let d = gradsync_compare::emulated::load_dilation(&runs).first().map_or(1.0, |r| r.dilation);
            format!("on emulated {} Gbit/s links, both sides dilated x{d}", a.rate_gbit)
        }
    };
    println!(
        "{} trained for real and replayed from its profile (recorded here at batch {}), {} workers {wire}, \
         medians over steps and {} repeats; replay/real within 10% is the target",
        a.model, a.batch, a.workers, a.repeats
    );
    let mut t = Table::new(&[
        "mode",
        "step ms real",
        "replay",
        "ratio",
        "comm ms real",
        "replay",
        "ratio",
        "real CPU busy",
        "within 10%",
    ]);
    for mode in &a.modes {
        let cell = |model: &str| {
            c.cells
                .iter()
                .map(|c| &c.median)
                .find(|m| m.model == model && m.mode == mode.label() && m.workers == a.workers)
        };
        let (Some(real), Some(rep)) = (cell(&a.model), cell(&replay_label)) else {
            t.row(vec![
                mode.label().into(),
                "no complete run".into(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                "-".into(),
            ]);
            continue;
        };
        let ratio = |r: Option<f64>, p: Option<f64>| r.zip(p).map(|(r, p)| p / r);
        let (step, comm) = (ratio(real.step_ms, rep.step_ms), ratio(real.comm_ms, rep.comm_ms));
        let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
        let busy = c
            .summaries
            .iter()
            .filter(|s| s.model == a.model && s.mode == mode.label() && s.complete())
            .filter_map(|s| s.cpu_busy)
            .collect::<Vec<_>>();
        let within = |r: Option<f64>| r.is_some_and(|r| (r - 1.0).abs() <= 0.10);
        t.row(vec![
            mode.label().into(),
            f(real.step_ms),
            f(rep.step_ms),
            f(step),
            f(real.comm_ms),
            f(rep.comm_ms),
            f(comm),
            if busy.is_empty() { "-".into() } else { format!("{:.0}%", 100.0 * median(&busy)) },
            if within(step) && within(comm) { "yes".into() } else { "no".into() },
        ]);
    }
    print!("{}", t.render());
    println!(
        "A real run's compute uses the cores its communication needs; a replay's waits leave them free (as a \
         GPU's would): where the real run kept the CPU busy, the replay's communication runs faster than the \
         real run's could. The runs and their report: {}",
        if a.out.is_some() { runs.display().to_string() } else { "(removed; --out keeps them)".into() }
    );
    Ok(())
}

/// Milliseconds of `ns`.
fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn show(a: &ShowArgs) -> anyhow::Result<()> {
    let p = a.rate.profile(&a.model)?;
    let (f, b) = p.compute_ns();
    let params = p.parameters();
    let how = if p.estimated { "estimated" } else { "measured" };
    println!("{} ({}), compute {how} on {}", p.model, p.source, p.device);
    println!(
        "  {params} parameters ({:.1} MB of f32 gradients) in {} tensors, {} layers, batch {}",
        params as f64 * 4.0 / 1e6,
        p.tensors(),
        p.layers.len(),
        p.batch
    );
    println!(
        "  per step: forward {:.3} ms, backward {:.3} ms, optimiser {:.3} ms",
        ms(f),
        ms(b),
        ms(p.optimizer_ns)
    );
    // How soon backward makes the bytes ready: what the communication can hide behind.
    let mut t = Table::new(&["bytes ready", "after backward ms", "of backward"]);
    let (mut done, mut at) = (0usize, 0u64);
    let mut marks = [0.25, 0.5, 0.75, 1.0].into_iter().peekable();
    for l in &p.layers {
        at += l.backward_ns;
        done += l.tensors.iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>();
        while let Some(&m) = marks.peek() {
            if done as f64 >= m * params as f64 {
                t.row(vec![
                    format!("{:.0}%", 100.0 * m),
                    format!("{:.3}", ms(at)),
                    format!("{:.0}%", 100.0 * at as f64 / b.max(1) as f64),
                ]);
                marks.next();
            } else {
                break;
            }
        }
    }
    print!("{}", t.render());
    let mut largest: Vec<(&str, usize)> = p
        .layers
        .iter()
        .flat_map(|l| &l.tensors)
        .map(|(n, s)| (n.as_str(), s.iter().product::<usize>()))
        .collect();
    largest.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let top: Vec<String> = largest
        .iter()
        .take(3)
        .map(|(n, v)| format!("{n} {:.1}%", 100.0 * *v as f64 / params as f64))
        .collect();
    println!("  largest tensors: {}", top.join(", "));
    if let Some(out) = &a.out {
        let text = serde_json::to_string_pretty(
            &p.to_file(&format!("written by gradsync-bench replay show {}", a.model)),
        )?;
        std::fs::write(out, text + "\n").with_context(|| format!("--out {}", out.display()))?;
        println!("  written to {}", out.display());
    }
    Ok(())
}

fn worker_path(given: &Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(w) = given {
        return Ok(w.clone());
    }
    let w = std::env::current_exe()?.with_file_name("gradsync-worker");
    anyhow::ensure!(
        w.exists(),
        "{} not found: build it (cargo build --release -p gradsync-worker) or pass --worker",
        w.display()
    );
    Ok(w)
}

/// Median step, forward and backward milliseconds of one run (warm-up left out).
fn one_run(worker: &Path, model: &str, a: &CheckArgs, metrics: &Path) -> anyhow::Result<[f64; 3]> {
    let out = Command::new(worker)
        .arg("train")
        .args(opt(wf::MODEL, model))
        .args(opt(wf::DEVICE, DeviceRequest::Cpu))
        .args(opt(wf::THREADS, 1))
        .arg(switch(wf::QUIET))
        .args(opt(wf::STEPS, a.steps))
        .args(a.rate.flags())
        .arg(switch(wf::METRICS))
        .arg(metrics)
        .output()
        .with_context(|| format!("starting {}", worker.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "replay of {model} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let text = std::fs::read_to_string(metrics).with_context(|| format!("{}", metrics.display()))?;
    let mut cols: [Vec<f64>; 3] = Default::default();
    for line in text.lines() {
        if let Ok(Record::Step(s)) = parse_line(line)
            && s.step > 2
        {
            cols[0].push(s.step_ms);
            cols[1].push(s.forward_ms);
            cols[2].push(s.backward_ms);
        }
    }
    anyhow::ensure!(!cols[0].is_empty(), "{}: no steps after the warm-up", metrics.display());
    Ok(cols.map(|c| median(&c)))
}

fn check(a: &CheckArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps > 2 && a.repeats > 0, "--steps must exceed 2 and --repeats be at least 1");
    let worker = worker_path(&a.worker)?;
    let dir = tempfile::tempdir()?;
    println!(
        "replay with one worker (no communication): each step's time against the profile's compute \
         (forward + backward + optimiser), medians over steps 3-{}, {} runs each",
        a.steps, a.repeats
    );
    let mut t =
        Table::new(&["model", "profile ms", "step ms (range)", "forward", "backward", "step/profile"]);
    for model in &a.models {
        let p = a.rate.profile(model)?;
        let (f, b) = p.compute_ns();
        let want = ms(f + b + p.optimizer_ns);
        let mut runs = Vec::new();
        for r in 0..a.repeats {
            runs.push(one_run(&worker, model, a, &dir.path().join(format!("{}-{r}.jsonl", p.model)))?);
        }
        let steps: Vec<f64> = runs.iter().map(|r| r[0]).collect();
        let step = median(&steps);
        let (lo, hi) = steps.iter().fold((f64::MAX, 0.0f64), |(l, h), &v| (l.min(v), h.max(v)));
        t.row(vec![
            p.model.clone(),
            format!("{want:.3}"),
            format!("{step:.3} ({lo:.3}-{hi:.3})"),
            format!("{:.3}/{:.3}", median(&runs.iter().map(|r| r[1]).collect::<Vec<_>>()), ms(f)),
            format!("{:.3}/{:.3}", median(&runs.iter().map(|r| r[2]).collect::<Vec<_>>()), ms(b)),
            format!("{:.3}", step / want),
        ]);
    }
    print!("{}", t.render());
    println!(
        "step/profile above 1 is what the loop itself adds (data, bookkeeping, late wake-ups); forward and \
         backward read measured/profile"
    );
    Ok(())
}
