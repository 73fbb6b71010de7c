//! The CPU's GEMM, `C (=|+=) op(A) op(B)` on row-major `f32` views: the `gemm` crate's
//! runtime-dispatched kernels (AVX2/AVX-512/NEON), split over a rayon pool by blocks of `C`.
//! Both the CPU device's [`Backend::gemm`](super::Backend::gemm) and the Winograd convolutions'
//! 16 GEMMs a pass (`cpu_winograd`) run here, so neither file needs the other.

use std::ops::Range;

use gemm::Parallelism;
use rayon::ThreadPool;
use rayon::prelude::*;

use crate::error::Result;

/// `c (=|+=) op(a) op(b)`, `op(a)` `m x k` (`a` transposed when `ta`), `op(b)` `k x n`, `c`
/// `m x n`, all row-major; on `pool`'s threads, or on the caller's without one.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    pool: Option<&ThreadPool>,
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
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n, "gemm: view too short");
    // Strides of op(A) (m x k) and op(B) (k x n) over row-major storage.
    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // The gemm crate's kernels favour a column-major destination, so compute the same
    // product as C^T = op(B)^T op(A)^T with C^T column-major, which is C's row-major memory.
    // Measured here (AVX-512, one thread): 98 against 87 GFLOP/s for the forward GEMM,
    // equal for the two backward ones.
    //
    // `kernel` computes the block `rows x cols` of C from `lhs`: op(B)^T's rows `cols`
    // (pointer, column stride, row stride).
    let kernel = |rows: Range<usize>,
                  cols: Range<usize>,
                  lhs: (*const f32, isize, isize),
                  c: SendPtr,
                  par: Parallelism| {
        // SAFETY: the asserts above keep every index the strides reach inside the slices
        // (or `lhs` points into a restaged copy of them); `c` is exclusive and cannot alias
        // `a` or `b`; parts cover disjoint blocks.
        unsafe {
            gemm::gemm(
                cols.len(),
                rows.len(),
                k,
                c.0.add(rows.start * n + cols.start),
                n as isize,
                1,
                accumulate,
                lhs.0,
                lhs.1,
                lhs.2,
                a.as_ptr().offset(rows.start as isize * a_rs),
                a_rs,
                a_cs,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        }
    };
    let part = |rows: Range<usize>, cols: Range<usize>, c: SendPtr, par: Parallelism| {
        if !(tb && restage(k, cols.len())) {
            // SAFETY: column `cols.start` of op(B) lies inside `b` by the assert above.
            let lhs = unsafe { b.as_ptr().offset(cols.start as isize * b_cs) };
            return kernel(rows, cols, (lhs, b_rs, b_cs), c, par);
        }
        // op(B)^T is B itself, rows `k` floats apart: restage them with a padded stride.
        let ld = k + RESTAGE_PAD;
        let block = (RESTAGE_BYTES / (ld * 4)).max(64);
        let run = |scratch: &mut Vec<f32>| {
            for start in cols.clone().step_by(block) {
                let end = (start + block).min(cols.end);
                scratch.resize(scratch.len().max((end - start) * ld), 0.0);
                for (dst, src) in scratch.chunks_exact_mut(ld).zip(b[start * k..end * k].chunks_exact(k)) {
                    dst[..k].copy_from_slice(src);
                }
                kernel(rows.clone(), start..end, (scratch.as_ptr(), 1, ld as isize), c, par);
            }
        };
        // A thread waiting inside the gemm crate's own parallel loop could in principle pick
        // up another part: it then restages into a buffer of its own.
        RESTAGED.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => run(&mut scratch),
            Err(_) => run(&mut Vec::new()),
        })
    };
    let c = SendPtr(c.as_mut_ptr());
    let Some(pool) = pool else {
        part(0..m, 0..n, c, Parallelism::None);
        return Ok(());
    };
    let threads = pool.current_num_threads();
    pool.install(|| match Split::choose(threads, m, n) {
        Split::Whole => part(0..m, 0..n, c, Parallelism::Rayon(threads)),
        Split::Rows(parts) => (0..parts)
            .into_par_iter()
            .for_each(|i| part(split_range(m, parts, i), 0..n, c, Parallelism::None)),
        Split::Cols(parts) => (0..parts)
            .into_par_iter()
            .for_each(|i| part(0..m, split_range(n, parts, i), c, Parallelism::None)),
    });
    Ok(())
}

/// Floats added to each restaged row: one cache line, so consecutive rows fall in different
/// L1 sets.
const RESTAGE_PAD: usize = 16;
/// The most a thread restages at once; larger operands go in blocks of rows (small under test,
/// so the tests cross block boundaries).
const RESTAGE_BYTES: usize = if cfg!(test) { 64 << 10 } else { 16 << 20 };

thread_local! {
    /// Each pool thread's restaging buffer, kept between calls.
    static RESTAGED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether the gemm crate's packing of `rows` rows `k` floats apart would thrash L1.
///
/// It packs op(B)^T in panels of 64 rows, reading 16 consecutive floats of each row before it
/// moves on. When the row stride is a multiple of 1 KiB those 64 rows map to at most 4 of L1's
/// 64 sets, 16 or more lines per set against 12 ways, so every line is evicted before its
/// 16 floats are read. mnist's 1024-wide layer (rows exactly 4 KiB apart) is the case: its
/// forward GEMM (128 x 1024 x 1024) ran at 62-65 GFLOP/s as laid out and at 81-84 with the rows
/// restaged one cache line apart, copy included (one thread; 74-81 against 131-137 with two).
fn restage(k: usize, rows: usize) -> bool {
    (k * 4).is_multiple_of(1024) && rows >= 64
}

/// A destination pointer shared by the parts of a split GEMM, which write disjoint columns.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: every part writes a disjoint set of columns through it (see [`gemm`]).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// How a GEMM spreads over the pool's threads.
///
/// Each part is an independent single-threaded GEMM over a block of C. Splitting C's columns
/// makes every part pack all of op(A) (m x k) and its own columns of op(B); splitting rows makes
/// every part pack all of op(B) (k x n). So the longer of m and n is split, and the smaller
/// operand is the one packed twice. With the MLP's shapes (batch 128 against 784-1024 wide
/// layers) this beats the gemm crate's own threading, which splits within one packed block:
/// mnist's 2-thread forward went from about 6 to about 4 ms per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// One call with the gemm crate's own parallelism (or none on one thread).
    Whole,
    /// Row blocks of C, one per part.
    Rows(usize),
    /// Column blocks of C, one per part.
    Cols(usize),
}

impl Split {
    /// Parts hold at least one 64-wide panel of the AVX-512 kernel each.
    fn choose(threads: usize, m: usize, n: usize) -> Split {
        let parts = |len: usize| threads.min(len / 64);
        match (m >= n, parts(m.max(n))) {
            (_, 0 | 1) => Split::Whole,
            (true, p) => Split::Rows(p),
            (false, p) => Split::Cols(p),
        }
    }
}

/// Part `i` of `n` columns split `parts` ways, in multiples of 16.
fn split_range(n: usize, parts: usize, i: usize) -> Range<usize> {
    let per = n.div_ceil(parts).div_ceil(16) * 16;
    (i * per).min(n)..((i + 1) * per).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restaging_is_for_strides_that_alias_in_l1() {
        assert!(restage(1024, 1024) && restage(256, 64));
        assert!(!restage(784, 1024) && !restage(1024, 63) && !restage(128, 1024) && !restage(1000, 1024));
    }

    #[test]
    fn split_choice_packs_the_smaller_operand_twice() {
        assert_eq!(Split::choose(1, 1024, 1024), Split::Whole);
        assert_eq!(Split::choose(2, 128, 1024), Split::Cols(2));
        assert_eq!(Split::choose(2, 1024, 784), Split::Rows(2));
        assert_eq!(Split::choose(4, 100, 10), Split::Whole);
        assert_eq!(Split::choose(8, 200, 10), Split::Rows(3));
    }
}
