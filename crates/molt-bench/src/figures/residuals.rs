//! `projector_residuals.png`: how well each fitted map predicts the destination's cache on
//! windows it never saw, with its training residual beside it (`projector_residuals.json`,
//! written by `molt-run train-projectors`).

use std::path::Path;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::{FAMILY, Figure, RUNG_COLORS, fig_err, serde_word};
use crate::BenchError;
use molt::routes::RouteKind;
use molt::train::{RouteResult, TrainReport};

/// `results/projector_residuals.json`: the fitting run's [`TrainReport`] with the ladder and
/// the machine. Its writer (`molt-run train-projectors`) builds the document in place; this
/// envelope is all that is declared here, the report is the writer's own type.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResidualDoc {
    /// Machine and versions ([`crate::RunInfo`]).
    #[serde(default)]
    pub run: serde_json::Value,
    /// The ladder fitted.
    #[serde(default)]
    pub ladder: String,
    /// The training report.
    pub report: TrainReport,
}

/// `results/projector_curve.json`: one route's residuals against training-set size
/// ([`molt::train::curve::CurveReport`]), written by `molt-run map-curve`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CurveDoc {
    /// Machine and versions ([`crate::RunInfo`]).
    #[serde(default)]
    pub run: serde_json::Value,
    /// The ladder fitted.
    #[serde(default)]
    pub ladder: String,
    /// The curve.
    pub curve: molt::train::curve::CurveReport,
}

/// Horizontal bars: held-out residual per route and variant, K and V side by side, the
/// training residual marked on each bar.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or there are no routes.
#[allow(clippy::cast_precision_loss)]
pub fn residuals(doc: &ResidualDoc, path: &Path) -> Result<Figure, BenchError> {
    let name = "projector_residuals";
    let e = fig_err(name);
    let routes = &doc.report.routes;
    if routes.is_empty() {
        return Err(BenchError::Figure {
            figure: name.into(),
            message: "no routes".into(),
        });
    }
    let height = (80 + routes.len() * 22).max(400) as u32;
    let root = BitMapBackend::new(path, (1400, height)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let (left, right) = root.split_horizontally(700);
    let labels: Vec<String> = routes
        .iter()
        .map(|r| format!("{} {}", r.route, serde_word(&r.variant)))
        .collect();
    for (area, which, title) in [(&left, 'k', "K"), (&right, 'v', "V")] {
        let pick = |r: &RouteResult| if which == 'k' { r.fit.k } else { r.fit.v };
        let xmax = routes
            .iter()
            .map(|r| pick(r).held_out.max(pick(r).train))
            .filter(|v| v.is_finite())
            .fold(0.1, f64::max);
        let n = routes.len() as f64;
        let labels = labels.clone();
        let fmt = move |y: &f64| {
            let i = y.round();
            if (y - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{title}: held-out relative RMS (bar) and training (tick)"),
                (FAMILY, 17),
            )
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(250)
            .build_cartesian_2d(0.0..xmax * 1.1, (n - 0.4)..-0.6)
            .map_err(&e)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .light_line_style(WHITE)
            .y_labels(routes.len() + 1)
            .y_label_formatter(&fmt)
            .x_desc("relative RMS (0 = exact, 1 = no better than zero)")
            .label_style((FAMILY, 12))
            .draw()
            .map_err(&e)?;
        for (i, r) in routes.iter().enumerate() {
            let y = i as f64;
            let c = if r.kind == RouteKind::Precision {
                RUNG_COLORS[1]
            } else {
                RUNG_COLORS[0]
            };
            let p = pick(r);
            if p.held_out.is_finite() {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(0.0, y - 0.35), (p.held_out, y + 0.35)],
                        c.filled(),
                    )))
                    .map_err(&e)?;
            }
            if p.train.is_finite() {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(p.train, y - 0.45), (p.train, y + 0.45)],
                        BLACK.stroke_width(3),
                    )))
                    .map_err(&e)?;
            }
        }
    }
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "How well each fitted map predicts the destination's cache on windows it never saw (bars; orange = precision route, blue = size route), with its training residual (ticks), over {} corpus tokens.",
            doc.report.corpus_tokens
        ),
    })
}
