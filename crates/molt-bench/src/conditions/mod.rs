//! The conditions benchmark: the same prompts under the same memory-pressure trace, once per
//! arm — A always-large, B always-small, C restart-on-pressure, D Molt, and ablations of D
//! that each remove one mechanism — with every event logged and every metric of the design
//! computed from what the runs did.
//!
//! # How a run is organised, and why
//!
//! 1. **Timing passes** (`reps` of them, arms interleaved within each prompt so drift hits all
//!    arms alike): plain sessions, nothing measured inside the token loop but a `/proc` read
//!    per token (resident footprint). These give TTFT, total time, max stall, switch cost,
//!    footprint and overshoot, as median and spread over repetitions.
//! 2. **A quality pass** for the arms that switch, up to one token past the last step of the
//!    trace: every rung preloaded with an attention tap armed, the source kept, the seam
//!    measured. It perturbs timings (preloading, the extra source decode), which is why it is a
//!    separate pass and none of its times are reported. It gives handoff JSD and attention
//!    flatness per switch; the native reference entropy comes from the destination rung
//!    decoding the same tokens on a cache it built itself.
//! 3. **The judge**: the largest rung scores the continuation after the first switch of the
//!    first timing repetition (greedy decoding makes every repetition produce the same
//!    tokens — checked, and reported if not), beside the repeated-4-gram fraction.
//!
//! # One benchmark, as data flows
//!
//! [`ConditionsOptions`] (arms from [`select_arms`], prompts from [`load_prompts`], trace
//! steps from [`default_steps`]) → [`run()`] resolves every Molt arm's routes from the
//! projector files (a missing one fails here, before any answer is generated) → the cost
//! probe loads each rung alone and decodes the longest prompt, giving the
//! [`RungCost`](molt::sched::RungCost)s every session decides on → [`spike_trace`] turns them
//! into the budget trace (or a trace file is read against them) → each run — one arm on one
//! prompt in one [`Pass`] — is a fresh session replaying that trace, its events and a
//! [`TokenRow`] per token kept as a [`RunLog`] and folded into its [`Cell`]: a [`TimedRun`],
//! or the [`QualityRun`]'s [`SeamRecord`]s → the judge adds each cell's
//! [`ContinuationQuality`] → the summary folds the cells into [`ArmSummary`] rows,
//! [`TimingComparison`]s and [`PairedComparison`]s → [`ConditionsReport`] →
//! [`write_outputs`] writes `conditions.json`, `conditions_events.jsonl` and
//! `token_series.json` ([`TokenSeries`]), from which the figures and the results page are
//! generated.
//!
//! # Where each part lives
//!
//! - `arms.rs`: the arm catalogue and the prompt file — the grid's two axes.
//! - `trace.rs`: the pressure trace built from the rungs' costs.
//! - `report.rs`: the report's schema, every type written (and read back) as JSON.
//! - `run.rs`: route resolution, the cost probe, one run, and the passes' orchestration.
//! - `summary.rs`: statistics over the cells, the comparisons, and the output files.
//!
//! Every public item is re-exported here, so `molt_bench::conditions::X` is the one path to
//! each of them.

mod arms;
mod report;
mod run;
mod summary;
mod trace;

pub use arms::{ArmSpec, PromptSpec, StartRung, all_arms, load_prompts, select_arms};
pub use report::{
    ArmSummary, Cell, ConditionsReport, ContinuationQuality, PairedComparison, Pass, QualityRun,
    RunLog, SeamRecord, Settings, TimedRun, TimingComparison, TokenRow, TokenSeries,
};
pub use run::{ConditionsOptions, REPETITION_N, run};
pub(crate) use summary::paired_comparisons;
pub use summary::{PAIRED_METRICS, write_outputs};
pub use trace::{default_steps, spike_trace};
