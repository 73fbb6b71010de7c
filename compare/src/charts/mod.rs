//! The report's charts, each drawn twice by the same code: an SVG (inlined in report.html) and
//! a PNG. Text is drawn with the DejaVu Sans font embedded in the binary, so PNGs render the
//! same on a machine with no fonts installed. No timestamps or random ids reach the output:
//! identical input gives byte-identical files.
//!
//! Here: [`Charts`] (where charts go, and the order [`Charts::draw_group`] draws them in) and
//! what every chart shares (the `render!` macro, font, frame, legend, colours). One file per
//! family of charts, each adding its methods to [`Charts`]: `convergence` (accuracy and loss
//! curves), `speed` (throughput, step phases, straggler slowdown), `traffic` (bytes and
//! staleness), `model` (the cost models and their extrapolation); `group` holds what they are
//! drawn from. [`advice`] draws `advise --check`'s one chart, SVG only, for its own page.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::cost::{self, Link};
use super::results::Summary;
use super::scenario::ModeKind;

pub use group::{Group, Slowdown, groups};

/// Draws `$body` once on an SVG and once on a PNG backend of `$size`.
macro_rules! render {
    ($out:expr, $name:expr, $title:expr, $size:expr, |$root:ident| $body:block) => {{
        let name: String = $name;
        let mut svg = String::new();
        {
            let $root = SVGBackend::with_string(&mut svg, $size).into_drawing_area();
            $root.fill(&WHITE)?;
            $body
            $root.present()?;
        }
        let png = $out.dir.join(format!("{name}.png"));
        {
            let $root = BitMapBackend::new(&png, $size).into_drawing_area();
            $root.fill(&WHITE)?;
            $body
            $root.present().with_context(|| format!("writing {}", png.display()))?;
        }
        let path = $out.dir.join(format!("{name}.svg"));
        std::fs::write(&path, &svg).with_context(|| format!("writing {}", path.display()))?;
        $out.charts.push(Chart { name, title: $title, svg });
    }};
}

pub mod advice;
mod convergence;
mod group;
mod model;
mod speed;
mod traffic;

/// DejaVu Sans (Bitstream Vera licence, see compare/assets/DejaVuSans-LICENSE.txt).
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

fn register_font() -> anyhow::Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT)
            .map_err(|_| anyhow::anyhow!("the embedded font does not parse"));
    });
    result
}

/// A chart drawn into the output directory.
#[derive(Debug, Clone)]
pub struct Chart {
    /// File stem (`throughput`): `<name>.svg` and `<name>.png`.
    pub name: String,
    /// Caption in the report.
    pub title: String,
    /// The SVG text.
    pub svg: String,
}

/// A named, coloured series of points.
type Line = (String, RGBColor, Vec<(f64, f64)>);
/// A measured series: name, colour, whether it is the servers' figure, points.
type Measured = (String, RGBColor, bool, Vec<(f64, f64)>);
/// A model line: name, colour, dash length (0: solid), points.
type Dashed = (String, RGBColor, u32, Vec<(f64, f64)>);
/// One phase of the step: its name, how to read it from a summary, its colour.
type Phase = (&'static str, fn(&Summary) -> Option<f64>, RGBColor);

/// Fixed colours per series position so every chart agrees.
fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

/// The colour of a mode, by its position in [`ModeKind::ALL`].
fn mode_color(mode: &str) -> RGBColor {
    color(ModeKind::ALL.iter().position(|k| k.label() == mode).unwrap_or(9))
}

fn font(size: u32) -> TextStyle<'static> {
    (FAMILY, size).into_font().into()
}

/// The file stems of the charts of one group, in report order.
pub const NAMES: [&str; 10] = [
    "accuracy_time",
    "accuracy_samples",
    "throughput",
    "step_time",
    "loss_step",
    "loss_wall",
    "bytes",
    "staleness",
    "cost_model",
    "cost_extrapolation",
];

/// Where charts go, and those drawn so far.
pub struct Charts {
    dir: PathBuf,
    /// Drawn charts, in report order.
    pub charts: Vec<Chart>,
}

/// Write a centred note on an empty chart.
fn empty<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, msg: &str) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (w, h) = root.dim_in_pixel();
    root.draw(&Text::new(
        msg.to_string(),
        (20, h as i32 / 2),
        font(16).pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Left,
            plotters::style::text_anchor::VPos::Center,
        )),
    ))?;
    let _ = w;
    Ok(())
}

/// A chart frame: caption and the margins every chart shares. The caption's font shrinks (down
/// to 11 px) until the title fits the chart's width, so a long title (a model on an emulated
/// link) is never cut at both ends.
fn frame<'a, 'b, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    title: &str,
    caption: u32,
    y_area: u32,
) -> ChartBuilder<'a, 'b, DB> {
    let size = caption_size(root, title, caption);
    let mut b = ChartBuilder::on(root);
    b.caption(title, font(size)).margin(FRAME_MARGIN).x_label_area_size(45).y_label_area_size(y_area);
    b
}

/// Pixels around every chart.
const FRAME_MARGIN: u32 = 15;

/// The largest caption font size up to `max` (at least 11) at which `title` fits `root`'s
/// width inside the margins.
fn caption_size<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str, max: u32) -> u32 {
    let room = root.dim_in_pixel().0.saturating_sub(2 * FRAME_MARGIN);
    let fits = |size: u32| root.estimate_text_size(title, &font(size)).is_ok_and(|(w, _)| w <= room);
    (11..=max).rev().find(|&s| fits(s)).unwrap_or(11)
}

/// The series legend, the same on every chart.
fn legend<'a, DB, CT>(
    c: &mut ChartContext<'a, DB, CT>,
    size: u32,
    pos: SeriesLabelPosition,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: plotters::coord::CoordTranslate,
{
    c.configure_series_labels()
        .label_font(font(size))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(pos)
        .draw()?;
    Ok(())
}

/// Named, coloured curves as solid lines, each with its legend entry.
fn draw_lines<'a, DB>(
    c: &mut ChartContext<
        'a,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    curves: &[Line],
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
{
    for (name, col, pts) in curves {
        let col = *col;
        c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
        // A line of one point draws nothing: mark it.
        if let [p] = pts.as_slice() {
            c.draw_series(std::iter::once(Circle::new(*p, 4, col.filled())))?;
        }
    }
    Ok(())
}

fn max_or(v: impl Iterator<Item = f64>, d: f64) -> f64 {
    let m = v.filter(|x| x.is_finite()).fold(f64::NAN, f64::max);
    if m.is_finite() && m > 0.0 { m } else { d }
}

impl Charts {
    /// Charts into `dir`.
    pub fn new(dir: &Path) -> anyhow::Result<Charts> {
        register_font()?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Charts { dir: dir.to_path_buf(), charts: Vec::new() })
    }

    /// Every chart of one group.
    pub fn draw_group(&mut self, g: &Group, link: Option<Link>) -> anyhow::Result<()> {
        // A replay has no accuracy or loss, and no gradient of its goes stale in a way that
        // matters to anything but speed: its charts are the speed and traffic ones.
        let replay = g.replay();
        if !replay {
            self.accuracy(g, true)?;
            self.accuracy(g, false)?;
        }
        self.throughput(g)?;
        self.step_time(g)?;
        if !replay {
            self.loss(g, false)?;
            self.loss(g, true)?;
        }
        self.bytes(g)?;
        if !replay {
            self.staleness(g)?;
        }
        self.cost_model(g, link)?;
        self.extrapolation(g, link)?;
        if g.sweep.iter().any(|r| r.slow_ms > 0) {
            self.slowdown(g)?;
        }
        Ok(())
    }
}
/// "1 worker", "4 workers".
pub fn workers(n: usize) -> String {
    if n == 1 { "1 worker".into() } else { format!("{n} workers") }
}

/// Tick labels at whole numbers only (worker counts).
fn int_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
}

/// A bar label short enough to sit under one bar: `bsp4k2`, `ring4`, `dp2`, `local`, as the
/// mode's entry in the worker's table of compared modes writes it.
pub fn short_label(r: &Summary) -> String {
    let (n, k) = (r.workers.to_string(), r.shards.to_string());
    match r.mode.parse::<ModeKind>() {
        Ok(m) => m.compared().short.replace("{n}", &n).replace("{k}", &k),
        Err(_) => format!("{}{n}k{k}", r.mode.trim_start_matches("ps-")),
    }
}

/// How the bar labels under one axis are laid out: level when the widest fits its bar's slot
/// with room to spare, otherwise turned a quarter (each then as wide as the font is tall),
/// with the label area deep enough for the longest.
#[derive(Debug, Clone, Copy, PartialEq)]
struct BarLabels {
    /// Whether the labels are turned to run upwards.
    rotated: bool,
    /// Pixels below the axis for the labels (and the axis description).
    area: u32,
    /// Each label's extent along the axis, pixels (at most the slot less the gap).
    extent: u32,
}

/// Pixels kept clear between two neighbouring labels.
const LABEL_GAP: u32 = 6;
/// Room below the labels for the axis description.
const AXIS_DESC: u32 = 28;

/// The layout of bar labels of `size` px under bars `slot` px apart, given each label's
/// measured (width, height) in pixels.
fn bar_labels(sizes: &[(u32, u32)], slot: u32) -> BarLabels {
    let widest = sizes.iter().map(|s| s.0).max().unwrap_or(0);
    let tallest = sizes.iter().map(|s| s.1).max().unwrap_or(0);
    if widest + LABEL_GAP <= slot {
        BarLabels { rotated: false, area: (tallest + AXIS_DESC).max(45), extent: widest }
    } else {
        BarLabels { rotated: true, area: widest + AXIS_DESC + 10, extent: tallest }
    }
}

/// [`bar_labels`] for `labels` drawn in `style` on `root`, under `n` bars across
/// `plot_width` pixels.
fn lay_out_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    labels: &[String],
    style: &TextStyle,
    plot_width: u32,
    n: usize,
) -> BarLabels {
    let sizes: Vec<(u32, u32)> =
        labels.iter().map(|l| root.estimate_text_size(l, style).unwrap_or((0, 0))).collect();
    bar_labels(&sizes, plot_width / n.max(1) as u32)
}

#[cfg(test)]
mod tests {
    use plotters::prelude::*;

    /// Thirty runs of the longest labels: laid out under the step-time chart's bars, no two
    /// label boxes overlap, and every label fits the area below the axis.
    #[test]
    fn bar_labels_never_overlap() {
        super::register_font().unwrap();
        let mut svg = String::new();
        let root = SVGBackend::with_string(&mut svg, (2000, 560)).into_drawing_area();
        let labels: Vec<String> = (0..30).map(|i| format!("topk-bsp{}k{}", 16 + i, 16 + i)).collect();
        let style = super::font(12);
        for n in [2, 10, 16, 30] {
            let plot = super::speed::step_time_size(n).1;
            let l = super::lay_out_labels(&root, &labels[..n], &style, plot, n);
            let slot = plot as f64 / n as f64;
            // Label i is centred on bar i: its box spans the centre +- extent / 2.
            let boxes: Vec<(f64, f64)> = (0..n)
                .map(|i| {
                    let c = slot * (i as f64 + 0.5);
                    (c - l.extent as f64 / 2.0, c + l.extent as f64 / 2.0)
                })
                .collect();
            for w in boxes.windows(2) {
                assert!(w[0].1 < w[1].0, "{n} runs, {l:?}: labels overlap ({:?})", w);
            }
            let (widest, _) = root.estimate_text_size(&labels[n - 1], &style).unwrap();
            let along = if l.rotated { l.area } else { slot as u32 };
            assert!(widest <= along, "{n} runs, {l:?}: a label of {widest} px does not fit");
            assert!(l.rotated || n == 2, "{n} runs: {l:?}");
        }
        // A shared-memory ring is named like the others, without a shard count.
        let shm = crate::results::Summary { mode: "ddp-shm".into(), workers: 2, ..Default::default() };
        assert_eq!(super::short_label(&shm), "shm2");
    }

    #[test]
    fn a_long_caption_shrinks_to_the_chart_and_a_short_one_keeps_its_size() {
        super::register_font().unwrap();
        let mut svg = String::new();
        let root = SVGBackend::with_string(&mut svg, (900, 550)).into_drawing_area();
        let short = "Throughput against workers (MLP 64-1024-1024-10, global batch 64)";
        assert_eq!(super::caption_size(&root, short, 20), 20);
        let long = "Throughput against workers (MLP 64-1024-1024-10 on emulated links of 0.1 Gbit/s, \
                    global batch 64; median and range of repeats)";
        let size = super::caption_size(&root, long, 20);
        let (w, _) = root.estimate_text_size(long, &super::font(size)).unwrap();
        assert!(size < 20 && w <= 900 - 2 * super::FRAME_MARGIN, "size {size}: {w} px");
        let (w, _) = root.estimate_text_size(long, &super::font(20)).unwrap();
        assert!(w > 900 - 2 * super::FRAME_MARGIN, "at 20 px it would not fit: {w} px");
    }
}
