//! The raw TCP bandwidth of this machine, measured in the same run as every communication
//! benchmark so figures can be quoted as a ratio to it: one plain socket pair, a sender
//! streaming large writes, a receiver draining them, no framing and no copies beyond the
//! kernel's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;

/// Bytes per write: large enough that syscall overhead is negligible.
const CHUNK: usize = 4 << 20;

/// Measure one-direction throughput over `addr`'s loopback (or any local address) for about
/// `duration`, returning bytes per second. `ip` is the address to bind (127.0.0.1 normally;
/// an emulated host's address in a network namespace).
pub fn bandwidth(ip: &str, duration: Duration) -> anyhow::Result<f64> {
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("binding {ip}:0"))?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0u64;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
        }
    });
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(10)).context("connecting to the receiver")?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    let buf = vec![1u8; CHUNK];
    // A short warm-up lets the congestion window and socket buffers grow first.
    let warm = Instant::now();
    while warm.elapsed() < duration / 5 {
        s.write_all(&buf)?;
    }
    let t = Instant::now();
    let mut sent = 0u64;
    while t.elapsed() < duration {
        s.write_all(&buf)?;
        sent += CHUNK as u64;
    }
    s.flush()?;
    let secs = t.elapsed().as_secs_f64();
    drop(s);
    receiver.join().map_err(|_| anyhow::anyhow!("receiver thread panicked"))?.context("receiving")?;
    Ok(sent as f64 / secs)
}

/// One-way latency of a small message over a plain socket pair on `ip`: the median of `rounds`
/// 8-byte ping-pongs, halved. The cost model's per-message term `a`.
pub fn latency(ip: &str, rounds: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("binding {ip}:0"))?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut buf = [0u8; 8];
        loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&buf)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(10)).context("connecting to the echo")?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = [7u8; 8];
    let mut rtts = Vec::with_capacity(rounds);
    for i in 0..rounds.max(1) + 10 {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut buf)?;
        // The first round trips warm the caches and the scheduler; leave them out.
        if i >= 10 {
            rtts.push(t.elapsed().as_secs_f64());
        }
    }
    drop(s);
    echo.join().map_err(|_| anyhow::anyhow!("echo thread panicked"))?.context("echoing")?;
    Ok(crate::table::median(&rtts) / 2.0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn latency_is_small_and_positive() {
        let a = super::latency("127.0.0.1", 50).unwrap();
        assert!(a > 0.0 && a < 0.1, "loopback one-way latency {a} s");
    }

    #[test]
    fn measures_something_positive() {
        let b = super::bandwidth("127.0.0.1", std::time::Duration::from_millis(200)).unwrap();
        assert!(b > 1e6, "loopback moved only {b} B/s");
    }
}
