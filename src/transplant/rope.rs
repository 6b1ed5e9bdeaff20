//! Rotary position embedding exactly as ggml-cpu computes it.
//!
//! llama.cpp caches K *after* RoPE, so moving a cache between rungs whose head sizes or
//! angles differ needs the rotation undone at the source's angles and redone at the
//! destination's (the "RoPE sandwich"). [`rotate`] reproduces ggml-cpu's f32 arithmetic
//! (`ggml_rope_cache_init` + `rotate_pairs`, no YaRN, no frequency factors): θ is advanced
//! iteratively with `theta *= theta_scale`, `theta_scale = base^(-2/n_rot)`, and cos/sin are
//! taken in f32 of `freq_scale * theta`. Un-rotation is rotation with the sine negated, as
//! ggml's backward pass does, so a round trip at one position is exact up to f32 rounding.
//!
//! [`RopeSpec`] is the per-rung description; [`RopeKind`] picks the pairing
//! (NEOX for Qwen2: `(i, i + n_rot/2)`; NORM for llama: `(2i, 2i+1)`).

use ndarray::{ArrayView1, ArrayViewMut2, Zip};
use serde::{Deserialize, Serialize};

use super::error::TransplantError;

/// Which dimensions of a head form a rotation pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeKind {
    /// `GGML_ROPE_TYPE_NEOX` (Qwen2, Gemma 3): dimension `i` pairs with `i + n_rot/2`.
    Neox,
    /// `GGML_ROPE_TYPE_NORMAL` (llama): dimension `2i` pairs with `2i + 1`.
    Norm,
}

/// Whether [`rotate`] applies the rotation or undoes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Rotate by `+θ(pos)`, as the forward pass does before caching K.
    Rotate,
    /// Rotate by `-θ(pos)`, recovering pre-RoPE keys from cached ones.
    Unrotate,
}

/// One rung's RoPE parameters, as read from its GGUF metadata.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    /// Pairing style.
    pub kind: RopeKind,
    /// Size of one attention head.
    pub head_dim: usize,
    /// Leading dimensions of each head that are rotated (`rope.dimension_count`); the rest
    /// pass through untouched.
    pub n_rot: usize,
    /// `rope.freq_base` (1e6 for Qwen2.5).
    pub freq_base: f32,
    /// `1 / rope.scaling.factor` for linear scaling, 1.0 without scaling.
    pub freq_scale: f32,
}

impl RopeSpec {
    /// NEOX rotation over the whole head without frequency scaling (the Qwen2 case).
    #[must_use]
    pub fn neox(head_dim: usize, freq_base: f32) -> Self {
        Self {
            kind: RopeKind::Neox,
            head_dim,
            n_rot: head_dim,
            freq_base,
            freq_scale: 1.0,
        }
    }

    /// Check the spec is one ggml would run.
    ///
    /// # Errors
    /// [`TransplantError::InvalidRope`] if `head_dim` is zero, `n_rot` is zero, odd or larger
    /// than `head_dim`, or the base/scale are not finite and positive.
    pub fn validate(&self) -> Result<(), TransplantError> {
        let bad = |reason| TransplantError::InvalidRope {
            head_dim: self.head_dim,
            n_rot: self.n_rot,
            reason,
        };
        if self.head_dim == 0 {
            return Err(bad("head_dim is zero"));
        }
        if self.n_rot == 0 || !self.n_rot.is_multiple_of(2) {
            return Err(bad("n_rot must be positive and even"));
        }
        if self.n_rot > self.head_dim {
            return Err(bad("n_rot exceeds head_dim"));
        }
        if !(self.freq_base.is_finite() && self.freq_base > 0.0) {
            return Err(bad("freq_base must be finite and positive"));
        }
        if !(self.freq_scale.is_finite() && self.freq_scale > 0.0) {
            return Err(bad("freq_scale must be finite and positive"));
        }
        Ok(())
    }

    /// FLOPs of rotating `n_rows` rows of `n_heads` heads: 6 per rotated pair (4 mul, 2 add),
    /// ignoring the per-row cos/sin table.
    #[must_use]
    pub fn flops(&self, n_rows: usize, n_heads: usize) -> u64 {
        (n_rows * n_heads * (self.n_rot / 2) * 6) as u64
    }
}

/// Below this many elements the rayon split costs more than it saves.
const PAR_MIN_ELEMS: usize = 16 * 1024;

/// Rotate (or un-rotate) keys in place.
///
/// `k` is `[n_cells][n_heads * head_dim]`, one row per cache cell, rotated at
/// `positions[row]`. Rows are processed in parallel with rayon when the matrix is large.
///
/// # Errors
/// [`TransplantError::InvalidRope`] for an invalid spec, [`TransplantError::ShapeMismatch`]
/// if `positions.len()` differs from the row count, [`TransplantError::NotMultiple`] if the
/// row width is not a positive multiple of `head_dim`.
pub fn rotate(
    k: ArrayViewMut2<'_, f32>,
    positions: &[i32],
    spec: &RopeSpec,
    dir: Direction,
) -> Result<(), TransplantError> {
    RopeTable::new(spec, positions)?.turn(k, dir)
}

/// The rotation of every position of a cache, computed once: `ggml_rope_cache_init`'s cos and
/// sin pairs per position, for a caller that turns many rows at the same positions — every
/// layer of a cache, both ways. Computed again for every row turned, at a precision switch of
/// ~1,200 cells that was ~4 M sines and cosines (28 layers, un-rotated and rotated), most of
/// the in-place projection's 50-65 ms. Un-rotating uses the negated sines, to the bit what
/// ggml's cache with a sign of −1 holds (the probe's routine, the tests' oracle).
pub struct RopeTable {
    spec: RopeSpec,
    cache: Vec<f32>,
}

impl RopeTable {
    /// The table of `positions` under `spec`.
    ///
    /// # Errors
    /// [`TransplantError`] when `spec` does not validate.
    pub fn new(spec: &RopeSpec, positions: &[i32]) -> Result<Self, TransplantError> {
        spec.validate()?;
        let theta_scale = spec.freq_base.powf(-2.0f32 / spec.n_rot as f32);
        let mut cache = vec![0f32; positions.len() * spec.n_rot];
        for (c, &p) in cache.chunks_exact_mut(spec.n_rot).zip(positions) {
            fill_cache(c, p, spec.freq_scale, theta_scale);
        }
        Ok(Self { spec: *spec, cache })
    }

    /// Turns `rows` — `[cell][width]` laid flat, the cells at the table's positions from
    /// `first` on — as [`rotate`] does at those positions under the table's spec.
    ///
    /// # Errors
    /// [`TransplantError`] when `width` is not a whole number of heads, or the rows run past
    /// the table's positions.
    pub fn apply(
        &self,
        rows: &mut [f32],
        width: usize,
        first: usize,
        dir: Direction,
    ) -> Result<(), TransplantError> {
        let (spec, n_rot) = (&self.spec, self.spec.n_rot);
        check_width(width, spec)?;
        let cells = rows.len() / width;
        let have = self.cache.len() / n_rot;
        if first + cells > have {
            return Err(TransplantError::ShapeMismatch {
                what: "rope positions vs rows",
                expected: first + cells,
                actual: have,
            });
        }
        self.turn_rows(rows, width, first, dir);
        Ok(())
    }

    /// [`RopeTable::apply`] without its checks (the caller made them).
    fn turn_rows(&self, rows: &mut [f32], width: usize, first: usize, dir: Direction) {
        let (spec, n_rot) = (&self.spec, self.spec.n_rot);
        let mut negated = vec![0f32; n_rot];
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let c = &self.cache[(first + i) * n_rot..(first + i + 1) * n_rot];
            match dir {
                Direction::Rotate => rotate_row(row, c, spec),
                Direction::Unrotate => {
                    for (d, s) in negated.chunks_exact_mut(2).zip(c.chunks_exact(2)) {
                        d[0] = s[0];
                        d[1] = -s[1];
                    }
                    rotate_row(row, &negated, spec);
                }
            }
        }
    }
}

impl RopeTable {
    /// Turns `k` — `[n_cells][n_heads * head_dim]`, row `i` at the table's position `i` — in
    /// place; rows in parallel with rayon when the matrix is large.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] if the table's positions are not one per row,
    /// [`TransplantError::NotMultiple`] if the row width is not a positive multiple of
    /// `head_dim`.
    pub fn turn(
        &self,
        mut k: ArrayViewMut2<'_, f32>,
        dir: Direction,
    ) -> Result<(), TransplantError> {
        let have = self.cache.len() / self.spec.n_rot;
        if have != k.nrows() {
            return Err(TransplantError::ShapeMismatch {
                what: "rope positions vs rows",
                expected: k.nrows(),
                actual: have,
            });
        }
        let width = k.ncols();
        check_width(width, &self.spec)?;
        let job = |mut row: ndarray::ArrayViewMut1<'_, f32>, &i: &usize| {
            if let Some(s) = row.as_slice_mut() {
                self.turn_rows(s, width, i, dir);
            } else {
                // Strided view (e.g. a column-major array): turn a contiguous copy.
                let mut buf = row.to_vec();
                self.turn_rows(&mut buf, width, i, dir);
                row.assign(&ArrayView1::from(&buf[..]));
            }
        };
        let parallel = k.len() >= PAR_MIN_ELEMS;
        let index = ndarray::Array1::from_iter(0..k.nrows());
        let zip = Zip::from(k.rows_mut()).and(&index);
        if parallel {
            zip.par_for_each(job);
        } else {
            zip.for_each(job);
        }
        Ok(())
    }
}

/// `width` is a positive whole number of `spec`'s heads.
fn check_width(width: usize, spec: &RopeSpec) -> Result<(), TransplantError> {
    if width == 0 || !width.is_multiple_of(spec.head_dim) {
        return Err(TransplantError::NotMultiple {
            what: "rope row width",
            width,
            unit: spec.head_dim,
        });
    }
    Ok(())
}

/// `ggml_rope_cache_init` for one position, rotating: `cache[2i] = cos`, `cache[2i+1] = sin`
/// (un-rotating negates the sines, [`RopeTable::apply`]).
fn fill_cache(cache: &mut [f32], pos: i32, freq_scale: f32, theta_scale: f32) {
    let mut theta = pos as f32;
    for pair in cache.chunks_exact_mut(2) {
        let t = freq_scale * theta;
        pair[0] = t.cos();
        pair[1] = t.sin();
        theta *= theta_scale;
    }
}

/// ggml's `rotate_pairs` over every head of one row.
fn rotate_row(row: &mut [f32], cache: &[f32], spec: &RopeSpec) {
    let half = spec.n_rot / 2;
    for head in row.chunks_exact_mut(spec.head_dim) {
        for i in 0..half {
            let (a, b) = match spec.kind {
                RopeKind::Neox => (i, i + half),
                RopeKind::Norm => (2 * i, 2 * i + 1),
            };
            let (co, si) = (cache[2 * i], cache[2 * i + 1]);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * co - x1 * si;
            head[b] = x0 * si + x1 * co;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, ShapeBuilder};
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    #[test]
    fn a_table_turns_rows_as_rotate_does_to_the_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for kind in [RopeKind::Neox, RopeKind::Norm] {
            let spec = RopeSpec {
                kind,
                head_dim: 8,
                n_rot: 8,
                freq_base: 10_000.0,
                freq_scale: 1.0,
            };
            let positions: Vec<i32> = (0..37).map(|i| i * 13 + 2).collect();
            let width = 16;
            let data: Vec<f32> = (0..positions.len() * width)
                .map(|_| rng.random_range(-3.0f32..3.0))
                .collect();
            let table = RopeTable::new(&spec, &positions).unwrap();
            for dir in [Direction::Rotate, Direction::Unrotate] {
                let mut want =
                    Array2::from_shape_vec((positions.len(), width), data.clone()).unwrap();
                rotate(want.view_mut(), &positions, &spec, dir).unwrap();
                // In two chunks, as the in-place projection turns them.
                let mut got = data.clone();
                let (a, b) = got.split_at_mut(10 * width);
                table.apply(a, width, 0, dir).unwrap();
                table.apply(b, width, 10, dir).unwrap();
                let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "{kind:?} {dir:?}");
            }
            let mut past = vec![0f32; width];
            assert!(
                table
                    .apply(&mut past, width, positions.len(), Direction::Rotate)
                    .is_err()
            );
        }
    }

    /// The probe's verified routine (shared/probe/rope.rs), kept verbatim as the oracle.
    #[allow(clippy::too_many_arguments)]
    fn probe_apply(
        data: &mut [f32],
        n_embd: usize,
        head_dim: usize,
        n_rot: usize,
        pos: &[i32],
        freq_base: f32,
        freq_scale: f32,
        kind: RopeKind,
        sign: f32,
    ) {
        let n_cells = pos.len();
        assert_eq!(data.len(), n_cells * n_embd);
        let theta_scale = freq_base.powf(-2.0f32 / n_rot as f32);
        let mut cs = vec![0f32; n_rot];
        for c in 0..n_cells {
            let mut theta = pos[c] as f32;
            for i0 in (0..n_rot).step_by(2) {
                let t = freq_scale * theta;
                cs[i0] = t.cos();
                cs[i0 + 1] = t.sin() * sign;
                theta *= theta_scale;
            }
            let row = &mut data[c * n_embd..(c + 1) * n_embd];
            for h in 0..n_embd / head_dim {
                let x = &mut row[h * head_dim..(h + 1) * head_dim];
                for i0 in (0..n_rot).step_by(2) {
                    let (a, b) = match kind {
                        RopeKind::Norm => (i0, i0 + 1),
                        RopeKind::Neox => (i0 / 2, i0 / 2 + n_rot / 2),
                    };
                    let (co, si) = (cs[i0], cs[i0 + 1]);
                    let (x0, x1) = (x[a], x[b]);
                    x[a] = x0 * co - x1 * si;
                    x[b] = x0 * si + x1 * co;
                }
            }
        }
    }

    fn random(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Array2::from_shape_fn((rows, cols), |_| rng.random_range(-3.0f32..3.0))
    }

    fn rel_diff(a: &Array2<f32>, b: &Array2<f32>) -> f32 {
        let num: f32 = (a - b).iter().map(|d| d * d).sum::<f32>().sqrt();
        let den: f32 = b.iter().map(|d| d * d).sum::<f32>().sqrt();
        num / den
    }

    #[test]
    fn matches_probe_bit_for_bit() {
        for (kind, head_dim, n_rot) in [
            (RopeKind::Neox, 64, 64),
            (RopeKind::Norm, 64, 64),
            (RopeKind::Neox, 128, 96),
        ] {
            let spec = RopeSpec {
                kind,
                head_dim,
                n_rot,
                freq_base: 1e6,
                freq_scale: 1.0,
            };
            let positions: Vec<i32> = (0..300).map(|i| i * 7 - 3).collect();
            // Large enough to take the parallel path.
            let mut ours = random(positions.len(), 2 * head_dim, 1);
            let mut probe = ours.clone();
            rotate(ours.view_mut(), &positions, &spec, Direction::Rotate).unwrap();
            let slice = probe.as_slice_mut().unwrap();
            probe_apply(
                slice,
                2 * head_dim,
                head_dim,
                n_rot,
                &positions,
                1e6,
                1.0,
                kind,
                1.0,
            );
            assert_eq!(ours, probe, "{kind:?} {head_dim} {n_rot}");
        }
    }

    #[test]
    fn unrotate_inverts_rotate() {
        let spec = RopeSpec::neox(128, 1e6);
        let positions: Vec<i32> = (0..512).collect();
        let orig = random(512, 256, 2);
        let mut k = orig.clone();
        rotate(k.view_mut(), &positions, &spec, Direction::Rotate).unwrap();
        assert!(rel_diff(&k, &orig) > 0.1, "rotation must move the keys");
        rotate(k.view_mut(), &positions, &spec, Direction::Unrotate).unwrap();
        assert!(rel_diff(&k, &orig) < 1e-5);
    }

    #[test]
    fn strided_view_matches_contiguous() {
        let spec = RopeSpec::neox(16, 1e4);
        let positions: Vec<i32> = (0..9).map(|i| i * 11).collect();
        let c = random(9, 32, 3);
        let mut f = Array2::<f32>::zeros((9, 32).f());
        f.assign(&c);
        let mut c = c;
        rotate(c.view_mut(), &positions, &spec, Direction::Rotate).unwrap();
        rotate(f.view_mut(), &positions, &spec, Direction::Rotate).unwrap();
        assert_eq!(c, f);
    }

    #[test]
    fn neox_and_norm_pair_the_documented_dimensions() {
        let n = 16;
        let p = 5;
        let theta_scale = 1e4f32.powf(-2.0 / n as f32);
        for kind in [RopeKind::Neox, RopeKind::Norm] {
            let spec = RopeSpec {
                kind,
                head_dim: n,
                n_rot: n,
                freq_base: 1e4,
                freq_scale: 1.0,
            };
            for i in 0..n / 2 {
                let (a, b) = match kind {
                    RopeKind::Neox => (i, i + n / 2),
                    RopeKind::Norm => (2 * i, 2 * i + 1),
                };
                let mut k = Array2::<f32>::zeros((1, n));
                k[(0, a)] = 1.0;
                rotate(k.view_mut(), &[p], &spec, Direction::Rotate).unwrap();
                let theta = p as f32 * theta_scale.powi(i as i32);
                for d in 0..n {
                    let want = if d == a {
                        theta.cos()
                    } else if d == b {
                        theta.sin()
                    } else {
                        0.0
                    };
                    assert!(
                        (k[(0, d)] - want).abs() < 1e-5,
                        "{kind:?} pair {i}: dim {d} = {} want {want}",
                        k[(0, d)]
                    );
                }
            }
        }
    }

    #[test]
    fn partial_rotation_leaves_tail_untouched() {
        let spec = RopeSpec {
            kind: RopeKind::Neox,
            head_dim: 32,
            n_rot: 20,
            freq_base: 1e6,
            freq_scale: 1.0,
        };
        let orig = random(10, 64, 4);
        let mut k = orig.clone();
        let positions: Vec<i32> = (1..=10).collect();
        rotate(k.view_mut(), &positions, &spec, Direction::Rotate).unwrap();
        for h in 0..2 {
            for d in 20..32 {
                for r in 0..10 {
                    assert_eq!(
                        k[(r, h * 32 + d)].to_bits(),
                        orig[(r, h * 32 + d)].to_bits()
                    );
                }
            }
            // The rotated part did move.
            let moved = (0..10).any(|r| (k[(r, h * 32)] - orig[(r, h * 32)]).abs() > 1e-3);
            assert!(moved);
        }
    }

    #[test]
    fn freq_scale_scales_the_angle() {
        let mut scaled = RopeSpec::neox(8, 1e4);
        scaled.freq_scale = 0.5;
        let plain = RopeSpec::neox(8, 1e4);
        let orig = random(1, 8, 5);
        let mut a = orig.clone();
        let mut b = orig.clone();
        rotate(a.view_mut(), &[40], &scaled, Direction::Rotate).unwrap();
        rotate(b.view_mut(), &[20], &plain, Direction::Rotate).unwrap();
        assert!(rel_diff(&a, &b) < 1e-6);
    }

    #[test]
    fn errors_not_panics() {
        let spec = RopeSpec::neox(8, 1e4);
        let mut k = Array2::<f32>::zeros((3, 16));
        assert!(matches!(
            rotate(k.view_mut(), &[0, 1], &spec, Direction::Rotate),
            Err(TransplantError::ShapeMismatch {
                expected: 3,
                actual: 2,
                ..
            })
        ));
        let mut k12 = Array2::<f32>::zeros((2, 12));
        assert!(matches!(
            rotate(k12.view_mut(), &[0, 1], &spec, Direction::Rotate),
            Err(TransplantError::NotMultiple {
                width: 12,
                unit: 8,
                ..
            })
        ));
        for (hd, nr) in [(8, 7), (8, 10), (0, 0), (8, 0)] {
            let bad = RopeSpec {
                head_dim: hd,
                n_rot: nr,
                ..spec
            };
            assert!(matches!(
                rotate(k.view_mut(), &[0, 1, 2], &bad, Direction::Rotate),
                Err(TransplantError::InvalidRope { .. })
            ));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn rotations_compose(p in -200i32..2000, q in -200i32..2000, seed in 0u64..1000, neox in any::<bool>()) {
            let spec = RopeSpec {
                kind: if neox { RopeKind::Neox } else { RopeKind::Norm },
                head_dim: 64,
                n_rot: 64,
                freq_base: 1e6,
                freq_scale: 1.0,
            };
            let orig = random(1, 128, seed);
            let mut two_steps = orig.clone();
            rotate(two_steps.view_mut(), &[p], &spec, Direction::Rotate).unwrap();
            rotate(two_steps.view_mut(), &[q], &spec, Direction::Rotate).unwrap();
            let mut one_step = orig.clone();
            rotate(one_step.view_mut(), &[p + q], &spec, Direction::Rotate).unwrap();
            // f32 angles near 4000 rad carry ~2e-4 rad of rounding each.
            prop_assert!(rel_diff(&two_steps, &one_step) < 2e-3);
            // And p then -p is the identity.
            let mut back = orig.clone();
            rotate(back.view_mut(), &[p], &spec, Direction::Rotate).unwrap();
            rotate(back.view_mut(), &[p], &spec, Direction::Unrotate).unwrap();
            prop_assert!(rel_diff(&back, &orig) < 1e-5);
        }
    }
}
