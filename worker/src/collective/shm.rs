//! The shared-memory transport: ring neighbours on the same host (and in the same network
//! namespace) exchange chunks through memory they both map instead of through loopback
//! sockets, the way NCCL's SHM transport and MPI's shared-memory channels do. On loopback
//! every byte of a socket crosses the kernel twice on the same cores; here it is written once
//! into the ring by the sender and reduced once out of it by the receiver, straight into the
//! destination buffer.
//!
//! ```text
//!   rank r-1 ──writes──> [ mailbox of rank r: bell | head | tail | data ring ] ──reads──> rank r
//!                          (a 2 MiB file in /dev/shm, unlinked once both neighbours mapped it)
//! ```
//!
//! Each rank owns one mailbox: a single-producer single-consumer byte ring its left neighbour
//! writes frames into (the same 8-byte header as on the wire, then the values), plus the
//! rank's *bell*, a futex word every event this rank may wait for bumps: its left neighbour
//! after publishing data, its right neighbour after freeing room in the ring this rank writes
//! to. One word for both events lets a single thread wait for "data in or room out" at once.
//! A waiter spins briefly, then sleeps on the bell (a shared futex, so it works across
//! processes) in slices of at most [`WAIT_SLICE`]; between slices it checks that the peer it
//! waits for is alive (its TCP link, idle while the rings are in use, has not reached end of
//! file) and has not failed (its mailbox's abort flag). A peer that stays silent for the
//! communicator's timeout is reported by rank, as on sockets.
//!
//! The TCP mesh stays up beside the rings: it carries the set-up, the direct transfers
//! (gather, scatter, send/recv), and tells a dead peer from a slow one.
//!
//! Set-up, right after the TCP mesh connects (three rounds of one JSON line to every peer):
//! 1. every rank says where it is (boot id and network namespace) and what it asked for
//!    ([`survey`]); all ranks see the same answers, so they all take the same decision, here
//!    and in `hier` (every rank must be given the same `--transport` and `--hierarchy`: with
//!    `tcp` and `off` there is no set-up at all);
//! 2. every rank of the ring (all ranks, or in a hierarchical all-reduce the ranks of one
//!    host) creates its mailbox and names it to the others;
//! 3. every rank of the ring maps its two neighbours' mailboxes and says whether that worked;
//!    the owners then unlink their files (the mappings stay). Only if every rank of the ring
//!    succeeded does it use the mailboxes; with `auto`, any failure means sockets.
//!
//! One file of about 700 lines on purpose: the mailbox layout, the engine's wait protocol and
//! the set-up that hands out the mappings share the invariants every `unsafe` block here
//! relies on (who writes which bytes when), and they are checked together.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::{MmapMut, MmapOptions};
use serde::{Deserialize, Serialize};

use super::error::{CollectiveError, Result};
use super::frame::{Link, frame_header, parse_header};
use super::handshake::{read_line, write_line};
use super::link::{Duplex, Op, returned};
use super::reduce::{Values, sum_into};
use super::{Hierarchy, RingConfig, Traffic, Transport};

/// Bytes of each mailbox's data ring: many pipelined pieces, small enough that the rings of
/// several ranks stay in the last-level cache (2 MiB with 128 KiB pieces measured ahead of
/// 4 MiB with 256 KiB and of 8 MiB with 1 MiB at 16-256 MB with 4 ranks, side by side).
const RING_BYTES: usize = 2 << 20;
/// Where the data ring starts in the mailbox (the control block fills the first page).
const DATA_OFFSET: usize = 4096;
/// The most bytes moved between two publications: the receiver starts on a piece while the
/// sender writes the next, and reduces data still in cache.
const PIECE: usize = 128 << 10;
/// Checks of the rings before sleeping on the bell (about a microsecond): enough to catch a
/// peer just behind without two system calls, short enough not to hold a core the peer needs
/// (more ranks than cores, or other work on the machine). Measured on a loaded 2-core
/// machine, 2-rank all-reduces of 8 B: 8 us with this, 16 us with a 5 us spin, 70-180 us
/// with 20-50 us spins.
const SPINS: u32 = 100;
/// The longest a waiter sleeps before checking that its peer is still alive.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// A bell ring for data published into the owner's ring.
const DATA: u32 = 1;
/// A bell ring for room freed in the ring the owner writes to.
const ROOM: u32 = 2;
/// Both, and failures, which end any wait.
const ANY: u32 = DATA | ROOM;
/// Marks an initialised mailbox ("gradshm1").
const MAGIC: u64 = 0x6772_6164_7368_6d31;

/// One cache line, so that words written by different ranks never share one.
#[repr(C, align(64))]
struct Line<T>(T);

/// The control block at the start of a mailbox. Only atomics: every bit pattern is valid, and
/// both processes read and write it concurrently.
#[repr(C)]
struct Control {
    /// [`MAGIC`] once the owner has initialised the block.
    magic: Line<AtomicU64>,
    /// A random number the owner also sends over TCP: proves the mapping is the right file.
    nonce: Line<AtomicU64>,
    /// Bytes of the data ring.
    cap: Line<AtomicU64>,
    /// The owner's futex word, bumped by every event it may be waiting for.
    bell: Line<AtomicU32>,
    /// What the owner sleeps (or is about to sleep) on the bell for: [`DATA`] and/or
    /// [`ROOM`]; zero while it is awake. Events nobody waits for cost no system call.
    waiters: Line<AtomicU32>,
    /// Set by the owner when it fails mid-operation: its neighbours stop at once.
    aborted: Line<AtomicU32>,
    /// Bytes written into the ring so far (by the left neighbour).
    head: Line<AtomicU64>,
    /// Bytes consumed so far (by the owner).
    tail: Line<AtomicU64>,
}

const _: () = assert!(std::mem::size_of::<Control>() <= DATA_OFFSET);

/// A mapped mailbox.
struct Mailbox {
    map: MmapMut,
    cap: usize,
}

impl Mailbox {
    fn ctl(&self) -> &Control {
        // SAFETY: the mapping is page-aligned and at least DATA_OFFSET >= size_of::<Control>()
        // bytes long (checked when mapped); Control consists of atomics only, for which any
        // bit pattern (the file starts zeroed) is valid, and which may be shared with other
        // processes: lock-free atomics are address-free on the platforms Rust supports.
        unsafe { &*self.map.as_ptr().cast::<Control>() }
    }

    /// The first byte of the data ring.
    fn data(&self) -> *mut u8 {
        // SAFETY: DATA_OFFSET + cap bytes are mapped (checked when mapped).
        unsafe { self.map.as_ptr().cast_mut().add(DATA_OFFSET) }
    }

    /// Bytes published and not yet consumed. Acquire on both ends: the consumer then sees the
    /// data, the producer sees the consumer done with the room.
    fn filled(&self) -> usize {
        let c = self.ctl();
        let tail = c.tail.0.load(Ordering::Acquire);
        (c.head.0.load(Ordering::Acquire) - tail) as usize
    }

    /// Wake the owner if it sleeps waiting for `event` ([`DATA`]: this mailbox's ring gained
    /// data; [`ROOM`]: its owner's outgoing ring gained room).
    fn ring(&self, event: u32) {
        let c = self.ctl();
        c.bell.0.fetch_add(1, Ordering::SeqCst);
        // Only the first ring after the owner registered pays for the system call: it clears
        // the registration (unless the owner changed it meanwhile), and the owner registers
        // again before it next sleeps.
        let want = c.waiters.0.load(Ordering::SeqCst);
        if want & event != 0
            && c.waiters.0.compare_exchange(want, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok()
        {
            futex_wake(&c.bell.0);
        }
    }

    /// Create this rank's mailbox at `path`, initialised, with `nonce`.
    fn create(path: &Path, nonce: u64) -> io::Result<Mailbox> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        let made = Self::init(&file, nonce);
        if made.is_err() {
            let _ = std::fs::remove_file(path);
        }
        made
    }

    fn init(file: &File, nonce: u64) -> io::Result<Mailbox> {
        let len = (DATA_OFFSET + RING_BYTES) as libc::off_t;
        // Reserve the pages now: a full /dev/shm must be an error here, not a SIGBUS on the
        // first write into a sparse page later (MAP_POPULATE ignores failures).
        // SAFETY: a valid descriptor we own, a non-negative range.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: the file was just created by this process with O_EXCL and is only resized
        // by nobody; peers change its contents only through the atomics of Control and the
        // ring's free space, as the protocol of this module allows.
        let map = unsafe { MmapOptions::new().len(DATA_OFFSET + RING_BYTES).populate().map_mut(file)? };
        let m = Mailbox { map, cap: RING_BYTES };
        let c = m.ctl();
        c.cap.0.store(RING_BYTES as u64, Ordering::Relaxed);
        c.nonce.0.store(nonce, Ordering::Relaxed);
        c.magic.0.store(MAGIC, Ordering::Release);
        Ok(m)
    }

    /// Map a neighbour's mailbox, checking that it is the one announced.
    fn open(path: &Path, nonce: u64) -> io::Result<Mailbox> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        if len != (DATA_OFFSET + RING_BYTES) as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{len} bytes long")));
        }
        // SAFETY: a file of the expected length; its contents change only through the
        // atomics of Control and the ring's free space, as this module's protocol allows.
        let map = unsafe { MmapOptions::new().len(DATA_OFFSET + RING_BYTES).populate().map_mut(&file)? };
        let m = Mailbox { map, cap: RING_BYTES };
        let c = m.ctl();
        let ok = c.magic.0.load(Ordering::Acquire) == MAGIC
            && c.nonce.0.load(Ordering::Relaxed) == nonce
            && c.cap.0.load(Ordering::Relaxed) == RING_BYTES as u64;
        if !ok {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not the mailbox announced"));
        }
        Ok(m)
    }
}

/// `FUTEX_WAIT` on a word shared between processes (not `FUTEX_PRIVATE`): sleep while `word`
/// holds `seen`, at most `t`. Returns false on timeout.
fn futex_wait(word: &AtomicU32, seen: u32, t: Duration) -> bool {
    let ts = libc::timespec { tv_sec: t.as_secs() as libc::time_t, tv_nsec: t.subsec_nanos() as _ };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call, and `ts` a valid
    // timespec; FUTEX_WAIT reads the word and sleeps, it writes nothing.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    !(rc == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT))
}

/// `FUTEX_WAKE` one sleeper on a shared word.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE only looks up sleepers on it.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1i32, std::ptr::null::<u8>(), 0, 0);
    }
}

/// Whether the peer behind `fd` has closed its end (or its process died). While the rings are
/// in use the link is idle, except for a peer already sending the frames of a later direct
/// transfer, which is alive.
fn peer_gone(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n <= 0 {
        return false;
    }
    if p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
        return true;
    }
    let mut b = 0u8;
    // SAFETY: a one-byte buffer we own; MSG_PEEK leaves the byte in the socket.
    let got = unsafe { libc::recv(fd, (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    got == 0 || (got < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock)
}

/// Where this thread runs, as far as sharing memory goes: the boot (a host, this boot) and
/// the network namespace (ranks in different namespaces on one host, as in an emulated
/// cluster, keep to their shaped links). The thread's own namespace, not the process's: a
/// thread moved into an emulated host with `setns` belongs to that host. `host_id` replaces
/// both when given ([`RingConfig::host_id`]).
fn place(host_id: Option<&str>) -> String {
    if let Some(id) = host_id {
        return format!("id:{id}");
    }
    let net = std::fs::metadata("/proc/thread-self/ns/net")
        .or_else(|_| std::fs::metadata("/proc/self/ns/net"))
        .map(|m| m.ino())
        .unwrap_or(0);
    format!("{}/net:{net}", machine())
}

/// The machine this thread runs on: its kernel's boot id (empty where there is none to read).
/// Ranks on one machine share its cores whatever their network namespaces (emulated hosts,
/// containers) or `host_id`.
fn machine() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|b| b.trim().to_string())
        .unwrap_or_default()
}

/// Whether the ranks of some machine in `all` outnumber its cores (every rank finds the same).
pub(crate) fn crowded(all: &[Where]) -> bool {
    all.iter().any(|w| {
        !w.machine.is_empty()
            && w.cores > 0
            && all.iter().filter(|o| o.machine == w.machine).count() > w.cores
    })
}

/// How many ranks of `all` (this rank, `me`, included) run on this rank's machine and so share
/// its cores; `None` where the machine is unknown.
pub(crate) fn sharing_cores(all: &[Where], me: usize) -> Option<usize> {
    let mine = &all.get(me)?.machine;
    (!mine.is_empty()).then(|| all.iter().filter(|w| &w.machine == mine).count())
}

/// Round 1: where a rank is and what it asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Where {
    /// The host (and network namespace) it runs on: ranks with equal places share memory.
    pub(crate) place: String,
    /// Its `--transport`.
    pub(crate) transport: Transport,
    /// Its `--hierarchy`.
    pub(crate) hierarchy: Hierarchy,
    /// The machine it runs on (see [`sharing_cores`]).
    #[serde(default)]
    pub(crate) machine: String,
    /// That machine's cores (0: unknown).
    #[serde(default)]
    pub(crate) cores: usize,
    /// Its `--chunk-kb` in bytes (0: not said), and whether the ranks may cut smaller chunks
    /// together (none was given): every rank must cut the same chunks.
    #[serde(default)]
    pub(crate) chunk_bytes: usize,
    #[serde(default)]
    pub(crate) chunk_auto: bool,
}

/// Round 1 of the set-up: tell every peer where this rank is and what it asked for, and
/// learn the same of them; every rank ends with the same list, by rank.
pub(crate) fn survey(links: &mut [Option<Link>], rank: usize, cfg: &RingConfig) -> Result<Vec<Where>> {
    let mine = Where {
        place: place(cfg.host_id.as_deref()),
        transport: cfg.transport,
        hierarchy: cfg.hierarchy,
        machine: machine(),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        chunk_bytes: cfg.chunk_bytes,
        chunk_auto: cfg.chunk_auto,
    };
    let all: Vec<usize> = (0..links.len()).collect();
    exchange(links, &all, rank, &mine)
}

/// Round 2: a rank's mailbox, or why it has none.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Offer {
    path: Option<PathBuf>,
    nonce: u64,
    error: Option<String>,
}

/// Round 3: whether a rank mapped its neighbours' mailboxes.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Mapped {
    error: Option<String>,
}

/// Whether the ring may use shared memory, given every rank's [`Where`] (`me`'s included).
/// Every rank computes the same answer from the same lines; a rank that asked for `shm` gets
/// an error naming the rank that prevents it.
pub(crate) fn decide(all: &[Where], me: usize) -> Result<bool> {
    let here = &all[me].place;
    let blocker = all.iter().enumerate().find_map(|(r, w)| {
        if &w.place != here {
            Some(format!("rank {r} is on another host or network namespace ({} vs {here})", w.place))
        } else {
            None
        }
    });
    match blocker {
        None => Ok(true),
        Some(why) if all[me].transport == Transport::Shm => {
            Err(CollectiveError::Invalid { what: "transport", why: format!("--transport shm: {why}") })
        }
        Some(why) => {
            if all[me].transport == Transport::Auto {
                tracing::debug!("ring over sockets: {why}");
            }
            Ok(false)
        }
    }
}

/// Send `mine` to every other rank of `members`, then read each one's line; the answers come
/// in the order of `members`, `me`'s slot (`members[me]` is this rank) holding `mine`.
fn exchange<T>(links: &mut [Option<Link>], members: &[usize], me: usize, mine: &T) -> Result<Vec<T>>
where
    T: Serialize + for<'de> Deserialize<'de> + Clone,
{
    let io = |peer: usize| {
        move |e: io::Error| CollectiveError::Protocol { peer, why: format!("transport set-up: {e}") }
    };
    let no_link =
        |peer: usize| CollectiveError::Invalid { what: "peer", why: format!("no link to rank {peer}") };
    for (i, &peer) in members.iter().enumerate() {
        if i != me {
            let l = links.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| no_link(peer))?;
            write_line(&mut l.writer, mine).map_err(io(peer))?;
        }
    }
    let mut out = Vec::with_capacity(members.len());
    for (i, &peer) in members.iter().enumerate() {
        out.push(if i == me {
            mine.clone()
        } else {
            let l = links.get(peer).and_then(Option::as_ref).ok_or_else(|| no_link(peer))?;
            read_line(&l.reader).map_err(io(peer))?
        });
    }
    Ok(out)
}

/// A mailbox file name no other process uses, and a random nonce (std's randomly keyed
/// SipHash, so no extra crate).
fn fresh_name(rank: usize) -> (PathBuf, u64) {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(rank);
    let nonce = h.finish();
    let path = PathBuf::from(format!("/dev/shm/gradsync-{}-{rank}-{nonce:016x}", std::process::id()));
    (path, nonce)
}

/// Removes a mailbox's name when dropped: once the neighbours have mapped it, or when the
/// set-up fails part-way.
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The shared-memory rings of one rank: its own mailbox (data in from the left) and its
/// neighbours' (data out to the right; the left's bell, rung when room frees up).
pub(crate) struct Shm {
    own: Mailbox,
    left: Mailbox,
    right: Mailbox,
    left_rank: usize,
    right_rank: usize,
    /// The TCP links to the neighbours, watched for a peer's death.
    left_fd: RawFd,
    right_fd: RawFd,
}

impl Shm {
    /// Set up the rings among `members` (global ranks in ring order, `members[me]` this rank;
    /// rounds 2 and 3 of the module documentation, only between them), once round 1 has
    /// decided that they share memory. `None`: they keep to sockets (with `--transport auto`,
    /// when some rank could not create or map a mailbox; with `shm` that is an error).
    pub(crate) fn setup(
        links: &mut [Option<Link>],
        members: &[usize],
        me: usize,
        cfg: &RingConfig,
    ) -> Result<Option<Shm>> {
        let world = members.len();
        if world < 2 {
            return Ok(None);
        }
        let rank = members[me];
        let (path, nonce) = fresh_name(rank);
        let own = Mailbox::create(&path, nonce);
        let unlink = own.is_ok().then(|| Unlink(path.clone()));
        let offer = match &own {
            Ok(_) => Offer { path: Some(path.clone()), nonce, error: None },
            Err(e) => Offer { path: None, nonce, error: Some(format!("creating {}: {e}", path.display())) },
        };
        let offers = exchange(links, members, me, &offer)?;
        let (left_at, right_at) = ((me + world - 1) % world, (me + 1) % world);
        let (left_rank, right_rank) = (members[left_at], members[right_at]);
        let open = |at: usize| -> std::result::Result<Mailbox, String> {
            let (o, r) = (&offers[at], members[at]);
            match (&o.path, &o.error) {
                (Some(p), _) => Mailbox::open(p, o.nonce)
                    .map_err(|e| format!("rank {rank} cannot map rank {r}'s {}: {e}", p.display())),
                (None, e) => Err(format!("rank {r} has no mailbox: {}", e.as_deref().unwrap_or("?"))),
            }
        };
        let peers = open(left_at).and_then(|l| Ok((l, open(right_at)?)));
        let mapped = exchange(links, members, me, &Mapped { error: peers.as_ref().err().cloned() })?;
        // Every neighbour has mapped it (or given up): the name is no longer needed, and a
        // crash from here on leaves nothing behind in /dev/shm.
        drop(unlink);
        let failed = mapped.iter().find_map(|m| m.error.clone());
        let (own, (left, right)) = match (own, peers, failed) {
            (Ok(own), Ok(peers), None) => (own, peers),
            (own, peers, failed) => {
                let why = failed
                    .or_else(|| own.err().map(|e| e.to_string()))
                    .or_else(|| peers.err())
                    .unwrap_or_default();
                if cfg.transport == Transport::Shm {
                    return Err(CollectiveError::Invalid {
                        what: "transport",
                        why: format!("--transport shm: {why}"),
                    });
                }
                tracing::warn!("shared memory unavailable, the ring uses sockets: {why}");
                return Ok(None);
            }
        };
        let fd = |r: usize| links[r].as_ref().map(|l| l.reader.as_raw_fd());
        let (Some(left_fd), Some(right_fd)) = (fd(left_rank), fd(right_rank)) else {
            return Err(CollectiveError::Invalid { what: "peer", why: "no link to a ring neighbour".into() });
        };
        Ok(Some(Shm { own, left, right, left_rank, right_rank, left_fd, right_fd }))
    }

    /// Tell the neighbours this rank failed, and wake them.
    pub(crate) fn abort(&self) {
        self.own.ctl().aborted.0.store(1, Ordering::SeqCst);
        self.left.ring(ANY);
        self.right.ring(ANY);
    }

    /// Run `body` over the rings to and from the neighbours; `body`'s result and the payload
    /// bytes moved once everything queued has been written.
    pub(crate) fn duplex<'b, T>(
        &self,
        op: Op,
        values: Values,
        timeout: Duration,
        body: impl FnOnce(&mut dyn Duplex<'b>) -> Result<T>,
    ) -> Result<(T, Traffic)> {
        let mut p = ShmPump {
            shm: self,
            op,
            values,
            timeout,
            queue: VecDeque::new(),
            sent_back: Vec::new(),
            traffic: Traffic::default(),
            progress: Instant::now(),
        };
        let out = body(&mut p)?;
        while !p.queue.is_empty() {
            if !p.write_some() {
                p.wait(0)?;
            }
        }
        Ok((out, p.traffic))
    }
}

/// A chunk being written into the right neighbour's ring: its header, then its values.
struct Outgoing<'b> {
    id: usize,
    head: [u8; 8],
    chunk: &'b mut [f32],
    /// Bytes of header + values written so far.
    done: usize,
}

/// The engine over the rings: one thread that writes to the right whenever there is room and
/// reads (reducing) from the left whenever there is data, sleeping on its bell when it can do
/// neither.
struct ShmPump<'s, 'b> {
    shm: &'s Shm,
    op: Op,
    values: Values,
    timeout: Duration,
    queue: VecDeque<Outgoing<'b>>,
    sent_back: Vec<(usize, &'b mut [f32])>,
    traffic: Traffic,
    /// When anything last moved: the timeout counts from here.
    progress: Instant,
}

impl ShmPump<'_, '_> {
    /// Bytes waiting in this rank's own ring.
    fn available(&self) -> usize {
        self.shm.own.filled()
    }

    /// Free bytes in the right neighbour's ring.
    fn room(&self) -> usize {
        self.shm.right.cap - self.shm.right.filled()
    }

    /// Write as much of the queue as the right neighbour's ring takes now; whether anything
    /// moved.
    fn write_some(&mut self) -> bool {
        let out = &self.shm.right;
        let c = out.ctl();
        let mut moved = false;
        while let Some(o) = self.queue.front_mut() {
            let room = out.cap - out.filled();
            if room == 0 {
                break;
            }
            let payload: &[u8] = bytemuck::cast_slice(&*o.chunk);
            let total = 8 + payload.len();
            let n = room.min(total - o.done).min(PIECE);
            let mut head = c.head.0.load(Ordering::Relaxed);
            let mut from = o.done;
            while from < o.done + n {
                let (src, at) = if from < 8 { (&o.head[..], from) } else { (payload, from - 8) };
                let len = (src.len() - at).min(o.done + n - from);
                put(out, head, &src[at..at + len]);
                head += len as u64;
                from += len;
            }
            c.head.0.store(head, Ordering::Release);
            out.ring(DATA);
            o.done += n;
            moved = true;
            if o.done == total {
                self.traffic.sent += payload.len() as u64;
                if let Some(o) = self.queue.pop_front() {
                    self.sent_back.push((o.id, o.chunk));
                }
            }
        }
        if moved {
            self.progress = Instant::now();
        }
        moved
    }

    /// Consume `n` bytes of this rank's ring (already available) with `f(bytes)`, wrapping
    /// as needed, then free their room for the left neighbour.
    fn consume(&mut self, n: usize, mut f: impl FnMut(&[u8])) {
        let own = &self.shm.own;
        let c = own.ctl();
        let tail = c.tail.0.load(Ordering::Relaxed);
        let at = (tail % own.cap as u64) as usize;
        let first = n.min(own.cap - at);
        // SAFETY: [tail, tail + n) lies within what the producer published (head was loaded
        // with Acquire in `available`, and n <= available), so those bytes are written and the
        // producer will not touch them until `tail` moves past them below; the two pieces lie
        // within the `cap` bytes of the data ring.
        unsafe {
            f(std::slice::from_raw_parts(own.data().add(at), first));
            if first < n {
                f(std::slice::from_raw_parts(own.data(), n - first));
            }
        }
        c.tail.0.store(tail + n as u64, Ordering::Release);
        self.shm.left.ring(ROOM);
        self.progress = Instant::now();
    }

    /// Block until `need` bytes wait in this rank's ring (if `need > 0`; a header is read
    /// whole, so a half-written one must not end the wait) or room frees up on the right (if
    /// anything is queued); fail if the awaited peer died, failed, or stayed silent for the
    /// whole timeout.
    fn wait(&mut self, need: usize) -> Result<()> {
        let (reading, writing) = (need > 0, !self.queue.is_empty());
        let ready = |p: &Self| (reading && p.available() >= need) || (writing && p.room() > 0);
        for _ in 0..SPINS {
            if ready(self) {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let c = self.shm.own.ctl();
        let mut slice_over = false;
        loop {
            // Say what would wake this rank before the last look (the notifier publishes, then
            // reads this word: one of the two sees the other's write).
            let want = if reading { DATA } else { 0 } | if writing { ROOM } else { 0 };
            c.waiters.0.store(want, Ordering::SeqCst);
            let seen = c.bell.0.load(Ordering::SeqCst);
            let stuck = if ready(self) { Ok(false) } else { self.why_stuck(reading, writing, slice_over) };
            if !matches!(stuck, Ok(true)) {
                c.waiters.0.store(0, Ordering::SeqCst);
                return stuck.map(|_| ());
            }
            let left = self.timeout.saturating_sub(self.progress.elapsed());
            slice_over = !futex_wait(&c.bell.0, seen, left.min(WAIT_SLICE));
            c.waiters.0.store(0, Ordering::SeqCst);
        }
    }

    /// Nothing can move: `Ok(true)` to go on waiting, or the error that explains why nothing
    /// ever will, the root cause first: this rank's own timeout, then a neighbour waited for
    /// that died (checked after each sleep that ran its full slice, or once a neighbour
    /// flagged a failure, which may be only a consequence), then the neighbour's failure.
    fn why_stuck(&self, reading: bool, writing: bool, slice_over: bool) -> Result<bool> {
        let (left, right) = (self.shm.left_rank, self.shm.right_rank);
        if self.progress.elapsed() >= self.timeout {
            let peer = if reading { left } else { right };
            return Err(CollectiveError::Timeout { peer, op: self.op.name(), timeout: self.timeout });
        }
        let flagged = |m: &Mailbox| m.ctl().aborted.0.load(Ordering::SeqCst) != 0;
        let aborted = [(&self.shm.left, left), (&self.shm.right, right)]
            .into_iter()
            .find_map(|(m, peer)| flagged(m).then_some(peer));
        if slice_over || aborted.is_some() {
            let watched = [(reading, left, self.shm.left_fd), (writing, right, self.shm.right_fd)];
            if let Some(&(_, peer, _)) = watched.iter().find(|(w, _, fd)| *w && peer_gone(*fd)) {
                return Err(CollectiveError::Peer {
                    peer,
                    op: self.op.name(),
                    source: io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed its connection"),
                });
            }
        }
        match aborted {
            Some(peer) => Err(CollectiveError::Peer {
                peer,
                op: self.op.name(),
                source: io::Error::other("the peer failed and left the collective"),
            }),
            None => Ok(true),
        }
    }
}

/// Copy `src` into `m`'s ring at byte position `pos`, wrapping at the end.
fn put(m: &Mailbox, pos: u64, src: &[u8]) {
    let at = (pos % m.cap as u64) as usize;
    let first = src.len().min(m.cap - at);
    // SAFETY: the caller writes only into free room ([head, tail + cap)), which the consumer
    // does not read until `head` is published past it; both pieces lie within the ring, and
    // `src` is this process's memory, never the ring itself.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), m.data().add(at), first);
        std::ptr::copy_nonoverlapping(src.as_ptr().add(first), m.data(), src.len() - first);
    }
}

impl<'b> Duplex<'b> for ShmPump<'_, 'b> {
    fn send(&mut self, id: usize, chunk: &'b mut [f32]) -> Result<()> {
        let head = frame_header(self.op, self.values, chunk.len())?;
        self.queue.push_back(Outgoing { id, head, chunk, done: 0 });
        self.write_some();
        Ok(())
    }

    fn take_back(&mut self, id: usize) -> Result<&'b mut [f32]> {
        loop {
            let queued = self.queue.iter().any(|o| o.id == id);
            if let Some(done) = returned(&mut self.sent_back, queued, id) {
                return done;
            }
            if !self.write_some() {
                self.wait(0)?;
            }
        }
    }

    fn recv(&mut self, dst: &mut [f32], add: bool) -> Result<()> {
        // The header arrives whole: the producer always has room for 8 bytes once everything
        // before them is consumed.
        while self.available() < 8 {
            if !self.write_some() {
                self.wait(8)?;
            }
        }
        let mut head = [0u8; 8];
        let mut at = 0;
        self.consume(8, |b| {
            head[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        });
        parse_header(&head, self.op, self.values, dst.len(), self.shm.left_rank)?;
        // Values are 4-byte aligned in the ring (every write is a multiple of 4 bytes), so
        // they are read in place: reduced (or copied) straight from the ring into `dst`.
        let mut done = 0;
        while done < dst.len() {
            let avail = self.available() / 4;
            if avail == 0 {
                if !self.write_some() {
                    self.wait(4)?;
                }
                continue;
            }
            let n = avail.min(dst.len() - done).min(PIECE / 4);
            let mut at = done;
            let values = self.values;
            self.consume(n * 4, |b| {
                let vals: &[f32] = bytemuck::cast_slice(b);
                let d = &mut dst[at..at + vals.len()];
                if add {
                    sum_into(values, d, vals);
                } else {
                    d.copy_from_slice(vals);
                }
                at += vals.len();
            });
            done += n;
            // Keep the right neighbour fed while this rank reduces.
            self.write_some();
        }
        self.traffic.recv += dst.len() as u64 * 4;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Hierarchy, Transport, Where, decide};

    fn w(place: &str, t: Transport) -> Where {
        Where {
            place: place.into(),
            transport: t,
            hierarchy: Hierarchy::Auto,
            machine: String::new(),
            cores: 0,
            chunk_bytes: 0,
            chunk_auto: false,
        }
    }

    #[test]
    fn shared_memory_only_when_every_rank_is_here_and_willing() {
        let (a, s) = (Transport::Auto, Transport::Shm);
        assert!(decide(&[w("h/net:1", a), w("h/net:1", a), w("h/net:1", s)], 0).unwrap());
        // Another network namespace on the same host: sockets, or an error naming it.
        let split = [w("h/net:1", a), w("h/net:2", a), w("h/net:1", s)];
        assert!(!decide(&split, 0).unwrap());
        let e = decide(&split, 2).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("network namespace"), "{e}");
        // Another host.
        let e = decide(&[w("h/net:1", s), w("g/net:1", a)], 0).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("another host"), "{e}");
    }
}
