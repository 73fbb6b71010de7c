//! The layer graph's kernels on the CUDA device: the [`Backend`] methods for convolution
//! columns, pooling, batch norm and layout changes, each one launch (or a few passes) of a
//! kernel in `cuda_kernels.cu` on the compute stream. Every launch asks for one thread per
//! output value, so its grid grows with the batch and the layer.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, PushKernelArg};

use super::{BIAS_GRAD_ROWS, Cuda, GpuView, GpuViewMut, buf_ptr, cuda_err, offset_ptr};
use crate::device::backend::{ChannelSum, NormConfig, Window, bias_grad_passes};
use crate::error::Result;

/// Names of the layer kernels, in [`LayerKernels`] order.
#[cfg(test)]
pub(super) const NAMES: [&str; 17] = [
    "relu",
    "add_into",
    "swap_axes",
    "im2col",
    "col2im",
    "max_pool",
    "max_pool_backward",
    "avg_pool",
    "avg_pool_backward",
    "channel_sums",
    "norm_stats",
    "norm_apply",
    "norm_backward",
    "bag_forward",
    "bag_backward",
    "zero_rows",
    "sgd_rows",
];

/// The NVRTC-compiled layer kernels.
pub(super) struct LayerKernels {
    relu: CudaFunction,
    add_into: CudaFunction,
    swap_axes: CudaFunction,
    im2col: CudaFunction,
    col2im: CudaFunction,
    max_pool: CudaFunction,
    max_pool_backward: CudaFunction,
    avg_pool: CudaFunction,
    avg_pool_backward: CudaFunction,
    channel_sums: CudaFunction,
    norm_stats: CudaFunction,
    norm_apply: CudaFunction,
    norm_backward: CudaFunction,
    bag_forward: CudaFunction,
    bag_backward: CudaFunction,
    zero_rows: CudaFunction,
    sgd_rows: CudaFunction,
}

impl LayerKernels {
    pub(super) fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let load = |name: &str| module.load_function(name).map_err(cuda_err("load kernel"));
        Ok(LayerKernels {
            relu: load("relu")?,
            add_into: load("add_into")?,
            swap_axes: load("swap_axes")?,
            im2col: load("im2col")?,
            col2im: load("col2im")?,
            max_pool: load("max_pool")?,
            max_pool_backward: load("max_pool_backward")?,
            avg_pool: load("avg_pool")?,
            avg_pool_backward: load("avg_pool_backward")?,
            channel_sums: load("channel_sums")?,
            norm_stats: load("norm_stats")?,
            norm_apply: load("norm_apply")?,
            norm_backward: load("norm_backward")?,
            bag_forward: load("bag_forward")?,
            bag_backward: load("bag_backward")?,
            zero_rows: load("zero_rows")?,
            sgd_rows: load("sgd_rows")?,
        })
    }
}

/// Queue `$kernel` on `$cuda`'s compute stream over `$n` threads with the arguments, each a
/// local binding (the launch borrows them until it is queued).
macro_rules! launch {
    ($cuda:expr, $kernel:ident, $n:expr; $($arg:ident),* $(,)?) => {{
        let mut l = $cuda.compute.stream.launch_builder(&$cuda.layers.$kernel);
        $( l.arg(&$arg); )*
        // SAFETY: the arguments are, in order and type, the kernel's parameters in
        // cuda_kernels.cu (the fake CUDA's launcher unpacks them by that signature under test);
        // every pointer is device memory of this backend's stream that the caller checked to
        // hold what the kernel reads and writes, and the stream orders the launch after its
        // writers.
        unsafe { l.launch(Cuda::grid($n)) }.map(|_| ()).map_err(cuda_err(stringify!($kernel)))
    }};
}

/// A window's sizes as the kernels take them.
fn window_args(w: &Window) -> [u64; 8] {
    [w.channels, w.height, w.width, w.kernel, w.stride, w.pad, w.out_height(), w.out_width()]
        .map(|v| v as u64)
}

/// The magic number with which the kernels' `quot` divides by `d`: the multiplier in the low 32
/// bits (0 when `d` is 1, or too large to need one), the shift in the high 32. With
/// `l = ceil(log2 d)` and `p = 31 + l`, the multiplier `ceil(2^p / d)` is below 2^32 and
/// `(n * mul) >> p` is `n / d` exactly for every `n < 2^31`: the multiplier exceeds `2^p / d` by
/// less than `2^l / d`, so the error stays below `n * 2^l / (d * 2^p) < 1 / d`. Those are the
/// only dividends the kernels take this path for (`fits_32`).
fn div_magic(d: usize) -> u64 {
    let d = d as u64;
    if d <= 1 || d >= 1 << 31 {
        return 0;
    }
    let l = u64::from(64 - (d - 1).leading_zeros());
    let p = 31 + l;
    let mul = (1u128 << p).div_ceil(u128::from(d));
    (mul as u64) | ((p - 32) << 32)
}

fn ptr_or_null(v: Option<GpuView<'_>>) -> CUdeviceptr {
    v.map_or(0, |v| v.ptr)
}

impl Cuda {
    /// Refuse views of another backend, and views shorter than the kernel needs.
    fn check_views(&self, op: &'static str, views: &[(usize, usize, usize)]) -> Result<()> {
        for &(owner, len, need) in views {
            self.own(op, owner)?;
            Self::need(op, len, need)?;
        }
        Ok(())
    }

    pub(super) fn layer_relu(&self, v: GpuViewMut<'_>) -> Result<()> {
        self.own("relu", v.owner)?;
        let (p, n) = (v.ptr, v.len as u64);
        if n == 0 {
            return Ok(());
        }
        launch!(self, relu, v.len; p, n)
    }

    pub(super) fn layer_add_into(&self, y: GpuViewMut<'_>, x: GpuView<'_>, accumulate: bool) -> Result<()> {
        self.check_views("add_into", &[(y.owner, y.len, 0), (x.owner, x.len, y.len)])?;
        let (yp, xp, n, acc) = (y.ptr, x.ptr, y.len as u64, i32::from(accumulate));
        if n == 0 {
            return Ok(());
        }
        launch!(self, add_into, y.len; yp, xp, n, acc)
    }

    pub(super) fn layer_swap_axes(
        &self,
        dst: GpuViewMut<'_>,
        src: GpuView<'_>,
        (outer, middle, inner): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let n = outer * middle * inner;
        self.check_views("swap_axes", &[(dst.owner, dst.len, n), (src.owner, src.len, n)])?;
        if n == 0 {
            return Ok(());
        }
        let (d, s, o, m, i, acc) =
            (dst.ptr, src.ptr, outer as u64, middle as u64, inner as u64, i32::from(accumulate));
        launch!(self, swap_axes, n; d, s, o, m, i, acc)
    }

    pub(super) fn layer_im2col(
        &self,
        col: GpuViewMut<'_>,
        x: GpuView<'_>,
        w: &Window,
        batch: usize,
    ) -> Result<()> {
        let cols = w.col_rows() * batch * w.out_pixels();
        let input = w.channels * batch * w.height * w.width;
        self.check_views("im2col", &[(col.owner, col.len, cols), (x.owner, x.len, input)])?;
        if cols == 0 {
            return Ok(());
        }
        let [c, h, wd, k, s, p, oh, ow] = window_args(w);
        let (cp, xp, b) = (col.ptr, x.ptr, batch as u64);
        let plane = w.out_pixels();
        let [m0, m1, m2, m3, m4] =
            [batch * plane, w.kernel * w.kernel, w.kernel, plane, w.out_width()].map(div_magic);
        launch!(self, im2col, cols; cp, xp, c, b, h, wd, k, s, p, oh, ow, m0, m1, m2, m3, m4)
    }

    pub(super) fn layer_col2im(
        &self,
        dx: GpuViewMut<'_>,
        col: GpuView<'_>,
        w: &Window,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let cols = w.col_rows() * batch * w.out_pixels();
        let input = w.channels * batch * w.height * w.width;
        self.check_views("col2im", &[(col.owner, col.len, cols), (dx.owner, dx.len, input)])?;
        if input == 0 {
            return Ok(());
        }
        let [c, h, wd, k, s, p, oh, ow] = window_args(w);
        let (dp, cp, b, acc) = (dx.ptr, col.ptr, batch as u64, i32::from(accumulate));
        let [m0, m1, m2, m3] = [w.height * w.width, w.width, batch, w.stride].map(div_magic);
        launch!(self, col2im, input; dp, cp, c, b, h, wd, k, s, p, oh, ow, acc, m0, m1, m2, m3)
    }

    pub(super) fn layer_max_pool(&self, y: GpuViewMut<'_>, x: GpuView<'_>, w: &Window) -> Result<()> {
        let (input, output) = (w.channels * w.height * w.width, w.channels * w.out_pixels());
        self.check_views("max_pool", &[(y.owner, y.len, output), (x.owner, x.len, input)])?;
        if output == 0 {
            return Ok(());
        }
        let [planes, h, wd, k, s, p, oh, ow] = window_args(w);
        let (yp, xp) = (y.ptr, x.ptr);
        launch!(self, max_pool, output; yp, xp, planes, h, wd, k, s, p, oh, ow)
    }

    pub(super) fn layer_max_pool_backward(
        &self,
        dx: GpuViewMut<'_>,
        dy: GpuView<'_>,
        x: GpuView<'_>,
        w: &Window,
        accumulate: bool,
    ) -> Result<()> {
        let (input, output) = (w.channels * w.height * w.width, w.channels * w.out_pixels());
        self.check_views(
            "max_pool_backward",
            &[(dx.owner, dx.len, input), (dy.owner, dy.len, output), (x.owner, x.len, input)],
        )?;
        if input == 0 {
            return Ok(());
        }
        let [planes, h, wd, k, s, p, oh, ow] = window_args(w);
        let (dxp, dyp, xp, acc) = (dx.ptr, dy.ptr, x.ptr, i32::from(accumulate));
        launch!(self, max_pool_backward, input; dxp, dyp, xp, planes, h, wd, k, s, p, oh, ow, acc)
    }

    pub(super) fn layer_avg_pool(
        &self,
        y: GpuViewMut<'_>,
        x: GpuView<'_>,
        (channels, batch, pixels): (usize, usize, usize),
    ) -> Result<()> {
        let (input, output) = (channels * batch * pixels, channels * batch);
        self.check_views("avg_pool", &[(y.owner, y.len, output), (x.owner, x.len, input)])?;
        if output == 0 {
            return Ok(());
        }
        let (yp, xp, c, b, p) = (y.ptr, x.ptr, channels as u64, batch as u64, pixels as u64);
        launch!(self, avg_pool, output; yp, xp, c, b, p)
    }

    pub(super) fn layer_avg_pool_backward(
        &self,
        dx: GpuViewMut<'_>,
        dy: GpuView<'_>,
        (channels, batch, pixels): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let (input, output) = (channels * batch * pixels, channels * batch);
        self.check_views("avg_pool_backward", &[(dx.owner, dx.len, input), (dy.owner, dy.len, output)])?;
        if input == 0 {
            return Ok(());
        }
        let (dxp, dyp, c, b, p, acc) =
            (dx.ptr, dy.ptr, channels as u64, batch as u64, pixels as u64, i32::from(accumulate));
        launch!(self, avg_pool_backward, input; dxp, dyp, c, b, p, acc)
    }

    /// One pass of `channel_sums` over `rows x m` values at `src` into `rows x groups` at `dst`.
    fn channel_sums_pass(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        (b, center, mode): (CUdeviceptr, CUdeviceptr, i32),
        rows: usize,
        m: usize,
    ) -> Result<()> {
        let groups = m.div_ceil(BIAS_GRAD_ROWS).max(1);
        let (r, m64, group) = (rows as u64, m as u64, BIAS_GRAD_ROWS as u64);
        launch!(self, channel_sums, rows * groups; dst, src, b, center, r, m64, group, mode)
    }

    pub(super) fn layer_channel_sums(
        &self,
        out: GpuViewMut<'_>,
        a: GpuView<'_>,
        what: ChannelSum<GpuView<'_>>,
        channels: usize,
        m: usize,
    ) -> Result<()> {
        self.check_views("channel_sums", &[(out.owner, out.len, channels), (a.owner, a.len, channels * m)])?;
        let (b, center, mode) = match what {
            ChannelSum::Plain => (None, None, 0),
            ChannelSum::SquaredDeviation { center } => (None, Some(center), 1),
            ChannelSum::Dot { b, center } => (Some(b), Some(center), 2),
        };
        if let Some(c) = center {
            self.check_views("channel_sums mean", &[(c.owner, c.len, channels)])?;
        }
        if let Some(b) = b {
            self.check_views("channel_sums second operand", &[(b.owner, b.len, channels * m)])?;
        }
        if channels == 0 {
            return Ok(());
        }
        let first = (ptr_or_null(b), ptr_or_null(center), mode);
        // The order of BIAS_GRAD_ROWS: the first pass sums the terms in groups, later passes
        // sum the groups' sums, the last one into `out`; two halves of the scratch take turns.
        let passes = bias_grad_passes(m);
        let Some(&groups) = passes.first() else {
            return self.channel_sums_pass(out.ptr, a.ptr, first, channels, m);
        };
        let second = passes.get(1).copied().unwrap_or(0);
        let mut scratch = self.sums_scratch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let need = (groups + second) * channels;
        let scratch = match &mut *scratch {
            Some(s) if s.len() >= need => s,
            slot => {
                slot.insert(self.compute.stream.alloc_zeros::<f32>(need.max(1)).map_err(cuda_err("alloc"))?)
            }
        };
        let halves = [buf_ptr(scratch), offset_ptr(buf_ptr(scratch), groups * channels)];
        self.channel_sums_pass(halves[0], a.ptr, first, channels, m)?;
        let mut src = (halves[0], groups);
        for (i, &next) in passes.iter().enumerate().skip(1) {
            let dst = halves[i % 2];
            self.channel_sums_pass(dst, src.0, (0, 0, 0), channels, src.1)?;
            src = (dst, next);
        }
        self.channel_sums_pass(out.ptr, src.0, (0, 0, 0), channels, src.1)
    }

    pub(super) fn layer_norm_stats(
        &self,
        saved: GpuViewMut<'_>,
        running: GpuViewMut<'_>,
        (channels, count, train): (usize, usize, bool),
        cfg: &NormConfig,
    ) -> Result<()> {
        self.check_views(
            "norm_stats",
            &[(saved.owner, saved.len, 2 * channels), (running.owner, running.len, 2 * channels)],
        )?;
        if train && count < 2 {
            return Err(crate::Error::invalid(
                "batch norm",
                format!("{count} value(s) per channel: training statistics need at least 2"),
            ));
        }
        if channels == 0 {
            return Ok(());
        }
        let (s, r, c, n, t, eps, mom) =
            (saved.ptr, running.ptr, channels as u64, count as u64, i32::from(train), cfg.eps, cfg.momentum);
        launch!(self, norm_stats, channels; s, r, c, n, t, eps, mom)
    }

    pub(super) fn layer_norm_apply(
        &self,
        y: GpuViewMut<'_>,
        x: GpuView<'_>,
        saved: GpuView<'_>,
        affine: GpuView<'_>,
        (channels, m): (usize, usize),
    ) -> Result<()> {
        let n = channels * m;
        self.check_views(
            "norm_apply",
            &[
                (y.owner, y.len, n),
                (x.owner, x.len, n),
                (saved.owner, saved.len, 2 * channels),
                (affine.owner, affine.len, 2 * channels),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let (yp, xp, sp, ap, c, m64) = (y.ptr, x.ptr, saved.ptr, affine.ptr, channels as u64, m as u64);
        launch!(self, norm_apply, n; yp, xp, sp, ap, c, m64)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm_backward(
        &self,
        dx: Option<GpuViewMut<'_>>,
        d_affine: Option<GpuViewMut<'_>>,
        (dy, x, saved, affine, sums): (GpuView<'_>, GpuView<'_>, GpuView<'_>, GpuView<'_>, GpuView<'_>),
        (channels, m, count): (usize, usize, usize),
        (accumulate, accumulate_dx): (bool, bool),
    ) -> Result<()> {
        let n = channels * m;
        self.check_views(
            "norm_backward",
            &[
                (dy.owner, dy.len, n),
                (x.owner, x.len, n),
                (saved.owner, saved.len, 2 * channels),
                (affine.owner, affine.len, 2 * channels),
                (sums.owner, sums.len, 2 * channels),
            ],
        )?;
        if let Some(d) = &dx {
            self.check_views("norm_backward input gradient", &[(d.owner, d.len, n)])?;
        }
        if let Some(d) = &d_affine {
            self.check_views("norm_backward affine gradient", &[(d.owner, d.len, 2 * channels)])?;
        }
        if channels == 0 {
            return Ok(());
        }
        let threads = if dx.is_some() { n.max(channels) } else { channels };
        let dxp = dx.map_or(0, |d| d.ptr);
        let dap = d_affine.map_or(0, |d| d.ptr);
        let (dyp, xp, sp, ap, smp) = (dy.ptr, x.ptr, saved.ptr, affine.ptr, sums.ptr);
        let (c, m64, cnt, acc, acc_dx) =
            (channels as u64, m as u64, count as u64, i32::from(accumulate), i32::from(accumulate_dx));
        launch!(self, norm_backward, threads; dxp, dap, dyp, xp, sp, ap, smp, c, m64, cnt, acc, acc_dx)
    }

    /// An embedding bag's forward; `off` and `ids` are `u32` device arrays of at least
    /// `batch + 1` and `entries` values.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_bag_forward(
        &self,
        y: GpuViewMut<'_>,
        table: GpuView<'_>,
        (off, ids): (&CudaSlice<u32>, &CudaSlice<u32>),
        w: GpuView<'_>,
        (batch, dim, entries): (usize, usize, usize),
    ) -> Result<()> {
        self.check_views(
            "bag_forward",
            &[(y.owner, y.len, batch * dim), (table.owner, table.len, dim), (w.owner, w.len, entries)],
        )?;
        Self::need("bag offsets", off.len(), batch + 1)?;
        Self::need("bag ids", ids.len(), entries)?;
        if batch * dim == 0 {
            return Ok(());
        }
        let (yp, tp, op, ip, wp) = (y.ptr, table.ptr, buf_ptr(off), buf_ptr(ids), w.ptr);
        let (b, d) = (batch as u64, dim as u64);
        launch!(self, bag_forward, batch * dim; yp, tp, op, ip, wp, b, d)
    }

    /// An embedding bag's backward into `count` distinct rows of `grad`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_bag_backward(
        &self,
        grad: GpuViewMut<'_>,
        dy: GpuView<'_>,
        (rows, off, samples): (&CudaSlice<u32>, &CudaSlice<u32>, &CudaSlice<u32>),
        w: GpuView<'_>,
        (count, dim, entries): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        self.check_views(
            "bag_backward",
            &[(grad.owner, grad.len, dim), (dy.owner, dy.len, 0), (w.owner, w.len, entries)],
        )?;
        Self::need("bag rows", rows.len(), count)?;
        Self::need("bag row offsets", off.len(), count + 1)?;
        Self::need("bag samples", samples.len(), entries)?;
        if count * dim == 0 {
            return Ok(());
        }
        let (gp, dp, rp, op, sp, wp) =
            (grad.ptr, dy.ptr, buf_ptr(rows), buf_ptr(off), buf_ptr(samples), w.ptr);
        let (c, d, acc) = (count as u64, dim as u64, i32::from(accumulate));
        launch!(self, bag_backward, count * dim; gp, dp, rp, op, sp, wp, c, d, acc)
    }

    /// Zero `count` rows of `v` (`rows`, or the first `count` when `None`).
    pub(super) fn layer_zero_rows(
        &self,
        v: GpuViewMut<'_>,
        rows: Option<&CudaSlice<u32>>,
        count: usize,
        dim: usize,
    ) -> Result<()> {
        self.own("zero_rows", v.owner)?;
        match rows {
            Some(r) => Self::need("zero_rows rows", r.len(), count)?,
            None => Self::need("zero_rows", v.len, count * dim)?,
        }
        if count * dim == 0 {
            return Ok(());
        }
        let (vp, rp, c, d) = (v.ptr, rows.map_or(0, buf_ptr), count as u64, dim as u64);
        launch!(self, zero_rows, count * dim; vp, rp, c, d)
    }

    /// The lazy SGD step over `count` rows (`rows`, or the first `count` when `None`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_sgd_rows(
        &self,
        cfg: &crate::optim::SgdConfig,
        params: GpuViewMut<'_>,
        grads: GpuView<'_>,
        momentum: GpuViewMut<'_>,
        rows: Option<&CudaSlice<u32>>,
        (count, dim): (usize, usize),
        grad_scale: f32,
    ) -> Result<()> {
        let n = params.len;
        self.check_views(
            "sgd_rows",
            &[(params.owner, n, 0), (grads.owner, grads.len, n), (momentum.owner, momentum.len, n)],
        )?;
        match rows {
            Some(r) => Self::need("sgd_rows rows", r.len(), count)?,
            None => Self::need("sgd_rows", n, count * dim)?,
        }
        if count * dim == 0 {
            return Ok(());
        }
        let (pp, gp, mp, rp) = (params.ptr, grads.ptr, momentum.ptr, rows.map_or(0, buf_ptr));
        let (c, d, s) = (count as u64, dim as u64, grad_scale);
        let crate::optim::SgdConfig { lr, momentum: mu, weight_decay: wd } = *cfg;
        launch!(self, sgd_rows, count * dim; pp, gp, mp, rp, c, d, lr, mu, wd, s)
    }
}

#[cfg(test)]
mod tests {
    use super::div_magic;

    /// What a kernel's `quot` computes on its 32-bit path.
    fn quot(n: u32, magic: u64) -> u32 {
        let mul = magic as u32;
        if mul == 0 {
            return n;
        }
        ((u64::from(n) * u64::from(mul)) >> 32) as u32 >> (magic >> 32)
    }

    /// Every divisor a layer can have up to 2^16 and a spread of large ones, against dividends
    /// at both ends of the range, around multiples of the divisor and at random.
    #[test]
    fn the_magic_divides_every_dividend_below_2_pow_31_exactly() {
        let top = (1u32 << 31) - 1;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u32 & top
        };
        let mut divisors: Vec<u32> = (1..=1u32 << 16).collect();
        divisors.extend((0..2000).map(|_| next().max(1)));
        divisors.push(top);
        for d in divisors {
            let magic = div_magic(d as usize);
            let edge = top - top % d;
            let mut ns = vec![0, 1, d - 1, d, d + 1, top, top - 1, edge, edge.saturating_sub(1)];
            ns.extend((0..24).map(|_| next()));
            let q = next() / d;
            ns.extend([q * d, (q * d).saturating_sub(1), q * d + d - 1]);
            for n in ns.into_iter().filter(|&n| n <= top) {
                assert_eq!(quot(n, magic), n / d, "{n} / {d} with magic {magic:#x}");
            }
        }
    }
}
