//! Gradient compression, `--compress none|fp16|bf16|topk:RATIO`: the flag's value, the codecs
//! and what each costs on the wire. Pure functions over slices, so the worker, the parameter
//! server and DDP's reducer share one implementation (docs/compression.md).
//!
//! - `fp16`, `bf16`: every value rounded to the nearest half-precision value (ties to even,
//!   the `half` crate), two little-endian bytes each.
//! - `topk:R`: the `k = ceil(R n)` values of largest magnitude, as `(index, value)` pairs in
//!   ascending index order, with **error feedback** ([`TopK`]): what a step does not send stays
//!   in a residual and is added to the next step's gradient, so every coordinate is sent
//!   eventually (Stich et al., "Sparsified SGD with memory", 2018).

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::{Error, Result};

/// What `--compress` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Compression {
    /// Full f32 values (4 bytes each).
    #[default]
    None,
    /// IEEE half precision (2 bytes each).
    Fp16,
    /// bfloat16: f32's exponent, 8 bits of mantissa (2 bytes each).
    Bf16,
    /// The `ceil(ratio n)` largest magnitudes as (u32 index, f32 value) pairs, with error
    /// feedback; `ratio` in (0, 1].
    TopK(f64),
}

impl Compression {
    /// The half-precision format, for `fp16` and `bf16`.
    pub fn half(self) -> Option<Half> {
        match self {
            Compression::Fp16 => Some(Half::F16),
            Compression::Bf16 => Some(Half::Bf16),
            _ => None,
        }
    }

    /// The fraction of values sent, for `topk`.
    pub fn ratio(self) -> Option<f64> {
        match self {
            Compression::TopK(r) => Some(r),
            _ => None,
        }
    }

    /// Whether values travel as full f32.
    pub fn is_none(self) -> bool {
        self == Compression::None
    }

    /// Payload bytes of `n` gradient values compressed this way (`topk`: 4 bytes of index
    /// and 4 of value per pair sent).
    pub fn wire_bytes(self, n: usize) -> u64 {
        let n = n as u64;
        match self {
            Compression::None => 4 * n,
            Compression::Fp16 | Compression::Bf16 => 2 * n,
            Compression::TopK(r) => 8 * topk_count(r, n as usize) as u64,
        }
    }
}

impl FromStr for Compression {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        const EXPECTED: &str = "expected none, fp16, bf16 or topk:RATIO with 0 < RATIO <= 1, e.g. topk:0.01";
        match s {
            "none" => Ok(Compression::None),
            "fp16" => Ok(Compression::Fp16),
            "bf16" => Ok(Compression::Bf16),
            _ => {
                let Some(r) = s.strip_prefix("topk:") else {
                    return Err(format!("unknown compression '{s}' ({EXPECTED})"));
                };
                let ratio: f64 = r
                    .trim()
                    .parse()
                    .map_err(|_| format!("'{s}': the top-k ratio '{r}' is not a number ({EXPECTED})"))?;
                if !(ratio > 0.0 && ratio <= 1.0) {
                    return Err(format!("'{s}': the top-k ratio must be above 0 and at most 1 ({EXPECTED})"));
                }
                Ok(Compression::TopK(ratio))
            }
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Fp16 => f.write_str("fp16"),
            Compression::Bf16 => f.write_str("bf16"),
            Compression::TopK(r) => write!(f, "topk:{r}"),
        }
    }
}

/// The values top-k sends out of `n`: `ceil(ratio n)`, at least one of a non-empty buffer.
/// (Computed less 1e-9, so that a ratio written in decimal, whose binary value is a hair
/// above it, gives the count its decimal says: 0.07 of 100 is 7, not 8.)
pub fn topk_count(ratio: f64, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let k = (ratio * n as f64 - 1e-9).ceil();
    (k.max(1.0) as usize).min(n)
}

/// A half-precision wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl Half {
    /// `src` rounded to nearest (ties to even) as little-endian half values into `dst`
    /// (`2 * src.len()` bytes).
    pub fn encode(self, src: &[f32], dst: &mut [u8]) -> Result<()> {
        if dst.len() != 2 * src.len() {
            return Err(Error::Length {
                what: "half-precision payload bytes",
                expected: 2 * src.len(),
                got: dst.len(),
            });
        }
        for (v, out) in src.iter().zip(dst.chunks_exact_mut(2)) {
            out.copy_from_slice(&self.bits(*v).to_le_bytes());
        }
        Ok(())
    }

    /// Little-endian half values `src` widened to f32 into `dst` (exact: every half value is
    /// an f32 value).
    pub fn decode(self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        if src.len() != 2 * dst.len() {
            return Err(Error::Codec(format!(
                "{} bytes of {} payload for {} values (2 bytes each)",
                src.len(),
                self.name(),
                dst.len()
            )));
        }
        for (b, out) in src.chunks_exact(2).zip(dst.iter_mut()) {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            *out = match self {
                Half::F16 => f16::from_bits(bits).to_f32(),
                Half::Bf16 => bf16::from_bits(bits).to_f32(),
            };
        }
        Ok(())
    }

    /// The largest finite value of this format (fp16: 65504; bf16: about 3.39e38).
    pub fn max(self) -> f32 {
        match self {
            Half::F16 => f16::MAX.to_f32(),
            Half::Bf16 => bf16::MAX.to_f32(),
        }
    }

    /// The first of `values` that is finite but rounds to an infinity in this format (beyond
    /// [`Half::max`] by more than half a step): its index and value.
    pub fn first_overflow(self, values: &[f32]) -> Option<(usize, f32)> {
        let max = self.max();
        values
            .iter()
            .position(|v| v.abs() > max && v.is_finite() && self.round(*v).is_infinite())
            .map(|i| (i, values[i]))
    }

    /// "`what` is `v`, beyond fp16's range (largest 65504): a --compress fp16 `carrier` cannot
    /// carry it; ...": the error that names a value past [`Half::max`] and what to do, for every
    /// sender of this format.
    pub fn overflow_error(self, what: &str, v: f32, carrier: &str) -> String {
        format!(
            "{what} is {v}, beyond {}'s range (largest {}): a --compress {} {carrier} cannot carry it; bf16 keeps \
             f32's range (--compress bf16 on the servers and workers), or the learning rate may be too high",
            self.name(),
            self.max(),
            self.name()
        )
    }

    /// `v` rounded to this format and back: what the receiver gets.
    pub fn round(self, v: f32) -> f32 {
        match self {
            Half::F16 => f16::from_f32(v).to_f32(),
            Half::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }

    fn bits(self, v: f32) -> u16 {
        match self {
            Half::F16 => f16::from_f32(v).to_bits(),
            Half::Bf16 => bf16::from_f32(v).to_bits(),
        }
    }

    /// The `--compress` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Half::F16 => "fp16",
            Half::Bf16 => "bf16",
        }
    }
}

/// Selected gradient values: ascending indices and their values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sparse {
    /// Indices into the compressed buffer, strictly ascending.
    pub indices: Vec<u32>,
    /// The value at each index.
    pub values: Vec<f32>,
}

impl Sparse {
    /// Pairs held.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether none are held.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The positions of the pairs whose index lies in `r` (a binary search: indices ascend).
    pub fn within(&self, r: Range<usize>) -> Range<usize> {
        let at = |i: usize| self.indices.partition_point(|&x| (x as usize) < i);
        at(r.start)..at(r.end)
    }

    /// Add the pairs into `dst` (indices into it).
    pub fn add_into(&self, dst: &mut [f32]) -> Result<()> {
        add_pairs(&self.indices, &self.values, dst)
    }
}

/// `dst[indices[j]] += values[j]`, refusing an index outside `dst`.
fn add_pairs(indices: &[u32], values: &[f32], dst: &mut [f32]) -> Result<()> {
    let n = dst.len();
    for (&i, &v) in indices.iter().zip(values) {
        let slot = dst
            .get_mut(i as usize)
            .ok_or_else(|| Error::Codec(format!("index {i} outside a buffer of {} values", n)))?;
        *slot += v;
    }
    Ok(())
}

/// Top-k with error feedback over one buffer (a worker's whole gradient, or one DDP bucket):
/// the residual is kept here, across steps, per buffer.
///
/// Each call computes `g' = g + residual`, sends the `k` entries of `g'` of largest magnitude
/// and keeps `residual = g' - sent`, so `sent + residual == g + old residual` exactly
/// (coordinate by coordinate, both sides are `g'`). Ties in magnitude go to the lower index,
/// so the choice is the same on every run.
#[derive(Debug, Clone)]
pub struct TopK {
    ratio: f64,
    residual: Vec<f32>,
    order: Vec<u32>,
}

impl TopK {
    /// Top-k of `ratio` over buffers of `n` values, with a zero residual.
    pub fn new(ratio: f64, n: usize) -> Self {
        TopK { ratio, residual: vec![0.0; n], order: Vec::new() }
    }

    /// Top-k of `ratio` carrying on from `residual` (what a checkpoint kept of an earlier
    /// run's), over buffers of its length.
    pub fn with_residual(ratio: f64, residual: Vec<f32>) -> Self {
        TopK { ratio, residual, order: Vec::new() }
    }

    /// The values each call selects.
    pub fn k(&self) -> usize {
        topk_count(self.ratio, self.residual.len())
    }

    /// What has not been sent yet.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Fold `grad` into the residual and move its `k` largest magnitudes out into `out`
    /// (indices ascending). Selection is `select_nth_unstable` (linear on average), then a
    /// sort of the `k` chosen indices.
    pub fn compress(&mut self, grad: &[f32], out: &mut Sparse) -> Result<()> {
        let n = self.residual.len();
        if grad.len() != n {
            return Err(Error::Length { what: "top-k gradient", expected: n, got: grad.len() });
        }
        if n > u32::MAX as usize {
            return Err(Error::invalid("--compress topk", format!("{n} values do not fit u32 indices")));
        }
        for (r, g) in self.residual.iter_mut().zip(grad) {
            *r += g;
        }
        let k = self.k();
        out.indices.clear();
        out.values.clear();
        if k == 0 {
            return Ok(());
        }
        let res = &self.residual;
        if k < n {
            self.order.clear();
            self.order.extend(0..n as u32);
            // Descending magnitude, then ascending index: a total order, so which k are
            // chosen does not depend on how the unstable selection moves equal keys.
            self.order.select_nth_unstable_by(k - 1, |&a, &b| {
                let (x, y) = (res[a as usize].abs(), res[b as usize].abs());
                y.total_cmp(&x).then(a.cmp(&b))
            });
            out.indices.extend_from_slice(&self.order[..k]);
            out.indices.sort_unstable();
        } else {
            out.indices.extend(0..n as u32);
        }
        for &i in &out.indices {
            let r = &mut self.residual[i as usize];
            out.values.push(*r);
            *r = 0.0;
        }
        Ok(())
    }
}

/// Little-endian u32 indices and f32 values of a sparse chunk covering values
/// `offset..offset + dst.len()` (indices count from the same origin as `offset`), written
/// into `dst` as dense values: zero where no pair is. Refuses ragged or unequal lengths, an
/// index outside the chunk's span and indices that do not strictly ascend (so no index
/// appears twice) with an error naming the first fault.
pub fn densify(indices: &[u8], values: &[u8], offset: u64, dst: &mut [f32]) -> Result<()> {
    if !indices.len().is_multiple_of(4) || !values.len().is_multiple_of(4) {
        return Err(Error::Codec(format!(
            "sparse chunk of {} index bytes and {} value bytes (4 bytes each)",
            indices.len(),
            values.len()
        )));
    }
    if indices.len() != values.len() {
        return Err(Error::Codec(format!(
            "sparse chunk with {} indices but {} values",
            indices.len() / 4,
            values.len() / 4
        )));
    }
    dst.fill(0.0);
    let span = offset..offset + dst.len() as u64;
    let mut next = offset;
    for (i, v) in indices.chunks_exact(4).zip(values.chunks_exact(4)) {
        let i = u64::from(u32::from_le_bytes([i[0], i[1], i[2], i[3]]));
        if !span.contains(&i) {
            return Err(Error::Codec(format!("index {i} outside the chunk's span {span:?}")));
        }
        if i < next {
            return Err(Error::Codec(format!(
                "index {i} after index {} (indices must strictly ascend: no repeats)",
                next - 1
            )));
        }
        dst[(i - offset) as usize] = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
        next = i + 1;
    }
    Ok(())
}

/// Little-endian u32 bytes of `indices - base` (a shard's indices count from its start).
pub fn put_indices(indices: &[u32], base: u32, out: &mut Vec<u8>) {
    out.reserve(indices.len() * 4);
    for &i in indices {
        out.extend_from_slice(&(i - base).to_le_bytes());
    }
}

/// A [`Sparse`] packed into f32 slots for a collective that moves values without arithmetic
/// (all-gather): the `k` indices bit-cast, then the `k` values. `out` holds `2k` slots.
pub fn pack(s: &Sparse, out: &mut [f32]) -> Result<()> {
    let k = s.len();
    if out.len() != 2 * k {
        return Err(Error::Length { what: "packed top-k slots", expected: 2 * k, got: out.len() });
    }
    for (o, &i) in out[..k].iter_mut().zip(&s.indices) {
        *o = f32::from_bits(i);
    }
    out[k..].copy_from_slice(&s.values);
    Ok(())
}

/// Every rank's packed pairs (`segments`, each `2k` slots, in rank order) summed into `dst`,
/// which is zeroed first: each rank's values are added in rank order, so every rank computes
/// the same sum bit for bit. Refuses an index outside `dst` (a peer's data is not trusted).
pub fn unpack_sum(segments: &[f32], k: usize, dst: &mut [f32]) -> Result<()> {
    if k == 0 {
        dst.fill(0.0);
        return Ok(());
    }
    if !segments.len().is_multiple_of(2 * k) {
        return Err(Error::Length { what: "gathered top-k slots", expected: 2 * k, got: segments.len() });
    }
    dst.fill(0.0);
    let mut indices = Vec::with_capacity(k);
    for seg in segments.chunks_exact(2 * k) {
        indices.clear();
        indices.extend(seg[..k].iter().map(|v| v.to_bits()));
        add_pairs(&indices, &seg[k..], dst)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn overflow_is_what_rounds_to_infinity() {
        let h = Half::F16;
        assert_eq!(h.max(), 65504.0);
        // 65519 still rounds down to 65504; 65520 is the tie that rounds to infinity.
        assert_eq!(h.first_overflow(&[1.0, 65504.0, 65519.0, -65519.0]), None);
        assert_eq!(h.first_overflow(&[1.0, -65520.0, 1e9]), Some((1, -65520.0)));
        assert_eq!(h.first_overflow(&[f32::INFINITY, f32::NAN]), None, "not finite: not an overflow");
        assert_eq!(Half::Bf16.first_overflow(&[1e9, 3.0e38]), None);
        assert_eq!(Half::Bf16.first_overflow(&[f32::MAX]), Some((0, f32::MAX)));
    }

    fn grad(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn parses_and_refuses_naming_the_fault() {
        assert_eq!("none".parse(), Ok(Compression::None));
        assert_eq!("fp16".parse(), Ok(Compression::Fp16));
        assert_eq!("bf16".parse(), Ok(Compression::Bf16));
        assert_eq!("topk:0.01".parse(), Ok(Compression::TopK(0.01)));
        assert_eq!("topk:1".parse(), Ok(Compression::TopK(1.0)));
        for (bad, says) in [
            ("topk:0", "above 0 and at most 1"),
            ("topk:2", "above 0 and at most 1"),
            ("topk:-0.5", "above 0 and at most 1"),
            ("topk:NaN", "above 0 and at most 1"),
            ("topk:abc", "'abc' is not a number"),
            ("topk:", "is not a number"),
            ("gzip", "unknown compression 'gzip'"),
            ("", "unknown compression"),
        ] {
            let e = bad.parse::<Compression>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        for c in [Compression::None, Compression::Fp16, Compression::Bf16, Compression::TopK(0.25)] {
            assert_eq!(c.to_string().parse(), Ok(c));
        }
    }

    #[test]
    fn half_round_trips_are_the_nearest_half_value() {
        let v = grad(4096, 3);
        for h in [Half::F16, Half::Bf16] {
            let mut wire = vec![0u8; 2 * v.len()];
            h.encode(&v, &mut wire).unwrap();
            let mut back = vec![0f32; v.len()];
            h.decode(&wire, &mut back).unwrap();
            // Within half an ulp of the format (relative 2^-11 for fp16, 2^-8 for bf16) for
            // normal values, and equal to the value rounded by itself.
            let rel = match h {
                Half::F16 => 2f32.powi(-11),
                Half::Bf16 => 2f32.powi(-8),
            };
            for (a, b) in v.iter().zip(&back) {
                assert_eq!(*b, h.round(*a));
                if a.abs() > 1e-4 {
                    assert!((a - b).abs() <= rel * a.abs(), "{h:?}: {a} -> {b}");
                }
            }
            // Values already in the format come back exactly; a second trip changes nothing.
            let mut again = vec![0u8; wire.len()];
            h.encode(&back, &mut again).unwrap();
            assert_eq!(again, wire);
            assert!(h.decode(&wire[1..], &mut back[..2047]).is_err(), "odd byte count refused");
        }
        // Ties go to even: 1 + 2^-11 lies halfway between fp16's 1 and 1 + 2^-10.
        assert_eq!(Half::F16.round(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(Half::F16.round(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2.0 * 2f32.powi(-10));
        assert_eq!(Half::Bf16.round(1.0 + 2f32.powi(-8)), 1.0);
    }

    #[test]
    fn topk_sends_exactly_the_k_largest_with_ties_to_the_lower_index() {
        for (n, ratio) in [(1000, 0.01), (1000, 0.07), (7, 0.5), (5, 1.0), (1, 0.001), (300, 0.01)] {
            let g = grad(n, n as u32);
            let mut t = TopK::new(ratio, n);
            let mut s = Sparse::default();
            t.compress(&g, &mut s).unwrap();
            let k = ((ratio * n as f64 - 1e-9).ceil() as usize).max(1);
            assert_eq!(s.len(), k, "n {n} ratio {ratio}");
            assert!(s.indices.windows(2).all(|w| w[0] < w[1]));
            // Independently: the k largest by a full sort.
            let mut by: Vec<usize> = (0..n).collect();
            by.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()).then(a.cmp(&b)));
            let mut want: Vec<u32> = by[..k].iter().map(|&i| i as u32).collect();
            want.sort_unstable();
            assert_eq!(s.indices, want);
        }
        // Ties: equal magnitudes, the lower indices win, the same on every call.
        let g = [1.0, -2.0, 2.0, -2.0, 1.0, 2.0];
        let mut t = TopK::new(0.5, 6);
        let mut s = Sparse::default();
        t.compress(&g, &mut s).unwrap();
        assert_eq!(s.indices, [1, 2, 3]);
        assert_eq!(s.values, [-2.0, 2.0, -2.0]);
        assert_eq!(topk_count(0.07, 100), 7);
        assert_eq!(topk_count(0.01, 300), 3);
        assert_eq!(topk_count(0.01, 301), 4);
        assert_eq!(topk_count(0.5, 0), 0);
    }

    #[test]
    fn residual_conserves_every_value_exactly() {
        let n = 2000;
        let mut t = TopK::new(0.01, n);
        let mut s = Sparse::default();
        let mut sent_total = vec![0f64; n];
        let mut grad_total = vec![0f64; n];
        for step in 0..50 {
            let g = grad(n, step);
            let old = t.residual().to_vec();
            t.compress(&g, &mut s).unwrap();
            let mut sent = vec![0f32; n];
            s.add_into(&mut sent).unwrap();
            for i in 0..n {
                // sent + residual == g + old residual, bit for bit.
                assert_eq!(sent[i] + t.residual()[i], g[i] + old[i], "step {step} value {i}");
                assert!(sent[i] == 0.0 || t.residual()[i] == 0.0);
                sent_total[i] += f64::from(sent[i]);
                grad_total[i] += f64::from(g[i]);
            }
        }
        // Over many steps, nothing is lost: what was sent plus what waits is what came in.
        for i in 0..n {
            let diff = grad_total[i] - sent_total[i] - f64::from(t.residual()[i]);
            assert!(diff.abs() < 1e-4, "value {i}: {diff}");
        }
        // Ratio 1: everything is sent as it is, nothing waits.
        let g = grad(n, 99);
        let mut all = TopK::new(1.0, n);
        all.compress(&g, &mut s).unwrap();
        let mut dense = vec![0f32; n];
        s.add_into(&mut dense).unwrap();
        assert_eq!(dense, g);
        assert!(all.residual().iter().all(|r| *r == 0.0));
        assert!(all.compress(&g[1..], &mut s).is_err(), "length refused");
    }

    #[test]
    fn densify_refuses_what_a_peer_can_get_wrong() {
        let le32 = |v: &[u32]| v.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>();
        let lef = |v: &[f32]| v.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>();
        let mut dst = vec![9.0f32; 4];
        densify(&le32(&[10, 13]), &lef(&[1.5, -2.0]), 10, &mut dst).unwrap();
        assert_eq!(dst, [1.5, 0.0, 0.0, -2.0]);
        let mut err = |i: &[u8], v: &[u8]| densify(i, v, 10, &mut dst).unwrap_err().to_string();
        assert!(err(&le32(&[14]), &lef(&[1.0])).contains("outside the chunk's span 10..14"));
        assert!(err(&le32(&[9]), &lef(&[1.0])).contains("outside"));
        assert!(err(&le32(&[11, 11]), &lef(&[1.0, 1.0])).contains("strictly ascend"));
        assert!(err(&le32(&[12, 11]), &lef(&[1.0, 1.0])).contains("strictly ascend"));
        assert!(err(&le32(&[11, 12]), &lef(&[1.0])).contains("2 indices but 1 values"));
        assert!(err(&[0, 0, 0], &lef(&[1.0])).contains("4 bytes each"));
        let mut out = Vec::new();
        put_indices(&[100, 105], 100, &mut out);
        assert_eq!(out, le32(&[0, 5]));
    }

    #[test]
    fn packed_pairs_sum_in_rank_order() {
        let a = Sparse { indices: vec![0, 3], values: vec![1.0, 2.0] };
        let b = Sparse { indices: vec![3, 4], values: vec![0.5, -1.0] };
        let mut slots = vec![0f32; 8];
        pack(&a, &mut slots[..4]).unwrap();
        pack(&b, &mut slots[4..]).unwrap();
        let mut dst = vec![7.0f32; 5];
        unpack_sum(&slots, 2, &mut dst).unwrap();
        assert_eq!(dst, [1.0, 0.0, 0.0, 2.5, -1.0]);
        slots[1] = f32::from_bits(5);
        assert!(unpack_sum(&slots, 2, &mut dst).is_err(), "index past the bucket refused");
        assert!(pack(&a, &mut slots[..3]).is_err());
    }

    #[test]
    fn wire_bytes_per_codec() {
        assert_eq!(Compression::None.wire_bytes(1000), 4000);
        assert_eq!(Compression::Fp16.wire_bytes(1000), 2000);
        assert_eq!(Compression::Bf16.wire_bytes(1000), 2000);
        assert_eq!(Compression::TopK(0.01).wire_bytes(1000), 80);
    }
}
