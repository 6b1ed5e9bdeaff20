//! The generation thread. It owns the [`Session`] (and with it every llama.cpp context), takes
//! [`Job`]s from the main thread and sends back each [`Event`] as it happens, so the main thread
//! stays free to draw tokens and read `/budget` while an answer is being generated.

use molt::sched::RungCost;
use molt::session::{Event, GenerateOptions, Generation, Prompt, Session};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

/// Work for the session.
pub enum Job {
    /// Answer a prompt.
    Answer(Prompt, GenerateOptions),
    /// Forget the conversation.
    Reset,
}

/// What the session says back.
pub enum Report {
    /// An event of the answer being generated.
    Event(Event),
    /// The answer ended (or failed before it began).
    Answered(Result<Generation, String>),
    /// The session's state after a job.
    Snapshot(Snapshot),
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
        }
    }
}

/// Starts the thread; it ends when the job sender is dropped.
pub fn spawn(mut session: Session) -> (Sender<Job>, Receiver<Report>, JoinHandle<()>) {
    let (job_tx, job_rx) = channel::<Job>();
    let (tx, rx) = channel::<Report>();
    let handle = std::thread::Builder::new()
        .name("molt-generate".into())
        .spawn(move || {
            for job in job_rx {
                match job {
                    Job::Answer(prompt, opts) => {
                        let r = session.generate(&prompt, &opts, &mut |e: &Event| {
                            if !matches!(e, Event::Done(_)) {
                                let _ = tx.send(Report::Event(e.clone()));
                            }
                        });
                        let _ = tx.send(Report::Answered(r.map_err(|e| e.to_string())));
                    }
                    Job::Reset => session.reset(),
                }
                if tx.send(Report::Snapshot(Snapshot::of(&session))).is_err() {
                    break;
                }
            }
        })
        .expect("spawning the generation thread");
    (job_tx, rx, handle)
}
