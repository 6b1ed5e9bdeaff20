//! State files on the tiny ladder: a conversation hibernated to a file and woken in a fresh
//! session (as after a restart) answers its next turn exactly as the session that never
//! stopped, re-reading only the new turn; and every file a reader must refuse — truncated,
//! corrupt, foreign (other rung, other format version), stale — is refused with the file's name
//! and the reason, before anything is imported.

mod common;

use std::path::Path;

use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions};
use molt::state::{Expect, StateDir, StateFile};

fn session(rung: &str) -> Session {
    let opts = SessionOptions {
        observe_footprint: false,
        ..SessionOptions::default()
    };
    Session::with_options(common::tiny_ladder().clone(), common::cfg(), rung, opts).unwrap()
}

/// Answers `prompt`; the answer's text and how many prompt tokens came from the cache.
fn answer(s: &mut Session, prompt: &str) -> (String, usize, usize) {
    let mut reused = 0;
    let g = s
        .generate(
            &Prompt::User(prompt.into()),
            &GenerateOptions {
                max_tokens: 12,
                ..GenerateOptions::default()
            },
            &mut |e| {
                if let Event::Start { reused_tokens, .. } = e {
                    reused = *reused_tokens;
                }
            },
        )
        .unwrap();
    (g.text, g.prompt_tokens, reused)
}

fn rungs() -> Vec<(String, String)> {
    common::tiny_ladder()
        .rungs
        .iter()
        .map(|r| (r.name().to_string(), r.sha256.clone()))
        .collect()
}

/// One hibernated two-turn conversation on `rung`, written to `dir`: the file's path, its
/// first turn's length, and the third turn's answer and cache reuse by the session that kept
/// running (the reference a woken session must match).
fn hibernated(dir: &StateDir, rung: &str) -> (std::path::PathBuf, usize, (String, usize)) {
    let mut s = session(rung);
    let (_, first_turn_len, _) = answer(&mut s, "The door code is 4711. Remember it.");
    answer(&mut s, "And the colour is teal.");
    let file = s
        .hibernate("conv-a", first_turn_len)
        .unwrap()
        .expect("a cache");
    assert_eq!(file.meta.rung, rung);
    assert_eq!(file.meta.tokens, s.history());
    dir.write("conv-a", &file).unwrap();
    let (reference, _, reused) = answer(&mut s, "What is the door code?");
    assert!(reused >= first_turn_len, "{reused}");
    (dir.file_of("conv-a"), first_turn_len, (reference, reused))
}

#[test]
fn a_woken_conversation_answers_as_if_it_never_stopped_and_rereads_only_its_new_turn() {
    let d = tempfile::tempdir().unwrap();
    let dir = StateDir::open(d.path(), 64).unwrap();
    let (path, first_turn_len, (reference, reference_reused)) = hibernated(&dir, "small");
    let r = rungs();
    let file = StateFile::load(
        &path,
        &Expect {
            rungs: &r,
            n_ctx: common::cfg().n_ctx,
            continues: None,
        },
    )
    .unwrap();
    // A fresh session on the big rung, as a restarted server is: the file puts it on `small`.
    let mut s = session("big");
    s.wake(&file).unwrap();
    assert_eq!(s.current_rung(), "small");
    assert_eq!(s.history(), file.meta.tokens.as_slice());
    assert_eq!(s.conversation(), file.meta.messages.as_slice());
    let (text, prompt_tokens, reused) = answer(&mut s, "What is the door code?");
    assert_eq!(text, reference, "the woken cache answers differently");
    // As much came from the file as from the cache of the session that kept running: all of
    // the history up to where the rendered answer's tokens differ from the sampled ones.
    assert_eq!(reused, reference_reused, "of {prompt_tokens}");
    assert!(
        reused >= first_turn_len && reused < prompt_tokens,
        "{reused}"
    );
}

fn expect_refused(path: &Path, continues: Option<&[i32]>, kind: &str, says: &str) {
    let r = rungs();
    let e = StateFile::load(
        path,
        &Expect {
            rungs: &r,
            n_ctx: common::cfg().n_ctx,
            continues,
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), kind, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains(says), "{msg}");
}

#[test]
fn truncated_corrupt_foreign_and_stale_files_are_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    let dir = StateDir::open(d.path(), 64).unwrap();
    let (path, first_turn_len, _) = hibernated(&dir, "big");
    let good = std::fs::read(&path).unwrap();
    let file = StateFile::from_bytes(&path, &good).unwrap();

    // Truncated: a write cut short anywhere.
    for cut in [10, good.len() / 2, good.len() - 1] {
        std::fs::write(&path, &good[..cut]).unwrap();
        expect_refused(&path, None, "truncated", "truncated");
    }
    // Corrupt: one byte of the KV blob changed.
    let mut bad = good.clone();
    let at = good.len() - 200;
    bad[at] = bad[at].wrapping_add(1);
    std::fs::write(&path, &bad).unwrap();
    expect_refused(&path, None, "corrupt", "checksum");
    // Foreign: another format version.
    let mut bad = good.clone();
    bad[8] = bad[8].wrapping_add(1);
    std::fs::write(&path, &bad).unwrap();
    expect_refused(&path, None, "foreign", "format version");
    // Foreign: written by another rung's weights under this rung's name (a file edited or
    // copied between machines): the sha256 decides, not the name.
    let mut other = file.clone();
    other.meta.rung_sha256 = common::tiny_ladder().rungs[2].sha256.clone();
    other.write_atomic(&path).unwrap();
    expect_refused(&path, None, "foreign", "sha256");
    // Stale: a request whose earlier turns differ from the file's.
    file.write_atomic(&path).unwrap();
    let mut edited = file.meta.tokens.clone();
    edited[first_turn_len / 2] += 1;
    expect_refused(&path, Some(&edited), "stale", "shares");
    // And the untouched file still loads for the request that continues it.
    let mut next = file.meta.tokens.clone();
    next.extend([1, 2, 3]);
    let r = rungs();
    StateFile::load(
        &path,
        &Expect {
            rungs: &r,
            n_ctx: common::cfg().n_ctx,
            continues: Some(&next),
        },
    )
    .unwrap();
}

#[test]
fn a_blob_another_rung_wrote_is_refused_by_llama_cpp_and_leaves_the_session_empty() {
    let d = tempfile::tempdir().unwrap();
    let dir = StateDir::open(d.path(), 64).unwrap();
    let (path, _, _) = hibernated(&dir, "small");
    let mut file = StateFile::from_bytes(&path, &std::fs::read(&path).unwrap()).unwrap();
    // The small rung's blob, claimed for the big rung (whose layout differs).
    file.meta.rung = "big".into();
    let mut s = session("big");
    answer(&mut s, "Something else entirely.");
    let e = s.wake(&file).unwrap_err();
    assert!(e.to_string().contains("big"), "{e}");
    assert!(s.history().is_empty(), "half-restored: {:?}", s.history());
    // The session still answers, from scratch.
    let (_, _, reused) = answer(&mut s, "What is the door code?");
    assert_eq!(reused, 0);
}

#[test]
fn a_file_whose_rung_the_budget_no_longer_holds_wakes_through_the_switch() {
    let d = tempfile::tempdir().unwrap();
    let dir = StateDir::open(d.path(), 64).unwrap();
    let (path, first_turn_len, _) = hibernated(&dir, "big");
    let file = StateFile::from_bytes(&path, &std::fs::read(&path).unwrap()).unwrap();
    // Started on the big rung (the session's home), moved down to the small one. The
    // projection alone (no token recompute): the default's choice would cover most of this
    // short conversation and re-read all of it at the wake, leaving no projected cell.
    let opts = SessionOptions {
        observe_footprint: false,
        projector_dirs: vec![common::tiny_projectors().clone()],
        token_recompute: None,
        ..SessionOptions::default()
    };
    let mut s =
        Session::with_options(common::tiny_ladder().clone(), common::cfg(), "big", opts).unwrap();
    s.move_idle(2).unwrap();
    answer(&mut s, "Something else entirely.");
    assert_eq!(s.current_rung(), "small");
    let tokens = file.meta.tokens.len() as u64 + 1;
    let big = s.modelled_footprint(0, tokens);
    // The budget holds a smaller rung, not the big one the file was written on: the file's
    // cache is carried to the largest rung that fits, the big rung never loaded.
    s.retune_with(big - 1).unwrap();
    let fits = (1..3)
        .find(|&r| s.modelled_footprint(r, tokens) < big)
        .unwrap();
    s.wake(&file).unwrap();
    assert_eq!(s.current_index(), fits);
    assert!(
        !s.loaded()[0],
        "the big rung was not loaded: {:?}",
        s.loaded()
    );
    assert_eq!(s.history(), file.meta.tokens, "the file's conversation");
    assert_eq!(s.conversation(), file.meta.messages.as_slice());
    // Its next turn re-reads only the new turn, on the projected cache.
    let (_, prompt_tokens, reused) = answer(&mut s, "What is the door code?");
    assert!(
        reused >= first_turn_len && reused < prompt_tokens,
        "{reused} of {prompt_tokens}"
    );
    // A cache with projected cells is not written to a file again.
    assert!(s.hibernate("conv-a", first_turn_len).unwrap().is_none());
    // Memory back: the same file wakes on its rung.
    s.retune_with(big * 2).unwrap();
    s.wake(&file).unwrap();
    assert_eq!(s.current_rung(), "big");
    assert_eq!(s.history(), file.meta.tokens);
}
