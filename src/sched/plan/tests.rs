use super::*;
use crate::sched::{RungCost, TenantClass, TenantView};

const MIB: u64 = 1 << 20;

/// The Qwen ladder of the design: weights from the file sizes, KV per token from the
/// probe's state sizes (tier1 shares tier0's geometry), compute buffers guessed.
fn qwen() -> Vec<RungCost> {
    vec![
        RungCost::new("tier0", 1_117_320_768, 28_708, 300 * MIB),
        RungCost::new("tier1", 752_880_192, 28_708, 300 * MIB),
        RungCost::new("tier2", 491_400_064, 12_321, 150 * MIB),
    ]
}

fn fg(id: u64, tokens: u64) -> TenantView {
    TenantView::new(id, TenantClass::Foreground).with_context(tokens, 16)
}

fn bg(id: u64, tokens: u64) -> TenantView {
    TenantView::new(id, TenantClass::Background).with_context(tokens, 16)
}

fn snap(budget: u64, tenants: Vec<TenantView>) -> Snapshot {
    Snapshot::new(budget, qwen(), tenants)
}

fn run(s: &Snapshot) -> (Plan, Snapshot) {
    let p = plan(s, &Policy::default()).expect("valid");
    let next = apply(&p, s).expect("applies");
    assert_eq!(usage(&next), p.projected_usage);
    (p, next)
}

#[test]
fn ample_budget_holds() {
    let s = snap(8000 * MIB, vec![fg(1, 500), bg(2, 500)]);
    let (p, next) = run(&s);
    assert_eq!(p.mode, PlanMode::Hold);
    assert!(p.actions.is_empty());
    assert_eq!(next, s);
}

#[test]
fn background_is_demoted_before_foreground() {
    // A long-context background job: moving it to tier2 saves more KV than tier2's
    // weights cost, so demoting it alone relieves the pressure.
    let s = snap(3500 * MIB, vec![fg(1, 1000), bg(2, 100_000)]);
    assert!(usage(&s) > s.budget_bytes);
    let (p, next) = run(&s);
    assert_eq!(p.mode, PlanMode::Relieve);
    assert!(p.feasible);
    assert_eq!(next.tenants[0].rung, 0, "foreground keeps tier0");
    assert_eq!(next.tenants[1].rung, 2, "background demoted");
    assert_eq!(
        p.actions,
        vec![(TenantId(2), Lever::Demote { from: 0, to: 2 })]
    );
}

#[test]
fn foreground_is_demoted_before_any_background_is_parked() {
    // 1000 MiB: no 1.5B rung fits at all (tier1 alone is 1018 MiB), so the choice is
    // between parking the background and demoting both to tier2. Lever 2 on everyone
    // beats lever 3 on anyone.
    let s = snap(1000 * MIB, vec![fg(1, 1000), bg(2, 1000)]);
    let (p, next) = run(&s);
    assert!(p.feasible);
    assert!(next.tenants.iter().all(|t| !t.parked));
    assert_eq!(p.levers_used(), vec![LeverKind::Demote]);
    assert_eq!(next.tenants[0].rung, 2);
    assert_eq!(next.tenants[1].rung, 2);
}

#[test]
fn park_then_shed_when_weights_no_longer_fit() {
    // Below tier2's weights: everyone parks; KV 2 × 20 000 tokens × 12 321 B ≈ 470 MiB.
    let s = snap(300 * MIB, vec![fg(1, 20_000), bg(2, 20_000)]);
    let (p, next) = run(&s);
    assert!(p.feasible, "{p:?}");
    assert_eq!(p.running, 0);
    assert!(next.tenants.iter().all(|t| t.parked));
    // Shedding was needed; the background shed first and (here) alone.
    assert!(p.levers_used().contains(&LeverKind::Shed));
    assert_eq!(next.tenants[0].context_tokens, 20_000);
    assert!(next.tenants[1].context_tokens < 20_000);
}

#[test]
fn infeasible_budget_is_reported_not_terminated() {
    // Below even the pinned prompts' KV (2 × 16 tokens × 12 321 B on tier2).
    let s = snap(100_000, vec![fg(1, 1000), bg(2, 1000)]);
    let (p, next) = run(&s);
    assert!(!p.feasible);
    let why = p.infeasible.expect("reason");
    assert!(why.min_usage_bytes > why.budget_bytes);
    assert!(why.to_string().contains("below the least"));
    assert_eq!(next.tenants.len(), 2);
    assert!(
        next.tenants
            .iter()
            .all(|t| t.parked && t.context_tokens == 16)
    );
}

#[test]
fn recovery_needs_the_margin() {
    let policy = Policy::default();
    let tier0_need = qwen()[0].resident_bytes() + qwen()[0].kv_bytes(500);
    let demoted = fg(1, 500).with_rung(1);
    // Fits tier0, but not with the margin: stay.
    let s = snap(
        tier0_need + policy.hysteresis_bytes - 1,
        vec![demoted.clone()],
    );
    let p = plan(&s, &policy).expect("valid");
    assert_eq!(p.mode, PlanMode::Hold);
    assert!(p.actions.is_empty());
    // With the margin: promote.
    let s = snap(tier0_need + policy.hysteresis_bytes, vec![demoted]);
    let p = plan(&s, &policy).expect("valid");
    assert_eq!(p.mode, PlanMode::Recover);
    assert_eq!(
        p.actions,
        vec![(TenantId(1), Lever::Promote { from: 1, to: 0 })]
    );
}

#[test]
fn admission_defers_rather_than_harm_and_takes_a_smaller_rung() {
    let running = fg(1, 1000);
    let newcomer = bg(2, 1000).waiting();
    // tier0 is resident and shared, so admitting there costs only KV; a long prompt makes
    // that dearer than tier2's weights plus its smaller KV.
    let mut big = newcomer.clone();
    big.context_tokens = 60_000;
    let base = usage(&snap(0, vec![running.clone()]));
    let tier2 = qwen()[2].resident_bytes() + qwen()[2].kv_bytes(60_000);
    let s = snap(base + tier2 + 128 * MIB, vec![running.clone(), big]);
    let (p, next) = run(&s);
    assert_eq!(p.actions, vec![(TenantId(2), Lever::Admit { rung: 2 })]);
    assert!(next.tenants[1].admitted);
    // No headroom at all: defer, and the running tenant is untouched.
    let s = snap(base, vec![running, newcomer]);
    let (p, next) = run(&s);
    assert_eq!(p.actions, vec![(TenantId(2), Lever::Defer)]);
    assert!(!next.tenants[1].admitted);
}

/// Pins down a two-round dance the property tests found: admission never harms a running
/// tenant, so a newcomer *more* protected than it starts on a smaller rung; the next round
/// (same budget) recovers by swapping them — the incumbent demoted, the newcomer promoted
/// by a transplant up the ladder. Admitting directly onto the larger rung would save both
/// migrations; this test documents the current behaviour until the planner does that.
#[test]
fn admission_then_swap_is_two_rounds() {
    let incumbent = bg(1, 1000);
    let newcomer = fg(2, 1000).waiting();
    let budget = qwen()[0].resident_bytes()
        + qwen()[0].kv_bytes(1000)
        + qwen()[1].resident_bytes()
        + qwen()[1].kv_bytes(1000)
        + 200 * MIB;
    // Separate copies of the weights per tenant: with shared weights the newcomer would
    // simply join tier0 for the price of its KV.
    let mut s = snap(budget, vec![incumbent, newcomer]);
    s.shared_weights = false;
    let (p1, s1) = run(&s);
    assert_eq!(p1.actions, vec![(TenantId(2), Lever::Admit { rung: 1 })]);
    let (p2, s2) = run(&s1);
    assert_eq!(p2.mode, PlanMode::Recover);
    assert_eq!(
        p2.actions,
        vec![
            (TenantId(1), Lever::Demote { from: 0, to: 1 }),
            (TenantId(2), Lever::Promote { from: 1, to: 0 }),
        ]
    );
    assert_eq!((s2.tenants[0].rung, s2.tenants[1].rung), (1, 0));
}

#[test]
fn parked_tenant_resumes_when_memory_returns() {
    let parked = fg(1, 1000).with_rung(2).with_parked(true);
    let s = snap(8000 * MIB, vec![parked]);
    let (p, next) = run(&s);
    assert_eq!(p.mode, PlanMode::Recover);
    assert_eq!(
        p.actions,
        vec![
            (TenantId(1), Lever::Promote { from: 2, to: 0 }),
            (TenantId(1), Lever::Resume { rung: 0 }),
        ]
    );
    assert!(next.tenants[0].is_running());
}

/// The batched server's policy: its tenants are sequences of one context, so a plan never
/// splits the running ones over two rungs — where the free one would demote only the long
/// background job, it moves both.
#[test]
fn one_rung_moves_every_running_tenant_together() {
    let s = snap(3500 * MIB, vec![fg(1, 1000), bg(2, 100_000)]);
    let policy = Policy {
        one_rung: true,
        ..Policy::exact()
    };
    let p = plan(&s, &policy).expect("valid");
    let next = apply(&p, &s).expect("applies");
    assert!(p.feasible);
    assert_eq!((next.tenants[0].rung, next.tenants[1].rung), (2, 2));
    assert!(next.tenants.iter().all(|t| !t.parked));
    assert!(usage(&next) <= s.budget_bytes);
}

/// With parked caches in files (the batched server's set-aside), a budget that holds the
/// smallest rung with the foreground answer but not with both sets the background one aside —
/// on its own rung, its cache costing nothing — and keeps the foreground running; with
/// parked caches in memory the same budget holds neither running, and both park. When memory
/// returns the background one resumes where the foreground runs.
#[test]
fn a_parked_cache_in_a_file_sets_the_background_aside_for_the_foreground() {
    let pinned = |t: TenantView| {
        let n = t.context_tokens;
        t.with_context(n, n)
    };
    let tenants = vec![pinned(fg(1, 1000)), pinned(bg(2, 50_000))];
    let small = &qwen()[2];
    let budget = small.resident_bytes() + small.kv_bytes(1000) + 20 * MIB;
    assert!(budget < small.resident_bytes() + small.kv_bytes(51_000));
    let policy = Policy {
        one_rung: true,
        ..Policy::exact()
    };
    let mut s = snap(budget, tenants);
    s.parked_kv_in_memory = false;
    let p = plan(&s, &policy).expect("valid");
    let next = apply(&p, &s).expect("applies");
    assert!(p.feasible, "{p:?}");
    assert_eq!(p.running, 1);
    assert_eq!(
        p.actions,
        vec![
            (TenantId(1), Lever::Demote { from: 0, to: 2 }),
            (TenantId(2), Lever::Park { rung: 0 }),
        ]
    );
    assert!(usage(&next) <= budget);

    let mut in_memory = s.clone();
    in_memory.parked_kv_in_memory = true;
    let p = plan(&in_memory, &policy).expect("valid");
    assert_eq!(p.running, 0, "{p:?}");

    let mut back = next.clone();
    back.budget_bytes = 8000 * MIB;
    let p = plan(&back, &policy).expect("valid");
    let after = apply(&p, &back).expect("applies");
    assert!(after.tenants.iter().all(TenantView::is_running), "{p:?}");
    assert_eq!(after.tenants[0].rung, after.tenants[1].rung);
}

#[test]
fn apply_rejects_foreign_and_stale_plans() {
    let s = snap(8000 * MIB, vec![fg(1, 100)]);
    let mut p = plan(&s, &Policy::default()).expect("valid");
    p.actions = vec![(TenantId(9), Lever::Defer)];
    assert_eq!(
        apply(&p, &s),
        Err(SchedError::UnknownTenant {
            tenant: TenantId(9)
        })
    );
    p.actions = vec![(TenantId(1), Lever::Demote { from: 1, to: 2 })];
    assert!(matches!(apply(&p, &s), Err(SchedError::StalePlan { .. })));
    p.actions = vec![(TenantId(1), Lever::Shed { tokens: 85 })];
    assert!(matches!(
        apply(&p, &s),
        Err(SchedError::ShedBelowPinned { .. })
    ));
}

#[test]
fn lever_serialises_tagged() {
    let json = serde_json::to_string(&Lever::Demote { from: 0, to: 1 }).expect("json");
    assert_eq!(json, r#"{"lever":"demote","from":0,"to":1}"#);
    assert_eq!(
        serde_json::to_string(&Lever::Defer).expect("json"),
        r#"{"lever":"defer"}"#
    );
}
