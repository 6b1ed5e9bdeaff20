//! Standby rungs ([`SessionOptions::standby`](super::SessionOptions::standby)): the rungs
//! below the current one, loaded ahead so a switch down does not wait for a load.
//!
//! The rules, in the order the session applies them:
//! - **Which**: every rung below the current one (smaller, so a destination of a switch down),
//!   never the current one or one above it: after a switch down the rungs now above are
//!   dropped, after a switch up the source joins the standby set instead of being freed.
//! - **When prepared**: when the session starts, and after an answer (never between two
//!   tokens), if the budget last read holds the rung's measured cost beside everything else.
//! - **What counts**: a standby rung's measured cost ([`StandbyRung::rss_bytes`]) is part of
//!   the session's modelled footprint, and of what the process's own numbers show.
//! - **Hot or cold** ([`SessionOptions::standby_hot`](super::SessionOptions::standby_hot)): a
//!   standby rung keeps its weight pages mapped — and counts them — when the budget last read
//!   holds them beside everything else (or there is none); otherwise they are released and a
//!   switch onto it maps them back (35-85 ms of the switch's gap on the real ladder).
//! - **The conversation's head**: after an answer, each standby rung reads the history's
//!   first tokens (the head a switch re-reads) and keeps their cells, so a switch down onto
//!   it splices the whole head in with the projection instead of decoding part of it at the
//!   switch ([`StandbyRung::read_head`]).
//! - **First given up**: before the policy would have to move because of them, hot standby
//!   rungs are cooled (their pages released), then standby rungs are dropped, smallest rung
//!   first (the next switch down most likely goes one rung down),
//!   until the current rung and the rest fit the budget. The policy itself decides on the
//!   rungs alone: a switch never happens to keep a standby rung.

use std::sync::Arc;

use super::{LiveRung, Session, StandbyRung};
use crate::transplant::anchor::Anchor;

/// Rungs whose models a session holds ([`Session::reap_rungs`]): dropped on the reaper's
/// thread, their contexts go, then their weight pages leave this process's page tables (the
/// held model keeps its mapping, with nothing of it resident).
struct RungContexts(Vec<LiveRung>);

impl Drop for RungContexts {
    fn drop(&mut self) {
        let paths: Vec<std::path::PathBuf> = self.0.iter().map(|r| r.info.path.clone()).collect();
        self.0.clear();
        for p in paths {
            let _ = crate::pressure::pages::release_mapping(&p);
        }
    }
}

impl Session {
    /// What the standby rungs hold, measured.
    pub fn standby_bytes(&self) -> u64 {
        self.standby.iter().flatten().map(|s| s.rss_bytes).sum()
    }

    /// Which rungs are on standby.
    pub fn on_standby(&self) -> Vec<bool> {
        self.standby.iter().map(Option::is_some).collect()
    }

    /// Which rungs are on standby hot, their weight pages mapped ([`StandbyRung::is_hot`]).
    pub fn on_standby_hot(&self) -> Vec<bool> {
        self.standby
            .iter()
            .map(|s| s.as_ref().is_some_and(StandbyRung::is_hot))
            .collect()
    }

    /// What the models of rungs let go during the answer still hold, bytes (0 between
    /// answers: `Session::free_held_models`).
    pub fn held_model_bytes(&self) -> u64 {
        self.held_bytes()
    }

    /// Takes rung `index` off standby, live, with the time its pages took to map back.
    pub(super) fn take_standby(&mut self, index: usize) -> Option<(LiveRung, f64)> {
        self.standby
            .get_mut(index)
            .and_then(Option::take)
            .map(StandbyRung::activate)
    }

    /// Puts a rung the session no longer runs on standby, when the rules allow it (standby on,
    /// the rung below the current one); otherwise it is freed.
    pub(super) fn retire(&mut self, index: usize, mut live: LiveRung) {
        if !self.opts.standby || index <= self.current {
            self.reap(live);
            return;
        }
        // Its buffers may have grown past the load's measurement while it ran.
        if let Some(seen) = self.context_bytes[index] {
            live.context_bytes = live.context_bytes.max(seen);
        }
        // A rung that was decoding has every weight page mapped: counted as the file's tensor
        // bytes until measured after the answer.
        let weights = self.rung_costs()[index].weights_bytes;
        let hot = self.holds_hot(live.context_bytes + weights);
        self.standby[index] = Some(if hot {
            StandbyRung::from_live_hot_unmeasured(live, weights)
        } else {
            StandbyRung::from_live(live)
        });
    }

    /// Whether a standby rung costing `bytes` with its weight pages mapped may wait hot: hot
    /// standby is on and the budget last read holds it beside everything else (no budget
    /// read: it does).
    fn holds_hot(&self, bytes: u64) -> bool {
        let tokens = self.history.len() as u64 + 1;
        // A budget source not read yet holds nothing: the first reading could be below.
        let holds = match (&self.budget, self.last_budget) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(_), Some(b)) => self.modelled_now(tokens) + bytes <= b,
        };
        self.opts.standby_hot && holds
    }

    /// Cools every hot standby rung (a budget source was attached and has not been read).
    pub(super) fn cool_standby(&mut self) {
        for s in self.standby.iter_mut().flatten() {
            s.cool();
        }
    }

    /// Frees a rung a switch let go of on a thread of its own, so that the destination's first
    /// token does not wait for it: unmapping a 1.5B rung's resident weights, freeing its
    /// buffers and returning the heap to the system took 90-210 ms of the gap at a switch down
    /// on the real ladder. The footprint sample after the switch, and the process's own
    /// footprint reading, wait for it ([`Session::join_reaper`]).
    pub(super) fn reap<T: Send + 'static>(&mut self, garbage: T) {
        // Not waiting for an earlier one: a switch lets go of its source and then of the
        // standby rungs above its destination, and the second waiting for the first put 146 ms
        // back into the gap.
        self.reapers.retain(|h| !h.is_finished());
        // A thread that cannot be spawned drops its closure, and the rung with it, here.
        if let Ok(h) = std::thread::Builder::new()
            .name("molt-free".into())
            .spawn(move || {
                drop(garbage);
                crate::pressure::trim_heap();
            })
        {
            self.reapers.push(h);
        }
    }

    /// Frees rungs a switch let go of, as [`Session::reap`] does, except their llama.cpp models:
    /// their contexts (KV cache, compute buffers) are freed and their weight pages released
    /// from this process on the reaper's thread at once, the models themselves (a few MiB of
    /// tensor and tokenizer tables, [`LiveRung::model_bytes`], counted in the modelled
    /// footprint meanwhile) are held until the answer ends ([`Session::free_held_models`]).
    /// Freeing a model's tables took 35-49 ms of a core at a switch down on the real ladder,
    /// beside a first decode that wants both cores (`results/switch_stall.json`'s
    /// `first_decode` at ~2× the destination's gap).
    pub(super) fn reap_rungs(&mut self, rungs: Vec<LiveRung>) {
        if rungs.is_empty() {
            return;
        }
        for r in &rungs {
            self.held_models.push(super::HeldModel {
                model: Arc::clone(r.ctx.model()),
                bytes: r.model_bytes,
            });
        }
        self.reap(RungContexts(rungs));
    }

    /// What the models [`Session::reap_rungs`] holds still hold, bytes.
    pub(super) fn held_bytes(&self) -> u64 {
        self.held_models.iter().map(|h| h.bytes).sum()
    }

    /// Frees the models [`Session::reap_rungs`] held, on the reaper's thread (`wait`: and
    /// waits for it). Called when the answer ends, and at once when the budget no longer
    /// holds them.
    pub(super) fn free_held_models(&mut self, wait: bool) {
        if !self.held_models.is_empty() {
            let held = std::mem::take(&mut self.held_models);
            self.reap(held);
        }
        if wait {
            self.join_reaper();
        }
    }

    /// Waits until every rung [`Session::reap`] frees is gone.
    pub(super) fn join_reaper(&mut self) {
        for h in self.reapers.drain(..) {
            let _ = h.join();
        }
    }

    /// Drops the standby rungs the rules no longer allow: those at or above the current rung,
    /// and, with a budget, as many as it takes (smallest rung first) for the current rung's
    /// modelled footprint and the rest to fit it. Returns whether any was dropped.
    pub(super) fn settle_standby(&mut self, budget: Option<u64>) -> bool {
        self.settle_standby_with(budget, false)
    }

    /// [`Session::settle_standby`] at a switch, between two tokens of an answer: the models of
    /// the rungs dropped are held until the answer ends ([`Session::reap_rungs`]) — freeing
    /// one beside the next token's decode put ~60-80 ms into that gap.
    pub(super) fn settle_standby_in_answer(&mut self, budget: Option<u64>) -> bool {
        self.settle_standby_with(budget, true)
    }

    fn settle_standby_with(&mut self, budget: Option<u64>, hold: bool) -> bool {
        let mut dropped: Vec<StandbyRung> = Vec::new();
        for i in 0..=self.current.min(self.standby.len().saturating_sub(1)) {
            dropped.extend(self.standby[i].take());
        }
        if let Some(b) = budget {
            let tokens = self.history.len() as u64 + 1;
            // Hot ones are cooled first, smallest rung first: their pages go, the rungs stay.
            while self.modelled_now(tokens) > b {
                let Some(s) = self.standby.iter_mut().rev().flatten().find(|s| s.is_hot()) else {
                    break;
                };
                s.cool();
            }
            while self.standby.iter().any(Option::is_some) && self.modelled_now(tokens) > b {
                if let Some(slot) = self.standby.iter_mut().rev().find(|s| s.is_some()) {
                    dropped.extend(slot.take());
                }
            }
        }
        // Freed off the answer's path, as a switch's source is: two standby rungs dropped after
        // a switch down from tier0 took 240 ms of the gap before the destination's first token.
        let any = !dropped.is_empty();
        if any && hold {
            self.reap_rungs(dropped.into_iter().map(StandbyRung::into_live).collect());
        } else if any {
            self.reap(dropped);
        }
        any
    }

    /// Prepares the missing standby rungs, largest first, each only if the budget last read
    /// holds its cost (measured, or the estimate before it has been loaded) beside the
    /// current rung and the others. A rung that fails to load is left off standby: the
    /// switch that needs it loads it and reports the error then. The session calls it when it
    /// starts and after each answer; a caller that unloaded rungs itself calls it again.
    pub fn prepare_standby(&mut self) {
        if !self.opts.standby || self.is_parked() {
            return;
        }
        // What a rung retired during the answer holds, measured now; a cold one the budget
        // holds hot again is heated (its pages mapped back, off the answer's path).
        for s in self.standby.iter_mut().flatten() {
            s.measure();
        }
        let costs = self.rung_costs();
        for (i, cost) in costs.iter().enumerate().skip(self.current + 1) {
            let weights = cost.weights_bytes;
            let heat = self.standby[i]
                .as_ref()
                .is_some_and(|s| !s.is_hot() && self.holds_hot(weights));
            if heat && let Some(s) = self.standby[i].as_mut() {
                s.heat();
            }
        }
        let tokens = self.history.len() as u64 + 1;
        for i in self.current + 1..self.ladder.rungs.len() {
            if self.standby[i].is_some() || self.rungs[i].is_some() {
                continue;
            }
            let cost = self.rung_costs()[i].compute_bytes;
            if let Some(b) = self.last_budget
                && self.modelled_now(tokens) + cost > b
            {
                continue;
            }
            // A standby rung waits beside the current one and the others: its setup must fit
            // the budget with them.
            let setup = self.speed_setup(i, self.modelled_now(tokens));
            let known = self.known_context_bytes(i, setup);
            if let Ok(mut live) =
                LiveRung::load_known(&self.ladder.rungs[i], self.config, setup, known)
            {
                self.record_load(i, &live);
                self.arm_hidden_tap(i, &mut live.ctx);
                let weights = self.rung_costs()[i].weights_bytes;
                let hot = self.holds_hot(live.context_bytes + weights);
                self.standby[i] = Some(if hot {
                    StandbyRung::from_live_hot(live)
                } else {
                    StandbyRung::from_live(live)
                });
            }
        }
        if let Some(b) = self.last_budget {
            self.settle_standby(Some(b));
        }
        self.read_standby_heads();
    }

    /// Reads the conversation's head on every standby rung that does not hold it yet
    /// ([`StandbyRung::read_head`]): once per conversation and rung, after an answer, so a
    /// switch down onto it decodes no head position at the switch. The decode maps the
    /// rung's weight pages for a moment, as its load did, and releases them again. A rung
    /// whose read fails keeps waiting without a head (its switch decodes it, as before).
    fn read_standby_heads(&mut self) {
        let h = self.opts.head_reread;
        if h == 0 || self.history.len() < h {
            return;
        }
        let head = &self.history[..h];
        for s in self.standby.iter_mut().flatten() {
            let _ = s.read_head(head);
        }
    }

    /// The conversation's head read natively on standby rung `to`, when it holds the head a
    /// switch now re-reads.
    pub(super) fn standby_head(&self, to: usize) -> Option<Arc<Anchor>> {
        let h = self.opts.head_reread.min(self.history.len());
        self.standby.get(to)?.as_ref()?.head_for(&self.history[..h])
    }
}
