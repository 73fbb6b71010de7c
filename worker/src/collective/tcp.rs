//! The TCP mesh: one connection per pair of ranks, the challenge-response handshake that keeps
//! strangers out (the pure protocol is in [`super::handshake`]), and the links it leaves
//! behind, by peer (`Mesh`). Frames over the links are in [`super::frame`]; what runs over
//! the mesh is the communicator's business (`comm`).
//!
//! Wire format after the handshake: each frame is an 8-byte header (operation tag and value
//! count, both `u32` little-endian) followed by the values as little-endian `f32`. The
//! receiver knows what it expects and refuses anything else, so ranks that call different
//! collectives, or pass buffers of different lengths, get an error instead of corrupt data.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::RingConfig;
use super::error::{CollectiveError, Result};
use super::frame::Link;
use super::handshake::{Failure, Hello, MAGIC, abort_notice, ends_with_abort, fresh_nonce, write_line};

/// How long a failing rank spends telling one peer whom to blame, or reading a peer's notice.
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(200);

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

/// A full mesh of links, one per peer (the ring uses the neighbours; rooted collectives and
/// send/recv use the others).
pub(crate) struct Mesh {
    rank: usize,
    links: Vec<Option<Link>>,
}

impl Mesh {
    /// Connect the mesh: connect to every lower rank, accept every higher one on `listener`
    /// (already bound, its address published as `info.addrs[rank]`). Connections that fail
    /// the handshake are refused and do not count.
    pub(crate) fn connect(listener: TcpListener, info: &MeshInfo, cfg: &RingConfig) -> Result<Mesh> {
        let (rank, world) = (info.rank, info.addrs.len());
        super::check_rank("rank", rank, world)?;
        let token = info.token.as_deref();
        let deadline = Instant::now() + cfg.timeout;
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        for (peer, addr) in info.addrs.iter().enumerate().take(rank) {
            let s = dial(peer, addr, info, cfg, deadline)?;
            links[peer] = Some(Link::new(peer, s, cfg)?);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| CollectiveError::Io { what: "configuring the ring listener".into(), source: e })?;
        while links.iter().enumerate().any(|(p, l)| p > rank && l.is_none()) {
            let (s, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing = (rank + 1..world).find(|&p| links[p].is_none()).unwrap_or(rank);
                        return Err(CollectiveError::Timeout {
                            peer: missing,
                            op: "connecting the ring",
                            timeout: cfg.timeout,
                        });
                    }
                    // Accept has no timeout in std; a short nap bounds the wait at the deadline.
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => {
                    return Err(CollectiveError::Io { what: "accepting ring connections".into(), source: e });
                }
            };
            match accept_one(s, rank, world, &info.fingerprint, token, cfg) {
                Ok((peer, s)) if links[peer].is_none() => links[peer] = Some(Link::new(peer, s, cfg)?),
                Ok((peer, _)) => {
                    tracing::warn!("refused a second connection claiming rank {peer} from {from}")
                }
                Err(why) => tracing::warn!("refused a connection from {from}: {why}"),
            }
        }
        Ok(Mesh { rank, links })
    }

    /// A mesh of one rank (no links).
    pub(crate) fn single() -> Mesh {
        Mesh { rank: 0, links: vec![None] }
    }

    /// A mesh of this rank's links to `peers` only, taken out of this one (which keeps the
    /// others) until [`Mesh::rejoin`] puts them back: a group's links that another thread may
    /// drive while this one uses the rest.
    pub(crate) fn split_off(&mut self, peers: &[usize]) -> Mesh {
        let mut links: Vec<Option<Link>> = (0..self.links.len()).map(|_| None).collect();
        for &p in peers {
            if let (Some(mine), Some(theirs)) = (links.get_mut(p), self.links.get_mut(p)) {
                *mine = theirs.take();
            }
        }
        Mesh { rank: self.rank, links }
    }

    /// Put back the links of a mesh made by [`Mesh::split_off`].
    pub(crate) fn rejoin(&mut self, part: Mesh) {
        for (p, l) in part.links.into_iter().enumerate() {
            if l.is_some() {
                self.links[p] = l;
            }
        }
    }

    /// The links, by peer (`None` for this rank).
    pub(crate) fn links_mut(&mut self) -> &mut [Option<Link>] {
        &mut self.links
    }

    /// The link to `peer`.
    pub(crate) fn link(&mut self, peer: usize) -> Result<&mut Link> {
        let rank = self.rank;
        self.links.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| CollectiveError::Invalid {
            what: "peer",
            why: format!("rank {rank} has no link to rank {peer}"),
        })
    }

    /// The stream from `left` and the stream to `right` (the same link when they are one
    /// peer), split so that one can be written while the other is read: a ring's neighbours,
    /// whichever ranks form the ring.
    pub(crate) fn pair(&mut self, left: usize, right: usize) -> Result<(&mut TcpStream, &mut TcpStream)> {
        let r = self.rank;
        let missing =
            |p| CollectiveError::Invalid { what: "peer", why: format!("rank {r} has no link to rank {p}") };
        if left.max(right) >= self.links.len() {
            return Err(missing(left.max(right)));
        }
        if left == right {
            let l = self.links[left].as_mut().ok_or_else(|| missing(left))?;
            return Ok((&mut l.reader, &mut l.writer));
        }
        let (lo, hi) = self.links.split_at_mut(left.max(right));
        let (a, b) = (lo[left.min(right)].as_mut(), hi[0].as_mut());
        let (l, rt) = if left < right { (a, b) } else { (b, a) };
        let l = l.ok_or_else(|| missing(left))?;
        let rt = rt.ok_or_else(|| missing(right))?;
        Ok((&mut l.reader, &mut rt.writer))
    }

    /// Tell every peer whom to blame for a failed operation, then close the links, which wakes
    /// the peers blocked on this rank at once rather than at their timeout.
    pub(crate) fn abort(&mut self, culprit: usize) {
        let notice = abort_notice(culprit);
        for l in self.links.iter_mut().flatten() {
            let _ = l.writer.set_nonblocking(false);
            // A peer that no longer reads must not hold this rank up.
            let _ = l.writer.set_write_timeout(Some(ABORT_WRITE_TIMEOUT));
            let _ = l.writer.write_all(&notice);
            let _ = l.reader.shutdown(Shutdown::Both);
        }
    }

    /// A connection error from a peer that sent an abort notice before closing (one this rank
    /// had not read yet, e.g. because it was writing to that peer) becomes the notice's
    /// [`CollectiveError::Aborted`]: the survivors of a failure name the rank that failed.
    /// `timeout` is restored as the link's read timeout afterwards.
    pub(crate) fn blame(&mut self, e: CollectiveError, timeout: Duration) -> CollectiveError {
        let CollectiveError::Peer { peer, op, .. } = e else { return e };
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
        let _ = l.reader.set_read_timeout(Some(timeout));
        match ends_with_abort(&tail) {
            Some(culprit) if ended => CollectiveError::Aborted { peer, culprit, op },
            _ => e,
        }
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
    let io = |what: &str| {
        let what = format!("{what} to rank {peer} at {addr}");
        move |source| CollectiveError::Io { what, source }
    };
    let hello = Hello {
        magic: MAGIC.into(),
        rank: info.rank,
        world: info.addrs.len(),
        fingerprint: info.fingerprint.clone(),
        to: Some(peer),
        addr: None,
        nonce: fresh_nonce().map_err(io("drawing a nonce for the connection"))?,
    };
    let s = connect_retry(addr, deadline).map_err(io("connecting"))?;
    // The acceptor answers at once unless it is busy with another caller's handshake.
    let mut w = s
        .set_read_timeout(Some(cfg.timeout))
        .and_then(|()| s.set_write_timeout(Some(cfg.timeout)))
        .and_then(|()| s.try_clone())
        .map_err(io("configuring the connection"))?;
    super::handshake::connect(&s, &mut w, &hello, info.token.as_deref())
        .map_err(|failure| CollectiveError::Handshake { peer, addr: *addr, failure })?;
    Ok(s)
}

/// Run the acceptor's side of the handshake on one incoming connection. `Ok` with the peer's
/// rank if it proved it belongs to this run; otherwise why it was refused (this rank goes on
/// waiting for the real peer).
fn accept_one(
    s: TcpStream,
    me: usize,
    world: usize,
    fingerprint: &str,
    token: Option<&str>,
    cfg: &RingConfig,
) -> std::result::Result<(usize, TcpStream), Failure> {
    s.set_nonblocking(false)?;
    // A stray client that says nothing must not hold the ring up for long.
    let t = Some(cfg.timeout.min(Duration::from_secs(10)));
    s.set_read_timeout(t)?;
    s.set_write_timeout(t)?;
    let mut w = s.try_clone()?;
    let nonce = fresh_nonce()?;
    let hello = super::handshake::accept(&s, &mut w, Some(me), world, fingerprint, token, &nonce)?;
    let proof = super::handshake::proof(token, super::handshake::Role::Acceptor, &hello, &nonce);
    write_line(&mut w, &super::handshake::Welcome { refused: None, proof: Some(proof) }).map_err(|e| {
        Failure::Io(io::Error::new(e.kind(), format!("rank {}: answering the handshake: {e}", hello.rank)))
    })?;
    Ok((hello.rank, s))
}
