//! `recall_frontier.png` and `recall_lengths.png`: does the answer still know what the context
//! said after a switch, and what did the switch cost (`recall.json`, written by
//! `molt-run bench --recall` as [`RecallDoc`])?
//!
//! The frontier puts every arm of a route at one point: x its switch cost over the re-prefill's
//! at the same points, y its recall, both pooled over the arm's rows (every context length and
//! switch point), with the native destination's recall as the line a switch is measured
//! against. The second figure follows the default switch, the re-prefill and the projection
//! alone along the context lengths of the size route, where the facts are lost.
//!
//! [`RecallSummary`] is that pooling; the results page reads the same summaries, so a number
//! on the page and a point on the figure are one computation.

use std::path::Path;

use plotters::prelude::*;

use super::{FAMILY, Figure, RUNG_COLORS, arm_color, fig_err, tick};
use crate::BenchError;
use crate::recall::{RecallDoc, RecallRow};

/// An arm keeps the context's facts when its recall is at least this share of the native
/// destination's on the same items (the destination cannot be asked to recall what it would
/// not recall reading the prompt itself).
pub const KEEPS_FACTS: f64 = 0.9;

/// One arm on one route, its rows pooled.
///
/// Recall is pooled exactly (Σ recall × items / Σ items). The rows keep only a median cost, so
/// the pooled cost is the median of the rows' medians, each row weighted by its items — the
/// re-prefill's the same way over the same rows, so the two are read at the same points.
#[derive(Debug, Clone, PartialEq)]
pub struct RecallSummary {
    /// Arm name.
    pub arm: String,
    /// Route `src→dst`.
    pub route: String,
    /// `precision` or `size`.
    pub route_kind: String,
    /// Whether it is what a session does when nothing is set.
    pub default: bool,
    /// Answers pooled.
    pub items: usize,
    /// Answers that held every expected string.
    pub correct: usize,
    /// `correct / items`.
    pub recall: f64,
    /// The native destination's recall on the same items.
    pub destination_recall: f64,
    /// Switch cost, ms (0 for the natives, which do not switch).
    pub cost_ms: f64,
    /// The re-prefill's cost at the same points, ms.
    pub reprefill_ms: f64,
    /// Positions re-read by selective token recompute.
    pub recomputed: f64,
}

impl RecallSummary {
    /// Pools rows of one arm on one route; `None` when they hold no answers.
    #[must_use]
    pub fn pool(rows: &[&RecallRow]) -> Option<Self> {
        let first = rows.first()?;
        let items: usize = rows.iter().map(|r| r.items).sum();
        if items == 0 {
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        let share = |f: &dyn Fn(&RecallRow) -> f64| {
            rows.iter().map(|r| f(r) * r.items as f64).sum::<f64>() / items as f64
        };
        let median = |f: &dyn Fn(&RecallRow) -> f64| {
            weighted_median(rows.iter().map(|r| (f(r), r.items)).collect())
        };
        let recall = share(&|r| r.recall);
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let correct = (recall * items as f64).round() as usize;
        Some(Self {
            arm: first.arm.clone(),
            route: first.route.clone(),
            route_kind: first.route_kind.clone(),
            default: first.default,
            items,
            correct,
            recall,
            destination_recall: share(&|r| r.destination_recall),
            cost_ms: median(&|r| r.cost_ms.median),
            reprefill_ms: median(&|r| r.reprefill_ms.median),
            recomputed: median(&|r| r.recomputed),
        })
    }

    /// Switch cost over the re-prefill's at the same points; `None` for an arm that does not
    /// switch (the natives) or when the re-prefill was not measured.
    #[must_use]
    pub fn cost_fraction(&self) -> Option<f64> {
        (self.cost_ms > 0.0 && self.reprefill_ms > 0.0).then(|| self.cost_ms / self.reprefill_ms)
    }

    /// Whether the arm loses facts: its recall is below [`KEEPS_FACTS`] × the destination's.
    #[must_use]
    pub fn loses_facts(&self) -> bool {
        self.recall < KEEPS_FACTS * self.destination_recall
    }

    /// Whether this is one of the arms that do not switch (its cost is not a switch's).
    #[must_use]
    pub fn is_native(&self) -> bool {
        self.arm.starts_with("native-")
    }
}

/// The smallest value whose cumulative weight reaches half the total (0 for no weight).
fn weighted_median(mut v: Vec<(f64, usize)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: usize = v.iter().map(|x| x.1).sum();
    let mut seen = 0;
    for (x, w) in &v {
        seen += w;
        if 2 * seen >= total && *w > 0 {
            return *x;
        }
    }
    0.0
}

/// Routes in the order the rows meet them.
#[must_use]
pub fn routes(doc: &RecallDoc) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in &doc.rows {
        if !out.contains(&r.route) {
            out.push(r.route.clone());
        }
    }
    out
}

/// One summary per route and arm: routes as the rows meet them, arms in the run's order.
#[must_use]
pub fn summaries(doc: &RecallDoc) -> Vec<RecallSummary> {
    let mut out = Vec::new();
    for route in routes(doc) {
        let mut arms: Vec<&str> = Vec::new();
        for r in doc.rows.iter().filter(|r| r.route == route) {
            if !arms.contains(&r.arm.as_str()) {
                arms.push(&r.arm);
            }
        }
        for arm in arms {
            let rows: Vec<&RecallRow> = doc
                .rows
                .iter()
                .filter(|r| r.route == route && r.arm == arm)
                .collect();
            out.extend(RecallSummary::pool(&rows));
        }
    }
    out
}

/// `arm` on `route` per context length (the items' length buckets, both switch points
/// pooled), shortest first.
#[must_use]
pub fn by_length(doc: &RecallDoc, route: &str, arm: &str) -> Vec<(usize, RecallSummary)> {
    let mut lengths: Vec<usize> = doc
        .rows
        .iter()
        .filter(|r| r.route == route && r.arm == arm)
        .map(|r| r.context_tokens)
        .collect();
    lengths.sort_unstable();
    lengths.dedup();
    lengths
        .into_iter()
        .filter_map(|n| {
            let rows: Vec<&RecallRow> = doc
                .rows
                .iter()
                .filter(|r| r.route == route && r.arm == arm && r.context_tokens == n)
                .collect();
            RecallSummary::pool(&rows).map(|s| (n, s))
        })
        .collect()
}

/// The default arm's name on `route`, when the run had it.
#[must_use]
pub fn default_arm(doc: &RecallDoc, route: &str) -> Option<String> {
    doc.rows
        .iter()
        .find(|r| r.route == route && r.default)
        .map(|r| r.arm.clone())
}

/// The route kinds present, precision first.
fn kinds(all: &[RecallSummary]) -> Vec<&'static str> {
    ["precision", "size"]
        .into_iter()
        .filter(|k| all.iter().any(|s| s.route_kind == *k))
        .collect()
}

/// The point labels of one panel as pixel boxes: a new label steps down, then up, a line at a
/// time until it overlaps no point and no label placed before it (arms of one recall would
/// otherwise print over each other).
#[derive(Default)]
struct Labels(Vec<(i32, i32, i32, i32)>);

impl Labels {
    const LINE: i32 = 14;

    /// Keeps labels off a `(w, h)` box at `at` (a point).
    fn block(&mut self, at: (i32, i32), (w, h): (i32, i32)) {
        self.0.push((at.0, at.1, at.0 + w, at.1 + h));
    }

    fn place(&mut self, at: (i32, i32), text: &str) -> (i32, i32) {
        let w = 7 * i32::try_from(text.chars().count()).unwrap_or(i32::MAX / 8);
        let h = Self::LINE;
        let free = |x: i32, y: i32| {
            !self
                .0
                .iter()
                .any(|&(x0, y0, x1, y1)| x < x1 && x + w > x0 && y < y1 && y + h > y0)
        };
        let y = [0, 1, -1, 2, -2, 3, -3, 4, -4]
            .into_iter()
            .map(|k| at.1 + k * h)
            .find(|&y| free(at.0, y))
            .unwrap_or(at.1);
        self.0.push((at.0, y, at.0 + w, y + h));
        (at.0, y)
    }
}

fn no_rows(name: &str) -> BenchError {
    BenchError::Figure {
        figure: name.into(),
        message: "recall.json has no rows".into(),
    }
}

/// Recall against switch cost, one point per arm, one panel per route kind: the frontier.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or the document has no rows.
#[allow(clippy::cast_precision_loss, clippy::too_many_lines)]
pub fn recall_frontier(doc: &RecallDoc, path: &Path) -> Result<Figure, BenchError> {
    let name = "recall_frontier";
    let e = fig_err(name);
    let all = summaries(doc);
    let kinds = kinds(&all);
    if kinds.is_empty() {
        return Err(no_rows(name));
    }
    let root = BitMapBackend::new(path, (700 * kinds.len() as u32, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let panels = root.split_evenly((1, kinds.len()));
    let routes = routes(doc);
    for (area, kind) in panels.iter().zip(&kinds) {
        let here: Vec<&RecallSummary> = all.iter().filter(|s| s.route_kind == *kind).collect();
        let fractions = || here.iter().filter_map(|s| s.cost_fraction());
        let lo = fractions().fold(1.0, f64::min);
        let hi = fractions().fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{kind} route: recall against switch cost"),
                (FAMILY, 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((lo * 0.5..hi * 3.0).log_scale(), 0.0..1.08)
            .map_err(&e)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_label_formatter(&|x: &f64| tick(*x))
            .y_label_formatter(&|y: &f64| format!("{y:.1}"))
            .x_desc("switch cost / the re-prefill's at the same points (log; 1 = re-prefill)")
            .y_desc("recall (share of answers with every expected string)")
            .label_style((FAMILY, 13))
            .draw()
            .map_err(&e)?;
        let in_kind: Vec<&String> = routes
            .iter()
            .filter(|r| here.iter().any(|s| &s.route == *r))
            .collect();
        let mut labels = Labels::default();
        // (the point in pixels, its label)
        let mut marks: Vec<((i32, i32), String)> = Vec::new();
        for (i, route) in in_kind.iter().enumerate() {
            let c = RUNG_COLORS[i.min(3)];
            // Only arms measured on every item of the route: an arm run on a subset (one
            // length, one switch point) pooled beside arms run on all of them would be read
            // as a point of the same frontier.
            let on_route = || here.iter().filter(|s| &s.route == *route);
            let every = on_route().map(|s| s.items).max().unwrap_or(0);
            let points: Vec<&&RecallSummary> = on_route().filter(|s| s.items == every).collect();
            // The destination's recall is the same on every arm's rows of the route (the same
            // items); the default arm's rows are read, or the first arm's without one.
            let reference = points.iter().find(|s| s.default).or(points.first());
            if let Some(r) = reference {
                let y = r.destination_recall;
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(lo * 0.5, y), (hi * 3.0, y)],
                        8,
                        6,
                        c.stroke_width(2),
                    ))
                    .map_err(&e)?
                    .label(format!("native destination on {route}: {y:.2}"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 14, y)], c.stroke_width(2))
                    });
            }
            let mut first = true;
            for s in &points {
                let Some(x) = s.cost_fraction() else {
                    continue;
                };
                let dot = chart
                    .draw_series(std::iter::once(Circle::new((x, s.recall), 5, c.filled())))
                    .map_err(&e)?;
                if first {
                    dot.label(format!("arms on {route}"))
                        .legend(move |(x, y)| Circle::new((x + 7, y), 5, c.filled()));
                    first = false;
                }
                if s.default {
                    chart
                        .draw_series(std::iter::once(Circle::new(
                            (x, s.recall),
                            10,
                            BLACK.stroke_width(2),
                        )))
                        .map_err(&e)?;
                }
                let label = if s.default {
                    format!("{} (default)", s.arm)
                } else {
                    s.arm.clone()
                };
                let (px, py) = chart.backend_coord(&(x, s.recall));
                labels.block((px - 11, py - 11), (22, 22));
                marks.push(((px, py), label));
            }
        }
        // Labels after every point, so none is written over a point placed later.
        // A label moved off its point's line gets a thin leader back to the point.
        for ((px, py), label) in marks {
            let want = (px + 13, py - Labels::LINE / 2);
            let at = labels.place(want, &label);
            if at != want {
                root.draw(&PathElement::new(
                    vec![(px + 5, py), (at.0 - 2, at.1 + Labels::LINE / 2)],
                    RGBColor(150, 150, 150).stroke_width(1),
                ))
                .map_err(&e)?;
            }
            root.draw(&Text::new(label, at, (FAMILY, 12).into_font()))
                .map_err(&e)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FAMILY, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(&e)?;
    }
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "Recall of the context's facts against switch cost, one point per arm measured on every item of its route ({} items in all; every context length and switch point pooled; cost as a share of the re-prefill's at the same points): dashed, the native destination's recall; ringed, the default switch. Arms run on a subset are in the tables, not here.",
            doc.n_items
        ),
    })
}

/// A line of the per-length figure: legend label, arm, its summary per length.
type Line = (String, String, Vec<(usize, RecallSummary)>);

/// Recall per context length on each size route: the default switch, the re-prefill and the
/// projection alone, beside the native destination's. `None` when the run had no size route.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails.
#[allow(clippy::cast_precision_loss, clippy::too_many_lines)]
pub fn recall_lengths(doc: &RecallDoc, path: &Path) -> Result<Option<Figure>, BenchError> {
    let name = "recall_lengths";
    let e = fig_err(name);
    let size: Vec<String> = routes(doc)
        .into_iter()
        .filter(|r| {
            doc.rows
                .iter()
                .any(|x| &x.route == r && x.route_kind == "size")
        })
        .collect();
    if size.is_empty() {
        return Ok(None);
    }
    let root = BitMapBackend::new(path, (900 * size.len() as u32, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let panels = root.split_evenly((1, size.len()));
    let mut defaults = Vec::new();
    for (area, route) in panels.iter().zip(&size) {
        let default = default_arm(doc, route);
        let mut arms: Vec<(String, String)> = Vec::new();
        if let Some(d) = &default {
            arms.push((d.clone(), format!("{d} (default)")));
            defaults.push(d.clone());
        }
        for (arm, label) in [
            ("reprefill", "re-prefill"),
            ("projection", "projection alone"),
        ] {
            if !arms.iter().any(|(a, _)| a == arm) {
                arms.push((arm.into(), label.into()));
            }
        }
        let lines: Vec<Line> = arms
            .into_iter()
            .map(|(arm, label)| {
                let v = by_length(doc, route, &arm);
                (label, arm, v)
            })
            .filter(|(_, _, v)| !v.is_empty())
            .collect();
        let mut lengths: Vec<f64> = lines
            .iter()
            .flat_map(|(_, _, v)| v.iter().map(|(n, _)| *n as f64))
            .collect();
        lengths.sort_by(f64::total_cmp);
        lengths.dedup();
        let (lo, hi) = (
            lengths.first().copied().unwrap_or(1.0),
            lengths.last().copied().unwrap_or(1.0),
        );
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{route}: recall by context length"), (FAMILY, 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                (lo * 0.8..hi * 1.25)
                    .log_scale()
                    .with_key_points(lengths.clone()),
                0.0..1.08,
            )
            .map_err(&e)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_label_formatter(&|x: &f64| format!("{x:.0}"))
            .y_label_formatter(&|y: &f64| format!("{y:.1}"))
            .x_desc("context tokens (the items' length bucket, log)")
            .y_desc("recall (both switch points pooled)")
            .label_style((FAMILY, 13))
            .draw()
            .map_err(&e)?;
        // The destination's recall per length, read from the first line's rows (every arm of
        // the route ran on the same items).
        if let Some((_, _, v)) = lines.first() {
            let pts: Vec<(f64, f64)> = v
                .iter()
                .map(|(n, s)| (*n as f64, s.destination_recall))
                .collect();
            chart
                .draw_series(DashedLineSeries::new(pts, 8, 6, BLACK.stroke_width(2)))
                .map_err(&e)?
                .label("native destination")
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(2))
                });
        }
        for (label, arm, v) in &lines {
            // The conditions figure's colours: D (Molt's default switch) blue, C (re-prefill)
            // red; the projection alone grey.
            let c = match arm.as_str() {
                "reprefill" => arm_color("C"),
                "projection" => arm_color("A"),
                _ => arm_color("D"),
            };
            let pts: Vec<(f64, f64)> = v.iter().map(|(n, s)| (*n as f64, s.recall)).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(&e)?
                .label(label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(&e)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .label_font((FAMILY, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(&e)?;
    }
    root.present().map_err(&e)?;
    defaults.dedup();
    Ok(Some(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "Recall by context length on the size route{}: the default switch ({}), the re-prefill and the projection alone, beside the native destination's recall (dashed); each length pools both switch points.",
            if size.len() > 1 { "s" } else { "" },
            if defaults.is_empty() {
                "not in this run".to_string()
            } else {
                defaults.join(", ")
            }
        ),
    }))
}

/// A small `recall.json` in the writer's own types: a size route whose default switch keeps
/// the facts at 256 tokens and loses them at 1,024, and a precision route that keeps them.
#[cfg(test)]
pub(crate) fn sample_doc() -> RecallDoc {
    use crate::recall::{RecallOptions, Spread, SwitchPoint, default_arms};
    /// `(length, switch point, re-prefill ms, destination recall)` of each row.
    type Cell = (usize, SwitchPoint, f64, f64);
    /// `(arm, recall, cost ms, positions recomputed)`, one value per cell.
    type ArmRows<'a> = (&'a str, &'a [f64], &'a [f64], &'a [f64]);
    let rows = |route: &str, kind: &str, items, cells: &[Cell], arms: &[ArmRows<'_>]| {
        let mut out = Vec::new();
        for &(arm, recall, cost, rc) in arms {
            for (i, &(n, switch_at, re, dst)) in cells.iter().enumerate() {
                let spread = |m: f64| Spread {
                    median: m,
                    min: m * 0.9,
                    max: m * 1.1,
                };
                out.push(RecallRow {
                    arm: arm.into(),
                    default: arm == "head4",
                    route: route.into(),
                    route_kind: kind.into(),
                    context_kind: "notes".into(),
                    context_tokens: n,
                    measured_tokens: n + 20,
                    switch_at,
                    items,
                    recall: recall[i],
                    destination_recall: dst,
                    reprefill_recall: 0.0,
                    facts: recall[i],
                    destination_facts: dst,
                    cost_ms: spread(cost[i]),
                    reprefill_ms: spread(re),
                    recomputed: rc[i],
                    refill_ms: None,
                });
            }
        }
        out
    };
    let (first, mid) = (SwitchPoint::First, SwitchPoint::Mid);
    let (third, two) = (1.0 / 3.0, 2.0 / 3.0);
    let none = [0.0; 4];
    let mut all = rows(
        "tier0→tier2",
        "size",
        3,
        &[
            (256, first, 300.0, 1.0),
            (256, mid, 320.0, 1.0),
            (1024, first, 1200.0, two),
            (1024, mid, 1280.0, two),
        ],
        &[
            ("native-destination", &[1.0, 1.0, two, two], &none, &none),
            (
                "reprefill",
                &[1.0, 1.0, two, two],
                &[300.0, 320.0, 1200.0, 1280.0],
                &none,
            ),
            ("projection", &none, &[20.0, 21.0, 40.0, 41.0], &none),
            (
                "head4",
                &[1.0, 1.0, third, 0.0],
                &[30.0, 32.0, 60.0, 64.0],
                &none,
            ),
            (
                "attn-r10",
                &[1.0, 1.0, two, two],
                &[90.0, 95.0, 150.0, 160.0],
                &[25.0, 26.0, 100.0, 102.0],
            ),
        ],
    );
    all.extend(rows(
        "tier0→tier1",
        "precision",
        2,
        &[(256, first, 200.0, 1.0)],
        &[
            ("native-destination", &[1.0], &[0.0], &[0.0]),
            ("reprefill", &[1.0], &[200.0], &[0.0]),
            ("projection", &[0.5], &[8.0], &[0.0]),
            ("head4", &[1.0], &[10.0], &[0.0]),
        ],
    ));
    let arms = default_arms(&[]);
    RecallDoc {
        items_file: "benches/recall/items.jsonl".into(),
        n_items: 12,
        problems: Vec::new(),
        options: RecallOptions {
            routes: vec![(0, 2), (0, 1)],
            size_arms: arms.clone(),
            precision_arms: arms,
            max_tokens_first: 40,
            max_tokens_mid: 96,
            mid_switch_at: 12,
            precision_every: 2,
            precision_variant: molt::routes::Variant::Auto,
            partial: None,
            answered: Default::default(),
        },
        rows: all,
        answers: Vec::new(),
        seconds: 1.0,
        run: serde_json::Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_median_takes_the_value_where_half_the_weight_is_reached() {
        assert!((weighted_median(vec![(3.0, 1), (1.0, 1), (2.0, 1)]) - 2.0).abs() < 1e-12);
        assert!((weighted_median(vec![(10.0, 1), (1.0, 3)]) - 1.0).abs() < 1e-12);
        assert!((weighted_median(vec![(10.0, 3), (1.0, 1)]) - 10.0).abs() < 1e-12);
        assert!((weighted_median(vec![(1.0, 1), (2.0, 1)]) - 1.0).abs() < 1e-12);
        assert!(weighted_median(Vec::new()).abs() < 1e-12);
    }

    /// Recall pooled over items, cost as the items-weighted median of the rows' medians.
    #[test]
    fn an_arm_is_pooled_over_its_rows() {
        let doc = sample_doc();
        let all = summaries(&doc);
        let d = all
            .iter()
            .find(|s| s.route == "tier0→tier2" && s.arm == "head4")
            .unwrap();
        assert!(d.default);
        assert_eq!((d.items, d.correct), (12, 7));
        assert!((d.recall - 7.0 / 12.0).abs() < 1e-12);
        assert!((d.destination_recall - 5.0 / 6.0).abs() < 1e-12);
        assert!((d.cost_ms - 32.0).abs() < 1e-12);
        assert!((d.reprefill_ms - 320.0).abs() < 1e-12);
        assert!((d.cost_fraction().unwrap() - 0.1).abs() < 1e-12);
        assert!(d.loses_facts());
        let re = all
            .iter()
            .find(|s| s.route == "tier0→tier2" && s.arm == "reprefill")
            .unwrap();
        assert!((re.cost_fraction().unwrap() - 1.0).abs() < 1e-12);
        assert!(!re.loses_facts());
        let native = all.iter().find(|s| s.arm == "native-destination").unwrap();
        assert!(native.is_native() && native.cost_fraction().is_none());
        // Routes as the rows meet them, arms in the run's order.
        assert_eq!(routes(&doc), ["tier0→tier2", "tier0→tier1"]);
        assert_eq!(all.len(), 5 + 4);
        assert_eq!(all[0].arm, "native-destination");
    }

    #[test]
    fn per_length_the_default_keeps_short_contexts_and_loses_long_ones() {
        let doc = sample_doc();
        let v = by_length(&doc, "tier0→tier2", "head4");
        let lengths: Vec<usize> = v.iter().map(|(n, _)| *n).collect();
        assert_eq!(lengths, [256, 1024]);
        assert!(!v[0].1.loses_facts());
        assert!(v[1].1.loses_facts());
        assert!((v[1].1.recall - 1.0 / 6.0).abs() < 1e-12);
        assert_eq!(default_arm(&doc, "tier0→tier1").as_deref(), Some("head4"));
        assert!(by_length(&doc, "tier0→tier2", "no-such-arm").is_empty());
    }

    /// Both figures draw from what `bench --recall` writes, read back through its type; without
    /// a size route the per-length figure is skipped, not drawn empty.
    #[test]
    fn recall_figures_draw_from_what_the_bench_writes() {
        let text = serde_json::to_string(&sample_doc()).unwrap();
        let doc: RecallDoc = serde_json::from_str(&text).unwrap();
        super::super::register_font().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = recall_frontier(&doc, &dir.path().join("f.png")).unwrap();
        assert!(std::fs::read(&f.path).unwrap().starts_with(b"\x89PNG"));
        assert!(f.caption.contains("12 items"));
        let l = recall_lengths(&doc, &dir.path().join("l.png"))
            .unwrap()
            .unwrap();
        assert!(std::fs::read(&l.path).unwrap().starts_with(b"\x89PNG"));
        assert!(l.caption.contains("(head4)"), "{}", l.caption);
        let mut precision_only = doc.clone();
        precision_only.rows.retain(|r| r.route_kind == "precision");
        assert!(
            recall_lengths(&precision_only, &dir.path().join("p.png"))
                .unwrap()
                .is_none()
        );
        let mut empty = doc;
        empty.rows.clear();
        assert!(recall_frontier(&empty, &dir.path().join("e.png")).is_err());
    }

    /// `draw_all` draws the recall figures when `recall.json` is there and skips them quietly
    /// when it is not.
    #[test]
    fn draw_all_reads_recall_json_when_present() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("figures");
        let set = super::super::draw_all(dir.path(), &out).unwrap();
        assert!(set.written.is_empty());
        assert!(set.skipped.iter().any(|(n, _)| n == "recall_frontier"));
        std::fs::write(
            dir.path().join("recall.json"),
            serde_json::to_string(&sample_doc()).unwrap(),
        )
        .unwrap();
        let set = super::super::draw_all(dir.path(), &out).unwrap();
        let names: Vec<&str> = set.written.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["recall_frontier", "recall_lengths"]);
        assert!(out.join("recall_frontier.png").exists());
    }
}
