//! [`SchedError`]: a snapshot or plan the scheduler cannot work with.

use super::TenantId;

/// The snapshot is malformed, or a plan does not fit the snapshot it is applied to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// The ladder has no rungs.
    #[error("the snapshot has no rungs")]
    NoRungs,
    /// More rungs than the planner enumerates.
    #[error("{count} rungs; the planner supports at most {max}")]
    TooManyRungs {
        /// Rungs given.
        count: usize,
        /// The limit, [`super::MAX_RUNGS`].
        max: usize,
    },
    /// A tenant's rung index is out of range.
    #[error("tenant {tenant}: rung {rung} does not exist ({rungs} rungs)")]
    RungOutOfRange {
        /// The tenant.
        tenant: TenantId,
        /// Its rung.
        rung: usize,
        /// Number of rungs.
        rungs: usize,
    },
    /// A tenant's home rung is out of range.
    #[error("tenant {tenant}: home rung {home} does not exist ({rungs} rungs)")]
    HomeOutOfRange {
        /// The tenant.
        tenant: TenantId,
        /// Its home rung.
        home: usize,
        /// Number of rungs.
        rungs: usize,
    },
    /// A tenant sits on a rung larger than its home rung (a smaller index).
    #[error("tenant {tenant}: on rung {rung}, above its home rung {home}")]
    RungAboveHome {
        /// The tenant.
        tenant: TenantId,
        /// Its rung.
        rung: usize,
        /// Its home rung.
        home: usize,
    },
    /// More pinned tokens than context tokens.
    #[error("tenant {tenant}: {pinned} pinned tokens but only {context} in context")]
    PinnedExceedsContext {
        /// The tenant.
        tenant: TenantId,
        /// Pinned tokens.
        pinned: u64,
        /// Context tokens.
        context: u64,
    },
    /// Two tenants share an id.
    #[error("tenant id {tenant} appears twice")]
    DuplicateTenant {
        /// The id.
        tenant: TenantId,
    },
    /// A tenant that was never admitted is marked parked.
    #[error("tenant {tenant} is parked but was never admitted")]
    ParkedButNotAdmitted {
        /// The tenant.
        tenant: TenantId,
    },
    /// A plan names a tenant the snapshot does not have.
    #[error("the plan names tenant {tenant}, which is not in the snapshot")]
    UnknownTenant {
        /// The id.
        tenant: TenantId,
    },
    /// A plan's action expects a rung the tenant is not on (the plan is stale).
    #[error("stale plan: tenant {tenant} expected on rung {expected}, is on rung {actual}")]
    StalePlan {
        /// The tenant.
        tenant: TenantId,
        /// Rung the action assumed.
        expected: usize,
        /// Rung the tenant is on.
        actual: usize,
    },
    /// A plan sheds more tokens than the tenant has beyond its pinned prefix.
    #[error("tenant {tenant}: cannot shed {tokens} tokens, only {sheddable} are not pinned")]
    ShedBelowPinned {
        /// The tenant.
        tenant: TenantId,
        /// Tokens the plan sheds.
        tokens: u64,
        /// Tokens beyond the pinned prefix.
        sheddable: u64,
    },
}
