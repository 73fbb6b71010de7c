//! Dilated time (`--dilate D`): a run slowed D times, as DieCast's guests are, so that an
//! emulated cluster whose hosts share a few cores can stand in for one whose hosts each have
//! their own. Every clock gradsync keeps runs D times slower and every figure it records is
//! divided back by D:
//!
//! - compute: a replayed model waits D times its profile's times; a model trained for real has
//!   each training compute phase (forward, backward up to each bucket it hands out, the
//!   update; evaluation excluded) made to last D times the CPU time its thread used, the
//!   thread waiting out the difference ([`Pace`]). The phase then counts, in dilated time, as
//!   exactly its CPU time: the compute of a host with a core of its own;
//! - waits: every timeout, heartbeat and injected delay is stretched ([`Dilation::stretch`]);
//! - links: the emulated cluster shapes every link at rate / D (it lives in the comparison
//!   crate, which hands `--dilate` to every process it starts);
//! - records: the metrics writer divides every duration by D ([`crate::metrics::Record::dilated`]).
//!
//! A phase whose wall time already exceeded D times its CPU time (its thread waited for a core,
//! or for something that is not compute) is *under-dilated*: it is counted, with the time by
//! which it overran, so that a run where the cores were still short is flagged, not believed.
//!
//! A phase's CPU time is only a host's own compute where nothing else computes beside it:
//! two processes computing at once on two cores of this machine each used 1.2x (an AMD EPYC
//! VM) to 1.6-2.1x (an Intel Xeon VM) the CPU time one alone uses, the caches and memory they
//! share stalling both. Processes given the same [`Turns`] file (`--compute-turns`) compute
//! one at a time: a phase waits for its turn inside its D-times-longer window and gives it
//! back before it waits out the rest, so with D at least the number of processes computing
//! at once the wait costs nothing in dilated time, and where it does the phase is counted
//! under-dilated like any other overrun.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A time-dilation factor: 1 (none) or more.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Dilation(f64);

impl Default for Dilation {
    fn default() -> Self {
        Dilation::NONE
    }
}

impl Dilation {
    /// No dilation: time as it is.
    pub const NONE: Dilation = Dilation(1.0);

    /// The largest factor accepted: past it a 1 ms step takes over a second, and the kernel's
    /// own timers (a TCP retransmission's 200 ms floor) would be the smaller clock.
    pub const MAX: f64 = 1000.0;

    /// The factor `d`, or why it cannot be one (named as `what`, the flag or key that gave it).
    pub fn new(what: &str, d: f64) -> Result<Self> {
        if d.is_finite() && (1.0..=Self::MAX).contains(&d) {
            Ok(Dilation(d))
        } else {
            Err(Error::invalid(
                what,
                format!(
                    "{d} (a time-dilation factor must be a number from 1, no dilation, to {})",
                    Self::MAX
                ),
            ))
        }
    }

    /// The factor.
    pub fn factor(self) -> f64 {
        self.0
    }

    /// Whether time runs as it is.
    pub fn is_none(self) -> bool {
        self.0 == 1.0
    }

    /// How long a wait of `d` in the emulated world's time lasts in real time.
    pub fn stretch(self, d: Duration) -> Duration {
        if self.is_none() { d } else { d.mul_f64(self.0) }
    }

    /// Real milliseconds as the emulated world's.
    pub fn shrink_ms(self, ms: f64) -> f64 {
        ms / self.0
    }

    /// `xD` as a label says it (`x4`, `x2.5`).
    pub fn label(self) -> String {
        format!("x{}", self.0)
    }
}

/// Sleep (never spin: a replayed model's compute leaves the cores to the communication) until
/// `deadline`.
pub(crate) fn sleep_until(deadline: Instant) {
    thread_local! {
        // Linux wakes a sleeping thread up to its timer slack (50 us by default) late; a
        // replayed backward sleeps once per layer, so this thread asks for 1 us.
        static SLACK: () = {
            // SAFETY: PR_SET_TIMERSLACK takes one integer and changes only the calling thread.
            #[cfg(target_os = "linux")]
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
            }
        };
    }
    SLACK.with(|_| ());
    let now = Instant::now();
    if deadline > now {
        std::thread::sleep(deadline - now);
    }
}

/// The CPU time the calling thread has used so far.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec the call writes; CLOCK_THREAD_CPUTIME_ID is always there
    // on Linux (it fails only for a clock id that does not exist).
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// How much a phase may overrun D times its CPU time before it counts as under-dilated: the
/// clocks are read a few hundred nanoseconds apart and a thread's wake-up is late by its timer
/// slack, so a phase of a few microseconds would otherwise be flagged for nothing.
const SLACK: Duration = Duration::from_micros(50);

/// Turns at computing, shared by every process that opens the same file: an exclusive
/// `flock` on it is the turn. A process that dies gives its turn back with its descriptor, so
/// a killed rank never stalls the others.
#[derive(Debug, Clone)]
pub struct Turns {
    file: Arc<std::fs::File>,
    path: PathBuf,
}

impl Turns {
    /// The turns of the file at `path` (made where missing), tried once, or why they cannot be
    /// taken there (named as `what`, the flag that gave it).
    pub fn open(what: &str, path: &Path) -> Result<Turns> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::invalid(what, format!("{}: {e}", path.display())))?;
        let turns = Turns { file: Arc::new(file), path: path.to_path_buf() };
        turns.take().and_then(|()| turns.give()).map_err(|e| {
            Error::invalid(
                what,
                format!("{}: cannot be locked ({e}); give a file on a local disk", path.display()),
            )
        })?;
        Ok(turns)
    }

    /// The file, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Wait for the turn.
    fn take(&self) -> std::io::Result<()> {
        self.flock(libc::LOCK_EX)
    }

    /// Give the turn back.
    fn give(&self) -> std::io::Result<()> {
        self.flock(libc::LOCK_UN)
    }

    fn flock(&self, op: libc::c_int) -> std::io::Result<()> {
        loop {
            // SAFETY: the descriptor is the open file this value owns; flock takes no pointers.
            if unsafe { libc::flock(self.file.as_raw_fd(), op) } == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Paces one thread's compute phases under a [`Dilation`]: [`Pace::begin`] marks where a phase
/// starts, [`Pace::lap`] makes it last D times the CPU time the thread used since (waiting out
/// the difference) and starts the next. With [`Turns`] each phase computes in its turn. Without
/// dilation both do nothing.
#[derive(Debug, Clone)]
pub struct Pace {
    dilation: Dilation,
    /// The turns the phases compute in, where the cores are shared with other processes.
    turns: Option<Turns>,
    /// The open phase's start: wall clock and the thread's CPU clock.
    start: Option<(Instant, Duration)>,
    /// What the phases so far came to.
    tally: PaceTally,
}

/// What a [`Pace`]'s phases came to since it was last read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PaceTally {
    /// Phases paced.
    pub phases: u32,
    /// Phases whose wall time exceeded D times their CPU time (beyond a small slack).
    pub under: u32,
    /// The CPU time of the phases.
    pub cpu: Duration,
    /// By how much the under-dilated phases overran D times their CPU time, real time.
    pub overrun: Duration,
}

impl Pace {
    /// A pace for `dilation`.
    pub fn new(dilation: Dilation) -> Self {
        Pace { dilation, turns: None, start: None, tally: PaceTally::default() }
    }

    /// The same, each phase computing in its turn of `turns` (none: whenever it starts).
    pub fn with_turns(mut self, turns: Option<Turns>) -> Self {
        self.turns = turns;
        self
    }

    /// The dilation it paces to.
    pub fn dilation(&self) -> Dilation {
        self.dilation
    }

    /// The turns its phases compute in.
    pub fn turns(&self) -> Option<&Turns> {
        self.turns.as_ref()
    }

    /// A phase starts now.
    pub fn begin(&mut self) {
        if !self.dilation.is_none() {
            self.open(Instant::now());
        }
    }

    /// Open a phase wanted from `wall0`: its turn first (the wait is inside its window, not
    /// its CPU time), then its CPU clock.
    fn open(&mut self, wall0: Instant) {
        if let Some(t) = &self.turns {
            // A lock that fails once it opened (it was tried at `Turns::open`) leaves the phase
            // to compute beside the others: its CPU time then shows it, as without turns.
            let _ = t.take();
        }
        self.start = Some((wall0, thread_cpu()));
    }

    /// The open phase ends: give its turn back, wait until it has lasted D times the CPU time
    /// it used, count it under-dilated where it lasted longer already, and open the next phase.
    pub fn lap(&mut self) {
        if self.close() {
            self.open(Instant::now());
        }
    }

    /// Close the open phase, as [`Pace::lap`] says; whether one was open.
    fn close(&mut self) -> bool {
        let Some((wall0, cpu0)) = self.start.take() else { return false };
        let cpu = thread_cpu().saturating_sub(cpu0);
        if let Some(t) = &self.turns {
            let _ = t.give();
        }
        let target = wall0 + cpu.mul_f64(self.dilation.0);
        let now = Instant::now();
        self.tally.phases += 1;
        self.tally.cpu += cpu;
        if now > target + SLACK {
            self.tally.under += 1;
            self.tally.overrun += now - target;
        } else if target > now {
            sleep_until(target);
        }
        true
    }

    /// The open phase ends (as [`Pace::lap`]) and no other opens.
    pub fn end(&mut self) {
        self.close();
    }

    /// Run `f` as one compute phase paced to `dilation`, in its turn of `turns` where given
    /// (nothing paced without dilation): for a phase that stands alone, whose tally nobody reads.
    pub fn run<T>(dilation: Dilation, turns: Option<&Turns>, f: impl FnOnce() -> T) -> T {
        let mut pace = Pace::new(dilation).with_turns(turns.cloned());
        pace.begin();
        let out = f();
        pace.end();
        out
    }

    /// What the phases came to since the last call, and start counting afresh.
    pub fn take(&mut self) -> PaceTally {
        std::mem::take(&mut self.tally)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burn about `d` of this thread's CPU time.
    fn burn(d: Duration) {
        let t0 = thread_cpu();
        let mut x = 1u64;
        while thread_cpu() - t0 < d {
            for _ in 0..1000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            }
            std::hint::black_box(x);
        }
    }

    #[test]
    fn a_bad_factor_is_refused_by_name() {
        for d in [0.0, 0.5, -2.0, f64::NAN, f64::INFINITY, 1001.0] {
            let e = Dilation::new("--dilate", d).unwrap_err().to_string();
            assert!(e.contains("--dilate") && e.contains("from 1"), "{d}: {e}");
        }
        assert_eq!(Dilation::new("--dilate", 4.0).unwrap().factor(), 4.0);
        assert!(Dilation::new("dilate", 1.0).unwrap().is_none());
    }

    #[test]
    fn waits_stretch_and_records_shrink_by_the_factor() {
        let d = Dilation::new("--dilate", 4.0).unwrap();
        assert_eq!(d.stretch(Duration::from_millis(250)), Duration::from_secs(1));
        assert_eq!(d.shrink_ms(100.0), 25.0);
        assert_eq!(Dilation::NONE.stretch(Duration::from_millis(3)), Duration::from_millis(3));
        assert_eq!(d.label(), "x4");
    }

    #[test]
    fn a_phase_lasts_the_factor_times_its_cpu_time() {
        let mut p = Pace::new(Dilation::new("--dilate", 5.0).unwrap());
        let t = Instant::now();
        p.begin();
        burn(Duration::from_millis(20));
        p.end();
        let wall = t.elapsed();
        let tally = p.take();
        // 20 ms of CPU (a little more: the clock is read between spins) made to last 5 x.
        let cpu = tally.cpu;
        assert!(cpu >= Duration::from_millis(20) && cpu < Duration::from_millis(40), "{cpu:?}");
        assert!(wall >= cpu * 5, "{wall:?} < 5 x {cpu:?}");
        assert!(wall < cpu * 5 + Duration::from_millis(30), "{wall:?} against 5 x {cpu:?}");
        assert_eq!((tally.phases, tally.under), (1, 0));
        assert_eq!(p.take(), PaceTally::default(), "taking resets the tally");
    }

    #[test]
    fn a_phase_that_waited_past_its_dilated_length_is_counted_under_dilated() {
        let mut p = Pace::new(Dilation::new("--dilate", 2.0).unwrap());
        p.begin();
        burn(Duration::from_millis(2));
        // Waiting is not compute: 30 ms of it exceed 2 x 2 ms of CPU time.
        std::thread::sleep(Duration::from_millis(30));
        p.lap();
        let t = p.take();
        assert_eq!((t.phases, t.under), (1, 1));
        assert!(t.overrun >= Duration::from_millis(20), "{:?}", t.overrun);
    }

    /// Two holders of the same file (each its own open file, as two processes have) never
    /// compute at once: a phase waits for the turn inside its window, its CPU time not
    /// counting the wait; a wait past the window is an overrun.
    #[test]
    fn phases_given_the_same_turns_compute_one_at_a_time() {
        let dir = std::env::temp_dir().join(format!("gradsync-turns-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("compute.turns");
        let (a, b) =
            (Turns::open("--compute-turns", &path).unwrap(), Turns::open("--compute-turns", &path).unwrap());
        assert_eq!(a.path(), path);
        // `a` holds the turn for 60 ms; `b`'s phase of 5 ms of CPU at x20 (a 100 ms window)
        // waits for it and still fits.
        a.take().unwrap();
        let held = Instant::now();
        let other = std::thread::spawn(move || {
            let mut p = Pace::new(Dilation::new("--dilate", 20.0).unwrap()).with_turns(Some(b));
            let t = Instant::now();
            p.begin();
            let computed_from = t.elapsed();
            burn(Duration::from_millis(5));
            p.end();
            (computed_from, t.elapsed(), p.take())
        });
        std::thread::sleep(Duration::from_millis(60));
        let released = held.elapsed();
        a.give().unwrap();
        let (computed_from, wall, tally) = other.join().unwrap();
        assert!(
            computed_from + Duration::from_millis(5) >= released.saturating_sub(Duration::from_millis(5)),
            "{computed_from:?} against the turn given back at {released:?}"
        );
        assert!(tally.cpu < Duration::from_millis(20), "the wait counted as compute: {:?}", tally.cpu);
        assert_eq!((tally.phases, tally.under), (1, 0), "{tally:?}");
        assert!(wall >= tally.cpu * 20, "{wall:?}");
        // At x2 the same wait is past the window: counted under-dilated.
        let c = Turns::open("--compute-turns", &path).unwrap();
        a.take().unwrap();
        let late = std::thread::spawn(move || {
            let mut p = Pace::new(Dilation::new("--dilate", 2.0).unwrap()).with_turns(Some(c));
            p.begin();
            burn(Duration::from_millis(2));
            p.end();
            p.take()
        });
        std::thread::sleep(Duration::from_millis(40));
        a.give().unwrap();
        let t = late.join().unwrap();
        assert_eq!((t.phases, t.under), (1, 1), "{t:?}");
        assert!(t.overrun >= Duration::from_millis(25), "{:?}", t.overrun);
        // A path that cannot be a lock is refused naming the flag and the path.
        let e = Turns::open("--compute-turns", &dir).unwrap_err().to_string();
        assert!(e.contains("--compute-turns") && e.contains(&dir.display().to_string()), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_dilation_nothing_is_paced_or_counted() {
        let mut p = Pace::new(Dilation::NONE);
        p.begin();
        burn(Duration::from_millis(2));
        p.end();
        assert_eq!(p.take(), PaceTally::default());
    }
}
