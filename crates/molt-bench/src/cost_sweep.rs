//! The cost sweep: Molt's transplant against a re-prefill at several context lengths, both
//! rungs warm, every route, measured side by side in one run (alternating, so the machine's
//! drift hits both), with the handoff divergence of each beside its cost.
//!
//! For each route and length `n`, `reps` times, each time on its own context (the first `n`
//! tokens of one of the given token streams — by default multi-turn conversations rendered
//! with the chat template, as a session holds them, see [`chat_contexts`]): the source reads
//! them (its attention tap observing what their last tokens attend to, as a session's does
//! when it reads a prompt); then, alternating, (a) Molt's default switch — [`transplant_with`]
//! its cache into the destination with the default head re-read (the destination's anchor
//! spliced where it covers the head) and, on a size route, the default selective token
//! recompute (the positions the source attended to, whole sentences, re-read natively on the
//! destination), then decode the next token there — and the same with each requested
//! variant (other head re-reads, tail recompute; the projection without recompute), (b)
//! [`reprefill`] the same `n` tokens plus the next one on the destination. All end at the
//! destination's first logits; all are compared (JSD) with the source's own next-token
//! distribution, at the switch step and over the next [`SEAM`] teacher-forced steps, averaged
//! over the contexts. The re-prefill's divergence is the floor: it is what the destination
//! says with a perfect cache of its own.

use serde::{Deserialize, Serialize};

use super::speed::Rate;
use molt::engine::{ContextConfig, Span, Token};
use molt::ladder::Ladder;
use molt::routes::{RouteKind, Routes, binding, route_kind};
use molt::session::migrate::{Reread, prefill_flops, reprefill, switch_flops, transplant_with};
use molt::session::{LiveRung, SessionError, SessionOptions, jsd, recompute_ranges};
use molt::transplant::select::TokenRecompute;

/// One route at one length.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepPoint {
    /// `src→dst`.
    pub route: String,
    /// Precision or size.
    pub kind: RouteKind,
    /// Context tokens carried.
    pub context_tokens: usize,
    /// Head re-read of the transplant (the history's first positions given the destination's
    /// own K/V), and how many of them the destination's anchor supplied (the rest decoded).
    #[serde(default)]
    pub head: usize,
    /// Of `head`, positions from the anchor.
    #[serde(default)]
    pub head_anchored: usize,
    /// Transplant cost (decision to first logits), ms.
    pub transplant_ms: Rate,
    /// Its parts (medians), ms: export, project, import, first decode.
    pub transplant_parts_ms: [f64; 4],
    /// Of its cost, the selective token recompute (median, ms; 0 on a precision route, or
    /// without recompute).
    #[serde(default)]
    pub recompute_ms: f64,
    /// Positions it re-read by selective token recompute (median).
    #[serde(default)]
    pub recomputed: usize,
    /// Re-prefill cost, ms.
    pub reprefill_ms: Rate,
    /// Median re-prefill / median transplant.
    pub speedup: f64,
    /// FLOPs of the transplant (projection + one decode).
    pub transplant_flops: f64,
    /// FLOPs of the re-prefill.
    pub reprefill_flops: f64,
    /// 1 − transplant / re-prefill FLOPs.
    pub flops_avoided: f64,
    /// Handoff JSD (nats) of the transplant against the source's next-token distribution
    /// (mean over the repetitions' windows, as are all the JSDs here).
    pub transplant_jsd: f64,
    /// Handoff JSD of the re-prefill (the floor).
    pub reprefill_jsd: f64,
    /// transplant_jsd / reprefill_jsd.
    pub seam_ratio: f64,
    /// Mean JSD of the transplant over the switch step and the next [`SEAM`] steps
    /// (teacher-forced on the corpus): one step can be near-certain for both models, so the
    /// mean is the steadier seam measure.
    pub transplant_jsd_mean: f64,
    /// The same for the re-prefill (the floor).
    pub reprefill_jsd_mean: f64,
    /// transplant_jsd_mean / reprefill_jsd_mean.
    pub seam_mean_ratio: f64,
    /// The transplant with part of the history re-read natively on the destination: tail
    /// recompute (its last `tail` tokens) or head re-read (its first `head` tokens), one
    /// entry per requested length.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tails: Vec<TailPoint>,
}

/// `results/cost_sweep.json`: the sweep's points with the run's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepDoc {
    /// Machine and versions ([`super::RunInfo`]).
    #[serde(default)]
    pub run: serde_json::Value,
    /// Threads per context.
    #[serde(default)]
    pub threads: u32,
    /// Repetitions per method.
    #[serde(default)]
    pub reps: usize,
    /// Context lengths.
    #[serde(default)]
    pub lengths: Vec<usize>,
    /// Where the contexts came from: `chat` (conversations in the chat form a session
    /// holds) or `raw` (windows of the corpus text); absent in older files: raw windows.
    #[serde(default)]
    pub contexts: Option<String>,
    /// Head re-read of the measured switch (absent in older files: none).
    #[serde(default)]
    pub head_reread: usize,
    /// Selective token recompute of the measured switch on size routes (absent in older
    /// files, and `None`: none).
    #[serde(default)]
    pub token_recompute: Option<TokenRecompute>,
    /// One per route and length.
    pub points: Vec<SweepPoint>,
}

/// The transplant with a native re-read (tail recompute or head re-read) at one sweep point.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TailPoint {
    /// The history's first tokens re-read natively (head re-read; 0 for none).
    #[serde(default)]
    pub head: usize,
    /// The history's last tokens re-read natively (tail recompute; 0 for none).
    pub tail: usize,
    /// Cost, decision to first logits, ms.
    pub cost_ms: Rate,
    /// Median re-prefill / median cost.
    pub speedup: f64,
    /// Handoff JSD at the switch step.
    pub jsd: f64,
    /// Mean JSD over the switch step and the next [`SEAM`] steps.
    pub jsd_mean: f64,
    /// jsd_mean / the re-prefill's (the floor's); `None` when the floor is 0.
    pub seam_mean_ratio: Option<f64>,
}

/// Steps after the switch over which the seam is averaged.
pub const SEAM: usize = 8;

/// `(JSD at the switch step, mean JSD over it and the next steps)` of `dst` against the
/// source's `reference` rows; `dst` has just produced its first logits after the switch and
/// is then fed `next` (teacher forcing).
fn seam(
    dst: &mut molt::engine::Context,
    reference: &[Vec<f32>],
    next: &[Token],
) -> Result<(f64, f64), molt::engine::EngineError> {
    let first = jsd(&reference[0], dst.logits());
    let rows = dst.decode_all_logits(next)?;
    let mut sum = first;
    for (r, d) in reference[1..].iter().zip(&rows) {
        sum += jsd(r, d);
    }
    #[allow(clippy::cast_precision_loss)]
    let mean = sum / (rows.len() + 1) as f64;
    Ok((first, mean))
}

/// Options.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// Context lengths.
    pub lengths: Vec<usize>,
    /// Repetitions per method.
    pub reps: usize,
    /// The head re-read of the measured switch (a session's default:
    /// [`molt::session::DEFAULT_HEAD_REREAD`]; 0 for the projection alone).
    pub head: usize,
    /// Selective token recompute of the measured switch on size routes (a session's default:
    /// [`TokenRecompute::default_size`]; `None`: none). With it, the plain projection with
    /// the same head re-read is measured beside it (a head re-read variant).
    pub recompute: Option<TokenRecompute>,
    /// Tail recompute lengths measured beside it (with the same head re-read; empty: none).
    pub tails: Vec<usize>,
    /// Other head re-read lengths measured beside it (empty: none).
    pub heads: Vec<usize>,
    /// Only the routes `src→dst` named here (empty: every ordered pair of rungs).
    pub routes: Vec<(String, String)>,
}

fn med(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// Runs the sweep over every ordered pair of rungs.
///
/// # Errors
/// Load, decode, route or migration errors.
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    routes: &mut Routes,
    contexts: &[Vec<Token>],
    opts: &SweepOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<SweepPoint>, SessionError> {
    let max_len = opts.lengths.iter().copied().max().unwrap_or(0);
    let shortest = contexts.iter().map(Vec::len).min().unwrap_or(0);
    if shortest < max_len + 1 + SEAM {
        return Err(SessionError::PromptTooLong {
            prompt_tokens: shortest,
            n_ctx: config.n_ctx,
            reserve: max_len + 1 + SEAM - shortest,
        });
    }
    let mut rungs: Vec<LiveRung> = ladder
        .rungs
        .iter()
        .map(|r| LiveRung::load(r, config))
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    let engine = |rung: &str| {
        let rung = rung.to_string();
        move |source| SessionError::Engine { rung, source }
    };
    for si in 0..rungs.len() {
        for di in 0..rungs.len() {
            if si == di {
                continue;
            }
            let projector = routes.get(si, di)?;
            let anchor = if opts.head > 0 || opts.heads.iter().any(|&h| h > 0) {
                routes.anchor(di)?
            } else {
                None
            };
            let kind = route_kind(&binding(&ladder.rungs[si]), &binding(&ladder.rungs[di]));
            let (sn, dn) = (ladder.rungs[si].name(), ladder.rungs[di].name());
            if !opts.routes.is_empty() && !opts.routes.iter().any(|(a, b)| a == sn && b == dn) {
                continue;
            }
            let route = format!("{sn}→{dn}");
            for &n in &opts.lengths {
                progress(&format!("{route} at {n} tokens"));
                let (src, dst) = pair(&mut rungs, si, di);
                let (mut t_ms, mut r_ms) = (Vec::new(), Vec::new());
                let mut parts = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
                let (mut t_seam, mut r_seam, mut t_flops) = ((0.0, 0.0), (0.0, 0.0), 0.0);
                let mut anchored = 0;
                let head = opts.head.min(n);
                // (head, tail) of each re-read variant measured beside the plain transplant.
                // On a size route the measured switch recomputes tokens; the projection with the
                // same head re-read and no recompute is measured beside it.
                let recompute = opts.recompute.filter(|_| kind == RouteKind::Size);
                let mut tails: Vec<(usize, usize)> = opts
                    .tails
                    .iter()
                    .filter(|&&w| w + head <= n)
                    .map(|&w| (head, w))
                    .chain(opts.heads.iter().filter(|&&h| h <= n).map(|&h| (h, 0)))
                    .collect();
                if recompute.is_some() && !tails.contains(&(head, 0)) {
                    tails.push((head, 0));
                }
                let session_opts = SessionOptions {
                    head_reread: head,
                    token_recompute: recompute,
                    research: molt::session::Research {
                        tail_recompute: 0,
                        ..molt::session::Research::default()
                    },
                    ..SessionOptions::default()
                };
                let (mut rc_ms, mut rc_n) = (Vec::new(), Vec::new());
                let mut tail_ms = vec![Vec::new(); tails.len()];
                let mut tail_seam = vec![(0.0, 0.0); tails.len()];
                let reps = opts.reps.max(1);
                let (p, l, e) = {
                    let m = dst.model();
                    (m.n_params(), m.n_layer() as u64, m.n_embd() as u64)
                };
                for rep in 0..reps {
                    // Each repetition reads its own context, so the seam is a mean over `reps`
                    // contexts rather than one (a single one can be near-certain for every
                    // model); the timings compare like with like, as every history is `n`
                    // tokens long.
                    let context = &contexts[rep % contexts.len()];
                    let history = &context[..n];
                    let last = context[n];
                    let follow = &context[n..n + 1 + SEAM];
                    src.ctx.clear();
                    // What the history's last tokens attend to, as a session observes its
                    // prompt's (the recompute's selection reads it).
                    let observed = match recompute {
                        Some(r) => src
                            .ctx
                            .decode_observed(history, r.window)
                            .map_err(engine(src.name()))?,
                        None => {
                            src.ctx.decode(history).map_err(engine(src.name()))?;
                            None
                        }
                    };
                    // The source's own distributions at the switch step and the next `SEAM`
                    // steps (teacher-forced on the corpus), then rewind it.
                    let reference = src
                        .ctx
                        .decode_all_logits(follow)
                        .map_err(engine(src.name()))?;
                    src.ctx.truncate(n);
                    let add = |acc: &mut (f64, f64), v: (f64, f64)| {
                        acc.0 += v.0 / reps as f64;
                        acc.1 += v.1 / reps as f64;
                    };
                    // The history's first `h` and last `w` tokens re-read natively.
                    let reread = |h: usize, w: usize| Reread {
                        head: &history[..h],
                        tail: &history[n - w..],
                        anchor: anchor.as_deref(),
                        spans: &[],
                    };
                    for (k, &(h, w)) in tails.iter().enumerate() {
                        let t = transplant_with(
                            &src.ctx,
                            &mut dst.ctx,
                            &projector,
                            None,
                            reread(h, w),
                            last,
                        )?;
                        let v = seam(&mut dst.ctx, &reference, &follow[1..])
                            .map_err(engine(dst.name()))?;
                        add(&mut tail_seam[k], v);
                        tail_ms[k].push(t.cost_ms);
                    }
                    // The default switch: its recompute positions chosen as a session's
                    // switch chooses them (the selection is part of its cost).
                    let t_select = std::time::Instant::now();
                    let ranges = recompute_ranges(
                        &session_opts,
                        kind,
                        history,
                        observed.as_deref(),
                        Some(src.ctx.model().as_ref()),
                        n,
                    );
                    let spans = Span::of(history, &ranges);
                    let select_ms = t_select.elapsed().as_secs_f64() * 1e3;
                    let t = transplant_with(
                        &src.ctx,
                        &mut dst.ctx,
                        &projector,
                        None,
                        Reread {
                            spans: &spans,
                            ..reread(head, 0)
                        },
                        last,
                    )?;
                    rc_ms.push(if t.recomputed > 0 {
                        select_ms + t.spans_ms
                    } else {
                        0.0
                    });
                    rc_n.push(t.recomputed as f64);
                    let t = molt::session::migrate::SwitchTimings {
                        cost_ms: t.cost_ms + select_ms,
                        ..t
                    };
                    anchored = t.head_anchored;
                    let v =
                        seam(&mut dst.ctx, &reference, &follow[1..]).map_err(engine(dst.name()))?;
                    add(&mut t_seam, v);
                    t_flops = switch_flops(&t, p, l, e, n as u64);
                    t_ms.push(t.cost_ms);
                    for (p, v) in parts.iter_mut().zip([
                        t.export_ms,
                        t.project_ms,
                        t.import_ms,
                        t.first_decode_ms,
                    ]) {
                        p.push(v);
                    }
                    let r = reprefill(&src.ctx, &mut dst.ctx, history, last)?;
                    let v =
                        seam(&mut dst.ctx, &reference, &follow[1..]).map_err(engine(dst.name()))?;
                    add(&mut r_seam, v);
                    r_ms.push(r.cost_ms);
                }
                let (t_jsd, r_jsd) = (t_seam.0, r_seam.0);
                let reprefill_flops = prefill_flops(p, l, e, n as u64 + 1);
                let (tm, rm) = (Rate::from(t_ms), Rate::from(r_ms));
                let speedup = if tm.median > 0.0 {
                    rm.median / tm.median
                } else {
                    0.0
                };
                progress(&format!(
                    "  transplant (head {head}, {anchored} from the anchor{}) {:.1} ms, re-prefill {:.1} ms ({speedup:.1}x); seam JSD {:.4} vs floor {:.4} (mean over {} steps {:.4} vs {:.4})",
                    if recompute.is_some() {
                        format!(
                            ", {} positions recomputed in {:.1} ms",
                            med(&rc_n),
                            med(&rc_ms)
                        )
                    } else {
                        String::new()
                    },
                    tm.median,
                    rm.median,
                    t_jsd,
                    r_jsd,
                    SEAM + 1,
                    t_seam.1,
                    r_seam.1
                ));
                let tails = tails
                    .iter()
                    .zip(tail_ms)
                    .zip(&tail_seam)
                    .map(|((&(head, tail), v), &(jsd, jsd_mean))| {
                        let cost_ms = Rate::from(v);
                        let what = if tail > 0 {
                            format!("head {head} + tail {tail}")
                        } else {
                            format!("head {head}")
                        };
                        progress(&format!(
                            "  {what}: {:.1} ms ({:.1}x); seam JSD {jsd:.4}, mean {jsd_mean:.4} (ratio {:.2})",
                            cost_ms.median,
                            rm.median / cost_ms.median,
                            jsd_mean / r_seam.1
                        ));
                        TailPoint {
                            head,
                            tail,
                            speedup: if cost_ms.median > 0.0 {
                                rm.median / cost_ms.median
                            } else {
                                0.0
                            },
                            cost_ms,
                            jsd,
                            jsd_mean,
                            seam_mean_ratio: (r_seam.1 > 0.0).then(|| jsd_mean / r_seam.1),
                        }
                    })
                    .collect();
                out.push(SweepPoint {
                    route: route.clone(),
                    kind,
                    context_tokens: n,
                    head,
                    head_anchored: anchored,
                    transplant_parts_ms: [
                        med(&parts[0]),
                        med(&parts[1]),
                        med(&parts[2]),
                        med(&parts[3]),
                    ],
                    recompute_ms: med(&rc_ms),
                    recomputed: med(&rc_n) as usize,
                    transplant_ms: tm,
                    reprefill_ms: rm,
                    speedup,
                    transplant_flops: t_flops,
                    reprefill_flops,
                    flops_avoided: 1.0 - t_flops / reprefill_flops,
                    transplant_jsd: t_jsd,
                    reprefill_jsd: r_jsd,
                    seam_ratio: if r_jsd > 0.0 { t_jsd / r_jsd } else { f64::NAN },
                    transplant_jsd_mean: t_seam.1,
                    reprefill_jsd_mean: r_seam.1,
                    seam_mean_ratio: if r_seam.1 > 0.0 {
                        t_seam.1 / r_seam.1
                    } else {
                        f64::NAN
                    },
                    tails,
                });
            }
        }
    }
    Ok(out)
}

/// Where window `rep` of `reps` of `len` tokens starts: spread evenly over the corpus, the
/// first at its start, the last at its end.
fn window_start(corpus_len: usize, len: usize, rep: usize, reps: usize) -> usize {
    let room = corpus_len.saturating_sub(len);
    if reps <= 1 {
        0
    } else {
        room * rep / (reps - 1)
    }
}

/// `count` windows of `len` tokens of a raw token stream, spread evenly over it (the sweep's
/// contexts without the chat form: they open mid-text, so no anchor covers their head).
#[must_use]
pub fn raw_contexts(corpus: &[Token], len: usize, count: usize) -> Vec<Vec<Token>> {
    (0..count.max(1))
        .map(|r| {
            let s = window_start(corpus.len(), len, r, count);
            corpus[s..(s + len).min(corpus.len())].to_vec()
        })
        .collect()
}

/// `count` conversations of at least `len` tokens, as a session holds them: the chats taken
/// in turn as user/assistant exchanges, rendered with `model`'s chat template and tokenized,
/// conversation `r` starting at chat `r · chats / count` (so each opens with another user
/// message) and adding chats, wrapping around, until it is long enough.
///
/// # Errors
/// [`molt::engine::EngineError`] if the template cannot be rendered or the text tokenized;
/// [`molt::engine::EngineError::ChatTemplate`] when there are no chats or all of them
/// together are shorter than `len`.
pub fn chat_contexts(
    model: &molt::engine::Model,
    chats: &[molt::train::ChatSample],
    len: usize,
    count: usize,
) -> Result<Vec<Vec<Token>>, molt::engine::EngineError> {
    use molt::engine::ChatMessage;
    let mut out = Vec::new();
    for r in 0..count.max(1) {
        let first = r * chats.len() / count.max(1);
        let mut conv = Vec::new();
        let mut tokens = Vec::new();
        for k in 0..chats.len() {
            let c = &chats[(first + k) % chats.len()];
            conv.push(ChatMessage::new("user", &c.prompt));
            conv.push(ChatMessage::new("assistant", &c.answer));
            let text = model.apply_chat_template(&conv, false)?;
            tokens = model.tokenize(&text, true)?;
            if tokens.len() >= len {
                break;
            }
        }
        if tokens.len() < len {
            return Err(molt::engine::EngineError::ChatTemplate(format!(
                "{} chats render to {} tokens; the sweep needs conversations of {len}",
                chats.len(),
                tokens.len()
            )));
        }
        out.push(tokens);
    }
    Ok(out)
}

fn pair(v: &mut [LiveRung], a: usize, b: usize) -> (&mut LiveRung, &mut LiveRung) {
    assert!(a != b, "a route needs two rungs");
    if a < b {
        let (x, y) = v.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = v.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}
