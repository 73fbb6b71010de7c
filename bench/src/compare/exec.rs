//! Running one [`Plan`]: servers first (each ready once it prints its listening line), then
//! the workers; a run ends when every worker has exited, fails as soon as one exits non-zero
//! or the deadline passes, and always leaves no process behind (each child is killed when its
//! guard drops).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::ProgressBar;

use gradsync_core::metrics::{Record, parse_line};

use super::modes::{Plan, ProcSpec};
use super::site::Site;

/// How long a server may take to print its listening line.
const SERVER_READY: Duration = Duration::from_secs(60);
/// How long a process may take to exit after SIGTERM before it is killed.
const TERM_GRACE: Duration = Duration::from_secs(10);
/// How often the workers' state and the progress bar are refreshed.
const TICK: Duration = Duration::from_millis(100);

/// How one run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// Every worker exited 0.
    Finished,
    /// The scenario's time budget stopped the workers.
    TimeBudget,
    /// A worker's loss became non-finite or exploded (it exited with
    /// `gradsync_worker::train::EXIT_DIVERGED`); what it said.
    Diverged(String),
    /// Ctrl-C or SIGTERM reached the runner: the processes were stopped, the run is partial.
    Interrupted,
    /// Rank 0 measured the target accuracy (`stop_at_target`): the workers were stopped there,
    /// the run is complete for time-to-accuracy.
    Target,
}

/// Set once Ctrl-C or SIGTERM has reached the runner; the run under way stops and no other
/// starts.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether Ctrl-C or SIGTERM has reached the runner.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Catch Ctrl-C and SIGTERM: instead of dying with the runs' processes, the runner stops the
/// run under way, records it as interrupted and writes what the finished runs show. (Run
/// processes sit in their own process group, so a terminal's Ctrl-C reaches only the runner.)
pub fn catch_interrupts() {
    std::thread::spawn(|| {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async {
            let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            else {
                return;
            };
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                INTERRUPTED.store(true, Ordering::SeqCst);
            }
        });
    });
}

/// Exit status of a worker whose training diverged (`gradsync_worker::train::EXIT_DIVERGED`).
const EXIT_DIVERGED: i32 = 3;

/// A child process that is killed (and reaped) when dropped.
struct Guard {
    /// The process's name, and where it runs when not here: `rank1 on host node2`.
    name: String,
    child: Child,
    log: PathBuf,
    done: Option<ExitStatus>,
    /// The write end of its stdin, for a process started over ssh: closing it stops the
    /// process on its host.
    stdin: Option<ChildStdin>,
    /// Whether it runs on another host over ssh.
    remote: bool,
}

impl Guard {
    /// Start `p`, its stderr to its log in `logs`. With `follow`, a process on another host or
    /// node sends the lines appended to its metrics file back on its stdout (which must then be
    /// `Stdio::piped()`).
    fn spawn(p: &ProcSpec, logs: &Path, stdout: Stdio, follow: bool) -> anyhow::Result<Guard> {
        let log = logs.join(format!("{}.log", p.name));
        let err = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let files = p.metrics.parent().unwrap_or(Path::new("."));
        let follow = follow.then_some(p.metrics.as_path());
        let mut launch = p.site.launch(&p.program, &p.args, &p.env, files, follow);
        let name = match p.site.label() {
            Some(at) => format!("{} on {at}", p.name),
            None => p.name.clone(),
        };
        let mut child = launch
            .command
            // Its own process group: a terminal's Ctrl-C goes to the runner alone, which then
            // stops its processes in order and records what finished.
            .process_group(0)
            .stdin(if launch.stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(stdout)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name} ({})", p.program.display()))?;
        let mut stdin = child.stdin.take();
        if let (Some(w), Some(bytes)) = (stdin.as_mut(), launch.stdin.as_deref()) {
            // A few hundred bytes: the pipe takes them whatever the other end does.
            w.write_all(bytes).and_then(|_| w.flush()).with_context(|| format!("starting {name}"))?;
        }
        Ok(Guard { name, child, log, done: None, stdin, remote: p.site.ssh_host().is_some() })
    }

    /// SIGTERM, so the process can write its final metrics and checkpoint.
    /// Over ssh: the end of its stdin, which its supervisor turns into SIGTERM for its group.
    fn terminate(&mut self) {
        if self.stdin.take().is_some() {
            return;
        }
        if self.done.is_none()
            && let Ok(pid) = i32::try_from(self.child.id())
        {
            // SAFETY: kill(2) with a pid we spawned and have not reaped yet; no memory is touched.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }

    fn poll(&mut self) -> Option<ExitStatus> {
        if self.done.is_none() {
            self.done = self.child.try_wait().ok().flatten();
        }
        self.done
    }

    /// Wait up to `grace` for the exit, then kill.
    fn reap(&mut self, grace: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + grace;
        while self.poll().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.done.is_none() {
            let _ = self.child.kill();
            self.done = self.child.wait().ok();
        }
        self.done
    }

    /// For a process over ssh whose ssh exited with 255 (ssh's own failure, not the
    /// program's): that the connection to its host was lost.
    fn lost(&self) -> &'static str {
        if self.remote && self.done.and_then(|s| s.code()) == Some(255) {
            " (ssh's own failure: the connection to the host was lost or refused)"
        } else {
            ""
        }
    }

    /// The last lines the process wrote to stderr, for error messages.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.is_empty() {
            return format!("no output (log {})", self.log.display());
        }
        lines[lines.len().saturating_sub(3)..].join(" / ")
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.done.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// How a run ended, and how busy the machine's cores were while its steps ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// How it ended.
    pub ended: Ended,
    /// The share of the cores busy from rank 0's first step to the end of its last (the
    /// start-up and the first step, allocation and connection set-up, left out); none when
    /// that window was too short to measure.
    pub cpu_busy: Option<f64>,
}

/// Start the plan's processes and wait for them. `timeout` fails the run; `budget` stops it
/// early and keeps it. `bar` follows rank 0's steps. Once every process has gone, what those
/// on other hosts wrote is brought into `dir`, however the run ended.
pub fn execute(
    plan: Plan,
    dir: &Path,
    timeout: Duration,
    budget: Option<Duration>,
    stop_at: Option<f64>,
    bar: &ProgressBar,
) -> anyhow::Result<Finished> {
    let mut sites: Vec<Site> = Vec::new();
    let ran = run_plan(plan, dir, Waits { timeout, budget, stop_at }, bar, &mut sites);
    // Each site once (its processes of this run share one directory there), all at once.
    let mut once: Vec<&Site> = Vec::new();
    for site in &sites {
        if !once.iter().any(|s| s.same(site)) {
            once.push(site);
        }
    }
    let collected = std::thread::scope(|s| {
        let handles: Vec<_> = once.iter().map(|site| s.spawn(|| site.collect(dir))).collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("collecting panicked"))))
    });
    match (ran, collected) {
        (Ok(f), Ok(())) => Ok(f),
        (Ok(_), Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(c)) => Err(anyhow::anyhow!("{e:#} (and the files: {c:#})")),
    }
}

/// What ends a run besides its workers finishing: see [`execute`].
struct Waits {
    timeout: Duration,
    budget: Option<Duration>,
    stop_at: Option<f64>,
}

/// [`execute`]'s processes, recording in `sites` where each was started.
fn run_plan(
    plan: Plan,
    dir: &Path,
    w: Waits,
    bar: &ProgressBar,
    sites: &mut Vec<Site>,
) -> anyhow::Result<Finished> {
    let Waits { timeout, budget, stop_at } = w;
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let start = Instant::now();
    let mut servers = Vec::new();
    let mut addrs = Vec::new();
    for s in &plan.servers {
        sites.push(s.site.clone());
        let mut g = Guard::spawn(s, &logs, Stdio::piped(), false)?;
        // Named with where it runs: a server that cannot start on its host says which host.
        let name = g.name.clone();
        let addr = wait_listening(&mut g).with_context(|| format!("{name} did not start"))?;
        addrs.push(addr);
        servers.push(g);
    }
    let specs = (plan.workers)(&addrs);
    let mut workers = Vec::new();
    // Rank 0's metrics are followed as they grow: read where this machine can read them, sent
    // back over the process's own connection (its supervisor's stdout) from another host.
    let mut follow = None;
    for (i, p) in specs.iter().enumerate() {
        sites.push(p.site.clone());
        let remote = i == 0 && !p.site.is_child();
        let mut g = Guard::spawn(p, &logs, if remote { Stdio::piped() } else { Stdio::null() }, remote)?;
        if i == 0 {
            follow = Some(match g.child.stdout.take() {
                Some(out) if remote => StepCounter::over(out),
                _ => StepCounter::new(p.metrics.clone()),
            });
        }
        workers.push(g);
    }
    let mut ended = Ended::Finished;
    // The machine's CPU from rank 0's first finished step on.
    let mut steady: Option<(u64, u64)> = None;
    // Only where the ranks run on this machine do its cores say how busy they were.
    let here = specs.iter().all(|p| p.site.is_child());
    loop {
        if let Some(c) = follow.as_mut() {
            bar.set_position(c.count());
            if here && steady.is_none() && c.count() >= 1 {
                steady = super::machine::cpu_ticks();
            }
            if stop_at.is_some_and(|t| c.best_accuracy >= t) && ended == Ended::Finished {
                ended = Ended::Target;
                workers.iter_mut().for_each(Guard::terminate);
            }
        }
        if interrupted() {
            workers.iter_mut().chain(servers.iter_mut()).for_each(Guard::terminate);
            for g in workers.iter_mut().chain(servers.iter_mut()) {
                g.reap(TERM_GRACE);
            }
            return Ok(Finished { ended: Ended::Interrupted, cpu_busy: None });
        }
        if let Some(i) = workers.iter_mut().position(|w| w.poll().is_some_and(|st| !st.success()))
            && ended == Ended::Finished
        {
            // One rank's divergence makes its peers fail too (a ring or a barrier loses a
            // member): give them a moment to exit, and report a divergence if any rank saw one.
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until && workers.iter_mut().any(|w| w.poll().is_none()) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Some(d) = workers.iter().find(|w| w.done.and_then(|s| s.code()) == Some(EXIT_DIVERGED)) {
                let why = format!("{}: {}", d.name, d.log_tail());
                return Ok(Finished { ended: Ended::Diverged(why), cpu_busy: None });
            }
            let w = &workers[i];
            let st = w.done.map(|s| s.to_string()).unwrap_or_default();
            anyhow::bail!("{} exited with {st}{}: {}", w.name, w.lost(), w.log_tail());
        }
        if let Some(s) = servers.iter_mut().find_map(|s| s.poll().is_some().then_some(s)) {
            let st = s.done.map(|s| s.to_string()).unwrap_or_default();
            anyhow::bail!("{} exited early ({st}{}): {}", s.name, s.lost(), s.log_tail());
        }
        if workers.iter_mut().all(|w| w.poll().is_some()) {
            break;
        }
        let elapsed = start.elapsed();
        if budget.is_some_and(|b| elapsed >= b) && ended == Ended::Finished {
            ended = Ended::TimeBudget;
            workers.iter_mut().for_each(Guard::terminate);
        }
        if elapsed >= timeout {
            anyhow::bail!(
                "still running after {:.0} s (run_timeout_s); stopped. rank0: {}",
                timeout.as_secs_f64(),
                workers.first().map(Guard::log_tail).unwrap_or_default()
            );
        }
        std::thread::sleep(TICK);
    }
    if let Some(c) = follow.as_mut() {
        bar.set_position(c.count());
    }
    // Half a second of the machine's ticks (its cores together) at the least.
    let ticks_per_s = 100 * std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let cpu_busy = steady
        .zip(super::machine::cpu_ticks())
        .and_then(|(a, b)| super::machine::busy_between(a, b, ticks_per_s / 2));
    for s in servers.iter_mut() {
        s.terminate();
    }
    for s in servers.iter_mut() {
        match s.reap(TERM_GRACE) {
            Some(st) if st.success() => {}
            st => anyhow::bail!(
                "{} did not exit cleanly after SIGTERM ({}): {}",
                s.name,
                st.map(|s| s.to_string()).unwrap_or_else(|| "no status".into()),
                s.log_tail()
            ),
        }
    }
    Ok(Finished { ended, cpu_busy })
}

/// Read the server's stdout until its `gradsync-server listening on ADDR` line, for at most
/// [`SERVER_READY`].
fn wait_listening(g: &mut Guard) -> anyhow::Result<String> {
    let out = g.child.stdout.take().context("server stdout not captured")?;
    match super::child::wait_for_line(out, "gradsync-server listening on ", SERVER_READY) {
        Ok(addr) => Ok(addr),
        Err(super::child::LineError::Closed) => {
            let st = g.reap(Duration::from_secs(2)).map(|s| s.to_string()).unwrap_or_default();
            anyhow::bail!("exited ({st}) before listening: {}", g.log_tail())
        }
        Err(e) => anyhow::bail!("{e}"),
    }
}

/// Where a [`StepCounter`] reads rank 0's metrics lines from.
enum Source {
    /// The metrics file itself, from this offset on.
    File { path: PathBuf, offset: u64 },
    /// Lines sent back from another host, read by a thread of their own.
    Lines(std::sync::mpsc::Receiver<String>),
}

/// Counts the step records appended to a metrics file, and the best held-out accuracy among
/// them, reading only what is new.
struct StepCounter {
    source: Source,
    steps: u64,
    best_accuracy: f64,
    partial: String,
}

impl StepCounter {
    fn new(path: PathBuf) -> Self {
        Self::from(Source::File { path, offset: 0 })
    }

    /// The lines a remote process's supervisor sends on `out` (`supervise --follow`).
    fn over(out: std::process::ChildStdout) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line + "\n").is_err() {
                    break;
                }
            }
        });
        Self::from(Source::Lines(rx))
    }

    fn from(source: Source) -> Self {
        StepCounter { source, steps: 0, best_accuracy: f64::NEG_INFINITY, partial: String::new() }
    }

    fn count(&mut self) -> u64 {
        match &mut self.source {
            Source::File { path, offset } => {
                let Ok(mut f) = File::open(&*path) else { return self.steps };
                if f.seek(SeekFrom::Start(*offset)).is_err() {
                    return self.steps;
                }
                let mut buf = String::new();
                if let Ok(n) = f.read_to_string(&mut buf) {
                    *offset += n as u64;
                    self.partial.push_str(&buf);
                }
            }
            Source::Lines(rx) => {
                while let Ok(line) = rx.try_recv() {
                    self.partial.push_str(&line);
                }
            }
        }
        while let Some(i) = self.partial.find('\n') {
            let line = &self.partial[..i];
            if line.contains("\"kind\":\"step\"") {
                self.steps += 1;
                if line.contains("\"accuracy\"")
                    && let Ok(Record::Step(s)) = parse_line(line)
                    && let Some(a) = s.accuracy
                {
                    self.best_accuracy = self.best_accuracy.max(a);
                }
            }
            self.partial.drain(..=i);
        }
        self.steps
    }
}
