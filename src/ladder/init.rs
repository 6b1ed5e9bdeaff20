//! A ladder of the user's own GGUF files: [`plan`] checks the files (each a GGUF model, no
//! file twice, one tokenizer, sizes that order them) and builds the manifest, largest first;
//! `write` puts it in a models directory, linking the files that live elsewhere.
//!
//! [`make`] is the whole of it for `molt-run ladder init`: it first builds the precision rungs
//! asked for (`--requantize TYPE`) from the largest file with llama.cpp's quantizer, then plans
//! and writes, and removes the files it built if anything after fails — a failed init leaves
//! nothing half-made behind.
//!
//! Fitting the projectors is the caller's next step (`molt-run ladder init` runs the same fit
//! as `train-projectors`); a manifest alone already makes a ladder that re-prefills on a switch.

use std::path::{Path, PathBuf};

use super::lock::{Lock, sha256_file};
use super::manifest::{Manifest, RungSpec, Source};
use crate::engine::QuantType;
use crate::gguf::{GgufError, GgufFile, ModelFacts, TokenizerIdentity};

/// Why a ladder cannot be made of these files.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// Fewer than two files.
    #[error("a ladder needs at least two rungs; got {0} file(s)")]
    TooFew(usize),
    /// A name that cannot be a file name.
    #[error(
        "ladder name {0:?}: use letters, digits, '.', '-' or '_' (it becomes the manifest's file name)"
    )]
    BadName(String),
    /// A file that cannot be read as a GGUF model.
    #[error("{path}: not a usable GGUF model: {source}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        source: GgufError,
    },
    /// The same file given twice (by path or by content).
    #[error("{a} and {b} are the same model ({why}); give each rung once")]
    Duplicate {
        /// One file.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// Same path, or same sha256.
        why: String,
    },
    /// Two files whose tokenizers differ.
    #[error(
        "{a} and {b} do not share a tokenizer ({reason}): the tokens one rung wrote would mean other text on the other"
    )]
    Tokenizer {
        /// The first file.
        a: PathBuf,
        /// The file that differs.
        b: PathBuf,
        /// The first difference.
        reason: String,
    },
    /// Two files of exactly the same size: no order between them.
    #[error("{a} and {b} are both {bytes} bytes: a ladder orders its rungs by size, largest first")]
    SameSize {
        /// One file.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// Their size.
        bytes: u64,
    },
    /// The manifest exists already.
    #[error("{0} exists; pass --force to replace it")]
    Exists(PathBuf),
    /// A file of another content already has a rung's name in the models directory.
    #[error("{path} exists and is not {wanted}; move it away or give the file from there")]
    Occupied {
        /// The occupied name.
        path: PathBuf,
        /// The file the rung needs there.
        wanted: PathBuf,
    },
    /// A precision rung asked of a file that is already at that type.
    #[error("{file} is already {ty}: requantizing it to {ty} would make the same rung again")]
    AlreadyAt {
        /// The source file.
        file: PathBuf,
        /// The type.
        ty: QuantType,
    },
    /// The same type asked twice.
    #[error("--requantize {0} given twice; give each type once")]
    SameType(QuantType),
    /// llama.cpp's quantizer failed.
    #[error("requantizing {file} to {ty}: {source}")]
    Requantize {
        /// The source file.
        file: PathBuf,
        /// The type.
        ty: QuantType,
        /// What llama.cpp said.
        source: crate::engine::EngineError,
    },
    /// Reading or writing.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// One checked file, as it will be a rung.
#[derive(Debug, Clone)]
pub struct PlannedRung {
    /// The file as given, made absolute.
    pub path: PathBuf,
    /// Its facts.
    pub facts: ModelFacts,
    /// Its sha256.
    pub sha256: String,
    /// Its size.
    pub bytes: u64,
}

/// A checked ladder, not written yet.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The manifest, rungs largest first, named `tier0`, `tier1`, ….
    pub manifest: Manifest,
    /// The rungs in manifest order.
    pub rungs: Vec<PlannedRung>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> InitError + '_ {
    move |source| InitError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A ladder name that can be a file name.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// Checks `files` and builds the ladder `name` of them, largest first. `progress` gets a line
/// per file (hashing a model file takes seconds).
///
/// # Errors
/// [`InitError`] naming the file or files at fault.
pub fn plan(
    name: &str,
    files: &[PathBuf],
    progress: &mut dyn FnMut(&str),
) -> Result<Plan, InitError> {
    if !valid_name(name) {
        return Err(InitError::BadName(name.to_string()));
    }
    if files.len() < 2 {
        return Err(InitError::TooFew(files.len()));
    }
    // Each checked file with its tokenizer and the path as the user gave it (for messages).
    let mut rungs: Vec<(PlannedRung, TokenizerIdentity, &PathBuf)> = Vec::new();
    for f in files {
        let path = f.canonicalize().map_err(io(f))?;
        if let Some((_, _, given)) = rungs.iter().find(|(r, _, _)| r.path == path) {
            return Err(InitError::Duplicate {
                a: (*given).clone(),
                b: f.clone(),
                why: "the same file".into(),
            });
        }
        let gguf_err = |source| InitError::Gguf {
            path: f.clone(),
            source,
        };
        let gguf = GgufFile::open(&path).map_err(gguf_err)?;
        let facts = ModelFacts::from_gguf(&gguf).map_err(gguf_err)?;
        let tok = TokenizerIdentity::from_gguf(&gguf).map_err(gguf_err)?;
        if let Some((_, t0, given)) = rungs.first() {
            t0.compare(&tok).map_err(|m| InitError::Tokenizer {
                a: (*given).clone(),
                b: f.clone(),
                reason: m.reason.to_string(),
            })?;
        }
        progress(&format!("hashing {}", f.display()));
        let sha256 = sha256_file(&path, |_| {}).map_err(io(&path))?;
        if let Some((_, _, given)) = rungs.iter().find(|(r, _, _)| r.sha256 == sha256) {
            return Err(InitError::Duplicate {
                a: (*given).clone(),
                b: f.clone(),
                why: "identical contents".into(),
            });
        }
        let bytes = std::fs::metadata(&path).map_err(io(&path))?.len();
        if let Some((_, _, given)) = rungs.iter().find(|(r, _, _)| r.bytes == bytes) {
            return Err(InitError::SameSize {
                a: (*given).clone(),
                b: f.clone(),
                bytes,
            });
        }
        rungs.push((
            PlannedRung {
                path,
                facts,
                sha256,
                bytes,
            },
            tok,
            f,
        ));
    }
    let mut rungs: Vec<PlannedRung> = rungs.into_iter().map(|(r, _, _)| r).collect();
    rungs.sort_by_key(|r| std::cmp::Reverse(r.bytes));
    let specs = rungs
        .iter()
        .enumerate()
        .map(|(i, r)| RungSpec {
            name: format!("tier{i}"),
            model: describe(r),
            file: file_name(&r.path),
            sha256: Some(r.sha256.clone()),
            size: Some(r.bytes),
            source: Source::Local {},
        })
        .collect();
    Ok(Plan {
        manifest: Manifest {
            name: name.to_string(),
            description: format!("{} rungs of the user's own GGUF files", rungs.len()),
            rungs: specs,
        },
        rungs,
    })
}

/// What [`make`] builds and where.
#[derive(Debug, Clone)]
pub struct MakeOptions<'a> {
    /// The ladder's name.
    pub name: &'a str,
    /// The files given (`--rung`).
    pub files: &'a [PathBuf],
    /// Precision rungs to build from the largest file (`--requantize`), in any order.
    pub requantize: &'a [QuantType],
    /// The models directory the manifest, links and built rungs go to.
    pub dir: &'a Path,
    /// Replace a manifest of the same name and rebuild a requantized file already there.
    pub force: bool,
    /// Threads of the quantizer.
    pub threads: u32,
}

/// Builds the requantized rungs, plans the ladder of them and the given files, and writes it
/// into `o.dir`: the manifest's path and the plan. `progress` gets a line per step.
///
/// # Errors
/// [`InitError::AlreadyAt`] for a type the largest file already has, [`InitError::SameType`],
/// [`InitError::Occupied`] for a built rung's name taken by a file (without `force`),
/// [`InitError::Requantize`] when llama.cpp fails, and everything [`plan`] and [`write`]
/// refuse. On any error the files built here are removed again (a requantized file is
/// written through a partial file, so none is ever half-written in place).
pub fn make(
    o: &MakeOptions<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<(PathBuf, Plan), InitError> {
    let mut built = Vec::new();
    let result = make_inner(o, &mut built, progress);
    if result.is_err() {
        for f in &built {
            let _ = std::fs::remove_file(f);
        }
    }
    result
}

fn make_inner(
    o: &MakeOptions<'_>,
    built: &mut Vec<PathBuf>,
    progress: &mut dyn FnMut(&str),
) -> Result<(PathBuf, Plan), InitError> {
    let mut files = o.files.to_vec();
    // What `plan` and `write` would refuse only after the quantizer's minutes.
    if !valid_name(o.name) {
        return Err(InitError::BadName(o.name.to_string()));
    }
    let manifest_path = o.dir.join(format!("{}.toml", o.name));
    if manifest_path.exists() && !o.force {
        return Err(InitError::Exists(manifest_path));
    }
    if !o.requantize.is_empty() {
        if files.len() + o.requantize.len() < 2 {
            return Err(InitError::TooFew(files.len() + o.requantize.len()));
        }
        std::fs::create_dir_all(o.dir).map_err(io(o.dir))?;
        let from = largest(&files)?;
        let gguf_err = |source| InitError::Gguf {
            path: from.clone(),
            source,
        };
        let facts =
            ModelFacts::from_gguf(&GgufFile::open(&from).map_err(gguf_err)?).map_err(gguf_err)?;
        // Every request checked before the first minute of quantizing is spent.
        let mut targets = Vec::new();
        for (i, &ty) in o.requantize.iter().enumerate() {
            if o.requantize[..i].contains(&ty) {
                return Err(InitError::SameType(ty));
            }
            if facts.file_type == Some(ty.file_type()) {
                return Err(InitError::AlreadyAt { file: from, ty });
            }
            let at = o.dir.join(requantized_name(&from, ty));
            if at.symlink_metadata().is_ok() && !o.force {
                return Err(InitError::Occupied {
                    path: at,
                    wanted: PathBuf::from(format!("{} requantized to {ty}", from.display())),
                });
            }
            targets.push((ty, at));
        }
        let n = targets.len();
        for (i, (ty, at)) in targets.into_iter().enumerate() {
            progress(&format!(
                "[{}/{n}] requantizing {} to {ty} …",
                i + 1,
                from.display()
            ));
            let t = std::time::Instant::now();
            crate::engine::quantize(&from, &at, ty, o.threads.max(1)).map_err(|source| {
                InitError::Requantize {
                    file: from.clone(),
                    ty,
                    source,
                }
            })?;
            built.push(at.clone());
            let bytes = std::fs::metadata(&at).map_err(io(&at))?.len();
            progress(&format!(
                "[{}/{n}] {} written: {:.1} MiB in {:.1} s",
                i + 1,
                at.display(),
                bytes as f64 / f64::from(1 << 20),
                t.elapsed().as_secs_f64()
            ));
            files.push(at);
        }
    }
    let plan = plan(o.name, &files, progress)?;
    let manifest = write(&plan, o.dir, o.force)?;
    Ok((manifest, plan))
}

/// The largest of `files` (the rung the precision rungs are made of).
fn largest(files: &[PathBuf]) -> Result<PathBuf, InitError> {
    let mut best: Option<(u64, &PathBuf)> = None;
    for f in files {
        let bytes = std::fs::metadata(f).map_err(io(f))?.len();
        if best.is_none_or(|(b, _)| bytes > b) {
            best = Some((bytes, f));
        }
    }
    best.map(|(_, f)| f.clone()).ok_or(InitError::TooFew(0))
}

/// `model.gguf` requantized to Q2_K: `model-q2_k.gguf`.
#[must_use]
pub fn requantized_name(from: &Path, ty: QuantType) -> String {
    let stem = from
        .file_stem()
        .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
    format!("{stem}-{}.gguf", ty.name().to_lowercase())
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// `Qwen2.5 Coder 1.5B Instruct (qwen2, Q4_K - Medium, 28 layers)`.
fn describe(r: &PlannedRung) -> String {
    let f = &r.facts;
    let name = f.name.clone().unwrap_or_else(|| file_name(&r.path));
    let ty = f.file_type_name().unwrap_or("unknown type");
    format!("{name} ({}, {ty}, {} layers)", f.architecture, f.n_layer)
}

/// Writes the plan into `dir`: each file that is not there already is linked under its name,
/// the lock records the hashes already taken (a ladder opened next does not hash the files
/// again), then the manifest `<dir>/<name>.toml` (through a temporary file, so a manifest is
/// whole or absent). Returns the manifest's path.
///
/// # Errors
/// [`InitError::Exists`] for a manifest already there (unless `force`),
/// [`InitError::Occupied`] for a name taken by another file, [`InitError::Io`].
pub fn write(plan: &Plan, dir: &Path, force: bool) -> Result<PathBuf, InitError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let manifest_path = dir.join(format!("{}.toml", plan.manifest.name));
    if manifest_path.exists() && !force {
        return Err(InitError::Exists(manifest_path));
    }
    for (r, spec) in plan.rungs.iter().zip(&plan.manifest.rungs) {
        let at = dir.join(&spec.file);
        match at.canonicalize() {
            Ok(real) if real == r.path => {}
            Ok(_) => {
                return Err(InitError::Occupied {
                    path: at,
                    wanted: r.path.clone(),
                });
            }
            Err(_) => {
                if at.symlink_metadata().is_ok() {
                    // A dangling link of an earlier init: replace it.
                    std::fs::remove_file(&at).map_err(io(&at))?;
                }
                symlink(&r.path, &at).map_err(io(&at))?;
            }
        }
    }
    let lock_path = Lock::path(dir, &plan.manifest.name);
    let mut lock = Lock::load(&lock_path);
    for (r, spec) in plan.rungs.iter().zip(&plan.manifest.rungs) {
        let at = dir.join(&spec.file);
        lock.record(&at, r.sha256.clone()).map_err(io(&at))?;
    }
    lock.save(&lock_path).map_err(io(&lock_path))?;
    let text = format!(
        "# Written by `molt-run ladder init`: rungs largest first, each file checked by its sha256.\n{}",
        toml::to_string(&plan.manifest).map_err(|e| InitError::Io {
            path: manifest_path.clone(),
            source: std::io::Error::other(e),
        })?
    );
    crate::durable::write(&manifest_path, text.as_bytes()).map_err(io(&manifest_path))?;
    Ok(manifest_path)
}

#[cfg(unix)]
fn symlink(target: &Path, at: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, at)
}

#[cfg(not(unix))]
fn symlink(target: &Path, at: &Path) -> std::io::Result<()> {
    std::fs::hard_link(target, at)
}

/// A manifest found by [`list`].
#[derive(Debug, Clone)]
pub struct Found {
    /// The manifest.
    pub path: PathBuf,
    /// Its contents, or why it could not be read.
    pub manifest: Result<Manifest, String>,
}

/// Every ladder manifest (`*.toml`) in `dirs`, in order; a directory that does not exist is
/// skipped.
#[must_use]
pub fn list(dirs: &[PathBuf]) -> Vec<Found> {
    let mut out = Vec::new();
    for d in dirs {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        paths.sort();
        for path in paths {
            let manifest = Manifest::load(&path).map_err(|e| e.to_string());
            out.push(Found { path, manifest });
        }
    }
    out
}
