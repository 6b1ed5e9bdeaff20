//! Migration between two tokens on real llama.cpp execution: the sandwich with identity maps is
//! lossless, a fitted tiny route continues decoding at the right positions, a projector bound
//! to other files is refused, and (on the real ladder, in CI) a migration mid-answer produces a
//! continuation that tier0 scores within a stated perplexity bound. The size-route tests (the
//! sandwich, head and tail re-reads, anchors, the migration) run on both tiny families: qwen2
//! (NEOX RoPE) and llama (normal RoPE, other head counts).

mod common;

use molt::engine::{Context, Model, ModelOptions, Sampler, SamplingParams, log_softmax};
use molt::kv::KvSnapshot;
use molt::ladder::Ladder;
use molt::routes::{Routes, Variant, binding};
use molt::session::migrate::{
    Exported, HEAD_IN_FIRST_BATCH, Reread, carry_exported, reprefill, transplant, transplant_with,
};
use molt::session::{
    Event, GenerateOptions, Generation, Prompt, Session, SessionOptions, Strategy, jsd,
};
use molt::transplant::anchor::Anchor;
use molt::transplant::project::identity_projector;
use molt::transplant::rope::{Direction, RopeKind, RopeSpec, rotate};

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns. fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); }";

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The identity sandwich between two contexts of one rung: un-rotate, copy, re-rotate,
/// import, decode the next token. The logits must match the native continuation to f16
/// rounding of the cache, and positions must continue where the source stopped.
fn identity_is_lossless(ladder: &Ladder, rung: usize, tol: f32) {
    let info = &ladder.rungs[rung];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let mut src = Context::new(model.clone(), common::cfg_long()).unwrap();
    let mut dst = Context::new(model.clone(), common::cfg_long()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    src.decode(&toks).unwrap();
    let next = Sampler::new(SamplingParams::greedy()).sample(src.logits());
    let p = identity_projector(&binding(info));
    let t = transplant(&src, &mut dst, &p, next).unwrap();
    assert_eq!(t.cells, toks.len());
    assert_eq!(
        dst.n_past(),
        toks.len() + 1,
        "positions continue after the import"
    );
    assert_eq!(dst.seq_pos_max(), i32::try_from(toks.len()).unwrap());
    src.decode(&[next]).unwrap();
    let d = max_abs(src.logits(), dst.logits());
    assert!(
        d <= tol,
        "{}: identity sandwich moved logits by {d} (tol {tol})",
        info.name()
    );
    // Control: re-rotating at other angles (as if the destination had another RoPE base)
    // must visibly change the output, or this test could not see a broken sandwich.
    let mut wrong = identity_projector(&binding(info));
    wrong.dst.rope.freq_base *= 0.01;
    src.truncate(toks.len());
    let mut dst2 = Context::new(model, common::cfg_long()).unwrap();
    transplant(&src, &mut dst2, &wrong, next).unwrap();
    let d2 = max_abs(src.logits(), dst2.logits());
    assert!(
        d2 > tol * 4.0,
        "re-rotating at wrong angles changed logits only by {d2}"
    );
}

/// A session on `l`'s rung `big` answering [`TEXT`] in `max_tokens`, with a switch to rung
/// `to` forced before token `at`.
fn answer_switching(
    l: Ladder,
    opts: SessionOptions,
    max_tokens: usize,
    (at, to): (usize, usize),
    sink: &mut dyn FnMut(&Event),
) -> (Session, Generation) {
    let mut s = Session::with_options(l, common::cfg_long(), "big", opts).unwrap();
    let g = s
        .generate(
            &Prompt::Text(TEXT.into()),
            &GenerateOptions {
                max_tokens,
                force_switch: Some((at, to)),
                ..GenerateOptions::default()
            },
            sink,
        )
        .unwrap();
    (s, g)
}

#[test]
fn identity_sandwich_is_lossless_on_tiny_rungs() {
    let l = common::tiny_ladder();
    for r in 0..l.rungs.len() {
        identity_is_lossless(l, r, 0.05);
    }
}

#[test]
fn identity_sandwich_is_lossless_on_llama_rungs() {
    let l = common::llama_ladder();
    for r in 0..l.rungs.len() {
        identity_is_lossless(l, r, 0.05);
    }
}

/// At layer 0 a key depends on its token alone until RoPE rotates it to its position, so one
/// token cached at two positions un-rotates to one vector under the rung's RoPE as read from
/// its file — and not under the other family's pairing. This is what tells NEOX (qwen2) from
/// normal (llama) RoPE apart; the identity sandwich cannot (it undoes what it does).
fn rope_convention_is_read_from_the_file(ladder: &Ladder, want: RopeKind) {
    for info in &ladder.rungs {
        let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
        let mut ctx = Context::new(model.clone(), common::cfg_long()).unwrap();
        let toks = model.tokenize(TEXT, false).unwrap();
        let (t, others) = (toks[3], &toks[4..20]);
        let mut seq = vec![t];
        seq.extend_from_slice(others);
        seq.push(t);
        ctx.decode(&seq).unwrap();
        let (_, stream) = KvSnapshot::parse_single_stream(&ctx.export_state().unwrap()).unwrap();
        let rows = |p: i32| {
            stream
                .cells
                .iter()
                .position(|c| c.pos == p)
                .expect("cell at position")
        };
        let (a, b) = (rows(0), rows(i32::try_from(seq.len()).unwrap() - 1));
        let spec = binding(info).rope;
        assert_eq!(spec.kind, want, "{}", info.name());
        let spread = |spec: &RopeSpec| {
            let k0 = &stream.layers[0].k;
            let mut k = ndarray::stack![ndarray::Axis(0), k0.row(a), k0.row(b)];
            rotate(
                k.view_mut(),
                &[0, i32::try_from(seq.len()).unwrap() - 1],
                spec,
                Direction::Unrotate,
            )
            .unwrap();
            max_abs(k.row(0).as_slice().unwrap(), k.row(1).as_slice().unwrap())
        };
        let right = spread(&spec);
        let other = RopeSpec {
            kind: if want == RopeKind::Neox {
                RopeKind::Norm
            } else {
                RopeKind::Neox
            },
            ..spec
        };
        let wrong = spread(&other);
        assert!(
            right < 0.02 && wrong > 20.0 * right.max(1e-3),
            "{}: same token, two positions, un-rotated: {right} apart under {want:?}, {wrong} under {:?}",
            info.name(),
            other.kind
        );
    }
}

#[test]
fn rope_pairing_is_the_files_own_on_both_families() {
    rope_convention_is_read_from_the_file(common::llama_ladder(), RopeKind::Norm);
    rope_convention_is_read_from_the_file(common::tiny_ladder(), RopeKind::Neox);
}

/// The whole switch on the llama family: its size route (other layer count, heads and head
/// size) fitted by the same code, a migration mid-answer that continues at the right
/// positions on the small rung with the projected cache.
#[test]
fn llama_ladder_migrates_mid_answer_on_its_fitted_size_route() {
    let dir = common::llama_projectors();
    let l = common::llama_ladder().clone();
    let opts = SessionOptions {
        projector_dirs: vec![dir.clone()],
        ..SessionOptions::default()
    };
    let (mut s, g) = answer_switching(l, opts, 16, (6, 1), &mut |_| {});
    let sw = &g.switches[0];
    assert_eq!(
        (sw.from.as_str(), sw.to.as_str(), sw.method.as_str()),
        ("big", "small", "molt")
    );
    let n = g.prompt_tokens + g.tokens.len() - 1;
    let live = s.rung_mut(1).unwrap();
    assert_eq!(live.ctx.n_past(), n);
    assert_eq!(live.ctx.seq_pos_max(), i32::try_from(n).unwrap() - 1);
}

/// The fit the tiny routes below are read from, made afresh: every ordered pair of the three
/// rungs gets a route, and no route's K map does much better on its training rows than on
/// the rows it never saw.
#[test]
fn fitting_the_tiny_ladder_covers_every_route_without_overfitting() {
    let dir = tempfile::tempdir().unwrap();
    let report = common::fit_tiny_projectors(dir.path());
    assert_eq!(report.routes.len(), 6, "every ordered pair of 3 rungs");
    for r in &report.routes {
        assert!(r.fit.k.held_out.is_finite() && r.fit.v.held_out.is_finite());
        assert!(
            r.fit.k.train <= r.fit.k.held_out * 1.5 + 1e-3,
            "{}: train {} held {}",
            r.route,
            r.fit.k.train,
            r.fit.k.held_out
        );
    }
}

#[test]
fn fitted_precision_route_is_nearly_exact_on_tiny_rungs() {
    let dir = common::tiny_projectors();
    let l = common::tiny_ladder();
    let mut routes = Routes::new(l, vec![dir.clone()], Variant::Auto);
    let p = routes.get(0, 1).unwrap();
    let held = p
        .layers
        .iter()
        .filter_map(|x| x.fit.as_ref())
        .map(|f| f.k_held_out_rel_rms)
        .fold(0.0, f64::max);
    assert!(
        held < 0.2,
        "Q8_0 requantization is close to F16: K held-out residual {held}"
    );
}

#[test]
fn a_precision_route_projected_in_place_is_the_general_paths_to_the_bit() {
    // The tiny ladder's precision route (same model, Q8_0; diagonal maps under the RoPE
    // sandwich): the blob rewritten where it lies equals the parse, projection and
    // serialization of the general path, byte for byte, and so does a head spliced into it.
    use molt::transplant::in_place;
    let dir = common::tiny_projectors();
    let l = common::tiny_ladder();
    let mut routes = Routes::new(l, vec![dir.clone()], Variant::Auto);
    let p = routes.get(0, 1).unwrap();
    assert!(
        in_place::applies(&p),
        "the precision route's maps are per channel"
    );
    assert!(
        !in_place::applies(&routes.get(0, 2).unwrap()),
        "a size route goes the general way"
    );
    let model = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let mut src = Context::new(model.clone(), common::cfg_long()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    src.decode(&toks).unwrap();
    let blob = src.export_state().unwrap();
    let general = |head: Option<&[u8]>| {
        let (bytes, _, _, spliced) = molt::session::migrate::project_blob_general(
            &blob,
            &p,
            molt::kv::CacheType::F16,
            None,
            head.map(|h| (h, None)),
        )
        .unwrap();
        spliced.unwrap();
        bytes
    };
    let (mut fast, layout, flops) = in_place::project(&blob, &p, molt::kv::CacheType::F16)
        .unwrap()
        .expect("applies");
    assert!(flops > 0);
    assert_eq!(layout.positions.len(), toks.len());
    assert!(
        fast == general(None),
        "projected in place = the general path"
    );
    // The destination's own state over the first 4 positions, spliced in.
    let md = Model::load(&l.rungs[1].path, "big-q8", ModelOptions::default()).unwrap();
    let mut dst = Context::new(md, common::cfg_long()).unwrap();
    dst.decode(&toks[..4]).unwrap();
    let head_blob = dst.export_state().unwrap();
    let (_, head) = KvSnapshot::parse_single_stream(&head_blob).unwrap();
    in_place::splice(&mut fast, &layout, &head, None).unwrap();
    assert!(
        fast == general(Some(&head_blob)),
        "the head spliced in place"
    );
    // A head of other widths is refused, and nothing is written.
    let mut narrow = head.clone();
    for x in &mut narrow.layers {
        x.k = x.k.slice(ndarray::s![.., ..1]).to_owned();
    }
    let before = fast.clone();
    assert!(in_place::splice(&mut fast, &layout, &narrow, None).is_err());
    assert!(fast == before);
}

#[test]
fn migration_mid_answer_continues_at_the_right_positions_on_tiny_rungs() {
    let dir = common::tiny_projectors();
    let l = common::tiny_ladder().clone();
    let opts = SessionOptions {
        projector_dirs: vec![dir.clone()],
        research: molt::session::Research {
            measure_seam: true,
            ..molt::session::Research::default()
        },
        ..SessionOptions::default()
    };
    let mut events = Vec::new();
    let (mut s, g) = answer_switching(l, opts, 24, (10, 2), &mut |e| events.push(e.clone()));
    assert_eq!(g.switches.len(), 1);
    let sw = &g.switches[0];
    assert_eq!(
        (sw.from.as_str(), sw.to.as_str(), sw.method.as_str()),
        ("big", "small", "molt")
    );
    assert_eq!(sw.at_token, 10);
    assert!(sw.handoff_jsd.is_some_and(f64::is_finite));
    // The switch's FLOPs count the projection and every position it decoded natively: it
    // is cheaper than a re-prefill unless the head and the recomputed tokens re-read the whole
    // (short) history.
    let t = &sw.timings;
    let native = t.head.saturating_sub(t.head_anchored) + t.tail + t.recomputed;
    assert!(t.flops > 0.0);
    assert_eq!(
        t.flops < sw.flops_reprefill,
        native < t.cells,
        "flops {} vs re-prefill {}, {native} of {} positions decoded natively",
        t.flops,
        sw.flops_reprefill,
        t.cells
    );
    assert_eq!(g.rungs_used, vec!["big".to_string(), "small".to_string()]);
    assert_eq!(s.current_rung(), "small");
    // Every token after the switch names the new rung; the switch event sits between.
    let names: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Token { rung, index, .. } => Some((*index, rung.clone())),
            _ => None,
        })
        .collect();
    assert!(
        names.iter().all(|(i, r)| (*i < 10) == (r == "big")),
        "{names:?}"
    );
    let sw_pos = events
        .iter()
        .position(|e| matches!(e, Event::Switch(_)))
        .unwrap();
    assert!(matches!(
        &events[sw_pos + 1],
        Event::Token { index: 10, .. }
    ));
    // The destination's cache holds the prompt plus every generated token but the last
    // (sampled, not yet decoded), at positions 0..n.
    let n = g.prompt_tokens + g.tokens.len() - 1;
    assert_eq!(s.history().len(), n);
    let live = s.rung_mut(2).unwrap();
    assert_eq!(live.ctx.n_past(), n);
    assert_eq!(live.ctx.seq_pos_max(), i32::try_from(n).unwrap() - 1);
    assert_eq!(live.ctx.seq_pos_min(), 0);
}

#[test]
fn reprefill_switch_goes_through_the_same_loop() {
    let l = common::tiny_ladder().clone();
    let opts = SessionOptions {
        strategy: Strategy::Reprefill,
        projector_dirs: vec![],
        ..SessionOptions::default()
    };
    let (_, g) = answer_switching(l, opts, 16, (5, 2), &mut |_| {});
    assert_eq!(g.switches[0].method, "reprefill");
    assert_eq!(g.switches[0].timings.cells, g.prompt_tokens + 5);
    assert!((g.switches[0].timings.flops - g.switches[0].flops_reprefill).abs() < 1.0);
}

#[test]
fn missing_and_foreign_projectors_are_clear_errors() {
    let l = common::tiny_ladder();
    let empty = tempfile::tempdir().unwrap();
    let mut routes = Routes::new(l, vec![empty.path().to_path_buf()], Variant::Auto);
    let e = routes.get(0, 2).unwrap_err().to_string();
    assert!(
        e.contains("train-projectors") && e.contains("big -> small"),
        "{e}"
    );
    // A precision route without a file is carried by the identity, and says so; an
    // ablation's variant is not stood in for.
    let p = routes.get(0, 1).expect("the identity stands in");
    assert_eq!(p.kind, molt::transplant::projector::ProjectorKind::Identity);
    assert_eq!(p.dst.name, "big-q8");
    assert!(routes.is_unfitted_identity(0, 1) && !routes.is_unfitted_identity(0, 2));
    let mut dense = Routes::new(l, vec![empty.path().to_path_buf()], Variant::Dense);
    assert!(dense.get(0, 1).is_err());
    // A projector fitted for other files: copy big->small over small->big's name.
    let dir = common::tiny_projectors();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("tiny")).unwrap();
    std::fs::copy(
        dir.join("tiny/big-to-small.dense.molt-proj"),
        tmp.path().join("tiny/big-q8-to-small.dense.molt-proj"),
    )
    .unwrap();
    let mut routes = Routes::new(l, vec![tmp.path().to_path_buf()], Variant::Auto);
    let e = routes.get(1, 2).unwrap_err().to_string();
    assert!(e.contains("sha256") || e.contains("bound"), "{e}");
}

/// The fitted tiny big→small route with the source holding [`TEXT`] and an empty destination.
struct TinyRoute {
    p: std::sync::Arc<molt::transplant::projector::Projector>,
    src: Context,
    dst: Context,
    toks: Vec<molt::engine::Token>,
    next: molt::engine::Token,
}

/// The size route from `l`'s largest rung to its smallest, with `l`'s fitted projector, the
/// source having read [`TEXT`].
fn big_to_small(l: &Ladder, projectors: &std::path::Path) -> TinyRoute {
    let small = l.rungs.len() - 1;
    let mut routes = Routes::new(l, vec![projectors.to_path_buf()], Variant::Auto);
    let p = routes.get(0, small).unwrap();
    let ms = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let md = Model::load(&l.rungs[small].path, "small", ModelOptions::default()).unwrap();
    let mut src = Context::new(ms.clone(), common::cfg_long()).unwrap();
    let dst = Context::new(md, common::cfg_long()).unwrap();
    let toks = ms.tokenize(TEXT, false).unwrap();
    src.decode(&toks).unwrap();
    let next = toks[3];
    TinyRoute {
        p,
        src,
        dst,
        toks,
        next,
    }
}

/// The size route of both tiny families: qwen2 (NEOX RoPE) and llama (normal RoPE).
fn both_families() -> [TinyRoute; 2] {
    [
        big_to_small(common::tiny_ladder(), common::tiny_projectors()),
        big_to_small(common::llama_ladder(), common::llama_projectors()),
    ]
}

fn transplant_and_reprefill_agree_in_direction_on_tiny_rungs_on(route: TinyRoute) {
    // Both strategies end at the destination's first logits; the re-prefill's divergence from
    // the source is the floor, and both must be finite distributions.
    let TinyRoute {
        p,
        src,
        mut dst,
        toks,
        next,
    } = route;
    let t = transplant(&src, &mut dst, &p, next).unwrap();
    let a = dst.logits().to_vec();
    let r = reprefill(&src, &mut dst, &toks, next).unwrap();
    let b = dst.logits().to_vec();
    assert!(t.cost_ms > 0.0 && r.cost_ms > 0.0);
    let d = jsd(&a, &b);
    assert!(d.is_finite() && d >= 0.0);
    let lp = log_softmax(&a);
    assert!(lp.iter().all(|x| x.is_finite()));
}

fn tail_recompute_rereads_the_last_tokens_natively_on(route: TinyRoute) {
    // A tail as long as the whole history drops every projected cell: the destination then
    // holds exactly what a re-prefill builds, so their logits agree to the bit. A shorter
    // tail keeps the projected prefix and the right positions, and moves the first logits
    // toward the re-prefill's.
    let TinyRoute {
        p,
        src,
        mut dst,
        toks,
        next,
    } = route;
    reprefill(&src, &mut dst, &toks, next).unwrap();
    let floor = dst.logits().to_vec();
    let all = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &[],
            tail: &toks,
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap();
    assert_eq!(all.tail, toks.len());
    assert_eq!(dst.n_past(), toks.len() + 1);
    assert_eq!(
        max_abs(dst.logits(), &floor),
        0.0,
        "whole-history tail = re-prefill"
    );
    let plain = transplant(&src, &mut dst, &p, next).unwrap();
    assert_eq!(plain.tail, 0);
    let d_plain = jsd(dst.logits(), &floor);
    let w = toks.len() / 2;
    let half = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &[],
            tail: &toks[toks.len() - w..],
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap();
    assert_eq!((half.tail, half.cells), (w, toks.len()));
    assert_eq!(
        dst.n_past(),
        toks.len() + 1,
        "positions continue after the tail"
    );
    assert_eq!(dst.seq_pos_max(), i32::try_from(toks.len()).unwrap());
    let d_half = jsd(dst.logits(), &floor);
    assert!(
        d_half <= d_plain,
        "re-reading half the context natively does not move away from the floor: {d_half} vs {d_plain}"
    );
    // A tail longer than the cache is refused, and the destination is left usable.
    let mut longer = toks.clone();
    longer.push(next);
    let e = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &[],
            tail: &longer,
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap_err();
    assert!(e.to_string().contains("tail recompute"), "{e}");
}

fn head_reread_splices_the_destinations_own_prefix_on(route: TinyRoute) {
    // A head as long as the history replaces every projected row by the destination's own:
    // exactly what a re-prefill builds. A head and a tail that meet cover the history too, so
    // the two options compose to the same bits; the positions continue after either.
    let TinyRoute {
        p,
        src,
        mut dst,
        toks,
        next,
    } = route;
    reprefill(&src, &mut dst, &toks, next).unwrap();
    let floor = dst.logits().to_vec();
    let all = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &toks,
            tail: &[],
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap();
    assert_eq!((all.head, all.tail, all.cells), (toks.len(), 0, toks.len()));
    assert!(all.head_ms > 0.0 && all.head_ms <= all.cost_ms, "{all:?}");
    assert_eq!(dst.n_past(), toks.len() + 1);
    assert_eq!(
        max_abs(dst.logits(), &floor),
        0.0,
        "whole-history head = re-prefill"
    );
    let h = toks.len() / 3;
    let both = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &toks[..h],
            tail: &toks[h..],
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap();
    assert_eq!((both.head, both.tail), (h, toks.len() - h));
    assert_eq!(
        max_abs(dst.logits(), &floor),
        0.0,
        "head + tail = re-prefill"
    );
    let plain = transplant(&src, &mut dst, &p, next).unwrap();
    let d_plain = max_abs(dst.logits(), &floor);
    assert!(d_plain > 0.0, "the tiny route's projection is not exact");
    assert_eq!(plain.head, 0);
    let part = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &toks[..h],
            tail: &[],
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap();
    assert_eq!(part.head, h);
    assert_eq!(dst.seq_pos_max(), i32::try_from(toks.len()).unwrap());
    assert_ne!(
        max_abs(dst.logits(), &floor),
        d_plain,
        "the head's native rows changed nothing"
    );
    // A head longer than the cache is refused, and the destination is left usable.
    let mut longer = toks.clone();
    longer.push(next);
    let e = transplant_with(
        &src,
        &mut dst,
        &p,
        None,
        Reread {
            head: &longer,
            tail: &[],
            anchor: None,
            spans: &[],
        },
        next,
    )
    .unwrap_err();
    assert!(e.to_string().contains("head re-read"), "{e}");
    transplant(&src, &mut dst, &p, next).unwrap();
    assert_eq!(dst.n_past(), toks.len() + 1);
}

/// Real ladder (CI): tier0 answers, the session moves to tier2 mid-answer by transplant, and
/// tier0 scores the continuation. Bound: the judge perplexity of the transplanted continuation
/// is within 1.5× of the same continuation length generated after a re-prefill switch, and
/// the continuation is not degenerate (fewer than half of its 4-grams repeated).
#[test]
fn real_ladder_migration_mid_answer_scores_within_bound() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    // Forced onto the 0.5B whatever precision rungs sit between: this is the size route.
    let tier2 = common::rung(l, "tier2").index;
    let run = |strategy| {
        let opts = SessionOptions {
            strategy,
            ..SessionOptions::default()
        };
        let mut s = Session::with_options(l.clone(), common::cfg_long(), "tier0", opts).unwrap();
        let g = s
            .generate(
                &Prompt::User("Explain in a few sentences how an operating system reclaims memory from background apps.".into()),
                &GenerateOptions {
                    max_tokens: 64,
                    force_switch: Some((24, tier2)),
                    ..GenerateOptions::default()
                },
                &mut |_| {},
            )
            .unwrap();
        assert_eq!(g.switches.len(), 1, "{strategy:?} switched once");
        assert_eq!(g.rungs_used, vec!["tier0".to_string(), "tier2".to_string()]);
        (s, g)
    };
    let (s, molt) = run(Strategy::Molt);
    let sw = &molt.switches[0];
    assert_eq!(
        (sw.timings.head, sw.timings.head_anchored),
        (molt::session::DEFAULT_HEAD_REREAD, 3),
        "the shipped anchor covers ChatML's opening, the user's first token is decoded: {sw:?}"
    );
    let (_, base) = run(Strategy::Reprefill);
    let judge = |g: &molt::session::Generation| {
        let tier0 = common::rung(l, "tier0");
        let model = Model::load(&tier0.path, "tier0", ModelOptions::default()).unwrap();
        let mut ctx = Context::new(model.clone(), common::cfg_long()).unwrap();
        let text = model
            .apply_chat_template(&s.conversation()[..1], true)
            .unwrap();
        let mut toks = model.tokenize(&text, true).unwrap();
        let start = toks.len() + 24;
        toks.extend(&g.tokens);
        let rows = ctx.decode_all_logits(&toks).unwrap();
        let mut nll = 0.0;
        let mut n = 0.0;
        for i in start..toks.len() {
            nll -= log_softmax(&rows[i - 1])[usize::try_from(toks[i]).unwrap()];
            n += 1.0;
        }
        (nll / n).exp()
    };
    let (pm, pb) = (judge(&molt), judge(&base));
    eprintln!("judge perplexity after switch: molt {pm:.2}, re-prefill {pb:.2}");
    assert!(
        pm.is_finite() && pm < pb * 1.5 + 1.0,
        "molt {pm} vs re-prefill {pb}"
    );
    let grams: Vec<_> = molt.tokens[24..].windows(4).collect();
    let distinct: std::collections::HashSet<_> = grams.iter().collect();
    assert!(
        distinct.len() * 2 > grams.len(),
        "degenerate repetition after the switch"
    );
}

#[test]
fn chat_windows_open_with_the_template_a_session_renders() {
    use molt::engine::ChatMessage;
    use molt::train::{ChatSample, corpus_windows};
    let l = common::tiny_ladder();
    let info = &l.rungs[0];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let chats = vec![ChatSample {
        prompt: "hello world".into(),
        answer: "the answer is here".into(),
    }];
    let text = "some raw corpus text ".repeat(60);
    let window = 512;
    let w = corpus_windows(&model, &text, &chats, window).unwrap();
    assert!(w.len() >= 2, "raw windows and one chat: {}", w.len());
    let rendered = model
        .apply_chat_template(&[ChatMessage::new("user", "hello world")], true)
        .unwrap();
    let prefix = model.tokenize(&rendered, true).unwrap();
    let chat = w.last().unwrap();
    assert!(chat.len() > prefix.len() && chat.len() <= window);
    // The session's prompt tokens, as the session builds them (the last may merge with the
    // answer's first byte).
    assert_eq!(chat[..prefix.len() - 1], prefix[..prefix.len() - 1]);
    let raw = model.tokenize(&text, false).unwrap();
    assert_eq!(
        w[0][..],
        raw[..w[0].len()],
        "raw text windows come first, in order"
    );
    // A window shorter than the conversation keeps its head.
    let short = corpus_windows(&model, "", &chats, 8).unwrap();
    assert_eq!(short.len(), 1);
    assert_eq!(short[0][..], prefix[..8]);
}

#[test]
fn background_refill_takes_over_with_the_native_cache() {
    // After a Molt switch on a size route the destination re-reads the history natively in
    // place, 32 positions in the batch of every generated token, until every cell is its own:
    // from then on the session's logits are those of a fresh native read of the history (up
    // to batch-order rounding), while without the refill they stay the projection's.
    let run = |refill: usize| {
        let opts = SessionOptions {
            refill_chunk: refill,
            // A fixed chunk: 32 a token, whatever the history's length, unpaced.
            refill_within: 0,
            refill_pace: 1.0,
            // The projection alone: the default token recompute re-reads whole sentences, at
            // least 64 positions, which on this short text is nearly all of it.
            token_recompute: None,
            ..SessionOptions::default()
        };
        let (g, levers, mut s) = common::events::forced_switch(opts, TEXT, 10, 2);
        let hist = s.history().to_vec();
        let live = s.rung_mut(2).unwrap();
        assert_eq!(live.ctx.n_past(), hist.len());
        let mut fresh = Context::new(live.ctx.model().clone(), common::cfg_long()).unwrap();
        fresh.decode(&hist).unwrap();
        let d = max_abs(live.ctx.logits(), fresh.logits());
        (g, levers, d)
    };
    let (g, levers, d_refill) = run(32);
    assert_eq!(g.tokens.len(), 40, "the answer goes on through the refill");
    assert_eq!(g.switches.len(), 1);
    let r = levers
        .iter()
        .find(|l| l.lever == "refill")
        .unwrap_or_else(|| panic!("no take-over: {levers:?}"));
    assert!(r.at_token > 10 && r.at_token < 40, "{r:?}");
    assert_eq!(r.rung, "small");
    // From the head's end to the token decoded before `at_token`.
    assert_eq!(
        r.tokens,
        g.prompt_tokens + r.at_token - 1 - molt::session::DEFAULT_HEAD_REREAD,
        "{r:?}"
    );
    assert!(r.cost_ms > 0.0);
    assert_eq!(g.levers, levers, "the answer's record lists the take-over");
    let (_, none, d_plain) = run(0);
    assert!(none.is_empty(), "off with 0: {none:?}");
    assert!(
        d_refill < 1e-2 && d_plain > 10.0 * d_refill.max(1e-4),
        "native after the take-over: {d_refill}, projected without it: {d_plain}"
    );
}

fn an_anchor_supplies_the_head_it_covers_on(route: TinyRoute) {
    // An anchor is the destination's own state over the history's first tokens, so splicing
    // it gives the same cache as decoding them, to the bit, whether it covers part of the head
    // (the rest decoded), all of it, or more (cut to the head). An anchor of other tokens is
    // not used. (Carried, then the next token decoded: a switch on the spot decodes the head's
    // rest in its first batch, see below.)
    let TinyRoute {
        p,
        src,
        mut dst,
        toks,
        next,
    } = route;
    let h = 4;
    let blob = src.export_state().unwrap();
    let exported = Exported {
        blob: &blob,
        n_past: src.n_past(),
        from: "big",
        export_ms: 0.0,
    };
    let head = &toks[..h];
    fn reread<'a>(head: &'a [molt::engine::Token], anchor: Option<&'a Anchor>) -> Reread<'a> {
        Reread {
            head,
            tail: &[],
            anchor,
            spans: &[],
        }
    }
    let switch = |dst: &mut Context, anchor: Option<&Anchor>| {
        let t = carry_exported(&exported, dst, &p, None, reread(head, anchor)).unwrap();
        assert_eq!(t.head, h);
        dst.decode(&[next]).unwrap();
        assert_eq!(dst.n_past(), toks.len() + 1);
        (t.head_anchored, dst.logits().to_vec())
    };
    let (none, decoded) = switch(&mut dst, None);
    assert_eq!(none, 0);
    let anchor_of = |dst: &mut Context, n: usize| {
        dst.clear();
        dst.decode(&toks[..n]).unwrap();
        Anchor {
            rung: "small".into(),
            file: "small.gguf".into(),
            sha256: String::new(),
            tokens: toks[..n].to_vec(),
            state: dst.export_state().unwrap(),
        }
    };
    for (n, covered) in [(3, 3), (h, h), (h + 2, h)] {
        let a = anchor_of(&mut dst, n);
        let (anchored, logits) = switch(&mut dst, Some(&a));
        assert_eq!(anchored, covered, "anchor of {n} tokens");
        assert_eq!(max_abs(&logits, &decoded), 0.0, "anchor of {n} tokens");
    }
    let mut other = anchor_of(&mut dst, 3);
    other.tokens[0] += 1;
    let (anchored, logits) = switch(&mut dst, Some(&other));
    assert_eq!(anchored, 0, "an anchor of other tokens is not spliced");
    assert_eq!(max_abs(&logits, &decoded), 0.0);
    // A state this context cannot import (here: not a state at all) costs the anchor, not the
    // switch: the head is decoded whole.
    let mut broken = anchor_of(&mut dst, 3);
    broken.state.truncate(16);
    let (anchored, logits) = switch(&mut dst, Some(&broken));
    assert_eq!(anchored, 0, "an unimportable anchor is not spliced");
    assert_eq!(max_abs(&logits, &decoded), 0.0);

    // On the spot, the head's rest is decoded in the first batch with the sampled token: the
    // cache ends holding the same cells at every position the carry holds, to the bit; only
    // the sampled token's own cell and logits saw the rest's positions as projected.
    let a = anchor_of(&mut dst, 3);
    switch(&mut dst, Some(&a));
    let carried = dst.export_state().unwrap();
    let carried_logits = dst.logits().to_vec();
    let t = transplant_with(&src, &mut dst, &p, None, reread(head, Some(&a)), next).unwrap();
    assert_eq!((t.head, t.head_anchored), (h, 3), "{t:?}");
    assert!(h - 3 <= HEAD_IN_FIRST_BATCH);
    assert_eq!(t.head_ms, 0.0, "the rest is in the first decode: {t:?}");
    assert_eq!(dst.n_past(), toks.len() + 1);
    let (_, want) = KvSnapshot::parse_single_stream(&carried).unwrap();
    let (_, got) = KvSnapshot::parse_single_stream(&dst.export_state().unwrap()).unwrap();
    let last = i32::try_from(toks.len()).unwrap();
    let rows = |st: &molt::kv::KvStream| {
        let mut r: Vec<(i32, Vec<f32>)> = st
            .cells
            .iter()
            .enumerate()
            .filter(|(_, c)| c.pos < last)
            .map(|(i, c)| {
                let mut v = Vec::new();
                for l in &st.layers {
                    v.extend(l.k.row(i).iter().chain(l.v.row(i)));
                }
                (c.pos, v)
            })
            .collect();
        r.sort_by_key(|(pos, _)| *pos);
        r
    };
    assert_eq!(got.n_cells(), want.n_cells());
    assert!(
        rows(&got) == rows(&want),
        "every cell before the sampled token's"
    );
    let d = jsd(dst.logits(), &carried_logits);
    assert!(d < 0.05, "first logits near the carry's: {d}");
}

#[test]
fn anchors_are_fitted_on_the_template_opening_and_bound_to_their_rung() {
    // `write_anchors` stores each rung's own state over the tokens every rendered chat opens
    // with; Routes finds them beside the projectors and refuses one of another file; a chat
    // session's default switch splices the anchor into its head re-read.
    let l = common::tiny_ladder().clone();
    let dir = tempfile::tempdir().unwrap();
    let written = molt::train::write_anchors(&l, common::cfg_long(), dir.path()).unwrap();
    assert_eq!(written.len(), l.rungs.len());
    let model = Model::load(&l.rungs[2].path, "small", ModelOptions::default()).unwrap();
    let opening = molt::train::template_opening(&model).unwrap();
    let rendered = model
        .apply_chat_template(&[molt::engine::ChatMessage::new("user", "hello")], true)
        .unwrap();
    let chat = model.tokenize(&rendered, true).unwrap();
    assert!(
        !opening.is_empty() && chat.starts_with(&opening) && opening.len() < chat.len(),
        "opening {opening:?} of {chat:?}"
    );
    let mut routes = Routes::new(&l, vec![dir.path().to_path_buf()], Variant::Auto);
    let a = routes.anchor(2).unwrap().expect("anchor written");
    assert_eq!(a.tokens, opening);
    assert_eq!(a.sha256, l.rungs[2].sha256);
    let path = &written[2];
    let e = Anchor::load(path, &"0".repeat(64)).unwrap_err();
    assert!(e.to_string().contains("bound to other model files"), "{e}");
    let empty = tempfile::tempdir().unwrap();
    let mut none = Routes::new(&l, vec![empty.path().to_path_buf()], Variant::Auto);
    assert!(none.anchor(2).unwrap().is_none(), "no file: no anchor");

    let opts = SessionOptions {
        projector_dirs: vec![common::tiny_projectors().clone(), dir.path().to_path_buf()],
        observe_footprint: false,
        ..SessionOptions::default()
    };
    assert_eq!(opts.head_reread, molt::session::DEFAULT_HEAD_REREAD);
    let mut s = Session::with_options(l.clone(), common::cfg_long(), "big", opts).unwrap();
    let g = s
        .generate(
            &Prompt::User(TEXT.into()),
            &GenerateOptions {
                max_tokens: 12,
                force_switch: Some((4, 2)),
                ..GenerateOptions::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(g.tokens.len(), 12);
    let sw = &g.switches[0];
    assert_eq!(sw.method, "molt");
    assert_eq!(sw.timings.head, molt::session::DEFAULT_HEAD_REREAD);
    assert_eq!(
        sw.timings.head_anchored,
        opening.len().min(sw.timings.head),
        "{sw:?}"
    );
    assert!(
        sw.timings.head_ms > 0.0 && sw.timings.head_ms <= sw.timings.cost_ms,
        "{sw:?}"
    );
}

#[test]
fn transplant_and_reprefill_agree_in_direction_on_tiny_rungs() {
    for route in both_families() {
        transplant_and_reprefill_agree_in_direction_on_tiny_rungs_on(route);
    }
}

#[test]
fn tail_recompute_rereads_the_last_tokens_natively() {
    for route in both_families() {
        tail_recompute_rereads_the_last_tokens_natively_on(route);
    }
}

#[test]
fn head_reread_splices_the_destinations_own_prefix() {
    for route in both_families() {
        head_reread_splices_the_destinations_own_prefix_on(route);
    }
}

#[test]
fn an_anchor_supplies_the_head_it_covers() {
    for route in both_families() {
        an_anchor_supplies_the_head_it_covers_on(route);
    }
}
