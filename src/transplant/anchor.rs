//! Anchors: a rung's own cache of the chat template's opening, fitted once and shipped.
//!
//! Under causal attention the K/V of a sequence's first tokens depend on those tokens alone,
//! and every chat a session renders opens with the same few (`<|im_start|>user\n` for
//! ChatML). Those positions hold the attention sink, where a projection's error costs the
//! most attention mass, so a switch re-reads them natively on the destination (head re-read,
//! [`crate::session::migrate::Reread`]). An anchor is that native state computed ahead of
//! time — the destination's exported sequence state over the template's opening — so the
//! switch splices it in instead of decoding it: the part of the head it covers costs nothing.
//!
//! File `<projectors>/<ladder>/anchors/<rung>.molt-anchor`: magic `MOLTANCH`, u32 format
//! version, u64 header length, JSON header (rung name, GGUF file and sha256, the tokens,
//! the state's sha256), then llama.cpp's state blob. Loading checks the rung's sha256 (an
//! anchor of other files is refused, by name), the checksum, and that the blob holds exactly
//! the tokens' positions `0 .. n`.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::ProjectorError;
use crate::kv::KvSnapshot;

/// File magic.
pub const MAGIC: [u8; 8] = *b"MOLTANCH";
/// File format version.
pub const FORMAT_VERSION: u32 = 1;

/// File name of a rung's anchor.
#[must_use]
pub fn file_name(rung: &str) -> String {
    format!("{rung}.molt-anchor")
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Header {
    rung: String,
    file: String,
    sha256: String,
    tokens: Vec<i32>,
    state_sha256: String,
}

/// A rung's native cache state over a token prefix.
#[derive(Debug, Clone)]
pub struct Anchor {
    /// The rung's name.
    pub rung: String,
    /// Its GGUF file name.
    pub file: String,
    /// Its GGUF sha256.
    pub sha256: String,
    /// The prefix, positions `0 .. tokens.len()`.
    pub tokens: Vec<i32>,
    /// llama.cpp's exported state of sequence 0 after decoding `tokens` on a fresh context.
    pub state: Vec<u8>,
}

impl Anchor {
    /// How many of `head`'s leading tokens this anchor provides: their common prefix.
    #[must_use]
    pub fn covers(&self, head: &[i32]) -> usize {
        self.tokens
            .iter()
            .zip(head)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Serialises the file.
    ///
    /// # Errors
    /// [`ProjectorError::Invalid`] if the header cannot be written.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ProjectorError> {
        let header = Header {
            rung: self.rung.clone(),
            file: self.file.clone(),
            sha256: self.sha256.clone(),
            tokens: self.tokens.clone(),
            state_sha256: super::framed::sha256_hex(&self.state),
        };
        let json = serde_json::to_vec_pretty(&header).map_err(|e| ProjectorError::Invalid {
            file: PathBuf::from(file_name(&self.rung)),
            reason: e.to_string(),
        })?;
        Ok(super::framed::frame(
            &MAGIC,
            FORMAT_VERSION,
            &json,
            &self.state,
        ))
    }

    /// Writes the file atomically (a temporary beside it, then renamed).
    ///
    /// # Errors
    /// [`ProjectorError::Io`].
    pub fn save(&self, path: &Path) -> Result<(), ProjectorError> {
        super::framed::write_atomic(path, &self.to_bytes()?)
    }

    /// Reads `path` and checks it belongs to the GGUF file with this sha256.
    ///
    /// # Errors
    /// [`ProjectorError::AnchorBoundToOtherFile`], and the format errors of a damaged file.
    pub fn load(path: &Path, sha256: &str) -> Result<Self, ProjectorError> {
        let bytes = fs::read(path).map_err(|source| ProjectorError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, path.to_path_buf(), sha256)
    }

    /// Parses a file's bytes (see [`Anchor::load`]).
    ///
    /// # Errors
    /// As [`Anchor::load`].
    pub fn from_bytes(bytes: &[u8], file: PathBuf, sha256: &str) -> Result<Self, ProjectorError> {
        let (head, state) = super::framed::unframe(bytes, &MAGIC, FORMAT_VERSION, &file)?;
        let header: Header =
            serde_json::from_slice(head).map_err(|source| ProjectorError::Header {
                file: file.clone(),
                source,
            })?;
        if header.sha256 != sha256 {
            return Err(ProjectorError::AnchorBoundToOtherFile {
                file,
                expected_sha256: sha256.to_string(),
                found_sha256: header.sha256,
                found_name: header.rung,
                found_file: header.file,
            });
        }
        super::framed::check_sha256(&file, "state", header.state_sha256, state)?;
        let invalid = |reason: String| ProjectorError::Invalid {
            file: file.clone(),
            reason,
        };
        if header.tokens.is_empty() {
            return Err(invalid("an anchor of no tokens".into()));
        }
        let (_, stream) = KvSnapshot::parse_single_stream(state)
            .map_err(|e| invalid(format!("state does not parse: {e}")))?;
        let mut positions = stream.positions();
        positions.sort_unstable();
        let expected: Vec<i32> = (0..).take(header.tokens.len()).collect();
        if positions != expected {
            return Err(invalid(format!(
                "state holds positions {positions:?}, the {} tokens need 0..{}",
                header.tokens.len(),
                header.tokens.len()
            )));
        }
        Ok(Self {
            rung: header.rung,
            file: header.file,
            sha256: header.sha256,
            tokens: header.tokens,
            state: state.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anchor() -> Anchor {
        Anchor {
            rung: "tier2".into(),
            file: "small.gguf".into(),
            sha256: "ab".repeat(32),
            tokens: vec![7, 8, 9],
            state: vec![1, 2, 3],
        }
    }

    #[test]
    fn covers_counts_the_common_prefix() {
        let a = anchor();
        assert_eq!(a.covers(&[7, 8, 9, 10]), 3);
        assert_eq!(a.covers(&[7, 8]), 2);
        assert_eq!(a.covers(&[7, 5, 9]), 1);
        assert_eq!(a.covers(&[1]), 0);
        assert_eq!(a.covers(&[]), 0);
    }

    #[test]
    fn damaged_or_foreign_files_are_refused_by_name() {
        let a = anchor();
        let bytes = a.to_bytes().unwrap();
        let file = PathBuf::from("tier2.molt-anchor");
        let err = Anchor::from_bytes(&bytes, file.clone(), &"cd".repeat(32)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("bound to other model files") && msg.contains("small.gguf"),
            "{msg}"
        );
        let err = Anchor::from_bytes(&bytes[..30], file.clone(), &a.sha256).unwrap_err();
        assert!(matches!(err, ProjectorError::Truncated { .. }), "{err}");
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let err = Anchor::from_bytes(&flipped, file.clone(), &a.sha256).unwrap_err();
        assert!(matches!(err, ProjectorError::Checksum { .. }), "{err}");
        // A state that is not a llama.cpp sequence blob is refused, not spliced.
        let err = Anchor::from_bytes(&bytes, file.clone(), &a.sha256).unwrap_err();
        assert!(err.to_string().contains("does not parse"), "{err}");
        let err = Anchor::from_bytes(b"MOLTPROJxxxxxxxxxxxxxxxx", file, &a.sha256).unwrap_err();
        assert!(matches!(err, ProjectorError::BadMagic { .. }), "{err}");
    }
}
