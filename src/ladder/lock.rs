//! The lock file beside the models (`<ladder>.lock.json`, machine-local, git-ignored): the
//! sha256 of every assembled or locally built rung, keyed by size and modification time, so a
//! 1 GB file is hashed once rather than on every start, and a locally requantized rung's hash
//! is recorded when it is built.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// One file's recorded identity.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileRecord {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: u128,
    /// sha256, lowercase hex.
    pub sha256: String,
}

/// The lock file's content.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Lock {
    /// Records by file name.
    pub files: BTreeMap<String, FileRecord>,
}

fn stat(path: &Path) -> std::io::Result<(u64, u128)> {
    let md = std::fs::metadata(path)?;
    let mtime = md
        .modified()?
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    Ok((md.len(), mtime))
}

/// sha256 of a file, calling `progress(bytes_done)` as it goes.
///
/// # Errors
/// I/O errors reading the file.
pub fn sha256_file(path: &Path, mut progress: impl FnMut(u64)) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        done += n as u64;
        progress(done);
    }
    Ok(hex::encode(h.finalize()))
}

impl Lock {
    /// The lock file path for a ladder in a models directory.
    pub fn path(models_dir: &Path, ladder: &str) -> PathBuf {
        models_dir.join(format!("{ladder}.lock.json"))
    }

    /// Reads the lock (a missing or unreadable lock is empty: it is only a cache of hashes).
    pub fn load(path: &Path) -> Self {
        std::fs::read(path)
            .map(|b| Self::from_bytes(&b))
            .unwrap_or_default()
    }

    /// Parses a lock file's bytes; anything that is not a lock is an empty lock (see
    /// [`Lock::load`]).
    #[must_use]
    pub fn from_bytes(bytes: &[u8]) -> Self {
        serde_json::from_slice(bytes).unwrap_or_default()
    }

    /// Writes the lock atomically.
    ///
    /// # Errors
    /// I/O errors.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        crate::durable::write(
            path,
            &serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?,
        )
    }

    /// Records `sha256`, hashed by the caller, for the file at `path` as it is now (size and
    /// mtime, through a link).
    ///
    /// # Errors
    /// I/O errors reading the file's metadata.
    pub fn record(&mut self, path: &Path, sha256: String) -> std::io::Result<()> {
        let key = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (size, mtime_ns) = stat(path)?;
        self.files.insert(
            key,
            FileRecord {
                size,
                mtime_ns,
                sha256,
            },
        );
        Ok(())
    }

    /// The file's sha256: from the lock when size and mtime still match, else hashed now (and
    /// recorded). Returns `(sha256, freshly_hashed)`.
    ///
    /// # Errors
    /// I/O errors.
    pub fn sha256_of(
        &mut self,
        path: &Path,
        progress: impl FnMut(u64),
    ) -> std::io::Result<(String, bool)> {
        let key = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (size, mtime_ns) = stat(path)?;
        if let Some(r) = self.files.get(&key)
            && r.size == size
            && r.mtime_ns == mtime_ns
        {
            return Ok((r.sha256.clone(), false));
        }
        let sha256 = sha256_file(path, progress)?;
        self.files.insert(
            key,
            FileRecord {
                size,
                mtime_ns,
                sha256: sha256.clone(),
            },
        );
        Ok((sha256, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_once_and_rehashes_after_change() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x.gguf");
        std::fs::write(&f, b"abc").unwrap();
        let mut lock = Lock::default();
        let (h, fresh) = lock.sha256_of(&f, |_| {}).unwrap();
        assert_eq!(
            h,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(fresh);
        assert!(!lock.sha256_of(&f, |_| {}).unwrap().1);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&f, b"abcd").unwrap();
        let (h2, fresh) = lock.sha256_of(&f, |_| {}).unwrap();
        assert!(fresh);
        assert_ne!(h, h2);
        let p = dir.path().join("l.json");
        lock.save(&p).unwrap();
        assert_eq!(Lock::load(&p).files.len(), 1);
    }
}
