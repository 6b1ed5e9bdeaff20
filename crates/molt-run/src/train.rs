//! `molt-run train-projectors`: fit the KV projectors of a ladder on the project's own corpus
//! (`projectors/corpus/*.txt`), write them bound to the rungs' sha256, and write every residual
//! to a report: `results/projector_residuals.json` for the shipped ladder, the projectors'
//! folder (`<out>/<ladder>/fit_report.json`) for any other, and never over a report of
//! another ladder, so fitting one's own ladder leaves the project's committed results alone.
//!
//! The corpus is text the team wrote (`notes.txt`, `code.txt`) plus answers tier0 generated
//! from the team's own seed prompts (`seeds.txt` → `generated.txt` as raw text, and
//! `chat-seeds.txt` → `chats.jsonl` as whole conversations fitted in their chat-template form),
//! produced here once with `--generate-corpus` and committed, so fitting is reproducible
//! without regenerating.

use crate::common::GlobalArgs;
use anyhow::{Context as _, Result, bail};
use molt::engine::SamplingParams;
use molt::routes::{Routes, Variant};
use molt::session::{GenerateOptions, Prompt, Session};
use molt::train::{
    ChatSample, TrainOptions, corpus_windows, fit_ladder_windows, read_chats, read_corpus,
};
use molt::transplant::projector::TensorDtype;
use std::path::PathBuf;

/// Options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Corpus directory (every *.txt in it as raw text, and `chats.jsonl` as conversations).
    #[arg(long, default_value = "projectors/corpus")]
    pub corpus: PathBuf,
    /// Where projectors are written (`<out>/<ladder>/`).
    #[arg(long, default_value = "projectors")]
    pub out: PathBuf,
    /// Tokens per window (each decoded from position 0).
    #[arg(long, default_value_t = 256)]
    pub window: usize,
    /// Every n-th window is held out for choosing λ and the depth remap.
    #[arg(long, default_value_t = 5)]
    pub held_out_every: usize,
    /// Also fit the ablation variants (per-head, no sandwich, no depth remap, truncate,
    /// identity, dense on the precision route).
    #[arg(long)]
    pub ablations: bool,
    /// Also fit the hidden maps of selective top-k recompute for these k (comma-separated,
    /// e.g. `2,4,6`), written under `<out>/<ladder>/ablations/`.
    #[arg(long, value_delimiter = ',', value_name = "K,...")]
    pub topk: Vec<usize>,
    /// Leave each window's first N positions out of the fit: the attention sink's outsized
    /// K/V would weigh on every map (and `--head-reread` re-reads them natively). The shipped
    /// maps were fitted with the default.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub skip_head: usize,
    /// Widen each fitted map's output heads to the destination's spread on the training rows
    /// (undoes the ridge's shrinkage toward the mean; keys that are too narrow flatten the
    /// destination's attention). On by default, as the shipped maps were fitted;
    /// `--restore-spread false` for the plain ridge maps.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub restore_spread: bool,
    /// Store maps as f32 instead of f16.
    #[arg(long)]
    pub f32: bool,
    /// First generate `generated.txt` in the corpus directory from `seeds.txt` with the
    /// largest rung (if it does not exist yet).
    #[arg(long)]
    pub generate_corpus: bool,
    /// Tokens per generated seed answer.
    #[arg(long, default_value_t = 192)]
    pub seed_tokens: usize,
    /// Do nothing if every route already has a projector bound to these rungs' files (what
    /// the demo and CI run: the shipped maps are reused unless the local rungs differ).
    #[arg(long)]
    pub if_stale: bool,
    /// Residual report; default `results/projector_residuals.json` for the shipped ladder,
    /// `<out>/<ladder>/fit_report.json` for any other. A report of another ladder is never
    /// overwritten.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Only write the rungs' anchors (each rung's own cache of the chat template's opening,
    /// `<out>/<ladder>/anchors/`), which every fit also writes.
    #[arg(long)]
    pub anchors_only: bool,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    let config = window_config(g, a.window, a.held_out_every)?;
    if a.topk.contains(&0) {
        bail!("--topk values must be at least 1");
    }
    let ladder = g.open_ladder()?;
    // Checked before any work: a fit of minutes must not end in a refused report.
    let report_path = report_path(a, ladder.name())?;
    sweep_partials(&[&a.out, &a.out.join(ladder.name()), &a.corpus]);
    if a.anchors_only {
        return anchors(&ladder, config, a);
    }
    if a.if_stale {
        let mut routes = Routes::new(&ladder, vec![a.out.clone()], Variant::Auto);
        let n = ladder.rungs.len();
        let stale: Vec<String> = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .filter_map(|(i, j)| match routes.get(i, j) {
                Err(e) => Some(e.to_string()),
                // Carried by the identity until a map is fitted: a fit is still due.
                Ok(_) if routes.is_unfitted_identity(i, j) => Some(format!(
                    "no diagonal map for {} -> {}",
                    ladder.rungs[i].name(),
                    ladder.rungs[j].name()
                )),
                Ok(_) => None,
            })
            .collect();
        if stale.is_empty() {
            let anchors_ok = (0..n).all(|i| matches!(routes.anchor(i), Ok(Some(_))));
            eprintln!(
                "projectors in {} match every rung; nothing to fit",
                a.out.display()
            );
            if !anchors_ok {
                return anchors(&ladder, config, a);
            }
            return Ok(());
        }
        for s in &stale {
            eprintln!("stale: {s}");
        }
    }
    if a.generate_corpus {
        generate_corpus(&ladder, config, a)?;
    }
    let text = read_corpus(&a.corpus)?;
    let chats = read_chats(&a.corpus)?;
    let wins = {
        let live = molt::session::LiveRung::load(&ladder.rungs[0], config)?;
        corpus_windows(live.model(), &text, &chats, a.window)?
    };
    let wins: Vec<&[molt::engine::Token]> = wins.iter().map(Vec::as_slice).collect();
    eprintln!(
        "corpus: {} tokens in {} windows ({} of them chats) from {}",
        wins.iter().map(|w| w.len()).sum::<usize>(),
        wins.len(),
        chats.len(),
        a.corpus.display()
    );
    let variants = if a.ablations {
        vec![
            Variant::Auto,
            Variant::Dense,
            Variant::PerHead,
            Variant::NoSandwich,
            Variant::NoRemap,
            Variant::Truncate,
            Variant::Identity,
        ]
    } else {
        vec![Variant::Auto]
    };
    let opts = TrainOptions {
        window: a.window,
        held_out_every: a.held_out_every,
        variants,
        dtype: if a.f32 {
            TensorDtype::F32
        } else {
            TensorDtype::F16
        },
        out_dir: a.out.clone(),
        skip_head: a.skip_head,
        restore_spread: a.restore_spread,
    };
    let started = std::time::Instant::now();
    let mut eta = Eta::new(&ladder, opts.variants.len());
    let mut report = fit_ladder_windows(&ladder, config, &wins, &opts, &mut |s| eta.line(s))?;
    anchors(&ladder, config, a)?;
    if !a.topk.is_empty() {
        report.topk = molt::train::topk::fit_topk_maps_windows(
            &ladder,
            config,
            &wins,
            &opts,
            &a.topk,
            &mut |s| eprintln!("{s}"),
        )?;
    }
    println!(
        "{:<16} {:<18} {:>9} {:>9} {:>9} {:>9}",
        "route", "variant", "K held", "K train", "V held", "V train"
    );
    for r in &report.routes {
        println!(
            "{:<16} {:<18} {:>9.4} {:>9.4} {:>9.4} {:>9.4}",
            r.route,
            r.variant.tag(r.kind),
            r.fit.k.held_out,
            r.fit.k.train,
            r.fit.v.held_out,
            r.fit.v.train
        );
    }
    if let Some(dir) = report_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let doc = serde_json::json!({ "run": molt_bench::RunInfo::now(), "ladder": ladder.name(), "report": report });
    molt::durable::write(&report_path, serde_json::to_string_pretty(&doc)?.as_bytes())
        .with_context(|| format!("writing {}", report_path.display()))?;
    eprintln!("wrote {}", report_path.display());
    eprintln!(
        "fitted {} route(s) in {}",
        report.routes.len(),
        fmt_secs(started.elapsed().as_secs_f64())
    );
    Ok(())
}

/// Where the residual report of ladder `ladder` goes (see the module docs).
///
/// # Errors
/// When the file holds the report of another ladder (or something that is not a report).
fn report_path(a: &Args, ladder: &str) -> Result<PathBuf> {
    let path = a.report.clone().unwrap_or_else(|| {
        if ladder == molt::ladder::search::DEFAULT_LADDER {
            PathBuf::from("results/projector_residuals.json")
        } else {
            a.out.join(ladder).join("fit_report.json")
        }
    });
    if let Ok(text) = std::fs::read_to_string(&path) {
        let holds = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("ladder")?.as_str().map(str::to_string));
        match holds {
            Some(l) if l == ladder => {}
            Some(l) => bail!(
                "{} holds the fit report of ladder {l}; not overwriting it with {ladder}'s \
                 (give another --report)",
                path.display()
            ),
            None => bail!(
                "{} is not a fit report; not overwriting it (give another --report)",
                path.display()
            ),
        }
    }
    Ok(path)
}

/// Writes every rung's anchor under `<out>/<ladder>/anchors/`.
/// The context configuration for fitting on corpus windows of `window` tokens (each decoded
/// from position 0, so the window must fit), after checking the window and hold-out settings
/// `train-projectors` and `map-curve` share.
pub fn window_config(
    g: &GlobalArgs,
    window: usize,
    held_out_every: usize,
) -> Result<molt::engine::ContextConfig> {
    if window < 16 || held_out_every < 2 {
        bail!("--window must be at least 16 and --held-out-every at least 2");
    }
    let mut config = g.context_config()?;
    config.n_ctx = config
        .n_ctx
        .max(u32::try_from(window).unwrap_or(u32::MAX) + 8);
    Ok(config)
}

fn anchors(
    ladder: &molt::ladder::Ladder,
    config: molt::engine::ContextConfig,
    a: &Args,
) -> Result<()> {
    for path in molt::train::write_anchors(ladder, config, &a.out)? {
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn generate_corpus(
    ladder: &molt::ladder::Ladder,
    config: molt::engine::ContextConfig,
    a: &Args,
) -> Result<()> {
    generate_chats(ladder, config, a)?;
    let out = a.corpus.join("generated.txt");
    if out.exists() {
        eprintln!("{} exists; not regenerating", out.display());
        return Ok(());
    }
    let seeds = std::fs::read_to_string(a.corpus.join("seeds.txt"))
        .with_context(|| format!("reading {}", a.corpus.join("seeds.txt").display()))?;
    let mut session = Session::new(ladder.clone(), config, ladder.rungs[0].name())?;
    let mut text = String::new();
    for (i, seed) in seeds.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        session.reset();
        let opts = GenerateOptions {
            max_tokens: a.seed_tokens,
            sampling: SamplingParams::balanced(u64::try_from(i).unwrap_or(0)),
            force_switch: None,
        };
        let g = session.generate(&Prompt::User(seed.to_string()), &opts, &mut |_| {})?;
        eprintln!("seed {}: {} tokens", i + 1, g.tokens.len());
        text.push_str(&g.text);
        text.push_str("\n\n");
    }
    molt::durable::write(&out, text.as_bytes())?;
    Ok(())
}

/// Removes the partial files an interrupted fit or corpus write left in `dirs` (their process is
/// gone, so nothing will finish them) and says which. A directory that cannot be listed is
/// left to the write that needs it to report.
fn sweep_partials(dirs: &[&std::path::Path]) {
    for dir in dirs {
        for stale in molt::durable::sweep_stale(dir).unwrap_or_default() {
            eprintln!("removed {} (left by an interrupted write)", stale.display());
        }
    }
}

/// `chat-seeds.txt` → `chats.jsonl`: the largest rung's greedy answer to every seed prompt, kept
/// with its prompt so the fit sees the whole conversation in its chat-template form.
fn generate_chats(
    ladder: &molt::ladder::Ladder,
    config: molt::engine::ContextConfig,
    a: &Args,
) -> Result<()> {
    let out = a.corpus.join("chats.jsonl");
    let seeds_path = a.corpus.join("chat-seeds.txt");
    if out.exists() || !seeds_path.exists() {
        return Ok(());
    }
    let seeds = std::fs::read_to_string(&seeds_path)
        .with_context(|| format!("reading {}", seeds_path.display()))?;
    let mut session = Session::new(ladder.clone(), config, ladder.rungs[0].name())?;
    let mut lines = String::new();
    for (i, seed) in seeds.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        session.reset();
        let opts = GenerateOptions {
            max_tokens: a.seed_tokens,
            sampling: SamplingParams::greedy(),
            force_switch: None,
        };
        let g = session.generate(&Prompt::User(seed.to_string()), &opts, &mut |_| {})?;
        eprintln!("chat seed {}: {} tokens", i + 1, g.tokens.len());
        let c = ChatSample {
            prompt: seed.to_string(),
            answer: g.text,
        };
        lines.push_str(&serde_json::to_string(&c)?);
        lines.push('\n');
    }
    molt::durable::write(&out, lines.as_bytes())?;
    Ok(())
}

/// Progress of a fit with a bar, the time so far and an estimate of what is left. The fit's
/// steps are the K/V collection on each rung (weighed by the rung's file size, which its
/// decode time follows) and one fit per route and variant (weighed as an eighth of the
/// smallest rung's collection); the estimate scales the weights still to come by the time the
/// finished ones took.
struct Eta {
    weights: Vec<f64>,
    step: usize,
    start: std::time::Instant,
}

impl Eta {
    fn new(ladder: &molt::ladder::Ladder, variants: usize) -> Self {
        let bytes: Vec<f64> = ladder.rungs.iter().map(|r| r.file_bytes as f64).collect();
        let fit = bytes.iter().copied().fold(f64::INFINITY, f64::min) / 8.0;
        let n = bytes.len();
        let mut weights = bytes;
        weights.extend(std::iter::repeat_n(fit, n * n.saturating_sub(1) * variants));
        Self {
            weights,
            step: 0,
            start: std::time::Instant::now(),
        }
    }

    /// Prints `line`; a line opening a step (`collecting …`, `fitting …`) advances the bar.
    fn line(&mut self, line: &str) {
        if !(line.starts_with("collecting ") || line.starts_with("fitting ")) {
            eprintln!("{line}");
            return;
        }
        let total: f64 = self.weights.iter().sum();
        let done: f64 = self.weights.iter().take(self.step).sum();
        let elapsed = self.start.elapsed().as_secs_f64();
        let left = if done > 0.0 {
            format!("~{} left", fmt_secs(elapsed / done * (total - done)))
        } else {
            "estimating".into()
        };
        let filled = ((done / total.max(1.0)) * 20.0).round() as usize;
        eprintln!(
            "[{:>2}/{} {}{} {} elapsed, {left}] {line}",
            self.step + 1,
            self.weights.len(),
            "█".repeat(filled.min(20)),
            "░".repeat(20 - filled.min(20)),
            fmt_secs(elapsed),
        );
        self.step += 1;
    }
}

/// `75 s`, `4m05s`.
fn fmt_secs(s: f64) -> String {
    if s < 90.0 {
        format!("{s:.0} s")
    } else {
        let m = (s / 60.0).floor();
        format!("{m:.0}m{:02.0}s", s - m * 60.0)
    }
}
