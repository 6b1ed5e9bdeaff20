//! Options every subcommand shares, and their validation into typed settings.

use anyhow::{Context as _, Result, bail};
use molt::engine::{CacheType, ContextConfig};
use molt::ladder::{Ladder, search};
use std::path::PathBuf;

/// Global options.
#[derive(clap::Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Ladder: a name searched in $MOLT_HOME/models, ./models and ~/.local/share/molt/models,
    /// or a path to a ladder manifest (.toml).
    #[arg(long, global = true, default_value = search::DEFAULT_LADDER, env = "MOLT_LADDER")]
    pub ladder: String,
    /// Directory holding the model files (default: beside the manifest, or $MOLT_HOME/models).
    #[arg(long, global = true)]
    pub models_dir: Option<PathBuf>,
    /// Context window in tokens, the same for every rung.
    #[arg(long, global = true, default_value_t = 2048)]
    pub n_ctx: u32,
    /// CPU threads (default: all cores).
    #[arg(long, global = true)]
    pub threads: Option<u32>,
    /// KV cache element type (only unquantized caches can be transplanted).
    #[arg(long, global = true, value_enum, default_value_t = CacheArg::F16)]
    pub cache_type: CacheArg,
}

/// `--cache-type` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheArg {
    /// 16-bit floats.
    F16,
    /// 32-bit floats.
    F32,
}

impl GlobalArgs {
    /// The context configuration every rung shares.
    pub fn context_config(&self) -> Result<ContextConfig> {
        if !(64..=131_072).contains(&self.n_ctx) {
            bail!("--n-ctx {} is outside 64..=131072", self.n_ctx);
        }
        let mut c = ContextConfig {
            n_ctx: self.n_ctx,
            ..ContextConfig::default()
        };
        if let Some(t) = self.threads {
            if t == 0 {
                bail!("--threads must be at least 1");
            }
            c.n_threads = t;
        }
        c.cache_type = match self.cache_type {
            CacheArg::F16 => CacheType::F16,
            CacheArg::F32 => CacheType::F32,
        };
        Ok(c)
    }

    /// Where the ladder is.
    pub fn locate(&self, create_default: bool) -> Result<search::Located> {
        search::locate(&self.ladder, self.models_dir.as_deref(), create_default)
            .map_err(anyhow::Error::msg)
    }

    /// Opens the ladder (files must be present).
    pub fn open_ladder(&self) -> Result<Ladder> {
        let loc = self.locate(false)?;
        Ladder::open(&loc.manifest, &loc.models_dir)
            .with_context(|| format!("opening ladder {}", loc.manifest.display()))
    }
}
