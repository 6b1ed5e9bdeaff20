//! The one-tenant policy: [`decide_one`] → [`Decision`].
//!
//! One tenant, one budget: demote to the largest rung that fits; if none fits, park (on the
//! largest rung whose KV alone fits); if still nothing fits, shed the oldest context; promote
//! once the budget clears the larger configuration's need by the hysteresis margin; resume
//! as soon as running fits the budget at all.
//!
//! Written independently of [`plan`](super::plan()) — by enumerating every (rung, parked)
//! pair with its minimal shed — so that the two can check each other: for a snapshot with a
//! single admitted tenant they must agree (a property test does exactly that).

use serde::{Deserialize, Serialize};

use super::SchedError;
use super::model::{Policy, RungCost, TenantView};

/// What one tenant should do; each variant states the tenant's state afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Nothing changes.
    Stay,
    /// A waiting tenant starts, running on `rung`.
    Admit {
        /// Rung to start on.
        rung: usize,
    },
    /// Moves to the smaller rung `to`; running or parked as before.
    Demote {
        /// Smaller rung.
        to: usize,
    },
    /// Moves to the larger rung `to`; running or parked as before.
    Promote {
        /// Larger rung.
        to: usize,
    },
    /// Parks, its KV in the layout of `rung` (migrated first if that is not its rung).
    Park {
        /// Rung it is parked on.
        rung: usize,
    },
    /// Runs again, on `rung`.
    Resume {
        /// Rung it resumes on.
        rung: usize,
    },
    /// Drops its oldest `tokens` unpinned tokens and ends on `rung`, parked or running as
    /// `parked` says.
    Shed {
        /// Tokens dropped.
        tokens: u64,
        /// Rung afterwards.
        rung: usize,
        /// Parked afterwards.
        parked: bool,
    },
}

impl Decision {
    /// The tenant as it is after the decision.
    #[must_use]
    pub fn apply_to(&self, view: &TenantView) -> TenantView {
        let mut v = view.clone();
        match *self {
            Decision::Stay => {}
            Decision::Admit { rung } => {
                v.admitted = true;
                v.parked = false;
                v.rung = rung;
            }
            Decision::Demote { to } | Decision::Promote { to } => v.rung = to,
            Decision::Park { rung } => {
                v.rung = rung;
                v.parked = true;
            }
            Decision::Resume { rung } => {
                v.rung = rung;
                v.parked = false;
            }
            Decision::Shed {
                tokens,
                rung,
                parked,
            } => {
                v.context_tokens = v.context_tokens.saturating_sub(tokens);
                v.rung = rung;
                v.parked = parked;
            }
        }
        v
    }
}

/// Bytes one tenant occupies on `rung` with `tokens` of context.
fn need(rung: &RungCost, parked: bool, tokens: u64) -> u128 {
    let weights = if parked {
        0
    } else {
        u128::from(rung.resident_bytes()) + u128::from(rung.tenant_bytes)
    };
    weights + u128::from(rung.kv_bytes_per_token) * u128::from(tokens)
}

/// `(shed, parked, demotion)` — the harm key, compared lexicographically — with the rung.
type Candidate = ((u64, bool, usize), usize);

/// The least harmful `(shed, parked, rung)` fitting `budget`, by enumeration.
fn best(view: &TenantView, rungs: &[RungCost], budget: u128, policy: &Policy) -> Option<Candidate> {
    let sheddable = view.sheddable_tokens();
    let mut best: Option<Candidate> = None;
    for (r, rung) in rungs.iter().enumerate().skip(view.home_rung) {
        for parked in [false, true] {
            let full = need(rung, parked, view.context_tokens);
            let minimal = if full <= budget {
                0
            } else {
                let per_token = u128::from(rung.kv_bytes_per_token);
                if per_token == 0 {
                    continue;
                }
                u64::try_from((full - budget).div_ceil(per_token)).unwrap_or(u64::MAX)
            };
            if minimal > sheddable {
                continue;
            }
            let key = (
                policy.round_shed(minimal, sheddable),
                parked,
                r - view.home_rung,
            );
            if best.is_none_or(|(b, _)| key < b) {
                best = Some((key, r));
            }
        }
    }
    best
}

fn decision_for(view: &TenantView, shed: u64, parked: bool, rung: usize) -> Decision {
    if shed > 0 {
        Decision::Shed {
            tokens: shed,
            rung,
            parked,
        }
    } else if parked != view.parked {
        if parked {
            Decision::Park { rung }
        } else {
            Decision::Resume { rung }
        }
    } else if rung > view.rung {
        Decision::Demote { to: rung }
    } else if rung < view.rung {
        Decision::Promote { to: rung }
    } else {
        Decision::Stay
    }
}

/// Decides for one tenant alone under `budget` bytes.
///
/// - Waiting: [`Decision::Admit`] on the largest rung that fits `budget − hysteresis`, else
///   on the largest that fits `budget`, else [`Decision::Stay`] (deferred).
/// - Over budget: the least harmful state that fits — the largest running rung; else parked
///   on the largest rung whose KV fits; else the fewest shed tokens. If nothing fits, the
///   cheapest state (parked on the smallest-KV rung, shed to the pinned prompt) — check the
///   result with [`need_after`] against the budget to see the overshoot.
/// - Within budget: a less harmful state is taken only if it fits `budget − hysteresis`;
///   a parked tenant resumes as soon as running fits `budget` itself.
///
/// # Errors
///
/// [`SchedError`] if `rungs` is empty or the view's indices or pinned count are invalid.
pub fn decide_one(
    view: &TenantView,
    budget: u64,
    rungs: &[RungCost],
    policy: &Policy,
) -> Result<Decision, SchedError> {
    if rungs.is_empty() {
        return Err(SchedError::NoRungs);
    }
    view.validate(rungs.len())?;
    let budget = u128::from(budget);
    let margin_budget = budget.saturating_sub(u128::from(policy.hysteresis_bytes));

    if !view.admitted {
        // The largest rung within the margin, else within the budget itself: a request must
        // not wait forever under a budget that holds it.
        let fits_within = |limit: u128| {
            (view.home_rung..rungs.len())
                .find(|&r| need(&rungs[r], false, view.context_tokens) <= limit)
        };
        let fits = fits_within(margin_budget).or_else(|| fits_within(budget));
        return Ok(fits.map_or(Decision::Stay, |rung| Decision::Admit { rung }));
    }

    let now = need(&rungs[view.rung], view.parked, view.context_tokens);
    if now > budget {
        if let Some(((shed, parked, _), rung)) = best(view, rungs, budget, policy) {
            return Ok(decision_for(view, shed, parked, rung));
        }
        // Nothing fits: the cheapest state, to keep the overshoot as small as it can be.
        let rung = (view.home_rung..rungs.len())
            .min_by_key(|&r| rungs[r].kv_bytes_per_token)
            .unwrap_or(view.rung);
        return Ok(decision_for(view, view.sheddable_tokens(), true, rung));
    }
    let current = (0, view.parked, view.rung - view.home_rung);
    // The margin keeps a tenant from flapping between rungs; it must not keep a parked one
    // waiting under a budget that holds it running: with a budget that stays where it is,
    // the margin would never be met and the answer would wait forever.
    if view.parked
        && let Some((key, rung)) = best(view, rungs, budget, policy)
        && !key.1
        && key < current
    {
        return Ok(decision_for(view, key.0, key.1, rung));
    }
    Ok(match best(view, rungs, margin_budget, policy) {
        Some((key, rung)) if key < current => decision_for(view, key.0, key.1, rung),
        _ => Decision::Stay,
    })
}

/// Bytes the tenant occupies after `decision` (0 if it is still waiting).
#[must_use]
pub fn need_after(view: &TenantView, decision: &Decision, rungs: &[RungCost]) -> u64 {
    let v = decision.apply_to(view);
    if !v.admitted {
        return 0;
    }
    rungs.get(v.rung).map_or(0, |r| {
        u64::try_from(need(r, v.parked, v.context_tokens)).unwrap_or(u64::MAX)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::TenantClass;

    const MIB: u64 = 1 << 20;

    fn ladder() -> Vec<RungCost> {
        vec![
            RungCost::new("tier0", 1000 * MIB, MIB / 32, 300 * MIB),
            RungCost::new("tier1", 700 * MIB, MIB / 32, 300 * MIB),
            RungCost::new("tier2", 450 * MIB, MIB / 64, 150 * MIB),
        ]
    }

    /// 320 tokens: 10 MiB of KV on tier0/1, 5 MiB on tier2; 32 pinned.
    fn tenant() -> TenantView {
        TenantView::new(1, TenantClass::Foreground).with_context(320, 32)
    }

    fn decide(view: &TenantView, budget_mib: u64) -> Decision {
        decide_one(view, budget_mib * MIB, &ladder(), &Policy::default()).expect("valid")
    }

    #[test]
    fn walks_down_the_ladder() {
        let t = tenant();
        assert_eq!(decide(&t, 2000), Decision::Stay);
        assert_eq!(
            decide(&t, 1310),
            Decision::Stay,
            "1310 MiB is exactly tier0's need"
        );
        assert_eq!(decide(&t, 1309), Decision::Demote { to: 1 });
        assert_eq!(decide(&t, 1009), Decision::Demote { to: 2 });
        assert_eq!(decide(&t, 604), Decision::Park { rung: 0 });
        assert_eq!(decide(&t, 9), Decision::Park { rung: 2 });
        // 4 MiB: parked on tier2 (5 MiB of KV) needs 64 tokens shed, rounded to 2 chunks.
        assert_eq!(
            decide(&t, 4),
            Decision::Shed {
                tokens: 64,
                rung: 2,
                parked: true
            }
        );
        let d = decide(&t, 0);
        assert_eq!(
            d,
            Decision::Shed {
                tokens: 288,
                rung: 2,
                parked: true
            },
            "nothing fits: the cheapest state"
        );
        assert_eq!(need_after(&t, &d, &ladder()), MIB / 2);
    }

    #[test]
    fn promotes_only_past_the_margin() {
        let on_tier2 = tenant().with_rung(2);
        // tier1 needs 1010 MiB; the margin is 128 MiB.
        assert_eq!(decide(&on_tier2, 1137), Decision::Stay);
        assert_eq!(decide(&on_tier2, 1138), Decision::Promote { to: 1 });
        assert_eq!(decide(&on_tier2, 1438), Decision::Promote { to: 0 });
        let parked = tenant().with_rung(2).with_parked(true);
        assert_eq!(decide(&parked, 5 + 128 - 1), Decision::Stay);
        // Not enough to run, but enough to hold the KV in the home rung's layout: parking on
        // a larger rung is less harm (resuming there needs no further transplant), so the
        // parked KV moves up.
        assert_eq!(decide(&parked, 600), Decision::Promote { to: 0 });
        assert_eq!(decide(&parked, 5000), Decision::Resume { rung: 0 });
    }

    #[test]
    fn a_parked_tenant_resumes_as_soon_as_running_fits() {
        let parked = tenant().with_rung(2).with_parked(true);
        // tier2 running needs 605 MiB: one MiB short waits, the exact need resumes — no
        // margin, or a budget that stays at 605 would keep the answer parked forever.
        assert_eq!(decide(&parked, 604), Decision::Promote { to: 0 });
        assert_eq!(decide(&parked, 605), Decision::Resume { rung: 2 });
        // Resumed, the same budget changes nothing.
        let resumed = Decision::Resume { rung: 2 }.apply_to(&parked);
        assert_eq!(decide(&resumed, 605), Decision::Stay);
        // It resumes on the largest rung that runs within the budget (tier1 needs 1010 MiB).
        assert_eq!(decide(&parked, 1010), Decision::Resume { rung: 1 });
    }

    #[test]
    fn admission_prefers_the_margin_and_takes_the_largest_fitting_rung() {
        let waiting = tenant().waiting();
        assert_eq!(decide(&waiting, 5000), Decision::Admit { rung: 0 });
        assert_eq!(decide(&waiting, 1310), Decision::Admit { rung: 1 });
        // tier2 needs 605 MiB: within the budget but not the margin, it is still admitted
        // (a request must not wait forever under a budget that holds it).
        assert_eq!(decide(&waiting, 700), Decision::Admit { rung: 2 });
        assert_eq!(decide(&waiting, 604), Decision::Stay);
    }

    #[test]
    fn home_rung_caps_promotion() {
        let small_only = tenant().with_home(2);
        assert_eq!(decide(&small_only, 100_000), Decision::Stay);
    }

    #[test]
    fn invalid_views_are_errors() {
        let policy = Policy::default();
        assert_eq!(
            decide_one(&tenant(), 1, &[], &policy),
            Err(SchedError::NoRungs)
        );
        assert!(decide_one(&tenant().with_rung(7), 1, &ladder(), &policy).is_err());
    }

    /// The shipped ladder's shape: the 1.5B at Q4_K_M, two precision rungs of the same weights
    /// (Q3_K_M, Q2_K) and the 0.5B (other geometry: half the KV per token). Costs as
    /// `bench --precision` measured them, rounded to MiB.
    fn precision_ladder() -> Vec<RungCost> {
        vec![
            RungCost::new("tier0", 1066 * MIB, MIB / 36, 300 * MIB),
            RungCost::new("q3km", 824 * MIB, MIB / 36, 300 * MIB),
            RungCost::new("q2k", 718 * MIB, MIB / 36, 300 * MIB),
            RungCost::new("small", 469 * MIB, MIB / 85, 150 * MIB),
        ]
    }

    #[test]
    fn a_precision_rung_that_fits_is_taken_before_the_smaller_family() {
        // The size route (to the 0.5B) loses facts a precision route keeps, so the smaller
        // family is taken only when no rung of the largest one fits running: at every budget
        // from tier0's need down to the 0.5B's, the decision is the largest 1.5B rung that
        // fits, and the 0.5B exactly when none does.
        let rungs = precision_ladder();
        let t = TenantView::new(1, TenantClass::Foreground).with_context(1024, 32);
        let policy = Policy::default();
        let needs: Vec<u64> = rungs
            .iter()
            .map(|r| u64::try_from(need(r, false, t.context_tokens)).expect("small"))
            .collect();
        let mut seen = [false; 4];
        let sweep = (needs[3]..needs[0]).step_by(usize::try_from(MIB).expect("fits"));
        for budget in sweep.chain([needs[0]]) {
            let d = decide_one(&t, budget, &rungs, &policy).expect("valid");
            let rung = match d {
                Decision::Stay => 0,
                Decision::Demote { to } => to,
                other => panic!("budget {budget}: unexpected {other:?}"),
            };
            let largest_fitting = (0..3).find(|&r| needs[r] <= budget);
            let expected = largest_fitting.unwrap_or(3);
            assert_eq!(rung, expected, "budget {} MiB", budget / MIB);
            seen[rung] = true;
        }
        assert_eq!(seen, [true; 4], "the sweep crosses every rung");
    }
}
