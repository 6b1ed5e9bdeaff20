//! The results page's reliability section, from `reliability.json` (see
//! [`crate::reliability`]): fuzzing, injected faults, the soak and the hostile-client
//! probes, each table beside the goal it is held to.

use std::fmt::Write as _;

use crate::reliability::{MAX_RSS_SLOPE_KIB_PER_SWITCH, MIN_SWITCHES_FOR_RSS_VERDICT, Reliability};

/// The section's Markdown.
#[must_use]
pub fn section(doc: &Reliability) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Reliability\n");
    let bad = doc.check();
    let _ = writeln!(
        s,
        "Goals: no fuzz crash open, nothing lost under any injected fault, the resident set growing at most {MAX_RSS_SLOPE_KIB_PER_SWITCH} KiB per switch over a soak, every probe ok — {}.\n",
        if bad.is_empty() {
            "all hold".to_string()
        } else {
            format!("**not met**: {}", bad.join("; "))
        }
    );
    let _ = writeln!(
        s,
        "**Fuzzing** (`scripts/fuzz.sh`: `cargo fuzz` on one core from the committed corpus in `tests/fuzz/corpus/`, which CI replays with a seeded mutator in `tests/fuzz_smoke.rs`):\n"
    );
    let _ = writeln!(
        s,
        "| target | executions | seconds | coverage | crashes found | open |\n|---|---|---|---|---|---|"
    );
    for f in &doc.fuzz {
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {} | {} | {} |",
            f.target,
            f.execs,
            f.seconds,
            f.coverage.map_or("–".to_string(), |c| c.to_string()),
            f.crashes_found,
            f.crashes_open
        );
    }
    let _ = writeln!(
        s,
        "\n**Injected faults** (`MOLT_FAULT=site:nth`, `tests/faults.rs` through `molt-run` on the tiny ladder):\n"
    );
    let _ = writeln!(s, "| site | outcome | lost |\n|---|---|---|");
    for f in &doc.faults {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            f.site,
            f.outcome,
            if f.lost { "**yes**" } else { "no" }
        );
    }
    let _ = writeln!(
        s,
        "\n**Soak** (one process, a sawtooth budget between the largest and the smallest rung; slopes by least squares over the samples after the first tenth of the switches; the resident-set goal is judged on soaks of at least {MIN_SWITCHES_FOR_RSS_VERDICT} switches — over fewer, the resident set's noise from one answer to the next is larger than the goal times the run):\n"
    );
    let _ = writeln!(
        s,
        "| ladder | switches | answers | RSS slope KiB/switch | RSS KiB (after warm-up → end) | anonymous slope KiB/switch | anonymous KiB | fd slope | fds | seconds | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &doc.soak {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {} → {} | {} | {} | {:.5} | {} → {} | {:.0} | {} |",
            r.ladder,
            r.switches,
            r.answers,
            r.rss_slope_kib_per_switch,
            r.rss_kib[0],
            r.rss_kib[1],
            r.anon_slope_kib_per_switch
                .map_or_else(|| "–".to_string(), |v| format!("{v:.3}")),
            r.rss_anon_kib
                .map_or_else(|| "–".to_string(), |[a, b]| format!("{a} → {b}")),
            r.fd_slope,
            r.fds[0],
            r.fds[1],
            r.seconds,
            if r.switches < MIN_SWITCHES_FOR_RSS_VERDICT {
                "RSS: too short to judge"
            } else if r.rss_slope_kib_per_switch <= MAX_RSS_SLOPE_KIB_PER_SWITCH {
                "met"
            } else {
                "**not met**"
            }
        );
    }
    let _ = writeln!(s, "\n**Probes** (issue 20's hostile-client holes):\n");
    let _ = writeln!(s, "| probe | status | ok |\n|---|---|---|");
    for p in &doc.probes {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            p.probe.replace('|', "\\|"),
            p.status.replace('|', "\\|"),
            if p.ok { "yes" } else { "**no**" }
        );
    }
    s
}
