//! Error types of the `pressure` room: one small enum per operation family
//! ([`TraceError`], [`HogError`]) and the umbrella [`PressureError`].

use std::io;
use std::path::PathBuf;

/// What is semantically wrong with a trace that parsed as JSON.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceProblem {
    /// `name` is empty or only whitespace.
    #[error("trace `name` is empty")]
    EmptyName,
    /// `unit` is not one of the known units.
    #[error("unknown unit {unit:?}; expected one of \"B\", \"KiB\", \"MiB\", \"GiB\"")]
    UnknownUnit {
        /// The unit as written.
        unit: String,
    },
    /// A budget (`initial` or an event's `budget`/`frac`) is negative.
    #[error("`{field}` is negative ({value})")]
    NegativeBudget {
        /// JSON path of the field, e.g. `events[2].budget`.
        field: String,
        /// The value as parsed.
        value: f64,
    },
    /// A budget does not fit in a `u64` byte count.
    #[error("`{field}` = {value} does not fit in 64-bit bytes")]
    BudgetTooLarge {
        /// JSON path of the field.
        field: String,
        /// The value as parsed.
        value: f64,
    },
    /// Event `at` values must strictly increase.
    #[error(
        "event {index} is at {at}, not after the previous event at {previous_at} \
         (events must be sorted by strictly increasing `at`)"
    )]
    EventsNotSorted {
        /// Index of the offending event in `events`.
        index: usize,
        /// Its `at`.
        at: u64,
        /// The previous event's `at`.
        previous_at: u64,
    },
    /// An event gives both `budget` and `frac`.
    #[error("event {index} gives both `budget` and `frac`; give exactly one")]
    BothBudgetAndFrac {
        /// Index of the offending event.
        index: usize,
    },
    /// An event gives neither `budget` nor `frac`.
    #[error("event {index} gives neither `budget` nor `frac`")]
    NoBudget {
        /// Index of the offending event.
        index: usize,
    },
    /// An event gives `of` without `frac`.
    #[error("event {index} gives `of` without `frac`")]
    OfWithoutFrac {
        /// Index of the offending event.
        index: usize,
    },
    /// An event's `of` names a reference the loader was not given.
    #[error("event {index}: `of` = {name:?} is not a known reference (known: {known})")]
    UnknownReference {
        /// Index of the offending event.
        index: usize,
        /// The name as written.
        name: String,
        /// Comma-separated names that were available.
        known: String,
    },
}

/// A trace file could not be read, parsed, or validated.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The text is not valid JSON or does not match the schema (wrong type, unknown field,
    /// unknown clock).
    #[error("{origin}:{line}:{column}: {message}")]
    Syntax {
        /// File path, or `<inline>` for a string.
        origin: String,
        /// 1-based line of the fault.
        line: usize,
        /// 1-based column of the fault.
        column: usize,
        /// `serde_json`'s description.
        message: String,
    },
    /// The JSON is well-formed but describes an impossible trace.
    #[error("{origin}:{line}:{column}: {problem}")]
    Invalid {
        /// File path, or `<inline>` for a string.
        origin: String,
        /// 1-based line of the offending field or event.
        line: usize,
        /// 1-based column of the offending field or event.
        column: usize,
        /// What is wrong.
        problem: TraceProblem,
    },
}

/// The hog (the memory-allocating child) or its parent-side handle failed.
#[derive(Debug, thiserror::Error)]
pub enum HogError {
    /// The child program could not be started.
    #[error("cannot start hog {program}: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Anonymous memory could not be mapped.
    #[error("cannot map {mib} MiB of anonymous memory (holding {held_mib} MiB): {source}")]
    Alloc {
        /// Target that was being reached.
        mib: u64,
        /// MiB already held when the mapping failed.
        held_mib: u64,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A control line was not `<mib>`, `quit` or empty.
    #[error("hog control line {line_no}: expected `<mib>` or `quit`, got {text:?}")]
    Protocol {
        /// 1-based line number on the control stream.
        line_no: usize,
        /// The line.
        text: String,
    },
    /// A `--mib-schedule` string is malformed.
    #[error("bad hog schedule {text:?}: {reason}")]
    Schedule {
        /// The schedule as given.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading control input or writing acknowledgements failed.
    #[error("hog pipe: {source}")]
    Pipe {
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The child did not acknowledge in time.
    #[error("hog did not report {expected:?} within {waited_ms} ms")]
    Timeout {
        /// The acknowledgement line that was awaited.
        expected: String,
        /// How long the parent waited.
        waited_ms: u64,
    },
    /// The child closed its output (it exited or crashed) before acknowledging.
    #[error("hog exited before reporting {expected:?} (status: {status})")]
    Exited {
        /// The acknowledgement line that was awaited.
        expected: String,
        /// The exit status, if it could be collected.
        status: String,
    },
}

/// Umbrella error of the `pressure` room.
#[derive(Debug, thiserror::Error)]
pub enum PressureError {
    /// A trace could not be loaded.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The hog failed.
    #[error(transparent)]
    Hog(#[from] HogError),
    /// A `/proc` or `/sys` file (or a file being measured) could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A `/proc` or `/sys` file did not have the expected content.
    #[error("{path}: cannot find or parse {what}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was looked for, e.g. `VmRSS`.
        what: &'static str,
    },
    /// Neither cgroup limits nor `MemAvailable` could be read: there is no system budget.
    #[error(
        "no memory information: no limited cgroup under {sys_root} and no MemAvailable in \
         {proc_root}/meminfo"
    )]
    NoMemoryInfo {
        /// The `/proc` root that was searched.
        proc_root: PathBuf,
        /// The `/sys` root that was searched.
        sys_root: PathBuf,
    },
    /// A system call (`mmap`, `mincore`) failed.
    #[error("{call} failed: {source}")]
    Sys {
        /// The call.
        call: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}
