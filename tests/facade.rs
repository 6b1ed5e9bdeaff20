//! The facade on the tiny ladder: an answer streams with every token naming its rung, a budget
//! cut mid-answer moves it, conversations keep apart, hibernation round-trips, and bad input
//! gets a typed error naming the thing (nothing panics across the API).

mod common;

use molt::{Budget, Error, Event, Molt};
use std::path::PathBuf;

fn manifest() -> PathBuf {
    let _ = common::tiny_ladder();
    common::fixture_dir().join("tiny.toml")
}

/// An engine on the tiny ladder with its fitted projectors (the library ships none for it).
/// Several engines share this test process: what the process's anonymous memory shows cannot
/// be told apart between them, so the policy decides on the modelled costs alone.
fn builder() -> molt::MoltBuilder {
    Molt::builder(manifest().as_path())
        .options(molt::session::SessionOptions {
            observe_footprint: false,
            park_deadline: Some(std::time::Duration::from_secs(20)),
            ..molt::session::SessionOptions::default()
        })
        .projectors(common::tiny_projectors().clone())
}

/// A budget only the smallest rung fits: halfway between its estimate and the next one's.
fn cut(est: &molt::Estimate) -> u64 {
    let n = est.rungs.len();
    (est.rungs[n - 1].full_window_bytes + est.rungs[n - 2].full_window_bytes) / 2
}

#[test]
fn an_answer_streams_tokens_that_name_their_rung_and_ends_with_stats() {
    let molt = Molt::builder(manifest().as_path()).build().unwrap();
    let mut chat = molt.conversation();
    chat.set_max_tokens(6);
    let mut answer = chat.send("hello there").unwrap();
    let mut tokens = 0;
    for e in answer.by_ref() {
        if let Event::Token { rung, .. } = e.unwrap() {
            assert_eq!(rung, "big");
            tokens += 1;
        }
    }
    let stats = answer.stats().expect("complete after Done");
    assert_eq!(stats.tokens, tokens);
    assert!(stats.tokens > 0 && stats.tokens <= 6);
    assert_eq!(stats.rungs_used, vec!["big".to_string()]);
    assert!(stats.prompt_tokens > 0);
    assert_eq!(
        stats.cached_tokens, 0,
        "nothing was cached before the first turn"
    );
    // The second turn reuses the first's cache.
    let second = chat.ask("and again").unwrap();
    assert!(
        second.cached_tokens > 0,
        "the second turn read its conversation again: {second:?}"
    );
}

#[test]
fn a_budget_cut_mid_answer_moves_the_answer_off_the_large_rung() {
    let (est, builder) = builder().estimate().unwrap();
    let small = est.rungs.last().unwrap();
    assert_eq!(small.rung, "small");
    assert!(est.rungs[0].full_window_bytes > small.full_window_bytes);
    let molt = builder.build().unwrap();
    let mut chat = molt.conversation();
    chat.set_max_tokens(12);
    let cut = cut(&est);
    let mut rungs = Vec::new();
    let mut switches = 0;
    for e in chat.send("tell me a long story").unwrap() {
        match e.unwrap() {
            Event::Token { index, rung, .. } => {
                rungs.push(rung);
                if index == 2 {
                    molt.set_budget(Budget::Bytes(cut)).unwrap();
                }
            }
            Event::Switch(s) => {
                if switches == 0 {
                    assert_eq!(s.from, "big");
                }
                switches += 1;
            }
            _ => {}
        }
    }
    // Which smaller rung the policy lands on follows what each rung measured at its load (the
    // cut lies between the smaller rungs' estimates); the answer must leave `big` at the cut.
    assert!(switches >= 1, "no switch after the cut: {rungs:?}");
    assert_eq!(rungs.first().map(String::as_str), Some("big"));
    let last = rungs.last().cloned().unwrap_or_default();
    assert_ne!(last, "big", "{rungs:?}");
    assert!(
        rungs.iter().skip_while(|r| *r == "big").all(|r| r != "big"),
        "the answer went back to big under the cut: {rungs:?}"
    );
    assert_eq!(molt.current_rung().unwrap(), last);
    assert_eq!(molt.budget_bytes(), Some(cut));
}

#[test]
fn two_conversations_keep_their_own_context() {
    let molt = Molt::builder(manifest().as_path()).build().unwrap();
    let mut a = molt.conversation();
    let mut b = molt.conversation();
    a.set_max_tokens(4);
    b.set_max_tokens(4);
    let a1 = a.ask("first turn of a").unwrap();
    let b1 = b.ask("first turn of b").unwrap();
    assert_eq!(b1.cached_tokens, 0, "b started on a's cache");
    let a2 = a.ask("second turn of a").unwrap();
    // a's cache came back (hibernated in memory while b was answered): its first turn and
    // answer are not read again.
    assert!(
        a2.cached_tokens >= a1.prompt_tokens,
        "a's second turn cached {} of a first prompt of {}",
        a2.cached_tokens,
        a1.prompt_tokens
    );
    assert!(a2.prompt_tokens > a1.prompt_tokens);
}

#[test]
fn a_hibernated_conversation_resumes_in_another_engine_on_a_smaller_rung() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.molt-state");
    let prompt_tokens;
    {
        let molt = builder().build().unwrap();
        let mut chat = molt.conversation();
        chat.set_max_tokens(4);
        prompt_tokens = chat.ask("remember the number 6142").unwrap().prompt_tokens;
        assert!(chat.hibernate(&file).unwrap() > 0);
    }
    let molt = builder().start_on("small").build().unwrap();
    let mut chat = molt.resume(&file, Some("small")).unwrap();
    assert_eq!(molt.current_rung().unwrap(), "small");
    chat.set_max_tokens(4);
    let next = chat.ask("which number?").unwrap();
    assert_eq!(next.rungs_used, vec!["small".to_string()]);
    assert!(
        next.cached_tokens >= prompt_tokens,
        "the resumed cache was not used: {next:?}"
    );
}

#[test]
fn bad_input_gets_a_typed_error_that_names_it() {
    // A ladder that does not exist.
    let e = Molt::builder("/nonexistent/ladder.toml")
        .build()
        .err()
        .unwrap();
    assert!(matches!(e, Error::LadderNotFound { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/ladder.toml"), "{e}");
    // A rung that is not on the ladder.
    let e = Molt::builder(manifest().as_path())
        .start_on("huge")
        .build()
        .err()
        .unwrap();
    assert!(matches!(e, Error::UnknownRung { .. }), "{e}");
    assert!(e.to_string().contains("big, big-q8, small"), "{e}");
    // A budget no rung fits.
    let e = Molt::builder(manifest().as_path())
        .budget(Budget::Bytes(1 << 10))
        .build()
        .err()
        .unwrap();
    assert!(matches!(e, Error::BudgetBelowSmallest { .. }), "{e}");
    assert!(e.to_string().contains("small"), "{e}");
    // A malformed trace.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    let e = Molt::builder(manifest().as_path())
        .budget(Budget::trace(&bad))
        .build()
        .err()
        .unwrap();
    assert!(matches!(e, Error::Budget(_)), "{e}");
    assert!(e.to_string().contains("bad.json"), "{e}");

    let molt = Molt::builder(manifest().as_path()).build().unwrap();
    // Nothing to hibernate before the first answer.
    let chat = molt.conversation();
    let e = chat.hibernate(dir.path().join("x")).err().unwrap();
    assert!(matches!(e, Error::NothingToHibernate { .. }), "{e}");
    // A hibernation file that is not one.
    std::fs::write(dir.path().join("junk"), b"not a state file").unwrap();
    let e = molt.resume(dir.path().join("junk"), None).err().unwrap();
    assert!(matches!(e, Error::State(_)), "{e}");
    // send while an answer streams.
    let mut chat = molt.conversation();
    chat.set_max_tokens(4);
    let answer = chat.send("one").unwrap();
    let e = chat.send("two").err().unwrap();
    assert!(matches!(e, Error::AnswerInProgress { .. }), "{e}");
    answer.finish().unwrap();
    chat.ask("two").unwrap();
    // A conversation used after its engine is dropped.
    drop(molt);
    let e = chat.send("three").err().unwrap();
    assert!(matches!(e, Error::EngineGone), "{e}");
}

#[test]
fn a_hibernation_file_of_another_ladder_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("llama.molt-state");
    {
        let ladder = common::llama_ladder().clone();
        let molt = Molt::builder(ladder).build().unwrap();
        let mut chat = molt.conversation();
        chat.set_max_tokens(3);
        chat.ask("hello").unwrap();
        chat.hibernate(&file).unwrap();
    }
    let molt = Molt::builder(manifest().as_path()).build().unwrap();
    let e = molt.resume(&file, None).err().unwrap();
    assert!(matches!(e, Error::State(_)), "{e}");
}
