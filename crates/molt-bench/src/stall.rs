//! The stall a user sees at a switch (`molt-run bench --stall`, `results/switch_stall.json`):
//! the time between the last token on the source and the first token on the destination,
//! everything included — the destination made ready, the cache carried, the first decode,
//! sampling — beside the destination's own gap between two tokens in the same run.
//!
//! How it runs: one session per repetition reads a context of about the asked length on the
//! smallest rung, then walks every ordered route of the ladder once, each leg a short answer
//! continuing the same cache with a switch forced a few tokens in (an Eulerian circuit of the
//! complete route graph, so one prefill serves every route). Before each leg the destination's
//! file is put in the asked page-cache state: warm (read through once) or cold
//! (`posix_fadvise(DONTNEED)`; pages another process maps stay, and the row says how much of
//! the file was still cached). Each switch's parts come from its [`SwitchInfo`]; what they do
//! not cover (sampling, the footprint sample after a switch) is `other`.
//!
//! Two setups are measured side by side: `before` loads the destination at the switch (the
//! landed behaviour, [`SessionOptions::standby`] and [`SessionOptions::prepare_up`] off),
//! `after` takes a switch down's destination off standby and loads a switch up's in the
//! background while the source goes on decoding ([`SessionOptions::prepare_up`]): the forced
//! switch up then waits for that load, the leg running up to [`UP_WAIT_TOKENS`] more tokens
//! on the source, and the row's `load` part is 0 with the overlapped load as its own part,
//! `prepared_in_background`. When the conversation was carried onto the destination in the
//! background too ([`molt::session`]'s prepare), the projection and re-reads are reported as
//! `carried_*` parts beside the stall, with `carried_in_background` (their time on the loading
//! thread) and `caught_up_tokens` (what the destination re-read to catch up with the source,
//! the last batch of it in the stall as `first_decode`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::BenchError;
use super::speed::Rate;
use molt::engine::{ContextConfig, Token};
use molt::ladder::Ladder;
use molt::session::{
    Event, GenerateOptions, Prompt, Session, SessionOptions, SwitchInfo, SwitchMethod, TokenControl,
};

/// Tokens a leg of the `after` setup may decode on the source while a switch up's destination
/// loads in the background, beyond the leg's own length; the leg is stopped once the
/// destination's tokens after the switch are in.
pub const UP_WAIT_TOKENS: usize = 1024;

/// Tokens a chain's context window holds per leg for the waits of prepared switches, on
/// average: a leg may wait up to [`UP_WAIT_TOKENS`], and a chain that runs out of window says
/// so (a carry decoding on half the cores beside the source took 100-300 tokens of the source
/// on the real ladder).
pub const WAIT_ROOM_PER_LEG: usize = 384;

/// Tokens after a switch that a leg watches a paced refill for: its gaps are measured until it
/// is done or this many tokens have passed; the answer's end reads the rest (its `fill` lever
/// counts in [`StallRow::lost_ms_median`]). The legs are chained into one conversation, and a
/// refill paced to ~3 gaps a token takes ~100-200 tokens to re-read ~1,200 positions.
pub const REFILL_WATCH_TOKENS: usize = 24;

/// The page-cache state of the destination's file before a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheState {
    /// Its pages in the page cache (read through once before the leg).
    Warm,
    /// Its pages dropped from the page cache before the leg, so they are read from disk.
    Cold,
}

/// Which switch a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Setup {
    /// The destination loaded at the switch (standby off).
    Before,
    /// Standby rungs on (the default session).
    After,
    /// As `After`, with a switch down known ahead, as a falling budget warns of it: the forced
    /// switch down waits, tokens on the source, for its destination to be carried in the
    /// background and caught up (the shadow, [`SessionOptions::forced_down_waits`]).
    Warned,
}

/// Options of the stall benchmark.
#[derive(Debug, Clone)]
pub struct StallOptions {
    /// Context lengths to switch at, tokens (approximate: the legs add a few each).
    pub lengths: Vec<usize>,
    /// Repetitions of every route.
    pub reps: usize,
    /// Page-cache states.
    pub caches: Vec<CacheState>,
    /// Setups measured.
    pub setups: Vec<Setup>,
    /// Tokens generated on the source before the forced switch.
    pub lead_tokens: usize,
    /// Tokens generated on the destination after the switch (its inter-token latency).
    pub itl_tokens: usize,
    /// Projector directories (the session's search order when empty).
    pub projector_dirs: Vec<PathBuf>,
    /// The sessions' hurried sparse read ([`SessionOptions::hurry`]).
    pub hurry: usize,
}

impl StallOptions {
    /// The real run: ~128 and ~1024 tokens, 3 repetitions, warm and cold, every setup.
    #[must_use]
    pub fn full(projector_dirs: Vec<PathBuf>) -> Self {
        Self {
            lengths: vec![128, 1024],
            reps: 3,
            caches: vec![CacheState::Warm, CacheState::Cold],
            setups: vec![Setup::Before, Setup::After, Setup::Warned],
            lead_tokens: 2,
            itl_tokens: 8,
            projector_dirs,
            hurry: molt::session::DEFAULT_HURRY,
        }
    }

    /// A smoke run (a tiny ladder's test): one short context, one repetition.
    #[must_use]
    pub fn quick(projector_dirs: Vec<PathBuf>) -> Self {
        Self {
            lengths: vec![32],
            reps: 1,
            itl_tokens: 3,
            ..Self::full(projector_dirs)
        }
    }
}

/// Median, min and max, ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
}

impl Spread {
    /// The spread of `v`.
    #[must_use]
    pub fn of(v: &[f64]) -> Self {
        let r = Rate::from(v.to_vec());
        Self {
            median: r.median,
            min: r.min,
            max: r.max,
        }
    }
}

/// One route, direction, context length and cache state of one setup.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StallRow {
    /// `src->dst`.
    pub route: String,
    /// `down` (to a smaller rung) or `up`.
    pub direction: String,
    /// Context tokens at the switch (median over repetitions).
    pub context_tokens: usize,
    /// Page-cache state of the destination's file before the switch.
    pub cache: CacheState,
    /// Last token on the source to first token on the destination, ms.
    pub stall_ms: Spread,
    /// Medians of the stall's parts, ms (see the module docs).
    pub parts_ms: BTreeMap<String, f64>,
    /// The destination's median gap between two tokens after the switch, same runs, ms.
    pub itl_ms_median: f64,
    /// What the standby rungs held when the switch began, MiB (median).
    pub standby_rss_mib: f64,
    /// Share of repetitions whose destination came off standby.
    pub from_standby: f64,
    /// Share of the destination's file in the page cache just before the leg (median): the
    /// honest reading of `cold` when another process maps the file.
    pub dst_page_cache_frac: f64,
    /// How the cache was carried (`molt`, `reprefill-no-projector`, …), of the first
    /// repetition.
    pub method: String,
    /// Every repetition's stall, ms.
    pub samples: Vec<f64>,
    /// The context length asked (the legs add a few tokens each).
    #[serde(default)]
    pub length: usize,
    /// The source's median gap between two tokens before the switch, same runs, ms: for a
    /// prepared switch, what preparing it cost the answer meanwhile.
    #[serde(default)]
    pub source_itl_ms_median: f64,
    /// After a switch followed by a refill: the destination's median gap while the refill
    /// re-read the history in the batches of its tokens (none: no refill ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_gap_ms_median: Option<f64>,
    /// The tokens after the switch the refill took (median; none: no refill ran, or none was
    /// done within [`REFILL_WATCH_TOKENS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_tokens_median: Option<f64>,
    /// The longest gap while the refill ran (the worst repetition; none: no refill ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_gap_ms_max: Option<f64>,
    /// Everything the switch cost the answer beyond the destination's own gaps (median over
    /// repetitions), ms: the stall less one gap, each watched refill gap less one gap, and the
    /// answer's end reading what the refill had not (`fill`). What a user waits for in all,
    /// where `stall_ms` is only the first wait. 0 in files written before this field.
    #[serde(default)]
    pub lost_ms_median: f64,
    /// Where `itl_ms_median` comes from: `after` (the destination's gaps after the switch, or
    /// after its refill) or `as-source` (the refill outlasted the watch: the rung's gaps
    /// before the switches leaving it, same run, same length).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub itl_from: String,
    /// The sessions' hurried switch ([`SessionOptions::hurry`]: the newest positions a size
    /// switch reads before its first token; 0: the whole sparse read before it, and in every
    /// file written before this field).
    #[serde(default, skip_serializing_if = "super::is_zero_count")]
    pub hurry: usize,
}

impl StallRow {
    /// The context length asked: recorded, or, for a row of an older file, the nearer of the
    /// full run's two.
    #[must_use]
    pub fn asked_length(&self) -> usize {
        if self.length > 0 {
            self.length
        } else if self.context_tokens < 600 {
            128
        } else {
            1024
        }
    }

    /// Whether `other` measures the same route, cache state and asked length.
    #[must_use]
    pub fn same_cell(&self, other: &Self) -> bool {
        self.route == other.route
            && self.cache == other.cache
            && self.asked_length() == other.asked_length()
    }
}

/// `old` with every row `new` measures again replaced, and `new`'s other rows added.
#[must_use]
pub fn merge_rows(old: &[StallRow], new: &[StallRow]) -> Vec<StallRow> {
    let mut out: Vec<StallRow> = old
        .iter()
        .filter(|o| !new.iter().any(|n| n.same_cell(o)))
        .cloned()
        .collect();
    out.extend(new.iter().cloned());
    out.sort_by(|a, b| {
        (a.asked_length(), &a.route, a.cache == CacheState::Cold).cmp(&(
            b.asked_length(),
            &b.route,
            b.cache == CacheState::Cold,
        ))
    });
    out
}

/// Rows by setup name (`before`, `after`).
pub type RowsBySetup = BTreeMap<String, Vec<StallRow>>;

/// One measured switch.
#[derive(Debug, Clone)]
struct Sample {
    from: usize,
    to: usize,
    length: usize,
    cache: CacheState,
    context_tokens: usize,
    stall_ms: f64,
    /// The gap after the destination's first token: whether the switch left anything for
    /// the next token to wait for.
    next_gap_ms: f64,
    itl_ms: Vec<f64>,
    /// The destination's gaps while a refill after the switch re-read the history in the
    /// batches of its tokens (none: no refill), and the answer token it was done by.
    refill_gaps_ms: Vec<f64>,
    refill_at: Option<usize>,
    /// What the answer's end read of the positions the refill had not reached when the leg
    /// stopped ([`molt::session::Session`]'s fill), ms.
    fill_ms: f64,
    /// The source's gaps before the switch (while a shadow or a load ran, for the prepared
    /// switches).
    source_itl_ms: Vec<f64>,
    info: SwitchInfo,
    standby_bytes: u64,
    page_cache_frac: f64,
    /// The session's hurried switch ([`SessionOptions::hurry`]).
    hurry: usize,
}

/// Every ordered route of an `n`-rung ladder once, as a circuit starting and ending on the
/// smallest rung (Hierholzer's walk over the complete directed graph).
#[must_use]
pub fn route_circuit(n: usize) -> Vec<(usize, usize)> {
    if n < 2 {
        return Vec::new();
    }
    let mut unused: Vec<Vec<usize>> = (0..n)
        .map(|a| (0..n).filter(|&b| b != a).rev().collect())
        .collect();
    let mut stack = vec![n - 1];
    let mut path = Vec::new();
    while let Some(&v) = stack.last() {
        if let Some(w) = unused[v].pop() {
            stack.push(w);
        } else {
            path.push(v);
            stack.pop();
        }
    }
    path.reverse();
    path.windows(2).map(|w| (w[0], w[1])).collect()
}

/// Runs the benchmark: every setup, length, cache state and repetition; `progress` gets a
/// line per leg, `checkpoint` the rows of every setup so far (and the repetitions they pool)
/// after each repetition, so a run cut short still leaves its results. Returns the rows of
/// each setup.
///
/// # Errors
/// A session failure, or a corpus too short for the longest context.
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    corpus: &str,
    opts: &StallOptions,
    progress: &mut dyn FnMut(&str),
    checkpoint: &mut dyn FnMut(&RowsBySetup, usize),
) -> Result<RowsBySetup, BenchError> {
    let mut samples: BTreeMap<&'static str, Vec<Sample>> = BTreeMap::new();
    for rep in 0..opts.reps {
        for &length in &opts.lengths {
            for &cache in &opts.caches {
                // The setups alternate inside a repetition, so drift on a shared machine hits
                // both alike.
                for &setup in &opts.setups {
                    let got = chain(ladder, config, corpus, opts, setup, length, cache)?;
                    for s in &got {
                        progress(&format!(
                            "rep {rep} {setup:?} {cache:?} ~{length}: {}->{} stall {:.1} ms (load {:.1}, switch {:.1}, prepared in the background {:.1} over {} tokens), itl {:.1} ms",
                            ladder.rungs[s.from].name(),
                            ladder.rungs[s.to].name(),
                            s.stall_ms,
                            s.info.timings.load_ms,
                            s.info.timings.cost_ms,
                            s.info.timings.prepared_ms,
                            s.info.timings.prepared_tokens,
                            median(&s.itl_ms),
                        ));
                    }
                    samples.entry(setup_name(setup)).or_default().extend(got);
                }
            }
        }
        checkpoint(&summarise(ladder, &samples), rep + 1);
    }
    Ok(summarise(ladder, &samples))
}

fn summarise(ladder: &Ladder, samples: &BTreeMap<&'static str, Vec<Sample>>) -> RowsBySetup {
    samples
        .iter()
        .map(|(name, s)| ((*name).to_string(), rows(ladder, s)))
        .collect()
}

fn setup_name(s: Setup) -> &'static str {
    match s {
        Setup::Before => "before",
        Setup::After => "after",
        Setup::Warned => "warned",
    }
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    Rate::from(v.to_vec()).median
}

/// A text of about `length` tokens of the corpus, as the smallest rung tokenizes it.
fn context_text(session: &mut Session, corpus: &str, length: usize) -> Result<String, BenchError> {
    let idx = session.current_index();
    let name = session.current_rung().to_string();
    let live = session
        .rung_mut(idx)
        .ok_or_else(|| BenchError::Config(format!("rung {name} is not loaded")))?;
    let tokens: Vec<Token> =
        live.model()
            .tokenize(corpus, false)
            .map_err(|source| BenchError::Engine {
                rung: name.clone(),
                source,
            })?;
    if tokens.len() < length {
        return Err(BenchError::Config(format!(
            "the corpus has {} tokens; the stall bench asked for {length}",
            tokens.len()
        )));
    }
    Ok(live.model().detokenize(&tokens[..length]))
}

/// Keeps a leg from ending at an end-of-generation token before its switch (a switch up may
/// wait many tokens for its background load): their logits are masked. The legs measure gaps
/// between tokens, not text.
struct NoEndOfText(Vec<usize>);

impl NoEndOfText {
    fn of(model: &molt::engine::Model) -> Self {
        Self(
            (0..model.n_vocab())
                .filter(|&t| Token::try_from(t).is_ok_and(|t| model.is_eog(t)))
                .collect(),
        )
    }
}

impl TokenControl for NoEndOfText {
    fn shape(&mut self, logits: &mut [f32]) {
        for &t in &self.0 {
            if let Some(l) = logits.get_mut(t) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// The kind of the route `from → to` as the session's bindings give it.
fn session_kind(ladder: &Ladder, from: usize, to: usize) -> molt::routes::RouteKind {
    molt::routes::route_kind(
        &molt::routes::binding(&ladder.rungs[from]),
        &molt::routes::binding(&ladder.rungs[to]),
    )
}

/// One repetition: a session reads the context on the smallest rung, then walks the route
/// circuit.
fn chain(
    ladder: &Ladder,
    config: ContextConfig,
    corpus: &str,
    opts: &StallOptions,
    setup: Setup,
    length: usize,
    cache: CacheState,
) -> Result<Vec<Sample>, BenchError> {
    let sopts = SessionOptions {
        standby: setup != Setup::Before,
        prepare_up: setup != Setup::Before,
        prepare_down: setup != Setup::Before,
        // A cold page cache is what memory pressure leaves behind, and pressure cools the
        // standby rungs first (their pages released, the rung kept): a hot rung's pages are
        // mapped, cannot be dropped, and its cold row would measure a warm switch.
        standby_hot: cache == CacheState::Warm,
        hurry: opts.hurry,
        projector_dirs: if opts.projector_dirs.is_empty() {
            SessionOptions::default().projector_dirs
        } else {
            opts.projector_dirs.clone()
        },
        research: molt::session::Research {
            forced_up_waits: setup != Setup::Before,
            forced_down_waits: setup == Setup::Warned,
            ..molt::session::Research::default()
        },
        ..SessionOptions::default()
    };
    let n = ladder.rungs.len();
    let refill_chunk = sopts.refill_chunk;
    let refill_opts = sopts.clone();
    let refills_on = |kind| refill_opts.refills(kind);
    let mut session = Session::with_options(ladder.clone(), config, ladder.rungs[0].name(), sopts)?;
    session.move_idle(n - 1)?;
    // A chat turn, as `chat` and `generate` send a prompt: the corpus text as the user's
    // message, rendered with the chat template (whose opening the head re-read's anchor holds).
    let mut prompt = Prompt::User(context_text(&mut session, corpus, length)?);
    // Every rung of a ladder shares its tokenizer.
    let mut no_end = {
        let idx = session.current_index();
        session
            .rung_mut(idx)
            .map_or(NoEndOfText(Vec::new()), |r| NoEndOfText::of(r.model()))
    };
    let mut out = Vec::new();
    for (from, to) in route_circuit(n) {
        // The session may have ended a leg early (end of text): the next leg continues it.
        debug_assert_eq!(session.current_index(), from);
        let path = &ladder.rungs[to].path;
        match cache {
            CacheState::Warm => {
                molt::pressure::pages::read_into_page_cache(path).map_err(io_err(path))?;
            }
            CacheState::Cold => {
                molt::pressure::pages::drop_from_page_cache(path).map_err(io_err(path))?;
            }
        }
        let page_cache_frac = molt::pressure::file_resident_in_page_cache(path)
            .map_or(f64::NAN, |r| {
                r.resident_bytes as f64 / r.file_bytes.max(1) as f64
            });
        let standby_bytes = session.standby_bytes();
        let mut sample = None;
        // A leg whose answer ends before the switch is run again from where it stopped.
        // A switch up prepared in the background waits for its load on the source.
        let wait = match setup {
            Setup::After if to < from => UP_WAIT_TOKENS,
            Setup::Warned => UP_WAIT_TOKENS,
            _ => 0,
        };
        let stop = session.cancel_handle();
        for _attempt in 0..3 {
            let leg = GenerateOptions {
                // Room for a refill of the whole window after a size switch.
                max_tokens: opts.lead_tokens
                    + 1
                    + opts.itl_tokens
                    + wait
                    + (config.n_ctx as usize).div_ceil(refill_chunk.max(1)),
                force_switch: Some((opts.lead_tokens, to)),
                ..GenerateOptions::default()
            };
            let mut latencies: Vec<(usize, f64)> = Vec::new();
            let mut switch: Option<SwitchInfo> = None;
            let mut refill_at: Option<usize> = None;
            let mut fill_ms = 0.0;
            // A Molt switch down a size route is followed by a refill (when the session's
            // options say so) of what it did not read natively — projected cells, or the
            // positions a sparse read left out; none when it read the whole cache: the
            // refill's tokens are not the destination's gap, and the leg goes on until
            // `itl_tokens` of the destination's own follow it. (Counting a switch that read
            // everything as refilling kept its leg going to `max_tokens`: a run's ~128-token
            // chain reached ~1,150-1,680 tokens.)
            let refills = |w: &SwitchInfo| {
                let t = &w.timings;
                let native = t.head + t.recomputed + t.tail;
                w.method == SwitchMethod::Molt
                    && refills_on(session_kind(ladder, from, to))
                    && t.cells > native
            };
            session.generate_with(&prompt, &leg, &mut no_end, &mut |e| match e {
                Event::Token {
                    index, latency_ms, ..
                } => {
                    latencies.push((*index, *latency_ms));
                    // The destination's tokens are in: the leg has what it measures. A paced
                    // refill is watched for `REFILL_WATCH_TOKENS` tokens at most; what it has
                    // not read then is read at the answer's end (its `fill` lever is counted).
                    let from = switch.as_ref().map(|w| {
                        if refills(w) {
                            refill_at.unwrap_or(usize::MAX)
                        } else {
                            w.at_token
                        }
                    });
                    let watched = switch
                        .as_ref()
                        .is_some_and(|w| refills(w) && *index >= w.at_token + REFILL_WATCH_TOKENS);
                    if watched || from.is_some_and(|a| *index >= a.saturating_add(opts.itl_tokens))
                    {
                        stop.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                Event::Switch(info) => switch = Some(info.clone()),
                Event::Lever(l) if l.lever.starts_with("refill") => {
                    refill_at = Some(l.at_token);
                }
                Event::Lever(l) if l.lever.starts_with("fill") => fill_ms += l.cost_ms,
                _ => {}
            })?;
            prompt = Prompt::Text(String::new());
            let Some(info) = switch else { continue };
            let at = info.at_token;
            // The gap before token `k` of the leg.
            let gap = |k: usize| {
                latencies
                    .iter()
                    .find(|(i, _)| *i == k)
                    .map_or(f64::NAN, |&(_, l)| l)
            };
            let stall_ms = gap(at);
            sample = Some(Sample {
                hurry: opts.hurry,
                from,
                to,
                length,
                cache,
                context_tokens: session.history().len(),
                stall_ms,
                next_gap_ms: gap(at + 1),
                // The destination's own gaps: after the refill, when one ran.
                itl_ms: if refills(&info) && refill_at.is_none() {
                    Vec::new()
                } else {
                    latencies
                        .iter()
                        .filter(|(i, _)| *i > refill_at.unwrap_or(at))
                        .map(|&(_, l)| l)
                        .collect()
                },
                // The gaps while the refill ran: until it was done, or until the leg stopped
                // watching it.
                refill_gaps_ms: latencies
                    .iter()
                    .filter(|(i, _)| *i > at && refills(&info) && refill_at.is_none_or(|k| *i <= k))
                    .map(|&(_, l)| l)
                    .collect(),
                refill_at: refill_at.map(|k| k - at),
                fill_ms,
                // The leg's first token follows the previous leg's end, not a gap.
                source_itl_ms: latencies
                    .iter()
                    .skip(1)
                    .filter(|(i, _)| *i < at)
                    .map(|&(_, l)| l)
                    .collect(),
                info,
                standby_bytes,
                page_cache_frac,
            });
            break;
        }
        let Some(s) = sample else {
            return Err(BenchError::Config(format!(
                "{} -> {}: three answers in a row ended before the switch",
                ladder.rungs[from].name(),
                ladder.rungs[to].name()
            )));
        };
        out.push(s);
    }
    Ok(out)
}

fn io_err(path: &std::path::Path) -> impl Fn(molt::pressure::PressureError) -> BenchError + '_ {
    move |e| BenchError::Config(format!("{}: {e}", path.display()))
}

/// The stall's parts of one switch, ms (keys as in the results file).
fn parts(s: &Sample) -> BTreeMap<String, f64> {
    let t = &s.info.timings;
    let mut p = BTreeMap::new();
    if t.from_standby {
        p.insert("standby_activate".into(), t.load_ms);
        p.insert("load".into(), 0.0);
    } else {
        p.insert("load".into(), t.load_ms);
    }
    if t.prepared_ms > 0.0 {
        // Overlapped with the source's decoding: not in the stall, reported beside it.
        p.insert("prepared_in_background".into(), t.prepared_ms);
        p.insert("prepared_tokens".into(), t.prepared_tokens as f64);
    }
    if let Some(lp) = t.load_parts {
        p.insert("load_model".into(), lp.model_ms);
        p.insert("load_context".into(), lp.context_ms);
        p.insert("load_warmup".into(), lp.warmup_ms);
    }
    // A switch up carried in the background did its projection and re-reads on the loading
    // thread: they are reported beside the stall (prefixed `carried_`), which holds only the
    // destination's catch-up batch (`first_decode`).
    let pre = if t.carried_ms > 0.0 {
        p.insert("carried_in_background".into(), t.carried_ms);
        p.insert("caught_up_tokens".into(), t.caught_up as f64);
        "carried_"
    } else {
        ""
    };
    p.insert(format!("{pre}export"), t.export_ms);
    p.insert(format!("{pre}project"), t.project_ms);
    p.insert(format!("{pre}import"), t.import_ms);
    p.insert(format!("{pre}head_reread"), t.head_ms);
    p.insert(format!("{pre}token_recompute"), t.spans_ms);
    p.insert("topk_recompute".into(), t.recompute_ms);
    p.insert("first_decode".into(), t.first_decode_ms);
    p.insert("switch_total".into(), t.cost_ms);
    if s.next_gap_ms.is_finite() {
        p.insert("next_gap".into(), s.next_gap_ms);
    }
    p.insert(
        "other".into(),
        (s.stall_ms - t.load_ms - t.cost_ms).max(0.0),
    );
    p
}

fn rows(ladder: &Ladder, samples: &[Sample]) -> Vec<StallRow> {
    // Each rung's own gaps as the source of a leg, by length and page-cache state.
    let mut own: BTreeMap<(usize, usize, u8), Vec<f64>> = BTreeMap::new();
    for s in samples {
        let c = u8::from(s.cache == CacheState::Cold);
        own.entry((s.length, s.from, c))
            .or_default()
            .extend(s.source_itl_ms.iter().copied());
    }
    let mut groups: BTreeMap<(usize, usize, usize, u8), Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        let c = u8::from(s.cache == CacheState::Cold);
        groups
            .entry((s.length, s.from, s.to, c))
            .or_default()
            .push(s);
    }
    groups
        .into_values()
        .map(|g| {
            let first = g[0];
            let stalls: Vec<f64> = g.iter().map(|s| s.stall_ms).collect();
            let mut parts_ms = BTreeMap::new();
            let all: Vec<BTreeMap<String, f64>> = g.iter().map(|s| parts(s)).collect();
            for key in all
                .iter()
                .flat_map(|m| m.keys())
                .collect::<std::collections::BTreeSet<_>>()
            {
                let v: Vec<f64> = all.iter().filter_map(|m| m.get(key).copied()).collect();
                parts_ms.insert(key.clone(), median(&v));
            }
            let mut itl: Vec<f64> = g.iter().flat_map(|s| s.itl_ms.iter().copied()).collect();
            let itl_from = if itl.is_empty() {
                let c = u8::from(first.cache == CacheState::Cold);
                itl = own
                    .get(&(first.length, first.to, c))
                    .cloned()
                    .unwrap_or_default();
                "as-source"
            } else {
                "after"
            };
            let itl_median = median(&itl);
            let lost: Vec<f64> = g
                .iter()
                .map(|s| {
                    (s.stall_ms - itl_median).max(0.0)
                        + s.refill_gaps_ms
                            .iter()
                            .map(|l| (l - itl_median).max(0.0))
                            .sum::<f64>()
                        + s.fill_ms
                })
                .collect();
            let ctx: Vec<f64> = g.iter().map(|s| s.context_tokens as f64).collect();
            let standby: Vec<f64> = g
                .iter()
                .map(|s| s.standby_bytes as f64 / f64::from(1u32 << 20))
                .collect();
            let frac: Vec<f64> = g.iter().map(|s| s.page_cache_frac).collect();
            StallRow {
                route: format!(
                    "{}->{}",
                    ladder.rungs[first.from].name(),
                    ladder.rungs[first.to].name()
                ),
                direction: if first.to > first.from { "down" } else { "up" }.into(),
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "a token count"
                )]
                context_tokens: median(&ctx) as usize,
                cache: first.cache,
                stall_ms: Spread::of(&stalls),
                parts_ms,
                itl_ms_median: itl_median,
                standby_rss_mib: median(&standby),
                from_standby: g.iter().filter(|s| s.info.timings.from_standby).count() as f64
                    / g.len() as f64,
                dst_page_cache_frac: median(&frac),
                method: first.info.method.as_str().to_string(),
                samples: stalls,
                length: first.length,
                source_itl_ms_median: median(
                    &g.iter()
                        .flat_map(|s| s.source_itl_ms.iter().copied())
                        .collect::<Vec<_>>(),
                ),
                refill_gap_ms_median: {
                    let v: Vec<f64> = g
                        .iter()
                        .flat_map(|s| s.refill_gaps_ms.iter().copied())
                        .collect();
                    (!v.is_empty()).then(|| median(&v))
                },
                refill_tokens_median: {
                    #[allow(clippy::cast_precision_loss)]
                    let v: Vec<f64> = g
                        .iter()
                        .filter_map(|s| s.refill_at.map(|k| k as f64))
                        .collect();
                    (!v.is_empty()).then(|| median(&v))
                },
                refill_gap_ms_max: g
                    .iter()
                    .flat_map(|s| s.refill_gaps_ms.iter().copied())
                    .reduce(f64::max),
                lost_ms_median: median(&lost),
                itl_from: itl_from.into(),
                hurry: first.hurry,
            }
        })
        .collect()
}

/// The results file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StallDoc {
    /// Machine and build.
    #[serde(default)]
    pub run: serde_json::Value,
    /// Threads every decode used.
    pub threads: u32,
    /// Context window of every rung.
    pub n_ctx: u32,
    /// What else ran on the machine meanwhile.
    pub contention: String,
    /// Repetitions per row.
    pub reps: usize,
    /// What the context is: `chat` ([`CONTEXT`], a user turn rendered with the chat template)
    /// or `raw` (the corpus text as is; files written before this field).
    #[serde(default = "raw_context")]
    pub context: String,
    /// The switch as the session now makes it (standby on).
    pub rows: Vec<StallRow>,
    /// The same measured with the destination loaded at the switch (the landed behaviour).
    #[serde(default)]
    pub before_rows: Vec<StallRow>,
    /// The same as `rows` with every switch down known ahead (the `warned` setup): its
    /// destination carried in the background and caught up before the switch.
    #[serde(default)]
    pub warned_rows: Vec<StallRow>,
}

/// The context this build's stall bench switches in (see [`StallDoc::context`]).
pub const CONTEXT: &str = "chat";

fn raw_context() -> String {
    "raw".into()
}

impl StallDoc {
    /// The down routes, warm cache, whose median stall exceeds `factor` × the destination's
    /// median inter-token latency.
    #[must_use]
    pub fn down_warm_over(&self, factor: f64) -> Vec<&StallRow> {
        Self::over(&self.rows, factor)
    }

    /// [`StallDoc::down_warm_over`] of the switches down known ahead (`warned_rows`).
    #[must_use]
    pub fn warned_down_warm_over(&self, factor: f64) -> Vec<&StallRow> {
        Self::over(&self.warned_rows, factor)
    }

    fn over(rows: &[StallRow], factor: f64) -> Vec<&StallRow> {
        rows.iter()
            .filter(|r| r.direction == "down" && r.cache == CacheState::Warm)
            .filter(|r| r.stall_ms.median > factor * r.itl_ms_median)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::route_circuit;

    #[test]
    fn the_circuit_walks_every_route_once_from_the_smallest_rung() {
        for n in 2..6 {
            let c = route_circuit(n);
            assert_eq!(c.len(), n * (n - 1), "{c:?}");
            assert_eq!(c[0].0, n - 1);
            assert_eq!(c.last().unwrap().1, n - 1);
            for w in c.windows(2) {
                assert_eq!(w[0].1, w[1].0, "{c:?}");
            }
            let mut sorted = c.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), c.len(), "no route twice: {c:?}");
            assert!(c.iter().all(|(a, b)| a != b));
        }
        assert!(route_circuit(1).is_empty());
    }
}
