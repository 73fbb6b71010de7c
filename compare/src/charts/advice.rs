//! `advise --check`'s chart: each configuration's measured step against the step predicted
//! for the link as measured, the diagonal where the two agree and the band of 15% either side
//! (the validation's bound on the largest error).

use plotters::prelude::*;

use super::{color, font, register_font};

/// One configuration's point: its number in the table, predicted ms, measured ms, the measured
/// repeats' range.
pub type Point = (usize, f64, f64, Option<(f64, f64)>);

/// The chart as SVG.
pub fn predicted_against_measured(title: &str, points: &[Point]) -> anyhow::Result<String> {
    register_font()?;
    let top = points.iter().flat_map(|p| [p.1, p.2, p.3.map_or(p.2, |r| r.1)]).fold(0.0f64, f64::max) * 1.1;
    let top = if top > 0.0 { top } else { 1.0 };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, font(18))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..top, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("predicted step, ms (the link as measured)")
            .y_desc("measured step, ms (median, range of repeats)")
            .label_style(font(13))
            .draw()?;
        let grey = RGBColor(150, 150, 150);
        chart
            .draw_series(LineSeries::new([(0.0, 0.0), (top, top)], grey.stroke_width(2)))?
            .label("measured = predicted")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], grey.stroke_width(2)));
        for f in [0.85, 1.15] {
            chart.draw_series(DashedLineSeries::new([(0.0, 0.0), (top, top * f)], 6, 4, grey.into()))?;
        }
        for (i, &(n, pred, meas, range)) in points.iter().enumerate() {
            let c = color(i);
            if let Some((lo, hi)) = range {
                chart.draw_series(LineSeries::new([(pred, lo), (pred, hi)], c.stroke_width(2)))?;
            }
            chart.draw_series([
                Circle::new((pred, meas), 5, c.filled()),
                Circle::new((pred, meas), 5, BLACK.stroke_width(1)),
            ])?;
            chart.draw_series([Text::new(format!("{n}"), (pred, meas), font(14).color(&BLACK))])?;
        }
        chart
            .configure_series_labels()
            .label_font(font(13))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn every_configuration_is_a_numbered_point_on_one_scale() {
        let svg = super::predicted_against_measured(
            "t",
            &[(1, 100.0, 110.0, Some((105.0, 115.0))), (2, 200.0, 190.0, None)],
        )
        .unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("measured = predicted"), "{svg}");
        assert_eq!(svg.matches("<circle").count(), 4, "two points, each filled and outlined");
        assert!(svg.contains(">\n1\n<") && svg.contains(">\n2\n<"), "the points are numbered: {svg}");
    }
}
