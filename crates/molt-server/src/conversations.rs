//! The conversations the service keeps: which request continues which conversation, where each
//! one's cache lives (in the engine, hibernated to a state file, or held in RAM when the file
//! could not be written), and the one place that moves a cache between those.
//!
//! Main types: [`Conversations`] (the store, shared by the HTTP handlers and the engine thread)
//! and [`JobConversation`] (what a queued request carries: its conversation, resolved when it
//! arrived).
//!
//! As data flows, one request: the HTTP side renders the messages to tokens and
//! [`Conversations::resolve`]s them — an explicit `molt.conversation` id, else the kept
//! conversation whose tokens share the longest prefix with the request (at least its first
//! turn, as llama.cpp's server picks the slot with the longest common prefix), else a new one.
//! When the engine takes the request, [`Conversations::take_engine`] hibernates the
//! conversation the session holds if it is another one (state file under `--state-dir`;
//! on a full disk its exported cache stays in RAM, said in a log line), and wakes the
//! request's conversation from its file if it has one, so only the new turn is read. A file
//! that is refused (truncated, corrupt, foreign, stale) is named in a log line and removed,
//! and the conversation is re-read from the request's messages — never lost, since the client
//! sends them with every request; a file refused at start is also told, with why, to the first
//! request that names its conversation (its `note`). After the answer, [`Conversations::after_answer`] records
//! what the session now holds.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;

use super::record::Recorder;
use molt::engine::Token;
use molt::session::Session;
use molt::state::{Evicted, Expect, StateDir, StateFile, valid_id};

/// Most conversations remembered; past it the least recently used one is forgotten (its state
/// file stays until the directory's bound evicts it, and is found again after a restart).
const MAX_CONVERSATIONS: usize = 1024;

/// Where a conversation's cache is (read back by the `QoS` bench from the status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConversationState {
    /// Being answered.
    Running,
    /// Its answer is parked mid-way: the budget holds no rung, the weights are unmapped and
    /// the cache waits in RAM until memory returns.
    Parked,
    /// Idle in RAM: in the engine's session, or its exported cache held because the state file
    /// could not be written. (Not "parked": a parked session has released its weights.)
    Kept,
    /// In its state file; costs no RAM.
    Hibernated,
    /// A request for it is waiting for the engine.
    Queued,
    /// No cache kept (nothing worth keeping, or its file was refused or evicted): the next
    /// request re-reads it from its messages.
    Dropped,
}

/// Scheduling class of a conversation (`molt.class`): both loops take queued foreground
/// requests before background ones, and the batched loop lets a background conversation's
/// kept cache go (to its state file) before a foreground one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// A user is waiting on it.
    #[default]
    Foreground,
    /// Nobody is watching it stream.
    Background,
}

/// What a request asks of the store (`molt.conversation`, `molt.class`, `molt.priority`).
#[derive(Debug, Clone, Default)]
pub struct ConversationAsk {
    /// Explicit id.
    pub id: Option<String>,
    /// Class.
    pub class: Option<Class>,
    /// Priority (higher first).
    pub priority: Option<i32>,
}

/// A request's conversation, resolved when it arrived.
#[derive(Debug, Clone)]
pub struct JobConversation {
    /// Its id.
    pub id: String,
    /// True when this request started it.
    pub new: bool,
    /// Why a new one was started for an id the request named, if so.
    pub note: Option<String>,
    /// The request's prompt tokens (a state file must be continued by them).
    pub tokens: Vec<Token>,
    /// The conversation's class when the request arrived.
    pub class: Class,
    /// Its priority (higher first within a class).
    pub priority: i32,
}

/// One kept conversation.
#[derive(Debug)]
struct Conversation {
    rung: String,
    /// Tokens its cache holds (in the engine or its file).
    tokens: Vec<Token>,
    first_turn_len: usize,
    state: ConversationState,
    bytes: u64,
    file: Option<PathBuf>,
    /// Its exported cache, when its file could not be written.
    in_ram: Option<StateFile>,
    class: Class,
    priority: i32,
    queued: usize,
    last_used: u64,
}

/// One conversation as `GET /v1/molt/status` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct ConversationView {
    /// Id.
    pub id: String,
    /// The rung its cache is on.
    pub rung: String,
    /// Tokens its cache holds.
    pub tokens: usize,
    /// Where the cache is.
    pub state: ConversationState,
    /// Bytes it costs where it is (KV in RAM, or the state file's size).
    pub bytes: u64,
    /// Its state file, when hibernated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// Class.
    pub class: Class,
    /// Priority.
    pub priority: i32,
}

/// How the engine took up a request's conversation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Takeover {
    /// The conversation hibernated to make room, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hibernated: Option<String>,
    /// Where the request's cache came from: `engine` (it was there), `file`, `ram`, or
    /// `messages` (re-read).
    pub resumed_from: &'static str,
    /// Tokens woken from a file or RAM.
    pub woken_tokens: usize,
}

struct Store {
    convs: HashMap<String, Conversation>,
    /// Conversations whose state file was refused when the store was opened, and why (without
    /// the path): a request that names one is told, not just "unknown". Taken when told.
    refused: HashMap<String, String>,
    /// The conversation the session holds.
    live: Option<String>,
    clock: u64,
}

/// The store. See the module doc.
pub struct Conversations {
    inner: Mutex<Store>,
    dir: Option<StateDir>,
    rungs: Vec<(String, String)>,
    n_ctx: u32,
}

fn log(recorder: &Recorder, kind: &str, message: &str, detail: serde_json::Value) {
    eprintln!("molt serve: {message}");
    recorder.service("", kind, detail);
}

impl Conversations {
    /// A store over `dir` (`None`: nothing is written, and a conversation displaced from the
    /// engine is re-read from its messages when it comes back), for a ladder of `rungs` (name,
    /// sha256). The directory's state files are read now: each valid one is a hibernated
    /// conversation; a refused one is named in a log line and removed.
    #[must_use]
    pub fn open(
        dir: Option<StateDir>,
        rungs: Vec<(String, String)>,
        n_ctx: u32,
        recorder: &Recorder,
    ) -> Self {
        let mut convs = HashMap::new();
        let mut refused = HashMap::new();
        let mut clock = 0;
        if let Some(d) = &dir {
            let expect = Expect {
                rungs: &rungs,
                n_ctx,
                continues: None,
            };
            for e in d.entries() {
                match StateFile::load(&e.path, &expect) {
                    Ok(f) if valid_id(&e.conversation) => {
                        clock += 1;
                        convs.insert(
                            e.conversation.clone(),
                            Conversation {
                                rung: f.meta.rung,
                                tokens: f.meta.tokens,
                                first_turn_len: f.meta.first_turn_len,
                                state: ConversationState::Hibernated,
                                bytes: e.bytes,
                                file: Some(e.path.clone()),
                                in_ram: None,
                                class: Class::default(),
                                priority: 0,
                                queued: 0,
                                last_used: clock,
                            },
                        );
                    }
                    Ok(_) => {}
                    Err(err) => {
                        log(
                            recorder,
                            "state_refused",
                            &format!("refused {err}; removed"),
                            serde_json::json!({"file": e.path, "kind": err.kind(), "reason": err.to_string()}),
                        );
                        let _ = std::fs::remove_file(&e.path);
                        if valid_id(&e.conversation) && refused.len() < MAX_CONVERSATIONS {
                            refused.insert(e.conversation.clone(), err.reason());
                        }
                    }
                }
            }
            if !convs.is_empty() {
                eprintln!(
                    "molt serve: {} hibernated conversation(s) in {}",
                    convs.len(),
                    d.path().display()
                );
            }
        }
        Self {
            inner: Mutex::new(Store {
                convs,
                refused,
                live: None,
                clock,
            }),
            dir,
            rungs,
            n_ctx,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The state directory, if any.
    #[must_use]
    pub fn dir(&self) -> Option<&StateDir> {
        self.dir.as_ref()
    }

    /// Which conversation a request of `tokens` continues: `ask.id` if it is kept; otherwise
    /// the kept conversation sharing the longest token prefix with the request (at least its
    /// first turn; the most recent on a tie); otherwise a new one (named `ask.id` when that is a
    /// valid id, and said so in `note`). The conversation counts the request as queued.
    pub fn resolve(&self, ask: &ConversationAsk, tokens: Vec<Token>) -> JobConversation {
        let mut s = self.lock();
        s.clock += 1;
        let now = s.clock;
        let (id, new, note) = match ask.id.as_deref() {
            Some(id) if s.convs.contains_key(id) => (id.to_string(), false, None),
            Some(id) => {
                let named = valid_id(id).then(|| id.to_string());
                let note = match s.refused.remove(id) {
                    Some(why) => format!(
                        "conversation {id:?}: its state file was refused ({why}) and removed; started it again under that id from the messages sent"
                    ),
                    None => format!(
                        "unknown conversation {:?}: started a new conversation{}",
                        id.chars().take(64).collect::<String>(),
                        if named.is_some() {
                            " under that id"
                        } else {
                            " (ids are 1–64 letters, digits, - or _)"
                        }
                    ),
                };
                (named.unwrap_or_else(fresh_id), true, Some(note))
            }
            None => {
                let best = s
                    .convs
                    .iter()
                    .filter_map(|(id, c)| {
                        let shared = common_prefix(&c.tokens, &tokens);
                        (c.first_turn_len > 0 && shared >= c.first_turn_len).then_some((
                            shared,
                            c.last_used,
                            id,
                        ))
                    })
                    .max();
                match best {
                    Some((_, _, id)) => (id.clone(), false, None),
                    None => (fresh_id(), true, None),
                }
            }
        };
        if new {
            if s.convs.len() >= MAX_CONVERSATIONS {
                forget_oldest(&mut s);
            }
            s.convs.insert(
                id.clone(),
                Conversation {
                    rung: String::new(),
                    tokens: Vec::new(),
                    first_turn_len: 0,
                    state: ConversationState::Queued,
                    bytes: 0,
                    file: None,
                    in_ram: None,
                    class: Class::default(),
                    priority: 0,
                    queued: 0,
                    last_used: now,
                },
            );
        }
        let (mut class, mut priority) = (Class::default(), 0);
        if let Some(c) = s.convs.get_mut(&id) {
            c.queued += 1;
            c.last_used = now;
            if let Some(class) = ask.class {
                c.class = class;
            }
            if let Some(p) = ask.priority {
                c.priority = p;
            }
            (class, priority) = (c.class, c.priority);
        }
        JobConversation {
            id,
            new,
            note,
            tokens,
            class,
            priority,
        }
    }

    /// Gives the engine to `job`'s conversation (`None`: a request outside any conversation,
    /// a text completion): hibernates the conversation the session holds if it is another
    /// one, then wakes `job`'s from its file or RAM if it has one there.
    pub fn take_engine(
        &self,
        session: &mut Session,
        job: Option<&JobConversation>,
        recorder: &Recorder,
    ) -> Takeover {
        let live = self.lock().live.clone();
        let target = job.map(|j| j.id.as_str());
        let mut out = Takeover {
            resumed_from: "messages",
            ..Takeover::default()
        };
        if live.is_some() && live.as_deref() == target {
            out.resumed_from = "engine";
        } else if let Some(l) = live {
            self.hibernate_live(session, &l, recorder);
            out.hibernated = Some(l);
        } else if job.is_some() {
            // A completion's cache (no conversation) is not another conversation's prefix.
            session.reset();
        }
        let Some(job) = job else {
            return out;
        };
        {
            let mut s = self.lock();
            s.live = Some(job.id.clone());
            match s.convs.get_mut(&job.id) {
                Some(c) => {
                    c.queued = c.queued.saturating_sub(1);
                    c.state = ConversationState::Running;
                    if out.resumed_from == "engine" {
                        return out;
                    }
                }
                None => return out,
            }
        }
        let woken = self.wake(job, recorder, |f| {
            session
                .wake(f)
                .map(|()| session.current_rung().to_string())
                .map_err(|e| e.to_string())
        });
        match woken {
            Some((from, n)) => {
                out.resumed_from = from;
                out.woken_tokens = n;
            }
            None => session.reset(),
        }
        out
    }

    /// Wakes `job`'s conversation from its RAM copy or its state file through `import`, which
    /// puts the file's cache where the loop runs it and names the rung (or says why it cannot):
    /// where it came from (`ram`, `file`) and the tokens woken. `None` when it has neither, or
    /// when the file was refused — named in a log line and removed; the conversation is then
    /// re-read from the request's messages, never lost. Both request loops wake through here.
    pub fn wake(
        &self,
        job: &JobConversation,
        recorder: &Recorder,
        import: impl FnOnce(&StateFile) -> Result<String, String>,
    ) -> Option<(&'static str, usize)> {
        let (in_ram, file) = {
            let mut s = self.lock();
            let c = s.convs.get_mut(&job.id)?;
            (c.in_ram.take(), c.file.clone())
        };
        let expect = Expect {
            rungs: &self.rungs,
            n_ctx: self.n_ctx,
            continues: Some(&job.tokens),
        };
        let (loaded, from) = match (in_ram, &file) {
            (Some(f), _) => (Ok(f), "ram"),
            (None, Some(path)) => (StateFile::load(path, &expect), "file"),
            (None, None) => return None,
        };
        let woken = loaded.map_err(|e| e.to_string()).and_then(|f| {
            import(&f)
                .map(|rung| (f.meta.tokens.len(), rung))
                .map_err(|e| {
                    format!(
                        "{}: {e}",
                        file.as_ref()
                            .map_or_else(|| "RAM copy".into(), |p| p.display().to_string())
                    )
                })
        });
        match woken {
            Ok((n, rung)) => {
                recorder.service(
                    "",
                    "woken",
                    serde_json::json!({"conversation": job.id, "from": from, "tokens": n, "rung": rung}),
                );
                Some((from, n))
            }
            Err(reason) => {
                log(
                    recorder,
                    "state_refused",
                    &format!(
                        "conversation {}: refused {reason}; re-reading it from its messages",
                        job.id
                    ),
                    serde_json::json!({"conversation": job.id, "file": file, "reason": reason}),
                );
                if let Some(p) = &file {
                    let _ = std::fs::remove_file(p);
                }
                let mut s = self.lock();
                if let Some(c) = s.convs.get_mut(&job.id) {
                    c.file = None;
                }
                None
            }
        }
    }

    /// Hibernates the conversation the session holds (to its file; in RAM if the write fails)
    /// and empties the session. Also what a server shutting down calls.
    pub fn hibernate_live(&self, session: &mut Session, id: &str, recorder: &Recorder) {
        let first = self.first_turn_len(id);
        // What a size switch left out is read first: a cache with absent cells is not kept
        // (its conversation would be read again from its messages). One call reads all of it;
        // a failure cut the cache before what it could not read.
        let _ = session.fill_idle(usize::MAX);
        let snapshot = session.hibernate(id, first);
        session.reset();
        {
            let mut s = self.lock();
            if s.live.as_deref() == Some(id) {
                s.live = None;
            }
        }
        self.hibernate(id, snapshot, recorder);
    }

    /// The order in which `id`'s cache is let go of when the engine needs its cells: background
    /// conversations before foreground ones, then the lower priority (an unknown id goes
    /// with the foreground ones at priority 0). Smaller goes first.
    #[must_use]
    pub fn let_go_rank(&self, id: &str) -> (bool, i32) {
        self.lock()
            .convs
            .get(id)
            .map_or((true, 0), |c| (c.class == Class::Foreground, c.priority))
    }

    /// The length of `id`'s first turn (0 while it has none).
    #[must_use]
    pub fn first_turn_len(&self, id: &str) -> usize {
        self.lock().convs.get(id).map_or(0, |c| c.first_turn_len)
    }

    /// Hibernates `id` from `snapshot`, its cache exported by the loop that held it (`None`:
    /// nothing worth keeping): written to its state file, or held in RAM when the write fails
    /// (said in a log line); without a state directory the conversation is dropped. Both
    /// request loops hibernate through here.
    pub fn hibernate(
        &self,
        id: &str,
        snapshot: Result<Option<StateFile>, impl std::fmt::Display>,
        recorder: &Recorder,
    ) {
        let mut s = self.lock();
        let Some(c) = s.convs.get_mut(id) else {
            return;
        };
        let file = match snapshot {
            Ok(Some(f)) => f,
            Ok(None) => {
                c.state = ConversationState::Dropped;
                c.bytes = 0;
                return;
            }
            Err(e) => {
                c.state = ConversationState::Dropped;
                c.bytes = 0;
                drop(s);
                log(
                    recorder,
                    "hibernate_failed",
                    &format!(
                        "conversation {id}: cannot export its cache ({e}); it will be re-read from its messages"
                    ),
                    serde_json::json!({"conversation": id, "reason": e.to_string()}),
                );
                return;
            }
        };
        // Without a state directory a displaced conversation is dropped, as before
        // conversations were kept: holding every one's cache in RAM would grow without bound.
        let Some(dir) = &self.dir else {
            c.state = ConversationState::Dropped;
            c.bytes = 0;
            return;
        };
        drop(s);
        let written = dir.write(id, &file);
        let mut s = self.lock();
        match written {
            Ok((n, evicted)) => {
                if let Some(c) = s.convs.get_mut(id) {
                    c.state = ConversationState::Hibernated;
                    c.bytes = n;
                    c.file = Some(dir.file_of(id));
                }
                recorder.service(
                    "",
                    "hibernated",
                    serde_json::json!({"conversation": id, "file": dir.file_of(id), "bytes": n, "tokens": file.meta.tokens.len()}),
                );
                self.evicted(&mut s, dir, evicted, recorder);
            }
            Err(e) => {
                if let Some(c) = s.convs.get_mut(id) {
                    c.state = ConversationState::Kept;
                    c.bytes = file.blob.len() as u64;
                    c.in_ram = Some(file);
                }
                drop(s);
                log(
                    recorder,
                    "hibernate_failed",
                    &format!(
                        "conversation {id}: cannot hibernate ({e}){}; its cache stays in RAM",
                        if e.is_disk_full() {
                            ": the disk is full"
                        } else {
                            ""
                        }
                    ),
                    serde_json::json!({"conversation": id, "reason": e.to_string(), "disk_full": e.is_disk_full()}),
                );
            }
        }
    }

    /// Writes the state file of `id` while its cache stays where the loop keeps it (the
    /// batched loop, as soon as an answer ends, so that a process killed later loses no
    /// finished turn): the conversation stays `kept`, now with a file behind it. A write that
    /// fails is said in a log line and changes nothing else: the cache is still in RAM, and
    /// [`Conversations::hibernate`] tries again when it is displaced. True when written.
    pub fn persist(&self, id: &str, file: &StateFile, recorder: &Recorder) -> bool {
        let Some(dir) = &self.dir else {
            return false;
        };
        match dir.write(id, file) {
            Ok((n, evicted)) => {
                let mut s = self.lock();
                if let Some(c) = s.convs.get_mut(id) {
                    c.file = Some(dir.file_of(id));
                }
                recorder.service(
                    "",
                    "persisted",
                    serde_json::json!({"conversation": id, "file": dir.file_of(id), "bytes": n, "tokens": file.meta.tokens.len()}),
                );
                self.evicted(&mut s, dir, evicted, recorder);
                true
            }
            Err(e) => {
                log(
                    recorder,
                    "persist_failed",
                    &format!(
                        "conversation {id}: cannot write its state file ({e}){}; its cache stays in RAM",
                        if e.is_disk_full() {
                            ": the disk is full"
                        } else {
                            ""
                        }
                    ),
                    serde_json::json!({"conversation": id, "reason": e.to_string(), "disk_full": e.is_disk_full()}),
                );
                false
            }
        }
    }

    /// `id`'s cache leaves RAM with its state file already written by
    /// [`Conversations::persist`] (and not evicted since): it is hibernated without writing it
    /// again. False, nothing changed, when it has no file.
    pub fn hibernate_persisted(&self, id: &str, recorder: &Recorder) -> bool {
        let mut s = self.lock();
        let Some(c) = s.convs.get_mut(id) else {
            return false;
        };
        let Some((file, size)) = c
            .file
            .as_ref()
            .and_then(|p| std::fs::metadata(p).ok().map(|m| (p.clone(), m.len())))
        else {
            return false;
        };
        c.state = ConversationState::Hibernated;
        c.bytes = size;
        if s.live.as_deref() == Some(id) {
            s.live = None;
        }
        drop(s);
        recorder.service(
            "",
            "hibernated",
            serde_json::json!({"conversation": id, "file": file, "bytes": size, "written": "when its answer ended"}),
        );
        true
    }

    /// Forgets the files the directory's bound evicted (each said in a log line).
    fn evicted(&self, s: &mut Store, dir: &StateDir, evicted: Vec<Evicted>, recorder: &Recorder) {
        for e in evicted {
            if let Some(c) = s.convs.get_mut(&e.conversation) {
                c.file = None;
                if c.state == ConversationState::Hibernated {
                    c.state = ConversationState::Dropped;
                    c.bytes = 0;
                }
            }
            log(
                recorder,
                "state_evicted",
                &format!(
                    "evicted {} ({} KiB, conversation {}): the state directory holds at most {} MiB; it will be re-read from its messages",
                    e.path.display(),
                    e.bytes >> 10,
                    e.conversation,
                    dir.max_bytes() >> 20
                ),
                serde_json::json!({"conversation": e.conversation, "file": e.path, "bytes": e.bytes}),
            );
        }
    }

    /// Records what the session holds after answering `id` (`prompt_tokens`: the answer's
    /// prompt length; the first one is the conversation's first turn), costing `kv_bytes`.
    pub fn after_answer(
        &self,
        session: &Session,
        id: Option<&str>,
        prompt_tokens: usize,
        kv_bytes: u64,
    ) {
        if let Some(id) = id {
            self.answered(
                id,
                session.current_rung(),
                session.history(),
                prompt_tokens,
                Some(kv_bytes),
            );
        }
    }

    /// Records an answer of `id` that ended with `tokens` in a cache on `rung`: kept there,
    /// costing `kept_bytes`, or (`None`) not kept, so the next request re-reads it. The tokens
    /// are remembered either way: a later request is matched to the conversation by them.
    pub fn answered(
        &self,
        id: &str,
        rung: &str,
        tokens: &[Token],
        prompt_tokens: usize,
        kept_bytes: Option<u64>,
    ) {
        let mut s = self.lock();
        if let Some(c) = s.convs.get_mut(id) {
            c.tokens = tokens.to_vec();
            c.rung = rung.to_string();
            if c.first_turn_len == 0 {
                c.first_turn_len = prompt_tokens;
            }
            c.state = if kept_bytes.is_some() {
                ConversationState::Kept
            } else {
                ConversationState::Dropped
            };
            c.bytes = kept_bytes.unwrap_or(0);
        }
    }

    /// A request of `job`'s conversation is being answered (the batched loop, where several
    /// are at once; the one-at-a-time loop goes through [`Conversations::take_engine`]).
    pub fn running(&self, job: Option<&JobConversation>) {
        if let Some(j) = job
            && let Some(c) = self.lock().convs.get_mut(&j.id)
        {
            c.queued = c.queued.saturating_sub(1);
            c.state = ConversationState::Running;
        }
    }

    /// The cache kept for `id` was let go (room for another, a rung change, or a failed
    /// answer, after which what it holds is unknown): the next request re-reads the
    /// conversation from its messages.
    pub fn let_go(&self, id: &str) {
        if let Some(c) = self.lock().convs.get_mut(id)
            && matches!(
                c.state,
                ConversationState::Kept | ConversationState::Running | ConversationState::Parked
            )
        {
            c.state = ConversationState::Dropped;
            c.bytes = 0;
        }
    }

    /// A queued request that will not be answered (its client left, or the queue was full).
    pub fn unqueue(&self, job: Option<&JobConversation>) {
        if let Some(j) = job
            && let Some(c) = self.lock().convs.get_mut(&j.id)
        {
            c.queued = c.queued.saturating_sub(1);
        }
    }

    /// Forgets the session's cache after an answer failed (what it holds is unknown): the
    /// conversation is re-read from its messages next time.
    pub fn drop_live(&self, session: &mut Session) {
        session.reset();
        let mut s = self.lock();
        if let Some(id) = s.live.take()
            && let Some(c) = s.convs.get_mut(&id)
        {
            c.state = ConversationState::Dropped;
            c.bytes = 0;
        }
    }

    /// The live conversation's answer parked (`true`: the budget holds no rung) or running
    /// again (`false`).
    pub fn set_parked(&self, id: &str, parked: bool) {
        if let Some(c) = self.lock().convs.get_mut(id) {
            let (from, to) = if parked {
                (ConversationState::Running, ConversationState::Parked)
            } else {
                (ConversationState::Parked, ConversationState::Running)
            };
            if c.state == from {
                c.state = to;
            }
        }
    }

    /// The live conversation's id.
    #[must_use]
    pub fn live(&self) -> Option<String> {
        self.lock().live.clone()
    }

    /// Every kept conversation, most recently used first.
    #[must_use]
    pub fn view(&self) -> Vec<ConversationView> {
        let s = self.lock();
        let mut v: Vec<(u64, ConversationView)> = s
            .convs
            .iter()
            .map(|(id, c)| {
                let state = if c.queued > 0
                    && !matches!(
                        c.state,
                        ConversationState::Running | ConversationState::Parked
                    ) {
                    ConversationState::Queued
                } else {
                    c.state
                };
                (
                    c.last_used,
                    ConversationView {
                        id: id.clone(),
                        rung: c.rung.clone(),
                        tokens: c.tokens.len(),
                        state,
                        bytes: c.bytes,
                        file: c
                            .file
                            .as_ref()
                            .filter(|_| c.state == ConversationState::Hibernated)
                            .map(|p| p.display().to_string()),
                        class: c.class,
                        priority: c.priority,
                    },
                )
            })
            .collect();
        v.sort_by_key(|c| std::cmp::Reverse(c.0));
        v.into_iter().map(|(_, c)| c).collect()
    }
}

fn forget_oldest(s: &mut Store) {
    let live = s.live.clone();
    if let Some(id) = s
        .convs
        .iter()
        .filter(|(id, c)| c.queued == 0 && Some(*id) != live.as_ref())
        .min_by_key(|(_, c)| c.last_used)
        .map(|(id, _)| id.clone())
    {
        s.convs.remove(&id);
    }
}

fn fresh_id() -> String {
    format!("conv-{:016x}", rand::random::<u64>())
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
