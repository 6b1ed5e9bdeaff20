//! The precision-rung benchmark: which lower-precision copies of the largest rung are worth a
//! place on the ladder between it and the smaller model family.
//!
//! A precision route (same weights, other quantization) keeps the context's facts after a
//! switch; a size route loses many. So the ladder should offer precision rungs at the budgets
//! between the largest rung and the smaller family, if they pay: for each rung this program
//! measures, in one run so the figures sit side by side, what a candidate costs and what it
//! gives —
//!
//! - **size**: the file, and the footprint the policy compares with the budget
//!   ([`footprint::run`], the same code as `bench --footprint`, at one context length);
//! - **speed**: prefill and decode through Molt's engine ([`speed::measure`]), also as a ratio
//!   to the largest rung measured in the same run (absolute tok/s on a shared machine drift);
//! - **its own answers**: greedy answers to the conditions prompts, judged by the largest rung
//!   (perplexity, as the conditions benchmark's judge), and how many of their first tokens
//!   agree with the largest rung's own answer;
//! - **recall after a switch to it**, pooled from `bench --recall` files (rows of
//!   `tier0→<rung>`), so the recall runs — long on 2 cores — are made apart and only read here.
//!
//! Main items: [`PrecisionOptions`], [`run`] → [`PrecisionDoc`] (`results/precision_rungs.json`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::BenchError;
use super::conditions::PromptSpec;
use super::footprint::{self, FootprintOptions};
use super::metrics::{Judge, JudgeScore, common_prefix, pooled_perplexity};
use super::recall::RecallDoc;
use super::speed::{self, SpeedOptions};
use molt::engine::{ChatMessage, ContextConfig, Token, argmax};
use molt::ladder::{Ladder, Source};
use molt::routes::Variant;
use molt::session::LiveRung;

/// Settings of one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrecisionOptions {
    /// Rung names to measure (empty: every rung).
    pub rungs: Vec<String>,
    /// Prompts each rung answers (the conditions prompts).
    pub prompts: Vec<PromptSpec>,
    /// Greedy tokens per answer.
    pub answer_tokens: usize,
    /// Context length the footprint is read at.
    pub footprint_tokens: usize,
    /// Prompt tokens of the prefill measurement.
    pub prefill_tokens: usize,
    /// Tokens of the decode measurement.
    pub decode_tokens: usize,
    /// Threads.
    pub threads: u32,
    /// Recall files (`bench --recall` output) whose `tier0→<rung>` rows are pooled here.
    pub recall_files: Vec<PathBuf>,
}

/// Recall of one arm on the route from the largest rung to a candidate, pooled over one
/// recall file's rows (every context length and switch point: Σ recall × items / Σ items).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PooledRecall {
    /// The recall file.
    pub file: String,
    /// The arm.
    pub arm: String,
    /// Whether this arm is the session's default on this route.
    pub default: bool,
    /// Projector family the file's precision routes used (`auto`: the fitted diagonal maps;
    /// `identity`: the cache carried unchanged).
    pub variant: Variant,
    /// Answers pooled.
    pub items: usize,
    /// Answers that held every expected string.
    pub recalled: usize,
    /// `recalled / items`.
    pub recall: f64,
    /// The native destination's recall on the same items.
    pub destination_recall: f64,
    /// The share of the expected strings the answers hold (a summary's facts stated), mean
    /// over the items.
    #[serde(default)]
    pub facts: f64,
    /// The same for the native destination on the same items.
    #[serde(default)]
    pub destination_facts: f64,
    /// Median switch cost over the rows (ms; 0 for the natives).
    pub cost_ms: f64,
    /// Median re-prefill cost at the same points (ms).
    pub reprefill_ms: f64,
}

/// One rung's measurements.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RungPrecision {
    /// Rung name.
    pub rung: String,
    /// Model description from the manifest.
    pub model: String,
    /// llama.cpp's name of the file's type (`general.file_type`), e.g. `Q3_K - Medium`.
    pub file_type: String,
    /// The type it was requantized to, when the manifest builds it that way.
    pub requantized_to: Option<String>,
    /// File size.
    pub file_bytes: u64,
    /// What the policy assumes the rung costs with `footprint_tokens` of context.
    pub modelled_bytes: u64,
    /// The session's measured footprint (mapped weights resident + anonymous bytes at load).
    pub measured_bytes: u64,
    /// Process RSS above its level before the rung was loaded, at `footprint_tokens`.
    pub rss_delta_bytes: u64,
    /// Prefill tok/s through Molt's engine.
    pub prefill_tps: f64,
    /// Decode tok/s through Molt's engine.
    pub decode_tps: f64,
    /// `prefill_tps` over the largest rung's in this run.
    pub prefill_vs_largest: f64,
    /// `decode_tps` over the largest rung's in this run.
    pub decode_vs_largest: f64,
    /// The largest rung's perplexity of this rung's answers, pooled over the prompts.
    pub judge_ppl: Option<f64>,
    /// Answer tokens judged.
    pub judged_tokens: usize,
    /// Mean over prompts of the fraction of the answer's tokens, from the first, that are the
    /// largest rung's own greedy answer (1 for the largest rung itself).
    pub agreement: f64,
    /// The answers, in prompt order.
    pub answers: Vec<String>,
    /// Recall after a switch from the largest rung to this one, per recall file and arm.
    pub recall: Vec<PooledRecall>,
}

/// `results/precision_rungs.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrecisionDoc {
    /// The ladder manifest measured.
    pub ladder: String,
    /// The settings.
    pub options: PrecisionOptions,
    /// One entry per rung, largest first.
    pub rungs: Vec<RungPrecision>,
    /// Wall time of the run, s.
    pub seconds: f64,
    /// Machine facts.
    pub run: serde_json::Value,
}

/// Pools the `src→dst` rows of one recall file per arm.
#[must_use]
pub fn pool_recall(doc: &RecallDoc, file: &str, route: &str) -> Vec<PooledRecall> {
    let mut arms: Vec<&str> = Vec::new();
    for r in doc.rows.iter().filter(|r| r.route == route) {
        if !arms.contains(&r.arm.as_str()) {
            arms.push(&r.arm);
        }
    }
    arms.into_iter()
        .map(|arm| {
            let rows: Vec<_> = doc
                .rows
                .iter()
                .filter(|r| r.route == route && r.arm == arm)
                .collect();
            let items: usize = rows.iter().map(|r| r.items).sum();
            #[allow(clippy::cast_precision_loss)] // counts far below 2^52
            let weighted = |f: &dyn Fn(&&super::recall::RecallRow) -> f64| {
                if items == 0 {
                    0.0
                } else {
                    rows.iter().map(|r| f(r) * r.items as f64).sum::<f64>() / items as f64
                }
            };
            let recall = weighted(&|r| r.recall);
            let median = |f: &dyn Fn(&&super::recall::RecallRow) -> f64| {
                let mut v: Vec<f64> = rows.iter().map(f).collect();
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            };
            #[allow(
                clippy::cast_precision_loss,
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss
            )]
            let recalled = (recall * items as f64).round() as usize;
            PooledRecall {
                file: file.to_string(),
                arm: arm.to_string(),
                default: rows.iter().any(|r| r.default),
                variant: doc.options.precision_variant,
                items,
                recalled,
                recall,
                destination_recall: weighted(&|r| r.destination_recall),
                facts: weighted(&|r| r.facts),
                destination_facts: weighted(&|r| r.destination_facts),
                cost_ms: median(&|r| r.cost_ms.median),
                reprefill_ms: median(&|r| r.reprefill_ms.median),
            }
        })
        .collect()
}

fn read_recall_files(files: &[PathBuf]) -> Result<Vec<(String, RecallDoc)>, BenchError> {
    let mut out = Vec::new();
    for f in files {
        let bytes = std::fs::read(f).map_err(|source| BenchError::Io {
            path: f.clone(),
            source,
        })?;
        let doc: RecallDoc = serde_json::from_slice(&bytes).map_err(|e| BenchError::Json {
            path: f.clone(),
            message: e.to_string(),
        })?;
        out.push((f.display().to_string(), doc));
    }
    Ok(out)
}

/// Pools `files` into `doc` again (each rung's `recall`, and the options' file list): for a
/// recall run that finished after the precision run.
///
/// # Errors
/// [`BenchError::Io`] / [`BenchError::Json`] for a recall file that cannot be read.
pub fn repool(doc: &mut PrecisionDoc, files: &[PathBuf]) -> Result<(), BenchError> {
    let docs = read_recall_files(files)?;
    let largest = doc
        .rungs
        .first()
        .map(|r| r.rung.clone())
        .unwrap_or_default();
    for r in &mut doc.rungs {
        let route = format!("{largest}→{}", r.rung);
        r.recall = docs
            .iter()
            .flat_map(|(f, d)| pool_recall(d, f, &route))
            .collect();
    }
    doc.options.recall_files = files.to_vec();
    Ok(())
}

/// Greedy answer of `live` to `prompt` (chat template applied): the prompt's tokens and up to
/// `max` answer tokens.
fn answer(
    live: &mut LiveRung,
    prompt: &str,
    max: usize,
) -> Result<(Vec<Token>, Vec<Token>), BenchError> {
    let name = live.name().to_string();
    let wrap = |source| BenchError::Engine {
        rung: name.clone(),
        source,
    };
    let text = live
        .model()
        .apply_chat_template(&[ChatMessage::new("user", prompt)], true)
        .map_err(wrap)?;
    let prompt_ids = live.model().tokenize(&text, true).map_err(wrap)?;
    live.ctx.clear();
    live.ctx.decode(&prompt_ids).map_err(wrap)?;
    let mut out = Vec::new();
    while out.len() < max {
        let t = argmax(live.ctx.logits());
        if live.model().is_eog(t) {
            break;
        }
        out.push(t);
        if out.len() < max {
            live.ctx.decode(&[t]).map_err(wrap)?;
        }
    }
    Ok((prompt_ids, out))
}

/// Measures every chosen rung of `ladder` (see the module docs).
///
/// # Errors
/// [`BenchError::Config`] for an unknown rung name or a recall file that does not parse; the
/// session, engine and judge errors of the parts otherwise.
#[allow(clippy::too_many_lines)]
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    opts: &PrecisionOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<PrecisionDoc, BenchError> {
    let t0 = std::time::Instant::now();
    for n in &opts.rungs {
        if !ladder.rungs.iter().any(|r| r.name() == n) {
            return Err(BenchError::Config(format!(
                "--precision-rungs names {n:?}, which is not a rung of this ladder (rungs: {})",
                ladder
                    .rungs
                    .iter()
                    .map(molt::ladder::RungInfo::name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let chosen: Vec<usize> = (0..ladder.rungs.len())
        .filter(|&i| {
            i == 0
                || opts.rungs.is_empty()
                || opts.rungs.iter().any(|n| n == ladder.rungs[i].name())
        })
        .collect();
    let recall_docs = read_recall_files(&opts.recall_files)?;

    // Footprint: the same code as `bench --footprint`, at one length, on a ladder of the
    // chosen rungs only.
    let mut sub = ladder.clone();
    sub.rungs = chosen.iter().map(|&i| ladder.rungs[i].clone()).collect();
    for (i, r) in sub.rungs.iter_mut().enumerate() {
        r.index = i;
    }
    let text = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns. "
        .repeat(64);
    let tokens = {
        let live = LiveRung::load(&ladder.rungs[0], config)?;
        live.model()
            .tokenize(&text, false)
            .map_err(|source| BenchError::Engine {
                rung: ladder.rungs[0].name().to_string(),
                source,
            })?
    };
    let fp = footprint::run(
        &sub,
        config,
        &tokens,
        &FootprintOptions {
            lengths: vec![opts.footprint_tokens],
        },
        progress,
    )?;

    let mut rows = Vec::new();
    let mut answers_ids: Vec<Vec<(Vec<Token>, Vec<Token>)>> = Vec::new();
    for (k, &i) in chosen.iter().enumerate() {
        let info = &ladder.rungs[i];
        progress(&format!("precision: {} speed ...", info.name()));
        let sp = speed::measure(
            info,
            &SpeedOptions {
                prefill_tokens: opts.prefill_tokens,
                decode_tokens: opts.decode_tokens,
                reps: 1,
                threads: opts.threads,
            },
        )
        .map_err(BenchError::Config)?;
        progress(&format!(
            "precision: {} answers {} prompts ...",
            info.name(),
            opts.prompts.len()
        ));
        let mut live = LiveRung::load(info, config)?;
        let mut mine = Vec::new();
        for p in &opts.prompts {
            mine.push(answer(&mut live, &p.prompt, opts.answer_tokens)?);
        }
        drop(live);
        let point = fp[k].points.first();
        let file_type = info.facts.file_type_name().unwrap_or("unknown").to_string();
        let requantized_to = match &info.spec.source {
            Source::Requantize { qtype, .. } => Some(qtype.name().to_string()),
            _ => None,
        };
        rows.push(RungPrecision {
            rung: info.name().to_string(),
            model: info.spec.model.clone(),
            file_type,
            requantized_to,
            file_bytes: info.file_bytes,
            modelled_bytes: point.map_or(0, |p| p.modelled_bytes),
            measured_bytes: point.map_or(0, |p| p.measured_bytes),
            rss_delta_bytes: point.map_or(0, |p| p.rss_delta_bytes),
            prefill_tps: sp.molt_prefill_tps.median,
            decode_tps: sp.molt_decode_tps.median,
            prefill_vs_largest: 0.0,
            decode_vs_largest: 0.0,
            judge_ppl: None,
            judged_tokens: 0,
            agreement: 0.0,
            answers: Vec::new(),
            recall: recall_docs
                .iter()
                .flat_map(|(f, d)| {
                    pool_recall(d, f, &format!("{}→{}", ladder.rungs[0].name(), info.name()))
                })
                .collect(),
        });
        answers_ids.push(mine);
    }

    progress("precision: judging every answer on the largest rung ...");
    let mut judge = Judge::new(&ladder.rungs[0], config)?;
    let (p0, d0) = (rows[0].prefill_tps, rows[0].decode_tps);
    let largest: Vec<Vec<Token>> = answers_ids[0].iter().map(|(_, a)| a.clone()).collect();
    for (row, mine) in rows.iter_mut().zip(&answers_ids) {
        let mut scores: Vec<JudgeScore> = Vec::new();
        let mut agree = Vec::new();
        for ((prompt_ids, ans), reference) in mine.iter().zip(&largest) {
            if !ans.is_empty() {
                let mut full = prompt_ids.clone();
                full.extend_from_slice(ans);
                scores.push(judge.score(&full, prompt_ids.len())?);
            }
            #[allow(clippy::cast_precision_loss)]
            agree.push(if ans.is_empty() {
                0.0
            } else {
                common_prefix(ans, reference) as f64 / ans.len() as f64
            });
            row.answers.push(judge.model().detokenize(ans));
        }
        row.judge_ppl = pooled_perplexity(&scores);
        row.judged_tokens = scores.iter().map(|s| s.tokens).sum();
        #[allow(clippy::cast_precision_loss)]
        {
            row.agreement = agree.iter().sum::<f64>() / agree.len().max(1) as f64;
        }
        row.prefill_vs_largest = row.prefill_tps / p0.max(1e-9);
        row.decode_vs_largest = row.decode_tps / d0.max(1e-9);
    }
    Ok(PrecisionDoc {
        ladder: ladder.name().to_string(),
        options: opts.clone(),
        rungs: rows,
        seconds: t0.elapsed().as_secs_f64(),
        run: serde_json::to_value(super::RunInfo::now()).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recall::{RecallOptions, RecallRow, Spread, SwitchPoint};

    fn row(arm: &str, route: &str, items: usize, recall: f64, cost: f64) -> RecallRow {
        RecallRow {
            arm: arm.into(),
            default: arm == "head4",
            route: route.into(),
            route_kind: "precision".into(),
            context_kind: "notes".into(),
            context_tokens: 256,
            measured_tokens: 260,
            switch_at: SwitchPoint::First,
            items,
            recall,
            destination_recall: 1.0,
            reprefill_recall: 0.0,
            facts: recall,
            destination_facts: 1.0,
            cost_ms: Spread {
                median: cost,
                min: cost,
                max: cost,
            },
            reprefill_ms: Spread::default(),
            recomputed: 0.0,
            refill_ms: None,
        }
    }

    #[test]
    fn pools_only_the_route_asked_for_weighted_by_items() {
        let doc = RecallDoc {
            items_file: "x".into(),
            n_items: 6,
            problems: vec![],
            options: RecallOptions {
                routes: vec![],
                size_arms: vec![],
                precision_arms: vec![],
                max_tokens_first: 40,
                max_tokens_mid: 80,
                mid_switch_at: 12,
                precision_every: 1,
                precision_variant: Variant::Identity,
                partial: None,
                answered: Default::default(),
            },
            rows: vec![
                row("head4", "tier0→q3km", 4, 1.0, 100.0),
                row("head4", "tier0→q3km", 2, 0.5, 300.0),
                row("head4", "tier0→tier2", 6, 0.0, 50.0),
                row("native-destination", "tier0→q3km", 6, 1.0, 0.0),
            ],
            answers: vec![],
            seconds: 0.0,
            run: serde_json::Value::Null,
        };
        let p = pool_recall(&doc, "f.json", "tier0→q3km");
        assert_eq!(p.len(), 2);
        let h = &p[0];
        assert_eq!((h.arm.as_str(), h.items, h.recalled), ("head4", 6, 5));
        assert!((h.recall - 5.0 / 6.0).abs() < 1e-9, "{}", h.recall);
        assert!(h.default);
        assert_eq!(h.variant, Variant::Identity);
        assert!(
            (h.cost_ms - 300.0).abs() < 1e-9,
            "median of 100 and 300 by the upper rule"
        );
        assert!(pool_recall(&doc, "f.json", "tier0→nothing").is_empty());
    }
}
