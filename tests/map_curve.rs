//! The map learning curve (`molt-run map-curve`) on the tiny ladder: every point is measured on
//! the same held-out windows, the point at the base corpus's training size reproduces what
//! `train-projectors` fits on that corpus, and points past it draw on the extra corpus.

mod common;

use molt::engine::Token;
use molt::routes::Variant;
use molt::train::curve::{CurveCorpus, CurveOptions, fit_curve};
use molt::train::{TrainOptions, fit_ladder_windows};
use molt::transplant::projector::TensorDtype;

#[test]
fn the_curve_keeps_its_held_out_set_and_reproduces_the_full_fit() {
    let l = common::tiny_ladder();
    let tokens = common::corpus_tokens(l);
    let window = 64;
    // 12 base windows (3 held out: 9 × 64 = 576 training tokens), the rest extra.
    let (base, extra) = tokens.split_at(12 * window);
    let base: Vec<&[Token]> = base.chunks(window).collect();
    let extra: Vec<&[Token]> = extra.chunks(window).filter(|w| w.len() == window).collect();
    assert!(extra.len() >= 4, "the corpus has room for extra windows");
    let (src, dst) = (common::rung(l, "big"), common::rung(l, "small"));
    let opts = CurveOptions {
        held_out_every: 4,
        skip_head: 2,
        restore_spread: true,
        train_tokens: vec![200, 576 + 2 * 64, 1_000_000],
        seed: 3,
    };
    let mut seen = Vec::new();
    let report = fit_curve(
        src,
        dst,
        common::cfg_long(),
        &CurveCorpus {
            base: base.clone(),
            extra,
        },
        &opts,
        &mut |_| {},
        &mut |r| seen.push(r.points.len()),
    )
    .expect("curve");
    // 200 -> 4 windows, the base's 9, 9 + 2 extra; a million is out of reach.
    let sizes: Vec<usize> = report.points.iter().map(|p| p.train_tokens).collect();
    assert_eq!(sizes, vec![256, 576, 704]);
    assert_eq!(report.skipped_sizes, vec![1_000_000]);
    assert_eq!(
        seen,
        vec![1, 2, 3],
        "the report is handed over after every point"
    );
    let extras: Vec<usize> = report.points.iter().map(|p| p.extra_tokens).collect();
    assert_eq!(extras, vec![0, 0, 128]);
    assert_eq!(
        (report.held_out_tokens, report.held_out_rows),
        (3 * 64, 3 * 62)
    );
    assert_eq!(report.base_train_tokens, 576);
    for p in &report.points {
        assert_eq!(
            p.train_rows,
            p.train_windows * 62,
            "each window's head skipped"
        );
        assert!(p.k_held_out.is_finite() && p.v_held_out.is_finite());
        assert!(p.lambda.k.is_some() && p.lambda.v.is_some());
    }

    // The same base windows through `train-projectors`' fit: the same route, the same
    // held-out windows, the same training rows in another order.
    let dir = tempfile::tempdir().unwrap();
    let full = fit_ladder_windows(
        l,
        common::cfg_long(),
        &base,
        &TrainOptions {
            window,
            held_out_every: 4,
            variants: vec![Variant::Auto],
            dtype: TensorDtype::F32,
            out_dir: dir.path().to_path_buf(),
            skip_head: 2,
            restore_spread: true,
        },
        &mut |_| {},
    )
    .expect("full fit");
    let r = full
        .routes
        .iter()
        .find(|r| r.src == "big" && r.dst == "small")
        .expect("the size route");
    let at_base = &report.points[1];
    assert_eq!(r.fit.n_held_out_rows, report.held_out_rows);
    assert_eq!(r.fit.n_train_rows, at_base.train_rows);
    for (curve, full) in [
        (at_base.k_held_out, r.fit.k.held_out),
        (at_base.v_held_out, r.fit.v.held_out),
    ] {
        assert!(
            (curve - full).abs() <= 1e-4 * full.max(1e-6),
            "curve {curve} vs train-projectors {full}"
        );
    }
}
