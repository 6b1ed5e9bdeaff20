//! What choosing the next token costs beside what computing it costs: on one rung's real
//! logits, the sampler's time per token for the presets a user gets (greedy; the chat's
//! temperature 0.7, top-p 0.9, top-k 40; a request's temperature with top-p 0.95 or 1.0), the
//! current sampler beside the full-sort baseline it replaced, and the rung's own decode time
//! per token measured in the same run. A sampler that costs a fifth of a decode is a fifth
//! of the user's tokens per second.

use super::speed::Rate;
use molt::engine::{
    Context, ContextConfig, Model, ModelOptions, Sampler, SamplingParams, Token,
    sample_by_full_sort,
};
use molt::ladder::RungInfo;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// One preset's sampling cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingRow {
    /// Where a user meets it.
    pub preset: String,
    /// Its parameters.
    pub params: SamplingParams,
    /// The sampler, ms per token (median and spread over repetitions).
    pub ms_per_token: Rate,
    /// The full-sort baseline, ms per token.
    pub full_sort_ms_per_token: Rate,
    /// Tokens on which the two drew differently from the same uniform numbers (0 expected:
    /// the change is in speed only).
    pub disagreements: usize,
}

/// `results/sampling.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingDoc {
    /// The run's facts.
    pub run: serde_json::Value,
    /// The rung whose logits and decode were measured.
    pub rung: String,
    /// Vocabulary size (the length of every logits row).
    pub n_vocab: usize,
    /// Logits rows sampled per repetition (one per decoded token).
    pub rows: usize,
    /// Threads of the decode.
    pub threads: u32,
    /// The rung's decode, ms per token, greedy, measured while the rows were collected.
    pub decode_ms_per_token: f64,
    /// One row per preset.
    pub presets: Vec<SamplingRow>,
}

/// The presets a user meets: `(where, parameters)`.
#[must_use]
pub fn presets() -> Vec<(String, SamplingParams)> {
    vec![
        (
            "greedy (benchmarks, temperature 0)".into(),
            SamplingParams::greedy(),
        ),
        (
            "chat (temperature 0.7, top-p 0.9, top-k 40)".into(),
            SamplingParams::balanced(7),
        ),
        (
            "request (temperature 0.8, top-p 0.95)".into(),
            SamplingParams::nucleus(0.8, 0.95, 7),
        ),
        (
            "request (temperature 1.0, top-p 1.0)".into(),
            SamplingParams::nucleus(1.0, 1.0, 7),
        ),
    ]
}

/// Decodes `rows` tokens greedily on `rung` after a short prompt, keeping every logits row,
/// then times each preset's sampler over those rows against the full-sort baseline, `reps`
/// times alternating.
///
/// # Errors
/// A message when the model or context cannot be made or a decode fails.
pub fn measure(
    rung: &RungInfo,
    threads: u32,
    rows: usize,
    reps: usize,
    run: serde_json::Value,
) -> Result<SamplingDoc, String> {
    let model =
        Model::load(&rung.path, rung.name(), ModelOptions::default()).map_err(|e| e.to_string())?;
    let prompt = model
        .tokenize(
            "Write a short note on why a cache keeps recently used entries and what it evicts.",
            false,
        )
        .map_err(|e| e.to_string())?;
    let cfg = ContextConfig {
        n_ctx: u32::try_from(prompt.len() + rows + 8).unwrap_or(4096),
        n_threads: threads,
        ..ContextConfig::default()
    };
    let mut ctx = Context::new(model.clone(), cfg).map_err(|e| e.to_string())?;
    ctx.decode(&prompt).map_err(|e| e.to_string())?;
    let mut logits: Vec<Vec<f32>> = Vec::with_capacity(rows);
    let mut tok: Token = molt::engine::argmax(ctx.logits());
    let t = Instant::now();
    for _ in 0..rows {
        ctx.decode(&[tok]).map_err(|e| e.to_string())?;
        let row = ctx.logits().to_vec();
        tok = molt::engine::argmax(&row);
        logits.push(row);
    }
    let decode_ms = t.elapsed().as_secs_f64() * 1000.0 / rows.max(1) as f64;
    let n_vocab = logits.first().map_or(0, Vec::len);
    let mut presets_out = Vec::new();
    for (preset, params) in presets() {
        let (mut now, mut before) = (Vec::new(), Vec::new());
        let mut disagreements = 0;
        for rep in 0..reps.max(1) {
            // The same uniform numbers for both: the sampler's own RNG is seeded as it seeds.
            let mut s = Sampler::new(params);
            let t = Instant::now();
            let drawn: Vec<Token> = logits.iter().map(|l| s.sample(l)).collect();
            now.push(t.elapsed().as_secs_f64() * 1000.0 / rows.max(1) as f64);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(params.seed);
            let t = Instant::now();
            let reference: Vec<Token> = logits
                .iter()
                .map(|l| {
                    let u = if params.temperature > 0.0 {
                        rng.random::<f64>()
                    } else {
                        0.0
                    };
                    sample_by_full_sort(params, l, u)
                })
                .collect();
            before.push(t.elapsed().as_secs_f64() * 1000.0 / rows.max(1) as f64);
            if rep == 0 {
                // The whole-row nucleus draws in token order, the baseline in rank order: the
                // same distribution, other tokens for the same number.
                let comparable = !(params.top_p >= 1.0 && params.top_k == 0);
                if comparable {
                    disagreements = drawn.iter().zip(&reference).filter(|(a, b)| a != b).count();
                }
            }
        }
        presets_out.push(SamplingRow {
            preset,
            params,
            ms_per_token: Rate::from(now),
            full_sort_ms_per_token: Rate::from(before),
            disagreements,
        });
    }
    Ok(SamplingDoc {
        run,
        rung: rung.name().to_string(),
        n_vocab,
        rows,
        threads,
        decode_ms_per_token: decode_ms,
        presets: presets_out,
    })
}

/// The results page's section.
#[must_use]
pub fn section(doc: &SamplingDoc) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## Choosing the next token\n\nFrom `sampling.json` (`molt-run bench --sampling`): the sampler's time per token on {} real logits rows of {} ({} tokens each), beside the full sort of the row it replaced (the same draws: {} disagreements), and beside {}'s own decode, {:.1} ms per token in the same run ({} thread(s)). Median [min–max] over repetitions.\n",
        doc.rows,
        doc.rung,
        doc.n_vocab,
        doc.presets.iter().map(|p| p.disagreements).sum::<usize>(),
        doc.rung,
        doc.decode_ms_per_token,
        doc.threads
    );
    let _ = writeln!(
        s,
        "| preset | sampler ms/token | full sort ms/token | share of a decode, now → before |\n|---|---|---|---|"
    );
    for p in &doc.presets {
        let share = |ms: f64| 100.0 * ms / doc.decode_ms_per_token.max(1e-9);
        let _ = writeln!(
            s,
            "| {} | {:.3} [{:.3}–{:.3}] | {:.3} [{:.3}–{:.3}] | {:.1}% → {:.1}% |",
            p.preset,
            p.ms_per_token.median,
            p.ms_per_token.min,
            p.ms_per_token.max,
            p.full_sort_ms_per_token.median,
            p.full_sort_ms_per_token.min,
            p.full_sort_ms_per_token.max,
            share(p.ms_per_token.median),
            share(p.full_sort_ms_per_token.median)
        );
    }
    s
}
