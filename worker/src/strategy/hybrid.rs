//! `--mode hybrid`, what recommendation systems train with (HugeCTR, Persia, Monolith): a
//! sparse model's table on parameter servers that hold it alone (`gradsync-server
//! --table-only`; rows pushed and pulled by id, updated there lazily), the rest of the model
//! all-reduced among the workers by DDP's ring and updated by each of them. This file is the
//! table's side ([`TablePs`]); DDP runs it beside its buckets in the same step
//! (`strategy/ddp.rs`): after backward, the rows the batch named are pushed and the next
//! batch's rows pulled, then the ranks update everything but the table.

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::trace::Trace;

use super::ps::PsConfig;
use crate::ps::{PsClient, TableRows};

/// The table's parameter servers, as one hybrid worker reaches them.
pub struct TablePs {
    rt: tokio::runtime::Runtime,
    client: PsClient,
    rows: Option<TableRows>,
    cfg: PsConfig,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

impl TablePs {
    /// Connect to the servers of `cfg` (registration waits for [`TablePs::start`]).
    pub fn connect(cfg: PsConfig) -> anyhow::Result<Self> {
        let (rt, mut client) = super::ps::connect(&cfg, "gradsync-table")?;
        client.set_table_only(true);
        Ok(TablePs { rt, client, rows: None, cfg, heartbeat: None })
    }

    /// Register with every server (which must hold the model's table alone) and start the
    /// heartbeat. Under anything but BSP the ranks' dense updates would not wait for the
    /// table's, so only BSP servers are taken.
    pub fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        let t = engine.layout().table.clone().context("--mode hybrid needs a model with a sparse table")?;
        anyhow::ensure!(
            self.client.sync() == gradsync_proto::SyncMode::Bsp,
            "--mode hybrid: the table's servers run --sync {}; the ring is synchronous, so they must run bsp",
            self.client.sync()
        );
        self.client.set_table(Some((t.range.clone(), t.rows, t.dim)));
        let (rank, world, fp, n) =
            (self.cfg.rank, self.cfg.world, self.cfg.fingerprint.clone(), engine.layout().len);
        self.rt.block_on(self.client.register(rank, world, &fp, n))?;
        self.rows = Some(TableRows::new(t.dim));
        let mut hb = self.client.share();
        self.heartbeat = Some(self.rt.spawn(async move {
            let mut tick = tokio::time::interval(gradsync_proto::HEARTBEAT_INTERVAL);
            loop {
                tick.tick().await;
                if let Err(e) = hb.heartbeat().await {
                    tracing::warn!("heartbeat: {e:#}");
                }
            }
        }));
        Ok(())
    }

    fn rows(&mut self) -> anyhow::Result<&mut TableRows> {
        self.rows.as_mut().context("the table's servers used before start")
    }

    /// Before the forward pass of batch `x`: its rows current in the engine. Returns the
    /// milliseconds it took (none when the step before fetched them).
    pub fn ensure(&mut self, engine: &mut Engine, x: &[f32], trace: &Trace) -> anyhow::Result<f64> {
        let t = std::time::Instant::now();
        let rows = self.rows.as_mut().context("the table's servers used before start")?;
        if self.rt.block_on(rows.ensure(&mut self.client, engine, x))? > 0 {
            trace.span("pull rows", "comm", "comm", t);
            return Ok(gradsync_core::metrics::ms_since(t));
        }
        Ok(0.0)
    }

    /// After backward: push the gradients of the rows the batch named, pull the next batch's
    /// rows into the engine, and clear the named rows' gradients so the ranks' own update
    /// leaves the table to the servers. Records the rows and the traffic in `rec`.
    pub fn exchange(&mut self, engine: &mut Engine, rec: &mut Step, trace: &Trace) -> anyhow::Result<()> {
        let t = std::time::Instant::now();
        let rows = self.rows.as_mut().context("the table's servers used before start")?;
        rec.rows = Some(rows.stage(engine)? as u64);
        let (push, pull) = self.rt.block_on(self.client.rows_step(rows.step()))?;
        rows.land(engine)?;
        rows.clear_named(engine)?;
        trace.span("push and pull rows", "comm", "comm", t);
        let ms = gradsync_core::metrics::ms_since(t);
        // The table's gradient is ready last, so its rows travel once backward ends: all of
        // that time is exposed.
        rec.comm_ms += ms;
        rec.comm_exposed_ms += ms;
        rec.bytes_sent += push.bytes;
        rec.bytes_recv += pull.bytes;
        Ok(())
    }

    /// The batch after the coming one.
    pub fn next_batch(&mut self, engine: &Engine, x: &[f32]) -> anyhow::Result<()> {
        Ok(self.rows()?.set_next(engine, x)?)
    }

    /// Every row of the table into the engine (before evaluation, a checkpoint, `--save`).
    pub fn sync(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        let rows = self.rows.as_mut().context("the table's servers used before start")?;
        self.rt.block_on(rows.sync(&mut self.client, engine))?;
        Ok(())
    }

    /// Leave the servers.
    pub fn finish(&mut self) -> anyhow::Result<()> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        Ok(self.rt.block_on(self.client.deregister())?)
    }

    /// The servers, for the metrics header.
    pub fn servers(&self) -> &[String] {
        &self.cfg.servers
    }
}

impl Drop for TablePs {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}
