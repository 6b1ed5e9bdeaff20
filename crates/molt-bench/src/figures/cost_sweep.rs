//! `cost_sweep.png`: Molt's switch against a re-prefill with both rungs warm, every route, by
//! context length — the cost of each (median of the repetitions), and how much more the
//! transplant diverges at the seam than the re-prefill does (`cost_sweep.json`).

use std::path::Path;

use plotters::prelude::*;

use super::{FAMILY, Figure, fig_err, tick};
use crate::BenchError;
use crate::cost_sweep::{SEAM, SweepDoc, SweepPoint};

fn routes_of(doc: &SweepDoc) -> Vec<String> {
    let mut routes: Vec<String> = Vec::new();
    for p in &doc.points {
        if !routes.contains(&p.route) {
            routes.push(p.route.clone());
        }
    }
    routes
}

/// Transplant against re-prefill by context length, and the seam ratio.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or the sweep is empty.
#[allow(clippy::cast_precision_loss)]
pub fn cost_sweep(doc: &SweepDoc, path: &Path) -> Result<Figure, BenchError> {
    let name = "cost_sweep";
    let e = fig_err(name);
    if doc.points.is_empty() {
        return Err(BenchError::Figure {
            figure: name.into(),
            message: "no points".into(),
        });
    }
    let root = BitMapBackend::new(path, (1400, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let (left, right) = root.split_horizontally(820);
    let routes = routes_of(doc);
    let xmax = doc
        .points
        .iter()
        .map(|p| p.context_tokens)
        .max()
        .unwrap_or(1) as f64;
    let xmin = doc
        .points
        .iter()
        .map(|p| p.context_tokens)
        .min()
        .unwrap_or(1) as f64;
    let ymax = doc
        .points
        .iter()
        .map(|p| p.reprefill_ms.max.max(p.transplant_ms.max))
        .fold(1.0, f64::max);
    let ymin = doc
        .points
        .iter()
        .map(|p| p.transplant_ms.min.min(p.reprefill_ms.min))
        .fold(f64::INFINITY, f64::min)
        .max(0.01);
    // Ticks at the measured lengths: a log axis over one octave would otherwise get none.
    let mut lengths: Vec<f64> = doc.points.iter().map(|p| p.context_tokens as f64).collect();
    lengths.sort_by(f64::total_cmp);
    lengths.dedup();
    let x_axis = || {
        (xmin * 0.8..xmax * 1.25)
            .log_scale()
            .with_key_points(lengths.clone())
    };
    let mut chart = ChartBuilder::on(&left)
        .caption(
            "switch cost: transplant (circles) vs re-prefill (crosses)",
            (FAMILY, 18),
        )
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(x_axis(), (ymin * 0.5..ymax * 2.0).log_scale())
        .map_err(&e)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .y_label_formatter(&|y: &f64| tick(*y))
        .x_desc("context tokens carried (log)")
        .y_desc("ms, median over reps (log)")
        .label_style((FAMILY, 13))
        .draw()
        .map_err(&e)?;
    for (i, route) in routes.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        let pts: Vec<&SweepPoint> = doc.points.iter().filter(|p| &p.route == route).collect();
        let t: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (p.context_tokens as f64, p.transplant_ms.median))
            .collect();
        let r: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (p.context_tokens as f64, p.reprefill_ms.median))
            .collect();
        chart
            .draw_series(LineSeries::new(t.clone(), c.stroke_width(2)))
            .map_err(&e)?
            .label(route.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], c.stroke_width(2)));
        chart
            .draw_series(t.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(&e)?;
        chart
            .draw_series(LineSeries::new(r.clone(), c.stroke_width(1)))
            .map_err(&e)?;
        chart
            .draw_series(r.iter().map(|&p| Cross::new(p, 5, c.stroke_width(2))))
            .map_err(&e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(&e)?;
    // The mean over the switch step and the steps after it: one step can be near-certain for
    // both models.
    let ratio = |p: &SweepPoint| p.seam_mean_ratio;
    let ratios = || {
        doc.points
            .iter()
            .map(ratio)
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let smax = ratios().fold(1.0, f64::max);
    let smin = ratios().fold(1.0, f64::min);
    let mut seam = ChartBuilder::on(&right)
        .caption(
            format!(
                "seam: transplant / re-prefill JSD, mean over {} steps",
                SEAM + 1
            ),
            (FAMILY, 18),
        )
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(x_axis(), (smin * 0.5..smax * 2.0).log_scale())
        .map_err(&e)?;
    seam.configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .y_label_formatter(&|y: &f64| tick(*y))
        .x_desc("context tokens carried (log)")
        .y_desc("ratio, log (1 = as good as re-prefill)")
        .label_style((FAMILY, 13))
        .draw()
        .map_err(&e)?;
    seam.draw_series(std::iter::once(PathElement::new(
        vec![(xmin * 0.8, 1.0), (xmax * 1.25, 1.0)],
        BLACK.stroke_width(1),
    )))
    .map_err(&e)?;
    for (i, route) in routes.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = doc
            .points
            .iter()
            .filter(|p| &p.route == route && ratio(p).is_finite() && ratio(p) > 0.0)
            .map(|p| (p.context_tokens as f64, ratio(p)))
            .collect();
        seam.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(&e)?;
        seam.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(&e)?;
    }
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "{} against re-prefill with both rungs warm, every route, by context length (median of {} repetitions), and how much more the transplant diverges at the seam than a re-prefill does.",
            if doc.token_recompute.is_some() {
                "Molt's default switch (on a size route with its token recompute)"
            } else {
                "Transplant"
            },
            doc.reps
        ),
    })
}
