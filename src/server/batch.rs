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
//!    the same way. When not even the smallest rung holds them, the tenants wait (a stall
//!    event) until memory comes back or their clients leave.
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
//! rung that holds it, a switch for every answer.
//!
//! What still differs from the serial loop: a switch carries the cache by projection alone
//! (no head re-read or token recompute), so a cache with projected cells is not kept for the
//! next request; a parked batch keeps its rung's weights loaded (the serial loop releases
//! them); a state file is woken only on the rung that wrote it (on another rung the
//! conversation is re-read); kept conversations are hibernated only when displaced, so
//! several can be kept at once where the serial loop keeps one.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::control::RequestControl;
use super::conversations::JobConversation;
use super::error::ApiError;
use super::worker::{Deferral, Job, Shared, Update};
use crate::engine::{
    BatchContext, ChatMessage, ContextConfig, Model, ModelOptions, Sampler, SeqChunk, SeqId, Token,
    Utf8Stream,
};
use crate::ladder::Ladder;
use crate::pressure::{Budget, BudgetSource, Tick};
use crate::routes::Routes;
use crate::sched::RungCost;
use crate::session::migrate::{SwitchTimings, prefill_flops, project_blob};
use crate::session::{
    Event, Generation, Prompt, Session, SessionError, StopReason, SwitchInfo, SwitchMethod,
    TokenControl, logprobs_of,
};
use crate::state::{StateFile, StateMeta, now_unix_ms};

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
    /// Oldest first.
    kept: Vec<Kept>,
}

/// A finished answer's sequence left in the context, as the one-at-a-time loop keeps its
/// session's cache: the next request whose prompt begins with its tokens (a conversation's
/// next turn, or the same system prompt) takes the sequence over and reads only what follows.
/// Only a cache the rung computed itself is kept: cells projected by a switch are not built
/// on (see the worker's `choose_start` for what that was seen to do).
struct Kept {
    seq: SeqId,
    tokens: Vec<Token>,
    conversation: String,
    /// Its state file was written when its answer ended (see `keep_or_free`).
    persisted: bool,
}

impl Engine {
    /// Cells the kept sequences hold.
    fn kept_cells(&self) -> u64 {
        self.kept.iter().map(|k| k.tokens.len() as u64).sum()
    }

    /// Frees the oldest kept sequence; false when none is kept.
    fn let_go_oldest(&mut self, shared: &Shared) -> bool {
        if self.kept.is_empty() {
            return false;
        }
        let Kept {
            seq,
            tokens,
            conversation: id,
            persisted,
        } = self.kept.remove(0);
        // The conversation's cache goes to its state file (or stays in RAM when the write
        // fails), as the one-at-a-time loop hibernates the conversation it displaces; a file
        // written when its answer ended is not written again.
        if !(persisted && shared.conversations.hibernate_persisted(&id)) {
            let snapshot = self.state_file(shared, seq, tokens, &id).map(Some);
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
    ) -> Result<StateFile, crate::engine::EngineError> {
        let first_turn_len = shared.conversations.first_turn_len(id).min(tokens.len());
        let blob = self.ctx.export_seq(seq)?;
        Ok(StateFile {
            meta: StateMeta {
                conversation: id.to_string(),
                rung: self.ctx.model().name().to_string(),
                rung_sha256: self.sha256.clone(),
                n_ctx: self.ctx.config().n_ctx,
                tokens,
                pos_start: 0,
                pending: None,
                first_turn_len,
                pinned: 0,
                messages: Vec::new(),
                written_unix_ms: now_unix_ms(),
            },
            blob,
        })
    }

    /// Wakes `job`'s conversation from its state file (or RAM copy) into `seq` when this rung
    /// wrote it, replacing what `seq` holds: the prompt tokens the woken cache holds (0 when
    /// the file was refused, the conversation then re-read from its messages); `None`, `seq`
    /// untouched, when the conversation has neither file nor RAM copy.
    fn wake(
        &mut self,
        shared: &Shared,
        job: &JobConversation,
        seq: SeqId,
        tokens: &[Token],
    ) -> Option<usize> {
        let rung = self.ctx.model().name().to_string();
        let mut file_tokens = Vec::new();
        let mut tried = false;
        let woken = shared.conversations.wake(job, &shared.recorder, |f| {
            tried = true;
            if f.meta.rung != rung {
                return Err(format!(
                    "written on rung {}, and the batch runs on {rung}",
                    f.meta.rung
                ));
            }
            self.ctx
                .import_seq(seq, &f.blob)
                .map_err(|e| e.to_string())?;
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
            return Some(0);
        }
        Some(held)
    }

    /// Frees every kept sequence (the rung is about to change).
    fn let_go_all(&mut self, shared: &Shared) {
        while self.let_go_oldest(shared) {}
    }

    /// A sequence for a prompt of `tokens` of `conversation`: the conversation's own kept
    /// sequence, rewound to the prefix it shares with the prompt (taken over: `true`); else a
    /// free one, letting the oldest kept sequences go while none is free or the cells would
    /// not hold `cells` more, given the longest prefix any kept sequence shares with the
    /// prompt (its cells tagged, not copied). Either way at most all but the prompt's last
    /// token, whose logits start the answer. The sequence, the prompt tokens it holds already,
    /// and whether it was the conversation's own.
    fn seq_for(
        &mut self,
        shared: &Shared,
        conversation: Option<&str>,
        tokens: &[Token],
        cells: u64,
    ) -> Option<(SeqId, usize, bool)> {
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
                return Some((k.seq, n, true));
            }
            self.ctx.remove_seq(k.seq);
        }
        let n_ctx = u64::from(self.ctx.config().n_ctx);
        while self.ctx.active() >= self.ctx.max_seqs()
            || self.ctx.cells_used() as u64 + cells > n_ctx
        {
            if !self.let_go_oldest(shared) {
                break;
            }
        }
        let seq = self.ctx.add_seq()?;
        let best = self
            .kept
            .iter()
            .map(|k| (shares(k), k.seq))
            .filter(|&(n, _)| n > 0)
            .max();
        if let Some((n, src)) = best
            && self.ctx.share_prefix(src, seq, n).is_ok()
        {
            return Some((seq, n, false));
        }
        Some((seq, 0, false))
    }
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
    routes: Routes,
    home: usize,
    slots: u32,
    /// How long an answer may stay parked (the session option of the same name).
    park_deadline: Option<Duration>,
}

impl Ladders {
    fn need(&self, rung: usize, tokens: u64) -> u64 {
        let c = &self.costs[rung];
        c.resident_bytes() + c.kv_bytes(tokens)
    }

    fn load(&self, rung: usize) -> Result<Engine, SessionError> {
        let info = &self.ladder.rungs[rung];
        let wrap = |source| SessionError::Engine {
            rung: info.name().to_string(),
            source,
        };
        let model = Model::load(&info.path, info.name(), ModelOptions::default()).map_err(wrap)?;
        let ctx = BatchContext::new(model, self.config, self.slots).map_err(wrap)?;
        Ok(Engine {
            rung,
            ctx,
            kv_per_token: self.costs[rung].kv_bytes_per_token,
            sha256: info.sha256.clone(),
            kept: Vec::new(),
        })
    }

    fn name(&self, rung: usize) -> &str {
        self.ladder.rungs[rung].name()
    }
}

/// The engine thread's loop with up to `slots` answers decoded together; returns when the
/// queue is closed.
pub fn run(mut session: Session, shared: &Shared, slots: usize) {
    let slots = u32::try_from(slots.max(1)).unwrap_or(u32::MAX);
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
        routes,
        slots,
        park_deadline: opts.park_deadline,
    };
    let start = session.current_index();
    drop(session);
    crate::pressure::trim_heap();
    let mut engine = match l.load(start) {
        Ok(e) => e,
        Err(e) => {
            fail_all_waiting(shared, &ApiError::from_session(&e));
            return;
        }
    };
    let mut l = l;
    publish_batch(shared, &l, &engine, &[]);
    let mut tenants: Vec<Tenant> = Vec::new();
    let mut last_budget: Option<u64> = None;
    // The oldest request, waiting for memory (deferred): it goes first once memory allows.
    let mut held: Option<Held> = None;
    loop {
        if drop_departed(shared, &mut engine, &mut tenants) {
            publish_batch(shared, &l, &engine, &tenants);
        }
        if held.as_ref().is_some_and(|h| h.job.cancelled()) {
            if let Some(h) = held.take() {
                skipped(shared, &h.job, "client gone while deferred");
            }
            publish_batch(shared, &l, &engine, &tenants);
        }
        if tenants.is_empty() {
            if held.is_none() {
                let Some(job) = shared.queue.pop() else {
                    // Shutting down: kept conversations go to their state files.
                    engine.let_go_all(shared);
                    return;
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
            let (moved, t) = start_idle(shared, &l, engine, &mut held);
            engine = match moved {
                Ok(e) => e,
                Err(e) => {
                    // The engine could not load a rung: nothing else can run either.
                    fail_all_waiting(shared, &e);
                    return;
                }
            };
            let Some(t) = t else {
                if held.is_some() {
                    std::thread::sleep(STALL_POLL);
                }
                continue;
            };
            tenants.push(t);
            last_budget = None;
        }
        join_waiting(shared, &l, &mut engine, &mut tenants, &mut held);
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
        match fit_rung(&mut l, shared, &mut engine, &mut tenants, budget) {
            Fit::Run => {}
            Fit::Stall => {
                park(shared, &l, &mut engine, &mut tenants, budget);
                std::thread::sleep(STALL_POLL);
                continue;
            }
            Fit::Failed(e) => {
                for t in tenants.drain(..) {
                    failed(shared, &mut engine, t, &e);
                }
                publish_batch(shared, &l, &engine, &tenants);
                continue;
            }
        }
        for t in &mut tenants {
            t.parked_since = None;
        }
        let before = tenants.len();
        step(shared, &l, &mut engine, &mut tenants);
        if tenants.len() != before {
            // Published before the next request is taken: one arriving after an answer ended
            // must not be told the engine is busy with it.
            publish_batch(shared, &l, &engine, &tenants);
        }
    }
}

/// A request that never ran because its client left.
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
            origin: crate::pressure::BudgetOrigin::Fixed,
        })
}

/// Publishes the batch's state for `GET /v1/molt/status`.
fn publish_batch(shared: &Shared, l: &Ladders, engine: &Engine, tenants: &[Tenant]) {
    let mut e = shared.engine();
    e.current_rung = l.name(engine.rung).to_string();
    e.loaded = vec![e.current_rung.clone()];
    e.running = (!tenants.is_empty()).then(|| {
        tenants
            .iter()
            .map(|t| t.job.id.as_str())
            .collect::<Vec<_>>()
            .join(",")
    });
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
fn prompt_tokens(model: &Model, job: &Job) -> Result<Vec<Token>, crate::engine::EngineError> {
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
    let Some((seq, reused, own)) = engine.seq_for(shared, conversation, &tokens, cells) else {
        refuse(shared, &job, &ApiError::internal("no free sequence"));
        return None;
    };
    // A conversation whose cache is not in the engine wakes from its state file, if any.
    let reused = match &job.conversation {
        Some(c) if !own => engine.wake(shared, c, seq, &tokens).unwrap_or(reused),
        _ => reused,
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
    Some(Tenant {
        seq,
        sampler: Sampler::new(job.opts.sampling),
        prompt_tokens: tokens.len(),
        reused,
        cached: tokens[..reused].to_vec(),
        fed: reused,
        feed: tokens,
        started: false,
        parked_since: None,
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
    })
}

fn refuse(shared: &Shared, job: &Job, e: &ApiError) {
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
    engine: Engine,
    held: &mut Option<Held>,
) -> (Result<Engine, ApiError>, Option<Tenant>) {
    let Some(h) = held.as_mut() else {
        return (Ok(engine), None);
    };
    let n_ctx = u64::from(l.config.n_ctx);
    let total_of = |j: &Job| (j.prompt_tokens.saturating_add(j.opts.max_tokens) as u64).min(n_ctx);
    let smallest = l.costs.len() - 1;
    let total = total_of(&h.job);
    let need = l.need(smallest, total);
    let budget = read_budget(shared, &[]).bytes;
    if budget >= need {
        let Some(h) = held.take() else {
            return (Ok(engine), None);
        };
        return start_on_best(shared, l, engine, h.job, budget);
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
        publish_batch(shared, l, &engine, &[]);
        return (Ok(engine), None);
    }
    let fits = |j: &Job| l.need(smallest, total_of(j)) <= budget;
    match shared.queue.take_first(fits) {
        Some(other) => {
            shared.recorder.service(
                &other.id,
                "overtook",
                serde_json::json!({"deferred": h.job.id}),
            );
            start_on_best(shared, l, engine, other, budget)
        }
        None => (Ok(engine), None),
    }
}

/// Moves the idle engine to the largest rung that holds `job` within `budget` (never above
/// home; freeing the old rung first: the two need not fit together) and admits it.
fn start_on_best(
    shared: &Shared,
    l: &Ladders,
    mut engine: Engine,
    job: Job,
    budget: u64,
) -> (Result<Engine, ApiError>, Option<Tenant>) {
    let total = (job.prompt_tokens.saturating_add(job.opts.max_tokens) as u64)
        .min(u64::from(l.config.n_ctx));
    let smallest = l.costs.len() - 1;
    let best = (l.home..l.costs.len())
        .find(|&i| l.need(i, total) <= budget)
        .unwrap_or(smallest);
    if best != engine.rung {
        let from = l.name(engine.rung).to_string();
        engine.let_go_all(shared);
        drop(engine);
        crate::pressure::trim_heap();
        engine = match l.load(best) {
            Ok(e) => e,
            Err(e) => {
                let api = ApiError::from_session(&e);
                refuse(shared, &job, &api);
                return (Err(api), None);
            }
        };
        shared.recorder.service(
            &job.id,
            "fresh_start",
            serde_json::json!({"from": from, "rung": l.name(best), "reason": "the budget picks another rung"}),
        );
    }
    let t = admit(shared, &mut engine, l, job);
    publish_batch(shared, l, &engine, t.as_slice());
    (Ok(engine), t)
}

/// Lets waiting requests join while a sequence is free and the budget holds the current rung
/// with every running tenant's whole length plus theirs.
fn join_waiting(
    shared: &Shared,
    l: &Ladders,
    engine: &mut Engine,
    tenants: &mut Vec<Tenant>,
    held: &mut Option<Held>,
) {
    let mut joined = false;
    // Kept sequences do not count: a newcomer lets the oldest go (`Engine::seq_for`).
    while tenants.len() < engine.ctx.max_seqs() {
        let budget = read_budget(shared, tenants).bytes;
        let n_ctx = l.config.n_ctx;
        let reserved: u64 = tenants.iter().map(|t| t.reserved(n_ctx)).sum();
        let rung = engine.rung;
        let fits = |j: &Job| {
            let total =
                (j.prompt_tokens.saturating_add(j.opts.max_tokens) as u64).min(u64::from(n_ctx));
            reserved + total <= u64::from(n_ctx) && l.need(rung, reserved + total) <= budget
        };
        // The request waiting for memory goes first when it fits.
        let first = held.take_if(|h| fits(&h.job)).map(|h| h.job);
        let Some(job) = first.or_else(|| shared.queue.take_first(fits)) else {
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
    /// No rung holds the batch: wait.
    Stall,
    /// Moving failed: every tenant ends with this error.
    Failed(ApiError),
}

/// Moves the batch when the budget (or a forced switch) says so.
fn fit_rung(
    l: &mut Ladders,
    shared: &Shared,
    engine: &mut Engine,
    tenants: &mut [Tenant],
    budget: Budget,
) -> Fit {
    let forced = tenants.iter().find_map(|t| {
        let (at, to) = t.job.opts.force_switch?;
        (at == t.out.len() && t.started && t.fed == 0 && to != engine.rung && to < l.costs.len())
            .then_some(to)
    });
    let to = if let Some(to) = forced {
        to
    } else {
        let holding: u64 = tenants.iter().map(Tenant::holding).sum();
        // Coming out of a park, the batch resumes on the largest rung memory holds again
        // (never above home), as a parked session does: a switch like any other.
        let resuming = tenants.iter().any(|t| t.parked_since.is_some());
        if resuming
            && let Some(best) =
                (l.home..l.costs.len()).find(|&i| l.need(i, holding) <= budget.bytes)
        {
            if best == engine.rung {
                return Fit::Run;
            }
            return match move_all(l, shared, engine, tenants, best, budget) {
                Ok(()) => {
                    publish_batch(shared, l, engine, tenants);
                    Fit::Run
                }
                Err(e) => Fit::Failed(ApiError::from_session(&e)),
            };
        }
        // Kept caches go first, oldest first, before any running answer moves.
        while l.need(engine.rung, holding + engine.kept_cells()) > budget.bytes
            && engine.let_go_oldest(shared)
        {}
        if l.need(engine.rung, holding) <= budget.bytes {
            return Fit::Run;
        }
        match (engine.rung + 1..l.costs.len()).find(|&i| l.need(i, holding) <= budget.bytes) {
            Some(to) => to,
            None => return Fit::Stall,
        }
    };
    match move_all(l, shared, engine, tenants, to, budget) {
        Ok(()) => {
            publish_batch(shared, l, engine, tenants);
            Fit::Run
        }
        Err(e) => Fit::Failed(ApiError::from_session(&e)),
    }
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

/// Carries every tenant to rung `to`: each sequence exported alone, projected and imported
/// into the destination's context (or re-read there when the route has no projector).
fn move_all(
    l: &mut Ladders,
    shared: &Shared,
    engine: &mut Engine,
    tenants: &mut [Tenant],
    to: usize,
    budget: Budget,
) -> Result<(), SessionError> {
    let from = engine.rung;
    let (from_name, to_name) = (l.name(from).to_string(), l.name(to).to_string());
    // Kept caches are not carried: the next turn of their conversations is re-read.
    engine.let_go_all(shared);
    let t_load = Instant::now();
    let mut dst = l.load(to)?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let projector = l.routes.get(from, to);
    let cache_type = l.config.cache_type;
    let dst_model = Arc::clone(dst.ctx.model());
    for t in tenants.iter_mut() {
        let seq = dst.ctx.add_seq().ok_or_else(|| SessionError::Engine {
            rung: to_name.clone(),
            source: crate::engine::EngineError::OutOfRange {
                what: "sequences on the destination",
                value: u64::from(l.slots),
            },
        })?;
        if !t.started {
            // No token yet: the prompt is simply read on the destination.
            let mut feed = std::mem::take(&mut t.cached);
            feed.extend_from_slice(&t.feed[t.fed..]);
            engine.ctx.remove_seq(t.seq);
            (t.feed, t.fed, t.seq) = (feed, 0, seq);
            continue;
        }
        let t0 = Instant::now();
        let carried = engine
            .ctx
            .export_seq(t.seq)
            .map_err(|e| e.to_string())
            .and_then(|blob| {
                let export_ms = t0.elapsed().as_secs_f64() * 1e3;
                let p = projector.as_ref().map_err(ToString::to_string)?;
                let tp = Instant::now();
                let (bytes, flops, cells) =
                    project_blob(&blob, p, cache_type).map_err(|e| e.to_string())?;
                let project_ms = tp.elapsed().as_secs_f64() * 1e3;
                let ti = Instant::now();
                dst.ctx.import_seq(seq, &bytes).map_err(|e| e.to_string())?;
                Ok(SwitchTimings {
                    export_ms,
                    project_ms,
                    import_ms: ti.elapsed().as_secs_f64() * 1e3,
                    cells,
                    flops,
                    ..SwitchTimings::default()
                })
            });
        engine.ctx.remove_seq(t.seq);
        let n_tokens = t.cached.len() as u64;
        let (method, timings, note) = match carried {
            Ok(timings) => (SwitchMethod::Molt, timings, None),
            Err(why) => {
                // Re-read the history on the destination, then the pending token.
                let mut feed = std::mem::take(&mut t.cached);
                feed.extend_from_slice(&t.feed[t.fed..]);
                // The destination's sequence is in use and empty (a failed import leaves
                // nothing behind).
                (t.feed, t.fed) = (feed, 0);
                (
                    SwitchMethod::ReprefillNoProjector,
                    SwitchTimings::default(),
                    Some(format!(
                        "the cache could not be carried ({why}); re-read instead"
                    )),
                )
            }
        };
        t.seq = seq;
        let flops_reprefill = prefill_flops(
            dst_model.n_params(),
            dst_model.n_layer() as u64,
            dst_model.n_embd() as u64,
            n_tokens,
        );
        // What this answer waited: the destination's load and every cache carried before
        // its own.
        let cost_ms = t_load.elapsed().as_secs_f64() * 1e3;
        let info = SwitchInfo {
            at_token: t.out.len(),
            from: from_name.clone(),
            to: to_name.clone(),
            method,
            timings: SwitchTimings {
                cost_ms,
                load_ms,
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
    *engine = dst;
    crate::pressure::trim_heap();
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
    if let Err(source) = engine.ctx.step(&chunks) {
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
                (n.min(t.feed.len() - 1), j)
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
    mut t: Tenant,
    stop: StopReason,
    stopped_by_control: bool,
) {
    keep_or_free(shared, engine, &t);
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
/// continues it ([`Kept`]), when the rung computed every cell itself; frees it otherwise. Tells the
/// conversation store which.
fn keep_or_free(shared: &Shared, engine: &mut Engine, t: &Tenant) {
    // A text completion belongs to no conversation: nothing continues it, so its cells are
    // not kept (as the serial loop does not build a conversation on a completion's cache).
    let Some(id) = t.job.conversation.as_ref().map(|c| c.id.clone()) else {
        engine.ctx.remove_seq(t.seq);
        return;
    };
    let native = t.switches.iter().all(|s| s.method != SwitchMethod::Molt);
    let keep = native && !t.cached.is_empty() && engine.ctx.n_past(t.seq) == Some(t.cached.len());
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
        });
    } else {
        engine.ctx.remove_seq(t.seq);
    }
}

fn failed(shared: &Shared, engine: &mut Engine, t: Tenant, e: &ApiError) {
    engine.ctx.remove_seq(t.seq);
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
