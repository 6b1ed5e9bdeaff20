//! The results page's section on the size switch's whole bill (`switch_bill.json`): per route
//! and length, the stall, the destination's whole work for the switch, the wait after the
//! answer and the next prompt's first token, each beside the re-prefill's — and a plain
//! sentence for every row where Molt's whole bill is larger than a re-prefill's.

use std::fmt::Write as _;

use crate::bill::{BillDoc, BillRow};

fn ms(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.0}")
    } else {
        "–".into()
    }
}

/// Sentences saying where Molt costs more than a re-prefill, and where it does not.
fn verdicts(r: &BillRow) -> Vec<String> {
    let mut v = Vec::new();
    let at = format!("{} at {} tokens", r.route, r.context_tokens);
    if r.whole_bill_ms.median > r.reprefill_ms.median {
        v.push(format!(
            "{at}: Molt's whole bill ({} ms) is **larger** than a re-prefill's ({} ms): the user waits {} ms at the switch instead of {}, and the rest is read between answers.",
            ms(r.whole_bill_ms.median),
            ms(r.reprefill_ms.median),
            ms(r.stall_ms.median),
            ms(r.reprefill_ms.median)
        ));
    } else {
        v.push(format!(
            "{at}: Molt's whole bill ({} ms) is no larger than a re-prefill's ({} ms).",
            ms(r.whole_bill_ms.median),
            ms(r.reprefill_ms.median)
        ));
    }
    if r.next_ttft_ms.median > r.next_ttft_reprefill_ms.median {
        v.push(format!(
            "{at}: a next prompt sent the moment the answer ends waits **longer** for its first token than after a re-prefill ({} vs {} ms): it reads what the switch left out first.",
            ms(r.next_ttft_ms.median),
            ms(r.next_ttft_reprefill_ms.median)
        ));
    }
    v
}

/// The section, from its `##` heading on.
pub(super) fn section(doc: &BillDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## The size switch's whole bill\n");
    let _ = writeln!(
        s,
        "From `switch_bill.json` (`molt-run --threads {} bench --bill`): a conversation whose notes were read on the large rung, the budget cut to the small one before the first token of an answer about one fact, then a question about another. The *stall* is the wait at the switch; the *whole bill* adds what the destination read for the switch after it (the refill during the answer, the fill between answers); the *wait after the answer* runs from its last token to the prompt accepting input again (the fill runs while the user types; *fill at end* is the order that read it before the answer ended); the *next TTFT* is the second question's first token sent the moment the answer ends, sent after the fill, after a re-prefill switch, and on a native cache of the small rung. Medians (min–max) over the repetitions. Machine: {}.\n",
        doc.threads, doc.contention
    );
    let _ = writeln!(
        s,
        "| route | context tokens | stall ms | whole bill ms (positions) | re-prefill ms | fill: positions, ms, × prefill rate | wait after answer ms (fill at end) | next TTFT ms: at once / after fill / re-prefill / native | recall (facts stated) |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for r in &doc.rows {
        let recall = r
            .recall
            .iter()
            .map(|(arm, x)| format!("{arm} {x}"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            s,
            "| {} | {} | {} ({}–{}) | {} ({}) | {} | {}, {}, {:.2}× | {} ({}) | {} / {} / {} / {} | {} |",
            r.route,
            r.context_tokens,
            ms(r.stall_ms.median),
            ms(r.stall_ms.min),
            ms(r.stall_ms.max),
            ms(r.whole_bill_ms.median),
            ms(r.whole_bill_positions.median),
            ms(r.reprefill_ms.median),
            ms(r.fill_positions.median),
            ms(r.fill_ms.median),
            r.fill_rate_ratio,
            ms(r.wait_after_answer_ms.median),
            ms(r.wait_after_answer_fill_at_end_ms.median),
            ms(r.next_ttft_ms.median),
            ms(r.next_ttft_after_fill_ms.median),
            ms(r.next_ttft_reprefill_ms.median),
            ms(r.next_ttft_native_ms.median),
            recall
        );
    }
    let _ = writeln!(s);
    for r in &doc.rows {
        for v in verdicts(r) {
            let _ = writeln!(s, "- {v}");
        }
    }
    s
}
