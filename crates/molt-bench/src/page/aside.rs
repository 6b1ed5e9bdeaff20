//! The results page's section on setting an answer aside, from `serve_aside.json` (written by
//! `molt-run bench --serve-aside`): a foreground answer beside a long background one when
//! memory falls below what holds both, with answers set aside and with the whole batch
//! parked, as the user of each answer sees it.

use std::fmt::Write as _;

use super::super::serve_aside::{ArmReport, ServeAsideReport};

fn mib(b: i64) -> String {
    format!("{:.1}", b as f64 / 1_048_576.0)
}

fn row(a: &ArmReport) -> String {
    let fg = &a.foreground;
    let bg = &a.background;
    format!(
        "| {} | {:.2} s | {:.1} s ({}) | {} | {:.1} s | {} | {} | {} MiB |",
        a.arm,
        fg.longest_gap_after_cut_ms / 1e3,
        fg.last_token_after_cut_ms / 1e3,
        if fg.ended_before_memory_returned {
            "before memory returned"
        } else {
            "after memory returned"
        },
        if fg.switches.is_empty() {
            "—".to_string()
        } else {
            fg.switches.join(", ")
        },
        bg.longest_gap_after_cut_ms / 1e3,
        bg.levers.join(" → "),
        match bg.differs_at_char {
            None => "yes".to_string(),
            Some(c) => format!("no: parts at character {c} of {}", bg.text.chars().count()),
        },
        mib(a.max_overshoot_measured_bytes)
    )
}

/// The section.
#[must_use]
pub fn section(doc: &ServeAsideReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## A foreground answer beside a background one when memory falls\n"
    );
    let low = doc.arms.first().map_or(0, |a| a.low_budget_bytes);
    let _ = writeln!(
        s,
        "`molt-run serve --parallel 2` with a background answer ({} prompt tokens, up to {} tokens) and a foreground one ({} prompt tokens, {} tokens) running together; then, for {:.0} s, a budget of {:.1} MiB: {} with the foreground answer whole, not with the background answer's cache beside it. `set-aside` is the server's default (the scheduler's plan sets the background answer aside, its cache to a file under the state directory); `whole-park` is `serve --no-set-aside`, the behaviour before (no rung holds the batch: it parks whole). Each arm on a server of its own; overshoot is the resident set above the idle server's floor against the budget, from {:.0} s after the cut (the switch acting) until memory returns. From `molt-run bench --serve-aside`.\n",
        doc.bg_prompt_tokens,
        doc.bg_max_tokens,
        doc.fg_prompt_tokens,
        doc.fg_max_tokens,
        doc.low_ms as f64 / 1e3,
        low as f64 / 1_048_576.0,
        doc.rung,
        doc.settle_ms as f64 / 1e3
    );
    let _ = writeln!(
        s,
        "| arm | foreground: longest wait after the cut | foreground: last token after the cut | foreground: switches | background: longest wait | background: levers | background: as alone | max overshoot |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for a in &doc.arms {
        let _ = writeln!(s, "{}", row(a));
    }
    let scenes: Vec<(&str, &super::super::serve_aside::SequencesReport)> = doc
        .arms
        .iter()
        .filter_map(|a| a.sequences.as_ref().map(|q| (a.arm.as_str(), q)))
        .collect();
    if !scenes.is_empty() {
        let _ = writeln!(
            s,
            "\nThe same servers, memory ample: two background answers fill both sequences, then the foreground request comes.\n"
        );
        let _ = writeln!(
            s,
            "| arm | foreground: first token after | before a background answer ended | later background answer: levers | as alone |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|");
        for (arm, q) in &scenes {
            let _ = writeln!(
                s,
                "| {} | {:.2} s | {} | {} | {} |",
                arm,
                q.fg_ttft_ms / 1e3,
                if q.fg_before_a_background_ended {
                    "yes"
                } else {
                    "no"
                },
                if q.second.levers.is_empty() {
                    "—".to_string()
                } else {
                    q.second.levers.join(" → ")
                },
                match q.second.differs_at_char {
                    None => "yes".to_string(),
                    Some(c) => format!(
                        "no: parts at character {c} of {}",
                        q.second.text.chars().count()
                    ),
                }
            );
        }
    }
    if let Some(first) = doc.other_rung.first() {
        let _ = writeln!(
            s,
            "\nA set-aside answer resumed on another rung, each on a server of its own: the background answer set aside on the largest rung by the same cut, the foreground answer ended, then a budget of {:.1} MiB, which holds {} with the background answer whole and no larger rung. It resumes there: its history re-read (the default), or its cache carried through the switch (`serve --carry-on-resume`, the behaviour before). What its user would check: the wait once memory allowed, and the facts of its notes ({} strings: names, numbers, the bucket) its answer states — one answer each, greedy.\n",
            first.budget_bytes as f64 / 1_048_576.0,
            doc.rung,
            first.facts
        );
        let _ = writeln!(
            s,
            "| arm | resumed | levers | wait once memory allowed | facts stated | of them written after the switch | the same request alone on the largest rung | alone on {} | not stated |",
            doc.rung
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        for o in &doc.other_rung {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2} s | {}/{} | {} | {}/{} | {}/{} | {} |",
                o.arm,
                o.switch,
                o.levers.join(" → "),
                o.wait_ms / 1e3,
                o.facts_stated.len(),
                o.facts,
                o.facts_stated_after_switch.len(),
                o.facts_alone_source,
                o.facts,
                o.facts_alone_destination,
                o.facts,
                if o.facts_missed.is_empty() {
                    "—".to_string()
                } else {
                    o.facts_missed.join(", ")
                }
            );
        }
    }
    let _ = writeln!(
        s,
        "\n*As alone*: the background answer's text against the one the same request gives alone, unpressured (greedy). A set-aside answer resumes from its file on the rung it left; two answers resumed together are decoded in one batch, whose arithmetic can part from a lone sequence's at a near tie."
    );
    s
}
