//! `gradsync-bench compare` and `gradsync-bench plot`: run an experiment matrix with real
//! server and worker processes on this machine, then turn every process's metrics into
//! merged tables, charts and one self-contained report.
//!
//! A run directory holds `scenario.toml`, `machine.json`, `outcomes.jsonl` (how each run ended),
//! `runs/<id>/` (each process's metrics, traces and logs), and what `plot` derives from them:
//! `runs.jsonl`, `summary.csv`, the charts (`*.svg`, `*.png`) and `report.html`.

pub mod charts;
pub mod cost;
pub mod exec;
pub mod machine;
pub mod modes;
pub mod report;
pub mod results;
pub mod scenario;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use machine::Machine;
use results::Outcome;
use scenario::{ModeKind, Scenario};

/// Flags of `gradsync-bench compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Scenario file (TOML); the built-in default scenario when absent.
    pub scenario: Option<PathBuf>,
    /// Run directory (default: runs/<UTC timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory holding gradsync-worker and gradsync-server (default: beside this program).
    #[arg(long, env = "GRADSYNC_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Override the scenario's step budget.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Override the scenario's model list.
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// Override the scenario's worker counts.
    #[arg(long, value_delimiter = ',')]
    pub workers: Option<Vec<usize>>,
    /// Override the scenario's modes.
    #[arg(long, value_delimiter = ',')]
    pub modes: Option<Vec<ModeKind>>,
    /// Override the scenario's worker device (cpu, cuda, cuda:N, auto).
    #[arg(long)]
    pub device: Option<String>,
    /// Record Chrome trace-event timelines of every process.
    #[arg(long)]
    pub trace: bool,
}

/// Flags of `gradsync-bench plot`.
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    /// Run directories (or any directories holding metrics files, walked recursively).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where to write the tables, charts and report (default: the first directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Run `compare`.
pub fn run_compare(a: &CompareArgs) -> anyhow::Result<()> {
    let mut scenario = Scenario::load(a.scenario.as_deref())?;
    if let Some(s) = a.steps {
        scenario.steps = s;
    }
    if let Some(m) = &a.models {
        scenario.models = m.clone();
    }
    if let Some(w) = &a.workers {
        scenario.workers = w.clone();
    }
    if let Some(m) = &a.modes {
        scenario.modes = m.clone();
    }
    if let Some(d) = &a.device {
        scenario.device = d.clone();
    }
    scenario.trace |= a.trace;
    let text = toml::to_string(&scenario).context("writing the scenario")?;
    // Re-parse what will be recorded, so overrides are checked like the file.
    let scenario = Scenario::parse(&text, "the scenario with command-line overrides")?;
    let bins = modes::Bins::find(a.bin_dir.as_deref())?;
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(utc_stamp()));
    compare(&scenario, &bins, &out)?;
    let html = plot(std::slice::from_ref(&out), &out)?;
    eprintln!("gradsync-bench compare: report in {}", html.display());
    Ok(())
}

/// Run `plot`.
pub fn run_plot(a: &PlotArgs) -> anyhow::Result<()> {
    let out = a.out.clone().unwrap_or_else(|| a.dirs[0].clone());
    let html = plot(&a.dirs, &out)?;
    eprintln!("gradsync-bench plot: report in {}", html.display());
    Ok(())
}

/// Run every cell of `scenario` into `out`: the scenario, the machine (with its link measured
/// now), each run's processes, and `outcomes.jsonl`. A failed run is recorded and the next one
/// starts.
pub fn compare(scenario: &Scenario, bins: &modes::Bins, out: &Path) -> anyhow::Result<Vec<Outcome>> {
    // Old metrics left beside new ones would be merged into this comparison's results.
    anyhow::ensure!(
        !out.join("outcomes.jsonl").exists(),
        "{} already holds a comparison; choose another --out",
        out.display()
    );
    std::fs::create_dir_all(out.join("runs")).with_context(|| format!("creating {}", out.display()))?;
    let write = |name: &str, text: &str| -> anyhow::Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    write("scenario.toml", &toml::to_string(scenario).context("writing the scenario")?)?;
    let mut machine = Machine::detect();
    machine.tcp_bandwidth = crate::rawtcp::bandwidth("127.0.0.1", Duration::from_secs_f64(scenario.rawtcp_s))
        .context("measuring raw TCP bandwidth")?;
    machine.tcp_latency_s = crate::rawtcp::latency("127.0.0.1", 2000).context("measuring TCP latency")?;
    write("machine.json", &(serde_json::to_string_pretty(&machine)? + "\n"))?;
    eprintln!(
        "gradsync-bench compare: {} ({} cores); raw TCP {:.2} GB/s, latency {:.1} us",
        machine.cpu,
        machine.cores,
        machine.tcp_bandwidth / 1e9,
        machine.tcp_latency_s * 1e6
    );

    let specs = scenario.expand();
    let multi = MultiProgress::new();
    let overall = multi.add(ProgressBar::new(specs.len() as u64));
    overall.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} runs, {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    overall.set_prefix("overall");
    let outcomes_path = out.join("outcomes.jsonl");
    let mut outcomes_file = std::fs::File::create(&outcomes_path)
        .with_context(|| format!("creating {}", outcomes_path.display()))?;
    let gpu = !machine.gpus.is_empty();
    let mut outcomes = Vec::new();
    for spec in specs {
        let skip = spec.skip.clone().or_else(|| {
            (spec.mode == ModeKind::DdpNccl && !gpu)
                .then(|| "no GPU on this machine (nvidia-smi found none)".to_string())
        });
        let o = run_spec(scenario, &spec, bins, out, modes::Placement::Loopback, skip, &multi, &overall)?;
        writeln!(outcomes_file, "{}", serde_json::to_string(&o)?)
            .and_then(|_| outcomes_file.flush())
            .with_context(|| format!("writing {}", outcomes_path.display()))?;
        outcomes.push(o);
        overall.inc(1);
    }
    overall.finish_and_clear();
    let n = |s: &str| outcomes.iter().filter(|o| o.status == s).count();
    eprintln!(
        "gradsync-bench compare: {} runs: {} ok, {} stopped by the time budget, {} failed, {} skipped",
        outcomes.len(),
        n("ok"),
        n("stopped"),
        n("failed"),
        n("skipped")
    );
    Ok(outcomes)
}

/// Run one cell of the matrix into `out/runs/<id>` with its processes placed by `placement`
/// (unless `skip` or the spec's own skip says why it cannot run), print its line above the
/// progress bars, and return its outcome. Only a run directory that cannot be made is an
/// error; a run that fails is an outcome.
#[allow(clippy::too_many_arguments)]
pub fn run_spec(
    scenario: &Scenario,
    spec: &scenario::RunSpec,
    bins: &modes::Bins,
    out: &Path,
    placement: modes::Placement,
    skip: Option<String>,
    multi: &MultiProgress,
    overall: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let rel = format!("runs/{}", spec.id);
    let dir = out.join(&rel);
    let t = Instant::now();
    let skip = spec.skip.clone().or(skip);
    let (status, error) = if let Some(why) = skip {
        ("skipped", Some(why))
    } else {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let bar = multi.insert_before(overall, ProgressBar::new(scenario.steps));
        bar.set_style(
            ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} steps {per_sec} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(short(&spec.id));
        let ctx = modes::Ctx {
            scenario: scenario.clone(),
            spec: spec.clone(),
            dir: dir.clone(),
            bins: bins.clone(),
            placement,
        };
        let result = modes::plan(&ctx).and_then(|plan| {
            exec::execute(
                plan,
                &dir,
                Duration::from_secs_f64(scenario.run_timeout_s),
                scenario.time_s.map(Duration::from_secs_f64),
                &bar,
            )
        });
        bar.finish_and_clear();
        multi.remove(&bar);
        match result {
            Ok(exec::Ended::Finished) => ("ok", None),
            Ok(exec::Ended::TimeBudget) => {
                ("stopped", Some(format!("time budget of {:?} s", scenario.time_s)))
            }
            Err(e) => ("failed", Some(format!("{e:#}"))),
        }
    };
    let o = Outcome {
        id: rel,
        mode: spec.mode,
        workers: spec.workers,
        model: spec.model.clone(),
        global_batch: spec.global_batch,
        shards: spec.shards,
        slow_ms: spec.slow_ms,
        status: status.into(),
        error,
        seconds: t.elapsed().as_secs_f64(),
    };
    let line = format!(
        "{:<44} {:<8} {:>6.1} s{}",
        spec.id,
        o.status,
        o.seconds,
        o.error.as_deref().map(|e| format!("  {}", first_chars(e, 160))).unwrap_or_default()
    );
    multi.suspend(|| eprintln!("{line}"));
    Ok(o)
}

/// Rebuild tables, charts and the report of `dirs` into `out`; returns the report's path.
/// Deterministic: the output depends only on the input files.
pub fn plot(dirs: &[PathBuf], out: &Path) -> anyhow::Result<PathBuf> {
    let collected = results::collect(dirs)?;
    for w in &collected.warnings {
        eprintln!("gradsync-bench plot: warning: {w}");
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    results::write_merged(&collected, out)?;
    let machine: Option<Machine> = dirs.iter().find_map(|d| {
        let text = std::fs::read_to_string(d.join("machine.json")).ok()?;
        serde_json::from_str(&text).ok()
    });
    let scenario: Option<String> =
        dirs.iter().find_map(|d| std::fs::read_to_string(d.join("scenario.toml")).ok());
    let cluster = crate::cluster::load(dirs);
    let html = report::write(&collected, machine.as_ref(), scenario.as_deref(), &cluster, out)?;
    Ok(html)
}

fn first_chars(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        one_line.chars().take(n).collect::<String>() + "..."
    }
}

/// A progress-bar prefix: the run id without its leading number.
fn short(id: &str) -> String {
    id.split_once('-').map_or(id, |(_, r)| r).chars().take(24).collect()
}

/// `YYYYMMDD-HHMMSS` in UTC, from the system clock (civil-from-days, Howard Hinnant).
pub(crate) fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}
