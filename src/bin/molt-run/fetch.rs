//! `molt-run fetch`.

use crate::common::GlobalArgs;
use anyhow::{Context as _, Result};
use molt::ladder::{FetchOptions, Manifest, fetch};

/// Fetch options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Keep the downloaded wheels after their model verified (they double the disk use).
    #[arg(long)]
    pub keep_downloads: bool,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    let loc = g.locate(true)?;
    let manifest = Manifest::load(&loc.manifest)?;
    eprintln!(
        "fetching ladder {} into {}",
        manifest.name,
        loc.models_dir.display()
    );
    let opts = FetchOptions {
        keep_downloads: a.keep_downloads,
        quiet: a.quiet,
        threads: g.context_config()?.n_threads,
    };
    let done = fetch::fetch(&manifest, &loc.models_dir, &opts)
        .with_context(|| format!("fetching {}", manifest.name))?;
    for r in &done {
        println!(
            "{:8} {:10} {:>14} B  sha256 {}  {:.1}s  {}",
            r.name,
            r.action,
            r.size,
            r.sha256,
            r.seconds,
            r.path.display()
        );
    }
    Ok(())
}
