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
        let mut opts = SessionOptions {
            projector_dirs: vec![common::tiny_projectors().clone()],
            observe_footprint: false,
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
