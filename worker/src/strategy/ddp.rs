//! DDP: every rank keeps a full replica; gradients are summed across ranks by all-reduce in
//! buckets, then every rank takes the same optimiser step (no parameter traffic after the
//! initial broadcast from rank 0).
//!
//! Buckets follow PyTorch DDP: `--bucket-mb` of gradients aligned to tensors, in the order
//! backward produces them (last layer first). On a CPU engine with the TCP backend, each
//! bucket is handed to a communication thread the moment backward finishes it, so its
//! all-reduce runs while backward computes the earlier layers; what is left when backward
//! ends is the *exposed* communication. On a GPU engine with NCCL, each finished bucket's
//! all-reduce is queued on NCCL's stream behind an event on the compute stream, in GPU memory.
//! GPU engines with TCP (and `--no-overlap`) reduce the buckets after backward, staged
//! through host memory for TCP.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::device::Device;
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::model::BucketPlan;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;

use super::{Strategy, ms_since, timed_span};
use crate::cli::Backend;
use crate::collective::{Collective, Nccl, RingConfig, TcpComm, Traffic};
use crate::rendezvous::{self, RendezvousConfig};
use crate::train::Run;

/// The communicator of either backend.
enum Comm {
    /// The TCP ring.
    Tcp(TcpComm),
    /// NCCL on the rank's GPU.
    Nccl(Box<Nccl>),
}

impl Comm {
    fn get(&mut self) -> &mut dyn Collective {
        match self {
            Comm::Tcp(c) => c,
            Comm::Nccl(c) => c.as_mut(),
        }
    }
}

/// DDP over one communicator.
pub struct Ddp {
    comm: Comm,
    sgd: SgdConfig,
    world: usize,
    bucket_values: usize,
    plan: Option<BucketPlan>,
    sync_every: u64,
    micro: u64,
    overlap: bool,
    backend: Backend,
    chunk_kb: usize,
    /// Host copy of the gradients for staged reductions.
    staging: Vec<f32>,
    /// Timeline recorder (`--trace`).
    trace: Trace,
}

impl Ddp {
    /// Meet the other ranks (rendezvous through rank 0's store) and connect the backend.
    pub fn connect(run: &Run) -> anyhow::Result<Ddp> {
        let d = &run.args.ddp;
        anyhow::ensure!(d.bucket_mb > 0.0 && d.bucket_mb.is_finite(), "--bucket-mb must be positive");
        anyhow::ensure!(d.sync_every >= 1, "--sync-every must be at least 1");
        anyhow::ensure!(
            d.comm_timeout > 0.0 && d.comm_timeout.is_finite(),
            "--comm-timeout must be a positive number of seconds"
        );
        let timeout = Duration::from_secs_f64(d.comm_timeout);
        let cfg = RendezvousConfig {
            master: d.master()?,
            rank: run.rank,
            world: run.world,
            fingerprint: run.fingerprint().text,
            token: d.ring_token.clone(),
            timeout,
            nccl: d.backend == Backend::Nccl,
        };
        let comm = match d.backend {
            Backend::Tcp => {
                let ring = RingConfig {
                    timeout,
                    chunk_bytes: d.chunk_kb << 10,
                    transport: d.transport,
                    ..RingConfig::default()
                };
                Comm::Tcp(
                    rendezvous::connect_tcp(&cfg, ring).with_context(|| {
                        format!("joining the ring of {} ranks at {}", run.world, cfg.master)
                    })?,
                )
            }
            Backend::Nccl => {
                let Device::Cuda { ordinal } = run.device else {
                    anyhow::bail!("--backend nccl works on GPU memory: use --device cuda (or --backend tcp)");
                };
                let id = if run.world == 1 {
                    crate::collective::nccl::unique_id()?
                } else {
                    rendezvous::join(&cfg)?.nccl_id.context("the store sent no NCCL id")?
                };
                Comm::Nccl(Box::new(Nccl::new(ordinal, run.rank, run.world, &id, timeout)?))
            }
        };
        Ok(Ddp {
            comm,
            sgd: run.sgd,
            world: run.world,
            bucket_values: ((d.bucket_mb * (1 << 20) as f64) / 4.0).max(1.0) as usize,
            plan: None,
            sync_every: d.sync_every,
            micro: 0,
            overlap: !d.no_overlap,
            backend: d.backend,
            chunk_kb: d.chunk_kb,
            staging: Vec::new(),
            trace: run.trace.clone(),
        })
    }

    /// All-reduce every bucket after backward, through host memory.
    fn reduce_after(&mut self, engine: &mut Engine, plan: &BucketPlan) -> anyhow::Result<()> {
        let n = engine.layout().len;
        self.staging.resize(n, 0.0);
        for b in &plan.buckets {
            let host = &mut self.staging[b.clone()];
            engine.read_grads(b.clone(), host)?;
            self.comm.get().all_reduce(host).with_context(|| format!("all-reduce of bucket {b:?}"))?;
            engine.write_grads(b.start, host)?;
        }
        Ok(())
    }
}

/// Backward with each bucket all-reduced by a scoped thread as soon as it is ready. Returns
/// (backward ms, communication busy ms, exposed ms).
fn backward_overlapped(
    engine: &mut Engine,
    comm: &mut TcpComm,
    plan: &BucketPlan,
    accumulate: bool,
    trace: &Trace,
) -> anyhow::Result<(f64, f64, f64)> {
    let t0 = Instant::now();
    let (tx, rx) = mpsc::channel::<(usize, std::ops::Range<usize>, &mut [f32])>();
    let (bwd, bwd_end, reduced) = std::thread::scope(|s| {
        let worker = s.spawn(move || -> anyhow::Result<Vec<(Instant, Instant)>> {
            let mut spans = Vec::new();
            for (i, range, bucket) in rx {
                let t = Instant::now();
                comm.all_reduce(bucket).with_context(|| format!("all-reduce of bucket {range:?}"))?;
                spans.push((t, Instant::now()));
                let mut args = serde_json::Map::new();
                args.insert("bytes".into(), (4 * range.len()).into());
                trace.span_with(format!("allreduce b{i}"), "comm", "comm", t, Instant::now(), args);
            }
            Ok(spans)
        });
        let bwd = engine.backward_host_buckets(plan, accumulate, &mut |i, range, view| {
            // If the thread has failed it has dropped the receiver; its error is reported below.
            let _ = tx.send((i, range, view));
        });
        let bwd_end = Instant::now();
        trace.span("backward", "compute", "compute", t0);
        drop(tx);
        let reduced =
            worker.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the communication thread panicked")));
        (bwd, bwd_end, reduced)
    });
    let spans = reduced?;
    bwd?;
    let (busy, exposed) = comm_split(&spans, bwd_end);
    Ok(((bwd_end - t0).as_secs_f64() * 1e3, busy, exposed))
}

/// Backward on a GPU engine with NCCL reducing the buckets in GPU memory: each bucket's
/// all-reduce is queued on NCCL's stream behind an event on the compute stream the moment
/// backward finishes it (or, without overlap, all of them after backward). Returns (backward
/// ms, communication ms from the first queued reduction to the last one's end, exposed ms).
fn backward_nccl(
    engine: &mut Engine,
    nccl: &mut Nccl,
    plan: &BucketPlan,
    accumulate: bool,
    overlap: bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let t0 = Instant::now();
    let mut first: Option<Instant> = None;
    let mut deferred = Vec::new();
    let mut failed = None;
    let bwd = engine.backward_device_buckets(plan, accumulate, &mut |_, range, ptr, stream| {
        if !overlap {
            deferred.push((ptr, range.len(), stream.clone()));
            return;
        }
        if failed.is_none() {
            first.get_or_insert_with(Instant::now);
            // SAFETY: the engine's gradient buffer outlives this step, and nothing touches the
            // bucket until wait_all below returns (on every path: see `settle`).
            if let Err(e) = unsafe { nccl.all_reduce_device_after(ptr, range.len(), stream) } {
                failed = Some(e);
            }
        }
    });
    // Once a reduction is queued, no error may leave this step before NCCL is done with the
    // gradient buffer: the engine could be dropped, and the buffer freed, while it writes.
    let settle = |nccl: &mut Nccl, queued: bool, e: anyhow::Error| {
        if queued {
            let _ = nccl.wait_all();
        }
        e
    };
    let ready = bwd
        .map_err(anyhow::Error::from)
        .and_then(|_| {
            failed.map_or(Ok(()), |e| Err(anyhow::Error::from(e).context("queueing a bucket's all-reduce")))
        })
        .and_then(|()| engine.synchronize().map_err(anyhow::Error::from));
    if let Err(e) = ready {
        return Err(settle(nccl, first.is_some(), e));
    }
    let bwd_end = Instant::now();
    for (ptr, len, stream) in deferred {
        first.get_or_insert_with(Instant::now);
        // SAFETY: as above; backward has finished with the buffer.
        if let Err(e) = unsafe { nccl.all_reduce_device_after(ptr, len, &stream) } {
            return Err(settle(nccl, true, anyhow::Error::from(e).context("queueing an all-reduce")));
        }
    }
    nccl.wait_all().context("waiting for the all-reduces")?;
    let end = Instant::now();
    let spans: Vec<(Instant, Instant)> = first.map(|f| (f, end)).into_iter().collect();
    let (busy, exposed) = comm_split(&spans, bwd_end);
    Ok(((bwd_end - t0).as_secs_f64() * 1e3, busy, exposed))
}

/// Communication time and its exposed part, ms, from the spans `(start, end)` the reductions
/// ran in: busy is their total length; exposed the part of each after backward ended at
/// `bwd_end`, so it never exceeds busy. Time between the spans (a hand-off to the
/// communication thread, its wake-up) is neither; the step's `other` holds it.
fn comm_split(spans: &[(Instant, Instant)], bwd_end: Instant) -> (f64, f64) {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let busy = spans.iter().map(|&(s, e)| ms(s, e)).sum();
    let exposed = spans.iter().map(|&(s, e)| ms(s.max(bwd_end), e)).sum();
    (busy, exposed)
}

impl Strategy for Ddp {
    fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        self.plan = Some(BucketPlan::with_cap(engine.layout(), self.bucket_values));
        // One set of initial parameters (and momentum, for --load) for every rank: rank 0's.
        let mut p = engine.params()?;
        self.comm.get().broadcast(&mut p, 0).context("broadcasting the initial parameters")?;
        engine.write_params(0, &p)?;
        engine.read_momentum(&mut p)?;
        self.comm.get().broadcast(&mut p, 0).context("broadcasting the momentum")?;
        engine.write_momentum(&p)?;
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
        m.insert("chunk_kb".into(), self.chunk_kb.into());
        if let Comm::Tcp(c) = &self.comm {
            // What `--transport auto` chose.
            m.insert("transport".into(), c.transport().name().into());
        }
        let v = match self.backend {
            Backend::Tcp => "tcp",
            Backend::Nccl => "nccl",
        };
        (v.into(), m)
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
        let trace = self.trace.clone();
        let (loss, ms) = timed_span(engine, &trace, "forward", |e| e.forward(x, y, true))?;
        rec.forward_ms = ms;
        self.micro += 1;
        let accumulate = !(self.micro - 1).is_multiple_of(self.sync_every);
        if !self.micro.is_multiple_of(self.sync_every) {
            // DDP's no_sync: accumulate locally, no communication, no update.
            let ((), ms) = timed_span(engine, &trace, "backward", |e| e.backward(accumulate))?;
            rec.backward_ms = ms;
            return Ok(loss);
        }
        let before: Traffic = self.comm.get().traffic();
        match &mut self.comm {
            Comm::Tcp(comm) if self.overlap && !engine.is_cuda() => {
                let (bwd, busy, exposed) = backward_overlapped(engine, comm, plan, accumulate, &trace)?;
                rec.backward_ms = bwd;
                rec.comm_ms = busy;
                rec.comm_exposed_ms = exposed;
            }
            Comm::Nccl(nccl) if engine.is_cuda() => {
                let (bwd, busy, exposed) = backward_nccl(engine, nccl, plan, accumulate, self.overlap)?;
                rec.backward_ms = bwd;
                rec.comm_ms = busy;
                rec.comm_exposed_ms = exposed;
            }
            _ => {
                let ((), ms) = timed_span(engine, &trace, "backward", |e| e.backward(accumulate))?;
                rec.backward_ms = ms;
                let t = Instant::now();
                self.reduce_after(engine, plan)?;
                trace.span("allreduce", "comm", "comm", t);
                rec.comm_ms = ms_since(t);
                rec.comm_exposed_ms = rec.comm_ms;
            }
        }
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
