//! f32 buffers to and from chunk payloads. Payloads are raw little-endian f32 (no per-value
//! framing), so converting is one pass over the buffer each way, and chunks of one encoded
//! buffer are zero-copy slices of it ([`Bytes::slice`]).

use bytes::{Bytes, BytesMut};

use crate::Error;

/// Encode `src` as little-endian bytes into `buf` (cleared first, its allocation reused) and
/// freeze it. One pass: on little-endian hosts a plain copy, with no zeroing first.
pub fn encode(src: &[f32], mut buf: BytesMut) -> Bytes {
    buf.clear();
    put_f32(src, &mut buf);
    buf.freeze()
}

/// Append `src` as little-endian bytes.
pub fn put_f32(src: &[f32], buf: &mut BytesMut) {
    buf.reserve(src.len() * 4);
    if cfg!(target_endian = "little") {
        buf.extend_from_slice(bytemuck::cast_slice(src));
    } else {
        for v in src {
            buf.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// SHA-256 of f32 values as they travel (their little-endian bits), fed in pieces in order.
/// A parameter server says it of its shard when a worker registers (`RegisterReply.digest`),
/// and a worker that holds values of the same digest (drawn from the same seed) starts from
/// them rather than pulling them; ranks of a ring compare theirs the same way.
#[derive(Debug, Clone, Default)]
pub struct Digest(sha2::Sha256);

impl Digest {
    /// Values, next in order.
    pub fn values(&mut self, v: &[f32]) {
        if cfg!(target_endian = "little") {
            sha2::Digest::update(&mut self.0, bytemuck::cast_slice::<f32, u8>(v));
        } else {
            for x in v {
                sha2::Digest::update(&mut self.0, x.to_le_bytes());
            }
        }
    }

    /// A payload's little-endian values, next in order.
    pub fn payload(&mut self, le: &[u8]) {
        sha2::Digest::update(&mut self.0, le);
    }

    /// The digest of everything fed.
    pub fn finish(self) -> [u8; 32] {
        sha2::Digest::finalize(self.0).into()
    }

    /// The digest of `v` alone.
    pub fn of(v: &[f32]) -> [u8; 32] {
        let mut d = Digest::default();
        d.values(v);
        d.finish()
    }
}

/// Take back the allocation of an encoded buffer once every slice of it has been dropped (the
/// RPC that sent it finished), or start a fresh one.
pub fn reclaim(b: Option<Bytes>) -> BytesMut {
    b.and_then(|b| b.try_into_mut().ok()).unwrap_or_default()
}

/// Decode the payload of a chunk at `offset` (in values) into `dst`, one pass. Returns whether
/// every value is finite (checked block by block right behind the copy, while still in L1).
pub fn decode_into(payload: &[u8], offset: u64, dst: &mut [f32]) -> Result<bool, Error> {
    Ok(copy_checked(payload, place(payload, offset, dst)?))
}

/// [`decode_into`] without the finiteness check, for a receiver that takes whatever values
/// arrive (a worker taking the server's parameters): a plain copy.
pub fn copy_into(payload: &[u8], offset: u64, dst: &mut [f32]) -> Result<(), Error> {
    copy_le(payload, place(payload, offset, dst)?);
    Ok(())
}

/// `payload` read in place as f32 values, where that needs no conversion: a little-endian host
/// and a 4-byte-aligned payload of whole values (as [`crate::frames::FramedChunk::build_f32`]
/// lays them out). `None` otherwise: decode it with [`copy_into`].
pub fn as_f32(payload: &[u8]) -> Option<&[f32]> {
    bytemuck::try_cast_slice(payload).ok().filter(|_| cfg!(target_endian = "little"))
}

/// The part of `dst` that a chunk `payload` at `offset` (in values) fills.
fn place<'a>(payload: &[u8], offset: u64, dst: &'a mut [f32]) -> Result<&'a mut [f32], Error> {
    if !payload.len().is_multiple_of(4) {
        return Err(Error::Ragged(payload.len()));
    }
    let len = payload.len() / 4;
    let range = dst.len();
    match usize::try_from(offset).ok().filter(|&o| o.checked_add(len).is_some_and(|e| e <= range)) {
        Some(start) => Ok(&mut dst[start..start + len]),
        None => Err(Error::Overrun { offset, len, range }),
    }
}

/// Copy little-endian `src` into `dst` (same length in values).
fn copy_le(src: &[u8], dst: &mut [f32]) {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src);
    } else {
        for (v, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

/// Values per block of [`copy_checked`]: small enough that a block is still in L1 when it is
/// checked.
const BLOCK: usize = 1024;

/// Copy little-endian `src` into `dst` (same length in values) and say whether every value is
/// finite. Block by block, a copy then a check that vectorises, so the check reads from L1.
fn copy_checked(src: &[u8], dst: &mut [f32]) -> bool {
    let mut finite = true;
    for (d, s) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK * 4)) {
        copy_le(s, d);
        finite &= all_finite(d);
    }
    finite
}

/// Whether every value is finite, in one pass without branches, which vectorises: a value is
/// NaN or Inf when its exponent bits are all ones. A sum of values is finite only if every
/// value is (or it overflowed), so a receiver that sums can check the sum instead of each
/// input.
pub fn all_finite(v: &[f32]) -> bool {
    v.iter().fold(true, |ok, v| ok & finite_bits(v.to_bits()))
}

/// [`all_finite`] of a payload's little-endian values where they lie, without decoding them
/// anywhere first (a trailing partial value is ignored).
pub fn all_finite_le(payload: &[u8]) -> bool {
    payload.chunks_exact(4).fold(true, |ok, b| ok & finite_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
}

/// Whether the f32 with these bits is finite: its exponent bits are not all ones.
#[inline(always)]
fn finite_bits(bits: u32) -> bool {
    bits & 0x7f80_0000 != 0x7f80_0000
}

/// Reassembles one streamed buffer of exactly `len` values from chunks that must arrive in
/// order. Pure (no I/O) so the service and the fuzzer run the same code. The destination is
/// allocated by the caller from the model's real size: nothing a peer declares sizes it.
/// [`Reassembly::checking`] checks order and length without a destination, for a receiver that
/// keeps the payloads themselves (and checks finiteness where it reads them).
#[derive(Debug)]
pub struct Reassembly<'a> {
    dst: Option<&'a mut [f32]>,
    len: usize,
    received: usize,
    finite: bool,
    bytes: u64,
}

/// Why a chunk stream was refused by [`Reassembly`].
#[derive(Debug, PartialEq, Eq)]
pub enum StreamError {
    /// A chunk whose offset is not where the previous one ended.
    OutOfOrder {
        /// The chunk's offset, in values.
        offset: u64,
        /// The offset expected next.
        expected: u64,
    },
    /// A chunk that is ragged or overruns the buffer.
    Chunk(Error),
    /// The stream ended before (or after) the buffer was full.
    Short {
        /// Values received.
        received: u64,
        /// Values the buffer holds.
        len: u64,
    },
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::OutOfOrder { offset, expected } => write!(
                f,
                "chunk at offset {offset} where {expected} was expected (chunks must arrive in order)"
            ),
            StreamError::Chunk(e) => write!(f, "{e}"),
            StreamError::Short { received, len } => write!(f, "{received} values, the range holds {len}"),
        }
    }
}

impl<'a> Reassembly<'a> {
    /// Reassemble into `dst` (its length is the expected length).
    pub fn new(dst: &'a mut [f32]) -> Self {
        Reassembly { len: dst.len(), dst: Some(dst), received: 0, finite: true, bytes: 0 }
    }

    /// Check a stream of `len` values chunk by chunk (order and length, not finiteness: the
    /// values are not read) without copying it anywhere.
    pub fn checking(len: usize) -> Reassembly<'static> {
        Reassembly { dst: None, len, received: 0, finite: true, bytes: 0 }
    }

    /// Values received so far.
    pub fn received(&self) -> usize {
        self.received
    }

    /// Whether every value so far is finite (always true for [`Reassembly::checking`], which
    /// does not read the values).
    pub fn finite(&self) -> bool {
        self.finite
    }

    /// Add the chunk at `offset` (values). Refuses a gap, an overlap, a ragged or an
    /// overrunning chunk; nothing is allocated.
    pub fn push(&mut self, offset: u64, payload: &[u8]) -> Result<(), StreamError> {
        if offset != self.received as u64 {
            return Err(StreamError::OutOfOrder { offset, expected: self.received as u64 });
        }
        self.finite &= match self.dst.as_deref_mut() {
            Some(dst) => decode_into(payload, offset, dst).map_err(StreamError::Chunk)?,
            None => {
                let len = payload.len() / 4;
                if !payload.len().is_multiple_of(4) {
                    return Err(StreamError::Chunk(Error::Ragged(payload.len())));
                }
                if self.received + len > self.len {
                    return Err(StreamError::Chunk(Error::Overrun { offset, len, range: self.len }));
                }
                true
            }
        };
        self.received += payload.len() / 4;
        self.bytes += payload.len() as u64;
        Ok(())
    }

    /// The stream ended: `Ok((all values finite, payload bytes))` if the buffer is full.
    pub fn finish(self) -> Result<(bool, u64), StreamError> {
        if self.received != self.len {
            return Err(StreamError::Short { received: self.received as u64, len: self.len as u64 });
        }
        Ok((self.finite, self.bytes))
    }
}

/// The chunk boundaries of `len` bytes in chunks of `chunk` bytes (rounded down to whole
/// values, at least one value).
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = (chunk / 4).max(1) * 4;
    (0..len).step_by(step).map(move |s| s..(s + step).min(len))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_in_chunks() {
        let v: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b = encode(&v, BytesMut::new());
        let mut out = vec![0.0; v.len()];
        for r in chunks(b.len(), 64) {
            assert!(decode_into(&b.slice(r.clone()), (r.start / 4) as u64, &mut out).unwrap());
        }
        assert_eq!(out, v);
        assert_eq!(chunks(10, 3).count(), 3, "3-byte chunks round down to one value: 4+4+2");
    }

    #[test]
    fn refuses_ragged_overrun_and_flags_nonfinite() {
        let mut out = vec![0.0; 4];
        assert_eq!(decode_into(&[0; 5], 0, &mut out), Err(Error::Ragged(5)));
        assert!(matches!(decode_into(&[0; 8], 3, &mut out), Err(Error::Overrun { .. })));
        assert!(matches!(decode_into(&[0; 8], u64::MAX, &mut out), Err(Error::Overrun { .. })));
        let bad = encode(&[1.0, f32::NAN], BytesMut::new());
        assert_eq!(decode_into(&bad, 0, &mut out), Ok(false));
        let inf = encode(&[f32::INFINITY], BytesMut::new());
        assert_eq!(decode_into(&inf, 0, &mut out), Ok(false));
    }

    #[test]
    fn reassembles_in_order_only() {
        let v: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let b = encode(&v, BytesMut::new());
        let mut out = vec![0.0; 10];
        let mut r = Reassembly::new(&mut out);
        r.push(0, &b[..16]).unwrap();
        assert_eq!(r.push(0, &b[..16]), Err(StreamError::OutOfOrder { offset: 0, expected: 4 }));
        assert!(matches!(r.push(4, &[0; 64]), Err(StreamError::Chunk(Error::Overrun { .. }))));
        r.push(4, &b[16..]).unwrap();
        assert_eq!(r.finish(), Ok((true, 40)));
        assert_eq!(out, v);
        let mut out = vec![0.0; 10];
        let mut r = Reassembly::new(&mut out);
        r.push(0, &b[..8]).unwrap();
        assert_eq!(r.finish(), Err(StreamError::Short { received: 2, len: 10 }));
    }

    #[test]
    fn checking_refuses_what_reassembly_refuses() {
        let v: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let b = encode(&v, BytesMut::new());
        let mut r = Reassembly::checking(10);
        r.push(0, &b[..16]).unwrap();
        assert_eq!(r.push(0, &b[..16]), Err(StreamError::OutOfOrder { offset: 0, expected: 4 }));
        assert!(matches!(r.push(4, &[0; 64]), Err(StreamError::Chunk(Error::Overrun { .. }))));
        assert!(matches!(r.push(4, &[0; 5]), Err(StreamError::Chunk(Error::Ragged(5)))));
        r.push(4, &b[16..]).unwrap();
        assert_eq!((r.received(), r.finite()), (10, true));
        assert_eq!(r.finish(), Ok((true, 40)));
        // It does not read the values; reassembling does.
        let bad = encode(&[1.0, f32::NAN, f32::NEG_INFINITY], BytesMut::new());
        let mut r = Reassembly::checking(3);
        r.push(0, &bad).unwrap();
        assert_eq!(r.finish(), Ok((true, 12)));
        let mut out = [0.0; 3];
        let mut r = Reassembly::new(&mut out);
        r.push(0, &bad).unwrap();
        assert_eq!(r.finish(), Ok((false, 12)));
        assert!(all_finite(&[0.0, -1.0, f32::MAX, f32::MIN_POSITIVE / 2.0]));
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN] {
            let mut v = vec![1.0f32; 100];
            v[77] = bad;
            assert!(!all_finite(&v), "{bad}");
            // The same values as a payload, read where they lie, from an odd address too.
            let wire = encode(&v, BytesMut::new());
            assert!(!all_finite_le(&wire), "{bad}");
            let mut odd = vec![0u8];
            odd.extend_from_slice(&wire);
            assert!(!all_finite_le(&odd[1..]), "{bad}");
            v[77] = 1.0;
            assert!(all_finite_le(&encode(&v, BytesMut::new())));
        }
    }

    #[test]
    fn reclaims_the_allocation() {
        let b = encode(&[1.0; 256], BytesMut::with_capacity(4096));
        let s = b.slice(0..16);
        drop(s);
        assert!(reclaim(Some(b)).capacity() >= 1024);
    }
}
