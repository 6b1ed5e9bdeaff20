//! How fast each rung runs, and at what memory: the prompt micro-batch and llama.cpp's CPU
//! repack, chosen per rung when it loads.
//!
//! Both knobs buy prefill (and, for repack, decode) speed with memory: a micro-batch of 512
//! reserves a compute buffer four times the default's, and repack copies the weights into
//! anonymous memory beside the mapped file. Which is worth it is a fact of the machine, so it
//! is measured, not assumed: `molt-run bench --speed --tune` measures every setting of every
//! rung and writes the rows to `<projectors>/<ladder>/speed_settings.json` ([`SpeedFile`]),
//! each rung's rows bound to the sha256 of its GGUF file as projectors are.
//!
//! At load, [`SpeedPolicy::choose`] picks a rung's [`RungSetup`]: with a measurement of the
//! rung and a budget read, the fastest setting whose extra memory fits what the budget leaves
//! above the rung's default footprint ([`choose_setting`]); without
//! either, Molt's default (micro-batch 128, repack off); an explicit `--ubatch` or
//! `MOLT_REPACK` wins over both. The setup's extra bytes are part of the rung's cost the
//! session's policy compares with the budget ([`crate::session::Session::rung_costs`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ladder::Ladder;

/// How a rung's engine is set up for speed: the prompt micro-batch and llama.cpp's CPU repack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setting {
    /// Tokens per micro-batch.
    pub n_ubatch: u32,
    /// llama.cpp's CPU repack of the weights (`use_extra_bufts`).
    pub repack: bool,
}

impl Setting {
    /// Molt's setting when nothing else is asked.
    #[must_use]
    pub fn molt_default() -> Self {
        Self {
            n_ubatch: crate::engine::DEFAULT_N_UBATCH,
            repack: false,
        }
    }

    /// The settings `--tune` measures: micro-batches of 128, 256 and 512, repack off and on.
    #[must_use]
    pub fn grid() -> Vec<Self> {
        [false, true]
            .into_iter()
            .flat_map(|repack| [128, 256, 512].map(|n_ubatch| Self { n_ubatch, repack }))
            .collect()
    }
}

/// Molt beside the peer at one setting on one rung (medians over repetitions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRow {
    /// Rung name.
    pub rung: String,
    /// Tokens per micro-batch.
    pub n_ubatch: u32,
    /// llama.cpp's CPU repack.
    pub repack: bool,
    /// Molt's prefill, tok/s.
    pub prefill_tok_s: f64,
    /// Molt's decode, tok/s.
    pub decode_tok_s: f64,
    /// The peer's prefill, tok/s.
    pub peer_prefill_tok_s: f64,
    /// The peer's decode, tok/s.
    pub peer_decode_tok_s: f64,
    /// `prefill_tok_s / peer_prefill_tok_s`.
    pub prefill_ratio: f64,
    /// `decode_tok_s / peer_decode_tok_s`.
    pub decode_ratio: f64,
    /// Every repetition: Molt prefill, Molt decode, peer prefill, peer decode.
    pub samples: Vec<[f64; 4]>,
    /// What llama.cpp reserved for Molt's context (KV, compute, output buffers), MiB.
    pub reserved_mib: f64,
    /// Anonymous memory the model load added (repacked weights, tokenizer tables), MiB.
    pub load_anon_mib: f64,
}

/// Prompt tokens of the reference turn [`choose_setting`] times: a chat turn that reads about a
/// page (a question with some pasted context, or the new turn plus what a switch re-reads).
pub const TURN_PROMPT_TOKENS: f64 = 256.0;
/// Answer tokens of the reference turn: a few paragraphs.
pub const TURN_ANSWER_TOKENS: f64 = 256.0;
/// How much faster than the default a setting's reference turn must be to be taken: less is
/// within the repetitions' noise, and a change reloads the rung.
pub const TURN_GAIN: f64 = 0.97;

/// Seconds the reference turn takes at a row's measured speeds: the prompt read at its prefill
/// rate, the answer written at its decode rate — what the user waits for, first token and
/// last.
#[must_use]
pub fn turn_seconds(r: &PeerRow) -> f64 {
    TURN_PROMPT_TOKENS / r.prefill_tok_s.max(1e-9) + TURN_ANSWER_TOKENS / r.decode_tok_s.max(1e-9)
}

/// The speed setting for a rung given the memory it may use beyond its default footprint: of
/// the measured rows of that rung, the one whose reference turn ([`TURN_PROMPT_TOKENS`] read,
/// [`TURN_ANSWER_TOKENS`] written) takes least time and whose extra memory over Molt's default
/// (a larger compute buffer, repacked weights) fits `spare_bytes` — taken only when it is at
/// least 3% faster than the default's. Prefill speed alone would be the wrong measure: on this
/// machine repack slows tier0's prefill by a third and speeds its decode by a third, and a
/// user waits for the whole answer. Molt's default when no row beats it within the room.
#[must_use]
pub fn choose_setting(rows: &[PeerRow], rung: &str, spare_bytes: u64) -> Setting {
    let default = Setting::molt_default();
    let of_rung: Vec<&PeerRow> = rows.iter().filter(|r| r.rung == rung).collect();
    let Some(base) = of_rung
        .iter()
        .find(|r| r.n_ubatch == default.n_ubatch && r.repack == default.repack)
    else {
        return default;
    };
    let cost = |r: &PeerRow| {
        ((r.reserved_mib - base.reserved_mib).max(0.0)
            + (r.load_anon_mib - base.load_anon_mib).max(0.0))
            * 1_048_576.0
    };
    of_rung
        .iter()
        .filter(|r| cost(r) <= spare_bytes as f64)
        .min_by(|a, b| turn_seconds(a).total_cmp(&turn_seconds(b)))
        .filter(|r| turn_seconds(r) < turn_seconds(base) * TURN_GAIN)
        .map_or(default, |r| Setting {
            n_ubatch: r.n_ubatch,
            repack: r.repack,
        })
}

/// The file name of a ladder's measured speed settings.
pub const FILE_NAME: &str = "speed_settings.json";

/// Why a speed-settings file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SpeedFileError {
    /// Reading or writing failed.
    #[error("speed settings {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a speed-settings document.
    #[error("speed settings {}: not a speed-settings file ({source})", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A rung's rows were measured on another GGUF file than the ladder's.
    #[error(
        "speed settings {}: rung {rung} was measured on another file (sha256 {found}, the ladder's is {expected}); its rows are ignored — run `molt-run bench --speed --tune` again",
        path.display()
    )]
    Stale {
        /// The file.
        path: PathBuf,
        /// The rung.
        rung: String,
        /// The ladder's sha256 of the rung's file.
        expected: String,
        /// The sha256 the rows were measured on.
        found: String,
    },
    /// The file was measured on another processor: speeds are a fact of the machine.
    #[error(
        "speed settings {}: measured on another processor ({measured}; this one is {here}); ignored — run `molt-run bench --speed --tune` to measure this one",
        path.display()
    )]
    OtherCpu {
        /// The file.
        path: PathBuf,
        /// The processor the rows were measured on.
        measured: String,
        /// This machine's.
        here: String,
    },
    /// The file measured a rung the ladder does not have.
    #[error("speed settings {}: the ladder has no rung {rung}; its rows are ignored", path.display())]
    UnknownRung {
        /// The file.
        path: PathBuf,
        /// The rung.
        rung: String,
    },
}

/// One rung's measured rows, bound to the file they were measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RungRows {
    /// Rung name.
    pub rung: String,
    /// The GGUF file name.
    pub file: String,
    /// Its sha256.
    pub sha256: String,
    /// Every measured setting (Molt beside the peer, the memory each costs).
    pub rows: Vec<PeerRow>,
}

/// `<projectors>/<ladder>/speed_settings.json`: what `bench --speed --tune` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpeedFile {
    /// Ladder name.
    pub ladder: String,
    /// Threads the rows were measured with.
    pub threads: u32,
    /// The processor they were measured on ([`this_cpu`]); rows of another are not used.
    #[serde(default)]
    pub cpu: Option<String>,
    /// Per rung.
    pub rungs: Vec<RungRows>,
}

/// This machine's processor as a speed measurement is bound to it: the model name the kernel
/// reports and the number of logical CPUs (`Intel(R) Xeon(R) … × 2`).
#[must_use]
pub fn this_cpu() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    format!("{model} × {n}")
}

impl SpeedFile {
    /// The rows of `rows` for the rungs of `ladder` they measured, bound to its files.
    #[must_use]
    pub fn of(ladder: &Ladder, threads: u32, rows: &[PeerRow]) -> Self {
        let rungs = ladder
            .rungs
            .iter()
            .map(|r| RungRows {
                rung: r.name().to_string(),
                file: r.spec.file.clone(),
                sha256: r.sha256.clone(),
                rows: rows
                    .iter()
                    .filter(|p| p.rung == r.name())
                    .cloned()
                    .collect(),
            })
            .filter(|r| !r.rows.is_empty())
            .collect();
        Self {
            ladder: ladder.name().to_string(),
            threads,
            cpu: Some(this_cpu()),
            rungs,
        }
    }

    /// Where a ladder's file lives under a projector directory.
    #[must_use]
    pub fn path(dir: &Path, ladder: &str) -> PathBuf {
        dir.join(ladder).join(FILE_NAME)
    }

    /// Writes the file under `dir` durably (whole or not at all); returns its path.
    ///
    /// # Errors
    /// [`SpeedFileError::Io`] naming the file.
    pub fn save(&self, dir: &Path) -> Result<PathBuf, SpeedFileError> {
        let path = Self::path(dir, &self.ladder);
        let io = |source| SpeedFileError::Io {
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let json = serde_json::to_vec_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        crate::durable::write(&path, &json).map_err(io)?;
        Ok(path)
    }

    /// Reads a file.
    ///
    /// # Errors
    /// [`SpeedFileError::Io`] or [`SpeedFileError::Parse`] naming the file.
    pub fn load(path: &Path) -> Result<Self, SpeedFileError> {
        let bytes = std::fs::read(path).map_err(|source| SpeedFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| SpeedFileError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The rows usable on `ladder`: those of rungs whose file is the one measured. Each rung
    /// measured on another file (or absent from the ladder) is left out and reported.
    #[must_use]
    pub fn bind(self, ladder: &Ladder, path: &Path) -> (Measured, Vec<SpeedFileError>) {
        let mut rows = Vec::new();
        let mut refused = Vec::new();
        for r in self.rungs {
            match ladder.rungs.iter().find(|l| l.name() == r.rung) {
                None => refused.push(SpeedFileError::UnknownRung {
                    path: path.to_path_buf(),
                    rung: r.rung,
                }),
                Some(l) if l.sha256 != r.sha256 => refused.push(SpeedFileError::Stale {
                    path: path.to_path_buf(),
                    rung: r.rung,
                    expected: l.sha256.clone(),
                    found: r.sha256,
                }),
                // Rows name their rung; keep only those that say this one.
                Some(_) => rows.extend(r.rows.into_iter().filter(|p| p.rung == r.rung)),
            }
        }
        (
            Measured {
                rows,
                path: path.to_path_buf(),
            },
            refused,
        )
    }
}

/// Measured rows a session may use: every rung's rows bound to the ladder's own files.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Measured {
    /// The rows.
    pub rows: Vec<PeerRow>,
    /// The file they came from.
    pub path: PathBuf,
}

impl Measured {
    /// The ladder's measured settings from the first of `dirs` holding its file: `None` when
    /// none does; otherwise the usable rows and, as warnings, what was refused (an unreadable
    /// file, rows of another file).
    #[must_use]
    pub fn find(dirs: &[PathBuf], ladder: &Ladder) -> (Option<Self>, Vec<SpeedFileError>) {
        let Some(path) = dirs
            .iter()
            .map(|d| SpeedFile::path(d, ladder.name()))
            .find(|p| p.exists())
        else {
            return (None, Vec::new());
        };
        match SpeedFile::load(&path) {
            Err(e) => (None, vec![e]),
            Ok(f) if f.cpu.as_ref().is_some_and(|c| *c != this_cpu()) => (
                None,
                vec![SpeedFileError::OtherCpu {
                    path,
                    measured: f.cpu.unwrap_or_default(),
                    here: this_cpu(),
                }],
            ),
            Ok(f) => {
                let (m, refused) = f.bind(ladder, &path);
                ((!m.rows.is_empty()).then_some(m), refused)
            }
        }
    }

    /// Whether `rung` has a measurement of Molt's default setting (what every other setting's
    /// extra memory is counted from).
    #[must_use]
    pub fn covers(&self, rung: &str) -> bool {
        let d = Setting::molt_default();
        self.rows
            .iter()
            .any(|r| r.rung == rung && r.n_ubatch == d.n_ubatch && r.repack == d.repack)
    }

    /// The extra memory `setting` costs on `rung` over Molt's default, as measured: the larger
    /// compute buffer and the anonymous memory repack adds. 0 without both rows.
    #[must_use]
    pub fn extra_bytes(&self, rung: &str, setting: Setting) -> u64 {
        let d = Setting::molt_default();
        let find = |s: Setting| {
            self.rows
                .iter()
                .find(|r| r.rung == rung && r.n_ubatch == s.n_ubatch && r.repack == s.repack)
        };
        match (find(d), find(setting)) {
            (Some(base), Some(r)) => {
                let mib = (r.reserved_mib - base.reserved_mib).max(0.0)
                    + (r.load_anon_mib - base.load_anon_mib).max(0.0);
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let bytes = (mib * 1_048_576.0) as u64;
                bytes
            }
            _ => 0,
        }
    }
}

/// Where a rung's setup came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SetupSource {
    /// Molt's default: no measurement of the rung, or no budget read yet.
    Default,
    /// Chosen from the measured rows and the budget.
    Measured,
    /// Asked for explicitly (`--ubatch`, `MOLT_REPACK`).
    Forced,
}

/// How one rung is loaded for speed, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RungSetup {
    /// Micro-batch and repack.
    pub setting: Setting,
    /// Where the choice came from.
    pub source: SetupSource,
    /// The memory the setting costs above Molt's default, as measured (0 when unmeasured);
    /// the session counts it in the rung's cost until the load's own measurement has it.
    pub extra_bytes: u64,
    /// The spare memory the choice was made within (measured choices only).
    pub spare_bytes: Option<u64>,
}

impl RungSetup {
    /// Molt's default setup at micro-batch `n_ubatch`, repack off.
    #[must_use]
    pub fn default_at(n_ubatch: u32) -> Self {
        Self {
            setting: Setting {
                n_ubatch,
                repack: false,
            },
            source: SetupSource::Default,
            extra_bytes: 0,
            spare_bytes: None,
        }
    }
}

impl std::fmt::Display for RungSetup {
    /// `ubatch 512, repack on (measured: fastest within 1200 MiB spare, +620 MiB)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ubatch {}, repack {} (",
            self.setting.n_ubatch,
            if self.setting.repack { "on" } else { "off" }
        )?;
        match (self.source, self.spare_bytes) {
            (SetupSource::Default, _) => write!(f, "default")?,
            (SetupSource::Forced, _) => write!(f, "forced by --ubatch / MOLT_REPACK")?,
            // A budget of a pebibyte or more is no budget (the server's "unlimited").
            (SetupSource::Measured, Some(spare)) if spare >= 1 << 49 => {
                write!(f, "measured: fastest, no budget")?
            }
            (SetupSource::Measured, Some(spare)) => {
                write!(f, "measured: fastest within {} MiB spare", spare >> 20)?
            }
            (SetupSource::Measured, None) => write!(f, "measured")?,
        }
        if self.extra_bytes > 0 {
            write!(f, ", +{} MiB", self.extra_bytes >> 20)?;
        }
        write!(f, ")")
    }
}

/// The session's speed policy: the measured rows (if any) and what was asked explicitly.
#[derive(Debug, Clone, Default)]
pub struct SpeedPolicy {
    /// The ladder's measured rows.
    pub measured: Option<std::sync::Arc<Measured>>,
    /// An explicit micro-batch (`--ubatch`): the policy keeps its hands off it.
    pub forced_ubatch: Option<u32>,
    /// An explicit repack (`MOLT_REPACK`).
    pub forced_repack: Option<bool>,
}

impl SpeedPolicy {
    /// No measurement; repack forced when `MOLT_REPACK` is set (`0` forces it off).
    #[must_use]
    pub fn from_env() -> Self {
        Self {
            measured: None,
            forced_ubatch: None,
            forced_repack: forced_repack_from_env(),
        }
    }

    /// The setup of `rung`. `default_ubatch` is the session's own micro-batch (the context
    /// configuration's); `spare_bytes` what the budget last read leaves above the rung's
    /// footprint at that default, `None` when no budget has been read. Anything forced wins
    /// (the knob not forced keeps its default); otherwise a measured rung with a known spare
    /// gets [`choose_setting`]'s pick; otherwise the default.
    #[must_use]
    pub fn choose(&self, rung: &str, default_ubatch: u32, spare_bytes: Option<u64>) -> RungSetup {
        let default = RungSetup::default_at(default_ubatch);
        let extra = |s: Setting| self.measured.as_ref().map_or(0, |m| m.extra_bytes(rung, s));
        if self.forced_ubatch.is_some() || self.forced_repack.is_some() {
            let setting = Setting {
                n_ubatch: self.forced_ubatch.unwrap_or(default_ubatch),
                repack: self.forced_repack.unwrap_or(false),
            };
            return RungSetup {
                setting,
                source: SetupSource::Forced,
                extra_bytes: extra(setting),
                spare_bytes: None,
            };
        }
        match (self.measured.as_ref(), spare_bytes) {
            (Some(m), Some(spare)) if m.covers(rung) => {
                let setting = choose_setting(&m.rows, rung, spare);
                RungSetup {
                    setting,
                    source: SetupSource::Measured,
                    extra_bytes: m.extra_bytes(rung, setting),
                    spare_bytes: Some(spare),
                }
            }
            _ => default,
        }
    }
}

/// `MOLT_REPACK`: unset or empty → not forced; `0` → forced off; anything else → forced on.
#[must_use]
pub fn forced_repack_from_env() -> Option<bool> {
    std::env::var_os("MOLT_REPACK")
        .filter(|v| !v.is_empty())
        .map(|v| v != "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        rung: &str,
        n_ubatch: u32,
        repack: bool,
        prefill: f64,
        reserved: f64,
        anon: f64,
    ) -> PeerRow {
        PeerRow {
            rung: rung.into(),
            n_ubatch,
            repack,
            prefill_tok_s: prefill,
            decode_tok_s: 25.0,
            peer_prefill_tok_s: prefill,
            peer_decode_tok_s: 25.0,
            prefill_ratio: 1.0,
            decode_ratio: 1.0,
            samples: vec![],
            reserved_mib: reserved,
            load_anon_mib: anon,
        }
    }

    fn measured() -> Measured {
        Measured {
            rows: vec![
                row("r", 128, false, 70.0, 100.0, 10.0),
                row("r", 512, false, 80.0, 330.0, 10.0),
                row("r", 128, true, 110.0, 100.0, 610.0),
            ],
            path: PathBuf::from("x"),
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_extra_memory_of_a_setting_is_counted_from_the_default_row() {
        let m = measured();
        let repack = Setting {
            n_ubatch: 128,
            repack: true,
        };
        assert_eq!(m.extra_bytes("r", repack), 600 * MIB);
        assert_eq!(
            m.extra_bytes(
                "r",
                Setting {
                    n_ubatch: 512,
                    repack: false
                }
            ),
            230 * MIB
        );
        assert_eq!(m.extra_bytes("r", Setting::molt_default()), 0);
        assert_eq!(m.extra_bytes("other", repack), 0);
    }

    #[test]
    fn the_policy_chooses_by_spare_memory_and_yields_to_what_is_forced() {
        let p = SpeedPolicy {
            measured: Some(std::sync::Arc::new(measured())),
            ..SpeedPolicy::default()
        };
        // No budget read: the default.
        assert_eq!(p.choose("r", 128, None), RungSetup::default_at(128));
        // A tight budget: measured, but nothing faster fits.
        let tight = p.choose("r", 128, Some(100 * MIB));
        assert_eq!(tight.source, SetupSource::Measured);
        assert_eq!(tight.setting, Setting::molt_default());
        assert_eq!(tight.extra_bytes, 0);
        // Room for repack: it is taken, and its cost is carried.
        let roomy = p.choose("r", 128, Some(700 * MIB));
        assert!(roomy.setting.repack);
        assert_eq!(roomy.extra_bytes, 600 * MIB);
        // An unmeasured rung keeps the default.
        assert_eq!(
            p.choose("s", 128, Some(700 * MIB)),
            RungSetup::default_at(128)
        );
        // Forced knobs win; the other keeps its default.
        let forced = SpeedPolicy {
            forced_ubatch: Some(512),
            ..p.clone()
        }
        .choose("r", 128, Some(10_000 * MIB));
        assert_eq!(forced.source, SetupSource::Forced);
        assert_eq!(
            forced.setting,
            Setting {
                n_ubatch: 512,
                repack: false
            }
        );
        assert_eq!(forced.extra_bytes, 230 * MIB);
        let off = SpeedPolicy {
            forced_repack: Some(false),
            ..p
        }
        .choose("r", 128, Some(10_000 * MIB));
        assert_eq!(off.setting, Setting::molt_default());
        assert_eq!(off.source, SetupSource::Forced);
    }

    #[test]
    fn a_setup_says_what_it_is_and_why() {
        let p = SpeedPolicy {
            measured: Some(std::sync::Arc::new(measured())),
            ..SpeedPolicy::default()
        };
        let s = p.choose("r", 128, Some(700 * MIB)).to_string();
        assert_eq!(
            s,
            "ubatch 128, repack on (measured: fastest within 700 MiB spare, +600 MiB)"
        );
        assert_eq!(
            RungSetup::default_at(128).to_string(),
            "ubatch 128, repack off (default)"
        );
    }
}
