//! Fitting a [`Projector`] from paired activations, as a pure function.
//!
//! [`RouteSamples`] holds, for one token sequence run through both rungs, every layer's
//! pre-RoPE K and V on each side, the positions, and a train / held-out split by windows
//! (consecutive tokens are correlated, so a random row split would leak). [`fit_route`]
//! fits every destination layer for every candidate source-layer set of the depth remap,
//! chooses λ from a relative grid on the held-out rows, keeps the candidate with the lowest
//! held-out K + V residual, and returns the projector with a serde [`FitReport`]: held-out
//! relative RMS per layer and pooled, K and V separately, with the training residual beside
//! it (a dense map fitted on few tokens drives the training residual to ~0 while
//! generalising not at all; only the pair tells the truth).
//!
//! [`FitOptions`] selects the map kind (dense, per-head, diagonal, truncate, identity), the
//! sandwich (off = fit rotated keys directly, the ablation), the λ grid and the depth
//! policy, with presets for the two routes of the shipped ladder and the baselines.
//!
//! Cost: the f64 moments `XₐᵀX_b` of each source layer (and of bracketing pairs) are
//! accumulated once and shared by every destination layer and candidate that uses them, so
//! the search costs little more than one fit per source layer.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use faer::Mat;
use ndarray::{Array2, ArrayView2, Axis};

use crate::transplant::error::TransplantError;
use crate::transplant::map::LayerMap;
use crate::transplant::project::{DepthSearch, depth_remap_candidates, uniform_depth_map};
use crate::transplant::projector::{
    LayerFit, LayerProjection, Projector, ProjectorKind, RungBinding,
};
use crate::transplant::ridge::{
    NormalEquations, at_b, col_sums, fit_diagonal, fit_per_head_from, ratio, select_lambda, sq_err,
    to_f64,
};
use crate::transplant::rope::{Direction, rotate};

mod options;
mod report;
mod samples;

pub use options::{DepthPolicy, FitOptions, log_grid};
pub use report::{CandidateScore, FitReport, LayerFitReport, Residual};
pub use samples::{LayerActivations, RouteSamples, Split, split_windows};

/// Fit a projector for the route described by `samples`.
///
/// # Errors
/// [`RouteSamples::validate`]'s errors; [`TransplantError::InvalidLambda`] for an empty grid
/// with a fitted kind; [`TransplantError::Unsupported`] for a diagonal or identity map
/// between different geometries, or a truncate/diagonal/identity map offered several source
/// layers; solve errors if no λ of the grid is solvable.
pub fn fit_route(
    samples: &RouteSamples,
    opts: &FitOptions,
) -> Result<(Projector, FitReport), TransplantError> {
    let t0 = Instant::now();
    samples.validate()?;
    let (src, dst) = (&samples.src, &samples.dst);
    let fitted = matches!(
        opts.kind,
        ProjectorKind::Dense | ProjectorKind::PerHead | ProjectorKind::Diagonal
    );
    if fitted && opts.lambdas.is_empty() {
        return Err(TransplantError::InvalidLambda {
            reason: "empty lambda grid for a fitted map kind",
        });
    }
    if matches!(opts.kind, ProjectorKind::Diagonal | ProjectorKind::Identity)
        && src.kv_dim() != dst.kv_dim()
    {
        return Err(TransplantError::Unsupported {
            kind: opts.kind.name(),
            reason: format!(
                "needs equal K/V widths, source {} is {} wide and destination {} is {}",
                src.name,
                src.kv_dim(),
                dst.name,
                dst.kv_dim()
            ),
        });
    }
    let candidates = candidates(src.n_layer, dst.n_layer, opts);

    // Keys in the space the maps act on: pre-RoPE inside the sandwich, rotated without it.
    let rotated = |layers: &[LayerActivations],
                   b: &RungBinding|
     -> Result<Vec<Array2<f32>>, TransplantError> {
        layers
            .iter()
            .map(|l| {
                let mut k = l.k.clone();
                rotate(k.view_mut(), &samples.positions, &b.rope, Direction::Rotate)?;
                Ok(k)
            })
            .collect()
    };
    let (src_k_rot, dst_k_rot);
    let (src_k, dst_k): (Vec<&Array2<f32>>, Vec<&Array2<f32>>) = if opts.sandwich {
        (
            samples.src_layers.iter().map(|l| &l.k).collect(),
            samples.dst_layers.iter().map(|l| &l.k).collect(),
        )
    } else {
        src_k_rot = rotated(&samples.src_layers, src)?;
        dst_k_rot = rotated(&samples.dst_layers, dst)?;
        (src_k_rot.iter().collect(), dst_k_rot.iter().collect())
    };
    let src_v: Vec<&Array2<f32>> = samples.src_layers.iter().map(|l| &l.v).collect();
    let dst_v: Vec<&Array2<f32>> = samples.dst_layers.iter().map(|l| &l.v).collect();

    let ctx = Ctx {
        opts,
        src,
        dst,
        train_idx: samples.train.iter().flat_map(Clone::clone).collect(),
        val_idx: samples.held_out.iter().flat_map(Clone::clone).collect(),
        train: &samples.train,
    };
    // K and V are searched separately but a candidate is scored on both, so keep every
    // candidate's fits of one side while the other is computed.
    let k_fits = ctx.fit_side(&src_k, &dst_k, &candidates)?;
    let v_fits = ctx.fit_side(&src_v, &dst_v, &candidates)?;

    let mut layers = Vec::with_capacity(dst.n_layer);
    let mut reports = Vec::with_capacity(dst.n_layer);
    let mut pooled = [[0f64; 2]; 4]; // k train, k val, v train, v val: [num, den]
    for (j, (kc, vc)) in k_fits.into_iter().zip(v_fits).enumerate() {
        let best = choose(&candidates[j], &kc, &vc, opts.multi_layer_margin);
        let scores = candidates[j]
            .iter()
            .zip(kc.iter().zip(&vc))
            .map(|(c, (k, v))| CandidateScore {
                src_layers: c.clone(),
                k_held_out: k.val_rel(),
                v_held_out: v.val_rel(),
            })
            .collect();
        let cand = &candidates[j][best];
        let no_candidate = || TransplantError::TooFewRows {
            what: "depth candidates",
            rows: 0,
            needed: 1,
        };
        let mut kf = kc.into_iter().nth(best).ok_or_else(no_candidate)?;
        let mut vf = vc.into_iter().nth(best).ok_or_else(no_candidate)?;
        if opts.restore_spread && fitted {
            ctx.restore_spread(&mut kf, &src_k, dst_k[j], cand, dst.head_dim)?;
            ctx.restore_spread(&mut vf, &src_v, dst_v[j], cand, dst.head_dim)?;
        }
        let ks = ctx.spread(&kf.map, &src_k, dst_k[j], cand)?;
        let vs = ctx.spread(&vf.map, &src_v, dst_v[j], cand)?;
        let k_train = ctx.sq_err_on(&kf.map, &src_k, dst_k[j], cand, &ctx.train_idx)?;
        let v_train = ctx.sq_err_on(&vf.map, &src_v, dst_v[j], cand, &ctx.train_idx)?;
        for (slot, e) in pooled.iter_mut().zip([k_train, kf.val, v_train, vf.val]) {
            slot[0] += e.0;
            slot[1] += e.1;
        }
        let k = Residual {
            train: ratio(k_train.0, k_train.1),
            held_out: kf.val_rel(),
        };
        let v = Residual {
            train: ratio(v_train.0, v_train.1),
            held_out: vf.val_rel(),
        };
        layers.push(LayerProjection {
            src_layers: cand.clone(),
            k: kf.map,
            v: vf.map,
            fit: Some(LayerFit {
                lambda_k: kf.lambda,
                lambda_v: vf.lambda,
                k_train_rel_rms: k.train,
                k_held_out_rel_rms: k.held_out,
                v_train_rel_rms: v.train,
                v_held_out_rel_rms: v.held_out,
            }),
        });
        reports.push(LayerFitReport {
            dst_layer: j,
            src_layers: cand.clone(),
            lambda_k: kf.lambda,
            lambda_v: vf.lambda,
            k,
            v,
            k_spread: Some(ks.0),
            v_spread: Some(vs.0),
            k_centred_held_out: Some(ks.1),
            v_centred_held_out: Some(vs.1),
            candidates: scores,
        });
    }
    let projector = Projector {
        src: src.clone(),
        dst: dst.clone(),
        kind: opts.kind,
        sandwich: opts.sandwich,
        layers,
    };
    projector.validate()?;
    let report = FitReport {
        route: projector.route_name(),
        options: opts.clone(),
        n_train_rows: ctx.train_idx.len(),
        n_held_out_rows: ctx.val_idx.len(),
        layers: reports,
        k: Residual {
            train: ratio(pooled[0][0], pooled[0][1]),
            held_out: ratio(pooled[1][0], pooled[1][1]),
        },
        v: Residual {
            train: ratio(pooled[2][0], pooled[2][1]),
            held_out: ratio(pooled[3][0], pooled[3][1]),
        },
        elapsed_ms: t0.elapsed().as_secs_f64() * 1e3,
    };
    Ok((projector, report))
}

/// Candidate sets per destination layer under the policy; kinds that read one layer only
/// never get multi-layer sets.
fn candidates(n_src: usize, n_dst: usize, opts: &FitOptions) -> Vec<Vec<Vec<usize>>> {
    let single_only = !matches!(opts.kind, ProjectorKind::Dense | ProjectorKind::PerHead);
    match opts.depth {
        DepthPolicy::Search(s) => {
            let s = DepthSearch {
                bracketing_pairs: s.bracketing_pairs && !single_only,
                ..s
            };
            depth_remap_candidates(n_src, n_dst, s)
        }
        DepthPolicy::Uniform => uniform_depth_map(n_src, n_dst)
            .into_iter()
            .map(|s| vec![vec![s]])
            .collect(),
        DepthPolicy::Index => (0..n_dst).map(|j| vec![vec![j.min(n_src - 1)]]).collect(),
    }
}

/// Index of the chosen candidate: lowest K + V held-out score; a candidate with more source
/// layers than the incumbent must beat it by `margin` (relative).
fn choose(cands: &[Vec<usize>], k: &[SideFit], v: &[SideFit], margin: f64) -> usize {
    let mut best = 0;
    let mut best_score = f64::INFINITY;
    for (i, c) in cands.iter().enumerate() {
        let score = k[i].val_rel() + v[i].val_rel();
        let need = if c.len() > cands[best].len() && best_score.is_finite() {
            best_score * (1.0 - margin)
        } else {
            best_score
        };
        if score < need {
            best = i;
            best_score = score;
        }
    }
    best
}

/// One map fitted for one candidate on one side (K or V).
struct SideFit {
    map: LayerMap,
    lambda: Option<f64>,
    /// Held-out `(‖E‖², ‖Y‖²)`.
    val: (f64, f64),
}

impl SideFit {
    fn val_rel(&self) -> f64 {
        ratio(self.val.0, self.val.1)
    }
}

struct Ctx<'a> {
    opts: &'a FitOptions,
    src: &'a RungBinding,
    dst: &'a RungBinding,
    train_idx: Vec<usize>,
    val_idx: Vec<usize>,
    train: &'a [Range<usize>],
}

/// Lazily accumulated f64 moments of the source layers' training rows.
struct Moments<'a> {
    src: &'a [&'a Array2<f32>],
    train: &'a [Range<usize>],
    x64: HashMap<usize, Mat<f64>>,
    sums: HashMap<usize, Vec<f64>>,
    gram: HashMap<(usize, usize), Mat<f64>>,
}

impl Moments<'_> {
    fn x(&mut self, a: usize) -> &Mat<f64> {
        let (src, train) = (self.src, self.train);
        self.x64
            .entry(a)
            .or_insert_with(|| to_f64(src[a].view(), train))
    }

    fn sum(&mut self, a: usize) -> Vec<f64> {
        if let Some(s) = self.sums.get(&a) {
            return s.clone();
        }
        let s = col_sums(self.x(a).as_ref());
        self.sums.insert(a, s.clone());
        s
    }

    /// `XₐᵀX_b`.
    fn gram(&mut self, a: usize, b: usize) -> Mat<f64> {
        let key = (a.min(b), a.max(b));
        if !self.gram.contains_key(&key) {
            let xa = self.x(key.0).clone();
            let g = at_b(xa.as_ref(), self.x(key.1).as_ref());
            self.gram.insert(key, g);
        }
        let g = &self.gram[&key];
        if a <= b {
            g.clone()
        } else {
            g.transpose().to_owned()
        }
    }

    /// Raw normal equations of candidate `cand` against target rows `y64` (with sums).
    fn normal(
        &mut self,
        cand: &[usize],
        y64: &Mat<f64>,
        y_sum: &[f64],
        n: usize,
    ) -> NormalEquations {
        let d = self.src[cand[0]].ncols();
        let width = d * cand.len();
        let mut xtx = Mat::<f64>::zeros(width, width);
        let mut xty = Mat::<f64>::zeros(width, y64.ncols());
        let mut sum_x = Vec::with_capacity(width);
        for (p, &a) in cand.iter().enumerate() {
            sum_x.extend(self.sum(a));
            for (q, &b) in cand.iter().enumerate() {
                let g = self.gram(a, b);
                xtx.as_mut()
                    .submatrix_mut(p * d, q * d, d, d)
                    .copy_from(g.as_ref());
            }
            let c = at_b(self.x(a).as_ref(), y64.as_ref());
            xty.as_mut()
                .submatrix_mut(p * d, 0, d, y64.ncols())
                .copy_from(c.as_ref());
        }
        NormalEquations::from_raw(n, &sum_x, y_sum, xtx, xty)
    }
}

/// Rows `idx` of the candidate's source layers side by side.
fn gather(src: &[&Array2<f32>], cand: &[usize], idx: &[usize]) -> Array2<f32> {
    let d = cand.first().map_or(0, |&a| src[a].ncols());
    let mut out = Array2::<f32>::zeros((idx.len(), d * cand.len()));
    for (p, &a) in cand.iter().enumerate() {
        for (r, &i) in idx.iter().enumerate() {
            out.slice_mut(ndarray::s![r, p * d..(p + 1) * d])
                .assign(&src[a].row(i));
        }
    }
    out
}

impl Ctx<'_> {
    /// Widens a fitted side's map per output head to the destination's spread on the
    /// training rows (see [`FitOptions::restore_spread`]) and re-measures its held-out error.
    fn restore_spread(
        &self,
        side: &mut SideFit,
        src: &[&Array2<f32>],
        dst: &Array2<f32>,
        cand: &[usize],
        head_dim: usize,
    ) -> Result<(), TransplantError> {
        let x = gather(src, cand, &self.train_idx);
        let y = dst.select(Axis(0), &self.train_idx);
        let p = side.map.apply(x.view())?;
        let n = p.ncols();
        let mean = |a: &Array2<f32>| -> Vec<f64> {
            let rows = a.nrows().max(1) as f64;
            a.axis_iter(Axis(1))
                .map(|c| c.iter().map(|&v| f64::from(v)).sum::<f64>() / rows)
                .collect()
        };
        let (pm, ym) = (mean(&p), mean(&y));
        let mut alpha = ndarray::Array1::<f32>::ones(n);
        for h0 in (0..n).step_by(head_dim.max(1)) {
            let cols = h0..(h0 + head_dim).min(n);
            let (mut num, mut den) = (0f64, 0f64);
            for c in cols.clone() {
                num += y
                    .column(c)
                    .iter()
                    .map(|&v| (f64::from(v) - ym[c]).powi(2))
                    .sum::<f64>();
                den += p
                    .column(c)
                    .iter()
                    .map(|&v| (f64::from(v) - pm[c]).powi(2))
                    .sum::<f64>();
            }
            #[allow(clippy::cast_possible_truncation)] // a clamped ratio
            let a = if den > 0.0 {
                (num / den).sqrt().clamp(1.0, 3.0) as f32
            } else {
                1.0
            };
            for c in cols {
                alpha[c] = a;
            }
        }
        #[allow(clippy::cast_possible_truncation)] // means of f32 data
        let centre = ndarray::Array1::from_iter(pm.iter().map(|&m| m as f32));
        side.map.rescale_outputs(&alpha, &centre)?;
        side.val = self.sq_err_on(&side.map, src, dst, cand, &self.val_idx)?;
        Ok(())
    }

    /// Held-out `(spread, centred error)` of a map: the prediction's centred spread over the
    /// destination's, and the error over the destination's centred spread.
    fn spread(
        &self,
        map: &LayerMap,
        src: &[&Array2<f32>],
        dst: &Array2<f32>,
        cand: &[usize],
    ) -> Result<(f64, f64), TransplantError> {
        let x = gather(src, cand, &self.val_idx);
        let y = dst.select(Axis(0), &self.val_idx);
        let p = map.apply(x.view())?;
        let centred = |a: &Array2<f32>| centred_sum_sq(a.view()) * a.ncols() as f64;
        let (sy, sp) = (centred(&y), centred(&p));
        let (err, _) = sq_err(p.view(), y.view())?;
        Ok((ratio(sp, sy), ratio(err, sy)))
    }

    fn sq_err_on(
        &self,
        map: &LayerMap,
        src: &[&Array2<f32>],
        dst: &Array2<f32>,
        cand: &[usize],
        idx: &[usize],
    ) -> Result<(f64, f64), TransplantError> {
        let x = gather(src, cand, idx);
        let y = dst.select(Axis(0), idx);
        sq_err(map.apply(x.view())?.view(), y.view())
    }

    /// Fit every candidate of every destination layer on one side (K or V).
    fn fit_side(
        &self,
        src: &[&Array2<f32>],
        dst: &[&Array2<f32>],
        candidates: &[Vec<Vec<usize>>],
    ) -> Result<Vec<Vec<SideFit>>, TransplantError> {
        let mut moments = Moments {
            src,
            train: self.train,
            x64: HashMap::new(),
            sums: HashMap::new(),
            gram: HashMap::new(),
        };
        let needs_moments = matches!(
            self.opts.kind,
            ProjectorKind::Dense | ProjectorKind::PerHead
        );
        let n_train = self.train_idx.len();
        candidates
            .iter()
            .enumerate()
            .map(|(j, cands)| {
                let y_val = dst[j].select(Axis(0), &self.val_idx);
                let y64 = needs_moments.then(|| to_f64(dst[j].view(), self.train));
                let y_sum = y64.as_ref().map(|y| col_sums(y.as_ref()));
                cands
                    .iter()
                    .map(|cand| {
                        let x_val = gather(src, cand, &self.val_idx);
                        let score = |m: &LayerMap| -> Result<f64, TransplantError> {
                            let (num, den) = sq_err(m.apply(x_val.view())?.view(), y_val.view())?;
                            Ok(ratio(num, den))
                        };
                        let (map, lambda) = match (self.opts.kind, &y64, &y_sum) {
                            (
                                ProjectorKind::Dense | ProjectorKind::PerHead,
                                Some(y64),
                                Some(y_sum),
                            ) => {
                                let ne = moments.normal(cand, y64, y_sum, n_train);
                                let unit = ne.feature_scale().max(f64::MIN_POSITIVE);
                                let grid: Vec<f64> =
                                    self.opts.lambdas.iter().map(|r| r * unit).collect();
                                let (m, l, _) = if self.opts.kind == ProjectorKind::Dense {
                                    select_lambda(
                                        &grid,
                                        |l| ne.solve(l).map(LayerMap::Affine),
                                        score,
                                    )?
                                } else {
                                    select_lambda(
                                        &grid,
                                        |l| {
                                            Ok(LayerMap::PerHead {
                                                in_dim: ne.d_in(),
                                                out_dim: ne.d_out(),
                                                blocks: fit_per_head_from(
                                                    &ne,
                                                    self.src.n_kv_heads,
                                                    self.dst.n_kv_heads,
                                                    self.src.head_dim,
                                                    self.dst.head_dim,
                                                    l,
                                                )?,
                                            })
                                        },
                                        score,
                                    )?
                                };
                                (m, Some(l))
                            }
                            (ProjectorKind::Diagonal, ..) => {
                                let x_tr = gather(src, cand, &self.train_idx);
                                let y_tr = dst[j].select(Axis(0), &self.train_idx);
                                let unit = centred_sum_sq(x_tr.view()).max(f64::MIN_POSITIVE);
                                let grid: Vec<f64> =
                                    self.opts.lambdas.iter().map(|r| r * unit).collect();
                                let (m, l, _) = select_lambda(
                                    &grid,
                                    |l| {
                                        let d = fit_diagonal(x_tr.view(), y_tr.view(), l)?;
                                        Ok(LayerMap::Diagonal {
                                            scale: d.scale.into(),
                                            offset: d.offset.into(),
                                        })
                                    },
                                    score,
                                )?;
                                (m, Some(l))
                            }
                            (ProjectorKind::Truncate, ..) => {
                                (self.single_layer_map(cand, true)?, None)
                            }
                            _ => (self.single_layer_map(cand, false)?, None),
                        };
                        let val = sq_err(map.apply(x_val.view())?.view(), y_val.view())?;
                        Ok(SideFit { map, lambda, val })
                    })
                    .collect::<Result<Vec<_>, TransplantError>>()
            })
            .collect()
    }

    /// The unfitted maps: truncate or identity, from exactly one source layer.
    fn single_layer_map(
        &self,
        cand: &[usize],
        truncate: bool,
    ) -> Result<LayerMap, TransplantError> {
        if cand.len() != 1 {
            return Err(TransplantError::Unsupported {
                kind: if truncate { "truncate" } else { "identity" },
                reason: format!("reads one source layer, offered {cand:?}"),
            });
        }
        Ok(if truncate {
            LayerMap::Truncate {
                n_heads_in: self.src.n_kv_heads,
                head_dim_in: self.src.head_dim,
                n_heads_out: self.dst.n_kv_heads,
                head_dim_out: self.dst.head_dim,
            }
        } else {
            LayerMap::Identity {
                dim: self.src.kv_dim(),
            }
        })
    }
}

/// Mean over channels of the centred sum of squares (the diagonal λ unit).
fn centred_sum_sq(x: ArrayView2<'_, f32>) -> f64 {
    let n = x.nrows() as f64;
    let total: f64 = x
        .axis_iter(Axis(1))
        .map(|c| {
            let m = c.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            c.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>()
        })
        .sum();
    total / x.ncols().max(1) as f64
}

#[cfg(test)]
mod tests;
