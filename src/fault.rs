//! Fault injection: `MOLT_FAULT=site:nth[,site:nth…]` makes the `nth` pass through a named
//! [`Site`] fail the way the real failure would, so the recovery paths — a destination that
//! will not load mid-switch, a refused KV import, an unreadable anchor, a process killed while
//! it writes a file, a hog child that dies — are exercised on purpose rather than trusted.
//!
//! **Why it is compiled into every build, not behind a cargo feature.** CI builds once, with
//! default features, and the fault tests must run in that build; a feature-gated hook would
//! need a second build of the crate (and of everything that links it). The hook costs one
//! relaxed atomic load per pass through a site while nothing is armed, and every site is on a
//! cold path — a rung load, a state import, an anchor read, a file write, a hog step — never on
//! the per-token path, so an unarmed binary pays nothing measurable. The one risk of shipping
//! it, a stray `MOLT_FAULT` in a user's environment, is loud: every injected failure names
//! itself (`injected fault …`), and a write fault kills the process with a message on stderr.
//!
//! Sites are counted from 1 per process, each on its own counter; [`arm`] replaces the plan
//! (and resets the counters) for in-process tests, which must then run one at a time.

use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A place where a fault can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// Loading the destination rung of a switch (`switch_load`): fails as a refused model.
    SwitchLoad,
    /// Importing a state blob into a context (`kv_import`): fails as llama.cpp refusing it.
    KvImport,
    /// Reading an anchor file (`anchor_read`): fails as an unreadable file.
    AnchorRead,
    /// Writing a file that is renamed into place when complete (`write`): the process is
    /// killed (SIGKILL) with the temporary file cut to half its length, before the rename —
    /// what `kill -9` during fetch, requantize, train-projectors or a lock update leaves.
    Write,
    /// The hog child, when it reaches a target (`hog_exit`): it kills itself (SIGKILL).
    HogExit,
    /// Writing a conversation's state file (`state_write`): as [`Site::Write`], the process is
    /// killed with the temporary file half written, before the rename. A site of its own so a
    /// test can aim at the state file whatever other files the run writes first.
    StateWrite,
    /// Writing a conversation's state file (`state_disk_full`): the write fails with ENOSPC,
    /// as on a full disk; the process lives on.
    StateDiskFull,
}

impl Site {
    /// Every site, in the order reports list them.
    pub const ALL: [Site; 7] = [
        Site::SwitchLoad,
        Site::KvImport,
        Site::AnchorRead,
        Site::Write,
        Site::HogExit,
        Site::StateWrite,
        Site::StateDiskFull,
    ];

    /// The site's name in `MOLT_FAULT`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Site::SwitchLoad => "switch_load",
            Site::KvImport => "kv_import",
            Site::AnchorRead => "anchor_read",
            Site::Write => "write",
            Site::HogExit => "hog_exit",
            Site::StateWrite => "state_write",
            Site::StateDiskFull => "state_disk_full",
        }
    }

    fn index(self) -> usize {
        match self {
            Site::SwitchLoad => 0,
            Site::KvImport => 1,
            Site::AnchorRead => 2,
            Site::Write => 3,
            Site::HogExit => 4,
            Site::StateWrite => 5,
            Site::StateDiskFull => 6,
        }
    }
}

/// A `MOLT_FAULT` value that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "MOLT_FAULT {text:?}: {reason} (expected site:nth[,site:nth…], sites: switch_load, kv_import, anchor_read, write, hog_exit, state_write, state_disk_full)"
)]
pub struct FaultSpecError {
    /// The value as given.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Which pass of each site fails (0: never).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Plan {
    nth: [u64; 7],
}

impl Plan {
    /// Parses `site:nth[,site:nth…]`.
    ///
    /// # Errors
    /// [`FaultSpecError`] for an unknown site or an `nth` that is not a positive integer.
    pub fn parse(text: &str) -> Result<Plan, FaultSpecError> {
        let bad = |reason: String| FaultSpecError {
            text: text.to_owned(),
            reason,
        };
        let mut plan = Plan::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, nth) = part.split_once(':').unwrap_or((part, "1"));
            let site = Site::ALL
                .into_iter()
                .find(|s| s.name() == name.trim())
                .ok_or_else(|| bad(format!("unknown site {name:?}")))?;
            let nth: u64 = nth
                .trim()
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("{nth:?} is not a positive pass number")))?;
            plan.nth[site.index()] = nth;
        }
        Ok(plan)
    }

    /// The plan that fails pass `nth` of `site`.
    #[must_use]
    pub fn at(site: Site, nth: u64) -> Plan {
        let mut plan = Plan::default();
        plan.nth[site.index()] = nth;
        plan
    }

    fn is_empty(&self) -> bool {
        self.nth.iter().all(|&n| n == 0)
    }
}

/// Fast path: false while no plan is armed, so an unarmed site costs one atomic load.
static ARMED: AtomicBool = AtomicBool::new(false);
static PLAN: Mutex<Option<Plan>> = Mutex::new(None);
static PASSES: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];
static FROM_ENV: std::sync::Once = std::sync::Once::new();

fn load_env() {
    FROM_ENV.call_once(|| {
        let Some(text) = std::env::var_os("MOLT_FAULT") else {
            return;
        };
        match Plan::parse(&text.to_string_lossy()) {
            Ok(plan) => install(Some(plan)),
            // A bad spec must not go unnoticed: a test that thinks it injects a fault and
            // does not would pass for the wrong reason.
            Err(e) => {
                eprintln!("molt: {e}");
                std::process::exit(2);
            }
        }
    });
}

fn install(plan: Option<Plan>) {
    let plan = plan.filter(|p| !p.is_empty());
    for c in &PASSES {
        c.store(0, Ordering::SeqCst);
    }
    let armed = plan.is_some();
    *PLAN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = plan;
    ARMED.store(armed, Ordering::SeqCst);
}

/// Replaces the plan (`None`: disarm) and resets every site's count; the environment is not
/// read afterwards. For in-process tests, which must hold a lock of their own while armed.
pub fn arm(plan: Option<Plan>) {
    FROM_ENV.call_once(|| {});
    install(plan);
}

/// Counts a pass through `site`; true when this pass is the one the plan fails.
#[must_use]
pub fn hit(site: Site) -> bool {
    load_env();
    if !ARMED.load(Ordering::Relaxed) {
        return false;
    }
    let nth = PLAN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .map_or(0, |p| p.nth[site.index()]);
    if nth == 0 {
        return false;
    }
    PASSES[site.index()].fetch_add(1, Ordering::SeqCst) + 1 == nth
}

/// The detail an injected failure reports.
#[must_use]
pub fn detail(site: Site) -> String {
    format!("injected fault (MOLT_FAULT {})", site.name())
}

/// At a [`Site::Write`] pass that the plan fails: cuts `partial` (the temporary a writer is
/// about to rename into place) to half its length and kills the process with SIGKILL — no
/// destructor, no cleanup, exactly what `kill -9` mid-write leaves behind. Otherwise nothing.
pub fn die_mid_write(partial: &Path) {
    die_mid_write_at(Site::Write, partial);
}

/// [`die_mid_write`] counted on `site` instead of [`Site::Write`].
pub fn die_mid_write_at(site: Site, partial: &Path) {
    if !hit(site) {
        return;
    }
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(partial)
        && let Ok(m) = f.metadata()
    {
        let _ = f.set_len(m.len() / 2);
        let _ = f.sync_all();
    }
    eprintln!(
        "molt: {} while writing {}: killing the process",
        detail(site),
        partial.display()
    );
    kill_self();
}

/// Serialises in-process tests that [`arm`] a plan: the plan and counters are global.
#[cfg(test)]
pub(crate) fn test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Kills this process with SIGKILL (nothing runs after it).
pub fn kill_self() -> ! {
    // SAFETY: kill(2) on our own pid with a valid signal number has no memory-safety
    // preconditions; SIGKILL cannot be caught, so the call does not return.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_refuse_by_name() {
        assert_eq!(
            Plan::parse("kv_import:2, write").unwrap(),
            Plan {
                nth: [0, 2, 0, 1, 0, 0, 0]
            }
        );
        assert!(
            Plan::parse("kv_imprt:1")
                .unwrap_err()
                .reason
                .contains("kv_imprt")
        );
        assert!(Plan::parse("write:0").is_err());
        assert!(Plan::parse("").unwrap().is_empty());
    }
}
