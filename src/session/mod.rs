//! The token loop: prefill, sample, stream, and — between two tokens — decide whether to move
//! to another rung. Everything a user sees (CLI, prompt files, the HTTP service, the
//! benchmark) is a consumer of the [`Event`]s this loop emits.
//!
//! Main types: [`Session`] (a ladder with loaded rungs and one conversation), [`Prompt`],
//! [`GenerateOptions`], [`Event`] and [`Generation`] (the summary of one answer).

mod condition;
mod control;
mod error;
mod events;
mod footprint;
mod hibernate;
mod levers;
pub mod migrate;
mod native;
mod options;
pub mod pace;
mod prepare;
pub mod prompt_file;
mod refill;
mod rest;
mod rung;
mod shadow;
mod standby;
mod switch;

pub use condition::Condition;
pub use control::{Accept, NoControl, TokenControl, TokenLogprobs, logprobs_of};
pub use error::{MigrationCause, MigrationError, MigrationStep, SessionError};
pub use events::{
    Event, FootprintSample, Generation, LeverInfo, PrepareInfo, PrepareState, StopReason, Summary,
    SwitchInfo,
};
pub use footprint::estimated_costs;
pub use levers::chat_pinned_prefix;
pub use options::{
    DEFAULT_HEAD_REREAD, DEFAULT_HURRY, DEFAULT_REFILL_CHUNK, DEFAULT_REFILL_PACE,
    DEFAULT_REFILL_WITHIN, GenerateOptions, Prompt, Research, SessionOptions, Strategy,
    refill_step,
};
pub use prepare::{CATCH_UP_STEP, SHADOW_STEP};
pub use refill::{FILL_JOIN, FillStep};
pub use rest::IdleMove;
pub use rung::{LiveRung, LoadParts, ParkedRung, StandbyRung};
pub use shadow::TREND_WINDOW;
pub use switch::SwitchMethod;
// What the server's batched loop (`molt-server`'s `batch.rs`) shares with the session's switch
// and prompt read, until it runs on this loop; not part of the embedding API.
#[doc(hidden)]
pub use native::{minus as uncovered, refresh as refresh_projected, sentences_of};
pub use refill::{PACE_PLAIN_TOKENS, RefillPace, hurry_split};
#[doc(hidden)]
pub use refill::{read_ranges_then_decode, reread_then_decode, take_chunk};
#[doc(hidden)]
pub use switch::{CachedState, CarryRoute, carry_cache, reads_sparse, recompute_ranges};

use crate::engine::{ChatMessage, ContextConfig, Sampler, Token, Utf8Stream, softmax};
use crate::ladder::Ladder;
use crate::pressure::{Budget, BudgetSource, Tick};
use crate::routes::Routes;
use crate::sched::{Decision, TenantClass, TenantView, decide_one};
use crate::transplant::select::SelectRule;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A llama.cpp model a switch let go of, held until the answer ends ([`Session::reap_rungs`]).
struct HeldModel {
    /// Dropping the last reference frees the model.
    #[allow(dead_code)]
    model: std::sync::Arc<crate::engine::Model>,
    /// What it holds, measured at its load ([`LiveRung::model_bytes`]).
    bytes: u64,
}

/// A ladder with loaded rungs and one conversation.
pub struct Session {
    ladder: Ladder,
    config: ContextConfig,
    opts: SessionOptions,
    routes: Routes,
    /// The projectors and anchors taken from the library's built-in copies ([`crate::shipped`]).
    built_in: crate::shipped::Installed,
    rungs: Vec<Option<LiveRung>>,
    /// Rungs loaded ahead with their weight pages released ([`SessionOptions::standby`]).
    standby: Vec<Option<StandbyRung>>,
    /// Measured context overheads, per rung, once a rung has been loaded.
    context_bytes: Vec<Option<u64>>,
    /// The part of each `context_bytes` measurement its speed setup accounts for (the setup's
    /// measured extra over Molt's default), so the rung's default cost is known when it is
    /// loaded again with another setup.
    measured_extra: Vec<u64>,
    /// The last `context_bytes` measurement of a load with the default's memory (no extra).
    default_context_bytes: Vec<Option<u64>>,
    /// The setting (micro-batch, repack) each rung's `context_bytes` was measured under, so a
    /// later load with the same setting skips the warm-up decode that measures it.
    measured_setting: Vec<Option<crate::speed::Setting>>,
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
    /// What the last switch, hurried ([`SessionOptions::hurry`]), left to read after its first
    /// token, in reading order: taken by the refill it starts.
    hurried: Vec<Range<usize>>,
    /// The head's positions a switch left projected onto rung `.0`, read natively in place
    /// with the next token ([`SessionOptions::head_later`]).
    head_behind: Option<(usize, Range<usize>)>,
    /// The attention mass the last prompt's final tokens gave each cached position (when
    /// [`SessionOptions::token_recompute`] selects by attention); positions after it (the
    /// answer's) count as 0.
    observed: Option<Vec<f32>>,
    /// Positions of the cache whose cells a switch projected and nothing has re-read natively
    /// since (ordered, disjoint).
    projected: Vec<Range<usize>>,
    /// The positions in `projected` hold no cell at all (a sparse read left them out,
    /// [`crate::transplant::select::Rest::LeftOut`]): they are read before a prompt or a state
    /// file is built on the cache, since nothing can attend to them.
    holes: bool,
    /// A switch's footprint sample (token index, budget), taken once the destination's first
    /// token is out: reading the process's page tables and trimming the heap took ~250 ms on
    /// a loaded 2-core machine, and belongs to no gap the user waits on.
    footprint_due: Option<(usize, u64)>,
    /// A switch up's destination loading in the background ([`SessionOptions::prepare_up`]).
    preparing: Option<prepare::Preparing>,
    /// What the finished background load cost, for the switch it prepared.
    prepared: Option<prepare::Prepared>,
    /// The conversation carried onto that destination in the background, catching up.
    carried: Option<prepare::Carried>,
    /// Why the background carry did not happen, for the switch's note.
    carry_note: Option<String>,
    /// A rung whose background load failed during the answer being generated: the answer
    /// stays where it is rather than try it again.
    prepare_failed: Option<usize>,
    /// The answer's forced switch ([`GenerateOptions::force_switch`]) has been taken (or given
    /// up): a forced switch up may wait tokens for its destination's background load.
    force_taken: bool,
    /// The budget readings that predict a fall ([`shadow`]).
    trend: shadow::Trend,
    /// What carrying a conversation onto each rung has cost in this process, to tell a shadow
    /// that could finish before the budget stops holding it from one that could not
    /// ([`shadow::CarryPace`]).
    carry_pace: Vec<shadow::CarryPace>,
    /// A pace was measured since the pace file was last written ([`pace`]).
    pace_dirty: bool,
    /// Why the pace file was not read or not written, if it was not.
    pace_note: Option<String>,
    /// The rung a shadow was last not started for because its carry would not finish in
    /// time: said once per answer.
    shadow_skipped: Option<usize>,
    /// Rungs a switch let go of, being freed off the answer's path ([`Session::reap`]).
    reapers: Vec<std::thread::JoinHandle<()>>,
    /// Models of rungs let go during the answer, freed when it ends ([`Session::reap_rungs`]).
    held_models: Vec<HeldModel>,
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
    /// Tunes the process's allocator to hand freed memory back
    /// ([`crate::pressure::return_freed_buffers_to_os`]: large blocks mapped on their own, one
    /// heap arena) — process-wide, as a runtime that gives memory back under pressure must.
    ///
    /// # Errors
    /// [`SessionError::UnknownRung`] or a load failure.
    pub fn with_options(
        ladder: Ladder,
        mut config: ContextConfig,
        start: &str,
        opts: SessionOptions,
    ) -> Result<Self, SessionError> {
        if let Some(t) = opts.token_recompute
            && t.rule == SelectRule::Residual
        {
            return Err(SessionError::RuleNotInSessions(t.rule.name()));
        }
        config.hidden_tap |= opts.research.topk_recompute.is_some();
        config.attention_tap |= opts
            .token_recompute
            .is_some_and(|t| t.rule == SelectRule::Attention);
        let current = ladder
            .rungs
            .iter()
            .position(|r| r.name() == start)
            .ok_or_else(|| SessionError::UnknownRung(start.to_string()))?;
        let n = ladder.rungs.len();
        let mut routes = Routes::new(&ladder, opts.projector_dirs.clone(), opts.variant);
        let built_in = if opts.strategy == Strategy::Molt {
            crate::shipped::install(&mut routes, &ladder, &opts.projector_dirs)
        } else {
            crate::shipped::Installed::default()
        };
        crate::pressure::return_freed_buffers_to_os();
        let anon_base = crate::pressure::process_anon_rss_bytes().unwrap_or(0);
        let mut s = Self {
            ladder,
            config,
            opts,
            routes,
            built_in,
            rungs: (0..n).map(|_| None).collect(),
            standby: (0..n).map(|_| None).collect(),
            preparing: None,
            prepared: None,
            carried: None,
            carry_note: None,
            prepare_failed: None,
            force_taken: false,
            trend: shadow::Trend::default(),
            carry_pace: vec![shadow::CarryPace::default(); n],
            pace_dirty: false,
            pace_note: None,
            shadow_skipped: None,
            reapers: Vec::new(),
            held_models: Vec::new(),
            context_bytes: vec![None; n],
            measured_extra: vec![0; n],
            default_context_bytes: vec![None; n],
            measured_setting: vec![None; n],
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
            hurried: Vec::new(),
            head_behind: None,
            observed: None,
            projected: Vec::new(),
            holes: false,
            footprint_due: None,
        };
        s.load_pace();
        s.ensure_loaded(current)?;
        s.prepare_standby();
        Ok(s)
    }

    /// The projectors and anchors this session took from the library's built-in copies (none
    /// where a file on disk came first), and the built-in files it refused.
    #[must_use]
    pub fn built_in(&self) -> &crate::shipped::Installed {
        &self.built_in
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
        // Until the new source is read, standby rungs wait cold: a first reading below what they
        // hold hot would be overshot at the first token (by ~2 GiB in the conditions run).
        if source.is_some() {
            self.cool_standby();
        }
        self.budget = source;
        self.last_budget = None;
        self.trend.clear();
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
        self.projected.clear();
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
            if !self.opts.research.keep_source
                && let Some(live) = self.rungs[old].take()
            {
                self.retire(old, live);
            }
            self.settle_standby(None);
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
    /// [`SessionError::NotIdle`] when the session is not idle, or a load failure.
    pub fn move_idle(&mut self, index: usize) -> Result<(), SessionError> {
        if index >= self.rungs.len() || index < self.home {
            return Err(SessionError::UnknownRung(index.to_string()));
        }
        if index == self.current && self.rungs[index].is_some() {
            return Ok(());
        }
        if !self.history.is_empty() || self.pending.is_some() {
            return Err(SessionError::NotIdle {
                from: self.current_rung().to_string(),
                to: self.ladder.rungs[index].name().to_string(),
            });
        }
        // After [`Session::release_idle`] nothing is loaded, the current rung included: it is
        // loaded here like any other.
        self.parked = None;
        self.ensure_loaded(index)?;
        let old = self.current;
        self.current = index;
        self.live().ctx.clear();
        if old != index
            && !self.opts.research.keep_source
            && let Some(live) = self.rungs[old].take()
        {
            self.retire(old, live);
        }
        self.settle_standby(None);
        Ok(())
    }

    /// Frees every rung of an idle session — weights, contexts (their KV pages included),
    /// standby rungs, a background load — so that it holds no model memory at all until an
    /// answer, [`Session::move_idle`] or [`Session::wake`] loads a rung again (the next answer
    /// maps the current one). What an idle service does when the budget no longer holds the
    /// rung it sits on: the conversation it held was hibernated first, so nothing is lost.
    /// Clearing a context is not enough for that: its KV pages stay resident once written.
    /// Returns whether anything was loaded.
    ///
    /// # Errors
    /// [`SessionError::NotIdle`] when the session holds a cache (hibernate or reset it first).
    pub fn release_idle(&mut self) -> Result<bool, SessionError> {
        if !self.history.is_empty() || self.pending.is_some() {
            return Err(SessionError::NotIdle {
                from: self.current_rung().to_string(),
                to: "nothing".to_string(),
            });
        }
        self.abandon_prepare(0, "the session is released", &mut |_| {});
        self.drop_refill();
        self.free_held_models(true);
        let held = self.rungs.iter().any(Option::is_some)
            || self.standby.iter().any(Option::is_some)
            || self.parked.is_some();
        for slot in &mut self.rungs {
            *slot = None;
        }
        for slot in &mut self.standby {
            *slot = None;
        }
        self.parked = None;
        self.projected.clear();
        self.pinned = 0;
        crate::pressure::trim_heap();
        Ok(held)
    }

    /// Whether no rung is loaded (after [`Session::release_idle`], until the next load).
    pub fn is_released(&self) -> bool {
        self.parked.is_none() && self.rungs.iter().all(Option::is_none)
    }

    /// The rung this session started on and never goes above.
    pub fn home_index(&self) -> usize {
        self.home
    }

    /// [`Session::retune_idle`] under `budget` (taken as the budget last read): for a caller
    /// that reads the budget itself before the first answer, to show the setup it gets.
    ///
    /// # Errors
    /// As [`Session::retune_idle`].
    pub fn retune_with(
        &mut self,
        budget: u64,
    ) -> Result<Option<crate::speed::RungSetup>, SessionError> {
        self.last_budget = Some(budget);
        self.retune_idle()
    }

    /// Loads the current rung again when the speed policy, asked now (with the budget last
    /// read), chooses another micro-batch or repack than the rung runs with ([`crate::speed`]).
    /// Only an idle session (nothing cached, nothing parked) is retuned; otherwise nothing
    /// happens. Returns the new setup when the rung was loaded again.
    ///
    /// # Errors
    /// A load failure (the rung is then not loaded; the next answer loads it again).
    pub fn retune_idle(&mut self) -> Result<Option<crate::speed::RungSetup>, SessionError> {
        if !self.history.is_empty() || self.pending.is_some() || self.is_parked() {
            return Ok(None);
        }
        let i = self.current;
        let Some(loaded) = self.rungs[i].as_ref().map(|r| r.setup) else {
            return Ok(None);
        };
        let wanted = self.speed_setup(i, 0);
        if wanted.setting == loaded.setting {
            // The same load, perhaps for another reason now (measured instead of default).
            if let Some(r) = self.rungs[i].as_mut() {
                r.setup = wanted;
            }
            return Ok(None);
        }
        self.rungs[i] = None;
        crate::pressure::trim_heap();
        self.ensure_loaded(i)?;
        self.settle_standby(self.last_budget);
        Ok(Some(wanted))
    }

    /// Loads a rung if it is not loaded.
    ///
    /// # Errors
    /// A load failure.
    pub fn ensure_loaded(&mut self, index: usize) -> Result<&mut LiveRung, SessionError> {
        if index >= self.rungs.len() {
            return Err(SessionError::UnknownRung(index.to_string()));
        }
        if self.rungs[index].is_none()
            && let Some((live, _)) = self.take_standby(index)
        {
            self.rungs[index] = Some(live);
        }
        if self.rungs[index].is_none() {
            let setup = self.speed_setup(index, 0);
            let known = self.known_context_bytes(index, setup);
            let mut live =
                LiveRung::load_known(&self.ladder.rungs[index], self.config, setup, known)?;
            self.record_load(index, &live);
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
        let Some(k) = self.opts.research.topk_recompute else {
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
            Prompt::Standalone(t) => {
                self.conversation.clear();
                self.live().model().tokenize(t, false).map_err(wrap)
            }
            Prompt::User(t) => {
                let mut conv = self.conversation.clone();
                conv.push(ChatMessage::new("user", t));
                let tokens = self
                    .live()
                    .model()
                    .tokenize_chat(&conv, true)
                    .map_err(wrap)?;
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
    pub fn generate(
        &mut self,
        prompt: &Prompt,
        opts: &GenerateOptions,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Generation, SessionError> {
        self.generate_with(prompt, opts, &mut NoControl, sink)
    }

    /// [`generate`](Self::generate) with per-answer hooks around sampling ([`TokenControl`]):
    /// reshaped logits, log-probabilities with each token, and text released (or a stop
    /// decided) by the control. [`Generation::text`] is the text the control released.
    ///
    /// # Errors
    /// As [`generate`](Self::generate).
    #[allow(clippy::too_many_lines)]
    pub fn generate_with(
        &mut self,
        prompt: &Prompt,
        opts: &GenerateOptions,
        control: &mut dyn TokenControl,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Generation, SessionError> {
        let t0 = Instant::now();
        self.cancel.store(false, Ordering::SeqCst);
        self.unpark()?;
        crate::pressure::reset_peak_rss();
        self.answer_levers.clear();
        self.stall_ms = 0.0;
        // An earlier answer that ended in an error may have left a background load behind.
        self.abandon_prepare(0, "a new answer starts", &mut |_| {});
        self.prepare_failed = None;
        self.shadow_skipped = None;
        self.force_taken = false;
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
        let mut carried_down = None;
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
            // The answer ends when the context is full, so no answer holds more than n_ctx
            // tokens of cache, whatever max_tokens says.
            let total = tokens
                .len()
                .saturating_add(opts.max_tokens)
                .min(n_ctx as usize) as u64;
            let need = costs[smallest].resident_bytes() + costs[smallest].kv_bytes(total);
            if b.bytes < need {
                return Err(SessionError::BudgetBelowSmallest {
                    budget_mib: b.bytes >> 20,
                    rung: costs[smallest].name.clone(),
                    need_mib: need >> 20,
                    tokens: total,
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
                // Down, the earlier turns' cache is carried through the switch; up (or where
                // it cannot be carried) it stays behind and the prompt is read on `to` whole.
                carried_down = self.carry_down_idle(to, &b)?;
                if carried_down.is_none() {
                    self.history.clear();
                    self.projected.clear();
                    self.pending = None;
                    self.move_idle(to)?;
                }
            }
        }
        // The rung may have been loaded before any budget was read (when the session started)
        // or under another one: now that the budget is known, an idle rung is loaded again if
        // the speed policy chooses another setup for it.
        if budget0.is_some() {
            self.retune_idle()?;
        }
        // Positions a sparse read left out and nothing has read since (an answer cancelled
        // before its end's fill, a cache parked meanwhile): the prompt could not attend to
        // them, so they are read first.
        self.fill_holes(0, sink);
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
        if let Some(info) = carried_down {
            sink(&Event::Switch(info.clone()));
            switches.push(info);
        }
        // Cells a switch projected in an earlier answer: re-read natively the ones this
        // prompt looks at before answering it.
        self.projected.retain(|r| r.start < keep);
        if let Some(r) = self.projected.last_mut() {
            r.end = r.end.min(keep);
        }
        if let Some(info) = self.refresh_projected(&tokens, keep, 0)? {
            let b = self.last_budget.unwrap_or(0);
            self.record_lever(info, 0, b, sink);
        }
        let mut stop = StopReason::Length;
        let mut stopped_by_control = false;
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
                // The rung that produced the last token: a park that resumes elsewhere is a
                // rung change like a switch, and is reported as one.
                let before = self.current;
                match self.between_tokens(i, tok, t0, opts, sink)? {
                    Between::Switched(info) => {
                        sink(&Event::Switch((*info).clone()));
                        if info.method == "molt" {
                            let kind = crate::routes::route_kind(
                                self.routes.binding(before),
                                self.routes.binding(self.current),
                            );
                            self.start_refill(kind);
                        } else {
                            self.drop_refill();
                        }
                        switches.push(*info);
                    }
                    Between::Decoded => {
                        if self.current != before {
                            let info = self.parked_switch(before, i);
                            sink(&Event::Switch(info.clone()));
                            switches.push(info);
                        }
                    }
                    Between::Cancelled => {
                        stop = StopReason::Cancelled;
                        break;
                    }
                    Between::ParkDeadline => {
                        stop = StopReason::ParkDeadline;
                        break;
                    }
                    Between::Stay => self.decode_next(tok, i, sink)?,
                    Between::Killed => {
                        killed = true;
                        stop = StopReason::Killed;
                        break;
                    }
                }
                self.history.push(tok);
            }
            let want_logprobs = control.logprobs();
            let (tok, logprobs) = {
                let live = self.live();
                let raw = live.ctx.logits();
                let mut row = raw.to_vec();
                control.shape(&mut row);
                let tok = sampler.sample(&row);
                let model = live.model();
                let lp = want_logprobs
                    .filter(|_| !model.is_eog(tok))
                    .map(|k| logprobs_of(raw, tok, k, |t| model.token_bytes(t)));
                (tok, lp)
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
            let accept = control.accept(tok, piece);
            text.push_str(&accept.emit);
            let rung = self.current_rung().to_string();
            if rungs_used.last() != Some(&rung) {
                rungs_used.push(rung.clone());
            }
            sink(&Event::Token {
                index: i,
                token: tok,
                text: accept.emit,
                rung,
                latency_ms,
                logprobs,
            });
            self.flush_footprint(sink);
            if accept.stop {
                stopped_by_control = true;
                stop = StopReason::Eos;
                break;
            }
        }
        self.flush_footprint(sink);
        // A refill still behind when the answer ends is dropped: what it re-read stays native,
        // and the next prompt re-reads the projected cells it looks at. Positions a sparse
        // read left out are read between answers ([`Session::fill_idle`], while the user reads
        // and types) or by the next prompt before it is read; with `fill_at_end`, now.
        if !killed {
            self.finish_head_behind();
        }
        self.drop_refill();
        if !killed && self.opts.fill_at_end {
            self.fill_holes(out_tokens.len(), sink);
        }
        // The models of the rungs the answer's switches let go of go now, after its last token
        // (waited for: the next answer's first tokens must not share the cores with them).
        self.free_held_models(true);
        let tail = stream.finish();
        if !stopped_by_control {
            text.push_str(&control.finish(tail));
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
        // A switch up still being prepared is not carried into the next answer (its budget
        // may be another): drop it, and say so before the answer's end.
        self.abandon_prepare(
            generation.tokens.len(),
            "the answer ended before the destination was ready",
            sink,
        );
        // A rung let go of is freed by the time the answer is done.
        self.join_reaper();
        sink(&Event::Done(generation.summary()));
        // After the answer, off every token's path: keep what the carries cost, and load
        // ahead what a switch down would need.
        self.save_pace();
        self.prepare_standby();
        Ok(generation)
    }

    /// A boundary the policy stays at, running: the shadow is tended (see `shadow`) and the
    /// switch down it prepared is taken when it says so.
    fn stay_tending_shadow(
        &mut self,
        tok: Token,
        i: usize,
        b: Budget,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Between, SessionError> {
        if let Some(to) = self.tend_shadow(i, b.bytes, sink)? {
            // `switch_to` settles the standby rungs under `b` itself.
            let info = self.switch_to(to, tok, i, Some(b))?;
            self.footprint_due = Some((i, b.bytes));
            return Ok(Between::Switched(Box::new(info)));
        }
        self.settle_standby(Some(b.bytes));
        Ok(Between::Stay)
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
            && (i == at
                || (i > at
                    && (self.opts.research.forced_up_waits
                        || self.opts.research.forced_down_waits)))
            && !self.force_taken
            && to < self.rungs.len()
        {
            // A forced switch is taken at its token; with `forced_up_waits`, a forced switch up,
            // as the policy's, waits for its destination's background load (the budget is not
            // read meanwhile, as it is not at the forced token itself), and is given up if that
            // load fails.
            let waits = if to > self.current {
                self.opts.research.forced_down_waits
            } else {
                self.opts.research.forced_up_waits
            };
            let ready = if to == self.current {
                None
            } else if !waits {
                Some(true)
            } else {
                match self.prepare_ready(to, i, None, sink)? {
                    prepare::Readiness::Now => Some(true),
                    prepare::Readiness::Wait if self.prepare_failed == Some(to) => None,
                    prepare::Readiness::Wait => Some(false),
                }
            };
            match ready {
                Some(false) => return Ok(Between::Stay),
                Some(true) => {
                    self.force_taken = true;
                    let info = self.switch_to(to, tok, i, None)?;
                    self.footprint_due = Some((i, self.last_budget.unwrap_or(0)));
                    return Ok(Between::Switched(Box::new(info)));
                }
                None => self.force_taken = true,
            }
        }
        // A forced switch holds for the rest of the answer: the policy may still move down when
        // the budget demands it, but not straight back up (which would undo the force at the
        // next token).
        let forced_hold = opts.force_switch.is_some_and(|(at, _)| i > at);
        // When this wait began (the stall event is sent once, then).
        let mut waited: Option<Instant> = None;
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
            self.trend.push(Instant::now(), b.bytes);
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
            let decision = decide_one(&view, b.bytes, &costs, &self.opts.policy)?;
            if self.opts.strategy == Strategy::Never {
                let over = costs[self.current].resident_bytes()
                    + costs[self.current].kv_bytes(self.history.len() as u64 + 1)
                    > b.bytes;
                return Ok(if over { Between::Killed } else { Between::Stay });
            }
            // A switch prepared in the background stays wanted while the policy goes on asking
            // for it: moving up to it, or, for a shadow of a switch down, staying, moving down
            // to it, or moving up into a falling budget (which waits).
            if let Some(t) = self.prepare_target() {
                let keep = match decision {
                    // A move up held back by the fall (see `shadow`) keeps the shadow.
                    Decision::Promote { to } => {
                        t < self.current || (t > self.current && self.falling_below(to))
                    }
                    Decision::Stay | Decision::Admit { .. } => t > self.current,
                    Decision::Demote { to } => t == to && t > self.current,
                    _ => false,
                };
                if !keep {
                    let why = if t < self.current {
                        format!(
                            "the budget {} MiB no longer moves the answer up",
                            b.bytes >> 20
                        )
                    } else {
                        format!(
                            "the budget {} MiB asks for another move than the switch down prepared",
                            b.bytes >> 20
                        )
                    };
                    self.abandon_prepare(i, &why, sink);
                }
            }
            let acted = match decision {
                Decision::Stay | Decision::Admit { .. } => {
                    if !parked {
                        return self.stay_tending_shadow(tok, i, b, sink);
                    }
                    false
                }
                Decision::Promote { .. } if forced_hold && !parked => {
                    self.abandon_prepare(i, "a forced switch holds the answer's rung", sink);
                    self.settle_standby(Some(b.bytes));
                    return Ok(Between::Stay);
                }
                // No move up into a budget that is falling below the destination (see
                // `shadow`).
                Decision::Promote { to } if !parked && self.falling_below(to) => {
                    if self.prepare_target().is_some_and(|t| t < self.current) {
                        self.abandon_prepare(
                            i,
                            "the budget is falling below the destination",
                            sink,
                        );
                    }
                    // The fall that holds the move up back may bring the switch down: the
                    // shadow is tended as at any boundary the policy stays at.
                    return self.stay_tending_shadow(tok, i, b, sink);
                }
                // Memory came back: load the destination in the background and stay on this
                // rung until it is ready (see `prepare`).
                Decision::Promote { to }
                    if !parked
                        && self.prepare_ready(to, i, Some(b.bytes), sink)?
                            == prepare::Readiness::Wait =>
                {
                    self.settle_standby(Some(b.bytes));
                    return Ok(Between::Stay);
                }
                Decision::Demote { to } | Decision::Promote { to } => {
                    if !parked {
                        // A shadow of this switch down still carrying is waited for, the
                        // source freed first (see `shadow`).
                        self.land_shadow(to, i, Some(b.bytes), sink)?;
                        let info = self.switch_to(to, tok, i, Some(b))?;
                        self.footprint_due = Some((i, b.bytes));
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
                        self.footprint_due = Some((i, b.bytes));
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
            let deadline = self.opts.park_deadline;
            let waiting_since = *waited.get_or_insert_with(|| {
                sink(&Event::Stall {
                    reason: format!(
                        "budget {} MiB is below every rung's footprint; parked on {}, waiting for memory{}",
                        b.bytes >> 20,
                        // Where the cache is: the rung the answer would resume on if memory
                        // returned now.
                        self.ladder.rungs[self.parked.as_ref().map_or(self.current, |p| p.layout)]
                            .name(),
                        deadline.map_or(String::new(), |d| format!(
                            " for up to {:.0} s",
                            d.as_secs_f64()
                        ))
                    ),
                    deadline_ms: deadline.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                });
                Instant::now()
            });
            let past_deadline = deadline.is_some_and(|d| waiting_since.elapsed() >= d);
            if self.cancel.load(Ordering::SeqCst) || past_deadline {
                if let Some(p) = self.parked.as_ref() {
                    self.stall_ms += p.since.elapsed().as_secs_f64() * 1e3;
                }
                return Ok(if past_deadline {
                    Between::ParkDeadline
                } else {
                    Between::Cancelled
                });
            }
            std::thread::sleep(PARK_POLL);
        }
    }

    /// Sends the footprint sample a switch left due ([`Session::footprint_due`]), after
    /// returning the freed heap to the operating system.
    fn flush_footprint(&mut self, sink: &mut dyn FnMut(&Event)) {
        if let Some((at, budget)) = self.footprint_due.take() {
            self.join_reaper();
            crate::pressure::trim_heap();
            sink(&Event::Footprint(self.footprint_sample(at, budget)));
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
    /// Parked past the park deadline: the answer ends, the session stays parked.
    ParkDeadline,
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
