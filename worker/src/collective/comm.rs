//! The host communicator, [`TcpComm`]: the [`Collective`] trait over a TCP mesh
//! ([`super::tcp`]) and, when every rank shares this host, shared-memory rings
//! ([`super::shm`]). It decides which transport carries what (the [`Links`] it hands the
//! algorithms: the rings or the socket pumps to the ring neighbours, the mesh for direct
//! transfers), counts the traffic, and after a failure tells every peer whom to blame and
//! refuses further calls.

use std::net::TcpListener;
use std::ops::Range;

use super::frame::{read_frame, write_frame};
use super::link::{Duplex, Links, Op};
use super::reduce::Values;
use super::ring::Phases;
use super::shm::Shm;
use super::tcp::{Mesh, MeshInfo};
use super::{
    Collective, CommError, Half, Result, RingConfig, Traffic, Transport, chain, pump, ring, segment,
};

/// The host backend: a full mesh of TCP links, and shared-memory rings to the ring
/// neighbours when they are on this host.
pub struct TcpComm {
    rank: usize,
    world: usize,
    cfg: RingConfig,
    mesh: Mesh,
    /// Cache-sized room the socket engines reduce through.
    scratch: Vec<f32>,
    /// This host's cores, and how many ranks share them (ranks whose ring address has this
    /// rank's IP): what the socket engine is picked by ([`pump::engine`]).
    cores: usize,
    ranks_here: usize,
    traffic: Traffic,
    /// Set when an operation failed part-way: the streams are out of step from then on.
    poisoned: Option<String>,
    /// The shared-memory rings to the neighbours, when the ring uses them.
    shm: Option<Box<Shm>>,
}

impl TcpComm {
    /// Connect the mesh (see [`MeshInfo`]) on `listener`, already bound and published as
    /// `info.addrs[info.rank]`, then agree with every peer on the transport of the ring.
    pub fn connect(listener: TcpListener, info: &MeshInfo, cfg: RingConfig) -> Result<TcpComm> {
        let (rank, world) = (info.rank, info.addrs.len());
        let mut mesh = Mesh::connect(listener, info, &cfg)?;
        let shm = Shm::setup(mesh.links_mut(), rank, &cfg)?.map(Box::new);
        let scratch = vec![0.0; cfg.chunk_values().min(1 << 16)];
        let me = info.addrs[rank].ip();
        let ranks_here = info.addrs.iter().filter(|a| a.ip() == me).count();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(TcpComm {
            rank,
            world,
            cfg,
            mesh,
            scratch,
            cores,
            ranks_here,
            traffic: Traffic::default(),
            poisoned: None,
            shm,
        })
    }

    /// A communicator of one rank (no sockets).
    pub fn single(cfg: RingConfig) -> TcpComm {
        TcpComm {
            rank: 0,
            world: 1,
            cfg,
            mesh: Mesh::single(),
            scratch: Vec::new(),
            cores: 1,
            ranks_here: 1,
            traffic: Traffic::default(),
            poisoned: None,
            shm: None,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Payload bytes moved so far.
    pub fn traffic(&self) -> Traffic {
        self.traffic
    }

    /// What the ring and chain collectives run on: [`Transport::Shm`] or [`Transport::Tcp`]
    /// (never `Auto`: that has been decided at connection).
    pub fn transport(&self) -> Transport {
        if self.shm.is_some() { Transport::Shm } else { Transport::Tcp }
    }

    /// Run one operation, refusing to start after an earlier failure (the streams would be
    /// out of step) and remembering a failure for the next call.
    fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.poisoned {
            return Err(CommError::Invalid {
                what: "communicator",
                why: format!("{} after an earlier failure: {why}", op.name()),
            });
        }
        let out = f(self).map_err(|e| self.mesh.blame(e, self.cfg.timeout));
        if let Err(e) = &out
            && !matches!(e, CommError::Invalid { .. })
        {
            self.poisoned = Some(e.to_string());
            // Tell every peer whom to blame (this rank, if nobody else).
            self.mesh.abort(e.culprit().unwrap_or(self.rank));
            // Neighbours asleep on the shared-memory rings: the notice is on the links by now.
            if let Some(shm) = &self.shm {
                shm.abort();
            }
        }
        out
    }
}

impl Links for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn chunk_values(&self) -> usize {
        self.cfg.chunk_values()
    }

    fn over_neighbours<'b, T>(
        &mut self,
        op: Op,
        values: Values,
        bytes: usize,
        body: impl FnOnce(&mut dyn Duplex<'b>) -> Result<T>,
    ) -> Result<T> {
        let (w, r) = (self.world, self.rank);
        let timeout = self.cfg.timeout;
        let (out, moved) = match &self.shm {
            Some(shm) => shm.duplex(op, values, timeout, body)?,
            None => {
                let (reader, writer) = self.mesh.neighbours()?;
                let sides = ((r + w - 1) % w, (r + 1) % w);
                let engine = pump::engine(self.cfg.engine, bytes, self.cores, self.ranks_here);
                pump::duplex(engine, reader, writer, sides, op, values, timeout, &mut self.scratch, body)?
            }
        };
        self.traffic += moved;
        Ok(out)
    }

    fn send_frame(&mut self, peer: usize, op: Op, vals: &[f32]) -> Result<()> {
        let t = self.cfg.timeout;
        self.traffic.sent += write_frame(&mut self.mesh.link(peer)?.writer, op, Values::F32, vals, peer, t)?;
        Ok(())
    }

    fn recv_frame(&mut self, peer: usize, op: Op, dst: &mut [f32]) -> Result<()> {
        let t = self.cfg.timeout;
        self.traffic.recv += read_frame(&mut self.mesh.link(peer)?.reader, op, dst, peer, t)?;
        Ok(())
    }
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpComm(rank {} of {})", self.rank, self.world)
    }
}

impl Collective for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllReduce, |c| ring::run(c, buf, Phases::Both, Op::AllReduce, Values::F32))
    }

    fn all_reduce_half(&mut self, packed: &mut [f32], half: Half) -> Result<()> {
        self.guarded(Op::AllReduce, |c| {
            ring::run(c, packed, Phases::Both, Op::AllReduce, Values::Packed(half))
        })
    }

    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        let mine = segment(buf.len(), self.world, self.rank);
        self.guarded(Op::ReduceScatter, |c| {
            ring::run(c, buf, Phases::ReduceScatter, Op::ReduceScatter, Values::F32)
        })?;
        Ok(mine)
    }

    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllGather, |c| ring::run(c, buf, Phases::AllGather, Op::AllGather, Values::F32))
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Broadcast, |c| chain::broadcast(c, buf, root))
    }

    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Reduce, |c| chain::reduce(c, buf, root))
    }

    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Gather, |c| chain::gather(c, send, out, root))
    }

    fn scatter(&mut self, src: &[f32], recv: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Scatter, |c| chain::scatter(c, src, recv, root))
    }

    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(CommError::Invalid {
                what: "peer",
                why: format!("rank {peer} cannot send to itself"),
            });
        }
        self.guarded(Op::SendRecv, |c| chain::send_to(c, buf, peer, Op::SendRecv))
    }

    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(CommError::Invalid {
                what: "peer",
                why: format!("rank {peer} cannot receive from itself"),
            });
        }
        self.guarded(Op::SendRecv, |c| chain::recv_from(c, buf, peer, Op::SendRecv))
    }

    fn barrier(&mut self) -> Result<()> {
        let world = self.world;
        self.guarded(Op::Barrier, |c| {
            let mut one = [1.0f32];
            ring::run(c, &mut one, Phases::Both, Op::Barrier, Values::F32)?;
            if one[0] != world as f32 {
                return Err(CommError::Protocol {
                    peer: (c.rank + 1) % world,
                    why: format!("barrier counted {} ranks, expected {world}", one[0]),
                });
            }
            Ok(())
        })
    }
}
