//! The verdict the report opens with, in at most three sentences: which design to pick for
//! this model on this wire, where (worker count, link speed) the answer changes according to
//! the measurements and the cost model, and how sure it is. Modes whose repeats' ranges
//! overlap are level, never ranked; a cell that ran once, and a run whose processes
//! outnumbered the cores, decide nothing (failed, diverged and partial runs are no rows), each
//! cause counted apart.

use super::context::Context;
use gradsync_core::metrics::elapsed;

use crate::charts::{Group, workers};
use crate::cost::{self, Link};
use crate::machine::Machine;
use crate::results::{Summary, overlap};

/// How the modes stand at one worker count.
#[derive(Debug)]
pub enum Standing<'a> {
    /// One mode's range clears every other's: the mode, and the runner-up if any.
    Ahead(&'a Summary, Option<&'a Summary>),
    /// The leaders' ranges overlap.
    Level(Vec<&'a Summary>),
    /// Cells that could decide ran once.
    Once,
    /// Every run there had more processes than cores.
    Saturated,
    /// Nothing to compare (no run, or with a target none reached it).
    Nothing,
}

/// What a standing is judged by: time to the target where the group has one (lower is
/// better), else throughput.
pub fn figure(cx: &Context, r: &Summary) -> Option<f64> {
    match cx.g.target {
        Some(_) => r.time_to_target_s,
        None => r.samples_per_s.map(|t| -t),
    }
}

/// The range of [`figure`] over a row's repeats (same sign).
pub fn range(cx: &Context, r: &Summary) -> Option<(f64, f64)> {
    let c = cx.g.cell_of(r)?;
    match cx.g.target {
        Some(_) => c.time_to_target,
        None => c.throughput.map(|(lo, hi)| (-hi, -lo)),
    }
}

/// How the modes stand at `n` workers.
pub fn standing<'a>(cx: &Context<'_, 'a>, n: usize) -> Standing<'a> {
    let at: Vec<&Summary> = cx.g.rows.iter().copied().filter(|r| r.workers == n).collect();
    if at.is_empty() {
        return Standing::Nothing;
    }
    let fit: Vec<&Summary> = at.iter().copied().filter(|r| !cx.cpu_saturated(r)).collect();
    if fit.is_empty() {
        return Standing::Saturated;
    }
    let mut ranked: Vec<(&Summary, f64)> = fit.iter().filter_map(|r| Some((*r, figure(cx, r)?))).collect();
    if ranked.is_empty() {
        return Standing::Nothing;
    }
    if ranked.iter().any(|(r, _)| !cx.repeated(r)) {
        return Standing::Once;
    }
    ranked.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.id.cmp(&b.0.id)));
    let best = ranked[0].0;
    let level: Vec<&Summary> = ranked
        .iter()
        .map(|x| x.0)
        .take_while(|r| matches!((range(cx, best), range(cx, r)), (Some(a), Some(b)) if overlap(a, b)))
        .collect();
    if level.len() > 1 { Standing::Level(level) } else { Standing::Ahead(best, ranked.get(1).map(|x| x.0)) }
}

/// "3.10 s to 97.0%" or "1200 samples/s", with the repeats' range.
fn quoted(cx: &Context, r: &Summary) -> String {
    let c = cx.g.cell_of(r);
    let reps = c.map_or(1, |c| c.runs.len());
    match cx.g.target {
        Some(t) => {
            let (lo, hi) = c.and_then(|c| c.time_to_target).unwrap_or((f64::NAN, f64::NAN));
            format!(
                "reaches {:.1}% held-out accuracy in {} (median of {reps}, {} to {})",
                100.0 * t,
                elapsed(r.time_to_target_s.unwrap_or(f64::NAN)),
                elapsed(lo),
                elapsed(hi)
            )
        }
        None => {
            let (lo, hi) = c.and_then(|c| c.throughput).unwrap_or((f64::NAN, f64::NAN));
            format!("runs {:.0} samples/s (median of {reps}, {lo:.0}-{hi:.0})", Context::thr(r))
        }
    }
}

/// The wire the group's runs crossed: emulated links, the network between the hosts of
/// `compare --hosts`, or this machine's loopback.
pub fn wire(g: &Group, m: Option<&Machine>) -> String {
    match m.and_then(|m| m.link.as_deref().filter(|_| !m.hosts.is_empty())) {
        _ if !g.link.is_empty() => format!("emulated links of {}", g.link),
        Some(l) => match m.map_or(&[][..], |m| &m.hosts[..]) {
            [one] => format!("one host, {} (the link measured on its loopback)", one.name),
            hosts => format!("{} hosts (the link measured from {l})", hosts.len()),
        },
        None => "this machine's loopback".into(),
    }
}

/// The worker counts to decide at: above one where any, the most first.
pub fn counts(cx: &Context) -> Vec<usize> {
    let many: Vec<usize> = cx.workers.iter().copied().filter(|&n| n > 1).rev().collect();
    if many.is_empty() { cx.workers.clone() } else { many }
}

/// What the first sentence opens with: "For MLP 64-1024-1024-10 on this machine's loopback".
pub fn head(cx: &Context) -> String {
    let g = cx.g;
    // An emulated group's model already names its links.
    if g.link.is_empty() {
        format!("For {} on {}", g.model, wire(g, cx.machine))
    } else {
        format!("For {}", g.model)
    }
}

/// The first sentence: the pick, or why there is none.
fn pick(cx: &Context) -> (String, Option<usize>) {
    let g = cx.g;
    if g.rows.is_empty() {
        return (
            "No pick: no run completed, so there is nothing to compare (the table below says why).".into(),
            None,
        );
    }
    let head = head(cx);
    let mut why_not = None;
    for n in counts(cx) {
        let at = workers(n);
        match standing(cx, n) {
            Standing::Ahead(best, next) => {
                let crowded: Vec<String> = g
                    .rows
                    .iter()
                    .filter(|r| r.workers == n && cx.cpu_saturated(r))
                    .map(|r| Group::series(r))
                    .collect();
                // After the figure's own brackets: a clause, not another bracket.
                let alone = if crowded.is_empty() {
                    ", the only mode measured there".to_string()
                } else {
                    format!(
                        "; {} {}, so it is the only mode left there",
                        crowded.join(" and "),
                        cx.saturated()
                    )
                };
                let vs = next.map_or(alone, |x| {
                    format!(
                        ", clear of every other mode's range (next: {}, which {})",
                        Group::series(x),
                        quoted(cx, x)
                    )
                });
                return (
                    format!("{head}, pick {}: at {at} it {}{vs}.", Group::series(best), quoted(cx, best)),
                    Some(n),
                );
            }
            Standing::Level(l) => {
                // "A, which reaches ...; B, which ...; and C, which ...": each mode's figure
                // after its name, without nesting brackets in brackets.
                let names: Vec<String> =
                    l.iter().map(|r| format!("{}, which {}", Group::series(r), quoted(cx, r))).collect();
                let listed = match names.split_last() {
                    Some((last, rest)) if !rest.is_empty() => format!("{}; and {last}", rest.join("; ")),
                    _ => names.join(""),
                };
                return (
                    format!(
                        "{head}, no single pick: at {at} these are level, their repeats' ranges overlapping: \
                         {listed}. Choose among them on other grounds."
                    ),
                    Some(n),
                );
            }
            Standing::Once => {
                why_not.get_or_insert(format!("at {at} a cell that could decide ran once, with no spread to compare (run two or more repeats)"));
            }
            Standing::Saturated => {
                why_not.get_or_insert(format!(
                    "at {at} the runs {}, so the figures measure the CPU, not the design",
                    cx.saturated()
                ));
            }
            Standing::Nothing => {}
        }
    }
    let why = why_not.unwrap_or_else(|| match g.target {
        Some(t) => format!("no complete run reached {:.1}% held-out accuracy", 100.0 * t),
        None => "no run measured its throughput".into(),
    });
    (format!("{head}, no pick: {why}."), None)
}

/// The second sentence: where the measured leader changes with the worker count, and where the
/// cost model moves the answer between the ring and a parameter server with a shard per worker.
fn changes(cx: &Context) -> Option<String> {
    let mut leaders: Vec<(usize, String)> = Vec::new();
    for n in cx.workers.iter().copied().filter(|&n| n > 1) {
        if let Standing::Ahead(best, _) = standing(cx, n) {
            leaders.push((n, Group::series(best)));
        }
    }
    let changed = leaders.windows(2).any(|w| w[0].1 != w[1].1);
    let measured = match (leaders.first(), leaders.last()) {
        _ if changed => {
            let at: Vec<String> = leaders.iter().map(|(n, s)| format!("{s} at {n}")).collect();
            Some(format!("the measured leader changes with the worker count ({})", at.join(", ")))
        }
        (Some(a), Some(b)) if a.0 != b.0 => {
            Some(format!("{} leads at every worker count from {} to {}", a.1, a.0, b.0))
        }
        _ => None,
    };
    // The dense crossing assumes a push and pull of the whole model, which a sparse table's
    // parameter server does not do (the sparse reading says what it does).
    let model =
        cx.link.filter(|_| super::sparse::table(cx).is_none()).map(|l| model_crossing(cx.g.grad_bytes(), l));
    match (measured, model) {
        (Some(m), Some(c)) if changed => Some(format!("The answer changes: {m}; {c}.")),
        (Some(m), None) if changed => Some(format!("The answer changes: {m}.")),
        (Some(m), Some(c)) => Some(format!("Measured, {m}; {c}.")),
        (Some(m), None) => Some(format!("Measured, {m}.")),
        (None, Some(c)) => {
            let (head, tail) = c.split_at(1);
            Some(format!("{}{tail}.", head.to_uppercase()))
        }
        (None, None) => None,
    }
}

/// Where the cost model puts a parameter server with a shard per worker ahead of the ring for
/// `s` bytes of gradients, on link `l` and at 10 Gbit/s.
fn model_crossing(s: f64, l: Link) -> String {
    let from = |l: Link| {
        cost::ps_wins(1024, s, l, |n| n)
            .map_or("never up to 1024 workers".to_string(), |(a, _)| format!("from {a} workers up"))
    };
    let ten = Link { a: l.a, b: cost::gbit(10.0) };
    format!(
        "by the cost model, a parameter server with a shard per worker beats the ring {} on this link ({:.2} GB/s, \
         {:.1} us) and {} at 10 Gbit/s",
        from(l),
        l.b / 1e9,
        l.a * 1e6,
        from(ten)
    )
}

/// The third sentence: how sure the pick is.
fn sureness(cx: &Context, at: Option<usize>) -> Option<String> {
    let n = at?;
    let reps: Vec<usize> =
        cx.g.rows
            .iter()
            .filter(|r| r.workers == n)
            .filter_map(|r| cx.g.cell_of(r).map(|c| c.runs.len()))
            .collect();
    let (lo, hi) = (reps.iter().min()?, reps.iter().max()?);
    // Named by cause: a reader acts differently on a run that broke and on one the machine
    // was too small for.
    let unfinished = cx.all.iter().filter(|r| !r.complete() && r.status != "skipped").count();
    let saturated =
        cx.g.rows
            .iter()
            .filter(|r| cx.cpu_saturated(r))
            .filter_map(|r| cx.g.cell_of(r))
            .map(|c| c.runs.len())
            .sum::<usize>();
    let mut left = Vec::new();
    if unfinished > 0 {
        left.push(format!("{unfinished} run(s) that failed, diverged or stopped early"));
    }
    if saturated > 0 {
        left.push(format!("{saturated} run(s) that {}", cx.saturated()));
    }
    let at = workers(n);
    let repeats = if lo == hi { format!("{lo}") } else { format!("{lo} to {hi}") };
    Some(format!(
        "Sure as far as {repeats} complete repeats per cell at {at} go: ranges that overlap are called level, \
         not ranked{}.",
        if left.is_empty() { String::new() } else { format!(", and {} decide nothing", left.join(" and ")) }
    ))
}

/// The verdict's three sentences, each apart, for the page to set where it reads best.
#[derive(Debug)]
pub struct Verdict {
    /// The pick, or why there is none.
    pub pick: String,
    /// The worker count the verdict was reached at (a pick, or modes called level); none when
    /// no worker count could decide.
    pub at: Option<usize>,
    /// Where the answer changes with the worker count and the link, if anywhere.
    pub changes: Option<String>,
    /// How sure the pick is.
    pub sureness: Option<String>,
}

/// The verdict of a group, sentence by sentence.
pub fn judge(cx: &Context) -> Verdict {
    let (pick, at) = pick(cx);
    Verdict { pick, at, changes: changes(cx), sureness: sureness(cx, at) }
}

/// The verdict: at most three sentences, one after the other (the page sets them apart:
/// [`judge`]).
#[cfg(test)]
pub fn verdict(cx: &Context) -> Vec<String> {
    let v = judge(cx);
    let mut out = vec![v.pick];
    out.extend(v.changes);
    out.extend(v.sureness);
    out
}
