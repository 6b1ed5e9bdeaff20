//! The scheduler's inputs — [`RungCost`], [`TenantView`], [`Snapshot`], [`Policy`] — and the
//! accounting over them: [`usage`] and [`protection_order`].

use std::cmp::Reverse;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::SchedError;

/// Most rungs a ladder may have: the planner enumerates subsets of resident rungs (2^rungs).
pub const MAX_RUNGS: usize = 8;

/// What running on one rung costs. Index 0 of a ladder is the largest rung.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RungCost {
    /// Rung name, e.g. `tier0`.
    pub name: String,
    /// Resident bytes of the rung's weights while mapped.
    pub weights_bytes: u64,
    /// KV bytes per context token on this rung.
    pub kv_bytes_per_token: u64,
    /// Compute buffer bytes of the rung's context while it is resident.
    pub compute_bytes: u64,
    /// Bytes every running (admitted, unparked) tenant on this rung pays for itself, on top of
    /// the shared weights: its own context's buffers when each tenant has a context of its
    /// own over one mapping of the weights. 0 when tenants are sequences of one context.
    #[serde(default)]
    pub tenant_bytes: u64,
}

impl RungCost {
    /// A rung cost.
    #[must_use]
    pub fn new(
        name: &str,
        weights_bytes: u64,
        kv_bytes_per_token: u64,
        compute_bytes: u64,
    ) -> RungCost {
        RungCost {
            name: name.to_owned(),
            weights_bytes,
            kv_bytes_per_token,
            compute_bytes,
            tenant_bytes: 0,
        }
    }

    /// Sets the per-running-tenant cost (see [`RungCost::tenant_bytes`]).
    #[must_use]
    pub fn with_tenant_bytes(mut self, tenant_bytes: u64) -> RungCost {
        self.tenant_bytes = tenant_bytes;
        self
    }

    /// Weights plus compute buffers: what the rung costs while resident, whatever its KV.
    #[must_use]
    pub fn resident_bytes(&self) -> u64 {
        self.weights_bytes.saturating_add(self.compute_bytes)
    }

    /// KV bytes of `tokens` context tokens on this rung.
    #[must_use]
    pub fn kv_bytes(&self, tokens: u64) -> u64 {
        self.kv_bytes_per_token.saturating_mul(tokens)
    }
}

/// A tenant's identity, stable across rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantId(pub u64);

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Whether a user is waiting on the tenant's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantClass {
    /// The conversation in front of the user: protected longest within every lever.
    Foreground,
    /// Batch or speculative work.
    Background,
}

/// What the scheduler knows of one tenant (a generation with its own KV sequence).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantView {
    /// Identity.
    pub id: TenantId,
    /// Foreground or background.
    pub class: TenantClass,
    /// Started. A tenant not admitted costs nothing and waits (lever 1).
    pub admitted: bool,
    /// Rung it runs on (or, parked, whose layout its KV is in). Ignored until admitted.
    pub rung: usize,
    /// Largest rung it may use (normally 0); promotion stops there.
    pub home_rung: usize,
    /// Weights released, KV kept in host memory (lever 3).
    pub parked: bool,
    /// Tokens in its KV: prompt plus generated (for a waiting tenant, the prompt to prefill).
    pub context_tokens: u64,
    /// Leading tokens that are never shed (the system prompt).
    pub pinned_tokens: u64,
    /// Higher is protected longer within its class (the HTTP API's `molt.priority`, any
    /// `i32`).
    pub priority: i32,
    /// Arrival order; earlier is protected longer (it has more invested).
    pub arrival: u64,
}

impl TenantView {
    /// An admitted, running tenant on rung 0 with home rung 0, no context, priority 0, arrival
    /// equal to its id. Adjust with the `with_*` builders.
    #[must_use]
    pub fn new(id: u64, class: TenantClass) -> TenantView {
        TenantView {
            id: TenantId(id),
            class,
            admitted: true,
            rung: 0,
            home_rung: 0,
            parked: false,
            context_tokens: 0,
            pinned_tokens: 0,
            priority: 0,
            arrival: id,
        }
    }

    /// Sets context and pinned tokens.
    #[must_use]
    pub fn with_context(mut self, context_tokens: u64, pinned_tokens: u64) -> TenantView {
        self.context_tokens = context_tokens;
        self.pinned_tokens = pinned_tokens;
        self
    }

    /// Puts it on `rung`.
    #[must_use]
    pub fn with_rung(mut self, rung: usize) -> TenantView {
        self.rung = rung;
        self
    }

    /// Sets its home rung (and moves it there if it was above).
    #[must_use]
    pub fn with_home(mut self, home_rung: usize) -> TenantView {
        self.home_rung = home_rung;
        self.rung = self.rung.max(home_rung);
        self
    }

    /// Marks it parked or running.
    #[must_use]
    pub fn with_parked(mut self, parked: bool) -> TenantView {
        self.parked = parked;
        self
    }

    /// Marks it waiting for admission (not admitted, not parked).
    #[must_use]
    pub fn waiting(mut self) -> TenantView {
        self.admitted = false;
        self.parked = false;
        self
    }

    /// Sets priority and arrival.
    #[must_use]
    pub fn with_order(mut self, priority: i32, arrival: u64) -> TenantView {
        self.priority = priority;
        self.arrival = arrival;
        self
    }

    /// Admitted and not parked: it makes progress.
    #[must_use]
    pub fn is_running(&self) -> bool {
        self.admitted && !self.parked
    }

    /// Tokens that may be shed.
    #[must_use]
    pub fn sheddable_tokens(&self) -> u64 {
        self.context_tokens.saturating_sub(self.pinned_tokens)
    }

    pub(crate) fn validate(&self, rungs: usize) -> Result<(), SchedError> {
        let tenant = self.id;
        if self.rung >= rungs {
            return Err(SchedError::RungOutOfRange {
                tenant,
                rung: self.rung,
                rungs,
            });
        }
        if self.home_rung >= rungs {
            return Err(SchedError::HomeOutOfRange {
                tenant,
                home: self.home_rung,
                rungs,
            });
        }
        if self.admitted && self.rung < self.home_rung {
            return Err(SchedError::RungAboveHome {
                tenant,
                rung: self.rung,
                home: self.home_rung,
            });
        }
        if self.pinned_tokens > self.context_tokens {
            return Err(SchedError::PinnedExceedsContext {
                tenant,
                pinned: self.pinned_tokens,
                context: self.context_tokens,
            });
        }
        if self.parked && !self.admitted {
            return Err(SchedError::ParkedButNotAdmitted { tenant });
        }
        Ok(())
    }
}

/// Everything the scheduler decides over, taken between two tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Bytes the tenants may occupy together.
    pub budget_bytes: u64,
    /// The ladder, index 0 largest.
    pub rungs: Vec<RungCost>,
    /// All tenants, admitted or waiting.
    pub tenants: Vec<TenantView>,
    /// Tenants on one rung share one mapping of its weights and one context's compute
    /// buffers (Molt: one model, tenants as sequences). When false, every running tenant pays
    /// for its own (separate processes, or copies).
    pub shared_weights: bool,
    /// A parked tenant's KV waits in host memory (true, the default: it counts) or in a file
    /// (false: the batched server writes a set-aside answer's cache to its state directory,
    /// and it costs nothing until it resumes).
    pub parked_kv_in_memory: bool,
}

impl Snapshot {
    /// A snapshot with shared weights.
    #[must_use]
    pub fn new(budget_bytes: u64, rungs: Vec<RungCost>, tenants: Vec<TenantView>) -> Snapshot {
        Snapshot {
            budget_bytes,
            rungs,
            tenants,
            shared_weights: true,
            parked_kv_in_memory: true,
        }
    }

    /// Checks indices, pinned counts and ids.
    ///
    /// # Errors
    ///
    /// The first [`SchedError`] found: no or too many rungs, a rung or home out of range, a
    /// rung above home, more pinned than context tokens, a parked waiting tenant, a duplicate
    /// id.
    pub fn validate(&self) -> Result<(), SchedError> {
        if self.rungs.is_empty() {
            return Err(SchedError::NoRungs);
        }
        if self.rungs.len() > MAX_RUNGS {
            return Err(SchedError::TooManyRungs {
                count: self.rungs.len(),
                max: MAX_RUNGS,
            });
        }
        let mut ids = std::collections::BTreeSet::new();
        for t in &self.tenants {
            t.validate(self.rungs.len())?;
            if !ids.insert(t.id) {
                return Err(SchedError::DuplicateTenant { tenant: t.id });
            }
        }
        Ok(())
    }
}

/// Bytes the snapshot's tenants occupy:
///
/// - with shared weights: the weights and compute buffers of every rung that has at least
///   one admitted, unparked tenant, **once per rung**; otherwise once per such tenant;
/// - plus every admitted tenant's KV (`context_tokens × kv_bytes_per_token` of its rung),
///   parked or not — parked KV is held in host memory (unless
///   [`Snapshot::parked_kv_in_memory`] is false: then a parked tenant's KV costs nothing);
/// - plus [`RungCost::tenant_bytes`] for every admitted, unparked tenant.
///
/// Waiting tenants cost nothing. Out-of-range rungs (an invalid snapshot) count 0 rather than
/// panic; [`Snapshot::validate`] reports them.
#[must_use]
pub fn usage(snapshot: &Snapshot) -> u64 {
    let mut resident = [false; MAX_RUNGS];
    let mut total = 0u64;
    for t in snapshot.tenants.iter().filter(|t| t.admitted) {
        let Some(rung) = snapshot.rungs.get(t.rung) else {
            continue;
        };
        if !t.parked || snapshot.parked_kv_in_memory {
            total = total.saturating_add(rung.kv_bytes(t.context_tokens));
        }
        if !t.parked {
            total = total.saturating_add(rung.tenant_bytes);
            if snapshot.shared_weights {
                if let Some(flag) = resident.get_mut(t.rung) {
                    *flag = true;
                }
            } else {
                total = total.saturating_add(rung.resident_bytes());
            }
        }
    }
    for (rung, _) in snapshot
        .rungs
        .iter()
        .zip(resident)
        .filter(|(_, resident)| *resident)
    {
        total = total.saturating_add(rung.resident_bytes());
    }
    total
}

/// Indices into `tenants`, most protected first: foreground before background, then higher
/// priority, then earlier arrival, then lower id. Levers fall on the *end* of this order
/// first.
#[must_use]
pub fn protection_order(tenants: &[TenantView]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tenants.len()).collect();
    order.sort_by_key(|&i| {
        let t = &tenants[i];
        (
            t.class == TenantClass::Background,
            Reverse(t.priority),
            t.arrival,
            t.id,
        )
    });
    order
}

/// Tuning of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Policy {
    /// Promotion, resumption and admission happen only when the resulting usage stays this
    /// far below the budget. Relief never waits for it.
    pub hysteresis_bytes: u64,
    /// Shedding drops whole multiples of this many tokens (capped at what is sheddable), so a
    /// growing context is not trimmed one token per step.
    pub shed_chunk_tokens: u64,
    /// Every running tenant on one rung: the batched server decodes its tenants as sequences
    /// of one context, so a plan that splits them over two rungs could not be carried out.
    /// Parked tenants' caches may still wait in any rung's layout.
    pub one_rung: bool,
}

impl Default for Policy {
    /// 128 MiB of hysteresis — a third of the tier0→tier1 weight gap of the Qwen ladder, and
    /// thousands of tokens of KV growth — and 32-token shed chunks.
    fn default() -> Self {
        Policy {
            hysteresis_bytes: 128 << 20,
            shed_chunk_tokens: 32,
            one_rung: false,
        }
    }
}

impl Policy {
    /// No hysteresis, one-token shedding: the exact least-harm policy, for analysis and tests.
    #[must_use]
    pub fn exact() -> Policy {
        Policy {
            hysteresis_bytes: 0,
            shed_chunk_tokens: 1,
            one_rung: false,
        }
    }

    /// `tokens` rounded up to a shed chunk, capped at `max`.
    pub(crate) fn round_shed(&self, tokens: u64, max: u64) -> u64 {
        let chunk = self.shed_chunk_tokens.max(1);
        tokens.div_ceil(chunk).saturating_mul(chunk).min(max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ladder() -> Vec<RungCost> {
        vec![
            RungCost::new("big", 1000, 10, 100),
            RungCost::new("mid", 600, 10, 80),
            RungCost::new("small", 300, 5, 50),
        ]
    }

    #[test]
    fn shared_weights_count_once_per_resident_rung() {
        let tenants = vec![
            TenantView::new(1, TenantClass::Foreground).with_context(10, 0),
            TenantView::new(2, TenantClass::Background).with_context(20, 0),
            TenantView::new(3, TenantClass::Background)
                .with_context(4, 0)
                .with_rung(2)
                .with_parked(true),
            TenantView::new(4, TenantClass::Background)
                .with_context(1000, 0)
                .waiting(),
        ];
        let mut s = Snapshot::new(0, ladder(), tenants);
        // rung 0 once (1100) + KV 100 + 200 + parked KV 20; rung 2 not resident; waiting free.
        assert_eq!(usage(&s), 1100 + 100 + 200 + 20);
        s.shared_weights = false;
        assert_eq!(usage(&s), 2 * 1100 + 100 + 200 + 20);
    }

    #[test]
    fn validation_catches_each_defect() {
        let ok = || TenantView::new(1, TenantClass::Foreground).with_context(5, 2);
        let check = |t: TenantView| Snapshot::new(0, ladder(), vec![t]).validate();
        assert_eq!(check(ok()), Ok(()));
        assert!(matches!(
            check(ok().with_rung(3)),
            Err(SchedError::RungOutOfRange { .. })
        ));
        let mut home = ok();
        home.home_rung = 5;
        assert!(matches!(
            check(home),
            Err(SchedError::HomeOutOfRange { .. })
        ));
        let mut above = ok();
        above.home_rung = 1;
        assert!(matches!(
            check(above),
            Err(SchedError::RungAboveHome { .. })
        ));
        assert!(matches!(
            check(ok().with_context(1, 2)),
            Err(SchedError::PinnedExceedsContext { .. })
        ));
        let mut parked_waiting = ok().waiting();
        parked_waiting.parked = true;
        assert!(matches!(
            check(parked_waiting),
            Err(SchedError::ParkedButNotAdmitted { .. })
        ));
        assert_eq!(
            Snapshot::new(0, ladder(), vec![ok(), ok()]).validate(),
            Err(SchedError::DuplicateTenant {
                tenant: TenantId(1)
            })
        );
        assert_eq!(
            Snapshot::new(0, vec![], vec![]).validate(),
            Err(SchedError::NoRungs)
        );
        let many = vec![RungCost::new("r", 1, 1, 1); MAX_RUNGS + 1];
        assert!(matches!(
            Snapshot::new(0, many, vec![]).validate(),
            Err(SchedError::TooManyRungs { .. })
        ));
    }

    #[test]
    fn protection_order_is_foreground_priority_arrival() {
        let tenants = vec![
            TenantView::new(1, TenantClass::Background).with_order(0, 1),
            TenantView::new(2, TenantClass::Background).with_order(5, 9),
            TenantView::new(3, TenantClass::Foreground).with_order(0, 7),
            TenantView::new(4, TenantClass::Background).with_order(0, 0),
        ];
        assert_eq!(protection_order(&tenants), vec![2, 1, 3, 0]);
        // The API's priorities are any i32: 300 and 1000 do not tie, nor do -5 and 0.
        let wide = vec![
            TenantView::new(1, TenantClass::Background).with_order(300, 0),
            TenantView::new(2, TenantClass::Background).with_order(1000, 1),
            TenantView::new(3, TenantClass::Background).with_order(-5, 2),
            TenantView::new(4, TenantClass::Background).with_order(0, 3),
        ];
        assert_eq!(protection_order(&wide), vec![1, 0, 3, 2]);
    }

    #[test]
    fn shed_rounding() {
        let p = Policy::default();
        assert_eq!(p.round_shed(0, 100), 0);
        assert_eq!(p.round_shed(1, 100), 32);
        assert_eq!(p.round_shed(33, 100), 64);
        assert_eq!(p.round_shed(90, 100), 96);
        assert_eq!(p.round_shed(97, 100), 100);
        assert_eq!(Policy::exact().round_shed(7, 100), 7);
    }
}
