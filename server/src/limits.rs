//! What one client may hold, and for how long, whether or not it knows the token: every wait
//! for a client's bytes has a limit, and what incomplete requests hold is bounded.
//!
//! ```text
//!  accept ──► Guarded (the socket)        first request within --handshake-timeout, then
//!              │                          no request open for --idle-timeout: closed
//!              ▼
//!  HTTP/2 (hyper)                         at most --max-streams requests per connection,
//!              │                          pings every --keepalive, unanswered: closed
//!              ▼
//!  Guard (each request)                   counts the connection's open requests; a request
//!              │                          body in full within --worker-timeout, except
//!              ▼                          PushGradients, whose messages the service times
//!  the services                           one by one and whose incomplete messages share
//!                                         --push-buffer-mb (RESOURCE_EXHAUSTED past it)
//! ```
//!
//! Waiting for other workers (a BSP barrier, the SSP bound) is not waiting for a client's
//! bytes: [`crate::service`] bounds it by the worker timeout.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic::transport::server::Connected;

use crate::error::Error;
// PushGradients: its request body is the one read message by message, under the budget.
use gradsync_proto::path::PUSH;

/// The limits (`gradsync-server` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From TCP accept to the first request's headers.
    pub handshake: Duration,
    /// A connection with no request open is closed after this long.
    pub idle: Duration,
    /// HTTP/2 ping interval, and how long an answer may take.
    pub keepalive: Duration,
    /// Requests open at once on one connection.
    pub max_streams: u32,
    /// Bytes of incomplete push messages, all pushes together.
    pub push_bytes: usize,
}

impl Limits {
    /// The defaults: a client that has connected has 10 s to ask something; a connection
    /// quiet for 5 minutes is closed (workers beat every 2 s); 16 requests per connection (a
    /// worker opens at most 3); 256 MiB of incomplete pushes (256 ranks with 1 MiB chunks).
    pub const DEFAULT: Limits = Limits {
        handshake: Duration::from_secs(10),
        idle: Duration::from_secs(300),
        keepalive: Duration::from_secs(30),
        max_streams: 16,
        push_bytes: 256 << 20,
    };
}

/// One accepted connection's requests, as [`Guard`] counts them and [`Guarded`] reads them.
#[derive(Debug)]
struct Usage {
    /// Requests whose response has not ended.
    open: AtomicUsize,
    /// Whether any request arrived.
    asked: AtomicBool,
    /// When the last open request ended.
    idle_since: Mutex<Instant>,
}

/// A connection's [`Usage`], where requests find it (tonic puts it in their extensions).
#[derive(Debug, Clone)]
pub struct ConnInfo {
    usage: Arc<Usage>,
    /// The client's address.
    pub remote: Option<SocketAddr>,
}

/// An accepted socket that closes itself (its reads fail with `TimedOut`) once its
/// connection has asked nothing within the handshake limit, or has had no request open for
/// the idle limit. The timer is polled with the reads, which the HTTP/2 (and TLS) layers
/// above keep pending for as long as the connection lives.
pub struct Guarded {
    io: TcpStream,
    info: ConnInfo,
    accepted: Instant,
    limits: Limits,
    timer: Pin<Box<Sleep>>,
}

impl Guarded {
    /// Guard `io`, accepted now.
    pub fn new(io: TcpStream, limits: Limits) -> Self {
        let now = Instant::now();
        let usage =
            Usage { open: AtomicUsize::new(0), asked: AtomicBool::new(false), idle_since: Mutex::new(now) };
        let info = ConnInfo { usage: Arc::new(usage), remote: io.peer_addr().ok() };
        Guarded {
            io,
            info,
            accepted: now,
            limits,
            timer: Box::pin(tokio::time::sleep_until(now + limits.handshake)),
        }
    }

    /// Whether the connection is past its limit; otherwise the timer is armed for the next
    /// check.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        loop {
            let u = &self.info.usage;
            let now = Instant::now();
            let (due, why) = if !u.asked.load(Ordering::Acquire) {
                (self.accepted + self.limits.handshake, "no request within --handshake-timeout")
            } else if u.open.load(Ordering::Acquire) == 0 {
                let since = *u.idle_since.lock().unwrap_or_else(|e| e.into_inner());
                (since + self.limits.idle, "no request for --idle-timeout")
            } else {
                // Busy: look again later (the last request may end meanwhile).
                (now + self.limits.idle, "")
            };
            if due <= now {
                return Some(why);
            }
            self.timer.as_mut().reset(due);
            if self.timer.as_mut().poll(cx).is_pending() {
                return None;
            }
        }
    }
}

impl Connected for Guarded {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Pending => match self.expired(cx) {
                Some(why) => {
                    tracing::debug!(remote = ?self.info.remote, "closing a connection: {why}");
                    Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)))
                }
                None => Poll::Pending,
            },
            ready => ready,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// One open request of a connection; the count goes down when it is dropped (with the
/// response body, or the call if it ends first).
struct Open(Arc<Usage>);

impl Open {
    fn new(usage: &Arc<Usage>) -> Self {
        usage.asked.store(true, Ordering::Release);
        usage.open.fetch_add(1, Ordering::AcqRel);
        Open(usage.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        // The time first: the connection may look at it as soon as the count reaches 0.
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Bytes of incomplete push messages, all pushes together, against a limit.
#[derive(Debug)]
pub struct Budget {
    held: AtomicUsize,
    limit: usize,
}

impl Budget {
    /// An empty budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Budget { held: AtomicUsize::new(0), limit }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    fn take(&self, n: usize) -> Result<(), Error> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|&t| t <= self.limit)
            })
            .map(|_| ())
            .map_err(|held| Error::Exhausted { held, limit: self.limit })
    }

    fn give(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }
}

/// The tower layer every request passes ([`tonic::transport::Server::layer`]).
#[derive(Clone)]
pub struct Guard {
    /// How long a request body (all but a push's) may take to arrive in full.
    pub body: Duration,
    /// The push budget.
    pub budget: Arc<Budget>,
}

impl<S> tower_layer::Layer<S> for Guard {
    type Service = GuardService<S>;

    fn layer(&self, inner: S) -> GuardService<S> {
        GuardService { guard: self.clone(), inner }
    }
}

/// [`Guard`] around the services.
#[derive(Clone)]
pub struct GuardService<S> {
    guard: Guard,
    inner: S,
}

impl<S> Service<http::Request<Body>> for GuardService<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Send,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<http::Response<Body>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let open = req.extensions().get::<ConnInfo>().map(|c| Open::new(&c.usage));
        let req = if req.uri().path() == PUSH {
            let budget = self.guard.budget.clone();
            req.map(|b| Body::new(Budgeted { body: b, budget, scan: Scan::default(), held: 0 }))
        } else {
            let sleep = Box::pin(tokio::time::sleep(self.guard.body));
            let limit = self.guard.body;
            req.map(|b| Body::new(Deadline { body: b, sleep, limit, over: false }))
        };
        let call = self.inner.call(req);
        Box::pin(async move {
            let resp = call.await?;
            Ok(resp.map(|body| Body::new(Tracked { body, _open: open })))
        })
    }
}

/// A response body that keeps its request counted as open until it is dropped.
struct Tracked {
    body: Body,
    _open: Option<Open>,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that must end within `limit` of the request's headers.
struct Deadline {
    body: Body,
    sleep: Pin<Box<Sleep>>,
    limit: Duration,
    over: bool,
}

impl HttpBody for Deadline {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.over {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Pending if self.sleep.as_mut().poll(cx).is_ready() => {
                self.over = true;
                let e = Error::Silent {
                    what: "the request".into(),
                    secs: self.limit.as_secs_f64(),
                    flag: "--worker-timeout",
                };
                Poll::Ready(Some(Err(e.into())))
            }
            p => p,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.over || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Where a byte stream of length-prefixed gRPC messages stands.
#[derive(Debug, Default)]
struct Scan {
    /// The current message's 5-byte prefix, as far as it has come.
    prefix: [u8; 5],
    got: usize,
    /// Bytes of the current message still to come, once its prefix is complete.
    left: usize,
    /// Bytes of the current (incomplete) message received, prefix included.
    partial: usize,
}

impl Scan {
    /// Follow `data`; afterwards `partial` is what the incomplete message at its end holds.
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.got < 5 {
                let n = (5 - self.got).min(data.len());
                self.prefix[self.got..self.got + n].copy_from_slice(&data[..n]);
                (self.got, self.partial) = (self.got + n, self.partial + n);
                data = &data[n..];
                if self.got == 5 {
                    self.left =
                        u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]])
                            as usize;
                }
            } else {
                let n = self.left.min(data.len());
                (self.left, self.partial) = (self.left - n, self.partial + n);
                data = &data[n..];
            }
            if self.got == 5 && self.left == 0 {
                (self.got, self.partial) = (0, 0);
            }
        }
    }
}

/// A push's request body, charging the bytes of its incomplete message to the [`Budget`]:
/// a message received in full is the service's (sized by the model), one still arriving is
/// the client's to pay for. (The message-size limit is the service's to enforce.)
struct Budgeted {
    body: Body,
    budget: Arc<Budget>,
    scan: Scan,
    /// What this push holds of the budget.
    held: usize,
}

impl HttpBody for Budgeted {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(d) = f.data_ref()
        {
            let this = &mut *self;
            this.scan.feed(d.chunk());
            let want = this.scan.partial;
            if want > this.held {
                if let Err(e) = this.budget.take(want - this.held) {
                    return Poll::Ready(Some(Err(e.into())));
                }
            } else {
                this.budget.give(this.held - want);
            }
            this.held = want;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Budgeted {
    fn drop(&mut self) {
        self.budget.give(self.held);
    }
}

/// When [`accepted`] last said the process is out of descriptors.
pub type LastWarned = Arc<Mutex<Option<Instant>>>;

/// An accepted socket, guarded; or the accept's error, after a pause if the process is out
/// of descriptors (the listener stays ready then, and accepting again at once would spin
/// until the handshake limit closes some). Says so at most every 10 s.
pub async fn accepted(r: io::Result<TcpStream>, limits: Limits, warned: LastWarned) -> io::Result<Guarded> {
    let e = match r {
        Ok(s) => return Ok(Guarded::new(s, limits)),
        Err(e) => e,
    };
    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
        if due(&warned, Duration::from_secs(10)) {
            tracing::warn!(
                "out of file descriptors ({e}): new connections wait until idle ones are closed \
                 (--handshake-timeout {} s, --idle-timeout {} s)",
                limits.handshake.as_secs_f64(),
                limits.idle.as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(e)
}

/// Whether `every` has passed since `last` (then it is now).
fn due(last: &LastWarned, every: Duration) -> bool {
    let now = Instant::now();
    let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
    let due = last.is_none_or(|t| now - t > every);
    if due {
        *last = Some(now);
    }
    due
}

/// Raise this process's soft limit on open files to its hard limit. Returns the limit before
/// and after.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on 64-bit Linux only
pub fn raise_open_files() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let before = lim.rlim_cur as u64;
    if lim.rlim_cur == lim.rlim_max {
        return Ok((before, before));
    }
    let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
    // SAFETY: a valid rlimit, read above, with the soft limit at the hard one.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((before, raised.rlim_cur as u64))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The scan follows messages across any split: what it reports held is the incomplete
    /// message at the end of what it was fed.
    #[test]
    fn scan_tracks_the_incomplete_message() {
        let msg = |n: usize| {
            let mut m = vec![0u8];
            m.extend_from_slice(&(n as u32).to_be_bytes());
            m.extend(std::iter::repeat_n(7u8, n));
            m
        };
        let wire: Vec<u8> = [msg(10), msg(0), msg(3)].concat();
        for cut in 0..=wire.len() {
            let mut s = Scan::default();
            s.feed(&wire[..cut]);
            // Bytes after the last complete message boundary at or before `cut`.
            let ends = [15, 20, 28];
            let last = ends.iter().copied().filter(|&e| e <= cut).max().unwrap_or(0);
            assert_eq!(s.partial, cut - last, "cut at {cut}");
            s.feed(&wire[cut..]);
            assert_eq!(s.partial, 0);
        }
    }

    #[test]
    fn budget_refuses_past_its_limit() {
        let b = Budget::new(100);
        b.take(60).unwrap();
        assert!(matches!(b.take(41), Err(Error::Exhausted { held: 60, limit: 100 })));
        b.take(40).unwrap();
        b.give(100);
        assert_eq!(b.held(), 0);
    }
}
