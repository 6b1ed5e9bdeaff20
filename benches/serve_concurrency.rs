//! Concurrency benchmark for the streaming service: N clients stream at once against
//! `molt-run serve` (continuous batching), `molt-run serve --serial` (one answer at a time)
//! and, when its binary is given, llama.cpp's own `llama-server -np N` on the same GGUF,
//! threads and total context. Writes `results/serve_concurrency.json`:
//! `{"rows": [{"server", "rung", "streams", "aggregate_tok_s", "ttft_ms_p50", "ttft_ms_p99",
//! "itl_ms_p50", "itl_ms_p99", "errors", "rss_peak_mib", …}], …}`.
//!
//! ```sh
//! cargo bench --bench serve_concurrency -- --llama-server PATH/llama-server \
//!     --rungs tier0,tier2 --streams 1,2,4,8 --max-tokens 24 --reps 2
//! ```
//!
//! Fairness on a shared machine: every server runs as its own process with the same threads
//! and context, and within one (rung, streams) cell the servers take turns — round 1 of each,
//! then round 2 of each — so a change in the machine's load hits all of them alike. The load
//! average is recorded with every row. Each request has a prompt of its own (no server can
//! reuse another request's cache), greedy sampling, and `max_tokens` tokens; a round's
//! aggregate rate is every token streamed in it over the round's wall time, from the first
//! request sent to the last stream closed. The molt servers are started once per rung (their
//! start measures every rung's cost) with room for the largest stream count, and their peak
//! resident set is reset (`/proc/PID/clear_refs`) before each cell; llama-server is started
//! per cell with `-np` equal to the stream count, as its slots are fixed at start.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use molt_server::client;
use serde::Serialize;
use serde_json::json;

struct Args {
    molt_run: PathBuf,
    llama_server: Option<PathBuf>,
    ladder: PathBuf,
    models_dir: PathBuf,
    rungs: Vec<String>,
    streams: Vec<usize>,
    max_tokens: usize,
    reps: usize,
    threads: u32,
    n_ctx: u32,
    out: PathBuf,
}

fn parse_list<T: std::str::FromStr>(s: &str, flag: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("{flag}: bad item {x:?}"))
        })
        .collect()
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        // Built by the workspace (the `molt-run` crate): target/<profile>/molt-run.
        molt_run: std::env::current_exe()?
            .parent()
            .and_then(std::path::Path::parent)
            .map(|d| d.join("molt-run"))
            .ok_or_else(|| anyhow::anyhow!("no target directory"))?,
        llama_server: None,
        ladder: PathBuf::from("models/qwen2.5-coder.toml"),
        models_dir: PathBuf::from("models"),
        rungs: vec!["tier0".into(), "tier2".into()],
        streams: vec![1, 2, 4, 8],
        max_tokens: 24,
        reps: 2,
        threads: 2,
        n_ctx: 2048,
        out: PathBuf::from("results/serve_concurrency.json"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--molt-run" => a.molt_run = PathBuf::from(val()?),
            "--llama-server" => a.llama_server = Some(PathBuf::from(val()?)),
            "--ladder" => a.ladder = PathBuf::from(val()?),
            "--models-dir" => a.models_dir = PathBuf::from(val()?),
            "--rungs" => a.rungs = parse_list(&val()?, "--rungs")?,
            "--streams" => a.streams = parse_list(&val()?, "--streams")?,
            "--max-tokens" => a.max_tokens = val()?.parse().context("--max-tokens")?,
            "--reps" => a.reps = val()?.parse().context("--reps")?,
            "--threads" => a.threads = val()?.parse().context("--threads")?,
            "--n-ctx" => a.n_ctx = val()?.parse().context("--n-ctx")?,
            "--out" => a.out = PathBuf::from(val()?),
            "-h" | "--help" => {
                println!(
                    "serve_concurrency [--llama-server BIN] [--molt-run BIN] [--ladder M] [--models-dir D]\n    [--rungs tier0,tier2] [--streams 1,2,4,8] [--max-tokens 24] [--reps 2] [--threads 2]\n    [--n-ctx 2048] [--out results/serve_concurrency.json]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown flag {other}"),
        }
    }
    if a.streams.is_empty() || a.streams.contains(&0) || a.max_tokens == 0 || a.reps == 0 {
        bail!("--streams items, --max-tokens and --reps must be positive");
    }
    if let Some(p) = &a.llama_server
        && !p.is_file()
    {
        bail!("--llama-server {}: no such file", p.display());
    }
    Ok(a)
}

/// Topics for the prompts: each request gets a different one (and a request number), so no
/// request's prompt is a prefix another's cache could serve.
const TOPICS: &[&str] = &[
    "a binary search over a sorted list",
    "parsing a CSV line with quoted fields",
    "a least-recently-used cache",
    "merging two sorted linked lists",
    "a token bucket rate limiter",
    "reversing the words of a sentence",
    "checking balanced brackets",
    "a breadth-first search on a grid",
    "computing a rolling average",
    "deduplicating a list while keeping order",
    "a trie for prefix lookups",
    "the edit distance of two strings",
];

fn prompt(k: usize) -> String {
    format!(
        "Request {k}: write a Python function for {} and explain each line in detail.",
        TOPICS[k % TOPICS.len()]
    )
}

/// What one request saw.
#[derive(Default)]
struct Sample {
    ttft_ms: Option<f64>,
    gaps_ms: Vec<f64>,
    tokens: usize,
    error: bool,
}

async fn one_request(addr: SocketAddr, k: usize, max_tokens: usize) -> Sample {
    let body = json!({
        "messages": [{"role": "user", "content": prompt(k)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
    let t0 = Instant::now();
    let mut s = Sample::default();
    let mut stream = match client::stream(addr, "/v1/chat/completions", &body).await {
        Ok(Ok(st)) => st,
        _ => {
            s.error = true;
            return s;
        }
    };
    let mut last: Option<Instant> = None;
    loop {
        match stream.next().await {
            Err(_) => {
                s.error = true;
                break;
            }
            Ok(None) => break,
            Ok(Some(ev)) => {
                if ev.data == "[DONE]" {
                    continue;
                }
                let Some(v) = ev.json() else { continue };
                if v.get("error").is_some() {
                    s.error = true;
                    continue;
                }
                // One content delta per token on both servers (molt's token chunks and
                // llama-server's); role-only and final chunks carry none.
                if v["choices"][0]["delta"]["content"].is_string()
                    && v["molt"]["event"].as_str().is_none_or(|e| e == "token")
                {
                    let now = Instant::now();
                    s.tokens += 1;
                    if s.ttft_ms.is_none() {
                        s.ttft_ms = Some(now.duration_since(t0).as_secs_f64() * 1e3);
                    }
                    if let Some(p) = last {
                        s.gaps_ms.push(now.duration_since(p).as_secs_f64() * 1e3);
                    }
                    last = Some(now);
                }
            }
        }
    }
    if s.tokens == 0 {
        s.error = true;
    }
    s
}

/// One round: `n` requests at once; their samples and the round's wall time, s.
async fn round(
    addr: SocketAddr,
    n: usize,
    first_k: usize,
    max_tokens: usize,
) -> (Vec<Sample>, f64) {
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|i| tokio::spawn(one_request(addr, first_k + i, max_tokens)))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or(Sample {
            error: true,
            ..Sample::default()
        }));
    }
    (out, t0.elapsed().as_secs_f64())
}

fn pct(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    Some((v[i] * 10.0).round() / 10.0)
}

#[derive(Serialize)]
struct Row {
    server: String,
    rung: String,
    streams: usize,
    aggregate_tok_s: f64,
    ttft_ms_p50: Option<f64>,
    ttft_ms_p99: Option<f64>,
    itl_ms_p50: Option<f64>,
    itl_ms_p99: Option<f64>,
    errors: usize,
    rss_peak_mib: Option<f64>,
    requests: usize,
    tokens: usize,
    reps: usize,
    load_avg_1m: Option<f64>,
    /// Whether the rung's weights were repacked for llama.cpp's CPU kernels (the same for
    /// every server in the cell).
    repack: bool,
}

/// A server process under test.
struct Proc {
    name: &'static str,
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resets the kernel's peak resident set of the process (`VmHWM`).
    fn reset_peak(&self) {
        let _ = std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5");
    }

    fn peak_mib(&self) -> Option<f64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let kb: f64 = s
            .lines()
            .find(|l| l.starts_with("VmHWM:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some((kb / 1024.0 * 10.0).round() / 10.0)
    }
}

fn free_port() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    l.local_addr().context("free port")
}

fn load_avg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Waits until `path` answers 200 (the server has loaded), at most `limit`.
async fn wait_ready(p: &mut Proc, path: &str, limit: Duration) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if let Ok(r) = client::request(p.addr, "GET", path, None).await
            && r.status == 200
        {
            return Ok(());
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            bail!("{} exited while starting: {status}", p.name);
        }
        if t0.elapsed() > limit {
            bail!("{} did not become ready within {limit:?}", p.name);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn start_molt(a: &Args, rung: &str, serial: bool) -> Result<Proc> {
    let addr = free_port()?;
    let mut c = Command::new(&a.molt_run);
    c.arg("--ladder").arg(&a.ladder);
    c.arg("--models-dir").arg(&a.models_dir);
    let max_streams = a.streams.iter().copied().max().unwrap_or(1);
    c.args([
        "--n-ctx",
        &a.n_ctx.to_string(),
        "--threads",
        &a.threads.to_string(),
        "serve",
        "--port",
        &addr.port().to_string(),
        "--rung",
        rung,
        "--queue",
        &(max_streams * 2).to_string(),
    ]);
    if serial {
        c.arg("--serial");
    } else {
        c.args(["--parallel", &max_streams.to_string()]);
    }
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let child = c.spawn().context("starting molt-run serve")?;
    let mut p = Proc {
        name: if serial { "molt-serial" } else { "molt" },
        child,
        addr,
    };
    wait_ready(&mut p, "/v1/molt/status", Duration::from_secs(600)).await?;
    Ok(p)
}

/// Whether Molt's server loads `rung` with llama.cpp's CPU repack, as its speed policy decides
/// with room to spare (`MOLT_REPACK`, else the ladder's measured settings for this processor,
/// else off): the peer is started the same way. On a processor with AMX, llama.cpp's repack
/// also routes matrix products through AMX tiles, which a virtual machine may refuse (SIGILL).
fn molt_repacks(ladder: &molt::ladder::Ladder, rung: &str) -> bool {
    let (measured, _) = molt::speed::Measured::find(&molt::routes::search_dirs(None), ladder);
    let policy = molt::speed::SpeedPolicy {
        measured: measured.map(std::sync::Arc::new),
        forced_ubatch: None,
        forced_repack: molt::speed::forced_repack_from_env(),
    };
    let n_ubatch = molt_bench::speed::Setting::molt_default().n_ubatch;
    policy
        .choose(rung, n_ubatch, Some(u64::MAX / 4))
        .setting
        .repack
}

async fn start_llama(
    a: &Args,
    bin: &PathBuf,
    gguf: &PathBuf,
    np: usize,
    repack: bool,
) -> Result<Proc> {
    let addr = free_port()?;
    let child = Command::new(bin)
        .arg("-m")
        .arg(gguf)
        .args([
            "-np",
            &np.to_string(),
            "-t",
            &a.threads.to_string(),
            "-tb",
            &a.threads.to_string(),
            "-c",
            &a.n_ctx.to_string(),
            // Molt's contexts run without flash attention (see `ContextConfig`): the same here.
            "-fa",
            "off",
            if repack { "--repack" } else { "--no-repack" },
            "--host",
            "127.0.0.1",
            "--port",
            &addr.port().to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting llama-server")?;
    let mut p = Proc {
        name: "llama-server",
        child,
        addr,
    };
    wait_ready(&mut p, "/health", Duration::from_secs(300)).await?;
    Ok(p)
}

/// Accumulates one server's rounds in one cell.
#[derive(Default)]
struct Cell {
    samples: Vec<Sample>,
    wall_s: f64,
}

impl Cell {
    fn row(
        mut self,
        server: &str,
        rung: &str,
        streams: usize,
        reps: usize,
        rss: Option<f64>,
        load: Option<f64>,
    ) -> Row {
        let tokens: usize = self.samples.iter().map(|s| s.tokens).sum();
        let mut ttft: Vec<f64> = self.samples.iter().filter_map(|s| s.ttft_ms).collect();
        let mut itl: Vec<f64> = self
            .samples
            .iter_mut()
            .flat_map(|s| std::mem::take(&mut s.gaps_ms))
            .collect();
        #[allow(clippy::cast_precision_loss)]
        let rate = if self.wall_s > 0.0 {
            ((tokens as f64 / self.wall_s) * 100.0).round() / 100.0
        } else {
            0.0
        };
        Row {
            server: server.to_string(),
            rung: rung.to_string(),
            streams,
            aggregate_tok_s: rate,
            ttft_ms_p50: pct(&mut ttft, 50.0),
            ttft_ms_p99: pct(&mut ttft, 99.0),
            itl_ms_p50: pct(&mut itl, 50.0),
            itl_ms_p99: pct(&mut itl, 99.0),
            errors: self.samples.iter().filter(|s| s.error).count(),
            rss_peak_mib: rss,
            requests: self.samples.len(),
            tokens,
            reps,
            load_avg_1m: load,
            repack: false,
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let a = parse_args()?;
    let ladder = molt::ladder::Ladder::open(&a.ladder, &a.models_dir)
        .with_context(|| format!("opening the ladder {}", a.ladder.display()))?;
    let started = Instant::now();
    let load_start = load_avg();
    let mut rows: Vec<Row> = Vec::new();
    let mut k = 0usize;
    for rung in &a.rungs {
        let info = ladder
            .rungs
            .iter()
            .find(|r| r.name() == rung)
            .with_context(|| format!("the ladder has no rung {rung}"))?;
        let repack = molt_repacks(&ladder, rung);
        eprintln!(
            "[{rung}] starting molt and molt-serial (llama.cpp's repack {}) …",
            if repack { "on" } else { "off" }
        );
        let molt = start_molt(&a, rung, false).await?;
        let serial = start_molt(&a, rung, true).await?;
        for &n in &a.streams {
            let llama = match &a.llama_server {
                Some(bin) => Some(start_llama(&a, bin, &info.path, n, repack).await?),
                None => None,
            };
            let mut servers: Vec<&Proc> = vec![&molt, &serial];
            servers.extend(llama.as_ref());
            for p in &servers {
                // A short answer first, not measured: the first request after a start pays
                // the weights' page faults, which is no part of serving concurrently.
                let _ = one_request(p.addr, usize::MAX / 2, 4).await;
                p.reset_peak();
            }
            let mut cells: Vec<Cell> = servers.iter().map(|_| Cell::default()).collect();
            let mut loads = Vec::new();
            for rep in 0..a.reps {
                for (p, cell) in servers.iter().zip(&mut cells) {
                    let (samples, wall) = round(p.addr, n, k, a.max_tokens).await;
                    k += n;
                    let toks: usize = samples.iter().map(|s| s.tokens).sum();
                    eprintln!(
                        "[{rung}] {n} streams, rep {rep}, {:<12} {toks} tokens in {wall:.1} s",
                        p.name
                    );
                    cell.samples.extend(samples);
                    cell.wall_s += wall;
                    loads.extend(load_avg());
                }
            }
            #[allow(clippy::cast_precision_loss)]
            let load = (!loads.is_empty())
                .then(|| (loads.iter().sum::<f64>() / loads.len() as f64 * 100.0).round() / 100.0);
            for (p, cell) in servers.iter().zip(cells) {
                let row = Row {
                    repack,
                    ..cell.row(p.name, rung, n, a.reps, p.peak_mib(), load)
                };
                eprintln!(
                    "  {:<12} {:>6.2} tok/s  TTFT p50 {:>8.1} ms  ITL p50 {:>7.1} ms  errors {}  peak {:?} MiB",
                    row.server,
                    row.aggregate_tok_s,
                    row.ttft_ms_p50.unwrap_or(f64::NAN),
                    row.itl_ms_p50.unwrap_or(f64::NAN),
                    row.errors,
                    row.rss_peak_mib
                );
                rows.push(row);
            }
            drop(llama);
        }
    }
    let out = json!({
        "benchmark": "serve_concurrency",
        "max_tokens": a.max_tokens,
        "reps": a.reps,
        "threads": a.threads,
        "n_ctx_total": a.n_ctx,
        "llama_server": a.llama_server.is_some(),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": load_avg(),
        "cores": std::thread::available_parallelism().map(std::num::NonZero::get).ok(),
        "wall_s": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        "method": "each server its own process, same GGUF, threads, total context and llama.cpp repack setting (Molt's choice for the rung); in each (rung, streams) cell the servers alternate round by round; greedy, one prompt per request; aggregate = tokens streamed / round wall time",
        "rows": rows,
    });
    if let Some(d) = a.out.parent() {
        std::fs::create_dir_all(d).ok();
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&out)?)
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
