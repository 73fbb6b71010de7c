//! Readings that rank modes: the fastest at each worker count, the first to the target, the
//! scaling efficiency, the ring against the parameter server, ZeRO-1 against DDP, each
//! compressed mode against the mode it compresses. Medians are compared, modes whose repeats'
//! ranges overlap are level, and a cell that ran once, or whose run saturated the CPU, is
//! listed, never ranked.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::context::Context;
use crate::charts::Group;
use crate::cost;
use crate::results::{Summary, overlap};
use crate::scenario::ModeKind;

/// The rows `keep` selects, split into those a ranking may use (repeated, the CPU not
/// saturated), those that ran once, and those that saturated the CPU; each sorted by `key`
/// (ascending, ties by id).
struct Split<'a> {
    ranked: Vec<&'a Summary>,
    once: Vec<&'a Summary>,
    crowded: Vec<&'a Summary>,
}

fn split_at<'a>(
    cx: &Context<'_, 'a>,
    keep: impl Fn(&Summary) -> bool,
    key: impl Fn(&Summary) -> f64,
) -> Split<'a> {
    let (mut crowded, rest): (Vec<&Summary>, Vec<&Summary>) =
        cx.g.rows.iter().copied().filter(|r| keep(r)).partition(|r| cx.cpu_saturated(r));
    let (mut ranked, mut once): (Vec<&Summary>, Vec<&Summary>) =
        rest.into_iter().partition(|r| cx.repeated(r));
    for v in [&mut ranked, &mut once, &mut crowded] {
        v.sort_by(|a, b| key(a).total_cmp(&key(b)).then_with(|| a.id.cmp(&b.id)));
    }
    Split { ranked, once, crowded }
}

impl Split<'_> {
    /// What is listed beside a ranking and not ranked, each with its `figure` (which says its
    /// own unit and spread): the cells that ran once, and those that saturated the CPU.
    fn aside(&self, cx: &Context, figure: &dyn Fn(&Summary) -> String) -> String {
        let list = |rs: &[&Summary]| {
            rs.iter().map(|r| format!("{} {}", Group::series(r), figure(r))).collect::<Vec<_>>().join("; ")
        };
        let mut out = String::new();
        if !self.once.is_empty() {
            let _ = write!(out, " Ran once, not ranked: {}.", list(&self.once));
        }
        if !self.crowded.is_empty() {
            let _ = write!(out, " Not ranked, since they {}: {}.", cx.saturated(), list(&self.crowded));
        }
        out
    }
}

/// The fastest mode at each worker count, by median throughput; level when the repeats'
/// ranges overlap.
pub fn fastest(cx: &Context) -> Vec<String> {
    let mut out = Vec::new();
    for &n in &cx.workers {
        let split = split_at(cx, |r| r.workers == n, |r| -Context::thr(r));
        let (at, once) = (&split.ranked, &split.once);
        let s = if n == 1 { "" } else { "s" };
        let thr = |r: &Summary| format!("{:.0} samples/s ({})", Context::thr(r), cx.spread(r));
        let Some(best) = at.first().filter(|_| at.len() > 1 || once.is_empty()) else {
            let all: Vec<&Summary> = at.iter().chain(once).copied().collect();
            if !all.is_empty() {
                let crowded = Split { once: Vec::new(), ..split };
                out.push(format!(
                    "At {n} worker{s}, in samples/s: {}. {}{}",
                    cx.listed(&all),
                    cx.unranked(),
                    crowded.aside(cx, &thr)
                ));
            } else if !split.crowded.is_empty() {
                out.push(format!("At {n} worker{s} nothing is ranked.{}", split.aside(cx, &thr)));
            }
            continue;
        };
        let aside = split.aside(cx, &thr);
        if at.len() == 1 {
            // One mode left to read: nothing to rank it against.
            let how = if split.crowded.is_empty() { "ran" } else { "is read" };
            out.push(format!("At {n} worker{s} only {} {how}: {}.{aside}", Group::series(best), thr(best)));
            continue;
        }
        match at.get(1) {
            Some(next) if cx.level(best, next) => {
                let level: Vec<String> = at
                    .iter()
                    .take_while(|r| cx.level(best, r))
                    .map(|r| format!("{} {:.0} ({})", Group::series(r), Context::thr(r), cx.spread(r)))
                    .collect();
                out.push(format!(
                    "At {n} worker{s} the fastest are level, their repeats' ranges overlapping: {} samples/s.{aside}",
                    level.join("; ")
                ));
            }
            next => out.push(format!(
                "At {n} worker{s}: {} is fastest with {:.0} samples/s ({}){}.{aside}",
                Group::series(best),
                Context::thr(best),
                cx.spread(best),
                next.map(|x| format!(
                    ", {:.2}x the next ({}, {:.0} samples/s, {})",
                    Context::thr(best) / Context::thr(x).max(1e-9),
                    Group::series(x),
                    Context::thr(x),
                    cx.spread(x)
                ))
                .unwrap_or_default()
            )),
        }
    }
    out
}

/// Why the first to the target beats the runner-up: throughput against samples needed.
pub fn factors(best: &Summary, next: &Summary) -> (f64, f64, &'static str) {
    // Within 2% a factor is a tie, not a reason.
    let tie = |x: f64| (x - 1.0).abs() < 0.02;
    let speed = Context::thr(best) / Context::thr(next).max(1e-9);
    let samples =
        next.samples_to_target.unwrap_or(0) as f64 / best.samples_to_target.unwrap_or(1).max(1) as f64;
    let why = match (speed >= 1.0, samples >= 1.0) {
        _ if tie(samples) && !tie(speed) => "the same samples needed, so throughput alone decides",
        _ if tie(speed) && !tie(samples) => "the same throughput, so convergence per sample alone decides",
        _ if tie(speed) && tie(samples) => "neither factor separates them",
        (true, true) if speed >= samples => "both favour it, throughput the more",
        (true, true) => "both favour it, convergence per sample the more",
        (true, false) => "its throughput outweighs the runner-up's better convergence per sample",
        (false, true) => "its convergence per sample outweighs the runner-up's higher throughput",
        (false, false) => "neither favours it alone; the two measurements disagree",
    };
    (speed, samples, why)
}

/// Time to accuracy at each worker count above one: what the user gets, throughput times
/// statistical efficiency.
pub fn first_to_target(cx: &Context) -> Vec<String> {
    let Some(target) = cx.g.target else { return Vec::new() };
    let tt = |r: &Summary| r.time_to_target_s.unwrap_or(f64::NAN);
    let times = |rs: &[&Summary]| cx.listed_by(rs, &|r| format!("{:.2} s", tt(r)));
    let mut out = Vec::new();
    for &n in cx.workers.iter().filter(|&&n| n > 1) {
        let split = split_at(
            cx,
            |r| r.workers == n && r.time_to_target_s.is_some(),
            |r| r.time_to_target_s.unwrap_or(f64::MAX),
        );
        let (at, once) = (&split.ranked, &split.once);
        let crowded = Split { once: Vec::new(), ranked: Vec::new(), crowded: split.crowded.clone() }
            .aside(cx, &|r| format!("{:.2} s", tt(r)));
        let missed: Vec<String> =
            cx.g.rows
                .iter()
                .filter(|r| r.workers == n && r.time_to_target_s.is_none())
                .map(|r| Group::series(r))
                .collect();
        if at.is_empty() && once.is_empty() {
            out.push(if split.crowded.is_empty() {
                format!(
                    "At {n} workers no mode reached {:.1}% held-out accuracy in most of its repeats.",
                    100.0 * target
                )
            } else {
                format!("At {n} workers nothing is ranked by time to {:.1}%.{crowded}", 100.0 * target)
            });
            continue;
        }
        let Some(best) = at.first().filter(|_| at.len() > 1 || once.is_empty()) else {
            let all: Vec<&Summary> = at.iter().chain(once).copied().collect();
            let mut line = format!(
                "At {n} workers, time to {:.1}% held-out accuracy: {}. {}{crowded}",
                100.0 * target,
                times(&all),
                cx.unranked()
            );
            if !missed.is_empty() {
                let _ = write!(line, " Not reached: {}.", missed.join(", "));
            }
            out.push(line);
            continue;
        };
        let tt_range = |r: &Summary| cx.g.cell_of(r).and_then(|c| c.time_to_target);
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
            let (speed, samples, why) = factors(best, next);
            let _ = write!(
                line,
                "; {} follows in {:.2} s{}. Its throughput is {speed:.2}x and its statistical efficiency \
                 {samples:.2}x the runner-up's (samples needed: {} against {}): {why}",
                Group::series(next),
                tt(next),
                if level { ", level with it (their repeats' ranges overlap)" } else { "" },
                best.samples_to_target.unwrap_or(0),
                next.samples_to_target.unwrap_or(0),
            );
        }
        line.push('.');
        if !once.is_empty() {
            let _ = write!(line, " Ran once, not ranked: {}.", times(once));
        }
        line.push_str(&crowded);
        if !missed.is_empty() {
            let _ = write!(line, " Not reached in most repeats: {}.", missed.join(", "));
        }
        out.push(line);
    }
    out
}

/// Scaling efficiency at the most workers: throughput over n times one worker's.
pub fn scaling(cx: &Context) -> Vec<String> {
    let (Some(b), Some(nmax)) = (cx.g.baseline(), cx.most_workers()) else { return Vec::new() };
    if nmax < 2 {
        return Vec::new();
    }
    let at: Vec<&Summary> = cx.g.rows.iter().copied().filter(|r| r.workers == nmax).collect();
    let crowded: Vec<String> = at.iter().filter(|r| cx.cpu_saturated(r)).map(|r| Group::series(r)).collect();
    let effs: Vec<(String, f64)> = at
        .iter()
        .filter(|r| !cx.cpu_saturated(r))
        .map(|r| (Group::series(r), Context::thr(r) / (nmax as f64 * b)))
        .collect();
    let left_out = if crowded.is_empty() {
        String::new()
    } else {
        format!(" Left out, since they {}: {}.", cx.saturated(), crowded.join(", "))
    };
    let (Some(hi), Some(lo)) =
        (effs.iter().max_by(|a, b| a.1.total_cmp(&b.1)), effs.iter().min_by(|a, b| a.1.total_cmp(&b.1)))
    else {
        return if crowded.is_empty() {
            Vec::new()
        } else {
            vec![format!("Scaling efficiency at {nmax} workers is not read.{left_out}")]
        };
    };
    vec![format!(
        "Scaling efficiency at {nmax} workers (throughput / ({nmax} x one worker's {b:.0} samples/s)) ranges \
         from {:.0}% ({}) to {:.0}% ({}).{left_out}",
        100.0 * lo.1,
        lo.0,
        100.0 * hi.1,
        hi.0
    )]
}

/// Ring all-reduce over TCP against the best uncompressed synchronous parameter server,
/// worker count by worker count (a compressed PS is read against ps-bsp itself).
pub fn ring_against_ps(cx: &Context) -> Vec<String> {
    let g = cx.g;
    let ring: BTreeMap<usize, f64> = g
        .rows
        .iter()
        .filter(|r| r.mode == ModeKind::DdpTcp.label())
        .filter_map(|r| Some((r.workers, r.samples_per_s?)))
        .collect();
    let mut ps_best: BTreeMap<usize, (f64, String)> = BTreeMap::new();
    for r in g.rows.iter().filter(|r| r.mode == ModeKind::PsBsp.label()) {
        let e = ps_best.entry(r.workers).or_insert((0.0, String::new()));
        if Context::thr(r) > e.0 {
            *e = (Context::thr(r), Group::series(r));
        }
    }
    let both: Vec<(usize, f64, f64, String)> = ring
        .iter()
        .filter(|(n, _)| **n > 1)
        .filter_map(|(&n, &rt)| ps_best.get(&n).map(|(pt, name)| (n, rt, *pt, name.clone())))
        .collect();
    if both.is_empty() {
        return Vec::new();
    }
    // The cells the ratios come from: the ring's, and the best parameter server's; a worker
    // count where either saturated the CPU is shown and not read.
    let involved = |r: &Summary| {
        both.iter().any(|b| b.0 == r.workers)
            && (r.mode == ModeKind::DdpTcp.label()
                || (r.mode == ModeKind::PsBsp.label() && Group::series(r) == ps_best[&r.workers].1))
    };
    let crowded = |n: usize| g.rows.iter().any(|r| r.workers == n && involved(r) && cx.cpu_saturated(r));
    let parts: Vec<String> = both
        .iter()
        .map(|(n, rt, pt, name)| {
            format!(
                "{n} workers: ring/PS = {:.2} (vs {name}){}",
                rt / pt.max(1e-9),
                if crowded(*n) { ", not read: a cell saturated the CPU" } else { "" }
            )
        })
        .collect();
    let once = g.rows.iter().any(|r| involved(r) && !cx.repeated(r));
    let both: Vec<(usize, f64, f64, String)> = both.iter().filter(|b| !crowded(b.0)).cloned().collect();
    let ahead = both.iter().position(|b| b.1 > b.2).filter(|&i| both[i..].iter().all(|b| b.1 > b.2));
    // The finding first, then the figures it is read from.
    vec![format!(
        "{} Ring all-reduce over TCP sockets (ddp-tcp) against the best synchronous parameter server (gRPC \
         over TCP, the same wire), by median throughput: {}.",
        match ahead {
            _ if both.is_empty() => format!("Not ranked: at every worker count a cell {}.", cx.saturated()),
            _ if once => cx.unranked().to_string(),
            Some(0) => format!(
                "The ring is ahead at every worker count {}, from {} on.",
                if both.len() < parts.len() { "read" } else { "measured" },
                both[0].0
            ),
            Some(i) => format!("The ring pulls ahead at {} workers and stays ahead.", both[i].0),
            None if both.iter().all(|b| b.2 >= b.1) => format!(
                "The parameter server is ahead at every worker count {}.",
                if both.len() < parts.len() { "read" } else { "measured" }
            ),
            None => "Neither stays ahead over the whole range.".into(),
        },
        parts.join("; "),
    )]
}

/// ZeRO-1 against DDP over the same TCP sockets, at each worker count both ran: the step time
/// as a ratio, and where the difference comes from (the exposed communication: ZeRO-1's
/// all-gather cannot hide behind backward; the update: ZeRO-1's touches 1/n of the state,
/// [`cost::update_bytes`]). Level when the repeats' throughput ranges overlap.
pub fn zero1_against_ddp(cx: &Context) -> Vec<String> {
    let g = cx.g;
    let mut out = Vec::new();
    let s = g.grad_bytes();
    for &n in cx.workers.iter().filter(|&&n| n > 1) {
        let find = |m: &str| g.rows.iter().copied().find(|r| r.workers == n && r.mode == m && r.slow_ms == 0);
        let (Some(z), Some(d)) = (find("zero1-tcp"), find("ddp-tcp")) else { continue };
        let (Some(zt), Some(dt)) = (z.step_ms, d.step_ms) else { continue };
        let crowded = format!("not ranked (a run {})", cx.saturated());
        let verdict = match () {
            _ if cx.cpu_saturated(z) || cx.cpu_saturated(d) => crowded.as_str(),
            _ if !cx.repeated(z) || !cx.repeated(d) => "not ranked (one run: no spread to compare)",
            _ if cx.level(z, d) => "level with DDP (the repeats' ranges overlap)",
            _ if zt < dt => "faster than DDP",
            _ => "slower than DDP",
        };
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        out.push(format!(
            "ZeRO-1 at {n} workers: {zt:.1} ms per step against DDP over TCP's {dt:.1} ms ({:.2}x), {verdict}. \
             Exposed communication {} ms against {} ms (its all-gather waits for the update); update {} ms \
             against {} ms (memory traffic {:.1} MB against {:.1} MB: 5S/n against 5S).",
            zt / dt,
            ms(z.comm_exposed_ms),
            ms(d.comm_exposed_ms),
            ms(z.update_ms),
            ms(d.update_ms),
            cost::update_bytes(n, s) / 1e6,
            cost::update_bytes(1, s) / 1e6,
        ));
    }
    out
}

/// Each compressed mode against the mode it compresses, at the same workers and shards: bytes
/// sent per step per worker (a PS worker's pushes; a DDP rank's share of the collective), the
/// median final held-out accuracy, and the time to the target.
pub fn compressed_against_base(cx: &Context) -> Vec<String> {
    let g = cx.g;
    let mut out = Vec::new();
    for c in g.rows.iter().filter(|r| r.slow_ms == 0) {
        let Ok(kind) = c.mode.parse::<ModeKind>() else { continue };
        if !kind.is_compressed() {
            continue;
        }
        let base = kind.base().label();
        let Some(b) = g
            .rows
            .iter()
            .find(|r| r.mode == base && r.workers == c.workers && r.shards == c.shards && r.slow_ms == 0)
        else {
            continue;
        };
        let mb = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.3}", v / 1e6));
        let fall = match (c.bytes_sent_per_step_worker, b.bytes_sent_per_step_worker) {
            (Some(x), Some(y)) if x > 0.0 => format!("{:.1}x fewer", y / x),
            _ => "-".into(),
        };
        let acc = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v));
        let points = match (c.final_accuracy, b.final_accuracy) {
            (Some(x), Some(y)) => format!("{:+.1} points", 100.0 * (x - y)),
            _ => "-".into(),
        };
        // Time to the target only where the scenario set one (runs without evaluation have
        // none to reach).
        let tt = |v: Option<f64>| v.map_or("not reached".to_string(), |v| format!("{v:.1} s"));
        let time = match g.target {
            Some(t) => format!(
                "; time to {:.0}% {} against {}",
                100.0 * t,
                tt(c.time_to_target_s),
                tt(b.time_to_target_s)
            ),
            None => String::new(),
        };
        out.push(format!(
            "{} at {} workers sends {} MB per step per worker against {}'s {} ({fall}); final held-out accuracy \
             {} against {} ({points}){time}.",
            c.mode,
            c.workers,
            mb(c.bytes_sent_per_step_worker),
            base,
            mb(b.bytes_sent_per_step_worker),
            acc(c.final_accuracy),
            acc(b.final_accuracy),
        ));
    }
    out
}
