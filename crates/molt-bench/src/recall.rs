//! The recall benchmark: does the answer still know what the context said after a switch?
//!
//! Fluency proxies (handoff JSD, judge perplexity) rate a size-route answer well while it
//! confabulates the port number it was given. This benchmark asks what a user checks by hand:
//! context-QA items (a fact inside ~256–1,800 tokens of notes, then a question), a switch
//! before answer token 1 or mid-answer (after a preamble the item asks for), and an automatic
//! score — every expected string present, case-insensitive — beside the native destination's
//! recall on the same items.
//!
//! Affordable on 2 cores: the source reads each item once, generates up to the switch point
//! and exports its sequence state; that one blob seeds every arm of every route out of that
//! source (exactly what a shed-first switch carries), and the source then finishes its own
//! native answer. Each arm runs the library's own switch ([`migrate::transplant_exported`],
//! [`migrate::reprefill_from`]) on a loaded destination, so `cost_ms` is the switch without
//! the destination's load (reported apart by the session; the stall benchmark's business).
//!
//! Main items: [`RecallItem`] / [`read_items`], [`Arm`] / [`default_arms`], [`run`] →
//! [`RecallDoc`] (`results/recall.json`).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::BenchError;
use molt::engine::{ChatMessage, Context, ContextConfig, Span, Token, argmax};
use molt::ladder::Ladder;
use molt::routes::{RouteKind, Routes, Variant, route_kind};
use molt::session::migrate::{self, Exported, Reread};
use molt::session::{DEFAULT_HEAD_REREAD, LiveRung, SessionOptions};
use molt::transplant::select::{
    Rest, SelectRule, Sentences, TokenRecompute, Unit, residual_scores, select_spans,
};

/// Where the switch falls in the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SwitchPoint {
    /// Before answer token 1: the whole answer after its first token is the destination's.
    First,
    /// Mid-answer: after a preamble the item asks for, before the fact is written.
    Mid,
}

/// One context-QA item (a line of `benches/recall/items.jsonl`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecallItem {
    /// Unique id.
    pub id: String,
    /// Kind of fact (number, identifier, name, string, two-part).
    pub kind: String,
    /// Kind of context the fact stands in: `notes` (prose paragraphs, the default),
    /// `repetitive` (the same few paragraphs again and again), `code`, `log`, `conversation`
    /// (a transcript, the fact many turns back), `two-place` (the answer joins two sentences).
    #[serde(default = "notes")]
    pub context_kind: String,
    /// Intended context length in tokens (the row's bucket; the measured length is reported).
    pub length: usize,
    /// Where the fact sits: start, middle, end.
    pub position: String,
    /// Switch point.
    pub switch: SwitchPoint,
    /// The notes.
    pub context: String,
    /// The question (and, for mid items, the preamble it asks for first).
    pub question: String,
    /// Strings that must all appear in a correct answer.
    pub expected: Vec<String>,
    /// Tokens of the answer, when the item needs another length than its switch point's
    /// (a summary of every fact needs ~200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// The answer token a mid item switches before, when not the run's
    /// ([`RecallOptions::mid_switch_at`]): a summary is caught after its first bullets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch_token: Option<usize>,
}

fn notes() -> String {
    "notes".into()
}

impl RecallItem {
    /// Whether the text `read` holds every expected string the context holds (what an
    /// answer needs from it; a value the answer must infer, as a two-place item's weekday,
    /// is not asked of it), matched as [`RecallItem::scores`] does.
    #[must_use]
    pub fn read_in(&self, read: &str) -> bool {
        let (r, c) = (normalised(read), normalised(&self.context));
        self.expected
            .iter()
            .map(|e| e.to_lowercase())
            .filter(|e| c.contains(e))
            .all(|e| r.contains(&e))
    }

    /// The user message: the notes, then the question.
    #[must_use]
    pub fn message(&self) -> String {
        format!("{}\n\n{}", self.context.trim_end(), self.question.trim())
    }

    /// Whether `answer` holds every expected string (case-insensitive; a comma between two
    /// digits is ignored, so "44,172" is 44172, as a reader would take it).
    #[must_use]
    pub fn scores(&self, answer: &str) -> bool {
        let a = normalised(answer);
        self.expected.iter().all(|e| a.contains(&e.to_lowercase()))
    }

    /// The share of the expected strings `answer` holds, matched as [`RecallItem::scores`]
    /// does: for a summary, how many of the notes' facts it states.
    #[must_use]
    pub fn facts(&self, answer: &str) -> f64 {
        let a = normalised(answer);
        let n = self
            .expected
            .iter()
            .filter(|e| a.contains(&e.to_lowercase()))
            .count();
        #[allow(clippy::cast_precision_loss)]
        let share = n as f64 / self.expected.len().max(1) as f64;
        share
    }
}

/// `answer` lower-cased, a comma between two digits dropped.
fn normalised(answer: &str) -> String {
    let chars: Vec<char> = answer.to_lowercase().chars().collect();
    chars
        .iter()
        .enumerate()
        .filter(|&(i, &c)| {
            !(c == ','
                && i > 0
                && chars[i - 1].is_ascii_digit()
                && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        })
        .map(|(_, &c)| c)
        .collect()
}

/// A line of the item file that could not be used, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ItemProblem {
    /// 1-based line.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// Reads an item file: one JSON object per line, blank lines and `#` comments skipped. A
/// malformed line is reported with its number and the rest still run; an item without
/// expected strings (or with an empty one) is refused by its id, and so is a repeated id.
///
/// # Errors
/// [`BenchError::Io`] when the file cannot be read.
pub fn read_items(path: &Path) -> Result<(Vec<RecallItem>, Vec<ItemProblem>), BenchError> {
    let bytes = std::fs::read(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut items: Vec<RecallItem> = Vec::new();
    let mut problems = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let Ok(text) = std::str::from_utf8(raw) else {
            problems.push(ItemProblem {
                line,
                message: "not valid UTF-8".into(),
            });
            continue;
        };
        let text = text.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        match serde_json::from_str::<RecallItem>(text) {
            Err(e) => problems.push(ItemProblem {
                line,
                message: format!("not a recall item: {e}"),
            }),
            Ok(item) if item.expected.is_empty() || item.expected.iter().any(String::is_empty) => {
                problems.push(ItemProblem {
                    line,
                    message: format!(
                        "item {:?} has no expected strings (or an empty one): it could never be scored",
                        item.id
                    ),
                });
            }
            Ok(item) if items.iter().any(|x| x.id == item.id) => problems.push(ItemProblem {
                line,
                message: format!("item id {:?} repeats an earlier line's", item.id),
            }),
            Ok(item) => items.push(item),
        }
    }
    Ok((items, problems))
}

/// How an arm continues the answer on the destination.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "kebab-case")]
pub enum ArmMethod {
    /// No switch: the source answers alone.
    NativeSource,
    /// No switch: the destination reads the prompt itself and answers alone.
    NativeDestination,
    /// Condition C: the destination re-reads prompt + generated text at the switch.
    Reprefill,
    /// A Molt switch: projection, head re-read, optional tail and selective token recompute.
    Transplant {
        /// Head positions re-read natively.
        head: usize,
        /// Tail positions re-read natively.
        tail: usize,
        /// Selective token recompute.
        recompute: Option<TokenRecompute>,
        /// Refill: history positions the destination re-reads natively in place, in the batch
        /// of every answer token, until the newest (0: off), as
        /// [`SessionOptions::refill_chunk`].
        #[serde(default)]
        refill: usize,
        /// The refill's deadline in tokens, as [`SessionOptions::refill_within`] (0: none, a
        /// fixed chunk).
        #[serde(default)]
        refill_within: usize,
        /// The refill's pace, as [`SessionOptions::refill_pace`] (0: unpaced, the chunk and
        /// deadline alone).
        #[serde(default, skip_serializing_if = "is_unpaced")]
        refill_pace: f64,
        /// A hurried sparse read, as [`SessionOptions::hurry`]: the newest positions read
        /// before the first token, the rest of the chosen ones after it (0: the whole read
        /// before).
        #[serde(default, skip_serializing_if = "super::is_zero_count")]
        hurry: usize,
        /// What happens to the positions the switch does not re-read
        /// ([`Uncovered::Projected`] unless the arm says otherwise).
        #[serde(default, skip_serializing_if = "Uncovered::is_projected")]
        uncovered: Uncovered,
    },
}

/// What a size switch does with the positions it does not re-read natively, besides what the
/// recompute setting's [`Rest`] says (a sparse read leaves them out).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Uncovered {
    /// Projected from the source's cache (the shipped switch).
    #[default]
    Projected,
    /// Projected, then forgotten before the first decode (SnapKV's eviction, by the source's
    /// choice): the answer attends only to the head, the re-read sentences and the question
    /// until the refill has re-read the rest in place.
    Forgotten,
}

fn is_unpaced(f: &f64) -> bool {
    *f <= 1.0
}

impl Uncovered {
    fn is_projected(&self) -> bool {
        *self == Self::Projected
    }
}

/// One arm of the benchmark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arm {
    /// Its name in the results.
    pub name: String,
    /// What it does.
    #[serde(flatten)]
    pub method: ArmMethod,
}

impl Arm {
    fn transplant(name: &str, head: usize, tail: usize, recompute: Option<TokenRecompute>) -> Self {
        Self::refilled(name, head, tail, recompute, (0, 0))
    }

    /// A transplant with a refill of `(chunk, within)` ([`SessionOptions::refill_chunk`],
    /// [`SessionOptions::refill_within`]).
    fn refilled(
        name: &str,
        head: usize,
        tail: usize,
        recompute: Option<TokenRecompute>,
        (refill, refill_within): (usize, usize),
    ) -> Self {
        Self {
            name: name.into(),
            method: ArmMethod::Transplant {
                head,
                tail,
                recompute,
                refill,
                refill_within,
                refill_pace: 0.0,
                hurry: 0,
                uncovered: Uncovered::Projected,
            },
        }
    }

    /// This arm, named `name`, with its refill paced at `factor` ([`SessionOptions::refill_pace`]).
    fn paced(mut self, factor: f64, name: &str) -> Self {
        if let ArmMethod::Transplant { refill_pace, .. } = &mut self.method {
            *refill_pace = factor;
        }
        self.name = name.into();
        self
    }

    /// This arm, named `name`, its sparse read hurried ([`SessionOptions::hurry`]).
    fn hurried(mut self, keep: usize, name: &str) -> Self {
        if let ArmMethod::Transplant { hurry, .. } = &mut self.method {
            *hurry = keep;
        }
        self.name = name.into();
        self
    }

    /// This arm, named `name`, doing `with` to the positions it does not re-read.
    fn leaving(mut self, with: Uncovered, name: &str) -> Self {
        if let ArmMethod::Transplant { uncovered, .. } = &mut self.method {
            *uncovered = with;
        }
        self.name = name.into();
        self
    }

    /// Whether this arm is what a session does on `kind` when nothing is set.
    #[must_use]
    pub fn is_default(&self, kind: RouteKind) -> bool {
        let d = SessionOptions::default();
        let refills = d.refills(kind);
        let recompute = d.token_recompute.filter(|_| kind == RouteKind::Size);
        let (refill_chunk, within, pace) = if refills {
            (d.refill_chunk, d.refill_within, d.refill_pace)
        } else {
            (0, 0, 0.0)
        };
        let pace = if is_unpaced(&pace) { 0.0 } else { pace };
        match self.method {
            ArmMethod::Transplant {
                head,
                tail,
                recompute: r,
                refill,
                refill_within,
                refill_pace,
                hurry,
                uncovered,
            } => {
                uncovered == Uncovered::Projected
                    && hurry == if r.is_some() { d.hurry } else { 0 }
                    && head == d.head_reread
                    && tail == d.research.tail_recompute
                    && r == recompute
                    && refill == refill_chunk
                    && (refill == 0 || (refill_within == within && refill_pace == pace))
            }
            _ => false,
        }
    }
}

/// The arm catalogue: natives, re-prefill, the projection alone, the head re-read, tail
/// recompute, and selective token recompute at three fractions by attention and two by chance
/// (the control). `names` picks by name (empty: all).
#[must_use]
pub fn default_arms(names: &[String]) -> Vec<Arm> {
    let h = DEFAULT_HEAD_REREAD;
    let follow = |r: f64| TokenRecompute {
        follow: 8,
        ..TokenRecompute::attention(r)
    };
    let wide = |r: f64| TokenRecompute {
        neighbours: 8,
        ..TokenRecompute::attention(r)
    };
    let random_follow = |r: f64| TokenRecompute {
        rule: SelectRule::Random,
        ..follow(r)
    };
    let random_sent = |r: f64| TokenRecompute {
        rule: SelectRule::Random,
        ..TokenRecompute::sentences(r)
    };
    let sent_floor = |r: f64, min_positions: usize| TokenRecompute {
        min_positions,
        ..TokenRecompute::sentences(r)
    };
    let random = |r: f64| TokenRecompute {
        rule: SelectRule::Random,
        ..TokenRecompute::attention(r)
    };
    // The default's choice with the rest projected (`--switch-rest projected`).
    let projected_rest = TokenRecompute {
        rest: Rest::Projected,
        ..TokenRecompute::default_size()
    };
    let all = vec![
        Arm {
            name: "native-source".into(),
            method: ArmMethod::NativeSource,
        },
        Arm {
            name: "native-destination".into(),
            method: ArmMethod::NativeDestination,
        },
        Arm {
            name: "reprefill".into(),
            method: ArmMethod::Reprefill,
        },
        Arm::transplant("projection", 0, 0, None),
        Arm::transplant("head4", h, 0, None),
        Arm::transplant("head4+tail32", h, 32, None),
        Arm::transplant("attn-r05", h, 0, Some(TokenRecompute::attention(0.05))),
        Arm::transplant("attn-r10", h, 0, Some(TokenRecompute::attention(0.10))),
        Arm::transplant("attn-r20", h, 0, Some(TokenRecompute::attention(0.20))),
        Arm::transplant("attn-r15", h, 0, Some(TokenRecompute::attention(0.15))),
        Arm::transplant("attn-r05-f8", h, 0, Some(follow(0.05))),
        Arm::transplant("attn-r10-f8", h, 0, Some(follow(0.10))),
        Arm::transplant("attn-r05-w8", h, 0, Some(wide(0.05))),
        Arm::transplant("attn-r10-w8", h, 0, Some(wide(0.10))),
        Arm::transplant("random-r10", h, 0, Some(random(0.10))),
        Arm::transplant("random-r05-f8", h, 0, Some(random_follow(0.05))),
        Arm::transplant("random-r10-f8", h, 0, Some(random_follow(0.10))),
        Arm::transplant("random-r20", h, 0, Some(random(0.20))),
        Arm::transplant("sent-r10", h, 0, Some(TokenRecompute::sentences(0.10))),
        Arm::transplant("sent-r15", h, 0, Some(TokenRecompute::sentences(0.15))),
        Arm::transplant("sent-r20", h, 0, Some(TokenRecompute::sentences(0.20))),
        Arm::transplant("random-sent-r15", h, 0, Some(random_sent(0.15))),
        Arm::transplant("sent-r10-m48", h, 0, Some(sent_floor(0.10, 48))),
        Arm::transplant("sent-r10-m64", h, 0, Some(sent_floor(0.10, 64))),
        Arm::transplant("sent-r08-m64", h, 0, Some(sent_floor(0.08, 64))),
        Arm::transplant(
            "random-sent-r10-m64",
            h,
            0,
            Some(TokenRecompute {
                rule: SelectRule::Random,
                ..sent_floor(0.10, 64)
            }),
        ),
        // The default's shape, chosen by what the maps lose instead of what the question
        // reads: the selection rule's ablation.
        Arm::transplant(
            "resid-sent-r10-m64",
            h,
            0,
            Some(TokenRecompute {
                rule: SelectRule::Residual,
                ..sent_floor(0.10, 64)
            }),
        ),
        // The default switch, then the history re-read natively behind the answer: the
        // projection's error lasts until the refill catches up (a re-prefill's compute,
        // spread over the next tokens instead of stalling the first).
        Arm::refilled(
            "sent-r10-m64+refill64",
            h,
            0,
            Some(sent_floor(0.10, 64)),
            (64, 0),
        ),
        Arm::refilled(
            "sent-r10-m64+refill256",
            h,
            0,
            Some(sent_floor(0.10, 64)),
            (256, 0),
        ),
        // The refill with a deadline: 64 per token, or what reaches the newest token within 8.
        // A choice covering half the cache re-reads all of it (`whole_from`: it covers 21-25%
        // at ~512 tokens and less beyond, so only ~256-token items can differ), the rest
        // projected (`--switch-rest projected`).
        Arm::refilled(
            "sent-r10-m64+refill64-w8",
            h,
            0,
            Some(projected_rest),
            (64, 8),
        ),
        // The same refill without the switch's selective recompute: the stall of a size
        // switch is mostly that recompute; the refill re-reads every position anyway.
        Arm::refilled("head4+refill64-w8", h, 0, None, (64, 8)),
        // The projected default with the cells it leaves projected forgotten until the refill
        // re-reads them: the answer's first tokens read only native cells.
        Arm::refilled(
            "sent-r10-m64+refill64-w8",
            h,
            0,
            Some(projected_rest),
            (64, 8),
        )
        .leaving(Uncovered::Forgotten, "sent-r10-m64-evict+refill64-w8"),
        Arm::transplant("sent-r10-m64", h, 0, Some(sent_floor(0.10, 64)))
            .leaving(Uncovered::Forgotten, "sent-r10-m64-evict"),
        // No projection at all (`Rest::LeftOut`, the session's default): the
        // destination reads what the projected default would re-read (the sentences the
        // question looks at, the question) natively at their own positions, the rest left out
        // until the refill reads it.
        Arm::refilled(
            "sparse-r10-m64+refill64-w8",
            h,
            0,
            Some(TokenRecompute::default_size()),
            (64, 8),
        ),
        // The same, its refill paced to three of the destination's own gaps a token (the
        // session's default).
        Arm::refilled(
            "sparse-r10-m64+refill64-w8",
            h,
            0,
            Some(TokenRecompute::default_size()),
            (64, 8),
        )
        .paced(3.0, "sparse-r10-m64+refill64-w8-p3"),
        // The same, hurried: the newest 8 positions read before the first token, the chosen
        // ones after it, paced, before the refill's pass.
        Arm::refilled(
            "sparse-r10-m64+refill64-w8",
            h,
            0,
            Some(TokenRecompute::default_size()),
            (64, 8),
        )
        .paced(3.0, "sparse-r10-m64+refill64-w8-p3")
        .hurried(8, "sparse-r10-m64+refill64-w8-p3-h8"),
        Arm::transplant("sparse-r10-m64", h, 0, Some(TokenRecompute::default_size())),
        // The default with every copy of a repeated sentence ranked on its own: the ablation
        // of [`TokenRecompute::distinct`].
        Arm::transplant(
            "sparse-r10-m64-copies",
            h,
            0,
            Some(TokenRecompute {
                distinct: false,
                ..TokenRecompute::default_size()
            }),
        ),
    ];
    if names.is_empty() {
        return all;
    }
    all.into_iter()
        .filter(|a| names.iter().any(|n| n == &a.name))
        .collect()
}

/// Settings of one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecallOptions {
    /// Routes `(source, destination)` by rung index.
    pub routes: Vec<(usize, usize)>,
    /// Arms for size routes.
    pub size_arms: Vec<Arm>,
    /// Arms for precision routes.
    pub precision_arms: Vec<Arm>,
    /// Tokens per answer for items switched before token 1.
    pub max_tokens_first: usize,
    /// Tokens per answer for mid-answer items.
    pub max_tokens_mid: usize,
    /// The generated-token index a mid item switches before.
    pub mid_switch_at: usize,
    /// Run the precision routes on every `n`-th item only (1: all): their destination reads
    /// cost twice a size route's.
    pub precision_every: usize,
    /// Projector family on precision routes: [`Variant::Auto`] (the fitted diagonal maps, as a
    /// session uses) or [`Variant::Identity`] (the cache carried unchanged, which needs no
    /// fitting: how a precision rung without fitted maps is measured).
    #[serde(default = "auto_variant")]
    pub precision_variant: Variant,
    /// Where the answers so far are written after every item (`None`: nowhere).
    #[serde(skip)]
    pub partial: Option<std::path::PathBuf>,
    /// Items already answered, as `(item id, route)`: not run again on that route (a source
    /// whose every route is answered for an item does not read it). For a run that adds items
    /// to an earlier one ([`merge`]).
    #[serde(skip)]
    pub answered: std::collections::BTreeSet<(String, String)>,
}

fn auto_variant() -> Variant {
    Variant::Auto
}

/// One item's answer in one arm.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecallAnswer {
    /// Item id.
    pub id: String,
    /// Arm name.
    pub arm: String,
    /// Route `src→dst`.
    pub route: String,
    /// The item's kind of context ([`RecallItem::context_kind`]).
    #[serde(default = "notes")]
    pub context_kind: String,
    /// Prompt tokens.
    pub context_tokens: usize,
    /// Generated-token index of the switch (0 for the natives).
    pub switch_at: usize,
    /// The answer's text.
    pub answer: String,
    /// Every expected string present.
    pub ok: bool,
    /// The share of the expected strings present (a summary's facts stated).
    #[serde(default)]
    pub facts: f64,
    /// Switch cost, ms (0 for the natives).
    pub cost_ms: f64,
    /// Positions re-read by selective token recompute.
    pub recomputed: usize,
    /// Their text, span by span (what the selection chose), before the always-read question.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reread: Vec<String>,
    /// Whether the positions read natively before the question (the head and the chosen
    /// spans) hold the fact ([`RecallItem::read_in`]); `None` for an arm that chooses nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fact_read: Option<bool>,
    /// A background refill's time, ms, spread over the answer's tokens after the switch (not
    /// in `cost_ms`, the stall before the next token).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refill_ms: f64,
    /// The answer token before which the refill took over the live cache (`None`: it did not
    /// catch up before the answer ended, or no refill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_at: Option<usize>,
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// A `{median, min, max}` summary.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
}

impl Spread {
    fn of(xs: &[f64]) -> Self {
        if xs.is_empty() {
            return Self::default();
        }
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            f64::midpoint(v[n / 2 - 1], v[n / 2])
        };
        Self {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// One row: an arm on a route at one context length and switch point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecallRow {
    /// Arm name.
    pub arm: String,
    /// Whether it is what a session does when nothing is set.
    pub default: bool,
    /// Route `src→dst`.
    pub route: String,
    /// `precision` or `size`.
    pub route_kind: String,
    /// The items' kind of context ([`RecallItem::context_kind`]).
    #[serde(default = "notes")]
    pub context_kind: String,
    /// The items' intended context length (bucket).
    pub context_tokens: usize,
    /// Measured prompt tokens, median over the row's items.
    pub measured_tokens: usize,
    /// `first` or `mid`.
    pub switch_at: SwitchPoint,
    /// Items in the row.
    pub items: usize,
    /// Share answered correctly.
    pub recall: f64,
    /// The native destination's recall on the same items.
    pub destination_recall: f64,
    /// The re-prefill's recall on the same items (0 when it was not run).
    #[serde(default)]
    pub reprefill_recall: f64,
    /// The share of the expected strings the answers hold, mean over the row's items (a
    /// summary's facts stated; for one-fact items, the recall).
    #[serde(default)]
    pub facts: f64,
    /// The same for the native destination on the same items.
    #[serde(default)]
    pub destination_facts: f64,
    /// Switch cost, ms.
    pub cost_ms: Spread,
    /// The re-prefill's cost at the same points, ms.
    pub reprefill_ms: Spread,
    /// Positions re-read by selective recompute, median.
    pub recomputed: f64,
    /// A background refill's time, ms, spread over the tokens after the switch (arms with a
    /// refill only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_ms: Option<Spread>,
}

/// `results/recall.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecallDoc {
    /// The item file.
    pub items_file: String,
    /// Items run.
    pub n_items: usize,
    /// Lines of the item file that were not run, and why.
    pub problems: Vec<ItemProblem>,
    /// The run's settings.
    pub options: RecallOptions,
    /// One row per arm × route × length × switch point.
    pub rows: Vec<RecallRow>,
    /// Every answer.
    pub answers: Vec<RecallAnswer>,
    /// Wall time of the run, s.
    pub seconds: f64,
    /// Machine and versions ([`super::RunInfo`]).
    #[serde(default)]
    pub run: serde_json::Value,
}

/// A subset: the first `per` items of every length × switch point (1 for a smoke check).
#[must_use]
pub fn sample(items: &[RecallItem], per: usize) -> Vec<RecallItem> {
    let mut seen: BTreeMap<(usize, bool), usize> = BTreeMap::new();
    items
        .iter()
        .filter(|i| {
            let n = seen
                .entry((i.length, i.switch == SwitchPoint::Mid))
                .or_default();
            *n += 1;
            *n <= per
        })
        .cloned()
        .collect()
}

fn engine(rung: &str) -> impl Fn(molt::engine::EngineError) -> BenchError + '_ {
    move |source| BenchError::Engine {
        rung: rung.to_string(),
        source,
    }
}

/// Greedy continuation on `ctx` (whose logits are ready) until `max` tokens are in `out` or
/// the model ends its turn.
fn continue_greedy(
    ctx: &mut Context,
    out: &mut Vec<Token>,
    max: usize,
    name: &str,
) -> Result<(), BenchError> {
    while out.len() < max {
        let t = argmax(ctx.logits());
        if ctx.model().is_eog(t) {
            break;
        }
        out.push(t);
        if out.len() < max {
            ctx.decode(&[t]).map_err(engine(name))?;
        }
    }
    Ok(())
}

/// Greedy continuation with a refill, as a session's [`SessionOptions::refill_chunk`] runs
/// one: `history` is what the destination's cache holds before the answer token `out.last()`
/// (just decoded on `ctx`, its logits ready), and `from` the first position to re-read (the end
/// of the head re-read). Every answer token is decoded in one batch with the next `chunk`
/// positions of the history re-read in place, until the newest token. Returns the refill's
/// time, ms (its batches, their tokens' decodes included), and the answer token before which it
/// reached the newest token (`None`: the answer ended first).
pub fn continue_refilling(
    ctx: &mut Context,
    history: &[Token],
    (mut first, from): (VecDeque<Range<usize>>, usize),
    out: &mut Vec<Token>,
    max: usize,
    chunk: usize,
    mut pace: Option<molt::session::RefillPace>,
) -> Result<(f64, Option<usize>), BenchError> {
    let name = ctx.model().name().to_string();
    let mut full: Vec<Token> = history.to_vec();
    full.extend(out.last().copied());
    let mut next = Some(from);
    let mut ms = 0.0;
    let mut done_at = None;
    while out.len() < max {
        let t = argmax(ctx.logits());
        if ctx.model().is_eog(t) {
            break;
        }
        out.push(t);
        if out.len() >= max {
            break;
        }
        let n_past = ctx.n_past().min(full.len());
        match next {
            Some(a) if a < n_past || !first.is_empty() => {
                let step = pace.map_or(chunk, |p| p.positions(chunk));
                let t0 = Instant::now();
                if step == 0 {
                    // As the session's paced refill: the rung's own gap timed first.
                    ctx.decode(&[t]).map_err(engine(&name))?;
                    if let Some(p) = pace.as_mut() {
                        p.observe(0, t0.elapsed().as_secs_f64() * 1e3);
                    }
                    full.push(t);
                    continue;
                }
                // As the session's refill reads it: a hurried switch's positions first.
                let read = if first.is_empty() {
                    let end = molt::session::reread_then_decode(ctx, &full, a, step, t)
                        .map_err(engine(&name))?;
                    next = Some(end);
                    end - a
                } else {
                    let ranges = molt::session::take_chunk(&mut first, step, n_past);
                    molt::session::read_ranges_then_decode(ctx, &full, &ranges, t)
                        .map_err(engine(&name))?
                };
                let step_ms = t0.elapsed().as_secs_f64() * 1e3;
                ms += step_ms;
                if let Some(p) = pace.as_mut() {
                    p.observe(read, step_ms);
                }
                if first.is_empty() && next.is_some_and(|e| e >= n_past) {
                    next = None;
                    done_at = Some(out.len());
                }
            }
            _ => ctx.decode(&[t]).map_err(engine(&name))?,
        }
        full.push(t);
    }
    Ok((ms, done_at))
}

/// [`SelectRule::Residual`]'s scores for a source state: the route's maps there and back.
fn residual_of(
    blob: &[u8],
    forward: &molt::transplant::projector::Projector,
    routes: &mut Routes,
    (s, d): (usize, usize),
) -> Result<Vec<f32>, BenchError> {
    let back = routes
        .get(d, s)
        .map_err(molt::session::SessionError::from)?;
    let (_, stream) = molt::kv::KvSnapshot::parse_single_stream(blob)
        .map_err(|e| BenchError::Config(format!("the source's exported state: {e}")))?;
    residual_scores(&stream, forward, &back)
        .map_err(|e| BenchError::Config(format!("residual scores: {e}")))
}

/// What the source hands every arm of one item.
struct SourceRead {
    tokens: Vec<Token>,
    /// The answer's tokens up to and including the one sampled before the switch.
    before: Vec<Token>,
    /// The source's exported state at the switch (history = prompt + `before` minus its last).
    blob: Vec<u8>,
    mass: Vec<f32>,
    native: Vec<Token>,
    /// The source ended its answer before the switch point.
    ended_early: bool,
}

fn read_on_source(
    src: &mut Context,
    item: &RecallItem,
    switch_at: usize,
    max: usize,
    window: usize,
) -> Result<SourceRead, BenchError> {
    let name = src.model().name().to_string();
    let text = src
        .model()
        .apply_chat_template(&[ChatMessage::new("user", &item.message())], true)
        .map_err(engine(&name))?;
    let tokens = src.model().tokenize(&text, true).map_err(engine(&name))?;
    src.clear();
    let mass = src
        .decode_observed(&tokens, window)
        .map_err(engine(&name))?
        .unwrap_or_default();
    let mut out = Vec::new();
    let mut ended_early = false;
    while out.len() < switch_at {
        let t = argmax(src.logits());
        if src.model().is_eog(t) {
            ended_early = true;
            break;
        }
        out.push(t);
        if out.len() < switch_at {
            src.decode(&[t]).map_err(engine(&name))?;
        }
    }
    let blob = src.export_state().map_err(engine(&name))?;
    let before = out.clone();
    if let Some(&last) = out.last()
        && !ended_early
    {
        src.decode(&[last]).map_err(engine(&name))?;
        continue_greedy(src, &mut out, max, &name)?;
    }
    Ok(SourceRead {
        tokens,
        before,
        blob,
        mass,
        native: out,
        ended_early,
    })
}

/// Runs the benchmark: every item through every arm of every route, rows summarised per arm ×
/// route × length × switch point. `progress` gets a line per item.
///
/// # Errors
/// A rung that cannot load, a route without a projector, or a decode failure.
#[allow(clippy::too_many_lines)]
pub fn run(
    ladder: &Ladder,
    config: ContextConfig,
    projector_dirs: Vec<std::path::PathBuf>,
    items: &[RecallItem],
    opts: &RecallOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<RecallRow>, Vec<RecallAnswer>), BenchError> {
    let mut precision_routes = Routes::new(ladder, projector_dirs.clone(), opts.precision_variant);
    let mut routes = Routes::new(ladder, projector_dirs, Variant::Auto);
    let window = TokenRecompute::attention(0.1).window;
    let mut answers: Vec<RecallAnswer> = Vec::new();
    let mut kinds: BTreeMap<String, RouteKind> = BTreeMap::new();
    let mut sources: Vec<usize> = opts.routes.iter().map(|r| r.0).collect();
    sources.dedup();
    let src_config = ContextConfig {
        attention_tap: true,
        ..config
    };
    let mut dsts: BTreeMap<usize, LiveRung> = BTreeMap::new();
    for &s in &sources {
        let mut src = LiveRung::load(&ladder.rungs[s], src_config)?;
        let src_name = ladder.rungs[s].name().to_string();
        for &(_, d) in opts.routes.iter().filter(|r| r.0 == s) {
            if let std::collections::btree_map::Entry::Vacant(e) = dsts.entry(d) {
                e.insert(LiveRung::load(&ladder.rungs[d], config)?);
            }
        }
        for (n_item, item) in items.iter().enumerate() {
            let route_name = |d: usize| format!("{}→{}", src_name, ladder.rungs[d].name());
            let todo = |d: usize| !opts.answered.contains(&(item.id.clone(), route_name(d)));
            if !opts.routes.iter().any(|&(s2, d)| s2 == s && todo(d)) {
                continue;
            }
            let (switch_at, max) = match item.switch {
                SwitchPoint::First => (1, opts.max_tokens_first),
                SwitchPoint::Mid => (
                    item.switch_token.unwrap_or(opts.mid_switch_at),
                    opts.max_tokens_mid,
                ),
            };
            let max = item.max_tokens.unwrap_or(max);
            let t_item = Instant::now();
            let read = read_on_source(&mut src.ctx, item, switch_at, max, window)?;
            let n_ctx_tokens = read.tokens.len();
            let answer = |arm: &str,
                          route: &str,
                          toks: &[Token],
                          sw: usize,
                          cost: f64,
                          rc,
                          reread: Vec<String>,
                          head: usize,
                          refill: Option<(f64, Option<usize>)>| {
                let text = src.ctx.model().detokenize(toks);
                let fact_read = (!reread.is_empty()).then(|| {
                    let head = src.ctx.model().detokenize(&read.tokens[..head]);
                    item.read_in(&format!("{head}{}", reread.concat()))
                });
                RecallAnswer {
                    id: item.id.clone(),
                    arm: arm.into(),
                    route: route.into(),
                    context_kind: item.context_kind.clone(),
                    context_tokens: n_ctx_tokens,
                    switch_at: sw,
                    ok: item.scores(&text),
                    facts: item.facts(&text),
                    answer: text,
                    cost_ms: cost,
                    recomputed: rc,
                    reread,
                    fact_read,
                    refill_ms: refill.map_or(0.0, |r| r.0),
                    refill_at: refill.and_then(|r| r.1),
                }
            };
            for &(_, d) in opts.routes.iter().filter(|r| r.0 == s && todo(r.1)) {
                let kind = route_kind(routes.binding(s), routes.binding(d));
                if kind == RouteKind::Precision && n_item % opts.precision_every.max(1) != 0 {
                    continue;
                }
                let route = route_name(d);
                kinds.insert(route.clone(), kind);
                let arms = match kind {
                    RouteKind::Size => &opts.size_arms,
                    RouteKind::Precision => &opts.precision_arms,
                };
                let dst = dsts.get_mut(&d).expect("loaded above");
                let dst_name = dst.name().to_string();
                let projector = match kind {
                    RouteKind::Size => routes.get(s, d),
                    RouteKind::Precision => precision_routes.get(s, d),
                }
                .map_err(molt::session::SessionError::from)?;
                let anchor = routes.anchor(d).ok().flatten();
                let n_past = read.tokens.len() + read.before.len().saturating_sub(1);
                let mut history = read.tokens.clone();
                history.extend_from_slice(&read.before[..read.before.len().saturating_sub(1)]);
                // The round-trip residual of this item's source cache, for the arms that
                // select by it (computed once per route).
                let mut residual: Option<Vec<f32>> = None;
                for arm in arms {
                    let mut reread = Vec::new();
                    let mut head_read = 0;
                    let mut refilled = None;
                    let (toks, sw, cost, rc) = match arm.method {
                        ArmMethod::NativeSource => (read.native.clone(), 0, 0.0, 0),
                        ArmMethod::NativeDestination => {
                            dst.ctx.clear();
                            dst.ctx.decode(&read.tokens).map_err(engine(&dst_name))?;
                            let mut out = Vec::new();
                            continue_greedy(&mut dst.ctx, &mut out, max, &dst_name)?;
                            (out, 0, 0.0, 0)
                        }
                        _ if read.ended_early => (read.native.clone(), 0, 0.0, 0),
                        ArmMethod::Reprefill => {
                            let last = *read.before.last().expect("switch after a token");
                            let t =
                                migrate::reprefill_from(&src_name, &mut dst.ctx, &history, last)?;
                            let mut out = read.before.clone();
                            continue_greedy(&mut dst.ctx, &mut out, max, &dst_name)?;
                            (out, switch_at, t.cost_ms, 0)
                        }
                        ArmMethod::Transplant {
                            head,
                            tail,
                            recompute,
                            refill,
                            refill_within,
                            refill_pace,
                            hurry,
                            uncovered,
                        } => {
                            let last = *read.before.last().expect("switch after a token");
                            let h = head.min(n_past);
                            head_read = h;
                            let tl = tail.min(n_past - h);
                            if recompute.is_some_and(|r| r.rule == SelectRule::Residual)
                                && residual.is_none()
                            {
                                residual =
                                    Some(residual_of(&read.blob, &projector, &mut routes, (s, d))?);
                            }
                            let ranges = recompute.map_or_else(Vec::new, |r| {
                                let scores: &[f32] = match r.rule {
                                    SelectRule::Attention => &read.mass,
                                    SelectRule::Random => &[],
                                    SelectRule::Residual => residual.as_deref().unwrap_or(&[]),
                                };
                                let always = read.tokens.len().saturating_sub(r.window);
                                let text = if r.unit == Unit::Sentence {
                                    let m = src.ctx.model();
                                    let pieces: Vec<Vec<u8>> =
                                        history.iter().map(|&t| m.token_bytes(t)).collect();
                                    Sentences::of(&pieces)
                                } else {
                                    Sentences::default()
                                };
                                select_spans(
                                    scores,
                                    &text,
                                    h,
                                    n_past - tl,
                                    always,
                                    &r,
                                    n_past as u64,
                                )
                            });
                            let window_at = read
                                .tokens
                                .len()
                                .saturating_sub(recompute.map_or(0, |r| r.window));
                            reread = ranges
                                .iter()
                                .filter(|r| r.start < window_at)
                                .map(|r| {
                                    src.ctx
                                        .model()
                                        .detokenize(&history[r.start..r.end.min(window_at)])
                                })
                                .collect();
                            // As a session decides: a sparse read or a projection, and
                            // hurried as a session hurries a sparse read (the newest
                            // positions before the first token, the rest after it).
                            let as_session = SessionOptions {
                                head_reread: h,
                                token_recompute: recompute,
                                research: molt::session::Research {
                                    tail_recompute: tl,
                                    ..molt::session::Research::default()
                                },
                                ..SessionOptions::default()
                            };
                            let sparse = molt::session::reads_sparse(
                                &as_session,
                                kind,
                                true,
                                &ranges,
                                n_past,
                            );
                            let hurried = if sparse {
                                molt::session::hurry_split(&ranges, n_past, h, hurry, &read.mass)
                            } else {
                                None
                            };
                            let read_ranges = hurried
                                .as_ref()
                                .map_or_else(|| ranges.clone(), |(now, _)| vec![now.clone()]);
                            let spans = Span::of(&history, &read_ranges);
                            let exported = Exported {
                                blob: &read.blob,
                                n_past,
                                from: &src_name,
                                export_ms: 0.0,
                            };
                            let reread = Reread {
                                head: &history[..h],
                                tail: &history[n_past - tl..],
                                anchor: anchor.as_deref(),
                                spans: &spans,
                            };
                            // Positions neither the head, the tail nor the spans re-read.
                            let mut covered = ranges.clone();
                            covered.extend([0..h, n_past - tl..n_past]);
                            let left = molt::session::uncovered(n_past, &covered);
                            let t = if sparse {
                                // Nothing projected: the head, the chosen positions and the
                                // tail read natively, the session's own path.
                                migrate::read_sparse(
                                    &mut dst.ctx,
                                    reread,
                                    n_past,
                                    &[last],
                                    &src_name,
                                )?
                            } else if uncovered == Uncovered::Forgotten && tl == 0 {
                                // As the switch, with the cells left projected forgotten
                                // between the carry and the first decode.
                                let t0 = Instant::now();
                                let t = migrate::carry_exported(
                                    &exported,
                                    &mut dst.ctx,
                                    &projector,
                                    None,
                                    reread,
                                )?;
                                dst.ctx.forget(&left);
                                dst.ctx.decode(&[last]).map_err(engine(&dst_name))?;
                                migrate::SwitchTimings {
                                    cost_ms: t0.elapsed().as_secs_f64() * 1e3,
                                    ..t
                                }
                            } else {
                                migrate::transplant_exported(
                                    &exported,
                                    &mut dst.ctx,
                                    &projector,
                                    None,
                                    reread,
                                    last,
                                )?
                            };
                            let mut out = read.before.clone();
                            // As a session: no refill when the switch re-read every position.
                            if refill > 0 && !left.is_empty() {
                                let first = hurried.map(|(_, later)| later).unwrap_or_default();
                                let cells = history.len() - h
                                    + first.iter().map(ExactSizeIterator::len).sum::<usize>();
                                let pace = molt::session::RefillPace::after_switch(
                                    refill_pace,
                                    !first.is_empty(),
                                );
                                refilled = Some(continue_refilling(
                                    &mut dst.ctx,
                                    &history,
                                    (first.into(), h),
                                    &mut out,
                                    max,
                                    molt::session::refill_step(refill, refill_within, cells),
                                    pace,
                                )?);
                            } else {
                                continue_greedy(&mut dst.ctx, &mut out, max, &dst_name)?;
                            }
                            (out, switch_at, t.cost_ms, t.recomputed)
                        }
                    };
                    answers.push(answer(
                        &arm.name, &route, &toks, sw, cost, rc, reread, head_read, refilled,
                    ));
                }
            }
            if !sources.is_empty() {
                let src_route = format!("{src_name} native");
                answers.push(answer(
                    "native-source",
                    &src_route,
                    &read.native,
                    0,
                    0.0,
                    0,
                    Vec::new(),
                    0,
                    None,
                ));
            }
            if let Some(path) = &opts.partial {
                // A long run's answers so far, so an interrupted run still says something.
                let _ = std::fs::write(path, serde_json::to_string(&answers).unwrap_or_default());
            }
            progress(&format!(
                "[{}/{}] {} ({} tokens, {:?}) on {src_name}: {:.1} s",
                n_item + 1,
                items.len(),
                item.id,
                n_ctx_tokens,
                item.switch,
                t_item.elapsed().as_secs_f64()
            ));
        }
    }
    let rows = summarise(items, &answers, &kinds, opts);
    Ok((rows, answers))
}

/// Recomputes a document's rows from its answers with this build's arm defaults (which arm a
/// session uses when nothing is set): for a run whose models were read before the default
/// changed. Nothing is re-measured; `items` must be the run's item file.
pub fn resummarise(doc: &mut RecallDoc, items: &[RecallItem]) {
    let kinds: BTreeMap<String, RouteKind> = doc
        .rows
        .iter()
        .map(|r| {
            let k = if r.route_kind == "size" {
                RouteKind::Size
            } else {
                RouteKind::Precision
            };
            (r.route.clone(), k)
        })
        .collect();
    let ran: Vec<RecallItem> = items
        .iter()
        .filter(|i| doc.answers.iter().any(|a| a.id == i.id))
        .cloned()
        .collect();
    // The arms as this build defines them (an arm renamed or retired keeps its stored form).
    let catalogue = default_arms(&[]);
    for arm in doc
        .options
        .size_arms
        .iter_mut()
        .chain(doc.options.precision_arms.iter_mut())
    {
        if let Some(now) = catalogue.iter().find(|c| c.name == arm.name) {
            arm.clone_from(now);
        }
    }
    doc.rows = summarise(&ran, &doc.answers, &kinds, &doc.options);
}

/// Merges an earlier run into `doc`: the earlier answers of every item × arm × route this run
/// did not measure are kept beside this run's (an item an arm answered again replaces its
/// earlier answer on that route; so a run of new items adds them), the arm lists and routes are
/// united, and the rows recomputed from the answers. `items` is the item file both ran. Each
/// answer keeps its own run's cost: rows that mix runs compare costs measured at different times.
pub fn merge(doc: &mut RecallDoc, old: RecallDoc, items: &[RecallItem]) {
    let measured: std::collections::BTreeSet<(&str, &str, &str)> = doc
        .answers
        .iter()
        .map(|a| (a.route.as_str(), a.arm.as_str(), a.id.as_str()))
        .collect();
    let kept: Vec<RecallAnswer> = old
        .answers
        .into_iter()
        .filter(|a| !measured.contains(&(a.route.as_str(), a.arm.as_str(), a.id.as_str())))
        .collect();
    doc.answers.extend(kept);
    let unite = |mine: &mut Vec<Arm>, theirs: Vec<Arm>| {
        for a in theirs {
            if !mine.iter().any(|m| m.name == a.name) {
                mine.push(a);
            }
        }
    };
    unite(&mut doc.options.size_arms, old.options.size_arms);
    unite(&mut doc.options.precision_arms, old.options.precision_arms);
    for r in old.options.routes {
        if !doc.options.routes.contains(&r) {
            doc.options.routes.push(r);
        }
    }
    let routes: std::collections::BTreeSet<String> =
        doc.rows.iter().map(|r| r.route.clone()).collect();
    doc.rows
        .extend(old.rows.into_iter().filter(|r| !routes.contains(&r.route)));
    doc.problems.extend(old.problems);
    doc.problems.sort_by_key(|p| p.line);
    doc.problems.dedup();
    resummarise(doc, items);
    let ran: std::collections::BTreeSet<&str> = doc.answers.iter().map(|a| a.id.as_str()).collect();
    doc.n_items = ran.len();
}

/// A document from the answers an interrupted run left in its partial file (written after
/// every item), summarised as a finished run's would be; `kinds` names each route's kind.
#[must_use]
pub fn from_partial(
    items_file: &str,
    items: &[RecallItem],
    answers: Vec<RecallAnswer>,
    kinds: &BTreeMap<String, RouteKind>,
    options: RecallOptions,
) -> RecallDoc {
    let mut answers = answers;
    // An answer written by a build before answers named their kind takes its item's.
    for a in &mut answers {
        if let Some(i) = items.iter().find(|i| i.id == a.id) {
            a.context_kind.clone_from(&i.context_kind);
        }
    }
    let ran: Vec<RecallItem> = items
        .iter()
        .filter(|i| answers.iter().any(|a| a.id == i.id))
        .cloned()
        .collect();
    let rows = summarise(&ran, &answers, kinds, &options);
    RecallDoc {
        items_file: items_file.to_string(),
        n_items: ran.len(),
        problems: Vec::new(),
        options,
        rows,
        answers,
        seconds: 0.0,
        run: serde_json::Value::Null,
    }
}

/// Rows from the answers: per arm × route × length × switch point, recall beside the native
/// destination's on the same items and the re-prefill's cost at the same points.
fn summarise(
    items: &[RecallItem],
    answers: &[RecallAnswer],
    kinds: &BTreeMap<String, RouteKind>,
    opts: &RecallOptions,
) -> Vec<RecallRow> {
    let by_id: BTreeMap<&str, &RecallItem> = items.iter().map(|i| (i.id.as_str(), i)).collect();
    let mut rows = Vec::new();
    for (route, &kind) in kinds {
        let arms = match kind {
            RouteKind::Size => &opts.size_arms,
            RouteKind::Precision => &opts.precision_arms,
        };
        let mut groups: Vec<(&str, usize)> = items
            .iter()
            .map(|i| (i.context_kind.as_str(), i.length))
            .collect();
        // Notes first (the rows of the shipped items keep their order), then the other kinds.
        groups.sort_unstable_by_key(|&(ck, len)| (ck != "notes", ck, len));
        groups.dedup();
        for &(ck, len) in &groups {
            for sp in [SwitchPoint::First, SwitchPoint::Mid] {
                let in_row = |a: &&RecallAnswer| {
                    a.route == *route
                        && by_id.get(a.id.as_str()).is_some_and(|i| {
                            i.length == len && i.switch == sp && i.context_kind == ck
                        })
                };
                let of = |arm: &str| -> Vec<&RecallAnswer> {
                    answers
                        .iter()
                        .filter(in_row)
                        .filter(|a| a.arm == arm)
                        .collect()
                };
                let share = |v: &[&RecallAnswer]| {
                    #[allow(clippy::cast_precision_loss)]
                    let r = v.iter().filter(|a| a.ok).count() as f64 / v.len().max(1) as f64;
                    r
                };
                let facts = |v: &[&RecallAnswer]| {
                    let sum: f64 = v
                        .iter()
                        .map(|a| by_id.get(a.id.as_str()).map_or(0.0, |i| i.facts(&a.answer)))
                        .sum();
                    #[allow(clippy::cast_precision_loss)]
                    let mean = sum / v.len().max(1) as f64;
                    mean
                };
                let dest = of("native-destination");
                let reprefill = of("reprefill");
                let re: Vec<f64> = reprefill.iter().map(|a| a.cost_ms).collect();
                for arm in arms {
                    let v = of(&arm.name);
                    if v.is_empty() {
                        continue;
                    }
                    let costs: Vec<f64> = v.iter().map(|a| a.cost_ms).collect();
                    #[allow(clippy::cast_precision_loss)]
                    let rc: Vec<f64> = v.iter().map(|a| a.recomputed as f64).collect();
                    let mut toks: Vec<usize> = v.iter().map(|a| a.context_tokens).collect();
                    toks.sort_unstable();
                    rows.push(RecallRow {
                        arm: arm.name.clone(),
                        default: arm.is_default(kind),
                        route: route.clone(),
                        route_kind: match kind {
                            RouteKind::Size => "size".into(),
                            RouteKind::Precision => "precision".into(),
                        },
                        context_kind: ck.to_string(),
                        context_tokens: len,
                        measured_tokens: toks[toks.len() / 2],
                        switch_at: sp,
                        items: v.len(),
                        recall: share(&v),
                        destination_recall: share(&dest),
                        reprefill_recall: share(&reprefill),
                        facts: facts(&v),
                        destination_facts: facts(&dest),
                        cost_ms: Spread::of(&costs),
                        reprefill_ms: Spread::of(&re),
                        recomputed: Spread::of(&rc).median,
                        refill_ms:
                            matches!(arm.method, ArmMethod::Transplant { refill, .. } if refill > 0)
                                .then(|| {
                                    Spread::of(&v.iter().map(|a| a.refill_ms).collect::<Vec<_>>())
                                }),
                    });
                }
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_line_is_reported_by_number_and_the_rest_run() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("items.jsonl");
        let good = r#"{"id":"a","kind":"number","length":256,"position":"start","switch":"first","context":"The port is 4471.","question":"Which port?","expected":["4471"]}"#;
        let none = r#"{"id":"b","kind":"number","length":256,"position":"start","switch":"first","context":"x","question":"y","expected":[]}"#;
        let mut bytes = format!("{good}\nnot json\n\n# a comment\n{none}\n{good}\n").into_bytes();
        bytes.extend_from_slice(b"\xff\xfe\n");
        std::fs::write(&p, bytes).unwrap();
        let (items, problems) = read_items(&p).unwrap();
        assert_eq!(items.len(), 1);
        let lines: Vec<usize> = problems.iter().map(|x| x.line).collect();
        assert_eq!(lines, vec![2, 5, 6, 7], "{problems:?}");
        assert!(problems[1].message.contains("\"b\""), "{problems:?}");
        assert!(problems[2].message.contains("repeats"));
        assert!(problems[3].message.contains("UTF-8"));
    }

    #[test]
    fn scoring_wants_every_expected_string_case_insensitively() {
        let item = RecallItem {
            id: "x".into(),
            kind: "two-part".into(),
            context_kind: "notes".into(),
            length: 256,
            position: "middle".into(),
            switch: SwitchPoint::First,
            context: String::new(),
            question: String::new(),
            expected: vec!["Ash-Vault-17".into(), "6621".into()],
            max_tokens: None,
            switch_token: None,
        };
        assert!(item.scores("The host ash-vault-17 listens on 6621."));
        assert!(!item.scores("The host ash-vault-17 listens on 6622."));
        assert!(!item.scores(""));
        assert!(
            item.scores("ASH-VAULT-17, port 6,621"),
            "digit grouping is read through"
        );
        assert!((item.facts("The host ash-vault-17 listens on 6622.") - 0.5).abs() < 1e-12);
        assert!((item.facts("ash-vault-17 on 6,621") - 1.0).abs() < 1e-12);
        assert!(item.facts("").abs() < 1e-12);
    }

    #[test]
    fn the_default_arm_is_what_a_session_does() {
        let arms = default_arms(&[]);
        let d = SessionOptions::default();
        let size: Vec<_> = arms
            .iter()
            .filter(|a| a.is_default(RouteKind::Size))
            .collect();
        let prec: Vec<_> = arms
            .iter()
            .filter(|a| a.is_default(RouteKind::Precision))
            .collect();
        assert_eq!(size.len(), 1, "one default on size routes");
        assert_eq!(prec.len(), 1, "one default on precision routes");
        assert!(matches!(
            size[0].method,
            ArmMethod::Transplant { head, recompute, refill, refill_within, refill_pace, .. }
                if head == d.head_reread
                    && recompute == d.token_recompute
                    && refill == d.refill_chunk
                    && refill_within == d.refill_within
                    && refill_pace == d.refill_pace
        ));
        assert!(matches!(
            prec[0].method,
            ArmMethod::Transplant {
                refill: 0,
                recompute: None,
                ..
            }
        ));
        assert_eq!(default_arms(&["reprefill".into()]).len(), 1);
    }

    #[test]
    fn a_merge_keeps_what_the_new_run_did_not_measure_and_replaces_what_it_did() {
        let item = |id: &str| RecallItem {
            id: id.into(),
            kind: "number".into(),
            context_kind: "notes".into(),
            length: 256,
            position: "middle".into(),
            switch: SwitchPoint::First,
            context: String::new(),
            question: String::new(),
            expected: vec!["42".into()],
            max_tokens: None,
            switch_token: None,
        };
        let items = vec![item("a"), item("b")];
        let answer = |id: &str, arm: &str, route: &str, text: &str| RecallAnswer {
            id: id.into(),
            arm: arm.into(),
            route: route.into(),
            context_kind: "notes".into(),
            context_tokens: 250,
            switch_at: 1,
            answer: text.into(),
            ok: text.contains("42"),
            facts: 0.0,
            cost_ms: 10.0,
            recomputed: 0,
            reread: Vec::new(),
            fact_read: None,
            refill_ms: 0.0,
            refill_at: None,
        };
        let row = |route: &str| RecallRow {
            arm: "reprefill".into(),
            default: false,
            route: route.into(),
            route_kind: "size".into(),
            context_kind: "notes".into(),
            context_tokens: 256,
            measured_tokens: 250,
            switch_at: SwitchPoint::First,
            items: 2,
            recall: 0.0,
            destination_recall: 0.0,
            reprefill_recall: 0.0,
            facts: 0.0,
            destination_facts: 0.0,
            cost_ms: Spread::default(),
            reprefill_ms: Spread::default(),
            recomputed: 0.0,
            refill_ms: None,
        };
        let arms = default_arms(&["reprefill".into(), "sent-r10-m64".into()]);
        let doc = |answers: Vec<RecallAnswer>, arms: Vec<Arm>, route: &str| RecallDoc {
            items_file: "x".into(),
            n_items: 2,
            problems: vec![],
            options: RecallOptions {
                routes: vec![(0, 2)],
                size_arms: arms,
                precision_arms: vec![],
                max_tokens_first: 40,
                max_tokens_mid: 80,
                mid_switch_at: 12,
                precision_every: 1,
                precision_variant: Variant::Auto,
                partial: None,
                answered: Default::default(),
            },
            rows: vec![row(route)],
            answers,
            seconds: 1.0,
            run: serde_json::Value::Null,
        };
        let r = "tier0→tier2";
        let old = doc(
            vec![
                answer("a", "reprefill", r, "no"),
                answer("b", "reprefill", r, "no"),
                answer("a", "sent-r10-m64", r, "42"),
                answer("b", "sent-r10-m64", r, "no"),
            ],
            arms.clone(),
            r,
        );
        let mut new = doc(
            vec![
                answer("a", "reprefill", r, "42"),
                answer("b", "reprefill", r, "42"),
                answer("b", "sent-r10-m64", r, "42"),
            ],
            arms.clone(),
            r,
        );
        merge(&mut new, old, &items);
        let recall = |arm: &str| {
            new.rows
                .iter()
                .find(|x| x.arm == arm)
                .map(|x| x.recall)
                .unwrap()
        };
        assert_eq!(
            new.answers.len(),
            4,
            "the re-measured answers replaced, the others kept"
        );
        assert!(
            (recall("reprefill") - 1.0).abs() < 1e-12,
            "the new run's answers"
        );
        assert!(
            (recall("sent-r10-m64") - 1.0).abs() < 1e-12,
            "item a's answer kept from the old run beside item b's from the new"
        );
        assert_eq!(new.options.size_arms.len(), 2);
    }

    #[test]
    fn spreads_are_medians_with_their_range() {
        let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        assert_eq!(Spread::of(&[]), Spread::default());
    }
}
