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
//! What the one-at-a-time loop ([`super::worker`], `serve --serial`) does and this one does
//! not (yet): a continued conversation re-reads its whole history (no cache is kept between
//! requests), a rung change mid-answer only goes down (answers start on the best rung the
//! budget holds when the engine is idle), and waiting for memory is a stall, not a park.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use super::control::RequestControl;
use super::error::ApiError;
use super::openai::mib;
use super::worker::{Job, Shared, Update};
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

/// The most prompt tokens one step carries: a newcomer's prefill delays the running answers'
/// next token by at most this many tokens' compute.
pub const PREFILL_CHUNK: usize = 64;

/// How often a stalled batch (no rung holds it) re-reads the budget.
const STALL_POLL: Duration = Duration::from_millis(50);

/// The rung the batch runs on: its model and the context holding every tenant's sequence.
struct Engine {
    rung: usize,
    ctx: BatchContext,
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
    stalled: bool,
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
        Ok(Engine { rung, ctx })
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
    loop {
        if drop_departed(shared, &mut engine, &mut tenants) {
            publish_batch(shared, &l, &engine, &tenants);
        }
        if tenants.is_empty() {
            let Some(job) = shared.queue.pop() else {
                return;
            };
            if job.cancelled() {
                skipped(shared, &job, "client gone while queued");
                continue;
            }
            let (moved, t) = start_idle(shared, &l, engine, job);
            engine = match moved {
                Ok(e) => e,
                Err(e) => {
                    // The engine could not load a rung: nothing else can run either.
                    fail_all_waiting(shared, &e);
                    return;
                }
            };
            let Some(t) = t else {
                continue;
            };
            tenants.push(t);
            last_budget = None;
        }
        join_waiting(shared, &l, &mut engine, &mut tenants);
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
                stall(shared, &l, &mut tenants, budget);
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
            if t.stalled {
                t.stalled = false;
            }
        }
        step(shared, &l, &mut engine, &mut tenants);
    }
}

/// A request that never ran because its client left.
fn skipped(shared: &Shared, job: &Job, reason: &str) {
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

fn to_mib(bytes: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let m = bytes as f64 / f64::from(1 << 20);
    m
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
    let Some(seq) = engine.ctx.add_seq() else {
        refuse(shared, &job, &ApiError::internal("no free sequence"));
        return None;
    };
    let queue_ms = job.received.elapsed().as_secs_f64() * 1e3;
    shared.recorder.service(
        &job.id,
        "admitted",
        serde_json::json!({"queue_ms": queue_ms, "rung": name, "sequence": seq}),
    );
    let _ = job.tx.send(Update::Admitted { queue_ms });
    let mut job = job;
    let control = std::mem::take(&mut job.control);
    let now = Instant::now();
    Some(Tenant {
        seq,
        sampler: Sampler::new(job.opts.sampling),
        prompt_tokens: tokens.len(),
        reused: 0,
        feed: tokens,
        fed: 0,
        cached: Vec::new(),
        started: false,
        stalled: false,
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
    shared.counters.failed.fetch_add(1, Ordering::Relaxed);
    shared.recorder.service(&job.id, "failed", e.json());
    let _ = job.tx.send(Update::Failed(e.clone()));
}

/// The first request of an idle engine: waits (deferred) until the budget holds the smallest
/// rung for it, moves the engine to the largest rung that holds it (never above home), and
/// admits it. Gives the engine back (`Err` when a rung failed to load), with the tenant
/// (`None` when the request did not run: client gone, or refused and told).
fn start_idle(
    shared: &Shared,
    l: &Ladders,
    mut engine: Engine,
    job: Job,
) -> (Result<Engine, ApiError>, Option<Tenant>) {
    let total = (job.prompt_tokens.saturating_add(job.opts.max_tokens) as u64)
        .min(u64::from(l.config.n_ctx));
    let smallest = l.costs.len() - 1;
    let need = l.need(smallest, total);
    let started = Instant::now();
    let mut told = None;
    let budget = loop {
        if job.cancelled() {
            skipped(shared, &job, "client gone while deferred");
            return (Ok(engine), None);
        }
        let b = read_budget(shared, &[]);
        if b.bytes >= need {
            break b.bytes;
        }
        let reason = format!(
            "the budget ({:.0} MiB) cannot hold the smallest rung for this request ({:.0} MiB for {total} tokens)",
            to_mib(b.bytes),
            to_mib(need)
        );
        let give_up = if shared.budget.is_trace() {
            Some(format!(
                "{reason}; the replayed trace starts there, so waiting cannot help"
            ))
        } else if started.elapsed() >= shared.admission_timeout {
            Some(format!(
                "{reason}, and memory did not come back within {} s",
                shared.admission_timeout.as_secs()
            ))
        } else {
            None
        };
        if let Some(message) = give_up {
            let e = ApiError::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "insufficient_memory",
                message,
            );
            refuse(shared, &job, &e);
            return (Ok(engine), None);
        }
        if told != Some(b.bytes) {
            if told.is_none() {
                shared.counters.deferred.fetch_add(1, Ordering::Relaxed);
            }
            told = Some(b.bytes);
            shared.recorder.service(
                &job.id,
                "deferred",
                serde_json::json!({"budget_mib": mib(b.bytes), "need_mib": mib(need)}),
            );
            let _ = job.tx.send(Update::Deferred {
                reason: format!("{reason}; waiting for memory"),
                budget_bytes: b.bytes,
                need_bytes: need,
            });
        }
        std::thread::sleep(STALL_POLL);
    };
    let best = (l.home..l.costs.len())
        .find(|&i| l.need(i, total) <= budget)
        .unwrap_or(smallest);
    if best != engine.rung {
        let from = l.name(engine.rung).to_string();
        // Free the old rung first: the two need not fit together.
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
fn join_waiting(shared: &Shared, l: &Ladders, engine: &mut Engine, tenants: &mut Vec<Tenant>) {
    let mut joined = false;
    while engine.ctx.active() < engine.ctx.max_seqs() {
        let budget = read_budget(shared, tenants).bytes;
        let n_ctx = l.config.n_ctx;
        let reserved: u64 = tenants.iter().map(|t| t.reserved(n_ctx)).sum();
        let rung = engine.rung;
        let fits = |j: &Job| {
            let total =
                (j.prompt_tokens.saturating_add(j.opts.max_tokens) as u64).min(u64::from(n_ctx));
            reserved + total <= u64::from(n_ctx) && l.need(rung, reserved + total) <= budget
        };
        let Some(job) = shared.queue.take_first(fits) else {
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

/// Tells every tenant, once per wait, that the batch is waiting for memory.
fn stall(shared: &Shared, l: &Ladders, tenants: &mut [Tenant], budget: Budget) {
    for t in tenants.iter_mut() {
        t.stall_ms += STALL_POLL.as_secs_f64() * 1e3;
        if !t.stalled {
            t.stalled = true;
            let reason = format!(
                "budget {} MiB is below every rung's footprint for the {} running answers; waiting on {} for memory",
                budget.bytes >> 20,
                l.slots,
                l.name(l.costs.len() - 1)
            );
            t.emit(
                shared,
                Event::Stall {
                    reason,
                    deadline_ms: None,
                },
            );
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
    engine.ctx.remove_seq(t.seq);
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
    let _ = t.job.tx.send(Update::Finished(Box::new(g)));
}

fn failed(shared: &Shared, engine: &mut Engine, t: Tenant, e: &ApiError) {
    engine.ctx.remove_seq(t.seq);
    shared.counters.failed.fetch_add(1, Ordering::Relaxed);
    shared.recorder.service(&t.job.id, "failed", e.json());
    let _ = t.job.tx.send(Update::Failed(e.clone()));
}
