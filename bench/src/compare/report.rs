//! `report.html`: one self-contained page (SVGs inlined, no scripts, no external files) with
//! the machine, the scenario, a reading of the figures computed from them, every chart and
//! the tables. Nothing in it depends on when or where it was rendered.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::charts::{Charts, Group, groups};
use super::cost::{self, Link};
use super::emulated::ClusterRun;
use super::machine::Machine;
#[cfg(test)]
use super::results::Cell;
use super::results::{Collected, Summary, overlap};
use super::scenario::ModeKind;

/// Worker counts at which the cost model is tabulated.
const EXTRAPOLATE_N: [usize; 6] = [2, 8, 32, 128, 512, 1024];
/// Link speeds of the extrapolation, Gbit/s.
const LINKS_GBIT: [f64; 3] = [1.0, 10.0, 100.0];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into())
}

/// The link the model is fitted to, when the run directory measured one.
pub fn link_of(m: Option<&Machine>) -> Option<Link> {
    let m = m?;
    (m.tcp_bandwidth > 0.0 && m.tcp_latency_s > 0.0)
        .then_some(Link { a: m.tcp_latency_s, b: m.tcp_bandwidth })
}

/// Draw the charts and write the report into `out`; returns its path.
pub fn write(
    c: &Collected,
    machine: Option<&Machine>,
    scenario: Option<&str>,
    cluster: &[ClusterRun],
    out: &Path,
) -> anyhow::Result<PathBuf> {
    let link = link_of(machine);
    let mut charts = Charts::new(out)?;
    let mut gs = groups(c);
    if gs.is_empty() {
        // No run produced figures: the charts still exist, each saying so.
        gs.push(Group {
            suffix: String::new(),
            model: "no data".into(),
            global_batch: 0,
            params: 0,
            rows: vec![],
            runs: vec![],
            sweep: vec![],
            cells: vec![],
            target: c.target,
        });
    }
    let mut h = String::new();
    h.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>gradsync comparison</title>\n<style>\n\
         body{font-family:'DejaVu Sans',sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}\n\
         table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #bbb;padding:3px 7px;text-align:right}\n\
         th{background:#eee}td.l,th.l{text-align:left}.failed{color:#b00}.skipped{color:#888}\n\
         .diverged{color:#b60;font-style:italic}.interrupted,.stopped,.partial{color:#668}\n\
         figure{margin:1.5em 0}figure svg{max-width:100%;height:auto}figcaption{font-size:13px;color:#555}\n\
         code,pre{background:#f5f5f5}pre{padding:.5em;overflow-x:auto;font-size:12px}\n</style></head><body>\n",
    );
    h.push_str("<h1>gradsync: local, DP, parameter server and ring all-reduce compared</h1>\n");
    machine_section(&mut h, machine);
    for g in &gs {
        charts.draw_group(g, link)?;
        if gs.len() > 1 {
            let _ = writeln!(h, "<h2>{} at global batch {}</h2>", esc(&g.model), g.global_batch);
        }
        h.push_str("<h2>Reading</h2>\n<ul>\n");
        for p in reading(g, link, machine, &c.summaries) {
            let _ = writeln!(h, "<li>{}</li>", esc(&p));
        }
        h.push_str("</ul>\n<h2>Charts</h2>\n");
        for ch in charts.charts.iter().filter(|ch| ch.name.ends_with(&g.suffix)) {
            let inline = ch.svg.find("<svg").map_or(ch.svg.as_str(), |i| &ch.svg[i..]);
            let _ = writeln!(
                h,
                "<figure id=\"{name}\">\n{inline}\n<figcaption>{title} (<a href=\"{name}.png\">PNG</a>, \
                 <a href=\"{name}.svg\">SVG</a>)</figcaption></figure>",
                name = esc(&ch.name),
                title = esc(&ch.title)
            );
        }
        convergence_table(&mut h, g);
        efficiency_table(&mut h, g);
        extrapolation_table(&mut h, g, link);
    }
    cluster_section(&mut h, cluster, &c.summaries);
    summary_table(&mut h, &c.summaries);
    if !c.warnings.is_empty() {
        h.push_str("<h2>Problems in the input</h2>\n<ul>\n");
        for w in &c.warnings {
            let _ = writeln!(h, "<li><code>{}</code></li>", esc(w));
        }
        h.push_str("</ul>\n");
    }
    if let Some(s) = scenario {
        let _ = writeln!(h, "<h2>Scenario</h2>\n<pre>{}</pre>", esc(s));
    }
    h.push_str(
        "<p>Files: <code>summary.csv</code> (one row per run), <code>runs.jsonl</code> (every step and \
         server update with its run's columns), <code>runs/&lt;id&gt;/</code> (each process's metrics, logs \
         and traces).</p>\n</body></html>\n",
    );
    let path = out.join("report.html");
    std::fs::write(&path, h).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// A cluster run's link for the cost model: the one-way latency is the two shaped hops' delay,
/// the bandwidth what a plain TCP stream measured over them (the shaped rate for runs that did
/// not measure it).
fn cluster_link(r: &ClusterRun) -> Link {
    Link { a: 2.0 * r.delay_us as f64 * 1e-6, b: cost::gbit(r.measured_gbit.unwrap_or(r.rate_gbit)) }
}

/// The gradient exchange the cost model predicts for a cluster run's link, seconds.
pub fn cluster_prediction(r: &ClusterRun, params: usize) -> Option<f64> {
    let s = 4.0 * params as f64;
    let l = cluster_link(r);
    if r.mode.is_ps() {
        Some(cost::ps(r.workers, r.shards.max(1), s, l))
    } else if r.mode.is_ring() {
        Some(cost::ring(r.workers, s, l))
    } else {
        None
    }
}

/// A cluster run, its measured step, its predicted exchange and its measured communication, ms.
type MeasuredRun = (ClusterRun, Option<f64>, Option<f64>, Option<f64>);

/// How far a measured PS-to-ring communication ratio may sit from BytePS's prediction for the
/// claim to count as reproduced.
const BYTEPS_TOLERANCE: f64 = 0.15;

/// BytePS's claim (OSDI'20) checked against a measurement: with one server shard per worker a
/// parameter server communicates in n / (2(n-1)) of the ring's time, since each worker's link
/// carries S each way instead of the ring's 2(n-1)/n S.
pub fn byteps_claim(n: usize, rate_gbit: f64, measured: f64) -> String {
    let predicted = n as f64 / (2.0 * (n as f64 - 1.0));
    let off = measured / predicted - 1.0;
    format!(
        "BytePS's claim at {rate_gbit} Gbit/s, {n} workers, {n} shards each on its own host: a parameter server \
         communicates in n/(2(n-1)) = {predicted:.2} x the ring's time; measured {measured:.2} x ({:+.0}% off). \
         The claim {} here (tolerance {:.0}%).",
        100.0 * off,
        if off.abs() <= BYTEPS_TOLERANCE { "holds" } else { "does not hold" },
        100.0 * BYTEPS_TOLERANCE
    )
}

/// Runs on emulated links: measured step and communication beside the model's prediction, per
/// link rate, and the PS-to-ring ratio measured and predicted.
fn cluster_section(h: &mut String, runs: &[ClusterRun], all: &[Summary]) {
    if runs.is_empty() {
        return;
    }
    h.push_str(
        "<h2>Emulated cluster</h2>\n<p>Each process on its own host (a network namespace), every host's \
         link shaped with tc in both directions; the model's latency is the two hops' added delay, its \
         bandwidth what one plain TCP stream carried between two hosts of the run's cluster, measured just \
         before the run (the shaped rate where it was not measured).</p>\n<table><tr><th>link</th><th class=l>mode</th><th>workers</th>\
         <th>shards</th><th class=l>status</th><th>step ms</th><th>communication ms</th><th>model ms</th>\
         <th>model ms, push then pull</th><th>communication / model</th></tr>\n",
    );
    // Per link rate: each run with its measured step and predicted exchange, ms, for the reading.
    let mut by_rate: BTreeMap<String, Vec<MeasuredRun>> = BTreeMap::new();
    for r in runs {
        let Some(s) = all.iter().find(|s| s.id == r.id) else { continue };
        let pred = cluster_prediction(r, s.params).map(|t| t * 1e3);
        // A PS that pulls only after its whole push pays the busiest link twice.
        let seq = r.mode.is_ps().then(|| {
            cost::ps_sequential(r.workers, r.shards.max(1), 4.0 * s.params as f64, cluster_link(r)) * 1e3
        });
        // The worker's BSP step pulls the next version block by block while it pushes, so a
        // PS run is held to the pipelined model; push-then-pull stays beside it for reference.
        let ratio = s.comm_ms.zip(pred).map(|(m, p)| m / p);
        let _ = writeln!(
            h,
            "<tr><td>{} Gbit/s{}, {} us, {}% loss</td><td class=l>{}</td><td>{}</td><td>{}</td>\
             <td class=\"l {st}\">{st}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            r.rate_gbit,
            r.measured_gbit.map(|g| format!(" ({g:.3} measured)")).unwrap_or_default(),
            r.delay_us,
            r.loss_pct,
            r.mode.label(),
            r.workers,
            r.shards,
            opt(s.step_ms, 1),
            opt(s.comm_ms, 1),
            opt(pred, 1),
            opt(seq, 1),
            opt(ratio, 2),
            st = esc(&s.status)
        );
        by_rate.entry(format!("{:08.2}", r.rate_gbit)).or_default().push((
            r.clone(),
            s.step_ms,
            pred,
            s.comm_ms,
        ));
    }
    h.push_str("</table>\n<ul>\n");
    for rows in by_rate.values() {
        let ps = rows.iter().find(|(r, ..)| r.mode == ModeKind::PsBsp);
        let ring = rows.iter().find(|(r, ..)| r.mode == ModeKind::DdpTcp);
        if let (Some((r, Some(ps_t), Some(ps_p), ps_c)), Some((_, Some(ring_t), Some(ring_p), ring_c))) =
            (ps, ring)
        {
            let _ = writeln!(
                h,
                "<li>At {} Gbit/s with {} workers, a PS-BSP step ({} shard(s)) takes {:.2} x a ring step \
                 (measured); the model (push and pull pipelined) predicts {:.2} x for the gradient exchange alone.</li>",
                r.rate_gbit,
                r.workers,
                r.shards,
                ps_t / ring_t,
                ps_p / ring_p
            );
            if let (Some(pc), Some(rc)) = (ps_c, ring_c)
                && r.shards == r.workers
                && r.workers > 1
            {
                let _ = writeln!(h, "<li>{}</li>", esc(&byteps_claim(r.workers, r.rate_gbit, *pc / *rc)));
            }
        }
    }
    h.push_str("</ul>\n");
}

fn machine_section(h: &mut String, m: Option<&Machine>) {
    let Some(m) = m else {
        h.push_str(
            "<p>No <code>machine.json</code> in these directories: the machine is not described and \
                    the cost model has no link figures.</p>\n",
        );
        return;
    };
    let _ = writeln!(
        h,
        "<table><tr><th class=l>host</th><td class=l>{}</td></tr><tr><th class=l>CPU</th><td class=l>{} ({} logical cores)</td></tr>\
         <tr><th class=l>memory</th><td class=l>{:.1} GiB</td></tr><tr><th class=l>GPU</th><td class=l>{}</td></tr>\
         <tr><th class=l>kernel</th><td class=l>{}</td></tr><tr><th class=l>gradsync</th><td class=l>{} (commit {})</td></tr>\
         <tr><th class=l>raw loopback TCP</th><td class=l>{} one stream; {:.1} us one-way small-message latency</td></tr></table>\n\
         <p>Wires: the parameter server speaks gRPC over TCP and <code>ddp-tcp</code> rings over TCP sockets, \
         the same loopback wire, so those two compare directly; <code>ddp-shm</code> rings over shared memory \
         and <code>dp</code> inside one process, neither a network.</p>",
        esc(&m.host),
        esc(&m.cpu),
        m.cores,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        if m.gpus.is_empty() { "none".into() } else { esc(&m.gpus.join(", ")) },
        esc(&m.kernel),
        esc(&m.gradsync_version),
        esc(&m.gradsync_commit),
        match &m.tcp_yardstick {
            Some(y) => esc(&y.describe()),
            None => format!("{:.2} GB/s (one measurement)", m.tcp_bandwidth / 1e9),
        },
        m.tcp_latency_s * 1e6
    );
}

/// Time-to-accuracy per series and worker count: the median over the complete repeats that
/// reached the target, their range, and the epochs it took; statistical efficiency beside
/// throughput.
fn convergence_table(h: &mut String, g: &Group) {
    let Some(t) = g.target else { return };
    let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
    ws.sort();
    ws.dedup();
    let _ = writeln!(
        h,
        "<h2>Time to {:.1}% held-out accuracy</h2>\n<p>Training-clock seconds (evaluation left out) until rank 0 \
         first measured the target: median over the complete repeats (range in brackets), then epochs and \
         samples/s. \"not reached\" when fewer than half the repeats got there. Time = samples to target / \
         throughput: the first factor is statistical efficiency, the second system throughput.</p>\n\
         <table><tr><th class=l>mode</th>{}</tr>",
        100.0 * t,
        ws.iter()
            .map(|w| format!("<th>{w} worker{}</th>", if *w == 1 { "" } else { "s" }))
            .collect::<String>()
    );
    for (name, rows) in g.by_series() {
        let cells: String = ws
            .iter()
            .map(|&w| {
                let Some(r) = rows.iter().find(|r| r.workers == w) else { return "<td>-</td>".into() };
                let c = g.cell_of(r);
                let reps = c.map_or(0, |c| c.runs.len());
                match (r.time_to_target_s, c.and_then(|c| c.time_to_target)) {
                    (Some(tt), Some((lo, hi))) => format!(
                        "<td>{tt:.2} s ({lo:.2}-{hi:.2}); {} ep; {} /s</td>",
                        opt(r.epochs_to_target, 1),
                        opt(r.samples_per_s, 0)
                    ),
                    _ => format!(
                        "<td>not reached ({}/{reps}); best {}%</td>",
                        c.map_or(0, |c| c.reached),
                        opt(r.best_accuracy.map(|a| 100.0 * a), 1)
                    ),
                }
            })
            .collect();
        let _ = writeln!(h, "<tr><td class=l>{}</td>{cells}</tr>", esc(&name));
    }
    h.push_str("</table>\n");
}

fn efficiency_table(h: &mut String, g: &Group) {
    let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
    ws.sort();
    ws.dedup();
    let base = g.baseline();
    let _ = writeln!(
        h,
        "<h2>Scaling efficiency</h2>\n<p>Samples/s, and in brackets throughput<sub>n</sub> / (n x {}) with \
         the one-worker baseline at {} samples/s.</p>\n<table><tr><th class=l>mode</th>{}</tr>",
        if g.rows.iter().any(|r| r.mode == "local") { "local" } else { "the fastest one-worker run" },
        opt(base, 0),
        ws.iter().map(|w| format!("<th>{w} workers</th>")).collect::<String>()
    );
    for (name, rows) in g.by_series() {
        let cells: String = ws
            .iter()
            .map(|&w| match rows.iter().find(|r| r.workers == w).and_then(|r| r.samples_per_s) {
                Some(t) => match base {
                    Some(b) if b > 0.0 => format!("<td>{t:.0} ({:.0}%)</td>", 100.0 * t / (w as f64 * b)),
                    _ => format!("<td>{t:.0}</td>"),
                },
                None => "<td>-</td>".into(),
            })
            .collect();
        let _ = writeln!(h, "<tr><td class=l>{}</td>{cells}</tr>", esc(&name));
    }
    h.push_str("</table>\n");
}

fn extrapolation_table(h: &mut String, g: &Group, link: Option<Link>) {
    let Some(l) = link else { return };
    let s = g.grad_bytes();
    let _ = writeln!(
        h,
        "<h2>Cost model, extrapolated</h2>\n<p>Milliseconds of gradient exchange per step for {:.1} MB of \
         gradients, a = {:.1} us (measured). Ring: 2(n-1)a + 2(n-1)/n S/B. PS: 2a + max(S/B, nS/(kB)).</p>\n\
         <table><tr><th>workers</th>{}</tr>",
        s / 1e6,
        l.a * 1e6,
        LINKS_GBIT
            .iter()
            .map(|gb| format!("<th>ring {gb:.0} Gbit/s</th><th>PS k=1</th><th>PS k=n</th>"))
            .collect::<String>()
    );
    for n in EXTRAPOLATE_N {
        let cells: String = LINKS_GBIT
            .iter()
            .map(|&gb| {
                let l = Link { a: l.a, b: cost::gbit(gb) };
                format!(
                    "<td>{:.2}</td><td>{:.2}</td><td>{:.2}</td>",
                    cost::ring(n, s, l) * 1e3,
                    cost::ps(n, 1, s, l) * 1e3,
                    cost::ps(n, n, s, l) * 1e3
                )
            })
            .collect();
        let _ = writeln!(h, "<tr><td>{n}</td>{cells}</tr>");
    }
    h.push_str("</table>\n");
}

fn summary_table(h: &mut String, rows: &[Summary]) {
    h.push_str(
        "<h2>Every run</h2>\n<table><tr><th class=l>run</th><th class=l>status</th><th>workers</th><th>shards</th>\
         <th>samples/s</th><th>ms/step</th><th>fwd</th><th>bwd</th><th>comm</th><th>exposed</th><th>wait</th>\
         <th>update</th><th>MB/step/worker</th><th>final loss</th><th>accuracy</th><th>to target s</th><th class=l>error</th></tr>\n",
    );
    for r in rows {
        let _ = writeln!(
            h,
            "<tr class=\"{st}\"><td class=l>{id}</td><td class=l>{st}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td class=l>{}</td></tr>",
            r.workers,
            r.shards,
            opt(r.samples_per_s, 0),
            opt(r.step_ms, 2),
            opt(r.forward_ms, 2),
            opt(r.backward_ms, 2),
            opt(r.comm_ms, 2),
            opt(r.comm_exposed_ms, 2),
            opt(r.wait_ms, 2),
            opt(r.update_ms, 2),
            opt(r.bytes_per_step_worker.map(|b| b / 1e6), 2),
            opt(r.final_loss, 4),
            opt(r.final_accuracy.map(|a| 100.0 * a), 1),
            opt(r.time_to_target_s, 2),
            esc(&r.error),
            st = esc(&r.status),
            id = esc(&r.id),
        );
    }
    h.push_str("</table>\n");
}

/// What the figures say, sentence by sentence, computed from them.
pub fn reading(g: &Group, link: Option<Link>, m: Option<&Machine>, all: &[Summary]) -> Vec<String> {
    let mut out = Vec::new();
    let thr = |r: &&Summary| r.samples_per_s.unwrap_or(0.0);
    let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
    ws.sort();
    ws.dedup();
    if g.rows.is_empty() {
        out.push("No run produced metrics, so there is nothing to compare; the table below says why each run failed.".into());
    }

    // Fastest mode at each worker count: medians compared, level when the repeats overlap.
    let spread = |r: &Summary| -> String {
        match g.cell_of(r) {
            Some(c) => match c.throughput {
                Some((lo, hi)) if c.runs.len() > 1 => format!("median of {}, {lo:.0}-{hi:.0}", c.runs.len()),
                _ => "one run".into(),
            },
            None => "one run".into(),
        }
    };
    let thr_range = |r: &Summary| g.cell_of(r).and_then(|c| c.throughput);
    for &n in &ws {
        let mut at: Vec<&Summary> = g.rows.iter().copied().filter(|r| r.workers == n).collect();
        at.sort_by(|a, b| thr(b).total_cmp(&thr(a)).then_with(|| a.id.cmp(&b.id)));
        let Some(best) = at.first() else { continue };
        let s = if n == 1 { "" } else { "s" };
        match at.get(1) {
            Some(next) if matches!((thr_range(best), thr_range(next)), (Some(a), Some(b)) if overlap(a, b)) =>
            {
                let level: Vec<String> = at
                    .iter()
                    .take_while(
                        |r| matches!((thr_range(best), thr_range(r)), (Some(a), Some(b)) if overlap(a, b)),
                    )
                    .map(|r| format!("{} {:.0} ({})", Group::series(r), thr(r), spread(r)))
                    .collect();
                out.push(format!(
                    "At {n} worker{s} the fastest are level, their repeats' ranges overlapping: {} samples/s.",
                    level.join("; ")
                ));
            }
            next => out.push(format!(
                "At {n} worker{s}: {} is fastest with {:.0} samples/s ({}){}.",
                Group::series(best),
                thr(best),
                spread(best),
                next.map(|x| format!(
                    ", {:.2}x the next ({}, {:.0} samples/s, {})",
                    thr(best) / thr(x).max(1e-9),
                    Group::series(x),
                    thr(x),
                    spread(x)
                ))
                .unwrap_or_default()
            )),
        }
    }

    // Time to accuracy: what the user gets, throughput times statistical efficiency.
    if let Some(target) = g.target {
        for &n in ws.iter().filter(|&&n| n > 1) {
            let mut at: Vec<&Summary> =
                g.rows.iter().copied().filter(|r| r.workers == n && r.time_to_target_s.is_some()).collect();
            at.sort_by(|a, b| {
                a.time_to_target_s.unwrap_or(f64::MAX).total_cmp(&b.time_to_target_s.unwrap_or(f64::MAX))
            });
            let missed: Vec<String> = g
                .rows
                .iter()
                .filter(|r| r.workers == n && r.time_to_target_s.is_none())
                .map(|r| Group::series(r))
                .collect();
            let Some(best) = at.first() else {
                out.push(format!(
                    "At {n} workers no mode reached {:.1}% held-out accuracy in most of its repeats.",
                    100.0 * target
                ));
                continue;
            };
            let tt = |r: &Summary| r.time_to_target_s.unwrap_or(f64::NAN);
            let tt_range = |r: &Summary| g.cell_of(r).and_then(|c| c.time_to_target);
            let mut line = format!(
                "At {n} workers {} reaches {:.1}% held-out accuracy first, in {:.2} s of training ({:.1} epochs",
                Group::series(best),
                100.0 * target,
                tt(best),
                best.epochs_to_target.unwrap_or(f64::NAN)
            );
            if let Some((lo, hi)) = tt_range(best) {
                let _ = write!(line, "; repeats {lo:.2}-{hi:.2} s");
            }
            line.push(')');
            if let Some(next) = at.get(1) {
                let level = matches!((tt_range(best), tt_range(next)), (Some(a), Some(b)) if overlap(a, b));
                // Within 2% a factor is a tie, not a reason.
                let tie = |x: f64| (x - 1.0).abs() < 0.02;
                let speed = thr(best) / thr(next).max(1e-9);
                let samples = next.samples_to_target.unwrap_or(0) as f64
                    / best.samples_to_target.unwrap_or(1).max(1) as f64;
                let _ = write!(
                    line,
                    "; {} follows in {:.2} s{}. Its throughput is {speed:.2}x and its statistical efficiency \
                     {samples:.2}x the runner-up's (samples needed: {} against {}): {}",
                    Group::series(next),
                    tt(next),
                    if level { ", level with it (their repeats' ranges overlap)" } else { "" },
                    best.samples_to_target.unwrap_or(0),
                    next.samples_to_target.unwrap_or(0),
                    match (speed >= 1.0, samples >= 1.0) {
                        _ if tie(samples) && !tie(speed) =>
                            "the same samples needed, so throughput alone decides",
                        _ if tie(speed) && !tie(samples) =>
                            "the same throughput, so convergence per sample alone decides",
                        _ if tie(speed) && tie(samples) => "neither factor separates them",
                        (true, true) if speed >= samples => "both favour it, throughput the more",
                        (true, true) => "both favour it, convergence per sample the more",
                        (true, false) =>
                            "its throughput outweighs the runner-up's better convergence per sample",
                        (false, true) =>
                            "its convergence per sample outweighs the runner-up's higher throughput",
                        (false, false) => "neither favours it alone; the two measurements disagree",
                    }
                );
            }
            line.push('.');
            if !missed.is_empty() {
                let _ = write!(line, " Not reached in most repeats: {}.", missed.join(", "));
            }
            out.push(line);
        }
    }

    // Scaling efficiency at the most workers.
    if let (Some(b), Some(&nmax)) = (g.baseline(), ws.last())
        && nmax > 1
    {
        let effs: Vec<(String, f64)> = g
            .rows
            .iter()
            .filter(|r| r.workers == nmax)
            .map(|r| (Group::series(r), thr(r) / (nmax as f64 * b)))
            .collect();
        if let (Some(hi), Some(lo)) =
            (effs.iter().max_by(|a, b| a.1.total_cmp(&b.1)), effs.iter().min_by(|a, b| a.1.total_cmp(&b.1)))
        {
            out.push(format!(
                "Scaling efficiency at {nmax} workers (throughput / ({nmax} x one worker's {b:.0} samples/s)) ranges \
                 from {:.0}% ({}) to {:.0}% ({}).",
                100.0 * lo.1,
                lo.0,
                100.0 * hi.1,
                hi.0
            ));
        }
    }

    // Ring against the best parameter server, worker count by worker count.
    let ring: BTreeMap<usize, f64> = g
        .rows
        .iter()
        .filter(|r| r.mode == "ddp-tcp")
        .filter_map(|r| Some((r.workers, r.samples_per_s?)))
        .collect();
    let mut ps_best: BTreeMap<usize, (f64, String)> = BTreeMap::new();
    for r in g.rows.iter().filter(|r| r.mode.starts_with("ps-bsp")) {
        let t = thr(r);
        let e = ps_best.entry(r.workers).or_insert((0.0, String::new()));
        if t > e.0 {
            *e = (t, Group::series(r));
        }
    }
    let both: Vec<(usize, f64, f64, String)> = ring
        .iter()
        .filter(|(n, _)| **n > 1)
        .filter_map(|(&n, &rt)| ps_best.get(&n).map(|(pt, name)| (n, rt, *pt, name.clone())))
        .collect();
    if !both.is_empty() {
        let parts: Vec<String> = both
            .iter()
            .map(|(n, rt, pt, name)| format!("{n} workers: ring/PS = {:.2} (vs {name})", rt / pt.max(1e-9)))
            .collect();
        let ahead = both.iter().position(|b| b.1 > b.2).filter(|&i| both[i..].iter().all(|b| b.1 > b.2));
        out.push(format!(
            "Ring all-reduce over TCP sockets (ddp-tcp) against the best synchronous parameter server (gRPC over \
             TCP, the same wire), by median throughput: {}. {}",
            parts.join("; "),
            match ahead {
                Some(0) =>
                    format!("The ring is ahead at every worker count measured, from {} on.", both[0].0),
                Some(i) => format!("The ring pulls ahead at {} workers and stays ahead.", both[i].0),
                None if both.iter().all(|b| b.2 >= b.1) =>
                    "The parameter server is ahead at every worker count measured.".into(),
                None => "Neither stays ahead over the whole range.".into(),
            }
        ));
    }

    // The servers' link: bytes per second through all servers against the raw link.
    if let Some(l) = link {
        let loads: Vec<(f64, &Summary)> = g
            .rows
            .iter()
            .filter_map(|r| {
                let steps_per_s = r.samples_per_s? / r.global_batch.max(1) as f64;
                Some((r.bytes_per_step_server? * steps_per_s / r.shards.max(1) as f64, *r))
            })
            .collect();
        if let Some((bps, r)) = loads.iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
            let series: Vec<&Summary> =
                g.rows.iter().copied().filter(|x| Group::series(x) == Group::series(r)).collect();
            let flat = series.windows(2).find(|w| thr(&w[1]) < 1.1 * thr(&w[0]));
            out.push(format!(
                "The busiest parameter-server shard ({} at {} workers) moves {:.2} GB/s, {:.0}% of the raw TCP link \
                 ({:.2} GB/s){}.",
                Group::series(r),
                r.workers,
                bps / 1e9,
                100.0 * bps / l.b,
                l.b / 1e9,
                match flat {
                    Some(w) => format!(
                        "; its throughput stops growing between {} and {} workers ({:.0} -> {:.0} samples/s)",
                        w[0].workers,
                        w[1].workers,
                        thr(&w[0]),
                        thr(&w[1])
                    ),
                    None => "; its throughput still grows with every worker added".into(),
                }
            ));
        }
    }

    // Where the step time goes at the most workers.
    if let Some(&nmax) = ws.last() {
        let shares: Vec<(String, f64, f64)> = g
            .rows
            .iter()
            .filter(|r| r.workers == nmax)
            .filter_map(|r| {
                let t = r.step_ms?;
                let c = r.comm_exposed_ms.unwrap_or(0.0) + r.wait_ms.unwrap_or(0.0);
                (t > 0.0).then(|| (Group::series(r), c / t, t))
            })
            .collect();
        if let Some(w) = shares.iter().max_by(|a, b| a.1.total_cmp(&b.1))
            && w.1 > 0.0
        {
            out.push(format!(
                "At {nmax} workers, {} spends the largest share of its step ({:.0}% of {:.1} ms) on exposed \
                 communication and waiting.",
                w.0,
                100.0 * w.1,
                w.2
            ));
        }
    }

    // Measured communication against the model.
    if let Some(l) = link {
        let s = g.grad_bytes();
        for r in g.rows.iter().filter(|r| r.workers > 1 && (r.mode == "ddp-tcp" || r.mode == "ps-bsp")) {
            let Some(c) = r.comm_ms.filter(|&c| c > 0.0) else { continue };
            let model = if r.mode == "ddp-tcp" {
                cost::ring(r.workers, s, l)
            } else {
                cost::ps(r.workers, r.shards, s, l)
            };
            if r.workers == ws.last().copied().unwrap_or(0) {
                out.push(format!(
                    "{} at {} workers: {:.2} ms of communication per step measured, {:.2} ms predicted by the \
                     alpha-beta model: the implementation reaches {:.0}% of what the raw link allows.",
                    Group::series(r),
                    r.workers,
                    c,
                    model * 1e3,
                    100.0 * model * 1e3 / c
                ));
            }
        }
        let ring_pts = g.ring_points();
        if ring_pts.len() >= 2
            && let Some(fit) = cost::fit_ring(&ring_pts)
        {
            if fit.a > 0.0 {
                out.push(format!(
                    "Fitting the ring model to the ring's own {} measurements gives a = {:.1} us per message and an \
                     effective B = {:.2} GB/s, {:.0}% of the raw link.",
                    ring_pts.len(),
                    fit.a * 1e6,
                    fit.b / 1e9,
                    100.0 * fit.b / l.b
                ));
            } else {
                // A least-squares latency below zero says the points cannot tell the per-message
                // cost from the bandwidth term: report the bandwidth alone, and say so.
                out.push(format!(
                    "The ring's own {} measurements do not separate a per-message latency from the bandwidth \
                     term (the best fit puts it below zero), so only an effective B = {:.2} GB/s ({:.0}% of the raw \
                     link) is fitted; more worker counts would separate them.",
                    ring_pts.len(),
                    fit.b / 1e9,
                    100.0 * fit.b / l.b
                ));
            }
        }
        let ten = Link { a: l.a, b: cost::gbit(10.0) };
        let ps_half = cost::ps_wins(1024, s, ten, |n| (n / 2).max(1));
        out.push(format!(
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
                Some((a, _)) => format!("wins from {a} workers on, once the ring's latency term outgrows the server's extra bandwidth"),
                None => "never wins up to 1024 workers".into(),
            },
            match cost::ps_wins(1024, s, ten, |_| 1) {
                Some((_, b)) => format!("it is faster only up to {b} workers"),
                None => "it is slower than the ring at every worker count from 2 to 1024".into(),
            }
        ));
    }

    // Staleness.
    let stale: Vec<String> = g
        .rows
        .iter()
        .filter(|r| r.staleness_mean.is_some() && (r.mode == "ps-asp" || r.mode == "ps-ssp"))
        .filter(|r| Some(&r.workers) == ws.last())
        .map(|r| {
            format!(
                "{} at {} workers: mean {:.2}, max {}",
                Group::series(r),
                r.workers,
                r.staleness_mean.unwrap_or(0.0),
                r.staleness_max.unwrap_or(0)
            )
        })
        .collect();
    if !stale.is_empty() {
        out.push(format!(
            "Staleness of applied gradients: {}. Staleness counts the server's versions between a worker's pull \
             and the update with its gradient, and every worker's gradient makes a version under ASP and SSP: \
             with n workers it can pass the SSP bound, which limits how many of its own steps a worker runs \
             ahead of the slowest, not how many updates others make meanwhile.",
            stale.join("; ")
        ));
    }

    // Final held-out accuracy against local training: same initial parameters, data and
    // global batch, so a difference comes from the mode (asynchrony, reduction order).
    let local_acc = g.rows.iter().find(|r| r.mode == "local").and_then(|r| r.final_accuracy);
    if let Some(la) = local_acc {
        let dev = |sync: bool| -> Option<(f64, String)> {
            g.rows
                .iter()
                .filter(|r| r.mode != "local" && (r.mode == "ps-asp" || r.mode == "ps-ssp") != sync)
                .filter_map(|r| {
                    Some(((r.final_accuracy? - la).abs(), format!("{} w{}", Group::series(r), r.workers)))
                })
                .max_by(|a, b| a.0.total_cmp(&b.0))
        };
        let mut parts = vec![format!(
            "Final held-out accuracy of local training (median of repeats): {:.2}%",
            100.0 * la
        )];
        if let Some((d, who)) = dev(true) {
            parts
                .push(format!("synchronous modes end within {:.2} points of it (largest: {who})", 100.0 * d));
        }
        if let Some((d, who)) = dev(false) {
            parts.push(format!("asynchronous ones within {:.2} points (largest: {who})", 100.0 * d));
        }
        out.push(parts.join("; ") + ".");
    }

    // Contention: every process shares this machine's cores.
    if let (Some(m), Some(&nmax)) = (m, ws.last())
        && nmax > m.cores
    {
        out.push(format!(
            "All processes share one machine with {} logical cores, and up to {nmax} workers ran at once (plus \
             servers): beyond {} workers compute time grows with contention, so throughput there measures the CPU \
             as much as the network.",
            m.cores, m.cores
        ));
    }

    out.extend(straggler_reading(g));

    // Failures.
    let failed: Vec<&Summary> = all.iter().filter(|r| r.status == "failed").collect();
    if !failed.is_empty() {
        let mut by_mode: BTreeMap<&str, usize> = BTreeMap::new();
        for f in &failed {
            *by_mode.entry(f.mode.as_str()).or_insert(0) += 1;
        }
        out.push(format!(
            "{} run{} failed ({}); first error: {}",
            failed.len(),
            if failed.len() == 1 { "" } else { "s" },
            by_mode.iter().map(|(m, n)| format!("{m}: {n}")).collect::<Vec<_>>().join(", "),
            failed[0].error.chars().take(200).collect::<String>()
        ));
    }
    let diverged: Vec<&Summary> = all.iter().filter(|r| r.status == "diverged").collect();
    if !diverged.is_empty() {
        let which: Vec<String> = diverged
            .iter()
            .map(|r| {
                let at = r.error.split("diverged at step ").nth(1).and_then(|t| t.split(':').next());
                format!(
                    "{} w{}{}",
                    r.mode,
                    r.workers,
                    at.map(|s| format!(" at step {s}")).unwrap_or_default()
                )
            })
            .collect();
        out.push(format!(
            "{} run{} diverged ({}): listed apart in the table below, never read as a speed. {}",
            diverged.len(),
            if diverged.len() == 1 { "" } else { "s" },
            which.join(", "),
            diverged.iter().find_map(|r| r.error.split_once("; ").map(|(_, fix)| fix)).unwrap_or_default()
        ));
    }
    let partial =
        all.iter().filter(|r| matches!(r.status.as_str(), "interrupted" | "stopped" | "partial")).count();
    if partial > 0 {
        out.push(format!(
            "{partial} run(s) did not run to their end (interrupted, stopped by the time budget, or without a \
             record): listed apart, they feed no figure and no reading."
        ));
    }
    let skipped = all.iter().filter(|r| r.status == "skipped").count();
    if skipped > 0 {
        out.push(format!("{skipped} run(s) were skipped; the table below gives each reason."));
    }
    out
}

/// What the straggler sweep says: per series, at its largest delay, the slowdown and the share
/// of the injected delay the whole job pays per global step, against what the mode's
/// synchronisation predicts (synchronous modes pay all of it; ASP at most W/(W-1) of the
/// undelayed step; SSP all of it once the fast ranks reach the staleness bound).
pub fn straggler_reading(g: &Group) -> Vec<String> {
    let mut out = Vec::new();
    let mut paid: Vec<(String, f64)> = Vec::new();
    for s in g.slowdowns() {
        let (name, mode, w) = (s.name, s.mode, s.workers);
        let (Some(&(d, slow)), Some(t0)) = (s.points.last(), g.undelayed_step_s(mode, w, s.shards)) else {
            continue;
        };
        if d <= 0.0 {
            continue;
        }
        let extra_ms = (slow - 1.0) * t0 * 1e3;
        let share = extra_ms / d;
        let expect = match mode {
            "ps-asp" => format!(
                "asynchronous: the other ranks go on, so the slowdown is bounded by W/(W-1) = {:.2}x",
                w as f64 / (w as f64 - 1.0).max(1.0)
            ),
            "ps-ssp" => "stale-synchronous: the fast ranks run ahead up to the bound, then wait".into(),
            _ => "synchronous: every step waits for the slowest rank".into(),
        };
        out.push(format!(
            "Straggler, {name}: with one rank {d:.0} ms slower per step, a global step takes {slow:.2}x as \
             long ({:.1} -> {:.1} ms); the job pays {:.0}% of the injected delay ({expect}).",
            t0 * 1e3,
            t0 * 1e3 * slow,
            100.0 * share
        ));
        paid.push((name, share));
    }
    if paid.len() > 1 {
        paid.sort_by(|a, b| a.1.total_cmp(&b.1));
        let waits: Vec<&str> = paid.iter().filter(|p| p.1 >= 0.8).map(|p| p.0.as_str()).collect();
        let spared: Vec<&str> = paid.iter().filter(|p| p.1 < 0.5).map(|p| p.0.as_str()).collect();
        out.push(format!(
            "At the largest delay, {} absorbs the straggler best ({:.0}% of the delay paid). Waiting for it \
             every step (80% or more paid): {}. Less than half paid: {}. Where processes outnumber cores, a \
             sleeping straggler also frees a core for the others, so synchronous modes pay less than the \
             whole delay.",
            paid[0].0,
            100.0 * paid[0].1,
            if waits.is_empty() { "none".to_string() } else { waits.join(", ") },
            if spared.is_empty() { "none".to_string() } else { spared.join(", ") },
        ));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn row(mode: &str, slow_ms: u64, samples_per_s: f64) -> Summary {
        Summary {
            id: format!("{mode}-{slow_ms}"),
            mode: mode.into(),
            workers: 4,
            shards: usize::from(mode.starts_with("ps")),
            model: "mnist".into(),
            global_batch: 128,
            samples_per_s: Some(samples_per_s),
            slow_ms,
            status: "ok".into(),
            ..Summary::default()
        }
    }

    fn collected(rows: Vec<Summary>) -> Collected {
        Collected { cells: Cell::all(&rows), summaries: rows, ..Collected::default() }
    }

    #[test]
    fn straggler_reading_measures_the_share_of_the_delay_paid() {
        // Undelayed: 1000 samples/s, 128 ms per global step. BSP pays the whole 100 ms
        // (228 ms per step); ASP pays 10 ms of it.
        let rows = [
            row("ps-bsp", 0, 1000.0),
            row("ps-bsp", 100, 128.0 / 0.228),
            row("ps-asp", 0, 1000.0),
            row("ps-asp", 100, 128.0 / 0.138),
            row("ddp-tcp", 0, 1000.0),
        ];
        let c = collected(rows.to_vec());
        let g = &crate::compare::charts::groups(&c)[0];
        assert_eq!(g.rows.len(), 3, "the other charts see only the undelayed runs");
        let s = g.slowdowns();
        assert_eq!(s.len(), 2, "ddp-tcp has no delayed run: {s:?}");
        let text = straggler_reading(g).join("\n");
        assert!(
            text.contains(
                "ps-bsp k=1 (gRPC over TCP) (4 workers): with one rank 100 ms slower per step, a global step takes 1.78x"
            ),
            "{text}"
        );
        assert!(text.contains("pays 100% of the injected delay"), "{text}");
        assert!(text.contains("pays 10% of the injected delay"), "{text}");
        assert!(text.contains("ps-asp k=1 (gRPC over TCP) (4 workers) absorbs the straggler best"), "{text}");
        assert!(text.contains("80% or more paid): ps-bsp k=1 (gRPC over TCP) (4 workers)."), "{text}");
    }

    fn rep_row(mode: &str, repeat: usize, status: &str, thr: f64, tt: Option<f64>) -> Summary {
        Summary {
            id: format!("runs/{mode}-r{repeat}"),
            repeat,
            status: status.into(),
            time_to_target_s: tt,
            samples_to_target: tt.map(|t| (t * thr) as u64),
            epochs_to_target: tt.map(|_| 3.0),
            ..row(mode, 0, thr)
        }
    }

    #[test]
    fn a_ring_fit_that_cannot_separate_latency_says_so_instead_of_a_zero() {
        let ring = |workers: usize, comm_ms: f64| Summary {
            workers,
            params: 1_000_000,
            comm_ms: Some(comm_ms),
            ..row("ddp-tcp", 0, 1000.0)
        };
        let link = Some(Link { a: 5e-6, b: 2e9 });
        // Exactly a = -100 us, B = 1 GB/s: no latency the data can support.
        let c = collected(vec![ring(2, 3.8), ring(4, 5.4)]);
        let text = reading(&crate::compare::charts::groups(&c)[0], link, None, &c.summaries).join("\n");
        assert!(
            text.contains("do not separate a per-message latency") && !text.contains("a = 0.0 us"),
            "{text}"
        );
        // a = 20 us, B = 1 GB/s: both fitted.
        let c = collected(vec![ring(2, 4.04), ring(4, 6.12)]);
        let text = reading(&crate::compare::charts::groups(&c)[0], link, None, &c.summaries).join("\n");
        assert!(text.contains("a = 20.0 us per message"), "{text}");
    }

    #[test]
    fn the_byteps_claim_is_judged_within_its_tolerance() {
        assert!(
            byteps_claim(4, 1.0, 0.70)
                .contains("0.67 x the ring's time; measured 0.70 x (+5% off). The claim holds")
        );
        assert!(byteps_claim(4, 1.0, 0.90).contains("does not hold"));
        assert!(byteps_claim(4, 1.0, 0.50).contains("does not hold"));
    }

    #[test]
    fn readings_rank_medians_call_overlaps_level_and_ignore_runs_that_did_not_complete() {
        let rows = vec![
            // ddp-tcp: 1000-1100; ps-bsp 1050-1300 (overlapping: level); dp clearly slower.
            rep_row("ddp-tcp", 0, "ok", 1000.0, Some(4.0)),
            rep_row("ddp-tcp", 1, "ok", 1100.0, Some(4.2)),
            rep_row("ddp-tcp", 2, "ok", 1050.0, Some(4.1)),
            rep_row("ps-bsp", 0, "ok", 1300.0, Some(3.0)),
            rep_row("ps-bsp", 1, "ok", 1050.0, Some(3.1)),
            rep_row("ps-bsp", 2, "ok", 1200.0, Some(3.2)),
            rep_row("dp", 0, "ok", 500.0, None),
            // Far faster, but interrupted, diverged or failed: never a reading.
            rep_row("ps-asp", 0, "interrupted", 90000.0, Some(0.1)),
            rep_row("ps-ssp", 0, "diverged", 80000.0, None),
            Summary { error: "rank0: gradsync-worker: error: diverged at step 35: the loss is NaN; lower the learning rate (--lr 0.05)".into(), ..rep_row("ps-ssp", 1, "diverged", 1.0, None) },
            rep_row("ddp-shm", 0, "failed", 70000.0, Some(0.1)),
        ];
        let c = collected(rows);
        let mut gs = crate::compare::charts::groups(&c);
        let g = gs.remove(0);
        let g = Group { target: Some(0.97), ..g };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("the fastest are level"), "{text}");
        assert!(text.contains("ps-bsp k=1 (gRPC over TCP) 1200 (median of 3, 1050-1300)"), "{text}");
        for never in ["ps-asp", "90000", "80000", "70000"] {
            let readings: Vec<&str> =
                text.lines().filter(|l| !l.contains("diverged") && !l.contains("did not run")).collect();
            assert!(
                readings.iter().all(|l| !l.contains(never)),
                "{never} read from a run that did not complete:\n{text}"
            );
        }
        assert!(
            text.contains("ps-bsp k=1 (gRPC over TCP) reaches 97.0% held-out accuracy first, in 3.10 s"),
            "{text}"
        );
        assert!(text.contains("Not reached in most repeats: dp"), "{text}");
        assert!(text.contains("2 runs diverged (ps-ssp w4, ps-ssp w4 at step 35)"), "{text}");
        assert!(text.contains("lower the learning rate"), "{text}");
        assert!(text.contains("1 run(s) did not run to their end"), "{text}");
    }
}
