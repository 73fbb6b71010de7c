//! The alpha-beta cost model of one step's gradient exchange, fitted to the link measured in
//! the same run (`a`: one-way small-message latency; `B`: raw TCP bandwidth).
//!
//! - Ring all-reduce (reduce-scatter then all-gather, Thakur et al.):
//!   `T = 2(n-1)a + 2(n-1)/n * S/B`.
//! - Parameter server with `k` shards, per direction (BytePS, OSDI'20): the busiest link is
//!   either one worker's (S/B) or one server's (n S / (k B)): `max(S/B, nS/(kB))`. Pushes use
//!   one direction of a full-duplex link and pulls the other, so when they are pipelined (chunk
//!   i pulled while chunk i+1 is pushed) a step costs `T = 2a + max(S/B, nS/(kB))`; a PS that
//!   pushes everything before it pulls pays the max twice ([`ps_sequential`]).

/// The link the model is fitted to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Seconds per message.
    pub a: f64,
    /// Bytes per second.
    pub b: f64,
}

/// Seconds for a ring all-reduce of `s` bytes over `n` ranks.
pub fn ring(n: usize, s: f64, l: Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    2.0 * (n - 1.0) * l.a + 2.0 * (n - 1.0) / n * s / l.b
}

/// Seconds for one push and one pull of `s` bytes by each of `n` workers through `k` shards,
/// push and pull pipelined over the two directions of the link.
pub fn ps(n: usize, k: usize, s: f64, l: Link) -> f64 {
    let (n, k) = (n.max(1) as f64, k.max(1) as f64);
    2.0 * l.a + (s / l.b).max(n * s / (k * l.b))
}

/// [`ps`] with the pull starting only after the whole push.
pub fn ps_sequential(n: usize, k: usize, s: f64, l: Link) -> f64 {
    2.0 * ps(n, k, s, l) - 2.0 * l.a
}

/// Bytes one worker sends plus receives per step, in theory.
pub fn ring_bytes_per_worker(n: usize, s: f64) -> f64 {
    if n <= 1 { 0.0 } else { 2.0 * 2.0 * (n as f64 - 1.0) / n as f64 * s }
}

/// Bytes one PS worker sends plus receives per step (push S, pull S).
pub fn ps_bytes_per_worker(s: f64) -> f64 {
    2.0 * s
}

/// Bytes in plus out at all servers together per step (n pushes and n pulls of S).
pub fn ps_bytes_at_servers(n: usize, s: f64) -> f64 {
    2.0 * n as f64 * s
}

/// The smallest worker count in `1..=max` at which the PS with `k(n)` shards is faster than
/// the ring, and the largest, if any.
pub fn ps_wins(max: usize, s: f64, l: Link, k: impl Fn(usize) -> usize) -> Option<(usize, usize)> {
    let wins: Vec<usize> = (2..=max).filter(|&n| ps(n, k(n), s, l) < ring(n, s, l)).collect();
    Some((*wins.first()?, *wins.last()?))
}

/// Gbit/s to bytes/s.
pub fn gbit(g: f64) -> f64 {
    g * 1e9 / 8.0
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn textbook_values() {
        let l = Link { a: 0.0, b: 1.0 };
        // Bandwidth-only ring: 2(n-1)/n S.
        assert!((ring(4, 100.0, l) - 150.0).abs() < 1e-9);
        assert_eq!(ring(1, 100.0, l), 0.0);
        // PS, k = n: S/B per direction; k = 1: n S/B.
        assert!((ps(4, 4, 100.0, l) - 100.0).abs() < 1e-9);
        assert!((ps(4, 1, 100.0, l) - 400.0).abs() < 1e-9);
        assert!((ps_sequential(4, 1, 100.0, l) - 800.0).abs() < 1e-9);
        // Latency: 2(n-1) messages for the ring, 2 for the PS.
        let l = Link { a: 1.0, b: f64::INFINITY };
        assert_eq!(ring(5, 1.0, l), 8.0);
        assert_eq!(ps(5, 1, 1.0, l), 2.0);
        // With as many shards as workers the PS wins on bandwidth from 3 workers on.
        let l = Link { a: 1e-6, b: gbit(10.0) };
        let w = ps_wins(64, 4e6, l, |n| n).unwrap();
        assert_eq!(w.0, 3);
        assert!(ps_wins(64, 4e6, l, |_| 1).is_none());
    }
}
