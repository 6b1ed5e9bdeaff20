//! From cells to the table, and the table to disk: [`summarize`] folds every arm's cells into
//! one [`ArmSummary`] (timings as median and spread over the repetitions' per-prompt means,
//! seam and judge measures as means over switches and prompts), [`timing_comparisons`] sets
//! timing differences against their noise, [`paired_comparisons`] compares every other arm
//! with D prompt by prompt, [`representative`] picks the run the token series draws, and
//! [`write_outputs`] writes the three result files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::arms::ArmSpec;
use super::report::{
    ArmSummary, Cell, ConditionsReport, ContinuationQuality, PairedComparison, Pass, RunLog,
    SeamRecord, TimedRun, TimingComparison, TokenSeries,
};
use crate::BenchError;
use crate::metrics::{JudgeScore, Noise, pooled_perplexity};
use crate::speed::Rate;
use molt::routes::RouteKind;
use molt::session::{Event, Strategy, SwitchInfo};

fn mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (s, n) = v
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    #[allow(clippy::cast_precision_loss)]
    (n > 0).then(|| s / n as f64)
}

/// Per repetition, the mean over prompts of `f` (runs where `f` is `None` skipped).
fn rate_over_reps(
    cells: &[&Cell],
    reps: usize,
    f: impl Fn(&TimedRun) -> Option<f64>,
) -> Option<Rate> {
    let samples: Vec<f64> = (1..=reps)
        .filter_map(|rep| {
            mean(
                cells
                    .iter()
                    .flat_map(|c| c.timed.iter().filter(|t| t.rep == rep))
                    .filter_map(&f),
            )
        })
        .collect();
    (!samples.is_empty()).then(|| Rate::from(samples))
}

pub(super) fn summarize(arms: &[ArmSpec], cells: &[Cell], reps: usize) -> Vec<ArmSummary> {
    arms.iter()
        .map(|arm| {
            let mine: Vec<&Cell> = cells.iter().filter(|c| c.arm == arm.id).collect();
            let firsts: Vec<&TimedRun> = mine.iter().map(|c| &c.timed[0]).collect();
            let all_runs = || mine.iter().flat_map(|c| c.timed.iter());
            let seams = |kind: RouteKind| {
                mine.iter()
                    .filter_map(|c| c.quality.as_ref())
                    .flat_map(|q| q.seams.iter())
                    .filter(move |s| s.kind == kind)
            };
            let conts: Vec<&ContinuationQuality> = mine
                .iter()
                .filter_map(|c| c.continuation.as_ref())
                .collect();
            let scores: Vec<JudgeScore> = conts.iter().map(|c| c.judge).collect();
            let switched = |t: &TimedRun| !t.switches.is_empty();
            #[allow(clippy::cast_precision_loss)]
            let n_first = firsts.len().max(1) as f64;
            ArmSummary {
                arm: arm.id.clone(),
                label: arm.label.clone(),
                removes: arm.removes.clone(),
                built: arm.built,
                prompts: mine.len(),
                killed: firsts.iter().filter(|t| t.killed).count(),
                #[allow(clippy::cast_precision_loss)]
                tokens_streamed: firsts.iter().map(|t| t.tokens_streamed as f64).sum::<f64>()
                    / n_first,
                #[allow(clippy::cast_precision_loss)]
                tokens_delivered: firsts
                    .iter()
                    .map(|t| t.tokens_delivered as f64)
                    .sum::<f64>()
                    / n_first,
                ttft_ms: rate_over_reps(&mine, reps, |t| Some(t.ttft_ms)),
                total_ms: rate_over_reps(&mine, reps, |t| Some(t.total_ms)),
                max_stall_ms: rate_over_reps(&mine, reps, |t| Some(t.max_stall_ms)),
                max_stall_excl_load_ms: rate_over_reps(&mine, reps, |t| {
                    Some(t.max_stall_excl_load_ms)
                }),
                worst_stall_ms: all_runs().map(|t| t.max_stall_ms).reduce(f64::max),
                switch_cost_ms: rate_over_reps(&mine, reps, |t| {
                    switched(t).then_some(t.switch_cost_ms)
                }),
                load_ms: rate_over_reps(&mine, reps, |t| switched(t).then_some(t.load_ms)),
                #[allow(clippy::cast_precision_loss)]
                switches_per_answer: firsts.iter().map(|t| t.switches.len() as f64).sum::<f64>()
                    / n_first,
                fallback_switches: if arm.strategy == Strategy::Molt {
                    all_runs()
                        .flat_map(|t| t.switches.iter())
                        .filter(|s| s.method != "molt")
                        .count()
                } else {
                    0
                },
                flops_avoided: mean(
                    firsts
                        .iter()
                        .flat_map(|t| t.switches.iter())
                        .map(SwitchInfo::flops_avoided),
                ),
                handoff_jsd_precision: mean(
                    seams(RouteKind::Precision).filter_map(|s| s.handoff_jsd),
                ),
                handoff_jsd_size: mean(seams(RouteKind::Size).filter_map(|s| s.handoff_jsd)),
                handoff_floor_precision: mean(
                    seams(RouteKind::Precision).filter_map(|s| s.handoff_floor_jsd),
                ),
                handoff_floor_size: mean(
                    seams(RouteKind::Size).filter_map(|s| s.handoff_floor_jsd),
                ),
                seam_ratio_size: paired_ratio(seams(RouteKind::Size)),
                seam_ratio_precision: paired_ratio(seams(RouteKind::Precision)),
                flatness_precision: mean(seams(RouteKind::Precision).filter_map(|s| s.flatness)),
                flatness_size: mean(seams(RouteKind::Size).filter_map(|s| s.flatness)),
                judge_ppl: pooled_perplexity(&scores),
                repetition: mean(conts.iter().filter_map(|c| c.repetition_after)),
                peak_footprint_bytes: all_runs().map(|t| t.peak_footprint_bytes).max(),
                max_overshoot_bytes: all_runs().filter_map(|t| t.max_overshoot_bytes).max(),
                drop_overshoot_bytes: all_runs().filter_map(|t| t.drop_overshoot_bytes).max(),
            }
        })
        .collect()
}

pub(super) fn timing_comparisons(summary: &[ArmSummary]) -> Vec<TimingComparison> {
    let get = |id: &str| summary.iter().find(|s| s.arm == id && s.built);
    let mut out = Vec::new();
    let mut push = |metric: &str, a: &ArmSummary, b: &ArmSummary| {
        let pick = |s: &ArmSummary| match metric {
            "switch_cost_ms" => s.switch_cost_ms.clone(),
            "max_stall_ms" => s.max_stall_ms.clone(),
            "max_stall_excl_load_ms" => s.max_stall_excl_load_ms.clone(),
            "total_ms" => s.total_ms.clone(),
            "ttft_ms" => s.ttft_ms.clone(),
            _ => None,
        };
        if let (Some(x), Some(y)) = (pick(a), pick(b)) {
            out.push(TimingComparison {
                metric: metric.into(),
                a: a.arm.clone(),
                b: b.arm.clone(),
                a_median: x.median,
                b_median: y.median,
                noise: Noise::between(&x, &y),
            });
        }
    };
    let Some(d) = get("D") else {
        return out;
    };
    if let Some(c) = get("C") {
        for m in [
            "switch_cost_ms",
            "max_stall_ms",
            "max_stall_excl_load_ms",
            "total_ms",
        ] {
            push(m, c, d);
        }
    }
    if let Some(b) = get("B") {
        push("total_ms", b, d);
    }
    for s in summary
        .iter()
        .filter(|s| s.built && s.arm.starts_with("D-"))
    {
        for m in ["switch_cost_ms", "total_ms"] {
            push(m, s, d);
        }
    }
    out
}

/// Mean handoff JSD over mean floor, over the seams where both were read (`None` without any,
/// or with a zero floor).
fn paired_ratio<'a>(seams: impl Iterator<Item = &'a SeamRecord>) -> Option<f64> {
    let pairs: Vec<(f64, f64)> = seams
        .filter_map(|s| s.handoff_jsd.zip(s.handoff_floor_jsd))
        .collect();
    let (j, f) = pairs
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    (!pairs.is_empty() && f > 0.0).then(|| j / f)
}

fn per_prompt(cells: &[Cell], arm: &str, metric: &str) -> HashMap<String, f64> {
    cells
        .iter()
        .filter(|c| c.arm == arm)
        .filter_map(|c| {
            let seam = |kind: RouteKind, f: fn(&SeamRecord) -> Option<f64>| {
                c.quality
                    .as_ref()
                    .and_then(|q| q.seams.iter().find(|s| s.kind == kind))
                    .and_then(f)
            };
            let v = match metric {
                "judge_ppl" => c.continuation.as_ref().map(|q| q.judge_ppl),
                "repetition" => c.continuation.as_ref().and_then(|q| q.repetition_after),
                "handoff_jsd_precision" => seam(RouteKind::Precision, |s| s.handoff_jsd),
                "handoff_jsd_size" => seam(RouteKind::Size, |s| s.handoff_jsd),
                "flatness_precision" => seam(RouteKind::Precision, |s| s.flatness),
                "flatness_size" => seam(RouteKind::Size, |s| s.flatness),
                _ => None,
            };
            v.filter(|x| x.is_finite()).map(|v| (c.prompt.clone(), v))
        })
        .collect()
}

/// The quality metrics compared prompt by prompt.
pub const PAIRED_METRICS: [&str; 6] = [
    "judge_ppl",
    "repetition",
    "handoff_jsd_precision",
    "handoff_jsd_size",
    "flatness_precision",
    "flatness_size",
];

/// Every option or ablation arm against D, prompt by prompt, on [`PAIRED_METRICS`]. A
/// prompt counts as worse (better) when the arm's value exceeds (falls below) D's by more than
/// 1% — except attention flatness, which is best at 1 (the destination's own attention), where
/// the distance `|ln flatness|` is compared, by more than 0.01.
pub(crate) fn paired_comparisons(arms: &[ArmSpec], cells: &[Cell]) -> Vec<PairedComparison> {
    let mut out = Vec::new();
    let others = arms
        .iter()
        .filter(|a| a.built && a.id != "D" && a.id != "A");
    for arm in others {
        for metric in PAIRED_METRICS {
            let a = per_prompt(cells, &arm.id, metric);
            let b = per_prompt(cells, "D", metric);
            let pairs: Vec<(f64, f64)> = a
                .iter()
                .filter_map(|(p, &x)| b.get(p).map(|&y| (x, y)))
                .collect();
            if pairs.is_empty() {
                continue;
            }
            let flat = metric.starts_with("flatness");
            let rel = |x: f64, y: f64| {
                if flat {
                    x.ln().abs() - y.ln().abs()
                } else {
                    (x - y) / y.abs().max(1e-12)
                }
            };
            out.push(PairedComparison {
                metric: metric.into(),
                a: arm.id.clone(),
                b: "D".into(),
                a_mean: mean(pairs.iter().map(|p| p.0)).unwrap_or(f64::NAN),
                b_mean: mean(pairs.iter().map(|p| p.1)).unwrap_or(f64::NAN),
                a_worse: pairs.iter().filter(|(x, y)| rel(*x, *y) > 0.01).count(),
                a_better: pairs.iter().filter(|(x, y)| rel(*x, *y) < -0.01).count(),
                ties: pairs
                    .iter()
                    .filter(|(x, y)| rel(*x, *y).abs() <= 0.01)
                    .count(),
            });
        }
    }
    out
}

/// The D run of the first repetition whose total time is the median of D's.
pub(super) fn representative(cells: &[Cell]) -> Option<(String, String, usize)> {
    let mut d: Vec<(&Cell, f64)> = cells
        .iter()
        .filter(|c| c.arm == "D")
        .filter_map(|c| {
            c.timed
                .first()
                .filter(|t| !t.switches.is_empty())
                .map(|t| (c, t.total_ms))
        })
        .collect();
    d.sort_by(|a, b| a.1.total_cmp(&b.1));
    d.get(d.len() / 2)
        .map(|(c, _)| (c.arm.clone(), c.prompt.clone(), c.timed[0].rep))
}

/// Writes `conditions.json` (everything but the event logs), `conditions_events.jsonl` (one
/// run per line) and `token_series.json` under `dir`; returns the paths written.
///
/// # Errors
/// [`BenchError::Io`] when a file cannot be written.
pub fn write_outputs(
    report: &ConditionsReport,
    logs: &[RunLog],
    dir: &Path,
) -> Result<Vec<PathBuf>, BenchError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BenchError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut written = Vec::new();
    let path = dir.join("conditions.json");
    let json =
        serde_json::to_string_pretty(report).map_err(|e| BenchError::Config(e.to_string()))?;
    std::fs::write(&path, json).map_err(io(&path))?;
    written.push(path);
    let path = dir.join("conditions_events.jsonl");
    let mut text = String::new();
    for l in logs {
        text.push_str(&serde_json::to_string(l).map_err(|e| BenchError::Config(e.to_string()))?);
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(io(&path))?;
    written.push(path);
    if let Some((arm, prompt, rep)) = &report.representative
        && let Some(log) = logs.iter().find(|l| {
            &l.arm == arm && &l.prompt == prompt && l.rep == *rep && l.pass == Pass::Timing
        })
    {
        let switches = log
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Switch(s) => Some(s.clone()),
                _ => None,
            })
            .collect();
        let series = TokenSeries {
            arm: arm.clone(),
            prompt: prompt.clone(),
            rep: *rep,
            trace: report.trace.clone(),
            rungs: report.rungs.clone(),
            switches,
            rows: log.rows.clone(),
        };
        let path = dir.join("token_series.json");
        let json =
            serde_json::to_string_pretty(&series).map_err(|e| BenchError::Config(e.to_string()))?;
        std::fs::write(&path, json).map_err(io(&path))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use molt::session::StopReason;

    #[test]
    fn representative_is_the_median_d_run() {
        let mk = |prompt: &str, total: f64| Cell {
            arm: "D".into(),
            prompt: prompt.into(),
            timed: vec![TimedRun {
                rep: 1,
                killed: false,
                stop: StopReason::Length,
                tokens_streamed: 1,
                tokens_delivered: 1,
                prompt_tokens: 1,
                rungs_used: vec![],
                ttft_ms: 0.0,
                total_ms: total,
                max_stall_ms: 0.0,
                max_stall_excl_load_ms: 0.0,
                switch_cost_ms: 0.0,
                load_ms: 0.0,
                // Built from JSON so that fields added to SwitchInfo later (with serde
                // defaults) do not break this test.
                switches: vec![
                    serde_json::from_value(serde_json::json!({
                        "at_token": 1, "from": "a", "to": "b", "method": "molt",
                        "cost_ms": 1.0, "load_ms": 0.0, "export_ms": 0.0, "project_ms": 0.0,
                        "import_ms": 0.0, "first_decode_ms": 0.0, "cells": 1, "flops": 1.0,
                        "flops_reprefill": 2.0, "pressure": 0.5, "budget_bytes": 1
                    }))
                    .unwrap(),
                ],
                peak_footprint_bytes: 0,
                max_overshoot_bytes: None,
                drop_overshoot_bytes: None,
                token_ids: vec![],
                text: String::new(),
                prompt_ids: vec![],
            }],
            tokens_identical_across_reps: true,
            quality: None,
            continuation: None,
        };
        let cells = vec![mk("p1", 30.0), mk("p2", 10.0), mk("p3", 20.0)];
        assert_eq!(representative(&cells).unwrap().1, "p3");
    }
}
