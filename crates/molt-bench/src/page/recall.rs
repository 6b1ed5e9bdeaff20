//! The results page's section on recall of the context's facts (`recall.json`): one table per
//! route, the two recall figures, and plain sentences saying on which routes and context
//! lengths the default switch still loses facts and what it costs there.
//!
//! Every number comes from the file through the same pooling the figures use
//! ([`RecallSummary`]), and "loses facts" is one rule, stated on the page beside its result:
//! recall below [`KEEPS_FACTS`] × the native destination's on the same items.

use std::fmt::Write as _;

use super::{f, file_name, pct};
use crate::figures::FigureSet;
use crate::figures::recall::{
    KEEPS_FACTS, RecallSummary, by_length, default_arm, routes, summaries,
};
use crate::precision::pool_recall;
use crate::recall::{ArmMethod, RecallDoc, Uncovered};
use molt::transplant::select::SelectRule;

/// The section, from its `##` heading on; `figures_rel` is the figure directory relative to
/// the page.
pub(super) fn section(doc: &RecallDoc, figures: &FigureSet, figures_rel: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Recall of the context's facts\n");
    let lengths = lengths(doc);
    let _ = writeln!(
        s,
        "From `recall.json`: {} context-QA items of `{}` — a fact inside notes of {} tokens, then a question — answered across a switch before answer token 1 or after {} tokens of a preamble the item asks for{}. An answer recalls the fact when it holds every expected string (case-insensitive). Per arm, recall is pooled over its rows (every context length and switch point: Σ recall × items / Σ items) beside the native destination's recall on the same items; the cost is the switch alone on a loaded destination, the median of the rows' medians weighted by their items, and the re-prefill's the same way at the same points. Precision routes ran on every {} item{}.\n",
        doc.n_items,
        doc.items_file,
        join_lengths(&lengths),
        doc.options.mid_switch_at,
        if doc.problems.is_empty() {
            String::new()
        } else {
            format!(
                " ({} lines of the item file were not run; their reasons are in the JSON)",
                doc.problems.len()
            )
        },
        ordinal(doc.options.precision_every),
        if doc.options.precision_every > 1 {
            ", so their rows hold fewer answers"
        } else {
            ""
        },
    );
    let all = summaries(doc);
    for route in routes(doc) {
        let here: Vec<&RecallSummary> = all.iter().filter(|x| x.route == route).collect();
        let Some(first) = here.first() else {
            continue;
        };
        let _ = writeln!(s, "### {route} ({} route)\n", first.route_kind);
        let _ = writeln!(
            s,
            "| arm | recall | native destination recall | median cost ms | cost as % of re-prefill | positions re-read |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for x in &here {
            let _ = writeln!(
                s,
                "| {} | {:.2} ({}/{}) | {:.2} | {} | {} | {} |",
                if x.default {
                    format!("**{}** (default)", x.arm)
                } else {
                    x.arm.clone()
                },
                x.recall,
                x.correct,
                x.items,
                x.destination_recall,
                if x.is_native() {
                    "–".to_string()
                } else {
                    f(Some(x.cost_ms), 1)
                },
                if x.is_native() {
                    "–".to_string()
                } else {
                    pct(x.cost_fraction())
                },
                reread(doc, x),
            );
        }
        s.push('\n');
    }
    for (name, alt) in [
        ("recall_frontier", "recall frontier"),
        ("recall_lengths", "recall by length"),
    ] {
        if let Some(h) = figures.written.iter().find(|x| x.name == name) {
            let _ = writeln!(
                s,
                "![{alt}]({figures_rel}/{})\n\n*{}*\n",
                file_name(&h.path),
                h.caption
            );
        }
    }
    let _ = writeln!(
        s,
        "**Where the facts are still lost.** Rule: the default switch loses facts at a context length when its recall there (both switch points pooled) is below {KEEPS_FACTS} × the native destination's on the same items.\n"
    );
    for route in routes(doc) {
        s.push_str(&verdict(doc, &all, &route));
    }
    s
}

/// The section on summaries (`recall_summaries.json`): notes with eight or nine facts spread
/// through them, summarised as a list across a switch, scored by the share of the facts the
/// summary states — what a user who asked for the summary would check. Per route, one row per
/// arm pooling every item (mean share), the native destination's on the same items, the
/// switch's median gap, and for a refill its time and the answer token it had every position
/// re-read by.
pub(super) fn summaries_section(doc: &RecallDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "
## Summaries across a switch: the facts a summary states
"
    );
    let lengths = lengths(doc);
    let _ = writeln!(
        s,
        "From `recall_summaries.json`: {} items of `{}` — notes of {} tokens with eight or nine facts (names, numbers, identifiers, places) spread through them, summarised as a bulleted list of up to 200 tokens — switched before answer token 1 or in the list's middle. A summary is scored by the share of its notes' facts it states (every expected string, case-insensitive), the mean over the items; `recall` counts the summaries that state them all. Every answer is in the JSON.\n",
        doc.n_items,
        doc.items_file,
        join_lengths(&lengths),
    );
    for route in routes(doc) {
        let _ = writeln!(s, "### {route}\n");
        let _ = writeln!(
            s,
            "| arm | facts stated | native destination | all facts | median switch gap ms | refill ms (median) | every position re-read by token |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        let mut pooled = pool_recall(doc, &doc.items_file, &route);
        pooled.sort_by(|a, b| a.arm.cmp(&b.arm));
        for p in &pooled {
            let arm = p.arm.as_str();
            let answers: Vec<_> = doc
                .answers
                .iter()
                .filter(|a| a.route == route && a.arm == arm)
                .collect();
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied()
            };
            let native = matches!(arm, "native-source" | "native-destination");
            let refill = median(
                answers
                    .iter()
                    .filter(|a| a.refill_ms > 0.0)
                    .map(|a| a.refill_ms)
                    .collect(),
            );
            #[allow(clippy::cast_precision_loss)]
            let by = median(
                answers
                    .iter()
                    .filter_map(|a| a.refill_at.map(|k| k as f64))
                    .collect(),
            );
            let _ = writeln!(
                s,
                "| {} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
                if p.default {
                    format!("**{arm}** (default)")
                } else {
                    arm.to_string()
                },
                p.facts,
                p.destination_facts,
                p.recall,
                if native {
                    "–".to_string()
                } else {
                    f(median(answers.iter().map(|a| a.cost_ms).collect()), 0)
                },
                refill.map_or("–".to_string(), |v| f(Some(v), 0)),
                by.map_or("–".to_string(), |v| f(Some(v), 0)),
            );
        }
        s.push('\n');
    }
    s
}

/// The section on kinds of context (`recall_kinds.json`, items of `benches/recall/kinds.jsonl`):
/// per route, kind and length, the default switch's recall beside the native destination's
/// and the re-prefill's on the same items, the goal (recall ≥ [`KEEPS_FACTS`] × the better of
/// the two) met or not, the switch's cost as a share of the re-prefill's, and every miss of
/// the default with its answer, whether the fact's sentence was read and what was read instead.
pub(super) fn kinds_section(doc: &RecallDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Recall by kind of context\n");
    let lengths = lengths(doc);
    let _ = writeln!(
        s,
        "From `recall_kinds.json`: {} items of `{}` — a fact inside repeated boilerplate, Python source, a service log, a chat transcript (the fact in its first turns), or notes whose answer joins two sentences far apart — of {} tokens, switched before answer token 1 or after {} tokens of a preamble. Scored as above. Per kind and length, every switch point pooled; the goal is recall ≥ {KEEPS_FACTS} × the better of the native destination and the re-prefill on the same items. The cost column is the default switch's median cost over the rows' medians as a share of the re-prefill's.\n",
        doc.n_items,
        doc.items_file,
        join_lengths(&lengths),
        doc.options.mid_switch_at,
    );
    for route in routes(doc) {
        // Without the session's own arm in the run, the arm with its selection and sparse
        // read and no refill behind the answer, said so.
        let (default, without_refill) = match default_arm(doc, &route) {
            Some(a) => (a, false),
            None if doc
                .rows
                .iter()
                .any(|r| r.route == route && r.arm == SELECTION_ARM) =>
            {
                (SELECTION_ARM.to_string(), true)
            }
            None => continue,
        };
        let others: Vec<String> = doc
            .options
            .size_arms
            .iter()
            .map(|a| a.name.clone())
            .filter(|a| {
                a != &default
                    && !matches!(
                        a.as_str(),
                        "native-source" | "native-destination" | "reprefill"
                    )
                    && doc.rows.iter().any(|r| r.route == route && &r.arm == a)
            })
            .collect();
        let _ = writeln!(s, "### {route}, default switch `{default}`\n");
        if without_refill {
            let _ = writeln!(
                s,
                "The run did not hold the session's default arm; `{default}` is its selection and sparse read without the refill that reads the left-out positions behind the answer.\n"
            );
        }
        let _ = writeln!(
            s,
            "| kind | tokens | items | native destination | re-prefill | **default** |{} goal | default cost % of re-prefill |",
            others
                .iter()
                .map(|a| format!(" `{a}` |"))
                .collect::<String>()
        );
        let _ = writeln!(
            s,
            "|---|---|---|---|---|---|{}---|---|",
            "---|".repeat(others.len())
        );
        let mut groups: Vec<(String, usize)> = doc
            .rows
            .iter()
            .filter(|r| r.route == route)
            .map(|r| (r.context_kind.clone(), r.context_tokens))
            .collect();
        groups.dedup();
        groups.sort();
        groups.dedup();
        let mut met = Vec::new();
        for (ck, len) in &groups {
            let rows = |arm: &str| -> Vec<&crate::recall::RecallRow> {
                doc.rows
                    .iter()
                    .filter(|r| {
                        r.route == route
                            && r.arm == arm
                            && &r.context_kind == ck
                            && r.context_tokens == *len
                    })
                    .collect()
            };
            let d = rows(&default);
            #[allow(clippy::cast_precision_loss)]
            let pooled = |v: &[&crate::recall::RecallRow],
                          x: &dyn Fn(&crate::recall::RecallRow) -> f64| {
                let n: usize = v.iter().map(|r| r.items).sum();
                let sum: f64 = v.iter().map(|r| x(r) * r.items as f64).sum();
                (sum / n.max(1) as f64, n)
            };
            let (recall, n) = pooled(&d, &|r| r.recall);
            let (dest, _) = pooled(&d, &|r| r.destination_recall);
            let (re, _) = pooled(&d, &|r| r.reprefill_recall);
            let (cost, _) = pooled(&d, &|r| r.cost_ms.median);
            let (re_ms, _) = pooled(&d, &|r| r.reprefill_ms.median);
            let goal = recall + 1e-9 >= KEEPS_FACTS * dest.max(re);
            met.push(goal);
            let count = |x: f64| {
                #[allow(
                    clippy::cast_precision_loss,
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss
                )]
                let k = (x * n as f64).round() as usize;
                format!("{k}/{n}")
            };
            let other: String = others
                .iter()
                .map(|a| format!(" {} |", count(pooled(&rows(a), &|r| r.recall).0)))
                .collect();
            let _ = writeln!(
                s,
                "| {ck} | {len} | {n} | {} | {} | **{}** |{other} {} | {} |",
                count(dest),
                count(re),
                count(recall),
                if goal { "met" } else { "**not met**" },
                pct((re_ms > 0.0).then(|| cost / re_ms)),
            );
        }
        let _ = writeln!(
            s,
            "\nThe goal holds on {} of {} kind × length groups.\n",
            met.iter().filter(|&&m| m).count(),
            met.len()
        );
        let misses: Vec<_> = doc
            .answers
            .iter()
            .filter(|a| a.route == route && a.arm == default && !a.ok)
            .collect();
        if misses.is_empty() {
            let _ = writeln!(s, "The default switch recalled every fact.\n");
            continue;
        }
        let _ = writeln!(
            s,
            "The default switch's misses (its answer; whether the positions it read natively before the question held the fact; what it read):\n"
        );
        for a in misses {
            let chosen: Vec<String> = a
                .reread
                .iter()
                .take(4)
                .map(|t| format!("«{}»", clip(t.trim(), 70)))
                .collect();
            let _ = writeln!(
                s,
                "- `{}` ({}): «{}» — fact read: {}; read: {}",
                a.id,
                a.context_kind,
                clip(a.answer.trim(), 160),
                match a.fact_read {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "–",
                },
                if chosen.is_empty() {
                    "–".to_string()
                } else {
                    chosen.join(" ")
                },
            );
        }
        s.push('\n');
    }
    s
}

/// The arm with the session's default selection and sparse read, without its refill.
const SELECTION_ARM: &str = "sparse-r10-m64";

/// `t` on one line, cut to `n` characters.
fn clip(t: &str, n: usize) -> String {
    let one: String = t
        .chars()
        .map(|c| if c == '\n' || c == '|' { ' ' } else { c })
        .collect();
    if one.chars().count() <= n {
        one
    } else {
        format!("{}…", one.chars().take(n).collect::<String>())
    }
}

/// The bullet for "What this does not show": how coarse a string-matched recall on few items
/// is.
pub(super) fn caveat(doc: &RecallDoc) -> String {
    let sizes = doc.rows.iter().map(|r| r.items).filter(|&n| n > 0);
    let (lo, hi) = (sizes.clone().min().unwrap_or(0), sizes.max().unwrap_or(0));
    #[allow(clippy::cast_precision_loss)]
    let step = if lo > 0 { 1.0 / lo as f64 } else { 0.0 };
    format!(
        "- Recall is scored by string match on the {} items of `{}`: an answer that gives the fact in other words counts as lost, one that names the expected string in passing as kept. A row holds {lo}–{hi} answers, so one answer moves its recall by up to {step:.2}; the per-answer texts are in `recall.json`.\n",
        doc.n_items, doc.items_file
    )
}

/// One bullet for `route`: where its default switch loses facts, at what cost, and the
/// cheapest arm that keeps them at every length.
fn verdict(doc: &RecallDoc, all: &[RecallSummary], route: &str) -> String {
    let kind = all
        .iter()
        .find(|x| x.route == route)
        .map_or("", |x| x.route_kind.as_str());
    let Some(arm) = default_arm(doc, route) else {
        return format!(
            "- **{route}** ({kind} route): the run had no default arm on this route.\n"
        );
    };
    let per_length = by_length(doc, route, &arm);
    let (lost, kept): (Vec<_>, Vec<_>) = per_length.iter().partition(|(_, x)| x.loses_facts());
    // The re-prefill builds the destination's own cache at the same point: what a perfect
    // carry would recall there (mid-answer it continues the source's preamble, which the
    // native destination's own answer does not).
    let reprefill = by_length(doc, route, "reprefill");
    let mut s = format!("- **{route}** ({kind} route), default switch `{arm}`: ");
    if lost.is_empty() {
        let pooled = all.iter().find(|x| x.route == route && x.arm == arm);
        let _ = write!(
            s,
            "keeps the facts at every length measured ({} tokens)",
            join_lengths(&kept.iter().map(|(n, _)| *n).collect::<Vec<_>>())
        );
        if let Some(p) = pooled {
            let _ = write!(
                s,
                ": recall {:.2} against the destination's {:.2}, at {} of the re-prefill's cost",
                p.recall,
                p.destination_recall,
                pct(p.cost_fraction())
            );
        }
        s.push('.');
    } else {
        let parts: Vec<String> = lost
            .iter()
            .map(|(n, x)| {
                let re = reprefill
                    .iter()
                    .find(|(m, _)| m == n)
                    .map_or_else(String::new, |(_, r)| {
                        format!(" and the re-prefill's {:.2}", r.recall)
                    });
                format!(
                    "at {n} tokens: recall {:.2} against the destination's {:.2}{re} ({} answers), at a switch cost of {} ms, {} of the re-prefill's {} ms",
                    x.recall,
                    x.destination_recall,
                    x.items,
                    f(Some(x.cost_ms), 1),
                    pct(x.cost_fraction()),
                    f(Some(x.reprefill_ms), 1)
                )
            })
            .collect();
        let _ = write!(s, "loses facts {}.", parts.join("; "));
        if !kept.is_empty() {
            let _ = write!(
                s,
                " It keeps them at {} tokens.",
                join_lengths(&kept.iter().map(|(n, _)| *n).collect::<Vec<_>>())
            );
        }
    }
    // The cheapest switching arm that keeps the facts at every length of this route (measured
    // at every length the default was: an arm run at one length only keeps them "everywhere"
    // it was run, which says nothing of the others).
    let lengths_of =
        |a: &str| -> Vec<usize> { by_length(doc, route, a).iter().map(|(n, _)| *n).collect() };
    let every = lengths_of(&arm);
    let keeps_where_run = |x: &&RecallSummary| {
        let v = by_length(doc, route, &x.arm);
        !v.is_empty() && v.iter().all(|(_, y)| !y.loses_facts())
    };
    let keeps = |x: &&RecallSummary| keeps_where_run(x) && lengths_of(&x.arm) == every;
    let cheapest = all
        .iter()
        .filter(|x| x.route == route && !x.is_native() && x.cost_fraction().is_some())
        .filter(keeps)
        .min_by(|a, b| {
            let fr = |x: &RecallSummary| x.cost_fraction().unwrap_or(f64::INFINITY);
            fr(a).total_cmp(&fr(b))
        });
    match cheapest {
        Some(x) if x.arm == arm => {
            let _ = write!(s, " No arm keeps them at every length for less.");
        }
        Some(x) if x.arm == "reprefill" => {
            let _ = write!(s, " Only the re-prefill keeps them at every length.");
        }
        Some(x) => {
            let _ = write!(
                s,
                " The cheapest arm that keeps them at every length is `{}`, at {} of the re-prefill's cost.",
                x.arm,
                pct(x.cost_fraction())
            );
        }
        None => {
            let _ = write!(
                s,
                " No switching arm keeps them at every length, the re-prefill included."
            );
        }
    }
    // Arms run at some lengths only that keep the facts there: said as such.
    let partial = all
        .iter()
        .filter(|x| x.route == route && !x.is_native() && x.cost_fraction().is_some())
        .filter(|x| keeps_where_run(x) && lengths_of(&x.arm) != every)
        .min_by(|a, b| {
            let fr = |x: &RecallSummary| x.cost_fraction().unwrap_or(f64::INFINITY);
            fr(a).total_cmp(&fr(b))
        });
    if let Some(x) = partial {
        let _ = write!(
            s,
            " Measured at {} tokens only, `{}` keeps them there, at {} of the re-prefill's cost.",
            join_lengths(&lengths_of(&x.arm)),
            x.arm,
            pct(x.cost_fraction())
        );
    }
    s.push('\n');
    s
}

/// What the arm re-reads natively at the switch, from the run's own arm settings.
fn reread(doc: &RecallDoc, x: &RecallSummary) -> String {
    let arms = if x.route_kind == "precision" {
        &doc.options.precision_arms
    } else {
        &doc.options.size_arms
    };
    let Some(arm) = arms.iter().find(|a| a.name == x.arm) else {
        return "–".into();
    };
    match arm.method {
        ArmMethod::NativeSource | ArmMethod::NativeDestination => "– (no switch)".into(),
        ArmMethod::Reprefill => "all".into(),
        ArmMethod::Transplant {
            head,
            tail,
            recompute,
            refill,
            refill_within,
            refill_pace,
            hurry,
            uncovered,
        } => {
            let mut parts = Vec::new();
            if head > 0 {
                parts.push(format!("head {head}"));
            }
            if hurry > 0 {
                parts.push(format!(
                    "hurried: the newest {hurry} read before the first token, the chosen ones after it"
                ));
            }
            let left_out =
                recompute.is_some_and(|r| r.rest == molt::transplant::select::Rest::LeftOut);
            if left_out {
                parts.push(
                    "nothing projected: only these read, the rest left out until re-read".into(),
                );
            } else if uncovered == Uncovered::Forgotten {
                parts.push("the rest forgotten until re-read".into());
            }
            if tail > 0 {
                parts.push(format!("tail {tail}"));
            }
            if recompute.is_some() && hurry > 0 {
                parts.push(format!(
                    "{:.0} read before the first token (median)",
                    x.recomputed
                ));
            } else if let Some(r) = recompute {
                parts.push(format!(
                    "{:.0} selected {} (median)",
                    x.recomputed,
                    match r.rule {
                        SelectRule::Attention => "by attention",
                        SelectRule::Random => "at random",
                        SelectRule::Residual => "by projection residual",
                    }
                ));
            }
            if refill > 0 {
                let mut spread: Vec<f64> = doc
                    .rows
                    .iter()
                    .filter(|r| r.arm == x.arm && r.route == x.route)
                    .filter_map(|r| r.refill_ms.map(|m| m.median))
                    .collect();
                spread.sort_by(f64::total_cmp);
                let deadline = if refill_within > 0 {
                    format!(" (more when needed to finish within {refill_within} tokens)")
                } else {
                    String::new()
                };
                let paced = if refill_pace > 1.0 {
                    format!(
                        ", paced: no token waits more than {refill_pace:.0} of the rung's own gaps"
                    )
                } else {
                    String::new()
                };
                parts.push(format!(
                    "then all behind the answer, {refill} positions a step{deadline}{paced}{}",
                    spread
                        .get(spread.len() / 2)
                        .map_or_else(String::new, |m| format!(
                            " ({m:.0} ms spread over the next tokens, median of the rows)"
                        ))
                ));
            }
            if parts.is_empty() {
                "none".into()
            } else {
                parts.join(" + ")
            }
        }
    }
}

/// The context lengths of a document's rows, ascending.
fn lengths(doc: &RecallDoc) -> Vec<usize> {
    let mut v: Vec<usize> = doc.rows.iter().map(|r| r.context_tokens).collect();
    v.sort_unstable();
    v.dedup();
    v
}

fn join_lengths(v: &[usize]) -> String {
    let words: Vec<String> = v.iter().map(ToString::to_string).collect();
    match words.as_slice() {
        [] => "no".into(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// `2nd`, `4th`; 1 reads as "every item".
fn ordinal(n: usize) -> String {
    match n {
        0 | 1 => "single".into(),
        n if n % 100 / 10 == 1 => format!("{n}th"),
        n => match n % 10 {
            2 => format!("{n}nd"),
            3 => format!("{n}rd"),
            _ => format!("{n}th"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::recall::sample_doc;

    #[test]
    fn the_section_says_where_the_default_loses_facts_from_the_numbers() {
        let doc = sample_doc();
        let s = section(&doc, &FigureSet::default(), "figures");
        assert!(s.contains("## Recall of the context's facts"));
        assert!(s.contains("### tier0→tier2 (size route)"));
        assert!(s.contains("### tier0→tier1 (precision route)"));
        // The default row, pooled: 7 of 12, the destination 5/6, cost 32 ms = 10 % of 320 ms.
        assert!(
            s.contains("| **head4** (default) | 0.58 (7/12) | 0.83 | 32.0 | 10.0% | head 4 |"),
            "{s}"
        );
        assert!(s.contains("| reprefill | 0.83 (10/12) | 0.83 | 320.0 | 100.0% | all |"));
        assert!(s.contains("| projection | 0.00 (0/12) | 0.83 | 21.0 | 6.6% | none |"));
        assert!(
            s.contains("head 4 + 26 selected by attention (median)"),
            "{s}"
        );
        // 1024 tokens: recall 1/6 against 2/3 (the re-prefill's too), cost 60 ms of 1200 ms;
        // 256 tokens kept.
        assert!(
            s.contains("default switch `head4`: loses facts at 1024 tokens: recall 0.17 against the destination's 0.67 and the re-prefill's 0.67 (6 answers), at a switch cost of 60.0 ms, 5.0% of the re-prefill's 1200.0 ms. It keeps them at 256 tokens."),
            "{s}"
        );
        assert!(s.contains(
            "The cheapest arm that keeps them at every length is `attn-r10`, at 29.7% of the re-prefill's cost."
        ), "{s}");
        assert!(s.contains(
            "- **tier0→tier1** (precision route), default switch `head4`: keeps the facts at every length measured (256 tokens): recall 1.00 against the destination's 1.00, at 5.0% of the re-prefill's cost. No arm keeps them at every length for less."
        ), "{s}");
        assert!(s.contains("every 2nd item"));
        assert!(
            caveat(&doc)
                .contains("A row holds 2–3 answers, so one answer moves its recall by up to 0.50"),
            "{}",
            caveat(&doc)
        );
    }

    #[test]
    fn the_kinds_section_pools_each_kind_and_names_the_misses() {
        let mut doc = sample_doc();
        doc.rows.retain(|r| r.route == "tier0→tier2");
        for r in &mut doc.rows {
            r.context_kind = if r.context_tokens == 256 {
                "log".into()
            } else {
                "code".into()
            };
            r.reprefill_recall = 1.0;
        }
        let default = default_arm(&doc, "tier0→tier2").expect("a default arm");
        doc.answers.push(crate::recall::RecallAnswer {
            id: "log-512-x".into(),
            arm: default,
            route: "tier0→tier2".into(),
            context_kind: "log".into(),
            context_tokens: 500,
            switch_at: 1,
            answer: "The port is\n8080.".into(),
            ok: false,
            facts: 0.0,
            cost_ms: 10.0,
            recomputed: 64,
            reread: vec!["Mugs belong in the dishwasher.".into()],
            fact_read: Some(false),
            refill_ms: 0.0,
            refill_at: None,
        });
        let s = kinds_section(&doc);
        assert!(s.contains("### tier0→tier2, default switch `head4`"), "{s}");
        // Against the re-prefill's 1.0: the default misses the goal on the code rows and meets
        // it on the log rows.
        let row = |kind: &str| {
            s.lines()
                .find(|l| l.starts_with(&format!("| {kind} |")))
                .unwrap_or_else(|| panic!("no {kind} row: {s}"))
                .to_string()
        };
        assert!(row("code").contains("| **not met** |"), "{s}");
        assert!(row("log").contains("| met |"), "{s}");
        assert!(
            s.contains("The goal holds on 1 of 2 kind × length groups."),
            "{s}"
        );
        assert!(
            s.contains(
                "«The port is 8080.» — fact read: **no**; read: «Mugs belong in the dishwasher.»"
            ),
            "{s}"
        );
    }

    #[test]
    fn lengths_and_ordinals_read_as_words() {
        assert_eq!(join_lengths(&[256]), "256");
        assert_eq!(join_lengths(&[256, 512, 1024]), "256, 512 and 1024");
        assert_eq!(ordinal(2), "2nd");
        assert_eq!(ordinal(3), "3rd");
        assert_eq!(ordinal(4), "4th");
        assert_eq!(ordinal(12), "12th");
        assert_eq!(ordinal(22), "22nd");
    }
}
