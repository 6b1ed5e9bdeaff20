//! Foundation checks on real llama.cpp execution: the KV mirror round trip, re-import,
//! parking (free and reload), and ladder loading errors. Each check runs on the tiny ladder
//! (hermetic) and again on the real ladder when it has been fetched.

mod common;

use molt::engine::{Context, ContextConfig, Model, ModelOptions, Sampler, SamplingParams};
use molt::kv::{KvSnapshot, ParseOptions};
use molt::ladder::{Ladder, RungInfo};

fn prompt_tokens(m: &Model) -> Vec<i32> {
    let t = m.tokenize("The quick brown fox explains memory pressure to the scheduler. fn main() { println!(\"hi\"); }", false).unwrap();
    assert!(t.len() > 8, "prompt too short: {t:?}");
    t
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Decodes a prompt, exports, and returns (ctx, blob, next token, reference logits after it).
fn reference(rung: &RungInfo) -> (std::sync::Arc<Model>, Vec<u8>, i32, Vec<f32>) {
    let model = Model::load(&rung.path, rung.name(), ModelOptions::default()).unwrap();
    let mut ctx = Context::new(model.clone(), common::cfg()).unwrap();
    let toks = prompt_tokens(&model);
    ctx.decode(&toks).unwrap();
    let next = Sampler::new(SamplingParams::greedy()).sample(ctx.logits());
    let blob = ctx.export_state().unwrap();
    ctx.decode(&[next]).unwrap();
    let logits = ctx.logits().to_vec();
    assert_eq!(ctx.n_past(), toks.len() + 1);
    (model, blob, next, logits)
}

fn roundtrip_checks(ladder: &Ladder) {
    for rung in &ladder.rungs {
        let (model, blob, next, ref_logits) = reference(rung);
        let snap = KvSnapshot::parse(&blob, ParseOptions::default()).unwrap();
        let stream = snap.single_stream().unwrap();
        assert_eq!(
            stream.n_layer(),
            rung.facts.n_layer as usize,
            "{}: layer count",
            rung.name()
        );
        let n = prompt_tokens(&model).len();
        assert_eq!(
            stream.positions(),
            (0..i32::try_from(n).unwrap()).collect::<Vec<_>>(),
            "{}: positions",
            rung.name()
        );
        assert_eq!(stream.layers[0].k.ncols(), rung.facts.kv_dim_k() as usize);
        assert!(
            stream.layers[0].k.iter().any(|x| *x != 0.0),
            "{}: K is all zero",
            rung.name()
        );
        // export -> parse -> serialize is byte-identical
        assert!(
            snap.to_bytes().unwrap() == blob,
            "{}: re-serialized blob differs",
            rung.name()
        );
        // unchanged re-import into a fresh context gives identical next-token logits
        let mut fresh = Context::new(model.clone(), common::cfg()).unwrap();
        fresh.import_state(&snap.to_bytes().unwrap()).unwrap();
        assert_eq!(fresh.n_past(), n);
        fresh.decode(&[next]).unwrap();
        let d = max_abs(fresh.logits(), &ref_logits);
        assert!(d == 0.0, "{}: re-import changed logits by {d}", rung.name());
        // a control: importing a blob whose V rows of two cells are swapped must change logits,
        // proving the comparison above can fail
        let mut swapped = snap.clone();
        for l in &mut swapped.single_stream_mut().unwrap().layers {
            let (r0, r1) = (l.v.row(0).to_owned(), l.v.row(n - 1).to_owned());
            l.v.row_mut(0).assign(&r1);
            l.v.row_mut(n - 1).assign(&r0);
        }
        fresh.import_state(&swapped.to_bytes().unwrap()).unwrap();
        fresh.decode(&[next]).unwrap();
        assert!(
            max_abs(fresh.logits(), &ref_logits) > 0.0,
            "{}: control did not change logits",
            rung.name()
        );
        drop(fresh);
        // parking: free the model (unmap), reload, re-import: identical
        let path = rung.path.clone();
        drop(model);
        let reloaded = Model::load(&path, rung.name(), ModelOptions::default()).unwrap();
        let mut ctx = Context::new(reloaded, common::cfg()).unwrap();
        ctx.import_state(&blob).unwrap();
        ctx.decode(&[next]).unwrap();
        let d = max_abs(ctx.logits(), &ref_logits);
        assert!(
            d == 0.0,
            "{}: reload + re-import changed logits by {d}",
            rung.name()
        );
    }
}

#[test]
fn tiny_kv_roundtrip_reimport_and_reload_are_exact() {
    roundtrip_checks(common::tiny_ladder());
}

#[test]
fn real_kv_roundtrip_reimport_and_reload_are_exact() {
    if let Some(l) = common::real_ladder() {
        roundtrip_checks(l);
    }
}

#[test]
fn tiny_ladder_shape_matches_the_real_one() {
    let l = common::tiny_ladder();
    let (big, q8, small) = (&l.rungs[0].facts, &l.rungs[1].facts, &l.rungs[2].facts);
    assert_ne!(big.head_dim, small.head_dim);
    assert_ne!(big.n_layer, small.n_layer);
    assert_eq!(big.head_dim, q8.head_dim);
    assert!(
        l.rungs[1].file_bytes < l.rungs[0].file_bytes,
        "Q8_0 rung should be smaller than F16"
    );
}

#[test]
fn ladder_refuses_rungs_with_different_tokenizers() {
    let dir = common::fixture_dir();
    let _ = common::tiny_ladder();
    let m = dir.join("mixed.toml");
    std::fs::write(&m, "name = \"mixed\"\n[[rung]]\nname = \"a\"\nfile = \"tiny-big.gguf\"\nsource = { local = {} }\n[[rung]]\nname = \"b\"\nfile = \"tiny-alt.gguf\"\nsource = { local = {} }\n").unwrap();
    let e = Ladder::open(&m, &dir).unwrap_err().to_string();
    assert!(
        e.contains("tiny-big.gguf") && e.contains("tiny-alt.gguf") && e.contains("tokenizer"),
        "{e}"
    );
}

#[test]
fn real_ladder_refuses_smollm_beside_qwen() {
    let Some(real) = common::real_ladder() else {
        return;
    };
    let Some(smol) = std::env::var_os("MOLT_SMOLLM").map(std::path::PathBuf::from) else {
        eprintln!("MOLT_SMOLLM not set; skipping the SmolLM2 tokenizer check");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&common::rung(real, "tier2").path, dir.path().join("q.gguf"))
        .unwrap();
    std::os::unix::fs::symlink(&smol, dir.path().join("s.gguf")).unwrap();
    let m = dir.path().join("mixed.toml");
    std::fs::write(&m, "name = \"mixed\"\n[[rung]]\nname = \"qwen\"\nfile = \"q.gguf\"\nsource = { local = {} }\n[[rung]]\nname = \"smol\"\nfile = \"s.gguf\"\nsource = { local = {} }\n").unwrap();
    let e = Ladder::open(&m, dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("q.gguf") && e.contains("s.gguf") && e.contains("tokenizer"),
        "{e}"
    );
}

#[test]
fn truncated_and_foreign_files_are_clear_errors() {
    let src = std::fs::read(common::tiny_file("tiny-small.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &src[..src.len() * 2 / 3]).unwrap();
    let e = Model::load(&cut, "cut", ModelOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cut.gguf") && e.to_lowercase().contains("trunc"),
        "{e}"
    );
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"PK\x03\x04 this is a zip, not a model").unwrap();
    let e = Model::load(&junk, "junk", ModelOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("junk.gguf"), "{e}");
}

#[test]
fn prompt_longer_than_context_is_refused_before_decoding() {
    use molt::session::{GenerateOptions, Prompt, Session, SessionError};
    let l = common::tiny_ladder().clone();
    let mut s = Session::new(
        l,
        ContextConfig {
            n_ctx: 64,
            n_batch: 64,
            n_threads: 2,
            ..ContextConfig::default()
        },
        "small",
    )
    .unwrap();
    let long = "word ".repeat(400);
    let e = s
        .generate(
            &Prompt::Text(long),
            &GenerateOptions::default(),
            &mut |_| {},
        )
        .unwrap_err();
    assert!(matches!(e, SessionError::PromptTooLong { .. }), "{e}");
    // the session still works afterwards
    let g = s
        .generate(
            &Prompt::Text("hello".into()),
            &GenerateOptions {
                max_tokens: 4,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert!(!g.tokens.is_empty() || g.stop == molt::session::StopReason::Eos);
}

#[test]
fn generate_streams_tokens_named_by_rung_on_every_tiny_rung() {
    use molt::session::{Event, GenerateOptions, Prompt, Session};
    for name in ["big", "big-q8", "small"] {
        let l = common::tiny_ladder().clone();
        let mut s = Session::new(l, common::cfg(), name).unwrap();
        let mut seen = Vec::new();
        let g = s
            .generate(
                &Prompt::User("hello there".into()),
                &GenerateOptions {
                    max_tokens: 12,
                    ..Default::default()
                },
                &mut |e| seen.push(e.clone()),
            )
            .unwrap();
        let toks: Vec<_> = seen
            .iter()
            .filter_map(|e| {
                if let Event::Token { rung, .. } = e {
                    Some(rung.clone())
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(toks.len(), g.tokens.len());
        assert!(toks.iter().all(|r| r == name));
        assert!(matches!(seen.last(), Some(Event::Done(_))));
        assert_eq!(g.rungs_used, vec![name.to_string()]);
    }
}

/// Issue 20, hole 8: a ladder whose rungs are one file (by name, or by two links to it) is
/// refused, and opening a ladder whose files are already hashed leaves the lock file alone.
#[test]
fn one_file_twice_is_refused_and_an_unchanged_lock_is_not_rewritten() {
    use std::os::unix::fs::MetadataExt;
    let big = common::tiny_file("tiny-big.gguf");
    let small = common::tiny_file("tiny-small.gguf");
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&big, dir.path().join("a.gguf")).unwrap();
    std::os::unix::fs::symlink(&big, dir.path().join("b.gguf")).unwrap();
    std::os::unix::fs::symlink(&small, dir.path().join("s.gguf")).unwrap();
    let manifest = |name: &str, files: [&str; 2]| {
        let m = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &m,
            format!(
                "name = \"{name}\"\n[[rung]]\nname = \"one\"\nfile = \"{}\"\nsource = {{ local = {{}} }}\n[[rung]]\nname = \"two\"\nfile = \"{}\"\nsource = {{ local = {{}} }}\n",
                files[0], files[1]
            ),
        )
        .unwrap();
        m
    };
    let e = Ladder::open(&manifest("same", ["a.gguf", "./a.gguf"]), dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("same file"), "{e}");
    let e = Ladder::open(&manifest("linked", ["a.gguf", "b.gguf"]), dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("same file"), "{e}");

    let m = manifest("fine", ["a.gguf", "s.gguf"]);
    Ladder::open(&m, dir.path()).unwrap();
    let lock = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".lock.json"))
        .expect("the first open writes a lock");
    let before = std::fs::metadata(&lock).unwrap();
    Ladder::open(&m, dir.path()).unwrap();
    let after = std::fs::metadata(&lock).unwrap();
    assert_eq!(
        (before.ino(), before.mtime_nsec()),
        (after.ino(), after.mtime_nsec()),
        "the lock was rewritten although nothing changed"
    );
}
