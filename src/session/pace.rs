//! What carrying a conversation onto each rung has cost on this machine, kept between processes
//! ([`SessionOptions::pace_file`](super::SessionOptions::pace_file)).
//!
//! The shadow is not started when its carry could not finish before the falling budget stops
//! holding both rungs (`super::shadow`); that needs the carry's pace, which a process only
//! learns from its own carries, so a new process (a one-shot `generate`, a restarted server)
//! tried its first shadow blind. The file keeps the last pace measured per rung file and thread
//! count, bound to the processor ([`crate::speed::this_cpu`]): a file of another processor, of
//! another format, or that does not parse is not used (the session says why, and the next
//! measurement replaces it). Written atomically after an answer that measured something new.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::shadow::CarryPace;

/// Format of the file; another is not read.
pub const PACE_FORMAT: u32 = 1;

/// The per-user default: `$XDG_DATA_HOME/molt/carry_pace.json`, else
/// `~/.local/share/molt/carry_pace.json`.
#[must_use]
pub fn default_pace_file() -> Option<PathBuf> {
    crate::state::default_state_dir().and_then(|d| d.parent().map(|p| p.join("carry_pace.json")))
}

/// One rung's pace, as `CarryPace` keeps it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PaceEntry {
    /// ms per carried cell on a background carry's share of the cores.
    pub ms_per_cell: Option<f64>,
    /// The rung's last load from its file, ms.
    pub load_ms: Option<f64>,
}

impl PaceEntry {
    /// What the session keeps of `p`.
    pub(super) fn of(p: CarryPace) -> Self {
        Self {
            ms_per_cell: p.ms_per_cell,
            load_ms: p.load_ms,
        }
    }

    /// The pace this entry gives the session: values that are not positive and finite are
    /// not taken.
    pub(super) fn pace(self) -> CarryPace {
        CarryPace {
            ms_per_cell: self.ms_per_cell.filter(|v| v.is_finite() && *v > 0.0),
            load_ms: self.load_ms.filter(|v| v.is_finite() && *v > 0.0),
        }
    }
}

/// The file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PaceFile {
    /// [`PACE_FORMAT`].
    pub format: u32,
    /// The processor the paces were measured on.
    pub cpu: String,
    /// Pace per rung file and thread count: key `<sha256>@<threads>`.
    pub rungs: BTreeMap<String, PaceEntry>,
}

/// The key of a rung file's pace at `threads` threads.
#[must_use]
pub fn key(sha256: &str, threads: u32) -> String {
    format!("{sha256}@{threads}")
}

impl PaceFile {
    /// An empty file of this processor.
    #[must_use]
    pub fn new() -> Self {
        Self {
            format: PACE_FORMAT,
            cpu: crate::speed::this_cpu(),
            rungs: BTreeMap::new(),
        }
    }

    /// Reads `path`: `Ok(None)` when there is no file; `Err` with why a file is not used (it
    /// does not parse, another format, another processor).
    ///
    /// # Errors
    /// The reason, naming the file.
    pub fn load(path: &Path) -> Result<Option<Self>, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("carry pace file {}: {e}", path.display())),
        };
        let f: Self = serde_json::from_str(&text)
            .map_err(|e| format!("carry pace file {} does not parse: {e}", path.display()))?;
        if f.format != PACE_FORMAT {
            return Err(format!(
                "carry pace file {} is format {}, this build reads {PACE_FORMAT}",
                path.display(),
                f.format
            ));
        }
        let here = crate::speed::this_cpu();
        if f.cpu != here {
            return Err(format!(
                "carry pace file {} was measured on {}, this is {here}",
                path.display(),
                f.cpu
            ));
        }
        Ok(Some(f))
    }

    /// Writes the file whole, atomically (temp file and rename), making its directory.
    ///
    /// # Errors
    /// The I/O error.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        crate::durable::write(path, text.as_bytes())
    }
}

impl Default for PaceFile {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_round_trips_and_one_of_another_processor_or_format_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sub").join("carry_pace.json");
        assert_eq!(PaceFile::load(&path).unwrap(), None, "no file: nothing");
        let mut f = PaceFile::new();
        f.rungs.insert(
            key("abc", 2),
            PaceEntry {
                ms_per_cell: Some(1.5),
                load_ms: Some(400.0),
            },
        );
        f.save(&path).unwrap();
        assert_eq!(PaceFile::load(&path).unwrap(), Some(f.clone()));
        let mut other = f.clone();
        other.cpu = "another processor".into();
        other.save(&path).unwrap();
        let e = PaceFile::load(&path).unwrap_err();
        assert!(
            e.contains("another processor") && e.contains("carry_pace.json"),
            "{e}"
        );
        let mut old = f;
        old.format = 0;
        old.save(&path).unwrap();
        assert!(PaceFile::load(&path).unwrap_err().contains("format 0"));
        std::fs::write(&path, "{ not json").unwrap();
        assert!(
            PaceFile::load(&path)
                .unwrap_err()
                .contains("does not parse")
        );
    }

    #[test]
    fn a_measured_nonsense_pace_is_not_taken() {
        let p = PaceEntry {
            ms_per_cell: Some(f64::NAN),
            load_ms: Some(-1.0),
        }
        .pace();
        assert_eq!(p, CarryPace::default());
    }
}
