//! The streaming HTTP service: OpenAI-compatible chat completions over a Molt ladder, where
//! every streamed token names the rung that produced it and a migration between two tokens
//! arrives as an event of its own.
//!
//! Main types: [`Server`] (bind, then [`Server::serve`]) configured by [`ServerConfig`];
//! [`ServerBudget`], the budget a client re-points through `POST /v1/molt/budget` while
//! answers stream; the wire types in [`openai`]; [`client`], a minimal HTTP/SSE client for
//! tests and the load benchmark.
//!
//! The page at `/` ([`web`](self)) is a chat over these same endpoints that shows the rungs,
//! the switches and the budget as they happen.
//!
//! Inside: [`routes`](self) validates and measures each request and queues it; one engine
//! thread ([`worker`](self)) owns the [`Session`] and answers the queue in order, deferring
//! admission while memory is short; each streamed answer is a [`DoneState`] machine that
//! turns engine updates into SSE chunks and cancels the answer if the client hangs up; an
//! optional record file keeps the raw event stream.
//!
//! Concurrency on purpose: one answer decodes at a time per ladder (see the worker's docs for
//! why); others wait in a bounded queue that answers 503 when full.

mod auth;
mod batch;
mod budget;
pub mod client;
pub mod completions;
mod control;
pub mod conversations;
mod error;
mod guard;
mod limits;
mod listen;
pub mod openai;
mod record;
mod routes;
mod stream;
mod web;
mod worker;

pub use auth::ApiKey;
pub use budget::{BudgetReport, BudgetRequest, ServerBudget, UNLIMITED_BYTES};
pub use error::{ApiError, ServerError};
pub use record::Recorder;
pub use stream::DoneState;
pub use worker::{EngineStatus, RouteStatus, RungStatus};

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use molt::engine::{ContextConfig, Model};
use molt::ladder::Ladder;
use molt::session::{Session, SessionOptions};

use routes::{AppState, Settings};
use worker::{Counters, Queue, Shared};

/// How to run the service.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen (`127.0.0.1:0` picks a free port).
    pub addr: SocketAddr,
    /// Context settings shared by every rung.
    pub context: ContextConfig,
    /// Session settings (strategy, projector directories, policy).
    pub session: SessionOptions,
    /// Rung to start on and never exceed (default: the largest).
    pub start_rung: Option<String>,
    /// Requests that may wait for the engine; one more is refused with 503.
    pub queue_capacity: usize,
    /// How long a request may wait for memory before it fails with 503.
    pub admission_timeout: Duration,
    /// `max_tokens` for requests that set none.
    pub default_max_tokens: usize,
    /// Largest request body, bytes (a larger `Content-Length` is refused before reading).
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive in full before the request fails with 408.
    pub body_timeout: Duration,
    /// How long a request's headers may take to arrive, counted from when the server starts
    /// waiting for them (the connection opened, or the previous answer on it ended); past it
    /// the connection is closed.
    pub header_timeout: Duration,
    /// Connections served at once; while all are open, new ones wait to be accepted.
    pub max_connections: usize,
    /// Further names a request's `Host` may give when no key is set (besides `localhost`,
    /// loopback addresses and the bound address), on any port: a reverse proxy's name.
    pub allowed_hosts: Vec<String>,
    /// The budget at start (the body `POST /v1/molt/budget` takes).
    pub budget: BudgetRequest,
    /// Where trace names are looked up.
    pub trace_dirs: Vec<PathBuf>,
    /// Record the raw event stream to this JSON file.
    pub record: Option<PathBuf>,
    /// SSE keep-alive interval.
    pub keep_alive: Duration,
    /// Load every rung once at start (one at a time) so the policy and admission work from
    /// measured context costs instead of the session's estimate for unloaded rungs.
    pub measure_rungs: bool,
    /// The key clients must send as `Authorization: Bearer KEY`; `None`: no authentication.
    pub api_key: Option<ApiKey>,
    /// The most memory the service could ever have, bytes: a request the smallest rung could
    /// not answer within it is refused at once (400) instead of waiting for memory. `None`:
    /// the memory cgroup's limit, or the machine's total memory.
    pub memory_ceiling: Option<u64>,
    /// Allow listening on a non-loopback address without a key. Off by default: anyone who
    /// can reach the port could otherwise use the engine and re-point its budget.
    pub insecure_no_auth: bool,
    /// The shortest time between two tokens of an answer (`None`: as fast as the rung
    /// decodes). For demos on fast hardware and for clients that act mid-answer (a budget cut
    /// posted after a few tokens must find the answer still running).
    pub token_pace: Option<Duration>,
    /// Where conversations are hibernated (`None`: nowhere; a conversation displaced from the
    /// engine is re-read from its messages when it comes back). The binary defaults it to the
    /// per-user data directory; an unwritable directory is a startup error naming it.
    pub state_dir: Option<PathBuf>,
    /// Bound on the state directory's files, MiB (oldest evicted first).
    pub state_max_mib: u64,
    /// Answers decoded together (continuous batching, one sequence each in one context of the
    /// current rung; conversations kept and hibernated, parks that free the rung, a cache a
    /// switch projected built on after its cells the next prompt looks at are re-read, as the
    /// serial loop does); [`DEFAULT_PARALLEL`] unless set. 1 answers one request at a time,
    /// the session's own loop (`serve --serial`).
    pub parallel: usize,
    /// In the batched loop, when no rung holds every running answer, set the least protected
    /// aside (their caches to files) so the others go on (true, the default); false parks the
    /// whole batch, as before (`serve --no-set-aside`, kept for the comparison the
    /// `serve-aside` bench makes).
    pub set_aside: bool,
    /// In the batched loop, a parked answer (set aside, or the whole batch) that resumes on a
    /// model of another size is carried through the switch, its cache projected, instead of
    /// re-reading its history there (false, the default: a projected cache loses the
    /// context's facts);
    /// `serve --carry-on-resume`, kept for the comparison the `serve-aside` bench makes.
    pub carry_on_resume: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 8088)),
            context: ContextConfig::default(),
            session: SessionOptions::default(),
            start_rung: None,
            queue_capacity: 8,
            admission_timeout: Duration::from_secs(120),
            default_max_tokens: 256,
            max_body_bytes: 4 << 20,
            body_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(DEFAULT_HEADER_TIMEOUT_S),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            allowed_hosts: Vec::new(),
            budget: BudgetRequest {
                unlimited: Some(true),
                ..BudgetRequest::default()
            },
            trace_dirs: default_trace_dirs(),
            record: None,
            keep_alive: Duration::from_secs(2),
            measure_rungs: true,
            api_key: None,
            insecure_no_auth: false,
            memory_ceiling: None,
            token_pace: None,
            state_dir: None,
            state_max_mib: molt::state::DEFAULT_MAX_MIB,
            parallel: DEFAULT_PARALLEL,
            set_aside: true,
            carry_on_resume: false,
        }
    }
}

/// Seconds a request's headers may take (`serve --header-timeout-s`): a local client sends them
/// in milliseconds, and an idle kept-alive connection is closed after as long — longer than the
/// stock clients keep an idle connection for reuse (Python's httpx 5 s, Node's undici 4 s), so
/// they never reuse one the server is closing.
pub const DEFAULT_HEADER_TIMEOUT_S: u64 = 10;

/// Connections served at once (`serve --max-connections`): a browser opens at most six per
/// server, and a queue of 8 requests with 4 answered together needs a dozen; far below the
/// 1024 descriptors a process gets by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// The answers `serve` decodes together unless told otherwise: the batched loop passes every
/// server test the serial one passes (`MOLT_TEST_PARALLEL` runs them against either), and four
/// sequences cost little more per step than one on a CPU, where a decode reads the weights once
/// for all of them.
pub const DEFAULT_PARALLEL: usize = 4;

/// `$MOLT_HOME/traces`, then `./traces`.
#[must_use]
pub fn default_trace_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(h) = std::env::var_os("MOLT_HOME").filter(|v| !v.is_empty()) {
        v.push(PathBuf::from(h).join("traces"));
    }
    v.push(PathBuf::from("traces"));
    v
}

/// All the memory this process could ever be given: the tightest memory cgroup limit, or the
/// machine's total memory.
fn machine_memory() -> Option<u64> {
    let r = molt::pressure::SystemBudget::new().read().ok()?;
    let cgroup = r.cgroup.and_then(|c| c.limit_bytes);
    match (cgroup, r.mem_total_bytes) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A bound service with its engine loaded, ready to serve.
pub struct Server {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    state: AppState,
    max_body_bytes: usize,
    body_timeout: Duration,
    connections: listen::ConnectionLimits,
    api_key: Option<ApiKey>,
    allowed_hosts: Vec<String>,
    engine: std::thread::JoinHandle<()>,
}

impl Server {
    /// Loads the ladder's starting rung on a new engine thread, checks every migration route
    /// for a projector, sets the initial budget and binds the socket.
    ///
    /// # Errors
    /// [`ServerError::Engine`] when a rung fails to load, [`ServerError::Tokenizer`],
    /// [`ServerError::Budget`] for an invalid initial budget, [`ServerError::Record`] when the
    /// record file cannot be created, [`ServerError::Bind`]; [`ServerError::InsecureBind`] for a non-loopback address without a key.
    pub async fn start(ladder: Ladder, config: ServerConfig) -> Result<Self, ServerError> {
        let started = Instant::now();
        // Refused before anything loads: a flag mistake should cost nothing.
        if !config.addr.ip().is_loopback() && config.api_key.is_none() && !config.insecure_no_auth {
            return Err(ServerError::InsecureBind { addr: config.addr });
        }
        let smallest = ladder.rungs.last().ok_or(ServerError::EngineGone)?;
        let tokenizer = Model::load_vocab_only(&smallest.path, smallest.name())
            .map_err(ServerError::Tokenizer)?;
        let recorder = match &config.record {
            Some(p) => Recorder::create(
                p,
                &serde_json::json!({
                    "ladder": ladder.name(),
                    "rungs": ladder.rungs.iter().map(|r| r.name()).collect::<Vec<_>>(),
                    "n_ctx": config.context.n_ctx,
                    "strategy": config.session.strategy,
                }),
            )?,
            None => Recorder::off(),
        };
        let state_dir = config
            .state_dir
            .as_deref()
            .map(|d| molt::state::StateDir::open(d, config.state_max_mib))
            .transpose()?;
        let conversations = conversations::Conversations::open(
            state_dir,
            ladder
                .rungs
                .iter()
                .map(|r| (r.name().to_string(), r.sha256.clone()))
                .collect(),
            config.context.n_ctx,
            &recorder,
        );
        let shared = Arc::new(Shared {
            conversations,
            queue: Queue::new(config.queue_capacity),
            budget: ServerBudget::unlimited(),
            recorder,
            counters: Counters::default(),
            engine: Mutex::new(EngineStatus::default()),
            session_cancel: OnceLock::new(),
            admission_timeout: config.admission_timeout,
        });
        let settings = Arc::new(Settings {
            model: ladder.name().to_string(),
            rungs: ladder.rungs.iter().map(|r| r.name().to_string()).collect(),
            n_ctx: config.context.n_ctx,
            default_max_tokens: config.default_max_tokens.max(1),
            keep_alive: config.keep_alive,
            trace_dirs: config.trace_dirs.clone(),
            started,
            memory_ceiling: config.memory_ceiling.or_else(machine_memory),
            token_pace: config.token_pace,
        });
        let start = config
            .start_rung
            .clone()
            .unwrap_or_else(|| settings.rungs[0].clone());
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        // The engine answers nothing until the operator's budget is applied (that needs the
        // costs the engine measures first): its first rung's setup is chosen under it.
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        // And the server is started once the engine has its first rung loaded that way.
        let (settled_tx, settled_rx) = tokio::sync::oneshot::channel::<()>();
        let engine = {
            let shared = Arc::clone(&shared);
            let context = config.context;
            let opts = config.session.clone();
            let measure = config.measure_rungs;
            let parallel = config.parallel;
            let batch = batch::BatchOptions {
                slots: config.parallel,
                set_aside: config.set_aside,
                carry_on_resume: config.carry_on_resume,
            };
            std::thread::Builder::new()
                .name("molt-engine".into())
                .spawn(move || {
                    let mut session = match Session::with_options(ladder, context, &start, opts) {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    if measure && let Err(e) = worker::measure_rungs(&mut session) {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    if let Some(n) = session.pace_note() {
                        eprintln!("molt serve: {n}");
                        shared
                            .recorder
                            .service("", "pace_file", serde_json::json!({"note": n}));
                    }
                    session.set_budget_source(Some(Box::new(shared.budget.clone())));
                    worker::publish(&shared, &mut session, None, true);
                    let _ = ready_tx.send(Ok(()));
                    if go_rx.recv().is_err() {
                        // The server did not start (its budget was refused).
                        return;
                    }
                    if parallel > 1 {
                        batch::run(session, &shared, batch, settled_tx);
                    } else {
                        worker::run(session, &shared, settled_tx);
                    }
                })
                .map_err(|_| ServerError::EngineGone)?
        };
        ready_rx.await.map_err(|_| ServerError::EngineGone)??;
        shared
            .budget
            .apply_operator(&config.budget, &config.trace_dirs, &shared.trace_refs())
            .map_err(ServerError::Budget)?;
        go_tx.send(()).map_err(|_| ServerError::EngineGone)?;
        settled_rx.await.map_err(|_| ServerError::EngineGone)?;
        shared.recorder.service(
            "",
            "started",
            serde_json::json!({"engine": &*shared.engine(), "budget": shared.budget.report()}),
        );
        let listener = tokio::net::TcpListener::bind(config.addr)
            .await
            .map_err(|source| ServerError::Bind {
                addr: config.addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(ServerError::Serve)?;
        Ok(Self {
            listener,
            addr,
            state: AppState {
                shared,
                tokenizer,
                settings,
            },
            max_body_bytes: config.max_body_bytes,
            body_timeout: config.body_timeout,
            connections: listen::ConnectionLimits {
                header_timeout: config.header_timeout,
                max_connections: config.max_connections.max(1),
            },
            api_key: config.api_key,
            allowed_hosts: config.allowed_hosts,
            engine,
        })
    }

    /// The address the service listens on.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The budget (the same one `POST /v1/molt/budget` changes).
    #[must_use]
    pub fn budget(&self) -> ServerBudget {
        self.state.shared.budget.clone()
    }

    /// The engine's state: current rung, loaded rungs, rung costs, route availability.
    #[must_use]
    pub fn engine_status(&self) -> EngineStatus {
        self.state.shared.engine().clone()
    }

    /// Serves until `shutdown` completes; then refuses new work, stops the answer in flight
    /// (its client gets the summary so far), tells queued clients the server is going away,
    /// and waits for the engine thread.
    ///
    /// In front of the routes, outermost first: without a key, a `Host` that is not this
    /// server's address is refused (403, every route); on the API, a browser's request from
    /// another origin (403), a missing or wrong key (401), a POST body that is not JSON (415),
    /// too large (413) or too slow (408). Each connection's headers have a deadline, and the
    /// open connections a cap (see `listen`).
    ///
    /// # Errors
    /// None today; the signature keeps [`ServerError::Serve`] for a listener that fails.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let shared = Arc::clone(&self.state.shared);
        let mut app = routes::router(self.state, self.max_body_bytes);
        app = limits::protect(
            app,
            self.max_body_bytes,
            self.body_timeout,
            Arc::clone(&shared),
        );
        // A client without the key gets nothing read, not even its body.
        let keyed = self.api_key.is_some();
        if let Some(key) = self.api_key {
            app = auth::protect(app, key);
        }
        // Outside the key check: a page of another site is refused whether or not it has a key.
        app = guard::origins(app);
        // Outside the key check: the page must load for the user to type the key it sends.
        app = app.merge(web::router());
        // Outermost, the web page included: a rebound name reaches nothing of an open server.
        if !keyed {
            app = guard::hosts(app, guard::HostPolicy::new(self.addr, &self.allowed_hosts));
        }
        let stop = {
            let shared = Arc::clone(&shared);
            async move {
                shutdown.await;
                shared.queue.close();
                if let Some(c) = shared.session_cancel.get() {
                    c.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
        };
        listen::serve(self.listener, app, self.connections, stop).await;
        shared.queue.close();
        let engine = self.engine;
        let _ = tokio::task::spawn_blocking(move || engine.join()).await;
        shared
            .recorder
            .service("", "stopped", serde_json::Value::Null);
        Ok(())
    }
}
