//! DDP: every rank keeps a full replica; gradients are summed across ranks by all-reduce in
//! buckets, then every rank takes the same optimiser step (no parameter traffic after the
//! initial broadcast from rank 0).
//!
//! Buckets follow PyTorch DDP: `--bucket-mb` of gradients aligned to tensors, in the order
//! backward produces them (last layer first). Each bucket is handed to the communicator the
//! moment backward finishes it ([`Communicator::backward_synced`]), which reduces it where it
//! works: the TCP or shared-memory ring in host memory on a communication thread (a GPU
//! engine's bucket staged through pinned memory as it is finished), NCCL in GPU memory on its
//! own stream (under `--compress fp16|bf16` rounded to half precision and widened back there
//! too); so the all-reduce runs while backward computes the earlier layers, on either device.
//! What is left when backward ends is the *exposed* communication. How one bucket is reduced
//! under `--compress` is `bucket.rs`; what DDP shares with ZeRO-1 is `shell.rs`. Under
//! `--mode hybrid` a sparse model's table is left out of the buckets and moved by rows to its
//! parameter servers instead (`hybrid.rs`).

use std::path::PathBuf;

use gradsync_core::Engine;
use gradsync_core::compress::Compression;
use gradsync_core::metrics::Step;
use gradsync_core::net::BatchLoss;
use gradsync_core::state_dict::{Entry, Tensors};

use super::bucket::BucketReduce;
use super::error::During;
use super::hybrid::TablePs;
use super::ps::PsConfig;
use super::shell::{Backend, DdpConfig, Shell};
use super::sparse::{RowGather, SparseGrads};
use super::{Batch, Result, Shape, Strategy, StrategyError, timed_span};
use crate::resume::{CheckpointAt, Contents, Resume, Resumed};

/// DDP over one communicator.
pub struct Ddp {
    shell: Shell,
    /// Optimiser-state bytes the engine holds once started (the full momentum buffer).
    state_bytes: usize,
    /// How a bucket is reduced (`--compress`), with what that keeps between steps.
    reduce: BucketReduce,
    compression: Compression,
    sparse_grads: SparseGrads,
    /// The table's rows all-gathered (`--sparse-grads allgather`).
    rows: RowGather,
    /// The table on its parameter servers (`--mode hybrid`).
    table: Option<TablePs>,
}

impl Ddp {
    /// Meet the other ranks (rendezvous through rank 0's store) and connect the backend.
    pub fn connect(c: DdpConfig) -> Result<Ddp> {
        let reduce = BucketReduce::new(c.compression);
        // Refused before meeting the other ranks.
        if c.backend == Backend::Nccl
            && let Some(why) = reduce.device_refusal()
        {
            return Err(StrategyError::Config(why));
        }
        Ok(Ddp {
            shell: Shell::connect(&c)?,
            state_bytes: 0,
            reduce,
            compression: c.compression,
            sparse_grads: c.sparse_grads,
            rows: RowGather::default(),
            table: None,
        })
    }

    /// `--mode hybrid`: DDP among the workers for everything but a sparse model's table, which
    /// lives on the servers of `ps` (started with `--table-only`).
    pub fn connect_hybrid(c: DdpConfig, ps: PsConfig) -> Result<Ddp> {
        if c.sparse_grads != SparseGrads::Servers {
            return Err(StrategyError::Config("--mode hybrid moves the table by rows".into()));
        }
        // The servers first: a wrong address fails before the ranks meet.
        let table = TablePs::connect(ps)?;
        Ok(Ddp { table: Some(table), ..Ddp::connect(c)? })
    }
}

impl Strategy for Ddp {
    fn shape(&self) -> Shape {
        Shape::processes(self.shell.world, self.shell.rank)
    }

    /// The engine's state from the checkpoint (rank 0's wins at the broadcast), then this
    /// rank's own top-k residual.
    fn start(&mut self, engine: &mut Engine, resume: &Resume) -> Result<Option<Resumed>> {
        let resumed = resume.engine(engine)?;
        let (_, momentum) = self.shell.start(engine)?;
        if let Some(m) = momentum {
            engine.write_momentum(&m)?;
        }
        if let Some(t) = &mut self.table {
            t.start(engine, &self.shell.sgd)?;
        }
        self.state_bytes = engine.updated_state_bytes();
        if let Some(saved) = resumed.as_ref().and_then(|r| r.state.as_ref())
            && matches!(self.compression, Compression::TopK(_))
        {
            let name = residual_name(self.shell.rank);
            let e = saved
                .get(&name)
                .ok_or_else(|| StrategyError::Restore(format!("the checkpoint holds no {name}")))?;
            self.reduce.restore_residual(e.to_f32());
        }
        Ok(resumed)
    }

    fn step(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, rec: &mut Step) -> Result<BatchLoss> {
        let fetch_ms = match &mut self.table {
            Some(t) => t.fetch(engine, batch, &self.shell.trace)?,
            None => 0.0,
        };
        rec.comm_ms += fetch_ms;
        Shell::step(
            self,
            |d| &mut d.shell,
            engine,
            (batch.x, batch.y),
            rec,
            |d, engine, s, rec| {
                let sh = &mut d.shell;
                let synced = sh.comm.backward_synced(
                    engine,
                    s.plan,
                    s.accumulate,
                    &mut d.reduce,
                    sh.overlap,
                    sh.sync_bn,
                    &sh.trace,
                )?;
                rec.backward_ms = synced.backward_ms;
                rec.comm_ms += synced.comm_ms;
                rec.comm_exposed_ms += synced.exposed_ms;
                if let Some(t) = &mut d.table {
                    t.exchange(engine, rec, &sh.trace)?;
                }
                if d.sparse_grads == SparseGrads::Allgather && engine.layout().table.is_some() {
                    // The table's gradient is ready last, so its rows travel once backward ends:
                    // all of that time is exposed.
                    let t = std::time::Instant::now();
                    let rows = d.rows.all_gather(sh.comm.get(), engine)?;
                    sh.trace.span("allgather rows", "comm", "comm", t);
                    let ms = gradsync_core::metrics::ms_since(t);
                    rec.comm_ms += ms;
                    rec.comm_exposed_ms += ms;
                    rec.rows = Some(rows as u64);
                }
                let ((), ms) = timed_span(engine, &sh.trace, "update", |e| e.update(&sh.sgd, s.scale))?;
                rec.update_ms = ms;
                Ok(())
            },
        )
    }

    fn finish(&mut self, _engine: &mut Engine) -> Result<()> {
        if let Some(t) = &mut self.table {
            t.finish()?;
        }
        self.shell.finish()
    }

    fn whole_params(&mut self, engine: &mut Engine) -> Result<()> {
        match &mut self.table {
            Some(t) => t.whole_table(engine),
            None => Ok(()),
        }
    }

    /// Every rank's top-k residual all-gathered (each rank keeps its own; rank 0 writes them
    /// all, `residual.rank<R>`) beside rank 0's engine.
    fn checkpoint(&mut self, engine: &mut Engine, at: &CheckpointAt<'_>) -> Result<Option<PathBuf>> {
        let residuals = self
            .gathered_residuals(engine)
            .map_err(StrategyError::checkpoint("gathering the checkpoint's state"))?;
        if at.rank != 0 {
            return Ok(None);
        }
        self.whole_params(engine)
            .map_err(StrategyError::checkpoint("bringing the parameters in for the checkpoint"))?;
        Ok(Some(at.write(Contents { state: residuals, ..Contents::engine(engine) })?))
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut m = serde_json::Map::new();
        m.insert("compression".into(), self.compression.to_string().into());
        m.insert("sparse_grads".into(), self.sparse_grads.name().into());
        if let Some(t) = &self.table {
            m.insert("servers".into(), t.servers().to_vec().into());
        }
        super::describe_memory(&mut m, self.state_bytes);
        let v = self.shell.describe(&mut m);
        (v, m)
    }
}

impl Ddp {
    /// Every rank's top-k residual, all-gathered; `None` without top-k.
    fn gathered_residuals(&mut self, engine: &Engine) -> Result<Option<Tensors>> {
        let n = engine.layout().len;
        let Some(mine) = self.reduce.residual(n) else { return Ok(None) };
        let (world, rank) = (self.shell.world, self.shell.rank);
        let mut all = vec![0.0; n * world];
        all[n * rank..n * (rank + 1)].copy_from_slice(&mine);
        self.shell.comm.get().all_gather(&mut all).during(|| "all-gathering the top-k residuals")?;
        Ok(Some(
            all.chunks_exact(n.max(1))
                .enumerate()
                .map(|(r, v)| (residual_name(r), Entry::f32(vec![n], v.to_vec())))
                .collect(),
        ))
    }
}

/// Rank `r`'s top-k residual's name in a checkpoint.
fn residual_name(r: usize) -> String {
    format!("residual.rank{r}")
}
