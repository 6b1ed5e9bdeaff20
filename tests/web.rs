//! The web page at `/`, in a real browser: headless Chromium, driven over the DevTools protocol,
//! loads the page from the service on the tiny ladder, types the API key, replays a budget trace
//! that cuts below the big rungs mid-answer, and asks a question through the page's own form —
//! then the DOM must hold tokens of two rungs, coloured apart, and a switch marker with its cost
//! between them. A second test stops an answer that waits for memory (the server counts the
//! hang-up), checks that a refused request's message reaches the user, and that the page says
//! so when the server goes away.
//!
//! Runs when Chromium is installed (`chromium`, `chromium-browser`, `google-chrome`, or
//! `$MOLT_CHROMIUM`); otherwise says "skipped" and passes, like the OpenAI client tests.
//!
//! The screenshot in the README comes from the ignored test at the end, run against a real
//! ladder: see its doc.

mod common;
#[path = "common/server.rs"]
mod harness;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::{SinkExt, StreamExt};
use molt_server::client;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

const KEY: &str = "sk-web-test";

/// How long one wait for the page may take before the test gives up: a guard against a hang,
/// not a measurement (the tiny rungs answer in well under a second).
const PATIENCE: Duration = Duration::from_secs(90);

/// The Chromium binary, if one is installed.
fn chromium() -> Option<String> {
    let candidates = std::env::var("MOLT_CHROMIUM").map_or_else(
        |_| {
            ["chromium", "chromium-browser", "google-chrome"]
                .map(String::from)
                .to_vec()
        },
        |c| vec![c],
    );
    candidates.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Headless Chromium with one page, spoken to over the DevTools protocol.
struct Browser {
    child: Child,
    ws: Socket,
    session: String,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    /// Starts Chromium on a fresh profile and attaches to a new blank page.
    async fn launch(binary: &str) -> Self {
        Self::launch_with(binary, &[]).await
    }

    /// [`Browser::launch`] with further command-line switches.
    async fn launch_with(binary: &str, extra: &[&str]) -> Self {
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(binary)
            .args([
                "--headless",
                // Tests run as root in CI's containers, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
                "--window-size=1280,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(extra)
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium starts");
        // Chromium prints the browser's websocket address on stderr; the rest of stderr is
        // drained on the same thread so a full pipe never blocks the browser.
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("DevTools listening on ")
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let url = tokio::task::spawn_blocking(move || rx.recv_timeout(PATIENCE))
            .await
            .unwrap()
            .expect("chromium prints its DevTools address");
        let (ws, _) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .expect("the DevTools socket opens");
        let mut b = Self {
            child,
            ws,
            session: String::new(),
            next_id: 0,
            _profile: profile,
        };
        let target = b
            .call("Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let attached = b
            .call(
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await;
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        b
    }

    /// One DevTools command (on the page once attached); its result.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.try_call(method, params)
            .await
            .unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    /// One DevTools command; its result, or the protocol's error.
    async fn try_call(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        self.ws.send(Message::text(msg.to_string())).await.unwrap();
        loop {
            let m = tokio::time::timeout(PATIENCE, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("chromium did not answer {method}"))
                .expect("the DevTools socket stays open")
                .unwrap();
            let Message::Text(text) = m else { continue };
            let v: Value = serde_json::from_str(text.as_str()).unwrap();
            if v["id"] == id {
                return match v.get("error") {
                    Some(e) => Err(e.clone()),
                    None => Ok(v["result"].clone()),
                };
            }
        }
    }

    /// Evaluates a JavaScript expression in the page (awaiting a promise); its value as JSON.
    async fn eval(&mut self, expression: &str) -> Value {
        self.try_eval(expression)
            .await
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    /// As [`Browser::eval`], with a thrown exception or a protocol error (an evaluation that
    /// meets a navigation) returned rather than fatal.
    async fn try_eval(&mut self, expression: &str) -> Result<Value, Value> {
        let r = self
            .try_call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await?;
        match r.get("exceptionDetails") {
            Some(e) => Err(e.clone()),
            None => Ok(r["result"]["value"].clone()),
        }
    }

    /// Waits until `expression` is truthy in the page; its value. An evaluation that fails
    /// (the page is still being replaced) counts as not yet.
    async fn wait_for(&mut self, expression: &str, what: &str) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let v = self.try_eval(expression).await.unwrap_or(Value::Null);
            let truthy =
                !matches!(&v, Value::Null | Value::Bool(false)) && v != json!("") && v != json!(0);
            if truthy {
                return v;
            }
            if Instant::now() > deadline {
                let page = self
                    .try_eval("document.querySelector('main').innerText + '\\n' + document.getElementById('error').innerText")
                    .await;
                panic!("waited in vain for {what} ({expression}); the page shows:\n{page:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn open(&mut self, url: &str) {
        self.navigate(url).await;
        self.wait_for(
            "document.readyState === 'complete' && document.getElementById('legend') !== null",
            "the page to load",
        )
        .await;
    }

    /// Goes to `url` (any page) and waits for it to finish loading.
    async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
        self.wait_for(
            &format!(
                "document.readyState === 'complete' && location.href.startsWith({})",
                json!(url)
            ),
            "a page to load",
        )
        .await;
    }

    /// Types `value` into the field with this id, as a user would leave it.
    async fn fill(&mut self, id: &str, value: &str) {
        self.eval(&format!(
            "(() => {{ const e = document.getElementById({}); e.value = {}; \
             e.dispatchEvent(new Event('input', {{bubbles: true}})); return true; }})()",
            json!(id),
            json!(value)
        ))
        .await;
    }

    /// Clicks the element `selector` names.
    async fn click(&mut self, selector: &str) {
        self.eval(&format!(
            "(() => {{ document.querySelector({}).click(); return true; }})()",
            json!(selector)
        ))
        .await;
    }

    /// A PNG of the whole page at 1280 px wide.
    async fn screenshot(&mut self, path: &Path) {
        let height = self
            .eval("document.documentElement.scrollHeight")
            .await
            .as_u64()
            .unwrap_or(1000);
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        )
        .await;
        let shot = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, png).unwrap();
    }
}

/// The page's view of the last answer: its state, the rung of each token in order with the
/// switch markers in place (`"|from>to|cost"`), and its closing line.
const LAST_ANSWER: &str = r#"(() => {
  const li = [...document.querySelectorAll('#log li.assistant')].pop();
  const parts = [...li.querySelector('.answer').children].map((e) =>
    e.classList.contains('switch')
      ? '|' + e.dataset.from + '>' + e.dataset.to + '|' + e.dataset.costMs + '|' + e.textContent
      : e.classList.contains('tok') ? e.dataset.rung : null).filter((x) => x !== null);
  return { state: li.dataset.state, parts, meta: li.querySelector('.meta').textContent };
})()"#;

async fn send(b: &mut Browser, prompt: &str, max_tokens: usize) {
    b.fill("max-tokens", &max_tokens.to_string()).await;
    b.fill("prompt", prompt).await;
    b.click("#send").await;
}

/// The key typed into the page's key form.
async fn use_key(b: &mut Browser, key: &str) {
    b.fill("key", key).await;
    b.click("#key-form button[type=submit]").await;
}

/// A budget in MiB that holds the small rung with a full context but neither big rung, from
/// the costs the status reports (the same rule as `tests/server.rs`).
async fn small_only_budget(b: &mut Browser) -> f64 {
    let rungs = b
        .eval(&format!(
            "fetch('/v1/molt/status', {{headers: {{Authorization: 'Bearer {KEY}'}}}}).then((r) => r.json()).then((s) => s.engine.rungs)"
        ))
        .await;
    let get = |name: &str, key: &str| {
        rungs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()[key]
            .as_f64()
            .unwrap()
    };
    let cut = get("big-q8", "resident_mib").min(get("big", "resident_mib")) - 0.1;
    assert!(
        get("small", "full_context_mib") + 0.5 < cut,
        "tiny rungs too close: {rungs}"
    );
    cut
}

/// The page loads without the key while the API keeps asking for it, says so on a 401, and —
/// once the key is typed — streams an answer through a replayed budget cut: tokens of `big`
/// then of `small`, coloured apart, with one switch marker carrying its cost between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_through_a_budget_cut_shows_two_rungs_and_a_switch() {
    let Some(binary) = chromium() else {
        eprintln!("skipped: no chromium (apt-get install chromium, or set MOLT_CHROMIUM)");
        return;
    };
    let _serial = harness::serial().await;
    let traces = tempfile::tempdir().unwrap();
    let dirs = vec![traces.path().to_path_buf()];
    let srv = harness::start(|c| {
        c.trace_dirs = dirs;
        c.api_key = Some(molt_server::ApiKey::new(KEY).unwrap());
    })
    .await;
    let addr = srv.addr;

    // The page and its files load without the key; the API does not.
    for (path, kind) in [
        ("/", "text/html"),
        ("/app.js", "text/javascript"),
        ("/style.css", "text/css"),
    ] {
        let r = client::request(addr, "GET", path, None).await.unwrap();
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.header("content-type").unwrap().starts_with(kind),
            "{path}"
        );
        assert!(
            r.header("content-security-policy")
                .unwrap()
                .contains("default-src 'none'"),
            "{path}"
        );
    }
    let r = client::request(addr, "GET", "/v1/molt/status", None)
        .await
        .unwrap();
    assert_eq!(r.status, 401);

    let mut b = Browser::launch(&binary).await;
    b.open(&format!("http://{addr}/")).await;
    let shown = b
        .wait_for(
            "!document.getElementById('error').hidden && document.getElementById('error').textContent",
            "the 401 to be shown",
        )
        .await;
    let shown = shown.as_str().unwrap();
    assert!(
        shown.contains("API key") && shown.contains("401"),
        "{shown}"
    );

    use_key(&mut b, KEY).await;
    b.wait_for(
        "document.getElementById('conn').textContent.startsWith('connected') && document.getElementById('error').hidden",
        "the status to load with the key",
    )
    .await;
    let legend = b
        .eval("[...document.querySelectorAll('#legend li .tok')].map((e) => e.textContent)")
        .await;
    assert_eq!(legend, json!(["big", "big-q8", "small"]));

    // A trace on the token clock: the cut lands before token 8 of every answer, however fast
    // the rungs decode.
    let cut = small_only_budget(&mut b).await;
    std::fs::write(
        traces.path().join("cut_mid_answer.json"),
        json!({"name": "cut_mid_answer", "clock": "token", "initial": 100_000,
               "events": [{"at": 8, "budget": cut}]})
        .to_string(),
    )
    .unwrap();
    b.fill("trace", "cut_mid_answer").await;
    b.click("#replay button[type=submit]").await;
    b.wait_for(
        "document.getElementById('budget-now').textContent.startsWith('trace')",
        "the trace to be set",
    )
    .await;

    send(
        &mut b,
        "the scheduler parks the weights of a background job",
        24,
    )
    .await;
    b.wait_for(
        "[...document.querySelectorAll('#log li.assistant')].pop().dataset.state !== 'streaming'",
        "the answer to end",
    )
    .await;
    let answer = b.eval(LAST_ANSWER).await;
    assert_eq!(answer["state"], "done", "{answer}");
    let parts: Vec<&str> = answer["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    let switches: Vec<usize> = (0..parts.len())
        .filter(|&i| parts[i].starts_with('|'))
        .collect();
    assert_eq!(switches.len(), 1, "one switch marker: {parts:?}");
    let at = switches[0];
    let marker: Vec<&str> = parts[at].split('|').collect();
    assert_eq!(marker[1], "big>small", "{parts:?}");
    let cost: f64 = marker[2].parse().unwrap();
    assert!(cost > 0.0, "{parts:?}");
    assert!(
        marker[3].contains("big → small") && marker[3].ends_with(" ms"),
        "the marker shows its cost: {}",
        marker[3]
    );
    assert!(
        at > 0 && parts[..at].iter().all(|r| *r == "big"),
        "{parts:?}"
    );
    assert!(
        at + 1 < parts.len() && parts[at + 1..].iter().all(|r| *r == "small"),
        "{parts:?}"
    );
    let meta = answer["meta"].as_str().unwrap();
    assert!(
        meta.contains("big → small") && meta.contains("1 switch"),
        "{meta}"
    );

    // The two rungs look different: their tokens' backgrounds and underline styles differ.
    let looks = b
        .eval(
            "['big', 'small'].map((r) => { const s = getComputedStyle(document.querySelector(`#log .tok[data-rung='${r}']`)); return s.backgroundColor + ' ' + s.borderBottomStyle; })",
        )
        .await;
    assert_ne!(looks[0], looks[1], "{looks}");
    // The chart draws the budget the answer reported and the resident set.
    b.wait_for(
        "document.querySelector('#chart path.budget') !== null && document.querySelector('#chart path.rss') !== null",
        "the chart's lines",
    )
    .await;
    b.screenshot(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("web-tiny.png"))
        .await;
    drop(b);
    srv.shutdown().await;
}

/// Stop hangs up on an answer that is waiting for memory (the server counts it as cancelled and
/// the page shows it stopped), a request the server refuses shows the server's message, and a
/// server that goes away is reported while the page keeps trying to reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_refusals_and_a_vanished_server_reach_the_user() {
    let Some(binary) = chromium() else {
        eprintln!("skipped: no chromium (apt-get install chromium, or set MOLT_CHROMIUM)");
        return;
    };
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let mut b = Browser::launch(&binary).await;
    b.open(&format!("http://{addr}/")).await;
    b.wait_for(
        "document.getElementById('conn').textContent.startsWith('connected')",
        "the status",
    )
    .await;

    // A 400: the server's words reach the user.
    b.fill("trace", "no_such_trace").await;
    b.click("#replay button[type=submit]").await;
    let shown = b
        .wait_for(
            "!document.getElementById('error').hidden && document.getElementById('error').textContent",
            "the 400 to be shown",
        )
        .await;
    let shown = shown.as_str().unwrap();
    assert!(
        shown.contains("(400)") && shown.contains("no_such_trace.json"),
        "{shown}"
    );

    // A budget nothing fits in: the answer waits for memory, streaming only that news, until
    // the user stops it.
    b.fill("cut-mib", "1").await;
    b.click("#cut button[type=submit]").await;
    b.wait_for(
        "document.getElementById('budget-now').textContent.startsWith('fixed')",
        "the cut",
    )
    .await;
    send(
        &mut b,
        "the scheduler parks the weights of a background job",
        24,
    )
    .await;
    b.wait_for(
        "[...document.querySelectorAll('#log li.assistant')].pop().querySelector('.meta').textContent.startsWith('waiting for memory')",
        "the answer to wait for memory",
    )
    .await;
    b.click("#stop").await;
    b.wait_for(
        "[...document.querySelectorAll('#log li.assistant')].pop().dataset.state !== 'streaming'",
        "the answer to stop",
    )
    .await;
    let answer = b.eval(LAST_ANSWER).await;
    assert_eq!(answer["state"], "stopped", "{answer}");
    assert!(
        answer["meta"]
            .as_str()
            .unwrap()
            .starts_with("stopped by you"),
        "{answer}"
    );
    // The server noticed the hang-up: the page's status line counts it.
    b.wait_for(
        "document.getElementById('stats').textContent.includes('stopped 1,')",
        "the server to count the stopped answer",
    )
    .await;
    // Stopped before a word, the question is taken back: the next one starts afresh.
    b.click("#unlimited").await;
    b.wait_for(
        "document.getElementById('budget-now').textContent.startsWith('unlimited')",
        "no limit",
    )
    .await;
    send(
        &mut b,
        "the scheduler parks the weights of a background job",
        4,
    )
    .await;
    b.wait_for(
        "[...document.querySelectorAll('#log li.assistant')].pop().dataset.state === 'done'",
        "the next answer",
    )
    .await;
    // The server goes away: the status poll says so and keeps trying.
    srv.shutdown().await;
    b.wait_for(
        "document.getElementById('conn').classList.contains('down') && document.getElementById('conn').textContent.includes('trying again')",
        "the page to notice the server has gone",
    )
    .await;
}

/// The README's screenshot, from a real ladder: start `molt-run serve --threads 1` (see the
/// README's web page section), then
/// `MOLT_WEB_URL=http://127.0.0.1:8088 cargo test --release --test web -- --ignored`.
/// It replays `traces/spike_mid_answer.json` (tier0 → q3km at token 32, → tier1 at 64, → tier2
/// at 96), asks a question through the page and writes `results/figures/web.png` once the
/// answer has ended.
/// A web server for one page on another origin (another port of 127.0.0.1): every request gets
/// `html`. Runs until the test's runtime ends.
async fn serve_page(html: String) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let html = html.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    html.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(html.as_bytes()).await;
            });
        }
    });
    addr
}

/// Issue 49, hole 1, in a real browser: a page of another origin (here another port of
/// 127.0.0.1, so no browser rule about private networks is what stops it) posts a budget to
/// the open server as `text/plain` — a request a browser sends without asking first — and a
/// JSON one; neither changes the budget. A name that resolves to the server (DNS rebinding,
/// here Chromium's host-resolver rule) gets a 403 instead of the page, while the page served
/// under the server's own address keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_49_a_page_of_another_origin_cannot_drive_the_server() {
    let Some(binary) = chromium() else {
        eprintln!("skipped: no chromium (apt-get install chromium, or set MOLT_CHROMIUM)");
        return;
    };
    let _serial = harness::serial().await;
    let srv = harness::start(|_| {}).await;
    let addr = srv.addr;
    let target = format!("http://{addr}/v1/molt/budget");
    let attacker = serve_page(format!(
        r#"<!doctype html><title>elsewhere</title><script>
const post = (type) => fetch({target}, {{method: "POST", mode: "no-cors",
  headers: {{"Content-Type": type}}, body: '{{"mib": 1}}'}}).then(() => "sent", (e) => "failed: " + e);
Promise.all([post("text/plain"), post("application/json")]).then((r) => {{ document.title = "done " + r.join(", "); }});
</script>"#,
        target = json!(target),
    ))
    .await;
    let rule = "--host-resolver-rules=MAP rebound.test 127.0.0.1";
    let mut b = Browser::launch_with(&binary, &[rule]).await;
    b.navigate(&format!("http://{attacker}/")).await;
    let done = b
        .wait_for(
            "document.title.startsWith('done') && document.title",
            "the other origin's requests",
        )
        .await;
    let st = client::request(addr, "GET", "/v1/molt/status", None)
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        st["budget"]["mode"], "unlimited",
        "a page of another origin changed the budget ({done}): {}",
        st["budget"]
    );

    // DNS rebinding: the browser takes rebound.test for the server's address.
    let rebound = format!("http://rebound.test:{}/", addr.port());
    b.navigate(&rebound).await;
    let body = b.eval("document.body.innerText").await;
    let body = body.as_str().unwrap_or_default();
    assert!(
        body.contains("host_not_allowed") && !body.contains("Molt"),
        "a rebound name must not reach the page: {body}"
    );
    // The same browser, on the server's own address, gets the page, which works.
    b.open(&format!("http://{addr}/")).await;
    b.wait_for(
        "document.getElementById('conn').textContent.startsWith('connected')",
        "the status",
    )
    .await;
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a running server on a real ladder (MOLT_WEB_URL)"]
async fn screenshot_of_a_real_answer() {
    let Ok(url) = std::env::var("MOLT_WEB_URL") else {
        eprintln!("skipped: set MOLT_WEB_URL to a running molt-run serve");
        return;
    };
    let binary = chromium().expect("chromium");
    let mut b = Browser::launch(&binary).await;
    b.open(&url).await;
    if let Ok(key) = std::env::var("MOLT_WEB_KEY") {
        use_key(&mut b, &key).await;
    }
    b.wait_for(
        "document.getElementById('conn').textContent.startsWith('connected')",
        "the status",
    )
    .await;
    b.fill("trace", "spike_mid_answer").await;
    b.click("#replay button[type=submit]").await;
    b.wait_for(
        "document.getElementById('budget-now').textContent.startsWith('trace')",
        "the trace to be set",
    )
    .await;
    let prompt = std::env::var("MOLT_WEB_PROMPT").unwrap_or_else(|_| {
        "Explain in a few short paragraphs how a memory budget can make a program change the model it runs on.".into()
    });
    send(&mut b, &prompt, 140).await;
    let deadline = Instant::now() + Duration::from_secs(1200);
    loop {
        let state = b
            .eval("[...document.querySelectorAll('#log li.assistant')].pop().dataset.state")
            .await;
        if state != "streaming" {
            assert_eq!(state, "done");
            break;
        }
        assert!(Instant::now() < deadline, "the answer did not end");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Two more status polls, so the chart reaches past the answer's end.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/figures/web.png");
    b.screenshot(&out).await;
    eprintln!("wrote {}", out.display());
}
