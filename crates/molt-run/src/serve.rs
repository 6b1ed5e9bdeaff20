//! `molt-run serve`: the OpenAI-compatible streaming service over the ladder (see
//! `molt_server`). Flags are validated before any model loads.

use crate::common::GlobalArgs;
use crate::generate::StrategyArg;
use anyhow::{Context as _, Result, bail};
use molt::routes;
use molt::session::SessionOptions;
use molt_server::{ApiKey, BudgetRequest, Server, ServerConfig, default_trace_dirs};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// Serve options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Port to listen on (0: any free port; the address is printed at start).
    #[arg(long, default_value_t = 8088)]
    pub port: u16,
    /// Address to bind. Loopback by default; any other address needs --api-key-file,
    /// --api-key or --insecure-no-auth.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Require this key as `Authorization: Bearer KEY` on every request (the scheme's case
    /// does not matter: `bearer KEY` is taken too; the key's does). Visible in the process
    /// list: prefer --api-key-file.
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the key from this file (surrounding whitespace ignored).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Listen on a non-loopback address without a key: anyone who can reach the port can use
    /// the service.
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Without a key, also answer requests whose Host is NAME (any port), e.g. a reverse
    /// proxy's name; repeatable. By default only localhost, loopback addresses and the --host
    /// address on --port are answered, which keeps web pages out through DNS rebinding.
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_host: Vec<String>,
    /// Seconds a request's headers may take to arrive (from when the connection opened, or
    /// the previous answer on it ended); past it the connection is closed.
    #[arg(long, default_value_t = molt_server::DEFAULT_HEADER_TIMEOUT_S, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub header_timeout_s: u64,
    /// Connections served at once; while all are open, new ones wait to be accepted.
    #[arg(long, default_value_t = molt_server::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Rung to start on and never exceed (default: the largest).
    #[arg(long)]
    pub rung: Option<String>,
    /// Directory of projector files (searched before $MOLT_HOME/projectors, ./projectors and
    /// the per-user data directory).
    #[arg(long)]
    pub projectors: Option<PathBuf>,
    /// How to change rung under pressure: molt (KV transplant), reprefill, never (one request
    /// at a time: with --serial).
    #[arg(long, value_enum, default_value_t = StrategyArg::Molt)]
    pub strategy: StrategyArg,
    #[command(flatten)]
    pub refill: crate::common::RefillArgs,
    /// Budget at start: `unlimited`, `system` (cgroup limits, MemAvailable, PSI), a number of
    /// MiB, or `trace:NAME` / `trace:PATH.json`. Change it later with POST /v1/molt/budget.
    #[arg(long, default_value = "unlimited")]
    pub budget: String,
    /// Directory of budget traces looked up by name, searched before $MOLT_HOME/traces and
    /// ./traces (which are always searched).
    #[arg(long)]
    pub traces: Option<PathBuf>,
    /// Requests that may wait for the engine; one more gets 503.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Answers decoded together (continuous batching, the default): each running request is
    /// a sequence of one context on the current rung, and all advance in one decode per step.
    /// They share the context window (--n-ctx), and the budget counts every one's cache. It
    /// keeps and hibernates conversations, parks (freeing the rung) and honours the park
    /// deadline, and builds on a cache a switch projected, as the serial loop does; 1
    /// answers one request at a time (--serial).
    // The library's `molt_server::DEFAULT_PARALLEL`.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub parallel: u16,
    /// Answer one request at a time on the session loop (the one `chat` and `generate` run; it keeps and
    /// hibernates conversations, parks and honours the park deadline). Same as --parallel 1.
    #[arg(long, conflicts_with = "parallel")]
    pub serial: bool,
    /// When no rung holds every running answer, park the whole batch instead of setting the
    /// least protected answers aside (their caches to files under --state-dir) so the others
    /// go on: the behaviour before set-aside, kept for comparison (`bench --serve-aside`).
    #[arg(long)]
    pub no_set_aside: bool,
    /// Carry a parked answer that resumes on a model of another size through the switch (its
    /// cache projected, as a switch under pressure does) instead of re-reading its history
    /// there: faster, and it loses the context's facts — kept for comparison (`bench
    /// --serve-aside`).
    #[arg(long)]
    pub carry_on_resume: bool,
    /// Seconds a request may wait for memory before it fails with 503.
    #[arg(long, default_value_t = 120)]
    pub admission_timeout_s: u64,
    /// Seconds an answer may stay parked mid-answer (the budget below every rung) before it
    /// ends with finish_reason "park_deadline", its conversation kept; 0: wait indefinitely.
    #[arg(long, default_value_t = 120)]
    pub park_deadline_s: u64,
    /// max_tokens for requests that set none.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Record the raw event stream (timestamps, tokens with rungs, migration costs) to this
    /// JSON file.
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Measure the handoff divergence at each switch (one extra decode on the source rung).
    #[arg(long)]
    pub measure_seam: bool,
    /// Hold each token of an answer at least this many milliseconds after the previous one
    /// (0: as fast as the rung decodes). Makes a mid-answer switch visible on fast hardware.
    #[arg(long, default_value_t = 0)]
    pub pace_ms: u64,
    /// Where conversations displaced from the engine are hibernated (their KV cache in a state
    /// file), to be resumed later — after a restart too (default: the per-user data directory,
    /// $XDG_DATA_HOME/molt/state).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Bound on the state directory's files, MiB; past it the oldest are evicted.
    #[arg(long, default_value_t = molt::state::DEFAULT_MAX_MIB)]
    pub state_max_mib: u64,
}

/// The key from --api-key or --api-key-file.
fn api_key(a: &Args) -> Result<Option<ApiKey>> {
    let text = match (&a.api_key, &a.api_key_file) {
        (Some(k), _) => k.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("--api-key-file {}", f.display()))?
        }
        (None, None) => return Ok(None),
    };
    ApiKey::new(&text)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("API key: {e}"))
}

fn budget_request(spec: &str) -> Result<BudgetRequest> {
    let mut r = BudgetRequest::default();
    match spec {
        "unlimited" => r.unlimited = Some(true),
        "system" => r.system = Some(true),
        s if s.starts_with("trace:") => {
            let t = &s["trace:".len()..];
            if t.is_empty() {
                bail!("--budget trace: needs a trace name or path");
            }
            r.trace = Some(serde_json::Value::String(t.to_string()));
        }
        s => {
            let m: f64 = s.parse().with_context(|| {
                format!(
                    "--budget {s:?}: expected unlimited, system, a number of MiB, or trace:NAME"
                )
            })?;
            if !(m.is_finite() && m >= 1.0) {
                bail!("--budget must be at least 1 MiB");
            }
            r.mib = Some(m);
        }
    }
    Ok(r)
}

/// Makes glibc serve allocations of 64 KiB and more with their own mappings, returned to the
/// system when freed. By default glibc raises that threshold after large frees, so once a rung
/// has been unloaded the next rung's buffers come from the heap, which fragments and is kept:
/// measured on the tiny ladder, 600 answers with 1200 rung loads grew the resident set from 29
/// to ~59 MiB by default (46 MiB with `malloc_trim` after each reload), and kept it at 26 MiB
/// with this setting. The cost — a mapping per large allocation — is microseconds beside a
/// token. Set here, in the binary, because it is a process-wide policy.
fn give_freed_memory_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
    }
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    give_freed_memory_back();
    let context = g.context_config()?;
    if a.queue == 0 {
        bail!("--queue must be at least 1");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    let budget = budget_request(&a.budget)?;
    let api_key = api_key(a)?;
    if !a.host.is_loopback() && api_key.is_none() && !a.insecure_no_auth {
        bail!(
            "--host {}: refusing to serve a non-loopback address without a key; give --api-key-file (or --api-key), or --insecure-no-auth",
            a.host
        );
    }
    let mut trace_dirs = default_trace_dirs();
    if let Some(d) = &a.traces {
        if !d.is_dir() {
            bail!("--traces {}: not a directory", d.display());
        }
        trace_dirs.insert(0, d.clone());
    }
    let state_dir = match &a.state_dir {
        Some(d) => d.clone(),
        None => molt::state::default_state_dir()
            .context("no per-user data directory for state files (set HOME or XDG_DATA_HOME, or give --state-dir)")?,
    };
    // Checked before any model loads: a flag mistake should cost nothing.
    molt::state::StateDir::open(&state_dir, a.state_max_mib)?;
    let ladder = g.open_ladder()?;
    if let Some(r) = &a.rung
        && !ladder.rungs.iter().any(|x| x.name() == r)
    {
        bail!("--rung {r:?}: the ladder has no such rung");
    }
    let parallel = if a.serial { 1 } else { usize::from(a.parallel) };
    if parallel > 1 && matches!(a.strategy, StrategyArg::Never) {
        bail!(
            "--strategy never runs one request at a time: add --serial (the batched loop of --parallel {parallel} always changes rung under pressure)"
        );
    }
    let config = ServerConfig {
        addr: SocketAddr::new(a.host, a.port),
        context,
        session: SessionOptions {
            strategy: a.strategy.into(),
            projector_dirs: routes::search_dirs(a.projectors.as_deref()),
            speed: g.speed_policy(&ladder, &routes::search_dirs(a.projectors.as_deref())),
            pace_file: molt::session::pace::default_pace_file(),
            refill_chunk: a.refill.chunk,
            refill_within: a.refill.within,
            refill_pace: a.refill.pace,
            hurry: a.refill.hurry,
            park_deadline: (a.park_deadline_s > 0).then(|| Duration::from_secs(a.park_deadline_s)),
            research: molt::session::Research {
                measure_seam: a.measure_seam,
                ..molt::session::Research::default()
            },
            ..SessionOptions::default()
        },
        start_rung: a.rung.clone(),
        queue_capacity: a.queue,
        admission_timeout: Duration::from_secs(a.admission_timeout_s),
        default_max_tokens: a.max_tokens,
        budget,
        trace_dirs,
        record: a.record.clone(),
        api_key,
        insecure_no_auth: a.insecure_no_auth,
        allowed_hosts: a.allow_host.clone(),
        header_timeout: Duration::from_secs(a.header_timeout_s),
        max_connections: a.max_connections,
        token_pace: (a.pace_ms > 0).then(|| Duration::from_millis(a.pace_ms)),
        state_dir: Some(state_dir),
        state_max_mib: a.state_max_mib,
        parallel,
        set_aside: !a.no_set_aside,
        carry_on_resume: a.carry_on_resume,
        ..ServerConfig::default()
    };
    let state_dir_shown = config.state_dir.clone().unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        eprintln!("molt serve: loading {} …", ladder.name());
        let server = Server::start(ladder, config).await?;
        let st = server.engine_status();
        for r in &st.rungs {
            eprintln!(
                "  rung {:<8} resident {:>7.1} MiB, {:>6} B KV/token, {:>7.1} MiB with a full context",
                r.name, r.resident_mib, r.kv_bytes_per_token, r.full_context_mib
            );
        }
        if let Some(setup) = &st.setup {
            eprintln!("  {} runs with {setup}", st.current_rung);
        }
        let missing: Vec<_> = st.routes.iter().filter(|r| !r.ready).collect();
        if missing.is_empty() {
            eprintln!("  every migration route has a projector");
        } else {
            for r in &missing {
                eprintln!(
                    "  warning: no projector {} -> {}: a switch on that route will fail ({})",
                    r.from,
                    r.to,
                    r.problem.as_deref().unwrap_or("?")
                );
            }
        }
        eprintln!(
            "  budget: {}",
            server.budget().report().description
        );
        eprintln!("  state files: {}", state_dir_shown.display());
        // The one line a script waits for.
        println!("molt serve: listening on http://{}", server.local_addr());
        server
            .serve(async {
                let _ = tokio::signal::ctrl_c().await;
                eprintln!("molt serve: shutting down");
            })
            .await?;
        Ok::<(), anyhow::Error>(())
    })
}
