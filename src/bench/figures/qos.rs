//! `qos.png`: several tenants sharing one moving budget — the budget against the scheduler's
//! modelled usage and the measured usage after every round's enforcement, and each tenant's
//! rung and state round by round (`qos.json`, written by `molt-run bench --qos`).

use std::path::Path;

use plotters::prelude::*;

use super::{FAMILY, Figure, fig_err, mib, rung_color};
use crate::bench::BenchError;
use crate::bench::qos::{QosDoc, RoundRecord};

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
    let series = |f: &dyn Fn(&RoundRecord) -> u64| -> Vec<(f64, f64)> {
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
            let color = match t.state {
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
    use std::collections::BTreeMap;

    use super::*;
    use crate::bench::qos::{QosReport, TenantReport, TenantState};
    use crate::sched::{Lever, PlanMode, Policy, TenantClass, TenantId};

    fn written() -> QosDoc {
        let state = |tenant, state, rung: &str| TenantState {
            tenant: TenantId(tenant),
            state,
            rung: rung.into(),
            context_tokens: 3,
            generated: 1,
        };
        let round = |round, budget_bytes, used, tenants| RoundRecord {
            round,
            budget_bytes,
            mode: PlanMode::Hold,
            feasible: true,
            actions: vec![(TenantId(0), Lever::Admit { rung: 0 })],
            modelled_before: used,
            modelled_after: used,
            measured_after: used,
            rss_after: used,
            overshoot_modelled: -5,
            overshoot_measured: -5,
            apply_ms: 1.0,
            tenants,
            tokens: vec![(TenantId(0), "a".into())],
        };
        let tenant = |id, name: &str, rungs: &[&str]| TenantReport {
            tenant: TenantId(id),
            name: name.into(),
            class: TenantClass::Foreground,
            tokens: 2,
            stall_rounds: 0,
            deferred_rounds: 0,
            levers: BTreeMap::from([("park".to_string(), 1)]),
            rungs: rungs.iter().map(ToString::to_string).collect(),
            finished_round: Some(1),
            stop: "length".into(),
            text: "ab".into(),
        };
        QosDoc {
            run: serde_json::Value::Null,
            trace: Some("t.json".into()),
            real_hog: false,
            n_ctx: 256,
            n_batch: 64,
            threads: 1,
            policy: Policy::default(),
            tenant_specs: Vec::new(),
            report: QosReport {
                costs: Vec::new(),
                floor_anon_bytes: 0,
                budget_source: "trace t".into(),
                rounds: vec![
                    round(
                        0,
                        2 << 30,
                        1 << 30,
                        vec![state(0, "running", "tier0"), state(1, "waiting", "tier0")],
                    ),
                    round(
                        1,
                        1 << 29,
                        1 << 28,
                        vec![state(0, "parked", "tier2"), state(1, "running", "tier2")],
                    ),
                ],
                actions: Vec::new(),
                tenants: vec![
                    tenant(0, "chat", &["tier0", "tier2"]),
                    tenant(1, "batch", &["tier2"]),
                ],
                max_overshoot_modelled: -5,
                max_overshoot_measured: -5,
                infeasible_rounds: 0,
                killed: 0,
                wall_s: 1.0,
            },
        }
    }

    /// The multi-tenant figure from what `bench --qos` writes, read back through the writer's
    /// own type; a tenant state the writer never writes does not read.
    #[test]
    fn qos_figure_draws_from_what_the_bench_writes() {
        let text = serde_json::to_string(&written()).unwrap();
        let doc: QosDoc = serde_json::from_str(&text).unwrap();
        assert_eq!(doc.report.rounds[1].tenants[0].state, "parked");
        assert!(serde_json::from_str::<QosDoc>(&text.replace("\"parked\"", "\"asleep\"")).is_err());
        super::super::register_font().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = qos(&doc, &dir.path().join("qos.png")).unwrap();
        assert!(std::fs::read(&f.path).unwrap().starts_with(b"\x89PNG"));
        assert!(f.caption.contains("2 tenants"));
    }
}
