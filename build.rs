//! Build script. llama.cpp itself is compiled by `llama-cpp-sys-2` (vendored in that crate, built
//! with cmake); this script records the build's facts so `molt-run --version` and the results
//! JSON can say which llama.cpp build produced a number, and lists the shipped projectors and
//! anchors that `molt-run` embeds (see `src/bin/molt-run/shipped.rs`).
use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let profile = std::env::var("PROFILE").unwrap_or_default();
    println!("cargo:rustc-env=MOLT_BUILD_PROFILE={profile}");
    shipped_projectors();
}

/// Writes `$OUT_DIR/shipped_projectors.rs`: one `(ladder, file name, bytes)` entry per shipped
/// projector, i.e. each `projectors/<ladder>/*.{dense,diagonal}.molt-proj` present at build
/// time (the variants a session uses by default; ablations are not embedded), and one per
/// anchor, `projectors/<ladder>/anchors/*.molt-anchor`. Empty lists when none has been fitted.
fn shipped_projectors() {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let dir = root.join("projectors");
    println!("cargo:rerun-if-changed={}", dir.display());
    let projectors = per_ladder(&dir, "", &[".dense.molt-proj", ".diagonal.molt-proj"]);
    let anchors = per_ladder(&dir, "anchors", &[".molt-anchor"]);
    let mut code = String::new();
    for (what, name, entries) in [
        ("projectors", "SHIPPED", projectors),
        ("anchors", "SHIPPED_ANCHORS", anchors),
    ] {
        let _ = writeln!(
            code,
            "/// Shipped {what} embedded at build time: (ladder, file name, bytes).\n\
             pub static {name}: &[(&str, &str, &[u8])] = &["
        );
        for (ladder, file, path) in &entries {
            let _ = writeln!(
                code,
                "    ({ladder:?}, {file:?}, include_bytes!({:?})),",
                path.display().to_string()
            );
        }
        code.push_str("];\n");
    }
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::write(Path::new(&out).join("shipped_projectors.rs"), code)
        .expect("writing shipped_projectors.rs");
}

/// `(ladder, file name, path)` of every file in `<dir>/<ladder>/<sub>/` whose name ends with
/// one of `suffixes`, sorted; each folder read is watched for changes.
fn per_ladder(
    dir: &Path,
    sub: &str,
    suffixes: &[&str],
) -> Vec<(String, String, std::path::PathBuf)> {
    let mut entries = Vec::new();
    for ladder in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = ladder.path().join(sub);
        if !path.is_dir() {
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        let ladder_name = ladder.file_name().to_string_lossy().into_owned();
        for f in std::fs::read_dir(&path).into_iter().flatten().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if suffixes.iter().any(|s| name.ends_with(s)) {
                entries.push((ladder_name.clone(), name, f.path()));
            }
        }
    }
    entries.sort();
    entries
}
