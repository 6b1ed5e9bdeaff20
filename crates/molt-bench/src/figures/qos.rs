//! `qos.png`: conversations sharing one moving budget through the real server — the budget
//! against the server's modelled usage and its measured usage (resident set above its floor)
//! round by round, and each conversation's rung and state (`serve_qos.json`, written by
//! `molt-run bench --serve-qos`, [`ServeQosDoc`]).

use std::path::Path;

use plotters::prelude::*;

use super::{FAMILY, Figure, fig_err, mib, rung_color};
use crate::BenchError;
use crate::serve_qos::{ServeQosDoc, ServeRound, TenantRow};
use molt_server::conversations::ConversationState;

/// The rungs of a run in the order it first used them (the engine's, then the
/// conversations'), so the colours follow the descent.
fn rungs_in_order(rounds: &[ServeRound]) -> Vec<String> {
    let mut rungs: Vec<String> = Vec::new();
    for r in rounds {
        let names = std::iter::once(&r.engine_rung)
            .chain(&r.loaded)
            .chain(r.tenants.iter().map(|t| &t.rung));
        for g in names {
            if !g.is_empty() && !rungs.contains(g) {
                rungs.push(g.clone());
            }
        }
    }
    rungs
}

/// The rung a conversation's lane shows in a round: the engine's while it is answering — every
/// running answer of the batch is on the engine's rung, while the status may list a running
/// conversation under the rung it was on before (or none, for a new one) — and its own
/// otherwise (where its kept cache or its state file is).
fn lane_rung<'a>(round: &'a ServeRound, t: &'a TenantRow) -> &'a str {
    if t.state == ConversationState::Running || t.rung.is_empty() {
        &round.engine_rung
    } else {
        &t.rung
    }
}

/// A lane cell's colour: the rung's while answering, paler while kept in RAM; greys where the
/// cache is out of the engine (parked, in its state file, waiting); none when nothing is kept.
fn state_color(rungs: &[String], rung: &str, state: ConversationState) -> Option<RGBColor> {
    match state {
        ConversationState::Running => Some(rung_color(rungs, rung)),
        ConversationState::Kept => {
            let RGBColor(r, g, b) = rung_color(rungs, rung);
            let pale = |c: u8| u8::try_from((u16::from(c) + 2 * 255) / 3).unwrap_or(255);
            Some(RGBColor(pale(r), pale(g), pale(b)))
        }
        ConversationState::Parked => Some(RGBColor(60, 60, 60)),
        ConversationState::Hibernated => Some(RGBColor(140, 140, 140)),
        ConversationState::Queued => Some(RGBColor(215, 215, 215)),
        ConversationState::Dropped => None,
    }
}

/// Budget against usage per round, and one lane per conversation coloured by rung and state.
///
/// # Errors
/// [`BenchError::Figure`] when drawing fails or there are no rounds.
#[allow(clippy::cast_precision_loss, clippy::too_many_lines)]
pub fn qos(doc: &ServeQosDoc, path: &Path) -> Result<Figure, BenchError> {
    let name = "qos";
    let e = fig_err(name);
    let r = &doc.report;
    if r.rounds.is_empty() {
        return Err(BenchError::Figure {
            figure: name.into(),
            message: "no rounds".into(),
        });
    }
    let rungs = rungs_in_order(&r.rounds);
    let n = r.rounds.iter().map(|x| x.round).max().unwrap_or(0) as f64 + 1.0;
    let root = BitMapBackend::new(path, (1400, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let (top, bottom) = root.split_vertically(440);
    let ymax = r
        .rounds
        .iter()
        .map(|x| mib(x.budget_bytes.max(x.modelled_bytes).max(x.measured_bytes)))
        .fold(1.0, f64::max)
        * 1.45; // room above the lines for the legend
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "{} conversations through serve --parallel {}, one moving budget: killed {}, lost {}, max overshoot {:+.0} MiB measured",
                r.conversations.len(),
                r.parallel,
                r.killed,
                r.lost_conversations,
                r.max_overshoot_measured_bytes as f64 / f64::from(1u32 << 20)
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
        .x_desc(format!("round ({} s each)", r.round_ms as f64 / 1e3))
        .label_style((FAMILY, 13))
        .draw()
        .map_err(&e)?;
    let series = |f: &dyn Fn(&ServeRound) -> u64| -> Vec<(f64, f64)> {
        r.rounds
            .iter()
            .map(|x| (x.round as f64, mib(f(x))))
            .collect()
    };
    for (label, pts, color) in [
        ("budget", series(&|x| x.budget_bytes), RED),
        ("modelled usage", series(&|x| x.modelled_bytes), BLUE),
        (
            "measured usage (resident set above the floor)",
            series(&|x| x.measured_bytes),
            BLACK,
        ),
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
            .label(format!("lane: answering on {g}"))
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
    let ids: Vec<String> = r.conversations.iter().map(|c| c.spec.id.clone()).collect();
    let lanes = ids.len() as f64;
    let names = ids.clone();
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
        .y_labels(ids.len() + 1)
        .y_label_formatter(&fmt)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .x_desc("round (colour: the rung answering; pale: kept in RAM; grey: in its state file; dark: parked; light: queued)")
        .label_style((FAMILY, 13))
        .draw()
        .map_err(&e)?;
    for round in &r.rounds {
        for t in &round.tenants {
            let Some(i) = ids.iter().position(|id| *id == t.id) else {
                continue;
            };
            let Some(color) = state_color(&rungs, lane_rung(round, t), t.state) else {
                continue;
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
            "{} conversations through the real server (`serve --parallel {}`, a child process) under {}: the budget against the server's modelled usage and its resident set above its {:.0} MiB floor, sampled every round, and each conversation's rung and state round by round.",
            r.conversations.len(),
            r.parallel,
            r.budget_source,
            mib(r.floor_rss_bytes)
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve_qos::{ConversationReport, ConversationSpec, ServeQosReport};

    fn written() -> ServeQosDoc {
        let row = |id: &str, rung: &str, state| TenantRow {
            id: id.into(),
            class: "foreground".into(),
            priority: 0,
            rung: rung.into(),
            tokens: 30,
            state,
            bytes: 1 << 20,
        };
        let round = |round, budget_bytes: u64, used: u64, tenants| ServeRound {
            round,
            t_s: round as f64,
            budget_bytes,
            rss_bytes: used + (100 << 20),
            measured_bytes: used,
            modelled_bytes: used,
            overshoot_measured_bytes: -5,
            overshoot_modelled_bytes: -5,
            engine_rung: "tier0".into(),
            loaded: vec!["tier0".into()],
            parked: false,
            released: false,
            queued: 0,
            tenants,
        };
        let conversation = |id: &str| ConversationReport {
            spec: ConversationSpec {
                id: id.into(),
                class: "foreground".into(),
                priority: 0,
                turns: vec!["hello".into()],
                fact: "x".into(),
            },
            turns: Vec::new(),
            complete: true,
            recalled: true,
        };
        ServeQosDoc {
            run: serde_json::Value::Null,
            trace: Some("t.json".into()),
            real_hog: false,
            n_ctx: 2048,
            threads: Some(2),
            max_tokens: 32,
            report: ServeQosReport {
                max_overshoot_measured_bytes: -5,
                max_overshoot_modelled_bytes: -5,
                killed: 0,
                lost_conversations: 0,
                hibernated: 1,
                resumed: 1,
                rounds: vec![
                    round(
                        0,
                        2 << 30,
                        1 << 30,
                        vec![
                            row("chat", "", ConversationState::Running),
                            row("ops", "tier2", ConversationState::Running),
                        ],
                    ),
                    round(
                        1,
                        1 << 29,
                        1 << 28,
                        vec![
                            row("chat", "tier2", ConversationState::Kept),
                            row("ops", "tier0", ConversationState::Hibernated),
                        ],
                    ),
                ],
                released: 1,
                floor_rss_bytes: 100 << 20,
                max_overshoot_rss_bytes: 10,
                recalled: 2,
                conversations: vec![conversation("chat"), conversation("ops")],
                budget_source: "trace t".into(),
                round_ms: 3000,
                wall_s: 6.0,
                parallel: 4,
                think_rounds: 8,
            },
        }
    }

    /// The `QoS` figure from what `bench --serve-qos` writes, read back through the writer's
    /// own type; a conversation state the server never writes does not read.
    #[test]
    fn qos_figure_draws_from_what_the_bench_writes() {
        let text = serde_json::to_string(&written()).unwrap();
        let doc: ServeQosDoc = serde_json::from_str(&text).unwrap();
        assert_eq!(
            doc.report.rounds[1].tenants[1].state,
            ConversationState::Hibernated
        );
        assert_eq!(doc.n_ctx, 2048);
        assert_eq!(doc.report.parallel, 4);
        assert!(
            serde_json::from_str::<ServeQosDoc>(
                &text.replace("\"state\":\"hibernated\"", "\"state\":\"asleep\"")
            )
            .is_err()
        );
        assert_eq!(rungs_in_order(&doc.report.rounds), ["tier0", "tier2"]);
        let (r0, r1) = (&doc.report.rounds[0], &doc.report.rounds[1]);
        assert_eq!(lane_rung(r0, &r0.tenants[0]), "tier0", "the engine's");
        assert_eq!(lane_rung(r0, &r0.tenants[1]), "tier0", "the engine's");
        assert_eq!(lane_rung(r1, &r1.tenants[0]), "tier2", "its own");
        super::super::register_font().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = qos(&doc, &dir.path().join("qos.png")).unwrap();
        assert!(std::fs::read(&f.path).unwrap().starts_with(b"\x89PNG"));
        assert!(f.caption.contains("2 conversations"), "{}", f.caption);
        assert!(f.caption.contains("--parallel 4"), "{}", f.caption);
    }

    /// The committed results file reads (a field renamed in the writer would fail here before
    /// `molt-run figures` does).
    #[test]
    fn the_committed_serve_qos_json_reads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results/serve_qos.json");
        let doc: ServeQosDoc = crate::figures::read_json(&path).unwrap();
        assert!(!doc.report.rounds.is_empty());
        assert_eq!(doc.report.conversations.len(), 3);
    }
}
