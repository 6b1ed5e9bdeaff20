//! The results page (`results/README.md`), the figure page (`results/figures.md`) and the top
//! README's headline table ([`headline`], spliced by [`readme`]), generated from the
//! benchmark's JSON: every number on them is read from a results file, and every judgement
//! ("inside the noise", "does not pay for itself") is a rule applied to those numbers, stated
//! next to it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::BenchError;
use super::conditions::{ArmSummary, ConditionsReport, PairedComparison, TimingComparison};
use super::cost_sweep::SweepDoc;
use super::figures::{CurveDoc, FigureSet, ResidualDoc, read_json, serde_word};
use super::recall::RecallDoc;
use super::speed::Rate;
use molt::routes::RouteKind;

mod aside;
mod bill;
mod concurrency;
pub mod headline;
mod precision;
mod qos;
pub mod readme;
mod recall;
mod reliability;
mod speed;
mod stall;

/// Where the page's inputs are and where figures live relative to the page and to the
/// repository root.
#[derive(Debug, Clone)]
pub struct PageOptions {
    /// Directory holding the JSON (and where the page is written).
    pub results: PathBuf,
    /// Figure directory relative to `results` (for the page's links).
    pub figures_rel_results: String,
    /// Figure directory relative to the repository root (for the snippet's links).
    pub figures_rel_root: String,
}

fn f(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.digits$}"),
        _ => "–".into(),
    }
}

fn rate(r: Option<&Rate>, digits: usize) -> String {
    match r {
        Some(r) if r.samples.len() > 1 => {
            format!("{:.d$} [{:.d$}–{:.d$}]", r.median, r.min, r.max, d = digits)
        }
        Some(r) => format!("{:.digits$}", r.median),
        None => "–".into(),
    }
}

#[allow(clippy::cast_precision_loss)]
fn mib(b: Option<u64>) -> String {
    b.map_or("–".into(), |b| format!("{:.0}", b as f64 / 1_048_576.0))
}

#[allow(clippy::cast_precision_loss)]
fn mib_i(b: Option<i64>) -> String {
    b.map_or("–".into(), |b| format!("{:+.0}", b as f64 / 1_048_576.0))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{:.1}%", x * 100.0))
}

fn pair(a: Option<f64>, b: Option<f64>, digits: usize) -> String {
    format!("{} / {}", f(a, digits), f(b, digits))
}

fn find<'a>(r: &'a ConditionsReport, id: &str) -> Option<&'a ArmSummary> {
    r.summary.iter().find(|s| s.arm == id && s.built)
}

fn timing<'a>(
    r: &'a ConditionsReport,
    metric: &str,
    a: &str,
    b: &str,
) -> Option<&'a TimingComparison> {
    r.timing
        .iter()
        .find(|t| t.metric == metric && t.a == a && t.b == b)
}

fn paired<'a>(r: &'a ConditionsReport, metric: &str, a: &str) -> Option<&'a PairedComparison> {
    r.paired.iter().find(|p| p.metric == metric && p.a == a)
}

fn noise_words(t: &TimingComparison, reps: usize) -> &'static str {
    if reps < 2 {
        "from a single repetition, so with no noise estimate"
    } else if t.noise.inside_noise {
        "inside the noise (the repetitions' ranges overlap)"
    } else {
        "outside the noise (the repetitions' ranges do not overlap)"
    }
}

/// The conditions table (Markdown), one row per arm.
#[must_use]
pub fn table(r: &ConditionsReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| arm | what | killed | tokens delivered | TTFT ms | total ms | max stall ms | max stall excl. load ms | switch cost ms | load ms | FLOPs avoided | handoff JSD prec. / size | × paired floor prec. / size | judge ppl | repeated 4-grams | attention flatness prec. / size | peak footprint MiB | max overshoot MiB |"
    );
    let _ = writeln!(s, "|{}", "---|".repeat(18));
    for a in &r.summary {
        if !a.built {
            let _ = writeln!(
                s,
                "| {} | {} | not built | | | | | | | | | | | | | | | |",
                a.arm, a.label
            );
            continue;
        }
        let _ = writeln!(
            s,
            "| {} | {} | {}/{} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            a.arm,
            a.label,
            a.killed,
            a.prompts,
            a.tokens_delivered,
            rate(a.ttft_ms.as_ref(), 0),
            rate(a.total_ms.as_ref(), 0),
            rate(a.max_stall_ms.as_ref(), 0),
            rate(a.max_stall_excl_load_ms.as_ref(), 0),
            rate(a.switch_cost_ms.as_ref(), 1),
            rate(a.load_ms.as_ref(), 0),
            pct(a.flops_avoided),
            pair(a.handoff_jsd_precision, a.handoff_jsd_size, 4),
            pair(a.seam_ratio_precision, a.seam_ratio_size, 2),
            f(a.judge_ppl, 2),
            f(a.repetition, 3),
            pair(a.flatness_precision, a.flatness_size, 3),
            mib(a.peak_footprint_bytes),
            if a.killed > 0 && a.max_overshoot_bytes.is_none() {
                "killed".into()
            } else {
                mib_i(a.max_overshoot_bytes)
            },
        );
    }
    s
}

#[allow(clippy::too_many_lines)]
fn tradeoff(r: &ConditionsReport) -> String {
    let mut s = String::new();
    let n = r.prompts.len();
    let first = r.settings.steps.first().copied().unwrap_or(0);
    if let Some(a) = find(r, "A") {
        let _ = writeln!(
            s,
            "- **A, always-large**, lost {} of {} answers: the budget fell below {}'s footprint at token {first}, and a process that holds its rung is killed there.",
            a.killed,
            n,
            r.rungs.first().map_or("the largest rung", String::as_str)
        );
    }
    if let (Some(b), Some(d)) = (find(r, "B"), find(r, "D")) {
        let _ = writeln!(
            s,
            "- **B, always-small**, lost {} answers but ran the small rung for all of them: {} scores its answers from token {first} on at perplexity {} against {} for Molt's (D), and B pays that on every request, pressure or not.",
            b.killed,
            r.settings.judge,
            f(b.judge_ppl, 2),
            f(d.judge_ppl, 2)
        );
    }
    if let (Some(c), Some(d)) = (find(r, "C"), find(r, "D")) {
        if let Some(t) = timing(r, "switch_cost_ms", "C", "D") {
            let _ = writeln!(
                s,
                "- **The switch.** Molt's switches ({:.0} per answer) cost {} ms per answer (median over {} repetitions, loading excluded) against {} ms for a re-prefill (C): {:.1}× cheaper, {}. Molt avoided {} of the re-prefill's FLOPs per switch.",
                d.switches_per_answer,
                f(Some(t.b_median), 1),
                r.settings.reps,
                f(Some(t.a_median), 1),
                t.noise.ratio,
                noise_words(t, r.settings.reps),
                pct(d.flops_avoided)
            );
        }
        if let Some(t) = timing(r, "max_stall_ms", "C", "D") {
            let _ = writeln!(
                s,
                "- **The stall the user sees.** The longest wait for a token was {} ms for Molt and {} ms for the re-prefill ({:.1}×, {}); both include mapping the destination's weights ({} ms vs {} ms per answer), which every strategy pays.",
                f(Some(t.b_median), 0),
                f(Some(t.a_median), 0),
                t.noise.ratio,
                noise_words(t, r.settings.reps),
                f(d.load_ms.as_ref().map(|r| r.median), 0),
                f(c.load_ms.as_ref().map(|r| r.median), 0),
            );
        }
        for (kind, dj, cj, paired) in [
            (
                "size",
                d.handoff_jsd_size,
                c.handoff_jsd_size,
                d.handoff_floor_size.zip(d.seam_ratio_size),
            ),
            (
                "precision",
                d.handoff_jsd_precision,
                c.handoff_jsd_precision,
                d.handoff_floor_precision.zip(d.seam_ratio_precision),
            ),
        ] {
            if let (Some(dj), Some((floor, ratio))) = (dj, paired) {
                let verdict = if ratio <= 2.0 {
                    "within the issue's 2× of the floor"
                } else {
                    "beyond the issue's 2× of the floor"
                };
                let _ = writeln!(
                    s,
                    "- **The seam, {kind} route.** Handoff JSD {dj:.4} nats for Molt; at the same switches a native cache of the same history (what a re-prefill gives) reaches {floor:.4} — the floor, since two different models simply disagree that much: {ratio:.2}× the floor, {verdict}. (The re-prefill arm's own handoff, {}, is read at other points of other texts, as its answers diverge from Molt's after the first switch.)",
                    f(cj, 4)
                );
            } else if let (Some(dj), Some(cj)) = (dj, cj) {
                let verdict = if dj <= cj {
                    "Molt reaches the floor here".to_string()
                } else {
                    format!(
                        "Molt does not reach the floor: {:.1}× its divergence",
                        dj / cj.max(1e-12)
                    )
                };
                let _ = writeln!(
                    s,
                    "- **The seam, {kind} route.** Handoff JSD {dj:.4} nats for Molt against {cj:.4} for the re-prefill, whose divergence is the floor (two different models simply disagree that much): {verdict}."
                );
            }
        }
        if let (Some(dp), Some(cp)) = (d.judge_ppl, c.judge_ppl) {
            let _ = writeln!(
                s,
                "- **After the seam.** The judge scores Molt's continuation at perplexity {dp:.2} and the re-prefill's at {cp:.2} (repeated 4-grams {} vs {}).",
                f(d.repetition, 3),
                f(c.repetition, 3)
            );
        }
        let seam_ratio = d.seam_ratio_size.or(d.seam_ratio_precision).or_else(|| {
            d.handoff_jsd_size
                .or(d.handoff_jsd_precision)
                .zip(c.handoff_jsd_size.or(c.handoff_jsd_precision))
                .map(|(dj, cj)| dj / cj.max(1e-12))
        });
        if let (Some(t), Some(ratio)) = (timing(r, "switch_cost_ms", "C", "D"), seam_ratio) {
            let _ = writeln!(
                s,
                "\nSo the trade is a purchase, not a free lunch: a {:.1}× cheaper switch, bought with {:.1}× the re-prefill's divergence at the seam{}.",
                t.noise.ratio,
                ratio,
                if d.handoff_jsd_size.is_some() {
                    " (size route)"
                } else {
                    ""
                }
            );
        }
    }
    s
}

fn ablations(r: &ConditionsReport) -> String {
    let mut s = String::new();
    let d_spec = r.arms.iter().find(|a| a.id == "D");
    for a in r.summary.iter().filter(|a| a.arm.starts_with("D-")) {
        if !a.built {
            let _ = writeln!(
                s,
                "- **{}** — {}: not built; the slot is kept so the table shows the gap.",
                a.arm, a.label
            );
            continue;
        }
        let spec = r.arms.iter().find(|x| x.id == a.arm);
        // Compared by the map actually loaded: `Dense` on the size route is D's own map.
        let differs = |x: &super::conditions::ArmSpec, d: &super::conditions::ArmSpec, k| {
            x.variant(k).tag(k) != d.variant(k).tag(k)
        };
        // An option arm (top-k, tail, head re-read, refill) adds a mechanism to D on every route.
        let option = spec.is_some_and(super::conditions::ArmSpec::is_option);
        let (prec, size) = match (spec, d_spec) {
            // Without the head re-read every route's switch changes.
            (Some(x), Some(d)) if !option => (
                differs(x, d, RouteKind::Precision) || x.head != d.head,
                differs(x, d, RouteKind::Size) || x.head != d.head,
            ),
            _ => (true, true),
        };
        // Seam metrics only on the route the ablation changes: a changed precision map
        // changes what the middle rung writes, so the size-route seam that follows happens in
        // another context and is not comparable.
        let mut metrics = Vec::new();
        if prec {
            metrics.push(("handoff_jsd_precision", "handoff JSD (precision)"));
            metrics.push(("flatness_precision", "flatness (precision)"));
        }
        if size {
            metrics.push(("handoff_jsd_size", "handoff JSD (size)"));
            metrics.push(("flatness_size", "flatness (size)"));
        }
        metrics.push(("judge_ppl", "judge perplexity"));
        metrics.push(("repetition", "repeated 4-grams"));
        let mut parts = Vec::new();
        let mut worse = Vec::new();
        let mut better = Vec::new();
        for (m, label) in metrics {
            if let Some(p) = paired(r, m, &a.arm) {
                let n = p.a_worse + p.a_better + p.ties;
                if p.a_worse * 2 > n {
                    worse.push(label);
                }
                if p.a_better * 2 > n {
                    better.push(label);
                }
                parts.push(format!(
                    "{label} {:.4} vs {:.4} (worse on {}/{n} prompts, better on {})",
                    p.a_mean, p.b_mean, p.a_worse, p.a_better
                ));
            }
        }
        if let Some(t) = timing(r, "switch_cost_ms", &a.arm, "D") {
            parts.push(format!(
                "switch cost {:.1} vs {:.1} ms ({})",
                t.a_median,
                t.b_median,
                if r.settings.reps < 2 {
                    "one repetition, no noise estimate"
                } else if t.noise.inside_noise {
                    "inside the noise"
                } else {
                    "outside the noise"
                }
            ));
        }
        // An option may move its cost out of the switch (a background refill runs between
        // the tokens after it): its whole-answer time and longest stall say what it cost.
        if option && let Some(d) = r.summary.iter().find(|x| x.arm == "D") {
            if let (Some(x), Some(y)) = (&a.max_stall_excl_load_ms, &d.max_stall_excl_load_ms) {
                parts.push(format!(
                    "max stall excl. load {:.0} vs {:.0} ms",
                    x.median, y.median
                ));
            }
            if let (Some(x), Some(y)) = (&a.total_ms, &d.total_ms) {
                parts.push(format!("total {:.0} vs {:.0} ms", x.median, y.median));
            }
        }
        let verdict = match (parts.is_empty(), worse.is_empty(), better.is_empty()) {
            (true, _, _) => "no quality difference could be measured on this run".to_string(),
            (false, true, false) if option => format!(
                "turning it on makes most prompts better on {} and worse on none: weigh that against the switch cost above",
                better.join(", ")
            ),
            (false, false, true) if option => format!(
                "turning it on makes most prompts worse on {}: on this run it does not earn its cost",
                worse.join(", ")
            ),
            (false, true, true) if option => "turning it on moves no measure for most prompts: on this run it does not earn its cost".to_string(),
            (false, false, false) if option => format!(
                "mixed: turning it on makes most prompts better on {} but worse on {}",
                better.join(", "),
                worse.join(", ")
            ),
            (false, false, true) => format!(
                "removing it makes most prompts worse on {}: the mechanism pays for itself here",
                worse.join(", ")
            ),
            (false, false, false) => format!(
                "mixed: removing it makes most prompts worse on {} but better on {}",
                worse.join(", "),
                better.join(", ")
            ),
            (false, true, true) => "removing it did not make most prompts worse on any measure: on this run the mechanism does not pay for itself".to_string(),
            (false, true, false) => format!(
                "removing it made most prompts better on {} and worse on none: on this run the mechanism does not pay for itself",
                better.join(", ")
            ),
        };
        let route = match (prec, size) {
            (true, true) => "both routes",
            (true, false) => "the precision route only",
            (false, true) => "the size route only",
            (false, false) => "no route",
        };
        let _ = writeln!(
            s,
            "- **{}** (Molt {}; changes {route}): {}. *{verdict}.*",
            a.arm,
            a.removes,
            parts.join("; ")
        );
    }
    s
}

fn sweep_section(doc: &SweepDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| route | kind | context tokens | transplant ms | of it, recompute ms (positions) | re-prefill ms | speedup | FLOPs avoided | transplant JSD | re-prefill JSD (floor) | seam ratio | mean JSD over {} steps, transplant / floor | mean seam ratio |",
        super::cost_sweep::SEAM + 1
    );
    let _ = writeln!(s, "|{}", "---|".repeat(13));
    for p in &doc.points {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {:.1}× | {} | {:.4} | {:.4} | {:.2} | {} | {} |",
            p.route,
            serde_word(&p.kind),
            p.context_tokens,
            rate(Some(&p.transplant_ms), 1),
            if p.recomputed > 0 {
                format!("{:.1} ({})", p.recompute_ms, p.recomputed)
            } else {
                "—".to_string()
            },
            rate(Some(&p.reprefill_ms), 0),
            p.speedup,
            pct(Some(p.flops_avoided)),
            p.transplant_jsd,
            p.reprefill_jsd,
            p.seam_ratio,
            pair(Some(p.transplant_jsd_mean), Some(p.reprefill_jsd_mean), 4),
            f(Some(p.seam_mean_ratio), 2),
        );
    }
    if doc.points.iter().any(|p| !p.tails.is_empty()) {
        let _ = writeln!(
            s,
            "\n**Native re-reads beside the projection, without the token recompute** (head re-read: the history's first N tokens decoded on the destination, `--head-reread N`; tail recompute: its last N tokens, `--tail-recompute N`): what each buys at the seam and what it costs.\n"
        );
        let _ = writeln!(
            s,
            "| route | context tokens | re-read | cost ms | speedup vs re-prefill | seam JSD | mean JSD over {} steps | mean seam ratio (plain transplant) |",
            super::cost_sweep::SEAM + 1
        );
        let _ = writeln!(s, "|{}", "---|".repeat(8));
        for p in &doc.points {
            for t in &p.tails {
                let what = if t.tail > 0 {
                    format!("head {} + tail {}", t.head, t.tail)
                } else {
                    format!("head {}", t.head)
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {what} | {} | {:.1}× | {:.4} | {:.4} | {} ({}) |",
                    p.route,
                    p.context_tokens,
                    rate(Some(&t.cost_ms), 1),
                    t.speedup,
                    t.jsd,
                    t.jsd_mean,
                    f(t.seam_mean_ratio, 2),
                    f(Some(p.seam_mean_ratio), 2),
                );
            }
        }
    }
    s
}

/// The learning curve of one route's maps: a table of residuals by training-set size.
fn curve_section(doc: &CurveDoc) -> String {
    let c = &doc.curve;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n### Against training-set size ({})\n\nThe same route fitted on growing training sets (`molt-run map-curve`, `projector_curve.json`), every point measured on the same {} held-out tokens of the project's corpus. The first {} training tokens are the project corpus's own (the shipped fit); beyond them the training text is extra text the machine already had (`scripts/toolchain-corpus.sh`), so later points also show how text of another kind transfers.\n",
        c.route, c.held_out_tokens, c.base_train_tokens
    );
    let _ = writeln!(
        s,
        "| training tokens | of them extra | K held-out | K train | V held-out | V train | median λ (K / V) |"
    );
    let _ = writeln!(s, "|{}", "---|".repeat(7));
    let lam = |x: Option<f64>| x.map_or_else(|| "–".into(), |v| format!("{v:.2e}"));
    for p in &c.points {
        let _ = writeln!(
            s,
            "| {} | {} | {:.4} | {:.4} | {:.4} | {:.4} | {} / {} |",
            p.train_tokens,
            p.extra_tokens,
            p.k_held_out,
            p.k_train,
            p.v_held_out,
            p.v_train,
            lam(p.lambda.k),
            lam(p.lambda.v)
        );
    }
    s
}

fn residual_section(doc: &ResidualDoc) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| route | kind | variant | K held-out | K train | V held-out | V train |"
    );
    let _ = writeln!(s, "|{}", "---|".repeat(7));
    for r in &doc.report.routes {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} |",
            r.route,
            serde_word(&r.kind),
            serde_word(&r.variant),
            r.fit.k.held_out,
            r.fit.k.train,
            r.fit.v.held_out,
            r.fit.v.train
        );
    }
    s
}

/// Writes `README.md` and `figures.md` into `opts.results`; returns their paths.
///
/// # Errors
/// [`BenchError::Io`] / [`BenchError::Json`] when an input present cannot be read or parsed,
/// or the page cannot be written. `conditions.json` is required; the other inputs add their
/// sections when present.
#[allow(clippy::too_many_lines)]
pub fn write(opts: &PageOptions, figures: &FigureSet) -> Result<Vec<PathBuf>, BenchError> {
    let dir = &opts.results;
    let mut r: ConditionsReport = read_json(&dir.join("conditions.json"))?;
    // The prompt-by-prompt comparisons are re-derived from the cells, so the page reads them
    // the way this code does (a file written by an older build keeps its raw cells).
    r.paired = super::conditions::paired_comparisons(&r.arms, &r.cells);
    let sweep: Option<SweepDoc> = optional(&dir.join("cost_sweep.json"))?;
    let resid: Option<ResidualDoc> = optional(&dir.join("projector_residuals.json"))?;
    let curve: Option<CurveDoc> = optional(&dir.join("projector_curve.json"))?;
    let qos: Option<super::serve_qos::ServeQosDoc> = optional(&dir.join("serve_qos.json"))?;
    let recall: Option<RecallDoc> = optional(&dir.join("recall.json"))?;
    let summaries: Option<RecallDoc> = optional(&dir.join("recall_summaries.json"))?;
    let by_kind: Option<RecallDoc> = optional(&dir.join("recall_kinds.json"))?;
    let precision_doc: Option<super::precision::PrecisionDoc> =
        optional(&dir.join("precision_rungs.json"))?;
    let stall_doc: Option<super::stall::StallDoc> = optional(&dir.join("switch_stall.json"))?;
    let bill_doc: Option<super::bill::BillDoc> = optional(&dir.join("switch_bill.json"))?;
    let reliability: Option<super::reliability::Reliability> =
        optional(&dir.join("reliability.json"))?;
    let speed_doc: Option<super::speed::SpeedDoc> = optional(&dir.join("speed.json"))?;
    let sampling_doc: Option<super::sampling::SamplingDoc> = optional(&dir.join("sampling.json"))?;
    let concurrency: Option<concurrency::ConcurrencyDoc> =
        optional(&dir.join("serve_concurrency.json"))?;
    let aside_doc: Option<super::serve_aside::ServeAsideReport> =
        optional(&dir.join("serve_aside.json"))?;
    let fig = |name: &str| figures.written.iter().find(|f| f.name == name);
    let mut s = String::new();
    let _ = writeln!(s, "# Molt — results\n");
    // The optional inputs present, in the order their sections appear.
    let inputs: String = [
        (sweep.is_some(), "cost_sweep.json"),
        (resid.is_some(), "projector_residuals.json"),
        (curve.is_some(), "projector_curve.json"),
        (qos.is_some(), "serve_qos.json"),
        (recall.is_some(), "recall.json"),
        (summaries.is_some(), "recall_summaries.json"),
        (by_kind.is_some(), "recall_kinds.json"),
        (precision_doc.is_some(), "precision_rungs.json"),
        (stall_doc.is_some(), "switch_stall.json"),
        (bill_doc.is_some(), "switch_bill.json"),
        (reliability.is_some(), "reliability.json"),
        (speed_doc.is_some(), "speed.json"),
        (sampling_doc.is_some(), "sampling.json"),
        (concurrency.is_some(), "serve_concurrency.json"),
        (aside_doc.is_some(), "serve_aside.json"),
    ]
    .iter()
    .filter(|(present, _)| *present)
    .map(|(_, name)| format!(", `{name}`"))
    .collect();
    let _ = writeln!(
        s,
        "*Generated by `molt-run figures` from the JSON in this directory (`conditions.json`, `conditions_events.jsonl`, `token_series.json`{inputs}); no number on this page is typed by hand. Regenerate everything with `scripts/bench.sh` (or one program with `molt-run bench --conditions all`, `--cost-sweep`, … then `molt-run figures`).*\n"
    );
    let run = &r.run;
    let costs = r
        .rung_costs
        .iter()
        .map(|c| {
            format!(
                "{} {} MiB + {} KiB/token",
                c.name,
                c.resident_bytes() >> 20,
                c.kv_bytes_per_token >> 10
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let budgets = std::iter::once(format!("{} MiB", r.trace.initial_bytes >> 20))
        .chain(
            r.trace
                .steps
                .iter()
                .map(|st| format!("{} MiB at token {}", st.budget_bytes >> 20, st.at)),
        )
        .collect::<Vec<_>>()
        .join(" → ");
    let _ = writeln!(s, "## Setup\n");
    let _ = writeln!(
        s,
        "- Ladder `{}`: {} (footprints the trace and every session's policy use, each rung loaded alone with the longest prompt decoded and its resident-memory growth split into weights + the rest: {costs}).",
        r.ladder,
        r.rungs.join(", ")
    );
    let _ = writeln!(
        s,
        "- {} prompts ({} code, {} general), greedy decoding, {} tokens per answer, {} timing repetitions{}; n_ctx {}, {} threads, {} KV cache.",
        r.prompts.len(),
        r.prompts.iter().filter(|p| p.kind == "code").count(),
        r.prompts.iter().filter(|p| p.kind != "code").count(),
        r.settings.max_tokens,
        r.settings.reps,
        if r.settings.quality_pass {
            " plus one seam-measurement pass"
        } else {
            ""
        },
        r.settings.n_ctx,
        r.settings.threads,
        r.settings.cache_type
    );
    let _ = writeln!(
        s,
        "- Trace `{}`, the same for every arm: {budgets}. {}",
        r.trace.name, r.trace.description
    );
    let _ = writeln!(
        s,
        "- Machine: {} logical CPUs, 1-minute load average {} when the run started; the whole benchmark took {:.1} min.\n",
        run.get("cpus")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0),
        run.get("loadavg_1m")
            .and_then(serde_json::Value::as_f64)
            .map_or("?".into(), |v| format!("{v:.2}")),
        r.elapsed_s / 60.0
    );
    let _ = writeln!(s, "## The trade-off, stated plainly\n");
    s.push_str(&tradeoff(&r));
    if let Some(h) = fig("hero") {
        let _ = writeln!(
            s,
            "\n![token series]({}/{})\n\n*{}*\n",
            opts.figures_rel_results,
            file_name(&h.path),
            h.caption
        );
    }
    let _ = writeln!(s, "## Conditions\n");
    let _ = writeln!(
        s,
        "Timings are the median over repetitions of the per-repetition mean over prompts, with the repetitions' [min–max]; quality columns come from the seam-measurement pass (JSD, flatness) and from the judge ({}) scoring the first repetition's answer from its first switch (or from token {} when there is none). Footprint is the process's resident memory above its level before the session loaded, sampled after every token; overshoot is footprint − budget at those samples (after enforcement; negative = inside the budget).\n",
        r.settings.judge,
        r.settings.steps.first().copied().unwrap_or(0)
    );
    s.push_str(&table(&r));
    for name in ["conditions", "seams"] {
        if let Some(h) = fig(name) {
            let _ = writeln!(
                s,
                "\n![{name}]({}/{})\n\n*{}*",
                opts.figures_rel_results,
                file_name(&h.path),
                h.caption
            );
        }
    }
    let _ = writeln!(s, "\n## Ablations: does each mechanism pay for itself?\n");
    let _ = writeln!(
        s,
        "Each ablation changes D on one mechanism, on the route kind where it exists, and keeps D's maps elsewhere. Compared with D prompt by prompt (a prompt counts as worse or better when it differs by more than 1 %); for every metric here higher is worse. Rule: a mechanism pays for itself when removing it makes a quality metric worse on more than half of the prompts.\n"
    );
    s.push_str(&ablations(&r));
    let _ = writeln!(s, "\n## Timing differences against their noise\n");
    let _ = writeln!(
        s,
        "A difference is called *inside the noise* when the [min–max] ranges of the two arms' repetitions overlap.\n"
    );
    let _ = writeln!(
        s,
        "| metric | arm | vs | median | vs median | ratio | verdict |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for t in &r.timing {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {:.1} | {:.2}× | {} |",
            t.metric,
            t.a,
            t.b,
            t.a_median,
            t.b_median,
            t.noise.ratio,
            if r.settings.reps < 2 {
                "no noise estimate (one repetition)"
            } else if t.noise.inside_noise {
                "inside the noise"
            } else {
                "outside the noise"
            }
        );
    }
    if let Some(doc) = &sweep {
        let _ = writeln!(s, "\n## What a switch costs, by context length\n");
        let _ = writeln!(
            s,
            "Both rungs warm, so this isolates the KV work from weight loading (which both strategies pay). Medians over {} repetitions with [min–max]. {} {}\n",
            doc.reps,
            match doc.contexts.as_deref() {
                Some("chat") =>
                    "Each repetition carries another multi-turn conversation of the corpus's chats, rendered with the chat template as a session holds it.",
                _ => "Each repetition carries another window of the corpus's raw text.",
            },
            match (doc.head_reread, doc.token_recompute) {
                (h, Some(r)) => format!(
                    "The transplant is Molt's default switch, as every session makes it: the projection plus a head re-read of the first {h} positions (the destination's anchor supplies the template's opening, the rest is decoded), and on a size route the selective token recompute — {:.0}% of the positions, at least {}, chosen by the attention the history's last {} tokens gave them on the source, whole sentences, re-read natively on the destination (the *recompute* columns). The second table measures variants beside it without the token recompute: the projection with the same head re-read, and the projection alone (head 0).",
                    r.fraction * 100.0,
                    r.min_positions,
                    r.window
                ),
                (h, None) if h > 0 => format!(
                    "The transplant is the projection plus a head re-read of the first {h} positions (the destination's anchor supplies the template's opening, the rest is decoded), without the token recompute a session's switch adds on a size route; the projection alone is measured beside it (head 0) in the second table."
                ),
                _ => "The transplant is the projection alone (no head re-read).".to_string(),
            }
        );
        s.push_str(&sweep_section(doc));
        if let Some(h) = fig("cost_sweep") {
            let _ = writeln!(
                s,
                "\n![cost sweep]({}/{})\n\n*{}*",
                opts.figures_rel_results,
                file_name(&h.path),
                h.caption
            );
        }
    }
    if let Some(doc) = &recall {
        s.push_str(&recall::section(doc, figures, &opts.figures_rel_results));
    }
    if let Some(doc) = &summaries {
        s.push_str(&recall::summaries_section(doc));
    }
    if let Some(doc) = &by_kind {
        s.push_str(&recall::kinds_section(doc));
    }
    if let Some(doc) = &precision_doc {
        s.push_str(&precision::section(doc));
    }
    if let Some(doc) = &stall_doc {
        s.push_str(&stall::section(doc, figures, &opts.figures_rel_results));
    }
    if let Some(doc) = &bill_doc {
        s.push_str(&bill::section(doc));
    }
    if let Some(doc) = &resid {
        let _ = writeln!(s, "\n## How well the maps fit\n");
        let _ = writeln!(
            s,
            "Relative RMS on held-out windows, with the training residual beside it (a large gap means the map memorised its training windows).\n"
        );
        s.push_str(&residual_section(doc));
        if let Some(h) = fig("projector_residuals") {
            let _ = writeln!(
                s,
                "\n![projector residuals]({}/{})\n\n*{}*",
                opts.figures_rel_results,
                file_name(&h.path),
                h.caption
            );
        }
    }
    if let Some(doc) = &curve {
        s.push_str(&curve_section(doc));
    }
    if let Some(doc) = &qos {
        s.push_str(&qos::section(doc));
        if let Some(h) = fig("qos") {
            let _ = writeln!(
                s,
                "\n![qos]({}/{})\n\n*{}*",
                opts.figures_rel_results,
                file_name(&h.path),
                h.caption
            );
        }
    }
    if let Some(doc) = &speed_doc {
        s.push_str(&speed::section(doc));
    }
    if let Some(doc) = &sampling_doc {
        s.push_str(&super::sampling::section(doc));
    }
    if let Some(doc) = &concurrency {
        s.push_str(&concurrency::section(doc));
    }
    if let Some(doc) = &aside_doc {
        s.push_str(&aside::section(doc));
    }
    if let Some(doc) = &reliability {
        s.push_str(&reliability::section(doc));
    }
    let _ = writeln!(s, "\n## What this does not show\n");
    let cells = r.cells.len();
    let identical = r
        .cells
        .iter()
        .filter(|c| c.tokens_identical_across_reps)
        .count();
    let q_total = r.cells.iter().filter(|c| c.quality.is_some()).count();
    let q_match = r
        .cells
        .iter()
        .filter(|c| c.quality.as_ref().is_some_and(|q| q.tokens_match_timing))
        .count();
    let _ = writeln!(
        s,
        "- One machine with {} CPUs shared with other work; the spread is over {} repetitions only, so a difference inside it is not a difference. Greedy decoding produced identical tokens in every repetition for {identical} of {cells} arm×prompt cells; the seam-measurement pass matched the first repetition's tokens in {q_match} of {q_total}.",
        run.get("cpus")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0),
        r.settings.reps
    );
    let _ = writeln!(
        s,
        "- {} prompts of {} tokens each is a small sample; the quality columns are means over it, and the per-prompt values are in `conditions.json`.",
        r.prompts.len(),
        r.settings.max_tokens
    );
    let _ = writeln!(
        s,
        "- The budget is a replayed trace keyed to token indices, not a real memory-pressure event; the footprint is measured (RSS), the budget is not. Max overshoot is sampled after each token, i.e. after enforcement: during a switch both rungs are mapped for the load and switch time, and the column *drop overshoot* in the JSON (largest: {} MiB for D) records footprint − budget at the instant the budget fell, before the switch.",
        mib_i(find(&r, "D").and_then(|d| d.drop_overshoot_bytes))
    );
    let _ = writeln!(
        s,
        "- The judge ({}) is also the rung that wrote every answer's first {} tokens, so it favours continuations that sound like itself; perplexity is read beside the repeated-4-gram fraction because low perplexity alone rewards loops.",
        r.settings.judge,
        r.settings.steps.first().copied().unwrap_or(0)
    );
    let _ = writeln!(
        s,
        "- Attention flatness is measured at one decode per switch (the first on the destination), averaged over layers and heads; it says whether the migrated cache is attended to more diffusely, not whether the right positions are attended to."
    );
    let _ = writeln!(
        s,
        "- Selective top-k layer recompute (arms D-topk2/4/6) is an option, off by default: its rows appear only when those arms were run, with the recompute's time inside the switch cost; step-to-step JSD and single-needle recall are not reported (the design rejects them as saturated / uninformative)."
    );
    let _ = writeln!(
        s,
        "- Switch cost excludes mapping the destination's weights (reported as load ms, paid by every strategy); max stall includes it, and the *excl. load* column takes it out."
    );
    if let Some(doc) = &recall {
        s.push_str(&recall::caveat(doc));
    }
    let out = dir.join("README.md");
    std::fs::write(&out, s).map_err(|source| BenchError::Io {
        path: out.clone(),
        source,
    })?;
    let snippet = dir.join("figures.md");
    std::fs::write(&snippet, snippet_text(&r, figures, &opts.figures_rel_root)).map_err(
        |source| BenchError::Io {
            path: snippet.clone(),
            source,
        },
    )?;
    Ok(vec![out, snippet])
}

fn snippet_text(r: &ConditionsReport, figures: &FigureSet, rel: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<!-- generated by `molt-run figures` from the JSON under results/ -->\n"
    );
    for fig in &figures.written {
        let _ = writeln!(
            s,
            "![{}]({rel}/{})\n\n*{}*\n",
            fig.name,
            file_name(&fig.path),
            fig.caption
        );
    }
    if let (Some(c), Some(d)) = (find(r, "C"), find(r, "D")) {
        let _ = writeln!(
            s,
            "Under the replayed trace, Molt's switch cost {} ms per answer against {} ms for a re-prefill; the full table, the ablations and what the numbers do not show are in [results/README.md](results/README.md).",
            f(d.switch_cost_ms.as_ref().map(|r| r.median), 1),
            f(c.switch_cost_ms.as_ref().map(|r| r.median), 1)
        );
    }
    s
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn optional<T: for<'de> serde::Deserialize<'de>>(p: &Path) -> Result<Option<T>, BenchError> {
    if p.exists() {
        read_json(p).map(Some)
    } else {
        Ok(None)
    }
}

#[cfg(test)]
mod tests;
