//! `molt-run figures`: PNG figures and the results page, generated from the JSON under
//! `results/`.

use anyhow::Result;
use molt::bench::{figures, page};
use std::path::PathBuf;

/// Figure options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Directory holding the benchmark JSON; the page is written there too.
    #[arg(long, default_value = "results")]
    pub results: PathBuf,
    /// Figure directory, relative to --results.
    #[arg(long, default_value = "figures")]
    pub figures_dir: String,
}

pub fn run(a: &Args) -> Result<()> {
    let out = a.results.join(&a.figures_dir);
    let set = figures::draw_all(&a.results, &out)?;
    for f in &set.written {
        eprintln!("drew {}", f.path.display());
    }
    for (name, why) in &set.skipped {
        eprintln!("skipped {name}: {why}");
    }
    let rel_root = format!(
        "{}/{}",
        a.results.display().to_string().trim_end_matches('/'),
        a.figures_dir
    );
    for p in page::write(
        &page::PageOptions {
            results: a.results.clone(),
            figures_rel_results: a.figures_dir.clone(),
            figures_rel_root: rel_root,
        },
        &set,
    )? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
