//! The seam between the collective algorithms and the transports under them: the operation
//! tags every frame carries ([`Op`]), the full-duplex engine a transport provides to the ring
//! neighbours ([`Duplex`]: the socket pumps of `pump`, the shared-memory rings of `shm`), and
//! what an algorithm may ask of a communicator's links ([`Links`]). The algorithms (`ring`,
//! `chain`) see nothing else, so they never know which transport moves their chunks.

use super::error::{CollectiveError, Result};
use super::reduce::Values;

/// Which collective a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Op {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Reduce = 5,
    Gather = 6,
    Scatter = 7,
    SendRecv = 8,
    Barrier = 9,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
            Op::SendRecv => "send/recv",
            Op::Barrier => "barrier",
        }
    }

    pub(crate) fn from_tag(t: u32) -> Option<Op> {
        [
            Op::AllReduce,
            Op::ReduceScatter,
            Op::AllGather,
            Op::Broadcast,
            Op::Reduce,
            Op::Gather,
            Op::Scatter,
            Op::SendRecv,
            Op::Barrier,
        ]
        .into_iter()
        .find(|o| *o as u32 == t)
    }
}

/// What the ring and chain algorithms drive: chunks out to the right, frames in from the left.
/// The algorithm calls it as if it were blocking; whenever one call waits, both directions
/// make progress.
pub(crate) trait Duplex<'b> {
    /// Queue `chunk` (known as `id`) to be sent to the right.
    fn send(&mut self, id: usize, chunk: &'b mut [f32]) -> Result<()>;
    /// Chunk `id`, once it has been sent.
    fn take_back(&mut self, id: usize) -> Result<&'b mut [f32]>;
    /// Receive the next frame from the left into `dst` (added into it when `add`).
    fn recv(&mut self, dst: &mut [f32], add: bool) -> Result<()>;
}

/// What an algorithm needs from a communicator: who it is, how large a chunk is, a duplex
/// engine to its ring neighbours, and single frames to any peer. The communicator picks the
/// transport behind each; it also counts the traffic.
pub(crate) trait Links {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Values per pipelined chunk.
    fn chunk_values(&self) -> usize;
    /// Run `body` over a duplex engine to the ring neighbours, for an operation on a buffer
    /// of `bytes` holding `values`; returns `body`'s result once everything it queued has
    /// been sent.
    fn over_neighbours<'b, T>(
        &mut self,
        op: Op,
        values: Values,
        bytes: usize,
        body: impl FnOnce(&mut dyn Duplex<'b>) -> Result<T>,
    ) -> Result<T>;
    /// Send one frame of `vals` to `peer`.
    fn send_frame(&mut self, peer: usize, op: Op, vals: &[f32]) -> Result<()>;
    /// Receive one frame of exactly `dst.len()` values from `peer`.
    fn recv_frame(&mut self, peer: usize, op: Op, dst: &mut [f32]) -> Result<()>;
}

/// Chunk `id` if the sender is done with it, an error if it was never `queued`, `None` while
/// it is still on its way out (for the engines' `take_back`).
pub(crate) fn returned<'b>(
    sent_back: &mut Vec<(usize, &'b mut [f32])>,
    queued: bool,
    id: usize,
) -> Option<Result<&'b mut [f32]>> {
    if let Some(i) = sent_back.iter().position(|(k, _)| *k == id) {
        return Some(Ok(sent_back.swap_remove(i).1));
    }
    (!queued).then(|| {
        Err(CollectiveError::Invalid { what: "ring schedule", why: format!("chunk {id} was never sent") })
    })
}
