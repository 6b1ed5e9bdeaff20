//! Budget sources: how many bytes Molt may occupy right now.
//!
//! The session asks a [`BudgetSource`] once between two tokens, passing the current [`Tick`],
//! and gets a [`Budget`]. Four sources:
//!
//! - [`TraceBudget`] replays a [`Trace`] — reproducible, the default for benchmarks.
//! - [`FixedBudget`] holds a value set from elsewhere through a cloneable
//!   [`FixedBudgetHandle`] (the server's `/budget` endpoint, an interactive command).
//! - [`HogBudget`] makes a trace real: a child process allocates what the trace says others
//!   take, and the budget is read back from the operating system.
//! - [`SystemBudget`] reads the real machine: the cgroup the process lives in (v2
//!   `memory.max` / `memory.high` / `memory.current`, or v1 `memory.limit_in_bytes` /
//!   `memory.usage_in_bytes`, every ancestor included), `/proc/meminfo` `MemAvailable`, and
//!   PSI from `/proc/pressure/memory`. Its `/proc` and `/sys` roots are injectable
//!   ([`SystemRoots`]) so tests run against fake files.
//!
//! # How the system budget is computed
//!
//! The budget is the total Molt may occupy, *including* what it already holds — otherwise
//! Molt's own growth would read as shrinking budget. So Molt's own resident set is added back
//! to each headroom:
//!
//! ```text
//! cgroup   = min over the cgroup and its ancestors of (limit − usage) + own RSS
//!            where limit = min(memory.max, memory.high) on v2, memory.limit_in_bytes on v1
//! machine  = MemAvailable + own RSS
//! budget   = min(cgroup, machine) − reserve          (reserve: DEFAULT_RESERVE_BYTES)
//! ```
//!
//! `memory.high` counts as a limit because the kernel throttles and reclaims hard above it.
//! Unlimited levels (`max`, or v1's ~2^63 sentinel) and missing files are skipped. The
//! reserve keeps room for the allocator, the tokenizer, the server and page-cache churn; 256
//! MiB is a guess at that slack on a laptop, made a parameter for that reason.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::procfile::{self, Limit};
use super::{MIB, PressureError, Trace};

/// When a budget is asked for: a point in the answer being generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Tick {
    /// Index of the token about to be generated (0 before the first).
    pub token_index: u64,
    /// Milliseconds since the answer started.
    pub elapsed_ms: u64,
}

/// Which kind of source produced a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetOrigin {
    /// A replayed [`Trace`].
    Trace,
    /// A value set from outside ([`FixedBudget`]).
    Fixed,
    /// The real system ([`SystemBudget`]).
    System,
}

/// A budget reading.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    /// Bytes Molt may occupy in total.
    pub bytes: u64,
    /// How squeezed memory is, 0 (not at all) to 1: `1 − bytes / initial` for replayed and
    /// fixed budgets; for the system the larger of that and PSI `some avg10`.
    pub pressure: f64,
    /// Where the reading came from.
    pub origin: BudgetOrigin,
}

/// Something that says how much memory Molt may use. Object safe: the session holds a
/// `Box<dyn BudgetSource + Send>`.
pub trait BudgetSource {
    /// The budget at `now`.
    ///
    /// # Errors
    ///
    /// Sources that read the system fail with [`PressureError::Io`],
    /// [`PressureError::Parse`] or [`PressureError::NoMemoryInfo`]; replayed and fixed
    /// budgets never fail.
    fn budget(&mut self, now: Tick) -> Result<Budget, PressureError>;

    /// One line for logs and results JSON, e.g. `trace spike_mid_answer (token clock, 2 steps)`.
    fn describe(&self) -> String;

    /// Whether the budget can change while no token is generated. A parked answer waits on
    /// the wall clock for memory to return; a source keyed by the answer's own token count
    /// (a token-clock trace) never would, so the session refuses to wait on it.
    fn moves_with_time(&self) -> bool {
        true
    }
}

/// `1 − bytes / reference`, clamped to `[0, 1]`; 0 when the reference is 0.
fn squeeze(bytes: u64, reference: u64) -> f64 {
    if reference == 0 {
        return 0.0;
    }
    #[expect(
        clippy::cast_precision_loss,
        reason = "a ratio; f64 rounding of byte counts is irrelevant here"
    )]
    let ratio = bytes as f64 / reference as f64;
    (1.0 - ratio).clamp(0.0, 1.0)
}

/// Replays a [`Trace`].
#[derive(Debug, Clone)]
pub struct TraceBudget {
    trace: Trace,
}

impl TraceBudget {
    /// Replays `trace`.
    #[must_use]
    pub fn new(trace: Trace) -> TraceBudget {
        TraceBudget { trace }
    }

    /// The trace being replayed.
    #[must_use]
    pub fn trace(&self) -> &Trace {
        &self.trace
    }
}

impl BudgetSource for TraceBudget {
    fn budget(&mut self, now: Tick) -> Result<Budget, PressureError> {
        let bytes = self.trace.budget_at(now.token_index, now.elapsed_ms);
        Ok(Budget {
            bytes,
            pressure: squeeze(bytes, self.trace.initial_bytes),
            origin: BudgetOrigin::Trace,
        })
    }

    fn describe(&self) -> String {
        let clock = match self.trace.clock {
            super::Clock::Token => "token",
            super::Clock::Ms => "ms",
        };
        format!(
            "trace {} ({clock} clock, {} steps, initial {} MiB)",
            self.trace.name,
            self.trace.steps.len(),
            self.trace.initial_bytes / MIB
        )
    }

    fn moves_with_time(&self) -> bool {
        self.trace.clock == super::Clock::Ms
    }
}

/// A budget set from outside through a [`FixedBudgetHandle`].
#[derive(Debug, Clone)]
pub struct FixedBudget {
    cell: Arc<AtomicU64>,
    initial: u64,
}

/// Sets the value a [`FixedBudget`] reports; cheap to clone and `Send + Sync`.
#[derive(Debug, Clone)]
pub struct FixedBudgetHandle {
    cell: Arc<AtomicU64>,
}

impl FixedBudget {
    /// A budget of `bytes` until changed; pressure is measured against this first value.
    #[must_use]
    pub fn new(bytes: u64) -> FixedBudget {
        FixedBudget {
            cell: Arc::new(AtomicU64::new(bytes)),
            initial: bytes,
        }
    }

    /// A handle that changes this budget.
    #[must_use]
    pub fn handle(&self) -> FixedBudgetHandle {
        FixedBudgetHandle {
            cell: Arc::clone(&self.cell),
        }
    }
}

impl FixedBudgetHandle {
    /// Sets the budget; the next [`BudgetSource::budget`] call sees it.
    pub fn set(&self, bytes: u64) {
        self.cell.store(bytes, Ordering::Release);
    }

    /// The current value.
    #[must_use]
    pub fn get(&self) -> u64 {
        self.cell.load(Ordering::Acquire)
    }
}

impl BudgetSource for FixedBudget {
    fn budget(&mut self, _now: Tick) -> Result<Budget, PressureError> {
        let bytes = self.cell.load(Ordering::Acquire);
        Ok(Budget {
            bytes,
            pressure: squeeze(bytes, self.initial),
            origin: BudgetOrigin::Fixed,
        })
    }

    fn describe(&self) -> String {
        format!(
            "fixed {} MiB (initially {} MiB)",
            self.cell.load(Ordering::Acquire) / MIB,
            self.initial / MIB
        )
    }
}

/// Default bytes held back from the system budget: 256 MiB (see the module docs).
pub const DEFAULT_RESERVE_BYTES: u64 = 256 * MIB;

/// Where [`SystemBudget`] finds `/proc` and `/sys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemRoots {
    /// Stands for `/proc`; `self/status`, `self/cgroup`, `meminfo` and `pressure/memory`
    /// are read under it.
    pub proc_root: PathBuf,
    /// Stands for `/sys`; cgroups are looked for under `fs/cgroup`.
    pub sys_root: PathBuf,
}

impl Default for SystemRoots {
    fn default() -> Self {
        SystemRoots {
            proc_root: PathBuf::from("/proc"),
            sys_root: PathBuf::from("/sys"),
        }
    }
}

/// Which cgroup hierarchy a reading came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupVersion {
    /// Legacy per-controller hierarchy (`memory.limit_in_bytes`).
    V1,
    /// Unified hierarchy (`memory.max`).
    V2,
}

/// The binding level of the process's memory cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupReading {
    /// Hierarchy version.
    pub version: CgroupVersion,
    /// The process's own cgroup directory.
    pub dir: PathBuf,
    /// The cgroup (own or ancestor) whose limit leaves the least headroom; `None` when no
    /// level is limited.
    pub binding_dir: Option<PathBuf>,
    /// That level's effective limit in bytes.
    pub limit_bytes: Option<u64>,
    /// That level's usage in bytes.
    pub usage_bytes: Option<u64>,
    /// `limit − usage` at that level (0 when over the limit).
    pub headroom_bytes: Option<u64>,
}

/// Pressure stall information for memory (percent of time, 10 s average).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Psi {
    /// Share of time at least one task stalled on memory, percent.
    pub some_avg10: f64,
    /// Share of time all non-idle tasks stalled on memory, percent.
    pub full_avg10: f64,
}

/// Everything [`SystemBudget`] read, for logs and results JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SystemReading {
    /// The cgroup reading, when a memory cgroup was found.
    pub cgroup: Option<CgroupReading>,
    /// `MemAvailable` in bytes, when `/proc/meminfo` has it.
    pub mem_available_bytes: Option<u64>,
    /// `MemTotal` in bytes, when `/proc/meminfo` has it.
    pub mem_total_bytes: Option<u64>,
    /// Molt's own resident set (`VmRSS`).
    pub own_rss_bytes: u64,
    /// Memory PSI, when the kernel exposes it.
    pub psi: Option<Psi>,
    /// Bytes held back.
    pub reserve_bytes: u64,
}

impl SystemReading {
    /// `min(cgroup headroom, MemAvailable) + own RSS − reserve`; `None` when neither bound
    /// is known.
    #[must_use]
    pub fn budget_bytes(&self) -> Option<u64> {
        let cgroup = self.cgroup.as_ref().and_then(|c| c.headroom_bytes);
        let headroom = match (cgroup, self.mem_available_bytes) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return None,
        };
        Some(
            headroom
                .saturating_add(self.own_rss_bytes)
                .saturating_sub(self.reserve_bytes),
        )
    }
}

/// The real system's budget (see the module docs for the formula).
#[derive(Debug, Clone)]
pub struct SystemBudget {
    roots: SystemRoots,
    reserve_bytes: u64,
    baseline: Option<u64>,
}

impl Default for SystemBudget {
    fn default() -> Self {
        SystemBudget::new()
    }
}

impl SystemBudget {
    /// Reads the real `/proc` and `/sys`, reserving [`DEFAULT_RESERVE_BYTES`].
    #[must_use]
    pub fn new() -> SystemBudget {
        SystemBudget::with_roots(SystemRoots::default())
    }

    /// Reads under `roots` instead (tests, containers with relocated mounts).
    #[must_use]
    pub fn with_roots(roots: SystemRoots) -> SystemBudget {
        SystemBudget {
            roots,
            reserve_bytes: DEFAULT_RESERVE_BYTES,
            baseline: None,
        }
    }

    /// Holds back `bytes` instead of the default reserve.
    #[must_use]
    pub fn with_reserve(mut self, bytes: u64) -> SystemBudget {
        self.reserve_bytes = bytes;
        self
    }

    /// Reads every input of the budget once.
    ///
    /// # Errors
    ///
    /// [`PressureError::Io`] / [`PressureError::Parse`] when `self/status` has no readable
    /// `VmRSS`, or a present cgroup, meminfo or PSI file cannot be read or parsed. Absent
    /// optional files are not errors.
    pub fn read(&self) -> Result<SystemReading, PressureError> {
        let proc_root = &self.roots.proc_root;
        let status_path = proc_root.join("self/status");
        let own_rss_bytes = procfile::kib_field_bytes(&procfile::read(&status_path)?, "VmRSS")
            .ok_or(PressureError::Parse {
                path: status_path,
                what: "VmRSS",
            })?;

        let meminfo_path = proc_root.join("meminfo");
        let (mem_available_bytes, mem_total_bytes) = match procfile::read_optional(&meminfo_path)? {
            Some(text) => (
                procfile::kib_field_bytes(&text, "MemAvailable"),
                procfile::kib_field_bytes(&text, "MemTotal"),
            ),
            None => (None, None),
        };

        let psi_path = proc_root.join("pressure/memory");
        // PSI is advisory: kernels built without it, or with it disabled, fail the read with
        // EOPNOTSUPP rather than ENOENT. Only malformed content is an error.
        let psi = match std::fs::read_to_string(&psi_path) {
            Ok(text) => Some(parse_psi(&text).ok_or(PressureError::Parse {
                path: psi_path,
                what: "memory PSI `some avg10=` and `full avg10=`",
            })?),
            Err(_) => None,
        };

        Ok(SystemReading {
            cgroup: self.read_cgroup()?,
            mem_available_bytes,
            mem_total_bytes,
            own_rss_bytes,
            psi,
            reserve_bytes: self.reserve_bytes,
        })
    }

    fn read_cgroup(&self) -> Result<Option<CgroupReading>, PressureError> {
        let cgroup_path = self.roots.proc_root.join("self/cgroup");
        let Some(text) = procfile::read_optional(&cgroup_path)? else {
            return Ok(None);
        };
        let (v2_path, v1_path) = parse_proc_cgroup(&text);
        let base = self.roots.sys_root.join("fs/cgroup");
        if let Some(path) = v2_path {
            // Pure v2 mounts the hierarchy at /sys/fs/cgroup; hybrid systems at .../unified,
            // where the memory controller is usually absent (it lives in v1 then).
            for mount in [base.clone(), base.join("unified")] {
                if !mount.join("cgroup.controllers").is_file() {
                    continue;
                }
                let dir = resolve_dir(&mount, &path);
                if dir.join("memory.current").is_file() || dir.join("memory.max").is_file() {
                    return read_levels(CgroupVersion::V2, &mount, &dir).map(Some);
                }
            }
        }
        if let Some(path) = v1_path {
            let mount = base.join("memory");
            if mount.is_dir() {
                let dir = resolve_dir(&mount, &path);
                return read_levels(CgroupVersion::V1, &mount, &dir).map(Some);
            }
        }
        Ok(None)
    }
}

impl BudgetSource for SystemBudget {
    fn budget(&mut self, _now: Tick) -> Result<Budget, PressureError> {
        let reading = self.read()?;
        let bytes = reading
            .budget_bytes()
            .ok_or_else(|| PressureError::NoMemoryInfo {
                proc_root: self.roots.proc_root.clone(),
                sys_root: self.roots.sys_root.clone(),
            })?;
        let baseline = *self.baseline.get_or_insert(bytes);
        let psi = reading
            .psi
            .map_or(0.0, |p| (p.some_avg10 / 100.0).clamp(0.0, 1.0));
        Ok(Budget {
            bytes,
            pressure: squeeze(bytes, baseline).max(psi),
            origin: BudgetOrigin::System,
        })
    }

    fn describe(&self) -> String {
        format!(
            "system (cgroup + MemAvailable under {} and {}, reserve {} MiB)",
            self.roots.proc_root.display(),
            self.roots.sys_root.display(),
            self.reserve_bytes / MIB
        )
    }
}

/// Genuine pressure, replayed: a `HogChild` allocates and touches what a [`Trace`] says the
/// rest of the device takes, and the budget is read back from the operating system.
///
/// A trace budgets Molt for a device of `ceiling` bytes (by default the trace's initial
/// budget). At each reading the hog is steered to hold `ceiling − trace budget` (and waited
/// for: its pages are touched before the budget is read), then
///
/// ```text
/// budget = min(ceiling − (hog RSS − hog RSS at start),  SystemBudget)
/// ```
///
/// with the hog's RSS read from `/proc/<pid>/status` — what it really holds, late or short if
/// the kernel made it so; its own code and libraries, resident before it allocated anything,
/// are not counted as taken — and [`SystemBudget`] (cgroup, `MemAvailable`, PSI) still bounding
/// it from the real machine. On a machine or cgroup the size of the device, the system term
/// alone binds and the same run is pressure end to end; on a larger shared machine the ceiling
/// stands in for the device without having to take the whole machine's memory away from
/// everyone else. Pressure is the larger of the squeeze below the ceiling and PSI.
#[derive(Debug)]
pub struct HogBudget {
    hog: super::HogChild,
    trace: Trace,
    ceiling_bytes: u64,
    system: SystemBudget,
    held_mib: Option<u64>,
    /// How long the last steering took (allocating and touching), ms.
    last_steer_ms: f64,
    /// The hog's RSS before it allocated anything (its code and libraries): not memory taken
    /// from the device.
    hog_base_rss: u64,
}

/// How long the hog may take to reach a target (allocate and touch gigabytes).
const HOG_STEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

impl HogBudget {
    /// Starts the hog (`program args…`, a process running [`super::run_hog`]) and binds it to
    /// `trace` under `ceiling_bytes` (`None`: the trace's initial budget).
    ///
    /// # Errors
    /// [`super::HogError`] if the child cannot be started or does not report ready.
    pub fn spawn<I, S>(
        program: &Path,
        args: I,
        trace: Trace,
        ceiling_bytes: Option<u64>,
    ) -> Result<HogBudget, super::HogError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let hog = super::HogChild::spawn(program, args)?;
        let hog_base_rss = hog.rss_bytes().unwrap_or(0);
        let ceiling_bytes = ceiling_bytes.unwrap_or(trace.initial_bytes);
        Ok(HogBudget {
            hog,
            trace,
            ceiling_bytes,
            system: SystemBudget::new(),
            held_mib: None,
            last_steer_ms: 0.0,
            hog_base_rss,
        })
    }

    /// The hog's process id.
    #[must_use]
    pub fn hog_pid(&self) -> u32 {
        self.hog.pid()
    }

    /// MiB the hog was last told to hold.
    #[must_use]
    pub fn held_mib(&self) -> Option<u64> {
        self.held_mib
    }

    /// How long the last change of the hog's size took, ms.
    #[must_use]
    pub fn last_steer_ms(&self) -> f64 {
        self.last_steer_ms
    }
}

impl BudgetSource for HogBudget {
    fn budget(&mut self, now: Tick) -> Result<Budget, PressureError> {
        let want = self.trace.budget_at(now.token_index, now.elapsed_ms);
        let mib = self.ceiling_bytes.saturating_sub(want).div_ceil(MIB);
        if self.held_mib != Some(mib) {
            let t0 = std::time::Instant::now();
            self.hog.set_target_mib_and_wait(mib, HOG_STEER_TIMEOUT)?;
            self.last_steer_ms = t0.elapsed().as_secs_f64() * 1e3;
            self.held_mib = Some(mib);
        }
        let taken = self.hog.rss_bytes()?.saturating_sub(self.hog_base_rss);
        let reading = self.system.read()?;
        let device = self.ceiling_bytes.saturating_sub(taken);
        let bytes = reading.budget_bytes().map_or(device, |sys| sys.min(device));
        let psi = reading
            .psi
            .map_or(0.0, |p| (p.some_avg10 / 100.0).clamp(0.0, 1.0));
        Ok(Budget {
            bytes,
            pressure: squeeze(bytes, self.ceiling_bytes).max(psi),
            origin: BudgetOrigin::System,
        })
    }

    fn describe(&self) -> String {
        format!(
            "real hog (pid {}) following trace {} under a {} MiB device; budget = min(device - hog RSS, system)",
            self.hog.pid(),
            self.trace.name,
            self.ceiling_bytes / MIB
        )
    }

    fn moves_with_time(&self) -> bool {
        // The hog follows the trace's clock; a token clock holds it still while parked.
        self.trace.clock == super::Clock::Ms
    }
}

/// `(v2 path, v1 memory path)` from `/proc/self/cgroup` lines `id:controllers:path`.
fn parse_proc_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let mut v2 = None;
    let mut v1 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path.to_owned());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_owned());
        }
    }
    (v2, v1)
}

/// The directory of cgroup `path` under `mount`. In a container with a cgroup namespace
/// the mount is rooted at the container's cgroup while the path may still name it from the
/// host root; when the full path does not exist, leading components are dropped until it
/// does, ending at the mount itself.
fn resolve_dir(mount: &Path, path: &str) -> PathBuf {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    for skip in 0..=parts.len() {
        let dir = parts[skip..]
            .iter()
            .fold(mount.to_path_buf(), |d, p| d.join(p));
        if dir.is_dir() {
            return dir;
        }
    }
    mount.to_path_buf()
}

/// Walks from `dir` up to `mount` (inclusive) and keeps the level with the least headroom.
fn read_levels(
    version: CgroupVersion,
    mount: &Path,
    dir: &Path,
) -> Result<CgroupReading, PressureError> {
    let mut reading = CgroupReading {
        version,
        dir: dir.to_path_buf(),
        binding_dir: None,
        limit_bytes: None,
        usage_bytes: None,
        headroom_bytes: None,
    };
    let mut level = Some(dir);
    while let Some(here) = level {
        if let Some((limit, usage)) = read_level(version, here)? {
            let headroom = limit.saturating_sub(usage);
            if reading.headroom_bytes.is_none_or(|h| headroom < h) {
                reading.binding_dir = Some(here.to_path_buf());
                reading.limit_bytes = Some(limit);
                reading.usage_bytes = Some(usage);
                reading.headroom_bytes = Some(headroom);
            }
        }
        if here == mount {
            break;
        }
        level = here.parent().filter(|p| p.starts_with(mount));
    }
    Ok(reading)
}

/// `(effective limit, usage)` of one cgroup directory, or `None` when it is unlimited or
/// does not expose both.
fn read_level(version: CgroupVersion, dir: &Path) -> Result<Option<(u64, u64)>, PressureError> {
    let (limit_files, usage_file): (&[&str], &str) = match version {
        CgroupVersion::V2 => (&["memory.max", "memory.high"], "memory.current"),
        CgroupVersion::V1 => (&["memory.limit_in_bytes"], "memory.usage_in_bytes"),
    };
    let mut limit: Option<u64> = None;
    for name in limit_files {
        let path = dir.join(name);
        let Some(text) = procfile::read_optional(&path)? else {
            continue;
        };
        match procfile::parse_limit(&text) {
            Some(Limit::Unlimited) => {}
            Some(Limit::Bytes(b)) => limit = Some(limit.map_or(b, |l| l.min(b))),
            None => {
                return Err(PressureError::Parse {
                    path,
                    what: "a byte count or `max`",
                });
            }
        }
    }
    let Some(limit) = limit else {
        return Ok(None);
    };
    let usage_path = dir.join(usage_file);
    let Some(text) = procfile::read_optional(&usage_path)? else {
        return Ok(None);
    };
    let usage = text
        .trim()
        .parse::<u64>()
        .map_err(|_| PressureError::Parse {
            path: usage_path,
            what: "a byte count",
        })?;
    Ok(Some((limit, usage)))
}

fn parse_psi(text: &str) -> Option<Psi> {
    let avg10 = |kind: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(kind))?;
        let field = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("avg10="))?;
        field.parse().ok()
    };
    Some(Psi {
        some_avg10: avg10("some ")?,
        // `full` appeared in memory PSI from the start, but treat its absence as no stall.
        full_avg10: avg10("full ").unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests;
