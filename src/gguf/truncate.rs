//! A model's last `k` transformer blocks as a model of their own: the file llama.cpp runs for
//! selective top-k recompute (see `crate::engine::PartialForward`).
//!
//! [`last_blocks`] copies a GGUF keeping only blocks `L − k … L − 1`, renamed `blk.0 … blk.k−1`,
//! with `<arch>.block_count = k` and every other metadata pair and non-block tensor (token
//! embedding, output norm, output head) as they were. Fed hidden states as input embeddings
//! at the original positions, llama.cpp then computes exactly those blocks with the same
//! kernels, weights and RoPE as the full model would; `<arch>.block_count` is the only
//! hyper-parameter tied to the depth in the architectures Molt ships (qwen2, llama), and a
//! per-layer metadata array (length L) is cut to its last k entries so that architectures
//! which have them stay consistent.
//!
//! The derived file records what it was cut from ([`DERIVED_FROM_KEY`], [`DERIVED_K_KEY`],
//! [`DERIVED_FORMAT_KEY`]) so a cached copy can be recognised as current or stale.

use std::path::Path;

use super::{ArrayValue, GgufError, GgufFile, GgufWriter, Value, WriteError};

/// sha256 of the full model the file was cut from.
pub const DERIVED_FROM_KEY: &str = "molt.derived.from_sha256";
/// The `k` it keeps.
pub const DERIVED_K_KEY: &str = "molt.derived.last_blocks";
/// Version of this derivation; bump when the cut changes.
pub const DERIVED_FORMAT_KEY: &str = "molt.derived.format";
/// The current derivation version.
pub const DERIVED_FORMAT: u32 = 1;

/// Why a model could not be cut.
#[derive(Debug, thiserror::Error)]
pub enum TruncateError {
    /// The source could not be read.
    #[error(transparent)]
    Read(#[from] GgufError),
    /// The derived file could not be written.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// `k` is not in `1 ..= n_layer − 1`.
    #[error("{file}: cannot keep the last {k} of {n_layer} blocks (need 1 ≤ k < n_layer)")]
    BadK {
        /// The source file.
        file: String,
        /// Blocks asked for.
        k: u32,
        /// Blocks the model has.
        n_layer: u32,
    },
}

/// The block index of a tensor named `blk.<i>.<rest>`, with `<rest>`.
fn block_of(name: &str) -> Option<(u32, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (i, tail) = rest.split_once('.')?;
    Some((i.parse().ok()?, tail))
}

/// Keeps the last `k` entries of a per-layer array (one entry per block), else `None`.
fn cut_per_layer(a: &ArrayValue, n_layer: usize, k: usize) -> Option<ArrayValue> {
    fn tail<T: Clone>(v: &[T], n: usize, k: usize) -> Option<Vec<T>> {
        (v.len() == n).then(|| v[n - k..].to_vec())
    }
    Some(match a {
        ArrayValue::U32s(v) => ArrayValue::U32s(tail(v, n_layer, k)?),
        ArrayValue::I32s(v) => ArrayValue::I32s(tail(v, n_layer, k)?),
        ArrayValue::F32s(v) => ArrayValue::F32s(tail(v, n_layer, k)?),
        ArrayValue::Bools(v) => ArrayValue::Bools(tail(v, n_layer, k)?),
        _ => return None,
    })
}

/// Writes to `out` the model of `src`'s last `k` blocks (see the module docs); `src_sha256`
/// is recorded in it. Returns the number of bytes written.
///
/// # Errors
/// [`TruncateError::BadK`] for `k` outside `1 ..= n_layer − 1`, a read error for a source
/// without `general.architecture` / `<arch>.block_count`, a write error.
pub fn last_blocks(
    src: &GgufFile,
    src_sha256: &str,
    k: u32,
    out: &Path,
) -> Result<u64, TruncateError> {
    let arch = src.get_str("general.architecture")?.to_string();
    let count_key = format!("{arch}.block_count");
    let n_layer = src.get_u32(&count_key)?;
    if k == 0 || k >= n_layer {
        return Err(TruncateError::BadK {
            file: src.path().display().to_string(),
            k,
            n_layer,
        });
    }
    let first = n_layer - k;
    let mut w = GgufWriter::new();
    let per_layer_prefix = format!("{arch}.");
    for (key, value) in src.metadata() {
        if key.starts_with("molt.derived.") {
            continue;
        }
        let value = if *key == count_key {
            Value::U32(k)
        } else if let (true, Value::Array(a)) = (key.starts_with(&per_layer_prefix), value) {
            cut_per_layer(a, n_layer as usize, k as usize)
                .map_or_else(|| value.clone(), Value::Array)
        } else {
            value.clone()
        };
        w.add(key.clone(), value)?;
    }
    w.add(DERIVED_FROM_KEY, src_sha256)?;
    w.add(DERIVED_K_KEY, k)?;
    w.add(DERIVED_FORMAT_KEY, DERIVED_FORMAT)?;
    for t in src.tensors() {
        let name = match block_of(&t.name) {
            Some((i, _)) if i < first => continue,
            Some((i, tail)) => format!("blk.{}.{tail}", i - first),
            None => t.name.clone(),
        };
        w.add_tensor(name, &t.dims, t.ggml_type, src.tensor_data(t).to_vec())?;
    }
    Ok(w.write(out)?)
}

/// Whether `path` is a current cut of the model with sha256 `src_sha256` keeping `k` blocks.
#[must_use]
pub fn is_current(path: &Path, src_sha256: &str, k: u32) -> bool {
    let Ok(f) = GgufFile::open(path) else {
        return false;
    };
    f.get_str(DERIVED_FROM_KEY).ok() == Some(src_sha256)
        && f.get_u32(DERIVED_K_KEY).ok() == Some(k)
        && f.get_u32(DERIVED_FORMAT_KEY).ok() == Some(DERIVED_FORMAT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_names_parse() {
        assert_eq!(
            block_of("blk.12.attn_q.weight"),
            Some((12, "attn_q.weight"))
        );
        assert_eq!(block_of("token_embd.weight"), None);
        assert_eq!(block_of("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn per_layer_arrays_keep_their_tail() {
        let a = ArrayValue::U32s(vec![1, 2, 3, 4]);
        assert_eq!(cut_per_layer(&a, 4, 2), Some(ArrayValue::U32s(vec![3, 4])));
        // An array of another length is not per layer: left alone.
        assert_eq!(cut_per_layer(&a, 5, 2), None);
    }
}
