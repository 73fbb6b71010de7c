//! The verdict card the page opens with, one per group (a model at a global batch, on one
//! wire): per worker count the pick, its margin over the runner-up beside the repeats' spread,
//! the one reason it wins, and how sure that is; or "level", or why nothing is ranked there.
//! The runs left unranked are listed once, each cause with its reason once; where most cells
//! saturated a machine too small for them, the card says so first and names the commands that
//! would decide.

use serde::Serialize;

use super::context::{Context, UNRANKED};
use super::ranking::factors;
use super::text::Text;
use super::verdict::{self, Standing};
use crate::charts::{Group, workers};
use crate::results::Summary;

/// One group's verdict card.
#[derive(Debug, Serialize)]
pub struct Card {
    /// What was compared: the model, its global batch and the wire.
    pub title: String,
    /// Said first where most cells saturated the CPU.
    pub too_small: Option<TooSmall>,
    /// The verdict's pick, or why there is none (left out where the machine was too small and
    /// nothing was picked: [`Card::too_small`] says why instead).
    pub headline: Option<Text>,
    /// One row per worker count that could decide, ascending.
    pub rows: Vec<Row>,
    /// Where the answer changes with the worker count and the link, and how sure it is.
    pub notes: Vec<Text>,
    /// The cells left unranked, each cause once with its reason.
    pub unranked: Vec<Text>,
}

/// A machine too small for most of the comparison, and what would decide instead.
#[derive(Debug, Serialize)]
pub struct TooSmall {
    /// Why most cells rank nothing, listing them.
    pub said: Text,
    /// What would decide, each a sentence and its command.
    pub remedies: Vec<Remedy>,
    /// What would not help, though it looks as if it would.
    pub not: Text,
}

/// One way to a comparison that decides.
#[derive(Debug, Serialize)]
pub struct Remedy {
    /// What it does.
    pub what: Text,
    /// The command.
    pub command: String,
}

/// How the modes stand at one worker count.
#[derive(Debug, Serialize)]
pub struct Row {
    /// "4 workers".
    pub workers: String,
    /// `pick`, `level` or `none`: how the row reads (its style on the page).
    pub kind: &'static str,
    /// The mode picked, the modes level, or "not ranked".
    pub verdict: String,
    /// By how much, against which mode.
    pub margin: String,
    /// The one reason.
    pub reason: String,
    /// How sure: the margin against the repeats' spread.
    pub sure: String,
}

/// The card of the group `cx` reads.
pub fn card(cx: &Context) -> Card {
    let g = cx.g;
    let title = if g.link.is_empty() {
        format!("{}, global batch {}, on {}", g.model, g.global_batch, verdict::wire(g, cx.machine))
    } else {
        format!("{}, global batch {}", g.model, g.global_batch)
    };
    let v = verdict::judge(cx);
    let too_small = too_small(cx);
    // Where the machine was too small, "no pick" is what the banner explains better.
    // The card's title names the model and the wire: the headline starts at the pick.
    let pick = match v.pick.strip_prefix(&format!("{}, ", verdict::head(cx))) {
        Some(rest) => rest.chars().take(1).flat_map(char::to_uppercase).chain(rest.chars().skip(1)).collect(),
        None => v.pick.clone(),
    };
    // Where the machine was too small, only a pick stands beside the banner: "no pick" and "no
    // single pick" are what the banner explains better (the rows still show modes level).
    let picked = v.at.is_some_and(|n| matches!(verdict::standing(cx, n), Standing::Ahead(..)));
    let headline = (too_small.is_none() || picked).then(|| Text::from(pick.as_str()));
    let mut counts = verdict::counts(cx);
    counts.reverse();
    let rows = if g.rows.is_empty() { Vec::new() } else { counts.iter().map(|&n| row(cx, n)).collect() };
    let notes = v.changes.iter().chain(&v.sureness).map(|s| Text::from(s.as_str())).collect();
    let mut unranked = Vec::new();
    let crowded: Vec<&Summary> = g.rows.iter().copied().filter(|r| cx.cpu_saturated(r)).collect();
    if !crowded.is_empty() && too_small.is_none() {
        unranked.push(Text::from(
            format!("Not ranked, since they {}: {}.", cx.saturation_reason(), listing(cx, &crowded)).as_str(),
        ));
    }
    let once: Vec<&Summary> =
        g.rows.iter().copied().filter(|r| !cx.cpu_saturated(r) && !cx.repeated(r)).collect();
    if !once.is_empty() {
        unranked.push(Text::from(format!("{UNRANKED} Ran once: {}.", listing(cx, &once)).as_str()));
    }
    Card { title, too_small, headline, rows, notes, unranked }
}

/// A row's mode in a list: the mode, with its shard count (and their place when colocated).
fn name(r: &Summary) -> String {
    r.design()
}

/// `rs` listed by worker count: "at 2 workers: ps-bsp k=1, ps-asp k=1; at 4 workers: every
/// mode".
fn listing(cx: &Context, rs: &[&Summary]) -> String {
    let mut parts = Vec::new();
    for &n in &cx.workers {
        let at: Vec<String> = rs.iter().filter(|r| r.workers == n).map(|r| name(r)).collect();
        let all = cx.g.rows.iter().filter(|r| r.workers == n).count();
        match at.len() {
            0 => continue,
            k if k == all && k > 1 => parts.push(format!("at {}: every mode", workers(n))),
            _ => parts.push(format!("at {}: {}", workers(n), at.join(", "))),
        }
    }
    parts.join("; ")
}

/// Most cells saturated the CPU: the banner, with the commands that would decide.
fn too_small(cx: &Context) -> Option<TooSmall> {
    let rows = &cx.g.rows;
    let crowded: Vec<&Summary> = rows.iter().copied().filter(|r| cx.cpu_saturated(r)).collect();
    if crowded.len() * 2 <= rows.len() {
        return None;
    }
    let cores = cx.machine.map_or(0, |m| m.cores);
    let need = crowded.iter().map(|r| r.workers + r.shards).max().unwrap_or(0);
    let machine = if cores > 0 { format!("this machine has {cores} cores, and ") } else { String::new() };
    let said = format!(
        "Too small to decide: {machine}{} of the {} cells {}, so they rank nothing ({}).",
        crowded.len(),
        rows.len(),
        cx.saturation_reason(),
        listing(cx, &crowded)
    );
    // A replay saturates by how busy its cores were, not by its process count.
    let more = if need > cores {
        format!("at least {need} cores (the most processes one run started)")
    } else {
        format!("more than {cores} cores")
    };
    let remedies = vec![
        Remedy {
            what: Text::from(
                format!(
                    "Run this comparison's scenario (`scenario.toml` beside this report) on a machine with {more}:"
                )
                .as_str(),
            ),
            command: "gradsync-bench compare scenario.toml".into(),
        },
        Remedy {
            what: Text::from(
                format!(
                    "Or run every server and worker on hosts over ssh, with a slot for each process of a run (up \
                     to {need}; a hostfile of `node0 slots=4` lines, docs/cluster.md):"
                )
                .as_str(),
            ),
            command: "gradsync-bench compare scenario.toml --hosts hosts.txt".into(),
        },
        Remedy {
            what: Text::from(
                "Or, on this machine (as root), give each process an emulated host of its own in dilated time: \
                 every link and clock slowed until the shared cores keep up, the figures divided back \
                 (docs/cluster.md; it takes the factor times as long, and runs over emulated links, not this \
                 loopback):",
            ),
            command: "gradsync-bench cluster scenario.toml --to-accuracy --dilate auto".into(),
        },
    ];
    let not = Text::from(
        "An emulated cluster without dilation would not decide it: every emulated host shares this machine's \
         cores.",
    );
    Some(TooSmall { said: Text::from(said.as_str()), remedies, not })
}

/// The row of worker count `n`.
fn row(cx: &Context, n: usize) -> Row {
    let none = |reason: String| Row {
        workers: workers(n),
        kind: "none",
        verdict: "not ranked".into(),
        margin: "-".into(),
        reason,
        sure: "-".into(),
    };
    match verdict::standing(cx, n) {
        Standing::Ahead(best, next) => ahead(cx, n, best, next),
        Standing::Level(l) => {
            let figures: Vec<String> =
                l.iter().map(|r| format!("{} {}", name(r), figure_range(cx, r))).collect();
            Row {
                workers: workers(n),
                kind: "level",
                verdict: format!("level: {}", l.iter().map(|r| name(r)).collect::<Vec<_>>().join(", ")),
                margin: figures.join("; "),
                reason: "their repeats' ranges overlap: choose among them on other grounds".into(),
                sure: format!("over {} repeats", repeats(cx, &l)),
            }
        }
        Standing::Once => none("a cell that could decide ran once: no spread to compare".into()),
        Standing::Saturated => none(format!("every run there {}", cx.saturated())),
        Standing::Nothing => none(match cx.g.target {
            Some(t) => format!("no complete run reached {:.1}% held-out accuracy", 100.0 * t),
            None => "no run measured its throughput".into(),
        }),
    }
}

/// A row's figure with its repeats' range: "0.35 s (0.30-0.44)", "1001 samples/s (1000-1002)".
fn figure_range(cx: &Context, r: &Summary) -> String {
    let cell = cx.g.cell_of(r);
    match cx.g.target {
        Some(_) => {
            let (lo, hi) = cell.and_then(|c| c.time_to_target).unwrap_or((f64::NAN, f64::NAN));
            format!("{:.2} s ({lo:.2}-{hi:.2})", r.time_to_target_s.unwrap_or(f64::NAN))
        }
        None => {
            let (lo, hi) = cell.and_then(|c| c.throughput).unwrap_or((f64::NAN, f64::NAN));
            format!("{:.0} samples/s ({lo:.0}-{hi:.0})", Context::thr(r))
        }
    }
}

/// "3", or "3 and 2" where the cells' complete repeats differ.
fn repeats(cx: &Context, rs: &[&Summary]) -> String {
    let mut k: Vec<usize> = rs.iter().filter_map(|r| cx.g.cell_of(r)).map(|c| c.runs.len()).collect();
    k.sort_unstable();
    k.dedup();
    match (k.first(), k.last()) {
        (Some(a), Some(b)) if a != b => format!("{a} to {b}"),
        (Some(a), _) => a.to_string(),
        _ => "0".into(),
    }
}

/// The row of a clear pick: its margin over the runner-up, the reason, and that margin set
/// against the wider of the two cells' ranges over their repeats.
fn ahead(cx: &Context, n: usize, best: &Summary, next: Option<&Summary>) -> Row {
    let pick = |margin: String, reason: String, sure: String| Row {
        workers: workers(n),
        kind: "pick",
        verdict: Group::series(best),
        margin,
        reason,
        sure,
    };
    let Some(next) = next else {
        let crowded = cx.g.rows.iter().any(|r| r.workers == n && cx.cpu_saturated(r));
        let reason = if crowded {
            format!("the only mode left: the others {}", cx.saturated())
        } else {
            "the only mode measured".into()
        };
        return pick(
            format!("alone: {}", figure_range(cx, best)),
            reason,
            format!("over {} repeats", repeats(cx, &[best])),
        );
    };
    let margin = match (cx.g.target, best.time_to_target_s, next.time_to_target_s) {
        (Some(t), Some(b), Some(x)) => format!(
            "{:.2}x sooner to {:.1}% than {} ({b:.2} s against {x:.2} s)",
            x / b.max(1e-12),
            100.0 * t,
            name(next)
        ),
        _ => format!(
            "{:.2}x the throughput of {} ({:.0} against {:.0} samples/s)",
            Context::thr(best) / Context::thr(next).max(1e-9),
            name(next),
            Context::thr(best),
            Context::thr(next)
        ),
    };
    let width = |r: &Summary| verdict::range(cx, r).map_or(0.0, |(lo, hi)| hi - lo);
    let gap = match (verdict::figure(cx, best), verdict::figure(cx, next)) {
        (Some(a), Some(b)) => (b - a).abs(),
        _ => f64::NAN,
    };
    let spread = width(best).max(width(next));
    let reps = repeats(cx, &[best, next]);
    let sure = if spread > 0.0 {
        format!("margin {:.1}x the spread over {reps} repeats", gap / spread)
    } else {
        format!("over {reps} repeats, each cell's alike")
    };
    pick(margin, reason(cx, best, next), sure)
}

/// A part of a step, ms, where the run measured it.
type Part = fn(&Summary) -> Option<f64>;

/// The one reason `best` beats `next`: with a target, the fewer samples it needs where
/// convergence per sample favours it more than throughput does; otherwise the part of the
/// step it spends least on against the runner-up (or its throughput, where the steps were not
/// split into parts).
fn reason(cx: &Context, best: &Summary, next: &Summary) -> String {
    if cx.g.target.is_some() {
        let (speed, samples, _) = factors(best, next);
        if samples > 1.02 && samples > speed {
            return format!(
                "it needs {samples:.2}x fewer samples to the target ({} against {})",
                best.samples_to_target.unwrap_or(0),
                next.samples_to_target.unwrap_or(0)
            );
        }
    }
    let compute = |r: &Summary| Some(r.forward_ms? + r.backward_ms?);
    let parts: [(&str, Part); 5] = [
        ("less compute (forward and backward)", compute),
        ("less exposed communication", |r| r.comm_exposed_ms),
        ("less waiting", |r| r.wait_ms),
        ("a shorter update", |r| r.update_ms),
        ("lower other per-step costs", |r| r.other_ms),
    ];
    let widest = parts
        .iter()
        .filter_map(|(what, f)| Some((*what, f(best)?, f(next)?)))
        .filter(|(_, b, x)| x > b)
        .max_by(|a, b| (a.2 - a.1).total_cmp(&(b.2 - b.1)));
    match widest {
        Some((what, b, x)) => format!("{what}: {b:.2} ms a step against {x:.2} ms"),
        None => format!(
            "its throughput, {:.2}x the runner-up's",
            Context::thr(best) / Context::thr(next).max(1e-9)
        ),
    }
}
