//! The CPU's layer kernels (convolution columns, pooling, batch norm, layout changes), as loops
//! over independent output chunks that the pool's threads share. Each output value is computed
//! by one thread in a fixed order, so results never depend on the thread count; the orders are
//! those of the CUDA kernels (`cuda_kernels.cu`), named beside each.

use rayon::ThreadPool;
use rayon::prelude::*;

use super::backend::{BIAS_GRAD_ROWS, ChannelSum, NormConfig, Window};
use crate::error::{Error, Result};

/// Values per parallel chunk in elementwise kernels (here and in `cpu.rs`).
pub(super) const CHUNK: usize = 1 << 14;

/// Run `body(i, chunk)` over `data` cut into chunks of `size` values (the last may be
/// shorter), on the pool's threads when there is a pool.
pub(super) fn for_each_chunk(
    pool: Option<&ThreadPool>,
    data: &mut [f32],
    size: usize,
    body: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    let size = size.max(1);
    match pool {
        None => data.chunks_mut(size).enumerate().for_each(|(i, c)| body(i, c)),
        Some(p) => p.install(|| data.par_chunks_mut(size).enumerate().for_each(|(i, c)| body(i, c))),
    }
}

/// Refuse a view shorter than `need`.
pub(super) fn need(what: &'static str, len: usize, need: usize) -> Result<()> {
    if len >= need { Ok(()) } else { Err(Error::Length { what, expected: need, got: len }) }
}

/// Refuse a 3x3 convolution's views shorter than the shapes say (`ys`: the `outs` side, `xs`:
/// the `w.channels` side, each named as the caller says, and the weights).
#[allow(clippy::too_many_arguments)]
pub(super) fn need_conv(
    ys: &[f32],
    xs: &[f32],
    weights: &[f32],
    w: &Window,
    outs: usize,
    batch: usize,
    y_what: &'static str,
    x_what: &'static str,
) -> Result<()> {
    let pixels = batch * w.height * w.width;
    need(y_what, ys.len(), outs * pixels)?;
    need(x_what, xs.len(), w.channels * pixels)?;
    need("convolution weights", weights.len(), outs * w.col_rows())
}

/// A raw pointer the pool's threads share; each writes its own disjoint values through it
/// (each user says why in its SAFETY comments).
#[derive(Clone, Copy)]
pub(super) struct Shared(pub(super) *mut f32);
// SAFETY: every user writes a disjoint set of values through it.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer plus `i` (a method, so that closures capture the whole `Shared`, which is
    /// `Sync`).
    pub(super) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `v` or `v + old`, as the kernels' `accumulate` flags say.
#[inline]
fn put(slot: &mut f32, v: f32, accumulate: bool) {
    *slot = if accumulate { *slot + v } else { v };
}

/// Sum `term(i)` for `i < m` in [`ChannelSum`]'s order: dealt into `g = ceil(m /
/// BIAS_GRAD_ROWS)` groups of strided terms (`j, j + g, ...`), each summed from zero, the
/// groups' sums dealt again while more than [`BIAS_GRAD_ROWS`] are left, the last summed in
/// order. (CUDA: the passes of `channel_sums`.)
pub(super) fn grouped_sum(m: usize, term: impl Fn(usize) -> f32) -> f32 {
    // One deal of `len` values into ceil(len / BIAS_GRAD_ROWS) sums: value k*g + j goes to sum
    // j, in k order, so each sum adds its values in the order of the GPU's thread j.
    fn deal(len: usize, value: impl Fn(usize) -> f32) -> Vec<f32> {
        let g = len.div_ceil(BIAS_GRAD_ROWS);
        let mut sums = vec![0.0f32; g];
        for base in (0..len).step_by(g) {
            for (j, s) in sums.iter_mut().enumerate().take(len - base) {
                *s += value(base + j);
            }
        }
        sums
    }
    if m <= BIAS_GRAD_ROWS {
        return (0..m).fold(0.0f32, |a, i| a + term(i));
    }
    let mut level = deal(m, term);
    while level.len() > BIAS_GRAD_ROWS {
        level = deal(level.len(), |i| level[i]);
    }
    level.iter().fold(0.0f32, |a, &v| a + v)
}

pub(super) fn relu(pool: Option<&ThreadPool>, v: &mut [f32]) {
    for_each_chunk(pool, v, CHUNK, |_, c| c.iter_mut().for_each(|x| *x = x.max(0.0)));
}

pub(super) fn add_into(pool: Option<&ThreadPool>, y: &mut [f32], x: &[f32], accumulate: bool) -> Result<()> {
    need("add_into x", x.len(), y.len())?;
    let size = CHUNK;
    for_each_chunk(pool, y, size, |i, c| {
        for (o, &v) in c.iter_mut().zip(&x[i * size..]) {
            put(o, v, accumulate);
        }
    });
    Ok(())
}

/// `dst[j, i, k] (=|+=) src[i, j, k]`. (CUDA: `swap_axes`, one thread per destination value.)
pub(super) fn swap_axes(
    pool: Option<&ThreadPool>,
    dst: &mut [f32],
    src: &[f32],
    (outer, middle, inner): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    let n = outer * middle * inner;
    need("swap_axes source", src.len(), n)?;
    need("swap_axes destination", dst.len(), n)?;
    for_each_chunk(pool, &mut dst[..n], outer * inner, |j, row| {
        for (i, out) in row.chunks_mut(inner.max(1)).enumerate() {
            let from = &src[(i * middle + j) * inner..][..inner];
            for (o, &v) in out.iter_mut().zip(from) {
                put(o, v, accumulate);
            }
        }
    });
    Ok(())
}

/// The output columns `ox` of a window row whose input column `ox*stride + k - pad` lies inside
/// `0..width`, as a range.
fn inside(w: &Window, k: usize, out: usize, width: usize) -> std::ops::Range<usize> {
    // ox*stride + k >= pad  and  ox*stride + k < width + pad.
    let lo = w.pad.saturating_sub(k).div_ceil(w.stride);
    let hi = if width + w.pad > k { (width + w.pad - k).div_ceil(w.stride) } else { 0 };
    lo.min(out)..hi.min(out).max(lo.min(out))
}

/// (CUDA: `im2col`, one thread per column entry.) Each output row segment is a copy of an
/// input row (strided when the stride is), zeros where the window hangs over the edge.
pub(super) fn im2col(
    pool: Option<&ThreadPool>,
    col: &mut [f32],
    x: &[f32],
    w: &Window,
    batch: usize,
) -> Result<()> {
    let (oh, ow, k) = (w.out_height(), w.out_width(), w.kernel);
    let cols = batch * oh * ow;
    need("im2col input", x.len(), w.channels * batch * w.height * w.width)?;
    need("im2col columns", col.len(), w.col_rows() * cols)?;
    for_each_chunk(pool, &mut col[..w.col_rows() * cols], cols, |r, row| {
        let (c, ky, kx) = (r / (k * k), r / k % k, r % k);
        let xs = inside(w, kx, ow, w.width);
        for n in 0..batch {
            let plane = &x[(c * batch + n) * w.height * w.width..][..w.height * w.width];
            for oy in 0..oh {
                let out = &mut row[(n * oh + oy) * ow..][..ow];
                let iy = (oy * w.stride + ky).wrapping_sub(w.pad);
                if iy >= w.height || xs.is_empty() {
                    out.fill(0.0);
                    continue;
                }
                out[..xs.start].fill(0.0);
                out[xs.end..].fill(0.0);
                let first = iy * w.width + xs.start * w.stride + kx - w.pad;
                if w.stride == 1 {
                    out[xs.clone()].copy_from_slice(&plane[first..first + xs.len()]);
                } else {
                    for (o, &v) in out[xs.clone()].iter_mut().zip(plane[first..].iter().step_by(w.stride)) {
                        *o = v;
                    }
                }
            }
        }
    });
    Ok(())
}

/// (CUDA: `col2im`, one thread per input value gathering its column entries in (ky, kx)
/// order; here each channel's values take the entries in the same order, a row segment at a
/// time.)
pub(super) fn col2im(
    pool: Option<&ThreadPool>,
    dx: &mut [f32],
    col: &[f32],
    w: &Window,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let (oh, ow, k) = (w.out_height(), w.out_width(), w.kernel);
    let cols = batch * oh * ow;
    let plane = w.height * w.width;
    need("col2im columns", col.len(), w.col_rows() * cols)?;
    need("col2im input gradient", dx.len(), w.channels * batch * plane)?;
    for_each_chunk(pool, &mut dx[..w.channels * batch * plane], batch * plane, |c, out| {
        if !accumulate {
            out.fill(0.0);
        }
        for ky in 0..k {
            for kx in 0..k {
                let row = &col[((c * k + ky) * k + kx) * cols..][..cols];
                let xs = inside(w, kx, ow, w.width);
                if xs.is_empty() {
                    continue;
                }
                for n in 0..batch {
                    for oy in 0..oh {
                        let iy = (oy * w.stride + ky).wrapping_sub(w.pad);
                        if iy >= w.height {
                            continue;
                        }
                        let src = &row[(n * oh + oy) * ow..][xs.clone()];
                        let first = n * plane + iy * w.width + xs.start * w.stride + kx - w.pad;
                        if w.stride == 1 {
                            for (d, &v) in out[first..first + xs.len()].iter_mut().zip(src) {
                                *d += v;
                            }
                        } else {
                            for (d, &v) in out[first..].iter_mut().step_by(w.stride).zip(src) {
                                *d += v;
                            }
                        }
                    }
                }
            }
        }
    });
    Ok(())
}

/// The index (within its plane) of window `(oy, ox)`'s first maximum. A NaN wins, as on the GPU
/// (`!(v <= best)`), so it propagates.
fn window_argmax(plane: &[f32], w: &Window, oy: usize, ox: usize) -> usize {
    let mut best = usize::MAX;
    let mut best_v = 0.0f32;
    for ky in 0..w.kernel {
        let iy = (oy * w.stride + ky).wrapping_sub(w.pad);
        if iy >= w.height {
            continue;
        }
        for kx in 0..w.kernel {
            let ix = (ox * w.stride + kx).wrapping_sub(w.pad);
            if ix >= w.width {
                continue;
            }
            let v = plane[iy * w.width + ix];
            // Take `v` unless the best so far is a NaN or `v` is not above it; a NaN `v` is
            // taken (v > best_v is false for it, so the NaN test comes first).
            let better = !best_v.is_nan() && (v.is_nan() || v > best_v);
            if best == usize::MAX || better {
                (best, best_v) = (iy * w.width + ix, v);
            }
        }
    }
    best
}

/// (CUDA: `max_pool`, one thread per output.)
pub(super) fn max_pool(pool: Option<&ThreadPool>, y: &mut [f32], x: &[f32], w: &Window) -> Result<()> {
    let (plane, out) = (w.height * w.width, w.out_pixels());
    need("max_pool input", x.len(), w.channels * plane)?;
    need("max_pool output", y.len(), w.channels * out)?;
    for_each_chunk(pool, &mut y[..w.channels * out], out, |p, o| {
        let src = &x[p * plane..][..plane];
        for (i, v) in o.iter_mut().enumerate() {
            *v = src[window_argmax(src, w, i / w.out_width(), i % w.out_width())];
        }
    });
    Ok(())
}

/// (CUDA: `max_pool_backward`, one thread per input value gathering, in window order, the
/// gradients of the windows whose maximum it is.)
pub(super) fn max_pool_backward(
    pool: Option<&ThreadPool>,
    dx: &mut [f32],
    dy: &[f32],
    x: &[f32],
    w: &Window,
    accumulate: bool,
) -> Result<()> {
    let (plane, out) = (w.height * w.width, w.out_pixels());
    need("max_pool_backward input", x.len(), w.channels * plane)?;
    need("max_pool_backward output gradient", dy.len(), w.channels * out)?;
    need("max_pool_backward input gradient", dx.len(), w.channels * plane)?;
    for_each_chunk(pool, &mut dx[..w.channels * plane], plane, |p, d| {
        if !accumulate {
            d.fill(0.0);
        }
        let src = &x[p * plane..][..plane];
        for (i, &g) in dy[p * out..][..out].iter().enumerate() {
            d[window_argmax(src, w, i / w.out_width(), i % w.out_width())] += g;
        }
    });
    Ok(())
}

/// (CUDA: `avg_pool`, one thread per output.)
pub(super) fn avg_pool(
    pool: Option<&ThreadPool>,
    y: &mut [f32],
    x: &[f32],
    (channels, batch, pixels): (usize, usize, usize),
) -> Result<()> {
    need("avg_pool input", x.len(), channels * batch * pixels)?;
    need("avg_pool output", y.len(), channels * batch)?;
    for_each_chunk(pool, &mut y[..batch * channels], channels, |n, row| {
        for (c, o) in row.iter_mut().enumerate() {
            let s = x[(c * batch + n) * pixels..][..pixels].iter().fold(0.0f32, |a, &v| a + v);
            *o = s / pixels as f32;
        }
    });
    Ok(())
}

/// (CUDA: `avg_pool_backward`, one thread per input value.)
pub(super) fn avg_pool_backward(
    pool: Option<&ThreadPool>,
    dx: &mut [f32],
    dy: &[f32],
    (channels, batch, pixels): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    need("avg_pool_backward output gradient", dy.len(), channels * batch)?;
    need("avg_pool_backward input gradient", dx.len(), channels * batch * pixels)?;
    for_each_chunk(pool, &mut dx[..channels * batch * pixels], batch * pixels, |c, d| {
        for (i, o) in d.iter_mut().enumerate() {
            put(o, dy[(i / pixels) * channels + c] / pixels as f32, accumulate);
        }
    });
    Ok(())
}

/// (CUDA: the passes of `channel_sums`.)
pub(super) fn channel_sums(
    pool: Option<&ThreadPool>,
    out: &mut [f32],
    a: &[f32],
    what: ChannelSum<&[f32]>,
    channels: usize,
    m: usize,
) -> Result<()> {
    need("channel_sums input", a.len(), channels * m)?;
    need("channel_sums output", out.len(), channels)?;
    match what {
        ChannelSum::Plain => {}
        ChannelSum::SquaredDeviation { center } => need("channel_sums mean", center.len(), channels)?,
        ChannelSum::Dot { b, center } => {
            need("channel_sums mean", center.len(), channels)?;
            need("channel_sums second operand", b.len(), channels * m)?;
        }
    }
    for_each_chunk(pool, &mut out[..channels], 1, |c, o| {
        let a = &a[c * m..][..m];
        o[0] = match what {
            ChannelSum::Plain => grouped_sum(m, |i| a[i]),
            ChannelSum::SquaredDeviation { center } => grouped_sum(m, |i| {
                let d = a[i] - center[c];
                d * d
            }),
            ChannelSum::Dot { b, center } => {
                let b = &b[c * m..][..m];
                grouped_sum(m, |i| a[i] * (b[i] - center[c]))
            }
        };
    });
    Ok(())
}

/// One channel's statistics (CUDA: `norm_stats`, one thread per channel).
pub(super) fn norm_stats(
    saved: &mut [f32],
    running: &mut [f32],
    channels: usize,
    count: usize,
    train: bool,
    cfg: &NormConfig,
) -> Result<()> {
    need("norm_stats saved statistics", saved.len(), 2 * channels)?;
    need("norm_stats running statistics", running.len(), 2 * channels)?;
    if train && count < 2 {
        return Err(Error::invalid(
            "batch norm",
            format!("{count} value(s) per channel: training statistics need at least 2"),
        ));
    }
    let (mean, rest) = saved.split_at_mut(channels);
    let (rmean, rvar) = running.split_at_mut(channels);
    for c in 0..channels {
        if train {
            let var = rest[c] / count as f32;
            let unbiased = rest[c] / (count - 1) as f32;
            rest[c] = 1.0 / (var + cfg.eps).sqrt();
            rmean[c] = (1.0 - cfg.momentum) * rmean[c] + cfg.momentum * mean[c];
            rvar[c] = (1.0 - cfg.momentum) * rvar[c] + cfg.momentum * unbiased;
        } else {
            mean[c] = rmean[c];
            rest[c] = 1.0 / (rvar[c] + cfg.eps).sqrt();
        }
    }
    Ok(())
}

/// (CUDA: `norm_apply`, one thread per value.)
pub(super) fn norm_apply(
    pool: Option<&ThreadPool>,
    y: &mut [f32],
    x: &[f32],
    saved: &[f32],
    affine: &[f32],
    (channels, m): (usize, usize),
) -> Result<()> {
    need("norm_apply input", x.len(), channels * m)?;
    need("norm_apply output", y.len(), channels * m)?;
    need("norm_apply statistics", saved.len(), 2 * channels)?;
    need("norm_apply affine parameters", affine.len(), 2 * channels)?;
    for_each_chunk(pool, &mut y[..channels * m], m, |c, out| {
        let (mean, invstd, gamma, beta) = (saved[c], saved[channels + c], affine[c], affine[channels + c]);
        for (o, &v) in out.iter_mut().zip(&x[c * m..]) {
            *o = (v - mean) * invstd * gamma + beta;
        }
    });
    Ok(())
}

/// (CUDA: `norm_backward`, one thread per value; the first `channels` threads also write the
/// affine gradients.)
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_backward(
    pool: Option<&ThreadPool>,
    dx: Option<&mut [f32]>,
    d_affine: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    saved: &[f32],
    affine: &[f32],
    sums: &[f32],
    (channels, m, count): (usize, usize, usize),
    (accumulate, accumulate_dx): (bool, bool),
) -> Result<()> {
    need("norm_backward output gradient", dy.len(), channels * m)?;
    need("norm_backward input", x.len(), channels * m)?;
    need("norm_backward statistics", saved.len(), 2 * channels)?;
    need("norm_backward affine parameters", affine.len(), 2 * channels)?;
    need("norm_backward sums", sums.len(), 2 * channels)?;
    if let Some(d_affine) = d_affine {
        need("norm_backward affine gradient", d_affine.len(), 2 * channels)?;
        for c in 0..channels {
            put(&mut d_affine[c], sums[channels + c] * saved[channels + c], accumulate);
            put(&mut d_affine[channels + c], sums[c], accumulate);
        }
    }
    let Some(dx) = dx else { return Ok(()) };
    need("norm_backward input gradient", dx.len(), channels * m)?;
    let inv_count = 1.0 / count as f32;
    for_each_chunk(pool, &mut dx[..channels * m], m, |c, out| {
        let (mean, invstd, gamma) = (saved[c], saved[channels + c], affine[c]);
        let (mean_dy, mean_dot) = (sums[c] * inv_count, sums[channels + c] * inv_count);
        let (dy, x) = (&dy[c * m..][..m], &x[c * m..][..m]);
        for ((o, &g), &v) in out.iter_mut().zip(dy).zip(x) {
            let xc = v - mean;
            let d = gamma * invstd * (g - mean_dy - xc * invstd * invstd * mean_dot);
            put(o, d, accumulate_dx);
        }
    });
    Ok(())
}

/// An embedding bag's forward (CUDA: `bag_forward`, a thread per output value, the same order).
#[allow(clippy::too_many_arguments)]
pub(super) fn bag_forward(
    pool: Option<&ThreadPool>,
    y: &mut [f32],
    table: &[f32],
    off: &[u32],
    ids: &[u32],
    w: &[f32],
    batch: usize,
    dim: usize,
) -> Result<()> {
    need("bag output", y.len(), batch * dim)?;
    need("bag offsets", off.len(), batch + 1)?;
    let entries = off[batch] as usize;
    need("bag ids", ids.len(), entries)?;
    need("bag weights", w.len(), entries)?;
    if let Some(&bad) = ids[..entries].iter().find(|&&r| (r as usize + 1) * dim > table.len()) {
        return Err(Error::invalid(
            "embedding bag",
            format!("row {bad} is past the table's {} rows", table.len() / dim),
        ));
    }
    for_each_chunk(pool, &mut y[..batch * dim], dim, |s, out| {
        out.fill(0.0);
        for j in off[s] as usize..off[s + 1] as usize {
            let row = &table[ids[j] as usize * dim..][..dim];
            for (o, &v) in out.iter_mut().zip(row) {
                *o += w[j] * v;
            }
        }
    });
    Ok(())
}

/// An embedding bag's backward into the rows its batch named (CUDA: `bag_backward`, a thread
/// per output value, the same order).
#[allow(clippy::too_many_arguments)]
pub(super) fn bag_backward(
    grad: &mut [f32],
    dy: &[f32],
    rows: &[u32],
    off: &[u32],
    samples: &[u32],
    w: &[f32],
    count: usize,
    dim: usize,
    accumulate: bool,
) -> Result<()> {
    need("bag rows", rows.len(), count)?;
    need("bag row offsets", off.len(), count + 1)?;
    let entries = off[count] as usize;
    need("bag samples", samples.len(), entries)?;
    need("bag weights", w.len(), entries)?;
    for (u, &r) in rows[..count].iter().enumerate() {
        let out = grad.get_mut(r as usize * dim..(r as usize + 1) * dim).ok_or_else(|| {
            Error::invalid("embedding bag", format!("row {r} is past the table's gradient"))
        })?;
        for (k, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for e in off[u] as usize..off[u + 1] as usize {
                acc += w[e] * dy[samples[e] as usize * dim + k];
            }
            put(o, acc, accumulate);
        }
    }
    Ok(())
}

/// The rows `rows` of `v`, or all of `v` when `None`, as `dim`-value slices: `body(row)` for each.
pub(super) fn for_rows(
    v: &mut [f32],
    rows: Option<&[u32]>,
    dim: usize,
    mut body: impl FnMut(usize, &mut [f32]),
) -> Result<()> {
    match rows {
        None => v.chunks_exact_mut(dim).enumerate().for_each(|(r, row)| body(r, row)),
        Some(rows) => {
            for &r in rows {
                let row = v
                    .get_mut(r as usize * dim..(r as usize + 1) * dim)
                    .ok_or_else(|| Error::invalid("table rows", format!("row {r} is past the table")))?;
                body(r as usize, row);
            }
        }
    }
    Ok(())
}
