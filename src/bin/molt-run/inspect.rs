//! `molt-run inspect MODEL.gguf`.

use crate::common::GlobalArgs;
use anyhow::Result;
use molt::gguf::{GgufFile, ModelFacts, TokenizerIdentity};
use std::path::PathBuf;

/// Inspect options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF file.
    pub model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_g: &GlobalArgs, a: &Args) -> Result<()> {
    let t = std::time::Instant::now();
    let f = GgufFile::open(&a.model)?;
    let facts = ModelFacts::from_gguf(&f)?;
    let tok = TokenizerIdentity::from_gguf(&f)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "file": a.model, "facts": facts, "tokenizer": tok.digest(), "read_ms": ms })
            )?
        );
    } else {
        println!("{}", a.model.display());
        println!("{facts:#?}");
        println!("{:#?}", tok.digest());
        println!("metadata read in {ms:.1} ms (weights not loaded)");
    }
    Ok(())
}
