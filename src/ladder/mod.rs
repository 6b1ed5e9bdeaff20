//! The ladder: rungs of one model family, largest first, that share a tokenizer.
//!
//! Main types: [`Manifest`] (the TOML that names the rungs and their sources), [`Ladder`] (an
//! opened manifest whose files exist, with every rung's GGUF facts read *before* any weights
//! are loaded, and its tokenizer checked against the first rung's), and `fetch()`, which
//! downloads, assembles, verifies and builds the files.
//!
//! Sharing a tokenizer is what makes a between-tokens migration meaningful at all: the token
//! ids already generated must mean the same text on the destination. The check compares the
//! vocabulary, merges, token types and special ids, not just the vocabulary size.

pub mod fetch;
pub mod init;
mod lock;
pub mod manifest;
pub mod search;

pub use fetch::{FetchError, FetchOptions, FetchProgress, FetchedRung, ProgressUnit};
pub use lock::{Lock, sha256_file};
pub use manifest::{Manifest, ManifestError, RungSpec, Source};

use crate::gguf::{GgufFile, ModelFacts, TokenizerIdentity};
use std::path::{Path, PathBuf};

/// Errors opening a ladder.
#[derive(Debug, thiserror::Error)]
pub enum LadderError {
    /// The manifest is unreadable or invalid.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// A rung's file is missing.
    #[error("rung {rung}: {path} is missing — run `molt-run fetch --ladder {ladder}` first")]
    Missing {
        /// Rung name.
        rung: String,
        /// Expected path.
        path: PathBuf,
        /// Ladder name or manifest path.
        ladder: String,
    },
    /// Two rungs are one file (through a symlink or another spelling of its path).
    #[error("rungs {a} and {b} are the same file {path}: a ladder's rungs are different models")]
    SameFile {
        /// The earlier rung.
        a: String,
        /// The later rung.
        b: String,
        /// The file both resolve to.
        path: PathBuf,
    },
    /// A rung's file is not a valid GGUF (truncated, foreign, corrupt).
    #[error("rung {rung}: {source}")]
    Gguf {
        /// Rung name.
        rung: String,
        /// The reader's error.
        source: crate::gguf::GgufError,
    },
    /// Two rungs do not share a tokenizer.
    #[error(
        "rungs {a} ({a_file}) and {b} ({b_file}) do not share a tokenizer: {reason}. A ladder's rungs must tokenize identically, or a migration would change the meaning of the tokens already generated"
    )]
    TokenizerMismatch {
        /// First rung.
        a: String,
        /// Its file.
        a_file: String,
        /// Second rung.
        b: String,
        /// Its file.
        b_file: String,
        /// Precise difference.
        reason: String,
    },
    /// The file's hash does not match the manifest.
    #[error("rung {rung}: {path} has sha256 {actual}, the manifest expects {expected}")]
    HashMismatch {
        /// Rung name.
        rung: String,
        /// File.
        path: PathBuf,
        /// Expected.
        expected: String,
        /// Found.
        actual: String,
    },
    /// An architecture Molt cannot transplant between.
    #[error("rung {rung}: {message}")]
    Unsupported {
        /// Rung name.
        rung: String,
        /// Why.
        message: String,
    },
    /// I/O.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Error.
        source: std::io::Error,
    },
}

/// One rung of an opened ladder: where its file is and what it is, before any weights load.
#[derive(Debug, Clone)]
pub struct RungInfo {
    /// Position in the ladder (0 = largest).
    pub index: usize,
    /// The manifest entry.
    pub spec: RungSpec,
    /// The GGUF file.
    pub path: PathBuf,
    /// Architecture facts read from the GGUF metadata.
    pub facts: ModelFacts,
    /// sha256 of the file (binds projectors to it).
    pub sha256: String,
    /// File size in bytes.
    pub file_bytes: u64,
}

impl RungInfo {
    /// The rung's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }
}

/// An opened ladder.
#[derive(Debug, Clone)]
pub struct Ladder {
    /// The manifest.
    pub manifest: Manifest,
    /// Where the manifest was read from.
    pub manifest_path: PathBuf,
    /// Where the model files are.
    pub models_dir: PathBuf,
    /// The rungs, largest first.
    pub rungs: Vec<RungInfo>,
}

impl Ladder {
    /// Opens a ladder: every rung's file must exist, parse as GGUF, match its recorded hash,
    /// and share the first rung's tokenizer.
    ///
    /// # Errors
    /// [`LadderError`] naming the rung (and both files, for a tokenizer mismatch).
    pub fn open(manifest_path: &Path, models_dir: &Path) -> Result<Self, LadderError> {
        let manifest = Manifest::load(manifest_path)?;
        let lock_path = Lock::path(models_dir, &manifest.name);
        let mut lock = Lock::load(&lock_path);
        let mut rungs = Vec::new();
        let mut first: Option<(TokenizerIdentity, String, String)> = None;
        let mut seen: Vec<(PathBuf, String)> = Vec::new();
        // Only a fresh hash changes the lock; rewriting it unchanged on every run would touch
        // the models directory (and its mtime) for nothing.
        let mut lock_changed = false;
        for (index, spec) in manifest.rungs.iter().enumerate() {
            let path = models_dir.join(&spec.file);
            if !path.exists() {
                return Err(LadderError::Missing {
                    rung: spec.name.clone(),
                    path,
                    ladder: manifest_path.display().to_string(),
                });
            }
            if let Ok(real) = path.canonicalize() {
                if let Some((_, a)) = seen.iter().find(|(p, _)| *p == real) {
                    return Err(LadderError::SameFile {
                        a: a.clone(),
                        b: spec.name.clone(),
                        path: real,
                    });
                }
                seen.push((real, spec.name.clone()));
            }
            let gguf = GgufFile::open(&path).map_err(|source| LadderError::Gguf {
                rung: spec.name.clone(),
                source,
            })?;
            let facts = ModelFacts::from_gguf(&gguf).map_err(|source| LadderError::Gguf {
                rung: spec.name.clone(),
                source,
            })?;
            let tok = TokenizerIdentity::from_gguf(&gguf).map_err(|source| LadderError::Gguf {
                rung: spec.name.clone(),
                source,
            })?;
            match &first {
                None => first = Some((tok, spec.name.clone(), spec.file.clone())),
                Some((t0, n0, f0)) => {
                    t0.compare(&tok)
                        .map_err(|m| LadderError::TokenizerMismatch {
                            a: n0.clone(),
                            a_file: f0.clone(),
                            b: spec.name.clone(),
                            b_file: spec.file.clone(),
                            reason: m.to_string(),
                        })?;
                }
            }
            let (sha256, fresh) =
                lock.sha256_of(&path, |_| {})
                    .map_err(|source| LadderError::Io {
                        path: path.clone(),
                        source,
                    })?;
            lock_changed |= fresh;
            if let Some(expected) = &spec.sha256
                && expected != &sha256
            {
                return Err(LadderError::HashMismatch {
                    rung: spec.name.clone(),
                    path,
                    expected: expected.clone(),
                    actual: sha256,
                });
            }
            let file_bytes = std::fs::metadata(&path)
                .map_err(|source| LadderError::Io {
                    path: path.clone(),
                    source,
                })?
                .len();
            rungs.push(RungInfo {
                index,
                spec: spec.clone(),
                path,
                facts,
                sha256,
                file_bytes,
            });
        }
        // The lock is only a cache; failing to write it (read-only dir) costs a re-hash later.
        if lock_changed {
            let _ = lock.save(&lock_path);
        }
        Ok(Self {
            manifest,
            manifest_path: manifest_path.to_path_buf(),
            models_dir: models_dir.to_path_buf(),
            rungs,
        })
    }

    /// The ladder's name.
    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    /// A rung by name.
    pub fn rung(&self, name: &str) -> Option<&RungInfo> {
        self.rungs.iter().find(|r| r.spec.name == name)
    }

    /// Names of the rungs, largest first.
    pub fn names(&self) -> Vec<String> {
        self.rungs.iter().map(|r| r.spec.name.clone()).collect()
    }
}
