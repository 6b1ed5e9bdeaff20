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
use serde::{Deserialize, Serialize};

use super::error::TransplantError;
use super::map::LayerMap;
use super::project::{DepthSearch, depth_remap_candidates, uniform_depth_map};
use super::projector::{LayerFit, LayerProjection, Projector, ProjectorKind, RungBinding};
use super::ridge::{
    NormalEquations, at_b, col_sums, fit_diagonal, fit_per_head_from, ratio, select_lambda, sq_err,
    to_f64,
};
use super::rope::{Direction, rotate};

/// One layer's activations on one rung: pre-RoPE K and V, `[n_rows][kv_dim]` each.
#[derive(Clone, Debug)]
pub struct LayerActivations {
    /// Keys before RoPE (as produced by the K projection, bias included).
    pub k: Array2<f32>,
    /// Values.
    pub v: Array2<f32>,
}

/// Paired activations of the same tokens on the source and destination rungs.
#[derive(Clone, Debug)]
pub struct RouteSamples {
    /// Source rung.
    pub src: RungBinding,
    /// Destination rung.
    pub dst: RungBinding,
    /// One entry per source layer.
    pub src_layers: Vec<LayerActivations>,
    /// One entry per destination layer.
    pub dst_layers: Vec<LayerActivations>,
    /// Position of each row (used to rotate keys for the no-sandwich ablation).
    pub positions: Vec<i32>,
    /// Training row ranges.
    pub train: Vec<Range<usize>>,
    /// Held-out row ranges, disjoint from `train`.
    pub held_out: Vec<Range<usize>>,
}

impl RouteSamples {
    /// Rows per layer.
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.positions.len()
    }

    /// Check shapes against the bindings and that the split is in range and disjoint.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`], [`TransplantError::RowsOutOfRange`],
    /// [`TransplantError::TooFewRows`] (fewer than 2 training or 1 held-out row, or an
    /// overlap, reported as the overlapping row count).
    pub fn validate(&self) -> Result<(), TransplantError> {
        self.src.validate()?;
        self.dst.validate()?;
        let n = self.n_rows();
        for (what, layers, b) in [
            ("source sample layers", &self.src_layers, &self.src),
            ("destination sample layers", &self.dst_layers, &self.dst),
        ] {
            if layers.len() != b.n_layer {
                return Err(TransplantError::ShapeMismatch {
                    what,
                    expected: b.n_layer,
                    actual: layers.len(),
                });
            }
            for l in layers {
                for m in [&l.k, &l.v] {
                    if m.dim() != (n, b.kv_dim()) {
                        let (what, expected, actual) = if m.nrows() == n {
                            ("sample width vs kv_dim", b.kv_dim(), m.ncols())
                        } else {
                            ("sample rows vs positions", n, m.nrows())
                        };
                        return Err(TransplantError::ShapeMismatch {
                            what,
                            expected,
                            actual,
                        });
                    }
                }
            }
        }
        let mut used = vec![0u8; n];
        for (bit, ranges) in [(1u8, &self.train), (2u8, &self.held_out)] {
            for r in ranges {
                if r.start > r.end || r.end > n {
                    return Err(TransplantError::RowsOutOfRange {
                        start: r.start,
                        end: r.end,
                        n_rows: n,
                    });
                }
                for u in &mut used[r.clone()] {
                    *u |= bit;
                }
            }
        }
        let overlap = used.iter().filter(|&&u| u == 3).count();
        if overlap > 0 {
            return Err(TransplantError::TooFewRows {
                what: "disjoint train/held-out rows (rows in both)",
                rows: overlap,
                needed: 0,
            });
        }
        let n_train: usize = self.train.iter().map(ExactSizeIterator::len).sum();
        let n_val: usize = self.held_out.iter().map(ExactSizeIterator::len).sum();
        if n_train < 2 {
            return Err(TransplantError::TooFewRows {
                what: "training rows",
                rows: n_train,
                needed: 2,
            });
        }
        if n_val == 0 {
            return Err(TransplantError::TooFewRows {
                what: "held-out rows",
                rows: 0,
                needed: 1,
            });
        }
        Ok(())
    }
}

/// Training and held-out row ranges.
pub type Split = (Vec<Range<usize>>, Vec<Range<usize>>);

/// Split `0..n_rows` into windows of `window` rows; every `held_out_every`-th window
/// (the last of each group) is held out, the rest train.
///
/// # Errors
/// [`TransplantError::TooFewRows`] if `window` is 0, `held_out_every < 2`, or there are
/// fewer than `held_out_every` windows (so one side would be empty).
pub fn split_windows(
    n_rows: usize,
    window: usize,
    held_out_every: usize,
) -> Result<Split, TransplantError> {
    if window == 0 || held_out_every < 2 {
        return Err(TransplantError::TooFewRows {
            what: "window length / held-out period",
            rows: window.min(held_out_every),
            needed: 2,
        });
    }
    let n_windows = n_rows.div_ceil(window);
    if n_windows < held_out_every {
        return Err(TransplantError::TooFewRows {
            what: "windows for a train/held-out split",
            rows: n_windows,
            needed: held_out_every,
        });
    }
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for w in 0..n_windows {
        let r = w * window..((w + 1) * window).min(n_rows);
        if w % held_out_every == held_out_every - 1 {
            held.push(r);
        } else {
            train.push(r);
        }
    }
    Ok((train, held))
}

/// Which source layers each destination layer may read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DepthPolicy {
    /// Search around the proportional map and keep the best held-out candidate.
    Search(DepthSearch),
    /// The proportional map, no search (the "no depth remap" ablation for unequal depths).
    Uniform,
    /// Index-mapped: destination layer `j` ← source layer `min(j, n_src − 1)` (the naive
    /// baseline).
    Index,
}

/// What to fit and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FitOptions {
    /// Map family.
    pub kind: ProjectorKind,
    /// Fit inside the RoPE sandwich (`false` fits rotated keys directly: the ablation).
    pub sandwich: bool,
    /// λ grid relative to the data: absolute λ = relative × mean centred sum of squares per
    /// input feature, so one grid serves keys of any magnitude.
    pub lambdas: Vec<f64>,
    /// Depth remap policy.
    pub depth: DepthPolicy,
    /// A candidate reading more source layers must beat the best smaller one by this
    /// relative margin of held-out score, or the smaller is kept (it has fewer parameters).
    pub multi_layer_margin: f64,
    /// Undo the ridge's shrinkage: after the fit, widen each output head around the
    /// prediction's mean so its spread on the training rows matches the destination's
    /// (`alpha = sqrt(Σ(y−ȳ)² / Σ(ŷ−mean ŷ)²)` per KV head, clamped to [1, 3]), folded into the
    /// map. A regression's prediction is narrower than its target; attention logits built
    /// from narrowed keys are flatter than the destination's own.
    #[serde(default)]
    pub restore_spread: bool,
}

/// `10^lo, 10^(lo+1), …, 10^hi`.
#[must_use]
pub fn log_grid(lo: i32, hi: i32) -> Vec<f64> {
    (lo..=hi).map(|e| 10f64.powi(e)).collect()
}

impl FitOptions {
    /// Size route (e.g. 1.5B → 0.5B): dense maps in the sandwich, depth search.
    #[must_use]
    pub fn size_route() -> Self {
        Self {
            kind: ProjectorKind::Dense,
            sandwich: true,
            lambdas: log_grid(-6, 2),
            depth: DepthPolicy::Search(DepthSearch::default()),
            multi_layer_margin: 0.02,
            restore_spread: false,
        }
    }

    /// Size route with per-head block maps.
    #[must_use]
    pub fn per_head_route() -> Self {
        Self {
            kind: ProjectorKind::PerHead,
            ..Self::size_route()
        }
    }

    /// Precision route (same weights, other quantisation): diagonal maps, layer `j` ← `j`.
    #[must_use]
    pub fn precision_route() -> Self {
        Self {
            kind: ProjectorKind::Diagonal,
            sandwich: true,
            lambdas: log_grid(-6, 2),
            depth: DepthPolicy::Uniform,
            multi_layer_margin: 0.02,
            restore_spread: false,
        }
    }

    /// The naive baseline: truncate each head, index-mapped layers, no fitting.
    #[must_use]
    pub fn truncate_baseline() -> Self {
        Self {
            kind: ProjectorKind::Truncate,
            sandwich: true,
            lambdas: Vec::new(),
            depth: DepthPolicy::Index,
            multi_layer_margin: 0.0,
            restore_spread: false,
        }
    }
}

impl Default for FitOptions {
    fn default() -> Self {
        Self::size_route()
    }
}

/// A training and a held-out relative RMS.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Residual {
    /// On training rows.
    pub train: f64,
    /// On held-out rows.
    pub held_out: f64,
}

/// Held-out residuals of one depth-remap candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    /// The candidate source layers.
    pub src_layers: Vec<usize>,
    /// K held-out relative RMS at its best λ.
    pub k_held_out: f64,
    /// V held-out relative RMS at its best λ.
    pub v_held_out: f64,
}

/// How one destination layer was fitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerFitReport {
    /// Destination layer.
    pub dst_layer: usize,
    /// Chosen source layers.
    pub src_layers: Vec<usize>,
    /// Chosen absolute λ for K (none for unfitted kinds).
    pub lambda_k: Option<f64>,
    /// Chosen absolute λ for V.
    pub lambda_v: Option<f64>,
    /// K residuals.
    pub k: Residual,
    /// V residuals.
    pub v: Residual,
    /// Held-out spread of the K prediction against the destination's:
    /// `sqrt(Σ(ŷ−mean ŷ)² / Σ(y−ȳ)²)` (1: as wide; below 1: shrunk toward the mean).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k_spread: Option<f64>,
    /// The same for V.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_spread: Option<f64>,
    /// Held-out K error relative to the destination's centred spread,
    /// `sqrt(Σ(ŷ−y)² / Σ(y−ȳ)²)`: the residual with the channel means (large for keys with a
    /// bias) taken out of the denominator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k_centred_held_out: Option<f64>,
    /// The same for V.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_centred_held_out: Option<f64>,
    /// Every candidate tried, in search order.
    pub candidates: Vec<CandidateScore>,
}

/// Everything [`fit_route`] measured, serialisable for the results JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FitReport {
    /// `"src→dst"`.
    pub route: String,
    /// The options used.
    pub options: FitOptions,
    /// Training rows.
    pub n_train_rows: usize,
    /// Held-out rows.
    pub n_held_out_rows: usize,
    /// Per destination layer.
    pub layers: Vec<LayerFitReport>,
    /// K residual pooled over layers (`sqrt(Σ‖E‖² / Σ‖Y‖²)`).
    pub k: Residual,
    /// V residual pooled over layers.
    pub v: Residual,
    /// Wall time of the fit.
    pub elapsed_ms: f64,
}

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
mod tests {
    use super::*;
    use crate::transplant::project::project;
    use crate::transplant::ridge::{Affine, rel_rms};
    use crate::transplant::rope::RopeSpec;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use rand_distr::{Distribution, Normal};

    fn gauss(rows: usize, cols: usize, sd: f32, rng: &mut ChaCha8Rng) -> Array2<f32> {
        let d = Normal::new(0.0f32, sd).unwrap();
        Array2::from_shape_fn((rows, cols), |_| d.sample(rng))
    }

    fn binding(
        name: &str,
        n_layer: usize,
        n_kv_heads: usize,
        head_dim: usize,
        base: f32,
    ) -> RungBinding {
        RungBinding {
            name: name.into(),
            file: format!("{name}.gguf"),
            sha256: format!("{name}-sha"),
            n_layer,
            n_kv_heads,
            head_dim,
            rope: RopeSpec::neox(head_dim, base),
        }
    }

    /// Source layers whose latents drift with depth (neighbours are correlated, so the
    /// depth search has plausible wrong answers), full-rank, with per-channel offsets.
    fn source_layers(n_layer: usize, n: usize, d: usize, rng: &mut ChaCha8Rng) -> Vec<Array2<f32>> {
        let mut z = gauss(n, d, 1.0, rng);
        (0..n_layer)
            .map(|_| {
                z = &z * 0.7 + &gauss(n, d, 0.71, rng);
                let mix = gauss(d, d, 1.0 / (d as f32).sqrt(), rng);
                z.dot(&mix) + &z * 0.3 + gauss(1, d, 4.0, rng).row(0)
            })
            .collect()
    }

    struct Planted {
        samples: RouteSamples,
        /// Clean destination pre-RoPE K and V (no noise).
        clean: Vec<(Array2<f32>, Array2<f32>)>,
        depth: Vec<usize>,
    }

    /// Destination layer `j` = planted map of source layer `depth[j]` (+ noise), dense or
    /// per-head.
    fn planted(
        src: RungBinding,
        dst: RungBinding,
        depth: &[usize],
        per_head: bool,
        noise: f32,
        seed: u64,
    ) -> Planted {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = 3000;
        let src_k = source_layers(src.n_layer, n, src.kv_dim(), &mut rng);
        let src_v = source_layers(src.n_layer, n, src.kv_dim(), &mut rng);
        let plant = |x: &Array2<f32>, rng: &mut ChaCha8Rng| -> Array2<f32> {
            if per_head {
                let mut y = Array2::<f32>::zeros((n, dst.kv_dim()));
                for h in 0..dst.n_kv_heads {
                    let a = Affine {
                        w: gauss(
                            src.head_dim,
                            dst.head_dim,
                            1.0 / (src.head_dim as f32).sqrt(),
                            rng,
                        ),
                        b: gauss(1, dst.head_dim, 2.0, rng).row(0).to_owned(),
                    };
                    let g = h * src.n_kv_heads / dst.n_kv_heads;
                    let part = a
                        .apply(x.slice(ndarray::s![.., g * src.head_dim..(g + 1) * src.head_dim]))
                        .unwrap();
                    y.slice_mut(ndarray::s![.., h * dst.head_dim..(h + 1) * dst.head_dim])
                        .assign(&part);
                }
                y
            } else {
                let a = Affine {
                    w: gauss(
                        src.kv_dim(),
                        dst.kv_dim(),
                        1.0 / (src.kv_dim() as f32).sqrt(),
                        rng,
                    ),
                    b: gauss(1, dst.kv_dim(), 2.0, rng).row(0).to_owned(),
                };
                a.apply(x.view()).unwrap()
            }
        };
        let clean: Vec<(Array2<f32>, Array2<f32>)> = depth
            .iter()
            .map(|&s| (plant(&src_k[s], &mut rng), plant(&src_v[s], &mut rng)))
            .collect();
        let noisy = |m: &Array2<f32>, rng: &mut ChaCha8Rng| {
            let sd = (m.iter().map(|v| v * v).sum::<f32>() / m.len() as f32).sqrt();
            m + &gauss(m.nrows(), m.ncols(), noise * sd, rng)
        };
        let dst_layers = clean
            .iter()
            .map(|(k, v)| LayerActivations {
                k: noisy(k, &mut rng),
                v: noisy(v, &mut rng),
            })
            .collect();
        let (train, held_out) = split_windows(n, 50, 5).unwrap();
        Planted {
            samples: RouteSamples {
                src_layers: src_k
                    .into_iter()
                    .zip(src_v)
                    .map(|(k, v)| LayerActivations { k, v })
                    .collect(),
                src,
                dst,
                dst_layers,
                positions: (0..n as i32).collect(),
                train,
                held_out,
            },
            clean,
            depth: depth.to_vec(),
        }
    }

    /// 6 layers × 2 heads × 16 (base 1e4) → 4 layers × 2 heads × 8 (base 1e6): other head
    /// size and other angles, like 1.5B → 0.5B.
    fn size_route(per_head: bool, seed: u64) -> Planted {
        planted(
            binding("big", 6, 2, 16, 1e4),
            binding("small", 4, 2, 8, 1e6),
            // The proportional map is [0, 2, 3, 5]; layers 0 and 2 are planted off it.
            &[1, 2, 4, 5],
            per_head,
            0.01,
            seed,
        )
    }

    /// The source's cache as llama.cpp holds it: K rotated at the source's angles.
    fn src_cache(s: &RouteSamples) -> Vec<(Array2<f32>, Array2<f32>)> {
        s.src_layers
            .iter()
            .map(|l| {
                let mut k = l.k.clone();
                rotate(k.view_mut(), &s.positions, &s.src.rope, Direction::Rotate).unwrap();
                (k, l.v.clone())
            })
            .collect()
    }

    /// Relative RMS of a projected cache against the clean planted destination cache
    /// (rotated at the destination's angles) on the held-out rows.
    fn projected_error(p: &Projector, planted: &Planted) -> (f64, f64) {
        let s = &planted.samples;
        let cache = src_cache(s);
        let views: Vec<_> = cache.iter().map(|(k, v)| (k.view(), v.view())).collect();
        let (out, stats) = project(p, &views, &s.positions).unwrap();
        assert_eq!(stats.n_cells, s.n_rows());
        let idx: Vec<usize> = s.held_out.iter().flat_map(Clone::clone).collect();
        let (mut k_err, mut v_err) = ((0.0, 0.0), (0.0, 0.0));
        for ((k, v), (ck, cv)) in out.iter().zip(&planted.clean) {
            let mut want_k = ck.clone();
            rotate(
                want_k.view_mut(),
                &s.positions,
                &s.dst.rope,
                Direction::Rotate,
            )
            .unwrap();
            let e = sq_err(
                k.select(Axis(0), &idx).view(),
                want_k.select(Axis(0), &idx).view(),
            )
            .unwrap();
            k_err = (k_err.0 + e.0, k_err.1 + e.1);
            let e = sq_err(
                v.select(Axis(0), &idx).view(),
                cv.select(Axis(0), &idx).view(),
            )
            .unwrap();
            v_err = (v_err.0 + e.0, v_err.1 + e.1);
        }
        (ratio(k_err.0, k_err.1), ratio(v_err.0, v_err.1))
    }

    #[test]
    fn dense_fit_recovers_planted_route_and_projected_cache_matches() {
        let planted = size_route(false, 21);
        let (proj, report) = fit_route(&planted.samples, &FitOptions::size_route()).unwrap();
        let chosen: Vec<usize> = proj.layers.iter().map(|l| l.src_layers[0]).collect();
        assert_eq!(chosen, planted.depth, "depth remap");
        assert!(proj.layers.iter().all(|l| l.src_layers.len() == 1));
        // 1% noise on the targets: held-out residual sits at the noise floor.
        for l in &report.layers {
            assert!(
                l.k.held_out < 0.02 && l.v.held_out < 0.02,
                "layer {}: {:?} {:?}",
                l.dst_layer,
                l.k,
                l.v
            );
            assert!(l.k.held_out > 0.005, "cannot beat the 1% noise: {:?}", l.k);
            assert!(l.lambda_k.is_some());
        }
        assert!(report.k.held_out < 0.02 && report.v.held_out < 0.02);
        // The projected, re-rotated cache matches the destination's clean rotated cache.
        let (ek, ev) = projected_error(&proj, &planted);
        assert!(
            ek < 5e-3 && ev < 5e-3,
            "projected cache error K {ek} V {ev}"
        );
        // The report serialises.
        let json = serde_json::to_string(&report).unwrap();
        assert!(json.contains("\"held_out\""));
        let back: FitReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back.layers.len(), 4);
    }

    #[test]
    fn restore_spread_undoes_the_shrinkage_of_a_noisy_fit() {
        // Most of the destination's centred variance unpredictable: the ridge's prediction is narrower
        // than the target. Restoring the spread widens it back (to ~1 on the training rows,
        // so near 1 held out) at a bounded cost in squared error.
        let noisy = planted(
            binding("big", 6, 2, 16, 1e4),
            binding("small", 4, 2, 8, 1e6),
            &[1, 2, 4, 5],
            false,
            0.2,
            31,
        );
        let plain = FitOptions {
            depth: DepthPolicy::Uniform,
            ..FitOptions::size_route()
        };
        let (_, shrunk) = fit_route(&noisy.samples, &plain).unwrap();
        let (_, widened) = fit_route(
            &noisy.samples,
            &FitOptions {
                restore_spread: true,
                ..plain
            },
        )
        .unwrap();
        for (a, b) in shrunk.layers.iter().zip(&widened.layers) {
            let (sa, sb) = (a.v_spread.unwrap(), b.v_spread.unwrap());
            assert!(
                sa < 0.95,
                "layer {}: noisy fit not shrunk: {sa}",
                a.dst_layer
            );
            assert!(
                (sb - 1.0).abs() < 0.1,
                "layer {}: widened {sb} from {sa}",
                b.dst_layer
            );
            assert!(
                b.v.held_out >= a.v.held_out - 1e-9,
                "ridge is the MSE optimum"
            );
            assert!(b.v.held_out < 1.5 * a.v.held_out, "{:?} vs {:?}", b.v, a.v);
            assert!(b.v_centred_held_out.unwrap() > 0.0);
        }
    }

    #[test]
    fn rescaled_outputs_fold_into_the_map() {
        use ndarray::Array1;
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let n = Normal::new(0.0f32, 1.0).unwrap();
        let x = Array2::from_shape_fn((7, 3), |_| n.sample(&mut rng));
        let alpha = Array1::from(vec![1.0f32, 2.0, 0.5, 3.0]);
        let centre = Array1::from(vec![0.1f32, -0.2, 0.3, 1.0]);
        let expect = |m: &LayerMap| {
            let y = m.apply(x.view()).unwrap();
            Array2::from_shape_fn(y.dim(), |(r, c)| {
                centre[c] + alpha[c] * (y[(r, c)] - centre[c])
            })
        };
        let affine = LayerMap::Affine(Affine {
            w: Array2::from_shape_fn((3, 4), |_| n.sample(&mut rng)),
            b: Array1::from_shape_fn(4, |_| n.sample(&mut rng)),
        });
        let x4 = Array2::from_shape_fn((7, 4), |_| n.sample(&mut rng));
        let diagonal = LayerMap::Diagonal {
            scale: Array1::from_shape_fn(4, |_| n.sample(&mut rng)),
            offset: Array1::from_shape_fn(4, |_| n.sample(&mut rng)),
        };
        let want = expect(&affine);
        let mut m = affine;
        m.rescale_outputs(&alpha, &centre).unwrap();
        let got = m.apply(x.view()).unwrap();
        assert!((&got - &want).iter().all(|d| d.abs() < 1e-5));
        let y = diagonal.apply(x4.view()).unwrap();
        let mut d = diagonal;
        d.rescale_outputs(&alpha, &centre).unwrap();
        let got = d.apply(x4.view()).unwrap();
        for ((r, c), v) in got.indexed_iter() {
            let w = centre[c] + alpha[c] * (y[(r, c)] - centre[c]);
            assert!((v - w).abs() < 1e-5);
        }
        let mut id = LayerMap::Identity { dim: 4 };
        assert!(id.rescale_outputs(&alpha, &centre).is_err());
        assert!(
            m.rescale_outputs(&alpha.slice(ndarray::s![..3]).to_owned(), &centre)
                .is_err()
        );
    }

    #[test]
    fn depth_remap_prefers_planted_layer_over_neighbours() {
        let planted = size_route(false, 22);
        let (_, report) = fit_route(&planted.samples, &FitOptions::size_route()).unwrap();
        for (l, &want) in report.layers.iter().zip(&planted.depth) {
            let planted_score = l
                .candidates
                .iter()
                .find(|c| c.src_layers == vec![want])
                .expect("planted layer is a candidate");
            for c in l
                .candidates
                .iter()
                .filter(|c| !c.src_layers.contains(&want))
            {
                assert!(
                    c.k_held_out > 10.0 * planted_score.k_held_out,
                    "layer {}: neighbour {:?} K {} vs planted {}",
                    l.dst_layer,
                    c.src_layers,
                    c.k_held_out,
                    planted_score.k_held_out
                );
            }
        }
        // With the proportional map forced, the off-map layers are fitted badly.
        let uniform = FitOptions {
            depth: DepthPolicy::Uniform,
            ..FitOptions::size_route()
        };
        let (_, forced) = fit_route(&planted.samples, &uniform).unwrap();
        // (The planted offsets carry much of ‖Y‖, so the wrong layer's relative residual
        // is ~0.16 rather than ~0.7.)
        assert!(forced.layers[1].k.held_out < 0.02);
        assert!(
            forced.layers[0].k.held_out > 0.1
                && forced.layers[0].k.held_out > 5.0 * forced.layers[1].k.held_out,
            "{:?}",
            forced.layers[0].k
        );
    }

    #[test]
    fn no_sandwich_ablation_is_measurably_worse() {
        let planted = size_route(false, 23);
        let (with, rep_with) = fit_route(&planted.samples, &FitOptions::size_route()).unwrap();
        let opts = FitOptions {
            sandwich: false,
            ..FitOptions::size_route()
        };
        let (without, rep_without) = fit_route(&planted.samples, &opts).unwrap();
        assert!(!without.sandwich);
        assert!(
            rep_without.k.held_out > 0.15 && rep_without.k.held_out > 20.0 * rep_with.k.held_out,
            "no-sandwich K {} vs sandwich {}",
            rep_without.k.held_out,
            rep_with.k.held_out
        );
        // V never goes through RoPE: every candidate's V fit is the same either way (the
        // chosen depth may differ, since the broken K score takes part in the choice).
        for (a, b) in rep_with.layers.iter().zip(&rep_without.layers) {
            for (ca, cb) in a.candidates.iter().zip(&b.candidates) {
                assert_eq!(ca.src_layers, cb.src_layers);
                assert!((ca.v_held_out - cb.v_held_out).abs() < 1e-12);
            }
        }
        let (ek_with, _) = projected_error(&with, &planted);
        let (ek_without, _) = projected_error(&without, &planted);
        assert!(ek_without > 20.0 * ek_with, "{ek_without} vs {ek_with}");
    }

    #[test]
    fn truncate_baseline_is_far_worse_than_dense() {
        let planted = size_route(false, 24);
        let (trunc, rep) = fit_route(&planted.samples, &FitOptions::truncate_baseline()).unwrap();
        assert!(matches!(trunc.layers[0].k, LayerMap::Truncate { .. }));
        assert_eq!(
            trunc
                .layers
                .iter()
                .map(|l| l.src_layers[0])
                .collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        assert!(
            rep.k.held_out > 0.5 && rep.v.held_out > 0.5,
            "{:?} {:?}",
            rep.k,
            rep.v
        );
        assert!(rep.layers[0].lambda_k.is_none());
        let (ek, _) = projected_error(&trunc, &planted);
        assert!(ek > 0.5);
    }

    #[test]
    fn per_head_fit_recovers_block_map() {
        let planted = size_route(true, 25);
        let (proj, rep) = fit_route(&planted.samples, &FitOptions::per_head_route()).unwrap();
        assert_eq!(proj.kind, ProjectorKind::PerHead);
        let LayerMap::PerHead { blocks, .. } = &proj.layers[2].k else {
            panic!("per-head map expected");
        };
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[1].input_ranges, vec![(16, 32)]);
        let chosen: Vec<usize> = proj.layers.iter().map(|l| l.src_layers[0]).collect();
        assert_eq!(chosen, planted.depth);
        assert!(
            rep.k.held_out < 0.02 && rep.v.held_out < 0.02,
            "{:?} {:?}",
            rep.k,
            rep.v
        );
        let (ek, ev) = projected_error(&proj, &planted);
        assert!(ek < 5e-3 && ev < 5e-3, "{ek} {ev}");
        // Per-head has far fewer parameters than dense for the same route.
        let dense = fit_route(&planted.samples, &FitOptions::size_route())
            .unwrap()
            .0;
        assert!(proj.map_flops(100) < dense.map_flops(100) * 11 / 20);
    }

    #[test]
    fn precision_route_diagonal_recovers_scale_and_offset() {
        let b0 = binding("tier0", 4, 2, 16, 1e6);
        let mut b1 = b0.clone();
        b1.name = "tier1".into();
        b1.sha256 = "tier1-sha".into();
        let mut rng = ChaCha8Rng::seed_from_u64(26);
        let n = 2000;
        let src_k = source_layers(4, n, 32, &mut rng);
        let src_v = source_layers(4, n, 32, &mut rng);
        let scale: Vec<f32> = (0..32).map(|i| 0.9 + 0.2 * (i as f32 / 31.0)).collect();
        let offset: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.05).collect();
        let perturb = |x: &Array2<f32>| {
            Array2::from_shape_fn(x.dim(), |(r, c)| x[(r, c)] * scale[c] + offset[c])
        };
        let dst_layers: Vec<LayerActivations> = src_k
            .iter()
            .zip(&src_v)
            .map(|(k, v)| LayerActivations {
                k: perturb(k),
                v: perturb(v),
            })
            .collect();
        let clean: Vec<_> = dst_layers
            .iter()
            .map(|l| (l.k.clone(), l.v.clone()))
            .collect();
        let (train, held_out) = split_windows(n, 40, 4).unwrap();
        let samples = RouteSamples {
            src: b0,
            dst: b1,
            src_layers: src_k
                .into_iter()
                .zip(src_v)
                .map(|(k, v)| LayerActivations { k, v })
                .collect(),
            dst_layers,
            positions: (0..n as i32).collect(),
            train,
            held_out,
        };
        let (proj, rep) = fit_route(&samples, &FitOptions::precision_route()).unwrap();
        let LayerMap::Diagonal {
            scale: s,
            offset: o,
        } = &proj.layers[3].k
        else {
            panic!("diagonal map expected");
        };
        for c in 0..32 {
            assert!(
                (s[c] - scale[c]).abs() < 1e-4,
                "scale {c}: {} vs {}",
                s[c],
                scale[c]
            );
            assert!(
                (o[c] - offset[c]).abs() < 1e-3,
                "offset {c}: {} vs {}",
                o[c],
                offset[c]
            );
        }
        assert!(rep.k.held_out < 1e-4, "{:?}", rep.k);
        let planted = Planted {
            samples,
            clean,
            depth: vec![0, 1, 2, 3],
        };
        let (ek, ev) = projected_error(&proj, &planted);
        assert!(ek < 1e-4 && ev < 1e-4, "{ek} {ev}");
        // Identity between the two precisions is measurably worse than the diagonal fit.
        let identity = FitOptions {
            kind: ProjectorKind::Identity,
            ..FitOptions::precision_route()
        };
        let (_, rep_id) = fit_route(&planted.samples, &identity).unwrap();
        assert!(rep_id.k.held_out > 100.0 * rep.k.held_out);
    }

    #[test]
    fn fit_errors_are_typed() {
        let mut planted = size_route(false, 27);
        let diag = fit_route(&planted.samples, &FitOptions::precision_route());
        assert!(matches!(
            diag,
            Err(TransplantError::Unsupported {
                kind: "diagonal",
                ..
            })
        ));
        let empty = FitOptions {
            lambdas: vec![],
            ..FitOptions::size_route()
        };
        assert!(matches!(
            fit_route(&planted.samples, &empty),
            Err(TransplantError::InvalidLambda { .. })
        ));
        planted.samples.held_out.push(0..10);
        assert!(matches!(
            fit_route(&planted.samples, &FitOptions::size_route()),
            Err(TransplantError::TooFewRows { rows: 10, .. })
        ));
        planted.samples.held_out.pop();
        planted.samples.train.push(2990..3001);
        assert!(matches!(
            planted.samples.validate(),
            Err(TransplantError::RowsOutOfRange { end: 3001, .. })
        ));
        planted.samples.train.pop();
        planted.samples.dst_layers.pop();
        assert!(matches!(
            planted.samples.validate(),
            Err(TransplantError::ShapeMismatch { .. })
        ));
        assert!(split_windows(100, 50, 5).is_err());
        let (t, h) = split_windows(10, 3, 2).unwrap();
        assert_eq!(t, vec![0..3, 6..9]);
        assert_eq!(h, vec![3..6, 9..10]);
    }

    #[test]
    fn rel_rms_agrees_with_report() {
        // The report's held-out figure is the plain rel_rms of the chosen map.
        let planted = size_route(false, 28);
        let (proj, rep) = fit_route(&planted.samples, &FitOptions::size_route()).unwrap();
        let s = &planted.samples;
        let idx: Vec<usize> = s.held_out.iter().flat_map(Clone::clone).collect();
        let l = &proj.layers[1];
        let x = s.src_layers[l.src_layers[0]].k.select(Axis(0), &idx);
        let y = s.dst_layers[1].k.select(Axis(0), &idx);
        let r = rel_rms(l.k.apply(x.view()).unwrap().view(), y.view()).unwrap();
        assert!((r - rep.layers[1].k.held_out).abs() < 1e-12);
    }
}
