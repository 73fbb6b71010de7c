//! The page as data, and its rendering: every piece of text is computed in Rust into the
//! structs below, and `templates/report.html` lays them out through minijinja, which escapes
//! every value it writes (only the charts' own SVG is written as it is).

use minijinja::{Environment, Value};
use serde::Serialize;

use super::card::Card;
use super::tables::{Grid, Results};
use super::text::{Finding, Text};

/// The page's template, built into the binary.
const TEMPLATE: &str = include_str!("templates/report.html");

/// A chart inlined in the page.
#[derive(Debug, Serialize)]
pub struct Figure {
    /// Its file name without extension (the figure's id).
    pub name: String,
    /// Its title.
    pub title: String,
    /// Its SVG, from `<svg` on: drawn by gradsync's own chart code, written as it is.
    pub svg: String,
}

/// One group's part of the page below the verdict: its table, charts, readings and the tables
/// that go into detail.
#[derive(Debug, Serialize)]
pub struct Section {
    /// Its heading where the page has several groups.
    pub heading: Option<String>,
    /// Mode by worker count: the table a reader wants first.
    pub results: Results,
    /// Its charts.
    pub figures: Vec<Figure>,
    /// Its readings, each folded under its finding.
    pub readings: Vec<Finding>,
    /// The tables that go into detail: time to accuracy, scaling, the cost model.
    pub tables: Vec<Grid>,
}

/// The machine, and the wire the runs crossed.
#[derive(Debug, Serialize)]
pub struct MachineView {
    /// Heading and value, a row each.
    pub rows: Vec<(String, String)>,
    /// Which wires compare directly.
    pub wires: Text,
    /// How the processes reached the hosts, where they ran on hosts.
    pub hosts_said: Option<String>,
    /// The hosts, each as its check found it.
    pub hosts: Option<Grid>,
}

/// Runs on emulated links.
#[derive(Debug, Serialize)]
pub struct ClusterView {
    /// Measured step and communication beside the model's prediction, a row per run.
    pub table: Grid,
    /// The parameter server against the ring, and BytePS's claim.
    pub readings: Vec<String>,
}

/// The whole page.
#[derive(Debug, Serialize)]
pub struct Page {
    /// Its title.
    pub title: String,
    /// A card per group.
    pub cards: Vec<Card>,
    /// A section per group.
    pub sections: Vec<Section>,
    /// The machine, where described.
    pub machine: Option<MachineView>,
    /// Runs on emulated links, where any.
    pub cluster: Option<ClusterView>,
    /// Every run, with its figures and errors.
    pub runs: Grid,
    /// What could not be read in the input.
    pub warnings: Vec<String>,
    /// The scenario as run.
    pub scenario: Option<String>,
}

/// The page as HTML.
pub fn render(page: &Page) -> anyhow::Result<String> {
    let mut env = Environment::new();
    // The name ends in .html: minijinja escapes every value for HTML.
    env.add_template("report.html", TEMPLATE)?;
    let html = env.get_template("report.html")?.render(Value::from_serialize(page))?;
    Ok(html)
}
