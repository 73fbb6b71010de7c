//! Where a push's values come from and where a pull's go: [`Gradients`] builds each gradient
//! chunk's message straight from its source, [`ChunkSink`] takes each parameter chunk as it
//! arrives; the host-buffer implementations of both, and [`Encoded`], a gradient compressed
//! for the wire (`--compress`). (The engine's are in `engine.rs`.)

use std::ops::Range;

use anyhow::Context;
use gradsync_core::compress::{self, Half, Sparse};
use gradsync_proto::frames::FramedChunk;
use gradsync_proto::pb::{Encoding, GradientChunk};
use gradsync_proto::tag::GRADIENT_DATA;
use gradsync_proto::wire;

/// Where a push's gradient values come from.
pub trait Gradients {
    /// The message `head` carrying `values` (of the whole flat buffer) as its payload, written
    /// straight into the message's buffer.
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk>;

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
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk> {
        match self {
            Encoded::Half(h, grads) => {
                let src = grads
                    .get(values.clone())
                    .with_context(|| format!("values {values:?} of {}", grads.len()))?;
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
                    u32::try_from(values.start as u64 - head.offset).context("a shard past u32 indices")?;
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
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk> {
        let src =
            self.0.get(values.clone()).with_context(|| format!("values {values:?} of {}", self.0.len()))?;
        // Appended as they are (no zeroing first).
        Ok(FramedChunk::build(head, GRADIENT_DATA, head.offset, src.len() * 4, |buf| wire::put_f32(src, buf)))
    }
}

/// Where one shard's pulled chunks go.
pub trait ChunkSink {
    /// Put the chunk `payload` (little-endian f32) at `offset` values of the shard's range.
    fn put(&mut self, payload: &[u8], offset: u64) -> Result<(), tonic::Status>;
    /// The shard's range length, values.
    fn values(&self) -> usize;
}

/// A shard's slice of a host buffer.
pub struct HostSlice<'a>(pub &'a mut [f32]);

impl ChunkSink for HostSlice<'_> {
    fn put(&mut self, payload: &[u8], offset: u64) -> Result<(), tonic::Status> {
        wire::copy_into(payload, offset, self.0).map_err(|e| tonic::Status::data_loss(e.to_string()))
    }

    fn values(&self) -> usize {
        self.0.len()
    }
}
