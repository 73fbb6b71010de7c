//! The socket link to one peer ([`Link`]) and the frames over it: the 8-byte header
//! (operation tag and value count, both `u32` little-endian) followed by the values as
//! little-endian `f32`, the checks a receiver makes, and the errors that name the peer. Used
//! by the socket pumps, the TCP mesh, and the shared-memory set-up (which agrees on its
//! mailboxes over the same links). No reduction math and no collective algorithm lives here.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use socket2::SockRef;

use super::RingConfig;
use super::error::{CollectiveError, Result};
use super::handshake::{HeaderError, check_header, ends_with_abort};
use super::link::Op;
use super::reduce::Values;

/// Turn a socket error into one that names the peer; timeouts become [`CollectiveError::Timeout`].
pub(crate) fn peer_err(peer: usize, op: Op, timeout: Duration) -> impl FnOnce(io::Error) -> CollectiveError {
    move |e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            CollectiveError::Timeout { peer, op: op.name(), timeout }
        }
        io::ErrorKind::UnexpectedEof => CollectiveError::Peer {
            peer,
            op: op.name(),
            source: io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection"),
        },
        _ => CollectiveError::Peer { peer, op: op.name(), source: e },
    }
}

/// What ended a read from `peer` with error `e`, given the bytes `tail` read from it just
/// before: an abort notice at the end of them names the rank to blame.
pub(crate) fn lost(peer: usize, op: Op, timeout: Duration, tail: &[u8], e: io::Error) -> CollectiveError {
    match ends_with_abort(tail) {
        Some(culprit) if !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            CollectiveError::Aborted { peer, culprit, op: op.name() }
        }
        _ => peer_err(peer, op, timeout)(e),
    }
}

/// Shift `bytes`, just read from a peer, into `tail`: the last 8 bytes of its stream so far,
/// whichever reads they came in, so that an abort notice a receive loop cut between two of
/// its reads is still found at the end of the stream.
pub(crate) fn remember(tail: &mut [u8; 8], bytes: &[u8]) {
    if bytes.len() >= 8 {
        tail.copy_from_slice(&bytes[bytes.len() - 8..]);
    } else {
        tail.rotate_left(bytes.len());
        tail[8 - bytes.len()..].copy_from_slice(bytes);
    }
}

/// `read_exact` from `peer`, blocking, keeping `tail` ([`remember`]), with the end of the
/// stream explained by [`lost`].
pub(crate) fn read_exact_from(
    r: &mut TcpStream,
    buf: &mut [u8],
    tail: &mut [u8; 8],
    peer: usize,
    op: Op,
    t: Duration,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err(lost(peer, op, t, tail, io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => {
                remember(tail, &buf[got..got + n]);
                got += n;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(lost(peer, op, t, tail, e)),
        }
    }
    Ok(())
}

/// One connection to one peer, split into a reading and a writing handle so that both
/// directions can be busy at once.
pub(crate) struct Link {
    pub(crate) reader: TcpStream,
    pub(crate) writer: TcpStream,
}

impl Link {
    pub(crate) fn new(peer: usize, s: TcpStream, cfg: &RingConfig) -> Result<Link> {
        let io = |what: &str| {
            let what = format!("configuring the link to rank {peer}: {what}");
            move |source| CollectiveError::Io { what, source }
        };
        configure_socket(&s, cfg.timeout, cfg.socket_buffer).map_err(|(what, e)| io(what)(e))?;
        let writer = s.try_clone().map_err(io("cloning the socket"))?;
        Ok(Link { reader: s, writer })
    }
}

/// Set up a ring socket: no Nagle delay, reads and writes bounded by `timeout`, and send and
/// receive buffers of at least `buffer` bytes when given (only ever grown: a fixed size below
/// what autotuning would reach slows the link). The error names the setting that failed.
pub fn configure_socket(
    s: &TcpStream,
    timeout: Duration,
    buffer: Option<usize>,
) -> std::result::Result<(), (&'static str, io::Error)> {
    s.set_nodelay(true).map_err(|e| ("TCP_NODELAY", e))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| ("read timeout", e))?;
    s.set_write_timeout(Some(timeout)).map_err(|e| ("write timeout", e))?;
    if let Some(n) = buffer {
        let sock = SockRef::from(s);
        if sock.send_buffer_size().map_or(true, |cur| cur < n) {
            sock.set_send_buffer_size(n).map_err(|e| ("SO_SNDBUF", e))?;
        }
        if sock.recv_buffer_size().map_or(true, |cur| cur < n) {
            sock.set_recv_buffer_size(n).map_err(|e| ("SO_RCVBUF", e))?;
        }
    }
    Ok(())
}

/// A frame's tag: the operation, and in the second byte the format of its values.
fn tag(op: Op, values: Values) -> u32 {
    op as u32 | values.code() << 8
}

/// What a tag announces, in words.
fn describe(tag: u32) -> String {
    match (Op::from_tag(tag & 0xff), Values::from_code(tag >> 8)) {
        (Some(op), Some(v)) => format!("{} frame of {} values", op.name(), v.name()),
        _ => format!("frame with unknown tag {tag}"),
    }
}

/// The 8-byte header of a frame of `count` slots of `values` for `op`.
pub(crate) fn frame_header(op: Op, values: Values, count: usize) -> Result<[u8; 8]> {
    let count = u32::try_from(count).map_err(|_| CollectiveError::Invalid {
        what: "chunk",
        why: format!("{count} values in one frame"),
    })?;
    let mut head = [0u8; 8];
    head[..4].copy_from_slice(&tag(op, values).to_le_bytes());
    head[4..].copy_from_slice(&count.to_le_bytes());
    Ok(head)
}

/// Write one frame of `vals`; returns the payload bytes written. Header and values go in one
/// system call where the socket takes them: with `TCP_NODELAY`, a header written on its own
/// leaves as a segment of its own (two `sendto` per frame instead of one `writev`).
pub(crate) fn write_frame(
    w: &mut TcpStream,
    op: Op,
    values: Values,
    vals: &[f32],
    peer: usize,
    t: Duration,
) -> Result<u64> {
    let head = frame_header(op, values, vals.len())?;
    let payload: &[u8] = bytemuck::cast_slice(vals);
    let mut done = 0;
    while done < 8 + payload.len() {
        let res = if done < 8 {
            w.write_vectored(&[io::IoSlice::new(&head[done..]), io::IoSlice::new(payload)])
        } else {
            w.write(&payload[done - 8..])
        };
        match res {
            Ok(0) => return Err(peer_err(peer, op, t)(io::ErrorKind::WriteZero.into())),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(peer_err(peer, op, t)(e)),
        }
    }
    Ok(payload.len() as u64)
}

/// Check a frame header from `peer`: it must announce `op` with `expect` slots of `values`.
pub(crate) fn parse_header(head: &[u8; 8], op: Op, values: Values, expect: usize, peer: usize) -> Result<()> {
    check_header(head, tag(op, values), expect).map_err(|e| CollectiveError::Protocol {
        peer,
        why: match e {
            HeaderError::Aborted(culprit) => {
                return CollectiveError::Aborted { peer, culprit, op: op.name() };
            }
            HeaderError::Tag(theirs) => format!(
                "sent a {} during a {} (ranks called different collectives, or were given \
                 different --compress)",
                describe(theirs),
                describe(tag(op, values))
            ),
            HeaderError::Count(count) => format!(
                "sent {count} values where {expect} were expected during {} (buffers of different lengths?)",
                op.name()
            ),
        },
    })
}

/// Read one frame of exactly `dst.len()` values into `dst`, blocking; returns the payload
/// bytes.
pub(crate) fn read_frame(
    r: &mut TcpStream,
    op: Op,
    dst: &mut [f32],
    peer: usize,
    t: Duration,
) -> Result<u64> {
    let (mut head, mut tail) = ([0u8; 8], [0u8; 8]);
    read_exact_from(r, &mut head, &mut tail, peer, op, t)?;
    parse_header(&head, op, Values::F32, dst.len(), peer)?;
    if !dst.is_empty() {
        read_exact_from(r, bytemuck::cast_slice_mut(dst), &mut tail, peer, op, t)?;
    }
    Ok(dst.len() as u64 * 4)
}
