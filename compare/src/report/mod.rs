//! `report.html`: one self-contained page (SVGs inlined, no scripts, no external files) with
//! the machine, the scenario, a reading of the figures computed from them, every chart and
//! the tables. Nothing in it depends on when or where it was rendered.
//!
//! Here: the page, its sections and tables. Below it, one way: `verdict` (the three sentences
//! the page opens with) and `reading` (the list of readings: `ranking`, `links`, `runs`), all
//! over `context` (what every reading reads from), computed from the figures and refusing to
//! read failed, diverged or partial runs.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::charts::{Charts, Group, groups};
use super::cost::{self, Link};
use super::emulated::ClusterRun;
use super::machine::Machine;
use super::results::{Cell, Collected, Summary, overlap};
use super::scenario::ModeKind;

mod context;
mod links;
mod ranking;
mod reading;
mod regime;
mod runs;
mod sparse;
mod verdict;

pub use reading::reading;
pub use runs::straggler_reading;

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
            link: String::new(),
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
    // The cost model's link per group: the machine's loopback, or the group's emulated link.
    let links: Vec<Option<Link>> =
        gs.iter().map(|g| if g.link.is_empty() { link } else { group_link(g, cluster) }).collect();
    h.push_str("<h2>Verdict</h2>\n");
    for (g, &link) in gs.iter().zip(&links) {
        let v = verdict::verdict(&context::Context::new(g, link, machine, &c.summaries));
        let _ = writeln!(h, "<p>{}</p>", esc(&v.join(" ")));
    }
    machine_section(&mut h, machine, !cluster.is_empty());
    for (g, &link) in gs.iter().zip(&links) {
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
        designs_table(&mut h, g, link);
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

/// The emulated link of a group's runs for the cost model: the medians of the runs' measured
/// bandwidth and latency; `None` where some run measured no latency and no delay was added,
/// since nothing then gives the latency the model needs.
fn group_link(g: &Group, cluster: &[ClusterRun]) -> Option<Link> {
    let runs: Vec<&ClusterRun> =
        cluster.iter().filter(|r| g.cells.iter().any(|c| c.runs.contains(&r.id))).collect();
    let latency_known = runs.iter().all(|r| r.measured_latency_us.is_some() || r.delay_us > 0);
    if runs.is_empty() || !latency_known {
        return None;
    }
    let median = |f: fn(Link) -> f64| {
        crate::results::median(&runs.iter().map(|r| f(cluster_link(r))).collect::<Vec<_>>())
    };
    Some(Link { a: median(|l| l.a)?, b: median(|l| l.b)? })
}

/// A cluster run's link for the cost model: the latency and bandwidth measured between two of
/// its hosts (for runs that did not measure them, the two shaped hops' added delay and the
/// shaped rate).
fn cluster_link(r: &ClusterRun) -> Link {
    let a = r.measured_latency_us.map_or(2.0 * r.delay_us as f64, |us| us) * 1e-6;
    Link { a, b: cost::gbit(r.measured_gbit.unwrap_or(r.rate_gbit)) }
}

/// The gradient exchange the cost model predicts for a cluster run's link, seconds.
pub fn cluster_prediction(r: &ClusterRun, params: usize) -> Option<f64> {
    let s = 4.0 * params as f64;
    let l = cluster_link(r);
    if r.mode.is_compressed() {
        // The model prices f32 gradients only.
        None
    } else if r.mode.is_ps() {
        Some(cost::ps(r.workers, r.shards.max(1), s, l))
    } else if r.mode == ModeKind::Zero1Tcp {
        Some(cost::zero1(r.workers, s, l))
    } else if r.mode.is_ring() {
        Some(cost::ring(r.workers, s, l))
    } else {
        None
    }
}

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
         link shaped with tc in both directions; the model's latency is half the round trip of a small \
         message, its bandwidth what one plain TCP stream carried, both between two hosts of the run's \
         cluster, measured just before the run (where they were not measured, the two hops' added delay \
         and the shaped rate).</p>\n<table><tr><th>link</th><th class=l>mode</th><th>workers</th>\
         <th>shards</th><th class=l>status</th><th>step ms</th><th>communication ms</th><th>model ms</th>\
         <th>model ms, push then pull</th><th>communication / model</th></tr>\n",
    );
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
            "<tr><td>{} Gbit/s{}, {} us delay{}, {}% loss</td><td class=l>{}</td><td>{}</td><td>{}</td>\
             <td class=\"l {st}\">{st}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            r.rate_gbit,
            r.measured_gbit.map(|g| format!(" ({g:.3} measured)")).unwrap_or_default(),
            r.delay_us,
            r.measured_latency_us.map(|us| format!(" ({us:.0} us one way, measured)")).unwrap_or_default(),
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
    }
    h.push_str("</table>\n<ul>\n");
    for line in ps_against_ring(runs, all) {
        let _ = writeln!(h, "<li>{}</li>", esc(&line));
    }
    h.push_str("</ul>\n");
}

/// The cluster's readings: on each link and at each worker count, every PS-BSP cell against the
/// ring's (DDP-TCP), each the median over its complete repeats; the step ratio beside the
/// model's, and BytePS's claim where there is a shard per worker. A cell with fewer than two
/// complete repeats is listed with its figures, never compared.
fn ps_against_ring(runs: &[ClusterRun], all: &[Summary]) -> Vec<String> {
    let mine: Vec<Summary> = all.iter().filter(|s| runs.iter().any(|r| r.id == s.id)).cloned().collect();
    let cells = Cell::all(&mine);
    let run_of = |id: &str| runs.iter().find(|r| r.id == id);
    // `f` of each of a cell's complete repeats (with its cluster record).
    let over = |c: &Cell, f: &dyn Fn(&ClusterRun, &Summary) -> Option<f64>| -> Vec<f64> {
        c.runs
            .iter()
            .filter_map(|id| Some((run_of(id)?, mine.iter().find(|s| &s.id == id)?)))
            .filter_map(|(r, s)| f(r, s))
            .collect()
    };
    let mut out = Vec::new();
    for ps in cells.iter().filter(|c| c.median.mode == ModeKind::PsBsp.label()) {
        let m = &ps.median;
        let Some(ring) = cells.iter().find(|c| {
            let r = &c.median;
            r.mode == ModeKind::DdpTcp.label()
                && (r.link.as_str(), r.workers, &r.model, r.global_batch, r.slow_ms)
                    == (m.link.as_str(), m.workers, &m.model, m.global_batch, m.slow_ms)
        }) else {
            continue;
        };
        let (Some(ps_t), Some(ring_t)) = (m.step_ms, ring.median.step_ms) else { continue };
        let head = format!("At {} with {} workers", m.link, m.workers);
        let (p, q) = (ps.runs.len(), ring.runs.len());
        if p < 2 || q < 2 {
            out.push(format!(
                "{head}: a PS-BSP step ({} shard(s)) {ps_t:.1} ms ({p} of {} repeats complete), a ring step \
                 {ring_t:.1} ms ({q} of {}). Not compared: a cell with fewer than two complete repeats has \
                 no spread to set a difference against (run `gradsync-bench cluster --repeats 3`).",
                m.shards, ps.attempts, ring.attempts
            ));
            continue;
        }
        let step = |c: &Cell| crate::table::spread(&over(c, &|_, s| s.step_ms)).map(|(_, lo, hi)| (lo, hi));
        let (Some(a), Some(b)) = (step(ps), step(ring)) else { continue };
        let predicted = |c: &Cell| super::results::median(&over(c, &|r, s| cluster_prediction(r, s.params)));
        let model = match (predicted(ps), predicted(ring)) {
            (Some(x), Some(y)) => format!(
                "; the model (push and pull pipelined) predicts {:.2} x for the gradient exchange alone",
                x / y
            ),
            _ => String::new(),
        };
        let level = if overlap(a, b) {
            "; the repeats' ranges overlap, so the two are level within their spread"
        } else {
            ""
        };
        out.push(format!(
            "{head}, a PS-BSP step ({} shard(s)) takes {:.2} x a ring step (medians of {p} and {q} complete \
             repeats: {:.1}-{:.1} against {:.1}-{:.1} ms){level}{model}.",
            m.shards,
            ps_t / ring_t,
            a.0,
            a.1,
            b.0,
            b.1
        ));
        if let (Some(pc), Some(rc)) = (m.comm_ms, ring.median.comm_ms)
            && m.shards == m.workers
            && m.workers > 1
        {
            let rate = ps.runs.first().and_then(|id| run_of(id)).map_or(0.0, |r| r.rate_gbit);
            out.push(byteps_claim(m.workers, rate, pc / rc));
        }
    }
    out
}

/// The machine, and the wire its runs crossed: loopback, or (`emulated`) the cluster's links.
fn machine_section(h: &mut String, m: Option<&Machine>, emulated: bool) {
    let Some(m) = m else {
        h.push_str(
            "<p>No <code>machine.json</code> in these directories: the machine is not described and \
                    the cost model has no link figures.</p>\n",
        );
        return;
    };
    // On hosts or nodes, each kind of machine a row (with its count and names): the machine
    // the comparison was started from ran none of the processes, and the hosts' cores
    // together are no one machine's.
    let what = if m.hosts.is_empty() {
        format!(
            "<tr><th class=l>host</th><td class=l>{}</td></tr><tr><th class=l>CPU</th><td class=l>{} ({} logical \
             cores)</td></tr><tr><th class=l>memory</th><td class=l>{:.1} GiB</td></tr><tr><th class=l>GPU</th>\
             <td class=l>{}</td></tr><tr><th class=l>kernel</th><td class=l>{}</td></tr>",
            esc(&m.host),
            esc(&m.cpu),
            m.cores,
            m.memory_bytes as f64 / (1u64 << 30) as f64,
            if m.gpus.is_empty() { "none".into() } else { esc(&m.gpus.join(", ")) },
            esc(&m.kernel),
        )
    } else {
        let mut rows = format!("<tr><th class=l>started from</th><td class=l>{}</td></tr>", esc(&m.host));
        for (f, names) in m.host_kinds() {
            let _ = write!(
                rows,
                "<tr><th class=l>{} x</th><td class=l>{}, {} logical cores, {:.1} GiB, GPU: {} ({})</td></tr>",
                names.len(),
                esc(&f.cpu),
                f.cores,
                f.memory_bytes as f64 / (1u64 << 30) as f64,
                if f.gpus.is_empty() { "none".into() } else { esc(&f.gpus.join(", ")) },
                esc(&names.join(", "))
            );
        }
        rows
    };
    let _ = writeln!(
        h,
        "<table>{what}<tr><th class=l>gradsync</th><td class=l>{} (commit {})</td></tr>\
         <tr><th class=l>raw {} TCP</th><td class=l>{}</td></tr></table>\n\
         <p>Wires: the parameter server speaks gRPC over TCP and <code>ddp-tcp</code> rings over TCP sockets, \
         {}, so those two compare directly; <code>ddp-shm</code> rings over shared memory \
         and <code>dp</code> inside one process, neither a network.</p>",
        esc(&m.gradsync_version),
        esc(&m.gradsync_commit),
        match m.link.as_deref() {
            None => "loopback".to_string(),
            Some(l) if l.starts_with("loopback") => esc(l),
            Some(l) => format!("host-to-host ({})", esc(l)),
        },
        match (&m.tcp_yardstick, m.tcp_bandwidth > 0.0) {
            (Some(y), _) => format!(
                "{} one stream;{} {:.1} us one-way small-message latency",
                esc(&y.describe()),
                m.tcp_parallel
                    .iter()
                    .map(|p| format!(
                        " {} {} streams at once together;",
                        esc(&p.yardstick.describe()),
                        p.streams
                    ))
                    .collect::<String>(),
                m.tcp_latency_s * 1e6
            ),
            (None, true) => format!(
                "{:.2} GB/s (one measurement) one stream; {:.1} us one-way small-message latency",
                m.tcp_bandwidth / 1e9,
                m.tcp_latency_s * 1e6
            ),
            (None, false) => "not measured".into(),
        },
        if emulated {
            "each process on a host of its own, every link emulated (the cluster section below names each \
             run's link), the same links for both"
        } else if !m.hosts.is_empty() {
            "the same network between the hosts below"
        } else {
            "the same loopback wire"
        },
    );
    hosts_table(h, m);
}

/// The hosts of `compare --hosts` (the nodes of `--slurm`), each as its check found it; the
/// machine above is the one the comparison was started from.
fn hosts_table(h: &mut String, m: &Machine) {
    if m.hosts.is_empty() {
        return;
    }
    let started = match m.launcher.as_deref() {
        Some("Slurm") => "as job steps of a Slurm allocation",
        _ => "over ssh",
    };
    let between = if m.link.as_deref().is_some_and(|l| l.starts_with("loopback")) {
        "on the one host's loopback "
    } else {
        "between two of them "
    };
    let _ = writeln!(
        h,
        "<p>Every server and worker ran on these hosts, started {started}; the link above was measured \
         {between}with the raw-TCP yardstick, and the cost model is fitted to it.</p>\n\
         <table><tr><th class=l>host</th><th class=l>address</th><th>slots</th><th class=l>name</th>\
         <th class=l>CPU</th><th>cores</th><th>memory GiB</th><th class=l>GPU</th><th class=l>kernel</th></tr>",
    );
    for f in &m.hosts {
        let _ = writeln!(
            h,
            "<tr><td class=l>{}</td><td class=l>{}</td><td>{}</td><td class=l>{}</td><td class=l>{}</td><td>{}</td>\
             <td>{:.1}</td><td class=l>{}</td><td class=l>{}</td></tr>",
            esc(&f.name),
            esc(&f.addr),
            f.slots,
            esc(&f.hostname),
            esc(&f.cpu),
            f.cores,
            f.memory_bytes as f64 / (1u64 << 30) as f64,
            if f.gpus.is_empty() { "none".into() } else { esc(&f.gpus.join(", ")) },
            esc(&f.kernel)
        );
    }
    h.push_str("</table>\n");
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
    let base = g.baseline().filter(|b| *b > 0.0);
    let caption = match base {
        Some(b) => format!(
            "Samples/s, and in brackets throughput<sub>n</sub> / (n x {}) with the one-worker baseline at \
             {b:.0} samples/s.",
            if g.rows.iter().any(|r| r.mode == "local") { "local" } else { "the fastest one-worker run" }
        ),
        None => "Samples/s. No one-worker run completed, so there is no baseline to divide by: add 1 to \
                 the worker counts (or the local mode) for each mode's scaling efficiency."
            .into(),
    };
    let _ = writeln!(
        h,
        "<h2>Scaling efficiency</h2>\n<p>{caption}</p>\n<table><tr><th class=l>mode</th>{}</tr>",
        ws.iter().map(|w| format!("<th>{w} workers</th>")).collect::<String>()
    );
    for (name, rows) in g.by_series() {
        let cells: String = ws
            .iter()
            .map(|&w| match rows.iter().find(|r| r.workers == w).and_then(|r| r.samples_per_s) {
                Some(t) => match base {
                    Some(b) => format!("<td>{t:.0} ({:.0}%)</td>", 100.0 * t / (w as f64 * b)),
                    None => format!("<td>{t:.0}</td>"),
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

/// Ranks per host of the hierarchical column (a typical GPU server's count).
const RANKS_PER_HOST: usize = 8;
/// The top-k ratio of the compression columns.
const TOPK_RATIO: f64 = 0.01;

/// The designs side by side in the cost model, at 10 Gbit/s and the measured latency: which
/// exchange is cheapest at which worker count, and what compression and a hierarchy change.
fn designs_table(h: &mut String, g: &Group, link: Option<Link>) {
    use gradsync_core::compress::Compression;
    let Some(l) = link else { return };
    let s = g.grad_bytes();
    let l = Link { a: l.a, b: cost::gbit(10.0) };
    let topk = Compression::TopK(TOPK_RATIO);
    let sparse = topk.wire_bytes((s / 4.0) as usize) as f64;
    let _ = writeln!(
        h,
        "<h2>Where each design wins (cost model)</h2>\n<p>Milliseconds of gradient exchange per step for {:.1} MB of \
         gradients over 10 Gbit/s links, a = {:.1} us (measured). Top-k keeps {}% of the values as (index, value) \
         pairs: a PS server sums them as they come, and the workers still pull dense f32 parameters; a ring cannot \
         add sparse vectors hop by hop, so it all-gathers every rank's pairs. PS rows use one server shard per \
         worker. The hierarchical column is the leaders' ring across hosts of {RANKS_PER_HOST} ranks (the \
         shared-memory steps inside a host are left out), beside the flat ring over every rank. \
         \"Cheapest\" compares exchange time only: the PS columns need as many server shards as \
         workers, and compression changes what each step learns (top-k took more epochs to reach \
         the target in gradsync's measurements; a comparison that runs the compressed modes reads \
         their time to accuracy beside the uncompressed ones).</p>\n\
         <table><tr><th>workers</th><th>ring</th><th>ring fp16</th><th>ring top-k</th><th>PS</th><th>PS fp16</th>\
         <th>PS top-k push</th><th>ZeRO-1 exposed</th><th>hierarchical, across hosts</th><th class=l>cheapest</th></tr>",
        s / 1e6,
        l.a * 1e6,
        TOPK_RATIO * 100.0
    );
    for n in EXTRAPOLATE_N {
        let designs = [
            ("ring", cost::ring(n, s, l)),
            ("ring fp16", cost::ring_compressed(n, s, Compression::Fp16, l)),
            ("ring top-k", cost::ring_compressed(n, s, topk, l)),
            ("PS", cost::ps(n, n, s, l)),
            ("PS fp16", cost::ps_compressed(n, n, s / 2.0, s / 2.0, l)),
            ("PS top-k push", cost::ps_compressed(n, n, sparse, s, l)),
        ];
        let cheapest = designs.iter().min_by(|a, b| a.1.total_cmp(&b.1)).map_or("", |d| d.0);
        let hosts = n.div_ceil(RANKS_PER_HOST);
        let hier = if n > RANKS_PER_HOST {
            format!("{:.2}", cost::ring(hosts, s, l) * 1e3)
        } else {
            "one host".to_string()
        };
        let cells: String = designs.iter().map(|d| format!("<td>{:.2}</td>", d.1 * 1e3)).collect();
        let _ = writeln!(
            h,
            "<tr><td>{n}</td>{cells}<td>{:.2}</td><td>{hier}</td><td class=l>{cheapest}</td></tr>",
            cost::zero1_exposed(n, s, l) * 1e3
        );
    }
    h.push_str("</table>\n");
}

fn summary_table(h: &mut String, rows: &[Summary]) {
    h.push_str(
        "<h2>Every run</h2>\n<table><tr><th class=l>run</th><th class=l>status</th><th>workers</th><th>shards</th>\
         <th>samples/s</th><th>ms/step</th><th>fwd</th><th>bwd</th><th>comm</th><th>exposed</th><th>wait</th>\
         <th>update</th><th>MB/step/worker</th><th>final loss</th><th>accuracy</th><th>to target s</th><th class=l>restarts</th>\
         <th class=l>error</th></tr>\n",
    );
    for r in rows {
        let _ = writeln!(
            h,
            "<tr class=\"{st}\"><td class=l>{id}</td><td class=l>{st}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td class=l>{}</td><td class=l>{}</td></tr>",
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
            esc(&r.restarts.iter().map(runs::restart_text).collect::<Vec<_>>().join("; ")),
            esc(&r.error),
            st = esc(&r.status),
            id = esc(&r.id),
        );
    }
    h.push_str("</table>\n");
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// On hosts, the machine table has a row per kind of host with its count and names (not
    /// the machine the comparison started from, nor the hosts' cores summed into one), and a
    /// one-node allocation's link is named as loopback.
    #[test]
    fn the_machine_table_has_a_row_per_kind_of_host() {
        let host = |name: &str, cpu: &str, cores| crate::site::HostFacts {
            name: name.into(),
            cpu: cpu.into(),
            cores,
            memory_bytes: 16 << 30,
            ..Default::default()
        };
        let m = Machine {
            host: "login1".into(),
            cpu: "Login CPU".into(),
            cores: 40,
            hosts: vec![host("n1", "EPYC 9654", 16), host("n2", "EPYC 9654", 16), host("g1", "Xeon 8480", 8)],
            link: Some("n1 to n2".into()),
            launcher: Some("Slurm".into()),
            ..Machine::default()
        };
        let mut h = String::new();
        machine_section(&mut h, Some(&m), false);
        assert!(
            h.contains(
                "<th class=l>2 x</th><td class=l>EPYC 9654, 16 logical cores, 16.0 GiB, GPU: none (n1, n2)"
            ),
            "{h}"
        );
        assert!(h.contains("<th class=l>1 x</th><td class=l>Xeon 8480, 8 logical cores"), "{h}");
        assert!(h.contains("started from</th><td class=l>login1"), "{h}");
        assert!(!h.contains("Login CPU") && !h.contains("40 logical cores"), "{h}");
        assert!(
            h.contains("raw host-to-host (n1 to n2) TCP") && h.contains("as job steps of a Slurm allocation"),
            "{h}"
        );
        let one = Machine {
            hosts: vec![host("n1", "EPYC 9654", 16)],
            link: Some("loopback (one node: n1)".into()),
            ..m
        };
        let mut h = String::new();
        machine_section(&mut h, Some(&one), false);
        assert!(
            h.contains("raw loopback (one node: n1) TCP") && h.contains("on the one host's loopback"),
            "{h}"
        );
    }

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
        // Each cell twice: what ranking the modes needs.
        let twice = |r: &Summary| {
            (0..2)
                .map(|k| Summary { id: format!("{}-r{k}", r.id), repeat: k, ..r.clone() })
                .collect::<Vec<_>>()
        };
        let c = collected(rows.iter().flat_map(twice).collect());
        let g = &crate::charts::groups(&c)[0];
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
        // Each cell once: the shares are read, the modes not ranked.
        let c = collected(rows.to_vec());
        let text = straggler_reading(&crate::charts::groups(&c)[0]).join("\n");
        assert!(text.contains("pays 10% of the injected delay"), "{text}");
        assert!(!text.contains("absorbs the straggler best ("), "{text}");
        assert!(text.contains("Which mode absorbs the straggler best: Not ranked"), "{text}");
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
        let text = reading(&crate::charts::groups(&c)[0], link, None, &c.summaries).join("\n");
        assert!(
            text.contains("do not separate a per-message latency") && !text.contains("a = 0.0 us"),
            "{text}"
        );
        // a = 20 us, B = 1 GB/s: both fitted.
        let c = collected(vec![ring(2, 4.04), ring(4, 6.12)]);
        let text = reading(&crate::charts::groups(&c)[0], link, None, &c.summaries).join("\n");
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
        let mut gs = crate::charts::groups(&c);
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

    /// A cell that ran once is listed, never ranked: not as fastest, not as first to the
    /// target, not in the ring-against-PS verdict, not against DDP; beside cells with repeats
    /// it is set apart, however fast it was.
    #[test]
    fn cells_that_ran_once_are_listed_not_ranked() {
        let with_step = |mode: &str, repeat: usize, thr: f64, tt: f64| Summary {
            step_ms: Some(1e5 / thr),
            ..rep_row(mode, repeat, "ok", thr, Some(tt))
        };
        let once = vec![
            with_step("ddp-tcp", 0, 1000.0, 4.0),
            with_step("ps-bsp", 0, 800.0, 3.0),
            with_step("zero1-tcp", 0, 900.0, 5.0),
        ];
        let c = collected(once);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        for ranked in
            ["is fastest", "are level", "first, in", "is ahead", "faster than DDP", "slower than DDP"]
        {
            assert!(!text.contains(ranked), "'{ranked}' from single runs:\n{text}");
        }
        assert!(text.contains("At 4 workers, in samples/s: ddp-tcp"), "{text}");
        assert!(text.contains("ps-bsp k=1 (gRPC over TCP) 800 (one run)"), "{text}");
        assert!(text.contains("time to 97.0% held-out accuracy: ps-bsp"), "{text}");
        assert!(text.matches("Not ranked: a cell measured once").count() >= 3, "{text}");
        assert!(text.contains("not ranked (one run"), "{text}");

        // Repeated cells are ranked; a faster cell that ran once stands apart.
        let mut rows: Vec<Summary> = (0..3)
            .flat_map(|r| {
                [
                    with_step("ddp-tcp", r, 1000.0 + r as f64, 4.0),
                    with_step("ps-bsp", r, 800.0 + r as f64, 3.0),
                ]
            })
            .collect();
        rows.push(with_step("dp", 0, 5000.0, 1.0));
        let c = collected(rows);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("At 4 workers: ddp-tcp (TCP sockets) is fastest"), "{text}");
        assert!(
            text.contains("Ran once, not ranked: dp (in one process) 5000 samples/s (one run)."),
            "{text}"
        );
        assert!(text.contains("ps-bsp k=1 (gRPC over TCP) reaches 97.0% held-out accuracy first"), "{text}");
        assert!(text.contains("Ran once, not ranked: dp (in one process) 1.00 s (one run)."), "{text}");
    }

    /// Without a one-worker run the efficiency table says there is no baseline, rather than
    /// describing bracketed ratios against a baseline of "-".
    #[test]
    fn the_efficiency_table_names_a_missing_baseline() {
        let c = collected(vec![row("ddp-tcp", 0, 1000.0), row("ps-bsp", 0, 800.0)]);
        let mut h = String::new();
        efficiency_table(&mut h, &crate::charts::groups(&c)[0]);
        assert!(h.contains("No one-worker run completed") && !h.contains("baseline at -"), "{h}");
        assert!(h.contains("<td>1000</td>"), "{h}");
        let one = Summary { workers: 1, ..row("local", 0, 300.0) };
        let c = collected(vec![row("ddp-tcp", 0, 1000.0), one]);
        let mut h = String::new();
        efficiency_table(&mut h, &crate::charts::groups(&c)[0]);
        assert!(h.contains("baseline at 300 samples/s") && h.contains("1000 (83%)"), "{h}");
    }

    /// The bytes chart's model lines are drawn at every worker count up to the largest, so a
    /// run of one worker count still shows them (a dashed line of one point draws nothing).
    #[test]
    fn the_bytes_model_shows_with_one_worker_count() {
        let with = |mode: &str| Summary { params: 1_000_000, ..row(mode, 0, 1000.0) };
        let c = collected(vec![with("ddp-tcp"), with("ps-bsp")]);
        let g = &crate::charts::groups(&c)[0];
        let dir = gradsync_testkit::Scratch::new("bytes-chart");
        let mut charts = crate::charts::Charts::new(&dir).unwrap();
        charts.draw_group(g, None).unwrap();
        let svg = &charts.charts.iter().find(|c| c.name.starts_with("bytes")).unwrap().svg;
        // "PS, per worker (theory)" in ps-bsp's colour: its legend swatch and its dashes.
        let ps = "stroke=\"#2CA02C\"";
        assert!(svg.matches(ps).count() >= 2, "{} strokes of {ps}", svg.matches(ps).count());
    }

    #[test]
    fn compressed_modes_are_read_against_the_mode_they_compress() {
        let with = |mode: &str, sent: f64, acc: f64, tt: Option<f64>| Summary {
            bytes_sent_per_step_worker: Some(sent),
            final_accuracy: Some(acc),
            ..rep_row(mode, 0, "ok", 1000.0, tt)
        };
        let rows = vec![
            with("ps-bsp", 4.0e6, 0.975, Some(3.0)),
            with("ps-bsp-topk", 8.0e4, 0.972, Some(3.5)),
            with("ddp-tcp", 4.0e6, 0.975, Some(2.0)),
            with("ddp-tcp-topk", 1.6e5, 0.95, None),
        ];
        let c = collected(rows);
        let g = Group { target: Some(0.97), ..crate::charts::groups(&c).remove(0) };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(
            text.contains(
                "ps-bsp-topk at 4 workers sends 0.080 MB per step per worker against ps-bsp's 4.000 (50.0x fewer); \
                 final held-out accuracy 97.2% against 97.5% (-0.3 points); time to 97% 3.5 s against 3.0 s."
            ),
            "{text}"
        );
        assert!(
            text.contains("ddp-tcp-topk at 4 workers")
                && text.contains("time to 97% not reached against 2.0 s"),
            "{text}"
        );
        // Runs without a target (no evaluation) reached nothing and missed nothing: no time.
        let g = Group { target: None, ..g };
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("(-0.3 points).") && !text.contains("time to"), "{text}");
    }

    /// The ring is set against the best uncompressed PS: a faster compressed PS is read against
    /// ps-bsp, not named as the ring's rival.
    #[test]
    fn the_ring_is_read_against_the_uncompressed_parameter_server() {
        let rows = vec![
            rep_row("ddp-tcp", 0, "ok", 1000.0, None),
            rep_row("ps-bsp", 0, "ok", 800.0, None),
            rep_row("ps-bsp-fp16", 0, "ok", 1500.0, None),
        ];
        let c = collected(rows);
        let g = crate::charts::groups(&c).remove(0);
        let text = reading(&g, None, None, &c.summaries).join("\n");
        assert!(text.contains("ring/PS = 1.25 (vs ps-bsp k=1"), "{text}");
    }

    /// Runs on different emulated links are never repeats of one another, nor rows of one
    /// group: each link gets its own group, named in its titles, so no reading ranks a mode on
    /// one link against a mode on another.
    #[test]
    fn runs_on_different_links_are_read_apart() {
        let on = |mode: &str, link: &str, thr: f64| Summary {
            id: format!("runs/{mode}-{link}"),
            link: link.into(),
            ..rep_row(mode, 0, "ok", thr, None)
        };
        let rows = vec![
            on("ddp-tcp", "1 Gbit/s", 900.0),
            on("ddp-tcp", "0.1 Gbit/s", 100.0),
            on("ps-bsp", "1 Gbit/s", 800.0),
            on("ps-bsp", "0.1 Gbit/s", 50.0),
        ];
        let c = collected(rows);
        assert_eq!(c.cells.len(), 4, "a cell per mode and link: {:?}", c.cells);
        let gs = crate::charts::groups(&c);
        assert_eq!(gs.len(), 2);
        for g in &gs {
            assert!(g.model.ends_with(&format!("on emulated links of {}", g.link)), "{}", g.model);
            assert!(g.rows.iter().all(|r| r.link == g.link) && g.rows.len() == 2, "{:?}", g.rows);
            assert!(!g.suffix.is_empty() && g.suffix.ends_with("gbits"), "{}", g.suffix);
            let text = reading(g, None, None, &c.summaries).join("\n");
            let (fast, slow) = if g.link == "1 Gbit/s" { ("900", "800") } else { ("100", "50") };
            assert!(text.contains(fast) && text.contains(slow), "{}: {text}", g.link);
        }
    }

    /// A cell of `mode` at `workers`, repeat `repeat`, with throughput `thr`.
    fn cell_row(mode: &str, workers: usize, repeat: usize, thr: f64) -> Summary {
        Summary { id: format!("runs/{mode}-w{workers}-r{repeat}"), workers, repeat, ..row(mode, 0, thr) }
    }

    /// Every "N% of" in `text`, as N.
    fn shares_of(text: &str) -> Vec<f64> {
        text.match_indices("% of")
            .filter_map(|(i, _)| {
                let head = &text[..i];
                let start = head.rfind(|c: char| !(c.is_ascii_digit() || c == '.')).map_or(0, |j| j + 1);
                head[start..].parse().ok()
            })
            .collect()
    }

    /// The figures of a 16-core machine's report that once read "the busiest parameter-server
    /// shard moves 5.75 GB/s, 123% of the raw TCP link" and "ps-bsp k=1 reaches 114% of what
    /// the raw link allows" against one TCP stream of 4.67 GB/s: read against as many streams
    /// as the modes keep busy, and with only one stream measured, no share of a limit passes
    /// 100%.
    #[test]
    fn no_reading_puts_a_figure_above_its_limit() {
        // S = 7.1875 MB; 4 workers, one shard: the shard moves 2nS = 57.5 MB a step at 100
        // steps/s; the alpha-beta model at one stream gives 6.196 ms, measured 5.435 ms.
        let params = 1_796_875;
        let ps = |r: usize| Summary {
            params,
            bytes_per_step_server: Some(5.75e7),
            comm_ms: Some(5.435),
            ..cell_row("ps-bsp", 4, r, 12_800.0 + r as f64)
        };
        let ring = |r: usize| Summary {
            params,
            comm_ms: Some(2.0),
            ..cell_row("ddp-tcp", 4, r, 9_000.0 + r as f64)
        };
        let c = collected((0..3).flat_map(|r| [ps(r), ring(r)]).collect());
        let g = &crate::charts::groups(&c)[0];
        let one = Machine { cores: 16, tcp_bandwidth: 4.67e9, tcp_latency_s: 20e-6, ..Machine::default() };
        let text = reading(g, link_of(Some(&one)), Some(&one), &c.summaries).join("\n");
        assert!(text.contains("moves 5.75 GB/s in and out, 1.23x what one raw TCP stream carries"), "{text}");
        assert!(text.contains("the implementation reaches 1.14x what one raw TCP stream carries"), "{text}");
        assert!(shares_of(&text).iter().all(|&p| p <= 100.0), "{:?}\n{text}", shares_of(&text));

        let streams = |n: usize, gbs: f64| crate::machine::Parallel {
            streams: n,
            yardstick: crate::rawtcp::Yardstick { samples: vec![gbs * 1e9] },
        };
        let many = Machine { tcp_parallel: vec![streams(4, 12.0), streams(8, 20.0)], ..one };
        let text = reading(g, link_of(Some(&many)), Some(&many), &c.summaries).join("\n");
        assert!(
            text.contains("5.75 GB/s in and out, 29% of what 8 raw TCP streams at once carry (20.00 GB/s)"),
            "{text}"
        );
        // 57.5 MB over 8 streams at 20 GB/s, plus 2a: 2.915 ms of the 5.435 measured.
        assert!(
            text.contains("ps-bsp k=1 (gRPC over TCP) at 4 workers: 5.43 ms")
                && text.contains("take 2.92 ms"),
            "{text}"
        );
        assert!(text.contains("54% of what 8 raw TCP streams at once carry"), "{text}");
        assert!(shares_of(&text).iter().all(|&p| p <= 100.0), "{:?}\n{text}", shares_of(&text));
    }

    /// Two workers sharing what one worker does 17x faster, computing for a tenth of the step:
    /// the reading names fixed per-step costs with the figures; with compute most of the step
    /// it says nothing.
    #[test]
    fn fixed_per_step_costs_are_named_when_compute_is_a_small_share() {
        let local = Summary { workers: 1, ..row("local", 0, 343_404.0) };
        let two = |fwd: f64| Summary {
            workers: 2,
            step_ms: Some(6.2),
            forward_ms: Some(fwd),
            backward_ms: Some(0.4),
            update_ms: Some(0.1),
            ..row("ddp-tcp", 0, 20_624.0)
        };
        let c = collected(vec![local.clone(), two(0.2)]);
        let g = &crate::charts::groups(&c)[0];
        let text = runs::fixed_costs(&context::Context::new(g, None, None, &c.summaries)).join("\n");
        assert!(text.contains("Fixed per-step costs decide the speed"), "{text}");
        assert!(
            text.contains(
                "computes (forward, backward and update, measured) for 0.70 ms of its 6.20 ms step (11%)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "One worker alone runs 343404 samples/s against 20624 here (3% scaling efficiency)"
            ),
            "{text}"
        );
        let c = collected(vec![local.clone(), two(5.0)]);
        let g = &crate::charts::groups(&c)[0];
        assert!(runs::fixed_costs(&context::Context::new(g, None, None, &c.summaries)).is_empty());
        // A replayed VGG-16's step was once read so: 16.7 ms of compute in a 101 ms step, whose
        // rest was exposed communication, not fixed costs.
        let exposed = Summary { comm_exposed_ms: Some(5.0), ..two(0.2) };
        let c = collected(vec![local, exposed]);
        let g = &crate::charts::groups(&c)[0];
        assert!(runs::fixed_costs(&context::Context::new(g, None, None, &c.summaries)).is_empty());
    }

    fn verdict_of(rows: Vec<Summary>, m: Option<&Machine>) -> Vec<String> {
        let c = collected(rows);
        let g = &crate::charts::groups(&c)[0];
        let v = verdict::verdict(&context::Context::new(g, Some(Link { a: 20e-6, b: 4e9 }), m, &c.summaries));
        assert!(!v.is_empty() && v.len() <= 3, "{v:?}");
        v
    }

    #[test]
    fn the_verdict_names_the_hosts_a_comparison_ran_on() {
        let rows: Vec<Summary> = (0..3).map(|r| cell_row("ddp-tcp", 4, r, 1000.0 + r as f64)).collect();
        assert!(verdict_of(rows.clone(), None)[0].contains("on this machine's loopback"));
        let host = |n: &str| crate::site::HostFacts { name: n.into(), ..Default::default() };
        let m = Machine {
            hosts: vec![host("node0"), host("node1")],
            link: Some("node0 to node1".into()),
            ..Machine::default()
        };
        let v = verdict_of(rows.clone(), Some(&m));
        assert!(v[0].contains("on 2 hosts (the link measured from node0 to node1)"), "{v:?}");
        // A Slurm allocation of one node: its loopback, said once, and no "1 hosts".
        let one =
            Machine { hosts: vec![host("node0")], link: Some("loopback (one node: node0)".into()), ..m };
        let v = verdict_of(rows, Some(&one));
        assert!(v[0].contains("on one host, node0 (the link measured on its loopback)"), "{v:?}");
    }

    #[test]
    fn the_verdict_picks_a_clear_winner() {
        let rows = (0..3).flat_map(|r| {
            [cell_row("ddp-tcp", 4, r, 1000.0 + r as f64), cell_row("ps-bsp", 4, r, 800.0 + r as f64)]
        });
        let v = verdict_of(rows.collect(), None);
        assert!(
            v[0].contains(
                "pick ddp-tcp (TCP sockets): at 4 workers it runs 1001 samples/s (median of 3, 1000-1002)"
            ),
            "{v:?}"
        );
        assert!(v[0].contains("next: ps-bsp k=1 (gRPC over TCP)"), "{v:?}");
        assert!(
            v[1].starts_with(
                "By the cost model, a parameter server with a shard per worker beats the ring from"
            ),
            "{v:?}"
        );
        assert!(v[2].starts_with("Sure as far as 3 complete repeats per cell at 4 workers go"), "{v:?}");
        // One mode alone is picked as what it is, the only one measured; a time to the target
        // below a second reads in milliseconds.
        let rows = (0..2).map(|r| Summary {
            time_to_target_s: Some(0.004 + 0.001 * r as f64),
            ..cell_row("local", 1, r, 5000.0)
        });
        let c = collected(rows.collect());
        let g = crate::charts::Group { target: Some(0.6), ..crate::charts::groups(&c).remove(0) };
        let v = verdict::verdict(&context::Context::new(&g, None, None, &c.summaries));
        assert!(
            v[0].contains("pick local: at 1 worker it reaches 60.0% held-out accuracy in 4.5 ms (median of 2, 4.0 ms to 5.0 ms), the only mode measured there"),
            "{v:?}"
        );
    }

    #[test]
    fn the_verdict_calls_overlapping_modes_level() {
        let rows = (0..3).flat_map(|r| {
            [cell_row("ddp-tcp", 4, r, 1000.0 + 10.0 * r as f64), cell_row("ps-bsp", 4, r, 1015.0 + r as f64)]
        });
        let v = verdict_of(rows.collect(), None);
        assert!(v[0].contains("no single pick: at 4 workers") && v[0].contains("are level"), "{v:?}");
        // Each mode's figure follows its name, one bracket deep.
        assert!(v[0].contains("(TCP sockets), which runs") && v[0].contains("; and "), "{v:?}");
        assert!(!v[0].contains(") ("), "brackets in brackets: {v:?}");
        assert!(!v.join(" ").contains(" pick ps-bsp") && !v.join(" ").contains(" pick ddp-tcp"), "{v:?}");
        // Ran once: no pick at all.
        let v = verdict_of(vec![cell_row("ddp-tcp", 4, 0, 1000.0), cell_row("ps-bsp", 4, 0, 500.0)], None);
        assert!(v[0].contains("no pick: at 4 workers a cell that could decide ran once"), "{v:?}");
        // Nothing complete: nothing concluded.
        let c = collected(vec![Summary { status: "diverged".into(), ..cell_row("ddp-tcp", 4, 0, 9e9) }]);
        let one = collected(vec![cell_row("dp", 4, 0, 1.0)]);
        let none = crate::charts::Group { rows: vec![], ..crate::charts::groups(&one).remove(0) };
        let v = verdict::verdict(&context::Context::new(&none, None, None, &c.summaries));
        assert_eq!(
            v,
            ["No pick: no run completed, so there is nothing to compare (the table below says why)."]
        );
    }

    /// On emulated links, with the parameter server's processes (2 workers and a server)
    /// outnumbering 2 cores: the verdict names the links once, and says why the ring is the
    /// only mode left to pick rather than calling it the only one measured.
    #[test]
    fn an_emulated_verdict_names_its_links_once_and_why_a_mode_stood_alone() {
        let rows: Vec<Summary> =
            (0..2)
                .flat_map(|r| {
                    let r_ = r as f64;
                    [cell_row("ps-bsp", 2, r, 14.0 + r_), cell_row("ddp-tcp", 2, r, 28.0 + r_)].map(|s| {
                        Summary { link: "1gbits".into(), shards: if s.mode == "ps-bsp" { 1 } else { 0 }, ..s }
                    })
                })
                .collect();
        let small = Machine { cores: 2, ..Machine::default() };
        let v = verdict_of(rows, Some(&small));
        assert_eq!(v[0].matches("emulated links of").count(), 1, "{v:?}");
        assert!(
            v[0].contains("pick ddp-tcp (TCP sockets)")
                && v[0].contains(
                    "; ps-bsp k=1 (gRPC over TCP) saturated the CPU (more processes than cores; for a replay, cores \
                     over 80% busy), so it is the only mode left there."
                ),
            "{v:?}"
        );
        assert!(v[2].contains("and 2 run(s) that saturated the CPU (more processes than cores"), "{v:?}");
    }

    /// Runs that saturated the CPU (more processes than cores) rank nothing in the readings
    /// either: the fastest mode, the ring against the PS, the scaling and the time to the
    /// target leave them out and say why, as the verdict does (the readings once ranked them:
    /// "ddp-shm fastest, 2.70x the next", "the ring ahead at every worker count").
    #[test]
    fn readings_rank_no_run_that_saturated_the_cpu() {
        let rows: Vec<Summary> = (0..2)
            .flat_map(|r| {
                let r_ = r as f64;
                let tt = |t: f64| Some(t + r_);
                [
                    Summary { time_to_target_s: tt(9.0), ..cell_row("ps-bsp", 2, r, 900.0 + r_) },
                    Summary { time_to_target_s: tt(5.0), ..cell_row("ddp-tcp", 2, r, 700.0 + r_) },
                    Summary { time_to_target_s: tt(8.0), ..cell_row("ps-bsp", 4, r, 1000.0 + r_) },
                    Summary { time_to_target_s: tt(3.0), ..cell_row("ddp-tcp", 4, r, 2000.0 + r_) },
                    Summary { time_to_target_s: tt(12.0), ..cell_row("local", 1, r, 500.0 + r_) },
                ]
            })
            .map(|s| Summary { samples_to_target: s.time_to_target_s.map(|t| t as u64 * 100), ..s })
            .collect();
        let c = Collected { cells: Cell::all(&rows), summaries: rows, ..Collected::default() };
        let mut g = crate::charts::groups(&c).remove(0);
        g.target = Some(0.9);
        let link = Some(Link { a: 20e-6, b: 4e9 });
        let read = |m: Option<&Machine>| {
            let cx = context::Context::new(&g, link, m, &c.summaries);
            [
                ranking::fastest(&cx),
                ranking::ring_against_ps(&cx),
                ranking::scaling(&cx),
                ranking::first_to_target(&cx),
            ]
            .concat()
            .join("\n")
        };
        // On a big machine every cell is read.
        let all = read(None);
        assert!(all.contains("At 4 workers: ddp-tcp (TCP sockets) is fastest"), "{all}");
        assert!(all.contains("The ring pulls ahead at 4 workers"), "{all}");
        // On 3 cores every 4-worker run saturates the CPU; 2 workers and a server are 3 processes.
        let small = Machine { cores: 3, ..Machine::default() };
        let text = read(Some(&small));
        assert!(!text.contains("is fastest with 2001"), "{text}");
        assert!(
            text.contains("At 4 workers nothing is ranked: Not ranked, since they saturated the CPU"),
            "{text}"
        );
        assert!(
            text.contains("4 workers: ring/PS = 2.00 (vs ps-bsp k=1 (gRPC over TCP)), not read"),
            "{text}"
        );
        assert!(!text.contains("pulls ahead") && text.contains("ahead at every worker count read"), "{text}");
        assert!(text.contains("ddp-tcp (TCP sockets) 3.50 s; ps-bsp k=1 (gRPC over TCP) 8.50 s."), "{text}");
        assert!(
            text.contains("Scaling efficiency at 4 workers is not read. Left out, since they saturated"),
            "{text}"
        );
        assert!(text.contains("At 4 workers nothing is ranked by time to 90.0%"), "{text}");
        // A worker count with one mode that ran says so, rather than calling it the fastest.
        assert!(text.contains("At 1 worker only local") && text.contains(" ran: 500 samples/s"), "{text}");
    }

    /// The parameter server leads at 2 workers, the ring at 8: the pick is made at 8 and the
    /// crossing named; on a machine of 4 cores the 8-worker runs decide nothing.
    #[test]
    fn the_verdict_names_a_crossing_with_worker_count() {
        let rows: Vec<Summary> = (0..2)
            .flat_map(|r| {
                let r_ = r as f64;
                [
                    cell_row("ps-bsp", 2, r, 900.0 + r_),
                    cell_row("ddp-tcp", 2, r, 700.0 + r_),
                    cell_row("ps-bsp", 8, r, 1000.0 + r_),
                    cell_row("ddp-tcp", 8, r, 2000.0 + r_),
                ]
            })
            .collect();
        let v = verdict_of(rows.clone(), None);
        assert!(v[0].contains("pick ddp-tcp (TCP sockets): at 8 workers"), "{v:?}");
        assert!(
            v[1].contains("the measured leader changes with the worker count (ps-bsp k=1 (gRPC over TCP) at 2, ddp-tcp (TCP sockets) at 8)"),
            "{v:?}"
        );
        let small = Machine { cores: 4, ..Machine::default() };
        let v = verdict_of(rows, Some(&small));
        assert!(v[0].contains("pick ps-bsp k=1 (gRPC over TCP): at 2 workers"), "{v:?}");
        assert!(!v[1].contains("leader changes") && v[1].starts_with("By the cost model"), "{v:?}");
        assert!(
            v[2].contains("and 4 run(s) that saturated the CPU") && v[2].contains("decide nothing"),
            "{v:?}"
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod cluster_tests {
    use super::*;

    /// A run on a 10 Gbit/s link: its cluster record and its summary.
    fn run(mode: ModeKind, repeat: usize, status: &str, step_ms: f64) -> (ClusterRun, Summary) {
        let id = format!("runs/{}-r{repeat}", mode.label());
        let shards = usize::from(mode.is_ps());
        let c = ClusterRun {
            id: id.clone(),
            mode,
            workers: 2,
            shards,
            hosts: 2 + shards,
            rate_gbit: 10.0,
            measured_gbit: Some(9.0),
            measured_latency_us: Some(30.0),
            delay_us: 0,
            loss_pct: 0.0,
        };
        let s = Summary {
            id,
            mode: mode.label().into(),
            workers: 2,
            shards,
            model: "mnist".into(),
            global_batch: 128,
            link: c.label(),
            params: 1_000_000,
            step_ms: Some(step_ms),
            comm_ms: Some(step_ms / 2.0),
            status: status.into(),
            repeat,
            ..Summary::default()
        };
        (c, s)
    }

    fn reading(runs: &[(ClusterRun, Summary)]) -> Vec<String> {
        let (c, s): (Vec<ClusterRun>, Vec<Summary>) = runs.iter().cloned().unzip();
        ps_against_ring(&c, &s)
    }

    /// The PS-to-ring ratio is the medians' over complete repeats (not the first run of each),
    /// with the ranges beside it; a failed repeat counts for neither.
    #[test]
    fn the_ps_to_ring_ratio_is_taken_over_complete_repeats() {
        let runs = [
            run(ModeKind::PsBsp, 0, "ok", 20.0),
            run(ModeKind::PsBsp, 1, "ok", 22.0),
            run(ModeKind::PsBsp, 2, "failed", 90.0),
            run(ModeKind::DdpTcp, 0, "ok", 10.0),
            run(ModeKind::DdpTcp, 1, "ok", 14.0),
        ];
        let r = reading(&runs);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(
            r[0].contains("takes 1.75 x a ring step (medians of 2 and 2 complete repeats: 20.0-22.0 against 10.0-14.0 ms)"),
            "{r:?}"
        );
        assert!(!r[0].contains("level"), "{r:?}");
    }

    /// With one complete repeat a cell is listed with its figures and not compared; ranges that
    /// overlap are called level.
    #[test]
    fn cells_run_once_are_not_compared_and_overlaps_are_level() {
        let once = [run(ModeKind::PsBsp, 0, "ok", 20.0), run(ModeKind::DdpTcp, 0, "ok", 10.0)];
        let r = reading(&once);
        assert!(r[0].contains("Not compared") && !r[0].contains(" x a ring step"), "{r:?}");
        let close = [
            run(ModeKind::PsBsp, 0, "ok", 11.0),
            run(ModeKind::PsBsp, 1, "ok", 13.0),
            run(ModeKind::DdpTcp, 0, "ok", 10.0),
            run(ModeKind::DdpTcp, 1, "ok", 12.0),
        ];
        let r = reading(&close);
        assert!(r[0].contains("level within their spread"), "{r:?}");
    }
}
