//! The three-tenant scheduler on real engines (tiny models): a budget that moves under three
//! tenants makes the apply step defer, park, shed and resume them; the policy's usage after
//! enforcement never exceeds the budget, nobody is terminated, every answer completes.

mod common;

use molt::bench::qos::{QosOptions, calibrate, run};
use molt::engine::ContextConfig;
use molt::pressure::{Trace, TraceBudget};
use molt::routes::Variant;
use molt::sched::{Policy, TenantClass};

#[test]
fn three_tenants_share_a_moving_budget_without_overshoot_or_kills() {
    let l = common::tiny_ladder();
    let config = ContextConfig {
        n_ctx: 256,
        n_batch: 32,
        n_threads: 2,
        ..ContextConfig::default()
    };
    let mut opts = QosOptions::standard(config, vec![]);
    opts.variant = Variant::Truncate;
    opts.policy = Policy {
        hysteresis_bytes: 64 << 10,
        shed_chunk_tokens: 4,
        one_rung: false,
    };
    for (t, arrival) in opts.tenants.iter_mut().zip([0, 0, 3]) {
        t.chat = false;
        t.max_tokens = 12;
        t.arrival_round = arrival;
    }
    assert_eq!(opts.tenants[0].class, TenantClass::Foreground);
    let costs = calibrate(l, config, &[1, 2, 3, 4]).unwrap();
    let run_cost = |r: usize| costs[r].resident_bytes() + costs[r].tenant_bytes;
    let cheapest = (0..costs.len()).map(run_cost).min().unwrap();
    let kv = costs.iter().map(|c| c.kv_bytes_per_token).min().unwrap();
    let ample = 4 * (0..costs.len()).map(run_cost).sum::<u64>();
    // Round 3: no headroom for the newcomer; 5: below every rung (park); 7: below the
    // parked caches (shed); 9: memory returns.
    let tight = 2 * cheapest + 40 * 2 * costs[0].kv_bytes_per_token;
    let trace = Trace::parse(&format!(
        r#"{{"name":"t","unit":"B","initial":{ample},"events":[
            {{"at":3,"budget":{tight}}},
            {{"at":5,"budget":{}}},
            {{"at":7,"budget":{}}},
            {{"at":9,"budget":{ample}}}]}}"#,
        cheapest / 2,
        kv * 20
    ))
    .unwrap();
    let mut budget = TraceBudget::new(trace);
    let report = run(l, &opts, &mut budget, &mut |_| {}).unwrap();
    assert_eq!(report.killed, 0);
    assert!(
        report.max_overshoot_modelled <= 0,
        "{}",
        report.max_overshoot_modelled
    );
    assert_eq!(report.infeasible_rounds, 0);
    for t in &report.tenants {
        assert_eq!(
            t.tokens, 12,
            "{} finished: {:?} {}",
            t.name, t.stop, t.tokens
        );
        assert!(t.finished_round.is_some());
    }
    let used = |name: &str, lever: &str| {
        report
            .tenants
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| t.levers.get(lever).copied())
            .unwrap_or(0)
    };
    assert!(
        used("batch-2", "defer") > 0,
        "{:?}",
        report.tenants[2].levers
    );
    for name in ["chat", "batch-1"] {
        assert!(used(name, "park") > 0, "{name}");
        assert!(used(name, "resume") > 0, "{name}");
    }
    assert!(used("batch-1", "shed") > 0, "the background sheds");
    // Every round's actions are logged with what was done.
    assert!(report.actions.iter().all(|a| !a.detail.is_empty()));
    // Levers run before anyone steps: a round that parks decodes nothing for the parked.
    let park_round = report
        .actions
        .iter()
        .find(|a| matches!(a.lever, molt::sched::Lever::Park { .. }))
        .unwrap()
        .round;
    let r = &report.rounds[park_round];
    assert!(
        r.tenants
            .iter()
            .all(|t| t.state != "running" || r.tokens.iter().any(|(id, _)| *id == t.tenant))
    );
}
