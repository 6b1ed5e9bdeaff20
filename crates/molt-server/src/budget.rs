//! The service's switchable budget: one [`ServerBudget`] is handed to the engine's session as
//! its [`BudgetSource`] and kept by the HTTP side, which changes what it follows (a fixed
//! value, a replayed trace, the real system, or nothing) through `POST /v1/molt/budget`.
//!
//! The session reads the budget before every token, so a change made while an answer streams
//! takes effect between two tokens of that answer: the client sees a `budget` event and, if
//! the current rung no longer fits, a `switch` event before the next token.
//!
//! A trace's clock is the answer's own (token index or ms since the answer started), so a
//! trace set here replays from its beginning in every answer that follows, and lands on the
//! current token of an answer already running.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use molt::pressure::{
    Budget, BudgetOrigin, BudgetSource, FixedBudget, FixedBudgetHandle, MIB, PressureError,
    SystemBudget, Tick, Trace, TraceBudget, TraceError, TraceRefs,
};

/// What "no budget" reads as: a value far above any machine, small enough that the
/// scheduler's sums cannot overflow. The wire shows it as `null` MiB.
pub const UNLIMITED_BYTES: u64 = 1 << 50;

/// What the budget follows.
enum Mode {
    Unlimited,
    Fixed(FixedBudget, FixedBudgetHandle),
    Trace(TraceBudget),
    System(SystemBudget),
}

struct Inner {
    mode: Mode,
    /// Bumped at every change, so the engine can tell a new setting from an old one.
    generation: u64,
}

/// A budget the HTTP side can re-point while the engine reads it. Cheap to clone; every clone
/// shares one setting.
#[derive(Clone)]
pub struct ServerBudget {
    inner: Arc<Mutex<Inner>>,
}

/// How to set the budget (the body of `POST /v1/molt/budget`, and `--budget`). Exactly one
/// field.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetRequest {
    /// A fixed budget in MiB.
    #[serde(default)]
    pub mib: Option<f64>,
    /// A fixed budget in bytes.
    #[serde(default)]
    pub bytes: Option<u64>,
    /// Replay a trace: a name (looked up as `NAME.json` in the traces directories) or an
    /// inline trace object. Only the operator's own setting (`serve --budget trace:PATH.json`)
    /// may name a path; a client names traces the operator put in the traces directories.
    #[serde(default)]
    pub trace: Option<serde_json::Value>,
    /// `true`: follow the real system (cgroup limits, `MemAvailable`, PSI).
    #[serde(default)]
    pub system: Option<bool>,
    /// Reserve kept free when following the system, MiB (default 256).
    #[serde(default)]
    pub reserve_mib: Option<u64>,
    /// `true`: no budget at all.
    #[serde(default)]
    pub unlimited: Option<bool>,
}

/// The budget as `GET /v1/molt/budget` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetReport {
    /// `unlimited`, `fixed`, `trace` or `system`.
    pub mode: String,
    /// One line describing the source.
    pub description: String,
    /// The budget now (at the start of an answer, for a trace), MiB; `None` when unlimited.
    pub budget_mib: Option<f64>,
    /// Pressure now, 0..1.
    pub pressure: f64,
    /// Changes so far.
    pub generation: u64,
}

impl Default for ServerBudget {
    fn default() -> Self {
        Self::unlimited()
    }
}

impl ServerBudget {
    /// No budget.
    #[must_use]
    pub fn unlimited() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                mode: Mode::Unlimited,
                generation: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock leaves a consistent Mode (every write is one
        // assignment), so a poisoned lock is still usable.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_mode(&self, mode: Mode) {
        let mut g = self.lock();
        g.mode = mode;
        g.generation += 1;
    }

    /// Applies a client's request. `trace_dirs` are searched for trace names; `refs` resolve a
    /// trace's `frac … of "tier1"` events. A trace is a bare name resolved inside
    /// `trace_dirs` (never a path, never a symlink leading out of them), and an error about a
    /// trace file never quotes what the file holds: the endpoint must not become a way to read
    /// files, or to learn whether they exist, on the serving machine.
    ///
    /// # Errors
    /// A message for a 400: no field or several, a negative budget, an unreadable trace, a
    /// trace with a step outside the fixed budget's range.
    pub fn apply(
        &self,
        req: &BudgetRequest,
        trace_dirs: &[PathBuf],
        refs: &TraceRefs,
    ) -> Result<(), String> {
        self.apply_with(req, trace_dirs, refs, TraceAccess::Names)
    }

    /// Applies the operator's own setting (`serve --budget`): as [`ServerBudget::apply`], and
    /// a trace may also be a path to a `.json` file, whose errors are quoted in full.
    ///
    /// # Errors
    /// As [`ServerBudget::apply`].
    pub fn apply_operator(
        &self,
        req: &BudgetRequest,
        trace_dirs: &[PathBuf],
        refs: &TraceRefs,
    ) -> Result<(), String> {
        self.apply_with(req, trace_dirs, refs, TraceAccess::Paths)
    }

    fn apply_with(
        &self,
        req: &BudgetRequest,
        trace_dirs: &[PathBuf],
        refs: &TraceRefs,
        access: TraceAccess,
    ) -> Result<(), String> {
        let set = [
            req.mib.is_some(),
            req.bytes.is_some(),
            req.trace.is_some(),
            req.system == Some(true),
            req.unlimited == Some(true),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if set != 1 {
            return Err(
                "give exactly one of \"mib\", \"bytes\", \"trace\", \"system\": true, \"unlimited\": true"
                    .into(),
            );
        }
        if req.reserve_mib.is_some() && req.system != Some(true) {
            return Err("\"reserve_mib\" goes with \"system\": true".into());
        }
        if let Some(m) = req.mib {
            #[allow(clippy::cast_precision_loss)]
            let in_range = m.is_finite() && m >= 1.0 && m * (MIB as f64) < UNLIMITED_BYTES as f64;
            if !in_range {
                return Err(fixed_range_error("mib"));
            }
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            return self.set_fixed((m * MIB as f64) as u64, reference(refs));
        }
        if let Some(b) = req.bytes {
            if !(MIB..UNLIMITED_BYTES).contains(&b) {
                return Err(fixed_range_error("bytes"));
            }
            return self.set_fixed(b, reference(refs));
        }
        if let Some(t) = &req.trace {
            let trace = load_trace(t, trace_dirs, refs, access)?;
            check_trace_range(&trace)?;
            self.set_mode(Mode::Trace(TraceBudget::new(trace)));
            return Ok(());
        }
        if req.system == Some(true) {
            let mut s = SystemBudget::new();
            if let Some(r) = req.reserve_mib {
                s = s.with_reserve(r.saturating_mul(MIB));
            }
            // Read once now, so a machine without any memory information is refused here
            // rather than failing every answer.
            s.read()
                .map_err(|e| format!("cannot follow the system: {e}"))?;
            self.set_mode(Mode::System(s));
            return Ok(());
        }
        self.set_mode(Mode::Unlimited);
        Ok(())
    }

    /// Sets a fixed budget. Pressure is measured against `reference` (what the largest rung
    /// needs with a full context, so a budget that holds it reads as no pressure), or against
    /// the budget itself when that is larger; changing one fixed value to another keeps the
    /// reference, so a cut reads as pressure.
    ///
    /// # Errors
    /// A zero budget.
    pub fn set_fixed(&self, bytes: u64, reference: u64) -> Result<(), String> {
        if bytes == 0 {
            return Err("a budget of 0 bytes holds nothing".into());
        }
        let mut g = self.lock();
        if let Mode::Fixed(_, h) = &g.mode {
            h.set(bytes);
        } else {
            let f = FixedBudget::new(reference.max(bytes));
            let h = f.handle();
            h.set(bytes);
            g.mode = Mode::Fixed(f, h);
        }
        g.generation += 1;
        Ok(())
    }

    /// True when the budget replays a trace (its value at the start of an answer never moves
    /// by waiting, so deferring admission would wait forever).
    #[must_use]
    pub fn is_trace(&self) -> bool {
        matches!(self.lock().mode, Mode::Trace(_))
    }

    /// The budget at `tick` (unlimited: [`UNLIMITED_BYTES`]).
    ///
    /// # Errors
    /// The system could not be read.
    pub fn read(&self, tick: Tick) -> Result<Budget, PressureError> {
        let mut g = self.lock();
        match &mut g.mode {
            Mode::Unlimited => Ok(Budget {
                bytes: UNLIMITED_BYTES,
                pressure: 0.0,
                origin: BudgetOrigin::Fixed,
            }),
            Mode::Fixed(f, _) => f.budget(tick),
            Mode::Trace(t) => t.budget(tick),
            Mode::System(s) => s.budget(tick),
        }
    }

    /// A report of the current setting.
    #[must_use]
    pub fn report(&self) -> BudgetReport {
        let reading = self.read(Tick::default());
        let g = self.lock();
        let (mode, description) = match &g.mode {
            Mode::Unlimited => ("unlimited", "no budget".to_string()),
            Mode::Fixed(f, _) => ("fixed", f.describe()),
            Mode::Trace(t) => ("trace", t.describe()),
            Mode::System(s) => ("system", s.describe()),
        };
        let (budget_mib, pressure, description) = match reading {
            Ok(b) => (super::openai::mib(b.bytes), b.pressure, description),
            Err(e) => (None, 0.0, format!("{description} (unreadable: {e})")),
        };
        BudgetReport {
            mode: mode.to_string(),
            description,
            budget_mib,
            pressure,
            generation: g.generation,
        }
    }
}

impl BudgetSource for ServerBudget {
    fn budget(&mut self, now: Tick) -> Result<Budget, PressureError> {
        self.read(now)
    }

    fn describe(&self) -> String {
        let g = self.lock();
        match &g.mode {
            Mode::Unlimited => "unlimited".to_string(),
            Mode::Fixed(f, _) => f.describe(),
            Mode::Trace(t) => t.describe(),
            Mode::System(s) => s.describe(),
        }
    }
}

/// One rule for a fixed budget however it is given: at least 1 MiB (less holds no rung) and
/// below [`UNLIMITED_BYTES`] (more would silently read as "no budget").
fn fixed_range_error(field: &str) -> String {
    format!(
        "\"{field}\" must be a budget from 1 MiB up to {} MiB; for no budget send \"unlimited\": true",
        (UNLIMITED_BYTES / MIB) - 1
    )
}

/// A trace, however it is given (a name, an inline object, the operator's path), is held to
/// the fixed budget's rule at every step: a step below 1 MiB would read as "unlimited" on the
/// wire and fail every answer after, and one at [`UNLIMITED_BYTES`] or above would silently
/// mean no budget. The step at fault is named as the trace names it (`initial`, `events[2]`),
/// in whole bytes, since the trace's unit may be any.
fn check_trace_range(trace: &Trace) -> Result<(), String> {
    let steps = std::iter::once(("initial".to_string(), trace.initial_bytes)).chain(
        trace
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("events[{i}]"), s.budget_bytes)),
    );
    for (field, bytes) in steps {
        if !(MIB..UNLIMITED_BYTES).contains(&bytes) {
            return Err(format!(
                "trace {:?}: {field} is {bytes} bytes; every budget a trace sets must be from 1 MiB up to {} MiB, as a fixed budget's",
                trace.name.chars().take(64).collect::<String>(),
                (UNLIMITED_BYTES / MIB) - 1
            ));
        }
    }
    Ok(())
}

/// The pressure reference: the largest footprint among the references (the largest rung with
/// a full context), 0 when none is known.
fn reference(refs: &TraceRefs) -> u64 {
    refs.values().copied().max().unwrap_or(0)
}

/// Who names a trace file, and so what may be named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TraceAccess {
    /// A client: bare names inside the traces directories; errors without file contents.
    Names,
    /// The operator: names or paths; errors in full.
    Paths,
}

fn load_trace(
    spec: &serde_json::Value,
    dirs: &[PathBuf],
    refs: &TraceRefs,
    access: TraceAccess,
) -> Result<Trace, String> {
    match spec {
        serde_json::Value::String(name) if access == TraceAccess::Paths && is_path(name) => {
            let path = operator_trace_path(name)?;
            Trace::load_with(&path, refs).map_err(|e| e.to_string())
        }
        serde_json::Value::String(name) => {
            let path = resolve_trace(name, dirs)?;
            Trace::load_with(&path, refs).map_err(|e| match access {
                TraceAccess::Paths => e.to_string(),
                TraceAccess::Names => quiet_trace_error(name, &e),
            })
        }
        serde_json::Value::Object(_) => {
            Trace::parse_with(&spec.to_string(), "<request>", refs).map_err(|e| e.to_string())
        }
        _ => Err("\"trace\" must be a trace name or a trace object".into()),
    }
}

/// A trace file's error as a client may see it: where, never what. A serde message quotes
/// the value it choked on, and a file in the traces directory may not be meant for clients'
/// eyes (or may be a link the operator did not mean to expose).
fn quiet_trace_error(name: &str, e: &TraceError) -> String {
    match e {
        TraceError::Syntax { line, column, .. } | TraceError::Invalid { line, column, .. } => {
            format!("trace {name:?} is not a valid trace (line {line}, column {column})")
        }
        _ => format!("trace {name:?} cannot be read"),
    }
}

fn is_path(spec: &str) -> bool {
    spec.contains('/') || spec.contains('\\') || spec.ends_with(".json")
}

/// A path the operator gave: only `.json` files are read.
fn operator_trace_path(spec: &str) -> Result<PathBuf, String> {
    let p = Path::new(spec);
    if p.extension().and_then(|e| e.to_str()) != Some("json") {
        return Err(format!("trace path {spec:?} must name a .json file"));
    }
    if !p.is_file() {
        return Err(format!("no trace file {spec:?}"));
    }
    Ok(p.to_path_buf())
}

/// A trace name (`spike_mid_answer`) is looked up as `NAME.json` in each directory. A name is
/// letters, digits, `_`, `-` and inner dots — no separator, no leading dot, no `..` — and the
/// file it names must still lie inside the directory once symlinks are resolved. The error
/// for a name that is not found is the same whether or not something of that name exists
/// elsewhere, and names no directory (those are the server's business).
fn resolve_trace(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, String> {
    let valid = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    if !valid {
        return Err(format!(
            "{:?} is not a trace name (a name is letters, digits, '_', '-' and '.', with no path)",
            name.chars().take(128).collect::<String>()
        ));
    }
    for d in dirs {
        let Ok(dir) = d.canonicalize() else { continue };
        let Ok(file) = dir.join(format!("{name}.json")).canonicalize() else {
            continue;
        };
        if file.starts_with(&dir) && file.is_file() {
            return Ok(file);
        }
    }
    Err(format!(
        "no trace file {name}.json in the traces directories"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: &str) -> BudgetRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_cut_reads_as_pressure_and_reaches_every_clone() {
        let b = ServerBudget::unlimited();
        let mut engine_side = b.clone();
        let refs: TraceRefs = [("big".to_string(), 1000 * MIB)].into_iter().collect();
        b.apply(&req(r#"{"mib": 500}"#), &[], &refs).unwrap();
        let r = engine_side.budget(Tick::default()).unwrap();
        assert!((r.pressure - 0.5).abs() < 1e-9, "{}", r.pressure);
        b.apply(&req(r#"{"mib": 250}"#), &[], &refs).unwrap();
        let r = engine_side.budget(Tick::default()).unwrap();
        assert_eq!(r.bytes, 250 * MIB);
        assert!((r.pressure - 0.75).abs() < 1e-9, "{}", r.pressure);
        assert_eq!(b.report().generation, 2);
    }

    #[test]
    fn exactly_one_setting_is_accepted() {
        let b = ServerBudget::unlimited();
        for bad in [
            r#"{}"#,
            r#"{"mib": 5, "bytes": 5}"#,
            r#"{"mib": -1}"#,
            r#"{"reserve_mib": 5, "mib": 9}"#,
            r#"{"mib": 0}"#,
            r#"{"mib": 1e30}"#,
            r#"{"bytes": 1}"#,
            r#"{"bytes": 1125899906842624}"#,
        ] {
            assert!(b.apply(&req(bad), &[], &TraceRefs::new()).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<BudgetRequest>(r#"{"mb": 5}"#).is_err());
    }

    #[test]
    fn inline_trace_follows_the_answer_clock() {
        let b = ServerBudget::unlimited();
        b.apply(
            &req(
                r#"{"trace": {"name": "t", "initial": 100, "events": [{"at": 3, "budget": 40}]}}"#,
            ),
            &[],
            &TraceRefs::new(),
        )
        .unwrap();
        assert!(b.is_trace());
        let at = |i| {
            b.read(Tick {
                token_index: i,
                elapsed_ms: 0,
            })
            .unwrap()
            .bytes
        };
        assert_eq!((at(2), at(3)), (100 * MIB, 40 * MIB));
    }

    #[test]
    fn a_trace_is_held_to_the_fixed_budget_s_range() {
        let b = ServerBudget::unlimited();
        for bad in [
            r#"{"trace": {"name": "x", "initial": 0, "events": []}}"#,
            r#"{"trace": {"name": "x", "unit": "B", "initial": 1}}"#,
            r#"{"trace": {"name": "x", "initial": 100, "events": [{"at": 2, "budget": 0.5}]}}"#,
            r#"{"trace": {"name": "x", "unit": "GiB", "initial": 1073741824}}"#,
        ] {
            let e = b.apply(&req(bad), &[], &TraceRefs::new()).unwrap_err();
            assert!(e.contains("from 1 MiB"), "{bad}: {e}");
        }
        assert_eq!(b.report().mode, "unlimited");
        b.apply(
            &req(r#"{"trace": {"name": "x", "unit": "B", "initial": 1048576}}"#),
            &[],
            &TraceRefs::new(),
        )
        .unwrap();
    }

    #[test]
    fn trace_names_are_not_paths() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x.json"), r#"{"name": "x", "initial": 5}"#).unwrap();
        let dirs = vec![dir.path().to_path_buf()];
        assert!(resolve_trace("x", &dirs).is_ok());
        assert!(resolve_trace("../x", &dirs).is_err());
        assert!(resolve_trace("/etc/passwd", &dirs).is_err());
        let e = resolve_trace("nope", &dirs).unwrap_err();
        assert!(e.contains("nope.json"), "{e}");
    }
}
