//! [`TenantsError`]: why the actuator could not carry out a plan or a step.

use crate::engine::EngineError;
use crate::routes::RouteError;
use crate::sched::{SchedError, TenantId};
use crate::session::MigrationError;

/// An action or a step failed, or a plan or an arrival does not fit the tenants.
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    /// llama.cpp failed (loading a rung, creating a context, decoding, export or import).
    #[error("{what}: {source}")]
    Engine {
        /// What was being done, naming the tenant or the rung.
        what: String,
        /// The engine error.
        source: EngineError,
    },
    /// The plan does not fit the snapshot it was applied to (unknown tenant, stale rung,
    /// shed below the pinned prompt); refused before any engine is touched.
    #[error("scheduler: {0}")]
    Sched(#[from] SchedError),
    /// A projector between two rungs is missing or unusable.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// A tenant's cache could not be projected or shed.
    #[error("tenant {tenant}: {source}")]
    Cache {
        /// The tenant.
        tenant: u64,
        /// The step that failed and why.
        source: MigrationError,
    },
    /// A tenant id was added twice.
    #[error("tenant {tenant} already arrived")]
    Duplicate {
        /// The tenant.
        tenant: TenantId,
    },
}

/// Wraps an engine error with what was being done.
pub(super) fn engine_err(what: String) -> impl FnOnce(EngineError) -> TenantsError {
    move |source| TenantsError::Engine { what, source }
}
