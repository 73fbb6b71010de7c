//! `advise --check`'s readings: the text table it prints and `report.html`, a verdict card
//! first, the table, then the chart of predicted against measured per configuration.

use minijinja::{Environment, Value};
use serde::Serialize;

use super::check::{CheckReport, Checked};
use super::testbed::Kind;
use crate::table::Table;

/// The page's template, built into the binary.
const TEMPLATE: &str = include_str!("templates/check.html");

/// What the emulated cluster cannot be, said beside every checked figure.
pub const CAVEATS: [&str; 4] = [
    "A host's ranks meet over its loopback, unshaped and dilated with everything else: not the SPEC's \
     NVLink or PCIe (the prediction for the link as measured prices it so).",
    "The NIC's latency is the network namespaces' own, a few microseconds, divided by the factor: this \
     machine's kernel has no netem to add the SPEC's.",
    "Per-byte CPU costs shrink with the factor: a host whose own CPU would limit its NIC is emulated as one \
     that does not (the cluster report's CPU seconds per GB say where that starts), and compression's codecs \
     run that many times faster than this machine's core, so a compressed configuration's measurement tests \
     its bytes, not its codecs (the prediction beside it prices them so).",
    REPLAYED,
];

/// What a check on real hosts is not, said beside every checked figure.
pub const REAL_CAVEATS: [&str; 4] = [
    "A host's ranks meet over its loopback (the replay runs on the CPUs, over gradsync's TCP backend): not the \
     --intra link the predictions price them at.",
    "The link as measured is the NIC the advice measured between the first two hosts (the raw-TCP yardstick), \
     every host's taken to be alike; each configuration's run directory records it measured again before its \
     runs (machine.json).",
    "The hosts are shared: whatever else runs on them and their links (other jobs, this machine's own work) \
     runs beside the check, and how busy their cores were is not measured from here.",
    REPLAYED,
];

/// What neither testbed measures.
const REPLAYED: &str = "Compute is the profile's, waited out (a replay); a configuration's effect on accuracy is \
     stated beside it, not measured here.";

/// The table's header.
const HEAD: [&str; 9] = [
    "#",
    "configuration",
    "predicted rank",
    "predicted ms (SPEC)",
    "predicted ms (link as measured)",
    "measured ms",
    "range",
    "error",
    "measured rank",
];

/// Milliseconds to three significant figures or one decimal, whichever says more.
fn ms(v: f64) -> String {
    if v.abs() < 10.0 { format!("{v:.3}") } else { format!("{v:.1}") }
}

/// Each configuration's row.
fn rows(r: &CheckReport) -> Vec<Vec<String>> {
    let f = |v: Option<f64>| v.map_or("-".into(), ms);
    r.checked
        .iter()
        .enumerate()
        .map(|(i, c): (usize, &Checked)| {
            let rank =
                r.measured_order.iter().position(|&j| j == i).map_or("-".into(), |p| (p + 1).to_string());
            vec![
                (i + 1).to_string(),
                c.label.clone(),
                c.predicted_rank.to_string(),
                ms(c.predicted_ms),
                f(c.predicted_measured_link_ms),
                match (&c.why_not, c.measured_ms) {
                    // A factor only where there was one: real hosts are not dilated.
                    (_, Some(m)) => match c.dilation {
                        Some(d) => format!("{} ({} of {}, x{d})", ms(m), c.sound, c.runs),
                        None => format!("{} ({} of {})", ms(m), c.sound, c.runs),
                    },
                    (Some(why), None) => why.clone(),
                    (None, None) => "-".into(),
                },
                c.range_ms.map_or("-".into(), |(lo, hi)| format!("{}-{}", ms(lo), ms(hi))),
                c.error().map_or("-".into(), |e| format!("{:+.1}%", e * 100.0)),
                rank,
            ]
        })
        .collect()
}

/// The errors, one sentence.
fn errors(r: &CheckReport) -> String {
    match (r.error_median, r.error_max) {
        (Some(m), Some(x)) => format!(
            "Predicted for the link as measured against measured, over the {} configuration(s) measured: median \
             |error| {:.1}%, largest {:.1}%.",
            r.measured_order.len(),
            m * 100.0,
            x * 100.0
        ),
        _ => "No configuration was measured soundly: no error to state.".into(),
    }
}

/// The text `advise --check` prints after the advice.
pub fn text(r: &CheckReport) -> String {
    let mut t = Table::new(&HEAD);
    for row in rows(r) {
        t.row(row);
    }
    let mut out = format!("\ncheck: measured on {} (every figure below labelled)\n", r.cluster);
    out += &t.render();
    for (label, why) in &r.not_checked {
        out += &format!("not checked: {label}: {why}\n");
    }
    out += &format!("\n{}\n{}\n", r.verdict, errors(r));
    out
}

#[derive(Serialize)]
struct Page<'a> {
    model: &'a str,
    verdict: &'a str,
    errors: String,
    #[serde(rename = "where")]
    at: String,
    head: [&'static str; 9],
    rows: Vec<Vec<String>>,
    chart: String,
    not_checked: &'a [(String, String)],
    caveats_title: &'static str,
    caveats: [&'static str; 4],
}

/// How the runs were made and which counted, one sentence: `r`'s testbed's.
fn made(r: &CheckReport) -> String {
    match r.testbed {
        Kind::Emulated => format!(
            "Measured on {}, each configuration twice after a probe picked its dilation, and checked at twice \
             the factor; a run whose cores did not keep up is not counted.",
            r.cluster
        ),
        Kind::Hosts | Kind::Slurm => format!(
            "Measured on {}, each configuration twice as a comparison on them (as `gradsync-bench compare {}` \
             runs one), at the hosts' own speed; a run counts when it completed.",
            r.cluster,
            if r.testbed == Kind::Slurm { "--slurm" } else { "--hosts" }
        ),
    }
}

/// `report.html`.
pub fn html(model: &str, r: &CheckReport) -> anyhow::Result<String> {
    let points: Vec<crate::charts::advice::Point> = r
        .checked
        .iter()
        .enumerate()
        .filter_map(|(i, c)| Some((i + 1, c.predicted_measured_link_ms?, c.measured_ms?, c.range_ms)))
        .collect();
    let chart = crate::charts::advice::predicted_against_measured(
        &format!("{model}: measured against predicted step ({})", r.cluster),
        &points,
    )?;
    let page = Page {
        model,
        verdict: &r.verdict,
        errors: errors(r),
        at: made(r),
        head: HEAD,
        rows: rows(r),
        chart,
        not_checked: &r.not_checked,
        caveats_title: match r.testbed {
            Kind::Emulated => "What the emulated cluster is not",
            Kind::Hosts | Kind::Slurm => "What the check on the hosts is not",
        },
        caveats: if r.testbed == Kind::Emulated { CAVEATS } else { REAL_CAVEATS },
    };
    let mut env = Environment::new();
    env.add_template("check.html", TEMPLATE)?;
    Ok(env.get_template("check.html")?.render(Value::from_serialize(&page))?)
}
