//! Benchmark programs. Every number on the results page comes from JSON these write under
//! `results/`; nothing is timed inside tests (the machines are shared and noisy, so the
//! benchmarks compare ratios measured side by side in one run, with repetitions).
//!
//! - [`conditions`]: arms A–D and the ablations of D under one pressure trace, every event
//!   logged, every metric of the design computed ([`metrics`] holds the measures).
//! - [`cost_sweep`]: transplant against re-prefill per route and context length.
//! - [`serve_qos`]: the `QoS` bench — conversations of two classes through the real server
//!   (`molt-run serve` as a child process) under one moving budget, the scheduler's plan
//!   applied by the server's own loop; [`serve_aside`]: one answer set aside for another.
//! - [`footprint`]: what each rung occupies per context length, measured by the OS beside the
//!   policy's model, and what parking gives back.
//! - [`speed`]: prefill/decode tok/s per rung, Molt's engine beside plain llama.cpp.
//! - [`precision`]: the candidates for precision rungs — size, footprint, speed, their own
//!   answers judged by the largest rung, recall after a switch to them.
//! - [`stall`]: the gap a user sees at a switch, every route, warm and cold page cache.
//! - [`reliability`]: the soak (switches in one process, RSS and descriptor slopes) and
//!   `results/reliability.json` (fuzz, faults, soak, probes).
//! - [`figures`] and [`page`]: PNG figures and the results page, generated from the JSON.

pub mod bill;
pub mod conditions;
pub mod cost_sweep;
pub mod families;
pub mod figures;
pub mod footprint;
pub mod metrics;
pub mod page;
pub mod precision;
pub mod recall;
pub mod reliability;
pub mod sampling;
pub mod serve_aside;
pub mod serve_qos;
pub mod speed;
pub mod stall;

use std::path::PathBuf;

/// Errors of the benchmark programs.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A session failed.
    #[error(transparent)]
    Session(#[from] molt::session::SessionError),
    /// llama.cpp failed on a rung the benchmark drives directly (judge, native reference).
    #[error("rung {rung}: {source}")]
    Engine {
        /// Rung name.
        rung: String,
        /// The engine error.
        source: molt::engine::EngineError,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A results file does not parse.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A prompt file entry is malformed.
    #[error("{path}:{line}: {message}")]
    Prompts {
        /// The file.
        path: PathBuf,
        /// 1-based line (0: the file as a whole).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// Options that cannot work together, or a missing projector.
    #[error("{0}")]
    Config(String),
    /// A figure could not be drawn.
    #[error("figure {figure}: {message}")]
    Figure {
        /// Which figure.
        figure: String,
        /// The drawing backend's error.
        message: String,
    },
}

/// Facts about the machine and build, stored beside every result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunInfo {
    /// When the run started (seconds since the epoch).
    pub started_unix: u64,
    /// Logical CPUs.
    pub cpus: usize,
    /// 1-minute load average at the start.
    pub loadavg_1m: f64,
    /// Molt version.
    pub molt_version: &'static str,
    /// llama.cpp bindings version.
    pub llama_cpp_sys: &'static str,
}

impl RunInfo {
    /// Reads the current facts.
    pub fn now() -> Self {
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
            .unwrap_or(0.0);
        Self {
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            cpus: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            loadavg_1m: load,
            molt_version: env!("CARGO_PKG_VERSION"),
            llama_cpp_sys: "0.1.161",
        }
    }
}

/// Whether a count is 0: serde's `skip_serializing_if` for fields added to a results file,
/// left out where they are 0 (as in every file written before them).
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
pub(crate) fn is_zero_count(n: &usize) -> bool {
    *n == 0
}
