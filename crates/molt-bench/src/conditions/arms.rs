//! The benchmark's grid: the arms ([`ArmSpec`], every one in [`all_arms`], chosen by
//! [`select_arms`]) and the prompts each of them answers ([`PromptSpec`], read by
//! [`load_prompts`]). One cell of the report is one arm on one prompt.
//!
//! An arm is data, not code: where it starts, how it changes rung, which projector family it
//! uses per route kind and which of D's options it turns on. The session reads those fields;
//! nothing here runs a model.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use molt::routes::RouteKind;
use molt::routes::Variant;
use molt::session::{DEFAULT_HEAD_REREAD, DEFAULT_REFILL_CHUNK, Strategy};

/// One prompt of the benchmark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptSpec {
    /// Short identifier.
    pub id: String,
    /// `code` or `general`.
    pub kind: String,
    /// The user turn.
    pub prompt: String,
}

/// Reads a JSONL prompt file: one `{"id", "kind", "prompt"}` object per line; blank lines and
/// lines starting with `//` are skipped.
///
/// # Errors
/// [`BenchError::Io`] when the file cannot be read, [`BenchError::Prompts`] naming the line of
/// a malformed entry or a duplicate id.
pub fn load_prompts(path: &Path) -> Result<Vec<PromptSpec>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out: Vec<PromptSpec> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        let bad = |message: String| BenchError::Prompts {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let p: PromptSpec = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if p.prompt.trim().is_empty() {
            return Err(bad("empty prompt".into()));
        }
        if out.iter().any(|q| q.id == p.id) {
            return Err(bad(format!("duplicate id {:?}", p.id)));
        }
        out.push(p);
    }
    if out.is_empty() {
        return Err(BenchError::Prompts {
            path: path.to_path_buf(),
            line: 0,
            message: "no prompts".into(),
        });
    }
    Ok(out)
}

/// Where an arm starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartRung {
    /// The largest rung (index 0).
    Largest,
    /// The smallest rung.
    Smallest,
}

/// One experimental arm.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmSpec {
    /// Short id (`A`, `D-no-sandwich`, …).
    pub id: String,
    /// What the arm is, in a few words.
    pub label: String,
    /// What an ablation takes away from D (empty for A–D).
    pub removes: String,
    /// Where it starts.
    pub start: StartRung,
    /// How it changes rung.
    pub strategy: Strategy,
    /// Projector family on precision routes (same geometry, other quantization).
    pub precision: Variant,
    /// Projector family on size routes (other depth / head size).
    pub size: Variant,
    /// False for a slot whose mechanism is not built yet (listed, never run).
    pub built: bool,
    /// Selective top-k recompute: the destination's last k blocks computed natively at a
    /// switch instead of projected (`None`: every layer projected).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk: Option<usize>,
    /// Tail recompute: the last n history tokens re-read natively on the destination at a
    /// switch (0: every position projected).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tail: usize,
    /// Head re-read: the first n history positions given the destination's own K/V at a
    /// switch (anchor, then decode) instead of projected rows (0: every position projected;
    /// [`DEFAULT_HEAD_REREAD`] in every Molt arm but the `D-head*` and `D-no-head` ones).
    #[serde(default)]
    pub head: usize,
    /// Background refill: after a switch the destination re-reads the history natively, n
    /// tokens between two generated tokens, and takes over once caught up (0: off).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refill: usize,
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl ArmSpec {
    fn new(id: &str, label: &str, start: StartRung, strategy: Strategy) -> Self {
        Self {
            id: id.into(),
            label: label.into(),
            removes: String::new(),
            start,
            strategy,
            precision: Variant::Auto,
            size: Variant::Auto,
            built: true,
            topk: None,
            tail: 0,
            head: DEFAULT_HEAD_REREAD,
            refill: DEFAULT_REFILL_CHUNK,
        }
    }

    /// Molt with a refill of `n` positions per step instead of the default's
    /// ([`DEFAULT_REFILL_CHUNK`]); `n = 0` is `D-no-refill`, the size switch's cells left as
    /// projected and recomputed.
    fn refill(n: usize) -> Self {
        let (id, removes) = if n == 0 {
            (
                "D-no-refill".to_string(),
                "without the refill after a size switch".to_string(),
            )
        } else {
            (
                format!("D-refill{n}"),
                format!("with a refill of {n} positions per step (not {DEFAULT_REFILL_CHUNK})"),
            )
        };
        Self {
            refill: n,
            ..Self::ablation(&id, &removes, Variant::Auto, Variant::Auto)
        }
    }

    /// Molt with a head re-read of `n` tokens instead of the default's
    /// ([`DEFAULT_HEAD_REREAD`]); `n = 0` is `D-no-head`, every position projected.
    fn head(n: usize) -> Self {
        let (id, removes) = if n == 0 {
            (
                "D-no-head".to_string(),
                "without the head re-read (every position projected)".to_string(),
            )
        } else {
            (
                format!("D-head{n}"),
                format!("with the first {n} tokens re-read natively (not {DEFAULT_HEAD_REREAD})"),
            )
        };
        Self {
            head: n,
            ..Self::ablation(&id, &removes, Variant::Auto, Variant::Auto)
        }
    }

    fn tail(n: usize) -> Self {
        Self {
            tail: n,
            ..Self::ablation(
                &format!("D-tail{n}"),
                &format!("with the last {n} tokens re-read natively after the projection"),
                Variant::Auto,
                Variant::Auto,
            )
        }
    }

    /// An option arm: one of D's off-by-default options turned on (top-k recompute, tail
    /// recompute, background refill) or a head re-read of another length than the default's,
    /// selected by id only. `D-no-head` (no head re-read) is an ablation, like the others
    /// that remove one mechanism.
    #[must_use]
    pub fn is_option(&self) -> bool {
        self.topk.is_some()
            || self.tail > 0
            || (self.refill > 0 && self.refill != DEFAULT_REFILL_CHUNK)
            || (self.head != 0 && self.head != DEFAULT_HEAD_REREAD)
    }

    fn topk(k: usize) -> Self {
        Self {
            topk: Some(k),
            ..Self::ablation(
                &format!("D-topk{k}"),
                &format!("with the last {k} layers recomputed natively instead of projected"),
                Variant::Auto,
                Variant::Auto,
            )
        }
    }

    fn ablation(id: &str, removes: &str, precision: Variant, size: Variant) -> Self {
        Self {
            removes: removes.into(),
            precision,
            size,
            ..Self::new(
                id,
                &format!("Molt {removes}"),
                StartRung::Largest,
                Strategy::Molt,
            )
        }
    }

    /// Whether the arm changes rung under pressure.
    #[must_use]
    pub fn switches(&self) -> bool {
        self.strategy != Strategy::Never
    }

    /// The projector family this arm uses on a route of `kind`.
    #[must_use]
    pub fn variant(&self, kind: RouteKind) -> Variant {
        match kind {
            RouteKind::Precision => self.precision,
            RouteKind::Size => self.size,
        }
    }
}

/// Every arm, in table order. An ablation changes D on exactly one mechanism; on a route kind
/// where that mechanism does not exist it keeps D's map (there is no depth remap on the
/// precision route, no diagonal scale on the size route).
#[must_use]
pub fn all_arms() -> Vec<ArmSpec> {
    use Variant::{Auto, Dense, Identity, NoRemap, NoSandwich, PerHead, Truncate};
    vec![
        ArmSpec::new(
            "A",
            "always-large: hold the big rung",
            StartRung::Largest,
            Strategy::Never,
        ),
        ArmSpec::new(
            "B",
            "always-small: run the small rung",
            StartRung::Smallest,
            Strategy::Never,
        ),
        ArmSpec::new(
            "C",
            "restart-on-pressure: switch and re-prefill",
            StartRung::Largest,
            Strategy::Reprefill,
        ),
        ArmSpec::new(
            "D",
            "Molt: switch between two tokens, project the cache",
            StartRung::Largest,
            Strategy::Molt,
        ),
        ArmSpec::ablation(
            "D-no-sandwich",
            "without the RoPE sandwich (maps fitted on rotated keys)",
            NoSandwich,
            NoSandwich,
        ),
        ArmSpec::ablation(
            "D-no-remap",
            "without the depth remap (proportional layers)",
            Auto,
            NoRemap,
        ),
        ArmSpec::ablation(
            "D-truncate",
            "with a naive truncated map instead of the learned one",
            Auto,
            Truncate,
        ),
        ArmSpec::ablation(
            "D-no-diagonal",
            "without the diagonal scale (precision route copies the cache)",
            Identity,
            Auto,
        ),
        ArmSpec::ablation(
            "D-dense",
            "with a dense map instead of the diagonal scale on the precision route",
            Dense,
            Dense,
        ),
        ArmSpec::ablation(
            "D-per-head",
            "with per-head instead of dense maps",
            Auto,
            PerHead,
        ),
        ArmSpec::topk(2),
        ArmSpec::topk(4),
        ArmSpec::topk(6),
        ArmSpec::tail(8),
        ArmSpec::tail(32),
        ArmSpec::head(0),
        ArmSpec::head(3),
        ArmSpec::head(32),
        ArmSpec::refill(0),
        ArmSpec::refill(8),
        ArmSpec::refill(32),
    ]
}

/// `all` (every arm but the option arms, which are selected by id: `D-topk2,D-topk4,D-topk6`,
/// `D-tail8,D-tail32`, `D-no-head,D-head3,D-head32`, `D-refill8,D-refill32`; `D-no-refill` is an ablation),
/// or a comma-separated list of arm ids (case-insensitive). Unbuilt slots are listed but never
/// run.
///
/// # Errors
/// [`BenchError::Config`] naming an unknown id and the known ones.
pub fn select_arms(spec: &str) -> Result<Vec<ArmSpec>, BenchError> {
    let all = all_arms();
    if spec.trim().eq_ignore_ascii_case("all") {
        // The top-k arms need hidden maps that `train-projectors --topk` fits on request only,
        // and run an option that is off by default: they are chosen by name.
        return Ok(all.into_iter().filter(|a| !a.is_option()).collect());
    }
    let mut out = Vec::new();
    for id in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let arm = all
            .iter()
            .find(|a| a.id.eq_ignore_ascii_case(id))
            .ok_or_else(|| {
                BenchError::Config(format!(
                    "unknown condition {id:?}; known: all, {}",
                    all.iter()
                        .map(|a| a.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        if !out.contains(arm) {
            out.push(arm.clone());
        }
    }
    if out.is_empty() {
        return Err(BenchError::Config("no conditions selected".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_are_selected_by_id_and_ablations_change_one_route() {
        let all = all_arms();
        assert_eq!(
            select_arms("all").unwrap().len(),
            all.iter().filter(|a| !a.is_option()).count(),
            "all but the option arms"
        );
        assert_eq!(all.iter().filter(|a| a.is_option()).count(), 9);
        let s = select_arms("a, D ,d-truncate").unwrap();
        assert_eq!(
            s.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
            ["A", "D", "D-truncate"]
        );
        assert!(
            select_arms("Z")
                .unwrap_err()
                .to_string()
                .contains("D-no-sandwich")
        );
        let d = all.iter().find(|a| a.id == "D").unwrap();
        for a in all
            .iter()
            .filter(|a| a.id.starts_with("D-") && a.built && !a.is_option())
        {
            let changed = [RouteKind::Precision, RouteKind::Size]
                .iter()
                .filter(|&&k| a.variant(k).tag(k) != d.variant(k).tag(k))
                .count();
            assert!(
                changed >= 1 || a.head != d.head || a.refill != d.refill,
                "{} changes nothing",
                a.id
            );
            assert_eq!(a.strategy, Strategy::Molt);
        }
        let topk: Vec<_> = all.iter().filter_map(|a| a.topk).collect();
        assert_eq!(topk, [2, 4, 6], "the top-k arms change only k");
        assert!(all.iter().all(|a| a.built));
        assert_eq!(select_arms("d-topk4").unwrap()[0].topk, Some(4));
        assert_eq!(select_arms("d-tail32").unwrap()[0].tail, 32);
        assert_eq!(select_arms("d-head32").unwrap()[0].head, 32);
        assert_eq!(select_arms("d-no-head").unwrap()[0].head, 0);
        assert_eq!(select_arms("D").unwrap()[0].head, DEFAULT_HEAD_REREAD);
        assert_eq!(select_arms("d-refill32").unwrap()[0].refill, 32);
        assert!(select_arms("all").unwrap().iter().all(|a| !a.is_option()));
    }

    #[test]
    fn prompts_file_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"kind\":\"code\",\"prompt\":\"x\"}\n\n{\"id\":\"a\",\"kind\":\"code\",\"prompt\":\"y\"}\n",
        )
        .unwrap();
        let e = load_prompts(&p).unwrap_err().to_string();
        assert!(e.contains(":3") && e.contains("duplicate"), "{e}");
        std::fs::write(&p, "{\"id\":\"a\",\"prompt\":\"x\"}\n").unwrap();
        assert!(load_prompts(&p).unwrap_err().to_string().contains(":1"));
    }
}
