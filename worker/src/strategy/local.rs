//! Local training: one process, one replica, no communication. Every other mode is checked
//! against it.

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::optim::SgdConfig;

use super::{Strategy, forward_backward, timed};

/// Forward, backward, update.
#[derive(Debug)]
pub struct Local {
    sgd: SgdConfig,
}

impl Local {
    /// With these optimiser settings.
    pub fn new(sgd: SgdConfig) -> Self {
        Local { sgd }
    }
}

impl Strategy for Local {
    fn start(&mut self, _engine: &mut Engine) -> anyhow::Result<()> {
        Ok(())
    }

    fn step(
        &mut self,
        engine: &mut Engine,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss> {
        let loss = forward_backward(engine, x, y, rec)?;
        let ((), ms) = timed(engine, |e| e.update(&self.sgd, 1.0))?;
        rec.update_ms = ms;
        Ok(loss)
    }

    fn finish(&mut self, _engine: &mut Engine) -> anyhow::Result<()> {
        Ok(())
    }
}
