//! The results page's section on precision rungs (`precision_rungs.json`): per candidate, what
//! it costs (file, the policy's footprint, speed beside the largest rung) and what it gives
//! (its own answers as the largest rung judges them, recall after a switch to it).

use std::fmt::Write as _;

use super::{f, mib};
use crate::precision::PrecisionDoc;

/// The section, from its `##` heading on.
pub(super) fn section(doc: &PrecisionDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Precision rungs: which pay\n");
    let o = &doc.options;
    let _ = writeln!(
        s,
        "From `precision_rungs.json` (ladder `{}`, {} thread(s), one run so the rungs sit side by side; {:.0} s): every rung's file, the footprint the policy compares with the budget at {} tokens of context, prefill ({} tokens) and decode ({} tokens) through Molt's engine, one repetition, as a ratio to the largest rung in the same run; its own greedy answers ({} tokens) to {} conditions prompt(s), judged by the largest rung (perplexity, pooled) and the share of each answer's tokens, from the first, that are the largest rung's own answer; and recall of the context's facts after a switch to it from the largest rung, pooled from {}.\n",
        doc.ladder,
        o.threads,
        doc.seconds,
        o.footprint_tokens,
        o.prefill_tokens,
        o.decode_tokens,
        o.answer_tokens,
        o.prompts.len(),
        if o.recall_files.is_empty() {
            "no recall file".to_string()
        } else {
            o.recall_files
                .iter()
                .map(|p| format!("`{}`", p.display()))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let _ = writeln!(
        s,
        "| rung | type | file MiB | policy MiB | prefill tok/s (× largest) | decode tok/s (× largest) | judge ppl | agrees | recall after a switch (default arm) | native recall | switch ms |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &doc.rungs {
        let def: Vec<_> = r.recall.iter().filter(|p| p.default).collect();
        let native: Vec<_> = r
            .recall
            .iter()
            .filter(|p| p.arm == "native-destination")
            .collect();
        let recall = if def.is_empty() {
            "–".to_string()
        } else {
            def.iter()
                .map(|p| {
                    format!(
                        "{}/{} ({}, {})",
                        p.recalled,
                        p.items,
                        p.arm,
                        serde_json::to_value(p.variant)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                            .unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let native = if native.is_empty() {
            "–".to_string()
        } else {
            native
                .iter()
                .map(|p| format!("{}/{}", p.recalled, p.items))
                .collect::<Vec<_>>()
                .join("; ")
        };
        let cost = def
            .iter()
            .map(|p| format!("{:.0}", p.cost_ms))
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.1} ({:.2}) | {:.2} ({:.2}) | {} | {:.2} | {} | {} | {} |",
            r.rung,
            r.requantized_to.as_deref().unwrap_or(&r.file_type),
            mib(Some(r.file_bytes)),
            mib(Some(r.modelled_bytes)),
            r.prefill_tps,
            r.prefill_vs_largest,
            r.decode_tps,
            r.decode_vs_largest,
            f(r.judge_ppl, 3),
            r.agreement,
            recall,
            native,
            if cost.is_empty() { "–".into() } else { cost }
        );
    }
    let _ = writeln!(
        s,
        "\nRecall after a switch is the session's default switch on a precision route (the head re-read of 4 positions over the carried cache); `identity` means the cache was carried unchanged (no fitted map: how a rung without fitted maps is measured), `auto` the fitted diagonal maps. The samples are small: each recall cell reads answers right / items, and with n items one answer moves it by 1/n{}.",
        doc.rungs
            .iter()
            .flat_map(|r| r.recall.iter().map(|p| p.items))
            .filter(|&n| n > 0)
            .max()
            .map_or_else(String::new, |n| format!(" (here by 1/{n} at best)"))
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::{PooledRecall, PrecisionOptions, RungPrecision};
    use molt::routes::Variant;

    fn rung(name: &str, bytes: u64, ppl: f64, recall: Option<(usize, usize)>) -> RungPrecision {
        RungPrecision {
            rung: name.into(),
            model: String::new(),
            file_type: "Q4_K - Medium".into(),
            requantized_to: recall.map(|_| "Q3_K_M".into()),
            file_bytes: bytes,
            modelled_bytes: bytes + (300 << 20),
            measured_bytes: 0,
            rss_delta_bytes: 0,
            prefill_tps: 50.0,
            decode_tps: 10.0,
            prefill_vs_largest: 1.0,
            decode_vs_largest: 1.25,
            judge_ppl: Some(ppl),
            judged_tokens: 10,
            agreement: 0.5,
            answers: vec![],
            recall: recall
                .map(|(n, of)| {
                    vec![PooledRecall {
                        file: "r.json".into(),
                        arm: "head4".into(),
                        default: true,
                        variant: Variant::Identity,
                        items: of,
                        recalled: n,
                        recall: 0.0,
                        destination_recall: 1.0,
                        facts: 0.0,
                        destination_facts: 1.0,
                        cost_ms: 123.4,
                        reprefill_ms: 900.0,
                    }]
                })
                .unwrap_or_default(),
        }
    }

    #[test]
    fn the_table_shows_each_rungs_cost_quality_and_recall() {
        let doc = PrecisionDoc {
            ladder: "l".into(),
            options: PrecisionOptions {
                rungs: vec![],
                prompts: vec![],
                answer_tokens: 48,
                footprint_tokens: 1024,
                prefill_tokens: 256,
                decode_tokens: 32,
                threads: 2,
                recall_files: vec!["r.json".into()],
            },
            rungs: vec![
                rung("tier0", 1 << 30, 1.5, None),
                rung("q3km", 900 << 20, 2.25, Some((7, 8))),
            ],
            seconds: 1.0,
            run: serde_json::Value::Null,
        };
        let s = section(&doc);
        assert!(s.contains("| tier0 | Q4_K - Medium | 1024 | 1324 |"), "{s}");
        assert!(
            s.contains("| q3km | Q3_K_M | 900 | 1200 | 50.0 (1.00) | 10.00 (1.25) | 2.250 | 0.50 | 7/8 (head4, identity) | – | 123 |"),
            "{s}"
        );
    }
}
