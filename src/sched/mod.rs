//! Scheduling under a memory budget: policy as pure functions over a snapshot, one mutation
//! point.
//!
//! Following llama.cpp's `llama-memory.h` ("the only method that should mutate the memory …
//! is `apply()`"), nothing in this room touches an engine. The session takes a [`Snapshot`]
//! (rung costs, tenants, budget), asks `plan` for a [`Plan`] — a list of
//! `(TenantId, Lever)` actions plus the usage they project — and performs those actions on
//! the engines in one apply step of its own. [`apply`] is the same step over the snapshot
//! alone, for simulation ([`simulate`]) and tests.
//!
//! # Main types
//!
//! - [`RungCost`], [`TenantView`], [`Snapshot`], [`Policy`] — the inputs ([`model`]).
//! - [`usage`] — bytes a snapshot occupies; the accounting every decision is checked against.
//! - [`decide_one`] → [`Decision`] — the one-tenant policy ([`one`]).
//! - `plan` → [`Plan`] of [`Lever`]s, and [`apply`] — the multi-tenant scheduler ([`plan`
//!   module](mod@plan)).
//! - [`simulate`] → [`RoundReport`]s — deterministic multi-round replay ([`sim`]).
//!
//! # The levers, in order of increasing harm
//!
//! 1. **Defer admission** — a tenant not yet started waits.
//! 2. **Demote** — migrate a tenant to a smaller rung (Molt's transplant).
//! 3. **Park** — unmap the tenant's rung weights; its KV stays in host memory and still
//!    costs bytes; it makes no progress until resumed.
//! 4. **Shed** — drop the oldest context tokens of a tenant's KV, never its pinned prefix
//!    (the system prompt). The only irreversible lever.
//!
//! Terminating a tenant is not a lever: no plan removes a tenant from the snapshot.
//!
//! # The ordering rule, precisely
//!
//! Running tenants are ranked by protection: foreground before background, then higher
//! `priority`, then earlier `arrival`, then lower id ([`protection_order`]). A configuration
//! assigns each running tenant a rung, a parked flag and a number of tokens to shed now. Its
//! *harm* is the vector
//!
//! ```text
//! [ shed(t1) … shed(tn),  parked(t1) … parked(tn),  demotion(t1) … demotion(tn) ]
//! ```
//!
//! with t1 the most protected tenant and demotion = rung − home rung, compared
//! lexicographically. Under pressure the plan picks the least harmful configuration that fits
//! the budget. Consequences: nobody is shed while parking anyone (foreground included) would
//! fit; nobody is parked while demotions alone would fit; the foreground is demoted only when
//! no demotion of the backgrounds lets it stay higher; and each tenant lands on the largest
//! rung that still fits. Admission (lever 1) never harms a running tenant: a waiting tenant is
//! admitted, on the largest rung that fits, only into headroom that remains after everyone
//! else.
//!
//! Promotion, resumption and admission need the budget to clear the new usage by
//! [`Policy::hysteresis_bytes`]; relief happens as soon as usage exceeds the budget. A budget
//! that oscillates within the margin therefore causes no flapping.
//!
//! # How memory is counted
//!
//! See [`usage`]: with [`Snapshot::shared_weights`] (the default for Molt, where tenants on
//! one rung are sequences of one mmap'd model and one context), a rung's weights and compute
//! buffers are counted **once per resident rung** — a rung with at least one admitted,
//! unparked tenant — not per tenant. Every admitted tenant's KV counts, parked or not (parked
//! KV lives in host memory).

mod error;
pub mod model;
pub mod one;
pub mod plan;
#[cfg(test)]
mod props;
pub mod sim;

pub use error::SchedError;
pub use model::{
    MAX_RUNGS, Policy, RungCost, Snapshot, TenantClass, TenantId, TenantView, protection_order,
    usage,
};
pub use one::{Decision, decide_one, need_after};
pub use plan::{Infeasible, Lever, LeverKind, Plan, PlanMode, apply, plan};
pub use sim::{RoundReport, SimOptions, max_overshoot, simulate};
