//! The `QoS` bench: several conversations of two classes under one moving budget, through the
//! HTTP service — the real `molt-run serve` as a child process (the batched loop by default,
//! [`ServeQosOptions::parallel`]; 1 answers one request at a time) — conversations that each
//! state a fact, go on, and ask the fact back, while the budget moves along a trace —
//! replayed as numbers, or made real by a memory hog ([`molt::pressure::HogBudget`]) — down
//! to a budget below the smallest rung and back.
//!
//! What it measures is the product's scheduler: the scheduler's plan ([`molt::sched::plan`])
//! as the server's own loop applies it (every running answer on one rung, the least protected
//! set aside or hibernated to their state files, `src/server/batch.rs`). There is no second
//! actuator for the bench to drive.
//!
//! Every round the bench posts the budget the trace (or the hog) gives, waits a round, then
//! samples: the server's resident set from `/proc/<pid>/status`, the engine's modelled usage
//! and rung and every conversation's rung, tokens, state and bytes from `GET /v1/molt/status`.
//! The measured usage is the resident set above the server's own floor — its resident set
//! with no rung loaded, taken at the start by a budget of 1 MiB, which an idle server answers
//! by freeing every rung — the part of the process the budget governs (the floor is the
//! binary, the allocator, the projectors; the raw resident set is reported beside it). At the
//! end the server's record file says how many conversations were hibernated and woken.
//!
//! Nobody is killed: a request that comes while no rung fits waits for memory (the admission
//! timeout and park deadline are set past the run's length), so a conversation is lost only
//! if one of its turns fails. What the user feels is measured too: each conversation's last
//! turn asks about its first, and the report says whether the answer holds the fact.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use molt::pressure::{BudgetSource, PressureError, Tick, rss_bytes_in};
use molt_server::client;
use molt_server::conversations::ConversationState;

/// Errors of the served `QoS` bench.
#[derive(Debug, thiserror::Error)]
pub enum ServeQosError {
    /// A file or the child process failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The server did not start or stopped answering.
    #[error("the server: {0}")]
    Server(String),
    /// The budget source failed.
    #[error("budget: {0}")]
    Budget(#[from] PressureError),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServeQosError {
    let what = what.into();
    move |source| ServeQosError::Io { what, source }
}

/// One conversation of the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConversationSpec {
    /// Its id (`molt.conversation`).
    pub id: String,
    /// `foreground` or `background`.
    pub class: String,
    /// Priority within its class.
    pub priority: i32,
    /// The user turns, in order; the first states `fact`, the last asks for it.
    pub turns: Vec<String>,
    /// The fact the last answer should hold.
    pub fact: String,
}

/// Options of the run.
#[derive(Debug, Clone)]
pub struct ServeQosOptions {
    /// The `molt-run` binary.
    pub program: PathBuf,
    /// Global options placed before `serve` (ladder, models, threads, context).
    pub global_args: Vec<String>,
    /// The conversations.
    pub conversations: Vec<ConversationSpec>,
    /// `max_tokens` of every answer.
    pub max_tokens: usize,
    /// Length of a round, ms.
    pub round_ms: u64,
    /// Rounds a conversation waits between two of its turns.
    pub think_rounds: usize,
    /// At least this many rounds (the trace's last step included).
    pub min_rounds: usize,
    /// At most this many rounds.
    pub max_rounds: usize,
    /// Where the state files, the record file and the server's log go.
    pub work_dir: PathBuf,
    /// The server's `--parallel`: answers decoded together (1: one at a time, `--serial`).
    pub parallel: usize,
}

/// The shipped conversations: a foreground chat and two background jobs of different
/// priorities, three turns each, the first stating a fact the last asks back.
#[must_use]
pub fn standard_conversations() -> Vec<ConversationSpec> {
    let c = |id: &str, class: &str, priority, turns: [&str; 3], fact: &str| ConversationSpec {
        id: id.to_owned(),
        class: class.to_owned(),
        priority,
        turns: turns.iter().map(|t| (*t).to_owned()).collect(),
        fact: fact.to_owned(),
    };
    vec![
        c(
            "chat",
            "foreground",
            0,
            [
                "My cat is called Wilhelmina. Say hello to her.",
                "Give me one tip for keeping a cat healthy.",
                "What is my cat called?",
            ],
            "Wilhelmina",
        ),
        c(
            "ops",
            "background",
            2,
            [
                "The staging server listens on port 6143. Acknowledge.",
                "Name one reason a server might refuse connections.",
                "Which port does the staging server listen on?",
            ],
            "6143",
        ),
        c(
            "digest",
            "background",
            0,
            [
                "Our project codename is Bluefinch. Remember it.",
                "Suggest a one-line tagline for a memory-frugal inference runtime.",
                "What is our project codename?",
            ],
            "Bluefinch",
        ),
    ]
}

/// One conversation's state in a round, as the status lists it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantRow {
    /// Conversation id.
    pub id: String,
    /// Class.
    pub class: String,
    /// Priority.
    pub priority: i64,
    /// The rung its cache is on.
    pub rung: String,
    /// Tokens its cache holds.
    pub tokens: u64,
    /// Where its cache is: `running`, `parked`, `kept`, `hibernated`, `queued` or `dropped`,
    /// in the server's own words (a word it never writes does not read).
    pub state: ConversationState,
    /// Bytes it costs where it is (KV in RAM, or its state file).
    pub bytes: u64,
}

/// One round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeRound {
    /// Round index (the trace's clock).
    pub round: usize,
    /// Seconds since the run started, at the sample.
    pub t_s: f64,
    /// The budget posted this round, bytes.
    pub budget_bytes: u64,
    /// The server's resident set, bytes.
    pub rss_bytes: u64,
    /// Resident set above the server's floor, bytes.
    pub measured_bytes: u64,
    /// The engine's modelled usage, bytes.
    pub modelled_bytes: u64,
    /// `measured − budget`.
    pub overshoot_measured_bytes: i64,
    /// `modelled − budget`.
    pub overshoot_modelled_bytes: i64,
    /// The engine's rung.
    pub engine_rung: String,
    /// Rungs loaded.
    pub loaded: Vec<String>,
    /// The answer's weights are parked.
    pub parked: bool,
    /// The idle engine holds no rung.
    pub released: bool,
    /// Requests waiting for the engine.
    pub queued: u64,
    /// Every conversation.
    pub tenants: Vec<TenantRow>,
}

/// One turn as its client saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Turn index.
    pub turn: usize,
    /// The user's message.
    pub prompt: String,
    /// HTTP status.
    pub status: u16,
    /// `finish_reason`, or the error's code.
    pub finish: String,
    /// The answer (or the error message).
    pub answer: String,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Of which came from a kept cache or a state file.
    pub cached_tokens: u64,
    /// Time waiting for the engine (deferrals included), ms.
    pub queue_ms: f64,
    /// Request to response, ms.
    pub total_ms: f64,
    /// Rungs that produced its tokens.
    pub rungs: Vec<String>,
    /// Round in which it was sent.
    pub sent_round: usize,
}

/// One conversation's outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConversationReport {
    /// The spec.
    pub spec: ConversationSpec,
    /// Its turns.
    pub turns: Vec<TurnRecord>,
    /// Every turn answered in full.
    pub complete: bool,
    /// The last answer holds the first turn's fact.
    pub recalled: bool,
}

/// The run's report (`results/serve_qos.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeQosReport {
    /// Max over rounds of (resident set above the floor − budget).
    pub max_overshoot_measured_bytes: i64,
    /// Max over rounds of (modelled usage − budget).
    pub max_overshoot_modelled_bytes: i64,
    /// Answers that ended without completing (a failure, an admission timeout, a park
    /// deadline) plus a server that died.
    pub killed: usize,
    /// Conversations with a turn not answered in full.
    pub lost_conversations: usize,
    /// Conversations written to their state files (record file).
    pub hibernated: usize,
    /// Conversations woken from a state file or RAM copy (record file).
    pub resumed: usize,
    /// Rounds.
    pub rounds: Vec<ServeRound>,
    /// Times the idle engine freed every rung (the floor's measurement included).
    pub released: usize,
    /// The server's resident set with no rung loaded, bytes.
    pub floor_rss_bytes: u64,
    /// Max over rounds of (raw resident set − budget).
    pub max_overshoot_rss_bytes: i64,
    /// Conversations whose last answer held their fact.
    pub recalled: usize,
    /// The conversations.
    pub conversations: Vec<ConversationReport>,
    /// Where the budget came from.
    pub budget_source: String,
    /// Round length, ms.
    pub round_ms: u64,
    /// Wall time, s.
    pub wall_s: f64,
    /// The server's `--parallel` (1: one answer at a time); absent in files written before
    /// the benchmark could run the batched loop (they ran `--serial`).
    #[serde(default = "one")]
    pub parallel: usize,
    /// Rounds a conversation waited between two of its turns.
    #[serde(default = "one")]
    pub think_rounds: usize,
}

fn one() -> usize {
    1
}

/// `results/serve_qos.json` (`serve_qos_real_hog.json` under a real hog): the run's report
/// with the settings it ran under. The figure and the results page read it through this type.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeQosDoc {
    /// Machine and versions ([`super::RunInfo`]).
    #[serde(default)]
    pub run: Value,
    /// The budget trace's file name.
    #[serde(default)]
    pub trace: Option<String>,
    /// Whether a real memory hog followed the trace (otherwise its budgets were replayed as
    /// numbers).
    #[serde(default)]
    pub real_hog: bool,
    /// The server's context window, tokens.
    #[serde(default)]
    pub n_ctx: u32,
    /// The server's decode threads (absent: its default, every core).
    #[serde(default)]
    pub threads: Option<u32>,
    /// `max_tokens` of every answer.
    #[serde(default)]
    pub max_tokens: usize,
    /// What happened.
    #[serde(flatten)]
    pub report: ServeQosReport,
}

/// The server child; killed and reaped on drop.
pub(crate) struct ServerChild {
    child: Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServerChild {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn rss(&self) -> u64 {
        rss_bytes_in(
            &Path::new("/proc")
                .join(self.pid().to_string())
                .join("status"),
        )
        .unwrap_or(0)
    }

    pub(crate) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

fn start_server(opts: &ServeQosOptions) -> Result<ServerChild, ServeQosError> {
    let serve_args: Vec<String> = [
        "--port",
        "0",
        "--parallel",
        &opts.parallel.max(1).to_string(),
        "--max-tokens",
        &opts.max_tokens.to_string(),
        "--admission-timeout-s",
        "36000",
        "--park-deadline-s",
        "36000",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    spawn_server(
        &opts.program,
        &opts.global_args,
        &serve_args,
        &opts.work_dir,
    )
}

/// Starts `program [global_args] serve [serve_args]` with its state files under
/// `work_dir/state`, its record in `work_dir/record.json` and its log in
/// `work_dir/serve.log`, and waits until it listens.
pub(crate) fn spawn_server(
    program: &Path,
    global_args: &[String],
    serve_args: &[String],
    work_dir: &Path,
) -> Result<ServerChild, ServeQosError> {
    std::fs::create_dir_all(work_dir).map_err(io("creating the work directory"))?;
    let log_path = work_dir.join("serve.log");
    let log = std::fs::File::create(&log_path).map_err(io("creating the server log"))?;
    let mut child = Command::new(program)
        .args(global_args)
        .arg("serve")
        .args(serve_args)
        .arg("--state-dir")
        .arg(work_dir.join("state"))
        .arg("--record")
        .arg(work_dir.join("record.json"))
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(io(format!("starting {}", program.display())))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| ServeQosError::Server("no standard output".into()))?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = loop {
        let Some(line) = lines.next() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ServeQosError::Server(format!(
                "exited before listening; its log: {}",
                log_path.display()
            )));
        };
        let line = line.map_err(io("reading the server's output"))?;
        if let Some(a) = line.strip_prefix("molt serve: listening on http://") {
            break a
                .trim()
                .parse()
                .map_err(|e| ServeQosError::Server(format!("address {a:?}: {e}")))?;
        }
    };
    // The rest of its output is not needed, but the pipe must not fill.
    std::thread::spawn(move || for _ in lines {});
    Ok(ServerChild { child, addr })
}

/// The server's resident set with no rung loaded: a budget of 1 MiB holds no rung, so the
/// idle server frees them all (the binary, the allocator, the projectors stay).
pub(crate) async fn floor_rss(server: &ServerChild) -> Result<u64, ServeQosError> {
    let addr = server.addr;
    post_budget(addr, &json!({"mib": 1})).await?;
    let t_floor = Instant::now();
    loop {
        let s = get_status(addr).await?;
        if s["engine"]["released"] == true {
            break;
        }
        if t_floor.elapsed() > Duration::from_secs(120) {
            return Err(ServeQosError::Server(
                "the idle server did not free its rungs under a 1 MiB budget".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(server.rss())
}

pub(crate) async fn get_status(addr: SocketAddr) -> Result<Value, ServeQosError> {
    let r = client::request(addr, "GET", "/v1/molt/status", None)
        .await
        .map_err(io("GET /v1/molt/status"))?;
    r.json()
        .map_err(|e| ServeQosError::Server(format!("status is not JSON: {e}")))
}

pub(crate) async fn post_budget(addr: SocketAddr, body: &Value) -> Result<(), ServeQosError> {
    let r = client::post_json(addr, "/v1/molt/budget", body)
        .await
        .map_err(io("POST /v1/molt/budget"))?;
    if r.status == 200 {
        Ok(())
    } else {
        Err(ServeQosError::Server(format!(
            "budget refused ({}): {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        )))
    }
}

/// Shared between the round loop and the conversations: the round now, and the turns.
#[derive(Default)]
struct Progress {
    round: usize,
    reports: Vec<Option<ConversationReport>>,
}

async fn converse(
    addr: SocketAddr,
    spec: ConversationSpec,
    max_tokens: usize,
    think: Duration,
    progress: Arc<std::sync::Mutex<Progress>>,
) -> ConversationReport {
    let mut messages: Vec<Value> = Vec::new();
    let mut turns = Vec::new();
    let round = || {
        progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .round
    };
    for (i, user) in spec.turns.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(think).await;
        }
        messages.push(json!({"role": "user", "content": user}));
        let body = json!({
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "molt": {"conversation": spec.id, "class": spec.class, "priority": spec.priority},
        });
        let sent_round = round();
        let t0 = Instant::now();
        let r = client::post_json(addr, "/v1/chat/completions", &body).await;
        let total_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (status, v) = match r {
            Ok(r) => (r.status, r.json().unwrap_or(Value::Null)),
            Err(e) => (
                0,
                json!({"error": {"code": "connection", "message": e.to_string()}}),
            ),
        };
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_owned);
        let record = TurnRecord {
            turn: i,
            prompt: user.clone(),
            status,
            finish: v["choices"][0]["finish_reason"]
                .as_str()
                .or_else(|| v["error"]["code"].as_str())
                .unwrap_or("unknown")
                .to_owned(),
            answer: answer
                .clone()
                .or_else(|| v["error"]["message"].as_str().map(str::to_owned))
                .unwrap_or_default(),
            prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
            cached_tokens: v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
            queue_ms: v["molt"]["queue_ms"].as_f64().unwrap_or(0.0),
            total_ms,
            rungs: v["molt"]["rungs_used"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|r| r.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            sent_round,
        };
        let ok = status == 200 && matches!(record.finish.as_str(), "stop" | "length");
        turns.push(record);
        match answer {
            Some(a) if ok => messages.push(json!({"role": "assistant", "content": a})),
            // A failed turn ends the conversation: it is counted as lost.
            _ => break,
        }
    }
    let complete = turns.len() == spec.turns.len()
        && turns
            .iter()
            .all(|t| t.status == 200 && matches!(t.finish.as_str(), "stop" | "length"));
    let recalled = complete
        && turns
            .last()
            .is_some_and(|t| t.answer.to_lowercase().contains(&spec.fact.to_lowercase()));
    ConversationReport {
        spec,
        turns,
        complete,
        recalled,
    }
}

pub(crate) fn signed(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// Every conversation the status lists, by id.
///
/// # Errors
/// [`ServeQosError::Server`] when a conversation's state is not one the server writes.
fn tenants_of(status: &Value) -> Result<Vec<TenantRow>, ServeQosError> {
    let mut v = Vec::new();
    for c in status["conversations"].as_array().into_iter().flatten() {
        let state = ConversationState::deserialize(&c["state"]).map_err(|e| {
            ServeQosError::Server(format!(
                "conversation {}: state {}: {e}",
                c["id"], c["state"]
            ))
        })?;
        v.push(TenantRow {
            id: c["id"].as_str().unwrap_or("").to_owned(),
            class: c["class"].as_str().unwrap_or("").to_owned(),
            priority: c["priority"].as_i64().unwrap_or(0),
            rung: c["rung"].as_str().unwrap_or("").to_owned(),
            tokens: c["tokens"].as_u64().unwrap_or(0),
            state,
            bytes: c["bytes"].as_u64().unwrap_or(0),
        });
    }
    v.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(v)
}

/// Counts the record file's service events of `kind`.
fn count_events(record: &Value, kind: &str) -> usize {
    record["events"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|e| e["kind"] == kind).count())
}

/// Runs the scenario: see the module doc.
///
/// # Errors
/// [`ServeQosError`] when the server cannot be started or its status read, or the budget
/// source fails.
pub fn run(
    opts: &ServeQosOptions,
    budget: &mut dyn BudgetSource,
    progress_line: &mut dyn FnMut(&str),
) -> Result<ServeQosReport, ServeQosError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("starting the async runtime"))?;
    rt.block_on(run_async(opts, budget, progress_line))
}

#[allow(clippy::too_many_lines)]
async fn run_async(
    opts: &ServeQosOptions,
    budget: &mut dyn BudgetSource,
    say: &mut dyn FnMut(&str),
) -> Result<ServeQosReport, ServeQosError> {
    let _ = std::fs::remove_dir_all(opts.work_dir.join("state"));
    let mut server = start_server(opts)?;
    let addr = server.addr;
    say(&format!("serve-qos: server pid {} on {addr}", server.pid()));
    let floor = floor_rss(&server).await?;
    say(&format!(
        "serve-qos: floor (no rung loaded) {} MiB resident",
        floor >> 20
    ));

    let t0 = Instant::now();
    let round_ms = opts.round_ms.max(100);
    let progress = Arc::new(std::sync::Mutex::new(Progress {
        round: 0,
        reports: vec![None; opts.conversations.len()],
    }));
    let mut rounds = Vec::new();
    let mut last_posted = None;
    let mut tasks = Vec::new();
    let mut server_died = false;
    for round in 0..opts.max_rounds {
        progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .round = round;
        let b = budget.budget(Tick {
            token_index: round as u64,
            elapsed_ms: u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
        })?;
        if last_posted != Some(b.bytes) {
            post_budget(addr, &json!({"bytes": b.bytes.max(1 << 20)})).await?;
            last_posted = Some(b.bytes);
        }
        if round == 0 {
            // The conversations start once the first budget is in force.
            for (i, spec) in opts.conversations.iter().enumerate() {
                let p = Arc::clone(&progress);
                let spec = spec.clone();
                let (max_tokens, think) = (
                    opts.max_tokens,
                    Duration::from_millis(round_ms * opts.think_rounds as u64),
                );
                tasks.push(tokio::spawn(async move {
                    let r = converse(addr, spec, max_tokens, think, Arc::clone(&p)).await;
                    p.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .reports[i] = Some(r);
                }));
            }
        }
        tokio::time::sleep(Duration::from_millis(round_ms)).await;
        if !server.alive() {
            server_died = true;
            say(&format!("serve-qos: the server died in round {round}"));
            break;
        }
        let s = get_status(addr).await?;
        let rss = server.rss();
        let measured = rss.saturating_sub(floor);
        let modelled = s["engine"]["modelled_bytes"].as_u64().unwrap_or(0);
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let row = ServeRound {
            round,
            t_s: t0.elapsed().as_secs_f64(),
            budget_bytes: b.bytes,
            rss_bytes: rss,
            measured_bytes: measured,
            modelled_bytes: modelled,
            overshoot_measured_bytes: signed(measured) - signed(b.bytes),
            overshoot_modelled_bytes: signed(modelled) - signed(b.bytes),
            engine_rung: s["engine"]["current_rung"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
            loaded: strings(&s["engine"]["loaded"]),
            parked: s["engine"]["parked"] == true,
            released: s["engine"]["released"] == true,
            queued: s["queue"]["waiting"].as_u64().unwrap_or(0),
            tenants: tenants_of(&s)?,
        };
        let states: Vec<String> = row
            .tenants
            .iter()
            .map(|t| {
                format!(
                    "{}:{}@{}",
                    t.id,
                    super::figures::serde_word(&t.state),
                    t.rung
                )
            })
            .collect();
        say(&format!(
            "serve-qos: round {round:>3} budget {:>5} MiB, rss {:>5} MiB (above floor {:>5}), modelled {:>5} MiB, engine {}{}{}  {}",
            b.bytes >> 20,
            rss >> 20,
            measured >> 20,
            modelled >> 20,
            row.engine_rung,
            if row.parked { " parked" } else { "" },
            if row.released { " released" } else { "" },
            states.join(" ")
        ));
        rounds.push(row);
        let done = tasks.iter().all(tokio::task::JoinHandle::is_finished);
        if done && round + 1 >= opts.min_rounds {
            break;
        }
    }
    let reports: Vec<ConversationReport> = {
        let p = progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        p.reports
            .iter()
            .zip(&opts.conversations)
            .map(|(r, spec)| {
                r.clone().unwrap_or_else(|| ConversationReport {
                    spec: spec.clone(),
                    turns: Vec::new(),
                    complete: false,
                    recalled: false,
                })
            })
            .collect()
    };
    for t in tasks {
        t.abort();
    }
    drop(server);
    let record: Value = std::fs::read(opts.work_dir.join("record.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let unfinished_turns = reports
        .iter()
        .flat_map(|r| &r.turns)
        .filter(|t| !(t.status == 200 && matches!(t.finish.as_str(), "stop" | "length")))
        .count();
    Ok(ServeQosReport {
        max_overshoot_measured_bytes: rounds
            .iter()
            .map(|r| r.overshoot_measured_bytes)
            .max()
            .unwrap_or(0),
        max_overshoot_modelled_bytes: rounds
            .iter()
            .map(|r| r.overshoot_modelled_bytes)
            .max()
            .unwrap_or(0),
        max_overshoot_rss_bytes: rounds
            .iter()
            .map(|r| signed(r.rss_bytes) - signed(r.budget_bytes))
            .max()
            .unwrap_or(0),
        killed: unfinished_turns + usize::from(server_died),
        lost_conversations: reports.iter().filter(|r| !r.complete).count(),
        hibernated: count_events(&record, "hibernated"),
        resumed: count_events(&record, "woken"),
        released: count_events(&record, "released"),
        recalled: reports.iter().filter(|r| r.recalled).count(),
        floor_rss_bytes: floor,
        rounds,
        conversations: reports,
        budget_source: budget.describe(),
        round_ms,
        wall_s: t0.elapsed().as_secs_f64(),
        parallel: opts.parallel.max(1),
        think_rounds: opts.think_rounds,
    })
}
