//! What a worker keeps of a sparse model's table on parameter servers between steps
//! ([`TableRows`]): the rows of the next batch, pulled with each step's push, and the rows of
//! this one, whose gradients the step pushes. It drives [`PsClient`] (the rows on the wire are
//! in `rows.rs`, below the client) and the engine's rows.

use gradsync_core::Engine;
use gradsync_core::net::RowsOf;

use super::bulk::Transfer;
use super::client::PsClient;
use super::error::{PsError, Result};
use super::rows::RowsStep;

/// A worker's side of a table on parameter servers, between steps: each step pushes the
/// gradients of the rows its batch named and pulls the rows of the next batch (known ahead,
/// `Batch::next_x`), so the rows a forward pass reads are always of the version the
/// step before made. Used by `--mode ps` and `--mode hybrid` alike.
#[derive(Debug, Default)]
pub struct TableRows {
    dim: usize,
    /// The rows the next batch names.
    next: Vec<u32>,
    /// The rows whose values in the engine are of the current version (pulled for this batch).
    fresh: Option<Vec<u32>>,
    /// The rows this step's batch named, and their gradients.
    named: Vec<u32>,
    grads: Vec<f32>,
    pulled: Vec<f32>,
}

impl TableRows {
    /// For a table of rows of `dim` values.
    pub fn new(dim: usize) -> Self {
        TableRows { dim, ..TableRows::default() }
    }

    /// The batch after the coming one is `x`: its rows are pulled with the coming step's push.
    pub fn set_next(&mut self, engine: &Engine, x: &[f32]) -> Result<()> {
        self.next = engine.rows_of(x)?;
        Ok(())
    }

    /// Make the engine's rows of batch `x` current before its forward pass, unless the step
    /// before pulled them (it does, except on the first step and after a step that could not
    /// look ahead). Returns the bytes pulled.
    pub async fn ensure(&mut self, client: &mut PsClient, engine: &mut Engine, x: &[f32]) -> Result<u64> {
        let want = engine.rows_of(x)?;
        if self.fresh.as_ref() == Some(&want) {
            return Ok(0);
        }
        self.pulled.resize(want.len() * self.dim, 0.0);
        let got = client.pull_rows(&want, &mut self.pulled).await?;
        engine.write_rows(RowsOf::Params, &want, &self.pulled)?;
        self.fresh = Some(want);
        Ok(got.bytes)
    }

    /// After backward: read the gradients of the rows the batch named, for the push. Returns
    /// how many rows that is.
    pub fn stage(&mut self, engine: &Engine) -> Result<usize> {
        self.named.clear();
        self.named.extend_from_slice(engine.batch_rows());
        self.grads.resize(self.named.len() * self.dim, 0.0);
        engine.read_rows(RowsOf::Grads, &self.named, &mut self.grads)?;
        self.pulled.resize(self.next.len() * self.dim, 0.0);
        Ok(self.named.len())
    }

    /// The step's rows: the staged ones to push, the next batch's to pull.
    pub fn step(&mut self) -> RowsStep<'_> {
        RowsStep { push: (&self.named, &self.grads), pull: (&self.next, &mut self.pulled) }
    }

    /// After the exchange: the pulled rows into the engine's parameters.
    pub fn land(&mut self, engine: &mut Engine) -> Result<()> {
        engine.write_rows(RowsOf::Params, &self.next, &self.pulled)?;
        self.fresh = Some(std::mem::take(&mut self.next));
        Ok(())
    }

    /// Clear the staged rows' gradients in the engine, so that its own update leaves them (the
    /// servers step the table; `--mode hybrid`, whose ranks update the rest locally).
    pub fn clear_named(&mut self, engine: &mut Engine) -> Result<()> {
        self.grads.fill(0.0);
        engine.write_rows(RowsOf::Grads, &self.named, &self.grads)?;
        Ok(())
    }

    /// Every row of the table, of the servers' current version, into the engine.
    pub async fn sync(&mut self, client: &mut PsClient, engine: &mut Engine) -> Result<Transfer> {
        let table = engine.layout().table.clone().ok_or_else(|| PsError::Invalid {
            what: "the table's rows",
            why: "the model has no sparse table".into(),
        })?;
        self.pulled.resize(table.range.len(), 0.0);
        let t = client.pull_all_rows(&mut self.pulled).await?;
        engine.write_params(table.range.start, &self.pulled)?;
        Ok(t)
    }
}
