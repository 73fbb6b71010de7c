//! [`PsError`], everything the parameter-server client refuses or fails at, and the module's
//! [`Result`].
//!
//! It lives in a file of its own, at the bottom of the module: every other file of `ps`
//! returns it and it imports none of them. The collectives have their own enum
//! (`crate::collective::CollectiveError`): the two areas share no code and fail in different
//! words (shards and gRPC statuses here, ranks and links there).
//!
//! Every message is whole: it names the shard by the address it was dialled at and says what
//! the server or the library said, so one line of a log (`{}`) tells the story; no variant
//! keeps part of it in a source error. A status the server answered with is kept whole too
//! ([`tonic::Status`]: its code, message and metadata), in a variant that tells who refused
//! and why: the token ([`PsError::Unauthenticated`]), a limit of the server's
//! ([`PsError::Exhausted`]), anything else the server refused ([`PsError::Refused`]), or no
//! answer at all because the connection under the call failed ([`PsError::Transport`]).

use std::time::Duration;

/// What [`PsError::Transport`] adds when its bytes looked like TLS to a plaintext client.
const TLS_HINT: &str = " (if the server serves TLS, pass --tls-ca)";

/// What [`PsError::Connect`] adds when a TLS client found a plaintext server.
const PLAINTEXT_HINT: &str =
    " (the server does not seem to serve TLS: start it with --tls-cert and --tls-key, or drop --tls-ca)";

/// Everything the parameter-server client refuses or fails at.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// A flag's value that cannot be used: no servers, an address that is not one, a token
    /// that cannot travel as a header, a CA the TLS stack refuses.
    #[error("{flag}: {why}")]
    Flag {
        /// The flag.
        flag: &'static str,
        /// What is wrong with its value.
        why: String,
    },
    /// A buffer whose length is not the model's.
    #[error("{what}: {got} values for a model of {want}")]
    Length {
        /// The operation it was given to (`push`, `pull`).
        what: &'static str,
        /// Its length.
        got: usize,
        /// The model's.
        want: usize,
    },
    /// A call this client cannot make as asked: destinations that are not one per shard, rows
    /// of a model without a table, values past a buffer's end.
    #[error("{what}: {why}")]
    Invalid {
        /// What was asked.
        what: &'static str,
        /// Why it cannot be done.
        why: String,
    },
    /// Nothing answered at a shard's address (refused, unreachable, unknown to DNS) within
    /// `--connect-timeout`.
    #[error(
        "no parameter server answered at {addr} within --connect-timeout {} s (last: {last})",
        wait.as_secs_f64()
    )]
    Unreachable {
        /// The shard's address.
        addr: String,
        /// How long the worker waited.
        wait: Duration,
        /// Why the last attempt failed.
        last: String,
    },
    /// Something answered at a shard's address but the connection could not be made (a TLS
    /// handshake, HTTP/2), or nothing did and the worker was not to wait.
    #[error("connecting to {addr}: {why}{}", if *plaintext_server { PLAINTEXT_HINT } else { "" })]
    Connect {
        /// The shard's address.
        addr: String,
        /// The innermost cause (tonic's own text is only "transport error").
        why: String,
        /// This worker dialled TLS (`--tls-ca`) and the server answered in plaintext HTTP/2.
        plaintext_server: bool,
    },
    /// A shard did not answer a call within `--rpc-timeout`.
    #[error("{what} at {addr}: no answer within {} s (--rpc-timeout)", timeout.as_secs_f64())]
    Deadline {
        /// The shard's address.
        addr: String,
        /// The call.
        what: &'static str,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The server refused the token (`gradsync-server --token`): a wrong one, or none.
    #[error("{what} at {addr}: {:?}: {}", status.code(), status.message())]
    Unauthenticated {
        /// The shard's address.
        addr: String,
        /// The call.
        what: &'static str,
        /// The server's answer.
        status: tonic::Status,
    },
    /// The server refused a call for one of its limits (`--push-buffer-mb`, its largest
    /// message).
    #[error("{what} at {addr}: {:?}: {}", status.code(), status.message())]
    Exhausted {
        /// The shard's address.
        addr: String,
        /// The call.
        what: &'static str,
        /// The server's answer.
        status: tonic::Status,
    },
    /// The server refused a call for any other reason (another model, a failed step, a
    /// gradient it would not take), or answered something this worker cannot take.
    #[error("{what} at {addr}: {:?}: {}", status.code(), status.message())]
    Refused {
        /// The shard's address.
        addr: String,
        /// The call.
        what: &'static str,
        /// The answer, as tonic reports it (or as this worker judged it: data loss).
        status: tonic::Status,
    },
    /// The connection under a call failed before the server answered (it died, reset the
    /// stream, or sent bytes that are not HTTP/2).
    #[error(
        "{what} at {addr}: {:?}: {}{}",
        status.code(),
        status.message(),
        if *looks_like_tls { TLS_HINT } else { "" }
    )]
    Transport {
        /// The shard's address.
        addr: String,
        /// The call.
        what: &'static str,
        /// The failure, as tonic reports it (its source is the transport's error).
        status: tonic::Status,
        /// A plaintext client read bytes that are not HTTP/2, as a TLS server's are.
        looks_like_tls: bool,
    },
    /// A plaintext client's first call failed, and the server turned out to serve TLS.
    #[error("{addr} serves TLS: pass --tls-ca ({what} in plaintext: {:?}: {})", status.code(), status.message())]
    ServesTls {
        /// The shard's address.
        addr: String,
        /// The call that failed.
        what: &'static str,
        /// How it failed.
        status: tonic::Status,
    },
    /// A shard's registration does not fit this worker (its model, its range, its rows, its
    /// chunks, its compression, its sync mode).
    #[error("{addr}: {why}")]
    Shard {
        /// The shard's address.
        addr: String,
        /// What does not fit.
        why: String,
    },
    /// The shards listed in `--servers` do not make one parameter server for this model
    /// together (their order, what they cover, whether they hold a table alone).
    #[error("--servers: {0}")]
    Servers(String),
    /// The shards disagree on what every one of them must share.
    #[error("the shards disagree on {what}: {detail}")]
    Disagree {
        /// What they disagree on.
        what: &'static str,
        /// How: each side's value.
        detail: String,
    },
    /// A bucket of the engine's gradient could not be staged to host memory for the push.
    #[error("staging bucket {index} of the gradient: {cause}")]
    Staging {
        /// The bucket's index in the staging plan.
        index: usize,
        /// Why.
        cause: gradsync_core::Error,
    },
    /// The engine failed: a gradient or parameters read or written, a table's rows.
    #[error(transparent)]
    Core(#[from] gradsync_core::Error),
}

impl PsError {
    /// A failed call `what` at `addr` as the variant that says who refused it: the failure
    /// of the connection under it when tonic saw one (a `source`), else the server's answer,
    /// by its code. `tls`: this worker dialled TLS, so bytes that are not HTTP/2 cannot be a
    /// TLS server's.
    pub fn from_status(addr: &str, what: &'static str, status: tonic::Status, tls: bool) -> PsError {
        let addr = addr.to_string();
        if std::error::Error::source(&status).is_some() {
            let looks_like_tls = !tls && spoke_other_than_http2(&status);
            return PsError::Transport { addr, what, status, looks_like_tls };
        }
        match status.code() {
            tonic::Code::Unauthenticated => PsError::Unauthenticated { addr, what, status },
            tonic::Code::ResourceExhausted => PsError::Exhausted { addr, what, status },
            _ => PsError::Refused { addr, what, status },
        }
    }

    /// The status a server answered with or tonic made, for the variants that carry one.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            PsError::Unauthenticated { status, .. }
            | PsError::Exhausted { status, .. }
            | PsError::Refused { status, .. }
            | PsError::Transport { status, .. }
            | PsError::ServesTls { status, .. } => Some(status),
            _ => None,
        }
    }
}

/// Whether the connection under `s` failed on bytes that are not HTTP/2 (as a TLS server's
/// alert to a plaintext client is), rather than being closed, reset or refused (a server
/// that died).
fn spoke_other_than_http2(s: &tonic::Status) -> bool {
    let mut cur = std::error::Error::source(s);
    while let Some(e) = cur {
        let text = e.to_string();
        // h2's codec: a connection that ended inside a frame header, or a "frame" whose
        // header makes no sense (TLS records read as HTTP/2 frames).
        if text.contains("bytes remaining on stream") || text.contains("frame with invalid size") {
            return true;
        }
        cur = e.source();
    }
    false
}

/// The result type of the parameter-server client.
pub type Result<T, E = PsError> = std::result::Result<T, E>;
