//! What can go wrong in a session, typed: llama.cpp, the prompt, the route, the budget, the
//! scheduler, a migration.
//!
//! A migration's failure is a [`MigrationError`]: the [`MigrationStep`] that failed and its
//! typed cause ([`MigrationCause`]), in the style of llama-cpp-2's per-operation error enums,
//! so a caller can tell an import that llama.cpp refused from a blob that did not parse
//! without reading a message.

use std::fmt;

use crate::engine::EngineError;
use crate::kv::KvError;
use crate::pressure::PressureError;
use crate::sched::SchedError;
use crate::transplant::TransplantError;
use crate::transplant::shift::ShedError;

use crate::routes::RouteError;

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
    /// A selection rule only the recall benchmark measures.
    #[error(
        "selective token recompute by {0} is an ablation `bench --recall` measures; a session selects by attention (the default) or at random"
    )]
    RuleNotInSessions(&'static str),
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
    /// A state file's rung does not fit the budget in force: waking the conversation there
    /// would load it over the budget (the conversation is re-read on a rung that fits instead).
    #[error(
        "the state file's rung {rung} needs {need_mib} MiB for its {tokens} tokens, over the budget of {budget_mib} MiB; not loaded for it"
    )]
    WakeOverBudget {
        /// The rung that wrote the file.
        rung: String,
        /// Its footprint, MiB.
        need_mib: u64,
        /// Its tokens.
        tokens: u64,
        /// The budget, MiB.
        budget_mib: u64,
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
    #[error("migration {from} -> {to} failed: {source}")]
    Migration {
        /// Source rung.
        from: String,
        /// Destination rung.
        to: String,
        /// The step that failed and why.
        source: MigrationError,
    },
    /// A migration failed after the source was freed, and the source could not be brought back
    /// either: the session restarted its rung afresh and forgot the history.
    #[error("{switch}; and the source could not be restored after it: {restore}")]
    SourceLost {
        /// The failed switch.
        switch: Box<SessionError>,
        /// Why the source could not be restored.
        restore: Box<SessionError>,
    },
    /// An idle move was asked of a session that holds a cache.
    #[error(
        "cannot move {from} -> {to} idle: the session holds a cache; reset it before moving idle"
    )]
    NotIdle {
        /// Current rung.
        from: String,
        /// Asked rung.
        to: String,
    },
    /// The weights were parked twice.
    #[error("rung {rung} is already parked")]
    AlreadyParked {
        /// The parked rung.
        rung: String,
    },
    /// A background load could not be started.
    #[error("cannot start loading a rung in the background: {0}")]
    Prepare(String),
    /// The scheduler refused the snapshot it was given.
    #[error("scheduler: {0}")]
    Policy(#[from] SchedError),
}

/// One step of a migration (see [`crate::session::migrate`]); its display is the prefix a
/// user reads before the cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationStep {
    /// Exporting the source's sequence state.
    Export,
    /// Parsing the source's state.
    SourceState,
    /// Projecting the layers.
    Projection,
    /// Splicing the last-k model's recomputed layers.
    RecomputedState,
    /// Splicing the destination's native head rows.
    NativeHeadState,
    /// Writing the destination's state.
    DestinationState,
    /// Decoding the head on the destination.
    HeadReread,
    /// Exporting the head's state.
    HeadExport,
    /// Checking the tail against the cache.
    TailRecompute,
    /// Mapping the boundary hidden states into the destination's residual stream.
    HiddenMap,
    /// Loading the destination's last-k model.
    LastKModel {
        /// Blocks recomputed.
        k: usize,
    },
    /// Running the last-k model.
    LastKForward {
        /// Blocks recomputed.
        k: usize,
    },
    /// Importing the projected state.
    Import,
    /// Re-reading the selected spans natively.
    SelectiveRecompute,
    /// The destination's first decode.
    FirstDecode,
    /// Re-reading the whole history on the destination.
    Reprefill,
    /// Shedding context from a parked cache.
    Shed,
}

impl MigrationStep {
    /// This step's failure from `cause`.
    pub fn fail(self, cause: impl Into<MigrationCause>) -> MigrationError {
        MigrationError {
            step: self,
            source: cause.into(),
        }
    }
}

impl fmt::Display for MigrationStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Export => f.write_str("export"),
            Self::SourceState => f.write_str("source state"),
            Self::Projection => f.write_str("projection"),
            Self::RecomputedState => f.write_str("recomputed state"),
            Self::NativeHeadState => f.write_str("native head state"),
            Self::DestinationState => f.write_str("destination state"),
            Self::HeadReread => f.write_str("head re-read"),
            Self::HeadExport => f.write_str("head export"),
            Self::TailRecompute => f.write_str("tail recompute"),
            Self::HiddenMap => f.write_str("hidden map"),
            Self::LastKModel { k } => write!(f, "last-{k} model"),
            Self::LastKForward { k } => write!(f, "last-{k} forward"),
            Self::Import => f.write_str("import"),
            Self::SelectiveRecompute => f.write_str("selective recompute"),
            Self::FirstDecode => f.write_str("first decode"),
            Self::Reprefill => f.write_str("re-prefill"),
            Self::Shed => f.write_str("shed"),
        }
    }
}

/// A failed migration step: which one, and why.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct MigrationError {
    /// The step that failed.
    pub step: MigrationStep,
    /// Why.
    pub source: MigrationCause,
}

/// Why a migration step failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrationCause {
    /// A state blob did not parse or could not be written.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The projection or the hidden map refused the shapes.
    #[error(transparent)]
    Transplant(#[from] TransplantError),
    /// llama.cpp failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Shedding a parked cache failed.
    #[error(transparent)]
    Shed(#[from] ShedError),
    /// More tokens asked to be re-read than the cache holds.
    #[error("{asked} tokens asked, but the cache holds {cached}")]
    LongerThanCache {
        /// Tokens asked.
        asked: usize,
        /// Tokens cached.
        cached: usize,
    },
    /// The last-k model's state does not hold the source's positions.
    #[error("it holds {positions} positions in {layers} layers, not the {cached} cached ones")]
    RecomputedPositions {
        /// Positions in the recomputed state.
        positions: usize,
        /// Its layers.
        layers: usize,
        /// Positions cached.
        cached: usize,
    },
    /// The destination's native head state has another layer count than the destination.
    #[error("it has {layers} layers for a destination of {expected}")]
    HeadLayers {
        /// Layers in the head state.
        layers: usize,
        /// The destination's layers.
        expected: usize,
    },
    /// The imported cache does not end where the source's did.
    #[error("the imported cache ends at position {imported}, the source's at {source_end}")]
    EndsElsewhere {
        /// End of the imported cache.
        imported: usize,
        /// End of the source's.
        source_end: usize,
    },
    /// More positions than llama.cpp can address.
    #[error("{0} positions, more than llama.cpp addresses")]
    TooManyPositions(usize),
}
