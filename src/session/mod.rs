//! The token loop: prefill, sample, stream, and — between two tokens — decide whether to move
//! to another rung. Everything a user sees (CLI, prompt files, the HTTP service, the
//! benchmark) is a consumer of the [`Event`]s this loop emits.
//!
//! Main types: [`Session`] (a ladder with loaded rungs and one conversation), [`Prompt`],
//! [`GenerateOptions`], [`Event`] and [`Generation`] (the summary of one answer).

mod condition;
mod events;
mod levers;
pub mod migrate;
mod refill;
pub mod routes;
mod rung;

pub use condition::Condition;
pub use events::{Event, FootprintSample, Generation, LeverInfo, StopReason, Summary, SwitchInfo};
pub use levers::chat_pinned_prefix;
pub use routes::{RouteError, RouteKind, Routes, Variant};
pub use rung::{LiveRung, ParkedRung};

use crate::engine::{
    ChatMessage, ContextConfig, EngineError, Sampler, SamplingParams, Span, Token, Utf8Stream,
    softmax,
};
use crate::ladder::Ladder;
use crate::pressure::{Budget, BudgetSource, PressureError, Tick};
use crate::sched::{Decision, Policy, RungCost, TenantClass, TenantView, decide_one};
use crate::transplant::anchor::Anchor;
use crate::transplant::select::{SelectRule, TokenRecompute, select_spans};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Errors from a session.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// llama.cpp failed.
    #[error("rung {rung}: {source}")]
    Engine {
        /// Rung name.
        rung: String,
        /// The engine error.
        source: EngineError,
    },
    /// The prompt does not fit the context window.
    #[error(
        "the prompt is {prompt_tokens} tokens but the context window is {n_ctx} (and {reserve} are kept for the answer); shorten the prompt or raise --n-ctx"
    )]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Context window.
        n_ctx: u32,
        /// Tokens reserved for the answer.
        reserve: usize,
    },
    /// No such rung.
    #[error("no rung named {0:?} in this ladder")]
    UnknownRung(String),
    /// No projector for a route the session needed.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The budget source failed.
    #[error("budget source: {0}")]
    Budget(#[from] PressureError),
    /// The budget can never hold even the smallest rung.
    #[error(
        "the budget ({budget_mib} MiB) is below the smallest rung's footprint ({rung}: {need_mib} MiB for {tokens} tokens of context); raise the budget or shorten the request"
    )]
    BudgetBelowSmallest {
        /// Budget in MiB.
        budget_mib: u64,
        /// Smallest rung.
        rung: String,
        /// Its footprint in MiB.
        need_mib: u64,
        /// Context tokens assumed.
        tokens: u64,
    },
    /// Parked, and the budget source cannot change while the answer waits (a token-clock
    /// trace: its clock is the answer's own progress, which stops while parked).
    #[error(
        "parked before token {at_token}: the budget ({budget_mib} MiB) is below every rung's footprint and {source_desc} only moves as tokens are generated, so it would never let the answer resume; give the trace an ms clock, or keep its lowest budget above the smallest rung"
    )]
    ParkedForever {
        /// Token index.
        at_token: usize,
        /// Budget in MiB.
        budget_mib: u64,
        /// The budget source.
        source_desc: String,
    },
    /// A migration failed; the session stays on the source rung.
    #[error("migration {from} -> {to} failed: {message}")]
    Migration {
        /// Source rung.
        from: String,
        /// Destination rung.
        to: String,
        /// Why.
        message: String,
    },
}

/// What to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text, tokenized as is (no chat template).
    Text(String),
    /// A user turn appended to the session's conversation and rendered with the model's chat
    /// template.
    User(String),
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
    /// Keep the source rung loaded after a switch (benchmarks that want both warm); by default
    /// it is freed, which is the point of moving.
    pub keep_source: bool,
    /// Also decode the switch token on the source, to measure the handoff divergence (JSD of
    /// the two next-token distributions). Costs one extra source decode, outside the switch
    /// cost.
    pub measure_seam: bool,
    /// Leading tokens shedding never drops. `None`: the chat template's system prompt for
    /// chat prompts, nothing for raw text.
    pub pinned_tokens: Option<usize>,
    /// Before each decision, raise the current rung's cost to what the process's anonymous
    /// memory shows it holding (compute buffers grow past what the load measured once a long
    /// prompt has gone through them). Turn off when several sessions share one process: the
    /// operating system's numbers cannot tell their allocations apart.
    pub observe_footprint: bool,
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
    /// Head re-read: at a Molt switch, the history's first `n` positions get the
    /// destination's own K/V instead of projected ones. The prefix carries the attention sink
    /// (most of every head's attention mass) and, in a chat, the chat template's opening (and
    /// a system prompt, if any); under causal attention its native K/V are exact. The part the
    /// destination's shipped anchor covers (its state over the template's opening, see
    /// [`crate::transplant::anchor`]) is spliced in for free; the rest is decoded on the
    /// destination at the switch, without logits. [`DEFAULT_HEAD_REREAD`] by default (the
    /// template's opening plus the first token of the user's message); 0 turns it off (the
    /// conditions benchmark's `D-no-head` arm).
    pub head_reread: usize,
    /// Background refill: after a Molt switch, re-read the history natively on the destination
    /// in a context of its own, this many tokens between every two generated tokens, and let
    /// it take over the live cache once caught up (the projection's error then lasts only until
    /// then; the compute is a re-prefill's, spread out instead of stalling). 0 (off) by
    /// default; the extra context costs the destination's KV once more while it runs.
    pub refill_chunk: usize,
    /// Selective token recompute at a size-route switch: after the import, the destination
    /// re-reads a share of the cached positions natively, chosen by the source's attention
    /// from the prompt's last tokens (see [`crate::transplant::select`]). On by default
    /// ([`TokenRecompute::default_size`]): without it a size switch keeps the answer fluent and
    /// loses the context's facts (the recall benchmark). `None`: off.
    pub token_recompute: Option<TokenRecompute>,
}

/// A switch's seam as the quality pass measures it.
#[derive(Debug, Clone, Copy)]
struct SeamReading {
    /// JSD of the destination's first distribution against the source's own.
    jsd: f64,
    /// The same for the destination with a native cache of the same history (a re-prefill's
    /// JSD; for a re-prefill switch, `jsd` itself).
    floor: Option<f64>,
}

/// The destination's native next-token distribution after `history` + `last`, read on a
/// scratch context of its model, as a JSD against `reference` (the source's): the floor a
/// re-prefill would have reached at this very switch. `None` if it cannot be measured.
fn native_floor(
    dst: &LiveRung,
    history: &[Token],
    last: Token,
    config: ContextConfig,
    reference: &[f32],
) -> Option<f64> {
    let cfg = ContextConfig {
        attention_tap: false,
        hidden_tap: false,
        ..config
    };
    let mut ctx = crate::engine::Context::new(dst.ctx.model().clone(), cfg).ok()?;
    let mut all = Vec::with_capacity(history.len() + 1);
    all.extend_from_slice(history);
    all.push(last);
    ctx.decode(&all).ok()?;
    Some(jsd(reference, ctx.logits()))
}

/// The head re-read of a default Molt switch: ChatML's opening (`<|im_start|>user\n`, three
/// tokens, from the anchor) and the user message's first token (decoded). Measured on the
/// real ladder (conditions benchmark, 10 prompts): judge perplexity 2.29 against the
/// projection alone's 3.00 and a re-prefill's 2.13; three tokens gave 2.46.
pub const DEFAULT_HEAD_REREAD: usize = 4;

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            strategy: Strategy::Molt,
            variant: Variant::Auto,
            projector_dirs: routes::search_dirs(None),
            policy: Policy::default(),
            keep_source: false,
            measure_seam: false,
            pinned_tokens: None,
            observe_footprint: true,
            topk_recompute: None,
            tail_recompute: 0,
            head_reread: DEFAULT_HEAD_REREAD,
            refill_chunk: 0,
            token_recompute: None,
        }
    }
}

/// A ladder with loaded rungs and one conversation.
pub struct Session {
    ladder: Ladder,
    config: ContextConfig,
    opts: SessionOptions,
    routes: Routes,
    rungs: Vec<Option<LiveRung>>,
    /// Measured context overheads, per rung, once a rung has been loaded.
    context_bytes: Vec<Option<u64>>,
    /// Set by [`Session::pin_context_bytes`]: loads no longer overwrite `context_bytes`.
    pinned_costs: bool,
    current: usize,
    /// The largest rung this session may use (where it started).
    home: usize,
    /// Tokens whose K/V are in the current rung's cache, in order.
    history: Vec<Token>,
    /// The conversation (for chat prompts).
    conversation: Vec<ChatMessage>,
    /// The token sampled last but not yet decoded (carried across answers and migrations).
    pending: Option<Token>,
    budget: Option<Box<dyn BudgetSource + Send>>,
    last_budget: Option<u64>,
    cancel: Arc<AtomicBool>,
    /// The weights released, the cache kept (lever 3); `current` is then the rung the policy
    /// places the cache on.
    parked: Option<levers::Parked>,
    /// Leading tokens of `history` never shed.
    pinned: usize,
    /// Levers pulled during the answer being generated.
    answer_levers: Vec<LeverInfo>,
    /// Time parked during the answer being generated, ms.
    stall_ms: f64,
    /// `RssAnon` before the session loaded anything: what it holds itself is the growth above.
    anon_base: u64,
    /// A background refill in progress ([`SessionOptions::refill_chunk`]).
    refill: Option<refill::Refill>,
    /// The attention mass the last prompt's final tokens gave each cached position (when
    /// [`SessionOptions::token_recompute`] selects by attention); positions after it (the
    /// answer's) count as 0.
    observed: Option<Vec<f32>>,
}

/// The inputs of one top-k recompute, gathered from the source before it may be freed.
struct TopkInputs {
    k: usize,
    map: Arc<crate::transplant::hidden::HiddenMap>,
    /// The source's boundary states, `[n_past][n_embd_src]`.
    hidden: ndarray::Array2<f32>,
}

/// KV bytes per token of a rung: K and V rows of every layer.
fn kv_per_token(info: &crate::ladder::RungInfo, config: ContextConfig) -> u64 {
    let f = &info.facts;
    u64::from(f.n_layer) * u64::from(f.kv_dim_k() + f.kv_dim_v()) * config.cache_type.bytes() as u64
}

/// Before a rung has been loaded, its context cost is estimated as a KV buffer for the whole
/// window plus a compute buffer of one micro-batch of logits (128 × n_vocab floats, what
/// dominates llama.cpp's reservation) and 8 MiB of graph scratch, with a quarter on top; the
/// measurement replaces it at load.
fn compute_estimate(info: &crate::ladder::RungInfo) -> u64 {
    let logits = 128 * info.facts.n_vocab * 4;
    (logits + (8 << 20)) * 5 / 4
}

impl Session {
    /// A session on `ladder`, starting on rung `start` (loaded now), with default options.
    ///
    /// # Errors
    /// [`SessionError::UnknownRung`] or a load failure.
    pub fn new(ladder: Ladder, config: ContextConfig, start: &str) -> Result<Self, SessionError> {
        Self::with_options(ladder, config, start, SessionOptions::default())
    }

    /// A session with explicit options.
    ///
    /// # Errors
    /// [`SessionError::UnknownRung`] or a load failure.
    pub fn with_options(
        ladder: Ladder,
        mut config: ContextConfig,
        start: &str,
        opts: SessionOptions,
    ) -> Result<Self, SessionError> {
        config.hidden_tap |= opts.topk_recompute.is_some();
        config.attention_tap |= opts
            .token_recompute
            .is_some_and(|t| t.rule == SelectRule::Attention);
        let current = ladder
            .rungs
            .iter()
            .position(|r| r.name() == start)
            .ok_or_else(|| SessionError::UnknownRung(start.to_string()))?;
        let n = ladder.rungs.len();
        let routes = Routes::new(&ladder, opts.projector_dirs.clone(), opts.variant);
        crate::pressure::return_freed_buffers_to_os();
        let anon_base = crate::pressure::process_anon_rss_bytes().unwrap_or(0);
        let mut s = Self {
            ladder,
            config,
            opts,
            routes,
            rungs: (0..n).map(|_| None).collect(),
            context_bytes: vec![None; n],
            pinned_costs: false,
            current,
            home: current,
            history: Vec::new(),
            conversation: Vec::new(),
            pending: None,
            budget: None,
            last_budget: None,
            cancel: Arc::new(AtomicBool::new(false)),
            parked: None,
            pinned: 0,
            answer_levers: Vec::new(),
            stall_ms: 0.0,
            anon_base,
            refill: None,
            observed: None,
        };
        s.ensure_loaded(current)?;
        Ok(s)
    }

    /// The ladder.
    pub fn ladder(&self) -> &Ladder {
        &self.ladder
    }

    /// The options.
    pub fn options(&self) -> &SessionOptions {
        &self.opts
    }

    /// The projector routes (to install freshly fitted projectors, or inspect).
    pub fn routes_mut(&mut self) -> &mut Routes {
        &mut self.routes
    }

    /// The current rung's name.
    pub fn current_rung(&self) -> &str {
        self.ladder.rungs[self.current].name()
    }

    /// Index of the current rung.
    pub fn current_index(&self) -> usize {
        self.current
    }

    /// The conversation so far.
    pub fn conversation(&self) -> &[ChatMessage] {
        &self.conversation
    }

    /// Replaces the conversation the next [`Prompt::User`] is appended to. A stateless caller
    /// (the HTTP service, which receives the whole conversation with every request) sets the
    /// earlier turns here; the cache is kept, so [`Session::generate`] still reuses whatever
    /// prefix the new rendering shares with what is cached.
    pub fn set_conversation(&mut self, messages: Vec<ChatMessage>) {
        self.conversation = messages;
    }

    /// The tokens in the current cache.
    pub fn history(&self) -> &[Token] {
        &self.history
    }

    /// The context config shared by every rung.
    pub fn config(&self) -> ContextConfig {
        self.config
    }

    /// Replaces the budget source (`None`: no budget, never switch).
    pub fn set_budget_source(&mut self, source: Option<Box<dyn BudgetSource + Send>>) {
        self.budget = source;
        self.last_budget = None;
    }

    /// Describes the budget source.
    pub fn budget_description(&self) -> String {
        self.budget
            .as_ref()
            .map_or_else(|| "none".to_string(), |b| b.describe())
    }

    /// A flag that, once set, stops the answer being generated (Ctrl-C, a client hanging up).
    /// It is cleared at the start of every answer.
    pub fn cancel_handle(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }

    /// Forgets the conversation and the cache (the rungs stay loaded).
    pub fn reset(&mut self) {
        self.conversation.clear();
        self.history.clear();
        self.pending = None;
        self.pinned = 0;
        // A parked cache is forgotten with the rest; the next answer maps the rung again.
        self.parked = None;
        if let Some(r) = self.rungs[self.current].as_mut() {
            r.ctx.clear();
        }
    }

    /// Forgets the conversation and moves back to the rung the session started on (mapping it
    /// again if a switch freed it), so the next answer starts where the first one did — what a
    /// prompt file wants between independent prompts.
    ///
    /// # Errors
    /// A load failure of the home rung (the session then stays where it was, reset).
    pub fn reset_home(&mut self) -> Result<(), SessionError> {
        self.reset();
        if self.current != self.home {
            self.ensure_loaded(self.home)?;
            let old = self.current;
            self.current = self.home;
            if !self.opts.keep_source {
                self.unload(old);
            }
            self.live().ctx.clear();
        }
        Ok(())
    }

    /// Moves an idle session — nothing cached, as after [`Session::reset`] — to rung `index`
    /// (never above the rung it started on): loads it and frees the old one unless
    /// `keep_source`. Nothing is projected because nothing is cached. The HTTP service uses
    /// this to start each answer on the largest rung the budget allows, instead of reading the
    /// prompt on a rung that must migrate right after.
    ///
    /// # Errors
    /// [`SessionError::UnknownRung`] for an index out of range or above the home rung,
    /// [`SessionError::Migration`] when the session is not idle, or a load failure.
    pub fn move_idle(&mut self, index: usize) -> Result<(), SessionError> {
        if index >= self.rungs.len() || index < self.home {
            return Err(SessionError::UnknownRung(index.to_string()));
        }
        if index == self.current {
            return Ok(());
        }
        if !self.history.is_empty() || self.pending.is_some() {
            return Err(SessionError::Migration {
                from: self.current_rung().to_string(),
                to: self.ladder.rungs[index].name().to_string(),
                message: "the session holds a cache; reset it before moving idle".into(),
            });
        }
        self.ensure_loaded(index)?;
        let old = self.current;
        self.current = index;
        self.live().ctx.clear();
        if !self.opts.keep_source {
            self.unload(old);
        }
        Ok(())
    }

    /// The history's first and last tokens a Molt switch re-reads natively
    /// ([`SessionOptions::head_reread`], [`SessionOptions::tail_recompute`]), never more than
    /// the `n_past` cells the cache holds; the head's anchored part comes from `anchor`.
    fn reread<'a>(
        &'a self,
        n_past: usize,
        anchor: Option<&'a Anchor>,
        spans: &'a [Span<'a>],
    ) -> migrate::Reread<'a> {
        let avail = n_past.min(self.history.len());
        let n = self.opts.tail_recompute.min(avail);
        let h = self.opts.head_reread.min(avail);
        migrate::Reread {
            head: &self.history[..h],
            tail: &self.history[self.history.len() - n..],
            anchor,
            spans,
        }
    }

    /// The positions a switch `from → to` re-reads natively between the head and the tail
    /// (selective token recompute): none unless it is on and the route is a size route (a
    /// precision route keeps the context's facts without it).
    fn recompute_ranges(&self, from: usize, to: usize, n_past: usize) -> Vec<Range<usize>> {
        let Some(setting) = self.opts.token_recompute else {
            return Vec::new();
        };
        let kind = routes::route_kind(self.routes.binding(from), self.routes.binding(to));
        if kind != RouteKind::Size {
            return Vec::new();
        }
        let avail = n_past.min(self.history.len());
        let lo = self.opts.head_reread.min(avail);
        let hi = avail - self.opts.tail_recompute.min(avail);
        let scores = self.observed.as_deref().unwrap_or(&[]);
        // The question (the observation window at the prompt's end) and the answer so far.
        let prompt_end = if scores.is_empty() { hi } else { scores.len() };
        let always = prompt_end.saturating_sub(setting.window);
        select_spans(scores, lo, hi, always, &setting, avail as u64)
    }

    /// The history's tokens of `ranges`.
    fn spans_of<'a>(&'a self, ranges: &[Range<usize>]) -> Vec<Span<'a>> {
        ranges
            .iter()
            .map(|r| Span {
                start: r.start,
                tokens: &self.history[r.clone()],
            })
            .collect()
    }

    /// The destination's anchor for a head re-read (none when the head re-read is off or no
    /// anchor is shipped); a damaged or foreign anchor is not used, and `note` says why (the
    /// head is then decoded whole).
    fn anchor_for(&mut self, to: usize, note: &mut Option<String>) -> Option<Arc<Anchor>> {
        if self.opts.head_reread == 0 {
            return None;
        }
        self.routes.anchor(to).unwrap_or_else(|e| {
            *note = Some(format!("anchor not used, head decoded: {e}"));
            None
        })
    }

    /// The rung this session started on and never goes above.
    pub fn home_index(&self) -> usize {
        self.home
    }

    /// Loads a rung if it is not loaded.
    ///
    /// # Errors
    /// A load failure.
    pub fn ensure_loaded(&mut self, index: usize) -> Result<&mut LiveRung, SessionError> {
        if index >= self.rungs.len() {
            return Err(SessionError::UnknownRung(index.to_string()));
        }
        if self.rungs[index].is_none() {
            let mut live = LiveRung::load(&self.ladder.rungs[index], self.config)?;
            if live.context_bytes > 0 && !self.pinned_costs {
                self.context_bytes[index] = Some(live.context_bytes);
            }
            self.arm_hidden_tap(index, &mut live.ctx);
            self.rungs[index] = Some(live);
        }
        self.rungs[index]
            .as_mut()
            .ok_or_else(|| SessionError::UnknownRung(index.to_string()))
    }

    /// Unloads a rung (not the current one).
    pub fn unload(&mut self, index: usize) {
        if index != self.current
            && let Some(slot) = self.rungs.get_mut(index)
        {
            *slot = None;
        }
    }

    /// Installs a top-k hidden map for the route `src → dst` (bypassing the file search) and
    /// re-arms the hidden-state tap of every loaded rung accordingly. Rows a rung's tap kept
    /// so far are dropped, so install maps before the first answer.
    pub fn install_hidden_map(
        &mut self,
        src: usize,
        dst: usize,
        map: crate::transplant::hidden::HiddenMap,
    ) {
        self.routes.insert_hidden(src, dst, map);
        for i in 0..self.rungs.len() {
            if let Some(mut live) = self.rungs[i].take() {
                self.arm_hidden_tap(i, &mut live.ctx);
                self.rungs[i] = Some(live);
            }
        }
    }

    /// With top-k recompute on, makes `ctx` (rung `index`'s) keep the boundary hidden states
    /// that the hidden maps out of `index` read: one source layer per route that has a map.
    fn arm_hidden_tap(&mut self, index: usize, ctx: &mut crate::engine::Context) {
        let Some(k) = self.opts.topk_recompute else {
            return;
        };
        let mut layers: Vec<usize> = (0..self.ladder.rungs.len())
            .filter(|&d| d != index)
            .filter_map(|d| self.routes.hidden(index, d, k).ok().map(|m| m.src_layer))
            .collect();
        layers.sort_unstable();
        layers.dedup();
        ctx.set_hidden_layers(&layers);
    }

    /// What top-k recompute needs for a switch `from → to` out of `src`, or why it cannot run
    /// (then the switch projects every layer, and the reason goes in the switch's note).
    ///
    /// Only states the source computed itself are used: after a switch the new rung holds an
    /// imported cache whose earlier positions it never decoded, so its tap covers only what
    /// came after, and a later switch out of it projects every layer. Chaining maps through the
    /// rung that did compute them would compound two fits' errors for a second switch inside
    /// one answer, which the benchmark's traces do not produce; the plain projection is the
    /// honest fallback.
    fn topk_inputs(
        &mut self,
        from: usize,
        to: usize,
        src: &crate::engine::Context,
    ) -> Result<Option<TopkInputs>, String> {
        let Some(k) = self.opts.topk_recompute else {
            return Ok(None);
        };
        let map = self
            .routes
            .hidden(from, to, k)
            .map_err(|e| format!("top-k recompute off for this switch: {e}"))?;
        let hidden = src.hidden_states(map.src_layer).ok_or_else(|| {
            format!(
                "top-k recompute off for this switch: {} did not compute the boundary state of every cached position itself",
                self.ladder.rungs[from].name()
            )
        })?;
        Ok(Some(TopkInputs { k, map, hidden }))
    }

    fn recompute_for<'a>(&'a self, to: usize, t: &'a TopkInputs) -> migrate::Recompute<'a> {
        let info = &self.ladder.rungs[to];
        migrate::Recompute {
            hidden: t.hidden.view(),
            map: Some(&t.map),
            k: t.k,
            dst_path: &info.path,
            dst_sha256: &info.sha256,
            dst_layers: info.facts.n_layer as usize,
        }
    }

    fn live(&mut self) -> &mut LiveRung {
        // The current rung is loaded by construction and by every switch.
        self.rungs[self.current]
            .as_mut()
            .expect("current rung is loaded")
    }

    /// Which rungs are loaded.
    pub fn loaded(&self) -> Vec<bool> {
        self.rungs.iter().map(Option::is_some).collect()
    }

    /// Access to a loaded rung.
    pub fn rung_mut(&mut self, index: usize) -> Option<&mut LiveRung> {
        self.rungs.get_mut(index).and_then(Option::as_mut)
    }

    /// What each rung costs, for the policy: weights = the file's tensor bytes (every weight
    /// page is touched by each decode, so a running rung's weights are all resident), KV per
    /// token from the geometry, and the context's measured overhead (an estimate until the
    /// rung has been loaded once).
    pub fn rung_costs(&self) -> Vec<RungCost> {
        self.ladder
            .rungs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let kv = kv_per_token(r, self.config);
                let ctx = self.context_bytes[i]
                    .unwrap_or(kv * u64::from(self.config.n_ctx) + compute_estimate(r));
                RungCost::new(r.name(), r.facts.total_tensor_bytes.max(1), kv, ctx)
            })
            .collect()
    }

    /// Fixes the context overhead the policy assumes for each rung (as [`RungCost`]'s
    /// `compute_bytes`) instead of measuring it when the rung loads. For benchmarks that replay
    /// one trace in many sessions of one process: the load-time measurement (growth of
    /// `RssAnon`) depends on what the allocator already holds from earlier sessions, so without
    /// pinning the same trace could mean different decisions in different sessions.
    pub fn pin_context_bytes(&mut self, bytes: &[u64]) {
        for (slot, &b) in self.context_bytes.iter_mut().zip(bytes) {
            *slot = Some(b);
        }
        self.pinned_costs = true;
    }

    /// The footprint the policy assigns rung `index` with `tokens` of context.
    pub fn modelled_footprint(&self, index: usize, tokens: u64) -> u64 {
        let c = &self.rung_costs()[index];
        c.resident_bytes() + c.kv_bytes(tokens)
    }

    /// The modelled footprint of every rung at `tokens` of context, by rung name: the
    /// references a relative trace's `frac … of tierN` events resolve against
    /// ([`crate::pressure::Trace::load_with`]).
    pub fn trace_refs(&self, tokens: u64) -> crate::pressure::TraceRefs {
        self.ladder
            .rungs
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name().to_string(), self.modelled_footprint(i, tokens)))
            .collect()
    }

    /// The measured footprint: resident pages of every mapped rung file (from the process's
    /// own `smaps`) plus the growth of the process's anonymous memory since the session was
    /// created — repacked weights, KV and compute buffers as far as they have been touched, a
    /// parked cache. If `RssAnon` cannot be read: each loaded rung's load-time measurement
    /// plus the parked cache's bytes. In a process that runs other work besides this session,
    /// the anonymous part includes that work too.
    pub fn measured_footprint(&self) -> u64 {
        let weights: u64 = self
            .rungs
            .iter()
            .flatten()
            .map(LiveRung::weights_resident)
            .sum();
        match crate::pressure::process_anon_rss_bytes() {
            Ok(anon) => weights + anon.saturating_sub(self.anon_base),
            Err(_) => {
                weights
                    + self
                        .rungs
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.is_some())
                        .map(|(i, _)| self.context_bytes[i].unwrap_or(0))
                        .sum::<u64>()
                    + self.parked_kv_bytes()
            }
        }
    }

    /// Tokens for a prompt: raw text, or the whole conversation rendered with the chat
    /// template (with the new user turn appended, assistant turn opened).
    fn prompt_tokens(&mut self, prompt: &Prompt) -> Result<Vec<Token>, SessionError> {
        let name = self.current_rung().to_string();
        let wrap = |source| SessionError::Engine {
            rung: name.clone(),
            source,
        };
        match prompt {
            Prompt::Text(t) => {
                let mut v = self.history.clone();
                if let Some(p) = self.pending {
                    v.push(p);
                }
                v.extend(self.live().model().tokenize(t, false).map_err(wrap)?);
                Ok(v)
            }
            Prompt::User(t) => {
                let mut conv = self.conversation.clone();
                conv.push(ChatMessage::new("user", t));
                let text = self
                    .live()
                    .model()
                    .apply_chat_template(&conv, true)
                    .map_err(wrap)?;
                let tokens = self.live().model().tokenize(&text, true).map_err(wrap)?;
                self.conversation = conv;
                Ok(tokens)
            }
        }
    }

    fn read_budget(&mut self, tick: Tick) -> Result<Option<Budget>, SessionError> {
        match self.budget.as_mut() {
            None => Ok(None),
            Some(b) => Ok(Some(b.budget(tick)?)),
        }
    }

    /// Moves the session to rung `to` between two tokens: `last` is the token sampled on the
    /// current rung but not decoded yet; on return it has been decoded on `to`, whose logits
    /// are ready.
    ///
    /// Moving down to a rung that is not loaded, the source is freed *before* the destination
    /// is mapped (see [`Session::switch_shed_first`]), so the process never holds both; moving
    /// up, or with the source kept or the seam measured, the destination is loaded first.
    fn switch_to(
        &mut self,
        to: usize,
        last: Token,
        at_token: usize,
        budget: Option<Budget>,
    ) -> Result<SwitchInfo, SessionError> {
        let from = self.current;
        let shed_first = to > from
            && self.rungs[to].is_none()
            && !self.opts.keep_source
            && !self.opts.measure_seam;
        let (from_name, timings, method, note, load_ms, seam) = if shed_first {
            let (timings, method, note, load_ms) = self.switch_shed_first(from, to, last)?;
            let name = self.ladder.rungs[from].name().to_string();
            (name, timings, method, note, load_ms, None)
        } else {
            self.switch_load_first(from, to, last)?
        };
        let dst = self.rungs[to].as_ref().expect("destination is loaded");
        let n_tokens = self.history.len() as u64 + 1;
        let (n_params, n_layer, n_embd) = (
            dst.model().n_params(),
            dst.model().n_layer() as u64,
            dst.model().n_embd() as u64,
        );
        let flops_reprefill = migrate::prefill_flops(n_params, n_layer, n_embd, n_tokens);
        let flops = match method {
            "reprefill" | "reprefill-no-projector" => flops_reprefill,
            _ => timings.flops + migrate::prefill_flops(n_params, n_layer, n_embd, 1),
        };
        let info = SwitchInfo {
            at_token,
            from: from_name,
            to: dst.name().to_string(),
            method: method.to_string(),
            cost_ms: timings.cost_ms,
            load_ms,
            export_ms: timings.export_ms,
            project_ms: timings.project_ms,
            import_ms: timings.import_ms,
            first_decode_ms: timings.first_decode_ms,
            recompute_ms: timings.recompute_ms,
            topk: timings.topk,
            head: timings.head,
            head_anchored: timings.head_anchored,
            head_ms: timings.head_ms,
            recomputed: timings.recomputed,
            spans: timings.spans,
            spans_ms: timings.spans_ms,
            cells: timings.cells,
            flops,
            flops_reprefill,
            pressure: budget.map_or(0.0, |b| b.pressure),
            budget_bytes: budget.map_or(0, |b| b.bytes),
            handoff_jsd: seam.map(|s| s.jsd),
            handoff_floor_jsd: seam.and_then(|s| s.floor),
            note,
        };
        self.current = to;
        Ok(info)
    }

    /// The load-first switch: map the destination (if needed), carry the state while both are
    /// live, then free the source (or keep it, cleared, with `keep_source`). On failure both
    /// rungs are as they were.
    #[allow(clippy::type_complexity)]
    fn switch_load_first(
        &mut self,
        from: usize,
        to: usize,
        last: Token,
    ) -> Result<
        (
            String,
            migrate::SwitchTimings,
            &'static str,
            Option<String>,
            f64,
            Option<SeamReading>,
        ),
        SessionError,
    > {
        let was_loaded = self.rungs[to].is_some();
        let t_load = Instant::now();
        self.ensure_loaded(to)?;
        let load_ms = if was_loaded {
            0.0
        } else {
            t_load.elapsed().as_secs_f64() * 1e3
        };
        let mut src = self.rungs[from].take().expect("current rung is loaded");
        let mut dst = self.rungs[to].take().expect("destination just loaded");
        let mut note = None;
        let result = match self.opts.strategy {
            Strategy::Reprefill => migrate::reprefill(&src.ctx, &mut dst.ctx, &self.history, last)
                .map(|t| (t, "reprefill")),
            // Without a usable projector the answer must still survive: fall back to a
            // re-prefill, named as such in the switch event, rather than lose it.
            _ => match self.routes.get(from, to) {
                Ok(p) => {
                    let topk = self.topk_inputs(from, to, &src.ctx).unwrap_or_else(|why| {
                        note = Some(why);
                        None
                    });
                    let anchor = self.anchor_for(to, &mut note);
                    let rc = topk.as_ref().map(|t| self.recompute_for(to, t));
                    let ranges = self.recompute_ranges(from, to, src.ctx.n_past());
                    let spans = self.spans_of(&ranges);
                    let reread = self.reread(src.ctx.n_past(), anchor.as_deref(), &spans);
                    migrate::transplant_with(&src.ctx, &mut dst.ctx, &p, rc.as_ref(), reread, last)
                        .map(|t| (t, "molt"))
                }
                Err(e) => {
                    note = Some(format!("fell back to a re-prefill: {e}"));
                    migrate::reprefill(&src.ctx, &mut dst.ctx, &self.history, last)
                        .map(|t| (t, "reprefill-no-projector"))
                }
            },
        };
        let (timings, method) = match result {
            Ok(r) => r,
            Err(e) => {
                self.rungs[from] = Some(src);
                self.rungs[to] = Some(dst);
                return Err(e);
            }
        };
        let seam = if self.opts.measure_seam && src.ctx.decode(&[last]).is_ok() {
            let reference = src.ctx.logits();
            let jsd = jsd(reference, dst.ctx.logits());
            // A re-prefill switch is its own floor.
            let floor = if method == "molt" {
                native_floor(&dst, &self.history, last, self.config, reference)
            } else {
                Some(jsd)
            };
            src.ctx.truncate(src.ctx.n_past().saturating_sub(1));
            Some(SeamReading { jsd, floor })
        } else {
            None
        };
        let from_name = src.name().to_string();
        self.rungs[to] = Some(dst);
        if self.opts.keep_source {
            src.ctx.clear();
            self.rungs[from] = Some(src);
        } else {
            drop(src);
        }
        Ok((from_name, timings, method, note, load_ms, seam))
    }

    /// The shed-first switch, for moving down under pressure: export the source's sequence
    /// state (a few MB of host memory), free the source — weights unmapped, context and its
    /// buffers released — then map the destination, project and import. The process never
    /// holds both rungs, so the switch itself cannot overshoot the budget it answers.
    ///
    /// If the destination cannot be loaded or the state cannot be carried, the source is
    /// mapped again and its exported state re-imported byte for byte, so the session stays
    /// where it was with nothing lost; only if that also fails is the error fatal.
    fn switch_shed_first(
        &mut self,
        from: usize,
        to: usize,
        last: Token,
    ) -> Result<(migrate::SwitchTimings, &'static str, Option<String>, f64), SessionError> {
        // Resolve the projector before anything is freed: a missing one means a re-prefill.
        let (projector, mut note) = match self.opts.strategy {
            Strategy::Reprefill => (None, None),
            _ => match self.routes.get(from, to) {
                Ok(p) => (Some(p), None),
                Err(e) => (None, Some(format!("fell back to a re-prefill: {e}"))),
            },
        };
        let t0 = Instant::now();
        let src = self.rungs[from].take().expect("current rung is loaded");
        let from_name = src.name().to_string();
        let from_model = src.model().name().to_string();
        let n_past = src.ctx.n_past();
        let blob = match src.ctx.export_state() {
            Ok(b) => b,
            Err(e) => {
                self.rungs[from] = Some(src);
                return Err(SessionError::Migration {
                    from: from_name,
                    to: self.ladder.rungs[to].name().to_string(),
                    message: format!("export: {e}"),
                });
            }
        };
        let export_ms = t0.elapsed().as_secs_f64() * 1e3;
        let src_config = src.ctx.config();
        let topk = match projector {
            Some(_) => self.topk_inputs(from, to, &src.ctx).unwrap_or_else(|why| {
                note = Some(why);
                None
            }),
            None => None,
        };
        drop(src);
        crate::pressure::trim_heap();
        let t_load = Instant::now();
        let carried = match LiveRung::load(&self.ladder.rungs[to], self.config) {
            Ok(mut dst) => {
                let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
                if dst.context_bytes > 0 && !self.pinned_costs {
                    self.context_bytes[to] = Some(dst.context_bytes);
                }
                self.arm_hidden_tap(to, &mut dst.ctx);
                let anchor = self.anchor_for(to, &mut note);
                let rc = topk.as_ref().map(|t| self.recompute_for(to, t));
                let ranges = self.recompute_ranges(from, to, n_past);
                let spans = self.spans_of(&ranges);
                // The load is reported apart (both strategies pay it): the switch's own cost
                // is the export plus everything after the load.
                let r = match &projector {
                    Some(p) => migrate::transplant_exported(
                        &migrate::Exported {
                            blob: &blob,
                            n_past,
                            from: &from_model,
                            export_ms,
                        },
                        &mut dst.ctx,
                        p,
                        rc.as_ref(),
                        self.reread(n_past, anchor.as_deref(), &spans),
                        last,
                    )
                    .map(|t| (t, "molt")),
                    None => migrate::reprefill_from(&from_model, &mut dst.ctx, &self.history, last)
                        .map(|mut t| {
                            t.export_ms = export_ms;
                            t.cost_ms += export_ms;
                            (t, "reprefill")
                        }),
                };
                r.map(|(t, m)| (t, m, dst, load_ms))
            }
            Err(e) => Err(e),
        };
        match carried {
            Ok((timings, method, dst, load_ms)) => {
                let method = if method == "reprefill" && note.is_some() {
                    "reprefill-no-projector"
                } else {
                    method
                };
                self.rungs[to] = Some(dst);
                Ok((timings, method, note.take(), load_ms))
            }
            Err(e) => {
                // Put the source back exactly as it was: its exported state is a parked rung.
                let restored = ParkedRung {
                    info: self.ladder.rungs[from].clone(),
                    config: src_config,
                    blob,
                    n_past,
                    park_ms: 0.0,
                }
                .resume();
                match restored {
                    Ok(live) => {
                        self.rungs[from] = Some(live);
                        Err(e)
                    }
                    Err(r) => {
                        // Nothing of the answer's state survives: start the rung afresh so the
                        // session stays usable, and forget the history its cache no longer
                        // holds.
                        self.history.clear();
                        let _ = self.ensure_loaded(from);
                        Err(SessionError::Migration {
                            from: from_name,
                            to: self.ladder.rungs[to].name().to_string(),
                            message: format!(
                                "{e}; and the source could not be restored after it: {r}"
                            ),
                        })
                    }
                }
            }
        }
    }

    /// Answers one prompt, streaming [`Event`]s into `sink`.
    ///
    /// The cache is reused for the longest prefix the new prompt shares with what is already
    /// cached (a chat's earlier turns are not re-read). Before each token the budget is read; if
    /// the current rung's footprint would exceed it, the session moves to the largest rung that
    /// fits (by the session's [`Strategy`]); when the budget recovers past the hysteresis
    /// margin it moves back up, never above the rung it started on.
    ///
    /// # Errors
    /// [`SessionError::PromptTooLong`] or [`SessionError::BudgetBelowSmallest`] before anything
    /// is decoded; engine and migration errors otherwise.
    #[allow(clippy::too_many_lines)]
    pub fn generate(
        &mut self,
        prompt: &Prompt,
        opts: &GenerateOptions,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Generation, SessionError> {
        let t0 = Instant::now();
        self.cancel.store(false, Ordering::SeqCst);
        self.unpark()?;
        crate::pressure::reset_peak_rss();
        self.answer_levers.clear();
        self.stall_ms = 0.0;
        let tokens = self.prompt_tokens(prompt)?;
        let n_ctx = self.config.n_ctx;
        let reserve = opts.max_tokens.clamp(1, 16);
        if tokens.len() + reserve > n_ctx as usize {
            return Err(SessionError::PromptTooLong {
                prompt_tokens: tokens.len(),
                n_ctx,
                reserve,
            });
        }
        // Before the prompt: check that the smallest rung fits at all, and start on the largest
        // rung that fits (never above home).
        let mut switches = Vec::new();
        let budget0 = self.read_budget(Tick {
            token_index: 0,
            elapsed_ms: 0,
        })?;
        if let Some(b) = budget0 {
            self.last_budget = Some(b.bytes);
            sink(&Event::Budget {
                bytes: b.bytes,
                pressure: b.pressure,
                source: self.budget_description(),
            });
            let costs = self.rung_costs();
            let smallest = costs.len() - 1;
            let need = costs[smallest].resident_bytes()
                + costs[smallest].kv_bytes((tokens.len() + opts.max_tokens) as u64);
            if b.bytes < need {
                return Err(SessionError::BudgetBelowSmallest {
                    budget_mib: b.bytes >> 20,
                    rung: costs[smallest].name.clone(),
                    need_mib: need >> 20,
                    tokens: (tokens.len() + opts.max_tokens) as u64,
                });
            }
        }
        // Start the answer on the largest rung the budget holds (never above home): the prompt
        // has to be read anyway, so moving now costs only the earlier turns' re-read.
        if let (Some(b), true) = (budget0, self.opts.strategy != Strategy::Never) {
            let view = TenantView::new(0, TenantClass::Foreground)
                .with_rung(self.current)
                .with_home(self.home)
                .with_context(tokens.len() as u64, 0);
            let costs = self.rung_costs();
            if let Ok(Decision::Demote { to } | Decision::Promote { to }) =
                decide_one(&view, b.bytes, &costs, &self.opts.policy)
            {
                let from = self.current;
                self.ensure_loaded(to)?;
                self.current = to;
                self.history.clear();
                self.pending = None;
                if let Some(r) = self.rungs[to].as_mut() {
                    r.ctx.clear();
                }
                if !self.opts.keep_source {
                    self.rungs[from] = None;
                }
            }
        }
        let keep = common_prefix(&self.history, &tokens).min(tokens.len().saturating_sub(1));
        let rung_name = self.current_rung().to_string();
        let wrap = |source| SessionError::Engine {
            rung: rung_name.clone(),
            source,
        };
        let window = self
            .opts
            .token_recompute
            .filter(|t| t.rule == SelectRule::Attention)
            .map(|t| t.window);
        self.observed = {
            let live = self.live();
            live.ctx.truncate(keep);
            match window {
                Some(w) => live.ctx.decode_observed(&tokens[keep..], w).map_err(wrap)?,
                None => {
                    live.ctx.decode(&tokens[keep..]).map_err(wrap)?;
                    None
                }
            }
        };
        self.history = tokens.clone();
        self.pending = None;
        if keep == 0 {
            self.pinned = self.pinned_prefix(&tokens, matches!(prompt, Prompt::User(_)));
        }
        let mut sampler = Sampler::new(opts.sampling);
        let mut stream = Utf8Stream::new();
        let mut out_tokens: Vec<Token> = Vec::new();
        let mut text = String::new();
        let mut rungs_used = vec![rung_name.clone()];
        let mut last = Instant::now();
        let mut ttft_ms = 0.0;
        let mut killed = false;
        sink(&Event::Start {
            rung: rung_name.clone(),
            prompt_tokens: tokens.len(),
            reused_tokens: keep,
        });
        let mut stop = StopReason::Length;
        for i in 0..opts.max_tokens {
            if self.cancel.load(Ordering::SeqCst) {
                stop = StopReason::Cancelled;
                break;
            }
            if i > 0 {
                let tok = *out_tokens.last().unwrap_or(&0);
                if self.history.len() + 1 > n_ctx as usize {
                    stop = StopReason::ContextFull;
                    break;
                }
                match self.between_tokens(i, tok, t0, opts, sink)? {
                    Between::Switched(info) => {
                        sink(&Event::Switch((*info).clone()));
                        if info.method == "molt" {
                            self.start_refill();
                        } else {
                            self.drop_refill();
                        }
                        switches.push(*info);
                    }
                    Between::Decoded => {}
                    Between::Cancelled => {
                        stop = StopReason::Cancelled;
                        break;
                    }
                    Between::Stay => {
                        let name = self.current_rung().to_string();
                        self.live()
                            .ctx
                            .decode(&[tok])
                            .map_err(|source| SessionError::Engine { rung: name, source })?;
                    }
                    Between::Killed => {
                        killed = true;
                        stop = StopReason::Killed;
                        break;
                    }
                }
                self.history.push(tok);
                self.refill_step(i, sink);
            }
            let tok = {
                let live = self.live();
                sampler.sample(live.ctx.logits())
            };
            let now = Instant::now();
            let latency_ms = now.duration_since(last).as_secs_f64() * 1e3;
            last = now;
            if i == 0 {
                ttft_ms = now.duration_since(t0).as_secs_f64() * 1e3;
            }
            if self.live().model().is_eog(tok) {
                stop = StopReason::Eos;
                break;
            }
            out_tokens.push(tok);
            let piece = stream.push(&self.live().model().token_bytes(tok));
            text.push_str(&piece);
            let rung = self.current_rung().to_string();
            if rungs_used.last() != Some(&rung) {
                rungs_used.push(rung.clone());
            }
            sink(&Event::Token {
                index: i,
                token: tok,
                text: piece,
                rung,
                latency_ms,
            });
        }
        // A refill still behind when the answer ends is dropped with its context: the next
        // answer starts from the cache as it stands.
        self.drop_refill();
        let tail = stream.finish();
        if !tail.is_empty() {
            text.push_str(&tail);
        }
        let lost_tokens = if killed { out_tokens.len() } else { 0 };
        if killed {
            // The process is gone: nothing of the conversation survives.
            self.pinned = 0;
            self.conversation.clear();
            self.history.clear();
            self.pending = None;
            self.live().ctx.clear();
        } else {
            self.pending = out_tokens.last().copied();
            if let Prompt::User(_) = prompt {
                self.conversation.push(ChatMessage::new("assistant", &text));
            }
        }
        let total_ms = t0.elapsed().as_secs_f64() * 1e3;
        let generation = Generation {
            text,
            tokens: out_tokens,
            prompt_tokens: tokens.len(),
            rungs_used,
            switches,
            ttft_ms,
            total_ms,
            stop,
            killed,
            lost_tokens,
            levers: std::mem::take(&mut self.answer_levers),
            stall_ms: self.stall_ms,
        };
        sink(&Event::Done(generation.summary()));
        Ok(generation)
    }

    /// Between token `i − 1` (sampled as `tok`, not yet decoded) and token `i`: read the budget
    /// and act on the one-tenant policy — switch rung, park, shed, resume — until the session
    /// can take its step. Parked, it waits on the wall clock (re-reading the budget every
    /// [`PARK_POLL`]) and resumes when the policy says so: the answer is never terminated, except
    /// under [`Strategy::Never`], which models the process that is.
    #[allow(clippy::too_many_lines)]
    fn between_tokens(
        &mut self,
        i: usize,
        tok: Token,
        t0: Instant,
        opts: &GenerateOptions,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Between, SessionError> {
        if let Some((at, to)) = opts.force_switch
            && at == i
            && to != self.current
            && to < self.rungs.len()
        {
            let info = self.switch_to(to, tok, i, None)?;
            crate::pressure::trim_heap();
            let b = self.last_budget.unwrap_or(0);
            sink(&Event::Footprint(self.footprint_sample(i, b)));
            return Ok(Between::Switched(Box::new(info)));
        }
        let mut waited = false;
        // Consecutive actions without a wait: each one changes the state, and the policy is
        // monotone within one budget reading, so a handful settle it; the cap only guards
        // against a policy/actuator disagreement spinning without sleeping.
        let mut actions = 0usize;
        loop {
            let elapsed_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
            let Some(b) = self.read_budget(Tick {
                token_index: i as u64,
                elapsed_ms,
            })?
            else {
                if self.is_parked() {
                    let to = self.current;
                    let info = self.resume(to, tok, i, None)?;
                    self.record_lever(info, i, 0, sink);
                    return Ok(Between::Decoded);
                }
                return Ok(Between::Stay);
            };
            if self.last_budget != Some(b.bytes) {
                self.last_budget = Some(b.bytes);
                sink(&Event::Budget {
                    bytes: b.bytes,
                    pressure: b.pressure,
                    source: self.budget_description(),
                });
            }
            self.observe_footprint();
            let costs = self.rung_costs();
            let parked = self.is_parked();
            let pinned = self.pinned.min(self.history.len()) as u64;
            let view = TenantView::new(0, TenantClass::Foreground)
                .with_rung(self.current)
                .with_home(self.home)
                .with_parked(parked)
                .with_context(self.history.len() as u64 + 1, pinned);
            let decision = decide_one(&view, b.bytes, &costs, &self.opts.policy).map_err(|e| {
                SessionError::Migration {
                    from: self.current_rung().to_string(),
                    to: "?".into(),
                    message: e.to_string(),
                }
            })?;
            if self.opts.strategy == Strategy::Never {
                let over = costs[self.current].resident_bytes()
                    + costs[self.current].kv_bytes(self.history.len() as u64 + 1)
                    > b.bytes;
                return Ok(if over { Between::Killed } else { Between::Stay });
            }
            let acted = match decision {
                Decision::Stay | Decision::Admit { .. } => {
                    if !parked {
                        return Ok(Between::Stay);
                    }
                    false
                }
                Decision::Demote { to } | Decision::Promote { to } => {
                    if !parked {
                        let info = self.switch_to(to, tok, i, Some(b))?;
                        crate::pressure::trim_heap();
                        sink(&Event::Footprint(self.footprint_sample(i, b.bytes)));
                        return Ok(Between::Switched(Box::new(info)));
                    }
                    if let Some(info) = self.move_parked(to, i, b)? {
                        self.record_lever(info, i, b.bytes, sink);
                    }
                    true
                }
                Decision::Park { rung } => {
                    let info = self.park(rung, i, b)?;
                    self.record_lever(info, i, b.bytes, sink);
                    true
                }
                Decision::Resume { rung } => {
                    let info = self.resume(rung, tok, i, Some(b))?;
                    self.record_lever(info, i, b.bytes, sink);
                    return Ok(Between::Decoded);
                }
                Decision::Shed {
                    tokens,
                    rung,
                    parked: stay_parked,
                } => {
                    let n = usize::try_from(tokens).unwrap_or(usize::MAX);
                    if stay_parked {
                        if !parked {
                            let info = self.park(rung, i, b)?;
                            self.record_lever(info, i, b.bytes, sink);
                        } else if let Some(info) = self.move_parked(rung, i, b)? {
                            self.record_lever(info, i, b.bytes, sink);
                        }
                        let info = self.shed_parked(n, i, b)?;
                        let moved = info.tokens > 0;
                        self.record_lever(info, i, b.bytes, sink);
                        moved
                    } else if parked {
                        let info = self.shed_parked(n, i, b)?;
                        self.record_lever(info, i, b.bytes, sink);
                        let info = self.resume(rung, tok, i, Some(b))?;
                        self.record_lever(info, i, b.bytes, sink);
                        return Ok(Between::Decoded);
                    } else {
                        let info = self.shed_live(n, tok, i, b)?;
                        self.record_lever(info, i, b.bytes, sink);
                        if rung == self.current {
                            return Ok(Between::Decoded);
                        }
                        // Shed and move: the shift is applied by decoding `tok` here; take that
                        // token back out and carry the shed cache across with it.
                        let live = self.live();
                        let n_past = live.ctx.n_past();
                        live.ctx.truncate(n_past - 1);
                        let info = self.switch_to(rung, tok, i, Some(b))?;
                        crate::pressure::trim_heap();
                        sink(&Event::Footprint(self.footprint_sample(i, b.bytes)));
                        return Ok(Between::Switched(Box::new(info)));
                    }
                }
            };
            if acted && actions < 8 {
                actions += 1;
                continue;
            }
            actions = 0;
            // Parked: wait for memory to come back.
            if !self.budget.as_ref().is_some_and(|s| s.moves_with_time()) {
                return Err(SessionError::ParkedForever {
                    at_token: i,
                    budget_mib: b.bytes >> 20,
                    source_desc: self.budget_description(),
                });
            }
            if !waited {
                sink(&Event::Stall {
                    reason: format!(
                        "budget {} MiB is below every rung's footprint; parked on {}, waiting for memory",
                        b.bytes >> 20,
                        self.current_rung()
                    ),
                });
                waited = true;
            }
            if self.cancel.load(Ordering::SeqCst) {
                if let Some(p) = self.parked.as_ref() {
                    self.stall_ms += p.since.elapsed().as_secs_f64() * 1e3;
                }
                return Ok(Between::Cancelled);
            }
            std::thread::sleep(PARK_POLL);
        }
    }

    fn record_lever(
        &mut self,
        info: LeverInfo,
        at_token: usize,
        budget_bytes: u64,
        sink: &mut dyn FnMut(&Event),
    ) {
        sink(&Event::Lever(info.clone()));
        self.answer_levers.push(info);
        sink(&Event::Footprint(
            self.footprint_sample(at_token, budget_bytes),
        ));
    }
}

/// How often a parked answer re-reads its budget.
pub const PARK_POLL: Duration = Duration::from_millis(50);

enum Between {
    /// Nothing happened: decode the pending token on the current rung.
    Stay,
    /// Moved rung; the pending token has been decoded on the destination.
    Switched(Box<SwitchInfo>),
    /// A lever (resume, shed) has decoded the pending token already.
    Decoded,
    /// Condition A/B's process is killed.
    Killed,
    /// Cancelled while parked.
    Cancelled,
}

/// Jensen–Shannon divergence (nats) between the softmax distributions of two logit rows.
#[must_use]
pub fn jsd(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.is_empty() {
        return f64::NAN;
    }
    let (p, q) = (softmax(a), softmax(b));
    let mut d = 0.0;
    for (&x, &y) in p.iter().zip(&q) {
        let m = 0.5 * (x + y);
        if x > 0.0 {
            d += 0.5 * x * (x / m).ln();
        }
        if y > 0.0 {
            d += 0.5 * y * (y / m).ln();
        }
    }
    d.max(0.0)
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::jsd;

    #[test]
    fn jsd_is_zero_for_equal_and_positive_for_different_rows() {
        let a = [1.0f32, 2.0, 3.0, -1.0];
        let b = [3.0f32, 2.0, 1.0, -1.0];
        assert!(jsd(&a, &a).abs() < 1e-12);
        let d = jsd(&a, &b);
        assert!(d > 0.05 && d < std::f64::consts::LN_2, "{d}");
        assert!((jsd(&a, &b) - jsd(&b, &a)).abs() < 1e-12);
    }
}
