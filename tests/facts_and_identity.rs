//! `ModelFacts` derivations and `TokenizerIdentity` comparisons on hand-built files.
#![allow(
    clippy::float_cmp,
    clippy::cast_precision_loss,
    clippy::many_single_char_names
)]
// Round trips are checked bit-exactly on purpose; the counts cast to f64 are small.

use molt::gguf::{
    ArrayValue, GgufError, GgufFile, GgufWriter, MismatchReason, ModelFacts, RopeKind, RopeScaling,
    TokenizerIdentity, Value, rope_kind,
};

fn file<K: AsRef<str>>(pairs: &[(K, Value)]) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in pairs {
        w.add(k.as_ref(), v.clone()).expect("add");
    }
    GgufFile::from_bytes("/m/model.gguf", w.to_bytes()).expect("parse")
}

fn llama_like() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", "llama".into()),
        ("llama.block_count", 30u32.into()),
        ("llama.embedding_length", 576u32.into()),
        ("llama.context_length", 8192u32.into()),
        ("llama.attention.head_count", 9u32.into()),
        ("llama.attention.head_count_kv", 3u32.into()),
        ("llama.feed_forward_length", 1536u32.into()),
        ("llama.vocab_size", 49_152u32.into()),
    ]
}

#[test]
fn defaults_mirror_llama_cpp() {
    let f = ModelFacts::from_gguf(&file(&llama_like())).expect("facts");
    assert_eq!(f.architecture, "llama");
    assert_eq!(f.name, None);
    assert_eq!(f.head_dim, 64); // 576 / 9
    assert_eq!(f.head_dim_v, 64);
    assert_eq!(f.rope.kind, RopeKind::Norm);
    assert_eq!(f.rope.freq_base, 10_000.0);
    assert_eq!(f.rope.dimension_count, 64);
    assert_eq!(f.rope.scaling, RopeScaling::Linear);
    assert_eq!(f.rope.scaling_factor, None);
    assert_eq!(f.n_vocab, 49_152);
    assert_eq!(f.file_type, None);
    assert_eq!(f.gqa_group(), 3);

    // head_count_kv absent -> n_head
    let mut pairs = llama_like();
    pairs.retain(|(k, _)| *k != "llama.attention.head_count_kv");
    assert_eq!(
        ModelFacts::from_gguf(&file(&pairs))
            .expect("facts")
            .n_head_kv,
        9
    );
}

#[test]
fn explicit_keys_override_defaults() {
    let mut pairs = llama_like();
    pairs.extend([
        ("general.name", "SmolLM2".into()),
        ("llama.attention.key_length", 128u32.into()),
        ("llama.attention.value_length", 96u32.into()),
        ("llama.rope.freq_base", 100_000f32.into()),
        ("llama.rope.dimension_count", 32u32.into()),
        ("llama.rope.scaling.type", "yarn".into()),
        ("llama.rope.scaling.factor", 4f32.into()),
        ("general.file_type", 15u32.into()),
    ]);
    let f = ModelFacts::from_gguf(&file(&pairs)).expect("facts");
    assert_eq!(f.name.as_deref(), Some("SmolLM2"));
    assert_eq!((f.head_dim, f.head_dim_v), (128, 96));
    assert_eq!((f.kv_dim_k(), f.kv_dim_v()), (384, 288));
    assert_eq!(f.rope.freq_base, 100_000.0);
    assert_eq!(f.rope.dimension_count, 32);
    assert_eq!(f.rope.scaling, RopeScaling::Yarn);
    assert_eq!(f.rope.freq_scale(), 0.25);
    assert_eq!(f.file_type_name(), Some("Q4_K - Medium"));
}

#[test]
fn per_layer_arrays_and_other_integer_types_are_accepted() {
    let mut pairs = llama_like();
    pairs.retain(|(k, _)| !k.ends_with("head_count_kv") && !k.ends_with("feed_forward_length"));
    pairs.push((
        "llama.attention.head_count_kv",
        ArrayValue::I32s(vec![3, 1, 3]).into(),
    ));
    pairs.push((
        "llama.feed_forward_length",
        ArrayValue::U32s(vec![1024, 2048]).into(),
    ));
    pairs.push(("llama.rope.scale_linear", 2f32.into()));
    let f = ModelFacts::from_gguf(&file(&pairs)).expect("facts");
    assert_eq!((f.n_head_kv, f.n_ff), (3, 2048));
    assert_eq!(f.rope.scaling_factor, Some(2.0));
    // a u64 block count is fine
    let mut pairs = llama_like();
    pairs[1] = ("llama.block_count", 30u64.into());
    assert_eq!(
        ModelFacts::from_gguf(&file(&pairs)).expect("facts").n_layer,
        30
    );
}

#[test]
fn missing_and_inconsistent_metadata_are_errors_naming_the_file() {
    let mut pairs = llama_like();
    pairs.retain(|(k, _)| *k != "llama.block_count");
    let e = ModelFacts::from_gguf(&file(&pairs)).expect_err("missing");
    assert!(matches!(&e, GgufError::MissingKey { key, .. } if key == "llama.block_count"));
    assert_eq!(
        e.to_string(),
        "/m/model.gguf: missing metadata key 'llama.block_count'"
    );

    let mut pairs = llama_like();
    pairs[4] = ("llama.attention.head_count", 0u32.into());
    assert!(matches!(
        ModelFacts::from_gguf(&file(&pairs)),
        Err(GgufError::InvalidMetadata { .. })
    ));
    let mut pairs = llama_like();
    pairs[4] = ("llama.attention.head_count", 7u32.into());
    let e = ModelFacts::from_gguf(&file(&pairs)).expect_err("576 % 7");
    assert!(e.to_string().contains("not a multiple"), "{e}");
    let mut pairs = llama_like();
    pairs[4] = ("llama.attention.head_count", "nine".into());
    assert!(matches!(
        ModelFacts::from_gguf(&file(&pairs)),
        Err(GgufError::WrongType { .. })
    ));
    let mut pairs = llama_like();
    pairs.push(("llama.rope.scaling.type", "cubic".into()));
    assert!(matches!(
        ModelFacts::from_gguf(&file(&pairs)),
        Err(GgufError::InvalidMetadata { .. })
    ));
    let mut pairs = llama_like();
    pairs.retain(|(k, _)| *k != "llama.vocab_size");
    assert!(matches!(
        ModelFacts::from_gguf(&file(&pairs)),
        Err(GgufError::InvalidMetadata { .. })
    ));
    assert!(matches!(
        ModelFacts::from_gguf(&file::<&str>(&[])),
        Err(GgufError::MissingKey { key, .. }) if key == "general.architecture"
    ));
}

#[test]
fn rope_kinds_follow_llama_model_rope_type() {
    for arch in [
        "qwen2", "qwen3", "gemma3", "phi3", "qwen2moe", "gpt-oss", "falcon",
    ] {
        assert_eq!(rope_kind(arch, false), RopeKind::Neox, "{arch}");
    }
    for arch in [
        "llama",
        "deepseek2",
        "granite",
        "mistral3",
        "smollm3",
        "hy_v4",
    ] {
        assert_eq!(rope_kind(arch, false), RopeKind::Norm, "{arch}");
    }
    assert_eq!(rope_kind("gpt2", false), RopeKind::None);
    assert_eq!(rope_kind("mamba", false), RopeKind::None);
    assert_eq!(rope_kind("qwen2vl", false), RopeKind::Mrope);
    assert_eq!(rope_kind("qwen3vl", false), RopeKind::Imrope);
    assert_eq!(rope_kind("glm4", false), RopeKind::Norm);
    assert_eq!(rope_kind("glm4", true), RopeKind::Mrope);
    assert_eq!(rope_kind("glm4moe", false), RopeKind::Neox);
    assert_eq!(rope_kind("no-such-arch", false), RopeKind::None);

    let mut pairs: Vec<(String, Value)> = llama_like()
        .into_iter()
        .map(|(k, v)| (k.replace("llama.", "glm4."), v))
        .collect();
    pairs[0].1 = "glm4".into();
    pairs.push((
        "glm4.rope.dimension_sections".to_owned(),
        ArrayValue::I32s(vec![8, 12, 12, 0]).into(),
    ));
    assert_eq!(
        ModelFacts::from_gguf(&file(&pairs))
            .expect("facts")
            .rope
            .kind,
        RopeKind::Mrope
    );
}

fn tokenizer_pairs() -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.model", "gpt2".into()),
        ("tokenizer.ggml.pre", "qwen2".into()),
        (
            "tokenizer.ggml.tokens",
            vec!["a".to_owned(), "b".to_owned(), "ab".to_owned()].into(),
        ),
        ("tokenizer.ggml.token_type", vec![1i32, 1, 1].into()),
        ("tokenizer.ggml.merges", vec!["a b".to_owned()].into()),
        ("tokenizer.ggml.bos_token_id", 0u32.into()),
        ("tokenizer.ggml.eos_token_id", 2u32.into()),
        ("tokenizer.ggml.add_bos_token", false.into()),
    ]
}

fn identity<K: AsRef<str>>(pairs: &[(K, Value)]) -> TokenizerIdentity {
    TokenizerIdentity::from_gguf(&file(pairs)).expect("identity")
}

fn with(key: &str, value: Value) -> TokenizerIdentity {
    let mut pairs: Vec<(String, Value)> = tokenizer_pairs()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    match pairs.iter_mut().find(|(k, _)| k == key) {
        Some(p) => p.1 = value,
        None => pairs.push((key.to_owned(), value)),
    }
    identity(&pairs)
}

#[test]
fn identical_tokenizers_compare_equal() {
    let a = identity(&tokenizer_pairs());
    let b = identity(&tokenizer_pairs());
    a.compare(&b).expect("equal");
    assert_eq!(a.digest(), b.digest());
    assert_eq!(a.digest().n_tokens, 3);
    assert_eq!(a.digest().n_merges, 1);
    assert_eq!(a.digest().tokens_sha256.len(), 64);
}

#[test]
fn vocabulary_differences_are_reported_precisely() {
    let base = identity(&tokenizer_pairs());
    let reason = |other: &TokenizerIdentity| base.compare(other).expect_err("differs").reason;
    let s = |x: &str| x.to_owned();

    assert_eq!(
        reason(&with("tokenizer.ggml.model", "llama".into())),
        MismatchReason::Model {
            left: s("gpt2"),
            right: s("llama")
        }
    );
    assert_eq!(
        reason(&with("tokenizer.ggml.pre", "smollm".into())),
        MismatchReason::PreTokenizer {
            left: Some(s("qwen2")),
            right: Some(s("smollm"))
        }
    );
    assert_eq!(
        reason(&with("tokenizer.ggml.tokens", vec![s("a"), s("b")].into())),
        MismatchReason::VocabSize { left: 3, right: 2 }
    );
    let e = base
        .compare(&with(
            "tokenizer.ggml.tokens",
            vec![s("a"), s("c"), s("ab")].into(),
        ))
        .expect_err("token");
    assert_eq!(
        e.reason,
        MismatchReason::Token {
            index: 1,
            left: s("b"),
            right: s("c")
        }
    );
    assert_eq!(
        e.to_string(),
        "/m/model.gguf and /m/model.gguf have different tokenizers: token #1 differs ('b' vs 'c')"
    );
    assert_eq!(
        reason(&with("tokenizer.ggml.token_type", vec![1i32, 3, 1].into())),
        MismatchReason::TokenType {
            index: 1,
            left: 1,
            right: 3
        }
    );
}

#[test]
fn merge_special_and_flag_differences_are_reported_precisely() {
    let base = identity(&tokenizer_pairs());
    let reason = |other: &TokenizerIdentity| base.compare(other).expect_err("differs").reason;
    let s = |x: &str| x.to_owned();

    assert_eq!(
        reason(&with(
            "tokenizer.ggml.merges",
            vec![s("a b"), s("ab ab")].into()
        )),
        MismatchReason::Merge {
            index: 1,
            left: None,
            right: Some(s("ab ab"))
        }
    );
    assert_eq!(
        reason(&with("tokenizer.ggml.merges", vec![s("b a")].into())),
        MismatchReason::Merge {
            index: 0,
            left: Some(s("a b")),
            right: Some(s("b a"))
        }
    );
    let e = base
        .compare(&with("tokenizer.ggml.eos_token_id", 1u32.into()))
        .expect_err("eos");
    assert_eq!(
        e.reason,
        MismatchReason::SpecialToken {
            which: "eos",
            left: Some(2),
            right: Some(1)
        }
    );
    assert!(
        e.to_string().ends_with("special ids differ: eos 2 vs 1"),
        "{e}"
    );
    assert_eq!(
        reason(&with("tokenizer.ggml.padding_token_id", 1u32.into())),
        MismatchReason::SpecialToken {
            which: "pad",
            left: None,
            right: Some(1)
        }
    );
    assert_eq!(
        reason(&with("tokenizer.ggml.add_bos_token", true.into())),
        MismatchReason::AddBos {
            left: Some(false),
            right: Some(true)
        }
    );
    // the digests differ in each case
    assert_ne!(
        base.digest().sha256,
        with("tokenizer.ggml.add_bos_token", true.into())
            .digest()
            .sha256
    );
}

#[test]
fn length_prefixed_hashing_separates_regroupings() {
    let a = with(
        "tokenizer.ggml.tokens",
        vec!["ab".to_owned(), "c".to_owned(), "x".to_owned()].into(),
    );
    let b = with(
        "tokenizer.ggml.tokens",
        vec!["a".to_owned(), "bc".to_owned(), "x".to_owned()].into(),
    );
    assert_ne!(a.digest().tokens_sha256, b.digest().tokens_sha256);
}

#[test]
fn tokenizer_keys_of_the_wrong_type_are_errors() {
    let mut pairs = tokenizer_pairs();
    pairs[3] = ("tokenizer.ggml.token_type", vec![1u32, 1, 1].into());
    assert!(matches!(
        TokenizerIdentity::from_gguf(&file(&pairs)),
        Err(GgufError::WrongType { key, .. }) if key == "tokenizer.ggml.token_type"
    ));
    let mut pairs = tokenizer_pairs();
    pairs.retain(|(k, _)| *k != "tokenizer.ggml.tokens");
    assert!(matches!(
        TokenizerIdentity::from_gguf(&file(&pairs)),
        Err(GgufError::MissingKey { .. })
    ));
    // no merges and no token types (an SPM tokenizer) is fine
    let mut pairs = tokenizer_pairs();
    pairs.retain(|(k, _)| !k.ends_with("merges") && !k.ends_with("token_type"));
    let id = TokenizerIdentity::from_gguf(&file(&pairs)).expect("spm-like");
    assert!(id.merges().is_empty() && id.token_types().is_empty());
    assert_eq!(
        identity(&tokenizer_pairs())
            .compare(&id)
            .expect_err("differs")
            .reason,
        MismatchReason::TokenTypeCount { left: 3, right: 0 }
    );
}

/// Found by the gguf fuzz target (`tests/fuzz/corpus/gguf/crash-9763a3c4…`): KV heads × key
/// length past `u32` was accepted, and `kv_dim_k` overflowed (wrapping in release builds, so a
/// cache row would have been sized wrong). It is refused by name now.
#[test]
fn a_kv_row_width_past_u32_is_refused() {
    for key in ["llama.attention.key_length", "llama.attention.value_length"] {
        let mut pairs = llama_like();
        pairs.retain(|(k, _)| *k != "llama.attention.head_count_kv");
        pairs.push(("llama.attention.head_count_kv", 0x1_0000u32.into()));
        pairs.push((key, 0x1_0000u32.into()));
        match ModelFacts::from_gguf(&file(&pairs)) {
            Err(GgufError::InvalidMetadata { reason, .. }) => {
                assert!(reason.contains("overflows"), "{reason}");
            }
            other => panic!("{key}: expected a refusal, got {other:?}"),
        }
    }
}
