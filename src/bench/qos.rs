//! Three tenants, one budget, real engines: a foreground conversation and two background batch
//! jobs share one moving budget over the real ladder.
//!
//! Every round: read the budget; take a [`Snapshot`] of the tenants (rung, parked, context,
//! pinned prompt) and the calibrated [`RungCost`]s; [`plan`] — pure — picks the levers in order
//! of increasing harm (defer admission, demote, park, shed; and their undoing when memory
//! returns); **one apply step** performs the plan's actions on the engines, in the plan's
//! order, before anyone takes a step; the footprint is sampled (the policy's usage and the
//! operating system's); then every running tenant decodes one token. Nobody is ever
//! terminated: a tenant leaves only when its answer is complete.
//!
//! Engines: one memory-mapped [`Model`] per rung, loaded while some running tenant is on it and
//! dropped (unmapped) when none is; one small [`Context`] per running tenant over it. Hence the
//! cost model: a rung's weights and the anonymous memory its model load adds (weights
//! llama.cpp repacks, tokenizer tables) once per resident rung, plus
//! [`RungCost::tenant_bytes`] (the context's KV and compute buffers) per running tenant,
//! plus KV per context token for every admitted tenant. All of it is calibrated at start by
//! loading each rung once and measuring `RssAnon`.
//!
//! Moves are Molt's: a demotion or promotion exports the tenant's cache, projects it
//! ([`project_blob`]) and imports it into a context on the destination; a parked tenant's
//! cache is projected when it is demoted, and when it resumes on another rung than its
//! layout. Shedding a running tenant uses llama.cpp's own position shift
//! ([`Context::shed_and_decode`]); shedding a parked one re-rotates the exported keys
//! ([`shed_blob`]).
//!
//! Measured usage after enforcement = resident pages of every mapped rung file + the growth of
//! `RssAnon` above the bench's own floor (taken after calibration, with every projector
//! loaded and no model mapped).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::engine::{
    ChatMessage, Context, ContextConfig, EngineError, Model, ModelOptions, Sampler, SamplingParams,
    Token, Utf8Stream,
};
use crate::ladder::Ladder;
use crate::pressure::{
    BudgetSource, PressureError, Tick, process_anon_rss_bytes, process_rss_bytes,
    resident_bytes_of_mapping, return_freed_buffers_to_os, trim_heap,
};
use crate::sched::{
    Lever, Plan, PlanMode, Policy, RungCost, SchedError, Snapshot, TenantClass, TenantId,
    TenantView, apply, plan, usage,
};
use crate::session::migrate::project_blob;
use crate::session::{RouteError, Routes, Variant, chat_pinned_prefix, routes};
use crate::transplant::shift::shed_blob;

/// Errors of the `QoS` bench.
#[derive(Debug, thiserror::Error)]
pub enum QosError {
    /// llama.cpp failed.
    #[error("{what}: {source}")]
    Engine {
        /// What was being done.
        what: String,
        /// The engine error.
        source: EngineError,
    },
    /// The budget source failed.
    #[error("budget: {0}")]
    Budget(#[from] PressureError),
    /// The planner refused the snapshot (a bug: the bench builds it).
    #[error("scheduler: {0}")]
    Sched(#[from] SchedError),
    /// A projector is missing or unusable.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// A cache could not be projected or shed.
    #[error("tenant {tenant}: {message}")]
    Cache {
        /// The tenant.
        tenant: u64,
        /// What failed.
        message: String,
    },
    /// Bad options.
    #[error("{0}")]
    Options(String),
}

/// One tenant of the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantSpec {
    /// Short name ("chat", "batch-1", ...).
    pub name: String,
    /// Foreground or background.
    pub class: TenantClass,
    /// The user turn it answers.
    pub prompt: String,
    /// Render the prompt with the model's chat template and pin its opening (system prompt
    /// and turn header); otherwise the prompt is raw text and nothing is pinned.
    pub chat: bool,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// Round at which it arrives (asks to be admitted).
    pub arrival_round: usize,
    /// Priority within its class.
    pub priority: u8,
}

/// Options of the `QoS` bench.
#[derive(Debug, Clone)]
pub struct QosOptions {
    /// The tenants.
    pub tenants: Vec<TenantSpec>,
    /// Context config of every tenant's context (small windows keep the run in minutes).
    pub config: ContextConfig,
    /// Scheduler policy.
    pub policy: Policy,
    /// Stop after this many rounds even if someone is unfinished.
    pub max_rounds: usize,
    /// Projector family and where to find the files.
    pub variant: Variant,
    /// Projector directories.
    pub projector_dirs: Vec<PathBuf>,
}

impl QosOptions {
    /// The shipped scenario: a chat in front of the user from round 0, a background batch job
    /// from round 0, a second one arriving at round 20.
    #[must_use]
    pub fn standard(config: ContextConfig, projector_dirs: Vec<PathBuf>) -> QosOptions {
        let t = |name: &str, class, prompt: &str, arrival_round, priority| TenantSpec {
            name: name.to_owned(),
            class,
            prompt: prompt.to_owned(),
            chat: true,
            max_tokens: 48,
            arrival_round,
            priority,
        };
        QosOptions {
            tenants: vec![
                t(
                    "chat",
                    TenantClass::Foreground,
                    "Explain how an operating system reclaims memory from background apps.",
                    0,
                    0,
                ),
                t(
                    "batch-1",
                    TenantClass::Background,
                    "Write a Rust function that splits a CSV line into fields, handling quoted commas.",
                    0,
                    1,
                ),
                t(
                    "batch-2",
                    TenantClass::Background,
                    "Summarize the trade-offs between mmap and read for loading large model files.",
                    20,
                    0,
                ),
            ],
            config,
            policy: Policy::default(),
            max_rounds: 400,
            variant: Variant::Auto,
            projector_dirs,
        }
    }
}

/// One action of the apply step, as performed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActionRecord {
    /// Round.
    pub round: usize,
    /// Tenant.
    pub tenant: TenantId,
    /// The plan's action.
    pub lever: Lever,
    /// Time it took, ms.
    pub ms: f64,
    /// What was done (route, tokens, fallbacks).
    pub detail: String,
}

/// A tenant's state at the end of a round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantState {
    /// Tenant.
    pub tenant: TenantId,
    /// "waiting", "running", "parked" or "done" (not yet arrived tenants are omitted).
    #[serde(deserialize_with = "state_name")]
    pub state: StateWord,
    /// Rung name (policy's rung for parked tenants).
    pub rung: String,
    /// Tokens in its cache (+ the one about to be decoded).
    pub context_tokens: usize,
    /// Tokens generated so far.
    pub generated: usize,
}

/// [`TenantState::state`]'s type under another name: serde borrows a field written `&str`
/// from the input, which would tie a read report to its file's text; through the alias it is
/// read by [`state_name`] instead, into the writer's own words.
type StateWord = &'static str;

/// The states [`TenantState::state`] is written with.
const STATE_WORDS: [&str; 4] = ["waiting", "running", "parked", "done"];

/// Reads [`TenantState::state`] back as one of [`STATE_WORDS`]; any other word is an error.
fn state_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<StateWord, D::Error> {
    let s = String::deserialize(d)?;
    STATE_WORDS
        .into_iter()
        .find(|w| *w == s)
        .ok_or_else(|| serde::de::Error::unknown_variant(&s, &STATE_WORDS))
}

/// One round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoundRecord {
    /// Round index (the trace's token clock).
    pub round: usize,
    /// Budget, bytes.
    pub budget_bytes: u64,
    /// The plan's mode.
    pub mode: PlanMode,
    /// Whether the plan fitted the budget.
    pub feasible: bool,
    /// The plan's actions, in execution order.
    pub actions: Vec<(TenantId, Lever)>,
    /// The policy's usage before enforcement.
    pub modelled_before: u64,
    /// The policy's usage after enforcement.
    pub modelled_after: u64,
    /// Measured after enforcement: mapped weights resident + anonymous memory above the floor.
    pub measured_after: u64,
    /// Process RSS after enforcement.
    pub rss_after: u64,
    /// `modelled_after − budget`.
    pub overshoot_modelled: i64,
    /// `measured_after − budget`.
    pub overshoot_measured: i64,
    /// The apply step's duration, ms.
    pub apply_ms: f64,
    /// Tenants after enforcement.
    pub tenants: Vec<TenantState>,
    /// Tokens decoded this round, per tenant.
    pub tokens: Vec<(TenantId, String)>,
}

/// Summary of one tenant.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantReport {
    /// Tenant id.
    pub tenant: TenantId,
    /// Name.
    pub name: String,
    /// Class.
    pub class: TenantClass,
    /// Tokens generated.
    pub tokens: usize,
    /// Rounds in which it was present but made no progress (deferred or parked).
    pub stall_rounds: usize,
    /// Rounds deferred before admission.
    pub deferred_rounds: usize,
    /// Levers applied to it, by kind (and their undoing: admit, promote, resume).
    pub levers: BTreeMap<String, usize>,
    /// Rungs it ran on, in order.
    pub rungs: Vec<String>,
    /// Round it finished in.
    pub finished_round: Option<usize>,
    /// "eos", "length", "context_full" or "unfinished".
    pub stop: String,
    /// Its answer.
    pub text: String,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QosReport {
    /// Calibrated costs per rung.
    pub costs: Vec<RungCost>,
    /// The anonymous memory floor of the bench itself, bytes.
    pub floor_anon_bytes: u64,
    /// Budget source.
    pub budget_source: String,
    /// Rounds.
    pub rounds: Vec<RoundRecord>,
    /// Every action performed.
    pub actions: Vec<ActionRecord>,
    /// Per tenant.
    pub tenants: Vec<TenantReport>,
    /// Max over rounds of (modelled usage − budget) after enforcement.
    pub max_overshoot_modelled: i64,
    /// Max over rounds of (measured usage − budget) after enforcement.
    pub max_overshoot_measured: i64,
    /// Rounds whose plan could not fit the budget at all.
    pub infeasible_rounds: usize,
    /// Tenants terminated (always 0: terminating is not a lever).
    pub killed: usize,
    /// Wall time, s.
    pub wall_s: f64,
}

/// `results/qos.json`: the run's report with the settings it ran under.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QosDoc {
    /// Machine and versions ([`super::RunInfo`]).
    #[serde(default)]
    pub run: serde_json::Value,
    /// The budget trace's file name.
    #[serde(default)]
    pub trace: Option<String>,
    /// Whether a real memory hog followed the trace (otherwise its budgets were replayed as
    /// numbers).
    #[serde(default)]
    pub real_hog: bool,
    /// Context length of every tenant's context.
    #[serde(default)]
    pub n_ctx: u32,
    /// Batch size.
    #[serde(default)]
    pub n_batch: u32,
    /// Threads per context.
    #[serde(default)]
    pub threads: u32,
    /// The scheduler's policy.
    #[serde(default)]
    pub policy: Policy,
    /// The tenants as specified.
    #[serde(default)]
    pub tenant_specs: Vec<TenantSpec>,
    /// What happened.
    pub report: QosReport,
}

enum State {
    NotArrived,
    Waiting,
    Live { ctx: Context, rung: usize },
    Parked { blob: Vec<u8>, layout: usize },
    Done,
}

struct Tenant {
    id: TenantId,
    spec: TenantSpec,
    state: State,
    /// The policy's rung (for a parked tenant, possibly above the blob's layout).
    rung: usize,
    history: Vec<Token>,
    /// Sampled, not decoded yet.
    pending: Option<Token>,
    pinned: usize,
    out: Vec<Token>,
    stream: Utf8Stream,
    text: String,
    sampler: Sampler,
    report: TenantReport,
}

impl Tenant {
    fn context_tokens(&self) -> usize {
        self.history.len() + usize::from(self.pending.is_some())
    }

    fn view(&self) -> Option<TenantView> {
        let base = TenantView::new(self.id.0, self.spec.class)
            .with_order(self.spec.priority, self.id.0)
            .with_rung(self.rung);
        let tokens = self.context_tokens() as u64;
        let pinned = (self.pinned as u64).min(tokens);
        match &self.state {
            State::NotArrived | State::Done => None,
            State::Waiting => Some(base.with_context(tokens, 0).waiting()),
            State::Live { .. } => Some(base.with_context(tokens, pinned)),
            State::Parked { .. } => Some(base.with_context(tokens, pinned).with_parked(true)),
        }
    }

    fn bump(&mut self, lever: &str) {
        *self.report.levers.entry(lever.to_owned()).or_default() += 1;
    }
}

/// The engines: one model per resident rung, the ladder's projectors.
struct Engines<'a> {
    ladder: &'a Ladder,
    config: ContextConfig,
    models: Vec<Option<Arc<Model>>>,
    routes: Routes,
}

impl Engines<'_> {
    fn model(&mut self, rung: usize) -> Result<Arc<Model>, QosError> {
        if let Some(m) = &self.models[rung] {
            return Ok(Arc::clone(m));
        }
        let info = &self.ladder.rungs[rung];
        let m =
            Model::load(&info.path, info.name(), ModelOptions::default()).map_err(|source| {
                QosError::Engine {
                    what: format!("loading {}", info.name()),
                    source,
                }
            })?;
        self.models[rung] = Some(Arc::clone(&m));
        Ok(m)
    }

    fn context(&mut self, rung: usize) -> Result<Context, QosError> {
        let m = self.model(rung)?;
        Context::new(m, self.config).map_err(|source| QosError::Engine {
            what: format!("context on {}", self.ladder.rungs[rung].name()),
            source,
        })
    }

    fn name(&self, rung: usize) -> &str {
        self.ladder.rungs[rung].name()
    }

    /// Drops the models no running tenant uses (their weights are unmapped, their heap
    /// pages handed back).
    fn release(&mut self, tenants: &[Tenant]) {
        let mut freed = false;
        for (r, slot) in self.models.iter_mut().enumerate() {
            let used = tenants
                .iter()
                .any(|t| matches!(t.state, State::Live { rung, .. } if rung == r));
            if !used && slot.is_some() {
                *slot = None;
                freed = true;
            }
        }
        if freed {
            trim_heap();
        }
    }

    fn mapped_resident(&self) -> u64 {
        self.models
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_some())
            .map(|(r, _)| resident_bytes_of_mapping(&self.ladder.rungs[r].path).unwrap_or(0))
            .sum()
    }

    /// Projects a cache between layouts; an empty cache (everything shed) stays empty.
    fn project(
        &mut self,
        tenant: TenantId,
        blob: &[u8],
        cells: usize,
        from: usize,
        to: usize,
    ) -> Result<Vec<u8>, QosError> {
        if cells == 0 {
            return Ok(Vec::new());
        }
        let p = self.routes.get(from, to)?;
        project_blob(blob, &p, self.config.cache_type)
            .map(|(bytes, _, _)| bytes)
            .map_err(|message| QosError::Cache {
                tenant: tenant.0,
                message,
            })
    }
}

fn engine_err(what: String) -> impl FnOnce(EngineError) -> QosError {
    move |source| QosError::Engine { what, source }
}

/// Loads each rung once, alone, and measures what it costs: the model's own anonymous memory
/// (shared by its tenants) and one context's (per tenant), the context warmed with a full
/// batch of `warm` tokens so its compute buffers are as touched as a prompt will touch them.
///
/// # Errors
/// [`QosError::Engine`] if a rung does not load.
pub fn calibrate(
    ladder: &Ladder,
    config: ContextConfig,
    warm: &[Token],
) -> Result<Vec<RungCost>, QosError> {
    return_freed_buffers_to_os();
    let mut costs = Vec::new();
    for info in &ladder.rungs {
        let a0 = process_anon_rss_bytes()?;
        let model = Model::load(&info.path, info.name(), ModelOptions::default())
            .map_err(engine_err(format!("loading {}", info.name())))?;
        let a1 = process_anon_rss_bytes()?;
        let mut ctx = Context::new(Arc::clone(&model), config)
            .map_err(engine_err(format!("context on {}", info.name())))?;
        let n = warm.len().min(config.n_batch as usize).max(1);
        ctx.decode(&warm[..n.min(warm.len())])
            .map_err(engine_err(format!("warming {}", info.name())))?;
        ctx.clear();
        let a2 = process_anon_rss_bytes()?;
        drop(ctx);
        drop(model);
        let f = &info.facts;
        let kv = u64::from(f.n_layer)
            * u64::from(f.kv_dim_k() + f.kv_dim_v())
            * config.cache_type.bytes() as u64;
        costs.push(
            RungCost::new(info.name(), f.total_tensor_bytes, kv, a1.saturating_sub(a0))
                .with_tenant_bytes(a2.saturating_sub(a1)),
        );
    }
    Ok(costs)
}

/// Runs the scenario under `budget` (one reading per round, the round index as the token
/// clock).
///
/// # Errors
/// [`QosError`] from the engines, the budget source or a missing projector.
#[allow(clippy::too_many_lines)]
pub fn run(
    ladder: &Ladder,
    opts: &QosOptions,
    budget: &mut dyn BudgetSource,
    progress: &mut dyn FnMut(&str),
) -> Result<QosReport, QosError> {
    if opts.tenants.is_empty() {
        return Err(QosError::Options("no tenants".into()));
    }
    let t_start = Instant::now();
    let prompts: Vec<Vec<Token>> = {
        let m = Model::load(&ladder.rungs[0].path, "tokenizer", ModelOptions::default())
            .map_err(engine_err("loading the tokenizer".into()))?;
        opts.tenants
            .iter()
            .map(|t| {
                if t.chat {
                    m.apply_chat_template(&[ChatMessage::new("user", &t.prompt)], true)
                        .and_then(|text| m.tokenize(&text, true))
                } else {
                    m.tokenize(&t.prompt, false)
                }
                .map_err(engine_err(format!("tokenizing {}", t.name)))
            })
            .collect::<Result<_, _>>()?
    };
    for (t, p) in opts.tenants.iter().zip(&prompts) {
        if p.len() + t.max_tokens + 2 > opts.config.n_ctx as usize {
            return Err(QosError::Options(format!(
                "{}: {} prompt tokens + {} to generate do not fit n_ctx {}",
                t.name,
                p.len(),
                t.max_tokens,
                opts.config.n_ctx
            )));
        }
    }
    progress("qos: calibrating rung costs ...");
    let costs = calibrate(ladder, opts.config, &prompts[0])?;
    for c in &costs {
        progress(&format!(
            "qos: {} weights {} MiB + model anon {} MiB shared, {} MiB per tenant, {} B/token",
            c.name,
            c.weights_bytes >> 20,
            c.compute_bytes >> 20,
            c.tenant_bytes >> 20,
            c.kv_bytes_per_token
        ));
    }
    let mut engines = Engines {
        ladder,
        config: opts.config,
        models: vec![None; ladder.rungs.len()],
        routes: Routes::new(ladder, opts.projector_dirs.clone(), opts.variant),
    };
    // Every route is loaded now, so projector matrices are part of the floor.
    for a in 0..ladder.rungs.len() {
        for b in 0..ladder.rungs.len() {
            if a != b {
                engines.routes.get(a, b)?;
            }
        }
    }
    trim_heap();
    let floor = process_anon_rss_bytes()?;
    let mut tenants: Vec<Tenant> = opts
        .tenants
        .iter()
        .enumerate()
        .map(|(i, spec)| Tenant {
            id: TenantId(i as u64),
            spec: spec.clone(),
            state: State::NotArrived,
            rung: 0,
            history: Vec::new(),
            pending: None,
            pinned: 0,
            out: Vec::new(),
            stream: Utf8Stream::new(),
            text: String::new(),
            sampler: Sampler::new(SamplingParams::greedy()),
            report: TenantReport {
                tenant: TenantId(i as u64),
                name: spec.name.clone(),
                class: spec.class,
                tokens: 0,
                stall_rounds: 0,
                deferred_rounds: 0,
                levers: BTreeMap::new(),
                rungs: Vec::new(),
                finished_round: None,
                stop: "unfinished".into(),
                text: String::new(),
            },
        })
        .collect();
    let mut rounds = Vec::new();
    let mut actions_log = Vec::new();
    let budget_source = budget.describe();
    for round in 0..opts.max_rounds {
        for t in &mut tenants {
            if matches!(t.state, State::NotArrived) && t.spec.arrival_round <= round {
                t.state = State::Waiting;
            }
        }
        if tenants.iter().all(|t| matches!(t.state, State::Done)) {
            break;
        }
        let b = budget.budget(Tick {
            token_index: round as u64,
            elapsed_ms: u64::try_from(t_start.elapsed().as_millis()).unwrap_or(u64::MAX),
        })?;
        let views: Vec<TenantView> = tenants.iter().filter_map(Tenant::view).collect();
        if views.is_empty() {
            continue;
        }
        let snapshot = Snapshot::new(b.bytes, costs.clone(), views);
        let p = plan(&snapshot, &opts.policy)?;
        let after = apply(&p, &snapshot)?;
        let t_apply = Instant::now();
        apply_on_engines(
            &p,
            &mut tenants,
            &mut engines,
            &prompts,
            round,
            &mut actions_log,
        )?;
        engines.release(&tenants);
        let apply_ms = t_apply.elapsed().as_secs_f64() * 1e3;
        // Keep the policy's rungs as the plan left them (a parked tenant's may differ from
        // its cache's layout).
        for v in &after.tenants {
            if let Some(t) = tenants.iter_mut().find(|t| t.id == v.id) {
                t.rung = v.rung;
            }
        }
        let modelled_after = usage(&after);
        let measured_after =
            engines.mapped_resident() + process_anon_rss_bytes()?.saturating_sub(floor);
        let signed = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        let states = tenants
            .iter()
            .filter(|t| !matches!(t.state, State::NotArrived))
            .map(|t| TenantState {
                tenant: t.id,
                state: match t.state {
                    State::Waiting => "waiting",
                    State::Live { .. } => "running",
                    State::Parked { .. } => "parked",
                    State::Done | State::NotArrived => "done",
                },
                rung: engines.name(t.rung).to_owned(),
                context_tokens: t.context_tokens(),
                generated: t.out.len(),
            })
            .collect();
        // Everyone running takes one step.
        let mut stepped = Vec::new();
        for t in &mut tenants {
            match &mut t.state {
                State::Live { ctx, rung } => {
                    let rung = *rung;
                    if let Some(pending) = t.pending.take() {
                        ctx.decode(&[pending])
                            .map_err(engine_err(format!("{} decoding", t.spec.name)))?;
                        t.history.push(pending);
                    }
                    let tok = t.sampler.sample(ctx.logits());
                    let name = engines.name(rung).to_owned();
                    if t.report.rungs.last() != Some(&name) {
                        t.report.rungs.push(name);
                    }
                    let eog = ctx.model().is_eog(tok);
                    let full = t.history.len() + 2 > opts.config.n_ctx as usize;
                    if !eog {
                        let piece = t.stream.push(&ctx.model().token_bytes(tok));
                        t.text.push_str(&piece);
                        t.out.push(tok);
                        t.pending = Some(tok);
                        stepped.push((t.id, piece));
                    }
                    let stop = if eog {
                        Some("eos")
                    } else if t.out.len() >= t.spec.max_tokens {
                        Some("length")
                    } else if full {
                        Some("context_full")
                    } else {
                        None
                    };
                    if let Some(stop) = stop {
                        t.report.stop = stop.into();
                        t.report.finished_round = Some(round);
                        t.state = State::Done;
                    }
                }
                State::Waiting => {
                    t.report.stall_rounds += 1;
                    t.report.deferred_rounds += 1;
                }
                State::Parked { .. } => t.report.stall_rounds += 1,
                State::NotArrived | State::Done => {}
            }
        }
        engines.release(&tenants);
        let record = RoundRecord {
            round,
            budget_bytes: b.bytes,
            mode: p.mode,
            feasible: p.feasible,
            actions: p.actions.clone(),
            modelled_before: usage(&snapshot),
            modelled_after,
            measured_after,
            rss_after: process_rss_bytes().unwrap_or(0),
            overshoot_modelled: signed(modelled_after) - signed(b.bytes),
            overshoot_measured: signed(measured_after) - signed(b.bytes),
            apply_ms,
            tenants: states,
            tokens: stepped,
        };
        if !p.actions.is_empty() {
            progress(&format!(
                "qos: round {round}: budget {} MiB, {:?}, {} actions, modelled {} MiB, measured {} MiB",
                b.bytes >> 20,
                p.mode,
                p.actions.len(),
                modelled_after >> 20,
                measured_after >> 20
            ));
        }
        rounds.push(record);
    }
    let reports = tenants
        .into_iter()
        .map(|mut t| {
            t.text.push_str(&t.stream.finish());
            t.report.tokens = t.out.len();
            t.report.text = t.text;
            t.report
        })
        .collect();
    Ok(QosReport {
        costs,
        floor_anon_bytes: floor,
        budget_source,
        max_overshoot_modelled: rounds
            .iter()
            .map(|r| r.overshoot_modelled)
            .max()
            .unwrap_or(0),
        max_overshoot_measured: rounds
            .iter()
            .map(|r| r.overshoot_measured)
            .max()
            .unwrap_or(0),
        infeasible_rounds: rounds.iter().filter(|r| !r.feasible).count(),
        rounds,
        actions: actions_log,
        tenants: reports,
        killed: 0,
        wall_s: t_start.elapsed().as_secs_f64(),
    })
}

/// Takes the last decoded token back out of a live cache, so that the cache ends before the
/// token to decode next (the state every export assumes).
fn unpend(t: &mut Tenant) {
    if t.pending.is_none()
        && let State::Live { ctx, .. } = &mut t.state
        && let Some(last) = t.history.pop()
    {
        let n = ctx.n_past();
        ctx.truncate(n.saturating_sub(1));
        t.pending = Some(last);
    }
}

/// The one apply step: performs the plan's actions on the engines, in the plan's order.
#[allow(clippy::too_many_lines)]
fn apply_on_engines(
    plan: &Plan,
    tenants: &mut [Tenant],
    engines: &mut Engines<'_>,
    prompts: &[Vec<Token>],
    round: usize,
    log: &mut Vec<ActionRecord>,
) -> Result<(), QosError> {
    for &(id, lever) in &plan.actions {
        let t0 = Instant::now();
        let Some(t) = tenants.iter_mut().find(|t| t.id == id) else {
            continue;
        };
        let name = t.spec.name.clone();
        let detail = match lever {
            Lever::Defer => {
                t.bump("defer");
                "waits for headroom".to_owned()
            }
            Lever::Admit { rung } => {
                let mut ctx = engines.context(rung)?;
                let prompt = &prompts[usize::try_from(id.0).unwrap_or(0)];
                ctx.decode(prompt)
                    .map_err(engine_err(format!("{name} prefill")))?;
                t.pinned = if t.spec.chat {
                    chat_pinned_prefix(ctx.model(), prompt)
                } else {
                    0
                };
                t.history.clone_from(prompt);
                t.pending = None;
                t.rung = rung;
                t.state = State::Live { ctx, rung };
                t.bump("admit");
                format!(
                    "prefilled {} tokens on {}",
                    prompt.len(),
                    engines.name(rung)
                )
            }
            Lever::Shed { tokens } => {
                unpend(t);
                let pinned = t.pinned.min(t.history.len());
                let n = usize::try_from(tokens)
                    .unwrap_or(usize::MAX)
                    .min(t.history.len() - pinned);
                match &mut t.state {
                    State::Live { ctx, .. } => {
                        let p = t.pending.take().unwrap_or(0);
                        ctx.shed_and_decode(pinned, n, &[p])
                            .map_err(engine_err(format!("{name} shed")))?;
                        t.history.drain(pinned..pinned + n);
                        t.history.push(p);
                    }
                    State::Parked { blob, layout } => {
                        let rope = routes::binding(&engines.ladder.rungs[*layout]).rope;
                        let fail = |m: String| QosError::Cache {
                            tenant: id.0,
                            message: m,
                        };
                        *blob = shed_blob(blob, pinned, n, &rope)
                            .map_err(|e| fail(format!("shed: {e}")))?;
                        t.history.drain(pinned..pinned + n);
                    }
                    _ => {}
                }
                t.bump("shed");
                format!("dropped {n} tokens after {pinned} pinned")
            }
            Lever::Demote { from, to } | Lever::Promote { from, to } => {
                let kind = if to > from { "demote" } else { "promote" };
                t.bump(kind);
                unpend(t);
                let state = std::mem::replace(&mut t.state, State::Done);
                match state {
                    State::Live { ctx, rung } => {
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
                        t.state = State::Live { ctx: dst, rung: to };
                        t.rung = to;
                        format!(
                            "transplanted {} cells {} -> {}",
                            t.history.len() - 1,
                            engines.name(rung),
                            engines.name(to)
                        )
                    }
                    State::Parked { blob, layout } if to > layout => {
                        let bytes = engines.project(id, &blob, t.history.len(), layout, to)?;
                        t.state = State::Parked {
                            blob: bytes,
                            layout: to,
                        };
                        t.rung = to;
                        format!(
                            "parked cache projected {} -> {}",
                            engines.name(layout),
                            engines.name(to)
                        )
                    }
                    other => {
                        t.state = other;
                        t.rung = to;
                        "parked cache stays in its smaller layout until it resumes".to_owned()
                    }
                }
            }
            Lever::Park { .. } => {
                unpend(t);
                let state = std::mem::replace(&mut t.state, State::Done);
                match state {
                    State::Live { ctx, rung } => {
                        let blob = ctx
                            .export_state()
                            .map_err(engine_err(format!("{name} park")))?;
                        let n = blob.len();
                        drop(ctx);
                        t.state = State::Parked { blob, layout: rung };
                        t.bump("park");
                        format!(
                            "parked on {}, {} KiB of cache kept",
                            engines.name(rung),
                            n >> 10
                        )
                    }
                    other => {
                        t.state = other;
                        "already parked".to_owned()
                    }
                }
            }
            Lever::Resume { rung } => {
                let state = std::mem::replace(&mut t.state, State::Done);
                match state {
                    State::Parked { blob, layout } => {
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
                        t.state = State::Live { ctx, rung };
                        t.rung = rung;
                        t.bump("resume");
                        format!(
                            "resumed on {} (cache in {} layout)",
                            engines.name(rung),
                            engines.name(layout)
                        )
                    }
                    other => {
                        t.state = other;
                        "not parked".to_owned()
                    }
                }
            }
        };
        log.push(ActionRecord {
            round,
            tenant: id,
            lever,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            detail,
        });
    }
    if !plan.actions.is_empty() {
        // Exports, projections and sheds leave freed arrays in the heap.
        trim_heap();
    }
    Ok(())
}
