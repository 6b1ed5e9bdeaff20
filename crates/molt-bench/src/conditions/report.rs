//! The report's schema: every type the benchmark writes, and nothing that computes.
//! `conditions.json` is a [`ConditionsReport`] (its [`Settings`], one [`Cell`] per arm and
//! prompt holding the [`TimedRun`]s, the [`QualityRun`]'s [`SeamRecord`]s and the judge's
//! [`ContinuationQuality`], then the [`ArmSummary`] rows and the [`TimingComparison`] /
//! [`PairedComparison`] lists); `conditions_events.jsonl` holds one [`RunLog`] per line (every
//! event and a [`TokenRow`] per token); `token_series.json` is a [`TokenSeries`].
//!
//! Every type derives `Deserialize` beside `Serialize`, so the readers (figures, the results
//! page, tests) parse the writer's own types rather than copies of them that could drift.
//! Fields added later carry `#[serde(default)]`, so results written before them still read.

use serde::{Deserialize, Serialize};

use super::arms::{ArmSpec, PromptSpec};
use crate::metrics::{JudgeScore, Noise};
use crate::speed::Rate;
use molt::engine::Token;
use molt::pressure::Trace;
use molt::routes::RouteKind;
use molt::sched::RungCost;
use molt::session::{Event, StopReason, SwitchInfo};

/// Which pass a run belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// Clean timing repetition.
    Timing,
    /// Seam measurement (taps, preloaded rungs, kept source); its timings are not reported.
    Quality,
}

/// One generated token as the hero figure draws it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenRow {
    /// Index in the answer.
    pub index: usize,
    /// Time since the previous token (since the prompt was submitted, for the first), ms.
    pub latency_ms: f64,
    /// Weight-loading time included in this latency (the first token after a switch that had
    /// to map the destination), ms.
    pub load_ms: f64,
    /// Rung that produced it.
    pub rung: String,
    /// Budget in force, bytes.
    pub budget_bytes: u64,
    /// Budget pressure, 0..1.
    pub pressure: f64,
    /// Resident footprint after the token (process RSS above the run's starting RSS), bytes.
    pub footprint_bytes: u64,
}

/// Everything one run emitted: its events and the per-token rows. Written one per line to
/// `conditions_events.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunLog {
    /// Arm id.
    pub arm: String,
    /// Prompt id.
    pub prompt: String,
    /// Pass.
    pub pass: Pass,
    /// Repetition (1-based; 0 for the quality pass).
    pub rep: usize,
    /// Every event the session emitted, in order.
    pub events: Vec<Event>,
    /// One row per generated token.
    pub rows: Vec<TokenRow>,
}

/// The measured outcome of one timing run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TimedRun {
    /// Repetition (1-based).
    pub rep: usize,
    /// The answer was lost (condition A when the budget falls below its rung).
    pub killed: bool,
    /// Why it ended.
    pub stop: StopReason,
    /// Tokens streamed before the end (or the kill).
    pub tokens_streamed: usize,
    /// Tokens of answers that survived (0 when killed).
    pub tokens_delivered: usize,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Rungs in order of use.
    pub rungs_used: Vec<String>,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Whole answer (until the kill, if killed), ms.
    pub total_ms: f64,
    /// Largest inter-token latency (tokens after the first), ms.
    pub max_stall_ms: f64,
    /// The same with the destination's weight-loading time taken out, ms.
    pub max_stall_excl_load_ms: f64,
    /// Summed switch cost (decision to first logits, loading excluded), ms.
    pub switch_cost_ms: f64,
    /// Summed destination loading time, ms.
    pub load_ms: f64,
    /// Every switch.
    pub switches: Vec<SwitchInfo>,
    /// Largest footprint sampled after a token, bytes.
    pub peak_footprint_bytes: u64,
    /// Largest `footprint − budget` sampled after a token (after enforcement), bytes.
    pub max_overshoot_bytes: Option<i64>,
    /// Largest `footprint − budget` at the moment the budget fell (before enforcement), bytes.
    pub drop_overshoot_bytes: Option<i64>,
    /// Generated token ids (empty in later repetitions that repeated the first exactly).
    pub token_ids: Vec<Token>,
    /// The answer text (empty in later repetitions that repeated the first exactly).
    pub text: String,
    /// Prompt token ids (kept in memory for the judge; not written).
    #[serde(skip)]
    pub prompt_ids: Vec<Token>,
}

/// One switch as the quality pass saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeamRecord {
    /// Generated-token index of the switch.
    pub at_token: usize,
    /// Source rung.
    pub from: String,
    /// Destination rung.
    pub to: String,
    /// Route kind.
    pub kind: RouteKind,
    /// JSD (nats) of the destination's first distribution against the source's own.
    pub handoff_jsd: Option<f64>,
    /// The same JSD for the destination with a native cache of the same history, at this
    /// very switch (a re-prefill's: the floor `handoff_jsd` is compared with, pairwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_floor_jsd: Option<f64>,
    /// Mean attention entropy (nats) of the destination's first decode after the switch.
    pub entropy_migrated: Option<f64>,
    /// The same on a cache the destination built itself from the same tokens.
    pub entropy_native: Option<f64>,
    /// `entropy_migrated / entropy_native` (> 1: flatter than native attention).
    pub flatness: Option<f64>,
}

/// The quality pass of one arm on one prompt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QualityRun {
    /// One per switch.
    pub seams: Vec<SeamRecord>,
    /// The quality pass generated the same tokens as the first timing repetition (over the
    /// tokens both produced).
    pub tokens_match_timing: bool,
}

/// The judge's view of one continuation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContinuationQuality {
    /// First judged generated-token index (the first switch, or the trace's first step for an
    /// arm that does not switch).
    pub judged_from: usize,
    /// Summed NLL and count.
    pub judge: JudgeScore,
    /// Judge perplexity.
    pub judge_ppl: f64,
    /// Repeated-4-gram fraction of the judged continuation.
    pub repetition_after: Option<f64>,
    /// Repeated-4-gram fraction of the whole answer.
    pub repetition_all: Option<f64>,
}

/// One arm on one prompt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    /// Arm id.
    pub arm: String,
    /// Prompt id.
    pub prompt: String,
    /// Timing repetitions.
    pub timed: Vec<TimedRun>,
    /// Every repetition produced the same tokens.
    pub tokens_identical_across_reps: bool,
    /// The quality pass (arms that switch).
    pub quality: Option<QualityRun>,
    /// The judge (answers that survived past the first step).
    pub continuation: Option<ContinuationQuality>,
}

/// One arm, every prompt and repetition folded into the table's columns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArmSummary {
    /// Arm id.
    pub arm: String,
    /// Label.
    pub label: String,
    /// What the ablation removes.
    pub removes: String,
    /// False for an unbuilt slot (every other field empty).
    pub built: bool,
    /// Prompts run.
    pub prompts: usize,
    /// Answers lost (first repetition).
    pub killed: usize,
    /// Mean tokens streamed per answer.
    pub tokens_streamed: f64,
    /// Mean tokens delivered per answer (killed answers deliver 0).
    pub tokens_delivered: f64,
    /// Per-repetition means over prompts, ms.
    pub ttft_ms: Option<Rate>,
    /// Total time.
    pub total_ms: Option<Rate>,
    /// Max stall (mean over prompts of each answer's largest inter-token latency).
    pub max_stall_ms: Option<Rate>,
    /// Max stall with loading excluded.
    pub max_stall_excl_load_ms: Option<Rate>,
    /// Worst stall of any answer, any repetition, ms.
    pub worst_stall_ms: Option<f64>,
    /// Switch cost per answer (summed over its switches).
    pub switch_cost_ms: Option<Rate>,
    /// Loading per answer.
    pub load_ms: Option<Rate>,
    /// Mean switches per answer.
    pub switches_per_answer: f64,
    /// Switches of a Molt arm that did not transplant (e.g. a re-prefill fallback for a missing
    /// projector), over every run; a non-zero count makes the arm's seam numbers suspect.
    #[serde(default)]
    pub fallback_switches: usize,
    /// Mean fraction of re-prefill FLOPs avoided per switch.
    pub flops_avoided: Option<f64>,
    /// Mean handoff JSD on precision-route switches.
    pub handoff_jsd_precision: Option<f64>,
    /// Mean handoff JSD on size-route switches.
    pub handoff_jsd_size: Option<f64>,
    /// Mean re-prefill floor of the same precision-route switches (each read at the switch
    /// itself on a native cache of the same history).
    #[serde(default)]
    pub handoff_floor_precision: Option<f64>,
    /// Mean re-prefill floor of the same size-route switches.
    #[serde(default)]
    pub handoff_floor_size: Option<f64>,
    /// Paired seam ratio on the size route: mean handoff JSD / mean floor over the switches
    /// where both were read (the "at most 2× the re-prefill floor", like for like).
    #[serde(default)]
    pub seam_ratio_size: Option<f64>,
    /// The same on the precision route.
    #[serde(default)]
    pub seam_ratio_precision: Option<f64>,
    /// Mean attention flatness on precision-route switches.
    pub flatness_precision: Option<f64>,
    /// Mean attention flatness on size-route switches.
    pub flatness_size: Option<f64>,
    /// Judge perplexity pooled over prompts.
    pub judge_ppl: Option<f64>,
    /// Mean repeated-4-gram fraction of the judged continuations.
    pub repetition: Option<f64>,
    /// Largest footprint of any run, bytes.
    pub peak_footprint_bytes: Option<u64>,
    /// Largest after-enforcement overshoot of any surviving run, bytes.
    pub max_overshoot_bytes: Option<i64>,
    /// Largest overshoot at a budget drop, before enforcement, bytes.
    pub drop_overshoot_bytes: Option<i64>,
}

/// A timing difference and whether it is inside the repetitions' noise.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TimingComparison {
    /// Metric name.
    pub metric: String,
    /// First arm.
    pub a: String,
    /// Second arm.
    pub b: String,
    /// Medians.
    pub a_median: f64,
    /// Medians.
    pub b_median: f64,
    /// Ratio and overlap.
    pub noise: Noise,
}

/// A per-prompt paired comparison of a quality metric (higher is worse for all of them).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PairedComparison {
    /// Metric name.
    pub metric: String,
    /// The arm compared.
    pub a: String,
    /// The reference arm.
    pub b: String,
    /// Mean of `a` over the paired prompts.
    pub a_mean: f64,
    /// Mean of `b` over the paired prompts.
    pub b_mean: f64,
    /// Prompts where `a` is worse (higher) by more than 1 %.
    pub a_worse: usize,
    /// Prompts where `a` is better (lower) by more than 1 %.
    pub a_better: usize,
    /// Prompts within 1 %.
    pub ties: usize,
}

/// The run's settings, as recorded beside its results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// Tokens per answer.
    pub max_tokens: usize,
    /// Timing repetitions.
    pub reps: usize,
    /// Whether the quality pass ran.
    pub quality_pass: bool,
    /// Generated-token indices of the trace's steps.
    pub steps: Vec<usize>,
    /// Context window.
    pub n_ctx: u32,
    /// Threads.
    pub threads: u32,
    /// KV cache type.
    pub cache_type: String,
    /// Judge rung.
    pub judge: String,
    /// Context length the trace was sized for.
    pub trace_ctx_tokens: u64,
}

/// Everything the conditions benchmark measured (without the event logs).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConditionsReport {
    /// Machine and build.
    pub run: serde_json::Value,
    /// Ladder name.
    pub ladder: String,
    /// Rung names, largest first.
    pub rungs: Vec<String>,
    /// Settings.
    pub settings: Settings,
    /// The trace every arm replayed.
    pub trace: Trace,
    /// The rung costs the policy used when the trace was built.
    pub rung_costs: Vec<RungCost>,
    /// Arms, in table order.
    pub arms: Vec<ArmSpec>,
    /// Prompts.
    pub prompts: Vec<PromptSpec>,
    /// One per arm and prompt.
    pub cells: Vec<Cell>,
    /// One per arm.
    pub summary: Vec<ArmSummary>,
    /// Timing differences against their noise.
    pub timing: Vec<TimingComparison>,
    /// Quality differences, prompt by prompt.
    pub paired: Vec<PairedComparison>,
    /// The run drawn as the token series: `(arm, prompt, rep)`.
    pub representative: Option<(String, String, usize)>,
    /// Wall time of the whole benchmark, s.
    pub elapsed_s: f64,
}

/// The token series file: one row per generated token of the representative run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenSeries {
    /// Arm id.
    pub arm: String,
    /// Prompt id.
    pub prompt: String,
    /// Repetition.
    pub rep: usize,
    /// The trace replayed.
    pub trace: Trace,
    /// Rung names, largest first.
    pub rungs: Vec<String>,
    /// The switches of the run.
    pub switches: Vec<SwitchInfo>,
    /// One per token.
    pub rows: Vec<TokenRow>,
}
