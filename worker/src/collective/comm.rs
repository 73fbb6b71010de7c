//! The host communicator, [`TcpComm`]: the [`Collective`] trait over a TCP mesh
//! ([`super::tcp`]) and, when ranks share a host, shared-memory rings ([`super::shm`]). It
//! takes the set-up's decision (`hier`: one flat ring on shared memory or sockets, or a
//! hierarchical all-reduce), hands the algorithms the group of ranks they run over
//! (`group`), counts the traffic, and after a failure tells every peer whom to blame and
//! refuses further calls.

use std::net::TcpListener;
use std::ops::Range;

use super::error::{CollectiveError, Result};
use super::group::{Group, Net};
use super::hier::{self, Hier};
use super::link::Op;
use super::reduce::Values;
use super::ring::Phases;
use super::shm::Shm;
use super::tcp::{Mesh, MeshInfo};
use super::{Collective, Half, RingConfig, Traffic, Transport, chain, ring, segment};

/// The host backend: a full mesh of TCP links, shared-memory rings to the ring neighbours
/// when they are on this host, and the hosts' hierarchy when all-reduce goes through it.
pub struct TcpComm {
    rank: usize,
    world: usize,
    /// Every rank, in ring order: the flat ring's members.
    everyone: Vec<usize>,
    net: Net,
    /// Set when an operation failed part-way: the streams are out of step from then on.
    poisoned: Option<String>,
    /// The shared-memory rings to the neighbours, when the flat ring uses them.
    shm: Option<Box<Shm>>,
    /// This rank's host and its leaders, when all-reduce is hierarchical.
    hier: Option<Box<Hier>>,
}

impl TcpComm {
    /// Connect the mesh (see [`MeshInfo`]) on `listener`, already bound and published as
    /// `info.addrs[info.rank]`, then agree with every peer on the transport of the ring and
    /// on the hierarchy.
    pub fn connect(listener: TcpListener, info: &MeshInfo, mut cfg: RingConfig) -> Result<TcpComm> {
        let (rank, world) = (info.rank, info.addrs.len());
        let mut mesh = Mesh::connect(listener, info, &cfg)?;
        let decided = hier::setup(&mut mesh, rank, &cfg)?;
        // A flat ring on sockets whose ranks crowd a machine's cores cuts smaller chunks; every
        // rank takes the same decision from the same survey, so they cut the same chunks.
        if cfg.chunk_auto && decided.crowded && decided.rings.is_none() && decided.hier.is_none() {
            cfg.chunk_bytes = cfg.chunk_bytes.min(super::CROWDED_CHUNK_BYTES);
        }
        let scratch = vec![0.0; cfg.chunk_values().min(1 << 16)];
        // Ranks on this machine, as they said (emulated hosts and containers on one machine
        // share its cores); else those at this rank's address.
        let me = info.addrs[rank].ip();
        let ranks_here =
            decided.sharing_cores.unwrap_or_else(|| info.addrs.iter().filter(|a| a.ip() == me).count());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(TcpComm {
            rank,
            world,
            everyone: (0..world).collect(),
            net: Net { mesh, scratch, traffic: Traffic::default(), cfg, cores, ranks_here },
            poisoned: None,
            shm: decided.rings,
            hier: decided.hier,
        })
    }

    /// A communicator of one rank (no sockets).
    pub fn single(cfg: RingConfig) -> TcpComm {
        TcpComm {
            rank: 0,
            world: 1,
            everyone: vec![0],
            net: Net {
                mesh: Mesh::single(),
                scratch: Vec::new(),
                traffic: Traffic::default(),
                cfg,
                cores: 1,
                ranks_here: 1,
            },
            poisoned: None,
            shm: None,
            hier: None,
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
        self.net.traffic
    }

    /// What the flat ring and chain collectives run on: [`Transport::Shm`] or
    /// [`Transport::Tcp`] (never `Auto`: that has been decided at connection). In a
    /// hierarchical all-reduce, what the ranks of one host run on (see [`Self::hosts`]).
    pub fn transport(&self) -> Transport {
        let host_rings = self.hier.as_deref().is_some_and(Hier::on_shm);
        if self.shm.is_some() || host_rings { Transport::Shm } else { Transport::Tcp }
    }

    /// The number of hosts when all-reduce is hierarchical (reduce inside each host, ring
    /// among one leader per host, broadcast inside), `None` when it is one flat ring.
    pub fn hosts(&self) -> Option<usize> {
        self.hier.as_deref().map(Hier::hosts)
    }

    /// How many ranks (this one included) run on this rank's machine and share its cores, as
    /// the ranks said at set-up, whatever their addresses and network namespaces; where the
    /// set-up did not run (`--transport tcp --hierarchy off`), those at this rank's IP. Large
    /// transfers get a sender thread of their own only with two cores for each of them.
    pub fn ranks_on_this_machine(&self) -> usize {
        self.net.ranks_here
    }

    /// The ring's chunk in bytes, as the ranks settled it (see [`RingConfig::chunk_auto`]).
    pub fn chunk_bytes(&self) -> usize {
        self.net.cfg.chunk_bytes
    }

    /// The flat ring: every rank, on the world's shared-memory rings or on sockets.
    fn flat(&mut self) -> Group<'_> {
        let rings =
            self.shm.as_deref().or_else(|| self.hier.as_ref().and_then(|h| h.world_rings(self.world)));
        Group::new(&mut self.net, &self.everyone, self.rank, rings)
    }

    /// Run one operation, refusing to start after an earlier failure (the streams would be
    /// out of step) and remembering a failure for the next call.
    fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.poisoned {
            return Err(CollectiveError::Invalid {
                what: "communicator",
                why: format!("{} after an earlier failure: {why}", op.name()),
            });
        }
        let out = f(self).map_err(|e| self.net.mesh.blame(e, self.net.cfg.timeout));
        if let Err(e) = &out
            && !matches!(e, CollectiveError::Invalid { .. })
        {
            self.poisoned = Some(e.to_string());
            // Tell every peer whom to blame (this rank, if nobody else).
            self.net.mesh.abort(e.culprit().unwrap_or(self.rank));
            // Neighbours asleep on the shared-memory rings: the notice is on the links by now.
            if let Some(shm) = &self.shm {
                shm.abort();
            }
            if let Some(h) = &self.hier {
                h.abort();
            }
        }
        out
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
        self.net.traffic
    }

    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllReduce, |c| match &c.hier {
            Some(h) => h.all_reduce(&mut c.net, buf, Values::F32),
            None => ring::run(&mut c.flat(), buf, Phases::Both, Op::AllReduce, Values::F32),
        })
    }

    fn all_reduce_half(&mut self, packed: &mut [f32], half: Half) -> Result<()> {
        let values = Values::Packed(half);
        self.guarded(Op::AllReduce, |c| match &c.hier {
            Some(h) => h.all_reduce(&mut c.net, packed, values),
            None => ring::run(&mut c.flat(), packed, Phases::Both, Op::AllReduce, values),
        })
    }

    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        let mine = segment(buf.len(), self.world, self.rank);
        self.guarded(Op::ReduceScatter, |c| {
            ring::run(&mut c.flat(), buf, Phases::ReduceScatter, Op::ReduceScatter, Values::F32)
        })?;
        Ok(mine)
    }

    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllGather, |c| {
            ring::run(&mut c.flat(), buf, Phases::AllGather, Op::AllGather, Values::F32)
        })
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Broadcast, |c| chain::broadcast(&mut c.flat(), buf, root, Values::F32))
    }

    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Reduce, |c| chain::reduce(&mut c.flat(), buf, root, Values::F32))
    }

    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Gather, |c| chain::gather(&mut c.flat(), send, out, root))
    }

    fn scatter(&mut self, src: &[f32], recv: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Scatter, |c| chain::scatter(&mut c.flat(), src, recv, root))
    }

    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(CollectiveError::Invalid {
                what: "peer",
                why: format!("rank {peer} cannot send to itself"),
            });
        }
        self.guarded(Op::SendRecv, |c| chain::send_to(&mut c.flat(), buf, peer, Op::SendRecv))
    }

    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(CollectiveError::Invalid {
                what: "peer",
                why: format!("rank {peer} cannot receive from itself"),
            });
        }
        self.guarded(Op::SendRecv, |c| chain::recv_from(&mut c.flat(), buf, peer, Op::SendRecv))
    }

    fn barrier(&mut self) -> Result<()> {
        let world = self.world;
        self.guarded(Op::Barrier, |c| {
            let mut one = [1.0f32];
            ring::run(&mut c.flat(), &mut one, Phases::Both, Op::Barrier, Values::F32)?;
            if one[0] != world as f32 {
                return Err(CollectiveError::Protocol {
                    peer: (c.rank + 1) % world,
                    why: format!("barrier counted {} ranks, expected {world}", one[0]),
                });
            }
            Ok(())
        })
    }
}
