//! The `QoS` bench on the tiny ladder: three conversations through a real `molt-run serve`
//! child (the batched loop, four sequences) while the budget falls below every rung and comes
//! back — the scheduler's plan as the server applies it, the only actuator there is. The
//! modelled usage stays inside the budget in every round, the idle server frees every rung
//! under the low budget (its resident set falls back to its floor), nobody is killed, no
//! conversation is lost, and the conversations that went to their state files are woken from
//! them.

mod common;

use molt::pressure::{Trace, TraceBudget};
use molt_bench::serve_qos::{ServeQosOptions, run, standard_conversations};
use molt_server::conversations::ConversationState;

#[test]
fn three_conversations_share_a_falling_budget_through_the_batched_server() {
    common::tiny_ladder();
    let manifest = common::fixture_dir().join("tiny.toml");
    let work = tempfile::tempdir().unwrap();
    let opts = ServeQosOptions {
        program: common::molt_run(),
        global_args: vec![
            "--ladder".into(),
            manifest.display().to_string(),
            "--threads".into(),
            "1".into(),
            "--n-ctx".into(),
            "512".into(),
        ],
        conversations: standard_conversations(),
        max_tokens: 8,
        round_ms: 1000,
        think_rounds: 2,
        min_rounds: 9,
        max_rounds: 60,
        work_dir: work.path().to_path_buf(),
        parallel: 4,
    };
    // Rounds 3-5: 1 MiB, below every rung (the smallest tiny model's file alone is larger);
    // the conversations' second or third turns come in it and wait.
    let trace = Trace::parse(
        r#"{"name":"fall","unit":"MiB","initial":1024,"events":[
            {"at":3,"budget":1},
            {"at":6,"budget":1024}]}"#,
    )
    .unwrap();
    let mut budget = TraceBudget::new(trace);
    let mut log = Vec::new();
    let report = run(&opts, &mut budget, &mut |s| log.push(s.to_owned())).unwrap();
    let log = log.join("\n");

    assert_eq!(report.killed, 0, "{log}");
    assert_eq!(report.lost_conversations, 0, "{log}");
    assert!(
        report.conversations.iter().all(|c| c.complete),
        "{:#?}",
        report.conversations
    );
    assert_eq!(report.parallel, 4);
    assert!(
        report.max_overshoot_modelled_bytes <= 0,
        "modelled usage over the budget by {} B\n{log}",
        report.max_overshoot_modelled_bytes
    );
    // Under the low budget the server holds no rung: every conversation's cache is out of
    // RAM (in its file, or waiting for memory), and the engine released.
    let low: Vec<_> = report
        .rounds
        .iter()
        .filter(|r| r.budget_bytes == 1 << 20)
        .collect();
    assert!(!low.is_empty());
    let last_low = low.last().unwrap();
    assert!(last_low.loaded.is_empty(), "{log}");
    assert_eq!(last_low.modelled_bytes, 0, "{log}");
    assert!(
        last_low.tenants.iter().all(|t| !matches!(
            t.state,
            ConversationState::Running | ConversationState::Kept
        )),
        "{log}"
    );
    // The process gives the memory back: its resident set above its floor under the low
    // budget is a fraction of what it was with a rung loaded. (Not "≤ 1 MiB": requests queued
    // there, and the allocator, hold ~1.5 MiB on this ladder, the size of its smallest rung;
    // measured ≤ budget is the real ladder's check, in the bench, where budgets are hundreds
    // of MiB.)
    let loaded_before = report.rounds[..3]
        .iter()
        .map(|r| r.measured_bytes)
        .min()
        .unwrap();
    for r in &low[1..] {
        assert!(
            r.measured_bytes < loaded_before / 2,
            "round {}: {} B above the floor, {loaded_before} B with a rung loaded\n{log}",
            r.round,
            r.measured_bytes
        );
    }
    assert!(report.hibernated >= 1, "{log}");
    assert!(report.resumed >= 1, "{log}");
    assert!(report.released >= 1, "{log}");
    // Every round is sampled with its budget and every conversation the server lists.
    assert!(report.rounds.len() >= opts.min_rounds);
    assert!(
        report
            .rounds
            .iter()
            .skip(1)
            .all(|r| r.tenants.len() == 3 && r.budget_bytes > 0),
        "{log}"
    );
}
