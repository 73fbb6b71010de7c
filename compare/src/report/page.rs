//! The page as data, and its rendering: every piece of text is computed in Rust into the
//! structs below, and `templates/report.html` lays them out through minijinja, which escapes
//! every value it writes (only the charts' own SVG is written as it is).

use minijinja::{Environment, Value};
use serde::Serialize;

use super::card::Card;
use super::tables::{Grid, Results};

/// The page's template, built into the binary.
const TEMPLATE: &str = include_str!("templates/report.html");

/// A piece of text whose `backticked` stretches are set as code.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Text {
    /// Its stretches, in order.
    pub spans: Vec<Span>,
}

/// A stretch of a [`Text`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span {
    /// The words.
    pub text: String,
    /// Whether it was between backticks.
    pub code: bool,
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        let spans = s
            .split('`')
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(i, t)| Span { text: t.to_string(), code: i % 2 == 1 })
            .collect();
        Text { spans }
    }
}

/// A reading folded on the page: its finding, then the rest of what it says.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// Its first sentence.
    pub finding: Text,
    /// The sentences after it (empty where it has one).
    pub more: Text,
}

impl Finding {
    /// A reading's paragraph split after its first sentence: at the first full stop outside
    /// brackets and backticks that a space and a capital (or a backtick) follow, so "1.25x",
    /// "e.g. a" and a sentence in brackets do not end it.
    pub fn of(paragraph: &str) -> Finding {
        let chars: Vec<(usize, char)> = paragraph.char_indices().collect();
        let (mut depth, mut code) = (0i32, false);
        let mut cut = None;
        for (k, &(i, c)) in chars.iter().enumerate() {
            match c {
                '(' | '[' if !code => depth += 1,
                ')' | ']' if !code => depth -= 1,
                '`' => code = !code,
                '.' if depth <= 0 && !code => {
                    let next = chars.get(k + 1).map(|x| x.1);
                    let after = chars.get(k + 2).map(|x| x.1);
                    if next == Some(' ') && after.is_some_and(|a| a.is_uppercase() || a == '`') {
                        cut = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let (head, tail) = paragraph.split_at(cut.unwrap_or(paragraph.len()));
        Finding { finding: Text::from(head.trim()), more: Text::from(tail.trim()) }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finding_is_the_first_sentence_outside_brackets() {
        let f = Finding::of("At 4 workers: a (median of 3. Odd) is 1.25x faster. Why: e.g. less. The end.");
        assert_eq!(f.finding, Text::from("At 4 workers: a (median of 3. Odd) is 1.25x faster."));
        assert_eq!(f.more, Text::from("Why: e.g. less. The end."));
        assert_eq!(Finding::of("One sentence.").more, Text::default());
        let t = Text::from("run `gradsync-bench compare` here");
        assert_eq!(t.spans.len(), 3);
        assert!(t.spans[1].code && t.spans[1].text == "gradsync-bench compare");
    }
}
