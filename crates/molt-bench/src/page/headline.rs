//! The headline table of the top README: ten measurements, each beside what it is compared with,
//! the results file it comes from and the machine that file was measured on. Every figure is
//! read from the JSON under `results/` through the same types the results page reads; the
//! machine column is the file's own record of its run (CPUs and 1-minute load average at the
//! start), or "not recorded" where the file keeps none.
//!
//! A row whose file is missing, does not parse or lacks what the row shows is left out of the
//! table and named in [`Headline::left_out`] with the reason: nothing is filled in.

use std::fmt::Write as _;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::concurrency::{ConcurrencyDoc, GOAL_STREAMS};
use crate::conditions::{ArmSummary, ConditionsReport};
use crate::figures::read_json;
use crate::figures::recall::{RecallSummary, default_arm, routes, summaries};
use crate::recall::RecallDoc;
use crate::reliability::{MAX_RSS_SLOPE_KIB_PER_SWITCH, SoakRow};
use crate::speed::SpeedDoc;
use crate::stall::{CacheState, StallDoc, StallRow};

/// The ladder of generated tiny models the tests soak; the headline's soak is the real ladder's.
const TEST_LADDER: &str = "tiny";

/// The table and the rows it could not fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headline {
    /// The Markdown table: a header and one line per row, each line ending in a newline.
    pub markdown: String,
    /// `row: why` for every row left out.
    pub left_out: Vec<String>,
}

/// One line of the table.
struct Row {
    measurement: String,
    molt: String,
    compared: String,
    file: &'static str,
    machine: String,
}

/// Every results file the table reads, each read once: the parsed file, or why there is none.
struct Inputs {
    conditions: Result<ConditionsReport, String>,
    recall: Result<RecallDoc, String>,
    stall: Result<StallDoc, String>,
    speed: Result<SpeedDoc, String>,
    serve: Result<(Value, ConcurrencyDoc), String>,
    soak: Result<Vec<SoakRow>, String>,
}

const CONDITIONS: &str = "conditions.json";
const RECALL: &str = "recall.json";
const STALL: &str = "switch_stall.json";
const SPEED: &str = "speed.json";
const SERVE: &str = "serve_concurrency.json";
const SOAK: &str = "soak.json";

type RowFn = fn(&Inputs) -> Result<Row, String>;

/// The rows in the table's order, each with the short name [`Headline::left_out`] uses.
const ROWS: [(&str, RowFn); 10] = [
    ("answers lost", answers_lost),
    ("switch cost", switch_cost),
    ("longest wait", longest_wait),
    ("perplexity after the switch", perplexity),
    ("recall after a size switch", recall),
    ("sudden switch down", sudden_stall),
    ("prepared switch down", prepared_stall),
    ("speed against llama-bench", speed),
    ("streams at once", streams),
    ("soak", soak),
];

/// The headline table from the JSON under `results`.
#[must_use]
pub fn headline(results: &Path) -> Headline {
    let inputs = Inputs {
        conditions: load(results, CONDITIONS),
        recall: load(results, RECALL),
        stall: load(results, STALL),
        speed: load(results, SPEED),
        serve: load::<Value>(results, SERVE).and_then(|v| {
            let doc = serde_json::from_value(v.clone()).map_err(|e| format!("`{SERVE}`: {e}"))?;
            Ok((v, doc))
        }),
        soak: load(results, SOAK),
    };
    let mut markdown = String::from(
        "| measurement | Molt | compared with | file | machine |\n|---|---|---|---|---|\n",
    );
    let mut left_out = Vec::new();
    for (name, row) in ROWS {
        match row(&inputs) {
            Ok(r) => {
                let _ = writeln!(
                    markdown,
                    "| {} | {} | {} | `{}` | {} |",
                    r.measurement, r.molt, r.compared, r.file, r.machine
                );
            }
            Err(why) => left_out.push(format!("{name}: {why}")),
        }
    }
    Headline { markdown, left_out }
}

fn load<T: DeserializeOwned>(dir: &Path, name: &str) -> Result<T, String> {
    let path = dir.join(name);
    if !path.exists() {
        return Err(format!("`{name}` is missing"));
    }
    read_json(&path).map_err(|e| match e {
        crate::BenchError::Json { message, .. } => format!("`{name}` does not parse: {message}"),
        other => format!("`{name}`: {other}"),
    })
}

fn need<T>(v: Option<T>, what: &str) -> Result<T, String> {
    v.ok_or_else(|| format!("no {what}"))
}

/// "2 CPUs, load 0.73" from the counts a file records; "not recorded" when it records neither.
fn machine(cpus: Option<u64>, load: Option<f64>) -> String {
    let cpus = cpus.map(|n| format!("{n} CPU{}", if n == 1 { "" } else { "s" }));
    let load = load.map(|l| format!("load {l:.2}"));
    match (cpus, load) {
        (Some(c), Some(l)) => format!("{c}, {l}"),
        (Some(c), None) => format!("{c}, load not recorded"),
        (None, Some(l)) => format!("CPUs not recorded, {l}"),
        (None, None) => "not recorded".into(),
    }
}

/// The machine from a file's `run` object (`cpus`, `loadavg_1m`, as [`crate::RunInfo`] writes
/// them).
fn machine_of_run(run: &Value) -> String {
    machine(
        run.get("cpus").and_then(Value::as_u64),
        run.get("loadavg_1m").and_then(Value::as_f64),
    )
}

/// `x` with `digits` decimals and its thousands grouped: `1,023.9`.
fn grouped(x: f64, digits: usize) -> String {
    group_digits(&format!("{x:.digits$}"))
}

/// A printed number with commas between its integer part's thousands.
fn group_digits(s: &str) -> String {
    let (sign, s) = s.strip_prefix('-').map_or(("", s), |r| ("-", r));
    let (int, frac) = s.split_once('.').map_or((s, None), |(i, f)| (i, Some(f)));
    let mut out = String::from(sign);
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if let Some(f) = frac {
        out.push('.');
        out.push_str(f);
    }
    out
}

/// `lo–hi` at `digits` decimals, or one number when both print alike.
fn range(lo: f64, hi: f64, digits: usize) -> String {
    let (a, b) = (format!("{lo:.digits$}"), format!("{hi:.digits$}"));
    if a == b { a } else { format!("{a}–{b}") }
}

/// The smallest and largest of `v`; `None` when it is empty.
fn bounds(v: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    v.into_iter().fold(None, |acc, x| match acc {
        None => Some((x, x)),
        Some((lo, hi)) => Some((lo.min(x), hi.max(x))),
    })
}

fn conditions(i: &Inputs) -> Result<&ConditionsReport, String> {
    i.conditions.as_ref().map_err(Clone::clone)
}

/// A built arm of the conditions benchmark.
fn arm<'a>(c: &'a ConditionsReport, id: &str) -> Result<&'a ArmSummary, String> {
    need(
        c.summary.iter().find(|s| s.arm == id && s.built),
        &format!("built arm {id}"),
    )
}

/// The median of a timing of arm `id`.
fn median(
    a: &ArmSummary,
    what: &str,
    f: impl Fn(&ArmSummary) -> Option<&crate::speed::Rate>,
) -> Result<f64, String> {
    need(f(a).map(|r| r.median), &format!("{what} for arm {}", a.arm))
}

fn answers_lost(i: &Inputs) -> Result<Row, String> {
    let c = conditions(i)?;
    let (a, d) = (arm(c, "A")?, arm(c, "D")?);
    Ok(Row {
        measurement: format!(
            "answers lost when the budget falls mid-answer ({} prompts)",
            d.prompts
        ),
        molt: format!("{} of {}", d.killed, d.prompts),
        compared: format!("always-large: {} of {}", a.killed, a.prompts),
        file: CONDITIONS,
        machine: machine_of_run(&c.run),
    })
}

fn switch_cost(i: &Inputs) -> Result<Row, String> {
    let c = conditions(i)?;
    let (cc, d) = (arm(c, "C")?, arm(c, "D")?);
    let cost = |a| median(a, "switch cost", |a| a.switch_cost_ms.as_ref());
    Ok(Row {
        measurement: format!(
            "time spent switching, per answer ({:.0} switches down, weight loading excluded)",
            d.switches_per_answer
        ),
        molt: format!("{} ms", grouped(cost(d)?, 1)),
        compared: format!("re-prefill: {} ms", grouped(cost(cc)?, 1)),
        file: CONDITIONS,
        machine: machine_of_run(&c.run),
    })
}

fn longest_wait(i: &Inputs) -> Result<Row, String> {
    let c = conditions(i)?;
    let (cc, d) = (arm(c, "C")?, arm(c, "D")?);
    let stall = |a| median(a, "longest wait", |a| a.max_stall_ms.as_ref());
    Ok(Row {
        measurement: "longest wait for a token in an answer".into(),
        molt: format!("{} ms", grouped(stall(d)?, 0)),
        compared: format!("re-prefill: {} ms", grouped(stall(cc)?, 0)),
        file: CONDITIONS,
        machine: machine_of_run(&c.run),
    })
}

fn perplexity(i: &Inputs) -> Result<Row, String> {
    let c = conditions(i)?;
    let ppl = |id| -> Result<f64, String> {
        need(
            arm(c, id)?.judge_ppl,
            &format!("judge perplexity for arm {id}"),
        )
    };
    Ok(Row {
        measurement: format!(
            "the answer after the switch, perplexity under {} (lower is better)",
            c.settings.judge
        ),
        molt: format!("{:.2}", ppl("D")?),
        compared: format!(
            "re-prefill {:.2} · always-small {:.2}",
            ppl("C")?,
            ppl("B")?
        ),
        file: CONDITIONS,
        machine: machine_of_run(&c.run),
    })
}

/// Per size route of `recall.json`: the default switch, the destination alone and the
/// re-prefill, each pooled over the route's rows.
fn recall(i: &Inputs) -> Result<Row, String> {
    let doc = i.recall.as_ref().map_err(Clone::clone)?;
    let all = summaries(doc);
    let size: Vec<String> = routes(doc)
        .into_iter()
        .filter(|r| all.iter().any(|x| &x.route == r && x.route_kind == "size"))
        .collect();
    if size.is_empty() {
        return Err("no size route in `recall.json`".into());
    }
    let find = |route: &str, arm: &str| -> Result<&RecallSummary, String> {
        need(
            all.iter().find(|x| x.route == route && x.arm == arm),
            &format!("`{arm}` rows on {route}"),
        )
    };
    let (mut items, mut molt, mut alone, mut reprefill) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for route in &size {
        let default = need(default_arm(doc, route), &format!("default arm on {route}"))?;
        let d = find(route, &default)?;
        let n = find(route, "native-destination")?;
        let r = find(route, "reprefill")?;
        if n.items != d.items || r.items != d.items {
            return Err(format!(
                "on {route} the arms pooled {}, {} and {} answers, not one count",
                d.items, n.items, r.items
            ));
        }
        items.push(d.items);
        molt.push(d.correct.to_string());
        alone.push(n.correct.to_string());
        reprefill.push(r.correct.to_string());
    }
    let of = if items.iter().all(|&n| n == items[0]) {
        items[0].to_string()
    } else {
        items
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" / ")
    };
    Ok(Row {
        measurement: format!(
            "facts recalled after a switch to the 0.5B model (of {of}, {})",
            size.iter()
                .map(|r| r.replace('→', " → "))
                .collect::<Vec<_>>()
                .join(" / ")
        ),
        molt: molt.join(" / "),
        compared: format!(
            "0.5B alone {} · re-prefill {}",
            alone.join(" / "),
            reprefill.join(" / ")
        ),
        file: RECALL,
        machine: machine_of_run(&doc.run),
    })
}

/// Whether a switch re-read positions natively on the destination (the selective token
/// recompute), which a session does on a size route only: on a precision route the projected
/// cache is the whole switch.
fn is_size_route(r: &StallRow) -> bool {
    ["token_recompute", "carried_token_recompute"]
        .iter()
        .any(|k| r.parts_ms.get(*k).is_some_and(|v| *v > 0.0))
}

/// The warm switches down of `rows`: `(stall range, stall over the destination's gap range)`.
fn stall_bounds<'a>(rows: impl Iterator<Item = &'a StallRow>) -> Option<((f64, f64), (f64, f64))> {
    let rows: Vec<&StallRow> = rows
        .filter(|r| r.direction == "down" && r.cache == CacheState::Warm)
        .collect();
    Some((
        bounds(rows.iter().map(|r| r.stall_ms.median))?,
        bounds(rows.iter().map(|r| r.stall_ms.median / r.itl_ms_median))?,
    ))
}

fn sudden_stall(i: &Inputs) -> Result<Row, String> {
    let doc = i.stall.as_ref().map_err(Clone::clone)?;
    let (ms, x) = need(
        stall_bounds(doc.rows.iter().filter(|r| !is_size_route(r))),
        "warm switch down on a precision route",
    )?;
    let (size_ms, size_x) = need(
        stall_bounds(doc.rows.iter().filter(|r| is_size_route(r))),
        "warm switch down on a size route",
    )?;
    Ok(Row {
        measurement: "gap at a sudden switch down, same model at lower precision (warm)".into(),
        molt: format!(
            "{} ms ({}× a token)",
            range(ms.0, ms.1, 0),
            range(x.0, x.1, 1)
        ),
        compared: format!(
            "to the 0.5B model: {} ms ({}×)",
            range(size_ms.0, size_ms.1, 0),
            range(size_x.0, size_x.1, 0)
        ),
        file: STALL,
        machine: machine_of_run(&doc.run),
    })
}

fn prepared_stall(i: &Inputs) -> Result<Row, String> {
    let doc = i.stall.as_ref().map_err(Clone::clone)?;
    let (ms, x) = need(
        stall_bounds(doc.warned_rows.iter()),
        "warm switch down known ahead",
    )?;
    Ok(Row {
        measurement: "gap at a switch down prepared while the budget slides (warm, every route)"
            .into(),
        molt: format!(
            "{} ms ({}× a token)",
            range(ms.0, ms.1, 0),
            range(x.0, x.1, 1)
        ),
        compared: "—".into(),
        file: STALL,
        machine: machine_of_run(&doc.run),
    })
}

fn speed(i: &Inputs) -> Result<Row, String> {
    let doc = i.speed.as_ref().map_err(Clone::clone)?;
    let (lo, hi) = need(
        bounds(
            doc.rows
                .iter()
                .flat_map(|r| [r.prefill_ratio, r.decode_ratio]),
        ),
        "row beside the peer",
    )?;
    Ok(Row {
        measurement: "prefill and decode speed against llama.cpp's `llama-bench` (every rung)"
            .into(),
        molt: format!("{}×", range(lo, hi, 2)),
        compared: "—".into(),
        file: SPEED,
        machine: machine_of_run(&doc.run),
    })
}

/// [`GOAL_STREAMS`] streams on the first rung the file lists.
fn streams(i: &Inputs) -> Result<Row, String> {
    let (raw, doc) = i.serve.as_ref().map_err(Clone::clone)?;
    let rung = need(doc.rows.first().map(|r| r.rung.as_str()), "rows")?;
    let tok_s = |server: &str| -> Result<f64, String> {
        need(
            doc.rows
                .iter()
                .find(|r| r.server == server && r.rung == rung && r.streams == GOAL_STREAMS)
                .map(|r| r.aggregate_tok_s),
            &format!("`{server}` row at {GOAL_STREAMS} streams on {rung}"),
        )
    };
    // The file keeps its machine at the top: the cores, and the load at the start of the run
    // that measured this rung's rows (`load_avg_1m_start_<rung>` when its rows come from a run
    // of their own).
    let load = raw
        .get(format!("load_avg_1m_start_{rung}"))
        .or_else(|| raw.get("load_avg_1m_start"))
        .and_then(Value::as_f64);
    Ok(Row {
        measurement: format!("{GOAL_STREAMS} streams at once on {rung}, tokens/s in all"),
        molt: format!("{:.2}", tok_s("molt")?),
        compared: format!(
            "`llama-server` {:.2} · one at a time {:.2}",
            tok_s("llama-server")?,
            tok_s("molt-serial")?
        ),
        file: SERVE,
        machine: machine(raw.get("cores").and_then(Value::as_u64), load),
    })
}

fn soak(i: &Inputs) -> Result<Row, String> {
    let rows = i.soak.as_ref().map_err(Clone::clone)?;
    let r = need(
        rows.iter().find(|r| r.ladder != TEST_LADDER),
        "soak on a real ladder",
    )?;
    Ok(Row {
        measurement: format!(
            "resident-set growth over {} switches on the real ladder (`{}`)",
            group_digits(&r.switches.to_string()),
            r.ladder
        ),
        molt: format!("{:.2} KiB per switch", r.rss_slope_kib_per_switch),
        compared: format!("goal: ≤ {MAX_RSS_SLOPE_KIB_PER_SWITCH} KiB"),
        file: SOAK,
        // The soak's record keeps no run metadata.
        machine: machine(None, None),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_grouped_and_ranges_collapse() {
        assert_eq!(grouped(1023.88, 1), "1,023.9");
        assert_eq!(grouped(431.33, 1), "431.3");
        assert_eq!(grouped(1_234_567.0, 0), "1,234,567");
        assert_eq!(grouped(-1000.0, 0), "-1,000");
        assert_eq!(range(60.7, 102.1, 0), "61–102");
        assert_eq!(range(2.96, 3.04, 1), "3.0");
        assert_eq!(machine(Some(1), None), "1 CPU, load not recorded");
        assert_eq!(machine(None, None), "not recorded");
    }

    fn write(dir: &Path, name: &str, v: &Value) {
        std::fs::write(dir.join(name), serde_json::to_string(v).unwrap()).unwrap();
    }

    fn peer_row(rung: &str, prefill: f64, decode: f64) -> Value {
        serde_json::json!({
            "rung": rung, "n_ubatch": 128, "repack": false,
            "prefill_tok_s": 100.0, "decode_tok_s": 20.0,
            "peer_prefill_tok_s": 100.0, "peer_decode_tok_s": 20.0,
            "prefill_ratio": prefill, "decode_ratio": decode,
            "samples": [], "reserved_mib": 90.0, "load_anon_mib": 50.0
        })
    }

    fn serve_row(server: &str, streams: usize, tok_s: f64) -> Value {
        serde_json::json!({
            "server": server, "rung": "big", "streams": streams, "aggregate_tok_s": tok_s,
            "ttft_ms_p50": null, "ttft_ms_p99": null, "itl_ms_p50": null, "itl_ms_p99": null,
            "errors": 0, "rss_peak_mib": null
        })
    }

    #[test]
    fn rows_come_from_the_files_present_and_a_missing_file_drops_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(
            d,
            SPEED,
            &serde_json::json!({
                "run": {"cpus": 4, "loadavg_1m": 0.5},
                "threads": 4, "prefill_tokens": 256, "decode_tokens": 32, "reps": 3,
                "rungs": [], "peer": "llama-bench",
                "rows": [peer_row("big", 0.991, 1.004), peer_row("small", 1.031, 0.962)]
            }),
        );
        write(
            d,
            SERVE,
            &serde_json::json!({
                "cores": 2, "load_avg_1m_start": 1.5,
                "rows": [
                    serve_row("molt", 4, 30.0), serve_row("molt-serial", 4, 20.0),
                    serve_row("llama-server", 4, 25.5), serve_row("molt", 1, 9.0)
                ]
            }),
        );
        write(
            d,
            SOAK,
            &serde_json::json!([
                {"ladder": "tiny", "switches": 1000, "rss_slope_kib_per_switch": 0.1,
                 "fd_slope": 0.0},
                {"ladder": "real", "switches": 2500, "rss_slope_kib_per_switch": 0.456,
                 "fd_slope": 0.0}
            ]),
        );
        // Not JSON: its rows are left out, not guessed.
        std::fs::write(d.join(RECALL), "{").unwrap();
        let h = headline(d);
        assert_eq!(
            h.markdown,
            "| measurement | Molt | compared with | file | machine |\n\
             |---|---|---|---|---|\n\
             | prefill and decode speed against llama.cpp's `llama-bench` (every rung) | 0.96–1.03× | — | `speed.json` | 4 CPUs, load 0.50 |\n\
             | 4 streams at once on big, tokens/s in all | 30.00 | `llama-server` 25.50 · one at a time 20.00 | `serve_concurrency.json` | 2 CPUs, load 1.50 |\n\
             | resident-set growth over 2,500 switches on the real ladder (`real`) | 0.46 KiB per switch | goal: ≤ 1 KiB | `soak.json` | not recorded |\n"
        );
        // conditions.json (4 rows) and switch_stall.json (2) are missing, recall.json broken.
        assert_eq!(h.left_out.len(), 7, "{:?}", h.left_out);
        assert!(h.left_out[0].starts_with("answers lost: `conditions.json` is missing"));
        assert!(
            h.left_out
                .iter()
                .any(|l| l.starts_with("recall after a size switch: `recall.json` does not parse")),
            "{:?}",
            h.left_out
        );
    }

    #[test]
    fn a_row_lacking_a_field_is_left_out_and_the_others_stay() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // No llama-server row at four streams, and a run record without the load.
        write(
            d,
            SERVE,
            &serde_json::json!({
                "cores": 2,
                "rows": [serve_row("molt", 4, 30.0), serve_row("molt-serial", 4, 20.0)]
            }),
        );
        write(
            d,
            SOAK,
            &serde_json::json!([{"ladder": "tiny", "switches": 1000,
                                 "rss_slope_kib_per_switch": 0.1, "fd_slope": 0.0}]),
        );
        let h = headline(d);
        assert_eq!(
            h.markdown,
            "| measurement | Molt | compared with | file | machine |\n|---|---|---|---|---|\n"
        );
        assert!(
            h.left_out
                .contains(&"streams at once: no `llama-server` row at 4 streams on big".into()),
            "{:?}",
            h.left_out
        );
        assert!(
            h.left_out
                .contains(&"soak: no soak on a real ladder".into()),
            "{:?}",
            h.left_out
        );
        assert_eq!(h.left_out.len(), 10);
    }
}
