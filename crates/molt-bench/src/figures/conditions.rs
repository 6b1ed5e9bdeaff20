//! `conditions.png`: every arm of the conditions benchmark side by side — max stall, switch
//! cost, total time and the judge's perplexity, medians over the repetitions with their
//! min–max (`conditions.json`).

use std::path::Path;

use plotters::prelude::*;

use super::{Bar, Figure, Panel, arm_bars, fig_err};
use crate::BenchError;
use crate::conditions::{ArmSummary, ConditionsReport};
use crate::speed::Rate;

fn with_range(r: Option<&Rate>) -> Bar {
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
