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
//! - Weight gradient: the inputs and output gradients copied stretch by stretch (a task's rows
//!   side by side, not a channel's length apart), then for one input channel and one row of
//!   taps, each of 8 output channels x 3 taps keeps 16 lane sums over the pixels, a block of
//!   pixels at a time (so that the block's values stay in L2), added across the lanes at the
//!   end.
//!
//! Every output value is computed by one thread in an order that depends only on the shapes, so
//! results do not depend on the thread count. The orders differ from the column-matrix path's
//! (and the GPU's), so results agree with them to rounding, not bit for bit.

use std::arch::x86_64::{
    __m512, _mm512_add_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4, _mm512_shuffle_ps, _mm512_storeu_ps,
    _mm512_unpackhi_ps, _mm512_unpacklo_ps,
};

use rayon::ThreadPool;
use rayon::prelude::*;

use super::backend::Window;
use super::cpu_layers::{Shared, need_conv};
use crate::error::Result;

/// Lanes of a vector.
const LANES: usize = 16;
/// Output channels of a forward tile (their sums stay in registers).
const OUTS: usize = 8;
/// Vectors of pixels of a forward tile.
const VECS: usize = 3;
/// Output channels per weight-gradient task.
const GRAD_OUTS: usize = 8;
/// Input channels per weight-gradient task.
const GRAD_INS: usize = 4;
/// Taps of a 3x3 window.
const TAPS: usize = 9;
/// Lane sums the weight gradient keeps at once (1 MiB).
const SUMS_VALUES: usize = 1 << 18;
/// Pixels of a weight-gradient task's stretch: its 12 rows (26 KiB with the inputs' margins)
/// stay in L1 over the taps.
const STRETCH: usize = 512;
/// Values of inputs and output gradients a weight-gradient block of pixels may hold (512 KiB:
/// half of a core's L2 here).
const BLOCK_VALUES: usize = 1 << 17;

/// Whether this CPU runs these kernels.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// The most input channels a window may have for these kernels to be used. Measured at batch 64
/// against the column matrix and the GEMM (forward + both gradients, docs/benchmarks.md): one
/// thread, 64 channels at 32x32 1.5x faster, 128 at 16x16 1.2x, 256 at 8x8 1.1x, 512 at 4x4
/// 0.98x (the weight gradient 0.90x), where the GEMM's blocking of hundreds of channels serves
/// as well as these tiles.
const MAX_CHANNELS: usize = 256;

/// Whether `w` is a window these kernels compute, and compute faster than a column matrix:
/// 3x3, stride 1, padding 1, at most [`MAX_CHANNELS`] input channels.
pub(super) fn fits(w: &Window) -> bool {
    w.kernel == 3 && w.stride == 1 && w.pad == 1 && w.channels <= MAX_CHANNELS
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
    need_conv(y, x, w, win, outs, batch, "convolution output", "convolution input")?;
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
    need_conv(dy, dx, w, win, outs, batch, "convolution output gradient", "convolution input gradient")?;
    run(pool, dx, dy, &pack(w, outs, ins, true), win, outs, ins, batch, accumulate);
    Ok(())
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
/// The inputs and output gradients are first copied stretch by stretch ([`Packed`]). Each task
/// is [`GRAD_OUTS`] output channels by [`GRAD_INS`] input channels and keeps 16 lane sums for
/// each of their pairs and taps; a group of tasks (their sums 1 MiB) goes over the pixels a
/// block at a time, so that the block's values stay in L2 across the tasks, and each task adds
/// up its lanes after the last block.
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
    need_conv(dy, x, dw, win, outs, batch, "convolution output gradient", "convolution input")?;
    let masks = Masks::new(win, batch);
    let pixels = masks.pixels;
    let (oblocks, iblocks) = (outs.div_ceil(GRAD_OUTS), ins.div_ceil(GRAD_INS));
    let tasks = oblocks * iblocks;
    // Each task's lane sums: [task][input][tap][output][lane].
    let per_task = TAPS * GRAD_OUTS * GRAD_INS * LANES;
    let group = (SUMS_VALUES / per_task).max(1);
    // Each task zeroes its own sums before its first block (the groups share them).
    let mut sums = vec![0f32; group.min(tasks) * per_task];
    // Whole stretches, at least one: with hundreds of channels a block that fits L2 would be a
    // few vectors long.
    let block = (BLOCK_VALUES / (ins + outs)).max(STRETCH) / STRETCH * STRETCH;
    let packed = Packed::new(win, ins, outs, pixels);
    let grads = Shared(dw.as_mut_ptr());
    PACKED.with_borrow_mut(|scratch| {
        let base = Shared(packed.fill(pool, scratch, x, dy).cast_mut());
        // Each of the pool's threads takes an equal share of a group's tasks through all the
        // blocks (one hand-out per group, not per block).
        let workers = pool.map_or(1, ThreadPool::current_num_threads);
        for first in (0..tasks).step_by(group) {
            let these = first..(first + group).min(tasks);
            let share = these.len().div_ceil(workers);
            let shared = Shared(sums.as_mut_ptr());
            let work = |w: usize| {
                let mine = (first + w * share).min(these.end)..(first + (w + 1) * share).min(these.end);
                for start in (0..pixels).step_by(block) {
                    let end = (start + block).min(pixels);
                    for i in mine.clone() {
                        // Task i: output block i / iblocks and input block i % iblocks.
                        let (ob, ib) = (i / iblocks, i % iblocks);
                        let at = shared.at((i - first) * per_task);
                        if start == 0 {
                            // SAFETY: the task's own sums, inside `sums`.
                            unsafe { std::ptr::write_bytes(at, 0, per_task) };
                        }
                        for s0 in (start..end).step_by(STRETCH) {
                            let (dys, xs) = packed.rows(base, s0, ob * GRAD_OUTS, ib * GRAD_INS);
                            // SAFETY: AVX-512F is present (the backend checked); the packed
                            // stretch holds every value the masks let through; task `i` alone
                            // writes its sums.
                            unsafe { grad_task(&dys, &xs, &masks, s0..(s0 + STRETCH).min(end), at) };
                        }
                        if end == pixels {
                            // SAFETY: as above; `check` measured `dw`.
                            unsafe { finish(at, grads, (ob, ib), (outs, ins), accumulate) };
                        }
                    }
                }
            };
            match pool {
                None => work(0),
                Some(p) => p.install(|| (0..workers).into_par_iter().for_each(work)),
            }
        }
    });
    Ok(())
}

/// Add up the lanes of a task's sums at `at` and store (or add) them into `dw` for its output
/// block `ob` and input block `ib` (`[input][tap][output]`, as the sums), skipping the rows
/// past `outs` and `ins`.
///
/// # Safety
/// AVX-512F must be present; `at` must hold the task's sums and `dw` the whole weight gradient,
/// whose values for these blocks no other thread touches meanwhile.
#[target_feature(enable = "avx512f")]
unsafe fn finish(
    at: *mut f32,
    dw: Shared,
    (ob, ib): (usize, usize),
    (outs, ins): (usize, usize),
    accumulate: bool,
) {
    let mut totals = [0f32; TAPS * GRAD_OUTS * GRAD_INS];
    // SAFETY: the task's sums (the contract).
    unsafe { reduce(at, &mut totals) };
    for (j, &total) in totals.iter().enumerate() {
        let (q, tap, r) = (j / (TAPS * GRAD_OUTS), j / GRAD_OUTS % TAPS, j % GRAD_OUTS);
        let (o, c) = (ob * GRAD_OUTS + r, ib * GRAD_INS + q);
        if o < outs && c < ins {
            // SAFETY: inside `dw`, in these blocks (the contract).
            unsafe {
                let slot = dw.at((o * ins + c) * TAPS + tap);
                *slot = if accumulate { *slot + total } else { total };
            }
        }
    }
}

std::thread_local! {
    /// The packed stretches of the weight gradient, kept between calls.
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The weight gradient's inputs and output gradients copied stretch by stretch: for each
/// stretch of [`STRETCH`] pixels, every input channel's pixels with `halo` more on each side
/// (zero outside the image's buffer), then every output channel's pixels. A task's rows are then
/// next to each other in memory rather than a channel's whole length apart (a multiple of 4 KiB
/// at batch 64, where every row fell into the same few sets of L1 and evicted the others).
struct Packed {
    ins: usize,
    outs: usize,
    pixels: usize,
    /// Pixels before and after a stretch held with each input row: the farthest tap, rounded
    /// up to whole vectors.
    halo: usize,
}

impl Packed {
    fn new(win: &Window, ins: usize, outs: usize, pixels: usize) -> Self {
        Packed { ins, outs, pixels, halo: (win.width + 1).next_multiple_of(LANES) }
    }

    /// Values of an input row.
    fn xrow(&self) -> usize {
        STRETCH + 2 * self.halo
    }

    /// Values of a stretch.
    fn stride(&self) -> usize {
        self.ins * self.xrow() + self.outs * STRETCH
    }

    /// Copy `x` and `dy` into `scratch` (grown when short), returning the first value's
    /// address (64-byte aligned).
    fn fill(&self, pool: Option<&ThreadPool>, scratch: &mut Vec<f32>, x: &[f32], dy: &[f32]) -> *const f32 {
        let stretches = self.pixels.div_ceil(STRETCH);
        let len = stretches * self.stride();
        if scratch.len() < len + LANES {
            *scratch = crate::heap::zeros(len + LANES);
        }
        let skip = scratch.as_ptr().align_offset(64).min(LANES);
        let area = &mut scratch[skip..skip + len];
        let (pixels, halo, xrow) = (self.pixels, self.halo, self.xrow());
        let one = |(s, dst): (usize, &mut [f32])| {
            let s0 = s * STRETCH;
            let (xs, dys) = dst.split_at_mut(self.ins * xrow);
            for (c, row) in xs.chunks_exact_mut(xrow).enumerate() {
                // Pixels s0 - halo + j for j in 0..xrow, those inside 0..pixels copied.
                let from = s0.saturating_sub(halo);
                let to = (s0 + STRETCH + halo).min(pixels);
                let at = from + halo - s0;
                row[..at].fill(0.0);
                row[at..at + to - from].copy_from_slice(&x[c * pixels + from..c * pixels + to]);
                row[at + to - from..].fill(0.0);
            }
            let n = STRETCH.min(pixels - s0);
            for (o, row) in dys.chunks_exact_mut(STRETCH).enumerate() {
                row[..n].copy_from_slice(&dy[o * pixels + s0..o * pixels + s0 + n]);
                row[n..].fill(0.0);
            }
        };
        let stride = self.stride();
        match pool {
            None => area.chunks_exact_mut(stride).enumerate().for_each(one),
            Some(p) => p.install(|| area.par_chunks_exact_mut(stride).enumerate().for_each(one)),
        }
        area.as_ptr()
    }

    /// The rows of the stretch starting at pixel `s0` for outputs from `o0` and inputs from
    /// `c0`, each pointer placed so that adding a pixel's index gives the pixel (the blocks'
    /// last rows repeat the last channel where the channels run out, their sums unused).
    fn rows(
        &self,
        base: Shared,
        s0: usize,
        o0: usize,
        c0: usize,
    ) -> ([*const f32; GRAD_OUTS], [*const f32; GRAD_INS]) {
        let at = base.at(s0 / STRETCH * self.stride()) as *const f32;
        let xs = std::array::from_fn(|q| {
            at.wrapping_add((c0 + q).min(self.ins - 1) * self.xrow() + self.halo).wrapping_sub(s0)
        });
        let dys = std::array::from_fn(|r| {
            at.wrapping_add(self.ins * self.xrow() + (o0 + r).min(self.outs - 1) * STRETCH).wrapping_sub(s0)
        });
        (dys, xs)
    }
}

/// The greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a.max(1) } else { gcd(b, a % b) }
}

/// The sums of the lanes of each of `totals.len()` vectors (a multiple of 16) at `sums`, into
/// `totals`: 16 vectors at a time, pairs of lanes added across the vectors and moved together
/// until each vector's sum lies in its own lane (45 instructions for 16 sums).
///
/// # Safety
/// AVX-512F must be present and `sums` must hold `16 x totals.len()` values.
#[target_feature(enable = "avx512f")]
unsafe fn reduce(sums: *const f32, totals: &mut [f32]) {
    for (g, out) in totals.chunks_exact_mut(LANES).enumerate() {
        // SAFETY: vector `16 g + j` lies inside `sums` (the contract).
        let v: [__m512; LANES] =
            std::array::from_fn(|j| unsafe { _mm512_loadu_ps(sums.add((g * LANES + j) * LANES)) });
        // In each 128-bit quarter: [v0 a, v1 a, v0 b, v1 b], two partial sums of each of a pair.
        let a: [__m512; 8] = std::array::from_fn(|k| {
            _mm512_add_ps(
                _mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]),
            )
        });
        // In each quarter: one partial sum of each of four vectors.
        let b: [__m512; 4] = std::array::from_fn(|k| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a[2 * k], a[2 * k + 1]),
                _mm512_shuffle_ps::<0xEE>(a[2 * k], a[2 * k + 1]),
            )
        });
        // Quarters 0 and 1 added, and 2 and 3: two partial sums of each of eight vectors.
        let c: [__m512; 2] = std::array::from_fn(|k| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(b[2 * k], b[2 * k + 1]),
                _mm512_shuffle_f32x4::<0xDD>(b[2 * k], b[2 * k + 1]),
            )
        });
        let d =
            _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(c[0], c[1]), _mm512_shuffle_f32x4::<0xDD>(c[0], c[1]));
        // SAFETY: `out` holds 16 values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), d) };
    }
}

/// One weight-gradient task over the pixels `range` (one packed stretch, its rows in L1): the
/// output gradients' rows `dys` against the inputs' rows `xs`, shifted by each tap, into `sums`
/// (`[input][tap][output][lane]`, added to). For each input channel and row of taps, the three
/// taps' sums for all [`GRAD_OUTS`] outputs stay in registers (24), so that each vector of
/// pixels loads 8 output gradients and 3 shifted inputs for 24 products.
///
/// # Safety
/// AVX-512F must be present; each row pointer plus a pixel's index in `range` must address
/// that pixel, and every tap the masks let through for those pixels must lie inside the row's
/// memory ([`Packed::rows`]); `sums` must hold `GRAD_INS x 9 x GRAD_OUTS x 16` values that
/// nothing else touches meanwhile.
#[target_feature(enable = "avx512f")]
unsafe fn grad_task(
    dys: &[*const f32; GRAD_OUTS],
    xs: &[*const f32; GRAD_INS],
    masks: &Masks,
    range: std::ops::Range<usize>,
    sums: *mut f32,
) {
    let per_tap = GRAD_OUTS * LANES;
    let rows = masks.table.len();
    let (start, end) = (range.start, range.end);
    for (q, x) in xs.iter().enumerate() {
        for ky in 0..3 {
            let first = ky * 3;
            let at = sums.wrapping_add((q * TAPS + first) * per_tap);
            let mut acc = [[_mm512_setzero_ps(); GRAD_OUTS]; 3];
            for (kx, a) in acc.iter_mut().enumerate() {
                for (r, v) in a.iter_mut().enumerate() {
                    // SAFETY: inside `sums` (the contract).
                    *v = unsafe { _mm512_maskz_loadu_ps(u16::MAX, at.add((kx * GRAD_OUTS + r) * LANES)) };
                }
            }
            let offsets = [masks.offsets[first], masks.offsets[first + 1], masks.offsets[first + 2]];
            // The vector's place in the masks' table, stepped rather than divided each time.
            let mut row = start / LANES % rows;
            let mut p0 = start;
            // Whole vectors: every lane a pixel.
            let whole = end.min(masks.pixels / LANES * LANES);
            let step = |p0: usize, m: &[u16; TAPS], lanes: u16, acc: &mut [[__m512; GRAD_OUTS]; 3]| {
                let mut xv = [_mm512_setzero_ps(); 3];
                for (kx, v) in xv.iter_mut().enumerate() {
                    // SAFETY: the mask lets through taps inside the image only, so inside the row.
                    *v = unsafe {
                        _mm512_maskz_loadu_ps(
                            m[first + kx] & lanes,
                            x.wrapping_offset(p0 as isize + offsets[kx]),
                        )
                    };
                }
                for (r, dy) in dys.iter().enumerate() {
                    // SAFETY: the lanes below `pixels` only (the contract).
                    let d = unsafe { _mm512_maskz_loadu_ps(lanes, dy.add(p0)) };
                    for (a, x) in acc.iter_mut().zip(&xv) {
                        a[r] = _mm512_fmadd_ps(d, *x, a[r]);
                    }
                }
            };
            while p0 < whole {
                step(p0, &masks.table[row], u16::MAX, &mut acc);
                row += 1;
                if row == rows {
                    row = 0;
                }
                p0 += LANES;
            }
            if p0 < end {
                step(p0, &masks.table[row], masks.lanes(p0), &mut acc);
            }
            for (kx, a) in acc.iter().enumerate() {
                for (r, v) in a.iter().enumerate() {
                    // SAFETY: inside `sums` (the contract).
                    unsafe { _mm512_mask_storeu_ps(at.add((kx * GRAD_OUTS + r) * LANES), u16::MAX, *v) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_stride_one_windows_of_few_channels_fit() {
        let win = Window { channels: MAX_CHANNELS, height: 4, width: 4, kernel: 3, stride: 1, pad: 1 };
        assert!(fits(&win));
        assert!(!fits(&Window { stride: 2, ..win }));
        assert!(!fits(&Window { channels: MAX_CHANNELS + 1, ..win }));
        assert!(!fits(&Window { kernel: 5, pad: 2, ..win }));
    }
}
