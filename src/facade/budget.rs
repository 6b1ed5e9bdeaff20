//! Where an embedded engine's memory budget comes from: [`Budget`] names the source, and
//! [`Swappable`] lets the application replace it (or push a new value) from any thread while
//! an answer streams — the engine reads it again before every token.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::pressure::{
    BudgetSource, FixedBudget, PressureError, SystemBudget, Tick, Trace, TraceBudget,
};

/// A memory budget for the engine: how much the model may hold, read before every token.
pub enum Budget {
    /// No limit: the engine stays on the rung it starts on.
    Unlimited,
    /// A fixed number of bytes, set by the application (call
    /// [`Molt::set_budget`](super::Molt::set_budget) again to move it, e.g. on each of the
    /// platform's memory warnings).
    Bytes(u64),
    /// The real system's: the cgroup's limit, `MemAvailable` and memory pressure (PSI), less
    /// a reserve for the rest of the machine.
    System,
    /// A replayed trace (JSON, see `traces/`): reproducible pressure for tests and demos.
    Trace(PathBuf),
    /// The application's own source.
    Source(Box<dyn BudgetSource + Send>),
}

impl Budget {
    /// The real system's budget ([`Budget::System`]).
    #[must_use]
    pub fn system() -> Self {
        Self::System
    }

    /// A fixed budget of `mib` MiB ([`Budget::Bytes`]).
    #[must_use]
    pub fn mib(mib: u64) -> Self {
        Self::Bytes(mib << 20)
    }

    /// A replayed trace ([`Budget::Trace`]).
    #[must_use]
    pub fn trace(path: impl Into<PathBuf>) -> Self {
        Self::Trace(path.into())
    }

    /// The source this budget reads, `None` for [`Budget::Unlimited`]. `refs` resolves a
    /// trace's `{"frac": …, "of": "rung"}` events against each rung's modelled footprint.
    pub(super) fn into_source(
        self,
        refs: &crate::pressure::TraceRefs,
    ) -> Result<Option<Box<dyn BudgetSource + Send>>, super::Error> {
        Ok(match self {
            Self::Unlimited => None,
            Self::Bytes(b) => Some(Box::new(FixedBudget::new(b))),
            Self::System => {
                let s = SystemBudget::new();
                s.read()
                    .map_err(|e| super::Error::Budget(format!("the system's memory: {e}")))?;
                Some(Box::new(s))
            }
            Self::Trace(path) => {
                let t = Trace::load_with(&path, refs)
                    .map_err(|e| super::Error::Budget(format!("trace {}: {e}", path.display())))?;
                Some(Box::new(TraceBudget::new(t)))
            }
            Self::Source(s) => Some(s),
        })
    }
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unlimited => write!(f, "Unlimited"),
            Self::Bytes(b) => write!(f, "Bytes({b})"),
            Self::System => write!(f, "System"),
            Self::Trace(p) => write!(f, "Trace({})", p.display()),
            Self::Source(s) => write!(f, "Source({})", s.describe()),
        }
    }
}

/// The engine's budget source, replaceable from another thread: the session holds one
/// [`Swappable`] for its whole life and reads through it; [`Swappable::replace`] takes effect
/// at the next token.
#[derive(Clone, Default)]
pub(super) struct Swappable(Arc<Mutex<Option<Box<dyn BudgetSource + Send>>>>);

impl Swappable {
    /// Puts `source` in place of the current one (`None`: unlimited).
    pub(super) fn replace(&self, source: Option<Box<dyn BudgetSource + Send>>) {
        if let Ok(mut g) = self.0.lock() {
            *g = source;
        }
    }

    /// The budget now, `None` when unlimited.
    pub(super) fn read_now(&self) -> Option<u64> {
        let mut g = self.0.lock().ok()?;
        g.as_mut()?.budget(Tick::default()).ok().map(|b| b.bytes)
    }
}

/// What "no budget" reads as: far above any machine, small enough that the scheduler's sums
/// cannot overflow.
pub(super) const UNLIMITED_BYTES: u64 = 1 << 50;

/// What the session sees: the swappable source, unlimited ([`UNLIMITED_BYTES`]) while none is set.
pub(super) struct Reader(pub(super) Swappable);

impl BudgetSource for Reader {
    fn budget(&mut self, now: Tick) -> Result<crate::pressure::Budget, PressureError> {
        let unlimited = crate::pressure::Budget {
            bytes: UNLIMITED_BYTES,
            pressure: 0.0,
            origin: crate::pressure::BudgetOrigin::Fixed,
        };
        let Ok(mut g) = self.0.0.lock() else {
            return Ok(unlimited);
        };
        match g.as_mut() {
            Some(s) => s.budget(now),
            None => Ok(unlimited),
        }
    }

    fn describe(&self) -> String {
        self.0
            .0
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(|s| s.describe()))
            .unwrap_or_else(|| "unlimited".to_string())
    }

    fn moves_with_time(&self) -> bool {
        self.0
            .0
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(|s| s.moves_with_time()))
            .unwrap_or(true)
    }
}
