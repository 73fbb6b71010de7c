//! Winograd F(2x2, 3x3) convolutions on the CPU (stride 1, padding 1): each 2x2 block of
//! outputs from a 4x4 block of inputs with 16 products per pair of channels instead of 36, the
//! products gathered into 16 GEMMs.
//!
//! With `d` a 4x4 block of inputs (zero outside the image), `g` a 3x3 window of weights and `y`
//! the 2x2 block of outputs it gives (Lavin and Gray, 2015):
//!
//! `y = Aᵀ [ (G g Gᵀ) ⊙ (Bᵀ d B) ] A`, where
//! `Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]`, `G = [1 0 0; ½ ½ ½; ½ -½ ½; 0 0 1]`,
//! `Aᵀ = [1 1 1 0; 0 1 -1 -1]`.
//!
//! Summed over the input channels, position `ξ` of the 16 is a GEMM: `M_ξ[o, t] = sum over c of
//! U_ξ[o, c] V_ξ[c, t]` over every block `t` of every sample. The passes:
//! - Forward: `V` from the input, `U` from the weights, 16 GEMMs, `y` from `M`.
//! - Input gradient: the forward pass over the output gradient with the weights turned by half a
//!   turn and the channels swapped (a 3x3 stride-1 padding-1 convolution's input gradient is one).
//! - Weight gradient: the forward pass's derivative, `dU_ξ = sum over t of (A dy_t Aᵀ)_ξ V_ξ[c,
//!   t]`, 16 GEMMs with the blocks as their inner dimension, then `dw = Gᵀ dU G`.
//!
//! The transforms add and halve only, and a GEMM sums 2.25 times fewer products than a column
//! matrix would, so results agree with the column-matrix path to rounding (tested to 1e-5 of the
//! largest value). The GEMMs and transforms split work by rows and channels, each value computed
//! in one order whatever the thread count.

use rayon::ThreadPool;
use rayon::prelude::*;

use super::backend::Window;
use super::cpu_gemm::gemm;
use super::cpu_layers::{Shared, need_conv};
use crate::error::Result;

/// Positions of a 4x4 block.
const POS: usize = 16;
/// Taps of a 3x3 window.
const TAPS: usize = 9;

/// The 2x2 blocks of outputs of a batch.
#[derive(Clone, Copy)]
struct Blocks {
    height: usize,
    width: usize,
    /// Blocks down and across one image.
    down: usize,
    across: usize,
    /// Blocks of the whole batch: `batch x down x across`, block `(n, i, j)` at
    /// `(n * down + i) * across + j`.
    count: usize,
}

impl Blocks {
    fn new(w: &Window, batch: usize) -> Self {
        let (down, across) = (w.height.div_ceil(2), w.width.div_ceil(2));
        Blocks { height: w.height, width: w.width, down, across, count: batch * down * across }
    }

    /// Pixels of a channel.
    fn pixels(&self) -> usize {
        self.count / (self.down * self.across) * self.height * self.width
    }
}

std::thread_local! {
    /// The transformed inputs, weights and products, kept between calls.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `f` over `len` values of scratch memory (their contents unspecified).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with_borrow_mut(|s| {
        if s.len() < len {
            *s = crate::heap::zeros(len);
        }
        f(&mut s[..len])
    })
}

/// Split `len` items into at most `parts` ranges for the pool's threads.
fn for_each_range(pool: Option<&ThreadPool>, len: usize, body: impl Fn(std::ops::Range<usize>) + Sync) {
    match pool {
        None => body(0..len),
        Some(p) => {
            // A few ranges per thread, so that an unlucky one does not hold the rest up.
            let parts = (p.current_num_threads() * 4).min(len).max(1);
            p.install(|| {
                (0..parts).into_par_iter().for_each(|i| body(len * i / parts..len * (i + 1) / parts))
            })
        }
    }
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
    need_conv(y, x, w, win, outs, batch, "convolution output", "convolution input")?;
    convolve(pool, y, x, w, false, win, win.channels, outs, batch, accumulate)
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
    need_conv(dy, dx, w, win, outs, batch, "convolution output gradient", "convolution input gradient")?;
    convolve(pool, dx, dy, w, true, win, outs, win.channels, batch, accumulate)
}

/// `dst (=|+=)` the convolution of `src` (`ins` channels) into `outs` channels with the
/// weights `w` as stored (`turned`: `w` is `ins x outs x 3 x 3`, used turned by half a turn,
/// which makes this the input gradient).
#[allow(clippy::too_many_arguments)]
fn convolve(
    pool: Option<&ThreadPool>,
    dst: &mut [f32],
    src: &[f32],
    w: &[f32],
    turned: bool,
    win: &Window,
    ins: usize,
    outs: usize,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let blocks = Blocks::new(win, batch);
    let t = blocks.count;
    let (u_len, v_len, m_len) = (POS * outs * ins, POS * ins * t, POS * outs * t);
    with_scratch(u_len + v_len + m_len, |scratch| {
        let (u, rest) = scratch.split_at_mut(u_len);
        let (v, m) = rest.split_at_mut(v_len);
        // `u[ξ][a][b]` for the weights as stored: `a` over `w`'s outputs, `b` over its inputs.
        let (w_outs, w_ins) = if turned { (ins, outs) } else { (outs, ins) };
        transform_weights(pool, w, w_outs, w_ins, u)?;
        transform_inputs(pool, src, ins, &blocks, v);
        for p in 0..POS {
            // Turned by half a turn, the window's transform has rows and columns 0 and 3
            // swapped (G R = S G, R reversing 3 values, S swapping the first and last of 4), and
            // its channels swapped: U'_ξ = (U_{S ξ})ᵀ.
            let from = if turned { SWAP[p / 4] * 4 + SWAP[p % 4] } else { p };
            gemm(
                pool,
                outs,
                t,
                ins,
                &u[from * outs * ins..][..outs * ins],
                turned,
                &v[p * ins * t..][..ins * t],
                false,
                &mut m[p * outs * t..][..outs * t],
                false,
            )?;
        }
        transform_outputs(pool, m, outs, &blocks, dst, accumulate);
        Ok(())
    })
}

/// `dw (=|+=)` the weight gradient of [`forward`]: `dw[o, c, ky, kx] = sum over pixels p of
/// dy[o, p] * x[c, p + tap]`.
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
    let blocks = Blocks::new(win, batch);
    let t = blocks.count;
    let (v_len, g_len, du_len) = (POS * ins * t, POS * outs * t, POS * outs * ins);
    with_scratch(v_len + g_len + du_len, |scratch| {
        let (v, rest) = scratch.split_at_mut(v_len);
        let (g, du) = rest.split_at_mut(g_len);
        transform_inputs(pool, x, ins, &blocks, v);
        transform_output_grads(pool, dy, outs, &blocks, g);
        for p in 0..POS {
            gemm(
                pool,
                outs,
                ins,
                t,
                &g[p * outs * t..][..outs * t],
                false,
                &v[p * ins * t..][..ins * t],
                true,
                &mut du[p * outs * ins..][..outs * ins],
                false,
            )?;
        }
        transform_weight_grads(pool, du, outs, ins, dw, accumulate)
    })
}

/// `u[ξ][o][c] = (G g Gᵀ)_ξ` for the window `g` of output `o` and input `c` of `w` (`outs x
/// ins x 3 x 3`): one GEMM, `u = T wᵀ` with [`weight_transform`] as `T`.
fn transform_weights(
    pool: Option<&ThreadPool>,
    w: &[f32],
    outs: usize,
    ins: usize,
    u: &mut [f32],
) -> Result<()> {
    gemm(pool, POS, outs * ins, TAPS, &weight_transform(), false, w, true, u, false)
}

/// `T[ξ][k] = G[r][ky] G[q][kx]` for `ξ = (r, q)` and tap `k = (ky, kx)`: `(G g Gᵀ)_ξ = sum
/// over k of T[ξ][k] g_k`, and `(Gᵀ dU G)_k = sum over ξ of T[ξ][k] dU_ξ`.
fn weight_transform() -> [f32; POS * TAPS] {
    const G: [[f32; 3]; 4] = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]];
    std::array::from_fn(|i| {
        let (p, k) = (i / TAPS, i % TAPS);
        G[p / 4][k / 3] * G[p % 4][k % 3]
    })
}

/// Positions 0 and 3 of a side of a block swapped (see [`convolve`]).
const SWAP: [usize; 4] = [3, 1, 2, 0];

/// `v[ξ][c][t] = (Bᵀ d B)_ξ` for the 4x4 block of inputs `d` of each output block `t` of each
/// channel `c` of `x` (zero outside the image): a row of blocks at a time, each of its four
/// input rows copied with a zero on either side, transformed across, then down.
fn transform_inputs(pool: Option<&ThreadPool>, x: &[f32], chans: usize, b: &Blocks, v: &mut [f32]) {
    let (t, plane, pixels, across) = (b.count, b.height * b.width, b.pixels(), b.across);
    let out = Shared(v.as_mut_ptr());
    let b = *b;
    // Input column s at padded index s + 1; 2 across + 2 values cover every block's four.
    let padded = 2 * across + 2;
    for_each_range(pool, chans, |range| {
        let mut rows = vec![0f32; 4 * padded];
        // Across: [input row][position q][block j].
        let mut h = vec![0f32; 4 * 4 * across];
        for c in range {
            let xc = &x[c * pixels..][..pixels];
            for (n, image) in xc.chunks_exact(plane).enumerate() {
                for i in 0..b.down {
                    for (a, row) in rows.chunks_exact_mut(padded).enumerate() {
                        let r = (2 * i + a).wrapping_sub(1);
                        if r < b.height {
                            row[1..=b.width].copy_from_slice(&image[r * b.width..][..b.width]);
                            row[b.width + 1..].fill(0.0);
                        } else {
                            row.fill(0.0);
                        }
                        row[0] = 0.0;
                        let h = &mut h[a * 4 * across..][..4 * across];
                        let (h0, rest) = h.split_at_mut(across);
                        let (h1, rest) = rest.split_at_mut(across);
                        let (h2, h3) = rest.split_at_mut(across);
                        for j in 0..across {
                            let (d0, d1, d2, d3) =
                                (row[2 * j], row[2 * j + 1], row[2 * j + 2], row[2 * j + 3]);
                            h0[j] = d0 - d2;
                            h1[j] = d1 + d2;
                            h2[j] = d2 - d1;
                            h3[j] = d1 - d3;
                        }
                    }
                    let first = (n * b.down + i) * across;
                    for q in 0..4 {
                        let at = |a: usize| &h[(a * 4 + q) * across..][..across];
                        let (e0, e1, e2, e3) = (at(0), at(1), at(2), at(3));
                        // SAFETY: blocks `first..first + across` of channel c at positions
                        // (r, q) lie inside `v` (16 x chans x t), and only this channel's range
                        // writes them.
                        let run = |r: usize| unsafe {
                            std::slice::from_raw_parts_mut(
                                out.at(((r * 4 + q) * chans + c) * t + first),
                                across,
                            )
                        };
                        let (v0, v1, v2, v3) = (run(0), run(1), run(2), run(3));
                        for j in 0..across {
                            v0[j] = e0[j] - e2[j];
                            v1[j] = e1[j] + e2[j];
                            v2[j] = e2[j] - e1[j];
                            v3[j] = e1[j] - e3[j];
                        }
                    }
                }
            }
        }
    });
}

/// `dst[o] (=|+=) Aᵀ M A` for each output block of each channel, from `m[ξ][o][t]`, the blocks'
/// values outside the image dropped: a row of blocks at a time, down then across.
fn transform_outputs(
    pool: Option<&ThreadPool>,
    m: &[f32],
    outs: usize,
    b: &Blocks,
    dst: &mut [f32],
    accumulate: bool,
) {
    let (t, plane, pixels, across) = (b.count, b.height * b.width, b.pixels(), b.across);
    let out = Shared(dst.as_mut_ptr());
    let b = *b;
    for_each_range(pool, outs, |range| {
        // Two output rows of 2 across values each.
        let mut rows = vec![0f32; 2 * 2 * across];
        for o in range {
            for n in 0..t / (b.down * across) {
                for i in 0..b.down {
                    let first = (n * b.down + i) * across;
                    let (top, bottom) = rows.split_at_mut(2 * across);
                    for q in 0..4 {
                        let run = |r: usize| &m[((r * 4 + q) * outs + o) * t + first..][..across];
                        let (m0, m1, m2, m3) = (run(0), run(1), run(2), run(3));
                        // Aᵀ M: rows 0 and 1, column q, for every block of the row.
                        for j in 0..across {
                            let (s0, s1) = (m0[j] + m1[j] + m2[j], m1[j] - m2[j] - m3[j]);
                            // (Aᵀ M) A: column q adds into output column 0 (q < 3) and 1 (q > 0).
                            for (row, s) in [(&mut *top, s0), (&mut *bottom, s1)] {
                                match q {
                                    0 => row[2 * j] = s,
                                    1 => {
                                        row[2 * j] += s;
                                        row[2 * j + 1] = s;
                                    }
                                    2 => {
                                        row[2 * j] += s;
                                        row[2 * j + 1] -= s;
                                    }
                                    _ => row[2 * j + 1] -= s,
                                }
                            }
                        }
                    }
                    for (a, row) in [&*top, &*bottom].into_iter().enumerate() {
                        let r = 2 * i + a;
                        if r >= b.height {
                            continue;
                        }
                        // SAFETY: row r of image n of channel o lies inside `dst` (`check`), and
                        // only this channel's range writes it.
                        let y = unsafe {
                            std::slice::from_raw_parts_mut(
                                out.at(o * pixels + n * plane + r * b.width),
                                b.width,
                            )
                        };
                        if accumulate {
                            y.iter_mut().zip(&row[..b.width]).for_each(|(y, v)| *y += v);
                        } else {
                            y.copy_from_slice(&row[..b.width]);
                        }
                    }
                }
            }
        }
    });
}

/// `g[ξ][o][t] = (A dy Aᵀ)_ξ` for the 2x2 block of output gradients `dy` of each block `t` of each
/// channel `o` (zero outside the image).
fn transform_output_grads(pool: Option<&ThreadPool>, dy: &[f32], outs: usize, b: &Blocks, g: &mut [f32]) {
    let (t, plane, pixels, across) = (b.count, b.height * b.width, b.pixels(), b.across);
    let out = Shared(g.as_mut_ptr());
    let b = *b;
    for_each_range(pool, outs, |range| {
        // The block row's two rows of output gradients, 2 across values each (zero past the
        // image), and A applied down: [position r][column of the block][block j].
        let mut rows = vec![0f32; 2 * 2 * across];
        let mut down = vec![0f32; 4 * 2 * across];
        for o in range {
            for n in 0..t / (b.down * across) {
                for i in 0..b.down {
                    for (a, row) in rows.chunks_exact_mut(2 * across).enumerate() {
                        let r = 2 * i + a;
                        if r < b.height {
                            row[..b.width]
                                .copy_from_slice(&dy[o * pixels + n * plane + r * b.width..][..b.width]);
                            row[b.width..].fill(0.0);
                        } else {
                            row.fill(0.0);
                        }
                    }
                    let (top, bottom) = rows.split_at(2 * across);
                    for (k, (d0, d1)) in top.iter().zip(bottom).enumerate() {
                        down[k] = *d0;
                        down[2 * across + k] = d0 + d1;
                        down[4 * across + k] = d0 - d1;
                        down[6 * across + k] = -d1;
                    }
                    let first = (n * b.down + i) * across;
                    for r in 0..4 {
                        let d = &down[r * 2 * across..][..2 * across];
                        // SAFETY: blocks `first..first + across` of channel o at positions
                        // (r, q) lie inside `g`, and only this channel's range writes them.
                        let run = |q: usize| unsafe {
                            std::slice::from_raw_parts_mut(
                                out.at(((r * 4 + q) * outs + o) * t + first),
                                across,
                            )
                        };
                        let (g0, g1, g2, g3) = (run(0), run(1), run(2), run(3));
                        for j in 0..across {
                            let (a0, a1) = (d[2 * j], d[2 * j + 1]);
                            g0[j] = a0;
                            g1[j] = a0 + a1;
                            g2[j] = a0 - a1;
                            g3[j] = -a1;
                        }
                    }
                }
            }
        }
    });
}

/// `dw[o][c] (=|+=) Gᵀ dU G` from `du[ξ][o][c]`: one GEMM, `dw = duᵀ T` with
/// [`weight_transform`] as `T`.
fn transform_weight_grads(
    pool: Option<&ThreadPool>,
    du: &[f32],
    outs: usize,
    ins: usize,
    dw: &mut [f32],
    accumulate: bool,
) -> Result<()> {
    gemm(pool, outs * ins, TAPS, POS, du, true, &weight_transform(), false, dw, accumulate)
}
