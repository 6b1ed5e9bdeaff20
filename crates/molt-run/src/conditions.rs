//! `molt-run bench --conditions`: validates the flags into the library's options, runs the
//! arms, writes `results/conditions.json`, `conditions_events.jsonl` and `token_series.json`.

use crate::bench::Args;
use crate::common::GlobalArgs;
use anyhow::{Result, bail};
use molt_bench::conditions::{self, ConditionsOptions};

pub fn run(g: &GlobalArgs, a: &Args, spec: &str) -> Result<()> {
    let arms = conditions::select_arms(spec)?;
    let mut prompts = conditions::load_prompts(&a.prompts_file)?;
    if let Some(n) = a.prompts {
        if n == 0 {
            bail!("--prompts must be at least 1");
        }
        prompts.truncate(n);
    }
    if a.max_tokens < 4 {
        bail!("--max-tokens must be at least 4");
    }
    if let Some(t) = &a.trace
        && !t.exists()
    {
        bail!("--trace {}: no such file", t.display());
    }
    let config = g.context_config()?;
    let ladder = g.open_ladder()?;
    let steps = if a.steps.is_empty() {
        conditions::default_steps(a.max_tokens, ladder.rungs.len())
    } else {
        a.steps.clone()
    };
    let opts = ConditionsOptions {
        arms,
        prompts,
        max_tokens: a.max_tokens,
        reps: a.reps,
        quality: !a.no_quality,
        steps,
        trace: a.trace.clone(),
        projector_dirs: molt::routes::search_dirs(a.projectors.as_deref()),
        chat: true,
    };
    let (report, logs) = conditions::run(&ladder, config, &opts, &mut |s| eprintln!("{s}"))?;
    println!("{}", molt_bench::page::table(&report));
    for p in conditions::write_outputs(&report, &logs, &a.out_dir)? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
