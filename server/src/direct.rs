//! The two bulk RPCs served straight from HTTP/2 frames ([`gradsync_proto::frames`]): a
//! layer in front of the generated service that answers PushGradients and PullParameters
//! itself and hands every other RPC through. The wire format is gRPC's, so tonic-built
//! clients, grpcurl and gradsync's own direct client are all served the same way; only the
//! copies tonic's codec makes are gone. The token interceptor wraps this layer, and tonic's
//! server still enforces `grpc-timeout` around it.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;

use gradsync_proto::frames::{self, Frames, Incoming, Messages};
use gradsync_proto::pb::PullRequest;
use tokio::sync::mpsc;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service as TowerService};
use tonic::server::NamedService;

use crate::service::{PULL_QUEUE, Service};
use crate::state::PullSource;

use gradsync_proto::path::{PULL, PUSH};

/// The generated service `S` with PushGradients and PullParameters answered directly.
#[derive(Clone)]
pub struct Direct<S> {
    svc: Service,
    inner: S,
    /// The largest message accepted, bytes.
    limit: usize,
}

impl<S> Direct<S> {
    /// Serve the bulk RPCs of `svc` directly and the rest through `inner`.
    pub fn new(svc: Service, inner: S) -> Self {
        let limit = svc.shared.cfg.tuning.max_message();
        Direct { svc, inner, limit }
    }
}

impl<S: NamedService> NamedService for Direct<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> TowerService<http::Request<Body>> for Direct<S>
where
    S: TowerService<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (svc, limit) = (self.svc.clone(), self.limit);
        match req.uri().path() {
            PUSH => Box::pin(async move { Ok(answer(push(svc, req, limit).await)) }),
            PULL => Box::pin(async move { Ok(answer(pull(svc, req, limit).await)) }),
            _ => {
                let mut inner = self.inner.clone();
                Box::pin(async move { inner.call(req).await })
            }
        }
    }
}

/// A response body: frames known up front, or frames produced while the response is sent.
enum Reply {
    Whole(Frames),
    Streamed(mpsc::Receiver<Frame<Bytes>>),
}

/// Frames from a channel, as a response body.
struct Streamed(mpsc::Receiver<Frame<Bytes>>);

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.0.poll_recv(cx).map(|f| f.map(Ok))
    }
}

/// `s` as the trailers that end a response whose data already went out.
fn trailers(s: Status) -> http::HeaderMap {
    let mut h = s.into_http::<()>().into_parts().0.headers;
    h.remove(http::header::CONTENT_TYPE);
    h
}

/// A response with `frames` as its body, or the status as a trailers-only response.
fn answer(r: Result<Reply, Status>) -> http::Response<Body> {
    match r {
        Ok(f) => {
            let body = match f {
                Reply::Whole(f) => f.into_body(),
                Reply::Streamed(rx) => Body::new(Streamed(rx)),
            };
            let mut resp = http::Response::new(body);
            resp.headers_mut()
                .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(frames::CONTENT_TYPE));
            resp
        }
        Err(s) => s.into_http(),
    }
}

/// gradsync never negotiates compression; a request that says it compressed is refused.
fn uncompressed(req: &http::Request<Body>) -> Result<(), Status> {
    match req.headers().get("grpc-encoding") {
        Some(e) if e != "identity" => Err(Status::unimplemented(format!(
            "grpc-encoding {}: this server accepts only uncompressed messages",
            crate::error::abbreviate(&String::from_utf8_lossy(e.as_bytes()))
        ))),
        _ => Ok(()),
    }
}

async fn push(svc: Service, req: http::Request<Body>, limit: usize) -> Result<Reply, Status> {
    uncompressed(&req)?;
    let reply = svc.push(Incoming::Direct(Messages::new(req.into_body(), limit))).await?;
    let mut f = Frames::new();
    f.data(frames::message(&reply));
    f.ok_trailers();
    Ok(Reply::Whole(f))
}

async fn pull(svc: Service, req: http::Request<Body>, limit: usize) -> Result<Reply, Status> {
    uncompressed(&req)?;
    let mut msgs = Messages::new(req.into_body(), limit);
    // (A client that never sends its request is cut off by `limits::Guard`.)
    let pr: PullRequest = msgs
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("PullParameters without a PullRequest"))?;
    match svc.pull_source(pr.rank as usize, pr.stream_version).await? {
        PullSource::Ready(_, snapshot) => {
            let mut f = Frames::new();
            for i in 0..snapshot.len() {
                f.data(snapshot.message(i));
            }
            f.ok_trailers();
            Ok(Reply::Whole(f))
        }
        PullSource::Round(round) => {
            // Each block goes out as soon as it is stepped; the status comes last, as trailers.
            let (tx, rx) = mpsc::channel(PULL_QUEUE);
            tokio::spawn(async move {
                let status = match svc.stream_round(&round, &tx, |c| Frame::data(c.message())).await {
                    Ok(()) => Status::ok(""),
                    Err(s) => s,
                };
                // Within the same limit: the client may be the one not reading.
                let _ = tokio::time::timeout(
                    svc.shared.cfg.worker_timeout,
                    tx.send(Frame::trailers(trailers(status))),
                )
                .await;
            });
            Ok(Reply::Streamed(rx))
        }
    }
}
