//! Shared fixtures: the tiny ladder (generated once per test process) and the real ladder
//! (present only after `molt-run fetch`).
#![allow(dead_code)]

use molt::ladder::{FetchOptions, Ladder, Manifest, fetch};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The tiny ladder's manifest: a big rung, its Q8_0 requantization (the precision route), and
/// a small rung with other head_dim and layer count (the size route).
pub const TINY_MANIFEST: &str = r#"
name = "tiny"
description = "random-weight qwen2 models for hermetic tests"
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
        molt::tiny::standard_ladder(&dir).expect("tiny models");
        let manifest_path = dir.join("tiny.toml");
        std::fs::write(&manifest_path, TINY_MANIFEST).expect("manifest");
        let m = Manifest::load(&manifest_path).expect("manifest parses");
        fetch::fetch(
            &m,
            &dir,
            &FetchOptions {
                quiet: true,
                threads: 2,
                ..FetchOptions::default()
            },
        )
        .expect("tiny fetch");
        Ladder::open(&manifest_path, &dir).expect("tiny ladder opens")
    })
}

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
