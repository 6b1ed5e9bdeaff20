//! The cost sweep: Molt's transplant against a re-prefill at several context lengths, both
//! rungs warm, every route, measured side by side in one run (alternating, so the machine's
//! drift hits both), with the handoff divergence of each beside its cost.
//!
//! For each route and length `n`, `reps` times, each time on its own window of `n` corpus
//! tokens (spread over the corpus): the source reads the window; then, alternating, (a)
//! [`transplant`] its cache into the destination and decode the next token there (and the same
//! with each requested tail recompute), (b) [`reprefill`] the same `n` tokens plus the next one
//! on the destination. All end at the destination's first logits; all are compared (JSD) with
//! the source's own next-token distribution, at the switch step and over the next [`SEAM`]
//! teacher-forced steps, averaged over the windows. The re-prefill's divergence is the floor:
//! it is what the destination says with a perfect cache of its own.

use serde::Serialize;

use super::speed::Rate;
use crate::engine::{ContextConfig, Token};
use crate::ladder::Ladder;
use crate::session::migrate::{Reread, prefill_flops, reprefill, transplant, transplant_with};
use crate::session::routes::{RouteKind, Routes, binding, route_kind};
use crate::session::{LiveRung, SessionError, jsd};

/// One route at one length.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    /// `src→dst`.
    pub route: String,
    /// Precision or size.
    pub kind: RouteKind,
    /// Context tokens carried.
    pub context_tokens: usize,
    /// Transplant cost (decision to first logits), ms.
    pub transplant_ms: Rate,
    /// Its parts (medians), ms: export, project, import, first decode.
    pub transplant_parts_ms: [f64; 4],
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
    /// The transplant with tail recompute (the last `tail` tokens re-read natively on the
    /// destination), one entry per requested tail length.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tails: Vec<TailPoint>,
}

/// The transplant with tail recompute at one sweep point.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TailPoint {
    /// Tokens re-read natively.
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
    dst: &mut crate::engine::Context,
    reference: &[Vec<f32>],
    next: &[Token],
) -> Result<(f64, f64), crate::engine::EngineError> {
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
    /// Tail recompute lengths measured beside the plain transplant (empty: none).
    pub tails: Vec<usize>,
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
    corpus: &[Token],
    opts: &SweepOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<SweepPoint>, SessionError> {
    let max_len = opts.lengths.iter().copied().max().unwrap_or(0);
    if corpus.len() < max_len + 1 + SEAM {
        return Err(SessionError::PromptTooLong {
            prompt_tokens: corpus.len(),
            n_ctx: config.n_ctx,
            reserve: max_len + 1 + SEAM - corpus.len(),
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
            let kind = route_kind(&binding(&ladder.rungs[si]), &binding(&ladder.rungs[di]));
            let route = format!("{}→{}", ladder.rungs[si].name(), ladder.rungs[di].name());
            for &n in &opts.lengths {
                progress(&format!("{route} at {n} tokens"));
                let (src, dst) = pair(&mut rungs, si, di);
                let (mut t_ms, mut r_ms) = (Vec::new(), Vec::new());
                let mut parts = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
                let (mut t_seam, mut r_seam, mut t_flops) = ((0.0, 0.0), (0.0, 0.0), 0.0);
                let tails: Vec<usize> = opts.tails.iter().copied().filter(|&w| w <= n).collect();
                let mut tail_ms = vec![Vec::new(); tails.len()];
                let mut tail_seam = vec![(0.0, 0.0); tails.len()];
                let reps = opts.reps.max(1);
                for rep in 0..reps {
                    // Each repetition reads its own window of the corpus, so the seam is a
                    // mean over `reps` contexts rather than one (a single window can be
                    // near-certain for every model); the timings compare like with like, as
                    // every window is `n` tokens long.
                    let start = window_start(corpus.len(), n + 1 + SEAM, rep, reps);
                    let history = &corpus[start..start + n];
                    let last = corpus[start + n];
                    let follow = &corpus[start + n..start + n + 1 + SEAM];
                    src.ctx.clear();
                    src.ctx.decode(history).map_err(engine(src.name()))?;
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
                    for (k, &w) in tails.iter().enumerate() {
                        let t = transplant_with(
                            &src.ctx,
                            &mut dst.ctx,
                            &projector,
                            None,
                            Reread {
                                head: &[],
                                tail: &history[n - w..],
                            },
                            last,
                        )?;
                        let v = seam(&mut dst.ctx, &reference, &follow[1..])
                            .map_err(engine(dst.name()))?;
                        add(&mut tail_seam[k], v);
                        tail_ms[k].push(t.cost_ms);
                    }
                    let t = transplant(&src.ctx, &mut dst.ctx, &projector, last)?;
                    let v =
                        seam(&mut dst.ctx, &reference, &follow[1..]).map_err(engine(dst.name()))?;
                    add(&mut t_seam, v);
                    t_flops = t.flops;
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
                let m = dst.model();
                let (p, l, e) = (m.n_params(), m.n_layer() as u64, m.n_embd() as u64);
                let reprefill_flops = prefill_flops(p, l, e, n as u64 + 1);
                let transplant_flops = t_flops + prefill_flops(p, l, e, 1);
                let (tm, rm) = (Rate::from(t_ms), Rate::from(r_ms));
                let speedup = if tm.median > 0.0 {
                    rm.median / tm.median
                } else {
                    0.0
                };
                progress(&format!(
                    "  transplant {:.1} ms, re-prefill {:.1} ms ({speedup:.1}x); seam JSD {:.4} vs floor {:.4} (mean over {} steps {:.4} vs {:.4})",
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
                    .map(|((&tail, v), &(jsd, jsd_mean))| {
                        let cost_ms = Rate::from(v);
                        progress(&format!(
                            "  tail {tail}: {:.1} ms ({:.1}x); seam JSD {jsd:.4}, mean {jsd_mean:.4}",
                            cost_ms.median,
                            rm.median / cost_ms.median
                        ));
                        TailPoint {
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
                    transplant_parts_ms: [
                        med(&parts[0]),
                        med(&parts[1]),
                        med(&parts[2]),
                        med(&parts[3]),
                    ],
                    transplant_ms: tm,
                    reprefill_ms: rm,
                    speedup,
                    transplant_flops,
                    reprefill_flops,
                    flops_avoided: 1.0 - transplant_flops / reprefill_flops,
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

/// Where repetition `rep` of `reps` starts its window of `len` tokens: spread evenly over the
/// corpus, the first at its start, the last at its end.
fn window_start(corpus_len: usize, len: usize, rep: usize, reps: usize) -> usize {
    let room = corpus_len.saturating_sub(len);
    if reps <= 1 {
        0
    } else {
        room * rep / (reps - 1)
    }
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
