//! What the token loop tells the world: one event per token (naming the rung that produced
//! it), one per switch, and a summary at the end.

use serde::{Deserialize, Serialize};

/// Why an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model emitted an end-of-generation token.
    Eos,
    /// `max_tokens` reached.
    Length,
    /// The context window is full.
    ContextFull,
    /// The caller cancelled (Ctrl-C, client hung up).
    Cancelled,
    /// Killed by the OS (condition A only: the answer is lost).
    Killed,
    /// Parked past the session's park deadline: the answer so far is kept, and so is the
    /// conversation (parked), for the next request to continue once memory returns.
    ParkDeadline,
}

/// One migration between two tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchInfo {
    /// Generated-token index at which the switch happened (before this token).
    pub at_token: usize,
    /// Source rung.
    pub from: String,
    /// Destination rung.
    pub to: String,
    /// How the state was carried: `molt` (KV transplant), `reprefill` (condition C),
    /// `reprefill-no-projector` (a transplant's fallback).
    pub method: super::SwitchMethod,
    /// Where the time went (decision to the destination's first logits, weight loading, the
    /// breakdown), the cells carried and the FLOPs spent — the projection's plus the
    /// destination's first decode. Flattened: its fields are this record's keys.
    #[serde(flatten)]
    pub timings: super::migrate::SwitchTimings,
    /// FLOPs a re-prefill of the same context would have spent.
    pub flops_reprefill: f64,
    /// Budget pressure at the decision (0 = none, 1 = all memory taken).
    pub pressure: f64,
    /// Budget at the decision, bytes.
    pub budget_bytes: u64,
    /// Handoff divergence: JSD (nats) between the destination's next-token distribution right
    /// after the switch and the source's own at the same step (measured only when asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_jsd: Option<f64>,
    /// The floor of `handoff_jsd` at this switch: the same JSD for the destination with a
    /// native cache of the same history (read on a scratch context; measured with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_floor_jsd: Option<f64>,
    /// Why the switch did not go the usual way (e.g. the projector that was missing or bound
    /// to other files, when a transplant fell back to a re-prefill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The destination's micro-batch and repack, and why ([`crate::speed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<crate::speed::RungSetup>,
}

impl SwitchInfo {
    /// Fraction of the re-prefill FLOPs avoided.
    pub fn flops_avoided(&self) -> f64 {
        if self.flops_reprefill <= 0.0 {
            0.0
        } else {
            1.0 - self.timings.flops / self.flops_reprefill
        }
    }
}

/// A lever other than a switch, pulled between two tokens: parking the rung's weights,
/// resuming them, shedding the oldest context, or moving a parked cache to another rung's
/// layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeverInfo {
    /// Generated-token index before which it happened.
    pub at_token: usize,
    /// "park", "resume", "shed" or "relayout".
    pub lever: String,
    /// The rung afterwards (for a park: the rung whose layout the parked cache is in, or will
    /// be resumed in).
    pub rung: String,
    /// Tokens dropped (shed) or cells carried (park, resume, relayout).
    pub tokens: usize,
    /// Time the action took, ms (for a resume: mapping, import and the first decode).
    pub cost_ms: f64,
    /// For a resume: how long the answer was parked, ms (the stall a user saw).
    pub parked_ms: f64,
    /// Process RSS just before, bytes (0 if unreadable).
    pub rss_before: u64,
    /// Process RSS just after, bytes (0 if unreadable).
    pub rss_after: u64,
    /// Bytes of the parked cache held in host memory afterwards (0 when running).
    pub parked_kv_bytes: u64,
    /// Budget at the decision, bytes.
    pub budget_bytes: u64,
}

impl LeverInfo {
    /// A refill's end ([`SessionOptions::refill_chunk`](super::SessionOptions::refill_chunk)):
    /// `what` is `refill` once every cell is the destination's own, or why it was abandoned;
    /// `tokens` the positions it re-read, `cost_ms` the time of the batches that carried them.
    #[must_use]
    pub fn refill(
        at_token: usize,
        what: &str,
        rung: &str,
        tokens: usize,
        cost_ms: f64,
        budget_bytes: u64,
    ) -> Self {
        Self {
            at_token,
            lever: what.to_string(),
            rung: rung.to_string(),
            tokens,
            cost_ms,
            parked_ms: 0.0,
            rss_before: 0,
            rss_after: 0,
            parked_kv_bytes: 0,
            budget_bytes,
        }
    }
}

/// What became of a switch up prepared in the background
/// ([`SessionOptions::prepare_up`](super::SessionOptions::prepare_up)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrepareState {
    /// The destination started loading on a thread of its own; the answer goes on on `from`.
    Started,
    /// The load was given up (the budget fell, the policy stopped asking for the rung, the
    /// answer ended first) and what it loaded freed; `reason` says which.
    Dropped,
    /// The load failed; the answer stays on `from` (no switch up for the rest of it), and
    /// `reason` holds the error.
    Failed,
    /// A switch down prepared ahead was not started: carrying the conversation would take
    /// longer, at the pace measured on earlier carries, than the falling budget holds both
    /// rungs; `reason` gives both times. Said once per answer and rung.
    Skipped,
}

/// A switch prepared in the background — up, or down ahead of a falling budget — as it starts,
/// is given up or fails. A preparation that finishes
/// is reported by the switch it prepared ([`SwitchInfo`]'s `prepared_ms`, `prepared_tokens`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrepareInfo {
    /// Generated-token index before which it happened.
    pub at_token: usize,
    /// What happened.
    pub state: PrepareState,
    /// The rung the answer decodes on meanwhile.
    pub from: String,
    /// The rung being loaded.
    pub to: String,
    /// Time since the load started, ms (0 when it starts).
    pub elapsed_ms: f64,
    /// Tokens decoded on `from` since the load started.
    pub tokens: usize,
    /// The session's modelled footprint with the rung being loaded counted in (at `Started`),
    /// or what it would have been (at `Dropped` for the budget), bytes.
    pub modelled_bytes: u64,
    /// The budget at that token, bytes (0: no budget source).
    pub budget_bytes: u64,
    /// Why it was dropped, or the load's error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A switch down prepared ahead as the budget falls (a shadow, `src/session/shadow.rs`):
    /// `to` is below `from` and the conversation is carried there before the switch.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub down: bool,
}

/// What the session occupies right after a switch or a lever, measured beside what the policy
/// assumed, so that "the budget was never exceeded" is checked against the OS, not the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FootprintSample {
    /// Generated-token index before which it was taken.
    pub at_token: usize,
    /// The rung in use (running or parked).
    pub rung: String,
    /// Whether the weights are parked.
    pub parked: bool,
    /// Tokens in the cache (plus the one about to be decoded).
    pub context_tokens: usize,
    /// Measured: resident pages of every mapped rung file + each live context's measured
    /// buffers + the parked cache's bytes.
    pub measured_bytes: u64,
    /// What the policy assumed for the same state.
    pub modelled_bytes: u64,
    /// Process RSS (everything: weights, buffers, code, allocator slack).
    pub rss_bytes: u64,
    /// Peak process RSS (`VmHWM`) since the previous sample or the answer's start: what the
    /// action cost while it ran (a switch maps the destination before freeing the source).
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// The budget in force.
    pub budget_bytes: u64,
}

/// The end-of-answer summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Generated tokens.
    pub tokens: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Rungs in order of use.
    pub rungs_used: Vec<String>,
    /// Migrations.
    pub switches: Vec<SwitchInfo>,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Whole answer, ms.
    pub total_ms: f64,
    /// Why it ended.
    pub stop: StopReason,
    /// Whether the process would have been killed (always false for Molt).
    pub killed: bool,
    /// Generated tokens lost to the kill (condition A): the whole answer so far.
    #[serde(default)]
    pub lost_tokens: usize,
    /// Park, resume and shed actions.
    #[serde(default)]
    pub levers: Vec<LeverInfo>,
    /// Wall time spent parked, waiting for memory, ms.
    #[serde(default)]
    pub stall_ms: f64,
}

/// A streamed event.
// The switch report is the large variant; an event is built on the stack and handed to the
// sink by reference, so its size costs a copy of a few hundred bytes per token at most, while
// boxing the report would put an allocation on the switch's path and in every matcher.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The answer started (prompt decoded).
    Start {
        /// Rung that read the prompt.
        rung: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Of which were already cached.
        reused_tokens: usize,
    },
    /// One generated token.
    Token {
        /// Index in the answer.
        index: usize,
        /// Token id.
        token: i32,
        /// Text completed by this token (may be empty mid-character).
        text: String,
        /// The rung that produced it.
        rung: String,
        /// Time since the previous token (or since the prompt was submitted, for the first).
        latency_ms: f64,
        /// Its log-probabilities, when the answer's control asked for them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<super::control::TokenLogprobs>,
    },
    /// A migration happened before the next token.
    Switch(SwitchInfo),
    /// The budget changed.
    Budget {
        /// New budget, bytes.
        bytes: u64,
        /// Pressure, 0..1.
        pressure: f64,
        /// Where it came from.
        source: String,
    },
    /// Generation is waiting (no rung fits the budget).
    Stall {
        /// Why.
        reason: String,
        /// How long the answer may stay parked before it ends, ms (`None`: no deadline).
        deadline_ms: Option<u64>,
    },
    /// A park, resume, shed or relayout happened before the next token.
    Lever(LeverInfo),
    /// A switch up's background load started, was given up, or failed.
    Prepare(PrepareInfo),
    /// Measured occupancy after a switch or a lever.
    Footprint(FootprintSample),
    /// The answer ended.
    Done(Summary),
}

/// One answer, complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// The text.
    pub text: String,
    /// Generated token ids.
    pub tokens: Vec<i32>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Rungs in order of use.
    pub rungs_used: Vec<String>,
    /// Migrations.
    pub switches: Vec<SwitchInfo>,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Whole answer, ms.
    pub total_ms: f64,
    /// Why it ended.
    pub stop: StopReason,
    /// Killed (condition A).
    pub killed: bool,
    /// Generated tokens lost to the kill (the answer is gone; 0 unless killed).
    #[serde(default)]
    pub lost_tokens: usize,
    /// Park, resume and shed actions.
    #[serde(default)]
    pub levers: Vec<LeverInfo>,
    /// Wall time spent parked, waiting for memory, ms.
    #[serde(default)]
    pub stall_ms: f64,
}

impl Generation {
    /// The summary event for this answer.
    pub fn summary(&self) -> Summary {
        Summary {
            tokens: self.tokens.len(),
            prompt_tokens: self.prompt_tokens,
            rungs_used: self.rungs_used.clone(),
            switches: self.switches.clone(),
            ttft_ms: self.ttft_ms,
            total_ms: self.total_ms,
            stop: self.stop,
            killed: self.killed,
            lost_tokens: self.lost_tokens,
            levers: self.levers.clone(),
            stall_ms: self.stall_ms,
        }
    }

    /// Decode speed over the answer, tokens per second after the first token.
    pub fn tokens_per_s(&self) -> f64 {
        let gen_ms = self.total_ms - self.ttft_ms;
        if self.tokens.len() < 2 || gen_ms <= 0.0 {
            0.0
        } else {
            (self.tokens.len() - 1) as f64 * 1e3 / gen_ms
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::SwitchMethod;
    use crate::session::migrate::SwitchTimings;

    /// The top-level keys of `info`'s JSON, in the order written.
    fn keys(info: &SwitchInfo) -> Vec<String> {
        struct Keys(Vec<String>);
        impl<'de> Deserialize<'de> for Keys {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> serde::de::Visitor<'de> for V {
                    type Value = Keys;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("an object")
                    }
                    fn visit_map<A: serde::de::MapAccess<'de>>(
                        self,
                        mut m: A,
                    ) -> Result<Keys, A::Error> {
                        let mut keys = Vec::new();
                        while let Some(k) = m.next_key::<String>()? {
                            m.next_value::<serde::de::IgnoredAny>()?;
                            keys.push(k);
                        }
                        Ok(Keys(keys))
                    }
                }
                d.deserialize_map(V)
            }
        }
        let json = serde_json::to_string(info).unwrap();
        serde_json::from_str::<Keys>(&json).unwrap().0
    }

    fn info(timings: SwitchTimings) -> SwitchInfo {
        SwitchInfo {
            at_token: 3,
            from: "big".into(),
            to: "small".into(),
            method: SwitchMethod::Molt,
            timings,
            flops_reprefill: 10.0,
            pressure: 0.5,
            budget_bytes: 7,
            handoff_jsd: None,
            handoff_floor_jsd: None,
            note: None,
            setup: None,
        }
    }

    /// The switch record's keys and their order are what results files and clients read:
    /// flattening the timings must neither add nor move one (nor write `tail`).
    #[test]
    fn switch_record_keys_are_stable() {
        let plain = info(SwitchTimings {
            cost_ms: 1.0,
            tail: 4,
            cells: 9,
            flops: 2.0,
            ..SwitchTimings::default()
        });
        assert_eq!(
            keys(&plain),
            [
                "at_token",
                "from",
                "to",
                "method",
                "cost_ms",
                "load_ms",
                "export_ms",
                "project_ms",
                "import_ms",
                "first_decode_ms",
                "recompute_ms",
                "cells",
                "flops",
                "flops_reprefill",
                "pressure",
                "budget_bytes",
            ]
        );
        let full = SwitchInfo {
            handoff_jsd: Some(0.1),
            handoff_floor_jsd: Some(0.05),
            note: Some("n".into()),
            setup: None,
            ..info(SwitchTimings {
                topk: Some(2),
                head: 4,
                head_anchored: 3,
                head_ms: 0.5,
                recomputed: 6,
                spans: 2,
                spans_ms: 0.25,
                ..plain.timings
            })
        };
        let json = serde_json::to_string(&full).unwrap();
        assert_eq!(
            keys(&full)[10..19],
            [
                "recompute_ms",
                "topk",
                "head",
                "head_anchored",
                "head_ms",
                "recomputed",
                "spans",
                "spans_ms",
                "cells",
            ],
            "{json}"
        );
        assert_eq!(keys(&full).len(), 26, "{json}");
        let back: SwitchInfo = serde_json::from_str(&json).unwrap();
        // `tail` is not written, so it reads back as 0.
        assert_eq!(
            back,
            SwitchInfo {
                timings: SwitchTimings {
                    tail: 0,
                    ..full.timings
                },
                ..full
            }
        );
    }
}
