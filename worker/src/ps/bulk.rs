//! The two bulk RPCs of one shard, PushGradients and PullParameters: each message goes
//! straight over the channel's HTTP/2 frames ([`frames`]), without tonic's codec and its two
//! copies per message, or through the generated client when [`Tuning::direct`] is off (the
//! benchmark's comparison rows). The wire format is the same either way.
//!
//! [`Tuning::direct`]: gradsync_proto::tuning::Tuning::direct

use std::ops::Range;
use std::time::{Duration, Instant};

use gradsync_core::compress::Half;
use gradsync_proto::frames::{self, Frames, Incoming};
use gradsync_proto::path::{PULL, PUSH};
use gradsync_proto::pb::{Encoding, GradientChunk, PullRequest, PushReply};
use gradsync_proto::wire;
use tonic::transport::Channel;

use super::chunks::{ChunkSink, Gradients};
use super::connect::{Auth, Shard, deadline, request};
use super::error::{PsError, Result};
use gradsync_core::metrics::ms_since;

/// Gradient messages a push builds ahead of what HTTP/2 has taken.
const PUSH_AHEAD: usize = 4;

/// DATA frames one gradient message goes in: one, or two when its payload is lent
/// ([`FramedChunk::lend`](gradsync_proto::frames::FramedChunk::lend)).
const FRAMES_PER_MESSAGE: usize = 2;

/// What the bulk RPCs need of a [`PsClient`].
pub(super) struct Opts<'a> {
    pub(super) timeout: Duration,
    pub(super) direct: bool,
    pub(super) limit: usize,
    pub(super) auth: &'a Auth,
    pub(super) rank: u32,
    /// The half precision pulls arrive in (`--compress fp16|bf16`), f32 when none.
    pub(super) pull_half: Option<Half>,
}

/// What one push or pull moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Transfer {
    /// Payload bytes.
    pub bytes: u64,
    /// Longest time a server held the push waiting for other workers, ms.
    pub wait_ms: f64,
    /// Largest staleness reported by any shard.
    pub staleness: u64,
    /// Milliseconds from the start of the call until the last shard finished.
    pub ms: f64,
}

/// The pushes' replies (and payload bytes) as one [`Transfer`], timed from `t`.
pub(super) fn push_transfer(replies: &[(PushReply, u64)], t: Instant) -> Transfer {
    replies.iter().fold(Transfer { ms: ms_since(t), ..Transfer::default() }, |a, (r, b)| Transfer {
        bytes: a.bytes + b,
        wait_ms: a.wait_ms.max(r.wait_ms),
        staleness: a.staleness.max(r.staleness),
        ms: a.ms,
    })
}

/// Push shard `s`'s range of `grads` as one PushGradients call. Returns the reply and the
/// payload bytes on the wire. Each message is built just before it is sent (one copy, from the
/// gradient into the message, so the first leaves at once and each is still in cache when the
/// kernel copies it into the socket; or none, when the message is lent the gradient's memory,
/// [`SharedGrads`](super::SharedGrads)).
pub(super) async fn push_shard<G: Gradients + ?Sized>(
    o: &Opts<'_>,
    s: &Shard,
    grads: &G,
) -> Result<(PushReply, u64)> {
    let (rank, base) = (o.rank, s.version);
    let chunk = |r: Range<usize>| {
        let head =
            GradientChunk { rank, base_version: base, offset: r.start as u64, ..GradientChunk::default() };
        grads.chunk(&head, s.range.start + r.start..s.range.start + r.end)
    };
    let ranges = || wire::chunks(s.range.len() * 4, s.chunk).map(|b| b.start / 4..b.end / 4);
    let r = if o.direct {
        let (tx, rx) = tokio::sync::mpsc::channel(PUSH_AHEAD * FRAMES_PER_MESSAGE);
        let body = tonic::body::Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ));
        // Owns the sender: the body ends when the last message is handed over.
        let produce = async move {
            for r in ranges() {
                match chunk(r) {
                    Ok(c) => {
                        for f in c.frames() {
                            if tx.send(Ok(http_body::Frame::data(f))).await.is_err() {
                                // The call ended early; its error says why.
                                return Ok(());
                            }
                        }
                    }
                    Err(e) => {
                        // Reset the stream: the server must not take a short push.
                        let _ = tx.send(Err(tonic::Status::cancelled(e.to_string()))).await;
                        return Err(e);
                    }
                }
            }
            Ok::<(), PsError>(())
        };
        let mut ch = s.rpc.channel.clone();
        let fut = async {
            let mut replies = call(&mut ch, o.auth, PUSH, o.timeout, body, o.limit).await?;
            let r = replies.message::<PushReply>().await?;
            match (r, replies.message::<PushReply>().await?) {
                (Some(r), None) => Ok(r),
                _ => Err(tonic::Status::internal("PushGradients must answer one PushReply")),
            }
        };
        let call = deadline(o.timeout, s.at(), "PushGradients", fut);
        tokio::pin!(produce, call);
        tokio::select! {
            // The call ended first (refused early, or past its deadline): nothing more to send,
            // whether or not the transport has let go of the body yet.
            reply = &mut call => reply?,
            produced = &mut produce => {
                produced?;
                call.await?
            }
        }
    } else {
        let chunks = ranges()
            .map(|r| {
                // The whole message, head fields (a sparse chunk's indices) included.
                chunk(r)?.decode::<GradientChunk>().map_err(|e| PsError::Invalid {
                    what: "re-reading a gradient message",
                    why: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut client = s.rpc.client.clone();
        let req = request(tokio_stream_iter(chunks), o.timeout);
        deadline(o.timeout, s.at(), "PushGradients", client.push_gradients(req)).await?.into_inner()
    };
    let wire = ranges().map(|r| grads.wire_bytes(s.range.start + r.start..s.range.start + r.end)).sum();
    Ok((r, wire))
}

/// Pull shard `s`'s parameters into `dst` chunk by chunk: the current version, or `want`
/// streamed as the server produces it (BSP); half-precision chunks (`--compress fp16|bf16`)
/// widened to f32 on arrival. Returns the version and the payload bytes on the wire.
pub(super) async fn pull_shard(
    o: &Opts<'_>,
    s: &Shard,
    dst: &mut impl ChunkSink,
    want: Option<u64>,
) -> Result<(u64, u64)> {
    let req = PullRequest { rank: o.rank, stream_version: want };
    let fut = async {
        let mut stream = if o.direct {
            let mut body = Frames::new();
            body.data(frames::message(&req));
            let mut ch = s.pull.channel.clone();
            Incoming::Direct(call(&mut ch, o.auth, PULL, o.timeout, body.into_body(), o.limit).await?)
        } else {
            let mut client = s.pull.client.clone();
            Incoming::Codec(client.pull_parameters(request(req, o.timeout)).await?.into_inner())
        };
        let (mut received, mut version, mut wire_bytes) = (0u64, None, 0u64);
        let expected = match o.pull_half {
            Some(Half::F16) => Encoding::F16,
            Some(Half::Bf16) => Encoding::Bf16,
            None => Encoding::F32,
        };
        let mut widened = Vec::new();
        while let Some(c) = stream.message().await? {
            if *version.get_or_insert(c.version) != c.version || c.offset != received {
                return Err(tonic::Status::data_loss("chunks of one pull disagree on version or order"));
            }
            if c.encoding != i32::from(expected) {
                return Err(tonic::Status::data_loss(format!(
                    "a parameter chunk encoded as {}, this worker's --compress pulls {}",
                    Encoding::try_from(c.encoding).map_or("an unknown encoding", |e| e.as_str_name()),
                    expected.as_str_name()
                )));
            }
            wire_bytes += c.data.len() as u64;
            let values = match o.pull_half {
                None => {
                    dst.put(&c.data, c.offset)?;
                    c.data.len() / 4
                }
                Some(h) => {
                    widened.resize(c.data.len() / 2, 0f32);
                    h.decode(&c.data, &mut widened).map_err(|e| tonic::Status::data_loss(e.to_string()))?;
                    dst.put(&wire::encode(&widened, bytes::BytesMut::new()), c.offset)?;
                    widened.len()
                }
            };
            received += values as u64;
        }
        if received as usize != dst.values() {
            return Err(tonic::Status::data_loss(format!("{received} values of {}", dst.values())));
        }
        Ok((version.or(want).unwrap_or(0), wire_bytes))
    };
    deadline(o.timeout, s.at(), "PullParameters", fut).await
}

/// Start the call `path` on `ch` with `body` as its request (the token, content type and
/// deadline as tonic would set them); its response's messages.
async fn call(
    ch: &mut Channel,
    auth: &Auth,
    path: &str,
    timeout: Duration,
    body: tonic::body::Body,
    limit: usize,
) -> std::result::Result<frames::Messages<tonic::body::Body>, tonic::Status> {
    let mut req = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .header(http::header::CONTENT_TYPE, frames::CONTENT_TYPE)
        .header(http::header::TE, "trailers")
        .header("grpc-timeout", frames::timeout_header(timeout));
    if let Some(v) = &auth.0 {
        req = req.header(gradsync_proto::auth::KEY, v.as_encoded_bytes());
    }
    let req = req.body(body).map_err(|e| tonic::Status::internal(e.to_string()))?;
    std::future::poll_fn(|cx| tonic::codegen::Service::poll_ready(ch, cx))
        .await
        .map_err(|e| frames::status_of(e.into()))?;
    let resp = tonic::codegen::Service::call(ch, req).await.map_err(|e| frames::status_of(e.into()))?;
    frames::response_messages(resp, limit)
}

/// A stream over owned chunks, as a client-streaming request body.
fn tokio_stream_iter(
    chunks: Vec<GradientChunk>,
) -> impl tonic::codegen::tokio_stream::Stream<Item = GradientChunk> {
    tonic::codegen::tokio_stream::iter(chunks)
}
