//! Prefill and decode speed of each rung, through Molt's engine and, side by side in the same
//! run, through plain llama.cpp (the `llama-cpp-2` safe API over the same build, none of
//! Molt's code in the loop). The ratio says what Molt's wrapper costs; the absolute numbers
//! say what this machine does.

use crate::engine::{
    Context, ContextConfig, Model, ModelOptions, Sampler, SamplingParams, Token, backend,
};
use crate::ladder::RungInfo;
use serde::Serialize;
use std::num::NonZeroU32;
use std::time::Instant;

/// One measurement series (median and spread over repetitions).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Rate {
    /// Median tokens per second.
    pub median: f64,
    /// Minimum over repetitions.
    pub min: f64,
    /// Maximum over repetitions.
    pub max: f64,
    /// Every repetition.
    pub samples: Vec<f64>,
}

impl Rate {
    /// Median, min and max of `v`.
    #[must_use]
    pub fn from(mut v: Vec<f64>) -> Self {
        let samples = v.clone();
        v.sort_by(f64::total_cmp);
        let median = if v.is_empty() { 0.0 } else { v[v.len() / 2] };
        Self {
            median,
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
            samples,
        }
    }
}

/// Speed of one rung.
#[derive(Debug, Clone, Serialize)]
pub struct RungSpeed {
    /// Rung name.
    pub rung: String,
    /// Model description.
    pub model: String,
    /// Prefill through Molt's engine.
    pub molt_prefill_tps: Rate,
    /// Decode through Molt's engine.
    pub molt_decode_tps: Rate,
    /// Prefill through plain llama.cpp.
    pub llama_prefill_tps: Rate,
    /// Decode through plain llama.cpp.
    pub llama_decode_tps: Rate,
    /// Molt decode median / llama.cpp decode median.
    pub decode_ratio: f64,
    /// Molt prefill median / llama.cpp prefill median.
    pub prefill_ratio: f64,
}

/// Options.
#[derive(Debug, Clone, Copy)]
pub struct SpeedOptions {
    /// Prompt tokens for prefill.
    pub prefill_tokens: usize,
    /// Tokens decoded one by one.
    pub decode_tokens: usize,
    /// Repetitions (alternating Molt / llama.cpp so drift hits both).
    pub reps: usize,
    /// Threads.
    pub threads: u32,
}

fn bench_text() -> String {
    "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns. \
     fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{:?}\", v); } "
        .repeat(64)
}

fn molt_once(
    model: &std::sync::Arc<Model>,
    toks: &[Token],
    decode: usize,
    threads: u32,
) -> Result<(f64, f64), String> {
    let cfg = ContextConfig {
        n_ctx: u32::try_from(toks.len() + decode + 8).unwrap_or(4096),
        n_batch: 512,
        n_threads: threads,
        ..ContextConfig::default()
    };
    let mut ctx = Context::new(model.clone(), cfg).map_err(|e| e.to_string())?;
    ctx.decode(&toks[..4]).map_err(|e| e.to_string())?;
    ctx.clear();
    let t = Instant::now();
    ctx.decode(toks).map_err(|e| e.to_string())?;
    let pf = toks.len() as f64 / t.elapsed().as_secs_f64();
    let mut s = Sampler::new(SamplingParams::greedy());
    let mut tok = s.sample(ctx.logits());
    let t = Instant::now();
    for _ in 0..decode {
        ctx.decode(&[tok]).map_err(|e| e.to_string())?;
        tok = s.sample(ctx.logits());
    }
    Ok((pf, decode as f64 / t.elapsed().as_secs_f64()))
}

fn llama_once(
    model: &llama_cpp_2::model::LlamaModel,
    toks: &[Token],
    decode: usize,
    threads: u32,
) -> Result<(f64, f64), String> {
    use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
    use llama_cpp_2::llama_batch::LlamaBatch;
    use llama_cpp_2::token::LlamaToken;
    let th = i32::try_from(threads).unwrap_or(2);
    let p = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(
            u32::try_from(toks.len() + decode + 8).unwrap_or(4096),
        ))
        .with_n_batch(512)
        .with_n_ubatch(512)
        .with_n_threads(th)
        .with_n_threads_batch(th)
        .with_type_k(KvCacheType::F16)
        .with_type_v(KvCacheType::F16)
        .with_flash_attention_policy(llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED);
    let mut ctx = model.new_context(backend(), p).map_err(|e| e.to_string())?;
    let run = |ctx: &mut llama_cpp_2::context::LlamaContext,
               ts: &[Token],
               pos0: usize|
     -> Result<(), String> {
        for (ci, chunk) in ts.chunks(512).enumerate() {
            let mut b = LlamaBatch::new(chunk.len(), 1);
            for (i, &t) in chunk.iter().enumerate() {
                let pos = i32::try_from(pos0 + ci * 512 + i).unwrap_or(0);
                b.add(LlamaToken(t), pos, &[0], i + 1 == chunk.len())
                    .map_err(|e| e.to_string())?;
            }
            ctx.decode(&mut b).map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    run(&mut ctx, &toks[..4], 0)?;
    ctx.clear_kv_cache();
    let t = Instant::now();
    run(&mut ctx, toks, 0)?;
    let pf = toks.len() as f64 / t.elapsed().as_secs_f64();
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i32::try_from(i).unwrap_or(0))
    };
    let mut tok = argmax(ctx.get_logits());
    let t = Instant::now();
    for i in 0..decode {
        run(&mut ctx, &[tok], toks.len() + i)?;
        tok = argmax(ctx.get_logits());
    }
    Ok((pf, decode as f64 / t.elapsed().as_secs_f64()))
}

/// Measures one rung.
///
/// # Errors
/// A message when a model or context cannot be created.
pub fn measure(rung: &RungInfo, opts: &SpeedOptions) -> Result<RungSpeed, String> {
    let model =
        Model::load(&rung.path, rung.name(), ModelOptions::default()).map_err(|e| e.to_string())?;
    let mut toks = model
        .tokenize(&bench_text(), false)
        .map_err(|e| e.to_string())?;
    toks.truncate(opts.prefill_tokens);
    if toks.len() < opts.prefill_tokens {
        return Err(format!(
            "benchmark text tokenizes to only {} tokens",
            toks.len()
        ));
    }
    let lp = llama_cpp_2::model::params::LlamaModelParams::default().with_use_mmap(true);
    let lmodel = llama_cpp_2::model::LlamaModel::load_from_file(backend(), &rung.path, &lp)
        .map_err(|e| e.to_string())?;
    let (mut mp, mut md, mut lpf, mut ld) = (vec![], vec![], vec![], vec![]);
    for _ in 0..opts.reps.max(1) {
        let (a, b) = molt_once(&model, &toks, opts.decode_tokens, opts.threads)?;
        mp.push(a);
        md.push(b);
        let (c, d) = llama_once(&lmodel, &toks, opts.decode_tokens, opts.threads)?;
        lpf.push(c);
        ld.push(d);
    }
    let (mp, md, lpf, ld) = (
        Rate::from(mp),
        Rate::from(md),
        Rate::from(lpf),
        Rate::from(ld),
    );
    Ok(RungSpeed {
        rung: rung.name().to_string(),
        model: rung.spec.model.clone(),
        decode_ratio: md.median / ld.median.max(1e-9),
        prefill_ratio: mp.median / lpf.median.max(1e-9),
        molt_prefill_tps: mp,
        molt_decode_tps: md,
        llama_prefill_tps: lpf,
        llama_decode_tps: ld,
    })
}
