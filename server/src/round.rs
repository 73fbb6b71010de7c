//! One pipelined BSP step (BytePS-style): the update of block `c` runs as soon as every
//! expected rank's block `c` has arrived and been checked, and the pulls of the new version
//! stream block `c` as soon as it is stepped, so a step costs about one push (or pull) plus a
//! block rather than push + update + pull.
//!
//! Over 600 lines with its tests (about 190): the step's whole life (arrival, check, step,
//! commit, refusal) stays in one file, so that "a failed step commits nothing" can be read
//! and checked in one place.
//!
//! ```text
//!   rank 0 push:  [b0][b1][b2][b3]                  pieces kept as they arrived (no copy)
//!   rank 1 push:    [b0][b1][b2][b3]
//!   step:             [b0][b1][b2][b3]              sum in rank order + SGD, written into
//!   pull v+1:           [b0][b1][b2][b3]            next params/momentum and the pull image
//!   commit:                            *            swap next <-> current, version + 1
//! ```
//!
//! Why it is safe: a step never writes the current parameters or momentum. Each block's result
//! goes into the *next* buffers (and the next version's wire image); only [`Round::finish`],
//! once every block is stepped and every expected rank's stream has ended cleanly, hands them
//! over for the swap. A NaN, a short or stalled stream, or a rank dropped before that point
//! withdraws that rank's pieces; if blocks were already stepped with them they are thrown
//! away (the `epoch` changes) and any pull that received one ends with an error, so no client
//! keeps parameters that never became a version. A step that fails outright (a strict
//! timeout, shutdown) ends every push and pull with its error and leaves the version as it
//! was. Memory traffic is that of an in-place step: the next buffers are the previous
//! version's, reused.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use gradsync_core::optim::{SgdConfig, sgd_step_into};
use gradsync_proto::frames::{Framed, FramedChunk, MessageBuf};
use gradsync_proto::pb::ParameterChunk;
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::rows::Rows;

/// Values per inner block of a step: a block of every buffer fits in L2 together.
const SUB: usize = 1 << 15;

/// How far a round has got, as every push and pull of it sees it.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Blocks stepped (and their wire image built) in the current epoch.
    pub stepped: usize,
    /// Bumped whenever stepped blocks are thrown away because a contributor withdrew.
    pub epoch: u64,
    /// Set once: the round was committed, or failed with this error.
    pub end: Option<std::result::Result<Committed, Arc<Error>>>,
    /// Ranks whose gradient was refused for NaN or Inf (until they join again).
    pub refused: BTreeSet<usize>,
}

/// What a committed round produced.
#[derive(Debug, Clone)]
pub struct Committed {
    /// The new version.
    pub version: u64,
    /// When the swap happened.
    pub at: Instant,
    /// The ranks whose gradients the update holds.
    pub ranks: Vec<usize>,
    /// When the last of them began its push: until then a push that began earlier waited for
    /// a slower worker; after it, for bytes on their way (the exchange itself).
    pub last_began: Option<Instant>,
}

/// One rank's pieces that overlap a block: (rank, [(value offset, payload)]).
type Part = (usize, Vec<(usize, Bytes)>);

/// One rank's gradient as it arrived: payload pieces (little-endian f32) at value offsets.
#[derive(Debug, Default)]
struct Contribution {
    pieces: Vec<(usize, Bytes)>,
    received: usize,
    /// When its push began (its first chunk joined the round).
    began: Option<Instant>,
    /// When the stream ended cleanly, and its payload bytes.
    done: Option<(Instant, u64)>,
    /// Which push this is ([`Round::serial`]).
    serial: u64,
}

#[derive(Debug)]
struct Inner {
    expected: BTreeSet<usize>,
    ranks: BTreeMap<usize, Contribution>,
    stepped: usize,
    epoch: u64,
    /// A task is stepping blocks (one at a time: blocks are stepped in order).
    stepping: bool,
    /// The wire image of the stepped blocks (this epoch).
    image: Vec<FramedChunk>,
    ended: bool,
    /// Ranks whose gradient held NaN or Inf, found while summing (withdrawn).
    refused: BTreeSet<usize>,
    /// See [`Round::heard`].
    heard: Instant,
    /// A sparse table's rows, by rank, as each rank's PushRows delivered them in full (when,
    /// and their bytes).
    rows: BTreeMap<usize, (Instant, u64, Rows)>,
    /// Pushes joined so far: each contribution's serial.
    joins: u64,
}

/// The buffers one stepper writes; only the task holding `Inner::stepping` locks this.
#[derive(Debug)]
struct Work {
    params: Params,
    momentum: Arc<Vec<f32>>,
    next_momentum: Vec<f32>,
    /// By block: the buffer of an earlier version's message to build this block's in, while
    /// no block is built yet, then the buffer it was built in (for a rebuild in a new epoch).
    bufs: Vec<Option<MessageBuf>>,
    sum: Vec<f32>,
    /// One inner block of the current parameters, copied out of an image whose payload is
    /// not aligned f32; or one rank's inner block, when looking for a non-finite one.
    current: Vec<f32>,
}

/// The parameters a step starts from: as values (at start, after a resume, or after updates
/// applied in place under ASP and SSP), or only in the wire image of the step that made them
/// (one `ParameterChunk` message per block), which the pulls of that version stream. A step
/// then writes the new parameters once, into the next image, rather than into a buffer of
/// values and then the image.
#[derive(Debug, Clone, Default)]
pub struct Params {
    /// The values; empty while `image` holds them.
    values: Arc<Vec<f32>>,
    image: Option<Framed>,
}

impl Params {
    /// Parameters held as values.
    pub fn from_values(values: Vec<f32>) -> Params {
        Params { values: Arc::new(values), image: None }
    }

    /// Parameters held only in a step's wire image.
    pub fn from_image(image: Framed) -> Params {
        Params { values: Arc::default(), image: Some(image) }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        match &self.image {
            Some(f) => (f.payload_len() / 4) as usize,
            None => self.values.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The image holding the parameters, if that is how they are held.
    pub fn image(&self) -> Option<&Framed> {
        self.image.as_ref()
    }

    /// The parameters as values, decoded from the image the first time they are asked for.
    pub fn values(&mut self) -> &mut Arc<Vec<f32>> {
        if let Some(f) = self.image.take() {
            let mut v = vec![0f32; (f.payload_len() / 4) as usize];
            for i in 0..f.len() {
                let (offset, payload) = f.payload(i);
                // The image was written by a step over exactly these values.
                let _ = gradsync_proto::wire::copy_into(&payload, offset, &mut v);
            }
            self.values = Arc::new(v);
        }
        &mut self.values
    }
}

/// What [`Round::finish`] hands over for the swap.
#[derive(Debug)]
pub struct Finished {
    /// The new momentum.
    pub momentum: Vec<f32>,
    /// The new parameters, in their wire image: one ParameterChunk message per block.
    pub image: Vec<FramedChunk>,
    /// The buffers `image` was built in, for a later round's image once its chunks are gone.
    pub image_bufs: Vec<MessageBuf>,
    /// The contributing ranks with when each stream ended and its payload bytes, by rank.
    pub ranks: Vec<(usize, Instant, u64)>,
    /// Their rows of a sparse table, in the same order (none for a model without one).
    pub rows: Vec<Rows>,
    /// When the last of their dense pushes began (None for a round of rows alone).
    pub last_began: Option<Instant>,
}

/// The step from `version - 1` to `version`.
#[derive(Debug)]
pub struct Round {
    /// The version this round produces.
    pub version: u64,
    len: usize,
    block: usize,
    nblocks: usize,
    sgd: SgdConfig,
    inner: StdMutex<Inner>,
    work: StdMutex<Work>,
    progress: watch::Sender<Progress>,
    /// Whether every rank also pushes rows of a sparse table ([`Round::add_rows`]).
    wants_rows: bool,
}

/// A poisoned lock means a stepper panicked; the data under it is still only this round's,
/// which the failure then throws away.
fn lock<T>(m: &StdMutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The buffers a round starts from: the current parameters and momentum (read only) and a
/// buffer of the same length for the next momentum (the next parameters go into the image).
#[derive(Debug, Default)]
pub struct Start {
    /// The current parameters.
    pub params: Params,
    /// The current momentum.
    pub momentum: Arc<Vec<f32>>,
    /// Room for the next momentum (any contents).
    pub next_momentum: Vec<f32>,
    /// The buffers an earlier version's image was built in, block by block, for this round's
    /// (those still held by a pull are left to it).
    pub image_bufs: Vec<MessageBuf>,
}

impl Round {
    /// The step producing `version` from `start`, in blocks of `chunk_bytes` (the pull chunk),
    /// waiting for the `expected` ranks.
    pub fn new(
        version: u64,
        start: Start,
        chunk_bytes: usize,
        sgd: SgdConfig,
        expected: BTreeSet<usize>,
    ) -> Self {
        let mut params = start.params;
        let len = params.len();
        let block = (chunk_bytes / 4).max(1);
        // An image is read block by block: its chunks must be this round's blocks.
        if let Some(f) = params.image() {
            let fits = f.len() == len.div_ceil(block)
                && (0..f.len()).all(|c| f.payload(c).1.len() == block.min(len - c * block) * 4);
            if !fits {
                params.values();
            }
        }
        let inner = SUB.min(block);
        let mut w = Work {
            params,
            momentum: start.momentum,
            next_momentum: start.next_momentum,
            bufs: start.image_bufs.into_iter().map(Some).collect(),
            sum: vec![0.0; inner],
            current: vec![0.0; inner],
        };
        if w.next_momentum.capacity() < len {
            // The first round (later ones reuse the momentum two rounds back).
            w.next_momentum = gradsync_core::heap::zeros(len);
        }
        w.next_momentum.resize(len, 0.0);
        w.bufs.resize(len.div_ceil(block), None);
        Round {
            version,
            len,
            block,
            nblocks: len.div_ceil(block),
            sgd,
            inner: StdMutex::new(Inner {
                expected,
                ranks: BTreeMap::new(),
                stepped: 0,
                epoch: 0,
                stepping: false,
                image: Vec::new(),
                ended: false,
                refused: BTreeSet::new(),
                heard: Instant::now(),
                rows: BTreeMap::new(),
                joins: 0,
            }),
            work: StdMutex::new(w),
            progress: watch::channel(Progress::default()).0,
            wants_rows: false,
        }
    }

    /// The same round for a model with a sparse table: it commits only once every expected
    /// rank has also delivered its rows.
    pub fn with_rows(mut self, yes: bool) -> Self {
        self.wants_rows = yes;
        self
    }

    /// `rank`'s rows of the sparse table, whole (its PushRows stream ended cleanly); true when
    /// the round can commit. Refused once the round ended, for a rank refused for NaN or Inf,
    /// and for a second set of rows.
    pub fn add_rows(&self, rank: usize, rows: Rows) -> Result<bool> {
        let mut g = lock(&self.inner);
        if g.ended {
            return Err(Error::Stale { rank, base: self.version - 1, version: self.version });
        }
        if g.refused.contains(&rank) {
            return Err(Error::NonFinite { rank });
        }
        if g.rows.contains_key(&rank) {
            return Err(Error::BadGradient {
                rank,
                why: format!("a second set of rows for version {}", self.version - 1),
            });
        }
        let bytes = 4 * (rows.ids.len() + rows.values.len()) as u64;
        g.rows.insert(rank, (Instant::now(), bytes, rows));
        g.heard = Instant::now();
        Ok(self.complete(&g))
    }

    /// Blocks in the step.
    pub fn blocks(&self) -> usize {
        self.nblocks
    }

    fn range(&self, c: usize) -> Range<usize> {
        c * self.block..((c + 1) * self.block).min(self.len)
    }

    /// Watch the round's progress.
    pub fn subscribe(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    fn publish(&self, g: &Inner, end: Option<std::result::Result<Committed, Arc<Error>>>) {
        let (stepped, epoch) = (g.stepped, g.epoch);
        self.progress.send_modify(|p| {
            p.stepped = stepped;
            p.epoch = epoch;
            if p.refused != g.refused {
                p.refused.clone_from(&g.refused);
            }
            if end.is_some() {
                p.end = end;
            }
        });
    }

    /// `rank` starts pushing its gradient for this step.
    pub fn join(&self, rank: usize) -> Result<()> {
        let mut g = lock(&self.inner);
        if g.ended {
            return Err(Error::Stale { rank, base: self.version - 1, version: self.version });
        }
        if g.ranks.contains_key(&rank) {
            return Err(Error::BadGradient {
                rank,
                why: format!("a second gradient for version {}", self.version - 1),
            });
        }
        if !g.expected.contains(&rank) {
            // A rank that came back while this step was under way: it joins the next one.
            return Err(Error::Membership(format!(
                "rank {rank} is not expected in the step to version {} (it came back after the step began); \
                 push from version {}",
                self.version, self.version
            )));
        }
        g.joins += 1;
        let serial = g.joins;
        let began = Some(Instant::now());
        g.ranks.insert(rank, Contribution { serial, began, ..Contribution::default() });
        g.heard = Instant::now();
        if g.refused.remove(&rank) {
            self.publish(&g, None);
        }
        Ok(())
    }

    /// When `rank`'s push into this round began (None if it has not joined, or was withdrawn).
    pub fn began(&self, rank: usize) -> Option<Instant> {
        lock(&self.inner).ranks.get(&rank).and_then(|c| c.began)
    }

    /// Whether `rank` is pushing (or has pushed) into this round.
    pub fn has(&self, rank: usize) -> bool {
        lock(&self.inner).ranks.contains_key(&rank)
    }

    /// A piece of `rank`'s gradient at value `offset` (directly after the previous one),
    /// checked for order and length; its values are checked while they are summed. Steps
    /// whatever blocks it completes. False once `rank`'s gradient has been refused for NaN or
    /// Inf (then it is withdrawn, and the rest of its stream can go).
    pub fn add(&self, rank: usize, offset: usize, payload: Bytes) -> bool {
        {
            let mut g = lock(&self.inner);
            if g.refused.contains(&rank) {
                return false;
            }
            let Some(c) = g.ranks.get_mut(&rank) else { return true };
            c.received = offset + payload.len() / 4;
            c.pieces.push((offset, payload));
            g.heard = Instant::now();
        }
        self.advance();
        !lock(&self.inner).refused.contains(&rank)
    }

    /// Check the values of `rank`'s pieces that no step has summed yet (they wait for other
    /// ranks' blocks) and refuse the rank, as summing would, if any is NaN or Inf: for a push
    /// whose stream has ended, so that its refusal does not depend on ranks that may never
    /// send. True if `rank` is refused.
    pub fn refuse_if_non_finite(&self, rank: usize) -> bool {
        // The pieces are taken (slices, no copy) and read outside the lock: other ranks keep
        // adding theirs meanwhile.
        let (summed, pieces) = {
            let g = lock(&self.inner);
            if g.refused.contains(&rank) {
                return true;
            }
            let Some(c) = g.ranks.get(&rank) else { return false };
            let summed = g.stepped * self.block;
            let pieces: Vec<(usize, Bytes)> =
                c.pieces.iter().filter(|(o, p)| o + p.len() / 4 > summed).cloned().collect();
            (summed, pieces)
        };
        let bad = pieces.iter().any(|(o, p)| {
            let from = summed.saturating_sub(*o) * 4;
            !gradsync_proto::wire::all_finite_le(&p[from..])
        });
        if bad {
            self.refuse(&mut lock(&self.inner), &[rank]);
        }
        bad
    }

    /// Refuse `rank` for NaN or Inf found outside the sum (in its rows of a sparse table).
    pub fn refuse_rank(&self, rank: usize) {
        self.refuse(&mut lock(&self.inner), &[rank]);
    }

    /// Refuse `ranks` for NaN or Inf: withdrawn like a failed stream (blocks already stepped
    /// with them go), and told so through the progress until they join again.
    fn refuse(&self, g: &mut Inner, ranks: &[usize]) {
        let mut withdrawn = false;
        for r in ranks {
            withdrawn |= g.ranks.remove(r).is_some();
            g.rows.remove(r);
            g.refused.insert(*r);
        }
        if withdrawn {
            self.invalidate(g);
        }
        self.publish(g, None);
    }

    /// `rank`'s stream ended cleanly with `bytes` of payload; true when the round can commit.
    pub fn done(&self, rank: usize, bytes: u64) -> bool {
        let mut g = lock(&self.inner);
        if let Some(c) = g.ranks.get_mut(&rank) {
            c.done = Some((Instant::now(), bytes));
            g.heard = Instant::now();
        }
        self.complete(&g)
    }

    /// Throw away stepped blocks (a contributor is gone): pulls that had any must fail.
    fn invalidate(&self, g: &mut Inner) {
        if g.stepped > 0 {
            g.stepped = 0;
            g.epoch += 1;
            g.image.clear();
            self.publish(g, None);
        }
    }

    /// Withdraw `rank`'s gradient (its stream failed, or it left).
    pub fn remove(&self, rank: usize) {
        let mut g = lock(&self.inner);
        g.rows.remove(&rank);
        if g.ranks.remove(&rank).is_some() {
            self.invalidate(&mut g);
        }
    }

    /// Which push of `rank` the round holds (`None`: none): a push whose stream fails
    /// withdraws its own gradient only ([`Round::remove_push`]), not that of the same rank's
    /// process restarted meanwhile.
    pub fn serial(&self, rank: usize) -> Option<u64> {
        lock(&self.inner).ranks.get(&rank).map(|c| c.serial)
    }

    /// [`Round::remove`], if the round still holds push `serial` of `rank`.
    pub fn remove_push(&self, rank: usize, serial: Option<u64>) {
        let mut g = lock(&self.inner);
        if serial.is_some() && g.ranks.get(&rank).map(|c| c.serial) == serial {
            g.ranks.remove(&rank);
            self.invalidate(&mut g);
        }
    }

    /// The ranks the step waits for changed (departures); true when the round can now commit.
    pub fn set_expected(&self, expected: BTreeSet<usize>) -> bool {
        {
            let mut g = lock(&self.inner);
            if g.expected != expected {
                g.ranks.retain(|r, _| expected.contains(r));
                g.rows.retain(|r, _| expected.contains(r));
                g.expected = expected;
                // The scale (1/W) and the sum change: every stepped block is wrong now.
                self.invalidate(&mut g);
            }
        }
        self.advance();
        let g = lock(&self.inner);
        self.complete(&g)
    }

    /// Expected ranks that have not finished pushing, and those of them whose gradient was
    /// refused for NaN or Inf (and which have not pushed again).
    pub fn missing(&self) -> (Vec<usize>, Vec<usize>) {
        let g = lock(&self.inner);
        let missing: Vec<usize> = g
            .expected
            .iter()
            .copied()
            .filter(|r| {
                (!self.rows_only() && g.ranks.get(r).is_none_or(|c| c.done.is_none()))
                    || (self.wants_rows && !g.rows.contains_key(r))
            })
            .collect();
        let refused = missing.iter().copied().filter(|r| g.refused.contains(r)).collect();
        (missing, refused)
    }

    /// When a push last started, sent a piece or ended in this round (or the round began).
    pub fn heard(&self) -> Instant {
        lock(&self.inner).heard
    }

    /// Whether any rank has started pushing.
    pub fn any_rank(&self) -> bool {
        !lock(&self.inner).ranks.is_empty()
    }

    fn complete(&self, g: &Inner) -> bool {
        !g.ended
            && !g.expected.is_empty()
            && g.stepped == self.nblocks
            && (self.rows_only()
                || g.expected.iter().all(|r| g.ranks.get(r).is_some_and(|c| c.done.is_some())))
            && (!self.wants_rows || g.expected.iter().all(|r| g.rows.contains_key(r)))
    }

    /// A shard that serves a sparse table only (`--table-only`): its steps are its rows'.
    fn rows_only(&self) -> bool {
        self.wants_rows && self.len == 0
    }

    /// Blocks every expected rank has delivered in full.
    fn ready(&self, g: &Inner) -> usize {
        if g.expected.is_empty() {
            return 0;
        }
        g.expected
            .iter()
            .map(|r| match g.ranks.get(r) {
                Some(c) if c.received == self.len => self.nblocks,
                Some(c) => c.received / self.block,
                None => 0,
            })
            .min()
            .unwrap_or(0)
    }

    /// Step every block that is ready, in order, one task at a time.
    pub fn advance(&self) {
        loop {
            let (c, parts, epoch, scale) = {
                let mut g = lock(&self.inner);
                if g.stepping || g.ended || g.stepped >= self.ready(&g) {
                    return;
                }
                g.stepping = true;
                let c = g.stepped;
                let r = self.range(c);
                // Rank order: the sum is the same whichever rank arrived first.
                let parts: Vec<Part> = g
                    .expected
                    .iter()
                    .filter_map(|rank| g.ranks.get(rank).map(|con| (rank, con)))
                    .map(|(rank, con)| {
                        let pieces = con
                            .pieces
                            .iter()
                            .filter(|(o, p)| *o < r.end && o + p.len() / 4 > r.start)
                            .cloned()
                            .collect();
                        (*rank, pieces)
                    })
                    .collect();
                (c, parts, g.epoch, 1.0 / g.expected.len() as f32)
            };
            let stepped = self.step_block(c, &parts, scale);
            let mut g = lock(&self.inner);
            g.stepping = false;
            if g.epoch != epoch || g.ended || g.stepped != c {
                continue;
            }
            match stepped {
                Ok(chunk) => {
                    g.image.push(chunk);
                    g.stepped += 1;
                    self.publish(&g, None);
                }
                Err(bad) => self.refuse(&mut g, &bad),
            }
        }
    }

    /// Sum block `c` of every rank (`parts`, in rank order) and step it inner block by inner
    /// block while each is in cache: the new momentum goes into the next buffer, the new
    /// parameters straight into the block's pull message. The current parameters are read
    /// straight out of their image where its payload is aligned f32 (images built here are).
    ///
    /// Finiteness is checked on the sum, in cache, rather than on every rank's gradient as it
    /// arrives: a NaN or Inf in any rank makes the sum NaN or Inf. Only then are the ranks'
    /// values checked one by one, and the ranks holding NaN or Inf are returned (refused).
    /// A sum that overflows from finite gradients is stepped as before.
    fn step_block(
        &self,
        c: usize,
        parts: &[Part],
        scale: f32,
    ) -> std::result::Result<FramedChunk, Vec<usize>> {
        let r = self.range(c);
        let mut w = lock(&self.work);
        let Work { params, momentum, next_momentum, bufs, sum, current } = &mut *w;
        let image = params.image().map(|f| f.payload(c).1);
        let head =
            ParameterChunk { version: self.version, offset: r.start as u64, ..ParameterChunk::default() };
        let reuse = bufs[c].take();
        let tag = gradsync_proto::tag::PARAMETER_DATA;
        let (chunk, buf) = FramedChunk::build_f32_in(reuse, &head, tag, r.start as u64, r.len(), |out| {
            for s in r.clone().step_by(SUB) {
                let s = s..(s + SUB).min(r.end);
                let acc = &mut sum[..s.len()];
                for (k, (_, pieces)) in parts.iter().enumerate() {
                    gather(pieces, s.clone(), acc, k == 0);
                }
                if !gradsync_proto::wire::all_finite(acc) {
                    let own = &mut current[..s.len()];
                    let bad: Vec<usize> = parts
                        .iter()
                        .filter(|(_, pieces)| {
                            gather(pieces, s.clone(), own, true);
                            !gradsync_proto::wire::all_finite(own)
                        })
                        .map(|(rank, _)| *rank)
                        .collect();
                    if !bad.is_empty() {
                        return Err(bad);
                    }
                }
                let p = match &image {
                    None => &params.values[s.clone()],
                    Some(payload) => {
                        let bytes = &payload[(s.start - r.start) * 4..(s.end - r.start) * 4];
                        match gradsync_proto::wire::as_f32(bytes) {
                            Some(p) => p,
                            None => {
                                let cur = &mut current[..s.len()];
                                // Same length by construction (checked in `new`).
                                let _ = gradsync_proto::wire::copy_into(bytes, 0, cur);
                                &*cur
                            }
                        }
                    }
                };
                let out = &mut out[s.start - r.start..s.end - r.start];
                sgd_step_into(
                    &self.sgd,
                    p,
                    acc,
                    &momentum[s.clone()],
                    scale,
                    out,
                    &mut next_momentum[s.clone()],
                );
            }
            Ok(())
        })?;
        bufs[c] = Some(buf);
        Ok(chunk)
    }

    /// Block `i` of the next version's wire image, if it is stepped in `epoch`.
    pub fn chunk(&self, i: usize, epoch: u64) -> Option<FramedChunk> {
        let g = lock(&self.inner);
        if g.epoch != epoch {
            return None;
        }
        g.image.get(i).cloned()
    }

    /// Every block stepped and every expected stream ended: take the results for the swap.
    /// `None` if not complete (or already taken).
    pub fn finish(&self) -> Option<Finished> {
        let mut g = lock(&self.inner);
        if !self.complete(&g) {
            return None;
        }
        g.ended = true;
        let mut w = lock(&self.work);
        let mut rows = std::mem::take(&mut g.rows);
        let ranks: Vec<(usize, Instant, u64)> = g
            .expected
            .iter()
            .filter_map(|r| match (g.ranks.get(r).and_then(|c| c.done), rows.get(r)) {
                // Its dense push's end, and the bytes of both.
                (Some((t, b)), Some(rw)) => Some((*r, t, b + rw.1)),
                (Some((t, b)), None) => Some((*r, t, b)),
                (None, Some(rw)) if self.rows_only() => Some((*r, rw.0, rw.1)),
                _ => None,
            })
            .collect();
        let rows = ranks.iter().filter_map(|(r, ..)| rows.remove(r).map(|rw| rw.2)).collect();
        let last_began = ranks.iter().filter_map(|(r, ..)| g.ranks.get(r).and_then(|c| c.began)).max();
        g.ranks.clear();
        w.params = Params::default();
        w.momentum = Arc::default();
        Some(Finished {
            momentum: std::mem::take(&mut w.next_momentum),
            // Cloned (slices, no copy): pulls still streaming this round read what they have
            // not sent yet from the round.
            image: g.image.clone(),
            image_bufs: w.bufs.iter_mut().filter_map(Option::take).collect(),
            ranks,
            rows,
            last_began,
        })
    }

    /// Tell every push and pull of the round that it was committed.
    pub fn committed(&self, c: Committed) {
        let g = lock(&self.inner);
        self.publish(&g, Some(Ok(c)));
    }

    /// The step failed: end every push and pull of it with `error`; nothing is committed.
    pub fn fail(&self, error: Error) {
        let mut g = lock(&self.inner);
        if g.ended {
            return;
        }
        g.ended = true;
        g.ranks.clear();
        g.rows.clear();
        g.image.clear();
        self.publish(&g, Some(Err(Arc::new(error))));
        drop(g);
        // Let go of the current buffers so nothing else has to copy them to write them.
        let mut w = lock(&self.work);
        w.params = Params::default();
        w.momentum = Arc::default();
    }

    /// Whether the round ended (committed or failed).
    pub fn ended(&self) -> bool {
        lock(&self.inner).ended
    }
}

/// Values `s` of one rank's gradient, from its payload `pieces`, into `acc`: assigned when
/// `first`, added otherwise (so the sum is exactly `g0 + g1 + ...`, as a serial sum).
fn gather(pieces: &[(usize, Bytes)], s: Range<usize>, acc: &mut [f32], first: bool) {
    for (o, p) in pieces {
        let (lo, hi) = (s.start.max(*o), s.end.min(o + p.len() / 4));
        if lo >= hi {
            continue;
        }
        let src = &p[(lo - o) * 4..(hi - o) * 4];
        let dst = &mut acc[lo - s.start..hi - s.start];
        if first {
            for (a, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *a = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        } else {
            for (a, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use gradsync_core::optim::sgd_step;

    fn val(k: usize, i: usize) -> f32 {
        ((i * 7 + k * 13) % 101) as f32 * 0.01 - 0.5
    }

    fn le(v: &[f32]) -> Bytes {
        gradsync_proto::wire::encode(v, bytes::BytesMut::new())
    }

    /// The pipelined step (blocks stepped as pieces arrive, ranks arriving interleaved and in
    /// odd piece sizes, sums in rank order) equals the serial one bit for bit: whole buffers
    /// summed in rank order, then one `sgd_step`.
    #[test]
    fn pipelined_step_equals_the_serial_step_bit_for_bit() {
        // One rank (its gradient copied), two and three (added in rank order).
        for ranks in 1..=3 {
            pipelined_step_equals_the_serial_step_with(ranks);
        }
    }

    fn pipelined_step_equals_the_serial_step_with(ranks: usize) {
        let n = 3 * SUB + 77;
        let grads: Vec<Vec<f32>> = (0..ranks).map(|k| (0..n).map(|i| val(k, i)).collect()).collect();
        let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
        let p0: Vec<f32> = (0..n).map(|i| val(9, i)).collect();
        let m0: Vec<f32> = (0..n).map(|i| val(5, i) * 0.1).collect();

        let (mut want_p, mut want_m) = (p0.clone(), m0.clone());
        let mut sum = grads[0].clone();
        for g in &grads[1..] {
            for (s, g) in sum.iter_mut().zip(g) {
                *s += g;
            }
        }
        sgd_step(&cfg, &mut want_p, &sum, &mut want_m, 1.0 / ranks as f32);

        // Blocks of 10 000 values; rank k sends pieces of 7 000 + 1 000 k values, ranks
        // interleaved, the highest rank first.
        let start = Start { params: Params::from_values(p0), momentum: Arc::new(m0), ..Start::default() };
        let round = Round::new(1, start, 40_000, cfg, (0..ranks).collect());
        let mut at = vec![0usize; ranks];
        for k in (0..ranks).rev() {
            round.join(k).unwrap();
        }
        while at.iter().any(|&a| a < n) {
            for k in (0..ranks).rev() {
                let piece = 7_000 + 1_000 * k;
                if at[k] < n {
                    let end = (at[k] + piece).min(n);
                    round.add(k, at[k], le(&grads[k][at[k]..end]));
                    at[k] = end;
                }
            }
        }
        let mut complete = false;
        for k in 0..ranks {
            complete = round.done(k, (n * 4) as u64);
        }
        assert!(complete);
        let f = round.finish().unwrap();
        assert_eq!(f.momentum, want_m);
        // The image holds the new parameters, block by block.
        let mut from_image = Vec::new();
        for c in &f.image {
            let (offset, payload) = c.payload();
            assert_eq!(offset as usize, from_image.len());
            from_image.extend(payload.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        }
        assert_eq!(from_image, want_p);
        assert_eq!(f.ranks.iter().map(|r| r.0).collect::<Vec<_>>(), (0..ranks).collect::<Vec<_>>());

        // A second step reads the parameters out of the first one's image: with the same
        // blocks, and with other blocks (then decoded to values first). Both equal a second
        // serial step bit for bit.
        sgd_step(&cfg, &mut want_p, &sum, &mut want_m, 1.0 / ranks as f32);
        for chunk_bytes in [40_000, 30_000] {
            let params = Params::from_image(Framed::from_chunks(f.image.clone()));
            let start = Start { params, momentum: Arc::new(f.momentum.clone()), ..Start::default() };
            let round = Round::new(2, start, chunk_bytes, cfg, (0..ranks).collect());
            for (k, g) in grads.iter().enumerate() {
                round.join(k).unwrap();
                round.add(k, 0, le(g));
            }
            let complete: Vec<bool> = (0..ranks).map(|k| round.done(k, (n * 4) as u64)).collect();
            assert_eq!(complete.last(), Some(&true));
            let g = round.finish().unwrap();
            let mut p = Params::from_image(Framed::from_chunks(g.image));
            assert_eq!(**p.values(), want_p, "blocks of {chunk_bytes} bytes");
            assert_eq!(g.momentum, want_m, "blocks of {chunk_bytes} bytes");
        }
    }

    /// Each round builds its image in the buffers of the version before the current one, as
    /// the server chains them (no pull holds that image any more): the same memory, and the
    /// same bits as the serial steps. A block a slow pull still holds is left to it (built
    /// elsewhere) and keeps its bits.
    #[test]
    fn a_round_builds_its_image_in_the_buffers_of_the_version_before() {
        let n = 5_000;
        let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0 };
        let g: Vec<f32> = (0..n).map(|i| val(1, i)).collect();
        let (mut want_p, mut want_m) = (vec![0.5f32; n], vec![0.0f32; n]);
        let mut params = Params::from_values(want_p.clone());
        let mut momentum = Arc::new(want_m.clone());
        let (mut bufs, mut spare) = (Vec::new(), Vec::new());
        let (mut addrs, mut held) = (Vec::new(), None);
        for version in 1..=4u64 {
            let image_bufs = std::mem::take(&mut spare);
            let start = Start { params, momentum, next_momentum: Vec::new(), image_bufs };
            let round = Round::new(version, start, 4_000, cfg, [0].into());
            round.join(0).unwrap();
            round.add(0, 0, le(&g));
            assert!(round.done(0, (n * 4) as u64));
            let f = round.finish().unwrap();
            sgd_step(&cfg, &mut want_p, &g, &mut want_m, 1.0);
            addrs.push(f.image.iter().map(|c| c.message().as_ptr() as usize).collect::<Vec<_>>());
            if version == 2 {
                held = Some((f.image[1].clone(), f.image[1].message().to_vec()));
            }
            params = Params::from_image(Framed::from_chunks(f.image));
            assert_eq!(**params.clone().values(), want_p, "version {version}");
            assert_eq!(f.momentum, want_m, "version {version}");
            momentum = Arc::new(f.momentum);
            spare = std::mem::replace(&mut bufs, f.image_bufs);
        }
        assert_eq!(addrs[0].len(), 5);
        assert_eq!(addrs[2], addrs[0], "version 3 not built in version 1's buffers");
        assert_eq!(addrs[3][0], addrs[1][0], "version 4 not built in version 2's buffers");
        assert_ne!(addrs[3][1], addrs[1][1], "built over a block a pull still holds");
        let (chunk, bits) = held.unwrap();
        assert_eq!(chunk.message().to_vec(), bits);
    }

    /// A failed push withdraws its own gradient only: once the rank's restarted process has
    /// joined again, the old push's failure leaves the new one in the round. A rank the round
    /// does not expect (back after it began) is refused.
    #[test]
    fn a_failed_push_withdraws_only_its_own_gradient() {
        let n = 100;
        let cfg = SgdConfig { lr: 0.5, momentum: 0.0, weight_decay: 0.0 };
        let start = Start {
            params: Params::from_values(vec![1.0; n]),
            momentum: Arc::new(vec![0.0; n]),
            ..Start::default()
        };
        let round = Round::new(1, start, 40, cfg, [0, 1].into());
        round.join(0).unwrap();
        let old = round.serial(0);
        round.add(0, 0, le(&[2.0; 30]));
        // The process died; its comeback withdraws the gradient and pushes again.
        round.remove(0);
        round.join(0).unwrap();
        round.add(0, 0, le(&vec![2.0; n]));
        // The old push's stream now fails: nothing of the new push goes.
        round.remove_push(0, old);
        assert!(round.has(0));
        assert!(!round.done(0, 400));
        round.join(1).unwrap();
        round.add(1, 0, le(&vec![2.0; n]));
        assert!(round.done(1, 400));
        let err = round.join(2).unwrap_err().to_string();
        assert!(err.contains("rank 2 is not expected in the step to version 1"), "{err}");
    }

    /// A contributor withdrawn after blocks were stepped throws them away (epoch bump) and the
    /// round steps again from block 0 without it.
    #[test]
    fn withdrawing_a_rank_restarts_the_stepped_blocks() {
        let n = 100;
        let cfg = SgdConfig { lr: 0.5, momentum: 0.0, weight_decay: 0.0 };
        let start = Start {
            params: Params::from_values(vec![1.0; n]),
            momentum: Arc::new(vec![0.0; n]),
            ..Start::default()
        };
        let round = Round::new(1, start, 40, cfg, [0, 1].into());
        let rx = round.subscribe();
        round.join(0).unwrap();
        round.join(1).unwrap();
        round.add(0, 0, le(&vec![2.0; n]));
        round.add(1, 0, le(&[4.0; 50]));
        assert_eq!((rx.borrow().stepped, rx.borrow().epoch), (5, 0));
        round.remove(1);
        assert_eq!((rx.borrow().stepped, rx.borrow().epoch), (0, 1));
        assert!(round.chunk(0, 0).is_none(), "blocks of the old epoch are gone");
        assert!(!round.done(0, 400));
        assert!(round.set_expected([0].into()), "rank 0 alone completes the step");
        let f = round.finish().unwrap();
        let mut p = Params::from_image(Framed::from_chunks(f.image));
        assert_eq!(**p.values(), vec![0.0; n], "1 - 0.5 * 2, rank 1's 4.0 not in it");
        assert!(round.finish().is_none(), "taken once");
    }

    /// Finiteness is checked on the sum: a NaN or Inf in one rank's block refuses that rank
    /// alone (withdrawn, blocks stepped with it thrown away), even when another rank's value
    /// at the same place would cancel it; the refusal ends when the rank joins again. A sum
    /// that overflows from finite values is no refusal.
    #[test]
    fn a_non_finite_rank_is_refused_while_summing() {
        let n = 100;
        let cfg = SgdConfig { lr: 0.5, momentum: 0.0, weight_decay: 0.0 };
        let start = |v: f32| Start {
            params: Params::from_values(vec![v; n]),
            momentum: Arc::new(vec![0.0; n]),
            ..Start::default()
        };
        let round = Round::new(1, start(1.0), 160, cfg, [0, 1, 2].into());
        let rx = round.subscribe();
        for k in 0..3 {
            round.join(k).unwrap();
        }
        let mut bad = vec![2.0; n];
        bad[95] = f32::INFINITY;
        let mut cancels = vec![2.0; n];
        cancels[95] = f32::NEG_INFINITY;
        assert!(round.add(0, 0, le(&vec![2.0; n])));
        // Blocks of 40 values: the Inf and the -Inf are in the third.
        assert!(round.add(1, 0, le(&bad[..50])));
        assert!(round.add(2, 0, le(&cancels[..60])));
        assert_eq!(rx.borrow().stepped, 1);
        assert!(round.add(1, 50, le(&bad[50..])));
        assert_eq!(rx.borrow().stepped, 1, "rank 2's block 1 is not in yet");
        assert!(
            !round.add(2, 60, le(&cancels[60..])),
            "the third block holds rank 1's Inf and rank 2's -Inf"
        );
        assert_eq!(rx.borrow().refused, [1, 2].into());
        assert_eq!((rx.borrow().stepped, rx.borrow().epoch), (0, 1), "block 0 had them in it");
        assert!(!round.add(1, 0, le(&[0.0])), "a refused rank's further pieces are not taken");
        assert!(!round.done(0, 400));
        // Both push again, finite this time: the round completes with all three.
        for k in [1, 2] {
            round.join(k).unwrap();
            assert!(round.add(k, 0, le(&vec![2.0; n])));
        }
        assert!(rx.borrow().refused.is_empty());
        round.done(1, 400);
        assert!(round.done(2, 400));
        let f = round.finish().unwrap();
        let mut p = Params::from_image(Framed::from_chunks(f.image));
        assert_eq!(**p.values(), vec![0.0; n], "1 - 0.5 * 2");

        // A rank whose Inf waits in a block another rank has not sent: found when asked (its
        // stream ended), not before.
        let round = Round::new(1, start(1.0), 160, cfg, [0, 1].into());
        let rx = round.subscribe();
        round.join(0).unwrap();
        round.join(1).unwrap();
        assert!(round.add(1, 0, le(&bad)));
        assert!(round.add(0, 0, le(&[2.0; 50])));
        assert!(rx.borrow().refused.is_empty(), "the Inf is in a block not summed yet");
        assert!(!round.refuse_if_non_finite(0));
        assert!(round.refuse_if_non_finite(1));
        assert_eq!((rx.borrow().refused.clone(), rx.borrow().epoch), ([1].into(), 1));

        // Two finite gradients whose sum overflows: stepped, as a serial step would.
        let round = Round::new(1, start(0.0), 160, cfg, [0, 1].into());
        for k in 0..2 {
            round.join(k).unwrap();
            assert!(round.add(k, 0, le(&vec![f32::MAX; n])));
        }
        round.done(0, 400);
        assert!(round.done(1, 400), "not refused");
        assert!(round.subscribe().borrow().refused.is_empty());
    }
}
