//! Parameter-server mode: compute the gradient on the device, copy it to host memory, push
//! each shard's range to its server concurrently, pull every range back concurrently, copy the
//! parameters to the device. The servers own the optimiser; this side owns no update.
//!
//! ```text
//!   device grads --read_grads--> host f32 --encode (1 pass)--> wire image --slices--> shard k
//!   device params <-write_params-- host f32 <--decode (1 pass)-- DATA frames <------- shard k
//! ```
//!
//! The two bulk RPCs go straight over the channel's HTTP/2 frames ([`frames`]), without
//! tonic's codec and its two copies per message; the rest use the generated client.
//!
//! [`PsClient`] is the transport-level client (also driven by `gradsync-bench ps`); [`Ps`] is
//! the [`Strategy`] that wraps it with a tokio runtime, because the training loop is
//! synchronous.

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures_util::future::try_join_all;
use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use gradsync_core::mlp::BatchLoss;
use gradsync_core::trace::Trace;
use gradsync_proto::frames::{self, Frames, Incoming};
use gradsync_proto::pb::parameter_server_client::ParameterServerClient;
use gradsync_proto::pb::{
    DeregisterRequest, GradientChunk, HeartbeatRequest, PullRequest, PushReply, RegisterRequest,
    VersionRequest,
};
use gradsync_proto::tuning::Tuning;
use gradsync_proto::wire;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use super::{Strategy, forward_backward_traced, ms_since};
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

/// One server shard as this worker sees it.
struct Shard {
    addr: String,
    client: Client,
    /// The same connection, for the bulk RPCs sent straight as HTTP/2 frames.
    channel: Channel,
    /// Its range of the flat buffer (known once registered).
    range: Range<usize>,
    /// Version of the parameters last pulled from it.
    version: u64,
    /// The last encoded gradient, kept so its allocation is reused once the RPC let go of it.
    spare: Option<Bytes>,
}

/// What one push or pull moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Traffic {
    /// Payload bytes.
    pub bytes: u64,
    /// Longest time a server held the push waiting for other workers, ms.
    pub wait_ms: f64,
    /// Largest staleness reported by any shard.
    pub staleness: u64,
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
    sync: String,
}

/// `host:port` to `http://host:port` (`https://` with TLS).
fn uri(addr: &str, tls: bool) -> String {
    match (addr.contains("://"), tls) {
        (true, _) => addr.to_string(),
        (false, false) => format!("http://{addr}"),
        (false, true) => format!("https://{addr}"),
    }
}

/// A status as a readable error naming the server.
fn rpc_err(addr: &str, what: &str, s: tonic::Status) -> anyhow::Error {
    // A plaintext client talking to a TLS server only ever sees the connection drop.
    let hint = if s.code() == tonic::Code::Unknown && s.message().contains("transport error") {
        " (if the server serves TLS, pass --tls-ca)"
    } else {
        ""
    };
    anyhow::anyhow!("{what} at {addr}: {:?}: {}{hint}", s.code(), s.message())
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
                let ch = tokio::time::timeout(timeout, ep.connect())
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!("connecting to {a}: no answer within {} s", timeout.as_secs_f64())
                    })?
                    .map_err(|e| {
                        anyhow::anyhow!("connecting to {a}: {}", gradsync_proto::tls::tls_why(&e))
                    })?;
                let client = ParameterServerClient::with_interceptor(ch.clone(), auth)
                    .max_decoding_message_size(tuning.max_message())
                    .max_encoding_message_size(tuning.max_message());
                anyhow::Ok(Shard {
                    addr: a.clone(),
                    client,
                    channel: ch,
                    range: 0..0,
                    version: 0,
                    spare: None,
                })
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
            sync: String::new(),
        })
    }

    /// The servers' synchronisation mode (`bsp`, `asp`, `ssp:S`), asked of shard 0.
    pub async fn sync_mode(&mut self) -> anyhow::Result<String> {
        let s = &mut self.shards[0];
        let r = deadline(
            self.timeout,
            &s.addr,
            "GetVersion",
            s.client.get_version(request(VersionRequest {}, self.timeout)),
        )
        .await?
        .into_inner();
        self.sync = r.sync.clone();
        Ok(r.sync)
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
            let r = deadline(timeout, &s.addr, "Register", s.client.register(request(req, timeout))).await?;
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
        self.sync = sync.clone();
        self.rank = rank as u32;
        self.total = total;
        Ok(replies.iter().map(|r| r.version).min().unwrap_or(0))
    }

    /// Push `grads` (the whole flat buffer): each shard gets its range, all concurrently.
    pub async fn push(&mut self, grads: &[f32]) -> anyhow::Result<Traffic> {
        anyhow::ensure!(
            grads.len() == self.total,
            "push: {} values for a model of {}",
            grads.len(),
            self.total
        );
        let (timeout, chunk, rank) = (self.timeout, self.chunk_bytes, self.rank);
        let (direct, limit, auth) = (self.direct, self.limit, &self.auth);
        let replies = try_join_all(self.shards.iter_mut().map(|s| {
            let (base, src) = (s.version, &grads[s.range.clone()]);
            let head = move |offset| GradientChunk { rank, base_version: base, offset, data: Bytes::new() };
            // Encoded once, into the allocation the previous push let go of, as one GradientChunk
            // message per chunk (direct) or as bare payloads (tonic's codec); every chunk is a
            // zero-copy slice.
            let spare = wire::reclaim(s.spare.take());
            let (framed, plain) = if direct {
                (Some(frames::Framed::encode(src, chunk, 4, head, spare)), None)
            } else {
                (None, Some(wire::encode(src, spare)))
            };
            s.spare = framed.as_ref().map(|f| f.bytes.clone()).or_else(|| plain.clone());
            let bytes = (src.len() * 4) as u64;
            async move {
                let r = if let Some(framed) = framed {
                    let mut body = Frames::new();
                    for i in 0..framed.len() {
                        body.data(framed.message(i));
                    }
                    let fut = async {
                        let mut replies = call(&mut s.channel, auth, PUSH, timeout, body, limit).await?;
                        let r = replies.message::<PushReply>().await?;
                        match (r, replies.message::<PushReply>().await?) {
                            (Some(r), None) => Ok(r),
                            _ => Err(tonic::Status::internal("PushGradients must answer one PushReply")),
                        }
                    };
                    deadline(timeout, &s.addr, "PushGradients", fut).await?
                } else {
                    let plain = plain.unwrap_or_default();
                    let chunks: Vec<GradientChunk> = wire::chunks(plain.len(), chunk)
                        .map(|r| GradientChunk { data: plain.slice(r.clone()), ..head((r.start / 4) as u64) })
                        .collect();
                    deadline(
                        timeout,
                        &s.addr,
                        "PushGradients",
                        s.client.push_gradients(request(tokio_stream_iter(chunks), timeout)),
                    )
                    .await?
                    .into_inner()
                };
                anyhow::Ok((r, bytes))
            }
        }))
        .await?;
        Ok(replies.iter().fold(Traffic::default(), |t, (r, b)| Traffic {
            bytes: t.bytes + b,
            wait_ms: t.wait_ms.max(r.wait_ms),
            staleness: t.staleness.max(r.staleness),
        }))
    }

    /// Pull every shard's parameters into `params` (the whole flat buffer), concurrently,
    /// decoding each chunk straight into place.
    pub async fn pull(&mut self, params: &mut [f32]) -> anyhow::Result<Traffic> {
        anyhow::ensure!(
            params.len() == self.total,
            "pull: {} values for a model of {}",
            params.len(),
            self.total
        );
        let (timeout, rank) = (self.timeout, self.rank);
        let (direct, limit, auth) = (self.direct, self.limit, &self.auth);
        // Split the buffer into each shard's disjoint slice (ranges are contiguous, in order).
        let mut rest = params;
        let mut slices = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(s.range.len());
            slices.push(mine);
            rest = tail;
        }
        let got = try_join_all(self.shards.iter_mut().zip(slices).map(|(s, dst)| async move {
            let fut = async {
                let mut stream = if direct {
                    let mut body = Frames::new();
                    body.data(frames::message(&PullRequest { rank }));
                    Incoming::Direct(call(&mut s.channel, auth, PULL, timeout, body, limit).await?)
                } else {
                    let r = s.client.pull_parameters(request(PullRequest { rank }, timeout)).await?;
                    Incoming::Codec(r.into_inner())
                };
                let (mut received, mut version) = (0u64, None);
                while let Some(c) = stream.message().await? {
                    if *version.get_or_insert(c.version) != c.version || c.offset != received {
                        return Err(tonic::Status::data_loss(
                            "chunks of one pull disagree on version or order",
                        ));
                    }
                    wire::decode_into(&c.data, c.offset, dst)
                        .map_err(|e| tonic::Status::data_loss(e.to_string()))?;
                    received += (c.data.len() / 4) as u64;
                }
                if received as usize != dst.len() {
                    return Err(tonic::Status::data_loss(format!("{received} values of {}", dst.len())));
                }
                Ok((version.unwrap_or(0), received * 4))
            };
            let (v, b) = deadline(timeout, &s.addr, "PullParameters", fut).await?;
            s.version = v;
            anyhow::Ok(b)
        }))
        .await?;
        Ok(Traffic { bytes: got.iter().sum(), ..Traffic::default() })
    }

    /// Tell every shard this rank is alive.
    pub async fn heartbeat(&mut self) -> anyhow::Result<()> {
        let (timeout, rank) = (self.timeout, self.rank);
        try_join_all(self.shards.iter_mut().map(|s| async move {
            deadline(
                timeout,
                &s.addr,
                "Heartbeat",
                s.client.heartbeat(request(HeartbeatRequest { rank }, timeout)),
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
                s.client.deregister(request(DeregisterRequest { rank }, timeout)),
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
                    client: s.client.clone(),
                    channel: s.channel.clone(),
                    range: s.range.clone(),
                    version: s.version,
                    spare: None,
                })
                .collect(),
            timeout: self.timeout,
            chunk_bytes: self.chunk_bytes,
            direct: self.direct,
            limit: self.limit,
            auth: self.auth.clone(),
            rank: self.rank,
            total: self.total,
            sync: self.sync.clone(),
        }
    }
}

const PUSH: &str = "/gradsync.ps.v1.ParameterServer/PushGradients";
const PULL: &str = "/gradsync.ps.v1.ParameterServer/PullParameters";

/// Call `path` with `body` as the request, straight over the channel (no codec): the
/// response's messages, its HTTP and trailers-only errors already checked.
async fn call(
    ch: &mut Channel,
    auth: &Auth,
    path: &str,
    timeout: Duration,
    body: Frames,
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
    let req = req.body(body.into_body()).map_err(|e| tonic::Status::internal(e.to_string()))?;
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
            args.rpc_timeout.is_finite() && args.rpc_timeout > 0.0,
            "--rpc-timeout {} must be a positive number of seconds",
            args.rpc_timeout
        );
        gradsync_core::heap::keep_freed_memory();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("gradsync-ps")
            .build()
            .context("starting the PS client runtime")?;
        let timeout = Duration::from_secs_f64(args.rpc_timeout);
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
                PsClient::connect_tls(&args.servers, args.token.as_deref(), timeout, tuning, tls).await?;
            c.sync_mode().await?;
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
        let loss = forward_backward_traced(engine, x, y, rec, &self.trace)?;
        let t = Instant::now();
        engine.read_grads(0..self.grads.len(), &mut self.grads)?;
        let (client, grads, params) = (&mut self.client, &self.grads, &mut self.params);
        let (push, pull, pushed) = self.rt.block_on(async {
            let push = client.push(grads).await?;
            let pushed = Instant::now();
            let pull = client.pull(params).await?;
            anyhow::Ok((push, pull, pushed))
        })?;
        let mut args = serde_json::Map::new();
        args.insert("bytes".into(), push.bytes.into());
        args.insert("wait_ms".into(), push.wait_ms.into());
        args.insert("staleness".into(), push.staleness.into());
        self.trace.span_with("push", "comm", "comm", t, pushed, args);
        self.trace.span("pull", "comm", "comm", pushed);
        engine.write_params(0, &self.params)?;
        engine.synchronize()?;
        rec.comm_ms = ms_since(t);
        rec.comm_exposed_ms = rec.comm_ms;
        rec.wait_ms = push.wait_ms;
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

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut extra = serde_json::Map::new();
        extra.insert("servers".into(), self.servers.clone().into());
        extra.insert("shards".into(), self.client.shards.len().into());
        extra.insert("chunk_bytes".into(), self.client.chunk_bytes.into());
        (self.client.sync.clone(), extra)
    }
}

impl Drop for Ps {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}
