//! Continuous batching: the engine thread's loop when several answers run at once. Every
//! running request is a *tenant*: a sequence of one [`BatchContext`] on the current rung, and
//! all of them advance together, one `llama_decode` per step.
//!
//! # A step, as data flows
//!
//! 1. Tenants whose clients left are removed (their sequence freed); the others go on.
//! 2. Waiting requests join while a sequence is free and the budget holds the current rung
//!    with every running tenant's whole length (prompt + `max_tokens`) plus theirs — the
//!    memory rule counts the KV of every sequence. An engine with no tenant starts the next
//!    request on the largest rung the budget holds for it, as the one-at-a-time loop does
//!    (waiting, deferred, while not even the smallest rung holds it).
//! 3. The budget is read. When the current rung no longer holds what the tenants' caches
//!    take, *every* tenant is carried to the largest rung that does: its sequence exported
//!    alone, projected by the route's projector (the library's transplant path,
//!    [`project_blob`]) and imported into a sequence of the destination's context; a tenant
//!    whose route has no projector re-reads its history there instead. Each tenant's stream
//!    gets its own switch event. A forced switch (`molt.switch_at`) moves the whole batch
//!    the same way. When no rung holds them all, the scheduler's plan ([`molt::sched::plan`],
//!    with every running answer on one rung and a parked cache in a file; this loop is its
//!    one actuator, and the `QoS` bench measures it) sets the least protected aside — background first, then the lower priority —
//!    their caches written under the state directory, so the others go on on the largest rung
//!    that holds them ([`aside`]); the plan resumes them when memory returns. When it keeps
//!    none running, the tenants wait (a stall event) until memory comes back or their
//!    clients leave.
//! 4. One batch is built: the pending token of every tenant that is answering, plus one
//!    chunk (at most [`PREFILL_CHUNK`] tokens) of one newcomer's prompt — so a newcomer's
//!    prefill delays the others' next token by one chunk at most — and decoded in one call.
//! 5. Each tenant whose input is complete samples its next token from its own logits with its
//!    own sampler and request control (stop strings, penalties, grammar, log-probabilities),
//!    and streams it. A finished answer leaves: its sequence is freed at once, and a waiting
//!    request can take it at the next step.
//!
//! Between requests, as in the one-at-a-time loop ([`super::worker`]): a finished answer's
//! sequence stays in the context ([`Kept`]) while no request needs its place, so a
//! conversation's next turn takes it over and re-reads only the new turn, and a newcomer whose
//! prompt begins as a kept one's does takes those cells. A kept conversation whose place is
//! needed (a free sequence, cells, memory, or a rung change) is hibernated to its state file
//! (`--state-dir`) through the same store as the serial loop's, and woken from it by its next
//! turn. A waiting request deferred for memory is told so with the serial loop's notice
//! ([`Shared::still_deferred`]), and requests the budget holds go ahead of it. A batch no rung
//! holds parks (its stall event names the rung and the park deadline), answers parked past the
//! deadline end with `park_deadline`, and when memory returns the batch resumes on the largest
//! rung that holds it, a switch for every answer. An engine with no tenant (idle, or waiting
//! with a deferred request) follows a falling budget as the serial loop does: when the budget
//! no longer holds its rung with the conversations kept in it, they go to their state files
//! and the rung is freed (`follow_budget_idle`); the next request loads the largest rung that
//! then holds it.
//!
//! A state file written on a rung the batch does not run on (the budget no longer holds it)
//! is carried onto the batch's rung through the switch, as the serial loop's session does
//! (`Engine::carry_file`): the file's rung is not loaded, and the next turn re-reads only
//! itself.
//!
//! What still differs from the serial loop: a parked batch keeps its rung's weights loaded
//! (the serial loop releases them); kept conversations are hibernated only when displaced or
//! when the idle budget no longer holds them, so several can be kept at once where the serial
//! loop keeps one.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::control::RequestControl;
use super::conversations::JobConversation;
use super::error::ApiError;
use super::worker::{Deferral, IDLE_POLL, Job, Next, Shared, Update};
use molt::engine::{
    BatchContext, ChatMessage, Context, ContextConfig, EngineError, Model, ModelOptions, Sampler,
    SeqChunk, SeqId, SeqSpan, Token, Utf8Stream,
};
use molt::ladder::Ladder;
use molt::pressure::{Budget, BudgetSource, Tick};
use molt::routes::{RouteKind, Routes, route_kind};
use molt::sched::RungCost;
use molt::session::migrate::{Exported, SwitchTimings, prefill_flops, switch_flops};
use molt::session::{
    CachedState, CarryRoute, Event, Generation, LeverInfo, Prompt, Session, SessionError,
    SessionOptions, StopReason, Strategy, SwitchInfo, SwitchMethod, TokenControl, carry_cache,
    logprobs_of, refresh_projected, sentences_of,
};
use molt::speed::RungSetup;
use molt::state::{StateFile, StateMeta, now_unix_ms};
use molt::transplant::anchor::Anchor;
use molt::transplant::projector::Projector;
use molt::transplant::select::SelectRule;

mod aside;

/// The most prompt tokens one step carries: a newcomer's prefill delays the running answers'
/// next token by at most this many tokens' compute.
pub const PREFILL_CHUNK: usize = 64;

/// How often a stalled batch (no rung holds it) re-reads the budget.
const STALL_POLL: Duration = Duration::from_millis(50);

/// The rung the batch runs on: its model and the context holding every tenant's sequence,
/// and the sequences answered requests left behind.
struct Engine {
    rung: usize,
    ctx: BatchContext,
    /// KV bytes per cell on this rung (what a kept sequence costs).
    kv_per_token: u64,
    /// The rung file's sha256 (a state file names the rung that wrote it).
    sha256: String,
    /// Cells a switch projected may be built on: the projected ones a prompt attends to are
    /// re-read first ([`SessionOptions::token_recompute`] by attention), as the session does.
    refreshable: bool,
    /// Oldest first.
    kept: Vec<Kept>,
    /// The micro-batch and repack it was loaded with ([`molt::speed`]), and the memory that
    /// adds above Molt's default setup: counted in what the rung needs while it is loaded
    /// ([`Ladders::need_on`]).
    setup: RungSetup,
}

/// A finished answer's sequence left in the context, as the one-at-a-time loop keeps its
/// session's cache: the next request whose prompt begins with its tokens (a conversation's
/// next turn, or the same system prompt) takes the sequence over and reads only what follows.
/// A cache with cells a switch projected is kept only when they can be refreshed before a
/// prompt is answered on them (`Engine::refreshable`); otherwise it is not built on (see the
/// worker's `choose_start` for what that was seen to do).
struct Kept {
    seq: SeqId,
    tokens: Vec<Token>,
    conversation: String,
    /// Its state file was written when its answer ended (see `keep_or_free`).
    persisted: bool,
    /// Positions whose cells a switch projected and nothing has re-read since.
    projected: Vec<Range<usize>>,
}

/// `projected` cut to the first `n` positions (what a prompt reusing `n` cells inherits).
fn cut(projected: &[Range<usize>], n: usize) -> Vec<Range<usize>> {
    projected
        .iter()
        .filter(|r| r.start < n)
        .map(|r| r.start..r.end.min(n))
        .collect()
}

impl Engine {
    /// Cells the kept sequences hold.
    fn kept_cells(&self) -> u64 {
        self.kept.iter().map(|k| k.tokens.len() as u64).sum()
    }

    /// Frees the kept sequence that goes first — a background conversation's before a
    /// foreground one's, then the lower priority, the oldest among equals; false when none is
    /// kept.
    fn let_go_next(&mut self, shared: &Shared) -> bool {
        if self.kept.is_empty() {
            return false;
        }
        // Background conversations' caches go first, then the lower priority; the oldest
        // among equals (`kept` is in the order the answers ended).
        let i = (0..self.kept.len())
            .min_by_key(|&i| shared.conversations.let_go_rank(&self.kept[i].conversation))
            .unwrap_or(0);
        let Kept {
            seq,
            tokens,
            conversation: id,
            persisted,
            projected,
        } = self.kept.remove(i);
        // The conversation's cache goes to its state file (or stays in RAM when the write
        // fails), as the one-at-a-time loop hibernates the conversation it displaces; a file
        // written when its answer ended is not written again.
        if !(persisted
            && shared
                .conversations
                .hibernate_persisted(&id, &shared.recorder))
        {
            // As the session hibernates: a file carries no record of projected cells, so a
            // cache holding some is not written (the conversation is re-read).
            let snapshot = if projected.is_empty() {
                self.state_file(shared, seq, tokens, &id).map(Some)
            } else {
                Ok(None)
            };
            shared
                .conversations
                .hibernate(&id, snapshot, &shared.recorder);
        }
        self.ctx.remove_seq(seq);
        true
    }

    /// `seq`'s cache, holding `tokens` of conversation `id`, as a state file.
    fn state_file(
        &self,
        shared: &Shared,
        seq: SeqId,
        tokens: Vec<Token>,
        id: &str,
    ) -> Result<StateFile, molt::engine::EngineError> {
        let blob = self.ctx.export_seq(seq)?;
        Ok(state_file(
            shared,
            self.ctx.model().name(),
            &self.sha256,
            self.ctx.config().n_ctx,
            tokens,
            id,
            blob,
        ))
    }

    /// Wakes `job`'s conversation from its state file (or RAM copy) into `seq`, replacing
    /// what `seq` holds: on this rung as written, or — a file of another rung — carried here
    /// through the switch ([`Self::carry_file`]). The prompt tokens the woken cache holds (0
    /// when the file was refused, the conversation then re-read from its messages) and the
    /// positions left projected; `None`, `seq` untouched, when the conversation has neither
    /// file nor RAM copy.
    fn wake(
        &mut self,
        shared: &Shared,
        l: &Ladders,
        job: &JobConversation,
        seq: SeqId,
        tokens: &[Token],
    ) -> Option<(usize, Vec<Range<usize>>)> {
        let rung = self.ctx.model().name().to_string();
        let mut file_tokens = Vec::new();
        let mut projected = Vec::new();
        let mut tried = false;
        let woken = shared.conversations.wake(job, &shared.recorder, |f| {
            tried = true;
            if f.meta.rung == rung {
                self.ctx
                    .import_seq(seq, &f.blob)
                    .map_err(|e| e.to_string())?;
            } else {
                projected = self.carry_file(l, f, seq)?;
            }
            let want = f.meta.pos_start as usize + f.meta.tokens.len();
            match self.ctx.n_past(seq) {
                Some(n) if n == want && f.meta.pos_start == 0 => {
                    file_tokens.clone_from(&f.meta.tokens);
                    Ok(rung.clone())
                }
                n => Err(format!(
                    "the blob holds {} positions, the file's tokens end at {want}",
                    n.unwrap_or(0)
                )),
            }
        });
        let held = match woken {
            Some(_) => file_tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(tokens.len().saturating_sub(1)),
            None => 0,
        };
        if !tried {
            return None;
        }
        if self.ctx.truncate(seq, held).is_err() || held == 0 {
            let _ = self.ctx.truncate(seq, 0);
            return Some((0, Vec::new()));
        }
        let projected = projected
            .into_iter()
            .filter(|r| r.start < held)
            .map(|r| r.start..r.end.min(held))
            .collect();
        Some((held, projected))
    }

    /// Carries a state file written on another rung into `seq` as a switch carries a
    /// tenant's cache ([`Carry::carry`]): projected onto this rung, the head re-read
    /// natively, on a size route the positions a switch re-reads; the file's rung is not
    /// loaded. The positions left projected, or why it could not.
    fn carry_file(
        &mut self,
        l: &Ladders,
        f: &StateFile,
        seq: SeqId,
    ) -> Result<Vec<Range<usize>>, String> {
        let from = l
            .ladder
            .rungs
            .iter()
            .position(|r| r.name() == f.meta.rung)
            .ok_or_else(|| format!("written on rung {}, not in this ladder", f.meta.rung))?;
        if f.meta.pos_start != 0 {
            return Err(format!(
                "written on rung {} from position {}: only a cache from position 0 is carried to {}",
                f.meta.rung,
                f.meta.pos_start,
                l.name(self.rung)
            ));
        }
        let (projector, anchor, kind) = {
            let mut r = l.routes.borrow_mut();
            let p = r
                .get(from, self.rung)
                .map_err(|e| format!("written on rung {}; carrying it here: {e}", f.meta.rung))?;
            let a = if l.opts.head_reread == 0 {
                None
            } else {
                r.anchor(self.rung).ok().flatten()
            };
            (p, a, route_kind(r.binding(from), r.binding(self.rung)))
        };
        let mut ctx = l
            .scratch(self.ctx.model(), false)
            .map_err(|e| e.to_string())?;
        let route = CarryRoute {
            kind,
            projector: &projector,
            anchor: anchor.as_deref(),
        };
        let cache = CachedState {
            exported: Exported {
                blob: &f.blob,
                n_past: f.meta.tokens.len(),
                from: &f.meta.rung,
                export_ms: 0.0,
            },
            history: &f.meta.tokens,
            observed: None,
            pending: f.meta.pending,
        };
        let (_, projected) =
            carry_cache(&l.opts, &route, &cache, &mut ctx).map_err(|e| e.to_string())?;
        let state = ctx.export_state().map_err(|e| e.to_string())?;
        drop(ctx);
        self.ctx
            .import_seq(seq, &state)
            .map_err(|e| e.to_string())?;
        Ok(projected)
    }

    /// Frees every kept sequence (the rung is about to change).
    fn let_go_all(&mut self, shared: &Shared) {
        while self.let_go_next(shared) {}
    }

    /// Frees the engine: its kept conversations go to their state files, then its rung —
    /// weights, context and KV pages — and the freed heap goes back to the system.
    fn free(mut self, shared: &Shared) {
        self.let_go_all(shared);
        drop(self);
        molt::pressure::trim_heap();
    }

    /// A sequence for a prompt of `tokens` of `conversation`: the conversation's own kept
    /// sequence, rewound to the prefix it shares with the prompt (taken over: `true`); else a
    /// free one, letting kept sequences go (background first, see `let_go_next`) while none is free or the cells would
    /// not hold `cells` more, given the longest prefix any kept sequence shares with the
    /// prompt (its cells tagged, not copied). Either way at most all but the prompt's last
    /// token, whose logits start the answer. The sequence, the prompt tokens it holds already,
    /// whether it was the conversation's own, and which of those positions a switch projected.
    fn seq_for(
        &mut self,
        shared: &Shared,
        conversation: Option<&str>,
        tokens: &[Token],
        cells: u64,
    ) -> Option<(SeqId, usize, bool, Vec<Range<usize>>)> {
        let most = tokens.len().saturating_sub(1);
        let shares = |k: &Kept| {
            k.tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(most)
        };
        if let Some(i) = self
            .kept
            .iter()
            .position(|k| conversation == Some(k.conversation.as_str()))
        {
            let k = self.kept.remove(i);
            let n = shares(&k);
            if self.ctx.truncate(k.seq, n).is_ok() {
                return Some((k.seq, n, true, cut(&k.projected, n)));
            }
            self.ctx.remove_seq(k.seq);
        }
        let n_ctx = u64::from(self.ctx.config().n_ctx);
        while self.ctx.active() >= self.ctx.max_seqs()
            || self.ctx.cells_used() as u64 + cells > n_ctx
        {
            if !self.let_go_next(shared) {
                break;
            }
        }
        let seq = self.ctx.add_seq()?;
        let best = self
            .kept
            .iter()
            .enumerate()
            .map(|(i, k)| (shares(k), k.seq, i))
            .filter(|&(n, _, _)| n > 0)
            .max();
        if let Some((n, src, i)) = best
            && self.ctx.share_prefix(src, seq, n).is_ok()
        {
            return Some((seq, n, false, cut(&self.kept[i].projected, n)));
        }
        Some((seq, 0, false, Vec::new()))
    }
}

/// A state file of conversation `id` whose cache `blob` (one sequence's llama.cpp state)
/// holds `tokens` on rung `rung` (file sha256 `sha256`) with an `n_ctx` window.
fn state_file(
    shared: &Shared,
    rung: &str,
    sha256: &str,
    n_ctx: u32,
    tokens: Vec<Token>,
    id: &str,
    blob: Vec<u8>,
) -> StateFile {
    let first_turn_len = shared.conversations.first_turn_len(id).min(tokens.len());
    StateFile {
        meta: StateMeta {
            conversation: id.to_string(),
            rung: rung.to_string(),
            rung_sha256: sha256.to_string(),
            n_ctx,
            tokens,
            pos_start: 0,
            pending: None,
            first_turn_len,
            pinned: 0,
            messages: Vec::new(),
            written_unix_ms: now_unix_ms(),
        },
        blob,
    }
}

/// A tenant's refill in progress: the next position to re-read, the positions re-read so far,
/// the positions a step re-reads ([`SessionOptions::refill_step`]) and the time of the steps
/// that carried them (every tenant's tokens of those steps included).
#[derive(Debug, Clone, Copy)]
struct Refill {
    next: usize,
    done: usize,
    step: usize,
    ms: f64,
}

/// One running request.
struct Tenant {
    job: Job,
    control: RequestControl,
    seq: SeqId,
    /// What must be decoded before the next token is sampled: the prompt (or, after a switch
    /// without a projector, the whole history), then the token sampled last.
    feed: Vec<Token>,
    /// How much of `feed` is decoded.
    fed: usize,
    /// Tokens in the sequence's cache, in order (re-read when a switch cannot project).
    cached: Vec<Token>,
    prompt_tokens: usize,
    /// Prompt tokens taken from another sequence's cells instead of being read.
    reused: usize,
    started: bool,
    /// When the batch parked with this answer in it (no rung held them all), if it is parked.
    parked_since: Option<Instant>,
    /// Positions of its cache whose cells a switch projected and nothing has re-read since.
    projected: Vec<Range<usize>>,
    /// The positions in `projected` hold no cell (a sparse read left them out): a cache
    /// still holding some when its answer ends is not built on.
    holes: bool,
    /// After a Molt switch down a size route: the refill re-reading its history in place, a
    /// chunk in the batch of each step ([`SessionOptions::refill_chunk`]); `None` when none
    /// runs.
    refill: Option<Refill>,
    /// The attention mass the prompt's last tokens gave each position when it was read (the
    /// session's `observed`): what a size switch's token recompute selects by. Read at the
    /// first switch that needs it when the prompt was read in a batch (no attention tap).
    observed: Option<Vec<f32>>,
    sampler: Sampler,
    stream: Utf8Stream,
    out: Vec<Token>,
    text: String,
    t0: Instant,
    last: Instant,
    ttft_ms: f64,
    rungs_used: Vec<String>,
    switches: Vec<SwitchInfo>,
    stall_ms: f64,
}

impl Tenant {
    fn emit(&self, shared: &Shared, e: Event) {
        shared.recorder.session(&self.job.id, &e);
        let _ = self.job.tx.send(Update::Session(e));
    }

    /// Cells its sequence will hold once its answer is complete (what admission reserved).
    fn reserved(&self, n_ctx: u32) -> u64 {
        (self.prompt_tokens.saturating_add(self.job.opts.max_tokens) as u64).min(u64::from(n_ctx))
    }

    /// Cells its sequence holds after the next step.
    fn holding(&self) -> u64 {
        (self.cached.len() + self.feed.len() - self.fed) as u64
    }
}

/// What the loop keeps of the session it was started with: the ladder, the measured costs and
/// the routes. The session itself (its single-sequence context) is dropped.
struct Ladders {
    ladder: Ladder,
    config: ContextConfig,
    costs: Vec<RungCost>,
    /// Borrowed mutably where a projector or anchor is read (they load once, then are shared).
    routes: std::cell::RefCell<Routes>,
    home: usize,
    slots: u32,
    /// How long an answer may stay parked (the session option of the same name).
    park_deadline: Option<Duration>,
    /// The session's options: a switch re-reads the head and recomputes tokens as the
    /// session's does.
    opts: SessionOptions,
    /// Whether answers are set aside for more protected ones (`ServerConfig::set_aside`).
    set_aside: bool,
    /// Whether a parked answer resuming on a model of another size is carried through the
    /// switch rather than re-read there (`ServerConfig::carry_on_resume`).
    carry_on_resume: bool,
    /// Until when answers are not set aside for memory (a set-aside cache could not be
    /// written: see `aside::set_aside`).
    no_aside_until: std::cell::Cell<Option<Instant>>,
}

impl Ladders {
    /// What rung `rung` needs with `tokens` cells cached, loaded with Molt's default setup
    /// (a rung loaded with another, see [`Ladders::need_on`]).
    fn need(&self, rung: usize, tokens: u64) -> u64 {
        let c = &self.costs[rung];
        c.resident_bytes() + c.kv_bytes(tokens)
    }

    /// What the loaded engine needs with `tokens` cells cached: its rung and what its setup
    /// adds (repacked weights are a copy in anonymous memory beside the mapped file).
    fn need_on(&self, e: &Engine, tokens: u64) -> u64 {
        self.need(e.rung, tokens) + e.setup.extra_bytes
    }

    /// Loads rung `rung` with the setup the speed policy chooses ([`molt::speed`]): within
    /// what `budget` leaves above the rung with a full window at the default setup, as a
    /// session's load does; the default when no budget has been read (`None`). The batch is
    /// what decodes, so it runs with the setup a single answer on that rung would get.
    fn load(&self, rung: usize, budget: Option<u64>) -> Result<Engine, SessionError> {
        let info = &self.ladder.rungs[rung];
        let wrap = |source| SessionError::Engine {
            rung: info.name().to_string(),
            source,
        };
        let spare = budget.map(|b| b.saturating_sub(self.need(rung, u64::from(self.config.n_ctx))));
        let setup = self
            .opts
            .speed
            .choose(info.name(), self.config.n_ubatch, spare);
        let opts = ModelOptions {
            mmap: true,
            repack: setup.setting.repack,
        };
        let config = ContextConfig {
            n_ubatch: setup.setting.n_ubatch,
            ..self.config
        };
        let model = Model::load(&info.path, info.name(), opts).map_err(wrap)?;
        let ctx = BatchContext::new(model, config, self.slots).map_err(wrap)?;
        Ok(Engine {
            rung,
            ctx,
            kv_per_token: self.costs[rung].kv_bytes_per_token,
            sha256: info.sha256.clone(),
            refreshable: self.refreshable(),
            kept: Vec::new(),
            setup,
        })
    }

    /// Whether `job` joins the batch on `e` whose other answers reserve `reserved` cells:
    /// the window holds every answer whole, and `budget` the rung with all of them.
    fn joins(&self, e: &Engine, reserved: u64, job: &Job, budget: u64) -> bool {
        let total = reserved + job_cells(job, self.config.n_ctx);
        total <= u64::from(self.config.n_ctx) && self.need_on(e, total) <= budget
    }

    fn name(&self, rung: usize) -> &str {
        self.ladder.rungs[rung].name()
    }

    /// Whether projected cells are refreshed before a prompt is answered on them (the
    /// session's `cache_is_trustworthy` rule).
    fn refreshable(&self) -> bool {
        self.opts
            .token_recompute
            .is_some_and(|t| t.rule == SelectRule::Attention)
    }

    /// A single-sequence context over `model` for the work the batch's own context cannot
    /// do (it has no attention tap, and the session's switch and refresh run on a
    /// [`Context`]): created when needed, freed when done.
    fn scratch(&self, model: &Arc<Model>, attention_tap: bool) -> Result<Context, EngineError> {
        let config = ContextConfig {
            attention_tap,
            hidden_tap: false,
            ..self.config
        };
        Context::new(Arc::clone(model), config)
    }
}

/// What the batched loop is asked to do beyond the session's options.
#[derive(Debug, Clone, Copy)]
pub struct BatchOptions {
    /// Answers decoded together (`ServerConfig::parallel`).
    pub slots: usize,
    /// `ServerConfig::set_aside`.
    pub set_aside: bool,
    /// `ServerConfig::carry_on_resume`.
    pub carry_on_resume: bool,
}

/// The engine thread's loop with up to `o.slots` answers decoded together; returns when the
/// queue is closed. `settled` is told once the first rung is loaded (the server's start waits
/// for it).
pub fn run(
    mut session: Session,
    shared: &Shared,
    o: BatchOptions,
    settled: tokio::sync::oneshot::Sender<()>,
) {
    let slots = u32::try_from(o.slots.max(1)).unwrap_or(u32::MAX);
    let opts = session.options().clone();
    let ladder = session.ladder().clone();
    let routes = std::mem::replace(
        session.routes_mut(),
        Routes::new(&ladder, opts.projector_dirs.clone(), opts.variant),
    );
    let mut config = session.config();
    // Room for every tenant's pending token beside one newcomer's chunk.
    config.n_batch = config
        .n_batch
        .max(u32::try_from(PREFILL_CHUNK).unwrap_or(u32::MAX) + slots);
    let l = Ladders {
        costs: session.rung_costs(),
        home: session.home_index(),
        config,
        ladder,
        routes: std::cell::RefCell::new(routes),
        slots,
        park_deadline: opts.park_deadline,
        opts: opts.clone(),
        set_aside: o.set_aside,
        carry_on_resume: o.carry_on_resume,
        no_aside_until: std::cell::Cell::new(None),
    };
    let start = session.current_index();
    drop(session);
    molt::pressure::trim_heap();
    // `None` while a park has released every rung's weights.
    let first_budget = read_budget(shared, &[]).bytes;
    let mut engine = match l.load(start, Some(first_budget)) {
        Ok(e) => Some(e),
        Err(e) => {
            fail_all_waiting(shared, &ApiError::from_session(&e));
            return;
        }
    };
    publish_engine(shared, &l, engine.as_ref(), &[]);
    let _ = settled.send(());
    let mut l = l;
    let mut tenants: Vec<Tenant> = Vec::new();
    let mut last_budget: Option<u64> = None;
    // The oldest request, waiting for memory (deferred): it goes first once memory allows.
    let mut held: Option<Held> = None;
    // Running answers set aside for more protected ones (`aside`).
    let mut aside: Vec<aside::Aside> = Vec::new();
    aside::clear_leftovers(shared);
    loop {
        if let Some(e) = engine.as_mut()
            && drop_departed(shared, e, &mut tenants)
        {
            publish_engine(shared, &l, engine.as_ref(), &tenants);
        }
        if aside::tend(shared, &l, &mut aside) {
            publish_engine(shared, &l, engine.as_ref(), &tenants);
        }
        if !aside.is_empty() {
            let b = less(read_budget(shared, &tenants), aside::in_memory(&aside));
            aside::resume(shared, &mut l, &mut engine, &mut tenants, &mut aside, b);
        }
        if held.as_ref().is_some_and(|h| h.job.cancelled()) {
            if let Some(h) = held.take() {
                skipped(shared, &h.job, "client gone while deferred");
            }
            publish_engine(shared, &l, engine.as_ref(), &tenants);
        }
        if tenants.is_empty() {
            if held.is_none() {
                // Answers set aside are looked at again every stall poll.
                let wait = if aside.is_empty() {
                    IDLE_POLL
                } else {
                    STALL_POLL
                };
                let job = match shared.queue.next(wait) {
                    Next::Job(job) => *job,
                    Next::Idle => {
                        follow_budget_idle(shared, &l, &mut engine, None);
                        continue;
                    }
                    Next::Closed if !aside.is_empty() => {
                        // Set-aside answers end by resuming, their clients leaving or their
                        // park deadline.
                        std::thread::sleep(STALL_POLL);
                        continue;
                    }
                    Next::Closed => {
                        // Shutting down: kept conversations go to their state files.
                        if let Some(e) = engine.as_mut() {
                            e.let_go_all(shared);
                        }
                        return;
                    }
                };
                if job.cancelled() {
                    skipped(shared, &job, "client gone while queued");
                    continue;
                }
                held = Some(Held {
                    job,
                    wait: Deferral::new(),
                });
            }
            let reserve = aside::in_memory(&aside);
            let (moved, t) = start_idle(shared, &l, engine.take(), &mut held, reserve);
            engine = match moved {
                Ok(e) => e,
                Err(e) => {
                    // The engine could not load a rung: nothing else can run either.
                    fail_all_waiting(shared, &e);
                    return;
                }
            };
            let Some(t) = t else {
                if let Some(h) = &held {
                    // Waiting for memory is idle time: what the engine holds follows the
                    // budget down.
                    follow_budget_idle(shared, &l, &mut engine, Some(&h.job.id));
                    std::thread::sleep(STALL_POLL);
                }
                continue;
            };
            tenants.push(t);
            last_budget = None;
        }
        let Some(running) = engine.as_mut() else {
            // Answers with no rung loaded: a tenant is admitted onto a loaded rung and a park
            // that keeps answers resumes one, so this does not happen; end them rather than
            // wait on nothing.
            let e = ApiError::internal("no rung is loaded for the running answers");
            for t in tenants.drain(..) {
                report_failed(shared, t, &e);
            }
            publish_engine(shared, &l, None, &tenants);
            continue;
        };
        let reserve = aside::in_memory(&aside);
        // A foreground request waiting while every sequence runs an answer takes a background
        // answer's sequence, that answer set aside.
        let room = less(read_budget(shared, &tenants), reserve);
        if let Some(job) = aside::make_room(shared, &l, running, &mut tenants, &mut aside, room)
            && let Some(t) = admit(shared, running, &l, job)
        {
            tenants.push(t);
            publish_batch(shared, &l, running, &tenants);
        }
        join_waiting(shared, &l, running, &mut tenants, &mut held, reserve);
        let budget = read_budget(shared, &tenants);
        if last_budget != Some(budget.bytes) {
            last_budget = Some(budget.bytes);
            let source = shared.budget.describe();
            for t in &tenants {
                t.emit(
                    shared,
                    Event::Budget {
                        bytes: budget.bytes,
                        pressure: budget.pressure,
                        source: source.clone(),
                    },
                );
            }
        }
        let fit = less(budget, reserve);
        match fit_rung(&mut l, shared, &mut engine, &mut tenants, &aside, fit) {
            Fit::Run => {}
            Fit::SetAside(which) => {
                if let Some(e) = engine.as_mut() {
                    let why = aside::Why::Memory;
                    aside::set_aside(shared, &l, e, &mut tenants, which, &mut aside, budget, &why);
                }
                continue;
            }
            Fit::Stall => {
                park_until(shared, &mut l, &mut engine, &mut tenants, fit);
                last_budget = None;
                continue;
            }
            Fit::Failed(e) => {
                for t in tenants.drain(..) {
                    match engine.as_mut() {
                        Some(en) => failed(shared, en, t, &e),
                        None => report_failed(shared, t, &e),
                    }
                }
                publish_engine(shared, &l, engine.as_ref(), &tenants);
                continue;
            }
        }
        let Some(running) = engine.as_mut() else {
            continue;
        };
        for t in &mut tenants {
            t.parked_since = None;
        }
        let before = tenants.len();
        step(shared, &l, running, &mut tenants);
        if tenants.len() != before {
            // Published before the next request is taken: one arriving after an answer ended
            // must not be told the engine is busy with it.
            publish_batch(shared, &l, running, &tenants);
        }
    }
}

/// A request that never ran because its client left.
/// What the idle engine does between jobs (and while a job waits for memory), as the
/// one-at-a-time loop does: when the budget no longer holds its rung with the conversations
/// kept in it, they go to their state files and the rung is freed — weights, context and its
/// KV pages — so the server's memory follows a falling budget down to the process's own floor
/// instead of waiting for the next request. Nothing is lost: a conversation's next request
/// wakes it from its file, and the next answer loads the largest rung the budget then holds.
/// `waiting` is the job deferred for memory meanwhile, if any: it stays published as running.
fn follow_budget_idle(
    shared: &Shared,
    l: &Ladders,
    engine: &mut Option<Engine>,
    waiting: Option<&str>,
) {
    let Ok(b) = shared.budget.read(Tick::default()) else {
        return;
    };
    let held = engine.as_ref().map_or(0, |e| l.need_on(e, e.kept_cells()));
    if held <= b.bytes {
        return;
    }
    let Some(e) = engine.take() else {
        return;
    };
    let hibernated: Vec<String> = e.kept.iter().map(|k| k.conversation.clone()).collect();
    let rung = l.name(e.rung).to_string();
    e.free(shared);
    shared.counters.released.fetch_add(1, Ordering::Relaxed);
    shared.recorder.service(
        "",
        "released",
        serde_json::json!({
            "budget_mib": super::openai::mib(b.bytes),
            "held_mib": super::openai::mib(held),
            "rung": rung,
            "hibernated": hibernated,
        }),
    );
    publish_engine(shared, l, None, &[]);
    if let Some(id) = waiting {
        shared.engine().running = Some(id.to_string());
    }
}

fn skipped(shared: &Shared, job: &Job, reason: &str) {
    shared.conversations.unqueue(job.conversation.as_ref());
    shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
    shared
        .recorder
        .service(&job.id, "skipped", serde_json::json!({ "reason": reason }));
}

/// The engine is gone: every waiting request is told why.
fn fail_all_waiting(shared: &Shared, e: &ApiError) {
    while let Some(job) = shared.queue.take_first(|_| true) {
        shared.counters.failed.fetch_add(1, Ordering::Relaxed);
        let _ = job.tx.send(Update::Failed(e.clone()));
    }
    shared.queue.close();
}

/// What the batch may take of `b`: the budget less `reserve`, the set-aside caches held in
/// memory (`aside::in_memory`).
fn less(b: Budget, reserve: u64) -> Budget {
    Budget {
        bytes: b.bytes.saturating_sub(reserve),
        ..b
    }
}

/// Cells a job's sequence holds once its answer is complete (what admission reserves), within
/// the window: the request's prompt as counted when it came, and its `max_tokens`.
fn job_cells(j: &Job, n_ctx: u32) -> u64 {
    (j.prompt_tokens.saturating_add(j.opts.max_tokens) as u64).min(u64::from(n_ctx))
}

fn read_budget(shared: &Shared, tenants: &[Tenant]) -> Budget {
    let elapsed_ms = tenants.first().map_or(0, |t| {
        u64::try_from(t.t0.elapsed().as_millis()).unwrap_or(u64::MAX)
    });
    let token_index = tenants.iter().map(|t| t.out.len()).max().unwrap_or(0) as u64;
    shared
        .budget
        .read(Tick {
            token_index,
            elapsed_ms,
        })
        .unwrap_or(Budget {
            bytes: super::budget::UNLIMITED_BYTES,
            pressure: 0.0,
            origin: molt::pressure::BudgetOrigin::Fixed,
        })
}

/// Publishes the batch's state for `GET /v1/molt/status`.
fn publish_batch(shared: &Shared, l: &Ladders, engine: &Engine, tenants: &[Tenant]) {
    // The policy's usage: the rung with every cached cell, kept or running.
    let cells = engine.kept_cells() + tenants.iter().map(Tenant::holding).sum::<u64>();
    let bytes = l.need_on(engine, cells);
    publish_rung(shared, l, engine.rung, running_ids(tenants), bytes);
    let mut e = shared.engine();
    e.setup = Some(engine.setup.to_string());
    e.setup_extra_mib = super::worker::to_mib(engine.setup.extra_bytes);
    // The loaded rung's cost with what its setup adds, as the one-at-a-time loop's status
    // shows it (its session counts the setup in the rung's measured cost).
    let extra = Some((engine.rung, engine.setup.extra_bytes));
    e.rungs = super::worker::rung_statuses(&l.costs, l.config.n_ctx, extra);
}

/// Publishes rung `rung` loaded, answering `running`, the policy counting `bytes` for it.
fn publish_rung(shared: &Shared, l: &Ladders, rung: usize, running: Option<String>, bytes: u64) {
    let mut e = shared.engine();
    e.current_rung = l.name(rung).to_string();
    e.loaded = vec![e.current_rung.clone()];
    e.running = running;
    e.modelled_bytes = bytes;
    e.released = false;
}

/// The running tenants' request ids, comma-separated, as the status lists them.
fn running_ids(tenants: &[Tenant]) -> Option<String> {
    (!tenants.is_empty()).then(|| {
        tenants
            .iter()
            .map(|t| t.job.id.as_str())
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// Publishes the batch's state whether or not a rung is loaded (`None`: a park released
/// every rung's weights; the status then lists none loaded).
fn publish_engine(shared: &Shared, l: &Ladders, engine: Option<&Engine>, tenants: &[Tenant]) {
    match engine {
        Some(e) => publish_batch(shared, l, e, tenants),
        None => {
            let mut e = shared.engine();
            e.loaded = Vec::new();
            e.setup = None;
            e.setup_extra_mib = 0.0;
            e.running = running_ids(tenants);
            // No rung and no answer: the idle engine released everything
            // (`follow_budget_idle`). A parked batch says what it holds itself
            // ([`publish_parked`]).
            if tenants.is_empty() {
                e.modelled_bytes = 0;
                e.released = true;
            }
        }
    }
}

/// Publishes a batch parked with every rung's weights released: no rung loaded, and what the
/// policy counts is what the park holds — the running answers' exported caches in host memory
/// (`held`). It went on counting the released rung with every cell (tier2's 569 MiB in a
/// `bench --serve-qos` run, 370 MiB over a 200 MiB budget for 30 s while the process stayed
/// at its floor).
fn publish_parked(shared: &Shared, l: &Ladders, tenants: &[Tenant], held: u64) {
    publish_engine(shared, l, None, tenants);
    if !tenants.is_empty() {
        let mut e = shared.engine();
        e.modelled_bytes = held;
        e.released = false;
    }
}

/// Removes tenants whose clients have gone; the others go on. True when one left.
fn drop_departed(shared: &Shared, engine: &mut Engine, tenants: &mut Vec<Tenant>) -> bool {
    let before = tenants.len();
    let mut i = 0;
    while i < tenants.len() {
        if tenants[i].job.cancelled() {
            let t = tenants.remove(i);
            finish(shared, engine, t, StopReason::Cancelled, false);
        } else {
            i += 1;
        }
    }
    tenants.len() != before
}

/// The prompt of a job as tokens of `model`.
fn prompt_tokens(model: &Model, job: &Job) -> Result<Vec<Token>, molt::engine::EngineError> {
    match &job.prompt {
        Prompt::User(text) => {
            let mut conv = job.history.clone();
            conv.push(ChatMessage::new("user", text));
            model.tokenize_chat(&conv, true)
        }
        Prompt::Text(text) | Prompt::Standalone(text) => model.tokenize(text, false),
    }
}

/// Takes `job` onto the batch as a tenant on the engine's rung (its prompt not read yet);
/// `Err` with the message for its client when it cannot run.
fn admit(shared: &Shared, engine: &mut Engine, l: &Ladders, job: Job) -> Option<Tenant> {
    let name = l.name(engine.rung).to_string();
    let tokens = match prompt_tokens(engine.ctx.model(), &job) {
        Ok(t) => t,
        Err(source) => {
            let e = SessionError::Engine { rung: name, source };
            refuse(shared, &job, &ApiError::from_session(&e));
            return None;
        }
    };
    let n_ctx = l.config.n_ctx;
    let reserve = job.opts.max_tokens.clamp(1, 16);
    if tokens.len() + reserve > n_ctx as usize {
        let e = SessionError::PromptTooLong {
            prompt_tokens: tokens.len(),
            n_ctx,
            reserve,
        };
        refuse(shared, &job, &ApiError::from_session(&e));
        return None;
    }
    let cells = (tokens.len().saturating_add(job.opts.max_tokens) as u64).min(u64::from(n_ctx));
    let conversation = job.conversation.as_ref().map(|c| c.id.as_str());
    let Some((seq, reused, own, projected)) = engine.seq_for(shared, conversation, &tokens, cells)
    else {
        refuse(shared, &job, &ApiError::internal("no free sequence"));
        return None;
    };
    // A conversation whose cache is not in the engine wakes from its state file, if any (a
    // file holds only native cells).
    let (reused, projected) = match &job.conversation {
        Some(c) if !own => match engine.wake(shared, l, c, seq, &tokens) {
            Some(woken) => woken,
            None => (reused, projected),
        },
        _ => (reused, projected),
    };
    shared.conversations.running(job.conversation.as_ref());
    let queue_ms = job.received.elapsed().as_secs_f64() * 1e3;
    shared.recorder.service(
        &job.id,
        "admitted",
        serde_json::json!({"queue_ms": queue_ms, "rung": name, "sequence": seq, "reused_tokens": reused}),
    );
    let _ = job.tx.send(Update::Admitted { queue_ms });
    let mut job = job;
    let control = std::mem::take(&mut job.control);
    let now = Instant::now();
    let mut t = Tenant {
        seq,
        sampler: Sampler::new(job.opts.sampling),
        prompt_tokens: tokens.len(),
        reused,
        cached: tokens[..reused].to_vec(),
        fed: reused,
        feed: tokens,
        started: false,
        parked_since: None,
        projected,
        holes: false,
        refill: None,
        observed: None,
        stream: Utf8Stream::new(),
        out: Vec::new(),
        text: String::new(),
        t0: now,
        last: now,
        ttft_ms: 0.0,
        rungs_used: vec![name],
        switches: Vec::new(),
        stall_ms: 0.0,
        control,
        job,
    };
    if !t.projected.is_empty() {
        read_over_projected(shared, l, engine, &mut t);
    }
    Some(t)
}

/// A prompt read over projected cells: the attention its last tokens gave each position,
/// and how many projected positions were re-read (`None`: none needed it).
type Refreshed = (Vec<f32>, Option<usize>);

/// Reads a newcomer's prompt over reused cells some of which a switch projected, as the
/// session reads a prompt over its cache: the new tokens decoded with the attention tap on
/// their last ones, the projected positions they attend to most re-read natively, and the
/// last ones read again over them ([`refresh_projected`]). The batch's context has no tap,
/// so this one prompt is read on a scratch context of the rung and its cache moved into the
/// tenant's sequence (all but the last token, which the next step decodes with the others').
/// It delays the running answers by the prompt's read, not by one chunk: the price of
/// building on a projected cache, paid only then. Anything failing makes the tenant read its
/// prompt from scratch instead, never on cells nothing refreshed.
fn read_over_projected(shared: &Shared, l: &Ladders, engine: &mut Engine, t: &mut Tenant) {
    let t0 = Instant::now();
    let keep = t.reused;
    let tokens = t.feed.clone();
    let n = tokens.len();
    let setting = l.opts.token_recompute.filter(|_| l.refreshable());
    let read = (|| -> Result<Option<Refreshed>, EngineError> {
        let Some(setting) = setting else {
            return Ok(None);
        };
        let model = Arc::clone(engine.ctx.model());
        let blob = engine.ctx.export_seq(t.seq)?;
        let mut ctx = l.scratch(&model, true)?;
        ctx.import_state(&blob)?;
        if ctx.n_past() != keep {
            return Ok(None);
        }
        let Some(mass) = ctx.decode_observed(&tokens[keep..], setting.window)? else {
            return Ok(None);
        };
        let text = sentences_of(&model, &setting, &tokens[..keep]);
        let done = refresh_projected(
            &mut ctx,
            &mut t.projected,
            &mass,
            &setting,
            &text,
            &tokens,
            keep,
        )?;
        ctx.truncate(n - 1);
        let state = ctx.export_state()?;
        engine.ctx.import_seq(t.seq, &state)?;
        if engine.ctx.n_past(t.seq) != Some(n - 1) {
            return Ok(None);
        }
        Ok(Some((mass, done)))
    })();
    match read {
        Ok(Some((mass, done))) => {
            t.cached = tokens[..n - 1].to_vec();
            t.fed = n - 1;
            t.observed = Some(mass);
            if let Some(done) = done {
                let info = LeverInfo {
                    at_token: 0,
                    lever: "refresh".into(),
                    rung: l.name(engine.rung).to_string(),
                    tokens: done,
                    cost_ms: t0.elapsed().as_secs_f64() * 1e3,
                    parked_ms: 0.0,
                    rss_before: 0,
                    rss_after: super::worker::rss_bytes(),
                    parked_kv_bytes: 0,
                    budget_bytes: 0,
                };
                t.emit(shared, Event::Lever(info));
            }
        }
        failed => {
            if let Err(e) = failed {
                eprintln!(
                    "molt serve: {}: reading the prompt over a projected cache failed ({e}); read from scratch",
                    t.job.id
                );
            }
            // Nothing refreshed the projected cells: nothing of the old cache is used.
            let _ = engine.ctx.truncate(t.seq, 0);
            (t.cached, t.fed, t.reused) = (Vec::new(), 0, 0);
            t.projected.clear();
        }
    }
}

fn refuse(shared: &Shared, job: &Job, e: &ApiError) {
    let e = &e.clone().for_prompt(&job.prompt);
    shared.conversations.unqueue(job.conversation.as_ref());
    shared.counters.failed.fetch_add(1, Ordering::Relaxed);
    shared.recorder.service(&job.id, "failed", e.json());
    let _ = job.tx.send(Update::Failed(e.clone()));
}

/// A request the engine has taken from the queue but memory does not hold yet.
struct Held {
    job: Job,
    wait: Deferral,
}

/// The next request of an idle engine: the held one once the budget holds the smallest rung
/// for it; while it does not, its client is told why it waits (the notice both loops send)
/// and a queued request the budget holds now goes first, as in the one-at-a-time loop. The
/// engine moves to the largest rung that holds the request (never above home) and admits it.
/// Gives the engine back (`Err` when a rung failed to load), with the tenant (`None` when no
/// request started: still waiting, or refused and told).
fn start_idle(
    shared: &Shared,
    l: &Ladders,
    engine: Option<Engine>,
    held: &mut Option<Held>,
    reserve: u64,
) -> (Result<Option<Engine>, ApiError>, Option<Tenant>) {
    let Some(h) = held.as_mut() else {
        return (Ok(engine), None);
    };
    let total_of = |j: &Job| job_cells(j, l.config.n_ctx);
    let smallest = l.costs.len() - 1;
    let total = total_of(&h.job);
    let need = l.need(smallest, total);
    // Set-aside caches held in memory (`reserve`) are not the newcomer's to take.
    let budget = read_budget(shared, &[]).bytes.saturating_sub(reserve);
    if budget >= need {
        let Some(Held { job, wait }) = held.take() else {
            return (Ok(engine), None);
        };
        return match start_on_best(shared, l, engine, job, budget, reserve) {
            Started::Admitted(e, t) => (e, t.map(|t| *t)),
            // The budget fell while the rung loaded: the request waits again, first in line.
            Started::Fell(e, job) => {
                *held = Some(Held { job: *job, wait });
                (e, None)
            }
        };
    }
    // Busy for the HTTP side (before its client hears it waits): a request arriving now is
    // told its place in the queue.
    shared.engine().running = Some(h.job.id.clone());
    let tokens = usize::try_from(total).unwrap_or(usize::MAX);
    let waited = shared.still_deferred(&h.job.id, &h.job.tx, &mut h.wait, budget, need, tokens);
    if let Err(e) = waited {
        if let Some(h) = held.take() {
            refuse(shared, &h.job, &e);
        }
        publish_engine(shared, l, engine.as_ref(), &[]);
        return (Ok(engine), None);
    }
    let fits = |j: &Job| l.need(smallest, total_of(j)) <= budget;
    match shared.queue.take_best(fits) {
        Some(other) => {
            shared.recorder.service(
                &other.id,
                "overtook",
                serde_json::json!({"deferred": h.job.id}),
            );
            match start_on_best(shared, l, engine, other, budget, reserve) {
                Started::Admitted(e, t) => (e, t.map(|t| *t)),
                // Back in the queue, unread, with the request it overtook still first in line.
                Started::Fell(e, other) => {
                    shared.queue.put_back(*other);
                    (e, None)
                }
            }
        }
        None => (Ok(engine), None),
    }
}

/// What [`start_on_best`] did with the request it was given.
enum Started {
    /// Admitted (`None` when refused, its client told why), or the rung failed to load.
    Admitted(Result<Option<Engine>, ApiError>, Option<Box<Tenant>>),
    /// Not admitted: the budget fell while the rung loaded and no longer holds the request on
    /// any rung; the rung is let go again and the request handed back, unread.
    Fell(Result<Option<Engine>, ApiError>, Box<Job>),
}

/// Moves the idle engine to the largest rung that holds `job` within `budget` (never above
/// home; freeing the old rung first: the two need not fit together) and admits it. While the
/// rung loads and the request is read onto it (a woken conversation carried from another
/// rung's file, its positions re-read), the status counts what that takes: it counted 0 B in
/// a `bench --serve-qos` run while the engine read a woken conversation onto q3km, 350 MiB
/// over the budget for three rounds. The budget is read again once the rung is loaded: when
/// it fell meanwhile, the engine moves down to the rung the budget now holds before reading
/// anything, and when it holds none, the request is handed back ([`Started::Fell`]).
/// `reserve`: the set-aside caches held in memory, not the newcomer's to take.
fn start_on_best(
    shared: &Shared,
    l: &Ladders,
    engine: Option<Engine>,
    job: Job,
    budget: u64,
    reserve: u64,
) -> Started {
    let total = job_cells(&job, l.config.n_ctx);
    let smallest = l.costs.len() - 1;
    let best_for = |budget: u64| {
        (l.home..l.costs.len())
            .find(|&i| l.need(i, total) <= budget)
            .unwrap_or(smallest)
    };
    let mut best = best_for(budget);
    let mut engine = engine;
    // A rung loaded for nothing is loaded at most once per rung below it.
    for _ in 0..l.costs.len() {
        if engine
            .as_ref()
            .is_some_and(|e| e.rung == best && l.need_on(e, total) <= budget)
        {
            break;
        }
        // Another rung, none loaded (a park released it), or the same rung whose setup (a
        // repacked copy) the budget no longer holds.
        let from = engine.as_ref().map(|e| l.name(e.rung).to_string());
        let reason = if engine.as_ref().is_some_and(|e| e.rung == best) {
            "the budget no longer holds the rung's speed setup"
        } else {
            "the budget picks another rung"
        };
        if let Some(e) = engine.take() {
            e.free(shared);
        }
        publish_loading(shared, l, best, &job.id, total);
        let e = match l.load(best, Some(budget)) {
            Ok(e) => e,
            Err(e) => {
                let api = ApiError::from_session(&e);
                refuse(shared, &job, &api);
                publish_engine(shared, l, None, &[]);
                return Started::Admitted(Err(api), None);
            }
        };
        shared.recorder.service(
            &job.id,
            "fresh_start",
            serde_json::json!({"from": from, "rung": l.name(best), "reason": reason}),
        );
        let now = read_budget(shared, &[]).bytes.saturating_sub(reserve);
        let fits = now >= l.need_on(&e, total);
        engine = Some(e);
        if fits {
            break;
        }
        if now < l.need(smallest, total) {
            shared.recorder.service(
                &job.id,
                "handed_back",
                serde_json::json!({"rung": l.name(best), "budget": now, "reason": "the budget fell below the smallest rung while the rung loaded"}),
            );
            if let Some(e) = engine.take() {
                e.free(shared);
            }
            publish_engine(shared, l, None, &[]);
            return Started::Fell(Ok(None), Box::new(job));
        }
        best = best_for(now);
    }
    let Some(mut engine) = engine else {
        return Started::Admitted(Ok(None), None);
    };
    publish_rung(
        shared,
        l,
        engine.rung,
        Some(job.id.clone()),
        l.need_on(&engine, total),
    );
    let t = admit(shared, &mut engine, l, job);
    publish_batch(shared, l, &engine, t.as_slice());
    Started::Admitted(Ok(Some(engine)), t.map(Box::new))
}

/// Publishes the engine loading rung `rung` and reading request `id` onto it: the rung with
/// the request's whole length counted, as the batch will be.
fn publish_loading(shared: &Shared, l: &Ladders, rung: usize, id: &str, cells: u64) {
    publish_rung(shared, l, rung, Some(id.to_string()), l.need(rung, cells));
}

/// Lets waiting requests join while a sequence is free and the budget holds the current rung
/// with every running tenant's whole length plus theirs.
fn join_waiting(
    shared: &Shared,
    l: &Ladders,
    engine: &mut Engine,
    tenants: &mut Vec<Tenant>,
    held: &mut Option<Held>,
    reserve: u64,
) {
    let mut joined = false;
    // Kept sequences do not count: a newcomer lets kept ones go (`Engine::seq_for`).
    while tenants.len() < engine.ctx.max_seqs() {
        let budget = read_budget(shared, tenants).bytes.saturating_sub(reserve);
        let reserved: u64 = tenants.iter().map(|t| t.reserved(l.config.n_ctx)).sum();
        let fits = |j: &Job| l.joins(engine, reserved, j, budget);
        // The request waiting for memory goes first when it fits; then the waiting ones by
        // class and priority (foreground first), as the one-at-a-time loop takes them.
        let first = held.take_if(|h| fits(&h.job)).map(|h| h.job);
        let Some(job) = first.or_else(|| shared.queue.take_best(fits)) else {
            break;
        };
        if let Some(t) = admit(shared, engine, l, job) {
            tenants.push(t);
            joined = true;
        }
    }
    if joined {
        publish_batch(shared, l, engine, tenants);
    }
}

enum Fit {
    /// Decode a step on the engine's rung.
    Run,
    /// No rung holds every running answer, but the scheduler's plan keeps the more protected
    /// ones running: set these (indices into the tenants) aside first.
    SetAside(Vec<usize>),
    /// No rung holds the batch: wait.
    Stall,
    /// Moving failed: every tenant ends with this error.
    Failed(ApiError),
}

/// Moves the batch when the budget (or a forced switch) says so.
fn fit_rung(
    l: &mut Ladders,
    shared: &Shared,
    engine: &mut Option<Engine>,
    tenants: &mut [Tenant],
    aside: &[aside::Aside],
    budget: Budget,
) -> Fit {
    let Some(e) = engine.as_mut() else {
        return Fit::Stall;
    };
    let forced = tenants.iter().find_map(|t| {
        let (at, to) = t.job.opts.force_switch?;
        (at == t.out.len() && t.started && t.fed == 0 && to != e.rung && to < l.costs.len())
            .then_some(to)
    });
    let to = if let Some(to) = forced {
        to
    } else {
        let holding: u64 = tenants.iter().map(Tenant::holding).sum();
        // Coming out of a park that kept the weights (a cache could not be exported), the
        // batch resumes on the largest rung memory holds again (never above home), as a
        // parked session does: a switch like any other.
        let resuming = tenants.iter().any(|t| t.parked_since.is_some());
        if resuming
            && let Some(best) =
                (l.home..l.costs.len()).find(|&i| l.need(i, holding) <= budget.bytes)
        {
            if best == e.rung && l.need_on(e, holding) <= budget.bytes {
                return Fit::Run;
            }
            return match move_all(l, shared, engine, tenants, best, budget) {
                Ok(()) => {
                    publish_engine(shared, l, engine.as_ref(), tenants);
                    Fit::Run
                }
                Err(e) => Fit::Failed(ApiError::from_session(&e)),
            };
        }
        // Kept caches go first (background first, then the oldest), before any running answer moves.
        while l.need_on(e, holding + e.kept_cells()) > budget.bytes && e.let_go_next(shared) {}
        if l.need_on(e, holding) <= budget.bytes {
            return Fit::Run;
        }
        // A rung loaded with a setup that costs more than the default's (repack) is loaded
        // again with the setup the budget now holds before the batch moves down a rung.
        let retune = e.setup.extra_bytes > 0 && l.need(e.rung, holding) <= budget.bytes;
        match (e.rung + usize::from(!retune)..l.costs.len())
            .find(|&i| l.need(i, holding) <= budget.bytes)
        {
            Some(to) => to,
            None => {
                return match aside::choose(l, shared, e.rung, tenants, aside, budget.bytes) {
                    Some(which) => Fit::SetAside(which),
                    None => Fit::Stall,
                };
            }
        }
    };
    match move_all(l, shared, engine, tenants, to, budget) {
        Ok(()) => {
            publish_engine(shared, l, engine.as_ref(), tenants);
            Fit::Run
        }
        Err(e) => Fit::Failed(ApiError::from_session(&e)),
    }
}

/// A batch no rung holds parks as the session parks (`src/session/levers.rs`): every
/// answer's cache is exported (llama.cpp's state blob of its sequence, kept in host memory),
/// the kept conversations go to their state files, and the rung — weights, context — is
/// freed, so a parked batch costs its caches and nothing else. Each answer is told once (a
/// stall naming the rung and the park deadline, in the session's words, and a `park`
/// lever). Then it waits: an answer whose client leaves, or every one once the park deadline
/// passes, ends (`park_deadline`), its conversation's cache written to its state file; when
/// the budget holds a rung again the batch resumes on the largest that holds it (never above
/// home) — on the rung it parked on, each cache imported back as it was (a `resume` lever);
/// on another, carried there as a switch carries it. Returns with the rung loaded and the
/// answers running, or with no rung loaded and no answer left. If a cache cannot be exported
/// the weights stay loaded and the batch waits on them ([`park`]).
fn park_until(
    shared: &Shared,
    l: &mut Ladders,
    engine: &mut Option<Engine>,
    tenants: &mut Vec<Tenant>,
    budget: Budget,
) {
    let Some(src) = engine.take() else {
        return;
    };
    if tenants.iter().any(|t| t.parked_since.is_some()) {
        // Already waiting with the weights loaded (below).
        let running = engine.insert(src);
        park(shared, l, running, tenants, budget);
        std::thread::sleep(STALL_POLL);
        return;
    }
    let rung = src.rung;
    let t0 = Instant::now();
    let rss_before = super::worker::rss_bytes();
    let mut scratch = Scratch::default();
    let mut exported = Vec::with_capacity(tenants.len());
    for t in tenants.iter_mut() {
        if !t.started {
            // A prompt not read whole is read again at the resume.
            exported.push(None);
            continue;
        }
        match export_for_switch(l, &src.ctx, t, &mut scratch) {
            Ok(x) => exported.push(Some(x)),
            Err(e) => {
                eprintln!(
                    "molt serve: parking on {} with the weights loaded: a cache could not be exported ({e})",
                    l.name(rung)
                );
                let running = engine.insert(src);
                park(shared, l, running, tenants, budget);
                std::thread::sleep(STALL_POLL);
                return;
            }
        }
    }
    drop(scratch);
    src.free(shared);
    let park_ms = t0.elapsed().as_secs_f64() * 1e3;
    let deadline = l.park_deadline;
    let reason = format!(
        "budget {} MiB is below every rung's footprint for the {} running answers; parked on {}, weights released, waiting for memory{}",
        budget.bytes >> 20,
        tenants.len(),
        l.name(rung),
        deadline.map_or(String::new(), |d| format!(
            " for up to {:.0} s",
            d.as_secs_f64()
        ))
    );
    let since = Instant::now();
    let rss_after = super::worker::rss_bytes();
    // Published before the answers hear of the park: a status read then lists no rung loaded.
    let held = |x: &[Option<Exportedseq>]| x.iter().flatten().map(|x| x.blob.len() as u64).sum();
    publish_parked(shared, l, tenants, held(&exported));
    for (t, x) in tenants.iter_mut().zip(&exported) {
        t.parked_since = Some(since);
        t.emit(
            shared,
            Event::Stall {
                reason: reason.clone(),
                deadline_ms: deadline.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            },
        );
        let info = lever(l, rung, t, "park", park_ms, budget.bytes);
        t.emit(
            shared,
            Event::Lever(LeverInfo {
                rss_before,
                rss_after,
                parked_kv_bytes: x.as_ref().map_or(0, |x| x.blob.len() as u64),
                ..info
            }),
        );
    }
    let mut told = budget.bytes;
    loop {
        std::thread::sleep(STALL_POLL);
        let past = deadline.is_some_and(|d| since.elapsed() >= d);
        let mut i = 0;
        while i < tenants.len() {
            tenants[i].stall_ms += STALL_POLL.as_secs_f64() * 1e3;
            let stop = if tenants[i].job.cancelled() {
                Some(StopReason::Cancelled)
            } else if past {
                Some(StopReason::ParkDeadline)
            } else {
                None
            };
            match stop {
                Some(stop) => {
                    let t = tenants.remove(i);
                    let x = exported.remove(i);
                    end_parked(shared, l, rung, t, x, stop);
                    publish_parked(shared, l, tenants, held(&exported));
                }
                None => i += 1,
            }
        }
        if tenants.is_empty() {
            return;
        }
        let b = read_budget(shared, tenants);
        if b.bytes != told {
            told = b.bytes;
            let source = shared.budget.describe();
            for t in tenants.iter() {
                t.emit(
                    shared,
                    Event::Budget {
                        bytes: b.bytes,
                        pressure: b.pressure,
                        source: source.clone(),
                    },
                );
            }
        }
        let holding: u64 = tenants.iter().map(Tenant::holding).sum();
        let Some(best) = (l.home..l.costs.len()).find(|&i| l.need(i, holding) <= b.bytes) else {
            continue;
        };
        let parked_ms = since.elapsed().as_secs_f64() * 1e3;
        for t in tenants.iter_mut() {
            t.parked_since = None;
        }
        match carry_all(
            l,
            shared,
            rung,
            best,
            tenants,
            exported,
            b,
            0.0,
            Moving::Resumed,
        ) {
            Ok(e) => {
                if best == rung {
                    for t in tenants.iter() {
                        let info = lever(l, rung, t, "resume", parked_ms, b.bytes);
                        t.emit(shared, Event::Lever(LeverInfo { parked_ms, ..info }));
                    }
                }
                publish_batch(shared, l, &e, tenants);
                *engine = Some(e);
            }
            Err(e) => {
                let api = ApiError::from_session(&e);
                for t in tenants.drain(..) {
                    report_failed(shared, t, &api);
                }
                publish_engine(shared, l, None, tenants);
            }
        }
        return;
    }
}

/// A lever event of tenant `t` on rung `rung`, as the session reports its own.
fn lever(l: &Ladders, rung: usize, t: &Tenant, what: &str, cost_ms: f64, budget: u64) -> LeverInfo {
    LeverInfo {
        at_token: t.out.len(),
        lever: what.to_string(),
        rung: l.name(rung).to_string(),
        tokens: t.cached.len(),
        cost_ms,
        parked_ms: 0.0,
        rss_before: 0,
        rss_after: super::worker::rss_bytes(),
        parked_kv_bytes: 0,
        budget_bytes: budget,
    }
}

/// Ends an answer while the batch is parked (its client left, or the park deadline passed):
/// its conversation's exported cache goes to its state file, as a displaced one does (a
/// cache with projected cells is not written; the conversation is then re-read), and the
/// client hears the end.
fn end_parked(
    shared: &Shared,
    l: &Ladders,
    rung: usize,
    t: Tenant,
    exported: Option<Exportedseq>,
    stop: StopReason,
) {
    if let Some(c) = &t.job.conversation {
        let name = l.name(rung);
        shared
            .conversations
            .answered(&c.id, name, &t.cached, t.prompt_tokens, None);
        let snapshot = match exported {
            Some(x) if t.projected.is_empty() => Some(state_file(
                shared,
                name,
                &l.ladder.rungs[rung].sha256,
                l.config.n_ctx,
                t.cached.clone(),
                &c.id,
                x.blob,
            )),
            _ => None,
        };
        shared
            .conversations
            .hibernate(&c.id, Ok::<_, String>(snapshot), &shared.recorder);
    }
    conclude(shared, t, stop, false);
}

/// The batch is parked: no rung holds the running answers, so none advances. Each is told
/// once, with the rung its cache waits on and the park deadline, in the words the session
/// uses; an answer parked past the deadline ends (`park_deadline`), its cache kept, so the
/// engine is not held until memory returns.
fn park(
    shared: &Shared,
    l: &Ladders,
    engine: &mut Engine,
    tenants: &mut Vec<Tenant>,
    budget: Budget,
) {
    let deadline = l.park_deadline;
    let mut i = 0;
    while i < tenants.len() {
        let t = &mut tenants[i];
        t.stall_ms += STALL_POLL.as_secs_f64() * 1e3;
        let Some(since) = t.parked_since else {
            t.parked_since = Some(Instant::now());
            let reason = format!(
                "budget {} MiB is below every rung's footprint for the {} running answers; parked on {}, waiting for memory{}",
                budget.bytes >> 20,
                tenants.len(),
                l.name(engine.rung),
                deadline.map_or(String::new(), |d| format!(
                    " for up to {:.0} s",
                    d.as_secs_f64()
                ))
            );
            tenants[i].emit(
                shared,
                Event::Stall {
                    reason,
                    deadline_ms: deadline.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                },
            );
            i += 1;
            continue;
        };
        if deadline.is_some_and(|d| since.elapsed() >= d) {
            let t = tenants.remove(i);
            finish(shared, engine, t, StopReason::ParkDeadline, false);
            publish_batch(shared, l, engine, tenants);
        } else {
            i += 1;
        }
    }
}

/// The scratch contexts one switch creates at most once, whatever the number of tenants it
/// carries: the source's with the attention tap (reading a prompt's attention when it was
/// read in a batch), and the destination's (where the session's transplant runs).
#[derive(Default)]
struct Scratch {
    src: Option<Context>,
    dst: Option<Context>,
}

/// One tenant's cache exported alone (llama.cpp's state blob of its sequence), and how long
/// the export took, ms.
struct Exportedseq {
    blob: Vec<u8>,
    ms: f64,
}

/// Exports `t`'s sequence, and, while the source is still loaded, reads the attention its
/// prompt's last tokens give each position when a later size switch will select by it and
/// the prompt was read in a batch (no tap there).
fn export_for_switch(
    l: &Ladders,
    src: &BatchContext,
    t: &mut Tenant,
    scratch: &mut Scratch,
) -> Result<Exportedseq, EngineError> {
    let t0 = Instant::now();
    let blob = src.export_seq(t.seq)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if t.observed.is_none() && t.started && l.refreshable() {
        let prompt = &t.cached[..t.prompt_tokens.min(t.cached.len())];
        t.observed = observe(l, src.model(), &blob, prompt, scratch);
    }
    Ok(Exportedseq { blob, ms })
}

/// The attention mass `prompt`'s last tokens give each of its positions (the session's
/// `observed`, read as it reads a prompt): the window read again on the source `model` over
/// the cache `blob` holds. `None` when it cannot be read (the selection then goes by
/// position, as a session's without a tap does).
fn observe(
    l: &Ladders,
    model: &Arc<Model>,
    blob: &[u8],
    prompt: &[Token],
    scratch: &mut Scratch,
) -> Option<Vec<f32>> {
    if prompt.is_empty() {
        return None;
    }
    let window = l.opts.token_recompute?.window.clamp(1, prompt.len());
    let ctx = match &mut scratch.src {
        Some(c) => c,
        empty => empty.insert(l.scratch(model, true).ok()?),
    };
    ctx.import_state(blob).ok()?;
    ctx.truncate(prompt.len() - window);
    ctx.decode_observed(&prompt[prompt.len() - window..], window)
        .ok()
        .flatten()
}

/// What carrying one tenant's cache needs that is the same for every tenant of the switch.
struct Carry<'a> {
    l: &'a Ladders,
    projector: &'a Projector,
    kind: RouteKind,
    anchor: Option<&'a Anchor>,
    from: &'a str,
    dst_model: &'a Arc<Model>,
}

impl Carry<'_> {
    /// Carries `t`'s exported cache into `dst`'s sequence `seq` as the session's switch
    /// carries its own ([`carry_cache`]): the head re-read natively (the anchor
    /// spliced in), projected, imported, the positions the prompt's attention pointed at
    /// recomputed natively on a size route, then moved into the batch's context without the
    /// pending token (the next step decodes it with the others'). The timings and the
    /// positions left projected; `Err` with why, `dst`'s sequence then to be emptied and the
    /// history re-read.
    fn carry(
        &self,
        exported: &Exportedseq,
        dst: &mut BatchContext,
        seq: SeqId,
        t: &Tenant,
        scratch: &mut Scratch,
    ) -> Result<(SwitchTimings, Vec<Range<usize>>), String> {
        let n_past = t.cached.len();
        let last = *t.feed.get(t.fed).ok_or("no pending token")?;
        let ctx = match &mut scratch.dst {
            Some(c) => c,
            empty => empty.insert(
                self.l
                    .scratch(self.dst_model, false)
                    .map_err(|e| e.to_string())?,
            ),
        };
        ctx.clear();
        let route = CarryRoute {
            kind: self.kind,
            projector: self.projector,
            anchor: self.anchor,
        };
        // The pending token is decoded by the batch's next step, with the others': the
        // carry stops before a first decode (a tail re-read is decoded with that token, then
        // cut back).
        let cache = CachedState {
            exported: Exported {
                blob: &exported.blob,
                n_past,
                from: self.from,
                export_ms: exported.ms,
            },
            history: &t.cached,
            observed: t.observed.as_deref(),
            pending: Some(last),
        };
        let (timings, projected) =
            carry_cache(&self.l.opts, &route, &cache, ctx).map_err(|e| e.to_string())?;
        let state = ctx.export_state().map_err(|e| e.to_string())?;
        dst.import_seq(seq, &state).map_err(|e| e.to_string())?;
        if dst.n_past(seq) != Some(n_past) {
            return Err(format!(
                "the destination holds {:?} positions, the cache {n_past}",
                dst.n_past(seq)
            ));
        }
        Ok((timings, projected))
    }
}

/// Carries every tenant to rung `to`: each sequence exported alone, the source freed (the
/// process never holds both rungs, as the session's shed-first switch), the destination
/// loaded, and each cache carried as the session's switch carries its own ([`Carry::carry`])
/// into the destination's context (or re-read there when the route has no projector).
fn move_all(
    l: &mut Ladders,
    shared: &Shared,
    engine: &mut Option<Engine>,
    tenants: &mut [Tenant],
    to: usize,
    budget: Budget,
) -> Result<(), SessionError> {
    let Some(src) = engine.take() else {
        return Err(SessionError::UnknownRung(l.name(to).to_string()));
    };
    let from = src.rung;
    let t0 = Instant::now();
    let mut scratch = Scratch::default();
    let mut exported = Vec::with_capacity(tenants.len());
    // With `--strategy reprefill` every cache is re-read on the destination: none exported.
    let carried = from == to || l.opts.strategy != Strategy::Reprefill;
    for t in tenants.iter_mut() {
        exported.push(if t.started && carried {
            export_for_switch(l, &src.ctx, t, &mut scratch).ok()
        } else {
            None
        });
    }
    drop(scratch);
    // Kept caches are not carried: the next turn of their conversations is re-read.
    src.free(shared);
    let export_ms = t0.elapsed().as_secs_f64() * 1e3;
    let dst = carry_all(
        l,
        shared,
        from,
        to,
        tenants,
        exported,
        budget,
        export_ms,
        Moving::Live,
    )?;
    *engine = Some(dst);
    Ok(())
}

/// Why caches change rung, which decides how a size route moves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Moving {
    /// Under pressure, between two tokens: carried through the switch (as `--strategy` says).
    Live,
    /// Resuming after a park (set aside, or the whole batch): on a size route (down or up) the
    /// history is re-read on the destination — a projected cache keeps an answer fluent but loses the
    /// context's facts (`bench --serve-aside`: a set-aside summary resumed on tier2 stated 1
    /// of its 12 facts carried, 12 re-read), and the answer has waited already. A precision
    /// route carries it (and every route, with `serve --carry-on-resume`).
    Resumed,
}

/// Loads rung `to` and moves every tenant's cache there from rung `from`: `exported[i]` is
/// tenant `i`'s (`None`: read again there, its prompt or its whole history), carried with a
/// switch event in its stream. `before_ms` is what the caller spent before the load (the
/// exports), counted in every switch's cost.
#[allow(clippy::too_many_arguments)] // one switch's parts, each needed once
fn carry_all(
    l: &mut Ladders,
    shared: &Shared,
    from: usize,
    to: usize,
    tenants: &mut [Tenant],
    exported: Vec<Option<Exportedseq>>,
    budget: Budget,
    before_ms: f64,
    moving: Moving,
) -> Result<Engine, SessionError> {
    let t_load = Instant::now();
    let mut dst = l.load(to, Some(budget.bytes))?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    carry_into(
        l,
        shared,
        &mut dst,
        from,
        tenants,
        exported,
        budget,
        (before_ms, t_load, load_ms),
        moving,
    )?;
    Ok(dst)
}

/// Moves every tenant's cache from rung `from` into new sequences of `dst` (its rung loaded
/// already), as [`carry_all`] describes. `(before_ms, t_load, load_ms)`: what was spent
/// before the load, when the load began (every switch's cost counts from there) and how
/// long it took.
#[allow(clippy::too_many_arguments)] // one switch's parts, each needed once
fn carry_into(
    l: &Ladders,
    shared: &Shared,
    dst: &mut Engine,
    from: usize,
    tenants: &mut [Tenant],
    exported: Vec<Option<Exportedseq>>,
    budget: Budget,
    (before_ms, t_load, load_ms): (f64, Instant, f64),
    moving: Moving,
) -> Result<(), SessionError> {
    let to = dst.rung;
    let (from_name, to_name) = (l.name(from).to_string(), l.name(to).to_string());
    let kind = {
        let r = l.routes.borrow();
        route_kind(r.binding(from), r.binding(to))
    };
    // A cache that changes rung is re-read there, never carried: with `serve --strategy
    // reprefill`, and on a size route after a park (see [`Moving::Resumed`]).
    let reread = match (from == to, l.opts.strategy, moving, kind) {
        (true, ..) => None,
        (false, Strategy::Reprefill, ..) => Some(None),
        (false, _, Moving::Resumed, RouteKind::Size) if !l.carry_on_resume => Some(Some(
            "parked: its history re-read on this model size (a cache projected from another loses the context's facts)",
        )),
        _ => None,
    };
    // Neither the projector nor the anchor is looked up for caches that are re-read.
    let projector = if from == to {
        Err("the cache returns to its own rung".to_string())
    } else if reread.is_some() {
        Err("re-read".to_string())
    } else {
        l.routes
            .borrow_mut()
            .get(from, to)
            .map_err(|e| e.to_string())
    };
    // The session's switch: the destination's anchor for the head re-read (a damaged one is
    // not used, and the head is decoded), and token recompute on a size route.
    let mut anchor_note = None;
    let anchor = if l.opts.head_reread == 0 || reread.is_some() {
        None
    } else {
        l.routes.borrow_mut().anchor(to).unwrap_or_else(|e| {
            anchor_note = Some(format!("anchor not used, head decoded: {e}"));
            None
        })
    };
    let mut scratch = Scratch::default();
    let dst_model = Arc::clone(dst.ctx.model());
    // A size route's carried caches are re-read in place behind their answers (a precision
    // route's only when asked): the session's refill.
    let refills = l.opts.refills(kind);
    for (t, exported) in tenants.iter_mut().zip(exported) {
        // A refill goes on only on the rung it began on, its cells as they were.
        let refill = t.refill.take();
        let seq = dst.ctx.add_seq().ok_or_else(|| SessionError::Engine {
            rung: to_name.clone(),
            source: molt::engine::EngineError::OutOfRange {
                what: "sequences on the destination",
                value: u64::from(l.slots),
            },
        })?;
        if !t.started {
            // No token yet: the prompt is simply read on the destination.
            let mut feed = std::mem::take(&mut t.cached);
            feed.extend_from_slice(&t.feed[t.fed..]);
            (t.feed, t.fed, t.seq) = (feed, 0, seq);
            t.projected.clear();
            continue;
        }
        if from == to {
            // Back on the rung it was exported from (a park's resume): imported as it was.
            let back = exported.as_ref().is_some_and(|x| {
                dst.ctx.import_seq(seq, &x.blob).is_ok()
                    && dst.ctx.n_past(seq) == Some(t.cached.len())
            });
            if back {
                t.refill = refill;
            } else {
                let mut feed = std::mem::take(&mut t.cached);
                feed.extend_from_slice(&t.feed[t.fed..]);
                let _ = dst.ctx.truncate(seq, 0);
                (t.feed, t.fed) = (feed, 0);
                t.projected.clear();
            }
            t.seq = seq;
            continue;
        }
        // `Err(Ok(note))`: re-read by choice (`reread`); `Err(Err(why))`: the carry failed.
        let carried = match (&projector, &exported) {
            _ if reread.is_some() => Err(Ok(reread.flatten())),
            (_, None) => Err(Err("its cache could not be exported".to_string())),
            (Err(e), _) => Err(Err(e.clone())),
            (Ok(p), Some(x)) => {
                let c = Carry {
                    l,
                    projector: p,
                    kind,
                    anchor: anchor.as_deref(),
                    from: &from_name,
                    dst_model: &dst_model,
                };
                c.carry(x, &mut dst.ctx, seq, t, &mut scratch).map_err(Err)
            }
        };
        let n_tokens = t.cached.len() as u64;
        let (method, timings, note) = match carried {
            Ok((timings, projected)) => {
                // Absent cells stay absent through a later projection.
                t.holes = (t.holes && !t.projected.is_empty()) || timings.sparse;
                t.projected = projected;
                // The head re-read is the destination's own already.
                let next = l.opts.head_reread.min(t.cached.len());
                // Nothing projected (the switch re-read the whole cache): nothing to refill.
                t.refill = (refills && !t.projected.is_empty()).then(|| Refill {
                    next,
                    done: 0,
                    step: l.opts.refill_step(t.cached.len() - next),
                    ms: 0.0,
                });
                (SwitchMethod::Molt, timings, anchor_note.clone())
            }
            Err(why) => {
                // Re-read the history on the destination, then the pending token.
                let mut feed = std::mem::take(&mut t.cached);
                feed.extend_from_slice(&t.feed[t.fed..]);
                // The destination's sequence is in use, emptied of whatever the failed carry
                // left in it.
                let _ = dst.ctx.truncate(seq, 0);
                (t.feed, t.fed) = (feed, 0);
                t.projected.clear();
                match why {
                    Ok(note) => (
                        SwitchMethod::Reprefill,
                        SwitchTimings::default(),
                        note.map(String::from),
                    ),
                    Err(why) => (
                        SwitchMethod::ReprefillNoProjector,
                        SwitchTimings::default(),
                        Some(format!(
                            "the cache could not be carried ({why}); re-read instead"
                        )),
                    ),
                }
            }
        };
        t.seq = seq;
        let flops_reprefill = prefill_flops(
            dst_model.n_params(),
            dst_model.n_layer() as u64,
            dst_model.n_embd() as u64,
            n_tokens,
        );
        // What this answer waited: the exports, the destination's load and every cache
        // carried before its own.
        let cost_ms = before_ms + t_load.elapsed().as_secs_f64() * 1e3;
        let info = SwitchInfo {
            at_token: t.out.len(),
            from: from_name.clone(),
            to: to_name.clone(),
            method,
            timings: SwitchTimings {
                cost_ms,
                load_ms,
                flops: if method.is_reprefill() {
                    flops_reprefill
                } else {
                    switch_flops(
                        &timings,
                        dst_model.n_params(),
                        dst_model.n_layer() as u64,
                        dst_model.n_embd() as u64,
                        n_tokens,
                    )
                },
                ..timings
            },
            flops_reprefill,
            pressure: budget.pressure,
            budget_bytes: budget.bytes,
            handoff_jsd: None,
            handoff_floor_jsd: None,
            note,
            setup: None,
        };
        shared.counters.switches.fetch_add(1, Ordering::Relaxed);
        t.emit(shared, Event::Switch(info.clone()));
        t.switches.push(info);
    }
    molt::pressure::trim_heap();
    Ok(())
}

/// One decode step for the whole batch, then sampling for each tenant whose input is in.
fn step(shared: &Shared, l: &Ladders, engine: &mut Engine, tenants: &mut Vec<Tenant>) {
    let n_ctx = l.config.n_ctx as usize;
    let chunk_room = (l.config.n_batch as usize)
        .saturating_sub(tenants.len())
        .max(1);
    let chunk = PREFILL_CHUNK.min(chunk_room);
    // A sequence whose next position would pass the window ends here.
    let mut i = 0;
    while i < tenants.len() {
        let t = &tenants[i];
        if t.cached.len() + t.feed.len() - t.fed > n_ctx && t.started {
            let t = tenants.remove(i);
            finish(shared, engine, t, StopReason::ContextFull, false);
        } else {
            i += 1;
        }
    }
    share_prefixes(engine, tenants);
    let mut prefilling = false;
    let mut plan: Vec<(usize, usize)> = Vec::new();
    for (k, t) in tenants.iter().enumerate() {
        let left = t.feed.len() - t.fed;
        if left == 0 {
            continue;
        }
        if left == 1 {
            plan.push((k, 1));
        } else if !prefilling {
            prefilling = true;
            plan.push((k, left.min(chunk)));
        }
    }
    if plan.is_empty() {
        return;
    }
    let chunks: Vec<SeqChunk<'_>> = plan
        .iter()
        .map(|&(k, n)| {
            let t = &tenants[k];
            SeqChunk {
                seq: t.seq,
                tokens: &t.feed[t.fed..t.fed + n],
                logits: t.fed + n == t.feed.len(),
            }
        })
        .collect();
    let reread = refill_span(l, engine, tenants, &plan);
    let span = reread.map(|(k, a, e)| SeqSpan {
        seq: tenants[k].seq,
        start: a,
        tokens: &tenants[k].cached[a..e],
    });
    let t_step = Instant::now();
    // A token decoded in the step of a span attends to the cells the span replaces as they
    // were: the last span of a refill is read in a step of its own first, so that the token's
    // cell is the destination's own too.
    let last_span = reread.is_some_and(|(k, _, e)| e >= tenants[k].cached.len());
    let mut stepped = if last_span {
        engine
            .ctx
            .step_rereading(&[], span)
            .and_then(|()| engine.ctx.step(&chunks))
    } else {
        engine.ctx.step_rereading(&chunks, span)
    };
    // A step that fails with a span is tried again without it (llama.cpp rolled the failed
    // batch back): a refill that cannot go on ends, the answers do not.
    let mut abandoned = None;
    if let (Err(e), Some(_)) = (&stepped, reread) {
        abandoned = Some(e.to_string());
        stepped = engine.ctx.step(&chunks);
    }
    if let Err(source) = stepped {
        drop(chunks);
        let e = SessionError::Engine {
            rung: l.name(engine.rung).to_string(),
            source,
        };
        let api = ApiError::from_session(&e);
        let mut ks: Vec<usize> = plan.iter().map(|&(k, _)| k).collect();
        ks.sort_unstable();
        for k in ks.into_iter().rev() {
            let t = tenants.remove(k);
            failed(shared, engine, t, &api);
        }
        publish_batch(shared, l, engine, tenants);
        return;
    }
    drop(chunks);
    match (reread, abandoned) {
        (Some((k, _, _)), Some(why)) => {
            let t = &mut tenants[k];
            if let Some(r) = t.refill.take() {
                let what = format!("refill abandoned: {why}");
                let info =
                    LeverInfo::refill(t.out.len(), &what, l.name(engine.rung), r.done, r.ms, 0);
                t.emit(shared, Event::Lever(info));
            }
        }
        (Some((k, a, e)), None) => {
            refilled(shared, l, engine, &mut tenants[k], a..e, t_step.elapsed());
        }
        _ => {}
    }
    let rung = l.name(engine.rung).to_string();
    let mut done: Vec<(usize, StopReason, bool)> = Vec::new();
    for &(k, n) in &plan {
        let t = &mut tenants[k];
        t.cached.extend_from_slice(&t.feed[t.fed..t.fed + n]);
        t.fed += n;
        if t.fed < t.feed.len() {
            continue;
        }
        if let Some((stop, by_control)) = sample(shared, engine, t, &rung) {
            done.push((k, stop, by_control));
        }
    }
    if !done.is_empty() {
        done.sort_unstable_by_key(|d| d.0);
        for (k, stop, by_control) in done.into_iter().rev() {
            let t = tenants.remove(k);
            finish(shared, engine, t, stop, by_control);
        }
        publish_batch(shared, l, engine, tenants);
    }
}

/// The span the refill of one answering tenant re-reads in this step, as `(tenant, start,
/// end)`: the first tenant in order whose refill runs and whose next input is its pending
/// token (not a prompt), when the step and the window have room for it. `None`: no refill this step.
fn refill_span(
    l: &Ladders,
    engine: &Engine,
    tenants: &[Tenant],
    plan: &[(usize, usize)],
) -> Option<(usize, usize, usize)> {
    let planned: usize = plan.iter().map(|p| p.1).sum();
    let room = (l.config.n_batch as usize).saturating_sub(planned);
    let cells = (l.config.n_ctx as usize).saturating_sub(engine.ctx.cells_used() + planned);
    let chunk = room.min(cells);
    if chunk == 0 {
        return None;
    }
    plan.iter().find_map(|&(k, n)| {
        let t = &tenants[k];
        let r = t.refill?;
        let held = t.cached.len();
        let end = (r.next + r.step.min(chunk)).min(held);
        (n == 1 && t.started && r.next < held && r.step > 0).then_some((k, r.next, end))
    })
}

/// After a step that re-read `span` of `t`'s cache: the refill moves on, the span is no longer
/// projected, and once every position before the newest is re-read the refill ends with a
/// `refill` lever on the answer's stream (its cache is the destination's own).
fn refilled(
    shared: &Shared,
    l: &Ladders,
    engine: &Engine,
    t: &mut Tenant,
    span: Range<usize>,
    took: Duration,
) {
    let Some(mut r) = t.refill.take() else {
        return;
    };
    r.done += span.len();
    r.next = span.end;
    r.ms += took.as_secs_f64() * 1e3;
    t.projected.retain(|p| p.end > span.end);
    if let Some(p) = t.projected.first_mut() {
        p.start = p.start.max(span.end);
    }
    // Called before the step's tokens join `cached`: it holds what the sequence held before.
    if span.end < t.cached.len() {
        t.refill = Some(r);
        return;
    }
    t.projected.clear();
    let info = LeverInfo::refill(t.out.len(), "refill", l.name(engine.rung), r.done, r.ms, 0);
    t.emit(shared, Event::Lever(info));
}

/// A newcomer whose prompt begins as a running tenant's cache does (the chat template and its
/// system prompt, a shared document) takes those cells instead of reading them: llama.cpp's
/// server reuses a slot's own earlier prompt, and the unified cache lets a sequence share
/// another's cells outright. At least the prompt's last token is still decoded (its logits
/// start the answer).
fn share_prefixes(engine: &mut Engine, tenants: &mut [Tenant]) {
    for k in 0..tenants.len() {
        let t = &tenants[k];
        if t.fed != 0 || !t.cached.is_empty() || t.started || t.feed.len() < 2 {
            continue;
        }
        let best = tenants
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != k)
            .map(|(j, d)| {
                let n = d
                    .cached
                    .iter()
                    .zip(&t.feed)
                    .take_while(|(a, b)| a == b)
                    .count();
                // Never cells a switch projected: nothing would refresh them for this prompt.
                let native = d.projected.first().map_or(n, |r| r.start);
                (n.min(native).min(t.feed.len() - 1), j)
            })
            .max();
        let Some((n, j)) = best.filter(|&(n, _)| n > 0) else {
            continue;
        };
        let (src, dst) = (tenants[j].seq, tenants[k].seq);
        if engine.ctx.share_prefix(src, dst, n).is_ok() {
            let t = &mut tenants[k];
            t.cached = t.feed[..n].to_vec();
            t.fed = n;
            t.reused = n;
        }
    }
}

/// Samples the tenant's next token and streams it; `Some` when its answer is complete.
fn sample(
    shared: &Shared,
    engine: &Engine,
    t: &mut Tenant,
    rung: &str,
) -> Option<(StopReason, bool)> {
    let model = engine.ctx.model();
    let raw = engine.ctx.logits(t.seq).unwrap_or(&[]);
    if raw.is_empty() {
        return Some((StopReason::Length, false));
    }
    if !t.started {
        t.started = true;
        t.emit(
            shared,
            Event::Start {
                rung: rung.to_string(),
                prompt_tokens: t.prompt_tokens,
                reused_tokens: t.reused,
            },
        );
    }
    let mut row = raw.to_vec();
    t.control.shape(&mut row);
    let tok = t.sampler.sample(&row);
    let logprobs = t
        .control
        .logprobs()
        .filter(|_| !model.is_eog(tok))
        .map(|k| logprobs_of(raw, tok, k, |x| model.token_bytes(x)));
    let now = Instant::now();
    let latency_ms = now.duration_since(t.last).as_secs_f64() * 1e3;
    t.last = now;
    let index = t.out.len();
    if index == 0 {
        t.ttft_ms = now.duration_since(t.t0).as_secs_f64() * 1e3;
    }
    if model.is_eog(tok) {
        return Some((StopReason::Eos, false));
    }
    t.out.push(tok);
    let piece = t.stream.push(&model.token_bytes(tok));
    let accept = t.control.accept(tok, piece);
    t.text.push_str(&accept.emit);
    if t.rungs_used.last().map(String::as_str) != Some(rung) {
        t.rungs_used.push(rung.to_string());
    }
    t.emit(
        shared,
        Event::Token {
            index,
            token: tok,
            text: accept.emit,
            rung: rung.to_string(),
            latency_ms,
            logprobs,
        },
    );
    if accept.stop {
        return Some((StopReason::Eos, true));
    }
    if t.out.len() >= t.job.opts.max_tokens {
        return Some((StopReason::Length, false));
    }
    (t.feed, t.fed) = (vec![tok], 0);
    None
}

/// Ends a tenant's answer: frees its sequence, sends the summary and the finished answer.
fn finish(
    shared: &Shared,
    engine: &mut Engine,
    t: Tenant,
    stop: StopReason,
    stopped_by_control: bool,
) {
    keep_or_free(shared, engine, &t);
    conclude(shared, t, stop, stopped_by_control);
}

/// The end of an answer once its cache is seen to: the summary and the finished answer.
fn conclude(shared: &Shared, mut t: Tenant, stop: StopReason, stopped_by_control: bool) {
    let tail = t.stream.finish();
    if !stopped_by_control {
        let rest = t.control.finish(tail);
        t.text.push_str(&rest);
    }
    shared
        .counters
        .tokens
        .fetch_add(t.out.len() as u64, Ordering::Relaxed);
    if stop == StopReason::Cancelled {
        shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
        shared.recorder.service(
            &t.job.id,
            "disconnected",
            serde_json::json!({"tokens": t.out.len()}),
        );
    } else {
        shared.counters.completed.fetch_add(1, Ordering::Relaxed);
    }
    let g = Generation {
        text: std::mem::take(&mut t.text),
        tokens: std::mem::take(&mut t.out),
        prompt_tokens: t.prompt_tokens,
        rungs_used: std::mem::take(&mut t.rungs_used),
        switches: std::mem::take(&mut t.switches),
        ttft_ms: t.ttft_ms,
        total_ms: t.t0.elapsed().as_secs_f64() * 1e3,
        stop,
        killed: false,
        lost_tokens: 0,
        levers: Vec::new(),
        stall_ms: t.stall_ms,
    };
    t.emit(shared, Event::Done(g.summary()));
    unlist(shared, &t.job.id);
    let _ = t.job.tx.send(Update::Finished(Box::new(g)));
}

/// Leaves a finished chat answer's sequence in the context for the next request that
/// continues it ([`Kept`]), when the rung computed every cell itself or the projected ones
/// will be refreshed before a prompt is answered on them; frees it otherwise. Tells the
/// conversation store which.
fn keep_or_free(shared: &Shared, engine: &mut Engine, t: &Tenant) {
    // A text completion belongs to no conversation: nothing continues it, so its cells are
    // not kept (as the serial loop does not build a conversation on a completion's cache).
    let Some(id) = t.job.conversation.as_ref().map(|c| c.id.clone()) else {
        engine.ctx.remove_seq(t.seq);
        return;
    };
    // Positions a sparse read left out and the refill did not reach (an answer shorter than
    // its deadline) cannot be refreshed: nothing attends to them. The conversation is read
    // again from its messages instead.
    let trusted = t.projected.is_empty() || (engine.refreshable && !t.holes);
    let keep = trusted && !t.cached.is_empty() && engine.ctx.n_past(t.seq) == Some(t.cached.len());
    let kv = engine.kv_per_token * t.cached.len() as u64;
    shared.conversations.answered(
        &id,
        engine.ctx.model().name(),
        &t.cached,
        t.prompt_tokens,
        keep.then_some(kv),
    );
    if keep {
        // Written now, not when the sequence is displaced: several conversations stay in the
        // context at once, and a process killed before it displaced them would lose them all.
        let persisted = shared.conversations.dir().is_some()
            && t.projected.is_empty()
            && match engine.state_file(shared, t.seq, t.cached.clone(), &id) {
                Ok(file) => shared.conversations.persist(&id, &file, &shared.recorder),
                Err(e) => {
                    eprintln!("molt serve: conversation {id}: cannot export its cache ({e})");
                    false
                }
            };
        engine.kept.push(Kept {
            seq: t.seq,
            tokens: t.cached.clone(),
            conversation: id,
            persisted,
            projected: t.projected.clone(),
        });
    } else {
        engine.ctx.remove_seq(t.seq);
    }
}

fn failed(shared: &Shared, engine: &mut Engine, t: Tenant, e: &ApiError) {
    engine.ctx.remove_seq(t.seq);
    report_failed(shared, t, e);
}

/// Tells a failed tenant's client and the books (its sequence already gone).
fn report_failed(shared: &Shared, t: Tenant, e: &ApiError) {
    if let Some(c) = &t.job.conversation {
        shared.conversations.let_go(&c.id);
    }
    shared.counters.failed.fetch_add(1, Ordering::Relaxed);
    shared.recorder.service(&t.job.id, "failed", e.json());
    unlist(shared, &t.job.id);
    let _ = t.job.tx.send(Update::Failed(e.clone()));
}

/// Takes a request off the published list of running ones before its client hears the end
/// (as the serial loop publishes before its last update): a request sent right after must
/// find the engine idle, not be told it queues behind an answer that has ended.
fn unlist(shared: &Shared, id: &str) {
    let mut e = shared.engine();
    if let Some(running) = e.running.take() {
        let rest: Vec<&str> = running.split(',').filter(|r| *r != id).collect();
        e.running = (!rest.is_empty()).then(|| rest.join(","));
    }
}
