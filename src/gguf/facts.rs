//! Model geometry read from GGUF metadata: [`ModelFacts`], [`RopeFacts`], [`RopeKind`].
//!
//! The ladder needs the same numbers llama.cpp derives when it loads a model — layer count,
//! head geometry, RoPE base and style — *before* loading it, to decide whether two rungs can
//! share a KV transplant and how to build the RoPE sandwich. The derivations mirror
//! `llama_model_base::load_hparams` (defaults: `head_dim = n_embd / n_head`, `n_head_kv =
//! n_head`, `freq_base = 10000`, rope dimension count = `head_dim`, scaling type `linear`) and
//! `llama_model_rope_type` of the pinned llama.cpp (`llama-cpp-sys-2` 0.1.161).

use crate::gguf::error::{GgufError, Result};
use crate::gguf::reader::GgufFile;
use crate::gguf::value::{ArrayValue, Value};

/// How RoPE pairs the dimensions of a head (`enum llama_rope_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RopeKind {
    /// No rotary embedding.
    None,
    /// "Normal" RoPE: rotates consecutive pairs `(2i, 2i+1)` (llama).
    Norm,
    /// NEOX RoPE: pairs dimension `i` with `i + n_rot/2` (qwen2, gemma, phi, …).
    Neox,
    /// Multi-section RoPE (qwen2-vl).
    Mrope,
    /// Interleaved multi-section RoPE (qwen3-vl, qwen3.5).
    Imrope,
}

/// RoPE frequency scaling (`enum llama_rope_scaling_type`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// `"none"`.
    None,
    /// `"linear"` (llama.cpp's default when the key is absent).
    Linear,
    /// `"yarn"`.
    Yarn,
    /// `"longrope"`.
    LongRope,
}

/// RoPE parameters of a model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeFacts {
    /// Pairing style.
    pub kind: RopeKind,
    /// `{arch}.rope.freq_base`, default 10000.
    pub freq_base: f32,
    /// `{arch}.rope.dimension_count` (`n_rot`), default the key head dimension.
    pub dimension_count: u32,
    /// `{arch}.rope.scaling.type`, default linear.
    pub scaling: RopeScaling,
    /// `{arch}.rope.scaling.factor` (or the old `{arch}.rope.scale_linear`); `None` or 0
    /// means no scaling.
    pub scaling_factor: Option<f32>,
}

impl RopeFacts {
    /// The frequency scale llama.cpp applies: `1 / factor`, or 1 without a factor.
    #[must_use]
    pub fn freq_scale(&self) -> f32 {
        match self.scaling_factor {
            Some(f) if f != 0.0 => 1.0 / f,
            _ => 1.0,
        }
    }
}

/// The geometry and identity of a model, from its GGUF metadata alone.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelFacts {
    /// `general.architecture`, e.g. `"qwen2"`.
    pub architecture: String,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// `{arch}.block_count`.
    pub n_layer: u32,
    /// `{arch}.embedding_length`.
    pub n_embd: u32,
    /// `{arch}.attention.head_count` (the maximum over layers if given per layer).
    pub n_head: u32,
    /// `{arch}.attention.head_count_kv`, default `n_head` (maximum over layers if per layer).
    pub n_head_kv: u32,
    /// Key head dimension: `{arch}.attention.key_length`, default `n_embd / n_head`.
    pub head_dim: u32,
    /// Value head dimension: `{arch}.attention.value_length`, default `n_embd / n_head`.
    pub head_dim_v: u32,
    /// `{arch}.feed_forward_length` (maximum over layers if per layer), 0 if absent.
    pub n_ff: u32,
    /// `{arch}.context_length`.
    pub n_ctx_train: u32,
    /// RoPE parameters.
    pub rope: RopeFacts,
    /// Vocabulary size: `{arch}.vocab_size`, else the length of `tokenizer.ggml.tokens`,
    /// else `token_embd.weight`'s second dimension.
    pub n_vocab: u64,
    /// `general.file_type` (`enum llama_ftype`), if present.
    pub file_type: Option<u32>,
    /// File size in bytes.
    pub file_size: u64,
    /// Sum of the tensors' data sizes.
    pub total_tensor_bytes: u64,
    /// Number of tensors.
    pub n_tensors: usize,
}

impl ModelFacts {
    /// Reads the facts from an opened file.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] for a missing `general.architecture`, `{arch}.block_count`,
    /// `{arch}.embedding_length`, `{arch}.attention.head_count` or `{arch}.context_length`;
    /// [`GgufError::WrongType`] for a key of the wrong type; [`GgufError::InvalidMetadata`]
    /// for zero heads, a head count that does not divide the embedding without a key
    /// length, a KV row width (`head_count_kv × key/value length`) past `u32`, or no way to
    /// tell the vocabulary size.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelFacts> {
        let arch = f.get_str("general.architecture")?.to_owned();
        let k = |suffix: &str| format!("{arch}.{suffix}");
        let invalid = |reason: String| GgufError::InvalidMetadata {
            file: f.path().to_path_buf(),
            reason,
        };

        let n_layer = f.get_u32(&k("block_count"))?;
        let n_embd = f.get_u32(&k("embedding_length"))?;
        let n_ctx_train = f.get_u32(&k("context_length"))?;
        let n_head = scalar_or_max(f, &k("attention.head_count"))?
            .ok_or_else(|| missing(f, &k("attention.head_count")))?;
        if n_head == 0 {
            return Err(invalid(format!("{} is 0", k("attention.head_count"))));
        }
        let n_head_kv = scalar_or_max(f, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        let n_ff = scalar_or_max(f, &k("feed_forward_length"))?.unwrap_or(0);

        let default_head = if n_embd % n_head == 0 {
            Some(n_embd / n_head)
        } else {
            None
        };
        let head_dim = match f.get_opt::<u32>(&k("attention.key_length"))? {
            Some(h) => h,
            None => default_head.ok_or_else(|| {
                invalid(format!(
                    "n_embd {n_embd} is not a multiple of n_head {n_head} and {} is absent",
                    k("attention.key_length")
                ))
            })?,
        };
        let head_dim_v = match f.get_opt::<u32>(&k("attention.value_length"))? {
            Some(h) => h,
            None => default_head.unwrap_or(head_dim),
        };

        // A cache row is n_head_kv × head_dim wide; a file whose product wraps a u32 would
        // size every KV buffer wrong (found by the gguf fuzz target).
        for (dim, key) in [(head_dim, "key_length"), (head_dim_v, "value_length")] {
            if n_head_kv.checked_mul(dim).is_none() {
                return Err(invalid(format!(
                    "{} {n_head_kv} × attention.{key} {dim} overflows a cache row's width",
                    k("attention.head_count_kv")
                )));
            }
        }

        let rope = RopeFacts {
            kind: rope_kind(&arch, has_mrope_sections(f, &k("rope.dimension_sections"))),
            freq_base: f.get_opt::<f32>(&k("rope.freq_base"))?.unwrap_or(10_000.0),
            dimension_count: f
                .get_opt::<u32>(&k("rope.dimension_count"))?
                .unwrap_or(head_dim),
            scaling: match f.get_opt::<String>(&k("rope.scaling.type"))?.as_deref() {
                None | Some("linear") => RopeScaling::Linear,
                Some("none") => RopeScaling::None,
                Some("yarn") => RopeScaling::Yarn,
                Some("longrope") => RopeScaling::LongRope,
                Some(other) => {
                    return Err(invalid(format!("unknown rope scaling type '{other}'")));
                }
            },
            scaling_factor: match f.get_opt::<f32>(&k("rope.scaling.factor"))? {
                Some(x) => Some(x),
                None => f.get_opt::<f32>(&k("rope.scale_linear"))?,
            },
        };

        let n_vocab = if let Some(n) = f.get_opt::<u64>(&k("vocab_size"))? {
            n
        } else if let Some(Value::Array(a)) = f.get("tokenizer.ggml.tokens") {
            a.len() as u64
        } else if let Some(t) = f.tensor("token_embd.weight") {
            t.dims.get(1).copied().unwrap_or(0)
        } else {
            return Err(invalid(
                "no vocab_size, tokenizer.ggml.tokens or token_embd.weight".to_owned(),
            ));
        };

        Ok(ModelFacts {
            name: f.get_opt::<String>("general.name")?,
            architecture: arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            n_ff,
            n_ctx_train,
            rope,
            n_vocab,
            file_type: f.get_opt::<u32>("general.file_type")?,
            file_size: f.file_len(),
            total_tensor_bytes: f.total_tensor_bytes(),
            n_tensors: f.tensors().len(),
        })
    }

    /// Width of one token's keys in one layer: `n_head_kv * head_dim` (`n_embd_k_gqa`).
    #[must_use]
    pub fn kv_dim_k(&self) -> u32 {
        self.n_head_kv * self.head_dim
    }

    /// Width of one token's values in one layer: `n_head_kv * head_dim_v` (`n_embd_v_gqa`).
    #[must_use]
    pub fn kv_dim_v(&self) -> u32 {
        self.n_head_kv * self.head_dim_v
    }

    /// Query heads per KV head (grouped-query attention factor), 0 without KV heads.
    #[must_use]
    pub fn gqa_group(&self) -> u32 {
        self.n_head.checked_div(self.n_head_kv).unwrap_or(0)
    }

    /// llama.cpp's name for [`ModelFacts::file_type`], e.g. `"Q4_K - Medium"`.
    #[must_use]
    pub fn file_type_name(&self) -> Option<&'static str> {
        self.file_type.and_then(file_type_name)
    }
}

fn missing(f: &GgufFile, key: &str) -> GgufError {
    GgufError::MissingKey {
        key: key.to_owned(),
        file: f.path().to_path_buf(),
    }
}

/// A count given either as one integer or per layer as an integer array (`get_key_or_arr`);
/// per-layer arrays yield their maximum.
fn scalar_or_max(f: &GgufFile, key: &str) -> Result<Option<u32>> {
    match f.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => {
            let mut best: Option<u32> = None;
            for i in 0..a.len() {
                let v = a
                    .integer_at(i)
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| GgufError::WrongType {
                        key: key.to_owned(),
                        expected: "an integer or an array of integers fitting u32",
                        found: Value::Array(a.clone()).type_description(),
                        file: f.path().to_path_buf(),
                    })?;
                best = Some(best.map_or(v, |b| b.max(v)));
            }
            Ok(best)
        }
        Some(_) => f.get_as::<u32>(key).map(Some),
    }
}

/// `hparams.use_mrope()`: the first two rope sections are non-zero.
fn has_mrope_sections(f: &GgufFile, key: &str) -> bool {
    match f.get(key) {
        Some(Value::Array(a @ (ArrayValue::I32s(_) | ArrayValue::U32s(_)))) => {
            let at = |i| a.integer_at(i).unwrap_or(0);
            at(0) > 0 && at(1) > 0
        }
        _ => false,
    }
}

/// The RoPE kind llama.cpp uses for `arch` (`llama_model_rope_type`, pinned llama.cpp).
/// An architecture this table does not know also yields [`RopeKind::None`], so a caller
/// that needs rotation refuses it rather than rotating the wrong pairs.
#[must_use]
#[allow(clippy::match_same_arms)] // the explicit no-RoPE list mirrors llama.cpp's
pub fn rope_kind(arch: &str, mrope_sections: bool) -> RopeKind {
    match arch {
        "clip" | "gpt2" | "gptj" | "mpt" | "refact" | "bloom" | "mamba" | "mamba2" | "jamba"
        | "jina-bert-v2" | "t5" | "t5encoder" | "jais" | "rwkv6" | "rwkv6qwen2" | "rwkv7"
        | "arwkv7" | "wavtokenizer-dec" | "nemotron_h" | "nemotron_h_moe" | "kimi-linear"
        | "kimi-k3" | "glm5-next" => RopeKind::None,

        "llama" | "llada" | "llama4" | "deci" | "baichuan" | "starcoder" | "internlm2"
        | "minicpm" | "xverse" | "command-r" | "cohere2" | "cohere2moe" | "olmo" | "arctic"
        | "deepseek" | "deepseek2" | "deepseek2-ocr" | "deepseek32" | "deepseek4"
        | "muse-glimmer" | "plm" | "chatglm" | "granite" | "granitemoe" | "granitehybrid"
        | "graniteswitch" | "granite_swa" | "chameleon" | "bailingmoe" | "neo-bert" | "smollm3"
        | "arcee" | "ernie4_5" | "ernie4_5-moe" | "mistral3" | "eagle3" | "mistral4"
        | "llama-embed" | "maincoder" | "glm-dsa" | "dots3note" | "nanbeige" | "pockettts"
        | "hy_v4" => RopeKind::Norm,

        "bailingmoe3" | "glm4" => {
            if mrope_sections {
                RopeKind::Mrope
            } else {
                RopeKind::Norm
            }
        }

        "falcon" | "falcon-h1" | "grok" | "dbrx" | "bert" | "jina-bert-v3" | "modern-bert"
        | "nomic-bert" | "nomic-bert-moe" | "eurobert" | "stablelm" | "bitnet" | "qwen"
        | "qwen2" | "dream" | "qwen2moe" | "qwen3" | "qwen3moe" | "llada-moe" | "rnd1"
        | "olmo2" | "olmoe" | "phi2" | "phi3" | "phimoe" | "plamo" | "plamo2" | "plamo3"
        | "gemma" | "gemma2" | "gemma3" | "gemma3n" | "gemma4" | "gemma4-assistant"
        | "gemma-embedding" | "starcoder2" | "openelm" | "gptneox" | "codeshell" | "orion"
        | "nemotron" | "exaone" | "exaone4" | "exaone-moe" | "minicpm3" | "bailingmoe2"
        | "dots1" | "hunyuan-moe" | "jais2" | "gpt-oss" | "hunyuan-dense" | "hy_v3" | "lfm2"
        | "lfm2moe" | "smallthinker" | "seed_oss" | "grovemoe" | "apertus" | "minimax-01"
        | "minimax-m2" | "minimax-m3" | "cogvlm" | "pangu-embedded" | "afmoe" | "laguna"
        | "qwen3next" | "mimo2" | "step35" | "spark2_5" | "talkie" | "mellum" | "maple"
        | "hrm_text" => RopeKind::Neox,

        "glm4moe" | "hunyuan_vl" | "dflash" => {
            if mrope_sections {
                RopeKind::Mrope
            } else {
                RopeKind::Neox
            }
        }

        "qwen2vl" | "paddleocr" => RopeKind::Mrope,

        "qwen3vl" | "qwen3vlmoe" | "qwen35" | "qwen35moe" | "clef" | "qwen4exp" | "qwen3tts" => {
            RopeKind::Imrope
        }

        _ => RopeKind::None,
    }
}

/// llama.cpp's description of a `general.file_type` (`llama_model_ftype_name`).
#[must_use]
pub fn file_type_name(ftype: u32) -> Option<&'static str> {
    Some(match ftype {
        0 => "all F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K - Medium",
        11 => "Q3_K - Small",
        12 => "Q3_K - Medium",
        13 => "Q3_K - Large",
        14 => "Q4_K - Small",
        15 => "Q4_K - Medium",
        16 => "Q5_K - Small",
        17 => "Q5_K - Medium",
        18 => "Q6_K",
        19 => "IQ2_XXS - 2.0625 bpw",
        20 => "IQ2_XS - 2.3125 bpw",
        21 => "Q2_K - Small",
        22 => "IQ3_XS - 3.3 bpw",
        23 => "IQ3_XXS - 3.0625 bpw",
        24 => "IQ1_S - 1.5625 bpw",
        25 => "IQ4_NL - 4.5 bpw",
        26 => "IQ3_S - 3.4375 bpw",
        27 => "IQ3_S mix - 3.66 bpw",
        28 => "IQ2_S - 2.5 bpw",
        29 => "IQ2_M - 2.7 bpw",
        30 => "IQ4_XS - 4.25 bpw",
        31 => "IQ1_M - 1.75 bpw",
        32 => "BF16",
        36 => "TQ1_0 - 1.69 bpw ternary",
        37 => "TQ2_0 - 2.06 bpw ternary",
        38 => "MXFP4 MoE",
        39 => "NVFP4",
        40 => "Q1_0",
        41 => "Q2_0",
        _ => return None,
    })
}
