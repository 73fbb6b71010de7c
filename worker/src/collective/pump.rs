//! The socket engines under the ring and chain algorithms ([`Duplex`] over TCP), which move
//! frames out to one neighbour and in from another at the same time. [`Pump`]: one thread per
//! rank, with non-blocking sockets and `poll(2)`, the way gloo's pairs and NCCL's proxy
//! thread do; no thread start per call, so small collectives cost a few system calls. For
//! large transfers, [`duplex`] runs a scoped sender thread beside the receiving one instead,
//! so the kernel's copies in and out use two cores.
//!
//! The algorithm above drives it as if it were blocking: [`Pump::send`] queues a chunk,
//! [`Pump::recv`] returns once the next frame has arrived in a chunk (added into it, or
//! copied), and [`Pump::take_back`] returns a sent chunk. Whenever one of them waits, both
//! directions make progress. A peer that neither reads nor writes for the whole timeout is
//! named in the error.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::Duration;

use super::error::{CollectiveError, Result};
use super::frame::{frame_header, lost, parse_header, peer_err, read_exact_from, remember, write_frame};
use super::link::{Duplex, Op, returned};
use super::reduce::{Values, sum_into};
use super::{SocketEngine, Traffic};

/// The most a reader waits to accumulate before it wakes.
const LOWAT: usize = 256 << 10;

/// A frame being written: its header, then its chunk.
struct Outgoing<'b> {
    id: usize,
    head: [u8; 8],
    chunk: &'b mut [f32],
    /// Bytes of header + payload written so far.
    done: usize,
}

/// Frames out to `right`, frames in from `left`, on one thread.
pub(crate) struct Pump<'s, 'b> {
    reader: &'s mut TcpStream,
    writer: &'s mut TcpStream,
    left: usize,
    right: usize,
    op: Op,
    values: Values,
    timeout: Duration,
    queue: VecDeque<Outgoing<'b>>,
    sent_back: Vec<(usize, &'b mut [f32])>,
    scratch: &'s mut Vec<f32>,
    /// The reader's current SO_RCVLOWAT.
    lowat: usize,
    /// The last 8 bytes read from the left (see [`remember`]).
    tail: [u8; 8],
    /// Payload bytes moved each way.
    sent: u64,
    recv: u64,
}

impl<'s, 'b> Pump<'s, 'b> {
    /// A pump over these streams (switched to non-blocking until it is dropped).
    pub(crate) fn new(
        reader: &'s mut TcpStream,
        writer: &'s mut TcpStream,
        (left, right): (usize, usize),
        (op, values): (Op, Values),
        timeout: Duration,
        scratch: &'s mut Vec<f32>,
    ) -> Result<Self> {
        let nb = |e| CollectiveError::Io { what: "switching a link to non-blocking".into(), source: e };
        reader.set_nonblocking(true).map_err(nb)?;
        writer.set_nonblocking(true).map_err(nb)?;
        Ok(Pump {
            reader,
            writer,
            left,
            right,
            op,
            values,
            timeout,
            queue: VecDeque::new(),
            sent_back: Vec::new(),
            scratch,
            lowat: 1,
            tail: [0; 8],
            sent: 0,
            recv: 0,
        })
    }

    /// Queue `chunk` (known as `id`) to be sent to the right.
    pub(crate) fn send(&mut self, id: usize, chunk: &'b mut [f32]) -> Result<()> {
        let head = frame_header(self.op, self.values, chunk.len())?;
        self.queue.push_back(Outgoing { id, head, chunk, done: 0 });
        // Start writing at once: the peer may be waiting for exactly this.
        self.write_some()?;
        Ok(())
    }

    /// Chunk `id`, once it has been sent.
    pub(crate) fn take_back(&mut self, id: usize) -> Result<&'b mut [f32]> {
        loop {
            let queued = self.queue.iter().any(|o| o.id == id);
            if let Some(done) = returned(&mut self.sent_back, queued, id) {
                return done;
            }
            self.wait(false)?;
        }
    }

    /// Receive the next frame from the left into `dst` (added into it when `add`).
    pub(crate) fn recv(&mut self, dst: &mut [f32], add: bool) -> Result<()> {
        let mut head = [0u8; 8];
        self.read_fully(&mut head)?;
        parse_header(&head, self.op, self.values, dst.len(), self.left)?;
        if add {
            // Through a cache-sized scratch, so the add reads data still in cache.
            let piece = self.scratch.len().max(1);
            for part in dst.chunks_mut(piece) {
                let mut s = std::mem::take(self.scratch);
                let r = self.read_fully(bytemuck::cast_slice_mut(&mut s[..part.len()]));
                sum_into(self.values, part, &s[..part.len()]);
                *self.scratch = s;
                r?;
            }
        } else {
            self.read_fully(bytemuck::cast_slice_mut(dst))?;
        }
        self.recv += dst.len() as u64 * 4;
        Ok(())
    }

    /// Send everything queued; the payload bytes moved each way.
    pub(crate) fn finish(mut self) -> Result<Traffic> {
        while !self.queue.is_empty() {
            self.wait(false)?;
        }
        Ok(Traffic { sent: self.sent, recv: self.recv })
    }

    /// Read exactly `buf.len()` bytes from the left, writing to the right whenever possible.
    fn read_fully(&mut self, buf: &mut [u8]) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            match self.reader.read(&mut buf[got..]) {
                Ok(0) => {
                    let eof = io::ErrorKind::UnexpectedEof.into();
                    return Err(lost(self.left, self.op, self.timeout, &self.tail, eof));
                }
                Ok(n) => {
                    remember(&mut self.tail, &buf[got..got + n]);
                    got += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Wake only once a worthwhile piece (or the rest of the read) is there:
                    // every wake-up costs a trip through the scheduler, which on a busy
                    // machine is what limits the link, not the copies.
                    self.set_lowat((buf.len() - got).min(LOWAT));
                    self.wait(true)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.left, self.op, self.timeout, &self.tail, e)),
            }
        }
        Ok(())
    }

    /// Set the reader's SO_RCVLOWAT (best effort: without it, poll just wakes more often).
    fn set_lowat(&mut self, bytes: usize) {
        if bytes == self.lowat {
            return;
        }
        let v = bytes.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: a valid socket descriptor and a c_int option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                self.reader.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            self.lowat = bytes;
        }
    }

    /// Write as much of the queue as the socket takes now.
    fn write_some(&mut self) -> Result<()> {
        while let Some(o) = self.queue.front_mut() {
            let payload: &[u8] = bytemuck::cast_slice(&*o.chunk);
            let total = 8 + payload.len();
            let res = if o.done < 8 {
                // Header and payload in one system call.
                let bufs = [io::IoSlice::new(&o.head[o.done..]), io::IoSlice::new(payload)];
                self.writer.write_vectored(&bufs)
            } else {
                self.writer.write(&payload[o.done - 8..])
            };
            match res {
                Ok(0) => {
                    return Err(peer_err(self.right, self.op, self.timeout)(io::ErrorKind::WriteZero.into()));
                }
                Ok(n) => {
                    o.done += n;
                    if o.done == total {
                        self.sent += payload.len() as u64;
                        if let Some(o) = self.queue.pop_front() {
                            self.sent_back.push((o.id, o.chunk));
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(peer_err(self.right, self.op, self.timeout)(e)),
            }
        }
        Ok(())
    }

    /// Block until the reader has data (if `reading`) or the writer has room (if anything is
    /// queued), writing what it can; time out naming the peer waited for.
    fn wait(&mut self, reading: bool) -> Result<()> {
        let writing = !self.queue.is_empty();
        let mut fds = [
            libc::pollfd {
                fd: self.reader.as_raw_fd(),
                events: if reading { libc::POLLIN } else { 0 },
                revents: 0,
            },
            libc::pollfd {
                fd: self.writer.as_raw_fd(),
                events: if writing { libc::POLLOUT } else { 0 },
                revents: 0,
            },
        ];
        let ms = self.timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(CollectiveError::Io { what: "poll".into(), source: e });
        }
        if n == 0 {
            let peer = if reading { self.left } else { self.right };
            return Err(CollectiveError::Timeout { peer, op: self.op.name(), timeout: self.timeout });
        }
        if writing && fds[1].revents != 0 {
            self.write_some()?;
        }
        Ok(())
    }
}

impl Drop for Pump<'_, '_> {
    fn drop(&mut self) {
        self.set_lowat(1);
        let _ = self.reader.set_nonblocking(false);
        let _ = self.writer.set_nonblocking(false);
    }
}

impl<'b> Duplex<'b> for Pump<'_, 'b> {
    fn send(&mut self, id: usize, chunk: &'b mut [f32]) -> Result<()> {
        Pump::send(self, id, chunk)
    }
    fn take_back(&mut self, id: usize) -> Result<&'b mut [f32]> {
        Pump::take_back(self, id)
    }
    fn recv(&mut self, dst: &mut [f32], add: bool) -> Result<()> {
        Pump::recv(self, dst, add)
    }
}

/// Buffers from this size up go through a sender thread beside the receiving one, when the
/// host has cores to spare for it (see [`engine`]): the kernel's copies out and in then run on
/// two cores at once, while below it the thread's start-up would cost more than it gains.
const THREADED_MIN_BYTES: usize = 4 << 20;

/// The two-thread engine: this thread receives (blocking reads), a scoped thread writes.
struct Threaded<'s, 'b> {
    reader: &'s mut TcpStream,
    left: usize,
    op: Op,
    values: Values,
    timeout: Duration,
    scratch: &'s mut Vec<f32>,
    to_sender: Option<mpsc::Sender<(usize, &'b mut [f32])>>,
    back: mpsc::Receiver<(usize, &'b mut [f32])>,
    returned: Vec<(usize, &'b mut [f32])>,
    /// The last 8 bytes read from the left (see [`remember`]).
    tail: [u8; 8],
    recv: u64,
}

fn sender_gone() -> CollectiveError {
    CollectiveError::Invalid { what: "sender", why: "stopped early".into() }
}

impl<'b> Duplex<'b> for Threaded<'_, 'b> {
    fn send(&mut self, id: usize, chunk: &'b mut [f32]) -> Result<()> {
        self.to_sender.as_ref().and_then(|t| t.send((id, chunk)).ok()).ok_or_else(sender_gone)
    }

    fn take_back(&mut self, id: usize) -> Result<&'b mut [f32]> {
        loop {
            if let Some(i) = self.returned.iter().position(|(k, _)| *k == id) {
                return Ok(self.returned.swap_remove(i).1);
            }
            let got = self.back.recv().map_err(|_| sender_gone())?;
            self.returned.push(got);
        }
    }

    fn recv(&mut self, dst: &mut [f32], add: bool) -> Result<()> {
        let (left, op, t) = (self.left, self.op, self.timeout);
        let mut head = [0u8; 8];
        read_exact_from(self.reader, &mut head, &mut self.tail, left, op, t)?;
        parse_header(&head, self.op, self.values, dst.len(), self.left)?;
        if add {
            let piece = self.scratch.len().max(1);
            for part in dst.chunks_mut(piece) {
                let s = &mut self.scratch[..part.len()];
                read_exact_from(self.reader, bytemuck::cast_slice_mut(s), &mut self.tail, left, op, t)?;
                sum_into(self.values, part, s);
            }
        } else {
            read_exact_from(self.reader, bytemuck::cast_slice_mut(dst), &mut self.tail, left, op, t)?;
        }
        self.recv += dst.len() as u64 * 4;
        Ok(())
    }
}

/// Which socket engine moves a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    /// The one-thread [`Pump`].
    OneThread,
    /// A sender thread beside the receiving one.
    SenderThread,
}

/// The engine for a transfer of `bytes`, on a machine with `cores` cores shared by
/// `ranks_here` ranks. A sender thread only pays when each rank has two cores to itself: otherwise the
/// ranks' threads take turns on the same cores, and every hand-off between them is a trip
/// through the scheduler. Measured side by side on 2 cores, ranks as processes, loopback
/// (`gradsync-bench collective`, compilers paused): with 2 ranks the one-thread pump made
/// 2.2-2.7 GB/s busbw at 4-64 MB against the sender thread's 1.5-2.2; with 4 and 8 ranks
/// both sit at the machine's copy limit (within 5%); see docs/benchmarks.md.
pub(crate) fn engine(choice: SocketEngine, bytes: usize, cores: usize, ranks_here: usize) -> Engine {
    let spare_cores = match choice {
        SocketEngine::Auto => cores >= 2 * ranks_here.max(1),
        SocketEngine::OneThread => false,
        SocketEngine::SenderThread => true,
    };
    if bytes >= THREADED_MIN_BYTES && spare_cores { Engine::SenderThread } else { Engine::OneThread }
}

/// Run `body` over a full-duplex engine between `reader` (from `left`) and `writer` (to
/// `right`), the one picked by [`engine`]. Returns `body`'s result and the payload bytes moved
/// once everything queued is sent.
#[allow(clippy::too_many_arguments)]
pub(crate) fn duplex<'b, T>(
    engine: Engine,
    reader: &mut TcpStream,
    writer: &mut TcpStream,
    (left, right): (usize, usize),
    op: Op,
    values: Values,
    timeout: Duration,
    scratch: &mut Vec<f32>,
    body: impl FnOnce(&mut dyn Duplex<'b>) -> Result<T>,
) -> Result<(T, Traffic)> {
    if engine == Engine::OneThread {
        let mut p = Pump::new(reader, writer, (left, right), (op, values), timeout, scratch)?;
        let out = body(&mut p)?;
        return Ok((out, p.finish()?));
    }
    let (to_sender, from_main) = mpsc::channel::<(usize, &'b mut [f32])>();
    let (to_main, back) = mpsc::channel();
    std::thread::scope(|s| {
        let sender = s.spawn(move || -> Result<u64> {
            let mut sent = 0;
            for (id, chunk) in from_main {
                sent += write_frame(writer, op, values, chunk, right, timeout)?;
                // The receiving side may have finished (or failed) and not want it back.
                let _ = to_main.send((id, chunk));
            }
            Ok(sent)
        });
        let mut t = Threaded {
            reader,
            left,
            op,
            values,
            timeout,
            scratch,
            to_sender: Some(to_sender),
            back,
            returned: Vec::new(),
            tail: [0; 8],
            recv: 0,
        };
        let out = body(&mut t);
        t.to_sender = None;
        let recv = t.recv;
        drop(t);
        let sent = sender.join().unwrap_or_else(|_| {
            Err(CollectiveError::Invalid {
                what: "sender thread",
                why: format!("panicked during {}", op.name()),
            })
        });
        match (out, sent) {
            (Ok(v), Ok(sent)) => Ok((v, Traffic { sent, recv })),
            // The receiving side stopped because the sender did: the sender says why.
            (Err(CollectiveError::Invalid { what: "sender", .. }), Err(e)) => Err(e),
            // Otherwise what this rank saw from its left is the first-hand account.
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use crate::collective::handshake::abort_notice;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn a_sender_thread_only_where_each_rank_has_two_cores() {
        let (big, auto) = (THREADED_MIN_BYTES, SocketEngine::Auto);
        assert_eq!(engine(auto, big, 2, 2), Engine::OneThread, "2 ranks on 2 cores");
        assert_eq!(engine(auto, big, 16, 8), Engine::SenderThread, "8 ranks on 16 cores");
        assert_eq!(engine(auto, big, 16, 9), Engine::OneThread, "9 ranks on 16 cores");
        assert_eq!(engine(auto, big, 2, 1), Engine::SenderThread, "one rank per host");
        assert_eq!(engine(auto, big - 1, 64, 1), Engine::OneThread, "small transfers");
        assert_eq!(engine(SocketEngine::SenderThread, big, 2, 8), Engine::SenderThread, "forced");
        assert_eq!(engine(SocketEngine::OneThread, big, 64, 1), Engine::OneThread, "forced");
    }

    #[test]
    fn the_tail_is_the_streams_last_bytes_whatever_the_reads() {
        let stream: Vec<u8> = (0..40).collect();
        for cut in [1, 3, 7, 8, 9, 13] {
            let mut tail = [0; 8];
            for piece in stream.chunks(cut) {
                remember(&mut tail, piece);
            }
            assert_eq!(&tail[..], &stream[32..], "pieces of {cut}");
        }
    }

    /// A left neighbour that fails mid-frame and writes its abort notice, which lands across
    /// the boundary of two of the receiver's summing pieces of 16 values; the stream then ends.
    fn left_neighbour_aborting_mid_frame(values: usize) -> TcpStream {
        let (mut left_end, reader) = pair();
        let mut sent = frame_header(Op::AllReduce, Values::F32, values).unwrap().to_vec();
        // One full piece less 4 bytes, then the notice: its halves fall in pieces 1 and 2.
        sent.extend(std::iter::repeat_n(0u8, 16 * 4 - 4));
        sent.extend(abort_notice(5));
        left_end.write_all(&sent).unwrap();
        reader
    }

    fn expect_culprit_5(got: Result<()>) {
        match got {
            Err(CollectiveError::Aborted { peer: 1, culprit: 5, .. }) => {}
            other => panic!("expected the notice's culprit (5), got {other:?}"),
        }
    }

    /// The receiver blames the rank the notice names, not the neighbour that closed on it,
    /// on both engines.
    #[test]
    fn an_abort_notice_cut_between_pieces_names_the_culprit() {
        let t = Duration::from_secs(5);
        let mut reader = left_neighbour_aborting_mid_frame(64);
        let (mut writer, _right_end) = pair();
        let mut scratch = vec![0f32; 16];
        let mut pump =
            Pump::new(&mut reader, &mut writer, (1, 2), (Op::AllReduce, Values::F32), t, &mut scratch)
                .unwrap();
        expect_culprit_5(pump.recv(&mut [0f32; 64], true));
        drop(pump);

        let mut reader = left_neighbour_aborting_mid_frame(64);
        let (to_sender, _) = mpsc::channel();
        let (_, back) = mpsc::channel();
        let mut threaded = Threaded {
            reader: &mut reader,
            left: 1,
            op: Op::AllReduce,
            values: Values::F32,
            timeout: t,
            scratch: &mut scratch,
            to_sender: Some(to_sender),
            back,
            returned: Vec::new(),
            tail: [0; 8],
            recv: 0,
        };
        expect_culprit_5(threaded.recv(&mut [0f32; 64], true));
    }
}
