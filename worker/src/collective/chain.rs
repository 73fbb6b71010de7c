//! Rooted collectives: broadcast and reduce as pipelined chains along the ring, gather,
//! scatter and send/recv as direct transfers.
//!
//! ```text
//! broadcast from root 1, W = 4 (chunks flow right, each rank forwards as it receives):
//!   rank1 --c0 c1 c2--> rank2 --c0 c1 c2--> rank3 --c0 c1 c2--> rank0
//!
//! reduce to root 1, W = 4 (the chain starts right of the root and ends at it):
//!   rank2 --x2--> rank3 --x2+x3--> rank0 --x2+x3+x0--> rank1 (adds x1: the sum)
//! ```
//!
//! With chunks in flight on every link at once, a chain moves the buffer in about the time of
//! one transfer plus `W - 2` chunks, and no rank sends more than the buffer once, unlike a
//! root that sends to every rank in turn.

use super::check_rank;
use super::error::{CollectiveError, Result};
use super::link::{Links, Op};
use super::reduce::Values;

/// The buffer as chunks of at most `chunk` values (at least one, possibly empty, chunk).
fn chunks(buf: &mut [f32], chunk: usize) -> Vec<&mut [f32]> {
    if buf.is_empty() { vec![buf] } else { buf.chunks_mut(chunk.max(1)).collect() }
}

/// Pipelined chain broadcast of `buf` from `root`.
pub(crate) fn broadcast(comm: &mut impl Links, buf: &mut [f32], root: usize, values: Values) -> Result<()> {
    let (w, r) = (comm.world(), comm.rank());
    check_rank("root", root, w)?;
    if w == 1 {
        return Ok(());
    }
    let pos = (r + w - root) % w;
    chain(comm, buf, (Op::Broadcast, values), pos == 0, pos + 1 < w, false)
}

/// Pipelined chain reduction of `buf` into `root`.
pub(crate) fn reduce(comm: &mut impl Links, buf: &mut [f32], root: usize, values: Values) -> Result<()> {
    let (w, r) = (comm.world(), comm.rank());
    check_rank("root", root, w)?;
    if w == 1 {
        return Ok(());
    }
    let pos = (r + w - root - 1) % w;
    chain(comm, buf, (Op::Reduce, values), pos == 0, pos + 1 < w, true)
}

/// One link of a chain: the head sends its own chunks; every other rank receives each chunk
/// from the left (adding it into its own when `add`) and, unless it is the tail, forwards it.
fn chain(
    comm: &mut impl Links,
    buf: &mut [f32],
    (op, values): (Op, Values),
    head: bool,
    forward: bool,
    add: bool,
) -> Result<()> {
    let bytes = buf.len() * 4;
    let parts = chunks(buf, comm.chunk_values());
    comm.over_neighbours(op, values, bytes, |pump| {
        for (id, c) in parts.into_iter().enumerate() {
            if !head {
                pump.recv(c, add)?;
            }
            if head || forward {
                pump.send(id, c)?;
            }
        }
        Ok(())
    })
}

/// Every rank's `send` into `root`'s `out`, in rank order.
pub(crate) fn gather(comm: &mut impl Links, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
    let (w, r) = (comm.world(), comm.rank());
    check_rank("root", root, w)?;
    let n = send.len();
    if r != root {
        return send_to(comm, send, root, Op::Gather);
    }
    if out.len() != n * w {
        return Err(CollectiveError::Invalid {
            what: "gather output",
            why: format!("holds {} values, {w} ranks x {n} need {}", out.len(), n * w),
        });
    }
    for peer in 0..w {
        let dst = &mut out[peer * n..(peer + 1) * n];
        if peer == r {
            dst.copy_from_slice(send);
        } else {
            recv_from(comm, dst, peer, Op::Gather)?;
        }
    }
    Ok(())
}

/// `root`'s `src`, cut in `world` equal pieces, one into each rank's `recv`.
pub(crate) fn scatter(comm: &mut impl Links, src: &[f32], recv: &mut [f32], root: usize) -> Result<()> {
    let (w, r) = (comm.world(), comm.rank());
    check_rank("root", root, w)?;
    let n = recv.len();
    if r != root {
        return recv_from(comm, recv, root, Op::Scatter);
    }
    if src.len() != n * w {
        return Err(CollectiveError::Invalid {
            what: "scatter input",
            why: format!("holds {} values, {w} ranks x {n} need {}", src.len(), n * w),
        });
    }
    for peer in 0..w {
        let piece = &src[peer * n..(peer + 1) * n];
        if peer == r {
            recv.copy_from_slice(piece);
        } else {
            send_to(comm, piece, peer, Op::Scatter)?;
        }
    }
    Ok(())
}

/// Send `buf` to `peer` in chunks.
pub(crate) fn send_to(comm: &mut impl Links, buf: &[f32], peer: usize, op: Op) -> Result<()> {
    check_rank("peer", peer, comm.world())?;
    let chunk = comm.chunk_values();
    // At least one frame, so that an empty buffer is still checked on the other side.
    comm.send_frame(peer, op, &buf[..buf.len().min(chunk)])?;
    for c in buf.chunks(chunk).skip(1) {
        comm.send_frame(peer, op, c)?;
    }
    Ok(())
}

/// Receive `buf.len()` values from `peer`, chunked as [`send_to`] sends them.
pub(crate) fn recv_from(comm: &mut impl Links, buf: &mut [f32], peer: usize, op: Op) -> Result<()> {
    check_rank("peer", peer, comm.world())?;
    let chunk = comm.chunk_values();
    for c in chunks(buf, chunk) {
        comm.recv_frame(peer, op, c)?;
    }
    Ok(())
}
