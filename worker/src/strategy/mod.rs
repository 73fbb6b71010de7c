//! How one step's gradients become an update: the one seam between the training loop (written
//! once, in [`crate::train`]) and the ways of synchronising, each in its own file.
//!
//! Here: the [`Strategy`] trait, the [`Shape`] through which a strategy tells the loop how to
//! draw its data, the [`Batch`] a step is handed (the next one drawn on demand), and the timed
//! compute helpers every strategy shares ([`forward`],
//! [`backward`]), so forward and backward are timed and traced in one place. Each strategy
//! takes its own typed configuration; [`crate::setup`] builds it from the flags. `shell.rs` is
//! what DDP and ZeRO-1 share (connection, initial broadcast, the start and end of a step);
//! `bucket.rs` is how DDP reduces one bucket under `--compress` (the f32 or half-precision
//! all-reduce, or top-k all-gathered), the work DDP hands the communicator for each bucket;
//! `hybrid.rs` a sparse model's table on parameter servers beside DDP (`--mode hybrid`);
//! `servers.rs` what PS and the hybrid's table share: the client on its runtime, its heartbeat,
//! and a sparse table's rows fetched ahead of each step and pulled whole; `error.rs` the
//! [`StrategyError`] every strategy returns.
//!
//! A strategy owns what differs between the modes, so the loop asks it nothing about which
//! mode it is: where a resumed run's state is read and in what order ([`Strategy::start`]),
//! what a checkpoint holds and which rank writes it ([`Strategy::checkpoint`]), whether it
//! reads the next batch ahead ([`Batch::next_x`]). A new mode is one file here and its
//! configuration in [`crate::setup`].

mod bucket;
mod ddp;
mod dp;
mod error;
mod hybrid;
mod local;
pub mod ps;
mod servers;
mod shell;
mod sparse;
mod zero1;

use std::path::PathBuf;
use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::net::BatchLoss;
use gradsync_core::trace::Trace;

use crate::resume::{CheckpointAt, Contents, Resume, Resumed};

pub use ddp::Ddp;
pub use dp::{Dp, DpConfig, FaultKind, ReplicaFault};
pub use error::{Result, StrategyError};
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

/// One step's batch: the rows it trains on, and a way to the batch after it, drawn only when
/// the strategy asks for it (a strategy that fetches what a step reads ahead of it: a
/// parameter server's table rows for the next batch are pulled during this step).
pub struct Batch<'a> {
    /// This rank's rows (`rows x input` values).
    pub x: &'a [f32],
    /// Their labels.
    pub y: &'a [u32],
    next: Option<&'a mut dyn NextBatch>,
}

/// Where the batch after a step's comes from: the loop's sampler, which draws it (the next
/// epoch's first, at the end of one) only when asked.
pub trait NextBatch {
    /// The next step's rows, drawn; `None` after the run's last step.
    fn next_x(&mut self) -> Option<&[f32]>;
}

impl<'a> Batch<'a> {
    /// Rows `x` and labels `y`, followed by what `next` draws (`None`: nothing follows).
    pub fn new(x: &'a [f32], y: &'a [u32], next: Option<&'a mut dyn NextBatch>) -> Self {
        Batch { x, y, next }
    }

    /// The rows of the step after this one; `None` after the run's last.
    pub fn next_x(&mut self) -> Option<&[f32]> {
        self.next.as_mut().and_then(|n| n.next_x())
    }
}

/// One way of training: local, DP, PS, DDP, ZeRO-1 or the hybrid. The loop asks nothing about
/// which: each strategy starts (or resumes) where it keeps its state, steps, makes its
/// parameters whole when asked, checkpoints what it holds, and finishes.
pub trait Strategy {
    /// How the loop draws this strategy's data.
    fn shape(&self) -> Shape;

    /// Before the first step: take the run's state where `resume` says (the newest checkpoint,
    /// under `--resume`) and agree on the initial parameters (broadcast, register, pull).
    /// Where the strategy keeps its state decides the order: an engine's is read before the
    /// ranks agree on it (rank 0's wins, [`Resume::engine`]); a parameter-server worker's own
    /// after it has met the servers, whose version says where the run is
    /// ([`Resume::worker`]). Returns where a resumed run continues (`None`: from the start).
    fn start(&mut self, engine: &mut Engine, resume: &Resume) -> Result<Option<Resumed>>;

    /// One step on this rank's `batch`: forward, backward, gradient synchronisation and
    /// update. Fills the timing and traffic fields of `rec`.
    fn step(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, rec: &mut Step) -> Result<BatchLoss>;

    /// Make the engine's parameters whole before anything reads them outside a step
    /// (evaluation, the saved model), where the strategy keeps part of them elsewhere and
    /// brings in only what each step reads (a parameter server's table rows).
    fn whole_params(&mut self, _engine: &mut Engine) -> Result<()> {
        Ok(())
    }

    /// The checkpoint after a step (`--checkpoint`), called on every rank at the same step,
    /// since what a strategy keeps outside the engine is gathered collectively: the strategy
    /// decides what it holds and which rank writes it. Returns the folder this rank wrote
    /// (`None`: another rank writes). By default the engine holds the run's whole state, the
    /// same on every rank, and rank 0 writes it.
    fn checkpoint(&mut self, engine: &mut Engine, at: &CheckpointAt<'_>) -> Result<Option<PathBuf>> {
        if at.rank != 0 {
            return Ok(None);
        }
        self.whole_params(engine)
            .map_err(StrategyError::checkpoint("bringing the parameters in for the checkpoint"))?;
        Ok(Some(at.write(Contents::engine(engine))?))
    }

    /// After the last step: leave cleanly (deregister, close the ring).
    fn finish(&mut self, engine: &mut Engine) -> Result<()>;

    /// The optimiser applied to this run's parameters when it is not this process's own (the
    /// parameter servers'), known after [`Strategy::start`].
    fn applied_optimiser(&self) -> Option<gradsync_core::optim::SgdConfig> {
        None
    }

    /// Per-strategy detail for the metrics header (`variant`, `extra`).
    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        (String::new(), serde_json::Map::new())
    }

    /// What besides a lower learning rate may keep this strategy's training from diverging,
    /// worded as advice for the error that stops a diverged run (`None`: nothing of its own).
    fn divergence_advice(&self) -> Option<String> {
        None
    }
}

// The compute helpers below fail only where the engine does: they return its error, which a
// strategy's `?` turns into `StrategyError::Core`.

/// Run `f` on the engine and return its result with the milliseconds it took, queued device
/// work included.
pub fn timed<T>(
    engine: &mut Engine,
    f: impl FnOnce(&mut Engine) -> gradsync_core::Result<T>,
) -> gradsync_core::Result<(T, f64)> {
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
) -> gradsync_core::Result<(T, f64)> {
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
) -> gradsync_core::Result<BatchLoss> {
    let (loss, ms) = timed_span(engine, trace, "forward", |e| e.forward(x, y, true))?;
    rec.forward_ms = ms;
    Ok(loss)
}

/// Backward into the gradient buffer (added to it when `accumulate`), timed into `rec` and
/// traced.
pub fn backward(
    engine: &mut Engine,
    accumulate: bool,
    rec: &mut Step,
    trace: &Trace,
) -> gradsync_core::Result<()> {
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
) -> gradsync_core::Result<(BatchLoss, Option<bool>)> {
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
) -> gradsync_core::Result<BatchLoss> {
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
