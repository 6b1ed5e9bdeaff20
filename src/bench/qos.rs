//! Three tenants, one budget, real engines: a foreground conversation and two background batch
//! jobs share one moving budget over the real ladder.
//!
//! Every round: tenants whose arrival round has come [arrive](Tenants::arrive); read the
//! budget; take a [`Snapshot`] of the tenants ([`Tenants::views`]: rung, parked, context,
//! pinned prompt) and the calibrated [`RungCost`]s; [`plan`] — pure — picks the levers in order
//! of increasing harm (defer admission, demote, park, shed; and their undoing when memory
//! returns); **one apply step**, [`Tenants::apply`], performs the plan's actions on the
//! engines, in the plan's order, before anyone takes a step; the footprint is sampled (the
//! policy's usage and the operating system's); then every running tenant decodes one token.
//! Nobody is ever terminated: a tenant leaves only when its answer is complete.
//!
//! The bench keeps what is its own: the scenario and its trace replay, sampling and the
//! answers' text, the measurements and the report. Engines and moves belong to the actuator
//! ([`crate::tenants`]): one memory-mapped model per resident rung, one small context per
//! running tenant over it. Hence the cost model: a rung's weights and the anonymous memory
//! its model load adds (weights llama.cpp repacks, tokenizer tables) once per resident rung,
//! plus [`RungCost::tenant_bytes`] (the context's KV and compute buffers) per running tenant,
//! plus KV per context token for every admitted tenant. All of it is calibrated at start by
//! loading each rung once and measuring `RssAnon` ([`calibrate`]).
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
    return_freed_buffers_to_os, trim_heap,
};
use crate::routes::{Routes, Variant};
use crate::sched::{
    Lever, PlanMode, Policy, RungCost, SchedError, Snapshot, TenantClass, TenantId, apply, plan,
    usage,
};
use crate::tenants::{Arrival, Phase, Tenants, TenantsError};

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
    /// The actuator could not perform a plan or a step.
    #[error(transparent)]
    Tenants(#[from] TenantsError),
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
    pub priority: i32,
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
            * config.cache_type.elem_bytes() as u64;
        costs.push(
            RungCost::new(info.name(), f.total_tensor_bytes, kv, a1.saturating_sub(a0))
                .with_tenant_bytes(a2.saturating_sub(a1)),
        );
    }
    Ok(costs)
}

/// What the bench keeps of one tenant: its spec, its sampler and answer, its report. Its
/// engines, cache and placement are the actuator's.
struct Tenant {
    id: TenantId,
    spec: TenantSpec,
    arrived: bool,
    out: Vec<Token>,
    stream: Utf8Stream,
    text: String,
    sampler: Sampler,
    report: TenantReport,
}

impl Tenant {
    fn bump(&mut self, lever: &str) {
        *self.report.levers.entry(lever.to_owned()).or_default() += 1;
    }
}

/// The report's name for an action.
fn lever_word(lever: Lever) -> &'static str {
    match lever {
        Lever::Defer => "defer",
        Lever::Admit { .. } => "admit",
        Lever::Shed { .. } => "shed",
        Lever::Demote { from, to } | Lever::Promote { from, to } => {
            if to > from {
                "demote"
            } else {
                "promote"
            }
        }
        Lever::Park { .. } => "park",
        Lever::Resume { .. } => "resume",
    }
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
    let mut live = Tenants::new(
        ladder,
        opts.config,
        Routes::new(ladder, opts.projector_dirs.clone(), opts.variant),
    );
    // Every route is loaded now, so projector matrices are part of the floor.
    live.load_routes()?;
    trim_heap();
    let floor = process_anon_rss_bytes()?;
    let mut tenants: Vec<Tenant> = opts
        .tenants
        .iter()
        .enumerate()
        .map(|(i, spec)| Tenant {
            id: TenantId(i as u64),
            spec: spec.clone(),
            arrived: false,
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
        for (t, prompt) in tenants.iter_mut().zip(&prompts) {
            if !t.arrived && t.spec.arrival_round <= round {
                live.arrive(
                    t.id,
                    Arrival {
                        name: t.spec.name.clone(),
                        class: t.spec.class,
                        priority: t.spec.priority,
                        prompt: prompt.clone(),
                        chat: t.spec.chat,
                    },
                )?;
                t.arrived = true;
            }
        }
        let phase = |live: &Tenants<'_>, t: &Tenant| live.observe(t.id).map(|o| o.phase);
        if tenants.iter().all(|t| phase(&live, t) == Some(Phase::Done)) {
            break;
        }
        let b = budget.budget(Tick {
            token_index: round as u64,
            elapsed_ms: u64::try_from(t_start.elapsed().as_millis()).unwrap_or(u64::MAX),
        })?;
        let views = live.views();
        if views.is_empty() {
            continue;
        }
        let snapshot = Snapshot::new(b.bytes, costs.clone(), views);
        let p = plan(&snapshot, &opts.policy)?;
        let after = apply(&p, &snapshot)?;
        let t_apply = Instant::now();
        let applied = live.apply(&p, &snapshot)?;
        let apply_ms = t_apply.elapsed().as_secs_f64() * 1e3;
        for a in applied {
            if a.performed
                && let Some(t) = tenants.iter_mut().find(|t| t.id == a.tenant)
            {
                t.bump(lever_word(a.lever));
            }
            actions_log.push(ActionRecord {
                round,
                tenant: a.tenant,
                lever: a.lever,
                ms: a.ms,
                detail: a.detail,
            });
        }
        let modelled_after = usage(&after);
        let measured_after =
            live.mapped_resident_bytes() + process_anon_rss_bytes()?.saturating_sub(floor);
        let signed = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        let states = tenants
            .iter()
            .filter_map(|t| {
                let o = live.observe(t.id)?;
                Some(TenantState {
                    tenant: t.id,
                    state: match o.phase {
                        Phase::Waiting => "waiting",
                        Phase::Running => "running",
                        Phase::Parked => "parked",
                        Phase::Done => "done",
                    },
                    rung: live.rung_name(o.rung).to_owned(),
                    context_tokens: o.context_tokens,
                    generated: t.out.len(),
                })
            })
            .collect();
        // Everyone running takes one step.
        let mut stepped = Vec::new();
        for t in &mut tenants {
            match phase(&live, t) {
                Some(Phase::Running) => {
                    let Some(step) = live.step(t.id, &mut t.sampler)? else {
                        continue;
                    };
                    let name = live.rung_name(step.rung).to_owned();
                    if t.report.rungs.last() != Some(&name) {
                        t.report.rungs.push(name);
                    }
                    let full = step.cached + 2 > opts.config.n_ctx as usize;
                    if let Some(bytes) = &step.bytes {
                        let piece = t.stream.push(bytes);
                        t.text.push_str(&piece);
                        t.out.push(step.token);
                        stepped.push((t.id, piece));
                    }
                    let stop = if step.eog {
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
                        live.finish(t.id);
                    }
                }
                Some(Phase::Waiting) => {
                    t.report.stall_rounds += 1;
                    t.report.deferred_rounds += 1;
                }
                Some(Phase::Parked) => t.report.stall_rounds += 1,
                Some(Phase::Done) | None => {}
            }
        }
        live.release_idle();
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
