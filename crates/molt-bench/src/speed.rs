//! Prefill and decode speed of each rung, through Molt's engine and, side by side in the same
//! run, through plain llama.cpp (the `llama-cpp-2` safe API over the same build, none of
//! Molt's code in the loop). The ratio says what Molt's wrapper costs; the absolute numbers
//! say what this machine does.
//!
//! A second, independent peer is llama.cpp's own `llama-bench` program ([`Peer`]), built by
//! `scripts/llama-tools.sh` from the same llama.cpp sources with the same flags: it runs in its
//! own process, alternating with Molt's engine repetition by repetition, under the same
//! protocol (prefill of a prompt into an empty cache; decode of single tokens from an empty
//! cache), the same micro-batch and the same repack setting. With `--tune` both run every
//! micro-batch (128/256/512) with llama.cpp's CPU repack off and on, beside the compute buffer
//! each reserves and the anonymous memory repack adds: the trade [`choose_setting`] decides.

use molt::engine::{
    Context, ContextConfig, Model, ModelOptions, Sampler, SamplingParams, Token, backend,
};
use molt::ladder::RungInfo;
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use molt::speed::{
    PeerRow, Setting, TURN_ANSWER_TOKENS, TURN_GAIN, TURN_PROMPT_TOKENS, choose_setting,
    turn_seconds,
};

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
#[derive(Debug, Clone, Serialize, Deserialize)]
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

/// llama.cpp's own `llama-bench` program, run as the peer.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The program.
    pub bin: PathBuf,
    /// What `scripts/llama-tools.sh` recorded of the build (its `SOURCE` file beside the
    /// binaries): a build from an sdist has no git commit for llama-bench to report.
    pub source: Option<String>,
}

/// One test of a llama-bench JSON report (the fields read).
#[derive(Debug, Deserialize)]
struct PeerTest {
    build_commit: String,
    build_number: i64,
    n_prompt: u64,
    n_gen: u64,
    avg_ts: f64,
}

/// One llama-bench run: prefill and decode tokens per second, and the build it reported.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerRun {
    /// Prefill tok/s.
    pub prefill_tps: f64,
    /// Decode tok/s.
    pub decode_tps: f64,
    /// "llama-bench <commit> (b<number>)".
    pub name: String,
}

impl Peer {
    /// The peer at `bin`, if that file exists.
    #[must_use]
    pub fn at(bin: &Path) -> Option<Self> {
        // The script's output directory holds SOURCE; the binary may be its link there or the
        // file under build/bin.
        let source = bin
            .ancestors()
            .skip(1)
            .take(3)
            .find_map(|d| std::fs::read_to_string(d.join("SOURCE")).ok())
            .and_then(|s| s.lines().next().map(str::to_owned));
        bin.is_file().then(|| Self {
            bin: bin.to_path_buf(),
            source,
        })
    }

    /// Runs llama-bench once (one repetition after its own warm-up) on `model`: a prefill of
    /// `prefill` tokens and a decode of `decode` tokens, both from an empty cache, F16 cache,
    /// flash attention off, every token through the CPU — what [`molt_peer_once`] measures.
    ///
    /// # Errors
    /// A message naming the program when it cannot run, fails, or prints no result.
    pub fn once(
        &self,
        model: &Path,
        setting: Setting,
        prefill: usize,
        decode: usize,
        threads: u32,
    ) -> Result<PeerRun, String> {
        let out = std::process::Command::new(&self.bin)
            .arg("-m")
            .arg(model)
            .args(["-p", &prefill.to_string(), "-n", &decode.to_string()])
            .args(["-t", &threads.to_string(), "-r", "1", "-b", "512"])
            .args(["-ub", &setting.n_ubatch.to_string()])
            .args(["--repack", if setting.repack { "1" } else { "0" }])
            .args(["-fa", "0", "-ctk", "f16", "-ctv", "f16", "-o", "json"])
            .output()
            .map_err(|e| format!("{}: {e}", self.bin.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} failed ({}): {}",
                self.bin.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" / ")
            ));
        }
        let mut run = parse_peer(&String::from_utf8_lossy(&out.stdout))
            .map_err(|e| format!("{}: {e}", self.bin.display()))?;
        if let Some(source) = &self.source
            && run.name.contains("unknown")
        {
            run.name = format!("llama-bench of {source}");
        }
        Ok(run)
    }
}

/// Reads llama-bench's JSON report: the prompt test's and the generation test's mean rates.
fn parse_peer(json: &str) -> Result<PeerRun, String> {
    let tests: Vec<PeerTest> =
        serde_json::from_str(json).map_err(|e| format!("its report does not parse: {e}"))?;
    let rate = |prompt: bool| {
        tests
            .iter()
            .find(|t| {
                if prompt {
                    t.n_prompt > 0 && t.n_gen == 0
                } else {
                    t.n_gen > 0 && t.n_prompt == 0
                }
            })
            .map(|t| t.avg_ts)
            .ok_or_else(|| {
                format!(
                    "its report has no {} test",
                    if prompt { "prompt" } else { "generation" }
                )
            })
    };
    let first = tests.first().ok_or("its report is empty")?;
    Ok(PeerRun {
        prefill_tps: rate(true)?,
        decode_tps: rate(false)?,
        name: format!(
            "llama-bench {} (b{})",
            first.build_commit, first.build_number
        ),
    })
}

/// Molt's engine under the peer's protocol: a context of `setting`'s micro-batch on `model`
/// (loaded with the setting's repack), a prefill of `toks` into the empty cache, then `decode`
/// single-token decodes from an empty cache. Returns prefill and decode tok/s and the bytes
/// llama.cpp reserved for the context (KV, compute and output buffers).
///
/// # Errors
/// A message when the context cannot be created or a decode fails.
pub fn molt_peer_once(
    model: &std::sync::Arc<Model>,
    setting: Setting,
    toks: &[Token],
    decode: usize,
    threads: u32,
) -> Result<(f64, f64, u64), String> {
    let cfg = ContextConfig {
        n_ctx: u32::try_from(toks.len().max(decode) + 8).unwrap_or(4096),
        n_batch: 512,
        n_ubatch: setting.n_ubatch,
        n_threads: threads,
        ..ContextConfig::default()
    };
    let mut ctx = Context::new(model.clone(), cfg).map_err(|e| e.to_string())?;
    let reserved = ctx.reserved_bytes();
    // Warm-up, as llama-bench does before it times anything.
    ctx.decode(&toks[..toks.len().min(32)])
        .map_err(|e| e.to_string())?;
    ctx.clear();
    let t = Instant::now();
    ctx.decode(toks).map_err(|e| e.to_string())?;
    let pf = toks.len() as f64 / t.elapsed().as_secs_f64();
    ctx.clear();
    let mut s = Sampler::new(SamplingParams::greedy());
    let mut tok = toks[0];
    let t = Instant::now();
    for _ in 0..decode {
        ctx.decode(&[tok]).map_err(|e| e.to_string())?;
        tok = s.sample(ctx.logits());
    }
    Ok((pf, decode as f64 / t.elapsed().as_secs_f64(), reserved))
}

/// Every setting's row of one rung, Molt and the peer alternating repetition by repetition.
///
/// # Errors
/// A message when a model, context or peer run fails.
pub fn measure_peer(
    rung: &RungInfo,
    peer: &Peer,
    settings: &[Setting],
    opts: &SpeedOptions,
    progress: &mut dyn FnMut(&PeerRow),
) -> Result<(Vec<PeerRow>, String), String> {
    let mut rows = Vec::new();
    let mut name = String::new();
    for repack in [false, true] {
        let of_repack: Vec<Setting> = settings
            .iter()
            .copied()
            .filter(|s| s.repack == repack)
            .collect();
        if of_repack.is_empty() {
            continue;
        }
        molt::pressure::trim_heap();
        let anon0 = molt::pressure::process_anon_rss_bytes().unwrap_or(0);
        let model = Model::load(&rung.path, rung.name(), ModelOptions { mmap: true, repack })
            .map_err(|e| e.to_string())?;
        let load_anon = molt::pressure::process_anon_rss_bytes()
            .unwrap_or(0)
            .saturating_sub(anon0);
        let mut toks = model
            .tokenize(&bench_text(), false)
            .map_err(|e| e.to_string())?;
        toks.truncate(opts.prefill_tokens);
        for setting in of_repack {
            let mut samples = Vec::new();
            let mut reserved = 0;
            for _ in 0..opts.reps.max(1) {
                let (pf, dc, r) =
                    molt_peer_once(&model, setting, &toks, opts.decode_tokens, opts.threads)?;
                reserved = r;
                let p = peer.once(
                    &rung.path,
                    setting,
                    toks.len(),
                    opts.decode_tokens,
                    opts.threads,
                )?;
                name = p.name;
                samples.push([pf, dc, p.prefill_tps, p.decode_tps]);
            }
            let median = |k: usize| Rate::from(samples.iter().map(|s| s[k]).collect()).median;
            let row = PeerRow {
                rung: rung.name().to_string(),
                n_ubatch: setting.n_ubatch,
                repack,
                prefill_tok_s: median(0),
                decode_tok_s: median(1),
                peer_prefill_tok_s: median(2),
                peer_decode_tok_s: median(3),
                prefill_ratio: median(0) / median(2).max(1e-9),
                decode_ratio: median(1) / median(3).max(1e-9),
                samples,
                reserved_mib: reserved as f64 / 1_048_576.0,
                load_anon_mib: load_anon as f64 / 1_048_576.0,
            };
            progress(&row);
            rows.push(row);
        }
    }
    Ok((rows, name))
}

/// `results/speed.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpeedDoc {
    /// The run's facts.
    pub run: serde_json::Value,
    /// Threads.
    pub threads: u32,
    /// Prompt tokens of the prefill.
    pub prefill_tokens: usize,
    /// Tokens decoded.
    pub decode_tokens: usize,
    /// Repetitions.
    pub reps: usize,
    /// Molt beside the `llama-cpp-2` safe API, per rung.
    pub rungs: Vec<RungSpeed>,
    /// The peer program and its build, when it ran.
    #[serde(default)]
    pub peer: Option<String>,
    /// Molt beside the peer at Molt's default setting, one row per rung (the goal's rows).
    #[serde(default)]
    pub rows: Vec<PeerRow>,
    /// Every measured setting (with `--tune`), the default's rows included.
    #[serde(default)]
    pub tuning: Vec<PeerRow>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_llama_bench_report_gives_both_rates_and_its_build() {
        let json = r#"[
          {"build_commit": "abc123", "build_number": 11434, "n_prompt": 256, "n_gen": 0, "avg_ts": 120.5, "other": 1},
          {"build_commit": "abc123", "build_number": 11434, "n_prompt": 0, "n_gen": 32, "avg_ts": 30.25}
        ]"#;
        let p = parse_peer(json).unwrap();
        assert_eq!(p.prefill_tps, 120.5);
        assert_eq!(p.decode_tps, 30.25);
        assert_eq!(p.name, "llama-bench abc123 (b11434)");
        assert!(parse_peer("[]").unwrap_err().contains("empty"));
        let only_pp = r#"[{"build_commit": "x", "build_number": 1, "n_prompt": 8, "n_gen": 0, "avg_ts": 1.0}]"#;
        assert!(parse_peer(only_pp).unwrap_err().contains("generation"));
        assert!(parse_peer("garbage").unwrap_err().contains("parse"));
    }

    fn row(
        n_ubatch: u32,
        repack: bool,
        prefill: f64,
        decode: f64,
        reserved: f64,
        anon: f64,
    ) -> PeerRow {
        PeerRow {
            rung: "r".into(),
            n_ubatch,
            repack,
            prefill_tok_s: prefill,
            decode_tok_s: decode,
            peer_prefill_tok_s: prefill,
            peer_decode_tok_s: decode,
            prefill_ratio: 1.0,
            decode_ratio: 1.0,
            samples: vec![],
            reserved_mib: reserved,
            load_anon_mib: anon,
        }
    }

    #[test]
    fn the_setting_is_the_quickest_turn_the_spare_memory_holds() {
        // Turn seconds (256 read + 256 written): 128/off 3.66+10.24 = 13.90; 512/off
        // 3.20+10.24 = 13.44 (3.3% quicker); 128/on 2.33+8.83 = 11.16; 512/on 2.13+8.83 = 10.96.
        let rows = vec![
            row(128, false, 70.0, 25.0, 100.0, 10.0),
            row(512, false, 80.0, 25.0, 330.0, 10.0),
            row(128, true, 110.0, 29.0, 100.0, 610.0),
            row(512, true, 120.0, 29.0, 330.0, 610.0),
        ];
        let mib = 1u64 << 20;
        assert_eq!(choose_setting(&rows, "r", 0), Setting::molt_default());
        assert_eq!(
            choose_setting(&rows, "r", 300 * mib),
            Setting {
                n_ubatch: 512,
                repack: false
            }
        );
        assert_eq!(
            choose_setting(&rows, "r", 700 * mib),
            Setting {
                n_ubatch: 128,
                repack: true
            }
        );
        assert_eq!(
            choose_setting(&rows, "r", 2000 * mib),
            Setting {
                n_ubatch: 512,
                repack: true
            }
        );
        // An unmeasured rung keeps the default.
        assert_eq!(
            choose_setting(&rows, "other", 2000 * mib),
            Setting::molt_default()
        );
        // A faster prefill that slows decode more than it gains is not taken
        // (2.84 + 12.8 = 15.64 s against 13.90).
        let slow_decode = vec![
            row(128, false, 70.0, 25.0, 100.0, 10.0),
            row(512, false, 90.0, 20.0, 330.0, 10.0),
        ];
        assert_eq!(
            choose_setting(&slow_decode, "r", 2000 * mib),
            Setting::molt_default()
        );
        // A slower prefill whose decode gains more is taken (what repack does to tier0 here:
        // 156 -> 97 tok/s prefill, 22.2 -> 30.6 tok/s decode; 13.17 s against 11.01 s).
        let repack_trade = vec![
            row(128, false, 156.0, 22.2, 97.0, 54.0),
            row(128, true, 97.0, 30.6, 97.0, 649.0),
        ];
        assert_eq!(
            choose_setting(&repack_trade, "r", 700 * mib),
            Setting {
                n_ubatch: 128,
                repack: true
            }
        );
        // Within the noise of the default: kept (13.58 s against 13.90, 2.3%).
        let close = vec![
            row(128, false, 70.0, 25.0, 100.0, 10.0),
            row(256, false, 74.0, 25.3, 200.0, 10.0),
        ];
        assert_eq!(
            choose_setting(&close, "r", 2000 * mib),
            Setting::molt_default()
        );
    }
}
