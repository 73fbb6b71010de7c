//! The cost-model family: measured communication against the alpha-beta models, and the
//! models extrapolated to more workers and faster links.

use super::*;

impl Charts {
    pub(super) fn cost_model(&mut self, g: &Group, link: Option<Link>) -> anyhow::Result<()> {
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

    pub(super) fn extrapolation(&mut self, g: &Group, link: Option<Link>) -> anyhow::Result<()> {
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
