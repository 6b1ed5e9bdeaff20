//! Load benchmark for the streaming service: N concurrent streaming clients for a fixed
//! duration against `molt-run serve` (or a server started in this process), optionally cutting
//! and restoring the memory budget on a timer so migrations happen under load. Writes
//! latency percentiles (time to first token, inter-token, whole request, queue wait), error
//! counts by kind and the server's resident set before and after to `results/load.json`.
//!
//! ```sh
//! cargo bench --bench load -- --addr 127.0.0.1:8088 --streams 4 --duration-s 60
//! cargo bench --bench load -- --ladder models/tiny.toml --projectors DIR --threads 1 \
//!     --streams 8 --duration-s 20 --cut-mib 5 --cut-every-s 2
//! ```
//!
//! A request refused with `503 queue_full` is counted apart from errors: it is the service's
//! contract when more clients arrive than the queue holds; the client backs off and retries.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use molt::engine::ContextConfig;
use molt::ladder::Ladder;
use molt::routes;
use molt::session::SessionOptions;
use molt_server::client;
use molt_server::{Server, ServerConfig};
use serde::Serialize;
use serde_json::{Value, json};

struct Args {
    addr: Option<SocketAddr>,
    ladder: Option<PathBuf>,
    models_dir: Option<PathBuf>,
    projectors: Option<PathBuf>,
    threads: u32,
    n_ctx: u32,
    queue: usize,
    streams: usize,
    duration_s: f64,
    max_tokens: usize,
    cut_mib: Option<f64>,
    cut_every_s: f64,
    out: PathBuf,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        addr: None,
        ladder: None,
        models_dir: None,
        projectors: None,
        threads: 1,
        n_ctx: 2048,
        queue: 8,
        streams: 4,
        duration_s: 30.0,
        max_tokens: 48,
        cut_mib: None,
        cut_every_s: 5.0,
        out: PathBuf::from("results/load.json"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        // `cargo bench` passes `--bench` to every bench binary.
        if flag == "--bench" {
            continue;
        }
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => a.addr = Some(val()?.parse().context("--addr")?),
            "--ladder" => a.ladder = Some(PathBuf::from(val()?)),
            "--models-dir" => a.models_dir = Some(PathBuf::from(val()?)),
            "--projectors" => a.projectors = Some(PathBuf::from(val()?)),
            "--threads" => a.threads = val()?.parse().context("--threads")?,
            "--n-ctx" => a.n_ctx = val()?.parse().context("--n-ctx")?,
            "--queue" => a.queue = val()?.parse().context("--queue")?,
            "--streams" => a.streams = val()?.parse().context("--streams")?,
            "--duration-s" => a.duration_s = val()?.parse().context("--duration-s")?,
            "--max-tokens" => a.max_tokens = val()?.parse().context("--max-tokens")?,
            "--cut-mib" => a.cut_mib = Some(val()?.parse().context("--cut-mib")?),
            "--cut-every-s" => a.cut_every_s = val()?.parse().context("--cut-every-s")?,
            "--out" => a.out = PathBuf::from(val()?),
            "-h" | "--help" => {
                println!(
                    "load [--addr HOST:PORT | --ladder MANIFEST.toml [--models-dir D] [--projectors D] [--threads N] [--n-ctx N] [--queue N]]\n     [--streams N] [--duration-s S] [--max-tokens N] [--cut-mib M [--cut-every-s S]] [--out results/load.json]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown flag {other}"),
        }
    }
    if a.addr.is_some() == a.ladder.is_some() {
        bail!("give exactly one of --addr (a running server) or --ladder (serve in this process)");
    }
    if a.streams == 0 || a.duration_s <= 0.0 || a.max_tokens == 0 || a.threads == 0 {
        bail!("--streams, --duration-s, --max-tokens and --threads must be positive");
    }
    Ok(a)
}

/// What one request saw.
#[derive(Default)]
struct Sample {
    ttft_ms: Option<f64>,
    gaps_ms: Vec<f64>,
    total_ms: f64,
    queue_ms: Option<f64>,
    tokens: usize,
    switches: Vec<f64>,
    outcome: Outcome,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    #[default]
    Ok,
    QueueFull,
    Http4xx,
    Http5xx,
    Transport,
    StreamError,
    Incomplete,
}

const PROMPTS: &[&str] = &[
    "Write a Rust function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a KV cache is.",
    "List three ways an operating system reclaims memory.",
    "Write a Python one-liner that reverses a string.",
];

async fn one_request(addr: SocketAddr, i: usize, max_tokens: usize) -> Sample {
    // No "model": the server answers with its ladder's name (and refuses names it does not
    // serve).
    let body = json!({
        "messages": [{"role": "user", "content": PROMPTS[i % PROMPTS.len()]}],
        "max_tokens": max_tokens,
        "stream": true,
    });
    let t0 = Instant::now();
    let mut s = Sample::default();
    let mut stream = match client::stream(addr, "/v1/chat/completions", &body).await {
        Err(_) => {
            s.outcome = Outcome::Transport;
            return s;
        }
        Ok(Err(resp)) => {
            s.outcome = match resp.status {
                503 if resp
                    .json()
                    .is_ok_and(|v| v["error"]["type"] == "queue_full") =>
                {
                    Outcome::QueueFull
                }
                400..=499 => Outcome::Http4xx,
                _ => Outcome::Http5xx,
            };
            s.total_ms = t0.elapsed().as_secs_f64() * 1e3;
            return s;
        }
        Ok(Ok(st)) => st,
    };
    let mut last_token: Option<Instant> = None;
    let mut done = false;
    loop {
        match stream.next().await {
            Err(_) => {
                s.outcome = Outcome::Transport;
                break;
            }
            Ok(None) => break,
            Ok(Some(ev)) => {
                if ev.data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Some(v) = ev.json() else { continue };
                if v.get("error").is_some() {
                    s.outcome = Outcome::StreamError;
                    continue;
                }
                let now = Instant::now();
                match v["molt"]["event"].as_str() {
                    Some("token") => {
                        s.tokens += 1;
                        if s.ttft_ms.is_none() {
                            s.ttft_ms = Some(now.duration_since(t0).as_secs_f64() * 1e3);
                        }
                        if let Some(p) = last_token {
                            s.gaps_ms.push(now.duration_since(p).as_secs_f64() * 1e3);
                        }
                        last_token = Some(now);
                    }
                    Some("switch") => {
                        s.switches
                            .push(v["molt"]["cost_ms"].as_f64().unwrap_or(f64::NAN));
                    }
                    Some("start") => s.queue_ms = v["molt"]["queue_ms"].as_f64(),
                    _ => {}
                }
            }
        }
    }
    if s.outcome == Outcome::Ok && !done {
        s.outcome = Outcome::Incomplete;
    }
    s.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    s
}

#[derive(Serialize)]
struct Dist {
    n: usize,
    mean: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

fn dist(mut v: Vec<f64>) -> Option<Dist> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    // Nearest rank.
    let pct = |p: f64| {
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    };
    let round = |x: f64| (x * 100.0).round() / 100.0;
    Some(Dist {
        n: v.len(),
        mean: round(v.iter().sum::<f64>() / v.len() as f64),
        p50: round(pct(50.0)),
        p90: round(pct(90.0)),
        p99: round(pct(99.0)),
        max: round(v[v.len() - 1]),
    })
}

async fn get_status(addr: SocketAddr) -> Value {
    match client::request(addr, "GET", "/v1/molt/status", None).await {
        Ok(r) => r.json().unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

async fn set_budget(addr: SocketAddr, body: Value) -> bool {
    client::post_json(addr, "/v1/molt/budget", &body)
        .await
        .is_ok_and(|r| r.status == 200)
}

async fn start_in_process(a: &Args) -> Result<(SocketAddr, tokio::sync::oneshot::Sender<()>)> {
    let manifest = a.ladder.clone().unwrap_or_default();
    let dir = a
        .models_dir
        .clone()
        .or_else(|| manifest.parent().map(PathBuf::from))
        .unwrap_or_default();
    let ladder = Ladder::open(&manifest, &dir)
        .with_context(|| format!("opening ladder {}", manifest.display()))?;
    let config = ServerConfig {
        addr: "127.0.0.1:0".parse()?,
        context: ContextConfig {
            n_ctx: a.n_ctx,
            n_threads: a.threads,
            ..ContextConfig::default()
        },
        session: SessionOptions {
            projector_dirs: routes::search_dirs(a.projectors.as_deref()),
            ..SessionOptions::default()
        },
        queue_capacity: a.queue,
        ..ServerConfig::default()
    };
    let server = Server::start(ladder, config).await?;
    let addr = server.local_addr();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = server
            .serve(async {
                let _ = rx.await;
            })
            .await;
    });
    Ok((addr, tx))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let a = parse_args()?;
    let run = molt_bench::RunInfo::now();
    let (addr, stop) = match a.addr {
        Some(addr) => (addr, None),
        None => {
            // The allocator policy `molt-run serve` sets (see serve.rs): freed rung buffers go
            // back to the system, so the resident set measured here is the service's.
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: mallopt only changes allocator tuning; it is safe to call at any time.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
            }
            let (addr, tx) = start_in_process(&a).await?;
            (addr, Some(tx))
        }
    };
    let before = get_status(addr).await;
    if before.is_null() {
        bail!("no molt server answers at {addr}");
    }
    eprintln!(
        "load: {} streams for {} s against {addr} ({}), max_tokens {}",
        a.streams, a.duration_s, before["model"], a.max_tokens
    );
    let deadline = Instant::now() + Duration::from_secs_f64(a.duration_s);
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::new(Mutex::new(Vec::new()));
    let cuts = Arc::new(Mutex::new(0usize));
    // The budget cycler: cut, restore, cut … so answers migrate while others queue.
    let cycler = a.cut_mib.map(|mib| {
        let cuts = Arc::clone(&cuts);
        let every = Duration::from_secs_f64(a.cut_every_s);
        tokio::spawn(async move {
            let mut cut = false;
            while Instant::now() + every < deadline {
                tokio::time::sleep(every).await;
                cut = !cut;
                let body = if cut {
                    json!({"mib": mib})
                } else {
                    json!({"unlimited": true})
                };
                if set_budget(addr, body).await && cut {
                    *cuts.lock().unwrap() += 1;
                }
            }
            set_budget(addr, json!({"unlimited": true})).await;
        })
    });
    let t_run = Instant::now();
    // The server's resident set once a second: growth after the warm-up is what a leak shows.
    let timeline: Arc<Mutex<Vec<(f64, f64)>>> = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let timeline = Arc::clone(&timeline);
        tokio::spawn(async move {
            loop {
                if let Some(m) = get_status(addr).await["rss_mib"].as_f64() {
                    let t = (t_run.elapsed().as_secs_f64() * 10.0).round() / 10.0;
                    timeline
                        .lock()
                        .unwrap()
                        .push((t, (m * 10.0).round() / 10.0));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let mut tasks = Vec::new();
    for w in 0..a.streams {
        let samples = Arc::clone(&samples);
        let max_tokens = a.max_tokens;
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while Instant::now() < deadline {
                let s = one_request(addr, i, max_tokens).await;
                let back_off = s.outcome == Outcome::QueueFull;
                samples.lock().unwrap().push(s);
                if back_off {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                i += 1;
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let wall_s = t_run.elapsed().as_secs_f64();
    sampler.abort();
    let timeline = std::mem::take(&mut *timeline.lock().unwrap());
    // Peaks per half: the resident set swings with the rung in use, so compare peaks; a leak
    // raises the second half's peak above the first's.
    let peak = |first: bool| {
        timeline
            .iter()
            .filter(|(t, _)| (*t < wall_s / 2.0) == first)
            .map(|(_, m)| *m)
            .fold(None, |a: Option<f64>, m| Some(a.map_or(m, |a| a.max(m))))
    };
    let (peak_first, peak_second) = (peak(true), peak(false));
    if let Some(c) = cycler {
        c.abort();
        set_budget(addr, json!({"unlimited": true})).await;
    }
    // Let the engine settle (cancelled work, status publish) before reading the resident set.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = get_status(addr).await;
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    let count = |o: Outcome| samples.iter().filter(|s| s.outcome == o).count();
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.outcome == Outcome::Ok)
        .collect();
    let tokens: usize = ok.iter().map(|s| s.tokens).sum();
    let switch_costs: Vec<f64> = ok.iter().flat_map(|s| s.switches.clone()).collect();
    let errors = json!({
        "http_4xx": count(Outcome::Http4xx),
        "http_5xx": count(Outcome::Http5xx),
        "transport": count(Outcome::Transport),
        "stream_error": count(Outcome::StreamError),
        "incomplete": count(Outcome::Incomplete),
    });
    let error_total: usize = errors
        .as_object()
        .map(|m| m.values().filter_map(Value::as_u64).sum::<u64>() as usize)
        .unwrap_or(0);
    let report = json!({
        "run": run,
        "config": {
            "target": if a.addr.is_some() { "external" } else { "in-process" },
            "model": before["model"],
            "streams": a.streams,
            "duration_s": a.duration_s,
            "max_tokens": a.max_tokens,
            "queue_capacity": before["queue"]["capacity"],
            "n_ctx": before["engine"]["n_ctx"],
            "budget_cut_mib": a.cut_mib,
            "budget_cut_every_s": a.cut_mib.map(|_| a.cut_every_s),
            "threads": before["engine"]["n_threads"],
        },
        "wall_s": wall_s,
        "requests": {
            "sent": samples.len(),
            "completed": ok.len(),
            "rejected_queue_full_503": count(Outcome::QueueFull),
            "errors": errors,
            "error_total": error_total,
        },
        "tokens": tokens,
        "tokens_per_s": tokens as f64 / wall_s,
        "latency_ms": {
            "ttft": dist(ok.iter().filter_map(|s| s.ttft_ms).collect()),
            "inter_token": dist(ok.iter().flat_map(|s| s.gaps_ms.clone()).collect()),
            "request": dist(ok.iter().map(|s| s.total_ms).collect()),
            "queue": dist(ok.iter().filter_map(|s| s.queue_ms).collect()),
        },
        "migrations": {
            "budget_cuts": *cuts.lock().unwrap(),
            "switches_seen": switch_costs.len(),
            "cost_ms": dist(switch_costs),
        },
        "server": {
            "rss_mib_before": before["rss_mib"],
            "rss_mib_after": after["rss_mib"],
            "rss_mib_peak_first_half": peak_first,
            "rss_mib_peak_second_half": peak_second,
            "rss_mib_timeline": timeline,
            "counters_after": after["counters"],
            "rung_after": after["engine"]["current_rung"],
        },
    });
    if let Some(dir) = a.out.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    eprintln!("load: wrote {}", a.out.display());
    if let Some(tx) = stop {
        let _ = tx.send(());
    }
    Ok(())
}
