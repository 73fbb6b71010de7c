//! Reaching a shard: the connection (a tonic client and its channel), dialling with back-off
//! while a server is not up yet, the token on every request, deadlines, and errors that name
//! the server (with a hint about TLS only where TLS is the problem: a plaintext worker that
//! reached a TLS server, or a TLS worker that reached a plaintext one).

use std::ops::Range;
use std::time::{Duration, Instant};

use gradsync_proto::pb::parameter_server_client::ParameterServerClient;
use gradsync_proto::tuning::Tuning;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::error::{PsError, Result};

/// Adds the token to every request.
#[derive(Clone)]
pub(super) struct Auth(pub(super) Option<MetadataValue<Ascii>>);

impl Interceptor for Auth {
    fn call(
        &mut self,
        mut req: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert(gradsync_proto::auth::KEY, v.clone());
        }
        Ok(req)
    }
}

pub(super) type Client = ParameterServerClient<InterceptedService<Channel, Auth>>;

/// One HTTP/2 connection to a shard, with a tonic client on it; the bulk RPCs go straight on
/// the channel as HTTP/2 frames.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) client: Client,
    pub(super) channel: Channel,
}

/// The longest pause between two attempts to reach a server that is not up yet.
const MAX_NAP: Duration = Duration::from_secs(2);

/// Open one connection to `a` through `ep` (over TLS when `tls`), each attempt within
/// `timeout`. While nothing answers at the address (refused, reset, unreachable, unknown to
/// DNS yet: a server not up yet), attempts go on with back-off for `wait` in all, saying once
/// what they wait for.
pub(super) async fn dial(
    ep: &Endpoint,
    a: &str,
    tls: bool,
    timeout: Duration,
    tuning: Tuning,
    auth: &Auth,
    wait: Duration,
) -> Result<Conn> {
    let until = Instant::now() + wait;
    let mut nap = Duration::from_millis(50);
    let mut told = false;
    let channel = loop {
        let why = match tokio::time::timeout(timeout, ep.connect()).await {
            Ok(Ok(ch)) => break ch,
            Ok(Err(e)) if tls && plaintext_answer(&e) => {
                let why = gradsync_proto::tls::tls_why(&e);
                return Err(PsError::Connect { addr: a.into(), why, plaintext_server: true });
            }
            Ok(Err(e)) if unanswered(&e) => gradsync_proto::tls::tls_why(&e),
            Ok(Err(e)) => {
                let why = gradsync_proto::tls::tls_why(&e);
                return Err(PsError::Connect { addr: a.into(), why, plaintext_server: false });
            }
            Err(_) => format!("no answer within {} s", timeout.as_secs_f64()),
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(if told {
                PsError::Unreachable { addr: a.into(), wait, last: why }
            } else {
                PsError::Connect { addr: a.into(), why, plaintext_server: false }
            });
        }
        if !told {
            eprintln!(
                "gradsync-worker: waiting for the parameter server at {a} ({why}); retrying for up to {} s (--connect-timeout)",
                wait.as_secs_f64()
            );
            told = true;
        }
        tokio::time::sleep(nap.min(left)).await;
        nap = (nap * 2).min(MAX_NAP);
    };
    let client = ParameterServerClient::with_interceptor(channel.clone(), auth.clone())
        .max_decoding_message_size(tuning.max_message())
        .max_encoding_message_size(tuning.max_message());
    Ok(Conn { client, channel })
}

/// Whether a failed connection attempt found nobody at the address (yet), rather than
/// somebody who refused it (TLS, HTTP/2).
fn unanswered(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind as K;
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                K::ConnectionRefused
                    | K::ConnectionReset
                    | K::ConnectionAborted
                    | K::TimedOut
                    | K::HostUnreachable
                    | K::NetworkUnreachable
                    | K::AddrNotAvailable
            )
        {
            return true;
        }
        // hyper-util's resolver failure: the name is not (yet) known.
        if e.to_string().starts_with("dns error") {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Whether a failed TLS connection attempt was answered in plaintext: the server closed or
/// reset the connection on the TLS hello, or answered it with bytes that are not a TLS record
/// (an HTTP/2 server's GOAWAY).
fn plaintext_answer(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(e) = cur {
        let text = e.to_string();
        if text.contains("InvalidContentType") || text.contains("tls handshake eof") {
            return true;
        }
        cur = e.source();
    }
    false
}

/// `host:port` to `http://host:port` (`https://` with TLS).
pub(super) fn uri(addr: &str, tls: bool) -> String {
    match (addr.contains("://"), tls) {
        (true, _) => addr.to_string(),
        (false, false) => format!("http://{addr}"),
        (false, true) => format!("https://{addr}"),
    }
}

/// Whether `addr` answers the HTTP/2 preface with TLS (an alert or handshake record, first
/// byte 0x15 or 0x16): one short probe, made only after a first call has failed. A server that
/// is gone refuses or closes, and is not taken for one that serves TLS.
pub(super) async fn serves_tls(addr: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut c = tokio::net::TcpStream::connect(addr).await.ok()?;
        c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.ok()?;
        let mut first = [0u8; 1];
        c.read_exact(&mut first).await.ok()?;
        Some(matches!(first[0], 0x15 | 0x16))
    };
    tokio::time::timeout(Duration::from_secs(2), probe).await.ok().flatten().unwrap_or(false)
}

/// Run call `what` at `addr` (dialled over TLS when `tls`) with a deadline: sent to the server
/// as grpc-timeout and enforced here too. A failure names the server and says who refused
/// ([`PsError::from_status`]).
pub(super) async fn deadline<T>(
    timeout: Duration,
    (addr, tls): (&str, bool),
    what: &'static str,
    f: impl Future<Output = std::result::Result<T, tonic::Status>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(|s| PsError::from_status(addr, what, s, tls)),
        Err(_) => Err(PsError::Deadline { addr: addr.into(), what, timeout }),
    }
}

/// `msg` with `timeout` as its grpc-timeout.
pub(super) fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// One server shard as this worker sees it.
pub(super) struct Shard {
    pub(super) addr: String,
    /// Whether it is dialled over TLS (`--tls-ca`).
    pub(super) tls: bool,
    /// The connection for pushes and the small RPCs.
    pub(super) rpc: Conn,
    /// The connection for pulls.
    pub(super) pull: Conn,
    /// Its range of the flat buffer (known once registered): of the values that move densely,
    /// for a model with a sparse table.
    pub(super) range: Range<usize>,
    /// The sparse table's rows it owns (empty for a model without one).
    pub(super) rows: Range<usize>,
    /// Version of the parameters last pulled from it.
    pub(super) version: u64,
    /// The digest of its parameters at `version` its registration reply gave, if it gave one
    /// (`RegisterReply.digest`).
    pub(super) digest: Option<[u8; 32]>,
    /// Payload bytes per pushed chunk: the size the shard steps and streams its blocks in, as
    /// it announced at registration, unless the client chose one (`PsClient::set_chunk_bytes`).
    pub(super) chunk: usize,
}

impl Shard {
    /// Where its calls go, as [`deadline`] names them in errors.
    pub(super) fn at(&self) -> (&str, bool) {
        (&self.addr, self.tls)
    }
}
