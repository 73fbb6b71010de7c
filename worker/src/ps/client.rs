//! [`PsClient`]: one worker's view of a sharded parameter server, ps-lite's `KVWorker` for
//! one flat buffer. It registers with every shard (learning each one's range of the buffer),
//! then pushes gradients and pulls parameters, every shard concurrently, each on its own
//! connections; heartbeats and deregistration go to every shard too.

use std::ops::Range;
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;
use gradsync_core::compress::Compression;
use gradsync_core::optim::SgdConfig;
use gradsync_proto::SyncMode;
use gradsync_proto::pb::{
    DeregisterRequest, HeartbeatRequest, PushReply, RegisterReply, RegisterRequest, VersionRequest,
};
use gradsync_proto::tuning::Tuning;

use super::bulk::{Opts, Transfer, pull_shard, push_shard, push_transfer};
use super::chunks::{ChunkSink, Gradients, HostGrads, HostSlice};
use super::connect::{Auth, Shard, deadline, dial, request, serves_tls, uri};
use super::error::{PsError, Result};
use super::rows::{RowsStep, pull_rows, push_rows, within};
use gradsync_core::metrics::ms_since;

/// A connection to every shard of a parameter server.
pub struct PsClient {
    shards: Vec<Shard>,
    timeout: Duration,
    /// Payload bytes per pushed chunk for every shard, whatever the shards announce.
    chunk_bytes: Option<usize>,
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
    /// How pushes are encoded (`--compress`), announced at registration.
    compression: Compression,
    /// A sparse table's place in the flat buffer, its rows and values per row
    /// ([`PsClient::set_table`]).
    table: Option<(Range<usize>, usize, usize)>,
    /// The servers hold the table alone (`--table-only`, for `--mode hybrid`).
    table_only: bool,
    /// Register as a rank coming back after a restart ([`PsClient::set_rejoin`]).
    rejoin: bool,
    /// The version this rank's first gradient must be computed from, once registered.
    join: u64,
}

impl PsClient {
    /// Connect to every server in `addrs` (one per shard, in shard order) concurrently.
    pub async fn connect(
        addrs: &[String],
        token: Option<&str>,
        timeout: Duration,
        tuning: Tuning,
    ) -> Result<Self> {
        Self::connect_tls(addrs, token, timeout, tuning, None).await
    }

    /// [`PsClient::connect`], over TLS when `tls` is given (addresses become `https://`).
    pub async fn connect_tls(
        addrs: &[String],
        token: Option<&str>,
        timeout: Duration,
        tuning: Tuning,
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> Result<Self> {
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
    ) -> Result<Self> {
        if addrs.is_empty() {
            return Err(PsError::Flag { flag: "--servers", why: "give at least one host:port".into() });
        }
        let auth = Auth(
            token
                .map(gradsync_proto::auth::bearer)
                .transpose()
                .map_err(|e| PsError::Flag { flag: "--token", why: e.to_string() })?,
        );
        let shards = try_join_all(addrs.iter().map(|a| {
            let auth = auth.clone();
            let tls = tls.clone();
            async move {
                let on_tls = tls.is_some();
                let mut ep = tuning.endpoint(&uri(a, on_tls), timeout).map_err(|e| PsError::Flag {
                    flag: "--servers",
                    why: format!("'{a}': {}", gradsync_proto::tls::tls_why(&e)),
                })?;
                if let Some(tls) = tls {
                    ep = ep.tls_config(tls).map_err(|e| PsError::Flag {
                        flag: "--tls-ca",
                        why: gradsync_proto::tls::tls_why(&e),
                    })?;
                }
                // Pulls get their own connection: on one TCP connection carrying both
                // directions at once, the sender's socket lock also processes the incoming
                // segments, and each direction runs at about half its rate (docs/ps.md).
                // The first connection waits for the server; the second finds it up.
                let rpc = dial(&ep, a, on_tls, timeout, tuning, &auth, wait).await?;
                let pull = dial(&ep, a, on_tls, timeout, tuning, &auth, Duration::ZERO).await?;
                Ok::<_, PsError>(Shard {
                    addr: a.clone(),
                    tls: on_tls,
                    rpc,
                    pull,
                    range: 0..0,
                    rows: 0..0,
                    version: 0,
                    digest: None,
                    chunk: tuning.chunk_bytes,
                })
            }
        }))
        .await?;
        Ok(PsClient {
            shards,
            timeout,
            chunk_bytes: None,
            direct: tuning.direct,
            limit: tuning.max_message(),
            auth,
            rank: 0,
            total: 0,
            sync: SyncMode::Bsp,
            pipeline: true,
            optimiser: None,
            compression: Compression::None,
            table: None,
            table_only: false,
            rejoin: false,
            join: 0,
        })
    }

    /// The model has a sparse table at `flat` of the flat buffer, `rows` rows of `dim`: the
    /// servers must split it by rows (checked at the next [`PsClient::register`]), and it
    /// moves by [`RowsStep`]s rather than with the dense values.
    pub fn set_table(&mut self, table: Option<(Range<usize>, usize, usize)>) {
        self.table = table;
    }

    /// The servers must hold the table alone (`gradsync-server --table-only`), its rows moved
    /// by [`PsClient::rows_step`] while the rest of the model goes elsewhere (`--mode hybrid`).
    pub fn set_table_only(&mut self, yes: bool) {
        self.table_only = yes;
    }

    /// Register as a rank coming back after its process was restarted (`--resume`): the
    /// servers take it back under its rank, in the step in progress if it was still
    /// registered, from the next step if it had left or been dropped
    /// ([`PsClient::join_version`]).
    pub fn set_rejoin(&mut self, on: bool) {
        self.rejoin = on;
    }

    /// The version this rank's first gradient must be computed from, known once registered:
    /// the servers' version, or the next one when it came back during a step that does not
    /// wait for it.
    pub fn join_version(&self) -> u64 {
        self.join
    }

    /// Each shard's version of the parameters this worker holds, with its address.
    pub fn versions(&self) -> Vec<(String, u64)> {
        self.shards.iter().map(|s| (s.addr.clone(), s.version)).collect()
    }

    /// The version of the parameters this worker holds (the lowest shard's).
    pub fn version(&self) -> u64 {
        self.shards.iter().map(|s| s.version).min().unwrap_or(0)
    }

    /// [`PsClient::pull_version_into`] the whole flat buffer `params`.
    pub async fn pull_version(&mut self, params: &mut [f32], want: u64) -> Result<Transfer> {
        let sinks = self.host_sinks(params)?;
        self.pull_version_into(sinks, want).await
    }

    /// Pull version `want` of every shard into `sinks` (one per shard, in shard order), as the
    /// servers make it when it is the next one (a BSP step in progress), at once when it is
    /// the current one.
    pub async fn pull_version_into<S: ChunkSink>(&mut self, sinks: Vec<S>, want: u64) -> Result<Transfer> {
        self.check_sinks(sinks.len())?;
        let t = Instant::now();
        let o = self.opts();
        let got = try_join_all(self.shards.iter().zip(sinks).map(|(s, mut dst)| {
            let o = &o;
            // A shard already past `want` sends its current version.
            let ask = (s.version < want).then_some(want);
            async move { pull_shard(o, s, &mut dst, ask).await }
        }))
        .await?;
        for (s, (v, _)) in self.shards.iter_mut().zip(&got) {
            s.version = *v;
        }
        Ok(Transfer { bytes: got.iter().map(|g| g.1).sum(), ms: ms_since(t), ..Transfer::default() })
    }

    /// Announce pushes encoded as `c` (`--compress`) at the next [`PsClient::register`]; the
    /// servers refuse a registration that does not match their own `--compress`. The caller
    /// encodes what it pushes ([`crate::ps::Encoded`]).
    pub fn set_compression(&mut self, c: Compression) {
        self.compression = c;
    }

    /// How pushes are encoded, as announced.
    pub fn compression(&self) -> Compression {
        self.compression
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

    /// The servers' synchronisation mode, as last asked ([`PsClient::sync_mode`]) or learnt
    /// at registration.
    pub fn sync(&self) -> SyncMode {
        self.sync
    }

    /// Whether a step pulls while it pushes: under BSP, unless [`PsClient::set_pipeline`]
    /// turned it off.
    pub fn pipelined(&self) -> bool {
        self.sync == SyncMode::Bsp && self.pipeline
    }

    /// Each shard's range of the flat buffer, in shard order (empty before registering).
    pub fn ranges(&self) -> impl ExactSizeIterator<Item = Range<usize>> + '_ {
        self.shards.iter().map(|s| s.range.clone())
    }

    /// Push in chunks of `bytes` to every shard (`None`: in the size each shard announced at
    /// registration, the size it steps and streams its blocks in). Takes effect at the next
    /// [`PsClient::register`].
    pub fn set_chunk_bytes(&mut self, bytes: Option<usize>) {
        self.chunk_bytes = bytes;
    }

    /// Payload bytes per pushed chunk, shard by shard (known once registered).
    pub fn chunk_bytes(&self) -> Vec<usize> {
        self.shards.iter().map(|s| s.chunk).collect()
    }

    /// The servers' synchronisation mode (`bsp`, `asp`, `ssp:S`), asked of shard 0.
    pub async fn sync_mode(&mut self) -> Result<SyncMode> {
        let s = &mut self.shards[0];
        let r = match deadline(
            self.timeout,
            (&s.addr, s.tls),
            "GetVersion",
            s.rpc.client.get_version(request(VersionRequest {}, self.timeout)),
        )
        .await
        {
            Ok(r) => r.into_inner(),
            // The first call on a new connection failed under it, before any answer: whether
            // the failure shows a TLS server's bytes depends on when its alert and its close
            // arrive, so ask the server itself. Never when this worker dialled TLS, nor when
            // the server answered (a refused token is not a TLS problem).
            Err(PsError::Transport { addr, what, status, .. }) if !s.tls && serves_tls(&addr).await => {
                return Err(PsError::ServesTls { addr, what, status });
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
    ) -> Result<u64> {
        let replies = self.ask_to_register(rank, world, fingerprint).await?;
        self.place_shards(&replies, total)?;
        self.agree(&replies)?;
        self.rank = rank as u32;
        self.total = total;
        Ok(replies.iter().map(|r| r.version).min().unwrap_or(0))
    }

    /// Every shard's answer to this rank's registration, all asked concurrently. A rank coming
    /// back ([`PsClient::set_rejoin`]) asks again the shards that would expect it from an
    /// earlier step than the others: every shard must expect it from the same one, the
    /// latest, which becomes [`PsClient::join_version`].
    async fn ask_to_register(
        &mut self,
        rank: usize,
        world: usize,
        fingerprint: &str,
    ) -> Result<Vec<RegisterReply>> {
        let timeout = self.timeout;
        let compression = &self.compression.to_string();
        let rejoin = self.rejoin;
        let req = |join_at: u64| RegisterRequest {
            rank: rank as u32,
            world_size: world as u32,
            fingerprint: fingerprint.into(),
            compression: compression.clone(),
            rejoin,
            join_at,
        };
        let mut replies =
            try_join_all(self.shards.iter_mut().map(|s| register_with(s, req(0), timeout))).await?;
        // A rank that came back while some shards had begun a step without it and others had
        // not: every shard must expect it from the same step, the latest.
        let join = replies.iter().map(|r| r.join_version.max(r.version)).max().unwrap_or(0);
        if rejoin {
            for (s, r) in self.shards.iter_mut().zip(replies.iter_mut()) {
                if r.join_version.max(r.version) < join {
                    *r = register_with(s, req(join), timeout).await?;
                }
            }
        }
        self.join = join;
        Ok(replies)
    }

    /// Each shard's range of the flat buffer and rows of the table, from its registration
    /// reply, each checked against this worker's model of `total` values and its limits, and
    /// all of them against what moves through the servers: the dense values, in shard order,
    /// and the table's rows.
    fn place_shards(&mut self, replies: &[RegisterReply], total: usize) -> Result<()> {
        // The dense values: the whole buffer, or what the table at one end of it leaves; none
        // on servers that hold the table alone.
        let mut dense = match &self.table {
            None => 0..total,
            Some((t, ..)) if t.start == 0 => t.end..total,
            Some((t, ..)) => 0..t.start,
        };
        let alone = replies.iter().all(|r| r.start == r.end) && !dense.is_empty();
        if alone != self.table_only {
            return Err(PsError::Servers(
                if alone {
                    "they serve a sparse table alone (--table-only), for --mode hybrid; start them without \
                     --table-only for --mode ps"
                } else {
                    "--mode hybrid keeps only the table on the servers; start them with --table-only"
                }
                .into(),
            ));
        }
        if alone {
            dense = dense.start..dense.start;
        }
        let fit = Fit {
            total,
            dim: self.table.as_ref().map(|t| t.2),
            alone,
            limit: self.limit,
            chunk_bytes: self.chunk_bytes,
        };
        let n = self.shards.len();
        let mut at = (dense.start, 0);
        for (i, (s, r)) in self.shards.iter_mut().zip(replies).enumerate() {
            at = place(s, (i, n), r, &fit, at)?;
        }
        let (end, rows_end) = at;
        if end != dense.end {
            return Err(PsError::Servers(format!(
                "the shards cover {}..{end} of the {}..{} that moves densely",
                dense.start, dense.start, dense.end
            )));
        }
        if let Some((_, rows, _)) = &self.table
            && rows_end != *rows
        {
            return Err(PsError::Servers(format!("the shards own rows 0..{rows_end} of the table's {rows}")));
        }
        Ok(())
    }

    /// What every shard must share, from their registration replies: the compression this
    /// worker pushes with, the sync mode and the optimiser (both recorded here).
    fn agree(&mut self, replies: &[RegisterReply]) -> Result<()> {
        let compression = self.compression.to_string();
        for (s, r) in self.shards.iter().zip(replies) {
            // A server that names no compression predates it and decodes f32 pushes only.
            let theirs = if r.compression.is_empty() { "none" } else { r.compression.as_str() };
            if theirs != compression {
                return Err(PsError::Shard {
                    addr: s.addr.clone(),
                    why: format!(
                        "takes pushes with --compress {theirs}, this worker sends --compress {compression}"
                    ),
                });
            }
        }
        let sync = &replies[0].sync;
        if let Some(r) = replies.iter().find(|r| &r.sync != sync) {
            return Err(PsError::Disagree {
                what: "the sync mode",
                detail: format!("{sync} and {}", r.sync),
            });
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
            return Err(PsError::Disagree {
                what: "the optimiser",
                detail: format!("shard 0 applies {first:?}, shard {i} {other:?}"),
            });
        }
        self.optimiser = Some(first);
        Ok(())
    }

    fn opts(&self) -> Opts<'_> {
        Opts {
            timeout: self.timeout,
            direct: self.direct,
            limit: self.limit,
            auth: &self.auth,
            rank: self.rank,
            pull_half: self.compression.half(),
        }
    }

    fn check_len(&self, what: &'static str, n: usize) -> Result<()> {
        if n != self.total {
            return Err(PsError::Length { what, got: n, want: self.total });
        }
        Ok(())
    }

    /// Destinations handed to a pull: one per shard.
    fn check_sinks(&self, n: usize) -> Result<()> {
        if n != self.shards.len() {
            return Err(PsError::Invalid {
                what: "a pull's destinations",
                why: format!("{n} for {} shards: give one per shard", self.shards.len()),
            });
        }
        Ok(())
    }

    /// The table's values per row, for `what`, which needs the model to have a table.
    fn table_dim(&self, what: &'static str) -> Result<usize> {
        match self.table.as_ref().map_or(0, |t| t.2) {
            0 => Err(PsError::Invalid { what, why: "the model has no sparse table".into() }),
            dim => Ok(dim),
        }
    }

    /// `buf` (the whole flat buffer, its length checked) as one sink a shard, in shard order,
    /// for a pull.
    pub fn host_sinks<'a>(&self, buf: &'a mut [f32]) -> Result<Vec<HostSlice<'a>>> {
        self.check_len("pull", buf.len())?;
        Ok(self.split(buf).into_iter().map(HostSlice).collect())
    }

    /// Each shard's disjoint slice of `buf` (ranges are contiguous, in order, from the first
    /// shard's start).
    fn split<'a>(&self, buf: &'a mut [f32]) -> Vec<&'a mut [f32]> {
        let first = self.shards.first().map_or(0, |s| s.range.start);
        let mut rest = &mut buf[first..];
        let mut slices = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(s.range.len());
            slices.push(mine);
            rest = tail;
        }
        slices
    }

    /// Push `grads` (the whole flat buffer): each shard gets its range, all concurrently.
    pub async fn push(&mut self, grads: &[f32]) -> Result<Transfer> {
        self.push_from(&HostGrads(grads)).await
    }

    /// [`PsClient::push`] from any gradient source (one that sends without copying,
    /// [`crate::ps::SharedGrads`], or a compressed one).
    pub async fn push_from<G: Gradients + ?Sized>(&mut self, grads: &G) -> Result<Transfer> {
        self.check_source(grads)?;
        let (t, o) = (Instant::now(), self.opts());
        let replies = try_join_all(self.shards.iter().map(|s| push_shard(&o, s, grads))).await?;
        Ok(push_transfer(&replies, t))
    }

    /// A gradient source's length, where it knows it, against the model's.
    fn check_source<G: Gradients + ?Sized>(&self, grads: &G) -> Result<()> {
        grads.values().map_or(Ok(()), |n| self.check_len("push", n))
    }

    /// Pull every shard's parameters into `params` (the whole flat buffer), concurrently,
    /// decoding each chunk straight into place.
    pub async fn pull(&mut self, params: &mut [f32]) -> Result<Transfer> {
        let sinks = self.host_sinks(params)?;
        self.pull_into(sinks).await
    }

    /// Pull every shard's parameters into `sinks` (one per shard, in shard order),
    /// concurrently, each chunk handed over as it arrives.
    pub async fn pull_into<S: ChunkSink>(&mut self, sinks: Vec<S>) -> Result<Transfer> {
        self.pull_into_except(sinks, &[]).await
    }

    /// Which shards' parameters at the version each registered this worker at this worker
    /// holds already: those whose registration digest equals `own`'s of the worker's values in
    /// their range (by shard, in shard order; `false` for a shard that gave none).
    pub fn held(&self, mut own: impl FnMut(Range<usize>) -> Result<[u8; 32]>) -> Result<Vec<bool>> {
        self.shards
            .iter()
            .map(|s| match s.digest {
                Some(d) => Ok(own(s.range.clone())? == d),
                None => Ok(false),
            })
            .collect()
    }

    /// [`PsClient::pull_into`] from the shards not `held` (by shard, as [`PsClient::held`]
    /// says; a shard past its end is pulled), leaving those sinks as they are.
    pub async fn pull_into_except<S: ChunkSink>(&mut self, sinks: Vec<S>, held: &[bool]) -> Result<Transfer> {
        self.check_sinks(sinks.len())?;
        let t = Instant::now();
        let o = self.opts();
        let got = try_join_all(self.shards.iter().zip(sinks).enumerate().map(|(i, (s, mut dst))| {
            let (o, keep) = (&o, held.get(i).copied().unwrap_or(false));
            async move {
                match keep {
                    true => Ok((s.version, 0)),
                    false => pull_shard(o, s, &mut dst, None).await,
                }
            }
        }))
        .await?;
        for (s, (v, _)) in self.shards.iter_mut().zip(&got) {
            s.version = *v;
        }
        Ok(Transfer { bytes: got.iter().map(|g| g.1).sum(), ms: ms_since(t), ..Transfer::default() })
    }

    /// One step's communication: push `grads` (as they come, compressed or not) and pull the
    /// parameters the update makes into the whole flat buffer `params`. See
    /// [`PsClient::exchange`].
    pub async fn exchange_into<G: Gradients + ?Sized>(
        &mut self,
        grads: &G,
        params: &mut [f32],
    ) -> Result<(Transfer, Transfer)> {
        let sinks = self.host_sinks(params)?;
        self.exchange(grads, sinks).await
    }

    /// [`PsClient::exchange_into`] with a sparse table's rows beside it
    /// ([`PsClient::exchange_with_rows`]).
    pub async fn exchange_into_with_rows<G: Gradients + ?Sized>(
        &mut self,
        grads: &G,
        params: &mut [f32],
        rows: RowsStep<'_>,
    ) -> Result<(Transfer, Transfer)> {
        let sinks = self.host_sinks(params)?;
        self.exchange_with_rows(grads, sinks, Some(rows)).await
    }

    /// Rows `ids` of the table (ascending, counted in the whole table), of each shard's
    /// current version, into `out` (`dim` values a row, in order).
    pub async fn pull_rows(&mut self, ids: &[u32], out: &mut [f32]) -> Result<Transfer> {
        let (t, o) = (Instant::now(), self.opts());
        let dim = self.table_dim("a pull of rows")?;
        if out.len() != ids.len() * dim {
            return Err(PsError::Invalid {
                what: "a pull of rows",
                why: format!("{} rows of {dim} values into {} values", ids.len(), out.len()),
            });
        }
        let parts = self.shard_rows(RowsStep { push: (&[], &[]), pull: (ids, out) })?;
        let got = try_join_all(
            self.shards.iter().zip(parts).map(|(s, p)| pull_rows(&o, s, dim, None, Some(p.pull.0), p.pull.1)),
        )
        .await?;
        Ok(Transfer { bytes: got.iter().map(|g| g.1).sum(), ms: ms_since(t), ..Transfer::default() })
    }

    /// One step's communication: push `grads` and pull the parameters the update makes into
    /// `params` (both the whole flat buffer). See [`PsClient::exchange`].
    pub async fn step(&mut self, grads: &[f32], params: &mut [f32]) -> Result<(Transfer, Transfer)> {
        self.check_len("push", grads.len())?;
        let sinks = self.host_sinks(params)?;
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
    ) -> Result<(Transfer, Transfer)> {
        self.exchange_with_rows(grads, sinks, None).await
    }

    /// [`PsClient::exchange`], and for a model with a sparse table the step's rows beside it,
    /// shard by shard: the rows pushed with the dense push, the rows pulled with the dense
    /// pull (under BSP pipelined, of the version the step makes, so they come as the update
    /// commits; otherwise once the push is done). Their bytes count in the push's and the
    /// pull's.
    pub async fn exchange_with_rows<G: Gradients + ?Sized, S: ChunkSink>(
        &mut self,
        grads: &G,
        sinks: Vec<S>,
        rows: Option<RowsStep<'_>>,
    ) -> Result<(Transfer, Transfer)> {
        let t = Instant::now();
        self.check_sinks(sinks.len())?;
        self.check_source(grads)?;
        let pipelined = self.pipelined();
        let o = self.opts();
        let dim = self.table.as_ref().map_or(0, |t| t.2);
        // Each shard's part of the step's rows: ids and values to push, ids to pull and where.
        let parts: Vec<Option<ShardRows<'_>>> = match rows {
            None => (0..self.shards.len()).map(|_| None).collect(),
            Some(rows) => self.shard_rows(rows)?.into_iter().map(Some).collect(),
        };
        let got = try_join_all(self.shards.iter().zip(sinks).zip(parts).map(|((s, mut sink), part)| {
            let o = &o;
            async move {
                let dense = exchange_dense(o, s, grads, &mut sink, pipelined, t);
                let Some(ShardRows { push: (ids, values), pull: (want, out) }) = part else {
                    return dense.await;
                };
                // The rows beside the dense exchange: pushed at once, and under BSP pipelined
                // pulled at the version the step makes (the server answers once it commits);
                // otherwise pulled once both pushes are applied.
                let rows_push = push_rows(o, s, dim, s.version, ids, values);
                let ((mut push, push_ms, mut pull, pull_ms), pushed, pulled) = if pipelined {
                    let rows_pull = pull_rows(o, s, dim, Some(s.version + 1), Some(want), out);
                    let (d, a, b) = tokio::join!(dense, rows_push, rows_pull);
                    (d?, a?, b?.1)
                } else {
                    let (d, a) = tokio::join!(dense, rows_push);
                    let (d, a) = (d?, a?);
                    (d, a, pull_rows(o, s, dim, None, Some(want), out).await?.1)
                };
                push.1 += pushed;
                pull.1 += pulled;
                Ok::<_, PsError>((push, push_ms, pull, pull_ms.max(ms_since(t))))
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

    /// One step's rows alone, on servers that hold the table only ([`PsClient::set_table_only`]):
    /// every shard gets its part of the rows to push, and under BSP pipelined its part of the
    /// rows to pull is asked for at the version the step makes (answered as it commits);
    /// otherwise pulled once the push is applied. Returns the push's and the pull's traffic.
    pub async fn rows_step(&mut self, rows: RowsStep<'_>) -> Result<(Transfer, Transfer)> {
        let (t, pipelined, o) = (Instant::now(), self.pipelined(), self.opts());
        let dim = self.table.as_ref().map_or(0, |t| t.2);
        let parts = self.shard_rows(rows)?;
        let got = try_join_all(self.shards.iter().zip(parts).map(
            |(s, ShardRows { push: (ids, values), pull: (want, out) })| {
                let o = &o;
                async move {
                    let push = push_rows(o, s, dim, s.version, ids, values);
                    let (pushed, (version, pulled)) = if pipelined {
                        let (a, b) =
                            tokio::join!(push, pull_rows(o, s, dim, Some(s.version + 1), Some(want), out));
                        (a?, b?)
                    } else {
                        let a = push.await?;
                        (a, pull_rows(o, s, dim, None, Some(want), out).await?)
                    };
                    Ok::<_, PsError>((pushed, version, pulled))
                }
            },
        ))
        .await?;
        for (s, g) in self.shards.iter_mut().zip(&got) {
            s.version = g.1;
        }
        let ms = ms_since(t);
        Ok((
            Transfer { bytes: got.iter().map(|g| g.0).sum(), ms, ..Transfer::default() },
            Transfer { bytes: got.iter().map(|g| g.2).sum(), ms, ..Transfer::default() },
        ))
    }

    /// Each shard's part of `rows` (ids ascending, counted in the whole table).
    fn shard_rows<'a>(&self, rows: RowsStep<'a>) -> Result<Vec<ShardRows<'a>>> {
        let dim = self.table_dim("rows of a table")?;
        let RowsStep { push: (ids, values), pull: (want, mut out) } = rows;
        let mut parts = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            let (p, q) = (within(ids, &s.rows), within(want, &s.rows));
            let (mine, rest) = std::mem::take(&mut out).split_at_mut(q.len() * dim);
            out = rest;
            let values = &values[p.start * dim..p.end * dim];
            parts.push(ShardRows { push: (&ids[p], values), pull: (&want[q], mine) });
        }
        if !out.is_empty() {
            return Err(PsError::Invalid {
                what: "rows to pull",
                why: "named outside the table's rows".into(),
            });
        }
        Ok(parts)
    }

    /// Every row of the table, of each shard's current version, into `out` (the whole table,
    /// `dim` values a row): what evaluation, a checkpoint or the saved model read.
    pub async fn pull_all_rows(&mut self, out: &mut [f32]) -> Result<Transfer> {
        let (t, o) = (Instant::now(), self.opts());
        let dim = self.table_dim("a pull of rows")?;
        let mut rest = out;
        let mut dsts = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(s.rows.len() * dim);
            dsts.push(mine);
            rest = tail;
        }
        let got =
            try_join_all(self.shards.iter().zip(dsts).map(|(s, out)| pull_rows(&o, s, dim, None, None, out)))
                .await?;
        Ok(Transfer { bytes: got.iter().map(|g| g.1).sum(), ms: ms_since(t), ..Transfer::default() })
    }

    /// Tell every shard this rank is alive.
    pub async fn heartbeat(&mut self) -> Result<()> {
        let (timeout, rank) = (self.timeout, self.rank);
        try_join_all(self.shards.iter_mut().map(|s| async move {
            deadline(
                timeout,
                (&s.addr, s.tls),
                "Heartbeat",
                s.rpc.client.heartbeat(request(HeartbeatRequest { rank }, timeout)),
            )
            .await
        }))
        .await?;
        Ok(())
    }

    /// Leave the run on every shard.
    pub async fn deregister(&mut self) -> Result<()> {
        let (timeout, rank) = (self.timeout, self.rank);
        try_join_all(self.shards.iter_mut().map(|s| async move {
            deadline(
                timeout,
                (&s.addr, s.tls),
                "Deregister",
                s.rpc.client.deregister(request(DeregisterRequest { rank }, timeout)),
            )
            .await
        }))
        .await?;
        Ok(())
    }

    /// A clone sharing the connections (for a heartbeat task).
    pub fn share(&self) -> PsClient {
        PsClient {
            shards: self
                .shards
                .iter()
                .map(|s| Shard {
                    addr: s.addr.clone(),
                    tls: s.tls,
                    rpc: s.rpc.clone(),
                    pull: s.pull.clone(),
                    range: s.range.clone(),
                    rows: s.rows.clone(),
                    version: s.version,
                    digest: s.digest,
                    chunk: s.chunk,
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
            compression: self.compression,
            table: self.table.clone(),
            table_only: self.table_only,
            rejoin: self.rejoin,
            join: self.join,
        }
    }
}

/// What one shard's part of a step moved: the push's reply and payload bytes, when it ended
/// (ms), the version pulled and its payload bytes, when the pull ended (ms).
type ShardStep = ((PushReply, u64), f64, (u64, u64), f64);

/// Shard `s`'s dense part of a step ([`PsClient::exchange`]): its push of `grads` and the pull
/// into `sink`, of the version the push makes streamed at once when `pipelined`, else after
/// the push. Times from `t`.
async fn exchange_dense<G: Gradients + ?Sized>(
    o: &Opts<'_>,
    s: &Shard,
    grads: &G,
    sink: &mut impl ChunkSink,
    pipelined: bool,
    t: Instant,
) -> Result<ShardStep> {
    let push = async {
        let r = push_shard(o, s, grads).await;
        (r, ms_since(t))
    };
    let ((push, push_ms), pull) = if pipelined {
        let pull = pull_shard(o, s, sink, Some(s.version + 1));
        tokio::pin!(push, pull);
        tokio::select! {
            // A failed push ends the exchange at once: its streamed pull could only fail too,
            // once the server gave up on the step.
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
        // The streamed pull ends with an error when its step fails (and then so did the push,
        // reported above) or had to be redone without a dropped worker's gradient: the push
        // succeeded, so pull the version it made.
        Some(Err(e)) => {
            tracing::debug!("{e}; pulling version {} again", push.0.version);
            pull_shard(o, s, sink, None).await?
        }
        None => pull_shard(o, s, sink, None).await?,
    };
    Ok((push, push_ms, pull, ms_since(t)))
}

/// One shard's part of a [`RowsStep`].
struct ShardRows<'a> {
    push: (&'a [u32], &'a [f32]),
    pull: (&'a [u32], &'a mut [f32]),
}

/// Register with shard `s` as `req` says; its answer.
async fn register_with(s: &mut Shard, req: RegisterRequest, timeout: Duration) -> Result<RegisterReply> {
    let call = s.rpc.client.register(request(req, timeout));
    Ok(deadline(timeout, (&s.addr, s.tls), "Register", call).await?.into_inner())
}

/// What a shard's registration reply must fit: this worker's model and limits.
struct Fit {
    /// The model's values.
    total: usize,
    /// The table's values per row, for a model with a sparse table.
    dim: Option<usize>,
    /// The shards hold the table alone, no dense values.
    alone: bool,
    /// The largest message this worker accepts, bytes.
    limit: usize,
    /// The chunk size this worker pushes in, where it chose one.
    chunk_bytes: Option<usize>,
}

/// Shard `i` of `n`, which answered its registration with `r`, placed at `at` (the flat
/// buffer's value and the table's row where it must start): its range, rows, version and
/// chunk size set from the reply once checked against `fit`. Returns where the next shard
/// must start.
fn place(
    s: &mut Shard,
    (i, n): (usize, usize),
    r: &RegisterReply,
    fit: &Fit,
    (end, mut rows_end): (usize, usize),
) -> Result<(usize, usize)> {
    let refuse = |s: &Shard, why: String| Err(PsError::Shard { addr: s.addr.clone(), why });
    if r.shard as usize != i || r.shards as usize != n {
        return Err(PsError::Servers(format!(
            "{} is shard {}/{} but was listed as shard {i} of {n}",
            s.addr, r.shard, r.shards
        )));
    }
    if r.total as usize != fit.total {
        return refuse(s, format!("holds {} values, this model has {}", r.total, fit.total));
    }
    // (Servers that hold the table alone own no dense values, each at its own offset.)
    if !fit.alone && r.start as usize != end {
        return refuse(s, format!("its range starts at {}, expected {end}", r.start));
    }
    match fit.dim {
        None if r.row_len != 0 => {
            return refuse(s, format!("splits a table of rows of {} values, this model has none", r.row_len));
        }
        None => {}
        Some(dim) if r.row_len as usize != dim || r.rows_start as usize != rows_end => {
            return refuse(
                s,
                format!(
                    "owns table rows {}..{} of {} values, expected rows from {rows_end} of {dim} values \
                     (a server too old for sparse tables says none)",
                    r.rows_start, r.rows_end, r.row_len
                ),
            );
        }
        Some(_) => {
            s.rows = r.rows_start as usize..r.rows_end as usize;
            rows_end = r.rows_end as usize;
        }
    }
    s.range = if fit.alone { end..end } else { r.start as usize..r.end as usize };
    s.version = r.version;
    s.digest = <[u8; 32]>::try_from(&r.digest[..]).ok();
    // A server that announces no size (older ones) gets the size its range suggests.
    let announced = match r.chunk_bytes as usize {
        0 => Tuning::chunk_for_shard(s.range.len() * 4),
        c => c,
    };
    if announced > fit.limit.saturating_sub(4096) {
        return refuse(
            s,
            format!("streams chunks of {announced} bytes, above the {} this worker accepts", fit.limit),
        );
    }
    s.chunk = fit.chunk_bytes.unwrap_or(announced);
    Ok((if fit.alone { end } else { r.end as usize }, rows_end))
}

/// A server's sync mode as it wrote it.
fn parse_sync(addr: &str, text: &str) -> Result<SyncMode> {
    text.parse()
        .map_err(|e| PsError::Shard { addr: addr.to_string(), why: format!("runs an unknown sync mode {e}") })
}
