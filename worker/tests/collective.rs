//! Every collective of the TCP backend against a serial reference, for 1 to 8 ranks and
//! awkward sizes (zero, smaller than the world, not divisible by it, many pipelined chunks),
//! on both transports: sockets only, and shared memory (the rings in `/dev/shm`) for the ring
//! and chain collectives. Ranks are threads, each with its own communicator over real
//! loopback sockets, meeting through the real rendezvous store. Inputs are small integers, so
//! every sum is exact.
//!
//! NCCL runs the same check at world size 1 where a GPU is present (NCCL refuses two ranks
//! on one GPU); without one the test says it skipped.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::time::Duration;

use gradsync_worker::collective::{Collective, Nccl, RingConfig, TcpComm, Transport, nccl, segment};
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
    }
}

thread_local! {
    /// Chunk size for the groups this test thread makes (large-buffer tests raise it).
    static CHUNK: std::cell::Cell<usize> = const { std::cell::Cell::new(64) };
}

/// `world` connected communicators on `transport`, one per thread, through the rendezvous
/// store.
fn with_group<T: Send>(world: usize, transport: Transport, body: impl Fn(TcpComm) -> T + Sync) -> Vec<T> {
    let cfg = || RingConfig { chunk_bytes: CHUNK.with(|c| c.get()), transport, ..cfg() };
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
                };
                let l = if rank == 0 { store.take() } else { None };
                let body = &body;
                s.spawn(move || {
                    let comm = if world == 1 {
                        TcpComm::single(cfg())
                    } else {
                        let j = join_with_store(&rc, l).unwrap();
                        let c = TcpComm::connect(j.listener, &j.mesh, cfg()).unwrap();
                        // The transport asked for is the one in use (threads share a host).
                        if transport != Transport::Auto {
                            assert_eq!(c.transport(), transport);
                        }
                        c
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

/// Buffers of 4 MiB and more take the two-thread engine on sockets, and wrap around the
/// shared-memory rings (2 MiB each) many times: the same reference must hold.
fn large_buffers(transport: Transport) {
    CHUNK.with(|c| c.set(64 << 10));
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
    large_buffers(Transport::Tcp);
}

#[test]
fn large_buffers_over_shared_memory() {
    large_buffers(Transport::Shm);
}

#[test]
fn auto_picks_shared_memory_on_one_host() {
    for (_, t) in with_group(3, Transport::Auto, |c| (c.rank(), c.transport())) {
        assert_eq!(t, Transport::Shm);
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

#[test]
fn nccl_matches_the_reference_at_world_size_one() {
    if let Err(e) = nccl::available() {
        eprintln!("SKIPPED: NCCL collectives need a GPU and libnccl: {e}");
        return;
    }
    let id = nccl::unique_id().unwrap();
    let mut c = Nccl::new(0, 0, 1, &id, Duration::from_secs(30)).unwrap();
    for op in [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast,
        Op::Reduce,
        Op::Gather,
        Op::Scatter,
        Op::Barrier,
    ] {
        for n in sizes(1) {
            assert_eq!(run_op(&mut c, op, n), expected(op, 1, 0, n), "NCCL {op:?}, {n} values");
        }
    }
}
