//! Refill: after a Molt switch on a size route, the destination re-reads the history natively,
//! in place, a chunk in the batch of every token it decodes, from the end of the head re-read
//! to the newest token. A summary caught by such a switch states a third of its notes' facts
//! where a re-prefill states three quarters (`results/recall_summaries.json`): the selective
//! recompute re-reads what the question looked at, and a summary looks at everything. The
//! switch itself stays a transplant (its gap is unchanged); the projection's error then lasts
//! only until the refill reaches the newest token, after which every cell is what a re-prefill
//! would have built. The compute is a re-prefill's, spread over the next tokens.
//!
//! Paced ([`refill_pace`](super::SessionOptions::refill_pace), the default): each token carries
//! as many positions as keep its gap within that many times the rung's own gap — a token
//! decoded alone, timed on the rung after the switch — by the cost per position the steps
//! before it measured ([`RefillPace`]). Unpaced, the chunk is
//! [`refill_chunk`](super::SessionOptions::refill_chunk) positions, or more when that is what it
//! takes to reach the newest token within [`refill_within`](super::SessionOptions::refill_within)
//! tokens (that rule stays the pace's ceiling). Unpaced, the answer crawled behind a size switch
//! at ~1,200 tokens: nine tokens ~1.1 s apart on tier2, whose own gap is ~25 ms
//! (`results/switch_stall.json`); paced, the same re-read is spread over more tokens
//! that each wait at most ~3 gaps, and what an answer ends before is read at its end
//! ([`Session::fill_holes`]).
//!
//! In place: the chunk at positions `next..next + chunk` is re-read in the live context
//! ([`crate::engine::Context::recompute_spans_then_decode`]), attending to the cells before it
//! — native, re-read by the steps before — and to itself, its new cells replacing the old; the
//! token is decoded in the same `llama_decode` (one pass over the weights for both), seeing
//! the chunk's cells as they were. The last chunk is read before its token, in a pass of its
//! own, so that the token's cell is native too. No second context, no extra memory, no
//! take-over. Failures are never fatal: the refill is dropped,
//! said as a lever, and the answer goes on from the cache as it stands.
//!
//! Hurried ([`hurry`](super::SessionOptions::hurry), off by default): a size switch that read
//! only the head and the newest positions before its first token leaves the positions it chose
//! to the refill, read first, most wanted first ([`hurry_split`], [`take_chunk`]), each piece
//! into the hole the sparse read left ([`Context::recompute_spans`] reads it after the last
//! cell before it and moves it). Measured to lose the facts: the first tokens are written
//! before the question is read (`results/recall.json`, arm `…-p3-h8`).

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use crate::engine::{Context, EngineError, Span, Token};
use crate::routes::RouteKind;

use super::{Event, LeverInfo, Session, SessionError};

/// A native re-read of the history in progress on the current rung.
pub(super) struct Refill {
    /// The rung it belongs to (dropped if the session moves).
    rung: usize,
    /// The first position not re-read yet.
    next: usize,
    /// Positions re-read so far.
    done: usize,
    /// Positions it re-reads per token ([`super::SessionOptions::refill_step`]).
    step: usize,
    /// Time of the batches that carried a chunk, ms (their tokens' decodes included).
    ms: f64,
    /// The pace that sizes each chunk by time (none: `step` every token).
    pace: Option<RefillPace>,
    /// Positions a hurried switch left for after its first token, most wanted first
    /// ([`hurry_split`]): read, paced as the rest, before the refill's pass from the head.
    first: VecDeque<Range<usize>>,
    /// Whether the pass from the head runs after `first` (off: the refill reads `first` only,
    /// and what it leaves absent stays so until [`Session::fill_holes`]).
    pass: bool,
}

/// Tokens decoded alone after a switch before a paced refill reads anything: the fastest of
/// them is the rung's own gap (the first can still share the cores with the source's freeing).
pub const PACE_PLAIN_TOKENS: usize = 2;

/// A refill paced by time (pure: the session feeds it what it measures): how many positions
/// the next token carries so that its decode stays within `factor` times a token decoded
/// alone on the rung. The cost of a position is learnt from the steps taken (a running mean,
/// the newest step weighing half); until one was taken it is guessed at a third of a token's
/// gap (tier2 on 2 cores: ~19 ms a token, 4-7 ms a position in batches of 4-16).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RefillPace {
    factor: f64,
    /// Tokens timed alone before anything is read ([`PACE_PLAIN_TOKENS`] unless told).
    plain_wanted: usize,
    /// Tokens decoded alone so far, and the fastest of them, ms.
    plain: usize,
    base_ms: Option<f64>,
    /// Learnt cost of one position carried in a token's batch, ms.
    per_position_ms: Option<f64>,
}

impl RefillPace {
    /// A pace allowing each token `factor` times the rung's own gap (> 1).
    #[must_use]
    pub fn new(factor: f64) -> Self {
        Self {
            factor,
            plain_wanted: PACE_PLAIN_TOKENS,
            plain: 0,
            base_ms: None,
            per_position_ms: None,
        }
    }

    /// The pace of a refill after a switch at `factor` ([`SessionOptions::refill_pace`]; 1 or
    /// less: none, unpaced). After a hurried switch one token is timed alone, not
    /// [`PACE_PLAIN_TOKENS`]: the answer runs on little of its context until the refill reads.
    ///
    /// [`SessionOptions::refill_pace`]: super::SessionOptions::refill_pace
    #[must_use]
    pub fn after_switch(factor: f64, hurried: bool) -> Option<Self> {
        (factor > 1.0).then(|| Self {
            plain_wanted: if hurried { 1 } else { PACE_PLAIN_TOKENS },
            ..Self::new(factor)
        })
    }

    /// Positions the next token carries, at most `cap` (the unpaced rule's step): 0 while the
    /// rung's own gap is being timed, else at least 1.
    #[must_use]
    pub fn positions(&self, cap: usize) -> usize {
        let Some(base) = self.base_ms.filter(|_| self.plain >= self.plain_wanted) else {
            return 0;
        };
        let per = self.per_position_ms.unwrap_or(base / 3.0).max(1e-3);
        let room = (self.factor - 1.0).max(0.0) * base;
        // Truncation to whole positions is the point.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = (room / per).floor() as usize;
        n.clamp(1, cap.max(1))
    }

    /// Records a decode of `ms` that carried `positions` (0: the token alone).
    pub fn observe(&mut self, positions: usize, ms: f64) {
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        if positions == 0 {
            self.plain += 1;
            self.base_ms = Some(self.base_ms.map_or(ms, |b| b.min(ms)));
            return;
        }
        let base = self.base_ms.unwrap_or(0.0);
        #[allow(clippy::cast_precision_loss)]
        let per = ((ms - base) / positions as f64).max(1e-3);
        self.per_position_ms = Some(self.per_position_ms.map_or(per, |p| 0.5 * (p + per)));
    }

    /// The rung's own gap as timed, ms.
    #[must_use]
    pub fn base_ms(&self) -> Option<f64> {
        self.base_ms
    }
}

impl Session {
    /// Starts a refill on the current rung after a Molt switch over a route of `kind`
    /// (replacing any other): on a size route when [`SessionOptions::refill_chunk`] is on, on
    /// a precision route only with [`SessionOptions::refill_precision`].
    ///
    /// [`SessionOptions::refill_chunk`]: super::SessionOptions::refill_chunk
    /// [`SessionOptions::refill_precision`]: super::SessionOptions::refill_precision
    pub(super) fn start_refill(&mut self, kind: RouteKind) {
        // What a hurried switch left for after its first token is read whether or not the
        // refill's own pass runs.
        let first: VecDeque<Range<usize>> = std::mem::take(&mut self.hurried).into();
        let refills = self.opts.refills(kind);
        // Nothing projected (the switch re-read the whole cache): nothing to refill.
        let on = (refills || !first.is_empty()) && !self.projected.is_empty();
        // The head re-read is the destination's own (its anchor and the first token): native
        // already. Without the refill's pass, only `first` is read (the pass never starts).
        let head = self.opts.head_reread.min(self.history.len());
        let (next, pass_cells) = if refills {
            (head, self.history.len() - head)
        } else {
            (usize::MAX, 0)
        };
        let cells = pass_cells + first.iter().map(ExactSizeIterator::len).sum::<usize>();
        let step = self.opts.refill_step(cells).max(if refills {
            0
        } else {
            super::DEFAULT_REFILL_CHUNK
        });
        let pace = RefillPace::after_switch(self.opts.refill_pace, !first.is_empty());
        self.refill = on.then_some(Refill {
            rung: self.current,
            next,
            done: 0,
            step,
            ms: 0.0,
            pace,
            first,
            pass: refills,
        });
    }

    /// Drops a refill in progress (the rung moved, parked, or the answer ended). What it
    /// re-read stays native.
    pub(super) fn drop_refill(&mut self) {
        self.refill = None;
        self.head_behind = None;
    }

    /// Reads the head's positions a switch left for the next token ([`Session::head_behind`])
    /// natively in place, in the batch that decodes `tok` when one is given. `Ok(true)` when
    /// `tok` was decoded here. A failed read leaves those cells projected (never fatal; the
    /// cache is as it was before the batch) and `tok` to the caller.
    fn read_head_behind(&mut self, tok: Option<Token>) -> Result<bool, EngineError> {
        let Some((rung, range)) = self.head_behind.take() else {
            return Ok(false);
        };
        if rung != self.current || self.parked.is_some() {
            return Ok(false);
        }
        let Some(live) = self.rungs[rung].as_mut() else {
            return Ok(false);
        };
        if range.end > live.ctx.n_past().min(self.history.len()) {
            return Ok(false);
        }
        let read = match tok {
            Some(tok) => {
                reread_then_decode(&mut live.ctx, &self.history, range.start, range.len(), tok)
                    .map(|_| ())
            }
            None => live
                .ctx
                .recompute_spans(&Span::of(&self.history, std::slice::from_ref(&range)))
                .map(|_| ()),
        };
        if read.is_ok() {
            self.projected = subtract(&self.projected, std::slice::from_ref(&range));
        }
        read.map(|_| tok.is_some())
    }

    /// Reads the head's positions a switch left for the next token when the answer ended
    /// before one came (a switch at its last token), so the cache it leaves is native there.
    pub(super) fn finish_head_behind(&mut self) {
        let _ = self.read_head_behind(None);
    }

    /// Decodes `tok` on the live rung — with the refill's next chunk in the same batch when one
    /// runs on it. Before generated token `at_token`; `tok` is not in the history yet.
    ///
    /// # Errors
    /// The decode of `tok` failing (a failed chunk only ends the refill).
    pub(super) fn decode_next(
        &mut self,
        tok: Token,
        at_token: usize,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<(), SessionError> {
        let name = self.current_rung().to_string();
        let engine = |source| SessionError::Engine {
            rung: name.clone(),
            source,
        };
        // The head a switch left for this token comes first; the refill goes on with the next.
        if matches!(self.read_head_behind(Some(tok)), Ok(true)) {
            return Ok(());
        }
        let refill = self.refill.take();
        let Some(mut r) = refill.filter(|r| r.rung == self.current && self.parked.is_none()) else {
            return self.live().ctx.decode(&[tok]).map_err(engine);
        };
        let n_past = self.live().ctx.n_past().min(self.history.len());
        if r.first.is_empty() && r.next >= n_past {
            self.live().ctx.decode(&[tok]).map_err(engine)?;
            self.refill_done(&r, at_token, "refill", sink);
            return Ok(());
        }
        let step = r.pace.map_or(r.step, |p| p.positions(r.step));
        let t0 = Instant::now();
        let live = self.rungs[r.rung]
            .as_mut()
            .expect("the live rung is loaded");
        if step == 0 {
            // A paced refill times the rung's own gap first.
            let result = live.ctx.decode(&[tok]).map_err(engine);
            if let Some(p) = r.pace.as_mut() {
                p.observe(0, t0.elapsed().as_secs_f64() * 1e3);
            }
            self.refill = Some(r);
            return result;
        }
        // What a hurried switch left comes first, then the pass from the head.
        let chunk = (!r.first.is_empty()).then(|| take_chunk(&mut r.first, step, n_past));
        let result = match &chunk {
            Some(ranges) => read_ranges_then_decode(&mut live.ctx, &self.history, ranges, tok),
            None => reread_then_decode(&mut live.ctx, &self.history, r.next, step, tok)
                .map(|end| end - r.next),
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        r.ms += ms;
        match result {
            Ok(read) => {
                if let Some(p) = r.pace.as_mut() {
                    p.observe(read, ms);
                }
                r.done += read;
                if let Some(ranges) = &chunk {
                    // Read out of order: what it read is no longer absent.
                    self.projected = subtract(&self.projected, ranges);
                } else {
                    let end = r.next + read;
                    r.next = end;
                    // What is re-read is no longer projected.
                    self.projected.retain(|p| p.end > end);
                    if let Some(p) = self.projected.first_mut() {
                        p.start = p.start.max(end);
                    }
                }
                if r.first.is_empty() && r.next >= n_past {
                    self.refill_done(&r, at_token, "refill", sink);
                } else {
                    self.refill = Some(r);
                }
                Ok(())
            }
            Err(e) => {
                // Sequence 0 is as it was before the failed batch: the token alone.
                let what = format!("refill abandoned: {e}");
                self.refill_done(&r, at_token, &what, sink);
                self.live().ctx.decode(&[tok]).map_err(engine)
            }
        }
    }

    /// Positions a size switch's sparse read left without a cell that are still to be read
    /// ([`Session::fill_idle`]): 0 when the cache is whole (or parked, or the answer's refill
    /// re-read them). A prompt answered on this cache reads them first: nothing can attend to a
    /// position with no cell.
    #[must_use]
    pub fn fill_due(&self) -> usize {
        if !self.holes || self.parked.is_some() || self.rungs[self.current].is_none() {
            return 0;
        }
        due(&self.projected, self.history.len())
    }

    /// Between answers, while the user reads and types: reads at least `max` of the positions
    /// a size switch left out (or all that are left), natively in place, as
    /// [`Session::fill_holes`] reads them, one micro-batch per `llama_decode` — so a caller
    /// that calls it again while no prompt is waiting yields to a new prompt within one
    /// micro-batch, and that prompt reads only what is left ([`Session::generate`] does).
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp fails: the cache and the history are then cut
    /// before the first stretch not read (what is left is native), and the next prompt reads
    /// the rest again from the conversation.
    pub fn fill_idle(&mut self, max: usize) -> Result<FillStep, SessionError> {
        let t0 = Instant::now();
        let rung = self.current_rung().to_string();
        let (read, result) = self.fill_some(max.max(1));
        result.map_err(|source| SessionError::Engine {
            rung: rung.clone(),
            source,
        })?;
        Ok(FillStep {
            read,
            due: self.fill_due(),
            ms: t0.elapsed().as_secs_f64() * 1e3,
            rung,
        })
    }

    /// Reads the positions a sparse read left out and no refill has read yet, natively in
    /// place, each stretch attending to every cell before it (the head, the positions the
    /// switch read, the stretches read before it): afterwards the cache is what a re-prefill
    /// builds. Called before a prompt is read on the cache — nothing can attend to a position
    /// with no cell, so the next question could not find what it asks about — and, with
    /// [`SessionOptions::fill_at_end`](super::SessionOptions::fill_at_end), when an answer ends
    /// before its refill did. A `fill` lever (`↻` in `chat`) says how many positions and how
    /// long. Nothing happens when no cell is absent. Never fatal: if the engine fails, the
    /// cache and the history are cut before the first stretch not read (what is left is
    /// native), the next prompt reads the rest again from the conversation, and the lever says
    /// `fill abandoned: …`.
    pub(super) fn fill_holes(&mut self, at_token: usize, sink: &mut dyn FnMut(&Event)) {
        if self.fill_due() == 0 {
            self.holes = self.holes && !self.projected.is_empty();
            return;
        }
        self.drop_refill();
        let t0 = Instant::now();
        let rung = self.current;
        let (done, result) = self.fill_some(usize::MAX);
        let what = match result {
            Ok(()) => "fill".to_string(),
            Err(e) => format!("fill abandoned: {e}"),
        };
        let info = LeverInfo::refill(
            at_token,
            &what,
            self.ladder.rungs[rung].name(),
            done,
            t0.elapsed().as_secs_f64() * 1e3,
            self.last_budget.unwrap_or(0),
        );
        sink(&Event::Lever(info.clone()));
        self.answer_levers.push(info);
    }

    /// Reads left-out positions in position order until at least `max` are read or none is
    /// left: each stretch in pieces of the rung's micro-batch, a piece per `llama_decode` (the
    /// destination's own prefill rate, not a trickle of small batches), stretches closer than
    /// [`FILL_JOIN`] read as one with the positions between them ([`fill_runs`]). Returns the
    /// left-out positions read; on an engine failure, the cache and the history are cut
    /// before the piece that failed.
    fn fill_some(&mut self, max: usize) -> (usize, Result<(), EngineError>) {
        if self.fill_due() == 0 {
            return (0, Ok(()));
        }
        let n = self.history.len();
        let Some(live) = self.rungs[self.current].as_mut() else {
            return (0, Ok(()));
        };
        let n_past = live.ctx.n_past().min(n);
        let piece = live.ctx.config().n_ubatch.max(1) as usize;
        let mut read = 0;
        let mut result = Ok(());
        while read < max {
            let Some(run) = fill_runs(&self.projected, n_past).into_iter().next() else {
                break;
            };
            let range = run.start..(run.start + piece).min(run.end);
            let span = Span {
                start: range.start,
                tokens: &self.history[range.clone()],
            };
            match live.ctx.recompute_spans(&[span]) {
                Ok(_) => {
                    let before = due(&self.projected, n_past);
                    self.projected = subtract(&self.projected, std::slice::from_ref(&range));
                    read += before - due(&self.projected, n_past);
                }
                Err(e) => {
                    live.ctx.truncate(range.start);
                    self.history.truncate(range.start);
                    self.pinned = self.pinned.min(range.start);
                    self.projected.clear();
                    result = Err(e);
                    break;
                }
            }
        }
        if due(&self.projected, n_past) == 0 {
            self.projected.clear();
            self.holes = false;
        }
        (read, result)
    }

    fn refill_done(
        &mut self,
        r: &Refill,
        at_token: usize,
        what: &str,
        sink: &mut dyn FnMut(&Event),
    ) {
        if what == "refill" && r.pass {
            self.projected.clear();
        }
        let info = LeverInfo::refill(
            at_token,
            what,
            self.ladder.rungs[r.rung].name(),
            r.done,
            r.ms,
            self.last_budget.unwrap_or(0),
        );
        sink(&Event::Lever(info.clone()));
        self.answer_levers.push(info);
    }
}

/// One step of a refill on `ctx`, whose cache holds `history[..n_past]`: re-reads the span
/// `next..next + step` (cut at the newest cell) in place and decodes `tok` after it — in the
/// same `llama_decode`, or, for the span that reaches the newest cell, in a pass of its own
/// after the span, since a token decoded in the batch of a span attends to the cells the span
/// replaces as they were: so every cell, the token's too, is the destination's own. Returns the
/// first position not re-read. `next` must be below the newest cell.
///
/// # Errors
/// The engine's (sequence 0 is then as it was before the failed batch).
pub fn reread_then_decode(
    ctx: &mut Context,
    history: &[Token],
    next: usize,
    step: usize,
    tok: Token,
) -> Result<usize, EngineError> {
    let n_past = ctx.n_past().min(history.len());
    let end = (next + step.max(1)).min(n_past);
    let span = Span {
        start: next,
        tokens: &history[next..end],
    };
    if end >= n_past {
        ctx.recompute_spans(&[span])?;
        ctx.decode(&[tok])?;
    } else {
        ctx.recompute_spans_then_decode(&[span], &[tok])?;
    }
    Ok(end)
}

/// Pieces of a chunk one batch carries at most: [`Context::recompute_spans_then_decode`]
/// reads up to seven spans in one `llama_decode`.
const CHUNK_SPANS: usize = 7;

/// The split of a hurried sparse read ([`super::SessionOptions::hurry`]) over a cache of
/// `n_past` cells whose head ends at `lo`: the newest `keep` positions (at least two, the
/// sparse read's last piece), read before the first token, and what else `ranges` (the
/// positions the switch chose, in order) holds, in the order they are read after it — the
/// newest piece first (the question and the answer so far: what the next tokens go on from),
/// then the others by the highest attention mass `scores` gives a position in them (the
/// sentences the question looked at most). `None` when there is nothing to hurry.
#[must_use]
pub fn hurry_split(
    ranges: &[Range<usize>],
    n_past: usize,
    lo: usize,
    keep: usize,
    scores: &[f32],
) -> Option<(Range<usize>, Vec<Range<usize>>)> {
    if keep == 0 {
        return None;
    }
    let start = n_past.saturating_sub(keep.max(2)).max(lo);
    if n_past < start + 2 {
        return None;
    }
    let mut later: Vec<Range<usize>> = ranges
        .iter()
        .map(|r| r.start..r.end.min(start))
        .filter(|r| !r.is_empty())
        .collect();
    let newest = later.pop_if(|r| r.end == start);
    let mass = |r: &Range<usize>| {
        r.clone()
            .map(|p| scores.get(p).copied().unwrap_or(0.0))
            .fold(f32::MIN, f32::max)
    };
    // Highest mass first; ties keep position order (stable sort).
    later.sort_by(|a, b| mass(b).total_cmp(&mass(a)));
    Some((start..n_past, newest.into_iter().chain(later).collect()))
}

/// Takes the next `step` positions (at least one) from the front of `first`, below `n_past`,
/// in at most `CHUNK_SPANS` pieces: the chunk a token carries, in position order with
/// touching pieces merged (as [`Context::recompute_spans_then_decode`] wants them).
pub fn take_chunk(
    first: &mut VecDeque<Range<usize>>,
    step: usize,
    n_past: usize,
) -> Vec<Range<usize>> {
    let mut taken: Vec<Range<usize>> = Vec::new();
    let mut left = step.max(1);
    while left > 0 {
        let Some(r) = first.pop_front() else { break };
        let r = r.start..r.end.min(n_past);
        if r.is_empty() {
            continue;
        }
        if !taken.is_empty() && merged(taken.iter().cloned().chain([r.clone()])).len() > CHUNK_SPANS
        {
            first.push_front(r);
            break;
        }
        let take = r.len().min(left);
        taken.push(r.start..r.start + take);
        if take < r.len() {
            first.push_front(r.start + take..r.end);
        }
        left -= take;
    }
    merged(taken.into_iter())
}

/// `spans` in position order, those that touch or overlap merged.
fn merged(spans: impl Iterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut v: Vec<Range<usize>> = spans.filter(|r| !r.is_empty()).collect();
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Left-out stretches closer than this are read as one run, the positions between them read
/// again with them: on a CPU a batch of a few dozen positions costs nearly what a micro-batch
/// costs (the weights are read once per batch), so reading a short stretch twice is cheaper
/// than a batch of its own.
pub const FILL_JOIN: usize = 64;

/// What one [`Session::fill_idle`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct FillStep {
    /// Left-out positions read now.
    pub read: usize,
    /// Left-out positions still due.
    pub due: usize,
    /// How long it took, ms.
    pub ms: f64,
    /// The rung it read on.
    pub rung: String,
}

/// Positions of `spans` below `n`.
fn due(spans: &[Range<usize>], n: usize) -> usize {
    spans
        .iter()
        .map(|r| r.end.min(n).saturating_sub(r.start))
        .sum()
}

/// The runs a fill reads, in position order: `spans` (ordered, disjoint) cut at `n`, those
/// less than [`FILL_JOIN`] apart joined.
fn fill_runs(spans: &[Range<usize>], n: usize) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for r in spans {
        let r = r.start..r.end.min(n);
        if r.is_empty() {
            continue;
        }
        match runs.last_mut() {
            Some(last) if r.start.saturating_sub(last.end) < FILL_JOIN => last.end = r.end,
            _ => runs.push(r),
        }
    }
    runs
}

/// The positions of `spans` (ordered, disjoint) not in `cut`, ordered.
fn subtract(spans: &[Range<usize>], cut: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(spans.len());
    for s in spans {
        let mut pieces = vec![s.clone()];
        for c in cut {
            pieces = pieces
                .into_iter()
                .flat_map(|p| [p.start..p.end.min(c.start), p.start.max(c.end)..p.end])
                .filter(|p| !p.is_empty())
                .collect();
        }
        out.extend(pieces);
    }
    out
}

/// One step of a hurried switch's reading on `ctx`, whose cache holds `history[..n_past]`:
/// re-reads `ranges` (ordered, apart, below the newest cell) in place and decodes `tok` in the
/// same `llama_decode` when they fit one. Returns the positions read.
///
/// # Errors
/// The engine's (sequence 0 is then as it was before the failed batch).
pub fn read_ranges_then_decode(
    ctx: &mut Context,
    history: &[Token],
    ranges: &[Range<usize>],
    tok: Token,
) -> Result<usize, EngineError> {
    let spans = Span::of(history, ranges);
    ctx.recompute_spans_then_decode(&spans, &[tok])
}

#[cfg(test)]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of spans, some of which hold a single span"
)]
mod tests {
    use std::collections::VecDeque;

    use super::{PACE_PLAIN_TOKENS, RefillPace, hurry_split, subtract, take_chunk};

    #[test]
    fn a_hurried_read_keeps_the_newest_positions_and_orders_the_rest() {
        // Chosen: two sentences and the question with the answer so far (90..120).
        let ranges = [10..20, 40..50, 90..120];
        let mut scores = vec![0.0_f32; 120];
        scores[15] = 0.2;
        scores[45] = 0.9;
        let (now, later) = hurry_split(&ranges, 120, 4, 8, &scores).unwrap();
        assert_eq!(now, 112..120);
        // The newest piece first, then by the mass the question gave them.
        assert_eq!(later, vec![90..112, 40..50, 10..20]);
        // Off, or nothing to hurry past the head.
        assert_eq!(hurry_split(&ranges, 120, 4, 0, &scores), None);
        assert_eq!(hurry_split(&[], 5, 4, 8, &[]), None);
        // At least two positions (the sparse read's last piece), never into the head.
        assert_eq!(hurry_split(&[], 120, 4, 1, &[]).unwrap().0, 118..120);
        assert_eq!(hurry_split(&[], 10, 4, 8, &[]).unwrap(), (4..10, vec![]));
    }

    #[test]
    fn a_chunk_takes_the_front_in_position_order_within_seven_pieces() {
        let mut q: VecDeque<_> = vec![90..112, 40..50, 10..20].into();
        assert_eq!(take_chunk(&mut q, 16, 120), vec![90..106]);
        // The rest of the first piece and the start of the next, in position order.
        assert_eq!(take_chunk(&mut q, 10, 120), vec![40..44, 106..112]);
        assert_eq!(take_chunk(&mut q, 100, 120), vec![10..20, 44..50]);
        assert!(q.is_empty());
        assert!(take_chunk(&mut q, 8, 120).is_empty());
        // Touching pieces merge; never past the newest cell; eight pieces apart go as seven.
        let mut q: VecDeque<_> = vec![5..8, 0..5, 100..130].into();
        assert_eq!(take_chunk(&mut q, 64, 110), vec![0..8, 100..110]);
        let mut q: VecDeque<_> = (0..8).map(|i| i * 10..i * 10 + 2).collect();
        assert_eq!(take_chunk(&mut q, 64, 100).len(), 7);
        assert_eq!(q, VecDeque::from(vec![70..72]));
    }

    #[test]
    fn subtracting_leaves_what_was_not_read() {
        assert_eq!(
            subtract(&[4..40, 50..60], &[10..20, 38..55]),
            vec![4..10, 20..38, 55..60]
        );
        assert_eq!(subtract(&[4..40], &[]), vec![4..40]);
        assert!(subtract(&[4..40], &[0..100]).is_empty());
    }

    #[test]
    fn a_paced_refill_times_the_rung_alone_then_keeps_each_gap_within_its_factor() {
        let mut p = RefillPace::new(3.0);
        // Nothing is read until the rung's own gap is timed; the fastest plain token counts
        // (the first shares the cores with the source being freed).
        assert_eq!(p.positions(64), 0);
        p.observe(0, 55.0);
        assert_eq!(p.positions(64), 0);
        for _ in 1..PACE_PLAIN_TOKENS {
            p.observe(0, 20.0);
        }
        assert_eq!(p.base_ms(), Some(20.0));
        // Guessed: a position at a third of a token, two tokens of room: six positions.
        assert_eq!(p.positions(64), 6);
        // Measured: 6 positions made a 68 ms gap, 8 ms a position: 40 ms of room holds 5.
        p.observe(6, 68.0);
        assert_eq!(p.positions(64), 5);
        // Cheaper steps raise it (a running mean: 8 then 2 ms a position give 5, so 8).
        p.observe(5, 30.0);
        assert_eq!(p.positions(64), 8);
        // Never more than the unpaced rule's step, never fewer than one.
        assert_eq!(p.positions(4), 4);
        p.observe(1, 500.0);
        assert_eq!(p.positions(64), 1);
    }

    #[test]
    fn a_pace_ignores_readings_that_are_not_times() {
        let mut p = RefillPace::new(3.0);
        p.observe(0, f64::NAN);
        p.observe(0, -1.0);
        assert_eq!(p.base_ms(), None);
        assert_eq!(p.positions(64), 0);
    }
}
