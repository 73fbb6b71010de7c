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
//! - ZeRO stage 1 (Rajbhandari et al., SC'20): a reduce-scatter and an all-gather, i.e. the
//!   ring's `2(n-1)a + 2(n-1)/n * S/B` ([`zero1`]), of which only the reduce-scatter can hide
//!   behind backward: the all-gather waits for the update ([`zero1_exposed`]). In exchange the
//!   update touches 1/n of the state: SGD with momentum reads parameters, gradients and
//!   momentum and writes parameters and momentum, `5 S` bytes of memory traffic for DDP and
//!   `5 S / n` for ZeRO-1 ([`update_bytes`]).
//! - Compression (`--compress`) changes the bytes, not the shape: fp16/bf16 halve `S` on
//!   every hop; top-k at ratio `r` sends `8 r S / 4 = 2 r S` bytes of (index, value) pairs. A PS
//!   server sums sparse pushes as they come ([`ps_compressed`]: push and pull directions each
//!   with their own bytes), while a ring cannot add two sparse vectors hop by hop without
//!   densifying them, so it all-gathers every rank's pairs ([`ring_compressed`]):
//!   `(n-1)a + (n-1) 2rS/B`, which grows with `n` where the dense ring's term does not.
//!   Top-k on the ring beats the dense ring while `n < 1/r` and fp16 while `n < 1/(2r)`.
//! - Hierarchical all-reduce over `h` hosts of `m` ranks (NCCL's tree/ring, Horovod's
//!   hierarchical allreduce): reduce inside each host, ring among one leader per host, broadcast
//!   inside ([`hierarchical`]). A flat ring over all `N = h m` ranks, laid out host by host,
//!   crosses each host's link once per direction and every hop carries `2(N-1)/N S`
//!   ([`flat_across_hosts`]); the leaders' ring carries `2(h-1)/h S`. With 2 hosts of 2 ranks:
//!   1.5 S against 1.0 S on the inter-host link, the 1.5x the hierarchy can win there.
//!   The all-reduce cuts a buffer into pieces and overlaps them (the leaders' ring of piece `i`
//!   while the host reduces piece `i+1` and then broadcasts piece `i`):
//!   [`hierarchical_pipelined`] runs that pipeline piece by piece, the reduce and the broadcast
//!   of a piece each half of an intra-host ring all-reduce of it; with one piece it is
//!   [`hierarchical`].
//! - A parameter server placed on hosts ([`ps_placed`]): `h` hosts of `m` workers each, `k`
//!   servers either on hosts of their own or colocated one a host with the workers. Each host's
//!   NIC carries, per direction, what its workers and its server send and receive across hosts;
//!   the busiest direction of the busiest NIC decides (incast: a server's inbound direction
//!   carries `n/k` pushes). On hosts of their own with `m = 1` it is [`ps_compressed`];
//!   colocated, a server host's NIC carries its workers' pushes to the other `k-1` servers and
//!   its server's pulls to the other hosts' workers: `2(h-1)/h m S` each way for `k = h`,
//!   twice what a worker host sends with the servers apart.
//! - A sparse model ([`Sparse`]: a table of `R` rows of `d` f32 values, and `D` bytes of dense
//!   layers) touches `u` distinct rows per worker's batch, a small fraction `u / R` of the
//!   table. Moved by id, a row costs `4d + 4` bytes (its values and a 4-byte id): a ps-sparse
//!   worker pushes `u (4d + 4) + D` and pulls as much for its next batch ([`sparse_ps`]);
//!   DDP's all-gather sends each rank's rows, padded to the largest count, to every other
//!   rank, `(n-1) u (4d + 4)`, beside the ring all-reduce of `D` ([`sparse_allgather`]); the
//!   hybrid pushes and pulls its rows through the table's servers and all-reduces `D` among
//!   the workers ([`sparse_hybrid`]). ddp-dense all-reduces the whole model, `4Rd + D`, zeros
//!   included: [`ring`]. How many rows a batch names is measured in a run (`rows`), or
//!   estimated for the built-in clicks data from its law of ids ([`clicks_unique_rows`]).

use gradsync_core::compress::Compression;

/// The link the model is fitted to.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
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

/// Seconds for ZeRO-1's exchange of `s` bytes over `n` ranks: reduce-scatter plus all-gather,
/// the ring all-reduce's two halves.
pub fn zero1(n: usize, s: f64, l: Link) -> f64 {
    ring(n, s, l)
}

/// The part of [`zero1`] that no backward can hide: the all-gather, `(n-1)a + (n-1)/n * S/B`,
/// which must wait for the update.
pub fn zero1_exposed(n: usize, s: f64, l: Link) -> f64 {
    ring(n, s, l) / 2.0
}

/// Bytes of memory traffic of one SGD-with-momentum step over `s` bytes of parameters split
/// into `shards` (1 for DDP, n for ZeRO-1): read parameters, gradients, momentum; write
/// parameters and momentum.
pub fn update_bytes(shards: usize, s: f64) -> f64 {
    5.0 * s / shards.max(1) as f64
}

/// Seconds for one push and one pull of `s` bytes by each of `n` workers through `k` shards,
/// push and pull pipelined over the two directions of the link.
pub fn ps(n: usize, k: usize, s: f64, l: Link) -> f64 {
    ps_on_hosts(n, 1, k, s, l)
}

/// [`ps`] with the `n` workers `per_host` to a host, each host's link carrying their pushes
/// (and pulls) together: the busiest link is a worker host's (`per_host S / B`) or a
/// server's (`n S / (k B)`).
pub fn ps_on_hosts(n: usize, per_host: usize, k: usize, s: f64, l: Link) -> f64 {
    let (n, m, k) = (n.max(1) as f64, per_host.max(1) as f64, k.max(1) as f64);
    2.0 * l.a + (m * s / l.b).max(n * s / (k * l.b))
}

/// [`ps`] with the pull starting only after the whole push.
pub fn ps_sequential(n: usize, k: usize, s: f64, l: Link) -> f64 {
    2.0 * ps(n, k, s, l) - 2.0 * l.a
}

/// Seconds for one push of `push` bytes and one pull of `pull` bytes by each of `n` workers
/// through `k` shards, pipelined over the two directions: each direction's busiest link
/// (a worker's, or a server's carrying `n/k` workers' bytes) decides, and the slower
/// direction decides the step.
pub fn ps_compressed(n: usize, k: usize, push: f64, pull: f64, l: Link) -> f64 {
    let (n, k) = (n.max(1) as f64, k.max(1) as f64);
    let busiest = |bytes: f64| (bytes / l.b).max(n * bytes / (k * l.b));
    2.0 * l.a + busiest(push).max(busiest(pull))
}

/// Seconds for an all-reduce of `s` bytes of f32 gradients over `n` ranks, compressed `c`:
/// the dense ring over the smaller values for fp16/bf16, an all-gather of every rank's
/// (index, value) pairs for top-k.
pub fn ring_compressed(n: usize, s: f64, c: Compression, l: Link) -> f64 {
    let wire = c.wire_bytes((s / 4.0) as usize) as f64;
    match c {
        Compression::TopK(_) if n > 1 => (n as f64 - 1.0) * (l.a + wire / l.b),
        _ => ring(n, wire, l),
    }
}

/// Seconds for an all-reduce of `s` bytes over `hosts` hosts of `per_host` ranks each: a ring
/// inside each host over `intra` (reduce to the leader, then broadcast back, which together
/// move what an intra-host ring all-reduce moves), and a ring among the leaders over `inter`.
pub fn hierarchical(hosts: usize, per_host: usize, s: f64, inter: Link, intra: Link) -> f64 {
    ring(per_host, s, intra) + ring(hosts, s, inter)
}

/// Seconds for the hierarchical all-reduce of a buffer cut into pieces of `pieces` bytes (in
/// order) over `hosts` hosts of `per_host` ranks: the leaders' ring of a piece over `inter` may
/// start once the host has reduced it and the ring of the piece before has ended; inside the
/// host, over `intra`, the reduce of the next piece goes first, then the broadcast of this one
/// once its ring has ended. A reduce and a broadcast each cost half an intra-host ring
/// all-reduce of the piece (together they move what one moves, as in [`hierarchical`]).
pub fn hierarchical_pipelined(
    hosts: usize,
    per_host: usize,
    pieces: &[f64],
    inter: Link,
    intra: Link,
) -> f64 {
    let half = |p: f64| ring(per_host, p, intra) / 2.0;
    let Some(&first) = pieces.first() else { return 0.0 };
    // When the host is free again, when piece `i` is reduced, when the leaders' link is free.
    let (mut host, mut reduced, mut leaders) = (half(first), half(first), 0.0f64);
    for (i, &p) in pieces.iter().enumerate() {
        leaders = leaders.max(reduced) + ring(hosts, p, inter);
        if let Some(&next) = pieces.get(i + 1) {
            host += half(next);
            reduced = host;
        }
        host = host.max(leaders) + half(p);
    }
    host
}

/// Seconds for one push of `push` bytes and one pull of `pull` bytes by each of `hosts x
/// per_host` workers through `k` servers, on links `l` (one NIC a host, full duplex), push and
/// pull pipelined: the busiest direction of the busiest NIC decides, plus a message each way.
/// `colocated`: server `i` on worker host `i` (`k <= hosts`), its own workers' share of the
/// exchange staying inside the host; otherwise each server on a host of its own.
pub fn ps_placed(
    hosts: usize,
    per_host: usize,
    k: usize,
    colocated: bool,
    push: f64,
    pull: f64,
    l: Link,
) -> f64 {
    let (h, m, k) = (hosts.max(1) as f64, per_host.max(1) as f64, k.max(1) as f64);
    let n = h * m;
    // Bytes out and in of a worker host without a server, and of a server's host.
    let worker_host = (m * push, m * pull);
    let server_host = if colocated {
        // Its workers' pushes to the other servers and its server's pulls to the other hosts'
        // workers go out; the other hosts' pushes and its workers' pulls from the others come in.
        (m * push * (k - 1.0) / k + (n - m) * pull / k, m * pull * (k - 1.0) / k + (n - m) * push / k)
    } else {
        (n * pull / k, n * push / k)
    };
    let mut busiest = server_host.0.max(server_host.1);
    if !colocated || k < h {
        busiest = busiest.max(worker_host.0).max(worker_host.1);
    }
    2.0 * l.a + busiest / l.b
}

/// Seconds for a flat ring all-reduce of `s` bytes over `hosts x per_host` ranks laid out host
/// by host: every hop carries `2(N-1)/N S`, and the slowest hop, the inter-host link, decides;
/// each of the `2(N-1)` steps pays the inter-host latency on the hops that cross.
pub fn flat_across_hosts(hosts: usize, per_host: usize, s: f64, inter: Link) -> f64 {
    if hosts <= 1 {
        return ring(per_host, s, inter);
    }
    ring(hosts * per_host, s, inter)
}

/// Bytes one worker sends plus receives per step, in theory.
pub fn ring_bytes_per_worker(n: usize, s: f64) -> f64 {
    if n <= 1 { 0.0 } else { 2.0 * 2.0 * (n as f64 - 1.0) / n as f64 * s }
}

/// Bytes one worker sends plus receives per step in an all-reduce of `s` bytes of f32 values
/// compressed `c` ([`ring_compressed`]): the dense ring's over the smaller values, or for top-k
/// its pairs sent to and every other rank's received from the `n-1` others.
pub fn ring_compressed_bytes_per_worker(n: usize, s: f64, c: Compression) -> f64 {
    let wire = c.wire_bytes((s / 4.0) as usize) as f64;
    match c {
        Compression::TopK(_) if n > 1 => 2.0 * (n as f64 - 1.0) * wire,
        _ => ring_bytes_per_worker(n, wire),
    }
}

/// Bytes the busiest worker of the hierarchical all-reduce of `s` bytes over `hosts` hosts of
/// `per_host` ranks sends plus receives: a leader moves the leaders' ring's bytes and, from
/// and to its host's chain, the reduced buffer in and the sum out; a rank inside a chain of
/// three or more receives and sends the buffer on both ways.
pub fn hierarchical_bytes_per_worker(hosts: usize, per_host: usize, s: f64) -> f64 {
    let chain = if per_host > 1 { 2.0 * s } else { 0.0 };
    let inner = if per_host > 2 { 4.0 * s } else { 0.0 };
    (ring_bytes_per_worker(hosts, s) + chain).max(inner)
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

/// Least-squares fit of the ring model to measured all-reduce times: `points` holds (ranks,
/// bytes, seconds) and the fit solves `t = a * 2(n-1) + (1/B) * 2(n-1)/n * S` for `a` and `1/B`
/// (normal equations of the two-column regression). `None` unless the points determine both
/// terms and give a positive bandwidth; a negative latency is clamped to zero (a pure
/// bandwidth fit, refitted through the origin).
pub fn fit_ring(points: &[(usize, f64, f64)]) -> Option<Link> {
    let rows: Vec<(f64, f64, f64)> = points
        .iter()
        .filter(|p| p.0 > 1 && p.2 > 0.0)
        .map(|&(n, s, t)| {
            let n = n as f64;
            (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n * s, t)
        })
        .collect();
    let (mut s11, mut s12, mut s22, mut s1t, mut s2t) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x1, x2, t) in &rows {
        s11 += x1 * x1;
        s12 += x1 * x2;
        s22 += x2 * x2;
        s1t += x1 * t;
        s2t += x2 * t;
    }
    let det = s11 * s22 - s12 * s12;
    if rows.len() >= 2 && det.abs() > 1e-12 * s11 * s22 {
        let a = (s1t * s22 - s2t * s12) / det;
        let inv_b = (s11 * s2t - s12 * s1t) / det;
        if a >= 0.0 && inv_b > 0.0 {
            return Some(Link { a, b: 1.0 / inv_b });
        }
    }
    // One size or a negative latency: bandwidth only.
    (s22 > 0.0 && s2t > 0.0).then(|| Link { a: 0.0, b: s22 / s2t })
}

/// Bytes one table row costs moved by id: `dim` f32 values and a 4-byte id (the PS's u32,
/// the all-gather's f32).
pub fn row_bytes(dim: usize) -> f64 {
    4.0 * dim as f64 + 4.0
}

/// A sparse model's step, as the cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sparse {
    /// The table's rows.
    pub rows: usize,
    /// Values per row.
    pub dim: usize,
    /// Bytes of everything else (the dense layers' f32 values).
    pub dense: f64,
    /// Distinct rows one worker's batch names (measured, or [`clicks_unique_rows`]).
    pub unique: f64,
}

impl Sparse {
    /// Bytes of the whole model, table and dense layers: what ddp-dense all-reduces.
    pub fn whole(&self) -> f64 {
        4.0 * (self.rows * self.dim) as f64 + self.dense
    }

    /// Bytes of one worker's rows moved by id.
    pub fn rows_bytes(&self) -> f64 {
        self.unique * row_bytes(self.dim)
    }

    /// The share of the table a worker's batch names.
    pub fn touched(&self) -> f64 {
        self.unique / self.rows.max(1) as f64
    }

    /// Bytes one worker sends plus receives per step, in theory, in `mode`'s way of moving the
    /// table (`None` for a mode that is not one of them).
    pub fn bytes_per_worker(&self, mode: super::scenario::ModeKind, n: usize) -> Option<f64> {
        use super::scenario::ModeKind as M;
        let nf = n.max(1) as f64;
        Some(match mode {
            M::PsSparse | M::PsBsp => 2.0 * (self.rows_bytes() + self.dense),
            M::DdpDense | M::DdpTcp => ring_bytes_per_worker(n, self.whole()),
            M::DdpAllgather => 2.0 * (nf - 1.0) * self.rows_bytes() + ring_bytes_per_worker(n, self.dense),
            M::Hybrid => 2.0 * self.rows_bytes() + ring_bytes_per_worker(n, self.dense),
            _ => return None,
        })
    }

    /// Seconds of `mode`'s exchange per step over `n` workers (and `k` shards), by the
    /// alpha-beta model (`None` for a mode that is not one of the table's ways).
    pub fn seconds(&self, mode: super::scenario::ModeKind, n: usize, k: usize, l: Link) -> Option<f64> {
        use super::scenario::ModeKind as M;
        Some(match mode {
            M::PsSparse | M::PsBsp => sparse_ps(n, k, self, l),
            M::DdpDense | M::DdpTcp => ring(n, self.whole(), l),
            M::DdpAllgather => sparse_allgather(n, self, l),
            M::Hybrid => sparse_hybrid(n, k, self, l),
            _ => return None,
        })
    }
}

/// Seconds for a ps-sparse step: each of `n` workers pushes its rows and the dense values and
/// pulls as much (the next batch's rows), pipelined over the two directions, through `k`
/// shards (rows split by range, so each shard sees about `1/k` of every worker's rows).
pub fn sparse_ps(n: usize, k: usize, sp: &Sparse, l: Link) -> f64 {
    let each = sp.rows_bytes() + sp.dense;
    ps_compressed(n, k, each, each, l)
}

/// Seconds for DDP's all-gather of the rows: one all-gather of the counts and one of the
/// padded rows, `(n-1)` messages each, beside the ring all-reduce of the dense values.
pub fn sparse_allgather(n: usize, sp: &Sparse, l: Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let hops = n as f64 - 1.0;
    hops * l.a + hops * (l.a + sp.rows_bytes() / l.b) + ring(n, sp.dense, l)
}

/// Seconds for the hybrid's step: the ring all-reduce of the dense values among the workers,
/// then each worker's rows pushed to and pulled from the `k` table shards (after backward, so
/// the two add up).
pub fn sparse_hybrid(n: usize, k: usize, sp: &Sparse, l: Link) -> f64 {
    let rows = sp.rows_bytes();
    ring(n, sp.dense, l) + ps_compressed(n, k, rows, rows, l)
}

/// Expected distinct ids among `samples` samples of the built-in clicks data over a table of
/// `rows` ids (an estimate, from the generator's law: each sample names `m` ids, `m` uniform
/// in `ids`, each id drawn with probability proportional to `rank^-zipf`). A rank of
/// probability `p` is missed by one sample with probability `E_m[(1-p)^m]` and by all of them
/// with that to the power `samples`; the estimate sums `1 - that` over the ranks.
pub fn clicks_unique_rows(rows: usize, ids: (usize, usize), zipf: f64, samples: usize) -> f64 {
    if rows == 0 || samples == 0 || ids.1 < ids.0 {
        return 0.0;
    }
    let norm: f64 = (1..=rows).map(|k| (k as f64).powf(-zipf)).sum();
    let (lo, span) = (ids.0 as i32, (ids.1 - ids.0 + 1) as i32);
    (1..=rows)
        .map(|k| {
            let p = (k as f64).powf(-zipf) / norm;
            let q = 1.0 - p;
            // The mean of q^m over m in lo..=hi: a geometric sum.
            let miss_one = if p < 1e-15 {
                1.0 - p * (f64::from(lo) + f64::from(span - 1) / 2.0)
            } else {
                q.powi(lo) * (1.0 - q.powi(span)) / (p * f64::from(span))
            };
            1.0 - miss_one.powf(samples as f64)
        })
        .sum()
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
    fn compression_changes_the_bytes_each_design_moves() {
        let l = Link { a: 0.0, b: 1.0 };
        let s = 4e6;
        // fp16 halves the ring; none is the ring.
        assert!((ring_compressed(4, s, Compression::Fp16, l) - ring(4, s / 2.0, l)).abs() < 1e-6);
        assert_eq!(ring_compressed(4, s, Compression::None, l), ring(4, s, l));
        // Top-k 1% on the ring: an all-gather of (n-1) blocks of 2rS bytes.
        let t = ring_compressed(8, s, Compression::TopK(0.01), l);
        assert!((t - 7.0 * 2.0 * 0.01 * s).abs() < 1.0, "{t}");
        // It beats the dense ring below n = 1/r and loses above.
        let c = Compression::TopK(0.01);
        assert!(ring_compressed(99, s, c, l) < ring(99, s, l));
        assert!(ring_compressed(101, s, c, l) > ring(101, s, l));
        // The PS with equal push and pull bytes is the PS.
        assert_eq!(ps_compressed(4, 2, s, s, l), ps(4, 2, s, l));
        // Sparse pushes with dense pulls: the pull direction decides.
        assert_eq!(ps_compressed(4, 4, 2.0 * 0.01 * s, s, l), s);
    }

    #[test]
    fn the_hierarchy_carries_fewer_bytes_across_hosts() {
        let inter = Link { a: 0.0, b: 1.0 };
        let free = Link { a: 0.0, b: f64::INFINITY };
        let s = 100.0;
        // 2 hosts x 2 ranks: 1.5 S flat against 1.0 S among the leaders.
        assert!((flat_across_hosts(2, 2, s, inter) - 150.0).abs() < 1e-9);
        assert!((hierarchical(2, 2, s, inter, free) - 100.0).abs() < 1e-9);
        // One host: no inter-host term at all.
        assert_eq!(hierarchical(1, 4, s, inter, free), 0.0);
    }

    #[test]
    fn the_pipelined_hierarchy_overlaps_its_pieces() {
        let inter = Link { a: 0.0, b: 1.0 };
        let intra = Link { a: 0.0, b: 4.0 };
        // One piece: reduce, leaders' ring, broadcast, one after the other.
        let one = hierarchical_pipelined(2, 2, &[100.0], inter, intra);
        assert!((one - hierarchical(2, 2, 100.0, inter, intra)).abs() < 1e-9, "{one}");
        // Two pieces of 50 over 2 x 2: a reduce or a broadcast of 50 is half an intra-host ring
        // of it, (2 (2-1)/2 50/4) / 2 = 6.25; a leaders' ring of 50 is 2 (2-1)/2 50/1 = 50. Reduce 0 ends at 6.25; ring 0 runs 6.25-56.25 while the
        // host reduces piece 1 (6.25-12.5); broadcast 0 runs 56.25-62.5; ring 1 runs
        // 56.25-106.25; broadcast 1 ends at 112.5.
        let two = hierarchical_pipelined(2, 2, &[50.0, 50.0], inter, intra);
        assert!((two - 112.5).abs() < 1e-9, "{two}");
        assert!(two < hierarchical(2, 2, 100.0, inter, intra));
        assert_eq!(hierarchical_pipelined(2, 2, &[], inter, intra), 0.0);
    }

    #[test]
    fn a_placed_ps_is_decided_by_its_busiest_nic() {
        let l = Link { a: 0.0, b: 1.0 };
        let s = 100.0;
        // One worker a host, servers apart: the PS of the alpha-beta model.
        for (h, k) in [(4, 4), (4, 1), (8, 2)] {
            assert!((ps_placed(h, 1, k, false, s, s, l) - ps(h, k, s, l)).abs() < 1e-9);
            assert!((ps_placed(h, 1, k, false, 10.0, s, l) - ps_compressed(h, k, 10.0, s, l)).abs() < 1e-9);
        }
        // 4 hosts of 2 workers, one server a host apart: a worker host sends 2S; the server
        // host receives 8S/4 = 2S.
        assert!((ps_placed(4, 2, 4, false, s, s, l) - 200.0).abs() < 1e-9);
        // Colocated, k = h = 4: out = 2S 3/4 + 6S/4 = 3S.
        assert!((ps_placed(4, 2, 4, true, s, s, l) - 300.0).abs() < 1e-9);
        // Colocated, one server on one of 4 hosts of one worker: it receives 3 pushes.
        assert!((ps_placed(4, 1, 1, true, s, s, l) - 300.0).abs() < 1e-9);
        let l = Link { a: 1.0, b: f64::INFINITY };
        assert_eq!(ps_placed(4, 2, 2, true, s, s, l), 2.0);
    }

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

    #[test]
    fn zero1_moves_the_rings_bytes_and_a_shard_of_the_update() {
        let l = Link { a: 1e-5, b: 1e9 };
        for n in [2, 3, 8] {
            assert_eq!(zero1(n, 4e6, l), ring(n, 4e6, l));
            // The all-gather: (n-1) messages and (n-1)/n S.
            let n_f = n as f64;
            let want = (n_f - 1.0) * l.a + (n_f - 1.0) / n_f * 4e6 / l.b;
            assert!((zero1_exposed(n, 4e6, l) - want).abs() < 1e-12);
        }
        assert_eq!(update_bytes(1, 100.0), 500.0);
        assert_eq!(update_bytes(4, 100.0), 125.0);
    }

    #[test]
    fn a_sparse_step_moves_its_rows_and_the_dense_ring_the_table() {
        use crate::scenario::ModeKind as M;
        // 2^16 rows of 16, 4 KiB of dense layers, 500 rows a worker's batch.
        let sp = Sparse { rows: 1 << 16, dim: 16, dense: 4096.0, unique: 500.0 };
        assert_eq!(row_bytes(16), 68.0);
        assert_eq!(sp.whole(), 4.0 * 65536.0 * 16.0 + 4096.0);
        let rows = 500.0 * 68.0;
        // The PS: push and pull, rows and dense values each way, whatever n.
        assert_eq!(sp.bytes_per_worker(M::PsSparse, 4), Some(2.0 * (rows + 4096.0)));
        // ddp-dense: 2(n-1)/n of the whole model each way.
        assert_eq!(sp.bytes_per_worker(M::DdpDense, 4), Some(ring_bytes_per_worker(4, sp.whole())));
        // The all-gather grows with n; the hybrid's rows do not.
        assert_eq!(
            sp.bytes_per_worker(M::DdpAllgather, 4),
            Some(6.0 * rows + ring_bytes_per_worker(4, 4096.0))
        );
        assert_eq!(sp.bytes_per_worker(M::Hybrid, 4), Some(2.0 * rows + ring_bytes_per_worker(4, 4096.0)));
        assert_eq!(sp.bytes_per_worker(M::Local, 4), None);
        // Bandwidth only, one shard per worker: the PS moves its rows each way, the ring the table.
        let l = Link { a: 0.0, b: 1.0 };
        assert_eq!(sp.seconds(M::PsSparse, 4, 4, l), Some(rows + 4096.0));
        assert_eq!(sp.seconds(M::DdpDense, 4, 0, l), Some(1.5 * sp.whole()));
        assert_eq!(sp.seconds(M::Hybrid, 4, 4, l), Some(ring(4, 4096.0, l) + rows));
        assert_eq!(sp.seconds(M::DdpAllgather, 4, 0, l), Some(3.0 * rows + ring(4, 4096.0, l)));
        // One shard carries every worker's rows.
        assert_eq!(sparse_ps(4, 1, &sp, l), 4.0 * (rows + 4096.0));
        // Latency: the all-gather's 2(n-1) messages, the PS's 2.
        let l = Link { a: 1.0, b: f64::INFINITY };
        assert_eq!(sparse_allgather(4, &sp, l), 6.0 + ring(4, 4096.0, l));
        assert_eq!(sparse_ps(4, 4, &sp, l), 2.0);
    }

    /// The estimate of the rows a batch names, against the built-in generator itself.
    #[test]
    fn the_unique_rows_estimate_matches_the_clicks_generator() {
        use gradsync_core::data::{CLICKS_IDS, CLICKS_ZIPF, ClicksConfig};
        for (rows, batch) in [(65536usize, 32usize), (65536, 128), (4096, 64)] {
            let data = ClicksConfig::parse(&format!("8192:{rows}")).unwrap().generate(7);
            let slots = CLICKS_IDS.1;
            let per = 2 * slots;
            let samples = data.train.x.len() / per;
            let batches = samples / batch;
            let mut total = 0usize;
            for b in 0..batches {
                let mut seen = std::collections::BTreeSet::new();
                for s in b * batch..(b + 1) * batch {
                    let x = &data.train.x[s * per..s * per + slots];
                    seen.extend(x.iter().filter(|&&id| id >= 0.0).map(|&id| id as u32));
                }
                total += seen.len();
            }
            let measured = total as f64 / batches as f64;
            let est = clicks_unique_rows(rows, CLICKS_IDS, CLICKS_ZIPF, batch);
            assert!(
                (est / measured - 1.0).abs() < 0.03,
                "{rows} rows, batch {batch}: {est:.1} vs {measured:.1}"
            );
        }
        // More rows, more of them named once; more ids per sample, more rows.
        let u = |rows, ids| clicks_unique_rows(rows, ids, 1.05, 32);
        assert!(u(1 << 20, (10, 40)) > u(1 << 16, (10, 40)));
        assert!(u(1 << 16, (20, 80)) > 1.5 * u(1 << 16, (10, 40)));
        assert_eq!(clicks_unique_rows(0, (10, 40), 1.05, 32), 0.0);
    }

    #[test]
    fn fit_recovers_the_link_that_made_the_points() {
        let truth = Link { a: 30e-6, b: 1.5e9 };
        let pts: Vec<(usize, f64, f64)> = [(2, 4e6), (4, 4e6), (8, 1e6), (3, 8e6)]
            .iter()
            .map(|&(n, s)| (n, s, ring(n, s, truth)))
            .collect();
        let f = fit_ring(&pts).unwrap();
        assert!((f.a - truth.a).abs() < 1e-9 && (f.b / truth.b - 1.0).abs() < 1e-9, "{f:?}");
        // One point: bandwidth only, through the origin.
        let f = fit_ring(&pts[..1]).unwrap();
        assert_eq!(f.a, 0.0);
        assert!(fit_ring(&[]).is_none());
    }
}
