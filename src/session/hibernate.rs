//! Hibernation of a session's conversation: [`Session::hibernate`] turns what the session holds
//! between answers — the cache's tokens, the pending token, the messages, llama.cpp's sequence
//! state — into a [`StateFile`], and [`Session::wake`] puts one back, on the rung that wrote
//! it (or through the switch on a smaller one when the budget no longer holds that rung), so
//! the next answer re-reads only its new turn.
//!
//! Only a cache the session computed natively is hibernated: cells a switch projected carry no
//! record of which positions they are once on disk, and a later answer built on them unaware
//! has been seen to answer a conversation that never happened (see `choose_start` in the
//! server). Such a conversation is re-read from its messages when it comes back instead.

use super::{Session, SessionError};
use crate::engine::EngineError;
use crate::state::{StateFile, StateMeta, now_unix_ms};

impl Session {
    /// The conversation as a state file named `id`, or `None` when there is nothing worth
    /// keeping: no cache, a parked cache (its weights are unmapped and its blob is the
    /// parked rung's), or cells a switch projected.
    ///
    /// `first_turn_len` is the length of the conversation's first prompt: a later request must
    /// share it to continue the file (see [`crate::state::Expect`]).
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp fails to export the sequence.
    pub fn hibernate(
        &mut self,
        id: &str,
        first_turn_len: usize,
    ) -> Result<Option<StateFile>, SessionError> {
        if self.history.is_empty() || self.parked.is_some() || !self.projected.is_empty() {
            return Ok(None);
        }
        let rung = self.current;
        let info = self.ladder.rungs[rung].clone();
        let n_ctx = self.config.n_ctx;
        let live = self.live();
        let blob = live
            .ctx
            .export_state()
            .map_err(|source| SessionError::Engine {
                rung: info.name().to_string(),
                source,
            })?;
        let pos_start = u32::try_from(live.ctx.seq_pos_min().max(0)).unwrap_or(0);
        Ok(Some(StateFile {
            meta: StateMeta {
                conversation: id.to_string(),
                rung: info.name().to_string(),
                rung_sha256: info.sha256.clone(),
                n_ctx,
                tokens: self.history.clone(),
                pos_start,
                pending: self.pending,
                first_turn_len: first_turn_len.min(self.history.len()),
                pinned: self.pinned.min(self.history.len()),
                messages: self.conversation.clone(),
                written_unix_ms: now_unix_ms(),
            },
            blob,
        }))
    }

    /// Re-reads natively, in place, every position of the cache a switch projected or left
    /// out, so the cache is the current rung's own and [`Session::hibernate`] can keep it.
    /// Returns the positions read (0 when the cache was already native). A refill in progress
    /// is dropped: this reads what it had left.
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp fails (the ranges not read stay projected).
    pub fn settle(&mut self) -> Result<usize, SessionError> {
        if self.projected.is_empty() || self.parked.is_some() {
            return Ok(0);
        }
        self.drop_refill();
        let ranges = std::mem::take(&mut self.projected);
        let spans = crate::engine::Span::of(&self.history, &ranges);
        let rung = self.current_rung().to_string();
        let cur = self.current;
        let read = match self.rungs[cur].as_mut() {
            Some(live) => live.ctx.recompute_spans(&spans),
            None => Ok(0),
        };
        match read {
            Ok(n) => {
                self.holes = false;
                Ok(n)
            }
            Err(source) => {
                self.projected = ranges;
                Err(SessionError::Engine { rung, source })
            }
        }
    }

    /// Replaces whatever the session holds with `file`'s conversation, on the rung that wrote
    /// it (loaded now if needed; the session's other rung is freed as in
    /// [`Session::move_idle`]) — or, when the budget read now does not hold that rung (loaded
    /// or not), on the largest smaller rung that does, the cache carried there through the
    /// switch. The caller has checked the file ([`StateFile::check`]).
    ///
    /// # Errors
    /// [`SessionError::WakeOverBudget`] when the budget holds no rung at or below the file's
    /// (or the strategy re-reads at a switch; nothing is changed); [`SessionError::UnknownRung`] for a rung
    /// above the session's home, a load failure, or
    /// [`SessionError::Engine`] when llama.cpp refuses the blob or it does not hold the file's
    /// tokens; the session is then left reset (empty), never half-restored.
    pub fn wake(&mut self, file: &StateFile) -> Result<(), SessionError> {
        let m = &file.meta;
        let index = self
            .ladder
            .rungs
            .iter()
            .position(|r| r.name() == m.rung)
            .ok_or_else(|| SessionError::UnknownRung(m.rung.clone()))?;
        // The budget as it is now: a file may be woken before any answer has read it (a chat
        // resumed at its start under a cap).
        if let Ok(Some(b)) = self.read_budget(crate::pressure::Tick::default()) {
            self.last_budget = Some(b.bytes);
        }
        // Waking on a rung the budget no longer holds would load it over the budget (seen in
        // `bench --serve-qos`: tier0's file woken under a 700 MiB budget, 1.7 GB resident for
        // a moment); the caller re-reads the conversation on a rung that fits instead.
        let tokens = m.tokens.len() as u64 + 1;
        let need = self.modelled_footprint(index, tokens);
        // (Loaded already but over the budget — the rung a chat starts on — counts the same:
        // the answer would only move off it, re-reading the conversation.)
        if let Some(budget) = self.last_budget
            && need > budget
        {
            // The largest smaller rung that holds the conversation takes the file's cache
            // through the switch, as an answer's switch down would.
            let fits = (index + 1..self.ladder.rungs.len())
                .find(|&r| self.modelled_footprint(r, tokens) <= budget);
            if let Some(to) = fits
                && m.pos_start == 0
                && self.opts.strategy != super::Strategy::Reprefill
            {
                return self.wake_through(file, index, to);
            }
            return Err(SessionError::WakeOverBudget {
                rung: m.rung.clone(),
                need_mib: need >> 20,
                tokens,
                budget_mib: budget >> 20,
            });
        }
        self.reset();
        self.move_idle(index)?;
        let name = m.rung.clone();
        let live = self.live();
        let imported = live.ctx.import_state(&file.blob).and_then(|()| {
            let held = live.ctx.n_past();
            let want = m.pos_start as usize + m.tokens.len();
            if held == want {
                Ok(())
            } else {
                Err(EngineError::State {
                    op: "wake",
                    detail: format!(
                        "the blob holds positions up to {held}, the file's tokens end at {want}"
                    ),
                })
            }
        });
        if let Err(source) = imported {
            self.reset();
            return Err(SessionError::Engine { rung: name, source });
        }
        self.history.clone_from(&m.tokens);
        self.pending = m.pending;
        self.pinned = m.pinned;
        self.conversation.clone_from(&m.messages);
        Ok(())
    }

    /// Wakes `file` (written on rung `from`) on rung `to` through the switch: the file's
    /// cache is projected onto `to` — the head re-read natively, and on a size route the
    /// positions a switch re-reads — without loading `from`. The cells left projected are
    /// recorded, as after an answer's switch (the conversation is then not hibernated again
    /// until it is read natively).
    ///
    /// # Errors
    /// As [`Session::wake`]; also the route's projector missing or refusing the cache (the
    /// session is then left reset and the conversation re-read by the caller).
    fn wake_through(
        &mut self,
        file: &StateFile,
        from: usize,
        to: usize,
    ) -> Result<(), SessionError> {
        let m = &file.meta;
        self.reset();
        self.move_idle(to)?;
        let exported = super::migrate::Exported {
            blob: &file.blob,
            n_past: m.tokens.len(),
            from: &m.rung,
            export_ms: 0.0,
        };
        match self.carry_onto_current(from, exported, &m.tokens, m.pending) {
            Ok((_, projected, _)) => {
                self.history.clone_from(&m.tokens);
                self.pending = m.pending;
                self.pinned = m.pinned;
                self.conversation.clone_from(&m.messages);
                self.projected = projected;
                Ok(())
            }
            Err(e) => {
                self.reset();
                Err(e)
            }
        }
    }

    /// Replaces whatever the session holds with `file`'s conversation on rung `rung` (an index
    /// into the ladder, at or below the session's home): the rung that wrote it takes the file
    /// as [`Session::wake`] does; any other takes the file's cache through the switch, without
    /// loading the rung that wrote it. What a conversation hibernated on one rung and resumed
    /// on a smaller one (another process, a tighter budget) goes through.
    ///
    /// # Errors
    /// As [`Session::wake`]; [`SessionError::UnknownRung`] for a rung off the ladder or above
    /// home, or for a file whose rung is not on this ladder.
    pub fn wake_on(&mut self, file: &StateFile, rung: usize) -> Result<(), SessionError> {
        let from = self
            .ladder
            .rungs
            .iter()
            .position(|r| r.name() == file.meta.rung)
            .ok_or_else(|| SessionError::UnknownRung(file.meta.rung.clone()))?;
        if rung >= self.ladder.rungs.len() || rung < self.home {
            return Err(SessionError::UnknownRung(rung.to_string()));
        }
        if rung == from || file.meta.pos_start != 0 {
            return self.wake(file);
        }
        self.wake_through(file, from, rung)
    }

    /// The token sampled last and not yet decoded (what a hibernated file must carry).
    pub fn pending_token(&self) -> Option<crate::engine::Token> {
        self.pending
    }
}
