//! The one-at-a-time service under a moving budget, on the tiny ladder: an idle server whose
//! budget falls below what it holds hibernates the conversation it holds to its state file and
//! frees every rung, and the next request wakes that conversation from its file, reading none
//! of the history the file holds again; queued requests are taken foreground first, then by
//! priority, whatever order they came in.

mod common;
#[path = "common/server.rs"]
mod harness;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use harness::{serial, start};
use molt::state::StateFile;
use molt_server::client::{self, EventStream};
use serde_json::{Value, json};

async fn status(addr: SocketAddr) -> Value {
    let r = client::request(addr, "GET", "/v1/molt/status", None)
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    r.json().unwrap()
}

async fn set_budget(addr: SocketAddr, body: Value) {
    let r = client::post_json(addr, "/v1/molt/budget", &body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Polls the status until `pred` holds (the engine acts between two looks at its queue); the
/// 60 s bound only turns a hang into a failure naming what was awaited.
async fn wait_for(addr: SocketAddr, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let s = status(addr).await;
        if pred(&s) {
            return s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "never saw {what}: {s}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn conversation<'a>(status: &'a Value, id: &str) -> Option<&'a Value> {
    status["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
}

async fn ask(addr: SocketAddr, body: &Value) -> Value {
    let r = client::post_json(addr, "/v1/chat/completions", body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json().unwrap()
}

/// The prompt tokens of `messages` as the server renders them.
fn rendered(messages: &[Value]) -> Vec<i32> {
    let small = common::tiny_ladder().rungs.last().unwrap();
    let m = molt::engine::Model::load_vocab_only(&small.path, small.name()).unwrap();
    let msgs: Vec<_> = messages
        .iter()
        .map(|v| {
            molt::engine::ChatMessage::new(
                v["role"].as_str().unwrap(),
                v["content"].as_str().unwrap(),
            )
        })
        .collect();
    m.tokenize_chat(&msgs, true).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_that_falls_while_idle_hibernates_the_conversation_and_frees_every_rung() {
    idle_under_a_falling_budget(1).await;
}

/// The same with answers decoded together (the default loop): it blocked waiting for the
/// next request and held its rung and kept conversations whatever the budget did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_server_idle_under_a_falling_budget_hibernates_and_frees_its_rung() {
    idle_under_a_falling_budget(4).await;
}

/// A conversation kept on an idle server with `parallel` answers at once; the budget falls
/// below what it holds; nothing is asked of it; then a request comes while no rung fits, and
/// memory returns.
async fn idle_under_a_falling_budget(parallel: usize) {
    let _serial = serial().await;
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let st_dir = state.clone();
    let srv = start(move |c| {
        c.parallel = parallel;
        c.state_dir = Some(st_dir);
    })
    .await;
    let addr = srv.addr;
    let mut msgs = vec![json!({"role": "user", "content": "My cat is called Wilhelmina."})];
    let first = ask(
        addr,
        &json!({"messages": msgs, "max_tokens": 8, "molt": {"conversation": "cat"}}),
    )
    .await;
    msgs.push(json!({"role": "assistant", "content": first["choices"][0]["message"]["content"]}));
    let st = status(addr).await;
    assert_eq!(conversation(&st, "cat").unwrap()["state"], "kept", "{st}");
    assert!(
        !st["engine"]["loaded"].as_array().unwrap().is_empty(),
        "{st}"
    );
    let held_mib = st["engine"]["modelled_bytes"].as_f64().unwrap() / f64::from(1 << 20);
    assert!(held_mib > 0.0, "{st}");

    // The budget falls below what the idle engine holds, and nothing is asked of it: it must
    // act on its own.
    set_budget(addr, json!({"mib": 1})).await;
    let st = wait_for(
        addr,
        "the conversation hibernated and every rung freed",
        |s| {
            conversation(s, "cat").is_some_and(|c| c["state"] == "hibernated")
                && s["engine"]["loaded"].as_array().unwrap().is_empty()
        },
    )
    .await;
    assert_eq!(st["engine"]["released"], true, "{st}");
    assert_eq!(st["engine"]["modelled_bytes"], 0, "{st}");
    assert_eq!(st["counters"]["released"], 1, "{st}");
    let file = state.join("cat.molt-state");
    let held = StateFile::from_bytes(&file, &std::fs::read(&file).unwrap())
        .unwrap()
        .meta
        .tokens;

    // A request that comes while no rung fits waits; memory returns; the conversation is
    // woken from its file: every token the file holds that the request shares comes from it.
    msgs.push(json!({"role": "user", "content": "What is my cat called?"}));
    let body = json!({"messages": msgs, "max_tokens": 8});
    let waiting = tokio::spawn(async move { ask(addr, &body).await });
    wait_for(addr, "the request deferred for memory", |s| {
        s["counters"]["deferred"] == 1
    })
    .await;
    set_budget(addr, json!({"unlimited": true})).await;
    let r = waiting.await.unwrap();
    assert_eq!(r["molt"]["conversation"]["id"], "cat", "{r}");
    let prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let req = rendered(&msgs);
    let shared = held.iter().zip(&req).take_while(|(a, b)| a == b).count() as u64;
    assert!(shared > 0);
    assert_eq!(cached, shared.min(prompt - 1), "{r}");
    srv.shutdown().await;
}

/// Opens a streamed chat of conversation `id` (`class`, `priority`), returning the stream
/// after its first event.
async fn open(
    addr: SocketAddr,
    id: &str,
    class: &str,
    priority: i32,
    max_tokens: usize,
) -> (EventStream, Value) {
    let body = json!({
        "messages": [{"role": "user", "content": format!("conversation {id} asks something")}],
        "max_tokens": max_tokens,
        "stream": true,
        "molt": {"conversation": id, "class": class, "priority": priority},
    });
    let mut s = client::stream(addr, "/v1/chat/completions", &body)
        .await
        .unwrap()
        .ok()
        .unwrap();
    let first = s.next().await.unwrap().unwrap().json().unwrap();
    (s, first)
}

async fn drain(s: &mut EventStream) {
    while s.next().await.unwrap().is_some() {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_are_taken_foreground_first_then_by_priority() {
    let _serial = serial().await;
    let d = tempfile::tempdir().unwrap();
    let record = d.path().join("record.json");
    let rec = record.clone();
    let srv = start(move |c| {
        c.parallel = 1;
        c.record = Some(rec);
        c.token_pace = Some(Duration::from_millis(20));
    })
    .await;
    let addr = srv.addr;
    // A long answer holds the engine while three others queue behind it: a background one of
    // low priority, a background one of high priority, then a foreground one.
    let (mut busy, _) = open(addr, "busy", "foreground", 0, 48).await;
    wait_for(addr, "the first answer running", |s| {
        conversation(s, "busy").is_some_and(|c| c["state"] == "running")
    })
    .await;
    let mut queued = Vec::new();
    for (id, class, priority) in [
        ("bg-low", "background", 0),
        ("bg-high", "background", 5),
        ("fg", "foreground", 0),
    ] {
        let (s, first) = open(addr, id, class, priority, 2).await;
        assert_eq!(first["molt"]["event"], "queued", "{id}: {first}");
        queued.push(s);
    }
    drain(&mut busy).await;
    for s in &mut queued {
        drain(s).await;
    }
    srv.shutdown().await;
    let doc: Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    let order: Vec<&str> = doc["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "conversation")
        .filter_map(|e| e["detail"]["id"].as_str())
        .collect();
    assert_eq!(order, ["busy", "fg", "bg-high", "bg-low"]);
}
