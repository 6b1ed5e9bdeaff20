//! Conversations that outlive the server: `molt-run serve` (the real binary, a child process)
//! hosts three conversations, hibernating each to its state file when the next takes the
//! engine; it is killed with SIGKILL mid-answer and started again on the same `--state-dir`;
//! each conversation is continued with a question about its first turn, and the tokens it
//! re-read are counted from what the server reports (`usage.prompt_tokens_details`). One
//! resumed from its file re-reads none of what the file holds; one whose file was corrupted
//! while the server was down is refused by name and re-read from its messages; the one that was
//! in the engine when the process died is re-read from its messages. Nothing is lost.
//!
//! Also the faults on a state-file write: `kill -9` mid-write (nothing half-written is taken
//! for a state file after the restart) and a full disk (the conversation stays in RAM).
//!
//! On the tiny ladder always; on the real ladder when it is fetched (`MOLT_REQUIRE_LADDER=1`
//! makes its absence a failure), where each answer must also contain the fact its first turn
//! gave.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use molt::state::StateFile;
use molt_server::client;
use serde_json::{Value, json};

/// With `MOLT_RELIABILITY_RECORD=FILE`, appends this fault's outcome as a JSON line (as
/// `tests/faults.rs` does, for `molt-run bench --reliability`); called only after the test's
/// assertions held.
fn record(site: &str, outcome: &str) {
    use std::io::Write;
    let Some(path) = std::env::var_os("MOLT_RELIABILITY_RECORD") else {
        return;
    };
    let row = json!({"site": site, "outcome": outcome, "lost": false});
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("record file");
    writeln!(f, "{row}").expect("record");
}

/// `MOLT_TEST_PARALLEL=N`: the request loop every server here is started with.
fn forced_parallel() -> Option<u16> {
    std::env::var("MOLT_TEST_PARALLEL")
        .ok()
        .and_then(|v| v.trim().parse::<u16>().ok())
        .map(|n| n.max(1))
}

/// Whether the servers run the batched loop, which writes a conversation's state file as soon
/// as its answer ends (the one-at-a-time loop writes it when another conversation takes the
/// engine). Unset, `serve`'s default loop.
fn batched() -> bool {
    forced_parallel().map_or(DEFAULT_BATCHED, |n| n > 1)
}

/// `serve` without `--parallel`/`--serial` runs the batched loop (`--parallel 4`).
const DEFAULT_BATCHED: bool = true;

/// A `molt-run serve` child.
struct Served {
    child: Child,
    addr: SocketAddr,
    stderr: PathBuf,
}

impl Served {
    fn start(ladder: &Path, state: &Path, log: &Path, fault: Option<&str>, pace_ms: u64) -> Self {
        Self::start_with(ladder, state, log, fault, pace_ms, &[])
    }

    /// [`Served::start`] with more `serve` arguments.
    fn start_with(
        ladder: &Path,
        state: &Path,
        log: &Path,
        fault: Option<&str>,
        pace_ms: u64,
        more: &[&std::ffi::OsStr],
    ) -> Self {
        let stderr = std::fs::File::create(log).unwrap();
        let mut cmd = Command::new(common::molt_run());
        cmd.env_remove("MOLT_FAULT")
            .env_remove("MOLT_LADDER")
            .arg("--ladder")
            .arg(ladder)
            .args([
                "--threads",
                "2",
                "serve",
                "--port",
                "0",
                "--max-tokens",
                "24",
            ])
            .args(["--pace-ms", &pace_ms.to_string()])
            .arg("--state-dir")
            .arg(state)
            .args(more)
            .stdout(Stdio::piped())
            .stderr(stderr);
        if let Some(f) = fault {
            cmd.env("MOLT_FAULT", f);
        }
        // The request loop to test (as the in-process harness does): `MOLT_TEST_PARALLEL=N`.
        if let Some(n) = forced_parallel() {
            cmd.args(["--parallel", &n.to_string()]);
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| {
                    panic!("server exited: {}", std::fs::read_to_string(log).unwrap())
                })
                .unwrap();
            if let Some(a) = line.strip_prefix("molt serve: listening on http://") {
                break a.parse().unwrap();
            }
        };
        Self {
            child,
            addr,
            stderr: log.to_path_buf(),
        }
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        let _ = self.child.wait();
    }

    /// Waits for the process to end on its own (a fault killed it).
    fn wait_killed(mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

fn body(messages: &[Value], max_tokens: usize) -> Value {
    json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0})
}

/// A non-streamed answer: the response.
async fn ask(addr: SocketAddr, messages: &[Value], max_tokens: usize) -> Value {
    let r = client::post_json(addr, "/v1/chat/completions", &body(messages, max_tokens))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let mut v = r.json().unwrap();
    v["header_conversation"] = json!(r.header("x-molt-conversation"));
    v
}

async fn status(addr: SocketAddr) -> Value {
    client::request(addr, "GET", "/v1/molt/status", None)
        .await
        .unwrap()
        .json()
        .unwrap()
}

fn conversation<'a>(status: &'a Value, id: &str) -> Option<&'a Value> {
    status["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens reported")
}

/// The three first turns: a fact each, asked back after the restart.
const FACTS: [(&str, &str, &str); 3] = [
    (
        "My cat is called Wilhelmina. Say hello to her.",
        "What is my cat called?",
        "Wilhelmina",
    ),
    (
        "The staging server listens on port 6143. Acknowledge.",
        "Which port does the staging server listen on?",
        "6143",
    ),
    (
        "Our project codename is Bluefinch. Remember it.",
        "What is our project codename?",
        "Bluefinch",
    ),
];

/// The prompt tokens of `messages` as the server renders them.
fn rendered(ladder: &molt::ladder::Ladder, messages: &[Value]) -> Vec<i32> {
    let small = ladder.rungs.last().unwrap();
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

/// The tokens every one-turn chat begins with (the template's opening).
fn opening(ladder: &molt::ladder::Ladder) -> u64 {
    let one = |text: &str| rendered(ladder, &[json!({"role": "user", "content": text})]);
    let (a, b) = (one("a"), one("b"));
    a.iter().zip(&b).take_while(|(x, y)| x == y).count() as u64
}

fn restart_case(ladder_manifest: &Path, ladder: &molt::ladder::Ladder, real: bool) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        let pace = if real { 0 } else { 40 };
        let s = Served::start(ladder_manifest, &state, &d.path().join("1.log"), None, pace);
        let mut convs: Vec<(String, Vec<Value>)> = Vec::new();
        for (first, _, _) in FACTS {
            let mut msgs = vec![json!({"role": "user", "content": first})];
            let r = ask(s.addr, &msgs, 16).await;
            let id = r["molt"]["conversation"]["id"].as_str().unwrap().to_string();
            assert_eq!(r["molt"]["conversation"]["new"], true);
            assert_eq!(r["header_conversation"], id.as_str());
            msgs.push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
            convs.push((id, msgs));
        }
        // One at a time: the first two were hibernated when the next took the engine, and the
        // third is in it, with no file yet. Batched: all three are still in the context, each
        // with the file written when its answer ended.
        let st = status(s.addr).await;
        for (i, (id, _)) in convs.iter().enumerate() {
            let c = conversation(&st, id).unwrap_or_else(|| panic!("{id} not listed: {st}"));
            let want = if i < 2 && !batched() { "hibernated" } else { "kept" };
            assert_eq!(c["state"], want, "{c}");
            assert!(c["tokens"].as_u64().unwrap() > 0 && c["bytes"].as_u64().unwrap() > 0, "{c}");
        }
        let file_a = state.join(format!("{}.molt-state", convs[0].0));
        let file_b = state.join(format!("{}.molt-state", convs[1].0));
        let file_c = state.join(format!("{}.molt-state", convs[2].0));
        assert!(file_a.exists() && file_b.exists());
        assert_eq!(file_c.exists(), batched(), "{}", file_c.display());

        // The third conversation's next turn, killed with SIGKILL after its first token.
        let mut msgs_c = convs[2].1.clone();
        msgs_c.push(json!({"role": "user", "content": "Tell me a long story about it."}));
        let mut stream = client::stream(s.addr, "/v1/chat/completions", &{
            let mut b = body(&msgs_c, 200);
            b["stream"] = json!(true);
            b
        })
        .await
        .unwrap()
        .unwrap();
        loop {
            let e = stream.next().await.unwrap().expect("a token before the end");
            if e.data.contains("\"token\"") {
                break;
            }
        }
        s.kill();
        drop(stream);

        // While the server is down, B's file is damaged on disk.
        let mut bytes = std::fs::read(&file_b).unwrap();
        let at = bytes.len() - 100;
        bytes[at] ^= 0x55;
        std::fs::write(&file_b, &bytes).unwrap();
        let held = |f: &Path| {
            StateFile::from_bytes(f, &std::fs::read(f).unwrap())
                .unwrap()
                .meta
                .tokens
        };
        let file_a_held = held(&file_a);
        // Its first turn's file, when the loop wrote one before the kill.
        let file_c_held = file_c.exists().then(|| held(&file_c));

        let s = Served::start(ladder_manifest, &state, &d.path().join("2.log"), None, 0);
        let log = s.log();
        assert!(
            log.contains(&file_b.display().to_string()) && log.contains("corrupt"),
            "the refused file is named: {log}"
        );
        assert!(!file_b.exists(), "a refused file is removed");
        let st = status(s.addr).await;
        assert_eq!(conversation(&st, &convs[0].0).unwrap()["state"], "hibernated", "{st}");
        assert!(conversation(&st, &convs[1].0).is_none(), "{st}");
        if batched() {
            assert_eq!(conversation(&st, &convs[2].0).unwrap()["state"], "hibernated", "{st}");
        }

        let mut report = Vec::new();
        for (i, ((id, msgs), (_, question, fact))) in convs.iter().zip(FACTS).enumerate() {
            let mut m = msgs.clone();
            m.push(json!({"role": "user", "content": question}));
            let r = ask(s.addr, &m, 24).await;
            let prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();
            let c = cached(&r);
            let reread = prompt - c;
            let answer = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
            let got = &r["molt"]["conversation"];
            eprintln!(
                "conversation {i}: {} prompt tokens, {c} from cache, {reread} re-read; answer {answer:?}",
                prompt
            );
            report.push(json!({"conversation": i, "prompt_tokens": prompt, "cached": c, "reread": reread}));
            // A resumed from its file; so did C when the loop wrote its file as its first
            // answer ended (batched), else C's cache died with the process.
            let from_file = match i {
                0 => Some(&file_a_held),
                2 => file_c_held.as_ref(),
                _ => None,
            };
            match from_file {
                Some(file_held) => {
                    // Resumed from its file: every token the file holds that the request
                    // shares was taken from it, none re-read.
                    assert_eq!(got["id"], id.as_str(), "continued by its tokens: {r}");
                    assert_eq!(got["new"], false);
                    let req = rendered(ladder, &m);
                    let shared = file_held
                        .iter()
                        .zip(&req)
                        .take_while(|(a, b)| a == b)
                        .count() as u64;
                    assert_eq!(c, shared.min(prompt - 1), "{r}");
                    assert!(c > 0);
                }
                None => {
                    // B's file was refused (and, one at a time, C's cache died with the
                    // process): re-read, all but (batched) the chat template's opening, whose
                    // cells a newcomer shares with another conversation's sequence.
                    let shared = if batched() { opening(ladder) } else { 0 };
                    assert!(c <= shared, "{c} cached, {shared} shareable: {r}");
                    assert_eq!(got["new"], true);
                }
            }
            if real {
                assert!(answer.contains(fact), "conversation {i} lost its fact: {answer:?}");
            }
        }
        eprintln!("restart report: {}", Value::Array(report));
        s.kill();
    });
}

#[test]
fn three_conversations_survive_a_sigkill_mid_answer_on_the_tiny_ladder() {
    let l = common::tiny_ladder();
    restart_case(&common::fixture_dir().join("tiny.toml"), l, false);
}

#[test]
fn three_conversations_survive_a_sigkill_mid_answer_on_the_real_ladder() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen2.5-coder.toml");
    restart_case(&manifest, l, true);
}

/// A conversation hibernated on the ladder's largest rung, the server killed and started
/// again, and the budget then set below that rung: the conversation's next turn wakes from its
/// file on the largest rung that fits, the file's cache carried there through the switch (the
/// rung that wrote it is not loaded), re-reads only the new turn, and (on the real ladder,
/// where that rung is a precision rung of the same weights) still answers with its fact.
fn wake_through_case(
    ladder_manifest: &Path,
    ladder: &molt::ladder::Ladder,
    projectors: Option<&Path>,
    real: bool,
) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        let more: Vec<&std::ffi::OsStr> = match projectors {
            Some(p) => vec!["--projectors".as_ref(), p.as_os_str()],
            None => Vec::new(),
        };
        let start = |log: &str| {
            Served::start_with(ladder_manifest, &state, &d.path().join(log), None, 0, &more)
        };
        let s = start("1.log");
        let (first, question, fact) = FACTS[1];
        let mut msgs = vec![json!({"role": "user", "content": first})];
        let r = ask(s.addr, &msgs, 16).await;
        let id = r["molt"]["conversation"]["id"].as_str().unwrap().to_string();
        msgs.push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
        // A second conversation takes the engine, so the first has its file one at a time too.
        ask(s.addr, &[json!({"role": "user", "content": "Say hi."})], 4).await;
        let file = state.join(format!("{id}.molt-state"));
        assert!(file.exists(), "{}", file.display());
        let held = StateFile::from_bytes(&file, &std::fs::read(&file).unwrap())
            .unwrap()
            .meta;
        let home = ladder.rungs[0].name();
        assert_eq!(held.rung, home);
        s.kill();

        let s = start("2.log");
        // A budget below the home rung's weights that holds the next rung with the
        // conversation and its answer.
        let st = status(s.addr).await;
        let rungs = st["engine"]["rungs"].as_array().unwrap();
        let get = |name: &str, key: &str| {
            rungs.iter().find(|r| r["name"] == name).unwrap()[key]
                .as_f64()
                .unwrap()
        };
        let next = ladder.rungs[1].name();
        // (at the default setup: the loaded rung's cost holds what its speed setup adds)
        assert_eq!(st["engine"]["current_rung"], home, "{st}");
        let extra = st["engine"]["setup_extra_mib"].as_f64().unwrap();
        let cut = get(home, "resident_mib") - extra - 0.1;
        let tokens = (held.tokens.len() + 64) as f64;
        let need = get(next, "resident_mib") + get(next, "kv_bytes_per_token") * tokens / 1048576.0;
        assert!(need + 0.5 < cut, "{rungs:?}");
        let r = client::post_json(s.addr, "/v1/molt/budget", &json!({"mib": cut}))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        msgs.push(json!({"role": "user", "content": question}));
        let r = ask(s.addr, &msgs, 24).await;
        let answer = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(r["molt"]["conversation"]["id"], id.as_str(), "{r}");
        assert_eq!(r["molt"]["conversation"]["new"], false, "{r}");
        let req = rendered(ladder, &msgs);
        let shared = held
            .tokens
            .iter()
            .zip(&req)
            .take_while(|(a, b)| a == b)
            .count() as u64;
        let prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            cached(&r),
            shared.min(prompt - 1),
            "only the new turn re-read: {r}\n{}",
            s.log()
        );
        let st = status(s.addr).await;
        let c = conversation(&st, &id).unwrap();
        assert_eq!(c["rung"], next, "woken on the rung that fits: {c}");
        assert!(
            !st["engine"]["loaded"]
                .as_array()
                .is_some_and(|l| l.iter().any(|n| n == home)),
            "{st}"
        );
        eprintln!(
            "woken through the switch {home} -> {next}: {prompt} prompt tokens, {} from the file; answer {answer:?}",
            cached(&r)
        );
        if real {
            assert!(answer.contains(fact), "the fact lost through the switch: {answer:?}");
        }
        s.kill();
    });
}

#[test]
fn a_file_woken_under_a_smaller_budget_comes_through_the_switch_on_the_tiny_ladder() {
    let l = common::tiny_ladder();
    let projectors = common::tiny_projectors();
    wake_through_case(
        &common::fixture_dir().join("tiny.toml"),
        l,
        Some(projectors),
        false,
    );
}

#[test]
fn a_file_woken_under_a_smaller_budget_comes_through_the_switch_on_the_real_ladder() {
    let Some(l) = common::real_ladder() else {
        return;
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen2.5-coder.toml");
    wake_through_case(&manifest, l, None, true);
}

#[test]
fn an_explicit_unknown_id_starts_a_new_conversation_and_says_so() {
    let _ = common::tiny_ladder();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = tempfile::tempdir().unwrap();
        let s = Served::start(
            &common::fixture_dir().join("tiny.toml"),
            &d.path().join("state"),
            &d.path().join("1.log"),
            None,
            0,
        );
        let mut b = body(&[json!({"role": "user", "content": "Hello"})], 4);
        b["molt"] = json!({"conversation": "never-seen", "class": "background", "priority": 3});
        let r = client::post_json(s.addr, "/v1/chat/completions", &b)
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-molt-conversation"), Some("never-seen"));
        assert_eq!(r.header("x-molt-conversation-new"), Some("true"));
        let v = r.json().unwrap();
        let note = v["molt"]["conversation"]["note"].as_str().unwrap();
        assert!(
            note.contains("unknown conversation \"never-seen\""),
            "{note}"
        );
        let st = status(s.addr).await;
        let c = conversation(&st, "never-seen").unwrap();
        assert_eq!(c["class"], "background");
        assert_eq!(c["priority"], 3);
        // Named again, it is the same conversation.
        let r = client::post_json(s.addr, "/v1/chat/completions", &b)
            .await
            .unwrap();
        assert_eq!(r.header("x-molt-conversation-new"), Some("false"));
        s.kill();
    });
}

#[test]
fn a_state_directory_that_cannot_be_written_is_a_startup_error_naming_it() {
    let _ = common::tiny_ladder();
    let d = tempfile::tempdir().unwrap();
    let plain = d.path().join("a-file");
    std::fs::write(&plain, b"").unwrap();
    let out = Command::new(common::molt_run())
        .env_remove("MOLT_FAULT")
        .arg("--ladder")
        .arg(common::fixture_dir().join("tiny.toml"))
        .args(["serve", "--port", "0", "--state-dir"])
        .arg(plain.join("state"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a-file/state") && err.contains("not writable"),
        "{err}"
    );
}

/// `--strategy never` is the one-request-at-a-time baseline: the batched loop (the default)
/// always changes rung under pressure, so it refuses to start with it and says how to run it.
#[test]
fn the_never_strategy_in_the_batched_loop_is_a_startup_error_saying_serial() {
    let _ = common::tiny_ladder();
    let d = tempfile::tempdir().unwrap();
    let serve = |extra: &[&str]| {
        let mut c = Command::new(common::molt_run());
        c.env_remove("MOLT_FAULT")
            .arg("--ladder")
            .arg(common::fixture_dir().join("tiny.toml"))
            .args(["serve", "--port", "0", "--strategy", "never", "--state-dir"])
            .arg(d.path().join("state"))
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c
    };
    let out = serve(&[]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--strategy never") && err.contains("--serial"),
        "{err}"
    );
    // With --serial it starts: it says where it listens.
    let mut child = serve(&["--serial"]).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    child.kill().unwrap();
    let _ = child.wait();
    assert!(
        line.starts_with("molt serve: listening on http://"),
        "{line}"
    );
}

/// A non-streamed answer, or why there was none (the server died).
async fn try_ask(addr: SocketAddr, messages: &[Value], max_tokens: usize) -> Result<Value, String> {
    match client::post_json(addr, "/v1/chat/completions", &body(messages, max_tokens)).await {
        Ok(r) if r.status == 200 => Ok(r.json().unwrap()),
        Ok(r) => Err(format!("status {}", r.status)),
        Err(e) => Err(e.to_string()),
    }
}

/// Two first turns, the second displacing the first: the first state file is written where a
/// state-file fault strikes — as the first answer ends (batched), or when the second takes
/// the engine (one at a time). Returns the first conversation so far and the second answer
/// (an error when the server died before either answer ended).
async fn two_conversations(addr: SocketAddr) -> (Vec<Value>, Result<Value, String>) {
    let a = vec![json!({"role": "user", "content": FACTS[0].0})];
    let first = try_ask(addr, &a, 8).await;
    let mut a2 = a.clone();
    let said = first.as_ref().map_or_else(
        |_| json!("Hello, Wilhelmina."),
        |r| r["choices"][0]["message"]["content"].clone(),
    );
    a2.push(json!({"role": "assistant", "content": said}));
    if let Err(e) = first {
        assert!(
            batched(),
            "one at a time, the first answer writes no file: {e}"
        );
        return (a2, Err(format!("first answer: {e}")));
    }
    let b = vec![json!({"role": "user", "content": FACTS[1].0})];
    (a2, try_ask(addr, &b, 8).await)
}

#[test]
fn kill_during_a_state_file_write_leaves_nothing_taken_for_valid() {
    let _ = common::tiny_ladder();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        let ladder = common::fixture_dir().join("tiny.toml");
        let s = Served::start(
            &ladder,
            &state,
            &d.path().join("1.log"),
            Some("state_write:1"),
            0,
        );
        let (mut a, second) = two_conversations(s.addr).await;
        assert!(second.is_err(), "the process died mid-write: {second:?}");
        let code = s.wait_killed();
        assert!(
            std::os::unix::process::ExitStatusExt::signal(&code) == Some(9),
            "{code:?}"
        );
        let names: Vec<String> = std::fs::read_dir(&state)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names
                .iter()
                .any(|n| n.contains(".molt-state.") && n.ends_with(".partial")),
            "the half-written temporary is there: {names:?}"
        );
        assert!(
            !names.iter().any(|n| n.ends_with(".molt-state")),
            "{names:?}"
        );
        // Restarted: the temporary is cleared away and the conversation is re-read whole.
        let s = Served::start(&ladder, &state, &d.path().join("2.log"), None, 0);
        assert_eq!(std::fs::read_dir(&state).unwrap().count(), 0);
        a.push(json!({"role": "user", "content": FACTS[0].1}));
        let r = ask(s.addr, &a, 4).await;
        assert_eq!(cached(&r), 0);
        assert_eq!(r["molt"]["conversation"]["new"], true);
        s.kill();
        record(
            "state_write (kill -9 while a conversation's state file is written)",
            "process killed with the file half written before its rename; the restart removed the temporary, no state file was taken from it, and the conversation was re-read from its messages",
        );
    });
}

#[test]
fn a_full_disk_keeps_the_conversation_in_ram_and_says_why() {
    let _ = common::tiny_ladder();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        let ladder = common::fixture_dir().join("tiny.toml");
        let s = Served::start(
            &ladder,
            &state,
            &d.path().join("1.log"),
            Some("state_disk_full:1"),
            0,
        );
        let (mut a, second) = two_conversations(s.addr).await;
        second.unwrap();
        let log = s.log();
        assert!(
            log.contains("disk is full") && log.contains("stays in RAM"),
            "{log}"
        );
        let st = status(s.addr).await;
        let kept: Vec<_> = st["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["state"] == "kept")
            .collect();
        assert_eq!(kept.len(), 2, "the displaced one is kept in RAM: {st}");
        // Continued, it resumes from RAM: its first turn is not read again.
        a.push(json!({"role": "user", "content": FACTS[0].1}));
        let r = ask(s.addr, &a, 4).await;
        assert!(cached(&r) > 0, "{r}");
        assert_eq!(r["molt"]["conversation"]["new"], false);
        s.kill();
        record(
            "state_disk_full (ENOSPC while hibernating a conversation)",
            "the conversation stayed in RAM (parked) with a log line saying the disk is full, and its next turn resumed from RAM",
        );
    });
}

/// A running answer the batched loop would set aside (no rung holds it beside a foreground
/// answer) whose file cannot be written — a full disk — is put back into its sequence: its
/// cache in memory, in the source's layout, would free less than the plan counted on. A log
/// line says why, and the batch is fitted as a whole: it parks, and when memory returns both
/// answers resume and run to their ends. Nothing lost.
#[test]
fn a_set_aside_that_cannot_be_written_parks_the_batch_and_says_why() {
    if forced_parallel() == Some(1) || (forced_parallel().is_none() && !DEFAULT_BATCHED) {
        return; // the one-at-a-time loop runs one answer: nothing to set aside
    }
    let _ = common::tiny_ladder();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = tempfile::tempdir().unwrap();
        let ladder = common::fixture_dir().join("tiny.toml");
        let s = Served::start(
            &ladder,
            &d.path().join("state"),
            &d.path().join("1.log"),
            Some("state_disk_full:1"),
            20,
        );
        let st = status(s.addr).await;
        let small = st["engine"]["rungs"].as_array().unwrap().last().unwrap().clone();
        // The smallest rung with ~100 cells: the short foreground answer fits, the long
        // background one's cache beside it does not.
        let cut = small["resident_mib"].as_f64().unwrap()
            + small["kv_bytes_per_token"].as_f64().unwrap() * 100.0 / 1_048_576.0;
        let long = ["the scheduler parks the weights of a background job"; 24].join("; ");
        let stream = |content: &str, max_tokens: usize, background: bool| {
            let mut b = json!({
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": true,
            });
            if background {
                b["molt"] = json!({"class": "background"});
            }
            b
        };
        let open = |b: Value| async move {
            client::stream(s.addr, "/v1/chat/completions", &b)
                .await
                .unwrap()
                .ok()
                .unwrap()
        };
        let kind = |v: &Value| v["molt"]["event"].as_str().unwrap_or("").to_string();
        let mut bg = open(stream(&long, 200, true)).await;
        let mut bg_events: Vec<Value> = Vec::new();
        while bg_events.iter().filter(|v| kind(v) == "token").count() < 4 {
            bg_events.push(bg.next().await.unwrap().unwrap().json().unwrap());
        }
        let mut fg = open(stream("which port does the staging server use", 16, false)).await;
        let mut fg_events: Vec<Value> = Vec::new();
        while !fg_events.iter().any(|v| kind(v) == "token") {
            let ev = fg.next().await.unwrap().expect("the foreground answer ended early");
            fg_events.push(ev.json().unwrap_or(Value::Null));
        }
        let r = client::post_json(s.addr, "/v1/molt/budget", &json!({"mib": cut}))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        while !fg_events.iter().any(|v| kind(v) == "stall") {
            let ev = fg.next().await.unwrap().expect("the foreground answer ended unparked");
            fg_events.push(ev.json().unwrap_or(Value::Null));
        }
        let log = s.log();
        assert!(
            log.contains("could not be set aside") && log.contains("the disk is full"),
            "{log}"
        );
        let r = client::post_json(s.addr, "/v1/molt/budget", &json!({"unlimited": true}))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        while let Some(ev) = fg.next().await.unwrap() {
            fg_events.push(ev.json().unwrap_or(Value::Null));
        }
        while let Some(ev) = bg.next().await.unwrap() {
            bg_events.push(ev.json().unwrap_or(Value::Null));
        }
        for (name, events) in [("background", &bg_events), ("foreground", &fg_events)] {
            let stall = events.iter().find(|v| kind(v) == "stall").unwrap();
            let reason = stall["molt"]["reason"].as_str().unwrap();
            assert!(reason.contains("below every rung"), "{name}: {reason}");
            let finish = events
                .iter()
                .rev()
                .find_map(|v| v["choices"][0]["finish_reason"].as_str())
                .unwrap();
            assert!(matches!(finish, "length" | "stop"), "{name}: {finish}");
        }
        s.kill();
        record(
            "state_disk_full (ENOSPC while setting a running answer aside)",
            "the answer was put back into its sequence with a log line saying why, the batch parked as a whole, and both answers resumed and ran to their ends",
        );
    });
}
