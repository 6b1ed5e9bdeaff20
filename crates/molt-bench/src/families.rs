//! `results/families.json`: one row per (family, ladder, route) — a ladder of another model
//! family switched mid-answer under a trace — summarised from two program outputs: the recall
//! benchmark's `recall.json` on that ladder (the default arm's recall on the route beside the
//! native destination's) and `molt-run generate --trace … --out` answers (each switch's stall
//! and the answer's decode pace). A row is keyed by family, ladder, route and method; a row of
//! the same key is replaced, others kept.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::stall::Spread;

/// The spread of the finite values of `v`, the median of an even count the mean of the two
/// middle values (`None` when there are none).
fn spread_of(v: &[f64]) -> Option<Spread> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        f64::midpoint(s[n / 2 - 1], s[n / 2])
    };
    Some(Spread {
        median,
        min: s[0],
        max: s[n - 1],
    })
}

/// One family's switch on one route.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FamilyRow {
    /// The GGUF architecture (`general.architecture`), e.g. `llama`, `gemma3`.
    pub family: String,
    /// The ladder's name.
    pub ladder: String,
    /// `src→dst`.
    pub route: String,
    /// The switch method the answers' switches used (`molt`, `reprefill`, …).
    pub method: String,
    /// How a Molt switch carried the cache when the note says (`identity`: the precision
    /// route without a fitted map, the cache carried as it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carry: Option<String>,
    /// The default arm's recall on the route, over every item of the recall run.
    pub recall: f64,
    /// The native destination's recall on the same items.
    pub destination_recall: f64,
    /// Items the recall figures are over.
    pub items: u64,
    /// Each switch's cost (decision to first logits on the destination), ms.
    pub stall_ms: Spread,
    /// Median over the answers of each answer's mean time per token after its first,
    /// the switch's stall left out, ms.
    pub itl_ms_median: f64,
    /// Answers the stall and pace are over.
    pub answers: usize,
}

/// The document.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FamiliesDoc {
    /// Rows, by family, ladder, route and method.
    pub rows: Vec<FamilyRow>,
    /// The run that wrote the last row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<Value>,
}

/// Why a row cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum FamiliesError {
    /// Inputs that do not hold what the row needs.
    #[error("{0}")]
    Input(String),
}

/// The row of ladder `ladder` (architecture `family`) from a recall document and generate
/// answers (one JSON object a line).
///
/// # Errors
/// [`FamiliesError::Input`] when the answers hold no switch or the recall document no row of
/// the switches' route for the default arm and the native destination.
pub fn row(
    family: &str,
    ladder: &str,
    recall: &Value,
    answers: &str,
) -> Result<FamilyRow, FamiliesError> {
    let mut stalls = Vec::new();
    let mut itls = Vec::new();
    let mut route = None;
    let mut method = None;
    let mut carry = None;
    let mut n_answers = 0;
    for line in answers.lines().filter(|l| !l.trim().is_empty()) {
        let a: Value = serde_json::from_str(line)
            .map_err(|e| FamiliesError::Input(format!("an answer line: {e}")))?;
        let Some(sw) = a["switches"].as_array().and_then(|s| s.first()) else {
            continue;
        };
        n_answers += 1;
        let cost = sw["cost_ms"].as_f64().unwrap_or(f64::NAN);
        stalls.push(cost);
        let r = format!(
            "{}→{}",
            sw["from"].as_str().unwrap_or("?"),
            sw["to"].as_str().unwrap_or("?")
        );
        let m = sw["method"].as_str().unwrap_or("?").to_string();
        if sw["note"]
            .as_str()
            .is_some_and(|n| n.contains("carried as it is"))
        {
            carry = Some("identity".to_string());
        }
        if route.get_or_insert_with(|| r.clone()) != &r {
            return Err(FamiliesError::Input(format!(
                "answers switch on two routes: {} and {r}",
                route.unwrap_or_default()
            )));
        }
        method.get_or_insert(m);
        let tokens = a["tokens"].as_f64().unwrap_or(0.0);
        let total = a["total_ms"].as_f64().unwrap_or(f64::NAN);
        let ttft = a["ttft_ms"].as_f64().unwrap_or(f64::NAN);
        if tokens > 1.0 {
            itls.push((total - ttft - cost) / (tokens - 1.0));
        }
    }
    let (Some(route), Some(method)) = (route, method) else {
        return Err(FamiliesError::Input("no answer switched".into()));
    };
    let rows = recall["rows"].as_array().cloned().unwrap_or_default();
    let on_route = |pick: &dyn Fn(&Value) -> bool| -> (f64, f64, u64) {
        let mut n = 0u64;
        let (mut r, mut d) = (0.0, 0.0);
        for row in rows
            .iter()
            .filter(|r| r["route"] == route.as_str() && pick(r))
        {
            let items = row["items"].as_u64().unwrap_or(0);
            n += items;
            #[allow(clippy::cast_precision_loss)] // item counts are small
            let w = items as f64;
            r += row["recall"].as_f64().unwrap_or(0.0) * w;
            d += row["destination_recall"].as_f64().unwrap_or(0.0) * w;
        }
        #[allow(clippy::cast_precision_loss)]
        let nf = n.max(1) as f64;
        (r / nf, d / nf, n)
    };
    // A re-prefill's answers are read beside the recall run's re-prefill arm, a Molt switch's
    // beside its default arm.
    let reprefill = method.starts_with("reprefill");
    let (recall_v, _, items) = on_route(&|r| {
        if reprefill {
            r["arm"] == "reprefill"
        } else {
            r["default"] == true
        }
    });
    let (dest, _, _) = on_route(&|r| r["arm"] == "native-destination");
    if items == 0 {
        return Err(FamiliesError::Input(format!(
            "the recall document has no {} row on {route}",
            if reprefill {
                "reprefill"
            } else {
                "default-arm"
            }
        )));
    }
    let stall = spread_of(&stalls)
        .ok_or_else(|| FamiliesError::Input("no switch measured a stall".into()))?;
    Ok(FamilyRow {
        family: family.to_string(),
        ladder: ladder.to_string(),
        route,
        method,
        carry,
        recall: recall_v,
        destination_recall: dest,
        items,
        stall_ms: stall,
        itl_ms_median: spread_of(&itls).map_or(f64::NAN, |s| s.median),
        answers: n_answers,
    })
}

/// `doc` with `row` in place of the row of its key, sorted.
pub fn merge(doc: &mut FamiliesDoc, row: FamilyRow) {
    let key = |r: &FamilyRow| {
        (
            r.family.clone(),
            r.ladder.clone(),
            r.route.clone(),
            r.method.clone(),
        )
    };
    let k = key(&row);
    doc.rows.retain(|r| key(r) != k);
    doc.rows.push(row);
    doc.rows.sort_by_key(key);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_weighs_recall_by_items_and_leaves_the_stall_out_of_the_pace() {
        let recall = serde_json::json!({"rows": [
            {"arm": "head4", "default": true, "route": "tier0→tier1", "items": 3,
             "recall": 1.0, "destination_recall": 0.0},
            {"arm": "head4", "default": true, "route": "tier0→tier1", "items": 1,
             "recall": 0.0, "destination_recall": 1.0},
            {"arm": "native-destination", "default": false, "route": "tier0→tier1", "items": 4,
             "recall": 0.5, "destination_recall": 0.5},
            {"arm": "head4", "default": true, "route": "tier0→tier2", "items": 9,
             "recall": 0.0, "destination_recall": 0.0}
        ]});
        let answers = concat!(
            r#"{"tokens": 11, "total_ms": 150.0, "ttft_ms": 20.0, "switches": [{"from": "tier0", "to": "tier1", "method": "molt", "note": "no fitted map for this precision route: the cache carried as it is", "cost_ms": 30.0}]}"#,
            "\n",
            r#"{"tokens": 5, "total_ms": 60.0, "ttft_ms": 10.0, "switches": []}"#,
            "\n",
            r#"{"tokens": 3, "total_ms": 70.0, "ttft_ms": 10.0, "switches": [{"from": "tier0", "to": "tier1", "method": "molt", "cost_ms": 50.0}]}"#,
        );
        let r = row("llama", "smol", &recall, answers).unwrap();
        assert_eq!(r.route, "tier0→tier1");
        assert_eq!(r.method, "molt");
        assert_eq!(r.carry.as_deref(), Some("identity"));
        assert!((r.recall - 0.75).abs() < 1e-9, "{}", r.recall);
        assert!((r.destination_recall - 0.5).abs() < 1e-9);
        assert_eq!(r.items, 4);
        assert_eq!(r.answers, 2);
        assert_eq!(
            r.stall_ms,
            Spread {
                median: 40.0,
                min: 30.0,
                max: 50.0
            }
        );
        // (150 - 20 - 30) / 10 = 10 and (70 - 10 - 50) / 2 = 5.
        assert!((r.itl_ms_median - 7.5).abs() < 1e-9);
        assert!(row("llama", "smol", &recall, "").is_err());

        let mut doc = FamiliesDoc::default();
        merge(&mut doc, r.clone());
        merge(&mut doc, FamilyRow { recall: 0.0, ..r });
        assert_eq!(doc.rows.len(), 1);
        assert!(doc.rows[0].recall.abs() < 1e-12);
    }
}
