//! State files: a hibernated conversation's KV cache on disk, so a conversation outlives the
//! engine holding it — another conversation taking the engine, a server restart, a chat closed
//! and opened again.
//!
//! Main types: [`StateFile`] (what one file holds), [`Expect`] (what the reader requires of
//! it), [`StateError`] (why a file was refused, always naming the file) and [`StateDir`]
//! (the directory, its default location and its size bound, in `dir.rs`).
//!
//! **Layout** (little-endian), in the order it is checked when read:
//!
//! ```text
//! magic      8 B   "MOLTSTAT"
//! version    u32   FORMAT_VERSION
//! meta_len   u32   bytes of the JSON metadata that follows
//! meta       JSON  rung name and sha256, context size, tokens and their positions, the
//!                  pending token, the messages, when it was written
//! blob_len   u64   bytes of llama.cpp's sequence state that follows
//! blob             `Context::export_state` of the conversation's sequence
//! sha256     32 B  over every byte above
//! ```
//!
//! A reader refuses, with a message naming the file: a file shorter than its lengths say
//! (**truncated**: a write cut short), a checksum that does not match (**corrupt**), another
//! format version or a rung whose sha256 is not the one running (**foreign**: llama.cpp's blob
//! is only meaningful to the exact weights that wrote it), and a file whose conversation the
//! request does not continue (**stale**). llama.cpp's own slot files carry none of this —
//! its server checks only that the blob imports — which is why `test_slot_save.py`'s cases
//! are the model here but its format is not.
//!
//! Writes go through [`crate::durable`]: a partial file in the same directory, fsync, rename,
//! fsync of the directory. A process killed mid-write leaves a `.partial` file that no reader
//! takes for a state file, and that the next [`StateDir::open`] removes.

mod dir;

pub use dir::{
    DEFAULT_MAX_MIB, Entry, Evicted, StateDir, StateDirError, create_private_dir,
    default_state_dir, valid_id,
};

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::engine::{ChatMessage, Token};

/// First bytes of every state file.
pub const MAGIC: &[u8; 8] = b"MOLTSTAT";

/// The layout written by this build. A reader refuses any other: llama.cpp's blob layout and
/// the metadata's meaning are only promised within one version.
pub const FORMAT_VERSION: u32 = 1;

/// File name ending of a state file.
pub const EXTENSION: &str = "molt-state";

/// Fixed bytes around the variable parts: magic, version, meta length, blob length, checksum.
const FIXED: usize = 8 + 4 + 4 + 8 + 32;

/// Why a state file was refused. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing failed.
    #[error("state file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Shorter than its own lengths say (a write cut short).
    #[error("state file {path} is truncated: {actual} bytes, its header needs {expected}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header announces (at least).
        expected: u64,
        /// Bytes found.
        actual: u64,
    },
    /// The bytes are not what was written.
    #[error("state file {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What does not match.
        reason: String,
    },
    /// Written by another format version or for other weights.
    #[error("state file {path} is foreign: {reason}")]
    Foreign {
        /// The file.
        path: PathBuf,
        /// Whose it is.
        reason: String,
    },
    /// A valid file of a conversation the request does not continue.
    #[error("state file {path} is stale: {reason}")]
    Stale {
        /// The file.
        path: PathBuf,
        /// Why it no longer applies.
        reason: String,
    },
}

impl StateError {
    /// The one-word kind (`io`, `truncated`, `corrupt`, `foreign`, `stale`), for logs and
    /// tests.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            StateError::Io { .. } => "io",
            StateError::Truncated { .. } => "truncated",
            StateError::Corrupt { .. } => "corrupt",
            StateError::Foreign { .. } => "foreign",
            StateError::Stale { .. } => "stale",
        }
    }

    /// Why the file was refused, without its path (for a client, who has no business knowing
    /// where the server keeps its files): `corrupt: checksum mismatch`.
    #[must_use]
    pub fn reason(&self) -> String {
        match self {
            StateError::Io { source, .. } => format!("unreadable: {source}"),
            StateError::Truncated {
                expected, actual, ..
            } => format!("truncated: {actual} bytes, its header needs {expected}"),
            StateError::Corrupt { reason, .. }
            | StateError::Foreign { reason, .. }
            | StateError::Stale { reason, .. } => format!("{}: {reason}", self.kind()),
        }
    }

    /// True when the write failed because the disk is full (the caller keeps the state in RAM).
    #[must_use]
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StateError::Io { source, .. }
            if source.raw_os_error() == Some(libc::ENOSPC) || source.kind() == std::io::ErrorKind::StorageFull)
    }
}

/// The metadata of a state file (everything but the blob).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateMeta {
    /// The conversation's id.
    pub conversation: String,
    /// The rung whose context wrote the blob.
    pub rung: String,
    /// That rung's file sha256 (lowercase hex).
    pub rung_sha256: String,
    /// The context window the blob was written from.
    pub n_ctx: u32,
    /// The tokens whose K/V the blob holds, in position order.
    pub tokens: Vec<Token>,
    /// First position of `tokens` (positions are `pos_start..pos_start + tokens.len()`).
    pub pos_start: u32,
    /// The token sampled last and not yet decoded (an answer's last token).
    pub pending: Option<Token>,
    /// How many leading tokens were the conversation's first prompt (system prompt and first
    /// user turn): a request must share at least these with the file to continue it. Not the
    /// whole file: an answer's text, rendered again as a message, need not tokenize to the
    /// tokens that were sampled, so a faithful continuation may share less than that.
    pub first_turn_len: usize,
    /// Leading tokens never shed.
    pub pinned: usize,
    /// The conversation's messages (the chat needs them to resume; the server gets them with
    /// every request).
    pub messages: Vec<ChatMessage>,
    /// When it was written, ms since the Unix epoch.
    pub written_unix_ms: u64,
}

/// One state file's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFile {
    /// Everything but the blob.
    pub meta: StateMeta,
    /// llama.cpp's sequence state.
    pub blob: Vec<u8>,
}

/// What a reader requires of a state file.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    /// `(rung name, sha256)` of every rung the reader can run.
    pub rungs: &'a [(String, String)],
    /// The reader's context window: a file holding more tokens cannot be imported.
    pub n_ctx: u32,
    /// The tokens of the request that continues the conversation (`None`: no request yet,
    /// as when a chat resumes before its next question).
    pub continues: Option<&'a [Token]>,
}

impl StateFile {
    /// The file's bytes, checksum included.
    ///
    /// # Errors
    /// Metadata that does not serialize (never for valid UTF-8 messages).
    pub fn to_bytes(&self) -> Result<Vec<u8>, serde_json::Error> {
        let meta = serde_json::to_vec(&self.meta)?;
        let mut out = Vec::with_capacity(FIXED + meta.len() + self.blob.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        // Metadata above 4 GiB is not a conversation this runtime can hold.
        out.extend_from_slice(&u32::try_from(meta.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&(self.blob.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.blob);
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        Ok(out)
    }

    /// Parses and checks a file's bytes: truncated, corrupt and foreign files are refused here,
    /// stale ones by [`StateFile::check`].
    ///
    /// # Errors
    /// [`StateError`] naming `path` and what is wrong.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, StateError> {
        let p = || path.to_path_buf();
        let truncated = |expected: u64| StateError::Truncated {
            path: p(),
            expected,
            actual: bytes.len() as u64,
        };
        if bytes.len() < 8 || &bytes[..8] != MAGIC {
            if bytes.len() < 8 && MAGIC.starts_with(bytes) {
                return Err(truncated(FIXED as u64));
            }
            return Err(StateError::Corrupt {
                path: p(),
                reason: "it does not start with a Molt state header".into(),
            });
        }
        if bytes.len() < 16 {
            return Err(truncated(FIXED as u64));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
        if version != FORMAT_VERSION {
            return Err(StateError::Foreign {
                path: p(),
                reason: format!(
                    "format version {version}, this build reads version {FORMAT_VERSION}"
                ),
            });
        }
        let meta_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap_or_default()) as u64;
        // Lengths are checked against the bytes present before anything is allocated or sliced.
        let blob_len_at = 16 + meta_len;
        if (bytes.len() as u64) < blob_len_at + 8 + 32 {
            return Err(truncated(blob_len_at + 8 + 32));
        }
        let blob_len_at = usize::try_from(blob_len_at).map_err(|_| truncated(u64::MAX))?;
        let blob_len = u64::from_le_bytes(
            bytes[blob_len_at..blob_len_at + 8]
                .try_into()
                .unwrap_or_default(),
        );
        let total = (blob_len_at as u64 + 8)
            .checked_add(blob_len)
            .and_then(|n| n.checked_add(32))
            .ok_or_else(|| truncated(u64::MAX))?;
        if (bytes.len() as u64) < total {
            return Err(truncated(total));
        }
        if (bytes.len() as u64) > total {
            return Err(StateError::Corrupt {
                path: p(),
                reason: format!(
                    "{} bytes after the checksum (the header accounts for {total})",
                    bytes.len() as u64 - total
                ),
            });
        }
        let body = &bytes[..bytes.len() - 32];
        let sum = Sha256::digest(body);
        if sum.as_slice() != &bytes[bytes.len() - 32..] {
            return Err(StateError::Corrupt {
                path: p(),
                reason: "checksum mismatch (the bytes changed after they were written)".into(),
            });
        }
        let meta: StateMeta =
            serde_json::from_slice(&bytes[16..blob_len_at]).map_err(|e| StateError::Corrupt {
                path: p(),
                reason: format!("metadata: {e}"),
            })?;
        if meta.first_turn_len > meta.tokens.len() || meta.pinned > meta.tokens.len() {
            return Err(StateError::Corrupt {
                path: p(),
                reason: format!(
                    "metadata: first_turn_len {} / pinned {} beyond its {} tokens",
                    meta.first_turn_len,
                    meta.pinned,
                    meta.tokens.len()
                ),
            });
        }
        Ok(Self {
            meta,
            blob: bytes[blob_len_at + 8..bytes.len() - 32].to_vec(),
        })
    }

    /// Checks that the reader can use this file: its rung is one the reader runs, byte for
    /// byte; its tokens fit the reader's context; the request continues its conversation.
    ///
    /// # Errors
    /// [`StateError::Foreign`] or [`StateError::Stale`], naming `path`.
    pub fn check(&self, path: &Path, expect: &Expect<'_>) -> Result<(), StateError> {
        let m = &self.meta;
        match expect.rungs.iter().find(|(name, _)| *name == m.rung) {
            None => {
                return Err(StateError::Foreign {
                    path: path.to_path_buf(),
                    reason: format!(
                        "written by rung {:?}, which this ladder does not have",
                        m.rung
                    ),
                });
            }
            Some((_, sha)) if *sha != m.rung_sha256 => {
                return Err(StateError::Foreign {
                    path: path.to_path_buf(),
                    reason: format!(
                        "written by rung {} with sha256 {}, the running {} has {}",
                        m.rung,
                        short(&m.rung_sha256),
                        m.rung,
                        short(sha)
                    ),
                });
            }
            Some(_) => {}
        }
        let end = m.pos_start as usize + m.tokens.len() + usize::from(m.pending.is_some());
        if end > expect.n_ctx as usize {
            return Err(StateError::Foreign {
                path: path.to_path_buf(),
                reason: format!(
                    "holds {end} positions, this context window is {} tokens",
                    expect.n_ctx
                ),
            });
        }
        if let Some(req) = expect.continues {
            let shared = m.tokens.iter().zip(req).take_while(|(a, b)| a == b).count();
            if shared < m.first_turn_len {
                return Err(StateError::Stale {
                    path: path.to_path_buf(),
                    reason: format!(
                        "the request shares {shared} tokens with it, fewer than its first turn's {}: the request's earlier turns are not the file's",
                        m.first_turn_len
                    ),
                });
            }
        }
        Ok(())
    }

    /// Reads, parses and checks `path`.
    ///
    /// # Errors
    /// [`StateError`] naming the file and why it was refused.
    pub fn load(path: &Path, expect: &Expect<'_>) -> Result<Self, StateError> {
        let bytes = std::fs::read(path).map_err(|source| StateError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let f = Self::from_bytes(path, &bytes)?;
        f.check(path, expect)?;
        Ok(f)
    }

    /// Writes the file atomically: a temporary file beside it, fsync, rename, fsync of the
    /// directory. The file is its owner's alone (mode 0600, whatever the umask): it holds the
    /// conversation's tokens. Returns the bytes written.
    ///
    /// # Errors
    /// [`StateError::Io`] (a full disk among them: [`StateError::is_disk_full`]); the
    /// temporary file is removed and `path` is untouched.
    pub fn write_atomic(&self, path: &Path) -> Result<u64, StateError> {
        let io = |source| StateError::Io {
            path: path.to_path_buf(),
            source,
        };
        let bytes = self
            .to_bytes()
            .map_err(|e| io(std::io::Error::other(e.to_string())))?;
        if crate::fault::hit(crate::fault::Site::StateDiskFull) {
            return Err(io(std::io::Error::from_raw_os_error(libc::ENOSPC)));
        }
        crate::durable::write_private_at(crate::fault::Site::StateWrite, path, &bytes)
            .map_err(io)?;
        Ok(bytes.len() as u64)
    }
}

fn short(sha: &str) -> &str {
    sha.get(..12).unwrap_or(sha)
}

/// Milliseconds since the Unix epoch, now.
#[must_use]
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rungs() -> Vec<(String, String)> {
        vec![
            ("big".into(), "a".repeat(64)),
            ("small".into(), "b".repeat(64)),
        ]
    }

    fn sample() -> StateFile {
        StateFile {
            meta: StateMeta {
                conversation: "c1".into(),
                rung: "big".into(),
                rung_sha256: "a".repeat(64),
                n_ctx: 512,
                tokens: vec![1, 2, 3, 4, 5, 6],
                pos_start: 0,
                pending: Some(7),
                first_turn_len: 4,
                pinned: 3,
                messages: vec![ChatMessage::new("user", "hi")],
                written_unix_ms: 1,
            },
            blob: vec![9u8; 100],
        }
    }

    fn expect<'a>(rungs: &'a [(String, String)], req: Option<&'a [Token]>) -> Expect<'a> {
        Expect {
            rungs,
            n_ctx: 512,
            continues: req,
        }
    }

    #[test]
    fn a_written_file_reads_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c1.molt-state");
        let f = sample();
        let n = f.write_atomic(&path).unwrap();
        assert_eq!(n, std::fs::metadata(&path).unwrap().len());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no partial file is left"
        );
        let r = rungs();
        let req = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(StateFile::load(&path, &expect(&r, Some(&req))).unwrap(), f);
    }

    #[test]
    fn every_truncation_is_refused_as_truncated_naming_the_file() {
        let path = Path::new("/x/c1.molt-state");
        let bytes = sample().to_bytes().unwrap();
        for cut in [0, 4, 8, 12, 15, 16, 40, bytes.len() - 33, bytes.len() - 1] {
            let e = StateFile::from_bytes(path, &bytes[..cut]).unwrap_err();
            assert_eq!(e.kind(), "truncated", "cut at {cut}: {e}");
            assert!(e.to_string().contains("/x/c1.molt-state"), "{e}");
        }
    }

    #[test]
    fn a_flipped_byte_anywhere_is_refused() {
        let path = Path::new("c1.molt-state");
        let bytes = sample().to_bytes().unwrap();
        // In the metadata, the blob and the checksum itself.
        for at in [20, bytes.len() - 60, bytes.len() - 5] {
            let mut b = bytes.clone();
            b[at] ^= 0x40;
            let e = StateFile::from_bytes(path, &b).unwrap_err();
            assert_eq!(e.kind(), "corrupt", "flip at {at}: {e}");
            assert!(e.to_string().contains("checksum"), "{e}");
        }
        let mut b = bytes.clone();
        b[0] = b'X';
        assert_eq!(
            StateFile::from_bytes(path, &b).unwrap_err().kind(),
            "corrupt"
        );
        let mut b = bytes;
        b.push(0);
        assert_eq!(
            StateFile::from_bytes(path, &b).unwrap_err().kind(),
            "corrupt"
        );
    }

    #[test]
    fn a_hostile_length_is_refused_before_allocating() {
        let path = Path::new("c1.molt-state");
        let mut b = Vec::from(*MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(b"{}");
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        b.extend_from_slice(&[0u8; 32]);
        assert_eq!(
            StateFile::from_bytes(path, &b).unwrap_err().kind(),
            "truncated"
        );
    }

    #[test]
    fn another_format_version_is_foreign() {
        let path = Path::new("c1.molt-state");
        let mut b = sample().to_bytes().unwrap();
        b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        let e = StateFile::from_bytes(path, &b).unwrap_err();
        assert_eq!(e.kind(), "foreign");
        assert!(e.to_string().contains("format version 2"), "{e}");
    }

    #[test]
    fn another_rungs_file_is_foreign() {
        let path = Path::new("c1.molt-state");
        let mut f = sample();
        f.meta.rung_sha256 = "c".repeat(64);
        let r = rungs();
        let e = f.check(path, &expect(&r, None)).unwrap_err();
        assert_eq!(e.kind(), "foreign");
        assert!(e.to_string().contains("sha256 cccccccccccc"), "{e}");
        f.meta.rung = "tiny".into();
        let e = f.check(path, &expect(&r, None)).unwrap_err();
        assert!(e.to_string().contains("does not have"), "{e}");
        let f = sample();
        let e = f
            .check(
                path,
                &Expect {
                    rungs: &r,
                    n_ctx: 4,
                    continues: None,
                },
            )
            .unwrap_err();
        assert_eq!(e.kind(), "foreign");
    }

    #[test]
    fn a_request_that_does_not_continue_the_file_finds_it_stale() {
        let path = Path::new("c1.molt-state");
        let f = sample();
        let r = rungs();
        // Shares the first turn (4 tokens) and then diverges: continues it.
        assert!(
            f.check(path, &expect(&r, Some(&[1, 2, 3, 4, 9, 9])))
                .is_ok()
        );
        // Diverges inside the first turn: an edited earlier turn.
        let e = f
            .check(path, &expect(&r, Some(&[1, 2, 9, 4, 5, 6, 7])))
            .unwrap_err();
        assert_eq!(e.kind(), "stale");
        assert!(e.to_string().contains("shares 2 tokens"), "{e}");
    }

    #[test]
    fn a_failed_write_leaves_no_file_and_says_disk_full() {
        let _g = crate::fault::test_lock();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c1.molt-state");
        crate::fault::arm(Some(crate::fault::Plan::at(
            crate::fault::Site::StateDiskFull,
            1,
        )));
        let e = sample().write_atomic(&path).unwrap_err();
        crate::fault::arm(None);
        assert!(e.is_disk_full(), "{e}");
        assert!(!path.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
