//! The traffic family: bytes each worker moves per step against the ring's optimum, and the
//! staleness of the gradients the asynchronous servers applied.

use super::*;

impl Charts {
    pub(super) fn bytes(&mut self, g: &Group) -> anyhow::Result<()> {
        const MB: f64 = 1e6;
        let s = g.grad_bytes();
        let series = g.by_series();
        let mut ws: Vec<usize> = g.rows.iter().map(|r| r.workers).collect();
        ws.sort();
        ws.dedup();
        let wmax = ws.last().copied().unwrap_or(1) as f64;
        let has = |m: &str| g.rows.iter().any(|r| r.mode.starts_with(m));
        let mut theory: Vec<Line> = Vec::new();
        // The model is a function of the worker count: drawn at every count up to the largest
        // measured, so it shows as a line even where one count was measured.
        let every_n = || 1..=wmax as usize;
        // ZeRO-1 moves the ring's bytes (a reduce-scatter and an all-gather).
        let ring_family = |n: &str| n.starts_with("ddp") || n.starts_with("zero1");
        if has("ddp") || has("zero1") {
            theory.push((
                "ring, per worker (theory)".into(),
                mode_color("ddp-tcp"),
                every_n().map(|n| (n as f64, cost::ring_bytes_per_worker(n, s) / MB)).collect(),
            ));
        }
        if has("ps") {
            theory.push((
                "PS, per worker (theory)".into(),
                mode_color("ps-bsp"),
                every_n().map(|n| (n as f64, cost::ps_bytes_per_worker(s) / MB)).collect(),
            ));
            theory.push((
                "PS, all servers (theory)".into(),
                BLACK,
                every_n().map(|n| (n as f64, cost::ps_bytes_at_servers(n, s) / MB)).collect(),
            ));
        }
        let mut measured: Vec<Measured> = Vec::new();
        // ASP and SSP move the same bytes per step as BSP: measuring BSP and the ring suffices.
        for (i, (name, rows)) in
            series.iter().enumerate().filter(|(_, (n, _))| n.starts_with("ps-bsp") || ring_family(n))
        {
            let family = if ring_family(name) { mode_color(name) } else { mode_color("ps-bsp") };
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

    pub(super) fn staleness(&mut self, g: &Group) -> anyhow::Result<()> {
        let hists: Vec<(String, RGBColor, BTreeMap<u64, usize>)> = g
            .widest_per_mode()
            .into_iter()
            .filter(|r| r.mode.is_async())
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
}
