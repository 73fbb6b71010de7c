//! The hierarchical all-reduce (NCCL's and Horovod's answer to several ranks per host), and
//! the one decision every rank takes at connection: one flat ring, or hosts first.
//!
//! ```text
//! 2 hosts x 2 ranks; host A = ranks 0 1, host B = ranks 2 3; leaders 0 and 2
//!
//!   1. reduce inside each host, a chain into the leader (shared memory)
//!        rank1 --x1--> rank0 (x0+x1)          rank3 --x3--> rank2 (x2+x3)
//!   2. ring all-reduce among the leaders (TCP, across hosts)
//!        rank0 <==== reduce-scatter, all-gather ====> rank2     both hold the sum
//!   3. broadcast inside each host, a chain from the leader (shared memory)
//!        rank0 --sum--> rank1                 rank2 --sum--> rank3
//! ```
//!
//! Why: with `H` hosts of `L` ranks (`W = H L`) and ranks numbered host by host, the flat
//! ring crosses each host's link once in each direction and sends `2 (W-1)/W S` over every
//! ring link, so each host's link carries `2 (W-1)/W S` each way; the leaders' ring carries
//! `2 (H-1)/H S`. For 2 x 2 that is 1.5 S against 1 S (the inter-host lower bound for two
//! hosts), a third less time on a slow link, at the price of one reduce and one broadcast
//! over shared memory; as `L` grows the ratio tends to `2 (W-1)/W / (2 (H-1)/H)`, 2 for two
//! hosts. Placed round-robin instead (rank `r` on host `r mod H`) every flat ring link
//! crosses hosts and the ratio is `L` times larger.
//!
//! The decision ([`setup`]): every rank says where it is (`shm::survey`: boot id and network
//! namespace, or `RingConfig::host_id`); hosts are the groups of equal places, ordered by
//! their lowest rank, each holding its ranks in ascending order, its lowest the leader. With
//! `--hierarchy auto` the all-reduce is hierarchical when there are several hosts and fewer
//! hosts than ranks; `on` always, `off` never. Otherwise the flat ring runs as before: on
//! shared memory when every rank shares one place (and the transport allows), on sockets
//! else. Only all-reduce is hierarchical; the other collectives keep to the flat ring over
//! sockets (or over the host's rings when there is one host).
//!
//! Buffers of more than 64 Ki values are cut into pieces ([`pieces`], the same on every host),
//! and on a host whose ranks share memory the steps overlap: the leaders' ring crosses hosts
//! with piece `k` (on a thread of the leader) while the host reduces piece `k + 1` and then
//! broadcasts piece `k`, so the time tends to the leaders' ring alone. What nothing overlaps is
//! the reduce of the first piece and the broadcast of the last, so those two are the smallest:
//! up to 8 equal pieces, the first and the last of them cut again into halving steps down to
//! 64 Ki values (a 64 MB buffer: 0.25, 0.25, 0.5, 1, 2, 4, then six of 8, then 4, 2, 1, 0.5,
//! 0.25, 0.25 MB). Larger end pieces cost link time (8 equal pieces of a 64 MB buffer: 1-2%
//! on 1 Gbit/s links); many equal pieces cost each ring's start (64 of them: slower on
//! 10 Gbit/s links).
//!
//! Every step runs the existing algorithms (`chain`, `ring`) over a [`Group`] of ranks, so the
//! timeouts, the frames' checks and the errors naming a global rank are theirs. A rank outside
//! the leaders waits in step 3 while the leaders cross hosts: a leaders' ring longer than the
//! communicator's timeout counts as a silent leader.

use std::sync::mpsc;

use super::chain;
use super::error::{CollectiveError, Result};
use super::group::{Group, Net};
use super::link::{Links, Op};
use super::reduce::Values;
use super::ring::{self, Phases};
use super::shm::{self, Shm, Where};
use super::tcp::Mesh;
use super::{Hierarchy, RingConfig, Transport, segment};

/// Most equal pieces a buffer is cut into, so that the leaders' ring of one piece runs while
/// the host reduces the next and broadcasts the one before.
const PIECES: usize = 8;
/// Fewest values in a piece: below this, the latency of three more operations outweighs the
/// overlap.
const MIN_PIECE: usize = 1 << 16;

/// The lengths a buffer of `n` values is cut into, first to last (they depend on `n` only, so
/// every host cuts alike): `n / MIN_PIECE` equal pieces, at most [`PIECES`], and, when they
/// are larger than `2 MIN_PIECE`, the first cut into halving steps that grow towards the
/// middle (the smallest first) and the last into the same steps reversed. Public so that a
/// prediction of the hierarchical all-reduce cuts buffers as the all-reduce itself does.
pub fn pieces(n: usize) -> Vec<usize> {
    let count = n.div_ceil(MIN_PIECE).clamp(1, PIECES);
    let equal: Vec<usize> = (0..count).map(|k| segment(n, count, k).len()).collect();
    if count < 2 {
        return equal;
    }
    // `len` as steps growing by halves: ..., len/4, len/2 rounded, the smallest at least
    // MIN_PIECE.
    let ramp = |len: usize| {
        let mut steps = Vec::new();
        let mut rest = len;
        while rest >= 2 * MIN_PIECE {
            let half = rest / 2;
            steps.push(rest - half);
            rest = half;
        }
        steps.push(rest);
        steps.reverse();
        steps
    };
    let mut out = ramp(equal[0]);
    out.extend_from_slice(&equal[1..count - 1]);
    out.extend(ramp(equal[count - 1]).into_iter().rev());
    out
}

/// The ranks of each host, hosts ordered by their lowest rank, ranks ascending: the same on
/// every rank, since every rank computes it from the same survey.
fn hosts(all: &[Where]) -> Vec<Vec<usize>> {
    let mut hosts: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, w) in all.iter().enumerate() {
        match hosts.iter_mut().find(|(p, _)| *p == w.place) {
            Some((_, ranks)) => ranks.push(r),
            None => hosts.push((&w.place, vec![r])),
        }
    }
    hosts.into_iter().map(|(_, ranks)| ranks).collect()
}

/// Whether all-reduce goes through the hosts, for `hosts` hosts among `world` ranks.
fn hierarchical(h: Hierarchy, hosts: usize, world: usize) -> bool {
    match h {
        Hierarchy::Off => false,
        Hierarchy::On => world > 1,
        Hierarchy::Auto => hosts > 1 && hosts < world,
    }
}

/// Every rank must have been given the same `--transport` and `--hierarchy`: otherwise they
/// would take different decisions and wait for each other forever. The error names the first
/// rank that differs from this one.
fn agree(all: &[Where], me: usize) -> Result<()> {
    let mine = &all[me];
    if let Some((r, w)) =
        all.iter().enumerate().find(|(_, w)| w.transport != mine.transport || w.hierarchy != mine.hierarchy)
    {
        return Err(CollectiveError::Protocol {
            peer: r,
            why: format!(
                "runs with --transport {} --hierarchy {}, this rank with --transport {} --hierarchy {} \
                 (every rank must be given the same)",
                w.transport.name(),
                w.hierarchy.name(),
                mine.transport.name(),
                mine.hierarchy.name()
            ),
        });
    }
    // A rank that did not say its chunk (0) is one of an older protocol: not compared.
    let chunk = |w: &Where| (w.chunk_bytes, w.chunk_auto);
    let said = |w: &Where| w.chunk_bytes != 0;
    match all.iter().enumerate().find(|(_, w)| said(w) && said(mine) && chunk(w) != chunk(mine)) {
        None => Ok(()),
        Some((r, w)) => Err(CollectiveError::Protocol {
            peer: r,
            why: format!(
                "cuts chunks of {}, this rank of {} (every rank must be given the same --chunk-kb)",
                chunk_flag(w),
                chunk_flag(mine)
            ),
        }),
    }
}

/// A rank's chunk as its flag reads: `--chunk-kb N`, or the default it was left at.
fn chunk_flag(w: &Where) -> String {
    let size = match w.chunk_bytes {
        b if b % 1024 == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    };
    if w.chunk_auto { format!("{size} or less (no --chunk-kb)") } else { format!("{size} (--chunk-kb)") }
}

/// What the set-up decided: the flat ring's shared-memory rings (when it runs on them) and
/// the hierarchy (when all-reduce is hierarchical); and what it learnt, how many ranks share
/// this rank's machine and whether some machine has more ranks than cores (when the ranks said
/// where they are).
#[derive(Default)]
pub(crate) struct Decided {
    pub(crate) rings: Option<Box<Shm>>,
    pub(crate) hier: Option<Box<Hier>>,
    pub(crate) sharing_cores: Option<usize>,
    pub(crate) crowded: bool,
}

/// Take the decision (see the module documentation) over the freshly connected mesh, and set
/// up the shared-memory rings it calls for.
pub(crate) fn setup(mesh: &mut Mesh, rank: usize, cfg: &RingConfig) -> Result<Decided> {
    let links = mesh.links_mut();
    let world = links.len();
    if world == 1 || (cfg.transport == Transport::Tcp && cfg.hierarchy == Hierarchy::Off) {
        // Every rank is given the same flags: no rank expects the set-up lines.
        return Ok(Decided::default());
    }
    let all = shm::survey(links, rank, cfg)?;
    agree(&all, rank)?;
    let (sharing_cores, crowded) = (shm::sharing_cores(&all, rank), shm::crowded(&all));
    let hosts = hosts(&all);
    if !hierarchical(cfg.hierarchy, hosts.len(), world) {
        if cfg.transport == Transport::Tcp || !shm::decide(&all, rank)? {
            return Ok(Decided { sharing_cores, crowded, ..Decided::default() });
        }
        let everyone: Vec<usize> = (0..world).collect();
        let rings = Shm::setup(links, &everyone, rank, cfg)?.map(Box::new);
        return Ok(Decided { rings, hier: None, sharing_cores, crowded });
    }
    let (host, at) = hosts
        .iter()
        .enumerate()
        .find_map(|(h, ranks)| ranks.iter().position(|&r| r == rank).map(|at| (h, at)))
        .ok_or_else(|| CollectiveError::Invalid {
            what: "rank",
            why: format!("rank {rank} is on no host"),
        })?;
    let local = hosts[host].clone();
    let shm = match cfg.transport {
        Transport::Tcp => None,
        Transport::Auto | Transport::Shm => Shm::setup(links, &local, at, cfg)?.map(Box::new),
    };
    tracing::debug!(
        "hierarchical all-reduce: {} hosts, this one with ranks {local:?} over {}",
        hosts.len(),
        if shm.is_some() { "shared memory" } else { "sockets" }
    );
    let leaders = hosts.iter().map(|ranks| ranks[0]).collect();
    Ok(Decided {
        rings: None,
        hier: Some(Box::new(Hier { hosts: hosts.len(), host, local, at, leaders, shm })),
        sharing_cores,
        crowded,
    })
}

/// This rank's place in the hierarchy.
pub(crate) struct Hier {
    /// Number of hosts.
    hosts: usize,
    /// This rank's host.
    host: usize,
    /// The ranks of this host, ascending; the first is the leader.
    local: Vec<usize>,
    /// This rank's place in `local`.
    at: usize,
    /// Each host's leader, by host.
    leaders: Vec<usize>,
    /// The shared-memory rings among this host's ranks, when they run on them.
    shm: Option<Box<Shm>>,
}

impl Hier {
    /// Number of hosts.
    pub(crate) fn hosts(&self) -> usize {
        self.hosts
    }

    /// The host's rings, when every rank is on this host: they serve as the flat ring's too.
    pub(crate) fn world_rings(&self, world: usize) -> Option<&Shm> {
        if self.local.len() == world { self.shm.as_deref() } else { None }
    }

    /// Whether the host's ranks reach each other over shared memory.
    pub(crate) fn on_shm(&self) -> bool {
        self.shm.is_some()
    }

    /// After a failure: tell this host's ring neighbours, and wake them.
    pub(crate) fn abort(&self) {
        if let Some(shm) = &self.shm {
            shm.abort();
        }
    }

    /// Hierarchical all-reduce of `buf`, which holds `values` (see the module documentation),
    /// piece by piece.
    pub(crate) fn all_reduce(&self, net: &mut Net, buf: &mut [f32], values: Values) -> Result<()> {
        // The same pieces on every host (they depend on the length only): the leaders' rings
        // match whichever way each host runs its part.
        let lengths = pieces(buf.len());
        let count = lengths.len();
        let mut pieces = Vec::with_capacity(count);
        let mut rest = buf;
        for len in lengths {
            let (piece, tail) = rest.split_at_mut(len);
            pieces.push(piece);
            rest = tail;
        }
        match self.shm.as_deref() {
            Some(shm) if count > 1 && self.leaders.len() > 1 => self.pipelined(net, shm, pieces, values),
            _ => {
                for piece in pieces {
                    self.in_turn(net, piece, values)?;
                }
                Ok(())
            }
        }
    }

    /// One piece, one step after the other: reduce into the leader, leaders' ring, broadcast.
    fn in_turn(&self, net: &mut Net, piece: &mut [f32], values: Values) -> Result<()> {
        let shm = self.shm.as_deref();
        chain::reduce(&mut Group::new(net, &self.local, self.at, shm), piece, 0, values)?;
        if self.at == 0 {
            let mut leaders = Group::new(net, &self.leaders, self.host, None);
            if leaders.world() > 1 {
                ring::run(&mut leaders, piece, Phases::Both, Op::AllReduce, values)?;
            }
        }
        chain::broadcast(&mut Group::new(net, &self.local, self.at, shm), piece, 0, values)
    }

    /// The pieces overlapped: while the leaders' ring (on a thread of the leader, over the
    /// links to the other leaders, taken out of the mesh meanwhile) crosses hosts with piece
    /// `k`, the host's rings reduce piece `k + 1` into the leader and then broadcast piece
    /// `k`. Every rank of the host runs the same sequence of operations on the rings: reduce
    /// 0, then for each `k` reduce `k + 1` (if any) and broadcast `k`.
    fn pipelined(&self, net: &mut Net, shm: &Shm, pieces: Vec<&mut [f32]>, values: Values) -> Result<()> {
        let count = pieces.len();
        let mut pieces = pieces.into_iter();
        if self.at != 0 {
            let mut waiting = std::collections::VecDeque::new();
            for k in 0..=count {
                if let Some(p) = pieces.next() {
                    chain::reduce(&mut Group::new(net, &self.local, self.at, Some(shm)), p, 0, values)?;
                    waiting.push_back(p);
                }
                if k > 0
                    && let Some(p) = waiting.pop_front()
                {
                    chain::broadcast(&mut Group::new(net, &self.local, self.at, Some(shm)), p, 0, values)?;
                }
            }
            return Ok(());
        }
        let mut across = Net {
            mesh: net.mesh.split_off(&self.leaders),
            scratch: std::mem::take(&mut net.scratch),
            traffic: Default::default(),
            cfg: net.cfg.clone(),
            cores: net.cores,
            ranks_here: net.ranks_here,
        };
        let out = std::thread::scope(|s| {
            let (to_ring, ring_in) = mpsc::channel::<&mut [f32]>();
            let (ring_out, from_ring) = mpsc::channel::<Result<&mut [f32]>>();
            let leaders = (&self.leaders, self.host, &mut across);
            s.spawn(move || {
                let (members, me, across) = leaders;
                for piece in ring_in {
                    let group = &mut Group::new(across, members, me, None);
                    let done = ring::run(group, piece, Phases::Both, Op::AllReduce, values).map(|()| piece);
                    let failed = done.is_err();
                    // Nobody waits any more once the host's side has failed.
                    if ring_out.send(done).is_err() || failed {
                        break;
                    }
                }
            });
            let mut host = || -> Result<()> {
                for k in 0..=count {
                    if let Some(p) = pieces.next() {
                        chain::reduce(&mut Group::new(net, &self.local, self.at, Some(shm)), p, 0, values)?;
                        // A closed channel means the ring failed: its error comes below.
                        let _ = to_ring.send(p);
                    }
                    if k > 0 {
                        let p = from_ring.recv().map_err(|_| CollectiveError::Invalid {
                            what: "hierarchy",
                            why: "the leaders' ring stopped without a word".into(),
                        })??;
                        chain::broadcast(
                            &mut Group::new(net, &self.local, self.at, Some(shm)),
                            p,
                            0,
                            values,
                        )?;
                    }
                }
                Ok(())
            };
            let out = host();
            // Ends the ring's thread once its piece in hand is done.
            drop(to_ring);
            out
        });
        net.mesh.rejoin(across.mesh);
        net.scratch = across.scratch;
        net.traffic += across.traffic;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{Hierarchy, MIN_PIECE, PIECES, Transport, Where, agree, hierarchical, hosts, pieces};

    fn at(places: &[&str]) -> Vec<Where> {
        places
            .iter()
            .map(|p| Where {
                place: p.to_string(),
                transport: Transport::Auto,
                hierarchy: Hierarchy::Auto,
                machine: String::new(),
                cores: 0,
                chunk_bytes: 1 << 20,
                chunk_auto: true,
            })
            .collect()
    }

    #[test]
    fn pieces_tile_the_buffer_smallest_at_the_ends() {
        assert_eq!(pieces(0), vec![0]);
        assert_eq!(pieces(1000), vec![1000]);
        assert_eq!(pieces(MIN_PIECE + 1), vec![MIN_PIECE / 2 + 1, MIN_PIECE / 2], "two pieces, no steps");
        // 64 MB: 8 pieces of 8 MB, the first and the last in steps of 0.25 to 4 MB.
        let m = MIN_PIECE;
        let mut want = vec![m, m, 2 * m, 4 * m, 8 * m, 16 * m];
        want.extend([32 * m; 6]);
        want.extend([16 * m, 8 * m, 4 * m, 2 * m, m, m]);
        assert_eq!(pieces(16 << 20), want);
        for n in [2 * m, 3 * m + 7, 5 * m, 8 * m, 8 * m + 1, 100 * m + 3, 1 << 24, (1 << 24) + 12345] {
            let p = pieces(n);
            assert_eq!(p.iter().sum::<usize>(), n, "{n}: {p:?}");
            assert!(p.iter().all(|&l| l >= m / 2), "{n}: a piece under half the least: {p:?}");
            let largest = *p.iter().max().unwrap();
            let least = *p.iter().min().unwrap();
            assert!(
                p[0] <= least + 1 && *p.last().unwrap() <= least + 1,
                "{n}: the ends are the smallest: {p:?}"
            );
            assert!(largest <= n.div_ceil(PIECES.min(n.div_ceil(m))) + 1, "{n}: {p:?}");
        }
    }

    #[test]
    fn hosts_are_equal_places_ordered_by_their_lowest_rank() {
        assert_eq!(hosts(&at(&["b", "a", "b", "a", "c"])), vec![vec![0, 2], vec![1, 3], vec![4]]);
        assert_eq!(hosts(&at(&["x", "x", "x"])), vec![vec![0, 1, 2]]);
    }

    #[test]
    fn auto_is_hierarchical_only_with_several_hosts_and_a_shared_one() {
        let (a, on, off) = (Hierarchy::Auto, Hierarchy::On, Hierarchy::Off);
        assert!(!hierarchical(a, 1, 4), "one host: the flat ring (shared memory)");
        assert!(!hierarchical(a, 4, 4), "a host per rank: the flat ring (sockets)");
        assert!(hierarchical(a, 2, 4));
        assert!(hierarchical(a, 2, 3), "uneven hosts too");
        assert!(hierarchical(on, 1, 2) && hierarchical(on, 4, 4) && !hierarchical(on, 1, 1));
        assert!(!hierarchical(off, 2, 4));
    }

    #[test]
    fn ranks_given_different_flags_are_named() {
        let mut all = at(&["a", "a", "b"]);
        assert!(agree(&all, 0).is_ok());
        all[2].hierarchy = Hierarchy::Off;
        let e = agree(&all, 0).unwrap_err();
        assert_eq!(e.culprit(), Some(2));
        assert!(e.to_string().contains("--hierarchy off"), "{e}");
        // A chunk given to one rank only: its chunks would not be the others'.
        let mut all = at(&["a", "a", "b"]);
        (all[1].chunk_bytes, all[1].chunk_auto) = (256 << 10, false);
        let e = agree(&all, 0).unwrap_err();
        assert_eq!(e.culprit(), Some(1));
        assert!(e.to_string().contains("256 KiB (--chunk-kb), this rank of 1024 KiB or less"), "{e}");
        // A rank of an older protocol says nothing of its chunk: not held against it.
        all[1].chunk_bytes = 0;
        assert!(agree(&all, 0).is_ok());
    }
}
