//! What every reading reads from: one group's figures, the link its cost model is fitted to,
//! the machine, and every run (the failed ones too), with the small judgements they share:
//! a cell's spread, whether it ran often enough to be ranked, and how a figure is set
//! against a yardstick.

use crate::charts::Group;
use crate::cost::Link;
use crate::emulated::ClusterRun;
use crate::machine::{self, Machine};
use crate::results::{Summary, overlap};

use crate::results::REPLAY_BUSY;

/// Why a run saturated the CPU, as the readings say it where nothing else on the page does.
pub const SATURATED: &str =
    "saturated the CPU (more processes than cores; for a replay, cores over 80% busy)";

/// [`SATURATED`] for a group of dilated runs, where processes may outnumber the cores.
pub const SATURATED_DILATED: &str = "saturated the CPU (dilated: cores over 80% busy, or a dilation too small for \
     the cores: its compute overran the factor or its check at twice the factor differed)";

/// What a reading says instead of a ranking where a cell ran once, where nothing else on the
/// page says why.
pub const UNRANKED: &str = "Not ranked: a cell measured once has no spread to set a difference against (run \
     each cell two or more times, `repeats` in the scenario or `--repeats`).";

/// [`SATURATED`] on a page that gives the reason once, beside the list of the runs it leaves
/// unranked (the verdict card's "not ranked" line).
const SATURATED_SAID: &str = "saturated the CPU";

/// [`UNRANKED`] on a page that gives the reason once.
const UNRANKED_SAID: &str = "Not ranked: measured once.";

/// One group's readings' shared input.
pub struct Context<'c, 'a> {
    /// The group read.
    pub g: &'c Group<'a>,
    /// The link its cost model is fitted to (the machine's loopback, or the group's emulated
    /// link), where measured.
    pub link: Option<Link>,
    /// The machine the runs shared, where described.
    pub machine: Option<&'c Machine>,
    /// Every run, complete or not.
    pub all: &'c [Summary],
    /// The emulated cluster's record of each run it placed (none for runs on loopback or on
    /// real hosts).
    pub cluster: &'c [ClusterRun],
    /// The group's worker counts, ascending.
    pub workers: Vec<usize>,
    /// Whether the page says once, elsewhere, why runs are left unranked, so a reading names
    /// the cause in a word instead of explaining it again.
    reasons_said: bool,
}

impl<'c, 'a> Context<'c, 'a> {
    /// The context of group `g`.
    pub fn new(
        g: &'c Group<'a>,
        link: Option<Link>,
        machine: Option<&'c Machine>,
        all: &'c [Summary],
    ) -> Self {
        let mut workers: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
        workers.sort_unstable();
        workers.dedup();
        Context { g, link, machine, all, cluster: &[], workers, reasons_said: false }
    }

    /// The same context with the emulated cluster's record of the runs it placed, which the
    /// cost model's lines then price as placed ([`super::links::exchange_model`]).
    pub fn with_cluster(self, cluster: &'c [ClusterRun]) -> Self {
        Context { cluster, ..self }
    }

    /// The same context for a page that explains once why runs are left unranked: the
    /// readings then name the cause ([`Context::saturated`], [`Context::unranked`]) without
    /// repeating the explanation in every sentence.
    pub fn reasons_said_once(self) -> Self {
        Context { reasons_said: true, ..self }
    }

    /// Why a run is not ranked when it saturated the CPU: [`SATURATED`], or its first words
    /// where the page gives the reason once.
    pub fn saturated(&self) -> &'static str {
        if self.reasons_said { SATURATED_SAID } else { self.saturation_reason() }
    }

    /// Why this group's runs count as saturated, in full: [`SATURATED_DILATED`] for a dilated
    /// group, else [`SATURATED`].
    pub fn saturation_reason(&self) -> &'static str {
        if self.g.rows.iter().any(|r| r.dilation.is_some()) { SATURATED_DILATED } else { SATURATED }
    }

    /// What a reading says instead of a ranking where a cell ran once: [`UNRANKED`], or a
    /// short form where the page gives the reason once.
    pub fn unranked(&self) -> &'static str {
        if self.reasons_said { UNRANKED_SAID } else { UNRANKED }
    }

    /// The largest worker count, if any run completed.
    pub fn most_workers(&self) -> Option<usize> {
        self.workers.last().copied()
    }

    /// A row's median throughput (0 where it has none).
    pub fn thr(r: &Summary) -> f64 {
        r.samples_per_s.unwrap_or(0.0)
    }

    /// The range of a row's repeats' throughput.
    pub fn thr_range(&self, r: &Summary) -> Option<(f64, f64)> {
        self.g.cell_of(r).and_then(|c| c.throughput)
    }

    /// Whether two rows' throughput ranges overlap: level, never ranked.
    pub fn level(&self, a: &Summary, b: &Summary) -> bool {
        matches!((self.thr_range(a), self.thr_range(b)), (Some(x), Some(y)) if overlap(x, y))
    }

    /// Whether `r`'s cell has two or more complete repeats: what a ranking needs.
    pub fn repeated(&self, r: &Summary) -> bool {
        self.g.cell_of(r).is_some_and(|c| c.runs.len() > 1)
    }

    /// Whether `r` saturated the CPU, so its figures measure the CPU as much as the design:
    /// its processes (workers and servers) outnumbered the machine's cores (unknown cores
    /// count as not saturated); or, for a replayed model, whose processes sleep through their
    /// compute, the cores were more than [`REPLAY_BUSY`] busy while its steps ran.
    pub fn cpu_saturated(&self, r: &Summary) -> bool {
        cpu_saturated(r, self.machine)
    }

    /// "median of 3, 1000-1100", or "one run".
    pub fn spread(&self, r: &Summary) -> String {
        match self.g.cell_of(r) {
            Some(c) => match c.throughput {
                Some((lo, hi)) if c.runs.len() > 1 => format!("median of {}, {lo:.0}-{hi:.0}", c.runs.len()),
                _ => "one run".into(),
            },
            None => "one run".into(),
        }
    }

    /// Rows listed with a figure each and their spread, for readings that do not rank them.
    pub fn listed_by(&self, rs: &[&Summary], figure: &dyn Fn(&Summary) -> String) -> String {
        rs.iter()
            .map(|r| format!("{} {} ({})", Group::series(r), figure(r), self.spread(r)))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Rows listed with their throughput.
    pub fn listed(&self, rs: &[&Summary]) -> String {
        self.listed_by(rs, &|r| format!("{:.0}", Context::thr(r)))
    }

    /// The raw TCP yardstick for `streams` streams at once on this group's wire: what that
    /// many streams carried together over loopback, or, where that was not measured (an
    /// emulated link, or a machine record without it), one stream's rate, named as such.
    pub fn yardstick(&self, streams: usize) -> Option<Yardstick> {
        let many = self.g.link.is_empty().then(|| self.machine?.streams_bandwidth(streams)).flatten();
        match many {
            Some(b) if b > 0.0 => Some(Yardstick { bytes_per_s: b, streams }),
            _ => self.link.map(|l| Yardstick { bytes_per_s: l.b, streams: 1 }),
        }
    }

    /// The streams a row's run kept busy at once.
    pub fn streams(r: &Summary) -> Option<machine::Streams> {
        machine::tcp_streams(r.mode.parse().ok()?, r.workers, r.shards)
    }
}

/// [`Context::cpu_saturated`] for a run on `machine`.
pub fn cpu_saturated(r: &Summary, machine: Option<&Machine>) -> bool {
    if r.dilation.is_some() {
        return r.dilated_saturated();
    }
    if r.widths.starts_with(gradsync_core::model::REPLAY_TOKEN) {
        return r.cpu_busy.is_some_and(|b| b > REPLAY_BUSY);
    }
    machine.is_some_and(|m| m.cores > 0 && r.workers + r.shards > m.cores)
}

/// A raw TCP rate a figure is read against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yardstick {
    /// Bytes per second, all streams together.
    pub bytes_per_s: f64,
    /// How many streams carried it at once.
    pub streams: usize,
}

impl Yardstick {
    /// "one raw TCP stream", "8 raw TCP streams at once".
    pub fn name(&self) -> String {
        if self.streams == 1 {
            "one raw TCP stream".into()
        } else {
            format!("{} raw TCP streams at once", self.streams)
        }
    }

    /// `share` (a figure over this yardstick, 1.0 = equal) in words that never call more than
    /// all of it a share of a limit: "83% of what 8 raw TCP streams at once carry (9.10
    /// GB/s)", or above it "1.23x what one raw TCP stream carries (4.67 GB/s): a yardstick,
    /// not a limit, ...".
    pub fn read(&self, share: f64) -> String {
        let what = format!("what {} carr{}", self.name(), if self.streams == 1 { "ies" } else { "y" });
        let rate = format!("{:.2} GB/s", self.bytes_per_s / 1e9);
        if share <= 1.0 {
            format!("{:.0}% of {what} ({rate})", 100.0 * share)
        } else if self.streams == 1 {
            format!(
                "{share:.2}x {what} ({rate}): a yardstick, not a limit, since the run keeps several streams \
                 busy at once"
            )
        } else {
            format!(
                "{share:.2}x {what} ({rate}): above that yardstick, measured before the runs under other \
                 load, so it is no limit here"
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Yardstick;

    #[test]
    fn a_yardstick_exceeded_is_never_a_percentage() {
        let one = Yardstick { bytes_per_s: 4.67e9, streams: 1 };
        assert_eq!(one.read(0.5), "50% of what one raw TCP stream carries (4.67 GB/s)");
        let over = one.read(1.23);
        assert!(over.starts_with("1.23x what one raw TCP stream carries") && !over.contains('%'), "{over}");
        let many = Yardstick { bytes_per_s: 2e10, streams: 8 }.read(1.1);
        assert!(many.contains("8 raw TCP streams at once carry") && !many.contains('%'), "{many}");
    }
}
