//! What this build was compiled for, and whether the CPU it runs on has it.
//!
//! Source builds target the CPU they are built on (`.cargo/config.toml` sets
//! `target-cpu=native`, which `llama-cpp-sys-2` turns into `GGML_NATIVE=ON` for llama.cpp). A
//! binary carried to another machine whose CPU lacks one of those instructions would otherwise
//! die of an illegal instruction somewhere deep in a kernel; [`check_cpu`] names the missing
//! feature instead, and the binary calls it before anything else. [`llama_system_info`] is
//! llama.cpp's own line (`AVX2 = 1 | AVX512 = 1 | …`), so a user can see what was built.

/// Calls the macro `$m` with the x86-64 features Molt checks, one list for what the build
/// requires and what the CPU has, so the two cannot drift apart.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_features {
    ($m:ident) => {
        $m!(
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "bmi1",
            "bmi2",
            "lzcnt",
            "avx512f",
            "avx512cd",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512vnni",
            "avx512bf16"
        )
    };
}

/// The CPU features this binary's Rust code was compiled to require, in the order a reader
/// expects them (older extensions first). Empty on targets other than x86-64.
#[must_use]
pub fn compiled_cpu_features() -> Vec<&'static str> {
    let mut on = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! push_if {
            ($($f:tt),*) => {$( if cfg!(target_feature = $f) { on.push($f); } )*};
        }
        x86_features!(push_if);
    }
    on
}

/// Whether the CPU running this process has `feature` (a `target_feature` name).
#[must_use]
pub fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! detect {
            ($($f:tt),*) => {
                match feature {
                    $( $f => std::arch::is_x86_feature_detected!($f), )*
                    _ => false,
                }
            };
        }
        x86_features!(detect)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        true
    }
}

/// A CPU that lacks instructions this build was compiled to use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this molt-run was built for a CPU with {} and this CPU lacks {}: rebuild from source on \
     this machine, or use a portable build (README, \"Portable build\")",
    compiled.join(", "),
    missing.join(", ")
)]
pub struct MissingCpuFeatures {
    /// Every feature the build requires.
    pub compiled: Vec<&'static str>,
    /// The ones this CPU does not have.
    pub missing: Vec<&'static str>,
}

/// Checks the features in `compiled` with `has`; the seam that lets a test stand in for a CPU.
///
/// # Errors
/// [`MissingCpuFeatures`] naming each feature `has` denies.
pub fn check_features(
    compiled: Vec<&'static str>,
    has: impl Fn(&str) -> bool,
) -> Result<(), MissingCpuFeatures> {
    let missing: Vec<&'static str> = compiled.iter().copied().filter(|f| !has(f)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(MissingCpuFeatures { compiled, missing })
    }
}

/// Checks that this CPU has every feature the build was compiled to require.
///
/// # Errors
/// [`MissingCpuFeatures`] naming each missing feature.
pub fn check_cpu() -> Result<(), MissingCpuFeatures> {
    check_features(compiled_cpu_features(), cpu_has)
}

/// llama.cpp's own system line (`CPU : SSE3 = 1 | … | AVX512 = 1 | …`) for this build.
#[must_use]
pub fn llama_system_info() -> String {
    super::backend();
    // SAFETY: llama_print_system_info takes no arguments and returns a pointer to a static,
    // NUL-terminated buffer owned by llama.cpp (valid until the next call; copied at once).
    let p = unsafe { llama_cpp_sys_2::llama_print_system_info() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: p is non-null and NUL-terminated (see above).
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_has_what_the_build_requires() {
        // The tests run on the machine that built them, so a failure here means the feature
        // table and the detector disagree.
        assert_eq!(check_cpu(), Ok(()));
    }

    #[test]
    fn a_missing_feature_is_named() {
        let err = check_features(vec!["avx2", "fma", "avx512f"], |f| f != "avx512f").unwrap_err();
        assert_eq!(err.missing, vec!["avx512f"]);
        let msg = err.to_string();
        assert!(msg.contains("lacks avx512f"), "{msg}");
        assert!(msg.contains("avx2, fma, avx512f"), "{msg}");
    }

    #[test]
    fn every_compiled_feature_is_one_the_detector_knows() {
        // A feature name the detector does not know would always read as missing.
        for f in compiled_cpu_features() {
            assert!(
                cpu_has(f),
                "{f} compiled in but not detected on the build machine"
            );
        }
    }

    #[test]
    fn llama_reports_its_build() {
        let line = llama_system_info();
        assert!(line.contains("CPU"), "{line}");
    }
}
