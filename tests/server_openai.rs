//! The OpenAI fields a client sends, on the tiny ladder over real sockets: `stop` (never a
//! partial stop string, streaming or not, even across token boundaries), `logprobs` /
//! `top_logprobs` (each entry naming its rung), `seed`, presence and frequency penalties,
//! `max_completion_tokens`, `user`, `response_format: json_object`, and the plain-text
//! `/v1/completions` endpoint — with usage counts that agree between the two modes.

mod common;
#[path = "common/server.rs"]
mod harness;

use std::net::SocketAddr;
use std::time::Duration;

use molt_server::client::{self, EventStream};
use serde_json::{Value, json};

const PROMPT: &str = "the scheduler parks the weights of a background job";

fn chat(extra: &Value) -> Value {
    let mut body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let r = client::post_json(addr, path, body).await.unwrap();
    let v = r.json().unwrap_or(Value::Null);
    (r.status, v)
}

async fn ok(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (status, v) = post(addr, path, body).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Every data event of a stream (`[DONE]` as a string).
async fn stream(addr: SocketAddr, path: &str, body: &Value) -> Vec<Value> {
    let mut s: EventStream = client::stream(addr, path, body)
        .await
        .unwrap()
        .ok()
        .unwrap();
    let mut out = Vec::new();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(60), s.next())
        .await
        .expect("stream stalls")
        .unwrap()
    {
        out.push(ev.json().unwrap_or(Value::String(ev.data)));
    }
    assert_eq!(out.last(), Some(&Value::String("[DONE]".into())));
    out
}

/// Token chunks of a chat stream.
fn token_chunks(events: &[Value]) -> Vec<&Value> {
    events
        .iter()
        .filter(|e| e["molt"]["event"] == "token")
        .collect()
}

/// The streamed text of a chat.
fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn finish(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .next_back()
        .unwrap_or("")
        .to_string()
}

fn usage(events: &[Value]) -> Value {
    events
        .iter()
        .find(|e| e.get("usage").is_some())
        .map(|e| e["usage"].clone())
        .unwrap_or(Value::Null)
}

/// Two characters straddling the boundary between two token pieces, and where in the whole
/// text they first occur: a stop string a token-level matcher would miss, or leak half of.
fn straddling_stop(pieces: &[String]) -> (String, usize) {
    let text: String = pieces.concat();
    let mut at = 0;
    for w in pieces.windows(2).skip(1) {
        at += w[0].len();
        let (Some(a), Some(b)) = (w[0].chars().next_back(), w[1].chars().next()) else {
            continue;
        };
        if w[0].chars().count() < 2 {
            continue;
        }
        let stop = format!("{a}{b}");
        let first = text.find(&stop).unwrap();
        // The first occurrence must be this straddling one.
        if first + a.len_utf8() == at {
            return (stop, first);
        }
    }
    panic!("no two pieces to straddle in {pieces:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_answer_and_are_never_sent_even_across_tokens() {
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let plain = stream(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    let pieces: Vec<String> = token_chunks(&plain)
        .iter()
        .map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let full: String = pieces.concat();
    let (stop, at) = straddling_stop(&pieces);
    let expected = &full[..at];

    // Not streamed: the text before the stop string, finish_reason stop.
    let v = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"stop": [stop.clone(), "never-seen-zzz"]})),
    )
    .await;
    assert_eq!(
        v["choices"][0]["message"]["content"], expected,
        "stop {stop:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Every token generated counts, including those that completed the stop string.
    let through = pieces
        .iter()
        .scan(0, |n, p| {
            *n += p.len();
            Some(*n)
        })
        .position(|n| n >= at + stop.len())
        .unwrap()
        + 1;
    assert_eq!(v["usage"]["completion_tokens"], through);

    // Streamed: the same text, and no chunk carries any part of the stop string.
    let events = stream(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"stop": stop, "stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(streamed_text(&events), expected);
    assert_eq!(finish(&events), "stop");
    assert_eq!(usage(&events)["completion_tokens"], through);
    assert_eq!(token_chunks(&events).len(), through);

    // Bad stops are refused, naming the parameter.
    for bad in [
        json!(["a", "b", "c", "d", "e"]),
        json!(""),
        json!([""]),
        json!(3),
    ] {
        let (status, e) = post(addr, "/v1/chat/completions", &chat(&json!({"stop": bad}))).await;
        assert_eq!(status, 400, "{e}");
        assert_eq!(e["error"]["param"], "stop", "{e}");
    }
    srv.shutdown().await;
}

fn check_entry(e: &Value, k: usize) {
    let lp = e["logprob"].as_f64().unwrap();
    assert!(lp <= 0.0, "{e}");
    let top = e["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), k, "{e}");
    for w in top.windows(2) {
        assert!(w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64(), "{e}");
    }
    // Greedy without penalties: the token drawn is the most likely one.
    assert_eq!(top[0]["token"], e["token"], "{e}");
    assert!(
        (top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-9,
        "{e}"
    );
    let bytes: Vec<u8> = e["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
        .collect();
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        e["token"].as_str().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_from_the_rung_that_produced_each_token() {
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let body = chat(&json!({
        "logprobs": true, "top_logprobs": 3, "max_tokens": 8,
        "molt": {"force_switch": {"at": 4, "to": "small"}},
    }));
    let v = ok(addr, "/v1/chat/completions", &body).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(content.len(), 8, "the tiny answer ended early: {v}");
    for e in content {
        check_entry(e, 3);
    }
    let rungs: Vec<&str> = content
        .iter()
        .map(|e| e["rung"].as_str().unwrap())
        .collect();
    // Forced to small before token 4 (and promoted back afterwards: nothing limits the budget).
    assert_eq!(rungs[4], "small", "{rungs:?}");
    assert!(
        rungs[..4].iter().all(|r| *r == rungs[0] && *r != "small"),
        "{rungs:?}"
    );
    let text: String = content
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(v["choices"][0]["message"]["content"], text);

    // Streamed: one entry per token chunk, naming the same rung as the chunk.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = stream(addr, "/v1/chat/completions", &sbody).await;
    let chunks = token_chunks(&events);
    assert_eq!(chunks.len(), 8);
    for c in chunks {
        let entries = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(entries.len(), 1, "{c}");
        check_entry(&entries[0], 3);
        assert_eq!(entries[0]["rung"], c["molt"]["rung"]);
    }
    // Without logprobs: null, as OpenAI sends.
    let v = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"max_tokens": 2})),
    )
    .await;
    assert!(v["choices"][0]["logprobs"].is_null());
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"logprobs": true, "top_logprobs": 21})),
    )
    .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("top_logprobs"))
    );
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_penalties_token_limits_and_user_behave_as_openai_says() {
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let sampled = |seed: i64| chat(&json!({"temperature": 1.0, "seed": seed, "user": "u-7"}));
    let text = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let a = text(&ok(addr, "/v1/chat/completions", &sampled(42)).await);
    let b = text(&ok(addr, "/v1/chat/completions", &sampled(42)).await);
    let c = text(&ok(addr, "/v1/chat/completions", &sampled(43)).await);
    assert_eq!(a, b, "the same seed sampled two answers");
    assert_ne!(a, c, "two seeds sampled the same answer");

    // Penalties: greedy text with repeated tokens changes, and repeats less.
    let tokens = |v: &Value| -> Vec<String> {
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["token"].as_str().unwrap().to_string())
            .collect()
    };
    let repeats = |t: &[String]| t.len() - t.iter().collect::<std::collections::HashSet<_>>().len();
    let base = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"logprobs": true})),
    )
    .await;
    let pen = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"logprobs": true, "frequency_penalty": 2.0, "presence_penalty": 2.0})),
    )
    .await;
    let (tb, tp) = (tokens(&base), tokens(&pen));
    assert!(repeats(&tb) > 0, "the greedy answer never repeats: {tb:?}");
    assert!(repeats(&tp) < repeats(&tb), "{tb:?} vs {tp:?}");
    // llama.cpp's repetition penalty, the same way.
    let rep = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"logprobs": true, "repeat_penalty": 10.0})),
    )
    .await;
    let tr = tokens(&rep);
    assert!(repeats(&tr) < repeats(&tb), "{tb:?} vs {tr:?}");
    for (bad, name) in [
        (json!({"presence_penalty": -2.5}), "presence_penalty"),
        (json!({"frequency_penalty": 3}), "frequency_penalty"),
        (json!({"n": 2}), "n"),
        (json!({"repeat_penalty": 0}), "repeat_penalty"),
    ] {
        let (status, e) = post(addr, "/v1/chat/completions", &chat(&bad)).await;
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some(name)),
            "{e}"
        );
    }

    // max_completion_tokens is the newer name and wins over max_tokens.
    let v = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"max_tokens": 12, "max_completion_tokens": 3})),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    srv.shutdown().await;
}

/// Every character of `s` could continue a JSON text that starts with an object.
fn json_prefix(s: &str) -> bool {
    let t = s.trim_start();
    t.starts_with('{')
        && (serde_json::from_str::<Value>(t).is_ok()
            || serde_json::from_str::<Value>(t)
                .err()
                .is_some_and(|e| e.is_eof()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_object_is_held_to_llama_cpps_json_grammar() {
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let text = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let free = text(&ok(addr, "/v1/chat/completions", &chat(&json!({}))).await);
    assert!(
        !json_prefix(&free),
        "the tiny model writes JSON unasked: {free:?}"
    );
    let fmt = json!({"response_format": {"type": "json_object"}});
    let v = ok(addr, "/v1/chat/completions", &chat(&fmt)).await;
    let constrained = text(&v);
    assert!(json_prefix(&constrained), "{constrained:?}");
    if v["choices"][0]["finish_reason"] == "stop" {
        serde_json::from_str::<Value>(&constrained).expect("a finished answer is whole JSON");
    }
    let mut sbody = chat(&fmt);
    sbody["stream"] = json!(true);
    let events = stream(addr, "/v1/chat/completions", &sbody).await;
    assert_eq!(streamed_text(&events), constrained);
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
    )
    .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("response_format"))
    );
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("json_schema"),
        "{e}"
    );
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_completions_stream_and_not_with_the_same_fields() {
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "logprobs": 2});
    let v = ok(addr, "/v1/completions", &body).await;
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    let lp = &v["choices"][0]["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{lp}");
    assert_eq!(lp["rungs"].as_array().unwrap().len(), n);
    let joined: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(joined, text);
    // The prompt is read as plain text, not as a chat turn.
    let chat_v = ok(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"max_tokens": 10})),
    )
    .await;
    assert!(v["usage"]["prompt_tokens"].as_u64() < chat_v["usage"]["prompt_tokens"].as_u64());

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let events = stream(addr, "/v1/completions", &sbody).await;
    for e in &events[..events.len() - 1] {
        assert_eq!(e["object"], "text_completion", "{e}");
    }
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(usage(&events), v["usage"]);

    // A stop string inside the text.
    let cut = text.char_indices().nth(3).map_or(text.len(), |(i, _)| i);
    let stop: String = text[cut..].chars().take(2).collect();
    if !stop.is_empty() {
        let first = text.find(&stop).unwrap();
        let mut sb = sbody.clone();
        sb["stop"] = json!(stop);
        let events = stream(addr, "/v1/completions", &sb).await;
        let streamed: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(streamed, text[..first]);
        assert_eq!(finish(&events), "stop");
    }
    for (bad, name) in [
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": "x", "echo": true}), "echo"),
        (json!({"prompt": "x", "n": 2}), "n"),
    ] {
        let (status, e) = post(addr, "/v1/completions", &bad).await;
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some(name)),
            "{e}"
        );
    }
    srv.shutdown().await;
}

/// Issue 49, hole 5 (completions): an over-long prompt names `param: "prompt"`, the field a
/// text completion has (not a chat's `messages`); and a `molt.conversation` (or class, or
/// priority), which a text completion cannot honour, is a 400 naming `molt` instead of being
/// ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_49_completions_name_their_own_fields() {
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let long = "memory pressure ".repeat(1500);
    let (status, e) = post(addr, "/v1/completions", &json!({"prompt": long})).await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    assert_eq!(e["error"]["param"], "prompt", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the prompt takes"),
        "{e}"
    );
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"messages": [{"role": "user", "content": long}]})),
    )
    .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("messages")),
        "{e}"
    );
    for molt in [
        json!({"conversation": "c1"}),
        json!({"class": "background"}),
        json!({"priority": 2}),
    ] {
        let (status, e) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1, "molt": molt}),
        )
        .await;
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some("molt")),
            "{molt}: {e}"
        );
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("no conversation"),
            "{e}"
        );
    }
    // A forced switch is still a completion's to ask for.
    let v = ok(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 4, "molt": {"force_switch": {"at": 2, "to": "small"}}}),
    )
    .await;
    assert_eq!(v["object"], "text_completion");
    srv.shutdown().await;
}

/// The stock `openai` Python client against this server (`scripts/openai_client_check.py`:
/// a budget cut mid-stream with logprobs, stop, seed, json_object, `/v1/completions`). Runs
/// when `$MOLT_PYTHON` (default `python3`) can import `openai`; otherwise says so and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stock_openai_python_client_passes_its_checks() {
    let python = std::env::var("MOLT_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_client = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_client {
        eprintln!(
            "skipped: {python} cannot import openai (pip install openai, or set MOLT_PYTHON)"
        );
        return;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/openai_client_check.py"
    );
    run_client_check(&python, script).await;
}

/// Runs a client check script (`program script --base-url … --max-tokens 160 --cut-after 4`)
/// against a fresh server and asserts it passed every check.
async fn run_client_check(program: &str, script: &'static str) {
    let _serial = harness::serial().await;
    // Tiny rungs decode a token in about a millisecond and may end an answer early: at 20 ms
    // a token, the budget cut the script posts from another thread after token 4 finds the
    // answer still running however slowly that thread gets to it.
    let srv = harness::start(|c| c.token_pace = Some(Duration::from_millis(20))).await;
    let url = format!("http://{}/v1", srv.addr);
    let program = program.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&program)
            .args([
                script,
                "--base-url",
                &url,
                "--max-tokens",
                "160",
                "--cut-after",
                "4",
            ])
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{log}");
    assert!(out.status.success(), "the client check failed:\n{log}");
    assert!(log.contains("all checks passed"), "{log}");
    srv.shutdown().await;
}

/// The official `openai` npm client against this server (`scripts/openai_node_check.mjs`).
/// Runs when `node` can load `openai` (installed beside the script, or found on `$NODE_PATH`);
/// otherwise says so and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_npm_client_passes_its_checks() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/openai_node_check.mjs");
    let has_client = std::process::Command::new("node")
        .args(["-e", "require('openai')"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts"))
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_client {
        eprintln!("skipped: node cannot load openai (npm install openai, or set NODE_PATH)");
        return;
    }
    run_client_check("node", script).await;
}

/// A grammar llama.cpp cannot compile is an error carrying llama.cpp's own message, and the
/// shipped JSON grammar compiles over a ladder's vocabulary.
#[test]
fn a_bad_grammar_is_refused_with_llama_cpps_message() {
    use molt::engine::{Grammar, GrammarError, JSON_GRAMMAR, Model};
    molt::engine::backend();
    let rung = &common::tiny_ladder().rungs[0];
    let vocab = Model::load_vocab_only(&rung.path, "vocab").unwrap();
    Grammar::new(std::sync::Arc::clone(&vocab), JSON_GRAMMAR).expect("the JSON grammar compiles");
    match Grammar::new(vocab, "root ::= \"unterminated") {
        Err(GrammarError::Compile { detail }) => {
            assert!(
                detail.contains("pars"),
                "not llama.cpp's parse error: {detail}"
            );
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a broken grammar compiled"),
    }
}
