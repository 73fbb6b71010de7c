//! Plain sockets around the ring: the yardstick beside every all-reduce row. Each rank streams
//! exactly the bytes a ring all-reduce of `S` sends per rank, `2(n-1)/n * S`, to its right
//! neighbour while it drains as many from its left, in 1 MiB writes and reads: no framing, no
//! steps waiting on each other, no arithmetic. Its engine follows the ring's own rule for large
//! transfers: a sending thread beside the receiving one where the ranks have a core each, one
//! thread polling both sockets where they outnumber the cores.
//!
//! Its busbw (the same formula) is what these sockets carry in this topology with nothing else
//! to do, so a library's busbw as a fraction of it says how much of the machine's socket
//! capacity the library leaves unused. It is a yardstick, not a proven bound: a library that
//! moves bytes better (smaller pieces that stay in cache, say) can pass it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use gradsync_core::heap::filled;
use gradsync_worker::collective::configure_socket;

use super::measure::{Busy, Row};

/// Bytes per write and per read: the ring's own chunk where its ranks have a core each. (4 MiB
/// pieces, as the raw stream writes, moved 8-25% less between emulated 10 Gbit/s hosts and no
/// more on loopback.)
const CHUNK: usize = 1 << 20;

/// What each rank sends per all-reduce of `bytes` over `world` ranks: `2(n-1)/n` of it.
pub(super) fn ring_bytes(bytes: usize, world: usize) -> usize {
    (2 * (world - 1) * bytes).div_ceil(world.max(1))
}

/// The byte every rank `r` streams (its left neighbour checks it).
fn mark(rank: usize) -> u8 {
    (rank % 251) as u8 + 1
}

/// Connect to the right neighbour at `right` and accept the left one on `listener`, each
/// naming itself; every wait bounded by `timeout`.
pub(super) fn connect(
    listener: &TcpListener,
    (rank, world): (usize, usize),
    right: SocketAddr,
    socket_buffer: Option<usize>,
    timeout: Duration,
) -> anyhow::Result<(TcpStream, TcpStream)> {
    let deadline = Instant::now() + timeout;
    let mut tx = TcpStream::connect_timeout(&right, timeout)
        .with_context(|| format!("rank {rank}: connecting to rank {} at {right}", (rank + 1) % world))?;
    tx.write_all(&(rank as u64).to_le_bytes())?;
    listener.set_nonblocking(true)?;
    let left = (rank + world - 1) % world;
    let mut rx = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "rank {rank}: rank {left} did not connect within {:.0} s",
                    timeout.as_secs_f64()
                );
                // Accept has no timeout in std; a short nap bounds the wait at the deadline.
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e).context("accepting the left neighbour"),
        }
    };
    for s in [&tx, &rx] {
        configure_socket(s, timeout, socket_buffer)
            .map_err(|(what, e)| anyhow::anyhow!("rank {rank}: configuring a socket: {what}: {e}"))?;
    }
    rx.set_nonblocking(true)?;
    tx.set_nonblocking(true)?;
    let mut who = [0u8; 8];
    pass(None, Some(&mut rx), &[], &mut who, timeout).context("reading the left neighbour's rank")?;
    let who = u64::from_le_bytes(who);
    anyhow::ensure!(
        who == left as u64,
        "rank {rank}: expected rank {left} on the left, rank {who} connected"
    );
    Ok((tx, rx))
}

/// One pass, on this thread alone, as the ring's own engine moves frames where its ranks
/// outnumber the cores: both sockets non-blocking, as much written out on `tx` and read in
/// from `rx` as each takes, `poll(2)` when neither moves (bounded by `timeout`). `None` for a
/// side with nothing to move.
fn pass(
    mut tx: Option<&mut TcpStream>,
    mut rx: Option<&mut TcpStream>,
    send: &[u8],
    recv: &mut [u8],
    timeout: Duration,
) -> std::io::Result<()> {
    use std::io::ErrorKind::{Interrupted, WouldBlock};
    use std::os::fd::AsRawFd;
    let (mut sent, mut got) = (0, 0);
    while sent < send.len() || got < recv.len() {
        let mut moved = false;
        if let (Some(tx), true) = (tx.as_mut(), sent < send.len()) {
            match tx.write(&send[sent..(sent + CHUNK).min(send.len())]) {
                Ok(n) => (sent, moved) = (sent + n, true),
                Err(e) if e.kind() == WouldBlock || e.kind() == Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if let (Some(rx), true) = (rx.as_mut(), got < recv.len()) {
            let end = (got + CHUNK).min(recv.len());
            match rx.read(&mut recv[got..end]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => (got, moved) = (got + n, true),
                Err(e) if e.kind() == WouldBlock || e.kind() == Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if moved {
            continue;
        }
        let want = |s: &Option<&mut TcpStream>, events: libc::c_short, on: bool| libc::pollfd {
            fd: s.as_ref().map_or(-1, |s| s.as_raw_fd()),
            events: if on { events } else { 0 },
            revents: 0,
        };
        let mut fds =
            [want(&tx, libc::POLLOUT, sent < send.len()), want(&rx, libc::POLLIN, got < recv.len())];
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the call
        // (a negative fd is ignored by poll).
        match unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) } {
            0 => return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no neighbour moved a byte")),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != Interrupted {
                    return Err(e);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// One pass on two threads: `send` written out on `tx` by a second thread while this one
/// reads `recv` in from `rx`, so the kernel's copies out and in run on two cores, as the
/// ring's own engine does where its ranks have cores to spare.
fn pass_threads(
    tx: &mut TcpStream,
    rx: &mut TcpStream,
    send: &[u8],
    recv: &mut [u8],
    timeout: Duration,
) -> std::io::Result<()> {
    std::thread::scope(|s| {
        let sender = s.spawn(move || pass(Some(tx), None, send, &mut [], timeout));
        let got = pass(None, Some(rx), &[], recv, timeout);
        let sent =
            sender.join().unwrap_or_else(|_| Err(std::io::Error::other("the sending thread panicked")));
        got.and(sent)
    })
}

/// Every rank has arrived: `world - 1` passes of a token to the right. A rank sends its token
/// of pass `k` only once it has the one of pass `k - 1` from its left, so after pass `k` it
/// knows the `k` ranks to its left have entered, and after `world - 1` every rank has.
fn barrier(tx: &mut TcpStream, rx: &mut TcpStream, world: usize, timeout: Duration) -> std::io::Result<()> {
    let mut b = [0u8; 1];
    for _ in 0..world.saturating_sub(1).max(1) {
        pass(Some(&mut *tx), Some(&mut *rx), &[1], &mut b, timeout)?;
    }
    Ok(())
}

/// Time each size as [`super::time_rank`] times an all-reduce: one checked pass (a byte not
/// the left neighbour's mark counts as wrong), then `iters` passes between barriers.
pub(super) fn time_rank(
    (tx, rx): (&mut TcpStream, &mut TcpStream),
    (rank, world): (usize, usize),
    sizes: &[usize],
    budget: usize,
    timeout: Duration,
    mut each: impl FnMut(&Row),
) -> anyhow::Result<Vec<Row>> {
    let left = (rank + world - 1) % world;
    // Every rank of the benchmark runs on this machine: the ring's own rule for its engine.
    let threads = world <= std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    for &bytes in sizes {
        let bytes = bytes / 4 * 4;
        let n = ring_bytes(bytes, world);
        // Allocated as the ring's buffers are (huge pages where they span them).
        let send = filled(n, mark(rank));
        let mut recv = filled(n, 0u8);
        let once = |tx: &mut TcpStream, rx: &mut TcpStream, recv: &mut [u8]| {
            if threads {
                pass_threads(tx, rx, &send, recv, timeout)
            } else {
                pass(Some(tx), Some(rx), &send, recv, timeout)
            }
        };
        once(tx, rx, &mut recv).with_context(|| format!("{bytes} B, the checked pass"))?;
        let wrong = recv.iter().filter(|&&b| b != mark(left)).count();
        let iters = (budget / bytes.max(1)).clamp(3, 200);
        barrier(tx, rx, world, timeout).context("waiting for every rank")?;
        let (t, busy) = (Instant::now(), Busy::start(rank));
        for _ in 0..iters {
            once(tx, rx, &mut recv).with_context(|| format!("{bytes} B"))?;
        }
        let row = Row { bytes, secs: t.elapsed().as_secs_f64() / iters as f64, wrong, busy: busy.per(iters) };
        each(&row);
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_sends_what_a_ring_all_reduce_sends() {
        // 2(n-1)/n of the buffer: all of it each way with 2 ranks, 7/4 of it with 8.
        assert_eq!(ring_bytes(1 << 20, 2), 1 << 20);
        assert_eq!(ring_bytes(1 << 20, 8), (1 << 20) * 14 / 8);
        assert_eq!(ring_bytes(8, 3), 11, "rounded up, never short");
    }

    #[test]
    fn three_ranks_move_their_bytes_around_the_ring_and_check_them() {
        let world = 3;
        let listeners: Vec<TcpListener> =
            (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let rows: Vec<Vec<Row>> = std::thread::scope(|s| {
            let hs: Vec<_> = listeners
                .iter()
                .enumerate()
                .map(|(rank, l)| {
                    let right = addrs[(rank + 1) % world];
                    s.spawn(move || {
                        let t = Duration::from_secs(30);
                        let (mut tx, mut rx) = connect(l, (rank, world), right, Some(1 << 20), t).unwrap();
                        time_rank((&mut tx, &mut rx), (rank, world), &[4, 3000, 1 << 20], 1 << 20, t, |_| {})
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in rows {
            assert_eq!(r.iter().map(|r| r.bytes).collect::<Vec<_>>(), [4, 3000, 1 << 20]);
            assert!(r.iter().all(|r| r.wrong == 0 && r.secs > 0.0), "{r:?}");
        }
    }

    #[test]
    fn a_stranger_on_the_left_is_named() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let right = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        // Rank 2 of 4 expects rank 1 on its left; rank 3 dials in instead.
        let stranger = std::thread::spawn(move || {
            let mut s = TcpStream::connect(at).unwrap();
            s.write_all(&3u64.to_le_bytes()).unwrap();
            s
        });
        let e = connect(&listener, (2, 4), right.local_addr().unwrap(), None, Duration::from_secs(10))
            .unwrap_err();
        assert!(e.to_string().contains("expected rank 1 on the left, rank 3 connected"), "{e}");
        drop(stranger.join().unwrap());
    }
}
