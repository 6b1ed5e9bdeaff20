//! The generation thread. It owns the [`Session`] (and with it every llama.cpp context), takes
//! [`Job`]s from the main thread and sends back each [`Event`] as it happens, so the main thread
//! stays free to draw tokens and read `/budget` while an answer is being generated.

use molt::sched::RungCost;
use molt::session::{Event, GenerateOptions, Generation, Prompt, Session};
use molt::state::{Expect, StateDir, StateFile};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

/// Work for the session.
pub enum Job {
    /// Answer a prompt.
    Answer(Prompt, GenerateOptions),
    /// Forget the conversation.
    Reset,
    /// The budget changed while idle: move back up if it holds a larger rung now.
    Settle,
}

/// What the session says back.
pub enum Report {
    /// An event of the answer being generated.
    /// Boxed: a switch's record is far larger than the other reports.
    Event(Box<Event>),
    /// The answer ended (or failed before it began).
    Answered(Result<Generation, String>),
    /// The session's state after a job.
    Snapshot(Snapshot),
    /// After a job, between answers: the session moved back up the ladder (or tried to, and
    /// why it could not), with its state after. Sent after the job's [`Report::Snapshot`], so
    /// the main thread reads it with whatever it does next.
    Idle(Result<molt::session::IdleMove, String>, Snapshot),
    /// Between answers: the session read what the last answer's size switch left out, while
    /// the user read and typed ([`Session::fill_idle`]); `due` were still to read when a new
    /// job came (the next answer reads them first), or why it stopped.
    Filled(Result<Filled, String>),
}

/// What the fill between answers did.
#[derive(Debug, Clone)]
pub struct Filled {
    /// The rung it read on.
    pub rung: String,
    /// Positions read.
    pub read: usize,
    /// Positions left for the next answer to read first.
    pub due: usize,
    /// Time spent, ms.
    pub ms: f64,
}

/// The session's state, as `/status` shows it.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Index of the current rung.
    pub current: usize,
    /// Which rungs are mapped.
    pub loaded: Vec<bool>,
    /// What each rung costs (measured context overheads once loaded).
    pub costs: Vec<RungCost>,
    /// Tokens in the current cache.
    pub context_tokens: usize,
    /// Messages in the conversation.
    pub messages: usize,
    /// Where the conversation's cache lives, for `/status`.
    pub cache: String,
    /// Each loaded rung's micro-batch and repack, and why.
    pub setups: Vec<Option<molt::speed::RungSetup>>,
}

impl Snapshot {
    /// Reads a session's state.
    pub fn of(s: &Session) -> Self {
        Self {
            current: s.current_index(),
            loaded: s.loaded(),
            costs: s.rung_costs(),
            context_tokens: s.history().len(),
            messages: s.conversation().len(),
            cache: String::new(),
            setups: (0..s.ladder().rungs.len())
                .map(|i| s.rung_setup(i))
                .collect(),
        }
    }
}

/// The chat's conversation kept on disk (`--state-dir`): hibernated after each answer and on
/// exit, woken at start with `--resume`, removed by `/reset`.
pub struct Keeper {
    /// The directory.
    pub dir: StateDir,
    /// The conversation's name (its file is `<id>.molt-state`).
    pub id: String,
    /// The first prompt's length (what a later request must share with the file).
    pub first_turn_len: usize,
    /// What happened last, for `/status`.
    pub last: String,
}

impl Keeper {
    /// The conversation's file.
    pub fn file(&self) -> std::path::PathBuf {
        self.dir.file_of(&self.id)
    }

    /// Wakes the saved conversation into `session`: a line saying what happened.
    pub fn resume(&mut self, session: &mut Session) -> String {
        let path = self.file();
        if !path.exists() {
            self.last = format!("nothing saved at {} yet", path.display());
            return format!(
                "no saved conversation at {}; starting a new one",
                path.display()
            );
        }
        let rungs: Vec<(String, String)> = session
            .ladder()
            .rungs
            .iter()
            .map(|r| (r.name().to_string(), r.sha256.clone()))
            .collect();
        let expect = Expect {
            rungs: &rungs,
            n_ctx: session.config().n_ctx,
            continues: None,
        };
        match StateFile::load(&path, &expect)
            .map_err(|e| e.to_string())
            .and_then(|f| {
                session
                    .wake(&f)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(f)
            }) {
            Ok(f) => {
                self.first_turn_len = f.meta.first_turn_len;
                self.last = format!("woken from {}", path.display());
                let on = session.current_rung();
                let through = if on == f.meta.rung {
                    String::new()
                } else {
                    format!(
                        ", carried from {} through the switch as the budget does not hold it",
                        f.meta.rung
                    )
                };
                format!(
                    "resumed conversation {:?} from {}: {} messages, {} tokens cached on {on}{through} (none re-read)",
                    self.id,
                    path.display(),
                    f.meta.messages.len(),
                    f.meta.tokens.len(),
                )
            }
            Err(e) => {
                self.last = format!("refused {e}");
                format!("refused {e}; starting a new conversation")
            }
        }
    }

    /// Writes the session's conversation to its file.
    pub fn save(&mut self, session: &mut Session) {
        match session.hibernate(&self.id, self.first_turn_len) {
            Ok(Some(f)) => match self.dir.write(&self.id, &f) {
                Ok((n, evicted)) => {
                    self.last = format!(
                        "saved to {} ({} KiB, {} tokens)",
                        self.file().display(),
                        n >> 10,
                        f.meta.tokens.len()
                    );
                    for e in evicted {
                        eprintln!(
                            "evicted {} ({} KiB): the state directory holds at most {} MiB",
                            e.path.display(),
                            e.bytes >> 10,
                            self.dir.max_bytes() >> 20
                        );
                    }
                }
                Err(e) => {
                    self.last = format!("not saved ({e}); RAM only");
                    eprintln!("cannot save the conversation: {e}; it stays in RAM only");
                }
            },
            Ok(None) => {
                self.last =
                    "not saved (the cache holds projected cells or is parked); RAM only".into();
            }
            Err(e) => self.last = format!("not saved ({e}); RAM only"),
        }
    }

    fn describe(&self, s: &Session) -> String {
        if s.history().is_empty() {
            return format!("empty · {}", self.last);
        }
        format!("RAM on {} · {}", s.current_rung(), self.last)
    }
}

/// Starts the thread; it ends when the job sender is dropped.
pub fn spawn(
    mut session: Session,
    mut keeper: Option<Keeper>,
) -> (Sender<Job>, Receiver<Report>, JoinHandle<()>) {
    let (job_tx, job_rx) = channel::<Job>();
    let (tx, rx) = channel::<Report>();
    let handle = std::thread::Builder::new()
        .name("molt-generate".into())
        .spawn(move || {
            let mut next = None;
            loop {
                let job = match next.take() {
                    Some(j) => j,
                    None => match job_rx.recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    },
                };
                let settle = matches!(job, Job::Settle);
                match job {
                    Job::Answer(prompt, opts) => {
                        let r = session.generate(&prompt, &opts, &mut |e: &Event| {
                            if !matches!(e, Event::Done(_)) {
                                let _ = tx.send(Report::Event(Box::new(e.clone())));
                            }
                        });
                        if let (Ok(g), Some(k)) = (&r, keeper.as_mut()) {
                            if k.first_turn_len == 0 {
                                k.first_turn_len = g.prompt_tokens;
                            }
                            k.save(&mut session);
                        }
                        let _ = tx.send(Report::Answered(r.map_err(|e| e.to_string())));
                    }
                    Job::Reset => {
                        session.reset();
                        if let Some(k) = keeper.as_mut() {
                            k.dir.remove(&k.id);
                            k.first_turn_len = 0;
                            k.last = "reset: its file removed".into();
                        }
                    }
                    Job::Settle => {}
                }
                let snapshot = |session: &Session, keeper: &Option<Keeper>| {
                    let mut snap = Snapshot::of(session);
                    snap.cache = keeper.as_ref().map_or_else(
                        || "RAM only (no --state-dir)".into(),
                        |k| k.describe(session),
                    );
                    snap
                };
                if !settle
                    && tx
                        .send(Report::Snapshot(snapshot(&session, &keeper)))
                        .is_err()
                {
                    break;
                }
                // Between answers, while the user reads and types: back up the ladder if the
                // budget holds a larger rung again, so that the next answer does not start
                // with the load and the conversation's re-read.
                let moved = match session.promote_idle() {
                    Ok(None) => {
                        next = fill_while_idle(&mut session, &mut keeper, &job_rx, &tx);
                        continue;
                    }
                    Ok(Some(m)) => {
                        if let Some(k) = keeper.as_mut() {
                            k.save(&mut session);
                        }
                        Ok(m)
                    }
                    Err(e) => Err(e.to_string()),
                };
                if tx
                    .send(Report::Idle(moved, snapshot(&session, &keeper)))
                    .is_err()
                {
                    break;
                }
                next = fill_while_idle(&mut session, &mut keeper, &job_rx, &tx);
            }
            // On exit: what is in RAM goes to its file.
            if let Some(k) = keeper.as_mut()
                && !session.history().is_empty()
            {
                // A cache with positions still left out is not kept: they are read first.
                let _ = session.fill_idle(usize::MAX);
                k.save(&mut session);
                eprintln!("conversation {}", k.last);
            }
        })
        .expect("spawning the generation thread");
    (job_tx, rx, handle)
}

/// While no job waits: reads what the last answer's size switch left out, a micro-batch at a
/// time ([`Session::fill_idle`]), so the next prompt does not wait for it — and yields to the
/// job that comes (returned; the answer then reads what is left before its prompt). Says what
/// it did ([`Report::Filled`]) and keeps the conversation's file once the cache is whole.
fn fill_while_idle(
    session: &mut Session,
    keeper: &mut Option<Keeper>,
    jobs: &Receiver<Job>,
    tx: &Sender<Report>,
) -> Option<Job> {
    if session.fill_due() == 0 {
        return None;
    }
    let t0 = std::time::Instant::now();
    let rung = session.current_rung().to_string();
    let mut read = 0;
    let mut next = None;
    let mut failed = None;
    loop {
        match jobs.try_recv() {
            Ok(j) => {
                next = Some(j);
                break;
            }
            Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        match session.fill_idle(1) {
            Ok(step) => {
                read += step.read;
                if step.due == 0 {
                    break;
                }
            }
            Err(e) => {
                failed = Some(e.to_string());
                break;
            }
        }
    }
    let due = session.fill_due();
    if due == 0
        && failed.is_none()
        && let Some(k) = keeper.as_mut()
    {
        k.save(session);
    }
    let report = failed.map_or_else(
        || {
            Ok(Filled {
                rung,
                read,
                due,
                ms: t0.elapsed().as_secs_f64() * 1e3,
            })
        },
        Err,
    );
    let _ = tx.send(Report::Filled(report));
    next
}
