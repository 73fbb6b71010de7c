//! The small trait every device implements: buffers, views into them, and the handful of
//! kernels an MLP needs. The layer sequencing that calls these is written once, in
//! [`crate::mlp`]; device differences stop here.

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

/// One device's buffers and kernels. All matrices are row-major `f32`.
///
/// Views are the unit of access. A `ViewMut<'a>` is an exclusive handle on a range of a buffer
/// for `'a`; [`Backend::split_at`] splits one into two disjoint handles that both live for
/// `'a`, which is what lets backward hand finished gradient buckets to a communication thread
/// while it keeps writing the rest.
pub trait Backend: Sized {
    /// An owned `f32` buffer on the device.
    type Buf;
    /// An owned buffer of class labels on the device.
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
    /// Wait until all work queued on the device has finished (for honest timings).
    fn synchronize(&self) -> Result<()>;
}
