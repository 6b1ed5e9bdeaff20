//! `seams.png`: what each switching arm leaves at the seam, by route kind — the handoff JSD
//! against the source's own next-token distribution and the destination's attention flatness
//! (`conditions.json`).

use std::path::Path;

use plotters::prelude::*;

use super::{Figure, Panel, arm_bars, fig_err};
use crate::BenchError;
use crate::conditions::{ArmSummary, ConditionsReport};

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
