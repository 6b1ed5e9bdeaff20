//! The results page's speed section, from `speed.json` (see [`molt::speed`]): Molt's
//! engine beside llama.cpp's own `llama-bench` at Molt's setting (the goal: at least
//! [`GOAL_RATIO`] of the peer, prefill and decode, every rung), and with `--tune` every
//! micro-batch and repack setting with the memory it costs.

use std::fmt::Write as _;

use crate::speed::{PeerRow, SpeedDoc};

/// Share of the peer's rate Molt must reach, prefill and decode, on every rung.
pub const GOAL_RATIO: f64 = 0.97;

fn spread(r: &PeerRow, k: usize) -> String {
    let v: Vec<f64> = r.samples.iter().map(|s| s[k]).collect();
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if v.len() < 2 {
        String::new()
    } else {
        format!(" [{lo:.0}–{hi:.0}]")
    }
}

/// The section's Markdown.
#[must_use]
pub fn section(doc: &SpeedDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Speed beside llama.cpp's own llama-bench\n");
    let Some(peer) = &doc.peer else {
        let _ = writeln!(
            s,
            "`speed.json` has no peer rows: `llama-bench` was not built when it ran (`scripts/llama-tools.sh`).\n"
        );
        return s;
    };
    let load = doc
        .run
        .get("loadavg_1m")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.0);
    let _ = writeln!(
        s,
        "From `speed.json` (`molt-run --threads {} bench --speed{}`): the peer is {peer}, built by `scripts/llama-tools.sh` from the same llama.cpp sources and flags as Molt's engine. Both run in turn, repetition by repetition ({} reps, median [min–max]): a {}-token prefill into an empty cache and {} single-token decodes from an empty cache, F16 cache, flash attention off, the same micro-batch and repack setting. Load average at the start: {load:.2}.\n",
        doc.threads,
        if doc.tuning.is_empty() { "" } else { " --tune" },
        doc.reps,
        doc.prefill_tokens,
        doc.decode_tokens
    );
    let bad: Vec<String> = doc
        .rows
        .iter()
        .flat_map(|r| {
            [("prefill", r.prefill_ratio), ("decode", r.decode_ratio)]
                .into_iter()
                .filter(|(_, x)| *x < GOAL_RATIO)
                .map(move |(what, x)| format!("{} {what} {x:.3}", r.rung))
        })
        .collect();
    let _ = writeln!(
        s,
        "Goal: Molt at least {GOAL_RATIO} × the peer, prefill and decode, on every rung, at Molt's setting — {}.\n",
        if bad.is_empty() {
            "met".to_string()
        } else {
            format!("**not met**: {}", bad.join(", "))
        }
    );
    let table = |s: &mut String, rows: &[PeerRow], with_setting: bool| {
        let _ = writeln!(
            s,
            "| rung |{} Molt prefill tok/s | llama-bench prefill | ratio | Molt decode tok/s | llama-bench decode | ratio | context reserved, MiB | load's anonymous memory, MiB |",
            if with_setting {
                " micro-batch | repack |"
            } else {
                ""
            }
        );
        let _ = writeln!(
            s,
            "|---|{}---|---|---|---|---|---|---|---|",
            if with_setting { "---|---|" } else { "" }
        );
        for r in rows {
            let _ = writeln!(
                s,
                "| {} |{} {:.1}{} | {:.1}{} | {:.3} | {:.1}{} | {:.1}{} | {:.3} | {:.0} | {:.0} |",
                r.rung,
                if with_setting {
                    format!(
                        " {} | {} |",
                        r.n_ubatch,
                        if r.repack { "on" } else { "off" }
                    )
                } else {
                    String::new()
                },
                r.prefill_tok_s,
                spread(r, 0),
                r.peer_prefill_tok_s,
                spread(r, 2),
                r.prefill_ratio,
                r.decode_tok_s,
                spread(r, 1),
                r.peer_decode_tok_s,
                spread(r, 3),
                r.decode_ratio,
                r.reserved_mib,
                r.load_anon_mib
            );
        }
    };
    table(&mut s, &doc.rows, false);
    if !doc.tuning.is_empty() {
        let _ = writeln!(
            s,
            "\n**Micro-batch and repack** (`--tune`): every setting, Molt and the peer side by side. A larger micro-batch reserves a larger compute buffer (its logits are sized for every token of a micro-batch); llama.cpp's CPU repack copies the weights into anonymous memory beside the mapped file. `speed::choose_setting` takes, per rung, the setting whose reference turn (256 prompt tokens read, 256 answer tokens written, at the measured rates) is quickest among those whose extra memory over Molt's default fits the room the budget leaves, and only when it is at least 3% quicker than the default.\n"
        );
        table(&mut s, &doc.tuning, true);
        let _ = writeln!(
            s,
            "\nWhat the policy picks from these rows when the budget leaves room for any of them (reference turn, seconds, against the default's):\n"
        );
        let mut rungs: Vec<&str> = Vec::new();
        for r in &doc.tuning {
            if !rungs.contains(&r.rung.as_str()) {
                rungs.push(&r.rung);
            }
        }
        let d = super::super::speed::Setting::molt_default();
        for rung in rungs {
            let pick = super::super::speed::choose_setting(&doc.tuning, rung, u64::MAX);
            let find = |st: super::super::speed::Setting| {
                doc.tuning
                    .iter()
                    .find(|r| r.rung == rung && r.n_ubatch == st.n_ubatch && r.repack == st.repack)
            };
            if let (Some(p), Some(b)) = (find(pick), find(d)) {
                let turn = super::super::speed::turn_seconds;
                let _ = writeln!(
                    s,
                    "- {rung}: micro-batch {}, repack {} — {:.2} s against {:.2} s{}",
                    pick.n_ubatch,
                    if pick.repack { "on" } else { "off" },
                    turn(p),
                    turn(b),
                    if pick == d {
                        " (the default: nothing is 3% quicker)".to_string()
                    } else {
                        format!(
                            ", for {:.0} MiB more",
                            (p.reserved_mib - b.reserved_mib).max(0.0)
                                + (p.load_anon_mib - b.load_anon_mib).max(0.0)
                        )
                    }
                );
            }
        }
    }
    s
}
