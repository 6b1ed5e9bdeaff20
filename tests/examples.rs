//! Every program under `examples/` runs on the tiny ladder and says what it should (they are
//! built by `cargo test` beside the tests; this runs the built binaries).

mod common;

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    let path = common::target_profile_dir().join("examples").join(name);
    assert!(
        path.exists(),
        "{} is not built (cargo test builds the examples)",
        path.display()
    );
    path
}

fn manifest() -> String {
    let _ = common::tiny_ladder();
    common::fixture_dir()
        .join("tiny.toml")
        .display()
        .to_string()
}

fn run(name: &str, args: &[&str]) -> String {
    // The tiny ladder's fitted projectors, found where an installed Molt looks:
    // `$MOLT_HOME/projectors/<ladder>/`.
    let home = common::tiny_projectors()
        .parent()
        .expect("projectors sit in the fixture directory")
        .to_path_buf();
    let out = Command::new(example(name))
        .env("MOLT_HOME", home)
        .args(args)
        .output()
        .expect("example runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn stream_prints_each_token_with_its_rung() {
    let out = run("stream", &[&manifest(), "hello"]);
    assert!(out.contains("[big] "), "{out}");
    assert!(out.contains(" tokens, first after "), "{out}");
}

#[test]
fn two_conversations_switch_at_the_cut_and_keep_their_contexts() {
    let out = run("two_conversations", &[&manifest()]);
    assert!(out.contains("↘ budget cut to"), "{out}");
    assert!(out.contains("big → "), "{out}");
    // A's second turn is answered with its first turn in the prompt (its cache came back from
    // memory, or — after a switch left projected cells in it — its messages were read again).
    let second = out
        .lines()
        .find_map(|l| l.strip_prefix("A's second turn: "))
        .expect("A's second turn line");
    let prompt: usize = second
        .split(' ')
        .next()
        .and_then(|s| s.parse().ok())
        .expect("prompt tokens");
    let first = out
        .lines()
        .find_map(|l| l.strip_prefix("A: "))
        .expect("A's first answer line");
    let answered: usize = first
        .split(' ')
        .next()
        .and_then(|s| s.parse().ok())
        .expect("A's tokens");
    assert!(prompt > answered, "{out}");
}

#[test]
fn hibernate_then_resume_in_a_new_process_on_a_smaller_rung() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.molt-state").display().to_string();
    let saved = run("hibernate", &["save", &manifest(), &file]);
    assert!(saved.contains("hibernated on big"), "{saved}");
    let resumed = run("hibernate", &["resume", &manifest(), &file, "small"]);
    assert!(resumed.contains("resumed on small"), "{resumed}");
    assert!(resumed.contains("[small]"), "{resumed}");
}
