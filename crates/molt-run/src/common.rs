//! Options every subcommand shares, their validation into typed settings, and the lines the
//! subcommands print for a session's events.

use anyhow::{Context as _, Result, bail};
use molt::engine::{ContextConfig, SamplingParams};
use molt::kv::CacheType;
use molt::ladder::{Ladder, search};
use molt::pressure::{Trace, TraceRefs};
use molt::sched::RungCost;
use molt::session::LeverInfo;
use std::path::{Path, PathBuf};

/// Global options.
#[derive(clap::Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Ladder: a name searched in $MOLT_HOME/models, ./models and ~/.local/share/molt/models,
    /// or a path to a ladder manifest (.toml).
    #[arg(long, global = true, default_value = search::DEFAULT_LADDER, env = "MOLT_LADDER")]
    pub ladder: String,
    /// Directory holding the model files (default: beside the manifest).
    #[arg(long, global = true)]
    pub models_dir: Option<PathBuf>,
    /// Context window in tokens, the same for every rung.
    #[arg(long, global = true, default_value_t = 2048)]
    pub n_ctx: u32,
    /// CPU threads (default: all cores).
    #[arg(long, global = true)]
    pub threads: Option<u32>,
    /// Prompt tokens per micro-batch (1..=512) for every rung: larger is faster prefill for a
    /// larger compute buffer (74 MiB at 128 on the Qwen ladder, 297 MiB at 512). Unset, each
    /// rung gets the one `bench --speed --tune` measured fastest within the budget (128
    /// without a measurement); set, it overrides that choice (as `MOLT_REPACK` does repack).
    #[arg(long, global = true)]
    pub ubatch: Option<u32>,
    /// KV cache element type (only unquantized caches can be transplanted).
    #[arg(long, global = true, value_enum, default_value_t = CacheArg::F16)]
    pub cache_type: CacheArg,
}

/// The refill's options (`chat`, `generate`, `serve`).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct RefillArgs {
    /// Refill: after a molt switch on a size route, the destination re-reads the history
    /// natively in place, N positions in the batch of every token it decodes, until every cell
    /// is its own (a summary keeps its facts; the compute is a re-prefill's, spread over the
    /// next tokens). 0 turns it off.
    #[arg(long = "refill", value_name = "N", default_value_t = molt::session::DEFAULT_REFILL_CHUNK)]
    pub chunk: usize,
    /// The refill's deadline: it re-reads more than --refill positions per token when that is
    /// what it takes to reach the newest token within T tokens (an answer that ends sooner is
    /// otherwise written over projected cells). 0: no deadline.
    #[arg(long = "refill-within", value_name = "T", default_value_t = molt::session::DEFAULT_REFILL_WITHIN)]
    pub within: usize,
    /// The refill's pace: each token carries as many positions as keep its gap within F times
    /// the rung's own gap (timed after the switch), never more than --refill and
    /// --refill-within give. 1 or less: unpaced.
    #[arg(long = "refill-pace", value_name = "F", default_value_t = molt::session::DEFAULT_REFILL_PACE)]
    pub pace: f64,
    /// Hurried switch: a size switch reads only the newest N positions before its first token
    /// and the positions it chose (the question, the answer so far, the sentences the question
    /// looked at) after it, paced as the refill. 0: the whole sparse read before the token.
    #[arg(long = "hurry", value_name = "N", default_value_t = molt::session::DEFAULT_HURRY)]
    pub hurry: usize,
}

/// `--cache-type` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheArg {
    /// 16-bit floats.
    F16,
    /// 32-bit floats.
    F32,
}

impl GlobalArgs {
    /// The context configuration every rung shares.
    pub fn context_config(&self) -> Result<ContextConfig> {
        if !(64..=131_072).contains(&self.n_ctx) {
            bail!("--n-ctx {} is outside 64..=131072", self.n_ctx);
        }
        let mut c = ContextConfig {
            n_ctx: self.n_ctx,
            ..ContextConfig::default()
        };
        if let Some(u) = self.ubatch {
            if !(1..=c.n_batch).contains(&u) {
                bail!("--ubatch {u} is outside 1..={}", c.n_batch);
            }
            c.n_ubatch = u;
        }
        if let Some(t) = self.threads {
            if t == 0 {
                bail!("--threads must be at least 1");
            }
            c.n_threads = t;
        }
        c.cache_type = match self.cache_type {
            CacheArg::F16 => CacheType::F16,
            CacheArg::F32 => CacheType::F32,
        };
        Ok(c)
    }

    /// The speed policy of a session on `ladder` ([`molt::speed`]): the ladder's measured
    /// settings from the first of `dirs` holding them, `--ubatch` and `MOLT_REPACK` as
    /// overrides. Measurements of other files are refused with a warning on stderr, not used.
    pub fn speed_policy(&self, ladder: &Ladder, dirs: &[PathBuf]) -> molt::speed::SpeedPolicy {
        let (measured, refused) = molt::speed::Measured::find(dirs, ladder);
        for e in refused {
            eprintln!("molt-run: warning: {e}");
        }
        molt::speed::SpeedPolicy {
            measured: measured.map(std::sync::Arc::new),
            forced_ubatch: self.ubatch,
            forced_repack: molt::speed::forced_repack_from_env(),
        }
    }

    /// Where the ladder is.
    pub fn locate(&self, create_default: bool) -> Result<search::Located> {
        search::locate(&self.ladder, self.models_dir.as_deref(), create_default)
            .map_err(anyhow::Error::msg)
    }

    /// Opens the ladder (files must be present).
    pub fn open_ladder(&self) -> Result<Ladder> {
        let loc = self.locate(false)?;
        Ladder::open(&loc.manifest, &loc.models_dir)
            .with_context(|| format!("opening ladder {}", loc.manifest.display()))
    }
}

/// Sampling settings from the shared flags, validated.
pub fn sampling(temperature: f32, top_p: f32, seed: u64) -> Result<SamplingParams> {
    if !(0.0..=5.0).contains(&temperature) || !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
        bail!("--temperature must be in 0..=5 and --top-p in (0, 1]");
    }
    Ok(SamplingParams::nucleus(temperature, top_p, seed))
}

/// Checks a trace file before any model loads: readable, valid JSON, every `of` naming a rung
/// (the footprints it refers to are measured later, see [`load_trace`]).
pub fn check_trace(path: &Path, rungs: &[String]) -> Result<()> {
    let refs: TraceRefs = rungs.iter().map(|r| (r.clone(), 1)).collect();
    Trace::load_with(path, &refs).with_context(|| format!("trace {}", path.display()))?;
    Ok(())
}

/// Loads a trace whose events may be relative (`{"frac": 1.05, "of": "tier1"}`): each rung name
/// stands for what that rung needs with a full context window of `n_ctx` tokens (weights,
/// context buffers and KV), as the session's policy models it.
pub fn load_trace(path: &Path, rungs: &[String], costs: &[RungCost], n_ctx: u32) -> Result<Trace> {
    let refs: TraceRefs = rungs
        .iter()
        .zip(costs)
        .map(|(r, c)| (r.clone(), c.resident_bytes() + c.kv_bytes(u64::from(n_ctx))))
        .collect();
    Trace::load_with(path, &refs).with_context(|| format!("trace {}", path.display()))
}

/// Loads every rung below the session's current one once and unmaps it again, so the policy
/// decides with measured context overheads instead of the session's conservative estimate
/// (which, on small models, can exceed the rung itself many times over), then puts them back
/// on standby (unloading dropped them, and the first answer's switch would load on the spot).
/// Returns `(rung, milliseconds)` per rung measured.
pub fn measure_rungs(session: &mut molt::session::Session) -> Result<Vec<(String, f64)>> {
    let home = session.current_index();
    let mut done = Vec::new();
    for i in home + 1..session.ladder().rungs.len() {
        let t0 = std::time::Instant::now();
        session.ensure_loaded(i)?;
        session.unload(i);
        done.push((
            session.ladder().rungs[i].name().to_string(),
            t0.elapsed().as_secs_f64() * 1e3,
        ));
    }
    session.prepare_standby();
    Ok(done)
}

/// What a switch up prepared in the background says beside its line: the destination's
/// load, and the conversation carried onto it meanwhile (empty when nothing was).
#[must_use]
pub fn background_part(s: &molt::session::SwitchInfo) -> String {
    let t = &s.timings;
    let mut out = String::new();
    if t.prepared_ms > 0.0 {
        out.push_str(&format!(
            " · {} prepared in the background in {:.0} ms over {} token(s)",
            s.to, t.prepared_ms, t.prepared_tokens
        ));
    }
    if t.carried_ms > 0.0 {
        out.push_str(&format!(
            ", the conversation carried there in {:.0} ms ({} token(s) caught up)",
            t.carried_ms, t.caught_up
        ));
    }
    out
}

/// A switch up's background load as one line: `⇡ loading tier0 in the background, answering
/// on tier2 meanwhile (footprint 1900 of 2400 MiB)`, or why it was dropped or failed.
pub fn prepare_line(p: &molt::session::PrepareInfo) -> String {
    use molt::session::PrepareState;
    let what = match p.state {
        PrepareState::Started if p.down => format!(
            "the budget is falling: carrying the conversation down to {} in the background, answering on {} meanwhile (footprint {} of {} MiB)",
            p.to,
            p.from,
            p.modelled_bytes >> 20,
            p.budget_bytes >> 20
        ),
        PrepareState::Dropped if p.down => format!(
            "the conversation carried down to {} dropped after {:.0} ms, {} tokens",
            p.to, p.elapsed_ms, p.tokens
        ),
        PrepareState::Started => format!(
            "loading {} in the background, answering on {} meanwhile (footprint {} of {} MiB)",
            p.to,
            p.from,
            p.modelled_bytes >> 20,
            p.budget_bytes >> 20
        ),
        PrepareState::Dropped => format!(
            "background load of {} dropped after {:.0} ms, {} tokens",
            p.to, p.elapsed_ms, p.tokens
        ),
        PrepareState::Skipped => format!(
            "the budget is falling, but the conversation is not carried down to {} in the background",
            p.to
        ),
        PrepareState::Failed => format!(
            "background load of {} failed after {:.0} ms",
            p.to, p.elapsed_ms
        ),
    };
    let mark = if p.down { '⇣' } else { '⇡' };
    match &p.reason {
        Some(r) => format!("{mark} {what}: {r}"),
        None => format!("{mark} {what}"),
    }
}

/// A park, resume, shed or relayout as one line: `⏸ park on tier1 (812 tokens, 40 ms, RSS
/// 1900 → 1100 MiB)`; a refill's end as `↻ tier2 re-read 812 positions …`.
pub fn lever_line(l: &LeverInfo) -> String {
    if l.lever == "refill" {
        return format!(
            "↻ {} re-read {} positions of the history natively behind the answer ({:.0} ms, in the batches of its tokens): its cache is its own again",
            l.rung, l.tokens, l.cost_ms
        );
    }
    if l.lever == "fill" {
        return format!(
            "↻ {} read the {} positions the switch left out ({:.0} ms): its cache is whole and its own",
            l.rung, l.tokens, l.cost_ms
        );
    }
    if let Some(why) = l.lever.strip_prefix("fill abandoned: ") {
        return format!(
            "↻ reading what the switch left out on {} failed after {} positions ({why}): the next prompt reads the rest again",
            l.rung, l.tokens
        );
    }
    if let Some(why) = l.lever.strip_prefix("refill abandoned: ") {
        return format!(
            "↻ refill on {} abandoned after {} positions: {why}",
            l.rung, l.tokens
        );
    }
    format!(
        "⏸ {} on {} ({} tokens, {:.0} ms, RSS {} → {} MiB)",
        l.lever,
        l.rung,
        l.tokens,
        l.cost_ms,
        l.rss_before >> 20,
        l.rss_after >> 20
    )
}
