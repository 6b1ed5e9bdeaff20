//! Build script. llama.cpp itself is compiled by `llama-cpp-sys-2` (vendored in that crate, built
//! with cmake); this script records the build's facts so `molt-run --version` and the results
//! JSON can say which llama.cpp build produced a number, and lists the shipped projectors that
//! `molt-run` embeds (see `src/bin/molt-run/shipped.rs`).
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
/// time (the variants a session uses by default; ablations are not embedded). An empty list
/// when none has been fitted yet.
fn shipped_projectors() {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let dir = root.join("projectors");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut entries: Vec<(String, String, std::path::PathBuf)> = Vec::new();
    for ladder in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let path = ladder.path();
        if !path.is_dir() {
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        let ladder_name = ladder.file_name().to_string_lossy().into_owned();
        for f in std::fs::read_dir(&path).into_iter().flatten().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.ends_with(".dense.molt-proj") || name.ends_with(".diagonal.molt-proj") {
                entries.push((ladder_name.clone(), name, f.path()));
            }
        }
    }
    entries.sort();
    let mut code = String::from(
        "/// Shipped projectors embedded at build time: (ladder, file name, bytes).\n\
         pub static SHIPPED: &[(&str, &str, &[u8])] = &[\n",
    );
    for (ladder, name, path) in &entries {
        let _ = writeln!(
            code,
            "    ({ladder:?}, {name:?}, include_bytes!({:?})),",
            path.display().to_string()
        );
    }
    code.push_str("];\n");
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::write(Path::new(&out).join("shipped_projectors.rs"), code)
        .expect("writing shipped_projectors.rs");
}
