//! `gradsync-bench overlap`: how much of DDP's communication hides behind backward, measured
//! from real DDP processes (`gradsync-worker launch ... train --mode ddp`), with the buckets
//! reduced during backward and, for comparison in the same run, after it (`--no-overlap`).
//!
//! hidden = 1 - exposed / comm, where comm is the time the communication thread spent in
//! all-reduces and exposed the part of it still running after backward ended.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use clap::Args;
use gradsync_core::device::DeviceRequest;
use gradsync_core::metrics::{Record, parse_line};
use gradsync_worker::cli::Mode;
use gradsync_worker::cli::flag::{self as wf, choice, opt, switch};

use gradsync_compare::table::{Table, median};

/// Flags of `gradsync-bench overlap`.
#[derive(Debug, Clone, Args)]
pub struct OverlapArgs {
    /// Model preset or widths.
    #[arg(long, default_value = "wide")]
    pub model: String,
    /// DDP ranks (processes on this machine).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Steps per run (the first is left out as warm-up).
    #[arg(long, default_value_t = 6)]
    pub steps: usize,
    /// DDP bucket size, MB.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// CPU threads per rank.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// The gradsync-worker binary (default: next to this one).
    #[arg(long)]
    pub worker: Option<PathBuf>,
    /// Keep the metrics files here (default: a temporary directory, removed afterwards).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Medians over ranks and steps of one run.
#[derive(Debug, Default)]
struct Figures {
    step_ms: f64,
    backward_ms: f64,
    comm_ms: f64,
    exposed_ms: f64,
    bytes: f64,
}

fn worker_path(a: &OverlapArgs) -> anyhow::Result<PathBuf> {
    if let Some(w) = &a.worker {
        return Ok(w.clone());
    }
    let me = std::env::current_exe()?;
    let w = me.with_file_name("gradsync-worker");
    anyhow::ensure!(
        w.exists(),
        "{} not found: build it (cargo build --release -p gradsync-worker) or pass --worker",
        w.display()
    );
    Ok(w)
}

fn one_run(a: &OverlapArgs, worker: &Path, dir: &Path, overlap: bool) -> anyhow::Result<Figures> {
    let tag = if overlap { "overlap" } else { "after" };
    let metrics = dir.join(format!("{tag}-{{rank}}.jsonl"));
    let mut cmd = Command::new(worker);
    cmd.arg("launch")
        .args(opt(wf::NPROC_PER_NODE, a.ranks))
        .args(opt(wf::MASTER_PORT, 0))
        .arg("--")
        .arg("train")
        .args(opt(wf::MODE, choice(Mode::Ddp)))
        .args(opt(wf::MODEL, &a.model))
        .args(opt(wf::DEVICE, DeviceRequest::Cpu))
        .args(opt(wf::THREADS, a.threads))
        .args(opt(wf::BATCH, a.batch))
        .args(opt(wf::DATA, format!("synthetic:{}", a.batch * a.ranks * (a.steps + 1))))
        .args(opt(wf::STEPS, a.steps))
        .args(opt(wf::EVAL_EVERY, 0))
        .arg(switch(wf::QUIET))
        .args(opt(wf::BUCKET_MB, a.bucket_mb))
        .args(opt(wf::COMM_TIMEOUT, 300))
        .arg(switch(wf::METRICS))
        .arg(&metrics);
    if !overlap {
        cmd.arg(switch(wf::NO_OVERLAP));
    }
    let out = cmd.output().with_context(|| format!("running {}", worker.display()))?;
    anyhow::ensure!(out.status.success(), "DDP run failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let mut cols: [Vec<f64>; 5] = Default::default();
    for r in 0..a.ranks {
        let path = dir.join(format!("{tag}-{r}.jsonl"));
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        for line in text.lines() {
            if let Ok(Record::Step(s)) = parse_line(line)
                && s.step > 1
            {
                for (c, v) in cols.iter_mut().zip([
                    s.step_ms,
                    s.backward_ms,
                    s.comm_ms,
                    s.comm_exposed_ms,
                    (s.bytes_sent + s.bytes_recv) as f64,
                ]) {
                    c.push(v);
                }
            }
        }
    }
    anyhow::ensure!(!cols[0].is_empty(), "the runs recorded no steps after the first");
    Ok(Figures {
        step_ms: median(&cols[0]),
        backward_ms: median(&cols[1]),
        comm_ms: median(&cols[2]),
        exposed_ms: median(&cols[3]),
        bytes: median(&cols[4]),
    })
}

/// Run both configurations and print the table.
pub fn run(a: &OverlapArgs) -> anyhow::Result<()> {
    let worker = worker_path(a)?;
    let tmp = std::env::temp_dir().join(format!("gradsync-overlap-{}", std::process::id()));
    let dir = a.out.clone().unwrap_or_else(|| tmp.clone());
    std::fs::create_dir_all(&dir)?;
    let runs = [true, false].map(|o| one_run(a, &worker, &dir, o));
    if a.out.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let mut t = Table::new(&[
        "buckets reduced",
        "ranks",
        "step ms",
        "backward ms",
        "comm ms",
        "exposed ms",
        "hidden",
        "MB moved/step",
    ]);
    for (overlap, f) in [true, false].into_iter().zip(runs) {
        let f = f?;
        t.row(vec![
            if overlap { "during backward" } else { "after backward" }.into(),
            a.ranks.to_string(),
            format!("{:.1}", f.step_ms),
            format!("{:.1}", f.backward_ms),
            format!("{:.1}", f.comm_ms),
            format!("{:.1}", f.exposed_ms),
            format!("{:.0}%", 100.0 * (1.0 - f.exposed_ms / f.comm_ms.max(1e-9))),
            format!("{:.1}", f.bytes / 1e6),
        ]);
    }
    println!(
        "DDP {} with {} ranks, batch {} per rank, {} MB buckets (medians over ranks and steps 2..)",
        a.model, a.ranks, a.batch, a.bucket_mb
    );
    print!("{}", t.render());
    println!("hidden = 1 - exposed/comm: the share of all-reduce time spent while backward still ran.");
    Ok(())
}
