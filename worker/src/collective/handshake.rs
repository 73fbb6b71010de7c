//! The ring's handshake and frame header, as pure functions over bytes: what a stranger can
//! send a rank or the rendezvous store is decoded here and nowhere else. No sockets and no
//! crate types, so the fuzzer (`fuzz/`) compiles this very file and calls the production
//! code; [`super::tcp`] turns the errors into [`super::CommError`].

use std::io::{self, Read, Write};
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// The handshake every connection opens with (to the store and between ranks), one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Hello {
    /// Always [`MAGIC`].
    pub magic: String,
    /// The sender's rank.
    pub rank: usize,
    /// The sender's world size.
    pub world: usize,
    /// The model the sender trains.
    pub fingerprint: String,
    /// FNV-1a hash of the shared token (empty token: no token). Not a cryptographic check: it
    /// keeps other runs and stray clients out, it does not stop an attacker on the network.
    pub token: u64,
    /// Between ranks: the rank the sender believes it is talking to.
    #[serde(default)]
    pub to: Option<usize>,
    /// To the store: where the sender's ring listener is.
    #[serde(default)]
    pub addr: Option<SocketAddr>,
}

/// Identifies gradsync ring traffic and its version.
pub const MAGIC: &str = "gradsync-ring/1";

/// The longest handshake line accepted: bounds what a stray client can make a rank read.
const MAX_LINE: usize = 64 << 10;

/// Hash of a shared token as sent in a [`Hello`].
pub fn token_hash(token: Option<&str>) -> u64 {
    token
        .unwrap_or("")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Write `v` as one JSON line.
pub fn write_line<T: Serialize>(s: &mut impl Write, v: &T) -> io::Result<()> {
    let mut line = serde_json::to_vec(v).map_err(io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line)?;
    s.flush()
}

/// Read one JSON line of at most [`MAX_LINE`] bytes. Byte by byte, on purpose: a buffered
/// reader would swallow the frames a peer may send right after the line.
pub fn read_line<T: for<'de> Deserialize<'de>>(mut s: impl Read) -> io::Result<T> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_LINE {
        match s.read(&mut byte)? {
            0 => break,
            _ if byte[0] == b'\n' => {
                return serde_json::from_slice(&line)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
            }
            _ => line.push(byte[0]),
        }
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "no complete handshake line"))
}

/// The answer to a [`Hello`] between ranks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// `None` when accepted, else why not.
    pub refused: Option<String>,
}

/// Why `h` may not join a ring of `world` ranks training `fingerprint` with `token` (as seen
/// by rank `me`, or by the store when `me` is `None`). `None` if it may.
pub fn refuse(h: &Hello, me: Option<usize>, world: usize, fingerprint: &str, token: u64) -> Option<String> {
    if h.magic != MAGIC {
        return Some(format!("not a gradsync ring client (magic '{}', expected '{MAGIC}')", h.magic));
    }
    if h.token != token {
        return Some("wrong ring token (--ring-token / GRADSYNC_RING_TOKEN)".into());
    }
    if h.world != world {
        return Some(format!("world size {} does not match this run's {world}", h.world));
    }
    if h.rank >= world {
        return Some(format!("rank {} is not below the world size {world}", h.rank));
    }
    if h.fingerprint != fingerprint {
        return Some(format!(
            "model fingerprint '{}' does not match this run's '{fingerprint}'",
            h.fingerprint
        ));
    }
    if let Some(me) = me {
        if h.to != Some(me) {
            return Some(format!("it meant to reach rank {:?}, this is rank {me}", h.to));
        }
        if h.rank <= me {
            return Some(format!("rank {} should be accepted by, not connect to, rank {me}", h.rank));
        }
    }
    None
}

/// Why a frame header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// The header's operation tag is not the expected one.
    Tag(u32),
    /// The header announces another number of values than expected.
    Count(usize),
}

/// Check an 8-byte frame header (operation tag and value count, `u32` little-endian): it must
/// announce `tag` with exactly `expect` values. The receiver's buffer was sized before the
/// header arrived, so a peer's count is only ever compared, never allocated.
pub fn check_header(head: &[u8; 8], tag: u32, expect: usize) -> Result<(), HeaderError> {
    let theirs = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    if theirs != tag {
        return Err(HeaderError::Tag(theirs));
    }
    if count != expect {
        return Err(HeaderError::Count(count));
    }
    Ok(())
}
