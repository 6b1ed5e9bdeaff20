//! Build script. llama.cpp itself is compiled by `llama-cpp-sys-2` (vendored in that crate, built
//! with cmake); this script only records the build's facts so `molt-run --version` and the
//! results JSON can say which llama.cpp build produced a number.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let profile = std::env::var("PROFILE").unwrap_or_default();
    println!("cargo:rustc-env=MOLT_BUILD_PROFILE={profile}");
}
