//! The state directory: where state files live, one per conversation (`<id>.molt-state`), and
//! the bound on their total size.
//!
//! Why a bound and oldest-first eviction: a state file costs disk, not RAM, but a service that
//! hibernates every conversation it ever saw would fill the disk it shares with everything
//! else. The oldest hibernated conversation is the one least likely to come back, and losing
//! its file loses nothing but time — the client still has the messages, and the next request
//! re-reads them.
//!
//! Why private: a state file holds a conversation's tokens, so the directory is its owner's
//! alone (0700, its files 0600, whatever the umask), and one that other users can write is
//! refused at start — another user could plant a file under a conversation id a client will
//! name, and the server would continue that conversation from it.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::{EXTENSION, StateError, StateFile};

/// Default bound on the directory's state files, MiB.
pub const DEFAULT_MAX_MIB: u64 = 1024;

/// The state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    /// Cannot be created, or written.
    #[error("state directory {path} is not writable: {source}")]
    NotWritable {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Other users could write it (or it is theirs): refused, never used.
    #[error(
        "state directory {path} {why}: another user could replace or plant state files in it; give a --state-dir of your own (or make this one yours alone: chmod 700)"
    )]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// No directory given and no per-user data directory known.
    #[error("no state directory: set HOME or XDG_DATA_HOME, or give --state-dir")]
    NoDefault,
}

/// A state file removed to keep the directory under its bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    /// The conversation whose file it was.
    pub conversation: String,
    /// The file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
}

/// One state file found in the directory.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Conversation id (the file stem).
    pub conversation: String,
    /// The file.
    pub path: PathBuf,
    /// Size, bytes.
    pub bytes: u64,
    /// Last written.
    pub modified: SystemTime,
}

/// A writable directory of state files with a size bound.
#[derive(Debug, Clone)]
pub struct StateDir {
    path: PathBuf,
    max_bytes: u64,
}

/// The per-user default: `$XDG_DATA_HOME/molt/state`, else `~/.local/share/molt/state`.
#[must_use]
pub fn default_state_dir() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("molt").join("state"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/molt/state"))
}

/// Whether `id` may name a state file: 1–64 ASCII letters, digits, `-` or `_` (a client's
/// id must never become a path elsewhere).
#[must_use]
pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Creates `path` and its missing parents for this user alone (0700, whatever the umask; the
/// mode of a directory that already exists is not changed).
///
/// # Errors
/// The I/O error of the step that failed.
pub fn create_private_dir(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if path.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
}

/// Refuses a directory other users can write (or that is not this user's); one they can only
/// read, this user's own, is made 0700 and said so, and so are its state files (0600: files a
/// version that did not set modes left to the umask).
fn make_private(path: &Path) -> Result<(), StateDirError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path).map_err(|source| StateDirError::NotWritable {
        path: path.to_path_buf(),
        source,
    })?;
    let refuse = |why: String| StateDirError::NotPrivate {
        path: path.to_path_buf(),
        why,
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(refuse(format!(
            "belongs to user {}, not to this user ({me})",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(refuse(format!(
            "can be written by other users (mode {mode:04o})"
        )));
    }
    let tighten = |p: &Path, private: u32| {
        if let Ok(m) = std::fs::metadata(p)
            && m.mode() & 0o077 != 0
        {
            let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(private));
        }
    };
    if mode & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| StateDirError::NotWritable {
                path: path.to_path_buf(),
                source,
            },
        )?;
        eprintln!(
            "state directory {} could be read by other users (mode {mode:04o}): made it 0700",
            path.display()
        );
    }
    let aside = path.join("aside");
    if aside.is_dir() {
        tighten(&aside, 0o700);
    }
    for dir in [path, aside.as_path()] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                tighten(&e.path(), 0o600);
            }
        }
    }
    Ok(())
}

impl StateDir {
    /// Opens (creating it, 0700, if needed) `path`, refuses it if other users can write it,
    /// makes it and its files private if others can read them, checks that a file can be
    /// written in it, and removes temporary files a killed write left behind.
    ///
    /// # Errors
    /// [`StateDirError::NotWritable`] or [`StateDirError::NotPrivate`], naming the directory.
    pub fn open(path: &Path, max_mib: u64) -> Result<Self, StateDirError> {
        let bad = |source| StateDirError::NotWritable {
            path: path.to_path_buf(),
            source,
        };
        create_private_dir(path).map_err(bad)?;
        make_private(path)?;
        let probe = path.join(format!(".probe-{}", std::process::id()));
        std::fs::write(&probe, b"").map_err(bad)?;
        let _ = std::fs::remove_file(&probe);
        // Partial files of writers killed mid-write (a live writer's are left alone).
        for stale in crate::durable::sweep_stale(path).unwrap_or_default() {
            eprintln!("removed {} (left by an interrupted write)", stale.display());
        }
        Ok(Self {
            path: path.to_path_buf(),
            max_bytes: max_mib.saturating_mul(1 << 20),
        })
    }

    /// The directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bound, bytes.
    #[must_use]
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The file of conversation `id` (which must be [`valid_id`]).
    #[must_use]
    pub fn file_of(&self, id: &str) -> PathBuf {
        self.path.join(format!("{id}.{EXTENSION}"))
    }

    /// Every state file, oldest first.
    #[must_use]
    pub fn entries(&self) -> Vec<Entry> {
        let mut v: Vec<Entry> = std::fs::read_dir(&self.path)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let path = e.path();
                if path.extension()? != EXTENSION {
                    return None;
                }
                let conversation = path.file_stem()?.to_str()?.to_string();
                let m = e.metadata().ok()?;
                Some(Entry {
                    conversation,
                    path,
                    bytes: m.len(),
                    modified: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                })
            })
            .collect();
        v.sort_by(|a, b| {
            a.modified
                .cmp(&b.modified)
                .then(a.conversation.cmp(&b.conversation))
        });
        v
    }

    /// Writes `file` as conversation `id`'s state, then evicts the oldest other files until the
    /// directory is within its bound. Returns the bytes written and what was evicted.
    ///
    /// # Errors
    /// [`StateError::Io`] from the write (nothing evicted then).
    pub fn write(&self, id: &str, file: &StateFile) -> Result<(u64, Vec<Evicted>), StateError> {
        let path = self.file_of(id);
        let n = file.write_atomic(&path)?;
        Ok((n, self.enforce_bound(Some(&path))))
    }

    /// Removes the oldest state files (never `keep`) until the total is within the bound.
    pub fn enforce_bound(&self, keep: Option<&Path>) -> Vec<Evicted> {
        let entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
        let mut out = Vec::new();
        for e in entries {
            if total <= self.max_bytes {
                break;
            }
            if keep == Some(e.path.as_path()) {
                continue;
            }
            if std::fs::remove_file(&e.path).is_ok() {
                total -= e.bytes;
                out.push(Evicted {
                    conversation: e.conversation,
                    path: e.path,
                    bytes: e.bytes,
                });
            }
        }
        out
    }

    /// Removes conversation `id`'s file, if any.
    pub fn remove(&self, id: &str) {
        let _ = std::fs::remove_file(self.file_of(id));
    }
}

#[cfg(test)]
mod tests {
    use super::super::StateMeta;
    use super::*;

    fn file(blob: usize) -> StateFile {
        StateFile {
            meta: StateMeta {
                conversation: "x".into(),
                rung: "big".into(),
                rung_sha256: "a".repeat(64),
                n_ctx: 64,
                tokens: vec![1, 2],
                pos_start: 0,
                pending: None,
                first_turn_len: 1,
                pinned: 0,
                messages: Vec::new(),
                written_unix_ms: 0,
            },
            blob: vec![0; blob],
        }
    }

    #[test]
    fn the_oldest_files_go_first_and_the_new_one_stays() {
        let d = tempfile::tempdir().unwrap();
        let mut dir = StateDir::open(d.path(), 10).unwrap();
        for id in ["a", "b", "c"] {
            let (_, ev) = dir.write(id, &file(400 << 10)).unwrap();
            assert!(ev.is_empty(), "{id}: {ev:?}");
            // Distinct modification times, whatever the file system's resolution.
            let t = SystemTime::now()
                - std::time::Duration::from_secs(match id {
                    "a" => 30,
                    "b" => 20,
                    _ => 10,
                });
            std::fs::File::options()
                .write(true)
                .open(dir.file_of(id))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        // 3 × 400 KiB > 1 MiB: the oldest file other than the one kept, "a", goes.
        dir.max_bytes = 1 << 20;
        let ev = dir.enforce_bound(Some(&dir.file_of("c")));
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0].conversation, "a");
        let left: Vec<_> = dir.entries().into_iter().map(|e| e.conversation).collect();
        assert_eq!(left, ["b", "c"]);
    }

    #[test]
    fn a_directory_that_cannot_be_written_is_named() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("plain-file");
        std::fs::write(&f, b"").unwrap();
        let e = StateDir::open(&f.join("state"), 1).unwrap_err();
        assert!(e.to_string().contains("plain-file/state"), "{e}");
    }

    #[test]
    fn leftover_temporaries_are_removed_on_open() {
        let d = tempfile::tempdir().unwrap();
        // A writer that died (a process id above any pid_max).
        let tmp = d.path().join(format!("a.{EXTENSION}.999999999-0.partial"));
        std::fs::write(&tmp, b"half").unwrap();
        let dir = StateDir::open(d.path(), 1).unwrap();
        assert!(!tmp.exists());
        assert!(dir.entries().is_empty());
    }

    #[test]
    fn ids_that_could_be_paths_are_not_valid() {
        assert!(valid_id("conv-1_A"));
        for bad in ["", "../x", "a/b", "a.b", &"x".repeat(65)] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
