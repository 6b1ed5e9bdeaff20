//! The facade's one error type: every failure an embedder can meet, each naming the thing at
//! fault.

use std::path::PathBuf;

/// What went wrong at the facade.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The ladder could not be found (no manifest by that name or path).
    #[error("ladder {ladder}: {detail}")]
    LadderNotFound {
        /// What was asked for (a name or a path).
        ladder: String,
        /// Where it was looked for.
        detail: String,
    },
    /// The ladder's manifest or files were found but cannot be used (a file missing or
    /// truncated, rungs that do not share a tokenizer, …).
    #[error("ladder {ladder}: {source}")]
    Ladder {
        /// The manifest.
        ladder: PathBuf,
        /// Why.
        #[source]
        source: crate::ladder::LadderError,
    },
    /// A rung name that is not on the ladder.
    #[error("no rung {rung} on ladder {ladder} (its rungs: {rungs})")]
    UnknownRung {
        /// The name asked for.
        rung: String,
        /// The ladder.
        ladder: String,
        /// The rungs it has, comma-separated.
        rungs: String,
    },
    /// The budget holds no rung of the ladder, not even the smallest.
    #[error(
        "a budget of {budget_mib} MiB holds no rung of ladder {ladder}: the smallest, {smallest}, needs about {need_mib} MiB"
    )]
    BudgetBelowSmallest {
        /// The ladder.
        ladder: String,
        /// The budget, MiB.
        budget_mib: u64,
        /// The smallest rung.
        smallest: String,
        /// What it needs with an empty conversation, MiB.
        need_mib: u64,
    },
    /// A budget source could not be set up (a trace that does not load, no memory
    /// information on this system).
    #[error("budget: {0}")]
    Budget(String),
    /// The engine failed (a load, a decode, a switch): llama.cpp's or Molt's own words.
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
    /// A hibernation file that cannot be resumed here: unreadable, damaged, or written for
    /// another ladder, rung file or context window.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// A hibernation file could not be written.
    #[error("hibernation file {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::state::StateError,
    },
    /// `send` on a conversation whose previous answer is still streaming: read it to its end,
    /// cancel it, or drop it first.
    #[error("conversation {conversation}: an answer is still streaming")]
    AnswerInProgress {
        /// The conversation's id.
        conversation: u64,
    },
    /// A conversation (or answer) used after its [`Molt`](super::Molt) engine was dropped.
    #[error("the Molt engine this conversation belongs to has been dropped")]
    EngineGone,
    /// Hibernating a conversation that has nothing cached yet.
    #[error("conversation {conversation} has nothing to hibernate yet (send it a message first)")]
    NothingToHibernate {
        /// The conversation's id.
        conversation: u64,
    },
}
