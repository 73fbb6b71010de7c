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
//! - Chunks chosen from the shard's size ([`Tuning::chunk_for_shard`]): an eighth of it, from
//!   64 KiB to 1 MiB. A BSP shard steps and streams back block by block, but its last block
//!   can go back only once every worker's push has ended, so the step's tail is one block per
//!   worker over the shard's link: a shard of only a few blocks idles its pull direction for
//!   much of the push. 1 MiB at most keeps every message far from the 4 MiB default message
//!   limit of other gRPC peers; 64 KiB at least keeps per-message costs small.

use std::time::Duration;

use tonic::transport::{Endpoint, Server};

/// The largest frame HTTP/2 allows (2^24 - 1).
pub const MAX_FRAME: u32 = (1 << 24) - 1;

/// The smallest chunk [`Tuning::chunk_for_shard`] picks, bytes.
pub const MIN_CHUNK: usize = 64 << 10;

/// The largest chunk [`Tuning::chunk_for_shard`] picks, bytes.
pub const MAX_CHUNK: usize = 1 << 20;

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
    /// Payload bytes per chunk message where nothing chose them from a shard's size
    /// ([`Tuning::chunk_for_shard`]).
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

    /// The chunk (and BSP block) for a shard of `shard_bytes`: the largest power of two at
    /// most an eighth of it, from [`MIN_CHUNK`] to [`MAX_CHUNK`].
    pub fn chunk_for_shard(shard_bytes: usize) -> usize {
        let eighth = (shard_bytes / 8).clamp(MIN_CHUNK, MAX_CHUNK);
        1 << eighth.ilog2()
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

#[cfg(test)]
mod tests {
    use super::{MAX_CHUNK, MIN_CHUNK, Tuning};

    #[test]
    fn chunks_follow_the_shard_size_within_bounds() {
        // mnist's 7.46 MB over 4 shards: 1.86 MB each, an eighth is 233 KB.
        assert_eq!(Tuning::chunk_for_shard(7_456_840 / 4), 128 << 10);
        // 8.4 MB over 2 shards: an eighth of 4.2 MB is just over 512 KiB.
        assert_eq!(Tuning::chunk_for_shard(8_392_608 / 2), 512 << 10);
        assert_eq!(Tuning::chunk_for_shard(64 << 20), MAX_CHUNK);
        assert_eq!(Tuning::chunk_for_shard(100), MIN_CHUNK);
        assert_eq!(Tuning::chunk_for_shard(0), MIN_CHUNK);
        for b in (0..40).map(|i| 1usize << i) {
            let c = Tuning::chunk_for_shard(b + 12_345);
            assert!(c.is_power_of_two() && (MIN_CHUNK..=MAX_CHUNK).contains(&c), "{b}: {c}");
        }
    }
}
