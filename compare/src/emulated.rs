//! The record of runs on emulated links (`cluster.json`): which link each run of a run
//! directory had. `gradsync-bench cluster` writes it; `plot` reads it for the report's cluster
//! section, so the comparison's code never reaches into the cluster runner.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::scenario::ModeKind;

/// The file in a run directory naming each run's emulated link.
pub const CLUSTER_FILE: &str = "cluster.json";

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
}

impl ClusterRun {
    /// The link as the report names it: `1 Gbit/s`, `0.1 Gbit/s, 50 us delay, 0.1% loss`.
    pub fn label(&self) -> String {
        let mut s = format!("{} Gbit/s", self.rate_gbit);
        if self.delay_us > 0 {
            s += &format!(", {} us delay", self.delay_us);
        }
        if self.loss_pct > 0.0 {
            s += &format!(", {}% loss", self.loss_pct);
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
