//! Selective top-k recompute on real llama.cpp execution.
//!
//! The partial forward (a rung's last k blocks, cut into a model of their own and fed hidden
//! states as input embeddings) must reproduce the rung's own cache for those blocks when it is
//! fed the rung's own hidden state at the boundary: on the tiny ladder (F16 and Q8_0 weights)
//! and, in CI, on the real tier2. A control feeds the wrong layer's state and must miss by far,
//! or the equality could not fail. A top-k switch mid-answer must keep decoding sensibly.

mod common;

use molt::engine::{Context, ContextConfig, Model, ModelOptions, PartialForward};
use molt::kv::{KvSnapshot, ParseOptions};
use molt::ladder::RungInfo;
use ndarray::Array2;

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns. fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); }";

/// Per-layer K and V (post-RoPE, as cached) of an exported blob, rows in position order.
fn layers_of(blob: &[u8]) -> Vec<(Array2<f32>, Array2<f32>)> {
    let snap = KvSnapshot::parse(blob, ParseOptions::default()).unwrap();
    let stream = snap.single_stream().unwrap();
    let pos = stream.positions();
    assert!(
        pos.windows(2).all(|w| w[1] == w[0] + 1),
        "fresh sequences keep cells in position order"
    );
    stream
        .layers
        .iter()
        .map(|l| (l.k.clone(), l.v.clone()))
        .collect()
}

fn max_abs(a: &Array2<f32>, b: &Array2<f32>) -> f32 {
    assert_eq!(a.shape(), b.shape());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_mag(a: &Array2<f32>) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Worst |Δ| over the last k layers' K and V between the rung's native cache and the partial
/// forward fed `boundary`, relative to the largest cached magnitude; and the worst absolute.
fn recompute_error(
    info: &RungInfo,
    native: &[(Array2<f32>, Array2<f32>)],
    boundary: &Array2<f32>,
    k: usize,
) -> (f32, f32) {
    let n_layer = native.len();
    let mut pf =
        PartialForward::open(&info.path, &info.sha256, n_layer, k, common::cfg_topk()).unwrap();
    assert_eq!(pf.first_layer(), n_layer - k);
    let positions: Vec<i32> = (0..i32::try_from(boundary.nrows()).unwrap()).collect();
    let blob = pf.run(boundary.view(), &positions).unwrap();
    let got = layers_of(&blob);
    assert_eq!(got.len(), k, "the cut model has k layers");
    let (mut rel, mut abs) = (0.0f32, 0.0f32);
    for (i, (k_got, v_got)) in got.iter().enumerate() {
        let (k_nat, v_nat) = &native[n_layer - k + i];
        for (g, n) in [(k_got, k_nat), (v_got, v_nat)] {
            let d = max_abs(g, n);
            abs = abs.max(d);
            rel = rel.max(d / max_mag(n).max(1e-6));
        }
    }
    (rel, abs)
}

/// For every k, the recompute fed the rung's own boundary state equals its native cache to
/// `tol` (relative to the largest cached value); fed the state of the layer before, it misses
/// by more than `10 × tol` relative.
fn recompute_matches_native(info: &RungInfo, ks: &[usize], tol: f32) {
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let n_layer = model.n_layer();
    let toks = model.tokenize(TEXT, false).unwrap();
    let mut ctx = Context::new(model, common::cfg_topk()).unwrap();
    let boundaries: Vec<usize> = (0..n_layer - 1).collect();
    assert!(ctx.set_hidden_layers(&boundaries));
    // Two decodes (a prompt and a token) so rows from several calls must line up.
    ctx.decode(&toks[..toks.len() - 1]).unwrap();
    ctx.decode(&toks[toks.len() - 1..]).unwrap();
    let native = layers_of(&ctx.export_state().unwrap());
    assert_eq!(native.len(), n_layer);
    for &k in ks {
        let b = n_layer - k - 1;
        let own = ctx.hidden_states(b).expect("every position tapped");
        assert_eq!(own.nrows(), toks.len());
        let (rel, abs) = recompute_error(info, &native, &own, k);
        eprintln!(
            "{} k={k}: recompute vs native cache: max |Δ| {abs:.3e}, relative {rel:.3e}",
            info.name()
        );
        assert!(
            rel <= tol,
            "{} k={k}: recomputed K/V differ from the native cache by {rel} relative (tol {tol})",
            info.name()
        );
        if b > 0 {
            let wrong = ctx.hidden_states(b - 1).unwrap();
            let (rel_wrong, _) = recompute_error(info, &native, &wrong, k);
            assert!(
                rel_wrong > 10.0 * tol.max(1e-4),
                "{} k={k}: the wrong layer's state came within {rel_wrong}",
                info.name()
            );
        }
    }
}

/// The f16 cache holds 11 significant bits: two caches of the same numbers agree exactly, and
/// numbers that differ only by f32 summation order (another batch split) round to within a
/// couple of f16 ulps (2^-10 relative each) of the largest value.
const F16_TOL: f32 = 4.0 / 1024.0;

#[test]
fn partial_forward_reproduces_the_native_cache_on_tiny_rungs() {
    let l = common::tiny_ladder();
    // big (F16 weights, 4 layers) and big-q8 (Q8_0 weights): k = 1 ..= 3.
    for r in 0..2 {
        recompute_matches_native(&l.rungs[r], &[1, 2, 3], F16_TOL);
    }
    // small (3 layers, other head_dim).
    recompute_matches_native(&l.rungs[2], &[1, 2], F16_TOL);
}

#[test]
fn hidden_tap_does_not_change_logits_and_follows_truncation() {
    let l = common::tiny_ladder();
    let info = &l.rungs[0];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    let plain_cfg = ContextConfig {
        hidden_tap: false,
        ..common::cfg_topk()
    };
    let mut plain = Context::new(model.clone(), plain_cfg).unwrap();
    assert!(!plain.set_hidden_layers(&[1]), "no tap unless configured");
    let mut tapped = Context::new(model, common::cfg_topk()).unwrap();
    assert!(tapped.set_hidden_layers(&[1]));
    plain.decode(&toks).unwrap();
    tapped.decode(&toks).unwrap();
    assert_eq!(plain.logits(), tapped.logits(), "the tap only reads");
    let h = tapped.hidden_states(1).unwrap();
    assert_eq!(h.nrows(), toks.len());
    assert!(tapped.hidden_states(0).is_none(), "layer 0 was not tapped");
    // Rewind and decode again: the rows follow the sequence.
    tapped.truncate(5);
    assert!(tapped.hidden_states(1).is_none() || tapped.n_past() == 5);
    assert_eq!(tapped.hidden_states(1).unwrap().nrows(), 5);
    tapped.decode(&toks[5..]).unwrap();
    let h2 = tapped.hidden_states(1).unwrap();
    assert_eq!(h2.nrows(), toks.len());
    let d = max_abs(&h, &h2);
    assert!(d < 1e-3, "re-decoded rows moved by {d}");
    // An imported cache was not computed by this context's decodes: no states.
    let blob = tapped.export_state().unwrap();
    tapped.import_state(&blob).unwrap();
    assert!(tapped.hidden_states(1).is_none());
}

#[test]
fn partial_forward_matches_real_tier2() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    // Real weights are K-quantized: activations are re-quantized to Q8_K inside each matrix
    // product, identically in both runs, so the same tolerance holds.
    recompute_matches_native(common::rung(l, "tier2"), &[2, 4, 6], F16_TOL);
}

/// The whole switch path with recompute: an identity transplant between two contexts of one
/// rung, its last k layers recomputed from the rung's own boundary state, continues exactly
/// like the native context (the splice puts rows at the right positions), and the recompute
/// time is reported inside the switch cost.
#[test]
fn spliced_recompute_continues_like_the_native_cache() {
    use molt::routes::binding;
    use molt::session::migrate::{Recompute, Reread, transplant_with};
    use molt::transplant::project::identity_projector;
    let l = common::tiny_ladder();
    let info = &l.rungs[0];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let n_layer = model.n_layer();
    let toks = model.tokenize(TEXT, false).unwrap();
    let k = 2;
    let mut src = Context::new(model.clone(), common::cfg_topk()).unwrap();
    src.set_hidden_layers(&[n_layer - k - 1]);
    src.decode(&toks).unwrap();
    let hidden = src.hidden_states(n_layer - k - 1).unwrap();
    let p = identity_projector(&binding(info));
    let next = 7;
    let rc = Recompute {
        hidden: hidden.view(),
        map: None,
        k,
        dst_path: &info.path,
        dst_sha256: &info.sha256,
        dst_layers: n_layer,
    };
    let mut dst = Context::new(model.clone(), common::cfg_topk()).unwrap();
    let t = transplant_with(&src, &mut dst, &p, Some(&rc), Reread::NONE, next).unwrap();
    assert_eq!(t.topk, Some(k));
    assert!(t.recompute_ms > 0.0 && t.recompute_ms <= t.cost_ms, "{t:?}");
    src.decode(&[next]).unwrap();
    let d = src
        .logits()
        .iter()
        .zip(dst.logits())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("identity + recompute k={k}: max |Δlogit| {d:.3e}");
    assert!(d <= 0.05, "identity + recompute moved logits by {d}");
    // Control: recomputing from zeros must show in the logits.
    let zeros = Array2::<f32>::zeros(hidden.dim());
    let bad = Recompute {
        hidden: zeros.view(),
        ..rc
    };
    src.truncate(toks.len());
    let mut dst2 = Context::new(model, common::cfg_topk()).unwrap();
    transplant_with(&src, &mut dst2, &p, Some(&bad), Reread::NONE, next).unwrap();
    src.decode(&[next]).unwrap();
    let d2 = src
        .logits()
        .iter()
        .zip(dst2.logits())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        d2 > 0.2,
        "recomputing from zeros changed logits only by {d2}"
    );
}

/// Fits the tiny ladder's top-k hidden maps once (k = 1, 2) into a fixture directory.
fn tiny_topk_dir() -> &'static std::path::PathBuf {
    use molt::train::TrainOptions;
    use std::sync::OnceLock;
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let l = common::tiny_ladder();
        // Beside, not inside, the shared tiny projectors: other tests copy that directory.
        let _ = common::tiny_projectors();
        let dir = common::fixture_dir().join("topk-projectors");
        let fits = molt::train::topk::fit_topk_maps(
            l,
            ContextConfig {
                hidden_tap: false,
                ..common::cfg_topk()
            },
            &common::tiny_corpus_tokens(),
            &TrainOptions {
                window: 128,
                held_out_every: 4,
                variants: vec![],
                dtype: molt::transplant::projector::TensorDtype::F32,
                out_dir: dir.clone(),
                skip_head: 0,
                restore_spread: false,
            },
            &[1, 2],
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(fits.len(), 6 * 2, "every ordered pair, every k");
        for f in &fits {
            assert!(
                f.fit.held_out_rel_rms.is_finite() && f.fit.held_out_rel_rms < 1.0,
                "{f:?}"
            );
        }
        dir
    })
}

/// A session with `--topk-recompute 2` forced to switch big → small mid-answer recomputes the
/// small rung's last 2 blocks, reports the time inside the switch cost, and keeps decoding.
#[test]
fn topk_switch_mid_answer_on_tiny_ladder() {
    use molt::routes;
    use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions};
    let l = common::tiny_ladder().clone();
    let dir = tiny_topk_dir().clone();
    let run = |topk: Option<usize>, dirs: Vec<std::path::PathBuf>| {
        let opts = SessionOptions {
            projector_dirs: dirs
                .into_iter()
                .chain([common::tiny_projectors().clone()])
                .collect(),
            observe_footprint: false,
            research: molt::session::Research {
                topk_recompute: topk,
                ..molt::session::Research::default()
            },
            ..SessionOptions::default()
        };
        let mut s = Session::with_options(l.clone(), common::cfg_topk(), "big", opts).unwrap();
        let mut switches = Vec::new();
        let g = s
            .generate(
                &Prompt::Text(TEXT.into()),
                &GenerateOptions {
                    max_tokens: 24,
                    force_switch: Some((10, 2)),
                    ..GenerateOptions::default()
                },
                &mut |e| {
                    if let Event::Switch(i) = e {
                        switches.push(i.clone());
                    }
                },
            )
            .unwrap();
        assert_eq!(g.tokens.len(), 24, "the answer continues after the switch");
        assert_eq!(switches.len(), 1);
        switches.remove(0)
    };
    let sw = run(Some(2), vec![dir.clone()]);
    assert_eq!(sw.method, "molt");
    assert_eq!(sw.timings.topk, Some(2), "{sw:?}");
    assert!(
        sw.timings.recompute_ms > 0.0 && sw.timings.recompute_ms <= sw.timings.cost_ms,
        "{sw:?}"
    );
    // Off by default: same switch, every layer projected.
    let plain = run(None, vec![dir.clone()]);
    assert_eq!(plain.timings.topk, None);
    assert_eq!(plain.timings.recompute_ms, 0.0);
    // Asked for a k without maps: the switch still projects, and says why.
    let missing = run(Some(3), routes::search_dirs(Some(&dir)));
    assert_eq!(missing.timings.topk, None);
    assert!(
        missing.note.as_deref().is_some_and(|n| n.contains("top-k")),
        "{missing:?}"
    );
}

/// Real ladder: fits tier0 → tier2 hidden maps for k = 2 on a slice of the corpus, then a
/// session on tier0 forced to tier2 mid-answer recomputes tier2's last 2 blocks and keeps
/// decoding sensibly: a handoff divergence well below ln 2 and a continuation that is not one
/// repeated token. The plain projection's divergence is printed beside it (not a benchmark).
#[test]
fn topk_switch_mid_answer_on_real_ladder() {
    use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions};
    use molt::train::{TrainOptions, read_corpus};
    let Some(l) = common::real_ladder() else {
        return;
    };
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("molt-real-topk");
    let corpus = read_corpus(
        &std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("projectors/corpus"),
    )
    .unwrap();
    let model = Model::load(
        &common::rung(l, "tier0").path,
        "tier0",
        ModelOptions::default(),
    )
    .unwrap();
    let tokens = model.tokenize(&corpus, false).unwrap();
    drop(model);
    molt::train::topk::fit_topk_maps(
        l,
        ContextConfig {
            hidden_tap: false,
            ..common::cfg_topk()
        },
        &tokens[..tokens.len().min(1024)],
        &TrainOptions {
            window: 128,
            held_out_every: 4,
            variants: vec![],
            dtype: molt::transplant::projector::TensorDtype::F32,
            out_dir: dir.clone(),
            skip_head: 0,
            restore_spread: false,
        },
        &[2],
        &mut |s| eprintln!("{s}"),
    )
    .unwrap();
    let tier2 = common::rung(l, "tier2").index;
    let run = |topk: Option<usize>| {
        let opts = SessionOptions {
            projector_dirs: molt::routes::search_dirs(Some(&dir)),
            observe_footprint: false,
            research: molt::session::Research {
                topk_recompute: topk,
                measure_seam: true,
                ..molt::session::Research::default()
            },
            ..SessionOptions::default()
        };
        let mut s = Session::with_options(l.clone(), common::cfg_topk(), "tier0", opts).unwrap();
        let mut switches = Vec::new();
        let g = s
            .generate(
                &Prompt::User(
                    "Write a Rust function that returns the n-th Fibonacci number.".into(),
                ),
                &GenerateOptions {
                    max_tokens: 48,
                    force_switch: Some((16, tier2)),
                    ..GenerateOptions::default()
                },
                &mut |e| {
                    if let Event::Switch(i) = e {
                        switches.push(i.clone());
                    }
                },
            )
            .unwrap();
        assert_eq!(switches.len(), 1);
        (g, switches.remove(0))
    };
    let (g, sw) = run(Some(2));
    let (_, plain) = run(None);
    eprintln!(
        "top-2: jsd {:?}, cost {:.1} ms (recompute {:.1} ms); plain: jsd {:?}, cost {:.1} ms\n{}",
        sw.handoff_jsd,
        sw.timings.cost_ms,
        sw.timings.recompute_ms,
        plain.handoff_jsd,
        plain.timings.cost_ms,
        g.text
    );
    assert_eq!(sw.timings.topk, Some(2), "{sw:?}");
    assert!(sw.timings.recompute_ms > 0.0 && sw.timings.recompute_ms <= sw.timings.cost_ms);
    let jsd = sw.handoff_jsd.unwrap();
    assert!(jsd < 0.5, "handoff divergence {jsd} after a top-2 switch");
    let after = &g.tokens[16.min(g.tokens.len())..];
    let distinct: std::collections::HashSet<_> = after.iter().collect();
    assert!(
        after.len() < 8 || distinct.len() * 3 >= after.len(),
        "degenerate continuation: {:?}",
        g.text
    );
}
