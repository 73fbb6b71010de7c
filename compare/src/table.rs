//! Plain-text tables: every benchmark prints its figures through this, so columns line up the
//! same way everywhere and the output pastes into docs/ unchanged (Markdown pipes).

/// A table under construction.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column names.
    pub fn new(header: &[&str]) -> Self {
        Table { header: header.iter().map(|s| s.to_string()).collect(), rows: Vec::new() }
    }

    /// Append a row (as many cells as columns).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Render as a Markdown table with aligned columns.
    pub fn render(&self) -> String {
        let n = self.header.len();
        let width: Vec<usize> = (0..n)
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r.get(c).map_or(0, |s| s.len()))
                    .max()
                    .unwrap_or(0)
                    .max(self.header[c].len())
            })
            .collect();
        let line = |cells: &[String]| {
            let parts: Vec<String> = (0..n)
                .map(|c| format!("{:>w$}", cells.get(c).map_or("", |s| s.as_str()), w = width[c]))
                .collect();
            format!("| {} |\n", parts.join(" | "))
        };
        let mut out = line(&self.header);
        out += &format!(
            "|{}|\n",
            width.iter().map(|w| format!("{}:", "-".repeat(w + 1))).collect::<Vec<_>>().join("|")
        );
        for r in &self.rows {
            out += &line(r);
        }
        out
    }
}

/// The median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 { s[m] } else { 0.5 * (s[m - 1] + s[m]) }
}

/// Median, least and most of `v` (`None` when empty): the figure and spread of a quantity
/// measured once per interleaved round.
pub fn spread(v: &[f64]) -> Option<(f64, f64, f64)> {
    let (lo, hi) = v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    (!v.is_empty()).then(|| (median(v), lo, hi))
}

/// A ratio measured once per round, its median followed by `unit`: `1.25` after one round,
/// `1.25 (1.18-1.34)` (median, least and most) after several; empty when there is none.
pub fn ratio_cell(v: &[f64], unit: &str) -> String {
    match spread(v) {
        None => String::new(),
        Some((m, ..)) if v.len() == 1 => format!("{m:.2}{unit}"),
        Some((m, lo, hi)) => format!("{m:.2}{unit} ({lo:.2}-{hi:.2})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned() {
        let mut t = Table::new(&["a", "bbb"]);
        t.row(vec!["1234".into(), "x".into()]);
        let s = t.render();
        assert_eq!(s.lines().count(), 3);
        assert!(s.lines().all(|l| l.len() == s.lines().next().unwrap().len()));
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn ratios_show_their_spread_once_there_are_rounds() {
        assert_eq!(spread(&[]), None);
        assert_eq!(spread(&[2.0, 0.5, 1.0]), Some((1.0, 0.5, 2.0)));
        assert_eq!(ratio_cell(&[], ""), "");
        assert_eq!(ratio_cell(&[1.254], ""), "1.25");
        assert_eq!(ratio_cell(&[1.254], "x"), "1.25x");
        assert_eq!(ratio_cell(&[1.3, 1.1, 1.2], "x"), "1.20x (1.10-1.30)");
    }
}
