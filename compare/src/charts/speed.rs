//! The speed family: samples/s per mode and worker count (with the repeats' range), the step
//! split into its phases, and the straggler sweep's slowdown.

use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::*;

/// The step-time chart's y label area, pixels.
const STEP_Y_AREA: u32 = 70;

/// The step-time chart's width for `n` bars and the width of its plotting area, pixels.
pub(super) fn step_time_size(n: usize) -> (u32, u32) {
    let width = (140 + 62 * n as u32).max(900);
    (width, width - 2 * FRAME_MARGIN - STEP_Y_AREA)
}

impl Charts {
    pub(super) fn throughput(&mut self, g: &Group) -> anyhow::Result<()> {
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

    pub(super) fn step_time(&mut self, g: &Group) -> anyhow::Result<()> {
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
        let (width, plot) = step_time_size(n);
        render!(self, format!("step_time{}", g.suffix), title.clone(), (width, 560), |root| {
            if rows.is_empty() {
                empty(&root, "no run with step timings")?;
            } else {
                let layout = lay_out_labels(&root, &labels, &font(12), plot, n);
                let mut c = frame(&root, &title, 20, STEP_Y_AREA)
                    .x_label_area_size(layout.area)
                    .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..ymax)?;
                c.configure_mesh()
                    .disable_x_mesh()
                    .x_labels(n)
                    .x_desc("run (mode, workers, shards)")
                    .y_desc("ms per step (mean over ranks and steps)")
                    .label_style(font(12))
                    .axis_desc_style(font(14))
                    // Turned labels are drawn below, each ending at the axis (plotters centres a
                    // turned tick label on its tick, half of it inside the plot).
                    .x_label_formatter(&|v| match v {
                        SegmentValue::CenterOf(i) if !layout.rotated => {
                            labels.get(*i).cloned().unwrap_or_default()
                        }
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
                if layout.rotated {
                    let turned =
                        font(12).transform(FontTransform::Rotate270).pos(Pos::new(HPos::Right, VPos::Center));
                    for (i, label) in labels.iter().enumerate() {
                        let (x, y) = c.backend_coord(&(SegmentValue::CenterOf(i), 0.0));
                        root.draw(&Text::new(label.clone(), (x, y + LABEL_GAP as i32), turned.clone()))?;
                    }
                }
                legend(&mut c, 13, SeriesLabelPosition::UpperLeft)?;
            }
        });
        Ok(())
    }

    /// The straggler sweep: slowdown of each series against the injected delay, with the
    /// two bounds that frame it: 1 (nobody waits) and "the whole delay is paid every step".
    pub(super) fn slowdown(&mut self, g: &Group) -> anyhow::Result<()> {
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
}
