//! `molt-run generate`: one prompt (`--prompt`) or a prompt file (`--prompt-file`: plain lines
//! or JSONL), JSONL results out. A bad line is reported with its number and the rest still run.

use crate::common::{self, GlobalArgs};
use anyhow::{Context as _, Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use molt::pressure::TraceBudget;
use molt::routes;
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions, Strategy};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

/// Generate options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt (a user turn, rendered with the model's chat template).
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    pub prompt: Option<String>,
    /// A file of prompts: one per line, or JSONL objects `{"prompt": "...", "max_tokens": N}`.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Rung to start on (default: the largest).
    #[arg(long)]
    pub rung: Option<String>,
    /// Maximum tokens per answer.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Replay a memory-budget trace (JSON, see traces/) during every answer; the session
    /// moves between rungs as the budget demands.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Make the trace real: a child process allocates and touches what the trace says the
    /// rest of the device takes, and the budget is read back from the operating system
    /// (min(device − the child's RSS, cgroup/MemAvailable)).
    #[arg(long, requires = "trace")]
    pub real_hog: bool,
    /// The device size for --real-hog, MiB (default: the trace's initial budget).
    #[arg(long, requires = "real_hog")]
    pub device_mib: Option<u64>,
    /// How to change rung under pressure: molt (KV transplant), reprefill, never.
    #[arg(long, value_enum, default_value_t = StrategyArg::Molt)]
    pub strategy: StrategyArg,
    /// Directory of projector files (searched before $MOLT_HOME/projectors, ./projectors and
    /// the per-user data directory).
    #[arg(long)]
    pub projectors: Option<PathBuf>,
    /// Selective top-k recompute (off by default): at a molt switch, compute the destination's
    /// last K blocks natively from the source's mapped boundary hidden state instead of
    /// projecting their K/V. Needs hidden maps from `train-projectors --topk K`.
    #[arg(long, value_name = "K")]
    pub topk_recompute: Option<usize>,
    /// Tail recompute (0, off, by default): at a molt switch, re-read the last N tokens
    /// natively on the destination instead of keeping their projected cache.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub tail_recompute: usize,
    /// Head re-read: at a molt switch, the first N tokens of the history get the
    /// destination's own K/V instead of projected ones (the attention sink and the chat
    /// template's opening): spliced from the destination's shipped anchor where it covers
    /// them, decoded otherwise. 0 turns it off.
    #[arg(long, value_name = "N", default_value_t = molt::session::DEFAULT_HEAD_REREAD)]
    pub head_reread: usize,
    /// Selective token recompute at a size-route switch: the share of the cached positions the
    /// destination re-reads natively, chosen by the source's attention from the prompt's last
    /// tokens (the question), each bringing its whole sentence, the question itself always;
    /// projected cells a later prompt looks at are re-read before it is answered (see
    /// `--recompute-unit` and `--recompute-floor`). 0 turns it off (the projection alone keeps the text fluent and loses the
    /// context's facts: see the recall benchmark).
    #[arg(long, value_name = "FRACTION", default_value_t = molt::transplant::select::TokenRecompute::default_size().fraction)]
    pub token_recompute: f64,
    /// How selective token recompute chooses: attention (default) or random (the control).
    #[arg(long, value_name = "RULE", default_value = "attention")]
    pub recompute_rule: molt::transplant::select::SelectRule,
    /// What a chosen position brings with it: its whole sentence (`sentence`) or itself with
    /// its neighbours (`position`).
    #[arg(long, value_name = "UNIT", default_value = molt::transplant::select::TokenRecompute::default_size().unit.name())]
    pub recompute_unit: molt::transplant::select::Unit,
    /// At least this many positions are re-read at a size switch, whatever the share gives
    /// (a short context's fact sentence is as long as a long context's).
    #[arg(long, value_name = "N", default_value_t = molt::transplant::select::TokenRecompute::default_size().min_positions)]
    pub recompute_floor: usize,
    /// What a size switch leaves at the positions it does not re-read: nothing (`left-out`,
    /// the default: the destination reads only the head, the chosen sentences and the
    /// question, the refill reads the rest behind the answer, and what it has not reached
    /// when the answer ends is read then) or the source's cells projected (`projected`).
    #[arg(long, value_name = "REST", default_value = "left-out")]
    pub switch_rest: molt::transplant::select::Rest,
    #[command(flatten)]
    pub refill: crate::common::RefillArgs,
    /// Write JSONL results here instead of stdout (text is then streamed to stdout).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The `--token-recompute` setting: off at 0, else the default's shape at that share with the
/// rule, unit and floor given.
fn token_recompute(a: &Args) -> Result<Option<molt::transplant::select::TokenRecompute>> {
    let fraction = a.token_recompute;
    if !(0.0..=1.0).contains(&fraction) {
        anyhow::bail!("--token-recompute {fraction} is not a share between 0 and 1");
    }
    Ok(
        (fraction > 0.0).then(|| molt::transplant::select::TokenRecompute {
            fraction,
            rule: a.recompute_rule,
            unit: a.recompute_unit,
            min_positions: a.recompute_floor,
            rest: a.switch_rest,
            ..molt::transplant::select::TokenRecompute::default_size()
        }),
    )
}

/// `--strategy` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum StrategyArg {
    /// Project the KV cache onto the new rung between two tokens.
    Molt,
    /// Re-read prompt and answer on the new rung.
    Reprefill,
    /// Never switch (killed when the budget falls below the rung).
    Never,
}

impl From<StrategyArg> for Strategy {
    fn from(s: StrategyArg) -> Self {
        match s {
            StrategyArg::Molt => Strategy::Molt,
            StrategyArg::Reprefill => Strategy::Reprefill,
            StrategyArg::Never => Strategy::Never,
        }
    }
}

use molt::session::prompt_file::PromptItem as Item;

/// Bad lines of a prompt file: line number and why.
type BadLines = Vec<(usize, String)>;

fn read_prompts(path: &PathBuf) -> Result<(Vec<Item>, BadLines)> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading prompt file {}", path.display()))?;
    let file = molt::session::prompt_file::parse(&bytes);
    Ok((
        file.items,
        file.bad.into_iter().map(|b| (b.line, b.why)).collect(),
    ))
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    let config = g.context_config()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.topk_recompute == Some(0) {
        bail!("--topk-recompute must be at least 1 (leave it out to project every layer)");
    }
    let sampling = common::sampling(a.temperature, a.top_p, a.seed)?;
    let (items, bad) = match (&a.prompt, &a.prompt_file) {
        (Some(p), None) => (
            vec![Item {
                line: 0,
                id: serde_json::json!(0),
                prompt: p.clone(),
                max_tokens: None,
            }],
            vec![],
        ),
        (None, Some(f)) => read_prompts(f)?,
        _ => bail!("give exactly one of --prompt or --prompt-file"),
    };
    for (line, why) in &bad {
        eprintln!("molt-run: prompt file line {line}: {why} (skipped)");
    }
    if let Some(t) = &a.trace {
        // A bad trace fails before any model file is opened or loaded.
        let loc = g.locate(false)?;
        let manifest = molt::ladder::Manifest::load(&loc.manifest)?;
        let names: Vec<String> = manifest.rungs.iter().map(|r| r.name.clone()).collect();
        common::check_trace(t, &names)?;
    }
    let ladder = g.open_ladder()?;
    let names = ladder.names();
    if let Some(t) = &a.trace {
        common::check_trace(t, &names)?;
    }
    let start = a.rung.clone().unwrap_or_else(|| names[0].clone());
    let opts = SessionOptions {
        strategy: a.strategy.into(),
        projector_dirs: routes::search_dirs(a.projectors.as_deref()),
        speed: g.speed_policy(&ladder, &routes::search_dirs(a.projectors.as_deref())),
        pace_file: molt::session::pace::default_pace_file(),
        head_reread: a.head_reread,
        refill_chunk: a.refill.chunk,
        refill_within: a.refill.within,
        refill_pace: a.refill.pace,
        hurry: a.refill.hurry,
        token_recompute: token_recompute(a)?,
        research: molt::session::Research {
            topk_recompute: a.topk_recompute,
            tail_recompute: a.tail_recompute,
            ..molt::session::Research::default()
        },
        ..SessionOptions::default()
    };
    let mut session = Session::with_options(ladder, config, &start, opts)?;
    if let Some(n) = session.pace_note() {
        eprintln!("molt-run: {n}");
    }
    if a.trace.is_some() {
        // Under a trace the policy decides, and relative traces refer to footprints: measure.
        common::measure_rungs(&mut session)?;
    }
    let trace = match &a.trace {
        Some(p) => Some(common::load_trace(
            p,
            &names,
            &session.rung_costs(),
            config.n_ctx,
        )?),
        None => None,
    };
    let home = session.current_index();
    // The home rung was loaded before the budget was known. Under a replayed trace the budget
    // every answer starts under is known now: the speed policy chooses the rung's setup under
    // it here, before the first prompt is read, as `chat` does — not inside the first answer,
    // where a reload (1.2 s for tier0 repacked) was the most of its time to first token. (A
    // `--real-hog` budget is the system's once the hog runs: the first answer retunes then.)
    if let Some(t) = trace.as_ref().filter(|_| !a.real_hog) {
        let b0 = molt::pressure::BudgetSource::budget(
            &mut TraceBudget::new(t.clone()),
            molt::pressure::Tick::default(),
        )?;
        session.retune_with(b0.bytes)?;
    }
    if let Some(setup) = session.rung_setup(home) {
        eprintln!("molt-run: {start}: {setup}");
    }
    let raw = a.raw
        || session
            .rung_mut(home)
            .and_then(|r| r.model().chat_template())
            .is_none();
    if raw && !a.raw {
        eprintln!("molt-run: {start} ships no chat template; prompts are sent as raw text");
    }
    let mut out: Box<dyn Write> = match &a.out {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    for (line, why) in &bad {
        writeln!(
            out,
            "{}",
            serde_json::json!({ "id": line, "line": line, "error": why })
        )?;
    }
    let stream_text = a.out.is_some();
    let bar = progress_bar(items.len());
    let mut failures = bad.len();
    for item in &items {
        // Each prompt is its own run: back on the home rung, the trace from its start.
        session.reset_home()?;
        if let Some(t) = &trace {
            if a.real_hog {
                let hog = crate::hog::spawn_budget(t.clone(), a.device_mib.map(|m| m << 20))?;
                eprintln!("molt-run: {}", molt::pressure::BudgetSource::describe(&hog));
                session.set_budget_source(Some(Box::new(hog)));
            } else {
                session.set_budget_source(Some(Box::new(TraceBudget::new(t.clone()))));
            }
        }
        let opts = GenerateOptions {
            max_tokens: item.max_tokens.unwrap_or(a.max_tokens),
            sampling,
            force_switch: None,
        };
        let prompt = if raw {
            Prompt::Text(item.prompt.clone())
        } else {
            Prompt::User(item.prompt.clone())
        };
        // While the bar is drawn, an answer's text is printed whole when it ends (streaming it
        // would tear the bar); without a bar it streams token by token.
        let mut held = String::new();
        let mut per_rung: Vec<(String, usize)> = Vec::new();
        let mut footprints = Vec::new();
        let mut sink = |e: &Event| {
            let piece = match e {
                Event::Footprint(f) => {
                    footprints.push(f.clone());
                    return;
                }
                Event::Lever(l) => format!("\n{}\n", common::lever_line(l)),
                Event::Prepare(p) => format!("\n{}\n", common::prepare_line(p)),
                Event::Token { text, rung, .. } => {
                    match per_rung.last_mut() {
                        Some((r, n)) if r == rung => *n += 1,
                        _ => per_rung.push((rung.clone(), 1)),
                    }
                    let n: usize = per_rung.iter().map(|(_, n)| n).sum();
                    bar.set_message(format!("{}: {rung}, {n} tokens", item.id));
                    text.clone()
                }
                Event::Switch(s) => format!(
                    "\n⇆ {} → {} ({}, {:.0} ms, pressure {:.2}){}{}\n",
                    s.from,
                    s.to,
                    s.method,
                    s.timings.cost_ms,
                    s.pressure,
                    common::background_part(s),
                    s.setup.map(|u| format!(" · {u}")).unwrap_or_default()
                ),
                _ => return,
            };
            if !stream_text {
                return;
            }
            if bar.is_hidden() {
                print!("{piece}");
                let _ = std::io::stdout().flush();
            } else {
                held.push_str(&piece);
            }
        };
        let result = session.generate(&prompt, &opts, &mut sink);
        if stream_text {
            if bar.is_hidden() {
                println!();
            } else {
                bar.suspend(|| println!("{held}"));
            }
        }
        bar.inc(1);
        match result {
            Ok(gen_) => {
                let rung_tokens: Vec<_> = per_rung
                    .iter()
                    .map(|(r, n)| serde_json::json!({ "rung": r, "tokens": n }))
                    .collect();
                let row = serde_json::json!({
                    "id": item.id,
                    "line": item.line,
                    "prompt": item.prompt,
                    "text": gen_.text,
                    "tokens": gen_.tokens.len(),
                    "prompt_tokens": gen_.prompt_tokens,
                    "rungs_used": gen_.rungs_used,
                    "rung_tokens": rung_tokens,
                    "switches": gen_.switches,
                    "ttft_ms": gen_.ttft_ms,
                    "total_ms": gen_.total_ms,
                    "tokens_per_s": gen_.tokens_per_s(),
                    "stop": gen_.stop,
                    "budget": session.budget_description(),
                    "killed": gen_.killed,
                    "lost_tokens": gen_.lost_tokens,
                    "levers": gen_.levers,
                    "stall_ms": gen_.stall_ms,
                    "footprints": footprints,
                });
                writeln!(out, "{row}")?;
                out.flush()?;
            }
            Err(e) => {
                failures += 1;
                bar.suspend(|| {
                    eprintln!("molt-run: prompt {} (line {}): {e}", item.id, item.line);
                });
                writeln!(
                    out,
                    "{}",
                    serde_json::json!({ "id": item.id, "line": item.line, "error": e.to_string() })
                )?;
            }
        }
    }
    bar.finish_and_clear();
    if failures > 0 && failures == items.len() + bad.len() {
        bail!("every prompt failed");
    }
    Ok(())
}

/// A bar over the prompts on stderr, drawn only when stderr is a terminal.
fn progress_bar(len: usize) -> ProgressBar {
    if len < 2 || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:30.cyan/blue} {pos}/{len} prompts · {msg} · {elapsed_precise} (eta {eta})",
    ) {
        bar.set_style(style.progress_chars("█▉▊▋▌▍▎▏ "));
    }
    bar
}
