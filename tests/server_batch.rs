//! Continuous batching in the service (tiny ladder, real sockets): two streams run at once —
//! the second's first token arrives while the first is still answering — and each gives the
//! text it gives alone; a budget cut mid-answer carries both to the smaller rung, each stream
//! with its own switch event; a client that hangs up leaves, and the other answer goes on.

mod common;
#[path = "common/server.rs"]
mod harness;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use harness::{serial, start};
use molt::session::Strategy;
use molt::transplant::select::TokenRecompute;
use molt_server::client::{self, EventStream};
use serde_json::{Value, json};

fn chat(content: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

const FIRST: &str = "the scheduler parks the weights of a background job";
const SECOND: &str = "a budget cut moves every answer to a smaller rung";

async fn status(addr: SocketAddr) -> Value {
    let r = client::request(addr, "GET", "/v1/molt/status", None)
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    r.json().unwrap()
}

/// Sets the service's budget (`POST /v1/molt/budget`).
async fn set_budget(addr: SocketAddr, body: Value) {
    let r = client::post_json(addr, "/v1/molt/budget", &body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

fn molt_kind(v: &Value) -> &str {
    v["molt"]["event"].as_str().unwrap_or("")
}

/// One event of a stream with when it arrived; `None` at the end.
async fn next(s: &mut EventStream) -> Option<(Instant, Value)> {
    let ev = tokio::time::timeout(Duration::from_secs(60), s.next())
        .await
        .expect("stream stalls")
        .unwrap()?;
    Some((Instant::now(), ev.json().unwrap_or(Value::String(ev.data))))
}

async fn open(addr: SocketAddr, body: &Value) -> EventStream {
    client::stream(addr, "/v1/chat/completions", body)
        .await
        .unwrap()
        .map_err(|r| String::from_utf8_lossy(&r.body).into_owned())
        .unwrap()
}

/// Reads until `n` token events have arrived.
async fn until_tokens(s: &mut EventStream, n: usize) -> Vec<(Instant, Value)> {
    let mut out = Vec::new();
    while out.iter().filter(|(_, e)| molt_kind(e) == "token").count() < n {
        out.push(next(s).await.expect("stream ended early"));
    }
    out
}

async fn drain(s: &mut EventStream, mut into: Vec<(Instant, Value)>) -> Vec<(Instant, Value)> {
    while let Some(e) = next(s).await {
        into.push(e);
    }
    into
}

/// The streamed text.
fn text(events: &[(Instant, Value)]) -> String {
    events
        .iter()
        .filter_map(|(_, e)| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn tokens(events: &[(Instant, Value)]) -> Vec<(u64, String)> {
    events
        .iter()
        .filter(|(_, e)| molt_kind(e) == "token")
        .map(|(_, e)| {
            (
                e["molt"]["index"].as_u64().unwrap(),
                e["molt"]["rung"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

async fn alone(addr: SocketAddr, body: &Value) -> String {
    let mut s = open(addr, body).await;
    text(&drain(&mut s, Vec::new()).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streams_run_at_once_and_answer_as_alone() {
    let _serial = serial().await;
    let srv = start(|c| c.parallel = 2).await;
    let addr = srv.addr;
    // Long enough that the first is still answering when the second arrives; both fit the
    // shared window (1024 cells) together.
    let (a, b) = (chat(FIRST, 600, true), chat(SECOND, 24, true));
    let want_a = alone(addr, &a).await;
    let want_b = alone(addr, &b).await;
    let mut sa = open(addr, &a).await;
    let head_a = until_tokens(&mut sa, 1).await;
    let mut sb = open(addr, &b).await;
    let (ea, eb) = tokio::join!(drain(&mut sa, head_a), drain(&mut sb, Vec::new()));
    let last_a = ea.iter().rfind(|(_, e)| molt_kind(e) == "token").unwrap().0;
    let first_b = eb.iter().find(|(_, e)| molt_kind(e) == "token").unwrap().0;
    assert!(
        first_b < last_a,
        "the second answer's first token came after the first answer's last: served one at a time"
    );
    assert_eq!(text(&ea), want_a, "first answer, batched vs alone");
    assert_eq!(text(&eb), want_b, "second answer, batched vs alone");
    let st = status(addr).await;
    assert_eq!(st["counters"]["completed"], 4);
    srv.shutdown().await;
}

/// A budget in MiB that holds the small rung with a full context but neither larger rung
/// (from the costs the engine publishes).
async fn small_only_budget(addr: SocketAddr) -> f64 {
    let s = status(addr).await;
    let rungs = s["engine"]["rungs"].as_array().unwrap();
    let get = |name: &str, key: &str| {
        rungs.iter().find(|r| r["name"] == name).unwrap()[key]
            .as_f64()
            .unwrap()
    };
    let cut = get("big-q8", "resident_mib").min(get("big", "resident_mib")) - 0.1;
    assert!(get("small", "full_context_mib") + 0.5 < cut, "{rungs:?}");
    cut
}

/// Two answers running on a batched server with `strategy`, then a budget cut that holds only
/// the small rung: each stream has one switch big → small, its tokens on big before it and on
/// small after, and the switches' methods come back in stream order, each with the refill
/// levers of its stream (a carried cache re-reads its history in place behind the answer).
async fn cut_two_running_answers(strategy: Strategy) -> Vec<(String, Vec<Value>)> {
    cut_two_running_answers_with(strategy, TokenRecompute::default_size().into()).await
}

/// [`cut_two_running_answers`] with the size switch's token recompute set.
async fn cut_two_running_answers_with(
    strategy: Strategy,
    recompute: Option<TokenRecompute>,
) -> Vec<(String, Vec<Value>)> {
    let srv = start(|c| {
        c.parallel = 2;
        c.session.strategy = strategy;
        c.session.token_recompute = recompute;
    })
    .await;
    let addr = srv.addr;
    let cut = small_only_budget(addr).await;
    let mut sa = open(addr, &chat(FIRST, 400, true)).await;
    let head_a = until_tokens(&mut sa, 1).await;
    let mut sb = open(addr, &chat(SECOND, 400, true)).await;
    let head_b = until_tokens(&mut sb, 4).await;
    set_budget(addr, json!({"mib": cut})).await;
    let (ea, eb) = tokio::join!(drain(&mut sa, head_a), drain(&mut sb, head_b));
    let mut methods = Vec::new();
    for (name, events) in [("first", &ea), ("second", &eb)] {
        let switches: Vec<&Value> = events
            .iter()
            .filter(|(_, e)| molt_kind(e) == "switch")
            .map(|(_, e)| &e["molt"])
            .collect();
        assert_eq!(switches.len(), 1, "{name}: one switch each: {switches:?}");
        let sw = switches[0];
        assert_eq!(
            (sw["from"].as_str(), sw["to"].as_str()),
            (Some("big"), Some("small"))
        );
        assert!(sw.get("note").is_none(), "{name}: {sw}");
        let at = sw["at_token"].as_u64().unwrap();
        let refills: Vec<Value> = of_kind(events, "lever")
            .into_iter()
            .filter(|l| l["lever"].as_str().is_some_and(|x| x.starts_with("refill")))
            .cloned()
            .collect();
        for r in &refills {
            assert!(
                r["at_token"].as_u64().unwrap() >= at,
                "{name}: {r} after {sw}"
            );
        }
        methods.push((sw["method"].as_str().unwrap().to_string(), refills));
        let toks = tokens(events);
        assert!(
            toks.len() as u64 > at,
            "{name}: tokens continue after the switch"
        );
        for (i, r) in &toks {
            assert_eq!(
                r,
                if *i < at { "big" } else { "small" },
                "{name}: token {i}"
            );
        }
        let summary = events
            .iter()
            .find(|(_, e)| molt_kind(e) == "summary")
            .map(|(_, e)| &e["molt"])
            .unwrap();
        assert_eq!(summary["rungs_used"], json!(["big", "small"]));
    }
    let st = status(addr).await;
    assert_eq!(st["engine"]["current_rung"], "small");
    assert_eq!(st["counters"]["switches"], 2);
    srv.shutdown().await;
    methods
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_cut_mid_answer_carries_every_running_answer() {
    let _serial = serial().await;
    let cut = cut_two_running_answers(Strategy::Molt).await;
    let methods: Vec<&str> = cut.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(methods, ["molt", "molt"], "the caches were carried");
    // Down a size route, a switch whose choice of positions covers half of a cache re-reads
    // all of it — these short conversations' — and nothing is re-read behind the answer.
    for (_, refills) in &cut {
        assert!(refills.is_empty(), "{refills:?}");
    }
    // With no choice, each carried cache is re-read in place behind its answer, once,
    // every position from the head's end to the newest token.
    // (The projection alone: any choice of the question's sentences covers most of these.)
    let cut = cut_two_running_answers_with(Strategy::Molt, None).await;
    for (m, refills) in &cut {
        assert_eq!(m, "molt");
        assert_eq!(refills.len(), 1, "{refills:?}");
        assert_eq!(refills[0]["lever"], "refill", "{refills:?}");
        assert_eq!(refills[0]["rung"], "small");
        assert!(refills[0]["tokens"].as_u64().unwrap() > 0, "{refills:?}");
    }
}

/// `serve --strategy reprefill` in the batched loop: the same cut re-reads each answer's
/// history on the small rung (the loop carried the caches whatever the strategy said).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_reprefill_strategy_a_cut_re_reads_every_running_answer() {
    let _serial = serial().await;
    let cut = cut_two_running_answers(Strategy::Reprefill).await;
    let methods: Vec<&str> = cut.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(methods, ["reprefill", "reprefill"]);
    assert!(
        cut.iter().all(|(_, r)| r.is_empty()),
        "a re-read cache is native: no refill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_leaves_and_the_other_answer_goes_on() {
    let _serial = serial().await;
    let srv = start(|c| c.parallel = 2).await;
    let addr = srv.addr;
    let a = chat(FIRST, 300, true);
    let want_a = alone(addr, &a).await;
    let mut sa = open(addr, &a).await;
    let head_a = until_tokens(&mut sa, 1).await;
    let mut sb = open(addr, &chat(SECOND, 600, true)).await;
    let _ = until_tokens(&mut sb, 3).await;
    drop(sb);
    let ea = drain(&mut sa, head_a).await;
    assert_eq!(text(&ea), want_a, "the other answer is unchanged");
    let n_a = tokens(&ea).len() as u64;
    let t0 = Instant::now();
    loop {
        let st = status(addr).await;
        if st["counters"]["cancelled"] == 1 && st["engine"]["running"].is_null() {
            assert!(
                st["counters"]["tokens"].as_u64().unwrap() < 2 * n_a + 600,
                "the hung-up answer stopped early: {st}"
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no cancellation: {st}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its sequence is free again: the next request is answered.
    let r = client::post_json(addr, "/v1/chat/completions", &chat(SECOND, 8, false))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    srv.shutdown().await;
}

/// The batched loop lets waiting requests join by class, then priority, as the one-at-a-time
/// loop takes them: with both sequences busy, a background request and then a foreground one
/// wait; when a sequence frees the foreground one joins, though it came second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_foreground_request_joins_before_an_earlier_background_one() {
    let _serial = serial().await;
    let srv = start(|c| c.parallel = 2).await;
    let addr = srv.addr;
    let mut long = open(addr, &chat(FIRST, 600, true)).await;
    let head_long = until_tokens(&mut long, 1).await;
    let mut short = open(addr, &chat(SECOND, 300, true)).await;
    let head_short = until_tokens(&mut short, 1).await;
    let mut background = chat("summarise the nightly logs for the archive", 8, true);
    background["molt"] = json!({"class": "background"});
    let mut bg = open(addr, &background).await;
    let mut fg = open(addr, &chat("what is the staging host called", 8, true)).await;
    // Both wait while the two answers run.
    let st = status(addr).await;
    assert_eq!(st["queue"]["waiting"], 2, "{st}");
    let (_, _, ebg, efg) = tokio::join!(
        drain(&mut long, head_long),
        drain(&mut short, head_short),
        drain(&mut bg, Vec::new()),
        drain(&mut fg, Vec::new())
    );
    let first = |e: &[(Instant, Value)]| e.iter().find(|(_, e)| molt_kind(e) == "token").unwrap().0;
    assert!(
        first(&efg) < first(&ebg),
        "the background request, queued first, joined before the foreground one"
    );
    srv.shutdown().await;
}

/// A non-streamed chat turn of `messages` (greedy): the response.
async fn turn(addr: SocketAddr, messages: &[Value]) -> Value {
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0});
    let r = client::post_json(addr, "/v1/chat/completions", &body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json().unwrap()
}

fn cached(r: &Value) -> u64 {
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens reported: {r}"))
}

fn conversation_id(r: &Value) -> String {
    r["molt"]["conversation"]["id"]
        .as_str()
        .unwrap()
        .to_string()
}

fn listed<'a>(status: &'a Value, id: &str) -> &'a Value {
    status["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed: {status}"))
}

/// The batched loop with two sequences, its state files under `dir`/state.
async fn batched_with_state(dir: &std::path::Path) -> harness::Running {
    batched_with_state_and(dir, |_| {}).await
}

/// [`batched_with_state`], the configuration then changed by `edit`.
async fn batched_with_state_and(
    dir: &std::path::Path,
    edit: impl FnOnce(&mut molt_server::ServerConfig) + Send + 'static,
) -> harness::Running {
    let state = dir.join("state");
    start(move |c| {
        c.parallel = 2;
        c.state_dir = Some(state);
        edit(c);
    })
    .await
}

/// Reads the foreground stream of a cut until it stalls, and checks the stall is the whole
/// batch parking (no rung holds it), not a set-aside.
async fn until_the_batch_parks(fg: &mut EventStream, efg: &mut Vec<(Instant, Value)>) {
    until_stall(fg, efg, "foreground").await;
    let reason = of_kind(efg, "stall")[0]["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(reason.contains("below every rung"), "{reason}");
}

/// Conversations in the batched loop, as in the one-at-a-time loop: a continued conversation
/// re-reads only its new turn (its kept sequence is taken over), the status lists each one
/// kept on its rung with its tokens and bytes; when a third conversation needs the sequence
/// the oldest holds, that one is hibernated to its state file, and its next turn wakes from
/// the file, again re-reading only the new turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_are_kept_hibernated_and_continued_in_the_batch() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = batched_with_state(dir.path()).await;
    let addr = srv.addr;
    let user = |s: &str| json!({"role": "user", "content": s});
    let mut convs = Vec::new();
    for first in [FIRST, SECOND] {
        let mut msgs = vec![user(first)];
        let r = turn(addr, &msgs).await;
        assert_eq!(r["molt"]["conversation"]["new"], true, "{r}");
        msgs.push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
        let first_prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();
        convs.push((conversation_id(&r), msgs, first_prompt));
    }
    let st = status(addr).await;
    for (id, _, _) in &convs {
        let c = listed(&st, id);
        assert_eq!(
            (c["state"].as_str(), c["rung"].as_str()),
            (Some("kept"), Some("big")),
            "{c}"
        );
        assert!(
            c["tokens"].as_u64().unwrap() > 0 && c["bytes"].as_u64().unwrap() > 0,
            "{c}"
        );
    }
    // The first conversation's next turn: its whole first turn comes from its kept sequence.
    let [(id_a, msgs_a, first_a), (id_b, msgs_b, first_b)] = &mut convs[..] else {
        unreachable!()
    };
    msgs_a.push(user("and then?"));
    let r = turn(addr, msgs_a).await;
    assert_eq!(conversation_id(&r), *id_a, "{r}");
    assert_eq!(r["molt"]["conversation"]["new"], false, "{r}");
    assert!(cached(&r) >= *first_a, "only the new turn is read: {r}");
    msgs_a.push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
    // A third conversation takes the second's place (the oldest kept): the second goes to
    // its state file.
    let r = turn(addr, &[user("a third conversation about parked weights")]).await;
    assert_eq!(r["molt"]["conversation"]["new"], true, "{r}");
    let st = status(addr).await;
    let b = listed(&st, id_b);
    assert_eq!(b["state"], "hibernated", "{b}");
    let file = b["file"].as_str().unwrap();
    assert!(std::path::Path::new(file).exists(), "{b}");
    // Its next turn wakes from the file: the first turn is not read again.
    msgs_b.push(user("and then?"));
    let r = turn(addr, msgs_b).await;
    assert_eq!(conversation_id(&r), *id_b, "{r}");
    assert!(
        cached(&r) >= *first_b,
        "woken from its file, only the new turn read: {r}"
    );
    let st = status(addr).await;
    assert_eq!(listed(&st, id_b)["state"], "kept", "{st}");
    assert_eq!(listed(&st, id_a)["state"], "hibernated", "{st}");
    srv.shutdown().await;
}

/// A conversation hibernated on a rung the budget then no longer holds wakes on the rung that
/// fits, its file's cache carried there through the switch (the rung that wrote it is not
/// loaded): its next turn re-reads only the new turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_a_rung_the_budget_no_longer_holds_wakes_through_the_switch() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = batched_with_state(dir.path()).await;
    let addr = srv.addr;
    let user = |s: &str| json!({"role": "user", "content": s});
    let mut msgs = vec![user(FIRST)];
    let r = turn(addr, &msgs).await;
    let id = conversation_id(&r);
    let first = r["usage"]["prompt_tokens"].as_u64().unwrap();
    msgs.push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
    assert_eq!(listed(&status(addr).await, &id)["rung"], "big");
    // The budget falls below the big rungs: the idle batch hibernates the conversation to
    // its file and lets its rung go.
    let cut = small_only_budget(addr).await;
    set_budget(addr, json!({"mib": cut})).await;
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let st = status(addr).await;
        if listed(&st, &id)["state"] == "hibernated" {
            break;
        }
        assert!(Instant::now() < deadline, "not hibernated: {st}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    msgs.push(user("and then?"));
    let r = turn(addr, &msgs).await;
    assert_eq!(conversation_id(&r), id, "{r}");
    assert!(
        cached(&r) >= first,
        "woken through the switch, only the new turn read: {r}"
    );
    let st = status(addr).await;
    let c = listed(&st, &id);
    assert_eq!(
        (c["state"].as_str(), c["rung"].as_str()),
        (Some("kept"), Some("small")),
        "{c}"
    );
    srv.shutdown().await;
}

/// A budget in MiB that holds the small rung with a foreground answer to `SECOND` of
/// `fg_max` tokens whole, and a few cells to spare — not with a long background answer's
/// cache beside it.
async fn fg_alone_cut(addr: SocketAddr, fg_max: u64) -> f64 {
    let probe = client::post_json(addr, "/v1/chat/completions", &chat(SECOND, 1, false))
        .await
        .unwrap()
        .json()
        .unwrap();
    let fg_prompt = probe["usage"]["prompt_tokens"].as_u64().unwrap();
    let s = status(addr).await;
    let small = s["engine"]["rungs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "small")
        .unwrap()
        .clone();
    let kv = small["kv_bytes_per_token"].as_f64().unwrap();
    small["resident_mib"].as_f64().unwrap() + kv * (fg_prompt + fg_max + 4) as f64 / 1048576.0
}

/// The long background request of the set-aside tests.
fn background_request() -> Value {
    let long = [FIRST, SECOND, FIRST, SECOND].join("; ");
    let mut background = chat(&long, 160, true);
    background["molt"] = json!({"class": "background"});
    background
}

/// The set-aside tests' scene, once the budget is cut: a long background answer was 4 tokens
/// in and a foreground answer to `SECOND` 1 token in when the budget fell to `cut` MiB, what
/// holds the small rung with the foreground answer alone. Both streams and their events so far.
struct Cut {
    cut: f64,
    bg: EventStream,
    ebg: Vec<(Instant, Value)>,
    fg: EventStream,
    efg: Vec<(Instant, Value)>,
}

/// The shortest time between two tokens on the set-aside tests' servers. The tiny rungs
/// decode a token in ~0.2 ms: unpaced, the 16-token foreground answer ended (~5 ms) before the
/// budget cut posted after its first token reached the engine, and a set-aside answer resumed
/// (the foreground one ended) before the test could look at its file — both seen on CI.
const SCENE_PACE: Duration = Duration::from_millis(10);

/// The set-aside tests' server: [`batched_with_state_and`], paced by [`SCENE_PACE`].
async fn scene_server(
    dir: &std::path::Path,
    edit: impl FnOnce(&mut molt_server::ServerConfig) + Send + 'static,
) -> harness::Running {
    batched_with_state_and(dir, move |c| {
        c.token_pace = Some(SCENE_PACE);
        edit(c);
    })
    .await
}

async fn both_running_then_cut(addr: SocketAddr, background: &Value, fg_max: u64) -> Cut {
    let cut = fg_alone_cut(addr, fg_max).await;
    let mut bg = open(addr, background).await;
    let ebg = until_tokens(&mut bg, 4).await;
    let mut fg = open(addr, &chat(SECOND, fg_max as usize, true)).await;
    let efg = until_tokens(&mut fg, 1).await;
    set_budget(addr, json!({"mib": cut})).await;
    Cut {
        cut,
        bg,
        ebg,
        fg,
        efg,
    }
}

/// Reads `s` into `events` until a stall event has come; `who` names the answer if it ends
/// first.
async fn until_stall(s: &mut EventStream, events: &mut Vec<(Instant, Value)>, who: &str) {
    while !events.iter().any(|(_, e)| molt_kind(e) == "stall") {
        let ev = next(s).await;
        events.push(ev.unwrap_or_else(|| panic!("the {who} answer ended unparked")));
    }
}

/// The lever events' names, in order.
fn levers(events: &[(Instant, Value)]) -> Vec<&str> {
    of_kind(events, "lever")
        .iter()
        .filter_map(|l| l["lever"].as_str())
        .collect()
}

/// The finish reason of a stream's last chunk that has one.
fn finish_reason(events: &[(Instant, Value)]) -> &str {
    events
        .iter()
        .rev()
        .find_map(|(_, e)| e["choices"][0]["finish_reason"].as_str())
        .unwrap()
}

/// The events of a stream that are `kind`, their `molt` objects.
fn of_kind<'a>(events: &'a [(Instant, Value)], kind: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(_, e)| molt_kind(e) == kind)
        .map(|(_, e)| &e["molt"])
        .collect()
}

/// Issue 17: when no rung holds both running answers but the smallest holds the foreground
/// one alone, the scheduler's plan sets the background answer aside — its cache to a file
/// under the state directory, a stall and a `park` lever in its stream — and the foreground
/// one goes on on the smallest rung without a stall (before, the whole batch parked). When
/// memory returns, the background answer resumes from its file on its own rung and ends as
/// it ends alone, token for token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_answer_is_set_aside_so_the_foreground_one_goes_on() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = scene_server(dir.path(), |_| {}).await;
    let addr = srv.addr;
    let background = background_request();
    let want_bg = alone(addr, &background).await;
    let fg_max = 16u64;
    let Cut {
        cut,
        mut bg,
        mut ebg,
        mut fg,
        efg: head_fg,
    } = both_running_then_cut(addr, &background, fg_max).await;
    assert!(cut < small_only_budget(addr).await);
    // The background answer hears it is set aside; its cache waits in a file.
    until_stall(&mut bg, &mut ebg, "background").await;
    let aside_dir = dir.path().join("state").join("aside");
    let files = || {
        std::fs::read_dir(&aside_dir)
            .map(|d| d.flatten().count())
            .unwrap_or(0)
    };
    assert_eq!(files(), 1, "one cache set aside in {}", aside_dir.display());
    let st = status(addr).await;
    let efg = drain(&mut fg, head_fg).await;
    assert!(
        of_kind(&efg, "stall").is_empty(),
        "the foreground answer stalled: {:?}",
        of_kind(&efg, "stall")
    );
    let switches = of_kind(&efg, "switch");
    assert_eq!(switches.len(), 1, "{switches:?}");
    assert_eq!(
        (switches[0]["from"].as_str(), switches[0]["to"].as_str()),
        (Some("big"), Some("small"))
    );
    assert_eq!(
        tokens(&efg).len() as u64,
        fg_max,
        "the foreground answer ran to its end"
    );
    // The background conversation is listed parked while set aside.
    let bg_conv = st["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["state"] == "parked");
    assert!(bg_conv.is_some(), "no parked conversation: {st}");

    set_budget(addr, json!({"unlimited": true})).await;
    let ebg = drain(&mut bg, ebg).await;
    let stall = of_kind(&ebg, "stall");
    let reason = stall[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("set aside") && reason.contains("in a file"),
        "{reason}"
    );
    let levers = levers(&ebg);
    assert_eq!(levers, ["park", "resume"], "{levers:?}");
    assert!(
        of_kind(&ebg, "switch").is_empty(),
        "it resumed on the rung it left: no switch"
    );
    assert_eq!(
        text(&ebg),
        want_bg,
        "the background answer, set aside and resumed vs alone"
    );
    assert_eq!(files(), 0, "its file is removed once read back");
    srv.shutdown().await;
}

/// A budget in MiB that holds rung `name` with a few hundred cells and no larger rung.
async fn only_budget(addr: SocketAddr, name: &str) -> f64 {
    let s = status(addr).await;
    let rungs = s["engine"]["rungs"].as_array().unwrap();
    let mib = |r: &Value, key: &str| r[key].as_f64().unwrap();
    let rung = rungs.iter().find(|r| r["name"] == name).unwrap();
    let cut = rungs
        .iter()
        .filter(|r| mib(r, "resident_mib") > mib(rung, "resident_mib"))
        .map(|r| mib(r, "resident_mib"))
        .fold(f64::INFINITY, f64::min)
        - 0.1;
    assert!(mib(rung, "resident_mib") + 1.0 < cut, "{rungs:?}");
    cut
}

/// The set-aside scene, then a budget that holds rung `to` with the background answer and no
/// larger rung once the foreground answer has ended: the background answer, set aside on
/// big, resumes on `to`. Checks what holds whatever the route (park then resume, one switch
/// big → `to`, token indices without a gap, big before the switch and `to` after, the text
/// before the cut as alone, its file removed) and returns the switch event.
async fn set_aside_then_resumed_on(to: &str, carry_on_resume: bool) -> Value {
    let dir = tempfile::tempdir().unwrap();
    // Down the size route, the projection alone (no token recompute): the default's choice
    // would cover most of this short conversation and re-read all of it, leaving nothing for
    // a refill to show.
    let projection_only = to == "small";
    let srv = scene_server(dir.path(), move |c| {
        c.carry_on_resume = carry_on_resume;
        if projection_only {
            c.session.token_recompute = None;
        }
    })
    .await;
    let addr = srv.addr;
    let background = background_request();
    let want_bg = alone(addr, &background).await;
    let holds_to = only_budget(addr, to).await;
    let Cut {
        mut bg,
        mut ebg,
        mut fg,
        efg,
        ..
    } = both_running_then_cut(addr, &background, 16).await;
    until_stall(&mut bg, &mut ebg, "background").await;
    // The foreground answer ends on the small rung; the cut still holds it alone, so the
    // background answer stays aside.
    drain(&mut fg, efg).await;
    let listed = status(addr).await;
    assert!(
        listed["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["state"] == "parked"),
        "still set aside after the foreground answer ended: {listed}"
    );
    set_budget(addr, json!({"mib": holds_to})).await;
    let ebg = drain(&mut bg, ebg).await;
    let switches = of_kind(&ebg, "switch");
    assert_eq!(switches.len(), 1, "{switches:?}");
    let sw = switches[0].clone();
    // A cache carried down a size route is then re-read in place behind the answer.
    let refilled = sw["method"] == "molt" && to == "small";
    assert_eq!(
        levers(&ebg),
        if refilled {
            vec!["park", "resume", "refill"]
        } else {
            vec!["park", "resume"]
        },
        "{sw}"
    );
    assert_eq!(
        (sw["from"].as_str(), sw["to"].as_str()),
        (Some("big"), Some(to))
    );
    let toks = tokens(&ebg);
    // It runs to its end: its 160 tokens, or the end of text the random tiny model may pick
    // after the switch (where the switch falls depends on when the cut lands, and so does the
    // continuation; a full-suite run saw one answer stop early on big-q8).
    match finish_reason(&ebg) {
        "length" => assert_eq!(toks.len(), 160, "it ran to its end"),
        "stop" => assert!(toks.len() > 16 && toks.len() <= 160, "{}", toks.len()),
        other => panic!("ended by {other}"),
    }
    assert!(
        toks.iter().enumerate().all(|(i, (k, _))| *k == i as u64),
        "token indices run on without a gap: {toks:?}"
    );
    let at = usize::try_from(sw["at_token"].as_u64().unwrap()).unwrap();
    assert!(
        toks[..at].iter().all(|(_, r)| r == "big") && toks[at..].iter().all(|(_, r)| r == to),
        "big before the switch at token {at}, {to} after: {toks:?}"
    );
    let before: String = ebg
        .iter()
        .filter(|(_, e)| molt_kind(e) == "token")
        .take(at)
        .filter_map(|(_, e)| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(
        want_bg.starts_with(&before),
        "the text before the cut is the one it gives alone: {before:?} vs {want_bg:?}"
    );
    let aside_dir = dir.path().join("state").join("aside");
    assert_eq!(
        std::fs::read_dir(&aside_dir).map_or(0, |d| d.flatten().count()),
        0,
        "its file is removed once read back"
    );
    srv.shutdown().await;
    sw
}

/// A set-aside answer resumes on the rung the budget holds, not only the one it left. On a
/// size route (big → small) its history is re-read there, said in the switch's note: a
/// projected cache loses the context's facts, and the answer has waited already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_aside_answer_resumed_on_a_smaller_model_re_reads_its_history() {
    let _serial = serial().await;
    let sw = set_aside_then_resumed_on("small", false).await;
    assert_eq!(sw["method"], "reprefill", "{sw}");
    assert!(
        sw["note"].as_str().unwrap_or("").contains("re-read"),
        "{sw}"
    );
    // `serve --carry-on-resume` (the behaviour before, kept for comparison) carries it.
    let sw = set_aside_then_resumed_on("small", true).await;
    assert_eq!(sw["method"], "molt", "carried: {sw}");
}

/// On a precision route (big → big-q8) a set-aside answer's cache is carried through the
/// switch: the projection keeps the facts there, at a fraction of a re-read's cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_aside_answer_resumed_on_a_lower_precision_is_carried() {
    let _serial = serial().await;
    let sw = set_aside_then_resumed_on("big-q8", false).await;
    assert_eq!(sw["method"], "molt", "carried, not re-read: {sw}");
}

/// `serve --no-set-aside` keeps the behaviour before set-aside, for comparison: the same cut
/// parks the whole batch, the foreground answer with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_set_aside_the_same_cut_parks_the_whole_batch() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = scene_server(dir.path(), |c| c.set_aside = false).await;
    let addr = srv.addr;
    let Cut {
        mut bg,
        ebg: head_bg,
        mut fg,
        mut efg,
        ..
    } = both_running_then_cut(addr, &background_request(), 16).await;
    until_the_batch_parks(&mut fg, &mut efg).await;
    set_budget(addr, json!({"unlimited": true})).await;
    let (ebg, efg) = tokio::join!(drain(&mut bg, head_bg), drain(&mut fg, efg));
    assert_eq!(
        tokens(&efg).len(),
        16,
        "the foreground answer ends after the park"
    );
    assert!(!of_kind(&ebg, "stall").is_empty());
    srv.shutdown().await;
}

/// A set-aside cache that cannot be read back (its file truncated while it waits) is not
/// used: the answer re-reads its history on resuming and runs to its end, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_aside_cache_that_cannot_be_read_back_is_re_read() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = scene_server(dir.path(), |_| {}).await;
    let addr = srv.addr;
    let Cut {
        mut bg,
        mut ebg,
        mut fg,
        efg: head_fg,
        ..
    } = both_running_then_cut(addr, &background_request(), 16).await;
    until_stall(&mut bg, &mut ebg, "background").await;
    let file = std::fs::read_dir(dir.path().join("state").join("aside"))
        .unwrap()
        .flatten()
        .next()
        .expect("a set-aside file")
        .path();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let _ = drain(&mut fg, head_fg).await;
    set_budget(addr, json!({"unlimited": true})).await;
    let ebg = drain(&mut bg, ebg).await;
    let levers = levers(&ebg);
    assert_eq!(levers, ["park", "resume"], "{levers:?}");
    let finish = finish_reason(&ebg);
    assert!(matches!(finish, "length" | "stop"), "{finish}");
    assert!(tokens(&ebg).len() > 4, "it went on after resuming");
    assert!(!file.exists(), "the unreadable file is removed");
    srv.shutdown().await;
}

/// With every sequence running a background answer, a foreground request does not wait for
/// one to end: the later background answer is set aside (its cache to its file) and the
/// request joins in its sequence; the set-aside answer resumes once a sequence frees, and
/// ends as it ends alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreground_request_takes_a_background_answers_sequence() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = batched_with_state(dir.path()).await;
    let addr = srv.addr;
    let mut first = chat(FIRST, 400, true);
    first["molt"] = json!({"class": "background"});
    let mut second = chat(SECOND, 400, true);
    second["molt"] = json!({"class": "background"});
    let want_second = alone(addr, &second).await;
    let mut b1 = open(addr, &first).await;
    let head_1 = until_tokens(&mut b1, 2).await;
    let mut b2 = open(addr, &second).await;
    let head_2 = until_tokens(&mut b2, 2).await;
    let mut fg = open(addr, &chat("what is the staging host called", 8, true)).await;
    // Read together: each event's time is when it arrived.
    let (efg, e1, e2) = tokio::join!(
        drain(&mut fg, Vec::new()),
        drain(&mut b1, head_1),
        drain(&mut b2, head_2)
    );
    let last = |e: &[(Instant, Value)]| e.iter().rfind(|(_, e)| molt_kind(e) == "token").unwrap().0;
    let fg_first = efg.iter().find(|(_, e)| molt_kind(e) == "token").unwrap().0;
    assert!(
        fg_first < last(&e1) && fg_first < last(&e2),
        "the foreground request waited for a background answer to end"
    );
    assert!(of_kind(&e1, "stall").is_empty(), "the earlier one runs on");
    let stall = of_kind(&e2, "stall");
    assert_eq!(stall.len(), 1, "{stall:?}");
    let reason = stall[0]["reason"].as_str().unwrap();
    assert!(reason.contains("a foreground request waits"), "{reason}");
    let levers = levers(&e2);
    assert_eq!(levers, ["park", "resume"], "{levers:?}");
    assert_eq!(text(&e2), want_second, "set aside and resumed vs alone");
    srv.shutdown().await;
}

/// A set-aside cache counts against `--state-max-mib` with the conversations' files: one that
/// would pass the bound is not written (no conversation's file is evicted for it); the answer
/// stays in its sequence and the batch is fitted as a whole — it parks, and both answers end
/// once memory returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_aside_past_the_state_bound_parks_the_batch_instead() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let srv = scene_server(dir.path(), |c| c.state_max_mib = 0).await;
    let addr = srv.addr;
    let Cut {
        mut bg,
        ebg: head_bg,
        mut fg,
        mut efg,
        ..
    } = both_running_then_cut(addr, &background_request(), 16).await;
    until_the_batch_parks(&mut fg, &mut efg).await;
    let aside = dir.path().join("state").join("aside");
    assert_eq!(
        std::fs::read_dir(&aside).map_or(0, |d| d.flatten().count()),
        0,
        "nothing written past the bound"
    );
    set_budget(addr, json!({"unlimited": true})).await;
    let (ebg, efg) = tokio::join!(drain(&mut bg, head_bg), drain(&mut fg, efg));
    assert_eq!(tokens(&efg).len(), 16, "the foreground answer ends");
    let finish = finish_reason(&ebg);
    assert!(matches!(finish, "length" | "stop"), "{finish}");
    srv.shutdown().await;
}

/// A measurement of `big` saying repack doubles its prefill for 300 MiB more, bound to the
/// tiny ladder's files the way `bench --speed --tune` writes it.
fn repack_measured(dir: &std::path::Path) -> molt::speed::Measured {
    let l = common::tiny_ladder();
    let rows = vec![
        common::speed_row("big", false, 100.0, 1.0),
        common::speed_row("big", true, 200.0, 301.0),
    ];
    molt::speed::SpeedFile::of(l, 2, &rows).save(dir).unwrap();
    let (m, refused) = molt::speed::Measured::find(&[dir.to_path_buf()], l);
    assert!(refused.is_empty(), "{refused:?}");
    m.expect("the file is found")
}

/// Both request loops run their rung with the setup the speed policy gives it under the
/// operator's budget: with room to spare `big` is loaded with repack before the first request
/// (the status says so and counts repack's memory in what the engine holds); a budget that
/// holds `big` only without it frees the idle rung, and the next answer loads `big` again
/// without repack — the same rung, not a smaller one.
async fn runs_its_rung_as_the_speed_policy_says(parallel: usize) {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = molt::speed::SpeedPolicy {
        measured: Some(std::sync::Arc::new(repack_measured(dir.path()))),
        forced_ubatch: None,
        forced_repack: None,
    };
    let srv = start(move |c| {
        c.parallel = parallel;
        c.session.speed = policy;
    })
    .await;
    let addr = srv.addr;
    let st = status(addr).await;
    let e = &st["engine"];
    assert_eq!(e["current_rung"], "big");
    let setup = e["setup"].as_str().unwrap();
    assert!(setup.contains("repack on (measured"), "{setup}");
    let big = e["rungs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "big")
        .unwrap();
    let (weights, full) = (
        big["weights_mib"].as_f64().unwrap(),
        big["full_context_mib"].as_f64().unwrap(),
    );
    let held_mib = e["modelled_bytes"].as_f64().unwrap() / 1_048_576.0;
    assert!(
        // (the status rounds MiB to a tenth)
        held_mib >= weights + 299.9,
        "repack's 300 MiB is counted: {held_mib:.1} MiB held, {weights:.1} MiB of weights"
    );

    // 100 MiB above big with a full window at the default setup (the status's cost of the
    // loaded rung holds its repack): repack's 300 MiB no longer fits.
    let budget = full - 300.0 + 100.0;
    set_budget(addr, json!({"mib": budget})).await;
    let r = client::post_json(addr, "/v1/chat/completions", &chat(FIRST, 8, false))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let st = status(addr).await;
    let e = &st["engine"];
    assert_eq!(e["current_rung"], "big", "the same rung, not a smaller one");
    let setup = e["setup"].as_str().unwrap();
    assert!(setup.contains("repack off (measured"), "{setup}");
    let held_mib = e["modelled_bytes"].as_f64().unwrap() / 1_048_576.0;
    assert!(held_mib <= budget, "{held_mib:.1} MiB held");
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_runs_its_rung_as_the_speed_policy_says_and_counts_what_that_costs() {
    runs_its_rung_as_the_speed_policy_says(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serial_loop_takes_its_rung_s_setup_before_the_first_request() {
    runs_its_rung_as_the_speed_policy_says(1).await;
}
