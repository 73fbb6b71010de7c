//! HTTP/2 and TCP settings for moving large buffers, applied identically to the server and to
//! every client channel. Why each value is what it is (measured, not guessed) is in
//! `docs/ps.md`; the short version:
//!
//! - HTTP/2 flow-control windows default to 64 KiB, so a sender stalls every 64 KiB waiting for
//!   a WINDOW_UPDATE round trip; windows of several MiB keep the pipe full.
//! - The default maximum frame is 16 KiB: a 1 MiB chunk crosses as 64 frames, each with its
//!   own header, poll and wake-up; a larger frame cuts that per-byte overhead.
//! - `TCP_NODELAY` keeps the small control frames (window updates, trailers) from waiting
//!   behind Nagle's algorithm.
//! - The bulk RPCs go straight over HTTP/2 frames ([`crate::frames`]), skipping the two
//!   copies tonic's codec makes of every message.
//! - Chunks of about 1 MiB: large enough that per-message costs vanish, small enough that
//!   decoding one overlaps the arrival of the next and no chunk nears the 4 MiB default
//!   message limit.

use std::time::Duration;

use tonic::transport::{Endpoint, Server};

/// The largest frame HTTP/2 allows (2^24 - 1).
pub const MAX_FRAME: u32 = (1 << 24) - 1;

/// One set of transport settings. `None` leaves tonic's (hyper's, h2's) default in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// A short name for reports (`tuned`, `default`).
    pub name: &'static str,
    /// SETTINGS_INITIAL_WINDOW_SIZE (per stream), bytes.
    pub stream_window: Option<u32>,
    /// Connection-level window, bytes.
    pub connection_window: Option<u32>,
    /// SETTINGS_MAX_FRAME_SIZE, bytes.
    pub max_frame: Option<u32>,
    /// Let hyper grow windows by measuring the bandwidth-delay product (BDP pings).
    pub adaptive_window: bool,
    /// TCP_NODELAY on both ends.
    pub nodelay: bool,
    /// Payload bytes per chunk message.
    pub chunk_bytes: usize,
    /// PushGradients and PullParameters framed by [`crate::frames`] (no codec copies) rather
    /// than by tonic's codec. The wire format is the same either way.
    pub direct: bool,
}

impl Tuning {
    /// The settings gradsync uses.
    pub const fn tuned() -> Self {
        Tuning {
            name: "tuned",
            stream_window: Some(32 << 20),
            connection_window: Some(128 << 20),
            max_frame: Some(MAX_FRAME),
            adaptive_window: false,
            nodelay: true,
            chunk_bytes: 1 << 20,
            direct: true,
        }
    }

    /// The tuned windows and frames, but the bulk RPCs through tonic's codec: what gradsync
    /// used before [`crate::frames`], kept as the benchmark's middle row.
    pub const fn tonic_codec() -> Self {
        Tuning { name: "tuned-codec", direct: false, ..Tuning::tuned() }
    }

    /// tonic's defaults (64 KiB windows, 16 KiB frames), with the same chunking: the baseline
    /// the benchmark compares against.
    pub const fn tonic_defaults() -> Self {
        Tuning {
            name: "default",
            stream_window: None,
            connection_window: None,
            max_frame: None,
            adaptive_window: false,
            nodelay: true,
            chunk_bytes: 1 << 20,
            direct: false,
        }
    }

    /// The largest message either end accepts: one chunk plus its few header fields, with
    /// room to spare for a peer configured with a larger chunk.
    pub fn max_message(&self) -> usize {
        (self.chunk_bytes * 2).max(4 << 20) + 4096
    }

    /// A client endpoint for `uri` (`http://host:port`) with these settings and `timeout` as
    /// the connect timeout.
    pub fn endpoint(&self, uri: &str, timeout: Duration) -> Result<Endpoint, tonic::transport::Error> {
        let mut e = Endpoint::from_shared(uri.to_string())?
            .connect_timeout(timeout)
            .tcp_nodelay(self.nodelay)
            .initial_stream_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window)
            .max_frame_size(self.max_frame);
        if self.adaptive_window {
            e = e.http2_adaptive_window(true);
        }
        Ok(e)
    }

    /// A server builder with these settings. (TCP_NODELAY for accepted sockets is set on the
    /// incoming stream; see [`Tuning::nodelay`].)
    pub fn server(&self) -> Server {
        Server::builder()
            .tcp_nodelay(self.nodelay)
            .initial_stream_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window)
            .max_frame_size(self.max_frame)
            .http2_adaptive_window(self.adaptive_window.then_some(true))
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning::tuned()
    }
}
