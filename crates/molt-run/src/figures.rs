//! `molt-run figures`: PNG figures, the results page and the top README's generated blocks
//! (the headline table, the included examples), generated from the JSON under `results/` and
//! the files the README includes.

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
    /// The top README: its block between `<!-- results: headline -->` and
    /// `<!-- end results -->` is replaced by the headline table generated from --results, and
    /// every `<!-- include: PATH -->` … `<!-- end include -->` block by the file at PATH
    /// (relative to the README's directory, the repository root) as a code block. Left alone
    /// when the file is absent.
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
    match std::fs::read_to_string(&a.readme) {
        Ok(text) => {
            let root = match a.readme.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            let r = page::readme::refresh(&text, &root, &a.results)
                .map_err(|e| anyhow::anyhow!("{}: {e}", a.readme.display()))?;
            match &r.headline {
                Some(h) => {
                    for why in &h.left_out {
                        eprintln!("{}: headline row left out: {why}", a.readme.display());
                    }
                }
                None => eprintln!(
                    "{}: no {:?} marker, headline table not written",
                    a.readme.display(),
                    page::readme::HEADLINE_BEGIN
                ),
            }
            for p in &r.includes {
                eprintln!("{}: included {p}", a.readme.display());
            }
            if r.text == text {
                eprintln!("{}: generated blocks already current", a.readme.display());
            } else {
                std::fs::write(&a.readme, &r.text)?;
                eprintln!("updated the generated blocks of {}", a.readme.display());
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(anyhow::anyhow!("{}: {e}", a.readme.display())),
    }
    Ok(())
}
