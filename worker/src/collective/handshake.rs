//! The ring's handshake and frame header, as pure functions over bytes and streams: what a
//! stranger can send a rank or the rendezvous store is decoded here and nowhere else. No
//! sockets and no crate types, so the fuzzer (`fuzz/`) compiles this very file and drives the
//! production code over in-memory streams; the TCP mesh and the rendezvous store turn the
//! failures into the collectives' `CollectiveError`.
//!
//! # The handshake: a mutual challenge-response over the shared token
//!
//! ```text
//!  connector (higher rank, or any rank registering)        acceptor (lower rank, or the store)
//!   Hello { rank, world, fingerprint, to, addr, nonce_c } ->
//!                                                      <- Challenge { nonce_a }   (or { refused })
//!   Answer { HMAC(token, "connector" | transcript) }    ->
//!                                                      <- Welcome { HMAC(token, "acceptor" | transcript) }
//!                                                         (or { refused: "wrong ring token ..." })
//! ```
//!
//! Both nonces are 32 fresh random bytes, so a proof recorded from one connection proves nothing
//! on another; the role label keeps one side's proof from being reflected as the other's; the
//! transcript binds the proof to who claims to be whom (see [`transcript`]). Proofs are
//! compared in constant time. The connector proves first, so a stranger who dials a rank learns
//! nothing derived from the token; the connector then checks the acceptor's proof, so a rank
//! never trusts a listener (or a store and the addresses it hands out) that does not know the
//! token either.

use std::io::{self, Read, Write};
use std::net::SocketAddr;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// A fresh random value each side contributes to one handshake.
pub type Nonce = [u8; 32];

/// HMAC-SHA256 of a handshake transcript under the shared token.
pub type Proof = [u8; 32];

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
    /// Between ranks: the rank the sender believes it is talking to.
    #[serde(default)]
    pub to: Option<usize>,
    /// To the store: where the sender's ring listener is.
    #[serde(default)]
    pub addr: Option<SocketAddr>,
    /// The connector's fresh nonce. (Defaulted so that a client of another protocol version
    /// is refused by its magic, with the reason, rather than by a missing field.)
    #[serde(default)]
    pub nonce: Nonce,
}

/// The acceptor's first answer: its nonce, or why the [`Hello`] was refused.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Challenge {
    /// Why the hello was refused (another run, another model, ...), if it was.
    #[serde(default)]
    pub refused: Option<String>,
    /// The acceptor's fresh nonce (absent when refused).
    #[serde(default)]
    pub nonce: Option<Nonce>,
}

/// The connector's answer to a [`Challenge`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Answer {
    /// [`proof`] for [`Role::Connector`].
    pub proof: Proof,
}

/// The acceptor's verdict between ranks. (The store answers with its own reply, which carries
/// the same two fields.)
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Welcome {
    /// `None` when accepted, else why not.
    pub refused: Option<String>,
    /// [`proof`] for [`Role::Acceptor`], when accepted.
    #[serde(default)]
    pub proof: Option<Proof>,
}

/// Identifies gradsync ring traffic and its version (2: challenge-response).
pub const MAGIC: &str = "gradsync-ring/2";

/// The longest handshake line accepted: bounds what a stray client can make a rank read.
const MAX_LINE: usize = 64 << 10;

/// Which side of a handshake a proof speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that dialled (and sent the [`Hello`]).
    Connector,
    /// The side that listened (a lower rank, or the store).
    Acceptor,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Connector => b"connector",
            Role::Acceptor => b"acceptor",
        }
    }
}

/// The bytes a proof covers: each field as a `u32` little-endian length and the bytes, in
/// this order: [`MAGIC`], the role (`connector` / `acceptor`), the connector's nonce, the
/// acceptor's nonce, the connector's rank, the world size, the addressee (`u64`
/// little-endian; `u64::MAX` for the store), the registered address (its text, or empty), the
/// model fingerprint. Lengths make the encoding unambiguous.
pub fn transcript(role: Role, hello: &Hello, acceptor: &Nonce) -> Vec<u8> {
    let to = hello.to.map_or(u64::MAX, |t| t as u64);
    let addr = hello.addr.map(|a| a.to_string()).unwrap_or_default();
    let fields: [&[u8]; 9] = [
        MAGIC.as_bytes(),
        role.label(),
        &hello.nonce,
        acceptor,
        &(hello.rank as u64).to_le_bytes(),
        &(hello.world as u64).to_le_bytes(),
        &to.to_le_bytes(),
        addr.as_bytes(),
        hello.fingerprint.as_bytes(),
    ];
    let mut out = Vec::new();
    for f in fields {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

fn mac(token: Option<&str>) -> Hmac<Sha256> {
    // HMAC takes keys of any length (an empty one included: no token, no secret).
    Hmac::<Sha256>::new_from_slice(token.unwrap_or("").as_bytes()).expect("HMAC accepts any key length")
}

/// HMAC-SHA256(token, [`transcript`]): what `role` sends to prove it knows the token.
pub fn proof(token: Option<&str>, role: Role, hello: &Hello, acceptor: &Nonce) -> Proof {
    let mut m = mac(token);
    m.update(&transcript(role, hello, acceptor));
    m.finalize().into_bytes().into()
}

/// Whether `theirs` is `role`'s proof for this handshake, compared in constant time.
pub fn verify(token: Option<&str>, role: Role, hello: &Hello, acceptor: &Nonce, theirs: &[u8]) -> bool {
    let mut m = mac(token);
    m.update(&transcript(role, hello, acceptor));
    m.verify_slice(theirs).is_ok()
}

/// 32 bytes from the operating system's random source.
pub fn fresh_nonce() -> io::Result<Nonce> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(format!("no random nonce: {e}")))?;
    Ok(n)
}

/// Why a handshake did not complete, as seen by one side.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The stream failed, timed out, or carried something that is not the handshake.
    #[error("bad handshake: {0}")]
    Io(io::Error),
    /// The other side refused this one, for the reason it gave.
    #[error("refused: {0}")]
    RefusedByPeer(String),
    /// This side refused the other, for this reason (the other side was told when it spoke
    /// the handshake).
    #[error("{0}")]
    Refused(String),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Io(e)
    }
}

/// What the acceptor says to a connector whose proof is wrong.
pub const WRONG_PROOF: &str = "wrong ring token (--ring-token / GRADSYNC_RING_TOKEN): the proof does \
     not match, so the client does not know the token or replayed another connection's handshake";

/// The acceptor's side up to its verdict: read a [`Hello`] from `r`, answer a refusal or a
/// [`Challenge`] with `nonce` on `w`, read the [`Answer`] and check its proof. Refusals are
/// told to the other side (as a [`Welcome`], which the store's reply parses as too). On `Ok`
/// the caller sends its verdict with [`proof`] for [`Role::Acceptor`].
pub fn accept(
    mut r: impl Read,
    w: &mut impl Write,
    me: Option<usize>,
    world: usize,
    fingerprint: &str,
    token: Option<&str>,
    nonce: &Nonce,
) -> Result<Hello, Failure> {
    let hello: Hello = read_line(&mut r)?;
    if let Some(why) = refuse(&hello, me, world, fingerprint) {
        write_line(w, &Challenge { refused: Some(why.clone()), nonce: None })?;
        return Err(Failure::Refused(why));
    }
    write_line(w, &Challenge { refused: None, nonce: Some(*nonce) })?;
    let answer: Answer = read_line(&mut r)?;
    if !verify(token, Role::Connector, &hello, nonce, &answer.proof) {
        write_line(w, &Welcome { refused: Some(WRONG_PROOF.into()), proof: None })?;
        return Err(Failure::Refused(format!("claiming rank {}: {WRONG_PROOF}", hello.rank)));
    }
    Ok(hello)
}

/// The connector's side up to the acceptor's verdict: send `hello` on `w`, read the
/// [`Challenge`] from `r`, answer with the proof. Returns the acceptor's nonce, for
/// [`confirm`] on the verdict.
pub fn offer(
    mut r: impl Read,
    w: &mut impl Write,
    hello: &Hello,
    token: Option<&str>,
) -> Result<Nonce, Failure> {
    write_line(w, hello)?;
    let challenge: Challenge = read_line(&mut r)?;
    let nonce = match (challenge.refused, challenge.nonce) {
        (Some(why), _) => return Err(Failure::RefusedByPeer(why)),
        (None, Some(n)) => n,
        (None, None) => {
            return Err(Failure::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                "a challenge without a nonce",
            )));
        }
    };
    write_line(w, &Answer { proof: proof(token, Role::Connector, hello, &nonce) })?;
    Ok(nonce)
}

/// The connector's check of the acceptor's verdict: accepted, and with the acceptor's proof
/// for this very handshake (mutual authentication).
pub fn confirm(
    token: Option<&str>,
    hello: &Hello,
    acceptor: &Nonce,
    refused: Option<String>,
    theirs: Option<&Proof>,
) -> Result<(), Failure> {
    if let Some(why) = refused {
        return Err(Failure::RefusedByPeer(why));
    }
    match theirs {
        Some(p) if verify(token, Role::Acceptor, hello, acceptor, p) => Ok(()),
        _ => Err(Failure::Refused(
            "the other side accepted without proving it knows the ring token (a wrong \
             --ring-token, an impostor at that address, or a replayed answer)"
                .into(),
        )),
    }
}

/// The connector's whole side between ranks: [`offer`], then [`confirm`] the [`Welcome`].
pub fn connect(
    mut r: impl Read,
    w: &mut impl Write,
    hello: &Hello,
    token: Option<&str>,
) -> Result<(), Failure> {
    let nonce = offer(&mut r, w, hello, token)?;
    let welcome: Welcome = read_line(&mut r)?;
    confirm(token, hello, &nonce, welcome.refused, welcome.proof.as_ref())
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

/// Why `h` may not join a ring of `world` ranks training `fingerprint` (as seen by rank `me`,
/// or by the store when `me` is `None`). `None` if it may (the token is checked afterwards,
/// by the proof).
pub fn refuse(h: &Hello, me: Option<usize>, world: usize, fingerprint: &str) -> Option<String> {
    if h.magic != MAGIC {
        return Some(format!("not a gradsync ring client (magic '{}', expected '{MAGIC}')", h.magic));
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
    match me {
        Some(me) => {
            if h.to != Some(me) {
                return Some(format!("it meant to reach rank {:?}, this is rank {me}", h.to));
            }
            if h.rank <= me {
                return Some(format!("rank {} should be accepted by, not connect to, rank {me}", h.rank));
            }
        }
        None if h.addr.is_none() => return Some("no ring address given".into()),
        None => {}
    }
    None
}

/// The tag of an abort notice: an 8-byte frame header whose count is the rank the sender
/// blames. A rank whose collective fails writes one on every link before closing it, so that
/// the others name the rank that failed rather than the neighbour that closed on them. (A NaN
/// bit pattern: improbable as the last word of a payload cut short.)
pub const ABORT_TAG: u32 = 0x7fab_0127;

/// The abort notice blaming `culprit`.
pub fn abort_notice(culprit: usize) -> [u8; 8] {
    let mut n = [0u8; 8];
    n[..4].copy_from_slice(&ABORT_TAG.to_le_bytes());
    n[4..].copy_from_slice(&(culprit.min(u32::MAX as usize) as u32).to_le_bytes());
    n
}

/// The rank blamed by an abort notice that ends `tail` (the bytes read from a peer up to the
/// end of its stream), if it ends with one: a notice cut into a frame's payload is found this
/// way.
pub fn ends_with_abort(tail: &[u8]) -> Option<usize> {
    let n = tail.len().checked_sub(8).map(|at| &tail[at..])?;
    let tag = u32::from_le_bytes([n[0], n[1], n[2], n[3]]);
    (tag == ABORT_TAG).then(|| u32::from_le_bytes([n[4], n[5], n[6], n[7]]) as usize)
}

/// Why a frame header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The header is an abort notice blaming this rank.
    #[error("an abort notice blaming rank {0}")]
    Aborted(usize),
    /// The header's operation tag is not the expected one.
    #[error("operation tag {0:#x}, not the one expected")]
    Tag(u32),
    /// The header announces another number of values than expected.
    #[error("{0} values, not the number expected")]
    Count(usize),
}

/// Check an 8-byte frame header (operation tag and value count, `u32` little-endian): it must
/// announce `tag` with exactly `expect` values. The receiver's buffer was sized before the
/// header arrived, so a peer's count is only ever compared, never allocated.
pub fn check_header(head: &[u8; 8], tag: u32, expect: usize) -> Result<(), HeaderError> {
    let theirs = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    if theirs == ABORT_TAG {
        return Err(HeaderError::Aborted(count));
    }
    if theirs != tag {
        return Err(HeaderError::Tag(theirs));
    }
    if count != expect {
        return Err(HeaderError::Count(count));
    }
    Ok(())
}
