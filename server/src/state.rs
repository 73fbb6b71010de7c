//! The shard's state and its synchronisation rules, with no transport: what a push, a pull,
//! a registration or a timeout does to the parameters, the optimiser state and the membership.
//! [`crate::service`] receives the bytes and calls in here; waiting (the BSP barrier, the SSP
//! bound) is expressed as the BSP round's progress ([`crate::round`]) and a counter every SSP
//! waiter watches.
//!
//! Over 600 lines: every rule that changes the shard (BSP, ASP, SSP, membership, checkpoints)
//! in one place, since they share the version, staleness and membership they must agree on;
//! the transport lives elsewhere.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;

use gradsync_core::checkpoint::{Checkpoint, CheckpointHeader};
use gradsync_core::heap::zeros;
use gradsync_core::metrics::{Header, HostInfo, MetricsWriter, Record, SCHEMA_VERSION, ServerApply, unix_ms};
use gradsync_core::model::{Fingerprint, Layout, init_params_in};
use gradsync_core::optim::sgd_step;
use gradsync_core::trace::Trace;
use gradsync_proto::frames::{Framed, MessageBuf};
use gradsync_proto::pb::ParameterChunk;
use tokio::sync::watch;

use crate::config::{Config, SyncMode, TableShard};
use crate::error::{Error, Result};
use crate::round::{Committed, Params, Round, Start};
use crate::rows::{RowStore, Rows};

/// What the service hands back for an applied gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Applied {
    /// The version the update produced.
    pub version: u64,
    /// Versions applied between the gradient's base and its update.
    pub staleness: u64,
    /// Milliseconds the push was held waiting for other workers.
    pub wait_ms: f64,
}

/// How an ASP or SSP push arrived: its payload bytes, and how long it took from its first
/// chunk to its last (recorded beside its update: pushes of several ranks arriving at once
/// shared the link into the server).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Arrival {
    /// Payload bytes received.
    pub bytes: u64,
    /// From the first chunk to the last, ms.
    pub receive_ms: f64,
}

/// What never changes while the shard serves, and the counters updated without the lock.
pub struct Shared {
    /// The configuration.
    pub cfg: Config,
    /// This shard's range of the flat buffer (of its dense values, for a model with a sparse
    /// table).
    pub range: Range<usize>,
    /// The sparse table's rows this shard owns, for a model with one.
    pub table: Option<TableShard>,
    /// The flat buffer's length.
    pub total: usize,
    /// The model fingerprint.
    pub fingerprint: Fingerprint,
    /// When the shard started (metrics clock).
    pub started: Instant,
    /// Pull bytes sent since the last update.
    pub bytes_out: AtomicU64,
    /// Gradients refused for NaN or Inf.
    pub rejected_nonfinite: AtomicU64,
    /// Bumped whenever clocks or membership change: SSP waiters watch it.
    pub progress: watch::Sender<u64>,
    /// Spare gradient buffers (one per rank in flight), reused across steps.
    pool: StdMutex<Vec<Vec<f32>>>,
    /// The timeline (`--trace`; disabled without it).
    pub trace: Trace,
}

impl Shared {
    /// A gradient buffer of this shard's length, reused when one is spare.
    pub fn take_buffer(&self) -> Vec<f32> {
        let n = self.range.len();
        let mut v = self.pool.lock().map(|mut p| p.pop()).ok().flatten().unwrap_or_default();
        v.resize(n, 0.0);
        v
    }

    /// Give a gradient buffer back.
    pub fn give_buffer(&self, v: Vec<f32>) {
        if let Ok(mut p) = self.pool.lock() {
            p.push(v);
        }
    }

    fn bump(&self) {
        self.progress.send_modify(|v| *v += 1);
    }
}

/// A registered worker.
#[derive(Debug, Clone)]
struct Member {
    last_seen: Instant,
    /// Gradients of this rank applied (its SSP clock).
    clock: u64,
}

/// The shard's mutable state; lives behind one async mutex.
pub struct State {
    /// Shared read-only with a BSP round while it steps ([`Round`]); replaced at its commit,
    /// after which they live only in the step's wire image until values are needed.
    params: Params,
    momentum: Arc<Vec<f32>>,
    version: u64,
    /// The BSP step in progress (from `version` to `version + 1`), if any push or pull of it
    /// has begun.
    round: Option<Arc<Round>>,
    /// The momentum buffer the last committed round replaced: the next round writes into it.
    spare: Option<Vec<f32>>,
    /// The buffers the current version's image was built in (by the round that made it).
    image_bufs: Vec<MessageBuf>,
    /// Those of the version before: the next round builds its image in them.
    spare_image: Vec<MessageBuf>,
    /// The parameters of `.0`'s version in their wire image (one ParameterChunk message per
    /// chunk), shared (zero-copy) by every pull until the next update; encoded on the first
    /// pull after an update.
    snapshot: Option<(u64, Framed)>,
    /// The digest of the parameters at `.0`'s version ([`State::digest`]).
    digest: Option<(u64, Option<[u8; 32]>)>,
    world: Option<usize>,
    members: BTreeMap<usize, Member>,
    departed: BTreeSet<usize>,
    /// Ranks that came back ([`State::rejoin`]) and are expected only from the step built on
    /// this version on.
    joining: BTreeMap<usize, u64>,
    /// SSP: each held push's rank and the slowest rank it is held for, so the update that
    /// releases it can name the straggler (`waited_for`).
    ssp_held: BTreeMap<usize, usize>,
    metrics: Option<MetricsWriter>,
    last_checkpoint: u64,
    closing: bool,
    /// The sparse table's rows this shard owns, updated in place (they never travel whole).
    rows: Option<RowStore>,
}

/// The largest world size a registration may declare: the barrier walks every expected rank,
/// so a peer must not be able to make that walk billions long.
pub const MAX_WORLD: usize = 1 << 16;

/// Where a pull's parameters come from.
pub enum PullSource {
    /// A version already applied, and its wire image.
    Ready(u64, Framed),
    /// The BSP round producing the next version: stream its blocks as they are stepped.
    Round(Arc<Round>),
}

/// What a registration tells the worker.
#[derive(Debug, Clone, Copy)]
pub struct Registered {
    /// The server's version.
    pub version: u64,
    /// The version the rank's first gradient must be computed from.
    pub join: u64,
}

impl State {
    /// Initial parameters from the model and seed, or the checkpoint with `resume`; opens the
    /// metrics file.
    pub fn new(cfg: Config) -> Result<(Shared, State)> {
        let layout = Layout::new(&cfg.spec);
        let total = layout.len;
        let split = cfg.shard.split(&layout)?;
        let (mut range, table) = (split.dense, split.rows);
        if cfg.table_only {
            // The workers all-reduce the rest among themselves (`--mode hybrid`).
            range = range.start..range.start;
        }
        let fingerprint = cfg.fingerprint();
        let (params, momentum, version) = match (&cfg.checkpoint, cfg.resume) {
            (Some(path), true) => {
                let ck = Checkpoint::load(path)?;
                fingerprint.check(&ck.header.fingerprint)?;
                if ck.header.start != range.start || ck.header.end != range.end {
                    return Err(Error::invalid(
                        "--resume",
                        format!(
                            "{} holds values {}..{}, shard {}/{} owns {}..{}",
                            path.display(),
                            ck.header.start,
                            ck.header.end,
                            cfg.shard.index,
                            cfg.shard.count,
                            range.start,
                            range.end
                        ),
                    ));
                }
                let n = range.len();
                (ck.params, ck.momentum.unwrap_or_else(|| zeros(n)), ck.header.step)
            }
            _ => (init_params_in(&layout, cfg.seed, range.clone()), zeros(range.len()), 0),
        };
        let rows = match (&table, &cfg.checkpoint, cfg.resume) {
            (None, ..) => None,
            (Some(t), Some(path), true) => Some(resume_rows(path, t, &fingerprint, version)?),
            (Some(t), ..) => {
                let flat = t.flat();
                Some(RowStore::new(t.dim, init_params_in(&layout, cfg.seed, flat.clone()), zeros(flat.len())))
            }
        };
        let metrics = match &cfg.metrics {
            Some(path) => {
                let mut w = MetricsWriter::create(path)?.dilated(cfg.dilation);
                w.write(&Record::Header(header(&cfg, total, &range, &fingerprint)))?;
                Some(w)
            }
            None => None,
        };
        let shared = Shared {
            range,
            table,
            total,
            fingerprint,
            started: Instant::now(),
            bytes_out: AtomicU64::new(0),
            rejected_nonfinite: AtomicU64::new(0),
            progress: watch::channel(0).0,
            pool: StdMutex::new(Vec::new()),
            trace: if cfg.trace.is_some() { Trace::new(1000 + cfg.shard.index) } else { Trace::disabled() },
            cfg,
        };
        let state = State {
            params: Params::from_values(params),
            momentum: Arc::new(momentum),
            version,
            round: None,
            spare: None,
            image_bufs: Vec::new(),
            spare_image: Vec::new(),
            snapshot: None,
            digest: None,
            world: None,
            members: BTreeMap::new(),
            departed: BTreeSet::new(),
            joining: BTreeMap::new(),
            ssp_held: BTreeMap::new(),
            metrics,
            last_checkpoint: version,
            closing: false,
            rows,
        };
        Ok((shared, state))
    }

    /// Updates applied so far.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// SHA-256 of the parameters at the current version, over their little-endian bits
    /// ([`gradsync_proto::wire::Digest`], what a registration reply says), computed once a
    /// version; `None` where a step's image holds them in chunks that do not run in order.
    pub fn digest(&mut self) -> Option<[u8; 32]> {
        if let Some((v, d)) = self.digest
            && v == self.version
        {
            return d;
        }
        let mut d = gradsync_proto::wire::Digest::default();
        let made = match self.params.image() {
            Some(f) => {
                let mut at = 0u64;
                (0..f.len()).all(|i| {
                    let (offset, payload) = f.payload(i);
                    d.payload(&payload);
                    let next = offset == at;
                    at += payload.len() as u64 / 4;
                    next
                })
            }
            None => {
                d.values(self.params.values());
                true
            }
        };
        let d = made.then(|| d.finish());
        self.digest = Some((self.version, d));
        d
    }

    /// The registered ranks.
    pub fn live_ranks(&self) -> Vec<usize> {
        self.members.keys().copied().collect()
    }

    /// Whether shutdown has begun.
    pub fn closing(&self) -> bool {
        self.closing
    }

    /// Ranks the run expects: every rank of the world that has not left or been dropped.
    fn expected(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world.unwrap_or(0))
            .filter(|r| !self.departed.contains(r))
            .filter(|r| self.joining.get(r).is_none_or(|&from| self.version >= from))
    }

    /// `rank` joins as one of `world` with the model `fingerprint`.
    pub fn register(
        &mut self,
        sh: &Shared,
        rank: usize,
        world: usize,
        fingerprint: &str,
    ) -> Result<Registered> {
        if self.closing {
            return Err(Error::ShuttingDown);
        }
        if fingerprint != sh.fingerprint.text {
            return Err(Error::Fingerprint {
                rank,
                server: sh.fingerprint.text.clone(),
                worker: crate::error::abbreviate(fingerprint),
            });
        }
        if world > MAX_WORLD {
            return Err(Error::Membership(format!(
                "world size {world} is above the most supported, {MAX_WORLD}"
            )));
        }
        if world == 0 || rank >= world {
            return Err(Error::Membership(format!("rank {rank} is not below the world size {world}")));
        }
        if let Some(w) = self.world.filter(|&w| w != world) {
            return Err(Error::Membership(format!("world size {world} differs from the run's {w}")));
        }
        if self.members.contains_key(&rank) {
            return Err(Error::AlreadyRegistered(rank));
        }
        if self.departed.contains(&rank) {
            return Err(Error::Membership(format!(
                "rank {rank} left this run or was dropped as dead; it cannot rejoin until every rank has left"
            )));
        }
        self.world = Some(world);
        // A rank joining late starts at the slowest live clock, so SSP does not stall on it.
        let clock = self.members.values().map(|m| m.clock).min().unwrap_or(0);
        self.members.insert(rank, Member { last_seen: Instant::now(), clock });
        sh.bump();
        tracing::info!(rank, world, version = self.version, "registered");
        Ok(Registered { version: self.version, join: self.version })
    }

    /// `rank` comes back after its process was restarted (`--resume`). A rank still
    /// registered (it died without leaving) is taken back in place: whatever it had pushed
    /// into the step in progress is thrown away (that process is gone; the new one pushes the
    /// step again) and the step keeps waiting for it. A rank that left or was dropped joins
    /// again at the next step: a step already under way does not wait for it. `join_at` (0:
    /// none) defers the rank to that version's step, so that every shard expects it from the
    /// same one. Anything else is an ordinary [`State::register`].
    pub fn rejoin(
        &mut self,
        sh: &Shared,
        rank: usize,
        world: usize,
        fingerprint: &str,
        join_at: u64,
    ) -> Result<Registered> {
        if self.closing {
            return Err(Error::ShuttingDown);
        }
        // Out of the membership for the ordinary checks (fingerprint, world), back on failure.
        let member = self.members.remove(&rank);
        let departed = self.departed.remove(&rank);
        if let Err(e) = self.register(sh, rank, world, fingerprint) {
            if let Some(m) = member {
                self.members.insert(rank, m);
            }
            if departed {
                self.departed.insert(rank);
            }
            return Err(e);
        }
        let open = self.round.clone().filter(|r| !r.ended());
        if member.is_some()
            && let Some(round) = &open
        {
            round.remove(rank);
        }
        // A step under way waits for a returning member (it is expected there), not for a
        // rank that had left (it is not).
        let mut join = if departed && open.is_some() { self.version + 1 } else { self.version };
        join = join.max(join_at);
        if join > self.version {
            self.joining.insert(rank, join);
        } else {
            self.joining.remove(&rank);
        }
        if let Some(round) = open
            && round.set_expected(self.expected().collect())
        {
            self.commit(sh);
        }
        tracing::warn!(
            rank,
            version = self.version,
            join,
            "rank {rank} came back ({}); its gradients are expected from version {join} on",
            if member.is_some() { "its process was restarted" } else { "it had left or was dropped" }
        );
        sh.bump();
        Ok(Registered { version: self.version, join })
    }

    /// Note that `rank` is alive; errors if it is not registered.
    pub fn touch(&mut self, rank: usize) -> Result<()> {
        if self.closing {
            return Err(Error::ShuttingDown);
        }
        let m = self.members.get_mut(&rank).ok_or(Error::NotRegistered(rank))?;
        m.last_seen = Instant::now();
        Ok(())
    }

    /// `rank` leaves; a BSP step waiting only for it goes ahead.
    pub fn deregister(&mut self, sh: &Shared, rank: usize) -> Result<()> {
        self.members.remove(&rank).ok_or(Error::NotRegistered(rank))?;
        self.departed.insert(rank);
        tracing::info!(rank, version = self.version, "deregistered");
        self.after_departure(sh);
        Ok(())
    }

    fn after_departure(&mut self, sh: &Shared) {
        if let Some(round) = self.round.clone()
            && round.set_expected(self.expected().collect())
        {
            self.commit(sh);
        }
        if self.members.is_empty() && !self.round.as_ref().is_some_and(|r| r.any_rank()) {
            // Everyone left: the next run may register afresh (another world size included).
            self.world = None;
            self.departed.clear();
            // A round only a streamed pull opened would wait for ranks of the old run.
            if let Some(round) = self.round.take() {
                round.fail(Error::Abandoned { version: round.version });
            }
        }
        sh.bump();
    }

    /// The BSP step from the current version, started if no push or pull of it has begun.
    fn round(&mut self, sh: &Shared) -> Arc<Round> {
        if let Some(r) = &self.round {
            return r.clone();
        }
        let start = Start {
            params: self.params.clone(),
            momentum: self.momentum.clone(),
            next_momentum: self.spare.take().unwrap_or_default(),
            image_bufs: std::mem::take(&mut self.spare_image),
        };
        let r = Arc::new(
            Round::new(
                self.version + 1,
                start,
                sh.cfg.tuning.chunk_bytes,
                sh.cfg.sgd,
                self.expected().collect(),
            )
            .with_rows(self.rows.is_some()),
        );
        self.round = Some(r.clone());
        r
    }

    /// `rank` starts pushing a BSP gradient computed from version `base`: the round it feeds.
    pub fn join_round(&mut self, sh: &Shared, rank: usize, base: u64) -> Result<Arc<Round>> {
        self.touch(rank)?;
        if base != self.version {
            return Err(Error::Stale { rank, base, version: self.version });
        }
        let round = self.round(sh);
        round.join(rank)?;
        Ok(round)
    }

    /// `rank` pushes rows of a sparse table computed from version `base` (BSP): the round
    /// they belong to (its dense push joins the same one).
    pub fn rows_round(&mut self, sh: &Shared, rank: usize, base: u64) -> Result<Arc<Round>> {
        self.touch(rank)?;
        if self.rows.is_none() {
            return Err(no_table(rank));
        }
        if base != self.version {
            return Err(Error::Stale { rank, base, version: self.version });
        }
        Ok(self.round(sh))
    }

    /// What a pull asking for `want` (BSP, streamed) gets: the current snapshot if `want` is
    /// the current version (or absent), or the round producing it if it is the next one.
    pub fn pull_source(&mut self, sh: &Shared, want: Option<u64>) -> Result<PullSource> {
        match want {
            Some(v) if sh.cfg.sync == SyncMode::Bsp && v == self.version + 1 => {
                if self.closing {
                    return Err(Error::ShuttingDown);
                }
                Ok(PullSource::Round(self.round(sh)))
            }
            Some(v) if v > self.version + 1 => Err(Error::Membership(format!(
                "a pull of version {v} streamed: the server is at version {}, only it or the next can be asked for",
                self.version
            ))),
            _ => {
                let t = Instant::now();
                let encoded = !matches!(&self.snapshot, Some((v, _)) if *v == self.version);
                let (v, f) = self.snapshot(sh.cfg.tuning.chunk_bytes);
                if encoded {
                    sh.trace.span(format!("encode v{v}"), "encode", "pulls", t);
                }
                Ok(PullSource::Ready(v, f))
            }
        }
    }

    /// Commit the BSP round if it is complete: the next buffers become the current ones, the
    /// version goes up, and every push and pull of it is told. True if it committed.
    pub fn commit(&mut self, sh: &Shared) -> bool {
        let Some(round) = self.round.clone() else { return false };
        let Some(fin) = round.finish() else { return false };
        self.round = None;
        let t0 = Instant::now();
        // The table's rows, in place: the sum of what each rank pushed, as the dense values.
        if let Some(store) = &mut self.rows {
            let pushes: Vec<&Rows> = fin.rows.iter().collect();
            store.step_sum(&sh.cfg.sgd, &pushes, 1.0 / fin.ranks.len().max(1) as f32);
        }
        let image = Framed::from_chunks(fin.image);
        self.params = Params::from_image(image.clone());
        // The image before this one is where the next round writes (pulls of it permitting).
        self.spare_image = std::mem::replace(&mut self.image_bufs, fin.image_bufs);
        let old_m = std::mem::replace(&mut self.momentum, Arc::new(fin.momentum));
        // The round let go of its reference in `finish`.
        self.spare = Arc::try_unwrap(old_m).ok();
        self.version += 1;
        self.snapshot = Some((self.version, image));
        let last_began = fin.last_began;
        let mut done = fin.ranks;
        let n = done.len();
        for (rank, ..) in &done {
            if let Some(m) = self.members.get_mut(rank) {
                m.clock += 1;
            }
        }
        let ranks: Vec<usize> = done.iter().map(|d| d.0).collect();
        done.sort_by_key(|d| d.1);
        let (first_at, last) = (done[0].1, done[n - 1]);
        let args = |k: &str, v: serde_json::Value| serde_json::Map::from_iter([(k.to_string(), v)]);
        sh.trace.span_with(
            format!("wait for pushes v{}", self.version),
            "wait",
            "rounds",
            first_at,
            last.1,
            args("gradients", n.into()),
        );
        // Summing and stepping ran block by block as the gradients arrived; this is what was
        // left after the last one: its last blocks and the swap.
        sh.trace.span_with(
            format!("apply v{}", self.version),
            "update",
            "rounds",
            last.1,
            Instant::now(),
            args("ranks", n.into()),
        );
        let rec = ServerApply {
            shard: sh.cfg.shard.index,
            version: self.version,
            wall_ms: ms(sh.started.elapsed()),
            gradients: n,
            ranks: ranks.clone(),
            staleness: vec![0; n],
            queue_wait_ms: ms(last.1 - first_at),
            // Summing and stepping ran block by block while the gradients arrived; what is
            // left after the last one is its last block and this swap.
            aggregate_ms: 0.0,
            apply_ms: ms(t0 - last.1),
            bytes_in: done.iter().map(|d| d.2).sum(),
            bytes_out: sh.bytes_out.swap(0, Ordering::Relaxed),
            waited_for: (n > 1).then_some(last.0),
            receive_ms: None,
        };
        self.after_update(sh, rec);
        round.committed(Committed { version: self.version, at: Instant::now(), ranks, last_began });
        true
    }

    /// An ASP or SSP gradient: applied at once, as one worker's mean gradient.
    pub fn apply_now(
        &mut self,
        sh: &Shared,
        rank: usize,
        base: u64,
        grad: Vec<f32>,
        how: Arrival,
    ) -> Result<Applied> {
        self.touch(rank)?;
        if base > self.version {
            return Err(Error::BadGradient {
                rank,
                why: format!("computed from version {base}, the server is only at {}", self.version),
            });
        }
        let staleness = self.version - base;
        let t = Instant::now();
        let (p, m) = (Arc::make_mut(self.params.values()), Arc::make_mut(&mut self.momentum));
        sgd_step(&sh.cfg.sgd, p, &grad, m, sh.cfg.staleness_lr.scale(staleness));
        sh.give_buffer(grad);
        sh.trace.span_with(
            format!("apply rank {rank}"),
            "update",
            "updates",
            t,
            Instant::now(),
            serde_json::Map::from_iter([("staleness".to_string(), serde_json::json!(staleness))]),
        );
        self.version += 1;
        let apply_ms = ms(t.elapsed());
        if let Some(m) = self.members.get_mut(&rank) {
            m.clock += 1;
        }
        let rec = ServerApply {
            shard: sh.cfg.shard.index,
            version: self.version,
            wall_ms: ms(sh.started.elapsed()),
            gradients: 1,
            ranks: vec![rank],
            staleness: vec![staleness],
            queue_wait_ms: 0.0,
            aggregate_ms: 0.0,
            apply_ms,
            bytes_in: how.bytes,
            bytes_out: sh.bytes_out.swap(0, Ordering::Relaxed),
            // Under SSP, an update from the rank a held push waits for is what the wait
            // was for: name that straggler.
            waited_for: self.ssp_held.values().any(|b| *b == rank).then_some(rank),
            receive_ms: Some(how.receive_ms),
        };
        self.after_update(sh, rec);
        Ok(Applied { version: self.version, staleness, wait_ms: 0.0 })
    }

    /// An ASP or SSP push of a sparse table's rows from `rank`, computed from version `base`:
    /// applied at once, scaled for its staleness as the dense gradient is. Returns the rows
    /// that changed.
    pub fn apply_rows_now(&mut self, sh: &Shared, rank: usize, base: u64, rows: &Rows) -> Result<usize> {
        self.touch(rank)?;
        if base > self.version {
            return Err(Error::BadGradient {
                rank,
                why: format!("rows computed from version {base}, the server is only at {}", self.version),
            });
        }
        let scale = sh.cfg.staleness_lr.scale(self.version - base);
        let store = self.rows.as_mut().ok_or_else(|| no_table(rank))?;
        Ok(store.step_one(&sh.cfg.sgd, rows, scale))
    }

    /// The current version and the values of rows `ids` as little-endian bytes, appended to
    /// `out`.
    pub fn read_rows(&self, rank: usize, ids: &[u32], out: &mut Vec<u8>) -> Result<u64> {
        self.rows.as_ref().ok_or_else(|| no_table(rank))?.read(ids, out);
        Ok(self.version)
    }

    fn after_update(&mut self, sh: &Shared, rec: ServerApply) {
        if let Some(m) = self.metrics.as_mut()
            && let Err(e) = m.write(&Record::ServerApply(rec))
        {
            tracing::warn!("metrics: {e}");
        }
        let every = sh.cfg.checkpoint_every;
        if every > 0
            && self.version.is_multiple_of(every)
            && let Err(e) = self.checkpoint(sh)
        {
            tracing::error!("checkpoint at version {} failed: {e}", self.version);
        }
        sh.bump();
    }

    /// The ranks `rank` is waiting for under SSP with bound `s` (empty: it may go on). Ranks
    /// expected but not yet registered count as clock 0.
    pub fn ssp_blockers(&self, rank: usize, s: u64) -> Vec<usize> {
        let mine = self.members.get(&rank).map_or(0, |m| m.clock);
        self.expected()
            .filter(|r| *r != rank)
            .filter(|r| mine.saturating_sub(self.members.get(r).map_or(0, |m| m.clock)) > s)
            .collect()
    }

    /// Note that `rank`'s push is held under SSP, for `blockers` (empty: released). The
    /// slowest blocker is the one whose next update the metrics attribute the wait to.
    pub fn ssp_hold(&mut self, rank: usize, blockers: &[usize]) {
        let slowest = blockers.iter().copied().min_by_key(|r| self.members.get(r).map_or(0, |m| m.clock));
        match slowest {
            Some(b) => self.ssp_held.insert(rank, b),
            None => self.ssp_held.remove(&rank),
        };
    }

    /// The BSP step from `base` did not gather every gradient within the worker timeout. With
    /// `elastic`, drop the missing ranks and apply what arrived; otherwise fail the step with
    /// an error naming them. Nothing happens if that step is already done.
    pub fn barrier_timeout(&mut self, sh: &Shared, base: u64) {
        let Some(round) = self.round.clone().filter(|r| r.version == base + 1 && !r.ended()) else {
            return;
        };
        let (missing, refused) = round.missing();
        let what = if refused.is_empty() {
            "sent no gradient for the BSP step".to_string()
        } else {
            format!("sent no gradient for the BSP step (refused for NaN or Inf: {refused:?})")
        };
        self.give_up_on(sh, missing, refused, base + 1, &what);
    }

    /// Drop (elastic) or fail on (strict) `missing` ranks, which did not do `what` within the
    /// worker timeout (`refused`, a subset, sent only a gradient refused for NaN or Inf).
    pub fn give_up_on(
        &mut self,
        sh: &Shared,
        missing: Vec<usize>,
        refused: Vec<usize>,
        step: u64,
        what: &str,
    ) {
        if missing.is_empty() {
            return;
        }
        if sh.cfg.elastic {
            for r in &missing {
                self.members.remove(r);
                self.departed.insert(*r);
            }
            // At the default log level: an elastic run shrinking is news its user must see.
            let remain: Vec<usize> = self.members.keys().copied().collect();
            tracing::warn!(
                "dropping workers that missed the timeout: rank(s) {missing:?} {what} within --worker-timeout \
                 {} s (step {step}); {} worker(s) remain: {remain:?}",
                sh.cfg.worker_timeout.as_secs_f64(),
                remain.len()
            );
            self.after_departure(sh);
        } else {
            tracing::warn!(?missing, version = self.version, "step failed: workers missed the timeout");
            let err = || Error::missing(step, &missing, &refused, sh.cfg.worker_timeout);
            if let Some(round) = self.round.take() {
                round.fail(err());
            }
            sh.bump();
        }
    }

    /// Elastic mode: drop every registered rank silent for longer than the worker timeout. A
    /// rank whose push the server itself is holding (BSP barrier, SSP bound) is not silent:
    /// it is waiting for the others.
    pub fn reap(&mut self, sh: &Shared) {
        let now = Instant::now();
        let silent: Vec<usize> = self
            .members
            .iter()
            .filter(|(r, _)| {
                !self.round.as_ref().is_some_and(|round| round.has(**r)) && !self.ssp_held.contains_key(r)
            })
            .filter(|(_, m)| now - m.last_seen > sh.cfg.worker_timeout)
            .map(|(r, _)| *r)
            .collect();
        if !silent.is_empty() && sh.cfg.elastic {
            let step = self.version + 1;
            self.give_up_on(sh, silent, Vec::new(), step, "sent nothing (no request, no heartbeat)");
        }
    }

    /// The parameters as ParameterChunk messages in chunks of `chunk_bytes`, encoded once per
    /// version and shared by every pull of that version.
    pub fn snapshot(&mut self, chunk_bytes: usize) -> (u64, Framed) {
        match &self.snapshot {
            Some((v, f)) if *v == self.version => (*v, f.clone()),
            _ => {
                let version = self.version;
                let head = |offset| ParameterChunk { version, offset, ..ParameterChunk::default() };
                // (A BSP commit sets the snapshot to the image it made, so an image is never
                // encoded again here.)
                let f = Framed::encode(
                    self.params.values(),
                    chunk_bytes,
                    gradsync_proto::tag::PARAMETER_DATA,
                    head,
                );
                self.snapshot = Some((version, f.clone()));
                (version, f)
            }
        }
    }

    /// Write the checkpoint (parameters, momentum, version) atomically, when configured.
    pub fn checkpoint(&mut self, sh: &Shared) -> Result<()> {
        let Some(path) = &sh.cfg.checkpoint else { return Ok(()) };
        let ck = Checkpoint {
            header: CheckpointHeader {
                fingerprint: sh.fingerprint.text.clone(),
                step: self.version,
                start: sh.range.start,
                end: sh.range.end,
                has_momentum: true,
                version: gradsync_core::VERSION.into(),
            },
            // Moved out and back rather than cloned: a shard may hold hundreds of MB (no copy
            // unless a round still shares them).
            params: std::mem::take(Arc::make_mut(self.params.values())),
            momentum: Some(std::mem::take(Arc::make_mut(&mut self.momentum))),
        };
        let result = ck.save(path);
        self.params = Params::from_values(ck.params);
        self.momentum = Arc::new(ck.momentum.unwrap_or_default());
        result?;
        if let (Some(store), Some(t)) = (&self.rows, &sh.table) {
            // Beside the dense values, with the same version: a resume checks that they agree.
            let (params, momentum) = store.parts();
            let flat = t.flat();
            Checkpoint {
                header: CheckpointHeader {
                    fingerprint: sh.fingerprint.text.clone(),
                    step: self.version,
                    start: flat.start,
                    end: flat.end,
                    has_momentum: true,
                    version: gradsync_core::VERSION.into(),
                },
                params: params.to_vec(),
                momentum: Some(momentum.to_vec()),
            }
            .save(&rows_checkpoint(path))?;
        }
        self.last_checkpoint = self.version;
        tracing::info!(version = self.version, path = %path.display(), "checkpoint written");
        Ok(())
    }

    /// Stop: refuse new work and fail every waiting push.
    pub fn close(&mut self, sh: &Shared) {
        self.closing = true;
        if let Some(round) = self.round.take() {
            round.fail(Error::ShuttingDown);
        }
        sh.bump();
    }

    /// Version of the last checkpoint written (or resumed from).
    pub fn last_checkpoint(&self) -> u64 {
        self.last_checkpoint
    }
}

/// Where a shard with a sparse table keeps its rows' checkpoint: beside the dense one.
pub fn rows_checkpoint(path: &std::path::Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".rows");
    p.into()
}

/// The rows of `t` from the checkpoint beside `path`, which must hold exactly them at
/// `version` (the dense checkpoint's).
fn resume_rows(path: &std::path::Path, t: &TableShard, fp: &Fingerprint, version: u64) -> Result<RowStore> {
    let at = rows_checkpoint(path);
    let ck = Checkpoint::load(&at)?;
    fp.check(&ck.header.fingerprint)?;
    let flat = t.flat();
    if ck.header.start != flat.start || ck.header.end != flat.end {
        return Err(Error::invalid(
            "--resume",
            format!(
                "{} holds table values {}..{}, this shard owns rows {}..{} (values {}..{})",
                at.display(),
                ck.header.start,
                ck.header.end,
                t.rows.start,
                t.rows.end,
                flat.start,
                flat.end
            ),
        ));
    }
    if ck.header.step != version {
        return Err(Error::invalid(
            "--resume",
            format!(
                "{} is of version {}, {} of version {}: a checkpoint interrupted between its two files",
                at.display(),
                ck.header.step,
                path.display(),
                version
            ),
        ));
    }
    let n = ck.params.len();
    Ok(RowStore::new(t.dim, ck.params, ck.momentum.unwrap_or_else(|| zeros(n))))
}

fn no_table(rank: usize) -> Error {
    Error::BadGradient { rank, why: "rows of a sparse table, and the server's model has none".into() }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn header(cfg: &Config, total: usize, range: &Range<usize>, fp: &Fingerprint) -> Header {
    let host = HostInfo::detect();
    let mut extra = serde_json::Map::new();
    extra.insert("shard".into(), cfg.shard.index.into());
    extra.insert("shards".into(), cfg.shard.count.into());
    extra.insert("start".into(), range.start.into());
    extra.insert("end".into(), range.end.into());
    extra.insert("worker_timeout_s".into(), cfg.worker_timeout.as_secs_f64().into());
    extra.insert("elastic".into(), cfg.elastic.into());
    extra.insert("checkpoint_every".into(), cfg.checkpoint_every.into());
    extra.insert("transport".into(), cfg.tuning.name.into());
    extra.insert("staleness_lr".into(), cfg.staleness_lr.name().into());
    extra.insert("chunk_bytes".into(), cfg.tuning.chunk_bytes.into());
    extra.insert("compression".into(), cfg.compression.to_string().into());
    Header {
        schema: SCHEMA_VERSION,
        mode: "server".into(),
        variant: cfg.sync.to_string(),
        device: "cpu".into(),
        preset: cfg.spec.name.clone(),
        widths: cfg.spec.widths_str(),
        params: total,
        seed: cfg.seed,
        data: cfg.data.clone(),
        fingerprint: fp.text.clone(),
        lr: cfg.sgd.lr,
        momentum: cfg.sgd.momentum,
        weight_decay: cfg.sgd.weight_decay,
        gradsync_version: gradsync_core::VERSION.into(),
        host: host.host,
        cores: host.cores,
        start_unix_ms: unix_ms(),
        extra,
        ..Header::default()
    }
}
