//! Every collective of the TCP backend against a serial reference, for 1 to 8 ranks and
//! awkward sizes (zero, smaller than the world, not divisible by it, many pipelined chunks),
//! on both transports: sockets only, and shared memory (the rings in `/dev/shm`) for the ring
//! and chain collectives. Ranks are threads, each with its own communicator over real
//! loopback sockets, meeting through the real rendezvous store. Inputs are small integers, so
//! every sum is exact.
//!
//! NCCL runs the same check with up to three ranks, one GPU each (NCCL refuses two ranks on
//! one GPU): on a real GPU machine with as many GPUs as it has, and everywhere else against
//! the fake CUDA and NCCL of gradsync-testkit (four fake GPUs), in a child process. The NCCL
//! tests also check the failure paths: a set-up that times out, a call that times out, both
//! aborting the communicator before any buffer it uses is freed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::time::Duration;

use gradsync_testkit::{Counters, GpuRun, gpu_test};
use gradsync_worker::collective::{
    After, Collective, Half, Hierarchy, Nccl, RingConfig, SocketEngine, TcpComm, Transport,
    all_reduce_as_half, nccl, pack, packed_len, segment, unpack,
};
use gradsync_worker::rendezvous::{RendezvousConfig, join_with_store};

#[derive(Debug, Clone, Copy)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    Gather,
    Scatter,
    SendRecv,
    Barrier,
}

/// Sizes to try with `world` ranks.
fn sizes(world: usize) -> Vec<usize> {
    let mut v = vec![0, 1, world.saturating_sub(1), world + 1, 3 * world + 2, 1001];
    v.sort();
    v.dedup();
    v
}

fn input(rank: usize, i: usize) -> f32 {
    ((rank * 131 + i * 17) % 23) as f32 - 11.0
}

/// Small chunks, so even 1001 values travel as many pipelined frames.
fn cfg() -> RingConfig {
    RingConfig {
        timeout: Duration::from_secs(20),
        chunk_bytes: 64,
        socket_buffer: None,
        transport: Transport::Tcp,
        ..RingConfig::default()
    }
}

thread_local! {
    /// Chunk size for the groups this test thread makes (large-buffer tests raise it).
    static CHUNK: std::cell::Cell<usize> = const { std::cell::Cell::new(64) };
    /// The socket engine for the groups this test thread makes.
    static ENGINE: std::cell::Cell<SocketEngine> = const { std::cell::Cell::new(SocketEngine::Auto) };
}

/// `world` connected communicators on `transport`, one per thread, through the rendezvous
/// store.
fn with_group<T: Send>(world: usize, transport: Transport, body: impl Fn(TcpComm) -> T + Sync) -> Vec<T> {
    let chunk_bytes = CHUNK.with(|c| c.get());
    with_ranks(
        world,
        |_| RingConfig { chunk_bytes, transport, engine: ENGINE.with(|e| e.get()), ..cfg() },
        |c| {
            // The transport asked for is the one in use (threads share a host).
            if transport != Transport::Auto && c.world_size() > 1 {
                assert_eq!(c.transport(), transport);
            }
            body(c)
        },
    )
}

/// `world` connected communicators, rank `r` configured with `cfg(r)`, one per thread,
/// through the rendezvous store.
fn with_ranks<T: Send>(
    world: usize,
    cfg: impl Fn(usize) -> RingConfig + Sync,
    body: impl Fn(TcpComm) -> T + Sync,
) -> Vec<T> {
    let store = TcpListener::bind("127.0.0.1:0").unwrap();
    let master = store.local_addr().unwrap().to_string();
    let mut store = Some(store);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let rc = RendezvousConfig {
                    master: master.clone(),
                    rank,
                    world,
                    fingerprint: "mlp:test".into(),
                    token: Some("secret".into()),
                    timeout: Duration::from_secs(20),
                    nccl: false,
                    generation: 0,
                };
                let l = if rank == 0 { store.take() } else { None };
                let (body, cfg) = (&body, &cfg);
                s.spawn(move || {
                    let comm = if world == 1 {
                        TcpComm::single(cfg(rank))
                    } else {
                        let j = join_with_store(&rc, l).unwrap();
                        TcpComm::connect(j.listener, &j.mesh, cfg(rank)).unwrap()
                    };
                    body(comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Run `op` on `n` values on one rank; returns what the rank ends with that the reference
/// determines (empty where the operation leaves it unspecified).
fn run_op(c: &mut dyn Collective, op: Op, n: usize) -> Vec<f32> {
    let (r, w) = (c.rank(), c.world_size());
    let root = (w - 1) / 2;
    let mut buf: Vec<f32> = (0..n).map(|i| input(r, i)).collect();
    match op {
        Op::AllReduce => {
            c.all_reduce(&mut buf).unwrap();
            buf
        }
        Op::ReduceScatter => {
            let mine = c.reduce_scatter(&mut buf).unwrap();
            assert_eq!(mine, segment(n, w, r));
            buf[mine].to_vec()
        }
        Op::AllGather => {
            c.all_gather(&mut buf).unwrap();
            buf
        }
        Op::Broadcast => {
            c.broadcast(&mut buf, root).unwrap();
            buf
        }
        Op::Reduce => {
            c.reduce(&mut buf, root).unwrap();
            if r == root { buf } else { vec![] }
        }
        Op::Gather => {
            let mut out = vec![f32::NAN; if r == root { n * w } else { 0 }];
            c.gather(&buf, &mut out, root).unwrap();
            out
        }
        Op::Scatter => {
            let src: Vec<f32> = if r == root { (0..n * w).map(|i| input(r, i)).collect() } else { vec![] };
            let mut got = vec![f32::NAN; n];
            c.scatter(&src, &mut got, root).unwrap();
            got
        }
        Op::SendRecv => {
            if w == 1 {
                return vec![];
            }
            // A ring shift: even ranks send first, odd ranks receive first.
            let mut got = vec![f32::NAN; n];
            let (to, from) = ((r + 1) % w, (r + w - 1) % w);
            if r % 2 == 0 {
                c.send(&buf, to).unwrap();
                c.recv(&mut got, from).unwrap();
            } else {
                c.recv(&mut got, from).unwrap();
                c.send(&buf, to).unwrap();
            }
            got
        }
        Op::Barrier => {
            c.barrier().unwrap();
            vec![]
        }
    }
}

/// The serial reference for rank `r`.
fn expected(op: Op, w: usize, r: usize, n: usize) -> Vec<f32> {
    let root = (w - 1) / 2;
    let sum = |i: usize| (0..w).map(|k| input(k, i)).sum::<f32>();
    match op {
        Op::AllReduce => (0..n).map(sum).collect(),
        Op::ReduceScatter => segment(n, w, r).map(sum).collect(),
        Op::AllGather => (0..w).flat_map(|k| segment(n, w, k).map(move |i| input(k, i))).collect(),
        Op::Broadcast => (0..n).map(|i| input(root, i)).collect(),
        Op::Reduce if r == root => (0..n).map(sum).collect(),
        Op::Gather if r == root => (0..w).flat_map(|k| (0..n).map(move |i| input(k, i))).collect(),
        Op::Reduce | Op::Gather | Op::Barrier => vec![],
        Op::Scatter => (r * n..(r + 1) * n).map(|i| input(root, i)).collect(),
        Op::SendRecv if w == 1 => vec![],
        Op::SendRecv => (0..n).map(|i| input((r + w - 1) % w, i)).collect(),
    }
}

/// The generic test: every size for `op` with every world size from 1 to 8.
fn check(op: Op, transport: Transport) {
    for world in 1..=8 {
        let results = with_group(world, transport, |mut c| {
            let mut per_size = Vec::new();
            for n in sizes(world) {
                per_size.push((n, run_op(&mut c, op, n)));
            }
            (c.rank(), per_size, c.traffic())
        });
        for (rank, per_size, _) in results {
            for (n, got) in per_size {
                let want = expected(op, world, rank, n);
                assert_eq!(got, want, "{op:?} over {transport:?}, {world} ranks, {n} values, rank {rank}");
            }
        }
    }
}

/// One test per operation and transport.
macro_rules! per_transport {
    ($($name:ident: $op:expr),* $(,)?) => {
        /// Sockets only.
        mod tcp {
            use super::*;
            $(#[test]
            fn $name() {
                check($op, Transport::Tcp);
            })*
        }

        /// Shared memory for the ring and chains (gather, scatter and send/recv stay on
        /// sockets).
        mod shm {
            use super::*;
            $(#[test]
            fn $name() {
                check($op, Transport::Shm);
            })*
        }
    };
}

per_transport! {
    all_reduce: Op::AllReduce,
    reduce_scatter: Op::ReduceScatter,
    all_gather: Op::AllGather,
    broadcast: Op::Broadcast,
    reduce: Op::Reduce,
    gather: Op::Gather,
    scatter: Op::Scatter,
    send_recv: Op::SendRecv,
    barrier: Op::Barrier,
}

/// Buffers of 4 MiB and more take the two-thread engine on sockets where it is asked for,
/// and wrap around the shared-memory rings (2 MiB each) many times: the same reference must
/// hold.
fn large_buffers(transport: Transport, engine: SocketEngine) {
    CHUNK.with(|c| c.set(64 << 10));
    ENGINE.with(|e| e.set(engine));
    let n = (1 << 20) + 3;
    for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather, Op::Broadcast, Op::Reduce] {
        for world in [2, 3, 4] {
            for (rank, got) in with_group(world, transport, |mut c| (c.rank(), run_op(&mut c, op, n))) {
                assert!(
                    got == expected(op, world, rank, n),
                    "{op:?} over {transport:?}, {world} ranks, {n} values, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn large_buffers_on_the_threaded_engine() {
    large_buffers(Transport::Tcp, SocketEngine::SenderThread);
}

#[test]
fn large_buffers_on_the_one_thread_engine() {
    large_buffers(Transport::Tcp, SocketEngine::OneThread);
}

#[test]
fn large_buffers_over_shared_memory() {
    large_buffers(Transport::Shm, SocketEngine::Auto);
}

#[test]
fn auto_picks_shared_memory_on_one_host() {
    for (_, t) in with_group(3, Transport::Auto, |c| (c.rank(), c.transport())) {
        assert_eq!(t, Transport::Shm);
    }
}

/// Ranks at different addresses of one machine (here 127.0.0.1, .2 and .3, as emulated hosts
/// or containers would be) share its cores: each counts all three as on its machine, so large
/// transfers do not get a sender thread per rank that would only take turns on the same cores.
/// Without the set-up (sockets only, no hierarchy) a rank counts those at its own address.
#[test]
fn ranks_count_every_rank_on_their_machine_whatever_its_address() {
    use gradsync_worker::collective::tcp::MeshInfo;
    for (hierarchy, want) in [(Hierarchy::Auto, 3), (Hierarchy::Off, 1)] {
        let ls: Vec<TcpListener> =
            (1..=3).map(|i| TcpListener::bind(format!("127.0.0.{i}:0")).unwrap()).collect();
        let addrs: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
        let counts: Vec<usize> = std::thread::scope(|s| {
            let hs: Vec<_> = ls
                .into_iter()
                .enumerate()
                .map(|(rank, l)| {
                    let info = MeshInfo {
                        rank,
                        addrs: addrs.clone(),
                        fingerprint: "fp".into(),
                        token: Some("t".into()),
                    };
                    let cfg = RingConfig { hierarchy, ..cfg() };
                    s.spawn(move || TcpComm::connect(l, &info, cfg).unwrap().ranks_on_this_machine())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(counts, vec![want; 3], "--hierarchy {hierarchy:?}");
    }
}

/// Where the ranks of a flat ring on sockets outnumber their machine's cores, they cut 256 KiB
/// chunks together, unless a chunk size was given; the sums stay exact either way.
#[test]
fn ranks_crowding_the_cores_cut_smaller_chunks_together() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let world = cores + 1;
    for (auto, want) in [(true, 256 << 10), (false, 1 << 20)] {
        let ring = |_| RingConfig { chunk_bytes: 1 << 20, chunk_auto: auto, ..cfg() };
        let got = with_ranks(world, ring, |mut c| {
            // 2.4 MB: segments of several 256 KiB chunks.
            let mut b: Vec<f32> = (0..600_000).map(|i| input(c.rank(), i)).collect();
            c.all_reduce(&mut b).unwrap();
            let exact = b.iter().enumerate().all(|(i, &v)| v == (0..world).map(|r| input(r, i)).sum::<f32>());
            (c.chunk_bytes(), exact)
        });
        assert_eq!(got, vec![(want, true); world], "chunk_auto {auto}, {world} ranks on {cores} cores");
    }
}

#[test]
fn all_reduce_traffic_is_the_ring_optimum() {
    // Each rank sends and receives 2 (W-1)/W of the buffer, in whole chunks of segments.
    let n = 4000;
    for (world, transport) in
        [(2, Transport::Tcp), (3, Transport::Tcp), (4, Transport::Tcp), (3, Transport::Shm)]
    {
        for (_, _, t) in with_group(world, transport, |mut c| {
            let mut b = vec![1.0f32; n];
            c.all_reduce(&mut b).unwrap();
            assert!(b.iter().all(|&v| v == world as f32));
            (c.rank(), (), c.traffic())
        }) {
            let want = (2 * (world - 1) * n / world * 4) as u64;
            // Uneven segments (4000 over 3) shift a few values between ranks.
            assert!(t.sent.abs_diff(want) <= 16 * world as u64, "{world} ranks: sent {} want {want}", t.sent);
            assert!(
                t.recv.abs_diff(want) <= 16 * world as u64,
                "{world} ranks: received {} want {want}",
                t.recv
            );
        }
    }
}

/// Ranks on emulated hosts: `hosts[r]` is rank `r`'s host, told to the communicator as its
/// host id (NCCL's `NCCL_HOSTID`), so threads of this process count as ranks of several hosts;
/// the links between "hosts" are loopback sockets, those inside them shared memory unless
/// `transport` is `Tcp`.
fn on_hosts<T: Send>(
    hosts: &[usize],
    transport: Transport,
    hierarchy: Hierarchy,
    body: impl Fn(TcpComm) -> T + Sync,
) -> Vec<T> {
    let chunk_bytes = CHUNK.with(|c| c.get());
    let cfg = |r: usize| RingConfig {
        chunk_bytes,
        transport,
        hierarchy,
        host_id: Some(format!("host{}", hosts[r])),
        ..cfg()
    };
    with_ranks(hosts.len(), cfg, body)
}

/// The hierarchical all-reduce against the serial sum on uneven and even layouts, sizes from
/// 0 and 1 value to many chunks, with the flat collectives (over sockets) run in between on
/// the same communicator; and what each rank says it ran.
fn hierarchical(transport: Transport) {
    CHUNK.with(|c| c.set(256));
    let layouts: [&[usize]; 4] = [&[0, 0, 1, 1], &[0, 0, 1, 1, 2, 2], &[0, 0, 0, 1, 1, 1], &[0, 1, 1]];
    for hosts in layouts {
        let (world, n_hosts) = (hosts.len(), hosts.iter().max().unwrap() + 1);
        let mut sizes = sizes(world);
        sizes.push(65_537);
        let results = on_hosts(hosts, transport, Hierarchy::Auto, |mut c| {
            let ran = (c.hosts(), c.transport());
            let mut got = Vec::new();
            for &n in &sizes {
                for op in [Op::AllReduce, Op::ReduceScatter, Op::AllReduce, Op::Broadcast] {
                    got.push((op, n, run_op(&mut c, op, n)));
                }
            }
            (c.rank(), ran, got)
        });
        for (rank, ran, got) in results {
            // A rank alone on its host has nobody to share memory with.
            let alone = hosts.iter().filter(|&&h| h == hosts[rank]).count() == 1;
            let inside = if alone { Transport::Tcp } else { transport };
            assert_eq!(ran, (Some(n_hosts), inside), "{hosts:?}, rank {rank}");
            for (op, n, got) in got {
                assert!(
                    got == expected(op, world, rank, n),
                    "{op:?} on hosts {hosts:?} over {transport:?}, {n} values, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn hierarchical_all_reduce_over_shared_memory_inside_hosts() {
    hierarchical(Transport::Shm);
}

#[test]
fn hierarchical_all_reduce_over_sockets_inside_hosts() {
    hierarchical(Transport::Tcp);
}

#[test]
fn hierarchical_all_reduce_of_large_buffers() {
    // Twelve-MiB buffers: the two-thread socket engine between leaders, rings wrapped many
    // times, and pieces of three sizes (the end pieces cut in steps).
    CHUNK.with(|c| c.set(64 << 10));
    let n = (3 << 20) + 3;
    for (rank, got) in on_hosts(&[0, 0, 1, 1], Transport::Auto, Hierarchy::Auto, |mut c| {
        (c.rank(), run_op(&mut c, Op::AllReduce, n))
    }) {
        assert!(got == expected(Op::AllReduce, 4, rank, n), "rank {rank}");
    }
}

#[test]
fn auto_decides_the_hierarchy_from_the_hosts() {
    let ran = |hosts: &[usize], h: Hierarchy| -> Vec<(Option<usize>, Transport)> {
        on_hosts(hosts, Transport::Auto, h, |mut c| {
            let mut b: Vec<f32> = (0..101).map(|i| input(c.rank(), i)).collect();
            c.all_reduce(&mut b).unwrap();
            assert_eq!(b, expected(Op::AllReduce, c.world_size(), c.rank(), 101));
            (c.hosts(), c.transport())
        })
    };
    let a = Hierarchy::Auto;
    // One host: the flat ring, on shared memory.
    assert!(ran(&[0, 0, 0, 0], a).iter().all(|&x| x == (None, Transport::Shm)));
    // Every rank its own host: the flat ring, on sockets.
    assert!(ran(&[0, 1, 2, 3], a).iter().all(|&x| x == (None, Transport::Tcp)));
    // Two hosts of two: through the hosts, shared memory inside them.
    assert!(ran(&[0, 0, 1, 1], a).iter().all(|&x| x == (Some(2), Transport::Shm)));
    // Forced either way.
    assert!(ran(&[0, 0, 1, 1], Hierarchy::Off).iter().all(|&x| x == (None, Transport::Tcp)));
    assert!(ran(&[0, 0, 0], Hierarchy::On).iter().all(|&x| x == (Some(1), Transport::Shm)));
    assert!(ran(&[0, 1, 2], Hierarchy::On).iter().all(|&x| x == (Some(3), Transport::Tcp)));
}

#[test]
fn hierarchical_traffic_crosses_hosts_once_per_leader() {
    // 2 hosts x 2: each non-leader sends its buffer to the leader once and receives the sum
    // once; each leader also runs the two-rank ring, 2 (H-1)/H = 1 buffer each way.
    let n = 4000;
    for (rank, t) in on_hosts(&[0, 0, 1, 1], Transport::Auto, Hierarchy::Auto, |mut c| {
        let mut b = vec![1.0f32; n];
        c.all_reduce(&mut b).unwrap();
        assert!(b.iter().all(|&v| v == 4.0));
        (c.rank(), c.traffic())
    }) {
        let bytes = (n * 4) as u64;
        let (sent, recv) = if rank % 2 == 0 { (2 * bytes, 2 * bytes) } else { (bytes, bytes) };
        assert_eq!((t.sent, t.recv), (sent, recv), "rank {rank}");
    }
}

/// `--compress fp16|bf16` on the ring: packed halves, summed in f32 at each hop and rounded
/// back. Small integers are exact in both formats (bf16 up to 256), so the result must equal
/// the exact sum; every rank must end with the same bits; the wire must carry two bytes a
/// value, half of what an f32 all-reduce moves.
#[test]
fn half_precision_all_reduce_sums_exactly_and_moves_half_the_bytes() {
    for transport in [Transport::Tcp, Transport::Shm] {
        for world in [2, 3, 4] {
            for half in [Half::F16, Half::Bf16] {
                for n in [1, 2, 7, 1001, 64 * 1024 + 3] {
                    let out = with_group(world, transport, |mut c| {
                        let r = c.rank();
                        let vals: Vec<f32> = (0..n).map(|i| input(r, i)).collect();
                        let mut packed = vec![0.0; packed_len(n)];
                        pack(half, &vals, &mut packed);
                        let before = c.traffic();
                        c.all_reduce_half(&mut packed, half).unwrap();
                        let half_sent = c.traffic().sent - before.sent;
                        let mut got = vec![0.0; n];
                        unpack(half, &packed, &mut got);
                        let mut plain = vals.clone();
                        let before = c.traffic();
                        c.all_reduce(&mut plain).unwrap();
                        (got, plain, half_sent, c.traffic().sent - before.sent)
                    });
                    let what = format!("{} over {transport:?}, {world} ranks, {n} values", half.name());
                    for (got, plain, half_sent, f32_sent) in &out {
                        assert!(got == plain, "{what}: the sum is not exact");
                        if n > 1000 {
                            let ratio = *half_sent as f64 / *f32_sent as f64;
                            assert!(
                                (0.45..=0.55).contains(&ratio),
                                "{what}: {half_sent} bytes against {f32_sent}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// DDP's `--compress fp16|bf16` sum (`all_reduce_as_half`): each rank rounds its share of the
/// mean, so gradients near 40000 (in range for fp16) whose sum over two to four ranks passes
/// fp16's largest value, 65504, still sum to a finite value within the rounding of the exact
/// one, the same bits on every rank; small integers over a power-of-two world stay exact.
#[test]
fn half_precision_sums_past_the_formats_range_stay_finite() {
    for transport in [Transport::Tcp, Transport::Shm] {
        for world in [2, 3, 4] {
            for half in [Half::F16, Half::Bf16] {
                let n = 1001;
                let big = |r: usize, i: usize| 40_000.0 + ((i * 7 + r * 13) % 101) as f32;
                let out = with_group(world, transport, |mut c| {
                    let r = c.rank();
                    let mut v: Vec<f32> = (0..n).map(|i| big(r, i)).collect();
                    all_reduce_as_half(&mut c, &mut v, half, &mut Vec::new()).unwrap();
                    let mut small: Vec<f32> = (0..n).map(|i| input(r, i)).collect();
                    all_reduce_as_half(&mut c, &mut small, half, &mut Vec::new()).unwrap();
                    (v, small)
                });
                let what = format!("{} over {transport:?}, {world} ranks", half.name());
                let eps = if half == Half::F16 { 1.0 / 1024.0 } else { 1.0 / 128.0 };
                for (rank, (v, small)) in out.iter().enumerate() {
                    assert!(
                        v.iter().zip(&out[0].0).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: rank {rank}"
                    );
                    for (i, g) in v.iter().enumerate() {
                        let exact: f32 = (0..world).map(|r| big(r, i)).sum();
                        assert!(
                            g.is_finite() && (g - exact).abs() <= world as f32 * eps * exact,
                            "{what} at {i}: {g}, exact {exact}"
                        );
                    }
                    if world.is_power_of_two() {
                        assert!(*small == expected(Op::AllReduce, world, rank, n), "{what}: small integers");
                    }
                }
            }
        }
    }
}

/// Half-precision all-reduce through the hosts (reduce inside each host, the leaders' ring,
/// broadcast): the same exact sums as the flat ring, small buffers and pipelined pieces alike.
#[test]
fn half_precision_all_reduce_through_the_hosts() {
    CHUNK.with(|c| c.set(256));
    for half in [Half::F16, Half::Bf16] {
        for n in [1, 7, 1001, 300_001] {
            for (rank, hosts, got) in on_hosts(&[0, 0, 1, 1], Transport::Auto, Hierarchy::Auto, |mut c| {
                let vals: Vec<f32> = (0..n).map(|i| input(c.rank(), i)).collect();
                let mut packed = vec![0.0; packed_len(n)];
                pack(half, &vals, &mut packed);
                c.all_reduce_half(&mut packed, half).unwrap();
                let mut got = vec![0.0; n];
                unpack(half, &packed, &mut got);
                (c.rank(), c.hosts(), got)
            }) {
                assert_eq!(hosts, Some(2));
                assert!(
                    got == expected(Op::AllReduce, 4, rank, n),
                    "{} {n} values, rank {rank}",
                    half.name()
                );
            }
        }
    }
}

/// Values that are not exact in half precision: every rank still ends with the same bits,
/// within the rounding of one half-precision step per hop of the exact sum.
#[test]
fn half_precision_all_reduce_agrees_across_ranks_within_rounding() {
    let n = 5000;
    for half in [Half::F16, Half::Bf16] {
        let world = 4;
        let out = with_group(world, Transport::Tcp, |mut c| {
            let r = c.rank();
            let vals: Vec<f32> = (0..n).map(|i| ((i * 7 + r * 13) % 101) as f32 / 37.0 - 1.3).collect();
            let mut packed = vec![0.0; packed_len(n)];
            pack(half, &vals, &mut packed);
            c.all_reduce_half(&mut packed, half).unwrap();
            packed.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        });
        assert!(out.iter().all(|b| *b == out[0]), "{}: ranks disagree", half.name());
        let packed: Vec<f32> = out[0].iter().map(|b| f32::from_bits(*b)).collect();
        let mut got = vec![0.0; n];
        unpack(half, &packed, &mut got);
        let eps = if half == Half::F16 { 1.0 / 1024.0 } else { 1.0 / 128.0 };
        for (i, g) in got.iter().enumerate() {
            let exact: f32 = (0..world).map(|r| ((i * 7 + r * 13) % 101) as f32 / 37.0 - 1.3).sum();
            let scale = exact.abs().max(1.0);
            assert!(
                (g - exact).abs() <= world as f32 * eps * scale,
                "{} at {i}: {g} against {exact}",
                half.name()
            );
        }
    }
}

/// Ranks given different formats fail instead of adding bits of one format as the other: the
/// rank that sees the other's frame first names both formats; the other may instead hear
/// its abort notice, which names that rank.
#[test]
fn ranks_with_different_half_formats_fail_naming_them() {
    let out = with_group(2, Transport::Tcp, |mut c| {
        let half = if c.rank() == 0 { Half::F16 } else { Half::Bf16 };
        let mut packed = vec![0.0; 100];
        c.all_reduce_half(&mut packed, half).unwrap_err().to_string()
    });
    let named = |e: &String| e.contains("fp16") && e.contains("bf16") && e.contains("--compress");
    assert!(out.iter().any(named), "{out:?}");
    for e in &out {
        assert!(named(e) || e.contains("stopped all_reduce because of it"), "{e}");
    }
}

/// Whether a GPU test's body runs in this process; when it ran against the fake CUDA in a
/// child instead, `check` looks at the fake's counters.
fn gpu_here(test: &str, check: impl FnOnce(&Counters)) -> bool {
    match gpu_test(test) {
        GpuRun::Here => {
            // Here a GPU and NCCL must work: a missing libnccl.so.2 is a failure, not a skip.
            nccl::available().unwrap();
            true
        }
        GpuRun::Fake(c) => {
            check(&c);
            false
        }
        GpuRun::Skipped => false,
    }
}

/// How many GPUs can be opened here (the fake has four).
fn gpus() -> usize {
    (0..16).take_while(|&i| gradsync_core::device::cuda::probe(i).is_ok()).count()
}

/// `world` NCCL communicators, one per thread and GPU (NCCL refuses two ranks on one GPU).
fn with_nccl<T: Send>(world: usize, timeout: Duration, body: impl Fn(Nccl) -> T + Sync) -> Vec<T> {
    let id = nccl::unique_id().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = &body;
                s.spawn(move || body(Nccl::new(rank, rank, world, &id, timeout).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn nccl_matches_the_reference() {
    if !gpu_here("nccl_matches_the_reference", |c| assert!(c.collectives > 0 && c.alive_at_exit == 0, "{c}"))
    {
        return;
    }
    let ops = [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast,
        Op::Reduce,
        Op::Gather,
        Op::Scatter,
        Op::SendRecv,
        Op::Barrier,
    ];
    for world in 1..=gpus().min(3) {
        let results = with_nccl(world, Duration::from_secs(30), |mut c| {
            let mut got = Vec::new();
            for op in ops {
                for n in sizes(world) {
                    got.push((op, n, run_op(&mut c, op, n)));
                }
            }
            (c.rank(), got)
        });
        for (rank, got) in results {
            for (op, n, v) in got {
                assert_eq!(
                    v,
                    expected(op, world, rank, n),
                    "NCCL {op:?}, {world} ranks, {n} values, rank {rank}"
                );
            }
        }
    }
}

/// NCCL's half-precision all-reduce (`--compress fp16|bf16` under `--backend nccl`), both ways
/// in: host buffers through `all_reduce_as_half` (each value's share of the mean packed two
/// halves a slot, the `Collective` trait), and a GPU buffer scaled, rounded, reduced, widened
/// and scaled back on the device (what DDP queues for its buckets). Values that are not exact
/// in either format, of both signs and several magnitudes, and values whose sum passes fp16's
/// 65504. Both ways end with the same bits on every rank; with one or two ranks those are the
/// serial reference's (each share rounded, the sum rounded, times the world size: any ring
/// order gives the same), with three within one rounding per hop of the exact sum. The device
/// way moves exactly half the bytes of the f32 one.
#[test]
fn nccl_half_all_reduce_rounds_like_the_reference_and_moves_half_the_bytes() {
    let test = "nccl_half_all_reduce_rounds_like_the_reference_and_moves_half_the_bytes";
    // On the fake CUDA (four GPUs: 1, 2 and 3 ranks): the only kernels are the rounding and
    // the widening of each non-empty GPU buffer, on every rank, so the GPU way ran on the GPU.
    let on_the_device = |c: &Counters| {
        assert!(c.launches == 2 * 10 * (1 + 2 + 3) && c.collectives > 0 && c.alive_at_exit == 0, "{c}");
    };
    if !gpu_here(test, on_the_device) {
        return;
    }
    use gradsync_core::device::{Backend, Cuda};
    // Case `n` = 64: values near 40000, whose sum over two or three ranks passes fp16's 65504.
    let value = |r: usize, i: usize, n: usize| {
        let v = ((i * 7 + r * 13) % 101) as f32 / 37.0 - 1.3;
        if n == 64 {
            40_000.0 + v * 100.0
        } else if i.is_multiple_of(5) {
            v * 300.0
        } else if i % 5 == 1 {
            v / 700.0
        } else {
            v
        }
    };
    let cases: Vec<(Half, usize)> =
        [Half::F16, Half::Bf16].into_iter().flat_map(|h| [0, 1, 2, 7, 64, 1001].map(|n| (h, n))).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for world in 1..=gpus().min(3) {
        // Per rank, per case: the host way's sum, the device way's, and the bytes each way.
        let out = with_nccl(world, Duration::from_secs(30), |mut c| {
            let r = c.rank();
            let gpu = Cuda::new(r).unwrap();
            let mut got = Vec::new();
            let mut scratch = Vec::new();
            for &(half, n) in &cases {
                let vals: Vec<f32> = (0..n).map(|i| value(r, i, n)).collect();
                let mut host = vals.clone();
                all_reduce_as_half(&mut c, &mut host, half, &mut scratch).unwrap();

                let mut buf = gpu.zeros(n).unwrap();
                gpu.write(&mut buf, 0, &vals).unwrap();
                let (ptr, len) = Cuda::raw_range(&buf, 0..n);
                let before = c.traffic();
                // SAFETY: `buf` lives until wait_all has returned.
                unsafe {
                    c.all_reduce_half_device_after(
                        ptr,
                        len,
                        After::Stream(gpu.stream()),
                        half,
                        gpu.half_cast(),
                    )
                }
                .unwrap();
                c.wait_all().unwrap();
                let half_sent = c.traffic().sent - before.sent;
                let mut device = vec![0.0; n];
                gpu.read(&buf, 0..n, &mut device).unwrap();
                gpu.write(&mut buf, 0, &vals).unwrap();
                let before = c.traffic();
                // SAFETY: as above.
                unsafe { c.all_reduce_device_after(ptr, len, After::Stream(gpu.stream())) }.unwrap();
                c.wait_all().unwrap();
                got.push((host, device, half_sent, c.traffic().sent - before.sent));
            }
            got
        });
        for (k, &(half, n)) in cases.iter().enumerate() {
            let what = format!("{}, {world} ranks, {n} values", half.name());
            let (share, w) = (1.0 / world as f32, world as f32);
            let reference: Vec<f32> = (0..n)
                .map(|i| {
                    let mine = |r: usize| half.round(value(r, i, n) * share);
                    (1..world).fold(mine(0), |acc, r| half.round(acc + mine(r))) * w
                })
                .collect();
            for (rank, mine) in out.iter().enumerate() {
                let (host, device, half_sent, f32_sent) = &mine[k];
                assert_eq!(bits(host), bits(&out[0][k].0), "{what}: ranks 0 and {rank} disagree");
                assert_eq!(
                    bits(device),
                    bits(host),
                    "{what}, rank {rank}: the device way differs from the host way"
                );
                if world <= 2 {
                    assert_eq!(
                        bits(device),
                        bits(&reference),
                        "{what}, rank {rank}: not the reference's sum"
                    );
                }
                // Relative rounding, and fp16's subnormal spacing (2^-24) for the tiny values.
                let (eps, tiny) =
                    if half == Half::F16 { (1.0 / 1024.0, 2f32.powi(-24)) } else { (1.0 / 128.0, 0.0) };
                for (i, g) in device.iter().enumerate() {
                    let exact: f32 = (0..world).map(|r| value(r, i, n)).sum();
                    let scale = (0..world).map(|r| value(r, i, n).abs()).sum::<f32>();
                    assert!(
                        (g - exact).abs() <= world as f32 * (eps * scale + tiny),
                        "{what} at {i}: {g} against {exact}"
                    );
                }
                // Half the bytes (to the byte: the (world - 1) / world share is rounded down).
                assert!(
                    (2 * half_sent).abs_diff(*f32_sent) <= 1,
                    "{what}, rank {rank}: {half_sent} bytes in half precision, {f32_sent} in f32"
                );
            }
        }
    }
}

/// A short limit on how long the fake CUDA lets a stream wait, so a missing abort fails the
/// test in seconds; only in the child that runs against the fake.
fn short_fake_hang_limit() {
    if std::env::var_os(gradsync_testkit::CHILD_ENV).is_some() {
        // SAFETY: set before this test starts any thread; the fake reads it at each wait.
        unsafe { std::env::set_var("FAKE_CUDA_HANG_SECS", "15") };
    }
}

#[test]
fn nccl_set_up_times_out_and_aborts_when_a_rank_never_joins() {
    if !gpu_here("nccl_set_up_times_out_and_aborts_when_a_rank_never_joins", |_| {}) {
        return;
    }
    short_fake_hang_limit();
    let id = nccl::unique_id().unwrap();
    // Rank 1 never comes.
    let err = Nccl::new(0, 0, 2, &id, Duration::from_secs(1)).unwrap_err().to_string();
    assert!(err.contains("did not finish within 1.0 s") && err.contains("aborted"), "{err}");
}

#[test]
fn a_timed_out_nccl_call_aborts_before_any_buffer_is_freed() {
    if !gpu_here("a_timed_out_nccl_call_aborts_before_any_buffer_is_freed", |_| {}) {
        return;
    }
    if gpus() < 2 {
        eprintln!(
            "SKIPPED (two ranks need two GPUs; the fake CUDA has four) [a_timed_out_nccl_call_aborts_before_any_buffer_is_freed]"
        );
        return;
    }
    short_fake_hang_limit();
    use gradsync_core::device::{Backend, Cuda};
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let errors = with_nccl(2, Duration::from_secs(1), |mut c| {
        if c.rank() == 1 {
            // Absent while rank 0 reduces; afterwards its own call finds the world aborted.
            done_rx.lock().unwrap().recv().unwrap();
            return c.all_reduce(&mut [1.0; 4]).unwrap_err().to_string();
        }
        // A gradient buffer of the compute backend, reduced in place on the GPU.
        let gpu = Cuda::new(0).unwrap();
        let mut grads = gpu.zeros(1000).unwrap();
        let (ptr, len) = Cuda::raw_range(&grads, 0..1000);
        // SAFETY: `grads` stays allocated until after wait_all, which aborts on failure.
        unsafe { c.all_reduce_device_after(ptr, len, After::Stream(gpu.stream())) }.unwrap();
        let err = c.wait_all().unwrap_err().to_string();
        assert!(err.contains("did not finish within 1.0 s") && err.contains("aborted"), "{err}");
        // NCCL no longer writes into the buffer: freeing it now is safe (the fake CUDA fails
        // the process if a collective still uses it).
        gpu.write(&mut grads, 0, &[2.0; 1000]).unwrap();
        drop(grads);
        // Later calls fail at once, naming the first failure.
        let again = c.all_reduce(&mut [1.0; 4]).unwrap_err().to_string();
        assert!(again.contains("aborted earlier") && again.contains("did not finish"), "{again}");
        done_tx.send(()).unwrap();
        err
    });
    assert!(errors[1].contains("NCCL"), "rank 1: {}", errors[1]);
}
