//! The reduction math the host collectives share (the ring, the chains, shared memory, and
//! DataParallel's master): element-wise sums, written once, over plain `f32` buffers and over
//! buffers of half-precision values packed two to an `f32` slot.
//!
//! Packed buffers are how the host collectives move `--compress fp16|bf16` gradients in two
//! bytes a value without a second set of engines: the ring, the socket pumps and the
//! shared-memory rings move slots and never look inside them; only the sum ([`sum_into`])
//! unpacks, adds in `f32` and rounds back. Slot `i` holds values `2i` (low 16 bits) and
//! `2i + 1` (high 16 bits), so on a little-endian machine the slots' bytes are the half values
//! in order.

use gradsync_core::compress::Half;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

use super::Collective;
use super::error::Result;

/// What the `f32` slots of a buffer hold, and so how two buffers add.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Values {
    /// One `f32` value per slot.
    F32,
    /// Two half-precision values per slot ([`pack`]).
    Packed(Half),
}

impl Values {
    /// The code frames carry beside the operation's tag, so that ranks disagreeing on the
    /// format fail with a protocol error instead of adding bits of another format.
    pub(crate) fn code(self) -> u32 {
        match self {
            Values::F32 => 0,
            Values::Packed(Half::F16) => 1,
            Values::Packed(Half::Bf16) => 2,
        }
    }

    pub(crate) fn from_code(c: u32) -> Option<Values> {
        [Values::F32, Values::Packed(Half::F16), Values::Packed(Half::Bf16)]
            .into_iter()
            .find(|v| v.code() == c)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Values::F32 => "f32",
            Values::Packed(h) => h.name(),
        }
    }
}

/// `dst += src`, element-wise; a plain loop the compiler vectorises.
pub(crate) fn add_into(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// Half values per block of the packed sum: two blocks of f32 stay in the first-level cache.
const BLOCK: usize = 1024;

/// `dst += src` for buffers holding `values`: packed halves are widened, added in `f32` and
/// rounded back to nearest (ties to even), block by block.
pub(crate) fn sum_into(values: Values, dst: &mut [f32], src: &[f32]) {
    let Values::Packed(h) = values else { return add_into(dst, src) };
    let (d16, s16): (&mut [u16], &[u16]) = (bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (d, s) in d16.chunks_mut(BLOCK).zip(s16.chunks(BLOCK)) {
        let (a, b) = (&mut a[..d.len()], &mut b[..d.len()]);
        widen(h, d, a);
        widen(h, s, b);
        add_into(a, b);
        narrow(h, a, d);
    }
}

fn widen(h: Half, bits: &[u16], out: &mut [f32]) {
    match h {
        Half::F16 => bits.reinterpret_cast::<f16>().convert_to_f32_slice(out),
        Half::Bf16 => bits.reinterpret_cast::<bf16>().convert_to_f32_slice(out),
    }
}

fn narrow(h: Half, vals: &[f32], bits: &mut [u16]) {
    match h {
        Half::F16 => bits.reinterpret_cast_mut::<f16>().convert_from_f32_slice(vals),
        Half::Bf16 => bits.reinterpret_cast_mut::<bf16>().convert_from_f32_slice(vals),
    }
}

/// Slots a packed buffer of `n` values needs.
pub fn packed_len(n: usize) -> usize {
    n.div_ceil(2)
}

/// `src` rounded to `h` into `out` (`packed_len(src.len())` slots; an odd length leaves the
/// last slot's high half zero).
pub fn pack(h: Half, src: &[f32], out: &mut [f32]) {
    assert_eq!(out.len(), packed_len(src.len()), "packed buffer of the wrong length");
    let bits: &mut [u16] = bytemuck::cast_slice_mut(out);
    narrow(h, src, &mut bits[..src.len()]);
    bits[src.len()..].fill(0);
}

/// The values of a packed buffer widened back into `dst` (exact).
pub fn unpack(h: Half, packed: &[f32], dst: &mut [f32]) {
    assert_eq!(packed.len(), packed_len(dst.len()), "packed buffer of the wrong length");
    let bits: &[u16] = bytemuck::cast_slice(packed);
    widen(h, &bits[..dst.len()], dst);
}

/// Every rank's `buf` ends as the sum over the ranks, moved two bytes a value (`--compress
/// fp16|bf16`). Each rank multiplies its values by one over the world size before rounding
/// them ([`half_shares`]), as PyTorch's fp16 and bf16 hooks divide, so that the hops add
/// shares of the mean: no partial sum exceeds the largest value a rank sends, where a sum of
/// fp16 values past 65504 would become infinite. The result is widened back and multiplied by
/// the world size (a power of two changes no bit of either step). Values below the format's
/// normal range lose precision a world size sooner. `packed` is scratch.
pub fn all_reduce_as_half(
    c: &mut dyn Collective,
    buf: &mut [f32],
    h: Half,
    packed: &mut Vec<f32>,
) -> Result<()> {
    let (share, world) = half_shares(c.world_size());
    packed.clear();
    packed.resize(packed_len(buf.len()), 0.0);
    let bits: &mut [u16] = bytemuck::cast_slice_mut(packed.as_mut_slice());
    let mut shares = [0f32; BLOCK];
    for (v, b) in buf.chunks(BLOCK).zip(bits.chunks_mut(BLOCK)) {
        let shares = &mut shares[..v.len()];
        for (s, x) in shares.iter_mut().zip(v) {
            *s = x * share;
        }
        narrow(h, shares, &mut b[..v.len()]);
    }
    c.all_reduce_half(packed, h)?;
    unpack(h, packed, buf);
    for x in buf.iter_mut() {
        *x *= world;
    }
    Ok(())
}

/// What a half-precision all-reduce over `world` ranks multiplies each value by before
/// rounding it (the reciprocal of the world size, so that host and device multiply alike),
/// and the sum by after widening it (the world size).
pub(crate) fn half_shares(world: usize) -> (f32, f32) {
    let w = world.max(1) as f32;
    (1.0 / w, w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 20001) as f32 / 997.0 - 10.0).collect()
    }

    #[test]
    fn packing_rounds_to_nearest_and_unpacks_exactly() {
        for h in [Half::F16, Half::Bf16] {
            for n in [0, 1, 2, 3, 1001, 2 * BLOCK + 1] {
                let v = sample(n, 7);
                let mut p = vec![f32::NAN; packed_len(n)];
                pack(h, &v, &mut p);
                let mut back = vec![0.0; n];
                unpack(h, &p, &mut back);
                for (x, y) in v.iter().zip(&back) {
                    assert_eq!(*y, h.round(*x), "{} of {x}", h.name());
                }
                if n % 2 == 1 {
                    assert_eq!(bytemuck::cast_slice::<f32, u16>(&p)[n], 0, "the pad is zero");
                }
            }
        }
    }

    #[test]
    fn a_packed_sum_is_the_rounded_f32_sum_of_each_pair() {
        for h in [Half::F16, Half::Bf16] {
            let n = 3 * BLOCK + 5;
            let (x, y) = (sample(n, 1), sample(n, 2));
            let (mut px, mut py) = (vec![0.0; packed_len(n)], vec![0.0; packed_len(n)]);
            pack(h, &x, &mut px);
            pack(h, &y, &mut py);
            sum_into(Values::Packed(h), &mut px, &py);
            let mut got = vec![0.0; n];
            unpack(h, &px, &mut got);
            for i in 0..n {
                assert_eq!(got[i], h.round(h.round(x[i]) + h.round(y[i])), "{} at {i}", h.name());
            }
        }
    }

    #[test]
    fn the_codes_name_every_format_once() {
        for v in [Values::F32, Values::Packed(Half::F16), Values::Packed(Half::Bf16)] {
            assert_eq!(Values::from_code(v.code()), Some(v));
        }
        assert_eq!(Values::from_code(3), None);
    }
}
