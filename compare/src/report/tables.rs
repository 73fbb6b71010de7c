//! The page's tables as data: the one table a reader wants first (mode by worker count: time
//! to the target with its spread, throughput, exposed communication, bytes per step), and the
//! tables that go into detail (time to accuracy, scaling efficiency, the cost model
//! extrapolated and per design, every run, the machine and its hosts).

use serde::Serialize;

use super::context::Context;
use super::runs;
use super::verdict::{self, Standing};
use crate::charts::Group;
use crate::cost::{self, Link};
use crate::machine::Machine;
use crate::results::Summary;

/// Worker counts at which the cost model is tabulated.
const EXTRAPOLATE_N: [usize; 6] = [2, 8, 32, 128, 512, 1024];
/// Link speeds of the extrapolation, Gbit/s.
const LINKS_GBIT: [f64; 3] = [1.0, 10.0, 100.0];
/// Ranks per host of the hierarchical column (a typical GPU server's count).
const RANKS_PER_HOST: usize = 8;
/// The top-k ratio of the compression columns.
const TOPK_RATIO: f64 = 0.01;

/// A table cell.
#[derive(Debug, Clone, Serialize)]
pub struct Td {
    /// What it says.
    pub text: String,
    /// Set flush left (words), not right (figures).
    pub left: bool,
}

/// A table row.
#[derive(Debug, Serialize)]
pub struct Tr {
    /// Its style: a run's status, or empty.
    pub class: String,
    /// Its cells, the first a heading where the table's rows have one.
    pub cells: Vec<Td>,
}

/// A table with its title and what it shows.
#[derive(Debug, Serialize)]
pub struct Grid {
    /// Its title.
    pub title: String,
    /// What it shows and how to read it.
    pub caption: String,
    /// Its column headings.
    pub head: Vec<Td>,
    /// Its rows.
    pub rows: Vec<Tr>,
}

fn num(text: impl Into<String>) -> Td {
    Td { text: text.into(), left: false }
}

fn word(text: impl Into<String>) -> Td {
    Td { text: text.into(), left: true }
}

fn row(cells: Vec<Td>) -> Tr {
    Tr { class: String::new(), cells }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into())
}

/// The group's worker counts, ascending.
fn worker_counts(g: &Group) -> Vec<usize> {
    let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
    ws.sort_unstable();
    ws.dedup();
    ws
}

/// Mode by worker count, the table under the verdict.
#[derive(Debug, Serialize)]
pub struct Results {
    /// The target, "97.0%", where the scenario set one (the time column's heading).
    pub target: Option<String>,
    /// A row per cell, by worker count, the best first.
    pub rows: Vec<ResultRow>,
}

/// One cell's medians.
#[derive(Debug, Serialize)]
pub struct ResultRow {
    /// The mode, with its shards and wire.
    pub mode: String,
    /// Workers.
    pub workers: usize,
    /// Time to the target with the range over the repeats, or "not reached".
    pub time: String,
    /// Samples/s with the range over the repeats.
    pub throughput: String,
    /// Exposed communication per step, ms.
    pub exposed: String,
    /// Bytes sent and received per step per worker, MB.
    pub bytes: String,
    /// How the verdict reads it: "pick", "level", "behind", "not ranked: ...", "baseline" (one
    /// worker beside counts above one), or nothing.
    pub note: String,
    /// Its style: `pick`, `level`, `unranked` or empty.
    pub kind: &'static str,
}

/// The table under the verdict: every cell of the group, by worker count, the best first.
pub fn results(cx: &Context) -> Results {
    let g = cx.g;
    let mut rows: Vec<&Summary> = g.rows.clone();
    let key = |r: &Summary| verdict::figure(cx, r).unwrap_or(f64::INFINITY);
    rows.sort_by(|a, b| a.workers.cmp(&b.workers).then(key(a).total_cmp(&key(b))).then(a.id.cmp(&b.id)));
    // Only the worker counts the verdict decides at are marked (not one worker's baseline
    // beside them).
    let standings: Vec<(usize, Standing)> =
        verdict::counts(cx).into_iter().map(|n| (n, verdict::standing(cx, n))).collect();
    let standing = |n: usize| standings.iter().find(|s| s.0 == n).map(|s| &s.1);
    let rows = rows
        .into_iter()
        .map(|r| {
            let c = g.cell_of(r);
            let (note, kind) = match standing(r.workers) {
                _ if cx.cpu_saturated(r) => (format!("not ranked: {}", cx.saturated()), "unranked"),
                _ if !cx.repeated(r) => ("not ranked: ran once".to_string(), "unranked"),
                Some(Standing::Ahead(best, _)) if std::ptr::eq(*best, r) => ("pick".into(), "pick"),
                Some(Standing::Level(l)) if l.iter().any(|x| std::ptr::eq(*x, r)) => {
                    ("level".into(), "level")
                }
                Some(Standing::Ahead(..) | Standing::Level(_)) => ("behind".into(), ""),
                None if r.workers == 1 => ("baseline".into(), ""),
                _ => (String::new(), ""),
            };
            let repeated = c.is_some_and(|c| c.runs.len() > 1);
            let time = match (r.time_to_target_s, c.and_then(|c| c.time_to_target)) {
                (Some(t), Some((lo, hi))) if repeated => format!("{t:.2} s ({lo:.2}-{hi:.2})"),
                (Some(t), _) => format!("{t:.2} s"),
                _ => {
                    format!("not reached ({}/{})", c.map_or(0, |c| c.reached), c.map_or(0, |c| c.runs.len()))
                }
            };
            let throughput = match (r.samples_per_s, c.and_then(|c| c.throughput)) {
                (Some(t), Some((lo, hi))) if repeated => format!("{t:.0} ({lo:.0}-{hi:.0})"),
                (t, _) => opt(t, 0),
            };
            ResultRow {
                mode: Group::series(r),
                workers: r.workers,
                time,
                throughput,
                exposed: opt(r.comm_exposed_ms, 2),
                bytes: opt(r.bytes_per_step_worker.map(|b| b / 1e6), 2),
                note,
                kind,
            }
        })
        .collect();
    Results { target: g.target.map(|t| format!("{:.1}%", 100.0 * t)), rows }
}

/// One row per series of `g`: its name, then `cell` of its run at each of the worker counts
/// `ws` (`None` where it has none there).
fn series_by_workers(g: &Group, ws: &[usize], cell: impl Fn(Option<&Summary>, usize) -> String) -> Vec<Tr> {
    g.by_series()
        .into_iter()
        .map(|(name, rows)| {
            let mut cells = vec![word(name)];
            cells.extend(ws.iter().map(|&w| num(cell(rows.iter().find(|r| r.workers == w).copied(), w))));
            row(cells)
        })
        .collect()
}

/// Time-to-accuracy per series and worker count: the median over the complete repeats that
/// reached the target, their range, and the epochs it took; statistical efficiency beside
/// throughput.
pub fn convergence(g: &Group) -> Option<Grid> {
    let t = g.target?;
    let ws = worker_counts(g);
    let mut head = vec![word("mode")];
    head.extend(ws.iter().map(|&w| num(crate::charts::workers(w))));
    let rows = series_by_workers(g, &ws, |r, _| {
        let Some(r) = r else { return "-".into() };
        let c = g.cell_of(r);
        let reps = c.map_or(0, |c| c.runs.len());
        match (r.time_to_target_s, c.and_then(|c| c.time_to_target)) {
            (Some(tt), Some((lo, hi))) => format!(
                "{tt:.2} s ({lo:.2}-{hi:.2}); {} ep; {} /s",
                opt(r.epochs_to_target, 1),
                opt(r.samples_per_s, 0)
            ),
            _ => format!(
                "not reached ({}/{reps}); best {}%",
                c.map_or(0, |c| c.reached),
                opt(r.best_accuracy.map(|a| 100.0 * a), 1)
            ),
        }
    });
    Some(Grid {
        title: format!("Time to {:.1}% held-out accuracy", 100.0 * t),
        caption: "Training-clock seconds (evaluation left out) until rank 0 first measured the target: median over \
                  the complete repeats (range in brackets), then epochs and samples/s. \"not reached\" when fewer \
                  than half the repeats got there. Time = samples to target / throughput: the first factor is \
                  statistical efficiency, the second system throughput."
            .into(),
        head,
        rows,
    })
}

/// Samples/s per series and worker count, with the share of linear scaling from the
/// one-worker baseline.
pub fn efficiency(g: &Group) -> Grid {
    let ws = worker_counts(g);
    let base = g.baseline().filter(|b| *b > 0.0);
    let caption = match base {
        Some(b) => format!(
            "Samples/s, and in brackets throughput_n / (n x {}) with the one-worker baseline at {b:.0} samples/s.",
            if g.rows.iter().any(|r| r.mode == "local") { "local" } else { "the fastest one-worker run" }
        ),
        None => "Samples/s. No one-worker run completed, so there is no baseline to divide by: add 1 to the \
                 worker counts (or the local mode) for each mode's scaling efficiency."
            .into(),
    };
    let mut head = vec![word("mode")];
    head.extend(ws.iter().map(|&w| num(format!("{w} workers"))));
    let rows = series_by_workers(g, &ws, |r, w| match r.and_then(|r| r.samples_per_s) {
        Some(t) => match base {
            Some(b) => format!("{t:.0} ({:.0}%)", 100.0 * t / (w as f64 * b)),
            None => format!("{t:.0}"),
        },
        None => "-".into(),
    });
    Grid { title: "Scaling efficiency".into(), caption, head, rows }
}

/// The cost model at other worker counts and link speeds.
pub fn extrapolation(g: &Group, link: Option<Link>) -> Option<Grid> {
    let l = link?;
    let s = g.grad_bytes();
    let mut head = vec![num("workers")];
    for gb in LINKS_GBIT {
        head.extend([num(format!("ring {gb:.0} Gbit/s")), num("PS k=1"), num("PS k=n")]);
    }
    let rows = EXTRAPOLATE_N
        .iter()
        .map(|&n| {
            let mut cells = vec![num(n.to_string())];
            for gb in LINKS_GBIT {
                let l = Link { a: l.a, b: cost::gbit(gb) };
                cells.extend([
                    num(format!("{:.2}", cost::ring(n, s, l) * 1e3)),
                    num(format!("{:.2}", cost::ps(n, 1, s, l) * 1e3)),
                    num(format!("{:.2}", cost::ps(n, n, s, l) * 1e3)),
                ]);
            }
            row(cells)
        })
        .collect();
    Some(Grid {
        title: "Cost model, extrapolated".into(),
        caption: format!(
            "Milliseconds of gradient exchange per step for {:.1} MB of gradients, a = {:.1} us (measured). Ring: \
             2(n-1)a + 2(n-1)/n S/B. PS: 2a + max(S/B, nS/(kB)).",
            s / 1e6,
            l.a * 1e6
        ),
        head,
        rows,
    })
}

/// The designs side by side in the cost model, at 10 Gbit/s and the measured latency: which
/// exchange is cheapest at which worker count, and what compression and a hierarchy change.
pub fn designs(g: &Group, link: Option<Link>) -> Option<Grid> {
    use gradsync_core::compress::Compression;
    let l = Link { a: link?.a, b: cost::gbit(10.0) };
    let s = g.grad_bytes();
    let topk = Compression::TopK(TOPK_RATIO);
    let sparse = topk.wire_bytes((s / 4.0) as usize) as f64;
    let head = [
        "workers",
        "ring",
        "ring fp16",
        "ring top-k",
        "PS",
        "PS fp16",
        "PS top-k push",
        "ZeRO-1 exposed",
        "hierarchical, across hosts",
    ]
    .into_iter()
    .map(num)
    .chain([word("cheapest")])
    .collect();
    let rows = EXTRAPOLATE_N
        .iter()
        .map(|&n| {
            let designs = [
                ("ring", cost::ring(n, s, l)),
                ("ring fp16", cost::ring_compressed(n, s, Compression::Fp16, l)),
                ("ring top-k", cost::ring_compressed(n, s, topk, l)),
                ("PS", cost::ps(n, n, s, l)),
                ("PS fp16", cost::ps_compressed(n, n, s / 2.0, s / 2.0, l)),
                ("PS top-k push", cost::ps_compressed(n, n, sparse, s, l)),
            ];
            let cheapest = designs.iter().min_by(|a, b| a.1.total_cmp(&b.1)).map_or("", |d| d.0);
            let hier = if n > RANKS_PER_HOST {
                format!("{:.2}", cost::ring(n.div_ceil(RANKS_PER_HOST), s, l) * 1e3)
            } else {
                "one host".to_string()
            };
            let mut cells = vec![num(n.to_string())];
            cells.extend(designs.iter().map(|d| num(format!("{:.2}", d.1 * 1e3))));
            cells.extend([
                num(format!("{:.2}", cost::zero1_exposed(n, s, l) * 1e3)),
                num(hier),
                word(cheapest),
            ]);
            row(cells)
        })
        .collect();
    Some(Grid {
        title: "Where each design wins (cost model)".into(),
        caption: format!(
            "Milliseconds of gradient exchange per step for {:.1} MB of gradients over 10 Gbit/s links, a = {:.1} us \
             (measured). Top-k keeps {}% of the values as (index, value) pairs: a PS server sums them as they come, \
             and the workers still pull dense f32 parameters; a ring cannot add sparse vectors hop by hop, so it \
             all-gathers every rank's pairs. PS rows use one server shard per worker. The hierarchical column is the \
             leaders' ring across hosts of {RANKS_PER_HOST} ranks (the shared-memory steps inside a host are left \
             out), beside the flat ring over every rank. \"Cheapest\" compares exchange time only: the PS columns \
             need as many server shards as workers, and compression changes what each step learns (top-k took more \
             epochs to reach the target in gradsync's measurements; a comparison that runs the compressed modes \
             reads their time to accuracy beside the uncompressed ones).",
            s / 1e6,
            l.a * 1e6,
            TOPK_RATIO * 100.0
        ),
        head,
        rows,
    })
}

/// Every run with its figures, its status and its error.
pub fn every_run(rows: &[Summary]) -> Grid {
    let head = ["run", "status"]
        .into_iter()
        .map(word)
        .chain(
            [
                "workers",
                "shards",
                "samples/s",
                "ms/step",
                "fwd",
                "bwd",
                "comm",
                "exposed",
                "wait",
                "update",
                "MB/step/worker",
                "final loss",
                "accuracy",
                "to target s",
            ]
            .into_iter()
            .map(num),
        )
        .chain(["restarts", "error"].into_iter().map(word))
        .collect();
    let rows = rows
        .iter()
        .map(|r| Tr {
            class: r.status.clone(),
            cells: vec![
                word(r.id.clone()),
                word(r.status.clone()),
                num(r.workers.to_string()),
                num(r.shards.to_string()),
                num(opt(r.samples_per_s, 0)),
                num(opt(r.step_ms, 2)),
                num(opt(r.forward_ms, 2)),
                num(opt(r.backward_ms, 2)),
                num(opt(r.comm_ms, 2)),
                num(opt(r.comm_exposed_ms, 2)),
                num(opt(r.wait_ms, 2)),
                num(opt(r.update_ms, 2)),
                num(opt(r.bytes_per_step_worker.map(|b| b / 1e6), 2)),
                num(opt(r.final_loss, 4)),
                num(opt(r.final_accuracy.map(|a| 100.0 * a), 1)),
                num(opt(r.time_to_target_s, 2)),
                word(r.restarts.iter().map(runs::restart_text).collect::<Vec<_>>().join("; ")),
                word(r.error.clone()),
            ],
        })
        .collect();
    Grid { title: "Every run".into(), caption: String::new(), head, rows }
}

/// "1.5 GiB".
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// "none", or the GPUs' names.
fn gpus(g: &[String]) -> String {
    if g.is_empty() { "none".into() } else { g.join(", ") }
}

/// The machine's rows: on one machine its parts; on hosts or nodes, each kind of host a row
/// (with its count and names), since the machine the comparison was started from ran none of
/// the processes and the hosts' cores together are no one machine's. Then the version and the
/// raw TCP yardstick.
pub fn machine_rows(m: &Machine) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> = if m.hosts.is_empty() {
        vec![
            ("host".into(), m.host.clone()),
            ("CPU".into(), format!("{} ({} logical cores)", m.cpu, m.cores)),
            ("memory".into(), gib(m.memory_bytes)),
            ("GPU".into(), gpus(&m.gpus)),
            ("kernel".into(), m.kernel.clone()),
        ]
    } else {
        let mut rows = vec![("started from".to_string(), m.host.clone())];
        for (f, names) in m.host_kinds() {
            rows.push((
                format!("{} x", names.len()),
                format!(
                    "{}, {} logical cores, {}, GPU: {} ({})",
                    f.cpu,
                    f.cores,
                    gib(f.memory_bytes),
                    gpus(&f.gpus),
                    names.join(", ")
                ),
            ));
        }
        rows
    };
    rows.push(("gradsync".into(), format!("{} (commit {})", m.gradsync_version, m.gradsync_commit)));
    let wire = match m.link.as_deref() {
        None => "loopback".to_string(),
        Some(l) if l.starts_with("loopback") => l.to_string(),
        Some(l) => format!("host-to-host ({l})"),
    };
    let measured = match (&m.tcp_yardstick, m.tcp_bandwidth > 0.0) {
        (Some(y), _) => format!(
            "{} one stream;{} {:.1} us one-way small-message latency",
            y.describe(),
            m.tcp_parallel
                .iter()
                .map(|p| format!(" {} {} streams at once together;", p.yardstick.describe(), p.streams))
                .collect::<String>(),
            m.tcp_latency_s * 1e6
        ),
        (None, true) => format!(
            "{:.2} GB/s (one measurement) one stream; {:.1} us one-way small-message latency",
            m.tcp_bandwidth / 1e9,
            m.tcp_latency_s * 1e6
        ),
        (None, false) => "not measured".into(),
    };
    rows.push((format!("raw {wire} TCP"), measured));
    rows
}

/// How the processes reached the hosts of `compare --hosts` (the nodes of `--slurm`), and where
/// the link was measured; none on one machine.
pub fn hosts_said(m: &Machine) -> Option<String> {
    if m.hosts.is_empty() {
        return None;
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
    Some(format!(
        "Every server and worker ran on these hosts, started {started}; the link above was measured {between}with \
         the raw-TCP yardstick, and the cost model is fitted to it."
    ))
}

/// The hosts, each as its check found it.
pub fn hosts(m: &Machine) -> Option<Grid> {
    if m.hosts.is_empty() {
        return None;
    }
    let head = vec![
        word("host"),
        word("address"),
        num("slots"),
        word("name"),
        word("CPU"),
        num("cores"),
        num("memory GiB"),
        word("GPU"),
        word("kernel"),
    ];
    let rows = m
        .hosts
        .iter()
        .map(|f| {
            row(vec![
                word(f.name.clone()),
                word(f.addr.clone()),
                num(f.slots.to_string()),
                word(f.hostname.clone()),
                word(f.cpu.clone()),
                num(f.cores.to_string()),
                num(format!("{:.1}", f.memory_bytes as f64 / (1u64 << 30) as f64)),
                word(gpus(&f.gpus)),
                word(f.kernel.clone()),
            ])
        })
        .collect();
    Some(Grid { title: "Hosts".into(), caption: String::new(), head, rows })
}
