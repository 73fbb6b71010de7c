//! The record of runs on emulated links (`cluster.json`): which link each run of a run
//! directory had. `gradsync-bench cluster` writes it; `plot` reads it for the report's cluster
//! section, so the comparison's code never reaches into the cluster runner.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::net::Queue;
use super::scenario::ModeKind;

/// The file in a run directory naming each run's emulated link.
pub const CLUSTER_FILE: &str = "cluster.json";

/// The file in a dilated cluster's run directory saying, per link rate, the factor it ran at,
/// how `auto` chose it and what the self-check found.
pub const DILATION_FILE: &str = "dilation.json";

/// The folder of a run directory holding the runs that checked it (the self-check at twice
/// the factor, `auto`'s probes): a comparison of their own, never read as the run's cells.
pub const CHECKS_DIR: &str = "checks";

/// One link rate of a dilated cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DilationRecord {
    /// The link rate, Gbit/s.
    pub rate_gbit: f64,
    /// The factor its runs ran at.
    pub dilation: f64,
    /// The designs that ran at factors of their own instead (`dilate_for`: the report's
    /// design name, its factor).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub designs: std::collections::BTreeMap<String, f64>,
    /// How `dilate = auto` chose it (none: given).
    pub probe: Option<Probe>,
    /// The self-check at twice the factor (none where no run finished to check).
    pub check: Option<Check>,
}

/// What `dilate = auto`'s probe saw.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The trial factor of the probe runs that decided.
    pub at: f64,
    /// The busiest probe's share of the cores busy.
    pub busy: f64,
    /// Which probe run that was.
    pub busiest: String,
    /// The factor chosen.
    pub chose: f64,
    /// Whether the cap held it below the factor the probe asked for.
    pub capped: bool,
}

/// The self-check of one rate: a run repeated at twice the factor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// The run checked (`runs/<id>`).
    pub id: String,
    /// The factor of the repetition: twice the checked run's own (absent in records made
    /// before designs had factors of their own: twice the rate's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<f64>,
    /// Its repetition at twice the factor (`checks/runs/<id>`).
    pub again: String,
    /// The run's mean step time (emulated), ms.
    pub step_ms: Option<f64>,
    /// The repetition's, ms.
    pub step_ms_2x: Option<f64>,
    /// Whether they differ by more than the tolerance (or one has no step time): the factor
    /// was too small and the rate's runs are not ranked.
    pub differs: bool,
    /// For an asynchronous run (checked only where its rate has no synchronous one): its
    /// pushes' overlap at the servers ([`crate::results::push_overlap`]) at the factor and
    /// at twice it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_overlap: Option<(f64, f64)>,
}

/// How far the two overlaps of an asynchronous check may be apart before its workers count as
/// having fallen into another phase: in phase they are near 1, taking turns near 0.
const PHASE_SHIFT: f64 = 0.25;

impl Check {
    /// Whether the asynchronous run and its repetition found their workers in different
    /// phases, which then, not the cores, set their step times apart.
    pub fn phase_changed(&self) -> bool {
        self.push_overlap.is_some_and(|(a, b)| (a - b).abs() > PHASE_SHIFT)
    }

    /// The difference of the step at twice the factor from the step at the factor, percent.
    pub fn diff_pct(&self) -> Option<f64> {
        Some((self.step_ms_2x? - self.step_ms?) / self.step_ms? * 100.0)
    }
}

/// The dilated rates recorded in `dir` ([`DILATION_FILE`]; none for an undilated run).
pub fn load_dilation(dir: &std::path::Path) -> Vec<DilationRecord> {
    std::fs::read_to_string(dir.join(DILATION_FILE))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// One run's emulated link, as recorded in `cluster.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterRun {
    /// The run's id (`runs/<id>`), as in `outcomes.jsonl`.
    pub id: String,
    /// Mode.
    pub mode: ModeKind,
    /// Workers.
    pub workers: usize,
    /// Server shards (0: none).
    pub shards: usize,
    /// Its shards on worker hosts, shard `i` on worker host `i` (runs recorded before the
    /// choice existed had them on hosts of their own).
    #[serde(default)]
    pub colocated: bool,
    /// Workers on each worker host.
    #[serde(default = "one")]
    pub ranks_per_host: usize,
    /// Hosts in the cluster.
    pub hosts: usize,
    /// Link rate, Gbit/s.
    pub rate_gbit: f64,
    /// What one plain TCP stream carried between two of the run's hosts over their shaped
    /// links, measured on the run's cluster just before the run, Gbit/s (absent in runs made
    /// before it was measured, and where measuring failed).
    #[serde(default)]
    pub measured_gbit: Option<f64>,
    /// Half the round trip of an 8-byte message between the same two hosts, measured with the
    /// bandwidth, microseconds (absent as `measured_gbit` is): the cost model's latency.
    #[serde(default)]
    pub measured_latency_us: Option<f64>,
    /// Delay per direction per link, microseconds.
    pub delay_us: u64,
    /// Loss per direction per link, percent.
    pub loss_pct: f64,
    /// How each NIC's queue shared the link among peers (runs recorded before the choice
    /// existed had one FIFO).
    #[serde(default = "fifo")]
    pub queue: Queue,
    /// The time dilation the run ran under (1: none): its link was shaped at `rate_gbit` /
    /// this, and its metrics are already divided back by it.
    #[serde(default = "undilated")]
    pub dilation: f64,
}

fn undilated() -> f64 {
    1.0
}

fn fifo() -> Queue {
    Queue::Fifo
}

impl ClusterRun {
    /// The link as the report names it, which groups runs (so ranks sharing hosts are a
    /// group of their own): `1 Gbit/s`, `0.1 Gbit/s, 50 us delay, 0.1% loss`, `10 Gbit/s, 2
    /// ranks a host`, `25 Gbit/s, one FIFO a NIC` (fair queues go unsaid). The dilation is
    /// not part of it: runs of one link at factors of their own (`dilate_for`) emulate the same
    /// link, and each run's factor is said beside it.
    pub fn label(&self) -> String {
        let mut s = format!("{} Gbit/s", self.rate_gbit);
        if self.ranks_per_host > 1 {
            s += &format!(", {} ranks a host", self.ranks_per_host);
        }
        if self.delay_us > 0 {
            s += &format!(", {} us delay", self.delay_us);
        }
        if self.loss_pct > 0.0 {
            s += &format!(", {}% loss", self.loss_pct);
        }
        if self.queue == Queue::Fifo {
            s += ", one FIFO a NIC";
        }
        s
    }
}

/// The runs with emulated links recorded in `dirs` (ids prefixed like
/// [`super::results::collect`] prefixes them when given several directories).
pub fn load(dirs: &[PathBuf]) -> Vec<ClusterRun> {
    let mut all = Vec::new();
    for d in dirs {
        let Ok(text) = std::fs::read_to_string(d.join(CLUSTER_FILE)) else { continue };
        let Ok(runs) = serde_json::from_str::<Vec<ClusterRun>>(&text) else {
            eprintln!(
                "gradsync-bench plot: warning: {} is not a list of cluster runs",
                d.join(CLUSTER_FILE).display()
            );
            continue;
        };
        let prefix = if dirs.len() > 1 {
            d.file_name().map(|n| format!("{}/", n.to_string_lossy())).unwrap_or_default()
        } else {
            String::new()
        };
        all.extend(runs.into_iter().map(|mut r| {
            r.id = format!("{prefix}{}", r.id);
            r
        }));
    }
    all
}

fn one() -> usize {
    1
}
