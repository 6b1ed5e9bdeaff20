//! Tiny random-weight models with a real architecture that llama.cpp executes.
//!
//! [`TinySpec`] describes a qwen2-architecture model (the architecture of the shipped
//! Qwen2.5 ladder) and [`write_model`] writes it as a GGUF file with the metadata keys and
//! tensor names/shapes `llama_model_qwen2::load_arch_tensors` requires, random weights from
//! a seeded `ChaCha` RNG, and a [`TinyTokenizer`]. [`standard_ladder`] writes a two-rung ladder
//! shaped like the real tier0/tier2 pair (different layer counts and head dims, one
//! tokenizer) plus a rung with another tokenizer, each file a few MB, so every engine,
//! KV and transplant path can be tested against real llama.cpp execution in seconds.
//!
//! Weight scales: matrices are N(0, `1/fan_in`) so each projection preserves the RMS of its
//! (RMS-normalised) input; output projections of residual branches are further divided by
//! `sqrt(2·n_layer)` (GPT-2 style) so the residual stream stays O(1) with depth; the
//! embedding is N(0, 1); the LM head is N(0, `2.5²/n_embd`), giving logits of standard
//! deviation ≈ 2.5 — peaked enough that greedy decoding is stable under f16 rounding,
//! flat enough that next-token distributions are not one-hot. Norm weights are 1.
//! Each tensor has its own RNG stream seeded by sha256(seed, tensor name), so the weights
//! of one tensor do not depend on which others exist.

mod tokenizer;

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};

use crate::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, WriteError};

pub use tokenizer::{
    CHAT_TEMPLATE, CORPUS, DEFAULT_MERGED_TOKENS, ENDOFTEXT, IM_END, IM_START, TinyTokenizer,
    bytes_to_unicode, pre_tokenize,
};

/// Bumped whenever the generator's output changes, so [`standard_ladder`] rewrites files.
pub const GENERATOR_VERSION: u32 = 1;

/// Metadata key holding the fingerprint of spec + tokenizer + generator version.
pub const FINGERPRINT_KEY: &str = "molt.tiny.fingerprint";

/// RMS-norm epsilon written to `qwen2.attention.layer_norm_rms_epsilon` (Qwen2.5's value).
pub const RMS_EPS: f32 = 1e-6;

/// Element type of the weight matrices (norms and biases are always F32, as in llama.cpp's
/// own "mostly F16" files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit floats (`general.file_type` 0).
    F32,
    /// 16-bit floats (`general.file_type` 1).
    F16,
}

impl DType {
    fn ggml(self) -> GgmlType {
        match self {
            DType::F32 => GgmlType::F32,
            DType::F16 => GgmlType::F16,
        }
    }

    fn file_type(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
        }
    }
}

/// The architecture a tiny model is written as: the one of the shipped ladder, or the llama
/// family's, whose RoPE rotates other pairs of dimensions — so the transplant's RoPE
/// sandwich is tested on both conventions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TinyArch {
    /// `qwen2`: biased Q/K/V projections, NEOX RoPE (dimension `i` pairs with `i + d/2`).
    #[default]
    Qwen2,
    /// `llama`: no projection biases, normal RoPE (dimension `2i` pairs with `2i + 1`).
    Llama,
}

impl TinyArch {
    /// `general.architecture`, also the prefix of the model's metadata keys.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Llama => "llama",
        }
    }
}

/// The shape of a tiny model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TinySpec {
    /// The architecture.
    #[serde(default)]
    pub arch: TinyArch,
    /// `general.name`, also the file stem in [`standard_ladder`].
    pub name: String,
    /// Transformer blocks.
    pub n_layer: u32,
    /// Hidden size.
    pub n_embd: u32,
    /// Query heads; `head_dim = n_embd / n_head`.
    pub n_head: u32,
    /// KV heads; must divide `n_head`.
    pub n_head_kv: u32,
    /// Feed-forward hidden size.
    pub n_ff: u32,
    /// Training context length (`qwen2.context_length`).
    pub n_ctx: u32,
    /// RoPE base (`qwen2.rope.freq_base`).
    pub rope_base: f32,
    /// RNG seed for the weights.
    pub seed: u64,
    /// Element type of the weight matrices.
    pub dtype: DType,
}

impl TinySpec {
    /// `n_embd / n_head`.
    #[must_use]
    pub fn head_dim(&self) -> u32 {
        self.n_embd.checked_div(self.n_head).unwrap_or(0)
    }

    /// `n_head_kv * head_dim`: the width of K and V per token and layer.
    #[must_use]
    pub fn n_embd_kv(&self) -> u32 {
        self.n_head_kv * self.head_dim()
    }

    /// Checks the spec describes a model llama.cpp can build.
    ///
    /// # Errors
    /// [`TinyError::InvalidSpec`] for zero sizes, `n_embd` not a multiple of `n_head`, an
    /// odd head dimension (RoPE rotates pairs), or `n_head` not a multiple of `n_head_kv`.
    pub fn validate(&self) -> Result<(), TinyError> {
        let bad = |reason: String| {
            Err(TinyError::InvalidSpec {
                name: self.name.clone(),
                reason,
            })
        };
        if self.name.is_empty() {
            return bad("empty name".to_owned());
        }
        for (what, v) in [
            ("n_layer", self.n_layer),
            ("n_embd", self.n_embd),
            ("n_head", self.n_head),
            ("n_head_kv", self.n_head_kv),
            ("n_ff", self.n_ff),
            ("n_ctx", self.n_ctx),
        ] {
            if v == 0 {
                return bad(format!("{what} is 0"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!("head_dim {} is odd", self.head_dim()));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "n_head {} is not a multiple of n_head_kv {}",
                self.n_head, self.n_head_kv
            ));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 1.0) {
            return bad(format!(
                "rope_base {} must be finite and > 1",
                self.rope_base
            ));
        }
        Ok(())
    }

    /// Hex sha256 of this spec, the tokenizer and [`GENERATOR_VERSION`]: equal fingerprints
    /// mean byte-identical files.
    #[must_use]
    pub fn fingerprint(&self, tokenizer: &TinyTokenizer) -> String {
        let mut h = Sha256::new();
        h.update(GENERATOR_VERSION.to_le_bytes());
        h.update((self.name.len() as u64).to_le_bytes());
        h.update(self.name.as_bytes());
        for v in [
            self.n_layer,
            self.n_embd,
            self.n_head,
            self.n_head_kv,
            self.n_ff,
            self.n_ctx,
        ] {
            h.update(v.to_le_bytes());
        }
        h.update(self.rope_base.to_bits().to_le_bytes());
        h.update(self.seed.to_le_bytes());
        h.update(self.dtype.file_type().to_le_bytes());
        // Only another architecture than the first one changes the fingerprint, so the qwen2
        // models written before architectures existed stay current.
        if self.arch != TinyArch::Qwen2 {
            h.update(self.arch.name().as_bytes());
        }
        h.update(tokenizer.identity().digest().sha256.as_bytes());
        hex::encode(h.finalize())
    }
}

/// An error making a tiny model.
#[derive(Debug, thiserror::Error)]
pub enum TinyError {
    /// The spec cannot describe a working model.
    #[error("tiny model '{name}': {reason}")]
    InvalidSpec {
        /// The spec's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Writing the file failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// Reading a file back failed.
    #[error(transparent)]
    Read(#[from] GgufError),
    /// Creating the output directory failed.
    #[error("{}: {source}", dir.display())]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Building the ladder's requantized rung failed.
    #[error(transparent)]
    Fetch(#[from] crate::ladder::FetchError),
}

/// A per-tensor random stream: `ChaCha20` seeded by `sha256(seed, name)`.
fn tensor_rng(seed: u64, name: &str) -> ChaCha20Rng {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name.as_bytes());
    ChaCha20Rng::from_seed(h.finalize().into())
}

/// `n` samples of N(0, sigma²) (Box–Muller).
#[allow(clippy::cast_possible_truncation)] // f64 samples narrowed to f32 weights
fn normal(rng: &mut ChaCha20Rng, n: usize, sigma: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt() * sigma;
        let t = std::f64::consts::TAU * u2;
        out.push((r * t.cos()) as f32);
        out.push((r * t.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// Writes a qwen2-architecture GGUF for `spec` with `tokenizer` to `path` (atomically).
/// Returns the file size.
///
/// Tensors (GGUF dims innermost first): `token_embd.weight [n_embd, n_vocab]`,
/// `output_norm.weight [n_embd]`, `output.weight [n_embd, n_vocab]`, and per layer
/// `attn_norm [n_embd]`, `attn_q [n_embd, n_embd]` + bias, `attn_k`/`attn_v [n_embd,
/// n_kv]` + biases, `attn_output [n_embd, n_embd]`, `ffn_norm [n_embd]`, `ffn_gate`/`ffn_up
/// [n_embd, n_ff]`, `ffn_down [n_ff, n_embd]`.
///
/// # Errors
/// [`TinyError::InvalidSpec`] for a bad spec; [`TinyError::Write`] if writing fails.
pub fn write_model(
    spec: &TinySpec,
    tokenizer: &TinyTokenizer,
    path: impl AsRef<Path>,
) -> Result<u64, TinyError> {
    spec.validate()?;
    let mut w = GgufWriter::new();
    let arch = spec.arch.name();
    let key = |k: &str| format!("{arch}.{k}");
    w.add("general.architecture", arch)?;
    w.add("general.type", "model")?;
    w.add("general.name", spec.name.as_str())?;
    w.add(key("block_count"), spec.n_layer)?;
    w.add(key("context_length"), spec.n_ctx)?;
    w.add(key("embedding_length"), spec.n_embd)?;
    w.add(key("feed_forward_length"), spec.n_ff)?;
    w.add(key("attention.head_count"), spec.n_head)?;
    w.add(key("attention.head_count_kv"), spec.n_head_kv)?;
    w.add(key("rope.freq_base"), spec.rope_base)?;
    w.add(key("attention.layer_norm_rms_epsilon"), RMS_EPS)?;
    if spec.arch == TinyArch::Llama {
        w.add(key("rope.dimension_count"), spec.head_dim())?;
    }
    w.add("general.file_type", spec.dtype.file_type())?;
    tokenizer.add_to(&mut w)?;
    w.add(FINGERPRINT_KEY, spec.fingerprint(tokenizer))?;

    let e = u64::from(spec.n_embd);
    let kv = u64::from(spec.n_embd_kv());
    let ff = u64::from(spec.n_ff);
    let vocab = tokenizer.n_vocab() as u64;
    let wt = spec.dtype.ggml();
    let residual = 1.0 / (2.0 * f64::from(spec.n_layer)).sqrt();
    let fan = |n: u64| 1.0 / f64::from(u32::try_from(n).unwrap_or(u32::MAX)).sqrt();

    let add = |w: &mut GgufWriter, name: &str, dims: &[u64], sigma: Option<f64>, ty: GgmlType| {
        let n: u64 = dims.iter().product();
        let values = match sigma {
            Some(s) => normal(&mut tensor_rng(spec.seed, name), n as usize, s),
            None => vec![1.0; n as usize],
        };
        w.add_f32_tensor(name, dims, &values, ty).map(|_| ())
    };

    add(&mut w, "token_embd.weight", &[e, vocab], Some(1.0), wt)?;
    add(&mut w, "output_norm.weight", &[e], None, GgmlType::F32)?;
    add(&mut w, "output.weight", &[e, vocab], Some(2.5 * fan(e)), wt)?;
    let biased = spec.arch == TinyArch::Qwen2;
    for i in 0..spec.n_layer {
        let t = |s: &str| format!("blk.{i}.{s}");
        add(&mut w, &t("attn_norm.weight"), &[e], None, GgmlType::F32)?;
        for (m, width) in [("q", e), ("k", kv), ("v", kv)] {
            add(
                &mut w,
                &t(&format!("attn_{m}.weight")),
                &[e, width],
                Some(fan(e)),
                wt,
            )?;
            if biased {
                add(
                    &mut w,
                    &t(&format!("attn_{m}.bias")),
                    &[width],
                    Some(0.1),
                    GgmlType::F32,
                )?;
            }
        }
        add(
            &mut w,
            &t("attn_output.weight"),
            &[e, e],
            Some(fan(e) * residual),
            wt,
        )?;
        add(&mut w, &t("ffn_norm.weight"), &[e], None, GgmlType::F32)?;
        add(&mut w, &t("ffn_gate.weight"), &[e, ff], Some(fan(e)), wt)?;
        add(&mut w, &t("ffn_up.weight"), &[e, ff], Some(fan(e)), wt)?;
        add(
            &mut w,
            &t("ffn_down.weight"),
            &[ff, e],
            Some(fan(ff) * residual),
            wt,
        )?;
    }
    Ok(w.write(path)?)
}

/// File stem of the larger standard rung (tier0 analogue).
pub const TINY_BIG: &str = "tiny-big";
/// File stem of the smaller standard rung (tier2 analogue).
pub const TINY_SMALL: &str = "tiny-small";
/// File stem of the rung with the alternative tokenizer.
pub const TINY_ALT: &str = "tiny-alt";

/// The specs of [`standard_ladder`]: `tiny-big` (4 layers, `n_embd` 256, 4/2 heads,
/// `head_dim` 64, `n_ff` 512), `tiny-small` (3 layers, `n_embd` 128, 4/2 heads, `head_dim`
/// 32, `n_ff` 256) and
/// `tiny-alt` (tiny-small's shape, another seed, used with [`TinyTokenizer::alt`]). All F16
/// weights, RoPE base 1e6, context 2048.
#[must_use]
pub fn standard_specs() -> [TinySpec; 3] {
    let base = TinySpec {
        arch: TinyArch::Qwen2,
        name: TINY_BIG.to_owned(),
        n_layer: 4,
        n_embd: 256,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 512,
        n_ctx: 2048,
        rope_base: 1e6,
        seed: 0x6d6f_6c74_0000_0000,
        dtype: DType::F16,
    };
    let small = TinySpec {
        name: TINY_SMALL.to_owned(),
        n_layer: 3,
        n_embd: 128,
        n_ff: 256,
        seed: base.seed + 2,
        ..base.clone()
    };
    let alt = TinySpec {
        name: TINY_ALT.to_owned(),
        seed: base.seed + 3,
        ..small.clone()
    };
    [base, small, alt]
}

/// Whether `path` is a readable GGUF whose fingerprint is `fingerprint`.
fn is_current(path: &Path, fingerprint: &str) -> bool {
    GgufFile::open(path)
        .ok()
        .and_then(|f| f.get_str(FINGERPRINT_KEY).ok().map(|s| s == fingerprint))
        .unwrap_or(false)
}

/// Writes the standard tiny ladder into `dir` (created if needed), skipping files that are
/// present and current (same fingerprint), and returns their paths in order: `tiny-big`,
/// `tiny-small` (both [`TinyTokenizer::standard`]), `tiny-alt` ([`TinyTokenizer::alt`]).
///
/// Safe to call from parallel tests: each writer uses its own partial file, renames are
/// atomic, and concurrent writers produce identical bytes.
///
/// # Errors
/// [`TinyError::Io`] if `dir` cannot be created; [`TinyError::Write`] if a file cannot be
/// written.
pub fn standard_ladder(dir: impl AsRef<Path>) -> Result<Vec<PathBuf>, TinyError> {
    let standard = TinyTokenizer::standard();
    let alt = TinyTokenizer::alt();
    let specs = standard_specs().map(|spec| {
        let tok = if spec.name == TINY_ALT {
            &alt
        } else {
            &standard
        };
        (spec, tok)
    });
    write_current(dir.as_ref(), &specs)
}

/// The manifest [`ladder`] writes: a big rung, its Q8_0 requantization (the precision route),
/// and a small rung with another head size and layer count (the size route).
pub const TINY_MANIFEST: &str = r#"
name = "tiny"
description = "random-weight qwen2 models for hermetic tests and examples"
[[rung]]
name = "big"
file = "tiny-big.gguf"
source = { local = {} }
[[rung]]
name = "big-q8"
file = "tiny-big-q8_0.gguf"
source = { requantize = { from = "big", type = "Q8_0" } }
[[rung]]
name = "small"
file = "tiny-small.gguf"
source = { local = {} }
"#;

/// A whole tiny ladder in `dir` — the [`standard_ladder`]'s files, the requantized rung and
/// the manifest `tiny.toml` — ready for [`crate::ladder::Ladder::open`] or the facade; returns
/// the manifest's path. The weights are random: the text is nonsense, the machinery real.
/// Skips what is already current.
///
/// # Errors
/// As [`standard_ladder`]; [`TinyError::Fetch`] when the requantized rung cannot be built.
pub fn ladder(dir: impl AsRef<Path>) -> Result<PathBuf, TinyError> {
    let dir = dir.as_ref();
    standard_ladder(dir)?;
    let manifest_path = dir.join("tiny.toml");
    std::fs::write(&manifest_path, TINY_MANIFEST).map_err(|source| TinyError::Io {
        dir: dir.to_path_buf(),
        source,
    })?;
    let m = crate::ladder::Manifest::load(&manifest_path).map_err(|e| TinyError::Io {
        dir: dir.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    crate::ladder::fetch::fetch(
        &m,
        dir,
        &crate::ladder::FetchOptions {
            threads: 2,
            ..crate::ladder::FetchOptions::default()
        },
    )?;
    Ok(manifest_path)
}

/// File stem of the larger llama-architecture rung.
pub const TINY_LLAMA_BIG: &str = "tiny-llama-big";
/// File stem of the smaller llama-architecture rung.
pub const TINY_LLAMA_SMALL: &str = "tiny-llama-small";

/// The specs of [`llama_ladder`], other head counts than the standard ones:
/// `tiny-llama-big` (4 layers, `n_embd` 192, 6/2 heads, `head_dim` 32, `n_ff` 384) and
/// `tiny-llama-small` (2 layers, `n_embd` 64, 4/2 heads, `head_dim` 16, `n_ff` 128). F16
/// weights, RoPE base 5e5, context 2048, [`TinyTokenizer::standard`].
#[must_use]
pub fn llama_specs() -> [TinySpec; 2] {
    let big = TinySpec {
        arch: TinyArch::Llama,
        name: TINY_LLAMA_BIG.to_owned(),
        n_layer: 4,
        n_embd: 192,
        n_head: 6,
        n_head_kv: 2,
        n_ff: 384,
        n_ctx: 2048,
        rope_base: 5e5,
        seed: 0x6c6c_616d_6100_0000,
        dtype: DType::F16,
    };
    let small = TinySpec {
        name: TINY_LLAMA_SMALL.to_owned(),
        n_layer: 2,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 128,
        seed: big.seed + 1,
        ..big.clone()
    };
    [big, small]
}

/// Writes the llama-architecture tiny ladder into `dir` like [`standard_ladder`] and returns
/// the paths: `tiny-llama-big`, `tiny-llama-small`.
///
/// # Errors
/// As [`standard_ladder`].
pub fn llama_ladder(dir: impl AsRef<Path>) -> Result<Vec<PathBuf>, TinyError> {
    let tok = TinyTokenizer::standard();
    let specs = llama_specs().map(|spec| (spec, &tok));
    write_current(dir.as_ref(), &specs)
}

/// Writes each spec to `dir/<name>.gguf` unless a current file is there; returns the paths.
fn write_current(
    dir: &Path,
    specs: &[(TinySpec, &TinyTokenizer)],
) -> Result<Vec<PathBuf>, TinyError> {
    std::fs::create_dir_all(dir).map_err(|source| TinyError::Io {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut paths = Vec::new();
    for (spec, tok) in specs {
        let path = dir.join(format!("{}.gguf", spec.name));
        if !is_current(&path, &spec.fingerprint(tok)) {
            write_model(spec, tok, &path)?;
        }
        paths.push(path);
    }
    Ok(paths)
}
