//! `molt-run hog`: the memory hog child (see `molt::pressure::hog`). Started by `--real-hog`
//! runs, which steer it over its standard input; usable alone with a timed schedule.

use anyhow::Result;
use molt::pressure::{HogSchedule, run_hog};

/// Hog options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Timed targets `at_ms:mib,...` (a bare number holds that many MiB from the start);
    /// lines `<mib>` on standard input override it, `quit` ends.
    #[arg(long, default_value = "")]
    pub mib_schedule: HogSchedule,
}

pub fn run(a: &Args) -> Result<()> {
    let report = run_hog(&a.mib_schedule, std::io::stdin())?;
    eprintln!(
        "hog: peak {} MiB, {} targets reached",
        report.peak_mib, report.targets_reached
    );
    Ok(())
}

/// Starts a hog child of this very binary, steered by `trace` under a device of `ceiling`
/// bytes (default: the trace's initial budget).
pub fn spawn_budget(
    trace: molt::pressure::Trace,
    ceiling: Option<u64>,
) -> Result<molt::pressure::HogBudget> {
    let exe = std::env::current_exe()?;
    Ok(molt::pressure::HogBudget::spawn(
        &exe,
        ["hog"],
        trace,
        ceiling,
    )?)
}
