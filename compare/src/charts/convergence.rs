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
        let ymin = accuracy_floor(&curves, g.target);
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

/// The bottom of an accuracy chart, %: a point below the lowest median reached after the first
/// evaluation (or at the only one), so the end game is visible and no curve lies on or below
/// the frame; at most 95, and 2 below the target.
fn accuracy_floor(curves: &[Line], target: Option<f64>) -> f64 {
    let after_first = |pts: &[(f64, f64)]| {
        let tail = if pts.len() > 1 { &pts[1..] } else { pts };
        tail.iter().map(|p| p.1).reduce(f64::min)
    };
    (curves.iter().filter_map(|c| after_first(&c.2)).fold(100.0f64, f64::min) - 1.0)
        .min(target.map_or(100.0, |t| 100.0 * t - 2.0))
        .clamp(0.0, 95.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run evaluated once (a step budget with its final evaluation) gets a point inside the
    /// frame, drawn as a mark: a line of one point draws nothing.
    #[test]
    fn a_curve_of_one_evaluation_is_inside_the_frame_and_marked() {
        let one = |y: f64| ("r".to_string(), color(0), vec![(0.3, y)]);
        assert!(accuracy_floor(&[one(93.5)], None) < 93.5);
        assert!(accuracy_floor(&[one(40.0)], None) < 40.0);
        // Curves of several points: from below the lowest after the first, target 97% in view.
        let many = ("m".to_string(), color(1), vec![(0.0, 10.0), (1.0, 96.0), (2.0, 98.0)]);
        assert_eq!(accuracy_floor(&[many], Some(0.97)), 95.0);
        register_font().unwrap();
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (400, 300)).into_drawing_area();
            let mut c = ChartBuilder::on(&root).build_cartesian_2d(0f64..1f64, 90f64..100f64).unwrap();
            draw_lines(&mut c, &[one(93.5)]).unwrap();
            root.present().unwrap();
        }
        assert!(svg.contains("<circle"), "{svg}");
    }
}
