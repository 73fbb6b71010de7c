//! gradsync's gRPC protocol: the parameter-server service, compiled from `proto/` with protox
//! (no system protoc), and what both ends of it share.
//!
//! # Layout
//! - [`pb`]: the generated messages, client and server of `gradsync.ps.v1`.
//! - [`SyncMode`]: BSP, ASP or SSP, as the server runs it and tells its workers.
//! - [`path`] and [`tag`]: the RPC paths and the payload field numbers the bulk RPCs write by
//!   hand, defined once for both ends.
//! - [`wire`]: f32 buffers to and from chunk payloads (little-endian, one pass), chunking.
//! - [`frames`]: gRPC messages straight over HTTP/2 frames for the bulk RPCs, without the
//!   codec's copies (same wire format).
//! - [`tuning`]: HTTP/2 and TCP settings for bulk transfers (windows, frame size, chunk
//!   size), tuned and tonic's defaults side by side, applied to both ends the same way.
//! - [`auth`]: the token's metadata entry.
//! - [`tls`]: optional TLS settings for both ends from PEM files.
//!
//! Errors are [`Error`].

pub mod auth;
pub mod frames;
pub mod tls;
pub mod tuning;
pub mod wire;

/// The generated protocol (`gradsync.ps.v1`).
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("gradsync.ps.v1");
}

/// The encoded `FileDescriptorSet` of every proto file, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/gradsync_descriptor.bin"));

/// How often a worker sends a heartbeat to every server, whatever it is doing. An elastic
/// server's `--worker-timeout` must be longer, or it would drop live workers between beats.
pub const HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// The fully qualified name of the service (for the health service).
pub const SERVICE_NAME: &str = "gradsync.ps.v1.ParameterServer";

/// How gradients from several workers become updates: the server's `--sync`, told to every
/// worker at registration (`RegisterReply.sync`, its text form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// Bulk synchronous: one update per step from every live worker's gradient, averaged.
    Bsp,
    /// Asynchronous: each gradient is applied as it arrives.
    Asp,
    /// Stale synchronous: applied as they arrive, but no worker runs more than `S` steps
    /// ahead of the slowest.
    Ssp(u64),
}

impl std::str::FromStr for SyncMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bsp" => Ok(SyncMode::Bsp),
            "asp" => Ok(SyncMode::Asp),
            _ => s
                .strip_prefix("ssp:")
                .and_then(|n| n.parse().ok())
                .map(SyncMode::Ssp)
                .ok_or_else(|| format!("'{s}' (expected bsp, asp or ssp:S, S a bound in steps)")),
        }
    }
}

impl std::fmt::Display for SyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyncMode::Bsp => f.write_str("bsp"),
            SyncMode::Asp => f.write_str("asp"),
            SyncMode::Ssp(s) => write!(f, "ssp:{s}"),
        }
    }
}

/// The HTTP/2 paths of the service's RPCs, for the ends that speak them without tonic's
/// generated client or server (the direct bulk path, the connection limits, raw tests).
pub mod path {
    /// `PushGradients`.
    pub const PUSH: &str = "/gradsync.ps.v1.ParameterServer/PushGradients";
    /// `PullParameters`.
    pub const PULL: &str = "/gradsync.ps.v1.ParameterServer/PullParameters";
    /// `Register`.
    pub const REGISTER: &str = "/gradsync.ps.v1.ParameterServer/Register";
    /// `GetVersion`.
    pub const GET_VERSION: &str = "/gradsync.ps.v1.ParameterServer/GetVersion";
}

/// Field numbers of the `bytes data` payloads that [`frames`] writes after a message's other
/// fields (ps.proto is their definition; a test checks them against prost's encoding).
pub mod tag {
    /// `GradientChunk.data`.
    pub const GRADIENT_DATA: u32 = 4;
    /// `ParameterChunk.data`.
    pub const PARAMETER_DATA: u32 = 3;
}

#[cfg(test)]
mod protocol_tests {
    use prost::Message;

    use super::pb::{GradientChunk, ParameterChunk};
    use super::{SERVICE_NAME, path, tag};

    /// The key byte prost writes for a length-delimited field `n`.
    fn key(n: u32) -> u8 {
        u8::try_from(n << 3 | 2).unwrap_or(0)
    }

    #[test]
    fn payload_tags_are_the_generated_messages_own() {
        let g = GradientChunk { data: vec![9u8].into(), ..GradientChunk::default() }.encode_to_vec();
        assert_eq!(g, [key(tag::GRADIENT_DATA), 1, 9]);
        let p = ParameterChunk { data: vec![9u8].into(), ..ParameterChunk::default() }.encode_to_vec();
        assert_eq!(p, [key(tag::PARAMETER_DATA), 1, 9]);
    }

    #[test]
    fn paths_name_the_service() {
        for p in [path::PUSH, path::PULL, path::REGISTER, path::GET_VERSION] {
            let (service, method) = p[1..].split_once('/').unwrap_or(("", ""));
            assert_eq!(service, SERVICE_NAME);
            assert!(!method.is_empty() && method.chars().next().is_some_and(char::is_uppercase), "{p}");
        }
    }
}

/// Everything the protocol helpers refuse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A chunk payload whose length is not a whole number of f32 values.
    #[error("chunk of {0} bytes is not a whole number of f32 values")]
    Ragged(usize),
    /// A chunk that does not fit the range it is written into.
    #[error("chunk at offset {offset} with {len} values overruns a range of {range} values")]
    Overrun {
        /// Offset of the chunk, in values.
        offset: u64,
        /// Values in the chunk.
        len: usize,
        /// Values in the range.
        range: usize,
    },
    /// A token that cannot travel as an HTTP header value.
    #[error("the token must be visible ASCII (it travels as an HTTP header)")]
    BadToken,
    /// A TLS file that cannot be read or is not PEM.
    #[error("{flag} {}: {why}", path.display())]
    TlsFile {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// What was wrong.
        why: String,
    },
    /// TLS settings that do not work together (a key that does not parse or fit).
    #[error("TLS with {what}: {why}")]
    Tls {
        /// Which files.
        what: String,
        /// What was wrong.
        why: String,
    },
}
