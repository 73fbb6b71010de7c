//! How one step's gradients become an update: the one seam between the training loop (written
//! once, in [`crate::train`]) and the ways of synchronising, each in its own file.
//!
//! Here: the [`Strategy`] trait, the [`Shape`] through which a strategy tells the loop how to
//! draw its data, and the timed compute helpers every strategy shares ([`forward`],
//! [`backward`]), so forward and backward are timed and traced in one place. Each strategy
//! takes its own typed configuration; [`crate::setup`] builds it from the flags. `shell.rs` is
//! what DDP and ZeRO-1 share (connection, initial broadcast, the start and end of a step);
//! `bucket.rs` is how DDP reduces one bucket under `--compress` (the f32 or half-precision
//! all-reduce, or top-k all-gathered), the work DDP hands the communicator for each bucket;
//! `hybrid.rs` a sparse model's table on parameter servers beside DDP (`--mode hybrid`).

mod bucket;
mod ddp;
mod dp;
mod hybrid;
mod local;
pub mod ps;
mod shell;
mod sparse;
mod zero1;

use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::net::BatchLoss;
use gradsync_core::state_dict::Tensors;
use gradsync_core::trace::Trace;

pub use ddp::Ddp;
pub use dp::{Dp, DpConfig, FaultKind, ReplicaFault};
pub use gradsync_core::metrics::ms_since;
pub use local::Local;
pub use ps::{Ps, PsConfig};
pub use shell::{Backend, DdpConfig};
pub use sparse::SparseGrads;
pub use zero1::{Zero1, Zero1Config};

/// How the training data is split among a strategy's ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Processes that each draw their own shard of the training data (the sampler's world).
    pub processes: usize,
    /// This process's shard.
    pub rank: usize,
    /// Replicas trained inside this process, each on its own `--batch` rows: the loop hands
    /// the strategy `replicas x batch` rows per step (DP's scatter), and a replica's
    /// injected delay (`--slow-rank`) is the strategy's to apply.
    pub replicas: usize,
}

impl Shape {
    /// One replica per process, this process being `rank` of `processes`.
    pub fn processes(processes: usize, rank: usize) -> Shape {
        Shape { processes, rank, replicas: 1 }
    }

    /// Every replica in the run: the workers a global batch is split over.
    pub fn workers(&self) -> usize {
        self.processes * self.replicas
    }
}

/// One way of training: local, DP, PS, DDP or ZeRO-1.
pub trait Strategy {
    /// How the loop draws this strategy's data.
    fn shape(&self) -> Shape;

    /// Before the first step: agree on the initial parameters (broadcast, register, pull).
    fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()>;

    /// One step on this rank's batch `x` (`rows x input`) and labels `y`: forward, backward,
    /// gradient synchronisation and update. Fills the timing and traffic fields of `rec`.
    fn step(
        &mut self,
        engine: &mut Engine,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss>;

    /// After the last step: leave cleanly (deregister, close the ring).
    fn finish(&mut self, engine: &mut Engine) -> anyhow::Result<()>;

    /// Whether the strategy fetches what a step reads ahead of it, and so wants
    /// [`Strategy::next_batch`] called.
    fn looks_ahead(&self) -> bool {
        false
    }

    /// The batch of the step after the coming one (called before each step while there is
    /// one, when [`Strategy::looks_ahead`]): a parameter server's table rows for it are
    /// fetched during the coming step.
    fn next_batch(&mut self, _engine: &Engine, _x: &[f32]) -> anyhow::Result<()> {
        Ok(())
    }

    /// Make the engine's parameters whole before anything reads them outside a step
    /// (evaluation, a checkpoint, the saved model), where the strategy keeps part of them
    /// elsewhere and brings in only what each step reads (a parameter server's table rows).
    fn sync_params(&mut self, _engine: &mut Engine) -> anyhow::Result<()> {
        Ok(())
    }

    /// The optimiser applied to this run's parameters when it is not this process's own (the
    /// parameter servers'), known after [`Strategy::start`].
    fn applied_optimiser(&self) -> Option<gradsync_core::optim::SgdConfig> {
        None
    }

    /// Per-strategy detail for the metrics header (`variant`, `extra`).
    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        (String::new(), serde_json::Map::new())
    }

    /// The whole optimiser state for a checkpoint of this step, in the engine's flat layout,
    /// where the strategy keeps it outside the engine (ZeRO-1's shards: gathered); `None`: the
    /// engine holds it. Called on every rank at the same step, since gathering is collective.
    fn checkpoint_momentum(&mut self, _engine: &Engine) -> anyhow::Result<Option<Vec<f32>>> {
        Ok(None)
    }

    /// Whether the run's parameters and optimiser state live on servers, not in this process
    /// (PS): each worker then checkpoints only its own state (its data position, its top-k
    /// residual), and a resumed worker reads it after [`Strategy::start`] has met the servers.
    fn state_on_servers(&self) -> bool {
        false
    }

    /// Under BSP on servers, the version of the parameters this worker holds (its next
    /// gradient is computed from it): steps and versions advance together, so a resumed
    /// worker's next step is the one this version stands for. `None` elsewhere.
    fn server_version(&self) -> Option<u64> {
        None
    }

    /// What this strategy keeps between steps besides the engine's state (top-k residuals),
    /// as tensors for the checkpoint of this step, gathered where each rank keeps its own.
    /// Called on every rank at the same step. `None`: nothing.
    fn checkpoint_state(&mut self, _engine: &Engine) -> anyhow::Result<Option<Tensors>> {
        Ok(None)
    }

    /// Take back what [`Strategy::checkpoint_state`] wrote, from the checkpoint a run resumes
    /// from (after [`Strategy::start`]).
    fn restore_state(&mut self, _saved: &Tensors) -> anyhow::Result<()> {
        Ok(())
    }

    /// What besides a lower learning rate may keep this strategy's training from diverging,
    /// worded as advice for the error that stops a diverged run (`None`: nothing of its own).
    fn divergence_advice(&self) -> Option<String> {
        None
    }
}

/// Run `f` on the engine and return its result with the milliseconds it took, queued device
/// work included.
pub fn timed<T>(
    engine: &mut Engine,
    f: impl FnOnce(&mut Engine) -> gradsync_core::Result<T>,
) -> anyhow::Result<(T, f64)> {
    let t = Instant::now();
    let out = f(engine)?;
    engine.synchronize()?;
    Ok((out, ms_since(t)))
}

/// [`timed`], also recording the span as `name` on the `compute` lane of `trace`.
pub fn timed_span<T>(
    engine: &mut Engine,
    trace: &Trace,
    name: &'static str,
    f: impl FnOnce(&mut Engine) -> gradsync_core::Result<T>,
) -> anyhow::Result<(T, f64)> {
    let t = Instant::now();
    let out = timed(engine, f)?;
    trace.span(name, "compute", "compute", t);
    Ok(out)
}

/// Forward over a training batch, timed into `rec` and traced.
pub fn forward(
    engine: &mut Engine,
    x: &[f32],
    y: &[u32],
    rec: &mut Step,
    trace: &Trace,
) -> anyhow::Result<BatchLoss> {
    let (loss, ms) = timed_span(engine, trace, "forward", |e| e.forward(x, y, true))?;
    rec.forward_ms = ms;
    Ok(loss)
}

/// Backward into the gradient buffer (added to it when `accumulate`), timed into `rec` and
/// traced.
pub fn backward(engine: &mut Engine, accumulate: bool, rec: &mut Step, trace: &Trace) -> anyhow::Result<()> {
    let ((), ms) = timed_span(engine, trace, "backward", |e| e.backward(accumulate))?;
    rec.backward_ms = ms;
    Ok(())
}

/// Gradient accumulation over `every` micro-steps (DDP's `no_sync`): counts this micro-step in
/// `count` and says whether backward adds to the gradients already there, and whether this
/// micro-step synchronises and updates.
pub fn micro_step(count: &mut u64, every: u64) -> (bool, bool) {
    *count += 1;
    (!(*count - 1).is_multiple_of(every), count.is_multiple_of(every))
}

/// What a synchronising strategy (DDP, ZeRO-1) does before it communicates: [`forward`], then
/// on a `no_sync` micro-step ([`micro_step`]) the local [`backward`] that accumulates into the
/// gradient buffer, and nothing more. Returns the loss and, on a step that synchronises,
/// whether its backward must accumulate (`None`: this micro-step is done).
pub fn forward_unless_synced(
    engine: &mut Engine,
    x: &[f32],
    y: &[u32],
    rec: &mut Step,
    trace: &Trace,
    (micro, every): (&mut u64, u64),
) -> anyhow::Result<(BatchLoss, Option<bool>)> {
    let loss = forward(engine, x, y, rec, trace)?;
    let (accumulate, sync) = micro_step(micro, every);
    if !sync {
        backward(engine, accumulate, rec, trace)?;
        return Ok((loss, None));
    }
    Ok((loss, Some(accumulate)))
}

/// [`forward`] then [`backward`] of one batch, the gradient buffer overwritten.
pub fn forward_backward(
    engine: &mut Engine,
    x: &[f32],
    y: &[u32],
    rec: &mut Step,
    trace: &Trace,
) -> anyhow::Result<BatchLoss> {
    let loss = forward(engine, x, y, rec, trace)?;
    backward(engine, false, rec, trace)?;
    Ok(loss)
}

/// Peak resident memory of this process so far (`VmHWM` of /proc/self/status), KiB; `None`
/// where the kernel does not report it.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    line.trim().trim_end_matches("kB").trim().parse().ok()
}

/// Record a rank's memory in the metrics header's `extra`: the optimiser-state bytes it holds
/// (`optimizer_state_bytes`: the momentum, whole in DDP, a 1/n shard in ZeRO-1) and its peak
/// resident memory once started (`peak_rss_kib_at_start`: parameters, gradients and optimiser
/// state are allocated by then; activations come with the first step).
pub fn describe_memory(m: &mut serde_json::Map<String, serde_json::Value>, state_bytes: usize) {
    m.insert("optimizer_state_bytes".into(), state_bytes.into());
    if let Some(kib) = peak_rss_kib() {
        m.insert("peak_rss_kib_at_start".into(), kib.into());
    }
}
