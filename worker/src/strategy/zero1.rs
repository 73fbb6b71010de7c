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
//! On a CPU engine everything happens in place on the engine's host buffers (no copies). On a
//! GPU engine each bucket is staged through host memory (TCP, or NCCL through its staging), and
//! the momentum shard lives in host memory. The engine's own momentum buffer is never
//! allocated, so the optimiser state a rank holds is 1/n of DDP's.

use std::ops::Range;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::engine::BucketGrads;
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::model::{BucketPlan, segment};
use gradsync_core::optim::{SgdConfig, sgd_step};
use gradsync_core::trace::Trace;

use super::ddp::{Comm, comm_split};
use super::{DdpConfig, Shape, Strategy, backward, describe_memory, forward_unless_synced};
use crate::collective::{Collective, Traffic};

/// What ZeRO-1 needs to know: DDP's settings (rendezvous, backend, buckets, overlap), and
/// whether the full momentum must be gathered at the end (a checkpoint holds it whole).
#[derive(Debug, Clone)]
pub struct Zero1Config {
    /// The communicator, buckets, overlap and optimiser, as DDP takes them.
    pub ddp: DdpConfig,
    /// All-gather the momentum shards into the engine after the last step (for `--save`).
    pub gather_momentum: bool,
}

/// A communication span: (start, end).
type Span = (Instant, Instant);

/// ZeRO-1 over one communicator.
pub struct Zero1 {
    comm: Comm,
    sgd: SgdConfig,
    rank: usize,
    world: usize,
    bucket_values: usize,
    plan: Option<BucketPlan>,
    /// Per bucket, the range of the flat buffer this rank owns and updates.
    owned: Vec<Range<usize>>,
    /// The momentum of the owned ranges, concatenated in bucket order: the optimiser shard.
    momentum: Vec<f32>,
    /// GPU engines: one bucket's gradients, then parameters, in host memory.
    staging: Vec<f32>,
    /// GPU engines: the owned parameters of one bucket in host memory.
    shard: Vec<f32>,
    sync_every: u64,
    micro: u64,
    overlap: bool,
    gather_momentum: bool,
    /// Optimiser-state bytes held once started: the shard (and nothing in the engine).
    state_bytes: usize,
    trace: Trace,
}

impl Zero1 {
    /// Meet the other ranks and connect the backend, as DDP does.
    pub fn connect(c: Zero1Config) -> anyhow::Result<Zero1> {
        let comm = Comm::connect(&c.ddp)?;
        let d = c.ddp;
        Ok(Zero1 {
            comm,
            sgd: d.sgd,
            rank: d.rendezvous.rank,
            world: d.rendezvous.world,
            bucket_values: d.bucket_values,
            plan: None,
            owned: Vec::new(),
            momentum: Vec::new(),
            staging: Vec::new(),
            shard: Vec::new(),
            sync_every: d.sync_every,
            micro: 0,
            overlap: d.overlap,
            gather_momentum: c.gather_momentum,
            state_bytes: 0,
            trace: d.trace,
        })
    }

    /// The owned ranges with their offsets into the momentum shard.
    fn shards(&self) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
        let mut off = 0;
        self.owned.iter().map(move |o| {
            let m = off..off + o.len();
            off = m.end;
            (o.clone(), m)
        })
    }

    /// Backward on a CPU engine with each finished bucket reduce-scattered: on the
    /// communication thread while backward goes on (overlap, TCP ring), or after it. Returns
    /// the backward milliseconds and when backward ended; the reductions' spans go to `spans`.
    fn backward_scattered(
        &mut self,
        engine: &mut Engine,
        plan: &BucketPlan,
        accumulate: bool,
        rec: &mut Step,
        spans: &mut Vec<Span>,
    ) -> anyhow::Result<Instant> {
        let trace = self.trace.clone();
        let Zero1 { comm, owned, overlap, .. } = self;
        let check = |i: usize, got: Range<usize>, start: usize| -> anyhow::Result<()> {
            let want = owned[i].start - start..owned[i].end - start;
            anyhow::ensure!(
                got == want,
                "reduce-scatter of bucket {i} left {got:?} summed here, not {want:?}"
            );
            Ok(())
        };
        let record = |i: usize, range: &Range<usize>, t: Instant| {
            let mut args = serde_json::Map::new();
            args.insert("bytes".into(), (4 * range.len()).into());
            trace.span_with(format!("reduce-scatter b{i}"), "comm", "comm", t, Instant::now(), args);
        };
        let Comm::Tcp(tcp) = comm else {
            anyhow::bail!("a CPU engine reduces over the TCP ring (--backend nccl needs --device cuda)")
        };
        if !*overlap {
            backward(engine, accumulate, rec, &trace)?;
            let bwd_end = Instant::now();
            let (_, grads) = engine.host_buffers_mut().context("a CPU engine lends its buffers")?;
            for (i, r) in plan.buckets.iter().enumerate() {
                let t = Instant::now();
                let got = tcp
                    .reduce_scatter(&mut grads[r.clone()])
                    .with_context(|| format!("reduce-scatter of bucket {r:?}"))?;
                spans.push((t, Instant::now()));
                record(i, r, t);
                check(i, got, r.start)?;
            }
            return Ok(bwd_end);
        }
        let t0 = Instant::now();
        let (bwd, bwd_end, done) = std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel::<(usize, Range<usize>, &mut [f32])>();
            let worker = s.spawn(move || -> anyhow::Result<Vec<Span>> {
                let mut spans = Vec::new();
                for (i, range, bucket) in rx {
                    let t = Instant::now();
                    let got = tcp
                        .reduce_scatter(bucket)
                        .with_context(|| format!("reduce-scatter of bucket {range:?}"))?;
                    spans.push((t, Instant::now()));
                    record(i, &range, t);
                    check(i, got, range.start)?;
                }
                Ok(spans)
            });
            let mut stray = false;
            let bwd = engine.backward_buckets(plan, accumulate, &mut |b| match b.grads {
                // If the thread has failed it has dropped the receiver; its error is reported
                // when it is joined.
                BucketGrads::Host(view) => drop(tx.send((b.index, b.range, view))),
                BucketGrads::Device(_) => stray = true,
            });
            drop(tx);
            let bwd_end = Instant::now();
            trace.span("backward", "compute", "compute", t0);
            let done =
                worker.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the communication thread panicked")));
            let bwd = bwd.map_err(anyhow::Error::from).and_then(|()| {
                anyhow::ensure!(!stray, "backward handed out a GPU bucket to the host path");
                Ok(())
            });
            (bwd, bwd_end, done)
        });
        bwd?;
        spans.extend(done?);
        rec.backward_ms = (bwd_end - t0).as_secs_f64() * 1e3;
        Ok(bwd_end)
    }

    /// The update and all-gather on a CPU engine, in place on its host buffers. Returns the
    /// update's milliseconds.
    fn update_gather_host(
        &mut self,
        engine: &mut Engine,
        plan: &BucketPlan,
        scale: f32,
        spans: &mut Vec<Span>,
    ) -> anyhow::Result<f64> {
        let (params, grads) = engine.host_buffers_mut().context("a CPU engine lends its buffers")?;
        let t = Instant::now();
        let shards: Vec<_> = self.shards().collect();
        for (own, m) in shards {
            sgd_step(&self.sgd, &mut params[own.clone()], &grads[own.clone()], &mut self.momentum[m], scale);
        }
        let update_ms = t.elapsed().as_secs_f64() * 1e3;
        self.trace.span("update (shard)", "compute", "compute", t);
        for (i, r) in plan.buckets.iter().enumerate() {
            let t = Instant::now();
            self.comm
                .get()
                .all_gather(&mut params[r.clone()])
                .with_context(|| format!("all-gather of bucket {r:?}"))?;
            spans.push((t, Instant::now()));
            self.trace.span(format!("all-gather b{i}"), "comm", "comm", t);
        }
        Ok(update_ms)
    }

    /// Reduce-scatter, update and all-gather on a GPU engine, one bucket at a time through
    /// host memory, after backward. Returns the update's milliseconds.
    fn staged(
        &mut self,
        engine: &mut Engine,
        plan: &BucketPlan,
        scale: f32,
        spans: &mut Vec<Span>,
    ) -> anyhow::Result<f64> {
        let mut update_ms = 0.0;
        let shards: Vec<_> = self.shards().collect();
        for (r, (own, m)) in plan.buckets.iter().zip(shards) {
            let local = own.start - r.start..own.end - r.start;
            let buf = &mut self.staging[..r.len()];
            engine.read_grads(r.clone(), buf)?;
            let t = Instant::now();
            let got = self
                .comm
                .get()
                .reduce_scatter(buf)
                .with_context(|| format!("reduce-scatter of bucket {r:?}"))?;
            spans.push((t, Instant::now()));
            anyhow::ensure!(
                got == local,
                "reduce-scatter of bucket {r:?} left {got:?} summed here, not {local:?}"
            );
            let t = Instant::now();
            let shard = &mut self.shard[..own.len()];
            engine.read_params(own.clone(), shard)?;
            sgd_step(&self.sgd, shard, &buf[local.clone()], &mut self.momentum[m], scale);
            buf[local].copy_from_slice(shard);
            update_ms += t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            self.comm.get().all_gather(buf).with_context(|| format!("all-gather of bucket {r:?}"))?;
            spans.push((t, Instant::now()));
            engine.write_params(r.start, buf)?;
        }
        Ok(update_ms)
    }

    fn step_with(
        &mut self,
        engine: &mut Engine,
        plan: &BucketPlan,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss> {
        // As DDP's no_sync micro-steps: accumulate locally, no communication, no update.
        let trace = self.trace.clone();
        let (loss, sync) =
            forward_unless_synced(engine, x, y, rec, &trace, (&mut self.micro, self.sync_every))?;
        let Some(accumulate) = sync else { return Ok(loss) };
        let before: Traffic = self.comm.get().traffic();
        // The sum of W ranks' (and K micro-steps') mean gradients, scaled to their mean.
        let scale = 1.0 / (self.world as f32 * self.sync_every as f32);
        let mut spans = Vec::new();
        let (bwd_end, update_ms) = if engine.is_cuda() {
            backward(engine, accumulate, rec, &trace)?;
            let bwd_end = Instant::now();
            (bwd_end, self.staged(engine, plan, scale, &mut spans)?)
        } else {
            let bwd_end = self.backward_scattered(engine, plan, accumulate, rec, &mut spans)?;
            (bwd_end, self.update_gather_host(engine, plan, scale, &mut spans)?)
        };
        let (busy, exposed) = comm_split(&spans, bwd_end);
        rec.comm_ms = busy;
        rec.comm_exposed_ms = exposed;
        rec.update_ms = update_ms;
        let moved = self.comm.get().traffic() - before;
        rec.bytes_sent = moved.sent;
        rec.bytes_recv = moved.recv;
        Ok(loss)
    }
}

impl Strategy for Zero1 {
    fn shape(&self) -> Shape {
        Shape::processes(self.world, self.rank)
    }

    fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        let plan = BucketPlan::with_cap(engine.layout(), self.bucket_values);
        // One set of initial parameters and momentum (--load) for every rank: rank 0's.
        let mut p = engine.params()?;
        self.comm.get().broadcast(&mut p, 0).context("broadcasting the initial parameters")?;
        engine.write_params(0, &p)?;
        engine.read_momentum(&mut p)?;
        self.comm.get().broadcast(&mut p, 0).context("broadcasting the momentum")?;
        self.owned = plan
            .buckets
            .iter()
            .map(|r| {
                let s = segment(r.len(), self.world, self.rank);
                r.start + s.start..r.start + s.end
            })
            .collect();
        self.momentum = self.owned.iter().flat_map(|o| p[o.clone()].iter().copied()).collect();
        drop(p);
        // The shard is the optimiser state from here on; the engine holds none.
        engine.release_momentum();
        if engine.is_cuda() {
            self.staging = vec![0.0; plan.buckets.iter().map(|r| r.len()).max().unwrap_or(0)];
            self.shard = vec![0.0; self.owned.iter().map(|r| r.len()).max().unwrap_or(0)];
        }
        self.state_bytes = self.momentum.len() * size_of::<f32>() + engine.optimizer_state_bytes();
        self.plan = Some(plan);
        Ok(())
    }

    fn step(
        &mut self,
        engine: &mut Engine,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss> {
        let plan = self.plan.take().context("step before start")?;
        let out = self.step_with(engine, &plan, x, y, rec);
        self.plan = Some(plan);
        out
    }

    fn finish(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        if self.gather_momentum {
            // A checkpoint holds the whole momentum: every rank contributes its shard.
            let mut full = vec![0.0; engine.layout().len];
            for (own, m) in self.shards() {
                full[own].copy_from_slice(&self.momentum[m]);
            }
            let buckets = self.plan.as_ref().map(|p| p.buckets.clone()).unwrap_or_default();
            for r in buckets {
                self.comm
                    .get()
                    .all_gather(&mut full[r.clone()])
                    .with_context(|| format!("all-gather of the momentum of {r:?}"))?;
            }
            engine.write_momentum(&full)?;
        }
        // Nobody leaves while another rank may still be reading from it.
        self.comm.get().barrier().context("the final barrier")?;
        Ok(())
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut m = serde_json::Map::new();
        m.insert("bucket_values".into(), self.bucket_values.into());
        m.insert("buckets".into(), self.plan.as_ref().map_or(0, |p| p.buckets.len()).into());
        m.insert("sync_every".into(), self.sync_every.into());
        m.insert("overlap".into(), self.overlap.into());
        m.insert("chunk_kb".into(), self.comm.chunk_kb().into());
        m.insert("shard_values".into(), self.momentum.len().into());
        describe_memory(&mut m, self.state_bytes);
        let v = self.comm.describe(&mut m);
        (v, m)
    }
}
