//! Where ladders and their models are found, in a documented order:
//!
//! 1. an explicit path (`--ladder path/to/ladder.toml`), with models beside it unless
//!    `--models-dir` says otherwise;
//! 2. `$MOLT_HOME/models/<name>.toml`;
//! 3. `./models/<name>.toml` (running from a checkout of the repository);
//! 4. the per-user data directory, `$XDG_DATA_HOME/molt/models` or
//!    `~/.local/share/molt/models`.
//!
//! The default ladder's manifest is compiled into the binary, so an installed `molt-run fetch`
//! can write it to the per-user directory and fetch there when no other location has it.

use std::path::{Path, PathBuf};

/// The shipped ladder's name.
pub const DEFAULT_LADDER: &str = "qwen2.5-coder";

/// The shipped ladder's manifest, compiled in.
pub const DEFAULT_MANIFEST: &str = include_str!("../../models/qwen2.5-coder.toml");

/// A resolved ladder location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The manifest file.
    pub manifest: PathBuf,
    /// The models directory.
    pub models_dir: PathBuf,
}

/// The per-user models directory.
pub fn user_models_dir() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("molt").join("models"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/molt/models"))
}

/// The directories searched for `<name>.toml`, in order.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(h) = std::env::var_os("MOLT_HOME").filter(|v| !v.is_empty()) {
        v.push(PathBuf::from(h).join("models"));
    }
    v.push(PathBuf::from("models"));
    if let Some(u) = user_models_dir() {
        v.push(u);
    }
    v
}

/// Resolves `--ladder` (a path or a name) and `--models-dir`.
///
/// When `create_default` is set and the default ladder is not found anywhere, its compiled-in
/// manifest is written to the first writable search directory (what `molt-run fetch` does on a
/// machine that only has the installed binary).
///
/// # Errors
/// A message listing every place that was searched.
pub fn locate(
    ladder: &str,
    models_dir: Option<&Path>,
    create_default: bool,
) -> Result<Located, String> {
    let as_path = Path::new(ladder);
    let manifest =
        if as_path.extension().is_some_and(|e| e == "toml") || as_path.components().count() > 1 {
            if !as_path.exists() {
                return Err(format!(
                    "ladder manifest {} does not exist",
                    as_path.display()
                ));
            }
            as_path.to_path_buf()
        } else {
            let dirs = search_dirs();
            match dirs
                .iter()
                .map(|d| d.join(format!("{ladder}.toml")))
                .find(|p| p.exists())
            {
                Some(p) => p,
                None if create_default && ladder == DEFAULT_LADDER => {
                    let dir = dirs
                        .iter()
                        .find(|d| std::fs::create_dir_all(d).is_ok())
                        .ok_or("no writable models directory")?;
                    let p = dir.join(format!("{ladder}.toml"));
                    std::fs::write(&p, DEFAULT_MANIFEST)
                        .map_err(|e| format!("{}: {e}", p.display()))?;
                    p
                }
                None => {
                    let tried: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
                    return Err(format!(
                        "no ladder named {ladder:?} in {}",
                        tried.join(", ")
                    ));
                }
            }
        };
    // The model files sit beside their manifest (a ladder found by name in
    // `$MOLT_HOME/models` has them there); a manifest given by path is never redirected.
    let models_dir = match models_dir {
        Some(d) => d.to_path_buf(),
        None => manifest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
    };
    Ok(Located {
        manifest,
        models_dir,
    })
}
