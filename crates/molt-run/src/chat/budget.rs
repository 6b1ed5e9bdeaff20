//! The chat's budget: a base source — the real system by default, or a replayed trace — under
//! an optional cap the user types (`/budget 900`).
//!
//! The cap can only take memory away: the budget is `min(base, cap)`, because typing a number
//! cannot give the machine memory it does not have (on a roomy laptop the cap is what you see;
//! under real pressure the system still wins). Base and cap are changed from the input thread
//! while the worker thread's session reads the budget before every token, so both sit behind
//! one mutex held only for a reading.
//!
//! Pressure: the base's own pressure (a trace's squeeze, the system's squeeze or PSI), or, when
//! the cap binds, `1 − cap / reference`, where the reference is the base's first reading — the
//! share of what the machine offered at the start that the cap takes away.

use molt::pressure::{Budget, BudgetOrigin, BudgetSource, MIB, PressureError, Tick};
use std::sync::{Arc, Mutex, PoisonError};

/// One reading, kept for `/status`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// What the session got.
    pub budget: Budget,
    /// What the base said.
    pub base_bytes: u64,
    /// The cap in force.
    pub cap: Option<u64>,
    /// Token index of the answer at which it was read.
    pub token_index: u64,
}

struct State {
    base: Box<dyn BudgetSource + Send>,
    cap: Option<u64>,
    reference: Option<u64>,
    last: Option<Reading>,
}

/// Shared control over the chat's budget.
#[derive(Clone)]
pub struct BudgetControl {
    state: Arc<Mutex<State>>,
}

impl BudgetControl {
    /// A budget following `base`, uncapped.
    pub fn new(base: Box<dyn BudgetSource + Send>) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                base,
                cap: None,
                reference: None,
                last: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the base (`/trace FILE`, `/trace off`); the cap stays.
    pub fn set_base(&self, base: Box<dyn BudgetSource + Send>) {
        let mut s = self.lock();
        s.base = base;
        s.reference = None;
        s.last = None;
    }

    /// Sets or lifts the cap; the session sees it before its next token.
    pub fn set_cap(&self, cap: Option<u64>) {
        self.lock().cap = cap;
    }

    /// The last reading the session took, if any.
    pub fn last(&self) -> Option<Reading> {
        self.lock().last
    }

    /// Reads now, as the session would before the first token of an answer.
    ///
    /// # Errors
    /// The base's error (the system's files unreadable).
    pub fn read_now(&self) -> Result<Reading, PressureError> {
        read(&mut self.lock(), Tick::default())
    }

    /// What the base is, for messages.
    pub fn describe_base(&self) -> String {
        self.lock().base.describe()
    }

    /// A source for the session.
    pub fn source(&self) -> ChatBudget {
        ChatBudget(self.clone())
    }
}

fn read(s: &mut State, now: Tick) -> Result<Reading, PressureError> {
    let b = s.base.budget(now)?;
    let reference = *s.reference.get_or_insert(b.bytes);
    let budget = match s.cap {
        Some(cap) if cap < b.bytes => Budget {
            bytes: cap,
            pressure: b.pressure.max(squeeze(cap, reference)),
            origin: BudgetOrigin::Fixed,
        },
        _ => b,
    };
    let r = Reading {
        budget,
        base_bytes: b.bytes,
        cap: s.cap,
        token_index: now.token_index,
    };
    s.last = Some(r);
    Ok(r)
}

fn squeeze(bytes: u64, reference: u64) -> f64 {
    if reference == 0 {
        return 0.0;
    }
    #[allow(clippy::cast_precision_loss)]
    let ratio = bytes as f64 / reference as f64;
    (1.0 - ratio).clamp(0.0, 1.0)
}

/// The session's side of a [`BudgetControl`].
pub struct ChatBudget(BudgetControl);

impl BudgetSource for ChatBudget {
    fn budget(&mut self, now: Tick) -> Result<Budget, PressureError> {
        read(&mut self.0.lock(), now).map(|r| r.budget)
    }

    fn describe(&self) -> String {
        let s = self.0.lock();
        match s.cap {
            Some(c) => format!("{} capped at {}", s.base.describe(), fmt_bytes(c)),
            None => s.base.describe(),
        }
    }
}

/// Parses a size typed by the user: a number of MiB (`900`, `1.5`), or a number with a unit —
/// `B`, `K`/`KiB`, `M`/`MiB`, `G`/`GiB` (`KB`/`MB`/`GB` are read as the binary units too).
///
/// # Errors
/// A message saying what was expected.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit_bytes: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "m" | "mib" | "mb" => MIB,
        "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "g" | "gib" | "gb" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {t:?}: give MiB (900), or a number with B, K, M or G"
            ));
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{t:?} is not a size: give MiB (900), or e.g. 1.5G"))?;
    #[allow(clippy::cast_precision_loss)]
    let bytes = value * unit_bytes as f64;
    if !(1.0..=1e18).contains(&bytes) {
        return Err(format!("{t:?} is outside 1 B ..= 1 EB"));
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(bytes.round() as u64)
}

/// Bytes for people: `812 KiB`, `1200 MiB`, `21.7 GiB`.
pub fn fmt_bytes(b: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let f = b as f64;
    if b >= 16 << 30 {
        format!("{:.1} GiB", f / f64::from(1u32 << 30))
    } else if b >= 10 * MIB {
        format!("{:.0} MiB", f / MIB as f64)
    } else if b >= MIB {
        format!("{:.2} MiB", f / MIB as f64)
    } else {
        format!("{:.0} KiB", f / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use molt::pressure::FixedBudget;

    #[test]
    fn sizes_parse_as_mib_by_default() {
        assert_eq!(parse_size("900"), Ok(900 * MIB));
        assert_eq!(parse_size(" 1.5G "), Ok(3 * (1 << 29)));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("2 MiB"), Ok(2 * MIB));
        assert_eq!(parse_size("100b"), Ok(100));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("-5").is_err());
    }

    #[test]
    fn the_cap_only_takes_memory_away() {
        let base = FixedBudget::new(1000 * MIB);
        let handle = base.handle();
        let c = BudgetControl::new(Box::new(base));
        let mut src = c.source();
        let t = Tick::default();
        assert_eq!(src.budget(t).unwrap().bytes, 1000 * MIB);
        c.set_cap(Some(250 * MIB));
        let b = src.budget(t).unwrap();
        assert_eq!(b.bytes, 250 * MIB);
        assert!((b.pressure - 0.75).abs() < 1e-9, "{}", b.pressure);
        assert_eq!(b.origin, BudgetOrigin::Fixed);
        // A cap above the base does not add memory.
        c.set_cap(Some(4000 * MIB));
        assert_eq!(src.budget(t).unwrap().bytes, 1000 * MIB);
        // The base moving below the cap wins.
        c.set_cap(Some(800 * MIB));
        handle.set(600 * MIB);
        let r = c.read_now().unwrap();
        assert_eq!((r.budget.bytes, r.base_bytes), (600 * MIB, 600 * MIB));
        c.set_cap(None);
        handle.set(1000 * MIB);
        assert_eq!(src.budget(t).unwrap().bytes, 1000 * MIB);
        assert!(src.describe().starts_with("fixed"));
    }

    #[test]
    fn bytes_print_for_people() {
        assert_eq!(fmt_bytes(812 << 10), "812 KiB");
        assert_eq!(fmt_bytes(1200 * MIB), "1200 MiB");
        assert_eq!(fmt_bytes(3 * MIB / 2), "1.50 MiB");
        assert_eq!(fmt_bytes(22 << 30), "22.0 GiB");
    }
}
