//! PNG figures drawn from the benchmark's JSON (never from numbers typed here), with plotters
//! over a bitmap backend and a bundled font (DejaVu Sans, `assets/fonts`, Bitstream Vera
//! licence) registered at run time — plotters' `ab_glyph` text needs one, and depending on a
//! system font would make the figures differ from machine to machine.
//!
//! This file holds the style every figure shares (font, colours, tick text, the per-arm bar
//! panel) and [`draw_all`]; each figure has its own file, and reads its results file through
//! the type that writes it, so a figure and its writer cannot disagree about a field:
//!
//! - `hero.png` ([`hero()`]) — the token series: latency per token coloured by rung, budget
//!   and resident footprint beneath (`token_series.json`, [`TokenSeries`]).
//! - `conditions.png` ([`conditions()`]) — per arm: max stall, switch cost, total time, judge
//!   perplexity (`conditions.json`, [`ConditionsReport`]), medians with the repetitions'
//!   min–max.
//! - `seams.png` ([`seams()`]) — per switching arm: handoff JSD and attention flatness by route
//!   kind (`conditions.json`).
//! - `cost_sweep.png` ([`cost_sweep()`]) — transplant against re-prefill by context length
//!   (`cost_sweep.json`, [`SweepDoc`]).
//! - `projector_residuals.png` ([`residuals()`]) — held-out and training residuals of every
//!   fitted map (`projector_residuals.json`, [`ResidualDoc`]).
//! - `qos.png` ([`qos()`]) — conversations sharing one moving budget through the real server:
//!   budget against modelled and measured usage per round, and each conversation's rung and
//!   state (`serve_qos.json`, [`ServeQosDoc`]).
//! - `recall_frontier.png` ([`recall_frontier()`]) and `recall_lengths.png`
//!   ([`recall_lengths()`]) — recall of the context's facts against switch cost per arm, and
//!   by context length (`recall.json`, [`RecallDoc`]).
//! - `switch_stall.png` ([`stall()`]) — the stall a user sees at a switch per route, before
//!   and after standby rungs, warm and cold page cache (`switch_stall.json`,
//!   [`crate::stall::StallDoc`]).
//!
//! [`draw_all`] draws whichever of them have their JSON present and says why the others were
//! skipped.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Deserialize;

use super::BenchError;
use super::conditions::{ArmSummary, ConditionsReport, TokenSeries};
use super::cost_sweep::SweepDoc;
use super::recall::RecallDoc;
use super::serve_qos::ServeQosDoc;

mod conditions;
mod cost_sweep;
mod hero;
mod qos;
pub mod recall;
mod residuals;
mod seams;
mod stall;

pub use conditions::conditions;
pub use cost_sweep::cost_sweep;
pub use hero::hero;
pub use qos::qos;
pub use recall::{recall_frontier, recall_lengths};
pub use residuals::{CurveDoc, ResidualDoc, residuals};
pub use seams::seams;
pub use stall::stall;

static FONT: &[u8] = include_bytes!("../../../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

fn register_font() -> Result<(), BenchError> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(BenchError::Figure {
            figure: "*".into(),
            message: "the bundled font does not parse".into(),
        })
    }
}

/// A figure written.
#[derive(Debug, Clone)]
pub struct Figure {
    /// File stem (`hero`, `conditions`, …).
    pub name: String,
    /// Where it was written.
    pub path: PathBuf,
    /// One-sentence caption.
    pub caption: String,
}

/// What [`draw_all`] did.
#[derive(Debug, Clone, Default)]
pub struct FigureSet {
    /// Figures written.
    pub written: Vec<Figure>,
    /// `(figure, why)` for those not drawn.
    pub skipped: Vec<(String, String)>,
}

fn fig_err<E: std::fmt::Display>(figure: &str) -> impl Fn(E) -> BenchError + '_ {
    move |e| BenchError::Figure {
        figure: figure.to_string(),
        message: e.to_string(),
    }
}

/// Reads and parses a results JSON file.
///
/// # Errors
/// [`BenchError::Io`] or [`BenchError::Json`].
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| BenchError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

const RUNG_COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

fn rung_color(rungs: &[String], name: &str) -> RGBColor {
    let i = rungs.iter().position(|r| r == name).unwrap_or(3);
    RUNG_COLORS[i.min(3)]
}

fn arm_color(arm: &str) -> RGBColor {
    match arm {
        "A" => RGBColor(127, 127, 127),
        "B" => RGBColor(140, 86, 75),
        "C" => RGBColor(214, 39, 40),
        "D" => RGBColor(31, 119, 180),
        _ => RGBColor(148, 103, 189),
    }
}

#[allow(clippy::cast_precision_loss)]
fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 20)
}

/// The word serde writes for a unit enum variant (`RouteKind::Size` → `size`), so a figure or
/// the page names a value exactly as its results file does.
pub(crate) fn serde_word<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

/// Draws every figure whose JSON is present in `results` into `out`.
///
/// # Errors
/// [`BenchError::Io`] when `out` cannot be created; a figure whose JSON exists but does not
/// parse or draw is an error too (a silently missing figure would hide a broken result).
pub fn draw_all(results: &Path, out: &Path) -> Result<FigureSet, BenchError> {
    register_font()?;
    std::fs::create_dir_all(out).map_err(|source| BenchError::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let mut set = FigureSet::default();
    let mut missing = |name: &str, file: &str| {
        set.skipped
            .push((name.to_string(), format!("{file} not found in results")));
    };
    let ts = results.join("token_series.json");
    let cond = results.join("conditions.json");
    let sweep = results.join("cost_sweep.json");
    let resid = results.join("projector_residuals.json");
    let mut written = Vec::new();
    if ts.exists() {
        let series: TokenSeries = read_json(&ts)?;
        written.push(hero(&series, &out.join("hero.png"))?);
    } else {
        missing("hero", "token_series.json");
    }
    if cond.exists() {
        let report: ConditionsReport = read_json(&cond)?;
        written.push(conditions(&report, &out.join("conditions.png"))?);
        written.push(seams(&report, &out.join("seams.png"))?);
    } else {
        missing("conditions", "conditions.json");
        missing("seams", "conditions.json");
    }
    if sweep.exists() {
        let doc: SweepDoc = read_json(&sweep)?;
        written.push(cost_sweep(&doc, &out.join("cost_sweep.png"))?);
    } else {
        missing("cost_sweep", "cost_sweep.json");
    }
    if resid.exists() {
        let doc: ResidualDoc = read_json(&resid)?;
        written.push(residuals(&doc, &out.join("projector_residuals.png"))?);
    } else {
        missing("projector_residuals", "projector_residuals.json");
    }
    let qos_path = results.join("serve_qos.json");
    if qos_path.exists() {
        let doc: ServeQosDoc = read_json(&qos_path)?;
        written.push(qos(&doc, &out.join("qos.png"))?);
    } else {
        missing("qos", "serve_qos.json");
    }
    let recall_path = results.join("recall.json");
    if recall_path.exists() {
        let doc: RecallDoc = read_json(&recall_path)?;
        written.push(recall_frontier(&doc, &out.join("recall_frontier.png"))?);
        match recall_lengths(&doc, &out.join("recall_lengths.png"))? {
            Some(f) => written.push(f),
            None => set.skipped.push((
                "recall_lengths".into(),
                "recall.json has no size route".into(),
            )),
        }
    } else {
        missing("recall_frontier", "recall.json");
        missing("recall_lengths", "recall.json");
    }
    match stall::draw(results, out) {
        Some(f) => written.push(f?),
        None => set.skipped.push((
            "switch_stall".into(),
            "switch_stall.json not found in results".into(),
        )),
    }
    set.written = written;
    Ok(set)
}

/// Axis tick text: no trailing ".0" on large values, enough digits on small ones.
fn tick(y: f64) -> String {
    let a = y.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{y:.0}")
    } else if a >= 1.0 {
        format!("{y:.1}")
    } else if a >= 0.01 {
        format!("{y:.2}")
    } else {
        format!("{y:.4}")
    }
}

/// A bar's height and, when repeated, its `(min, max)`.
type Bar = Option<(f64, Option<(f64, f64)>)>;

/// One panel of per-arm bars.
struct Panel<'a> {
    title: &'a str,
    y_desc: &'a str,
    log: bool,
    figure: &'a str,
}

/// One bar per arm with optional min–max whisker; `None` draws a note instead of a bar.
#[allow(clippy::cast_precision_loss)]
fn arm_bars(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    panel: &Panel<'_>,
    arms: &[&ArmSummary],
    value: &dyn Fn(&ArmSummary) -> Bar,
    note: &dyn Fn(&ArmSummary) -> String,
) -> Result<(), BenchError> {
    let Panel {
        title,
        y_desc,
        log,
        figure,
    } = *panel;
    let e = fig_err(figure);
    let vals: Vec<Bar> = arms.iter().map(|a| value(a)).collect();
    let hi = vals
        .iter()
        .flatten()
        .map(|(v, r)| r.map_or(*v, |(_, mx)| mx.max(*v)))
        .fold(0.0, f64::max);
    let lo_pos = vals
        .iter()
        .flatten()
        .map(|(v, r)| r.map_or(*v, |(mn, _)| mn.min(*v)))
        .filter(|v| *v > 0.0)
        .fold(f64::INFINITY, f64::min);
    let n = arms.len() as f64;
    // Ablations without their "D-" prefix: ten labels must fit under ten bars.
    let labels: Vec<String> = arms
        .iter()
        .map(|a| a.arm.strip_prefix("D-").unwrap_or(&a.arm).to_string())
        .collect();
    let fmt = move |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, (FAMILY, 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70);
    macro_rules! draw {
        ($chart:expr, $base:expr, $note_y:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .light_line_style(WHITE)
                .x_labels(arms.len() + 1)
                .x_label_formatter(&fmt)
                .y_label_formatter(&|y: &f64| tick(*y))
                .y_desc(y_desc)
                .label_style((FAMILY, 13))
                .draw()
                .map_err(&e)?;
            for (i, (arm, v)) in arms.iter().zip(&vals).enumerate() {
                let x = i as f64;
                let c = arm_color(&arm.arm);
                match v {
                    Some((y, range)) => {
                        chart
                            .draw_series(std::iter::once(Rectangle::new(
                                [(x - 0.35, $base), (x + 0.35, *y)],
                                c.filled(),
                            )))
                            .map_err(&e)?;
                        if let Some((mn, mx)) = range {
                            chart
                                .draw_series(std::iter::once(PathElement::new(
                                    vec![(x, *mn), (x, *mx)],
                                    BLACK.stroke_width(2),
                                )))
                                .map_err(&e)?;
                        }
                    }
                    None => {
                        chart
                            .draw_series(std::iter::once(Text::new(
                                note(arm),
                                (x - 0.4, $note_y),
                                (FAMILY, 12).into_font().color(&RGBColor(90, 90, 90)),
                            )))
                            .map_err(&e)?;
                    }
                }
            }
        }};
    }
    if log {
        let lo = if lo_pos.is_finite() {
            lo_pos * 0.5
        } else {
            0.1
        };
        let base = lo;
        let top = (hi * 2.0).max(lo * 10.0);
        let note_y = lo * (top / lo).powf(0.08);
        draw!(
            builder
                .build_cartesian_2d(-0.6..n - 0.4, (lo..top).log_scale())
                .map_err(&e)?,
            base,
            note_y
        );
    } else {
        let top = (hi * 1.15).max(1e-9);
        draw!(
            builder
                .build_cartesian_2d(-0.6..n - 0.4, 0.0..top)
                .map_err(&e)?,
            0.0,
            top * 0.06
        );
    }
    Ok(())
}
