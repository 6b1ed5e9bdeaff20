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
    /// Transplant against re-prefill at several context lengths, every route, both rungs warm.
    #[arg(long)]
    pub cost_sweep: bool,
    /// Context lengths of the cost sweep.
    #[arg(long, value_delimiter = ',', default_values_t = vec![128usize, 256, 512, 1024])]
    pub lengths: Vec<usize>,
    /// Corpus for the cost sweep's contexts.
    #[arg(long, default_value = "projectors/corpus")]
    pub corpus: PathBuf,
    /// Directory of projector files (default: the search order of `molt-run chat`).
    #[arg(long)]
    pub projectors: Option<PathBuf>,
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
    /// The conditions benchmark: `all`, or arm ids separated by commas (A, B, C, D,
    /// D-no-sandwich, D-no-remap, D-truncate, D-no-diagonal, D-dense, D-per-head).
    #[arg(long, value_name = "ARMS")]
    pub conditions: Option<String>,
    /// Prompts of the conditions benchmark (JSONL: id, kind, prompt).
    #[arg(long, default_value = "benches/prompts.jsonl")]
    pub prompts_file: PathBuf,
    /// Use only the first N prompts.
    #[arg(long)]
    pub prompts: Option<usize>,
    /// Tokens per answer in the conditions benchmark.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Generated-token indices where the trace steps down one rung (default: a quarter and
    /// five eighths into the answer).
    #[arg(long, value_delimiter = ',')]
    pub steps: Vec<usize>,
    /// Replay this trace instead of the one built from the rungs' footprints.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Skip the seam-measurement pass (handoff JSD, attention flatness).
    #[arg(long)]
    pub no_quality: bool,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    if !a.speed && !a.cost_sweep && a.conditions.is_none() {
        bail!("nothing to run: pass --conditions all, --cost-sweep and/or --speed");
    }
    if a.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if let Some(spec) = &a.conditions {
        crate::conditions::run(g, a, spec)?;
    }
    if a.cost_sweep {
        run_cost_sweep(g, a)?;
    }
    if a.speed {
        run_speed(g, a)?;
    }
    Ok(())
}

fn run_cost_sweep(g: &GlobalArgs, a: &Args) -> Result<()> {
    let ladder = g.open_ladder()?;
    let mut config = g.context_config()?;
    let max_len = a.lengths.iter().copied().max().unwrap_or(0);
    if max_len == 0 || a.lengths.contains(&0) {
        bail!("--lengths must be positive");
    }
    config.n_ctx = config
        .n_ctx
        .max(u32::try_from(max_len + 16).unwrap_or(u32::MAX));
    let text = molt::train::read_corpus(&a.corpus)?;
    let tokens = {
        let live = molt::session::LiveRung::load(&ladder.rungs[0], config)?;
        live.model().tokenize(&text, false)?
    };
    if tokens.len() <= max_len {
        bail!(
            "the corpus in {} has {} tokens; the sweep needs {}",
            a.corpus.display(),
            tokens.len(),
            max_len + 1
        );
    }
    let mut routes = molt::session::Routes::new(
        &ladder,
        molt::session::routes::search_dirs(a.projectors.as_deref()),
        molt::session::Variant::Auto,
    );
    let info = RunInfo::now();
    let points = molt::bench::cost_sweep::run(
        &ladder,
        config,
        &mut routes,
        &tokens,
        &molt::bench::cost_sweep::SweepOptions {
            lengths: a.lengths.clone(),
            reps: a.reps,
        },
        &mut |s| eprintln!("{s}"),
    )?;
    println!(
        "{:<14} {:>6} {:>13} {:>13} {:>8} {:>9} {:>9} {:>9}",
        "route", "ctx", "transplant ms", "reprefill ms", "speedup", "JSD", "floor", "FLOPs av."
    );
    for p in &points {
        println!(
            "{:<14} {:>6} {:>13.1} {:>13.1} {:>7.1}x {:>9.4} {:>9.4} {:>8.2}%",
            p.route,
            p.context_tokens,
            p.transplant_ms.median,
            p.reprefill_ms.median,
            p.speedup,
            p.transplant_jsd,
            p.reprefill_jsd,
            p.flops_avoided * 100.0
        );
    }
    std::fs::create_dir_all(&a.out_dir)?;
    let path = a.out_dir.join("cost_sweep.json");
    let doc = serde_json::json!({ "run": info, "threads": config.n_threads, "reps": a.reps, "lengths": a.lengths, "points": points });
    std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn run_speed(g: &GlobalArgs, a: &Args) -> Result<()> {
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
