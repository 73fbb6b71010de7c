//! The report's charts, each drawn twice by the same code: an SVG (inlined in report.html) and
//! a PNG. Text is drawn with the DejaVu Sans font embedded in the binary, so PNGs render the
//! same on a machine with no fonts installed. No timestamps or random ids reach the output:
//! identical input gives byte-identical files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::cost::{self, Link};
use super::results::{Cell, Collected, EvalPoint, RunData, Summary, median};
use super::scenario::ModeKind;

/// DejaVu Sans (Bitstream Vera licence, see bench/assets/DejaVuSans-LICENSE.txt).
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

/// The figures of one chart group: one model at one global batch.
#[derive(Debug, Clone)]
pub struct Group<'a> {
    /// Suffix of the file names (empty for the only group).
    pub suffix: String,
    /// Model preset.
    pub model: String,
    /// Global batch.
    pub global_batch: usize,
    /// Parameters of the model.
    pub params: usize,
    /// Summaries of its runs with figures.
    pub rows: Vec<&'a Summary>,
    /// Its runs' metrics.
    pub runs: Vec<&'a RunData>,
    /// The straggler sweep: every run with figures, delayed or not (`rows` and `runs` hold
    /// only the undelayed ones, so the other charts compare like with like).
    pub sweep: Vec<&'a Summary>,
    /// The undelayed cells behind `rows` (same order), with their repeats' ranges.
    pub cells: Vec<&'a Cell>,
    /// The accuracy time-to-target is measured to.
    pub target: Option<f64>,
}

impl Group<'_> {
    /// Gradient bytes per step (f32).
    pub fn grad_bytes(&self) -> f64 {
        self.params as f64 * 4.0
    }

    /// Samples/s of the one-worker baseline: the local run, else the fastest one-worker run.
    pub fn baseline(&self) -> Option<f64> {
        let local = self.rows.iter().find(|r| r.mode == "local").and_then(|r| r.samples_per_s);
        local.or_else(|| {
            self.rows.iter().filter(|r| r.workers == 1).filter_map(|r| r.samples_per_s).reduce(f64::max)
        })
    }

    /// Series key of a row: the mode, with the shard count for PS modes and the wire its
    /// traffic crosses, so no label compares two wires unannounced.
    pub fn series(r: &Summary) -> String {
        let wire = r.mode.parse::<ModeKind>().map(ModeKind::wire).unwrap_or("");
        let name = if r.shards > 0 { format!("{} k={}", r.mode, r.shards) } else { r.mode.clone() };
        match wire {
            "" | "none" => name,
            w => format!("{name} ({w})"),
        }
    }

    /// The cell behind a row of `rows`.
    pub fn cell_of(&self, r: &Summary) -> Option<&Cell> {
        self.cells.iter().copied().find(|c| std::ptr::eq(&c.median, r))
    }

    /// Per cell with a convergence curve: the median held-out accuracy and training time at
    /// each evaluation point over its complete repeats, at the cadence they share.
    pub fn accuracy_curves(&self) -> Vec<(&Summary, Vec<EvalPoint>)> {
        self.cells
            .iter()
            .map(|c| {
                let curves: Vec<Vec<EvalPoint>> =
                    self.runs.iter().filter(|r| c.runs.contains(&r.id)).map(|r| r.accuracy_curve()).collect();
                let mut at: BTreeMap<u64, Vec<EvalPoint>> = BTreeMap::new();
                for p in curves.iter().flatten() {
                    at.entry(p.samples).or_default().push(*p);
                }
                let pts = at
                    .into_iter()
                    .filter(|(_, v)| 2 * v.len() > curves.len())
                    .filter_map(|(samples, v)| {
                        let m = |g: fn(&EvalPoint) -> f64| median(&v.iter().map(g).collect::<Vec<_>>());
                        Some(EvalPoint {
                            samples,
                            epoch: m(|p| p.epoch)?,
                            train_s: m(|p| p.train_s)?,
                            accuracy: m(|p| p.accuracy)?,
                            loss: m(|p| p.loss).unwrap_or(f64::NAN),
                        })
                    })
                    .collect();
                (&c.median, pts)
            })
            .filter(|(_, p): &(&Summary, Vec<EvalPoint>)| !p.is_empty())
            .collect()
    }

    /// Rows by series, in mode order then shard count, each sorted by workers.
    pub fn by_series(&self) -> Vec<(String, Vec<&Summary>)> {
        let mut m: BTreeMap<(usize, usize, String), Vec<&Summary>> = BTreeMap::new();
        for r in &self.rows {
            let order = ModeKind::ALL.iter().position(|k| k.label() == r.mode).unwrap_or(99);
            m.entry((order, r.shards, Self::series(r))).or_default().push(r);
        }
        m.into_iter()
            .map(|((_, _, k), mut v)| {
                v.sort_by_key(|r| r.workers);
                (k, v)
            })
            .collect()
    }

    /// The TCP ring's measured exchanges as (ranks, gradient bytes, seconds per step), for
    /// fitting the ring model.
    pub fn ring_points(&self) -> Vec<(usize, f64, f64)> {
        self.rows
            .iter()
            .filter(|r| r.mode == "ddp-tcp" && r.workers > 1)
            .filter_map(|r| Some((r.workers, self.grad_bytes(), r.comm_ms? / 1e3)))
            .collect()
    }

    /// The straggler sweep per series (mode, workers, shards): (injected ms, slowdown) points
    /// sorted by delay, where the slowdown is the time per global step (global batch over
    /// samples/s) with the delay over the same without it. Series without an undelayed run or
    /// without a delayed one are left out.
    pub fn slowdowns(&self) -> Vec<Slowdown<'_>> {
        let mut m: BTreeMap<(usize, usize, usize), Vec<&Summary>> = BTreeMap::new();
        for r in &self.sweep {
            let order = ModeKind::ALL.iter().position(|k| k.label() == r.mode).unwrap_or(99);
            m.entry((order, r.workers, r.shards)).or_default().push(r);
        }
        m.into_values()
            .filter_map(|v| {
                let base = v.iter().find(|r| r.slow_ms == 0)?.samples_per_s?;
                let mut pts: Vec<(f64, f64)> =
                    v.iter().filter_map(|r| Some((r.slow_ms as f64, base / r.samples_per_s?))).collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (pts.len() > 1).then(|| {
                    let r = v[0];
                    Slowdown {
                        name: format!("{} ({})", Self::series(r), workers(r.workers)),
                        mode: r.mode.as_str(),
                        workers: r.workers,
                        shards: r.shards,
                        points: pts,
                    }
                })
            })
            .collect()
    }

    /// Seconds per global step of an undelayed series, for converting slowdowns to ms.
    pub fn undelayed_step_s(&self, mode: &str, workers: usize, shards: usize) -> Option<f64> {
        let r = self
            .sweep
            .iter()
            .find(|r| r.mode == mode && r.workers == workers && r.shards == shards && r.slow_ms == 0)?;
        Some(r.global_batch as f64 / r.samples_per_s?)
    }

    /// For each mode, its run at the most workers (fewest shards on a tie).
    pub fn widest_per_mode(&self) -> Vec<&RunData> {
        let mut best: BTreeMap<ModeKind, &RunData> = BTreeMap::new();
        for r in &self.runs {
            let e = best.entry(r.mode).or_insert(r);
            if (r.world(), std::cmp::Reverse(r.shards())) > (e.world(), std::cmp::Reverse(e.shards())) {
                *e = r;
            }
        }
        best.into_values().collect()
    }
}

/// One series of the straggler sweep.
#[derive(Debug, Clone)]
pub struct Slowdown<'a> {
    /// Legend name: mode, shards, workers.
    pub name: String,
    /// Mode label.
    pub mode: &'a str,
    /// Workers.
    pub workers: usize,
    /// Server shards (0: none).
    pub shards: usize,
    /// (injected ms, slowdown), sorted by delay; the first is (0, 1).
    pub points: Vec<(f64, f64)>,
}

/// Split the summaries into chart groups (model x global batch), with their runs.
/// Only complete runs take part: each group's rows are its cells' medians over their complete
/// repeats, and its runs the complete ones.
pub fn groups(c: &Collected) -> Vec<Group<'_>> {
    let cells: Vec<&Cell> = c.cells.iter().filter(|x| x.median.samples_per_s.is_some()).collect();
    let mut keys: Vec<(String, usize)> =
        cells.iter().map(|x| (x.median.model.clone(), x.median.global_batch)).collect();
    keys.sort();
    keys.dedup();
    let many = keys.len() > 1;
    keys.into_iter()
        .map(|(model, gb)| {
            let mine: Vec<&Cell> = cells
                .iter()
                .copied()
                .filter(|x| x.median.model == model && x.median.global_batch == gb)
                .collect();
            let sweep: Vec<&Summary> = mine.iter().map(|x| &x.median).collect();
            let undelayed: Vec<&Cell> = mine.iter().copied().filter(|x| x.median.slow_ms == 0).collect();
            let rows: Vec<&Summary> = undelayed.iter().map(|x| &x.median).collect();
            let runs = c.runs.iter().filter(|d| undelayed.iter().any(|x| x.runs.contains(&d.id))).collect();
            Group {
                sweep,
                suffix: if many { format!("-{model}-b{gb}") } else { String::new() },
                params: rows.iter().map(|r| r.params).max().unwrap_or(0),
                model,
                global_batch: gb,
                rows,
                runs,
                cells: undelayed,
                target: c.target,
            }
        })
        .collect()
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

/// A chart frame: caption and the margins every chart shares.
fn frame<'a, 'b, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    title: &str,
    caption: u32,
    y_area: u32,
) -> ChartBuilder<'a, 'b, DB> {
    let mut b = ChartBuilder::on(root);
    b.caption(title, font(caption)).margin(15).x_label_area_size(45).y_label_area_size(y_area);
    b
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
        self.accuracy(g, true)?;
        self.accuracy(g, false)?;
        self.throughput(g)?;
        self.step_time(g)?;
        self.loss(g, false)?;
        self.loss(g, true)?;
        self.bytes(g)?;
        self.staleness(g)?;
        self.cost_model(g, link)?;
        self.extrapolation(g, link)?;
        if g.sweep.iter().any(|r| r.slow_ms > 0) {
            self.slowdown(g)?;
        }
        Ok(())
    }

    /// The straggler sweep: slowdown of each series against the injected delay, with the
    /// two bounds that frame it: 1 (nobody waits) and "the whole delay is paid every step".
    fn slowdown(&mut self, g: &Group) -> anyhow::Result<()> {
        let series = g.slowdowns();
        let xmax = max_or(g.sweep.iter().map(|r| r.slow_ms as f64), 1.0);
        // The "whole delay paid" lines end at (t0 + xmax) / t0; keep them inside the frame.
        let full_at_max = series
            .iter()
            .filter_map(|s| Some(1.0 + xmax / 1e3 / g.undelayed_step_s(s.mode, s.workers, s.shards)?));
        let ymax = max_or(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).chain(full_at_max), 1.0)
            .max(1.0)
            * 1.1;
        let title = format!(
            "Slowdown against one straggler's injected delay ({}, global batch {})",
            g.model, g.global_batch
        );
        render!(self, format!("slowdown{}", g.suffix), title.clone(), (900, 560), |root| {
            if series.is_empty() {
                empty(&root, "no series has both an undelayed and a delayed run")?;
            } else {
                let mut c = frame(&root, &title, 18, 70).build_cartesian_2d(0f64..xmax * 1.05, 0f64..ymax)?;
                c.configure_mesh()
                    .x_desc("injected delay of one rank, ms per step")
                    .y_desc("time per global step / undelayed")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .y_label_formatter(&|y| format!("{y:.1}x"))
                    .draw()?;
                c.draw_series(DashedLineSeries::new(
                    [(0.0, 1.0), (xmax * 1.05, 1.0)],
                    8,
                    6,
                    BLACK.stroke_width(1),
                ))?
                .label("no slowdown")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
                for (i, s) in series.iter().enumerate() {
                    let (name, pts) = (&s.name, &s.points);
                    let col = color(i);
                    if let Some(t0) = g.undelayed_step_s(s.mode, s.workers, s.shards) {
                        // Waiting for the straggler every step: (t0 + d) / t0.
                        let full = [(0.0, 1.0), (xmax, 1.0 + xmax / 1e3 / t0)];
                        c.draw_series(DashedLineSeries::new(full, 3, 4, col.stroke_width(1)))?;
                    }
                    c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
                        .label(name.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2))
                        });
                    c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, col.filled())))?;
                }
                legend(&mut c, 13, SeriesLabelPosition::UpperLeft)?;
            }
        });
        Ok(())
    }

    fn throughput(&mut self, g: &Group) -> anyhow::Result<()> {
        let series = g.by_series();
        let wmax = g.rows.iter().map(|r| r.workers).max().unwrap_or(1) as f64;
        let base = g.baseline();
        let ymax =
            max_or(g.rows.iter().filter_map(|r| r.samples_per_s).chain(base.map(|b| b * wmax)), 1.0) * 1.1;
        let title = format!(
            "Throughput against workers ({}, global batch {}; median and range of repeats)",
            g.model, g.global_batch
        );
        render!(self, format!("throughput{}", g.suffix), title.clone(), (900, 560), |root| {
            let mut c = frame(&root, &title, 20, 70).build_cartesian_2d(0.5f64..wmax + 0.5, 0f64..ymax)?;
            c.configure_mesh()
                .x_desc("workers")
                .y_desc("samples/s")
                .label_style(font(13))
                .axis_desc_style(font(14))
                .x_labels(wmax as usize + 2)
                .x_label_formatter(&int_label)
                .y_label_formatter(&|y| format!("{y:.0}"))
                .draw()?;
            if let Some(b) = base {
                let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
                ws.sort();
                ws.dedup();
                c.draw_series(DashedLineSeries::new(
                    ws.iter().map(|&w| (w as f64, b * w as f64)),
                    8,
                    6,
                    BLACK.stroke_width(2),
                ))?
                .label("ideal linear (n x local)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
            }
            for (i, (name, rows)) in series.iter().enumerate() {
                let col = color(i);
                let pts: Vec<(f64, f64)> =
                    rows.iter().filter_map(|r| Some((r.workers as f64, r.samples_per_s?))).collect();
                c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
                    .label(name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
                c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, col.filled())))?;
                // The range over the repeats (the point is their median).
                let bars = rows.iter().filter_map(|r| {
                    let (lo, hi) = g.cell_of(r)?.throughput?;
                    Some(ErrorBar::new_vertical(r.workers as f64, lo, r.samples_per_s?, hi, col.filled(), 8))
                });
                c.draw_series(bars)?;
            }
            legend(&mut c, 13, SeriesLabelPosition::UpperLeft)?;
        });
        Ok(())
    }

    fn step_time(&mut self, g: &Group) -> anyhow::Result<()> {
        let mut rows: Vec<&Summary> = g.rows.iter().copied().filter(|r| r.step_ms.is_some()).collect();
        rows.sort_by_key(|r| {
            (ModeKind::ALL.iter().position(|k| k.label() == r.mode).unwrap_or(99), r.workers, r.shards)
        });
        let parts: [Phase; 6] = [
            ("forward", |r| r.forward_ms, color(0)),
            ("backward", |r| r.backward_ms, color(1)),
            ("exposed comm", |r| r.comm_exposed_ms, color(3)),
            ("wait", |r| r.wait_ms, color(4)),
            ("update", |r| r.update_ms, color(2)),
            ("other", |r| r.other_ms, color(7)),
        ];
        let n = rows.len().max(2);
        let ymax = max_or(rows.iter().filter_map(|r| r.step_ms), 1.0) * 1.15;
        let title = format!("Step time by phase ({}, global batch {})", g.model, g.global_batch);
        let labels: Vec<String> = rows.iter().map(|r| short_label(r)).collect();
        let width = (140 + 62 * n as u32).max(900);
        render!(self, format!("step_time{}", g.suffix), title.clone(), (width, 560), |root| {
            if rows.is_empty() {
                empty(&root, "no run with step timings")?;
            } else {
                let mut c = frame(&root, &title, 20, 70)
                    .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..ymax)?;
                c.configure_mesh()
                    .disable_x_mesh()
                    .x_labels(n)
                    .x_desc("run (mode, workers, shards)")
                    .y_desc("ms per step (mean over ranks and steps)")
                    .label_style(font(12))
                    .axis_desc_style(font(14))
                    .x_label_formatter(&|v| match v {
                        SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                        _ => String::new(),
                    })
                    .draw()?;
                for (name, get, col) in parts {
                    let bars = rows.iter().enumerate().filter_map(|(i, r)| {
                        let below: f64 =
                            parts.iter().take_while(|p| p.0 != name).filter_map(|p| (p.1)(r)).sum();
                        let v = get(r)?;
                        let mut bar = Rectangle::new(
                            [(SegmentValue::Exact(i), below), (SegmentValue::Exact(i + 1), below + v)],
                            col.filled(),
                        );
                        bar.set_margin(0, 0, 8, 8);
                        Some(bar)
                    });
                    c.draw_series(bars)?
                        .label(name)
                        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.filled()));
                }
                legend(&mut c, 13, SeriesLabelPosition::UpperLeft)?;
            }
        });
        Ok(())
    }

    /// Held-out accuracy against training time (evaluation left out) or samples seen, the
    /// median of each cell's complete repeats, at the largest worker count (and local), with
    /// the target dashed: where a curve crosses it is that mode's time-to-accuracy.
    fn accuracy(&mut self, g: &Group, time: bool) -> anyhow::Result<()> {
        let all = g.accuracy_curves();
        let wmax = all.iter().map(|(r, _)| r.workers).max().unwrap_or(1);
        let curves: Vec<Line> = all
            .iter()
            .filter(|(r, _)| r.workers == wmax || r.mode == "local")
            .enumerate()
            .map(|(i, (r, pts))| {
                let name = format!("{}, {}", Group::series(r), workers(r.workers));
                let xy =
                    pts.iter().map(|p| (if time { p.train_s } else { p.samples as f64 }, 100.0 * p.accuracy));
                (name, color(i), xy.collect())
            })
            .collect();
        let xmax = max_or(curves.iter().flat_map(|c| c.2.iter().map(|p| p.0)), 1.0) * 1.02;
        // From the lowest median reached after the first evaluation, so the end game is visible.
        let ymin = curves
            .iter()
            .filter_map(|c| c.2.get(1).map(|p| p.1))
            .fold(100.0f64, f64::min)
            .min(g.target.map_or(100.0, |t| 100.0 * t - 2.0))
            .clamp(0.0, 95.0);
        let (name, xdesc) = if time {
            ("accuracy_time", "training time, s (evaluation left out; median of repeats)")
        } else {
            ("accuracy_samples", "samples seen by all workers")
        };
        let title = format!(
            "Held-out accuracy against {} ({}, global batch {})",
            if time { "time" } else { "samples" },
            g.model,
            g.global_batch
        );
        render!(self, format!("{name}{}", g.suffix), title.clone(), (900, 560), |root| {
            if curves.is_empty() {
                empty(&root, "no complete run evaluated on held-out data")?;
            } else {
                let mut c = frame(&root, &title, 20, 70).build_cartesian_2d(0f64..xmax, ymin..100.5f64)?;
                c.configure_mesh()
                    .x_desc(xdesc)
                    .y_desc("held-out accuracy, % (median of repeats)")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .draw()?;
                if let Some(t) = g.target {
                    c.draw_series(DashedLineSeries::new(
                        [(0.0, 100.0 * t), (xmax, 100.0 * t)],
                        8,
                        6,
                        BLACK.stroke_width(1),
                    ))?
                    .label(format!("target {:.1}%", 100.0 * t))
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
                }
                draw_lines(&mut c, &curves)?;
                legend(&mut c, 12, SeriesLabelPosition::LowerRight)?;
            }
        });
        Ok(())
    }

    fn loss(&mut self, g: &Group, wall: bool) -> anyhow::Result<()> {
        let runs = g.widest_per_mode();
        let curves: Vec<Line> = runs
            .iter()
            .map(|r| {
                let pts = r
                    .loss_curve()
                    .into_iter()
                    .map(|(s, l, w)| (if wall { w } else { s as f64 }, l))
                    .collect();
                let name = format!(
                    "{} ({}{})",
                    r.mode.label(),
                    workers(r.world()),
                    if r.shards() > 0 { format!(", k={}", r.shards()) } else { String::new() }
                );
                (name, mode_color(r.mode.label()), pts)
            })
            .collect();
        let xmax = max_or(curves.iter().flat_map(|c| c.2.iter().map(|p| p.0)), 1.0);
        // A spike (an unstable asynchronous run) must not flatten every other curve: the axis
        // stops at twice the highest starting loss, and what lies above is cut off.
        let start = max_or(curves.iter().filter_map(|c| c.2.first().map(|p| p.1)), 1.0);
        let ymax = max_or(curves.iter().flat_map(|c| c.2.iter().map(|p| p.1)), 1.0).min(2.0 * start) * 1.05;
        let (name, xdesc) = if wall { ("loss_wall", "wall-clock time (s)") } else { ("loss_step", "step") };
        let title = format!(
            "Training loss against {} ({}, global batch {})",
            if wall { "time" } else { "step" },
            g.model,
            g.global_batch
        );
        render!(self, format!("{name}{}", g.suffix), title.clone(), (900, 560), |root| {
            if curves.is_empty() {
                empty(&root, "no run with loss figures")?;
            } else {
                let mut c = frame(&root, &title, 20, 70).build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
                c.configure_mesh()
                    .x_desc(xdesc)
                    .y_desc("mean training loss over ranks")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .draw()?;
                draw_lines(&mut c, &curves)?;
                legend(&mut c, 13, SeriesLabelPosition::UpperRight)?;
            }
        });
        Ok(())
    }

    fn bytes(&mut self, g: &Group) -> anyhow::Result<()> {
        const MB: f64 = 1e6;
        let s = g.grad_bytes();
        let series = g.by_series();
        let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
        ws.sort();
        ws.dedup();
        let wmax = ws.last().copied().unwrap_or(1) as f64;
        let has = |m: &str| g.rows.iter().any(|r| r.mode.starts_with(m));
        let mut theory: Vec<Line> = Vec::new();
        if has("ddp") {
            theory.push((
                "ring, per worker (theory)".into(),
                mode_color("ddp-tcp"),
                ws.iter().map(|&n| (n as f64, cost::ring_bytes_per_worker(n, s) / MB)).collect(),
            ));
        }
        if has("ps") {
            theory.push((
                "PS, per worker (theory)".into(),
                mode_color("ps-bsp"),
                ws.iter().map(|&n| (n as f64, cost::ps_bytes_per_worker(s) / MB)).collect(),
            ));
            theory.push((
                "PS, all servers (theory)".into(),
                BLACK,
                ws.iter().map(|&n| (n as f64, cost::ps_bytes_at_servers(n, s) / MB)).collect(),
            ));
        }
        let mut measured: Vec<Measured> = Vec::new();
        // ASP and SSP move the same bytes per step as BSP: measuring BSP and the ring suffices.
        for (i, (name, rows)) in
            series.iter().enumerate().filter(|(_, (n, _))| n.starts_with("ps-bsp") || n.starts_with("ddp"))
        {
            let family = if name.starts_with("ddp") { mode_color("ddp-tcp") } else { mode_color("ps-bsp") };
            let w: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|r| Some((r.workers as f64, r.bytes_per_step_worker? / MB)))
                .filter(|p| p.1 > 0.0)
                .collect();
            if !w.is_empty() {
                measured.push((format!("{name}, per worker"), family, false, w));
            }
            let sv: Vec<(f64, f64)> =
                rows.iter().filter_map(|r| Some((r.workers as f64, r.bytes_per_step_server? / MB))).collect();
            if !sv.is_empty() {
                measured.push((format!("{name}, all servers"), color(6 + i % 4), true, sv));
            }
        }
        let ymax = max_or(
            theory
                .iter()
                .flat_map(|t| t.2.iter().map(|p| p.1))
                .chain(measured.iter().flat_map(|m| m.3.iter().map(|p| p.1))),
            1.0,
        ) * 1.1;
        let title = format!("Bytes moved per step ({}: {:.1} MB of gradients)", g.model, s / MB);
        render!(self, format!("bytes{}", g.suffix), title.clone(), (900, 560), |root| {
            if theory.is_empty() && measured.is_empty() {
                empty(&root, "no run that communicates over the network")?;
            } else {
                let mut c =
                    frame(&root, &title, 20, 70).build_cartesian_2d(0.5f64..wmax + 0.5, 0f64..ymax)?;
                c.configure_mesh()
                    .x_desc("workers")
                    .y_desc("MB sent + received per step")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .x_labels(wmax as usize + 2)
                    .x_label_formatter(&int_label)
                    .draw()?;
                for (name, col, pts) in &theory {
                    let col = *col;
                    c.draw_series(DashedLineSeries::new(pts.clone(), 8, 6, col.stroke_width(2)))?
                        .label(name.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 8, y)], col.stroke_width(2))
                        });
                }
                for (name, col, server, pts) in &measured {
                    let col = *col;
                    c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?;
                    if *server {
                        c.draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 6, col.filled())))?
                            .label(name.clone())
                            .legend(move |(x, y)| TriangleMarker::new((x + 8, y), 6, col.filled()));
                    } else {
                        c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, col.filled())))?
                            .label(name.clone())
                            .legend(move |(x, y)| Circle::new((x + 8, y), 4, col.filled()));
                    }
                }
                legend(&mut c, 12, SeriesLabelPosition::UpperLeft)?;
            }
        });
        Ok(())
    }

    fn staleness(&mut self, g: &Group) -> anyhow::Result<()> {
        let hists: Vec<(String, RGBColor, BTreeMap<u64, usize>)> = g
            .widest_per_mode()
            .into_iter()
            .filter(|r| matches!(r.mode, ModeKind::PsAsp | ModeKind::PsSsp))
            .filter_map(|r| {
                let v = r.staleness();
                if v.is_empty() {
                    return None;
                }
                let mut h = BTreeMap::new();
                for s in v {
                    *h.entry(s).or_insert(0) += 1;
                }
                Some((format!("{} ({})", r.mode.label(), workers(r.world())), mode_color(r.mode.label()), h))
            })
            .collect();
        let xmax = hists.iter().flat_map(|h| h.2.keys().copied()).max().unwrap_or(1) as f64 + 1.0;
        let ymax = max_or(hists.iter().flat_map(|h| h.2.values().map(|&c| c as f64)), 1.0) * 1.1;
        let title = format!("Staleness of applied gradients, ASP and SSP ({})", g.model);
        let nh = hists.len().max(1) as f64;
        render!(self, format!("staleness{}", g.suffix), title.clone(), (900, 520), |root| {
            if hists.is_empty() {
                empty(&root, "no ASP or SSP run reported staleness")?;
            } else {
                let mut c =
                    frame(&root, &title, 20, 70).build_cartesian_2d(-0.5f64..xmax - 0.5, 0f64..ymax)?;
                c.configure_mesh()
                    .x_desc("staleness (server versions between pull and apply)")
                    .y_desc("gradients")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .x_label_formatter(&|x| if x.fract() == 0.0 { format!("{x:.0}") } else { String::new() })
                    .draw()?;
                for (i, (name, col, h)) in hists.iter().enumerate() {
                    let col = *col;
                    let w = 0.8 / nh;
                    let x0 = -0.4 + i as f64 * w;
                    c.draw_series(h.iter().map(|(&s, &n)| {
                        Rectangle::new([(s as f64 + x0, 0.0), (s as f64 + x0 + w, n as f64)], col.filled())
                    }))?
                    .label(name.clone())
                    .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.filled()));
                }
                legend(&mut c, 13, SeriesLabelPosition::UpperRight)?;
            }
        });
        Ok(())
    }

    fn cost_model(&mut self, g: &Group, link: Option<Link>) -> anyhow::Result<()> {
        let s = g.grad_bytes();
        let wmax = g.rows.iter().map(|r| r.workers).max().unwrap_or(1);
        let mut shards: Vec<usize> = g.rows.iter().filter(|r| r.shards > 0).map(|r| r.shards).collect();
        shards.sort();
        shards.dedup();
        let ns: Vec<usize> = (1..=wmax.max(2)).collect();
        let mut model: Vec<Line> = Vec::new();
        if let Some(l) = link {
            model.push((
                "ring model".into(),
                color(0),
                ns.iter().map(|&n| (n as f64, cost::ring(n, s, l) * 1e3)).collect(),
            ));
            for (i, &k) in shards.iter().enumerate() {
                model.push((
                    format!("PS model, k={k}"),
                    color(1 + i * 2),
                    ns.iter().map(|&n| (n as f64, cost::ps(n, k, s, l) * 1e3)).collect(),
                ));
            }
        }
        // The ring model fitted to the ring's own measurements, where they pin it down.
        let ring_pts = g.ring_points();
        if let Some(fit) = cost::fit_ring(&ring_pts).filter(|_| ring_pts.len() >= 2) {
            model.push((
                format!("ring fitted: a = {:.1} us, B = {:.2} GB/s", fit.a * 1e6, fit.b / 1e9),
                BLACK,
                ns.iter().map(|&n| (n as f64, cost::ring(n, s, fit) * 1e3)).collect(),
            ));
        }
        let measured: Vec<Line> = g
            .by_series()
            .into_iter()
            // The model is of a synchronous exchange: BSP and the ring.
            .filter(|(_, rows)| rows.first().is_some_and(|r| r.mode == "ps-bsp" || r.mode.starts_with("ddp")))
            .map(|(name, rows)| {
                let col = match rows.first().map(|r| r.shards) {
                    Some(k) if k > 0 => color(1 + 2 * shards.iter().position(|&x| x == k).unwrap_or(0)),
                    _ => color(0),
                };
                let pts = rows.iter().filter_map(|r| Some((r.workers as f64, r.comm_ms?))).collect();
                (format!("{name} measured"), col, pts)
            })
            .collect();
        let ymax = max_or(model.iter().chain(&measured).flat_map(|m| m.2.iter().map(|p| p.1)), 1.0) * 1.1;
        let title = match link {
            Some(l) => format!(
                "Communication per step: alpha-beta model (a = {:.1} us, B = {:.2} GB/s) and measurements",
                l.a * 1e6,
                l.b / 1e9
            ),
            None => "Communication per step: measurements (no link figures to fit the model)".into(),
        };
        render!(self, format!("cost_model{}", g.suffix), title.clone(), (1000, 560), |root| {
            if model.is_empty() && measured.iter().all(|m| m.2.is_empty()) {
                empty(&root, "no link measurement and no communicating run")?;
            } else {
                let mut c = frame(&root, &title, 17, 70)
                    .build_cartesian_2d(0.5f64..wmax.max(2) as f64 + 0.5, 0f64..ymax)?;
                c.configure_mesh()
                    .x_desc("workers")
                    .y_desc("ms of communication per step")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .x_labels(wmax.max(2) + 2)
                    .x_label_formatter(&int_label)
                    .draw()?;
                for (name, col, pts) in &model {
                    let col = *col;
                    c.draw_series(DashedLineSeries::new(pts.clone(), 8, 6, col.stroke_width(2)))?
                        .label(name.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 8, y)], col.stroke_width(2))
                        });
                }
                for (name, col, pts) in &measured {
                    let col = *col;
                    c.draw_series(pts.iter().map(|&p| Circle::new(p, 5, col.filled())))?
                        .label(name.clone())
                        .legend(move |(x, y)| Circle::new((x + 8, y), 4, col.filled()));
                }
                legend(&mut c, 12, SeriesLabelPosition::UpperLeft)?;
            }
        });
        Ok(())
    }

    fn extrapolation(&mut self, g: &Group, link: Option<Link>) -> anyhow::Result<()> {
        let s = g.grad_bytes();
        let a = link.map(|l| l.a);
        let ns: Vec<usize> = (0..=10).map(|p| 1usize << p).collect();
        let mut lines: Vec<Dashed> = Vec::new();
        if let Some(a) = a {
            for (i, gb) in [1.0, 10.0, 100.0].into_iter().enumerate() {
                let l = Link { a, b: cost::gbit(gb) };
                let col = color(i * 3);
                let pts = |f: &dyn Fn(usize) -> f64| -> Vec<(f64, f64)> {
                    ns.iter().skip(1).map(|&n| (n as f64, f(n) * 1e3)).collect()
                };
                lines.push((format!("ring, {gb:.0} Gbit/s (solid)"), col, 0, pts(&|n| cost::ring(n, s, l))));
                lines.push((
                    format!("PS k=1, {gb:.0} Gbit/s (dotted)"),
                    col,
                    3,
                    pts(&|n| cost::ps(n, 1, s, l)),
                ));
                lines.push((
                    format!("PS k=n, {gb:.0} Gbit/s (dashed)"),
                    col,
                    10,
                    pts(&|n| cost::ps(n, n, s, l)),
                ));
            }
        }
        let ymin = lines
            .iter()
            .flat_map(|l| l.3.iter().map(|p| p.1))
            .filter(|&y| y > 0.0)
            .fold(f64::INFINITY, f64::min);
        let ymax = max_or(lines.iter().flat_map(|l| l.3.iter().map(|p| p.1)), 1.0);
        let title = format!(
            "Model extrapolated to 1024 workers ({}: {:.1} MB of gradients, a = {})",
            g.model,
            s / 1e6,
            a.map(|a| format!("{:.1} us", a * 1e6)).unwrap_or_else(|| "unmeasured".into())
        );
        render!(self, format!("cost_extrapolation{}", g.suffix), title.clone(), (1000, 600), |root| {
            if lines.is_empty() {
                empty(&root, "no latency measurement in these runs: nothing to extrapolate")?;
            } else {
                let mut c = frame(&root, &title, 17, 80)
                    .build_cartesian_2d((2f64..1024f64).log_scale(), (ymin * 0.8..ymax * 1.25).log_scale())?;
                c.configure_mesh()
                    .x_desc("workers (log)")
                    .y_desc("ms of communication per step (log)")
                    .label_style(font(13))
                    .axis_desc_style(font(14))
                    .x_label_formatter(&|x| format!("{x:.0}"))
                    .y_label_formatter(&|y| if *y >= 1.0 { format!("{y:.0}") } else { format!("{y:.2}") })
                    .draw()?;
                for (name, col, dash, pts) in &lines {
                    let (col, dash) = (*col, *dash);
                    if dash == 0 {
                        c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
                    } else {
                        c.draw_series(DashedLineSeries::new(pts.clone(), dash, 5, col.stroke_width(2)))?
                    }
                    .label(name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
                }
                legend(&mut c, 12, SeriesLabelPosition::UpperLeft)?;
            }
        });
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

/// A bar label short enough to sit under one bar: `bsp4k2`, `ring4`, `dp2`, `local`.
pub fn short_label(r: &Summary) -> String {
    let n = r.workers;
    match r.mode.as_str() {
        "local" => "local".into(),
        "dp" => format!("dp{n}"),
        "ddp-tcp" => format!("ring{n}"),
        "ddp-nccl" => format!("nccl{n}"),
        m => format!("{}{n}k{}", m.trim_start_matches("ps-"), r.shards),
    }
}
