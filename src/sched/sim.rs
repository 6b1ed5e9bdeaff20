//! Deterministic multi-round simulation: [`simulate`] replays a budget sequence through
//! [`plan`] and [`apply`], growing running tenants' contexts between rounds, and returns one
//! [`RoundReport`] per round, and the worst round's overshoot ([`max_overshoot`]) — the
//! policy's "max overshoot ≤ 0" checked without an engine, in the property tests.

use serde::{Deserialize, Serialize};

use super::SchedError;
use super::model::{Policy, Snapshot, TenantId, usage};
use super::plan::{Lever, PlanMode, apply, plan};

/// How a simulation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SimOptions {
    /// Scheduler policy.
    pub policy: Policy,
    /// Tokens every running (admitted, unparked) tenant generates after each round.
    pub tokens_per_round: u64,
}

/// One round of a simulation. Usage is sampled after enforcement, before the round's tokens
/// are generated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundReport {
    /// Round index.
    pub round: usize,
    /// Budget of the round, bytes.
    pub budget: u64,
    /// Usage entering the round.
    pub usage_before: u64,
    /// Usage after the plan was applied.
    pub usage_after: u64,
    /// `usage_after − budget`; ≤ 0 when the plan was feasible.
    pub overshoot: i64,
    /// Whether the plan fitted the budget.
    pub feasible: bool,
    /// Kind of round.
    pub mode: PlanMode,
    /// The plan's actions.
    pub levers: Vec<(TenantId, Lever)>,
}

/// Runs one round per budget, starting from `initial` (whose own budget is ignored).
///
/// # Errors
///
/// [`SchedError`] if `initial` is invalid.
pub fn simulate(
    budgets: &[u64],
    initial: &Snapshot,
    options: &SimOptions,
) -> Result<Vec<RoundReport>, SchedError> {
    let mut snapshot = initial.clone();
    let mut reports = Vec::with_capacity(budgets.len());
    for (round, &budget) in budgets.iter().enumerate() {
        snapshot.budget_bytes = budget;
        let usage_before = usage(&snapshot);
        let plan = plan(&snapshot, &options.policy)?;
        snapshot = apply(&plan, &snapshot)?;
        let usage_after = usage(&snapshot);
        let overshoot = i128::from(usage_after) - i128::from(budget);
        reports.push(RoundReport {
            round,
            budget,
            usage_before,
            usage_after,
            overshoot: i64::try_from(overshoot).unwrap_or(if overshoot > 0 {
                i64::MAX
            } else {
                i64::MIN
            }),
            feasible: plan.feasible,
            mode: plan.mode,
            levers: plan.actions,
        });
        for t in snapshot.tenants.iter_mut().filter(|t| t.is_running()) {
            t.context_tokens = t.context_tokens.saturating_add(options.tokens_per_round);
        }
    }
    Ok(reports)
}

/// The largest overshoot over the rounds (`None` for no rounds).
#[must_use]
pub fn max_overshoot(reports: &[RoundReport]) -> Option<i64> {
    reports.iter().map(|r| r.overshoot).max()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{LeverKind, RungCost, TenantClass, TenantView};

    const MIB: u64 = 1 << 20;

    #[test]
    fn spike_and_recover_walks_down_and_back_up() {
        let rungs = vec![
            RungCost::new("tier0", 1066 * MIB, 28_708, 300 * MIB),
            RungCost::new("tier1", 718 * MIB, 28_708, 300 * MIB),
            RungCost::new("tier2", 469 * MIB, 12_321, 150 * MIB),
        ];
        let fg = TenantView::new(1, TenantClass::Foreground).with_context(200, 50);
        let initial = Snapshot::new(0, rungs, vec![fg]);
        // The shipped spike_and_recover trace, one round per token.
        let budgets: Vec<u64> = (0..200)
            .map(|t| match t {
                40..100 => 700,
                100..160 => 1300,
                _ => 2400,
            } * MIB)
            .collect();
        let options = SimOptions {
            policy: Policy::default(),
            tokens_per_round: 1,
        };
        let reports = simulate(&budgets, &initial, &options).expect("valid");
        assert!(max_overshoot(&reports).expect("rounds") <= 0);
        let moves: Vec<(usize, Lever)> = reports
            .iter()
            .flat_map(|r| r.levers.iter().map(move |(_, l)| (r.round, *l)))
            .collect();
        assert_eq!(
            moves,
            vec![
                (40, Lever::Demote { from: 0, to: 2 }),
                (100, Lever::Promote { from: 2, to: 1 }),
                (160, Lever::Promote { from: 1, to: 0 }),
            ]
        );
        assert!(reports.iter().all(|r| {
            r.levers
                .iter()
                .all(|(_, l)| l.kind() != Some(LeverKind::Park))
        }));
    }

    #[test]
    fn overshoot_is_reported_when_infeasible() {
        let rungs = vec![RungCost::new("only", 100, 10, 0)];
        let t = TenantView::new(1, TenantClass::Foreground).with_context(10, 10);
        let reports = simulate(
            &[5],
            &Snapshot::new(0, rungs, vec![t]),
            &SimOptions::default(),
        )
        .expect("ok");
        assert!(!reports[0].feasible);
        assert_eq!(reports[0].overshoot, 100 - 5);
        assert_eq!(max_overshoot(&[]), None);
    }
}
