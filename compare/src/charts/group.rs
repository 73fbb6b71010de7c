//! What the charts are drawn from: the runs split into groups (one model at one global batch),
//! and the series each chart reads out of a group.

use std::collections::BTreeMap;

use super::super::results::{Cell, Collected, EvalPoint, RunData, Summary, median};
use super::super::scenario::ModeKind;
use super::workers;

/// The figures of one chart group: one model at one global batch.
#[derive(Debug, Clone)]
pub struct Group<'a> {
    /// Suffix of the file names (empty for the only group).
    pub suffix: String,
    /// The network trained (`MLP 64-1024-1024-10`), or its preset when the widths are unknown.
    pub model: String,
    /// Global batch.
    pub global_batch: usize,
    /// The emulated link its runs crossed (see [`Summary::link`]); empty on loopback.
    pub link: String,
    /// Parameters of the model.
    pub params: usize,
    /// Summaries of its runs with figures.
    pub rows: Vec<&'a Summary>,
    /// Its runs' metrics.
    pub runs: Vec<&'a RunData>,
    /// The straggler sweep: every run with figures, delayed or not (`rows` and `runs` hold
    /// only the undelayed ones, so the other charts compare like with like).
    pub sweep: Vec<&'a Summary>,
    /// The undelayed cells behind `rows` (same order), with their repeats' ranges.
    pub cells: Vec<&'a Cell>,
    /// The accuracy time-to-target is measured to.
    pub target: Option<f64>,
}

impl Group<'_> {
    /// Gradient bytes per step (f32).
    pub fn grad_bytes(&self) -> f64 {
        self.params as f64 * 4.0
    }

    /// Whether the group's model is replayed (speed only: no accuracy, no loss).
    pub fn replay(&self) -> bool {
        self.rows.iter().any(|r| r.widths.starts_with(gradsync_core::model::REPLAY_TOKEN))
    }

    /// Samples/s of the one-worker baseline: the local run, else the fastest one-worker run.
    pub fn baseline(&self) -> Option<f64> {
        let local = self.rows.iter().find(|r| r.mode == "local").and_then(|r| r.samples_per_s);
        local.or_else(|| {
            self.rows.iter().filter(|r| r.workers == 1).filter_map(|r| r.samples_per_s).reduce(f64::max)
        })
    }

    /// Series key of a row: the mode, with the shard count for PS modes and the wire its
    /// traffic crosses, so no label compares two wires unannounced.
    pub fn series(r: &Summary) -> String {
        let wire = r.mode.parse::<ModeKind>().map(ModeKind::wire).unwrap_or("");
        let name = r.design();
        match wire {
            "" | "none" => name,
            w => format!("{name} ({w})"),
        }
    }

    /// The cell behind a row of `rows`.
    pub fn cell_of(&self, r: &Summary) -> Option<&Cell> {
        self.cells.iter().copied().find(|c| std::ptr::eq(&c.median, r))
    }

    /// Per cell with a convergence curve: the median held-out accuracy and training time at
    /// each evaluation point over its complete repeats, at the cadence they share.
    pub fn accuracy_curves(&self) -> Vec<(&Summary, Vec<EvalPoint>)> {
        self.cells
            .iter()
            .map(|c| {
                let curves: Vec<Vec<EvalPoint>> =
                    self.runs.iter().filter(|r| c.runs.contains(&r.id)).map(|r| r.accuracy_curve()).collect();
                let mut at: BTreeMap<u64, Vec<EvalPoint>> = BTreeMap::new();
                for p in curves.iter().flatten() {
                    at.entry(p.samples).or_default().push(*p);
                }
                let pts = at
                    .into_iter()
                    .filter(|(_, v)| 2 * v.len() > curves.len())
                    .filter_map(|(samples, v)| {
                        let m = |g: fn(&EvalPoint) -> f64| median(&v.iter().map(g).collect::<Vec<_>>());
                        Some(EvalPoint {
                            samples,
                            epoch: m(|p| p.epoch)?,
                            train_s: m(|p| p.train_s)?,
                            accuracy: m(|p| p.accuracy)?,
                            loss: m(|p| p.loss).unwrap_or(f64::NAN),
                        })
                    })
                    .collect();
                (&c.median, pts)
            })
            .filter(|(_, p): &(&Summary, Vec<EvalPoint>)| !p.is_empty())
            .collect()
    }

    /// Rows by series, in mode order then shard count, each sorted by workers.
    pub fn by_series(&self) -> Vec<(String, Vec<&Summary>)> {
        let mut m: BTreeMap<(usize, usize, String), Vec<&Summary>> = BTreeMap::new();
        for r in &self.rows {
            let order = ModeKind::ALL.iter().position(|k| k.label() == r.mode).unwrap_or(99);
            m.entry((order, r.shards, Self::series(r))).or_default().push(r);
        }
        m.into_iter()
            .map(|((_, _, k), mut v)| {
                v.sort_by_key(|r| r.workers);
                (k, v)
            })
            .collect()
    }

    /// The TCP ring's measured exchanges as (ranks, gradient bytes, seconds per step), for
    /// fitting the ring model.
    pub fn ring_points(&self) -> Vec<(usize, f64, f64)> {
        self.rows
            .iter()
            .filter(|r| r.mode == "ddp-tcp" && r.workers > 1)
            .filter_map(|r| Some((r.workers, self.grad_bytes(), r.comm_ms? / 1e3)))
            .collect()
    }

    /// The straggler sweep per series (mode, workers, shards): (injected ms, slowdown) points
    /// sorted by delay, where the slowdown is the time per global step (global batch over
    /// samples/s) with the delay over the same without it. Series without an undelayed run or
    /// without a delayed one are left out.
    pub fn slowdowns(&self) -> Vec<Slowdown<'_>> {
        let mut m: BTreeMap<(usize, usize, usize), Vec<&Summary>> = BTreeMap::new();
        for r in &self.sweep {
            let order = ModeKind::ALL.iter().position(|k| k.label() == r.mode).unwrap_or(99);
            m.entry((order, r.workers, r.shards)).or_default().push(r);
        }
        m.into_values()
            .filter_map(|v| {
                let base = v.iter().find(|r| r.slow_ms == 0)?.samples_per_s?;
                let mut pts: Vec<(f64, f64)> =
                    v.iter().filter_map(|r| Some((r.slow_ms as f64, base / r.samples_per_s?))).collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (pts.len() > 1).then(|| {
                    let r = v[0];
                    Slowdown {
                        name: format!("{} ({})", Self::series(r), workers(r.workers)),
                        mode: r.mode.as_str(),
                        workers: r.workers,
                        shards: r.shards,
                        points: pts,
                        // (A cell's median row counts its complete repeats.)
                        repeated: v.iter().all(|r| r.repeat > 1),
                    }
                })
            })
            .collect()
    }

    /// Seconds per global step of an undelayed series, for converting slowdowns to ms.
    pub fn undelayed_step_s(&self, mode: &str, workers: usize, shards: usize) -> Option<f64> {
        let r = self
            .sweep
            .iter()
            .find(|r| r.mode == mode && r.workers == workers && r.shards == shards && r.slow_ms == 0)?;
        Some(r.global_batch as f64 / r.samples_per_s?)
    }

    /// For each mode, its run at the most workers (fewest shards on a tie).
    pub fn widest_per_mode(&self) -> Vec<&RunData> {
        let mut best: BTreeMap<ModeKind, &RunData> = BTreeMap::new();
        for r in &self.runs {
            let e = best.entry(r.mode).or_insert(r);
            if (r.world(), std::cmp::Reverse(r.shards())) > (e.world(), std::cmp::Reverse(e.shards())) {
                *e = r;
            }
        }
        best.into_values().collect()
    }
}

/// One series of the straggler sweep.
#[derive(Debug, Clone)]
pub struct Slowdown<'a> {
    /// Legend name: mode, shards, workers.
    pub name: String,
    /// Mode label.
    pub mode: &'a str,
    /// Workers.
    pub workers: usize,
    /// Server shards (0: none).
    pub shards: usize,
    /// (injected ms, slowdown), sorted by delay; the first is (0, 1).
    pub points: Vec<(f64, f64)>,
    /// Whether every point's cell has two or more complete repeats (what ranking needs).
    pub repeated: bool,
}

/// Split the summaries into chart groups (model x global batch x emulated link), with their
/// runs.
/// Only complete runs take part: each group's rows are its cells' medians over their complete
/// repeats, and its runs the complete ones.
pub fn groups(c: &Collected) -> Vec<Group<'_>> {
    let cells: Vec<&Cell> = c.cells.iter().filter(|x| x.median.samples_per_s.is_some()).collect();
    let mut keys: Vec<(String, usize, String)> = cells
        .iter()
        .map(|x| (x.median.model.clone(), x.median.global_batch, x.median.link.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    let many = keys.len() > 1;
    keys.into_iter()
        .map(|(model, gb, link)| {
            let mine: Vec<&Cell> = cells
                .iter()
                .copied()
                .filter(|x| x.median.model == model && x.median.global_batch == gb && x.median.link == link)
                .collect();
            let sweep: Vec<&Summary> = mine.iter().map(|x| &x.median).collect();
            let undelayed: Vec<&Cell> = mine.iter().copied().filter(|x| x.median.slow_ms == 0).collect();
            let rows: Vec<&Summary> = undelayed.iter().map(|x| &x.median).collect();
            let runs = c.runs.iter().filter(|d| undelayed.iter().any(|x| x.runs.contains(&d.id))).collect();
            Group {
                sweep,
                suffix: match (many, link.is_empty()) {
                    (false, _) => String::new(),
                    (true, true) => format!("-{model}-b{gb}"),
                    (true, false) => {
                        let slug: String = link.chars().filter(char::is_ascii_alphanumeric).collect();
                        format!("-{model}-b{gb}-{}", slug.to_lowercase())
                    }
                },
                params: rows.iter().map(|r| r.params).max().unwrap_or(0),
                // The shape trained, not the preset's name: a preset fitted to another data
                // set's input and classes (mnist on the 8x8 digits) is another network.
                model: {
                    let shape = rows
                        .first()
                        .filter(|r| !r.widths.is_empty())
                        .map_or(model, |r| gradsync_core::model::label_of(&r.widths));
                    if link.is_empty() { shape } else { format!("{shape} on emulated links of {link}") }
                },
                link,
                global_batch: gb,
                rows,
                runs,
                cells: undelayed,
                target: c.target,
            }
        })
        .collect()
}
