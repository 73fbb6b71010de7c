//! Where a push's values come from and where a pull's go: [`Gradients`] builds each gradient
//! chunk's message straight from its source, [`ChunkSink`] takes each parameter chunk as it
//! arrives; the host-buffer implementations of both. (The engine's are in `engine.rs`.)

use std::ops::Range;

use anyhow::Context;
use gradsync_proto::frames::FramedChunk;
use gradsync_proto::pb::GradientChunk;
use gradsync_proto::tag::GRADIENT_DATA;
use gradsync_proto::wire;

/// Where a push's gradient values come from.
pub trait Gradients {
    /// The message `head` carrying `values` (of the whole flat buffer) as its payload, written
    /// straight into the message's buffer.
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk>;
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
