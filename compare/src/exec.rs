//! Running one [`Plan`]: servers first (each ready once it prints its listening line), then
//! the workers; a run ends when every worker has exited, fails as soon as one exits non-zero
//! or the deadline passes, and always leaves no process behind (each child is killed when its
//! guard drops).

use std::fs::File;
use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::ProgressBar;

use gradsync_core::metrics::{MetricsTail, Record, parse_line};

use super::modes::{Plan, ProcSpec};
use super::results::Restart;
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
    /// A worker failed once every restart (`max_restarts`) was spent: why.
    Exhausted(String),
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
    /// The write end of its stdin, for a process started under the supervisor on another
    /// host or node: closing it stops the process there.
    stdin: Option<ChildStdin>,
    /// Where it runs.
    site: Arc<dyn Site>,
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
        Ok(Guard { name, child, log, done: None, stdin, site: p.site.clone() })
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

    /// SIGKILL, as a fault the scenario injects (`kills`). Over ssh this kills the ssh client,
    /// whose end closes the program's stdin: its supervisor kills its group.
    fn kill9(&mut self) {
        if self.done.is_none()
            && let Ok(pid) = i32::try_from(self.child.id())
        {
            // SAFETY: kill(2) with a pid we spawned and have not reaped yet; no memory is touched.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
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

    /// For a process whose launcher failed rather than the program (ssh's 255): what that
    /// says, such as that the connection to its host was lost.
    fn lost(&self) -> &'static str {
        self.done.and_then(|s| self.site.launcher_failure(s)).unwrap_or("")
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
    /// The restarts of its workers after failures, in order.
    pub restarts: Vec<Restart>,
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
    waits: Waits,
    faults: Faults,
    bar: &ProgressBar,
) -> anyhow::Result<Finished> {
    let mut sites: Vec<Arc<dyn Site>> = Vec::new();
    let ran = run_plan(plan, dir, waits, faults, bar, &mut sites);
    // Each site once (its processes of this run share one directory there), all at once.
    let mut once: Vec<&dyn Site> = Vec::new();
    for site in &sites {
        if !once.iter().any(|s| s.same(site.as_ref())) {
            once.push(site.as_ref());
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

/// What ends a run besides its workers finishing: `timeout` fails the run; `budget` stops it
/// early and keeps it; `stop_at` stops it once rank 0 measures that accuracy.
pub struct Waits {
    /// Fails the run (`run_timeout_s`).
    pub timeout: Duration,
    /// Stops it and keeps it (`time_s`).
    pub budget: Option<Duration>,
    /// Stops it at this held-out accuracy (`stop_at_target`).
    pub stop_at: Option<f64>,
}

/// Failures injected into a run, and how many restarts it may take.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Restarts of the workers allowed (`max_restarts`).
    pub max_restarts: u32,
    /// Kills to inject: once rank 0 has recorded this step, SIGKILL this worker (modulo the
    /// run's worker processes), in order.
    pub kills: Vec<(u64, usize)>,
}

/// A failure being restarted from: when it was seen (or the kill sent), and the restart's
/// record until the restarted rank 0 records its first step.
struct Pending {
    at: Instant,
    restart: Restart,
}

/// [`execute`]'s processes, recording in `sites` where each was started: the servers, then
/// the workers, watched until they end (or the run is stopped), then the servers stopped.
fn run_plan(
    plan: Plan,
    dir: &Path,
    w: Waits,
    faults: Faults,
    bar: &ProgressBar,
    sites: &mut Vec<Arc<dyn Site>>,
) -> anyhow::Result<Finished> {
    let Waits { timeout, budget, stop_at } = w;
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let start = Instant::now();
    let (servers, addrs) = start_servers(&plan.servers, &logs, sites)?;
    let specs = (plan.workers)(&addrs);
    let (workers, follow) = start_workers(&specs, &logs, sites)?;
    let mut run = Running {
        logs,
        bar,
        stop_at,
        max_restarts: faults.max_restarts,
        kills: faults.kills.into_iter().peekable(),
        // Only where the ranks run on this machine do its cores say how busy they were.
        here: specs.iter().all(|p| p.site.is_child()),
        specs,
        servers,
        workers,
        follow,
        restarts: Vec::new(),
        killed: None,
        pending: None,
        ended: Ended::Finished,
        steady: Steady::default(),
    };
    loop {
        run.watch_rank0();
        if interrupted() {
            return Ok(run.interrupt());
        }
        if run.workers.iter_mut().any(|w| w.poll().is_some_and(|st| !st.success()))
            && run.ended == Ended::Finished
        {
            match run.after_failure()? {
                Some(finished) => return Ok(finished),
                None => continue,
            }
        }
        if let Some(s) = run.servers.iter_mut().find_map(|s| s.poll().is_some().then_some(s)) {
            let st = s.done.map(|s| s.to_string()).unwrap_or_default();
            anyhow::bail!("{} exited early ({st}{}): {}", s.name, s.lost(), s.log_tail());
        }
        if run.workers.iter_mut().all(|w| w.poll().is_some()) {
            break;
        }
        let elapsed = start.elapsed();
        if budget.is_some_and(|b| elapsed >= b) && run.ended == Ended::Finished {
            run.ended = Ended::TimeBudget;
            run.workers.iter_mut().for_each(Guard::terminate);
        }
        if elapsed >= timeout {
            anyhow::bail!(
                "still running after {:.0} s (run_timeout_s); stopped. rank0: {}",
                timeout.as_secs_f64(),
                run.workers.first().map(Guard::log_tail).unwrap_or_default()
            );
        }
        std::thread::sleep(TICK);
    }
    run.finish()
}

/// Start the plan's servers in order, each waited for until it listens, recording in `sites`
/// where each was started: their guards and the addresses they listen on.
fn start_servers(
    plan: &[ProcSpec],
    logs: &Path,
    sites: &mut Vec<Arc<dyn Site>>,
) -> anyhow::Result<(Vec<Guard>, Vec<String>)> {
    let mut servers = Vec::new();
    let mut addrs = Vec::new();
    for s in plan {
        sites.push(s.site.clone());
        let mut g = Guard::spawn(s, logs, Stdio::piped(), false)?;
        // Named with where it runs: a server that cannot start on its host says which host.
        let name = g.name.clone();
        let addr = wait_listening(&mut g).with_context(|| format!("{name} did not start"))?;
        addrs.push(addr);
        servers.push(g);
    }
    Ok((servers, addrs))
}

/// Start the workers, recording in `sites` where each was started, and follow rank 0's
/// metrics as they grow: read where this machine can read them, sent back over the process's
/// own connection (its supervisor's stdout) from another host.
fn start_workers(
    specs: &[ProcSpec],
    logs: &Path,
    sites: &mut Vec<Arc<dyn Site>>,
) -> anyhow::Result<(Vec<Guard>, Option<StepCounter>)> {
    let mut workers = Vec::new();
    let mut follow = None;
    for (i, p) in specs.iter().enumerate() {
        sites.push(p.site.clone());
        let (mut g, remote) = spawn_worker(i, p, logs)?;
        if i == 0 {
            follow = Some(match g.child.stdout.take() {
                Some(out) if remote => StepCounter::over(out),
                _ => StepCounter::new(p.metrics.clone()),
            });
        }
        workers.push(g);
    }
    Ok((workers, follow))
}

/// Start worker `i`: rank 0 on another host sends the lines appended to its metrics back on
/// its stdout (returned `true` then).
fn spawn_worker(i: usize, p: &ProcSpec, logs: &Path) -> anyhow::Result<(Guard, bool)> {
    let remote = i == 0 && !p.site.is_child();
    let g = Guard::spawn(p, logs, if remote { Stdio::piped() } else { Stdio::null() }, remote)?;
    Ok((g, remote))
}

/// One run under way: its processes, and what has happened to them so far.
struct Running<'a> {
    logs: PathBuf,
    bar: &'a ProgressBar,
    /// Stop the workers once rank 0 measures this accuracy.
    stop_at: Option<f64>,
    max_restarts: u32,
    /// The kills still to inject, in order.
    kills: std::iter::Peekable<std::vec::IntoIter<(u64, usize)>>,
    /// Whether every worker runs on this machine (its cores then say how busy they were).
    here: bool,
    /// The workers' processes, as started again after a failure.
    specs: Vec<ProcSpec>,
    servers: Vec<Guard>,
    workers: Vec<Guard>,
    /// Rank 0's steps.
    follow: Option<StepCounter>,
    restarts: Vec<Restart>,
    /// A kill sent and not yet seen as a failure: (worker, when).
    killed: Option<(usize, Instant)>,
    pending: Option<Pending>,
    ended: Ended,
    /// The machine's CPU while rank 0's steps after the first ran.
    steady: Steady,
}

/// The window a run's cores are judged busy over: from rank 0's first step recorded (the
/// warm-up, and every rank's start, behind it) to its last one, so neither the start (a large
/// model's processes fault in and zero gigabytes of pages) nor the exit (freeing them) counts.
/// With only the first step recorded, the window ends when the workers have exited.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Steady {
    /// The machine's [`super::machine::cpu_ticks`] when rank 0 had recorded its first step.
    start: Option<(u64, u64)>,
    /// Those of the latest step after it: (steps recorded, ticks).
    last: Option<(u64, (u64, u64))>,
}

impl Steady {
    /// Rank 0 has recorded `count` steps, the machine's cores standing at `ticks`.
    pub(crate) fn saw(&mut self, count: u64, ticks: impl FnOnce() -> Option<(u64, u64)>) {
        match (self.start, self.last) {
            (None, _) if count >= 1 => self.start = ticks(),
            (Some(_), last) if count >= 2 && last.is_none_or(|(n, _)| count > n) => {
                self.last = ticks().map(|t| (count, t));
            }
            _ => {}
        }
    }

    /// The share of the cores busy over the window, `now` ending it where no later step was
    /// seen; `None` for a window of under `min_ticks`.
    pub(crate) fn busy(&self, now: Option<(u64, u64)>, min_ticks: u64) -> Option<f64> {
        let end = self.last.map(|(_, t)| t).or(now)?;
        super::machine::busy_between(self.start?, end, min_ticks)
    }
}

impl Running<'_> {
    /// Rank 0's progress: the bar, the start of the steady window, its target reached, what
    /// a restart cost once the restarted rank 0 records its first step, and the next kill to
    /// inject once rank 0 has recorded the step it waits for.
    fn watch_rank0(&mut self) {
        let Some(c) = self.follow.as_mut() else { return };
        self.bar.set_position(c.count());
        if self.here {
            self.steady.saw(c.count(), super::machine::cpu_ticks);
        }
        if self.stop_at.is_some_and(|t| c.best_accuracy >= t) && self.ended == Ended::Finished {
            self.ended = Ended::Target;
            self.workers.iter_mut().for_each(Guard::terminate);
        }
        if let Some(first) = c.first_since_mark
            && let Some(p) = self.pending.take()
        {
            let mut r = p.restart;
            r.resumed_after = Some(first.0.saturating_sub(1));
            r.lost_s = Some(first.1.saturating_duration_since(p.at).as_secs_f64());
            self.restarts.push(r);
        }
        if self.killed.is_none()
            && self.pending.is_none()
            && let Some(&(step, victim)) = self.kills.peek()
            && c.last_step >= step
        {
            // Local training and DP run one process: it is the one killed.
            let victim = victim % self.workers.len().max(1);
            self.kills.next();
            if let Some(w) = self.workers.get_mut(victim) {
                w.kill9();
                self.killed = Some((victim, Instant::now()));
            }
        }
    }

    /// Ctrl-C or SIGTERM: every process stopped, the run partial.
    fn interrupt(mut self) -> Finished {
        self.workers.iter_mut().chain(self.servers.iter_mut()).for_each(Guard::terminate);
        for g in self.workers.iter_mut().chain(self.servers.iter_mut()) {
            g.reap(TERM_GRACE);
        }
        Finished { ended: Ended::Interrupted, cpu_busy: None, restarts: self.restarts }
    }

    /// A worker exited with a failure: the run diverged, failed, or is restarted (`None`: the
    /// workers run again).
    fn after_failure(&mut self) -> anyhow::Result<Option<Finished>> {
        self.settle();
        if let Some(d) = self.workers.iter().find(|w| w.done.and_then(|s| s.code()) == Some(EXIT_DIVERGED)) {
            let why = format!("{}: {}", d.name, d.log_tail());
            let restarts = std::mem::take(&mut self.restarts);
            return Ok(Some(Finished { ended: Ended::Diverged(why), cpu_busy: None, restarts }));
        }
        // The failure to blame, by the launcher's rule: the one a signal ended first.
        let mut failed: Vec<(usize, ExitStatus)> = self
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.done.filter(|s| !s.success()).map(|s| (i, s)))
            .collect();
        gradsync_worker::launch::blame(&mut failed, |(_, s)| s.signal().is_some());
        let (i, st) = failed[0];
        let w = &self.workers[i];
        let why = format!("{} exited with {st}{}: {}", w.name, w.lost(), w.log_tail());
        if self.max_restarts == 0 {
            anyhow::bail!("{why}");
        }
        let spent = self.restarts.len() + usize::from(self.pending.is_some());
        if spent >= self.max_restarts as usize {
            self.stop_workers();
            if let Some(p) = self.pending.take() {
                self.restarts.push(p.restart);
            }
            let why = format!("{why}; after {spent} restart(s) of {}", self.max_restarts);
            let restarts = std::mem::take(&mut self.restarts);
            return Ok(Some(Finished { ended: Ended::Exhausted(why), cpu_busy: None, restarts }));
        }
        self.restart(i, st, &why)?;
        Ok(None)
    }

    /// One rank's divergence makes its peers fail too (a ring or a barrier loses a member):
    /// give them a moment to exit, so that a divergence any rank saw is reported as one. Not
    /// after a kill the runner injected: its cause is known, and a PS run's other workers
    /// wait in their step rather than exit.
    fn settle(&mut self) {
        let injected =
            self.killed.is_some_and(|(k, _)| self.workers.get_mut(k).is_some_and(|w| w.poll().is_some()));
        let settle = if injected { Duration::ZERO } else { Duration::from_secs(2) };
        let until = Instant::now() + settle;
        while Instant::now() < until && self.workers.iter_mut().any(|w| w.poll().is_none()) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Restart after worker `i` failed with `st` (`why`): every worker stopped, then all
    /// started again from their checkpoints; the restart is recorded once the restarted rank
    /// 0 records its first step.
    fn restart(&mut self, i: usize, st: ExitStatus, why: &str) -> anyhow::Result<()> {
        let injected = self.killed.take().filter(|(k, _)| *k == i);
        let at = injected.map_or_else(Instant::now, |(_, t)| t);
        if let Some(p) = self.pending.take() {
            // The restart before this one never recorded a step.
            self.restarts.push(p.restart);
        }
        let reached = self.follow.as_mut().map_or(0, |c| {
            c.count();
            c.last_step
        });
        self.stop_workers();
        let restart = Restart {
            rank: i,
            exit: st.to_string(),
            injected: injected.is_some(),
            step_reached: reached,
            resumed_after: None,
            lost_s: None,
        };
        multi_line(self.bar, &format!("restarting the workers: {why}"));
        self.workers.clear();
        if let Some(c) = self.follow.as_mut() {
            c.mark();
        }
        for (i, p) in self.specs.iter_mut().enumerate() {
            gradsync_worker::launch::resume_args(&mut p.args);
            let (mut g, remote) = spawn_worker(i, p, &self.logs)?;
            if let (Some(c), Some(out)) = (self.follow.as_mut(), g.child.stdout.take().filter(|_| remote)) {
                c.refollow(lines(out));
            }
            self.workers.push(g);
        }
        self.pending = Some(Pending { at, restart });
        Ok(())
    }

    /// Every worker killed and reaped.
    fn stop_workers(&mut self) {
        self.workers.iter_mut().for_each(Guard::kill9);
        for w in self.workers.iter_mut() {
            w.reap(TERM_GRACE);
        }
    }

    /// Every worker has exited: how busy the cores were, and the servers stopped, each of
    /// which must exit cleanly.
    fn finish(mut self) -> anyhow::Result<Finished> {
        if let Some(c) = self.follow.as_mut() {
            self.bar.set_position(c.count());
        }
        if let Some(p) = self.pending.take() {
            self.restarts.push(p.restart);
        }
        // Half a second of the machine's ticks (its cores together) at the least.
        let ticks_per_s = 100 * std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let cpu_busy = self.steady.busy(super::machine::cpu_ticks(), ticks_per_s / 2);
        for s in self.servers.iter_mut() {
            s.terminate();
        }
        for s in self.servers.iter_mut() {
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
        Ok(Finished { ended: self.ended, cpu_busy, restarts: self.restarts })
    }
}

/// A line printed above the progress bars.
fn multi_line(bar: &ProgressBar, line: &str) {
    bar.suspend(|| eprintln!("{line}"));
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
    /// The metrics file itself.
    File(MetricsTail),
    /// Lines sent back from another host, read by a thread of their own.
    Lines(std::sync::mpsc::Receiver<String>),
}

/// Counts the step records appended to a metrics file, and the best held-out accuracy among
/// them, reading only what is new.
struct StepCounter {
    source: Source,
    /// The highest step recorded.
    steps: u64,
    best_accuracy: f64,
    partial: Vec<u8>,
    /// The step of the newest record.
    last_step: u64,
    /// The first step recorded since [`StepCounter::mark`], and when it was read.
    first_since_mark: Option<(u64, Instant)>,
    /// Whether the counter is marked and waiting for that first step.
    marked: bool,
    /// After a restart on another host, whose supervisor sends the metrics file again from
    /// its start: the step reached before, up to which records are not counted again.
    replayed: Option<u64>,
}

impl StepCounter {
    fn new(path: PathBuf) -> Self {
        Self::from(Source::File(MetricsTail::new(path)))
    }

    /// The lines a remote process's supervisor sends on `out` (`supervise --follow`).
    fn over(out: std::process::ChildStdout) -> Self {
        Self::from(lines(out))
    }

    fn from(source: Source) -> Self {
        StepCounter {
            source,
            steps: 0,
            best_accuracy: f64::NEG_INFINITY,
            partial: Vec::new(),
            last_step: 0,
            first_since_mark: None,
            marked: false,
            replayed: None,
        }
    }

    /// Note the first step recorded from now on (restarted workers' first).
    fn mark(&mut self) {
        self.marked = true;
        self.first_since_mark = None;
    }

    /// Follow a restarted rank 0 on another host through its new supervisor's `out`. That
    /// supervisor sends the metrics file from its start, so the records up to the step already
    /// reached are not counted again, and the first new step cannot be told from a resent one:
    /// the restart's cost is not measured there.
    fn refollow(&mut self, source: Source) {
        self.source = source;
        self.partial.clear();
        self.replayed = Some(self.last_step);
        self.marked = false;
    }

    fn count(&mut self) -> u64 {
        match &mut self.source {
            Source::File(tail) => self.partial.extend_from_slice(&tail.read()),
            Source::Lines(rx) => {
                while let Ok(line) = rx.try_recv() {
                    self.partial.extend_from_slice(line.as_bytes());
                }
            }
        }
        while let Some(i) = self.partial.iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&self.partial[..i]);
            if line.contains("\"kind\":\"step\"")
                && let Ok(Record::Step(s)) = parse_line(&line)
            {
                if self.replayed.is_some_and(|r| s.step <= r) {
                    self.partial.drain(..=i);
                    continue;
                }
                self.replayed = None;
                // Steps recomputed after a restart from a checkpoint are not reached twice.
                self.steps = self.steps.max(s.step);
                if let Some(a) = s.accuracy {
                    self.best_accuracy = self.best_accuracy.max(a);
                }
                self.last_step = s.step;
                if self.marked {
                    self.marked = false;
                    self.first_since_mark = Some((s.step, Instant::now()));
                }
            }
            self.partial.drain(..=i);
        }
        self.steps
    }
}

/// A [`Source`] of the lines `out` carries, read by a thread of its own.
fn lines(out: std::process::ChildStdout) -> Source {
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
    Source::Lines(rx)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The busy window runs from rank 0's first step to its last: the cores' ticks at the exit
    /// (here all busy, as a large model's processes freeing their pages keep them) do not count
    /// where a later step was seen; with the first step alone, the exit ends it.
    #[test]
    fn the_cores_are_judged_busy_from_the_first_step_to_the_last_not_to_the_exit() {
        let mut s = Steady::default();
        s.saw(0, || Some((0, 0)));
        assert_eq!(s, Steady::default(), "nothing before the first step");
        s.saw(1, || Some((100, 200)));
        assert_eq!(s.busy(Some((400, 500)), 10), Some(1.0), "one step: to the exit");
        s.saw(2, || Some((150, 300)));
        s.saw(2, || panic!("a step seen once is read once"));
        assert_eq!(s.busy(Some((400, 500)), 10), Some(0.5), "50 of 100 ticks busy between the steps");
        s.saw(3, || Some((160, 400)));
        assert_eq!(s.busy(Some((400, 500)), 10), Some(0.3));
        // Too short a window says nothing.
        assert_eq!(s.busy(None, 1000), None);
        assert_eq!(Steady::default().busy(Some((1, 2)), 1), None);
    }

    /// A step record as rank 0's metrics file holds it, with the fields the counter reads.
    fn step(n: u64, accuracy: Option<f64>) -> String {
        let line = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/step-record.json"),
        )
        .unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&line).unwrap();
        v["step"] = n.into();
        v["accuracy"] = accuracy.map_or(serde_json::Value::Null, Into::into);
        format!("{v}\n")
    }

    #[test]
    fn a_restarted_remote_rank_0_is_not_counted_twice() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut c = StepCounter::from(Source::Lines(rx));
        for n in 1..=5 {
            tx.send(step(n, (n == 4).then_some(0.5))).unwrap();
        }
        assert_eq!(c.count(), 5);
        assert_eq!((c.last_step, c.best_accuracy), (5, 0.5));
        // Restarted from its checkpoint at step 3: its supervisor resends steps 1-5 of the
        // file, then the run goes on from step 4.
        let (tx, rx) = std::sync::mpsc::channel();
        c.mark();
        c.refollow(Source::Lines(rx));
        for n in (1..=5).chain(4..=7) {
            tx.send(step(n, (n == 7).then_some(0.75))).unwrap();
        }
        assert_eq!(c.count(), 5 + 2, "the resent steps 1-5 and the recomputed 4-5 are not counted again");
        assert_eq!((c.last_step, c.best_accuracy), (7, 0.75));
        assert!(c.first_since_mark.is_none(), "no restart cost is measured from resent records");
    }

    /// A header line as a worker opens its metrics file with, started at `ms`.
    fn header(ms: u64) -> String {
        format!("{{\"kind\":\"header\",\"start_unix_ms\":{ms}}}\n")
    }

    #[test]
    fn a_metrics_file_written_again_from_its_start_is_read_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank0.jsonl");
        std::fs::write(&path, header(1_000) + &step(1, None)).unwrap();
        let mut c = StepCounter::new(path.clone());
        assert_eq!((c.count(), c.last_step), (1, 1));
        // Killed at step 1, before any checkpoint: the restarted worker writes its file again
        // and is already a step further than before when the counter next looks, so the file
        // is longer than what was read of the old one.
        c.mark();
        std::fs::write(&path, header(2_000) + &step(1, None) + &step(2, Some(0.5))).unwrap();
        assert_eq!(c.count(), 2);
        assert_eq!(c.first_since_mark.map(|f| f.0), Some(1), "the restart's first step is step 1");
        assert_eq!((c.last_step, c.best_accuracy), (2, 0.5));
        // Appended to, as after a resume from a checkpoint: read on from where it was, and the
        // steps recomputed after the checkpoint (2) are not reached twice.
        c.mark();
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all((step(2, None) + &step(3, None)).as_bytes()).unwrap();
        assert_eq!(c.count(), 3);
        assert_eq!(c.first_since_mark.map(|f| f.0), Some(2));
        // Written again, shorter than before and with half a header so far.
        c.mark();
        let head = header(3_000);
        std::fs::write(&path, &head[..10]).unwrap();
        c.count();
        std::fs::write(&path, head + &step(1, None)).unwrap();
        c.count();
        assert_eq!(c.first_since_mark.map(|f| f.0), Some(1));
        assert_eq!(c.last_step, 1);
    }
}
