//! A foreground answer beside a background one when memory falls below what holds them both,
//! through the real `molt-run serve` (the batched loop, two sequences): what the foreground
//! user waits, what becomes of the background answer, and whether the process stays within
//! the budget — with answers set aside (the default) and with the whole batch parked (the
//! behaviour before, `serve --no-set-aside`), each arm on a server of its own.
//!
//! An arm: the floor (the idle server's resident set with no rung loaded, as `serve_qos`
//! measures it); each answer alone, unpressured (its text, and the foreground prompt's
//! length); then the background answer starts, the foreground one joins, and once both are
//! streaming the budget falls to what holds the smallest rung with the foreground answer
//! whole and a few cells to spare — not with the background answer's cache beside it. The
//! budget stays there `low_ms`, then memory returns. Every stream is read event by event with
//! its arrival time, and the server's resident set is sampled every 100 ms.
//!
//! What the user feels, per arm: the foreground answer's longest wait between two tokens after
//! the cut, and whether it ended before memory returned; the background answer's pause, and
//! whether its text is the one it gives alone (a set-aside answer resumes from its file on
//! the rung it left). Beside them: the largest measured overshoot (resident set above the
//! floor, against the budget) once the cut has settled.
//!
//! A second scene on the same server, memory ample: two background answers fill both
//! sequences, then a foreground request comes. Set aside, the later background answer yields
//! its sequence (its cache to its file) and resumes when one frees; parked whole (the old
//! behaviour), the request waits for a background answer to end. Measured: the foreground
//! request's time to its first token, and whether the background answers end as alone.
//!
//! A third scene, on servers of their own: the background answer set aside on the largest
//! rung as in the first, the foreground one ended, then a budget that holds the smallest rung
//! with the background answer whole and no larger rung — it resumes there, its history re-read
//! (the default), or its cache carried through the switch (`serve --carry-on-resume`).
//! Measured: its wait once memory allowed, and the facts of its notes its answer states,
//! beside the same request alone on the largest rung and alone on the smallest.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::serve_qos::{ServeQosError, floor_rss, get_status, post_budget, signed, spawn_server};
use molt_server::client;

/// Options of the run.
#[derive(Debug, Clone)]
pub struct ServeAsideOptions {
    /// The `molt-run` binary.
    pub program: PathBuf,
    /// Global options placed before `serve` (ladder, models, threads, context).
    pub global_args: Vec<String>,
    /// Where each arm's server keeps its state files, record and log.
    pub work_dir: PathBuf,
    /// The foreground user's message.
    pub foreground: String,
    /// The background job's message (long: its cache is what does not fit).
    pub background: String,
    /// Strings a faithful answer to the background message states (its facts), matched
    /// case-insensitively.
    pub facts: Vec<String>,
    /// `max_tokens` of the foreground answer.
    pub fg_max_tokens: usize,
    /// `max_tokens` of the background answer.
    pub bg_max_tokens: usize,
    /// How long the budget stays low, ms.
    pub low_ms: u64,
    /// Time after the cut the process is given to act on it before overshoot counts, ms.
    pub settle_ms: u64,
}

/// The facts of [`standard_messages`]' background notes, as a faithful summary states them.
#[must_use]
pub fn standard_facts() -> Vec<String> {
    [
        "zstd",
        "45 days",
        "14 days",
        "cold-ledger-eu",
        "Frankfurt",
        "Marguerite Abadie",
        "Tobias Lindqvist",
        "02:30",
        "eleven minutes",
        "five times",
        "2 seconds",
        "4.0",
    ]
    .map(String::from)
    .to_vec()
}

/// The shipped messages: a coding question in the foreground, a long report to summarise in
/// the background.
#[must_use]
pub fn standard_messages() -> (String, String) {
    let fg = "Write a Python function that returns the n-th Fibonacci number, iteratively, with a docstring.".to_string();
    let bg = [
        "Here are the release notes of the archive service, version 4.2.",
        "The nightly job now compresses logs with zstd at level 9, which cut storage by a third.",
        "The retention window is 45 days for audit logs and 14 days for debug logs.",
        "The archive bucket is called cold-ledger-eu and lives in the Frankfurt region.",
        "The on-call owner for the archive is Marguerite Abadie; her backup is Tobias Lindqvist.",
        "Rotation happens at 02:30 UTC and takes about eleven minutes on a normal night.",
        "Failed uploads are retried five times with exponential backoff starting at 2 seconds.",
        "A checksum mismatch now pages the on-call owner instead of only writing a warning.",
        "The dashboard shows upload latency per region and the size of the retry queue.",
        "Old snapshots from before version 4.0 are kept read-only until the end of the quarter.",
        "Summarise these notes as a bulleted list for the weekly report, one bullet per fact,",
        "then write a short paragraph on the risks each change brings.",
    ]
    .join(" ");
    (fg, bg)
}

/// One streamed answer, as its client saw it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StreamReport {
    /// Tokens streamed.
    pub tokens: usize,
    /// `finish_reason` of its last chunk.
    pub finish: String,
    /// The text.
    pub text: String,
    /// Whether the text is the one the same request gives alone, unpressured.
    pub matches_alone: bool,
    /// Where it first differs from that text (a character index), if it does. Greedy answers
    /// decoded beside another (two sequences in one decode) can part from the one decoded
    /// alone at a near tie, whatever became of their caches.
    pub differs_at_char: Option<usize>,
    /// The longest wait between two tokens after the cut, ms.
    pub longest_gap_after_cut_ms: f64,
    /// When its last token came, ms after the cut.
    pub last_token_after_cut_ms: f64,
    /// Whether it ended before memory returned.
    pub ended_before_memory_returned: bool,
    /// The stall events' reasons.
    pub stalls: Vec<String>,
    /// The lever events (`park`, `resume`, …).
    pub levers: Vec<String>,
    /// The switches, `from→to at token N (cost ms)`.
    pub switches: Vec<String>,
}

/// One arm of the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArmReport {
    /// `set-aside` or `whole-park`.
    pub arm: String,
    /// The foreground answer.
    pub foreground: StreamReport,
    /// The background answer.
    pub background: StreamReport,
    /// The low budget, bytes.
    pub low_budget_bytes: u64,
    /// The idle server's resident set with no rung loaded, bytes.
    pub floor_rss_bytes: u64,
    /// The largest resident set above the floor minus the budget, while the budget was low
    /// and `settle_ms` after the cut, bytes.
    pub max_overshoot_measured_bytes: i64,
    /// The same in the first `settle_ms` after the cut (the switch acting), bytes.
    pub max_overshoot_measured_settling_bytes: i64,
    /// The largest number of set-aside cache files seen at once.
    pub aside_files: usize,
    /// The second scene: every sequence busy with a background answer when a foreground
    /// request comes, memory ample (absent in files written before it was measured).
    #[serde(default)]
    pub sequences: Option<SequencesReport>,
}

/// The background answer set aside on the largest rung (the same cut as the first scene), the
/// foreground one ended, then a budget that holds the smallest rung with the background
/// answer whole and no larger rung: it resumes there, its cache carried through the switch.
/// What its user would check: how long it waited once memory allowed, and whether the answer
/// written on the smaller rung still states the facts of its notes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OtherRungReport {
    /// `default` (its history re-read on the rung it resumes on) or `carry-on-resume` (`serve
    /// --carry-on-resume`: its cache carried through the switch, projected).
    pub arm: String,
    /// The budget it resumed under, bytes.
    pub budget_bytes: u64,
    /// Its switch, `from→to at token N (cost ms)`.
    pub switch: String,
    /// The switch's method (`molt`: carried; a re-read names itself).
    pub method: String,
    /// Tokens it had when set aside (the switch's token).
    pub at_token: usize,
    /// From the budget's rise to its next token, ms.
    pub wait_ms: f64,
    /// Its levers, in order.
    pub levers: Vec<String>,
    /// Tokens streamed in all.
    pub tokens: usize,
    /// The facts of its notes (see [`ServeAsideOptions::facts`]).
    pub facts: usize,
    /// Those its answer states.
    pub facts_stated: Vec<String>,
    /// Those it does not state.
    pub facts_missed: Vec<String>,
    /// Those stated in the part written on the smaller rung, after the switch.
    pub facts_stated_after_switch: Vec<String>,
    /// Facts stated by the same request alone on the largest rung, unpressured.
    pub facts_alone_source: usize,
    /// Facts stated by the same request alone on the rung it resumed on (the native
    /// destination).
    pub facts_alone_destination: usize,
    /// Its text.
    pub text: String,
    /// The native destination's text.
    pub alone_destination_text: String,
}

/// Two background answers fill both sequences; a foreground request comes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SequencesReport {
    /// The foreground request's time to its first token, from when it was sent, ms.
    pub fg_ttft_ms: f64,
    /// Whether its first token came before either background answer ended.
    pub fg_before_a_background_ended: bool,
    /// The earlier background answer.
    pub first: StreamReport,
    /// The later one (the one set aside, when one is).
    pub second: StreamReport,
}

/// The run's report (`results/serve_aside.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeAsideReport {
    /// The arms, set-aside first.
    pub arms: Vec<ArmReport>,
    /// The foreground prompt's tokens.
    pub fg_prompt_tokens: u64,
    /// The background prompt's tokens.
    pub bg_prompt_tokens: u64,
    /// `max_tokens` of the two answers.
    pub fg_max_tokens: usize,
    /// `max_tokens` of the background answer.
    pub bg_max_tokens: usize,
    /// How long the budget stayed low, ms.
    pub low_ms: u64,
    /// See [`ServeAsideOptions::settle_ms`].
    pub settle_ms: u64,
    /// The smallest rung (the one the low budget holds with the foreground answer alone).
    pub rung: String,
    /// The third scene, a set-aside answer resumed on a smaller model than the one it left:
    /// with the server's default (its history re-read there) and with `serve
    /// --carry-on-resume` (its cache carried through the switch) — absent in files written
    /// before it was measured.
    #[serde(default)]
    pub other_rung: Vec<OtherRungReport>,
}

/// Runs both arms: see the module doc.
///
/// # Errors
///
/// [`ServeQosError`] when a server does not start, a request fails or the prompts do not
/// make the scenario (the background cache too small to matter).
pub fn run(
    opts: &ServeAsideOptions,
    say: &mut dyn FnMut(&str),
) -> Result<ServeAsideReport, ServeQosError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(super::serve_qos::io("starting the async runtime"))?;
    rt.block_on(async {
        let mut arms = Vec::new();
        let mut facts = None;
        for (arm, set_aside) in [("set-aside", true), ("whole-park", false)] {
            let (report, f) = run_arm(opts, arm, set_aside, say).await?;
            arms.push(report);
            facts = Some(f);
        }
        let (fg_prompt_tokens, bg_prompt_tokens, rung) = facts.unwrap_or_default();
        let mut other_rung = Vec::new();
        for (arm, extra) in [
            ("default", None),
            ("carry-on-resume", Some("--carry-on-resume")),
        ] {
            other_rung.push(other_rung_arm(opts, arm, extra, say).await?);
        }
        Ok(ServeAsideReport {
            other_rung,
            arms,
            fg_prompt_tokens,
            bg_prompt_tokens,
            fg_max_tokens: opts.fg_max_tokens,
            bg_max_tokens: opts.bg_max_tokens,
            low_ms: opts.low_ms,
            settle_ms: opts.settle_ms,
            rung,
        })
    })
}

fn body(content: &str, max_tokens: usize, stream: bool, background: bool) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    });
    if background {
        b["molt"] = json!({"class": "background"});
    }
    b
}

/// A non-streamed answer: its text and prompt tokens.
async fn alone(addr: std::net::SocketAddr, b: &Value) -> Result<(String, u64), ServeQosError> {
    let r = client::post_json(addr, "/v1/chat/completions", b)
        .await
        .map_err(super::serve_qos::io("POST /v1/chat/completions"))?;
    let v: Value = r
        .json()
        .map_err(|e| ServeQosError::Server(format!("answer is not JSON: {e}")))?;
    if r.status != 200 {
        return Err(ServeQosError::Server(format!("answer refused: {v}")));
    }
    Ok((
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
    ))
}

type Events = Arc<Mutex<(Vec<(Instant, Value)>, bool)>>;

/// Reads a stream into `events` until it ends (the flag set then).
fn read_stream(addr: std::net::SocketAddr, b: Value) -> Events {
    let events: Events = Arc::new(Mutex::new((Vec::new(), false)));
    let out = Arc::clone(&events);
    tokio::spawn(async move {
        if let Ok(Ok(mut s)) = client::stream(addr, "/v1/chat/completions", &b).await {
            while let Ok(Some(ev)) = s.next().await {
                let v = ev.json().unwrap_or(Value::String(ev.data));
                out.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0
                    .push((Instant::now(), v));
            }
        }
        out.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1 = true;
    });
    events
}

fn kind(v: &Value) -> &str {
    v["molt"]["event"].as_str().unwrap_or("")
}

fn tokens_in(e: &Events) -> usize {
    e.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .0
        .iter()
        .filter(|(_, v)| kind(v) == "token")
        .count()
}

fn ended(e: &Events) -> bool {
    e.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .1
}

async fn until(
    what: &str,
    deadline: Duration,
    mut f: impl FnMut() -> bool,
) -> Result<(), ServeQosError> {
    let t0 = Instant::now();
    while !f() {
        if t0.elapsed() > deadline {
            return Err(ServeQosError::Server(format!(
                "timed out waiting for {what}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Opens a stream of `b` and waits until it has streamed `n` tokens (or ended).
async fn stream_until(
    addr: std::net::SocketAddr,
    b: Value,
    n: usize,
    what: &str,
) -> Result<Events, ServeQosError> {
    let events = read_stream(addr, b);
    until(what, Duration::from_secs(300), || {
        tokens_in(&events) >= n || ended(&events)
    })
    .await?;
    Ok(events)
}

/// The background answer streaming (8 tokens in), then the foreground one beside it (4 in):
/// the scene a cut falls on. Both streams.
async fn both_streaming(
    addr: std::net::SocketAddr,
    opts: &ServeAsideOptions,
) -> Result<(Events, Events), ServeQosError> {
    let bg = stream_until(
        addr,
        body(&opts.background, opts.bg_max_tokens, true, true),
        8,
        "the background answer's 8th token",
    )
    .await?;
    let fg = stream_until(
        addr,
        body(&opts.foreground, opts.fg_max_tokens, true, false),
        4,
        "the foreground answer's 4th token",
    )
    .await?;
    if ended(&bg) || ended(&fg) {
        return Err(ServeQosError::Server(
            "an answer ended before the cut: raise its max_tokens".into(),
        ));
    }
    Ok((bg, fg))
}

/// What a stream's events say, against the cut and the return of memory.
fn summarise(e: &Events, want: &str, cut: Instant, back: Instant) -> StreamReport {
    let g = e.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let events = &g.0;
    let mut r = StreamReport::default();
    let mut last: Option<Instant> = None;
    for (at, v) in events {
        match kind(v) {
            "token" => {
                r.tokens += 1;
                if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                    r.text.push_str(c);
                }
                if let Some(prev) = last
                    && *at > cut
                {
                    let gap = at.duration_since(prev.max(cut)).as_secs_f64() * 1e3;
                    r.longest_gap_after_cut_ms = r.longest_gap_after_cut_ms.max(gap);
                }
                last = Some(*at);
            }
            "stall" => r
                .stalls
                .push(v["molt"]["reason"].as_str().unwrap_or("").to_string()),
            "lever" => r
                .levers
                .push(v["molt"]["lever"].as_str().unwrap_or("").to_string()),
            "switch" => {
                let m = &v["molt"];
                // A re-read is done over the next steps: the event has no cost of its own
                // (the stream's wait says it).
                let how = if m["method"] == "molt" {
                    format!("{:.0} ms", m["cost_ms"].as_f64().unwrap_or(0.0))
                } else {
                    "re-read".to_string()
                };
                r.switches.push(format!(
                    "{}→{} at token {} ({how})",
                    m["from"].as_str().unwrap_or(""),
                    m["to"].as_str().unwrap_or(""),
                    m["at_token"].as_u64().unwrap_or(0),
                ));
            }
            _ => {}
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            r.finish = f.to_string();
        }
    }
    if let Some(l) = last {
        r.last_token_after_cut_ms = l.saturating_duration_since(cut).as_secs_f64() * 1e3;
        r.ended_before_memory_returned = l < back;
    }
    r.matches_alone = r.text == want;
    r.differs_at_char = (!r.matches_alone).then(|| {
        r.text
            .chars()
            .zip(want.chars())
            .take_while(|(a, b)| a == b)
            .count()
    });
    r
}

/// The second scene (see the module doc), memory ample.
async fn sequences_scene(
    addr: std::net::SocketAddr,
    opts: &ServeAsideOptions,
    want_first: &str,
) -> Result<SequencesReport, ServeQosError> {
    let second_msg = format!("Second copy. {}", opts.background);
    let (want_second, _) = alone(addr, &body(&second_msg, opts.bg_max_tokens, false, true)).await?;
    let first = stream_until(
        addr,
        body(&opts.background, opts.bg_max_tokens, true, true),
        8,
        "the first background answer's 8th token",
    )
    .await?;
    let second = stream_until(
        addr,
        body(&second_msg, opts.bg_max_tokens, true, true),
        4,
        "the second background answer's 4th token",
    )
    .await?;
    if ended(&first) || ended(&second) {
        return Err(ServeQosError::Server(
            "a background answer ended before the foreground request came: raise its max_tokens"
                .into(),
        ));
    }
    let sent = Instant::now();
    let fg = read_stream(
        addr,
        body(&opts.foreground, opts.fg_max_tokens, true, false),
    );
    until("every answer to end", Duration::from_secs(900), || {
        ended(&fg) && ended(&first) && ended(&second)
    })
    .await?;
    let first_token = |e: &Events| {
        e.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .iter()
            .find(|(_, v)| kind(v) == "token")
            .map(|(at, _)| *at)
    };
    let last_token = |e: &Events| {
        e.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .iter()
            .rev()
            .find(|(_, v)| kind(v) == "token")
            .map(|(at, _)| *at)
    };
    let fg_first = first_token(&fg);
    let ended_first = [last_token(&first), last_token(&second)]
        .into_iter()
        .flatten()
        .min();
    let fg_ttft_ms = fg_first.map_or(f64::NAN, |t| t.duration_since(sent).as_secs_f64() * 1e3);
    // No cut in this scene: the stream summaries are taken against the request's sending.
    let far = sent + Duration::from_secs(3600);
    Ok(SequencesReport {
        fg_ttft_ms,
        fg_before_a_background_ended: matches!((fg_first, ended_first), (Some(a), Some(b)) if a < b),
        first: summarise(&first, want_first, sent, far),
        second: summarise(&second, &want_second, sent, far),
    })
}

async fn run_arm(
    opts: &ServeAsideOptions,
    arm: &str,
    set_aside: bool,
    say: &mut dyn FnMut(&str),
) -> Result<(ArmReport, (u64, u64, String)), ServeQosError> {
    let work = opts.work_dir.join(arm);
    let _ = std::fs::remove_dir_all(&work);
    let mut serve_args: Vec<String> = [
        "--port",
        "0",
        "--parallel",
        "2",
        "--admission-timeout-s",
        "36000",
        "--park-deadline-s",
        "36000",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    if !set_aside {
        serve_args.push("--no-set-aside".into());
    }
    let mut server = spawn_server(&opts.program, &opts.global_args, &serve_args, &work)?;
    let addr = server.addr;
    let floor = floor_rss(&server).await?;
    post_budget(addr, &json!({"unlimited": true})).await?;
    let Setup {
        want_fg,
        want_bg,
        fg_prompt,
        bg_prompt,
        low,
        rung,
        ..
    } = setup(addr, opts).await?;
    say(&format!(
        "serve-aside [{arm}]: floor {} MiB; prompts {fg_prompt} (foreground) and {bg_prompt} (background) tokens; the cut: {:.1} MiB ({rung} with the foreground answer alone)",
        floor >> 20,
        low as f64 / 1_048_576.0
    ));

    let (bg_events, fg_events) = both_streaming(addr, opts).await?;
    let cut = Instant::now();
    post_budget(addr, &json!({"bytes": low})).await?;
    let aside_dir = work.join("state").join("aside");
    let mut settling = i64::MIN;
    let mut settled = i64::MIN;
    let mut aside_files = 0;
    while cut.elapsed() < Duration::from_millis(opts.low_ms) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let over = signed(server.rss().saturating_sub(floor)) - signed(low);
        if cut.elapsed() < Duration::from_millis(opts.settle_ms) {
            settling = settling.max(over);
        } else {
            settled = settled.max(over);
        }
        let files = std::fs::read_dir(&aside_dir).map_or(0, |d| d.flatten().count());
        aside_files = aside_files.max(files);
        if !server.alive() {
            return Err(ServeQosError::Server("the server died".into()));
        }
    }
    let back = Instant::now();
    post_budget(addr, &json!({"unlimited": true})).await?;
    until("both answers to end", Duration::from_secs(600), || {
        ended(&bg_events) && ended(&fg_events)
    })
    .await?;
    let foreground = summarise(&fg_events, &want_fg, cut, back);
    let background = summarise(&bg_events, &want_bg, cut, back);
    say(&format!(
        "serve-aside [{arm}]: foreground: longest wait after the cut {:.0} ms, last token {:.1} s after the cut ({}), {} tokens; background: longest wait {:.1} s, matches alone {}, levers {:?}; max overshoot {:.1} MiB (settling {:.1} MiB)",
        foreground.longest_gap_after_cut_ms,
        foreground.last_token_after_cut_ms / 1e3,
        if foreground.ended_before_memory_returned {
            "before memory returned"
        } else {
            "after memory returned"
        },
        foreground.tokens,
        background.longest_gap_after_cut_ms / 1e3,
        background.matches_alone,
        background.levers,
        settled as f64 / 1_048_576.0,
        settling as f64 / 1_048_576.0,
    ));
    let sequences = sequences_scene(addr, opts, &want_bg).await?;
    say(&format!(
        "serve-aside [{arm}]: every sequence busy with a background answer: the foreground request's first token after {:.0} ms ({}); the later background answer: levers {:?}, matches alone {}",
        sequences.fg_ttft_ms,
        if sequences.fg_before_a_background_ended {
            "before either background answer ended"
        } else {
            "after a background answer ended"
        },
        sequences.second.levers,
        sequences.second.matches_alone
    ));
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
    Ok((
        ArmReport {
            sequences: Some(sequences),
            arm: arm.to_string(),
            foreground,
            background,
            low_budget_bytes: low,
            floor_rss_bytes: floor,
            max_overshoot_measured_bytes: settled,
            max_overshoot_measured_settling_bytes: settling,
            aside_files,
        },
        (fg_prompt, bg_prompt, rung),
    ))
}

/// What every arm measures first: each answer alone, unpressured, and the scenes' budgets.
struct Setup {
    want_fg: String,
    want_bg: String,
    fg_prompt: u64,
    bg_prompt: u64,
    /// The smallest rung with the foreground answer whole, not the background one beside it.
    low: u64,
    /// The smallest rung with the background answer whole, and no larger rung.
    mid: u64,
    /// The smallest rung.
    rung: String,
}

async fn setup(
    addr: std::net::SocketAddr,
    opts: &ServeAsideOptions,
) -> Result<Setup, ServeQosError> {
    let fg = body(&opts.foreground, opts.fg_max_tokens, false, false);
    let bg = body(&opts.background, opts.bg_max_tokens, false, true);
    let (want_fg, fg_prompt) = alone(addr, &fg).await?;
    let (want_bg, bg_prompt) = alone(addr, &bg).await?;
    let status = get_status(addr).await?;
    let rungs = status["engine"]["rungs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let small = rungs
        .last()
        .ok_or_else(|| ServeQosError::Server("the status lists no rung".into()))?;
    let resident = (small["resident_mib"].as_f64().unwrap_or(0.0) * 1_048_576.0) as u64;
    let kv = small["kv_bytes_per_token"].as_u64().unwrap_or(0);
    let fg_whole = fg_prompt + opts.fg_max_tokens as u64 + 32;
    let low = resident + kv * fg_whole;
    // The background answer holds at least its prompt and 8 tokens when the cut comes.
    if resident + kv * (fg_prompt + bg_prompt + 8) <= low {
        return Err(ServeQosError::Server(format!(
            "the background prompt ({bg_prompt} tokens) is too short: the smallest rung would hold both answers under the cut"
        )));
    }
    let rung = small["name"].as_str().unwrap_or("").to_string();
    let mid = mid_budget(&rungs, &rung, bg_prompt + opts.bg_max_tokens as u64 + 32)?;
    Ok(Setup {
        want_fg,
        want_bg,
        fg_prompt,
        bg_prompt,
        low,
        mid,
        rung,
    })
}

/// The third scene on a server of its own, `extra` added to its arguments.
async fn other_rung_arm(
    opts: &ServeAsideOptions,
    arm: &str,
    extra: Option<&str>,
    say: &mut dyn FnMut(&str),
) -> Result<OtherRungReport, ServeQosError> {
    let work = opts.work_dir.join(format!("other-rung-{arm}"));
    let _ = std::fs::remove_dir_all(&work);
    let serve_args: Vec<String> = [
        "--port",
        "0",
        "--parallel",
        "2",
        "--admission-timeout-s",
        "36000",
        "--park-deadline-s",
        "36000",
    ]
    .into_iter()
    .chain(extra)
    .map(ToString::to_string)
    .collect();
    let server = spawn_server(&opts.program, &opts.global_args, &serve_args, &work)?;
    let addr = server.addr;
    post_budget(addr, &json!({"unlimited": true})).await?;
    let s = setup(addr, opts).await?;
    let r = other_rung_scene(addr, opts, arm, &s).await?;
    say(&format!(
        "serve-aside [other rung, {arm}]: set aside on the largest rung, resumed under {:.1} MiB: {} ({}), {:.0} ms after memory allowed; facts stated {}/{} ({} after the switch); alone on the largest rung {}, alone on the destination {}",
        r.budget_bytes as f64 / 1_048_576.0,
        r.switch,
        r.method,
        r.wait_ms,
        r.facts_stated.len(),
        r.facts,
        r.facts_stated_after_switch.len(),
        r.facts_alone_source,
        r.facts_alone_destination
    ));
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
    Ok(r)
}

/// The facts of `facts` that `text` states (case-insensitive).
fn stated(facts: &[String], text: &str) -> Vec<String> {
    let text = text.to_lowercase();
    facts
        .iter()
        .filter(|f| text.contains(&f.to_lowercase()))
        .cloned()
        .collect()
}

/// A budget that holds the smallest rung `small` with `cells` of its cache and no larger rung.
fn mid_budget(rungs: &[Value], small: &str, cells: u64) -> Result<u64, ServeQosError> {
    let mib = |r: &Value, k: &str| (r[k].as_f64().unwrap_or(0.0) * 1_048_576.0) as u64;
    let s = rungs
        .iter()
        .find(|r| r["name"] == small)
        .ok_or_else(|| ServeQosError::Server(format!("the status lists no rung {small}")))?;
    let mid = mib(s, "resident_mib") + s["kv_bytes_per_token"].as_u64().unwrap_or(0) * cells;
    let next = rungs
        .iter()
        .filter(|r| r["name"] != small)
        .map(|r| mib(r, "resident_mib"))
        .min()
        .unwrap_or(u64::MAX);
    if mid >= next {
        return Err(ServeQosError::Server(format!(
            "a budget holding {small} with the background answer whole ({:.1} MiB) also holds a larger rung: lower bg_max_tokens",
            mid as f64 / 1_048_576.0
        )));
    }
    Ok(mid)
}

/// The third scene (see [`OtherRungReport`]).
async fn other_rung_scene(
    addr: std::net::SocketAddr,
    opts: &ServeAsideOptions,
    arm: &str,
    scene: &Setup,
) -> Result<OtherRungReport, ServeQosError> {
    post_budget(addr, &json!({"bytes": scene.mid})).await?;
    let (alone_destination_text, _) = alone(
        addr,
        &body(&opts.background, opts.bg_max_tokens, false, true),
    )
    .await?;
    post_budget(addr, &json!({"unlimited": true})).await?;
    let (bg, fg) = both_streaming(addr, opts).await?;
    post_budget(addr, &json!({"bytes": scene.low})).await?;
    let has_lever = |e: &Events, name: &str| {
        e.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .iter()
            .any(|(_, v)| kind(v) == "lever" && v["molt"]["lever"] == name)
    };
    until(
        "the background answer to be set aside",
        Duration::from_secs(120),
        || has_lever(&bg, "park") || ended(&bg),
    )
    .await?;
    until(
        "the foreground answer to end",
        Duration::from_secs(600),
        || ended(&fg),
    )
    .await?;
    if ended(&bg) || has_lever(&bg, "resume") {
        return Err(ServeQosError::Server(
            "the background answer was not set aside under the cut, or resumed before the budget rose".into(),
        ));
    }
    let raised = Instant::now();
    post_budget(addr, &json!({"bytes": scene.mid})).await?;
    until(
        "the background answer to end",
        Duration::from_secs(600),
        || ended(&bg),
    )
    .await?;
    post_budget(addr, &json!({"unlimited": true})).await?;
    let g = bg.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let events = &g.0;
    let wait_ms = events
        .iter()
        .find(|(at, v)| *at > raised && kind(v) == "token")
        .map_or(f64::NAN, |(at, _)| {
            at.duration_since(raised).as_secs_f64() * 1e3
        });
    let content = |v: &Value| {
        v["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    let switch_at = events.iter().position(|(_, v)| kind(v) == "switch");
    let after: String = switch_at.map_or_else(String::new, |i| {
        events[i..]
            .iter()
            .filter(|(_, v)| kind(v) == "token")
            .map(|(_, v)| content(v))
            .collect()
    });
    drop(g);
    let far = raised + Duration::from_secs(3600);
    let r = summarise(&bg, &scene.want_bg, raised, far);
    let g = bg.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let sw = switch_at.map(|i| &g.0[i].1["molt"]);
    let facts_stated = stated(&opts.facts, &r.text);
    Ok(OtherRungReport {
        arm: arm.to_string(),
        budget_bytes: scene.mid,
        switch: r.switches.join(", "),
        method: sw.map_or_else(String::new, |m| {
            m["method"].as_str().unwrap_or("").to_string()
        }),
        at_token: sw.map_or(0, |m| {
            usize::try_from(m["at_token"].as_u64().unwrap_or(0)).unwrap_or(0)
        }),
        wait_ms,
        levers: r.levers.clone(),
        tokens: r.tokens,
        facts: opts.facts.len(),
        facts_missed: opts
            .facts
            .iter()
            .filter(|f| !facts_stated.contains(f))
            .cloned()
            .collect(),
        facts_stated,
        facts_stated_after_switch: stated(&opts.facts, &after),
        facts_alone_source: stated(&opts.facts, &scene.want_bg).len(),
        facts_alone_destination: stated(&opts.facts, &alone_destination_text).len(),
        text: r.text,
        alone_destination_text,
    })
}
