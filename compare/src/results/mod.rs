//! From metrics files to results: discover every process's file by walking directories, parse
//! it (a bad line is reported with its path and line number and skipped), group the files into
//! runs by their headers and timing, and reduce each run to one row of figures. Everything is
//! sorted, so identical input gives identical output.
//!
//! Here: what a run reduces to ([`Summary`], a matrix cell of repeats [`Cell`], the curves),
//! and the statistics over repeats. `collect`: finding, reading and grouping the files, and
//! writing the merged outputs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use gradsync_core::metrics::{Header, Record, ServerApply, Step, parse_line};
use serde::{Deserialize, Serialize};

use super::scenario::ModeKind;

mod collect;

#[cfg(test)]
use collect::common_dir;
pub use collect::{collect, write_merged};

/// Files the runner writes beside the metrics that are not metrics.
const NOT_METRICS: [&str; 2] = ["runs.jsonl", "outcomes.jsonl"];

/// One process's metrics file.
#[derive(Debug, Clone)]
pub struct MetricsFile {
    /// Its path, relative to the directory it was found under (prefixed by that directory's
    /// name when several are read).
    pub rel: String,
    /// The header.
    pub header: Header,
    /// Step records.
    pub steps: Vec<Step>,
    /// Server updates.
    pub applies: Vec<ServerApply>,
}

impl MetricsFile {
    fn is_server(&self) -> bool {
        self.header.mode == "server"
    }

    fn start(&self) -> f64 {
        self.header.start_unix_ms as f64
    }

    /// When its process last recorded, on the machine's clock: the start plus the last
    /// record's `wall_ms`, which a dilated run records in the emulated world's time (divided
    /// by its factor), so multiplied back here.
    fn end(&self) -> f64 {
        let last = self
            .steps
            .iter()
            .map(|s| s.wall_ms)
            .chain(self.applies.iter().map(|a| a.wall_ms))
            .fold(0.0, f64::max);
        self.start() + last * self.header.dilation.unwrap_or(1.0)
    }
}

/// How the runner recorded a run (`outcomes.jsonl`), joined to the metrics by `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The run's directory relative to the run root, e.g. `runs/003-ps-bsp-w2-mnist-b128-k1`.
    pub id: String,
    /// Mode label.
    pub mode: ModeKind,
    /// Workers.
    pub workers: usize,
    /// Model preset or widths.
    pub model: String,
    /// Global batch.
    pub global_batch: usize,
    /// Server shards (0: none).
    pub shards: usize,
    /// Injected straggler delay, ms per step (0: none).
    #[serde(default)]
    pub slow_ms: u64,
    /// Which repeat of its cell, from 0.
    #[serde(default)]
    pub repeat: usize,
    /// `ok`, `diverged`, `stopped` (time budget), `failed`, `skipped` or `interrupted`.
    pub status: String,
    /// Why it failed or was skipped.
    pub error: Option<String>,
    /// Seconds the run took, processes' start-up included.
    pub seconds: f64,
    /// The CPU seconds its processes used, start-up included (this machine's children only;
    /// absent for processes on other hosts).
    #[serde(default)]
    pub cpu_s: Option<f64>,
    /// How busy the machine's cores were while its steps ran (from rank 0's first step to its
    /// last, `/proc/stat`: `exec::Steady`), or, for a run too short for that, its processes' CPU time over the
    /// whole run's wall time times the cores.
    #[serde(default)]
    pub cpu_busy: Option<f64>,
    /// Each time the run's workers were restarted after a failure (`max_restarts`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarts: Vec<Restart>,
}

/// One restart of a run's workers: what failed, and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Restart {
    /// The worker rank that failed first (DP: the one process).
    pub rank: usize,
    /// How it ended, as the runner saw it (`signal: 9 (SIGKILL)`).
    pub exit: String,
    /// Whether the runner killed it (the scenario's `kills`) rather than it failing by itself.
    pub injected: bool,
    /// The last step rank 0 had recorded when the failure was seen.
    pub step_reached: u64,
    /// The step the restarted workers continued after: the step before rank 0's first new
    /// one (its newest checkpoint's, 0 when there was none; a PS worker under BSP continues at
    /// the servers' version). Unknown when rank 0 ran on another host or recorded no new step.
    pub resumed_after: Option<u64>,
    /// Seconds from the failure (the kill, for an injected one) to the first step recorded by
    /// the restarted rank 0: the wall time the restart cost, beside the steps computed again.
    pub lost_s: Option<f64>,
}

impl Restart {
    /// Steps computed a second time: those between the checkpoint resumed from and the step
    /// reached.
    pub fn recomputed(&self) -> Option<u64> {
        self.resumed_after.map(|c| self.step_reached.saturating_sub(c))
    }
}

/// The metrics of one run: its worker files and its server files.
#[derive(Debug, Clone)]
pub struct RunData {
    /// Directory of its files (relative), unique.
    pub id: String,
    /// Mode.
    pub mode: ModeKind,
    /// Worker processes' files (one for DP).
    pub workers: Vec<MetricsFile>,
    /// Server shards' files.
    pub servers: Vec<MetricsFile>,
}

impl RunData {
    /// The header of rank 0 (or the first worker).
    pub fn header(&self) -> &Header {
        &self.workers[0].header
    }

    /// Worker count (ranks or replicas).
    pub fn world(&self) -> usize {
        self.header().world_size.max(1)
    }

    /// Server shards: the server files found, else the header's `servers` list.
    pub fn shards(&self) -> usize {
        if !self.servers.is_empty() {
            return self.servers.len();
        }
        match self.header().extra.get("servers") {
            Some(serde_json::Value::Array(a)) => a.len(),
            Some(serde_json::Value::Number(n)) => n.as_u64().unwrap_or(0) as usize,
            _ => 0,
        }
    }

    /// Mean training loss over ranks, per step, with the latest wall time (s) of that step.
    pub fn loss_curve(&self) -> Vec<(u64, f64, f64)> {
        let mut by_step: BTreeMap<u64, (f64, usize, f64)> = BTreeMap::new();
        for f in &self.workers {
            for s in &f.steps {
                let e = by_step.entry(s.step).or_insert((0.0, 0, 0.0));
                e.0 += s.loss;
                e.1 += 1;
                e.2 = e.2.max(s.wall_ms / 1e3);
            }
        }
        by_step.into_iter().map(|(k, (l, n, w))| (k, l / n as f64, w)).collect()
    }

    /// Rank 0's held-out evaluations in order (the first worker file's; under ASP/SSP rank 0's
    /// parameters are the servers' at the version it last pulled).
    pub fn accuracy_curve(&self) -> Vec<EvalPoint> {
        let Some(f) = self.workers.first() else { return vec![] };
        let h = &f.header;
        let train = h.extra.get("train_samples").and_then(serde_json::Value::as_u64);
        f.steps
            .iter()
            .filter_map(|s| {
                Some(EvalPoint {
                    samples: s.samples,
                    epoch: match train {
                        Some(n) if n > 0 => s.samples as f64 / n as f64,
                        _ => s.epoch as f64,
                    },
                    train_s: clock(s) / 1e3,
                    accuracy: s.accuracy?,
                    loss: s.eval_loss.unwrap_or(f64::NAN),
                })
            })
            .collect()
    }

    /// The injected straggler delay (`--slow-rank`), ms per step, from the workers' header.
    pub fn slow_ms(&self) -> u64 {
        self.header().extra.get("slow_ms").and_then(serde_json::Value::as_u64).unwrap_or(0)
    }

    /// Staleness values seen: the workers' per-step figures, else the servers' per-gradient
    /// figures.
    pub fn staleness(&self) -> Vec<u64> {
        let w: Vec<u64> =
            self.workers.iter().flat_map(|f| f.steps.iter().filter_map(|s| s.staleness)).collect();
        if !w.is_empty() {
            return w;
        }
        self.servers.iter().flat_map(|f| f.applies.iter().flat_map(|a| a.staleness.iter().copied())).collect()
    }
}

/// One row of `summary.csv`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Run id (its directory).
    pub id: String,
    /// The restarts of its workers after failures (from the runner's record; not a column).
    #[serde(skip)]
    pub restarts: Vec<Restart>,
    /// Mode label.
    pub mode: String,
    /// Workers.
    pub workers: usize,
    /// Server shards (0: none).
    pub shards: usize,
    /// Model preset.
    pub model: String,
    /// Layer widths.
    pub widths: String,
    /// DDP's and ZeRO-1's bucket size, MB (from the header's `bucket_values`).
    #[serde(skip)]
    pub bucket_mb: Option<f64>,
    /// Parameters.
    pub params: usize,
    /// Global batch.
    pub global_batch: usize,
    /// Batch per worker.
    pub batch: usize,
    /// `ok`, `diverged`, `stopped`, `failed`, `skipped`, `interrupted`, or, for metrics
    /// without a runner record, `ok` when every worker reached its planned steps and `partial`
    /// otherwise.
    pub status: String,
    /// Why it failed.
    pub error: String,
    /// Steps every worker completed.
    pub steps: u64,
    /// Samples per second over all workers, first step (warm-up) excluded.
    pub samples_per_s: Option<f64>,
    /// Mean step time, ms.
    pub step_ms: Option<f64>,
    /// Mean forward, ms.
    pub forward_ms: Option<f64>,
    /// Mean backward, ms.
    pub backward_ms: Option<f64>,
    /// Mean communication (overlapped or not), ms.
    pub comm_ms: Option<f64>,
    /// Mean exposed communication, ms.
    pub comm_exposed_ms: Option<f64>,
    /// Mean wait, ms.
    pub wait_ms: Option<f64>,
    /// Mean update, ms.
    pub update_ms: Option<f64>,
    /// Step time not in any of the above, ms.
    pub other_ms: Option<f64>,
    /// Mean bytes sent + received per step per worker.
    pub bytes_per_step_worker: Option<f64>,
    /// Mean bytes sent per step per worker (a PS worker's pushes, as encoded on the wire).
    pub bytes_sent_per_step_worker: Option<f64>,
    /// Bytes in + out per worker step at all servers together.
    pub bytes_per_step_server: Option<f64>,
    /// Mean table rows per step per worker, where the steps record them: the rows a PS or
    /// hybrid worker pushed, the union DDP's all-gather summed.
    pub rows_per_step: Option<f64>,
    /// Mean training loss over ranks at the last step.
    pub final_loss: Option<f64>,
    /// Held-out accuracy at the end.
    pub final_accuracy: Option<f64>,
    /// Mean staleness (PS).
    pub staleness_mean: Option<f64>,
    /// Largest staleness (PS).
    pub staleness_max: Option<u64>,
    /// ASP and SSP: the share of the pushes' arrival time at a server during which another
    /// rank's push arrived there too ([`push_overlap`]): near 1 the workers push in phase,
    /// each push sharing the server's link; near 0 they take turns.
    pub push_overlap: Option<f64>,
    /// Wall-clock seconds of the training loop (longest rank).
    pub train_s: Option<f64>,
    /// Injected straggler delay of one rank, ms per step (0: none).
    pub slow_ms: u64,
    /// Which repeat of its cell, from 0.
    pub repeat: usize,
    /// Best held-out accuracy rank 0 measured.
    pub best_accuracy: Option<f64>,
    /// Training-clock seconds (evaluation left out) until rank 0 first measured the target
    /// accuracy; empty when never reached or no target was set.
    pub time_to_target_s: Option<f64>,
    /// Samples seen by all workers together by then.
    pub samples_to_target: Option<u64>,
    /// Epochs over the training split by then.
    pub epochs_to_target: Option<f64>,
    /// The emulated link the run crossed (`1 Gbit/s`, with its delay and loss where set, as
    /// `cluster.json` records it); empty on loopback. Runs on different links are never
    /// repeats of one cell.
    pub link: String,
    /// How busy the machine's cores were over the run ([`Outcome::cpu_busy`]), where its
    /// runner measured it.
    pub cpu_busy: Option<f64>,
    /// The time dilation the run ran under (its header's; none: undilated). Its figures are
    /// already the emulated world's.
    pub dilation: Option<f64>,
    /// Under dilation: by how much its compute phases overran D times their CPU time, as a
    /// share of its compute (the cores were short for the factor).
    pub overrun_share: Option<f64>,
    /// Under dilation: its link rate's self-check at twice the factor differed by more than
    /// its tolerance (`dilation.json`): the factor was too small.
    pub dilation_too_small: bool,
    /// The CPU seconds its processes used (this machine's children only), where measured.
    pub cpu_s: Option<f64>,
    /// Its shards sat on worker hosts, one a host (an emulated cluster's `--servers
    /// colocated`, as `cluster.json` records it): a design of its own, never a repeat of the
    /// same shards apart.
    pub colocated: bool,
}

/// The share of the asynchronous pushes' arrival time (each server's records of them, one
/// slice a shard) during which another rank's push was arriving at the same server: each push
/// arrived over `[end - receive_ms, end]`, `end` being its update's `wall_ms - apply_ms`. None
/// where no update recorded its arrival (BSP, a sparse table, an older server).
///
/// Two asynchronous workers whose steps are all communication fall into one of two phases
/// and stay there: pushing together, each push at half the server's link and the step twice
/// as long (near 1), or one pushing while the other pulls (near 0). Which one a run finds is
/// timing: measured, the same cell of ASP found the first at x8 and the second at x4.
pub fn push_overlap<'a>(shards: impl Iterator<Item = &'a [ServerApply]>) -> Option<f64> {
    let (mut covered, mut total) = (0.0, 0.0);
    for applies in shards {
        let mut pushes: Vec<(f64, f64, usize)> = applies
            .iter()
            .filter_map(|a| {
                let end = a.wall_ms - a.apply_ms;
                Some((end - a.receive_ms?, end, *a.ranks.first()?))
            })
            .collect();
        pushes.sort_by(|a, b| a.0.total_cmp(&b.0));
        let longest = pushes.iter().map(|p| p.1 - p.0).fold(0.0, f64::max);
        for (i, &(s, e, rank)) in pushes.iter().enumerate() {
            // Other ranks' pushes that overlap this one start within `longest` before it.
            let mut others: Vec<(f64, f64)> = pushes[..i]
                .iter()
                .rev()
                .take_while(|p| p.0 >= s - longest)
                .chain(pushes[i + 1..].iter().take_while(|p| p.0 < e))
                .filter(|p| p.2 != rank && p.1 > s && p.0 < e)
                .map(|p| (p.0.max(s), p.1.min(e)))
                .collect();
            others.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut reach = s;
            for (a, b) in others {
                covered += (b - a.max(reach)).max(0.0);
                reach = reach.max(b);
            }
            total += e - s;
        }
    }
    (total > 0.0).then(|| covered / total)
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

impl Summary {
    /// The figures of one run. Step 1 is left out of the means (allocation, connection set-up)
    /// whenever there are later steps.
    pub fn of(run: &RunData, target: Option<f64>) -> Summary {
        let h = run.header();
        let steady = |f: &MetricsFile| -> Vec<Step> {
            let skip = usize::from(f.steps.len() > 1);
            f.steps.iter().skip(skip).cloned().collect()
        };
        let all: Vec<Step> = run.workers.iter().flat_map(steady).collect();
        let field = |g: fn(&Step) -> f64| mean(all.iter().map(g));
        let step_ms = field(|s| s.step_ms);
        let parts = [
            field(|s| s.forward_ms),
            field(|s| s.backward_ms),
            field(|s| s.comm_exposed_ms),
            field(|s| s.wait_ms),
            field(|s| s.update_ms),
        ];
        let other = step_ms.map(|t| (t - parts.iter().flatten().sum::<f64>()).max(0.0));
        // Each worker file accounts for an equal share of the global batch (the whole of it
        // for DP's single process).
        let per_file = h.global_batch as f64 / run.workers.len() as f64;
        let rates: Vec<f64> = run
            .workers
            .iter()
            .filter_map(|f| {
                let (first, last) = (f.steps.first()?, f.steps.last()?);
                // The training clock: evaluation pauses are not throughput.
                let (t0, t1) = (clock(first), clock(last));
                if f.steps.len() > 1 && t1 > t0 {
                    Some(per_file * (f.steps.len() - 1) as f64 / ((t1 - t0) / 1e3))
                } else if first.step_ms > 0.0 {
                    Some(per_file / (first.step_ms / 1e3))
                } else {
                    None
                }
            })
            .collect();
        let steps = run.workers.iter().map(|f| f.steps.last().map_or(0, |s| s.step)).min().unwrap_or(0);
        let curve = run.loss_curve();
        let stale = run.staleness();
        let worker_steps: usize = run.workers.iter().map(|f| f.steps.len()).sum();
        let server_bytes: u64 =
            run.servers.iter().flat_map(|f| f.applies.iter().map(|a| a.bytes_in + a.bytes_out)).sum();
        let worker_steps_per_rank = worker_steps as f64 / run.workers.len() as f64;
        let curve_acc = run.accuracy_curve();
        let reached = target.and_then(|t| curve_acc.iter().find(|p| p.accuracy >= t));
        Summary {
            id: run.id.clone(),
            // From the runner's record (`collect`).
            restarts: Vec::new(),
            mode: run.mode.label().into(),
            workers: run.world(),
            shards: run.shards(),
            // A replay of a model is another row than the model trained for real, even under
            // the same name.
            model: if h.widths.starts_with(gradsync_core::model::REPLAY_TOKEN) {
                gradsync_core::model::label_of(&h.widths)
            } else {
                h.preset.clone()
            },
            widths: h.widths.clone(),
            bucket_mb: h
                .extra
                .get("bucket_values")
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as f64 * 4.0 / f64::from(1 << 20)),
            params: h.params,
            global_batch: h.global_batch,
            batch: h.batch,
            // Without a runner's record: complete when every worker reached the steps it
            // planned (a run by hand, collected from its hosts), else partial.
            status: if planned(run).is_some_and(|p| p > 0 && steps >= p) { "ok" } else { "partial" }.into(),
            error: String::new(),
            steps,
            samples_per_s: (!rates.is_empty()).then(|| rates.iter().sum()),
            step_ms,
            forward_ms: parts[0],
            backward_ms: parts[1],
            comm_ms: field(|s| s.comm_ms),
            comm_exposed_ms: parts[2],
            wait_ms: parts[3],
            update_ms: parts[4],
            other_ms: other,
            bytes_per_step_worker: field(|s| (s.bytes_sent + s.bytes_recv) as f64),
            bytes_sent_per_step_worker: field(|s| s.bytes_sent as f64),
            bytes_per_step_server: (!run.servers.is_empty() && worker_steps > 0)
                .then(|| server_bytes as f64 / worker_steps_per_rank),
            rows_per_step: mean(all.iter().filter_map(|s| s.rows.map(|r| r as f64))),
            final_loss: curve.last().map(|c| c.1),
            final_accuracy: run
                .workers
                .iter()
                .flat_map(|f| f.steps.iter().rev().find_map(|s| s.accuracy))
                .next(),
            staleness_mean: mean(stale.iter().map(|&s| s as f64)),
            staleness_max: stale.iter().copied().max(),
            push_overlap: push_overlap(run.servers.iter().map(|f| f.applies.as_slice())),
            train_s: run
                .workers
                .iter()
                .filter_map(|f| f.steps.last().map(|s| clock(s) / 1e3))
                .reduce(f64::max),
            slow_ms: run.slow_ms(),
            repeat: 0,
            best_accuracy: run.accuracy_curve().iter().map(|p| p.accuracy).reduce(f64::max),
            time_to_target_s: reached.map(|p| p.train_s),
            samples_to_target: reached.map(|p| p.samples),
            epochs_to_target: reached.map(|p| p.epoch),
            link: String::new(),
            cpu_busy: None,
            dilation: h.dilation,
            overrun_share: h.dilation.and_then(|_| {
                let compute: f64 = all.iter().map(|s| s.forward_ms + s.backward_ms + s.update_ms).sum();
                let over: f64 = all.iter().filter_map(|s| s.overrun_ms).sum();
                (compute > 0.0).then(|| over / compute)
            }),
            dilation_too_small: false,
            cpu_s: None,
            colocated: false,
        }
    }

    /// A row for a run that left no metrics.
    pub fn missing(o: &Outcome) -> Summary {
        Summary {
            id: o.id.clone(),
            mode: o.mode.label().into(),
            workers: o.workers,
            shards: o.shards,
            model: o.model.clone(),
            global_batch: o.global_batch,
            batch: o.global_batch / o.workers.max(1),
            status: o.status.clone(),
            error: o.error.clone().unwrap_or_default(),
            slow_ms: o.slow_ms,
            repeat: o.repeat,
            restarts: o.restarts.clone(),
            ..Summary::default()
        }
    }

    /// The design it ran, as lists name it: the mode, with the shard count for PS modes and
    /// where colocated shards sat (`ps-bsp k=4 colocated`).
    pub fn design(&self) -> String {
        crate::scenario::design_name(&self.mode, self.shards, self.colocated)
    }

    /// Whether the run finished as planned: only such runs feed charts and readings
    /// (failed, diverged, stopped, interrupted and partial runs are listed apart).
    pub fn complete(&self) -> bool {
        self.status == "ok"
    }

    /// Whether a dilated run's figures are the cores' rather than the design's: processes may
    /// outnumber the cores there, so what counts is whether the cores kept up with the factor
    /// (busy over [`REPLAY_BUSY`], compute overrunning D times its CPU time by more than
    /// [`OVERRUN_SHARE`], or its rate's check at twice the factor off).
    pub fn dilated_saturated(&self) -> bool {
        self.cpu_busy.is_some_and(|b| b > REPLAY_BUSY)
            || self.dilation_too_small
            || self.overrun_share.is_some_and(|o| o > OVERRUN_SHARE)
    }
}

/// The share of the cores a replayed run's processes may keep busy before its figures count as
/// the CPU's rather than the design's: its compute is waited out, so what keeps the cores busy
/// is the communication itself, which a saturated CPU slows.
pub const REPLAY_BUSY: f64 = 0.8;

/// The share of a dilated run's compute by which its phases may overrun D times their CPU time
/// (a thread that waited for a core) before the run counts as the cores', not the design's.
pub const OVERRUN_SHARE: f64 = 0.05;

/// The steps a run's workers planned (`extra.total_steps`), when every header says.
fn planned(run: &RunData) -> Option<u64> {
    let p: Vec<u64> = run
        .workers
        .iter()
        .map(|f| f.header.extra.get("total_steps").and_then(serde_json::Value::as_u64))
        .collect::<Option<_>>()?;
    p.iter().copied().max()
}

/// A step's time on the training clock, ms: evaluation pauses left out (older files, which
/// have no such clock, give their wall clock).
fn clock(s: &Step) -> f64 {
    s.train_ms.unwrap_or(s.wall_ms)
}

/// One held-out evaluation of rank 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalPoint {
    /// Samples seen by all workers together.
    pub samples: u64,
    /// Epochs over the training split (fractional).
    pub epoch: f64,
    /// Training-clock seconds.
    pub train_s: f64,
    /// Held-out accuracy.
    pub accuracy: f64,
    /// Held-out loss.
    pub loss: f64,
}

/// The median of `v` (empty: none).
pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// One cell of the matrix (mode, workers, shards, model, global batch, delay) over its
/// repeats: the median of each figure over the complete repeats, and the range of the two a
/// reading ranks by.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The medians, as a summary row (status `ok`, `repeat` the number of complete repeats).
    pub median: Summary,
    /// Ids of its complete repeats.
    pub runs: Vec<String>,
    /// Repeats of any status.
    pub attempts: usize,
    /// (min, max) samples/s over the complete repeats.
    pub throughput: Option<(f64, f64)>,
    /// (min, max) time-to-target over the complete repeats that reached it.
    pub time_to_target: Option<(f64, f64)>,
    /// Complete repeats that reached the target.
    pub reached: usize,
}

impl Cell {
    /// Group `rows` into cells, keeping only complete runs for the figures.
    pub fn all(rows: &[Summary]) -> Vec<Cell> {
        let mut by: BTreeMap<CellKey, Vec<&Summary>> = BTreeMap::new();
        for r in rows {
            let key = (r.model.clone(), r.global_batch, r.link.clone());
            by.entry((key, r.mode.clone(), r.workers, (r.shards, r.colocated), r.slow_ms))
                .or_default()
                .push(r);
        }
        by.into_values()
            .filter_map(|all| {
                let ok: Vec<&Summary> = all.iter().copied().filter(|r| r.complete()).collect();
                let first = *ok.first()?;
                let med = |g: fn(&Summary) -> Option<f64>| {
                    median(&ok.iter().filter_map(|r| g(r)).collect::<Vec<_>>())
                };
                let range = |g: fn(&Summary) -> Option<f64>| {
                    let v: Vec<f64> = ok.iter().filter_map(|r| g(r)).collect();
                    (!v.is_empty()).then(|| {
                        (
                            v.iter().copied().fold(f64::INFINITY, f64::min),
                            v.iter().copied().fold(0.0, f64::max),
                        )
                    })
                };
                // Time-to-target is a median only when most repeats reached it.
                let reached = ok.iter().filter(|r| r.time_to_target_s.is_some()).count();
                let most = 2 * reached > ok.len();
                let median = Summary {
                    id: first.id.clone(),
                    status: "ok".into(),
                    error: String::new(),
                    steps: ok.iter().map(|r| r.steps).min().unwrap_or(0),
                    samples_per_s: med(|r| r.samples_per_s),
                    step_ms: med(|r| r.step_ms),
                    forward_ms: med(|r| r.forward_ms),
                    backward_ms: med(|r| r.backward_ms),
                    comm_ms: med(|r| r.comm_ms),
                    comm_exposed_ms: med(|r| r.comm_exposed_ms),
                    wait_ms: med(|r| r.wait_ms),
                    update_ms: med(|r| r.update_ms),
                    other_ms: med(|r| r.other_ms),
                    bytes_per_step_worker: med(|r| r.bytes_per_step_worker),
                    bytes_sent_per_step_worker: med(|r| r.bytes_sent_per_step_worker),
                    bytes_per_step_server: med(|r| r.bytes_per_step_server),
                    rows_per_step: med(|r| r.rows_per_step),
                    final_loss: med(|r| r.final_loss),
                    final_accuracy: med(|r| r.final_accuracy),
                    staleness_mean: med(|r| r.staleness_mean),
                    staleness_max: ok.iter().filter_map(|r| r.staleness_max).max(),
                    push_overlap: med(|r| r.push_overlap),
                    train_s: med(|r| r.train_s),
                    repeat: ok.len(),
                    best_accuracy: med(|r| r.best_accuracy),
                    time_to_target_s: if most { med(|r| r.time_to_target_s) } else { None },
                    samples_to_target: if most {
                        med(|r| r.samples_to_target.map(|s| s as f64)).map(|s| s.round() as u64)
                    } else {
                        None
                    },
                    epochs_to_target: if most { med(|r| r.epochs_to_target) } else { None },
                    cpu_busy: med(|r| r.cpu_busy),
                    ..first.clone()
                };
                Some(Cell {
                    runs: ok.iter().map(|r| r.id.clone()).collect(),
                    attempts: all.len(),
                    throughput: range(|r| r.samples_per_s),
                    time_to_target: range(|r| r.time_to_target_s),
                    reached,
                    median,
                })
            })
            .collect()
    }
}

/// What makes runs repeats of one cell: (model, global batch, link), mode, workers, (shards,
/// colocated), straggler delay.
type CellKey = ((String, usize, String), String, usize, (usize, bool), u64);

/// Whether two (min, max) ranges overlap: the modes behind them are level.
pub fn overlap(a: (f64, f64), b: (f64, f64)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

/// Everything read from a set of run directories.
#[derive(Debug, Default)]
pub struct Collected {
    /// Runs with metrics, sorted by id.
    pub runs: Vec<RunData>,
    /// The runner's records (may name runs without metrics).
    pub outcomes: Vec<Outcome>,
    /// One row per run: every run with metrics, then every recorded run without.
    pub summaries: Vec<Summary>,
    /// The cells of the matrix over their complete repeats.
    pub cells: Vec<Cell>,
    /// The held-out accuracy time-to-target is measured to, when the scenario set one.
    pub target: Option<f64>,
    /// Problems with the input, each naming a path and line.
    pub warnings: Vec<String>,
    /// A dilated cluster's rates: the factor, how it was chosen, the self-check
    /// (`dilation.json`).
    pub dilations: Vec<crate::emulated::DilationRecord>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn row(mode: &str, repeat: usize, status: &str, thr: f64, tt: Option<f64>) -> Summary {
        Summary {
            id: format!("runs/{mode}-r{repeat}"),
            mode: mode.into(),
            workers: 2,
            model: "mnist".into(),
            global_batch: 64,
            status: status.into(),
            repeat,
            samples_per_s: Some(thr),
            step_ms: Some(64e3 / thr),
            time_to_target_s: tt,
            samples_to_target: tt.map(|t| (t * thr) as u64),
            ..Summary::default()
        }
    }

    /// An update of `rank`'s push that arrived over `[start, end]` ms and was applied in 1 ms.
    fn arrived(rank: usize, start: f64, end: f64) -> ServerApply {
        ServerApply {
            ranks: vec![rank],
            wall_ms: end + 1.0,
            apply_ms: 1.0,
            receive_ms: Some(end - start),
            ..ServerApply::default()
        }
    }

    #[test]
    fn push_overlap_is_the_share_of_arrival_time_another_ranks_push_shared() {
        // In phase: two ranks' pushes arrive together, step after step.
        let together: Vec<ServerApply> = (0..4)
            .flat_map(|k| {
                [
                    arrived(0, 146.0 * k as f64, 146.0 * k as f64 + 72.0),
                    arrived(1, 146.0 * k as f64 + 2.0, 146.0 * k as f64 + 72.0),
                ]
            })
            .collect();
        let o = push_overlap([together.as_slice()].into_iter()).unwrap();
        // Each step: rank 0's 72 ms overlapped for 70, rank 1's 70 ms for all 70.
        assert!((o - 140.0 / 142.0).abs() < 1e-9, "{o}");
        // Taking turns: one pushes while the other pulls.
        let turns: Vec<ServerApply> = (0..4)
            .flat_map(|k| {
                [
                    arrived(0, 75.0 * k as f64, 75.0 * k as f64 + 36.0),
                    arrived(1, 75.0 * k as f64 + 37.0, 75.0 * k as f64 + 73.0),
                ]
            })
            .collect();
        assert_eq!(push_overlap([turns.as_slice()].into_iter()), Some(0.0));
        // A rank's own consecutive pushes never count, nor pushes to another shard; a third
        // rank's push covering what a second already covered counts once.
        let own = [arrived(0, 0.0, 10.0), arrived(0, 5.0, 15.0)];
        let other_shard = [arrived(1, 0.0, 10.0)];
        assert_eq!(push_overlap([own.as_slice(), other_shard.as_slice()].into_iter()), Some(0.0));
        let three = [arrived(0, 0.0, 10.0), arrived(1, 2.0, 6.0), arrived(2, 4.0, 8.0)];
        // rank 0: 2..8 of 10 covered; rank 1: 2..6 covered by 0, all 4; rank 2: all 4.
        let o = push_overlap([three.as_slice()].into_iter()).unwrap();
        assert!((o - 14.0 / 18.0).abs() < 1e-9, "{o}");
        // No arrival recorded (BSP): nothing to say.
        assert_eq!(push_overlap([[ServerApply::default()].as_slice()].into_iter()), None);
    }

    #[test]
    fn cells_take_medians_and_ranges_of_complete_repeats_only() {
        let rows = vec![
            row("ps-bsp", 0, "ok", 1000.0, Some(3.0)),
            row("ps-bsp", 1, "ok", 1200.0, Some(2.5)),
            row("ps-bsp", 2, "ok", 900.0, None),
            // Faster, but not complete: must not move any figure.
            row("ps-bsp", 3, "interrupted", 9000.0, Some(0.1)),
            row("ps-bsp", 4, "diverged", 8000.0, None),
            row("ps-asp", 0, "failed", 5000.0, Some(0.2)),
        ];
        let cells = Cell::all(&rows);
        // ps-asp has no complete run: no cell, so it can never be read as a speed.
        assert_eq!(cells.len(), 1);
        let c = &cells[0];
        assert_eq!((c.attempts, c.runs.len(), c.reached), (5, 3, 2));
        assert_eq!(c.median.samples_per_s, Some(1000.0));
        assert_eq!(c.throughput, Some((900.0, 1200.0)));
        // Two of three reached the target: the median of those two.
        assert_eq!(c.median.time_to_target_s, Some(2.75));
        assert_eq!(c.time_to_target, Some((2.5, 3.0)));
        assert_eq!(c.median.status, "ok");
        // One of three reaching it is not enough for a time-to-target.
        let rows = vec![
            row("dp", 0, "ok", 1.0, Some(1.0)),
            row("dp", 1, "ok", 1.0, None),
            row("dp", 2, "ok", 1.0, None),
        ];
        assert_eq!(Cell::all(&rows)[0].median.time_to_target_s, None);
        // How busy the cores were is the repeats' median too, not the first repeat's.
        let busy = |r: usize, b: f64| Summary { cpu_busy: Some(b), ..row("ddp-shm", r, "ok", 1.0, None) };
        let rows = vec![busy(0, 0.70), busy(1, 0.95), busy(2, 0.90)];
        assert_eq!(Cell::all(&rows)[0].median.cpu_busy, Some(0.90));
    }

    #[test]
    fn ranges_that_overlap_are_level() {
        assert!(overlap((1.0, 3.0), (2.0, 4.0)));
        assert!(overlap((1.0, 3.0), (3.0, 4.0)));
        assert!(!overlap((1.0, 2.0), (2.5, 4.0)));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN]), None);
    }

    #[test]
    fn common_dir_of_paths() {
        assert_eq!(common_dir(["runs/a/rank0.jsonl", "runs/a/rank1.jsonl"].into_iter()), "runs/a");
        assert_eq!(common_dir(["h1/a/rank0.jsonl", "h2/a/rank1.jsonl"].into_iter()), ".");
        assert_eq!(common_dir(["rank0.jsonl"].into_iter()), ".");
    }
}
