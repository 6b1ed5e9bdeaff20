//! The results page's `QoS` section, from `serve_qos.json` (written by `molt-run bench
//! --serve-qos`): conversations of two classes through the real server under one moving
//! budget — the scheduler's plan as the server's own loop applies it — with the overshoot,
//! what was killed, lost, hibernated and woken, and whether each last answer recalls its first
//! turn's fact.

use std::fmt::Write as _;

use super::super::serve_qos::{ConversationReport, ServeQosDoc};

fn mib(b: i64) -> f64 {
    b as f64 / 1_048_576.0
}

/// A cell of the page's table: the text on one line, without the table's separator.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
        .replace('\n', " ")
        .trim()
        .to_owned()
}

fn row(c: &ConversationReport) -> String {
    let rungs: Vec<String> = c.turns.iter().map(|t| t.rungs.join(" → ")).collect();
    let cached: Vec<String> = c
        .turns
        .iter()
        .map(|t| format!("{} of {}", t.cached_tokens, t.prompt_tokens))
        .collect();
    format!(
        "| {} | {} | {} | {} of {} | {} | {} | {} | {} |",
        c.spec.id,
        c.spec.class,
        c.spec.priority,
        c.turns.len(),
        c.spec.turns.len(),
        rungs.join(" / "),
        cached.join(" / "),
        if c.recalled { "yes" } else { "no" },
        c.turns
            .last()
            .map_or_else(String::new, |t| format!("\"{}\"", cell(&t.answer)))
    )
}

/// The section, with the figure's place left to the caller.
#[allow(clippy::cast_precision_loss)]
pub(super) fn section(doc: &ServeQosDoc) -> String {
    let r = &doc.report;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## Several conversations, one budget, through the server\n"
    );
    let _ = writeln!(
        s,
        "From `serve_qos.json`: {} conversations through the real server (`molt-run serve --parallel {}` as a child process, n_ctx {}, {} tokens per answer, turns {} rounds apart) under {}{}, {} rounds of {:.0} s in {:.0} s; the scheduler's plan is applied by the server's own loop (`sched::plan`, `src/server/batch.rs`). Killed {}, conversations lost {}, hibernated {}, woken {}, rungs released {}; {} of {} last answers recall their first turn's fact. Max overshoot over the rounds: {:+.1} MiB measured (the resident set above the server's {:.0} MiB floor), {:+.1} MiB modelled, {:+.1} MiB raw resident set (negative = inside the budget).\n",
        r.conversations.len(),
        r.parallel,
        doc.n_ctx,
        doc.max_tokens,
        r.think_rounds,
        r.budget_source,
        if doc.real_hog { " (a real hog)" } else { "" },
        r.rounds.len(),
        r.round_ms as f64 / 1e3,
        r.wall_s,
        r.killed,
        r.lost_conversations,
        r.hibernated,
        r.resumed,
        r.released,
        r.recalled,
        r.conversations.len(),
        mib(r.max_overshoot_measured_bytes),
        r.floor_rss_bytes as f64 / 1_048_576.0,
        mib(r.max_overshoot_modelled_bytes),
        mib(r.max_overshoot_rss_bytes),
    );
    let _ = writeln!(
        s,
        "| conversation | class | priority | turns answered | rungs per turn | prompt tokens from a cache or file, per turn | recalled | last answer |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for c in &r.conversations {
        let _ = writeln!(s, "{}", row(c));
    }
    s
}
