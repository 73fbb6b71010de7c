//! Gradient buckets of a GPU engine staged through page-locked host memory, for communicators
//! that reduce in host memory (the TCP and shared-memory rings).
//!
//! ```text
//!   compute stream:  ... bwd(layer 3) ─ ev ─ bwd(layer 2) ─ ev ─ bwd(layer 1) ... ─ wait(back) ─ sgd
//!                               │                  │
//!   copy stream:            wait ─ D2H b0 ─ ready  wait ─ D2H b1 ─ ready ...  H2D b0 ─ H2D b1 ─ back
//!                                           │                      │           ▲
//!   host ring (communication thread):  wait(ready) ─ all-reduce b0  wait ─ all-reduce b1 ...
//! ```
//!
//! The moment backward has queued a bucket's last kernel, the copy of that bucket to the host
//! is queued on a copy stream of its own behind an event on the compute stream, and an event
//! after the copy marks it landed. The host ring waits for that event (bounded) and reduces the
//! values in place, then queues the copy back on the same stream. The compute stream waits for
//! every copy back before it next touches the gradients. So a bucket's copies and its
//! reduction overlap the backward of the earlier layers, as on the CPU, where a bucket is
//! reduced in place.
//!
//! The pinned buffer mirrors the whole gradient buffer (each bucket its own range), is
//! allocated at the first staged backward and freed once the copy stream is idle. It is plain
//! page-locked memory (not write-combined: the ring reads it).

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};

use super::cuda::Cuda;
use crate::error::{Error, Result};

/// The longest a staged bucket's copy may take to land before it is reported as a failure: the
/// device is then stuck, and no bucket waits forever.
const COPY_TIMEOUT: Duration = Duration::from_secs(120);

fn cuda_err<E: std::fmt::Display>(op: &'static str) -> impl FnOnce(E) -> Error {
    move |e| Error::Cuda { op, msg: e.to_string() }
}

/// Page-locked host memory holding `len` `f32` values, freed on drop.
struct Pinned {
    ptr: *mut f32,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned like a `Vec`'s: nothing else frees or aliases it, and it is
// only reached through `&self`/`&mut self`, so moving or sharing the owner across threads is as
// sound as for a `Vec<f32>`.
unsafe impl Send for Pinned {}
// SAFETY: as above; `&Pinned` gives no access to the values.
unsafe impl Sync for Pinned {}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned> {
        let bytes =
            len.max(1).checked_mul(size_of::<f32>()).ok_or_else(|| Error::invalid("staging", "too large"))?;
        ctx.bind_to_thread().map_err(cuda_err("staging"))?;
        // SAFETY: a plain page-locked allocation (flags 0: cached, not write-combined); zeroed
        // below before any use.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(cuda_err("allocate pinned host memory"))?
            as *mut f32;
        // SAFETY: `bytes` writable bytes at `ptr`, just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        Ok(Pinned { ptr, len, ctx: ctx.clone() })
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: `len` initialised values, exclusively borrowed through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // Nothing may be in flight here: the owner synchronised the copy stream first.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host, freed once.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The staging of one GPU engine: the copy stream and the pinned mirror of its gradients.
/// Dropping it waits for the copy stream, so it must be dropped before the gradient buffer.
pub struct Staging {
    streams: Streams,
    host: Option<Pinned>,
}

/// The streams a staged bucket is copied on, and whether copies back are pending.
pub struct Streams {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copies: Arc<CudaStream>,
    /// A copy back was queued since the compute stream last waited for the copy stream.
    returned: AtomicBool,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging").field("values", &self.host.as_ref().map_or(0, |h| h.len)).finish()
    }
}

impl Staging {
    /// Staging for `gpu`'s buffers, with its own copy stream (no memory until first used).
    pub fn new(gpu: &Cuda) -> Result<Staging> {
        let compute = gpu.stream();
        let copies = compute.beside()?.stream;
        let streams = Streams {
            ctx: compute.ctx.clone(),
            compute: compute.stream.clone(),
            copies,
            returned: AtomicBool::new(false),
        };
        Ok(Staging { streams, host: None })
    }

    /// The pinned mirror of `len` gradients (allocated the first time) and the streams a
    /// staged bucket is copied on.
    pub fn lend(&mut self, len: usize) -> Result<(&mut [f32], &Streams)> {
        if self.host.as_ref().is_none_or(|h| h.len != len) {
            self.streams.copies.synchronize().map_err(cuda_err("synchronize the copy stream"))?;
            self.host = None;
            self.host = Some(Pinned::new(&self.streams.ctx, len)?);
        }
        let Staging { streams, host: Some(host) } = self else { unreachable!("allocated above") };
        Ok((host.as_mut_slice(), streams))
    }

    /// Make the compute stream wait for every copy back queued so far (nothing when none
    /// was).
    pub fn settle(&self) -> Result<()> {
        self.streams.settle()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned buffer, and the gradients the copies write, are freed after this.
        let _ = self.streams.copies.synchronize();
    }
}

impl Streams {
    /// Queue the copy of the `host.len()` device values at `device` (written by work queued
    /// so far on the compute stream) into `host`, values `range` of the gradient buffer; the
    /// returned bucket waits for it to land.
    ///
    /// # Safety
    /// `device` must hold `host.len()` values of this engine's gradient buffer that stay
    /// allocated, and that no other work writes, until the bucket is finished or dropped and
    /// the copy stream has drained (the engine's next touch of its gradients waits for it).
    pub unsafe fn stage<'a>(
        &'a self,
        range: Range<usize>,
        device: CUdeviceptr,
        host: &'a mut [f32],
    ) -> Result<StagedBucket<'a>> {
        self.ctx.bind_to_thread().map_err(cuda_err("stage a bucket"))?;
        let written = self.compute.record_event(None).map_err(cuda_err("record the bucket's event"))?;
        self.copies.wait(&written).map_err(cuda_err("order the copy after backward"))?;
        if !host.is_empty() {
            // SAFETY: `host` is pinned memory of `host.len()` values, exclusively ours until the
            // bucket ends; the caller vouches for `device`.
            unsafe { result::memcpy_dtoh_async(host, device, self.copies.cu_stream()) }
                .map_err(cuda_err("copy a bucket to the host"))?;
        }
        let landed = self.copies.record_event(None).map_err(cuda_err("record the copy's event"))?;
        Ok(StagedBucket { streams: self, range, device, host, landed })
    }

    fn settle(&self) -> Result<()> {
        if self.returned.swap(false, Ordering::AcqRel) {
            self.ctx.bind_to_thread().map_err(cuda_err("settle the staged buckets"))?;
            let back = self.copies.record_event(None).map_err(cuda_err("record the copies' event"))?;
            self.compute.wait(&back).map_err(cuda_err("order the update after the copies"))?;
        }
        Ok(())
    }
}

/// A bucket whose copy to pinned host memory has been queued.
pub struct StagedBucket<'a> {
    streams: &'a Streams,
    range: Range<usize>,
    device: CUdeviceptr,
    host: &'a mut [f32],
    landed: CudaEvent,
}

impl std::fmt::Debug for StagedBucket<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedBucket").field("range", &self.range).finish_non_exhaustive()
    }
}

impl StagedBucket<'_> {
    /// The values in host memory, once their copy has landed (waiting at most two minutes: a
    /// device that does not finish by then is reported, not waited for).
    pub fn values(&mut self) -> Result<&mut [f32]> {
        let t0 = Instant::now();
        let mut spins = 0u32;
        while !self.landed.try_is_complete().map_err(cuda_err("wait for a staged bucket"))? {
            if t0.elapsed() > COPY_TIMEOUT {
                return Err(Error::Cuda {
                    op: "wait for a staged bucket",
                    msg: format!(
                        "the copy of gradients {:?} to the host did not finish within {} s",
                        self.range,
                        COPY_TIMEOUT.as_secs()
                    ),
                });
            }
            // The copy follows the bucket's backward kernels: usually microseconds away.
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(self.host)
    }

    /// Queue the copy of the (reduced) host values `part` (counted from the bucket's start)
    /// back into the bucket's gradients, before anything the engine does next with them.
    pub fn copy_back(self, part: Range<usize>) -> Result<()> {
        let s = self.streams;
        let values = self.host.get(part.clone()).ok_or_else(|| {
            Error::invalid(
                "copy a bucket back",
                format!("{part:?} is not inside its {} values", self.host.len()),
            )
        })?;
        s.ctx.bind_to_thread().map_err(cuda_err("copy a bucket back"))?;
        // The copy back must not start before the copy out has landed (the same stream orders
        // them) nor read values the ring is still writing (the ring has returned).
        if !values.is_empty() {
            let at = self.device + (part.start * size_of::<f32>()) as CUdeviceptr;
            // SAFETY: `part` lies inside the bucket, whose device range the caller of `stage`
            // vouched for; the pinned values stay allocated and untouched until the copy stream
            // drains: the next write to them is the next step's copy out, queued behind this.
            unsafe { result::memcpy_htod_async(at, values, s.copies.cu_stream()) }
                .map_err(cuda_err("copy a bucket back to the device"))?;
        }
        s.returned.store(true, Ordering::Release);
        Ok(())
    }
}
