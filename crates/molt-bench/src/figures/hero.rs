//! `hero.png`: one answer under the pressure trace, token by token — the latency before every
//! token coloured by the rung that produced it, the switches marked with their cost, and
//! beneath it the budget against the process's resident footprint (`token_series.json`).

use std::path::Path;

use plotters::prelude::*;

use super::{FAMILY, Figure, fig_err, mib, rung_color, tick};
use crate::BenchError;
use crate::conditions::TokenSeries;

/// The hero figure.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or the series is empty.
#[allow(clippy::cast_precision_loss, clippy::too_many_lines)]
pub fn hero(series: &TokenSeries, path: &Path) -> Result<Figure, BenchError> {
    let name = "hero";
    let e = fig_err(name);
    if series.rows.is_empty() {
        return Err(BenchError::Figure {
            figure: name.into(),
            message: "the token series is empty".into(),
        });
    }
    let root = BitMapBackend::new(path, (1200, 780)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let (top, bottom) = root.split_vertically(470);
    let n = series.rows.iter().map(|r| r.index).max().unwrap_or(0) as f64 + 1.0;
    let lat_max = series.rows.iter().map(|r| r.latency_ms).fold(1.0, f64::max);
    let lat_min = series
        .rows
        .iter()
        .map(|r| r.latency_ms)
        .fold(f64::INFINITY, f64::min)
        .max(0.1);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "Molt under memory pressure, token by token ({}, prompt {}, trace {})",
                series.arm, series.prompt, series.trace.name
            ),
            (FAMILY, 22),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..n - 0.5, (lat_min * 0.7..lat_max * 1.6).log_scale())
        .map_err(&e)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .y_label_formatter(&|y: &f64| tick(*y))
        .y_desc("latency before this token (ms, log; token 0 excludes the prompt)")
        .x_desc("generated token")
        .label_style((FAMILY, 14))
        .draw()
        .map_err(&e)?;
    for rung in &series.rungs {
        let c = rung_color(&series.rungs, rung);
        let pts: Vec<(f64, f64)> = series
            .rows
            .iter()
            .filter(|r| &r.rung == rung)
            .map(|r| (r.index as f64, r.latency_ms.max(lat_min)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(pts.iter().map(|&(x, y)| {
                Rectangle::new([(x - 0.35, lat_min * 0.7), (x + 0.35, y)], c.filled())
            }))
            .map_err(&e)?
            .label(format!("token on {rung}"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    for s in &series.switches {
        let x = s.at_token as f64 - 0.5;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x, lat_min * 0.7), (x, lat_max * 1.6)],
                BLACK.stroke_width(1),
            )))
            .map_err(&e)?;
        let label = format!(
            "{}→{} {}: {:.0} ms (+{:.0} ms load)",
            s.from, s.to, s.method, s.timings.cost_ms, s.timings.load_ms
        );
        chart
            .draw_series(std::iter::once(Text::new(
                label,
                (x + 0.6, lat_max * 1.25),
                (FAMILY, 14).into_font(),
            )))
            .map_err(&e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(&e)?;

    let ymax = series
        .rows
        .iter()
        .map(|r| mib(r.budget_bytes).max(mib(r.footprint_bytes)))
        .fold(0.0, f64::max)
        * 1.1;
    let mut mem = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..ymax.max(1.0))
        .map_err(&e)?;
    mem.configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .y_label_formatter(&|y: &f64| format!("{y:.0}"))
        .y_desc("MiB")
        .x_desc("generated token")
        .label_style((FAMILY, 14))
        .draw()
        .map_err(&e)?;
    let mut budget_pts = Vec::new();
    for r in &series.rows {
        let (x, y) = (r.index as f64, mib(r.budget_bytes));
        if let Some(&(_, py)) = budget_pts.last()
            && py != y
        {
            budget_pts.push((x - 0.5, py));
            budget_pts.push((x - 0.5, y));
        }
        budget_pts.push((x, y));
    }
    mem.draw_series(LineSeries::new(budget_pts, RED.stroke_width(2)))
        .map_err(&e)?
        .label("budget (replayed trace)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], RED.stroke_width(2)));
    for rung in &series.rungs {
        let c = rung_color(&series.rungs, rung);
        let pts: Vec<(f64, f64)> = series
            .rows
            .iter()
            .filter(|r| &r.rung == rung)
            .map(|r| (r.index as f64, mib(r.footprint_bytes)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        mem.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(&e)?
            .label(format!("resident footprint on {rung}"))
            .legend(move |(x, y)| Circle::new((x + 6, y), 4, c.filled()));
    }
    mem.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(&e)?;
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "One answer of arm {} under trace {}: the latency before every token, coloured by the rung that produced it (switches marked with their cost), and beneath it the budget and the process's resident footprint.",
            series.arm, series.trace.name
        ),
    })
}
