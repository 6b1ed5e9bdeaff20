//! Benchmark programs. Every number on the results page comes from JSON these write under
//! `results/`; nothing is timed inside tests (the machines are shared and noisy, so the
//! benchmarks compare ratios measured side by side in one run, with repetitions).
//!
//! - [`cost_sweep`]: transplant against re-prefill per route and context length.
//! - [`qos`]: three tenants with real engines sharing one moving budget, the scheduler's
//!   levers applied before anyone takes a step.
//! - [`footprint`]: what each rung occupies per context length, measured by the OS beside the
//!   policy's model, and what parking gives back.
//! - [`speed`]: prefill/decode tok/s per rung, Molt's engine beside plain llama.cpp.

pub mod cost_sweep;
pub mod footprint;
pub mod qos;
pub mod speed;

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
