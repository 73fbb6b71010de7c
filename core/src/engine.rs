//! [`Engine`]: the model on whichever device was chosen. Callers hold one type; the match on
//! the device happens here and nowhere else.

use std::ops::Range;

use crate::device::staging::{StagedBucket, Staging, Streams};
use crate::device::{Cpu, Cuda, Device, GpuStream, HalfCast};
use crate::dilation::{Dilation, Pace, PaceTally, Turns};
use crate::error::Result;
use crate::model::{BucketPlan, Fingerprint, Layout, ModelSpec};
use crate::net::{BatchLoss, Net, NormSync};
use crate::optim::SgdConfig;

/// A bucket of gradients that backward has finished, handed to the hook of
/// [`Engine::backward_buckets`]: where it lies in the flat buffer, and its values wherever they
/// live. The communicator that reduces it takes it in the memory it works on:
/// [`Bucket::into_host`] (the rings) or [`Bucket::into_device`] (NCCL); it never asks the
/// device.
pub struct Bucket<'a> {
    /// Its index in the [`BucketPlan`].
    pub index: usize,
    /// The range of the flat gradient buffer it covers.
    pub range: Range<usize>,
    grads: Grads<'a>,
}

/// Where a finished bucket's values live.
enum Grads<'a> {
    /// In host memory: an exclusive view that stays valid for the whole borrow, so another
    /// thread may reduce it while backward writes the rest.
    Host(&'a mut [f32]),
    /// In GPU memory, with the pinned host range and the streams to stage it through.
    Device { grads: DeviceGrads, host: &'a mut [f32], streams: &'a Streams },
}

impl<'a> Bucket<'a> {
    /// The bucket in host memory, for a communicator that reduces there: the gradients
    /// themselves where they live in host memory; otherwise a copy to page-locked host memory,
    /// queued now behind the bucket's backward on a copy stream of its own, so that it, and
    /// the reduction that waits for it, overlap the rest of backward (`device/staging.rs`).
    pub fn into_host(self) -> Result<HostBucket<'a>> {
        let values = match self.grads {
            Grads::Host(v) => HostValues::InPlace(v),
            Grads::Device { grads, host, streams } => {
                // SAFETY: the bucket's device range stays allocated while the engine lives
                // (the engine waits for its staging before freeing it) and nothing else
                // writes it until the next backward, which first waits for the copies.
                HostValues::Staged(unsafe { streams.stage(self.range.clone(), grads.ptr, host) }?)
            }
        };
        Ok(HostBucket { index: self.index, range: self.range, values })
    }

    /// The bucket in GPU memory, for a communicator that reduces it there; a bucket in host
    /// memory comes back as the error, untouched.
    pub fn into_device(self) -> std::result::Result<DeviceGrads, Bucket<'a>> {
        match self.grads {
            Grads::Device { grads, .. } => Ok(grads),
            Grads::Host(_) => Err(self),
        }
    }
}

/// A finished bucket in host memory ([`Bucket::into_host`]).
pub struct HostBucket<'a> {
    /// Its index in the [`BucketPlan`].
    pub index: usize,
    /// The range of the flat gradient buffer it covers.
    pub range: Range<usize>,
    values: HostValues<'a>,
}

enum HostValues<'a> {
    /// The engine's own gradients.
    InPlace(&'a mut [f32]),
    /// A staged copy of them.
    Staged(StagedBucket<'a>),
}

impl HostBucket<'_> {
    /// The values, to reduce in place: at once for the engine's own gradients, once the copy
    /// has landed for a staged one (a bounded wait).
    pub fn values(&mut self) -> Result<&mut [f32]> {
        match &mut self.values {
            HostValues::InPlace(v) => Ok(v),
            HostValues::Staged(s) => s.values(),
        }
    }

    /// The values `part` of the bucket (counted from its start) are final and the engine needs
    /// them: a staged copy of them goes back to the engine's gradients (queued; the engine's
    /// next use of its gradients waits for it). The rest, and a bucket dropped unfinished,
    /// leave the engine's gradients as backward wrote them where they were staged.
    pub fn finish(self, part: Range<usize>) -> Result<()> {
        match self.values {
            HostValues::InPlace(_) => Ok(()),
            HostValues::Staged(s) => s.copy_back(part),
        }
    }
}

/// A finished bucket in GPU memory. Its values are final once the work queued so far on the
/// engine's compute stream completes: a communicator that reduces it on a stream of its own
/// orders that stream after the bucket first ([`DeviceGrads::order_before`]). The memory stays
/// allocated while the engine lives; nothing but that work may touch it until the next
/// backward.
#[derive(Clone)]
pub struct DeviceGrads {
    ptr: u64,
    len: usize,
    /// The engine's compute stream, which backward queues the bucket's kernels on.
    stream: GpuStream,
    half: HalfCast,
}

impl DeviceGrads {
    /// Values in the bucket.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bucket holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device's half-precision conversion kernels, to round the bucket for an fp16 or
    /// bf16 all-reduce and widen the sum back, on the communication stream.
    pub fn half_cast(&self) -> &HalfCast {
        &self.half
    }

    /// Make the stream `other` (of this bucket's device) wait for the work queued so far on
    /// the compute stream, the bucket's backward included.
    pub fn order_before(&self, other: &GpuStream) -> Result<()> {
        other.after(&self.stream)
    }

    /// The bucket's device address.
    ///
    /// # Safety
    /// The address is valid only while the engine that handed out the bucket lives, and may
    /// be read or written only by work ordered after the bucket ([`DeviceGrads::order_before`])
    /// and finished before the engine's next backward, update or drop.
    pub unsafe fn address(&self) -> u64 {
        self.ptr
    }
}

/// Waits for the work an engine has queued so far without borrowing the engine: what a caller
/// still holding the engine's buckets uses to see backward end (at once on the CPU, where
/// nothing is queued).
#[derive(Clone)]
pub struct ComputeFence(Option<GpuStream>);

impl ComputeFence {
    /// Wait for the work queued on the engine's compute stream when the fence was made, and
    /// anything queued there since.
    pub fn wait(&self) -> Result<()> {
        match &self.0 {
            None => Ok(()),
            Some(s) => s.synchronize(),
        }
    }
}

/// An optimiser step over a part of the model in host memory ([`Engine::part_update`]).
#[derive(Debug, Clone)]
pub struct PartUpdate {
    replay_ns_per_value: Option<f64>,
    dilation: Dilation,
    turns: Option<Turns>,
}

impl PartUpdate {
    /// Step `params` with `grads` (scaled by `scale`) and `momentum`, all of one part.
    pub fn apply(
        &self,
        cfg: &SgdConfig,
        params: &mut [f32],
        grads: &[f32],
        momentum: &mut [f32],
        scale: f32,
    ) {
        match self.replay_ns_per_value {
            Some(ns) => std::thread::sleep(
                self.dilation.stretch(std::time::Duration::from_nanos((ns * params.len() as f64) as u64)),
            ),
            // A compute phase of its own under `--dilate`.
            None => Pace::run(self.dilation, self.turns.as_ref(), || {
                crate::optim::sgd_step(cfg, params, grads, momentum, scale)
            }),
        }
    }
}

/// The model on one device.
#[expect(
    clippy::large_enum_variant,
    reason = "one Engine per process, built once and never moved in a hot loop; boxing would buy nothing"
)]
pub enum Engine {
    /// On the CPU.
    Cpu(Net<Cpu>),
    /// On one CUDA device, with what stages its buckets through host memory (first, so that
    /// it is dropped, and its copies drained, before the model's buffers are freed).
    Cuda(Staging, Net<Cuda>),
}

/// Run `$body` with `$m` bound to the device's [`Net`], whatever the device.
macro_rules! on_device {
    ($engine:expr, $m:ident => $body:expr) => {
        match $engine {
            Engine::Cpu($m) => $body,
            Engine::Cuda(_, $m) => $body,
        }
    };
}

impl Engine {
    /// The model `spec`, initialised from `seed`, on `device`.
    pub fn new(device: Device, spec: ModelSpec, seed: u64) -> Result<Self> {
        match device {
            Device::Cpu { threads } => Ok(Engine::Cpu(Net::new(Cpu::new(threads)?, spec, seed)?)),
            Device::Cuda { ordinal } => {
                let gpu = Cuda::new(ordinal)?;
                Ok(Engine::Cuda(Staging::new(&gpu)?, Net::new(gpu, spec, seed)?))
            }
        }
    }

    /// The device, described.
    pub fn describe(&self) -> String {
        on_device!(self, m => crate::device::Backend::describe(m.backend()))
    }

    /// The GPU's name, when the model lives on one.
    pub fn gpu_name(&self) -> Option<String> {
        match self {
            Engine::Cpu(_) => None,
            Engine::Cuda(_, m) => Some(m.backend().name()),
        }
    }

    /// The GPU's peak FP32 throughput in FLOP/s (none on the CPU, or when unknown).
    pub fn peak_fp32_flops(&self) -> Option<f64> {
        match self {
            Engine::Cpu(_) => None,
            Engine::Cuda(_, m) => m.backend().peak_fp32_flops().ok(),
        }
    }

    /// The layer widths.
    pub fn spec(&self) -> &ModelSpec {
        on_device!(self, m => m.spec())
    }

    /// The flat layout.
    pub fn layout(&self) -> &Layout {
        on_device!(self, m => m.layout())
    }

    /// Forward over a batch ([`Net::forward`]).
    pub fn forward(&mut self, x: &[f32], labels: &[u32], train: bool) -> Result<BatchLoss> {
        on_device!(self, m => m.forward(x, labels, train))
    }

    /// A training forward over a batch with batch norms synchronised through `sync`
    /// ([`Net::forward_loaded_synced`]).
    pub fn forward_synced(&mut self, x: &[f32], y: &[u32], sync: NormSync<'_>) -> Result<BatchLoss> {
        on_device!(self, m => {
            m.load_batch(x, y)?;
            m.forward_loaded_synced(true, Some(sync))
        })
    }

    /// Copy a batch to the device ([`Net::load_batch`]).
    pub fn load_batch(&mut self, x: &[f32], labels: &[u32]) -> Result<()> {
        on_device!(self, m => m.load_batch(x, labels))
    }

    /// Forward over the batch last loaded ([`Net::forward_loaded`]).
    pub fn forward_loaded(&mut self, train: bool) -> Result<BatchLoss> {
        on_device!(self, m => m.forward_loaded(train))
    }

    /// Backward into the gradient buffer, with no bucket hook.
    pub fn backward(&mut self, accumulate: bool) -> Result<()> {
        self.settle()?;
        on_device!(self, m => {
            // Nobody takes a bucket here, so a sparse model's table is written in place and the
            // net keeps track of which rows it wrote.
            let plan = BucketPlan::whole(m.layout()).without_table(m.layout());
            m.backward(&plan, accumulate, &mut |_, _, _| {})
        })
    }

    /// Backward into the gradient buffer, handing each finished [`Bucket`] of `plan` to
    /// `on_ready` the moment backward has written it (last layer first), so its reduction can
    /// start while backward computes the earlier layers (DDP overlap). The hook takes it in the
    /// memory its communicator works on ([`Bucket::into_host`], [`Bucket::into_device`]).
    pub fn backward_buckets<'a>(
        &'a mut self,
        plan: &BucketPlan,
        accumulate: bool,
        on_ready: &mut dyn FnMut(Bucket<'a>),
    ) -> Result<()> {
        self.backward_buckets_synced(plan, accumulate, on_ready, None)
    }

    /// [`Engine::backward_buckets`] with batch norms synchronised through `sync`
    /// ([`Net::backward_synced`]).
    pub fn backward_buckets_synced<'a>(
        &'a mut self,
        plan: &BucketPlan,
        accumulate: bool,
        on_ready: &mut dyn FnMut(Bucket<'a>),
        sync: Option<NormSync<'_>>,
    ) -> Result<()> {
        self.settle()?;
        match self {
            Engine::Cpu(m) => m.backward_synced(
                plan,
                accumulate,
                &mut |index, range, v| on_ready(Bucket { index, range, grads: Grads::Host(v) }),
                sync,
            ),
            Engine::Cuda(staging, m) => {
                let stream = m.backend().stream().clone();
                let half = m.backend().half_cast().clone();
                let (mut pinned, streams) = staging.lend(m.layout().len)?;
                m.backward_synced(
                    plan,
                    accumulate,
                    &mut |index, range, v| {
                        // Buckets come last first (descending ranges): each takes the top of what
                        // is left of the pinned mirror.
                        let rest = std::mem::take(&mut pinned);
                        let (below, top) = rest.split_at_mut(range.start.min(rest.len()));
                        pinned = below;
                        let take = range.len().min(top.len());
                        let host = &mut top[..take];
                        let grads = DeviceGrads {
                            ptr: v.device_ptr(),
                            len: v.len(),
                            stream: stream.clone(),
                            half: half.clone(),
                        };
                        on_ready(Bucket { index, range, grads: Grads::Device { grads, host, streams } })
                    },
                    sync,
                )
            }
        }
    }

    /// One optimiser step ([`Net::update`]).
    pub fn update(&mut self, cfg: &SgdConfig, grad_scale: f32) -> Result<()> {
        self.settle()?;
        on_device!(self, m => m.update(cfg, grad_scale))
    }

    /// How this model's optimiser steps over a part of it held in host memory (a ZeRO-1
    /// rank's shard): for a model trained for real [`crate::optim::sgd_step`]; for a replayed
    /// one, the profile's optimiser time for that fraction of its parameters, waited.
    pub fn part_update(&self) -> PartUpdate {
        PartUpdate {
            replay_ns_per_value: self
                .spec()
                .profile()
                .map(|p| p.optimizer_ns as f64 / self.layout().len.max(1) as f64),
            dilation: self.dilation(),
            turns: self.turns(),
        }
    }

    /// Run the training compute under `dilation` ([`Net::set_dilation`]).
    pub fn set_dilation(&mut self, dilation: Dilation) {
        on_device!(self, m => m.set_dilation(dilation))
    }

    /// The dilation the training compute runs under.
    pub fn dilation(&self) -> Dilation {
        on_device!(self, m => m.dilation())
    }

    /// Compute each paced phase in its turn of `turns` ([`Net::set_turns`]).
    pub fn set_turns(&mut self, turns: Option<Turns>) {
        on_device!(self, m => m.set_turns(turns))
    }

    /// The turns the training compute takes, if any.
    pub fn turns(&self) -> Option<Turns> {
        on_device!(self, m => m.turns().cloned())
    }

    /// What the paced compute phases came to since the last call ([`Net::take_pace`]).
    pub fn take_pace(&mut self) -> PaceTally {
        on_device!(self, m => m.take_pace())
    }

    /// This model's profile measured on its device ([`Net::record_profile`]).
    pub fn record_profile(
        &mut self,
        x: &[f32],
        labels: &[u32],
        steps: usize,
    ) -> Result<crate::profile::Profile> {
        on_device!(self, m => m.record_profile(x, labels, steps))
    }

    /// Multiply every gradient by `factor`.
    pub fn scale_grads(&mut self, factor: f32) -> Result<()> {
        self.settle()?;
        on_device!(self, m => m.scale_grads(factor))
    }

    /// Copy parameters `range` to host memory.
    pub fn read_params(&self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        on_device!(self, m => m.read_params(range, dst))
    }

    /// Hand `f` the parameters of `range` in order, `chunk` values at a time, through one
    /// buffer of that size: a pass over them (a digest) that never holds a copy of the whole.
    pub fn scan_params(&self, range: Range<usize>, chunk: usize, mut f: impl FnMut(&[f32])) -> Result<()> {
        let mut buf = vec![0.0; chunk.max(1).min(range.len())];
        let mut at = range.start;
        while at < range.end {
            let n = buf.len().min(range.end - at);
            self.read_params(at..at + n, &mut buf[..n])?;
            f(&buf[..n]);
            at += n;
        }
        Ok(())
    }

    /// Overwrite parameters from host memory at `offset`.
    pub fn write_params(&mut self, offset: usize, src: &[f32]) -> Result<()> {
        on_device!(self, m => m.write_params(offset, src))
    }

    /// Copy gradients `range` to host memory.
    pub fn read_grads(&self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        self.settle()?;
        on_device!(self, m => m.read_grads(range, dst))
    }

    /// Overwrite gradients from host memory at `offset`.
    pub fn write_grads(&mut self, offset: usize, src: &[f32]) -> Result<()> {
        self.settle()?;
        on_device!(self, m => m.write_grads(offset, src))
    }

    /// The rows of a sparse model's table the loaded batch names, ascending (none for a dense
    /// model).
    pub fn batch_rows(&self) -> &[u32] {
        on_device!(self, m => m.batch_rows())
    }

    /// The rows of a sparse model's table that the batch `x` names, ascending, each once
    /// (none for a dense model), without loading it.
    pub fn rows_of(&self, x: &[f32]) -> Result<Vec<u32>> {
        on_device!(self, m => m.rows_of(x))
    }

    /// Rows of a sparse model's table (parameters or gradient) copied to host memory, `dim`
    /// values a row in the order of `rows`.
    pub fn read_rows(&self, part: crate::net::RowsOf, rows: &[u32], dst: &mut [f32]) -> Result<()> {
        self.settle()?;
        on_device!(self, m => m.read_rows(part, rows, dst))
    }

    /// Overwrite rows of a sparse model's table (parameters or gradient) from host memory.
    pub fn write_rows(&mut self, part: crate::net::RowsOf, rows: &[u32], src: &[f32]) -> Result<()> {
        self.settle()?;
        on_device!(self, m => m.write_rows(part, rows, src))
    }

    /// The running statistics (batch norms' means and variances), in host memory.
    pub fn buffers(&self) -> Result<Vec<f32>> {
        let mut v = vec![0.0; self.layout().buffers_len];
        on_device!(self, m => m.read_buffers(&mut v))?;
        Ok(v)
    }

    /// Overwrite the running statistics.
    pub fn write_buffers(&mut self, src: &[f32]) -> Result<()> {
        on_device!(self, m => m.write_buffers(src))
    }

    /// Training forward passes so far ([`Net::batches_tracked`]).
    pub fn batches_tracked(&self) -> u64 {
        on_device!(self, m => m.batches_tracked())
    }

    /// Set the training forward passes counted so far ([`Net::set_batches_tracked`]).
    pub fn set_batches_tracked(&mut self, n: u64) {
        on_device!(self, m => m.set_batches_tracked(n))
    }

    /// The model's state under PyTorch's names ([`crate::state_dict::from_model`]).
    pub fn state_dict(&self) -> Result<crate::state_dict::Tensors> {
        Ok(crate::state_dict::from_model(
            self.layout(),
            &self.params()?,
            &self.buffers()?,
            self.batches_tracked(),
        ))
    }

    /// Copy the momentum buffer to host memory (zeros while none is allocated).
    pub fn read_momentum(&self, dst: &mut [f32]) -> Result<()> {
        on_device!(self, m => m.read_momentum(dst))
    }

    /// Overwrite the momentum buffer, allocating it if needed.
    pub fn write_momentum(&mut self, src: &[f32]) -> Result<()> {
        on_device!(self, m => m.write_momentum(src))
    }

    /// Free the momentum buffer ([`Net::release_momentum`]).
    pub fn release_momentum(&mut self) {
        on_device!(self, m => m.release_momentum())
    }

    /// Bytes of optimiser state the engine holds: the momentum buffer once an update or a
    /// momentum write has allocated it, else nothing.
    pub fn optimizer_state_bytes(&self) -> usize {
        on_device!(self, m => m.optimizer_state_bytes())
    }

    /// Bytes of optimiser state the engine holds once it has updated: the momentum buffer,
    /// which the first update allocates where no momentum write did; none for a replayed
    /// model, whose update is a wait.
    pub fn updated_state_bytes(&self) -> usize {
        match self.spec().profile() {
            Some(_) => self.optimizer_state_bytes(),
            None => self.layout().len * size_of::<f32>(),
        }
    }

    /// The parameters and gradients as host slices, when they live in host memory (the CPU);
    /// `None` on a GPU.
    pub fn host_buffers_mut(&mut self) -> Option<(&mut [f32], &mut [f32])> {
        match self {
            Engine::Cpu(m) => Some(m.host_buffers_mut()),
            Engine::Cuda(..) => None,
        }
    }

    /// Exchange the gradient buffer with `other` (as long) where it is a host vector (the
    /// CPU), without copying ([`Net::swap_grads`]). `false`, and nothing exchanged, on a GPU.
    pub fn swap_host_grads(&mut self, other: &mut Vec<f32>) -> Result<bool> {
        match self {
            Engine::Cpu(m) => m.swap_grads(other).map(|()| true),
            Engine::Cuda(..) => Ok(false),
        }
    }

    /// All parameters in host memory.
    pub fn params(&self) -> Result<Vec<f32>> {
        let mut v = vec![0.0; self.layout().len];
        self.read_params(0..v.len(), &mut v)?;
        Ok(v)
    }

    /// All gradients in host memory.
    pub fn grads(&self) -> Result<Vec<f32>> {
        let mut v = vec![0.0; self.layout().len];
        self.read_grads(0..v.len(), &mut v)?;
        Ok(v)
    }

    /// Wait for queued device work (timings).
    pub fn synchronize(&self) -> Result<()> {
        on_device!(self, m => crate::device::Backend::synchronize(m.backend()))
    }

    /// A [`ComputeFence`] on this engine's queued work.
    pub fn fence(&self) -> ComputeFence {
        match self {
            Engine::Cpu(_) => ComputeFence(None),
            Engine::Cuda(_, m) => ComputeFence(Some(m.backend().stream().clone())),
        }
    }

    /// The parameters `params` and the gradients `grads` in host memory, for `f` to change the
    /// parameters from the gradients: in place where they live there, else copied into
    /// `scratch` and the parameters written back after `f` (whatever it returns).
    pub fn with_host_buffers<R>(
        &mut self,
        params: Range<usize>,
        grads: Range<usize>,
        scratch: &mut Vec<f32>,
        f: impl FnOnce(&mut [f32], &[f32]) -> R,
    ) -> Result<R> {
        let len = self.layout().len;
        let outside =
            |r: &Range<usize>| crate::Error::Length { what: "buffer range", expected: len, got: r.end };
        if params.start > params.end || params.end > len {
            return Err(outside(&params));
        }
        if grads.start > grads.end || grads.end > len {
            return Err(outside(&grads));
        }
        if let Some((p, g)) = self.host_buffers_mut() {
            return Ok(f(&mut p[params], &g[grads]));
        }
        scratch.resize(params.len() + grads.len(), 0.0);
        let (p, g) = scratch.split_at_mut(params.len());
        self.read_params(params.clone(), p)?;
        self.read_grads(grads, g)?;
        let out = f(p, g);
        self.write_params(params.start, p)?;
        Ok(out)
    }

    /// Order what the engine queues next after every staged bucket's copy back (on a GPU;
    /// nothing on the CPU).
    fn settle(&self) -> Result<()> {
        match self {
            Engine::Cpu(_) => Ok(()),
            Engine::Cuda(staging, _) => staging.settle(),
        }
    }

    /// This model's fingerprint for `seed`.
    pub fn fingerprint(&self, seed: u64) -> Fingerprint {
        Fingerprint::new(self.spec(), seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        let spec = ModelSpec::parse("6-5-3").expect("widths");
        Engine::new(Device::Cpu { threads: 1 }, spec, 7).expect("a CPU engine")
    }

    fn step(e: &mut Engine) {
        let x: Vec<f32> = (0..4 * 6).map(|i| (i as f32 * 0.3).sin()).collect();
        e.forward(&x, &[0, 1, 2, 1], true).expect("forward");
        e.backward(false).expect("backward");
        e.update(&SgdConfig::default(), 1.0).expect("update");
    }

    #[test]
    fn momentum_is_allocated_only_when_first_needed() {
        let mut e = engine();
        let n = e.layout().len;
        assert_eq!(e.optimizer_state_bytes(), 0, "a new engine holds no optimiser state");
        let mut m = vec![1.0; n];
        e.read_momentum(&mut m).expect("read");
        assert!(m.iter().all(|&v| v == 0.0), "an unallocated momentum reads as zeros");
        assert!(e.read_momentum(&mut [0.0; 2]).is_err(), "a short buffer is refused");
        step(&mut e);
        assert_eq!(e.optimizer_state_bytes(), 4 * n);
        e.release_momentum();
        assert_eq!(e.optimizer_state_bytes(), 0);
        e.write_momentum(&vec![0.5; n]).expect("write");
        assert_eq!(e.optimizer_state_bytes(), 4 * n);
    }

    /// Swapping the gradient buffer out hands over the gradient itself (the same allocation)
    /// and takes the other buffer in; a buffer of another length is refused, nothing swapped.
    #[test]
    fn host_gradients_swap_out_whole_and_back() {
        let mut e = engine();
        let n = e.layout().len;
        let x: Vec<f32> = (0..4 * 6).map(|i| (i as f32 * 0.3).sin()).collect();
        e.forward(&x, &[0, 1, 2, 1], true).expect("forward");
        e.backward(false).expect("backward");
        let grads = e.grads().expect("grads");
        let mut other = vec![7.0; n];
        let spare_at = other.as_ptr();
        assert!(e.swap_host_grads(&mut other).expect("swap"));
        assert_eq!(other, grads, "the gradient was not handed over");
        assert!(e.grads().expect("grads").iter().all(|&v| v == 7.0), "the other buffer was not taken in");
        let mut short = vec![0.0; n - 1];
        assert!(e.swap_host_grads(&mut short).is_err(), "a short buffer is refused");
        assert_eq!(short.len(), n - 1);
        let lent_at = other.as_ptr();
        assert!(e.swap_host_grads(&mut other).expect("swap back"));
        assert_eq!((e.grads().expect("grads"), other.as_ptr()), (grads, spare_at));
        assert!(e.host_buffers_mut().is_some_and(|(_, g)| g.as_ptr() == lent_at), "not the same buffer");
    }

    /// A replayed backward hands each layer's gradients out, last layer first, never before
    /// the layer's backward time (scaled to the batch) has passed since backward began; it
    /// writes nothing into them; the update changes no parameter and waits the optimiser out.
    #[test]
    fn a_replayed_backward_hands_out_each_layer_at_its_moment() {
        use crate::profile::{Layer, Profile};
        let layer = |name: &str, ms: u64, tensors: Vec<(String, Vec<usize>)>| Layer {
            name: name.into(),
            forward_ns: ms * 1_000_000,
            backward_ns: 2 * ms * 1_000_000,
            tensors,
        };
        let t = |name: &str, shape: &[usize]| (name.to_string(), shape.to_vec());
        let profile = Profile {
            model: "toy".into(),
            batch: 4,
            device: "test".into(),
            estimated: false,
            layers: vec![
                layer("fc2", 3, vec![t("fc2.bias", &[10]), t("fc2.weight", &[10, 20])]),
                layer("act", 1, vec![]),
                layer("fc1", 5, vec![t("fc1.weight", &[20, 30])]),
            ],
            optimizer_ns: 4_000_000,
            source: "test".into(),
        };
        let mut e = Engine::new(Device::Cpu { threads: 1 }, ModelSpec::replay(profile), 7).expect("engine");
        let layout = e.layout().clone();
        assert_eq!(layout.len, 10 + 200 + 600);
        assert_eq!(layout.backward_order(), vec![800..810, 600..800, 0..600], "fc2 on top, fc1 below");
        assert_eq!(layout.param("fc1.weight").map(|t| t.range.clone()), Some(0..600));
        let (params, grads) = (e.params().expect("params"), e.grads().expect("grads"));
        assert!(grads.iter().all(|g| g.abs() > 0.0 && g.abs() < 1.0), "gradients are drawn once, nonzero");
        // Batch 8 is twice the profile's: each time doubles.
        let t0 = std::time::Instant::now();
        e.forward(&[0.0; 8], &[0; 8], true).expect("forward");
        assert!(t0.elapsed() >= std::time::Duration::from_millis(18));
        let plan = BucketPlan::with_cap(&layout, 200);
        let mut seen = Vec::new();
        let t0 = std::time::Instant::now();
        e.backward_buckets(&plan, false, &mut |b| {
            seen.push((b.range.clone(), t0.elapsed()));
        })
        .expect("backward");
        let ms = |v: u64| std::time::Duration::from_millis(v);
        assert_eq!(seen.iter().map(|s| s.0.clone()).collect::<Vec<_>>(), vec![600..810, 0..600]);
        assert!(seen[0].1 >= ms(12) && seen[1].1 >= ms(12 + 4 + 20), "{seen:?}");
        assert_eq!(e.grads().expect("grads"), grads, "a replayed backward writes nothing");
        let t0 = std::time::Instant::now();
        e.update(&SgdConfig::default(), 1.0).expect("update");
        assert!(t0.elapsed() >= ms(4));
        assert_eq!(e.params().expect("params"), params, "a replayed update changes nothing");
        let mut shard = vec![1.0; 405];
        let t0 = std::time::Instant::now();
        e.part_update().apply(&SgdConfig::default(), &mut shard, &[1.0; 405], &mut [0.0; 405], 1.0);
        assert!(t0.elapsed() >= ms(2), "half the parameters, half the optimiser's time");
        assert!(shard.iter().all(|&v| v == 1.0));
    }

    /// A profile measured from a model trained for real replays with the very same layout:
    /// every tensor at the same place of the flat buffer, the same gradient-ready units.
    #[test]
    fn a_recorded_profile_replays_with_the_models_own_layout() {
        for (name, input) in [
            ("tiny", crate::model::Input::Flat(32)),
            ("cnn8", crate::model::Input::Image { channels: 1, height: 8, width: 8 }),
            ("embedding:50:4:8", crate::model::Input::Bag { rows: 50, slots: 3 }),
        ] {
            let spec = ModelSpec::parse(name).unwrap().fit(input, 8).unwrap();
            let mut e = Engine::new(Device::Cpu { threads: 1 }, spec, 3).unwrap();
            let rows = 4;
            let x: Vec<f32> = match input {
                // Bags: ids 0, 7, 14, ... with weight 1.
                crate::model::Input::Bag { slots, .. } => (0..rows)
                    .flat_map(|s| {
                        (0..2 * slots)
                            .map(move |j| if j < slots { ((s * slots + j) * 7 % 50) as f32 } else { 1.0 })
                    })
                    .collect(),
                _ => (0..rows * input.len()).map(|i| (i as f32 * 0.37).sin()).collect(),
            };
            let p = e.record_profile(&x, &[1, 2, 3, 4], 2).unwrap();
            assert_eq!(
                (p.batch, p.estimated, p.layers[0].name.as_str()),
                (4, false, "loss (softmax cross-entropy)")
            );
            assert_eq!(p.parameters(), e.layout().len, "{name}");
            let (f, b) = p.compute_ns();
            assert!(f > 0 && b > 0, "{name}: {f} {b}");
            let replay = Engine::new(Device::Cpu { threads: 1 }, ModelSpec::replay(p), 3).unwrap();
            let strip = |l: &Layout| {
                l.params
                    .iter()
                    .map(|t| (t.name.clone(), t.shape.clone(), t.range.clone()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(strip(replay.layout()), strip(e.layout()), "{name}");
            // The same gradient-ready boundaries, each of the model's a replay's too (a replay
            // readies a norm's weight and bias as two units, where the model fuses them).
            let starts = |l: &Layout| l.backward_order().iter().map(|r| r.start).collect::<Vec<_>>();
            let replayed = starts(replay.layout());
            assert!(starts(e.layout()).iter().all(|s| replayed.contains(s)), "{name}");
        }
    }

    #[test]
    fn lazy_momentum_trains_as_an_explicit_zero_one() {
        // Two steps from an engine whose momentum was written as zeros up front, and from one
        // that allocates it on the first update: the same bits.
        let (mut lazy, mut eager) = (engine(), engine());
        let n = eager.layout().len;
        eager.write_momentum(&vec![0.0; n]).expect("write");
        for _ in 0..2 {
            step(&mut lazy);
            step(&mut eager);
        }
        assert_eq!(lazy.params().expect("params"), eager.params().expect("params"));
    }
}
