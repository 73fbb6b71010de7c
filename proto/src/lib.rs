//! gradsync's gRPC protocol: the parameter-server service, compiled from `proto/` with protox
//! (no system protoc), and what both ends of it share.
//!
//! # Layout
//! - [`pb`]: the generated messages, client and server of `gradsync.ps.v1`.
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
