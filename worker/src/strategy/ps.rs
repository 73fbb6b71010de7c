//! Parameter-server mode: compute the gradient on the device, send each shard its range and
//! receive the parameters back, all shards concurrently. The servers own the optimiser; this
//! side owns no update. Under BSP the push and the pull of the next version go at once, each on
//! its own connection to the shard, and the servers stream the new parameters block by block as
//! they step them (`gradsync_server::round`); under ASP and SSP the worker pushes, then pulls.
//!
//! ```text
//!   device grads --read_grads per chunk (1 pass)--> messages --------> shard k
//!   device params <-write_params per chunk-- DATA frames <------- shard k   (CPU engine)
//!   device params <-write_params-- host f32 <--decode-- DATA frames          (GPU engine)
//! ```
//!
//! The two bulk RPCs go straight over the channel's HTTP/2 frames ([`frames`]), without
//! tonic's codec and its two copies per message; the rest use the generated client.
//!
//! [`PsClient`] is the transport-level client (also driven by `gradsync-bench ps`); [`Ps`] is
//! the [`Strategy`] that wraps it with a tokio runtime, because the training loop is
//! synchronous.

use std::cell::RefCell;
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures_util::future::try_join_all;
use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;
use gradsync_proto::SyncMode;
use gradsync_proto::frames::{self, FramedChunk, Frames, Incoming};
use gradsync_proto::path::{PULL, PUSH};
use gradsync_proto::pb::parameter_server_client::ParameterServerClient;
use gradsync_proto::pb::{
    DeregisterRequest, GradientChunk, HeartbeatRequest, PullRequest, PushReply, RegisterReply,
    RegisterRequest, VersionRequest,
};
use gradsync_proto::tag::GRADIENT_DATA;
use gradsync_proto::tuning::Tuning;
use gradsync_proto::wire;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::{Shape, Strategy, forward_backward, ms_since};
use crate::cli::PsArgs;

/// Adds the token to every request.
#[derive(Clone)]
pub struct Auth(Option<MetadataValue<Ascii>>);

impl Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert(gradsync_proto::auth::KEY, v.clone());
        }
        Ok(req)
    }
}

type Client = ParameterServerClient<InterceptedService<Channel, Auth>>;

/// One HTTP/2 connection to a shard, with a tonic client on it; the bulk RPCs go straight on
/// the channel as HTTP/2 frames.
#[derive(Clone)]
struct Conn {
    client: Client,
    channel: Channel,
}

/// The longest pause between two attempts to reach a server that is not up yet.
const MAX_NAP: Duration = Duration::from_secs(2);

/// Open one connection to `a` through `ep`, each attempt within `timeout`. While nothing
/// answers at the address (refused, reset, unreachable, unknown to DNS yet: a server not up
/// yet), attempts go on with back-off for `wait` in all, saying once what they wait for.
async fn dial(
    ep: &Endpoint,
    a: &str,
    timeout: Duration,
    tuning: Tuning,
    auth: &Auth,
    wait: Duration,
) -> anyhow::Result<Conn> {
    let until = Instant::now() + wait;
    let mut nap = Duration::from_millis(50);
    let mut told = false;
    let channel = loop {
        let why = match tokio::time::timeout(timeout, ep.connect()).await {
            Ok(Ok(ch)) => break ch,
            Ok(Err(e)) if unanswered(&e) => gradsync_proto::tls::tls_why(&e),
            Ok(Err(e)) => anyhow::bail!("connecting to {a}: {}", gradsync_proto::tls::tls_why(&e)),
            Err(_) => format!("no answer within {} s", timeout.as_secs_f64()),
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            anyhow::ensure!(
                !told,
                "no parameter server answered at {a} within --connect-timeout {} s (last: {why})",
                wait.as_secs_f64()
            );
            anyhow::bail!("connecting to {a}: {why}");
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

/// One server shard as this worker sees it.
struct Shard {
    addr: String,
    /// The connection for pushes and the small RPCs.
    rpc: Conn,
    /// The connection for pulls.
    pull: Conn,
    /// Its range of the flat buffer (known once registered).
    range: Range<usize>,
    /// Version of the parameters last pulled from it.
    version: u64,
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

/// A connection to every shard of a parameter server.
pub struct PsClient {
    shards: Vec<Shard>,
    timeout: Duration,
    chunk_bytes: usize,
    /// Bulk RPCs through [`frames`] rather than tonic's codec ([`Tuning::direct`]).
    direct: bool,
    /// The largest message accepted, bytes.
    limit: usize,
    auth: Auth,
    rank: u32,
    total: usize,
    sync: SyncMode,
    /// Under BSP, pull the next version while pushing (`--no-pipeline` clears it).
    pipeline: bool,
    /// The optimiser the servers apply and their staleness policy, known once registered.
    optimiser: Option<(SgdConfig, String)>,
}

/// `host:port` to `http://host:port` (`https://` with TLS).
fn uri(addr: &str, tls: bool) -> String {
    match (addr.contains("://"), tls) {
        (true, _) => addr.to_string(),
        (false, false) => format!("http://{addr}"),
        (false, true) => format!("https://{addr}"),
    }
}

/// A server's sync mode as it wrote it.
fn parse_sync(addr: &str, text: &str) -> anyhow::Result<SyncMode> {
    text.parse().map_err(|e| anyhow::anyhow!("{addr} runs an unknown sync mode {e}"))
}

/// A status as a readable error naming the server.
fn rpc_err(addr: &str, what: &str, s: tonic::Status) -> anyhow::Error {
    let hint = if spoke_other_than_http2(&s) { " (if the server serves TLS, pass --tls-ca)" } else { "" };
    anyhow::anyhow!("{what} at {addr}: {:?}: {}{hint}", s.code(), s.message())
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

/// Whether `addr` answers the HTTP/2 preface with TLS (an alert or handshake record, first
/// byte 0x15 or 0x16): one short probe, made only after a first call has failed. A server that
/// is gone refuses or closes, and is not taken for one that serves TLS.
async fn serves_tls(addr: &str) -> bool {
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

/// Run `f` with a deadline: sent to the server as grpc-timeout and enforced here too.
async fn deadline<T>(
    timeout: Duration,
    addr: &str,
    what: &str,
    f: impl Future<Output = Result<T, tonic::Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(|s| rpc_err(addr, what, s)),
        Err(_) => {
            anyhow::bail!("{what} at {addr}: no answer within {} s (--rpc-timeout)", timeout.as_secs_f64())
        }
    }
}

fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

impl PsClient {
    /// Connect to every server in `addrs` (one per shard, in shard order) concurrently.
    pub async fn connect(
        addrs: &[String],
        token: Option<&str>,
        timeout: Duration,
        tuning: Tuning,
    ) -> anyhow::Result<Self> {
        Self::connect_tls(addrs, token, timeout, tuning, None).await
    }

    /// [`PsClient::connect`], over TLS when `tls` is given (addresses become `https://`).
    pub async fn connect_tls(
        addrs: &[String],
        token: Option<&str>,
        timeout: Duration,
        tuning: Tuning,
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> anyhow::Result<Self> {
        Self::connect_waiting(addrs, token, timeout, tuning, tls, Duration::ZERO).await
    }

    /// [`PsClient::connect_tls`], waiting up to `wait` for servers that are not up yet.
    pub async fn connect_waiting(
        addrs: &[String],
        token: Option<&str>,
        timeout: Duration,
        tuning: Tuning,
        tls: Option<tonic::transport::ClientTlsConfig>,
        wait: Duration,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!addrs.is_empty(), "--servers: give at least one host:port");
        let auth = Auth(token.map(gradsync_proto::auth::bearer).transpose().context("--token")?);
        let shards = try_join_all(addrs.iter().map(|a| {
            let auth = auth.clone();
            let tls = tls.clone();
            async move {
                let mut ep = tuning
                    .endpoint(&uri(a, tls.is_some()), timeout)
                    .with_context(|| format!("--servers: '{a}'"))?;
                if let Some(tls) = tls {
                    ep = ep
                        .tls_config(tls)
                        .map_err(|e| anyhow::anyhow!("--tls-ca: {}", gradsync_proto::tls::tls_why(&e)))?;
                }
                // Pulls get their own connection: on one TCP connection carrying both
                // directions at once, the sender's socket lock also processes the incoming
                // segments, and each direction runs at about half its rate (docs/ps.md).
                // The first connection waits for the server; the second finds it up.
                let rpc = dial(&ep, a, timeout, tuning, &auth, wait).await?;
                let pull = dial(&ep, a, timeout, tuning, &auth, Duration::ZERO).await?;
                anyhow::Ok(Shard { addr: a.clone(), rpc, pull, range: 0..0, version: 0 })
            }
        }))
        .await?;
        Ok(PsClient {
            shards,
            timeout,
            chunk_bytes: tuning.chunk_bytes,
            direct: tuning.direct,
            limit: tuning.max_message(),
            auth,
            rank: 0,
            total: 0,
            sync: SyncMode::Bsp,
            pipeline: true,
            optimiser: None,
        })
    }

    /// Whether a BSP exchange pulls the next version while pushing (the default) or pushes,
    /// then pulls.
    pub fn set_pipeline(&mut self, on: bool) {
        self.pipeline = on;
    }

    /// The optimiser the servers apply (learning rate, momentum, weight decay) and how they
    /// scale stale gradients, as they told this worker at registration.
    pub fn optimiser(&self) -> Option<&(SgdConfig, String)> {
        self.optimiser.as_ref()
    }

    /// The servers' synchronisation mode (`bsp`, `asp`, `ssp:S`), asked of shard 0.
    pub async fn sync_mode(&mut self) -> anyhow::Result<SyncMode> {
        let s = &mut self.shards[0];
        let r = match deadline(
            self.timeout,
            &s.addr,
            "GetVersion",
            s.rpc.client.get_version(request(VersionRequest {}, self.timeout)),
        )
        .await
        {
            Ok(r) => r.into_inner(),
            // The first call on a new connection: whether the failure shows a TLS server's
            // bytes depends on when its alert and its close arrive, so ask the server itself.
            Err(e) if !format!("{e:#}").contains("--tls-ca") && serves_tls(&s.addr).await => {
                return Err(e.context(format!("{} serves TLS: pass --tls-ca", s.addr)));
            }
            Err(e) => return Err(e),
        };
        self.sync = parse_sync(&s.addr, &r.sync)?;
        Ok(self.sync)
    }

    /// Register with every shard and check that together they cover a buffer of `total`
    /// values in order. Returns the servers' version.
    pub async fn register(
        &mut self,
        rank: usize,
        world: usize,
        fingerprint: &str,
        total: usize,
    ) -> anyhow::Result<u64> {
        let timeout = self.timeout;
        let n = self.shards.len();
        let replies = try_join_all(self.shards.iter_mut().map(|s| async move {
            let req = RegisterRequest {
                rank: rank as u32,
                world_size: world as u32,
                fingerprint: fingerprint.into(),
            };
            let r =
                deadline(timeout, &s.addr, "Register", s.rpc.client.register(request(req, timeout))).await?;
            anyhow::Ok(r.into_inner())
        }))
        .await?;
        let mut end = 0;
        for (i, (s, r)) in self.shards.iter_mut().zip(&replies).enumerate() {
            anyhow::ensure!(
                r.shard as usize == i && r.shards as usize == n,
                "--servers: {} is shard {}/{} but was listed as shard {i} of {n}",
                s.addr,
                r.shard,
                r.shards
            );
            anyhow::ensure!(
                r.total as usize == total,
                "{}: holds {} values, this model has {total}",
                s.addr,
                r.total
            );
            anyhow::ensure!(
                r.start as usize == end,
                "{}: its range starts at {}, expected {end}",
                s.addr,
                r.start
            );
            s.range = r.start as usize..r.end as usize;
            s.version = r.version;
            end = r.end as usize;
        }
        anyhow::ensure!(end == total, "--servers: the shards cover 0..{end} of {total} values");
        let sync = &replies[0].sync;
        if let Some(r) = replies.iter().find(|r| &r.sync != sync) {
            anyhow::bail!("the shards disagree on the sync mode: {sync} and {}", r.sync);
        }
        self.sync = parse_sync(&self.shards[0].addr, sync)?;
        let optimiser = |r: &RegisterReply| {
            (
                SgdConfig { lr: r.lr, momentum: r.momentum, weight_decay: r.weight_decay },
                r.staleness_lr.clone(),
            )
        };
        let first = optimiser(&replies[0]);
        if let Some((i, other)) = replies.iter().map(optimiser).enumerate().find(|(_, o)| *o != first) {
            anyhow::bail!(
                "the shards disagree on the optimiser: shard 0 applies {first:?}, shard {i} {other:?}"
            );
        }
        self.optimiser = Some(first);
        self.rank = rank as u32;
        self.total = total;
        Ok(replies.iter().map(|r| r.version).min().unwrap_or(0))
    }

    fn opts(&self) -> Opts<'_> {
        Opts {
            timeout: self.timeout,
            direct: self.direct,
            limit: self.limit,
            auth: &self.auth,
            rank: self.rank,
            chunk_bytes: self.chunk_bytes,
        }
    }

    fn check_len(&self, what: &str, n: usize) -> anyhow::Result<()> {
        anyhow::ensure!(n == self.total, "{what}: {n} values for a model of {}", self.total);
        Ok(())
    }

    /// Each shard's disjoint slice of `buf` (ranges are contiguous, in order).
    fn split<'a>(&self, buf: &'a mut [f32]) -> Vec<&'a mut [f32]> {
        let mut rest = buf;
        let mut slices = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(s.range.len());
            slices.push(mine);
            rest = tail;
        }
        slices
    }

    /// Push `grads` (the whole flat buffer): each shard gets its range, all concurrently.
    pub async fn push(&mut self, grads: &[f32]) -> anyhow::Result<Transfer> {
        self.check_len("push", grads.len())?;
        let (t, o) = (Instant::now(), self.opts());
        let grads = HostGrads(grads);
        let replies = try_join_all(self.shards.iter().map(|s| push_shard(&o, s, &grads))).await?;
        Ok(push_transfer(&replies, t))
    }

    /// Pull every shard's parameters into `params` (the whole flat buffer), concurrently,
    /// decoding each chunk straight into place.
    pub async fn pull(&mut self, params: &mut [f32]) -> anyhow::Result<Transfer> {
        self.check_len("pull", params.len())?;
        let t = Instant::now();
        let o = self.opts();
        let slices = self.split(params);
        let got = try_join_all(self.shards.iter().zip(slices).map(|(s, dst)| {
            let o = &o;
            async move { pull_shard(o, s, &mut HostSlice(dst), None).await }
        }))
        .await?;
        for (s, (v, _)) in self.shards.iter_mut().zip(&got) {
            s.version = *v;
        }
        Ok(Transfer { bytes: got.iter().map(|g| g.1).sum(), ms: ms_since(t), ..Transfer::default() })
    }

    /// [`PsClient::exchange`] between the gradients and the parameters of `engine` (a
    /// host-memory device): each gradient chunk is copied out straight into its message and
    /// each pulled chunk written straight into the parameters, with no whole-buffer copy in
    /// between.
    pub async fn exchange_engine(&mut self, engine: &mut Engine) -> anyhow::Result<(Transfer, Transfer)> {
        let engine = RefCell::new(engine);
        let sinks = self
            .shards
            .iter()
            .map(|s| EngineRange {
                engine: &engine,
                start: s.range.start,
                len: s.range.len(),
                scratch: Vec::new(),
            })
            .collect();
        self.exchange(&EngineGrads(&engine), sinks).await
    }

    /// One step's communication: push `grads` and pull the parameters the update makes into
    /// `params` (both the whole flat buffer). See [`PsClient::exchange`].
    pub async fn step(&mut self, grads: &[f32], params: &mut [f32]) -> anyhow::Result<(Transfer, Transfer)> {
        self.check_len("push", grads.len())?;
        self.check_len("pull", params.len())?;
        let sinks = self.split(params).into_iter().map(HostSlice).collect();
        self.exchange(&HostGrads(grads), sinks).await
    }

    /// One step's communication: push the gradient `grads` and pull the parameters the update
    /// makes into `sinks` (one per shard). Under BSP the push and the pull go at once to each
    /// shard, the pull on its own connection: it asks for the next version streamed, so its
    /// blocks arrive while the rest of the gradient is still going out and the server steps
    /// block by block. Other sync modes push, then pull. Returns the push's and the pull's
    /// traffic (times from the start of the call).
    pub async fn exchange<G: Gradients + ?Sized, S: ChunkSink>(
        &mut self,
        grads: &G,
        sinks: Vec<S>,
    ) -> anyhow::Result<(Transfer, Transfer)> {
        let t = Instant::now();
        anyhow::ensure!(sinks.len() == self.shards.len(), "one destination per shard");
        let pipelined = self.sync == SyncMode::Bsp && self.pipeline;
        let o = self.opts();
        let got = try_join_all(self.shards.iter().zip(sinks).map(|(s, mut sink)| {
            let o = &o;
            async move {
                let push = async {
                    let r = push_shard(o, s, grads).await;
                    (r, ms_since(t))
                };
                let ((push, push_ms), pull) = if pipelined {
                    let pull = pull_shard(o, s, &mut sink, Some(s.version + 1));
                    tokio::pin!(push, pull);
                    tokio::select! {
                        // A failed push ends the exchange at once: its streamed pull could only
                        // fail too, once the server gave up on the step.
                        p = &mut push => match p {
                            (Err(e), _) => return Err(e),
                            p => (p, Some(pull.await)),
                        },
                        q = &mut pull => (push.await, Some(q)),
                    }
                } else {
                    (push.await, None)
                };
                let push = push?;
                let pull = match pull {
                    Some(Ok(p)) => p,
                    // The streamed pull ends with an error when its step fails (and then so
                    // did the push, reported above) or had to be redone without a dropped
                    // worker's gradient: the push succeeded, so pull the version it made.
                    Some(Err(e)) => {
                        tracing::debug!("{e:#}; pulling version {} again", push.0.version);
                        pull_shard(o, s, &mut sink, None).await?
                    }
                    None => pull_shard(o, s, &mut sink, None).await?,
                };
                anyhow::Ok((push, push_ms, pull, ms_since(t)))
            }
        }))
        .await?;
        let mut push = push_transfer(&got.iter().map(|g| g.0).collect::<Vec<_>>(), t);
        push.ms = got.iter().map(|g| g.1).fold(0.0, f64::max);
        let pull = Transfer {
            bytes: got.iter().map(|g| g.2.1).sum(),
            ms: got.iter().map(|g| g.3).fold(0.0, f64::max),
            ..Transfer::default()
        };
        for (s, g) in self.shards.iter_mut().zip(&got) {
            s.version = g.2.0;
        }
        Ok((push, pull))
    }

    /// Tell every shard this rank is alive.
    pub async fn heartbeat(&mut self) -> anyhow::Result<()> {
        let (timeout, rank) = (self.timeout, self.rank);
        try_join_all(self.shards.iter_mut().map(|s| async move {
            deadline(
                timeout,
                &s.addr,
                "Heartbeat",
                s.rpc.client.heartbeat(request(HeartbeatRequest { rank }, timeout)),
            )
            .await
        }))
        .await?;
        Ok(())
    }

    /// Leave the run on every shard.
    pub async fn deregister(&mut self) -> anyhow::Result<()> {
        let (timeout, rank) = (self.timeout, self.rank);
        try_join_all(self.shards.iter_mut().map(|s| async move {
            deadline(
                timeout,
                &s.addr,
                "Deregister",
                s.rpc.client.deregister(request(DeregisterRequest { rank }, timeout)),
            )
            .await
        }))
        .await?;
        Ok(())
    }

    /// A clone sharing the connections (for a heartbeat task).
    fn share(&self) -> PsClient {
        PsClient {
            shards: self
                .shards
                .iter()
                .map(|s| Shard {
                    addr: s.addr.clone(),
                    rpc: s.rpc.clone(),
                    pull: s.pull.clone(),
                    range: s.range.clone(),
                    version: s.version,
                })
                .collect(),
            timeout: self.timeout,
            chunk_bytes: self.chunk_bytes,
            direct: self.direct,
            limit: self.limit,
            auth: self.auth.clone(),
            rank: self.rank,
            total: self.total,
            sync: self.sync,
            pipeline: self.pipeline,
            optimiser: self.optimiser.clone(),
        }
    }
}

/// Where a push's gradient values come from.
pub trait Gradients {
    /// The message `head` carrying `values` (of the whole flat buffer) as its payload, written
    /// straight into the message's buffer.
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk>;
}

/// A host buffer of the whole flat length.
pub struct HostGrads<'a>(pub &'a [f32]);

impl Gradients for HostGrads<'_> {
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk> {
        let src =
            self.0.get(values.clone()).with_context(|| format!("values {values:?} of {}", self.0.len()))?;
        // Appended as they are (no zeroing first).
        Ok(FramedChunk::build(head, GRADIENT_DATA, head.offset, src.len() * 4, |buf| wire::put_f32(src, buf)))
    }
}

/// The engine's gradients, copied out straight into the message. The shards' pushes share
/// the engine: they run on one task and never hold it across an await.
struct EngineGrads<'a, 'e>(&'a RefCell<&'e mut Engine>);

impl Gradients for EngineGrads<'_, '_> {
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk> {
        let engine = self.0.try_borrow().map_err(|e| anyhow::anyhow!("the engine is busy: {e}"))?;
        FramedChunk::build_f32(head, GRADIENT_DATA, head.offset, values.len(), |dst| {
            engine.read_grads(values.clone(), dst)
        })
        .map_err(Into::into)
    }
}

/// Gradient messages a push builds ahead of what HTTP/2 has taken.
const PUSH_AHEAD: usize = 4;

/// Where one shard's pulled chunks go.
pub trait ChunkSink {
    /// Put the chunk `payload` (little-endian f32) at `offset` values of the shard's range.
    fn put(&mut self, payload: &[u8], offset: u64) -> Result<(), tonic::Status>;
    /// The shard's range length, values.
    fn values(&self) -> usize;
}

/// A shard's slice of a host buffer.
pub struct HostSlice<'a>(pub &'a mut [f32]);

impl ChunkSink for HostSlice<'_> {
    fn put(&mut self, payload: &[u8], offset: u64) -> Result<(), tonic::Status> {
        wire::copy_into(payload, offset, self.0).map_err(|e| tonic::Status::data_loss(e.to_string()))
    }

    fn values(&self) -> usize {
        self.0.len()
    }
}

/// A shard's range of the engine's parameters, from `start` for `len` values, written through
/// a chunk-sized buffer. The shards' pulls share the engine: they run on one task and never
/// hold it across an await.
struct EngineRange<'a, 'e> {
    engine: &'a RefCell<&'e mut Engine>,
    start: usize,
    len: usize,
    scratch: Vec<f32>,
}

impl ChunkSink for EngineRange<'_, '_> {
    fn put(&mut self, payload: &[u8], offset: u64) -> Result<(), tonic::Status> {
        let n = payload.len() / 4;
        if usize::try_from(offset).ok().and_then(|o| o.checked_add(n)).is_none_or(|end| end > self.len) {
            return Err(tonic::Status::data_loss(format!(
                "a chunk of {n} values at {offset} overruns the {} of the range",
                self.len
            )));
        }
        self.scratch.resize(n, 0.0);
        wire::copy_into(payload, 0, &mut self.scratch)
            .map_err(|e| tonic::Status::data_loss(e.to_string()))?;
        let internal = |e: String| tonic::Status::internal(e);
        let mut engine = self.engine.try_borrow_mut().map_err(|e| internal(e.to_string()))?;
        engine.write_params(self.start + offset as usize, &self.scratch).map_err(|e| internal(e.to_string()))
    }

    fn values(&self) -> usize {
        self.len
    }
}

/// What the bulk RPCs need of a [`PsClient`].
struct Opts<'a> {
    timeout: Duration,
    direct: bool,
    limit: usize,
    auth: &'a Auth,
    rank: u32,
    chunk_bytes: usize,
}

/// The pushes' replies (and payload bytes) as one [`Transfer`], timed from `t`.
fn push_transfer(replies: &[(PushReply, u64)], t: Instant) -> Transfer {
    replies.iter().fold(Transfer { ms: ms_since(t), ..Transfer::default() }, |a, (r, b)| Transfer {
        bytes: a.bytes + b,
        wait_ms: a.wait_ms.max(r.wait_ms),
        staleness: a.staleness.max(r.staleness),
        ms: a.ms,
    })
}

/// Push shard `s`'s range of `grads` as one PushGradients call. Returns the reply and the
/// payload bytes. Each message is built (one copy, from the gradient into the message) just
/// before it is sent, so the first leaves at once and each is still in cache when the kernel
/// copies it into the socket.
async fn push_shard<G: Gradients + ?Sized>(
    o: &Opts<'_>,
    s: &Shard,
    grads: &G,
) -> anyhow::Result<(PushReply, u64)> {
    let (rank, base) = (o.rank, s.version);
    let chunk = |r: Range<usize>| {
        let head = GradientChunk { rank, base_version: base, offset: r.start as u64, data: Bytes::new() };
        grads.chunk(&head, s.range.start + r.start..s.range.start + r.end)
    };
    let ranges = || wire::chunks(s.range.len() * 4, o.chunk_bytes).map(|b| b.start / 4..b.end / 4);
    let r = if o.direct {
        let (tx, rx) = tokio::sync::mpsc::channel(PUSH_AHEAD);
        let body = tonic::body::Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ));
        // Owns the sender: the body ends when the last message is handed over.
        let produce = async move {
            for r in ranges() {
                match chunk(r) {
                    Ok(c) => {
                        if tx.send(Ok(http_body::Frame::data(c.message()))).await.is_err() {
                            // The call ended early; its error says why.
                            return Ok(());
                        }
                    }
                    Err(e) => {
                        // Reset the stream: the server must not take a short push.
                        let _ = tx.send(Err(tonic::Status::cancelled(format!("{e:#}")))).await;
                        return Err(e);
                    }
                }
            }
            anyhow::Ok(())
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
        let call = deadline(o.timeout, &s.addr, "PushGradients", fut);
        tokio::pin!(produce, call);
        tokio::select! {
            // The call ended first (refused early, or past its deadline): nothing more to send,
            // whether or not the transport has let go of the body yet.
            reply = &mut call => reply?,
            produced = &mut produce => {
                produced.context("reading the gradient")?;
                call.await?
            }
        }
    } else {
        let chunks = ranges()
            .map(|r| {
                let (offset, data) = chunk(r)?.payload();
                anyhow::Ok(GradientChunk { rank, base_version: base, offset, data })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut client = s.rpc.client.clone();
        let req = request(tokio_stream_iter(chunks), o.timeout);
        deadline(o.timeout, &s.addr, "PushGradients", client.push_gradients(req)).await?.into_inner()
    };
    Ok((r, s.range.len() as u64 * 4))
}

/// Pull shard `s`'s parameters into `dst` chunk by chunk: the current version, or `want`
/// streamed as the server produces it (BSP). Returns the version and the payload bytes.
async fn pull_shard(
    o: &Opts<'_>,
    s: &Shard,
    dst: &mut impl ChunkSink,
    want: Option<u64>,
) -> anyhow::Result<(u64, u64)> {
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
        let (mut received, mut version) = (0u64, None);
        while let Some(c) = stream.message().await? {
            if *version.get_or_insert(c.version) != c.version || c.offset != received {
                return Err(tonic::Status::data_loss("chunks of one pull disagree on version or order"));
            }
            dst.put(&c.data, c.offset)?;
            received += (c.data.len() / 4) as u64;
        }
        if received as usize != dst.values() {
            return Err(tonic::Status::data_loss(format!("{received} values of {}", dst.values())));
        }
        Ok((version.or(want).unwrap_or(0), received * 4))
    };
    deadline(o.timeout, &s.addr, "PullParameters", fut).await
}

async fn call(
    ch: &mut Channel,
    auth: &Auth,
    path: &str,
    timeout: Duration,
    body: tonic::body::Body,
    limit: usize,
) -> Result<frames::Messages<tonic::body::Body>, tonic::Status> {
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

/// `--mode ps`: the [`Strategy`].
pub struct Ps {
    rt: tokio::runtime::Runtime,
    client: PsClient,
    rank: usize,
    world: usize,
    fingerprint: String,
    servers: Vec<String>,
    grads: Vec<f32>,
    params: Vec<f32>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// Timeline recorder (`--trace`).
    trace: Trace,
}

/// How often a worker tells the servers it is alive, whatever it is doing.
const HEARTBEAT: Duration = gradsync_proto::HEARTBEAT_INTERVAL;

impl Ps {
    /// Connect to the servers of `args` (registration waits for [`Strategy::start`]).
    pub fn new(args: &PsArgs, rank: usize, world: usize, fingerprint: String) -> anyhow::Result<Self> {
        anyhow::ensure!(
            args.rpc_timeout.is_finite() && args.rpc_timeout > 0.0 && args.rpc_timeout < 1e9,
            "--rpc-timeout {} must be a positive number of seconds",
            args.rpc_timeout
        );
        gradsync_core::heap::keep_freed_memory();
        gradsync_core::heap::single_arena();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("gradsync-ps")
            .build()
            .context("starting the PS client runtime")?;
        anyhow::ensure!(
            args.connect_timeout.is_finite() && (0.0..1e9).contains(&args.connect_timeout),
            "--connect-timeout {} must be 0 or a positive number of seconds",
            args.connect_timeout
        );
        let timeout = Duration::from_secs_f64(args.rpc_timeout);
        let wait = Duration::from_secs_f64(args.connect_timeout);
        let mut tuning = Tuning::tuned();
        if let Some(c) = args.chunk_bytes {
            anyhow::ensure!((4..=(64 << 20)).contains(&c), "--chunk-bytes {c} must be 4 bytes to 64 MiB");
            tuning.chunk_bytes = c;
        }
        let client = rt.block_on(async {
            let tls = match &args.tls_ca {
                Some(ca) => Some(gradsync_proto::tls::client(ca, args.tls_domain.as_deref())?),
                None => None,
            };
            let mut c =
                PsClient::connect_waiting(&args.servers, args.token.as_deref(), timeout, tuning, tls, wait)
                    .await?;
            c.sync_mode().await?;
            c.set_pipeline(!args.no_pipeline);
            anyhow::Ok(c)
        })?;
        Ok(Ps {
            rt,
            client,
            rank,
            world,
            fingerprint,
            servers: args.servers.clone(),
            grads: Vec::new(),
            params: Vec::new(),
            heartbeat: None,
            trace: Trace::disabled(),
        })
    }

    /// Record push and pull spans (and forward/backward) in `trace`.
    pub fn with_trace(mut self, trace: Trace) -> Self {
        self.trace = trace;
        self
    }
}

impl Strategy for Ps {
    fn shape(&self) -> Shape {
        Shape::processes(self.world, self.rank)
    }

    fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        let n = engine.layout().len;
        self.grads = vec![0.0; n];
        self.params = vec![0.0; n];
        let (client, params) = (&mut self.client, &mut self.params);
        let (rank, world, fp) = (self.rank, self.world, self.fingerprint.as_str());
        self.rt.block_on(async {
            client.register(rank, world, fp, n).await?;
            client.pull(params).await
        })?;
        engine.write_params(0, &self.params)?;
        let mut hb = self.client.share();
        self.heartbeat = Some(self.rt.spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT);
            loop {
                tick.tick().await;
                if let Err(e) = hb.heartbeat().await {
                    tracing::warn!("heartbeat: {e:#}");
                }
            }
        }));
        Ok(())
    }

    fn step(
        &mut self,
        engine: &mut Engine,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss> {
        let loss = forward_backward(engine, x, y, rec, &self.trace)?;
        let t = Instant::now();
        let (client, grads, params) = (&mut self.client, &mut self.grads, &mut self.params);
        let (t_comm, (push, pull)) = if engine.is_cuda() {
            // Device memory: one copy to a host buffer each way.
            engine.read_grads(0..grads.len(), grads)?;
            let t_comm = Instant::now();
            let r = self.rt.block_on(client.step(grads, params))?;
            engine.write_params(0, params)?;
            (t_comm, r)
        } else {
            // Host memory: the gradients go straight into the wire image and each pulled
            // chunk straight into the engine's parameters.
            let t_comm = Instant::now();
            (t_comm, self.rt.block_on(client.exchange_engine(engine))?)
        };
        let at = |ms: f64| t_comm + Duration::from_secs_f64(ms / 1e3);
        let mut args = serde_json::Map::new();
        args.insert("bytes".into(), push.bytes.into());
        args.insert("wait_ms".into(), push.wait_ms.into());
        args.insert("staleness".into(), push.staleness.into());
        self.trace.span_with("push", "comm", "comm", t, at(push.ms), args);
        // Under BSP the pull runs beside the push (the lane shows them overlapping).
        let pull_from = if self.client.sync == SyncMode::Bsp { t_comm } else { at(push.ms) };
        self.trace.span("pull", "comm", "comm", pull_from);
        engine.synchronize()?;
        // The time the servers held the push for other workers is waiting, not communication:
        // the step's parts (exposed communication + wait + ...) then add up to at most the step.
        rec.wait_ms = push.wait_ms.min(ms_since(t));
        rec.comm_ms = ms_since(t) - rec.wait_ms;
        rec.comm_exposed_ms = rec.comm_ms;
        rec.bytes_sent = push.bytes;
        rec.bytes_recv = pull.bytes;
        rec.staleness = Some(push.staleness);
        Ok(loss)
    }

    fn finish(&mut self, _engine: &mut Engine) -> anyhow::Result<()> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        self.rt.block_on(self.client.deregister())
    }

    fn applied_optimiser(&self) -> Option<SgdConfig> {
        self.client.optimiser().map(|o| o.0)
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut extra = serde_json::Map::new();
        if let Some((_, stale)) = self.client.optimiser() {
            extra.insert("staleness_lr".into(), stale.clone().into());
        }
        extra.insert("servers".into(), self.servers.clone().into());
        extra.insert("shards".into(), self.client.shards.len().into());
        extra.insert("chunk_bytes".into(), self.client.chunk_bytes.into());
        extra.insert("pipeline".into(), (self.client.sync == SyncMode::Bsp && self.client.pipeline).into());
        (self.client.sync.to_string(), extra)
    }
}

impl Drop for Ps {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}
