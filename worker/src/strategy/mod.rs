//! How one step's gradients become an update: the one seam between the training loop (written
//! once, in [`crate::train`]) and the ways of synchronising, each in its own file.

mod ddp;
mod dp;
mod local;
pub mod ps;

use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::trace::Trace;

pub use ddp::Ddp;
pub use dp::Dp;
pub use local::Local;
pub use ps::Ps;

/// One way of training: local, DP, PS or DDP.
pub trait Strategy {
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

    /// The optimiser applied to this run's parameters when it is not this process's own (the
    /// parameter servers'), known after [`Strategy::start`].
    fn applied_optimiser(&self) -> Option<gradsync_core::optim::SgdConfig> {
        None
    }

    /// Per-strategy detail for the metrics header (`variant`, `extra`).
    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        (String::new(), serde_json::Map::new())
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

/// Milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Forward and backward of one batch into the gradient buffer, timed into `rec`.
pub fn forward_backward(
    engine: &mut Engine,
    x: &[f32],
    y: &[u32],
    rec: &mut Step,
) -> anyhow::Result<BatchLoss> {
    forward_backward_traced(engine, x, y, rec, &Trace::disabled())
}

/// [`forward_backward`], also recording `forward` and `backward` spans in `trace`.
pub fn forward_backward_traced(
    engine: &mut Engine,
    x: &[f32],
    y: &[u32],
    rec: &mut Step,
    trace: &Trace,
) -> anyhow::Result<BatchLoss> {
    let (loss, ms) = timed_span(engine, trace, "forward", |e| e.forward(x, y, true))?;
    rec.forward_ms = ms;
    let ((), ms) = timed_span(engine, trace, "backward", |e| e.backward(false))?;
    rec.backward_ms = ms;
    Ok(loss)
}
