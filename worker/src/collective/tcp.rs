//! The TCP communicator: one connection per pair of ranks, a handshake that keeps strangers
//! out, and the mesh set-up. The frames it sends are in [`super::frame`], the sums in
//! [`super::reduce`], the algorithms in [`super::ring`] and [`super::chain`].
//!
//! The full-duplex engine the ring and chains run on is in [`super::pump`].
//!
//! Wire format after the handshake: each frame is an 8-byte header (operation tag and value
//! count, both `u32` little-endian) followed by the values as little-endian `f32`. The
//! receiver knows what it expects and refuses anything else, so ranks that call different
//! collectives, or pass buffers of different lengths, get an error instead of corrupt data.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::frame::{Link, Op};
pub(crate) use super::handshake::{Hello, MAGIC, fresh_nonce, read_line, write_line};
use super::handshake::{abort_notice, ends_with_abort};
use super::shm::Shm;
use super::{CommError, Result, Traffic};
use super::{RingConfig, Transport};

/// How long a failing rank spends telling one peer whom to blame, or reading a peer's notice.
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(200);

/// The TCP backend: a full mesh of links (the ring uses the neighbours; rooted collectives
/// and send/recv use the others).
pub struct TcpComm {
    rank: usize,
    world: usize,
    pub(crate) cfg: RingConfig,
    links: Vec<Option<Link>>,
    pub(crate) scratch: Vec<f32>,
    pub(crate) traffic: Traffic,
    /// Set when an operation failed part-way: the streams are out of step from then on.
    poisoned: Option<String>,
    /// The shared-memory rings to the neighbours, when the ring uses them.
    pub(crate) shm: Option<Box<Shm>>,
}

/// What a rank needs to join the mesh.
#[derive(Debug, Clone)]
pub struct MeshInfo {
    /// This rank.
    pub rank: usize,
    /// Every rank's ring listener, by rank.
    pub addrs: Vec<SocketAddr>,
    /// The model fingerprint every rank must share.
    pub fingerprint: String,
    /// The shared token, if any.
    pub token: Option<String>,
}

impl TcpComm {
    /// Connect the mesh: connect to every lower rank, accept every higher one on `listener`
    /// (already bound, its address published as `info.addrs[rank]`). Connections that fail
    /// the handshake are refused and do not count.
    pub fn connect(listener: TcpListener, info: &MeshInfo, cfg: RingConfig) -> Result<TcpComm> {
        let (rank, world) = (info.rank, info.addrs.len());
        super::check_rank("rank", rank, world)?;
        let token = info.token.as_deref();
        let deadline = Instant::now() + cfg.timeout;
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        for (peer, addr) in info.addrs.iter().enumerate().take(rank) {
            let s = dial(peer, addr, info, &cfg, deadline)?;
            links[peer] = Some(Link::new(peer, s, &cfg)?);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::Io { what: "configuring the ring listener".into(), source: e })?;
        while links.iter().enumerate().any(|(p, l)| p > rank && l.is_none()) {
            let (s, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing = (rank + 1..world).find(|&p| links[p].is_none()).unwrap_or(rank);
                        return Err(CommError::Timeout {
                            peer: missing,
                            op: "connecting the ring",
                            secs: cfg.timeout.as_secs_f64(),
                        });
                    }
                    // Accept has no timeout in std; a short nap bounds the wait at the deadline.
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(CommError::Io { what: "accepting ring connections".into(), source: e }),
            };
            match accept_one(s, rank, world, &info.fingerprint, token, &cfg) {
                Ok((peer, s)) if links[peer].is_none() => links[peer] = Some(Link::new(peer, s, &cfg)?),
                Ok((peer, _)) => {
                    tracing::warn!("refused a second connection claiming rank {peer} from {from}")
                }
                Err(why) => tracing::warn!("refused a connection from {from}: {why}"),
            }
        }
        let shm = Shm::setup(&mut links, rank, &cfg)?.map(Box::new);
        let scratch = vec![0.0; cfg.chunk_values().min(1 << 16)];
        Ok(TcpComm { rank, world, cfg, links, scratch, traffic: Traffic::default(), poisoned: None, shm })
    }

    /// A communicator of one rank (no sockets).
    pub fn single(cfg: RingConfig) -> TcpComm {
        TcpComm {
            rank: 0,
            world: 1,
            cfg,
            links: vec![None],
            scratch: Vec::new(),
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

    /// The link to `peer`, and the scratch buffer and settings beside it.
    pub(crate) fn link(&mut self, peer: usize) -> Result<(&mut Link, &mut Vec<f32>, &RingConfig)> {
        let rank = self.rank;
        let l = self.links.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| CommError::Invalid {
            what: "peer",
            why: format!("rank {rank} has no link to rank {peer}"),
        })?;
        Ok((l, &mut self.scratch, &self.cfg))
    }

    /// The links to the left and right ring neighbours (the same link when there are two
    /// ranks), split so that one can be written while the other is read.
    pub(crate) fn neighbours(
        &mut self,
    ) -> Result<(&mut TcpStream, &mut TcpStream, &mut Vec<f32>, &RingConfig)> {
        let (w, r) = (self.world, self.rank);
        let (left, right) = ((r + w - 1) % w, (r + 1) % w);
        let missing =
            |p| CommError::Invalid { what: "peer", why: format!("rank {r} has no link to rank {p}") };
        if left == right {
            let l = self.links[left].as_mut().ok_or_else(|| missing(left))?;
            return Ok((&mut l.reader, &mut l.writer, &mut self.scratch, &self.cfg));
        }
        let (lo, hi) = self.links.split_at_mut(left.max(right));
        let (a, b) = (lo[left.min(right)].as_mut(), hi[0].as_mut());
        let (l, rt) = if left < right { (a, b) } else { (b, a) };
        let l = l.ok_or_else(|| missing(left))?;
        let rt = rt.ok_or_else(|| missing(right))?;
        Ok((&mut l.reader, &mut rt.writer, &mut self.scratch, &self.cfg))
    }

    /// Run one operation, refusing to start after an earlier failure (the streams would be
    /// out of step) and remembering a failure for the next call.
    pub(crate) fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.poisoned {
            return Err(CommError::Invalid {
                what: "communicator",
                why: format!("{} after an earlier failure: {why}", op.name()),
            });
        }
        let out = f(self).map_err(|e| self.blame(e));
        if let Err(e) = &out
            && !matches!(e, CommError::Invalid { .. })
        {
            self.poisoned = Some(e.to_string());
            // Tell every peer whom to blame (this rank, if nobody else), then wake the ones
            // blocked on us at once rather than at their timeout.
            let notice = abort_notice(e.culprit().unwrap_or(self.rank));
            for l in self.links.iter_mut().flatten() {
                let _ = l.writer.set_nonblocking(false);
                // A peer that no longer reads must not hold this rank up.
                let _ = l.writer.set_write_timeout(Some(ABORT_WRITE_TIMEOUT));
                let _ = l.writer.write_all(&notice);
                let _ = l.reader.shutdown(Shutdown::Both);
            }
            // Neighbours asleep on the shared-memory rings: the notice is on the links by now.
            if let Some(shm) = &self.shm {
                shm.abort();
            }
        }
        out
    }

    /// A connection error from a peer that sent an abort notice before closing (one this rank
    /// had not read yet, e.g. because it was writing to that peer) becomes the notice's
    /// [`CommError::Aborted`]: the survivors of a failure name the rank that failed.
    fn blame(&mut self, e: CommError) -> CommError {
        let CommError::Peer { peer, op, .. } = e else { return e };
        let Some(l) = self.links.get_mut(peer).and_then(Option::as_mut) else { return e };
        let mut tail = Vec::new();
        if l.reader.set_nonblocking(false).is_err()
            || l.reader.set_read_timeout(Some(ABORT_WRITE_TIMEOUT)).is_err()
        {
            return e;
        }
        // What is left in the stream, up to its end (bounded by the socket buffer and time).
        let mut buf = [0u8; 64 << 10];
        let start = Instant::now();
        let ended = loop {
            match l.reader.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => {
                    tail.extend_from_slice(&buf[..n]);
                    let keep = tail.len().saturating_sub(8);
                    tail.drain(..keep);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break true,
            }
            if start.elapsed() > ABORT_WRITE_TIMEOUT {
                break false;
            }
        };
        let _ = l.reader.set_read_timeout(Some(self.cfg.timeout));
        match ends_with_abort(&tail) {
            Some(culprit) if ended => CommError::Aborted { peer, culprit, op },
            _ => e,
        }
    }
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpComm(rank {} of {})", self.rank, self.world)
    }
}

/// Connect to `addr`, retrying while nobody listens yet, until `deadline`.
pub(crate) fn connect_retry(addr: &SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let mut nap = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "nobody answered before the timeout"));
        }
        match TcpStream::connect_timeout(addr, left) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                // The peer has not bound yet: the one unavoidable wait of a rendezvous.
                std::thread::sleep(nap.min(left));
                nap = (nap * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Connect to rank `peer` at `addr` and run the connector's side of the handshake
/// (challenge-response over the token, both ways).
fn dial(
    peer: usize,
    addr: &SocketAddr,
    info: &MeshInfo,
    cfg: &RingConfig,
    deadline: Instant,
) -> Result<TcpStream> {
    let who = || format!("rank {peer} at {addr}");
    let hs = |e: io::Error| CommError::Handshake { who: who(), why: e.to_string() };
    let hello = Hello {
        magic: MAGIC.into(),
        rank: info.rank,
        world: info.addrs.len(),
        fingerprint: info.fingerprint.clone(),
        to: Some(peer),
        addr: None,
        nonce: fresh_nonce().map_err(hs)?,
    };
    let s = connect_retry(addr, deadline)
        .map_err(|e| CommError::Io { what: format!("connecting to {}", who()), source: e })?;
    // The acceptor answers at once unless it is busy with another caller's handshake.
    s.set_read_timeout(Some(cfg.timeout)).map_err(hs)?;
    s.set_write_timeout(Some(cfg.timeout)).map_err(hs)?;
    let mut w = s.try_clone().map_err(hs)?;
    super::handshake::connect(&s, &mut w, &hello, info.token.as_deref())
        .map_err(|e| CommError::Handshake { who: who(), why: e.to_string() })?;
    Ok(s)
}

/// Run the acceptor's side of the handshake on one incoming connection. `Ok` with the peer's
/// rank if it proved it belongs to this run.
fn accept_one(
    s: TcpStream,
    me: usize,
    world: usize,
    fingerprint: &str,
    token: Option<&str>,
    cfg: &RingConfig,
) -> std::result::Result<(usize, TcpStream), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    // A stray client that says nothing must not hold the ring up for long.
    let t = Some(cfg.timeout.min(Duration::from_secs(10)));
    s.set_read_timeout(t).map_err(|e| e.to_string())?;
    s.set_write_timeout(t).map_err(|e| e.to_string())?;
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    let nonce = fresh_nonce().map_err(|e| e.to_string())?;
    let hello = super::handshake::accept(&s, &mut w, Some(me), world, fingerprint, token, &nonce)
        .map_err(|e| e.to_string())?;
    let proof = super::handshake::proof(token, super::handshake::Role::Acceptor, &hello, &nonce);
    write_line(&mut w, &super::handshake::Welcome { refused: None, proof: Some(proof) })
        .map_err(|e| format!("rank {}: answering the handshake: {e}", hello.rank))?;
    Ok((hello.rank, s))
}

impl super::Collective for TcpComm {
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
        self.guarded(Op::AllReduce, |c| super::ring::run(c, buf, super::ring::Phases::Both, Op::AllReduce))
    }

    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<std::ops::Range<usize>> {
        let mine = super::segment(buf.len(), self.world, self.rank);
        self.guarded(Op::ReduceScatter, |c| {
            super::ring::run(c, buf, super::ring::Phases::ReduceScatter, Op::ReduceScatter)
        })?;
        Ok(mine)
    }

    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllGather, |c| {
            super::ring::run(c, buf, super::ring::Phases::AllGather, Op::AllGather)
        })
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Broadcast, |c| super::chain::broadcast(c, buf, root))
    }

    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Reduce, |c| super::chain::reduce(c, buf, root))
    }

    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Gather, |c| super::chain::gather(c, send, out, root))
    }

    fn scatter(&mut self, src: &[f32], recv: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Scatter, |c| super::chain::scatter(c, src, recv, root))
    }

    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(CommError::Invalid {
                what: "peer",
                why: format!("rank {peer} cannot send to itself"),
            });
        }
        self.guarded(Op::SendRecv, |c| super::chain::send_to(c, buf, peer, Op::SendRecv))
    }

    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(CommError::Invalid {
                what: "peer",
                why: format!("rank {peer} cannot receive from itself"),
            });
        }
        self.guarded(Op::SendRecv, |c| super::chain::recv_from(c, buf, peer, Op::SendRecv))
    }

    fn barrier(&mut self) -> Result<()> {
        let world = self.world;
        self.guarded(Op::Barrier, |c| {
            let mut one = [1.0f32];
            super::ring::run(c, &mut one, super::ring::Phases::Both, Op::Barrier)?;
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
