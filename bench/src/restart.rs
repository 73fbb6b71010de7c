//! `gradsync-bench restart`: what `launch --max-restarts` costs. Real DDP runs under the
//! launcher, each SIGKILLing a random rank after a random number of steps, several times; for
//! every restart, the time from the kill to the launcher logging it, to rank 0 having restored
//! the newest checkpoint, and to the next progress line (an upper bound on the first new step).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use gradsync_worker::cli::Mode;
use gradsync_worker::cli::flag::{self as wf, choice, opt, switch};

use gradsync_compare::table::{Table, median};

/// Flags of `gradsync-bench restart`.
#[derive(Debug, Clone, Args)]
pub struct RestartArgs {
    /// Runs, each with its own seed for when and whom to kill.
    #[arg(long, default_value_t = 3)]
    pub runs: u64,
    /// Kills (and restarts) per run.
    #[arg(long, default_value_t = 3)]
    pub kills: u32,
    /// DDP ranks.
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Model.
    #[arg(long, default_value = "mnist")]
    pub model: String,
    /// Data.
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Steps per run.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// A checkpoint every this many steps.
    #[arg(long, default_value_t = 20)]
    pub checkpoint_every: u64,
    /// The gradsync-worker binary (default: next to this one).
    #[arg(long)]
    pub worker: Option<PathBuf>,
}

/// A small generator for the kill points (SplitMix64, as gradsync's own).
fn next(state: &mut u64) -> u64 {
    let mut r = gradsync_core::rng::Rng::new(*state, 0x4b1);
    *state = r.next_u64();
    *state
}

/// Run `gradsync-bench restart`.
pub fn run(a: &RestartArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.ranks >= 2 && a.kills >= 1 && a.runs >= 1,
        "--ranks must be 2 or more, --kills and --runs 1 or more"
    );
    let worker = match &a.worker {
        Some(w) => w.clone(),
        None => std::env::current_exe()?.with_file_name("gradsync-worker"),
    };
    let mut marks: [Vec<f64>; 3] = Default::default();
    for seed in 1..=a.runs {
        let dir = tempfile::tempdir()?;
        let mut child = Command::new(&worker)
            .arg("launch")
            .args(opt(wf::NPROC_PER_NODE, a.ranks))
            .args(opt(wf::MASTER_PORT, 0))
            .args(opt(wf::MAX_RESTARTS, a.kills))
            .arg("--")
            .arg("train")
            .args(opt(wf::MODE, choice(Mode::Ddp)))
            .args(opt(wf::MODEL, &a.model))
            .args(opt(wf::DATA, &a.data))
            .args(opt(wf::THREADS, 1))
            .args(opt(wf::STEPS, a.steps))
            .args(opt(wf::EVAL_EVERY, 0))
            .args(opt(wf::CHECKPOINT_EVERY, a.checkpoint_every))
            .arg(switch(wf::CHECKPOINT))
            .arg(dir.path().join("ck"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", worker.display()))?;
        let (tx, lines) = mpsc::channel();
        let err = child.stderr.take().context("the launcher's stderr")?;
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        let mut rng = seed;
        let (mut kills, mut seen) = (0, 0);
        let mut wait = 2 + next(&mut rng) % 4;
        let mut killed: Option<(Instant, [Option<f64>; 3])> = None;
        while let Ok((at, line)) = lines.recv_timeout(Duration::from_secs(300)) {
            if let Some((t, m)) = killed.as_mut() {
                let since = (at - *t).as_secs_f64();
                if line.contains("restart") && line.contains(&format!("of {}", a.kills)) {
                    m[0] = Some(since);
                } else if line.contains("resuming after step") {
                    m[1] = Some(since);
                } else if line.starts_with("[0] step") && m[1].is_some() {
                    m[2] = Some(since);
                    for (v, x) in marks.iter_mut().zip(m.iter()) {
                        v.extend(*x);
                    }
                    killed = None;
                    seen = 0;
                    wait = 2 + next(&mut rng) % 4;
                }
                continue;
            }
            if line.starts_with("[0] step") {
                seen += 1;
                let ranks = gradsync_worker::launch::children(child.id());
                if seen >= wait && kills < a.kills && ranks.len() == a.ranks {
                    let victim = ranks[(next(&mut rng) % ranks.len() as u64) as usize];
                    // SAFETY: kill(2) on a grandchild we know by pid; a wrong pid only fails.
                    unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) };
                    kills += 1;
                    killed = Some((Instant::now(), [None; 3]));
                }
            }
        }
        let status = child.wait()?;
        anyhow::ensure!(status.success(), "run {seed} failed ({status}) after {kills} kill(s)");
        eprintln!("run {seed}: {kills} kills, finished");
    }
    println!(
        "launch --max-restarts: DDP, {} ranks, {} on {}, {} steps, a checkpoint every {}; {} runs x {} kills of a random rank at a random step",
        a.ranks, a.model, a.data, a.steps, a.checkpoint_every, a.runs, a.kills
    );
    let mut t = Table::new(&["after the kill", "restarts", "median s", "range s"]);
    for (name, v) in [
        "the launcher logs the restart",
        "rank 0 has restored the checkpoint",
        "the next progress line (an upper bound on the first new step)",
    ]
    .iter()
    .zip(&marks)
    {
        if v.is_empty() {
            continue;
        }
        let (lo, hi) = v.iter().fold((f64::MAX, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
        t.row(vec![
            name.to_string(),
            v.len().to_string(),
            format!("{:.3}", median(v)),
            format!("{lo:.3}-{hi:.3}"),
        ]);
    }
    print!("{}", t.render());
    Ok(())
}
