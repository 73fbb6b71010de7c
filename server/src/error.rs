//! The server crate's one error type, turned into a gRPC status only at the service edge
//! ([`From<Error> for tonic::Status`]).

use tonic::Code;

/// Everything the parameter server refuses or fails at.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag or configuration value that cannot be used; the message names it.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which value.
        what: String,
        /// Why it was refused.
        why: String,
    },
    /// A core failure: a checkpoint, data or metrics file, a fingerprint.
    #[error(transparent)]
    Core(#[from] gradsync_core::Error),
    /// A protocol helper refused a value (TLS files, the token).
    #[error(transparent)]
    Proto(#[from] gradsync_proto::Error),
    /// Serving failed (binding, HTTP/2).
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// A worker holds another model than the server's.
    #[error("rank {rank}: model fingerprint mismatch: the server holds {server}, the worker {worker}")]
    Fingerprint {
        /// The worker's rank.
        rank: usize,
        /// The server's fingerprint.
        server: String,
        /// The worker's fingerprint, cut short by [`abbreviate`] (a peer's text is not echoed
        /// back whole).
        worker: String,
    },
    /// A rank asked to register while it is already registered.
    #[error("rank {0} is already registered")]
    AlreadyRegistered(usize),
    /// A request from a rank that is not (or no longer) registered.
    #[error("rank {0} is not registered (register first, or it was dropped as dead)")]
    NotRegistered(usize),
    /// A registration that disagrees with the run's shape (rank or world size).
    #[error("registration refused: {0}")]
    Membership(String),
    /// A malformed gradient stream (length, offsets, chunk sizes, mixed ranks).
    #[error("bad gradient from rank {rank}: {why}")]
    BadGradient {
        /// The sender.
        rank: usize,
        /// What was wrong.
        why: String,
    },
    /// A gradient holding NaN or Inf; refused and counted.
    #[error("gradient from rank {rank} holds NaN or Inf; refused, parameters unchanged")]
    NonFinite {
        /// The sender.
        rank: usize,
    },
    /// A BSP gradient computed from parameters other than the current ones.
    #[error(
        "rank {rank}: gradient is for version {base}, the server is at version {version} (BSP needs the current one)"
    )]
    Stale {
        /// The sender.
        rank: usize,
        /// The version the gradient was computed from.
        base: u64,
        /// The server's version.
        version: u64,
    },
    /// Ranks that did not arrive within the worker timeout; the step failed (not elastic).
    #[error("step {version} failed: {} within the worker timeout of {timeout_s} s", absent(ranks, refused))]
    Missing {
        /// The version the step would have produced.
        version: u64,
        /// The ranks that sent nothing.
        ranks: Vec<usize>,
        /// The ranks whose gradient was refused for NaN or Inf, and which sent no other.
        refused: Vec<usize>,
        /// The timeout, seconds.
        timeout_s: f64,
    },
    /// A client did not send what it had to within the time it is given.
    #[error("{what} did not arrive within {secs} s ({flag})")]
    Silent {
        /// What was waited for.
        what: String,
        /// The limit, seconds.
        secs: f64,
        /// The flag that sets it.
        flag: &'static str,
    },
    /// Pushes already hold as many bytes of incomplete messages as the server allows.
    #[error(
        "pushes hold {held} bytes of gradient messages not yet received in full, and this one would \
         pass the limit of {limit} bytes (--push-buffer-mb); retry later"
    )]
    Exhausted {
        /// Bytes held, all pushes together.
        held: usize,
        /// The limit.
        limit: usize,
    },
    /// Every worker left the run while a BSP step was still open (a streamed pull waited on it).
    #[error("step {version} abandoned: every worker left the run before it completed")]
    Abandoned {
        /// The version the step would have produced.
        version: u64,
    },
    /// The server is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
}

impl Error {
    /// [`Error::Missing`]: the step to `version` failed waiting `timeout` for `missing` ranks,
    /// of which `refused` sent only a gradient refused for NaN or Inf.
    pub fn missing(version: u64, missing: &[usize], refused: &[usize], timeout: std::time::Duration) -> Self {
        Error::Missing {
            version,
            ranks: missing.iter().copied().filter(|r| !refused.contains(r)).collect(),
            refused: refused.to_vec(),
            timeout_s: timeout.as_secs_f64(),
        }
    }

    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::Invalid { what: what.into(), why: why.into() }
    }

    /// The gRPC code a client sees.
    pub fn code(&self) -> Code {
        match self {
            Error::Invalid { .. } | Error::BadGradient { .. } | Error::NonFinite { .. } => {
                Code::InvalidArgument
            }
            Error::Fingerprint { .. } | Error::NotRegistered(_) | Error::Stale { .. } => {
                Code::FailedPrecondition
            }
            Error::Membership(_) => Code::InvalidArgument,
            Error::AlreadyRegistered(_) => Code::AlreadyExists,
            Error::Missing { .. } | Error::Abandoned { .. } => Code::Aborted,
            Error::Silent { .. } => Code::DeadlineExceeded,
            Error::Exhausted { .. } => Code::ResourceExhausted,
            Error::ShuttingDown => Code::Unavailable,
            Error::Core(_) | Error::Transport(_) | Error::Proto(_) => Code::Internal,
        }
    }
}

/// `ranks` that sent nothing and `refused` ones that sent only a gradient refused for NaN or
/// Inf, in words.
fn absent(ranks: &[usize], refused: &[usize]) -> String {
    let silent = (!ranks.is_empty()).then(|| format!("rank(s) {ranks:?} sent nothing"));
    let refused = (!refused.is_empty())
        .then(|| format!("rank(s) {refused:?} sent a gradient refused for NaN or Inf and no other"));
    match (silent, refused) {
        (Some(s), Some(r)) => format!("{s}, {r}"),
        (Some(s), None) => s,
        (None, Some(r)) => r,
        (None, None) => "no rank was missing".into(),
    }
}

/// Text a peer sent, as an error may quote it: at most its first 64 bytes (cut at a
/// character boundary) and its length, so that an error never echoes back what a peer made
/// arbitrarily long.
pub fn abbreviate(text: &str) -> String {
    const KEEP: usize = 64;
    if text.len() <= KEEP {
        return text.to_string();
    }
    let cut = (0..=KEEP).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
    format!("{}... ({} bytes)", &text[..cut], text.len())
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        tonic::Status::from(&e)
    }
}

impl From<&Error> for tonic::Status {
    fn from(e: &Error) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// The server crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
