//! Reliability: the soak (many switches in one process under a sawtooth budget, resident set
//! and open file descriptors sampled, their slopes per switch reported) and
//! `results/reliability.json`, which gathers what the reliability work measured:
//!
//! - `fuzz`: one row per fuzz target, from `results/fuzz.json` — recorded from the `cargo fuzz`
//!   runs (executions, seconds, crashes found, crashes still open);
//! - `faults`: one row per injected fault, from `results/faults.jsonl` — written by
//!   `tests/faults.rs` and `tests/restart.rs` with `MOLT_RELIABILITY_RECORD` set, only after a
//!   scenario's checks held;
//! - `soak`: one row per ladder, from `results/soak.json` — written by [`run_soak`] (`molt-run
//!   bench --soak` on any ladder; `tests/soak.rs` on the tiny one);
//! - `probes`: the hostile-client probes (issues 20 and 49), from `benches/reliability/probes.json`.
//!
//! [`Reliability::check`] states the goals the results page and the check test hold it to: no
//! crash open, nothing lost under any fault, resident set growing at most 1 KiB per switch, no
//! descriptor leak, every probe ok.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::BenchError;
use molt::engine::SamplingParams;
use molt::pressure::{Budget, BudgetOrigin, BudgetSource, PressureError, Tick};
use molt::session::{Event, GenerateOptions, Prompt, Session};

/// Resident-set growth per switch the soak may show, KiB (the goal of issue 20).
pub const MAX_RSS_SLOPE_KIB_PER_SWITCH: f64 = 1.0;
/// Switches a soak needs before its resident-set slope is judged: over a hundred switches the
/// resident set's own noise (hundreds of KiB from one answer to the next on the real ladder)
/// is larger than the goal times the run, so a shorter soak's slope is reported, not judged.
pub const MIN_SWITCHES_FOR_RSS_VERDICT: u64 = 1000;
/// Descriptor growth per switch the soak may show: one leaked descriptor per thousand switches
/// is already a leak, so the line sits well below it.
pub const MAX_FD_SLOPE: f64 = 0.0005;

/// One fuzz target's recorded run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuzzRow {
    /// Target name (`molt_testkit::TARGETS`).
    pub target: String,
    /// Inputs executed.
    pub execs: u64,
    /// Seconds run.
    pub seconds: f64,
    /// Crashes the run found (each fixed with a regression input in the corpus).
    pub crashes_found: u64,
    /// Crashes not yet fixed.
    pub crashes_open: u64,
    /// Coverage counters reached (libFuzzer's `cov`), when recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<u64>,
}

/// One injected fault's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRow {
    /// Where the fault struck (`molt::fault::Site` name, with the write path).
    pub site: String,
    /// What happened to the answer, the source rung and the files.
    pub outcome: String,
    /// Whether anything was lost: an answer's state, a valid file, a usable session.
    pub lost: bool,
}

/// One soak: many switches in one process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SoakRow {
    /// The ladder's name.
    pub ladder: String,
    /// Switches made.
    pub switches: u64,
    /// Least-squares slope of the resident set over switches, after the warm-up, KiB/switch.
    pub rss_slope_kib_per_switch: f64,
    /// Least-squares slope of open file descriptors over switches, after the warm-up.
    pub fd_slope: f64,
    /// Answers the switches were spread over.
    #[serde(default)]
    pub answers: u64,
    /// Resident set after the warm-up and at the end, KiB.
    #[serde(default)]
    pub rss_kib: [u64; 2],
    /// Open descriptors after the warm-up and at the end.
    #[serde(default)]
    pub fds: [u64; 2],
    /// Wall time, seconds.
    #[serde(default)]
    pub seconds: f64,
    /// Least-squares slope of the anonymous part of the resident set (`RssAnon`: heap, caches,
    /// buffers) over switches after the warm-up, KiB/switch: what a leak grows. The rest of the
    /// resident set is mapped weight pages, which the kernel reclaims and faults back in as it
    /// pleases, so it wanders with the page cache rather than with the process.
    #[serde(default)]
    pub anon_slope_kib_per_switch: Option<f64>,
    /// Anonymous resident memory after the warm-up and at the end, KiB.
    #[serde(default)]
    pub rss_anon_kib: Option<[u64; 2]>,
}

/// One hostile-client probe and where it stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeRow {
    /// What was tried.
    pub probe: String,
    /// What happens now (and the test that holds it).
    pub status: String,
    /// Whether the behaviour is what it must be.
    pub ok: bool,
}

/// `results/reliability.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reliability {
    /// Fuzz targets.
    pub fuzz: Vec<FuzzRow>,
    /// Injected faults.
    pub faults: Vec<FaultRow>,
    /// Soaks.
    pub soak: Vec<SoakRow>,
    /// Probes.
    pub probes: Vec<ProbeRow>,
}

impl Reliability {
    /// Gathers the record files under `results_dir` and the probe list `probes` (a missing
    /// record is an empty section, which [`Reliability::check`] refuses).
    ///
    /// # Errors
    /// [`BenchError::Io`] / [`BenchError::Json`] for a record that cannot be read or parsed.
    pub fn gather(results_dir: &Path, probes: &Path) -> Result<Self, BenchError> {
        let fuzz: Vec<FuzzRow> = read_json_or_empty(&results_dir.join("fuzz.json"))?;
        let soak: Vec<SoakRow> = read_json_or_empty(&results_dir.join("soak.json"))?;
        let probes: Vec<ProbeRow> = read_json_or_empty(probes)?;
        let faults_path = results_dir.join("faults.jsonl");
        let mut faults: Vec<FaultRow> = Vec::new();
        if faults_path.exists() {
            let text = std::fs::read_to_string(&faults_path).map_err(|source| BenchError::Io {
                path: faults_path.clone(),
                source,
            })?;
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let row: FaultRow = serde_json::from_str(line).map_err(|e| BenchError::Json {
                    path: faults_path.clone(),
                    message: e.to_string(),
                })?;
                // One row per site: a re-run replaces the earlier record.
                faults.retain(|f| f.site != row.site);
                faults.push(row);
            }
        }
        Ok(Self {
            fuzz,
            faults,
            soak,
            probes,
        })
    }

    /// Every goal that does not hold, in words (empty: all hold).
    #[must_use]
    pub fn check(&self) -> Vec<String> {
        let mut bad = Vec::new();
        for (name, empty) in [
            ("fuzz", self.fuzz.is_empty()),
            ("faults", self.faults.is_empty()),
            ("soak", self.soak.is_empty()),
            ("probes", self.probes.is_empty()),
        ] {
            if empty {
                bad.push(format!("no {name} rows"));
            }
        }
        for f in &self.fuzz {
            if f.crashes_open > 0 {
                bad.push(format!(
                    "fuzz {}: {} crashes open",
                    f.target, f.crashes_open
                ));
            }
            if f.execs == 0 {
                bad.push(format!("fuzz {}: never run", f.target));
            }
        }
        for f in self.faults.iter().filter(|f| f.lost) {
            bad.push(format!("fault {}: lost ({})", f.site, f.outcome));
        }
        for s in &self.soak {
            // A NaN slope fails too.
            let over = |v: f64, max: f64| v.is_nan() || v > max;
            if s.switches >= MIN_SWITCHES_FOR_RSS_VERDICT
                && over(s.rss_slope_kib_per_switch, MAX_RSS_SLOPE_KIB_PER_SWITCH)
            {
                bad.push(format!(
                    "soak {}: resident set grows {:.3} KiB per switch",
                    s.ladder, s.rss_slope_kib_per_switch
                ));
            }
            if over(s.fd_slope, MAX_FD_SLOPE) {
                bad.push(format!(
                    "soak {}: descriptors grow {:.5} per switch",
                    s.ladder, s.fd_slope
                ));
            }
        }
        for p in self.probes.iter().filter(|p| !p.ok) {
            bad.push(format!("probe {}: {}", p.probe, p.status));
        }
        bad
    }
}

fn read_json_or_empty<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>, BenchError> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| BenchError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Writes `value` as pretty JSON to `path`.
///
/// # Errors
/// [`BenchError::Io`].
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), BenchError> {
    let io = |source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    };
    let text = serde_json::to_string_pretty(value).map_err(|e| io(std::io::Error::other(e)))?;
    std::fs::write(path, text + "\n").map_err(io)
}

/// Replaces (or adds) `row` in the soak record at `path`, keyed by ladder.
///
/// # Errors
/// As [`Reliability::gather`] and [`write_json`].
pub fn record_soak(path: &Path, row: &SoakRow) -> Result<(), BenchError> {
    let mut rows: Vec<SoakRow> = read_json_or_empty(path)?;
    rows.retain(|r| r.ladder != row.ladder);
    rows.push(row.clone());
    write_json(path, &rows)
}

/// A budget that alternates every `leg` tokens between room for every rung (`high`) and room
/// for the smallest rung only (`low`): each answer moves down and back up, again and again.
#[derive(Debug, Clone, Copy)]
pub struct Sawtooth {
    /// Budget on even legs.
    pub high: u64,
    /// Budget on odd legs.
    pub low: u64,
    /// Tokens per leg.
    pub leg: u64,
}

impl BudgetSource for Sawtooth {
    fn budget(&mut self, now: Tick) -> Result<Budget, PressureError> {
        let low = (now.token_index / self.leg.max(1)) % 2 == 1;
        Ok(Budget {
            bytes: if low { self.low } else { self.high },
            pressure: if low { 0.5 } else { 0.0 },
            origin: BudgetOrigin::Trace,
        })
    }

    fn describe(&self) -> String {
        format!(
            "sawtooth: {} MiB / {} MiB every {} tokens",
            self.high >> 20,
            self.low >> 20,
            self.leg
        )
    }

    fn moves_with_time(&self) -> bool {
        false
    }
}

/// What a soak runs.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// Switches to make.
    pub switches: u64,
    /// Tokens per budget leg (a switch every leg).
    pub leg: u64,
    /// Legs per answer (the answer's context must hold `leg × legs` tokens plus the prompt).
    pub legs_per_answer: u64,
    /// The prompt every answer answers.
    pub prompt: String,
}

impl Default for SoakOptions {
    fn default() -> Self {
        Self {
            switches: 1000,
            leg: 3,
            legs_per_answer: 8,
            prompt: "Tell me about caches.".into(),
        }
    }
}

/// One sample of the process between two answers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SoakSample {
    /// Switches made so far.
    pub switches: u64,
    /// Resident set, KiB.
    pub rss_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Anonymous resident memory (`RssAnon`), KiB.
    #[serde(default)]
    pub anon_kib: u64,
}

/// Open file descriptors of this process.
#[must_use]
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// Least-squares slope of `y` over `x` (0 for fewer than two distinct `x`).
#[must_use]
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

/// The two budgets of a sawtooth over `session`'s ladder (at least two rungs): `low` holds
/// only the smallest rung with a full window, `high` every rung past the policy's promotion
/// margin. Costs are the session's as measured so far.
#[must_use]
pub fn sawtooth_budgets(session: &Session) -> (u64, u64) {
    let n = session.ladder().rungs.len();
    let n_ctx = u64::from(session.config().n_ctx);
    let costs = session.rung_costs();
    let full = |c: &molt::sched::RungCost| c.resident_bytes() + c.kv_bytes(n_ctx);
    // Just below what the next rung up needs: as much room as the smallest rung can be given
    // while it is the only one that fits (its measured footprint may exceed the model's).
    let low = full(&costs[n.saturating_sub(2)])
        .saturating_sub(1)
        .max(full(&costs[n - 1]));
    // Room for every rung past the policy's promotion margin, so each high leg promotes.
    let high = costs
        .iter()
        .map(full)
        .max()
        .unwrap_or(0)
        .saturating_mul(2)
        .saturating_add(session.options().policy.hysteresis_bytes);
    (low, high)
}

/// The soak's row from its samples so far: slopes by least squares over the samples after the
/// warm-up (the first tenth of `planned` switches), the first steady sample and the last.
#[must_use]
pub fn soak_row(ladder: &str, planned: u64, samples: &[SoakSample], seconds: f64) -> SoakRow {
    let warm = planned / 10;
    let steady: Vec<&SoakSample> = samples.iter().filter(|s| s.switches > warm).collect();
    let points = |f: fn(&SoakSample) -> u64| -> Vec<(f64, f64)> {
        steady
            .iter()
            .map(|s| (s.switches as f64, f(s) as f64))
            .collect()
    };
    let first = steady.first().copied().copied().unwrap_or(SoakSample {
        switches: 0,
        rss_kib: 0,
        fds: 0,
        anon_kib: 0,
    });
    let last = samples.last().copied().unwrap_or(first);
    SoakRow {
        ladder: ladder.to_string(),
        switches: last.switches,
        rss_slope_kib_per_switch: slope(&points(|s| s.rss_kib)),
        fd_slope: slope(&points(|s| s.fds)),
        answers: samples.len() as u64,
        rss_kib: [first.rss_kib, last.rss_kib],
        fds: [first.fds, last.fds],
        seconds,
        anon_slope_kib_per_switch: Some(slope(&points(|s| s.anon_kib))),
        rss_anon_kib: Some([first.anon_kib, last.anon_kib]),
    }
}

/// Runs answers on `session` under a [`Sawtooth`] between its home rung and its smallest rung
/// until `opts.switches` switches are made, sampling the resident set and open descriptors
/// after every answer; `progress(switches, sample)` is called after each. The first tenth of
/// the switches is warm-up (allocator arenas, llama.cpp's lazily built tables) and is left out
/// of the slopes.
///
/// # Errors
/// [`BenchError::Session`] if an answer fails; [`BenchError::Config`] for a one-rung ladder or
/// an answer that makes no switch (the budget would not move it).
pub fn run_soak(
    session: &mut Session,
    opts: &SoakOptions,
    progress: &mut dyn FnMut(&SoakSample),
) -> Result<(SoakRow, Vec<SoakSample>), BenchError> {
    let t0 = std::time::Instant::now();
    let n = session.ladder().rungs.len();
    if n < 2 {
        return Err(BenchError::Config("a soak needs at least two rungs".into()));
    }
    // Load every rung once so the policy decides on measured context overheads.
    let home = session.current_index();
    for i in home + 1..n {
        session.ensure_loaded(i)?;
        session.unload(i);
    }
    let (low, high) = sawtooth_budgets(session);
    session.set_budget_source(Some(Box::new(Sawtooth {
        high,
        low,
        leg: opts.leg,
    })));
    let gen_opts = GenerateOptions {
        max_tokens: usize::try_from(opts.leg * opts.legs_per_answer).unwrap_or(usize::MAX),
        sampling: SamplingParams::greedy(),
        force_switch: None,
    };
    let prompt = Prompt::User(opts.prompt.clone());
    let mut switches = 0u64;
    let mut samples = Vec::new();
    let mut answers = 0u64;
    while switches < opts.switches {
        session.reset();
        let mut made = 0u64;
        session.generate(&prompt, &gen_opts, &mut |e| {
            if matches!(e, Event::Switch(_)) {
                made += 1;
            }
        })?;
        if made == 0 {
            return Err(BenchError::Config(format!(
                "answer {} made no switch under the sawtooth (budgets {} / {} MiB)",
                answers + 1,
                high >> 20,
                low >> 20
            )));
        }
        switches += made;
        answers += 1;
        molt::pressure::trim_heap();
        let sample = SoakSample {
            switches,
            rss_kib: molt::pressure::process_rss_bytes().unwrap_or(0) >> 10,
            fds: open_fds(),
            anon_kib: molt::pressure::process_anon_rss_bytes().unwrap_or(0) >> 10,
        };
        progress(&sample);
        samples.push(sample);
    }
    session.set_budget_source(None);
    let row = soak_row(
        session.ladder().name(),
        opts.switches,
        &samples,
        t0.elapsed().as_secs_f64(),
    );
    Ok((row, samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_noise_around_flat() {
        let line: Vec<(f64, f64)> = (0..10)
            .map(|i| (f64::from(i), 3.0 * f64::from(i) + 1.0))
            .collect();
        assert!((slope(&line) - 3.0).abs() < 1e-12);
        let flat: Vec<(f64, f64)> = (0..10)
            .map(|i| (f64::from(i), if i % 2 == 0 { 5.0 } else { 6.0 }))
            .collect();
        assert!(slope(&flat).abs() < 0.1);
        assert_eq!(slope(&[(1.0, 2.0)]), 0.0);
    }

    #[test]
    fn check_names_every_broken_goal() {
        let mut r = Reliability {
            fuzz: vec![FuzzRow {
                target: "gguf".into(),
                execs: 10,
                seconds: 1.0,
                crashes_found: 1,
                crashes_open: 0,
                coverage: None,
            }],
            faults: vec![FaultRow {
                site: "kv_import".into(),
                outcome: "x".into(),
                lost: false,
            }],
            soak: vec![SoakRow {
                ladder: "tiny".into(),
                switches: 1000,
                rss_slope_kib_per_switch: 0.2,
                fd_slope: 0.0,
                answers: 1,
                rss_kib: [0, 0],
                fds: [0, 0],
                seconds: 0.0,
                anon_slope_kib_per_switch: None,
                rss_anon_kib: None,
            }],
            probes: vec![ProbeRow {
                probe: "p".into(),
                status: "s".into(),
                ok: true,
            }],
        };
        assert!(r.check().is_empty(), "{:?}", r.check());
        r.fuzz[0].crashes_open = 1;
        r.faults[0].lost = true;
        r.soak[0].rss_slope_kib_per_switch = 1.5;
        r.soak.push(SoakRow {
            ladder: "real".into(),
            switches: 100,
            ..r.soak[0].clone()
        });
        r.probes[0].ok = false;
        assert_eq!(r.check().len(), 4, "{:?}", r.check());
    }
}
