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
    /// "molt" (KV transplant), "reprefill" (condition C), "park", "shed".
    pub method: String,
    /// Decision to the destination's first logits, ms.
    pub cost_ms: f64,
    /// Time to load the destination's weights (paid by every strategy; reported apart).
    pub load_ms: f64,
    /// Breakdown: export, project, import, first decode (ms).
    pub export_ms: f64,
    /// Projection time.
    pub project_ms: f64,
    /// Import time.
    pub import_ms: f64,
    /// First decode on the destination.
    pub first_decode_ms: f64,
    /// Cells carried across.
    pub cells: usize,
    /// FLOPs the transplant spent.
    pub flops: f64,
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
    /// Why the switch did not go the usual way (e.g. the projector that was missing or bound
    /// to other files, when a transplant fell back to a re-prefill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl SwitchInfo {
    /// Fraction of the re-prefill FLOPs avoided.
    pub fn flops_avoided(&self) -> f64 {
        if self.flops_reprefill <= 0.0 {
            0.0
        } else {
            1.0 - self.flops / self.flops_reprefill
        }
    }
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
}

/// A streamed event.
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
    },
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
