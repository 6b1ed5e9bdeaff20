//! Real ladder (CI; skipped when it is not fetched, required with `MOLT_REQUIRE_LADDER=1`):
//! one answer under the shipped `spike_mid_answer` trace, at the `molt-run generate` defaults
//! (n_ctx 2048), visits every rung — tier0 → q3km → tier1 (precision routes) → tier2 (the size
//! route) — and after each switch the footprint the operating system shows (resident weight
//! pages of every mapped GGUF + the anonymous memory the session has grown by) is within the
//! budget in force.
//!
//! In a binary of its own: the measured footprint is a whole-process number.

mod common;

use molt::engine::ContextConfig;
use molt::pressure::{Trace, TraceBudget};
use molt::routes::{self, Routes, Variant};
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions, Strategy};
use std::path::Path;

#[test]
fn spike_mid_answer_visits_every_rung_within_the_measured_budget() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    let dirs = routes::search_dirs(None);
    let mut probe = Routes::new(l, dirs.clone(), Variant::Auto);
    // The walk down, by name: each switch goes one rung down.
    let walk = ["tier0", "q3km", "tier1", "tier2"];
    let index = |name: &str| common::rung(l, name).index;
    let fitted = walk
        .windows(2)
        .all(|w| probe.get(index(w[0]), index(w[1])).is_ok());
    let strategy = if fitted {
        Strategy::Molt
    } else {
        eprintln!("projectors of the walk {walk:?} not found; switching by re-prefill");
        Strategy::Reprefill
    };
    let config = ContextConfig {
        n_threads: 2,
        ..ContextConfig::default()
    };
    assert_eq!(config.n_ctx, 2048, "the generate default");
    let opts = SessionOptions {
        strategy,
        projector_dirs: dirs,
        ..SessionOptions::default()
    };
    let mut s = Session::with_options(l.clone(), config, "tier0", opts).unwrap();
    let trace =
        Trace::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/spike_mid_answer.json"))
            .unwrap();
    let drops: Vec<u64> = trace.steps.iter().map(|s| s.at).collect();
    s.set_budget_source(Some(Box::new(TraceBudget::new(trace))));
    let mut samples = Vec::new();
    let g = s
        .generate(
            &Prompt::User(
                "Explain in detail how an operating system reclaims memory from background apps, step by step."
                    .into(),
            ),
            &GenerateOptions {
                max_tokens: 112,
                ..GenerateOptions::default()
            },
            &mut |e| {
                if let Event::Footprint(f) = e {
                    samples.push(f.clone());
                }
            },
        )
        .unwrap();
    assert!(!g.killed);
    assert_eq!(
        g.rungs_used,
        walk.map(String::from),
        "stopped after {} tokens ({:?})",
        g.tokens.len(),
        g.stop
    );
    let at: Vec<u64> = g.switches.iter().map(|s| s.at_token as u64).collect();
    assert_eq!(
        at, drops,
        "each switch lands on the token the budget dropped"
    );
    assert_eq!(
        samples.len(),
        drops.len(),
        "one footprint sample per switch"
    );
    for f in &samples {
        eprintln!(
            "after the switch to {} at token {}: measured {} MiB, modelled {} MiB, RSS {} MiB, budget {} MiB",
            f.rung,
            f.at_token,
            f.measured_bytes >> 20,
            f.modelled_bytes >> 20,
            f.rss_bytes >> 20,
            f.budget_bytes >> 20
        );
        assert!(
            f.measured_bytes <= f.budget_bytes,
            "measured {} B over the budget {} B on {}",
            f.measured_bytes,
            f.budget_bytes,
            f.rung
        );
        assert!(f.modelled_bytes <= f.budget_bytes);
    }
}
