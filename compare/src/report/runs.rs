//! Readings of how the runs went: where the step time goes (exposed communication, or fixed
//! per-step costs that leave compute a small share), staleness, accuracy against local
//! training, contention for the cores, the straggler sweep, and the runs that failed,
//! diverged, stopped early or were skipped (listed, never read as a speed).

use std::collections::BTreeMap;

use gradsync_worker::modes::ServerSync;

use super::context::{Context, UNRANKED};
use crate::charts::Group;
use crate::results::Summary;
use crate::scenario::ModeKind;

/// The synchronisation of the servers of the mode named `mode`, if it runs any.
fn servers_sync(mode: &str) -> Option<ServerSync> {
    mode.parse::<ModeKind>().ok()?.compared().servers.map(|s| s.sync)
}

/// Whether the mode named `mode` applies gradients as they arrive (its servers' ASP or SSP).
fn is_async(mode: &str) -> bool {
    mode.parse::<ModeKind>().is_ok_and(ModeKind::is_async)
}

/// Below this share of the step spent computing, fixed per-step costs decide the speed.
const COMPUTE_SMALL: f64 = 0.25;

/// Said when no run produced metrics.
pub fn no_runs(cx: &Context) -> Vec<String> {
    if cx.g.rows.is_empty() {
        vec!["No run produced metrics, so there is nothing to compare; the table below says why each run failed.".into()]
    } else {
        Vec::new()
    }
}

/// At the most workers, the mode that spends the largest share of its step on exposed
/// communication and waiting.
pub fn exposed_share(cx: &Context) -> Vec<String> {
    let Some(nmax) = cx.most_workers() else { return Vec::new() };
    let shares: Vec<(String, f64, f64)> =
        cx.g.rows
            .iter()
            .filter(|r| r.workers == nmax)
            .filter_map(|r| {
                let t = r.step_ms?;
                let c = r.comm_exposed_ms.unwrap_or(0.0) + r.wait_ms.unwrap_or(0.0);
                (t > 0.0).then(|| (Group::series(r), c / t, t))
            })
            .collect();
    match shares.iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
        Some(w) if w.1 > 0.0 => vec![format!(
            "At {nmax} workers, {} spends the largest share of its step ({:.0}% of {:.1} ms) on exposed \
             communication and waiting.",
            w.0,
            100.0 * w.1,
            w.2
        )],
        _ => Vec::new(),
    }
}

/// A row's compute per step (forward, backward and update, measured), ms.
fn compute_ms(r: &Summary) -> Option<f64> {
    Some(r.forward_ms? + r.backward_ms? + r.update_ms.unwrap_or(0.0))
}

/// Where the fastest mode at the most workers computes for a small share of its step and most
/// of the rest is neither exposed communication nor waiting, fixed per-step costs (host
/// staging, process switches, RPCs) decide the speed, not the arithmetic or the bandwidth: said
/// with the figures, beside the one-worker baseline. A step that exposed communication fills
/// is left to the readings of communication.
pub fn fixed_costs(cx: &Context) -> Vec<String> {
    let Some(nmax) = cx.most_workers().filter(|&n| n > 1) else { return Vec::new() };
    let at: Vec<(&Summary, f64, f64)> =
        cx.g.rows
            .iter()
            .copied()
            .filter(|r| r.workers == nmax)
            .filter_map(|r| Some((r, compute_ms(r)?, r.step_ms.filter(|&t| t > 0.0)?)))
            .collect();
    let Some(&(best, c, t)) = at.iter().max_by(|a, b| Context::thr(a.0).total_cmp(&Context::thr(b.0))) else {
        return Vec::new();
    };
    let comm = best.comm_exposed_ms.unwrap_or(0.0) + best.wait_ms.unwrap_or(0.0);
    if c / t >= COMPUTE_SMALL || (t - c - comm) / t < 0.5 {
        return Vec::new();
    }
    let all_small = at.iter().all(|x| x.1 / x.2 < COMPUTE_SMALL);
    let base = match cx.g.baseline() {
        Some(b) if b > 0.0 => format!(
            " One worker alone runs {b:.0} samples/s against {:.0} here ({:.0}% scaling efficiency).",
            Context::thr(best),
            100.0 * Context::thr(best) / (nmax as f64 * b)
        ),
        _ => String::new(),
    };
    vec![format!(
        "Fixed per-step costs decide the speed here: at {nmax} workers the fastest mode, {}, computes \
         (forward, backward and update, measured) for {c:.2} ms of its {t:.2} ms step ({:.0}%){}.{base} The rest \
         of the step is host staging, process switches, RPCs and waiting, costs that do not shrink with the \
         model, so a larger model or batch per step, not a faster wire, is what would change the ranking.",
        Group::series(best),
        100.0 * c / t,
        if all_small {
            ", and every other mode computes for less than a quarter of its step too"
        } else {
            ""
        },
    )]
}

/// Staleness of the asynchronous modes at the most workers.
pub fn staleness(cx: &Context) -> Vec<String> {
    let stale: Vec<String> =
        cx.g.rows
            .iter()
            .filter(|r| r.staleness_mean.is_some() && is_async(&r.mode))
            .filter(|r| Some(r.workers) == cx.most_workers())
            .map(|r| {
                format!(
                    "{} at {} workers: mean {:.2}, max {}{}",
                    Group::series(r),
                    r.workers,
                    r.staleness_mean.unwrap_or(0.0),
                    r.staleness_max.unwrap_or(0),
                    overlap_said(cx, r)
                )
            })
            .collect();
    if stale.is_empty() {
        return Vec::new();
    }
    let overlaps = cx.g.rows.iter().any(|r| r.push_overlap.is_some() && is_async(&r.mode));
    vec![format!(
        "Staleness of applied gradients: {}. Staleness counts the server's versions between a worker's pull \
         and the update with its gradient, and every worker's gradient makes a version under ASP and SSP: \
         with n workers it can pass the SSP bound, which limits how many of its own steps a worker runs \
         ahead of the slowest, not how many updates others make meanwhile.{}",
        stale.join("; "),
        if overlaps { PHASES } else { "" }
    )]
}

/// An asynchronous cell's push overlap in words: the one phase its repeats agree on, or each
/// repeat's where they fell into different phases (a median would name a phase no run was in).
fn overlap_said(cx: &Context, r: &Summary) -> String {
    let Some(median) = r.push_overlap else { return String::new() };
    let each: Vec<f64> = cx
        .g
        .cell_of(r)
        .map(|c| c.runs.iter().filter_map(|id| cx.all.iter().find(|s| &s.id == id)?.push_overlap).collect())
        .unwrap_or_default();
    let phases: Vec<&str> = each.iter().map(|&o| phase(o)).collect();
    if phases.windows(2).any(|w| w[0] != w[1]) {
        let listed: Vec<String> = each.iter().map(|o| format!("{:.0}%", o * 100.0)).collect();
        return format!(
            ", its repeats' pushes arriving at a server beside another rank's {} of the time: they found \
             different phases, so its median step is no one phase's",
            listed.join(", ")
        );
    }
    format!(
        ", its pushes arriving at a server beside another rank's {:.0}% of the time ({})",
        median * 100.0,
        phase(median)
    )
}

/// What an asynchronous run's push overlap says of its workers' phase.
fn phase(overlap: f64) -> &'static str {
    if overlap >= 0.75 {
        "in phase: each push shared the server's link"
    } else if overlap <= 0.25 {
        "taking turns: one pushing while another pulled"
    } else {
        "between the two phases"
    }
}

/// Why an asynchronous run's push overlap is worth reading beside its step.
const PHASES: &str = " Asynchronous workers fall into a phase and tend to stay in it: pushing together, each push \
     gets a share of the server's link, and a step whose time is mostly communication takes up to n times as long \
     as when they take turns. Which phase a run finds is timing (their start, the noise of the hosts), not the \
     design; a repeat may find the other.";

/// Final held-out accuracy against local training: same initial parameters, data and global
/// batch, so a difference comes from the mode (asynchrony, reduction order).
pub fn accuracy_against_local(cx: &Context) -> Vec<String> {
    let g = cx.g;
    let Some(la) = g.rows.iter().find(|r| r.mode == "local").and_then(|r| r.final_accuracy) else {
        return Vec::new();
    };
    let dev = |sync: bool| -> Option<(f64, String)> {
        g.rows
            .iter()
            .filter(|r| r.mode != "local" && is_async(&r.mode) != sync)
            .filter_map(|r| {
                Some(((r.final_accuracy? - la).abs(), format!("{} w{}", Group::series(r), r.workers)))
            })
            .max_by(|a, b| a.0.total_cmp(&b.0))
    };
    let mut parts =
        vec![format!("Final held-out accuracy of local training (median of repeats): {:.2}%", 100.0 * la)];
    if let Some((d, who)) = dev(true) {
        parts.push(format!("synchronous modes end within {:.2} points of it (largest: {who})", 100.0 * d));
    }
    if let Some((d, who)) = dev(false) {
        parts.push(format!("asynchronous ones within {:.2} points (largest: {who})", 100.0 * d));
    }
    vec![parts.join("; ") + "."]
}

/// Contention: every process shares this machine's cores. Not said of a dilated group: its
/// runs had the cores' time dilated away (the dilation's own reading says how, and a run whose
/// cores could not keep up is not ranked).
pub fn contention(cx: &Context) -> Vec<String> {
    if !cx.g.rows.is_empty() && cx.g.rows.iter().all(|r| r.dilation.is_some()) {
        return Vec::new();
    }
    match (cx.machine, cx.most_workers()) {
        // On several hosts no one machine's cores are shared by every process.
        (Some(m), Some(nmax)) if m.hosts.is_empty() && nmax > m.cores => vec![format!(
            "All processes share one machine with {} logical cores, and up to {nmax} workers ran at once (plus \
             servers): beyond {} workers compute time grows with contention, so throughput there measures the CPU \
             as much as the network.",
            m.cores, m.cores
        )],
        _ => Vec::new(),
    }
}

/// The straggler sweep ([`straggler_reading`]).
pub fn straggler(cx: &Context) -> Vec<String> {
    sweep(cx.g, cx.unranked())
}

/// The runs whose workers were restarted after failures (`max_restarts`): per run, each
/// restart's failed rank and exit, the step it had reached, the checkpoint resumed from, and
/// what it cost: the wall time from the failure to the restarted rank 0's first step, and the
/// steps computed again. A run whose restarts ran out is failed, listed with the failures.
pub fn restarts(cx: &Context) -> Vec<String> {
    let runs: Vec<&Summary> = cx.all.iter().filter(|r| !r.restarts.is_empty()).collect();
    if runs.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for r in runs {
        let each: Vec<String> = r.restarts.iter().map(restart_text).collect();
        let lost: f64 = r.restarts.iter().filter_map(|x| x.lost_s).sum();
        let again: u64 = r.restarts.iter().filter_map(|x| x.recomputed()).sum();
        let ended = if r.status == "ok" { "finished" } else { r.status.as_str() };
        out.push(format!(
            "{} restarted its workers {} time{} and {ended}: {}. In all {lost:.2} s from failure to first new \
             step and {again} step{} computed again. Its figures are read from the steps that count (a step \
             computed again replaces the one lost), its samples/s over a wall time that includes the restarts.",
            r.id,
            r.restarts.len(),
            if r.restarts.len() == 1 { "" } else { "s" },
            each.join("; "),
            if again == 1 { "" } else { "s" },
        ));
    }
    out
}

/// One restart, in words: `rank 1 (killed by the runner, signal: 9 (SIGKILL)) at step 14,
/// resumed after step 10: 0.84 s, 4 steps again`.
pub fn restart_text(x: &crate::results::Restart) -> String {
    let how = if x.injected { format!("killed by the runner, {}", x.exit) } else { x.exit.clone() };
    let cost = match (x.resumed_after, x.lost_s) {
        (Some(c), Some(s)) => format!(
            ", resumed after step {c}: {s:.2} s, {} step{} again",
            x.step_reached.saturating_sub(c),
            if x.step_reached.saturating_sub(c) == 1 { "" } else { "s" }
        ),
        _ => ", no step recorded after it".to_string(),
    };
    format!("rank {} ({how}) at step {}{cost}", x.rank, x.step_reached)
}

/// The runs that failed: how many per mode, and the first error.
pub fn failures(cx: &Context) -> Vec<String> {
    let failed: Vec<&Summary> = cx.all.iter().filter(|r| r.status == "failed").collect();
    let Some(first) = failed.first() else { return Vec::new() };
    let mut by_mode: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &failed {
        *by_mode.entry(f.mode.as_str()).or_insert(0) += 1;
    }
    vec![format!(
        "{} run{} failed ({}); first error: {}",
        failed.len(),
        if failed.len() == 1 { "" } else { "s" },
        by_mode.iter().map(|(m, n)| format!("{m}: {n}")).collect::<Vec<_>>().join(", "),
        first.error.chars().take(200).collect::<String>()
    )]
}

/// The runs that diverged: which, at which step, and the fix the error names.
pub fn diverged(cx: &Context) -> Vec<String> {
    let diverged: Vec<&Summary> = cx.all.iter().filter(|r| r.status == "diverged").collect();
    if diverged.is_empty() {
        return Vec::new();
    }
    let which: Vec<String> = diverged
        .iter()
        .map(|r| {
            let at = r.error.split("diverged at step ").nth(1).and_then(|t| t.split(':').next());
            format!("{} w{}{}", r.mode, r.workers, at.map(|s| format!(" at step {s}")).unwrap_or_default())
        })
        .collect();
    vec![format!(
        "{} run{} diverged ({}): listed apart in the table below, never read as a speed. {}",
        diverged.len(),
        if diverged.len() == 1 { "" } else { "s" },
        which.join(", "),
        diverged.iter().find_map(|r| r.error.split_once("; ").map(|(_, fix)| fix)).unwrap_or_default()
    )]
}

/// The runs that did not run to their end.
pub fn partial(cx: &Context) -> Vec<String> {
    let n =
        cx.all.iter().filter(|r| matches!(r.status.as_str(), "interrupted" | "stopped" | "partial")).count();
    if n == 0 {
        return Vec::new();
    }
    vec![format!(
        "{n} run(s) did not run to their end (interrupted, stopped by the time budget, or without a \
         record): listed apart, they feed no figure and no reading."
    )]
}

/// The runs skipped, each with its reason in the table.
pub fn skipped(cx: &Context) -> Vec<String> {
    let n = cx.all.iter().filter(|r| r.status == "skipped").count();
    if n == 0 {
        return Vec::new();
    }
    vec![format!("{n} run(s) were skipped; the table below gives each reason.")]
}

/// What the straggler sweep says: per series, at its largest delay, the slowdown and the share
/// of the injected delay the whole job pays per global step, against what the mode's
/// synchronisation predicts (synchronous modes pay all of it; ASP at most W/(W-1) of the
/// undelayed step; SSP all of it once the fast ranks reach the staleness bound).
pub fn straggler_reading(g: &Group) -> Vec<String> {
    sweep(g, UNRANKED)
}

/// [`straggler_reading`], saying `unranked` where the modes ran once.
fn sweep(g: &Group, unranked: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut paid: Vec<(String, f64)> = Vec::new();
    let mut once = Vec::new();
    for s in g.slowdowns() {
        if !s.repeated {
            once.push(s.name.clone());
        }
        let (name, mode, w) = (s.name, s.mode, s.workers);
        let (Some(&(d, slow)), Some(t0)) = (s.points.last(), g.undelayed_step_s(mode, w, s.shards)) else {
            continue;
        };
        if d <= 0.0 {
            continue;
        }
        let extra_ms = (slow - 1.0) * t0 * 1e3;
        let share = extra_ms / d;
        let expect = match servers_sync(mode) {
            Some(ServerSync::Asp) => format!(
                "asynchronous: the other ranks go on, so the slowdown is bounded by W/(W-1) = {:.2}x",
                w as f64 / (w as f64 - 1.0).max(1.0)
            ),
            Some(ServerSync::Ssp) => {
                "stale-synchronous: the fast ranks run ahead up to the bound, then wait".into()
            }
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
    if paid.len() > 1 && !once.is_empty() {
        out.push(format!("Which mode absorbs the straggler best: {unranked} Ran once: {}.", once.join(", ")));
    } else if paid.len() > 1 {
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
