//! The CPU device: GEMMs through the `gemm` crate (runtime-dispatched AVX2/AVX-512/NEON
//! kernels), elementwise work through rayon, all inside one thread pool of `--threads` threads.
//! With one thread there is no pool: every kernel runs on the calling thread, as PyTorch's do,
//! rather than handing each one to a pool thread and sleeping until it is done (two wake-ups
//! per kernel, about twenty kernels per step, each a scheduling delay on a busy machine).

use std::ops::Range;

use rayon::prelude::*;

use super::backend::{BIAS_GRAD_ROWS, Backend, ChannelSum, NormConfig, Window, bias_grad_passes};
#[cfg(target_arch = "x86_64")]
use super::cpu_conv as conv;
use super::cpu_gemm;
use super::cpu_layers::{self as layers, CHUNK};
use super::cpu_winograd as winograd;
use crate::error::{Error, Result};
use crate::optim::{SgdConfig, sgd_block, sgd_step};

/// The CPU backend.
#[derive(Debug)]
pub struct Cpu {
    threads: usize,
    /// `None` with one thread: kernels run on the caller.
    pool: Option<rayon::ThreadPool>,
    /// How 3x3 stride-1 convolutions are computed ([`CPU_CONV_VAR`]).
    conv: ConvChoice,
}

/// The variable that chooses how the CPU computes 3x3 stride-1 padding-1 convolutions: `auto`
/// (the default: Winograd from [`WINOGRAD_FROM`] input channels, the direct kernels below where
/// the CPU has AVX-512F, a column matrix elsewhere), `direct` (the direct kernels wherever they
/// apply), `winograd` (Winograd F(2x2, 3x3) for every such window) or `columns` (a column matrix
/// and a GEMM, as for every other window).
pub const CPU_CONV_VAR: &str = "GRADSYNC_CPU_CONV";

/// The fewest input channels for which `auto` computes a 3x3 convolution with Winograd rather
/// than the direct kernels. Measured at batch 64, forward and both gradients, one thread
/// (docs/benchmarks.md): 64 channels at 32x32 level with the direct kernels (its 16 GEMMs are
/// only 64 deep, and their 4x larger operands go to memory), 128 at 16x16 1.3x faster, 256 at
/// 8x8 1.5x; 512 at 4x4 1.6x faster than the column matrix, at 2x2 1.1x.
pub const WINOGRAD_FROM: usize = 128;

/// The smallest height and width for which `auto` uses Winograd: on a 1x1 image a 4x4 block
/// of inputs holds one pixel (16 products for one output, against 9 directly). At 2x2, three
/// quarters of each block are padding and Winograd still measured 1.1x the column matrix (512
/// channels, one and two threads).
const WINOGRAD_SIDE: usize = 2;

/// The share of a direct convolution's multiply-adds that the CPU performs for a window like
/// `w` under [`CPU_CONV_VAR`]'s choice: 1 for the direct kernels and the column matrix; for
/// Winograd F(2x2, 3x3), 16 products per 2x2 block of outputs against 9 per output (4/9 where
/// the sides are even). An error names a bad value of the variable.
pub fn cpu_conv_products(w: &Window) -> Result<f64> {
    let cpu = Cpu { threads: 1, pool: None, conv: conv_chosen(std::env::var(CPU_CONV_VAR).ok().as_deref())? };
    Ok(match cpu.conv_method(w) {
        ConvMethod::Winograd => {
            let blocks = w.height.div_ceil(2) * w.width.div_ceil(2);
            16.0 * blocks as f64 / (9.0 * (w.height * w.width) as f64)
        }
        ConvMethod::Direct | ConvMethod::Columns => 1.0,
    })
}

/// What [`CPU_CONV_VAR`] chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConvChoice {
    Auto,
    Direct,
    Winograd,
    Columns,
}

/// How one convolution is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConvMethod {
    Direct,
    Winograd,
    Columns,
}

impl Cpu {
    /// A CPU device with its own pool of `threads` threads (0: one per core).
    pub fn new(threads: usize) -> Result<Self> {
        // The gemm crate allocates its packing buffers inside every call.
        crate::heap::keep_freed_memory();
        let threads =
            if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("gradsync-cpu-{i}"))
                    .build()
                    .map_err(|e| Error::invalid("threads", e.to_string()))
            })
            .transpose()?;
        let conv = conv_chosen(std::env::var(CPU_CONV_VAR).ok().as_deref())?;
        Ok(Cpu { threads, pool, conv })
    }

    /// A CPU device as [`Cpu::new`], computing 3x3 stride-1 convolutions the way `conv` names
    /// (a value of [`CPU_CONV_VAR`]) whatever the variable says; a bad name is refused.
    pub fn with_conv(threads: usize, conv: &str) -> Result<Self> {
        let conv = conv_chosen(Some(conv))?;
        Ok(Cpu { conv, ..Cpu::new(threads)? })
    }

    /// How a convolution over `w` is computed here.
    fn conv_method(&self, w: &Window) -> ConvMethod {
        let winograd = winograd_fits(w);
        let direct = direct_conv_available() && direct_conv_fits(w);
        match self.conv {
            ConvChoice::Auto
                if winograd && w.channels >= WINOGRAD_FROM && w.height.min(w.width) >= WINOGRAD_SIDE =>
            {
                ConvMethod::Winograd
            }
            ConvChoice::Auto | ConvChoice::Direct if direct => ConvMethod::Direct,
            ConvChoice::Winograd if winograd => ConvMethod::Winograd,
            _ => ConvMethod::Columns,
        }
    }

    /// The pool's size.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Labels = Vec<u32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn describe(&self) -> String {
        format!("cpu ({} thread{})", self.threads, if self.threads == 1 { "" } else { "s" })
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>> {
        Ok(crate::heap::zeros(n))
    }

    fn upload(&self, src: Vec<f32>) -> Result<Vec<f32>> {
        Ok(src)
    }

    fn write(&self, dst: &mut Vec<f32>, offset: usize, src: &[f32]) -> Result<()> {
        dst[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read(&self, src: &Vec<f32>, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        dst.copy_from_slice(&src[range]);
        Ok(())
    }

    fn write_labels(&self, dst: &mut Option<Vec<u32>>, src: &[u32]) -> Result<()> {
        let d = dst.get_or_insert_with(Vec::new);
        d.clear();
        d.extend_from_slice(src);
        Ok(())
    }

    fn view(buf: &Vec<f32>, range: Range<usize>) -> &[f32] {
        &buf[range]
    }

    fn view_mut(buf: &mut Vec<f32>, range: Range<usize>) -> &mut [f32] {
        &mut buf[range]
    }

    fn split_at<'a>(view: &'a mut [f32], mid: usize) -> (&'a mut [f32], &'a mut [f32])
    where
        Self: 'a,
    {
        view.split_at_mut(mid)
    }

    fn sub<'b>(view: &'b mut &mut [f32], range: Range<usize>) -> &'b mut [f32] {
        &mut view[range]
    }

    fn as_view<'b>(view: &'b &mut [f32]) -> &'b [f32] {
        view
    }

    fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        ta: bool,
        b: &[f32],
        tb: bool,
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<()> {
        cpu_gemm::gemm(self.pool.as_ref(), m, n, k, a, ta, b, tb, c, accumulate)
    }

    fn bias_act(&self, z: &mut [f32], bias: &[f32], rows: usize, cols: usize, relu: bool) -> Result<()> {
        debug_assert_eq!(z.len(), rows * cols);
        let body = |block: &mut [f32]| {
            for row in block.chunks_exact_mut(cols) {
                for (v, &b) in row.iter_mut().zip(bias) {
                    let x = *v + b;
                    *v = if relu { x.max(0.0) } else { x };
                }
            }
        };
        let rows_per = (CHUNK / cols.max(1)).max(1);
        match &self.pool {
            None => body(z),
            Some(pool) => pool.install(|| z.par_chunks_mut(rows_per * cols).for_each(body)),
        }
        Ok(())
    }

    fn relu_backward(&self, dz: &mut [f32], a: &[f32]) -> Result<()> {
        let body = |(d, a): (&mut [f32], &[f32])| {
            // A select and a store for every element, not a branch around the store: the
            // compiler vectorises this form (the branch cost about 1 ms per mnist step).
            for (d, &a) in d.iter_mut().zip(a) {
                *d = if a <= 0.0 { 0.0 } else { *d };
            }
        };
        match &self.pool {
            None => body((dz, a)),
            Some(pool) => pool.install(|| dz.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK)).for_each(body)),
        }
        Ok(())
    }

    fn bias_grad(
        &self,
        db: &mut [f32],
        dz: &[f32],
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<()> {
        if db.len() < cols || dz.len() < rows * cols {
            return Err(Error::Length { what: "bias_grad", expected: rows * cols, got: dz.len() });
        }
        let (db, dz) = (&mut db[..cols], &dz[..rows * cols]);
        if cols == 0 {
            return Ok(());
        }
        // The groups of BIAS_GRAD_ROWS rows (backend.rs), each summed from zero in row order,
        // over the pool's threads; their sums grouped again until one group is left. The
        // order depends on the rows only, never on the thread count.
        let mut sums: Option<Vec<f32>> = None;
        for groups in bias_grad_passes(rows) {
            let rows_in = sums.as_deref().unwrap_or(dz);
            let mut next = vec![0.0; groups * cols];
            let body = |(out, src): (&mut [f32], &[f32])| {
                for row in src.chunks_exact(cols) {
                    for (d, &g) in out.iter_mut().zip(row) {
                        *d += g;
                    }
                }
            };
            let group = BIAS_GRAD_ROWS * cols;
            match &self.pool {
                None => next.chunks_mut(cols).zip(rows_in.chunks(group)).for_each(body),
                Some(pool) => {
                    pool.install(|| next.par_chunks_mut(cols).zip(rows_in.par_chunks(group)).for_each(body))
                }
            }
            sums = Some(next);
        }
        let rows_left = sums.as_deref().unwrap_or(dz);
        if !accumulate {
            db.fill(0.0);
        }
        for row in rows_left.chunks_exact(cols) {
            for (d, &g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
        Ok(())
    }

    fn softmax_xent(
        &self,
        logits: &[f32],
        labels: &Vec<u32>,
        dlogits: Option<&mut [f32]>,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<(f64, u64)> {
        let mut loss = 0.0f64;
        let mut correct = 0u64;
        let mut dl = dlogits;
        for (i, z) in logits.chunks_exact(cols).take(rows).enumerate() {
            let y = labels[i] as usize;
            let (arg, max) = z
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(ai, m), (j, &v)| if v > m { (j, v) } else { (ai, m) });
            let sum: f32 = z.iter().map(|&v| (v - max).exp()).sum();
            loss += f64::from(sum.ln() - (z[y] - max));
            correct += u64::from(arg == y);
            if let Some(d) = dl.as_deref_mut() {
                let row = &mut d[i * cols..(i + 1) * cols];
                let inv = 1.0 / sum;
                for (j, (o, &v)) in row.iter_mut().zip(z).enumerate() {
                    let p = (v - max).exp() * inv;
                    *o = scale * (p - if j == y { 1.0 } else { 0.0 });
                }
            }
        }
        Ok((loss, correct))
    }

    fn sgd(
        &self,
        cfg: &SgdConfig,
        params: &mut [f32],
        grads: &[f32],
        momentum: &mut [f32],
        grad_scale: f32,
    ) -> Result<()> {
        match &self.pool {
            None => sgd_block(cfg, params, grads, momentum, grad_scale),
            Some(pool) => pool.install(|| sgd_step(cfg, params, grads, momentum, grad_scale)),
        }
        Ok(())
    }

    fn bag_forward(
        &self,
        y: &mut [f32],
        table: &[f32],
        off: &Vec<u32>,
        ids: &Vec<u32>,
        w: &[f32],
        batch: usize,
        dim: usize,
    ) -> Result<()> {
        layers::bag_forward(self.pool.as_ref(), y, table, off, ids, w, batch, dim)
    }

    fn bag_backward(
        &self,
        grad: &mut [f32],
        dy: &[f32],
        rows: &Vec<u32>,
        off: &Vec<u32>,
        samples: &Vec<u32>,
        w: &[f32],
        count: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        layers::bag_backward(grad, dy, rows, off, samples, w, count, dim, accumulate)
    }

    fn zero_rows(&self, v: &mut [f32], rows: Option<&Vec<u32>>, count: usize, dim: usize) -> Result<()> {
        match rows {
            None => {
                layers::need("zero_rows", v.len(), count * dim)?;
                layers::for_each_chunk(self.pool.as_ref(), &mut v[..count * dim], CHUNK, |_, c| c.fill(0.0));
                Ok(())
            }
            Some(r) => layers::for_rows(v, Some(&r[..count]), dim, |_, row| row.fill(0.0)),
        }
    }

    fn sgd_rows(
        &self,
        cfg: &SgdConfig,
        params: &mut [f32],
        grads: &[f32],
        momentum: &mut [f32],
        rows: Option<&Vec<u32>>,
        count: usize,
        dim: usize,
        grad_scale: f32,
    ) -> Result<()> {
        layers::need("table momentum", momentum.len(), params.len())?;
        layers::need("table gradient", grads.len(), params.len())?;
        let rows = rows.map(|r| &r[..count]);
        if rows.is_none() {
            layers::need("sgd_rows", params.len(), count * dim)?;
        }
        let Some(rows) = rows else {
            // Every row (a table whose gradient came from outside): the rows in parallel
            // blocks, each row stepped or left as one, so the result is the thread count's
            // to choose only in speed.
            let span = count * dim;
            let block = (CHUNK / dim).max(1) * dim;
            let body = |((p, g), m): ((&mut [f32], &[f32]), &mut [f32])| {
                for ((p, g), m) in
                    p.chunks_exact_mut(dim).zip(g.chunks_exact(dim)).zip(m.chunks_exact_mut(dim))
                {
                    crate::optim::sgd_row(cfg, p, g, m, grad_scale);
                }
            };
            let (p, g, m) = (&mut params[..span], &grads[..span], &mut momentum[..span]);
            match &self.pool {
                None => p.chunks_mut(block).zip(g.chunks(block)).zip(m.chunks_mut(block)).for_each(body),
                Some(pool) => pool.install(|| {
                    p.par_chunks_mut(block)
                        .zip(g.par_chunks(block))
                        .zip(m.par_chunks_mut(block))
                        .for_each(body)
                }),
            }
            return Ok(());
        };
        layers::for_rows(params, Some(rows), dim, |r, p| {
            let at = r * dim..(r + 1) * dim;
            crate::optim::sgd_row(cfg, p, &grads[at.clone()], &mut momentum[at], grad_scale);
        })
    }

    fn scale(&self, v: &mut [f32], factor: f32) -> Result<()> {
        let body = |c: &mut [f32]| c.iter_mut().for_each(|x| *x *= factor);
        match &self.pool {
            None => body(v),
            Some(pool) => pool.install(|| v.par_chunks_mut(CHUNK).for_each(body)),
        }
        Ok(())
    }

    fn relu(&self, v: &mut [f32]) -> Result<()> {
        layers::relu(self.pool.as_ref(), v);
        Ok(())
    }

    fn add_into(&self, y: &mut [f32], x: &[f32], accumulate: bool) -> Result<()> {
        layers::add_into(self.pool.as_ref(), y, x, accumulate)
    }

    fn swap_axes(
        &self,
        dst: &mut [f32],
        src: &[f32],
        outer: usize,
        middle: usize,
        inner: usize,
        accumulate: bool,
    ) -> Result<()> {
        layers::swap_axes(self.pool.as_ref(), dst, src, (outer, middle, inner), accumulate)
    }

    fn im2col(&self, col: &mut [f32], x: &[f32], w: &Window, batch: usize) -> Result<()> {
        layers::im2col(self.pool.as_ref(), col, x, w, batch)
    }

    fn col2im(&self, dx: &mut [f32], col: &[f32], w: &Window, batch: usize, accumulate: bool) -> Result<()> {
        layers::col2im(self.pool.as_ref(), dx, col, w, batch, accumulate)
    }

    fn direct_conv(&self, w: &Window) -> bool {
        self.conv_method(w) != ConvMethod::Columns
    }

    fn conv(
        &self,
        y: &mut [f32],
        x: &[f32],
        weight: &[f32],
        w: &Window,
        outs: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let pool = self.pool.as_ref();
        match self.conv_method(w) {
            ConvMethod::Winograd => winograd::forward(pool, y, x, weight, w, outs, batch, accumulate),
            #[cfg(target_arch = "x86_64")]
            ConvMethod::Direct => conv::forward(pool, y, x, weight, w, outs, batch, accumulate),
            _ => Err(super::backend::no_direct_conv(w)),
        }
    }

    fn conv_input_grad(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        weight: &[f32],
        w: &Window,
        outs: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let pool = self.pool.as_ref();
        match self.conv_method(w) {
            ConvMethod::Winograd => winograd::input_grad(pool, dx, dy, weight, w, outs, batch, accumulate),
            #[cfg(target_arch = "x86_64")]
            ConvMethod::Direct => conv::input_grad(pool, dx, dy, weight, w, outs, batch, accumulate),
            _ => Err(super::backend::no_direct_conv(w)),
        }
    }

    fn conv_weight_grad(
        &self,
        dweight: &mut [f32],
        dy: &[f32],
        x: &[f32],
        w: &Window,
        outs: usize,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let pool = self.pool.as_ref();
        match self.conv_method(w) {
            ConvMethod::Winograd => winograd::weight_grad(pool, dweight, dy, x, w, outs, batch, accumulate),
            #[cfg(target_arch = "x86_64")]
            ConvMethod::Direct => conv::weight_grad(pool, dweight, dy, x, w, outs, batch, accumulate),
            _ => Err(super::backend::no_direct_conv(w)),
        }
    }

    fn max_pool(&self, y: &mut [f32], x: &[f32], w: &Window) -> Result<()> {
        layers::max_pool(self.pool.as_ref(), y, x, w)
    }

    fn max_pool_backward(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        x: &[f32],
        w: &Window,
        accumulate: bool,
    ) -> Result<()> {
        layers::max_pool_backward(self.pool.as_ref(), dx, dy, x, w, accumulate)
    }

    fn avg_pool(&self, y: &mut [f32], x: &[f32], channels: usize, batch: usize, pixels: usize) -> Result<()> {
        layers::avg_pool(self.pool.as_ref(), y, x, (channels, batch, pixels))
    }

    fn avg_pool_backward(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        channels: usize,
        batch: usize,
        pixels: usize,
        accumulate: bool,
    ) -> Result<()> {
        layers::avg_pool_backward(self.pool.as_ref(), dx, dy, (channels, batch, pixels), accumulate)
    }

    fn channel_sums(
        &self,
        out: &mut [f32],
        a: &[f32],
        what: ChannelSum<&[f32]>,
        channels: usize,
        m: usize,
    ) -> Result<()> {
        layers::channel_sums(self.pool.as_ref(), out, a, what, channels, m)
    }

    fn norm_stats(
        &self,
        saved: &mut [f32],
        running: &mut [f32],
        channels: usize,
        count: usize,
        train: bool,
        cfg: &NormConfig,
    ) -> Result<()> {
        layers::norm_stats(saved, running, channels, count, train, cfg)
    }

    fn norm_apply(
        &self,
        y: &mut [f32],
        x: &[f32],
        saved: &[f32],
        affine: &[f32],
        channels: usize,
        m: usize,
    ) -> Result<()> {
        layers::norm_apply(self.pool.as_ref(), y, x, saved, affine, (channels, m))
    }

    fn norm_backward(
        &self,
        dx: Option<&mut [f32]>,
        d_affine: Option<&mut [f32]>,
        dy: &[f32],
        x: &[f32],
        saved: &[f32],
        affine: &[f32],
        sums: &[f32],
        channels: usize,
        m: usize,
        count: usize,
        accumulate: bool,
        accumulate_dx: bool,
    ) -> Result<()> {
        layers::norm_backward(
            self.pool.as_ref(),
            dx,
            d_affine,
            dy,
            x,
            saved,
            affine,
            sums,
            (channels, m, count),
            (accumulate, accumulate_dx),
        )
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// What [`CPU_CONV_VAR`]'s value chooses.
fn conv_chosen(var: Option<&str>) -> Result<ConvChoice> {
    match var {
        None | Some("auto") => Ok(ConvChoice::Auto),
        Some("direct") => Ok(ConvChoice::Direct),
        Some("winograd") => Ok(ConvChoice::Winograd),
        Some("columns") => Ok(ConvChoice::Columns),
        Some(other) => Err(Error::invalid(
            CPU_CONV_VAR,
            format!("{other:?} is not a way to compute convolutions: use auto, direct, winograd or columns"),
        )),
    }
}

/// Whether Winograd F(2x2, 3x3) computes windows like `w`: 3x3, stride 1, padding 1.
fn winograd_fits(w: &Window) -> bool {
    w.kernel == 3 && w.stride == 1 && w.pad == 1
}

/// Whether this CPU has the direct convolutions' instructions.
fn direct_conv_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return conv::available();
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Whether the direct convolutions compute windows like `w`.
fn direct_conv_fits(w: &Window) -> bool {
    #[cfg(target_arch = "x86_64")]
    return conv::fits(w);
    #[cfg(not(target_arch = "x86_64"))]
    return {
        let _ = w;
        false
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// C = op(A) op(B) (+ C) by the definition, in f64.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        ta: bool,
        b: &[f32],
        tb: bool,
        c: &mut [f32],
        acc: bool,
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut s = if acc { f64::from(c[i * n + j]) } else { 0.0 };
                for p in 0..k {
                    let x = if ta { a[p * m + i] } else { a[i * k + p] };
                    let y = if tb { b[j * k + p] } else { b[p * n + j] };
                    s += f64::from(x) * f64::from(y);
                }
                c[i * n + j] = s as f32;
            }
        }
    }

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

    /// The ways without a column matrix this CPU has: Winograd, and the direct kernels with
    /// AVX-512F.
    fn without_columns() -> Vec<ConvChoice> {
        let mut choices = vec![ConvChoice::Winograd];
        if direct_conv_available() {
            choices.push(ConvChoice::Direct);
        }
        choices
    }

    /// The three passes of the direct kernels and of Winograd against the column matrix and the
    /// GEMM, on shapes with planes of whole vectors and not (35 pixels, 4, 1; odd heights and
    /// widths, whose last 2x2 blocks are cut), output channels not a multiple of 8, odd pairs,
    /// several blocks and groups of the direct weight gradient, and added to what is there; the
    /// same bits on one thread and two.
    #[test]
    fn convolutions_without_columns_match_the_column_matrix() {
        let columns = Cpu { threads: 1, pool: None, conv: ConvChoice::Columns };
        let choices = without_columns();
        if !choices.contains(&ConvChoice::Direct) {
            eprintln!(
                "SKIPPED the direct kernels (no AVX-512F on this CPU) [convolutions_without_columns_match_the_column_matrix]"
            );
        }
        for choice in choices {
            let one = Cpu { conv: choice, ..Cpu::new(1).unwrap() };
            let two = Cpu { conv: choice, ..Cpu::new(2).unwrap() };
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
                // Several blocks of pixels (the last one short) and groups of tasks.
                (64, 72, 16, 16, 9),
                // Wide: the direct kernels up to their 256 channels, and Winograd where `auto` uses it.
                (256, 24, 6, 6, 3),
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
                columns.im2col(&mut col, &x, &win, batch).unwrap();
                let case = format!("{choice:?}: {ins} -> {outs} channels, {height}x{width}, batch {batch}");
                for acc in [false, true] {
                    let same = |what: &str, got: &[f32], want: &[f32], par: &[f32]| {
                        assert!(rel(got, want) < 1e-5, "{case} {what} (acc {acc}): {:.2e}", rel(got, want));
                        assert_eq!(par, got, "{case}: {what} on two threads");
                    };
                    // Forward.
                    let mut want = start_y.clone();
                    columns.gemm(outs, cols, k, &w, false, &col, false, &mut want, acc).unwrap();
                    let mut got = start_y.clone();
                    one.conv(&mut got, &x, &w, &win, outs, batch, acc).unwrap();
                    let mut par = start_y.clone();
                    two.conv(&mut par, &x, &w, &win, outs, batch, acc).unwrap();
                    same("forward", &got, &want, &par);
                    // Input gradient.
                    let mut g = vec![0.0; k * cols];
                    columns.gemm(k, cols, outs, &w, true, &dy, false, &mut g, false).unwrap();
                    let mut want = start_x.clone();
                    columns.col2im(&mut want, &g, &win, batch, acc).unwrap();
                    let mut got = start_x.clone();
                    one.conv_input_grad(&mut got, &dy, &w, &win, outs, batch, acc).unwrap();
                    let mut par = start_x.clone();
                    two.conv_input_grad(&mut par, &dy, &w, &win, outs, batch, acc).unwrap();
                    same("input gradient", &got, &want, &par);
                    // Weight gradient.
                    let mut want = start_w.clone();
                    columns.gemm(outs, k, cols, &dy, false, &col, true, &mut want, acc).unwrap();
                    let mut got = start_w.clone();
                    one.conv_weight_grad(&mut got, &dy, &x, &win, outs, batch, acc).unwrap();
                    let mut par = start_w.clone();
                    two.conv_weight_grad(&mut par, &dy, &x, &win, outs, batch, acc).unwrap();
                    same("weight gradient", &got, &want, &par);
                }
            }
        }
    }

    /// Views shorter than the shapes say are refused by name, and so is a window neither way
    /// computes, by both ways.
    #[test]
    fn short_views_and_other_windows_are_refused() {
        let win = Window { channels: 2, height: 4, width: 4, kernel: 3, stride: 1, pad: 1 };
        let strided = Window { stride: 2, ..win };
        let (x, w) = (vec![0.0; 2 * 16], vec![0.0; 3 * 2 * 9]);
        for choice in without_columns() {
            let cpu = Cpu { threads: 1, pool: None, conv: choice };
            let e = cpu.conv(&mut [0.0; 3 * 16 - 1], &x, &w, &win, 3, 1, false).unwrap_err().to_string();
            assert!(e.contains("convolution output"), "{choice:?}: {e}");
            let e = cpu
                .conv_input_grad(&mut [0.0; 2 * 16], &[0.0; 3 * 16], &w, &win, 3, 2, false)
                .unwrap_err()
                .to_string();
            assert!(e.contains("convolution output gradient"), "{choice:?}: {e}");
            let e = cpu
                .conv_weight_grad(&mut [0.0; 5], &[0.0; 48], &x, &win, 3, 1, false)
                .unwrap_err()
                .to_string();
            assert!(e.contains("convolution weights"), "{choice:?}: {e}");
            let e = cpu.conv(&mut [0.0; 3 * 4], &x, &w, &strided, 3, 1, false).unwrap_err().to_string();
            assert!(e.contains("stride 2"), "{choice:?}: {e}");
        }
    }

    #[test]
    fn winograd_counts_16_products_a_block_of_four_outputs() {
        let even = Window { channels: 2 * WINOGRAD_FROM, height: 8, width: 8, kernel: 3, stride: 1, pad: 1 };
        let odd = Window { height: 5, width: 7, ..even };
        let small = Window { channels: 3, ..even };
        let winograd = |w: &Window| Cpu { threads: 1, pool: None, conv: ConvChoice::Auto }.conv_method(w);
        assert_eq!(winograd(&even), ConvMethod::Winograd);
        if std::env::var_os(CPU_CONV_VAR).is_none() {
            assert!((cpu_conv_products(&even).unwrap() - 4.0 / 9.0).abs() < 1e-12);
            // 3 x 4 blocks for 35 outputs.
            assert!((cpu_conv_products(&odd).unwrap() - 16.0 * 12.0 / (9.0 * 35.0)).abs() < 1e-12);
            assert_eq!(cpu_conv_products(&small).unwrap(), 1.0);
        }
    }

    #[test]
    fn the_convolution_variable_is_read_or_refused_by_name() {
        assert_eq!(conv_chosen(None).unwrap(), ConvChoice::Auto);
        for (name, choice) in [
            ("auto", ConvChoice::Auto),
            ("direct", ConvChoice::Direct),
            ("winograd", ConvChoice::Winograd),
            ("columns", ConvChoice::Columns),
        ] {
            assert_eq!(conv_chosen(Some(name)).unwrap(), choice);
        }
        let e = conv_chosen(Some("fft")).unwrap_err().to_string();
        assert!(e.contains(CPU_CONV_VAR) && e.contains("fft"), "{e}");
    }

    /// Each choice's method for the windows of each kind: Winograd from [`WINOGRAD_FROM`]
    /// channels and [`WINOGRAD_SIDE`] pixels a side under `auto`, the direct kernels below that
    /// where the CPU has them, a column matrix for strided windows whatever the choice.
    #[test]
    fn each_choice_computes_each_window_as_it_says() {
        let small = Window { channels: 16, height: 8, width: 8, kernel: 3, stride: 1, pad: 1 };
        let wide = Window { channels: WINOGRAD_FROM, ..small };
        let tiny = Window { height: WINOGRAD_SIDE - 1, ..wide };
        let strided = Window { stride: 2, ..small };
        let direct = if direct_conv_available() { ConvMethod::Direct } else { ConvMethod::Columns };
        let cpu = |conv| Cpu { threads: 1, pool: None, conv };
        assert_eq!(cpu(ConvChoice::Auto).conv_method(&small), direct);
        assert_eq!(cpu(ConvChoice::Auto).conv_method(&wide), ConvMethod::Winograd);
        assert_eq!(cpu(ConvChoice::Auto).conv_method(&tiny), direct);
        assert_eq!(cpu(ConvChoice::Winograd).conv_method(&tiny), ConvMethod::Winograd);
        assert_eq!(cpu(ConvChoice::Direct).conv_method(&wide), direct);
        assert_eq!(cpu(ConvChoice::Winograd).conv_method(&small), ConvMethod::Winograd);
        assert_eq!(cpu(ConvChoice::Columns).conv_method(&wide), ConvMethod::Columns);
        for choice in [ConvChoice::Auto, ConvChoice::Direct, ConvChoice::Winograd, ConvChoice::Columns] {
            assert_eq!(cpu(choice).conv_method(&strided), ConvMethod::Columns, "{choice:?}");
            assert!(!cpu(choice).direct_conv(&strided));
        }
    }

    /// Every transpose combination, with and without accumulation, at shapes that split by
    /// rows, by columns, unevenly and not at all, against the definition.
    #[test]
    fn gemm_matches_the_definition_whole_and_split() {
        // (70, 200, 256): op(B)^T's rows 1 KiB apart, restaged in blocks of 64 rows.
        let shapes = [(130, 200, 33), (300, 70, 17), (5, 3, 7), (64, 129, 64), (1, 1, 1), (70, 200, 256)];
        for threads in [1, 2, 3] {
            let cpu = Cpu::new(threads).unwrap();
            for &(m, n, k) in &shapes {
                for (ta, tb, acc) in
                    [(false, false, false), (true, false, true), (false, true, false), (true, true, true)]
                {
                    let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0).collect();
                    let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
                    let start: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
                    let (mut got, mut want) = (start.clone(), start);
                    cpu.gemm(m, n, k, &a, ta, &b, tb, &mut got, acc).unwrap();
                    reference(m, n, k, &a, ta, &b, tb, &mut want, acc);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "threads {threads} m {m} n {n} k {k} ta {ta} tb {tb} acc {acc}: C[{i}] = {g}, want {w}"
                        );
                    }
                }
            }
        }
    }
}
