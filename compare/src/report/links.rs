//! Readings of the network: the busiest parameter-server shard and each mode's communication
//! against the raw TCP yardstick with as many streams as the mode keeps busy, the ring's
//! fitted latency and bandwidth, and the cost model extrapolated to other links and designs.
//! A figure above its yardstick is never called a share of a limit ([`Yardstick::read`]).

use super::context::{Context, Yardstick};
use crate::charts::Group;
use crate::cost::{self, Link};
use crate::results::Summary;
use crate::scenario::ModeKind;

/// The busiest parameter-server shard: bytes per second in and out against what as many raw
/// TCP streams as it has connections carry together, and where its throughput stops growing.
pub fn busiest_shard(cx: &Context) -> Vec<String> {
    let g = cx.g;
    let loads: Vec<(f64, &Summary)> = g
        .rows
        .iter()
        .filter_map(|r| {
            let steps_per_s = r.samples_per_s? / r.global_batch.max(1) as f64;
            Some((r.bytes_per_step_server? * steps_per_s / r.shards.max(1) as f64, *r))
        })
        .collect();
    let Some(&(bps, r)) = loads.iter().max_by(|a, b| a.0.total_cmp(&b.0)) else { return Vec::new() };
    let Some(streams) = Context::streams(r) else { return Vec::new() };
    let Some(y) = cx.yardstick(streams.busiest) else { return Vec::new() };
    let series: Vec<&Summary> =
        g.rows.iter().copied().filter(|x| Group::series(x) == Group::series(r)).collect();
    let flat = series.windows(2).find(|w| Context::thr(w[1]) < 1.1 * Context::thr(w[0]));
    vec![format!(
        "The busiest parameter-server shard ({} at {} workers, {} connections) moves {:.2} GB/s in and out, {}{}.",
        Group::series(r),
        r.workers,
        streams.busiest,
        bps / 1e9,
        y.read(bps / y.bytes_per_s),
        match flat {
            Some(w) => format!(
                "; its throughput stops growing between {} and {} workers ({:.0} -> {:.0} samples/s)",
                w[0].workers,
                w[1].workers,
                Context::thr(w[0]),
                Context::thr(w[1])
            ),
            None => "; its throughput still grows with every worker added".into(),
        }
    )]
}

/// The bytes all ranks together move per step, and the per-message latencies the alpha-beta
/// model charges, for a mode reading `s` bytes of gradients at `n` workers.
fn traffic(mode: &str, n: usize, s: f64, a: f64) -> Option<(f64, f64)> {
    let n_f = n as f64;
    match mode {
        // Each rank sends 2(n-1)/n S.
        "ddp-tcp" | "zero1-tcp" => Some((2.0 * (n_f - 1.0) * s, 2.0 * (n_f - 1.0) * a)),
        // Each worker pushes S and pulls S.
        "ps-bsp" => Some((2.0 * n_f * s, 2.0 * a)),
        _ => None,
    }
}

/// What the cost model says one exchange of `r` takes on `l`, seconds, with each link's
/// bandwidth one stream's and each rank on a host of its own: the ring's for the flat ring,
/// ZeRO-1's, one push and pull through its shards for a bulk-synchronous parameter server
/// (on the workers' hosts where the run colocated them). None for a mode it does not price.
pub(crate) fn per_link_model(r: &Summary, s: f64, l: Link) -> Option<f64> {
    match r.mode.parse::<ModeKind>().ok()? {
        ModeKind::DdpTcp => Some(cost::ring(r.workers, s, l)),
        ModeKind::Zero1Tcp => Some(cost::zero1(r.workers, s, l)),
        ModeKind::PsBsp => Some(cost::ps_placed(r.workers, 1, r.shards.max(1), r.colocated, s, s, l)),
        _ => None,
    }
}

/// What the cost model says one exchange of row `r` (`s` bytes of gradients) takes on link
/// `l`, seconds: for a run the emulated cluster placed (`cx.cluster`), as placed (ranks sharing
/// a host share its link; servers on the workers' hosts or their own); otherwise each rank on a
/// host of its own ([`per_link_model`]). None for a mode the model does not price.
pub(crate) fn exchange_model(cx: &Context, r: &Summary, s: f64, l: Link) -> Option<f64> {
    match cx.cluster.iter().find(|c| c.id == r.id) {
        Some(c) => super::cluster::placed_prediction(c, s, l),
        None => per_link_model(r, s, l),
    }
}

/// Measured communication at the most workers against what the raw wire allows. On loopback,
/// where every socket shares one machine, that is all the ranks' bytes at what as many raw
/// streams carry together as the run keeps busy, plus the model's latencies; on an emulated
/// link (or without the many-stream yardstick) the alpha-beta model with one stream's rate
/// per link, named as such.
pub fn communication_against_raw(cx: &Context) -> Vec<String> {
    let (Some(l), Some(nmax)) = (cx.link, cx.most_workers()) else { return Vec::new() };
    let s = cx.g.grad_bytes();
    let mut out = Vec::new();
    for r in cx.g.rows.iter().filter(|r| r.workers == nmax && r.workers > 1) {
        let (Some(c), Some((bytes, lat)), Some(st)) =
            (r.comm_ms.filter(|&c| c > 0.0), traffic(&r.mode, r.workers, s, l.a), Context::streams(r))
        else {
            continue;
        };
        let Some(y) = cx.yardstick(st.total) else { continue };
        let (raw_ms, how) = if y.streams > 1 {
            let t = (lat + bytes / y.bytes_per_s) * 1e3;
            (
                t,
                format!(
                    "its {:.1} MB per step (all ranks) at that rate plus the model's latencies take {t:.2} ms",
                    bytes / 1e6
                ),
            )
        } else {
            let Some(t) = exchange_model(cx, r, s, l) else { continue };
            let t = t * 1e3;
            (t, format!("the alpha-beta model, one stream's rate per link, predicts {t:.2} ms"))
        };
        out.push(format!(
            "{} at {} workers: {c:.2} ms of communication per step measured; {how}: the implementation reaches {}.",
            Group::series(r),
            r.workers,
            y.read(raw_ms / c),
        ));
    }
    out
}

/// The ring model fitted to the ring's own measurements, its bandwidth per hop against one
/// raw stream's.
pub fn ring_fit(cx: &Context) -> Vec<String> {
    let Some(l) = cx.link else { return Vec::new() };
    let pts = cx.g.ring_points();
    if pts.len() < 2 {
        return Vec::new();
    }
    let Some(fit) = cost::fit_ring(&pts) else { return Vec::new() };
    let one = Yardstick { bytes_per_s: l.b, streams: 1 }.read(fit.b / l.b);
    vec![if fit.a > 0.0 {
        format!(
            "Fitting the ring model to the ring's own {} measurements gives a = {:.1} us per message and an \
             effective B = {:.2} GB/s per hop, {one}.",
            pts.len(),
            fit.a * 1e6,
            fit.b / 1e9,
        )
    } else {
        // A least-squares latency below zero says the points cannot tell the per-message
        // cost from the bandwidth term: report the bandwidth alone, and say so.
        format!(
            "The ring's own {} measurements do not separate a per-message latency from the bandwidth \
             term (the best fit puts it below zero), so only an effective B = {:.2} GB/s per hop ({one}) is \
             fitted; more worker counts would separate them.",
            pts.len(),
            fit.b / 1e9,
        )
    }]
}

/// The cost model extrapolated to 10 Gbit/s links and 1024 workers: ring against PS, and
/// compression and hierarchy.
pub fn extrapolated(cx: &Context) -> Vec<String> {
    let Some(l) = cx.link else { return Vec::new() };
    if super::sparse::table(cx).is_some() {
        // A push and pull of the whole model is not what a parameter server does with a sparse
        // table: the sparse reading takes the cost model to other tables instead.
        return Vec::new();
    }
    let s = cx.g.grad_bytes();
    let ten = Link { a: l.a, b: cost::gbit(10.0) };
    let ps_half = cost::ps_wins(1024, s, ten, |n| (n / 2).max(1));
    let line = format!(
        "Extrapolated to 10 Gbit/s links and 1024 workers, one exchange of {:.1} MB costs {:.1} ms on the ring, \
         {:.1} ms through one server and {:.1} ms with one server per worker. With a server per worker the PS \
         beats the ring from {} workers on (S/B against 2(n-1)/n S/B plus the ring's 2(n-1) latencies); with \
         half as many servers as workers it {}; with a single server {}.",
        s / 1e6,
        cost::ring(1024, s, ten) * 1e3,
        cost::ps(1024, 1, s, ten) * 1e3,
        cost::ps(1024, 1024, s, ten) * 1e3,
        cost::ps_wins(1024, s, ten, |n| n).map_or("no worker count".into(), |w| w.0.to_string()),
        match ps_half {
            Some((a, _)) => format!(
                "wins from {a} workers on, once the ring's latency term outgrows the server's extra bandwidth"
            ),
            None => "never wins up to 1024 workers".into(),
        },
        match cost::ps_wins(1024, s, ten, |_| 1) {
            Some((_, b)) => format!("it is faster only up to {b} workers"),
            None => "it is slower than the ring at every worker count from 2 to 1024".into(),
        }
    );
    vec![line, designs_reading(s, ten)]
}

/// Where compression and a hierarchy win in the cost model, for `s` bytes of gradients over
/// link `l`: the crossovers are computed, not assumed.
fn designs_reading(s: f64, l: Link) -> String {
    use gradsync_core::compress::Compression;
    let topk = Compression::TopK(0.01);
    let beats = |n: usize, other: f64| cost::ring_compressed(n, s, topk, l) < other;
    let last = |f: &dyn Fn(usize) -> bool| (2..=1024).take_while(|&n| f(n)).last();
    let vs_dense = last(&|n| beats(n, cost::ring(n, s, l)));
    let vs_half = last(&|n| beats(n, cost::ring_compressed(n, s, Compression::Fp16, l)));
    let upto = |w: Option<usize>| w.map_or("at no worker count".to_string(), |w| format!("up to {w} ranks"));
    let n = 32;
    let sparse = topk.wire_bytes((s / 4.0) as usize) as f64;
    let (dense_ps, topk_ps) = (cost::ps(n, n, s, l), cost::ps_compressed(n, n, sparse, s, l));
    let (flat, leaders) = (cost::flat_across_hosts(8, 8, s, l), cost::ring(8, s, l));
    format!(
        "Compression and hierarchy in the same model (10 Gbit/s, table \"Where each design wins\"): fp16 halves the \
         bandwidth term of the ring and of the PS at every worker count. Top-k 1% on the ring must all-gather every \
         rank's (index, value) pairs, a term that grows with the ranks: it beats the dense ring {} and the fp16 \
         ring {} in exchange time alone (top-k needs more steps to reach the same accuracy). On the PS the same top-k shrinks each push {:.0}x, yet with dense pulls the step stays bound by \
         the pull direction: {:.2} ms against {:.2} ms uncompressed at {n} workers, so top-k saves the PS bytes \
         and memory traffic at the servers, not time, unless the pulls shrink too. A hierarchy of 8 ranks per host \
         cuts what crosses hosts from 2(N-1)/N S to 2(h-1)/h S: at 64 ranks on 8 hosts, {:.2} ms for the leaders' \
         ring against {:.2} ms for the flat ring's inter-host hops.",
        upto(vs_dense),
        upto(vs_half),
        s / sparse,
        topk_ps * 1e3,
        dense_ps * 1e3,
        leaders * 1e3,
        flat * 1e3
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_designs_crossovers_are_computed_from_the_model() {
        let l = Link { a: 0.0, b: cost::gbit(10.0) };
        let r = designs_reading(4e6, l);
        // Top-k 1% all-gathered: below the dense ring while n < 1/r, below fp16 while n < 1/(2r).
        assert!(r.contains("beats the dense ring up to 99 ranks"), "{r}");
        assert!(r.contains("the fp16 ring up to 49 ranks"), "{r}");
        assert!(r.contains("shrinks each push 50x"), "{r}");
        // With a per-message latency, the all-gather's fewer messages keep it ahead longer.
        let r = designs_reading(4e6, Link { a: 50e-6, ..l });
        assert!(!r.contains("up to 99 ranks"), "{r}");
    }
}
