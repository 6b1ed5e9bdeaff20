//! `molt-run inspect MODEL.gguf`.

use crate::common::GlobalArgs;
use anyhow::Result;
use molt::gguf::{GgufFile, ModelFacts, TokenizerIdentity};
use std::path::PathBuf;

/// Inspect options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF file.
    #[arg(required_unless_present = "system")]
    pub model: Option<PathBuf>,
    /// Print what this build was compiled for: llama.cpp's own system line (AVX2, AVX512, …)
    /// and the CPU features Molt's Rust code requires.
    #[arg(long)]
    pub system: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_g: &GlobalArgs, a: &Args) -> Result<()> {
    if a.system {
        let features = molt::engine::system::compiled_cpu_features();
        let llama = molt::engine::system::llama_system_info();
        if a.json {
            println!(
                "{}",
                serde_json::to_string_pretty(
                    &serde_json::json!({ "llama_system_info": llama, "rust_target_features": features })
                )?
            );
        } else {
            println!("llama.cpp: {llama}");
            println!(
                "molt (Rust) requires: {}",
                if features.is_empty() {
                    "baseline".to_string()
                } else {
                    features.join(", ")
                }
            );
        }
        if a.model.is_none() {
            return Ok(());
        }
    }
    let Some(model) = a.model.as_ref() else {
        return Ok(());
    };
    let t = std::time::Instant::now();
    let f = GgufFile::open(model)?;
    let facts = ModelFacts::from_gguf(&f)?;
    let tok = TokenizerIdentity::from_gguf(&f)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "file": model, "facts": facts, "tokenizer": tok.digest(), "read_ms": ms })
            )?
        );
    } else {
        print!("{}", table(model, &facts, tok.digest()));
        println!("metadata read in {ms:.1} ms (weights not loaded)");
    }
    Ok(())
}

/// The facts as a two-column table a user reads (`--json` has every field).
fn table(model: &std::path::Path, f: &ModelFacts, t: &molt::gguf::TokenizerDigest) -> String {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let opt = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |x| x.to_string());
    let rope = &f.rope;
    let scaling = match rope.scaling_factor {
        Some(x) if x != 0.0 => format!("{:?} x{x}", rope.scaling).to_lowercase(),
        _ => "none".to_string(),
    };
    let rows: Vec<(&str, String)> = vec![
        ("file", model.display().to_string()),
        ("architecture", f.architecture.clone()),
        ("name", f.name.clone().unwrap_or_else(|| "-".into())),
        ("type", f.file_type_name().unwrap_or("unknown").to_string()),
        (
            "size",
            format!(
                "{:.1} MiB ({} tensors, {:.1} MiB of weights)",
                mib(f.file_size),
                f.n_tensors,
                mib(f.total_tensor_bytes)
            ),
        ),
        ("layers", f.n_layer.to_string()),
        ("embedding", f.n_embd.to_string()),
        (
            "heads",
            format!(
                "{} query, {} key/value; head size {} (values {})",
                f.n_head, f.n_head_kv, f.head_dim, f.head_dim_v
            ),
        ),
        ("feed-forward", f.n_ff.to_string()),
        ("context", format!("{} tokens (trained)", f.n_ctx_train)),
        (
            "rope",
            format!(
                "{:?}, base {}, {} dims, scaling {scaling}",
                rope.kind, rope.freq_base, rope.dimension_count
            )
            .to_lowercase(),
        ),
        ("vocabulary", f.n_vocab.to_string()),
        (
            "tokenizer",
            format!(
                "{} (pre {}), {} tokens, {} merges",
                t.model,
                t.pre.as_deref().unwrap_or("-"),
                t.n_tokens,
                t.n_merges
            ),
        ),
        (
            "special",
            format!(
                "bos {}, eos {}, eot {}, pad {}, add bos {}",
                opt(t.special.bos),
                opt(t.special.eos),
                opt(t.special.eot),
                opt(t.special.pad),
                t.add_bos.map_or_else(|| "-".to_string(), |b| b.to_string())
            ),
        ),
        ("tokenizer sha256", t.sha256.clone()),
    ];
    let mut out = String::new();
    for (k, v) in rows {
        out.push_str(&format!("{k:<17}{v}\n"));
    }
    out
}
