//! The CUDA device through cudarc, with the driver, cuBLAS and NVRTC loaded at run time.
//!
//! # Design
//! - One [`Cuda`] per device ordinal owns the context, ONE compute stream (a non-blocking stream
//!   of its own, so a communication stream created beside it can overlap), a cuBLAS handle bound
//!   to that stream and the NVRTC-compiled kernels of `cuda_kernels.cu`.
//! - Buffers are [`GpuBuf`]s, allocated on the compute stream. Views ([`GpuView`],
//!   [`GpuViewMut`]) are a raw device pointer, a length and a borrow marker; everything the
//!   backend queues goes to the compute stream in program order, so the GPU sees kernels in the
//!   same order Rust's borrow checker saw the views.
//! - Matrices are row-major, as on the CPU; GEMMs go through cuBLAS in FP32 (no TF32), the rest
//!   through kernels that keep the CPU backend's arithmetic order, so both devices agree to
//!   rounding.
//!
//! # Views and safety
//! cudarc's own views only split by reborrowing, but [`Backend::split_at`] must turn one
//! exclusive view into two that live as long as the original (backward hands finished gradient
//! buckets to a communication thread while it keeps writing the rest). So the views here are
//! plain `(pointer, length)` pairs carrying a `PhantomData` borrow of the buffer:
//! - every view is created from a live buffer through a bounds-checked range and can only
//!   shrink, so it never reaches outside its allocation, and the buffer cannot be freed while
//!   the view's borrow lasts;
//! - a `GpuViewMut` is exclusive for its lifetime and `split_at` yields disjoint halves, exactly
//!   like `&mut [f32]`, so no two live views can be used to write the same values;
//! - each view records which stream owns its buffer and the backend refuses views of another
//!   backend's buffers, since its stream ordering would not cover them.
//!
//! Work queued through the backend runs on the compute stream in submission order. Code that
//! touches a view's memory from ANOTHER stream (NCCL, asynchronous copies) through
//! [`GpuViewMut::device_ptr`] must order itself against [`Cuda::stream`] ([`GpuStream::after`]),
//! and keep the buffer alive until that work has finished. [`HalfCast`] is the one piece of the
//! kernels such code may queue on its own stream: NCCL's fp16/bf16 all-reduce rounds and widens
//! gradient buckets with it on the communication stream.
//!
//! # What leaves this module
//! No cudarc type: other code holds a stream, buffers and events through core's own wrappers
//! (`stream.rs`: [`GpuStream`], [`GpuBuf`], [`GpuLabels`], [`GpuEvent`]) and device addresses
//! as `u64`, so the backend's cudarc stays an implementation detail of this module.
//!
//! # Length
//! Over 600 lines on purpose: the whole [`Backend`] for one device in one file, like
//! `cpu.rs`, so the two can be read side by side kernel by kernel; its unit tests close it.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

mod layers;
mod stream;

pub use stream::{GpuBuf, GpuEvent, GpuLabels, GpuStream, RawStream};

use super::backend::{BIAS_GRAD_ROWS, Backend, ChannelSum, NormConfig, Window, bias_grad_passes};
use super::nvrtc;
use crate::compress::Half;
use crate::error::{Error, Result};
use crate::optim::SgdConfig;

/// Threads per block for every kernel (all are 1-D with grid-stride loops).
const BLOCK: u32 = 256;
/// The most blocks one launch asks for; grid-stride loops cover the rest.
const MAX_BLOCKS: usize = 1 << 16;

/// Check that CUDA device `ordinal` can be used, without letting cudarc panic on a machine
/// that lacks the driver library. Returns the device's name.
pub fn probe(ordinal: usize) -> Result<String> {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::NoCuda("libcuda (the NVIDIA driver library) was not found".into()));
    }
    let attempt = std::panic::catch_unwind(|| -> Result<String> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| Error::NoCuda(format!("cannot open cuda:{ordinal}: {e}")))?;
        ctx.name().map_err(|e| Error::NoCuda(format!("cuda:{ordinal}: {e}")))
    });
    attempt.unwrap_or_else(|_| Err(Error::NoCuda("the CUDA driver failed to load".into())))
}

/// Turn any cudarc error into [`Error::Cuda`] naming the operation.
fn cuda_err<E: fmt::Display>(op: &'static str) -> impl FnOnce(E) -> Error {
    move |e| Error::Cuda { op, msg: e.to_string() }
}

/// A shared view of `len` consecutive `f32`s in device memory, borrowed from a buffer for `'a`.
#[derive(Debug, Clone, Copy)]
pub struct GpuView<'a> {
    ptr: CUdeviceptr,
    len: usize,
    /// The owning buffer's stream (as an address), to refuse views of another backend.
    owner: usize,
    _borrow: PhantomData<&'a [f32]>,
}

/// An exclusive view of `len` consecutive `f32`s in device memory, borrowed from a buffer for
/// `'a`. Like `&mut [f32]`, it can be split ([`Backend::split_at`]) into two disjoint views that
/// live as long as it does.
#[derive(Debug)]
pub struct GpuViewMut<'a> {
    ptr: CUdeviceptr,
    len: usize,
    owner: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

impl<'a> GpuView<'a> {
    /// Values in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first value's device address (valid for `'a`; see the module docs on ordering).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The sub-view `range` (panics when it reaches outside the view).
    pub fn slice(self, range: Range<usize>) -> GpuView<'a> {
        check_range("view", self.len, &range);
        GpuView { ptr: offset_ptr(self.ptr, range.start), len: range.len(), ..self }
    }
}

impl<'a> GpuViewMut<'a> {
    /// Values in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first value's device address, for collectives and copies that write in place (valid
    /// for `'a`; see the module docs on ordering).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A shared view of the same values, for as long as this one is borrowed.
    pub fn as_view(&self) -> GpuView<'_> {
        GpuView { ptr: self.ptr, len: self.len, owner: self.owner, _borrow: PhantomData }
    }

    /// A shorter-lived exclusive view of the same values.
    pub fn reborrow(&mut self) -> GpuViewMut<'_> {
        GpuViewMut { ptr: self.ptr, len: self.len, owner: self.owner, _borrow: PhantomData }
    }
}

/// Panic unless `range` lies inside `len` values: a wrong range on the device would be a silent
/// overrun, so it is stopped where the view is made.
fn check_range(what: &str, len: usize, range: &Range<usize>) {
    assert!(
        range.start <= range.end && range.end <= len,
        "cuda {what}: range {range:?} is outside the {len} values available"
    );
}

/// `ptr` advanced by `n` f32 values.
fn offset_ptr(ptr: CUdeviceptr, n: usize) -> CUdeviceptr {
    ptr + (n * size_of::<f32>()) as CUdeviceptr
}

/// Identifies a stream for the ownership check of views.
fn stream_id(stream: &CudaStream) -> usize {
    stream.cu_stream() as usize
}

/// The start address of a buffer. cudarc's accessor also records a read event on the buffer's
/// own stream (it is in multi-stream mode); that event only orders the buffer's own free, which
/// happens on that same stream after all the work queued there.
fn buf_ptr<T>(buf: &CudaSlice<T>) -> CUdeviceptr {
    let (ptr, _record) = buf.device_ptr(buf.stream());
    ptr
}

/// A row-major GEMM rewritten for column-major cuBLAS.
///
/// A row-major `r x c` matrix is, read column-major, its `c x r` transpose. So the row-major
/// `C = op(A) op(B)` (`m x n`) is the column-major `C^T = op(B)^T op(A)^T` (`n x m`): cuBLAS gets
/// B first and A second, with m and n swapped, each keeping its own transpose flag, and leading
/// dimensions equal to the stored row lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ColMajorGemm {
    /// Transpose the first operand (row-major B).
    trans_first: bool,
    /// Transpose the second operand (row-major A).
    trans_second: bool,
    m: usize,
    n: usize,
    k: usize,
    /// Leading dimension of the first operand (B's stored row length).
    ld_first: usize,
    /// Leading dimension of the second operand (A's stored row length).
    ld_second: usize,
    /// Leading dimension of C (its row length, n).
    ldc: usize,
}

impl ColMajorGemm {
    fn new(m: usize, n: usize, k: usize, ta: bool, tb: bool) -> Self {
        // Stored row lengths: B is k x n (n wide), or n x k (k wide) when tb; A is m x k (k
        // wide), or k x m (m wide) when ta. cuBLAS wants every leading dimension >= 1.
        ColMajorGemm {
            trans_first: tb,
            trans_second: ta,
            m: n,
            n: m,
            k,
            ld_first: if tb { k } else { n }.max(1),
            ld_second: if ta { m } else { k }.max(1),
            ldc: n.max(1),
        }
    }
}

/// Compile the kernels for `ctx`'s device and load them: its own cubin first, PTX as the
/// fallback ([`nvrtc::targets`]). The error names every attempt.
fn load_kernels(ctx: &Arc<CudaContext>) -> Result<Arc<CudaModule>> {
    let (major, minor) = ctx.compute_capability().map_err(cuda_err("compute capability"))?;
    let arch = u32::try_from(major * 10 + minor)
        .map_err(|_| Error::invalid("compute capability", format!("{major}.{minor}")))?;
    let supported = nvrtc::supported_archs()?;
    let mut attempts = Vec::new();
    for target in nvrtc::targets(arch, &supported) {
        let loaded = nvrtc::compile(target, &[])
            .and_then(|c| ctx.load_module(Ptx::from_binary(c.image)).map_err(cuda_err("load kernels")));
        match loaded {
            Ok(module) => return Ok(module),
            Err(e) => attempts.push(format!("{target}: {e}")),
        }
    }
    let (nv_major, nv_minor) = nvrtc::version()?;
    let mut driver = 0;
    // SAFETY: an out-pointer to a live integer; the driver library is loaded (a context exists).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(cuda_err("driver version"))?;
    Err(Error::Cuda {
        op: "load kernels",
        msg: format!(
            "no kernel image loads on sm_{arch} with NVRTC {nv_major}.{nv_minor} (knows {supported:?}) and a CUDA \
             {}.{} driver{}{}",
            driver / 1000,
            driver % 1000 / 10,
            if attempts.is_empty() { "" } else { ": " },
            attempts.join("; ")
        ),
    })
}

/// The NVRTC-compiled kernels of `cuda_kernels.cu`.
struct Kernels {
    bias_act: CudaFunction,
    relu_backward: CudaFunction,
    bias_grad: CudaFunction,
    softmax_xent: CudaFunction,
    sgd: CudaFunction,
    scale: CudaFunction,
    half: HalfCast,
}

/// Names of every kernel in `cuda_kernels.cu`, in [`Kernels`] order.
const KERNEL_NAMES: [&str; 8] =
    ["bias_act", "relu_backward", "bias_grad", "softmax_xent", "sgd", "scale", "round_to_half", "widen_half"];

/// Every kernel of `cuda_kernels.cu`: the MLP's, the half-precision casts and the layer
/// graph's.
#[cfg(test)]
fn all_kernel_names() -> impl Iterator<Item = &'static str> {
    KERNEL_NAMES.into_iter().chain(layers::NAMES)
}

/// The kernels that round `f32` values to a half-precision format and widen them back, for
/// NCCL's fp16/bf16 all-reduce of gradient buckets (`--compress fp16|bf16`). They round every
/// value to the bits [`Half::encode`] gives on the host (ties to even; NaNs stay NaN with their
/// sign and top payload bits, quiet). Unlike the [`Backend`] methods they may be queued on any
/// stream of the device's context, such as NCCL's, which is what lets a bucket be rounded,
/// reduced and widened on the communication stream while backward goes on; the caller then
/// orders that stream against the compute stream with events.
#[derive(Debug, Clone)]
pub struct HalfCast {
    round: CudaFunction,
    widen: CudaFunction,
}

impl HalfCast {
    /// Queue on `stream`: the `n` `f32` values at `src`, each multiplied by `scale` (in `f32`,
    /// as the host multiplies), rounded to `half`, as `n` 16-bit values at `dst`.
    ///
    /// # Safety
    /// `src` must hold `n` `f32` values and `dst` room for `n` `u16` values, in device memory of
    /// this device that stays allocated, and that no other work touches, until the queued work
    /// has run (work ordered after `stream`'s).
    pub unsafe fn round(
        &self,
        stream: &GpuStream,
        src: u64,
        dst: u64,
        n: usize,
        half: Half,
        scale: f32,
    ) -> Result<()> {
        // SAFETY: passed on to the caller.
        unsafe { Self::launch(&self.round, &stream.stream, dst, src, n, half, scale) }
            .map_err(cuda_err("round_to_half"))
    }

    /// Queue on `stream`: the `n` 16-bit `half` values at `src` widened (exactly) to `f32` and
    /// multiplied by `scale`, as `n` `f32` values at `dst`.
    ///
    /// # Safety
    /// As [`HalfCast::round`], `src` holding `n` `u16` values and `dst` room for `n` `f32`.
    pub unsafe fn widen(
        &self,
        stream: &GpuStream,
        src: u64,
        dst: u64,
        n: usize,
        half: Half,
        scale: f32,
    ) -> Result<()> {
        // SAFETY: passed on to the caller.
        unsafe { Self::launch(&self.widen, &stream.stream, dst, src, n, half, scale) }
            .map_err(cuda_err("widen_half"))
    }

    /// Launch `f(dst, src, n, bf16, scale)` over `n` values.
    ///
    /// # Safety
    /// As [`HalfCast::round`].
    unsafe fn launch(
        f: &CudaFunction,
        stream: &CudaStream,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        n: usize,
        half: Half,
        scale: f32,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        if n == 0 {
            return Ok(());
        }
        let (n64, bf16) = (n as u64, i32::from(half == Half::Bf16));
        let mut launch = stream.launch_builder(f);
        launch.arg(&dst).arg(&src).arg(&n64).arg(&bf16).arg(&scale);
        // SAFETY: round_to_half(unsigned short*, const float*, u64, int, float) and
        // widen_half(float*, const unsigned short*, u64, int, float); the caller vouches for
        // the buffers.
        unsafe { launch.launch(Cuda::grid(n)) }.map(|_| ())
    }
}

/// One CUDA device: its context, compute stream, cuBLAS handle and kernels.
pub struct Cuda {
    ordinal: usize,
    name: String,
    /// The context and the compute stream.
    compute: GpuStream,
    blas: CudaBlas,
    kernels: Kernels,
    layers: layers::LayerKernels,
    /// Per-row loss and hit flags of `softmax_xent`, grown on demand and reused every batch.
    stats: Mutex<Option<CudaSlice<f32>>>,
    /// The group sums of `bias_grad`'s passes, grown on demand and reused (work on the one
    /// stream is ordered, so one buffer serves every call).
    sums_scratch: Mutex<Option<CudaSlice<f32>>>,
}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cuda")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Cuda {
    /// Open CUDA device `ordinal`: context, compute stream, cuBLAS handle, and the kernels
    /// compiled by NVRTC. A machine without the driver or libraries gets [`Error::NoCuda`].
    pub fn new(ordinal: usize) -> Result<Self> {
        let name = probe(ordinal)?;
        // One consistent set of libraries, loaded by path before cudarc opens any by name.
        super::libs::load()?;
        // SAFETY: each call only tries to dlopen a library; no function of it is called.
        let (has_blas, has_nvrtc) =
            unsafe { (cudarc::cublas::sys::is_culib_present(), cudarc::nvrtc::sys::is_culib_present()) };
        if !has_blas {
            return Err(Error::NoCuda("libcublas was not found".into()));
        }
        if !has_nvrtc {
            return Err(Error::NoCuda("libnvrtc was not found".into()));
        }
        // cudarc's loader panics when a library lacks a symbol it expects (a version
        // mismatch); that is a missing capability of this machine, so it becomes an error.
        catch_unwind(AssertUnwindSafe(|| Self::open(ordinal, name))).unwrap_or_else(|_| {
            Err(Error::NoCuda(format!(
                "cuda:{ordinal}: the CUDA libraries failed to load (a version mismatch with the driver?)"
            )))
        })
    }

    fn open(ordinal: usize, name: String) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("open context"))?;
        let stream = ctx.new_stream().map_err(cuda_err("create stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_err("create cuBLAS handle"))?;
        // Plain FP32 GEMMs: TF32 would cost the 1e-4 agreement with the CPU backend.
        // SAFETY: the handle is live; setting its math mode has no other precondition.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), cublasMath_t::CUBLAS_DEFAULT_MATH) }
            .result()
            .map_err(cuda_err("cuBLAS math mode"))?;
        let module = load_kernels(&ctx)?;
        let load = |name: &str| module.load_function(name).map_err(cuda_err("load kernel"));
        let [bias_act, relu_backward, bias_grad, softmax_xent, sgd, scale, round, widen] = KERNEL_NAMES;
        let kernels = Kernels {
            bias_act: load(bias_act)?,
            relu_backward: load(relu_backward)?,
            bias_grad: load(bias_grad)?,
            softmax_xent: load(softmax_xent)?,
            sgd: load(sgd)?,
            scale: load(scale)?,
            half: HalfCast { round: load(round)?, widen: load(widen)? },
        };
        let layers = layers::LayerKernels::load(&module)?;
        Ok(Cuda {
            ordinal,
            name,
            compute: GpuStream { ctx, stream },
            blas,
            kernels,
            layers,
            stats: Mutex::new(None),
            sums_scratch: Mutex::new(None),
        })
    }

    /// The device's index.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> String {
        self.name.clone()
    }

    /// The GPU's peak FP32 (non-tensor-core) throughput in FLOP/s: SMs x FP32 lanes per SM x 2
    /// (a fused multiply-add) x the maximum SM clock. Lanes per SM follow NVIDIA's tables for
    /// each compute capability; an unknown one is an error rather than a guess.
    pub fn peak_fp32_flops(&self) -> Result<f64> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let err = |e: cudarc::driver::DriverError| Error::Cuda { op: "device attribute", msg: e.to_string() };
        let sms = self.compute.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(err)?;
        let khz = self.compute.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).map_err(err)?;
        let (major, minor) = self.compute.ctx.compute_capability().map_err(err)?;
        let lanes = match (major, minor) {
            (7, _) => 64,
            (8, 0) => 64,
            (8, _) | (9, _) | (10, _) | (12, _) => 128,
            _ => {
                return Err(Error::Cuda {
                    op: "peak FP32",
                    msg: format!("FP32 lanes per SM unknown for compute capability {major}.{minor}"),
                });
            }
        };
        Ok(f64::from(sms) * f64::from(lanes) * 2.0 * f64::from(khz) * 1e3)
    }

    /// The compute stream: every kernel, GEMM and copy of this backend is queued here, in
    /// order. Other streams must wait for it ([`GpuStream::after`]) before touching its
    /// buffers.
    pub fn stream(&self) -> &GpuStream {
        &self.compute
    }

    /// The half-precision conversion kernels, for work on other streams of this device.
    pub fn half_cast(&self) -> &HalfCast {
        &self.kernels.half
    }

    /// The device address and length of `buf[range]` (panics when `range` is outside `buf`),
    /// for collectives and asynchronous copies that work on device memory directly.
    pub fn raw_range(buf: &GpuBuf, range: Range<usize>) -> (u64, usize) {
        let v = Self::view(buf, range);
        (v.ptr, v.len)
    }

    /// Refuse a view whose buffer belongs to another backend's stream.
    fn own(&self, op: &'static str, owner: usize) -> Result<()> {
        if owner == stream_id(&self.compute.stream) {
            Ok(())
        } else {
            Err(Error::Cuda {
                op,
                msg: format!("a view of a buffer from another device or backend (not cuda:{})", self.ordinal),
            })
        }
    }

    /// Require a view of at least `need` values.
    fn need(what: &'static str, len: usize, need: usize) -> Result<()> {
        if len >= need { Ok(()) } else { Err(Error::Length { what, expected: need, got: len }) }
    }

    /// A 1-D launch covering `n` items (grid-stride loops do the rest beyond the cap).
    fn grid(n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// Queue one launch of `bias_grad`: the column sums of each group of [`BIAS_GRAD_ROWS`] rows
    /// of the `rows x cols` matrix at `src`, into `dst` (one row per group).
    fn bias_grad_pass(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<()> {
        let groups = rows.div_ceil(BIAS_GRAD_ROWS).max(1);
        let (rows64, cols64, group, acc) =
            (rows as u64, cols as u64, BIAS_GRAD_ROWS as u64, i32::from(accumulate));
        let mut launch = self.compute.stream.launch_builder(&self.kernels.bias_grad);
        launch.arg(&dst).arg(&src).arg(&rows64).arg(&cols64).arg(&group).arg(&acc);
        // SAFETY: bias_grad(float*, const float*, u64, u64, u64, int); the caller passes a
        // source of rows x cols values and a destination of groups x cols, both device memory of
        // this backend's stream, which orders this launch after their writers.
        unsafe { launch.launch(Self::grid(groups * cols)) }.map_err(cuda_err("bias_grad"))?;
        Ok(())
    }

    /// Surface an error cudarc recorded where it could not return one (its drop guards).
    fn check(&self, op: &'static str) -> Result<()> {
        self.compute.ctx.check_err().map_err(cuda_err(op))
    }
}

impl Backend for Cuda {
    type Buf = GpuBuf;
    type Labels = GpuLabels;
    type View<'a> = GpuView<'a>;
    type ViewMut<'a> = GpuViewMut<'a>;

    fn describe(&self) -> String {
        format!("cuda:{} {}", self.ordinal, self.name)
    }

    fn zeros(&self, n: usize) -> Result<GpuBuf> {
        // cudarc cannot allocate nothing; one value keeps empty buffers valid.
        self.compute.zeros(n)
    }

    fn write(&self, dst: &mut GpuBuf, offset: usize, src: &[f32]) -> Result<()> {
        self.compute.upload(src, dst, offset)?;
        self.check("copy to device")
    }

    fn read(&self, src: &GpuBuf, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        self.compute.download(src, range, dst)?;
        self.check("copy to host")
    }

    fn write_labels(&self, dst: &mut Option<GpuLabels>, src: &[u32]) -> Result<()> {
        let GpuLabels(labels) = match dst {
            Some(l) if l.0.len() >= src.len() => l,
            _ => dst.insert(GpuLabels(
                self.compute.stream.alloc_zeros::<u32>(src.len().max(1)).map_err(cuda_err("alloc"))?,
            )),
        };
        if src.is_empty() {
            return Ok(());
        }
        self.compute
            .stream
            .memcpy_htod(src, &mut labels.slice_mut(0..src.len()))
            .map_err(cuda_err("copy labels to device"))?;
        self.check("copy labels to device")
    }

    fn view(GpuBuf(buf): &GpuBuf, range: Range<usize>) -> GpuView<'_> {
        check_range("view", buf.len(), &range);
        GpuView {
            ptr: offset_ptr(buf_ptr(buf), range.start),
            len: range.len(),
            owner: stream_id(buf.stream()),
            _borrow: PhantomData,
        }
    }

    fn view_mut(GpuBuf(buf): &mut GpuBuf, range: Range<usize>) -> GpuViewMut<'_> {
        check_range("view_mut", buf.len(), &range);
        GpuViewMut {
            ptr: offset_ptr(buf_ptr(buf), range.start),
            len: range.len(),
            owner: stream_id(buf.stream()),
            _borrow: PhantomData,
        }
    }

    fn split_at<'a>(view: GpuViewMut<'a>, mid: usize) -> (GpuViewMut<'a>, GpuViewMut<'a>)
    where
        Self: 'a,
    {
        check_range("split_at", view.len, &(0..mid));
        // The halves are disjoint and together cover exactly `view`, which is consumed: the
        // same argument that makes `<[f32]>::split_at_mut` sound.
        let lower = GpuViewMut { ptr: view.ptr, len: mid, owner: view.owner, _borrow: PhantomData };
        let upper = GpuViewMut {
            ptr: offset_ptr(view.ptr, mid),
            len: view.len - mid,
            owner: view.owner,
            _borrow: PhantomData,
        };
        (lower, upper)
    }

    fn sub<'b>(view: &'b mut GpuViewMut<'_>, range: Range<usize>) -> GpuViewMut<'b> {
        check_range("sub", view.len, &range);
        GpuViewMut {
            ptr: offset_ptr(view.ptr, range.start),
            len: range.len(),
            owner: view.owner,
            _borrow: PhantomData,
        }
    }

    fn as_view<'b>(view: &'b GpuViewMut<'_>) -> GpuView<'b> {
        view.as_view()
    }

    fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: GpuView<'_>,
        ta: bool,
        b: GpuView<'_>,
        tb: bool,
        c: GpuViewMut<'_>,
        accumulate: bool,
    ) -> Result<()> {
        for owner in [a.owner, b.owner, c.owner] {
            self.own("gemm", owner)?;
        }
        Self::need("gemm A", a.len, m * k)?;
        Self::need("gemm B", b.len, k * n)?;
        Self::need("gemm C", c.len, m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let g = ColMajorGemm::new(m, n, k, ta, tb);
        let int = |v: usize| {
            i32::try_from(v)
                .map_err(|_| Error::invalid("gemm size", format!("{v} exceeds cuBLAS's 32-bit sizes")))
        };
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        self.compute.ctx.bind_to_thread().map_err(cuda_err("gemm"))?;
        // SAFETY: the handle is bound to the compute stream; the views were checked above to
        // hold op(A) (m x k), op(B) (k x n) and C (m x n) with the leading dimensions of
        // ColMajorGemm, and belong to this backend; alpha and beta are host values that
        // cuBLAS reads before returning. With beta = 0 cuBLAS does not read C.
        unsafe {
            blas::sgemm(
                *self.blas.handle(),
                op(g.trans_first),
                op(g.trans_second),
                int(g.m)?,
                int(g.n)?,
                int(g.k)?,
                &alpha,
                b.ptr as *const f32,
                int(g.ld_first)?,
                a.ptr as *const f32,
                int(g.ld_second)?,
                &beta,
                c.ptr as *mut f32,
                int(g.ldc)?,
            )
        }
        .map_err(cuda_err("gemm"))
    }

    fn bias_act(
        &self,
        z: GpuViewMut<'_>,
        bias: GpuView<'_>,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> Result<()> {
        self.own("bias_act", z.owner)?;
        self.own("bias_act", bias.owner)?;
        Self::need("bias_act z", z.len, rows * cols)?;
        Self::need("bias_act bias", bias.len, cols)?;
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        let (rows, cols, relu) = (rows as u64, cols as u64, i32::from(relu));
        let mut launch = self.compute.stream.launch_builder(&self.kernels.bias_act);
        launch.arg(&z.ptr).arg(&bias.ptr).arg(&rows).arg(&cols).arg(&relu);
        // SAFETY: the argument list matches bias_act(float*, const float*, u64, u64, int); the
        // views hold rows x cols and cols values and belong to this stream.
        unsafe { launch.launch(Self::grid(n)) }.map_err(cuda_err("bias_act"))?;
        Ok(())
    }

    fn relu_backward(&self, dz: GpuViewMut<'_>, a: GpuView<'_>) -> Result<()> {
        self.own("relu_backward", dz.owner)?;
        self.own("relu_backward", a.owner)?;
        Self::need("relu_backward activations", a.len, dz.len)?;
        if dz.len == 0 {
            return Ok(());
        }
        let n = dz.len as u64;
        let mut launch = self.compute.stream.launch_builder(&self.kernels.relu_backward);
        launch.arg(&dz.ptr).arg(&a.ptr).arg(&n);
        // SAFETY: relu_backward(float*, const float*, u64); both views hold n values.
        unsafe { launch.launch(Self::grid(dz.len)) }.map_err(cuda_err("relu_backward"))?;
        Ok(())
    }

    fn bias_grad(
        &self,
        db: GpuViewMut<'_>,
        dz: GpuView<'_>,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.own("bias_grad", db.owner)?;
        self.own("bias_grad", dz.owner)?;
        Self::need("bias_grad db", db.len, cols)?;
        Self::need("bias_grad dz", dz.len, rows * cols)?;
        if cols == 0 {
            return Ok(());
        }
        // The summation order of BIAS_GRAD_ROWS (backend.rs): each pass sums groups of rows
        // into the scratch buffer, one thread per (group, column); the last launch sums the one
        // group left into db. Two halves of the scratch take turns as source and destination.
        let passes = bias_grad_passes(rows);
        let (first, second) = (passes.first().copied().unwrap_or(0), passes.get(1).copied().unwrap_or(0));
        let mut scratch = self.sums_scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let need = (first + second) * cols;
        let scratch = match &mut *scratch {
            Some(s) if s.len() >= need => s,
            slot => {
                slot.insert(self.compute.stream.alloc_zeros::<f32>(need.max(1)).map_err(cuda_err("alloc"))?)
            }
        };
        let halves = [buf_ptr(scratch), offset_ptr(buf_ptr(scratch), first * cols)];
        let (mut src, mut src_rows) = (dz.ptr, rows);
        for (i, &groups) in passes.iter().enumerate() {
            let dst = halves[i % 2];
            self.bias_grad_pass(dst, src, src_rows, cols, false)?;
            (src, src_rows) = (dst, groups);
        }
        self.bias_grad_pass(db.ptr, src, src_rows, cols, accumulate)
    }

    fn softmax_xent(
        &self,
        logits: GpuView<'_>,
        GpuLabels(labels): &GpuLabels,
        dlogits: Option<GpuViewMut<'_>>,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<(f64, u64)> {
        self.own("softmax_xent", logits.owner)?;
        self.own("softmax_xent", stream_id(labels.stream()))?;
        Self::need("softmax_xent logits", logits.len, rows * cols)?;
        Self::need("softmax_xent labels", labels.len(), rows)?;
        let dptr = match &dlogits {
            Some(d) => {
                self.own("softmax_xent", d.owner)?;
                Self::need("softmax_xent dlogits", d.len, rows * cols)?;
                d.ptr
            }
            // The kernel skips the gradient for a null pointer.
            None => 0,
        };
        if rows == 0 {
            return Ok((0.0, 0));
        }
        if cols == 0 {
            return Err(Error::invalid("softmax_xent", "no classes"));
        }
        // The scratch buffer holds no state between calls, so a panic elsewhere while it was
        // locked leaves nothing to repair.
        let mut stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        let stats = match &mut *stats {
            Some(s) if s.len() >= 2 * rows => s,
            slot => slot.insert(self.compute.stream.alloc_zeros::<f32>(2 * rows).map_err(cuda_err("alloc"))?),
        };
        let (lptr, sptr) = (buf_ptr(labels), buf_ptr(stats));
        let (rows64, cols64) = (rows as u64, cols as u64);
        let mut launch = self.compute.stream.launch_builder(&self.kernels.softmax_xent);
        launch.arg(&logits.ptr).arg(&lptr).arg(&dptr).arg(&sptr).arg(&rows64).arg(&cols64).arg(&scale);
        // SAFETY: softmax_xent(const float*, const unsigned*, float*, float*, u64, u64, float);
        // logits and dlogits hold rows x cols values, labels rows, stats 2 x rows.
        unsafe { launch.launch(Self::grid(rows)) }.map_err(cuda_err("softmax_xent"))?;
        let mut host = vec![0.0f32; 2 * rows];
        self.compute
            .stream
            .memcpy_dtoh(&stats.slice(0..2 * rows), &mut host)
            .map_err(cuda_err("copy loss to host"))?;
        self.check("copy loss to host")?;
        // Summed in row order in f64, as the CPU backend does.
        let (loss, hits) = host.split_at(rows);
        let loss = loss.iter().map(|&l| f64::from(l)).sum();
        let correct = hits.iter().filter(|&&h| h != 0.0).count() as u64;
        Ok((loss, correct))
    }

    fn sgd(
        &self,
        cfg: &SgdConfig,
        params: GpuViewMut<'_>,
        grads: GpuView<'_>,
        momentum: GpuViewMut<'_>,
        grad_scale: f32,
    ) -> Result<()> {
        for owner in [params.owner, grads.owner, momentum.owner] {
            self.own("sgd", owner)?;
        }
        if grads.len != params.len || momentum.len != params.len {
            return Err(Error::Length {
                what: "sgd gradients/momentum",
                expected: params.len,
                got: if grads.len != params.len { grads.len } else { momentum.len },
            });
        }
        if params.len == 0 {
            return Ok(());
        }
        let n = params.len as u64;
        let SgdConfig { lr, momentum: mu, weight_decay: wd } = *cfg;
        let mut launch = self.compute.stream.launch_builder(&self.kernels.sgd);
        launch
            .arg(&params.ptr)
            .arg(&grads.ptr)
            .arg(&momentum.ptr)
            .arg(&n)
            .arg(&lr)
            .arg(&mu)
            .arg(&wd)
            .arg(&grad_scale);
        // SAFETY: sgd(float*, const float*, float*, u64, float, float, float, float); the three
        // views hold n values each; params and momentum are exclusive so distinct from grads.
        unsafe { launch.launch(Self::grid(params.len)) }.map_err(cuda_err("sgd"))?;
        Ok(())
    }

    fn scale(&self, v: GpuViewMut<'_>, factor: f32) -> Result<()> {
        self.own("scale", v.owner)?;
        if v.len == 0 {
            return Ok(());
        }
        let n = v.len as u64;
        let mut launch = self.compute.stream.launch_builder(&self.kernels.scale);
        launch.arg(&v.ptr).arg(&n).arg(&factor);
        // SAFETY: scale(float*, u64, float); the view holds n values.
        unsafe { launch.launch(Self::grid(v.len)) }.map_err(cuda_err("scale"))?;
        Ok(())
    }

    fn relu(&self, v: GpuViewMut<'_>) -> Result<()> {
        self.layer_relu(v)
    }

    fn add_into(&self, y: GpuViewMut<'_>, x: GpuView<'_>, accumulate: bool) -> Result<()> {
        self.layer_add_into(y, x, accumulate)
    }

    fn swap_axes(
        &self,
        dst: GpuViewMut<'_>,
        src: GpuView<'_>,
        outer: usize,
        middle: usize,
        inner: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.layer_swap_axes(dst, src, (outer, middle, inner), accumulate)
    }

    fn im2col(&self, col: GpuViewMut<'_>, x: GpuView<'_>, w: &Window, batch: usize) -> Result<()> {
        self.layer_im2col(col, x, w, batch)
    }

    fn col2im(
        &self,
        dx: GpuViewMut<'_>,
        col: GpuView<'_>,
        w: &Window,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.layer_col2im(dx, col, w, batch, accumulate)
    }

    fn max_pool(&self, y: GpuViewMut<'_>, x: GpuView<'_>, w: &Window) -> Result<()> {
        self.layer_max_pool(y, x, w)
    }

    fn max_pool_backward(
        &self,
        dx: GpuViewMut<'_>,
        dy: GpuView<'_>,
        x: GpuView<'_>,
        w: &Window,
        accumulate: bool,
    ) -> Result<()> {
        self.layer_max_pool_backward(dx, dy, x, w, accumulate)
    }

    fn bag_forward(
        &self,
        y: GpuViewMut<'_>,
        table: GpuView<'_>,
        off: &GpuLabels,
        ids: &GpuLabels,
        w: GpuView<'_>,
        batch: usize,
        dim: usize,
    ) -> Result<()> {
        let entries = w.len;
        self.layer_bag_forward(y, table, (&off.0, &ids.0), w, (batch, dim, entries))
    }

    fn bag_backward(
        &self,
        grad: GpuViewMut<'_>,
        dy: GpuView<'_>,
        rows: &GpuLabels,
        off: &GpuLabels,
        samples: &GpuLabels,
        w: GpuView<'_>,
        count: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        let entries = w.len;
        self.layer_bag_backward(grad, dy, (&rows.0, &off.0, &samples.0), w, (count, dim, entries), accumulate)
    }

    fn zero_rows(&self, v: GpuViewMut<'_>, rows: Option<&GpuLabels>, count: usize, dim: usize) -> Result<()> {
        self.layer_zero_rows(v, rows.map(|r| &r.0), count, dim)
    }

    fn sgd_rows(
        &self,
        cfg: &SgdConfig,
        params: GpuViewMut<'_>,
        grads: GpuView<'_>,
        momentum: GpuViewMut<'_>,
        rows: Option<&GpuLabels>,
        count: usize,
        dim: usize,
        grad_scale: f32,
    ) -> Result<()> {
        self.layer_sgd_rows(cfg, params, grads, momentum, rows.map(|r| &r.0), (count, dim), grad_scale)
    }

    fn avg_pool(
        &self,
        y: GpuViewMut<'_>,
        x: GpuView<'_>,
        channels: usize,
        batch: usize,
        pixels: usize,
    ) -> Result<()> {
        self.layer_avg_pool(y, x, (channels, batch, pixels))
    }

    fn avg_pool_backward(
        &self,
        dx: GpuViewMut<'_>,
        dy: GpuView<'_>,
        channels: usize,
        batch: usize,
        pixels: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.layer_avg_pool_backward(dx, dy, (channels, batch, pixels), accumulate)
    }

    fn channel_sums(
        &self,
        out: GpuViewMut<'_>,
        a: GpuView<'_>,
        what: ChannelSum<GpuView<'_>>,
        channels: usize,
        m: usize,
    ) -> Result<()> {
        self.layer_channel_sums(out, a, what, channels, m)
    }

    fn norm_stats(
        &self,
        saved: GpuViewMut<'_>,
        running: GpuViewMut<'_>,
        channels: usize,
        count: usize,
        train: bool,
        cfg: &NormConfig,
    ) -> Result<()> {
        self.layer_norm_stats(saved, running, (channels, count, train), cfg)
    }

    fn norm_apply(
        &self,
        y: GpuViewMut<'_>,
        x: GpuView<'_>,
        saved: GpuView<'_>,
        affine: GpuView<'_>,
        channels: usize,
        m: usize,
    ) -> Result<()> {
        self.layer_norm_apply(y, x, saved, affine, (channels, m))
    }

    fn norm_backward(
        &self,
        dx: Option<GpuViewMut<'_>>,
        d_affine: Option<GpuViewMut<'_>>,
        dy: GpuView<'_>,
        x: GpuView<'_>,
        saved: GpuView<'_>,
        affine: GpuView<'_>,
        sums: GpuView<'_>,
        channels: usize,
        m: usize,
        count: usize,
        accumulate: bool,
        accumulate_dx: bool,
    ) -> Result<()> {
        self.layer_norm_backward(
            dx,
            d_affine,
            (dy, x, saved, affine, sums),
            (channels, m, count),
            (accumulate, accumulate_dx),
        )
    }

    fn synchronize(&self) -> Result<()> {
        self.compute.stream.synchronize().map_err(cuda_err("synchronize"))?;
        self.check("synchronize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column-major `C = op(X) op(Y)` with BLAS's conventions, the reference for what cuBLAS
    /// computes from [`ColMajorGemm`]'s arguments.
    fn blas_sgemm(g: &ColMajorGemm, first: &[f32], second: &[f32], c: &mut [f32]) {
        let at =
            |x: &[f32], t: bool, ld: usize, i: usize, p: usize| if t { x[p + i * ld] } else { x[i + p * ld] };
        for j in 0..g.n {
            for i in 0..g.m {
                let mut s = 0.0;
                for p in 0..g.k {
                    s += at(first, g.trans_first, g.ld_first, i, p)
                        * at(second, g.trans_second, g.ld_second, p, j);
                }
                c[i + j * g.ldc] = s;
            }
        }
    }

    /// Row-major `op(A) op(B)` computed directly.
    fn row_major(m: usize, n: usize, k: usize, a: &[f32], ta: bool, b: &[f32], tb: bool) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        let av = if ta { a[p * m + i] } else { a[i * k + p] };
                        let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                        av * bv
                    })
                    .sum();
            }
        }
        c
    }

    #[test]
    fn col_major_rewrite_computes_the_row_major_product() {
        let (m, n, k) = (3, 5, 4);
        // Small integers keep every product exact, so the comparison is exact.
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let g = ColMajorGemm::new(m, n, k, ta, tb);
            let mut c = vec![0.0; m * n];
            blas_sgemm(&g, &b, &a, &mut c);
            assert_eq!(c, row_major(m, n, k, &a, ta, &b, tb), "ta={ta} tb={tb}");
        }
    }

    #[test]
    fn every_kernel_is_in_the_source() {
        for name in all_kernel_names() {
            assert!(
                nvrtc::KERNELS_SRC.contains(&format!("extern \"C\" __global__ void {name}(")),
                "kernel {name} missing from cuda_kernels.cu"
            );
        }
    }

    /// Every kernel compiles with NVRTC to a cubin and to PTX for sm_80, sm_90 and the newest
    /// architecture NVRTC knows, and ptxas reports no register spill for any of them. Runs
    /// where NVRTC is (a child process with NVIDIA's wheels on its library path, here); fails
    /// rather than skips under CI.
    #[test]
    fn kernels_compile_for_every_target_without_spills() -> Result<()> {
        const TEST: &str = "device::cuda::tests::kernels_compile_for_every_target_without_spills";
        if !matches!(gradsync_testkit::gpu_test(TEST), gradsync_testkit::GpuRun::Here) {
            return Ok(());
        }
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(
                !gradsync_testkit::in_ci(),
                "CI must compile the kernels, but libnvrtc is not on the library path"
            );
            eprintln!("SKIPPED (no libnvrtc on the library path) [{TEST}]");
            return Ok(());
        }
        let ptxas = std::env::var_os("GRADSYNC_PTXAS").map(std::path::PathBuf::from);
        let supported = nvrtc::supported_archs()?;
        let newest = supported.iter().copied().max().expect("NVRTC supports some architecture");
        let mut archs = vec![80, 90, newest];
        archs.dedup();
        let scratch = gradsync_testkit::Scratch::new("ptx");
        for arch in archs {
            let cubin = nvrtc::compile(nvrtc::KernelTarget::Cubin(arch), &[])?;
            assert_eq!(&cubin.image[..4], b"\x7fELF", "sm_{arch}: NVRTC's cubin is not an ELF image");
            let ptx = nvrtc::compile(nvrtc::KernelTarget::Ptx(arch), &[])?;
            let text = String::from_utf8_lossy(&ptx.image);
            for name in all_kernel_names() {
                assert!(
                    text.contains(&format!(".entry {name}(")),
                    "compute_{arch}: no entry point {name} in the PTX"
                );
                let bytes = name.as_bytes();
                assert!(
                    cubin.image.windows(bytes.len()).any(|w| w == bytes),
                    "sm_{arch}: no symbol {name} in the cubin"
                );
            }
            let Some(ptxas) = &ptxas else {
                assert!(
                    !gradsync_testkit::in_ci(),
                    "CI must check register spills, but GRADSYNC_PTXAS is not set"
                );
                eprintln!("sm_{arch}: compiled; spills not checked (GRADSYNC_PTXAS is not set)");
                continue;
            };
            let file = scratch.join(format!("kernels-{arch}.ptx"));
            std::fs::write(&file, text.trim_end_matches('\0')).expect("write the PTX");
            let out = std::process::Command::new(ptxas)
                .args(["-v", &format!("-arch=sm_{arch}"), "-o", "/dev/null"])
                .arg(&file)
                .output()
                .expect("run ptxas");
            let report =
                String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "ptxas failed for sm_{arch}: {report}");
            let (functions, spills) = ptxas_spills(&report);
            assert_eq!(
                functions,
                all_kernel_names().count(),
                "sm_{arch}: ptxas reported on {functions} kernels:\n{report}"
            );
            assert_eq!(spills, 0, "sm_{arch}: ptxas reports register spills:\n{report}");
            eprintln!(
                "sm_{arch}: {} kernels compiled to cubin and PTX, ptxas: 0 bytes spilled",
                all_kernel_names().count()
            );
        }
        Ok(())
    }

    /// From `ptxas -v`'s report: how many functions it reported on, and the spilled bytes
    /// (stores plus loads) over all of them.
    fn ptxas_spills(report: &str) -> (usize, u64) {
        let mut functions = 0;
        let mut spilled = 0;
        for line in report.lines().filter(|l| l.contains("bytes spill stores")) {
            functions += 1;
            let numbers: Vec<u64> = line
                .split(|c: char| !c.is_ascii_digit())
                .filter(|w| !w.is_empty())
                .filter_map(|w| w.parse().ok())
                .collect();
            // "N bytes stack frame, S bytes spill stores, L bytes spill loads"
            spilled += numbers.iter().rev().take(2).sum::<u64>();
        }
        (functions, spilled)
    }

    #[test]
    fn ptxas_reports_are_read() {
        let report = "ptxas info    : Compiling entry function 'sgd' for 'sm_90'\n\
                      ptxas info    : Function properties for sgd\n\
                      \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                      ptxas info    : Function properties for scale\n\
                      \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n";
        assert_eq!(ptxas_spills(report), (2, 16));
    }

    #[test]
    fn probe_reports_instead_of_panicking() {
        // Whatever this machine has, probe returns; without a usable GPU the reason is NoCuda.
        match probe(0) {
            Ok(name) => assert!(!name.is_empty()),
            Err(e) => assert!(matches!(e, Error::NoCuda(_)), "{e}"),
        }
        // No machine has a millionth GPU.
        assert!(matches!(probe(1_000_000), Err(Error::NoCuda(_))));
    }

    #[test]
    fn view_ranges_are_checked() {
        check_range("view", 10, &(2..10));
        let outside = std::panic::catch_unwind(|| check_range("view", 10, &(2..11)));
        assert!(outside.is_err(), "a range past the buffer must be refused");
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = std::panic::catch_unwind(|| check_range("view", 10, &(5..4)));
        assert!(reversed.is_err(), "a reversed range must be refused");
    }
}
