//! `switch_stall.png`: the stall a user sees at a switch, per route, before (destination
//! loaded at the switch), after (standby) and known ahead (a switch down prepared as a shadow),
//! warm and cold page cache, one panel per context
//! length, with three times the destination's inter-token latency marked (the goal for down
//! routes, warm) — from `switch_stall.json` ([`StallDoc`]).

use std::path::Path;

use plotters::prelude::*;

use super::{FAMILY, Figure, fig_err, tick};
use crate::BenchError;
use crate::stall::{CacheState, StallDoc, StallRow};

/// The bars of a route: (setup, cache, colour).
const SERIES: [(&str, CacheState, RGBColor); 6] = [
    ("before, warm", CacheState::Warm, RGBColor(158, 158, 158)),
    ("after, warm", CacheState::Warm, RGBColor(31, 119, 180)),
    ("known ahead, warm", CacheState::Warm, RGBColor(44, 160, 44)),
    ("before, cold", CacheState::Cold, RGBColor(214, 160, 120)),
    ("after, cold", CacheState::Cold, RGBColor(214, 39, 40)),
    (
        "known ahead, cold",
        CacheState::Cold,
        RGBColor(148, 103, 189),
    ),
];

/// The rows of a series by its label.
fn series_rows<'a>(doc: &'a StallDoc, label: &str) -> &'a [StallRow] {
    if label.starts_with("before") {
        &doc.before_rows
    } else if label.starts_with("known ahead") {
        &doc.warned_rows
    } else {
        &doc.rows
    }
}

/// The context lengths the document's rows were asked for, in order: one panel each (a row's
/// measured context grows along the route circuit, so it cannot tell the runs apart).
fn lengths(doc: &StallDoc) -> Vec<usize> {
    let mut v: Vec<usize> = doc
        .rows
        .iter()
        .chain(&doc.before_rows)
        .chain(&doc.warned_rows)
        .map(StallRow::asked_length)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

fn in_group(r: &StallRow, len: usize) -> bool {
    r.asked_length() == len
}

/// One panel per context length; per route six bars (before/after/known ahead × warm/cold) with
/// min–max whiskers, and a black tick at 3 × the destination's inter-token latency.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or the document has no rows.
#[allow(clippy::cast_precision_loss)]
pub fn stall(doc: &StallDoc, path: &Path) -> Result<Figure, BenchError> {
    let name = "switch_stall";
    let e = fig_err(name);
    let groups = lengths(doc);
    if groups.is_empty() {
        return Err(BenchError::Figure {
            figure: name.into(),
            message: "switch_stall.json has no rows".into(),
        });
    }
    let mut routes: Vec<(String, String)> = Vec::new();
    for r in &doc.rows {
        if !routes.iter().any(|(x, _)| *x == r.route) {
            routes.push((r.route.clone(), r.direction.clone()));
        }
    }
    // Down routes first: the goal is about them.
    routes.sort_by_key(|(_, d)| d != "down");
    let root = BitMapBackend::new(path, (1600, 520 * groups.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let panels = root.split_evenly((groups.len(), 1));
    let all: Vec<f64> = doc
        .rows
        .iter()
        .chain(&doc.before_rows)
        .chain(&doc.warned_rows)
        .flat_map(|r| [r.stall_ms.min, r.stall_ms.max, 3.0 * r.itl_ms_median])
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min).max(1.0) * 0.5;
    let hi = all.iter().copied().fold(0.0, f64::max) * 2.0;
    for (panel, &len) in panels.iter().zip(&groups) {
        let labels: Vec<String> = routes
            .iter()
            .map(|(r, d)| format!("{} ({d})", r.replace("->", " → ")))
            .collect();
        let fmt = move |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let n = routes.len() as f64;
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!(
                    "stall at a switch, context asked ~{len} tokens (median of {} reps, min-max; black tick: 3 × the destination's inter-token latency)",
                    doc.reps
                ),
                (FAMILY, 18),
            )
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.6..n - 0.4, (lo..hi).log_scale())
            .map_err(&e)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(routes.len() + 1)
            .x_label_formatter(&fmt)
            .y_label_formatter(&|y: &f64| tick(*y))
            .y_desc("ms (log)")
            .label_style((FAMILY, 13))
            .draw()
            .map_err(&e)?;
        for (k, (label, cache, color)) in SERIES.iter().enumerate() {
            let rows = series_rows(doc, label);
            let mut bars = Vec::new();
            let mut whiskers = Vec::new();
            for (i, (route, _)) in routes.iter().enumerate() {
                let Some(r) = rows
                    .iter()
                    .find(|r| r.route == *route && r.cache == *cache && in_group(r, len))
                else {
                    continue;
                };
                let x = i as f64 - 0.375 + 0.15 * k as f64;
                bars.push(Rectangle::new(
                    [(x - 0.065, lo), (x + 0.065, r.stall_ms.median)],
                    color.filled(),
                ));
                whiskers.push(PathElement::new(
                    vec![(x, r.stall_ms.min), (x, r.stall_ms.max)],
                    BLACK.stroke_width(1),
                ));
            }
            chart
                .draw_series(bars)
                .map_err(&e)?
                .label(*label)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
            chart.draw_series(whiskers).map_err(&e)?;
        }
        let goal: Vec<PathElement<(f64, f64)>> = routes
            .iter()
            .enumerate()
            .filter_map(|(i, (route, _))| {
                let r = doc.rows.iter().find(|r| {
                    r.route == *route && r.cache == CacheState::Warm && in_group(r, len)
                })?;
                let y = 3.0 * r.itl_ms_median;
                y.is_finite().then(|| {
                    PathElement::new(
                        vec![(i as f64 - 0.42, y), (i as f64 + 0.42, y)],
                        BLACK.stroke_width(2),
                    )
                })
            })
            .collect();
        chart.draw_series(goal).map_err(&e)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font((FAMILY, 13))
            .draw()
            .map_err(&e)?;
    }
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "The gap a user sees at a switch (last token on the source to first on the destination, everything included), every route, {} reps, {} thread(s) on a shared machine: before = the destination loaded at the switch, after = off standby (a switch up loaded and carried in the background), known ahead = a switch down prepared as a shadow while the budget falls; warm and cold page cache; the black tick is 3 × the destination's inter-token latency.",
            doc.reps, doc.threads
        ),
    })
}

/// The figures module draws it when `switch_stall.json` is present.
pub(super) fn draw(results: &Path, out: &Path) -> Option<Result<Figure, BenchError>> {
    let p = results.join("switch_stall.json");
    if !p.exists() {
        return None;
    }
    Some(
        super::read_json::<StallDoc>(&p).and_then(|doc| stall(&doc, &out.join("switch_stall.png"))),
    )
}
