//! Refill: after a Molt switch on a size route, the destination re-reads the history natively,
//! in place, a chunk in the batch of every token it decodes, from the end of the head re-read
//! to the newest token. A summary caught by such a switch states a third of its notes' facts
//! where a re-prefill states three quarters (`results/recall_summaries.json`): the selective
//! recompute re-reads what the question looked at, and a summary looks at everything. The
//! switch itself stays a transplant (its gap is unchanged); the projection's error then lasts
//! only until the refill reaches the newest token, after which every cell is what a re-prefill
//! would have built. The compute is a re-prefill's, spread over the next tokens.
//!
//! The chunk is [`refill_chunk`](super::SessionOptions::refill_chunk) positions, or more when
//! that is what it takes to reach the newest token within
//! [`refill_within`](super::SessionOptions::refill_within) tokens: a one-sentence
//! answer after a switch at ~1,800 tokens would otherwise end before the refill does.
//!
//! In place: the chunk at positions `next..next + chunk` is re-read in the live context
//! ([`crate::engine::Context::recompute_spans_then_decode`]), attending to the cells before it
//! — native, re-read by the steps before — and to itself, its new cells replacing the old; the
//! token is decoded in the same `llama_decode` (one pass over the weights for both), seeing
//! the chunk's cells as they were. The last chunk is read before its token, in a pass of its
//! own, so that the token's cell is native too. No second context, no extra memory, no
//! take-over. Failures are never fatal: the refill is dropped,
//! said as a lever, and the answer goes on from the cache as it stands.

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
}

impl Session {
    /// Starts a refill on the current rung after a Molt switch over a route of `kind`
    /// (replacing any other): on a size route when [`SessionOptions::refill_chunk`] is on, on
    /// a precision route only with [`SessionOptions::refill_precision`].
    ///
    /// [`SessionOptions::refill_chunk`]: super::SessionOptions::refill_chunk
    /// [`SessionOptions::refill_precision`]: super::SessionOptions::refill_precision
    pub(super) fn start_refill(&mut self, kind: RouteKind) {
        // Nothing projected (the switch re-read the whole cache): nothing to refill.
        let on = self.opts.refills(kind) && !self.projected.is_empty();
        // The head re-read is the destination's own (its anchor and the first token): native
        // already.
        let next = self.opts.head_reread.min(self.history.len());
        self.refill = on.then_some(Refill {
            rung: self.current,
            next,
            done: 0,
            step: self.opts.refill_step(self.history.len() - next),
            ms: 0.0,
        });
    }

    /// Drops a refill in progress (the rung moved, parked, or the answer ended). What it
    /// re-read stays native.
    pub(super) fn drop_refill(&mut self) {
        self.refill = None;
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
        let refill = self.refill.take();
        let Some(mut r) = refill.filter(|r| r.rung == self.current && self.parked.is_none()) else {
            return self.live().ctx.decode(&[tok]).map_err(engine);
        };
        let n_past = self.live().ctx.n_past().min(self.history.len());
        if r.next >= n_past {
            self.live().ctx.decode(&[tok]).map_err(engine)?;
            self.refill_done(&r, at_token, "refill", sink);
            return Ok(());
        }
        let t0 = Instant::now();
        let live = self.rungs[r.rung]
            .as_mut()
            .expect("the live rung is loaded");
        let result = reread_then_decode(&mut live.ctx, &self.history, r.next, r.step, tok);
        r.ms += t0.elapsed().as_secs_f64() * 1e3;
        match result {
            Ok(end) => {
                r.done += end - r.next;
                r.next = end;
                // What is re-read is no longer projected.
                self.projected.retain(|p| p.end > end);
                if let Some(p) = self.projected.first_mut() {
                    p.start = p.start.max(end);
                }
                if end >= n_past {
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

    /// Reads the positions a sparse read left out and no refill has read yet, natively in
    /// place, each stretch attending to every cell before it (the head, the positions the
    /// switch read, the stretches read before it): afterwards the cache is what a re-prefill
    /// builds. Called when an answer ends before its refill did, and before a prompt is read
    /// on the cache — nothing can attend to a position with no cell, so the next question
    /// could not find what it asks about. A `fill` lever (`↻` in `chat`) says how many
    /// positions and how long. Nothing happens when no cell is absent. Never fatal: if the
    /// engine fails, the cache and the history are cut before the first stretch not read
    /// (what is left is native), the next prompt reads the rest again from the conversation,
    /// and the lever says `fill abandoned: …`.
    pub(super) fn fill_holes(&mut self, at_token: usize, sink: &mut dyn FnMut(&Event)) {
        if !self.holes || self.projected.is_empty() || self.rungs[self.current].is_none() {
            return;
        }
        self.drop_refill();
        let t0 = Instant::now();
        let holes = std::mem::take(&mut self.projected);
        self.holes = false;
        let rung = self.current;
        let live = self.rungs[rung].as_mut().expect("checked above");
        let n_past = live.ctx.n_past().min(self.history.len());
        let mut done = 0;
        let mut what = "fill".to_string();
        for h in &holes {
            let end = h.end.min(n_past);
            if h.start >= end {
                continue;
            }
            let span = Span {
                start: h.start,
                tokens: &self.history[h.start..end],
            };
            match live.ctx.recompute_spans(&[span]) {
                Ok(n) => done += n,
                Err(e) => {
                    live.ctx.truncate(h.start);
                    self.history.truncate(h.start);
                    self.pinned = self.pinned.min(h.start);
                    what = format!("fill abandoned: {e}");
                    break;
                }
            }
        }
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

    fn refill_done(
        &mut self,
        r: &Refill,
        at_token: usize,
        what: &str,
        sink: &mut dyn FnMut(&Event),
    ) {
        if what == "refill" {
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
pub(crate) fn reread_then_decode(
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
