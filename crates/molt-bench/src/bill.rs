//! The size switch's whole bill (`bench --bill`, `results/switch_bill.json`): what a switch
//! costs the destination from the switch to the next prompt, beside what a re-prefill costs at
//! the same points — measured as a user of `chat` meets it, in a conversation.
//!
//! Each repetition wakes one conversation (a notes text of about the row's length with two
//! facts in it, read on the source in a first turn and kept in a state file), asks about the
//! first fact with the budget cut before answer token 1 ([`GenerateOptions::force_switch`]),
//! then asks about the second fact. Arms:
//!
//! - `molt`, next prompt **at once**: the answer ends when its last token is written; the next
//!   prompt reads what the switch left out first ([`Session::generate`]'s `fill` lever at its
//!   token 0), then itself.
//! - `molt`, next prompt **after the fill**: the user took longer to type than the fill took
//!   ([`Session::fill_idle`] until nothing is due): the whole bill's fill, and the next
//!   prompt's first token on a whole cache.
//! - `molt-fill-at-end`: the order before the fill left the user's path
//!   ([`molt::session::SessionOptions::fill_at_end`]): the answer reads it before it ends.
//! - `reprefill`: the switch re-reads the history on the destination.
//! - `native`: the conversation read on the destination from the start (no switch): its
//!   recall, and its next prompt's first token on a whole native cache.
//!
//! The destination's own prefill rate is timed when its state file is made (the first turn
//! read on it whole), at the same micro-batch as the fill's.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use molt::engine::ContextConfig;
use molt::ladder::Ladder;
use molt::session::{Event, GenerateOptions, Prompt, Session, SessionOptions, Strategy};
use molt::state::StateFile;
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::stall::Spread;

/// What the bill bench runs.
#[derive(Debug, Clone)]
pub struct BillOptions {
    /// Context lengths, tokens (about: whole paragraphs).
    pub lengths: Vec<usize>,
    /// Repetitions per arm and length.
    pub reps: usize,
    /// The rung the conversation starts on.
    pub from: usize,
    /// The rung the budget cut sends it to.
    pub to: usize,
    /// Tokens per answer.
    pub max_tokens: usize,
    /// Projector directories searched first.
    pub projector_dirs: Vec<PathBuf>,
}

/// One route and context length.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BillRow {
    /// `from→to`.
    pub route: String,
    /// Tokens of the conversation at the switch.
    pub context_tokens: usize,
    /// Repetitions.
    pub reps: usize,
    /// The stall at the switch: the last source token to the first destination token, ms.
    pub stall_ms: Spread,
    /// The destination's whole work for the switch: the stall, the refill during the answer
    /// and the fill after it, ms.
    pub whole_bill_ms: Spread,
    /// Positions the destination read for the switch (the sparse read, the refill, the fill).
    pub whole_bill_positions: Spread,
    /// A re-prefill's stall at the same point (its whole bill: nothing follows it), ms.
    pub reprefill_ms: Spread,
    /// Positions the fill read between answers.
    pub fill_positions: Spread,
    /// The fill's time between answers, ms.
    pub fill_ms: Spread,
    /// The fill's positions per second over the destination's prefill tokens per second at
    /// the same micro-batch.
    pub fill_rate_ratio: f64,
    /// The destination's prefill rate, tokens/s (its first turn read whole).
    pub prefill_tokens_per_s: f64,
    /// The answer's end to end time (the call to its last token), ms.
    pub answer_ms: Spread,
    /// The same with a re-prefill at the switch, ms.
    pub answer_reprefill_ms: Spread,
    /// The answer's last token to the prompt accepting input again, ms.
    pub wait_after_answer_ms: Spread,
    /// The same with the fill read before the answer ends (`fill_at_end`), ms.
    pub wait_after_answer_fill_at_end_ms: Spread,
    /// The next prompt's first token when it is sent the moment the answer ends, ms.
    pub next_ttft_ms: Spread,
    /// The next prompt's first token when it is sent after the fill, ms.
    pub next_ttft_after_fill_ms: Spread,
    /// The next prompt's first token after a re-prefill switch, ms.
    pub next_ttft_reprefill_ms: Spread,
    /// The next prompt's first token on a whole native cache of the destination, ms.
    pub next_ttft_native_ms: Spread,
    /// Facts stated, of those asked, per arm (both questions of every repetition).
    pub recall: BTreeMap<String, String>,
    /// Every answer of the run, per arm (the first repetition's).
    pub answers: BTreeMap<String, Vec<String>>,
}

/// The results file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BillDoc {
    /// Machine and build.
    pub run: serde_json::Value,
    /// Threads every decode used.
    pub threads: u32,
    /// What else ran on the machine meanwhile.
    pub contention: String,
    /// One row per route and length.
    pub rows: Vec<BillRow>,
    /// Switches known ahead from the machine's own signals (not measured by this bench yet).
    #[serde(default)]
    pub ahead: Vec<serde_json::Value>,
}

/// The two facts planted in every context, each with its question and the words an answer
/// must contain.
const FACTS: [(&str, &str, &str); 2] = [
    (
        "The door code for the east stairwell is 4826.",
        "What is the door code for the east stairwell? Answer in one sentence.",
        "4826",
    ),
    (
        "The spare laptop chargers are kept in locker 17 behind reception.",
        "In which locker are the spare laptop chargers kept? Answer in one sentence.",
        "17",
    ),
];

const NAMES: [&str; 12] = [
    "Avery", "Blake", "Casey", "Devon", "Emery", "Finley", "Harper", "Jordan", "Kendall", "Logan",
    "Morgan", "Parker",
];
const THINGS: [&str; 8] = [
    "the billing service",
    "the search index",
    "the nightly export",
    "the mobile app",
    "the data warehouse",
    "the login page",
    "the payment gateway",
    "the image cache",
];
const ACTS: [&str; 6] = [
    "migrated",
    "reviewed",
    "rewrote",
    "benchmarked",
    "documented",
    "profiled",
];

/// Team notes of about `length` tokens (as `count` tokenizes them), the facts planted at a
/// third and at two thirds of the way.
fn notes(length: usize, count: &dyn Fn(&str) -> usize) -> String {
    let para = |i: usize| {
        format!(
            "On day {}, {} {} {} and noted that it took {} hours, with {} follow-up tasks filed.",
            i + 1,
            NAMES[(i * 7 + 3) % NAMES.len()],
            ACTS[(i * 5 + 1) % ACTS.len()],
            THINGS[(i * 3 + 2) % THINGS.len()],
            2 + (i * 7) % 8,
            1 + (i * 3) % 5
        )
    };
    let mut paras: Vec<String> = Vec::new();
    let mut i = 0;
    while count(&paras.join(" ")) < length.saturating_sub(40) {
        paras.push(para(i));
        i += 1;
    }
    let n = paras.len();
    paras.insert(2 * n / 3, FACTS[1].0.to_string());
    paras.insert(n / 3, FACTS[0].0.to_string());
    format!("Here are our team's notes.\n\n{}", paras.join(" "))
}

/// What one answer did, as the user saw it.
#[derive(Debug, Default, Clone)]
struct Turn {
    text: String,
    /// The call to the first token, ms.
    ttft_ms: f64,
    /// The call to the last token, ms.
    answer_ms: f64,
    /// The last token to the call's return, ms.
    wait_after_ms: f64,
    /// The switch's cost and the positions it read natively.
    stall_ms: Option<f64>,
    switch_positions: usize,
    /// The refill levers during the answer: positions and ms.
    refill: (usize, f64),
    /// A `fill` lever: positions and ms.
    fill: (usize, f64),
}

fn turn(
    session: &mut Session,
    question: &str,
    max_tokens: usize,
    force: Option<(usize, usize)>,
) -> Result<Turn, BenchError> {
    let mut t = Turn::default();
    let t0 = Instant::now();
    let mut first = None;
    let mut last = None;
    let g = session.generate(
        &Prompt::User(question.to_string()),
        &GenerateOptions {
            max_tokens,
            force_switch: force,
            ..GenerateOptions::default()
        },
        &mut |e: &Event| match e {
            Event::Token { .. } => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
            }
            Event::Switch(s) => {
                t.stall_ms = Some(s.timings.cost_ms);
                t.switch_positions = s.timings.recomputed + s.timings.head;
            }
            Event::Lever(l) if l.lever == "refill" => {
                t.refill.0 += l.tokens;
                t.refill.1 += l.cost_ms;
            }
            Event::Lever(l) if l.lever == "fill" => {
                t.fill.0 += l.tokens;
                t.fill.1 += l.cost_ms;
            }
            _ => {}
        },
    )?;
    let end = Instant::now();
    let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
    t.ttft_ms = first.map_or(f64::NAN, |f| ms(t0, f));
    t.answer_ms = last.map_or(f64::NAN, |l| ms(t0, l));
    t.wait_after_ms = last.map_or(f64::NAN, |l| ms(l, end));
    t.text = g.text;
    Ok(t)
}

/// A conversation whose first turn (the notes) was read on `rung`, kept to be woken again:
/// the state file, and the first turn's prompt tokens per second.
fn first_turn(
    ladder: &Ladder,
    config: ContextConfig,
    opts: &SessionOptions,
    rung: usize,
    context: &str,
) -> Result<(StateFile, f64), BenchError> {
    let name = ladder.rungs[rung].name().to_string();
    let mut s = Session::with_options(ladder.clone(), config, &name, opts.clone())?;
    let prompt = format!("{context}\n\nRead these notes; I will ask about them. Reply with OK.");
    let t = turn(&mut s, &prompt, 4, None)?;
    let tokens = s.history().len();
    let file = s.hibernate("bill", tokens)?.ok_or_else(|| {
        BenchError::Config(format!("{name}: the first turn left nothing to keep"))
    })?;
    Ok((file, tokens as f64 / (t.ttft_ms / 1e3)))
}

/// One repetition: the switched answer, the next one, and the fill between them (positions,
/// ms).
type Rep = (Turn, Turn, (usize, f64));

/// How a repetition goes after the switched answer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    /// The next prompt the moment the answer ends.
    AtOnce,
    /// The next prompt once the fill is done.
    AfterFill,
}

/// One repetition of an arm: woken from `file`, the first question with the forced switch
/// (`force`), then the second one. The two turns, and the fill between them (positions, ms).
fn rep(
    s: &mut Session,
    file: &StateFile,
    force: Option<(usize, usize)>,
    next: Next,
    max_tokens: usize,
) -> Result<Rep, BenchError> {
    s.wake(file)?;
    let a = turn(s, FACTS[0].1, max_tokens, force)?;
    let mut fill = (0, 0.0);
    if next == Next::AfterFill {
        let t0 = Instant::now();
        fill.0 = s.fill_idle(usize::MAX)?.read;
        fill.1 = t0.elapsed().as_secs_f64() * 1e3;
    }
    let b = turn(s, FACTS[1].1, max_tokens, None)?;
    Ok((a, b, fill))
}

fn spread(v: &[f64]) -> Spread {
    Spread::of(v)
}

fn stated(answers: &[String]) -> usize {
    answers
        .chunks(2)
        .map(|p| p.iter().zip(FACTS).filter(|(a, f)| a.contains(f.2)).count())
        .sum()
}

/// Runs the bench; `progress` is told what runs.
///
/// # Errors
/// A session or engine failure.
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    o: &BillOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BillRow>, BenchError> {
    let base = SessionOptions {
        projector_dirs: o.projector_dirs.clone(),
        observe_footprint: false,
        standby: false,
        ..SessionOptions::default()
    };
    let (from, to) = (o.from, o.to);
    let route = format!("{}→{}", ladder.rungs[from].name(), ladder.rungs[to].name());
    let mut rows = Vec::new();
    for &length in &o.lengths {
        let context = {
            let name = ladder.rungs[to].name().to_string();
            let mut s = Session::with_options(ladder.clone(), config, &name, base.clone())?;
            let live = s
                .rung_mut(to)
                .ok_or_else(|| BenchError::Config(format!("rung {name} is not loaded")))?;
            let model = live.model();
            notes(length, &|t: &str| {
                model.tokenize(t, false).map_or(0, |v| v.len())
            })
        };
        progress(&format!(
            "{route} at ~{length} tokens: the first turn on each rung"
        ));
        let (src_file, _) = first_turn(ladder, config, &base, from, &context)?;
        let (dst_file, prefill_rate) = first_turn(ladder, config, &base, to, &context)?;
        let context_tokens = src_file.meta.tokens.len();
        let force = Some((1, to));
        let arms: [(&str, SessionOptions); 3] = [
            ("molt", base.clone()),
            (
                "molt-fill-at-end",
                SessionOptions {
                    fill_at_end: true,
                    ..base.clone()
                },
            ),
            (
                "reprefill",
                SessionOptions {
                    strategy: Strategy::Reprefill,
                    ..base.clone()
                },
            ),
        ];
        let mut turns: BTreeMap<String, Vec<Rep>> = BTreeMap::new();
        let src_name = ladder.rungs[from].name().to_string();
        for (arm, opts) in &arms {
            let mut s = Session::with_options(ladder.clone(), config, &src_name, opts.clone())?;
            for r in 0..o.reps {
                progress(&format!(
                    "{route} at {context_tokens} tokens: {arm}, rep {}",
                    r + 1
                ));
                if *arm == "molt" {
                    let at_once = rep(&mut s, &src_file, force, Next::AtOnce, o.max_tokens)?;
                    turns.entry("molt".into()).or_default().push(at_once);
                    let after = rep(&mut s, &src_file, force, Next::AfterFill, o.max_tokens)?;
                    turns
                        .entry("molt-after-fill".into())
                        .or_default()
                        .push(after);
                } else {
                    let x = rep(&mut s, &src_file, force, Next::AtOnce, o.max_tokens)?;
                    turns.entry((*arm).into()).or_default().push(x);
                }
            }
        }
        {
            let mut s = Session::with_options(
                ladder.clone(),
                config,
                ladder.rungs[to].name(),
                base.clone(),
            )?;
            for r in 0..o.reps {
                progress(&format!(
                    "{route} at {context_tokens} tokens: native, rep {}",
                    r + 1
                ));
                let x = rep(&mut s, &dst_file, None, Next::AtOnce, o.max_tokens)?;
                turns.entry("native".into()).or_default().push(x);
            }
        }
        let of = |arm: &str, f: &dyn Fn(&Rep) -> f64| -> Spread {
            spread(&turns[arm].iter().map(f).collect::<Vec<_>>())
        };
        let after = &turns["molt-after-fill"];
        let bill: Vec<f64> = after
            .iter()
            .map(|(a, _, f)| a.stall_ms.unwrap_or(0.0) + a.refill.1 + f.1)
            .collect();
        let positions: Vec<f64> = after
            .iter()
            .map(|(a, _, f)| (a.switch_positions + a.refill.0 + f.0) as f64)
            .collect();
        let fill_rate = {
            let (p, ms): (usize, f64) = after
                .iter()
                .fold((0, 0.0), |(p, ms), (_, _, f)| (p + f.0, ms + f.1));
            if ms > 0.0 {
                p as f64 / (ms / 1e3)
            } else {
                f64::NAN
            }
        };
        let mut recall = BTreeMap::new();
        let mut answers = BTreeMap::new();
        for (arm, reps) in &turns {
            let texts: Vec<String> = reps
                .iter()
                .flat_map(|(a, b, _)| [a.text.clone(), b.text.clone()])
                .collect();
            recall.insert(arm.clone(), format!("{}/{}", stated(&texts), texts.len()));
            answers.insert(arm.clone(), texts.into_iter().take(2).collect());
        }
        rows.push(BillRow {
            route: route.clone(),
            context_tokens,
            reps: o.reps,
            stall_ms: of("molt-after-fill", &|x| x.0.stall_ms.unwrap_or(f64::NAN)),
            whole_bill_ms: spread(&bill),
            whole_bill_positions: spread(&positions),
            reprefill_ms: of("reprefill", &|x| x.0.stall_ms.unwrap_or(f64::NAN)),
            fill_positions: of("molt-after-fill", &|x| x.2.0 as f64),
            fill_ms: of("molt-after-fill", &|x| x.2.1),
            fill_rate_ratio: fill_rate / prefill_rate,
            prefill_tokens_per_s: prefill_rate,
            answer_ms: of("molt", &|x| x.0.answer_ms),
            answer_reprefill_ms: of("reprefill", &|x| x.0.answer_ms),
            wait_after_answer_ms: of("molt", &|x| x.0.wait_after_ms),
            wait_after_answer_fill_at_end_ms: of("molt-fill-at-end", &|x| x.0.wait_after_ms),
            next_ttft_ms: of("molt", &|x| x.1.ttft_ms),
            next_ttft_after_fill_ms: of("molt-after-fill", &|x| x.1.ttft_ms),
            next_ttft_reprefill_ms: of("reprefill", &|x| x.1.ttft_ms),
            next_ttft_native_ms: of("native", &|x| x.1.ttft_ms),
            recall,
            answers,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::{FACTS, notes, stated};

    #[test]
    fn the_notes_hold_both_facts_in_order_and_reach_their_length() {
        let count = |t: &str| t.split_whitespace().count();
        let n = notes(600, &count);
        assert!(count(&n) >= 560, "{}", count(&n));
        let (a, b) = (n.find(FACTS[0].0).unwrap(), n.find(FACTS[1].0).unwrap());
        assert!(a < b);
    }

    #[test]
    fn an_answer_counts_when_it_states_its_own_fact() {
        let answers = [
            "The code is 4826.".to_string(),
            "Locker 17.".to_string(),
            "It is 17.".to_string(),
            "Locker 4826.".to_string(),
        ];
        assert_eq!(stated(&answers), 2);
    }
}
