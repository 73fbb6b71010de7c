//! NCCL through cudarc: collectives on GPU memory.
//!
//! The NCCL and driver libraries are loaded at run time, so this compiles everywhere; on a
//! machine without them, [`Nccl::new`] and [`unique_id`] return [`CommError::Nccl`] instead of
//! panicking. The unique id is made by rank 0 and travels through the rendezvous store.
//!
//! Device buffers go straight to NCCL ([`Nccl::all_reduce_device`]). Host buffers (the
//! [`Collective`] trait, used by the tests and by engines whose gradients live on the host)
//! are staged through one device buffer that grows on demand. NCCL itself has no per-call
//! timeout: every wait here polls the stream and aborts the communicator once the timeout
//! passes, so a dead peer gives an error, not a hang. NCCL refuses two ranks on one GPU, so
//! more than one rank needs as many GPUs.
//!
//! The communicator is not `Send`: it stays on the thread that made it.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp, group_end, group_start};

use super::{Collective, CommError, Result, Traffic, check_rank, segment};

/// Bytes in an NCCL unique id.
pub const ID_BYTES: usize = 128;

fn nccl_err<E: std::fmt::Debug>(op: &'static str) -> impl FnOnce(E) -> CommError {
    move |e| CommError::Nccl { op, msg: format!("{e:?}") }
}

/// Whether the NCCL library (and a GPU driver) can be loaded here; the reason if not.
pub fn available() -> Result<()> {
    gradsync_core::device::cuda::probe(0).map_err(|e| CommError::Nccl { op: "probe", msg: e.to_string() })?;
    // SAFETY: only tries to dlopen libnccl; no NCCL call is made.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(CommError::Nccl { op: "probe", msg: "libnccl was not found".into() });
    }
    Ok(())
}

/// A fresh NCCL unique id (rank 0 makes it; the store hands it to the others).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    available()?;
    let id = Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank's NCCL communicator on one GPU.
pub struct Nccl {
    comm: Comm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    staging: Option<CudaSlice<f32>>,
    timeout: Duration,
    traffic: Traffic,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Nccl(rank {} of {} on cuda:{})",
            self.comm.rank(),
            self.comm.world_size(),
            self.ctx.ordinal()
        )
    }
}

impl Nccl {
    /// Join the communicator `id` as `rank` of `world` on CUDA device `ordinal`.
    pub fn new(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: &[u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Nccl> {
        available()?;
        check_rank("rank", rank, world)?;
        let ctx = CudaContext::new(ordinal).map_err(nccl_err("cuCtxCreate"))?;
        let stream = ctx.new_stream().map_err(nccl_err("cuStreamCreate"))?;
        let id = Id::uninit(id.map(|b| b as ::core::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), rank, world, id).map_err(nccl_err("ncclCommInitRank"))?;
        Ok(Nccl { comm, ctx, stream, staging: None, timeout, traffic: Traffic::default() })
    }

    /// The stream NCCL works on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Queue the in-place sum of `len` values at device address `ptr` across ranks, to start
    /// once the work queued so far on `after` (the stream that produced them) is done. Returns
    /// at once; [`Nccl::wait_all`] waits for every queued reduction.
    ///
    /// # Safety
    /// `ptr` must point to `len` `f32` values of device memory on this communicator's GPU that
    /// stay allocated, and that nothing else reads or writes, until [`Nccl::wait_all`] returns.
    pub unsafe fn all_reduce_device_after(
        &mut self,
        ptr: cudarc::driver::sys::CUdeviceptr,
        len: usize,
        after: &CudaStream,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let ready = after.record_event(None).map_err(nccl_err("cuEventRecord"))?;
        self.stream.wait(&ready).map_err(nccl_err("cuStreamWaitEvent"))?;
        // SAFETY: the caller vouches for the allocation; the slice is leaked below, never freed.
        let mut view = unsafe { self.stream.upgrade_device_ptr::<f32>(ptr, len) };
        let out = self.comm.all_reduce_in_place(&mut view, &ReduceOp::Sum);
        let _ = view.leak();
        out.map_err(nccl_err("ncclAllReduce"))?;
        self.count(len, 2);
        Ok(())
    }

    /// Wait (bounded by the timeout) for every reduction queued so far.
    pub fn wait_all(&mut self) -> Result<()> {
        self.wait("all_reduce")
    }

    /// Ring-equivalent traffic of an operation over `len` values (`factor` full passes).
    fn count(&mut self, len: usize, factor: u64) {
        let w = self.comm.world_size() as u64;
        let bytes = len as u64 * 4 * factor * (w - 1) / w.max(1);
        self.traffic.sent += bytes;
        self.traffic.recv += bytes;
    }

    /// Wait for the stream, polling so that a hung peer turns into an error at the timeout.
    fn wait(&mut self, op: &'static str) -> Result<()> {
        let ev = self.stream.record_event(None).map_err(nccl_err("cuEventRecord"))?;
        let t0 = Instant::now();
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if t0.elapsed() < self.timeout => std::thread::sleep(Duration::from_micros(50)),
                Ok(false) => {
                    return Err(CommError::Nccl {
                        op,
                        msg: format!(
                            "did not finish within {:.1} s (a rank is dead or hung; NCCL cannot say which)",
                            self.timeout.as_secs_f64()
                        ),
                    });
                }
                Err(e) => return Err(CommError::Nccl { op, msg: format!("{e:?}") }),
            }
        }
    }

    /// The staging buffer, at least `n` values long.
    fn staging(&mut self, n: usize) -> Result<&mut CudaSlice<f32>> {
        if self.staging.as_ref().is_none_or(|s| s.len() < n.max(1)) {
            self.staging = Some(self.stream.alloc_zeros::<f32>(n.max(1)).map_err(nccl_err("cuMemAlloc"))?);
        }
        self.staging.as_mut().ok_or_else(|| CommError::Nccl { op: "cuMemAlloc", msg: "no buffer".into() })
    }

    fn upload(&mut self, src: &[f32], n: usize) -> Result<()> {
        let stream = self.stream.clone();
        let st = self.staging(n)?;
        if !src.is_empty() {
            stream.memcpy_htod(src, &mut st.slice_mut(0..src.len())).map_err(nccl_err("cuMemcpyHtoD"))?;
        }
        Ok(())
    }

    fn download(&mut self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        self.wait("copy")?;
        let stream = self.stream.clone();
        let st = self.staging(range.end)?;
        if !dst.is_empty() {
            stream.memcpy_dtoh(&st.slice(range), dst).map_err(nccl_err("cuMemcpyDtoH"))?;
        }
        Ok(())
    }

    /// Run `f` on the staging buffer holding `buf`, then copy `back` of it into `buf[back]`.
    fn staged(
        &mut self,
        buf: &mut [f32],
        back: Range<usize>,
        op: &'static str,
        f: impl FnOnce(&Comm, &mut CudaSlice<f32>) -> std::result::Result<(), cudarc::nccl::result::NcclError>,
    ) -> Result<()> {
        self.upload(buf, buf.len())?;
        let Nccl { comm, staging, .. } = self;
        let st = staging.as_mut().ok_or_else(|| CommError::Nccl { op, msg: "no staging buffer".into() })?;
        f(comm, st).map_err(nccl_err(op))?;
        self.wait(op)?;
        self.download(back.clone(), &mut buf[back])
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()> {
        let n = buf.len();
        self.count(n, 2);
        self.staged(buf, 0..n, "ncclAllReduce", |c, st| {
            c.all_reduce_in_place(&mut st.slice_mut(0..n), &ReduceOp::Sum).map(|_| ())
        })
    }

    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        let (n, w, r) = (buf.len(), self.world_size(), self.rank());
        let mine = segment(n, w, r);
        self.count(n, 1);
        // NCCL needs equal pieces: pad each segment to the longest, reduce, and unpad.
        let piece = segment(n, w, 0).len();
        let mut padded = vec![0.0f32; piece * w];
        for k in 0..w {
            let s = segment(n, w, k);
            padded[k * piece..k * piece + s.len()].copy_from_slice(&buf[s]);
        }
        self.upload(&padded, piece * (w + 1))?;
        let Nccl { comm, staging, .. } = self;
        let st = staging
            .as_mut()
            .ok_or_else(|| CommError::Nccl { op: "reduce_scatter", msg: "no buffer".into() })?;
        let (src, mut dst) = st.split_at_mut(piece * w);
        comm.reduce_scatter(&src, &mut dst.slice_mut(0..piece), &ReduceOp::Sum)
            .map_err(nccl_err("ncclReduceScatter"))?;
        self.wait("reduce_scatter")?;
        let at = piece * w;
        self.download(at..at + mine.len(), &mut buf[mine.clone()])?;
        Ok(mine)
    }

    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        let (n, w, r) = (buf.len(), self.world_size(), self.rank());
        self.count(n, 1);
        let piece = segment(n, w, 0).len();
        let mine = segment(n, w, r);
        let mut padded = vec![0.0f32; piece];
        padded[..mine.len()].copy_from_slice(&buf[mine]);
        self.upload(&padded, piece * (w + 1))?;
        let Nccl { comm, staging, .. } = self;
        let st =
            staging.as_mut().ok_or_else(|| CommError::Nccl { op: "all_gather", msg: "no buffer".into() })?;
        let (src, mut dst) = st.split_at_mut(piece);
        comm.all_gather(&src, &mut dst.slice_mut(0..piece * w)).map_err(nccl_err("ncclAllGather"))?;
        self.wait("all_gather")?;
        let mut all = vec![0.0f32; piece * w];
        self.download(piece..piece * (w + 1), &mut all)?;
        for k in 0..w {
            let s = segment(n, w, k);
            buf[s.clone()].copy_from_slice(&all[k * piece..k * piece + s.len()]);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        check_rank("root", root, self.world_size())?;
        let n = buf.len();
        self.count(n, 1);
        self.staged(buf, 0..n, "ncclBroadcast", |c, st| {
            c.broadcast_in_place(&mut st.slice_mut(0..n), root as i32).map(|_| ())
        })
    }

    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        check_rank("root", root, self.world_size())?;
        let n = buf.len();
        self.count(n, 1);
        let back = if self.rank() == root { 0..n } else { 0..0 };
        self.staged(buf, back, "ncclReduce", |c, st| {
            c.reduce_in_place(&mut st.slice_mut(0..n), &ReduceOp::Sum, root as i32).map(|_| ())
        })
    }

    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
        let (w, r, n) = (self.world_size(), self.rank(), send.len());
        check_rank("root", root, w)?;
        if r == root && out.len() != n * w {
            return Err(CommError::Invalid {
                what: "gather output",
                why: format!("{} values, need {}", out.len(), n * w),
            });
        }
        self.upload(send, n * (w + 1))?;
        let Nccl { comm, staging, .. } = self;
        let st = staging.as_mut().ok_or_else(|| CommError::Nccl { op: "gather", msg: "no buffer".into() })?;
        let (src, mut dst) = st.split_at_mut(n);
        group_start().map_err(nccl_err("ncclGroupStart"))?;
        if r == root {
            for p in (0..w).filter(|&p| p != r) {
                comm.recv(&mut dst.slice_mut(p * n..(p + 1) * n), p as i32).map_err(nccl_err("ncclRecv"))?;
            }
        } else {
            comm.send(&src, root as i32).map_err(nccl_err("ncclSend"))?;
        }
        group_end().map_err(nccl_err("ncclGroupEnd"))?;
        self.wait("gather")?;
        if r == root {
            let mut all = vec![0.0f32; n * w];
            self.download(n..n * (w + 1), &mut all)?;
            out.copy_from_slice(&all);
            out[r * n..(r + 1) * n].copy_from_slice(send);
        }
        Ok(())
    }

    fn scatter(&mut self, src: &[f32], recv: &mut [f32], root: usize) -> Result<()> {
        let (w, r, n) = (self.world_size(), self.rank(), recv.len());
        check_rank("root", root, w)?;
        if r == root && src.len() != n * w {
            return Err(CommError::Invalid {
                what: "scatter input",
                why: format!("{} values, need {}", src.len(), n * w),
            });
        }
        if r == root {
            self.upload(src, n * (w + 1))?;
        } else {
            self.staging(n * (w + 1))?;
        }
        let Nccl { comm, staging, .. } = self;
        let st =
            staging.as_mut().ok_or_else(|| CommError::Nccl { op: "scatter", msg: "no buffer".into() })?;
        let (all, mut mine) = st.split_at_mut(n * w);
        group_start().map_err(nccl_err("ncclGroupStart"))?;
        if r == root {
            for p in (0..w).filter(|&p| p != r) {
                comm.send(&all.slice(p * n..(p + 1) * n), p as i32).map_err(nccl_err("ncclSend"))?;
            }
        } else {
            comm.recv(&mut mine.slice_mut(0..n), root as i32).map_err(nccl_err("ncclRecv"))?;
        }
        group_end().map_err(nccl_err("ncclGroupEnd"))?;
        self.wait("scatter")?;
        if r == root {
            recv.copy_from_slice(&src[r * n..(r + 1) * n]);
        } else {
            self.download(n * w..n * (w + 1), recv)?;
        }
        Ok(())
    }

    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()> {
        check_rank("peer", peer, self.world_size())?;
        self.upload(buf, buf.len())?;
        let n = buf.len();
        let Nccl { comm, staging, .. } = self;
        let st = staging.as_mut().ok_or_else(|| CommError::Nccl { op: "send", msg: "no buffer".into() })?;
        comm.send(&st.slice(0..n), peer as i32).map_err(nccl_err("ncclSend"))?;
        self.traffic.sent += n as u64 * 4;
        self.wait("send")
    }

    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()> {
        check_rank("peer", peer, self.world_size())?;
        let n = buf.len();
        self.staging(n)?;
        let Nccl { comm, staging, .. } = self;
        let st = staging.as_mut().ok_or_else(|| CommError::Nccl { op: "recv", msg: "no buffer".into() })?;
        comm.recv(&mut st.slice_mut(0..n), peer as i32).map_err(nccl_err("ncclRecv"))?;
        self.traffic.recv += n as u64 * 4;
        self.download(0..n, buf)
    }

    fn barrier(&mut self) -> Result<()> {
        let mut one = [1.0f32];
        self.all_reduce(&mut one)
    }
}
