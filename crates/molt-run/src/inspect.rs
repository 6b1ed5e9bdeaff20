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
        println!("{}", model.display());
        println!("{facts:#?}");
        println!("{:#?}", tok.digest());
        println!("metadata read in {ms:.1} ms (weights not loaded)");
    }
    Ok(())
}
