//! A switch down on the tiny ladder prepared ahead while the budget falls (the shadow): the
//! conversation is carried onto the small rung in the background while the big one goes on,
//! the small one follows it, and the switch, when the budget no longer holds both, is only the
//! small rung catching up with the last few tokens; the shadow is counted in the footprint, is
//! dropped when the fall stops, is not started by a single step down, and leaves the small rung's cache reading as its own.

mod common;

use common::events::{
    assert_never_over, assert_reads_as_fresh, one_at_a_time, prepares, switches,
    token_trace as trace,
};

use std::time::Duration;

use molt::ladder::Ladder;
use molt::pressure::TraceBudget;
use molt::sched::Policy;
use molt::session::{
    Event, GenerateOptions, PrepareInfo, PrepareState, Prompt, Session, SessionOptions, Strategy,
    SwitchInfo, SwitchMethod, TokenControl,
};

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns.";

/// Tokens every answer here generates.
const MAX_TOKENS: usize = 60;

/// Budgets, bytes, from the session's modelled costs at the answer's end: `both` holds the big
/// and the small rung side by side; `low` holds the small rung only.
struct Budgets {
    both: u64,
    low: u64,
}

/// A session on the tiny ladder's big rung, exact policy, costs as measured.
fn on_big(l: &Ladder, strategy: Strategy) -> (Session, Budgets) {
    on_big_paced(l, strategy, None)
}

/// [`on_big`] with carry paces kept in `pace_file`.
fn on_big_paced(
    l: &Ladder,
    strategy: Strategy,
    pace_file: Option<std::path::PathBuf>,
) -> (Session, Budgets) {
    let opts = SessionOptions {
        observe_footprint: false,
        policy: Policy::exact(),
        projector_dirs: vec![common::tiny_projectors().clone()],
        strategy,
        pace_file,
        ..SessionOptions::default()
    };
    let s = Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
    let small = l.rungs.len() - 1;
    let end = 200;
    let fp = |i: usize| s.modelled_footprint(i, end);
    let b = Budgets {
        both: fp(0) + fp(small) + (1 << 20),
        low: fp(small) + (fp(1) - fp(small)) / 2,
    };
    (s, b)
}

/// A budget that starts `margin` above `from` and falls by the same step every token from
/// token 4, to `to` at token 4 + `steps`.
fn ramp(from: u64, to: u64, margin: u64, steps: usize) -> Box<TraceBudget> {
    let top = from + margin;
    let step = (top - to) / steps as u64;
    let events: Vec<(usize, u64)> = (1..=steps)
        .map(|k| (4 + k, top - step * k as u64))
        .collect();
    trace(top, &events)
}

/// Keeps the random-weight rungs from ending an answer (end of text) before the budget has
/// fallen: the answer runs to its length.
struct NoEndOfText(Vec<usize>);

impl NoEndOfText {
    fn of(s: &mut Session) -> Self {
        let i = s.current_index();
        let model = s.rung_mut(i).expect("the current rung is loaded").model();
        Self(
            (0..model.n_vocab())
                .filter(|&t| molt::engine::Token::try_from(t).is_ok_and(|t| model.is_eog(t)))
                .collect(),
        )
    }
}

impl TokenControl for NoEndOfText {
    fn shape(&mut self, logits: &mut [f32]) {
        for &t in &self.0 {
            if let Some(l) = logits.get_mut(t) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// One answer, every event in order; the reader is slower than the tiny rungs decode while a
/// preparation runs, so the carry gets the tokens it needs within the answer.
fn answer(s: &mut Session) -> (molt::session::Generation, Vec<Event>) {
    answer_paced(s, MAX_TOKENS, Duration::from_millis(20))
}

/// [`answer`] with `max_tokens` and the reader's pause per token while a preparation runs.
fn answer_paced(
    s: &mut Session,
    max_tokens: usize,
    pause: Duration,
) -> (molt::session::Generation, Vec<Event>) {
    let mut events: Vec<Event> = Vec::new();
    let mut preparing = false;
    let mut no_end = NoEndOfText::of(s);
    let g = s
        .generate_with(
            &Prompt::Text(TEXT.into()),
            &GenerateOptions {
                max_tokens,
                ..GenerateOptions::default()
            },
            &mut no_end,
            &mut |e| {
                match e {
                    Event::Prepare(p) => preparing = p.state == PrepareState::Started,
                    Event::Switch(_) => preparing = false,
                    Event::Token { .. } if preparing => {
                        std::thread::sleep(pause);
                    }
                    _ => {}
                }
                events.push(e.clone());
            },
        )
        .unwrap();
    (g, events)
}

/// Tokens the switch re-read with the sampled one, from its note.
fn caught_up_at_switch(w: &SwitchInfo) -> usize {
    let note = w.note.as_deref().unwrap_or("");
    let i = note
        .find(" token(s) caught up at the switch")
        .unwrap_or_else(|| panic!("no catch-up in the note: {note}"));
    let head = &note[..i];
    head[head.rfind(' ').map_or(0, |j| j + 1)..]
        .parse()
        .unwrap()
}

#[test]
fn a_falling_budget_carries_the_conversation_down_ahead_and_the_switch_only_catches_up() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (mut s, b) = on_big(l, Strategy::Molt);
    let (big, small) = (l.rungs[0].name(), l.rungs[2].name());
    // Falls from well above the pair to the small rung alone over 30 tokens.
    s.set_budget_source(Some(ramp(b.both, b.low, b.both - b.low, 30)));
    let (g, events) = answer(&mut s);

    let p = prepares(&events);
    assert!(!p.is_empty(), "a shadow was started: {events:?}");
    let started = p[0];
    assert_eq!(started.state, PrepareState::Started, "{p:?}");
    assert_eq!((started.from.as_str(), started.to.as_str()), (big, small));
    assert!(
        started.at_token > 4,
        "the fall began after token 4: {started:?}"
    );
    assert!(
        !p.iter().any(|p| p.state != PrepareState::Started),
        "neither dropped nor failed: {p:?}"
    );
    assert_never_over(&events);

    let w = switches(&events);
    assert_eq!(w.len(), 1, "one switch, straight to the small rung: {w:?}");
    let down = w[0];
    assert_eq!((down.from.as_str(), down.to.as_str()), (big, small));
    assert!(down.at_token > started.at_token, "{down:?}");
    assert_eq!(down.method, SwitchMethod::Molt, "{down:?}");
    assert!(down.timings.carried_ms > 0.0, "{down:?}");
    assert_eq!(down.timings.load_ms, 0.0, "{down:?}");
    let note = down.note.as_deref().unwrap_or("");
    assert!(note.contains("carried in the background"), "{note}");
    assert!(
        note.contains("taken early"),
        "taken when the budget stopped holding both, before the big rung itself stopped fitting: {note}"
    );
    assert!(
        caught_up_at_switch(down) <= molt::session::SHADOW_STEP + 1,
        "the switch re-read only the last few tokens: {note}"
    );
    assert_eq!(
        down.timings.caught_up,
        down.at_token - started.at_token,
        "the small rung re-read every token the big one wrote since the carry began"
    );
    assert_eq!(s.current_rung(), small);
    assert!(g.tokens.len() > down.at_token);
    for e in &events {
        if let Event::Token { index, rung, .. } = e {
            let want = if *index < down.at_token { big } else { small };
            assert_eq!(rung, want, "token {index}");
        }
    }
}

#[test]
fn a_carry_a_pace_file_says_could_not_finish_is_not_started_and_the_answer_says_so_once() {
    // The fall of the first test, in a process whose pace file (a machine's measurements,
    // kept between processes) says a carry onto any rung takes far longer than the budget
    // holds both rungs: no shadow is started, the answer says why once, the switch is carried
    // at its token, and what that switch cost replaces the file's pace.
    use molt::session::pace::{PaceEntry, PaceFile, key};
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("carry_pace.json");
    let threads = common::cfg().n_threads;
    let mut f = PaceFile::new();
    for r in &l.rungs {
        let slow = PaceEntry {
            ms_per_cell: Some(1e6),
            load_ms: None,
        };
        f.rungs.insert(key(&r.sha256, threads), slow);
    }
    f.save(&path).unwrap();
    let (mut s, b) = on_big_paced(l, Strategy::Molt, Some(path.clone()));
    assert_eq!(s.pace_note(), None, "the file is this machine's");
    let small = l.rungs[2].name();
    s.set_budget_source(Some(ramp(b.both, b.low, b.both - b.low, 30)));
    let (_, events) = answer(&mut s);
    let p = prepares(&events);
    assert!(
        !p.iter().any(|p| p.state == PrepareState::Started),
        "no shadow started: {p:?}"
    );
    let skipped: Vec<_> = p
        .iter()
        .filter(|p| p.state == PrepareState::Skipped)
        .collect();
    assert_eq!(skipped.len(), 1, "said once: {p:?}");
    let why = skipped[0].reason.as_deref().unwrap_or("");
    assert!(why.contains("carrying it would take"), "{why}");
    assert_never_over(&events);
    let w = switches(&events);
    let down = w
        .iter()
        .find(|w| w.to == small)
        .expect("down to the small rung");
    assert_eq!(
        down.timings.carried_ms, 0.0,
        "carried at its token: {down:?}"
    );
    let kept = PaceFile::load(&path).unwrap().expect("the file");
    let pace = kept.rungs[&key(&l.rungs[2].sha256, threads)];
    assert!(
        pace.ms_per_cell.is_some_and(|ms| ms < 1e6),
        "the switch's measured pace replaced the file's: {pace:?}"
    );
    // A file of another processor is not used, and the session says so.
    let mut other = kept;
    other.cpu = "another processor".into();
    other.save(&path).unwrap();
    let (s, _) = on_big_paced(l, Strategy::Molt, Some(path));
    assert!(
        s.pace_note()
            .is_some_and(|n| n.contains("another processor")),
        "{:?}",
        s.pace_note()
    );
}

#[test]
fn a_shadow_carried_natively_leaves_the_small_rungs_cache_as_its_own() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (mut s, b) = on_big(l, Strategy::Reprefill);
    s.set_budget_source(Some(ramp(b.both, b.low, b.both - b.low, 30)));
    let (_, events) = answer(&mut s);
    let w = switches(&events);
    assert_eq!(w.len(), 1, "{w:?}");
    let down = w[0];
    assert_eq!(down.to, l.rungs[2].name());
    assert!(down.timings.carried_ms > 0.0, "{down:?}");
    assert_eq!(down.method, SwitchMethod::Reprefill, "{down:?}");

    assert_reads_as_fresh(&mut s, 2, down.at_token, "the shadow's catch-ups");
}

#[test]
fn a_fall_that_stops_drops_the_shadow_and_the_answer_stays_on_the_big_rung() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (mut s, b) = on_big(l, Strategy::Molt);
    let top = b.both + (b.both - b.low);
    // Falls for 4 tokens, then holds well above the pair for the rest of the answer.
    let hold = b.both + (b.both - b.low) / 2;
    let mut ev: Vec<(usize, u64)> = (1..=4)
        .map(|k| (4 + k, top - (top - hold) * k as u64 / 4))
        .collect();
    ev.push((9, hold));
    s.set_budget_source(Some(trace(top, &ev)));
    // The trend reads the last 3 s of the wall clock: the reader keeps the shadow's tokens
    // slow enough for the fall to leave that window within the answer.
    let (_, events) = answer_paced(&mut s, 120, Duration::from_millis(60));
    let p = prepares(&events);
    assert_eq!(
        p.first().map(|p| p.state),
        Some(PrepareState::Started),
        "{p:?}"
    );
    let dropped = p
        .iter()
        .find(|p| p.state == PrepareState::Dropped)
        .unwrap_or_else(|| panic!("the shadow was dropped once the fall stopped: {p:?}"));
    assert!(
        dropped
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("no longer falls")),
        "{dropped:?}"
    );
    assert!(switches(&events).is_empty(), "no switch: {events:?}");
    assert_eq!(s.current_rung(), l.rungs[0].name());
    assert_never_over(&events);
}

#[test]
fn a_flat_budget_starts_no_shadow() {
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (mut s, b) = on_big(l, Strategy::Molt);
    s.set_budget_source(Some(trace(b.both, &[])));
    let (_, events) = answer(&mut s);
    assert!(prepares(&events).is_empty(), "{events:?}");
    assert!(switches(&events).is_empty());
}

#[test]
fn a_single_step_down_starts_no_shadow() {
    // An application taking its memory at once: the budget steps down once, to a level that
    // still holds both rungs. Nothing more is coming; the window's slope alone would predict a
    // fall to zero and carry the conversation down for nothing while the answer slows.
    let _serial = one_at_a_time();
    let l = common::tiny_ladder();
    let (mut s, b) = on_big(l, Strategy::Molt);
    let top = b.both + (b.both - b.low);
    s.set_budget_source(Some(trace(top, &[(5, b.both)])));
    let (_, events) = answer(&mut s);
    assert!(prepares(&events).is_empty(), "{:?}", prepares(&events));
    assert!(switches(&events).is_empty());
    assert_eq!(s.current_rung(), l.rungs[0].name());
}

/// What a user checks by hand, on the real ladder: a conversation whose first answer was moved
/// down to the 0.5B rung by a switch prepared ahead (carried in the background, then caught
/// up) still answers a question about its first turn.
#[test]
fn real_ladder_a_conversation_carried_down_ahead_remembers_its_first_turn() {
    // Its loads would be charged to a tiny test's rungs measured meanwhile.
    let _serial = one_at_a_time();
    let Some(l) = common::real_ladder() else {
        return;
    };
    let opts = SessionOptions {
        research: molt::session::Research {
            forced_down_waits: true,
            ..molt::session::Research::default()
        },
        ..SessionOptions::default()
    };
    let tier2 = common::rung(l, "tier2").index;
    let mut s =
        Session::with_options(l.clone(), common::context(2048, 256), "tier0", opts).unwrap();
    let mut switches: Vec<SwitchInfo> = Vec::new();
    let mut started: Vec<PrepareInfo> = Vec::new();
    s.generate(
        &Prompt::User(
            "Keep this in mind for later: the build server's address is 10.42.7.19 and the release manager is Oyelaran Fitzgibbon. Now write four sentences about code review.".into(),
        ),
        &GenerateOptions {
            max_tokens: 96,
            force_switch: Some((4, tier2)),
            ..GenerateOptions::default()
        },
        &mut |e| match e {
            Event::Switch(x) => switches.push(x.clone()),
            Event::Prepare(p) => started.push(p.clone()),
            _ => {}
        },
    )
    .unwrap();
    assert_eq!(switches.len(), 1, "{switches:?}");
    let down = &switches[0];
    assert_eq!(down.to, "tier2");
    assert!(
        down.timings.carried_ms > 0.0,
        "carried in the background: {down:?}, {started:?}"
    );
    assert!(down.timings.recomputed > 0, "{down:?}");
    let g = s
        .generate(
            &Prompt::User(
                "What is the build server's address, and who is the release manager? Answer in one sentence."
                    .into(),
            ),
            &GenerateOptions {
                max_tokens: 40,
                ..GenerateOptions::default()
            },
            &mut |_| {},
        )
        .unwrap();
    eprintln!("second turn: {:?}", g.text);
    assert_eq!(g.rungs_used, vec!["tier2".to_string()]);
    let text = g.text.to_lowercase();
    assert!(
        text.contains("10.42.7.19") && text.contains("fitzgibbon"),
        "the conversation carried down ahead lost its first turn: {:?}",
        g.text
    );
}
