//! The engine thread behind the facade: it owns the [`Session`] (the loaded rungs, the
//! budget, the token loop) and answers the jobs of every conversation of one [`Molt`]
//! in the order they arrive.
//!
//! Several conversations share the one session: the conversation being answered holds the
//! cache; when another one sends, the first is hibernated in memory (its cache exported as a
//! state file, or only its messages when the cache holds cells a switch projected) and the
//! other's put back, so each answer reads only its new turn. Answers take turns: one
//! decodes at a time.
//!
//! [`Molt`]: super::Molt

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};

use crate::engine::ChatMessage;
use crate::session::{Event, GenerateOptions, Prompt, Session, SessionError};
use crate::state::{Expect, StateFile};

use super::Error;

/// One thing asked of the engine thread.
pub(super) enum Job {
    /// Answer `text` in conversation `conv`.
    Send {
        conv: u64,
        text: String,
        opts: GenerateOptions,
        cancel: Arc<AtomicBool>,
        events: Sender<Result<Event, Error>>,
    },
    /// Write conversation `conv` to `path`.
    Hibernate {
        conv: u64,
        path: PathBuf,
        reply: Sender<Result<u64, Error>>,
    },
    /// Read `path` into conversation `conv`, on `rung` when one is named.
    Resume {
        conv: u64,
        path: PathBuf,
        rung: Option<String>,
        reply: Sender<Result<String, Error>>,
    },
    /// Conversation `conv`'s handle was dropped.
    Forget { conv: u64 },
    /// The rung the engine is on now.
    Rung { reply: Sender<String> },
}

/// A conversation the session does not hold now.
#[derive(Default)]
struct Stored {
    /// Its cache, exported (when it was the session's own).
    file: Option<StateFile>,
    /// Its messages (always).
    messages: Vec<ChatMessage>,
    /// Prompt tokens of its first answer (a state file records it).
    first_turn_len: usize,
}

/// The engine thread's state.
pub(super) struct Engine {
    session: Session,
    /// The conversation whose cache the session holds.
    live: Option<u64>,
    /// Every other conversation.
    stored: HashMap<u64, Stored>,
    /// Prompt tokens of the live conversation's first answer.
    live_first_turn: usize,
    /// Set while an answer runs: the session's own flag, set by an answer's cancel.
    session_cancel: Arc<AtomicBool>,
}

impl Engine {
    pub(super) fn new(session: Session) -> Self {
        let session_cancel = session.cancel_handle();
        Self {
            session,
            live: None,
            stored: HashMap::new(),
            live_first_turn: 0,
            session_cancel,
        }
    }

    /// Answers jobs until every sender is gone.
    pub(super) fn run(mut self, jobs: &Receiver<Job>) {
        while let Some(job) = self.next_job(jobs) {
            match job {
                Job::Send {
                    conv,
                    text,
                    opts,
                    cancel,
                    events,
                } => {
                    let r = self.answer(conv, &text, &opts, &cancel, &events);
                    if let Err(e) = r {
                        let _ = events.send(Err(e));
                    }
                }
                Job::Hibernate { conv, path, reply } => {
                    let _ = reply.send(self.hibernate(conv, &path));
                }
                Job::Resume {
                    conv,
                    path,
                    rung,
                    reply,
                } => {
                    let _ = reply.send(self.resume(conv, &path, rung.as_deref()));
                }
                Job::Forget { conv } => {
                    self.stored.remove(&conv);
                    if self.live == Some(conv) {
                        self.live = None;
                        self.session.reset();
                    }
                }
                Job::Rung { reply } => {
                    let _ = reply.send(self.session.current_rung().to_string());
                }
            }
        }
    }

    /// The next job, or `None` once every sender is gone. While none waits, the live
    /// conversation's cache is made whole: what its last answer's size switch left out is
    /// read a micro-batch at a time ([`Session::fill_idle`]), so its next message does not
    /// wait for it; a job that comes is taken at once (the answer reads what is left first).
    fn next_job(&mut self, jobs: &Receiver<Job>) -> Option<Job> {
        while self.session.fill_due() > 0 {
            match jobs.try_recv() {
                Ok(job) => return Some(job),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
            // A failure cut the cache before what it could not read: the next message reads
            // the rest again from the conversation.
            if self.session.fill_idle(1).is_err() {
                break;
            }
        }
        jobs.recv().ok()
    }

    /// Keeps the live conversation in memory — its cache exported when it is the session's own
    /// (cells a switch projected are not: it is then kept as messages) — so that another can
    /// take the session.
    fn put_live_aside(&mut self) -> Result<(), Error> {
        if let Some(old) = self.live.take() {
            let first_turn_len = self.live_first_turn;
            // What a size switch left out is read first (all of it, in one call): a cache with
            // absent cells is not kept. A failure cut the cache before what it could not read.
            let _ = self.session.fill_idle(usize::MAX);
            let file = self.session.hibernate(&old.to_string(), first_turn_len)?;
            let messages = self.session.conversation().to_vec();
            self.stored.insert(
                old,
                Stored {
                    file,
                    messages,
                    first_turn_len,
                },
            );
        }
        Ok(())
    }

    /// Puts the live conversation aside (in memory) and `conv`'s cache in the session.
    fn bring(&mut self, conv: u64) -> Result<(), Error> {
        if self.live == Some(conv) {
            return Ok(());
        }
        self.put_live_aside()?;
        self.session.reset();
        let stored = self.stored.remove(&conv).unwrap_or_default();
        self.live_first_turn = stored.first_turn_len;
        self.live = Some(conv);
        if let Some(file) = &stored.file
            && self.session.wake(file).is_ok()
        {
            return Ok(());
        }
        // No cache of its own, or one the budget no longer holds: its messages are read again
        // with its next turn (the session then starts on the rung the budget holds).
        self.session.reset();
        self.session.set_conversation(stored.messages);
        Ok(())
    }

    fn answer(
        &mut self,
        conv: u64,
        text: &str,
        opts: &GenerateOptions,
        cancel: &Arc<AtomicBool>,
        events: &Sender<Result<Event, Error>>,
    ) -> Result<(), Error> {
        if cancel.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.bring(conv)?;
        let session_cancel = Arc::clone(&self.session_cancel);
        let mut sink = |e: &Event| {
            // A cancelled answer, or one whose reader went away, stops at the next token.
            if cancel.load(Ordering::SeqCst) || events.send(Ok(e.clone())).is_err() {
                session_cancel.store(true, Ordering::SeqCst);
            }
        };
        let generation = self
            .session
            .generate(&Prompt::User(text.to_string()), opts, &mut sink)?;
        if self.live_first_turn == 0 {
            self.live_first_turn = generation.prompt_tokens;
        }
        Ok(())
    }

    fn hibernate(&mut self, conv: u64, path: &std::path::Path) -> Result<u64, Error> {
        let file = if self.live == Some(conv) {
            // Cells a switch projected carry no record of which positions they are once on
            // disk: they are read natively first.
            self.session.settle()?;
            self.session
                .hibernate(&conv.to_string(), self.live_first_turn)?
        } else {
            self.stored.get(&conv).and_then(|s| s.file.clone())
        };
        let Some(file) = file else {
            return Err(Error::NothingToHibernate { conversation: conv });
        };
        file.write_atomic(path).map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    fn resume(
        &mut self,
        conv: u64,
        path: &std::path::Path,
        rung: Option<&str>,
    ) -> Result<String, Error> {
        let ladder = self.session.ladder();
        let rungs: Vec<(String, String)> = ladder
            .rungs
            .iter()
            .map(|r| (r.name().to_string(), r.sha256.clone()))
            .collect();
        let target = match rung {
            Some(name) => Some(rungs.iter().position(|(n, _)| n == name).ok_or_else(|| {
                Error::UnknownRung {
                    rung: name.to_string(),
                    ladder: ladder.name().to_string(),
                    rungs: ladder.names().join(", "),
                }
            })?),
            None => None,
        };
        let file = StateFile::load(
            path,
            &Expect {
                rungs: &rungs,
                n_ctx: self.session.config().n_ctx,
                continues: None,
            },
        )?;
        // The live conversation is put aside first: the file takes the session's cache.
        self.put_live_aside()?;
        self.stored.remove(&conv);
        let woken = match target {
            Some(to) => self.session.wake_on(&file, to),
            None => self.session.wake(&file),
        };
        if let Err(e) = woken {
            // A cache that cannot be carried (no map for the route, a budget that holds no
            // rung at or below the file's) is not lost: the conversation's messages are read
            // again with its next turn, on the rung asked for or the one the budget holds.
            let fallback = matches!(
                e,
                SessionError::Route(_)
                    | SessionError::Migration { .. }
                    | SessionError::WakeOverBudget { .. }
            );
            if !fallback {
                return Err(e.into());
            }
            self.session.reset();
            if let Some(to) = target {
                self.session.move_idle(to)?;
            }
            self.session.set_conversation(file.meta.messages.clone());
        }
        self.live = Some(conv);
        self.live_first_turn = file.meta.first_turn_len;
        Ok(self.session.current_rung().to_string())
    }
}
