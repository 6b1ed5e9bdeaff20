//! Faults injected on purpose (`MOLT_FAULT=site:nth`, see `molt::fault`), each through the real
//! `molt-run` binary on the tiny ladder, so a fault that kills the process kills only the child:
//! the destination's load fails mid-switch, the KV import fails, the anchor is unreadable, the
//! process is killed while it writes a file (requantize, the lock, train-projectors' anchors),
//! the hog child dies. For each: the answer completes or ends with a clear error, the session
//! comes back on its source (the next answer switches normally), nothing half-written is taken
//! as valid later, and the next run repairs or redoes the work.
//!
//! The hook is compiled into every build and inert without `MOLT_FAULT` (the module doc says
//! why), so these run in CI's one default-feature release build.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

/// With `MOLT_RELIABILITY_RECORD=FILE`, appends this fault's outcome as a JSON line (what
/// `molt-run bench --reliability` gathers into `results/reliability.json`); called only after
/// the test's assertions held, so `lost` is false by construction of a passing test.
fn record(site: &str, outcome: &str) {
    use std::io::Write;
    let Some(path) = std::env::var_os("MOLT_RELIABILITY_RECORD") else {
        return;
    };
    let row = serde_json::json!({"site": site, "outcome": outcome, "lost": false});
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("record file");
    writeln!(f, "{row}").expect("record");
}

fn molt_run(home: &Path, ladder: &Path) -> assert_cmd::Command {
    let mut c = assert_cmd::Command::new(common::molt_run());
    c.env_remove("MOLT_HOME")
        .env_remove("MOLT_LADDER")
        .env_remove("MOLT_FAULT")
        .env_remove("XDG_DATA_HOME")
        .env("HOME", home)
        .arg("--ladder")
        .arg(ladder)
        .args(["--threads", "1"])
        .timeout(Duration::from_secs(300));
    c
}

/// Two prompts under a trace that leaves room for the small rung only from token 6: each
/// answer moves big → small between tokens 5 and 6. Returns the process output and its rows.
fn two_answers_with_a_switch(
    dir: &Path,
    fault: Option<&str>,
    projectors: &Path,
    extra: &[&str],
) -> (Output, Vec<serde_json::Value>) {
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "The cache\nTell me a story\n").unwrap();
    let trace = dir.join("cut.json");
    std::fs::write(
        &trace,
        r#"{"name": "cut", "unit": "MiB", "initial": 8000,
            "events": [{"at": 6, "frac": 1.05, "of": "small"}]}"#,
    )
    .unwrap();
    let results = dir.join("results.jsonl");
    let _ = std::fs::remove_file(&results);
    let mut cmd = molt_run(dir, &common::fixture_dir().join("tiny.toml"));
    if let Some(f) = fault {
        cmd.env("MOLT_FAULT", f);
    }
    let out = cmd
        .arg("generate")
        .arg("--prompt-file")
        .arg(&prompts)
        .arg("--trace")
        .arg(&trace)
        .arg("--projectors")
        .arg(projectors)
        .args(extra)
        .args(["--max-tokens", "12", "--out"])
        .arg(&results)
        .output()
        .unwrap();
    let rows = std::fs::read_to_string(&results)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (out, rows)
}

/// A copy of the tiny projectors with every rung's anchor beside them.
fn projectors_with_anchors(dir: &Path) -> PathBuf {
    let src = common::tiny_projectors().join("tiny");
    let out = dir.join("projectors");
    std::fs::create_dir_all(out.join("tiny")).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, out.join("tiny").join(p.file_name().unwrap())).unwrap();
        }
    }
    let written =
        molt::train::write_anchors(common::tiny_ladder(), common::cfg_long(), &out).unwrap();
    assert!(!written.is_empty(), "the tiny rungs have anchors");
    out
}

/// The second answer of a faulted run: it must have switched big → small by projection, which
/// shows the session came back whole on its source after the first answer's fault.
fn assert_next_answer_switches(rows: &[serde_json::Value]) {
    let next = rows.last().expect("a row per prompt");
    assert_eq!(
        next["rungs_used"],
        serde_json::json!(["big", "small"]),
        "{next}"
    );
    assert_eq!(next["switches"][0]["method"], "molt", "{next}");
}

/// A switch whose `fault` fires: the first answer ends with an error naming every one of
/// `words`, and the next answer switches by projection.
fn a_failed_switch_ends_its_answer_only(fault: &str, words: &[&str], extra: &[&str]) {
    let _ = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let (out, rows) =
        two_answers_with_a_switch(dir.path(), Some(fault), common::tiny_projectors(), extra);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(rows.len(), 2, "{stderr}");
    let err = rows[0]["error"]
        .as_str()
        .expect("the first answer ends with an error");
    assert!(words.iter().all(|w| err.contains(w)), "{err}");
    assert_next_answer_switches(&rows);
}

#[test]
fn destination_load_fails_mid_switch() {
    a_failed_switch_ends_its_answer_only(
        "switch_load:1",
        &["could not load", "injected fault"],
        &[],
    );
    record(
        "switch_load",
        "the answer ends with a clear error (llama.cpp could not load …: injected fault); the source stays loaded and the next answer switches by projection",
    );
}

#[test]
fn kv_import_fails_mid_switch() {
    // A size switch reads sparsely by default and imports nothing: the projection is asked
    // for, as a precision route's switch projects.
    a_failed_switch_ends_its_answer_only(
        "kv_import:1",
        &["import", "injected fault"],
        &["--switch-rest", "projected"],
    );
    record(
        "kv_import",
        "the answer ends with a clear error (import: injected fault); the source is restored and the next answer switches by projection",
    );
}

#[test]
fn unreadable_anchor_decodes_the_head_instead() {
    let _ = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let projectors = projectors_with_anchors(dir.path());
    let (out, rows) =
        two_answers_with_a_switch(dir.path(), Some("anchor_read:1"), &projectors, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(rows.len(), 2, "{stderr}");
    // The answer completes: the switch decodes the head itself and says why.
    let first = &rows[0];
    assert_eq!(
        first["rungs_used"],
        serde_json::json!(["big", "small"]),
        "{first}"
    );
    let note = first["switches"][0]["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("anchor not used") && note.contains("injected fault"),
        "{first}"
    );
    // The anchor was not cached as missing: the next switch reads it.
    let next = &rows[1];
    assert!(next["switches"][0]["note"].is_null(), "{next}");
    assert_next_answer_switches(&rows);
    record(
        "anchor_read",
        "the answer completes: the switch decodes the head itself and its note says why; the next switch reads the anchor",
    );
}

/// A minimal ladder in `dir`: the tiny big rung (copied) and its Q8_0 requantization, which
/// `molt-run fetch` builds and records in the lock.
fn requantize_ladder(dir: &Path) -> PathBuf {
    std::fs::copy(
        common::tiny_file("tiny-big.gguf"),
        dir.join("tiny-big.gguf"),
    )
    .unwrap();
    let manifest = dir.join("tiny.toml");
    std::fs::write(
        &manifest,
        r#"name = "tiny"
[[rung]]
name = "big"
file = "tiny-big.gguf"
source = { local = {} }
[[rung]]
name = "big-q8"
file = "tiny-big-q8_0.gguf"
source = { requantize = { from = "big", type = "Q8_0" } }
"#,
    )
    .unwrap();
    manifest
}

fn assert_killed(out: &Output) {
    assert_eq!(
        out.status.signal(),
        Some(9),
        "the fault kills the process: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn killed_while_requantizing_then_fetch_redoes_it() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = requantize_ladder(dir.path());
    let q8 = dir.path().join("tiny-big-q8_0.gguf");
    // The partial files of the rung being written (`NAME.<pid>-<n>.partial`).
    let partials = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy().into_owned();
                n.starts_with("tiny-big-q8_0.gguf.") && n.ends_with(".partial")
            })
            .collect()
    };
    // Pass 1 is the lock (recording the local rung's hash), pass 2 the requantized rung.
    let out = molt_run(dir.path(), &manifest)
        .env("MOLT_FAULT", "write:2")
        .arg("fetch")
        .output()
        .unwrap();
    assert_killed(&out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tiny-big-q8_0.gguf."),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!q8.exists(), "no half-written rung under its real name");
    let left = partials();
    assert_eq!(left.len(), 1, "the fault struck mid-write: {left:?}");
    // The next run rebuilds it whole and records its hash.
    let out = molt_run(dir.path(), &manifest)
        .arg("fetch")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    molt::gguf::GgufFile::open(&q8).expect("the rebuilt rung is a whole GGUF");
    // The dead writer's partial file is gone, and the run said so.
    assert!(partials().is_empty(), "{:?}", partials());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("left by an interrupted write"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ladder = molt::ladder::Ladder::open(&manifest, dir.path()).expect("ladder opens");
    assert_eq!(ladder.rungs.len(), 2);
    record(
        "write: requantize (fetch)",
        "killed mid-write: only the .partial is left, the rung is absent; the next fetch removes the partial and rebuilds the rung whole",
    );
}

#[test]
fn killed_while_writing_the_lock_then_the_next_run_rewrites_it() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = requantize_ladder(dir.path());
    let lock = molt::ladder::Lock::path(dir.path(), "tiny");
    // Pass 1 is the lock, written after the local rung is hashed.
    let out = molt_run(dir.path(), &manifest)
        .env("MOLT_FAULT", "write:1")
        .arg("fetch")
        .output()
        .unwrap();
    assert_killed(&out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tiny.lock.json"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!lock.exists(), "no half-written lock under its real name");
    let out = molt_run(dir.path(), &manifest)
        .arg("fetch")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let l = molt::ladder::Lock::load(&lock);
    assert!(l.files.contains_key("tiny-big-q8_0.gguf"), "{:?}", l.files);
    record(
        "write: lock file",
        "killed mid-write: no lock under its real name; the next run rehashes and writes it",
    );
}

#[test]
fn killed_while_writing_anchors_then_the_next_run_writes_them_whole() {
    let _ = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("projectors");
    let train = |fault: Option<&str>| {
        let mut c = molt_run(dir.path(), &common::fixture_dir().join("tiny.toml"));
        if let Some(f) = fault {
            c.env("MOLT_FAULT", f);
        }
        c.args(["train-projectors", "--anchors-only", "--out"])
            .arg(&out_dir)
            .arg("--report")
            .arg(dir.path().join("report.json"))
            .output()
            .unwrap()
    };
    // The first anchor is written whole, the process dies halfway through the second.
    assert_killed(&train(Some("write:2")));
    let anchors = out_dir.join("tiny/anchors");
    let ladder = common::tiny_ladder();
    let load = |rung: &molt::ladder::RungInfo| {
        let p = anchors.join(molt::transplant::anchor::file_name(rung.name()));
        (
            p.exists(),
            molt::transplant::anchor::Anchor::load(&p, &rung.sha256),
        )
    };
    let complete: Vec<bool> = ladder.rungs.iter().map(|r| load(r).0).collect();
    assert_eq!(complete.iter().filter(|&&c| c).count(), 1, "{complete:?}");
    for r in &ladder.rungs {
        if let (true, a) = load(r) {
            a.expect("a file under its real name is whole");
        }
    }
    let out = train(None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in &ladder.rungs {
        load(r).1.expect("every anchor written whole");
    }
    record(
        "write: train-projectors anchors",
        "killed mid-write: the finished anchor loads, the cut one is absent; the next run writes every anchor whole",
    );
}

#[test]
fn hog_child_dies_mid_answer_with_a_clear_error() {
    let _ = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("hog.json");
    std::fs::write(
        &trace,
        r#"{"name": "hog", "unit": "MiB", "initial": 2000,
            "events": [{"at": 3, "budget": 1990}, {"at": 6, "budget": 1980}]}"#,
    )
    .unwrap();
    let run = |fault: Option<&str>| {
        let mut c = molt_run(dir.path(), &common::fixture_dir().join("tiny.toml"));
        if let Some(f) = fault {
            // Inherited by the hog child, the only process that passes the hog site.
            c.env("MOLT_FAULT", f);
        }
        c.args(["generate", "--prompt", "The cache", "--max-tokens", "10"])
            .arg("--trace")
            .arg(&trace)
            .args(["--real-hog", "--projectors"])
            .arg(common::tiny_projectors())
            .output()
            .unwrap()
    };
    let out = run(Some("hog_exit:2"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a clear error, not a crash: {stderr}"
    );
    assert!(stderr.contains("hog exited"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out = run(None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    record(
        "hog_exit",
        "the answer ends with a clear error (hog exited … SIGKILL), exit code 2, no panic; the next run completes",
    );
}
