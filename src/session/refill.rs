//! Background refill: after a Molt switch, the destination re-reads the history natively, a
//! chunk between every two tokens, in a context of its own; when it has caught up it takes
//! over the live cache. The switch itself stays a transplant (no stall); the projection's
//! error then lasts only until the refill catches up, after which the cache is exactly what a
//! re-prefill would have built. The compute is a re-prefill's, spread over the next tokens.
//!
//! The take-over is one state export/import and one decode of the newest token, so the logits
//! the next token is sampled from are the destination's own. Failures are never fatal: the
//! refill is dropped and the answer goes on from the projected cache.

use std::time::Instant;

use crate::engine::ReRead;

use super::{Event, LeverInfo, Session};

/// A native re-read of the history in progress on the current rung.
pub(super) struct Refill {
    /// The rung it belongs to (dropped if the session moves).
    rung: usize,
    /// The re-read (created at the first step: its model is the rung's, loaded by then).
    reread: Option<ReRead>,
    /// Time spent so far, ms.
    ms: f64,
}

impl Session {
    /// Starts a refill on the current rung (after a Molt switch), replacing any other.
    pub(super) fn start_refill(&mut self) {
        self.refill = (self.opts.refill_chunk > 0).then_some(Refill {
            rung: self.current,
            reread: None,
            ms: 0.0,
        });
    }

    /// Drops a refill in progress (the rung moved, parked, or the answer ended), releasing its
    /// context.
    pub(super) fn drop_refill(&mut self) {
        self.refill = None;
    }

    /// One refill step between two tokens: decode the next chunk of the history (all but the
    /// newest token, which the live context has just decoded) and, once caught up, take over
    /// the live cache. Called with the newest token already in `history`.
    pub(super) fn refill_step(&mut self, at_token: usize, sink: &mut dyn FnMut(&Event)) {
        let Some(mut r) = self.refill.take() else {
            return;
        };
        if r.rung != self.current || self.parked.is_some() || self.rungs[r.rung].is_none() {
            return;
        }
        let t0 = Instant::now();
        let target = self.history.len().saturating_sub(1);
        let step = (|| -> Result<bool, String> {
            let reread = match r.reread.as_mut() {
                Some(x) => x,
                None => {
                    let live = self.rungs[r.rung].as_ref().ok_or("rung not loaded")?;
                    r.reread.insert(ReRead::new(
                        live.ctx.model().clone(),
                        self.config,
                        self.opts.refill_chunk,
                    ))
                }
            };
            reread
                .step(&self.history, target)
                .map_err(|e| format!("refill: {e}"))
        })();
        r.ms += t0.elapsed().as_secs_f64() * 1e3;
        match step {
            Ok(false) => self.refill = Some(r),
            Ok(true) => self.take_over(r, at_token, sink),
            Err(e) => {
                let done = r.reread.as_ref().map_or(0, ReRead::done);
                self.refill_note(&r, done, at_token, &format!("refill abandoned: {e}"), sink);
            }
        }
    }

    /// Moves the refill's native cache into the live context and decodes the newest token on
    /// it. If anything fails, the live context is restored from a copy taken first.
    fn take_over(&mut self, mut r: Refill, at_token: usize, sink: &mut dyn FnMut(&Event)) {
        let t0 = Instant::now();
        let newest = *self.history.last().unwrap_or(&0);
        let Some(reread) = r.reread.take() else {
            return;
        };
        let done = reread.done();
        let result = (|| -> Result<(), String> {
            let blob = reread
                .into_state()
                .map_err(|e| format!("refill export: {e}"))?;
            let live = self.rungs[r.rung].as_mut().ok_or("rung not loaded")?;
            let backup = live
                .ctx
                .export_state()
                .map_err(|e| format!("live export: {e}"))?;
            let swap = live
                .ctx
                .import_state(&blob)
                .map_err(|e| format!("import: {e}"))
                .and_then(|()| {
                    live.ctx
                        .decode(&[newest])
                        .map_err(|e| format!("decode after take-over: {e}"))
                });
            if let Err(e) = swap {
                live.ctx.clear();
                live.ctx
                    .import_state(&backup)
                    .and_then(|()| {
                        live.ctx.truncate(self.history.len() - 1);
                        live.ctx.decode(&[newest])
                    })
                    .map_err(|e2| format!("{e}; restoring the projected cache: {e2}"))?;
                return Err(e);
            }
            Ok(())
        })();
        r.ms += t0.elapsed().as_secs_f64() * 1e3;
        match result {
            Ok(()) => {
                self.projected.clear();
                self.refill_note(&r, done, at_token, "refill", sink);
            }
            Err(e) => {
                let what = format!("refill abandoned: {e}");
                self.refill_note(&r, done, at_token, &what, sink);
            }
        }
    }

    fn refill_note(
        &mut self,
        r: &Refill,
        done: usize,
        at_token: usize,
        what: &str,
        sink: &mut dyn FnMut(&Event),
    ) {
        let info = LeverInfo {
            at_token,
            lever: what.to_string(),
            rung: self.ladder.rungs[r.rung].name().to_string(),
            tokens: done + 1,
            cost_ms: r.ms,
            parked_ms: 0.0,
            rss_before: 0,
            rss_after: 0,
            parked_kv_bytes: 0,
            budget_bytes: self.last_budget.unwrap_or(0),
        };
        sink(&Event::Lever(info.clone()));
        self.answer_levers.push(info);
    }
}
