//! What each rung really occupies, per context length, beside what the policy assumes — and
//! what parking gives back.
//!
//! For each rung, alone in the process (one at a time, freed before the next): load it
//! through a [`Session`], grow its context to each length by decoding real text, and read
//! the operating system's numbers — resident pages of the mapped GGUF (`smaps`), the file's
//! pages in the page cache (`mincore`), `RssAnon` (repacked weights, KV, compute buffers),
//! process RSS and PSS — beside the state blob's size (the KV bytes that parking keeps) and
//! the session's modelled footprint ([`Session::modelled_footprint`], what [`decide_one`]
//! compares with the budget). Then park at the longest context, measure the fall of RSS,
//! resume, and check the next token's logits against the unparked ones.
//!
//! [`decide_one`]: molt::sched::decide_one

use std::time::Instant;

use serde::Serialize;

use molt::engine::{ContextConfig, Token};
use molt::ladder::Ladder;
use molt::pressure::{
    file_resident_in_page_cache, process_anon_rss_bytes, process_pss_bytes, process_rss_bytes,
    return_freed_buffers_to_os,
};
use molt::session::{Session, SessionError, SessionOptions};

/// Options of the footprint bench.
#[derive(Debug, Clone)]
pub struct FootprintOptions {
    /// Context lengths to measure at (ascending; each must fit the context window).
    pub lengths: Vec<usize>,
}

/// One rung at one context length.
#[derive(Debug, Clone, Serialize)]
pub struct FootprintPoint {
    /// Tokens in the cache.
    pub context_tokens: usize,
    /// Resident bytes of the mapped GGUF in this process (`smaps` `Rss` of the mapping).
    pub weights_mapped_resident: u64,
    /// The file's pages in the page cache (`mincore`), mapped or not.
    pub weights_page_cache: u64,
    /// `RssAnon` above the process's level before the rung was loaded: repacked weights, KV
    /// buffer, compute and output buffers, tokenizer tables.
    pub anon_bytes: u64,
    /// The exported state's size: the KV bytes of these tokens (what a parked rung keeps).
    pub kv_state_bytes: u64,
    /// KV bytes the policy counts for these tokens (`kv_bytes_per_token × tokens`).
    pub kv_modelled_bytes: u64,
    /// The session's measured footprint: mapped weights resident + the anonymous bytes
    /// measured at load.
    pub measured_bytes: u64,
    /// Process RSS above its level before the rung was loaded: the rung's share of RSS.
    pub rss_delta_bytes: u64,
    /// Process RSS.
    pub rss_bytes: u64,
    /// Process PSS.
    pub pss_bytes: u64,
    /// What the policy assumes this rung costs with these tokens.
    pub modelled_bytes: u64,
    /// `modelled_bytes / rss_delta_bytes`: above 1, the model is conservative.
    pub modelled_over_rss_delta: f64,
}

/// Parking measured on one rung.
#[derive(Debug, Clone, Serialize)]
pub struct ParkMeasurement {
    /// Tokens in the cache when parked.
    pub context_tokens: usize,
    /// Mapped weights resident just before parking.
    pub weights_resident_before: u64,
    /// RSS just before.
    pub rss_before: u64,
    /// RSS while parked.
    pub rss_parked: u64,
    /// `rss_before − rss_parked`.
    pub rss_fall: u64,
    /// Bytes of the parked cache kept in host memory.
    pub parked_kv_bytes: u64,
    /// Park time, ms.
    pub park_ms: f64,
    /// Resume time (map, new context, import), ms.
    pub resume_ms: f64,
    /// RSS after resuming and decoding one token.
    pub rss_resumed: u64,
    /// Largest |Δ logit| of the next token, resumed vs never parked (0 = bit-exact).
    pub max_abs_logit_delta: f32,
}

/// One rung.
#[derive(Debug, Clone, Serialize)]
pub struct RungFootprint {
    /// Rung name.
    pub rung: String,
    /// GGUF file size.
    pub file_bytes: u64,
    /// Tensor bytes (the policy's weight cost).
    pub tensor_bytes: u64,
    /// KV bytes per token the policy uses.
    pub kv_bytes_per_token: u64,
    /// Anonymous bytes measured when the rung loaded (the policy's fixed context cost).
    pub load_anon_bytes: u64,
    /// Load time, ms.
    pub load_ms: f64,
    /// Measurements per context length.
    pub points: Vec<FootprintPoint>,
    /// Parking at the longest context.
    pub park: ParkMeasurement,
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Measures every rung of `ladder` (see the module docs). `tokens` is the text decoded to
/// reach each length; it must be longer than the largest length.
///
/// # Errors
/// [`SessionError`] from loading, decoding, parking or resuming.
///
/// # Panics
/// Never on valid input: lengths are checked against `tokens` and the window first.
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    tokens: &[Token],
    opts: &FootprintOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<RungFootprint>, SessionError> {
    return_freed_buffers_to_os();
    let max_len = opts.lengths.iter().copied().max().unwrap_or(0);
    if max_len + 2 > tokens.len() || max_len + 2 > config.n_ctx as usize {
        return Err(SessionError::PromptTooLong {
            prompt_tokens: max_len + 2,
            n_ctx: config.n_ctx,
            reserve: 2,
        });
    }
    let mut lengths = opts.lengths.clone();
    lengths.sort_unstable();
    lengths.dedup();
    let mut out = Vec::new();
    for (index, info) in ladder.rungs.iter().enumerate() {
        progress(&format!("footprint: {} ...", info.name()));
        let rss0 = process_rss_bytes().unwrap_or(0);
        let anon0 = process_anon_rss_bytes().unwrap_or(0);
        let t0 = Instant::now();
        let mut session = Session::with_options(
            ladder.clone(),
            config,
            info.name(),
            SessionOptions {
                projector_dirs: Vec::new(),
                ..SessionOptions::default()
            },
        )?;
        let load_ms = t0.elapsed().as_secs_f64() * 1e3;
        let costs = session.rung_costs();
        let cost = costs[index].clone();
        let mut points = Vec::new();
        let mut decoded = 0usize;
        let wrap = |source| SessionError::Engine {
            rung: info.name().to_string(),
            source,
        };
        for &len in &lengths {
            {
                let live = session
                    .rung_mut(index)
                    .ok_or_else(|| SessionError::UnknownRung(info.name().to_string()))?;
                live.ctx.decode(&tokens[decoded..len]).map_err(wrap)?;
                decoded = len;
            }
            let live = session
                .rung_mut(index)
                .ok_or_else(|| SessionError::UnknownRung(info.name().to_string()))?;
            let weights_mapped_resident = live.weights_resident();
            let kv_state_bytes = if len == 0 {
                0
            } else {
                live.ctx.export_state().map_err(wrap)?.len() as u64
            };
            let rss = process_rss_bytes().unwrap_or(0);
            let rss_delta_bytes = rss.saturating_sub(rss0);
            let modelled_bytes = session.modelled_footprint(index, len as u64);
            #[allow(clippy::cast_precision_loss)]
            let ratio = if rss_delta_bytes == 0 {
                0.0
            } else {
                modelled_bytes as f64 / rss_delta_bytes as f64
            };
            points.push(FootprintPoint {
                context_tokens: len,
                weights_mapped_resident,
                weights_page_cache: file_resident_in_page_cache(&info.path)
                    .map_or(0, |r| r.resident_bytes),
                anon_bytes: process_anon_rss_bytes().unwrap_or(0).saturating_sub(anon0),
                kv_state_bytes,
                kv_modelled_bytes: cost.kv_bytes(len as u64),
                measured_bytes: session.measured_footprint(),
                rss_delta_bytes,
                rss_bytes: rss,
                pss_bytes: process_pss_bytes().unwrap_or(0),
                modelled_bytes,
                modelled_over_rss_delta: ratio,
            });
        }
        // Park at the longest context: the reference logits of the next token first, then
        // take that token back out, park, resume and decode it again.
        let next = tokens[decoded];
        let reference = {
            let live = session
                .rung_mut(index)
                .ok_or_else(|| SessionError::UnknownRung(info.name().to_string()))?;
            live.ctx.decode(&[next]).map_err(wrap)?;
            let l = live.ctx.logits().to_vec();
            live.ctx.truncate(decoded);
            l
        };
        let weights_resident_before = session.rung_mut(index).map_or(0, |r| r.weights_resident());
        let rss_before = process_rss_bytes().unwrap_or(0);
        let t_park = Instant::now();
        session.park_weights()?;
        let park_ms = t_park.elapsed().as_secs_f64() * 1e3;
        let rss_parked = process_rss_bytes().unwrap_or(0);
        let parked_kv_bytes = session.parked_kv_bytes();
        let t_resume = Instant::now();
        session.resume_weights()?;
        let resume_ms = t_resume.elapsed().as_secs_f64() * 1e3;
        let resumed = {
            let live = session
                .rung_mut(index)
                .ok_or_else(|| SessionError::UnknownRung(info.name().to_string()))?;
            live.ctx.decode(&[next]).map_err(wrap)?;
            live.ctx.logits().to_vec()
        };
        let park = ParkMeasurement {
            context_tokens: decoded,
            weights_resident_before,
            rss_before,
            rss_parked,
            rss_fall: rss_before.saturating_sub(rss_parked),
            parked_kv_bytes,
            park_ms,
            resume_ms,
            rss_resumed: process_rss_bytes().unwrap_or(0),
            max_abs_logit_delta: max_abs(&reference, &resumed),
        };
        out.push(RungFootprint {
            rung: info.name().to_string(),
            file_bytes: info.file_bytes,
            tensor_bytes: cost.weights_bytes,
            kv_bytes_per_token: cost.kv_bytes_per_token,
            load_anon_bytes: cost.compute_bytes,
            load_ms,
            points,
            park,
        });
        drop(session);
    }
    Ok(out)
}
