//! Direct 3x3 convolutions (stride 1, padding 1) for CPUs with AVX-512: the three passes of a
//! convolution read the image where it lies, with no column matrix.
//!
//! The column matrix that [`super::cpu_layers::im2col`] builds for a whole batch is nine times
//! the input (38 MB for a 16-channel ResNet-20 layer at batch 64): building it, packing it for the
//! GEMM and scattering its gradient back all go to memory. Here every vector of 16 consecutive
//! output pixels (CNHW: a channel's pixels of every sample follow each other) reads its nine
//! shifted inputs with one masked load each, the mask zeroing the lanes whose tap falls outside
//! the image (padding, a row's edge, the next sample); a tile of 8 output channels by 48 pixels
//! keeps its 24 sums in registers over every input channel and tap. Used for windows of up to
//! [`MAX_CHANNELS`] input channels, where it was measured faster than the column matrix.
//!
//! - Forward: `y[o, p] = sum over c, then taps (ky, kx) in order, of w[o, c, ky, kx] *
//!   x[c, p + (ky - 1) * W + kx - 1]`.
//! - Input gradient: the same kernel with the roles of the channels swapped and the taps turned
//!   (`dx[c, q] = sum over o, then taps, of w[o, c, 2 - ky, 2 - kx] * dy[o, q + tap]`).
//! - Weight gradient: for one tap, each of 4 output channels x 4 input channels keeps 16 lane
//!   sums over the pixels, a block of pixels at a time (so that the block's inputs and output
//!   gradients stay in L2), added across the lanes at the end.
//!
//! Every output value is computed by one thread in an order that depends only on the shapes, so
//! results do not depend on the thread count. The orders differ from the column-matrix path's
//! (and the GPU's), so results agree with them to rounding, not bit for bit.

use std::arch::x86_64::{
    _mm512_add_ps, _mm512_fmadd_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_set1_ps,
    _mm512_setzero_ps,
};

use rayon::ThreadPool;
use rayon::prelude::*;

use super::backend::Window;
use super::cpu_layers::need;
use crate::error::Result;

/// Lanes of a vector.
const LANES: usize = 16;
/// Output channels of a forward tile (their sums stay in registers).
const OUTS: usize = 8;
/// Vectors of pixels of a forward tile.
const VECS: usize = 3;
/// Output channels per weight-gradient task.
const GRAD_OUTS: usize = 4;
/// Input channels per weight-gradient task.
const GRAD_INS: usize = 4;
/// Taps of a 3x3 window.
const TAPS: usize = 9;
/// Lane sums the weight gradient keeps at once (1 MiB).
const SUMS_VALUES: usize = 1 << 18;
/// Pixels of a weight-gradient task's stretch: its 8 rows (32 KiB) stay in L1 over the taps.
const STRETCH: usize = 1024;
/// Values of inputs and output gradients a weight-gradient block of pixels may hold (512 KiB:
/// half of a core's L2 here).
const BLOCK_VALUES: usize = 1 << 17;

/// Whether this CPU runs these kernels.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// The most input channels a window may have for these kernels to be used. Measured on one
/// thread at batch 64 against the column matrix and the GEMM (forward + both gradients): 16
/// channels at 32x32 5.4x faster, 64 at 32x32 1.5x, 128 at 16x16 1.25x; 256 at 8x8 0.93x, 512 at
/// 4x4 0.95x and at 2x2 0.68x, where the GEMM's blocking of hundreds of channels serves better
/// than these tiles of 8 and 4 (docs/benchmarks.md).
const MAX_CHANNELS: usize = 128;

/// Whether `w` is a window these kernels compute, and compute faster than a column matrix:
/// 3x3, stride 1, padding 1, at most [`MAX_CHANNELS`] input channels.
pub(super) fn fits(w: &Window) -> bool {
    w.kernel == 3 && w.stride == 1 && w.pad == 1 && w.channels <= MAX_CHANNELS
}

/// A raw pointer the pool's threads share; each writes its own disjoint values through it.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: every user writes a disjoint set of values through it (see each kernel's driver).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so that closures capture the whole `Shared`, which is `Sync`).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Which lanes of a vector of output pixels have each tap inside the image.
struct Masks {
    /// Pixels in all (`batch x plane`).
    pixels: usize,
    /// The tap offsets in memory: `(ky - 1) * width + kx - 1`.
    offsets: [isize; TAPS],
    /// The masks of vector `v` (pixels `16 v ..`) are `table[v % table.len()]`: the pattern
    /// repeats every `lcm(plane, 16)` pixels. Lanes past the last pixel are not cleared here
    /// ([`Masks::lanes`] does that).
    table: Vec<[u16; TAPS]>,
}

impl Masks {
    fn new(w: &Window, batch: usize) -> Self {
        let plane = w.height * w.width;
        let mut offsets = [0isize; TAPS];
        for (t, o) in offsets.iter_mut().enumerate() {
            *o = (t / 3) as isize * w.width as isize - w.width as isize + (t % 3) as isize - 1;
        }
        let period = plane / gcd(plane, LANES);
        let table = (0..period)
            .map(|v| {
                let mut out = [0u16; TAPS];
                for lane in 0..LANES {
                    let s = (v * LANES + lane) % plane;
                    let (y, x) = (s / w.width, s % w.width);
                    for (t, m) in out.iter_mut().enumerate() {
                        // Inside when 0 <= y + ky - 1 < height and 0 <= x + kx - 1 < width.
                        let (iy, ix) = (y + t / 3, x + t % 3);
                        if (1..=w.height).contains(&iy) && (1..=w.width).contains(&ix) {
                            *m |= 1 << lane;
                        }
                    }
                }
                out
            })
            .collect();
        Masks { pixels: batch * plane, offsets, table }
    }

    /// The masks of the vector starting at pixel `p0`, a multiple of [`LANES`], lanes past the
    /// last pixel off.
    fn at(&self, p0: usize) -> [u16; TAPS] {
        let lanes = self.lanes(p0);
        self.table[p0 / LANES % self.table.len()].map(|m| m & lanes)
    }

    /// The lanes of the vector starting at `p0` that hold pixels.
    fn lanes(&self, p0: usize) -> u16 {
        let n = self.pixels.saturating_sub(p0).min(LANES);
        if n == LANES { u16::MAX } else { (1u16 << n) - 1 }
    }
}

/// The weights `w` (`outs x ins x 3 x 3`) in tiles of [`OUTS`] output channels: `[tile][in][tap][8]`,
/// zero past the last output. `turned`: the input gradient's weights, whose outputs are `w`'s
/// inputs and whose taps are turned by half a turn.
fn pack(w: &[f32], outs: usize, ins: usize, turned: bool) -> Vec<f32> {
    let (to, ti) = if turned { (ins, outs) } else { (outs, ins) };
    let mut p = vec![0.0; to.div_ceil(OUTS) * OUTS * ti * TAPS];
    for o in 0..to {
        for i in 0..ti {
            for t in 0..TAPS {
                let v =
                    if turned { w[(i * ins + o) * TAPS + TAPS - 1 - t] } else { w[(o * ins + i) * TAPS + t] };
                p[(((o / OUTS) * ti + i) * TAPS + t) * OUTS + o % OUTS] = v;
            }
        }
    }
    p
}

/// `y (=|+=)` the convolution of `x` (`ins x batch x H x W`) with `w` (`outs x ins x 3 x 3`).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    pool: Option<&ThreadPool>,
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    win: &Window,
    outs: usize,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let ins = win.channels;
    check(y, x, w, win, outs, batch, "convolution output", "convolution input")?;
    run(pool, y, x, &pack(w, outs, ins, false), win, ins, outs, batch, accumulate);
    Ok(())
}

/// `dx (=|+=)` the input gradient of [`forward`] given its output gradient `dy`.
#[allow(clippy::too_many_arguments)]
pub(super) fn input_grad(
    pool: Option<&ThreadPool>,
    dx: &mut [f32],
    dy: &[f32],
    w: &[f32],
    win: &Window,
    outs: usize,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let ins = win.channels;
    check(dy, dx, w, win, outs, batch, "convolution output gradient", "convolution input gradient")?;
    run(pool, dx, dy, &pack(w, outs, ins, true), win, outs, ins, batch, accumulate);
    Ok(())
}

/// Refuse views shorter than the shapes say (`ys`: the `outs` side, `xs`: the `ins` side).
#[allow(clippy::too_many_arguments)]
fn check(
    ys: &[f32],
    xs: &[f32],
    w: &[f32],
    win: &Window,
    outs: usize,
    batch: usize,
    y_what: &'static str,
    x_what: &'static str,
) -> Result<()> {
    let pixels = batch * win.height * win.width;
    need(y_what, ys.len(), outs * pixels)?;
    need(x_what, xs.len(), win.channels * pixels)?;
    need("convolution weights", w.len(), outs * win.channels * TAPS)
}

/// `dst (=|+=)` the convolution of `src` (`ins` channels) with the packed weights `wp` (`outs`
/// channels), tile by tile, the tiles shared among the pool's threads.
#[allow(clippy::too_many_arguments)]
fn run(
    pool: Option<&ThreadPool>,
    dst: &mut [f32],
    src: &[f32],
    wp: &[f32],
    win: &Window,
    ins: usize,
    outs: usize,
    batch: usize,
    accumulate: bool,
) {
    let masks = Masks::new(win, batch);
    let pixels = masks.pixels;
    let span = VECS * LANES;
    let out = Shared(dst.as_mut_ptr());
    let tile = |g: usize| {
        let p0 = g * span;
        let vecs = (pixels - p0).div_ceil(LANES).min(VECS);
        let mut m = [[0u16; TAPS]; VECS];
        let mut store = [0u16; VECS];
        for v in 0..vecs {
            m[v] = masks.at(p0 + v * LANES);
            store[v] = masks.lanes(p0 + v * LANES);
        }
        for t in 0..outs.div_ceil(OUTS) {
            let a = Tile {
                src: src.as_ptr().wrapping_add(p0),
                pixels,
                ins,
                weights: wp[t * ins * TAPS * OUTS..].as_ptr(),
                offsets: &masks.offsets,
                dst: out.at(t * OUTS * pixels + p0),
                outs: (outs - t * OUTS).min(OUTS),
                accumulate,
            };
            // SAFETY: AVX-512F is present (`available`, checked by the caller's backend); loads
            // reach only lanes whose masks say they lie inside `src` (a tap inside the image, a
            // pixel below `pixels`), `check` having measured it; stores go to this tile's own
            // pixels of its own output channels, which no other tile writes.
            unsafe {
                match vecs {
                    3 => a.run::<3>(&m, &store),
                    2 => a.run::<2>(&[m[0], m[1]], &[store[0], store[1]]),
                    _ => a.run::<1>(&[m[0]], &[store[0]]),
                }
            }
        }
    };
    let tiles = pixels.div_ceil(span);
    match pool {
        None => (0..tiles).for_each(tile),
        Some(p) => p.install(|| (0..tiles).into_par_iter().with_min_len(4).for_each(tile)),
    }
}

/// One forward tile: up to [`OUTS`] output channels by `V` vectors of pixels.
struct Tile<'a> {
    /// The first input channel at the tile's first pixel.
    src: *const f32,
    /// Values per channel.
    pixels: usize,
    ins: usize,
    /// This tile's packed weights, `[in][tap][8]`.
    weights: *const f32,
    offsets: &'a [isize; TAPS],
    /// The first output channel at the tile's first pixel.
    dst: *mut f32,
    /// Output channels to store (the rest of 8 are padding).
    outs: usize,
    accumulate: bool,
}

impl Tile<'_> {
    /// # Safety
    /// AVX-512F must be present, and the masks must keep every lane they let through inside
    /// the input and output buffers.
    #[target_feature(enable = "avx512f")]
    unsafe fn run<const V: usize>(&self, masks: &[[u16; TAPS]; V], store: &[u16; V]) {
        let mut acc = [[_mm512_setzero_ps(); V]; OUTS];
        for c in 0..self.ins {
            let s = self.src.wrapping_add(c * self.pixels);
            // SAFETY: `c < ins`, so the tile's weights hold `[c][tap][8]`.
            let wc = unsafe { self.weights.add(c * TAPS * OUTS) };
            for (t, &offset) in self.offsets.iter().enumerate() {
                let mut xv = [_mm512_setzero_ps(); V];
                for (v, (x, m)) in xv.iter_mut().zip(masks).enumerate() {
                    let at = s.wrapping_offset(offset + (v * LANES) as isize);
                    // SAFETY: the lanes the mask lets through are taps inside the image, so
                    // inside `src` (the caller's contract).
                    *x = unsafe { _mm512_maskz_loadu_ps(m[t], at) };
                }
                for (o, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `t * 8 + o < 72`, inside this channel's weights.
                    let wv = _mm512_set1_ps(unsafe { *wc.add(t * OUTS + o) });
                    for v in 0..V {
                        acc[v] = _mm512_fmadd_ps(wv, xv[v], acc[v]);
                    }
                }
            }
        }
        for (o, acc) in acc.iter().enumerate().take(self.outs) {
            for v in 0..V {
                let at = self.dst.wrapping_add(o * self.pixels + v * LANES);
                // SAFETY: `store` lets through the tile's pixels below `pixels` only, in an
                // output channel below `outs` (the caller's contract).
                unsafe {
                    let sum = if self.accumulate {
                        _mm512_add_ps(_mm512_maskz_loadu_ps(store[v], at), acc[v])
                    } else {
                        acc[v]
                    };
                    _mm512_mask_storeu_ps(at, store[v], sum);
                }
            }
        }
    }
}

/// `dw (=|+=)` the weight gradient of [`forward`]: `dw[o, c, ky, kx] = sum over pixels p of
/// dy[o, p] * x[c, p + tap]`.
///
/// Each task is [`GRAD_OUTS`] output channels by [`GRAD_INS`] input channels: for each tap, 16
/// vectors of lane sums, each vector of pixels read once for the 16 (one mask for them all); a
/// block of pixels at a time, so that the block's values stay in L2 across the tasks.
#[allow(clippy::too_many_arguments)]
pub(super) fn weight_grad(
    pool: Option<&ThreadPool>,
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    win: &Window,
    outs: usize,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let ins = win.channels;
    check(dy, x, dw, win, outs, batch, "convolution output gradient", "convolution input")?;
    let masks = Masks::new(win, batch);
    let pixels = masks.pixels;
    let (oblocks, iblocks) = (outs.div_ceil(GRAD_OUTS), ins.div_ceil(GRAD_INS));
    let tasks = oblocks * iblocks;
    // Each task's lane sums: [task][tap][output][input][lane], for a group of tasks at a time
    // (1 MiB of sums: 113 tasks), each group over the blocks of pixels.
    let per_task = TAPS * GRAD_OUTS * GRAD_INS * LANES;
    let group = (SUMS_VALUES / per_task).max(1);
    let mut sums = vec![0f32; group.min(tasks) * per_task];
    // At least a stretch: with hundreds of channels a block that fits L2 would be a few vectors
    // long, and each task would spend more on loading and storing its sums than on its sums.
    let block = (BLOCK_VALUES / (ins + outs)).max(STRETCH) / LANES * LANES;
    // Task i: output block i / iblocks and input block i % iblocks. The blocks' last rows
    // repeat the last channel where the channels run out (their sums unused).
    let rows = |first: usize, count: usize, base: &[f32]| {
        std::array::from_fn(|r| base.as_ptr().wrapping_add((first + r).min(count - 1) * pixels))
    };
    for first in (0..tasks).step_by(group) {
        let these = first..(first + group).min(tasks);
        sums.fill(0.0);
        let shared = Shared(sums.as_mut_ptr());
        for start in (0..pixels).step_by(block) {
            let end = (start + block).min(pixels);
            let task = |i: usize| {
                let (ob, ib) = (i / iblocks, i % iblocks);
                let dys: [*const f32; GRAD_OUTS] = rows(ob * GRAD_OUTS, outs, dy);
                let xs: [*const f32; GRAD_INS] = rows(ib * GRAD_INS, ins, x);
                // SAFETY: AVX-512F is present (the backend checked); every row pointer starts a
                // channel of `dy` or `x`, which `check` measured at `pixels` values; task `i`
                // alone writes its sums.
                unsafe { grad_task(&dys, &xs, &masks, start..end, shared.at((i - first) * per_task)) };
            };
            match pool {
                None => these.clone().for_each(task),
                Some(p) => p.install(|| these.clone().into_par_iter().for_each(task)),
            }
        }
        for (i, tap) in these.flat_map(|i| (0..TAPS).map(move |t| (i, t))) {
            let (ob, ib) = (i / iblocks, i % iblocks);
            for r in 0..GRAD_OUTS {
                for q in 0..GRAD_INS {
                    let (o, c) = (ob * GRAD_OUTS + r, ib * GRAD_INS + q);
                    if o >= outs || c >= ins {
                        continue;
                    }
                    let at = (i - first) * per_task + ((tap * GRAD_OUTS + r) * GRAD_INS + q) * LANES;
                    let total = reduce(&sums[at..][..LANES]);
                    let slot = &mut dw[(o * ins + c) * TAPS + tap];
                    *slot = if accumulate { *slot + total } else { total };
                }
            }
        }
    }
    Ok(())
}

/// The greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a.max(1) } else { gcd(b, a % b) }
}

/// The sum of the 16 lanes, in halves: lane i plus lane i + 8, then i + 4, i + 2, i + 1.
fn reduce(lanes: &[f32]) -> f32 {
    let mut v = [0f32; LANES];
    v.copy_from_slice(lanes);
    let mut n = LANES / 2;
    while n > 0 {
        for i in 0..n {
            v[i] += v[i + n];
        }
        n /= 2;
    }
    v[0]
}

/// One weight-gradient task over the pixels `range`: the output gradients' rows `dys` against
/// the inputs' rows `xs`, shifted by each tap, into `sums` (`[tap][output][input][lane]`, added
/// to). A stretch of [`STRETCH`] pixels at a time, its rows in L1, for all nine taps.
///
/// # Safety
/// AVX-512F must be present; every row must hold `masks.pixels` values; `sums` must hold
/// `9 x GRAD_OUTS x GRAD_INS x 16` values that nothing else touches meanwhile.
#[target_feature(enable = "avx512f")]
unsafe fn grad_task(
    dys: &[*const f32; GRAD_OUTS],
    xs: &[*const f32; GRAD_INS],
    masks: &Masks,
    range: std::ops::Range<usize>,
    sums: *mut f32,
) {
    let per_tap = GRAD_OUTS * GRAD_INS * LANES;
    for start in range.clone().step_by(STRETCH) {
        let end = (start + STRETCH).min(range.end);
        for tap in 0..TAPS {
            let at = sums.wrapping_add(tap * per_tap);
            let mut acc = [[_mm512_setzero_ps(); GRAD_INS]; GRAD_OUTS];
            for (r, a) in acc.iter_mut().enumerate() {
                for (q, v) in a.iter_mut().enumerate() {
                    // SAFETY: inside `sums` (the contract).
                    *v = unsafe { _mm512_maskz_loadu_ps(u16::MAX, at.add((r * GRAD_INS + q) * LANES)) };
                }
            }
            let offset = masks.offsets[tap];
            // The vector's place in the masks' table, stepped rather than divided each time.
            let rows = masks.table.len();
            let mut row = start / LANES % rows;
            let mut p0 = start;
            while p0 < end {
                let lanes = masks.lanes(p0);
                let m = masks.table[row][tap] & lanes;
                row += 1;
                if row == rows {
                    row = 0;
                }
                let mut xv = [_mm512_setzero_ps(); GRAD_INS];
                for (v, x) in xv.iter_mut().zip(xs) {
                    // SAFETY: the mask lets through taps inside the image only, so inside the row.
                    *v = unsafe { _mm512_maskz_loadu_ps(m, x.wrapping_offset(p0 as isize + offset)) };
                }
                for (a, dy) in acc.iter_mut().zip(dys) {
                    // SAFETY: the lanes below `pixels` only (the contract).
                    let d = unsafe { _mm512_maskz_loadu_ps(lanes, dy.add(p0)) };
                    for (acc, x) in a.iter_mut().zip(&xv) {
                        *acc = _mm512_fmadd_ps(d, *x, *acc);
                    }
                }
                p0 += LANES;
            }
            for (r, a) in acc.iter().enumerate() {
                for (q, v) in a.iter().enumerate() {
                    // SAFETY: inside `sums` (the contract).
                    unsafe { _mm512_mask_storeu_ps(at.add((r * GRAD_INS + q) * LANES), u16::MAX, *v) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::device::{Backend, Cpu};

    /// Values in [-1, 1) from a simple generator, different for each `seed`.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `max |a - b|` over `max |b|`.
    fn rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// The three passes against the column matrix and the GEMM, on shapes with planes of whole
    /// vectors and not (35 pixels, 4, 1), output channels not a multiple of 8, odd pairs, and
    /// added to what is there; the same bits on one thread and two.
    #[test]
    fn direct_convolutions_match_the_column_matrix() {
        if !available() {
            eprintln!("SKIPPED (no AVX-512F on this CPU) [direct_convolutions_match_the_column_matrix]");
            return;
        }
        let one = Cpu::new(1).unwrap();
        let two = Cpu::new(2).unwrap();
        // (input channels, output channels, height, width, batch)
        let shapes = [
            (3, 16, 8, 8, 2),
            (16, 16, 32, 32, 2),
            (5, 12, 7, 5, 3),
            (8, 9, 2, 2, 3),
            (1, 1, 1, 1, 1),
            (17, 24, 4, 4, 5),
            (64, 64, 8, 8, 4),
            (2, 3, 3, 17, 1),
        ];
        for (seed, &(ins, outs, height, width, batch)) in shapes.iter().enumerate() {
            let win = Window { channels: ins, height, width, kernel: 3, stride: 1, pad: 1 };
            let (cols, k) = (batch * height * width, ins * 9);
            let x = values(ins * cols, seed as u64 * 4 + 1);
            let w = values(outs * k, seed as u64 * 4 + 2);
            let dy = values(outs * cols, seed as u64 * 4 + 3);
            let start_y = values(outs * cols, seed as u64 * 4 + 4);
            let start_x = values(ins * cols, seed as u64 * 4 + 5);
            let start_w = values(outs * k, seed as u64 * 4 + 6);
            let mut col = vec![0.0; k * cols];
            one.im2col(&mut col, &x, &win, batch).unwrap();
            let case = format!("{ins} -> {outs} channels, {height}x{width}, batch {batch}");
            for acc in [false, true] {
                // Forward.
                let mut want = start_y.clone();
                one.gemm(outs, cols, k, &w, false, &col, false, &mut want, acc).unwrap();
                let mut got = start_y.clone();
                forward(None, &mut got, &x, &w, &win, outs, batch, acc).unwrap();
                assert!(rel(&got, &want) < 1e-5, "{case} forward (acc {acc}): {:.2e}", rel(&got, &want));
                let mut par = start_y.clone();
                two.conv(&mut par, &x, &w, &win, outs, batch, acc).unwrap();
                assert_eq!(par, got, "{case}: forward on two threads");
                // Input gradient.
                let mut g = vec![0.0; k * cols];
                one.gemm(k, cols, outs, &w, true, &dy, false, &mut g, false).unwrap();
                let mut want = start_x.clone();
                one.col2im(&mut want, &g, &win, batch, acc).unwrap();
                let mut got = start_x.clone();
                input_grad(None, &mut got, &dy, &w, &win, outs, batch, acc).unwrap();
                assert!(
                    rel(&got, &want) < 1e-5,
                    "{case} input gradient (acc {acc}): {:.2e}",
                    rel(&got, &want)
                );
                let mut par = start_x.clone();
                two.conv_input_grad(&mut par, &dy, &w, &win, outs, batch, acc).unwrap();
                assert_eq!(par, got, "{case}: input gradient on two threads");
                // Weight gradient.
                let mut want = start_w.clone();
                one.gemm(outs, k, cols, &dy, false, &col, true, &mut want, acc).unwrap();
                let mut got = start_w.clone();
                weight_grad(None, &mut got, &dy, &x, &win, outs, batch, acc).unwrap();
                assert!(
                    rel(&got, &want) < 1e-5,
                    "{case} weight gradient (acc {acc}): {:.2e}",
                    rel(&got, &want)
                );
                let mut par = start_w.clone();
                two.conv_weight_grad(&mut par, &dy, &x, &win, outs, batch, acc).unwrap();
                assert_eq!(par, got, "{case}: weight gradient on two threads");
            }
        }
    }

    #[test]
    fn short_views_and_other_windows_are_refused() {
        let win = Window { channels: 2, height: 4, width: 4, kernel: 3, stride: 1, pad: 1 };
        let (x, w) = (vec![0.0; 2 * 16], vec![0.0; 3 * 2 * 9]);
        let mut y = vec![0.0; 3 * 16 - 1];
        let e = forward(None, &mut y, &x, &w, &win, 3, 1, false).unwrap_err().to_string();
        assert!(e.contains("convolution output"), "{e}");
        let e = weight_grad(None, &mut [0.0; 5], &[0.0; 48], &x, &win, 3, 1, false).unwrap_err().to_string();
        assert!(e.contains("convolution weights"), "{e}");
        let cpu = Cpu::new(1).unwrap();
        let strided = Window { stride: 2, ..win };
        assert!(!cpu.direct_conv(&strided));
        assert!(!cpu.direct_conv(&Window { channels: MAX_CHANNELS + 1, ..win }));
        assert_eq!(cpu.direct_conv(&win), available());
        let e = cpu.conv(&mut [0.0; 3 * 4], &x, &w, &strided, 3, 1, false).unwrap_err().to_string();
        assert!(e.contains("stride 2"), "{e}");
    }
}
