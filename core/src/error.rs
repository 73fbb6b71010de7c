//! The core crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong in gradsync's core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command-line or configuration value that cannot be used; the message names it.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which value (flag, preset, field).
        what: String,
        /// Why it was refused.
        why: String,
    },
    /// A data or checkpoint file that is missing, truncated or malformed.
    #[error("{}: {why}", path.display())]
    File {
        /// The file (or directory) at fault.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// An I/O error on a named file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A CUDA device was asked for but cannot be used (no driver, no library, no such ordinal).
    #[error("CUDA unavailable: {0}")]
    NoCuda(String),
    /// A CUDA call (driver, cuBLAS, NVRTC, NCCL) failed.
    #[error("CUDA error in {op}: {msg}")]
    Cuda {
        /// The operation that failed.
        op: &'static str,
        /// The library's message.
        msg: String,
    },
    /// Two peers (a checkpoint, a server, a ring neighbour) hold different models.
    #[error("model fingerprint mismatch: expected {expected}, found {found}")]
    Fingerprint {
        /// Ours.
        expected: String,
        /// Theirs.
        found: String,
    },
    /// An exchange with the other ranks that forward or backward needed (a synchronised batch
    /// norm's sums) failed.
    #[error("exchanging batch-norm statistics with the other ranks: {0}")]
    Exchange(String),
    /// A buffer's length does not match the model's layout.
    #[error("{what}: expected {expected} values, got {got}")]
    Length {
        /// What was being checked.
        what: &'static str,
        /// The expected length.
        expected: usize,
        /// The length received.
        got: usize,
    },
    /// A compressed payload that does not decode (lengths, indices out of range or repeated).
    #[error("compressed payload: {0}")]
    Codec(String),
}

/// The core crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::Invalid { what: what.into(), why: why.into() }
    }

    /// Shorthand for [`Error::File`].
    pub fn file(path: impl Into<PathBuf>, why: impl Into<String>) -> Self {
        Error::File { path: path.into(), why: why.into() }
    }

    /// Shorthand for [`Error::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
