//! Conditions A and B through the same session loop and trace: A (always large, never
//! switching) is killed when the budget falls below its rung and loses the answer — counted —
//! while B (always small) starts on the smallest rung and survives the same trace.
//!
//! A binary of its own: the rungs' costs are measured as the change of the process's
//! anonymous memory at load, which tests loading models in parallel threads would disturb.

mod common;

use molt::engine::ContextConfig;
use molt::pressure::{Trace, TraceBudget};
use molt::session::{
    Condition, GenerateOptions, Generation, Prompt, Session, SessionOptions, StopReason,
};

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns.";

fn answer(s: &mut Session, max: usize) -> Generation {
    s.generate(
        &Prompt::Text(TEXT.into()),
        &GenerateOptions {
            max_tokens: max,
            ..GenerateOptions::default()
        },
        &mut |_| {},
    )
    .unwrap()
}

/// Condition A is killed when the budget drops under the large rung (the answer so far is
/// lost and counted); B starts on the smallest rung and, never moving, survives the same
/// trace.
#[test]
fn conditions_a_and_b_under_one_trace() {
    let l = common::tiny_ladder();
    let cfg = ContextConfig {
        n_ctx: 512,
        n_batch: 128,
        n_threads: 2,
        ..ContextConfig::default()
    };
    let open = |c: Condition| {
        assert_eq!(
            c.start_index(l),
            if c == Condition::AlwaysSmall { 2 } else { 0 }
        );
        let opts = SessionOptions {
            strategy: c.strategy(),
            observe_footprint: false,
            ..SessionOptions::default()
        };
        Session::with_options(l.clone(), cfg, c.start_rung(l), opts).unwrap()
    };
    let mut a = open(Condition::AlwaysLarge);
    // Just under the large rung's resident cost: A cannot hold it.
    let high = 64 * a.rung_costs()[0].resident_bytes();
    let mid = a.rung_costs()[0].resident_bytes() - 1;
    let trace = Trace::parse(&format!(
        r#"{{"name":"drop","unit":"B","initial":{high},"events":[{{"at":6,"budget":{mid}}}]}}"#
    ))
    .unwrap();
    a.set_budget_source(Some(Box::new(TraceBudget::new(trace.clone()))));
    let ga = answer(&mut a, 16);
    assert!(ga.killed, "{ga:?}");
    assert_eq!(ga.stop, StopReason::Killed);
    assert_eq!(ga.lost_tokens, 6);
    assert!(a.history().is_empty(), "a killed process keeps nothing");

    let mut b = open(Condition::AlwaysSmall);
    let small = b.modelled_footprint(2, 512);
    assert!(
        small < mid,
        "the small rung ({small} B) must fit under {mid} B"
    );
    b.set_budget_source(Some(Box::new(TraceBudget::new(trace))));
    let gb = answer(&mut b, 16);
    assert!(!gb.killed);
    assert_eq!(gb.lost_tokens, 0);
    assert_eq!(gb.tokens.len(), 16);
    assert_eq!(gb.rungs_used, vec!["small".to_string()]);
}
