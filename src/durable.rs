//! Files replaced whole or not at all, and the leftovers of writes that were cut short.
//!
//! Every file Molt writes for later runs to trust — a fetched or requantized rung, the lock of
//! hashes, projector, hidden-map and anchor files, corpora, GGUF models — is written to a
//! partial file beside it, flushed to the disk (`fsync`), renamed over the real name, and the
//! directory flushed too, so that after a `kill -9` *or a power loss* the real name holds
//! either the old file or the whole new one. A partial file is named
//! `NAME.<pid>-<n>.partial`: the process that owns it is in its name, which lets a later run
//! tell a write still going on from one whose process died ([`sweep_stale`]).

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// The suffix every partial file ends with.
pub const PARTIAL_SUFFIX: &str = ".partial";

/// A partial file left by a process that cannot be asked (a name without a process id, as
/// older versions wrote) counts as stale once it has not been touched for this long.
pub const ORPHAN_AGE: Duration = Duration::from_secs(3600);

/// A partial-file name beside `path`, unique to this process and this call:
/// `NAME.<pid>-<n>.partial`.
#[must_use]
pub fn partial_path(path: &Path) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut name: OsString = path.file_name().map(ToOwned::to_owned).unwrap_or_default();
    name.push(format!(".{}-{seq}{PARTIAL_SUFFIX}", std::process::id()));
    path.with_file_name(name)
}

/// Writes `bytes` to `path` durably: a partial file beside it, flushed, renamed over `path`,
/// the directory flushed. The partial file is removed if any step fails.
///
/// # Errors
/// The I/O error of the step that failed.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_at(crate::fault::Site::Write, path, bytes)
}

/// `write` whose kill-mid-write fault is counted on `site` (a writer with a fault site of
/// its own, such as the state files of hibernated conversations).
///
/// # Errors
/// The I/O error of the step that failed.
pub fn write_at(site: crate::fault::Site, path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(site, path, bytes, false)
}

/// [`write_at`] for a file only its owner may read or write: created (partial file included)
/// with mode 0600, whatever the umask — a conversation's state holds its tokens.
///
/// # Errors
/// The I/O error of the step that failed.
pub fn write_private_at(site: crate::fault::Site, path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(site, path, bytes, true)
}

fn write_with(
    site: crate::fault::Site,
    path: &Path,
    bytes: &[u8],
    private: bool,
) -> io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let partial = partial_path(path);
    let written = (|| {
        let mut f = if private {
            let f = File::options()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&partial)?;
            // The mode asked for at creation is cut by the umask; this one is not.
            f.set_permissions(fs::Permissions::from_mode(0o600))?;
            f
        } else {
            File::create(&partial)?
        };
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&partial);
        return Err(e);
    }
    commit_at(site, &partial, path)
}

/// Puts a finished partial file in place: flushes it (another writer — llama.cpp's quantize,
/// a download — may have left it in the page cache only), renames it over `path` and flushes
/// the directory, so the rename itself survives a power loss. The partial file is removed if
/// any step fails. The fault hook `write` (see [`crate::fault`]) strikes just before the
/// rename.
///
/// # Errors
/// The I/O error of the step that failed.
pub fn commit(partial: &Path, path: &Path) -> io::Result<()> {
    commit_at(crate::fault::Site::Write, partial, path)
}

/// [`commit`] whose kill-mid-write fault is counted on `site`.
///
/// # Errors
/// The I/O error of the step that failed.
pub fn commit_at(site: crate::fault::Site, partial: &Path, path: &Path) -> io::Result<()> {
    let result = (|| {
        File::open(partial)?.sync_all()?;
        crate::fault::die_mid_write_at(site, partial);
        fs::rename(partial, path)?;
        sync_dir(path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(partial);
    }
    result
}

/// Flushes the directory holding `path`, which makes a rename into it durable.
fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Removes the partial files in `dir` that no write will ever finish: those whose process (the
/// id in their name) is gone, and those without an id untouched for [`ORPHAN_AGE`]. A partial
/// file of a process still running is left alone. Returns the files removed, for the caller to
/// report; a directory that does not exist has none.
///
/// # Errors
/// The I/O error of listing `dir` (a file that vanished meanwhile is not an error).
pub fn sweep_stale(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.ends_with(PARTIAL_SUFFIX) || !entry.file_type()?.is_file() {
            continue;
        }
        let stale = match owner_pid(name) {
            Some(pid) => !process_alive(pid),
            None => entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .is_some_and(|age| age >= ORPHAN_AGE),
        };
        if stale {
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    removed.sort();
    Ok(removed)
}

/// The process id in a partial file's name (`NAME.<pid>-<n>.partial`), if it has one.
fn owner_pid(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(PARTIAL_SUFFIX)?;
    let tag = stem.rsplit('.').next()?;
    let (pid, seq) = tag.split_once('-')?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether a process with this id exists (signal 0 checks without sending anything).
fn process_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) with signal 0 performs only the existence and permission check.
    let rc = unsafe { libc::kill(pid, 0) };
    // EPERM: it exists but belongs to another user.
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_is_read_from_the_name_only_when_it_is_there() {
        assert_eq!(owner_pid("a.gguf.123-4.partial"), Some(123));
        assert_eq!(owner_pid("qwen.lock.json.77-0.partial"), Some(77));
        assert_eq!(owner_pid("a.gguf.partial"), None);
        assert_eq!(owner_pid("a.gguf.12-x.partial"), None);
        assert_eq!(owner_pid("a.gguf"), None);
    }

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_partial() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        write(&path, b"old").unwrap();
        write(&path, b"new contents").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new contents");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "only the file itself: {names:?}");
    }

    #[test]
    fn a_failed_commit_removes_its_partial() {
        let dir = tempfile::tempdir().unwrap();
        let partial = partial_path(&dir.path().join("x"));
        fs::write(&partial, b"data").unwrap();
        // Renaming a file over a non-empty directory fails.
        let target = dir.path().join("busy");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("inside"), b"").unwrap();
        assert!(commit(&partial, &target).is_err());
        assert!(!partial.exists());
    }

    #[test]
    fn the_sweep_removes_dead_writers_partials_and_keeps_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        // A process id far above pid_max (4194304 at most on Linux) is never alive.
        let dead = dir.path().join("rung.gguf.999999999-0.partial");
        let live = partial_path(&dir.path().join("rung.gguf"));
        let fresh_orphan = dir.path().join("rung.gguf.partial");
        let other = dir.path().join("rung.gguf");
        for p in [&dead, &live, &fresh_orphan, &other] {
            fs::write(p, b"x").unwrap();
        }
        let removed = sweep_stale(dir.path()).unwrap();
        assert_eq!(removed, vec![dead.clone()]);
        assert!(live.exists() && fresh_orphan.exists() && other.exists());
        // An orphan without an id goes once it is old.
        let old = SystemTime::now() - ORPHAN_AGE - Duration::from_secs(5);
        File::options()
            .write(true)
            .open(&fresh_orphan)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(sweep_stale(dir.path()).unwrap(), vec![fresh_orphan]);
        assert!(sweep_stale(&dir.path().join("absent")).unwrap().is_empty());
    }
}
