//! Shared fixtures: the tiny ladder (generated once per test process), its fitted projectors,
//! the contexts the tests run the tiny models in, and the real ladder (present only after
//! `molt-run fetch`).
#![allow(dead_code)]

pub mod events;

use molt::engine::{ContextConfig, Token};
use molt::ladder::Ladder;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The tiny ladder's manifest: a big rung, its Q8_0 requantization (the precision route), and
/// a small rung with other head_dim and layer count (the size route).
pub const TINY_MANIFEST: &str = molt::tiny::TINY_MANIFEST;

/// A directory under target/ for generated fixtures (kept between runs: generation is
/// deterministic and skipped when current).
pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("molt-tiny")
}

/// The tiny ladder, generated and fetched once per process.
pub fn tiny_ladder() -> &'static Ladder {
    static L: OnceLock<Ladder> = OnceLock::new();
    L.get_or_init(|| {
        let dir = fixture_dir();
        let manifest_path = molt::tiny::ladder(&dir).expect("tiny ladder");
        Ladder::open(&manifest_path, &dir).expect("tiny ladder opens")
    })
}

/// The llama-architecture tiny ladder (normal RoPE, no projection biases, other head counts):
/// `big` and `small`, generated once per process.
pub fn llama_ladder() -> &'static Ladder {
    static L: OnceLock<Ladder> = OnceLock::new();
    L.get_or_init(|| {
        let dir = fixture_dir();
        molt::tiny::llama_ladder(&dir).expect("tiny llama models");
        let manifest_path = dir.join("tiny-llama.toml");
        std::fs::write(&manifest_path, LLAMA_MANIFEST).expect("manifest");
        Ladder::open(&manifest_path, &dir).expect("tiny llama ladder opens")
    })
}

/// The llama ladder's manifest.
pub const LLAMA_MANIFEST: &str = r#"
name = "tiny-llama"
description = "random-weight llama models for hermetic tests"
[[rung]]
name = "big"
file = "tiny-llama-big.gguf"
source = { local = {} }
[[rung]]
name = "small"
file = "tiny-llama-small.gguf"
source = { local = {} }
"#;

/// Path of a tiny model file.
pub fn tiny_file(name: &str) -> PathBuf {
    let _ = tiny_ladder();
    fixture_dir().join(name)
}

/// The real ladder, if fetched. With `MOLT_REQUIRE_LADDER=1` (CI) its absence is a failure.
pub fn real_ladder() -> Option<&'static Ladder> {
    static L: OnceLock<Option<Ladder>> = OnceLock::new();
    L.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = root.join("models/qwen2.5-coder.toml");
        let dir = std::env::var_os("MOLT_HOME")
            .map_or_else(|| root.join("models"), |h| PathBuf::from(h).join("models"));
        match Ladder::open(&manifest, &dir) {
            Ok(l) => Some(l),
            Err(e) => {
                assert!(
                    std::env::var_os("MOLT_REQUIRE_LADDER").is_none(),
                    "MOLT_REQUIRE_LADDER is set but the real ladder is not usable: {e}"
                );
                eprintln!("real ladder not fetched ({e}); skipping real-ladder checks");
                None
            }
        }
    })
    .as_ref()
}

/// A rung of `l` by name. Real-ladder tests address rungs by name: the shipped ladder's
/// indices move whenever a rung is added (the Q3_K_M rung went in at index 1).
pub fn rung<'a>(l: &'a Ladder, name: &str) -> &'a molt::ladder::RungInfo {
    l.rung(name)
        .unwrap_or_else(|| panic!("ladder {} has no rung {name}: {:?}", l.name(), l.names()))
}

/// A context for the tiny models: `n_ctx` tokens, decoded `n_batch` at a time on two threads.
pub fn context(n_ctx: u32, n_batch: u32) -> ContextConfig {
    ContextConfig {
        n_ctx,
        n_batch,
        n_threads: 2,
        ..ContextConfig::default()
    }
}

/// The usual tiny-model context: 512 tokens in batches of 128.
pub fn cfg() -> ContextConfig {
    context(512, 128)
}

/// Room for a history, its answer and a switch: 1024 tokens in batches of 256. The tiny
/// projectors are fitted with it.
pub fn cfg_long() -> ContextConfig {
    context(1024, 256)
}

/// The service's tests: [`cfg_long`] on one thread (see [`one_thread`]).
pub fn cfg_server() -> ContextConfig {
    one_thread(cfg_long())
}

/// The conditions benchmark's tests: 512 tokens in batches of 256, one thread (see
/// [`one_thread`]).
pub fn cfg_conditions() -> ContextConfig {
    one_thread(context(512, 256))
}

/// The top-k recompute tests: 512 tokens in batches of 256, the hidden-state tap on.
pub fn cfg_topk() -> ContextConfig {
    ContextConfig {
        hidden_tap: true,
        ..context(512, 256)
    }
}

/// `c` on one thread: on a shared 2-core machine under load, ggml's two-thread barrier
/// collapses tiny-model decode from hundreds of tokens/s to a few, and a tiny model gains
/// nothing from a second thread.
pub fn one_thread(c: ContextConfig) -> ContextConfig {
    ContextConfig { n_threads: 1, ..c }
}

/// What the tiny projectors and hidden maps are fitted on: the first 1600 tokens of the
/// project's corpus (`projectors/corpus`), as the tiny big rung tokenizes it.
pub fn tiny_corpus_tokens() -> Vec<Token> {
    corpus_tokens(tiny_ladder())
}

/// The first 1600 tokens of the project's corpus as `l`'s largest rung tokenizes it.
pub fn corpus_tokens(l: &Ladder) -> Vec<Token> {
    use molt::engine::{Model, ModelOptions};
    use molt::train::read_corpus;
    let corpus = read_corpus(&Path::new(env!("CARGO_MANIFEST_DIR")).join("projectors/corpus"))
        .expect("corpus");
    let model = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).expect("big");
    let mut tokens = model.tokenize(&corpus, false).expect("tokenize");
    tokens.truncate(1600);
    tokens
}

/// Fits the tiny ladder's projectors (every ordered route, the automatic variant) into
/// `out/tiny/`: what [`tiny_projectors`] holds, and what a test of the fit itself fits.
pub fn fit_tiny_projectors(out: &Path) -> molt::train::TrainReport {
    fit_projectors(tiny_ladder(), out)
}

/// Fits `l`'s projectors as [`fit_tiny_projectors`] fits the tiny ladder's, into
/// `out/<ladder>/`.
pub fn fit_projectors(l: &Ladder, out: &Path) -> molt::train::TrainReport {
    use molt::routes::Variant;
    use molt::train::{TrainOptions, fit_ladder};
    use molt::transplant::projector::TensorDtype;
    fit_ladder(
        l,
        cfg_long(),
        &corpus_tokens(l),
        &TrainOptions {
            window: 128,
            held_out_every: 4,
            variants: vec![Variant::Auto],
            dtype: TensorDtype::F32,
            out_dir: out.to_path_buf(),
            skip_head: 0,
            restore_spread: false,
        },
        &mut |_| {},
    )
    .expect("fitting tiny projectors")
}

/// The tiny ladder's fitted projectors (`<dir>/tiny/*.molt-proj`), fitted once and reused while
/// every route still loads against the current tiny files (generation is deterministic).
pub fn tiny_projectors() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| projectors_of(tiny_ladder()))
}

/// The llama ladder's fitted projectors, as [`tiny_projectors`].
pub fn llama_projectors() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| projectors_of(llama_ladder()))
}

/// `l`'s projectors under the fixture directory, fitted unless every route already loads
/// against the current files.
fn projectors_of(l: &Ladder) -> PathBuf {
    use molt::routes::{Routes, Variant};
    let out = fixture_dir().join("projectors");
    let n = l.rungs.len();
    let mut routes = Routes::new(l, vec![out.clone()], Variant::Auto);
    let current = (0..n)
        .flat_map(|i| (0..n).map(move |j| (i, j)))
        .filter(|(i, j)| i != j)
        .all(|(i, j)| routes.get(i, j).is_ok());
    if !current {
        fit_projectors(l, &out);
    }
    out
}

/// Rows of every layer's K and V at position `pos` in a one-sequence state blob (llama.cpp's
/// export of one sequence), in layer order, K then V.
pub fn kv_rows_at(blob: &[u8], pos: i32) -> Vec<f32> {
    let (_, stream) = molt::kv::KvSnapshot::parse_single_stream(blob).unwrap();
    let i = stream
        .positions()
        .iter()
        .position(|&p| p == pos)
        .unwrap_or_else(|| panic!("position {pos} not cached"));
    stream
        .layers
        .iter()
        .flat_map(|l| l.k.row(i).to_vec().into_iter().chain(l.v.row(i).to_vec()))
        .collect()
}

/// A row of a speed measurement (`bench --speed --tune`) of `rung` at micro-batch 128: its
/// prefill rate and the anonymous memory its load took, the other figures fixed.
pub fn speed_row(
    rung: &str,
    repack: bool,
    prefill: f64,
    load_anon_mib: f64,
) -> molt_bench::speed::PeerRow {
    molt_bench::speed::PeerRow {
        rung: rung.into(),
        n_ubatch: 128,
        repack,
        prefill_tok_s: prefill,
        decode_tok_s: 50.0,
        peer_prefill_tok_s: prefill,
        peer_decode_tok_s: 50.0,
        prefill_ratio: 1.0,
        decode_ratio: 1.0,
        samples: vec![],
        reserved_mib: 10.0,
        load_anon_mib,
    }
}

/// `target/<profile>`: this test binary lives in its `deps/`.
pub fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// The `molt-run` binary of this build (`target/<profile>/molt-run`), built by the workspace's
/// `cargo build` / `cargo test` (it lives in the `molt-run` crate beside this one).
///
/// # Panics
/// When it has not been built: `cargo build --release -p molt-run` (the test script does).
pub fn molt_run() -> PathBuf {
    let path = target_profile_dir().join(format!("molt-run{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --release -p molt-run` (scripts/test.sh does)",
        path.display()
    );
    path
}
