//! `molt-run bench`: the benchmark programs, JSON under `results/`.

use crate::common::GlobalArgs;
use anyhow::{Context as _, Result, bail};
use molt_bench::{RunInfo, speed};
use std::path::{Path, PathBuf};

/// Bench options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Prefill and decode tok/s of every rung, Molt beside plain llama.cpp and beside
    /// llama.cpp's own llama-bench (when built: scripts/llama-tools.sh).
    #[arg(long)]
    pub speed: bool,
    /// With --speed: llama.cpp's llama-bench program to run as the peer (default:
    /// target/llama-tools/llama-bench, built by scripts/llama-tools.sh).
    #[arg(long, env = "MOLT_LLAMA_BENCH")]
    pub peer: Option<PathBuf>,
    /// With --speed: measure micro-batches 128/256/512 with llama.cpp's CPU repack off and on,
    /// Molt beside the peer at each, with the memory each costs; the rows also go to
    /// `<projectors>/<ladder>/speed_settings.json` (--projectors, default ./projectors), where
    /// chat, generate and serve choose each rung's setting from them.
    #[arg(long)]
    pub tune: bool,
    /// Transplant against re-prefill at several context lengths, every route, both rungs warm.
    #[arg(long)]
    pub cost_sweep: bool,
    /// Per rung and context length: resident weight pages, KV, buffers and RSS, beside the
    /// policy's estimate; then park and resume (results/footprint.json).
    #[arg(long)]
    pub footprint: bool,
    /// Make the --serve-qos trace real: a child process allocates what the trace says others
    /// take, and the budget is read back from the operating system.
    #[arg(long)]
    pub real_hog: bool,
    /// The QoS bench: three conversations (a foreground chat, two background jobs) through the
    /// real HTTP service (`serve` as a child process, the scheduler's plan applied by its own
    /// loop) under a moving budget, sampled every round (results/serve_qos.json; with
    /// --real-hog, results/serve_qos_real_hog.json). `--qos` is the same bench (the in-process
    /// one it named drove a second actuator and is gone).
    #[arg(long, visible_alias = "qos")]
    pub serve_qos: bool,
    /// The budget trace of --serve-qos (its token clock counts rounds).
    #[arg(long, default_value = "traces/serve_qos.json")]
    pub serve_qos_trace: PathBuf,
    /// Length of a --serve-qos round, ms.
    #[arg(long, default_value_t = 3000)]
    pub serve_qos_round_ms: u64,
    /// `max_tokens` of every --serve-qos answer.
    #[arg(long, default_value_t = 32)]
    pub serve_qos_max_tokens: usize,
    /// The --serve-qos server's answers decoded together (`serve --parallel`; 1 answers one
    /// at a time, as `serve --serial`).
    #[arg(long, default_value_t = molt_server::DEFAULT_PARALLEL, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub serve_qos_parallel: usize,
    /// Rounds a --serve-qos conversation waits between two of its turns (8: the turns meet
    /// the trace's falls; answered together a round apart, the batched loop finishes every
    /// turn before the budget has fallen).
    #[arg(long, default_value_t = 8)]
    pub serve_qos_think_rounds: usize,
    /// A foreground answer beside a long background one when memory falls below what holds
    /// both, through the real HTTP service (two sequences), with answers set aside (the
    /// default) and with the whole batch parked (`serve --no-set-aside`): what the foreground
    /// user waits, whether the background answer comes back whole, the overshoot
    /// (results/serve_aside.json).
    #[arg(long)]
    pub serve_aside: bool,
    /// How long --serve-aside keeps the budget low, ms.
    #[arg(long, default_value_t = 20_000)]
    pub serve_aside_low_ms: u64,
    /// The device size for --real-hog, MiB (default: the trace's initial budget).
    #[arg(long, requires = "real_hog")]
    pub device_mib: Option<u64>,
    /// Context lengths of the footprint bench.
    #[arg(long, value_delimiter = ',', default_values_t = vec![0usize, 256, 1024, 2000])]
    pub footprint_lengths: Vec<usize>,
    /// Context lengths of the cost sweep.
    #[arg(long, value_delimiter = ',', default_values_t = vec![128usize, 256, 512, 1024])]
    pub lengths: Vec<usize>,
    /// Tail recompute lengths the cost sweep measures beside the plain transplant (the last N
    /// tokens re-read natively on the destination); `--tails ''` for none.
    #[arg(long, value_delimiter = ',', value_parser = parse_tail, default_values = ["8", "32"])]
    pub tails: Vec<Option<usize>>,
    /// The head re-read of the switch the cost sweep measures (a session's default; 0: the
    /// projection alone).
    #[arg(long, value_name = "N", default_value_t = molt::session::DEFAULT_HEAD_REREAD)]
    pub head_reread: usize,
    /// Other head re-read lengths the cost sweep measures beside it (0: the projection
    /// alone); `--heads ''` for none.
    #[arg(long, value_delimiter = ',', value_parser = parse_tail, default_values = ["0"])]
    pub heads: Vec<Option<usize>>,
    /// The cost sweep's contexts: `chat` (multi-turn conversations of the corpus's
    /// `chats.jsonl` rendered with the chat template, as a session holds them) or `raw`
    /// (windows of the corpus's raw text, opening mid-text).
    #[arg(long, value_enum, default_value_t = SweepContexts::Chat)]
    pub contexts: SweepContexts,
    /// Only these routes in the cost sweep, `src:dst` separated by commas (e.g.
    /// `tier0:tier2,tier1:tier2`); every ordered pair of rungs by default.
    #[arg(long, value_delimiter = ',', value_parser = parse_route)]
    pub routes: Vec<(String, String)>,
    /// Corpus for the cost sweep's contexts.
    #[arg(long, default_value = "projectors/corpus")]
    pub corpus: PathBuf,
    /// Directory of projector files (default: the search order of `molt-run chat`).
    #[arg(long)]
    pub projectors: Option<PathBuf>,
    /// Repetitions for timings.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 256)]
    pub prefill_tokens: usize,
    /// Tokens for the decode measurement.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// The stall a user sees at a switch: every route, down and up, warm and cold page cache,
    /// the destination loaded at the switch (before) and off standby (after)
    /// (results/switch_stall.json). Run it with --threads 1 on a shared machine.
    #[arg(long)]
    pub stall: bool,
    /// Context lengths of the stall bench, tokens.
    #[arg(long, value_delimiter = ',', default_values_t = vec![128usize, 1024])]
    pub stall_lengths: Vec<usize>,
    /// Setups of the stall bench: before (the destination loaded at the switch), after
    /// (standby rungs, switches up prepared in the background), warned (as after, every switch
    /// down known ahead and prepared as a shadow). The rows of results/switch_stall.json this
    /// run does not measure again are kept.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["before".to_string(), "after".to_string(), "warned".to_string()])]
    pub stall_setups: Vec<String>,
    /// Page-cache states of the stall bench: warm, cold.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["warm".to_string(), "cold".to_string()])]
    pub stall_caches: Vec<String>,
    /// The stall bench's sessions' hurried switch (as `chat --hurry`): a size switch reads the
    /// newest N positions before its first token, what it chose after it.
    #[arg(long, value_name = "N", default_value_t = molt::session::DEFAULT_HURRY)]
    pub stall_hurry: usize,
    /// The size switch's whole bill (results/switch_bill.json): in a conversation, the budget
    /// cut to the smallest rung before answer token 1, then a second question — the stall, the
    /// destination's whole work for the switch, the wait after the answer and the next
    /// prompt's first token, beside a re-prefill's and a native cache's.
    #[arg(long)]
    pub bill: bool,
    /// Context lengths of the bill bench, tokens (about).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1000usize, 4000])]
    pub bill_lengths: Vec<usize>,
    /// Output directory.
    #[arg(long, default_value = "results")]
    pub out_dir: PathBuf,
    /// The conditions benchmark: `all`, or arm ids separated by commas (A, B, C, D,
    /// D-no-sandwich, D-no-remap, D-truncate, D-no-diagonal, D-dense, D-per-head; and by id
    /// only, top-k recompute: D-topk2, D-topk4, D-topk6; tail recompute: D-tail8, D-tail32; head re-read other than the default 4: D-no-head, D-head3, D-head32; refill other than the default 64: D-refill8, D-refill32; D-no-refill runs with all).
    #[arg(long, value_name = "ARMS")]
    pub conditions: Option<String>,
    /// Prompts of the conditions benchmark (JSONL: id, kind, prompt).
    #[arg(long, default_value = "benches/prompts.jsonl")]
    pub prompts_file: PathBuf,
    /// Use only the first N prompts.
    #[arg(long)]
    pub prompts: Option<usize>,
    /// Tokens per answer in the conditions benchmark.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Generated-token indices where the trace steps down one rung (default: a quarter and
    /// five eighths into the answer).
    #[arg(long, value_delimiter = ',')]
    pub steps: Vec<usize>,
    /// Replay this trace instead of the one built from the rungs' footprints.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Skip the seam-measurement pass (handoff JSD, attention flatness).
    #[arg(long)]
    pub no_quality: bool,
    /// Summarise a family's switch into `<out-dir>/families.json` (the row of this ladder and
    /// route replaced): this recall.json of the ladder's recall run, with the answers of
    /// `--families-answers`.
    #[arg(long, value_name = "RECALL.json", requires = "families_answers")]
    pub families_recall: Option<PathBuf>,
    /// `molt-run generate --trace … --out FILE` answers on the ladder, each switching once.
    #[arg(long, value_name = "ANSWERS.jsonl", requires = "families_recall")]
    pub families_answers: Option<PathBuf>,
    /// The recall benchmark: context-QA items answered across a switch, scored by expected
    /// strings beside the native destination's recall (results/recall.json).
    #[arg(long)]
    pub recall: bool,
    /// Items of the recall benchmark (JSONL).
    #[arg(long, default_value = "benches/recall/items.jsonl")]
    pub recall_items: PathBuf,
    /// Routes of the recall benchmark, `src:dst` separated by commas.
    #[arg(long, value_delimiter = ',', value_parser = parse_route, default_values = ["tier0:tier2", "tier0:tier1"])]
    pub recall_routes: Vec<(String, String)>,
    /// Only these arms of the recall benchmark (by name, comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub recall_arms: Vec<String>,
    /// Precision routes run on every N-th item only (their destination is twice as slow).
    #[arg(long, default_value_t = 2)]
    pub recall_precision_every: usize,
    /// A smoke check: one item per context length and switch point.
    #[arg(long)]
    pub quick: bool,
    /// Recompute the rows of this recall.json from its answers with this build's defaults
    /// (nothing is re-measured), and write it back.
    #[arg(long, value_name = "FILE")]
    pub recall_resummarise: Option<PathBuf>,
    /// Run only the first N items of every context length and switch point.
    #[arg(long)]
    pub recall_sample: Option<usize>,
    /// Run only the items of these context lengths (the items' nominal lengths: 256, 512,
    /// 1024, 1800; comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub recall_lengths: Vec<usize>,
    /// Run only the items that switch at this point (`first`: before answer token 1; `mid`:
    /// mid-answer).
    #[arg(long)]
    pub recall_switch: Option<String>,
    /// On precision routes, carry the cache unchanged (the identity projector) instead of the
    /// fitted diagonal maps: how a precision rung without fitted maps is measured.
    #[arg(long)]
    pub recall_identity: bool,
    /// Summarise the answers an interrupted recall run left in its partial file (the options
    /// are this command line's) into `<out-dir>/recall.json`; nothing is re-measured.
    #[arg(long, value_name = "FILE")]
    pub recall_from_partial: Option<PathBuf>,
    /// Keep the answers of an earlier recall.json for every arm × route this run does not
    /// measure, and summarise both together (the rows then mix runs; each answer keeps its
    /// own run's cost).
    #[arg(long, value_name = "FILE")]
    pub recall_merge: Option<PathBuf>,
    /// With --recall-merge: run only what the merged file has not answered (an item on a route
    /// it has any answer for is skipped), as when items were added to the item file.
    #[arg(long, requires = "recall_merge")]
    pub recall_new: bool,
    /// The precision-rung benchmark: per rung, file size, the policy's footprint, prefill and
    /// decode speed, its own answers to the conditions prompts judged by the largest rung, and
    /// recall after a switch to it read from --precision-recall files
    /// (results/precision_rungs.json).
    #[arg(long)]
    pub precision: bool,
    /// Rungs the precision benchmark measures (comma-separated; default: every rung; the
    /// largest is always measured, as the reference).
    #[arg(long, value_delimiter = ',')]
    pub precision_rungs: Vec<String>,
    /// `bench --recall` outputs whose `tier0→<rung>` rows the precision benchmark pools.
    #[arg(long, value_delimiter = ',')]
    pub precision_recall: Vec<PathBuf>,
    /// Context length the precision benchmark reads the footprint at.
    #[arg(long, default_value_t = 1024)]
    pub precision_context: usize,
    /// Pool the --precision-recall files into this precision_rungs.json again (after a recall
    /// run finished), and write it back; nothing is re-measured.
    #[arg(long, value_name = "FILE")]
    pub precision_repool: Option<PathBuf>,
    /// The soak: switches in one process under a sawtooth budget (home rung / smallest rung),
    /// the resident set and open descriptors sampled after every answer; the ladder's row of
    /// results/soak.json is replaced.
    #[arg(long)]
    pub soak: bool,
    /// Switches the soak makes.
    #[arg(long, default_value_t = 1000)]
    pub switches: u64,
    /// The sampler's cost per token on a rung's real logits (greedy, the chat's preset, a
    /// request's top-p), beside the full-sort baseline it replaced and the rung's own decode
    /// (results/sampling.json)
    #[arg(long)]
    pub sampling: bool,
    /// The rung whose logits --sampling samples (default: the smallest, where a decode is
    /// shortest and sampling weighs most)
    #[arg(long)]
    pub sampling_rung: Option<String>,
    /// Gather results/reliability.json from the fuzz, fault and soak records and the probe list,
    /// and fail if a goal does not hold (crashes open, anything lost, RSS slope > 1 KiB/switch).
    #[arg(long)]
    pub reliability: bool,
    /// The probe list merged into results/reliability.json.
    #[arg(long, default_value = "benches/reliability/probes.json")]
    pub probes: PathBuf,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    if !a.speed
        && !a.cost_sweep
        && !a.footprint
        && !a.serve_qos
        && !a.serve_aside
        && !a.recall
        && !a.stall
        && !a.bill
        && !a.soak
        && !a.sampling
        && !a.reliability
        && !a.precision
        && a.precision_repool.is_none()
        && a.conditions.is_none()
        && a.families_recall.is_none()
    {
        bail!(
            "nothing to run: pass --conditions all, --cost-sweep, --speed, --footprint, --recall, --precision, --stall, --bill, --serve-qos, --serve-aside, --soak, --sampling and/or --reliability"
        );
    }
    if a.stall && (a.stall_lengths.is_empty() || a.stall_lengths.contains(&0)) {
        bail!("--stall-lengths must be positive");
    }
    if a.real_hog && !a.serve_qos {
        bail!("--real-hog applies to --serve-qos");
    }
    if a.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if let (Some(recall), Some(answers)) = (&a.families_recall, &a.families_answers) {
        run_families(g, a, recall, answers)?;
    }
    if a.serve_qos {
        run_serve_qos(g, a)?;
    }
    if a.serve_aside {
        run_serve_aside(g, a)?;
    }
    if a.footprint {
        run_footprint(g, a)?;
    }
    if let Some(spec) = &a.conditions {
        crate::conditions::run(g, a, spec)?;
    }
    if a.cost_sweep {
        run_cost_sweep(g, a)?;
    }
    if a.recall {
        run_recall(g, a)?;
    }
    if a.speed {
        run_speed(g, a)?;
    }
    if let Some(path) = &a.precision_repool {
        let mut doc: molt_bench::precision::PrecisionDoc =
            serde_json::from_slice(&std::fs::read(path)?)?;
        molt_bench::precision::repool(&mut doc, &a.precision_recall)?;
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("re-pooled the recall of {}", path.display());
    } else if a.precision {
        run_precision(g, a)?;
    }
    if a.stall {
        run_stall(g, a)?;
    }
    if a.bill {
        run_bill(g, a)?;
    }
    if a.soak {
        run_soak(g, a)?;
    }
    if a.sampling {
        run_sampling(g, a)?;
    }
    if a.reliability {
        run_reliability(a)?;
    }
    Ok(())
}

fn run_soak(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt_bench::reliability::{SoakOptions, record_soak, run_soak, soak_row};
    let ladder = g.open_ladder()?;
    let config = g.context_config()?;
    let start = ladder.rungs[0].name().to_string();
    let opts = molt::session::SessionOptions {
        projector_dirs: molt::routes::search_dirs(a.projectors.as_deref()),
        // The soak measures what switching leaks; the process's own growth must not be what
        // moves (or parks) the answer.
        observe_footprint: false,
        ..molt::session::SessionOptions::default()
    };
    let mut session = molt::session::Session::with_options(ladder, config, &start, opts)?;
    let soak = SoakOptions {
        switches: a.switches,
        ..SoakOptions::default()
    };
    std::fs::create_dir_all(&a.out_dir)?;
    let ladder_name = session.ladder().name().to_string();
    let samples_path = a.out_dir.join(format!("soak_samples_{ladder_name}.json"));
    // Every sample, so the shape behind a slope can be looked at (a step, a drift, noise); the
    // row and the samples so far are written every 50 answers, so a run stopped early still
    // leaves what it measured.
    let write = |row: &molt_bench::reliability::SoakRow,
                 samples: &[molt_bench::reliability::SoakSample]|
     -> Result<()> {
        record_soak(&a.out_dir.join("soak.json"), row)?;
        std::fs::write(&samples_path, serde_json::to_string(samples)?)?;
        Ok(())
    };
    let t0 = std::time::Instant::now();
    let mut so_far = Vec::new();
    let mut failed = None;
    let (row, samples) = run_soak(&mut session, &soak, &mut |s| {
        eprintln!(
            "soak: {} switches, RSS {} KiB (anonymous {} KiB), {} fds",
            s.switches, s.rss_kib, s.anon_kib, s.fds
        );
        so_far.push(*s);
        if so_far.len() % 50 == 0 {
            let row = soak_row(
                &ladder_name,
                soak.switches,
                &so_far,
                t0.elapsed().as_secs_f64(),
            );
            if let Err(e) = write(&row, &so_far) {
                failed.get_or_insert(e);
            }
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    println!("{}", serde_json::to_string_pretty(&row)?);
    write(&row, &samples)?;
    Ok(())
}

fn run_sampling(g: &GlobalArgs, a: &Args) -> Result<()> {
    let ladder = g.open_ladder()?;
    let threads = g.context_config()?.n_threads;
    let rung = match &a.sampling_rung {
        Some(name) => ladder.rung(name).ok_or_else(|| {
            anyhow::anyhow!("--sampling-rung {name}: no such rung in {}", ladder.name())
        })?,
        None => ladder
            .rungs
            .last()
            .ok_or_else(|| anyhow::anyhow!("the ladder has no rungs"))?,
    };
    eprintln!("sampling: {} ...", rung.name());
    let run = serde_json::to_value(RunInfo::now())?;
    let doc = molt_bench::sampling::measure(rung, threads, 64, a.reps, run)
        .map_err(anyhow::Error::msg)?;
    for p in &doc.presets {
        println!(
            "{:44} sampler {:7.3} ms/token, full sort {:7.3} ms/token (decode {:.1} ms/token)",
            p.preset,
            p.ms_per_token.median,
            p.full_sort_ms_per_token.median,
            doc.decode_ms_per_token
        );
    }
    write_result(&a.out_dir, "sampling.json", &doc)
}

fn run_reliability(a: &Args) -> Result<()> {
    use molt_bench::reliability::{Reliability, write_json};
    let r = Reliability::gather(&a.out_dir, &a.probes)?;
    write_json(&a.out_dir.join("reliability.json"), &r)?;
    let bad = r.check();
    eprintln!(
        "reliability: {} fuzz targets, {} faults, {} soaks, {} probes -> {}",
        r.fuzz.len(),
        r.faults.len(),
        r.soak.len(),
        r.probes.len(),
        a.out_dir.join("reliability.json").display()
    );
    if !bad.is_empty() {
        bail!("reliability goals not met: {}", bad.join("; "));
    }
    Ok(())
}

fn run_bill(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt_bench::bill::{self, BillDoc, BillOptions};
    let ladder = g.open_ladder()?;
    if ladder.rungs.len() < 2 {
        bail!("--bill needs a ladder of two rungs or more");
    }
    if a.bill_lengths.is_empty() || a.bill_lengths.contains(&0) {
        bail!("--bill-lengths must be positive");
    }
    let lengths = if a.quick {
        vec![a.bill_lengths[0]]
    } else {
        a.bill_lengths.clone()
    };
    let mut config = g.context_config()?;
    // Room for the longest context, its turns and a reserve.
    let longest = lengths.iter().copied().max().unwrap_or(0);
    config.n_ctx = config
        .n_ctx
        .max(u32::try_from(longest + 512).unwrap_or(u32::MAX));
    let opts = BillOptions {
        lengths,
        reps: if a.quick { 1 } else { a.reps },
        from: 0,
        to: ladder.rungs.len() - 1,
        max_tokens: 24,
        projector_dirs: a.projectors.iter().cloned().collect(),
    };
    let info = RunInfo::now();
    let rows = bill::run(&ladder, config, &opts, &mut |m| {
        eprintln!("bench --bill: {m}")
    })?;
    let doc = BillDoc {
        run: serde_json::to_value(&info)?,
        threads: config.n_threads,
        contention: format!(
            "a shared {}-CPU machine, load average {:.2} at the start; every decode on {} thread(s)",
            info.cpus, info.loadavg_1m, config.n_threads
        ),
        rows,
        ahead: Vec::new(),
    };
    std::fs::create_dir_all(&a.out_dir)?;
    let path = a.out_dir.join("switch_bill.json");
    std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    for r in &doc.rows {
        eprintln!(
            "{} at {} tokens: stall {:.0} ms, whole bill {:.0} ms ({:.0} positions), re-prefill \
             {:.0} ms; fill {:.0} positions in {:.0} ms ({:.2} × the prefill rate); wait after \
             the answer {:.0} ms (fill at end {:.0}); next TTFT {:.0} ms at once, {:.0} after \
             the fill, {:.0} after a re-prefill, {:.0} native; recall {:?}",
            r.route,
            r.context_tokens,
            r.stall_ms.median,
            r.whole_bill_ms.median,
            r.whole_bill_positions.median,
            r.reprefill_ms.median,
            r.fill_positions.median,
            r.fill_ms.median,
            r.fill_rate_ratio,
            r.wait_after_answer_ms.median,
            r.wait_after_answer_fill_at_end_ms.median,
            r.next_ttft_ms.median,
            r.next_ttft_after_fill_ms.median,
            r.next_ttft_reprefill_ms.median,
            r.next_ttft_native_ms.median,
            r.recall
        );
    }
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn run_stall(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt_bench::stall::{self, StallDoc, StallOptions};
    let ladder = g.open_ladder()?;
    let mut config = g.context_config()?;
    let dirs = a.projectors.iter().cloned().collect::<Vec<_>>();
    let mut opts = if a.quick {
        StallOptions::quick(dirs)
    } else {
        StallOptions::full(dirs)
    };
    if !a.quick {
        opts.lengths.clone_from(&a.stall_lengths);
        opts.reps = a.reps;
    }
    opts.hurry = a.stall_hurry;
    opts.setups = a
        .stall_setups
        .iter()
        .map(|n| match n.as_str() {
            "before" => Ok(stall::Setup::Before),
            "after" => Ok(stall::Setup::After),
            "warned" => Ok(stall::Setup::Warned),
            other => bail!("--stall-setups: unknown setup {other:?} (before, after, warned)"),
        })
        .collect::<Result<_>>()?;
    opts.caches = a
        .stall_caches
        .iter()
        .map(|n| match n.as_str() {
            "warm" => Ok(stall::CacheState::Warm),
            "cold" => Ok(stall::CacheState::Cold),
            other => bail!("--stall-caches: unknown state {other:?} (warm, cold)"),
        })
        .collect::<Result<_>>()?;
    // The rows this run does not measure again are kept from the file it rewrites.
    // Rows measured in another kind of context are not kept beside this run's.
    let earlier: Option<StallDoc> = std::fs::read_to_string(a.out_dir.join("switch_stall.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<StallDoc>(&t).ok())
        .filter(|d| d.context == stall::CONTEXT);
    let longest = opts.lengths.iter().copied().max().unwrap_or(0);
    // Room for the context and every leg's tokens, three tries each, the tokens a prepared
    // switch may wait on its source while its destination is loaded and the conversation
    // carried there in the background, and a reserve.
    let legs = molt_bench::stall::route_circuit(ladder.rungs.len()).len();
    let need = longest
        + 3 * legs * (opts.lead_tokens + 1 + opts.itl_tokens)
        + legs * stall::WAIT_ROOM_PER_LEG
        + 16;
    // And the tokens a refill after a size switch takes: its deadline and one, or without one
    // 63 cells a token net (64 re-read, one written) over a history as long as all that. (A
    // window larger than the run needs makes every context's buffers larger, and the switch
    // slower: without this rule a run needing ~6,150 cells got 7,196.)
    let refill_tokens = match molt::session::DEFAULT_REFILL_WITHIN {
        0 => need.div_ceil(molt::session::DEFAULT_REFILL_CHUNK.max(2) - 1),
        within => within + 1,
    };
    let need = need + legs * refill_tokens;
    config.n_ctx = config.n_ctx.max(u32::try_from(need).unwrap_or(u32::MAX));
    let corpus = molt::train::read_corpus(&a.corpus)?;
    let info = RunInfo::now();
    let doc_of = |by_setup: &stall::RowsBySetup, reps: usize| -> Result<StallDoc> {
        let merged = |name: &str, old: Option<&Vec<stall::StallRow>>| {
            stall::merge_rows(
                old.map_or(&[][..], Vec::as_slice),
                by_setup.get(name).map_or(&[][..], Vec::as_slice),
            )
        };
        Ok(StallDoc {
            run: serde_json::to_value(&info)?,
            threads: config.n_threads,
            n_ctx: config.n_ctx,
            contention: format!(
                "a shared {}-CPU machine, load average {:.2} at the start; every decode on {} thread(s)",
                info.cpus, info.loadavg_1m, config.n_threads
            ),
            reps,
            context: stall::CONTEXT.into(),
            rows: merged("after", earlier.as_ref().map(|d| &d.rows)),
            before_rows: merged("before", earlier.as_ref().map(|d| &d.before_rows)),
            warned_rows: merged("warned", earlier.as_ref().map(|d| &d.warned_rows)),
        })
    };
    let mut saved: Result<()> = Ok(());
    let by_setup = stall::run(
        &ladder,
        config,
        &corpus,
        &opts,
        &mut |line| eprintln!("{line}"),
        &mut |rows, reps| {
            // Each repetition's results are written as they stand, so a cut run keeps them.
            if saved.is_ok() {
                saved = doc_of(rows, reps)
                    .and_then(|d| write_result(&a.out_dir, "switch_stall.json", &d));
            }
        },
    )?;
    saved?;
    let doc = doc_of(&by_setup, opts.reps)?;
    for (setup, r) in by_setup
        .iter()
        .flat_map(|(k, rows)| rows.iter().map(move |r| (k, r)))
    {
        eprintln!(
            "{setup:>6} {:>12} {:>4} ~{:>4} {:<4} stall {:>7.1} ms [{:.1}–{:.1}]  itl {:>6.1} ms  ratio {:>5.1}  source itl {:>6.1} ms  standby {:>5.1} MiB  lost {:>7.1} ms{}",
            r.route,
            r.direction,
            r.context_tokens,
            format!("{:?}", r.cache).to_lowercase(),
            r.stall_ms.median,
            r.stall_ms.min,
            r.stall_ms.max,
            r.itl_ms_median,
            r.stall_ms.median / r.itl_ms_median,
            r.source_itl_ms_median,
            r.standby_rss_mib,
            r.lost_ms_median,
            r.refill_gap_ms_max.map_or_else(String::new, |m| format!(
                "  refill gaps {:.1} ms median, {m:.1} max",
                r.refill_gap_ms_median.unwrap_or(f64::NAN)
            )),
        );
    }
    write_result(&a.out_dir, "switch_stall.json", &doc)
}

fn run_cost_sweep(g: &GlobalArgs, a: &Args) -> Result<()> {
    let ladder = g.open_ladder()?;
    let mut config = g.context_config()?;
    let max_len = a.lengths.iter().copied().max().unwrap_or(0);
    if max_len == 0 || a.lengths.contains(&0) {
        bail!("--lengths must be positive");
    }
    config.n_ctx = config
        .n_ctx
        .max(u32::try_from(max_len + 16).unwrap_or(u32::MAX));
    let need = max_len + 1 + molt_bench::cost_sweep::SEAM;
    // The switch a session makes by default: on a size route it re-reads the tokens the
    // source attended to, which a session's rungs observe with their attention tap.
    let recompute = molt::session::SessionOptions::default().token_recompute;
    config.attention_tap |= recompute.is_some();
    let contexts = {
        let live = molt::session::LiveRung::load(&ladder.rungs[0], config)?;
        match a.contexts {
            SweepContexts::Chat => {
                let chats = molt::train::read_chats(&a.corpus)?;
                if chats.is_empty() {
                    bail!(
                        "no chats.jsonl in {}: the chat-form sweep needs one (or pass --contexts raw)",
                        a.corpus.display()
                    );
                }
                molt_bench::cost_sweep::chat_contexts(live.model(), &chats, need, a.reps)?
            }
            SweepContexts::Raw => {
                let text = molt::train::read_corpus(&a.corpus)?;
                let tokens = live.model().tokenize(&text, false)?;
                if tokens.len() < need {
                    bail!(
                        "the corpus in {} has {} tokens; the sweep needs {need}",
                        a.corpus.display(),
                        tokens.len(),
                    );
                }
                molt_bench::cost_sweep::raw_contexts(&tokens, need, a.reps)
            }
        }
    };
    let mut routes = molt::routes::Routes::new(
        &ladder,
        molt::routes::search_dirs(a.projectors.as_deref()),
        molt::routes::Variant::Auto,
    );
    for (src, dst) in &a.routes {
        for name in [src, dst] {
            if !ladder.rungs.iter().any(|r| r.name() == name) {
                bail!("--routes names {name:?}, which is not a rung of this ladder");
            }
        }
    }
    let info = RunInfo::now();
    let points = molt_bench::cost_sweep::run(
        &ladder,
        config,
        &mut routes,
        &contexts,
        &molt_bench::cost_sweep::SweepOptions {
            lengths: a.lengths.clone(),
            reps: a.reps,
            head: a.head_reread,
            recompute,
            tails: a.tails.iter().flatten().copied().collect(),
            heads: a.heads.iter().flatten().copied().collect(),
            routes: a.routes.clone(),
        },
        &mut |s| eprintln!("{s}"),
    )?;
    println!(
        "{:<14} {:>6} {:>13} {:>13} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "route",
        "ctx",
        "transplant ms",
        "reprefill ms",
        "speedup",
        "seam JSD",
        "floor",
        "ratio",
        "FLOPs av."
    );
    for p in &points {
        println!(
            "{:<14} {:>6} {:>13.1} {:>13.1} {:>7.1}x {:>9.4} {:>9.4} {:>9.2} {:>8.2}%",
            p.route,
            p.context_tokens,
            p.transplant_ms.median,
            p.reprefill_ms.median,
            p.speedup,
            p.transplant_jsd_mean,
            p.reprefill_jsd_mean,
            p.seam_mean_ratio,
            p.flops_avoided * 100.0
        );
    }
    let doc = molt_bench::cost_sweep::SweepDoc {
        run: serde_json::to_value(info)?,
        threads: config.n_threads,
        reps: a.reps,
        lengths: a.lengths.clone(),
        contexts: serde_json::to_value(a.contexts)?.as_str().map(String::from),
        head_reread: a.head_reread,
        token_recompute: recompute,
        points,
    };
    write_result(&a.out_dir, "cost_sweep.json", &doc)
}

fn run_recall(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt_bench::recall;
    if let Some(path) = &a.recall_resummarise {
        let mut doc: recall::RecallDoc = serde_json::from_slice(&std::fs::read(path)?)?;
        let (items, _) = recall::read_items(&a.recall_items)?;
        recall::resummarise(&mut doc, &items);
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("rewrote the rows of {}", path.display());
        return Ok(());
    }
    let ladder = g.open_ladder()?;
    let mut config = g.context_config()?;
    config.n_ctx = config.n_ctx.max(4096);
    let index = |name: &str| {
        ladder
            .rungs
            .iter()
            .position(|r| r.name() == name)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--recall-routes names {name:?}, which is not a rung of this ladder"
                )
            })
    };
    let mut routes = Vec::new();
    for (s, d) in &a.recall_routes {
        routes.push((index(s)?, index(d)?));
    }
    routes.sort_by_key(|r| r.0);
    let (mut items, problems) = recall::read_items(&a.recall_items)?;
    for p in &problems {
        eprintln!(
            "{}:{}: skipped: {}",
            a.recall_items.display(),
            p.line,
            p.message
        );
    }
    // The whole file: a merged document's rows are summarised over every item it answered.
    let all_items = items.clone();
    if !a.recall_lengths.is_empty() {
        items.retain(|i| a.recall_lengths.contains(&i.length));
    }
    match a.recall_switch.as_deref() {
        None => {}
        Some("first") => items.retain(|i| i.switch == recall::SwitchPoint::First),
        Some("mid") => items.retain(|i| i.switch == recall::SwitchPoint::Mid),
        Some(other) => bail!("--recall-switch {other:?}: first or mid"),
    }
    if a.quick {
        items = recall::sample(&items, 1);
    } else if let Some(n) = a.recall_sample {
        items = recall::sample(&items, n);
    }
    if items.is_empty() {
        bail!("no usable items in {}", a.recall_items.display());
    }
    let arms = recall::default_arms(&a.recall_arms);
    for n in &a.recall_arms {
        if !arms.iter().any(|x| &x.name == n) {
            bail!("--recall-arms: no arm named {n:?}");
        }
    }
    let precision_arms: Vec<_> = arms
        .iter()
        .filter(|x| {
            matches!(
                x.name.as_str(),
                "native-source" | "native-destination" | "reprefill" | "projection" | "head4"
            )
        })
        .cloned()
        .collect();
    let merged: Option<recall::RecallDoc> = match &a.recall_merge {
        Some(path) => Some(
            serde_json::from_slice(&std::fs::read(path)?)
                .map_err(|e| anyhow::anyhow!("--recall-merge {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let answered = match &merged {
        Some(old) if a.recall_new => old
            .answers
            .iter()
            .map(|x| (x.id.clone(), x.route.clone()))
            .collect(),
        _ => Default::default(),
    };
    let opts = recall::RecallOptions {
        routes,
        size_arms: arms,
        precision_arms,
        max_tokens_first: 40,
        max_tokens_mid: 80,
        mid_switch_at: 12,
        precision_every: a.recall_precision_every,
        precision_variant: if a.recall_identity {
            molt::routes::Variant::Identity
        } else {
            molt::routes::Variant::Auto
        },
        partial: Some(a.out_dir.join("recall.partial.json")),
        answered,
    };
    std::fs::create_dir_all(&a.out_dir)?;
    if let Some(path) = &a.recall_from_partial {
        let answers: Vec<recall::RecallAnswer> = serde_json::from_slice(&std::fs::read(path)?)?;
        let kinds = opts
            .routes
            .iter()
            .map(|&(s, d)| {
                (
                    format!("{}→{}", ladder.rungs[s].name(), ladder.rungs[d].name()),
                    molt::routes::route_kind(
                        &molt::routes::binding(&ladder.rungs[s]),
                        &molt::routes::binding(&ladder.rungs[d]),
                    ),
                )
            })
            .collect();
        let mut doc = recall::from_partial(
            &a.recall_items.display().to_string(),
            &items,
            answers,
            &kinds,
            opts,
        );
        // The machine that measured them is the one summarising them.
        doc.run = serde_json::to_value(RunInfo::now())?;
        return write_result(&a.out_dir, &recall_file_name(&a.recall_items, false), &doc);
    }
    let info = RunInfo::now();
    let t0 = std::time::Instant::now();
    let (rows, answers) = recall::run(
        &ladder,
        config,
        molt::routes::search_dirs(a.projectors.as_deref()),
        &items,
        &opts,
        &mut |s| eprintln!("{s}"),
    )?;
    println!(
        "{:<18} {:<12} {:>6} {:>5} {:>6} {:>7} {:>9} {:>6} {:>9} {:>10} {:>8}",
        "arm",
        "route",
        "ctx",
        "at",
        "items",
        "recall",
        "dst rec.",
        "facts",
        "dst facts",
        "cost ms",
        "reprefill"
    );
    for r in &rows {
        println!(
            "{:<18} {:<12} {:>6} {:>5} {:>6} {:>7.2} {:>9.2} {:>6.2} {:>9.2} {:>10.1} {:>8.1}{}",
            r.arm,
            r.route,
            r.context_tokens,
            format!("{:?}", r.switch_at).to_lowercase(),
            r.items,
            r.recall,
            r.destination_recall,
            r.facts,
            r.destination_facts,
            r.cost_ms.median,
            r.reprefill_ms.median,
            if r.default { "  (default)" } else { "" }
        );
    }
    let doc = recall::RecallDoc {
        items_file: a.recall_items.display().to_string(),
        n_items: items.len(),
        problems,
        options: opts,
        rows,
        answers,
        seconds: t0.elapsed().as_secs_f64(),
        run: serde_json::to_value(info)?,
    };
    let mut doc = doc;
    if let (Some(path), Some(old)) = (&a.recall_merge, merged) {
        recall::merge(&mut doc, old, &all_items);
        eprintln!(
            "merged the answers this run did not measure from {}",
            path.display()
        );
    }
    let name = recall_file_name(&a.recall_items, a.quick);
    write_result(&a.out_dir, &name, &doc)?;
    let _ = std::fs::remove_file(a.out_dir.join("recall.partial.json"));
    Ok(())
}

/// Where a recall run's document goes: `recall.json` for the shipped items
/// (`benches/recall/items.jsonl`), `recall_<stem>.json` for another item file (the summaries'
/// `recall_summaries.json`), `-quick` before the extension for a quick run.
fn recall_file_name(items: &std::path::Path, quick: bool) -> String {
    let stem = items
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("items");
    let base = if stem == "items" {
        "recall".to_string()
    } else {
        format!("recall_{stem}")
    };
    if quick {
        format!("{base}-quick.json")
    } else {
        format!("{base}.json")
    }
}

fn run_precision(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt_bench::precision;
    let ladder = g.open_ladder()?;
    let mut config = g.context_config()?;
    config.n_ctx = config
        .n_ctx
        .max(u32::try_from(a.precision_context + 64).unwrap_or(u32::MAX));
    let mut prompts = molt_bench::conditions::load_prompts(&a.prompts_file)?;
    if let Some(n) = a.prompts {
        prompts.truncate(n.max(1));
    }
    let opts = precision::PrecisionOptions {
        rungs: a.precision_rungs.clone(),
        prompts,
        answer_tokens: a.max_tokens,
        footprint_tokens: a.precision_context,
        prefill_tokens: a.prefill_tokens,
        decode_tokens: a.decode_tokens,
        threads: config.n_threads,
        recall_files: a.precision_recall.clone(),
    };
    let doc = precision::run(&ladder, config, &opts, &mut |s| eprintln!("{s}"))?;
    println!(
        "{:<8} {:<18} {:>8} {:>9} {:>8} {:>8} {:>8} {:>7} {:>6}  recall (arm: n/items, dst)",
        "rung", "type", "file MiB", "model MiB", "pf tok/s", "dc tok/s", "dc ×", "judge", "agree"
    );
    for r in &doc.rungs {
        #[allow(clippy::cast_precision_loss)]
        let mib = |b: u64| b as f64 / 1_048_576.0;
        let recall: Vec<String> = r
            .recall
            .iter()
            .map(|p| {
                format!(
                    "{}{}: {}/{} dst {:.2}",
                    p.arm,
                    if p.default { "*" } else { "" },
                    p.recalled,
                    p.items,
                    p.destination_recall
                )
            })
            .collect();
        println!(
            "{:<8} {:<18} {:>8.1} {:>9.1} {:>8.1} {:>8.2} {:>8.2} {:>7} {:>6.2}  {}",
            r.rung,
            r.file_type,
            mib(r.file_bytes),
            mib(r.modelled_bytes),
            r.prefill_tps,
            r.decode_tps,
            r.decode_vs_largest,
            r.judge_ppl
                .map_or_else(|| "-".into(), |p| format!("{p:.3}")),
            r.agreement,
            recall.join("; ")
        );
    }
    write_result(&a.out_dir, "precision_rungs.json", &doc)
}

fn run_speed(g: &GlobalArgs, a: &Args) -> Result<()> {
    let ladder = g.open_ladder()?;
    let threads = g.context_config()?.n_threads;
    std::fs::create_dir_all(&a.out_dir)?;
    let info = RunInfo::now();
    let opts = speed::SpeedOptions {
        prefill_tokens: a.prefill_tokens,
        decode_tokens: a.decode_tokens,
        reps: a.reps,
        threads,
    };
    let mut rows = Vec::new();
    for r in &ladder.rungs {
        eprintln!("speed: {} ...", r.name());
        let s = speed::measure(r, &opts).map_err(anyhow::Error::msg)?;
        println!(
            "{:6} prefill {:6.1} tok/s (llama.cpp {:6.1}, ratio {:.3})  decode {:5.1} tok/s (llama.cpp {:5.1}, ratio {:.3})",
            s.rung,
            s.molt_prefill_tps.median,
            s.llama_prefill_tps.median,
            s.prefill_ratio,
            s.molt_decode_tps.median,
            s.llama_decode_tps.median,
            s.decode_ratio
        );
        rows.push(s);
    }
    let bin = a
        .peer
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/llama-tools/llama-bench"));
    let peer = speed::Peer::at(&bin);
    if a.peer.is_some() && peer.is_none() {
        bail!("--peer {}: no such program", bin.display());
    }
    let settings = if a.tune {
        speed::Setting::grid()
    } else {
        vec![speed::Setting::molt_default()]
    };
    let (mut peer_name, mut tuning) = (None, Vec::new());
    match &peer {
        None => eprintln!(
            "speed: no peer ({} is absent; scripts/llama-tools.sh builds it)",
            bin.display()
        ),
        Some(peer) => {
            for r in &ladder.rungs {
                let (rows, name) = speed::measure_peer(r, peer, &settings, &opts, &mut |p| {
                    println!(
                        "{:6} ubatch {:3} repack {:3}  prefill {:6.1} tok/s (llama-bench {:6.1}, ratio {:.3})  decode {:5.1} tok/s (llama-bench {:5.1}, ratio {:.3})  context {:.0} MiB, load {:.0} MiB",
                        p.rung,
                        p.n_ubatch,
                        if p.repack { "on" } else { "off" },
                        p.prefill_tok_s,
                        p.peer_prefill_tok_s,
                        p.prefill_ratio,
                        p.decode_tok_s,
                        p.peer_decode_tok_s,
                        p.decode_ratio,
                        p.reserved_mib,
                        p.load_anon_mib
                    );
                })
                .map_err(anyhow::Error::msg)?;
                peer_name = Some(name);
                tuning.extend(rows);
            }
        }
    }
    // The measured trade, bound to the rungs' files, for the speed policy of later sessions
    // (`molt::speed`): beside the projectors, where `chat`, `generate` and `serve` look.
    if a.tune && !tuning.is_empty() {
        let dir = a
            .projectors
            .clone()
            .unwrap_or_else(|| PathBuf::from("projectors"));
        let path = molt::speed::SpeedFile::of(&ladder, threads, &tuning).save(&dir)?;
        eprintln!("speed: measured settings written to {}", path.display());
    }
    let default = speed::Setting::molt_default();
    let doc = speed::SpeedDoc {
        run: serde_json::to_value(info)?,
        threads,
        prefill_tokens: a.prefill_tokens,
        decode_tokens: a.decode_tokens,
        reps: a.reps,
        rungs: rows,
        peer: peer_name,
        rows: tuning
            .iter()
            .filter(|r| r.n_ubatch == default.n_ubatch && r.repack == default.repack)
            .cloned()
            .collect(),
        tuning: if a.tune { tuning } else { Vec::new() },
    };
    write_result(&a.out_dir, "speed.json", &doc)
}

fn run_footprint(g: &GlobalArgs, a: &Args) -> Result<()> {
    let ladder = g.open_ladder()?;
    let config = g.context_config()?;
    let max_len = a.footprint_lengths.iter().copied().max().unwrap_or(0);
    if max_len + 2 > config.n_ctx as usize {
        bail!(
            "--footprint-lengths up to {max_len} do not fit --n-ctx {}",
            config.n_ctx
        );
    }
    let text = molt::train::read_corpus(&a.corpus)?;
    let tokens = {
        let m = molt::engine::Model::load(
            &ladder.rungs[0].path,
            ladder.rungs[0].name(),
            molt::engine::ModelOptions::default(),
        )?;
        let mut t = m.tokenize(&text, false)?;
        while t.len() < max_len + 2 && !t.is_empty() {
            let again = t.clone();
            t.extend(again);
        }
        t
    };
    let info = RunInfo::now();
    let rungs = molt_bench::footprint::run(
        &ladder,
        config,
        &tokens,
        &molt_bench::footprint::FootprintOptions {
            lengths: a.footprint_lengths.clone(),
        },
        &mut |s| eprintln!("{s}"),
    )?;
    let mib = |b: u64| b as f64 / 1_048_576.0;
    println!(
        "{:<6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "rung", "ctx", "mapped", "anon", "KV state", "measured", "RSS delta", "modelled", "mod/RSS"
    );
    for r in &rungs {
        for p in &r.points {
            println!(
                "{:<6} {:>6} {:>8.1}M {:>8.1}M {:>8.1}M {:>8.1}M {:>9.1}M {:>9.1}M {:>8.3}",
                r.rung,
                p.context_tokens,
                mib(p.weights_mapped_resident),
                mib(p.anon_bytes),
                mib(p.kv_state_bytes),
                mib(p.measured_bytes),
                mib(p.rss_delta_bytes),
                mib(p.modelled_bytes),
                p.modelled_over_rss_delta
            );
        }
        let k = &r.park;
        println!(
            "{:<6} park at {} tokens: RSS {:.1}M -> {:.1}M (fell {:.1}M; weights resident {:.1}M), parked KV {:.1}M, park {:.0} ms, resume {:.0} ms, max |dlogit| {}",
            r.rung,
            k.context_tokens,
            mib(k.rss_before),
            mib(k.rss_parked),
            mib(k.rss_fall),
            mib(k.weights_resident_before),
            mib(k.parked_kv_bytes),
            k.park_ms,
            k.resume_ms,
            k.max_abs_logit_delta
        );
    }
    let doc = serde_json::json!({
        "run": info,
        "n_ctx": config.n_ctx,
        "n_batch": config.n_batch,
        "threads": config.n_threads,
        "cache_type": config.cache_type,
        "rungs": rungs,
    });
    write_result(&a.out_dir, "footprint.json", &doc)
}

/// The global options a served bench's child gets: the same ladder, models, context and
/// threads as this command.
fn child_global_args(g: &GlobalArgs) -> Vec<String> {
    let mut global_args = vec!["--ladder".to_string(), g.ladder.clone()];
    if let Some(d) = &g.models_dir {
        global_args.push("--models-dir".into());
        global_args.push(d.display().to_string());
    }
    global_args.push("--n-ctx".into());
    global_args.push(g.n_ctx.to_string());
    if let Some(t) = g.threads {
        global_args.push("--threads".into());
        global_args.push(t.to_string());
    }
    if let Some(u) = g.ubatch {
        global_args.push("--ubatch".into());
        global_args.push(u.to_string());
    }
    global_args
}

fn run_serve_aside(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt_bench::serve_aside::{ServeAsideOptions, run, standard_facts, standard_messages};
    let (foreground, background) = standard_messages();
    let opts = ServeAsideOptions {
        program: std::env::current_exe()?,
        global_args: child_global_args(g),
        work_dir: std::env::temp_dir().join(format!("molt-serve-aside-{}", std::process::id())),
        foreground,
        background,
        facts: standard_facts(),
        fg_max_tokens: 80,
        bg_max_tokens: 240,
        low_ms: a.serve_aside_low_ms,
        settle_ms: 2_000,
    };
    let info = RunInfo::now();
    let report = run(&opts, &mut |s| eprintln!("{s}"))?;
    let _ = std::fs::remove_dir_all(&opts.work_dir);
    let mut doc = serde_json::to_value(&report)?;
    if let serde_json::Value::Object(m) = &mut doc {
        m.insert("run".into(), serde_json::to_value(info)?);
        m.insert("n_ctx".into(), serde_json::json!(g.n_ctx));
        m.insert("threads".into(), serde_json::json!(g.threads));
    }
    write_result(&a.out_dir, "serve_aside.json", &doc)
}

fn run_serve_qos(g: &GlobalArgs, a: &Args) -> Result<()> {
    use molt::pressure::Trace;
    use molt_bench::serve_qos::{ServeQosOptions, run, standard_conversations};
    let trace = Trace::load(&a.serve_qos_trace)?;
    let last_step = trace.steps.last().map_or(0, |s| s.at);
    let global_args = child_global_args(g);
    let name = if a.real_hog {
        "serve_qos_real_hog"
    } else {
        "serve_qos"
    };
    let opts = ServeQosOptions {
        program: std::env::current_exe()?,
        global_args,
        conversations: standard_conversations(),
        max_tokens: a.serve_qos_max_tokens,
        round_ms: a.serve_qos_round_ms,
        think_rounds: a.serve_qos_think_rounds,
        min_rounds: usize::try_from(last_step)
            .unwrap_or(usize::MAX)
            .saturating_add(2),
        max_rounds: 400,
        work_dir: std::env::temp_dir().join(format!("molt-{name}-{}", std::process::id())),
        parallel: a.serve_qos_parallel,
    };
    let trace_name = a
        .serve_qos_trace
        .file_name()
        .map(|n| n.to_string_lossy().to_string());
    let mut budget = trace_or_hog(trace, a)?;
    eprintln!("serve-qos: budget from {}", budget.describe());
    let info = RunInfo::now();
    let report = run(&opts, budget.as_mut(), &mut |s| eprintln!("{s}"))?;
    let _ = std::fs::remove_dir_all(&opts.work_dir);
    for c in &report.conversations {
        println!(
            "{:<8} {:<10} prio {:>2}: {} of {} turns, recalled {:<5} {}",
            c.spec.id,
            c.spec.class,
            c.spec.priority,
            c.turns.len(),
            c.spec.turns.len(),
            c.recalled,
            c.turns
                .last()
                .map_or(String::new(), |t| format!("{:?}", t.answer))
        );
    }
    let mib = |b: i64| b as f64 / 1_048_576.0;
    println!(
        "rounds {}, max overshoot: measured {:.1} MiB (resident set above the {:.1} MiB floor), modelled {:.1} MiB, raw resident set {:.1} MiB; killed {}, lost {}, hibernated {}, resumed {}, released {}, recalled {} of {}; {:.0} s",
        report.rounds.len(),
        mib(report.max_overshoot_measured_bytes),
        mib(i64::try_from(report.floor_rss_bytes).unwrap_or(i64::MAX)),
        mib(report.max_overshoot_modelled_bytes),
        mib(report.max_overshoot_rss_bytes),
        report.killed,
        report.lost_conversations,
        report.hibernated,
        report.resumed,
        report.released,
        report.recalled,
        report.conversations.len(),
        report.wall_s
    );
    let doc = molt_bench::serve_qos::ServeQosDoc {
        run: serde_json::to_value(info)?,
        trace: trace_name,
        real_hog: a.real_hog,
        n_ctx: g.n_ctx,
        threads: g.threads,
        max_tokens: a.serve_qos_max_tokens,
        report,
    };
    write_result(&a.out_dir, &format!("{name}.json"), &doc)
}

/// One `--tails` item: a token count, or nothing (`--tails ''` measures no tail).
/// Writes a benchmark's JSON document as `dir/name` (creating `dir`) and says so.
/// One row of `<out-dir>/families.json` from a recall run and generate answers on the ladder.
fn run_families(g: &GlobalArgs, a: &Args, recall: &Path, answers: &Path) -> Result<()> {
    let ladder = g.open_ladder()?;
    let family = ladder.rungs[0].facts.architecture.clone();
    let recall_doc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(recall).with_context(|| format!("reading {}", recall.display()))?,
    )
    .with_context(|| format!("{} is not JSON", recall.display()))?;
    let text = std::fs::read_to_string(answers)
        .with_context(|| format!("reading {}", answers.display()))?;
    let row = molt_bench::families::row(&family, ladder.name(), &recall_doc, &text)?;
    let path = a.out_dir.join("families.json");
    let mut doc: molt_bench::families::FamiliesDoc = match std::fs::read(&path) {
        Ok(b) => {
            serde_json::from_slice(&b).with_context(|| format!("reading {}", path.display()))?
        }
        Err(_) => molt_bench::families::FamiliesDoc::default(),
    };
    println!(
        "{} {} {} {}{}: recall {:.2} (destination {:.2}, {} items), stall {:.1} ms median, {:.1} ms/token",
        row.family,
        row.ladder,
        row.route,
        row.method,
        row.carry
            .as_deref()
            .map_or_else(String::new, |c| format!(" ({c})")),
        row.recall,
        row.destination_recall,
        row.items,
        row.stall_ms.median,
        row.itl_ms_median
    );
    molt_bench::families::merge(&mut doc, row);
    doc.run = Some(serde_json::to_value(RunInfo::now())?);
    write_result(&a.out_dir, "families.json", &doc)
}

fn write_result(dir: &Path, name: &str, doc: &impl serde::Serialize) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(doc)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn parse_tail(s: &str) -> Result<Option<usize>, String> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.trim()
        .parse()
        .map(Some)
        .map_err(|e| format!("{s:?} is not a token count: {e}"))
}

/// One `--routes` item: `src:dst`, two rung names.
fn parse_route(s: &str) -> Result<(String, String), String> {
    match s.trim().split_once(':') {
        Some((a, b)) if !a.trim().is_empty() && !b.trim().is_empty() && a.trim() != b.trim() => {
            Ok((a.trim().to_string(), b.trim().to_string()))
        }
        _ => Err(format!(
            "{s:?} is not a route: write two different rung names as src:dst"
        )),
    }
}

/// Where the cost sweep's contexts come from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SweepContexts {
    /// Multi-turn conversations rendered with the chat template.
    Chat,
    /// Windows of the raw corpus text.
    Raw,
}

/// A bench's budget: `trace` replayed as numbers, or made real by the memory hog with
/// `--real-hog` (the device size `--device-mib`).
fn trace_or_hog(
    trace: molt::pressure::Trace,
    a: &Args,
) -> Result<Box<dyn molt::pressure::BudgetSource>> {
    Ok(if a.real_hog {
        Box::new(crate::hog::spawn_budget(
            trace,
            a.device_mib.map(|m| m << 20),
        )?)
    } else {
        Box::new(molt::pressure::TraceBudget::new(trace))
    })
}
