//! The small trait every device implements: buffers, views into them, and the kernels the
//! layer graph needs. The layer sequencing that calls these is written once, in
//! [`crate::net`]; device differences stop here.
//!
//! Image activations are stored channel-major, `C x N x H x W` ("CNHW"): each channel's values
//! for the whole batch are contiguous, so a convolution is one GEMM over the batch
//! (`weight (Cout x C*k*k) * columns (C*k*k x N*OH*OW)` gives the next CNHW activation) and a
//! batch norm reduces contiguous rows. Flat activations are `N x F`, row-major.

use std::ops::Range;

use crate::error::Result;
use crate::optim::SgdConfig;

/// Rows per group in [`Backend::bias_grad`]'s summation order, which every device follows so
/// that they agree to the bit: the rows are summed in groups of this many consecutive rows,
/// each group from zero in row order; the groups' sums are summed again the same way while
/// more than one group is left; the last group's rows are added, in order, to zero (or to the
/// gradient already there when accumulating). Grouping is what lets a GPU give every
/// (group, column) its own thread, so the work in flight grows with the batch, and the CPU
/// spread the groups over its threads; the result does not depend on the thread count.
pub const BIAS_GRAD_ROWS: usize = 32;

/// How many rows are left after each grouping pass of [`BIAS_GRAD_ROWS`] over `rows` rows, in
/// order, ending at the pass that leaves one group (at most `BIAS_GRAD_ROWS` rows, summed into
/// the gradient itself). `rows <= BIAS_GRAD_ROWS` needs no pass.
pub fn bias_grad_passes(rows: usize) -> Vec<usize> {
    let mut passes = Vec::new();
    let mut left = rows;
    while left > BIAS_GRAD_ROWS {
        left = left.div_ceil(BIAS_GRAD_ROWS);
        passes.push(left);
    }
    passes
}

/// The geometry of a sliding window over CNHW activations: a convolution's kernel, or a
/// pooling window (whose `channels` are the planes it slides over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Input channels.
    pub channels: usize,
    /// Input height.
    pub height: usize,
    /// Input width.
    pub width: usize,
    /// The window's side (square windows only).
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// Zeros added on every side of the input.
    pub pad: usize,
}

impl Window {
    /// Output height.
    pub fn out_height(&self) -> usize {
        (self.height + 2 * self.pad - self.kernel) / self.stride + 1
    }

    /// Output width.
    pub fn out_width(&self) -> usize {
        (self.width + 2 * self.pad - self.kernel) / self.stride + 1
    }

    /// Output pixels per channel and sample.
    pub fn out_pixels(&self) -> usize {
        self.out_height() * self.out_width()
    }

    /// Rows of the column matrix: one per (channel, kernel row, kernel column).
    pub fn col_rows(&self) -> usize {
        self.channels * self.kernel * self.kernel
    }

    /// Whether the column matrix of this window is its input itself (a 1x1, stride-1,
    /// unpadded convolution), so no copy is needed.
    pub fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.pad == 0
    }
}

/// What [`Backend::channel_sums`] adds up for channel `c` over its `m` values `i`, with
/// `mean = center[c]`. Every sum follows one order, so it is the same on every device and for
/// every thread count: the `m` terms are dealt into `g = ceil(m / BIAS_GRAD_ROWS)` groups,
/// group `j` holding terms `j, j + g, j + 2g, ...` summed from zero in that order (so on a GPU
/// neighbouring threads read neighbouring values), the `g` sums dealt again the same way
/// while more than [`BIAS_GRAD_ROWS`] are left, and the last at most [`BIAS_GRAD_ROWS`] summed
/// in order.
#[derive(Debug, Clone, Copy)]
pub enum ChannelSum<V> {
    /// `a[c, i]`.
    Plain,
    /// `(a[c, i] - mean)^2`.
    SquaredDeviation {
        /// The per-channel mean.
        center: V,
    },
    /// `a[c, i] * (b[c, i] - mean)`.
    Dot {
        /// The second operand, shaped as `a`.
        b: V,
        /// The per-channel mean of `b`.
        center: V,
    },
}

/// Batch-norm constants shared by every device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormConfig {
    /// Added to the variance before its square root (PyTorch's `eps`, 1e-5).
    pub eps: f32,
    /// Weight of the new batch in the running statistics (PyTorch's `momentum`, 0.1).
    pub momentum: f32,
}

impl NormConfig {
    /// PyTorch's `BatchNorm2d` defaults.
    pub const DEFAULT: NormConfig = NormConfig { eps: 1e-5, momentum: 0.1 };
}

/// One device's buffers and kernels. All matrices are row-major `f32`.
///
/// Views are the unit of access. A `ViewMut<'a>` is an exclusive handle on a range of a buffer
/// for `'a`; [`Backend::split_at`] splits one into two disjoint handles that both live for
/// `'a`, which is what lets backward hand finished gradient buckets to a communication thread
/// while it keeps writing the rest.
pub trait Backend: Sized {
    /// An owned `f32` buffer on the device.
    type Buf;
    /// An owned buffer of `u32` on the device: class labels, and an embedding bag's ids and
    /// offsets.
    type Labels;
    /// A shared view of a range of a buffer.
    type View<'a>: Copy
    where
        Self: 'a;
    /// An exclusive view of a range of a buffer.
    type ViewMut<'a>
    where
        Self: 'a;

    /// A short description (`cpu (2 threads)`, `cuda:0 NVIDIA H100 ...`).
    fn describe(&self) -> String;
    /// A zero-filled buffer of `n` values.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    /// A buffer holding `src`'s values. The CPU keeps `src` itself, so a model's initial
    /// parameters cost their pages once, not again in a copy; a GPU uploads them.
    fn upload(&self, src: Vec<f32>) -> Result<Self::Buf> {
        let mut buf = self.zeros(src.len())?;
        self.write(&mut buf, 0, &src)?;
        Ok(buf)
    }
    /// Copy `src` into `dst[offset..offset + src.len()]`.
    fn write(&self, dst: &mut Self::Buf, offset: usize, src: &[f32]) -> Result<()>;
    /// Copy `src[range]` into `dst` (`dst.len() == range.len()`).
    fn read(&self, src: &Self::Buf, range: Range<usize>, dst: &mut [f32]) -> Result<()>;
    /// Replace the labels buffer's contents with `src` (growing it when needed).
    fn write_labels(&self, dst: &mut Option<Self::Labels>, src: &[u32]) -> Result<()>;

    /// A shared view of `buf[range]`.
    fn view(buf: &Self::Buf, range: Range<usize>) -> Self::View<'_>;
    /// An exclusive view of `buf[range]`.
    fn view_mut(buf: &mut Self::Buf, range: Range<usize>) -> Self::ViewMut<'_>;
    /// Split an exclusive view at `mid` into `[..mid]` and `[mid..]`, both for the full `'a`.
    fn split_at<'a>(view: Self::ViewMut<'a>, mid: usize) -> (Self::ViewMut<'a>, Self::ViewMut<'a>)
    where
        Self: 'a;
    /// A shorter-lived exclusive view of `view[range]`.
    fn sub<'b>(view: &'b mut Self::ViewMut<'_>, range: Range<usize>) -> Self::ViewMut<'b>;
    /// A shared view of an exclusive view's values, for as long as it is borrowed.
    fn as_view<'b>(view: &'b Self::ViewMut<'_>) -> Self::View<'b>;

    /// `c = op(a) * op(b)` (`+ c` when `accumulate`), `op(a)` being `m x k` and `op(b)`
    /// `k x n`; `ta`/`tb` say the stored matrix is the transpose.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Self::View<'_>,
        ta: bool,
        b: Self::View<'_>,
        tb: bool,
        c: Self::ViewMut<'_>,
        accumulate: bool,
    ) -> Result<()>;
    /// `z[i, j] += bias[j]` over `rows x cols`, then ReLU when `relu`.
    fn bias_act(
        &self,
        z: Self::ViewMut<'_>,
        bias: Self::View<'_>,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> Result<()>;
    /// `dz[i] = 0` where `a[i] <= 0` (a is the ReLU's output).
    fn relu_backward(&self, dz: Self::ViewMut<'_>, a: Self::View<'_>) -> Result<()>;
    /// `db[j] = sum_i dz[i, j]` (`+ db[j]` when `accumulate`), summed in the order
    /// [`BIAS_GRAD_ROWS`] describes.
    fn bias_grad(
        &self,
        db: Self::ViewMut<'_>,
        dz: Self::View<'_>,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// Softmax cross-entropy of `logits` (`rows x cols`) against `labels`. Returns the summed
    /// loss and the number of rows whose arg-max is the label; when `dlogits` is given, writes
    /// `scale * (softmax - onehot)` into it.
    #[allow(clippy::too_many_arguments)]
    fn softmax_xent(
        &self,
        logits: Self::View<'_>,
        labels: &Self::Labels,
        dlogits: Option<Self::ViewMut<'_>>,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<(f64, u64)>;
    /// One SGD-with-momentum step ([`crate::optim`]) with the gradient scaled by `grad_scale`.
    fn sgd(
        &self,
        cfg: &SgdConfig,
        params: Self::ViewMut<'_>,
        grads: Self::View<'_>,
        momentum: Self::ViewMut<'_>,
        grad_scale: f32,
    ) -> Result<()>;
    /// `v *= factor`.
    fn scale(&self, v: Self::ViewMut<'_>, factor: f32) -> Result<()>;

    /// An embedding bag's forward: row `s` of `y` (`batch x dim`) is `sum_j w[j] * table[ids[j]]`
    /// over `j` in `off[s]..off[s + 1]`, each table row `dim` values.
    #[allow(clippy::too_many_arguments)]
    fn bag_forward(
        &self,
        y: Self::ViewMut<'_>,
        table: Self::View<'_>,
        off: &Self::Labels,
        ids: &Self::Labels,
        w: Self::View<'_>,
        batch: usize,
        dim: usize,
    ) -> Result<()>;
    /// An embedding bag's backward into the table's gradient, by rows: for each `u` below
    /// `count`, row `rows[u]` of `grad` becomes (plus itself when `accumulate`)
    /// `sum_e w[e] * dy[samples[e]]` over `e` in `off[u]..off[u + 1]`, in that order. The rows
    /// are distinct, so each is written by one thread and the sums need no atomics.
    #[allow(clippy::too_many_arguments)]
    fn bag_backward(
        &self,
        grad: Self::ViewMut<'_>,
        dy: Self::View<'_>,
        rows: &Self::Labels,
        off: &Self::Labels,
        samples: &Self::Labels,
        w: Self::View<'_>,
        count: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// Zero the rows `rows[..count]` of `v` (`dim` values a row), or its first `count` rows
    /// when `rows` is `None`.
    fn zero_rows(
        &self,
        v: Self::ViewMut<'_>,
        rows: Option<&Self::Labels>,
        count: usize,
        dim: usize,
    ) -> Result<()>;
    /// [`Backend::sgd`] over the rows `rows[..count]` (the first `count` when `None`) whose gradient
    /// is not all zero; the other rows, their momentum too, stay as they are (lazy momentum).
    #[allow(clippy::too_many_arguments)]
    fn sgd_rows(
        &self,
        cfg: &SgdConfig,
        params: Self::ViewMut<'_>,
        grads: Self::View<'_>,
        momentum: Self::ViewMut<'_>,
        rows: Option<&Self::Labels>,
        count: usize,
        dim: usize,
        grad_scale: f32,
    ) -> Result<()>;

    /// `v = max(v, 0)` in place.
    fn relu(&self, v: Self::ViewMut<'_>) -> Result<()>;
    /// `y = x`, or `y += x` when `accumulate`.
    fn add_into(&self, y: Self::ViewMut<'_>, x: Self::View<'_>, accumulate: bool) -> Result<()>;
    /// Swap the two outer axes: `dst[j, i, k] (=|+=) src[i, j, k]` for `src` shaped
    /// `outer x middle x inner`. Turns a batch between NCHW and CNHW, and CNHW into the
    /// `N x (C*H*W)` rows of a flatten, in PyTorch's order.
    #[allow(clippy::too_many_arguments)]
    fn swap_axes(
        &self,
        dst: Self::ViewMut<'_>,
        src: Self::View<'_>,
        outer: usize,
        middle: usize,
        inner: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// The column matrix of a convolution: `col[(c*k + ky)*k + kx, (n*OH + oy)*OW + ox] =
    /// x[c, n, oy*stride - pad + ky, ox*stride - pad + kx]`, zero outside the image.
    fn im2col(&self, col: Self::ViewMut<'_>, x: Self::View<'_>, w: &Window, batch: usize) -> Result<()>;
    /// The adjoint of [`Backend::im2col`]: each input value gets the sum of the column entries
    /// it was copied to, in (ky, kx) order (`+=` what is there when `accumulate`).
    fn col2im(
        &self,
        dx: Self::ViewMut<'_>,
        col: Self::View<'_>,
        w: &Window,
        batch: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// Whether this device computes convolutions over `w` directly ([`Backend::conv`],
    /// [`Backend::conv_input_grad`], [`Backend::conv_weight_grad`]), reading the image where it
    /// lies; where it does not, the caller builds a column matrix ([`Backend::im2col`]) and
    /// multiplies it.
    fn direct_conv(&self, w: &Window) -> bool {
        let _ = w;
        false
    }
    /// `y (=|+=)` the convolution of CNHW `x` (`w.channels x batch x height x width`) with
    /// `weight` (`outs x w.channels x kernel x kernel`), for a window [`Backend::direct_conv`]
    /// accepts.
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &self,
        y: Self::ViewMut<'_>,
        x: Self::View<'_>,
        weight: Self::View<'_>,
        w: &Window,
        outs: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let _ = (y, x, weight, outs, batch, accumulate);
        Err(no_direct_conv(w))
    }
    /// `dx (=|+=)` the input gradient of [`Backend::conv`] given its output gradient `dy`.
    #[allow(clippy::too_many_arguments)]
    fn conv_input_grad(
        &self,
        dx: Self::ViewMut<'_>,
        dy: Self::View<'_>,
        weight: Self::View<'_>,
        w: &Window,
        outs: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let _ = (dx, dy, weight, outs, batch, accumulate);
        Err(no_direct_conv(w))
    }
    /// `dweight (=|+=)` the weight gradient of [`Backend::conv`] given its output gradient `dy`
    /// and its input `x`.
    #[allow(clippy::too_many_arguments)]
    fn conv_weight_grad(
        &self,
        dweight: Self::ViewMut<'_>,
        dy: Self::View<'_>,
        x: Self::View<'_>,
        w: &Window,
        outs: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let _ = (dweight, dy, x, outs, batch, accumulate);
        Err(no_direct_conv(w))
    }
    /// Max pooling over `w.channels` planes (channels times batch) of `height x width`: each
    /// output is its window's maximum (the first, scanning rows then columns, on ties).
    fn max_pool(&self, y: Self::ViewMut<'_>, x: Self::View<'_>, w: &Window) -> Result<()>;
    /// The gradient of [`Backend::max_pool`]: each window's output gradient goes to its
    /// maximum's position, windows added in order.
    fn max_pool_backward(
        &self,
        dx: Self::ViewMut<'_>,
        dy: Self::View<'_>,
        x: Self::View<'_>,
        w: &Window,
        accumulate: bool,
    ) -> Result<()>;
    /// Global average pooling of CNHW `x` (`channels x batch x pixels`) into `y`
    /// (`batch x channels`): each output the sum of its pixels in order, divided by `pixels`.
    fn avg_pool(
        &self,
        y: Self::ViewMut<'_>,
        x: Self::View<'_>,
        channels: usize,
        batch: usize,
        pixels: usize,
    ) -> Result<()>;
    /// The gradient of [`Backend::avg_pool`]: `dx[c, n, p] (=|+=) dy[n, c] / pixels`.
    #[allow(clippy::too_many_arguments)]
    fn avg_pool_backward(
        &self,
        dx: Self::ViewMut<'_>,
        dy: Self::View<'_>,
        channels: usize,
        batch: usize,
        pixels: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// `out[c] = sum over i < m of` the [`ChannelSum`] term of `a` (`channels x m`).
    fn channel_sums(
        &self,
        out: Self::ViewMut<'_>,
        a: Self::View<'_>,
        what: ChannelSum<Self::View<'_>>,
        channels: usize,
        m: usize,
    ) -> Result<()>;
    /// Batch-norm statistics of `count` values per channel, in place in `saved`
    /// (`mean | x`, `2 x channels`). Training: `saved` holds the batch mean and the sum of
    /// squared deviations; this leaves `mean | 1/sqrt(var + eps)` there (biased variance) and
    /// moves `running` (`mean | var`) towards the batch (unbiased variance), as PyTorch does.
    /// Evaluation: `saved` becomes `running mean | 1/sqrt(running var + eps)`.
    fn norm_stats(
        &self,
        saved: Self::ViewMut<'_>,
        running: Self::ViewMut<'_>,
        channels: usize,
        count: usize,
        train: bool,
        cfg: &NormConfig,
    ) -> Result<()>;
    /// `y[c, i] = (x[c, i] - mean[c]) * invstd[c] * gamma[c] + beta[c]`, with `saved` =
    /// `mean | invstd` and `affine` = `gamma | beta`.
    fn norm_apply(
        &self,
        y: Self::ViewMut<'_>,
        x: Self::View<'_>,
        saved: Self::View<'_>,
        affine: Self::View<'_>,
        channels: usize,
        m: usize,
    ) -> Result<()>;
    /// Batch-norm backward from `sums` = `sum dy | sum dy (x - mean)` over `count` values per
    /// channel ([`Backend::channel_sums`], all-reduced first for a synchronised batch norm):
    /// `d_affine`, when given, (=|+=) `sum dy (x - mean) * invstd | sum dy` when `accumulate`, and, when `dx`
    /// is given, `dx (=|+=) gamma invstd (dy - sum dy / count - (x - mean) invstd^2
    /// sum dy (x - mean) / count)` when `accumulate_dx`.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        dx: Option<Self::ViewMut<'_>>,
        d_affine: Option<Self::ViewMut<'_>>,
        dy: Self::View<'_>,
        x: Self::View<'_>,
        saved: Self::View<'_>,
        affine: Self::View<'_>,
        sums: Self::View<'_>,
        channels: usize,
        m: usize,
        count: usize,
        accumulate: bool,
        accumulate_dx: bool,
    ) -> Result<()>;
    /// Wait until all work queued on the device has finished (for honest timings).
    fn synchronize(&self) -> Result<()>;
}

/// The error of a direct convolution asked of a device or window without one.
pub(super) fn no_direct_conv(w: &Window) -> crate::error::Error {
    crate::error::Error::invalid(
        "convolution",
        format!(
            "no direct kernel for a {k}x{k} window of stride {} and padding {} here",
            w.stride,
            w.pad,
            k = w.kernel
        ),
    )
}
