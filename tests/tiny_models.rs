//! The tiny ladder: files read back, facts, tokenizer identity, determinism, staleness.
#![allow(
    clippy::float_cmp,
    clippy::cast_precision_loss,
    clippy::many_single_char_names
)]
// Round trips are checked bit-exactly on purpose; the counts cast to f64 are small.

use std::path::PathBuf;
use std::sync::OnceLock;

use molt::gguf::{
    GgmlType, GgufFile, MismatchReason, ModelFacts, RopeKind, RopeScaling, TokenizerIdentity,
};
use molt::tiny::{
    self, DType, FINGERPRINT_KEY, IM_END, IM_START, TinyArch, TinyError, TinySpec, TinyTokenizer,
};

/// One ladder per test process (written once, shared by the tests).
fn ladder() -> &'static (tempfile::TempDir, Vec<PathBuf>) {
    static LADDER: OnceLock<(tempfile::TempDir, Vec<PathBuf>)> = OnceLock::new();
    LADDER.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = tiny::standard_ladder(dir.path()).expect("ladder");
        (dir, paths)
    })
}

fn open(i: usize) -> GgufFile {
    GgufFile::open(&ladder().1[i]).expect("open")
}

#[test]
fn ladder_files_are_named_small_and_readable() {
    let (dir, paths) = ladder();
    let names: Vec<String> = paths
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["tiny-big.gguf", "tiny-small.gguf", "tiny-alt.gguf"]);
    for p in paths {
        assert!(p.starts_with(dir.path()));
        let f = GgufFile::open(p).expect("open");
        assert!(
            f.file_len() < 10 << 20,
            "{}: {} bytes",
            p.display(),
            f.file_len()
        );
        assert_eq!(f.get_str("general.architecture").expect("arch"), "qwen2");
    }
}

#[test]
fn facts_match_the_specs() {
    let big = ModelFacts::from_gguf(&open(0)).expect("facts");
    assert_eq!(big.architecture, "qwen2");
    assert_eq!(big.name.as_deref(), Some("tiny-big"));
    assert_eq!(
        (big.n_layer, big.n_embd, big.n_head, big.n_head_kv),
        (4, 256, 4, 2)
    );
    assert_eq!((big.head_dim, big.head_dim_v, big.n_ff), (64, 64, 512));
    assert_eq!(big.kv_dim_k(), 128);
    assert_eq!(big.gqa_group(), 2);
    assert_eq!(big.n_ctx_train, 2048);
    assert_eq!(big.rope.kind, RopeKind::Neox);
    assert_eq!(big.rope.freq_base, 1e6);
    assert_eq!(big.rope.dimension_count, 64);
    assert_eq!(big.rope.scaling, RopeScaling::Linear);
    assert_eq!(big.rope.freq_scale(), 1.0);
    assert_eq!(big.n_vocab, 659);
    assert_eq!(big.file_type, Some(1));
    assert_eq!(big.file_type_name(), Some("F16"));
    assert_eq!(big.n_tensors, 3 + 4 * 12);

    let small = ModelFacts::from_gguf(&open(1)).expect("facts");
    assert_eq!(
        (small.n_layer, small.n_embd, small.head_dim, small.n_ff),
        (3, 128, 32, 256)
    );
    assert_eq!(small.kv_dim_v(), 64);
    assert_eq!(small.n_tensors, 3 + 3 * 12);
    assert!(small.total_tensor_bytes < small.file_size);
}

#[test]
fn tensors_have_the_qwen2_names_shapes_and_types() {
    let f = open(0);
    let (e, kv, ff, vocab) = (256, 128, 512, 659);
    let expect = |name: &str, dims: &[u64], ty: GgmlType| {
        let t = f.require_tensor(name).expect("tensor");
        assert_eq!(t.dims, dims, "{name}");
        assert_eq!(t.ggml_type, ty, "{name}");
    };
    expect("token_embd.weight", &[e, vocab], GgmlType::F16);
    expect("output_norm.weight", &[e], GgmlType::F32);
    expect("output.weight", &[e, vocab], GgmlType::F16);
    for i in 0..4 {
        let n = |s: &str| format!("blk.{i}.{s}");
        expect(&n("attn_norm.weight"), &[e], GgmlType::F32);
        expect(&n("attn_q.weight"), &[e, e], GgmlType::F16);
        expect(&n("attn_q.bias"), &[e], GgmlType::F32);
        expect(&n("attn_k.weight"), &[e, kv], GgmlType::F16);
        expect(&n("attn_k.bias"), &[kv], GgmlType::F32);
        expect(&n("attn_v.weight"), &[e, kv], GgmlType::F16);
        expect(&n("attn_v.bias"), &[kv], GgmlType::F32);
        expect(&n("attn_output.weight"), &[e, e], GgmlType::F16);
        expect(&n("ffn_norm.weight"), &[e], GgmlType::F32);
        expect(&n("ffn_gate.weight"), &[e, ff], GgmlType::F16);
        expect(&n("ffn_up.weight"), &[e, ff], GgmlType::F16);
        expect(&n("ffn_down.weight"), &[ff, e], GgmlType::F16);
    }
    assert!(f.tensor("blk.4.attn_q.weight").is_none());
}

/// Mean and standard deviation of an F16 tensor.
fn f16_stats(f: &GgufFile, name: &str) -> (f64, f64) {
    let t = f.require_tensor(name).expect("tensor");
    let v: Vec<f64> = f
        .tensor_data(t)
        .chunks_exact(2)
        .map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
        .collect();
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    (mean, var.sqrt())
}

#[test]
fn weights_have_the_documented_scales() {
    let f = open(0);
    let (m, s) = f16_stats(&f, "token_embd.weight");
    assert!(m.abs() < 0.02 && (s - 1.0).abs() < 0.02, "{m} {s}");
    let (m, s) = f16_stats(&f, "blk.0.attn_q.weight");
    assert!(m.abs() < 0.005 && (s - 1.0 / 16.0).abs() < 0.002, "{m} {s}");
    // residual output projections are scaled by 1/sqrt(2 n_layer)
    let (_, s) = f16_stats(&f, "blk.2.ffn_down.weight");
    let want = 1.0 / 512f64.sqrt() / 8f64.sqrt();
    assert!((s - want).abs() < 0.05 * want, "{s} vs {want}");
    // different tensors get different streams
    let a = f.tensor_data(f.require_tensor("blk.0.ffn_gate.weight").expect("gate"));
    let b = f.tensor_data(f.require_tensor("blk.0.ffn_up.weight").expect("up"));
    assert_ne!(a, b);
}

#[test]
fn big_and_small_share_a_tokenizer_and_alt_does_not() {
    let big = TokenizerIdentity::from_gguf(&open(0)).expect("big");
    let small = TokenizerIdentity::from_gguf(&open(1)).expect("small");
    let alt = TokenizerIdentity::from_gguf(&open(2)).expect("alt");
    big.compare(&small).expect("same tokenizer");
    assert_eq!(big.digest(), small.digest());
    assert_eq!(big.digest(), TinyTokenizer::standard().identity().digest());
    assert_eq!(big.model(), "gpt2");
    assert_eq!(big.pre(), Some("qwen2"));
    assert_eq!(big.n_tokens(), 659);
    assert_eq!(big.special().eos, Some(658));
    assert_eq!(big.special().bos, Some(656));
    assert_eq!(big.add_bos(), Some(false));

    let e = big.compare(&alt).expect_err("different tokenizer");
    let MismatchReason::Token {
        index,
        ref left,
        ref right,
    } = e.reason
    else {
        panic!("expected a token mismatch, got {e}");
    };
    // the 256 byte symbols are shared; the learnt tokens diverge right after them
    assert!((256..260).contains(&index), "{index}");
    assert_eq!(big.tokens()[..index], alt.tokens()[..index]);
    assert_eq!(left, &big.tokens()[index]);
    assert_eq!(right, &alt.tokens()[index]);
    let msg = e.to_string();
    assert!(
        msg.contains("tiny-big.gguf") && msg.contains("tiny-alt.gguf"),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("token #{index} differs ('{left}' vs '{right}')")),
        "{msg}"
    );
    assert_ne!(big.digest().sha256, alt.digest().sha256);
}

#[test]
fn tokenizer_ids_match_what_llama_cpp_produced() {
    // Recorded from llama.cpp (llama-cpp-sys-2 0.1.161) tokenizing with the tiny-big file:
    // `vocab.tokenize(text, add_special = false, parse_special = true)`.
    let t = TinyTokenizer::standard();
    assert_eq!(t.encode("hello world"), [257, 75, 75, 78, 265, 264, 306]);
    assert_eq!(
        t.encode("The robot wrote a new rule in the notebook."),
        [
            313, 490, 407, 602, 260, 371, 349, 84, 326, 285, 261, 320, 565, 13
        ]
    );
    assert_eq!(
        t.encode("fn main() {\n    println!(\"{x}\");\n}"),
        [
            575, 286, 410, 291, 340, 263, 443, 75, 77, 0, 374, 90, 87, 92, 321, 302, 92
        ]
    );
    assert_eq!(
        t.encode("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"),
        [
            657, 346, 268, 198, 257, 75, 75, 78, 265, 264, 306, 658, 198, 657, 463, 72, 300, 305,
            83, 198
        ]
    );
    assert_eq!(t.token_id(IM_START), Some(657));
    assert_eq!(t.token_id(IM_END), Some(658));
    let alt = TinyTokenizer::alt();
    assert_eq!(
        alt.encode("hello world"),
        [71, 68, 75, 75, 78, 220, 86, 78, 81, 75, 67]
    );
}

#[test]
fn generation_is_deterministic_and_current_files_are_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = tiny::standard_ladder(dir.path()).expect("ladder");
    let bytes: Vec<Vec<u8>> = first
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    // same bytes as the shared ladder written by another call
    for (i, b) in bytes.iter().enumerate() {
        assert_eq!(b, &std::fs::read(&ladder().1[i]).expect("read"), "file {i}");
    }
    let inode =
        |p: &PathBuf| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
    let before: Vec<u64> = first.iter().map(inode).collect();
    let again = tiny::standard_ladder(dir.path()).expect("ladder");
    let after: Vec<u64> = again.iter().map(inode).collect();
    assert_eq!(before, after, "current files must not be rewritten");

    // a stale file (wrong fingerprint) and a damaged one are rewritten
    let mut w = molt::gguf::GgufWriter::new();
    w.add(FINGERPRINT_KEY, "stale").expect("key");
    w.write(&first[0]).expect("write stale");
    std::fs::write(&first[1], b"garbage").expect("damage");
    let fixed = tiny::standard_ladder(dir.path()).expect("ladder");
    assert_eq!(std::fs::read(&fixed[0]).expect("read"), bytes[0]);
    assert_eq!(std::fs::read(&fixed[1]).expect("read"), bytes[1]);
    assert_eq!(inode(&fixed[2]), before[2]);
}

#[test]
fn write_model_accepts_custom_specs_and_rejects_bad_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec {
        arch: TinyArch::Qwen2,
        name: "tiny-f32".to_owned(),
        n_layer: 1,
        n_embd: 64,
        n_head: 2,
        n_head_kv: 1,
        n_ff: 96,
        n_ctx: 512,
        rope_base: 10_000.0,
        seed: 7,
        dtype: DType::F32,
    };
    let tok = TinyTokenizer::standard();
    let path = dir.path().join("f32.gguf");
    let n = tiny::write_model(&spec, &tok, &path).expect("write");
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.file_len(), n);
    let facts = ModelFacts::from_gguf(&f).expect("facts");
    assert_eq!(
        (facts.head_dim, facts.n_head_kv, facts.file_type),
        (32, 1, Some(0))
    );
    assert_eq!(facts.rope.freq_base, 10_000.0);
    assert_eq!(
        f.require_tensor("blk.0.attn_k.weight").expect("k").dims,
        [64, 32]
    );
    assert_eq!(
        f.require_tensor("output.weight").expect("out").ggml_type,
        GgmlType::F32
    );

    // another seed, other weights; same seed, same bytes
    let other = dir.path().join("seed8.gguf");
    tiny::write_model(
        &TinySpec {
            seed: 8,
            ..spec.clone()
        },
        &tok,
        &other,
    )
    .expect("write");
    assert_ne!(
        std::fs::read(&path).expect("a"),
        std::fs::read(&other).expect("b")
    );
    let same = dir.path().join("same.gguf");
    tiny::write_model(&spec, &tok, &same).expect("write");
    assert_eq!(
        std::fs::read(&path).expect("a"),
        std::fs::read(&same).expect("c")
    );

    for (bad, what) in [
        (
            TinySpec {
                n_head: 3,
                ..spec.clone()
            },
            "multiple of n_head",
        ),
        (
            TinySpec {
                n_head_kv: 3,
                n_head: 4,
                ..spec.clone()
            },
            "n_head_kv",
        ),
        (
            TinySpec {
                n_layer: 0,
                ..spec.clone()
            },
            "n_layer is 0",
        ),
        (
            TinySpec {
                n_embd: 66,
                n_head: 2,
                ..spec.clone()
            },
            "odd",
        ),
        (
            TinySpec {
                rope_base: f32::NAN,
                ..spec.clone()
            },
            "rope_base",
        ),
    ] {
        let e = tiny::write_model(&bad, &tok, dir.path().join("bad.gguf")).expect_err(what);
        assert!(matches!(e, TinyError::InvalidSpec { .. }), "{e:?}");
        assert!(e.to_string().contains(what), "{e}");
    }
    assert!(!dir.path().join("bad.gguf").exists());
}

#[test]
fn the_llama_family_is_written_with_its_own_keys_rope_and_no_biases() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = tiny::llama_ladder(dir.path()).expect("llama models");
    let facts: Vec<ModelFacts> = paths
        .iter()
        .map(|p| ModelFacts::from_gguf(&GgufFile::open(p).expect("open")).expect("facts"))
        .collect();
    for (f, p) in facts.iter().zip(&paths) {
        assert_eq!(f.architecture, "llama", "{}", p.display());
        assert_eq!(f.rope.kind, RopeKind::Norm, "{}", p.display());
        let g = GgufFile::open(p).expect("open");
        assert!(g.require_tensor("blk.0.attn_k.bias").is_err());
        assert!(g.require_tensor("blk.0.attn_k.weight").is_ok());
    }
    assert_eq!(
        (facts[0].n_head, facts[0].n_head_kv, facts[0].head_dim),
        (6, 2, 32)
    );
    assert_eq!(
        (facts[1].n_layer, facts[1].n_head_kv, facts[1].head_dim),
        (2, 2, 16)
    );
    // Both share the standard tokenizer, so they make a ladder with the qwen2 rungs' words.
    let a = TokenizerIdentity::from_gguf(&GgufFile::open(&paths[0]).unwrap()).unwrap();
    let b = TokenizerIdentity::from_gguf(&GgufFile::open(&paths[1]).unwrap()).unwrap();
    a.compare(&b).expect("one tokenizer");
    // The qwen2 specs keep their fingerprints: adding architectures regenerated nothing.
    let qwen = &tiny::standard_specs()[0];
    assert_eq!(qwen.arch, TinyArch::Qwen2);
    let as_llama = TinySpec {
        arch: TinyArch::Llama,
        ..qwen.clone()
    };
    let tok = TinyTokenizer::standard();
    assert_ne!(qwen.fingerprint(&tok), as_llama.fingerprint(&tok));
}
