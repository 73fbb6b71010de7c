//! NCCL on GPU memory.
//!
//! The library is found and loaded by gradsync ([`nccl_lib`](super::nccl_lib): cudarc never
//! looks for `libnccl.so.2`), so this compiles everywhere; on a machine without NCCL or a GPU,
//! [`Nccl::new`] and [`unique_id`] return [`CollectiveError::Nccl`] instead of panicking. The unique
//! id is made by rank 0 and travels through the rendezvous store.
//!
//! Device buffers go straight to NCCL ([`Nccl::all_reduce_device_after`]), or, in half
//! precision, through the staging buffer: rounded there by the device's kernels, reduced in
//! NCCL's fp16 or bf16 type and widened back, all on NCCL's stream
//! ([`Nccl::all_reduce_half_device_after`]). Host buffers (the
//! [`Collective`] trait, used by the tests and by engines whose gradients live on the host)
//! are staged through one device buffer that grows on demand. NCCL refuses two ranks on one
//! GPU, so more than one rank needs as many GPUs.
//!
//! The device side (NCCL's stream, the staging buffer, the events a wait polls, the kernels
//! of a half-precision reduction) is core's ([`GpuStream`], [`GpuBuf`], [`GpuEvent`],
//! [`HalfCast`]): this file holds NCCL's calls and their failure handling, never a CUDA
//! binding's types.
//!
//! # Timeouts and failures
//! NCCL has no per-call timeout, and a collective whose peer is dead runs forever on the GPU,
//! writing into its buffers. So:
//! - the communicator is nonblocking: set-up returns at once and is polled
//!   (`ncclCommGetAsyncError`) until every rank has joined, up to the timeout;
//! - every wait polls the stream and NCCL's asynchronous error, up to the timeout;
//! - any failure (a timeout, an error from NCCL) aborts the communicator (`ncclCommAbort`),
//!   which stops its kernels, and then waits for the stream to drain before returning, so no
//!   buffer is freed while NCCL still writes into it. If the stream still does not drain, the
//!   staging buffer is leaked rather than freed. An aborted communicator refuses every later
//!   call with the reason;
//! - a group (`ncclGroupStart`/`End`) is a guard that ends on every path ([`Group`]);
//! - dropping a communicator whose work has not finished waits up to the timeout, then
//!   aborts instead of destroying (NCCL's destroy would wait forever).
//!
//! The communicator is not `Send`: it stays on the thread that made it.
//!
//! Over 700 lines because every NCCL call and its failure handling (abort, drain,
//! leak rather than free) must stay next to each other; the library loading is apart, in
//! `nccl_lib`.

use std::ffi::c_int;
use std::ops::Range;
use std::time::{Duration, Instant};

use gradsync_core::device::{Cuda, GpuBuf, GpuEvent, GpuStream, HalfCast};
use gradsync_core::engine::DeviceGrads;

use super::error::{CollectiveError, Result};
use super::nccl_lib::{
    self, BFLOAT16, Config, FLOAT16, FLOAT32, Group, IN_PROGRESS, Lib, RawComm, RawStream, SUCCESS, SUM,
};
use super::{Collective, Half, Traffic, check_rank, packed_len, segment};

pub use super::nccl_lib::ID_BYTES;

/// The work a device reduction waits for before it starts.
#[derive(Clone, Copy)]
pub enum After<'a> {
    /// Everything queued so far on a stream of this GPU.
    Stream(&'a GpuStream),
    /// A gradient bucket's backward.
    Bucket(&'a DeviceGrads),
}

/// A failure of the device's stream, copies or kernels, as NCCL's communicator reports it.
fn core_err(op: &'static str) -> impl FnOnce(gradsync_core::Error) -> CollectiveError {
    move |e| CollectiveError::Nccl { op, msg: e.to_string() }
}

/// NCCL's type for `half`.
fn half_type(half: Half) -> c_int {
    match half {
        Half::F16 => FLOAT16,
        Half::Bf16 => BFLOAT16,
    }
}

/// Whether NCCL (and a GPU driver) can be used here; the reason if not.
pub fn available() -> Result<()> {
    gradsync_core::device::cuda::probe(0)
        .map_err(|e| CollectiveError::Nccl { op: "probe", msg: e.to_string() })?;
    nccl_lib::lib().map(|_| ())
}

/// A fresh NCCL unique id (rank 0 makes it; the store hands it to the others).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    available()?;
    let lib = nccl_lib::lib()?;
    let mut id = [0u8; ID_BYTES];
    // SAFETY: an out-pointer to ID_BYTES writable bytes, ncclUniqueId's size.
    lib.check("ncclGetUniqueId", unsafe { (lib.get_unique_id)(&mut id) }, None)?;
    Ok(id)
}

/// The device buffer host data is staged through, and its address.
struct Staging {
    buf: GpuBuf,
    ptr: u64,
}

/// One rank's NCCL communicator on one GPU.
pub struct Nccl {
    lib: &'static Lib,
    /// Null once destroyed or aborted.
    comm: RawComm,
    rank: usize,
    world: usize,
    stream: GpuStream,
    staging: Option<Staging>,
    timeout: Duration,
    traffic: Traffic,
    /// Why the communicator was aborted; every later call fails with it.
    broken: Option<String>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Nccl(rank {} of {} on cuda:{}, {})",
            self.rank,
            self.world,
            self.stream.ordinal(),
            self.lib.path
        )
    }
}

impl Nccl {
    /// Join the communicator `id` as `rank` of `world` on CUDA device `ordinal`, waiting at
    /// most `timeout` for every rank to join.
    pub fn new(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: &[u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Nccl> {
        available()?;
        check_rank("rank", rank, world)?;
        let lib = nccl_lib::lib()?;
        let stream = GpuStream::new(ordinal).map_err(core_err("cuStreamCreate"))?;
        let size = |v: usize| {
            c_int::try_from(v)
                .map_err(|_| CollectiveError::Invalid { what: "world size", why: format!("{v} ranks") })
        };
        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = Config::nonblocking();
        stream.bind().map_err(core_err("cuCtxSetCurrent"))?;
        // SAFETY: an out-pointer for the handle, the id by value, a live config.
        let r =
            unsafe { (lib.comm_init_rank_config)(&mut comm, size(world)?, *id, size(rank)?, &mut config) };
        let mut nccl = Nccl {
            lib,
            comm,
            rank,
            world,
            stream,
            staging: None,
            timeout,
            traffic: Traffic::default(),
            broken: None,
        };
        if comm.is_null() {
            nccl.broken = Some("set-up failed".into());
            lib.check("ncclCommInitRankConfig", r, None)?;
            return Err(CollectiveError::Nccl {
                op: "ncclCommInitRankConfig",
                msg: "no communicator was made".into(),
            });
        }
        nccl.settle("ncclCommInitRank (waiting for every rank to join)", r)?;
        Ok(nccl)
    }

    /// The stream NCCL works on.
    pub fn stream(&self) -> &GpuStream {
        &self.stream
    }

    /// Queue the in-place sum of `len` values at device address `ptr` across ranks, to start
    /// once the work `after` names (what produced them) is done. Returns
    /// at once; [`Nccl::wait_all`] waits for every queued reduction.
    ///
    /// # Safety
    /// `ptr` must point to `len` `f32` values of device memory on this communicator's GPU that
    /// stay allocated, and that nothing else reads or writes, until [`Nccl::wait_all`] returns
    /// (an error included: on failure the communicator is aborted first).
    pub unsafe fn all_reduce_device_after(&mut self, ptr: u64, len: usize, after: After<'_>) -> Result<()> {
        self.usable()?;
        if len == 0 {
            return Ok(());
        }
        self.follow(after)?;
        self.call("ncclAllReduce", |lib, comm, stream| {
            // SAFETY: the caller vouches for `len` values at `ptr`; in place is allowed.
            unsafe { (lib.all_reduce)(ptr as *const _, ptr as *mut _, len, FLOAT32, SUM, comm, stream) }
        })?;
        self.count(len * size_of::<f32>(), 2);
        Ok(())
    }

    /// [`Nccl::all_reduce_device_after`] in half precision (`--compress fp16|bf16`), all on
    /// NCCL's stream once the work `after` names is done: the `len` values at `ptr` are divided
    /// by the world size and rounded to `half` into the staging buffer (`cast`, the device's
    /// kernels), all-reduced there in NCCL's own half type (`ncclFloat16` or `ncclBfloat16`:
    /// two bytes a value on the wire, each hop adding and rounding back to the type), widened
    /// back to `f32` into `ptr` and multiplied by the world size: the sum, its partial sums
    /// never past the largest value a rank sends ([`super::all_reduce_as_half`] on the host
    /// does the same, with the same bits). Every rank ends with the same bits. Returns at once.
    ///
    /// # Safety
    /// As [`Nccl::all_reduce_device_after`].
    pub unsafe fn all_reduce_half_device_after(
        &mut self,
        ptr: u64,
        len: usize,
        after: After<'_>,
        half: Half,
        cast: &HalfCast,
    ) -> Result<()> {
        self.usable()?;
        if len == 0 {
            return Ok(());
        }
        // Buckets queued before this one use the staging buffer too, but in stream order: each
        // is widened back before the next is rounded into it. A larger buffer replaces it
        // only once the work queued on the stream is done with it.
        let halves = self.staging(packed_len(len))?;
        self.follow(after)?;
        self.stream.bind().map_err(core_err("cuCtxSetCurrent"))?;
        // SAFETY: the caller vouches for `len` f32 values at `ptr`; the staging buffer holds
        // `packed_len(len)` f32 slots, room for `len` 16-bit values, and stays allocated while
        // work queued on the stream uses it.
        let (share, world) = super::half_shares(self.world);
        unsafe { cast.round(&self.stream, ptr, halves, len, half, share) }
            .map_err(core_err("round_to_half"))?;
        self.call("ncclAllReduce", |lib, comm, stream| {
            // SAFETY: `len` half values in the staging buffer; in place is allowed.
            unsafe { (lib.all_reduce)(at(halves, 0), at(halves, 0), len, half_type(half), SUM, comm, stream) }
        })?;
        // SAFETY: as above.
        unsafe { cast.widen(&self.stream, halves, ptr, len, half, world) }.map_err(core_err("widen_half"))?;
        self.count(len * size_of::<u16>(), 2);
        Ok(())
    }

    /// Make NCCL's stream wait for what `after` names.
    fn follow(&self, after: After<'_>) -> Result<()> {
        match after {
            After::Stream(s) => self.stream.after(s).map_err(core_err("cuStreamWaitEvent")),
            After::Bucket(g) => g.order_before(&self.stream).map_err(core_err("order NCCL after the bucket")),
        }
    }

    /// Wait (bounded by the timeout) for every reduction queued so far.
    pub fn wait_all(&mut self) -> Result<()> {
        self.wait("all_reduce")
    }

    /// Fail at once if the communicator was aborted.
    fn usable(&self) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => {
                Err(CollectiveError::Nccl { op: "communicator", msg: format!("aborted earlier: {why}") })
            }
        }
    }

    /// Abort the communicator (once) and wait for its stream to drain; returns the error to
    /// report for `op`.
    fn fail(&mut self, op: &'static str, why: String) -> CollectiveError {
        if !self.comm.is_null() {
            let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
            // SAFETY: a live communicator, used by nobody else; null afterwards.
            let aborted = unsafe { (self.lib.comm_abort)(comm) };
            self.broken = Some(format!("{op}: {why}"));
            // The abort stopped NCCL's kernels; the stream now drains. Until it has, buffers
            // it used must stay allocated.
            let drained = self.stream.record().is_ok_and(|ev| self.poll(&ev, None).is_ok());
            if aborted != SUCCESS || !drained {
                if let Some(st) = self.staging.take() {
                    std::mem::forget(st.buf);
                }
                return CollectiveError::Nccl {
                    op,
                    msg: format!(
                        "{why}; the communicator was aborted but its stream did not drain, so its buffers were \
                         left allocated"
                    ),
                };
            }
        }
        CollectiveError::Nccl { op, msg: format!("{why}; the communicator was aborted") }
    }

    /// After a call that returned `r`: wait while NCCL reports the call in progress (a
    /// nonblocking communicator), up to the timeout; abort on an error or at the timeout.
    fn settle(&mut self, op: &'static str, r: c_int) -> Result<()> {
        if r != SUCCESS && r != IN_PROGRESS {
            let why = match self.lib.check(op, r, Some(self.comm)) {
                Err(CollectiveError::Nccl { msg, .. }) => msg,
                _ => format!("NCCL error {r}"),
            };
            return Err(self.fail(op, why));
        }
        let t0 = Instant::now();
        loop {
            match self.async_state() {
                Ok(SUCCESS) => return Ok(()),
                Ok(IN_PROGRESS) if t0.elapsed() < self.timeout => {
                    std::thread::sleep(Duration::from_micros(200))
                }
                Ok(IN_PROGRESS) => {
                    let why = format!(
                        "did not finish within {:.1} s (a rank never joined, or is dead or hung)",
                        self.timeout.as_secs_f64()
                    );
                    return Err(self.fail(op, why));
                }
                Ok(other) => {
                    let why = self.describe(other);
                    return Err(self.fail(op, why));
                }
                Err(why) => return Err(self.fail(op, why)),
            }
        }
    }

    /// `ncclCommGetAsyncError`'s state.
    fn async_state(&self) -> std::result::Result<c_int, String> {
        let mut state = SUCCESS;
        // SAFETY: a live communicator and an out-pointer to a live integer.
        let r = unsafe { (self.lib.comm_get_async_error)(self.comm, &mut state) };
        if r == SUCCESS { Ok(state) } else { Err(self.describe(r)) }
    }

    fn describe(&self, r: c_int) -> String {
        match self.lib.check("", r, Some(self.comm)) {
            Err(CollectiveError::Nccl { msg, .. }) => msg,
            _ => format!("NCCL state {r}"),
        }
    }

    /// Run one NCCL call on this communicator and stream, then settle it.
    fn call(&mut self, op: &'static str, f: impl FnOnce(&Lib, RawComm, RawStream) -> c_int) -> Result<()> {
        self.usable()?;
        self.stream.bind().map_err(core_err("cuCtxSetCurrent"))?;
        let r = f(self.lib, self.comm, self.stream.raw());
        self.settle(op, r)
    }

    /// Run several NCCL calls as one group (`f` returns the first failure); the group is ended
    /// on every path, and a failure aborts the communicator.
    fn grouped(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&Lib, RawComm, RawStream) -> std::result::Result<(), c_int>,
    ) -> Result<()> {
        self.usable()?;
        self.stream.bind().map_err(core_err("cuCtxSetCurrent"))?;
        let group = Group::start(self.lib)?;
        let inner = f(self.lib, self.comm, self.stream.raw());
        let end = group.end();
        match (inner, end) {
            (Err(r), _) => self.settle(op, r),
            (Ok(()), Err(e)) => Err(self.fail(op, e.to_string())),
            (Ok(()), Ok(r)) => self.settle(op, r),
        }
    }

    /// Ring-equivalent traffic of an operation over a buffer of `bytes` (`factor` full
    /// passes), as the host ring counts it.
    fn count(&mut self, bytes: usize, factor: u64) {
        let w = self.world as u64;
        let bytes = bytes as u64 * factor * (w - 1) / w.max(1);
        self.traffic.sent += bytes;
        self.traffic.recv += bytes;
    }

    /// Poll `ev` until it completes, for at most the timeout; with a communicator, also fail
    /// as soon as NCCL reports an asynchronous error.
    fn poll(&self, ev: &GpuEvent, comm: Option<RawComm>) -> std::result::Result<(), String> {
        let t0 = Instant::now();
        loop {
            match ev.is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if t0.elapsed() < self.timeout => {}
                Ok(false) => {
                    return Err(format!(
                        "did not finish within {:.1} s (a rank is dead or hung; NCCL cannot say which)",
                        self.timeout.as_secs_f64()
                    ));
                }
                Err(e) => return Err(e.to_string()),
            }
            if comm.is_some() {
                match self.async_state() {
                    Ok(SUCCESS) | Ok(IN_PROGRESS) => {}
                    Ok(other) => return Err(self.describe(other)),
                    Err(why) => return Err(why),
                }
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Wait for the stream, polling so that a hung peer turns into an error (and an abort) at
    /// the timeout.
    fn wait(&mut self, op: &'static str) -> Result<()> {
        self.usable()?;
        let ev = self.stream.record().map_err(core_err("cuEventRecord"))?;
        match self.poll(&ev, Some(self.comm)) {
            Ok(()) => Ok(()),
            Err(why) => Err(self.fail(op, why)),
        }
    }

    /// The staging buffer's address, the buffer holding at least `n` values.
    fn staging(&mut self, n: usize) -> Result<u64> {
        match &self.staging {
            Some(s) if s.buf.len() >= n.max(1) => Ok(s.ptr),
            _ => {
                // The old buffer is freed on this stream, after the work queued on it.
                let buf = self.stream.zeros(n.max(1)).map_err(core_err("cuMemAlloc"))?;
                let (ptr, _) = Cuda::raw_range(&buf, 0..buf.len());
                self.staging = Some(Staging { buf, ptr });
                Ok(ptr)
            }
        }
    }

    /// Copy `src` to the start of the staging buffer, grown to `n` values. Returns its address.
    fn upload(&mut self, src: &[f32], n: usize) -> Result<u64> {
        let ptr = self.staging(n.max(src.len()))?;
        if let Some(st) = &mut self.staging
            && !src.is_empty()
        {
            self.stream.upload(src, &mut st.buf, 0).map_err(core_err("cuMemcpyHtoD"))?;
        }
        Ok(ptr)
    }

    /// Wait for the queued work, then copy `range` of the staging buffer into `dst`.
    fn download(&mut self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        self.wait("copy")?;
        self.staging(range.end)?;
        if let Some(st) = &self.staging
            && !dst.is_empty()
        {
            self.stream.download(&st.buf, range, dst).map_err(core_err("cuMemcpyDtoH"))?;
        }
        Ok(())
    }
}

/// The address `n` f32 values past `ptr`, as NCCL takes buffers.
fn at(ptr: u64, n: usize) -> *mut std::ffi::c_void {
    (ptr + (n * size_of::<f32>()) as u64) as *mut std::ffi::c_void
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        // NCCL's destroy waits for the communicator's work, forever if a peer is dead: wait
        // here with the timeout, and abort when it does not finish.
        let finished = self.stream.record().is_ok_and(|ev| self.poll(&ev, Some(self.comm)).is_ok());
        if finished {
            let _ = self.stream.bind();
            let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
            // SAFETY: a live communicator with no work left, destroyed once.
            let _ = unsafe { (self.lib.comm_destroy)(comm) };
        } else {
            let _ = self.fail("drop", "work still running when the communicator was dropped".into());
        }
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()> {
        let n = buf.len();
        self.count(size_of_val(buf), 2);
        let p = self.upload(buf, n)?;
        // SAFETY: the staging buffer holds n values; in place is allowed.
        self.call("ncclAllReduce", |lib, c, s| unsafe {
            (lib.all_reduce)(at(p, 0), at(p, 0), n, FLOAT32, SUM, c, s)
        })?;
        self.download(0..n, buf)
    }

    fn all_reduce_half(&mut self, packed: &mut [f32], half: Half) -> Result<()> {
        // Two half values a slot (an odd bucket's pad is a zero, and sums to zero).
        let (slots, n) = (packed.len(), 2 * packed.len());
        self.count(slots * size_of::<f32>(), 2);
        let p = self.upload(packed, slots)?;
        // SAFETY: the staging buffer holds `slots` f32 slots, i.e. n half values; in place is
        // allowed.
        self.call("ncclAllReduce", |lib, c, s| unsafe {
            (lib.all_reduce)(at(p, 0), at(p, 0), n, half_type(half), SUM, c, s)
        })?;
        self.download(0..slots, packed)
    }

    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        let (n, w, r) = (buf.len(), self.world, self.rank);
        let mine = segment(n, w, r);
        self.count(size_of_val(buf), 1);
        // NCCL needs equal pieces: pad each segment to the longest, reduce, and unpad.
        let piece = segment(n, w, 0).len();
        let mut padded = vec![0.0f32; piece * w];
        for k in 0..w {
            let s = segment(n, w, k);
            padded[k * piece..k * piece + s.len()].copy_from_slice(&buf[s]);
        }
        let p = self.upload(&padded, piece * (w + 1))?;
        // SAFETY: the staging buffer holds piece * w values to send, then piece to receive.
        self.call("ncclReduceScatter", |lib, c, s| unsafe {
            (lib.reduce_scatter)(at(p, 0), at(p, piece * w), piece, FLOAT32, SUM, c, s)
        })?;
        let from = piece * w;
        self.download(from..from + mine.len(), &mut buf[mine.clone()])?;
        Ok(mine)
    }

    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        let (n, w, r) = (buf.len(), self.world, self.rank);
        self.count(size_of_val(buf), 1);
        let piece = segment(n, w, 0).len();
        let mine = segment(n, w, r);
        let mut padded = vec![0.0f32; piece];
        padded[..mine.len()].copy_from_slice(&buf[mine]);
        let p = self.upload(&padded, piece * (w + 1))?;
        // SAFETY: the staging buffer holds piece values to send, then piece * w to receive.
        self.call("ncclAllGather", |lib, c, s| unsafe {
            (lib.all_gather)(at(p, 0), at(p, piece), piece, FLOAT32, c, s)
        })?;
        let mut all = vec![0.0f32; piece * w];
        self.download(piece..piece * (w + 1), &mut all)?;
        for k in 0..w {
            let s = segment(n, w, k);
            buf[s.clone()].copy_from_slice(&all[k * piece..k * piece + s.len()]);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        check_rank("root", root, self.world)?;
        let n = buf.len();
        self.count(size_of_val(buf), 1);
        let p = self.upload(buf, n)?;
        let root = root as c_int;
        // SAFETY: the staging buffer holds n values; in place is allowed.
        self.call("ncclBroadcast", |lib, c, s| unsafe {
            (lib.broadcast)(at(p, 0), at(p, 0), n, FLOAT32, root, c, s)
        })?;
        self.download(0..n, buf)
    }

    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        check_rank("root", root, self.world)?;
        let n = buf.len();
        self.count(size_of_val(buf), 1);
        let back = if self.rank == root { 0..n } else { 0..0 };
        let p = self.upload(buf, n)?;
        let root = root as c_int;
        // SAFETY: the staging buffer holds n values; in place is allowed.
        self.call("ncclReduce", |lib, c, s| unsafe {
            (lib.reduce)(at(p, 0), at(p, 0), n, FLOAT32, SUM, root, c, s)
        })?;
        self.download(back.clone(), &mut buf[back])
    }

    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
        let (w, r, n) = (self.world, self.rank, send.len());
        check_rank("root", root, w)?;
        if r == root && out.len() != n * w {
            return Err(CollectiveError::Invalid {
                what: "gather output",
                why: format!("{} values, need {}", out.len(), n * w),
            });
        }
        let p = self.upload(send, n * (w + 1))?;
        let root_c = root as c_int;
        self.grouped("gather", |lib, c, s| {
            // SAFETY: the staging buffer holds this rank's n values, then n per rank.
            unsafe {
                if r == root {
                    for peer in (0..w).filter(|&peer| peer != r) {
                        let res = (lib.recv)(at(p, n + peer * n), n, FLOAT32, peer as c_int, c, s);
                        if res != SUCCESS && res != IN_PROGRESS {
                            return Err(res);
                        }
                    }
                    Ok(())
                } else {
                    match (lib.send)(at(p, 0), n, FLOAT32, root_c, c, s) {
                        SUCCESS | IN_PROGRESS => Ok(()),
                        res => Err(res),
                    }
                }
            }
        })?;
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
        let (w, r, n) = (self.world, self.rank, recv.len());
        check_rank("root", root, w)?;
        if r == root && src.len() != n * w {
            return Err(CollectiveError::Invalid {
                what: "scatter input",
                why: format!("{} values, need {}", src.len(), n * w),
            });
        }
        let p = if r == root { self.upload(src, n * (w + 1))? } else { self.staging(n * (w + 1))? };
        let root_c = root as c_int;
        self.grouped("scatter", |lib, c, s| {
            // SAFETY: the staging buffer holds n values per rank, then this rank's n.
            unsafe {
                if r == root {
                    for peer in (0..w).filter(|&peer| peer != r) {
                        let res = (lib.send)(at(p, peer * n), n, FLOAT32, peer as c_int, c, s);
                        if res != SUCCESS && res != IN_PROGRESS {
                            return Err(res);
                        }
                    }
                    Ok(())
                } else {
                    match (lib.recv)(at(p, n * w), n, FLOAT32, root_c, c, s) {
                        SUCCESS | IN_PROGRESS => Ok(()),
                        res => Err(res),
                    }
                }
            }
        })?;
        self.wait("scatter")?;
        if r == root {
            recv.copy_from_slice(&src[r * n..(r + 1) * n]);
        } else {
            self.download(n * w..n * (w + 1), recv)?;
        }
        Ok(())
    }

    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()> {
        check_rank("peer", peer, self.world)?;
        let n = buf.len();
        let p = self.upload(buf, n)?;
        let peer = peer as c_int;
        // SAFETY: the staging buffer holds n values.
        self.call("ncclSend", |lib, c, s| unsafe { (lib.send)(at(p, 0), n, FLOAT32, peer, c, s) })?;
        self.traffic.sent += n as u64 * 4;
        self.wait("send")
    }

    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()> {
        check_rank("peer", peer, self.world)?;
        let n = buf.len();
        let p = self.staging(n)?;
        let peer = peer as c_int;
        // SAFETY: the staging buffer holds n values.
        self.call("ncclRecv", |lib, c, s| unsafe { (lib.recv)(at(p, 0), n, FLOAT32, peer, c, s) })?;
        self.traffic.recv += n as u64 * 4;
        self.download(0..n, buf)
    }

    fn barrier(&mut self) -> Result<()> {
        let mut one = [1.0f32];
        self.all_reduce(&mut one)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A call failing inside a group must still end the group: an open group would hold back
    /// every later NCCL call of the thread (NCCL only posts a group's work at its end), so the
    /// next communicator's all-reduce would never run.
    #[test]
    fn a_failure_inside_a_group_still_ends_it() {
        const TEST: &str = "collective::nccl::tests::a_failure_inside_a_group_still_ends_it";
        if !matches!(gradsync_testkit::gpu_test(TEST), gradsync_testkit::GpuRun::Here) {
            return;
        }
        let timeout = Duration::from_secs(2);
        let mut first = Nccl::new(0, 0, 1, &unique_id().unwrap(), timeout).unwrap();
        // ncclInvalidArgument from the second call of a group.
        let err = first.grouped("test group", |_, _, _| Err(4)).unwrap_err().to_string();
        assert!(err.contains("invalid argument") && err.contains("aborted"), "{err}");
        drop(first);
        let mut second = Nccl::new(0, 0, 1, &unique_id().unwrap(), timeout).unwrap();
        let mut buf = [1.0, 2.0, 3.0];
        second.all_reduce(&mut buf).unwrap();
        assert_eq!(buf, [1.0, 2.0, 3.0]);
    }

    /// A data type NCCL does not have is refused as an invalid argument (and the fake NCCL,
    /// which implements float32, float16 and bfloat16, says which type and what it has), not
    /// reduced as some other type.
    #[test]
    fn an_unknown_data_type_is_refused() {
        const TEST: &str = "collective::nccl::tests::an_unknown_data_type_is_refused";
        if !matches!(gradsync_testkit::gpu_test(TEST), gradsync_testkit::GpuRun::Here) {
            return;
        }
        let mut c = Nccl::new(0, 0, 1, &unique_id().unwrap(), Duration::from_secs(2)).unwrap();
        let p = c.upload(&[1.0; 4], 4).unwrap();
        // SAFETY: the staging buffer holds 4 values; NCCL refuses the call before reading them.
        let err = c
            .call("ncclAllReduce", |lib, comm, s| unsafe {
                (lib.all_reduce)(at(p, 0), at(p, 0), 4, 99, SUM, comm, s)
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid argument"), "{err}");
        if std::env::var_os(gradsync_testkit::CHILD_ENV).is_some() {
            assert!(err.contains("data type 99") && err.contains("float32, float16 and bfloat16"), "{err}");
        }
    }
}
