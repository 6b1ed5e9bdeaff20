//! `molt-run figures`: PNG figures and the results page, generated from the JSON under
//! `results/`.

use anyhow::Result;
use molt_bench::{figures, page};
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
    /// The top README: its block between `<!-- molt-run figures: begin -->` and
    /// `<!-- molt-run figures: end -->` is replaced by the generated figures (left alone when
    /// the file or the markers are absent).
    #[arg(long, default_value = "README.md")]
    pub readme: PathBuf,
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
    let snippet = std::fs::read_to_string(a.results.join("figures.md"))?;
    match std::fs::read_to_string(&a.readme) {
        Ok(text) => match page::splice_readme(&text, &snippet)
            .map_err(|e| anyhow::anyhow!("{}: {e}", a.readme.display()))?
        {
            Some(new) if new != text => {
                std::fs::write(&a.readme, new)?;
                eprintln!("updated the figure block of {}", a.readme.display());
            }
            Some(_) => eprintln!("{}: figure block already current", a.readme.display()),
            None => eprintln!(
                "{}: no {:?} marker, figure block not written",
                a.readme.display(),
                page::README_BEGIN
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(anyhow::anyhow!("{}: {e}", a.readme.display())),
    }
    Ok(())
}
