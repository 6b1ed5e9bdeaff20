//! The multi-tenant scheduler: [`plan`] decides, [`apply`] performs the decision on a
//! snapshot.
//!
//! # Algorithm
//!
//! Each round is one of three [`PlanMode`]s:
//!
//! - **Relieve** — usage exceeds the budget: move to the least harmful configuration that
//!   fits the budget (harm as defined in the [room docs](super)).
//! - **Recover** — usage fits, and the least harmful configuration fitting
//!   `budget − hysteresis` is strictly less harmful than the current one: move there
//!   (promotions, resumptions; possibly a swap that favours a more protected tenant).
//! - **Hold** — otherwise: no change to running tenants.
//!
//! A parked tenant is not held to the margin: a configuration that resumes someone is taken
//! as soon as it fits the budget and is less harmful (a budget that stays put would never
//! clear the margin, and the parked answer would wait forever).
//!
//! Then waiting tenants are considered in protection order: each is admitted on the largest
//! rung (from its home down) that keeps usage within `budget − hysteresis` — else within the
//! budget itself — or deferred.
//!
//! The least harmful configuration is found exactly by fixing the harm vector's components
//! from most to least significant, each to the smallest value that still has a feasible
//! completion. Feasibility of a partial choice is exact and cheap because the cheapest
//! completion is known in closed form: an unfixed tenant is cheapest parked (parking only
//! removes weights) on its smallest-KV rung with everything sheddable shed; running tenants
//! with free rungs are placed by enumerating the subsets of resident rungs (at most
//! 2^[`MAX_RUNGS`](super::MAX_RUNGS)). Cost: O(tenants² × rungs × 2^rungs) per round.
//!
//! If even the cheapest configuration exceeds the budget, the plan takes it anyway (it
//! minimises the overshoot) and reports [`Plan::feasible`] = false with an [`Infeasible`]
//! reason. It never terminates a tenant.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::SchedError;
use super::model::{Policy, Snapshot, TenantId, protection_order, usage};

/// The four levers, in order of increasing harm (`Ord` follows harm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeverKind {
    /// 1: a waiting tenant keeps waiting.
    DeferAdmission,
    /// 2: move to a smaller rung.
    Demote,
    /// 3: release weights, keep KV.
    Park,
    /// 4: drop the oldest unpinned context.
    Shed,
}

/// One action of a plan, applied to one tenant. Harmful actions are the four levers; the
/// others undo them when memory allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "lever", rename_all = "snake_case")]
pub enum Lever {
    /// Lever 1: stays waiting.
    Defer,
    /// Starts, running on `rung`.
    Admit {
        /// Rung to start on.
        rung: usize,
    },
    /// Lever 2: migrate from `from` to the smaller rung `to`. For a parked tenant only its
    /// KV is transplanted.
    Demote {
        /// Current rung.
        from: usize,
        /// Smaller rung.
        to: usize,
    },
    /// Lever 3: release the weights of `rung`, keeping the KV in host memory.
    Park {
        /// Rung the tenant is on when parked: after a demotion in the same plan, before a
        /// promotion (a parked tenant's KV may then move to a larger rung's layout).
        rung: usize,
    },
    /// Lever 4: drop the oldest `tokens` unpinned tokens of the KV.
    Shed {
        /// Tokens dropped.
        tokens: u64,
    },
    /// Migrate from `from` to the larger rung `to`.
    Promote {
        /// Current rung.
        from: usize,
        /// Larger rung.
        to: usize,
    },
    /// Re-map `rung`'s weights and continue.
    Resume {
        /// Rung to resume on (after any rung change in the same plan).
        rung: usize,
    },
}

impl Lever {
    /// Which lever this is, or `None` for the actions that undo harm (admit, promote, resume).
    #[must_use]
    pub fn kind(&self) -> Option<LeverKind> {
        match self {
            Lever::Defer => Some(LeverKind::DeferAdmission),
            Lever::Demote { .. } => Some(LeverKind::Demote),
            Lever::Park { .. } => Some(LeverKind::Park),
            Lever::Shed { .. } => Some(LeverKind::Shed),
            Lever::Admit { .. } | Lever::Promote { .. } | Lever::Resume { .. } => None,
        }
    }

    /// Order of execution within a plan: memory is freed (shed, demote, park) before it is
    /// taken (promote, resume, admit).
    pub(super) fn phase(&self) -> u8 {
        match self {
            Lever::Shed { .. } => 0,
            Lever::Demote { .. } => 1,
            Lever::Park { .. } => 2,
            Lever::Promote { .. } => 3,
            Lever::Resume { .. } => 4,
            Lever::Admit { .. } => 5,
            Lever::Defer => 6,
        }
    }
}

/// Why the round's situation was what it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanMode {
    /// Usage fitted and nothing could be undone: running tenants unchanged.
    Hold,
    /// Usage exceeded the budget: levers applied.
    Relieve,
    /// The budget recovered past the hysteresis margin: harm undone.
    Recover,
}

/// The budget is below the least memory the tenants can occupy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Infeasible {
    /// The budget.
    pub budget_bytes: u64,
    /// Usage with every running tenant parked on its smallest-KV rung and shed to its pinned
    /// prefix.
    pub min_usage_bytes: u64,
}

impl fmt::Display for Infeasible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "budget of {} bytes is below the least the tenants can occupy ({} bytes: every \
             tenant parked on its cheapest rung, context shed to the pinned prompt); \
             overshoot {} bytes",
            self.budget_bytes,
            self.min_usage_bytes,
            self.min_usage_bytes.saturating_sub(self.budget_bytes)
        )
    }
}

/// What to do this round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Which kind of round this was.
    pub mode: PlanMode,
    /// Actions in execution order: frees before takes; within the harmful phases the least
    /// protected tenant first, within the others the most protected first. A tenant may have
    /// several (e.g. demote, then park).
    pub actions: Vec<(TenantId, Lever)>,
    /// [`usage`] after the actions.
    pub projected_usage: u64,
    /// The budget the plan was made for.
    pub budget_bytes: u64,
    /// `projected_usage ≤ budget_bytes`.
    pub feasible: bool,
    /// Set when not feasible.
    pub infeasible: Option<Infeasible>,
    /// Tenants making progress after the plan (admitted, not parked). Zero with
    /// `feasible = true` means the budget holds only parked KV: nothing can run.
    pub running: usize,
}

impl Plan {
    /// The levers (harmful actions) the plan uses, deduplicated, in harm order.
    #[must_use]
    pub fn levers_used(&self) -> Vec<LeverKind> {
        let mut kinds: Vec<LeverKind> = self.actions.iter().filter_map(|(_, l)| l.kind()).collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }
}

/// One running tenant's state in a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Choice {
    rung: usize,
    parked: bool,
    shed: u64,
}

/// A running tenant as the search sees it.
#[derive(Debug, Clone, Copy)]
struct Ten {
    index: usize,
    home: usize,
    tokens: u64,
    pinned: u64,
    /// Rung in `home..` with the least KV per token (ties: the larger rung).
    min_kv_rung: usize,
}

/// Rung costs widened to u128 so sums never overflow.
struct Costs {
    resident: Vec<u128>,
    kv: Vec<u128>,
    /// Per running tenant ([`super::RungCost::tenant_bytes`]).
    tenant: Vec<u128>,
    shared: bool,
    /// [`Policy::one_rung`], with shared weights: at most one rung holds running tenants.
    one_rung: bool,
    /// [`Snapshot::parked_kv_in_memory`]: a parked tenant's KV counts.
    parked_kv: bool,
}

/// A partial choice for one tenant during the search.
#[derive(Debug, Clone, Copy)]
struct Spec {
    tokens: u64,
    parked: Option<bool>,
    rung: Option<usize>,
}

impl Costs {
    fn of(snapshot: &Snapshot, policy: &Policy) -> Costs {
        Costs {
            resident: snapshot
                .rungs
                .iter()
                .map(|r| u128::from(r.resident_bytes()))
                .collect(),
            kv: snapshot
                .rungs
                .iter()
                .map(|r| u128::from(r.kv_bytes_per_token))
                .collect(),
            tenant: snapshot
                .rungs
                .iter()
                .map(|r| u128::from(r.tenant_bytes))
                .collect(),
            shared: snapshot.shared_weights,
            one_rung: policy.one_rung && snapshot.shared_weights,
            parked_kv: snapshot.parked_kv_in_memory,
        }
    }

    /// Whether `mask` (resident rungs) is a configuration this policy can carry out.
    fn allowed(&self, mask: u32) -> bool {
        !self.one_rung || mask.count_ones() <= 1
    }

    fn rungs(&self) -> usize {
        self.kv.len()
    }

    fn min_kv_rung(&self, home: usize) -> usize {
        (home..self.rungs())
            .min_by_key(|&r| self.kv[r])
            .unwrap_or(home)
    }

    /// Usage of a complete configuration.
    fn usage_of(&self, tens: &[Ten], choices: &[Choice]) -> u128 {
        let mut resident = 0u32;
        let mut total = 0u128;
        for (t, c) in tens.iter().zip(choices) {
            if !c.parked || self.parked_kv {
                total += self.kv[c.rung] * u128::from(t.tokens - c.shed);
            }
            if !c.parked {
                total += self.tenant[c.rung];
                if self.shared {
                    resident |= 1 << c.rung;
                } else {
                    total += self.resident[c.rung];
                }
            }
        }
        total + self.mask_cost(resident)
    }

    fn mask_cost(&self, mask: u32) -> u128 {
        (0..self.rungs())
            .filter(|r| mask & (1 << r) != 0)
            .map(|r| self.resident[r])
            .sum()
    }

    /// The least usage of any completion of a partial configuration: unfixed parks are
    /// parked, unfixed rungs of parked tenants take the smallest KV, unfixed rungs of running
    /// tenants are placed optimally over subsets of resident rungs.
    fn min_usage(&self, tens: &[Ten], specs: &[Spec]) -> u128 {
        let mut total = 0u128;
        let mut forced = 0u32;
        let mut free: Vec<(usize, u128)> = Vec::new();
        for (t, s) in tens.iter().zip(specs) {
            let tokens = u128::from(s.tokens);
            match (s.parked, s.rung) {
                (Some(false), Some(r)) => {
                    total += self.kv[r] * tokens + self.tenant[r];
                    if self.shared {
                        forced |= 1 << r;
                    } else {
                        total += self.resident[r];
                    }
                }
                (Some(false), None) => {
                    if self.shared {
                        free.push((t.home, tokens));
                    } else {
                        total += (t.home..self.rungs())
                            .map(|r| self.resident[r] + self.kv[r] * tokens + self.tenant[r])
                            .min()
                            .unwrap_or(0);
                    }
                }
                // Parked (or still open, cheapest parked): its KV, where it waits in memory.
                _ if !self.parked_kv => {}
                (_, Some(r)) => total += self.kv[r] * tokens,
                (_, None) => total += self.kv[t.min_kv_rung] * tokens,
            }
        }
        if !self.shared {
            return total;
        }
        if !self.allowed(forced) {
            return u128::MAX;
        }
        if free.is_empty() {
            return total + self.mask_cost(forced);
        }
        let mut best: Option<u128> = None;
        for mask in 0u32..(1 << self.rungs()) {
            if mask & forced != forced || !self.allowed(mask) {
                continue;
            }
            let mut cost = self.mask_cost(mask);
            let mut placeable = true;
            for &(home, tokens) in &free {
                let Some(kv) = (home..self.rungs())
                    .filter(|r| mask & (1 << r) != 0)
                    .map(|r| self.kv[r] * tokens + self.tenant[r])
                    .min()
                else {
                    placeable = false;
                    break;
                };
                cost += kv;
            }
            if placeable && best.is_none_or(|b| cost < b) {
                best = Some(cost);
            }
        }
        // Every free tenant can use its home rung, so the full mask is always placeable; with
        // one rung, the smallest of their homes is (a forced rung above one of them is not).
        total + best.unwrap_or(u128::MAX - total)
    }

    /// The least harmful configuration fitting `budget`, or `None` if none fits.
    fn least_harm(&self, tens: &[Ten], budget: u128, policy: &Policy) -> Option<Vec<Choice>> {
        let floor: u128 = tens
            .iter()
            .filter(|_| self.parked_kv)
            .map(|t| self.kv[t.min_kv_rung] * u128::from(t.pinned))
            .sum();
        if floor > budget {
            return None;
        }
        let n = tens.len();

        // Sheds, most protected first, each as small as the others' cheapest completion allows.
        // A parked cache in a file costs nothing, so parking, less harmful, always relieves
        // first: nothing is shed.
        let mut shed = vec![0u64; n];
        for i in (0..n).filter(|_| self.parked_kv) {
            let rest: u128 = tens
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(j, t)| {
                    let kept = if j < i { t.tokens - shed[j] } else { t.pinned };
                    self.kv[t.min_kv_rung] * u128::from(kept)
                })
                .sum();
            let available = budget.saturating_sub(rest);
            let per_token = self.kv[tens[i].min_kv_rung];
            let need = per_token * u128::from(tens[i].tokens);
            let minimal = if need <= available {
                0
            } else {
                // per_token > 0 here, since need > available ≥ 0.
                u64::try_from((need - available).div_ceil(per_token)).unwrap_or(u64::MAX)
            };
            shed[i] = policy.round_shed(minimal, tens[i].tokens - tens[i].pinned);
        }

        let mut specs: Vec<Spec> = tens
            .iter()
            .zip(&shed)
            .map(|(t, &s)| Spec {
                tokens: t.tokens - s,
                parked: None,
                rung: None,
            })
            .collect();

        // Parks, most protected first: run if any completion fits.
        for i in 0..n {
            specs[i].parked = Some(false);
            if self.min_usage(tens, &specs) > budget {
                specs[i].parked = Some(true);
            }
        }

        // Rungs, most protected first: the largest that still has a fitting completion.
        for i in 0..n {
            let mut chosen = None;
            let mut cheapest: Option<(u128, usize)> = None;
            for r in tens[i].home..self.rungs() {
                specs[i].rung = Some(r);
                let cost = self.min_usage(tens, &specs);
                if cost <= budget {
                    chosen = Some(r);
                    break;
                }
                if cheapest.is_none_or(|(c, _)| cost < c) {
                    cheapest = Some((cost, r));
                }
            }
            // The invariant (a fitting completion exists before each step) makes `chosen`
            // always Some; the fallback only keeps this total without a panic.
            specs[i].rung = chosen.or(cheapest.map(|(_, r)| r));
        }

        Some(
            specs
                .iter()
                .zip(&shed)
                .map(|(s, &shed)| Choice {
                    rung: s.rung.unwrap_or(0),
                    parked: s.parked.unwrap_or(true),
                    shed,
                })
                .collect(),
        )
    }

    /// The configuration with the least usage: everyone parked on the smallest-KV rung, shed
    /// to the pinned prefix.
    fn cheapest(tens: &[Ten]) -> Vec<Choice> {
        tens.iter()
            .map(|t| Choice {
                rung: t.min_kv_rung,
                parked: true,
                shed: t.tokens - t.pinned,
            })
            .collect()
    }
}

/// The harm vector of a configuration (see the room docs); `tens` in protection order.
fn harm(tens: &[Ten], choices: &[Choice]) -> Vec<u64> {
    let mut h = Vec::with_capacity(3 * tens.len());
    h.extend(choices.iter().map(|c| c.shed));
    h.extend(choices.iter().map(|c| u64::from(c.parked)));
    h.extend(
        tens.iter()
            .zip(choices)
            .map(|(t, c)| (c.rung - t.home) as u64),
    );
    h
}

/// Decides this round's actions. Pure: reads the snapshot, changes nothing.
///
/// # Errors
///
/// [`SchedError`] if the snapshot fails [`Snapshot::validate`].
pub fn plan(snapshot: &Snapshot, policy: &Policy) -> Result<Plan, SchedError> {
    snapshot.validate()?;
    let costs = Costs::of(snapshot, policy);
    let order = protection_order(&snapshot.tenants);
    let tens: Vec<Ten> = order
        .iter()
        .filter(|&&i| snapshot.tenants[i].admitted)
        .map(|&i| {
            let t = &snapshot.tenants[i];
            Ten {
                index: i,
                home: t.home_rung,
                tokens: t.context_tokens,
                pinned: t.pinned_tokens,
                min_kv_rung: costs.min_kv_rung(t.home_rung),
            }
        })
        .collect();
    let current: Vec<Choice> = tens
        .iter()
        .map(|t| {
            let v = &snapshot.tenants[t.index];
            Choice {
                rung: v.rung,
                parked: v.parked,
                shed: 0,
            }
        })
        .collect();

    let budget = u128::from(snapshot.budget_bytes);
    let margin_budget = budget.saturating_sub(u128::from(policy.hysteresis_bytes));
    let (mode, target, infeasible) = if u128::from(usage(snapshot)) > budget {
        match costs.least_harm(&tens, budget, policy) {
            Some(t) => (PlanMode::Relieve, t, false),
            None => (PlanMode::Relieve, Costs::cheapest(&tens), true),
        }
    } else {
        let better = |t: &Vec<Choice>| harm(&tens, t) < harm(&tens, &current);
        // The margin keeps tenants from flapping between rungs; it must not keep a parked
        // tenant waiting under a budget that holds it running (a budget that stays put would
        // never clear the margin): a configuration that resumes someone needs only to fit.
        let resumes = |t: &Vec<Choice>| t.iter().zip(&current).any(|(a, b)| b.parked && !a.parked);
        match costs.least_harm(&tens, budget, policy) {
            Some(t) if resumes(&t) && better(&t) => (PlanMode::Recover, t, false),
            _ => match costs.least_harm(&tens, margin_budget, policy) {
                Some(t) if better(&t) => (PlanMode::Recover, t, false),
                _ => (PlanMode::Hold, current.clone(), false),
            },
        }
    };

    let (mut harmful, mut helpful) = transitions(snapshot, &tens, &current, &target);
    let (tens_after, choices_after) = if infeasible {
        (tens, target)
    } else {
        admit(
            snapshot,
            &costs,
            &order,
            tens,
            target,
            (margin_budget, budget),
            &mut helpful,
        )
    };
    // Deferred: every waiting tenant that was not admitted.
    for (rank, &i) in order.iter().enumerate() {
        let t = &snapshot.tenants[i];
        let admitted_now = helpful
            .iter()
            .any(|&(_, id, lever)| id == t.id && matches!(lever, Lever::Admit { .. }));
        if !t.admitted && !admitted_now {
            helpful.push((rank, t.id, Lever::Defer));
        }
    }

    // Frees before takes; harm falls on the least protected first, relief of harm on the
    // most protected first.
    harmful.sort_by_key(|&(rank, _, lever)| (lever.phase(), std::cmp::Reverse(rank)));
    helpful.sort_by_key(|&(rank, _, lever)| (lever.phase(), rank));
    let actions: Vec<(TenantId, Lever)> = harmful
        .into_iter()
        .chain(helpful)
        .map(|(_, id, lever)| (id, lever))
        .collect();

    let projected = costs.usage_of(&tens_after, &choices_after);
    let projected_usage = u64::try_from(projected).unwrap_or(u64::MAX);
    let feasible = projected <= budget;
    Ok(Plan {
        mode,
        actions,
        projected_usage,
        budget_bytes: snapshot.budget_bytes,
        feasible,
        infeasible: (!feasible).then_some(Infeasible {
            budget_bytes: snapshot.budget_bytes,
            min_usage_bytes: projected_usage,
        }),
        running: choices_after.iter().filter(|c| !c.parked).count(),
    })
}

/// An action with the acting tenant's protection rank (0 = most protected), for ordering.
type Ranked = (usize, TenantId, Lever);

/// The actions taking each running tenant from `current` to `target`, split into harmful
/// (levers) and helpful (their undoing).
fn transitions(
    snapshot: &Snapshot,
    tens: &[Ten],
    current: &[Choice],
    target: &[Choice],
) -> (Vec<Ranked>, Vec<Ranked>) {
    let mut harmful = Vec::new();
    let mut helpful = Vec::new();
    for (rank, ((t, now), next)) in tens.iter().zip(current).zip(target).enumerate() {
        let id = snapshot.tenants[t.index].id;
        if next.shed > 0 {
            harmful.push((rank, id, Lever::Shed { tokens: next.shed }));
        }
        let (from, to) = (now.rung, next.rung);
        if to > from {
            harmful.push((rank, id, Lever::Demote { from, to }));
        } else if to < from {
            helpful.push((rank, id, Lever::Promote { from, to }));
        }
        match (now.parked, next.parked) {
            // Parking runs after demotions and before promotions (see `Lever::phase`), so
            // it happens on the smaller of the two rungs.
            (false, true) => harmful.push((rank, id, Lever::Park { rung: to.max(from) })),
            (true, false) => helpful.push((rank, id, Lever::Resume { rung: to })),
            _ => {}
        }
    }
    (harmful, helpful)
}

/// Admits waiting tenants, most protected first, each on the largest rung that keeps usage
/// within `margin_budget` — or, when none does, within `budget` itself (a request must not
/// wait forever under a budget that holds it); returns the configuration including them.
fn admit(
    snapshot: &Snapshot,
    costs: &Costs,
    order: &[usize],
    mut tens: Vec<Ten>,
    mut choices: Vec<Choice>,
    (margin_budget, budget): (u128, u128),
    helpful: &mut Vec<Ranked>,
) -> (Vec<Ten>, Vec<Choice>) {
    for (rank, &i) in order.iter().enumerate() {
        let t = &snapshot.tenants[i];
        if t.admitted {
            continue;
        }
        tens.push(Ten {
            index: i,
            home: t.home_rung,
            tokens: t.context_tokens,
            pinned: t.pinned_tokens,
            min_kv_rung: costs.min_kv_rung(t.home_rung),
        });
        // With one rung, a newcomer runs where the running tenants do.
        let running_on = choices
            .iter()
            .find(|c| !c.parked)
            .map(|c| c.rung)
            .filter(|_| costs.one_rung);
        let mut fits_within = |limit: u128| {
            (t.home_rung..costs.rungs()).find(|&rung| {
                if running_on.is_some_and(|r| r != rung) {
                    return false;
                }
                choices.push(Choice {
                    rung,
                    parked: false,
                    shed: 0,
                });
                let fits = costs.usage_of(&tens, &choices) <= limit;
                choices.pop();
                fits
            })
        };
        let fits = fits_within(margin_budget).or_else(|| fits_within(budget));
        match fits {
            Some(rung) => {
                choices.push(Choice {
                    rung,
                    parked: false,
                    shed: 0,
                });
                helpful.push((rank, t.id, Lever::Admit { rung }));
            }
            None => {
                tens.pop();
            }
        }
    }
    (tens, choices)
}

/// Performs a plan on a snapshot and returns the result — the pure counterpart of the
/// session's apply step, for simulation and tests. Tenants are never removed; the budget is
/// kept.
///
/// # Errors
///
/// [`SchedError::UnknownTenant`], [`SchedError::StalePlan`] (an action assumes a rung the
/// tenant is not on) or [`SchedError::ShedBelowPinned`] when the plan was not made for this
/// snapshot.
pub fn apply(plan: &Plan, snapshot: &Snapshot) -> Result<Snapshot, SchedError> {
    let mut next = snapshot.clone();
    for &(id, lever) in &plan.actions {
        let t = next
            .tenants
            .iter_mut()
            .find(|t| t.id == id)
            .ok_or(SchedError::UnknownTenant { tenant: id })?;
        let expect_rung = |t: &super::TenantView, expected: usize| {
            if t.rung == expected {
                Ok(())
            } else {
                Err(SchedError::StalePlan {
                    tenant: id,
                    expected,
                    actual: t.rung,
                })
            }
        };
        match lever {
            Lever::Defer => {}
            Lever::Admit { rung } => {
                t.admitted = true;
                t.parked = false;
                t.rung = rung;
            }
            Lever::Demote { from, to } | Lever::Promote { from, to } => {
                expect_rung(t, from)?;
                t.rung = to;
            }
            Lever::Park { rung } => {
                expect_rung(t, rung)?;
                t.parked = true;
            }
            Lever::Resume { rung } => {
                expect_rung(t, rung)?;
                t.parked = false;
            }
            Lever::Shed { tokens } => {
                let sheddable = t.sheddable_tokens();
                if tokens > sheddable {
                    return Err(SchedError::ShedBelowPinned {
                        tenant: id,
                        tokens,
                        sheddable,
                    });
                }
                t.context_tokens -= tokens;
            }
        }
    }
    Ok(next)
}

#[cfg(test)]
mod tests;
