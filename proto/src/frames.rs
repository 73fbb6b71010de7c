//! gRPC messages straight over HTTP/2 DATA frames, for the two bulk RPCs (PushGradients,
//! PullParameters), without the copies tonic's codec makes.
//!
//! tonic copies every message twice on its way through: its encoder writes the whole message,
//! payload included, into a fresh buffer (`EncodeBuf` is a `BytesMut`; `Bytes` fields are
//! copied in), and its decoder appends every received DATA frame to its own buffer before
//! decoding. Neither is avoidable through tonic's `Codec` trait, which only ever sees those
//! buffers. Here the wire format is the same (a 5-byte prefix, then the protobuf message;
//! trailers carry `grpc-status`), so any gRPC peer still talks to gradsync, but:
//!
//! - sending: the f32 buffer is encoded once straight into its wire image, every chunk's
//!   message prefix and small fields in front of its payload ([`Framed`]); each message is then
//!   a zero-copy slice, one body frame ([`Frames`]) and one HTTP/2 DATA frame, which h2 writes
//!   with `writev` straight from the slice. Or, where the caller's buffer already is the
//!   payload (f32 on a little-endian host), the message is lent it ([`FramedChunk::lend`]):
//!   a small DATA frame with the message's head, then the caller's bytes as the next.
//! - receiving: [`MessageReader`] cuts messages out of the received frames as ropes of slices
//!   of them ([`Rope`]), and prost decodes a `bytes` field from a rope as one more slice when it
//!   lies in one frame (the usual case), so the payload reaches its destination with a single
//!   pass (`wire::decode_into`) after the kernel's copy.
//!
//! Memory stays bounded: a declared message length above the limit is refused before anything
//! is buffered for it, and [`Messages`] asks the body for another frame only when no complete
//! message is buffered.
//!
//! Over 600 lines with its tests (about 140): both directions of one wire format (encoding,
//! decoding, trailers, errors) kept together, so the two ends cannot drift apart.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame};
use prost::Message;
use tonic::{Code, Status};

/// The gRPC message prefix: a compression flag and a big-endian u32 length.
pub const PREFIX: usize = 5;

/// The headers every gRPC request and response carries.
pub const CONTENT_TYPE: &str = "application/grpc";

/// Write the part of a gRPC message that precedes its payload: the prefix, `head`'s fields,
/// and the key and length of the `bytes` field numbered `tag` that holds `payload_len` bytes.
/// `head` must leave that field empty (proto3 then does not encode it).
fn put_head<M: Message>(head: &M, tag: u32, payload_len: usize, out: &mut BytesMut) {
    let total = head.encoded_len()
        + prost::encoding::key_len(tag)
        + prost::encoding::encoded_len_varint(payload_len as u64)
        + payload_len;
    out.put_u8(0);
    out.put_u32(u32::try_from(total).unwrap_or(u32::MAX));
    // Encoding into a BytesMut cannot run out of room (it grows).
    let _ = head.encode(out);
    prost::encoding::encode_key(tag, prost::encoding::WireType::LengthDelimited, out);
    prost::encoding::encode_varint(payload_len as u64, out);
}

/// Room for [`put_head`]'s bytes: the prefix and at most a few varints.
const HEAD_ROOM: usize = 64;

/// `head` followed by a `bytes` field numbered `tag` holding `payload`, as the two `Bytes` of
/// one length-prefixed gRPC message: everything but the payload, then the payload (not
/// copied).
pub fn payload_message<M: Message>(head: &M, tag: u32, payload: Bytes) -> [Bytes; 2] {
    let mut prefix = BytesMut::with_capacity(HEAD_ROOM + head.encoded_len());
    put_head(head, tag, payload.len(), &mut prefix);
    [prefix.freeze(), payload]
}

/// A buffer of f32 values laid out as it goes on the wire: chunk after chunk, each a whole
/// gRPC message (prefix, header fields, payload key and length, then the little-endian
/// payload) in its own allocation. Sending is then one zero-copy slice per message
/// ([`Framed::message`]), so every DATA frame carries one whole message and the receiver finds
/// each payload in one piece; tonic's codec path takes the payloads alone ([`Framed::payload`]).
/// One allocation per chunk (not one for the whole buffer) keeps each below glibc's mmap
/// threshold, so it comes back from the heap warm instead of freshly faulted in, and lets a
/// producer hand out chunk `i` while it still writes chunk `i + 1` ([`FramedChunk::build`]).
#[derive(Debug, Clone, Default)]
pub struct Framed {
    chunks: Vec<FramedChunk>,
}

/// One chunk of a [`Framed`] buffer: a whole gRPC message whose payload starts at `at`; or
/// ([`FramedChunk::lend`]) the message's head alone, its payload in memory the chunk does not
/// own.
#[derive(Debug, Clone)]
pub struct FramedChunk {
    /// The whole message, or everything before the payload when it is `lent`.
    msg: Bytes,
    /// Where the payload starts in `msg` (`msg.len()` when it is lent).
    at: usize,
    /// The payload, when it is a view of someone else's buffer rather than part of `msg`.
    lent: Option<Bytes>,
    offset: u64,
}

/// The buffer a [`FramedChunk::build_f32_in`] message was built in, kept to build another in
/// once every chunk (and clone) of the first has been dropped. Words, so that the payload of
/// a message built in it is aligned f32.
#[derive(Debug, Clone, Default)]
pub struct MessageBuf(Arc<Vec<u32>>);

/// A [`MessageBuf`]'s words as the bytes of a [`Bytes`] (its owner: the buffer stays until the
/// last view of it is dropped).
struct Words(Arc<Vec<u32>>);

impl AsRef<[u8]> for Words {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl FramedChunk {
    /// The message `head` (at `offset` values) whose `bytes` field `tag` holds `payload_len`
    /// bytes, which `fill` appends (little-endian f32) straight into the message's buffer.
    pub fn build<M: Message>(
        head: &M,
        tag: u32,
        offset: u64,
        payload_len: usize,
        fill: impl FnOnce(&mut BytesMut),
    ) -> FramedChunk {
        let mut buf = BytesMut::with_capacity(HEAD_ROOM + head.encoded_len() + payload_len);
        put_head(head, tag, payload_len, &mut buf);
        let at = buf.len();
        fill(&mut buf);
        debug_assert_eq!(buf.len(), at + payload_len, "fill wrote another length than declared");
        FramedChunk { msg: buf.freeze(), at, lent: None, offset }
    }

    /// The message `head` (at `offset` values) whose `bytes` field `tag` holds `values` f32,
    /// which `fill` writes straight into the message's buffer as values. The message starts
    /// where its payload lands 4-byte aligned, so the payload can be handed out as `&mut [f32]`
    /// (for example to a device's copy-out); little-endian order is restored afterwards on
    /// big-endian hosts.
    pub fn build_f32<M: Message, E>(
        head: &M,
        tag: u32,
        offset: u64,
        values: usize,
        fill: impl FnOnce(&mut [f32]) -> Result<(), E>,
    ) -> Result<FramedChunk, E> {
        Ok(FramedChunk::build_f32_in(None, head, tag, offset, values, fill)?.0)
    }

    /// [`FramedChunk::build_f32`] in `reuse` where every chunk built in it before has been
    /// dropped (it is then overwritten, not zeroed first), in a fresh buffer otherwise; also
    /// returns the buffer the chunk was built in, to pass back once its chunks are gone. A
    /// producer that builds the same messages again and again (the parameter server's image of
    /// every version) thus spares a fresh allocation per message, its zeroing, and the page
    /// faults and unmapping of memory the allocator took from the kernel and gave back.
    pub fn build_f32_in<M: Message, E>(
        reuse: Option<MessageBuf>,
        head: &M,
        tag: u32,
        offset: u64,
        values: usize,
        fill: impl FnOnce(&mut [f32]) -> Result<(), E>,
    ) -> Result<(FramedChunk, MessageBuf), E> {
        let mut h = BytesMut::with_capacity(HEAD_ROOM + head.encoded_len());
        put_head(head, tag, values * 4, &mut h);
        // Padding in front of the message puts the payload on a word boundary of the buffer.
        let pad = (4 - h.len() % 4) % 4;
        let at = pad + h.len();
        // Unique stays unique: the chunks' views can only be dropped, not cloned into an Arc.
        let mut words = reuse
            .map(|b| b.0)
            .filter(|w| Arc::strong_count(w) == 1 && Arc::weak_count(w) == 0)
            .unwrap_or_default();
        let buf = Arc::make_mut(&mut words);
        // Only words past the old length are zeroed: a reused buffer of the same size is not.
        buf.truncate(at / 4 + values);
        buf.resize(at / 4 + values, 0);
        let (front, payload) = buf.split_at_mut(at / 4);
        let front: &mut [u8] = bytemuck::cast_slice_mut(front);
        front[..pad].fill(0);
        front[pad..].copy_from_slice(&h);
        let dst: &mut [f32] = bytemuck::cast_slice_mut(payload);
        fill(dst)?;
        if cfg!(target_endian = "big") {
            for v in dst.iter_mut() {
                *v = f32::from_bits(v.to_bits().swap_bytes());
            }
        }
        let msg = Bytes::from_owner(Words(Arc::clone(&words))).slice(pad..);
        Ok((FramedChunk { msg, at: at - pad, lent: None, offset }, MessageBuf(words)))
    }

    /// The message `head` (at `offset` values) whose `bytes` field `tag` is `payload`, which is
    /// not copied: the chunk is the message's head (prefix, `head`'s fields, the payload's key
    /// and length) in a small buffer of its own, and `payload` as it is, for example a
    /// [`Bytes::from_owner`] view of a buffer that stays put until every clone is dropped.
    /// Sent as two DATA frames ([`FramedChunk::frames`]); the receiver's reader finds the
    /// payload in one piece all the same.
    pub fn lend<M: Message>(head: &M, tag: u32, offset: u64, payload: Bytes) -> FramedChunk {
        let [msg, payload] = payload_message(head, tag, payload);
        FramedChunk { at: msg.len(), msg, lent: Some(payload), offset }
    }

    /// The whole message, prefix included: a slice, no copy, unless the payload is lent
    /// ([`FramedChunk::lend`]): then head and payload are gathered into one new buffer. To send
    /// a chunk, take its [`FramedChunk::frames`].
    pub fn message(&self) -> Bytes {
        match &self.lent {
            None => self.msg.clone(),
            Some(p) => {
                let mut b = BytesMut::with_capacity(self.msg.len() + p.len());
                b.extend_from_slice(&self.msg);
                b.extend_from_slice(p);
                b.freeze()
            }
        }
    }

    /// The message as the DATA frames it goes in, without copying: the whole message, or its
    /// head and then its lent payload.
    pub fn frames(&self) -> impl Iterator<Item = Bytes> + use<> {
        std::iter::once(self.msg.clone()).chain(self.lent.clone())
    }

    /// The message (after its prefix) decoded as `M`, its payload field a slice of the
    /// chunk's payload (no copy).
    pub fn decode<M: Message + Default>(&self) -> Result<M, prost::DecodeError> {
        let head = self.msg.slice(PREFIX..);
        match &self.lent {
            None => M::decode(head),
            Some(p) => M::decode(head.chain(p.clone())),
        }
    }

    /// The payload alone and its offset in values.
    pub fn payload(&self) -> (u64, Bytes) {
        let payload = match &self.lent {
            None => self.msg.slice(self.at..),
            Some(p) => p.clone(),
        };
        (self.offset, payload)
    }

    /// Payload bytes.
    pub fn payload_len(&self) -> usize {
        self.lent.as_ref().map_or(self.msg.len() - self.at, Bytes::len)
    }
}

impl Framed {
    /// Lay out `src` in chunks of `chunk_bytes` payload bytes, each message `head(offset)`
    /// (offset in values) with the payload in field `tag`. One pass over `src`.
    pub fn encode<M: Message>(src: &[f32], chunk_bytes: usize, tag: u32, head: impl Fn(u64) -> M) -> Framed {
        let chunks = crate::wire::chunks(src.len() * 4, chunk_bytes)
            .map(|r| {
                let offset = (r.start / 4) as u64;
                FramedChunk::build(&head(offset), tag, offset, r.len(), |buf| {
                    crate::wire::put_f32(&src[r.start / 4..r.end / 4], buf)
                })
            })
            .collect();
        Framed { chunks }
    }

    /// Chunks built one by one ([`FramedChunk::build`]), in order.
    pub fn from_chunks(chunks: Vec<FramedChunk>) -> Framed {
        Framed { chunks }
    }

    /// The number of chunks.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether there are none (an empty range).
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Chunk `i` as a whole gRPC message, prefix included (a slice, no copy).
    pub fn message(&self, i: usize) -> Bytes {
        self.chunks[i].message()
    }

    /// Chunk `i`'s payload alone and its offset in values.
    pub fn payload(&self, i: usize) -> (u64, Bytes) {
        self.chunks[i].payload()
    }

    /// Chunk `i`.
    pub fn chunk(&self, i: usize) -> FramedChunk {
        self.chunks[i].clone()
    }

    /// Payload bytes in all chunks.
    pub fn payload_len(&self) -> u64 {
        self.chunks.iter().map(|c| c.payload_len() as u64).sum()
    }
}

/// One small message (no payload) with its gRPC prefix.
pub fn message(m: &impl Message) -> Bytes {
    let len = m.encoded_len();
    let mut b = BytesMut::with_capacity(PREFIX + len);
    b.put_u8(0);
    b.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    let _ = m.encode(&mut b);
    b.freeze()
}

/// A body made of frames known up front (data, then optional trailers): the request body of
/// a push, the response body of a pull or a push reply.
#[derive(Debug, Default)]
pub struct Frames {
    frames: VecDeque<Frame<Bytes>>,
    len: u64,
}

impl Frames {
    /// No frames yet.
    pub fn new() -> Self {
        Frames::default()
    }

    /// Append a DATA frame (empty ones are skipped).
    pub fn data(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.len += b.len() as u64;
            self.frames.push_back(Frame::data(b));
        }
    }

    /// End with trailers saying OK (responses).
    pub fn ok_trailers(&mut self) {
        let mut t = HeaderMap::new();
        t.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
        self.frames.push_back(Frame::trailers(t));
    }

    /// The frames as a tonic body.
    pub fn into_body(self) -> tonic::body::Body {
        tonic::body::Body::new(self)
    }
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Poll::Ready(self.frames.pop_front().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.frames.iter().any(|f| !f.is_data()) {
            return http_body::SizeHint::default();
        }
        http_body::SizeHint::with_exact(self.len)
    }
}

/// A message's bytes as slices of the frames they arrived in. As a [`Buf`], `copy_to_bytes`
/// hands out a slice (no copy) whenever the bytes asked for lie in one frame.
#[derive(Debug, Default)]
pub struct Rope {
    parts: VecDeque<Bytes>,
    remaining: usize,
}

impl Buf for Rope {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |b| b.as_ref())
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the end of a message");
        self.remaining -= cnt;
        while cnt > 0 {
            let Some(front) = self.parts.front_mut() else { return };
            if cnt < front.len() {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.parts.pop_front();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(len <= self.remaining, "copy_to_bytes past the end of a message");
        match self.parts.front_mut() {
            Some(front) if front.len() >= len => {
                self.remaining -= len;
                let out = front.split_to(len);
                if front.is_empty() {
                    self.parts.pop_front();
                }
                out
            }
            _ => {
                // Spans frames: the one place bytes are gathered (a peer's odd framing).
                let mut out = BytesMut::with_capacity(len);
                out.put(self.take(len));
                out.freeze()
            }
        }
    }
}

/// Why a frame sequence is not a sequence of gRPC messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A message declared longer than the limit.
    #[error("a message of {len} bytes declared, the limit is {limit}")]
    TooLong {
        /// Declared length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A compressed message (gradsync never negotiates compression).
    #[error("a compressed message (flag {0}); this endpoint accepts only uncompressed messages")]
    Compressed(u8),
    /// The stream ended inside a message.
    #[error("the stream ended inside a message ({0} bytes left over)")]
    Truncated(usize),
}

impl From<FrameError> for Status {
    fn from(e: FrameError) -> Status {
        match e {
            FrameError::TooLong { .. } => Status::out_of_range(e.to_string()),
            FrameError::Compressed(_) => Status::unimplemented(e.to_string()),
            FrameError::Truncated(_) => Status::internal(e.to_string()),
        }
    }
}

/// Cuts length-prefixed gRPC messages out of DATA frames, as [`Rope`]s of slices of them.
#[derive(Debug)]
pub struct MessageReader {
    buf: Rope,
    /// The length of the message whose prefix has been read.
    want: Option<usize>,
    limit: usize,
}

impl MessageReader {
    /// A reader refusing messages longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        MessageReader { buf: Rope::default(), want: None, limit }
    }

    /// Add a received DATA frame.
    pub fn push(&mut self, frame: Bytes) {
        if !frame.is_empty() {
            self.buf.remaining += frame.len();
            self.buf.parts.push_back(frame);
        }
    }

    /// The next complete message, `None` until its last byte has been pushed.
    pub fn next_message(&mut self) -> Result<Option<Rope>, FrameError> {
        let len = match self.want {
            Some(len) => len,
            None => {
                if self.buf.remaining < PREFIX {
                    return Ok(None);
                }
                let flag = self.buf.get_u8();
                let len = self.buf.get_u32() as usize;
                if flag != 0 {
                    return Err(FrameError::Compressed(flag));
                }
                if len > self.limit {
                    return Err(FrameError::TooLong { len, limit: self.limit });
                }
                self.want = Some(len);
                len
            }
        };
        if self.buf.remaining < len {
            return Ok(None);
        }
        self.want = None;
        let mut msg = Rope { parts: VecDeque::new(), remaining: len };
        let mut left = len;
        while left > 0 {
            let Some(front) = self.buf.parts.front_mut() else { break };
            if front.len() <= left {
                left -= front.len();
                msg.parts.extend(self.buf.parts.pop_front());
            } else {
                msg.parts.push_back(front.split_to(left));
                left = 0;
            }
        }
        self.buf.remaining -= len;
        Ok(Some(msg))
    }

    /// The body ended: refuses a partial message left behind.
    pub fn finish(&self) -> Result<(), FrameError> {
        match self.buf.remaining + self.want.map_or(0, |_| PREFIX) {
            0 => Ok(()),
            n => Err(FrameError::Truncated(n)),
        }
    }
}

/// The messages of a request or response body, decoded as they complete. For responses the
/// trailers' `grpc-status` is checked when the body ends.
#[derive(Debug)]
pub struct Messages<B> {
    body: B,
    reader: MessageReader,
    trailers: Option<HeaderMap>,
    done: bool,
    response: bool,
}

impl<B> Messages<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Read a request's `body`, refusing messages longer than `limit` bytes.
    pub fn new(body: B, limit: usize) -> Self {
        Messages { body, reader: MessageReader::new(limit), trailers: None, done: false, response: false }
    }

    /// The next message, or `None` at the end of the body (for a response, once its trailers
    /// said OK; their error status otherwise).
    pub async fn message<M: Message + Default>(&mut self) -> Result<Option<M>, Status> {
        loop {
            if let Some(mut rope) = self.reader.next_message()? {
                return M::decode(&mut rope)
                    .map(Some)
                    .map_err(|e| Status::internal(format!("decoding a message: {e}")));
            }
            if self.done {
                self.reader.finish()?;
                if self.response {
                    self.status()?;
                }
                return Ok(None);
            }
            let frame = std::future::poll_fn(|cx| Pin::new(&mut self.body).poll_frame(cx)).await;
            match frame {
                None => self.done = true,
                Some(Err(e)) => return Err(status_of(e.into())),
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => self.reader.push(d),
                    Err(f) => {
                        if let Ok(t) = f.into_trailers() {
                            self.trailers.get_or_insert_with(HeaderMap::new).extend(t);
                        }
                    }
                },
            }
        }
    }

    /// The status a response's trailers carry (a missing `grpc-status` is an error).
    fn status(&self) -> Result<(), Status> {
        match self.trailers.as_ref().and_then(status_in) {
            Some(s) if s.code() == Code::Ok => Ok(()),
            Some(s) => Err(s),
            None => Err(Status::internal("the response ended without a grpc-status")),
        }
    }
}

/// The status a header map carries, if any. (`grpc-status-details-bin` is dropped first:
/// tonic panics on one that is not base64, and gradsync never sends one.)
pub fn status_in(h: &HeaderMap) -> Option<Status> {
    if h.contains_key(Status::GRPC_STATUS_DETAILS) {
        let mut h = h.clone();
        h.remove(Status::GRPC_STATUS_DETAILS);
        return Status::from_header_map(&h);
    }
    Status::from_header_map(h)
}

/// A transport or body error as a status (keeping one that already is).
pub fn status_of(e: Box<dyn std::error::Error + Send + Sync>) -> Status {
    match e.downcast::<Status>() {
        Ok(s) => *s,
        Err(e) => Status::from_error(e),
    }
}

/// A `grpc-timeout` header value for `d` (milliseconds, at most the 8 digits gRPC allows).
pub fn timeout_header(d: std::time::Duration) -> http::HeaderValue {
    let ms = d.as_millis().clamp(1, 99_999_999);
    // Digits and a letter are always a valid header value.
    http::HeaderValue::from_str(&format!("{ms}m")).unwrap_or(http::HeaderValue::from_static("99999999m"))
}

/// The response to a gRPC call, checked: an HTTP status other than 200 or a trailers-only
/// error becomes that error; otherwise the messages of its body.
pub fn response_messages(
    resp: http::Response<tonic::body::Body>,
    limit: usize,
) -> Result<Messages<tonic::body::Body>, Status> {
    if let Some(s) = status_in(resp.headers())
        && s.code() != Code::Ok
    {
        return Err(s);
    }
    if resp.status() != http::StatusCode::OK {
        return Err(Status::unknown(format!("HTTP status {} (not a gRPC server?)", resp.status())));
    }
    Ok(Messages { response: true, ..Messages::new(resp.into_body(), limit) })
}

/// A stream of messages `M`, whichever framing delivered them: tonic's codec, or
/// [`Messages`] straight from the frames.
#[derive(Debug)]
pub enum Incoming<M> {
    /// Decoded by tonic.
    Codec(tonic::Streaming<M>),
    /// Decoded here, without copies.
    Direct(Messages<tonic::body::Body>),
}

impl<M: Message + Default> Incoming<M> {
    /// The next message, `None` at the end of the stream.
    pub async fn message(&mut self) -> Result<Option<M>, Status> {
        match self {
            Incoming::Codec(s) => s.message().await,
            Incoming::Direct(m) => m.message().await,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pb::{GradientChunk, PushReply};

    fn chunk(offset: u64, data: &[u8]) -> GradientChunk {
        GradientChunk {
            rank: 3,
            base_version: 7,
            offset,
            data: Bytes::copy_from_slice(data),
            ..GradientChunk::default()
        }
    }

    /// The two-part encoding is byte for byte prost's (what tonic sends).
    #[test]
    fn payload_message_is_the_standard_encoding() {
        let full = chunk(12, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let head = GradientChunk { data: Bytes::new(), ..full.clone() };
        let [p, d] = payload_message(&head, 4, full.data.clone());
        let mut wire = p.to_vec();
        wire.extend_from_slice(&d);
        let mut expect = vec![0u8];
        expect.extend_from_slice(&(full.encoded_len() as u32).to_be_bytes());
        expect.extend_from_slice(&full.encode_to_vec());
        assert_eq!(wire, expect);
        assert_eq!(d.as_ptr(), full.data.as_ptr(), "the payload is not copied");
    }

    /// Messages split at every possible frame boundary decode the same; a payload that lies in
    /// one frame is a slice of it.
    #[test]
    fn reads_messages_across_any_frame_split() {
        let msgs = [chunk(0, &[9; 40]), chunk(10, &[8; 8])];
        let mut wire = Vec::new();
        for m in &msgs {
            let [p, d] =
                payload_message(&GradientChunk { data: Bytes::new(), ..m.clone() }, 4, m.data.clone());
            wire.extend_from_slice(&p);
            wire.extend_from_slice(&d);
        }
        let wire = Bytes::from(wire);
        for cut in 0..=wire.len() {
            let mut r = MessageReader::new(1 << 20);
            let mut got = Vec::new();
            for part in [wire.slice(..cut), wire.slice(cut..)] {
                r.push(part);
                while let Some(mut m) = r.next_message().unwrap() {
                    got.push(GradientChunk::decode(&mut m).unwrap());
                }
            }
            r.finish().unwrap();
            assert_eq!(got, msgs, "split at {cut}");
        }
        // One frame: the payload is a slice of it.
        let mut r = MessageReader::new(1 << 20);
        r.push(wire.clone());
        let m = GradientChunk::decode(&mut r.next_message().unwrap().unwrap()).unwrap();
        let at = m.data.as_ptr() as usize - wire.as_ptr() as usize;
        assert!(at < wire.len(), "the payload was copied");
    }

    /// Each framed message is what prost and tonic would send for that chunk.
    #[test]
    fn framed_messages_are_standard_messages() {
        let v: Vec<f32> = (0..1001).map(|i| i as f32 * 0.25).collect();
        let f = Framed::encode(&v, 400, 4, |o| chunk(o, &[]));
        assert_eq!(f.len(), 11);
        assert_eq!(f.payload_len(), 4004);
        let mut r = MessageReader::new(1 << 20);
        let mut out = vec![0.0; v.len()];
        for i in 0..f.len() {
            r.push(f.message(i));
            let m = GradientChunk::decode(&mut r.next_message().unwrap().unwrap()).unwrap();
            let (offset, payload) = f.payload(i);
            assert_eq!((m.offset, &m.data), (offset, &payload));
            assert_eq!((m.rank, m.base_version), (3, 7));
            crate::wire::decode_into(&m.data, m.offset, &mut out).unwrap();
        }
        assert_eq!(out, v);
        assert!(Framed::encode(&[], 400, 4, |o| chunk(o, &[])).is_empty());
        // Filled in place as f32 (a device's copy-out): the same messages, byte for byte.
        for (i, r) in crate::wire::chunks(v.len() * 4, 400).enumerate() {
            let vals = r.start / 4..r.end / 4;
            let o = vals.start as u64;
            let filled = FramedChunk::build_f32(&chunk(o, &[]), 4, o, vals.len(), |dst| {
                dst.copy_from_slice(&v[vals.clone()]);
                Ok::<(), ()>(())
            })
            .unwrap();
            assert_eq!(filled.message(), f.message(i), "chunk {i}");
            assert_eq!(filled.payload(), f.payload(i), "chunk {i}");
        }
    }

    /// A message built again in the buffer of one whose chunks are all gone takes that buffer
    /// (same memory, no fresh allocation) and is byte for byte the message a fresh build makes,
    /// also where the head grew; a buffer still viewed by a live chunk is left alone, and the
    /// live chunk keeps its bits.
    #[test]
    fn a_message_is_built_again_in_a_buffer_no_chunk_holds() {
        let build = |reuse, version: u64, v: f32| {
            let head = crate::pb::ParameterChunk { version, offset: 8, ..Default::default() };
            FramedChunk::build_f32_in(reuse, &head, 3, 8, 1000, |d| {
                d.fill(v);
                Ok::<(), ()>(())
            })
            .unwrap()
        };
        let fresh = |version, v| build(None, version, v).0.message();
        let (first, buf) = build(None, 1, 1.0);
        let at = first.message().as_ptr();
        drop(first);
        // Version 200 takes a varint byte more than version 1: the head grows by one.
        let (second, buf) = build(Some(buf), 200, 2.0);
        assert_eq!(second.message(), fresh(200, 2.0));
        assert!(
            (second.message().as_ptr() as usize).abs_diff(at as usize) < 4,
            "not built in the old buffer"
        );
        let held = second.clone();
        drop(second);
        let (third, _) = build(Some(buf), 201, 3.0);
        assert_eq!(third.message(), fresh(201, 3.0));
        assert_ne!(third.message().as_ptr(), held.message().as_ptr(), "built over a live chunk");
        assert_eq!(held.message(), fresh(200, 2.0));
        if cfg!(target_endian = "little") {
            assert_eq!(crate::wire::as_f32(&third.payload().1), Some(&[3.0f32; 1000][..]));
        }
    }

    /// A lent payload goes as a DATA frame of its own, not copied; the two frames are the
    /// standard message, and the receiver decodes the payload as a slice of its frame.
    #[test]
    fn lent_payloads_are_sent_and_received_without_copies() {
        let v: Vec<f32> = (0..300).map(|i| i as f32 - 7.5).collect();
        let payload = crate::wire::encode(&v, BytesMut::new());
        let lent = FramedChunk::lend(&chunk(40, &[]), 4, 40, payload.clone());
        let whole =
            FramedChunk::build(&chunk(40, &[]), 4, 40, payload.len(), |b| b.extend_from_slice(&payload));
        let frames: Vec<Bytes> = lent.frames().collect();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[1].as_ptr(), payload.as_ptr(), "the payload frame is the payload itself");
        assert_eq!([&frames[0][..], &frames[1][..]].concat(), whole.message().to_vec());
        assert_eq!(lent.message(), whole.message());
        assert_eq!(lent.payload(), whole.payload());
        assert_eq!(lent.payload_len(), payload.len());
        let m: GradientChunk = lent.decode().unwrap();
        assert_eq!(m, whole.decode::<GradientChunk>().unwrap());
        assert_eq!(m.data.as_ptr(), payload.as_ptr(), "decoding copied the lent payload");
        let mut r = MessageReader::new(1 << 20);
        for f in lent.frames() {
            r.push(f);
        }
        let got = GradientChunk::decode(&mut r.next_message().unwrap().unwrap()).unwrap();
        r.finish().unwrap();
        assert_eq!((got.offset, got.rank, got.base_version), (40, 3, 7));
        assert_eq!(got.data.as_ptr(), payload.as_ptr(), "the reader copied the payload frame");
    }

    #[test]
    fn refuses_long_compressed_and_truncated() {
        let mut r = MessageReader::new(16);
        r.push(Bytes::from_static(&[0, 0, 0, 0, 17]));
        assert_eq!(r.next_message().unwrap_err(), FrameError::TooLong { len: 17, limit: 16 });
        let mut r = MessageReader::new(16);
        r.push(Bytes::from_static(&[1, 0, 0, 0, 1, 0]));
        assert_eq!(r.next_message().unwrap_err(), FrameError::Compressed(1));
        let mut r = MessageReader::new(16);
        r.push(message(&PushReply { version: 5, staleness: 0, wait_ms: 1.5 }).slice(..7));
        assert!(r.next_message().unwrap().is_none());
        assert!(matches!(r.finish(), Err(FrameError::Truncated(_))));
        let mut r = MessageReader::new(16);
        r.push(Bytes::from_static(&[0, 0]));
        assert_eq!(r.finish(), Err(FrameError::Truncated(2)));
    }

    #[test]
    fn statuses_from_trailers() {
        let mut h = HeaderMap::new();
        h.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("3"));
        h.insert(Status::GRPC_MESSAGE, http::HeaderValue::from_static("bad%20chunk"));
        h.insert(Status::GRPC_STATUS_DETAILS, http::HeaderValue::from_static("***not base64***"));
        let s = status_in(&h).unwrap();
        assert_eq!((s.code(), s.message()), (Code::InvalidArgument, "bad chunk"));
        assert_eq!(timeout_header(std::time::Duration::from_secs(2)), "2000m");
    }

    #[test]
    fn reads_aligned_payloads_in_place_only() {
        let vals = [1.5f32, -2.0, 3.25, 0.0];
        let head = crate::pb::ParameterChunk::default();
        let f = FramedChunk::build_f32(&head, 3, 0, 4, |d| {
            d.copy_from_slice(&vals);
            Ok::<(), ()>(())
        })
        .unwrap();
        let (_, payload) = f.payload();
        if cfg!(target_endian = "little") {
            assert_eq!(crate::wire::as_f32(&payload), Some(&vals[..]));
        }
        // Off by one byte from an aligned start, or not whole values: decode instead.
        let words = [0u32; 5];
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        assert_eq!(crate::wire::as_f32(&bytes[1..13]), None);
        assert_eq!(crate::wire::as_f32(&bytes[..6]), None);
    }
}
