//! `molt-run fetch`.

use crate::common::GlobalArgs;
use anyhow::{Context as _, Result};
use indicatif::{ProgressBar, ProgressStyle};
use molt::ladder::{FetchOptions, FetchProgress, Manifest, ProgressUnit, fetch};
use std::sync::{Arc, Mutex};

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
        progress: (!a.quiet).then(|| Arc::new(Bars::default()) as Arc<dyn FetchProgress>),
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

/// The fetch's progress as terminal bars, one step at a time.
#[derive(Default)]
struct Bars(Mutex<Option<ProgressBar>>);

impl FetchProgress for Bars {
    fn start(&self, what: &str, total: u64, unit: ProgressUnit) {
        let template = match unit {
            ProgressUnit::Parts => "{msg:24} [{bar:30}] part {pos}/{len}",
            ProgressUnit::Bytes if total == 0 => "{msg:24} {spinner} {elapsed}",
            ProgressUnit::Bytes => {
                "{msg:24} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}"
            }
        };
        let pb = ProgressBar::new(total);
        pb.set_style(
            ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_message(what.to_string());
        if total == 0 {
            pb.enable_steady_tick(std::time::Duration::from_millis(200));
        }
        if let Ok(mut g) = self.0.lock() {
            *g = Some(pb);
        }
    }

    fn advance(&self, done: u64) {
        if let Ok(g) = self.0.lock()
            && let Some(pb) = g.as_ref()
        {
            pb.set_position(done);
        }
    }

    fn finish(&self) {
        if let Ok(mut g) = self.0.lock()
            && let Some(pb) = g.take()
        {
            pb.finish_and_clear();
        }
    }
}
