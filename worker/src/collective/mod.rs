//! Collective communication between the ranks of a DDP run: one small trait, two backends.
//!
//! Layers, each file importing only from the ones below it:
//! - `error`, under everything but `handshake` (whose pure `Failure` a refused handshake
//!   carries): [`CollectiveError`], which every file returns.
//! - Here: the [`Collective`] trait, [`RingConfig`] and [`Transport`] (what the command line
//!   sets), and [`segment`] (core's one way of cutting the flat buffer, which the parameter
//!   servers' shards use too).
//! - Links, at the bottom. `reduce`: the element-wise sums every host collective (and DP)
//!   shares. `handshake`: the challenge-response handshake, the frame header and the abort
//!   notice, as pure functions over bytes and streams (fuzzed). `link`: the seam, the
//!   operation tags, the `Duplex` engine every transport provides to the ring neighbours and
//!   the `Links` an algorithm may ask of a communicator. `frame`: the socket link to one peer
//!   and the length-checked frames over it, with the errors that name the peer. `pump`: the
//!   socket `Duplex` engines (one thread with `poll` for small transfers, a sender thread
//!   beside the receiver for large ones). [`tcp`]: the mesh of TCP links and its set-up.
//!   [`shm`]: the shared-memory `Duplex` rings between ranks of one host and network
//!   namespace, and their set-up over the mesh.
//! - Groups: `group`, the `Links` of any subset of the ranks (all of them, one host's, one
//!   leader per host), numbered in ring order, over the mesh and the group's shared-memory
//!   rings.
//! - Algorithms, over `link` only. `ring`: the bandwidth-optimal ring reduce-scatter,
//!   all-gather and all-reduce, pipelined in chunks. `chain`: pipelined chains for broadcast
//!   and reduce, direct sends for gather, scatter and send/recv.
//! - `hier`: the set-up's one decision (flat ring on shared memory or sockets, or
//!   hierarchical, by [`Hierarchy`]) and the hierarchical all-reduce, composed of those
//!   algorithms over groups: reduce inside each host, ring among the hosts' leaders,
//!   broadcast inside, overlapped piece by piece.
//! - `comm`: the host communicator [`TcpComm`], which implements [`Collective`] with those
//!   algorithms, picking the transport by [`Transport`] (`--transport auto|tcp|shm`) and the
//!   all-reduce by [`Hierarchy`] (`--hierarchy auto|off|on`).
//! - [`nccl`]: NCCL on GPU memory, with timeouts that abort the communicator; `nccl_lib`:
//!   finding and loading `libnccl.so.2` (system paths, Python environments) and its functions.
//! - `buckets`, at the top: the [`Communicator`] a data-parallel strategy hands its gradient
//!   buckets to (the ring or NCCL), which takes each bucket in the memory it works on (host
//!   memory, staged from a GPU as backward finishes it, or GPU memory) and does the strategy's
//!   [`BucketWork`] to it, overlapped with backward.
//! - Tests only: `sim`, a simulated network (in-memory `Links`, seeded interleavings, virtual
//!   time, injected faults) and `SimComm`, the algorithms with `TcpComm`'s failure handling
//!   over it; `sim_faults`, the algorithms' protocol edge cases on it.
//!
//! Every operation works in place on `f32` buffers of the same length on every rank and is
//! collective: all ranks call the same operations in the same order. Every blocking call is
//! bounded by the communicator's timeout, and a dead or silent peer is reported by rank.

mod buckets;
mod chain;
mod comm;
mod error;
pub(crate) mod frame;
mod group;
pub(crate) mod handshake;
mod hier;
mod link;
pub mod nccl;
mod nccl_lib;
mod pump;
pub(crate) mod reduce;
mod ring;
pub mod shm;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod sim_faults;
pub mod tcp;

use std::ops::Range;
use std::time::Duration;

use gradsync_core::Engine;
pub use gradsync_core::model::segment;
use serde::{Deserialize, Serialize};

pub use buckets::{BucketWork, Communicator, Synced};
pub use comm::TcpComm;
pub use error::{CollectiveError, Result};
pub use frame::configure_socket;
pub use gradsync_core::compress::Half;
pub use hier::pieces as hierarchical_pieces;
pub use nccl::{After, Nccl};
pub(crate) use reduce::half_shares;
pub use reduce::{all_reduce_as_half, pack, packed_len, unpack};
pub use tcp::MeshInfo;

/// Payload bytes moved by a communicator since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes this rank sent.
    pub sent: u64,
    /// Bytes this rank received.
    pub recv: u64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, o: Traffic) {
        self.sent += o.sent;
        self.recv += o.recv;
    }
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;
    fn sub(self, o: Traffic) -> Traffic {
        Traffic { sent: self.sent - o.sent, recv: self.recv - o.recv }
    }
}

/// The collectives, all in place on `f32` buffers, summing where they reduce.
///
/// Lengths must agree across ranks; a mismatch is detected on the wire and reported as a
/// [`CollectiveError::Protocol`] error, never as silently corrupted data.
pub trait Collective {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Payload bytes moved so far.
    fn traffic(&self) -> Traffic;

    /// Every rank ends with the element-wise sum of every rank's `buf`.
    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()>;
    /// [`Collective::all_reduce`] of half-precision values packed two to a slot ([`pack`]),
    /// moving two bytes a value: each hop adds in `f32` and rounds back to `half`, and every
    /// rank ends with the same bits. Backends that cannot say so.
    fn all_reduce_half(&mut self, packed: &mut [f32], half: Half) -> Result<()> {
        let _ = packed;
        Err(CollectiveError::Invalid {
            what: "collective",
            why: format!("this backend has no {} all-reduce", half.name()),
        })
    }
    /// Rank `r` ends with the sum of every rank's `buf[segment(len, world, r)]` in that range,
    /// which is returned; the rest of `buf` holds partial sums.
    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<Range<usize>>;
    /// Each rank contributes `buf[segment(len, world, rank)]`; every rank ends with all of them.
    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()>;
    /// Every rank ends with `root`'s `buf`.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()>;
    /// `root` ends with the sum of every rank's `buf`; other ranks' buffers hold partial sums.
    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()>;
    /// `root`'s `out` (`world * send.len()` values) ends with every rank's `send`, in rank
    /// order; `out` is ignored elsewhere.
    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()>;
    /// Rank `r`'s `recv` ends with `root`'s `src[r * len..(r + 1) * len]`; `src` is read on
    /// `root` only.
    fn scatter(&mut self, src: &[f32], recv: &mut [f32], root: usize) -> Result<()>;
    /// Send `buf` to `peer`, which must call [`Collective::recv`] with as many values.
    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()>;
    /// Receive `buf.len()` values from `peer`.
    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()>;
    /// Return once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
}

/// Every rank ends with `root`'s `buf`, as [`Collective::broadcast`] leaves it, but the values
/// travel only where some rank holds others ([`held_everywhere`]). Returns whether they were
/// sent.
pub fn broadcast_unless_held(c: &mut dyn Collective, buf: &mut [f32], root: usize) -> Result<bool> {
    if held_everywhere(c, gradsync_proto::wire::Digest::of(buf), root)? {
        return Ok(false);
    }
    c.broadcast(buf, root)?;
    Ok(true)
}

/// Whether every rank holds the values `root` holds, each rank giving the
/// [`gradsync_proto::wire::Digest`] of its own: `root`'s goes to every rank (as sixteen 16-bit
/// pieces, each exact in an `f32`), each compares it with its own, and the sum of the
/// disagreements, all-reduced, decides, the same on every rank. A run's start is the case it
/// is for: every rank draws the same initial parameters from one seed, and two messages of a
/// few values replace a broadcast of the whole model, which on a slow or dilated link takes as
/// long as a step.
pub fn held_everywhere(c: &mut dyn Collective, digest: [u8; 32], root: usize) -> Result<bool> {
    check_rank("root", root, c.world_size())?;
    if c.world_size() == 1 {
        return Ok(true);
    }
    let mut own = [0.0f32; 16];
    for (o, pair) in own.iter_mut().zip(digest.chunks_exact(2)) {
        *o = f32::from(u16::from_le_bytes([pair[0], pair[1]]));
    }
    let mut theirs = own;
    c.broadcast(&mut theirs, root)?;
    let mut differ = [f32::from(u8::from(theirs != own))];
    c.all_reduce(&mut differ)?;
    Ok(differ[0] == 0.0)
}

/// The [`gradsync_proto::wire::Digest`] of `engine`'s parameters in `range`, read through a
/// small buffer (no copy of the whole model).
pub fn params_digest(engine: &Engine, range: Range<usize>) -> gradsync_core::Result<[u8; 32]> {
    let mut d = gradsync_proto::wire::Digest::default();
    engine.scan_params(range, 1 << 16, |v| d.values(v))?;
    Ok(d.finish())
}

/// How ring neighbours exchange data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory when every rank is on this host and in this network namespace, sockets
    /// otherwise.
    #[default]
    Auto,
    /// Loopback or network sockets only.
    Tcp,
    /// Shared memory; fail if some rank is on another host or network namespace.
    Shm,
}

impl Transport {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }
}

/// Whether all-reduce runs hierarchically when ranks share hosts (see `hier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hierarchy {
    /// Hierarchical when there are several hosts and at least one of them holds several ranks;
    /// one flat ring otherwise.
    #[default]
    Auto,
    /// Always the flat ring.
    Off,
    /// Always hierarchical (with more than one rank), whatever the hosts.
    On,
}

impl Hierarchy {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Hierarchy::Auto => "auto",
            Hierarchy::Off => "off",
            Hierarchy::On => "on",
        }
    }
}

/// Tunables of the TCP backend.
#[derive(Debug, Clone)]
pub struct RingConfig {
    /// How long any blocking call (connect, accept, read, write) may wait for a peer.
    pub timeout: Duration,
    /// Bytes per pipelined chunk: small enough that the ring keeps every link busy, large
    /// enough that per-frame costs vanish.
    pub chunk_bytes: usize,
    /// Let the ranks make `chunk_bytes` smaller together where it pays: a flat ring on sockets
    /// whose ranks outnumber the cores of a machine they share cuts chunks of at most
    /// [`CROWDED_CHUNK_BYTES`]. Off when the user gave a chunk size.
    pub chunk_auto: bool,
    /// Socket send/receive buffer size to ask for (`None`: the kernel's autotuning).
    pub socket_buffer: Option<usize>,
    /// How the ring and chain collectives reach the neighbours (see [`super::shm`]); in a
    /// hierarchical all-reduce, how the ranks of one host reach each other.
    pub transport: Transport,
    /// Whether all-reduce reduces inside each host before crossing hosts.
    pub hierarchy: Hierarchy,
    /// The host this rank claims to be on, instead of the one it finds (boot id and network
    /// namespace), like NCCL's `NCCL_HOSTID`: ranks given the same value count as one host.
    /// Shared memory is still only used where it maps.
    pub host_id: Option<String>,
    /// Which socket engine moves large transfers.
    pub engine: SocketEngine,
}

/// Which socket engine moves a ring's large transfers (`pump`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SocketEngine {
    /// A sender thread beside the receiving one from 4 MiB up, where this machine has at
    /// least two cores for each rank running on it (ranks in other network namespaces or
    /// containers on the same machine count: they share its cores); one thread otherwise.
    #[default]
    Auto,
    /// One thread with `poll`, whatever the size.
    OneThread,
    /// A sender thread from 4 MiB up, whatever the cores.
    SenderThread,
}

impl RingConfig {
    /// This configuration with the chunk a `--chunk-kb` flag gives: that many KiB, kept as
    /// given; the default chunk, which the ranks may cut smaller together, when none is given.
    pub fn with_chunk_kb(self, kb: Option<usize>) -> RingConfig {
        RingConfig {
            chunk_bytes: kb.map_or(RingConfig::default().chunk_bytes, |k| k << 10),
            chunk_auto: kb.is_none(),
            ..self
        }
    }
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            timeout: Duration::from_secs(60),
            chunk_bytes: 1 << 20,
            chunk_auto: true,
            socket_buffer: Some(4 << 20),
            transport: Transport::Auto,
            engine: SocketEngine::Auto,
            hierarchy: Hierarchy::Auto,
            host_id: None,
        }
    }
}

/// The chunk of a socket ring whose ranks outnumber a machine's cores (see
/// [`RingConfig::chunk_auto`]): ranks there take turns on each core, and a chunk that fits in
/// a core's L2 cache beside the next is still there when it has been received and is reduced
/// and sent on. Measured side by side on 2 cores with 4 and 8 ranks: 5-34% more busbw at
/// 4-64 MB than 1 MiB chunks (docs/benchmarks.md); with a core per rank 1 MiB stays ahead.
pub const CROWDED_CHUNK_BYTES: usize = 256 << 10;

impl RingConfig {
    /// Values per chunk.
    pub(crate) fn chunk_values(&self) -> usize {
        (self.chunk_bytes / 4).max(1)
    }
}

/// Check that `root` (or `peer`) names a rank.
pub(crate) fn check_rank(what: &'static str, r: usize, world: usize) -> Result<()> {
    if r >= world {
        return Err(CollectiveError::Invalid {
            what,
            why: format!("rank {r} is not below the world size {world}"),
        });
    }
    Ok(())
}
