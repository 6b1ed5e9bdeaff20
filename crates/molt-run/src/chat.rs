//! `molt-run chat`: a conversation in the terminal that survives memory pressure.
//!
//! The budget follows the real machine (cgroup limits, `MemAvailable`, PSI, minus a reserve) or
//! replays a trace (`--trace`); `/budget 900` caps it from the keyboard, also in the middle of an
//! answer. Every token is drawn in the colour of the rung that produced it and every switch gets
//! a line of its own. Generation runs on a worker thread ([`worker`]) so the main thread can keep
//! drawing and reading commands; Ctrl-C stops the answer, not the program.
//!
//! Modules: [`budget`] (the system-or-trace budget under a typed cap), [`input`] (rustyline
//! between answers, polled stdin during them, SIGINT as a flag), [`render`] (colours, switch
//! lines, summaries) and [`worker`] (the thread that owns the session).

mod budget;
mod input;
mod render;
mod worker;

use crate::common::{self, GlobalArgs};
use crate::generate::StrategyArg;
use anyhow::{Context as _, Result, bail};
use budget::{BudgetControl, fmt_bytes, parse_size};
use input::{Input, Line};
use molt::pressure::{
    BudgetSource, MIB, SystemBudget, TraceBudget, file_resident_in_page_cache,
    process_anon_rss_bytes, process_rss_bytes, resident_bytes_of_mapping,
};
use molt::routes;
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions, Strategy};
use molt::shipped;
use render::Renderer;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::Duration;
use worker::{Job, Report, Snapshot};

/// The prompt shown before each message.
const PROMPT: &str = "› ";

/// Chat options.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Commands while chatting (also mid-answer; they act before the next token):
  /budget SIZE     cap the budget: MiB (900) or with a unit (1.5G, 800M, 512K)
  /budget RUNG     cap it 5 % above what RUNG needs for a full context window
  /budget off      lift the cap (back to the system budget or the trace)
  /trace FILE|off  replay a trace in every answer from now on / follow the system again
  /status          rungs mapped or not, resident weights and page cache, footprint vs budget
  /reset           forget the conversation (the rungs stay mapped)
  /quit            leave (also Ctrl-D); Ctrl-C stops the answer being generated")]
pub struct Args {
    /// Replay this memory-budget trace (JSON, see traces/) in every answer instead of following
    /// the real system; its clock restarts with each answer.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Start with the budget capped, as if `/budget SIZE|RUNG` had been typed.
    #[arg(long, value_name = "SIZE|RUNG")]
    pub budget: Option<String>,
    /// MiB the system budget leaves to everything else (allocator slack, other apps' growth).
    #[arg(long, value_name = "MiB", default_value_t = 256)]
    pub reserve: u64,
    /// Rung to start on, and the largest the chat may use (default: the largest).
    #[arg(long)]
    pub rung: Option<String>,
    /// Maximum tokens per answer.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Sampling seed (the n-th answer uses seed + n).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How to change rung under pressure: molt (KV transplant), reprefill, never.
    #[arg(long, value_enum, default_value_t = StrategyArg::Molt)]
    pub strategy: StrategyArg,
    #[command(flatten)]
    pub refill: crate::common::RefillArgs,
    /// Directory of projector files, searched first (then $MOLT_HOME/projectors, ./projectors,
    /// the per-user data directory, and the projectors built into molt-run).
    #[arg(long, value_name = "DIR")]
    pub projectors: Option<PathBuf>,
    /// Send messages as raw text, without the chat template (automatic when the model has none).
    #[arg(long)]
    pub raw: bool,
    /// History file (default: chat_history in the per-user data directory).
    #[arg(long, value_name = "FILE")]
    pub history: Option<PathBuf>,
    /// Do not load the smaller rungs once at start to measure their context buffers (the
    /// policy then works from a conservative estimate until a rung has been used).
    #[arg(long)]
    pub no_measure: bool,
    /// Keep no history file.
    #[arg(long, conflicts_with = "history")]
    pub no_history: bool,
    /// Colour tokens by rung: auto (a terminal, NO_COLOR unset), always, never.
    #[arg(long, value_enum, default_value_t = ColorArg::Auto)]
    pub color: ColorArg,
    /// Continue the conversation saved by the last chat (its KV cache from its state file, so
    /// nothing is re-read). The conversation is saved after each answer and on exit either way.
    #[arg(long)]
    pub resume: bool,
    /// Where the conversation's state file is kept (default: the per-user data directory,
    /// $XDG_DATA_HOME/molt/state).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// The saved conversation's name: several can be kept side by side.
    #[arg(long, default_value = "chat")]
    pub conversation: String,
    /// Bound on the state directory's files, MiB; past it the oldest are evicted.
    #[arg(long, default_value_t = molt::state::DEFAULT_MAX_MIB)]
    pub state_max_mib: u64,
    /// Keep the conversation in RAM only: no state file is read or written.
    #[arg(long, conflicts_with = "resume")]
    pub no_state: bool,
}

/// `--color` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColorArg {
    /// Colour when stdout is a terminal and `NO_COLOR` is unset or empty.
    Auto,
    /// Always colour.
    Always,
    /// Never colour.
    Never,
}

/// A parsed `/command`.
#[derive(Debug, Clone, PartialEq)]
enum Command {
    Budget(BudgetCmd),
    Trace(Option<Option<PathBuf>>),
    Status,
    Reset,
    Quit,
    Help,
}

#[derive(Debug, Clone, PartialEq)]
enum BudgetCmd {
    Show,
    Off,
    Bytes(u64),
    Rung(String),
}

/// A line the user typed: a command, or a message for the model.
#[derive(Debug, Clone, PartialEq)]
enum Typed {
    Command(Command),
    Message(String),
    Empty,
}

/// Parses a typed line; `rungs` are the ladder's names (for `/budget RUNG`). A message that must
/// start with `/` is written `//…`.
fn parse_typed(line: &str, rungs: &[String]) -> Result<Typed, String> {
    let t = line.trim();
    if t.is_empty() {
        return Ok(Typed::Empty);
    }
    if let Some(rest) = t.strip_prefix("//") {
        return Ok(Typed::Message(format!("/{rest}")));
    }
    let Some(cmd) = t.strip_prefix('/') else {
        return Ok(Typed::Message(t.to_string()));
    };
    let (name, arg) = cmd
        .split_once(char::is_whitespace)
        .map_or((cmd, ""), |(n, a)| (n, a.trim()));
    let c = match (name, arg) {
        ("budget", "") => Command::Budget(BudgetCmd::Show),
        ("budget", "off" | "none" | "system") => Command::Budget(BudgetCmd::Off),
        ("budget", r) if rungs.iter().any(|n| n == r) => {
            Command::Budget(BudgetCmd::Rung(r.to_string()))
        }
        ("budget", size) if size.starts_with(|c: char| c.is_ascii_digit() || c == '.') => {
            Command::Budget(BudgetCmd::Bytes(parse_size(size)?))
        }
        ("budget", other) => {
            return Err(format!(
                "/budget {other}: not a size (900, 1.5G) nor a rung ({}), nor off",
                rungs.join(", ")
            ));
        }
        ("trace", "") => Command::Trace(None),
        ("trace", "off" | "none" | "system") => Command::Trace(Some(None)),
        ("trace", file) => Command::Trace(Some(Some(PathBuf::from(file)))),
        ("status", "") => Command::Status,
        ("reset", "") => Command::Reset,
        ("quit" | "exit" | "q", "") => Command::Quit,
        ("help" | "?", "") => Command::Help,
        ("status" | "reset" | "quit" | "exit" | "q" | "help" | "?", _) => {
            return Err(format!("/{name} takes no argument"));
        }
        _ => return Err(format!("unknown command /{name}; /help lists them")),
    };
    Ok(Typed::Command(c))
}

const HELP: &str = "/budget SIZE|RUNG|off · /trace FILE|off · /status · /reset · /quit — \
Ctrl-C stops an answer, Ctrl-D quits; a message starting with / is written //…";

/// What is going on in the answer being generated, for `/status` mid-answer.
struct Live {
    rung: String,
    prompt: usize,
    tokens: usize,
    reused: usize,
}

struct Chat {
    renderer: Renderer,
    input: Input,
    control: BudgetControl,
    cancel: Arc<AtomicBool>,
    snapshot: Snapshot,
    names: Vec<String>,
    paths: Vec<PathBuf>,
    n_ctx: u32,
    raw: bool,
    turn: u64,
    options: GenerateOptions,
    seed: u64,
    queue: VecDeque<String>,
    reset_after: bool,
    quit: bool,
    /// Ctrl-D mid-answer: leave once this answer (and any queued message) is done.
    eof: bool,
    live: Option<Live>,
    reserve: u64,
    /// The rung the chat started on: the largest it may use.
    home: usize,
}

pub fn run(g: &GlobalArgs, a: &Args) -> Result<()> {
    let config = g.context_config()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let sampling = common::sampling(a.temperature, a.top_p, a.seed)?;
    let ladder = g.open_ladder()?;
    let names = ladder.names();
    // The same forms as `/budget`: a size, a rung, or off; checked before any model loads.
    let budget_arg = match a.budget.as_deref() {
        None => None,
        Some(b) => match parse_typed(&format!("/budget {b}"), &names) {
            Ok(Typed::Command(Command::Budget(c @ (BudgetCmd::Bytes(_) | BudgetCmd::Rung(_))))) => {
                Some(c)
            }
            Ok(_) => None,
            Err(e) => bail!("--budget: {e}"),
        },
    };
    if let Some(t) = &a.trace {
        common::check_trace(t, &names)?;
    }
    let start = a.rung.clone().unwrap_or_else(|| names[0].clone());
    if !names.contains(&start) {
        bail!("--rung {start}: the ladder has {}", names.join(", "));
    }
    if !molt::state::valid_id(&a.conversation) {
        bail!(
            "--conversation {:?}: 1–64 letters, digits, - or _",
            a.conversation
        );
    }
    let state_dir = if a.no_state {
        None
    } else {
        let d = match &a.state_dir {
            Some(d) => d.clone(),
            None => molt::state::default_state_dir().context(
                "no per-user data directory for the state file (set HOME or XDG_DATA_HOME, or give --state-dir or --no-state)",
            )?,
        };
        Some(molt::state::StateDir::open(&d, a.state_max_mib)?)
    };
    let paths = ladder.rungs.iter().map(|r| r.path.clone()).collect();
    let stdout_tty = std::io::stdout().is_terminal();
    let interactive = std::io::stdin().is_terminal() && stdout_tty;
    eprintln!("loading {start} of ladder {} …", ladder.name());
    let opts = SessionOptions {
        strategy: a.strategy.into(),
        projector_dirs: routes::search_dirs(a.projectors.as_deref()),
        speed: g.speed_policy(&ladder, &routes::search_dirs(a.projectors.as_deref())),
        pace_file: molt::session::pace::default_pace_file(),
        refill_chunk: a.refill.chunk,
        refill_within: a.refill.within,
        refill_pace: a.refill.pace,
        hurry: a.refill.hurry,
        ..SessionOptions::default()
    };
    let mut session = Session::with_options(ladder, config, &start, opts)?;
    if let Some(n) = session.pace_note() {
        eprintln!("molt-run: {n}");
    }
    let shipped = session.built_in().clone();
    let missing = missing_routes(&mut session);
    if !a.no_measure {
        for (rung, ms) in common::measure_rungs(&mut session)? {
            eprintln!("measured {rung} in {ms:.0} ms (mapped, one token, unmapped)");
        }
    }
    let home = session.current_index();
    let template = session
        .rung_mut(home)
        .and_then(|r| r.model().chat_template())
        .is_some();
    let mut keeper = state_dir.map(|dir| worker::Keeper {
        dir,
        id: a.conversation.clone(),
        first_turn_len: 0,
        last: "nothing saved yet".into(),
    });
    let mut snapshot = Snapshot::of(&session);
    let base: Box<dyn BudgetSource + Send> = match &a.trace {
        Some(p) => Box::new(TraceBudget::new(common::load_trace(
            p,
            &names,
            &snapshot.costs,
            config.n_ctx,
        )?)),
        None => Box::new(SystemBudget::new().with_reserve(a.reserve.saturating_mul(MIB))),
    };
    let control = BudgetControl::new(base);
    control.set_cap(budget_arg.and_then(|c| {
        match c {
            BudgetCmd::Bytes(b) => Some(b),
            BudgetCmd::Rung(name) => names
                .iter()
                .position(|n| *n == name)
                .map(|i| rung_cap(&snapshot, i, config.n_ctx)),
            BudgetCmd::Show | BudgetCmd::Off => None,
        }
    }));
    let first = control
        .read_now()
        .context("reading the memory budget (use --trace FILE where /proc is unavailable)")?;
    session.set_budget_source(Some(Box::new(control.source())));
    // The rung loaded before the budget was known; the speed policy chooses under it now.
    session.retune_with(first.budget.bytes)?;
    // Resumed under the budget as it is: a file of a rung it no longer holds is carried
    // through the switch onto the largest that does.
    let resumed = match keeper.as_mut() {
        Some(k) if a.resume => Some(k.resume(&mut session)),
        _ => None,
    };
    snapshot.cache = keeper.as_ref().map_or_else(
        || "RAM only (--no-state)".into(),
        |k| {
            if session.history().is_empty() {
                format!("empty · {}", k.last)
            } else {
                format!("RAM on {} · {}", session.current_rung(), k.last)
            }
        },
    );
    snapshot.setups = Snapshot::of(&session).setups;
    if let Some(setup) = session.rung_setup(session.current_index()) {
        eprintln!("{}: {setup}", session.current_rung());
    }
    let cancel = session.cancel_handle();
    let history = if a.no_history {
        None
    } else {
        a.history.clone().or_else(|| {
            molt::ladder::search::user_models_dir()
                .and_then(|m| m.parent().map(|p| p.join("chat_history")))
        })
    };
    let color = render::use_color(a.color, stdout_tty);
    let mut chat = Chat {
        renderer: Renderer::new(color, names.clone()),
        input: Input::new(interactive, history),
        control,
        cancel,
        snapshot,
        names,
        paths,
        n_ctx: config.n_ctx,
        raw: a.raw || !template,
        turn: 0,
        options: GenerateOptions {
            max_tokens: a.max_tokens,
            sampling,
            force_switch: None,
        },
        seed: a.seed,
        queue: VecDeque::new(),
        reset_after: false,
        quit: false,
        eof: false,
        live: None,
        reserve: a.reserve,
        home,
    };
    // After the editor exists: rustyline installs a SIGINT handler of its own when created (it
    // only needs it while reading a line, when the terminal sends Ctrl-C as a key anyway).
    input::install_sigint().context("installing the Ctrl-C handler")?;
    let ladder_name = session.ladder().name().to_string();
    chat.banner(
        &ladder_name,
        &start,
        template,
        &first,
        &shipped,
        &missing,
        a,
    );
    if let Some(line) = resumed {
        chat.renderer.note(&line);
    }
    let (jobs, reports, handle) = worker::spawn(session, keeper);
    let result = chat.repl(&jobs, &reports);
    chat.input.save_history();
    drop(jobs);
    let _ = handle.join();
    result
}

/// Bytes rung `i` needs holding `tokens` of context.
fn need(snapshot: &Snapshot, i: usize, tokens: u64) -> u64 {
    let c = &snapshot.costs[i];
    c.resident_bytes() + c.kv_bytes(tokens)
}

/// The cap `/budget RUNG` sets: 5 % above what rung `i` needs for a full window.
fn rung_cap(snapshot: &Snapshot, i: usize, n_ctx: u32) -> u64 {
    let need = need(snapshot, i, u64::from(n_ctx));
    need + need / 20
}

/// Routes (below the home rung, where the chat can go) that have no projector.
fn missing_routes(session: &mut Session) -> Vec<String> {
    if session.options().strategy != Strategy::Molt {
        return Vec::new();
    }
    let home = session.current_index();
    let n = session.ladder().rungs.len();
    let names = session.ladder().names();
    let mut missing = Vec::new();
    for i in home..n {
        for j in home..n {
            if i != j && session.routes_mut().get(i, j).is_err() {
                missing.push(format!("{} -> {}", names[i], names[j]));
            }
        }
    }
    missing
}

impl Chat {
    #[allow(clippy::too_many_arguments)]
    fn banner(
        &mut self,
        ladder: &str,
        start: &str,
        template: bool,
        first: &budget::Reading,
        shipped: &shipped::Installed,
        missing: &[String],
        a: &Args,
    ) {
        let mode = if template && !a.raw {
            "chat template".to_string()
        } else if a.raw {
            "raw text (--raw)".to_string()
        } else {
            format!("raw text: {start} ships no chat template")
        };
        let head = format!(
            "molt chat · ladder {ladder} · starting on {} · {mode}",
            self.renderer.rung_name(start)
        );
        self.renderer.note(&head);
        let legend = self.renderer.legend();
        self.renderer.note(&legend);
        let budget = self.budget_line(first);
        self.renderer.note(&format!("budget: {budget}"));
        if !shipped.embedded.is_empty() {
            self.renderer.note(&format!(
                "projectors built into the library: {}",
                shipped.embedded.join(", ")
            ));
        }
        for r in &shipped.refused {
            self.renderer
                .note(&format!("built-in projector not used: {r}"));
        }
        if !missing.is_empty() {
            self.renderer.note(&format!(
                "no projector for {} (searched {}): a switch on such a route fails — run \
                 `molt-run train-projectors`, pass --projectors DIR, or --strategy reprefill",
                missing.join(", "),
                shipped::search_order(a.projectors.as_deref())
            ));
        }
        self.renderer.note(HELP);
    }

    fn budget_line(&self, r: &budget::Reading) -> String {
        let mut s = format!(
            "{} · pressure {:.2} — {}",
            fmt_bytes(r.budget.bytes),
            r.budget.pressure,
            self.control.describe_base()
        );
        if let Some(c) = r.cap {
            let _ = write!(
                s,
                ", capped at {}{}",
                fmt_bytes(c),
                if c >= r.base_bytes {
                    " (not binding)"
                } else {
                    ""
                }
            );
        }
        s
    }

    fn context_tokens(&self) -> u64 {
        match &self.live {
            Some(l) if l.prompt > 0 => (l.prompt + l.tokens) as u64,
            _ => self.snapshot.context_tokens as u64,
        }
    }

    /// Bytes rung `i` needs with `tokens` of context (the policy's model).
    fn need(&self, i: usize, tokens: u64) -> u64 {
        need(&self.snapshot, i, tokens)
    }

    fn fits(&self, bytes: u64) -> String {
        let t = self.context_tokens().max(1);
        let fit: Vec<&str> = (self.home..self.names.len())
            .filter(|&i| self.need(i, t) <= bytes)
            .map(|i| self.names[i].as_str())
            .collect();
        if fit.is_empty() {
            "no rung fits: the answer waits for memory".to_string()
        } else {
            format!("fits {}", fit.join(", "))
        }
    }

    fn repl(&mut self, jobs: &Sender<Job>, reports: &Receiver<Report>) -> Result<()> {
        let editing = self.input.is_editing();
        while !self.quit {
            let line = if let Some(q) = self.queue.pop_front() {
                self.renderer.user_line(PROMPT, &q);
                Line::Text(q)
            } else if self.eof {
                break;
            } else {
                let l = self.input.read(PROMPT).context("reading input")?;
                if let Line::Text(t) = &l
                    && !editing
                {
                    self.renderer.user_line(PROMPT, t);
                }
                l
            };
            let text = match line {
                Line::Eof => break,
                Line::Interrupted => {
                    if editing {
                        self.renderer
                            .note("(Ctrl-C stops an answer; /quit or Ctrl-D leaves)");
                    }
                    continue;
                }
                Line::Text(t) => t,
            };
            self.input.remember(text.trim());
            self.drain_idle(reports);
            match parse_typed(&text, &self.names) {
                Ok(Typed::Empty) => {}
                Ok(Typed::Command(c)) => self.command(c, jobs, reports, false)?,
                Ok(Typed::Message(m)) => self.answer(m, jobs, reports)?,
                Err(e) => self.renderer.note(&e),
            }
        }
        Ok(())
    }

    fn command(
        &mut self,
        c: Command,
        jobs: &Sender<Job>,
        reports: &Receiver<Report>,
        answering: bool,
    ) -> Result<()> {
        match c {
            Command::Help => self.renderer.note(HELP),
            Command::Quit => {
                self.quit = true;
                if answering {
                    self.cancel.store(true, Ordering::SeqCst);
                }
            }
            Command::Reset => {
                if answering {
                    self.reset_after = true;
                    self.renderer
                        .note("the conversation will be forgotten when this answer ends");
                } else {
                    jobs.send(Job::Reset)
                        .context("the generation thread ended")?;
                    self.wait_snapshot(reports)?;
                    self.turn = 0;
                    self.renderer.note("conversation forgotten");
                }
            }
            Command::Status => self.status(),
            Command::Budget(b) => {
                self.budget(b);
                self.settle(jobs, answering)?;
            }
            Command::Trace(t) => {
                self.trace(t);
                self.settle(jobs, answering)?;
            }
        }
        Ok(())
    }

    /// After the budget changed between answers: the session moves back up the ladder, if the
    /// budget now holds a larger rung, while the user types (its report is read with whatever
    /// comes next). During an answer the answer's own policy moves it, and the session settles
    /// after the answer anyway.
    fn settle(&mut self, jobs: &Sender<Job>, answering: bool) -> Result<()> {
        if !answering {
            jobs.send(Job::Settle)
                .context("the generation thread ended")?;
        }
        Ok(())
    }

    /// Shows what the session did between answers ([`Report::Idle`]) and takes its state.
    /// `waited`: how long the message sent last had been waiting when the report came (the
    /// move was still under way when it was sent; its answer's own TTFT does not count that).
    fn on_idle(
        &mut self,
        moved: Result<molt::session::IdleMove, String>,
        s: Snapshot,
        waited: Option<Duration>,
    ) {
        let line = match moved {
            Ok(m) => {
                let load = if m.load_ms > 0.0 {
                    format!(", {} loaded in {:.0} ms", m.to, m.load_ms)
                } else {
                    String::new()
                };
                let wait = waited.map_or_else(String::new, |w| {
                    format!("; this message waited {} ms for it", w.as_millis())
                });
                let read = if m.tokens == 0 {
                    "nothing cached to read".to_string()
                } else {
                    format!("the conversation's {} tokens read on it", m.tokens)
                };
                format!(
                    "⇡ {} → {} between answers: the budget holds it again; {read} in {:.0} ms\
                     {load}{wait}",
                    self.renderer.rung_name(&m.from),
                    self.renderer.rung_name(&m.to),
                    m.ms
                )
            }
            Err(e) => format!("could not move back up between answers: {e}"),
        };
        self.renderer.note(&line);
        self.snapshot = s;
    }

    /// Shows what the session read between answers of what a size switch left out.
    fn on_filled(&mut self, f: Result<worker::Filled, String>) {
        let line = match f {
            Ok(f) if f.due == 0 => format!(
                "↻ {} read the {} positions the switch left out while you typed ({:.0} ms): \
                 its cache is whole and its own",
                self.renderer.rung_name(&f.rung),
                f.read,
                f.ms
            ),
            Ok(f) => format!(
                "↻ {} read {} of the positions the switch left out while you typed ({:.0} ms); \
                 this message reads the other {} first",
                self.renderer.rung_name(&f.rung),
                f.read,
                f.ms,
                f.due
            ),
            Err(e) => format!(
                "↻ reading what the switch left out failed ({e}): the next message reads the \
                 rest again"
            ),
        };
        self.renderer.note(&line);
    }

    /// Reads the reports that came while the main thread waited for input.
    fn drain_idle(&mut self, reports: &Receiver<Report>) {
        while let Ok(r) = reports.try_recv() {
            match r {
                Report::Idle(m, s) => self.on_idle(m, s, None),
                Report::Filled(f) => self.on_filled(f),
                _ => {}
            }
        }
    }

    fn budget(&mut self, b: BudgetCmd) {
        match b {
            BudgetCmd::Show => {
                let r = self.reading();
                let line = r.map_or_else(
                    |e| format!("budget unreadable: {e}"),
                    |r| format!("budget {}", self.budget_line(&r)),
                );
                self.renderer.note(&line);
            }
            BudgetCmd::Off => {
                self.control.set_cap(None);
                self.renderer.note(&format!(
                    "budget cap lifted: following {}",
                    self.control.describe_base()
                ));
            }
            BudgetCmd::Bytes(bytes) => {
                self.control.set_cap(Some(bytes));
                let fits = self.fits(bytes);
                self.renderer
                    .note(&format!("budget capped at {} ({fits})", fmt_bytes(bytes)));
            }
            BudgetCmd::Rung(name) => {
                let i = self.names.iter().position(|n| *n == name).unwrap_or(0);
                let bytes = rung_cap(&self.snapshot, i, self.n_ctx);
                self.control.set_cap(Some(bytes));
                let fits = self.fits(bytes);
                self.renderer.note(&format!(
                    "budget capped at {}: 5 % above what {name} needs for a full {}-token window ({fits})",
                    fmt_bytes(bytes),
                    self.n_ctx
                ));
            }
        }
    }

    fn trace(&mut self, t: Option<Option<PathBuf>>) {
        match t {
            None => {
                let d = self.control.describe_base();
                self.renderer.note(&format!("budget source: {d}"));
            }
            Some(None) => {
                self.control.set_base(Box::new(
                    SystemBudget::new().with_reserve(self.reserve.saturating_mul(MIB)),
                ));
                let d = self.control.describe_base();
                self.renderer.note(&format!("budget follows {d}"));
            }
            Some(Some(path)) => {
                match common::load_trace(&path, &self.names, &self.snapshot.costs, self.n_ctx) {
                    Ok(trace) => {
                        self.control.set_base(Box::new(TraceBudget::new(trace)));
                        let d = self.control.describe_base();
                        self.renderer.note(&format!(
                            "budget replays {d}; its clock is each answer's own"
                        ));
                    }
                    Err(e) => self.renderer.note(&format!("{e:#}")),
                }
            }
        }
    }

    fn reading(&self) -> Result<budget::Reading, String> {
        if self.live.is_some() {
            self.control
                .last()
                .ok_or_else(|| "not read yet".to_string())
        } else {
            self.control.read_now().map_err(|e| e.to_string())
        }
    }

    fn status(&mut self) {
        let tokens = self.context_tokens();
        let current = self
            .live
            .as_ref()
            .and_then(|l| self.names.iter().position(|n| *n == l.rung))
            .unwrap_or(self.snapshot.current);
        let mut s =
            String::from("  rung       state      weights   resident  page cache   needs now\n");
        let mut weights_resident = 0;
        for (i, name) in self.names.iter().enumerate() {
            let c = &self.snapshot.costs[i];
            let loaded = self.snapshot.loaded[i];
            let resident = if loaded {
                resident_bytes_of_mapping(&self.paths[i]).unwrap_or(0)
            } else {
                0
            };
            weights_resident += resident;
            let cached = file_resident_in_page_cache(&self.paths[i])
                .map_or_else(|_| "?".to_string(), |p| fmt_bytes(p.resident_bytes));
            let setup = self.snapshot.setups.get(i).copied().flatten();
            let _ = writeln!(
                s,
                "{} {:<10} {:<10} {:>9} {:>9} {:>11} {:>11}{}",
                if i == current { "▸" } else { " " },
                name,
                if loaded { "resident" } else { "unmapped" },
                fmt_bytes(c.weights_bytes),
                fmt_bytes(resident),
                cached,
                fmt_bytes(self.need(i, tokens.max(1))),
                setup.map(|u| format!("  {u}")).unwrap_or_default(),
            );
        }
        let budget = match self.reading() {
            Ok(r) => {
                let fits = self.fits(r.budget.bytes);
                format!("{} ({fits})", self.budget_line(&r))
            }
            Err(e) => e,
        };
        let _ = writeln!(s, "budget {budget}");
        let _ = write!(
            s,
            "context {tokens} tokens of {} · {} messages",
            self.n_ctx, self.snapshot.messages
        );
        if let Some(l) = &self.live {
            let _ = write!(
                s,
                " · answering on {}, {} tokens so far ({} prompt tokens were cached)",
                l.rung, l.tokens, l.reused
            );
        }
        // Measured, not modelled: the mapped weights' resident pages plus all anonymous memory
        // (KV caches, compute buffers, logits, heap); beside it what the policy assumes.
        let anon = process_anon_rss_bytes().unwrap_or(0);
        let rss = process_rss_bytes().map_or_else(|_| "?".to_string(), fmt_bytes);
        let _ = write!(
            s,
            "\nfootprint {} measured = weight pages resident {} + anonymous memory {} (KV, \
             compute buffers, heap) · the policy models {} · process RSS {rss}",
            fmt_bytes(weights_resident + anon),
            fmt_bytes(weights_resident),
            fmt_bytes(anon),
            fmt_bytes(self.need(current, tokens.max(1))),
        );
        // Where the conversation's cache lives: RAM, and the state file it was saved to.
        let _ = write!(s, "\ncache {}", self.snapshot.cache);
        self.renderer.note(&s);
    }

    fn wait_snapshot(&mut self, reports: &Receiver<Report>) -> Result<()> {
        loop {
            match reports.recv().context("the generation thread ended")? {
                Report::Snapshot(s) => {
                    self.snapshot = s;
                    return Ok(());
                }
                Report::Idle(m, s) => self.on_idle(m, s, None),
                Report::Filled(f) => self.on_filled(f),
                Report::Event(_) | Report::Answered(_) => {}
            }
        }
    }

    fn answer(&mut self, m: String, jobs: &Sender<Job>, reports: &Receiver<Report>) -> Result<()> {
        let prompt = if self.raw {
            Prompt::Text(if self.turn > 0 { format!("\n{m}") } else { m })
        } else {
            Prompt::User(m)
        };
        let mut opts = self.options;
        opts.sampling.seed = self.seed.wrapping_add(self.turn);
        self.turn += 1;
        let _ = input::take_interrupt();
        jobs.send(Job::Answer(prompt, opts))
            .context("the generation thread ended")?;
        let sent = std::time::Instant::now();
        self.live = Some(Live {
            rung: self.names[self.snapshot.current].clone(),
            prompt: 0,
            tokens: 0,
            reused: 0,
        });
        let mut stopping = false;
        'answer: loop {
            let first = match reports.recv_timeout(Duration::from_millis(10)) {
                Ok(r) => Some(r),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => bail!("the generation thread ended"),
            };
            for r in first
                .into_iter()
                .chain(std::iter::from_fn(|| reports.try_recv().ok()))
            {
                match r {
                    Report::Event(e) => self.on_event(*e),
                    Report::Answered(Ok(g)) => {
                        let reused = self.live.as_ref().map_or(0, |l| l.reused);
                        self.renderer.summary(&g, reused);
                    }
                    Report::Answered(Err(e)) => self.renderer.note(&format!("error: {e}")),
                    Report::Snapshot(s) => {
                        self.snapshot = s;
                        break 'answer;
                    }
                    Report::Idle(m, s) => self.on_idle(m, s, Some(sent.elapsed())),
                    Report::Filled(f) => self.on_filled(f),
                }
            }
            if input::take_interrupt() && !stopping {
                stopping = true;
                self.cancel.store(true, Ordering::SeqCst);
            }
            // Piped input is a script: its lines run in order, each after the answer before it.
            if !self.input.is_editing() || self.eof {
                continue;
            }
            match self.input.poll(Duration::ZERO).context("reading input")? {
                Some(Line::Text(t)) => self.typed_mid_answer(&t, jobs, reports)?,
                Some(Line::Eof) => self.eof = true,
                Some(Line::Interrupted) | None => {}
            }
        }
        self.live = None;
        if self.reset_after {
            self.reset_after = false;
            self.command(Command::Reset, jobs, reports, false)?;
        }
        Ok(())
    }

    fn typed_mid_answer(
        &mut self,
        t: &str,
        jobs: &Sender<Job>,
        reports: &Receiver<Report>,
    ) -> Result<()> {
        self.input.remember(t.trim());
        match parse_typed(t, &self.names) {
            Ok(Typed::Empty) => {}
            Ok(Typed::Command(c)) => self.command(c, jobs, reports, true)?,
            Ok(Typed::Message(m)) => {
                self.renderer.note("(queued: sent when this answer ends)");
                self.queue.push_back(m);
            }
            Err(e) => self.renderer.note(&e),
        }
        Ok(())
    }

    fn on_event(&mut self, e: Event) {
        match e {
            Event::Start {
                rung,
                prompt_tokens,
                reused_tokens,
            } => {
                if let Some(l) = self.live.as_mut() {
                    l.rung = rung;
                    l.prompt = prompt_tokens;
                    l.reused = reused_tokens;
                }
            }
            Event::Token { rung, text, .. } => {
                self.renderer.token(&rung, &text);
                if let Some(l) = self.live.as_mut() {
                    l.tokens += 1;
                    l.rung = rung;
                }
            }
            Event::Switch(s) => {
                self.renderer.switch(&s);
                if let Some(i) = self.names.iter().position(|n| *n == s.from) {
                    self.snapshot.loaded[i] = false;
                }
                if let Some(i) = self.names.iter().position(|n| *n == s.to) {
                    self.snapshot.loaded[i] = true;
                    self.snapshot.current = i;
                }
                if let Some(l) = self.live.as_mut() {
                    l.rung = s.to;
                }
            }
            Event::Stall { reason, .. } => self.renderer.note(&format!(
                "⏸ {reason} — /budget to give memory back, Ctrl-C to stop"
            )),
            Event::Lever(l) => self.renderer.note(&common::lever_line(&l)),
            Event::Prepare(p) => self.renderer.note(&common::prepare_line(&p)),
            Event::Budget { .. } | Event::Footprint(_) | Event::Done(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["tier0".into(), "tier1".into(), "tier2".into()]
    }

    #[test]
    fn typed_lines_parse_into_commands_and_messages() {
        let n = names();
        let p = |s: &str| parse_typed(s, &n);
        assert_eq!(p("  "), Ok(Typed::Empty));
        assert_eq!(
            p("hello /budget"),
            Ok(Typed::Message("hello /budget".into()))
        );
        assert_eq!(
            p("//budget is a word"),
            Ok(Typed::Message("/budget is a word".into()))
        );
        assert_eq!(
            p("/budget 900"),
            Ok(Typed::Command(Command::Budget(BudgetCmd::Bytes(900 * MIB))))
        );
        assert_eq!(
            p("/budget   1.5G"),
            Ok(Typed::Command(Command::Budget(BudgetCmd::Bytes(3 << 29))))
        );
        assert_eq!(
            p("/budget tier2"),
            Ok(Typed::Command(Command::Budget(BudgetCmd::Rung(
                "tier2".into()
            ))))
        );
        assert_eq!(
            p("/budget off"),
            Ok(Typed::Command(Command::Budget(BudgetCmd::Off)))
        );
        assert_eq!(
            p("/budget"),
            Ok(Typed::Command(Command::Budget(BudgetCmd::Show)))
        );
        assert_eq!(
            p("/trace traces/a.json"),
            Ok(Typed::Command(Command::Trace(Some(Some(
                "traces/a.json".into()
            )))))
        );
        assert_eq!(
            p("/trace off"),
            Ok(Typed::Command(Command::Trace(Some(None))))
        );
        assert_eq!(p("/status"), Ok(Typed::Command(Command::Status)));
        assert_eq!(p("/quit"), Ok(Typed::Command(Command::Quit)));
        assert!(p("/budget tier9").unwrap_err().contains("tier9"));
        assert!(p("/frobnicate").unwrap_err().contains("/help"));
        assert!(p("/reset now").is_err());
    }
}
