//! Ring reduce-scatter, all-gather and all-reduce (Patarasuk & Yuan; the MPICH and NCCL
//! ring), pipelined in chunks.
//!
//! The buffer is cut into `W` segments (as even as possible), and each segment into `m`
//! chunks of at most `chunk_bytes`. Rank `r` only ever sends to `r + 1` and receives from
//! `r - 1`. With `W = 4`, segments `a b c d`, and `x+y` meaning a partial sum:
//!
//! ```text
//! reduce-scatter: at step s rank r sends segment r-1-s and adds what arrives into r-2-s
//!
//!   step 0   rank0 --d--> rank1 --a--> rank2 --b--> rank3 --c--> rank0
//!   step 1   rank0 -c+d-> rank1 -d+a-> rank2 -a+b-> rank3 -b+c-> rank0
//!   step 2   rank0 -b..d> rank1 -c..a> rank2 -d..b> rank3 -a..c> rank0
//!   after:   rank r holds the full sum of segment r
//!
//! all-gather: at step s rank r sends segment r-s and stores what arrives in r-s-1
//!
//!   step 0   rank0 --A--> rank1 --B--> rank2 --C--> rank3 --D--> rank0
//!   step 1   rank0 --D--> rank1 --A--> rank2 --B--> rank3 --C--> rank0
//!   step 2   rank0 --C--> rank1 --D--> rank2 --A--> rank3 --B--> rank0
//!   after:   every rank holds every full segment
//! ```
//!
//! What a rank receives at one step is exactly what it sends at the next, so the operation is
//! one stream: each chunk, once received (and reduced), is queued on the sender thread at
//! once, and goes out while the next chunk comes in (the transport's `Duplex`
//! engine keeps both directions busy). Each rank sends and receives
//! `2 (W-1)/W` of the buffer, the lower bound for all-reduce; the reduction is a plain
//! vectorised add over data still in cache.

use super::error::{CollectiveError, Result};
use super::link::{Links, Op};
use super::reduce::Values;
use super::segment;

/// Which halves of the all-reduce to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phases {
    /// Reduce-scatter only: rank `r` ends with the sum of segment `r`.
    ReduceScatter,
    /// All-gather only: every rank ends with every rank's segment.
    AllGather,
    /// Both: all-reduce.
    Both,
}

/// Run `phases` of the ring over `buf`, which holds `values`.
pub(crate) fn run(
    links: &mut impl Links,
    buf: &mut [f32],
    phases: Phases,
    op: Op,
    values: Values,
) -> Result<()> {
    let (w, r) = (links.world(), links.rank());
    if w == 1 {
        return Ok(());
    }
    let n = buf.len();
    let m = segment(n, w, 0).len().div_ceil(links.chunk_values()).max(1);

    // Chunk `j` of segment `k` is `slots[k * m + j]`: disjoint exclusive views of `buf` that
    // travel to the sender thread and back.
    let mut slots: Vec<Option<&mut [f32]>> = Vec::with_capacity(w * m);
    let mut rest = buf;
    for k in 0..w {
        let seg_len = segment(n, w, k).len();
        let (mut seg, tail) = rest.split_at_mut(seg_len);
        rest = tail;
        for j in 0..m {
            let (c, tail) = seg.split_at_mut(segment(seg_len, m, j).len());
            slots.push(Some(c));
            seg = tail;
        }
    }
    let at = |x: usize| (r + 2 * w - x) % w; // segment r - x, mod w
    // (segment sent, segment received, reduce?) per step.
    let mut steps = Vec::with_capacity(2 * w);
    if phases != Phases::AllGather {
        steps.extend((0..w - 1).map(|s| (at(1 + s), at(2 + s), true)));
    }
    if phases != Phases::ReduceScatter {
        steps.extend((0..w - 1).map(|s| (at(s), at(s + 1), false)));
    }
    links.over_neighbours(op, values, n * 4, |pump| {
        let first = steps[0].0;
        for id in first * m..(first + 1) * m {
            pump.send(id, take_ready(&mut slots, id)?)?;
        }
        for (i, &(_, from, reduce)) in steps.iter().enumerate() {
            let forward = i + 1 < steps.len();
            for (id, slot) in slots.iter_mut().enumerate().skip(from * m).take(m) {
                // The chunk may still be on its way out from an earlier step.
                let c = match slot.take() {
                    Some(c) => c,
                    None => pump.take_back(id)?,
                };
                pump.recv(c, reduce)?;
                if forward {
                    pump.send(id, c)?;
                } else {
                    *slot = Some(c);
                }
            }
        }
        Ok(())
    })
}

fn take_ready<'b>(slots: &mut [Option<&'b mut [f32]>], id: usize) -> Result<&'b mut [f32]> {
    slots[id].take().ok_or_else(|| CollectiveError::Invalid {
        what: "ring schedule",
        why: format!("chunk {id} is not here"),
    })
}
