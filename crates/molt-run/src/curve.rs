//! `molt-run map-curve`: the learning curve of one route's maps — held-out K and V residuals
//! against training-set size, with the held-out windows fixed — written to
//! `results/projector_curve.json`. It fits but writes no projector, so the shipped maps stay.
//!
//! More text than the project's corpus comes from `--extra-corpus DIR` (every `*.txt` in it);
//! `scripts/toolchain-corpus.sh DIR` fills such a directory from what the machine already has
//! (the Python standard library, the Cargo registry's crate sources, man pages).

use crate::common::GlobalArgs;
use anyhow::{Context as _, Result, bail};
use molt::engine::Token;
use molt::train::curve::{CurveCorpus, CurveOptions, fit_curve};
use molt::train::{corpus_windows, read_chats, read_corpus};
use std::path::{Path, PathBuf};

/// Options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The route, `SRC:DST` by rung name.
    #[arg(long, default_value = "tier0:tier2", value_name = "SRC:DST")]
    pub route: String,
    /// Base corpus: its held-out windows are the curve's fixed held-out set, its other windows
    /// come first in the training order.
    #[arg(long, default_value = "projectors/corpus")]
    pub corpus: PathBuf,
    /// Extra training text (every `*.txt` in it), used after the base corpus's windows.
    #[arg(long, value_name = "DIR")]
    pub extra_corpus: Option<PathBuf>,
    /// Training-set sizes to measure, in tokens (the base corpus's own training size is always
    /// measured too).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "N,...",
        default_value = "3600,7300,14600,30000,60000"
    )]
    pub train_tokens: Vec<usize>,
    /// Tokens per window (as `train-projectors`).
    #[arg(long, default_value_t = 256)]
    pub window: usize,
    /// Every n-th base window is held out (as `train-projectors`).
    #[arg(long, default_value_t = 5)]
    pub held_out_every: usize,
    /// First positions of each window left out (as `train-projectors --skip-head`).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub skip_head: usize,
    /// Widen the maps' heads to the destination's spread (as the shipped maps).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub restore_spread: bool,
    /// Seed of the training windows' order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the curve is written (rewritten after every point).
    #[arg(long, default_value = "results/projector_curve.json")]
    pub report: PathBuf,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    let config = crate::train::window_config(g, a.window, a.held_out_every)?;
    let Some((src_name, dst_name)) = a.route.split_once(':') else {
        bail!("--route must be SRC:DST, got {:?}", a.route);
    };
    if src_name == dst_name {
        bail!("--route needs two different rungs");
    }
    let ladder = g.open_ladder()?;
    let find = |name: &str| {
        ladder
            .rung(name)
            .with_context(|| format!("no rung {name:?} in ladder {}", ladder.name()))
    };
    let (src, dst) = (find(src_name)?, find(dst_name)?);
    // Windows as `train-projectors` cuts them: tokenized by the largest rung.
    let model = molt::session::LiveRung::load(&ladder.rungs[0], config)?;
    let base = corpus_windows(
        model.model(),
        &read_corpus(&a.corpus)?,
        &read_chats(&a.corpus)?,
        a.window,
    )?;
    let extra = match &a.extra_corpus {
        Some(dir) => corpus_windows(model.model(), &read_corpus(dir)?, &[], a.window)?,
        None => Vec::new(),
    };
    drop(model);
    let tokens = |w: &[Vec<Token>]| w.iter().map(Vec::len).sum::<usize>();
    eprintln!(
        "base corpus: {} tokens in {} windows; extra: {} tokens in {} windows",
        tokens(&base),
        base.len(),
        tokens(&extra),
        extra.len()
    );
    let corpus = CurveCorpus {
        base: base.iter().map(Vec::as_slice).collect(),
        extra: extra.iter().map(Vec::as_slice).collect(),
    };
    let opts = CurveOptions {
        held_out_every: a.held_out_every,
        skip_head: a.skip_head,
        restore_spread: a.restore_spread,
        train_tokens: a.train_tokens.clone(),
        seed: a.seed,
    };
    if let Some(dir) = a.report.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut write_error = None;
    let report = fit_curve(
        src,
        dst,
        config,
        &corpus,
        &opts,
        &mut |s| eprintln!("{s}"),
        &mut |r| {
            if let Err(e) = write(&a.report, ladder.name(), r) {
                write_error.get_or_insert(e);
            }
        },
    )?;
    if let Some(e) = write_error {
        return Err(e);
    }
    println!(
        "{:>8} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "train", "extra", "K held", "K train", "V held", "V train"
    );
    for p in &report.points {
        println!(
            "{:>8} {:>8} {:>9.4} {:>9.4} {:>9.4} {:>9.4}",
            p.train_tokens, p.extra_tokens, p.k_held_out, p.k_train, p.v_held_out, p.v_train
        );
    }
    for s in &report.skipped_sizes {
        eprintln!("skipped {s} tokens: the corpora hold fewer training tokens");
    }
    eprintln!("wrote {}", a.report.display());
    Ok(())
}

/// Writes the curve so far, with the run's identity.
fn write(path: &Path, ladder: &str, r: &molt::train::curve::CurveReport) -> Result<()> {
    let doc =
        serde_json::json!({ "run": molt_bench::RunInfo::now(), "ladder": ladder, "curve": r });
    molt::durable::write(path, serde_json::to_string_pretty(&doc)?.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}
