//! [`CollectiveError`], everything that can go wrong between the ranks of a collective, and the
//! module's [`Result`].
//!
//! It lives in a file of its own, at the bottom of the module: every other file of
//! `collective` (and the rendezvous, and the strategies above) imports it, and it imports only
//! `handshake`'s [`Failure`], which imports nothing of the crate (the fuzzer compiles it alone). The parameter-server client has its own enum (`crate::ps::PsError`): the two areas
//! share no code and fail in different words (ranks and links here, shards and gRPC statuses
//! there).

use std::net::SocketAddr;
use std::time::Duration;

use super::handshake::Failure;

/// What can go wrong between ranks.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// A peer sent nothing (or accepted nothing) for longer than the timeout.
    #[error(
        "rank {peer} did not answer within {:.1} s during {op} (dead, hung, or much slower?)",
        timeout.as_secs_f64()
    )]
    Timeout {
        /// The silent peer's rank.
        peer: usize,
        /// The operation under way.
        op: &'static str,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The connection to a peer failed or was closed.
    #[error("rank {peer}: {op}")]
    Peer {
        /// The peer's rank.
        peer: usize,
        /// The operation under way.
        op: &'static str,
        /// The socket error (an unexpected end of file means the peer went away).
        source: std::io::Error,
    },
    /// A peer gave up on the operation because of another rank, and said which: the rank to
    /// blame is `culprit`, not the neighbour that closed the connection.
    #[error("rank {culprit} failed: rank {peer} stopped {op} because of it")]
    Aborted {
        /// The rank that sent the abort notice.
        peer: usize,
        /// The rank it blames (dead, silent, or out of step).
        culprit: usize,
        /// The operation under way.
        op: &'static str,
    },
    /// A peer sent something this rank did not expect (another collective, another length).
    #[error("rank {peer}: protocol error: {why}")]
    Protocol {
        /// The peer's rank.
        peer: usize,
        /// What was wrong.
        why: String,
    },
    /// A connection to a peer was refused in the handshake (another run, another model, a bad
    /// token), by either side.
    #[error("handshake with rank {peer} at {addr}: {failure}")]
    Handshake {
        /// The peer's rank.
        peer: usize,
        /// The address dialled.
        addr: SocketAddr,
        /// Why the handshake did not complete (the peer's reason when it refused).
        failure: Failure,
    },
    /// The rendezvous store could not be reached or answered badly.
    #[error("rendezvous at {addr}: {why}")]
    Rendezvous {
        /// The store's address.
        addr: String,
        /// What went wrong.
        why: String,
    },
    /// A local socket could not be created or configured.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// An argument this rank passed makes no sense (a root out of range, buffer sizes).
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which argument.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// NCCL or the CUDA driver failed, or is not available on this machine.
    #[error("NCCL {op}: {msg}")]
    Nccl {
        /// The call that failed.
        op: &'static str,
        /// The library's message.
        msg: String,
    },
    /// The engine failed under a data-parallel step: backward, its fence, a bucket's values
    /// handed between device and host.
    #[error(transparent)]
    Core(#[from] gradsync_core::Error),
    /// One gradient bucket could not be reduced: staged to the host, queued on NCCL's stream,
    /// or the strategy's work on it (its own error, kept whole as the source).
    #[error("bucket {index}: {what}")]
    Bucket {
        /// The bucket's index in the plan.
        index: usize,
        /// What was being done to it.
        what: &'static str,
        /// Why it failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Waiting for the reductions queued on NCCL's stream failed (the communicator names the
    /// cause; which bucket it was, NCCL cannot say).
    #[error("waiting for the buckets' reductions")]
    Reductions {
        /// NCCL's failure.
        source: Box<CollectiveError>,
    },
    /// A communicator's thread panicked (its error is gone with it).
    #[error("{0} panicked")]
    Panicked(&'static str),
}

impl CollectiveError {
    /// The rank this error blames, if it blames one.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            CollectiveError::Timeout { peer, .. }
            | CollectiveError::Peer { peer, .. }
            | CollectiveError::Protocol { peer, .. } => Some(*peer),
            CollectiveError::Aborted { culprit, .. } => Some(*culprit),
            CollectiveError::Reductions { source } => source.culprit(),
            _ => None,
        }
    }
}

/// The result type of the collectives.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;
