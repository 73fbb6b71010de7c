//! The training loop, written once for every mode: data, sampler, epochs, evaluation, metrics,
//! progress, saving. The mode's [`Strategy`] does the step.

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::checkpoint::{Checkpoint, CheckpointHeader};
use gradsync_core::data::{Dataset, DistributedSampler};
use gradsync_core::metrics::{Header, HostInfo, MetricsWriter, Record, SCHEMA_VERSION, Step, unix_ms};
use gradsync_core::model::Fingerprint;
use gradsync_core::optim::SgdConfig;
use gradsync_core::state_dict::is_state_dict;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::TrainArgs;
use crate::setup::{Budget, Eval, Run};
use crate::strategy::{Strategy, ms_since};

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Steps taken.
    pub steps: u64,
    /// Mean training loss of the first step.
    pub first_loss: f64,
    /// Mean training loss of the last step.
    pub last_loss: f64,
    /// Held-out loss and accuracy at the end (rank 0).
    pub eval: Option<(f64, f64)>,
    /// Wall-clock seconds of the training loop.
    pub seconds: f64,
}

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

fn run_steps(run: &Run, mut strategy: Box<dyn Strategy>) -> anyhow::Result<Summary> {
    // Each process draws its own shard of the data, `--batch` rows per replica it trains.
    let shape = strategy.shape();
    let (world, rank, batch) = (shape.processes, shape.rank, run.batch * shape.replicas);
    let global_batch = run.batch * shape.workers();
    let leader = run.rank == 0;
    let mut engine = Engine::new(run.device, run.model.clone(), run.seed)?;
    let fingerprint = run.fingerprint();
    if let Some(path) = &run.load {
        load_params(&mut engine, path, &fingerprint)?;
    }
    let sampler = DistributedSampler::new(
        run.data.train.len(),
        world,
        rank,
        run.shuffle,
        run.order_seed,
        run.drop_last,
    )?;
    let steps_per_epoch = (sampler.num_samples() / batch) as u64;
    anyhow::ensure!(
        steps_per_epoch > 0,
        "--batch {batch} is larger than this rank's {} training samples",
        sampler.num_samples()
    );
    let total_steps = match run.budget {
        Budget::Steps(n) => n,
        Budget::Epochs(e) => steps_per_epoch * e,
    };

    // A run that keeps checkpoints holds its state in one engine (`Run::prepare` refused the
    // modes that do not); a resumed run takes the newest one's state before the ranks agree on
    // it in `start` (rank 0's wins).
    let identity = crate::resume::Identity {
        fingerprint: fingerprint.text.clone(),
        mode: run.mode.name().into(),
        world_size: shape.workers(),
        batch: run.batch,
        lr: run.sgd.lr,
        momentum: run.sgd.momentum,
        weight_decay: run.sgd.weight_decay,
        order_seed: run.order_seed,
    };
    let mut resumed_at = 0;
    let mut first_loss = f64::NAN;
    // Where the servers hold the parameters (PS), a worker's checkpoint is its own state only,
    // read once the servers have said where the run is.
    let remote = strategy.state_on_servers();
    let resume = run.checkpoints.as_ref().filter(|ck| ck.resume);
    let mut restored = match resume {
        Some(ck) if !remote => ck.restore(&mut engine, &identity)?,
        _ => None,
    };
    let progress = Progress::new(leader && !run.quiet, total_steps, &engine, run.batch);
    strategy.start(&mut engine).context("starting the run")?;
    if let Some(ck) = resume
        && remote
    {
        restored = ck.restore_worker(&identity, strategy.server_version())?;
    }
    if let Some(r) = &restored {
        resumed_at = r.state.step;
        first_loss = r.state.first_loss;
        let mut how = format!("after step {} (epoch {})", r.state.step, r.state.epoch);
        // Under BSP a step is a version: the servers went on (or waited) while this worker
        // was away, and it continues at the step their version stands for.
        if let (Some(at), Some(now)) = (r.state.server_version, strategy.server_version())
            && now != at
        {
            resumed_at = r.state.step + (now - at);
            how = format!(
                "at step {} (the servers' version {now}; its checkpoint of step {} was at version {at})",
                resumed_at + 1,
                r.state.step
            );
            if r.extra.is_some() {
                eprintln!(
                    "gradsync: --resume: the top-k residual is that of step {} (version {at}): what the \
                     gradients of the {} steps since had left unsent is lost",
                    r.state.step,
                    now - at
                );
            }
        }
        if (leader || remote) && !run.quiet {
            eprintln!("gradsync: resuming {how} from {}", r.path.display());
        }
        if let Some(extra) = &r.extra {
            strategy.restore_state(extra).context("restoring the strategy's state from the checkpoint")?;
        }
    } else if let (Some(ck), Some(now)) = (resume, strategy.server_version())
        && now > 0
    {
        // No checkpoint of its own yet (killed before its first): the servers' version is
        // the step, counted from when they started with the run's workers.
        resumed_at = now;
        if !run.quiet {
            eprintln!(
                "gradsync: resuming at step {} (the servers' version {now}; no checkpoint in {} yet)",
                now + 1,
                ck.dir.display()
            );
        }
    }
    // The optimiser actually applied: this process's own, or the one the servers told it at
    // registration (a contradicting flag is refused, never recorded).
    let sgd = match strategy.applied_optimiser() {
        Some(applied) => {
            if let Err(e) = run.optimiser_flags.check(&applied, "the parameter servers") {
                // Leave the servers as they were: without this they would hold the rank as
                // registered until it timed out, and refuse it when started again.
                let _ = strategy.finish(&mut engine);
                return Err(e.into());
            }
            applied
        }
        None => run.sgd,
    };
    // A resumed run adds to the metrics the run before it wrote.
    let appended =
        resumed_at > 0 && run.metrics.as_ref().is_some_and(|p| p.metadata().is_ok_and(|m| m.len() > 0));
    let mut metrics = match &run.metrics {
        Some(p) if appended => Some(MetricsWriter::append(p)?),
        Some(p) => Some(MetricsWriter::create(p)?),
        None => None,
    };
    let start_ms = unix_ms();
    if let Some(m) = metrics.as_mut().filter(|_| !appended) {
        let (variant, mut extra) = strategy.describe();
        if let Eval::Samples(every) = run.eval {
            extra.insert("eval_samples".into(), every.into());
        }
        extra.insert("order_seed".into(), run.order_seed.into());
        // Samples per epoch, so readers can turn samples seen into epochs; the steps planned,
        // so a run collected without its runner's record can still be told complete or not.
        extra.insert("train_samples".into(), run.data.train.len().into());
        extra.insert("total_steps".into(), total_steps.into());
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
        let host = HostInfo::detect();
        m.write(&Record::Header(Header {
            schema: SCHEMA_VERSION,
            mode: run.mode.name().into(),
            variant,
            device: run.device.label(),
            preset: run.model.name.clone(),
            widths: run.model.widths_str(),
            params: engine.layout().len,
            batch: run.batch,
            global_batch,
            world_size: shape.workers(),
            rank: run.rank,
            seed: run.seed,
            data: run.source.to_string(),
            fingerprint: fingerprint.text.clone(),
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
            extra,
        }))?;
    }

    // A resumed run's steps continue the clock of the file they are added to (its header's
    // start), so that times read across the restart include the time it cost.
    let wall_base = match (&run.metrics, appended) {
        (Some(p), true) => unix_ms().saturating_sub(metrics_start(p)?) as f64,
        _ => 0.0,
    };
    let t0 = Instant::now();
    let mut eval_ms = 0.0;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let (mut x_next, mut y_next) = (Vec::new(), Vec::new());
    let looks_ahead = strategy.looks_ahead();
    let mut summary = Summary { steps: 0, first_loss, last_loss: f64::NAN, eval: None, seconds: 0.0 };
    // A resumed run starts in the epoch of its next step, at that step's batch: the sampler's
    // order depends on the seed and the epoch only.
    let first_epoch = resumed_at / steps_per_epoch;
    summary.steps = first_epoch * steps_per_epoch;
    'epochs: for epoch in first_epoch.. {
        let indices = sampler.indices(epoch);
        let mut following = None;
        for (i, chunk) in indices.chunks_exact(batch).enumerate() {
            if summary.steps >= total_steps {
                break 'epochs;
            }
            if summary.steps < resumed_at {
                summary.steps += 1;
                continue;
            }
            let ts = Instant::now();
            summary.steps += 1;
            let step = summary.steps;
            run.data.gather(chunk, &mut x, &mut y);
            run.augment.apply(&mut x, run.data.input, chunk, run.seed, epoch);
            if looks_ahead && step < total_steps {
                // The batch after this one: the rest of this epoch's order, or the next's.
                let next = match indices.chunks_exact(batch).nth(i + 1) {
                    Some(c) => (c.to_vec(), epoch),
                    None => {
                        let order = following.get_or_insert_with(|| sampler.indices(epoch + 1));
                        (order[..batch.min(order.len())].to_vec(), epoch + 1)
                    }
                };
                run.data.gather(&next.0, &mut x_next, &mut y_next);
                run.augment.apply(&mut x_next, run.data.input, &next.0, run.seed, next.1);
                strategy
                    .next_batch(&engine, &x_next)
                    .with_context(|| format!("step {step}: the next batch"))?;
            }
            let mut rec =
                Step { rank: run.rank, step, epoch, samples: step * global_batch as u64, ..Step::default() };
            // The injected straggler delay (a strategy with several replicas delays its own).
            if let Some(slow) = run.slow
                && slow.rank == run.rank
                && shape.replicas == 1
            {
                let t = Instant::now();
                std::thread::sleep(slow.delay());
                run.trace.span("slow-rank delay", "compute", "compute", t);
            }
            let loss =
                strategy.step(&mut engine, &x, &y, &mut rec).with_context(|| format!("step {step}"))?;
            rec.step_ms = ms_since(ts);
            rec.loss = loss.loss;
            rec.train_accuracy = loss.correct as f64 / loss.rows.max(1) as f64;
            if summary.first_loss.is_nan() {
                summary.first_loss = loss.loss;
            }
            if let Some(why) = divergence(loss.loss, summary.first_loss, run.data.classes) {
                return Err(Diverged {
                    step,
                    why,
                    hint: divergence_hint(&sgd, strategy.divergence_advice()),
                }
                .into());
            }
            summary.last_loss = loss.loss;
            // The training clock stops while the model is evaluated.
            rec.train_ms = Some(ms_since(t0) - eval_ms);
            let at_cadence = match run.eval {
                Eval::Samples(every) => {
                    rec.samples / every.max(1) > (step - 1) * global_batch as u64 / every.max(1)
                }
                Eval::Steps(every) => every > 0 && step.is_multiple_of(every),
            };
            // At a samples cadence every rank evaluates (synchronous ranks then pause together
            // and every clock leaves it out); at a steps cadence, and after the last step, rank
            // 0 alone.
            let eval_here = ((at_cadence && (matches!(run.eval, Eval::Samples(_)) || leader))
                || (leader && step == total_steps))
                && run.model.profile().is_none();
            if eval_here {
                let te = Instant::now();
                // Part of evaluating (off the training clock): a strategy that keeps part of
                // the model elsewhere brings it in.
                strategy.sync_params(&mut engine).context("bringing the parameters in for evaluation")?;
                let (l, a) = evaluate(&mut engine, &run.data)?;
                let took = ms_since(te);
                eval_ms += took;
                rec.eval_ms = Some(took);
                rec.eval_loss = Some(l);
                rec.accuracy = Some(a);
                summary.eval = Some((l, a));
            }
            rec.wall_ms = wall_base + ms_since(t0);
            run.trace.span_with(
                format!("step {step}"),
                "step",
                "step",
                ts,
                Instant::now(),
                serde_json::Map::from_iter([("loss".to_string(), serde_json::json!(loss.loss))]),
            );
            if let Some(m) = metrics.as_mut() {
                m.write(&Record::Step(rec.clone()))?;
            }
            if let Some(ck) = run.checkpoints.as_ref().filter(|ck| ck.due(step)) {
                // Every rank takes part in gathering state kept outside the engine; rank 0 writes
                // (every worker its own, where the servers hold the parameters).
                let held =
                    strategy.checkpoint_momentum(&engine).context("gathering the checkpoint's state")?;
                let state = strategy.checkpoint_state(&engine).context("gathering the checkpoint's state")?;
                if leader && !remote {
                    // The model is written from the engine: whole first.
                    strategy
                        .sync_params(&mut engine)
                        .context("bringing the parameters in for the checkpoint")?;
                }
                if leader || remote {
                    let t = Instant::now();
                    let contents = crate::resume::Contents {
                        engine: (!remote).then_some(&engine),
                        momentum: held.as_deref(),
                        state,
                        server_version: strategy.server_version(),
                    };
                    let at = ck.write_contents(contents, step, epoch, summary.first_loss, &identity)?;
                    run.trace.span("checkpoint", "compute", "compute", t);
                    if !run.quiet {
                        progress.note(&format!("checkpoint of step {step} in {}", at.display()));
                    }
                }
            }
            progress.step(&rec);
        }
        if let Budget::Epochs(e) = run.budget
            && epoch + 1 >= e
        {
            break;
        }
    }
    if leader && run.save.is_some() {
        strategy.sync_params(&mut engine).context("bringing the parameters in for --save")?;
    }
    strategy.finish(&mut engine).context("finishing the run")?;
    summary.seconds = t0.elapsed().as_secs_f64();
    progress.finish(&summary);
    if leader && let Some(path) = &run.save {
        save_params(&engine, path, &fingerprint, summary.steps)?;
    }
    Ok(summary)
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

/// Write the engine's state to `path`: as a PyTorch state dict in safetensors (parameters,
/// running statistics and `num_batches_tracked` under PyTorch's names; the fingerprint and step
/// in its metadata) when the path ends in `.safetensors`, else as a gradsync checkpoint
/// (parameters and momentum), which cannot hold batch-norm statistics.
pub fn save_params(
    engine: &Engine,
    path: &std::path::Path,
    fp: &Fingerprint,
    step: u64,
) -> anyhow::Result<()> {
    if is_state_dict(path) {
        let meta = [
            ("fingerprint", fp.text.clone()),
            ("step", step.to_string()),
            ("gradsync", gradsync_core::VERSION.into()),
        ];
        return gradsync_core::state_dict::save(path, &engine.state_dict()?, &meta).context("--save");
    }
    anyhow::ensure!(
        engine.layout().buffers_len == 0,
        "--save {}: this model has batch-norm statistics, which a gradsync checkpoint does not hold; \
         save it as a PyTorch state dict (a path ending in .safetensors)",
        path.display()
    );
    let n = engine.layout().len;
    let mut momentum = vec![0.0; n];
    engine.read_momentum(&mut momentum)?;
    Checkpoint {
        header: CheckpointHeader {
            fingerprint: fp.text.clone(),
            step,
            start: 0,
            end: n,
            has_momentum: true,
            version: gradsync_core::VERSION.into(),
        },
        params: engine.params()?,
        momentum: Some(momentum),
    }
    .save(path)
    .context("--save")?;
    Ok(())
}

/// Read parameters (and momentum) from `path`, refusing another model's: a gradsync checkpoint
/// by its fingerprint, a PyTorch state dict (`.safetensors`, from gradsync or from PyTorch's
/// `save_file(model.state_dict())`) by its tensors' names and shapes.
pub fn load_params(engine: &mut Engine, path: &std::path::Path, fp: &Fingerprint) -> anyhow::Result<()> {
    if is_state_dict(path) {
        let tensors = gradsync_core::state_dict::load(path).context("--load")?;
        let (params, buffers) =
            gradsync_core::state_dict::to_model(path, engine.layout(), &tensors).context("--load")?;
        engine.write_params(0, &params)?;
        if let Some(b) = buffers {
            engine.write_buffers(&b)?;
        }
        return Ok(());
    }
    let ck = Checkpoint::load(path).context("--load")?;
    fp.check(&ck.header.fingerprint).with_context(|| format!("--load {}", path.display()))?;
    anyhow::ensure!(
        ck.header.start == 0 && ck.header.end == engine.layout().len,
        "--load {}: holds parameters {}..{}, the model has {}",
        path.display(),
        ck.header.start,
        ck.header.end,
        engine.layout().len
    );
    engine.write_params(0, &ck.params)?;
    if let Some(m) = &ck.momentum {
        engine.write_momentum(m)?;
    }
    Ok(())
}

/// A progress bar on a terminal, a log line every few steps otherwise; silent off rank 0.
struct Progress {
    bar: Option<ProgressBar>,
    enabled: bool,
    every: u64,
    /// Whether the model is replayed (no loss to show).
    replay: bool,
}

impl Progress {
    fn new(enabled: bool, total: u64, engine: &Engine, batch: usize) -> Self {
        let replay = engine.spec().profile();
        if enabled {
            eprintln!(
                "gradsync: {} parameters on {}, {} steps",
                engine.layout().len,
                engine.describe(),
                total
            );
            if let Some(p) = replay {
                let (forward, backward) = p.step_ms(batch);
                let how = if p.estimated_at(batch) { "estimated" } else { "measured" };
                eprintln!(
                    "gradsync: replay of {} ({}): speed only, no accuracy; compute {how} at {forward:.2} ms forward + \
                     {backward:.2} ms backward per step of {batch} samples ({}{})",
                    p.model,
                    p.source,
                    p.device,
                    if batch == p.batch { String::new() } else { format!(", scaled from batch {}", p.batch) },
                );
            }
            if let Some(libs) =
                engine.gpu_name().is_some().then(gradsync_core::device::libs::loaded).flatten()
            {
                eprintln!("gradsync: CUDA libraries: {libs}");
            }
        }
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template("{bar:40} {pos}/{len} steps {per_sec} eta {eta} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        });
        Progress { bar, enabled, every: (total / 20).max(1), replay: replay.is_some() }
    }

    fn step(&self, rec: &Step) {
        let acc = rec.accuracy.map(|a| format!(" eval acc {:.1}%", 100.0 * a)).unwrap_or_default();
        let loss = if self.replay { "replay".to_string() } else { format!("loss {:.4}", rec.loss) };
        if let Some(b) = &self.bar {
            b.set_position(rec.step);
            b.set_message(format!("{loss}{acc}"));
        } else if self.enabled && (rec.step.is_multiple_of(self.every) || rec.accuracy.is_some()) {
            eprintln!(
                "step {:>6}  epoch {:>3}  {loss}  {:.1} ms/step{acc}",
                rec.step, rec.epoch, rec.step_ms
            );
        }
    }

    /// A line between the steps' (above the bar on a terminal).
    fn note(&self, msg: &str) {
        if let Some(b) = &self.bar {
            b.println(format!("gradsync: {msg}"));
        } else if self.enabled {
            eprintln!("gradsync: {msg}");
        }
    }

    fn finish(&self, s: &Summary) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        if self.enabled {
            let eval = s
                .eval
                .map(|(l, a)| format!(", held-out loss {l:.4}, accuracy {:.2}%", 100.0 * a))
                .unwrap_or_default();
            if self.replay {
                eprintln!(
                    "gradsync: {} steps in {} (replay: speed only, no accuracy)",
                    s.steps,
                    gradsync_core::metrics::elapsed(s.seconds)
                );
                return;
            }
            eprintln!(
                "gradsync: {} steps in {}, loss {:.4} -> {:.4}{eval}",
                s.steps,
                gradsync_core::metrics::elapsed(s.seconds),
                s.first_loss,
                s.last_loss
            );
        }
    }
}

/// The start (`start_unix_ms`) of the header that opens the metrics file at `path`.
fn metrics_start(path: &std::path::Path) -> anyhow::Result<u64> {
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
