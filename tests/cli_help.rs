//! Golden `--help` texts: the CLI's surface is reviewed as a diff. After an intended change,
//! refresh with `MOLT_UPDATE_GOLDEN=1 cargo test --release --test cli_help` and commit the files
//! under tests/golden/.

mod common;

use std::path::PathBuf;

fn check(args: &[&str], golden: &str) {
    let out = assert_cmd::Command::new(common::molt_run())
        .env_remove("MOLT_LADDER")
        .env_remove("MOLT_HOME")
        .env("COLUMNS", "100")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(golden);
    if std::env::var_os("MOLT_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        text == want,
        "`molt-run {}` differs from {}; if the change is intended, run \
         MOLT_UPDATE_GOLDEN=1 cargo test --release --test cli_help and commit the file.\n\
         --- got ---\n{text}\n--- want ---\n{want}",
        args.join(" "),
        path.display()
    );
}

#[test]
fn top_level_help() {
    check(&["--help"], "molt-run.help.txt");
}

#[test]
fn chat_help() {
    check(&["chat", "--help"], "molt-run-chat.help.txt");
}

#[test]
fn generate_help() {
    check(&["generate", "--help"], "molt-run-generate.help.txt");
}

#[test]
fn serve_help() {
    check(&["serve", "--help"], "molt-run-serve.help.txt");
}
