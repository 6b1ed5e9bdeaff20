//! Budget traces: how much memory Molt may use over the course of one answer.
//!
//! A [`Trace`] is a step function from a clock reading to a byte budget, loaded from a JSON
//! file in `traces/`. The default clock is the generated-token index ([`Clock::Token`]), so a
//! replay lands the same pressure on the same token on every machine and every run — which is
//! what makes conditions A–D comparable. [`Clock::Ms`] (wall time since the answer started)
//! exists for traces that mimic a real app launch.
//!
//! # Schema
//!
//! ```json
//! {
//!   "name": "spike_mid_answer",            // required, non-empty
//!   "description": "free text",            // optional
//!   "unit": "MiB",                         // optional: "B" | "KiB" | "MiB" (default) | "GiB"
//!   "clock": "token",                      // optional: "token" (default) | "ms"
//!   "initial": 2400,                       // budget before the first event, in `unit`
//!   "events": [                            // optional; strictly increasing `at`
//!     { "at": 48, "budget": 1200 },        // absolute, in `unit`
//!     { "at": 96, "frac": 1.05, "of": "tier2" }  // fraction of a named reference
//!   ]
//! }
//! ```
//!
//! An event holds from its `at` (inclusive) until the next event. `frac` is a fraction of a
//! reference resolved at load time: `"initial"` (the default for `of`) or a name the loader
//! was given in [`TraceRefs`] — the lead passes measured rung footprints as `tier0`, `tier1`,
//! `tier2`, so a trace can say "5 % above what tier2 needs" and stay right when footprints
//! change. Unknown fields are rejected (a typo must not silently mean "no event").
//!
//! Every error names the line and column at fault: `serde_json`'s own position for syntax and
//! type errors, and for semantic errors (unsorted events, negative budget, unknown unit,
//! empty name, unknown reference) the position of the offending field or event, found by
//! scanning the text.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{TraceError, TraceProblem};

/// Which clock a trace's `at` values are read against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    /// Generated-token index of the answer (0 = before the first generated token).
    /// Reproducible; the default.
    #[default]
    Token,
    /// Milliseconds of wall time since the answer started.
    Ms,
}

/// The unit a trace file writes its budgets in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit {
    /// Bytes.
    B,
    /// 1024 bytes.
    KiB,
    /// 1024² bytes.
    MiB,
    /// 1024³ bytes.
    GiB,
}

impl Unit {
    /// Bytes per unit.
    #[must_use]
    pub fn bytes(self) -> u64 {
        match self {
            Unit::B => 1,
            Unit::KiB => 1 << 10,
            Unit::MiB => 1 << 20,
            Unit::GiB => 1 << 30,
        }
    }

    fn parse(text: &str) -> Option<Unit> {
        match text {
            "B" => Some(Unit::B),
            "KiB" => Some(Unit::KiB),
            "MiB" => Some(Unit::MiB),
            "GiB" => Some(Unit::GiB),
            _ => None,
        }
    }
}

/// Named byte counts a trace's `frac` events may refer to with `of` (e.g. measured rung
/// footprints under `tier0`, `tier1`, `tier2`). `initial` is always available and need not be
/// given.
pub type TraceRefs = BTreeMap<String, u64>;

/// One resolved step of a trace: from `at` on, the budget is `budget_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceStep {
    /// Clock reading at which the step takes effect (inclusive).
    pub at: u64,
    /// Budget in bytes from then on.
    pub budget_bytes: u64,
}

/// A loaded, validated and resolved budget trace. See the module docs for the file schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// Short identifier, e.g. `spike_mid_answer`.
    pub name: String,
    /// Free-text description.
    pub description: String,
    /// Clock the steps are keyed by.
    pub clock: Clock,
    /// Budget before the first step, in bytes.
    pub initial_bytes: u64,
    /// Steps, strictly increasing in `at`.
    pub steps: Vec<TraceStep>,
}

/// On-disk form, before validation and resolution.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrace {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default = "default_unit")]
    unit: String,
    #[serde(default)]
    clock: Clock,
    initial: f64,
    #[serde(default)]
    events: Vec<RawEvent>,
}

fn default_unit() -> String {
    "MiB".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    at: u64,
    budget: Option<f64>,
    frac: Option<f64>,
    of: Option<String>,
}

const INLINE_ORIGIN: &str = "<inline>";

impl Trace {
    /// A trace with no events: the budget is `initial_bytes` throughout.
    #[must_use]
    pub fn steady(name: &str, initial_bytes: u64) -> Trace {
        Trace {
            name: name.to_owned(),
            description: String::new(),
            clock: Clock::Token,
            initial_bytes,
            steps: Vec::new(),
        }
    }

    /// Parses a trace from JSON text that uses no named references.
    ///
    /// # Errors
    ///
    /// [`TraceError::Syntax`] for malformed JSON or a schema mismatch, and
    /// [`TraceError::Invalid`] for a semantic problem; both carry line and column.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        Trace::parse_with(text, INLINE_ORIGIN, &TraceRefs::new())
    }

    /// Parses a trace from JSON text, resolving `of` references against `refs`. `origin`
    /// names the text in error messages (normally the file path).
    ///
    /// # Errors
    ///
    /// As [`Trace::parse`]; additionally [`TraceProblem::UnknownReference`] when an event's
    /// `of` is neither `initial` nor a key of `refs`.
    pub fn parse_with(text: &str, origin: &str, refs: &TraceRefs) -> Result<Trace, TraceError> {
        let raw: RawTrace = serde_json::from_str(text).map_err(|e| TraceError::Syntax {
            origin: origin.to_owned(),
            line: e.line(),
            column: e.column(),
            message: strip_serde_position(&e.to_string()),
        })?;
        resolve(raw, refs).map_err(|(path, problem)| {
            let (line, column) = locate(text, &path);
            TraceError::Invalid {
                origin: origin.to_owned(),
                line,
                column,
                problem,
            }
        })
    }

    /// Loads a trace file that uses no named references.
    ///
    /// # Errors
    ///
    /// [`TraceError::Io`] when the file cannot be read; otherwise as [`Trace::parse`], with
    /// the path as origin.
    pub fn load(path: &Path) -> Result<Trace, TraceError> {
        Trace::load_with(path, &TraceRefs::new())
    }

    /// Loads a trace file, resolving `of` references against `refs`.
    ///
    /// # Errors
    ///
    /// As [`Trace::load`] and [`Trace::parse_with`].
    pub fn load_with(path: &Path, refs: &TraceRefs) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Trace::parse_with(&text, &path.display().to_string(), refs)
    }

    /// The budget in bytes at a point of the answer: the last step whose `at` is at or before
    /// the clock reading (`token_index` for [`Clock::Token`], `elapsed_ms` for [`Clock::Ms`]),
    /// or the initial budget before the first step.
    #[must_use]
    pub fn budget_at(&self, token_index: u64, elapsed_ms: u64) -> u64 {
        let now = match self.clock {
            Clock::Token => token_index,
            Clock::Ms => elapsed_ms,
        };
        let after = self.steps.partition_point(|s| s.at <= now);
        match after.checked_sub(1) {
            Some(i) => self.steps[i].budget_bytes,
            None => self.initial_bytes,
        }
    }

    /// The smallest budget the trace ever sets (including the initial one).
    #[must_use]
    pub fn min_budget_bytes(&self) -> u64 {
        self.steps
            .iter()
            .map(|s| s.budget_bytes)
            .fold(self.initial_bytes, u64::min)
    }
}

/// `serde_json` appends " at line L column C" to its messages; the position is reported in
/// our own fields instead.
fn strip_serde_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

type Located = (String, TraceProblem);

fn resolve(raw: RawTrace, refs: &TraceRefs) -> Result<Trace, Located> {
    if raw.name.trim().is_empty() {
        return Err(("name".to_owned(), TraceProblem::EmptyName));
    }
    let Some(unit) = Unit::parse(&raw.unit) else {
        return Err((
            "unit".to_owned(),
            TraceProblem::UnknownUnit { unit: raw.unit },
        ));
    };
    let initial_bytes = to_bytes("initial", raw.initial, unit.bytes())?;
    let mut steps = Vec::with_capacity(raw.events.len());
    let mut previous_at: Option<u64> = None;
    for (index, event) in raw.events.into_iter().enumerate() {
        let here = format!("events[{index}]");
        if let Some(previous_at) = previous_at
            && event.at <= previous_at
        {
            return Err((
                here,
                TraceProblem::EventsNotSorted {
                    index,
                    at: event.at,
                    previous_at,
                },
            ));
        }
        previous_at = Some(event.at);
        let budget_bytes = match (event.budget, event.frac, event.of) {
            (Some(_), Some(_), _) => {
                return Err((here, TraceProblem::BothBudgetAndFrac { index }));
            }
            (_, None, Some(_)) => {
                return Err((format!("{here}.of"), TraceProblem::OfWithoutFrac { index }));
            }
            (None, None, None) => return Err((here, TraceProblem::NoBudget { index })),
            (Some(budget), None, None) => {
                to_bytes(&format!("{here}.budget"), budget, unit.bytes())?
            }
            (None, Some(frac), of) => {
                let name = of.unwrap_or_else(|| "initial".to_owned());
                let base = if name == "initial" {
                    initial_bytes
                } else if let Some(&bytes) = refs.get(&name) {
                    bytes
                } else {
                    let mut known = vec!["initial".to_owned()];
                    known.extend(refs.keys().cloned());
                    return Err((
                        format!("{here}.of"),
                        TraceProblem::UnknownReference {
                            index,
                            name,
                            known: known.join(", "),
                        },
                    ));
                };
                #[expect(
                    clippy::cast_precision_loss,
                    reason = "byte counts far below 2^53 are exact in f64"
                )]
                let base = base as f64;
                to_bytes(&format!("{here}.frac"), frac, 1)
                    .and_then(|_| to_bytes(&format!("{here}.frac"), frac * base, 1))?
            }
        };
        steps.push(TraceStep {
            at: event.at,
            budget_bytes,
        });
    }
    Ok(Trace {
        name: raw.name,
        description: raw.description,
        clock: raw.clock,
        initial_bytes,
        steps,
    })
}

/// `value × scale` as whole bytes (rounded down), rejecting negatives and overflow.
fn to_bytes(field: &str, value: f64, scale: u64) -> Result<u64, Located> {
    if value < 0.0 {
        return Err((
            field.to_owned(),
            TraceProblem::NegativeBudget {
                field: field.to_owned(),
                value,
            },
        ));
    }
    #[expect(
        clippy::cast_precision_loss,
        reason = "unit scales are powers of two, exact in f64"
    )]
    let bytes = (value * scale as f64).floor();
    // 2^64 is exactly representable; anything at or above it does not fit.
    if !bytes.is_finite() || bytes >= 18_446_744_073_709_551_616.0 {
        return Err((
            field.to_owned(),
            TraceProblem::BudgetTooLarge {
                field: field.to_owned(),
                value,
            },
        ));
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "checked above: finite, non-negative, below 2^64"
    )]
    Ok(bytes as u64)
}

/// Line and column (1-based) of a JSON path such as `events[2].budget` in `text`: the
/// position of the member's key, or of the array element. Falls back to the nearest enclosing
/// path that was found, and to 1:1.
fn locate(text: &str, path: &str) -> (usize, usize) {
    let mut scanner = Scanner {
        bytes: text.as_bytes(),
        i: 0,
        found: BTreeMap::new(),
    };
    scanner.value("");
    let mut probe = path.to_owned();
    loop {
        if let Some(&offset) = scanner.found.get(&probe) {
            return line_column(text, offset);
        }
        match probe.rfind(['.', '[']) {
            Some(cut) => probe.truncate(cut),
            None => return (1, 1),
        }
    }
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text.as_bytes()[..offset.min(text.len())];
    let line = before.split(|&b| b == b'\n').count();
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |p| p + 1);
    (line, offset - line_start + 1)
}

/// A structural JSON walker that records where every member key and array element starts.
/// It runs only on text `serde_json` already accepted, so it can be lenient; it never panics
/// on any input (every index is bounds-checked).
struct Scanner<'a> {
    bytes: &'a [u8],
    i: usize,
    found: BTreeMap<String, usize>,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn value(&mut self, path: &str) {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.object(path),
            Some(b'[') => self.array(path),
            Some(b'"') => {
                self.string();
            }
            Some(_) => {
                while let Some(b) = self.peek() {
                    if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.i += 1;
                }
            }
            None => {}
        }
    }

    fn object(&mut self, path: &str) {
        self.i += 1;
        loop {
            self.skip_ws();
            match self.peek() {
                Some(b'}') => {
                    self.i += 1;
                    return;
                }
                Some(b',') => self.i += 1,
                Some(b'"') => {
                    let key_at = self.i;
                    let key = self.string();
                    let child = if path.is_empty() {
                        key
                    } else {
                        format!("{path}.{key}")
                    };
                    self.skip_ws();
                    if self.peek() == Some(b':') {
                        self.i += 1;
                    }
                    self.value(&child);
                    self.found.entry(child).or_insert(key_at);
                }
                _ => return,
            }
        }
    }

    fn array(&mut self, path: &str) {
        self.i += 1;
        let mut index = 0usize;
        loop {
            self.skip_ws();
            match self.peek() {
                Some(b']') => {
                    self.i += 1;
                    return;
                }
                Some(b',') => self.i += 1,
                Some(_) => {
                    let child = format!("{path}[{index}]");
                    let before = self.i;
                    self.value(&child);
                    self.found.entry(child).or_insert(before);
                    if self.i == before {
                        return;
                    }
                    index += 1;
                }
                None => return,
            }
        }
    }

    /// Consumes a string literal and returns its raw content (escapes left as written —
    /// member names in a trace are plain ASCII).
    fn string(&mut self) -> String {
        self.i += 1;
        let start = self.i;
        while let Some(b) = self.peek() {
            match b {
                b'\\' => self.i += 2,
                b'"' => break,
                _ => self.i += 1,
            }
        }
        let end = self.i.min(self.bytes.len());
        self.i += 1;
        String::from_utf8_lossy(&self.bytes[start.min(end)..end]).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pressure::MIB;

    const GOOD: &str = r#"{
  "name": "two_steps",
  "unit": "MiB",
  "initial": 2000,
  "events": [
    {"at": 10, "budget": 1000},
    {"at": 20, "budget": 500.5}
  ]
}"#;

    fn invalid(text: &str) -> (usize, usize, TraceProblem) {
        match Trace::parse(text) {
            Err(TraceError::Invalid {
                line,
                column,
                problem,
                ..
            }) => (line, column, problem),
            other => panic!("expected an Invalid error, got {other:?}"),
        }
    }

    #[test]
    fn parses_and_steps() {
        let t = Trace::parse(GOOD).expect("valid trace");
        assert_eq!(t.clock, Clock::Token);
        assert_eq!(t.initial_bytes, 2000 * MIB);
        assert_eq!(t.budget_at(0, 0), 2000 * MIB);
        assert_eq!(t.budget_at(9, 99_999), 2000 * MIB);
        assert_eq!(t.budget_at(10, 0), 1000 * MIB);
        assert_eq!(t.budget_at(19, 0), 1000 * MIB);
        assert_eq!(t.budget_at(20, 0), 500 * MIB + MIB / 2);
        assert_eq!(t.budget_at(u64::MAX, 0), 500 * MIB + MIB / 2);
        assert_eq!(t.min_budget_bytes(), 500 * MIB + MIB / 2);
    }

    #[test]
    fn ms_clock_reads_elapsed_time() {
        let t = Trace::parse(
            r#"{"name":"ms","clock":"ms","unit":"KiB","initial":8,"events":[{"at":100,"budget":4}]}"#,
        )
        .expect("valid");
        assert_eq!(t.budget_at(1_000_000, 99), 8 * 1024);
        assert_eq!(t.budget_at(0, 100), 4 * 1024);
    }

    #[test]
    fn defaults_unit_mib_and_token_clock_and_no_events() {
        let t = Trace::parse(r#"{"name":"s","initial":3}"#).expect("valid");
        assert_eq!(t.clock, Clock::Token);
        assert_eq!(t.initial_bytes, 3 * MIB);
        assert!(t.steps.is_empty());
        assert_eq!(t.budget_at(123, 456), 3 * MIB);
    }

    #[test]
    fn syntax_error_carries_line_and_column() {
        let text = "{\n  \"name\": \"x\",\n  \"initial\": 10,\n  \"events\": [ {\"at\": 1 \"budget\": 2} ]\n}";
        match Trace::parse(text) {
            Err(TraceError::Syntax {
                line,
                column,
                message,
                ..
            }) => {
                assert_eq!(line, 4);
                assert!(column > 20, "column {column}");
                assert!(!message.contains("at line"), "{message}");
            }
            other => panic!("expected Syntax, got {other:?}"),
        }
    }

    #[test]
    fn type_errors_and_unknown_fields_and_clocks_are_syntax_errors_with_position() {
        for (text, line) in [
            ("{\"name\": \"x\",\n\"initial\": \"big\"}", 2),
            ("{\"name\": \"x\", \"initial\": 1,\n\"evnts\": []}", 2),
            (
                "{\"name\": \"x\", \"initial\": 1,\n\n\"clock\": \"tokens\"}",
                3,
            ),
            (
                "{\"name\": \"x\", \"initial\": 1, \"events\": [\n{\"at\": -3, \"budget\": 1}]}",
                2,
            ),
        ] {
            match Trace::parse(text) {
                Err(TraceError::Syntax { line: got, .. }) => assert_eq!(got, line, "{text}"),
                other => panic!("expected Syntax for {text}, got {other:?}"),
            }
        }
    }

    #[test]
    fn unsorted_events_name_the_offending_line() {
        let text = "{\n \"name\": \"x\",\n \"initial\": 10,\n \"events\": [\n  {\"at\": 5, \"budget\": 1},\n  {\"at\": 5, \"budget\": 2}\n ]\n}";
        let (line, column, problem) = invalid(text);
        assert_eq!((line, column), (6, 3));
        assert_eq!(
            problem,
            TraceProblem::EventsNotSorted {
                index: 1,
                at: 5,
                previous_at: 5
            }
        );
    }

    #[test]
    fn negative_budget_names_the_field() {
        let text = "{\"name\": \"x\", \"initial\": 10, \"events\": [\n {\"at\": 1, \"budget\": 4},\n {\"at\": 2,\n  \"budget\": -4}]}";
        let (line, column, problem) = invalid(text);
        assert_eq!((line, column), (4, 3));
        assert_eq!(
            problem,
            TraceProblem::NegativeBudget {
                field: "events[1].budget".to_owned(),
                value: -4.0
            }
        );
        let (line, _, _) = invalid("{\"name\": \"x\",\n \"initial\": -1}");
        assert_eq!(line, 2);
    }

    #[test]
    fn unknown_unit_and_empty_name() {
        let (line, _, problem) = invalid("{\"name\": \"x\", \"initial\": 1,\n \"unit\": \"MB\"}");
        assert_eq!(line, 2);
        assert_eq!(
            problem,
            TraceProblem::UnknownUnit {
                unit: "MB".to_owned()
            }
        );
        let (line, column, problem) = invalid("{\n\n   \"name\": \" \", \"initial\": 1}");
        assert_eq!((line, column), (3, 4));
        assert_eq!(problem, TraceProblem::EmptyName);
    }

    #[test]
    fn event_level_must_be_exactly_one_of_budget_and_frac() {
        let base = |ev: &str| format!("{{\"name\":\"x\",\"initial\":1,\"events\":[\n{ev}]}}");
        assert_eq!(
            invalid(&base(r#"{"at":1,"budget":1,"frac":0.5}"#)).2,
            TraceProblem::BothBudgetAndFrac { index: 0 }
        );
        assert_eq!(
            invalid(&base(r#"{"at":1}"#)).2,
            TraceProblem::NoBudget { index: 0 }
        );
        assert_eq!(
            invalid(&base(r#"{"at":1,"budget":1,"of":"tier0"}"#)).2,
            TraceProblem::OfWithoutFrac { index: 0 }
        );
    }

    #[test]
    fn fractions_resolve_against_initial_and_references() {
        let text = r#"{"name":"rel","initial":1000,"events":[
            {"at":1,"frac":0.5},
            {"at":2,"frac":1.5,"of":"tier2"}]}"#;
        let mut refs = TraceRefs::new();
        refs.insert("tier2".to_owned(), 100 * MIB);
        let t = Trace::parse_with(text, "rel.json", &refs).expect("resolves");
        assert_eq!(t.budget_at(1, 0), 500 * MIB);
        assert_eq!(t.budget_at(2, 0), 150 * MIB);

        match Trace::parse(text) {
            Err(TraceError::Invalid {
                origin,
                line,
                problem,
                ..
            }) => {
                assert_eq!(origin, "<inline>");
                assert_eq!(line, 3);
                assert_eq!(
                    problem,
                    TraceProblem::UnknownReference {
                        index: 1,
                        name: "tier2".to_owned(),
                        known: "initial".to_owned()
                    }
                );
            }
            other => panic!("expected UnknownReference, got {other:?}"),
        }
    }

    #[test]
    fn huge_budgets_are_rejected_not_wrapped() {
        let (_, _, problem) = invalid(r#"{"name":"x","unit":"GiB","initial":1e12}"#);
        assert!(matches!(problem, TraceProblem::BudgetTooLarge { .. }));
    }

    #[test]
    fn error_display_is_file_line_column() {
        let err = Trace::parse_with(
            "{\"name\": \"\", \"initial\": 1}",
            "traces/bad.json",
            &TraceRefs::new(),
        )
        .expect_err("empty name");
        assert_eq!(
            err.to_string(),
            "traces/bad.json:1:2: trace `name` is empty"
        );
    }

    #[test]
    fn shipped_traces_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
        let spike = Trace::load(&dir.join("spike_mid_answer.json")).expect("spike");
        assert_eq!(spike.steps.len(), 3, "one step per rung below tier0");
        assert!(spike.steps[0].budget_bytes < spike.initial_bytes);
        assert!(
            spike
                .steps
                .windows(2)
                .all(|w| w[1].budget_bytes < w[0].budget_bytes)
        );

        let recover = Trace::load(&dir.join("spike_and_recover.json")).expect("recover");
        let last = recover.steps.last().expect("has steps").budget_bytes;
        assert!(last > recover.min_budget_bytes());

        let steady = Trace::load(&dir.join("steady.json")).expect("steady");
        assert!(steady.steps.is_empty());

        let mut refs = TraceRefs::new();
        let rungs = [
            ("tier0", 1400),
            ("q3km", 1200),
            ("tier1", 1000),
            ("tier2", 700),
        ];
        for (name, mib) in rungs {
            refs.insert(name.to_owned(), mib * MIB);
        }
        let relative =
            Trace::load_with(&dir.join("spike_mid_answer_relative.json"), &refs).expect("rel");
        // Each step admits the next rung down and not the one above it.
        assert_eq!(relative.steps.len(), rungs.len() - 1);
        for (step, pair) in relative.steps.iter().zip(rungs.windows(2)) {
            let (above, below) = (pair[0].1 * MIB, pair[1].1 * MIB);
            assert!(
                (below..above).contains(&step.budget_bytes),
                "{} between {} and {}",
                step.budget_bytes,
                pair[1].0,
                pair[0].0
            );
        }
        assert!(Trace::load(&dir.join("spike_mid_answer_relative.json")).is_err());

        // Every shipped trace loads (with the rung references) and is named after its file.
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("traces/") {
            let path = entry.expect("entry").path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let t = Trace::load_with(&path, &refs).expect("shipped trace loads");
            assert_eq!(
                Some(t.name.as_str()),
                path.file_stem().and_then(|s| s.to_str())
            );
            assert!(!t.description.is_empty(), "{}", t.name);
            seen += 1;
        }
        assert!(seen >= 6, "{seen} traces");
        // The wall-clock traces drop below every rung and come back.
        for name in ["park_and_resume", "shed_and_resume"] {
            let t = Trace::load(&dir.join(format!("{name}.json"))).expect(name);
            assert_eq!(t.clock, Clock::Ms);
            assert!(t.min_budget_bytes() < 500 * MIB);
            assert_eq!(
                t.steps.last().map(|s| s.budget_bytes),
                Some(t.initial_bytes)
            );
        }
    }

    #[test]
    fn scanner_survives_garbage() {
        for text in ["", "{", "[[[", "{\"a\":", "\"\\", "{\"a\" 1}", "[1,,2]"] {
            let _ = locate(text, "events[3].budget");
        }
    }
}
