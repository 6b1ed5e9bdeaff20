//! `molt-run ladder`: make a ladder of one's own GGUF files in one command (`init`: check,
//! order, write the manifest, fit the projectors and anchors), and see the ladders found
//! (`list`).

use crate::common::GlobalArgs;
use crate::train;
use anyhow::{Context as _, Result};
use clap::Parser as _;
use molt::ladder::init;
use molt::ladder::search;
use std::path::PathBuf;

/// Options.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: LadderCommand,
}

/// `ladder` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum LadderCommand {
    /// Make a ladder of these GGUF files: check that they share a tokenizer, order them
    /// largest first, write the manifest and fit the projectors and anchors.
    Init(InitArgs),
    /// List the ladders found (the places `--ladder NAME` searches) and their rungs.
    List,
}

/// `ladder init` options.
#[derive(clap::Args, Debug)]
pub struct InitArgs {
    /// The ladder's name (its manifest becomes `NAME.toml`; use it as `--ladder NAME`).
    pub name: String,
    /// A rung's GGUF file; give two or more, in any order (one is enough with
    /// `--requantize`).
    #[arg(long = "rung", value_name = "FILE.gguf", required = true)]
    pub rungs: Vec<PathBuf>,
    /// Also make a precision rung of the largest file at this llama.cpp type (e.g. Q3_K_M,
    /// Q2_K) with llama.cpp's quantizer, written beside the manifest; repeat for more.
    /// Types that need an importance matrix (IQ2_*, IQ1_*, IQ3_XXS, Q2_K_S) are refused.
    #[arg(long, value_name = "TYPE")]
    pub requantize: Vec<molt::engine::QuantType>,
    /// Where the manifest goes (files elsewhere are linked there); default: the per-user
    /// models directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Where the projectors go (`DIR/NAME/`); default: `projectors` beside the models
    /// directory, where sessions look for them.
    #[arg(long)]
    pub projectors: Option<PathBuf>,
    /// The corpus the projectors are fitted on.
    #[arg(long, default_value = "projectors/corpus")]
    pub corpus: PathBuf,
    /// Replace a manifest of the same name.
    #[arg(long)]
    pub force: bool,
    /// Write the manifest only, no projectors: a switch on a precision route then carries the
    /// cache as it is, and one on a size route reads the context's chosen positions natively.
    #[arg(long)]
    pub no_fit: bool,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    match &a.command {
        LadderCommand::Init(i) => run_init(g, i),
        LadderCommand::List => {
            list();
            Ok(())
        }
    }
}

fn run_init(g: &GlobalArgs, a: &InitArgs) -> Result<()> {
    let started = std::time::Instant::now();
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => search::user_models_dir()
            .context("no per-user data directory (set HOME or XDG_DATA_HOME, or give --dir)")?,
    };
    let threads = g.context_config()?.n_threads;
    let (manifest, plan) = init::make(
        &init::MakeOptions {
            name: &a.name,
            files: &a.rungs,
            requantize: &a.requantize,
            dir: &dir,
            force: a.force,
            threads,
        },
        &mut |s| eprintln!("{s}"),
    )?;
    println!("ladder {} written to {}:", a.name, manifest.display());
    for (spec, r) in plan.manifest.rungs.iter().zip(&plan.rungs) {
        println!(
            "  {:<6} {:>8.1} MiB  {}",
            spec.name,
            r.bytes as f64 / f64::from(1 << 20),
            spec.model
        );
    }
    if a.no_fit {
        println!(
            "no projectors fitted (--no-fit): precision switches carry the cache as it is, size \
             switches read natively; fit later with \
             `molt-run --ladder {} train-projectors`",
            manifest.display()
        );
        return Ok(());
    }
    let projectors = a.projectors.clone().unwrap_or_else(|| {
        dir.parent()
            .map_or_else(|| PathBuf::from("projectors"), |p| p.join("projectors"))
    });
    let report = projectors.join(&a.name).join("fit_report.json");
    let g = GlobalArgs {
        ladder: manifest.display().to_string(),
        models_dir: Some(dir.clone()),
        ..g.clone()
    };
    // The fit `train-projectors` runs, with its own defaults; only where it reads and writes
    // differs (a user's ladder must not overwrite the project's committed report).
    let fit = TrainOnly::try_parse_from([
        "train-projectors".as_ref(),
        "--out".as_ref(),
        projectors.as_os_str(),
        "--report".as_ref(),
        report.as_os_str(),
        "--corpus".as_ref(),
        a.corpus.as_os_str(),
    ])
    .context("building the fit's options")?;
    train::run(&g, &fit.args)
        .with_context(|| format!("fitting the projectors of {}", manifest.display()))?;
    println!(
        "ladder {} ready in {:.0} s: use it with --ladder {}",
        a.name,
        started.elapsed().as_secs_f64(),
        a.name
    );
    Ok(())
}

/// `train-projectors`' options parsed from arguments, defaults included.
#[derive(clap::Parser, Debug)]
struct TrainOnly {
    #[command(flatten)]
    args: train::Args,
}

fn list() {
    let dirs = search::search_dirs();
    let found = init::list(&dirs);
    if found.is_empty() {
        println!(
            "no ladders in {}",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return;
    }
    for f in found {
        match f.manifest {
            Ok(m) => {
                let dir = f.path.parent().unwrap_or(std::path::Path::new("."));
                let rungs: Vec<String> = m
                    .rungs
                    .iter()
                    .map(|r| {
                        let there = dir.join(&r.file).exists();
                        format!("{}{}", r.name, if there { "" } else { " (missing)" })
                    })
                    .collect();
                println!(
                    "{:<24} {}  [{}]",
                    m.name,
                    f.path.display(),
                    rungs.join(", ")
                );
            }
            Err(e) => println!("{:<24} {}  unreadable: {e}", "?", f.path.display()),
        }
    }
}
