//! The actuator on real engines (tiny models): a stale plan is refused before anything moves,
//! and a tenant parked and resumed between tokens continues exactly as one never parked.

mod common;

use molt::engine::{ContextConfig, Sampler, SamplingParams, Token};
use molt::routes::{Routes, Variant};
use molt::sched::{Lever, Plan, PlanMode, RungCost, SchedError, Snapshot, TenantClass, TenantId};
use molt::tenants::{Arrival, Phase, Tenants, TenantsError};

fn config() -> ContextConfig {
    ContextConfig {
        n_ctx: 128,
        n_batch: 32,
        n_threads: 2,
        ..ContextConfig::default()
    }
}

fn arrival(name: &str) -> Arrival {
    Arrival {
        name: name.to_owned(),
        class: TenantClass::Foreground,
        priority: 0,
        prompt: vec![1, 2, 3, 4, 5, 6, 7, 8],
        chat: false,
    }
}

/// Applies `actions` as a plan made from the tenants' current views.
fn apply(
    tenants: &mut Tenants<'_>,
    actions: Vec<(TenantId, Lever)>,
) -> Result<Vec<molt::tenants::Applied>, TenantsError> {
    let l = common::tiny_ladder();
    // Costs do not matter to the actuator: it checks the plan, not the budget.
    let costs = l
        .rungs
        .iter()
        .map(|r| RungCost::new(r.name(), 1, 1, 1))
        .collect();
    let snapshot = Snapshot::new(0, costs, tenants.views());
    let plan = Plan {
        mode: PlanMode::Relieve,
        actions,
        projected_usage: 0,
        budget_bytes: 0,
        feasible: true,
        infeasible: None,
        running: 0,
    };
    tenants.apply(&plan, &snapshot)
}

fn steps(tenants: &mut Tenants<'_>, id: TenantId, n: usize, sampler: &mut Sampler) -> Vec<Token> {
    (0..n)
        .map(|_| tenants.step(id, sampler).unwrap().expect("running").token)
        .collect()
}

#[test]
fn park_and_resume_between_tokens_is_lossless_and_stale_plans_are_refused() {
    let l = common::tiny_ladder();
    let mut tenants = Tenants::new(l, config(), Routes::new(l, vec![], Variant::Truncate));
    let (a, b) = (TenantId(0), TenantId(1));
    tenants.arrive(a, arrival("a")).unwrap();
    tenants.arrive(b, arrival("b")).unwrap();
    assert!(matches!(
        tenants.arrive(a, arrival("again")),
        Err(TenantsError::Duplicate { .. })
    ));
    assert_eq!(tenants.views().len(), 2);

    // A waiting tenant is on rung 0: parking it "on rung 1" is stale, and nothing moves.
    let stale = apply(&mut tenants, vec![(a, Lever::Park { rung: 1 })]);
    assert!(matches!(
        stale,
        Err(TenantsError::Sched(SchedError::StalePlan { .. }))
    ));
    assert_eq!(tenants.observe(a).unwrap().phase, Phase::Waiting);
    assert!(
        tenants
            .step(a, &mut Sampler::new(SamplingParams::greedy()))
            .unwrap()
            .is_none()
    );

    let applied = apply(
        &mut tenants,
        vec![(a, Lever::Admit { rung: 0 }), (b, Lever::Admit { rung: 0 })],
    )
    .unwrap();
    assert!(applied.iter().all(|x| x.performed && !x.detail.is_empty()));
    let seen = tenants.observe(a).unwrap();
    assert_eq!(
        (seen.phase, seen.rung, seen.context_tokens),
        (Phase::Running, 0, 8)
    );

    let mut sa = Sampler::new(SamplingParams::greedy());
    let mut sb = Sampler::new(SamplingParams::greedy());
    let straight = steps(&mut tenants, a, 4, &mut sa);
    let mut interrupted = steps(&mut tenants, b, 2, &mut sb);

    apply(&mut tenants, vec![(b, Lever::Park { rung: 0 })]).unwrap();
    let parked = tenants.observe(b).unwrap();
    assert_eq!(parked.phase, Phase::Parked);
    assert!(parked.parked_bytes > 0);
    assert!(
        tenants.step(b, &mut sb).unwrap().is_none(),
        "a parked tenant does not step"
    );
    // Parking twice finds nothing to do.
    let again = apply(&mut tenants, vec![(b, Lever::Park { rung: 0 })]).unwrap();
    assert!(!again[0].performed);

    apply(&mut tenants, vec![(b, Lever::Resume { rung: 0 })]).unwrap();
    assert_eq!(tenants.observe(b).unwrap().phase, Phase::Running);
    interrupted.extend(steps(&mut tenants, b, 2, &mut sb));
    assert_eq!(
        interrupted, straight,
        "parking between tokens changed the answer"
    );

    tenants.finish(a);
    tenants.finish(b);
    tenants.release_idle();
    assert_eq!(tenants.observe(a).unwrap().phase, Phase::Done);
    assert!(tenants.views().is_empty());
    assert_eq!(tenants.mapped_resident_bytes(), 0, "no rung stays mapped");
}
