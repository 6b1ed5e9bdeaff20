//! The HTTP surface: routes and their handlers.
//!
//! - `POST /v1/chat/completions` — OpenAI-compatible, streaming (SSE) or not;
//! - `GET /v1/models` — the served ladder, for clients that list models first;
//! - `GET`/`POST /v1/molt/budget` — the memory budget: a fixed value, a replayed trace, the
//!   real system, or none;
//! - `GET /v1/molt/status` — queue, counters, current rung, routes, resident set;
//! - `GET /` — the web page (its routes live in `web`, outside the key check).
//!
//! Everything a request can get wrong is refused before it reaches the queue, with a 4xx and
//! a JSON error: a body that is not JSON, unknown fields, unsupported parameters, a prompt
//! longer than the context window (measured with the ladder's own tokenizer and chat
//! template, exactly as the engine will). Unknown paths and methods answer JSON too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use tokio::sync::mpsc;

use super::budget::{BudgetReport, BudgetRequest};
use super::completions::{CompletionRequest, text_completion};
use super::control::{Pace, Penalties, RequestControl, StopFilter};
use super::error::ApiError;
use super::openai::{
    ChatCompletion, ChatRequest, Choice, ChoiceLogprobs, ConversationWire, MessageOut, SummaryWire,
    TokenLogprob, Usage, ValidRequest, finish_reason, mib,
};
use super::stream::{CancelGuard, ChunkStream, Chunks};
use super::worker::{EngineStatus, Job, Shared, Update, rss_bytes};
use molt::engine::{ChatMessage, Grammar, JSON_GRAMMAR, Model, SamplingParams};
use molt::pressure::Tick;
use molt::session::{Event, GenerateOptions, Prompt};

/// Settings the handlers read.
pub struct Settings {
    /// The model name answered (the ladder's).
    pub model: String,
    /// Rung names, largest first.
    pub rungs: Vec<String>,
    /// Context window.
    pub n_ctx: u32,
    /// `max_tokens` when a request sets none (capped by the room left in the context).
    pub default_max_tokens: usize,
    /// SSE keep-alive interval (also bounds how long a queued client's departure goes
    /// unnoticed).
    pub keep_alive: Duration,
    /// Where trace names are looked up.
    pub trace_dirs: Vec<std::path::PathBuf>,
    /// When the server started.
    pub started: Instant,
    /// The most memory this service could ever have (the cgroup limit or the machine's
    /// total), bytes; `None` when unknown.
    pub memory_ceiling: Option<u64>,
    /// The shortest time between two tokens of an answer.
    pub token_pace: Option<Duration>,
}

/// State shared by every handler.
#[derive(Clone)]
pub struct AppState {
    /// Queue, budget, counters, engine status.
    pub shared: Arc<Shared>,
    /// A vocabulary-only model: tokenizer and chat template, no weights.
    pub tokenizer: Arc<Model>,
    /// Settings.
    pub settings: Arc<Settings>,
}

/// The router.
pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/molt/budget", get(get_budget).post(set_budget))
        .route("/v1/molt/status", get(status))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::with(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such endpoint",
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::with(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed on this endpoint",
    )
}

fn unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "chatcmpl-{:012x}{:04x}",
        rand::random::<u64>() & 0xffff_ffff_ffff,
        N.fetch_add(1, Ordering::Relaxed) & 0xffff
    )
}

/// A body as JSON of type `T`, or the 4xx that says why not.
fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| {
        let status = r.status();
        let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "request_too_large"
        } else {
            "invalid_request_error"
        };
        ApiError::with(status, kind, r.body_text())
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => {
                ApiError::invalid(format!("malformed JSON: {e}")).code("invalid_json")
            }
            Category::Data => ApiError::invalid(format!("invalid request body: {e}")),
        }
    })
}

/// A request checked, measured and ready to queue.
struct Prepared {
    req: ValidRequest,
    prompt_tokens: usize,
    /// The prompt as the engine will read it (a chat's whole rendered conversation).
    tokens: Vec<molt::engine::Token>,
    opts: GenerateOptions,
    control: RequestControl,
}

/// Which endpoint a request came through: the same engine answers both, in their own shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions` (plain text).
    Text,
}

fn validate(
    st: &AppState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<ValidRequest, ApiError> {
    let checked = match endpoint {
        Endpoint::Chat => {
            let req = parse_body::<ChatRequest>(body)?;
            check_model(req.model.as_deref(), &st.settings)?;
            req.validate()
        }
        Endpoint::Text => {
            let req = parse_body::<CompletionRequest>(body)?;
            check_model(req.model.as_deref(), &st.settings)?;
            req.validate()
        }
    };
    checked.map_err(|(m, p)| ApiError::invalid(m).param(p))
}

/// The request's sampling hooks; a grammar is compiled here, so a bad one is a 400 before the
/// request is queued.
fn request_control(st: &AppState, req: &ValidRequest) -> Result<RequestControl, ApiError> {
    let grammar = if req.sampling.json_object {
        Some(
            Grammar::new(Arc::clone(&st.tokenizer), JSON_GRAMMAR)
                .map_err(|e| ApiError::invalid(e.to_string()).param("response_format"))?,
        )
    } else {
        None
    };
    Ok(RequestControl {
        stop: StopFilter::new(req.sampling.stop.clone()),
        penalties: Penalties::new(
            req.sampling.presence_penalty,
            req.sampling.frequency_penalty,
            req.sampling.repeat_penalty,
        ),
        grammar,
        logprobs: req.logprobs,
        pace: st.settings.token_pace.map(Pace::new),
    })
}

async fn prepare(
    st: &AppState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Prepared, ApiError> {
    let req = validate(st, endpoint, body)?;
    let force_switch = match &req.force_switch {
        None => None,
        Some((at, name)) => {
            let i = st
                .settings
                .rungs
                .iter()
                .position(|r| r == name)
                .ok_or_else(|| {
                    ApiError::invalid(format!(
                        "molt.force_switch.to: no rung named {name:?} (rungs: {})",
                        st.settings.rungs.join(", ")
                    ))
                    .param("molt")
                })?;
            Some((*at, i))
        }
    };
    // Measure the prompt exactly as the engine will render and tokenize it, off the async
    // threads (a long prompt takes milliseconds to tokenize).
    let tokenizer = Arc::clone(&st.tokenizer);
    let mut conv = req.history.clone();
    let prompt = req.prompt.clone();
    let tokens = tokio::task::spawn_blocking(move || match prompt {
        Prompt::Standalone(text) | Prompt::Text(text) => tokenizer.tokenize(&text, false),
        Prompt::User(last) => {
            conv.push(ChatMessage::new("user", &last));
            tokenizer.tokenize_chat(&conv, true)
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
    .map_err(|e| ApiError::invalid(format!("cannot render the prompt: {e}")))?;
    let prompt_tokens = tokens.len();
    let n_ctx = st.settings.n_ctx as usize;
    let room = n_ctx.saturating_sub(prompt_tokens);
    let max_tokens = req
        .max_tokens
        .unwrap_or_else(|| st.settings.default_max_tokens.min(room))
        .max(1);
    if let Some((at, _)) = force_switch {
        check_force_at(at, max_tokens)?;
    }
    // The session's own rule: the prompt plus a small reserve for the answer must fit.
    let reserve = max_tokens.clamp(1, 16);
    if prompt_tokens + reserve > n_ctx {
        let (field, takes) = match endpoint {
            Endpoint::Chat => ("messages", "the messages take"),
            Endpoint::Text => ("prompt", "the prompt takes"),
        };
        return Err(ApiError::invalid(format!(
            "this model's context window is {n_ctx} tokens; {takes} {prompt_tokens} tokens and at least {reserve} are needed for the answer"
        ))
        .code("context_length_exceeded")
        .param(field));
    }
    check_fits_machine(st, prompt_tokens.saturating_add(max_tokens))?;
    if st.shared.budget.is_trace()
        && let (Some(need), Ok(b)) = (
            st.shared
                .need_bytes(prompt_tokens.saturating_add(max_tokens)),
            st.shared.budget.read(Tick::default()),
        )
        && b.bytes < need
    {
        return Err(ApiError::with(
            StatusCode::SERVICE_UNAVAILABLE,
            "insufficient_memory",
            format!(
                "the replayed budget trace starts at {:.0} MiB, below the {:.0} MiB the smallest rung needs for this request",
                mib(b.bytes).unwrap_or(0.0),
                mib(need).unwrap_or(0.0)
            ),
        ));
    }
    let opts = GenerateOptions {
        max_tokens,
        sampling: SamplingParams::nucleus(req.temperature, req.top_p, req.seed),
        force_switch,
    };
    let control = request_control(st, &req)?;
    Ok(Prepared {
        req,
        prompt_tokens,
        tokens,
        opts,
        control,
    })
}

/// A request may name the ladder or one of its rungs (what `/v1/models` lists), or no model;
/// anything else is OpenAI's 404 `model_not_found`, so a client pointed at the wrong server
/// finds out rather than getting another model's answers.
fn check_model(model: Option<&str>, settings: &Settings) -> Result<(), ApiError> {
    match model {
        None | Some("") => Ok(()),
        Some(m) if m == settings.model || settings.rungs.iter().any(|r| r == m) => Ok(()),
        Some(m) => Err(ApiError::with(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "The model {:?} does not exist here; this server serves {:?} (rungs: {})",
                m.chars().take(200).collect::<String>(),
                settings.model,
                settings.rungs.join(", ")
            ),
        )
        .code("model_not_found")
        .param("model")),
    }
}

/// A request the smallest rung could not answer even with all the memory the service could
/// ever have is refused at once: deferring it would hold the engine for the admission timeout
/// and end in a 503 that invites a retry which can never succeed.
fn check_fits_machine(st: &AppState, tokens: usize) -> Result<(), ApiError> {
    if let (Some(ceiling), Some(need)) = (st.settings.memory_ceiling, st.shared.need_bytes(tokens))
        && need > ceiling
    {
        return Err(ApiError::invalid(format!(
            "this request needs {:.0} MiB on the smallest rung, more than the {:.0} MiB this machine could ever give it; ask for fewer tokens",
            mib(need).unwrap_or(0.0),
            mib(ceiling).unwrap_or(0.0)
        ))
        .code("request_too_large_for_memory")
        .param("max_tokens"));
    }
    Ok(())
}

/// A forced switch happens before generated token `at`, so it must fall between the first
/// token and the last: at 0 (before the prompt is even read) or at or after `max_tokens` it
/// could never happen, and a silent no-op would read as a switch that did nothing.
fn check_force_at(at: usize, max_tokens: usize) -> Result<(), ApiError> {
    if at == 0 || at >= max_tokens {
        return Err(ApiError::invalid(format!(
            "molt.force_switch.at must be between 1 and max_tokens − 1 ({}): a switch at token {at} would never happen",
            max_tokens.saturating_sub(1)
        ))
        .param("molt"));
    }
    Ok(())
}

async fn chat(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(st, Endpoint::Chat, body).await
}

async fn completions(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(st, Endpoint::Text, body).await
}

async fn answer(st: AppState, endpoint: Endpoint, body: Result<Bytes, BytesRejection>) -> Response {
    let received = Instant::now();
    let shared = &st.shared;
    shared.counters.received.fetch_add(1, Ordering::Relaxed);
    let id = request_id();
    let p = match prepare(&st, endpoint, body).await {
        Ok(p) => p,
        Err(e) => {
            shared
                .counters
                .rejected_invalid
                .fetch_add(1, Ordering::Relaxed);
            shared.recorder.service(&id, "rejected", e.json());
            return e.into_response();
        }
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let stream = p.req.stream;
    let include_usage = p.req.include_usage;
    let want_logprobs = p.req.logprobs.is_some();
    let received_record = serde_json::json!({
        "endpoint": if endpoint == Endpoint::Chat { "chat" } else { "completions" },
        "stream": stream,
        "prompt_tokens": p.prompt_tokens,
        "max_tokens": p.opts.max_tokens,
        "force_switch": p.opts.force_switch,
        "user": p.req.user,
        "stop": p.req.sampling.stop.len(),
        "logprobs": p.req.logprobs,
        "json_object": p.req.sampling.json_object,
        "presence_penalty": p.req.sampling.presence_penalty,
        "frequency_penalty": p.req.sampling.frequency_penalty,
        "repeat_penalty": p.req.sampling.repeat_penalty,
    });
    // A chat belongs to a conversation; a text completion to none.
    let conversation = (endpoint == Endpoint::Chat)
        .then(|| shared.conversations.resolve(&p.req.conversation, p.tokens));
    let conversation_wire = conversation.as_ref().map(|c| ConversationWire {
        id: c.id.clone(),
        new: c.new,
        note: c.note.clone(),
    });
    let job = Job {
        conversation,
        id: id.clone(),
        history: p.req.history,
        prompt: p.req.prompt,
        prompt_tokens: p.prompt_tokens,
        opts: p.opts,
        control: p.control,
        cancel: Arc::clone(&cancel),
        tx,
        received,
    };
    shared.recorder.service(&id, "received", received_record);
    let busy = shared.engine().running.is_some();
    let position = match shared.queue.push(job, |left| {
        shared.conversations.unqueue(left.conversation.as_ref());
        shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
        shared.recorder.service(
            &left.id,
            "skipped",
            serde_json::json!({"reason": "client gone while queued"}),
        );
    }) {
        Ok(n) => n,
        Err(job) => {
            shared.conversations.unqueue(job.conversation.as_ref());
            shared
                .counters
                .rejected_queue_full
                .fetch_add(1, Ordering::Relaxed);
            let e = ApiError::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!(
                    "{} requests are already waiting for the engine (the queue holds {}); retry later",
                    shared.queue.waiting(),
                    shared.queue.capacity()
                ),
            );
            shared.recorder.service(&id, "rejected", e.json());
            return e.into_response();
        }
    };
    shared.recorder.service(
        &id,
        "queued",
        serde_json::json!({"position": position, "engine_busy": busy}),
    );
    let guard = CancelGuard::new(Arc::clone(shared), id.clone(), cancel);
    let chunks = Chunks {
        id,
        created: unix_s(),
        model: st.settings.model.clone(),
    };
    let mut response = if stream {
        let mut s = ChunkStream::new(rx, chunks.clone(), include_usage, guard, received);
        s.text_completion(endpoint == Endpoint::Text);
        s.conversation(conversation_wire.clone());
        if busy || position > 1 {
            s.queued(position);
        }
        Sse::new(s)
            .keep_alive(KeepAlive::new().interval(st.settings.keep_alive))
            .into_response()
    } else {
        collect(
            rx,
            chunks,
            guard,
            endpoint,
            want_logprobs,
            conversation_wire.clone(),
        )
        .await
    };
    // The conversation is known before the first byte, so a streaming client gets it too.
    if let Some(c) = conversation_wire {
        let h = response.headers_mut();
        if let Ok(v) = axum::http::HeaderValue::from_str(&c.id) {
            h.insert("x-molt-conversation", v);
        }
        h.insert(
            "x-molt-conversation-new",
            axum::http::HeaderValue::from_static(if c.new { "true" } else { "false" }),
        );
    }
    response
}

/// Waits for a whole answer. If the client leaves first, the handler's future is dropped and
/// the guard cancels the answer.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<Update>,
    chunks: Chunks,
    mut guard: CancelGuard,
    endpoint: Endpoint,
    want_logprobs: bool,
    conversation: Option<ConversationWire>,
) -> Response {
    let mut queue_ms = 0.0;
    let mut reused = 0;
    let mut logprobs: Option<ChoiceLogprobs> = None;
    while let Some(u) = rx.recv().await {
        match u {
            Update::Admitted { queue_ms: q } => queue_ms = q,
            Update::Session(Event::Start { reused_tokens, .. }) => reused = reused_tokens,
            Update::Session(Event::Token {
                logprobs: Some(l),
                rung,
                ..
            }) => logprobs
                .get_or_insert_with(ChoiceLogprobs::default)
                .content
                .push(TokenLogprob::new(&l, &rung)),
            Update::Finished(g) => {
                guard.disarm();
                let body = ChatCompletion {
                    id: chunks.id,
                    object: "chat.completion".into(),
                    created: chunks.created,
                    model: chunks.model,
                    choices: vec![Choice {
                        index: 0,
                        message: MessageOut {
                            role: "assistant".into(),
                            content: g.text.clone(),
                        },
                        // Asked for but no token generated: an empty list, as OpenAI sends.
                        logprobs: logprobs.or_else(|| want_logprobs.then(ChoiceLogprobs::default)),
                        finish_reason: finish_reason(g.stop).into(),
                    }],
                    usage: Usage::new(g.prompt_tokens, g.tokens.len()).with_cached(reused),
                    molt: SummaryWire {
                        conversation,
                        ..SummaryWire::new(&g.summary(), queue_ms)
                    },
                };
                return match endpoint {
                    Endpoint::Chat => Json(body).into_response(),
                    Endpoint::Text => Json(text_completion(body)).into_response(),
                };
            }
            Update::Failed(e) => {
                guard.disarm();
                return e.into_response();
            }
            _ => {}
        }
    }
    guard.disarm();
    ApiError::internal("the engine ended this answer without a result").into_response()
}

#[derive(Serialize)]
struct ModelList {
    object: &'static str,
    data: Vec<ModelEntry>,
}

#[derive(Serialize)]
struct ModelEntry {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    rungs: Vec<String>,
}

async fn models(State(st): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelEntry {
            id: st.settings.model.clone(),
            object: "model",
            created: unix_s(),
            owned_by: "molt",
            rungs: st.settings.rungs.clone(),
        }],
    })
}

#[derive(Serialize)]
struct BudgetView {
    #[serde(flatten)]
    budget: BudgetReport,
    current_rung: String,
    rungs: Vec<super::worker::RungStatus>,
}

fn budget_view(st: &AppState) -> BudgetView {
    let e = st.shared.engine();
    BudgetView {
        budget: st.shared.budget.report(),
        current_rung: e.current_rung.clone(),
        rungs: e.rungs.clone(),
    }
}

async fn get_budget(State(st): State<AppState>) -> Json<BudgetView> {
    Json(budget_view(&st))
}

async fn set_budget(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<BudgetView>, ApiError> {
    let req: BudgetRequest = parse_body(body)?;
    let refs = st.shared.trace_refs();
    st.shared
        .budget
        .apply(&req, &st.settings.trace_dirs, &refs)
        .map_err(ApiError::invalid)?;
    let view = budget_view(&st);
    st.shared.recorder.service(
        "",
        "budget_set",
        serde_json::to_value(&view.budget).unwrap_or_default(),
    );
    Ok(Json(view))
}

#[derive(Serialize)]
struct Status {
    model: String,
    uptime_s: f64,
    rss_mib: Option<f64>,
    queue: QueueView,
    counters: CountersView,
    engine: EngineStatus,
    budget: BudgetReport,
    /// Where hibernated conversations are written (absent: kept in RAM only).
    state_dir: Option<String>,
    /// Kept conversations, most recently used first.
    conversations: Vec<super::conversations::ConversationView>,
}

#[derive(Serialize)]
struct QueueView {
    waiting: usize,
    capacity: usize,
}

#[derive(Serialize)]
struct CountersView {
    received: u64,
    completed: u64,
    cancelled: u64,
    failed: u64,
    rejected_invalid: u64,
    rejected_queue_full: u64,
    deferred: u64,
    switches: u64,
    tokens: u64,
    /// Times the idle engine freed its rungs for a falling budget.
    released: u64,
}

async fn status(State(st): State<AppState>) -> Json<Status> {
    let c = &st.shared.counters;
    let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Json(Status {
        model: st.settings.model.clone(),
        uptime_s: st.settings.started.elapsed().as_secs_f64(),
        rss_mib: mib(rss_bytes()),
        queue: QueueView {
            waiting: st.shared.queue.waiting(),
            capacity: st.shared.queue.capacity(),
        },
        counters: CountersView {
            received: r(&c.received),
            completed: r(&c.completed),
            cancelled: r(&c.cancelled),
            failed: r(&c.failed),
            rejected_invalid: r(&c.rejected_invalid),
            rejected_queue_full: r(&c.rejected_queue_full),
            deferred: r(&c.deferred),
            switches: r(&c.switches),
            tokens: r(&c.tokens),
            released: r(&c.released),
        },
        engine: st.shared.engine().clone(),
        budget: st.shared.budget.report(),
        state_dir: st
            .shared
            .conversations
            .dir()
            .map(|d| d.path().display().to_string()),
        conversations: st.shared.conversations.view(),
    })
}
