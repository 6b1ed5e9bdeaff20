//! Applying a [`Projector`] to a whole KV cache, and the depth-remap helpers.
//!
//! [`project`] is the hot path of a migration: for every destination layer, in parallel,
//! it gathers the source layer(s) chosen by the depth remap, un-rotates K at the source's
//! RoPE angles (when the projector is sandwiched), applies the K map, re-rotates at the
//! destination's angles, and maps V plainly. Each source layer is un-rotated once even when
//! several destination layers read it. Destination positions equal source positions.
//! [`ProjectStats`] reports FLOPs and wall time, the switch-cost metric set against
//! re-prefill.
//!
//! [`uniform_depth_map`] and [`depth_remap_candidates`] give the proportional layer
//! correspondence and its neighbours, from which fitting picks per layer by held-out
//! residual. [`identity_projector`] maps a rung onto itself through the sandwich, the
//! losslessness control.

use std::time::Instant;

use ndarray::{Array2, ArrayView2, Axis};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::error::TransplantError;
use super::map::LayerMap;
use super::projector::{LayerProjection, Projector, ProjectorKind, RungBinding};
use super::rope::{Direction, RopeTable};

/// Cost of one [`project`] call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProjectStats {
    /// Cache cells projected.
    pub n_cells: usize,
    /// FLOPs of the K and V maps (see [`LayerMap::flops`]).
    pub map_flops: u64,
    /// FLOPs of the un-rotations and re-rotations (6 per rotated pair).
    pub rope_flops: u64,
    /// Wall time un-rotating the source layers.
    pub unrotate_ms: f64,
    /// Wall time per destination layer (map + re-rotation), measured inside the parallel
    /// loop, so they overlap and do not add up to `total_ms`.
    pub per_layer_ms: Vec<f64>,
    /// Wall time of the whole call.
    pub total_ms: f64,
}

impl ProjectStats {
    /// Map plus RoPE FLOPs.
    #[must_use]
    pub fn flops(&self) -> u64 {
        self.map_flops + self.rope_flops
    }
}

/// One layer's projected cache: `(K, V)`, each `[n_cells][dst kv_dim]` (a bare pair; the
/// KV mirror's [`crate::kv::LayerKv`] adds the storage types it is written with).
pub type KvPair = (Array2<f32>, Array2<f32>);

/// Project a source cache onto the destination rung.
///
/// `src_layers[l]` is source layer `l`'s `(K, V)`, each `[n_cells][src kv_dim]`, K as
/// cached (rotated); `positions[c]` is cell `c`'s position. Returns one `(K, V)` per
/// destination layer, K rotated at the destination's angles (when sandwiched) at the same
/// positions.
///
/// # Errors
/// [`TransplantError::ShapeMismatch`] if the layer count, a layer's shape or the position
/// count disagrees with the projector; the projector's own validation errors.
pub fn project(
    projector: &Projector,
    src_layers: &[(ArrayView2<'_, f32>, ArrayView2<'_, f32>)],
    positions: &[i32],
) -> Result<(Vec<KvPair>, ProjectStats), TransplantError> {
    let t0 = Instant::now();
    projector.validate()?;
    let src = &projector.src;
    let dst = &projector.dst;
    if src_layers.len() != src.n_layer {
        return Err(TransplantError::ShapeMismatch {
            what: "source layers given vs source n_layer",
            expected: src.n_layer,
            actual: src_layers.len(),
        });
    }
    let n_cells = positions.len();
    for (k, v) in src_layers {
        for (what, m) in [
            ("source K rows vs positions", k),
            ("source V rows vs positions", v),
        ] {
            if m.nrows() != n_cells {
                return Err(TransplantError::ShapeMismatch {
                    what,
                    expected: n_cells,
                    actual: m.nrows(),
                });
            }
        }
        for (what, m) in [("source K width", k), ("source V width", v)] {
            if m.ncols() != src.kv_dim() {
                return Err(TransplantError::ShapeMismatch {
                    what,
                    expected: src.kv_dim(),
                    actual: m.ncols(),
                });
            }
        }
    }

    let mut needed = vec![false; src.n_layer];
    for l in &projector.layers {
        for &s in &l.src_layers {
            needed[s] = true;
        }
    }
    let t_unrot = Instant::now();
    // Each rung's rotation of these positions, computed once for every layer it turns.
    let tables = if projector.sandwich {
        Some((
            RopeTable::new(&src.rope, positions)?,
            RopeTable::new(&dst.rope, positions)?,
        ))
    } else {
        None
    };
    let unrotated: Vec<Option<Array2<f32>>> = if let Some((src_table, _)) = &tables {
        (0..src.n_layer)
            .into_par_iter()
            .map(|s| {
                if !needed[s] {
                    return Ok(None);
                }
                let mut k = src_layers[s].0.to_owned();
                src_table.turn(k.view_mut(), Direction::Unrotate)?;
                Ok(Some(k))
            })
            .collect::<Result<_, TransplantError>>()?
    } else {
        vec![None; src.n_layer]
    };
    let unrotate_ms = ms(t_unrot);

    let results: Vec<(Array2<f32>, Array2<f32>, f64)> = projector
        .layers
        .par_iter()
        .map(|lp| {
            let t = Instant::now();
            let k_in: Vec<ArrayView2<'_, f32>> = lp
                .src_layers
                .iter()
                .map(|&s| unrotated[s].as_ref().map_or(src_layers[s].0, |k| k.view()))
                .collect();
            let mut k = apply_gathered(&lp.k, &k_in)?;
            if let Some((_, dst_table)) = &tables {
                dst_table.turn(k.view_mut(), Direction::Rotate)?;
            }
            let v_in: Vec<ArrayView2<'_, f32>> =
                lp.src_layers.iter().map(|&s| src_layers[s].1).collect();
            let v = apply_gathered(&lp.v, &v_in)?;
            Ok((k, v, ms(t)))
        })
        .collect::<Result<_, TransplantError>>()?;

    let rope_flops = if projector.sandwich {
        let n_src_used = needed.iter().filter(|&&n| n).count();
        src.rope.flops(n_cells, src.n_kv_heads) * n_src_used as u64
            + dst.rope.flops(n_cells, dst.n_kv_heads) * dst.n_layer as u64
    } else {
        0
    };
    let mut per_layer_ms = Vec::with_capacity(results.len());
    let mut out = Vec::with_capacity(results.len());
    for (k, v, t) in results {
        per_layer_ms.push(t);
        out.push((k, v));
    }
    let stats = ProjectStats {
        n_cells,
        map_flops: projector.map_flops(n_cells),
        rope_flops,
        unrotate_ms,
        per_layer_ms,
        total_ms: ms(t0),
    };
    Ok((out, stats))
}

/// Apply `map` to the column-wise concatenation of `inputs` (no copy for one input).
///
/// # Errors
/// The map's shape errors.
pub fn apply_gathered(
    map: &LayerMap,
    inputs: &[ArrayView2<'_, f32>],
) -> Result<Array2<f32>, TransplantError> {
    match inputs {
        [one] => map.apply(*one),
        many => {
            let joined = ndarray::concatenate(Axis(1), many).map_err(|_| {
                TransplantError::ShapeMismatch {
                    what: "rows of concatenated source layers",
                    expected: many.first().map_or(0, ArrayView2::nrows),
                    actual: many.iter().map(ArrayView2::nrows).max().unwrap_or(0),
                }
            })?;
            map.apply(joined.view())
        }
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The proportional depth map: destination layer `j` ← source layer
/// `round(j (n_src − 1) / (n_dst − 1))` (first to first, last to last). A one-layer
/// destination reads source layer 0. Empty if either count is zero.
#[must_use]
pub fn uniform_depth_map(n_src: usize, n_dst: usize) -> Vec<usize> {
    if n_src == 0 || n_dst == 0 {
        return Vec::new();
    }
    if n_dst == 1 {
        return vec![0];
    }
    (0..n_dst)
        .map(|j| (2 * j * (n_src - 1) + (n_dst - 1)) / (2 * (n_dst - 1)))
        .collect()
}

/// How widely to search the depth remap around the proportional map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DepthSearch {
    /// Single source layers within this distance of the proportional one are candidates.
    pub radius: usize,
    /// Also offer the two source layers bracketing the exact fractional position,
    /// concatenated, when it falls between layers.
    pub bracketing_pairs: bool,
}

impl Default for DepthSearch {
    fn default() -> Self {
        Self {
            radius: 1,
            bracketing_pairs: true,
        }
    }
}

/// Candidate source-layer sets for every destination layer: the proportional layer first,
/// then its neighbours by distance (clipped to `0..n_src`), then the bracketing pair if
/// asked for. Each inner `Vec<usize>` is one candidate set.
#[must_use]
pub fn depth_remap_candidates(
    n_src: usize,
    n_dst: usize,
    search: DepthSearch,
) -> Vec<Vec<Vec<usize>>> {
    let uniform = uniform_depth_map(n_src, n_dst);
    uniform
        .iter()
        .enumerate()
        .map(|(j, &p)| {
            let mut c = vec![vec![p]];
            for d in 1..=search.radius {
                if p >= d {
                    c.push(vec![p - d]);
                }
                if p + d < n_src {
                    c.push(vec![p + d]);
                }
            }
            if search.bracketing_pairs && n_dst > 1 {
                let num = j * (n_src - 1);
                let (lo, hi) = (num / (n_dst - 1), num.div_ceil(n_dst - 1));
                if lo != hi {
                    c.push(vec![lo, hi]);
                }
            }
            c
        })
        .collect()
}

/// The sandwich with identity maps from a rung onto itself: un-rotate, copy, re-rotate.
/// Lossless up to f32 rounding; the control for the whole projection path.
#[must_use]
pub fn identity_projector(binding: &RungBinding) -> Projector {
    let dim = binding.kv_dim();
    Projector {
        src: binding.clone(),
        dst: binding.clone(),
        kind: ProjectorKind::Identity,
        sandwich: true,
        layers: (0..binding.n_layer)
            .map(|j| LayerProjection {
                src_layers: vec![j],
                k: LayerMap::Identity { dim },
                v: LayerMap::Identity { dim },
                fit: None,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transplant::ridge::Affine;
    use crate::transplant::rope::{RopeSpec, rotate};
    use ndarray::Array1;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn binding(n_layer: usize, n_kv_heads: usize, head_dim: usize, base: f32) -> RungBinding {
        RungBinding {
            name: format!("r{head_dim}"),
            file: format!("r{head_dim}.gguf"),
            sha256: "00".into(),
            n_layer,
            n_kv_heads,
            head_dim,
            rope: RopeSpec::neox(head_dim, base),
        }
    }

    fn random(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Array2<f32> {
        Array2::from_shape_fn((rows, cols), |_| rng.random_range(-20.0f32..20.0))
    }

    #[test]
    fn identity_sandwich_is_lossless() {
        let b = binding(4, 2, 64, 1e6);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let positions: Vec<i32> = (0..300).map(|i| i * 3 + 1).collect();
        let cache: Vec<(Array2<f32>, Array2<f32>)> = (0..4)
            .map(|_| (random(300, 128, &mut rng), random(300, 128, &mut rng)))
            .collect();
        let views: Vec<_> = cache.iter().map(|(k, v)| (k.view(), v.view())).collect();
        let (out, stats) = project(&identity_projector(&b), &views, &positions).unwrap();
        assert_eq!(out.len(), 4);
        for ((k, v), (k0, v0)) in out.iter().zip(&cache) {
            assert_eq!(v, v0, "V must pass through bit-exact");
            // Un-rotate + re-rotate at the same angles: a few ulp of |k| (~20).
            let err = (k - k0).iter().fold(0f32, |m, d| m.max(d.abs()));
            assert!(err < 2e-5 * 20.0, "max |dK| {err}");
            assert!(err > 0.0 || k == k0);
        }
        assert_eq!(stats.map_flops, 0);
        assert_eq!(stats.rope_flops, 2 * 4 * (300 * 2 * 32 * 6));
        assert_eq!(stats.per_layer_ms.len(), 4);
    }

    #[test]
    fn without_sandwich_keys_are_not_rotated() {
        let b = binding(2, 1, 8, 1e4);
        let mut p = identity_projector(&b);
        p.sandwich = false;
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let cache: Vec<_> = (0..2)
            .map(|_| (random(5, 8, &mut rng), random(5, 8, &mut rng)))
            .collect();
        let views: Vec<_> = cache.iter().map(|(k, v)| (k.view(), v.view())).collect();
        let (out, stats) = project(&p, &views, &[10, 20, 30, 40, 50]).unwrap();
        assert_eq!(out[1].0, cache[1].0);
        assert_eq!(stats.rope_flops, 0);
    }

    #[test]
    fn concatenated_sources_and_rerotation_at_destination_angles() {
        // Destination layer 0 = K0 + K1 of the source in pre-RoPE space, at another head size.
        let src = binding(2, 1, 8, 1e4);
        let dst = binding(1, 2, 4, 1e6);
        let mut w = Array2::<f32>::zeros((16, 8));
        for i in 0..8 {
            w[(i, i)] = 1.0;
            w[(8 + i, i)] = 1.0;
        }
        let affine = Affine {
            w,
            b: Array1::from_elem(8, 0.5),
        };
        let proj = Projector {
            src: src.clone(),
            dst: dst.clone(),
            kind: ProjectorKind::Dense,
            sandwich: true,
            layers: vec![LayerProjection {
                src_layers: vec![0, 1],
                k: LayerMap::Affine(affine.clone()),
                v: LayerMap::Affine(affine),
                fit: None,
            }],
        };
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let positions = [0, 5, 900];
        let pre: Vec<Array2<f32>> = (0..2).map(|_| random(3, 8, &mut rng)).collect();
        let vals: Vec<Array2<f32>> = (0..2).map(|_| random(3, 8, &mut rng)).collect();
        let rotated: Vec<Array2<f32>> = pre
            .iter()
            .map(|k| {
                let mut k = k.clone();
                rotate(k.view_mut(), &positions, &src.rope, Direction::Rotate).unwrap();
                k
            })
            .collect();
        let views: Vec<_> = rotated
            .iter()
            .zip(&vals)
            .map(|(k, v)| (k.view(), v.view()))
            .collect();
        let (out, stats) = project(&proj, &views, &positions).unwrap();
        let mut want_k = &pre[0] + &pre[1] + 0.5;
        rotate(want_k.view_mut(), &positions, &dst.rope, Direction::Rotate).unwrap();
        let want_v = &vals[0] + &vals[1] + 0.5;
        let ek = (&out[0].0 - &want_k)
            .iter()
            .fold(0f32, |m, d| m.max(d.abs()));
        let ev = (&out[0].1 - &want_v)
            .iter()
            .fold(0f32, |m, d| m.max(d.abs()));
        assert!(ek < 1e-4 && ev < 1e-5, "{ek} {ev}");
        assert_eq!(stats.map_flops, 2 * 3 * 8 * (2 * 16 + 1));
    }

    #[test]
    fn shape_errors() {
        let b = binding(2, 1, 8, 1e4);
        let p = identity_projector(&b);
        let k = Array2::<f32>::zeros((3, 8));
        let one = [(k.view(), k.view())];
        assert!(matches!(
            project(&p, &one, &[0, 1, 2]),
            Err(TransplantError::ShapeMismatch {
                expected: 2,
                actual: 1,
                ..
            })
        ));
        let two = [(k.view(), k.view()), (k.view(), k.view())];
        assert!(matches!(
            project(&p, &two, &[0, 1]),
            Err(TransplantError::ShapeMismatch { .. })
        ));
        let wide = Array2::<f32>::zeros((3, 16));
        let bad = [(k.view(), k.view()), (wide.view(), k.view())];
        assert!(matches!(
            project(&p, &bad, &[0, 1, 2]),
            Err(TransplantError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn uniform_map_and_candidates() {
        let u = uniform_depth_map(28, 24);
        assert_eq!(u.len(), 24);
        assert_eq!((u[0], u[23]), (0, 27));
        assert!(u.windows(2).all(|w| w[1] > w[0]));
        assert_eq!(u[12], (12 * 27 * 2 + 23) / 46); // round(14.09) = 14
        assert_eq!(u[12], 14);
        assert_eq!(uniform_depth_map(28, 28), (0..28).collect::<Vec<_>>());
        assert_eq!(uniform_depth_map(5, 1), vec![0]);
        let c = depth_remap_candidates(28, 24, DepthSearch::default());
        assert_eq!(c[0], vec![vec![0], vec![1]]);
        assert_eq!(c[23], vec![vec![27], vec![26]]);
        // j = 12: exact position 14.09 → 14, neighbours 13, 15, bracketing pair 14+15.
        assert_eq!(c[12], vec![vec![14], vec![13], vec![15], vec![14, 15]]);
        let same = depth_remap_candidates(
            28,
            28,
            DepthSearch {
                radius: 0,
                bracketing_pairs: true,
            },
        );
        assert!(same.iter().enumerate().all(|(j, c)| c == &vec![vec![j]]));
    }
}
