//! DDP: every rank keeps a full replica; gradients are summed across ranks by all-reduce in
//! buckets, then every rank takes the same optimiser step (no parameter traffic after the
//! initial broadcast from rank 0).
//!
//! Buckets follow PyTorch DDP: `--bucket-mb` of gradients aligned to tensors, in the order
//! backward produces them (last layer first). On a CPU engine with the TCP backend, each
//! bucket is handed to a communication thread the moment backward finishes it, so its
//! all-reduce runs while backward computes the earlier layers; what is left when backward
//! ends is the *exposed* communication. On a GPU engine with NCCL, each finished bucket's
//! all-reduce is queued on NCCL's stream behind an event on the compute stream, in GPU memory
//! (under `--compress fp16|bf16` rounded to half precision and widened back there too).
//! GPU engines with TCP (and `--no-overlap`) reduce the buckets after backward, staged
//! through host memory for TCP. Backward hands every finished bucket to one hook
//! (`Engine::backward_buckets`); which of these paths a bucket takes is decided in one place,
//! [`Reducer`], by where its values live and what the communicator reduces.

use std::ops::Range;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::compress::Compression;
use gradsync_core::device::Device;
use gradsync_core::engine::{Bucket, BucketGrads, DeviceGrads};
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::model::BucketPlan;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;

use super::bucket::BucketReduce;
use super::{Shape, Strategy, forward_unless_synced, timed_span};
use crate::collective::{Collective, CommError, Hierarchy, Nccl, RingConfig, TcpComm, Traffic, Transport};
use crate::rendezvous::{self, RendezvousConfig};

/// The communicator of either backend (DDP's and ZeRO's).
pub(super) enum Comm {
    /// The TCP ring.
    Tcp(Box<TcpComm>),
    /// NCCL on the rank's GPU.
    Nccl(Box<Nccl>),
}

impl Comm {
    pub(super) fn get(&mut self) -> &mut dyn Collective {
        match self {
            Comm::Tcp(c) => c.as_mut(),
            Comm::Nccl(c) => c.as_mut(),
        }
    }

    /// The TCP ring's chunk in KiB as the ranks settled it; `None` on NCCL (no ring of ours).
    pub(super) fn chunk_kb(&self) -> Option<usize> {
        match self {
            Comm::Tcp(c) => Some(c.chunk_bytes() >> 10),
            Comm::Nccl(_) => None,
        }
    }

    /// Meet the other ranks (rendezvous through rank 0's store) and connect `c`'s backend.
    pub(super) fn connect(c: &DdpConfig) -> anyhow::Result<Comm> {
        let cfg = &c.rendezvous;
        let (rank, world) = (cfg.rank, cfg.world);
        Ok(match c.backend {
            Backend::Tcp => {
                let ring = RingConfig {
                    timeout: cfg.timeout,
                    transport: c.transport,
                    hierarchy: c.hierarchy,
                    ..RingConfig::default()
                }
                .with_chunk_kb(c.chunk_kb);
                Comm::Tcp(Box::new(
                    rendezvous::connect_tcp(cfg, ring)
                        .with_context(|| format!("joining the ring of {world} ranks at {}", cfg.master))?,
                ))
            }
            Backend::Nccl => {
                let Device::Cuda { ordinal } = c.device else {
                    anyhow::bail!("--backend nccl works on GPU memory: use --device cuda (or --backend tcp)");
                };
                let id = if world == 1 {
                    crate::collective::nccl::unique_id()?
                } else {
                    rendezvous::join(cfg)?.nccl_id.context("the store sent no NCCL id")?
                };
                Comm::Nccl(Box::new(Nccl::new(ordinal, rank, world, &id, cfg.timeout)?))
            }
        })
    }

    /// The header's description of the communicator: the variant (the backend's name) and,
    /// into `m`, what `--transport auto` and `--hierarchy auto` chose: the transport, the
    /// all-reduce that ran (`ring` or `hierarchical`) and, for the latter, the hosts.
    pub(super) fn describe(&self, m: &mut serde_json::Map<String, serde_json::Value>) -> String {
        match self {
            Comm::Tcp(c) => {
                m.insert("transport".into(), c.transport().name().into());
                m.insert(
                    "all_reduce".into(),
                    if c.hosts().is_some() { "hierarchical" } else { "ring" }.into(),
                );
                if let Some(hosts) = c.hosts() {
                    m.insert("hosts".into(), hosts.into());
                }
                "tcp".into()
            }
            Comm::Nccl(_) => "nccl".into(),
        }
    }
}

/// What DDP needs to know.
#[derive(Debug, Clone)]
pub struct DdpConfig {
    /// Where to meet the other ranks, this rank's place among them, and the timeout of every
    /// blocking call.
    pub rendezvous: RendezvousConfig,
    /// The collective backend.
    pub backend: Backend,
    /// This rank's device (NCCL needs a GPU).
    pub device: Device,
    /// Values per gradient bucket.
    pub bucket_values: usize,
    /// Synchronise every this many steps, accumulating in between.
    pub sync_every: u64,
    /// Reduce each bucket while backward computes the rest.
    pub overlap: bool,
    /// The TCP ring's chunk, KiB (`None`: the ranks choose, [`RingConfig::chunk_auto`]).
    pub chunk_kb: Option<usize>,
    /// How the TCP ring reaches its neighbours.
    pub transport: Transport,
    /// Whether the TCP backend's all-reduce goes through the hosts.
    pub hierarchy: Hierarchy,
    /// The optimiser every rank applies.
    pub sgd: SgdConfig,
    /// Timeline recorder (`--trace`).
    pub trace: Trace,
    /// How each bucket travels (`--compress`).
    pub compression: Compression,
}

/// Collective backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum Backend {
    /// TCP ring on host memory (GPU buffers staged through the host).
    #[default]
    Tcp,
    /// NCCL on GPU memory.
    Nccl,
}

/// DDP over one communicator.
pub struct Ddp {
    comm: Comm,
    sgd: SgdConfig,
    rank: usize,
    world: usize,
    bucket_values: usize,
    plan: Option<BucketPlan>,
    sync_every: u64,
    micro: u64,
    overlap: bool,
    /// Host copy of the gradients for staged reductions.
    staging: Vec<f32>,
    /// Timeline recorder (`--trace`).
    trace: Trace,
    /// Optimiser-state bytes the engine holds once started (the full momentum buffer).
    state_bytes: usize,
    /// How a bucket is reduced (`--compress`), with what that keeps between steps.
    reduce: BucketReduce,
    compression: Compression,
}

impl Ddp {
    /// Meet the other ranks (rendezvous through rank 0's store) and connect the backend.
    pub fn connect(c: DdpConfig) -> anyhow::Result<Ddp> {
        let reduce = BucketReduce::new(c.compression);
        // Refused before meeting the other ranks.
        if c.backend == Backend::Nccl
            && let Some(why) = reduce.device_refusal()
        {
            anyhow::bail!(why);
        }
        let comm = Comm::connect(&c)?;
        let (rank, world) = (c.rendezvous.rank, c.rendezvous.world);
        Ok(Ddp {
            comm,
            sgd: c.sgd,
            rank,
            world,
            bucket_values: c.bucket_values,
            plan: None,
            sync_every: c.sync_every,
            micro: 0,
            overlap: c.overlap,
            staging: Vec::new(),
            trace: c.trace,
            state_bytes: 0,
            reduce,
            compression: c.compression,
        })
    }

    /// All-reduce `buckets` after backward, through host memory.
    fn reduce_after(
        &mut self,
        engine: &mut Engine,
        buckets: &[std::ops::Range<usize>],
    ) -> anyhow::Result<()> {
        let n = engine.layout().len;
        self.staging.resize(n, 0.0);
        for b in buckets {
            let host = &mut self.staging[b.clone()];
            engine.read_grads(b.clone(), host)?;
            self.reduce.reduce(self.comm.get(), b.clone(), host)?;
            engine.write_grads(b.start, host)?;
        }
        Ok(())
    }
}

/// A finished host bucket on its way to the communication thread: index, range, values.
type HostBucket<'a> = (usize, Range<usize>, &'a mut [f32]);

/// What a step does with each bucket backward finishes, decided per bucket by where its
/// values live and what the communicator can reduce: a host bucket goes to the TCP ring's
/// communication thread at once (overlap), a GPU bucket is queued on NCCL's stream at once
/// (overlap), and anything else waits for the end of backward and is staged through host
/// memory.
struct Reducer<'a, 'env> {
    /// The overlapping TCP ring's communication thread, fed through this channel.
    thread: Option<mpsc::Sender<HostBucket<'a>>>,
    /// Whether finished buckets may start at once.
    overlap: bool,
    /// The latest GPU bucket: waiting on its stream waits for all of backward.
    device: Option<DeviceGrads>,
    /// What is left to do once backward has ended.
    after: AfterBackward<'env>,
}

/// What a step's reductions leave for after backward.
struct AfterBackward<'env> {
    /// NCCL, and how it reduces a GPU bucket, when the communicator is NCCL.
    nccl: Option<(&'env mut Nccl, &'env BucketReduce)>,
    /// GPU buckets for NCCL, queued after backward (no overlap).
    deferred: Vec<DeviceGrads>,
    /// Buckets staged through host memory after backward.
    staged: Vec<Range<usize>>,
    /// When the first reduction was queued on NCCL.
    first_queued: Option<Instant>,
    /// The first error queueing on NCCL; later buckets are not queued.
    failed: Option<CommError>,
}

impl<'a> Reducer<'a, '_> {
    fn ready(&mut self, b: Bucket<'a>) {
        if let BucketGrads::Device(g) = &b.grads {
            self.device = Some(g.clone());
        }
        let after = &mut self.after;
        match (b.grads, &mut after.nccl, &self.thread) {
            (BucketGrads::Host(view), None, Some(tx)) => {
                // If the thread has failed it has dropped the receiver; its error is reported
                // when it is joined.
                let _ = tx.send((b.index, b.range, view));
            }
            (BucketGrads::Device(grads), Some((nccl, reduce)), _) if self.overlap => {
                if after.failed.is_none() {
                    after.first_queued.get_or_insert_with(Instant::now);
                    // SAFETY: the engine outlives this step, and nothing touches the bucket
                    // until wait_all returns (on every path: see `settle`).
                    let queued = unsafe { reduce.queue_device(nccl, &grads) };
                    if let Err(e) = queued {
                        after.failed = Some(e);
                    }
                }
            }
            (BucketGrads::Device(grads), Some(_), _) => after.deferred.push(grads),
            _ => after.staged.push(b.range),
        }
    }
}

/// Backward with every bucket all-reduced as [`Reducer`] decides. Returns (backward ms,
/// communication busy ms, exposed ms).
fn backward_reduced(
    ddp: &mut Ddp,
    engine: &mut Engine,
    plan: &BucketPlan,
    accumulate: bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let trace = ddp.trace.clone();
    let overlap = ddp.overlap;
    let t0 = Instant::now();
    // The TCP ring's communication thread reduces host buckets; NCCL only reads how to.
    let (nccl, tcp) = match &mut ddp.comm {
        Comm::Nccl(n) => (Some((n.as_mut(), &ddp.reduce)), None),
        Comm::Tcp(c) => (None, Some((c.as_mut(), &mut ddp.reduce))),
    };
    let host_overlap = overlap && !engine.is_cuda();
    let (bwd, bwd_end, spans, after) = std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<HostBucket<'_>>();
        let trace_comm = &trace;
        let worker = match tcp {
            Some((comm, reduce)) if host_overlap => {
                Some(s.spawn(move || -> anyhow::Result<Vec<(Instant, Instant)>> {
                    let mut spans = Vec::new();
                    for (i, range, bucket) in rx {
                        let t = Instant::now();
                        reduce.reduce(comm, range.clone(), bucket)?;
                        spans.push((t, Instant::now()));
                        let mut args = serde_json::Map::new();
                        args.insert("bytes".into(), (4 * range.len()).into());
                        trace_comm.span_with(
                            format!("allreduce b{i}"),
                            "comm",
                            "comm",
                            t,
                            Instant::now(),
                            args,
                        );
                    }
                    Ok(spans)
                }))
            }
            _ => None,
        };
        let mut r = Reducer {
            thread: worker.is_some().then_some(tx),
            overlap,
            device: None,
            after: AfterBackward {
                nccl,
                deferred: Vec::new(),
                staged: Vec::new(),
                first_queued: None,
                failed: None,
            },
        };
        let bwd = engine.backward_buckets(plan, accumulate, &mut |b| r.ready(b));
        let Reducer { thread, device, after, .. } = r;
        drop(thread);
        // Backward ends when the device has run it; NCCL's reductions run on their own stream.
        let bwd = bwd.and_then(|()| device.map_or(Ok(()), |g| g.synchronize()));
        let bwd_end = Instant::now();
        trace.span("backward", "compute", "compute", t0);
        let spans = match worker {
            Some(w) => w.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the communication thread panicked"))),
            None => Ok(Vec::new()),
        };
        (bwd, bwd_end, spans, after)
    });
    let AfterBackward { nccl, deferred, staged, first_queued, failed } = after;
    let mut spans = spans?;
    if let Some((nccl, reduce)) = nccl {
        // Once a reduction is queued, no error may leave this step before NCCL is done with
        // the gradient buffer: the engine could be dropped, and the buffer freed, while it
        // writes.
        let queued = first_queued.is_some();
        let settle = |nccl: &mut Nccl, queued: bool, e: anyhow::Error| {
            if queued {
                let _ = nccl.wait_all();
            }
            e
        };
        let ready = bwd.map_err(anyhow::Error::from).and_then(|()| {
            failed.map_or(Ok(()), |e| Err(anyhow::Error::from(e).context("queueing a bucket's all-reduce")))
        });
        if let Err(e) = ready {
            return Err(settle(nccl, queued, e));
        }
        let mut first = first_queued;
        for grads in deferred {
            first.get_or_insert_with(Instant::now);
            // SAFETY: as above; backward has finished with the buffer.
            let queued = unsafe { reduce.queue_device(nccl, &grads) };
            if let Err(e) = queued {
                return Err(settle(nccl, true, anyhow::Error::from(e).context("queueing an all-reduce")));
            }
        }
        nccl.wait_all().context("waiting for the all-reduces")?;
        spans.extend(first.map(|f| (f, Instant::now())));
    } else {
        bwd?;
    }
    if !staged.is_empty() {
        let t = Instant::now();
        ddp.reduce_after(engine, &staged)?;
        trace.span("allreduce", "comm", "comm", t);
        spans.push((t, Instant::now()));
    }
    let (busy, exposed) = comm_split(&spans, bwd_end);
    Ok(((bwd_end - t0).as_secs_f64() * 1e3, busy, exposed))
}

/// Communication time and its exposed part, ms, from the spans `(start, end)` the reductions
/// ran in: busy is their total length; exposed the part of each after backward ended at
/// `bwd_end`, so it never exceeds busy. Time between the spans (a hand-off to the
/// communication thread, its wake-up) is neither; the step's `other` holds it.
pub(super) fn comm_split(spans: &[(Instant, Instant)], bwd_end: Instant) -> (f64, f64) {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let busy = spans.iter().map(|&(s, e)| ms(s, e)).sum();
    let exposed = spans.iter().map(|&(s, e)| ms(s.max(bwd_end), e)).sum();
    (busy, exposed)
}

impl Strategy for Ddp {
    fn shape(&self) -> Shape {
        Shape::processes(self.world, self.rank)
    }

    fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        self.plan = Some(BucketPlan::with_cap(engine.layout(), self.bucket_values));
        // One set of initial parameters (and momentum, for --load) for every rank: rank 0's.
        let mut p = engine.params()?;
        self.comm.get().broadcast(&mut p, 0).context("broadcasting the initial parameters")?;
        engine.write_params(0, &p)?;
        engine.read_momentum(&mut p)?;
        self.comm.get().broadcast(&mut p, 0).context("broadcasting the momentum")?;
        engine.write_momentum(&p)?;
        self.state_bytes = engine.optimizer_state_bytes();
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

    fn finish(&mut self, _engine: &mut Engine) -> anyhow::Result<()> {
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
        m.insert("compression".into(), self.compression.to_string().into());
        super::describe_memory(&mut m, self.state_bytes);
        let v = self.comm.describe(&mut m);
        (v, m)
    }
}

impl Ddp {
    fn step_with(
        &mut self,
        engine: &mut Engine,
        plan: &BucketPlan,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss> {
        // DDP's no_sync micro-steps accumulate locally: no communication, no update.
        let trace = self.trace.clone();
        let (loss, sync) =
            forward_unless_synced(engine, x, y, rec, &trace, (&mut self.micro, self.sync_every))?;
        let Some(accumulate) = sync else { return Ok(loss) };
        let before: Traffic = self.comm.get().traffic();
        let (bwd, busy, exposed) = backward_reduced(self, engine, plan, accumulate)?;
        rec.backward_ms = bwd;
        rec.comm_ms = busy;
        rec.comm_exposed_ms = exposed;
        let moved = self.comm.get().traffic() - before;
        rec.bytes_sent = moved.sent;
        rec.bytes_recv = moved.recv;
        // The sum of W ranks' (and K micro-steps') mean gradients, scaled to their mean.
        let scale = 1.0 / (self.world as f32 * self.sync_every as f32);
        let ((), ms) = timed_span(engine, &trace, "update", |e| e.update(&self.sgd, scale))?;
        rec.update_ms = ms;
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn exposed_communication_never_exceeds_busy() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // One bucket that starts after backward ends (a late hand-off): all of it is exposed,
        // and the gap before it is not communication.
        let (busy, exposed) = comm_split(&[(at(12), at(15))], at(10));
        assert!((busy - 3.0).abs() < 1e-6 && (exposed - 3.0).abs() < 1e-6, "{busy} {exposed}");
        // Two buckets: the first hidden behind backward, the second half exposed.
        let (busy, exposed) = comm_split(&[(at(2), at(5)), (at(8), at(12))], at(10));
        assert!((busy - 7.0).abs() < 1e-6 && (exposed - 2.0).abs() < 1e-6, "{busy} {exposed}");
        assert_eq!(comm_split(&[], at(10)), (0.0, 0.0));
    }
}
