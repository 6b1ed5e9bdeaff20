//! The learning curve of one route's maps: held-out K and V residuals against the number of
//! training tokens, measured by fitting the same route on growing training sets while the
//! held-out windows stay fixed — so the points differ only in how much the fit saw, and a
//! plateau (or its absence) can be read off directly instead of extrapolated.
//!
//! The held-out windows are the ones `train-projectors` holds out of the base corpus (every
//! `held_out_every`-th). The training order is the base corpus's other windows, then the extra
//! corpus's windows, each shuffled by a fixed seed so a prefix mixes the corpus's files rather
//! than taking the first file alone. Each point fits on the shortest prefix reaching its token
//! count; one point always uses exactly the base corpus's training windows, which reproduces
//! the shipped fit. Activations are collected only for the windows a point needs, smallest
//! point first, so a run cut short still has its first points.
//!
//! Main items: [`fit_curve`], [`CurveOptions`], [`CurveReport`] / [`CurvePoint`].

use std::ops::Range;
use std::time::Instant;

use ndarray::{Axis, concatenate};
use serde::{Deserialize, Serialize};

use super::{TrainError, collect, fit_options};
use crate::engine::{ContextConfig, Token};
use crate::ladder::RungInfo;
use crate::routes::{Variant, binding, route_kind};
use crate::transplant::fit::{LayerActivations, RouteSamples, fit_route};

/// Options for [`fit_curve`].
#[derive(Debug, Clone)]
pub struct CurveOptions {
    /// Every n-th window of the base corpus is held out (the same windows for every point).
    pub held_out_every: usize,
    /// Rows of each window's first `skip_head` positions are left out of fit and residuals
    /// (as in [`super::TrainOptions::skip_head`]).
    pub skip_head: usize,
    /// Widen the fitted maps' heads to the destination's spread, as the shipped maps are.
    pub restore_spread: bool,
    /// Training-set sizes to measure, in tokens (the base corpus's own training size is
    /// always added).
    pub train_tokens: Vec<usize>,
    /// Seed of the shuffle that orders the training windows.
    pub seed: u64,
}

/// The windows a curve is fitted on, each decoded from position 0.
#[derive(Debug, Clone, Default)]
pub struct CurveCorpus<'a> {
    /// The base corpus: its held-out windows are the curve's fixed held-out set, its other
    /// windows come first in the training order.
    pub base: Vec<&'a [Token]>,
    /// Extra training windows, used after the base corpus's.
    pub extra: Vec<&'a [Token]>,
}

/// Median over layers of the λ the held-out search chose.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LambdaMedians {
    /// For K.
    pub k: Option<f64>,
    /// For V.
    pub v: Option<f64>,
}

/// One point of the curve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Tokens in the training windows (first positions of each window included, as the
    /// corpus size of `train-projectors` counts them).
    pub train_tokens: usize,
    /// Of which from the extra corpus.
    pub extra_tokens: usize,
    /// Training windows.
    pub train_windows: usize,
    /// Training rows the fit used (after the skipped head of each window).
    pub train_rows: usize,
    /// K held-out relative RMS, pooled over layers.
    pub k_held_out: f64,
    /// V held-out relative RMS.
    pub v_held_out: f64,
    /// K training relative RMS.
    pub k_train: f64,
    /// V training relative RMS.
    pub v_train: f64,
    /// The chosen λ (median over destination layers).
    pub lambda: LambdaMedians,
    /// Wall time of this point's fit, ms.
    pub fit_ms: f64,
}

/// The whole curve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurveReport {
    /// `src→dst`.
    pub route: String,
    /// Tokens per window.
    pub window: usize,
    /// Every n-th base window held out.
    pub held_out_every: usize,
    /// Tokens in the held-out windows (the same for every point).
    pub held_out_tokens: usize,
    /// Held-out rows the residuals are measured on.
    pub held_out_rows: usize,
    /// Training tokens the base corpus offers (the shipped fit's training set).
    pub base_train_tokens: usize,
    /// Tokens the extra corpus offers.
    pub extra_available_tokens: usize,
    /// Activation collection time per rung so far, ms.
    pub collect_ms: Vec<(String, f64)>,
    /// One per measured size, ascending.
    pub points: Vec<CurvePoint>,
    /// Sizes asked for that the corpora cannot reach.
    pub skipped_sizes: Vec<usize>,
}

/// The training windows in fit order: `base` then `extra`, each shuffled by `seed`.
fn train_order<'a>(base: &[&'a [Token]], extra: &[&'a [Token]], seed: u64) -> Vec<&'a [Token]> {
    let mut order = shuffled(base, seed);
    order.extend(shuffled(extra, seed.wrapping_add(1)));
    order
}

/// A Fisher–Yates shuffle driven by a 64-bit LCG: deterministic across platforms and runs
/// without a random-number crate.
fn shuffled<T: Copy>(items: &[T], seed: u64) -> Vec<T> {
    let mut out = items.to_vec();
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    for i in (1..out.len()).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = usize::try_from((state >> 33) % (i as u64 + 1)).unwrap_or(0);
        out.swap(i, j);
    }
    out
}

/// For each size (ascending, deduplicated), the shortest prefix of `lens` whose sum reaches it;
/// sizes beyond the total are returned apart.
fn prefixes(lens: &[usize], sizes: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let mut sizes = sizes.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let total: usize = lens.iter().sum();
    let (reachable, skipped): (Vec<usize>, Vec<usize>) =
        sizes.into_iter().partition(|&s| s <= total);
    let mut out = Vec::new();
    for s in reachable {
        let mut sum = 0;
        let n = lens
            .iter()
            .position(|&l| {
                sum += l;
                sum >= s
            })
            .map_or(lens.len(), |i| i + 1);
        if out.last() != Some(&n) {
            out.push(n);
        }
    }
    (out, skipped)
}

/// Row ranges of consecutive windows of `lens` starting at row `start`, each without its
/// first `skip_head` rows.
fn window_ranges(lens: &[usize], start: usize, skip_head: usize) -> Vec<Range<usize>> {
    let mut at = start;
    lens.iter()
        .map(|&l| {
            let r = (at + skip_head.min(l))..(at + l);
            at += l;
            r
        })
        .collect()
}

/// Appends `more` to `layers` row-wise.
fn append(
    layers: &mut Vec<LayerActivations>,
    more: Vec<LayerActivations>,
    rung: &str,
) -> Result<(), TrainError> {
    if layers.is_empty() {
        *layers = more;
        return Ok(());
    }
    let fail = |e: ndarray::ShapeError| TrainError::Cache {
        rung: rung.to_string(),
        detail: e.to_string(),
    };
    for (l, m) in layers.iter_mut().zip(more) {
        l.k = concatenate(Axis(0), &[l.k.view(), m.k.view()]).map_err(fail)?;
        l.v = concatenate(Axis(0), &[l.v.view(), m.v.view()]).map_err(fail)?;
    }
    Ok(())
}

/// Fits the route `src → dst` (its shipped variant) on growing training sets and reports
/// the residuals on the fixed held-out windows of `corpus.base`; `corpus.extra` extends the
/// training order past the base corpus. `progress` receives one line per step; `on_point` the report
/// after every point (to write it as it grows). Nothing is written to the projectors.
///
/// # Errors
/// [`TrainError::Corpus`] if `corpus.base` has fewer than `held_out_every` windows; collection and
/// fit errors as [`super::fit_ladder`].
pub fn fit_curve(
    src: &RungInfo,
    dst: &RungInfo,
    config: ContextConfig,
    corpus: &CurveCorpus<'_>,
    opts: &CurveOptions,
    progress: &mut dyn FnMut(&str),
    on_point: &mut dyn FnMut(&CurveReport),
) -> Result<CurveReport, TrainError> {
    let (base, extra) = (&corpus.base, &corpus.extra);
    let every = opts.held_out_every.max(2);
    if base.len() < every {
        return Err(TrainError::Corpus(format!(
            "{} base windows; need at least {every}",
            base.len()
        )));
    }
    let mut held: Vec<&[Token]> = Vec::new();
    let mut base_train: Vec<&[Token]> = Vec::new();
    for (i, &w) in base.iter().enumerate() {
        if i % every == every - 1 {
            held.push(w);
        } else {
            base_train.push(w);
        }
    }
    let order = train_order(&base_train, extra, opts.seed);
    let lens: Vec<usize> = order.iter().map(|w| w.len()).collect();
    let base_train_tokens: usize = base_train.iter().map(|w| w.len()).sum();
    let mut sizes = opts.train_tokens.clone();
    sizes.push(base_train_tokens);
    let (ends, skipped_sizes) = prefixes(&lens, &sizes);

    let (sb, db) = (binding(src), binding(dst));
    let kind = route_kind(&sb, &db);
    let mut fo = fit_options(Variant::Auto, kind)
        .ok_or_else(|| TrainError::Corpus(format!("no shipped variant for a {kind:?} route")))?;
    fo.restore_spread = opts.restore_spread;
    let route = format!("{}→{}", src.name(), dst.name());
    let held_lens: Vec<usize> = held.iter().map(|w| w.len()).collect();
    let held_out_tokens: usize = held_lens.iter().sum();
    let mut report = CurveReport {
        route: route.clone(),
        window: base.iter().map(|w| w.len()).max().unwrap_or(0),
        held_out_every: every,
        held_out_tokens,
        held_out_rows: 0,
        base_train_tokens,
        extra_available_tokens: extra.iter().map(|w| w.len()).sum(),
        collect_ms: vec![(src.name().to_string(), 0.0), (dst.name().to_string(), 0.0)],
        points: Vec::new(),
        skipped_sizes,
    };
    let mut samples = RouteSamples {
        src: sb,
        dst: db,
        src_layers: Vec::new(),
        dst_layers: Vec::new(),
        positions: Vec::new(),
        train: Vec::new(),
        held_out: window_ranges(&held_lens, 0, opts.skip_head),
    };
    // Rows: the held-out windows first, then the training order as far as collected.
    let mut pending: Vec<&[Token]> = held.clone();
    let mut collected = 0;
    for &end in &ends {
        pending.extend_from_slice(&order[collected..end]);
        if !pending.is_empty() {
            let n: usize = pending.iter().map(|w| w.len()).sum();
            for (slot, (rung, layers)) in [
                (src, &mut samples.src_layers),
                (dst, &mut samples.dst_layers),
            ]
            .into_iter()
            .enumerate()
            {
                progress(&format!(
                    "collecting K/V on {} ({} windows, {n} tokens)",
                    rung.name(),
                    pending.len()
                ));
                let acts = collect(rung, config, &pending)?;
                if acts.positions.len() != n {
                    return Err(TrainError::Cache {
                        rung: rung.name().to_string(),
                        detail: format!("{} cache rows for {n} tokens", acts.positions.len()),
                    });
                }
                report.collect_ms[slot].1 += acts.elapsed_ms;
                append(layers, acts.layers, rung.name())?;
                if slot == 0 {
                    samples.positions.extend(acts.positions);
                }
            }
            pending.clear();
        }
        collected = end;
        samples.train = window_ranges(&lens[..end], held_out_tokens, opts.skip_head);
        let train_tokens: usize = lens[..end].iter().sum();
        progress(&format!(
            "fitting {route} on {train_tokens} training tokens"
        ));
        let t0 = Instant::now();
        let (_, fit) = fit_route(&samples, &fo).map_err(|source| TrainError::Fit {
            route: route.clone(),
            variant: format!("curve at {train_tokens} tokens"),
            source,
        })?;
        let median = |pick: fn(&crate::transplant::fit::LayerFitReport) -> Option<f64>| {
            let mut v: Vec<f64> = fit.layers.iter().filter_map(pick).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied()
        };
        let base_in_prefix = end.min(base_train.len());
        let point = CurvePoint {
            train_tokens,
            extra_tokens: lens[base_in_prefix..end].iter().sum(),
            train_windows: end,
            train_rows: fit.n_train_rows,
            k_held_out: fit.k.held_out,
            v_held_out: fit.v.held_out,
            k_train: fit.k.train,
            v_train: fit.v.train,
            lambda: LambdaMedians {
                k: median(|l| l.lambda_k),
                v: median(|l| l.lambda_v),
            },
            fit_ms: t0.elapsed().as_secs_f64() * 1e3,
        };
        progress(&format!(
            "  {train_tokens} tokens: K held-out {:.4} (train {:.4}), V held-out {:.4} (train {:.4})",
            point.k_held_out, point.k_train, point.v_held_out, point.v_train
        ));
        report.held_out_rows = fit.n_held_out_rows;
        report.points.push(point);
        on_point(&report);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_reach_each_size_with_the_fewest_windows() {
        let lens = [10, 10, 10, 10];
        let (ends, skipped) = prefixes(&lens, &[25, 10, 10, 41, 40, 11]);
        // 10 -> 1 window, 11 -> 2, 25 -> 3, 40 -> 4; 41 is out of reach.
        assert_eq!(ends, vec![1, 2, 3, 4]);
        assert_eq!(skipped, vec![41]);
        // Two sizes that need the same prefix give one point.
        assert_eq!(prefixes(&lens, &[21, 30]).0, vec![3]);
    }

    #[test]
    fn the_order_keeps_base_windows_before_extra_ones_and_is_reproducible() {
        let a: Vec<Token> = (0..40).collect();
        let base: Vec<&[Token]> = a[..20].chunks(2).collect();
        let extra: Vec<&[Token]> = a[20..].chunks(2).collect();
        let o = train_order(&base, &extra, 7);
        assert_eq!(o, train_order(&base, &extra, 7));
        assert!(o[..10].iter().all(|w| w[0] < 20), "base first");
        assert!(o[10..].iter().all(|w| w[0] >= 20), "then extra");
        assert_ne!(o[..10], base[..], "shuffled");
        let mut sorted = o[..10].to_vec();
        sorted.sort();
        assert_eq!(sorted, base, "a permutation");
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn window_ranges_skip_each_head() {
        assert_eq!(
            window_ranges(&[5, 3, 2], 100, 2),
            vec![102..105, 107..108, 110..110]
        );
    }
}
