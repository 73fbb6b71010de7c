//! The seam between a data-parallel strategy (DDP, ZeRO-1) and its communicator: the strategy
//! runs backward through [`Communicator::backward_synced`] with the [`BucketWork`] it wants
//! done on each bucket (DDP's all-reduce under `--compress`, ZeRO-1's reduce-scatter), and the
//! communicator takes every finished bucket in the memory it works on:
//!
//! - the TCP or shared-memory ring (flat or hierarchical) reduces in host memory: each bucket
//!   is taken with [`Bucket::into_host`], which on a CPU engine is the gradient itself and on a
//!   GPU engine a copy staged through pinned memory as backward finishes the bucket, and goes
//!   at once to a communication thread (with `overlap`), which waits for the copy, runs the
//!   work, and queues the copy back; so the ring overlaps backward on either device;
//! - NCCL reduces in GPU memory: a GPU bucket is queued on NCCL's stream behind the bucket's
//!   backward (`overlap`) or after backward; work NCCL cannot do in GPU memory, and buckets in
//!   host memory, go through NCCL's host path after backward (its communicator stays on the
//!   thread that made it).
//!
//! A synchronised batch norm's statistics (`--sync-bn`) go through the same communicator, in
//! order with the buckets (see [`Communicator::backward_synced`]), on every backend.
//!
//! The strategy never asks which device the engine is on, nor which backend it talks to.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::mpsc;
use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::engine::{Bucket, ComputeFence, DeviceGrads, HostBucket};
use gradsync_core::model::BucketPlan;
use gradsync_core::trace::Trace;

use super::error::{CollectiveError, Result};
use super::{Collective, Nccl, TcpComm};

/// A data-parallel communicator.
pub enum Communicator {
    /// The TCP ring (sockets or shared memory, flat or hierarchical) on host memory.
    Tcp(Box<TcpComm>),
    /// NCCL on the rank's GPU.
    Nccl(Box<Nccl>),
}

/// What a strategy does with each finished bucket.
pub trait BucketWork: Send {
    /// What the work fails with: the strategy's own error, which the communicator hands back
    /// whole as the source of a [`CollectiveError::Bucket`] naming the bucket.
    type Error: Into<Box<dyn std::error::Error + Send + Sync>>;

    /// The name of one bucket's operation in traces (`allreduce`, `reduce-scatter`).
    fn name(&self) -> &'static str;

    /// Do it to bucket `index`, values `range` of the flat gradient, in host memory over
    /// `comm`. Returns the part of the bucket (counted from its start) whose new values the
    /// engine needs for its update: all of a sum, this rank's segment of a reduce-scatter.
    fn host(
        &mut self,
        comm: &mut dyn Collective,
        index: usize,
        range: Range<usize>,
        values: &mut [f32],
    ) -> Result<Range<usize>, Self::Error>;

    /// Whether [`BucketWork::queue_device`] does this work in GPU memory.
    fn on_device(&self) -> bool {
        false
    }

    /// Queue it on NCCL's stream for GPU bucket `grads`, to start once backward has written
    /// it (only called when [`BucketWork::on_device`]).
    ///
    /// # Safety
    /// The engine that handed out `grads` must outlive [`Nccl::wait_all`], and nothing else may
    /// touch the bucket until it returns.
    unsafe fn queue_device(&self, nccl: &mut Nccl, grads: &DeviceGrads) -> Result<(), CollectiveError> {
        let _ = (nccl, grads);
        Err(CollectiveError::Invalid {
            what: "bucket",
            why: format!("{} is not done in GPU memory", self.name()),
        })
    }
}

/// What [`Communicator::backward_synced`] measured.
#[derive(Debug, Clone, Copy)]
pub struct Synced {
    /// Backward, until the device had run it, ms.
    pub backward_ms: f64,
    /// Communication busy time, ms.
    pub comm_ms: f64,
    /// The part of it after backward ended, ms.
    pub exposed_ms: f64,
}

/// A communication span: (start, end).
type Span = (Instant, Instant);

/// What the communication thread is handed, in the order every rank hands it over.
enum Job<'a> {
    /// A finished bucket to reduce.
    Bucket(HostBucket<'a>),
    /// A synchronised batch norm's sums to all-reduce, and where to send them back.
    Sums(Vec<f32>, mpsc::Sender<Result<Vec<f32>, String>>),
}

/// What one bucket's hook needs (and a synchronised batch norm's sums, which go the same way).
struct Hook<'a, 'w, W: BucketWork + ?Sized> {
    /// The communication thread (host buckets, overlapped).
    thread: Option<mpsc::Sender<Job<'a>>>,
    /// NCCL and the work, for GPU buckets it reduces in GPU memory.
    nccl: Option<(&'w mut Nccl, &'w W)>,
    /// The ring, when no communication thread runs: for the batch norms' sums only (its
    /// buckets wait for the end of backward).
    direct: Option<&'w mut TcpComm>,
    overlap: bool,
    /// GPU buckets for NCCL after backward, with their indices.
    deferred: Vec<(usize, DeviceGrads)>,
    /// Host buckets for after backward.
    later: Vec<HostBucket<'a>>,
    /// When the first reduction was queued on NCCL.
    first_queued: Option<Instant>,
    /// The first error; later buckets are not started.
    failed: Option<CollectiveError>,
}

impl<'a, W: BucketWork + ?Sized> Hook<'a, '_, W> {
    /// Sum a synchronised batch norm's statistics (`buf`, in host memory) over the ranks, in
    /// order with the buckets handed over so far: behind them on the communication thread when
    /// it runs, on NCCL's stream behind the reductions queued there, else on the ring at once.
    /// Every rank's backward hands over its buckets and sums in the same order.
    fn sums(&mut self, buf: &mut [f32]) -> gradsync_core::Result<()> {
        use gradsync_core::Error::Exchange;
        if let Some(e) = &self.failed {
            return Err(Exchange(format!("a bucket failed before the batch norm's sums: {e:#}")));
        }
        if let Some(tx) = &self.thread {
            let gone = || Exchange("the communication thread stopped".into());
            let (rtx, rrx) = mpsc::channel();
            tx.send(Job::Sums(buf.to_vec(), rtx)).map_err(|_| gone())?;
            let v = rrx.recv().map_err(|_| gone())?.map_err(Exchange)?;
            buf.copy_from_slice(&v);
            return Ok(());
        }
        let comm: &mut dyn Collective = match (&mut self.nccl, &mut self.direct) {
            (Some((nccl, _)), _) => &mut **nccl,
            (None, Some(ring)) => &mut **ring,
            (None, None) => return Err(Exchange("no communicator for the batch norm's sums".into())),
        };
        comm.all_reduce(buf).map_err(|e| Exchange(e.to_string()))
    }

    fn ready(&mut self, b: Bucket<'a>) {
        if self.failed.is_some() {
            return;
        }
        let index = b.index;
        let b = match &mut self.nccl {
            Some((nccl, work)) if work.on_device() => match b.into_device() {
                Ok(grads) if self.overlap => {
                    self.first_queued.get_or_insert_with(Instant::now);
                    // SAFETY: the engine outlives this step, and nothing touches the bucket
                    // until wait_all returns (on every path: see `backward_synced`).
                    if let Err(e) = unsafe { work.queue_device(nccl, &grads) } {
                        self.failed = Some(bucket_err(index, "queueing its reduction", e));
                    }
                    return;
                }
                Ok(grads) => return self.deferred.push((index, grads)),
                Err(host) => host,
            },
            _ => b,
        };
        match b.into_host() {
            Ok(h) => match &self.thread {
                // If the thread has failed it has dropped the receiver; its error is reported
                // when it is joined.
                Some(tx) => drop(tx.send(Job::Bucket(h))),
                None => self.later.push(h),
            },
            Err(e) => self.failed = Some(bucket_err(index, "staging it through host memory", e)),
        }
    }
}

/// Do `work` to host bucket `b` over `comm`, and hand the values the work says the engine
/// needs back to it. Returns the span it took (the wait for a staged copy included).
fn run_host<W: BucketWork + ?Sized>(
    work: &mut W,
    comm: &mut dyn Collective,
    mut b: HostBucket<'_>,
    trace: &Trace,
) -> Result<Span> {
    let t = Instant::now();
    let (index, range) = (b.index, b.range.clone());
    let back =
        work.host(comm, index, range.clone(), b.values()?).map_err(|e| bucket_err(index, work.name(), e))?;
    b.finish(back)?;
    let end = Instant::now();
    let mut args = serde_json::Map::new();
    args.insert("bytes".into(), (4 * range.len()).into());
    trace.span_with(format!("{} b{index}", work.name()), "comm", "comm", t, end, args);
    Ok((t, end))
}

impl Communicator {
    /// The collective, for whole-buffer operations (broadcast, all-gather, barrier).
    pub fn get(&mut self) -> &mut dyn Collective {
        match self {
            Communicator::Tcp(c) => c.as_mut(),
            Communicator::Nccl(c) => c.as_mut(),
        }
    }

    /// Sum a synchronised batch norm's per-channel statistics (`sums`, in host memory) over the
    /// ranks, as core's `NormSync` asks in forward (backward's go with the buckets, in
    /// [`Communicator::backward_synced`]); the same on every backend.
    pub fn sum_norm_stats(&mut self, sums: &mut [f32]) -> gradsync_core::Result<()> {
        self.get().all_reduce(sums).map_err(|e| gradsync_core::Error::Exchange(e.to_string()))
    }

    /// The TCP ring's chunk in KiB as the ranks settled it; `None` on NCCL (no ring of ours).
    pub fn chunk_kb(&self) -> Option<usize> {
        match self {
            Communicator::Tcp(c) => Some(c.chunk_bytes() >> 10),
            Communicator::Nccl(_) => None,
        }
    }

    /// The header's description of the communicator: the variant (the backend's name) and,
    /// into `m`, what `--transport auto` and `--hierarchy auto` chose: the transport, the
    /// all-reduce that ran (`ring` or `hierarchical`) and, for the latter, the hosts.
    pub fn describe(&self, m: &mut serde_json::Map<String, serde_json::Value>) -> String {
        match self {
            Communicator::Tcp(c) => {
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
            Communicator::Nccl(_) => "nccl".into(),
        }
    }

    /// Backward of `engine` over `plan` (adding to the gradients when `accumulate`), with
    /// `work` done to every bucket as described at the top of this file: as soon as backward
    /// finishes it when `overlap`, else after backward. Returns when every bucket's work is
    /// done and its values are back in the engine (queued, on a GPU, before anything the
    /// engine does next).
    ///
    /// With `sync_bn`, backward's batch norms all-reduce their sums over the ranks too
    /// (SyncBatchNorm), through this communicator in order with the buckets: on the
    /// communication thread when it runs, on NCCL's stream behind the reductions queued there,
    /// else at once (`Hook::sums`).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_synced<W: BucketWork + ?Sized>(
        &mut self,
        engine: &mut Engine,
        plan: &BucketPlan,
        accumulate: bool,
        work: &mut W,
        overlap: bool,
        sync_bn: bool,
        trace: &Trace,
    ) -> Result<Synced> {
        let step = Backward { t0: Instant::now(), fence: engine.fence(), plan, accumulate, overlap, trace };
        let (bwd_end, spans) = match self {
            Communicator::Tcp(comm) => on_ring(comm, &step, engine, work, sync_bn)?,
            Communicator::Nccl(nccl) => on_nccl(nccl, &step, engine, work, sync_bn)?,
        };
        let (comm_ms, exposed_ms) = comm_split(&spans, bwd_end);
        Ok(Synced { backward_ms: (bwd_end - step.t0).as_secs_f64() * 1e3, comm_ms, exposed_ms })
    }
}

/// One step's backward as [`Communicator::backward_synced`] was asked to run it.
struct Backward<'a> {
    /// When it began.
    t0: Instant,
    /// What tells when the device has run it.
    fence: ComputeFence,
    plan: &'a BucketPlan,
    accumulate: bool,
    overlap: bool,
    trace: &'a Trace,
}

impl Backward<'_> {
    /// When backward ended, given its result `bwd` and the first failure `failed` of a
    /// bucket's hook: once the device has run it (the buckets' copies and reductions run on
    /// streams and threads of their own).
    fn ended(&self, bwd: gradsync_core::Result<()>, failed: Option<CollectiveError>) -> Result<Instant> {
        bwd?;
        failed.map_or(Ok(()), Err)?;
        self.fence.wait()?;
        self.trace.span("backward", "compute", "compute", self.t0);
        Ok(Instant::now())
    }
}

/// [`Communicator::backward_synced`] on the ring: each host bucket reduced on a communication
/// thread as backward finishes it (with `overlap`), else after backward; a synchronised batch
/// norm's sums all-reduced in order with them (`sync_bn`). Returns when backward ended and the
/// spans the reductions ran in.
fn on_ring<W: BucketWork + ?Sized>(
    comm: &mut TcpComm,
    step: &Backward<'_>,
    engine: &mut Engine,
    work: &mut W,
    sync_bn: bool,
) -> Result<(Instant, Vec<Span>)> {
    let trace = step.trace;
    let (ended, thread_spans, later) = std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<Job<'_>>();
        let (for_thread, direct) =
            if step.overlap { (Some(&mut *comm), None) } else { (None, Some(&mut *comm)) };
        let worker = for_thread.map(|comm| {
            let work = &mut *work;
            s.spawn(move || -> Result<Vec<Span>> {
                let mut spans = Vec::new();
                for job in rx {
                    match job {
                        Job::Bucket(b) => spans.push(run_host(work, comm, b, trace)?),
                        Job::Sums(mut v, reply) => {
                            let r = comm.all_reduce(&mut v).map(|()| v).map_err(|e| e.to_string());
                            drop(reply.send(r));
                        }
                    }
                }
                Ok(spans)
            })
        });
        let thread = worker.is_some().then_some(tx);
        let hook = RefCell::new(Hook::<W> { direct, ..Hook::new(thread, None, step.overlap) });
        let bwd = backward_through(engine, step.plan, step.accumulate, &hook, sync_bn);
        // The thread ends once every sender is gone.
        let Hook { thread, later, failed, .. } = hook.into_inner();
        drop(thread);
        let ended = step.ended(bwd, failed);
        let thread_spans: Result<Vec<Span>> = match worker {
            Some(w) => {
                w.join().unwrap_or_else(|_| Err(CollectiveError::Panicked("the communication thread")))
            }
            None => Ok(Vec::new()),
        };
        (ended, thread_spans, later)
    });
    let bwd_end = ended?;
    let mut spans = thread_spans?;
    for b in later {
        spans.push(run_host(work, comm, b, trace)?);
    }
    Ok((bwd_end, spans))
}

/// [`Communicator::backward_synced`] on NCCL: each GPU bucket queued on NCCL's stream behind
/// its backward (with `overlap`) or after backward, host buckets through NCCL's host path after
/// backward, a synchronised batch norm's sums (`sync_bn`) on NCCL behind the reductions queued so
/// far. Returns when backward ended and the spans the reductions ran in.
fn on_nccl<W: BucketWork + ?Sized>(
    nccl: &mut Nccl,
    step: &Backward<'_>,
    engine: &mut Engine,
    work: &mut W,
    sync_bn: bool,
) -> Result<(Instant, Vec<Span>)> {
    let hook = RefCell::new(Hook::new(None, Some((&mut *nccl, &*work)), step.overlap));
    let bwd = backward_through(engine, step.plan, step.accumulate, &hook, sync_bn);
    let Hook { later, deferred, first_queued, failed, .. } = hook.into_inner();
    // Once a reduction is queued, no error may leave before NCCL is done with the gradients:
    // the engine could be dropped, and its buffer freed, while NCCL writes.
    let settle = |nccl: &mut Nccl, queued: bool, e: CollectiveError| {
        if queued {
            let _ = nccl.wait_all();
        }
        e
    };
    let bwd_end = step.ended(bwd, failed).map_err(|e| settle(nccl, first_queued.is_some(), e))?;
    let mut first = first_queued;
    for (index, grads) in deferred {
        first.get_or_insert_with(Instant::now);
        // SAFETY: as in the hook; backward has finished with the buffer.
        if let Err(e) = unsafe { work.queue_device(nccl, &grads) } {
            return Err(settle(nccl, true, bucket_err(index, "queueing its reduction", e)));
        }
    }
    let mut spans = Vec::new();
    if let Some(first) = first {
        nccl.wait_all().map_err(|e| CollectiveError::Reductions { source: Box::new(e) })?;
        spans.push((first, Instant::now()));
    }
    for b in later {
        spans.push(run_host(work, nccl, b, step.trace)?);
    }
    Ok((bwd_end, spans))
}

impl<'a, 'w, W: BucketWork + ?Sized> Hook<'a, 'w, W> {
    fn new(
        thread: Option<mpsc::Sender<Job<'a>>>,
        nccl: Option<(&'w mut Nccl, &'w W)>,
        overlap: bool,
    ) -> Self {
        Hook {
            thread,
            nccl,
            direct: None,
            overlap,
            deferred: Vec::new(),
            later: Vec::new(),
            first_queued: None,
            failed: None,
        }
    }
}

/// [`CollectiveError::Bucket`]: doing `what` to bucket `index` failed with `e`.
fn bucket_err(
    index: usize,
    what: &'static str,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> CollectiveError {
    CollectiveError::Bucket { index, what, source: e.into() }
}

/// Backward of `engine` over `plan`, every finished bucket handed to `hook` and, with
/// `sync_bn`, every batch norm's sums too (`Hook::sums`), in the order backward reaches them.
fn backward_through<'a, W: BucketWork + ?Sized>(
    engine: &'a mut Engine,
    plan: &BucketPlan,
    accumulate: bool,
    hook: &RefCell<Hook<'a, '_, W>>,
    sync_bn: bool,
) -> gradsync_core::Result<()> {
    // Backward calls the two one at a time, never one from inside the other, so neither
    // finds the hook borrowed.
    let mut sums = |buf: &mut [f32]| hook.borrow_mut().sums(buf);
    let sync: Option<gradsync_core::net::NormSync<'_>> = if sync_bn { Some(&mut sums) } else { None };
    engine.backward_buckets_synced(plan, accumulate, &mut |b| hook.borrow_mut().ready(b), sync)
}

/// Communication time and its exposed part, ms, from the spans `(start, end)` the reductions
/// ran in: busy is their total length; exposed the part of each after backward ended at
/// `bwd_end`, so it never exceeds busy. Time between the spans (a hand-off to the
/// communication thread, its wake-up) is neither; the step's `other` holds it.
fn comm_split(spans: &[Span], bwd_end: Instant) -> (f64, f64) {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let busy = spans.iter().map(|&(s, e)| ms(s, e)).sum();
    let exposed = spans.iter().map(|&(s, e)| ms(s.max(bwd_end), e)).sum();
    (busy, exposed)
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
