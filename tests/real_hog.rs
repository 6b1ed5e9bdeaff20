//! Genuine pressure: a real child process (`molt-run hog`) allocates what a wall-clock trace
//! says the device's other apps take; the session reads its budget back from the operating
//! system, parks when nothing fits, and resumes when the child gives the memory back. Also:
//! a malformed trace given to `molt-run` fails before any model loads, naming the line.

mod common;

use molt::pressure::{BudgetSource, HogBudget, MIB, Tick, Trace};
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions};

fn hog_program() -> std::path::PathBuf {
    common::molt_run()
}

#[test]
fn hog_budget_follows_the_trace_through_the_os() {
    let trace = Trace::parse(
        r#"{"name":"hog","unit":"MiB","clock":"token","initial":400,
            "events":[{"at":1,"budget":100},{"at":2,"budget":400}]}"#,
    )
    .unwrap();
    let mut b = HogBudget::spawn(&hog_program(), ["hog"], trace, None).unwrap();
    let at = |i| Tick {
        token_index: i,
        elapsed_ms: 0,
    };
    let full = b.budget(at(0)).unwrap();
    assert_eq!(b.held_mib(), Some(0));
    let squeezed = b.budget(at(1)).unwrap();
    assert_eq!(b.held_mib(), Some(300));
    // The child really holds ~300 MiB (read from its /proc status), so the device has ~100.
    assert!(
        (90 * MIB..=110 * MIB).contains(&squeezed.bytes),
        "budget {} MiB",
        squeezed.bytes / MIB
    );
    assert!(squeezed.pressure > 0.7);
    let back = b.budget(at(2)).unwrap();
    assert!(back.bytes + 10 * MIB >= full.bytes, "{back:?} vs {full:?}");
    assert!(b.describe().contains("real hog"));
}

#[test]
fn real_hog_parks_the_answer_and_lets_it_resume() {
    let cfg = common::cfg();
    let mut s = Session::with_options(
        common::tiny_ladder().clone(),
        cfg,
        "big",
        SessionOptions::default(),
    )
    .unwrap();
    // A 300 MiB device: at 0.3 s the hog takes all of it (nothing fits, not even the cache:
    // the session parks and sheds), at 4 s it gives it back.
    let trace = Trace::parse(
        r#"{"name":"squeeze","unit":"MiB","clock":"ms","initial":300,
            "events":[{"at":300,"budget":0},{"at":4000,"budget":300}]}"#,
    )
    .unwrap();
    let hog = HogBudget::spawn(&hog_program(), ["hog"], trace, None).unwrap();
    s.set_budget_source(Some(Box::new(hog)));
    let mut budgets = Vec::new();
    let g = s
        .generate(
            &Prompt::Text("The hog takes the memory and gives it back.".into()),
            &GenerateOptions {
                max_tokens: 450,
                ..GenerateOptions::default()
            },
            &mut |e| {
                if let Event::Budget { bytes, .. } = e {
                    budgets.push(*bytes);
                }
                // Slow the tiny model down to the trace's pace.
                if let Event::Token { .. } = e {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            },
        )
        .unwrap();
    assert!(!g.killed);
    let kinds: Vec<_> = g.levers.iter().map(|l| l.lever.as_str()).collect();
    assert!(
        kinds.contains(&"park"),
        "{kinds:?} {:?} {} tokens in {} ms, budgets {budgets:?}",
        g.stop,
        g.tokens.len(),
        g.total_ms
    );
    assert_eq!(kinds.last(), Some(&"resume"), "{kinds:?}");
    assert!(
        g.stall_ms > 300.0,
        "parked for {} ms: {:?}",
        g.stall_ms,
        g.levers
    );
    let low = budgets.iter().copied().min().unwrap();
    assert!(low < 20 * MIB, "the OS reading fell to {} MiB", low / MIB);
    assert!(budgets.last().copied().unwrap() > 250 * MIB);
}

#[test]
fn malformed_trace_fails_before_loading_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        "{\n  \"name\": \"bad\",\n  \"initial\": 2400,\n  \"events\": [\n    { \"at\": 48, \"budget\": 1300 },\n    { \"at\": 40, \"budget\": 700 }\n  ]\n}\n",
    )
    .unwrap();
    let out = std::process::Command::new(hog_program())
        .args([
            "--models-dir",
            "/nonexistent",
            "generate",
            "--prompt",
            "x",
            "--trace",
        ])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.json:6:"), "{err}");
    assert!(err.contains("not") && err.contains("40"), "{err}");
}
