//! The engine side of the service: a bounded FIFO [`Queue`] of [`Job`]s and one engine thread
//! per ladder that owns the [`Session`] and answers jobs one at a time.
//!
//! One thread, one session, because that is what the hardware does anyway: the rungs' decode
//! already uses every core, so two answers decoding at once would each run at half speed
//! while holding two KV caches — more memory for no throughput, the opposite of what a
//! service under memory pressure needs. Concurrent clients therefore wait in the queue
//! (streaming clients are told their position), and the answer in flight streams at full
//! speed. Between answers the session keeps the cache it computed itself, so a conversation
//! continued by its next request re-reads only the new turn; cells projected by a migration
//! are not reused by later answers, and an idle session starts each answer on the largest rung
//! the budget holds for it (see `choose_start`).
//!
//! Admission is deferred while memory is short: before a job starts, the engine checks that
//! the budget holds the smallest rung for the job's whole length (prompt + `max_tokens`, up
//! to the context window), and if not, it waits — telling the client why — until memory
//! comes back, the client leaves, or the admission timeout passes. While it waits, jobs
//! queued behind it that the budget holds now are answered first, so one deferred job blocks
//! no one. A replayed trace is the exception: its value at the start of an answer never
//! changes by waiting, so the job fails at once. A job that could not fit even in all the
//! machine's memory never gets here: the HTTP side refuses it with a 400, as it refuses a
//! full queue with `503 queue_full`, when the request arrives.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde::Serialize;
use tokio::sync::mpsc;

use super::budget::ServerBudget;
use super::control::RequestControl;
use super::conversations::{Class, Conversations, JobConversation};
use super::error::ApiError;
use super::openai::mib;
use super::record::Recorder;
use molt::engine::ChatMessage;
use molt::pressure::{Tick, TraceRefs, process_rss_bytes};
use molt::sched::RungCost;
use molt::session::{Event, GenerateOptions, Generation, Prompt, Session, StopReason};

/// What the engine tells the HTTP side about one job.
// A session event is the large variant (a switch's report) and the one sent for every token;
// boxing it would allocate per token to shrink updates that only pass through a channel.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Update {
    /// Memory is short: admission deferred.
    Deferred {
        /// Why.
        reason: String,
        /// Budget now, bytes.
        budget_bytes: u64,
        /// What the job needs, bytes.
        need_bytes: u64,
    },
    /// The engine took the job.
    Admitted {
        /// Time spent queued (and deferred), ms.
        queue_ms: f64,
    },
    /// A session event, verbatim.
    Session(Event),
    /// The answer is complete (after its `Done` event).
    Finished(Box<Generation>),
    /// The job failed.
    Failed(ApiError),
}

/// One request for the engine.
pub struct Job {
    /// The conversation it continues or starts (`None`: a text completion).
    pub conversation: Option<JobConversation>,
    /// Request id (`chatcmpl-…`).
    pub id: String,
    /// Earlier turns.
    pub history: Vec<ChatMessage>,
    /// What to answer (a user turn, or a completion's standalone prompt).
    pub prompt: Prompt,
    /// Prompt tokens, as measured when the request arrived.
    pub prompt_tokens: usize,
    /// Generation options (forced switch resolved to a rung index).
    pub opts: GenerateOptions,
    /// Stop strings, penalties, grammar, log-probabilities (taken by the engine thread).
    pub control: RequestControl,
    /// Set when the client has gone.
    pub cancel: Arc<AtomicBool>,
    /// Where updates go.
    pub tx: mpsc::UnboundedSender<Update>,
    /// When the request arrived.
    pub received: Instant,
}

impl Job {
    pub(super) fn send(&self, u: Update) -> bool {
        self.tx.send(u).is_ok()
    }

    pub(super) fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::SeqCst) || self.tx.is_closed()
    }
}

/// A bounded FIFO of jobs waiting for the engine (the job being answered is not in it).
pub struct Queue {
    inner: Mutex<QueueInner>,
    cv: Condvar,
    capacity: usize,
}

struct QueueInner {
    jobs: VecDeque<Job>,
    closed: bool,
}

impl Queue {
    /// A queue holding at most `capacity` waiting jobs.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(QueueInner {
                jobs: VecDeque::new(),
                closed: false,
            }),
            cv: Condvar::new(),
            capacity,
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueInner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends a job; its 1-based position, or the job back when the queue is full or closed.
    /// Waiting jobs whose clients have left are dropped first, each handed to `gone` (to be
    /// counted and recorded: a request nobody answered must still show somewhere).
    ///
    /// # Errors
    /// The job, when it was not queued.
    pub fn push(&self, job: Job, mut gone: impl FnMut(&Job)) -> Result<usize, Box<Job>> {
        let mut g = self.lock();
        // Jobs whose clients left are dropped here, so they do not hold places.
        g.jobs.retain(|j| {
            let left = j.cancelled();
            if left {
                gone(j);
            }
            !left
        });
        if g.closed || g.jobs.len() >= self.capacity {
            return Err(Box::new(job));
        }
        g.jobs.push_back(job);
        let n = g.jobs.len();
        drop(g);
        self.cv.notify_one();
        Ok(n)
    }

    /// Takes the waiting job that goes first — foreground before background, then the higher
    /// priority, then the one that came first — waiting at most `wait` for one: what the
    /// one-at-a-time loop answers next. [`Next::Idle`] when none came within `wait` (the engine
    /// then looks at the budget), [`Next::Closed`] once closed and empty.
    pub(super) fn next(&self, wait: Duration) -> Next {
        let mut g = self.lock();
        let deadline = Instant::now() + wait;
        loop {
            if let Some(i) = first_in_order(&g.jobs, |_| true)
                && let Some(j) = g.jobs.remove(i)
            {
                return Next::Job(Box::new(j));
            }
            if g.closed {
                return Next::Closed;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Next::Idle;
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// As [`Queue::take_first`], but the job that goes first in the order of [`Queue::next`]
    /// among those `fits` accepts: what the one-at-a-time loop answers while an earlier job
    /// is deferred for memory, and what the batched loop lets join when a sequence frees.
    pub(super) fn take_best(&self, fits: impl Fn(&Job) -> bool) -> Option<Job> {
        let mut g = self.lock();
        let i = first_in_order(&g.jobs, |j| !j.cancelled() && fits(j))?;
        g.jobs.remove(i)
    }

    /// Puts back a job taken out of the queue and not started, ahead of the others (it came
    /// before them). It held a place, so a full queue takes it back too; a closed one as well:
    /// shutting down answers or refuses what is queued, and this job with them.
    pub(super) fn put_back(&self, job: Job) {
        self.lock().jobs.push_front(job);
        self.cv.notify_one();
    }

    /// Whether some waiting job (not cancelled) satisfies `f`.
    pub(super) fn any(&self, f: impl Fn(&Job) -> bool) -> bool {
        self.lock().jobs.iter().any(|j| !j.cancelled() && f(j))
    }

    /// Takes the first waiting job that `fits` accepts, without waiting: what the engine
    /// answers while an earlier job is deferred for memory.
    pub(super) fn take_first(&self, fits: impl Fn(&Job) -> bool) -> Option<Job> {
        let mut g = self.lock();
        let i = g.jobs.iter().position(|j| !j.cancelled() && fits(j))?;
        g.jobs.remove(i)
    }

    /// Waiting jobs.
    pub fn waiting(&self) -> usize {
        self.lock().jobs.len()
    }

    /// Capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stops accepting jobs; those waiting are told the server is going away.
    pub fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        for j in g.jobs.drain(..) {
            j.send(Update::Failed(ApiError::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_shutting_down",
                "the server is shutting down",
            )));
        }
        drop(g);
        self.cv.notify_all();
    }
}

/// What [`Queue::next`] found.
pub(super) enum Next {
    /// A job to answer.
    Job(Box<Job>),
    /// Nothing arrived in time.
    Idle,
    /// The queue is closed and empty.
    Closed,
}

/// Where a job goes in the one-at-a-time loop's order: foreground (and requests outside a
/// conversation) before background, then the higher priority; ties keep arrival order.
fn rank(job: &Job) -> (bool, std::cmp::Reverse<i32>) {
    job.conversation
        .as_ref()
        .map_or((false, std::cmp::Reverse(0)), |c| {
            (c.class == Class::Background, std::cmp::Reverse(c.priority))
        })
}

/// The index of the job among those `take` accepts that goes first by [`rank`] (the earliest
/// of equals).
fn first_in_order(jobs: &VecDeque<Job>, take: impl Fn(&Job) -> bool) -> Option<usize> {
    jobs.iter()
        .enumerate()
        .filter(|(_, j)| take(j))
        .min_by_key(|(i, j)| (rank(j), *i))
        .map(|(i, _)| i)
}

/// How long the idle engine waits for a job before it looks at the budget again.
pub(super) const IDLE_POLL: Duration = Duration::from_millis(100);

/// Counters since the server started.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests received on the chat endpoint.
    pub received: AtomicU64,
    /// Answers completed.
    pub completed: AtomicU64,
    /// Answers stopped because the client left (or skipped while queued).
    pub cancelled: AtomicU64,
    /// Answers that failed in the engine.
    pub failed: AtomicU64,
    /// Refused with 4xx before queueing.
    pub rejected_invalid: AtomicU64,
    /// Refused with 503, queue full.
    pub rejected_queue_full: AtomicU64,
    /// Admissions deferred for memory.
    pub deferred: AtomicU64,
    /// Migrations between rungs.
    pub switches: AtomicU64,
    /// Tokens generated.
    pub tokens: AtomicU64,
    /// Times the idle engine released its rungs because the budget no longer held them.
    pub released: AtomicU64,
}

/// What the engine publishes about itself.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStatus {
    /// The rung the session is on.
    pub current_rung: String,
    /// Rungs loaded now.
    pub loaded: Vec<String>,
    /// The micro-batch and repack the current rung runs with, and why ([`molt::speed`]);
    /// `None` while no rung is loaded.
    pub setup: Option<String>,
    /// What that setup costs above Molt's default, MiB (repacked weights, a larger compute
    /// buffer): part of the current rung's cost in `rungs`; the rung loaded again with the
    /// default costs that much less.
    pub setup_extra_mib: f64,
    /// The request being answered.
    pub running: Option<String>,
    /// The policy's cost of each rung.
    pub rungs: Vec<RungStatus>,
    /// Which migration routes have a usable projector.
    pub routes: Vec<RouteStatus>,
    /// Measured footprint of the loaded rungs (resident weights + contexts), MiB.
    pub measured_footprint_mib: f64,
    /// Context window.
    pub n_ctx: u32,
    /// Decode threads.
    pub n_threads: u32,
    /// The policy's usage of what the engine holds, bytes: the current rung's resident cost
    /// (none while parked or released) + the KV of the tokens it caches + standby rungs.
    /// Published between answers, at an answer's start and after every switch or lever.
    pub modelled_bytes: u64,
    /// The weights are parked mid-answer (the budget holds no rung).
    pub parked: bool,
    /// The idle engine holds no rung at all: the budget no longer held the one it sat on, so
    /// its conversation was hibernated and the weights freed; the next answer loads a rung.
    pub released: bool,
    #[serde(skip)]
    pub(crate) costs: Vec<RungCost>,
}

/// One rung's cost.
#[derive(Debug, Clone, Serialize)]
pub struct RungStatus {
    /// Name.
    pub name: String,
    /// Weights alone (the file's tensor bytes, all resident while the rung runs), MiB.
    pub weights_mib: f64,
    /// Weights + compute buffers (measured when the rung was loaded), MiB.
    pub resident_mib: f64,
    /// KV bytes per token.
    pub kv_bytes_per_token: u64,
    /// With a full context window, MiB.
    pub full_context_mib: f64,
}

/// One route's availability.
#[derive(Debug, Clone, Serialize)]
pub struct RouteStatus {
    /// Source rung.
    pub from: String,
    /// Destination rung.
    pub to: String,
    /// A projector is loaded for it.
    pub ready: bool,
    /// Why not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// Everything the HTTP handlers and the engine thread share.
pub struct Shared {
    /// Waiting jobs.
    pub queue: Queue,
    /// The budget.
    pub budget: ServerBudget,
    /// The record file.
    pub recorder: Recorder,
    /// Counters.
    pub counters: Counters,
    /// Published by the engine after every job.
    pub engine: Mutex<EngineStatus>,
    /// The session's own cancel flag, so a client leaving mid-answer (or mid-stall, when no
    /// event flows) stops it at the next check.
    pub session_cancel: OnceLock<Arc<AtomicBool>>,
    /// How long a job may wait for memory.
    pub admission_timeout: Duration,
    /// The kept conversations and their state files.
    pub conversations: Conversations,
}

impl Shared {
    /// The engine status.
    pub fn engine(&self) -> MutexGuard<'_, EngineStatus> {
        self.engine
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the smallest rung needs to answer a job of `tokens` total length (prompt +
    /// `max_tokens`), bytes: the session's own admission test, which counts no more than the
    /// context window (an answer ends when the context is full).
    pub fn need_bytes(&self, tokens: usize) -> Option<u64> {
        let e = self.engine();
        let tokens = (tokens as u64).min(u64::from(e.n_ctx));
        e.costs
            .last()
            .map(|c| c.resident_bytes() + c.kv_bytes(tokens))
    }

    /// Footprints with a full context, by rung name: the references a trace's `frac … of`
    /// events resolve against.
    pub fn trace_refs(&self) -> TraceRefs {
        let e = self.engine();
        e.costs
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.resident_bytes() + c.kv_bytes(u64::from(e.n_ctx)),
                )
            })
            .collect()
    }

    /// One look at a request waiting for memory (the budget, `budget` bytes, does not hold the
    /// smallest rung for its `total` tokens, `need` bytes): `Err` with the error for its client
    /// when waiting cannot help (a replayed trace starts there) or has lasted the admission
    /// timeout; otherwise the client is told why it waits, once per budget value, through its
    /// sender `tx` (the first time counted as a deferral and recorded). Both request loops call
    /// this, so a client hears the same words from either.
    ///
    /// # Errors
    /// The `insufficient_memory` error to answer the request with.
    pub(super) fn still_deferred(
        &self,
        id: &str,
        tx: &mpsc::UnboundedSender<Update>,
        wait: &mut Deferral,
        budget: u64,
        need: u64,
        total: usize,
    ) -> Result<(), ApiError> {
        let reason = format!(
            "the budget ({:.0} MiB) cannot hold the smallest rung for this request ({:.0} MiB for {total} tokens)",
            to_mib(budget),
            to_mib(need)
        );
        let give_up = if self.budget.is_trace() {
            Some(format!(
                "{reason}; the replayed trace starts there, so waiting cannot help"
            ))
        } else if wait.since.elapsed() >= self.admission_timeout {
            Some(format!(
                "{reason}, and memory did not come back within {} s",
                self.admission_timeout.as_secs()
            ))
        } else {
            None
        };
        if let Some(message) = give_up {
            return Err(ApiError::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "insufficient_memory",
                message,
            ));
        }
        if wait.told != Some(budget) {
            if wait.told.is_none() {
                self.counters.deferred.fetch_add(1, Ordering::Relaxed);
            }
            wait.told = Some(budget);
            self.recorder.service(
                id,
                "deferred",
                serde_json::json!({"budget_mib": mib(budget), "need_mib": mib(need)}),
            );
            let _ = tx.send(Update::Deferred {
                reason: format!("{reason}; waiting for memory"),
                budget_bytes: budget,
                need_bytes: need,
            });
        }
        Ok(())
    }

    /// Tells the engine that the client of `id` has gone.
    pub fn cancel(&self, id: &str, flag: &AtomicBool) {
        flag.store(true, Ordering::SeqCst);
        if self.engine().running.as_deref() == Some(id)
            && let Some(c) = self.session_cancel.get()
        {
            c.store(true, Ordering::SeqCst);
        }
    }
}

/// A request waiting for memory: since when, and the budget its client was last told about.
#[derive(Debug)]
pub(super) struct Deferral {
    since: Instant,
    told: Option<u64>,
}

impl Deferral {
    /// Starts waiting now.
    pub(super) fn new() -> Self {
        Self {
            since: Instant::now(),
            told: None,
        }
    }
}

pub(super) fn to_mib(bytes: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let m = bytes as f64 / f64::from(1 << 20);
    (m * 10.0).round() / 10.0
}

/// Publishes the session's state for `GET /v1/molt/status` and the HTTP side's checks.
pub fn publish(shared: &Shared, session: &mut Session, running: Option<String>, routes: bool) {
    let costs = session.rung_costs();
    let n_ctx = session.config().n_ctx;
    let n_threads = session.config().n_threads;
    let names: Vec<String> = session
        .ladder()
        .rungs
        .iter()
        .map(|r| r.name().to_string())
        .collect();
    let loaded = session
        .loaded()
        .iter()
        .zip(&names)
        .filter(|(l, _)| **l)
        .map(|(_, n)| n.clone())
        .collect();
    let route_status = routes.then(|| {
        let mut v = Vec::new();
        for (i, a) in names.iter().enumerate() {
            for (j, b) in names.iter().enumerate() {
                if i != j {
                    let r = session.routes_mut().get(i, j);
                    v.push(RouteStatus {
                        from: a.clone(),
                        to: b.clone(),
                        ready: r.is_ok(),
                        problem: r.err().map(|e| e.to_string()),
                    });
                }
            }
        }
        v
    });
    let footprint = to_mib(session.measured_footprint());
    let mut e = shared.engine();
    e.current_rung = session.current_rung().to_string();
    let setup = session.rung_setup(session.current_index());
    e.setup = setup.map(|s| s.to_string());
    e.setup_extra_mib = to_mib(setup.map_or(0, |s| s.extra_bytes));
    e.loaded = loaded;
    e.running = running;
    e.rungs = rung_statuses(&costs, n_ctx, None);
    if let Some(r) = route_status {
        e.routes = r;
    }
    e.measured_footprint_mib = footprint;
    e.modelled_bytes = if session.is_released() {
        0
    } else {
        session.modelled_now(session.history().len() as u64)
    };
    e.parked = session.is_parked();
    e.released = session.is_released();
    e.n_ctx = n_ctx;
    e.n_threads = n_threads;
    e.costs = costs;
}

/// The status's cost of each rung, `extra` (rung, bytes) added to one: what the setup it is
/// loaded with costs above the default, when the costs do not hold it.
pub(super) fn rung_statuses(
    costs: &[RungCost],
    n_ctx: u32,
    extra: Option<(usize, u64)>,
) -> Vec<RungStatus> {
    costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let more = extra.filter(|&(r, _)| r == i).map_or(0, |(_, b)| b);
            let resident = c.resident_bytes() + more;
            RungStatus {
                name: c.name.clone(),
                weights_mib: to_mib(c.weights_bytes),
                resident_mib: to_mib(resident),
                kv_bytes_per_token: c.kv_bytes_per_token,
                full_context_mib: to_mib(resident + c.kv_bytes(u64::from(n_ctx))),
            }
        })
        .collect()
}

/// Loads and frees every rung but the current one, one at a time, so that each rung's context
/// cost is measured (the session keeps the measurement after unloading).
///
/// # Errors
/// A rung that fails to load.
pub fn measure_rungs(session: &mut Session) -> Result<(), molt::session::SessionError> {
    let current = session.current_index();
    for i in 0..session.ladder().rungs.len() {
        if i != current && !session.loaded()[i] {
            session.ensure_loaded(i)?;
            session.unload(i);
        }
    }
    Ok(())
}

/// The engine thread's loop: answers jobs until the queue is closed. `settled` is told once
/// the first rung has its speed setup (the server's start waits for it).
pub fn run(mut session: Session, shared: &Shared, settled: tokio::sync::oneshot::Sender<()>) {
    let cancel = session.cancel_handle();
    let _ = shared.session_cancel.set(Arc::clone(&cancel));
    // Whether the cache holds cells projected by a transplant in an earlier answer.
    let mut projected = false;
    retune_at_start(&mut session, shared);
    let _ = settled.send(());
    loop {
        // While what an answer's size switch left out is still to read, the queue is only
        // looked at: the read goes on between requests, a micro-batch at a time, and a
        // request that comes reads what is left first.
        let wait = if session.fill_due() > 0 {
            Duration::ZERO
        } else {
            IDLE_POLL
        };
        let mut job = match shared.queue.next(wait) {
            Next::Job(job) => job,
            Next::Idle if session.fill_due() > 0 => {
                if let Err(e) = session.fill_idle(1) {
                    shared.recorder.service(
                        "",
                        "fill failed",
                        serde_json::json!({"rung": session.current_rung(), "error": e.to_string()}),
                    );
                }
                continue;
            }
            Next::Idle => {
                follow_budget_idle(&mut session, shared, &mut projected, None);
                continue;
            }
            Next::Closed => break,
        };
        if job.cancelled() {
            shared.conversations.unqueue(job.conversation.as_ref());
            shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            shared.recorder.service(
                &job.id,
                "skipped",
                serde_json::json!({"reason": "client gone while queued"}),
            );
            continue;
        }
        serve(&mut session, shared, &mut job, &cancel, &mut projected);
    }
    // Shutting down: the conversation in the engine goes to its state file like any other.
    if let Some(id) = shared.conversations.live() {
        shared
            .conversations
            .hibernate_live(&mut session, &id, &shared.recorder);
    }
}

/// The rung was loaded before any budget was read: under the operator's, it is loaded again
/// when the speed policy chooses another setup for it ([`molt::speed`]), as `chat` and
/// `generate` do before their first prompt — before the first request, which otherwise waited
/// for that reload (a `molt-serial` TTFT of 2,145 ms at one stream in a `serve_concurrency`
/// run, tier0 repacked on its first answer). A failed load leaves the rung unloaded; the first
/// answer loads it.
fn retune_at_start(session: &mut Session, shared: &Shared) {
    let Ok(b) = shared.budget.read(Tick::default()) else {
        return;
    };
    match retune(session, shared, "", b.bytes) {
        Ok(true) => publish(shared, session, None, false),
        Ok(false) => {}
        Err(e) => eprintln!(
            "molt serve: cannot load {} with its speed setup: {e}",
            session.current_rung()
        ),
    }
}

/// [`Session::retune_with`] under `budget`, recorded (for request `id`, empty at start) when
/// the rung was loaded again. Whether it was.
fn retune(
    session: &mut Session,
    shared: &Shared,
    id: &str,
    budget: u64,
) -> Result<bool, molt::session::SessionError> {
    let Some(setup) = session.retune_with(budget)? else {
        return Ok(false);
    };
    shared.recorder.service(
        id,
        "retuned",
        serde_json::json!({"rung": session.current_rung(), "setup": setup.to_string()}),
    );
    Ok(true)
}

/// What an idle engine does between jobs (and while a job waits for memory): when the budget no
/// longer holds what the session holds — its rung with the conversation's cache — the
/// conversation goes to its state file and every rung is freed, weights and contexts with
/// their KV pages, so the server's memory follows a falling budget down to the process's own
/// floor instead of waiting for the next request to act. Nothing is lost: the next request of
/// that conversation wakes it from its file and reads only its new turn, and the next answer
/// loads the largest rung the budget then holds.
///
/// `waiting` is the job deferred for memory while this runs, if any: it stays published as
/// the running one, so requests arriving meanwhile are told they queue behind it.
fn follow_budget_idle(
    session: &mut Session,
    shared: &Shared,
    projected: &mut bool,
    waiting: Option<&str>,
) {
    if session.is_released() {
        return;
    }
    let Ok(b) = shared.budget.read(Tick::default()) else {
        return;
    };
    let held = session.modelled_now(session.history().len() as u64);
    if held <= b.bytes {
        return;
    }
    let hibernated = shared.conversations.live();
    match &hibernated {
        Some(id) => shared
            .conversations
            .hibernate_live(session, id, &shared.recorder),
        None => session.reset(),
    }
    *projected = false;
    match session.release_idle() {
        Ok(true) => {
            shared.counters.released.fetch_add(1, Ordering::Relaxed);
            shared.recorder.service(
                "",
                "released",
                serde_json::json!({
                    "budget_mib": mib(b.bytes),
                    "held_mib": mib(held),
                    "hibernated": hibernated,
                }),
            );
        }
        Ok(false) => {}
        Err(e) => eprintln!("molt serve: cannot release the idle rungs: {e}"),
    }
    publish(shared, session, waiting.map(str::to_string), false);
}

/// Answers one job start to end: publishes it as running, answers, gives freed memory back,
/// publishes the engine idle, and sends the client its last update.
fn serve(
    session: &mut Session,
    shared: &Shared,
    job: &mut Job,
    cancel: &Arc<AtomicBool>,
    projected: &mut bool,
) {
    publish(shared, session, Some(job.id.clone()), false);
    let loaded_before = session.loaded();
    let mut control = std::mem::take(&mut job.control);
    let last = answer(session, shared, job, &mut control, cancel, projected);
    // Hand memory freed by an unloaded rung back to the system. glibc keeps freed heap
    // memory for reuse, and after a rung's contexts are freed it raises its mmap
    // threshold, so the next rung's buffers come from the heap and fragment it: measured
    // on the tiny ladder, 600 answers with 1200 rung loads took the resident set from 29
    // to 59 MiB by default and kept it at 26 MiB with a small mmap threshold. A service
    // that exists to give memory back when asked must actually give it back.
    if session.loaded() != loaded_before {
        molt::pressure::trim_heap();
    }
    // Publish before the client hears the end, so a status query made after `[DONE]`
    // sees the rung the answer ended on.
    publish(shared, session, None, false);
    if let Some(u) = last {
        job.send(u);
    }
}

/// Waits until the budget holds the smallest rung for the job. `Err` when the job must not
/// run (client gone: `None`; otherwise the error to report). While it waits, jobs queued
/// behind it that the budget holds now are answered first: a deferred job must not block the
/// ones that fit.
fn admit(
    session: &mut Session,
    shared: &Shared,
    job: &Job,
    cancel: &Arc<AtomicBool>,
    projected: &mut bool,
) -> Result<(), Option<ApiError>> {
    let total = job.prompt_tokens.saturating_add(job.opts.max_tokens);
    let Some(need) = shared.need_bytes(total) else {
        return Ok(());
    };
    let mut wait = Deferral::new();
    loop {
        if job.cancelled() {
            return Err(None);
        }
        let b = shared
            .budget
            .read(Tick::default())
            .map_err(|e| Some(ApiError::internal(format!("reading the budget: {e}"))))?;
        if b.bytes >= need {
            return Ok(());
        }
        shared
            .still_deferred(&job.id, &job.tx, &mut wait, b.bytes, need, total)
            .map_err(Some)?;
        let fits = |j: &Job| {
            shared
                .need_bytes(j.prompt_tokens.saturating_add(j.opts.max_tokens))
                .is_none_or(|n| n <= b.bytes)
        };
        if let Some(mut other) = shared.queue.take_best(fits) {
            shared.recorder.service(
                &other.id,
                "overtook",
                serde_json::json!({"deferred": job.id}),
            );
            serve(session, shared, &mut other, cancel, projected);
            publish(shared, session, Some(job.id.clone()), false);
            continue;
        }
        // Waiting for memory is idle time: what the engine holds follows the budget down.
        follow_budget_idle(session, shared, projected, Some(&job.id));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Answers one job; the last update for its client (`None` if the client has gone).
/// Where an answer starts. The session reuses whatever prefix of the new prompt its cache
/// holds, which is right for cells it computed itself but not for cells a transplant projected
/// for an earlier answer: a new answer built on them — even on the three template tokens every
/// chat prompt shares, the attention sink among them — has been seen (real ladder) to end at
/// once or to answer a conversation that never happened. So after an answer that migrated by
/// transplant, the cache is dropped. And an idle session is moved to the largest rung that
/// holds this request whole before the prompt is read, rather than reading it on a rung that
/// would migrate at the first token.
fn choose_start(
    session: &mut Session,
    shared: &Shared,
    job: &Job,
    projected: &mut bool,
) -> Result<(), molt::session::SessionError> {
    let total = (job.prompt_tokens.saturating_add(job.opts.max_tokens) as u64)
        .min(u64::from(session.config().n_ctx));
    let budget = shared
        .budget
        .read(Tick::default())
        .map_or(super::budget::UNLIMITED_BYTES, |b| b.bytes);
    let home = session.home_index();
    let best_of = |costs: &[molt::sched::RungCost]| {
        (home..costs.len())
            .find(|&i| costs[i].resident_bytes() + costs[i].kv_bytes(total) <= budget)
            .unwrap_or(costs.len() - 1)
    };
    let mut best = best_of(&session.rung_costs());
    // The current rung loaded with a setup that costs more than the default (repack) and no
    // longer held with it: loaded again with the setup the budget holds, before the request is
    // moved to a smaller rung for it.
    let current = session.current_index();
    if best > current
        && session
            .rung_setup(current)
            .is_some_and(|s| s.extra_bytes > 0)
    {
        session.reset();
        *projected = false;
        if retune(session, shared, &job.id, budget)? {
            best = best_of(&session.rung_costs());
        }
    }
    let from = session.current_rung().to_string();
    let moved = best != session.current_index();
    if moved || *projected {
        session.reset();
        session.move_idle(best)?;
        shared.recorder.service(
            &job.id,
            "fresh_start",
            serde_json::json!({
                "from": from,
                "rung": session.current_rung(),
                "reason": if moved { "the budget picks another rung" } else { "the cache held projected cells" },
            }),
        );
        *projected = false;
    }
    Ok(())
}

fn answer(
    session: &mut Session,
    shared: &Shared,
    job: &Job,
    control: &mut RequestControl,
    cancel: &Arc<AtomicBool>,
    projected: &mut bool,
) -> Option<Update> {
    match admit(session, shared, job, cancel, projected) {
        Ok(()) => {}
        Err(None) => {
            shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            shared.recorder.service(
                &job.id,
                "skipped",
                serde_json::json!({"reason": "client gone while deferred"}),
            );
            return None;
        }
        Err(Some(e)) => {
            shared.counters.failed.fetch_add(1, Ordering::Relaxed);
            shared.recorder.service(&job.id, "failed", e.json());
            return Some(Update::Failed(e));
        }
    }
    let takeover =
        shared
            .conversations
            .take_engine(session, job.conversation.as_ref(), &shared.recorder);
    if takeover.hibernated.is_some() || takeover.woken_tokens > 0 {
        // The session now holds a woken native cache, or nothing.
        *projected = false;
    }
    if let Some(c) = &job.conversation {
        shared.recorder.service(
            &job.id,
            "conversation",
            serde_json::json!({"id": c.id, "new": c.new, "takeover": takeover}),
        );
    }
    if let Err(e) = choose_start(session, shared, job, projected) {
        let api = ApiError::from_session(&e).for_prompt(&job.prompt);
        shared.counters.failed.fetch_add(1, Ordering::Relaxed);
        shared.recorder.service(&job.id, "failed", api.json());
        return Some(Update::Failed(api));
    }
    let queue_ms = job.received.elapsed().as_secs_f64() * 1e3;
    shared.recorder.service(
        &job.id,
        "admitted",
        serde_json::json!({"queue_ms": queue_ms}),
    );
    job.send(Update::Admitted { queue_ms });
    session.set_conversation(job.history.clone());
    {
        // What the answer will hold once its prompt is read, for the status while it runs.
        let modelled = session.modelled_now(job.prompt_tokens as u64);
        let mut e = shared.engine();
        e.current_rung = session.current_rung().to_string();
        e.modelled_bytes = modelled;
        e.parked = false;
        e.released = false;
    }
    let conversation = job.conversation.as_ref().map(|c| c.id.as_str());
    let mut parked = false;
    let mut sink = |e: &Event| {
        shared.recorder.session(&job.id, e);
        match e {
            Event::Switch(_) => {
                shared.counters.switches.fetch_add(1, Ordering::Relaxed);
            }
            Event::Footprint(f) => {
                let mut s = shared.engine();
                s.current_rung.clone_from(&f.rung);
                s.modelled_bytes = f.modelled_bytes;
                s.parked = f.parked;
            }
            Event::Stall { .. } if !parked => {
                parked = true;
                if let Some(id) = conversation {
                    shared.conversations.set_parked(id, true);
                }
            }
            Event::Token { .. } if parked => {
                parked = false;
                if let Some(id) = conversation {
                    shared.conversations.set_parked(id, false);
                }
            }
            _ => {}
        }
        // A client that left stops the answer at the next token: the session checks this
        // flag before every token (and while stalled).
        if !job.send(Update::Session(e.clone())) || job.cancel.load(Ordering::SeqCst) {
            cancel.store(true, Ordering::SeqCst);
        }
    };
    let r = session.generate_with(&job.prompt, &job.opts, control, &mut sink);
    match r {
        Ok(g) => {
            // Projected cells are kept when the session re-reads, before the next answer, the
            // ones its question looks at; otherwise the next request re-reads the conversation.
            *projected = !session.cache_is_trustworthy();
            let kv = session
                .rung_costs()
                .get(session.current_index())
                .map_or(0, |c| c.kv_bytes(session.history().len() as u64));
            shared.conversations.after_answer(
                session,
                job.conversation.as_ref().map(|c| c.id.as_str()),
                g.prompt_tokens,
                kv,
            );
            shared
                .counters
                .tokens
                .fetch_add(g.tokens.len() as u64, Ordering::Relaxed);
            if g.stop == StopReason::Cancelled {
                shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
                shared.recorder.service(
                    &job.id,
                    "disconnected",
                    serde_json::json!({"tokens": g.tokens.len()}),
                );
            } else {
                shared.counters.completed.fetch_add(1, Ordering::Relaxed);
            }
            Some(Update::Finished(Box::new(g)))
        }
        Err(e) => {
            // What the cache holds after a failure mid-answer is unknown: start clean.
            *projected = true;
            shared.conversations.drop_live(session);
            let api = ApiError::from_session(&e);
            shared.counters.failed.fetch_add(1, Ordering::Relaxed);
            shared.recorder.service(&job.id, "failed", api.json());
            Some(Update::Failed(api))
        }
    }
}

/// Resident set of this process, bytes (0 if unreadable).
#[must_use]
pub fn rss_bytes() -> u64 {
    process_rss_bytes().unwrap_or(0)
}
