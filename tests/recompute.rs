//! Selective token recompute on real llama.cpp execution (tiny ladder): re-reading cached
//! positions natively in scratch sequences reproduces the native cache at those positions,
//! a whole-history span over a projected cache equals a re-prefill, the attention mass of a
//! prompt's last tokens covers the cache, and a size switch with the option on reports what
//! it re-read.

mod common;

use molt::engine::{Context, ContextConfig, Model, ModelOptions, Span, Token};
use molt::kv::KvSnapshot;
use molt::routes::{Routes, Variant};
use molt::session::migrate::{Exported, Reread, reprefill, transplant_exported};
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions};
use molt::transplant::select::TokenRecompute;

const TEXT: &str = "The release captain this cycle keeps the staging host warm; the pager extension sits in the runbook. fn tally(xs: &[u32]) -> u32 { xs.iter().sum() } and the notes go on about budgets, hiring and a long design review of the cache.";

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn recomputing_over_a_native_cache_reproduces_it() {
    let l = common::tiny_ladder();
    let info = &l.rungs[2];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let mut ctx = Context::new(model.clone(), common::cfg_long()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    assert!(toks.len() > 40, "{} tokens", toks.len());
    ctx.decode(&toks).unwrap();
    let native = ctx.export_state().unwrap();
    let logits = ctx.logits().to_vec();
    // More spans than one batch holds (seven), one of them long, the first at position 0.
    let ranges: Vec<_> = vec![
        0..2,
        5..9,
        12..13,
        15..17,
        19..20,
        22..30,
        32..33,
        35..38,
        40..41,
    ];
    let n = ctx.recompute_spans(&Span::of(&toks, &ranges)).unwrap();
    assert_eq!(n, ranges.iter().map(ExactSizeIterator::len).sum::<usize>());
    assert_eq!(ctx.n_past(), toks.len(), "nothing added, nothing lost");
    assert_eq!(ctx.seq_pos_max(), i32::try_from(toks.len() - 1).unwrap());
    let again = ctx.export_state().unwrap();
    for p in 0..i32::try_from(toks.len()).unwrap() {
        let d = max_abs(
            &common::kv_rows_at(&native, p),
            &common::kv_rows_at(&again, p),
        );
        assert!(d < 2e-2, "position {p} moved by {d}");
    }
    // The cache still continues: the next token's logits are the native ones.
    ctx.truncate(toks.len() - 1);
    ctx.decode(&toks[toks.len() - 1..]).unwrap();
    let d = max_abs(ctx.logits(), &logits);
    assert!(d < 2e-2, "logits after the recompute moved by {d}");
}

#[test]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of spans, one of which holds a single span"
)]
fn bad_spans_are_refused_and_leave_the_cache_alone() {
    let l = common::tiny_ladder();
    let info = &l.rungs[2];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let mut ctx = Context::new(model.clone(), common::cfg_long()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    ctx.decode(&toks).unwrap();
    let before = ctx.export_state().unwrap();
    let n = toks.len();
    let span = |start: usize, len: usize| Span {
        start,
        tokens: &toks[..len],
    };
    let cases: [Vec<Span>; 3] = [
        vec![span(5, 4), span(7, 3)],  // overlapping
        vec![span(10, 2), span(3, 1)], // out of order
        vec![span(n - 2, 3)],          // past the cache
    ];
    for sp in &cases {
        let e = ctx.recompute_spans(sp).unwrap_err().to_string();
        assert!(e.contains("span"), "{e}");
        assert_eq!(
            ctx.export_state().unwrap(),
            before,
            "refused without a change"
        );
    }
}

#[test]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of spans, one of which holds a single span"
)]
fn a_whole_history_span_over_a_projected_cache_is_a_reprefill() {
    // Over the projected cells, one span of every position recomputes each in order: the
    // result is what a re-prefill builds. A few spans move the logits toward it.
    let l = common::tiny_ladder();
    let mut routes = Routes::new(l, vec![common::tiny_projectors().clone()], Variant::Auto);
    let p = routes.get(0, 2).unwrap();
    let ms = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let md = Model::load(&l.rungs[2].path, "small", ModelOptions::default()).unwrap();
    let mut src = Context::new(ms.clone(), common::cfg_long()).unwrap();
    let mut dst = Context::new(md, common::cfg_long()).unwrap();
    let toks = ms.tokenize(TEXT, false).unwrap();
    src.decode(&toks).unwrap();
    let next = toks[3];
    reprefill(&src, &mut dst, &toks, next).unwrap();
    let floor = dst.logits().to_vec();
    let blob = src.export_state().unwrap();
    let exported = Exported {
        blob: &blob,
        n_past: toks.len(),
        from: "big",
        export_ms: 0.0,
    };
    let run = |dst: &mut Context, ranges: &[std::ops::Range<usize>]| {
        let sp = Span::of(&toks, ranges);
        let t = transplant_exported(
            &exported,
            dst,
            &p,
            None,
            Reread {
                spans: &sp,
                ..Reread::NONE
            },
            next,
        )
        .unwrap();
        (t, dst.logits().to_vec())
    };
    let (t0, plain) = run(&mut dst, &[]);
    assert_eq!(t0.recomputed, 0);
    let whole_span = std::iter::once(0..toks.len()).collect::<Vec<_>>();
    let (t, whole) = run(&mut dst, &whole_span);
    assert_eq!((t.recomputed, t.spans), (toks.len(), 1));
    assert!(t.spans_ms > 0.0 && t.cost_ms >= t.spans_ms);
    let d_whole = max_abs(&whole, &floor);
    let d_plain = max_abs(&plain, &floor);
    assert!(
        d_whole < 2e-2 && d_plain > 10.0 * d_whole.max(1e-3),
        "whole span {d_whole}, projection alone {d_plain}"
    );
    assert_eq!(dst.n_past(), toks.len() + 1);
}

#[test]
fn the_prompts_last_tokens_give_every_cached_position_a_mass() {
    let l = common::tiny_ladder();
    let info = &l.rungs[0];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let c = ContextConfig {
        attention_tap: true,
        ..common::cfg_long()
    };
    let mut ctx = Context::new(model.clone(), c).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    let mass = ctx.decode_observed(&toks, 8).unwrap().expect("tapped");
    assert_eq!(mass.len(), toks.len());
    // Each of the 8 query rows gives mass 1 per head and layer, spread over the positions it
    // sees (its own and earlier).
    let per_row = f64::from(info.facts.n_layer) * f64::from(info.facts.n_head);
    let total: f64 = mass.iter().map(|&m| f64::from(m)).sum();
    assert!(
        (total / (8.0 * per_row) - 1.0).abs() < 1e-3,
        "total mass {total}, expected {}",
        8.0 * per_row
    );
    assert!(mass.iter().all(|&m| m >= 0.0));
    // The decode is the plain decode: same logits as without the tap.
    let mut plain = Context::new(model, common::cfg_long()).unwrap();
    plain.decode(&toks).unwrap();
    assert!(max_abs(plain.logits(), ctx.logits()) < 1e-3);
    // Without a tap there is no mass, and the tokens are still decoded.
    let none = plain.decode_observed(&toks[..4], 8);
    assert!(none.is_err() || none.unwrap().is_none());
}

#[test]
fn a_size_switch_with_token_recompute_reports_what_it_reread() {
    let l = common::tiny_ladder().clone();
    let run = |recompute: Option<TokenRecompute>, to: usize| {
        let opts = SessionOptions {
            projector_dirs: vec![common::tiny_projectors().clone()],
            token_recompute: recompute,
            observe_footprint: false,
            ..SessionOptions::default()
        };
        let mut s = Session::with_options(l.clone(), common::cfg_long(), "big", opts).unwrap();
        let mut switches = Vec::new();
        let g = s
            .generate(
                &Prompt::Text(TEXT.into()),
                &GenerateOptions {
                    max_tokens: 12,
                    force_switch: Some((4, to)),
                    ..GenerateOptions::default()
                },
                &mut |e| {
                    if let Event::Switch(x) = e {
                        switches.push(x.clone());
                    }
                },
            )
            .unwrap();
        assert_eq!(g.tokens.len(), 12);
        assert_eq!(switches.len(), 1);
        switches.remove(0)
    };
    let on = Some(TokenRecompute::attention(0.2));
    let sw = run(on, 2);
    assert_eq!(sw.method, "molt");
    assert!(
        sw.timings.recomputed > 0 && sw.timings.spans > 0 && sw.timings.spans_ms > 0.0,
        "{sw:?}"
    );
    let n = sw.timings.cells;
    assert!(
        sw.timings.recomputed >= n / 5 && sw.timings.recomputed < n,
        "{} of {n}",
        sw.timings.recomputed
    );
    // A precision route keeps its facts without it: nothing re-read there.
    let prec = run(on, 1);
    assert_eq!(prec.timings.recomputed, 0, "{prec:?}");
    // Off: nothing re-read.
    assert_eq!(run(None, 2).timings.recomputed, 0);
}

/// The recall benchmark's refill arm: whatever the live cache held, once the refill has re-read
/// every position in place the answer goes on exactly as it would on a native cache of the
/// same text.
#[test]
fn a_refill_that_caught_up_continues_as_the_native_cache_does() {
    let l = common::tiny_ladder();
    let info = &l.rungs[2];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    let (history, last) = (&toks[..toks.len() - 1], toks[toks.len() - 1]);
    // The live cache holds other text at the history's positions (a stand-in for projected
    // cells), then the newest token.
    let mut live = Context::new(model.clone(), common::cfg_long()).unwrap();
    let other: Vec<_> = history.iter().rev().copied().collect();
    live.decode(&other).unwrap();
    live.decode(&[last]).unwrap();
    let mut out = vec![last];
    let (ms, done_at) = molt_bench::recall::continue_refilling(
        &mut live,
        history,
        (Default::default(), 0),
        &mut out,
        40,
        8,
        None,
    )
    .unwrap();
    let k = done_at.expect("caught up inside 40 tokens");
    assert!(ms > 0.0);
    // Seven new history tokens a step (eight read, one more written): a few steps.
    assert!(
        k > 2 && k <= 2 + history.len() / 7,
        "caught up before answer token {k}"
    );
    assert!(k < out.len(), "the answer went on after the refill");
    assert_eq!(
        live.n_past(),
        history.len() + out.len() - 1,
        "nothing added"
    );
    // A native cache of the history and the answer up to the take-over continues the same.
    let mut native = Context::new(model, common::cfg_long()).unwrap();
    native.decode(history).unwrap();
    native.decode(&out[..k]).unwrap();
    let mut again = out[..k].to_vec();
    while again.len() < out.len() {
        let t = molt::engine::argmax(native.logits());
        again.push(t);
        if again.len() < out.len() {
            native.decode(&[t]).unwrap();
        }
    }
    assert_eq!(
        again, out,
        "after the refill the answer is the native cache's"
    );
}

/// A session's switch down a size route re-reads the history in place behind the answer, by
/// default: a `refill` lever once every position is the destination's own, the positions it
/// re-read counted, and from that token on the answer is what a native cache of the same text
/// gives. With a deadline it re-reads more per token and ends within it. A precision route's
/// switch starts none, and `refill_chunk: 0` turns it off.
#[test]
fn a_size_switch_refills_the_history_in_place_and_then_answers_as_the_native_cache_does() {
    let paced = |to: usize, chunk: usize, within: usize, pace: f64| {
        // A twentieth by position: on this short text the default's choice covers most of the
        // cache and the switch re-reads all of it, leaving nothing to refill (the test below).
        let opts = SessionOptions {
            refill_chunk: chunk,
            refill_within: within,
            refill_pace: pace,
            token_recompute: Some(TokenRecompute::attention(0.05)),
            ..SessionOptions::default()
        };
        let (g, levers, s) = common::events::forced_switch(opts, TEXT, 2, to);
        (g, levers, s.history().to_vec())
    };
    // The chunk and deadline rules, unpaced (a pace of 1).
    let run = |to: usize, chunk: usize, within: usize| paced(to, chunk, within, 1.0);
    assert_eq!(
        SessionOptions::default().refill_chunk,
        molt::session::DEFAULT_REFILL_CHUNK
    );
    let (g, levers, history) = run(2, 8, 0);
    assert_eq!(g.tokens.len(), 40, "the tiny model ended early");
    let refills: Vec<_> = levers
        .iter()
        .filter(|x| x.lever.starts_with("refill"))
        .collect();
    assert_eq!(refills.len(), 1, "{levers:?}");
    let r = refills[0];
    assert_eq!(r.lever, "refill", "{r:?}");
    assert_eq!(r.rung, "small");
    assert!(r.cost_ms > 0.0);
    // The history as the session holds it: the prompt, then every answer token but the last.
    let prompt = history.len() - (g.tokens.len() - 1);
    assert_eq!(&history[prompt..], &g.tokens[..g.tokens.len() - 1]);
    // From the head's end to the token before `at_token`, eight a step.
    let k = r.at_token;
    let head = molt::session::DEFAULT_HEAD_REREAD;
    assert_eq!(r.tokens, prompt + k - 1 - head, "{r:?}");
    assert!(k > 2 && k < g.tokens.len(), "refilled before token {k}");
    assert!(
        k - 2 > 3,
        "eight a step takes more than three tokens here (refilled before token {k})"
    );
    // A native cache of the same text continues as the answer did from token `k`.
    assert_eq!(
        native_continuation(&history, &g.tokens, k),
        g.tokens,
        "after the refill the answer is the native cache's"
    );
    // With a deadline of three tokens: more a step, the same positions, done by then.
    let (g3, levers3, _) = run(2, 8, 3);
    assert_eq!(g3.tokens[..2], g.tokens[..2]);
    let r3: Vec<_> = levers3.iter().filter(|x| x.lever == "refill").collect();
    assert_eq!(r3.len(), 1, "{levers3:?}");
    assert!(r3[0].at_token <= 2 + 3 + 1, "{:?}", r3[0]);
    assert_eq!(
        r3[0].tokens,
        prompt + r3[0].at_token - 1 - head,
        "{:?}",
        r3[0]
    );
    // Paced (the default): the tokens right after the switch are decoded alone (the rung's own
    // gap timed), then the refill re-reads the same positions, never more than 8 a step, and
    // from then on the answer is the native cache's.
    let (gp, leversp, historyp) = paced(2, 8, 0, molt::session::DEFAULT_REFILL_PACE);
    let rp: Vec<_> = leversp
        .iter()
        .filter(|x| x.lever.starts_with("refill"))
        .collect();
    assert!(rp.len() <= 1, "{leversp:?}");
    // How fast it goes depends on this machine's timings; where it ends, it has re-read every
    // position after the head once, no sooner than the plain tokens and eight a step allow.
    if let Some(r) = rp.first().filter(|r| r.lever == "refill") {
        let promptp = historyp.len() - (gp.tokens.len() - 1);
        let kp = r.at_token;
        assert_eq!(r.tokens, promptp + kp - 1 - head, "{r:?}");
        assert!(
            kp >= 2 + molt::session::PACE_PLAIN_TOKENS + (k - 2),
            "no more than eight a step, after the plain tokens (refilled before token {kp})"
        );
        assert_eq!(
            native_continuation(&historyp, &gp.tokens, kp),
            gp.tokens,
            "after the paced refill the answer is the native cache's"
        );
    }
    // A precision route keeps its facts without one; off, none either.
    let (_, precision, _) = run(1, 8, 0);
    assert!(
        precision.iter().all(|x| !x.lever.starts_with("refill")),
        "{precision:?}"
    );
    let (_, off, _) = run(2, 0, 8);
    assert!(
        off.iter().all(|x| !x.lever.starts_with("refill")),
        "{off:?}"
    );
}

/// The sparse read a size switch makes by default (`Rest::LeftOut`): the head and a few spans
/// of a history read natively at their own positions, nothing between them. The cache then
/// holds exactly those positions and ends where the history does, its moved keys already
/// rotated for their new positions when the read returns (layer 0's keys depend only on the
/// token and its position, so they match a native prefill's there, exported before any other
/// decode); and re-reading the holes in place from the head on (as a refill does) leaves every
/// cell what a native prefill of the history builds.
#[test]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of spans, one of which holds a single span"
)]
fn a_sparse_read_holds_only_its_spans_and_a_refill_over_its_holes_is_native() {
    let l = common::tiny_ladder();
    let md = Model::load(&l.rungs[2].path, "small", ModelOptions::default()).unwrap();
    let toks = md.tokenize(TEXT, false).unwrap();
    let n = toks.len();
    assert!(n > 40, "{n}");
    let head = 4;
    let ranges = [10..16, 25..31, n - 6..n];
    let mut native = Context::new(md.clone(), common::cfg_long()).unwrap();
    native.decode(&toks).unwrap();
    let native_blob = native.export_state().unwrap();
    let mut ctx = Context::new(md, common::cfg_long()).unwrap();
    ctx.decode(&toks[..head]).unwrap();
    let read = ctx.decode_sparse(&Span::of(&toks, &ranges), &[]).unwrap();
    assert_eq!(read, 18);
    assert_eq!(ctx.n_past(), n);
    let blob = ctx.export_state().unwrap();
    let (_, stream) = KvSnapshot::parse_single_stream(&blob).unwrap();
    let want: Vec<i32> = (0..head)
        .chain(ranges.iter().flat_map(Clone::clone))
        .map(|p| i32::try_from(p).unwrap())
        .collect();
    assert_eq!(stream.positions(), want.as_slice());
    let (_, native_stream) = KvSnapshot::parse_single_stream(&native_blob).unwrap();
    let layer0_key = |s: &molt::kv::KvStream, pos: usize| {
        let i = s
            .positions()
            .iter()
            .position(|&p| p == i32::try_from(pos).unwrap())
            .unwrap();
        s.layers[0].k.row(i).to_vec()
    };
    for pos in [12, 27, n - 1] {
        let d = max_abs(&layer0_key(&stream, pos), &layer0_key(&native_stream, pos));
        assert!(d < 2e-2, "layer 0 key at {pos}: {d}");
    }
    // A piece read into a hole out of order (no cell right before it), as a hurried switch's
    // reading does: read after the last cell before it, then moved to its own positions; an
    // export right after it (no decode since) holds its keys rotated for where it stands —
    // layer 0's keys match a native prefill's there.
    let mut holed = Context::new(ctx.model().clone(), common::cfg_long()).unwrap();
    holed.import_state(&blob).unwrap();
    assert_eq!(
        holed.recompute_spans(&Span::of(&toks, &[18..22])).unwrap(),
        4
    );
    let moved = holed.export_state().unwrap();
    let (_, moved) = KvSnapshot::parse_single_stream(&moved).unwrap();
    assert!(moved.positions().contains(&18) && moved.positions().contains(&21));
    for pos in [18, 21] {
        let d = max_abs(&layer0_key(&moved, pos), &layer0_key(&native_stream, pos));
        assert!(d < 2e-2, "layer 0 key at {pos} read into a hole: {d}");
    }
    // Read in the batch of a token, as a refill step does: the export that re-rotates the
    // moved keys leaves the token's logits as they were.
    let mut stepped = Context::new(ctx.model().clone(), common::cfg_long()).unwrap();
    stepped.import_state(&blob).unwrap();
    stepped
        .recompute_spans_then_decode(&Span::of(&toks, &[34..38]), &[toks[0]])
        .unwrap();
    let before = stepped.logits().to_vec();
    assert!(!before.is_empty());
    stepped.export_state().unwrap();
    assert_eq!(
        stepped.logits(),
        before.as_slice(),
        "the logits survive the export"
    );
    // Out of order, or a lone last token apart from the rest: refused, the cache as it was.
    assert!(ctx.decode_sparse(&Span::of(&toks, &[2..3]), &[]).is_err());
    let mut other = Context::new(ctx.model().clone(), common::cfg_long()).unwrap();
    other.decode(&toks[..head]).unwrap();
    assert!(
        other
            .decode_sparse(&Span::of(&toks, &[10..16, 30..31]), &[])
            .is_err()
    );
    assert_eq!(other.n_past(), head);
    // The next token goes after the history.
    ctx.decode(&[toks[0]]).unwrap();
    ctx.truncate(n);
    // Re-read from the head's end to the end, in place: the native cache.
    ctx.recompute_spans(&Span::of(&toks, &[head..n])).unwrap();
    let a = ctx.export_state().unwrap();
    for pos in [0, 5, 12, 20, 28, n - 1] {
        let p = i32::try_from(pos).unwrap();
        let d = max_abs(
            &common::kv_rows_at(&a, p),
            &common::kv_rows_at(&native_blob, p),
        );
        assert!(d < 2e-2, "position {pos}: {d}");
    }
}

/// A size switch whose choice of positions covers half the cache or more (a short
/// conversation: the default's floor of 64 positions and the question) re-reads all of it,
/// by default: the switch reports every position between the head and the newest token
/// recomputed, nothing is left projected, no refill runs behind the answer, and the answer
/// after the switch is what a native cache of the same text gives.
#[test]
fn a_size_switch_over_a_short_history_re_reads_all_of_it_and_refills_nothing() {
    let at = 2;
    let (g, levers, s) = common::events::forced_switch(SessionOptions::default(), TEXT, at, 2);
    let sw = &g.switches[0];
    let head = molt::session::DEFAULT_HEAD_REREAD;
    let cells = sw.timings.cells;
    assert_eq!(sw.timings.recomputed, cells - head, "{:?}", sw.timings);
    assert_eq!(s.projected_positions(), 0);
    assert!(
        levers.iter().all(|x| !x.lever.starts_with("refill")),
        "{levers:?}"
    );
    assert_eq!(
        native_continuation(s.history(), &g.tokens, at),
        g.tokens,
        "the answer after the switch is the native cache's"
    );
}

/// The default size switch over a longer history reads sparsely: nothing is projected or
/// imported, the destination reads the head, the positions the question looked at and the
/// question, and leaves the rest out. The refill then reads what was left out behind the
/// answer, and from the token after it the answer is what a native cache of the same text
/// gives. With the refill off, the answer ends as soon as its last token is written, with
/// what was left out still due: read between answers ([`Session::fill_idle`], a micro-batch
/// at a time), or when the answer ends with `fill_at_end` (a `fill` lever) — either way the
/// cache then holds every position, natively.
#[test]
fn a_default_size_switch_reads_sparsely_and_leaves_a_whole_native_cache() {
    let long = [TEXT; 4].join(" ");
    let head = molt::session::DEFAULT_HEAD_REREAD;
    let run = |chunk: usize| {
        let opts = SessionOptions {
            refill_chunk: chunk,
            // Unpaced: the paced refill's chunks follow this machine's timings, and on a busy
            // one it had not reached the newest token within the answer's 40 tokens.
            refill_pace: 1.0,
            ..SessionOptions::default()
        };
        common::events::forced_switch(opts, &long, 2, 2)
    };
    let (g, levers, s) = run(molt::session::DEFAULT_REFILL_CHUNK);
    let t = &g.switches[0].timings;
    assert!(t.sparse, "{t:?}");
    assert!(t.project_ms == 0.0 && t.import_ms == 0.0, "{t:?}");
    let left_out = t.cells - head - t.recomputed;
    assert!(
        left_out > t.cells / 3,
        "most of the history left out: {t:?}"
    );
    let refills: Vec<_> = levers.iter().filter(|x| x.lever == "refill").collect();
    assert_eq!(refills.len(), 1, "{levers:?}");
    let k = refills[0].at_token;
    assert_eq!(s.projected_positions(), 0);
    assert_eq!(
        native_continuation(s.history(), &g.tokens, k),
        g.tokens,
        "after the refill the answer is the native cache's"
    );

    let (g0, levers0, mut s0) = run(0);
    assert!(g0.switches[0].timings.sparse);
    assert_eq!(g0.tokens[..2], g.tokens[..2]);
    assert!(levers0.iter().all(|x| x.lever != "refill"), "{levers0:?}");
    assert!(levers0.iter().all(|x| x.lever != "fill"), "{levers0:?}");
    assert_eq!(s0.fill_due(), left_out);
    // Between answers, a micro-batch at a time.
    let mut read = 0;
    let mut steps = 0;
    while s0.fill_due() > 0 {
        let step = s0.fill_idle(1).unwrap();
        assert!(step.read > 0, "{step:?}");
        assert_eq!(step.due, s0.fill_due());
        read += step.read;
        steps += 1;
        assert!(steps <= left_out, "the fill makes progress");
    }
    assert!(
        steps > 1,
        "{left_out} positions in micro-batches: {steps} steps"
    );
    assert_eq!(read, left_out);
    assert_eq!(s0.projected_positions(), 0);
    assert_eq!(
        s0.fill_idle(1).unwrap().read,
        0,
        "nothing left: nothing read"
    );

    // A prompt that comes before the fill is done reads what is left first (a `fill` lever at
    // its token 0), then itself.
    let (_, _, mut s2) = run(0);
    let first = s2.fill_idle(1).unwrap();
    assert!(first.read > 0 && first.due > 0, "{first:?}");
    let mut next = Vec::new();
    s2.generate(
        &Prompt::Text(" Again.".into()),
        &GenerateOptions {
            max_tokens: 4,
            ..GenerateOptions::default()
        },
        &mut |e| {
            if let Event::Lever(x) = e {
                next.push(x.clone());
            }
        },
    )
    .unwrap();
    let fills: Vec<_> = next.iter().filter(|x| x.lever == "fill").collect();
    assert_eq!(fills.len(), 1, "{next:?}");
    assert_eq!((fills[0].at_token, fills[0].tokens), (0, first.due));
    assert_eq!(s2.fill_due(), 0);

    let opts = SessionOptions {
        refill_chunk: 0,
        fill_at_end: true,
        ..SessionOptions::default()
    };
    let (g1, levers1, s1) = common::events::forced_switch(opts, &long, 2, 2);
    let fills: Vec<_> = levers1.iter().filter(|x| x.lever == "fill").collect();
    assert_eq!(fills.len(), 1, "{levers1:?}");
    assert_eq!(fills[0].at_token, g1.tokens.len());
    assert_eq!(fills[0].tokens, left_out, "{:?}", fills[0]);
    assert_eq!(s1.projected_positions(), 0);
    assert_eq!(s1.fill_due(), 0);
}

/// A hurried size switch (`SessionOptions::hurry`) reads only the head and the newest
/// positions before its first token; the positions the switch chose are read behind the
/// answer, then the refill's pass, and from the token after it the answer is what a native
/// cache of the same text gives. With the refill's pass off, the chosen positions are still
/// read behind the answer, and what the switch did not choose is read when the answer ends
/// (with `fill_at_end`: a `fill` lever, as many positions as the unhurried switch left out):
/// the cache the answer leaves holds every position, natively.
#[test]
fn a_hurried_size_switch_reads_the_newest_positions_first_and_the_rest_behind_the_answer() {
    let long = [TEXT; 4].join(" ");
    let head = molt::session::DEFAULT_HEAD_REREAD;
    let run = |chunk: usize, hurry: usize| {
        let opts = SessionOptions {
            refill_chunk: chunk,
            // Unpaced: how many positions each token carries does not hang on timings.
            refill_pace: 1.0,
            hurry,
            fill_at_end: true,
            ..SessionOptions::default()
        };
        common::events::forced_switch(opts, &long, 2, 2)
    };
    let (g_whole, _, _) = run(0, 0);
    let whole = &g_whole.switches[0].timings;
    let left_out = whole.cells - head - whole.recomputed;

    let (g, levers, s) = run(molt::session::DEFAULT_REFILL_CHUNK, 8);
    let t = &g.switches[0].timings;
    assert!(t.sparse, "{t:?}");
    assert_eq!(
        t.recomputed, 8,
        "only the newest positions before the token: {t:?}"
    );
    let refills: Vec<_> = levers.iter().filter(|x| x.lever == "refill").collect();
    assert_eq!(refills.len(), 1, "{levers:?}");
    let r = refills[0];
    let k = r.at_token;
    let prompt = s.history().len() - (g.tokens.len() - 1);
    // The chosen positions, then every position after the head once more.
    assert_eq!(
        r.tokens,
        (whole.recomputed - 8) + (prompt + k - 1 - head),
        "{r:?}"
    );
    assert_eq!(s.projected_positions(), 0);
    assert_eq!(
        native_continuation(s.history(), &g.tokens, k),
        g.tokens,
        "after the refill the answer is the native cache's"
    );

    let (g0, levers0, s0) = run(0, 8);
    assert_eq!(g0.switches[0].timings.recomputed, 8);
    let chosen: Vec<_> = levers0.iter().filter(|x| x.lever == "refill").collect();
    assert_eq!(
        chosen.len(),
        1,
        "the chosen positions read behind the answer: {levers0:?}"
    );
    assert_eq!(chosen[0].tokens, whole.recomputed - 8, "{:?}", chosen[0]);
    let fills: Vec<_> = levers0.iter().filter(|x| x.lever == "fill").collect();
    assert_eq!(fills.len(), 1, "{levers0:?}");
    assert_eq!(fills[0].at_token, g0.tokens.len());
    assert_eq!(fills[0].tokens, left_out, "{:?}", fills[0]);
    assert_eq!(s0.projected_positions(), 0);
}

/// What the small rung answers, greedily, from a native cache of the session's `history` (the
/// prompt, then every answer token but the last) cut after the answer's first `k` tokens:
/// `tokens[..k]`, then its own tokens up to `tokens`' length.
fn native_continuation(history: &[Token], tokens: &[Token], k: usize) -> Vec<Token> {
    let info = &common::tiny_ladder().rungs[2];
    let prompt = history.len() - (tokens.len() - 1);
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let mut native = Context::new(model, common::cfg_long()).unwrap();
    native.decode(&history[..prompt + k]).unwrap();
    let mut again = tokens[..k].to_vec();
    while again.len() < tokens.len() {
        let t = molt::engine::argmax(native.logits());
        again.push(t);
        if again.len() < tokens.len() {
            native.decode(&[t]).unwrap();
        }
    }
    again
}

/// The residual rule's scores: a size route's maps there and back lose a share of every
/// position's cells, unevenly (something to choose by); the identity there and back loses
/// nothing.
#[test]
fn the_residual_rule_scores_what_the_maps_lose() {
    use molt::transplant::project::identity_projector;
    use molt::transplant::select::residual_scores;
    let l = common::tiny_ladder();
    let mut routes = Routes::new(l, vec![common::tiny_projectors().clone()], Variant::Auto);
    let (forward, back) = (routes.get(0, 2).unwrap(), routes.get(2, 0).unwrap());
    let ms = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let mut src = Context::new(ms.clone(), common::cfg_long()).unwrap();
    let toks = ms.tokenize(TEXT, false).unwrap();
    src.decode(&toks).unwrap();
    let blob = src.export_state().unwrap();
    let (_, stream) = KvSnapshot::parse_single_stream(&blob).unwrap();

    let scores = residual_scores(&stream, &forward, &back).unwrap();
    assert_eq!(scores.len(), toks.len(), "one score per position");
    assert!(
        scores.iter().all(|s| s.is_finite() && *s > 1e-3),
        "{scores:?}"
    );
    let (lo, hi) = scores
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &s| (a.min(s), b.max(s)));
    assert!(hi > lo * 1.2, "uneven across positions: {lo} .. {hi}");

    let id = identity_projector(&forward.src);
    let none = residual_scores(&stream, &id, &id).unwrap();
    assert!(none.iter().all(|s| *s < 1e-4), "{none:?}");
    // Maps that do not fit the cache are refused, not scored.
    assert!(residual_scores(&stream, &back, &forward).is_err());
}
