//! The reading: what the figures say, sentence by sentence, computed from them: which mode is
//! fastest and reaches the target first at each worker count (level when the repeats' ranges
//! overlap; not ranked at all where a cell ran once, since one run has no spread to compare),
//! what the cost model predicts, and what the straggler sweep shows.

use super::*;

/// What a reading says instead of a ranking where a cell ran once.
const UNRANKED: &str = "Not ranked: a cell measured once has no spread to set a difference against (run \
     each cell two or more times, `repeats` in the scenario or `--repeats`).";

/// Whether `r`'s cell has two or more complete repeats: what a ranking needs.
fn repeated(g: &Group, r: &Summary) -> bool {
    g.cell_of(r).is_some_and(|c| c.runs.len() > 1)
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
    // Cells listed with a figure each and their spread, for readings that do not rank them.
    let listed_by = |rs: &[&Summary], figure: &dyn Fn(&Summary) -> String| -> String {
        rs.iter()
            .map(|r| format!("{} {} ({})", Group::series(r), figure(r), spread(r)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let listed = |rs: &[&Summary]| listed_by(rs, &|r| format!("{:.0}", thr(&r)));
    for &n in &ws {
        // Only cells with repeats are ranked; those that ran once are listed beside them.
        let (mut at, mut once): (Vec<&Summary>, Vec<&Summary>) =
            g.rows.iter().copied().filter(|r| r.workers == n).partition(|r| repeated(g, r));
        for v in [&mut at, &mut once] {
            v.sort_by(|a, b| thr(b).total_cmp(&thr(a)).then_with(|| a.id.cmp(&b.id)));
        }
        let s = if n == 1 { "" } else { "s" };
        let Some(best) = at.first().filter(|_| at.len() > 1 || once.is_empty()) else {
            if !once.is_empty() || !at.is_empty() {
                let all: Vec<&Summary> = at.iter().chain(&once).copied().collect();
                out.push(format!("At {n} worker{s}, in samples/s: {}. {UNRANKED}", listed(&all)));
            }
            continue;
        };
        let aside = if once.is_empty() {
            String::new()
        } else {
            format!(" Ran once, not ranked: {} samples/s.", listed(&once))
        };
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
                    "At {n} worker{s} the fastest are level, their repeats' ranges overlapping: {} samples/s.{aside}",
                    level.join("; ")
                ));
            }
            next => out.push(format!(
                "At {n} worker{s}: {} is fastest with {:.0} samples/s ({}){}.{aside}",
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
            let (mut at, mut once): (Vec<&Summary>, Vec<&Summary>) = g
                .rows
                .iter()
                .copied()
                .filter(|r| r.workers == n && r.time_to_target_s.is_some())
                .partition(|r| repeated(g, r));
            for v in [&mut at, &mut once] {
                v.sort_by(|a, b| {
                    a.time_to_target_s.unwrap_or(f64::MAX).total_cmp(&b.time_to_target_s.unwrap_or(f64::MAX))
                });
            }
            let missed: Vec<String> = g
                .rows
                .iter()
                .filter(|r| r.workers == n && r.time_to_target_s.is_none())
                .map(|r| Group::series(r))
                .collect();
            let tt = |r: &Summary| r.time_to_target_s.unwrap_or(f64::NAN);
            let tt_range = |r: &Summary| g.cell_of(r).and_then(|c| c.time_to_target);
            let times = |rs: &[&Summary]| listed_by(rs, &|r| format!("{:.2} s", tt(r)));
            if at.is_empty() && once.is_empty() {
                out.push(format!(
                    "At {n} workers no mode reached {:.1}% held-out accuracy in most of its repeats.",
                    100.0 * target
                ));
                continue;
            }
            let Some(best) = at.first().filter(|_| at.len() > 1 || once.is_empty()) else {
                let all: Vec<&Summary> = at.iter().chain(&once).copied().collect();
                let mut line = format!(
                    "At {n} workers, time to {:.1}% held-out accuracy: {}. {UNRANKED}",
                    100.0 * target,
                    times(&all)
                );
                if !missed.is_empty() {
                    let _ = write!(line, " Not reached: {}.", missed.join(", "));
                }
                out.push(line);
                continue;
            };
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
            if !once.is_empty() {
                let _ = write!(line, " Ran once, not ranked: {}.", times(&once));
            }
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
    // Uncompressed against uncompressed: a compressed PS is read against ps-bsp itself
    // (`compressed_against_base`), not set against the full-precision ring.
    for r in g.rows.iter().filter(|r| r.mode == ModeKind::PsBsp.label()) {
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
        // The cells the ratios come from: the ring's, and the best parameter server's.
        let involved = |r: &Summary| {
            both.iter().any(|b| b.0 == r.workers)
                && (r.mode == "ddp-tcp"
                    || (r.mode == ModeKind::PsBsp.label() && Group::series(r) == ps_best[&r.workers].1))
        };
        let once = g.rows.iter().any(|r| involved(r) && !repeated(g, r));
        out.push(format!(
            "Ring all-reduce over TCP sockets (ddp-tcp) against the best synchronous parameter server (gRPC over \
             TCP, the same wire), by median throughput: {}. {}",
            parts.join("; "),
            match ahead {
                _ if once => UNRANKED.to_string(),
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

    out.extend(zero1_against_ddp(g, &ws, thr_range, |r| repeated(g, r)));
    out.extend(compressed_against_base(g));

    // Measured communication against the model.
    if let Some(l) = link {
        let s = g.grad_bytes();
        for r in g
            .rows
            .iter()
            .filter(|r| r.workers > 1 && matches!(r.mode.as_str(), "ddp-tcp" | "ps-bsp" | "zero1-tcp"))
        {
            let Some(c) = r.comm_ms.filter(|&c| c > 0.0) else { continue };
            let model = match r.mode.as_str() {
                "ddp-tcp" => cost::ring(r.workers, s, l),
                "zero1-tcp" => cost::zero1(r.workers, s, l),
                _ => cost::ps(r.workers, r.shards, s, l),
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
        out.push(designs_reading(s, ten));
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
    if paid.len() > 1 && !once.is_empty() {
        out.push(format!("Which mode absorbs the straggler best: {UNRANKED} Ran once: {}.", once.join(", ")));
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

/// ZeRO-1 against DDP over the same TCP sockets, at each worker count both ran: the step time
/// as a ratio, and where the difference comes from (the exposed communication: ZeRO-1's
/// all-gather cannot hide behind backward; the update: ZeRO-1's touches 1/n of the state,
/// [`cost::update_bytes`]). Level when the repeats' throughput ranges overlap.
fn zero1_against_ddp(
    g: &Group,
    ws: &[usize],
    thr_range: impl Fn(&Summary) -> Option<(f64, f64)>,
    repeated: impl Fn(&Summary) -> bool,
) -> Vec<String> {
    let mut out = Vec::new();
    let s = g.grad_bytes();
    for &n in ws.iter().filter(|&&n| n > 1) {
        let find = |m: &str| g.rows.iter().copied().find(|r| r.workers == n && r.mode == m && r.slow_ms == 0);
        let (Some(z), Some(d)) = (find("zero1-tcp"), find("ddp-tcp")) else { continue };
        let (Some(zt), Some(dt)) = (z.step_ms, d.step_ms) else { continue };
        let verdict = match (thr_range(z), thr_range(d)) {
            _ if !repeated(z) || !repeated(d) => "not ranked (one run: no spread to compare)",
            (Some(a), Some(b)) if overlap(a, b) => "level with DDP (the repeats' ranges overlap)",
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
fn compressed_against_base(g: &Group) -> Vec<String> {
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
