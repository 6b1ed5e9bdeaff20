//! One run of the benchmark and the passes that make it up. [`run`] checks the options,
//! resolves every Molt arm's routes ([`RouteSet`]: projectors, hidden maps, anchors) before any
//! answer is generated, probes what each rung really costs ([`measure_costs`]), builds the
//! trace, then runs the timing repetitions, the quality pass and the judge, and hands the
//! cells to the summary. [`generate_once`] is one arm answering one prompt in one pass, every
//! event and per-token row recorded.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::arms::{ArmSpec, PromptSpec, StartRung};
use super::report::{
    Cell, ConditionsReport, ContinuationQuality, Pass, QualityRun, RunLog, SeamRecord, Settings,
    TimedRun, TokenRow,
};
use super::summary::{paired_comparisons, representative, summarize, timing_comparisons};
use super::trace::spike_trace;
use crate::BenchError;
use crate::metrics::{Judge, NativeAttention, repetition};
use molt::engine::{AttentionCapture, ChatMessage, ContextConfig, SamplingParams, Token};
use molt::ladder::Ladder;
use molt::pressure::{Trace, TraceBudget, process_rss_bytes};
use molt::routes::Variant;
use molt::routes::{RouteKind, Routes, binding, route_kind};
use molt::sched::{Policy, RungCost};
use molt::session::{
    Event, GenerateOptions, Generation, Prompt, Session, SessionOptions, Strategy,
};
use molt::transplant::anchor::Anchor;
use molt::transplant::hidden::HiddenMap;
use molt::transplant::projector::Projector;

/// n of the repeated-n-gram measure.
pub const REPETITION_N: usize = 4;

/// Options of [`run`].
#[derive(Debug, Clone)]
pub struct ConditionsOptions {
    /// Arms (unbuilt slots are reported, not run).
    pub arms: Vec<ArmSpec>,
    /// Prompts.
    pub prompts: Vec<PromptSpec>,
    /// Tokens per answer.
    pub max_tokens: usize,
    /// Timing repetitions (≥ 1).
    pub reps: usize,
    /// Run the quality pass (handoff JSD, attention flatness).
    pub quality: bool,
    /// Trace steps (generated-token indices), one per rung below the largest.
    pub steps: Vec<usize>,
    /// A trace file to replay instead of [`spike_trace`]; its `frac` events may refer to the
    /// rungs by name (`"of": "tier1"`), meaning that rung's modelled footprint with the longest
    /// context of the run.
    pub trace: Option<PathBuf>,
    /// Where projector files are searched.
    pub projector_dirs: Vec<PathBuf>,
    /// Render prompts with the rung's chat template (otherwise tokenize them as raw text, for
    /// models without a template).
    pub chat: bool,
}

/// Projectors of every downward route, per (precision, size) variant pair, and for a top-k
/// arm the hidden maps of those routes.
#[derive(Clone, Default)]
struct RouteSet {
    projectors: Vec<(usize, usize, Arc<Projector>)>,
    hidden: Vec<(usize, usize, Arc<HiddenMap>)>,
    anchors: Vec<(usize, Arc<Anchor>)>,
}

fn route_kind_of(ladder: &Ladder, s: usize, d: usize) -> RouteKind {
    route_kind(&binding(&ladder.rungs[s]), &binding(&ladder.rungs[d]))
}

fn projectors_for(
    ladder: &Ladder,
    arm: &ArmSpec,
    dirs: &[PathBuf],
    cache: &mut HashMap<Variant, Routes>,
) -> Result<RouteSet, BenchError> {
    let n = ladder.rungs.len();
    let mut out = RouteSet::default();
    for s in 0..n {
        for d in s + 1..n {
            let v = arm.variant(route_kind_of(ladder, s, d));
            let routes = cache
                .entry(v)
                .or_insert_with(|| Routes::new(ladder, dirs.to_vec(), v));
            if let Some(k) = arm.topk {
                match routes.hidden(s, d, k) {
                    Ok(m) => out.hidden.push((s, d, m)),
                    Err(e) if d == s + 1 => {
                        return Err(BenchError::Config(format!(
                            "arm {}: {e} (fit with `molt-run train-projectors --topk {k}`)",
                            arm.id
                        )));
                    }
                    Err(_) => {}
                }
            }
            match routes.get(s, d) {
                Ok(p) => out.projectors.push((s, d, p)),
                // Adjacent rungs are what the trace walks; a gap may stay unfitted.
                Err(e) if d == s + 1 => {
                    return Err(BenchError::Config(format!("arm {}: {e}", arm.id)));
                }
                Err(_) => {}
            }
        }
    }
    // A head re-read splices each destination's shipped anchor where it covers the head.
    if arm.head > 0 {
        let routes = cache
            .entry(Variant::Auto)
            .or_insert_with(|| Routes::new(ladder, dirs.to_vec(), Variant::Auto));
        for i in 0..n {
            match routes.anchor(i) {
                Ok(Some(a)) => out.anchors.push((i, a)),
                Ok(None) => {}
                Err(e) => return Err(BenchError::Config(format!("arm {}: {e}", arm.id))),
            }
        }
    }
    Ok(out)
}

fn rss() -> u64 {
    process_rss_bytes().unwrap_or(0)
}

/// What each rung costs as a running process sees it: every rung loaded alone, the longest
/// prompt decoded, and the growth of the process's resident memory taken as weights plus
/// context (compute buffers, KV buffer, logits). The session's own load-time estimate
/// decodes one token, which leaves most of the compute buffers untouched and undercounts
/// them by hundreds of MiB on the real ladder; a budget built on it would be exceeded before
/// any pressure. Returns the costs and the longest prompt's length.
fn measure_costs(
    ladder: &Ladder,
    config: ContextConfig,
    prompts: &[PromptSpec],
    chat: bool,
) -> Result<(Vec<RungCost>, usize), BenchError> {
    let mut probe = Session::with_options(
        ladder.clone(),
        config,
        ladder.rungs[0].name(),
        SessionOptions {
            projector_dirs: Vec::new(),
            ..SessionOptions::default()
        },
    )?;
    let modelled = probe.rung_costs();
    let wrap = |source| BenchError::Engine {
        rung: ladder.rungs[0].name().to_string(),
        source,
    };
    let mut longest: Vec<Token> = Vec::new();
    let live = probe.ensure_loaded(0)?;
    for p in prompts {
        let toks = if chat {
            let text = live
                .model()
                .apply_chat_template(&[ChatMessage::new("user", &p.prompt)], true)
                .map_err(wrap)?;
            live.model().tokenize(&text, true).map_err(wrap)?
        } else {
            live.model().tokenize(&p.prompt, false).map_err(wrap)?
        };
        if toks.len() > longest.len() {
            longest = toks;
        }
    }
    drop(probe);
    let mut costs = Vec::new();
    for (i, info) in ladder.rungs.iter().enumerate() {
        molt::pressure::trim_heap();
        let before = rss();
        let mut live = molt::session::LiveRung::load(info, config)?;
        live.ctx
            .decode(&longest)
            .map_err(|source| BenchError::Engine {
                rung: info.name().to_string(),
                source,
            })?;
        let grown = rss().saturating_sub(before);
        let at_load = live.context_bytes;
        drop(live);
        let m = &modelled[i];
        // Never below what the rung's own load measured (a warm-up token's worth).
        let context = grown.saturating_sub(m.weights_bytes).max(at_load);
        costs.push(RungCost::new(
            &m.name,
            m.weights_bytes,
            m.kv_bytes_per_token,
            context,
        ));
    }
    molt::pressure::trim_heap();
    Ok((costs, longest.len()))
}

fn to_i64(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// What one generation produced, before it is folded into a [`TimedRun`] or [`QualityRun`].
struct Outcome {
    generation: Generation,
    log: RunLog,
    prompt_ids: Vec<Token>,
    captures: Vec<Option<AttentionCapture>>,
    drop_overshoot: Option<i64>,
}

/// What every run of one benchmark shares: the ladder and its context settings, the trace
/// every arm replays and the measured costs it was built from (every session decides on
/// those), and how prompts are rendered. Built once, after the cost probe.
#[derive(Clone, Copy)]
struct Setup<'a> {
    ladder: &'a Ladder,
    config: ContextConfig,
    trace: &'a Trace,
    costs: &'a [RungCost],
    /// Render prompts with the rung's chat template ([`ConditionsOptions::chat`]).
    chat: bool,
}

/// One run: which arm answers which prompt, with which routes, in which pass.
#[derive(Clone, Copy)]
struct RunSpec<'a> {
    arm: &'a ArmSpec,
    /// The arm's resolved routes (empty for an arm that does not transplant).
    routes: &'a RouteSet,
    prompt: &'a PromptSpec,
    pass: Pass,
    /// Repetition (1-based; 0 for the quality pass).
    rep: usize,
    /// Tokens to generate (the quality pass stops just past the trace's last step).
    max_tokens: usize,
}

/// Runs `spec` on a fresh session of `setup`'s ladder, recording every event and a row per
/// token; in the quality pass every other rung is preloaded with its attention tap armed and
/// the source is kept to measure the seam.
fn generate_once(setup: &Setup<'_>, spec: &RunSpec<'_>) -> Result<Outcome, BenchError> {
    let Setup {
        ladder,
        config,
        trace,
        costs,
        chat,
    } = *setup;
    let RunSpec {
        arm,
        routes,
        prompt,
        pass,
        rep,
        max_tokens,
    } = *spec;
    let quality = pass == Pass::Quality;
    let n = ladder.rungs.len();
    let start = match arm.start {
        StartRung::Largest => 0,
        StartRung::Smallest => n - 1,
    };
    let cfg = ContextConfig {
        attention_tap: quality,
        ..config
    };
    molt::pressure::trim_heap();
    let baseline = rss();
    let opts = SessionOptions {
        strategy: arm.strategy,
        variant: Variant::Auto,
        // Only the projectors installed below: never a silent fallback to other files.
        projector_dirs: Vec::new(),
        policy: Policy::default(),
        // The trace and every arm decide on the costs measured up front
        // (`pin_context_bytes`); the process's live numbers would also count the benchmark's
        // own buffers and make arms differ by bookkeeping.
        observe_footprint: false,
        head_reread: arm.head,
        refill_chunk: arm.refill,
        research: molt::session::Research {
            keep_source: quality,
            measure_seam: quality,
            topk_recompute: arm.topk,
            tail_recompute: arm.tail,
            ..molt::session::Research::default()
        },
        ..SessionOptions::default()
    };
    let mut session = Session::with_options(ladder.clone(), cfg, ladder.rungs[start].name(), opts)?;
    // Every session decides against the costs the trace was built from.
    session.pin_context_bytes(&costs.iter().map(|c| c.compute_bytes).collect::<Vec<_>>());
    for (s, d, p) in &routes.projectors {
        session.routes_mut().insert(*s, *d, Projector::clone(p));
    }
    for (s, d, m) in &routes.hidden {
        session.install_hidden_map(*s, *d, HiddenMap::clone(m));
    }
    for (i, a) in &routes.anchors {
        session
            .routes_mut()
            .insert_anchor(*i, Some(Anchor::clone(a)));
    }
    if quality {
        for i in (0..n).filter(|&i| i != start) {
            session.ensure_loaded(i)?.ctx.arm_attention_tap();
        }
    }
    session.set_budget_source(Some(Box::new(TraceBudget::new(trace.clone()))));
    let mut events = Vec::new();
    let mut rows = Vec::new();
    let mut budget = (trace.initial_bytes, 0.0);
    let mut pending_load = 0.0;
    let mut drop_overshoot: Option<i64> = None;
    let generation = {
        let mut sink = |e: &Event| {
            match e {
                Event::Budget {
                    bytes, pressure, ..
                } => {
                    budget = (*bytes, *pressure);
                    let over = to_i64(rss().saturating_sub(baseline)) - to_i64(*bytes);
                    drop_overshoot = Some(drop_overshoot.map_or(over, |d| d.max(over)));
                }
                Event::Switch(info) => pending_load += info.timings.load_ms,
                Event::Token {
                    index,
                    rung,
                    latency_ms,
                    ..
                } => {
                    rows.push(TokenRow {
                        index: *index,
                        latency_ms: *latency_ms,
                        load_ms: pending_load,
                        rung: rung.clone(),
                        budget_bytes: budget.0,
                        pressure: budget.1,
                        footprint_bytes: rss().saturating_sub(baseline),
                    });
                    pending_load = 0.0;
                }
                _ => {}
            }
            events.push(e.clone());
        };
        let p = if chat {
            Prompt::User(prompt.prompt.clone())
        } else {
            Prompt::Text(prompt.prompt.clone())
        };
        session.generate(
            &p,
            &GenerateOptions {
                max_tokens,
                sampling: SamplingParams::greedy(),
                force_switch: None,
            },
            &mut sink,
        )?
    };
    let prompt_ids = if generation.killed {
        Vec::new()
    } else {
        session.history()[..generation.prompt_tokens.min(session.history().len())].to_vec()
    };
    let captures = (0..n)
        .map(|i| session.rung_mut(i).and_then(|r| r.ctx.take_attention()))
        .collect();
    Ok(Outcome {
        generation,
        log: RunLog {
            arm: arm.id.clone(),
            prompt: prompt.id.clone(),
            pass,
            rep,
            events,
            rows,
        },
        prompt_ids,
        captures,
        drop_overshoot,
    })
}

fn timed_run(o: &Outcome, rep: usize) -> TimedRun {
    let g = &o.generation;
    let rows = &o.log.rows;
    let stalls = rows.iter().filter(|r| r.index > 0);
    let max_stall = stalls.clone().map(|r| r.latency_ms).fold(0.0, f64::max);
    let max_stall_excl = stalls.map(|r| r.latency_ms - r.load_ms).fold(0.0, f64::max);
    let max_overshoot = rows
        .iter()
        .map(|r| to_i64(r.footprint_bytes) - to_i64(r.budget_bytes))
        .max();
    TimedRun {
        rep,
        killed: g.killed,
        stop: g.stop,
        tokens_streamed: g.tokens.len(),
        tokens_delivered: if g.killed { 0 } else { g.tokens.len() },
        prompt_tokens: g.prompt_tokens,
        rungs_used: g.rungs_used.clone(),
        ttft_ms: g.ttft_ms,
        total_ms: g.total_ms,
        max_stall_ms: max_stall,
        max_stall_excl_load_ms: max_stall_excl,
        switch_cost_ms: g.switches.iter().map(|s| s.timings.cost_ms).sum(),
        load_ms: g.switches.iter().map(|s| s.timings.load_ms).sum(),
        switches: g.switches.clone(),
        peak_footprint_bytes: rows.iter().map(|r| r.footprint_bytes).max().unwrap_or(0),
        max_overshoot_bytes: if g.killed { None } else { max_overshoot },
        drop_overshoot_bytes: o.drop_overshoot,
        token_ids: g.tokens.clone(),
        text: g.text.clone(),
        prompt_ids: o.prompt_ids.clone(),
    }
}

/// Runs the benchmark. `progress` receives one line per run.
///
/// # Errors
/// [`BenchError::Config`] for inconsistent options or missing projectors (before any answer
/// is generated); session, engine and judge errors otherwise.
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    opts: &ConditionsOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<(ConditionsReport, Vec<RunLog>), BenchError> {
    let t0 = Instant::now();
    let info = serde_json::to_value(crate::RunInfo::now()).unwrap_or_default();
    if opts.reps == 0 {
        return Err(BenchError::Config(
            "at least one repetition is needed".into(),
        ));
    }
    if opts.prompts.is_empty() {
        return Err(BenchError::Config("no prompts".into()));
    }
    if opts.steps.last().is_some_and(|&s| s >= opts.max_tokens) {
        return Err(BenchError::Config(format!(
            "the trace's last step ({}) must fall inside the answer (max tokens {})",
            opts.steps.last().copied().unwrap_or(0),
            opts.max_tokens
        )));
    }
    let runnable: Vec<&ArmSpec> = opts.arms.iter().filter(|a| a.built).collect();
    // Projectors first: a missing file must fail before minutes of generation.
    let projectors = resolve_routes(ladder, &runnable, &opts.projector_dirs)?;

    progress("measuring rung footprints with the longest prompt");
    let (costs, max_prompt) = measure_costs(ladder, config, &opts.prompts, opts.chat)?;
    progress(&format!(
        "footprints the trace and every session use: {}",
        costs
            .iter()
            .map(|c| format!("{} {} MiB", c.name, c.resident_bytes() >> 20))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let ctx_tokens = (max_prompt + opts.max_tokens) as u64;
    if ctx_tokens + 16 > u64::from(config.n_ctx) {
        return Err(BenchError::Config(format!(
            "the longest prompt ({max_prompt} tokens) plus {} answer tokens does not fit n_ctx {}",
            opts.max_tokens, config.n_ctx
        )));
    }
    let trace = match &opts.trace {
        Some(path) => {
            let refs = costs
                .iter()
                .map(|c| (c.name.clone(), c.resident_bytes() + c.kv_bytes(ctx_tokens)))
                .collect();
            Trace::load_with(path, &refs).map_err(|e| BenchError::Config(format!("trace: {e}")))?
        }
        None => spike_trace(&costs, ctx_tokens, &opts.steps)?,
    };
    let setup = Setup {
        ladder,
        config,
        trace: &trace,
        costs: &costs,
        chat: opts.chat,
    };

    let (mut cells, mut logs) = timing_pass(&setup, opts, &runnable, &projectors, t0, progress)?;
    if opts.quality {
        logs.extend(quality_pass(
            &setup,
            opts,
            &runnable,
            &projectors,
            &mut cells,
            progress,
        )?);
    }

    progress(&format!(
        "judging continuations with {}",
        ladder.rungs[0].name()
    ));
    judge_pass(ladder, config, opts, &mut cells)?;

    let summary = summarize(&opts.arms, &cells, opts.reps);
    let timing = timing_comparisons(&summary);
    let paired = paired_comparisons(&opts.arms, &cells);
    let representative = representative(&cells);
    let report = ConditionsReport {
        run: info,
        ladder: ladder.name().to_string(),
        rungs: ladder.names(),
        settings: Settings {
            max_tokens: opts.max_tokens,
            reps: opts.reps,
            quality_pass: opts.quality,
            steps: opts.steps.clone(),
            n_ctx: config.n_ctx,
            threads: config.n_threads,
            cache_type: format!("{:?}", config.cache_type).to_lowercase(),
            judge: ladder.rungs[0].name().to_string(),
            trace_ctx_tokens: ctx_tokens,
        },
        trace,
        rung_costs: costs,
        arms: opts.arms.clone(),
        prompts: opts.prompts.clone(),
        cells,
        summary,
        timing,
        paired,
        representative,
        elapsed_s: t0.elapsed().as_secs_f64(),
    };
    Ok((report, logs))
}

/// Every Molt arm's routes, by arm id, resolved before any answer is generated.
fn resolve_routes(
    ladder: &Ladder,
    runnable: &[&ArmSpec],
    dirs: &[PathBuf],
) -> Result<HashMap<String, RouteSet>, BenchError> {
    let mut cache = HashMap::new();
    let mut projectors: HashMap<String, RouteSet> = HashMap::new();
    for arm in runnable.iter().filter(|a| a.strategy == Strategy::Molt) {
        projectors.insert(
            arm.id.clone(),
            projectors_for(ladder, arm, dirs, &mut cache)?,
        );
    }
    Ok(projectors)
}

/// The timing repetitions, arms interleaved within each prompt so that drift hits every arm
/// alike: one [`Cell`] per arm and prompt holding its [`TimedRun`]s, and every run's log.
/// `t0` is the benchmark's start, for the time-left estimate.
fn timing_pass(
    setup: &Setup<'_>,
    opts: &ConditionsOptions,
    runnable: &[&ArmSpec],
    projectors: &HashMap<String, RouteSet>,
    t0: Instant,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Cell>, Vec<RunLog>), BenchError> {
    let mut logs = Vec::new();
    let mut cells: Vec<Cell> = Vec::new();
    let total_runs = opts.reps * opts.prompts.len() * runnable.len();
    let mut done = 0usize;
    for rep in 1..=opts.reps {
        for prompt in &opts.prompts {
            for arm in runnable {
                let routes = projectors.get(&arm.id).cloned().unwrap_or_default();
                let o = generate_once(
                    setup,
                    &RunSpec {
                        arm,
                        routes: &routes,
                        prompt,
                        pass: Pass::Timing,
                        rep,
                        max_tokens: opts.max_tokens,
                    },
                )?;
                let t = timed_run(&o, rep);
                done += 1;
                if arm.strategy == Strategy::Molt
                    && let Some(s) = t.switches.iter().find(|s| s.method != "molt")
                {
                    progress(&format!(
                        "WARNING: arm {} switched {}→{} by {:?}, not by transplant",
                        arm.id, s.from, s.to, s.method
                    ));
                }
                let eta = t0.elapsed().as_secs_f64() / done as f64 * (total_runs - done) as f64;
                progress(&format!(
                    "[{done}/{total_runs}, ~{:.0} min of timing left] rep {rep} {} {:<13} {:>3} tok{} ttft {:>6.0} ms  total {:>6.0} ms  max stall {:>6.0} ms  switch {:>6.1} ms  {}",
                    eta / 60.0,
                    prompt.id,
                    arm.id,
                    t.tokens_streamed,
                    if t.killed { " KILLED" } else { "" },
                    t.ttft_ms,
                    t.total_ms,
                    t.max_stall_ms,
                    t.switch_cost_ms,
                    t.rungs_used.join("→"),
                ));
                logs.push(o.log);
                match cells
                    .iter_mut()
                    .find(|c| c.arm == arm.id && c.prompt == prompt.id)
                {
                    Some(c) => c.timed.push(t),
                    None => cells.push(Cell {
                        arm: arm.id.clone(),
                        prompt: prompt.id.clone(),
                        timed: vec![t],
                        tokens_identical_across_reps: true,
                        quality: None,
                        continuation: None,
                    }),
                }
            }
        }
    }
    for c in &mut cells {
        let first = c.timed[0].token_ids.clone();
        c.tokens_identical_across_reps = c.timed.iter().all(|t| t.token_ids == first);
        // Later repetitions' text is written only where it differs from the first.
        if c.tokens_identical_across_reps {
            for t in c.timed.iter_mut().skip(1) {
                t.token_ids.clear();
                t.text.clear();
            }
        }
    }
    Ok((cells, logs))
}

/// The quality pass for the arms that switch, up to one token past the trace's last step: the
/// seam of every switch ([`SeamRecord`]: handoff JSD, its re-prefill floor, attention flatness
/// against the destination's own cache of the same tokens), folded into the arm's cell; returns
/// the runs' logs.
fn quality_pass(
    setup: &Setup<'_>,
    opts: &ConditionsOptions,
    runnable: &[&ArmSpec],
    projectors: &HashMap<String, RouteSet>,
    cells: &mut [Cell],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<RunLog>, BenchError> {
    let Setup { ladder, config, .. } = *setup;
    let mut logs = Vec::new();
    let max_tokens = opts
        .steps
        .last()
        .map_or(opts.max_tokens, |&s| (s + 2).min(opts.max_tokens));
    let mut native = NativeAttention::new(ladder.rungs.len(), config);
    let index_of = |name: &str| ladder.rungs.iter().position(|r| r.name() == name);
    for prompt in &opts.prompts {
        for arm in runnable.iter().filter(|a| a.switches()) {
            let routes = projectors.get(&arm.id).cloned().unwrap_or_default();
            let o = generate_once(
                setup,
                &RunSpec {
                    arm,
                    routes: &routes,
                    prompt,
                    pass: Pass::Quality,
                    rep: 0,
                    max_tokens,
                },
            )?;
            let g = &o.generation;
            let mut seams = Vec::new();
            for sw in &g.switches {
                let (Some(s), Some(d)) = (index_of(&sw.from), index_of(&sw.to)) else {
                    continue;
                };
                let migrated = o.captures[d]
                    .as_ref()
                    .map(AttentionCapture::mean_entropy)
                    .filter(|e| e.is_finite());
                let mut seq = o.prompt_ids.clone();
                seq.extend_from_slice(&g.tokens[..sw.at_token.min(g.tokens.len())]);
                let native_e = native.entropy(d, &ladder.rungs[d], &seq).ok();
                seams.push(SeamRecord {
                    at_token: sw.at_token,
                    from: sw.from.clone(),
                    to: sw.to.clone(),
                    kind: route_kind_of(ladder, s, d),
                    handoff_jsd: sw.handoff_jsd,
                    handoff_floor_jsd: sw.handoff_floor_jsd,
                    entropy_migrated: migrated,
                    entropy_native: native_e,
                    flatness: migrated.zip(native_e).map(|(m, n)| m / n),
                });
            }
            let cell = cells
                .iter_mut()
                .find(|c| c.arm == arm.id && c.prompt == prompt.id)
                .expect("every arm and prompt has a timed cell");
            let timed = &cell.timed[0].token_ids;
            let k = timed.len().min(g.tokens.len());
            let tokens_match_timing = timed[..k] == g.tokens[..k];
            progress(&format!(
                "quality {} {:<13} {}{}",
                prompt.id,
                arm.id,
                seams
                    .iter()
                    .map(|s| format!(
                        "{}→{} JSD {} flatness {}  ",
                        s.from,
                        s.to,
                        s.handoff_jsd.map_or("-".into(), |v| format!("{v:.4}")),
                        s.flatness.map_or("-".into(), |v| format!("{v:.3}"))
                    ))
                    .collect::<String>(),
                if tokens_match_timing {
                    ""
                } else {
                    "(tokens differ from timing rep 1)"
                }
            ));
            cell.quality = Some(QualityRun {
                seams,
                tokens_match_timing,
            });
            logs.push(o.log);
        }
    }
    native.clear();
    Ok(logs)
}

/// The judge: the largest rung scores each cell's first timing repetition from its first
/// switch (or the trace's first step), beside the repeated-4-gram fractions.
fn judge_pass(
    ladder: &Ladder,
    config: ContextConfig,
    opts: &ConditionsOptions,
    cells: &mut [Cell],
) -> Result<(), BenchError> {
    let mut judge = Judge::new(&ladder.rungs[0], config)?;
    let first_step = opts.steps.first().copied().unwrap_or(0);
    for prompt in &opts.prompts {
        for cell in cells.iter_mut().filter(|c| c.prompt == prompt.id) {
            let t = &cell.timed[0];
            if t.killed || t.prompt_ids.is_empty() {
                continue;
            }
            let j0 = t.switches.first().map_or(first_step, |s| s.at_token);
            if j0 >= t.token_ids.len() {
                continue;
            }
            let mut full = t.prompt_ids.clone();
            full.extend_from_slice(&t.token_ids);
            let score = judge.score(&full, t.prompt_ids.len() + j0)?;
            cell.continuation = Some(ContinuationQuality {
                judged_from: j0,
                judge: score,
                judge_ppl: score.perplexity(),
                repetition_after: repetition(&t.token_ids[j0..], REPETITION_N),
                repetition_all: repetition(&t.token_ids, REPETITION_N),
            });
        }
    }
    Ok(())
}
