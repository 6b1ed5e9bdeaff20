//! Closed-form ridge regression for the KV maps.
//!
//! A destination layer's pre-RoPE keys (or values) are fitted as an affine function of the
//! source's: `Ŷ = X W + b`. The solve is `W = (XcᵀXc + λI)⁻¹ XcᵀYc` on *centred* data and
//! `b = ȳ − x̄ W`: fitting the bias column by centring is exactly the augmented-ones-column
//! ridge with the bias left unregularised (the choice made here — shrinking the bias would
//! pull every prediction toward zero, and K/V carry large per-channel offsets from Qwen2's
//! k/v bias). The moments are accumulated in f64 (`XᵀX` of a few thousand rows of K with
//! offsets in the tens loses digits in f32) and solved by Cholesky in `faer`.
//!
//! Main types: [`Affine`] (a fitted map), [`NormalEquations`] (the f64 sufficient statistics,
//! reusable across a λ grid and sub-selectable for per-head blocks), [`RidgeFit`] (the result
//! of choosing λ on held-out rows) and [`DiagonalFit`] (per-channel scale + offset for the
//! precision route).

use std::ops::Range;

use faer::linalg::solvers::{Llt, Solve};
use faer::{Accum, Mat, MatRef, Par, Side};
use ndarray::{Array1, Array2, ArrayView2, Axis};
use serde::{Deserialize, Serialize};

use super::error::TransplantError;
use super::map::{HeadBlock, per_head_layout};

/// An affine map `y = x W + b` from `d_in` to `d_out` features.
#[derive(Clone, Debug, PartialEq)]
pub struct Affine {
    /// Weights, `[d_in][d_out]`.
    pub w: Array2<f32>,
    /// Bias, `[d_out]`.
    pub b: Array1<f32>,
}

impl Affine {
    /// The identity map on `dim` features (zero bias).
    #[must_use]
    pub fn identity(dim: usize) -> Self {
        Self {
            w: Array2::eye(dim),
            b: Array1::zeros(dim),
        }
    }

    /// Input width.
    #[must_use]
    pub fn d_in(&self) -> usize {
        self.w.nrows()
    }

    /// Output width.
    #[must_use]
    pub fn d_out(&self) -> usize {
        self.w.ncols()
    }

    /// Apply to rows of `x` (`[n][d_in]`), giving `[n][d_out]`.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] if `x` is not `d_in` wide or `b` is not `d_out` long.
    pub fn apply(&self, x: ArrayView2<'_, f32>) -> Result<Array2<f32>, TransplantError> {
        self.check()?;
        if x.ncols() != self.d_in() {
            return Err(TransplantError::ShapeMismatch {
                what: "affine input width",
                expected: self.d_in(),
                actual: x.ncols(),
            });
        }
        let mut out = x.dot(&self.w);
        out += &self.b;
        Ok(out)
    }

    /// Check `b` matches `w`.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] if `b.len() != w.ncols()`.
    pub fn check(&self) -> Result<(), TransplantError> {
        if self.b.len() == self.d_out() {
            Ok(())
        } else {
            Err(TransplantError::ShapeMismatch {
                what: "affine bias length",
                expected: self.d_out(),
                actual: self.b.len(),
            })
        }
    }

    /// FLOPs of applying to `n_rows` rows: 2 per multiply-add plus 1 per bias add.
    #[must_use]
    pub fn flops(&self, n_rows: usize) -> u64 {
        (n_rows * self.d_out() * (2 * self.d_in() + 1)) as u64
    }
}

/// Relative RMS error `‖Ŷ − Y‖_F / ‖Y‖_F`, accumulated in f64.
///
/// A zero target gives 0 for a zero prediction and infinity otherwise.
///
/// # Errors
/// [`TransplantError::ShapeMismatch`] if the shapes differ.
pub fn rel_rms(
    pred: ArrayView2<'_, f32>,
    target: ArrayView2<'_, f32>,
) -> Result<f64, TransplantError> {
    let (num, den) = sq_err(pred, target)?;
    Ok(ratio(num, den))
}

/// `(‖Ŷ − Y‖², ‖Y‖²)` in f64, for pooling residuals across layers.
///
/// # Errors
/// [`TransplantError::ShapeMismatch`] if the shapes differ.
pub fn sq_err(
    pred: ArrayView2<'_, f32>,
    target: ArrayView2<'_, f32>,
) -> Result<(f64, f64), TransplantError> {
    for (what, e, a) in [
        ("rel_rms rows", target.nrows(), pred.nrows()),
        ("rel_rms cols", target.ncols(), pred.ncols()),
    ] {
        if e != a {
            return Err(TransplantError::ShapeMismatch {
                what,
                expected: e,
                actual: a,
            });
        }
    }
    let mut num = 0f64;
    let mut den = 0f64;
    ndarray::Zip::from(pred).and(target).for_each(|&p, &t| {
        let d = f64::from(p) - f64::from(t);
        num += d * d;
        den += f64::from(t) * f64::from(t);
    });
    Ok((num, den))
}

/// `sqrt(num / den)` with the zero-target convention of [`rel_rms`].
#[must_use]
pub fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        (num / den).sqrt()
    } else if num > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// Centred f64 sufficient statistics of a regression `Y ~ X`.
///
/// Building them costs `O(n d_in (d_in + d_out))`; solving for one λ costs only a
/// `d_in³/3` Cholesky, so a λ grid reuses one instance.
#[derive(Clone, Debug)]
pub struct NormalEquations {
    n: usize,
    mean_x: Vec<f64>,
    mean_y: Vec<f64>,
    /// `XcᵀXc`, `[d_in][d_in]`.
    xtx: Mat<f64>,
    /// `XcᵀYc`, `[d_in][d_out]`.
    xty: Mat<f64>,
}

/// Copy rows of an f32 array into a column-major f64 faer matrix (all rows if `rows` is empty
/// is *not* implied: pass `0..n`).
pub(crate) fn to_f64(x: ArrayView2<'_, f32>, rows: &[Range<usize>]) -> Mat<f64> {
    let idx: Vec<usize> = rows.iter().flat_map(Clone::clone).collect();
    Mat::from_fn(idx.len(), x.ncols(), |i, j| f64::from(x[(idx[i], j)]))
}

/// Column sums of a faer matrix.
pub(crate) fn col_sums(x: MatRef<'_, f64>) -> Vec<f64> {
    (0..x.ncols())
        .map(|j| (0..x.nrows()).map(|i| x[(i, j)]).sum())
        .collect()
}

/// `aᵀ b` in f64 with faer's parallel matmul.
pub(crate) fn at_b(a: MatRef<'_, f64>, b: MatRef<'_, f64>) -> Mat<f64> {
    let mut out = Mat::<f64>::zeros(a.ncols(), b.ncols());
    faer::linalg::matmul::matmul(
        out.as_mut(),
        Accum::Replace,
        a.transpose(),
        b,
        1.0,
        Par::rayon(0),
    );
    out
}

impl NormalEquations {
    /// Accumulate from paired rows of `x` (`[n][d_in]`) and `y` (`[n][d_out]`).
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] if the row counts differ,
    /// [`TransplantError::TooFewRows`] for fewer than 2 rows,
    /// [`TransplantError::NonFinite`] if either input holds NaN or infinity.
    pub fn from_data(
        x: ArrayView2<'_, f32>,
        y: ArrayView2<'_, f32>,
    ) -> Result<Self, TransplantError> {
        check_pair(x, y)?;
        #[allow(clippy::single_range_in_vec_init)] // one range of rows, not a range of values
        let all = [0..x.nrows()];
        let xf = to_f64(x, &all);
        let yf = to_f64(y, &all);
        Ok(Self::from_raw(
            x.nrows(),
            &col_sums(xf.as_ref()),
            &col_sums(yf.as_ref()),
            at_b(xf.as_ref(), xf.as_ref()),
            at_b(xf.as_ref(), yf.as_ref()),
        ))
    }

    /// Build from raw (uncentred) moments: `Σx`, `Σy`, `XᵀX`, `XᵀY` over `n` rows.
    ///
    /// Centring afterwards (`XᵀX − n x̄x̄ᵀ`) in f64 keeps ~1e-10 relative accuracy even when
    /// channel means are a thousand times their spread, which K with bias never reaches.
    pub(crate) fn from_raw(
        n: usize,
        sum_x: &[f64],
        sum_y: &[f64],
        mut xtx: Mat<f64>,
        mut xty: Mat<f64>,
    ) -> Self {
        let nf = n as f64;
        let mean_x: Vec<f64> = sum_x.iter().map(|s| s / nf).collect();
        let mean_y: Vec<f64> = sum_y.iter().map(|s| s / nf).collect();
        for j in 0..xtx.ncols() {
            for i in 0..xtx.nrows() {
                xtx[(i, j)] -= nf * mean_x[i] * mean_x[j];
            }
        }
        for j in 0..xty.ncols() {
            for i in 0..xty.nrows() {
                xty[(i, j)] -= nf * mean_x[i] * mean_y[j];
            }
        }
        Self {
            n,
            mean_x,
            mean_y,
            xtx,
            xty,
        }
    }

    /// Rows the moments were accumulated over.
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.n
    }

    /// Input width.
    #[must_use]
    pub fn d_in(&self) -> usize {
        self.mean_x.len()
    }

    /// Output width.
    #[must_use]
    pub fn d_out(&self) -> usize {
        self.mean_y.len()
    }

    /// Mean centred sum of squares per input feature, `tr(XcᵀXc) / d_in`: the natural unit
    /// for a λ grid that should not depend on the keys' magnitude.
    #[must_use]
    pub fn feature_scale(&self) -> f64 {
        let d = self.d_in().max(1);
        (0..self.d_in()).map(|i| self.xtx[(i, i)]).sum::<f64>() / d as f64
    }

    /// The sub-problem on input columns `in_cols` and output columns `out_cols` (a per-head
    /// block), without touching the data again.
    #[must_use]
    pub fn select(&self, in_cols: &[usize], out_cols: &[usize]) -> Self {
        Self {
            n: self.n,
            mean_x: in_cols.iter().map(|&i| self.mean_x[i]).collect(),
            mean_y: out_cols.iter().map(|&j| self.mean_y[j]).collect(),
            xtx: Mat::from_fn(in_cols.len(), in_cols.len(), |a, b| {
                self.xtx[(in_cols[a], in_cols[b])]
            }),
            xty: Mat::from_fn(in_cols.len(), out_cols.len(), |a, b| {
                self.xty[(in_cols[a], out_cols[b])]
            }),
        }
    }

    /// Solve for one λ (absolute, in the units of `XcᵀXc`).
    ///
    /// # Errors
    /// [`TransplantError::InvalidLambda`] for a negative or non-finite λ,
    /// [`TransplantError::NotPositiveDefinite`] if Cholesky fails (λ = 0 on rank-deficient
    /// data).
    pub fn solve(&self, lambda: f64) -> Result<Affine, TransplantError> {
        check_lambda(lambda)?;
        let d = self.d_in();
        let mut a = self.xtx.clone();
        for i in 0..d {
            a[(i, i)] += lambda;
        }
        let llt = Llt::new(a.as_ref(), Side::Lower).map_err(|e| match e {
            faer::linalg::solvers::LltError::NonPositivePivot { index } => {
                TransplantError::NotPositiveDefinite {
                    lambda,
                    pivot: index,
                }
            }
        })?;
        let mut w = self.xty.clone();
        llt.solve_in_place(w.as_mut());
        if (0..w.ncols()).any(|j| (0..w.nrows()).any(|i| !w[(i, j)].is_finite())) {
            return Err(TransplantError::NotPositiveDefinite { lambda, pivot: d });
        }
        let b = Array1::from_shape_fn(self.d_out(), |j| {
            let dot: f64 = (0..d).map(|i| self.mean_x[i] * w[(i, j)]).sum();
            (self.mean_y[j] - dot) as f32
        });
        let w = Array2::from_shape_fn((d, self.d_out()), |(i, j)| w[(i, j)] as f32);
        Ok(Affine { w, b })
    }
}

fn check_lambda(lambda: f64) -> Result<(), TransplantError> {
    if lambda.is_finite() && lambda >= 0.0 {
        Ok(())
    } else {
        Err(TransplantError::InvalidLambda {
            reason: "lambda must be finite and non-negative",
        })
    }
}

fn check_pair(x: ArrayView2<'_, f32>, y: ArrayView2<'_, f32>) -> Result<(), TransplantError> {
    if x.nrows() != y.nrows() {
        return Err(TransplantError::ShapeMismatch {
            what: "ridge rows of x vs y",
            expected: x.nrows(),
            actual: y.nrows(),
        });
    }
    if x.nrows() < 2 {
        return Err(TransplantError::TooFewRows {
            what: "ridge training set",
            rows: x.nrows(),
            needed: 2,
        });
    }
    if !x.iter().all(|v| v.is_finite()) {
        return Err(TransplantError::NonFinite { what: "ridge x" });
    }
    if !y.iter().all(|v| v.is_finite()) {
        return Err(TransplantError::NonFinite { what: "ridge y" });
    }
    Ok(())
}

/// Fit `y ≈ x W + b` by ridge with an unregularised bias.
///
/// # Errors
/// As [`NormalEquations::from_data`] and [`NormalEquations::solve`].
pub fn fit(
    x: ArrayView2<'_, f32>,
    y: ArrayView2<'_, f32>,
    lambda: f64,
) -> Result<Affine, TransplantError> {
    NormalEquations::from_data(x, y)?.solve(lambda)
}

/// A ridge map with λ chosen on held-out rows.
#[derive(Clone, Debug)]
pub struct RidgeFit {
    /// The map at the chosen λ.
    pub affine: Affine,
    /// The chosen λ (absolute).
    pub lambda: f64,
    /// Relative RMS on the training rows.
    pub train_rel_rms: f64,
    /// Relative RMS on the held-out rows (what λ was chosen by).
    pub val_rel_rms: f64,
}

/// Fit on `(x_train, y_train)` for every λ in `lambdas` and keep the one with the lowest
/// held-out relative RMS on `(x_val, y_val)`; ties go to the larger λ. A λ whose solve fails
/// (λ = 0 on rank-deficient data) is skipped.
///
/// # Errors
/// [`TransplantError::InvalidLambda`] for an empty grid or a bad λ, shape errors as
/// [`fit`], and the last solve error if every λ failed.
pub fn fit_select_lambda(
    x_train: ArrayView2<'_, f32>,
    y_train: ArrayView2<'_, f32>,
    x_val: ArrayView2<'_, f32>,
    y_val: ArrayView2<'_, f32>,
    lambdas: &[f64],
) -> Result<RidgeFit, TransplantError> {
    let ne = NormalEquations::from_data(x_train, y_train)?;
    let (affine, lambda, val_rel_rms) = select_lambda(
        lambdas,
        |l| ne.solve(l),
        |a| rel_rms(a.apply(x_val)?.view(), y_val),
    )?;
    let train_rel_rms = rel_rms(affine.apply(x_train)?.view(), y_train)?;
    Ok(RidgeFit {
        affine,
        lambda,
        train_rel_rms,
        val_rel_rms,
    })
}

/// Shared λ search: `solve(λ)` then `score(&map)`, keep the lowest score (ties → larger λ).
pub(crate) fn select_lambda<M>(
    lambdas: &[f64],
    mut solve: impl FnMut(f64) -> Result<M, TransplantError>,
    mut score: impl FnMut(&M) -> Result<f64, TransplantError>,
) -> Result<(M, f64, f64), TransplantError> {
    if lambdas.is_empty() {
        return Err(TransplantError::InvalidLambda {
            reason: "empty lambda grid",
        });
    }
    let mut best: Option<(M, f64, f64)> = None;
    let mut last_err = None;
    for &lambda in lambdas {
        check_lambda(lambda)?;
        let map = match solve(lambda) {
            Ok(m) => m,
            Err(e @ TransplantError::NotPositiveDefinite { .. }) => {
                last_err = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        let s = score(&map)?;
        let better = match &best {
            None => true,
            Some((_, bl, bs)) => s < *bs || (s == *bs && lambda > *bl),
        };
        if better && s.is_finite() {
            best = Some((map, lambda, s));
        }
    }
    best.ok_or_else(|| {
        last_err.unwrap_or(TransplantError::InvalidLambda {
            reason: "no lambda gave a finite held-out score",
        })
    })
}

/// A per-channel map `y_j = scale_j x_j + offset_j`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiagonalFit {
    /// Per-channel scale.
    pub scale: Vec<f32>,
    /// Per-channel offset.
    pub offset: Vec<f32>,
}

/// Fit a per-channel scale and offset (the precision route: same geometry, different
/// quantisation). The ridge penalty shrinks each scale toward **1** rather than 0,
/// `s_j = (Σxy_c + λ) / (Σx²_c + λ)`, because the prior for two precisions of the same
/// weights is the identity; the offset is unregularised. A constant channel gets scale 1.
///
/// # Errors
/// [`TransplantError::ShapeMismatch`] unless `x` and `y` have the same shape,
/// [`TransplantError::TooFewRows`] for fewer than 2 rows, [`TransplantError::NonFinite`],
/// [`TransplantError::InvalidLambda`].
pub fn fit_diagonal(
    x: ArrayView2<'_, f32>,
    y: ArrayView2<'_, f32>,
    lambda: f64,
) -> Result<DiagonalFit, TransplantError> {
    check_lambda(lambda)?;
    check_pair(x, y)?;
    if x.ncols() != y.ncols() {
        return Err(TransplantError::ShapeMismatch {
            what: "diagonal map needs d_in == d_out",
            expected: x.ncols(),
            actual: y.ncols(),
        });
    }
    let n = x.nrows() as f64;
    let mut scale = Vec::with_capacity(x.ncols());
    let mut offset = Vec::with_capacity(x.ncols());
    for (xc, yc) in x.axis_iter(Axis(1)).zip(y.axis_iter(Axis(1))) {
        let mx = xc.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let my = yc.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let (mut sxx, mut sxy) = (0f64, 0f64);
        for (&a, &b) in xc.iter().zip(yc.iter()) {
            let (a, b) = (f64::from(a) - mx, f64::from(b) - my);
            sxx += a * a;
            sxy += a * b;
        }
        let den = sxx + lambda;
        let s = if den > 0.0 { (sxy + lambda) / den } else { 1.0 };
        scale.push(s as f32);
        offset.push((my - s * mx) as f32);
    }
    Ok(DiagonalFit { scale, offset })
}

/// Fit a block-diagonal (per-head) map.
///
/// `x` is one or more source layers side by side, each `n_heads_in * head_dim_in` wide;
/// `y` is `n_heads_out * head_dim_out` wide. Output head `h` is fitted from the input heads
/// whose share of the head axis overlaps `h`'s (see [`per_head_layout`]): with equal counts
/// that is input head `h` alone; 4 → 2 gives heads `{2h, 2h+1}`; 2 → 4 gives head `h/2`.
/// With several source layers, block `h` takes those heads from every layer. Each block gets
/// its own bias; one λ is shared by all blocks.
///
/// # Errors
/// [`TransplantError::NotMultiple`] if the widths do not split into heads, plus the errors
/// of [`NormalEquations`].
#[allow(clippy::too_many_arguments)]
pub fn fit_per_head(
    x: ArrayView2<'_, f32>,
    y: ArrayView2<'_, f32>,
    n_heads_in: usize,
    n_heads_out: usize,
    head_dim_in: usize,
    head_dim_out: usize,
    lambda: f64,
) -> Result<Vec<HeadBlock>, TransplantError> {
    let ne = NormalEquations::from_data(x, y)?;
    fit_per_head_from(
        &ne,
        n_heads_in,
        n_heads_out,
        head_dim_in,
        head_dim_out,
        lambda,
    )
}

/// [`fit_per_head`] from already accumulated moments (the λ-grid path).
///
/// # Errors
/// As [`fit_per_head`].
pub fn fit_per_head_from(
    ne: &NormalEquations,
    n_heads_in: usize,
    n_heads_out: usize,
    head_dim_in: usize,
    head_dim_out: usize,
    lambda: f64,
) -> Result<Vec<HeadBlock>, TransplantError> {
    let layout = per_head_layout(
        ne.d_in(),
        n_heads_in,
        head_dim_in,
        n_heads_out,
        head_dim_out,
    )?;
    if layout.out_dim() != ne.d_out() {
        return Err(TransplantError::ShapeMismatch {
            what: "per-head output width",
            expected: layout.out_dim(),
            actual: ne.d_out(),
        });
    }
    layout
        .blocks
        .iter()
        .map(|spec| {
            let in_cols: Vec<usize> = spec.input_ranges.iter().flat_map(|&(a, b)| a..b).collect();
            let out_cols: Vec<usize> =
                (spec.output_offset..spec.output_offset + spec.output_len).collect();
            let affine = ne.select(&in_cols, &out_cols).solve(lambda)?;
            Ok(HeadBlock {
                input_ranges: spec.input_ranges.clone(),
                output_offset: spec.output_offset,
                affine,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transplant::map::LayerMap;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use rand_distr::{Distribution, Normal};
    use std::time::Instant;

    fn gauss(rows: usize, cols: usize, sd: f32, rng: &mut ChaCha8Rng) -> Array2<f32> {
        let d = Normal::new(0.0f32, sd).unwrap();
        Array2::from_shape_fn((rows, cols), |_| d.sample(rng))
    }

    /// Correlated inputs with per-channel offsets, like real K.
    fn inputs(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Array2<f32> {
        let base = gauss(rows, cols, 1.0, rng);
        let mix = gauss(cols, cols, 1.0 / (cols as f32).sqrt(), rng);
        let off = gauss(1, cols, 5.0, rng);
        base.dot(&mix) + &base * 0.5 + off.row(0)
    }

    fn planted(d_in: usize, d_out: usize, rng: &mut ChaCha8Rng) -> Affine {
        Affine {
            w: gauss(d_in, d_out, 1.0 / (d_in as f32).sqrt(), rng),
            b: gauss(1, d_out, 3.0, rng).row(0).to_owned(),
        }
    }

    fn max_rel(a: &Array2<f32>, b: &Array2<f32>) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        (a - b).iter().fold(0f32, |m, v| m.max(v.abs())) / scale
    }

    #[test]
    fn recovers_planted_affine_noise_free() {
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        let x = inputs(600, 40, &mut rng);
        let truth = planted(40, 24, &mut rng);
        let y = truth.apply(x.view()).unwrap();
        let got = fit(x.view(), y.view(), 0.0).unwrap();
        assert!(
            max_rel(&got.w, &truth.w) < 1e-4,
            "w err {}",
            max_rel(&got.w, &truth.w)
        );
        let b_err = (&got.b - &truth.b).iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(b_err < 1e-3, "bias err {b_err}");
        let pred = got.apply(x.view()).unwrap();
        assert!(rel_rms(pred.view(), y.view()).unwrap() < 1e-5);
    }

    #[test]
    fn bias_is_not_shrunk() {
        // A huge λ kills W but the bias still lands on the mean of y.
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let x = inputs(300, 8, &mut rng);
        let y = gauss(300, 3, 1.0, &mut rng) + 40.0;
        let got = fit(x.view(), y.view(), 1e12).unwrap();
        let mean = y.mean_axis(Axis(0)).unwrap();
        for j in 0..3 {
            assert!(
                (got.b[j] - mean[j]).abs() < 1e-3,
                "{} vs {}",
                got.b[j],
                mean[j]
            );
        }
        assert!(got.w.iter().all(|w| w.abs() < 1e-6));
    }

    #[test]
    fn noisy_fit_is_close_and_selection_generalises() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let truth = planted(32, 16, &mut rng);
        let x = inputs(3000, 32, &mut rng);
        let clean = truth.apply(x.view()).unwrap();
        let noise = gauss(3000, 16, 0.05, &mut rng);
        let y = &clean + &noise;
        let got = fit(x.view(), y.view(), 1e-3).unwrap();
        let pred = got.apply(x.view()).unwrap();
        let err = rel_rms(pred.view(), clean.view()).unwrap();
        assert!(err < 5e-3, "error vs clean {err}");
    }

    #[test]
    fn lambda_grows_when_training_is_tiny_and_noisy() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let d_in = 48;
        let truth = planted(d_in, 8, &mut rng);
        let grid: Vec<f64> = (-6..=6).map(|e| 10f64.powi(e)).collect();
        let make = |n: usize, noise: f32, rng: &mut ChaCha8Rng| {
            let x = inputs(n, d_in, rng);
            let y = truth.apply(x.view()).unwrap() + gauss(n, 8, noise, rng);
            (x, y)
        };
        let (xv, yv) = make(2000, 0.0, &mut rng);
        let (xl, yl) = make(4000, 0.01, &mut rng);
        let (xs, ys) = make(60, 3.0, &mut rng);
        let large = fit_select_lambda(xl.view(), yl.view(), xv.view(), yv.view(), &grid).unwrap();
        let small = fit_select_lambda(xs.view(), ys.view(), xv.view(), yv.view(), &grid).unwrap();
        assert!(
            small.lambda > 100.0 * large.lambda,
            "tiny/noisy chose {} vs large/clean {}",
            small.lambda,
            large.lambda
        );
        // The tiny fit overfits: training residual well under held-out.
        assert!(small.train_rel_rms < small.val_rel_rms);
        assert!(large.val_rel_rms < 0.01);
    }

    #[test]
    fn diagonal_recovers_planted_scale_offset() {
        let mut rng = ChaCha8Rng::seed_from_u64(14);
        let x = inputs(500, 16, &mut rng);
        let scale: Vec<f32> = (0..16).map(|i| 0.5 + i as f32 * 0.1).collect();
        let offset: Vec<f32> = (0..16).map(|i| i as f32 - 8.0).collect();
        let y = Array2::from_shape_fn((500, 16), |(r, c)| x[(r, c)] * scale[c] + offset[c]);
        let got = fit_diagonal(x.view(), y.view(), 0.0).unwrap();
        for c in 0..16 {
            assert!((got.scale[c] - scale[c]).abs() < 1e-5, "scale {c}");
            assert!((got.offset[c] - offset[c]).abs() < 1e-3, "offset {c}");
        }
        // λ shrinks toward 1, not 0.
        let shrunk = fit_diagonal(x.view(), y.view(), 1e12).unwrap();
        assert!(shrunk.scale.iter().all(|s| (s - 1.0).abs() < 1e-3));
        assert!(matches!(
            fit_diagonal(x.view(), y.slice(ndarray::s![.., ..8]), 0.0),
            Err(TransplantError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn per_head_recovers_block_map_and_ignores_other_heads() {
        let mut rng = ChaCha8Rng::seed_from_u64(15);
        // 2 heads of 16 → 2 heads of 8; block h only sees head h.
        let x = inputs(800, 32, &mut rng);
        let blocks: Vec<Affine> = (0..2).map(|_| planted(16, 8, &mut rng)).collect();
        let mut y = Array2::<f32>::zeros((800, 16));
        for (h, a) in blocks.iter().enumerate() {
            let part = a
                .apply(x.slice(ndarray::s![.., h * 16..(h + 1) * 16]))
                .unwrap();
            y.slice_mut(ndarray::s![.., h * 8..(h + 1) * 8])
                .assign(&part);
        }
        let got = fit_per_head(x.view(), y.view(), 2, 2, 16, 8, 0.0).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].input_ranges, vec![(16, 32)]);
        assert_eq!(got[1].output_offset, 8);
        for h in 0..2 {
            assert!(max_rel(&got[h].affine.w, &blocks[h].w) < 1e-4);
        }
        let map = LayerMap::PerHead {
            in_dim: 32,
            out_dim: 16,
            blocks: got,
        };
        let pred = map.apply(x.view()).unwrap();
        assert!(rel_rms(pred.view(), y.view()).unwrap() < 1e-5);
    }

    #[test]
    fn errors_are_typed() {
        let x = Array2::<f32>::zeros((5, 3));
        let y = Array2::<f32>::zeros((4, 2));
        assert!(matches!(
            fit(x.view(), y.view(), 1.0),
            Err(TransplantError::ShapeMismatch { .. })
        ));
        let y = Array2::<f32>::zeros((5, 2));
        assert!(matches!(
            fit(x.view(), y.view(), -1.0),
            Err(TransplantError::InvalidLambda { .. })
        ));
        // All-zero x with λ = 0 is singular.
        assert!(matches!(
            fit(x.view(), y.view(), 0.0),
            Err(TransplantError::NotPositiveDefinite { .. })
        ));
        let mut bad = x.clone();
        bad[(0, 0)] = f32::NAN;
        assert!(matches!(
            fit(bad.view(), y.view(), 1.0),
            Err(TransplantError::NonFinite { .. })
        ));
        assert!(matches!(
            fit_select_lambda(x.view(), y.view(), x.view(), y.view(), &[]),
            Err(TransplantError::InvalidLambda { .. })
        ));
        assert!(matches!(
            fit_per_head(x.view(), y.view(), 2, 2, 2, 1, 1.0),
            Err(TransplantError::NotMultiple { .. })
        ));
    }

    #[test]
    fn fit_5000x257_to_128_is_fast() {
        let mut rng = ChaCha8Rng::seed_from_u64(16);
        let x = inputs(5000, 256, &mut rng);
        let y = gauss(5000, 128, 1.0, &mut rng);
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            let a = fit(x.view(), y.view(), 1.0).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            assert_eq!(a.w.dim(), (256, 128));
        }
        eprintln!("fit 5000x257->128: {:.1} ms", best * 1e3);
        // The unoptimised debug build is an order of magnitude slower; the bound is for release.
        let limit = if cfg!(debug_assertions) { 10.0 } else { 1.0 };
        assert!(best < limit, "{best} s");
    }
}
