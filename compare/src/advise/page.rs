//! `advise --check`'s readings: the text table it prints and `report.html`, a verdict card
//! first, the table, then the chart of predicted against measured per configuration.

use minijinja::{Environment, Value};
use serde::Serialize;

use super::check::{CheckReport, Checked};
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
     that does not (the cluster report's CPU seconds per GB say where that starts).",
    "Compute is the profile's, waited out (a replay); a configuration's effect on accuracy is stated beside \
     it, not measured here.",
];

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
                    (_, Some(m)) => {
                        format!("{} ({} of {}, x{})", ms(m), c.sound, c.runs, c.dilation.unwrap_or(1.0))
                    }
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
    caveats: [&'static str; 4],
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
        at: format!(
            "Measured on {}, each configuration twice after a probe picked its dilation, and checked at twice \
             the factor; a run whose cores did not keep up is not counted.",
            r.cluster
        ),
        head: HEAD,
        rows: rows(r),
        chart,
        not_checked: &r.not_checked,
        caveats: CAVEATS,
    };
    let mut env = Environment::new();
    env.add_template("check.html", TEMPLATE)?;
    Ok(env.get_template("check.html")?.render(Value::from_serialize(&page))?)
}
