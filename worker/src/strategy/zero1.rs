//! ZeRO stage 1 (DeepSpeed; Rajbhandari et al., SC'20): every rank keeps the full parameters
//! and gradients, but only 1/n of the optimiser state. A step reduce-scatters the gradients,
//! each rank updates the parameters it owns with its own momentum, and an all-gather hands the
//! updated parameters to everyone: a parameter server whose shards live on the workers, moving
//! the ring's bytes (reduce-scatter plus all-gather is the ring all-reduce, split around the
//! update).
//!
//! Ownership follows DDP's buckets (the same plan, last layer first): rank r owns
//! `segment(len, n, r)` of *every* bucket, the part the ring's reduce-scatter leaves summed on
//! it. So a bucket is reduce-scattered the moment backward finishes it, on the communication
//! thread, exactly as DDP overlaps its all-reduce; the update and the all-gather wait for the
//! end of backward, which still reads the parameters.
//!
//! ```text
//!   bucket b:  | rank 0 | rank 1 | ... | rank n-1 |   (segment(len, n, r) of the bucket)
//!   backward ── reduce-scatter b (overlapped) ──> own segment summed on its owner
//!   after backward: owner updates its segments (its momentum shard), all-gather each bucket
//! ```
//!
//! The communicator takes each bucket where it works (`collective/buckets.rs`): on a CPU
//! engine the ring reduce-scatters the engine's own gradients in place; on a GPU engine each
//! bucket is staged through pinned host memory as backward finishes it, and reduce-scattered
//! there while backward goes on (NCCL: through its host path after backward), and only the
//! rank's summed segment goes back. The update works on the parameters and that segment in
//! place on the CPU, through a host copy of each bucket's parameters and segment on a GPU. The
//! engine's own momentum buffer is never allocated, so the optimiser state a rank holds is 1/n
//! of DDP's. What ZeRO-1 shares with DDP is `shell.rs`.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::model::segment;
use gradsync_core::net::BatchLoss;

use super::error::During;
use super::shell::Shell;
use super::{Batch, DdpConfig, Result, Shape, Strategy, StrategyError, describe_memory};
use crate::collective::{BucketWork, Collective};
use crate::resume::{CheckpointAt, Contents, Resume, Resumed};

/// What ZeRO-1 needs to know: DDP's settings (rendezvous, backend, buckets, overlap), and
/// whether the full momentum must be gathered at the end (a checkpoint holds it whole).
#[derive(Debug, Clone)]
pub struct Zero1Config {
    /// The communicator, buckets, overlap and optimiser, as DDP takes them.
    pub ddp: DdpConfig,
    /// All-gather the momentum shards into the engine after the last step (for `--save`).
    pub gather_momentum: bool,
}

/// ZeRO-1's work on each bucket: reduce-scatter it; this rank's summed segment is what the
/// engine needs back.
#[derive(Default)]
struct Scatter {
    /// Per bucket, the range of the flat buffer this rank owns and updates.
    owned: Vec<Range<usize>>,
    /// Per bucket, where its owned segment lies in the momentum shard.
    shard: Vec<Range<usize>>,
}

impl BucketWork for Scatter {
    type Error = StrategyError;

    fn name(&self) -> &'static str {
        "reduce-scatter"
    }

    fn host(
        &mut self,
        comm: &mut dyn Collective,
        index: usize,
        range: Range<usize>,
        values: &mut [f32],
    ) -> Result<Range<usize>> {
        let got = comm.reduce_scatter(values).during(|| format!("reduce-scatter of bucket {range:?}"))?;
        let own = &self.owned[index];
        let want = own.start - range.start..own.end - range.start;
        if got != want {
            return Err(StrategyError::Segment { index, got, want });
        }
        // Only this rank's summed segment is read by the update.
        Ok(want)
    }
}

/// ZeRO-1 over one communicator.
pub struct Zero1 {
    shell: Shell,
    scatter: Scatter,
    /// The momentum of the owned ranges, concatenated in bucket order: the optimiser shard.
    momentum: Vec<f32>,
    /// A bucket's parameters in host memory, where the engine keeps them elsewhere.
    scratch: Vec<f32>,
    gather_momentum: bool,
    /// Optimiser-state bytes held once started: the shard (and nothing in the engine).
    state_bytes: usize,
}

impl Zero1 {
    /// Meet the other ranks and connect the backend, as DDP does.
    pub fn connect(c: Zero1Config) -> Result<Zero1> {
        Ok(Zero1 {
            shell: Shell::connect(&c.ddp)?,
            scatter: Scatter::default(),
            momentum: Vec::new(),
            scratch: Vec::new(),
            gather_momentum: c.gather_momentum,
            state_bytes: 0,
        })
    }
}

impl Zero1 {
    /// The whole momentum on every rank: each rank's shards all-gathered bucket by bucket.
    fn gathered_momentum(&mut self, len: usize) -> Result<Vec<f32>> {
        let mut full = vec![0.0; len];
        for (own, m) in self.scatter.owned.iter().zip(&self.scatter.shard) {
            full[own.clone()].copy_from_slice(&self.momentum[m.clone()]);
        }
        for r in self.shell.plan_buckets() {
            self.shell
                .comm
                .get()
                .all_gather(&mut full[r.clone()])
                .during(|| format!("all-gather of the momentum of {r:?}"))?;
        }
        Ok(full)
    }
}

impl Strategy for Zero1 {
    fn shape(&self) -> Shape {
        Shape::processes(self.shell.world, self.shell.rank)
    }

    fn start(&mut self, engine: &mut Engine, resume: &Resume) -> Result<Option<Resumed>> {
        // One set of initial parameters and momentum (--load, --resume) for every rank: rank 0's.
        let resumed = resume.engine(engine)?;
        let (plan, p) = self.shell.start(engine)?;
        let (world, rank) = (self.shell.world, self.shell.rank);
        let owned: Vec<Range<usize>> = plan
            .buckets
            .iter()
            .map(|r| {
                let s = segment(r.len(), world, rank);
                r.start + s.start..r.start + s.end
            })
            .collect();
        let mut off = 0;
        let shard = owned
            .iter()
            .map(|o| {
                let m = off..off + o.len();
                off = m.end;
                m
            })
            .collect();
        self.momentum = match &p {
            Some(p) => owned.iter().flat_map(|o| p[o.clone()].iter().copied()).collect(),
            None => vec![0.0; owned.iter().map(|o| o.len()).sum()],
        };
        self.scatter = Scatter { owned, shard };
        drop(p);
        // The shard is the optimiser state from here on; the engine holds none.
        engine.release_momentum();
        self.state_bytes = self.momentum.len() * size_of::<f32>() + engine.optimizer_state_bytes();
        Ok(resumed)
    }

    fn step(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, rec: &mut Step) -> Result<BatchLoss> {
        Shell::step(
            self,
            |z| &mut z.shell,
            engine,
            (batch.x, batch.y),
            rec,
            |z, engine, s, rec| {
                let Zero1 { shell: sh, scatter, momentum, scratch, .. } = z;
                let synced = sh.comm.backward_synced(
                    engine,
                    s.plan,
                    s.accumulate,
                    scatter,
                    sh.overlap,
                    sh.sync_bn,
                    &sh.trace,
                )?;
                rec.backward_ms = synced.backward_ms;
                // Each owned segment updated with its momentum, then every bucket's parameters
                // all-gathered: all after backward, which still reads the parameters.
                let (mut update_ms, mut gather_ms) = (0.0, 0.0);
                let step = engine.part_update();
                for (i, r) in s.plan.buckets.iter().enumerate() {
                    let (own, m) = (scatter.owned[i].clone(), scatter.shard[i].clone());
                    let local = own.start - r.start..own.end - r.start;
                    engine.with_host_buffers(r.clone(), own, scratch, |p, g| -> Result<()> {
                        let t = Instant::now();
                        step.apply(&sh.sgd, &mut p[local], g, &mut momentum[m], s.scale);
                        update_ms += t.elapsed().as_secs_f64() * 1e3;
                        sh.trace.span("update (shard)", "compute", "compute", t);
                        let t = Instant::now();
                        sh.comm.get().all_gather(p).during(|| format!("all-gather of bucket {r:?}"))?;
                        gather_ms += t.elapsed().as_secs_f64() * 1e3;
                        sh.trace.span(format!("all-gather b{i}"), "comm", "comm", t);
                        Ok(())
                    })??;
                }
                rec.update_ms = update_ms;
                // The all-gathers follow backward: exposed whole.
                rec.comm_ms = synced.comm_ms + gather_ms;
                rec.comm_exposed_ms = synced.exposed_ms + gather_ms;
                Ok(())
            },
        )
    }

    fn finish(&mut self, engine: &mut Engine) -> Result<()> {
        if self.gather_momentum {
            // A saved file holds the whole momentum: every rank contributes its shard.
            let full = self.gathered_momentum(engine.layout().len)?;
            engine.write_momentum(&full)?;
        }
        self.shell.finish()
    }

    /// The momentum shards gathered by every rank, and rank 0's engine with them.
    fn checkpoint(&mut self, engine: &mut Engine, at: &CheckpointAt<'_>) -> Result<Option<PathBuf>> {
        let momentum = self
            .gathered_momentum(engine.layout().len)
            .map_err(StrategyError::checkpoint("gathering the checkpoint's momentum"))?;
        if at.rank != 0 {
            return Ok(None);
        }
        Ok(Some(at.write(Contents { momentum: Some(&momentum), ..Contents::engine(engine) })?))
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut m = serde_json::Map::new();
        m.insert("shard_values".into(), self.momentum.len().into());
        describe_memory(&mut m, self.state_bytes);
        let v = self.shell.describe(&mut m);
        (v, m)
    }
}
