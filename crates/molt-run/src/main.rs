//! `molt-run`: the command-line face of Molt. Each subcommand lives in its own file; this file
//! holds the two clap layers (global options + subcommand) and the error/exit-code policy.
//!
//! Raw flags are turned into validated settings before any model loads, so a bad flag fails in
//! milliseconds rather than after a 2-second mmap.

mod bench;
mod chat;
mod common;
mod conditions;
mod curve;
mod fetch;
mod figures;
mod generate;
mod hog;
mod inspect;
mod ladder;
mod serve;
mod train;

use clap::{Parser, Subcommand};

/// Molt runs an LLM on a ladder of model sizes and, when memory is taken away mid-answer,
/// moves the answer onto a smaller rung between two tokens, carrying the KV cache across.
///
/// Start with `molt-run fetch` (downloads and builds the default ladder, ~1.6 GB), then
/// `molt-run generate --prompt "..."` or `molt-run chat`.
#[derive(Parser, Debug)]
#[command(name = "molt-run", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    global: common::GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Download, assemble, verify and build the ladder's model files.
    Fetch(fetch::Args),
    /// Show a GGUF file's architecture, tokenizer and size (reads metadata only).
    Inspect(inspect::Args),
    /// Answer one prompt, or every line of a prompt file (JSONL results out).
    Generate(generate::Args),
    /// Chat in the terminal under the real (or a replayed) memory budget.
    Chat(chat::Args),
    /// Run the benchmark programs (JSON results under results/).
    Bench(Box<bench::Args>),
    /// Fit the KV projectors of the ladder on the project's corpus.
    TrainProjectors(train::Args),
    /// Measure one route's map residuals against training-set size (a learning curve).
    MapCurve(curve::Args),
    /// Make a ladder of your own GGUF files (`ladder init`), or list the ladders found.
    Ladder(ladder::Args),
    /// The memory hog child of `--real-hog` runs (allocates and touches memory on command).
    #[command(hide = true)]
    Hog(hog::Args),
    /// Serve OpenAI-compatible chat completions; every streamed token names its rung.
    Serve(serve::Args),
    /// Draw the figures and write the results page from the benchmark's JSON.
    Figures(figures::Args),
}

fn main() {
    // Before anything that may run code compiled for this build's CPU (README, "Portable build").
    if let Err(e) = molt::engine::system::check_cpu() {
        eprintln!("molt-run: error: {e}");
        std::process::exit(2);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Fetch(a) => fetch::run(&cli.global, &a),
        Command::Inspect(a) => inspect::run(&cli.global, &a),
        Command::Generate(a) => generate::run(&cli.global, &a),
        Command::Chat(a) => chat::run(&cli.global, &a),
        Command::Bench(a) => bench::run(&cli.global, &a),
        Command::TrainProjectors(a) => train::run(&cli.global, &a),
        Command::MapCurve(a) => curve::run(&cli.global, &a),
        Command::Ladder(a) => ladder::run(&cli.global, &a),
        Command::Hog(a) => hog::run(&a),
        Command::Serve(a) => serve::run(&cli.global, &a),
        Command::Figures(a) => figures::run(&a),
    };
    if let Err(e) = result {
        if is_broken_pipe(&e) {
            std::process::exit(0);
        }
        eprintln!("molt-run: error: {e}");
        for cause in e.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        std::process::exit(2);
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
