//! The results page's section on the stall a user sees at a switch (`switch_stall.json`):
//! one table of every route, context length and page-cache state, before and after standby
//! rungs, the figure, and one sentence per goal saying which rows meet it.
//!
//! The goal is the issue's: with the page cache warm, a switch down stalls at most
//! [`GOAL_FACTOR`] × the destination's median inter-token latency measured in the same run.

use std::fmt::Write as _;

use super::file_name;
use crate::figures::FigureSet;
use crate::stall::{CacheState, StallDoc, StallRow};

/// Stall over the destination's inter-token latency a warm switch down may reach.
pub const GOAL_FACTOR: f64 = 3.0;

fn cache_word(c: CacheState) -> &'static str {
    match c {
        CacheState::Warm => "warm",
        CacheState::Cold => "cold",
    }
}

/// The largest parts of a row's stall, as `name ms` (the `switch_total` sum left out, and
/// `prepared_in_background`, which overlapped the source's decoding and is not in the stall).
fn top_parts(r: &StallRow, n: usize) -> String {
    let mut v: Vec<(&String, &f64)> = r
        .parts_ms
        .iter()
        .filter(|(k, v)| {
            !["switch_total", "prepared_in_background", "next_gap"].contains(&k.as_str())
                && v.is_finite()
                && **v >= 1.0
        })
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(a.1));
    v.iter()
        .take(n)
        .map(|(k, v)| format!("{k} {v:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The section, from its `##` heading on; `figures_rel` is the figure directory relative to
/// the page.
pub(super) fn section(doc: &StallDoc, figures: &FigureSet, figures_rel: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## The stall at a switch\n");
    let _ = writeln!(
        s,
        "From `switch_stall.json` (`molt-run --threads {} bench --stall`): the gap between the last token on the source and the first on the destination, everything included, for every route of the ladder at two context lengths, {} repetitions; the destination's page cache warm (its file read through before the leg) or cold (dropped with `posix_fadvise(DONTNEED)`; `cached` says how much of the file another process's mapping kept in the cache anyway). *Before*: the destination is loaded at the switch (llama.cpp's load with its mapping populated, a context with a full-window KV buffer, and a warm-up decode the first time the rung loads in the session, to measure its footprint). *After*: the rungs below the current one wait on standby — loaded ahead; hot (their weight pages kept mapped and counted, `standby held`) while the budget holds them, which it always does here (no budget), else their pages released — and a switch down only maps back what is not mapped; a switch up's destination loads on a thread of its own while the source goes on decoding, and the switch waits for it (`prepared_in_background`, not part of the stall). Every rung's context window: {} tokens. The context: {}. Machine: {}.\n",
        doc.threads,
        doc.reps,
        doc.n_ctx,
        if doc.context == "chat" {
            "a chat turn, the corpus text sent as the user's message and rendered with the chat template as `chat` and `generate` send a prompt (the head re-read's anchor holds the template's opening)"
        } else {
            "the corpus text as is, no chat template"
        },
        doc.contention
    );
    let _ = writeln!(
        s,
        "| route | dir | context | cache | cached | stall before, ms | stall after, ms [min–max] | dst ITL, ms | after / ITL | refill after: tokens × gap ms (longest) | lost in all, ms | standby held, MiB | largest parts after, ms |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows: Vec<&StallRow> = doc.rows.iter().collect();
    rows.sort_by(|a, b| {
        (
            a.direction != "down",
            a.context_tokens,
            &a.route,
            a.cache == CacheState::Cold,
        )
            .cmp(&(
                b.direction != "down",
                b.context_tokens,
                &b.route,
                b.cache == CacheState::Cold,
            ))
    });
    for r in &rows {
        let before = doc.before_rows.iter().find(|b| b.same_cell(r));
        let _ = writeln!(
            s,
            "| {}{} | {} | {} | {} | {:.0}% | {} | {:.0} [{:.0}–{:.0}] | {:.0}{} | {:.1} | {} | {} | {:.0} | {} |",
            r.route.replace("->", " → "),
            if r.hurry > 0 && r.parts_ms.contains_key("token_recompute") {
                format!(" (hurried, {})", r.hurry)
            } else {
                String::new()
            },
            r.direction,
            r.context_tokens,
            cache_word(r.cache),
            r.dst_page_cache_frac * 100.0,
            before.map_or_else(|| "–".to_string(), |b| format!("{:.0}", b.stall_ms.median)),
            r.stall_ms.median,
            r.stall_ms.min,
            r.stall_ms.max,
            r.itl_ms_median,
            if r.itl_from == "as-source" { "*" } else { "" },
            r.stall_ms.median / r.itl_ms_median,
            match (
                r.refill_tokens_median,
                r.refill_gap_ms_median,
                r.refill_gap_ms_max,
            ) {
                (Some(n), Some(g), Some(m)) => format!("{n:.0} × {g:.0} ({m:.0})"),
                (None, Some(g), Some(m)) =>
                    format!("> {} × {g:.0} ({m:.0})", crate::stall::REFILL_WATCH_TOKENS),
                (Some(n), Some(g), None) => format!("{n:.0} × {g:.0}"),
                _ => "–".to_string(),
            },
            if r.lost_ms_median > 0.0 {
                format!("{:.0}", r.lost_ms_median)
            } else {
                "–".to_string()
            },
            r.standby_rss_mib,
            top_parts(r, 3),
        );
    }
    let _ = writeln!(
        s,
        "\n*Lost in all*: what the switch cost the answer beyond the destination's own gaps — the stall, each gap while a refill re-read the history in the batches of the next tokens, and what the answer's end read of the positions the refill had not reached (the legs watch a refill for {} tokens). A re-prefill's is its stall less one gap. A size switch marked *hurried, N* read the head and the newest N positions before its first token, and the positions it chose behind the answer (`--hurry N`). ITL marked * is the destination's own gap as the source of the run's other legs at that length: its refill outlasted the watch.",
        crate::stall::REFILL_WATCH_TOKENS
    );
    let down_warm: Vec<&&StallRow> = rows
        .iter()
        .filter(|r| r.direction == "down" && r.cache == CacheState::Warm)
        .collect();
    let met: Vec<String> = down_warm
        .iter()
        .filter(|r| r.stall_ms.median <= GOAL_FACTOR * r.itl_ms_median)
        .map(|r| format!("{} at {}", r.route.replace("->", " → "), r.context_tokens))
        .collect();
    let _ = writeln!(
        s,
        "\n**Goal** (warm cache, every switch down: stall ≤ {GOAL_FACTOR} × the destination's inter-token latency): met on {} of {} rows{}.",
        met.len(),
        down_warm.len(),
        if met.is_empty() {
            String::new()
        } else {
            format!(" ({})", met.join(", "))
        }
    );
    let _ = writeln!(
        s,
        "Where it is missed, the largest parts say why: on the size routes the selective token recompute (`token_recompute`, the destination re-reading at least 64 positions and a tenth of the context natively) and the head re-read are the switch itself, not the destination's readiness; `other` is sampling and bookkeeping between the switch and the token. Parts are medians of their own, so they need not add up to the stall's median."
    );
    // Whether the switch left anything for the token after its first to wait for.
    let next: Vec<String> = down_warm
        .iter()
        // A size route's next gap is its refill's first batch, reported with the refill.
        .filter(|r| r.method == "molt" && r.refill_gap_ms_median.is_none())
        .filter_map(|r| {
            let n = r.parts_ms.get("next_gap")?;
            Some(format!(
                "{} at {}: {n:.0} ms ({:.1}×)",
                r.route.replace("->", " → "),
                r.context_tokens,
                n / r.itl_ms_median
            ))
        })
        .collect();
    if !next.is_empty() {
        let _ = writeln!(
            s,
            "On a precision route down the destination's pages are mapped back, its cache imported and its first token decoded while the source is still being freed on a thread of its own; the token is shown once the source is gone. The gap before the second token (`next_gap`, not part of the stall), warm, down: {}. Where a switch leaves a standby rung above its destination (a rung between the source and the destination), that rung is freed on a thread of its own while the next token decodes, and its gap shows it.",
            next.join("; ")
        );
    }
    // What standby changed, part by part: the load before against the activation after, on
    // the same down rows.
    let pairs: Vec<(f64, f64)> = down_warm
        .iter()
        .filter_map(|r| {
            let b = doc.before_rows.iter().find(|b| b.same_cell(r))?;
            Some((
                *b.parts_ms.get("load")?,
                r.parts_ms.get("standby_activate").copied().unwrap_or(0.0)
                    + r.parts_ms.get("load").copied().unwrap_or(0.0),
            ))
        })
        .collect();
    if !pairs.is_empty() {
        let before: Vec<String> = pairs.iter().map(|(b, _)| format!("{b:.0}")).collect();
        let after: Vec<String> = pairs.iter().map(|(_, a)| format!("{a:.0}")).collect();
        let _ = writeln!(
            s,
            "What standby takes off a warm switch down, row by row as listed: the destination's load, {} ms before, became {} ms of mapping its pages back.",
            before.join(" / "),
            after.join(" / ")
        );
    }
    warned_section(&mut s, doc);
    if doc.reps < 3 {
        let _ = writeln!(
            s,
            "With {} repetition{} the rows carry no spread, and before and after ran minutes apart on a machine whose load moved: compare the parts, not the totals.",
            doc.reps,
            if doc.reps == 1 { "" } else { "s" }
        );
    }
    if let Some(h) = figures.written.iter().find(|f| f.name == "switch_stall") {
        let _ = writeln!(
            s,
            "\n![switch stall]({figures_rel}/{})\n\n*{}*",
            file_name(&h.path),
            h.caption
        );
    }
    s
}

/// The switches down known ahead (`warned_rows`): the stall when the destination was carried
/// in the background and caught up first, beside the same route's sudden switch, the warning it
/// took, and what it cost the answer meanwhile.
fn warned_section(s: &mut String, doc: &StallDoc) {
    let mut rows: Vec<&StallRow> = doc
        .warned_rows
        .iter()
        .filter(|r| r.direction == "down")
        .collect();
    if rows.is_empty() {
        return;
    }
    rows.sort_by(|a, b| {
        (a.asked_length(), &a.route, a.cache == CacheState::Cold).cmp(&(
            b.asked_length(),
            &b.route,
            b.cache == CacheState::Cold,
        ))
    });
    let _ = writeln!(
        s,
        "
**A switch down known ahead** (the `warned` setup: `SessionOptions::forced_down_waits`, as a falling budget warns of it through the trend the session reads, `src/session/shadow.rs`). The conversation is carried onto the destination in the background while the source goes on — projected, its head and sentences re-read natively — and the destination follows the source, re-reading what it wrote every few tokens; the switch is the last short batch. *Warning* is how many tokens the source decoded from the start of the carry to the switch, *carry* the carry's time on its thread; *source ITL* is the source's gap between two tokens meanwhile (what following costs the answer), beside the same gap before a sudden switch.\n"
    );
    let _ = writeln!(
        s,
        "| route | context | cache | stall known ahead, ms | stall sudden, ms | dst ITL, ms | known ahead / ITL | warning, tokens | carry, ms | source ITL meanwhile / sudden, ms |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let sudden = doc.rows.iter().find(|b| b.same_cell(r));
        let part = |k: &str| r.parts_ms.get(k).copied().unwrap_or(f64::NAN);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} / {} |",
            r.route.replace("->", " → "),
            r.context_tokens,
            cache_word(r.cache),
            r.stall_ms.median,
            sudden.map_or_else(|| "–".to_string(), |b| format!("{:.0}", b.stall_ms.median)),
            r.itl_ms_median,
            r.stall_ms.median / r.itl_ms_median,
            part("prepared_tokens"),
            part("carried_in_background"),
            r.source_itl_ms_median,
            sudden.filter(|b| b.source_itl_ms_median > 0.0).map_or_else(
                || "–".to_string(),
                |b| format!("{:.0}", b.source_itl_ms_median)
            ),
        );
    }
    let warm: Vec<&&StallRow> = rows
        .iter()
        .filter(|r| r.cache == CacheState::Warm)
        .collect();
    let met = warm
        .iter()
        .filter(|r| r.stall_ms.median <= GOAL_FACTOR * r.itl_ms_median)
        .count();
    let _ = writeln!(
        s,
        "\n**Goal, known ahead** (warm cache, every switch down: stall ≤ {GOAL_FACTOR} × the destination's inter-token latency): met on {met} of {} rows. It holds only when the budget's fall is seen at least *warning* tokens before the source stops fitting; a sudden drop is the table above.",
        warm.len()
    );
}
