//! What can go wrong in a session, typed: llama.cpp, the prompt, the route, the budget, a
//! migration.

use crate::engine::EngineError;
use crate::pressure::PressureError;

use super::RouteError;

/// Errors from a session.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// llama.cpp failed.
    #[error("rung {rung}: {source}")]
    Engine {
        /// Rung name.
        rung: String,
        /// The engine error.
        source: EngineError,
    },
    /// The prompt does not fit the context window.
    #[error(
        "the prompt is {prompt_tokens} tokens but the context window is {n_ctx} (and {reserve} are kept for the answer); shorten the prompt or raise --n-ctx"
    )]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Context window.
        n_ctx: u32,
        /// Tokens reserved for the answer.
        reserve: usize,
    },
    /// No such rung.
    #[error("no rung named {0:?} in this ladder")]
    UnknownRung(String),
    /// No projector for a route the session needed.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The budget source failed.
    #[error("budget source: {0}")]
    Budget(#[from] PressureError),
    /// The budget can never hold even the smallest rung.
    #[error(
        "the budget ({budget_mib} MiB) is below the smallest rung's footprint ({rung}: {need_mib} MiB for {tokens} tokens of context); raise the budget or shorten the request"
    )]
    BudgetBelowSmallest {
        /// Budget in MiB.
        budget_mib: u64,
        /// Smallest rung.
        rung: String,
        /// Its footprint in MiB.
        need_mib: u64,
        /// Context tokens assumed.
        tokens: u64,
    },
    /// Parked, and the budget source cannot change while the answer waits (a token-clock
    /// trace: its clock is the answer's own progress, which stops while parked).
    #[error(
        "parked before token {at_token}: the budget ({budget_mib} MiB) is below every rung's footprint and {source_desc} only moves as tokens are generated, so it would never let the answer resume; give the trace an ms clock, or keep its lowest budget above the smallest rung"
    )]
    ParkedForever {
        /// Token index.
        at_token: usize,
        /// Budget in MiB.
        budget_mib: u64,
        /// The budget source.
        source_desc: String,
    },
    /// A migration failed; the session stays on the source rung.
    #[error("migration {from} -> {to} failed: {message}")]
    Migration {
        /// Source rung.
        from: String,
        /// Destination rung.
        to: String,
        /// Why.
        message: String,
    },
}
