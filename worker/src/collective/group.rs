//! A group of ranks as the algorithms see it: [`Group`] implements [`Links`] for any subset
//! of the ranks (all of them; the ranks of one host; one leader per host), numbering them
//! `0..members.len()` in ring order. Its ring neighbours are the members before and after
//! this rank; their chunks travel over the group's shared-memory rings when it has them, over
//! the TCP mesh's links to those two members otherwise; single frames go over the mesh link
//! to the member addressed. Errors name global ranks, so a dead peer is reported by the rank
//! the user knows, whichever group it failed in.

use super::error::{CollectiveError, Result};
use super::frame::{read_frame, write_frame};
use super::link::{Duplex, Links, Op};
use super::reduce::Values;
use super::shm::Shm;
use super::tcp::Mesh;
use super::{RingConfig, Traffic, pump};

/// What every group of one communicator shares: the mesh, the room the socket engines reduce
/// through, the traffic count and the tunables.
pub(crate) struct Net {
    pub(crate) mesh: Mesh,
    /// Cache-sized room the socket engines reduce through.
    pub(crate) scratch: Vec<f32>,
    pub(crate) traffic: Traffic,
    pub(crate) cfg: RingConfig,
    /// This host's cores, and how many ranks share them (ranks whose ring address has this
    /// rank's IP): what the socket engine is picked by ([`pump::engine`]).
    pub(crate) cores: usize,
    pub(crate) ranks_here: usize,
}

/// A group of ranks over a communicator's [`Net`].
pub(crate) struct Group<'a> {
    net: &'a mut Net,
    /// Global ranks, in ring order.
    members: &'a [usize],
    /// This rank's place in `members`.
    me: usize,
    /// The group's shared-memory rings, when its ring runs on them.
    shm: Option<&'a Shm>,
}

impl<'a> Group<'a> {
    /// The group of `members` (global ranks in ring order), this rank being `members[me]`.
    pub(crate) fn new(net: &'a mut Net, members: &'a [usize], me: usize, shm: Option<&'a Shm>) -> Group<'a> {
        Group { net, members, me, shm }
    }

    /// The global rank of member `i`.
    fn global(&self, i: usize) -> Result<usize> {
        self.members.get(i).copied().ok_or_else(|| CollectiveError::Invalid {
            what: "peer",
            why: format!("member {i} is not below the group's size {}", self.members.len()),
        })
    }
}

impl Links for Group<'_> {
    fn rank(&self) -> usize {
        self.me
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    fn chunk_values(&self) -> usize {
        self.net.cfg.chunk_values()
    }

    fn over_neighbours<'b, T>(
        &mut self,
        op: Op,
        values: Values,
        bytes: usize,
        body: impl FnOnce(&mut dyn Duplex<'b>) -> Result<T>,
    ) -> Result<T> {
        let (w, r) = (self.members.len(), self.me);
        let timeout = self.net.cfg.timeout;
        let (out, moved) = match self.shm {
            Some(shm) => shm.duplex(op, values, timeout, body)?,
            None => {
                let sides = (self.global((r + w - 1) % w)?, self.global((r + 1) % w)?);
                let (reader, writer) = self.net.mesh.pair(sides.0, sides.1)?;
                let engine = pump::engine(self.net.cfg.engine, bytes, self.net.cores, self.net.ranks_here);
                let scratch = &mut self.net.scratch;
                pump::duplex(engine, reader, writer, sides, op, values, timeout, scratch, body)?
            }
        };
        self.net.traffic += moved;
        Ok(out)
    }

    fn send_frame(&mut self, peer: usize, op: Op, vals: &[f32]) -> Result<()> {
        let (peer, t) = (self.global(peer)?, self.net.cfg.timeout);
        self.net.traffic.sent +=
            write_frame(&mut self.net.mesh.link(peer)?.writer, op, Values::F32, vals, peer, t)?;
        Ok(())
    }

    fn recv_frame(&mut self, peer: usize, op: Op, dst: &mut [f32]) -> Result<()> {
        let (peer, t) = (self.global(peer)?, self.net.cfg.timeout);
        self.net.traffic.recv += read_frame(&mut self.net.mesh.link(peer)?.reader, op, dst, peer, t)?;
        Ok(())
    }
}
