//! A conversation continued after a size switch: the projected cells the next prompt looks at
//! are re-read natively before it is answered (tiny ladder: the lever and its bookkeeping),
//! and on the real ladder (CI) the continued conversation still knows what its first turn
//! said.

mod common;

use molt::session::{Event, GenerateOptions, LeverInfo, Prompt, Session, SessionOptions};
use molt::transplant::select::TokenRecompute;

/// A window for a two-turn conversation of a few hundred tokens.
fn cfg() -> molt::engine::ContextConfig {
    common::context(2048, 256)
}

fn levers(s: &mut Session, prompt: &str, force: Option<(usize, usize)>) -> Vec<LeverInfo> {
    let mut out = Vec::new();
    s.generate(
        &Prompt::User(prompt.into()),
        &GenerateOptions {
            max_tokens: 16,
            force_switch: force,
            ..GenerateOptions::default()
        },
        &mut |e| {
            if let Event::Lever(l) = e {
                out.push(l.clone());
            }
        },
    )
    .unwrap();
    out
}

#[test]
fn the_next_prompt_rereads_the_projected_cells_it_looks_at() {
    let l = common::tiny_ladder().clone();
    let run = |recompute: bool| {
        // Without the refill, which would re-read every projected cell behind the answer
        // (this ~100-token history within a couple of tokens): the refresh is what re-reads
        // the cells a refill left, or all of them when it is off.
        let mut opts = SessionOptions {
            projector_dirs: vec![common::tiny_projectors().clone()],
            observe_footprint: false,
            refill_chunk: 0,
            ..SessionOptions::default()
        };
        // The position unit at a twentieth: on this ~100-token conversation the default's
        // floor (64 positions, whole sentences) would re-read every projected cell at the
        // switch itself and leave nothing for the next prompt to refresh.
        opts.token_recompute = recompute.then(|| TokenRecompute {
            follow: 8,
            ..TokenRecompute::attention(0.05)
        });
        let mut s = Session::with_options(l.clone(), cfg(), "big", opts).unwrap();
        let first = "The staging host is ash vault and the pager code is quill spool. Write a long note about release planning, budgets, hiring and the design review of the cache.";
        let none = levers(&mut s, first, Some((6, 2)));
        assert!(none.is_empty(), "{none:?}");
        let after_switch = s.projected_positions();
        let cached = s.history().len();
        let second = levers(&mut s, "What is the pager code?", None);
        (
            after_switch,
            cached,
            second,
            s.projected_positions(),
            s.cache_is_trustworthy(),
        )
    };
    let (after, cached, second, left, trusted) = run(true);
    assert!(after > 0 && after < cached, "{after} of {cached} projected");
    let r = second
        .iter()
        .find(|l| l.lever == "refresh")
        .unwrap_or_else(|| panic!("no refresh: {second:?}"));
    assert!(r.tokens > 0 && r.tokens <= after, "{r:?}");
    // The re-read cells are no longer projected (nor are the positions the new prompt's
    // rendering no longer shares with the cache: the answer's end is read again).
    assert!(
        left + r.tokens <= after && left < after,
        "{left} + {} vs {after}",
        r.tokens
    );
    assert!(trusted);
    // Off: the projected cells stay and nothing is re-read; the cache is not to be built on.
    let (after, _, second, left, trusted) = run(false);
    assert!(second.is_empty(), "{second:?}");
    assert!(left > 0 && left <= after && !trusted, "{left} of {after}");
}

#[test]
fn real_ladder_a_continued_conversation_remembers_its_first_turn() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    let opts = SessionOptions::default();
    // The size route (onto the 0.5B) is the one that projects and re-reads cells; a precision
    // route would carry the cache unchanged and test nothing here.
    let tier2 = common::rung(l, "tier2").index;
    let mut s = Session::with_options(l.clone(), cfg(), "tier0", opts).unwrap();
    let mut switches = Vec::new();
    let mut sink = |e: &Event| {
        if let Event::Switch(x) = e {
            switches.push(x.clone());
        }
    };
    s.generate(
        &Prompt::User(
            "Please remember this for later: the staging database password is quartz-heron-314 and the on-call lead is Ravindra Lindqvist. Now write three sentences about why backups matter.".into(),
        ),
        &GenerateOptions {
            max_tokens: 48,
            force_switch: Some((6, tier2)),
            ..GenerateOptions::default()
        },
        &mut sink,
    )
    .unwrap();
    assert_eq!(switches.len(), 1);
    assert_eq!(switches[0].to, "tier2");
    assert!(switches[0].timings.recomputed > 0, "{:?}", switches[0]);
    let mut reused = 0;
    let mut refreshed = 0;
    let g = s
        .generate(
            &Prompt::User(
                "What is the staging database password, and who is the on-call lead? Answer in one sentence."
                    .into(),
            ),
            &GenerateOptions {
                max_tokens: 40,
                ..GenerateOptions::default()
            },
            &mut |e| match e {
                Event::Start { reused_tokens, .. } => reused = *reused_tokens,
                Event::Lever(l) if l.lever == "refresh" => refreshed = l.tokens,
                _ => {}
            },
        )
        .unwrap();
    eprintln!(
        "second turn: {reused} tokens reused, {refreshed} re-read: {:?}",
        g.text
    );
    assert!(reused > 0, "built on the cache, not re-read");
    assert_eq!(g.rungs_used, vec!["tier2".to_string()]);
    let text = g.text.to_lowercase();
    assert!(
        text.contains("quartz-heron-314") && text.contains("lindqvist"),
        "the continued conversation lost its first turn: {:?}",
        g.text
    );
}

/// Two turns on `home`; before the second the budget falls to what rung `to` holds: the switch
/// reported before the second answer, its prompt tokens read from the cache, and the answer.
fn second_turn_after_a_fall(
    l: &molt::ladder::Ladder,
    opts: SessionOptions,
    home: &str,
    to: usize,
    first: &str,
    second: &str,
    max_tokens: usize,
) -> (
    Vec<molt::session::SwitchInfo>,
    usize,
    usize,
    Session,
    String,
) {
    let (mut s, handle) = on_a_fixed_budget(l, opts, home);
    let (switches, _, _) = turn(&mut s, first, max_tokens);
    assert!(switches.is_empty(), "{switches:?}");
    // Room for `to` and the conversation, not for the rung above it.
    let tokens = s.history().len() as u64 + 64 + max_tokens as u64;
    let need = s.modelled_footprint(to, tokens);
    let above = s.modelled_footprint(to - 1, tokens);
    assert!(above > need, "{above} vs {need}");
    handle.set(need + (above - need) / 2);
    let (switches, reused, g) = turn(&mut s, second, max_tokens);
    (switches, reused, g.prompt_tokens, s, g.text)
}

/// A session on `home` reading its budget from a [`molt::pressure::FixedBudget`] (ample until
/// the handle sets it), its rungs' costs pinned.
fn on_a_fixed_budget(
    l: &molt::ladder::Ladder,
    opts: SessionOptions,
    home: &str,
) -> (Session, molt::pressure::FixedBudgetHandle) {
    let fixed = molt::pressure::FixedBudget::new(u64::MAX / 4);
    let handle = fixed.handle();
    let mut s = Session::with_options(l.clone(), cfg(), home, opts).unwrap();
    // Costs fixed, not measured at each load: tests share the process, and a load's growth of
    // its anonymous memory counts what other tests allocate meanwhile.
    s.pin_context_bytes(&vec![48 << 20; l.rungs.len()]);
    s.set_budget_source(Some(Box::new(fixed)));
    (s, handle)
}

/// One turn of at most `max_tokens`: its switches, the prompt tokens read from the cache, and
/// the answer.
fn turn(
    s: &mut Session,
    prompt: &str,
    max_tokens: usize,
) -> (
    Vec<molt::session::SwitchInfo>,
    usize,
    molt::session::Generation,
) {
    let (mut switches, mut reused) = (Vec::new(), 0);
    let g = s
        .generate(
            &Prompt::User(prompt.into()),
            &GenerateOptions {
                max_tokens,
                ..GenerateOptions::default()
            },
            &mut |e| match e {
                Event::Switch(x) => switches.push(x.clone()),
                Event::Start { reused_tokens, .. } => reused = *reused_tokens,
                _ => {}
            },
        )
        .unwrap();
    (switches, reused, g)
}

#[test]
fn a_budget_that_falls_between_two_answers_carries_the_cache_down_through_the_switch() {
    let l = common::tiny_ladder().clone();
    let opts = |strategy| SessionOptions {
        projector_dirs: vec![common::tiny_projectors().clone()],
        observe_footprint: false,
        strategy,
        ..SessionOptions::default()
    };
    let first = "The staging host is ash vault and the pager code is quill spool.";
    let second = "What is the pager code?";
    for to in [1, 2] {
        let (switches, reused, prompt, s, _) = second_turn_after_a_fall(
            &l,
            opts(molt::session::Strategy::Molt),
            "big",
            to,
            first,
            second,
            8,
        );
        // Carried: one switch before the answer's first token, the earlier turns' tokens
        // read from the cache, the big rung no longer loaded.
        assert_eq!(switches.len(), 1, "{switches:?}");
        let sw = &switches[0];
        assert_eq!((sw.at_token, sw.from.as_str()), (0, "big"), "{sw:?}");
        assert_eq!(sw.to, l.rungs[to].name());
        assert_eq!(sw.method, molt::session::SwitchMethod::Molt, "{sw:?}");
        assert!(reused > 0 && reused < prompt, "{reused} of {prompt}");
        assert_eq!(s.current_index(), to);
        assert!(!s.loaded()[0], "{:?}", s.loaded());
        // A re-prefill strategy re-reads the conversation there instead.
        let (switches, reused, _, s, _) = second_turn_after_a_fall(
            &l,
            opts(molt::session::Strategy::Reprefill),
            "big",
            to,
            first,
            second,
            8,
        );
        assert!(switches.is_empty(), "{switches:?}");
        assert_eq!(reused, 0);
        assert_eq!(s.current_index(), to);
    }
}

#[test]
fn real_ladder_a_conversation_moved_down_between_two_answers_remembers_its_first_turn() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    let first = "Please remember this for later: the build cache lives on host larkspur-17 and the release manager is Oyelaran Petrakis. Now write two sentences about why caches matter.";
    let second = "On which host does the build cache live, and who is the release manager? Answer in one sentence.";
    // Decided on the modelled costs alone: the tests share the process, whose measured
    // memory counts the others' models too.
    let opts = SessionOptions {
        observe_footprint: false,
        ..SessionOptions::default()
    };
    // A precision route (same weights' family, other quantization) and the size route.
    for to in ["q3km", "tier2"] {
        let to = common::rung(l, to).index;
        let (switches, reused, prompt, _, text) =
            second_turn_after_a_fall(l, opts.clone(), "tier0", to, first, second, 40);
        eprintln!(
            "tier0 -> {}: {reused} of {prompt} prompt tokens from the cache, {:?}: {text:?}",
            l.rungs[to].name(),
            switches.first().map(|s| (s.method, s.timings.cost_ms))
        );
        assert_eq!(switches.len(), 1, "{switches:?}");
        assert_eq!(switches[0].method, molt::session::SwitchMethod::Molt);
        assert!(reused > 0, "carried, not re-read");
        let t = text.to_lowercase();
        assert!(
            t.contains("larkspur-17") && t.contains("petrakis"),
            "moved down between two answers, the conversation lost its first turn: {text:?}"
        );
    }
}

#[test]
fn a_budget_that_comes_back_between_two_answers_moves_the_conversation_up_before_the_next() {
    let l = common::tiny_ladder().clone();
    let opts = SessionOptions {
        projector_dirs: vec![common::tiny_projectors().clone()],
        observe_footprint: false,
        ..SessionOptions::default()
    };
    let (mut s, handle) = on_a_fixed_budget(&l, opts, "big");
    turn(
        &mut s,
        "The staging host is ash vault and the pager code is quill spool.",
        8,
    );
    // On its home rung: nothing to move up to.
    assert_eq!(s.promote_idle().unwrap(), None);
    // The budget falls to what the smallest rung holds: the next answer is carried down.
    let to = l.rungs.len() - 1;
    let tokens = s.history().len() as u64 + 64 + 8;
    let need = s.modelled_footprint(to, tokens);
    handle.set(need + need / 50);
    let (switches, _, g) = turn(&mut s, "What is the pager code?", 8);
    assert_eq!(switches.len(), 1, "{switches:?}");
    assert_eq!(s.current_index(), to, "{:?}", g.rungs_used);
    // Still low: it stays.
    assert_eq!(s.promote_idle().unwrap(), None);
    assert_eq!(s.current_index(), to);
    // Memory comes back while the user types: the conversation moves up between the answers,
    // read natively on the home rung.
    handle.set(u64::MAX / 4);
    let cached = s.history().len();
    let m = s
        .promote_idle()
        .unwrap()
        .expect("the budget holds the home rung again");
    assert_eq!(
        (m.from.as_str(), m.to.as_str(), m.tokens),
        (l.rungs[to].name(), "big", cached),
        "{m:?}"
    );
    assert_eq!(s.current_index(), 0);
    assert_eq!(s.history().len(), cached);
    assert_eq!(s.projected_positions(), 0);
    assert!(s.cache_is_trustworthy());
    // The next answer starts on the home rung with the conversation cached: no switch, only
    // the new turn read (moved up at the answer's start, it had re-read it all: 0 reused).
    let (switches, reused, g) = turn(&mut s, "And the staging host?", 8);
    assert!(switches.is_empty(), "{switches:?}");
    assert_eq!(g.rungs_used, vec!["big".to_string()]);
    assert!(
        reused > 0 && reused < g.prompt_tokens,
        "{reused} of {}",
        g.prompt_tokens
    );
    // Nothing to do once home.
    assert_eq!(s.promote_idle().unwrap(), None);
}
