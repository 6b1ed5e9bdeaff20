//! `molt-run bench`: the benchmark programs, JSON under `results/`.

use crate::common::GlobalArgs;
use anyhow::{Result, bail};
use molt::bench::{RunInfo, speed};
use std::path::PathBuf;

/// Bench options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Prefill and decode tok/s of every rung, Molt beside plain llama.cpp.
    #[arg(long)]
    pub speed: bool,
    /// Repetitions for timings.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 256)]
    pub prefill_tokens: usize,
    /// Tokens for the decode measurement.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Output directory.
    #[arg(long, default_value = "results")]
    pub out_dir: PathBuf,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    if !a.speed {
        bail!("nothing to run: pass --speed");
    }
    let ladder = g.open_ladder()?;
    let threads = g.context_config()?.n_threads;
    std::fs::create_dir_all(&a.out_dir)?;
    let info = RunInfo::now();
    let opts = speed::SpeedOptions {
        prefill_tokens: a.prefill_tokens,
        decode_tokens: a.decode_tokens,
        reps: a.reps,
        threads,
    };
    let mut rows = Vec::new();
    for r in &ladder.rungs {
        eprintln!("speed: {} ...", r.name());
        let s = speed::measure(r, &opts).map_err(anyhow::Error::msg)?;
        println!(
            "{:6} prefill {:6.1} tok/s (llama.cpp {:6.1}, ratio {:.3})  decode {:5.1} tok/s (llama.cpp {:5.1}, ratio {:.3})",
            s.rung,
            s.molt_prefill_tps.median,
            s.llama_prefill_tps.median,
            s.prefill_ratio,
            s.molt_decode_tps.median,
            s.llama_decode_tps.median,
            s.decode_ratio
        );
        rows.push(s);
    }
    let path = a.out_dir.join("speed.json");
    let doc = serde_json::json!({ "run": info, "threads": threads, "prefill_tokens": a.prefill_tokens, "decode_tokens": a.decode_tokens, "reps": a.reps, "rungs": rows });
    std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
