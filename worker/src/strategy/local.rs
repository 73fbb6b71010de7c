//! Local training: one process, one replica, no communication. Every other mode is checked
//! against it.

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::net::BatchLoss;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;

use super::{Batch, Result, Shape, Strategy, forward_backward, timed_span};
use crate::resume::{Resume, Resumed};

/// Forward, backward, update.
#[derive(Debug)]
pub struct Local {
    sgd: SgdConfig,
    shape: Shape,
    trace: Trace,
}

impl Local {
    /// With these optimiser settings, on shard `shape` of the data (the whole of it, unless
    /// the flags name a rank), recording spans in `trace`.
    pub fn new(sgd: SgdConfig, shape: Shape, trace: Trace) -> Self {
        Local { sgd, shape, trace }
    }
}

impl Strategy for Local {
    fn shape(&self) -> Shape {
        self.shape
    }

    fn start(&mut self, engine: &mut Engine, resume: &Resume) -> Result<Option<Resumed>> {
        Ok(resume.engine(engine)?)
    }

    fn step(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, rec: &mut Step) -> Result<BatchLoss> {
        let loss = forward_backward(engine, batch.x, batch.y, rec, &self.trace)?;
        let ((), ms) = timed_span(engine, &self.trace, "update", |e| e.update(&self.sgd, 1.0))?;
        rec.update_ms = ms;
        Ok(loss)
    }

    fn finish(&mut self, _engine: &mut Engine) -> Result<()> {
        Ok(())
    }
}
