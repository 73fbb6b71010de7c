//! The training loop, written once for every mode, in phases that `run_steps` reads top to
//! bottom: the run prepared (`Training::new`: the engine, `--load`, the data's batches), its
//! start or resumption, the metrics header, then for each step the step itself, the
//! evaluation when due, its record and the checkpoint when due, and the end (finish, `--save`,
//! the closing line). The mode's [`Strategy`] does the step and owns what differs between the
//! modes (where a checkpoint's state is and which rank writes it, reading the next batch
//! ahead); the loop never asks which mode it runs.
//!
//! This is the `train` subcommand's body, the binary's edge: its errors are `anyhow` errors,
//! a strategy's typed one ([`crate::strategy::StrategyError`]) wrapped in the phase it ended
//! (`starting the run`, `step N`, `finishing the run`).
//!
//! # Layout
//! - `batches.rs`: each step's batch in the sampler's order, and the next one on demand.
//! - `progress.rs`: the progress bar or log lines, and the opening and closing lines.
//! - `params.rs`: `--save` and `--load`, the model as a PyTorch state dict or a gradsync
//!   checkpoint.

mod batches;
mod params;
mod progress;

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::data::{Dataset, DistributedSampler};
use gradsync_core::metrics::{Header, HostInfo, MetricsWriter, Record, SCHEMA_VERSION, Step, unix_ms};
use gradsync_core::model::Fingerprint;
use gradsync_core::optim::SgdConfig;

use crate::cli::TrainArgs;
use crate::resume::{CheckpointAt, Identity, Resume};
use crate::setup::{Eval, Run};
use crate::strategy::{Shape, Strategy, ms_since};
use batches::Batches;
pub use params::{load_params, save_params};
use progress::Progress;
pub use progress::Summary;

/// Train according to `args`, with the strategy its `--mode` names.
pub fn train(args: TrainArgs) -> anyhow::Result<Summary> {
    let run = Run::prepare(args)?;
    let strategy = crate::setup::strategy(&run)?;
    run_loop(&run, strategy)
}

/// The loop itself, given a strategy. The `--trace` timeline is written even when the run
/// fails, since a timeline is most wanted then.
pub fn run_loop(run: &Run, strategy: Box<dyn Strategy>) -> anyhow::Result<Summary> {
    let out = run_steps(run, strategy);
    if let Some(path) = &run.trace_path {
        run.trace.write(path).context("--trace")?;
    }
    out
}

fn run_steps(run: &Run, strategy: Box<dyn Strategy>) -> anyhow::Result<Summary> {
    let mut t = Training::new(run, strategy)?;
    t.resume()?;
    t.write_header()?;
    while let Some(step) = t.next_step() {
        let (mut rec, began) = t.step(step)?;
        t.evaluate(&mut rec)?;
        t.record(&mut rec, began)?;
        t.checkpoint(&rec)?;
        t.progress.step(&rec);
    }
    t.end()
}

/// A run in progress: what its phases share.
struct Training<'r> {
    run: &'r Run,
    strategy: Box<dyn Strategy>,
    engine: Engine,
    /// How the strategy's ranks split the data.
    shape: Shape,
    /// Each step's batch.
    batches: Batches<'r>,
    fingerprint: Fingerprint,
    /// What a checkpoint's run must match to be resumed from.
    identity: Identity,
    progress: Progress,
    metrics: Option<MetricsWriter>,
    summary: Summary,
    /// The optimiser applied: this process's own, or the one the servers apply.
    sgd: SgdConfig,
    /// The training clock, which stops while the model is evaluated.
    clock: Clock,
}

/// The loop's clocks.
struct Clock {
    /// When the first step began (after the header).
    t0: Instant,
    /// Milliseconds spent evaluating since, off the training clock.
    eval_ms: f64,
    /// Where a resumed run's wall clock starts: the milliseconds since its metrics file's
    /// header, so that times read across a restart include the time it cost.
    wall_base: f64,
}

impl<'r> Training<'r> {
    /// The engine (from `--load` if given) and the batches this process draws: each process
    /// its own shard of the data, `--batch` rows per replica it trains.
    fn new(run: &'r Run, strategy: Box<dyn Strategy>) -> anyhow::Result<Self> {
        let shape = strategy.shape();
        let mut engine = Engine::new(run.device, run.model.clone(), run.seed)?;
        engine.set_dilation(run.dilation);
        engine.set_turns(run.turns.clone());
        let fingerprint = run.fingerprint();
        if let Some(path) = &run.load {
            load_params(&mut engine, path, &fingerprint)?;
        }
        let sampler = DistributedSampler::new(
            run.data.train.len(),
            shape.processes,
            shape.rank,
            run.shuffle,
            run.order_seed,
            run.drop_last,
        )?;
        let data = (&run.data, run.augment, run.seed);
        let batches = Batches::new(data, sampler, run.batch * shape.replicas, run.budget)?;
        let identity = Identity {
            fingerprint: fingerprint.text.clone(),
            mode: run.mode.name().into(),
            world_size: shape.workers(),
            batch: run.batch,
            lr: run.sgd.lr,
            momentum: run.sgd.momentum,
            weight_decay: run.sgd.weight_decay,
            order_seed: run.order_seed,
        };
        let progress = Progress::new(run.rank == 0 && !run.quiet, batches.steps(), &engine, run.batch);
        let summary = Summary {
            steps: 0,
            taken: 0,
            first_loss: None,
            last_loss: None,
            eval: None,
            seconds: 0.0,
            dilation: 1.0,
        };
        let clock = Clock { t0: Instant::now(), eval_ms: 0.0, wall_base: 0.0 };
        Ok(Training {
            run,
            strategy,
            engine,
            shape,
            batches,
            fingerprint,
            identity,
            progress,
            metrics: None,
            summary,
            sgd: run.sgd,
            clock,
        })
    }

    /// The run's start: from the beginning, or under `--resume` from where its checkpoints
    /// say, read by the strategy where it keeps its state as it agrees on it with its peers.
    fn resume(&mut self) -> anyhow::Result<()> {
        let run = self.run;
        let resume = Resume::new(run.checkpoints.as_ref(), self.identity.clone(), run.rank, run.quiet);
        if let Some(r) = self.strategy.start(&mut self.engine, &resume).context("starting the run")? {
            self.summary.steps = r.step;
            self.summary.first_loss = r.first_loss;
        }
        // Known once started: the servers' optimiser, told at registration.
        self.sgd = self.strategy.applied_optimiser().unwrap_or(run.sgd);
        Ok(())
    }

    /// The metrics file: begun with its header, or, for a resumed run, added to (its steps
    /// continue the clock of the header there). Starts the training clock.
    fn write_header(&mut self) -> anyhow::Result<()> {
        let Some(path) = &self.run.metrics else {
            self.clock.t0 = Instant::now();
            return Ok(());
        };
        let appended = self.summary.steps > 0 && path.metadata().is_ok_and(|m| m.len() > 0);
        if appended {
            self.metrics = Some(MetricsWriter::append(path)?.dilated(self.run.dilation));
        } else {
            let mut m = MetricsWriter::create(path)?.dilated(self.run.dilation);
            m.write(&Record::Header(self.header(unix_ms())))?;
            self.metrics = Some(m);
        }
        let wall_base = if appended { unix_ms().saturating_sub(metrics_start(path)?) as f64 } else { 0.0 };
        self.clock = Clock { t0: Instant::now(), eval_ms: 0.0, wall_base };
        Ok(())
    }

    /// The step after the last one taken, while the run has one.
    fn next_step(&self) -> Option<u64> {
        (self.summary.steps < self.batches.steps()).then_some(self.summary.steps + 1)
    }

    /// Step `step`: its batch, the injected delay, the strategy's step and the divergence
    /// check. Returns its record and when it began.
    fn step(&mut self, step: u64) -> anyhow::Result<(Step, Instant)> {
        let (run, began) = (self.run, Instant::now());
        let (mut batch, epoch) = self.batches.draw(step);
        let samples = step * (run.batch * self.shape.workers()) as u64;
        let mut rec = Step { rank: run.rank, step, epoch, samples, ..Step::default() };
        // The injected straggler delay (a strategy with several replicas delays its own).
        if let Some(slow) = run.slow
            && slow.rank == run.rank
            && self.shape.replicas == 1
        {
            let t = Instant::now();
            std::thread::sleep(run.dilation.stretch(slow.delay()));
            run.trace.span("slow-rank delay", "compute", "compute", t);
        }
        let loss = self
            .strategy
            .step(&mut self.engine, &mut batch, &mut rec)
            .with_context(|| format!("step {step}"))?;
        rec.step_ms = ms_since(began);
        if !run.dilation.is_none() {
            rec.count_pace(self.engine.take_pace());
        }
        rec.loss = loss.loss;
        rec.train_accuracy = loss.correct as f64 / loss.rows.max(1) as f64;
        let first = *self.summary.first_loss.get_or_insert(loss.loss);
        if let Some(why) = divergence(loss.loss, first, run.data.classes) {
            let hint = divergence_hint(&self.sgd, self.strategy.divergence_advice());
            return Err(Diverged { step, why, hint }.into());
        }
        self.summary.steps = step;
        self.summary.taken += 1;
        self.summary.last_loss = Some(loss.loss);
        rec.train_ms = Some(ms_since(self.clock.t0) - self.clock.eval_ms);
        Ok((rec, began))
    }

    /// Held-out loss and accuracy into `rec` when due, off the training clock: at a samples
    /// cadence on every rank (synchronous ranks then pause together and every clock leaves it
    /// out); at a steps cadence, and after the last step, on rank 0 alone. Never for a
    /// replayed model, which has no accuracy.
    fn evaluate(&mut self, rec: &mut Step) -> anyhow::Result<()> {
        let (run, step, leader) = (self.run, rec.step, self.run.rank == 0);
        let global = (run.batch * self.shape.workers()) as u64;
        let at_cadence = match run.eval {
            Eval::Samples(every) => rec.samples / every.max(1) > (step - 1) * global / every.max(1),
            Eval::Steps(every) => every > 0 && step.is_multiple_of(every),
        };
        let due = (at_cadence && (matches!(run.eval, Eval::Samples(_)) || leader))
            || (leader && step == self.batches.steps());
        if !due || run.model.profile().is_some() {
            return Ok(());
        }
        let te = Instant::now();
        // A strategy that keeps part of the model elsewhere brings it in (part of evaluating).
        self.strategy.whole_params(&mut self.engine).context("bringing the parameters in for evaluation")?;
        let (l, a) = evaluate(&mut self.engine, &run.data)?;
        let took = ms_since(te);
        self.clock.eval_ms += took;
        rec.eval_ms = Some(took);
        rec.eval_loss = Some(l);
        rec.accuracy = Some(a);
        self.summary.eval = Some((l, a));
        Ok(())
    }

    /// The step's record: its wall-clock time, its span on the timeline (from `began`), its
    /// line in the metrics file.
    fn record(&mut self, rec: &mut Step, began: Instant) -> anyhow::Result<()> {
        rec.wall_ms = self.clock.wall_base + ms_since(self.clock.t0);
        self.run.trace.span_with(
            format!("step {}", rec.step),
            "step",
            "step",
            began,
            Instant::now(),
            serde_json::Map::from_iter([("loss".to_string(), serde_json::json!(rec.loss))]),
        );
        if let Some(m) = self.metrics.as_mut() {
            m.write(&Record::Step(rec.clone()))?;
        }
        Ok(())
    }

    /// The checkpoint after the step of `rec`, when one is due: every rank takes part (what a
    /// strategy keeps outside the engine is gathered collectively); the strategy says what it
    /// holds and which rank writes it.
    fn checkpoint(&mut self, rec: &Step) -> anyhow::Result<()> {
        let run = self.run;
        let Some(ck) = run.checkpoints.as_ref().filter(|ck| ck.due(rec.step)) else { return Ok(()) };
        let at = CheckpointAt {
            checkpoints: ck,
            identity: &self.identity,
            step: rec.step,
            epoch: rec.epoch,
            first_loss: self.summary.first_loss.unwrap_or(f64::NAN),
            rank: run.rank,
            trace: &run.trace,
        };
        if let Some(folder) = self.strategy.checkpoint(&mut self.engine, &at)?
            && !run.quiet
        {
            self.progress.note(&format!("checkpoint of step {} in {}", rec.step, folder.display()));
        }
        Ok(())
    }

    /// After the last step: the parameters made whole for `--save`, the strategy finished,
    /// the model saved (rank 0), and the closing line.
    fn end(mut self) -> anyhow::Result<Summary> {
        let save = self.run.save.as_deref().filter(|_| self.run.rank == 0);
        if save.is_some() {
            self.strategy.whole_params(&mut self.engine).context("bringing the parameters in for --save")?;
        }
        self.strategy.finish(&mut self.engine).context("finishing the run")?;
        // In the emulated world's time, as every figure of a dilated run.
        self.summary.seconds = self.run.dilation.shrink_ms(self.clock.t0.elapsed().as_secs_f64());
        self.summary.dilation = self.run.dilation.factor();
        if let Some(path) = save {
            save_params(&self.engine, path, &self.fingerprint, self.summary.steps)?;
        }
        self.progress.finish(&self.summary, save);
        Ok(self.summary)
    }

    /// The metrics header: the run's settings, the strategy's own (`variant`, `extra`), the
    /// host, and `start_ms`, when the run began.
    fn header(&self, start_ms: u64) -> Header {
        let (run, engine, shape) = (self.run, &self.engine, self.shape);
        let (variant, extra) = self.strategy.describe();
        let host = HostInfo::detect();
        let sgd = self.sgd;
        Header {
            schema: SCHEMA_VERSION,
            mode: run.mode.name().into(),
            variant,
            device: run.device.label(),
            preset: run.model.name.clone(),
            widths: run.model.widths_str(),
            params: engine.layout().len,
            batch: run.batch,
            global_batch: run.batch * shape.workers(),
            world_size: shape.workers(),
            rank: run.rank,
            seed: run.seed,
            data: run.source.to_string(),
            fingerprint: self.fingerprint.text.clone(),
            lr: sgd.lr,
            momentum: sgd.momentum,
            weight_decay: sgd.weight_decay,
            threads: run.threads,
            gradsync_version: gradsync_core::VERSION.into(),
            host: host.host,
            cores: host.cores,
            gpu: engine.gpu_name(),
            cuda_libs: engine
                .gpu_name()
                .is_some()
                .then(gradsync_core::device::libs::loaded)
                .flatten()
                .cloned()
                .map(Box::new),
            start_unix_ms: start_ms,
            extra: self.header_extra(extra),
            // The writer sets it for a dilated run.
            dilation: None,
        }
    }

    /// The header's `extra`: the strategy's, and what readers need besides.
    fn header_extra(
        &self,
        mut extra: serde_json::Map<String, serde_json::Value>,
    ) -> serde_json::Map<String, serde_json::Value> {
        let run = self.run;
        if let Eval::Samples(every) = run.eval {
            extra.insert("eval_samples".into(), every.into());
        }
        extra.insert("order_seed".into(), run.order_seed.into());
        // Samples per epoch, so readers can turn samples seen into epochs; the steps planned,
        // so a run collected without its runner's record can still be told complete or not.
        extra.insert("train_samples".into(), run.data.train.len().into());
        extra.insert("total_steps".into(), self.batches.steps().into());
        if let Some(p) = run.model.profile() {
            // What a reader needs to read a replayed run: no accuracy, and where its compute
            // came from.
            extra.insert("replay".into(), replay_record(p, run.batch));
        }
        if let Some(slow) = run.slow {
            // Charts need the injected delay beside the measured step times.
            extra.insert("slow_rank".into(), slow.rank.into());
            extra.insert("slow_ms".into(), slow.ms.into());
        }
        extra
    }
}

/// The metrics header's record of a replayed model: its source, whether its times are
/// estimated (a built-in's, or a profile's scaled to another batch), the device they belong to
/// and the compute of one step at this batch.
fn replay_record(p: &gradsync_core::profile::Profile, batch: usize) -> serde_json::Value {
    let (forward, backward) = p.step_ms(batch);
    serde_json::json!({
        "model": p.model,
        "source": p.source,
        "estimated": p.estimated_at(batch),
        "device": p.device,
        "profile_batch": p.batch,
        "forward_ms": forward,
        "backward_ms": backward,
        "optimizer_ms": p.optimizer_ns as f64 / 1e6,
    })
}

/// A run stopped because its loss became non-finite or exploded. `gradsync-worker` exits with
/// [`EXIT_DIVERGED`] on it, so a runner can tell divergence from a failure.
#[derive(Debug, Clone, PartialEq)]
pub struct Diverged {
    /// The step whose loss diverged.
    pub step: u64,
    /// What the loss did.
    pub why: String,
    /// What to change.
    pub hint: String,
}

impl std::fmt::Display for Diverged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "diverged at step {}: {}; {}", self.step, self.why, self.hint)
    }
}

impl std::error::Error for Diverged {}

/// The exit status of a worker whose training diverged.
pub const EXIT_DIVERGED: u8 = 3;

/// How many times the larger of the first loss and chance level (ln classes) a loss may reach
/// before the run counts as exploded. Healthy cross-entropy training falls from chance level;
/// a stable run's noisiest batch stays well inside this.
const EXPLODED: f64 = 20.0;

/// Why `loss` means the run diverged, if it does.
pub fn divergence(loss: f64, first_loss: f64, classes: usize) -> Option<String> {
    if !loss.is_finite() {
        return Some(format!("the loss is {loss}"));
    }
    let chance = (classes.max(2) as f64).ln();
    let limit = EXPLODED * first_loss.max(chance);
    (loss > limit).then(|| {
        format!(
            "the loss is {loss:.4e}, above {EXPLODED} x max(first loss {first_loss:.4}, ln {classes} classes)"
        )
    })
}

/// The settings that decide convergence, named with what they are now: the learning rate,
/// and whatever the strategy advises besides ([`Strategy::divergence_advice`]).
fn divergence_hint(sgd: &SgdConfig, advice: Option<String>) -> String {
    let lr = format!("lower the learning rate (--lr {})", sgd.lr);
    match advice {
        Some(a) => format!("{lr}, or {a}"),
        None => lr,
    }
}

/// Held-out loss and accuracy, in batches so activations stay small.
pub fn evaluate(engine: &mut Engine, data: &Dataset) -> anyhow::Result<(f64, f64)> {
    const EVAL_BATCH: usize = 512;
    let (mut loss, mut correct) = (0.0, 0u64);
    let n = data.test.len();
    for start in (0..n).step_by(EVAL_BATCH) {
        let end = (start + EVAL_BATCH).min(n);
        let b = engine.forward(
            &data.test.x[start * data.dim..end * data.dim],
            &data.test.y[start..end],
            false,
        )?;
        loss += b.loss * b.rows as f64;
        correct += b.correct;
    }
    Ok((loss / n.max(1) as f64, correct as f64 / n.max(1) as f64))
}

/// The start (`start_unix_ms`) of the header that opens the metrics file at `path`.
fn metrics_start(path: &Path) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    match text.lines().next().map(gradsync_core::metrics::parse_line) {
        Some(Ok(Record::Header(h))) => Ok(h.start_unix_ms),
        _ => anyhow::bail!(
            "{}: a resumed run adds to its metrics file, and this one does not begin with a header",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_divergence_hint_names_the_learning_rate_and_the_strategys_advice() {
        let sgd = SgdConfig { lr: 40.0, ..SgdConfig::DEFAULT };
        assert_eq!(divergence_hint(&sgd, None), "lower the learning rate (--lr 40)");
        let h = divergence_hint(&sgd, Some("bound the staleness (--sync ssp:S)".into()));
        assert_eq!(h, "lower the learning rate (--lr 40), or bound the staleness (--sync ssp:S)");
    }
}
