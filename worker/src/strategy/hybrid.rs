//! `--mode hybrid`, what recommendation systems train with (HugeCTR, Persia, Monolith): a
//! sparse model's table on parameter servers that hold it alone (`gradsync-server
//! --table-only`; rows pushed and pulled by id, updated there lazily), the rest of the model
//! all-reduced among the workers by DDP's ring and updated by each of them. This file is the
//! table's side ([`TablePs`]); DDP runs it beside its buckets in the same step
//! (`strategy/ddp.rs`): after backward, the rows the batch named are pushed and the next
//! batch's rows pulled, then the ranks update everything but the table. The connection, the
//! heartbeat and the fetching of a batch's rows ahead of it are those of `--mode ps`
//! (`servers.rs`).

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;

use super::ps::PsConfig;
use super::servers::Servers;
use super::{Batch, Result, StrategyError};
use crate::ps::TableRows;

/// The table's parameter servers, as one hybrid worker reaches them.
pub struct TablePs {
    servers: Servers,
    cfg: PsConfig,
}

impl TablePs {
    /// Connect to the servers of `cfg` (registration waits for [`TablePs::start`]).
    pub fn connect(cfg: PsConfig) -> Result<Self> {
        let mut servers = Servers::connect(&cfg, "gradsync-table")?;
        servers.client.set_table_only(true);
        Ok(TablePs { servers, cfg })
    }

    /// Register with every server (which must hold the model's table alone) and start the
    /// heartbeat. Under anything but BSP the ranks' dense updates would not wait for the
    /// table's, so only BSP servers are taken; and the servers must step the table with the
    /// optimiser the ranks step the rest with (`dense`), or the model would train at two rates.
    pub fn start(&mut self, engine: &mut Engine, dense: &SgdConfig) -> Result<()> {
        let t =
            engine.layout().table.clone().ok_or_else(|| {
                StrategyError::Config("--mode hybrid needs a model with a sparse table".into())
            })?;
        let s = &mut self.servers;
        if s.client.sync() != gradsync_proto::SyncMode::Bsp {
            return Err(StrategyError::Config(format!(
                "--mode hybrid: the table's servers run --sync {}; the ring is synchronous, so they must run bsp",
                s.client.sync()
            )));
        }
        s.client.set_table(Some((t.range.clone(), t.rows, t.dim)));
        let (rank, world, fp, n) =
            (self.cfg.rank, self.cfg.world, self.cfg.fingerprint.clone(), engine.layout().len);
        s.rt.block_on(s.client.register(rank, world, &fp, n))?;
        if let Some(applied) = s.client.optimiser().map(|o| o.0)
            && applied != *dense
        {
            // Leave the servers as they were, so that a corrected run is taken at once.
            let _ = s.leave();
            return Err(StrategyError::Optimiser(gradsync_core::Error::invalid(
                "--mode hybrid",
                format!(
                    "the table's servers step it with --lr {} --momentum {} --weight-decay {}, and this worker \
                     steps the rest of the model with --lr {} --momentum {} --weight-decay {}: give the \
                     servers and the workers the same optimiser flags",
                    applied.lr,
                    applied.momentum,
                    applied.weight_decay,
                    dense.lr,
                    dense.momentum,
                    dense.weight_decay
                ),
            )));
        }
        s.rows = Some(TableRows::new(t.dim));
        s.keep_alive();
        Ok(())
    }

    /// Before the forward pass of `batch`: its rows current in the engine, the next batch's
    /// named for this step's pull. Returns the milliseconds it took (none when the step before
    /// fetched them).
    pub fn fetch(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, trace: &Trace) -> Result<f64> {
        if self.servers.rows.is_none() {
            return Err(StrategyError::NotStarted("the table's servers used"));
        }
        Ok(self.servers.fetch_rows(engine, batch, trace)?.ms)
    }

    /// After backward: push the gradients of the rows the batch named, pull the next batch's
    /// rows into the engine, and clear the named rows' gradients so the ranks' own update
    /// leaves the table to the servers. Records the rows and the traffic in `rec`.
    pub fn exchange(&mut self, engine: &mut Engine, rec: &mut Step, trace: &Trace) -> Result<()> {
        let t = std::time::Instant::now();
        let s = &mut self.servers;
        let rows = s.rows.as_mut().ok_or(StrategyError::NotStarted("the table's servers used"))?;
        rec.rows = Some(rows.stage(engine)? as u64);
        let (push, pull) = s.rt.block_on(s.client.rows_step(rows.step()))?;
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

    /// Every row of the table into the engine (before evaluation, a checkpoint, `--save`).
    pub fn whole_table(&mut self, engine: &mut Engine) -> Result<()> {
        self.servers.whole_table(engine)
    }

    /// Leave the servers.
    pub fn finish(&mut self) -> Result<()> {
        self.servers.leave()
    }

    /// The servers, for the metrics header.
    pub fn servers(&self) -> &[String] {
        &self.cfg.servers
    }
}
