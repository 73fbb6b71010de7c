//! Where a push's values come from and where a pull's go: [`Gradients`] builds each gradient
//! chunk's message straight from its source, [`ChunkSink`] takes each parameter chunk as it
//! arrives; the host-buffer implementations of both ([`SharedGrads`] sends its values without
//! copying them), and [`Encoded`], a gradient compressed for the wire (`--compress`). (The
//! engine's are in `engine.rs`.)

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use gradsync_core::compress::{self, Half, Sparse};
use gradsync_proto::frames::FramedChunk;
use gradsync_proto::pb::{Encoding, GradientChunk};
use gradsync_proto::tag::GRADIENT_DATA;
use gradsync_proto::wire;

use super::error::{PsError, Result};

/// Where a push's gradient values come from.
pub trait Gradients {
    /// The message `head` carrying `values` (of the whole flat buffer) as its payload, written
    /// straight into the message's buffer (or lent it, [`SharedGrads`]).
    /// A source that fails says why in its own terms: a device's copy that failed is a core
    /// error ([`PsError::Core`]).
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> Result<FramedChunk>;

    /// The length of the flat buffer the values come from, where the source knows it (checked
    /// against the model's before anything is sent).
    fn values(&self) -> Option<usize> {
        None
    }

    /// Payload bytes the chunk of `values` puts on the wire (f32: 4 per value).
    fn wire_bytes(&self, values: Range<usize>) -> u64 {
        values.len() as u64 * 4
    }
}

/// A gradient in a compressed form (`--compress`), read from the engine to the host first.
pub enum Encoded<'a> {
    /// Every value of the whole flat buffer, sent in half precision.
    Half(Half, &'a [f32]),
    /// Top-k pairs over the whole flat buffer (indices ascending): each chunk carries the
    /// pairs that fall in the values it covers, its indices counted from the shard's start.
    Sparse(&'a Sparse),
}

impl Gradients for Encoded<'_> {
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> Result<FramedChunk> {
        match self {
            Encoded::Half(h, grads) => {
                let src = grads.get(values.clone()).ok_or_else(|| past_the_end(&values, grads.len()))?;
                let encoding = match h {
                    Half::F16 => Encoding::F16,
                    Half::Bf16 => Encoding::Bf16,
                };
                let head = GradientChunk { encoding: encoding.into(), ..head.clone() };
                let mut fault = None;
                let c = FramedChunk::build(&head, GRADIENT_DATA, head.offset, src.len() * 2, |buf| {
                    let at = buf.len();
                    buf.resize(at + src.len() * 2, 0);
                    fault = h.encode(src, &mut buf[at..]).err();
                });
                fault.map_or(Ok(c), |e| Err(e.into()))
            }
            Encoded::Sparse(s) => {
                // The shard's first value: `head.offset` counts from it.
                let base =
                    u32::try_from(values.start as u64 - head.offset).map_err(|_| PsError::Invalid {
                        what: "a top-k push",
                        why: format!(
                            "value {} of a shard is past u32 indices",
                            values.start as u64 - head.offset
                        ),
                    })?;
                let pairs = s.within(values.clone());
                let mut indices = Vec::new();
                compress::put_indices(&s.indices[pairs.clone()], base, &mut indices);
                let head = GradientChunk {
                    encoding: Encoding::Sparse.into(),
                    indices: indices.into(),
                    span: values.len() as u64,
                    ..head.clone()
                };
                let vals = &s.values[pairs];
                Ok(FramedChunk::build(&head, GRADIENT_DATA, head.offset, vals.len() * 4, |buf| {
                    wire::put_f32(vals, buf)
                }))
            }
        }
    }

    fn values(&self) -> Option<usize> {
        match self {
            Encoded::Half(_, grads) => Some(grads.len()),
            // Pairs, not values: the chunks check their spans.
            Encoded::Sparse(_) => None,
        }
    }

    fn wire_bytes(&self, values: Range<usize>) -> u64 {
        match self {
            Encoded::Half(..) => values.len() as u64 * 2,
            Encoded::Sparse(s) => s.within(values).len() as u64 * 8,
        }
    }
}

/// A host buffer of the whole flat length.
pub struct HostGrads<'a>(pub &'a [f32]);

impl Gradients for HostGrads<'_> {
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> Result<FramedChunk> {
        let src = self.0.get(values.clone()).ok_or_else(|| past_the_end(&values, self.0.len()))?;
        // Appended as they are (no zeroing first).
        Ok(FramedChunk::build(head, GRADIENT_DATA, head.offset, src.len() * 4, |buf| wire::put_f32(src, buf)))
    }

    fn values(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// A host gradient buffer that pushes send from where it lies instead of copying it into
/// their messages: on a little-endian host its memory already is the payload (little-endian
/// f32), so each chunk's message is lent a view of it ([`FramedChunk::lend`]; the message's
/// head goes as a small DATA frame of its own). A view holds a clone of the buffer's `Arc`
/// until HTTP/2 has written its frame and dropped it, so the buffer is shared while a push
/// may still read it: [`SharedGrads::make_mut`] hands it out for writing in place once no
/// view is left (every push of it completed), and otherwise moves to a copy, leaving the old
/// values to the frames still queued (a push that ended early, refused or past its deadline,
/// whose frames the connection has not dropped yet). It never waits. On a big-endian host
/// chunks are copied into their messages as [`HostGrads`] does.
#[derive(Debug, Clone, Default)]
pub struct SharedGrads {
    values: Arc<Vec<f32>>,
    /// How often [`SharedGrads::make_mut`] found the buffer still lent and copied it.
    copies: u64,
}

impl SharedGrads {
    /// A buffer holding `values`.
    pub fn new(values: Vec<f32>) -> Self {
        SharedGrads { values: Arc::new(values), copies: 0 }
    }

    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        &self.values
    }

    /// The buffer to write the next gradient into: this one in place when no push holds a
    /// view of it any more, otherwise a copy of it (the views keep the old values).
    pub fn make_mut(&mut self) -> &mut Vec<f32> {
        if Arc::get_mut(&mut self.values).is_none() {
            self.copies += 1;
        }
        Arc::make_mut(&mut self.values)
    }

    /// How often [`SharedGrads::make_mut`] had to copy because a push still held the buffer.
    pub fn copies(&self) -> u64 {
        self.copies
    }
}

/// A range of a shared gradient buffer as bytes: the owner of a lent payload.
struct Lent {
    values: Arc<Vec<f32>>,
    range: Range<usize>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.values[self.range.clone()])
    }
}

impl Gradients for SharedGrads {
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> Result<FramedChunk> {
        if cfg!(target_endian = "big") {
            return HostGrads(&self.values).chunk(head, values);
        }
        if values.start > values.end || values.end > self.values.len() {
            return Err(past_the_end(&values, self.values.len()));
        }
        let payload = Bytes::from_owner(Lent { values: Arc::clone(&self.values), range: values });
        Ok(FramedChunk::lend(head, GRADIENT_DATA, head.offset, payload))
    }

    fn values(&self) -> Option<usize> {
        Some(self.values.len())
    }
}

/// [`PsError::Invalid`]: a chunk of `values` asked of a gradient of `len` values.
fn past_the_end(values: &Range<usize>, len: usize) -> PsError {
    PsError::Invalid { what: "the gradient", why: format!("values {values:?} of {len}") }
}

/// Where one shard's pulled chunks go.
pub trait ChunkSink {
    /// Put the chunk `payload` (little-endian f32) at `offset` values of the shard's range.
    fn put(&mut self, payload: &[u8], offset: u64) -> std::result::Result<(), tonic::Status>;
    /// The shard's range length, values.
    fn values(&self) -> usize;
}

/// A shard's slice of a host buffer.
pub struct HostSlice<'a>(pub &'a mut [f32]);

impl ChunkSink for HostSlice<'_> {
    fn put(&mut self, payload: &[u8], offset: u64) -> std::result::Result<(), tonic::Status> {
        wire::copy_into(payload, offset, self.0).map_err(|e| tonic::Status::data_loss(e.to_string()))
    }

    fn values(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A chunk of a shared buffer is a view of it, not a copy; writing the buffer while a view
    /// is held (a push's frames still queued) moves the writer to a copy and leaves the view's
    /// bits alone; once no view is left the writer writes in place again.
    #[test]
    fn shared_grads_are_lent_and_written_in_place_only_when_free() {
        let vals: Vec<f32> = (0..100).map(|i| i as f32 * 0.5 - 9.0).collect();
        let mut g = SharedGrads::new(vals.clone());
        let head = GradientChunk { rank: 1, base_version: 4, offset: 10, ..GradientChunk::default() };
        let c = g.chunk(&head, 10..30).unwrap();
        let want = wire::encode(&vals[10..30], bytes::BytesMut::new());
        assert_eq!(c.payload(), (10, want.clone()));
        let sent: GradientChunk = c.decode().unwrap();
        assert_eq!((sent.rank, sent.base_version, sent.offset, &sent.data), (1, 4, 10, &want));
        if cfg!(target_endian = "little") {
            let at = g.as_slice()[10..].as_ptr().cast::<u8>();
            assert_eq!(c.payload().1.as_ptr(), at, "the payload was copied");
            assert_eq!(sent.data.as_ptr(), at, "decoding copied the payload");
        }
        let first = g.as_slice().as_ptr();
        g.make_mut().fill(-1.0);
        assert_eq!(g.copies(), 1, "written while lent: must move to a copy");
        assert_ne!(g.as_slice().as_ptr(), first);
        assert_eq!(c.payload().1, want, "the queued frames' values changed");
        assert_eq!(sent.data, want);
        drop((c, sent));
        let second = g.as_slice().as_ptr();
        g.make_mut().fill(2.0);
        assert_eq!((g.copies(), g.as_slice().as_ptr()), (1, second), "not written in place when free");
        assert!(g.chunk(&head, 90..101).is_err(), "a range past the buffer");
        assert_eq!(g.values(), Some(100));
    }
}
