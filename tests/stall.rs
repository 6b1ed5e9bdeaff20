//! The stall at a switch on the tiny ladder: standby rungs are what a switch down takes
//! (nothing loaded at the switch), a switch up puts its source on standby, standby is the
//! first thing given up when the budget no longer holds it, and `molt-run bench --stall
//! --quick` writes `switch_stall.json` in the schema the results page and the checks read.

mod common;

use std::path::Path;
use std::time::Duration;

use molt::pressure::{FixedBudget, resident_bytes_of_mapping};
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions, SwitchInfo};
use molt_bench::stall::{StallDoc, route_circuit};

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns.";

fn session(standby: bool) -> Session {
    let l = common::tiny_ladder();
    let opts = SessionOptions {
        standby,
        // A forced switch up is prepared in the background, as the policy's.
        projector_dirs: vec![common::tiny_projectors().clone()],
        research: molt::session::Research {
            forced_up_waits: true,
            ..molt::session::Research::default()
        },
        ..SessionOptions::default()
    };
    Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap()
}

/// One answer of at most `max_tokens` to `TEXT`, its events ignored.
fn answer(s: &mut Session, max_tokens: usize) {
    s.generate(
        &Prompt::Text(TEXT.into()),
        &GenerateOptions {
            max_tokens,
            ..GenerateOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
}

/// One answer with a switch forced before token `at`; returns the switch.
fn forced(s: &mut Session, prompt: &str, at: usize, to: usize) -> SwitchInfo {
    forced_then(s, prompt, at, to, 3)
}

/// [`forced`], the answer ending `after` tokens from `at` (1: the switch's token is its last).
fn forced_then(s: &mut Session, prompt: &str, at: usize, to: usize, after: usize) -> SwitchInfo {
    let mut switch = None;
    s.generate(
        &Prompt::Text(prompt.into()),
        &GenerateOptions {
            max_tokens: at + after,
            force_switch: Some((at, to)),
            ..GenerateOptions::default()
        },
        &mut |e| {
            if let Event::Switch(i) = e {
                switch = Some(i.clone());
            }
        },
    )
    .unwrap();
    switch.expect("the forced switch happened")
}

/// One answer with a switch up forced before token `at`, which waits for its destination's
/// background load: a reader slower than the tiny rungs decode (until the switch) gives the
/// load the tokens it needs, and the answer stops two tokens after the switch.
fn forced_up(s: &mut Session, at: usize, to: usize) -> SwitchInfo {
    let stop = s.cancel_handle();
    let mut switch: Option<SwitchInfo> = None;
    s.generate(
        &Prompt::Text(String::new()),
        &GenerateOptions {
            max_tokens: 300,
            force_switch: Some((at, to)),
            ..GenerateOptions::default()
        },
        &mut |e| match e {
            Event::Switch(i) => switch = Some(i.clone()),
            Event::Token { index, .. } => match &switch {
                Some(w) if *index >= w.at_token + 2 => {
                    stop.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                Some(_) => {}
                None => std::thread::sleep(Duration::from_millis(20)),
            },
            _ => {}
        },
    )
    .unwrap();
    switch.expect("the forced switch up happened")
}

#[test]
fn a_switch_down_takes_its_destination_off_standby_and_a_switch_up_leaves_its_source_there() {
    // Rung costs are measured at load as the process's memory growth: one test at a time.
    let _serial = common::events::one_at_a_time();
    let n = common::tiny_ladder().rungs.len();
    let mut s = session(true);
    let all_below: Vec<bool> = (0..n).map(|i| i > 0).collect();
    assert_eq!(s.on_standby(), all_below, "every rung below the home rung");
    assert!(s.standby_bytes() > 0, "standby is measured, not free");
    let down = forced(&mut s, TEXT, 2, n - 1);
    assert!(down.timings.from_standby, "{down:?}");
    assert!(
        down.timings.load_parts.is_none(),
        "nothing loaded at the switch"
    );
    // On the smallest rung nothing is below: the rungs above are dropped.
    assert!(s.on_standby().iter().all(|b| !b), "{:?}", s.on_standby());
    let up = forced_up(&mut s, 1, 0);
    assert!(!up.timings.from_standby);
    assert!(
        up.timings.load_parts.is_none() && up.timings.load_ms == 0.0,
        "a switch up loads in the background, not at the switch: {up:?}"
    );
    assert!(up.timings.prepared_ms > 0.0, "{up:?}");
    assert!(
        s.on_standby()[n - 1],
        "the source of a switch up waits on standby"
    );
    // Without standby every switch loads its destination.
    let mut plain = session(false);
    assert!(plain.on_standby().iter().all(|b| !b));
    assert_eq!(plain.standby_bytes(), 0);
    let down = forced(&mut plain, TEXT, 2, n - 1);
    assert!(!down.timings.from_standby);
    assert!(down.timings.load_parts.is_some());
}

#[test]
fn a_switch_down_onto_standby_shows_its_first_token_and_footprint_with_the_source_unmapped() {
    // The footprint reads the process's memory: one test at a time.
    let _serial = common::events::one_at_a_time();
    let l = common::tiny_ladder();
    let n = l.rungs.len();
    let mut s = session(true);
    let source = l.rungs[0].path.clone();
    assert!(
        resident_bytes_of_mapping(&source).unwrap() > 0,
        "the source is mapped"
    );
    // What happened at the switch's token, in order: the events and, at the footprint
    // sample, how much of the source's weights the process still maps.
    let mut order: Vec<&'static str> = Vec::new();
    let mut source_at_sample = None;
    let mut source_at_token = None;
    let mut at = None;
    s.generate(
        &Prompt::Text(TEXT.into()),
        &GenerateOptions {
            max_tokens: 6,
            force_switch: Some((2, n - 1)),
            ..GenerateOptions::default()
        },
        &mut |e| match e {
            Event::Switch(i) => {
                at = Some(i.at_token);
                order.push("switch");
            }
            Event::Token { index, .. } if Some(*index) == at => {
                order.push("token");
                source_at_token = Some(resident_bytes_of_mapping(&source).unwrap_or(0));
            }
            Event::Footprint(_) if at.is_some() && source_at_sample.is_none() => {
                order.push("footprint");
                source_at_sample = Some(resident_bytes_of_mapping(&source).unwrap_or(0));
            }
            _ => {}
        },
    )
    .unwrap();
    assert_eq!(order, ["switch", "token", "footprint"]);
    // The destination's import and first decode overlap the source's unmap; the token is
    // shown once it is done.
    assert_eq!(
        source_at_token,
        Some(0),
        "the switch's first token is shown with the source's weights unmapped"
    );
    assert_eq!(
        source_at_sample,
        Some(0),
        "the footprint after the switch is sampled with the source's weights unmapped"
    );
}

#[test]
fn standby_is_given_up_before_the_budget_is_overshot() {
    // Rung costs are measured at load as the process's memory growth: one test at a time.
    let _serial = common::events::one_at_a_time();
    let l = common::tiny_ladder();
    let opts = SessionOptions {
        // The policy's costs stay as measured at load, so the budget below means what it says.
        observe_footprint: false,
        projector_dirs: vec![common::tiny_projectors().clone()],
        ..SessionOptions::default()
    };
    let mut s = Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
    assert!(s.on_standby().iter().any(|b| *b));
    let standby = s.standby_bytes();
    // A budget that holds the home rung with the whole answer's context but not the standby
    // rungs beside it.
    let prompt = s
        .rung_mut(0)
        .unwrap()
        .model()
        .tokenize(TEXT, false)
        .unwrap();
    let tokens = prompt.len() as u64 + 5;
    let home_only = s.modelled_now(tokens) - standby;
    let budget = FixedBudget::new(home_only + standby / 2);
    s.set_budget_source(Some(Box::new(budget)));
    let g = s
        .generate(
            &Prompt::Text(TEXT.into()),
            &GenerateOptions {
                max_tokens: 4,
                ..GenerateOptions::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(
        g.rungs_used,
        vec![s.ladder().rungs[0].name().to_string()],
        "standby is given up; the rung is not"
    );
    // Given up while the answer ran (smallest rung first); after it, only what the budget
    // holds beside the home rung is prepared again.
    assert!(
        s.standby_bytes() <= standby / 2,
        "standby {} of {standby} B kept: {:?}",
        s.standby_bytes(),
        s.on_standby()
    );
    let used = s.history().len() as u64 + 1;
    assert!(s.modelled_now(used) <= home_only + standby / 2);
    // And with room again, the next answer prepares it anew.
    s.set_budget_source(None);
    s.generate(
        &Prompt::Text(String::new()),
        &GenerateOptions {
            max_tokens: 1,
            ..GenerateOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert!(
        s.on_standby().iter().skip(1).all(|b| *b),
        "{:?}",
        s.on_standby()
    );
}

#[test]
fn bench_stall_quick_writes_the_schema() {
    // Rung costs are measured at load as the process's memory growth: one test at a time.
    let _serial = common::events::one_at_a_time();
    let l = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let out = assert_cmd::Command::new(common::molt_run())
        .env_remove("MOLT_HOME")
        .env_remove("MOLT_LADDER")
        .env_remove("XDG_DATA_HOME")
        .env("HOME", dir.path())
        .arg("--ladder")
        .arg(common::fixture_dir().join("tiny.toml"))
        .args(["--threads", "1", "--n-ctx", "512"])
        .args(["bench", "--stall", "--quick", "--projectors"])
        .arg(common::tiny_projectors())
        .arg("--corpus")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("projectors/corpus"))
        .arg("--out-dir")
        .arg(dir.path())
        .timeout(Duration::from_secs(600))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.path().join("switch_stall.json")).unwrap();
    let raw: serde_json::Value = serde_json::from_str(&text).unwrap();
    let routes = route_circuit(l.rungs.len()).len();
    for key in ["rows", "before_rows", "warned_rows"] {
        let rows = raw[key].as_array().unwrap();
        // Every route, warm and cold, at the one quick length.
        assert_eq!(rows.len(), routes * 2, "{key}: {text}");
        for r in rows {
            for field in [
                "route",
                "direction",
                "context_tokens",
                "cache",
                "stall_ms",
                "parts_ms",
                "itl_ms_median",
                "standby_rss_mib",
            ] {
                assert!(r.get(field).is_some(), "{key} row without {field}: {r}");
            }
            assert!(["down", "up"].contains(&r["direction"].as_str().unwrap()));
            assert!(["warm", "cold"].contains(&r["cache"].as_str().unwrap()));
            let stall = &r["stall_ms"];
            let (med, min, max) = (
                stall["median"].as_f64().unwrap(),
                stall["min"].as_f64().unwrap(),
                stall["max"].as_f64().unwrap(),
            );
            assert!(min > 0.0 && min <= med && med <= max, "{r}");
            assert!(r["itl_ms_median"].as_f64().unwrap() > 0.0, "{r}");
            assert!(
                r["parts_ms"]
                    .as_object()
                    .unwrap()
                    .contains_key("first_decode")
            );
        }
    }
    let doc: StallDoc = serde_json::from_str(&text).unwrap();
    for r in &doc.rows {
        let expected = if r.direction == "down" { 1.0 } else { 0.0 };
        assert!(
            (r.from_standby - expected).abs() < 1e-9,
            "after: {} {} from standby {}",
            r.route,
            r.direction,
            r.from_standby
        );
        if r.direction == "down" {
            assert!(r.standby_rss_mib > 0.0, "{r:?}");
        }
    }
    // A switch up: after, its destination loaded while the source decoded (`load` 0, the
    // overlapped load its own part); before, loaded at the switch.
    for r in doc.rows.iter().filter(|r| r.direction == "up") {
        assert_eq!(r.parts_ms["load"], 0.0, "{r:?}");
        assert!(r.parts_ms["prepared_in_background"] > 0.0, "{r:?}");
    }
    for r in doc.before_rows.iter().filter(|r| r.direction == "up") {
        assert!(r.parts_ms["load"] > 0.0, "{r:?}");
        assert!(!r.parts_ms.contains_key("prepared_in_background"), "{r:?}");
    }
    // A switch down known ahead: carried onto its destination in the background while the
    // source went on, the stall only the catch-up batch, and the source's gaps meanwhile
    // measured.
    for r in doc.warned_rows.iter().filter(|r| r.direction == "down") {
        assert!(r.parts_ms["carried_in_background"] > 0.0, "{r:?}");
        assert!(r.parts_ms["prepared_tokens"] >= 1.0, "{r:?}");
        assert!(r.source_itl_ms_median > 0.0, "{r:?}");
        assert!(
            !r.parts_ms.contains_key("token_recompute"),
            "the sentence re-reads were carried, not in the stall: {r:?}"
        );
    }
    assert!(doc.before_rows.iter().all(|r| r.from_standby == 0.0));
    assert!(doc.before_rows.iter().all(|r| r.standby_rss_mib == 0.0));
    // The figure and the page section draw from it.
    let set = molt_bench::figures::draw_all(dir.path(), &dir.path().join("figures")).unwrap();
    assert!(
        set.written.iter().any(|f| f.name == "switch_stall"),
        "{:?}",
        set.skipped
    );
}

#[test]
fn a_switch_up_loads_its_destination_in_the_background_while_the_answer_goes_on() {
    // Rung costs are measured at load as the process's memory growth: one test at a time.
    let _serial = common::events::one_at_a_time();
    let l = common::tiny_ladder();
    for prepare_up in [true, false] {
        let opts = SessionOptions {
            observe_footprint: false,
            prepare_up,
            projector_dirs: vec![common::tiny_projectors().clone()],
            ..SessionOptions::default()
        };
        let mut s =
            Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
        let (low, high) = molt_bench::reliability::sawtooth_budgets(&s);
        // Down before token 2, memory back before token 6.
        let trace = molt::pressure::Trace::parse(&format!(
            r#"{{"name":"dip","unit":"B","clock":"token","initial":{high},"events":[{{"at":2,"budget":{low}}},{{"at":6,"budget":{high}}}]}}"#
        ))
        .unwrap();
        s.set_budget_source(Some(Box::new(molt::pressure::TraceBudget::new(trace))));
        let mut switches: Vec<SwitchInfo> = Vec::new();
        let mut tokens = 0usize;
        let g = s
            .generate(
                &Prompt::Text(TEXT.into()),
                &GenerateOptions {
                    max_tokens: 60,
                    ..GenerateOptions::default()
                },
                &mut |e| match e {
                    Event::Switch(i) => switches.push(i.clone()),
                    // A reader slower than the tiny rungs decode, once memory is back and until
                    // the switch up: the background load (seconds on a loaded machine) gets the
                    // tokens it needs to finish within the answer.
                    Event::Token { .. } => {
                        tokens += 1;
                        if tokens >= 6 && switches.len() < 2 {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                    _ => {}
                },
            )
            .unwrap();
        assert_eq!(g.tokens.len(), 60, "the answer runs to its length");
        let up = switches
            .iter()
            .find(|w| w.to == l.rungs[0].name())
            .unwrap_or_else(|| panic!("no switch up: {switches:?}"));
        if prepare_up {
            assert!(up.timings.prepared_ms > 0.0, "{up:?}");
            assert!(up.timings.prepared_tokens >= 1, "{up:?}");
            assert_eq!(up.timings.load_ms, 0.0, "nobody waited for the load");
            assert!(up.timings.load_parts.is_none(), "{up:?}");
            assert!(
                up.at_token > 6,
                "the source decoded while the destination loaded: {up:?}"
            );
        } else {
            assert_eq!(up.timings.prepared_ms, 0.0);
            assert!(up.timings.load_parts.is_some(), "loaded on the spot");
            assert_eq!(up.at_token, 6, "{up:?}");
        }
    }
}

#[test]
fn a_standby_rung_reads_the_conversations_head_after_an_answer_and_a_switch_down_splices_it_whole()
{
    // Rung costs are measured at load as the process's memory growth: one test at a time.
    let _serial = common::events::one_at_a_time();
    let n = common::tiny_ladder().rungs.len();
    let head = molt::session::DEFAULT_HEAD_REREAD;
    let mut s = session(true);
    // The first answer: the standby rungs were prepared before there was a conversation.
    let mut first = None;
    s.generate(
        &Prompt::Text(TEXT.into()),
        &GenerateOptions {
            max_tokens: 3,
            ..GenerateOptions::default()
        },
        &mut |e| {
            if let Event::Switch(i) = e {
                first = Some(i.clone());
            }
        },
    )
    .unwrap();
    assert!(first.is_none(), "no switch in the first answer");
    let down = forced(&mut s, " and then", 2, n - 1);
    assert!(down.timings.from_standby, "{down:?}");
    assert_eq!(down.method, "molt", "{down:?}");
    assert_eq!(
        (down.timings.head, down.timings.head_anchored),
        (head, head),
        "the whole head spliced from what the standby rung read, none decoded at the switch: {down:?}"
    );
    // Those cells are the destination's own: what a fresh context of the rung computes.
    let history = s.history().to_vec();
    let got = s.rung_mut(n - 1).unwrap().ctx.export_state().unwrap();
    let info = &common::tiny_ladder().rungs[n - 1];
    let model = molt::engine::Model::load(
        &info.path,
        info.name(),
        molt::engine::ModelOptions::default(),
    )
    .unwrap();
    let mut native = molt::engine::Context::new(model, common::cfg()).unwrap();
    native.decode(&history[..head]).unwrap();
    let want = native.export_state().unwrap();
    for pos in 0..head {
        let pos = i32::try_from(pos).unwrap();
        assert_eq!(
            common::kv_rows_at(&got, pos),
            common::kv_rows_at(&want, pos),
            "position {pos}"
        );
    }
}

#[test]
fn a_standby_rung_waits_hot_while_the_budget_holds_its_pages_and_is_cooled_before_it_is_dropped() {
    // Rung costs and mappings are measured from the process: one test at a time.
    let _serial = common::events::one_at_a_time();
    let l = common::tiny_ladder();
    let n = l.rungs.len();
    let opts = SessionOptions {
        observe_footprint: false,
        projector_dirs: vec![common::tiny_projectors().clone()],
        ..SessionOptions::default()
    };
    let mut s = Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
    // No budget read: every standby rung waits hot, its pages mapped and counted.
    let below: Vec<bool> = (0..n).map(|i| i > 0).collect();
    assert_eq!(s.on_standby_hot(), below);
    let hot = s.standby_bytes();
    let pages: u64 = (1..n)
        .map(|i| resident_bytes_of_mapping(&l.rungs[i].path).unwrap_or(0))
        .sum();
    assert!(pages > 0, "a hot rung's pages are mapped");
    assert!(
        hot >= pages,
        "standby {hot} B counts its {pages} B of pages"
    );
    // A budget that holds the home rung and the standby rungs cold, not hot: they are cooled,
    // not dropped, and their pages leave the process.
    let tokens = 40;
    let cold_room = s.modelled_now(tokens) - pages / 2;
    s.set_budget_source(Some(Box::new(FixedBudget::new(cold_room))));
    answer(&mut s, 2);
    assert!(
        s.on_standby().iter().skip(1).any(|b| *b),
        "cooled, not dropped: {:?}",
        s.on_standby()
    );
    for i in 1..n {
        if s.on_standby()[i] && !s.on_standby_hot()[i] {
            assert_eq!(
                resident_bytes_of_mapping(&l.rungs[i].path).unwrap_or(0),
                0,
                "a cooled rung's pages are released"
            );
        }
    }
    assert!(s.on_standby_hot().iter().any(|h| !h));
    assert!(s.standby_bytes() < hot);
    let used = s.history().len() as u64 + 1;
    assert!(s.modelled_now(used) <= cold_room);
    // A switch down onto a hot rung maps nothing.
    let mut fresh = session(true);
    assert!(fresh.on_standby_hot()[n - 1]);
    let down = forced(&mut fresh, TEXT, 2, n - 1);
    assert!(down.timings.from_standby, "{down:?}");
    assert_eq!(
        down.timings.load_ms, 0.0,
        "nothing mapped at the switch: {down:?}"
    );
    // The source's model is held until the answer ends, then freed.
    assert_eq!(fresh.held_model_bytes(), 0);
}

#[test]
fn a_budget_source_attached_cools_standby_until_it_is_read_and_room_heats_it_again() {
    // Mappings are read from the process: one test at a time.
    let _serial = common::events::one_at_a_time();
    let l = common::tiny_ladder();
    let n = l.rungs.len();
    let mut s = session(true);
    assert!(s.on_standby_hot().iter().skip(1).all(|h| *h));
    // A source not read yet: nothing waits hot (its first reading could be below them).
    s.set_budget_source(Some(Box::new(FixedBudget::new(u64::MAX / 4))));
    assert!(
        s.on_standby_hot().iter().all(|h| !h),
        "{:?}",
        s.on_standby_hot()
    );
    for i in 1..n {
        assert_eq!(
            resident_bytes_of_mapping(&l.rungs[i].path).unwrap_or(0),
            0,
            "rung {i}'s pages released"
        );
    }
    // Read, and holding them all: after the answer they are hot again.
    answer(&mut s, 2);
    assert!(
        s.on_standby_hot().iter().skip(1).all(|h| *h),
        "{:?}",
        s.on_standby_hot()
    );
}

/// The destination's rows at the history's first `head` positions against what a fresh
/// context of rung `to` computes for them: the largest difference.
fn head_rows_off_native(s: &mut Session, to: usize, head: usize) -> f32 {
    let history = s.history().to_vec();
    let got = s.rung_mut(to).unwrap().ctx.export_state().unwrap();
    let info = &common::tiny_ladder().rungs[to];
    let model = molt::engine::Model::load(
        &info.path,
        info.name(),
        molt::engine::ModelOptions::default(),
    )
    .unwrap();
    let mut native = molt::engine::Context::new(model, common::cfg()).unwrap();
    native.decode(&history[..head]).unwrap();
    let want = native.export_state().unwrap();
    (0..i32::try_from(head).unwrap())
        .map(|pos| {
            let (a, b) = (
                common::kv_rows_at(&got, pos),
                common::kv_rows_at(&want, pos),
            );
            a.iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max)
        })
        .fold(0.0, f32::max)
}

#[test]
fn a_switch_down_leaves_the_heads_unanchored_positions_to_the_next_token_which_reads_them_natively()
{
    // Rung costs are measured at load as the process's memory growth: one test at a time.
    let _serial = common::events::one_at_a_time();
    let head = molt::session::DEFAULT_HEAD_REREAD;
    // The tiny ladder's precision route (projected where it lies, off standby); no anchor
    // covers its raw-text head, and a fresh conversation's standby rungs have read none.
    let to = 1;
    let at = 2;
    // Tokens after the switch's (the next one reads the head), and none (the answer's end does).
    for after in [3, 1] {
        let mut s = session(true);
        let down = forced_then(&mut s, TEXT, at, to, after);
        assert!(down.timings.from_standby, "{down:?}");
        assert_eq!(
            (
                down.timings.head,
                down.timings.head_anchored,
                down.timings.head_later
            ),
            (head, 0, head),
            "the head left for the next token: {down:?}"
        );
        let d = head_rows_off_native(&mut s, to, head);
        assert!(
            d < 2e-2,
            "{after}: the head's cells are the destination's own, off by {d}"
        );
        assert_eq!(
            s.projected_positions(),
            down.timings.cells - head,
            "{after}: the head is no longer counted projected"
        );
    }
    // Off: the head decoded in the switch's first batch, as before.
    let l = common::tiny_ladder();
    let opts = SessionOptions {
        head_later: false,
        projector_dirs: vec![common::tiny_projectors().clone()],
        ..SessionOptions::default()
    };
    let mut s = Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap();
    let down = forced(&mut s, TEXT, at, to);
    assert_eq!(down.timings.head_later, 0, "{down:?}");
    assert!(head_rows_off_native(&mut s, to, head) < 2e-2);
}

/// Maps `file` as llama.cpp maps a rung (shared, read-only, no advice), nothing read yet;
/// the caller unmaps it. The address and the length.
fn map_as_llama_does(file: &Path) -> (*mut libc::c_void, usize) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).unwrap();
    let len = usize::try_from(f.metadata().unwrap().len()).unwrap();
    // SAFETY: a fresh shared read-only mapping of an open file (the mapping outlives the
    // descriptor); the caller unmaps it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    (p, len)
}

/// Maps `file` as llama.cpp does, touches every page, and returns the bytes this process then
/// maps a whole 2 MiB folio per entry.
fn pmd_mapped_as_llama_maps(file: &Path) -> u64 {
    let (p, len) = map_as_llama_does(file);
    for i in (0..len).step_by(4096) {
        // SAFETY: inside the readable mapping.
        unsafe { std::ptr::read_volatile(p.cast::<u8>().add(i)) };
    }
    let whole = molt::pressure::pmd_mapped_bytes_of_mapping(file).unwrap();
    // SAFETY: the mapping above.
    unsafe { libc::munmap(p, len) };
    whole
}

#[test]
fn a_file_settled_in_huge_folios_maps_them_whole_wherever_it_is_mapped() {
    use molt::pressure::pages::{Folios, settle_huge_folios};
    // On the target's file system (a temporary one may be backed otherwise).
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("huge_folios");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("weights.bin");
    let len = 24usize << 20;
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect();
    std::fs::write(&path, &bytes).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    // In small folios, as a read without readahead leaves it (a file written or read ahead
    // in small pieces looks the same to a mapping).
    molt::pressure::pages::drop_from_page_cache(&path).unwrap();
    {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let mut f = std::fs::File::open(&path).unwrap();
        // SAFETY: an open descriptor; the advice only changes readahead.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        let mut page = [0u8; 4096];
        while f.read(&mut page).unwrap() > 0 {}
    }
    let small = pmd_mapped_as_llama_maps(&path);
    let got = settle_huge_folios(&path).unwrap();
    eprintln!("{small} bytes mapped whole before; settled: {got:?}");
    let whole = pmd_mapped_as_llama_maps(&path) as f64;
    match got {
        Folios::Huge { share } | Folios::Reread { share, .. } => {
            assert!(share >= 0.9, "{got:?}");
            // What it says holds for a mapping that asks for nothing: llama.cpp's.
            assert!(
                whole >= 0.9 * len as f64,
                "{got:?}, yet {whole} of {len} bytes map whole"
            );
            // Settled again: found in huge folios at once, nothing read again.
            assert!(matches!(
                settle_huge_folios(&path).unwrap(),
                Folios::Huge { .. }
            ));
        }
        Folios::Small { share } => assert!(share < 0.9, "{got:?}"),
        Folios::NotApplicable => {}
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn real_ladder_a_loaded_rungs_weights_map_in_huge_folios_where_the_kernel_allows() {
    use molt::pressure::pages::{Folios, settle_huge_folios};
    let _serial = common::events::one_at_a_time();
    let Some(l) = common::real_ladder() else {
        return;
    };
    let tier0 = &common::rung(l, "tier0").path;
    let mut s = Session::with_options(
        l.clone(),
        common::context(512, 128),
        "tier0",
        SessionOptions {
            standby: false,
            ..SessionOptions::default()
        },
    )
    .unwrap();
    answer(&mut s, 2);
    // The load settled the file; asked again, it says how the page cache holds it now.
    let folios = settle_huge_folios(tier0).unwrap();
    eprintln!("tier0: {folios:?}");
    if let Folios::Huge { .. } = folios {
        // llama.cpp's own mapping, every weight touched by the answer, maps whole folios.
        let whole = molt::pressure::pmd_mapped_bytes_of_mapping(tier0).unwrap() as f64;
        let resident = resident_bytes_of_mapping(tier0).unwrap() as f64;
        assert!(
            whole >= 0.9 * resident,
            "{whole} of {resident} resident bytes map whole"
        );
    } else {
        assert!(
            !matches!(folios, Folios::Reread { .. }),
            "a loaded rung's file was not settled at its load: {folios:?}"
        );
    }
}

#[test]
fn a_cold_mapping_populated_reads_its_file_in_huge_folios_where_the_kernel_allows() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("huge_populate");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("weights.bin");
    let len = 16usize << 20;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    // Whether this kernel and file system hold this file in huge folios at all (settling it
    // reads it in them where they can); a file system that cannot is not what is tested here.
    let capable = matches!(
        molt::pressure::pages::settle_huge_folios(&path).unwrap(),
        molt::pressure::pages::Folios::Huge { .. } | molt::pressure::pages::Folios::Reread { .. }
    );
    molt::pressure::pages::drop_from_page_cache(&path).unwrap();
    // Mapped as llama.cpp maps a rung, nothing read yet: a standby rung whose pages the
    // system reclaimed.
    let (p, _) = map_as_llama_does(&path);
    let covered = molt::pressure::pages::populate_mapping(&path).unwrap();
    let whole = molt::pressure::pmd_mapped_bytes_of_mapping(&path).unwrap();
    let aligned = (p as usize).is_multiple_of(2 << 20);
    // SAFETY: the mapping above.
    unsafe { libc::munmap(p, len) };
    std::fs::remove_file(&path).unwrap();
    assert_eq!(covered, len as u64);
    eprintln!(
        "{whole} of {len} bytes map whole (huge folios possible: {capable}, aligned: {aligned})"
    );
    if capable && aligned {
        assert!(
            whole as f64 >= 0.9 * len as f64,
            "read back from disk in small folios: {whole} of {len} bytes map whole"
        );
    }
}
