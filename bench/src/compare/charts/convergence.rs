//! The convergence family: held-out accuracy against training time and against samples seen
//! (median of the repeats, the target dashed), and the training loss against steps and time.

use super::*;

impl Charts {
    /// Held-out accuracy against training time (evaluation left out) or samples seen, the
    /// median of each cell's complete repeats, at the largest worker count (and local), with
    /// the target dashed: where a curve crosses it is that mode's time-to-accuracy.
    pub(super) fn accuracy(&mut self, g: &Group, time: bool) -> anyhow::Result<()> {
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

    pub(super) fn loss(&mut self, g: &Group, wall: bool) -> anyhow::Result<()> {
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
}
