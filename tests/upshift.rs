//! A switch up on the tiny ladder never waits for a load: under a rising budget the answer goes
//! on on the small rung while the big one loads in the background, and switches once it is
//! ready; the rung loading is counted in the footprint the budget holds; a budget that falls
//! meanwhile drops the load (and, if it still holds the big rung alone, the switch is taken
//! with the source freed first); a load that fails leaves the answer where it is, said in an
//! event. The conversation is carried onto the big rung in the background as well, so the
//! switch itself is only the big rung catching up with the tokens written meanwhile.

mod common;

use common::events::{
    assert_never_over, assert_reads_as_fresh, one_at_a_time, prepares, switches, token_rungs,
    token_trace as trace,
};

use std::time::Duration;

use molt::ladder::Ladder;
use molt::sched::Policy;
use molt::session::{
    Event, GenerateOptions, LiveRung, PrepareState, Prompt, Session, SessionOptions, Strategy,
};

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns.";

/// Tokens every answer here generates.
const MAX_TOKENS: usize = 120;

/// Budgets, bytes, from the session's own modelled costs (measured at load): `low` holds the
/// small rung only; `both` holds the small and the big rung side by side for the whole answer;
/// `big_only` holds the big rung for the whole answer but not both rungs at any point of it.
struct Budgets {
    low: u64,
    both: u64,
    big_only: u64,
    /// The two rungs' footprints at the prompt's length, summed.
    pair_at_prompt: u64,
}

/// A session on the tiny ladder `l`, moved idle to its smallest rung, with the costs the policy
/// uses fixed at what the loads measured and no hysteresis, so the budgets mean what they say.
fn on_small(l: &Ladder) -> (Session, Budgets) {
    on_small_with(l, Strategy::Molt)
}

/// [`on_small`] with the switch's strategy.
fn on_small_with(l: &Ladder, strategy: Strategy) -> (Session, Budgets) {
    let opts = SessionOptions {
        observe_footprint: false,
        policy: Policy::exact(),
        projector_dirs: vec![common::tiny_projectors().clone()],
        strategy,
        ..SessionOptions::default()
    };
    let mut s = Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
    let small = l.rungs.len() - 1;
    s.move_idle(small).unwrap();
    assert_eq!(s.loaded(), vec![false, false, true], "only the small rung");
    let prompt = s
        .rung_mut(small)
        .unwrap()
        .model()
        .tokenize(TEXT, false)
        .unwrap()
        .len() as u64;
    let end = prompt + MAX_TOKENS as u64 + 1;
    let fp = |i: usize, t: u64| s.modelled_footprint(i, t);
    let (small_end, q8_end, big_end) = (fp(small, end), fp(1, end), fp(0, end));
    assert!(
        q8_end > small_end && big_end >= q8_end,
        "a ladder, largest first"
    );
    let pair_at_prompt = fp(small, prompt) + fp(0, prompt);
    let big_only = big_end + fp(small, prompt) / 2;
    assert!(
        big_only < pair_at_prompt,
        "the answer's KV growth stays under half the small rung: {big_only} vs {pair_at_prompt}"
    );
    let b = Budgets {
        low: small_end + (q8_end - small_end) / 2,
        both: small_end + big_end + (1 << 20),
        big_only,
        pair_at_prompt,
    };
    (s, b)
}

/// One answer; every event, in order. While a background load runs the reader is slower than
/// the tiny rungs decode, so the load gets the tokens it needs within the answer.
fn answer(s: &mut Session) -> (molt::session::Generation, Vec<Event>) {
    let mut events: Vec<Event> = Vec::new();
    let mut loading = false;
    let g = s
        .generate(
            &Prompt::Text(TEXT.into()),
            &GenerateOptions {
                max_tokens: MAX_TOKENS,
                ..GenerateOptions::default()
            },
            &mut |e| {
                match e {
                    Event::Prepare(p) => loading = p.state == PrepareState::Started,
                    Event::Switch(_) => loading = false,
                    Event::Token { .. } if loading => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    _ => {}
                }
                events.push(e.clone());
            },
        )
        .unwrap();
    (g, events)
}

#[test]
fn a_switch_up_goes_on_decoding_on_the_source_while_the_destination_loads_then_switches() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (mut s, b) = on_small(l);
    let (small, big) = (l.rungs[2].name(), l.rungs[0].name());
    s.set_budget_source(Some(trace(b.low, &[(4, b.both)])));
    let (g, events) = answer(&mut s);

    let p = prepares(&events);
    assert_eq!(
        p.len(),
        1,
        "one background load, neither dropped nor failed: {p:?}"
    );
    let started = p[0];
    assert_eq!(started.state, PrepareState::Started);
    assert_eq!((started.from.as_str(), started.to.as_str()), (small, big));
    assert_eq!(started.at_token, 4, "memory came back before token 4");
    // The rung loading is counted: both rungs' footprints, within the budget.
    assert!(
        started.modelled_bytes >= b.pair_at_prompt,
        "{} B counted, the pair needs {} B",
        started.modelled_bytes,
        b.pair_at_prompt
    );
    assert_never_over(&events);

    let w = switches(&events);
    assert_eq!(w.len(), 1, "{w:?}");
    let up = w[0];
    assert_eq!((up.from.as_str(), up.to.as_str()), (small, big));
    assert!(up.at_token > started.at_token, "{up:?}");
    assert_eq!(
        up.timings.load_ms, 0.0,
        "nobody waited for the load: {up:?}"
    );
    assert!(up.timings.load_parts.is_none(), "{up:?}");
    assert!(up.timings.prepared_ms > 0.0, "{up:?}");
    assert_eq!(
        up.timings.prepared_tokens,
        up.at_token - started.at_token,
        "every token from the load's start to the switch was decoded on the source"
    );
    // The conversation was carried onto the big rung in the background too: projected there
    // while the small one went on, then caught up with what the small one wrote meanwhile.
    assert!(up.timings.carried_ms > 0.0, "{up:?}");
    assert_eq!(up.method, molt::session::SwitchMethod::Molt, "{up:?}");
    let note = up.note.as_deref().unwrap_or("");
    assert!(note.contains("carried in the background"), "{note}");
    assert_eq!(
        up.timings.caught_up,
        up.at_token - started.at_token,
        "the big rung re-read every token the small one wrote since the carry began"
    );

    // In order: tokens on the small rung before the load started and while it ran, the
    // switch, then the big rung's.
    let pos = |pred: &dyn Fn(&Event) -> bool| events.iter().position(pred).unwrap();
    let at_start = pos(&|e| matches!(e, Event::Prepare(_)));
    let at_switch = pos(&|e| matches!(e, Event::Switch(_)));
    assert!(at_start < at_switch);
    let between = events[at_start..at_switch]
        .iter()
        .filter(|e| matches!(e, Event::Token { rung, .. } if rung == small))
        .count();
    assert_eq!(
        between,
        up.at_token - started.at_token,
        "tokens kept flowing"
    );
    for (i, rung) in token_rungs(&events) {
        let want = if i < up.at_token { small } else { big };
        assert_eq!(rung, want, "token {i}");
    }
    // The random-weight big rung may end the answer early (end of text), never before its
    // first token.
    assert!(g.tokens.len() > up.at_token, "{} tokens", g.tokens.len());
    assert_eq!(s.current_rung(), big);
    assert_eq!(g.rungs_used, vec![small.to_string(), big.to_string()]);
}

#[test]
fn a_budget_that_falls_during_the_background_load_drops_it() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (small, big) = (l.rungs[2].name(), l.rungs[0].name());

    // Back to where only the small rung fits: the load is dropped, the answer stays.
    let (mut s, b) = on_small(l);
    s.set_budget_source(Some(trace(b.low, &[(4, b.both), (5, b.low)])));
    let (g, events) = answer(&mut s);
    assert_eq!(g.tokens.len(), MAX_TOKENS);
    let p = prepares(&events);
    assert_eq!(p.len(), 2, "{p:?}");
    assert_eq!((p[0].state, p[0].at_token), (PrepareState::Started, 4));
    assert_eq!((p[1].state, p[1].at_token), (PrepareState::Dropped, 5));
    assert_eq!(p[1].to, big);
    assert!(
        p[1].reason.as_deref().unwrap_or("").contains("no longer"),
        "{p:?}"
    );
    assert!(switches(&events).is_empty());
    assert!(token_rungs(&events).iter().all(|(_, r)| r == small));
    assert_eq!(
        s.loaded(),
        vec![false, false, true],
        "nothing of the load is left"
    );
    assert!(s.modelled_now(s.history().len() as u64 + 1) <= b.low);
    assert_never_over(&events);

    // Down to where the big rung fits alone but not beside the small one: the load is dropped
    // and the switch is taken on the spot, the source freed first.
    let (mut s, b) = on_small(l);
    s.set_budget_source(Some(trace(b.low, &[(4, b.both), (5, b.big_only)])));
    let (g, events) = answer(&mut s);
    assert!(g.tokens.len() > 5, "{} tokens", g.tokens.len());
    let p = prepares(&events);
    assert_eq!(p.len(), 2, "{p:?}");
    assert_eq!((p[1].state, p[1].at_token), (PrepareState::Dropped, 5));
    assert!(
        p[1].reason
            .as_deref()
            .unwrap_or("")
            .contains("side by side"),
        "{p:?}"
    );
    let w = switches(&events);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].to.as_str(), w[0].at_token), (big, 5));
    assert!(w[0].timings.load_parts.is_some(), "loaded at the switch");
    assert_eq!(w[0].timings.prepared_ms, 0.0);
    assert!(
        w[0].note
            .as_deref()
            .unwrap_or("")
            .contains("source freed first"),
        "{w:?}"
    );
    assert_eq!(s.current_rung(), big);
    assert_never_over(&events);

    // With no room for both from the start, no background load is tried at all.
    let (mut s, b) = on_small(l);
    s.set_budget_source(Some(trace(b.low, &[(4, b.big_only)])));
    let (_, events) = answer(&mut s);
    assert!(prepares(&events).is_empty(), "{:?}", prepares(&events));
    let w = switches(&events);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].to.as_str(), w[0].at_token), (big, 4));
    assert_never_over(&events);
}

#[test]
fn a_background_load_that_fails_leaves_the_answer_on_the_source() {
    let _serial = one_at_a_time();
    // The big rung's file is a copy of our own, spoiled once the session no longer maps it.
    let dir = tempfile::tempdir().unwrap();
    let mut l = common::tiny_ladder().clone();
    let copy = dir.path().join("big.gguf");
    std::fs::copy(&l.rungs[0].path, &copy).unwrap();
    l.rungs[0].path = copy.clone();
    let (small, big) = (l.rungs[2].name().to_string(), l.rungs[0].name().to_string());
    let (mut s, b) = on_small(&l);
    std::fs::write(&copy, b"not a model").unwrap();
    s.set_budget_source(Some(trace(b.low, &[(4, b.both)])));
    let (g, events) = answer(&mut s);
    assert_eq!(g.tokens.len(), MAX_TOKENS, "the answer runs to its length");
    let p = prepares(&events);
    assert_eq!(
        p.len(),
        2,
        "started, then failed once, never retried: {p:?}"
    );
    assert_eq!((p[0].state, p[0].at_token), (PrepareState::Started, 4));
    let failed = p[1];
    assert_eq!(failed.state, PrepareState::Failed);
    assert_eq!(
        (failed.from.as_str(), failed.to.as_str()),
        (small.as_str(), big.as_str())
    );
    let why = failed.reason.as_deref().unwrap_or("");
    assert!(why.contains(&big) && why.contains("stays on"), "{why}");
    assert!(switches(&events).is_empty());
    assert!(token_rungs(&events).iter().all(|(_, r)| *r == small));
    assert_eq!(s.current_rung(), small);
    assert_eq!(s.loaded(), vec![false, false, true]);
    assert_never_over(&events);
}

#[test]
fn a_rung_whose_footprint_is_measured_loads_without_the_warm_up() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let info = &l.rungs[2];
    let setup = molt::speed::RungSetup::default_at(common::cfg().n_ubatch);
    let warmed = LiveRung::load_with(info, common::cfg(), setup).unwrap();
    assert!(warmed.parts.warmup_ms > 0.0, "{:?}", warmed.parts);
    let known = warmed.context_bytes.max(1);
    let mut skipped = LiveRung::load_known(info, common::cfg(), setup, Some(known)).unwrap();
    assert_eq!(skipped.parts.warmup_ms, 0.0, "{:?}", skipped.parts);
    assert!(skipped.context_bytes >= known, "the known cost is kept");
    // The warm-up only measured: the first decode after skipping it reads as after one.
    let mut warmed = warmed;
    let tokens = warmed.model().tokenize(TEXT, false).unwrap();
    warmed.ctx.decode(&tokens).unwrap();
    skipped.ctx.decode(&tokens).unwrap();
    assert_eq!(warmed.ctx.logits(), skipped.ctx.logits());
    drop((warmed, skipped));

    // In a session: a rung loaded again (here the home rung, measured when the session
    // started) skips it; a rung loaded for the first time does not.
    let opts = SessionOptions {
        standby: false,
        prepare_up: false,
        projector_dirs: vec![common::tiny_projectors().clone()],
        ..SessionOptions::default()
    };
    let mut s = Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
    let switch = |s: &mut Session, to: usize| {
        let mut w = None;
        s.generate(
            &Prompt::Text(TEXT.into()),
            &GenerateOptions {
                max_tokens: 3,
                force_switch: Some((1, to)),
                ..GenerateOptions::default()
            },
            &mut |e| {
                if let Event::Switch(i) = e {
                    w = Some(i.clone());
                }
            },
        )
        .unwrap();
        w.expect("the forced switch happened")
    };
    let down = switch(&mut s, 2);
    let first = down.timings.load_parts.expect("loaded at the switch");
    assert!(
        first.warmup_ms > 0.0,
        "small's first load measures: {first:?}"
    );
    let up = switch(&mut s, 0);
    let again = up.timings.load_parts.expect("loaded at the switch");
    assert_eq!(
        again.warmup_ms, 0.0,
        "big was measured at the start: {again:?}"
    );
    let down = switch(&mut s, 2);
    let again = down.timings.load_parts.expect("loaded at the switch");
    assert_eq!(
        again.warmup_ms, 0.0,
        "small was measured by its first load: {again:?}"
    );
}

/// What skipping the warm-up saves at a load, and what it moves onto the first decode: a
/// measurement, not a check (`--ignored --nocapture`). `MOLT_MEASURE_RUNG` names a rung of the
/// real ladder (`tier2`; the tiny ladder's `small` when unset), `MOLT_MEASURE_THREADS` the
/// decode threads (1), `MOLT_MEASURE_REPS` the repetitions (5), alternating the two loads.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn measure_the_warm_up_skip() {
    let _serial = one_at_a_time();
    let env = |k: &str| std::env::var(k).ok();
    let (l, name) = match env("MOLT_MEASURE_RUNG") {
        Some(n) => (
            common::real_ladder().expect("the real ladder is fetched"),
            n,
        ),
        None => (common::tiny_ladder(), "small".to_string()),
    };
    let threads: u32 = env("MOLT_MEASURE_THREADS").map_or(1, |t| t.parse().unwrap());
    let reps: usize = env("MOLT_MEASURE_REPS").map_or(5, |t| t.parse().unwrap());
    let info = common::rung(l, &name);
    let config = molt::engine::ContextConfig {
        n_threads: threads,
        ..molt::engine::ContextConfig::default()
    };
    let setup = molt::speed::RungSetup::default_at(config.n_ubatch);
    let tokens = {
        let r = LiveRung::load_with(info, config, setup).unwrap();
        r.model().tokenize(TEXT, false).unwrap()[..8].to_vec()
    };
    let mut known = None;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows: [Vec<(f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..reps {
        for (i, k) in [None, known].into_iter().enumerate() {
            let t0 = std::time::Instant::now();
            let mut r = LiveRung::load_known(info, config, setup, k).unwrap();
            let load_ms = t0.elapsed().as_secs_f64() * 1e3;
            let t1 = std::time::Instant::now();
            r.ctx.decode(&tokens[..1]).unwrap();
            let first_ms = t1.elapsed().as_secs_f64() * 1e3;
            rows[i].push((load_ms, r.parts.warmup_ms, first_ms));
            known = Some(r.context_bytes);
        }
    }
    for (i, what) in ["warm-up", "skipped"].iter().enumerate() {
        let col = |f: fn(&(f64, f64, f64)) -> f64| median(rows[i].iter().map(f).collect());
        println!(
            "{name} ({threads} thread(s), n_ctx {}, {reps} reps) {what}: load {:.1} ms (warm-up part {:.1}), first decode after it {:.1} ms, load + first decode {:.1} ms (medians)",
            config.n_ctx,
            col(|r| r.0),
            col(|r| r.1),
            col(|r| r.2),
            col(|r| r.0 + r.2),
        );
    }
}

#[test]
fn a_conversation_carried_up_natively_in_the_background_reads_as_a_fresh_decode() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    // The re-prefill strategy: the background carry re-reads the history on the big rung, so
    // after the switch its cache is the big rung's own, whatever the catch-up's batches were.
    let (mut s, b) = on_small_with(l, Strategy::Reprefill);
    s.set_budget_source(Some(trace(b.low, &[(4, b.both)])));
    let (_, events) = answer(&mut s);
    let w = switches(&events);
    assert_eq!(w.len(), 1, "{w:?}");
    let up = w[0];
    assert_eq!(up.to, l.rungs[0].name());
    assert!(up.timings.carried_ms > 0.0, "{up:?}");
    assert_eq!(up.method, molt::session::SwitchMethod::Reprefill, "{up:?}");
    assert_eq!(up.timings.load_ms, 0.0, "{up:?}");

    assert_reads_as_fresh(&mut s, 0, up.at_token, "the carried cache");
}
