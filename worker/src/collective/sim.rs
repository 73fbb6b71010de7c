//! A simulated network for the collectives, in the manner of raft-rs's test harness: the ring
//! and chain algorithms run unchanged over in-memory [`Links`], with faults injected by rule
//! ([`Fault`]: a dead rank, a silent link, a slow link, a cut connection, a torn frame, a slow
//! rank) and every run decided by a seed.
//!
//! Each rank is a thread, but only one of them runs at a time: a rank gives up its turn at every
//! send and receive, and the network hands it to a rank picked from those that can go on by a
//! seeded generator, so one seed is one interleaving, the same on every run, and a loop over
//! seeds visits many. Time is virtual: when no rank can go on, the clock jumps to the next
//! event (a delayed frame arriving, a wait expiring), so a 60 s timeout costs nothing and
//! expires at exactly 60 s.
//!
//! Links behave as the TCP mesh's do, minus the kernel's timing: one ordered stream per
//! direction and pair of ranks, unbounded (a send never waits); frames carry the real 8-byte
//! header, checked by the real [`parse_header`]; a closed stream still delivers what was sent
//! before it closed, then reads as the end of the stream; a write to a closed stream is a
//! broken pipe. After a failure, [`SimComm`] does what `TcpComm` does: blame the rank an
//! abort notice names, refuse later calls, and send its own notice to every peer before
//! closing. Unlike sockets, a close never discards a notice already sent, which is what lets a
//! dead-peer test name the right rank every time.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use gradsync_core::rng::Rng;

use super::error::{CollectiveError, Result};
use super::frame::{frame_header, parse_header, peer_err};
use super::handshake::{abort_notice, ends_with_abort};
use super::link::{Duplex, Links, Op, returned};
use super::reduce::{Values, sum_into};
use super::ring::{self, Phases};
use super::{Collective, Half, RingConfig, Traffic, chain, segment};

/// How long a rank thread may wait for its turn, in real time, before the simulation counts
/// as stalled (a bug in the harness or a rank blocked outside it).
const STALL: Duration = Duration::from_secs(120);

/// A fault the network injects, by rule. Frames are counted from 0 per rank (`Die`) or per
/// link (the others).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Fault {
    /// `rank` dies when it is about to send its frame number `after` (0: before the run
    /// starts): its links close at once, without an abort notice, as a killed process's do.
    Die { rank: usize, after: usize },
    /// The link `from -> to` goes silent from its frame `at` on: frames, abort notices and
    /// its closing all vanish, and the receiver sees only silence (a partition).
    Silence { from: usize, to: usize, at: usize },
    /// Every frame on the link `from -> to` arrives `by` later (in order).
    Delay { from: usize, to: usize, by: Duration },
    /// The connection between `from` and `to` is reset when `from` sends its frame `at` to
    /// `to`: that frame is lost, both directions close, the sender sees the reset.
    Cut { from: usize, to: usize, at: usize },
    /// Frame `at` on the link `from -> to` arrives with its header and half of its values,
    /// then the connection closes both ways (the sender's write went through).
    Torn { from: usize, to: usize, at: usize },
    /// `rank` takes `per_frame` before each frame it sends (a slow peer, not a slow link).
    Slow { rank: usize, per_frame: Duration },
}

/// One frame on its way: the header as it would be on the wire, the values, when it may be
/// read, and whether the connection broke in the middle of it.
struct Frame {
    at: Duration,
    head: [u8; 8],
    vals: Vec<f32>,
    torn: bool,
}

/// One direction of one connection.
#[derive(Default)]
struct Pipe {
    frames: VecDeque<Frame>,
    closed: bool,
    /// Frames sent on it so far (what the link faults count).
    sent: usize,
    /// When its last frame arrives: frames never overtake each other.
    last_at: Duration,
    /// Whether a [`Fault::Silence`] cut it off: nothing more gets through, not even its
    /// closing.
    partitioned: bool,
}

/// What a rank that cannot go on waits for.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// A frame from `from` (or its stream's end), until `until`.
    Frame { from: usize, until: Duration },
    /// Nothing, until `until`.
    Sleep { until: Duration },
}

#[derive(Debug, Clone, Copy)]
enum Status {
    Ready,
    Waiting(Wait),
    Done,
}

struct State {
    world: usize,
    now: Duration,
    /// `pipes[from * world + to]`.
    pipes: Vec<Pipe>,
    status: Vec<Status>,
    dead: Vec<bool>,
    /// Frames each rank has sent, on any link.
    sent_by: Vec<usize>,
    /// The rank whose turn it is.
    turn: Option<usize>,
    rng: Rng,
    faults: Vec<Fault>,
    /// Turns handed out: the length of the interleaving.
    turns: u64,
    /// A fingerprint of the interleaving: who got each turn.
    schedule: u64,
}

impl State {
    fn pipe(&mut self, from: usize, to: usize) -> &mut Pipe {
        &mut self.pipes[from * self.world + to]
    }

    /// When the wait of a rank is over (now, if it is), given the frames on their way.
    fn wakes_at(&self, me: usize, w: Wait) -> Duration {
        match w {
            Wait::Sleep { until } => until,
            Wait::Frame { from, until } => {
                let p = &self.pipes[from * self.world + me];
                match p.frames.front() {
                    Some(f) => f.at.min(until),
                    None if p.closed => self.now,
                    None => until,
                }
            }
        }
    }

    /// Hand the turn to a rank that can go on, picked by the seed, moving the clock to the
    /// next event when none can.
    fn pass(&mut self) {
        loop {
            let can: Vec<usize> = (0..self.world)
                .filter(|&r| match self.status[r] {
                    Status::Ready => true,
                    Status::Waiting(w) => self.wakes_at(r, w) <= self.now,
                    Status::Done => false,
                })
                .collect();
            if !can.is_empty() {
                let pick = can[self.rng.below(can.len() as u64) as usize];
                self.status[pick] = Status::Ready;
                self.turn = Some(pick);
                self.turns += 1;
                self.schedule = (self.schedule ^ pick as u64).wrapping_mul(0x0100_0000_01b3);
                return;
            }
            let next = (0..self.world)
                .filter_map(|r| match self.status[r] {
                    Status::Waiting(w) => Some(self.wakes_at(r, w)),
                    _ => None,
                })
                .min();
            match next {
                Some(t) => self.now = t,
                None => {
                    self.turn = None;
                    return;
                }
            }
        }
    }

    /// Close every stream to and from `rank`, after an abort notice blaming `notice` on each
    /// one out of it that is still open.
    fn close(&mut self, rank: usize, notice: Option<usize>) {
        let now = self.now;
        for peer in (0..self.world).filter(|&p| p != rank) {
            let out = self.pipe(rank, peer);
            if !out.partitioned {
                if let (Some(culprit), false) = (notice, out.closed) {
                    let at = out.last_at.max(now);
                    let head = abort_notice(culprit);
                    out.frames.push_back(Frame { at, head, vals: Vec::new(), torn: false });
                    out.last_at = at;
                }
                out.closed = true;
            }
            let into = self.pipe(peer, rank);
            if !into.partitioned {
                into.closed = true;
            }
        }
    }

    fn kill(&mut self, rank: usize) {
        self.dead[rank] = true;
        self.close(rank, None);
    }
}

/// The simulated network of one run.
pub(crate) struct SimNet {
    state: Mutex<State>,
    bell: Condvar,
    cfg: RingConfig,
}

impl SimNet {
    /// A network of `world` ranks with these faults, its interleaving decided by `seed`.
    pub(crate) fn new(world: usize, cfg: RingConfig, seed: u64, faults: &[Fault]) -> Arc<SimNet> {
        let mut s = State {
            world,
            now: Duration::ZERO,
            pipes: (0..world * world).map(|_| Pipe::default()).collect(),
            status: vec![Status::Ready; world],
            dead: vec![false; world],
            sent_by: vec![0; world],
            turn: None,
            rng: Rng::new(seed, 0x5157),
            faults: faults.to_vec(),
            turns: 0,
            schedule: 0xcbf2_9ce4_8422_2325,
        };
        for f in faults {
            if let Fault::Die { rank, after: 0 } = *f {
                s.kill(rank);
            }
        }
        s.pass();
        Arc::new(SimNet { state: Mutex::new(s), bell: Condvar::new(), cfg })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Block until it is `me`'s turn.
    fn wait_turn<'a>(&'a self, me: usize, mut g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let start = Instant::now();
        while g.turn != Some(me) {
            assert!(
                start.elapsed() < STALL,
                "the simulation stalled: rank {me} waited {STALL:?} for its turn"
            );
            g = self.bell.wait_timeout(g, Duration::from_secs(1)).unwrap_or_else(PoisonError::into_inner).0;
        }
        g
    }

    /// Give up the turn in state `status` and take it back when the network hands it over.
    fn reschedule<'a>(
        &'a self,
        me: usize,
        mut g: MutexGuard<'a, State>,
        status: Status,
    ) -> MutexGuard<'a, State> {
        g.status[me] = status;
        g.pass();
        self.bell.notify_all();
        self.wait_turn(me, g)
    }

    /// Leave the network: `me`'s streams close (no notice: a process that exits), and the
    /// turn passes on.
    fn leave(&self, me: usize) {
        let mut g = self.lock();
        g.close(me, None);
        g.status[me] = Status::Done;
        if g.turn == Some(me) {
            g.pass();
        }
        self.bell.notify_all();
    }

    fn killed(op: Op, me: usize) -> CollectiveError {
        CollectiveError::Invalid {
            what: "simulated rank",
            why: format!("rank {me} was killed during {}", op.name()),
        }
    }

    /// Send one frame of `vals` from `me` to `to`.
    fn send(&self, me: usize, to: usize, op: Op, values: Values, vals: &[f32]) -> Result<()> {
        let head = frame_header(op, values, vals.len())?;
        let mut g = self.reschedule(me, self.lock(), Status::Ready);
        let slow: Duration = g
            .faults
            .iter()
            .filter_map(|f| match *f {
                Fault::Slow { rank, per_frame } if rank == me => Some(per_frame),
                _ => None,
            })
            .sum();
        if !slow.is_zero() {
            let until = g.now + slow;
            g = self.reschedule(me, g, Status::Waiting(Wait::Sleep { until }));
        }
        if g.faults
            .iter()
            .any(|f| matches!(*f, Fault::Die { rank, after } if rank == me && after == g.sent_by[me]))
        {
            g.kill(me);
        }
        if g.dead[me] {
            return Err(Self::killed(op, me));
        }
        let t = self.cfg.timeout;
        if g.pipe(me, to).closed {
            return Err(peer_err(to, op, t)(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the peer closed the connection",
            )));
        }
        let n = g.pipe(me, to).sent;
        g.pipe(me, to).sent += 1;
        g.sent_by[me] += 1;
        let (mut delay, mut torn) = (Duration::ZERO, false);
        for f in g.faults.clone() {
            match f {
                Fault::Cut { from, to: dst, at } if (from, dst, at) == (me, to, n) => {
                    g.pipe(me, to).closed = true;
                    g.pipe(to, me).closed = true;
                    let reset = io::Error::new(io::ErrorKind::ConnectionReset, "the connection was reset");
                    return Err(peer_err(to, op, t)(reset));
                }
                Fault::Silence { from, to: dst, at } if (from, dst) == (me, to) && n >= at => {
                    g.pipe(me, to).partitioned = true;
                    return Ok(());
                }
                Fault::Delay { from, to: dst, by } if (from, dst) == (me, to) => delay += by,
                Fault::Torn { from, to: dst, at } if (from, dst, at) == (me, to, n) => torn = true,
                _ => {}
            }
        }
        let now = g.now;
        let p = g.pipe(me, to);
        let at = p.last_at.max(now + delay);
        let vals = if torn { vals[..vals.len() / 2].to_vec() } else { vals.to_vec() };
        p.frames.push_back(Frame { at, head, vals, torn });
        p.last_at = at;
        if torn {
            p.closed = true;
            g.pipe(to, me).closed = true;
        }
        Ok(())
    }

    /// Receive one frame from `from` into `dst` (added into it when `add`), waiting at most
    /// the timeout.
    fn recv(
        &self,
        me: usize,
        from: usize,
        (op, values): (Op, Values),
        dst: &mut [f32],
        add: bool,
    ) -> Result<()> {
        let t = self.cfg.timeout;
        let mut g = self.reschedule(me, self.lock(), Status::Ready);
        let until = g.now + t;
        loop {
            if g.dead[me] {
                return Err(Self::killed(op, me));
            }
            let now = g.now;
            let p = g.pipe(from, me);
            let due = p.frames.front().is_some_and(|f| f.at <= now);
            match if due { p.frames.pop_front() } else { None } {
                Some(f) => {
                    parse_header(&f.head, op, values, dst.len(), from)?;
                    if f.torn {
                        let why = "the connection closed in the middle of a frame";
                        let cut = io::Error::new(io::ErrorKind::UnexpectedEof, why);
                        return Err(CollectiveError::Peer { peer: from, op: op.name(), source: cut });
                    }
                    if add {
                        sum_into(values, dst, &f.vals);
                    } else {
                        dst.copy_from_slice(&f.vals);
                    }
                    return Ok(());
                }
                None if p.frames.is_empty() && p.closed => {
                    return Err(peer_err(from, op, t)(io::ErrorKind::UnexpectedEof.into()));
                }
                None if now >= until => {
                    return Err(CollectiveError::Timeout { peer: from, op: op.name(), timeout: t });
                }
                None => g = self.reschedule(me, g, Status::Waiting(Wait::Frame { from, until })),
            }
        }
    }

    /// `me` does nothing for `d` (a rank alive but busy elsewhere).
    fn sleep(&self, me: usize, d: Duration) {
        let mut g = self.reschedule(me, self.lock(), Status::Ready);
        let until = g.now + d;
        g = self.reschedule(me, g, Status::Waiting(Wait::Sleep { until }));
        drop(g);
    }

    /// What `TcpComm`'s mesh does with a connection error: a peer whose stream ends with an
    /// abort notice gave up because of the rank it names, so that rank is blamed.
    fn blame(&self, me: usize, e: CollectiveError) -> CollectiveError {
        let CollectiveError::Peer { peer, op, .. } = e else { return e };
        let mut g = self.lock();
        let p = g.pipe(peer, me);
        let notice = p.frames.back().filter(|_| p.closed).and_then(|f| ends_with_abort(&f.head));
        p.frames.clear();
        match notice {
            Some(culprit) => CollectiveError::Aborted { peer, culprit, op },
            None => e,
        }
    }

    /// `me` gives up: an abort notice blaming `culprit` to every peer, then its streams close.
    fn abort(&self, me: usize, culprit: usize) {
        let mut g = self.lock();
        if !g.dead[me] {
            g.close(me, Some(culprit));
        }
    }

    /// The virtual time now.
    pub(crate) fn now(&self) -> Duration {
        self.lock().now
    }

    /// Turns handed out so far, and a fingerprint of who got them.
    pub(crate) fn schedule(&self) -> (u64, u64) {
        let g = self.lock();
        (g.turns, g.schedule)
    }
}

/// One rank's communicator over a [`SimNet`]: the algorithms of the host backend, with
/// `TcpComm`'s handling of failures.
pub(crate) struct SimComm {
    net: Arc<SimNet>,
    rank: usize,
    world: usize,
    poisoned: Option<String>,
    traffic: Traffic,
}

impl SimComm {
    /// Rank `rank`'s communicator; returns once it is this rank's turn.
    pub(crate) fn enter(net: Arc<SimNet>, rank: usize) -> SimComm {
        let world = net.lock().world;
        drop(net.wait_turn(rank, net.lock()));
        SimComm { net, rank, world, poisoned: None, traffic: Traffic::default() }
    }

    /// The network's virtual time now.
    pub(crate) fn now(&self) -> Duration {
        self.net.now()
    }

    /// Stay silent for `d` of virtual time: alive, links open, not calling.
    pub(crate) fn sleep(&mut self, d: Duration) {
        self.net.sleep(self.rank, d);
    }

    /// As `TcpComm::guarded`: refuse to start after a failure; after one, blame the rank a
    /// notice names and tell every peer whom to blame.
    fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.poisoned {
            return Err(CollectiveError::Invalid {
                what: "communicator",
                why: format!("{} after an earlier failure: {why}", op.name()),
            });
        }
        let out = f(self).map_err(|e| self.net.blame(self.rank, e));
        if let Err(e) = &out
            && !matches!(e, CollectiveError::Invalid { .. })
        {
            self.poisoned = Some(e.to_string());
            self.net.abort(self.rank, e.culprit().unwrap_or(self.rank));
        }
        out
    }
}

impl Drop for SimComm {
    fn drop(&mut self) {
        self.net.leave(self.rank);
    }
}

/// The chunks of one ring or chain operation, to the right neighbour and from the left.
struct SimDuplex<'n, 'b> {
    net: &'n SimNet,
    me: usize,
    left: usize,
    right: usize,
    op: Op,
    values: Values,
    sent_back: Vec<(usize, &'b mut [f32])>,
    traffic: Traffic,
}

impl<'b> Duplex<'b> for SimDuplex<'_, 'b> {
    fn send(&mut self, id: usize, chunk: &'b mut [f32]) -> Result<()> {
        self.net.send(self.me, self.right, self.op, self.values, chunk)?;
        self.traffic.sent += chunk.len() as u64 * 4;
        self.sent_back.push((id, chunk));
        Ok(())
    }

    fn take_back(&mut self, id: usize) -> Result<&'b mut [f32]> {
        // Sends never wait here, so a chunk is back as soon as it was sent.
        returned(&mut self.sent_back, false, id).unwrap_or_else(|| {
            Err(CollectiveError::Invalid { what: "ring schedule", why: format!("chunk {id} is still out") })
        })
    }

    fn recv(&mut self, dst: &mut [f32], add: bool) -> Result<()> {
        self.net.recv(self.me, self.left, (self.op, self.values), dst, add)?;
        self.traffic.recv += dst.len() as u64 * 4;
        Ok(())
    }
}

impl Links for SimComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn chunk_values(&self) -> usize {
        self.net.cfg.chunk_values()
    }

    fn over_neighbours<'b, T>(
        &mut self,
        op: Op,
        values: Values,
        _bytes: usize,
        body: impl FnOnce(&mut dyn Duplex<'b>) -> Result<T>,
    ) -> Result<T> {
        let (w, r) = (self.world, self.rank);
        let mut d = SimDuplex {
            net: &self.net,
            me: r,
            left: (r + w - 1) % w,
            right: (r + 1) % w,
            op,
            values,
            sent_back: Vec::new(),
            traffic: Traffic::default(),
        };
        let out = body(&mut d);
        self.traffic += d.traffic;
        out
    }

    fn send_frame(&mut self, peer: usize, op: Op, vals: &[f32]) -> Result<()> {
        self.net.send(self.rank, peer, op, Values::F32, vals)?;
        self.traffic.sent += vals.len() as u64 * 4;
        Ok(())
    }

    fn recv_frame(&mut self, peer: usize, op: Op, dst: &mut [f32]) -> Result<()> {
        self.net.recv(self.rank, peer, (op, Values::F32), dst, false)?;
        self.traffic.recv += dst.len() as u64 * 4;
        Ok(())
    }
}

impl Collective for SimComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }

    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllReduce, |c| ring::run(c, buf, Phases::Both, Op::AllReduce, Values::F32))
    }

    fn all_reduce_half(&mut self, packed: &mut [f32], half: Half) -> Result<()> {
        self.guarded(Op::AllReduce, |c| {
            ring::run(c, packed, Phases::Both, Op::AllReduce, Values::Packed(half))
        })
    }

    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        let mine = segment(buf.len(), self.world, self.rank);
        self.guarded(Op::ReduceScatter, |c| {
            ring::run(c, buf, Phases::ReduceScatter, Op::ReduceScatter, Values::F32)
        })?;
        Ok(mine)
    }

    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        self.guarded(Op::AllGather, |c| ring::run(c, buf, Phases::AllGather, Op::AllGather, Values::F32))
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Broadcast, |c| chain::broadcast(c, buf, root, Values::F32))
    }

    fn reduce(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Reduce, |c| chain::reduce(c, buf, root, Values::F32))
    }

    fn gather(&mut self, send: &[f32], out: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Gather, |c| chain::gather(c, send, out, root))
    }

    fn scatter(&mut self, src: &[f32], recv: &mut [f32], root: usize) -> Result<()> {
        self.guarded(Op::Scatter, |c| chain::scatter(c, src, recv, root))
    }

    fn send(&mut self, buf: &[f32], peer: usize) -> Result<()> {
        self.guarded(Op::SendRecv, |c| chain::send_to(c, buf, peer, Op::SendRecv))
    }

    fn recv(&mut self, buf: &mut [f32], peer: usize) -> Result<()> {
        self.guarded(Op::SendRecv, |c| chain::recv_from(c, buf, peer, Op::SendRecv))
    }

    fn barrier(&mut self) -> Result<()> {
        let world = self.world;
        self.guarded(Op::Barrier, |c| {
            let mut one = [1.0f32];
            ring::run(c, &mut one, Phases::Both, Op::Barrier, Values::F32)?;
            if one[0] != world as f32 {
                return Err(CollectiveError::Protocol {
                    peer: (c.rank + 1) % world,
                    why: format!("barrier counted {} ranks, expected {world}", one[0]),
                });
            }
            Ok(())
        })
    }
}

/// What one simulated run returns: each rank's result, the virtual time it took, and its
/// interleaving (the number of turns, and a fingerprint of who got them).
#[derive(Debug)]
pub(crate) struct Outcome<T> {
    pub(crate) results: Vec<T>,
    pub(crate) elapsed: Duration,
    pub(crate) schedule: (u64, u64),
}

/// Run `body` for every rank of a `world`-rank network with `faults`, interleaved by `seed`.
pub(crate) fn run<T: Send>(
    world: usize,
    cfg: RingConfig,
    seed: u64,
    faults: &[Fault],
    body: impl Fn(SimComm) -> T + Sync,
) -> Outcome<T> {
    let net = SimNet::new(world, cfg, seed, faults);
    let results = std::thread::scope(|s| {
        let body = &body;
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let net = net.clone();
                s.spawn(move || body(SimComm::enter(net, r)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    Outcome { results, elapsed: net.now(), schedule: net.schedule() }
}
