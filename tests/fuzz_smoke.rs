//! The fuzz targets' CI smoke, inside the normal release test run (CI builds once, so it cannot
//! build the `cargo fuzz` crate in `tests/fuzz/` as well).
//!
//! For every target in [`molt_testkit::TARGETS`] — the same entry points the `cargo fuzz`
//! targets call — it replays each committed corpus file (`tests/fuzz/corpus/<target>/`, the
//! seeds plus every crash a fuzzer found, kept as regression inputs), then feeds a bounded
//! number of inputs made by a deterministic, seeded mutator: bit flips, random bytes, cuts,
//! inserted and deleted runs, splices of two corpus files, and extreme integers written where a
//! header keeps its lengths and counts. Any panic fails the test and names the corpus file or
//! the mutant (written beside the build's target directory for `cargo fuzz run` to replay).
//!
//! `MOLT_FUZZ_SMOKE_ITERS` sets the mutants per target (default 20,000: well under a second each in a
//! release build). `cargo test --release --test fuzz_smoke -- --ignored write_seed_corpora`
//! rewrites the generated seeds (`seed-*` files; found crashes are kept).

#[path = "gguf_common/mod.rs"]
mod gguf_common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use molt_testkit::{TARGETS, Target};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Default number of mutants per target.
const DEFAULT_ITERS: usize = 20_000;
/// Mutants never grow past this many bytes (a parser's cost grows with its input; the smoke
/// is about shapes, not size).
const MAX_LEN: usize = 256 * 1024;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("corpus file"))
        })
        .collect()
}

/// Runs `input` through `target`; `Err` with the panic message if it panicked.
fn run(target: &Target, input: &[u8]) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(|| (target.run)(input))).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "non-string panic".into())
    })
}

/// Extreme values for length and count fields: the shapes of the GGUF header overflows
/// (llama.cpp CVE-2024-23496, CVE-2025-53630, CVE-2026-27940) and their neighbours.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    4,
    5,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    (1 << 61) + 1,
    1 << 62,
    1 << 63,
    u64::MAX - 7,
    u64::MAX - 1,
    u64::MAX,
];

/// One mutation of `data`, drawn from `rng`; `others` are the corpus for splices.
fn mutate_once(
    data: &mut Vec<u8>,
    rng: &mut ChaCha8Rng,
    others: &[(String, Vec<u8>)],
    offsets: &[usize],
) {
    let len = data.len();
    match rng.random_range(0..8u8) {
        0 if len > 0 => {
            let i = rng.random_range(0..len);
            data[i] ^= 1 << rng.random_range(0..8);
        }
        1 if len > 0 => {
            let i = rng.random_range(0..len);
            data[i] = rng.random();
        }
        2 if len > 0 => data.truncate(rng.random_range(0..len)),
        3 => {
            let at = rng.random_range(0..=len);
            let n = rng.random_range(1..=16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            data.splice(at..at, bytes);
        }
        4 if len > 1 => {
            let a = rng.random_range(0..len);
            let b = rng.random_range(a..=len.min(a + 64));
            data.drain(a..b);
        }
        5 if !others.is_empty() => {
            let other = &others[rng.random_range(0..others.len())].1;
            let cut = rng.random_range(0..=len);
            let from = rng.random_range(0..=other.len());
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
        }
        6 if len > 0 => {
            // An ASCII digit or JSON/TOML punctuation: text formats need text mutations.
            let i = rng.random_range(0..len);
            data[i] = *b"0123456789-.e\"{}[],:=#\n \\"
                .get(rng.random_range(0..26))
                .unwrap_or(&b'9');
        }
        _ => {
            let v = INTERESTING[rng.random_range(0..INTERESTING.len())];
            let wide = rng.random_bool(0.5);
            let bytes = if wide {
                v.to_le_bytes().to_vec()
            } else {
                (v as u32).to_le_bytes().to_vec()
            };
            let at = if !offsets.is_empty() && rng.random_bool(0.7) {
                offsets[rng.random_range(0..offsets.len())]
            } else {
                rng.random_range(0..=len)
            };
            if at + bytes.len() > data.len() {
                data.resize(at + bytes.len(), 0);
            }
            data[at..at + bytes.len()].copy_from_slice(&bytes);
        }
    }
    data.truncate(MAX_LEN);
}

fn iterations() -> usize {
    std::env::var("MOLT_FUZZ_SMOKE_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_ITERS)
}

/// A stable per-target seed, so every run of the smoke feeds the same mutants.
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn smoke(name: &str) {
    let target = molt_testkit::target(name).expect("a listed target");
    let files = corpus(name);
    assert!(!files.is_empty(), "{name}: empty corpus");
    for (file, bytes) in &files {
        if let Err(msg) = run(target, bytes) {
            panic!("{name}: corpus file {file} panics: {msg}");
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed_of(name));
    for i in 0..iterations() {
        let mut data = files[rng.random_range(0..files.len())].1.clone();
        for _ in 0..rng.random_range(1..=4) {
            mutate_once(&mut data, &mut rng, &files, target.header_offsets);
        }
        if let Err(msg) = run(target, &data) {
            let out = std::env::temp_dir().join(format!("molt-fuzz-smoke-{name}-{i}.bin"));
            let _ = std::fs::write(&out, &data);
            panic!(
                "{name}: mutant {i} panics: {msg}\n(input written to {}; replay with \
                 cargo +nightly fuzz run --fuzz-dir tests/fuzz {name} <that file>)",
                out.display()
            );
        }
    }
}

#[test]
fn every_target_has_a_smoke_test() {
    let here = include_str!("fuzz_smoke.rs");
    for t in TARGETS {
        assert!(
            here.contains(&format!("smoke(\"{}\")", t.name)),
            "target {} has no smoke test",
            t.name
        );
        assert!(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("tests/fuzz/fuzz_targets/{}.rs", t.name))
                .is_file(),
            "target {} has no cargo-fuzz target",
            t.name
        );
    }
}

#[test]
fn gguf() {
    smoke("gguf");
}

#[test]
fn kv_blob() {
    smoke("kv_blob");
}

#[test]
fn transplant_files() {
    smoke("transplant_files");
}

#[test]
fn ladder() {
    smoke("ladder");
}

#[test]
fn trace() {
    smoke("trace");
}

#[test]
fn prompt_file() {
    smoke("prompt_file");
}

#[test]
fn chat_request() {
    smoke("chat_request");
}

/// The generated seeds: what each parser accepts, built by Molt's own writers, and the
/// hostile shapes of the GGUF CVEs.
mod seeds {
    use super::gguf_common::{header, push_str, sample_bytes};
    use molt::kv::{CacheType, Cell, CellExt, KvSection, KvSnapshot, KvStream, LayerKv};
    use molt::transplant::anchor::Anchor;
    use molt::transplant::hidden::{HiddenFit, HiddenMap};
    use molt::transplant::project::identity_projector;
    use molt::transplant::projector::{RungBinding, TensorDtype};
    use molt::transplant::ridge::Affine;
    use molt::transplant::rope::RopeSpec;
    use ndarray::{Array1, Array2};

    type Seeds = Vec<(&'static str, Vec<u8>)>;

    fn tensor_info(v: &mut Vec<u8>, name: &str, dims: &[u64], ty: u32, offset: u64) {
        push_str(v, name);
        v.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            v.extend(d.to_le_bytes());
        }
        v.extend(ty.to_le_bytes());
        v.extend(offset.to_le_bytes());
    }

    fn tiny_model() -> Vec<u8> {
        let tok = molt::tiny::TinyTokenizer::train("fuzz", "the cat sat on the mat. ", 8);
        let spec = molt::tiny::TinySpec {
            arch: molt::tiny::TinyArch::Qwen2,
            name: "fuzz".into(),
            n_layer: 1,
            n_embd: 8,
            n_head: 2,
            n_head_kv: 1,
            n_ff: 8,
            n_ctx: 64,
            rope_base: 1e6,
            seed: 7,
            dtype: molt::tiny::DType::F16,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("fuzz.gguf");
        molt::tiny::write_model(&spec, &tok, &path).expect("tiny model");
        std::fs::read(path).expect("read")
    }

    pub fn gguf() -> Seeds {
        let mut out: Seeds = vec![
            ("seed-sample", sample_bytes()),
            ("seed-tiny-model", tiny_model()),
        ];
        // CVE-2024-23496 / CVE-2025-53630 / CVE-2026-27940 shapes: counts and lengths whose
        // products or sums overflow a size computation.
        out.push(("seed-cve-huge-tensor-count", header(u64::MAX, 0)));
        out.push(("seed-cve-huge-kv-count", header(0, u64::MAX)));
        out.push(("seed-cve-counts-2p61", header(1 << 61, 1 << 61)));
        let mut v = header(0, 1);
        v.extend((u64::MAX).to_le_bytes()); // key length u64::MAX (len + 1 overflows)
        out.push(("seed-cve-key-len-max", v));
        let mut v = header(0, 1);
        push_str(&mut v, "general.name");
        v.extend(8u32.to_le_bytes());
        v.extend((u64::MAX - 1).to_le_bytes()); // string value length
        v.extend(b"abc");
        out.push(("seed-cve-string-len-max", v));
        for (name, elem, n) in [
            ("seed-cve-array-u64-overflow", 10u32, (1u64 << 61) + 1), // n * 8 wraps
            ("seed-cve-array-u32-overflow", 4, (1 << 62) + 1),        // n * 4 wraps
            ("seed-cve-array-str-huge", 8, 1 << 60),
            ("seed-cve-array-len-max", 0, u64::MAX),
        ] {
            let mut v = header(0, 1);
            push_str(&mut v, "tokenizer.ggml.tokens");
            v.extend(9u32.to_le_bytes());
            v.extend(elem.to_le_bytes());
            v.extend(n.to_le_bytes());
            v.extend([0u8; 64]);
            out.push((name, v));
        }
        let mut v = header(0, 1);
        push_str(&mut v, "nested");
        v.extend(9u32.to_le_bytes());
        v.extend(9u32.to_le_bytes()); // array of arrays
        v.extend(2u64.to_le_bytes());
        v.extend(9u32.to_le_bytes());
        v.extend(u64::MAX.to_le_bytes());
        out.push(("seed-cve-nested-array", v));
        // ggml type ids: F16 = 1, Q4_0 = 2.
        let (f16, q4_0) = (1u32, 2u32);
        for (name, dims, ty, offset) in [
            (
                "seed-cve-dims-product-overflow",
                vec![1u64 << 32, 1 << 32, 1 << 32, 1],
                f16,
                0u64,
            ),
            ("seed-cve-dims-bytes-overflow", vec![1u64 << 62, 1], f16, 0),
            ("seed-cve-dim-max", vec![u64::MAX], f16, 0),
            ("seed-cve-dim-zero", vec![0, 4], f16, 0),
            (
                "seed-cve-q4-blocks-overflow",
                vec![(u64::MAX / 32) * 32, 1],
                q4_0,
                0,
            ),
            ("seed-cve-q4-unaligned-row", vec![33, 2], q4_0, 0),
            ("seed-cve-offset-overflow", vec![4], f16, u64::MAX - 3),
            ("seed-cve-offset-unaligned", vec![4], f16, 3),
            ("seed-cve-too-many-dims", vec![1, 1, 1, 1, 1], f16, 0),
        ] {
            let mut v = header(1, 0);
            tensor_info(&mut v, "t", &dims, ty, offset);
            v.resize(v.len().next_multiple_of(32) + 64, 0);
            out.push((name, v));
        }
        // n_dims itself huge, and a type id past the table.
        let mut v = header(1, 0);
        push_str(&mut v, "t");
        v.extend(u32::MAX.to_le_bytes());
        v.extend([0u8; 64]);
        out.push(("seed-cve-n-dims-max", v));
        let mut v = header(1, 0);
        tensor_info(&mut v, "t", &[4], u32::MAX, 0);
        v.extend([0u8; 64]);
        out.push(("seed-cve-type-max", v));
        // Two tensors whose sizes sum past u64, and two overlapping at the same offset.
        let mut v = header(2, 0);
        tensor_info(&mut v, "a", &[1 << 62], f16, 0);
        tensor_info(&mut v, "b", &[1 << 62], f16, 1 << 63);
        v.extend([0u8; 64]);
        out.push(("seed-cve-size-sum-overflow", v));
        let mut v = header(2, 0);
        tensor_info(&mut v, "a", &[4], f16, 0);
        tensor_info(&mut v, "a", &[4], f16, 0);
        v.resize(v.len().next_multiple_of(32) + 32, 0);
        out.push(("seed-duplicate-tensor", v));
        // An alignment that is zero, and one that is not a power of two.
        for (name, align) in [("seed-alignment-zero", 0u32), ("seed-alignment-odd", 3)] {
            let mut v = header(1, 1);
            push_str(&mut v, "general.alignment");
            v.extend(4u32.to_le_bytes());
            v.extend(align.to_le_bytes());
            tensor_info(&mut v, "t", &[4], f16, 0);
            v.extend([0u8; 64]);
            out.push((name, v));
        }
        out
    }

    fn stream(
        n_layer: usize,
        cells: usize,
        width: usize,
        ty: CacheType,
        ext: bool,
        v_trans: bool,
        has_v: bool,
    ) -> KvStream {
        KvStream {
            cells: (0..cells)
                .map(|p| Cell {
                    pos: p as i32,
                    seq_ids: vec![0],
                    ext: ext.then_some(CellExt { x: 1, y: 2, tok: 3 }),
                })
                .collect(),
            v_trans,
            n_rot_k: 0,
            n_rot_v: 0,
            has_v,
            layers: (0..n_layer)
                .map(|l| LayerKv {
                    k: Array2::from_shape_fn((cells, width), |(i, j)| {
                        (l + i * width + j) as f32 * 0.25
                    }),
                    v: Array2::from_shape_fn((cells, if has_v { width } else { 0 }), |(i, j)| {
                        -((i + j) as f32)
                    }),
                    k_type: ty,
                    v_type: ty,
                })
                .collect(),
        }
    }

    pub fn kv_states() -> Vec<(&'static str, KvSnapshot)> {
        let one = |s| KvSnapshot::from_single_stream(0, s);
        vec![
            (
                "seed-f16-vtrans",
                one(stream(2, 3, 8, CacheType::F16, false, true, true)),
            ),
            (
                "seed-f32-rows",
                one(stream(1, 2, 4, CacheType::F32, false, false, true)),
            ),
            (
                "seed-bf16",
                one(stream(1, 2, 4, CacheType::BF16, false, true, true)),
            ),
            (
                "seed-cell-ext",
                one(stream(1, 2, 4, CacheType::F16, true, true, true)),
            ),
            (
                "seed-no-v",
                one(stream(2, 2, 4, CacheType::F16, false, false, false)),
            ),
            (
                "seed-empty",
                one(stream(1, 0, 4, CacheType::F16, false, true, true)),
            ),
            (
                "seed-two-sections",
                KvSnapshot {
                    seq_id: 3,
                    sections: vec![
                        KvSection {
                            streams: vec![
                                Some(stream(1, 2, 4, CacheType::F16, false, true, true)),
                                None,
                            ],
                        },
                        KvSection {
                            streams: vec![Some(stream(1, 1, 4, CacheType::F16, false, true, true))],
                        },
                    ],
                },
            ),
        ]
    }

    pub fn kv_blob() -> Seeds {
        let mut out: Seeds = kv_states()
            .into_iter()
            .map(|(n, s)| (n, s.to_bytes().expect("encode")))
            .collect();
        // A header with huge stream and cell counts.
        let mut v = molt::kv::IO_MAGIC.to_le_bytes().to_vec();
        v.extend(0i32.to_le_bytes());
        v.extend(u32::MAX.to_le_bytes());
        v.extend(u32::MAX.to_le_bytes());
        out.push(("seed-huge-counts", v));
        out
    }

    fn binding(name: &str, sha: char, n_layer: usize) -> RungBinding {
        RungBinding {
            name: name.into(),
            file: format!("{name}.gguf"),
            sha256: sha.to_string().repeat(64),
            n_layer,
            n_kv_heads: 1,
            head_dim: 4,
            rope: RopeSpec::neox(4, 1e6),
        }
    }

    pub fn transplant_files() -> Seeds {
        let big = binding("big", 'a', 3);
        let small = binding("small", 'b', 2);
        let ident = identity_projector(&small);
        let trunc = molt::routes::truncate_projector(&big, &small);
        let hidden = HiddenMap {
            src: big.clone(),
            dst: small.clone(),
            k: 1,
            src_layer: 1,
            affine: Affine {
                w: Array2::from_shape_fn((3, 2), |(i, j)| (i * 2 + j) as f32),
                b: Array1::from_vec(vec![0.5, -0.5]),
            },
            fit: HiddenFit {
                lambda: 1.0,
                train_rel_rms: 0.1,
                held_out_rel_rms: 0.2,
                rows: 10,
            },
        };
        let state =
            KvSnapshot::from_single_stream(0, stream(2, 3, 4, CacheType::F16, false, true, true))
                .to_bytes()
                .expect("encode");
        let anchor = Anchor {
            rung: "small".into(),
            file: "small.gguf".into(),
            sha256: small.sha256.clone(),
            tokens: vec![1, 2, 3],
            state,
        };
        vec![
            (
                "seed-projector-identity-f32",
                ident.to_bytes(TensorDtype::F32).expect("proj"),
            ),
            (
                "seed-projector-identity-f16",
                ident.to_bytes(TensorDtype::F16).expect("proj"),
            ),
            (
                "seed-projector-truncate",
                trunc.to_bytes(TensorDtype::F32).expect("proj"),
            ),
            ("seed-hidden-map", hidden.to_bytes().expect("hmap")),
            ("seed-anchor", anchor.to_bytes().expect("anchor")),
        ]
    }

    pub fn ladder() -> Seeds {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = std::fs::read(root.join("models/qwen2.5-coder.toml")).expect("manifest");
        let lock = serde_json::json!({"files": {
            "a.gguf": {"size": 1117320768u64, "mtime_ns": 1_700_000_000_000_000_000u128, "sha256": "ab".repeat(32)},
            "b.gguf": {"size": 0, "mtime_ns": 0, "sha256": ""}
        }});
        let tiny = "name = \"tiny\"\n\n[[rung]]\nname = \"big\"\nfile = \"big.gguf\"\nsource = { local = {} }\n\n[[rung]]\nname = \"small\"\nfile = \"small.gguf\"\nsha256 = \"".to_string()
            + &"0".repeat(64)
            + "\"\nsource = { requantize = { from = \"big\", type = \"Q2_K\" } }\n";
        vec![
            ("seed-manifest", manifest),
            ("seed-manifest-tiny", tiny.into_bytes()),
            ("seed-lock", serde_json::to_vec_pretty(&lock).expect("json")),
        ]
    }

    pub fn trace() -> Seeds {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
        let mut out = Vec::new();
        for (name, file) in [
            ("seed-spike-mid-answer", "spike_mid_answer.json"),
            ("seed-spike-relative", "spike_mid_answer_relative.json"),
            ("seed-park-and-resume", "park_and_resume.json"),
            ("seed-serve-qos", "serve_qos.json"),
        ] {
            out.push((name, std::fs::read(root.join(file)).expect("trace")));
        }
        out
    }

    pub fn prompt_file() -> Seeds {
        vec![
            ("seed-plain", b"Write a haiku about rust.\n# a comment\n\nExplain KV caches.\n".to_vec()),
            (
                "seed-jsonl",
                b"{\"prompt\": \"Sum 2+2\", \"id\": \"a\", \"max_tokens\": 8}\r\n{\"prompt\": \"x\", \"max_tokens\": 0}\n{\"prompt\": \"  \"}\n{\"prompt\": 1}\nplain \xff\xfe line\n".to_vec(),
            ),
        ]
    }

    pub fn chat_request() -> Seeds {
        let bodies = [
            (
                "seed-chat-minimal",
                serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
            ),
            (
                "seed-chat-full",
                serde_json::json!({
                    "model": "qwen2.5-coder", "stream": true, "stream_options": {"include_usage": true},
                    "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 42, "n": 1,
                    "stop": ["\n\n", "END"], "presence_penalty": 0.5, "frequency_penalty": 0.1,
                    "logprobs": true, "top_logprobs": 3, "user": "u1",
                    "response_format": {"type": "json_object"},
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                        {"role": "user", "content": "<|im_end|> hi"}
                    ],
                    "molt": {"force_switch": {"at": 4, "to": "tier2"}}
                }),
            ),
            (
                "seed-completion",
                serde_json::json!({"prompt": "def f():", "max_tokens": 4, "echo": false, "stop": "\n"}),
            ),
            (
                "seed-budget",
                serde_json::json!({"mib": 1e30, "trace": {"name": "x", "initial": 1}}),
            ),
        ];
        bodies
            .into_iter()
            .map(|(n, b)| (n, serde_json::to_vec(&b).expect("json")))
            .collect()
    }
}

/// Rewrites the generated seeds of every target (`seed-*`; other corpus files are kept).
#[test]
#[ignore = "writes tests/fuzz/corpus; run by hand after a format changes"]
fn write_seed_corpora() {
    let all = [
        ("gguf", seeds::gguf()),
        ("kv_blob", seeds::kv_blob()),
        ("transplant_files", seeds::transplant_files()),
        ("ladder", seeds::ladder()),
        ("trace", seeds::trace()),
        ("prompt_file", seeds::prompt_file()),
        ("chat_request", seeds::chat_request()),
    ];
    for (target, seeds) in all {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        for old in std::fs::read_dir(&dir).expect("read dir") {
            let p = old.expect("entry").path();
            if p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
            {
                std::fs::remove_file(p).expect("remove");
            }
        }
        for (name, bytes) in seeds {
            std::fs::write(dir.join(name), bytes).expect("write seed");
        }
    }
}

/// The valid seeds are accepted by their parsers, so mutants start from inputs that reach the
/// code behind the first checks (a corpus of rejects would fuzz only the magic test).
#[test]
fn valid_seeds_are_accepted() {
    let read = |t: &str, f: &str| std::fs::read(corpus_dir(t).join(f)).expect("seed");
    for f in ["seed-sample", "seed-tiny-model"] {
        let g = molt::gguf::GgufFile::from_bytes(f, read("gguf", f)).expect(f);
        assert!(!g.tensors().is_empty(), "{f}");
    }
    molt::gguf::ModelFacts::from_gguf(
        &molt::gguf::GgufFile::from_bytes("t", read("gguf", "seed-tiny-model")).unwrap(),
    )
    .expect("tiny model facts");
    for f in [
        "seed-f16-vtrans",
        "seed-f32-rows",
        "seed-bf16",
        "seed-empty",
    ] {
        molt::kv::KvSnapshot::parse(&read("kv_blob", f), molt::kv::ParseOptions::default())
            .expect(f);
    }
    let p = Path::new("x");
    for f in ["seed-projector-identity-f32", "seed-projector-truncate"] {
        molt::transplant::projector::Projector::from_bytes(&read("transplant_files", f), p)
            .expect(f);
    }
    let (a, b) = ("a".repeat(64), "b".repeat(64));
    molt::transplant::hidden::HiddenMap::from_bytes(
        &read("transplant_files", "seed-hidden-map"),
        p.into(),
        &a,
        &b,
    )
    .expect("hidden map");
    molt::transplant::anchor::Anchor::from_bytes(
        &read("transplant_files", "seed-anchor"),
        p.into(),
        &b,
    )
    .expect("anchor");
    for f in ["seed-manifest", "seed-manifest-tiny"] {
        let text = String::from_utf8(read("ladder", f)).unwrap();
        molt::ladder::Manifest::parse(&text, p).expect(f);
    }
    assert_eq!(
        molt::ladder::Lock::from_bytes(&read("ladder", "seed-lock"))
            .files
            .len(),
        2
    );
    let text = String::from_utf8(read("trace", "seed-spike-mid-answer")).unwrap();
    molt::pressure::Trace::parse(&text).expect("trace");
    let f = molt::session::prompt_file::parse(&read("prompt_file", "seed-jsonl"));
    assert_eq!((f.items.len(), f.bad.len()), (1, 4));
    for f in ["seed-chat-minimal", "seed-chat-full"] {
        serde_json::from_slice::<molt_server::openai::ChatRequest>(&read("chat_request", f))
            .expect(f)
            .validate()
            .expect(f);
    }
    serde_json::from_slice::<molt_server::completions::CompletionRequest>(&read(
        "chat_request",
        "seed-completion",
    ))
    .expect("completion")
    .validate()
    .expect("completion");
}
