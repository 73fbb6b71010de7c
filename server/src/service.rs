//! The gRPC edge: receives chunk streams, checks the token, calls [`crate::state`], and turns
//! [`crate::Error`] into a `tonic::Status`. Nothing here decides what an update is.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gradsync_core::compress::{self, Compression, Half};
use gradsync_proto::frames::{Framed, FramedChunk, Incoming};
use gradsync_proto::pb::Encoding;
use gradsync_proto::pb::parameter_server_server::ParameterServer;
use gradsync_proto::pb::{
    DeregisterReply, DeregisterRequest, GradientChunk, HeartbeatReply, HeartbeatRequest, ParameterChunk,
    PullRequest, PullRowsRequest, PushReply, PushRowsReply, RegisterReply, RegisterRequest, RowChunk,
    ShutdownReply, ShutdownRequest, VersionReply, VersionRequest,
};
use gradsync_proto::wire;
use tokio::sync::{Mutex, mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::config::SyncMode;
use crate::error::{Error, Result};
use crate::round::{Committed, Round};
use crate::rows::{Rows, RowsError, decode_ids};
use crate::state::{Arrival, PullSource, Shared, State};

/// The service: the shared configuration, the state behind one async mutex, and the stop
/// switch the Shutdown RPC pulls.
#[derive(Clone)]
pub struct Service {
    /// Immutable configuration and lock-free counters.
    pub shared: Arc<Shared>,
    /// The mutable state.
    pub state: Arc<Mutex<State>>,
    /// Set to `true` to stop serving.
    pub stop: Arc<watch::Sender<bool>>,
}

fn rank_of(r: u32) -> usize {
    r as usize
}

/// How long a committed round held a push (which began at `began` and was whole at `arrived`)
/// for workers that began theirs later: the straggler's share of the hold. The rest of it went
/// on bytes already on their way, which is the exchange, not waiting: with servers on the
/// workers' hosts a worker's own shard is whole at once and then holds it for every other
/// worker's bytes through that host's link, the whole exchange, and none of that is a
/// straggler's.
fn held_for_later_pushes(c: &Committed, began: Option<Instant>, arrived: Instant) -> Duration {
    let held = c.at.saturating_duration_since(arrived);
    match (began, c.last_began) {
        (Some(b), Some(last)) => held.min(last.saturating_duration_since(b)),
        _ => held,
    }
}

impl Service {
    /// Run `f` on the state on a blocking thread: updates sum and step hundreds of MB.
    async fn with_state<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State, &Shared) -> T + Send + 'static,
    ) -> Result<T> {
        let mut guard = self.state.clone().lock_owned().await;
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || f(&mut guard, &shared))
            .await
            .map_err(|e| Error::invalid("server task", e.to_string()))
    }

    /// Receive one gradient stream into a buffer of this shard's length. Returns the rank,
    /// base version, buffer and payload bytes.
    async fn receive(&self, mut stream: Incoming<GradientChunk>) -> Result<Received, Status> {
        let first = self.first_chunk(&mut stream).await?;
        let arriving = Instant::now();
        let (rank, base) = (rank_of(first.rank), first.base_version);
        self.state.lock().await.touch(rank)?;
        let mut grad = self.shared.take_buffer();
        let got = self.read(rank, base, first, stream, wire::Reassembly::new(&mut grad), |_, _| true).await;
        match got {
            Ok(bytes) => {
                let how = Arrival { bytes, receive_ms: arriving.elapsed().as_secs_f64() * 1e3 };
                Ok(Received { rank, base, grad, how })
            }
            Err(e) => {
                self.shared.give_buffer(grad);
                Err(e)
            }
        }
    }

    /// Read `rank`'s chunks into `asm` one by one (order, length, and finiteness where `asm`
    /// reads the values), handing each checked one to `each` with its offset in values; `each`
    /// returning false means the values were found to hold NaN or Inf. Returns the payload
    /// bytes.
    async fn read(
        &self,
        rank: usize,
        base: u64,
        first: GradientChunk,
        mut stream: Incoming<GradientChunk>,
        mut asm: wire::Reassembly<'_>,
        mut each: impl FnMut(usize, bytes::Bytes) -> bool,
    ) -> Result<u64, Status> {
        let len = self.shared.range.len();
        let bad = |why: wire::StreamError| Error::BadGradient {
            rank,
            why: format!("{why} (this shard's range holds {len} values)"),
        };
        let mut chunk = Some(first);
        let mut wire = 0u64;
        while let Some(c) = chunk {
            if rank_of(c.rank) != rank || c.base_version != base {
                return Err(Error::BadGradient {
                    rank,
                    why: "rank or base version changes mid-stream".into(),
                }
                .into());
            }
            wire += (c.data.len() + c.indices.len()) as u64;
            let (at, offset) = (asm.received(), c.offset);
            let data = dense(&self.shared, rank, at, c)?;
            asm.push(offset, &data).map_err(bad)?;
            if !asm.finite() || !each(at, data) {
                return Err(self.refuse_nonfinite(rank));
            }
            chunk = self.next_chunk(Some(rank), &mut stream).await?;
        }
        asm.finish().map_err(bad)?;
        Ok(wire)
    }

    /// Count a gradient refused for NaN or Inf; the status that says so.
    fn refuse_nonfinite(&self, rank: usize) -> Status {
        self.shared.rejected_nonfinite.fetch_add(1, Ordering::Relaxed);
        Error::NonFinite { rank }.into()
    }

    /// A BSP push, pipelined: each piece checked for order and length goes into the step's
    /// [`Round`] as it arrives (which steps every block it completes, checking the values as
    /// it sums them); the reply comes when the round commits or fails, or when this rank's
    /// gradient is refused for NaN or Inf.
    async fn push_bsp(&self, mut stream: Incoming<GradientChunk>) -> Result<PushReply, Status> {
        let first = self.first_chunk(&mut stream).await?;
        let (rank, base) = (rank_of(first.rank), first.base_version);
        let round = self.state.lock().await.join_round(&self.shared, rank, base)?;
        let (serial, began) = (round.serial(rank), round.began(rank));
        let check = wire::Reassembly::checking(self.shared.range.len());
        let fed = self.read(rank, base, first, stream, check, |at, data| round.add(rank, at, data)).await;
        let bytes = match fed {
            Ok(b) => b,
            Err(e) => {
                // Withdrawn: blocks already stepped with it are thrown away (unless this rank's
                // restarted process has pushed again meanwhile).
                round.remove_push(rank, serial);
                return Err(e);
            }
        };
        // What of the gradient still waits for other ranks' blocks is checked now, so that a
        // NaN or Inf is refused whether or not the others ever send (with one worker, or the
        // last to finish, nothing is left to check here).
        if round.refuse_if_non_finite(rank) {
            return Err(self.refuse_nonfinite(rank));
        }
        let arrived = Instant::now();
        if round.done(rank, bytes) {
            self.with_state(|st, sh| st.commit(sh)).await?;
        }
        let mut rx = round.subscribe();
        let timeout = self.shared.cfg.worker_timeout;
        let ended = |p: &crate::round::Progress| p.end.is_some() || p.refused.contains(&rank);
        let outcome = |p: &crate::round::Progress| (p.refused.contains(&rank), p.end.clone());
        let first_wait = tokio::time::timeout(timeout, rx.wait_for(ended)).await;
        let (refused, end) = match first_wait.map(|p| p.map(|p| outcome(&p)).ok()) {
            Ok(seen) => seen.unwrap_or((false, None)),
            Err(_) => {
                self.with_state(move |st, sh| st.barrier_timeout(sh, base)).await?;
                let again = tokio::time::timeout(timeout, rx.wait_for(ended)).await;
                again.ok().and_then(|p| p.map(|p| outcome(&p)).ok()).unwrap_or((false, None))
            }
        };
        if refused {
            return Err(self.refuse_nonfinite(rank));
        }
        match end {
            Some(Ok(c)) if c.ranks.contains(&rank) => Ok(PushReply {
                version: c.version,
                staleness: 0,
                wait_ms: held_for_later_pushes(&c, began, arrived).as_secs_f64() * 1e3,
            }),
            Some(Ok(c)) => Err(Status::aborted(format!(
                "rank {rank} was dropped from step {} before it completed; its gradient is not in it",
                c.version
            ))),
            Some(Err(e)) => Err(Status::from(&*e)),
            None => {
                let (missing, refused) = round.missing();
                Err(Error::missing(base + 1, &missing, &refused, timeout).into())
            }
        }
    }

    /// A push's first chunk (it names the rank and base version); an empty stream is refused.
    async fn first_chunk(&self, stream: &mut Incoming<GradientChunk>) -> Result<GradientChunk, Status> {
        self.next_chunk(None, stream)
            .await?
            .ok_or_else(|| Error::BadGradient { rank: 0, why: "empty stream".into() }.into())
    }

    /// The next chunk of a push (from `rank`, once its first chunk named it), within the
    /// worker timeout: a sender that goes silent, before its first chunk or mid-stream, must
    /// not hold a stream, a shard-sized buffer or a step for longer. (This waits only for the
    /// client's bytes: nothing here waits for other workers.)
    async fn next_chunk(
        &self,
        rank: Option<usize>,
        stream: &mut Incoming<GradientChunk>,
    ) -> Result<Option<GradientChunk>, Status> {
        let timeout = self.shared.cfg.worker_timeout;
        tokio::time::timeout(timeout, stream.message()).await.map_err(|_| match rank {
            Some(rank) => Error::BadGradient {
                rank,
                why: format!("stream stalled for {} s before the range was full", timeout.as_secs_f64()),
            },
            None => Error::Silent {
                what: "the first gradient chunk of a push".into(),
                secs: timeout.as_secs_f64(),
                flag: "--worker-timeout",
            },
        })?
    }

    /// The next chunk of a PushRows stream, within the worker timeout (as [`Self::next_chunk`]).
    async fn next_row_chunk(
        &self,
        rank: Option<usize>,
        stream: &mut Streaming<RowChunk>,
    ) -> Result<Option<RowChunk>, Status> {
        let timeout = self.shared.cfg.worker_timeout;
        tokio::time::timeout(timeout, stream.message()).await.map_err(|_| {
            Status::from(Error::Silent {
                what: match rank {
                    Some(r) => format!("the next chunk of rank {r}'s rows"),
                    None => "the first chunk of a PushRows stream".into(),
                },
                secs: timeout.as_secs_f64(),
                flag: "--worker-timeout",
            })
        })?
    }

    /// A response the client has not taken for `limit` (its flow-control window stays shut):
    /// the stream serving it must not wait longer.
    pub(crate) fn not_taken(limit: std::time::Duration) -> Status {
        Error::Silent {
            what: "room for the next block of a pull (the client stopped reading)".into(),
            secs: limit.as_secs_f64(),
            flag: "--worker-timeout",
        }
        .into()
    }

    /// Hold an SSP push until `rank` is no more than `s` steps ahead of every expected rank.
    async fn ssp_wait(&self, rank: usize, s: u64) -> Result<f64> {
        let t = Instant::now();
        let deadline = tokio::time::Instant::now() + self.shared.cfg.worker_timeout;
        let mut rx = self.shared.progress.subscribe();
        loop {
            {
                let mut st = self.state.lock().await;
                if st.closing() {
                    st.ssp_hold(rank, &[]);
                    return Err(Error::ShuttingDown);
                }
                let blockers = st.ssp_blockers(rank, s);
                st.ssp_hold(rank, &blockers);
                if blockers.is_empty() {
                    return Ok(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                let mut st = self.state.lock().await;
                let blockers = st.ssp_blockers(rank, s);
                let step = st.version() + 1;
                if !blockers.is_empty() && !self.shared.cfg.elastic {
                    st.ssp_hold(rank, &[]);
                    return Err(Error::missing(step, &blockers, &[], self.shared.cfg.worker_timeout));
                }
                st.give_up_on(
                    &self.shared,
                    blockers,
                    Vec::new(),
                    step,
                    "fell more than the staleness bound behind",
                );
            }
        }
    }

    /// PushGradients, whichever framing delivered the chunks.
    pub(crate) async fn push(&self, chunks: Incoming<GradientChunk>) -> Result<PushReply, Status> {
        if self.shared.cfg.sync == SyncMode::Bsp {
            return self.push_bsp(chunks).await;
        }
        let Received { rank, base, grad, how } = self.receive(chunks).await?;
        let applied = match self.shared.cfg.sync {
            SyncMode::Bsp | SyncMode::Asp => {
                self.with_state(move |st, sh| st.apply_now(sh, rank, base, grad, how)).await??
            }
            SyncMode::Ssp(s) => {
                let mut a = self.with_state(move |st, sh| st.apply_now(sh, rank, base, grad, how)).await??;
                a.wait_ms = self.ssp_wait(rank, s).await?;
                a
            }
        };
        Ok(PushReply { version: applied.version, staleness: applied.staleness, wait_ms: applied.wait_ms })
    }

    /// PullParameters: a version's wire image, or the round producing the version asked for.
    pub(crate) async fn pull_source(&self, rank: usize, want: Option<u64>) -> Result<PullSource, Status> {
        let src = self
            .with_state(move |st, sh| {
                // Pulls from outside the run (monitoring) are allowed; a member's counts as a
                // sign of life.
                let _ = st.touch(rank);
                st.pull_source(sh, want)
            })
            .await??;
        let src = match src {
            PullSource::Ready(v, f) if self.shared.cfg.compression.half().is_some() => {
                let chunks =
                    (0..f.len()).map(|i| for_pull(&self.shared, v, f.chunk(i))).collect::<Result<_, _>>()?;
                PullSource::Ready(v, Framed::from_chunks(chunks))
            }
            src => src,
        };
        if let PullSource::Ready(_, f) = &src {
            self.shared.bytes_out.fetch_add(f.payload_len(), Ordering::Relaxed);
        }
        Ok(src)
    }

    /// Send `round`'s blocks through `tx` (as `item` makes them) as they are stepped, until it
    /// commits; its error if it fails, or if blocks already sent are thrown away.
    pub(crate) async fn stream_round<T>(
        &self,
        round: &Round,
        tx: &mpsc::Sender<T>,
        item: impl Fn(FramedChunk) -> T,
    ) -> Result<(), Status> {
        let mut rx = round.subscribe();
        let (mut sent, mut epoch) = (0, rx.borrow().epoch);
        // Every push into the round is heard from (it starts, sends a piece, ends) within the
        // worker timeout of the last sign, or is given up on by its own timers (silence
        // mid-stream; the barrier once it has ended). A round not heard from for as long has
        // no push under way (then the pull ends), or pushes that are about to be given up on:
        // the pull then applies the barrier itself (it changes or ends the round, as the
        // pushes' timers would, at the same moment), so that it ends with the step's outcome
        // rather than a timeout of its own.
        let (patience, started) = (self.shared.cfg.worker_timeout, std::time::Instant::now());
        let mut barrier_applied = false;
        loop {
            let p = rx.borrow_and_update().clone();
            if p.epoch != epoch {
                if sent > 0 {
                    return Err(Status::aborted(format!(
                        "step {}: a gradient was withdrawn after part of the new parameters was sent; pull again",
                        round.version
                    )));
                }
                epoch = p.epoch;
            }
            if let Some(Err(e)) = p.end {
                return Err(Status::from(&*e));
            }
            while sent < p.stepped {
                let Some(c) = round.chunk(sent, epoch) else { break };
                let c = for_pull(&self.shared, round.version, c)?;
                self.shared.bytes_out.fetch_add(c.payload().1.len() as u64, Ordering::Relaxed);
                match tokio::time::timeout(patience, tx.send(item(c))).await {
                    Ok(Ok(())) => {}
                    // The client went away.
                    Ok(Err(_)) => return Ok(()),
                    Err(_) => return Err(Self::not_taken(patience)),
                }
                sent += 1;
            }
            if matches!(p.end, Some(Ok(_))) && sent == round.blocks() {
                return Ok(());
            }
            let quiet_until = || round.heard().max(started) + patience;
            match tokio::time::timeout_at(quiet_until().into(), rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(Error::ShuttingDown.into()),
                // Heard from since: wait on.
                Err(_) if quiet_until() > std::time::Instant::now() => {}
                // The round failed (a push's own timer gave up on it) just as this wait timed out:
                // its error, read at the top of the loop, not a timeout of the pull's, is the
                // answer.
                Err(_) if matches!(rx.borrow().end, Some(Err(_))) => {}
                Err(_) if round.any_rank() && !barrier_applied => {
                    barrier_applied = true;
                    let base = round.version - 1;
                    self.with_state(move |st, sh| st.barrier_timeout(sh, base)).await?;
                }
                Err(_) => {
                    return Err(Status::deadline_exceeded(format!(
                        "step {}: no push under way for {} s (--worker-timeout)",
                        round.version,
                        patience.as_secs_f64()
                    )));
                }
            }
        }
    }
}

/// A worker's `--compress`, as it announced it at registration (empty: an older worker, which
/// pushes f32), against the server's: the same, or refused naming both.
fn check_compression(sh: &Shared, rank: usize, announced: &str) -> Result<()> {
    let theirs = if announced.is_empty() { Ok(Compression::None) } else { announced.parse() };
    match theirs {
        Ok(c) if c == sh.cfg.compression => Ok(()),
        Ok(c) => Err(Error::Membership(format!(
            "rank {rank} pushes with --compress {c}, this server takes --compress {}: give every worker and \
             server the same value",
            sh.cfg.compression
        ))),
        Err(_) => Err(Error::Membership(format!(
            "rank {rank} announces --compress '{}', which this server does not know",
            crate::error::abbreviate(announced)
        ))),
    }
}

/// The wire encoding `--compress` asks pushes for.
fn encoding_of(c: Compression) -> Encoding {
    match c {
        Compression::None => Encoding::F32,
        Compression::Fp16 => Encoding::F16,
        Compression::Bf16 => Encoding::Bf16,
        Compression::TopK(_) => Encoding::Sparse,
    }
}

/// Gradient chunk `c` of `rank`, due at value `at` of this shard's range, as little-endian f32
/// values of the range it covers: an f32 chunk's payload as it is (no copy), a half chunk
/// widened, a sparse chunk spread over its span with zeros between its pairs (in memory only:
/// the wire carried the pairs). Everything a peer can get wrong is refused, naming it, before
/// anything is allocated from what it declares: another encoding than the run's, index fields
/// on a dense chunk, a span past the range, ragged or unequal lengths, indices out of the span
/// or not strictly ascending.
fn dense(sh: &Shared, rank: usize, at: usize, c: GradientChunk) -> Result<bytes::Bytes> {
    let bad = |why: String| Error::BadGradient { rank, why };
    let want = encoding_of(sh.cfg.compression);
    let got = Encoding::try_from(c.encoding).map_err(|_| bad(format!("unknown encoding {}", c.encoding)))?;
    if got != want {
        return Err(bad(format!(
            "a chunk encoded as {}, this run's pushes are --compress {} ({})",
            got.as_str_name(),
            sh.cfg.compression,
            want.as_str_name()
        )));
    }
    if got != Encoding::Sparse && (!c.indices.is_empty() || c.span != 0) {
        return Err(bad(format!("a {} chunk with sparse fields (indices, span)", got.as_str_name())));
    }
    let len = sh.range.len();
    let room = len.saturating_sub(at);
    let codec = |e: gradsync_core::Error| bad(format!("chunk at offset {}: {e}", c.offset));
    let values = match got {
        Encoding::F32 => return Ok(c.data),
        Encoding::F16 | Encoding::Bf16 => {
            let half = if got == Encoding::F16 { Half::F16 } else { Half::Bf16 };
            let n = c.data.len() / 2;
            if n > room {
                return Err(bad(format!(
                    "chunk at offset {} with {n} values overruns a range of {len} values",
                    c.offset
                )));
            }
            let mut v = vec![0f32; n];
            half.decode(&c.data, &mut v).map_err(codec)?;
            v
        }
        Encoding::Sparse => {
            if c.offset != at as u64 {
                return Err(bad(format!(
                    "chunk at offset {} where {at} was expected (chunks must arrive in order)",
                    c.offset
                )));
            }
            let span = usize::try_from(c.span).ok().filter(|s| *s <= room).ok_or_else(|| {
                bad(format!(
                    "sparse chunk at offset {} spans {} values, past the range's {len}",
                    c.offset, c.span
                ))
            })?;
            let mut v = vec![0f32; span];
            compress::densify(&c.indices, &c.data, c.offset, &mut v).map_err(codec)?;
            v
        }
    };
    Ok(wire::encode(&values, bytes::BytesMut::new()))
}

/// The encoding pulls carry under `--compress c`: half precision for fp16 and bf16 (the
/// parameters rounded on their way, the server's own staying f32); f32 otherwise (a top-k
/// run's update still moves every parameter: momentum and weight decay are dense).
fn pull_encoding(c: Compression) -> Encoding {
    match c.half() {
        Some(Half::F16) => Encoding::F16,
        Some(Half::Bf16) => Encoding::Bf16,
        None => Encoding::F32,
    }
}

/// Parameter chunk `c` (an f32 message of `version`) as a pull sends it: re-encoded in half
/// precision when the run's pulls are, else as it is (no copy). A parameter the format cannot
/// hold (fp16 past 65504) fails the pull, naming it, rather than reaching the worker as an
/// infinity that its next loss would turn into a NaN blamed on the learning rate.
fn for_pull(sh: &Shared, version: u64, c: FramedChunk) -> Result<FramedChunk, Status> {
    let Some(half) = sh.cfg.compression.half() else { return Ok(c) };
    let (offset, payload) = c.payload();
    let mut values = vec![0f32; payload.len() / 4];
    // The payload is a whole number of f32 values: this server wrote it.
    let _ = wire::copy_into(&payload, 0, &mut values);
    if let Some((i, v)) = half.first_overflow(&values) {
        let what = format!(
            "version {version}: parameter {} of the flat buffer",
            sh.range.start + offset as usize + i
        );
        return Err(Status::out_of_range(half.overflow_error(&what, v, "pull")));
    }
    let head = ParameterChunk {
        version,
        offset,
        encoding: pull_encoding(sh.cfg.compression).into(),
        ..Default::default()
    };
    Ok(FramedChunk::build(&head, gradsync_proto::tag::PARAMETER_DATA, offset, values.len() * 2, |buf| {
        let at = buf.len();
        buf.resize(at + values.len() * 2, 0);
        // Sized above: two bytes a value.
        let _ = half.encode(&values, &mut buf[at..]);
    }))
}

/// Blocks of a streamed pull queued ahead of the connection (each one chunk).
pub(crate) const PULL_QUEUE: usize = 8;

type ChunkStream = Pin<Box<dyn Stream<Item = Result<ParameterChunk, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ParameterServer for Service {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let r = req.into_inner();
        let sh = &self.shared;
        check_compression(sh, rank_of(r.rank), &r.compression)?;
        let (rank, world) = (rank_of(r.rank), r.world_size as usize);
        let (reg, digest) = {
            let mut state = self.state.lock().await;
            let reg = if r.rejoin {
                state.rejoin(sh, rank, world, &r.fingerprint, r.join_at)?
            } else {
                state.register(sh, rank, world, &r.fingerprint)?
            };
            // Of the version the reply names (the state is locked until then).
            let digest = (state.version() == reg.version).then(|| state.digest()).flatten();
            (reg, digest)
        };
        Ok(Response::new(RegisterReply {
            shard: sh.cfg.shard.index as u32,
            shards: sh.cfg.shard.count as u32,
            start: sh.range.start as u64,
            end: sh.range.end as u64,
            total: sh.total as u64,
            version: reg.version,
            sync: sh.cfg.sync.to_string(),
            chunk_bytes: sh.cfg.tuning.chunk_bytes as u32,
            lr: sh.cfg.sgd.lr,
            momentum: sh.cfg.sgd.momentum,
            weight_decay: sh.cfg.sgd.weight_decay,
            staleness_lr: sh.cfg.staleness_lr.name().into(),
            compression: sh.cfg.compression.to_string(),
            rows_start: sh.table.as_ref().map_or(0, |t| t.rows.start as u64),
            rows_end: sh.table.as_ref().map_or(0, |t| t.rows.end as u64),
            row_len: sh.table.as_ref().map_or(0, |t| t.dim as u32),
            join_version: reg.join,
            digest: digest.map_or_else(bytes::Bytes::new, |d| bytes::Bytes::copy_from_slice(&d)),
        }))
    }

    async fn push_rows(&self, req: Request<Streaming<RowChunk>>) -> Result<Response<PushRowsReply>, Status> {
        let mut stream = req.into_inner();
        let table = self.shared.table.clone();
        let first = self.next_row_chunk(None, &mut stream).await?.ok_or_else(|| {
            Status::from(Error::BadGradient { rank: 0, why: "an empty PushRows stream".into() })
        })?;
        let (rank, base) = (rank_of(first.rank), first.version);
        let t = table.ok_or_else(|| {
            Status::from(Error::BadGradient {
                rank,
                why: "rows of a sparse table, and the server's model has none".into(),
            })
        })?;
        let mut rows = Rows::default();
        let mut chunk = Some(first);
        while let Some(c) = chunk {
            if rank_of(c.rank) != rank || c.version != base {
                return Err(
                    Error::BadGradient { rank, why: "rank or version changes mid-stream".into() }.into()
                );
            }
            match rows.extend_from_wire(&c.ids, &c.data, t.rows.len(), t.dim) {
                Ok(()) => {}
                Err(RowsError::Bad(why)) => return Err(Error::BadGradient { rank, why }.into()),
                Err(RowsError::NonFinite(_)) => {
                    if self.shared.cfg.sync == SyncMode::Bsp
                        && let Ok(round) = self.state.lock().await.rows_round(&self.shared, rank, base)
                    {
                        round.refuse_rank(rank);
                    }
                    return Err(self.refuse_nonfinite(rank));
                }
            }
            chunk = self.next_row_chunk(Some(rank), &mut stream).await?;
        }
        let n = rows.len() as u64;
        if self.shared.cfg.sync == SyncMode::Bsp {
            let round = self.state.lock().await.rows_round(&self.shared, rank, base)?;
            if round.add_rows(rank, rows)? {
                self.with_state(|st, sh| st.commit(sh)).await?;
            }
        } else {
            self.with_state(move |st, sh| st.apply_rows_now(sh, rank, base, &rows)).await??;
        }
        Ok(Response::new(PushRowsReply { rows: n }))
    }

    type PullRowsStream = Pin<Box<dyn Stream<Item = Result<RowChunk, Status>> + Send + 'static>>;

    async fn pull_rows(
        &self,
        req: Request<PullRowsRequest>,
    ) -> Result<Response<Self::PullRowsStream>, Status> {
        let req = req.into_inner();
        let rank = rank_of(req.rank);
        let t = self.shared.table.clone().ok_or_else(|| {
            Status::from(Error::BadGradient {
                rank,
                why: "a pull of rows, and the server's model has none".into(),
            })
        })?;
        if req.all && !req.ids.is_empty() {
            return Err(Status::invalid_argument("PullRows: `all` and `ids` together"));
        }
        // The rows asked for, every row of the shard with `all`: read and labelled alike.
        let ids: Vec<u32> = if req.all {
            (0..t.rows.len() as u32).collect()
        } else {
            decode_ids(&req.ids, t.rows.len())
                .map_err(|e| Status::invalid_argument(format!("PullRows: {e}")))?
        };
        let bsp = self.shared.cfg.sync == SyncMode::Bsp;
        let deadline = tokio::time::Instant::now() + self.shared.cfg.worker_timeout;
        let mut rx = self.shared.progress.subscribe();
        let mut data = Vec::new();
        let version = loop {
            {
                let mut st = self.state.lock().await;
                let _ = st.touch(rank);
                if st.closing() {
                    return Err(Error::ShuttingDown.into());
                }
                let now = st.version();
                match req.version {
                    Some(v) if bsp && v == now + 1 => {}
                    Some(v) if bsp && v != now => {
                        return Err(Status::failed_precondition(format!(
                            "PullRows of version {v}: the server is at version {now}, only it or the next can be asked for"
                        )));
                    }
                    _ => break st.read_rows(rank, &ids, &mut data)?,
                }
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(Status::deadline_exceeded(format!(
                    "PullRows of version {}: not applied within {} s (--worker-timeout)",
                    req.version.unwrap_or(0),
                    self.shared.cfg.worker_timeout.as_secs_f64()
                )));
            }
        };
        self.shared.bytes_out.fetch_add(data.len() as u64, Ordering::Relaxed);
        let per = (self.shared.cfg.tuning.chunk_bytes / (4 * t.dim.max(1))).max(1);
        let chunks: Vec<Result<RowChunk, Status>> = ids
            .chunks(per)
            .zip(data.chunks(per * t.dim * 4))
            .map(|(ids, data)| {
                Ok(RowChunk {
                    rank: req.rank,
                    version,
                    ids: ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>().into(),
                    data: bytes::Bytes::copy_from_slice(data),
                })
            })
            .collect();
        // At least one chunk, so that the version travels even when no row was asked for.
        let chunks = if chunks.is_empty() {
            vec![Ok(RowChunk { rank: req.rank, version, ..RowChunk::default() })]
        } else {
            chunks
        };
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn push_gradients(
        &self,
        req: Request<Streaming<GradientChunk>>,
    ) -> Result<Response<PushReply>, Status> {
        Ok(Response::new(self.push(Incoming::Codec(req.into_inner())).await?))
    }

    type PullParametersStream = ChunkStream;

    async fn pull_parameters(&self, req: Request<PullRequest>) -> Result<Response<ChunkStream>, Status> {
        let req = req.into_inner();
        let encoding = pull_encoding(self.shared.cfg.compression).into();
        let chunk = move |version, c: &FramedChunk| {
            let (offset, data) = c.payload();
            ParameterChunk { version, offset, data, encoding }
        };
        match self.pull_source(rank_of(req.rank), req.stream_version).await? {
            PullSource::Ready(version, f) => {
                let chunks: Vec<_> = (0..f.len()).map(|i| Ok(chunk(version, &f.chunk(i)))).collect();
                Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
            }
            PullSource::Round(round) => {
                let (tx, rx) = mpsc::channel(PULL_QUEUE);
                let svc = self.clone();
                tokio::spawn(async move {
                    let version = round.version;
                    if let Err(s) = svc.stream_round(&round, &tx, |c| Ok(chunk(version, &c))).await {
                        // Within the same limit: the client may be the one not reading.
                        let _ = tokio::time::timeout(svc.shared.cfg.worker_timeout, tx.send(Err(s))).await;
                    }
                });
                Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
            }
        }
    }

    async fn get_version(&self, _req: Request<VersionRequest>) -> Result<Response<VersionReply>, Status> {
        let st = self.state.lock().await;
        Ok(Response::new(VersionReply {
            version: st.version(),
            live_ranks: st.live_ranks().into_iter().map(|r| r as u32).collect(),
            rejected_nonfinite: self.shared.rejected_nonfinite.load(Ordering::Relaxed),
            sync: self.shared.cfg.sync.to_string(),
            shard: self.shared.cfg.shard.index as u32,
            shards: self.shared.cfg.shard.count as u32,
        }))
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatReply>, Status> {
        let mut st = self.state.lock().await;
        st.touch(rank_of(req.into_inner().rank))?;
        Ok(Response::new(HeartbeatReply { version: st.version() }))
    }

    async fn deregister(&self, req: Request<DeregisterRequest>) -> Result<Response<DeregisterReply>, Status> {
        let rank = rank_of(req.into_inner().rank);
        self.with_state(move |st, sh| st.deregister(sh, rank)).await??;
        Ok(Response::new(DeregisterReply {}))
    }

    async fn shutdown(&self, _req: Request<ShutdownRequest>) -> Result<Response<ShutdownReply>, Status> {
        let version = self.state.lock().await.version();
        tracing::info!(version, "shutdown requested");
        self.stop.send_replace(true);
        Ok(Response::new(ShutdownReply { version }))
    }
}

/// The token check, run before any ParameterServer RPC: `authorization: Bearer TOKEN`,
/// compared in constant time.
pub fn auth(token: Option<Arc<str>>) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let Some(token) = &token else { return Ok(req) };
        let given = req
            .metadata()
            .get(gradsync_proto::auth::KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if gradsync_proto::auth::constant_time_eq(g.as_bytes(), token.as_bytes()) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong token")),
            None => Err(Status::unauthenticated("missing token: send `authorization: Bearer TOKEN`")),
        }
    }
}

/// One worker's whole push, read by `Service::receive`.
struct Received {
    rank: usize,
    /// The version its gradient was computed from.
    base: u64,
    grad: Vec<f32>,
    how: Arrival,
}
