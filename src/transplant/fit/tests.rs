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
    let perturb =
        |x: &Array2<f32>| Array2::from_shape_fn(x.dim(), |(r, c)| x[(r, c)] * scale[c] + offset[c]);
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
