//! Reliability: the record's goals (`results/reliability.json`), and the soak on the tiny
//! ladder.
//!
//! The soak: one process, many switches under a sawtooth budget (the big
//! rung / room for the small rung only, alternating every few tokens), the resident set and the
//! open descriptors sampled after every answer (`molt_bench::reliability::run_soak`, the same
//! code `molt-run bench --soak` runs on the real ladder).
//!
//! `MOLT_SOAK_SWITCHES` sets the switches (default 1000, a minute or two on the tiny models);
//! with `MOLT_SOAK_RECORD=results/soak.json` the run's row replaces the tiny ladder's there.

mod common;

use molt::session::{Session, SessionOptions};
use molt_bench::reliability::{MAX_FD_SLOPE, MAX_RSS_SLOPE_KIB_PER_SWITCH, SoakOptions, run_soak};

#[test]
fn a_thousand_switches_leak_neither_memory_nor_descriptors() {
    let switches = std::env::var("MOLT_SOAK_SWITCHES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    // The policy decides on the rungs' modelled costs: the soak measures what switching leaks,
    // and the process's own growth must not be what moves it (or parks it).
    let opts = SessionOptions {
        projector_dirs: vec![common::tiny_projectors().clone()],
        observe_footprint: false,
        ..SessionOptions::default()
    };
    let mut session = Session::with_options(
        common::tiny_ladder().clone(),
        common::one_thread(common::cfg()),
        "big",
        opts,
    )
    .unwrap();
    let (row, samples) = run_soak(
        &mut session,
        &SoakOptions {
            switches,
            ..SoakOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    eprintln!("{}", serde_json::to_string_pretty(&row).unwrap());
    assert!(row.switches >= switches);
    // The sawtooth moves the answer down and back up: at least one switch per leg change.
    assert!(row.switches >= row.answers, "{row:?}");
    assert!(
        row.fd_slope <= MAX_FD_SLOPE && row.fds[1] <= row.fds[0],
        "descriptors leak: {row:?}\n{samples:?}"
    );
    assert!(
        row.rss_slope_kib_per_switch <= MAX_RSS_SLOPE_KIB_PER_SWITCH,
        "the resident set grows {:.3} KiB per switch: {row:?}",
        row.rss_slope_kib_per_switch
    );
    if let Some(path) = std::env::var_os("MOLT_SOAK_RECORD") {
        molt_bench::reliability::record_soak(std::path::Path::new(&path), &row).unwrap();
    }
}

/// `results/reliability.json` — what the results page shows — meets every goal: no fuzz crash
/// open, nothing lost under any fault, the soak's resident set growing at most 1 KiB per
/// switch with no descriptor leak, every probe ok; and it covers every fuzz target and every
/// fault site.
#[test]
fn the_reliability_record_meets_its_goals() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results/reliability.json");
    let text = std::fs::read_to_string(&path).expect("results/reliability.json");
    let r: molt_bench::reliability::Reliability = serde_json::from_str(&text).expect("parses");
    assert_eq!(r.check(), Vec::<String>::new());
    for t in molt_testkit::TARGETS {
        assert!(
            r.fuzz.iter().any(|f| f.target == t.name && f.execs > 0),
            "fuzz target {} has no recorded run",
            t.name
        );
    }
    for site in molt::fault::Site::ALL {
        assert!(
            r.faults.iter().any(|f| f.site.starts_with(site.name())),
            "fault site {} has no recorded outcome",
            site.name()
        );
    }
    assert!(
        r.soak
            .iter()
            .any(|s| s.ladder == "tiny" && s.switches >= 1000),
        "no 1,000-switch soak on the tiny ladder"
    );
}
