//! The small public face of the runtime: open a ladder, set a budget, talk.
//!
//! - [`Molt`] is one engine: the ladder's rungs (memory-mapped GGUF files run by llama.cpp),
//!   the budget, and the token loop that moves an answer between rungs when the budget says so.
//!   Made by [`Molt::builder`]; dropping it stops the engine.
//! - [`Conversation`] is one chat on that engine ([`Molt::conversation`]); several share the
//!   engine and its budget.
//! - [`Answer`] streams one reply as [`Event`]s — every token names the rung that produced it,
//!   every switch arrives as an event of its own — and ends with its [`Stats`].
//! - [`Budget`] says where the memory budget comes from: fixed, the real system, a replayed
//!   trace, or the application's own source; [`Molt::set_budget`] changes it mid-answer.
//!
//! Everything fallible returns the one [`Error`], which names the thing at fault; nothing
//! panics across the API.

#![deny(missing_docs)]

mod budget;
mod engine;
mod error;

pub use budget::Budget;
pub use error::Error;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use crate::engine::{ContextConfig, SamplingParams};
use crate::ladder::{Ladder, search};
use crate::session::{Event, GenerateOptions, Session, SessionOptions, StopReason, SwitchInfo};

use budget::{Reader, Swappable};
use engine::{Engine, Job};

/// Where the ladder is: a name (searched in `$MOLT_HOME/models`, `./models` and the per-user
/// data directory), a path to its manifest (`.toml`), or a ladder already opened.
pub enum LadderRef {
    /// A name or a manifest path.
    Named(String),
    /// An opened ladder.
    Open(Ladder),
}

impl From<&str> for LadderRef {
    fn from(s: &str) -> Self {
        Self::Named(s.to_string())
    }
}

impl From<String> for LadderRef {
    fn from(s: String) -> Self {
        Self::Named(s)
    }
}

impl From<&Path> for LadderRef {
    fn from(p: &Path) -> Self {
        Self::Named(p.display().to_string())
    }
}

impl From<PathBuf> for LadderRef {
    fn from(p: PathBuf) -> Self {
        Self::Named(p.display().to_string())
    }
}

impl From<Ladder> for LadderRef {
    fn from(l: Ladder) -> Self {
        Self::Open(l)
    }
}

/// What loading the engine is doing, for a progress line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadProgress {
    /// The ladder's files were checked (hashes, tokenizer): `rungs` of them.
    LadderOpened {
        /// The ladder's rung names, largest first.
        rungs: Vec<String>,
    },
    /// A rung is being mapped and its context created.
    LoadingRung {
        /// The rung.
        rung: String,
    },
    /// The engine is ready on `rung`.
    Ready {
        /// The rung it starts on.
        rung: String,
    },
}

/// One rung's memory, estimated from its file before anything is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RungEstimate {
    /// The rung.
    pub rung: String,
    /// Its weights (the tensors of its GGUF file, memory-mapped), bytes.
    pub weight_bytes: u64,
    /// Its KV cache per token of context, bytes.
    pub kv_bytes_per_token: u64,
    /// Weights and the context's buffers — the KV cache is reserved for the whole window when
    /// the context is created — bytes: what the budget must hold to run this rung.
    pub full_window_bytes: u64,
}

/// A ladder's memory, estimated before loading ([`MoltBuilder::estimate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Estimate {
    /// The context window the estimate is for, tokens.
    pub n_ctx: u32,
    /// Every rung, largest first.
    pub rungs: Vec<RungEstimate>,
}

/// How long an answer may stay parked (no rung fits the budget) before it ends with
/// [`StopReason::ParkDeadline`], unless [`MoltBuilder::options`] says otherwise.
pub const DEFAULT_PARK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

/// What [`MoltBuilder::on_progress`] is given.
type ProgressFn = Box<dyn FnMut(&LoadProgress) + Send>;

/// Sets up a [`Molt`] engine ([`Molt::builder`]).
pub struct MoltBuilder {
    ladder: LadderRef,
    models_dir: Option<PathBuf>,
    budget: Budget,
    start: Option<String>,
    config: ContextConfig,
    options: SessionOptions,
    progress: Option<ProgressFn>,
}

impl MoltBuilder {
    /// Where the budget comes from (default: [`Budget::Unlimited`]).
    #[must_use]
    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }

    /// The rung to start on (default: the largest the budget holds).
    #[must_use]
    pub fn start_on(mut self, rung: &str) -> Self {
        self.start = Some(rung.to_string());
        self
    }

    /// The directory of the model files (default: beside the manifest).
    #[must_use]
    pub fn models_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.models_dir = Some(dir.into());
        self
    }

    /// A directory of fitted projectors (`<dir>/<ladder>/*.molt-proj`), searched before the
    /// default places (`$MOLT_HOME/projectors`, `./projectors`, the per-user data directory)
    /// and the copies built into the library.
    #[must_use]
    pub fn projectors(mut self, dir: impl Into<PathBuf>) -> Self {
        self.options.projector_dirs.insert(0, dir.into());
        self
    }

    /// The context window, tokens, for every rung (default 2048).
    #[must_use]
    pub fn context_tokens(mut self, n_ctx: u32) -> Self {
        self.config.n_ctx = n_ctx;
        self
    }

    /// CPU threads (default: every core).
    #[must_use]
    pub fn threads(mut self, n: u32) -> Self {
        self.config.n_threads = n.max(1);
        self
    }

    /// The session's options: how a switch carries the cache, the levers, standby rungs, …
    /// (default: [`SessionOptions::default`], what `molt-run` uses, with a park deadline of
    /// [`DEFAULT_PARK_DEADLINE`]). Replaces what [`MoltBuilder::projectors`] added: call that
    /// after this.
    #[must_use]
    pub fn options(mut self, options: SessionOptions) -> Self {
        self.options = options;
        self
    }

    /// Called as the engine loads (the ladder checked, each rung mapped, ready).
    #[must_use]
    pub fn on_progress(mut self, f: impl FnMut(&LoadProgress) + Send + 'static) -> Self {
        self.progress = Some(Box::new(f));
        self
    }

    fn open_ladder(&mut self) -> Result<Ladder, Error> {
        match std::mem::replace(&mut self.ladder, LadderRef::Named(String::new())) {
            LadderRef::Open(l) => Ok(l),
            LadderRef::Named(name) => {
                let loc =
                    search::locate(&name, self.models_dir.as_deref(), false).map_err(|detail| {
                        Error::LadderNotFound {
                            ladder: name.clone(),
                            detail,
                        }
                    })?;
                Ladder::open(&loc.manifest, &loc.models_dir).map_err(|source| Error::Ladder {
                    ladder: loc.manifest.clone(),
                    source,
                })
            }
        }
    }

    /// What each rung of the ladder would hold, from its files' metadata, before anything is
    /// loaded: weights, KV per token, and the whole at a full window.
    ///
    /// # Errors
    /// [`Error::LadderNotFound`] or [`Error::Ladder`] when the ladder cannot be opened.
    pub fn estimate(mut self) -> Result<(Estimate, Self), Error> {
        let ladder = self.open_ladder()?;
        let costs = crate::session::estimated_costs(&ladder, self.config);
        let rungs = costs
            .iter()
            .map(|c| RungEstimate {
                rung: c.name.clone(),
                weight_bytes: c.weights_bytes,
                kv_bytes_per_token: c.kv_bytes(1),
                full_window_bytes: c.resident_bytes(),
            })
            .collect();
        let est = Estimate {
            n_ctx: self.config.n_ctx,
            rungs,
        };
        self.ladder = LadderRef::Open(ladder);
        Ok((est, self))
    }

    /// Opens the ladder, loads the starting rung (and the smaller ones on standby), and starts
    /// the engine.
    ///
    /// # Errors
    /// [`Error::LadderNotFound`] / [`Error::Ladder`] for a ladder that cannot be opened (a
    /// missing or truncated file, rungs with different tokenizers), [`Error::UnknownRung`],
    /// [`Error::Budget`] for a source that cannot be read, [`Error::BudgetBelowSmallest`]
    /// when the budget holds no rung, [`Error::Session`] when a rung fails to load.
    pub fn build(mut self) -> Result<Molt, Error> {
        let mut progress = self.progress.take();
        let mut report = |p: LoadProgress| {
            if let Some(f) = progress.as_mut() {
                f(&p);
            }
        };
        let ladder = self.open_ladder()?;
        report(LoadProgress::LadderOpened {
            rungs: ladder.names().iter().map(ToString::to_string).collect(),
        });
        let names: Vec<String> = ladder.names().iter().map(ToString::to_string).collect();
        if let Some(s) = &self.start
            && !names.contains(s)
        {
            return Err(Error::UnknownRung {
                rung: s.clone(),
                ladder: ladder.name().to_string(),
                rungs: names.join(", "),
            });
        }
        // The budget's source, read once now: it decides the starting rung and refuses a
        // budget that holds nothing.
        let costs = crate::session::estimated_costs(&ladder, self.config);
        let refs: crate::pressure::TraceRefs = costs
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.resident_bytes() + c.kv_bytes(u64::from(self.config.n_ctx)),
                )
            })
            .collect();
        let source = std::mem::replace(&mut self.budget, Budget::Unlimited).into_source(&refs)?;
        let swappable = Swappable::default();
        swappable.replace(source);
        let at_start = swappable.read_now();
        let start = match (&self.start, at_start) {
            (Some(s), _) => s.clone(),
            (None, Some(b)) => {
                // The largest rung whose weights and a short conversation fit.
                let need = |c: &crate::sched::RungCost| c.resident_bytes() + c.kv_bytes(256);
                let Some(c) = costs.iter().find(|c| need(c) <= b) else {
                    let smallest = costs
                        .last()
                        .map_or((String::new(), 0), |c| (c.name.clone(), need(c) >> 20));
                    return Err(Error::BudgetBelowSmallest {
                        ladder: ladder.name().to_string(),
                        budget_mib: b >> 20,
                        smallest: smallest.0,
                        need_mib: smallest.1,
                    });
                };
                c.name.clone()
            }
            (None, None) => names[0].clone(),
        };
        report(LoadProgress::LoadingRung {
            rung: start.clone(),
        });
        let mut session = Session::with_options(ladder, self.config, &start, self.options.clone())?;
        session.set_budget_source(Some(Box::new(Reader(swappable.clone()))));
        report(LoadProgress::Ready {
            rung: start.clone(),
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("molt-engine".to_string())
            .spawn(move || Engine::new(session).run(&rx))
            .map_err(|e| Error::Budget(format!("starting the engine thread: {e}")))?;
        Ok(Molt {
            shared: Arc::new(Shared {
                jobs: Mutex::new(Some(tx)),
                next_conversation: AtomicU64::new(1),
            }),
            budget: swappable,
            thread: Some(thread),
            names,
            refs,
        })
    }
}

/// What conversations hold of their engine: the job queue (closed when the engine drops).
struct Shared {
    jobs: Mutex<Option<Sender<Job>>>,
    next_conversation: AtomicU64,
}

impl Shared {
    fn send(&self, job: Job) -> Result<(), Error> {
        let g = self.jobs.lock().map_err(|_| Error::EngineGone)?;
        g.as_ref()
            .ok_or(Error::EngineGone)?
            .send(job)
            .map_err(|_| Error::EngineGone)
    }
}

/// One engine: a ladder's rungs under one memory budget, and the token loop that moves every
/// conversation's answer between them. See the [crate root](crate) for an example.
pub struct Molt {
    shared: Arc<Shared>,
    budget: Swappable,
    thread: Option<JoinHandle<()>>,
    names: Vec<String>,
    /// What a trace's `{"frac": …, "of": "rung"}` events resolve against.
    refs: crate::pressure::TraceRefs,
}

impl Molt {
    /// Starts setting up an engine on `ladder`: a name (`"qwen2.5-coder"`), a manifest path, or
    /// an opened [`Ladder`].
    pub fn builder(ladder: impl Into<LadderRef>) -> MoltBuilder {
        MoltBuilder {
            ladder: ladder.into(),
            models_dir: None,
            budget: Budget::Unlimited,
            start: None,
            config: ContextConfig::default(),
            options: SessionOptions {
                // An answer parked (no rung fits the budget) ends after two minutes, its text
                // and the conversation kept, rather than holding the application's thread
                // until memory returns.
                park_deadline: Some(DEFAULT_PARK_DEADLINE),
                ..SessionOptions::default()
            },
            progress: None,
        }
    }

    /// A new conversation on this engine.
    #[must_use]
    pub fn conversation(&self) -> Conversation {
        Conversation {
            id: self
                .shared
                .next_conversation
                .fetch_add(1, Ordering::Relaxed),
            shared: Arc::downgrade(&self.shared),
            streaming: Arc::new(AtomicBool::new(false)),
            max_tokens: 256,
            sampling: SamplingParams::greedy(),
        }
    }

    /// Replaces the budget's source; the engine reads it before its next token, so a budget cut
    /// mid-answer moves that answer at once. Call it with [`Budget::Bytes`] on each of the
    /// platform's memory warnings to drive Molt from the application.
    ///
    /// # Errors
    /// [`Error::Budget`] when the new source cannot be read (the old one stays).
    pub fn set_budget(&self, budget: Budget) -> Result<(), Error> {
        let source = budget.into_source(&self.refs)?;
        self.budget.replace(source);
        Ok(())
    }

    /// The budget now, bytes (`None`: unlimited).
    #[must_use]
    pub fn budget_bytes(&self) -> Option<u64> {
        self.budget.read_now()
    }

    /// The rung the engine is on now (after the last answer, or the one streaming).
    ///
    /// # Errors
    /// [`Error::EngineGone`] when the engine thread has stopped.
    pub fn current_rung(&self) -> Result<String, Error> {
        let (reply, rx) = mpsc::channel();
        self.shared.send(Job::Rung { reply })?;
        rx.recv().map_err(|_| Error::EngineGone)
    }

    /// The ladder's rung names, largest first.
    #[must_use]
    pub fn rungs(&self) -> &[String] {
        &self.names
    }

    /// Resumes a conversation hibernated to `path` ([`Conversation::hibernate`], this process
    /// or another) as a new conversation: on the rung that wrote it, or on `rung` — a smaller
    /// one takes its cache through the switch, without loading the rung that wrote it.
    ///
    /// # Errors
    /// [`Error::State`] for a file that is unreadable, damaged, or written for another ladder,
    /// rung file or context window; [`Error::UnknownRung`]; [`Error::Session`] when the
    /// budget holds no rung for it or the switch fails.
    pub fn resume(
        &self,
        path: impl AsRef<Path>,
        rung: Option<&str>,
    ) -> Result<Conversation, Error> {
        let conv = self.conversation();
        let (reply, rx) = mpsc::channel();
        self.shared.send(Job::Resume {
            conv: conv.id,
            path: path.as_ref().to_path_buf(),
            rung: rung.map(str::to_string),
            reply,
        })?;
        rx.recv().map_err(|_| Error::EngineGone)??;
        Ok(conv)
    }
}

impl Drop for Molt {
    fn drop(&mut self) {
        // Closing the queue ends the engine thread after the job it is on (an answer streaming
        // is cancelled by its reader going away).
        if let Ok(mut g) = self.shared.jobs.lock() {
            g.take();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One chat on a [`Molt`] engine: its messages and (while it is the one answered) its cache.
pub struct Conversation {
    id: u64,
    shared: Weak<Shared>,
    streaming: Arc<AtomicBool>,
    max_tokens: usize,
    sampling: SamplingParams,
}

impl Conversation {
    /// Its id, unique within its engine.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// At most this many tokens per answer (default 256).
    pub fn set_max_tokens(&mut self, n: usize) {
        self.max_tokens = n.max(1);
    }

    /// How tokens are sampled (default: greedy).
    pub fn set_sampling(&mut self, sampling: SamplingParams) {
        self.sampling = sampling;
    }

    fn shared(&self) -> Result<Arc<Shared>, Error> {
        self.shared.upgrade().ok_or(Error::EngineGone)
    }

    /// Sends a user message and streams the answer. Answers of several conversations take
    /// turns on the engine; this one's events start once the engine reaches it.
    ///
    /// # Errors
    /// [`Error::AnswerInProgress`] while this conversation's previous [`Answer`] is alive;
    /// [`Error::EngineGone`] after the engine was dropped. What goes wrong while answering
    /// (a prompt longer than the context, a budget below the smallest rung) arrives as the
    /// answer's last item.
    pub fn send(&mut self, text: &str) -> Result<Answer, Error> {
        let shared = self.shared()?;
        if self.streaming.swap(true, Ordering::SeqCst) {
            return Err(Error::AnswerInProgress {
                conversation: self.id,
            });
        }
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job::Send {
            conv: self.id,
            text: text.to_string(),
            opts: GenerateOptions {
                max_tokens: self.max_tokens,
                sampling: self.sampling,
                force_switch: None,
            },
            cancel: Arc::clone(&cancel),
            events: tx,
        };
        if let Err(e) = shared.send(job) {
            self.streaming.store(false, Ordering::SeqCst);
            return Err(e);
        }
        Ok(Answer {
            events: rx,
            cancel,
            streaming: Arc::clone(&self.streaming),
            stats: StatsBuilder::default(),
            done: false,
        })
    }

    /// Sends a user message and waits for the whole answer: its text and stats.
    ///
    /// # Errors
    /// As [`Conversation::send`], and whatever ended the answer.
    pub fn ask(&mut self, text: &str) -> Result<Stats, Error> {
        self.send(text)?.finish()
    }

    /// Writes this conversation — its cache, its messages, the rung it is on — to `path`, so
    /// that [`Molt::resume`] can put it back (in this process or another, on that rung or a
    /// smaller one). Cells a switch projected are read natively first. Returns the file's
    /// size in bytes.
    ///
    /// # Errors
    /// [`Error::NothingToHibernate`] before the first answer; [`Error::Write`];
    /// [`Error::EngineGone`].
    pub fn hibernate(&self, path: impl AsRef<Path>) -> Result<u64, Error> {
        let shared = self.shared()?;
        let (reply, rx) = mpsc::channel();
        shared.send(Job::Hibernate {
            conv: self.id,
            path: path.as_ref().to_path_buf(),
            reply,
        })?;
        rx.recv().map_err(|_| Error::EngineGone)?
    }
}

impl Drop for Conversation {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            let _ = s.send(Job::Forget { conv: self.id });
        }
    }
}

/// One answer streaming: iterate it for [`Event`]s (tokens naming their rung, switches,
/// budget changes, levers), then read its [`Stats`]; [`Answer::cancel`] stops it at the
/// next token. Dropping it cancels what is left.
pub struct Answer {
    events: Receiver<Result<Event, Error>>,
    cancel: Arc<AtomicBool>,
    streaming: Arc<AtomicBool>,
    stats: StatsBuilder,
    done: bool,
}

impl Answer {
    /// Stops the answer at the next token (its `Done` event says `cancelled`).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// A handle that cancels this answer from another thread.
    #[must_use]
    pub fn cancel_handle(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }

    /// Reads the rest of the answer and returns its stats.
    ///
    /// # Errors
    /// Whatever ended the answer ([`Error::Session`]: a prompt too long for the context, a
    /// budget below the smallest rung, a failed load), or [`Error::EngineGone`].
    pub fn finish(mut self) -> Result<Stats, Error> {
        for e in self.by_ref() {
            e?;
        }
        self.stats.build().ok_or(Error::EngineGone)
    }

    /// The stats so far (complete once the `Done` event was read).
    #[must_use]
    pub fn stats(&self) -> Option<Stats> {
        self.stats.build()
    }
}

impl Iterator for Answer {
    type Item = Result<Event, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.events.recv() {
            Ok(Ok(e)) => {
                if matches!(e, Event::Done(_)) {
                    self.done = true;
                    self.streaming.store(false, Ordering::SeqCst);
                }
                self.stats.see(&e);
                Some(Ok(e))
            }
            Ok(Err(e)) => {
                self.done = true;
                self.streaming.store(false, Ordering::SeqCst);
                Some(Err(e))
            }
            Err(_) => {
                // The engine dropped the answer's sender without a Done: it was cancelled
                // before it started, or the engine stopped.
                self.done = true;
                self.streaming.store(false, Ordering::SeqCst);
                if self.cancel.load(Ordering::SeqCst) {
                    None
                } else {
                    Some(Err(Error::EngineGone))
                }
            }
        }
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if !self.done {
            self.cancel.store(true, Ordering::SeqCst);
        }
        self.streaming.store(false, Ordering::SeqCst);
    }
}

/// One answer, measured: what the user waited for and what the engine did.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// The answer's text.
    pub text: String,
    /// Tokens generated.
    pub tokens: usize,
    /// Time to the first token, ms.
    pub ttft_ms: f64,
    /// The whole answer, ms.
    pub total_ms: f64,
    /// Decode speed after the first token, tokens per second.
    pub tokens_per_s: f64,
    /// The prompt's tokens (the whole conversation as rendered).
    pub prompt_tokens: usize,
    /// Of which were already cached (not read again).
    pub cached_tokens: usize,
    /// Rungs in the order the answer used them.
    pub rungs_used: Vec<String>,
    /// Every switch between two tokens, with its cost.
    pub switches: Vec<SwitchInfo>,
    /// Why it ended.
    pub stop: StopReason,
}

#[derive(Default)]
struct StatsBuilder {
    text: String,
    tokens: usize,
    cached: usize,
    prompt: usize,
    switches: Vec<SwitchInfo>,
    done: Option<crate::session::Summary>,
}

impl StatsBuilder {
    fn see(&mut self, e: &Event) {
        match e {
            Event::Start {
                prompt_tokens,
                reused_tokens,
                ..
            } => {
                self.prompt = *prompt_tokens;
                self.cached = *reused_tokens;
            }
            Event::Token { text, .. } => {
                self.text.push_str(text);
                self.tokens += 1;
            }
            Event::Switch(s) => self.switches.push(s.clone()),
            Event::Done(s) => self.done = Some(s.clone()),
            _ => {}
        }
    }

    fn build(&self) -> Option<Stats> {
        let d = self.done.as_ref()?;
        Some(Stats {
            text: self.text.clone(),
            tokens: self.tokens,
            ttft_ms: d.ttft_ms,
            total_ms: d.total_ms,
            tokens_per_s: if d.tokens > 1 && d.total_ms > d.ttft_ms {
                (d.tokens - 1) as f64 * 1e3 / (d.total_ms - d.ttft_ms)
            } else {
                0.0
            },
            prompt_tokens: self.prompt,
            cached_tokens: self.cached,
            rungs_used: d.rungs_used.clone(),
            switches: self.switches.clone(),
            stop: d.stop,
        })
    }
}
