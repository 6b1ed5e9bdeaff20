//! PNG figures drawn from the benchmark's JSON (never from numbers typed here), with plotters
//! over a bitmap backend and a bundled font (DejaVu Sans, `assets/fonts`, Bitstream Vera
//! licence) registered at run time — plotters' `ab_glyph` text needs one, and depending on a
//! system font would make the figures differ from machine to machine.
//!
//! - `hero.png` — the token series: latency per token coloured by rung, budget and resident
//!   footprint beneath (`token_series.json`).
//! - `conditions.png` — per arm: max stall, switch cost, total time, judge perplexity
//!   (`conditions.json`), medians with the repetitions' min–max.
//! - `seams.png` — per switching arm: handoff JSD and attention flatness by route kind.
//! - `cost_sweep.png` — transplant against re-prefill by context length (`cost_sweep.json`).
//! - `projector_residuals.png` — held-out and training residuals of every fitted map
//!   (`projector_residuals.json`).
//! - `qos.png` — several tenants sharing one moving budget: budget against modelled and
//!   measured usage per round, and each tenant's rung and state (`qos.json`, written by
//!   `molt-run bench --qos` where that benchmark is built).
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
use super::speed::Rate;

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
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
    let qos_path = results.join("qos.json");
    if qos_path.exists() {
        let doc: QosDoc = read_json(&qos_path)?;
        written.push(qos(&doc, &out.join("qos.png"))?);
    } else {
        missing("qos", "qos.json");
    }
    set.written = written;
    Ok(set)
}

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
            s.from, s.to, s.method, s.cost_ms, s.load_ms
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

fn with_range(r: Option<&Rate>) -> Option<(f64, Option<(f64, f64)>)> {
    r.map(|r| (r.median, Some((r.min, r.max))))
}

/// Four panels over the arms: max stall, switch cost, total time, judge perplexity.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails.
pub fn conditions(report: &ConditionsReport, path: &Path) -> Result<Figure, BenchError> {
    let name = "conditions";
    let e = fig_err(name);
    let arms: Vec<&ArmSummary> = report.summary.iter().filter(|s| s.built).collect();
    let root = BitMapBackend::new(path, (1600, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let panels = root.split_evenly((2, 2));
    let killed = |a: &ArmSummary| {
        if a.killed > 0 {
            format!("killed {}/{}", a.killed, a.prompts)
        } else {
            "no switch".into()
        }
    };
    arm_bars(
        &panels[0],
        &Panel {
            title: "max stall: largest inter-token latency (median over reps, min-max)",
            y_desc: "ms (log)",
            log: true,
            figure: name,
        },
        &arms,
        &|a| with_range(a.max_stall_ms.as_ref()),
        &killed,
    )?;
    arm_bars(
        &panels[1],
        &Panel {
            title: "switch cost per answer, loading excluded",
            y_desc: "ms (log)",
            log: true,
            figure: name,
        },
        &arms,
        &|a| with_range(a.switch_cost_ms.as_ref()),
        &killed,
    )?;
    arm_bars(
        &panels[2],
        &Panel {
            title: "total time per answer (until the kill for A)",
            y_desc: "ms",
            log: false,
            figure: name,
        },
        &arms,
        &|a| with_range(a.total_ms.as_ref()),
        &killed,
    )?;
    let first = report.settings.steps.first().copied().unwrap_or(0);
    arm_bars(
        &panels[3],
        &Panel {
            title: &format!(
                "judge perplexity ({} scores the answer from the first switch, token {first})",
                report.settings.judge
            ),
            y_desc: "perplexity (log)",
            log: true,
            figure: name,
        },
        &arms,
        &|a| a.judge_ppl.map(|v| (v, None)),
        &|a| {
            if a.killed > 0 {
                "answer lost".into()
            } else {
                "-".into()
            }
        },
    )?;
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "Every arm on {} prompts under trace {}: max stall and switch cost (log scales), total time, and the judge's perplexity of the continuation; bars are medians over {} repetitions, whiskers their min-max.",
            report.prompts.len(),
            report.trace.name,
            report.settings.reps
        ),
    })
}

/// Handoff JSD and attention flatness per switching arm, by route kind.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails.
pub fn seams(report: &ConditionsReport, path: &Path) -> Result<Figure, BenchError> {
    let name = "seams";
    let e = fig_err(name);
    let arms: Vec<&ArmSummary> = report
        .summary
        .iter()
        .filter(|s| s.built && s.switches_per_answer > 0.0)
        .collect();
    let root = BitMapBackend::new(path, (1600, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let panels = root.split_evenly((2, 2));
    let none = |_: &ArmSummary| "-".to_string();
    arm_bars(
        &panels[0],
        &Panel {
            title: "handoff JSD, precision route (C is the floor)",
            y_desc: "nats",
            log: false,
            figure: name,
        },
        &arms,
        &|a| a.handoff_jsd_precision.map(|v| (v, None)),
        &none,
    )?;
    arm_bars(
        &panels[1],
        &Panel {
            title: "handoff JSD, size route (C is the floor)",
            y_desc: "nats",
            log: false,
            figure: name,
        },
        &arms,
        &|a| a.handoff_jsd_size.map(|v| (v, None)),
        &none,
    )?;
    arm_bars(
        &panels[2],
        &Panel {
            title: "attention flatness, precision route (1 = native)",
            y_desc: "entropy ratio",
            log: false,
            figure: name,
        },
        &arms,
        &|a| a.flatness_precision.map(|v| (v, None)),
        &none,
    )?;
    arm_bars(
        &panels[3],
        &Panel {
            title: "attention flatness, size route (1 = native)",
            y_desc: "entropy ratio",
            log: false,
            figure: name,
        },
        &arms,
        &|a| a.flatness_size.map(|v| (v, None)),
        &none,
    )?;
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: "At the seam, per switching arm and route kind: the handoff JSD between the destination's first next-token distribution and the source's own (C's re-prefill is the floor), and the destination's attention entropy after the switch over its entropy on a cache it built itself.".into(),
    })
}

/// The cost sweep's JSON, as far as the figure and the page read it.
#[derive(Debug, Clone, Deserialize)]
pub struct SweepDoc {
    /// Repetitions.
    #[serde(default)]
    pub reps: usize,
    /// Where the contexts came from (`chat`, `raw`; absent in older files: raw windows).
    #[serde(default)]
    pub contexts: Option<String>,
    /// Head re-read of the measured switch (absent in older files: none).
    #[serde(default)]
    pub head_reread: usize,
    /// Points.
    pub points: Vec<SweepPointDoc>,
}

/// One point of the cost sweep.
#[derive(Debug, Clone, Deserialize)]
pub struct SweepPointDoc {
    /// `src→dst`.
    pub route: String,
    /// `precision` or `size`.
    pub kind: String,
    /// Context tokens carried.
    pub context_tokens: usize,
    /// Transplant cost.
    pub transplant_ms: Rate,
    /// Re-prefill cost.
    pub reprefill_ms: Rate,
    /// Median ratio.
    pub speedup: f64,
    /// FLOPs avoided.
    pub flops_avoided: f64,
    /// Transplant handoff JSD.
    pub transplant_jsd: f64,
    /// Re-prefill handoff JSD (floor).
    pub reprefill_jsd: f64,
    /// Their ratio.
    pub seam_ratio: f64,
    /// Transplant JSD averaged over the switch step and the steps after it.
    #[serde(default)]
    pub transplant_jsd_mean: Option<f64>,
    /// The same for the re-prefill (floor).
    #[serde(default)]
    pub reprefill_jsd_mean: Option<f64>,
    /// Their ratio.
    #[serde(default)]
    pub seam_mean_ratio: Option<f64>,
    /// The transplant with tail recompute.
    #[serde(default)]
    pub tails: Vec<crate::bench::cost_sweep::TailPoint>,
}

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
        let pts: Vec<&SweepPointDoc> = doc.points.iter().filter(|p| &p.route == route).collect();
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
    // The mean over the switch step and the steps after it when the sweep recorded it (one
    // step can be near-certain for both models); older sweeps have the switch step only.
    let mean = doc.points.iter().any(|p| p.seam_mean_ratio.is_some());
    let ratio = |p: &SweepPointDoc| {
        if mean {
            p.seam_mean_ratio.unwrap_or(f64::NAN)
        } else {
            p.seam_ratio
        }
    };
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
            if mean {
                format!(
                    "seam: transplant / re-prefill JSD, mean over {} steps",
                    super::cost_sweep::SEAM + 1
                )
            } else {
                "seam: transplant JSD / re-prefill JSD".to_string()
            },
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
            "Transplant against re-prefill with both rungs warm, every route, by context length (median of {} repetitions), and how much more the transplant diverges at the seam than a re-prefill does.",
            doc.reps
        ),
    })
}

/// The residuals JSON, as far as the figure and the page read it.
#[derive(Debug, Clone, Deserialize)]
pub struct ResidualDoc {
    /// The training report.
    pub report: ResidualReport,
}

/// The training report's routes.
#[derive(Debug, Clone, Deserialize)]
pub struct ResidualReport {
    /// Corpus tokens.
    #[serde(default)]
    pub corpus_tokens: usize,
    /// One per route and variant.
    pub routes: Vec<ResidualRoute>,
}

/// One fitted route and variant.
#[derive(Debug, Clone, Deserialize)]
pub struct ResidualRoute {
    /// `src→dst`.
    pub route: String,
    /// Route kind.
    pub kind: String,
    /// Variant.
    pub variant: String,
    /// The fit.
    pub fit: ResidualFit,
}

/// K and V residuals of a fit.
#[derive(Debug, Clone, Deserialize)]
pub struct ResidualFit {
    /// K.
    pub k: ResidualPair,
    /// V.
    pub v: ResidualPair,
}

/// Relative RMS on training and held-out rows.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct ResidualPair {
    /// Training rows.
    pub train: f64,
    /// Held-out rows.
    pub held_out: f64,
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
        .map(|r| format!("{} {}", r.route, r.variant))
        .collect();
    for (area, which, title) in [(&left, 'k', "K"), (&right, 'v', "V")] {
        let pick = |r: &ResidualRoute| if which == 'k' { r.fit.k } else { r.fit.v };
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
            let c = if r.kind == "precision" {
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

/// The multi-tenant benchmark's JSON, as far as the figure and the page read it.
#[derive(Debug, Clone, Deserialize)]
pub struct QosDoc {
    /// The run's report.
    pub report: QosReportDoc,
}

/// The multi-tenant report.
#[derive(Debug, Clone, Deserialize)]
pub struct QosReportDoc {
    /// Where the budget came from.
    #[serde(default)]
    pub budget_source: String,
    /// One per scheduling round.
    pub rounds: Vec<QosRoundDoc>,
    /// One per tenant.
    pub tenants: Vec<QosTenantDoc>,
    /// Max over rounds of modelled usage − budget, after enforcement.
    #[serde(default)]
    pub max_overshoot_modelled: i64,
    /// Max over rounds of measured usage − budget, after enforcement.
    #[serde(default)]
    pub max_overshoot_measured: i64,
    /// Rounds whose plan could not fit.
    #[serde(default)]
    pub infeasible_rounds: usize,
    /// Tenants terminated.
    #[serde(default)]
    pub killed: usize,
    /// Wall time, s.
    #[serde(default)]
    pub wall_s: f64,
}

/// One round.
#[derive(Debug, Clone, Deserialize)]
pub struct QosRoundDoc {
    /// Round index.
    pub round: usize,
    /// Budget, bytes.
    pub budget_bytes: u64,
    /// Modelled usage after enforcement, bytes.
    pub modelled_after: u64,
    /// Measured usage after enforcement, bytes.
    pub measured_after: u64,
    /// Tenants after enforcement.
    #[serde(default)]
    pub tenants: Vec<QosTenantRound>,
}

/// A tenant at the end of a round.
#[derive(Debug, Clone, Deserialize)]
pub struct QosTenantRound {
    /// Tenant id.
    pub tenant: u64,
    /// `waiting`, `running`, `parked` or `done`.
    pub state: String,
    /// Rung.
    pub rung: String,
}

/// One tenant's summary.
#[derive(Debug, Clone, Deserialize)]
pub struct QosTenantDoc {
    /// Tenant id.
    pub tenant: u64,
    /// Name.
    pub name: String,
    /// Class.
    #[serde(default)]
    pub class: String,
    /// Tokens generated.
    #[serde(default)]
    pub tokens: usize,
    /// Rounds present without progress.
    #[serde(default)]
    pub stall_rounds: usize,
    /// Rounds deferred before admission.
    #[serde(default)]
    pub deferred_rounds: usize,
    /// Levers applied, by kind.
    #[serde(default)]
    pub levers: std::collections::BTreeMap<String, usize>,
    /// Rungs in order.
    #[serde(default)]
    pub rungs: Vec<String>,
    /// How it ended.
    #[serde(default)]
    pub stop: String,
}

/// Budget against usage per round, and one lane per tenant coloured by rung (grey: waiting,
/// hatched dark: parked).
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or there are no rounds.
#[allow(clippy::cast_precision_loss, clippy::too_many_lines)]
pub fn qos(doc: &QosDoc, path: &Path) -> Result<Figure, BenchError> {
    let name = "qos";
    let e = fig_err(name);
    let r = &doc.report;
    if r.rounds.is_empty() {
        return Err(BenchError::Figure {
            figure: name.into(),
            message: "no rounds".into(),
        });
    }
    let mut rungs: Vec<String> = Vec::new();
    for t in &r.tenants {
        for g in &t.rungs {
            if !rungs.contains(g) {
                rungs.push(g.clone());
            }
        }
    }
    rungs.sort();
    let n = r.rounds.iter().map(|x| x.round).max().unwrap_or(0) as f64 + 1.0;
    let root = BitMapBackend::new(path, (1400, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let (top, bottom) = root.split_vertically(440);
    let ymax = r
        .rounds
        .iter()
        .map(|x| mib(x.budget_bytes.max(x.modelled_after).max(x.measured_after)))
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "{} tenants, one moving budget: killed {}, max overshoot after enforcement {:+.0} MiB measured",
                r.tenants.len(),
                r.killed,
                r.max_overshoot_measured as f64 / f64::from(1u32 << 20)
            ),
            (FAMILY, 20),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..ymax)
        .map_err(&e)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .y_label_formatter(&|y: &f64| format!("{y:.0}"))
        .y_desc("MiB")
        .x_desc("scheduling round")
        .label_style((FAMILY, 13))
        .draw()
        .map_err(&e)?;
    let series = |f: &dyn Fn(&QosRoundDoc) -> u64| -> Vec<(f64, f64)> {
        r.rounds
            .iter()
            .map(|x| (x.round as f64, mib(f(x))))
            .collect()
    };
    for (label, pts, color) in [
        ("budget", series(&|x| x.budget_bytes), RED),
        ("modelled usage", series(&|x| x.modelled_after), BLUE),
        ("measured usage", series(&|x| x.measured_after), BLACK),
    ] {
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(&e)?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
            });
    }
    // The lanes' colours, explained in this legend (the lanes leave no free corner).
    for g in &rungs {
        let c = rung_color(&rungs, g);
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
            .map_err(&e)?
            .label(format!("lane: running on {g}"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FAMILY, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(&e)?;
    let lanes = r.tenants.len() as f64;
    let names: Vec<String> = r.tenants.iter().map(|t| t.name.clone()).collect();
    let fmt = move |y: &f64| {
        let i = y.round();
        if (y - i).abs() < 1e-6 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut lane = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(100)
        .build_cartesian_2d(-0.5..n - 0.5, (lanes - 0.5)..-0.5)
        .map_err(&e)?;
    lane.configure_mesh()
        .disable_mesh()
        .y_labels(r.tenants.len() + 1)
        .y_label_formatter(&fmt)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .x_desc("scheduling round (colour: rung; grey: waiting; dark: parked)")
        .label_style((FAMILY, 13))
        .draw()
        .map_err(&e)?;
    for round in &r.rounds {
        for t in &round.tenants {
            let Some(i) = r.tenants.iter().position(|x| x.tenant == t.tenant) else {
                continue;
            };
            let color = match t.state.as_str() {
                "waiting" => RGBColor(210, 210, 210),
                "parked" => RGBColor(60, 60, 60),
                "done" => continue,
                _ => rung_color(&rungs, &t.rung),
            };
            let (x, y) = (round.round as f64, i as f64);
            lane.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.5, y - 0.35), (x + 0.5, y + 0.35)],
                color.filled(),
            )))
            .map_err(&e)?;
        }
    }
    root.present().map_err(&e)?;
    Ok(Figure {
        name: name.into(),
        path: path.to_path_buf(),
        caption: format!(
            "{} tenants under {}: the budget against the scheduler's modelled usage and the measured usage after every round's enforcement, and each tenant's rung round by round.",
            r.tenants.len(),
            r.budget_source
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multi-tenant figure from a minimal document in the shape `bench --qos` writes.
    #[test]
    fn qos_figure_draws_from_its_json_shape() {
        let doc: QosDoc = serde_json::from_value(serde_json::json!({
            "report": {
                "budget_source": "trace t",
                "rounds": [
                    {"round": 0, "budget_bytes": 2u64 << 30, "modelled_after": 1u64 << 30,
                     "measured_after": 1u64 << 30, "mode": "hold",
                     "tenants": [{"tenant": 0, "state": "running", "rung": "tier0", "context_tokens": 3, "generated": 1},
                                 {"tenant": 1, "state": "waiting", "rung": "tier0", "context_tokens": 0, "generated": 0}]},
                    {"round": 1, "budget_bytes": 1u64 << 29, "modelled_after": 1u64 << 28,
                     "measured_after": 1u64 << 28,
                     "tenants": [{"tenant": 0, "state": "parked", "rung": "tier2"},
                                 {"tenant": 1, "state": "running", "rung": "tier2"}]}
                ],
                "tenants": [
                    {"tenant": 0, "name": "chat", "class": "foreground", "tokens": 2,
                     "levers": {"park": 1}, "rungs": ["tier0", "tier2"], "stop": "length"},
                    {"tenant": 1, "name": "batch", "rungs": ["tier2"]}
                ],
                "max_overshoot_measured": -5, "killed": 0
            }
        }))
        .unwrap();
        register_font().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = qos(&doc, &dir.path().join("qos.png")).unwrap();
        assert!(std::fs::read(&f.path).unwrap().starts_with(b"\x89PNG"));
        assert!(f.caption.contains("2 tenants"));
    }
}
