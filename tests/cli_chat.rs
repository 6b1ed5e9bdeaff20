//! `molt-run chat` end to end on the tiny ladder: driven through a pseudo-terminal (rustyline,
//! colours, Ctrl-C as a real SIGINT from the terminal) and through a pipe (a script of lines).
//!
//! The tiny models are random-weight qwen2 models: their text is noise, so the assertions read
//! the chat's own lines — the switch line, the summary `[N tokens · big → small · 1 switch at
//! token K · prompt P (C cached) · …]` and `/status`.

mod common;

use rexpect::session::{PtySession, spawn_command};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A prompt on which the tiny big rung does not emit end-of-generation for thousands of tokens
/// (greedy decoding is deterministic), so a command typed after it starts lands mid-answer.
const LONG: &str = "Tell me a long story";

fn manifest() -> PathBuf {
    let _ = common::tiny_ladder();
    common::fixture_dir().join("tiny.toml")
}

/// `molt-run` with the tiny ladder and a clean environment (no user ladder, home or history).
fn molt_run(home: &Path) -> Command {
    let mut c = Command::new(common::molt_run());
    c.env_remove("MOLT_HOME")
        .env_remove("MOLT_LADDER")
        .env_remove("XDG_DATA_HOME")
        .env_remove("NO_COLOR")
        .env("HOME", home)
        .env("TERM", "xterm")
        .arg("--ladder")
        .arg(manifest())
        .args(["--threads", "1", "--n-ctx", "8192"]);
    c
}

fn chat(home: &Path, max_tokens: usize, extra: &[&str]) -> Command {
    let mut c = molt_run(home);
    c.arg("chat")
        .arg("--projectors")
        .arg(common::tiny_projectors())
        .args(["--temperature", "0", "--no-history", "--max-tokens"])
        .arg(max_tokens.to_string())
        .args(extra);
    c
}

/// rexpect hands the terminal's bytes over one `char` per byte; these two convert UTF-8 text
/// to that form (for needles) and back (for what was read).
fn bytes_of(s: &str) -> String {
    s.bytes().map(char::from).collect()
}

fn text_of(s: &str) -> String {
    #[allow(clippy::cast_possible_truncation)]
    let b: Vec<u8> = s.chars().map(|c| c as u8).collect();
    String::from_utf8_lossy(&b).into_owned()
}

/// Waits for `needle` (UTF-8) and returns what came before it, as text.
fn expect(p: &mut PtySession, needle: &str) -> String {
    text_of(
        &p.exp_string(&bytes_of(needle))
            .unwrap_or_else(|e| panic!("waiting for {needle:?}: {}", text_of(&e.to_string()))),
    )
}

/// Waits for an answer's summary line; returns (what came before, the line), as text.
fn expect_summary(p: &mut PtySession) -> (String, String) {
    let (before, line) = p
        .exp_regex(&bytes_of(r"\[\d+ tokens · [^\]]*\]"))
        .unwrap_or_else(|e| panic!("waiting for a summary: {}", text_of(&e.to_string())));
    (text_of(&before), text_of(&line))
}

/// Parses a summary line without a regex dependency.
fn regex_lite(line: &str) -> Option<(usize, String, Option<usize>, usize, usize, String)> {
    let inner = line.trim_start_matches('[').trim_end_matches(']');
    let parts: Vec<&str> = inner.split(" · ").collect();
    let tokens = parts.first()?.strip_suffix(" tokens")?.parse().ok()?;
    let rungs = parts.get(1)?.to_string();
    let switch = parts
        .iter()
        .find_map(|p| p.strip_prefix("1 switch at token "))
        .and_then(|k| k.parse().ok());
    let prompt = parts.iter().find_map(|p| p.strip_prefix("prompt "))?;
    let (p_tokens, cached) = prompt.split_once(" (")?;
    let cached = cached.strip_suffix(" cached)")?;
    Some((
        tokens,
        rungs,
        switch,
        p_tokens.parse().ok()?,
        cached.parse().ok()?,
        parts.last()?.to_string(),
    ))
}

#[test]
fn budget_cut_mid_answer_switches_and_the_conversation_goes_on() {
    let home = tempfile::tempdir().unwrap();
    let cmd = chat(home.path(), 4000, &["--color", "always"]);
    let mut p = spawn_command(cmd, Some(120_000)).unwrap();
    let banner = expect(&mut p, "› ");
    assert!(
        banner.contains("\x1b[32m■ big\x1b[0m"),
        "legend in colour: {banner:?}"
    );
    p.send_line(LONG).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    p.send_line("/budget small").unwrap();
    expect(&mut p, "budget capped at");
    expect(&mut p, "⇆ ");
    let switch = expect(&mut p, ")");
    assert!(
        switch.contains("\x1b[32mbig\x1b[0m → ") && switch.contains("(molt, "),
        "switch line: {switch:?}"
    );
    // Let the answer go on on the new rung for a moment, then stop it with Ctrl-C.
    std::thread::sleep(Duration::from_millis(400));
    p.send_control('c').unwrap();
    let (after, line) = expect_summary(&mut p);
    assert!(
        after.contains("\x1b[35m") || after.contains("\x1b[33m"),
        "tokens after the switch are drawn in the new rung's colour: {after:?}"
    );
    let (tokens, rungs, at, prompt, _, ending) =
        regex_lite(&line).unwrap_or_else(|| panic!("unexpected summary {line:?}"));
    let at = at.expect("one switch");
    assert!(at >= 1, "the switch came after the first token");
    assert!(
        tokens > at,
        "the answer continued after the switch ({tokens} tokens, switch at {at})"
    );
    assert!(rungs.starts_with("big → "), "{rungs}");
    // Normally Ctrl-C stops it; the small rung may also end the answer by itself first, and the
    // Ctrl-C then lands at the prompt (where it must not end the program either).
    assert!(
        ["stopped", "end of answer", "max tokens"].contains(&ending.as_str()),
        "{ending}"
    );
    assert!(prompt > 0);

    // The program is still there, on the smaller rung, with the conversation.
    expect(&mut p, "› ");
    p.send_line("/status").unwrap();
    let status = expect(&mut p, "process RSS");
    assert!(
        status.contains("▸ small") || status.contains("▸ big-q8"),
        "{status}"
    );
    assert!(status.contains("2 messages"), "{status}");
    assert!(status.contains("capped at"), "{status}");
    // A loaded rung says which micro-batch and repack it runs with, and why.
    assert!(status.contains("ubatch 128, repack "), "{status}");
    expect(&mut p, "› ");
    p.send_line("And then?").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    p.send_control('c').unwrap();
    let (_, line) = expect_summary(&mut p);
    let (_, rungs2, _, prompt2, cached2, _) =
        regex_lite(&line).unwrap_or_else(|| panic!("unexpected summary {line:?}"));
    assert!(
        !rungs2.starts_with("big "),
        "the second answer stays on the smaller rung: {rungs2}"
    );
    assert!(
        cached2 > 0 && prompt2 > prompt,
        "the second turn reads the first from the cache ({cached2} of {prompt2} cached)"
    );
    expect(&mut p, "› ");
    p.send_line("/quit").unwrap();
    p.exp_eof().unwrap();
    match p.process().wait().unwrap() {
        rexpect::process::WaitStatus::Exited(_, code) => assert_eq!(code, 0),
        other => panic!("chat did not exit cleanly: {other:?}"),
    }
}

/// What a size switch left out is read while the user types, not before the prompt: the answer
/// ends with its summary and the prompt, and the next message says what was read meanwhile
/// (all of it, or the part before the message came; the message reads the rest first).
#[test]
fn what_a_size_switch_left_out_is_read_while_the_user_types() {
    let home = tempfile::tempdir().unwrap();
    // No refill: the positions the switch's sparse read left out all wait for the fill.
    let cmd = chat(home.path(), 4000, &["--refill", "0"]);
    let mut p = spawn_command(cmd, Some(120_000)).unwrap();
    expect(&mut p, "› ");
    let notes = (1..=40)
        .map(|i| format!("Note {i}: the lamp in room {i} was checked and it works."))
        .collect::<Vec<_>>()
        .join(" ");
    p.send_line(&format!("{notes} Tell me a long story about the rooms."))
        .unwrap();
    std::thread::sleep(Duration::from_millis(400));
    p.send_line("/budget small").unwrap();
    expect(&mut p, "⇆ ");
    std::thread::sleep(Duration::from_millis(300));
    p.send_control('c').unwrap();
    let (before, _) = expect_summary(&mut p);
    assert!(
        !before.contains("left out"),
        "nothing is read between the answer's last token and its summary: {before:?}"
    );
    expect(&mut p, "› ");
    // The user takes a moment to type.
    std::thread::sleep(Duration::from_millis(1500));
    p.send_line("And then?").unwrap();
    let said = expect(&mut p, "while you typed");
    assert!(said.contains("positions the switch left out"), "{said:?}");
    let (_, line) = expect_summary(&mut p);
    assert!(regex_lite(&line).is_some(), "{line:?}");
    expect(&mut p, "› ");
    p.send_line("/quit").unwrap();
    p.exp_eof().unwrap();
}

#[test]
fn no_color_and_ctrl_c_at_the_prompt() {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = chat(home.path(), 4000, &[]);
    cmd.env("NO_COLOR", "1");
    let mut p = spawn_command(cmd, Some(120_000)).unwrap();
    let banner = expect(&mut p, "› ");
    assert!(
        banner.contains("no colour: each ⇆ line marks where the answer changed rung"),
        "{banner}"
    );
    p.send_control('c').unwrap();
    expect(&mut p, "Ctrl-C stops an answer");
    p.send_line(LONG).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    p.send_control('c').unwrap();
    let out = expect(&mut p, "stopped]");
    assert!(
        !out.contains("\x1b[32m"),
        "NO_COLOR: no colour codes: {out:?}"
    );
    expect(&mut p, "› ");
    p.send_line("/bogus").unwrap();
    expect(&mut p, "unknown command /bogus");
    p.send_control('d').unwrap();
    p.exp_eof().unwrap();
}

/// Piped input is a script: each line runs after the answer before it. A relative trace
/// switches at a known token; a cap switches at the next answer's first token.
#[test]
fn piped_script_with_trace_and_budget() {
    let home = tempfile::tempdir().unwrap();
    let trace = home.path().join("squeeze.json");
    std::fs::write(
        &trace,
        r#"{"name": "squeeze", "unit": "MiB", "clock": "token", "initial": 8000,
            "events": [{"at": 5, "frac": 1.05, "of": "small"}]}"#,
    )
    .unwrap();
    let script = format!(
        "/trace {}\nThe cache\n/trace off\n/budget 0.5\n/budget\n/budget off\n/status\n/reset\n/status\n",
        trace.display()
    );
    let (stdout, _) = piped_with(home.path(), 24, &script, &[]);
    assert!(
        !stdout.contains('\x1b'),
        "a pipe gets no colour: {stdout:?}"
    );
    assert!(
        stdout.contains("› The cache"),
        "piped lines are echoed: {stdout}"
    );
    assert!(stdout.contains("budget replays trace squeeze"), "{stdout}");
    assert!(stdout.contains("⇆ big → small (molt, "), "{stdout}");
    assert!(stdout.contains("1 switch at token 5"), "{stdout}");
    assert!(
        stdout.contains("budget capped at 512 KiB (no rung fits"),
        "{stdout}"
    );
    assert!(stdout.contains("budget cap lifted"), "{stdout}");
    assert!(stdout.contains("conversation forgotten"), "{stdout}");
    assert!(stdout.contains("0 messages"), "{stdout}");
}

#[test]
fn projectors_are_found_in_the_per_user_directory() {
    // As an installed binary would run: another working directory, no --projectors, the
    // projectors where `molt-run` documents the per-user data directory.
    let home = tempfile::tempdir().unwrap();
    let user = home.path().join(".local/share/molt/projectors/tiny");
    std::fs::create_dir_all(&user).unwrap();
    for f in std::fs::read_dir(common::tiny_projectors().join("tiny")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), user.join(f.file_name())).unwrap();
    }
    let trace = home.path().join("squeeze.json");
    std::fs::write(
        &trace,
        r#"{"name": "squeeze", "unit": "MiB", "initial": 8000,
            "events": [{"at": 3, "frac": 1.05, "of": "small"}]}"#,
    )
    .unwrap();
    let out = assert_cmd::Command::from_std(molt_run(home.path()))
        .current_dir(home.path())
        .args([
            "generate",
            "--prompt",
            "The cache",
            "--max-tokens",
            "8",
            "--trace",
        ])
        .arg(&trace)
        .timeout(Duration::from_secs(120))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(row["switches"][0]["method"], "molt", "{row}");
    assert_eq!(row["switches"][0]["to"], "small", "{row}");
}

#[test]
fn summary_lines_parse() {
    let s = "[57 tokens · big → small · 1 switch at token 12 · prompt 25 (0 cached) · TTFT 16 ms · 412.0 tok/s · stopped]";
    let (t, r, at, p, c, e) = regex_lite(s).unwrap();
    assert_eq!(
        (t, r.as_str(), at, p, c, e.as_str()),
        (57, "big → small", Some(12), 25, 0, "stopped")
    );
}

/// Runs a piped chat script in `home` (each line after the answer before it, at most 8 tokens
/// each); stdout and stderr, once it exited successfully.
fn piped(home: &Path, script: &str, extra: &[&str]) -> (String, String) {
    piped_with(home, 8, script, extra)
}

/// [`piped`] with answers of at most `max_tokens`.
fn piped_with(home: &Path, max_tokens: usize, script: &str, extra: &[&str]) -> (String, String) {
    let mut cmd = chat(home, max_tokens, extra);
    let out = assert_cmd::Command::from_std({
        cmd.stdin(std::process::Stdio::piped());
        cmd
    })
    .write_stdin(script.to_string())
    .timeout(Duration::from_secs(120))
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}

#[test]
fn resume_wakes_the_saved_conversation_and_status_says_where_its_cache_lives() {
    let home = tempfile::tempdir().unwrap();
    let state = home.path().join(".local/share/molt/state/chat.molt-state");
    let (stdout, stderr) = piped(home.path(), "The door code is 4711.\n/status\n", &[]);
    assert!(state.exists(), "saved in the per-user data directory");
    assert!(
        stdout.contains(&format!("cache RAM on big · saved to {}", state.display())),
        "{stdout}"
    );
    assert!(stderr.contains("conversation saved to"), "{stderr}");
    // Without --resume the saved conversation is not read: the first answer caches nothing.
    // With it, the second run starts from the file: its first prompt is partly cached.
    let (stdout, _) = piped(
        home.path(),
        "What is the door code?\n/status\n",
        &["--resume"],
    );
    assert!(
        stdout.contains(&format!(
            "resumed conversation \"chat\" from {}",
            state.display()
        )),
        "{stdout}"
    );
    let line = stdout
        .lines()
        .find_map(|l| {
            l.find('[')
                .map(|i| &l[i..])
                .filter(|t| t.contains(" cached)"))
        })
        .expect("a summary line");
    let cached: usize = line
        .split("prompt ")
        .nth(1)
        .and_then(|r| r.split(" (").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(cached > 0, "the woken cache was used: {line}");
    assert!(stdout.contains("2 messages"), "{stdout}");
    // A damaged file is refused by name, and the chat starts afresh.
    let mut b = std::fs::read(&state).unwrap();
    let n = b.len();
    b[n - 50] ^= 1;
    std::fs::write(&state, &b).unwrap();
    let (stdout, _) = piped(home.path(), "/status\n", &["--resume"]);
    assert!(
        stdout.contains(&format!(
            "refused state file {} is corrupt",
            state.display()
        )),
        "{stdout}"
    );
}

#[test]
fn memory_back_between_answers_moves_the_conversation_up_before_the_next_one() {
    let home = tempfile::tempdir().unwrap();
    let script = "/budget small\nThe cache\n/budget off\nGo on\n/status\n";
    let (stdout, _) = piped_with(home.path(), 6, script, &[]);
    let summaries: Vec<_> = stdout
        .lines()
        .filter(|l| l.starts_with('[') && l.contains(" tokens · "))
        .map(|l| regex_lite(l).unwrap_or_else(|| panic!("summary {l:?}")))
        .collect();
    assert_eq!(summaries.len(), 2, "{stdout}");
    // The first answer under the cap, on the small rung.
    assert_eq!(summaries[0].1, "small", "{stdout}");
    // The cap lifted: the conversation is moved up between the answers, said on its own line
    // before the next answer…
    let moved = stdout
        .find("⇡ small → big between answers")
        .unwrap_or_else(|| panic!("no move up between the answers: {stdout}"));
    let second = stdout.find("› Go on").unwrap();
    let lifted = stdout.find("budget cap lifted").unwrap();
    assert!(lifted < moved, "{stdout}");
    // …which starts on the big rung with the conversation cached: only its new turn read.
    let (_, rungs, switch, prompt, cached, _) = &summaries[1];
    assert_eq!((rungs.as_str(), *switch), ("big", None), "{stdout}");
    assert!(*cached > 0 && cached < prompt, "{stdout}");
    assert!(
        stdout[second..].lines().any(|l| l.starts_with("▸ big ")),
        "/status shows the big rung current: {stdout}"
    );
}
