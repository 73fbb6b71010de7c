//! What code outside the CUDA backend may hold of a GPU: a stream ([`GpuStream`]), device
//! buffers ([`GpuBuf`], [`GpuLabels`]) and the events that mark work on a stream done
//! ([`GpuEvent`]). Each wraps its cudarc type privately, so core's public API names none: a
//! communicator that runs a library of its own on the device (NCCL) gets a stream handle
//! ([`GpuStream::raw`]), device addresses (`u64`) and these calls, and nothing that ties it to
//! cudarc's version.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};

use super::cuda_err;
use crate::error::{Error, Result};

/// A CUDA stream's driver handle (`CUstream`), as libraries that queue work on a stream take it.
pub type RawStream = *mut std::ffi::c_void;

/// A stream on one GPU and the context it belongs to. Work queued on it runs in order; work
/// on another stream is ordered against it with [`GpuStream::after`]. Cloning gives another
/// handle to the same stream.
#[derive(Clone)]
pub struct GpuStream {
    pub(in crate::device) ctx: Arc<CudaContext>,
    pub(in crate::device) stream: Arc<CudaStream>,
}

impl std::fmt::Debug for GpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuStream(cuda:{})", self.ctx.ordinal())
    }
}

impl GpuStream {
    /// A new stream of its own on CUDA device `ordinal` (the device's primary context, which
    /// the backend's compute stream shares). Fails with [`Error::NoCuda`] where the device
    /// cannot be opened.
    pub fn new(ordinal: usize) -> Result<GpuStream> {
        super::probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("open context"))?;
        let stream = ctx.new_stream().map_err(cuda_err("create stream"))?;
        Ok(GpuStream { ctx, stream })
    }

    /// Another new stream on the same context.
    pub(in crate::device) fn beside(&self) -> Result<GpuStream> {
        let stream = self.ctx.new_stream().map_err(cuda_err("create stream"))?;
        Ok(GpuStream { ctx: self.ctx.clone(), stream })
    }

    /// The device's index.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Make the stream's context current on the calling thread, as a library's own calls on
    /// this device (NCCL's) expect.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(cuda_err("bind context"))
    }

    /// The driver's handle of the stream, for a library that queues work on it. Valid while
    /// any handle to this stream lives.
    pub fn raw(&self) -> RawStream {
        self.stream.cu_stream().cast()
    }

    /// Make this stream wait for the work queued on `other` so far.
    pub fn after(&self, other: &GpuStream) -> Result<()> {
        let ready = other.stream.record_event(None).map_err(cuda_err("record event"))?;
        // The event is destroyed when this returns; the queued wait still holds what it
        // recorded.
        self.stream.wait(&ready).map_err(cuda_err("wait for event"))
    }

    /// An event marking the work queued on this stream so far.
    pub fn record(&self) -> Result<GpuEvent> {
        self.stream.record_event(None).map(GpuEvent).map_err(cuda_err("record event"))
    }

    /// [`GpuStream::record`] with timing, for [`GpuEvent::elapsed_ms`].
    pub fn record_timed(&self) -> Result<GpuEvent> {
        let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
        self.stream.record_event(timed).map(GpuEvent).map_err(cuda_err("record event"))
    }

    /// Wait on the host for the work queued on this stream so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    /// `n` zeroed values (at least one: an empty allocation is no buffer), allocated on this
    /// stream and freed on it after the work queued there when dropped.
    pub fn zeros(&self, n: usize) -> Result<GpuBuf> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map(GpuBuf).map_err(cuda_err("alloc"))
    }

    /// Copy `src` into `dst` from value `offset` on, returning once `src` has been consumed.
    pub fn upload(&self, src: &[f32], dst: &mut GpuBuf, offset: usize) -> Result<()> {
        let end = offset.checked_add(src.len()).filter(|&e| e <= dst.len()).ok_or(Error::Length {
            what: "device write",
            expected: dst.len().saturating_sub(offset),
            got: src.len(),
        })?;
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.0.slice_mut(offset..end);
        // Copying from pageable host memory returns once `src` has been consumed.
        self.stream.memcpy_htod(src, &mut view).map_err(cuda_err("copy to device"))
    }

    /// Copy `src[range]` into `dst` once the work queued on this stream so far is done.
    pub fn download(&self, src: &GpuBuf, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        if range.start > range.end || range.end > src.len() || dst.len() != range.len() {
            return Err(Error::Length { what: "device read", expected: range.len(), got: dst.len() });
        }
        if dst.is_empty() {
            return Ok(());
        }
        // The copy synchronizes the stream, so `dst` holds the values on return.
        self.stream.memcpy_dtoh(&src.0.slice(range), dst).map_err(cuda_err("copy to host"))
    }
}

/// The point a stream had reached when the event was recorded ([`GpuStream::record`]).
pub struct GpuEvent(CudaEvent);

impl std::fmt::Debug for GpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GpuEvent")
    }
}

impl GpuEvent {
    /// Whether the work before the event has finished (never waits).
    pub fn is_complete(&self) -> Result<bool> {
        self.0.try_is_complete().map_err(cuda_err("query event"))
    }

    /// The GPU's milliseconds from this event to `end` (both timed), once `end` is reached.
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32> {
        self.0.elapsed_ms(&end.0).map_err(cuda_err("event time"))
    }
}

/// `f32` values in a GPU's memory: the CUDA backend's buffer ([`super::Cuda`]'s
/// `Backend::Buf`). Freed on its stream, after the work queued there, when dropped.
pub struct GpuBuf(pub(in crate::device) CudaSlice<f32>);

/// Class labels in a GPU's memory (the CUDA backend's `Backend::Labels`).
pub struct GpuLabels(pub(in crate::device) CudaSlice<u32>);

impl std::fmt::Debug for GpuBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuf({} values)", self.len())
    }
}

impl std::fmt::Debug for GpuLabels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuLabels({} values)", self.0.len())
    }
}

impl GpuBuf {
    /// Values in the buffer.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the buffer holds no values (never: an allocation holds at least one).
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }
}
