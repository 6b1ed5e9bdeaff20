//! The results page's concurrency section, from `serve_concurrency.json` (written by
//! `cargo bench --bench serve_concurrency`): molt's continuous batching beside its own
//! one-at-a-time loop and llama.cpp's `llama-server`, per rung and number of streams, with
//! the goals at four streams checked from the rows.

use std::fmt::Write as _;

use serde::Deserialize;

/// `serve_concurrency.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct ConcurrencyDoc {
    /// One row per server, rung and stream count.
    pub rows: Vec<ConcurrencyRow>,
    /// Tokens per answer.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Rounds per server and cell.
    #[serde(default)]
    pub reps: Option<usize>,
    /// Decode threads of every server.
    #[serde(default)]
    pub threads: Option<u32>,
    /// The context every server had in total.
    #[serde(default)]
    pub n_ctx_total: Option<u32>,
    /// One-minute load average when the run started and ended.
    #[serde(default)]
    pub load_avg_1m_start: Option<f64>,
    /// See `load_avg_1m_start`.
    #[serde(default)]
    pub load_avg_1m_end: Option<f64>,
    /// How the file was put together, when its rows come from more than one run.
    #[serde(default)]
    pub note: Option<String>,
}

/// One server in one cell.
#[derive(Debug, Clone, Deserialize)]
pub struct ConcurrencyRow {
    /// `molt`, `molt-serial` or `llama-server`.
    pub server: String,
    /// The rung's name.
    pub rung: String,
    /// Concurrent streams.
    pub streams: usize,
    /// Tokens streamed per second of wall time, all streams together.
    pub aggregate_tok_s: f64,
    /// Time to first token, median, ms.
    pub ttft_ms_p50: Option<f64>,
    /// Time to first token, 99th percentile, ms.
    pub ttft_ms_p99: Option<f64>,
    /// Inter-token latency, median, ms.
    pub itl_ms_p50: Option<f64>,
    /// Inter-token latency, 99th percentile, ms.
    pub itl_ms_p99: Option<f64>,
    /// Requests that failed.
    pub errors: usize,
    /// Peak resident set of the server process in the cell, MiB.
    pub rss_peak_mib: Option<f64>,
    /// Load average while the cell ran.
    #[serde(default)]
    pub load_avg_1m: Option<f64>,
    /// Whether the rung's weights were repacked for llama.cpp's CPU kernels; `None` in files
    /// written before the benchmark set it (the peer then ran with llama.cpp's default, on).
    #[serde(default)]
    pub repack: Option<bool>,
}

/// The stream count the goals are stated at.
pub const GOAL_STREAMS: usize = 4;

impl ConcurrencyDoc {
    /// The repack setting of the rows, per rung: `off`, `on`, or `tier0 off, tier2 on`.
    fn repack_text(&self) -> String {
        let mut per: Vec<(&str, Option<bool>)> = Vec::new();
        for r in &self.rows {
            if !per.iter().any(|(n, _)| *n == r.rung) {
                per.push((&r.rung, r.repack));
            }
        }
        let word = |b: Option<bool>| match b {
            Some(true) => "on",
            Some(false) => "off",
            None => "not recorded",
        };
        match per.as_slice() {
            [] => "–".into(),
            [(_, b), rest @ ..] if rest.iter().all(|(_, c)| c == b) => word(*b).into(),
            _ => per
                .iter()
                .map(|(n, b)| format!("{n} {}", word(*b)))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    fn find(&self, server: &str, rung: &str, streams: usize) -> Option<&ConcurrencyRow> {
        self.rows
            .iter()
            .find(|r| r.server == server && r.rung == rung && r.streams == streams)
    }

    /// The goals at [`GOAL_STREAMS`] streams, per rung: `(rung, goal, met)`; a goal whose
    /// rows are missing is not listed.
    #[must_use]
    pub fn goals(&self) -> Vec<(String, String, bool)> {
        let mut rungs: Vec<&str> = self.rows.iter().map(|r| r.rung.as_str()).collect();
        rungs.dedup();
        let mut out = Vec::new();
        for rung in rungs {
            let Some(m) = self.find("molt", rung, GOAL_STREAMS) else {
                continue;
            };
            if let Some(l) = self.find("llama-server", rung, GOAL_STREAMS) {
                out.push((
                    rung.to_string(),
                    format!(
                        "aggregate ≥ 0.9 × llama-server's ({:.2} vs {:.2} tok/s)",
                        m.aggregate_tok_s, l.aggregate_tok_s
                    ),
                    m.aggregate_tok_s >= 0.9 * l.aggregate_tok_s,
                ));
            }
            if let Some(s) = self.find("molt-serial", rung, GOAL_STREAMS) {
                out.push((
                    rung.to_string(),
                    format!(
                        "aggregate above molt-serial's ({:.2} vs {:.2} tok/s)",
                        m.aggregate_tok_s, s.aggregate_tok_s
                    ),
                    m.aggregate_tok_s > s.aggregate_tok_s,
                ));
                if let (Some(a), Some(b)) = (m.ttft_ms_p50, s.ttft_ms_p50) {
                    out.push((
                        rung.to_string(),
                        format!("TTFT p50 ≤ ⅓ of molt-serial's ({a:.0} vs {b:.0} ms)"),
                        a * 3.0 <= b,
                    ));
                }
            }
        }
        out
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".to_string(), |x| format!("{x:.digits$}"))
}

/// The section's Markdown.
#[must_use]
pub fn section(doc: &ConcurrencyDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Several streams at once\n");
    let _ = writeln!(
        s,
        "`molt-run serve --parallel N` (`molt`, the default with N = 4) decodes every running answer in one `llama_decode` per step (continuous batching); `--serial` (`molt-serial`) answers one request at a time; `llama-server -np N` is llama.cpp's own server on the same GGUF. Every server its own process with the same decode threads ({}), total context ({} tokens) and llama.cpp CPU repack setting (Molt's choice for the rung: {}), {} tokens per answer, {} rounds per server and cell, the servers taking turns round by round. Load average {} at the start, {} at the end (2 cores shared with other work: absolute numbers are low, the comparison is side by side). From `cargo bench --bench serve_concurrency`.\n",
        doc.threads.map_or("–".into(), |t| t.to_string()),
        doc.n_ctx_total.map_or("–".into(), |t| t.to_string()),
        doc.repack_text(),
        doc.max_tokens.map_or("–".into(), |t| t.to_string()),
        doc.reps.map_or("–".into(), |t| t.to_string()),
        opt(doc.load_avg_1m_start, 1),
        opt(doc.load_avg_1m_end, 1),
    );
    if let Some(note) = &doc.note {
        let _ = writeln!(s, "Rows: {note}; each row's load average is its own.\n");
    }
    let goals = doc.goals();
    if !goals.is_empty() {
        let _ = writeln!(s, "Goals at {GOAL_STREAMS} streams:\n");
        for (rung, goal, met) in &goals {
            let _ = writeln!(
                s,
                "- {rung}: {goal} — {}",
                if *met { "met" } else { "**not met**" }
            );
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(
        s,
        "| rung | streams | server | tok/s (all streams) | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors | peak RSS MiB | load avg |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &doc.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} |",
            r.rung,
            r.streams,
            r.server,
            r.aggregate_tok_s,
            opt(r.ttft_ms_p50, 0),
            opt(r.ttft_ms_p99, 0),
            opt(r.itl_ms_p50, 0),
            opt(r.itl_ms_p99, 0),
            r.errors,
            opt(r.rss_peak_mib, 0),
            opt(r.load_avg_1m, 1),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(server: &str, tok_s: f64, ttft: f64) -> ConcurrencyRow {
        ConcurrencyRow {
            server: server.into(),
            rung: "tier2".into(),
            streams: GOAL_STREAMS,
            aggregate_tok_s: tok_s,
            ttft_ms_p50: Some(ttft),
            ttft_ms_p99: None,
            itl_ms_p50: None,
            itl_ms_p99: None,
            errors: 0,
            rss_peak_mib: None,
            load_avg_1m: None,
            repack: Some(false),
        }
    }

    /// A file of `rows` and nothing else.
    fn doc(rows: Vec<ConcurrencyRow>) -> ConcurrencyDoc {
        ConcurrencyDoc {
            rows,
            max_tokens: None,
            reps: None,
            threads: None,
            n_ctx_total: None,
            load_avg_1m_start: None,
            load_avg_1m_end: None,
            note: None,
        }
    }

    #[test]
    fn goals_are_judged_from_the_rows_at_four_streams() {
        let doc = doc(vec![
            row("molt", 9.0, 1000.0),
            row("molt-serial", 6.0, 2500.0),
            row("llama-server", 10.5, 900.0),
        ]);
        let met: Vec<bool> = doc.goals().iter().map(|g| g.2).collect();
        // 9.0 < 0.9 × 10.5; above serial; 1000 × 3 > 2500.
        assert_eq!(met, [false, true, false]);
        let page = section(&doc);
        assert!(page.contains("| tier2 | 4 | molt | 9.00 |"), "{page}");
        assert!(page.contains("**not met**"));
    }

    #[test]
    fn the_repack_setting_is_stated_once_when_alike_and_per_rung_when_not() {
        let mut doc = doc(vec![
            row("molt", 9.0, 1000.0),
            row("llama-server", 9.0, 1000.0),
        ]);
        assert_eq!(doc.repack_text(), "off");
        let mut t0 = row("molt", 4.0, 3000.0);
        t0.rung = "tier0".into();
        t0.repack = Some(true);
        doc.rows.push(t0);
        assert_eq!(doc.repack_text(), "tier2 off, tier0 on");
        doc.rows.iter_mut().for_each(|r| r.repack = None);
        assert_eq!(doc.repack_text(), "not recorded");
    }
}
