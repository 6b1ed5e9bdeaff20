//! The actuator for a multi-tenant [`Plan`]: [`Tenants`] holds the live tenants over shared
//! engines, and [`Tenants::apply`] is the one step that performs a plan's levers on them.
//!
//! [`sched`](crate::sched) decides in pure functions over a [`Snapshot`]; this room carries the
//! decision out on llama.cpp, and nothing else here changes where a tenant runs or what its
//! cache holds (rule 6, after llama.cpp's `llama-memory.h`: "the only method that should
//! mutate the memory … is `apply()`"). It sits above `sched` and beside `session`, and uses
//! only their public APIs, so that the `QoS` bench now, and the server later, drive tenants
//! the same way.
//!
//! # A round, as data flows
//!
//! 1. A tenant [arrives](Tenants::arrive) with its prompt tokens; it waits for admission.
//! 2. [`Tenants::views`] gives one [`TenantView`] per waiting, running or parked tenant
//!    (rung, parked flag, context and pinned prompt); with the budget and the rung costs the
//!    caller builds a [`Snapshot`] and asks [`plan`](crate::sched::plan) for a [`Plan`].
//! 3. [`Tenants::apply`] first checks the plan against that snapshot
//!    ([`sched::apply`](crate::sched::apply), pure: a stale or foreign plan is refused before
//!    any engine is touched), then performs its actions in the plan's order — frees before
//!    takes:
//!    - **admit**: a context on the rung, the prompt prefilled, its chat opening pinned;
//!    - **shed**: a running tenant through llama.cpp's own position shift
//!      ([`Context::shed_and_decode`]), a parked one by re-rotating its exported keys
//!      ([`shed_blob`]); the pinned prefix is never dropped;
//!    - **demote / promote**: the cache exported, projected ([`project_blob`]) and imported
//!      into a context on the destination; a parked cache is projected when it moves down,
//!      and stays in its smaller layout when it moves up until it resumes;
//!    - **park**: the cache exported into host memory, the context dropped;
//!    - **resume**: the blob projected to the rung's layout if needed and imported into a
//!      fresh context;
//!    - **defer**: nothing.
//!
//!    Then the heap is trimmed, every rung no running tenant uses is unmapped, and each
//!    tenant's policy rung is set as the plan left it. One [`Applied`] per action says what
//!    was done and how long it took.
//! 4. The caller measures (e.g. [`Tenants::mapped_resident_bytes`], [`Tenants::observe`]),
//!    then lets every running tenant [step](Tenants::step) one token and
//!    [finishes](Tenants::finish) those whose answer is complete, and
//!    [releases](Tenants::release_idle) the rungs they left.
//!
//! # Engines
//!
//! One memory-mapped [`Model`] per rung, loaded while some running tenant is on it and
//! dropped (unmapped) when none is; one small [`Context`] per running tenant over it. This is
//! why the session's [`LiveRung`](crate::session::LiveRung) / [`ParkedRung`](crate::session::ParkedRung)
//! are not reused: each owns a model of its own, while tenants on one rung share its mapping.
//!
//! Between steps a running tenant's cache holds its history, and the last sampled token is
//! *pending* (not decoded yet). Every export takes the last decoded token back out first, so
//! a blob always ends before the token to decode next.

mod error;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::engine::{Context, ContextConfig, Model, ModelOptions, Sampler, Token};
use crate::ladder::Ladder;
use crate::pressure::{resident_bytes_of_mapping, trim_heap};
use crate::routes::{self, Routes};
use crate::sched::{self, Lever, Plan, SchedError, Snapshot, TenantClass, TenantId, TenantView};
use crate::session::migrate::project_blob;
use crate::session::{MigrationStep, chat_pinned_prefix};
use crate::transplant::shift::shed_blob;

pub use error::TenantsError;
use error::engine_err;

/// A tenant asking to be admitted.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// Name used in error messages.
    pub name: String,
    /// Foreground or background.
    pub class: TenantClass,
    /// Priority within its class.
    pub priority: i32,
    /// The prompt, tokenized; prefilled on admission.
    pub prompt: Vec<Token>,
    /// The prompt is chat-templated: pin its opening (system prompt and turn header).
    pub chat: bool,
}

/// Where a tenant is, as an observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Arrived, not admitted yet.
    Waiting,
    /// A context on a mapped rung.
    Running,
    /// Its cache in host memory, no context.
    Parked,
    /// Finished; holds nothing.
    Done,
}

/// One tenant as an observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// Where it is.
    pub phase: Phase,
    /// The policy's rung (for a parked tenant, possibly above its cache's layout).
    pub rung: usize,
    /// Tokens in its cache, plus the pending one.
    pub context_tokens: usize,
    /// Bytes of its parked cache in host memory (0 unless parked).
    pub parked_bytes: usize,
}

/// One action of a plan, as performed.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The tenant.
    pub tenant: TenantId,
    /// The plan's action.
    pub lever: Lever,
    /// False when the action found nothing to do (parking a tenant already parked, resuming
    /// one that is not).
    pub performed: bool,
    /// Time it took, ms.
    pub ms: f64,
    /// What was done (route, tokens, layouts).
    pub detail: String,
}

/// One token of a running tenant.
#[derive(Debug, Clone)]
pub struct Step {
    /// The sampled token.
    pub token: Token,
    /// It ends the generation; it is not kept pending.
    pub eog: bool,
    /// Its bytes, unless `eog`.
    pub bytes: Option<Vec<u8>>,
    /// The rung it was sampled on.
    pub rung: usize,
    /// Tokens in the cache after decoding the previous pending one.
    pub cached: usize,
}

enum Place {
    Waiting,
    Live { ctx: Context, rung: usize },
    Parked { blob: Vec<u8>, layout: usize },
    Done,
}

struct Tenant {
    arrival: Arrival,
    place: Place,
    /// The policy's rung (for a parked tenant, possibly above the blob's layout).
    rung: usize,
    /// Tokens in the cache.
    history: Vec<Token>,
    /// Sampled, not decoded yet.
    pending: Option<Token>,
    pinned: usize,
}

impl Tenant {
    fn context_tokens(&self) -> usize {
        self.history.len() + usize::from(self.pending.is_some())
    }

    fn view(&self, id: TenantId) -> Option<TenantView> {
        let base = TenantView::new(id.0, self.arrival.class)
            .with_order(self.arrival.priority, id.0)
            .with_rung(self.rung);
        let tokens = self.context_tokens() as u64;
        let pinned = (self.pinned as u64).min(tokens);
        match &self.place {
            Place::Done => None,
            Place::Waiting => Some(base.with_context(tokens, 0).waiting()),
            Place::Live { .. } => Some(base.with_context(tokens, pinned)),
            Place::Parked { .. } => Some(base.with_context(tokens, pinned).with_parked(true)),
        }
    }

    /// Takes the last decoded token back out of a live cache, so that the cache ends before
    /// the token to decode next (the state every export assumes).
    fn unpend(&mut self) {
        if self.pending.is_none()
            && let Place::Live { ctx, .. } = &mut self.place
            && let Some(last) = self.history.pop()
        {
            let n = ctx.n_past();
            ctx.truncate(n.saturating_sub(1));
            self.pending = Some(last);
        }
    }
}

/// The rungs' models and the ladder's projectors.
struct Engines<'a> {
    ladder: &'a Ladder,
    config: ContextConfig,
    models: Vec<Option<Arc<Model>>>,
    routes: Routes,
}

impl Engines<'_> {
    fn model(&mut self, rung: usize) -> Result<Arc<Model>, TenantsError> {
        if let Some(m) = &self.models[rung] {
            return Ok(Arc::clone(m));
        }
        let info = &self.ladder.rungs[rung];
        let m = Model::load(&info.path, info.name(), ModelOptions::default())
            .map_err(engine_err(format!("loading {}", info.name())))?;
        self.models[rung] = Some(Arc::clone(&m));
        Ok(m)
    }

    fn context(&mut self, rung: usize) -> Result<Context, TenantsError> {
        let m = self.model(rung)?;
        Context::new(m, self.config).map_err(engine_err(format!(
            "context on {}",
            self.ladder.rungs[rung].name()
        )))
    }

    fn name(&self, rung: usize) -> &str {
        self.ladder.rungs[rung].name()
    }

    /// Projects a cache between layouts; an empty cache (everything shed) stays empty.
    fn project(
        &mut self,
        tenant: TenantId,
        blob: &[u8],
        cells: usize,
        from: usize,
        to: usize,
    ) -> Result<Vec<u8>, TenantsError> {
        if cells == 0 {
            return Ok(Vec::new());
        }
        let p = self.routes.get(from, to)?;
        project_blob(blob, &p, self.config.cache_type)
            .map(|(bytes, _, _)| bytes)
            .map_err(|source| TenantsError::Cache {
                tenant: tenant.0,
                source,
            })
    }
}

/// The live tenants of one ladder and the engines they run on.
pub struct Tenants<'a> {
    engines: Engines<'a>,
    tenants: BTreeMap<TenantId, Tenant>,
}

impl<'a> Tenants<'a> {
    /// No tenants, no rung mapped; every tenant's context is made with `config`, moves use
    /// `routes`.
    #[must_use]
    pub fn new(ladder: &'a Ladder, config: ContextConfig, routes: Routes) -> Tenants<'a> {
        Tenants {
            engines: Engines {
                ladder,
                config,
                models: vec![None; ladder.rungs.len()],
                routes,
            },
            tenants: BTreeMap::new(),
        }
    }

    /// Loads the projector of every pair of rungs now, so that no move loads one later (and
    /// a caller measuring memory can count them in its floor).
    ///
    /// # Errors
    /// [`TenantsError::Route`] when a projector is missing or unusable.
    pub fn load_routes(&mut self) -> Result<(), TenantsError> {
        let n = self.engines.ladder.rungs.len();
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    self.engines.routes.get(a, b)?;
                }
            }
        }
        Ok(())
    }

    /// A tenant arrives and waits for admission.
    ///
    /// # Errors
    /// [`TenantsError::Duplicate`] when `id` has already arrived.
    pub fn arrive(&mut self, id: TenantId, arrival: Arrival) -> Result<(), TenantsError> {
        if self.tenants.contains_key(&id) {
            return Err(TenantsError::Duplicate { tenant: id });
        }
        self.tenants.insert(
            id,
            Tenant {
                arrival,
                place: Place::Waiting,
                rung: 0,
                history: Vec::new(),
                pending: None,
                pinned: 0,
            },
        );
        Ok(())
    }

    /// The planner's view of every tenant not done, in id order.
    #[must_use]
    pub fn views(&self) -> Vec<TenantView> {
        self.tenants
            .iter()
            .filter_map(|(&id, t)| t.view(id))
            .collect()
    }

    /// One tenant, or `None` if it has not arrived.
    #[must_use]
    pub fn observe(&self, id: TenantId) -> Option<Observed> {
        self.tenants.get(&id).map(|t| {
            let (phase, parked_bytes) = match &t.place {
                Place::Waiting => (Phase::Waiting, 0),
                Place::Live { .. } => (Phase::Running, 0),
                Place::Parked { blob, .. } => (Phase::Parked, blob.len()),
                Place::Done => (Phase::Done, 0),
            };
            Observed {
                phase,
                rung: t.rung,
                context_tokens: t.context_tokens(),
                parked_bytes,
            }
        })
    }

    /// Resident bytes of every mapped rung file right now.
    #[must_use]
    pub fn mapped_resident_bytes(&self) -> u64 {
        self.engines
            .models
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_some())
            .map(|(r, _)| {
                resident_bytes_of_mapping(&self.engines.ladder.rungs[r].path).unwrap_or(0)
            })
            .sum()
    }

    /// The name of rung `rung`.
    #[must_use]
    pub fn rung_name(&self, rung: usize) -> &str {
        self.engines.name(rung)
    }

    /// The one apply step: checks `plan` against `snapshot` (the snapshot it was made from),
    /// performs its actions on the engines in the plan's order, trims the heap, unmaps the
    /// rungs nobody runs on and records the policy's rungs as the plan left them.
    ///
    /// # Errors
    /// [`TenantsError::Sched`] when the plan does not fit the snapshot (nothing is touched);
    /// [`TenantsError::Engine`], [`TenantsError::Route`] or [`TenantsError::Cache`] when an
    /// action fails: the actions before it stay performed, and the failing tenant may be left
    /// done, holding nothing.
    pub fn apply(
        &mut self,
        plan: &Plan,
        snapshot: &Snapshot,
    ) -> Result<Vec<Applied>, TenantsError> {
        let after = sched::apply(plan, snapshot)?;
        let mut applied = Vec::with_capacity(plan.actions.len());
        for &(id, lever) in &plan.actions {
            let t0 = Instant::now();
            let t = self
                .tenants
                .get_mut(&id)
                .ok_or(SchedError::UnknownTenant { tenant: id })?;
            let (performed, detail) = act(&mut self.engines, id, t, lever)?;
            applied.push(Applied {
                tenant: id,
                lever,
                performed,
                ms: t0.elapsed().as_secs_f64() * 1e3,
                detail,
            });
        }
        if !plan.actions.is_empty() {
            // Exports, projections and sheds leave freed arrays in the heap.
            trim_heap();
        }
        self.release_idle();
        // The policy's rungs as the plan left them (a parked tenant's may differ from its
        // cache's layout).
        for v in &after.tenants {
            if let Some(t) = self.tenants.get_mut(&v.id) {
                t.rung = v.rung;
            }
        }
        Ok(applied)
    }

    /// A running tenant decodes its pending token and samples the next with `sampler`; the
    /// sampled token becomes pending unless it ends the generation. `None` when the tenant is
    /// not running.
    ///
    /// # Errors
    /// [`TenantsError::Engine`] when the decode fails.
    pub fn step(
        &mut self,
        id: TenantId,
        sampler: &mut Sampler,
    ) -> Result<Option<Step>, TenantsError> {
        let Some(t) = self.tenants.get_mut(&id) else {
            return Ok(None);
        };
        let Place::Live { ctx, rung } = &mut t.place else {
            return Ok(None);
        };
        if let Some(pending) = t.pending.take() {
            ctx.decode(&[pending])
                .map_err(engine_err(format!("{} decoding", t.arrival.name)))?;
            t.history.push(pending);
        }
        let token = sampler.sample(ctx.logits());
        let eog = ctx.model().is_eog(token);
        let bytes = (!eog).then(|| ctx.model().token_bytes(token));
        if !eog {
            t.pending = Some(token);
        }
        Ok(Some(Step {
            token,
            eog,
            bytes,
            rung: *rung,
            cached: t.history.len(),
        }))
    }

    /// The tenant's answer is complete: its context or cache is dropped. Its rung stays mapped
    /// until [`Tenants::release_idle`].
    pub fn finish(&mut self, id: TenantId) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.place = Place::Done;
        }
    }

    /// Drops the models no running tenant uses (their weights are unmapped, their heap pages
    /// handed back).
    pub fn release_idle(&mut self) {
        let mut freed = false;
        for (r, slot) in self.engines.models.iter_mut().enumerate() {
            let used = self
                .tenants
                .values()
                .any(|t| matches!(t.place, Place::Live { rung, .. } if rung == r));
            if !used && slot.is_some() {
                *slot = None;
                freed = true;
            }
        }
        if freed {
            trim_heap();
        }
    }
}

/// Performs one action on one tenant: whether it found something to do, and what it did.
fn act(
    engines: &mut Engines<'_>,
    id: TenantId,
    t: &mut Tenant,
    lever: Lever,
) -> Result<(bool, String), TenantsError> {
    let name = t.arrival.name.clone();
    Ok(match lever {
        Lever::Defer => (true, "waits for headroom".to_owned()),
        Lever::Admit { rung } => (true, admit(engines, t, rung)?),
        Lever::Shed { tokens } => (true, shed(engines, id, t, tokens)?),
        Lever::Demote { to, .. } | Lever::Promote { to, .. } => {
            (true, migrate(engines, id, t, to)?)
        }
        Lever::Park { .. } => {
            t.unpend();
            match std::mem::replace(&mut t.place, Place::Done) {
                Place::Live { ctx, rung } => {
                    let blob = ctx
                        .export_state()
                        .map_err(engine_err(format!("{name} park")))?;
                    let n = blob.len();
                    drop(ctx);
                    t.place = Place::Parked { blob, layout: rung };
                    (
                        true,
                        format!(
                            "parked on {}, {} KiB of cache kept",
                            engines.name(rung),
                            n >> 10
                        ),
                    )
                }
                other => {
                    t.place = other;
                    (false, "already parked".to_owned())
                }
            }
        }
        Lever::Resume { rung } => match std::mem::replace(&mut t.place, Place::Done) {
            Place::Parked { blob, layout } => {
                let bytes = if layout == rung {
                    blob
                } else {
                    engines.project(id, &blob, t.history.len(), layout, rung)?
                };
                let mut ctx = engines.context(rung)?;
                if !t.history.is_empty() {
                    ctx.import_state(&bytes)
                        .map_err(engine_err(format!("{name} resume")))?;
                }
                t.place = Place::Live { ctx, rung };
                t.rung = rung;
                (
                    true,
                    format!(
                        "resumed on {} (cache in {} layout)",
                        engines.name(rung),
                        engines.name(layout)
                    ),
                )
            }
            other => {
                t.place = other;
                (false, "not parked".to_owned())
            }
        },
    })
}

/// Admits a waiting tenant on `rung`: prefills its prompt and pins its chat opening.
fn admit(engines: &mut Engines<'_>, t: &mut Tenant, rung: usize) -> Result<String, TenantsError> {
    let mut ctx = engines.context(rung)?;
    let prompt = &t.arrival.prompt;
    ctx.decode(prompt)
        .map_err(engine_err(format!("{} prefill", t.arrival.name)))?;
    t.pinned = if t.arrival.chat {
        chat_pinned_prefix(ctx.model(), prompt)
    } else {
        0
    };
    t.history.clone_from(prompt);
    t.pending = None;
    t.rung = rung;
    t.place = Place::Live { ctx, rung };
    Ok(format!(
        "prefilled {} tokens on {}",
        t.arrival.prompt.len(),
        engines.name(rung)
    ))
}

/// Drops up to `tokens` of the oldest unpinned tokens of a running or parked tenant.
fn shed(
    engines: &Engines<'_>,
    id: TenantId,
    t: &mut Tenant,
    tokens: u64,
) -> Result<String, TenantsError> {
    t.unpend();
    let pinned = t.pinned.min(t.history.len());
    let n = usize::try_from(tokens)
        .unwrap_or(usize::MAX)
        .min(t.history.len() - pinned);
    match &mut t.place {
        Place::Live { ctx, .. } => {
            let p = t.pending.take().unwrap_or(0);
            ctx.shed_and_decode(pinned, n, &[p])
                .map_err(engine_err(format!("{} shed", t.arrival.name)))?;
            t.history.drain(pinned..pinned + n);
            t.history.push(p);
        }
        Place::Parked { blob, layout } => {
            let rope = routes::binding(&engines.ladder.rungs[*layout]).rope;
            *blob = shed_blob(blob, pinned, n, &rope).map_err(|e| TenantsError::Cache {
                tenant: id.0,
                source: MigrationStep::Shed.fail(e),
            })?;
            t.history.drain(pinned..pinned + n);
        }
        Place::Waiting | Place::Done => {}
    }
    Ok(format!("dropped {n} tokens after {pinned} pinned"))
}

/// Moves a tenant to rung `to`, down or up the ladder.
fn migrate(
    engines: &mut Engines<'_>,
    id: TenantId,
    t: &mut Tenant,
    to: usize,
) -> Result<String, TenantsError> {
    let name = t.arrival.name.clone();
    t.unpend();
    match std::mem::replace(&mut t.place, Place::Done) {
        Place::Live { ctx, rung } => {
            let blob = ctx
                .export_state()
                .map_err(engine_err(format!("{name} export")))?;
            drop(ctx);
            let bytes = engines.project(id, &blob, t.history.len(), rung, to)?;
            drop(blob);
            let mut dst = engines.context(to)?;
            if !bytes.is_empty() {
                dst.import_state(&bytes)
                    .map_err(engine_err(format!("{name} import")))?;
            }
            let p = t.pending.take().unwrap_or(0);
            dst.decode(&[p])
                .map_err(engine_err(format!("{name} first decode")))?;
            t.history.push(p);
            t.place = Place::Live { ctx: dst, rung: to };
            t.rung = to;
            Ok(format!(
                "transplanted {} cells {} -> {}",
                t.history.len() - 1,
                engines.name(rung),
                engines.name(to)
            ))
        }
        Place::Parked { blob, layout } if to > layout => {
            let bytes = engines.project(id, &blob, t.history.len(), layout, to)?;
            t.place = Place::Parked {
                blob: bytes,
                layout: to,
            };
            t.rung = to;
            Ok(format!(
                "parked cache projected {} -> {}",
                engines.name(layout),
                engines.name(to)
            ))
        }
        other => {
            t.place = other;
            t.rung = to;
            Ok("parked cache stays in its smaller layout until it resumes".to_owned())
        }
    }
}
