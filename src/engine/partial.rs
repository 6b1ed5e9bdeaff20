//! The partial forward of selective top-k recompute: a rung's last `k` blocks run natively over
//! hidden states, producing those blocks' K/V for every cached position.
//!
//! Why through llama.cpp rather than a hand-built ggml graph: a model file holding only the
//! last `k` blocks ([`crate::gguf::truncate::last_blocks`]) makes llama.cpp build the very
//! graph it builds for the full model — same kernels, same quantized weights, same RoPE, same
//! cache layout — so the recomputed K/V cannot drift from what the destination would have
//! cached by a re-implementation's mistake, and the result comes back through the state-seq
//! export the KV mirror already parses. The price is a one-time derived file
//! (`<model dir>/.derived/<sha256[..16]>-last<k>.gguf`, the blocks plus the embedding and output
//! tensors llama.cpp requires; a few hundred MB for the 0.5B rung) and the embedding / output
//! head being mapped, not computed: only the last position asks for logits.
//!
//! Main type: [`PartialForward`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Context, ContextConfig, EngineError, Model, ModelOptions};
use crate::gguf::GgufFile;
use crate::gguf::truncate::{is_current, last_blocks};

/// A rung's last `k` blocks, loaded as a model of their own, with a context to run them.
pub struct PartialForward {
    ctx: Context,
    k: usize,
    n_layer: usize,
}

impl std::fmt::Debug for PartialForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartialForward")
            .field("model", &self.ctx.model().name())
            .field("k", &self.k)
            .field("n_layer", &self.n_layer)
            .finish()
    }
}

/// Where the last-`k` cut of the model with sha256 `sha256` at `full` is cached.
#[must_use]
pub fn derived_path(full: &Path, sha256: &str, k: usize) -> PathBuf {
    let dir = full.parent().unwrap_or_else(|| Path::new("."));
    let prefix = sha256.get(..16).unwrap_or(sha256);
    dir.join(".derived").join(format!("{prefix}-last{k}.gguf"))
}

/// The cached last-`k` cut of `full` (sha256 `sha256`), written first if missing or stale (cut
/// from another file, with another `k`, or by an older derivation). Rewriting a stale copy
/// rather than refusing it is deliberate: the cut is a pure function of the full model, so a
/// stale file is only ever a cache to refresh.
///
/// # Errors
/// [`EngineError::LoadFailed`] naming `full` when it cannot be read or cut, or the cut cannot
/// be written.
pub fn ensure_derived(full: &Path, sha256: &str, k: usize) -> Result<PathBuf, EngineError> {
    let path = derived_path(full, sha256, k);
    let k32 = u32::try_from(k).map_err(|_| EngineError::OutOfRange {
        what: "k",
        value: k as u64,
    })?;
    if is_current(&path, sha256, k32) {
        return Ok(path);
    }
    let fail = |detail: String| EngineError::LoadFailed {
        path: full.display().to_string(),
        detail: format!(
            "cutting the last {k} blocks into {}: {detail}",
            path.display()
        ),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
    }
    let src = GgufFile::open(full).map_err(|e| fail(e.to_string()))?;
    last_blocks(&src, sha256, k32, &path).map_err(|e| fail(e.to_string()))?;
    Ok(path)
}

impl PartialForward {
    /// Loads the last `k` blocks of the rung at `full` (sha256 `sha256`, `n_layer` blocks),
    /// cutting them first if needed, with a context of `config` (its window must hold every
    /// position that will be recomputed; the cache type must be the destination's).
    ///
    /// # Errors
    /// As [`ensure_derived`], [`Model::load`] and [`Context::new`].
    pub fn open(
        full: &Path,
        sha256: &str,
        n_layer: usize,
        k: usize,
        config: ContextConfig,
    ) -> Result<Self, EngineError> {
        let path = ensure_derived(full, sha256, k)?;
        let name = format!(
            "{}-last{k}",
            full.file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned())
        );
        let model: Arc<Model> = Model::load(&path, &name, ModelOptions::default())?;
        let config = ContextConfig {
            attention_tap: false,
            hidden_tap: false,
            ..config
        };
        let ctx = Context::new(model, config)?;
        Ok(Self { ctx, k, n_layer })
    }

    /// Blocks it computes.
    #[must_use]
    pub fn k(&self) -> usize {
        self.k
    }

    /// The first of the full model's blocks it stands for (`n_layer − k`): its input is the
    /// hidden state entering that block, i.e. the output of block `n_layer − k − 1`.
    #[must_use]
    pub fn first_layer(&self) -> usize {
        self.n_layer - self.k
    }

    /// Runs the blocks over `hidden` (one row per position, `n_embd` wide) at `positions`
    /// (consecutive from 0, as the cache holds them) and returns the exported state of the
    /// sequence: `k` layers of K/V in llama.cpp's blob layout, layer `i` standing for the full
    /// model's layer `first_layer() + i`.
    ///
    /// # Errors
    /// As [`Context::decode_embeddings`] and [`Context::export_state`].
    pub fn run(
        &mut self,
        hidden: ndarray::ArrayView2<'_, f32>,
        positions: &[i32],
    ) -> Result<Vec<u8>, EngineError> {
        self.ctx.clear();
        let r = self
            .ctx
            .decode_embeddings(hidden, positions)
            .and_then(|()| self.ctx.export_state());
        self.ctx.clear();
        r
    }
}
