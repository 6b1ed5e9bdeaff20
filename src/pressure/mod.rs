//! Memory pressure: where Molt's budget comes from and what Molt occupies.
//!
//! - [`trace`]: [`Trace`], a budget over the course of one answer, replayed from JSON files in
//!   `traces/` — the reproducible default, keyed by generated-token index.
//! - [`budget`]: the [`BudgetSource`] trait and its three implementations — [`TraceBudget`]
//!   (replay), [`FixedBudget`] (a value set from outside, e.g. the server's `/budget`) and
//!   [`SystemBudget`] (cgroup v1/v2 limits, PSI and `MemAvailable` of the real machine).
//! - [`hog`]: a real child process ([`HogChild`]) that allocates and touches memory on
//!   command, creating genuine pressure that [`SystemBudget`] then observes; [`run_hog`] is the
//!   child's side.
//! - [`footprint`]: measured (never guessed) occupancy — RSS, PSS, the resident pages of one
//!   memory-mapped file, page-cache residency via `mincore` — and the [`Footprint`] record.
//! - [`pages`]: a mapped file's pages released from this process or mapped back in, and a
//!   file's pages dropped from or read into the page cache (standby rungs, the stall bench).
//!
//! All fallible functions return [`PressureError`] (or the narrower [`TraceError`] /
//! [`HogError`], which convert into it).

pub mod budget;
mod error;
pub mod footprint;
pub mod hog;
pub mod pages;
mod procfile;
pub mod trace;

pub use budget::{
    Budget, BudgetOrigin, BudgetSource, CgroupReading, CgroupVersion, DEFAULT_RESERVE_BYTES,
    FixedBudget, FixedBudgetHandle, HogBudget, Psi, SystemBudget, SystemReading, SystemRoots, Tick,
    TraceBudget,
};
pub use error::{HogError, PressureError, TraceError, TraceProblem};
pub use footprint::{
    Footprint, PageCacheResidency, file_resident_in_page_cache, mincore_resident_bytes,
    pmd_mapped_bytes_of_mapping, process_anon_rss_bytes, process_peak_rss_bytes, process_pss_bytes,
    process_rss_bytes, reset_peak_rss, resident_bytes_of_mapping, resident_bytes_of_mappings,
    return_freed_buffers_to_os, rss_bytes_in, trim_heap,
};
pub use hog::{HogChild, HogMemory, HogReport, HogSchedule, HogStep, run_hog, run_hog_with};
pub use trace::{Clock, Trace, TraceRefs, TraceStep, Unit};

/// One mebibyte, the unit traces and the hog speak in.
pub const MIB: u64 = 1 << 20;
