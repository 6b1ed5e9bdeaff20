//! What a session is asked to do: the prompt ([`Prompt`]), one answer's options
//! ([`GenerateOptions`]), and the session-wide settings ([`SessionOptions`], [`Strategy`]) —
//! how to switch, what a switch re-reads natively, where projectors are found.

use std::path::PathBuf;
use std::time::Duration;

use crate::engine::SamplingParams;
use crate::sched::Policy;
use crate::transplant::select::TokenRecompute;

use crate::routes::{self, RouteKind, Variant};

/// What to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text, tokenized as is (no chat template).
    Text(String),
    /// A user turn appended to the session's conversation and rendered with the model's chat
    /// template.
    User(String),
    /// A whole prompt of its own (a plain-text completion): tokenized with the model's BOS rule
    /// and without parsing control tokens, independent of earlier answers (the cached prefix
    /// it shares with them is still reused).
    Standalone(String),
}

/// Per-answer options.
#[derive(Debug, Clone, Copy)]
pub struct GenerateOptions {
    /// Stop after this many generated tokens.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// `(i, rung)`: switch to `rung` before generated token `i`, whatever the budget says
    /// (benchmarks and tests that need a switch at a known point).
    pub force_switch: Option<(usize, usize)>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::greedy(),
            force_switch: None,
        }
    }
}

/// How a session changes rung when the budget says it must.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Molt (condition D): project the KV cache between two tokens.
    Molt,
    /// Condition C: switch rung and re-read prompt + generated text on the destination.
    Reprefill,
    /// Conditions A and B: never switch; when the budget falls below the rung's footprint the
    /// process would be killed, and the answer is lost.
    Never,
}

/// Session-wide settings.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// How to change rung.
    pub strategy: Strategy,
    /// Projector family (ablations).
    pub variant: Variant,
    /// Where projector files are searched (see [`routes::search_dirs`]).
    pub projector_dirs: Vec<PathBuf>,
    /// Hysteresis and shedding granularity.
    pub policy: Policy,
    /// Leading tokens shedding never drops. `None`: the chat template's system prompt for
    /// chat prompts, nothing for raw text.
    pub pinned_tokens: Option<usize>,
    /// Before each decision, raise the current rung's cost to what the process's anonymous
    /// memory shows it holding (compute buffers grow past what the load measured once a long
    /// prompt has gone through them). Turn off when several sessions share one process: the
    /// operating system's numbers cannot tell their allocations apart.
    pub observe_footprint: bool,
    /// Head re-read: at a Molt switch, the history's first `n` positions get the
    /// destination's own K/V instead of projected ones. The prefix carries the attention sink
    /// (most of every head's attention mass) and, in a chat, the chat template's opening (and
    /// a system prompt, if any); under causal attention its native K/V are exact. The part the
    /// destination's shipped anchor covers (its state over the template's opening, see
    /// [`crate::transplant::anchor`]) is spliced in for free; the rest is decoded on the
    /// destination at the switch: in the batch of its first token when a few positions are
    /// left and no span is re-read ([`crate::session::migrate::HEAD_IN_FIRST_BATCH`]), else
    /// before the projection, without logits. [`DEFAULT_HEAD_REREAD`] by default (the
    /// template's opening plus the first token of the user's message); 0 turns it off (the
    /// conditions benchmark's `D-no-head` arm).
    pub head_reread: usize,
    /// Head later: a switch that would decode the head's few unanchored positions in the batch
    /// of its first token (off standby, projected where it lies,
    /// [`crate::session::migrate::stage`]) leaves them projected and reads them natively in
    /// place with the next token instead. That first token attends to them as projected
    /// either way (they are read in scratch cells beside it); only the second does too now.
    /// Two positions in a batch cost ~1.5-2× one on the real ladder, and the first token after
    /// a switch is the gap the user sees. On by default; a standby rung that read the
    /// conversation's head after an earlier answer has nothing left to read.
    pub head_later: bool,
    /// Refill: after a Molt switch on a size route, the destination re-reads the history
    /// natively in place, this many positions in the batch of every token it decodes, until
    /// every cell is its own (`super::refill`). The switch's selective recompute re-reads
    /// what the question looked at; a summary looks at everything, and without the refill one
    /// caught by a size switch states a third of its notes' facts where a re-prefill states
    /// three quarters (`bench --recall --recall-items benches/recall/summaries.jsonl`). The
    /// compute is a re-prefill's, spread over the next tokens instead of stalling the first.
    /// [`DEFAULT_REFILL_CHUNK`] by default; 0 turns it off.
    pub refill_chunk: usize,
    /// The refill's deadline, in tokens: it re-reads more than [`Self::refill_chunk`] per
    /// token when that is what it takes to reach the newest token within this many
    /// ([`Self::refill_step`]). A one-sentence answer after a switch at ~1,800 tokens ends
    /// before 64 per token reach the end (25 tokens), and what it states is then read over
    /// projected cells. [`DEFAULT_REFILL_WITHIN`] by default; 0: no deadline.
    pub refill_within: usize,
    /// The refill's pace, as a multiple of the rung's own gap between two tokens: each token
    /// carries as many positions as keep its gap within this (timed on the rung after the
    /// switch, [`super::refill::RefillPace`]), never more than [`Self::refill_step`] gives.
    /// [`DEFAULT_REFILL_PACE`] by default; 1 or less: unpaced, [`Self::refill_step`] a token.
    pub refill_pace: f64,
    /// Hurried sparse read: a size switch that reads sparsely
    /// ([`crate::transplant::select::Rest::LeftOut`]) reads only the head and the newest `n`
    /// positions before its first token, and leaves the positions it chose (the question, the
    /// answer so far, then the sentences the question looked at most) to be read after it,
    /// paced as the refill, before the refill's own pass ([`super::refill::hurry_split`]). The
    /// gap at the switch becomes a token's with a few positions, where the whole sparse read
    /// took 420-750 ms on tier2 at ~300-1,600 tokens (`results/switch_stall.json`); the first
    /// tokens after it see little of the context. 0: off, the whole sparse read before the
    /// first token.
    pub hurry: usize,
    /// Refill after a precision route's switch too (off: the projection keeps the facts there,
    /// at a fortieth of a re-prefill's cost).
    pub refill_precision: bool,
    /// Selective token recompute at a size-route switch: after the import, the destination
    /// re-reads a share of the cached positions natively, chosen by the source's attention
    /// from the prompt's last tokens (see [`crate::transplant::select`]). On by default
    /// ([`TokenRecompute::default_size`]): without it a size switch keeps the answer fluent and
    /// loses the context's facts (the recall benchmark). `None`: off.
    pub token_recompute: Option<TokenRecompute>,
    /// How long an answer may stay parked between two tokens (no rung fits the budget)
    /// before it ends with [`StopReason::ParkDeadline`](super::StopReason::ParkDeadline),
    /// the conversation kept and the session still parked, instead of holding the engine
    /// until memory returns. `None`: wait as long as it takes.
    pub park_deadline: Option<Duration>,
    /// Keep the rungs below the current one on standby ([`super::StandbyRung`]): loaded ahead,
    /// context created and warmed up, weight pages released from this process, so a switch
    /// down only maps the pages back instead of loading the rung (measured by `molt-run bench
    /// --stall`). What they hold (their context buffers, measured) is counted in the
    /// session's footprint, and they are the first thing given up when the budget no longer
    /// holds them beside the current rung. On by default; off, every switch loads its
    /// destination on the spot.
    pub standby: bool,
    /// Keep a standby rung's weight pages mapped while the budget last read holds them beside
    /// everything else (no budget: always), counted in full; released first when it no longer
    /// does. A switch down onto a hot rung maps nothing (35-85 ms of the gap on the real
    /// ladder, 2 cores). On by default; off, standby rungs always wait with their pages
    /// released.
    pub standby_hot: bool,
    /// Prepare a switch up in the background (`super::prepare`): when the policy moves up to
    /// a rung that is neither loaded nor on standby, load it on a thread of its own while the
    /// answer goes on on the current rung, and switch at the first token after the load
    /// finished. On by default; off, the switch up loads its destination on the spot.
    pub prepare_up: bool,
    /// Prepare a switch down ahead while the budget falls (`super::shadow`): when, at the
    /// slope of the last readings, the budget would fall below the current rung's footprint
    /// within [`SessionOptions::shadow_horizon`], the conversation is carried onto the rung
    /// below in the background and kept caught up, so the switch down, when it comes, is one
    /// short batch. On by default; off, a switch down carries the conversation at its token.
    pub prepare_down: bool,
    /// How far ahead the budget's trend is read for [`SessionOptions::prepare_down`]: long
    /// enough for a carry to finish before the budget stops holding both rungs (30 s by
    /// default: a size route's carry took 13-18 s on half of 2 cores on the real ladder, the
    /// precision routes' 1-2 s). A longer horizon reacts to slower falls, and to noise.
    pub shadow_horizon: Duration,
    /// How soon the current rung must be predicted to stop fitting for a carried shadow to be
    /// taken early once the budget no longer holds both rungs (5 s by default); otherwise the
    /// shadow is dropped (`super::shadow`).
    pub shadow_early: Duration,
    /// Where what a carry onto each rung cost on this machine is kept between processes
    /// ([`crate::session::pace`]), so a new process decides its first shadow on a measurement
    /// (`None`, the library's default: kept in the process only; the CLI passes the per-user
    /// file, [`crate::session::pace::default_pace_file`]).
    pub pace_file: Option<std::path::PathBuf>,
    /// Read what a size switch's sparse read left out when the answer ends, before its last
    /// event (off by default: the answer ends as soon as its last token is written, and the
    /// positions are read between answers by [`Session::fill_idle`](super::Session::fill_idle)
    /// — `chat`, the facade and the server call it while no prompt waits — or by the next
    /// prompt, before it is read, when none did).
    pub fill_at_end: bool,
    /// Switches for benchmarks and ablations, not for products ([`Research`]): the defaults
    /// are what Molt ships.
    pub research: Research,
    /// How each rung's micro-batch and CPU repack are chosen when it loads ([`crate::speed`]):
    /// by default no measurement (every rung at the context configuration's micro-batch,
    /// repack off) and repack forced when `MOLT_REPACK` is set.
    pub speed: crate::speed::SpeedPolicy,
}

/// The experiment knobs of a session, kept apart from what an application chooses: each makes a
/// switch do or measure something a benchmark compares (the conditions, stall and recall
/// benchmarks set them; `molt-run generate` exposes the recompute ones as flags). The defaults
/// are Molt's shipped behaviour.
#[derive(Debug, Clone, Default)]
pub struct Research {
    /// Keep the source rung loaded after a switch (benchmarks that want both warm); by default
    /// it is freed, which is the point of moving.
    pub keep_source: bool,
    /// Also decode the switch token on the source, to measure the handoff divergence (JSD of
    /// the two next-token distributions). Costs one extra source decode, outside the switch
    /// cost.
    pub measure_seam: bool,
    /// Selective top-k recompute: at a Molt switch, compute the destination's last `k` blocks'
    /// K/V natively from the source's mapped boundary hidden state instead of projecting them.
    /// Off (`None`) by default: it needs a fitted hidden map per route
    /// (`molt-run train-projectors --topk`), keeps every position's boundary state in host
    /// memory (n_embd floats per tapped layer and token), and its extra switch cost has to be
    /// earned by a smoother seam (the conditions benchmark's `D-topk*` arms measure it).
    pub topk_recompute: Option<usize>,
    /// Tail recompute: at a Molt switch, drop the projected cells of the last `n` history
    /// tokens and let the destination re-read them natively (one batch with the pending
    /// token), so the positions the next token leans on most are the destination's own. 0
    /// (off) by default; each token re-read costs what a prefill token costs on the
    /// destination (the conditions benchmark's `D-tail*` arms weigh it against the seam).
    pub tail_recompute: usize,
    /// A forced switch up ([`GenerateOptions::force_switch`]) is prepared as the policy's is:
    /// it waits, tokens on the source, for its destination's background load (with
    /// [`SessionOptions::prepare_up`]). Off by default: a forced switch happens at its token,
    /// which the benchmarks that switch at chosen points (recall, conditions) rely on;
    /// `bench --stall` turns it on to measure the switch up as the policy takes it.
    pub forced_up_waits: bool,
    /// A forced switch down ([`GenerateOptions::force_switch`]) is prepared as a shadow, the
    /// decision known ahead: it waits, tokens on the source, until its destination is carried
    /// and caught up (with [`SessionOptions::prepare_down`]). Off by default; `bench --stall`
    /// turns it on to measure the switch down a falling budget warns of.
    pub forced_down_waits: bool,
}

/// The head re-read of a default Molt switch: ChatML's opening (`<|im_start|>user\n`, three
/// tokens, from the anchor) and the user message's first token (decoded, with the switch's
/// first token when nothing else is re-read). Measured on the
/// real ladder (conditions benchmark, 10 prompts): judge perplexity 2.29 against the
/// projection alone's 3.00 and a re-prefill's 2.13; three tokens gave 2.46.
pub const DEFAULT_HEAD_REREAD: usize = 4;

/// Positions a refill re-reads in the batch of every token after a size switch
/// ([`SessionOptions::refill_chunk`]). A summary switched tier0 → tier2 stated as many of its
/// notes' facts with 64 as with 256 per step (`results/recall_summaries.json`); 64 finishes
/// ~850 cells in 13 tokens, each ~0.3 s slower on tier2 on 2 cores, where 256 makes every one
/// of 4 tokens wait ~1 s.
pub const DEFAULT_REFILL_CHUNK: usize = 64;

/// Tokens within which a refill reaches the newest token ([`SessionOptions::refill_within`]):
/// 64 per token up to ~520 cells, more beyond (~200 per token at ~1,800). Measured on the
/// recall items, tier0 → tier2 (`results/recall.json`): the refill ended before the answer
/// in 11 of 12 answers at ~1,800 tokens (3 of 12 with 64 a token and no deadline) and 12 of
/// 12 at ~1,024 (10), so the next turn builds on a cache that is the destination's own; the
/// facts stated were the same within one answer per length (29 of 48 against 28; summaries
/// 0.47 against 0.47). The price: each of those tokens waits longer at long contexts (~1.3 s
/// for each of 9 at ~1,800 on 2 cores, where 64 a token spreads the same work over 25).
pub const DEFAULT_REFILL_WITHIN: usize = 8;

/// The refill's pace ([`SessionOptions::refill_pace`]): no token behind a switch waits more
/// than three of the rung's own gaps for the refill, the yardstick the stall benchmark holds a
/// switch's own gap to. Unpaced, a size switch at ~1,200 tokens was followed by nine tokens
/// ~1.1 s apart on tier2 (own gap ~25 ms) on 2 cores: the answer stopped for ten seconds.
pub const DEFAULT_REFILL_PACE: f64 = 3.0;

/// Positions a hurried size switch reads before its first token ([`SessionOptions::hurry`]);
/// 0: not hurried.
pub const DEFAULT_HURRY: usize = 0;

impl SessionOptions {
    /// Whether a Molt switch over a route of `kind` is followed by a refill.
    #[must_use]
    pub fn refills(&self, kind: RouteKind) -> bool {
        self.refill_chunk > 0 && (kind == RouteKind::Size || self.refill_precision)
    }

    /// Positions a refill that starts with `cells` positions to re-read takes per token: at
    /// least [`Self::refill_chunk`], and enough to finish within [`Self::refill_within`]
    /// tokens. 0 when the refill is off.
    #[must_use]
    pub fn refill_step(&self, cells: usize) -> usize {
        refill_step(self.refill_chunk, self.refill_within, cells)
    }
}

/// [`SessionOptions::refill_step`] for a chunk of `chunk` positions (0: off) and a deadline of
/// `within` tokens (0: none).
#[must_use]
pub fn refill_step(chunk: usize, within: usize, cells: usize) -> usize {
    if chunk == 0 {
        return 0;
    }
    if within == 0 {
        return chunk;
    }
    chunk.max(cells.div_ceil(within))
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            strategy: Strategy::Molt,
            variant: Variant::Auto,
            projector_dirs: routes::search_dirs(None),
            policy: Policy::default(),
            pinned_tokens: None,
            observe_footprint: true,
            head_reread: DEFAULT_HEAD_REREAD,
            head_later: true,
            refill_chunk: DEFAULT_REFILL_CHUNK,
            refill_within: DEFAULT_REFILL_WITHIN,
            refill_pace: DEFAULT_REFILL_PACE,
            hurry: DEFAULT_HURRY,
            refill_precision: false,
            token_recompute: Some(TokenRecompute::default_size()),
            park_deadline: None,
            standby: true,
            standby_hot: true,
            prepare_up: true,
            prepare_down: true,
            shadow_horizon: Duration::from_secs(30),
            shadow_early: Duration::from_secs(5),
            pace_file: None,
            fill_at_end: false,
            research: Research::default(),
            speed: crate::speed::SpeedPolicy::from_env(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::refill_step;

    #[test]
    fn a_refill_takes_its_chunk_or_what_reaches_the_end_within_its_deadline() {
        // Short histories: the chunk.
        assert_eq!(refill_step(64, 8, 400), 64);
        assert_eq!(refill_step(64, 8, 512), 64);
        // Long ones: enough to finish within 8 tokens.
        assert_eq!(refill_step(64, 8, 1_600), 200);
        assert_eq!(refill_step(64, 8, 1_601), 201);
        assert!(1_601_usize.div_ceil(201) <= 8);
        // No deadline: the chunk; off: nothing.
        assert_eq!(refill_step(64, 0, 1_600), 64);
        assert_eq!(refill_step(0, 8, 1_600), 0);
    }
}
