//! Memory-pressure levers on real llama.cpp execution (tiny models): shedding context live
//! and on an exported cache agree, a parked answer resumes when the budget returns and
//! continues exactly as an unpressured one, shedding under a budget below the whole cache
//! keeps the answer going, and a token-clock trace that would park forever is a clear error.
//! (Parking's bit-exactness and RSS fall: `tests/parking.rs`; conditions A/B:
//! `tests/conditions.rs`.)

mod common;

use molt::engine::{Context, Model, ModelOptions};
use molt::kv::{KvSnapshot, ParseOptions};
use molt::pressure::{FixedBudget, Trace, TraceBudget};
use molt::routes::{self, Variant};
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionError, SessionOptions};
use molt::transplant::shift::shed_stream;
use std::time::Duration;

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns. fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); } Shedding drops the oldest context but never the system prompt.";

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// llama.cpp's own shed (seq_rm + seq_add, K-shift on the next decode) and Molt's shed of an
/// exported cache (drop cells, re-rotate keys in Rust) give the same next-token logits, to f16
/// rounding of the cache; and both differ clearly from keeping the keys at their old angles.
#[test]
fn live_shed_and_blob_shed_agree() {
    let l = common::tiny_ladder();
    for rung in [0, 2] {
        let info = &l.rungs[rung];
        let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
        let toks = model.tokenize(TEXT, false).unwrap();
        assert!(toks.len() > 40, "{} tokens", toks.len());
        let (pinned, n) = (4usize, 16usize);
        let next = toks[7];

        let mut live = Context::new(model.clone(), common::cfg()).unwrap();
        live.decode(&toks).unwrap();
        live.shed_and_decode(pinned, n, &[next]).unwrap();
        assert_eq!(live.n_past(), toks.len() - n + 1);
        assert_eq!(live.seq_pos_max(), i32::try_from(toks.len() - n).unwrap());
        assert_eq!(live.seq_pos_min(), 0);

        let mut src = Context::new(model.clone(), common::cfg()).unwrap();
        src.decode(&toks).unwrap();
        let blob = src.export_state().unwrap();
        let opts = ParseOptions {
            sections: Some(1),
            ..ParseOptions::default()
        };
        let rope = routes::binding(info).rope;
        let mut snap = KvSnapshot::parse(&blob, opts).unwrap();
        let stats = shed_stream(snap.single_stream_mut().unwrap(), 4, 16, &rope).unwrap();
        assert_eq!((stats.removed, stats.shifted), (n, toks.len() - pinned - n));
        let mut dst = Context::new(model.clone(), common::cfg()).unwrap();
        dst.import_state(&snap.to_bytes().unwrap()).unwrap();
        assert_eq!(dst.n_past(), toks.len() - n);
        dst.decode(&[next]).unwrap();
        let d = max_abs(live.logits(), dst.logits());
        assert!(d < 0.05, "{}: live vs blob shed differ by {d}", info.name());

        // Control: the same cells at the new positions without re-rotating the keys.
        let mut stale = KvSnapshot::parse(&blob, opts).unwrap();
        let s = stale.single_stream_mut().unwrap();
        let keep: Vec<usize> = (0..s.cells.len())
            .filter(|&i| s.cells[i].pos < 4 || s.cells[i].pos >= 20)
            .collect();
        s.cells = keep.iter().map(|&i| s.cells[i].clone()).collect();
        for c in &mut s.cells {
            if c.pos >= 20 {
                c.pos -= 16;
            }
        }
        for layer in &mut s.layers {
            layer.k = layer.k.select(ndarray::Axis(0), &keep);
            layer.v = layer.v.select(ndarray::Axis(0), &keep);
        }
        let mut wrong = Context::new(model.clone(), common::cfg()).unwrap();
        wrong.import_state(&stale.to_bytes().unwrap()).unwrap();
        wrong.decode(&[next]).unwrap();
        let d_wrong = max_abs(live.logits(), wrong.logits());
        assert!(
            d_wrong > 10.0 * d.max(1e-3),
            "{}: not re-rotating moved logits only by {d_wrong} (rotated: {d})",
            info.name()
        );
    }
}

#[test]
fn shed_refuses_bad_ranges() {
    let l = common::tiny_ladder();
    let model = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let toks = model.tokenize(TEXT, false).unwrap();
    let mut ctx = Context::new(model, common::cfg()).unwrap();
    ctx.decode(&toks[..10]).unwrap();
    let e = ctx
        .shed_and_decode(4, 7, &[toks[10]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("past the end"), "{e}");
    assert!(ctx.shed_and_decode(4, 2, &[]).is_err());
    assert_eq!(ctx.n_past(), 10, "a refused shed changes nothing");
}

/// Tests in this binary run in parallel threads of one process, whose memory the OS cannot
/// attribute to one session: the policy runs on its load-time measurements only.
fn session(opts: SessionOptions) -> Session {
    let opts = SessionOptions {
        observe_footprint: false,
        ..opts
    };
    Session::with_options(common::tiny_ladder().clone(), common::cfg(), "big", opts).unwrap()
}

fn answer(s: &mut Session, max: usize, sink: &mut dyn FnMut(&Event)) -> molt::session::Generation {
    s.generate(
        &Prompt::Text(TEXT.into()),
        &GenerateOptions {
            max_tokens: max,
            ..GenerateOptions::default()
        },
        sink,
    )
    .unwrap()
}

/// A budget that holds the cache but no rung's weights parks the answer mid-way; when it comes
/// back (on the wall clock, from another thread) the answer resumes on its rung and the greedy
/// text is exactly the unpressured one.
#[test]
fn parked_answer_resumes_when_memory_returns_and_is_unchanged() {
    let mut plain = session(SessionOptions::default());
    let expected = answer(&mut plain, 24, &mut |_| {});

    let mut s = session(SessionOptions::default());
    let costs = s.rung_costs();
    let smallest_resident = costs.iter().map(|c| c.resident_bytes()).min().unwrap();
    let kv_all = costs[0].kv_bytes(512);
    assert!(
        kv_all < smallest_resident,
        "tiny KV must fit under any rung's weights"
    );
    let high = 64 * costs[0].resident_bytes();
    let budget = FixedBudget::new(high);
    let handle = budget.handle();
    s.set_budget_source(Some(Box::new(budget)));
    let mut events = Vec::new();
    let g = answer(&mut s, 24, &mut |e| {
        match e {
            Event::Token { index: 8, .. } => handle.set(kv_all),
            Event::Lever(l) if l.lever == "park" => {
                let h = handle.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    h.set(high);
                });
            }
            _ => {}
        }
        events.push(e.clone());
    });
    assert_eq!(g.tokens, expected.tokens, "parking changed the answer");
    assert_eq!(g.stop, expected.stop);
    let levers: Vec<_> = g.levers.iter().map(|l| l.lever.as_str()).collect();
    assert_eq!(levers, vec!["park", "resume"]);
    assert_eq!(g.levers[0].at_token, 9);
    assert!(g.levers[1].parked_ms >= 250.0, "{:?}", g.levers[1]);
    assert!(g.stall_ms >= 250.0);
    assert!(g.switches.is_empty());
    assert!(events.iter().any(|e| matches!(e, Event::Stall { .. })));
    // After the park the policy's view is the parked cache alone, within the budget (the
    // measured side is checked on the real ladder, in a process of its own).
    let parked_sample = events
        .iter()
        .find_map(|e| match e {
            Event::Footprint(f) if f.parked => Some(f.clone()),
            _ => None,
        })
        .unwrap();
    assert!(
        parked_sample.modelled_bytes <= parked_sample.budget_bytes,
        "{parked_sample:?}"
    );
    assert!(parked_sample.modelled_bytes > 0);
    assert!(!s.is_parked());
}

/// Under a budget below even the whole cache, the oldest context is shed (never the pinned
/// prefix), the answer waits parked, and continues on a consistent, shorter cache afterwards.
#[test]
fn shedding_keeps_the_answer_alive_and_the_pinned_prefix() {
    let opts = SessionOptions {
        pinned_tokens: Some(6),
        variant: Variant::Truncate,
        ..SessionOptions::default()
    };
    let mut s = session(opts);
    let costs = s.rung_costs();
    let high = 64 * costs[0].resident_bytes();
    let budget = FixedBudget::new(high);
    let handle = budget.handle();
    s.set_budget_source(Some(Box::new(budget)));
    let mut prompt_len = 0;
    // Room for 20 tokens of KV on the smallest-KV rung: far less than the context.
    let tight = costs.iter().map(|c| c.kv_bytes_per_token).min().unwrap() * 20;
    let g = answer(&mut s, 20, &mut |e| match e {
        Event::Start { prompt_tokens, .. } => prompt_len = *prompt_tokens,
        Event::Token { index: 4, .. } => handle.set(tight),
        Event::Lever(l) if l.lever == "shed" => {
            let h = handle.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                h.set(high);
            });
        }
        _ => {}
    });
    assert_eq!(
        g.tokens.len(),
        20,
        "the answer ran to its length: {:?}",
        g.stop
    );
    let shed: usize = g
        .levers
        .iter()
        .filter(|l| l.lever == "shed")
        .map(|l| l.tokens)
        .sum();
    assert!(shed > 0, "{:?}", g.levers);
    assert!(g.levers.iter().any(|l| l.lever == "park"));
    assert!(g.levers.iter().any(|l| l.lever == "resume"));
    assert_eq!(s.pinned_tokens(), 6);
    // The cache holds prompt + answer − shed − the last (pending) token, at contiguous
    // positions from 0.
    let n = prompt_len + g.tokens.len() - 1 - shed;
    assert_eq!(s.history().len(), n);
    let at = s.current_index();
    let live = s.rung_mut(at).unwrap();
    assert_eq!(live.ctx.n_past(), n);
    assert_eq!(live.ctx.seq_pos_max(), i32::try_from(n).unwrap() - 1);
    assert_eq!(live.ctx.seq_pos_min(), 0);
}

/// A token-clock trace that drops below every rung would park the answer forever (its clock
/// stops with the answer): a clear error naming the token, not a hang.
#[test]
fn token_clock_trace_that_would_park_forever_is_a_clear_error() {
    let mut s = session(SessionOptions::default());
    let costs = s.rung_costs();
    let kv = costs[0].kv_bytes(512);
    let trace = Trace::parse(&format!(
        r#"{{"name":"floor","unit":"B","initial":{},"events":[{{"at":5,"budget":{kv}}}]}}"#,
        64 * costs[0].resident_bytes()
    ))
    .unwrap();
    s.set_budget_source(Some(Box::new(TraceBudget::new(trace))));
    let e = s
        .generate(
            &Prompt::Text(TEXT.into()),
            &GenerateOptions {
                max_tokens: 12,
                ..GenerateOptions::default()
            },
            &mut |_| {},
        )
        .unwrap_err();
    assert!(
        matches!(e, SessionError::ParkedForever { at_token: 5, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("ms clock"), "{e}");
}
