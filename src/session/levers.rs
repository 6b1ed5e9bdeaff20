//! The levers a session pulls between two tokens besides switching rung: **park** (unmap
//! the weights, keep the KV cache in host memory as llama.cpp's own state blob), **resume**
//! (map them again, re-import, decode the pending token), **shed** (drop the oldest context
//! after the pinned system prompt), and moving a parked cache to another rung's layout.
//!
//! Which lever, and when, is [`decide_one`](crate::sched::decide_one)'s choice; this file only
//! performs it and reports a [`LeverInfo`] and a [`FootprintSample`] measured after it.
//!
//! While parked the session's `current` index is the rung the policy believes the cache is
//! on. A demotion of a parked cache is projected at once (it frees memory, which is why the
//! policy asked for it); a promotion is deferred to the resume, so the cache is projected at
//! most once and never held in a layout larger than the policy assumed.

use std::time::Instant;

use super::error::MigrationStep;
use super::migrate;
use super::rung::ParkedRung;
use super::{FootprintSample, LeverInfo, Session, SessionError, Strategy};
use crate::engine::Token;
use crate::pressure::{Budget, process_rss_bytes};
use crate::routes;
use crate::transplant::shift::shed_blob;

/// A parked rung as the session holds it.
pub(super) struct Parked {
    /// The exported cache (empty when it was dropped for a re-prefill, condition C).
    pub rung: ParkedRung,
    /// Index of the rung whose layout the blob is in.
    pub layout: usize,
    /// When the weights were released.
    pub since: Instant,
}

/// Tokens of a chat prompt that shedding must keep: the rendered system prompt and the opening
/// of the first user turn — the longest token prefix two different one-turn chats share — if
/// `tokens` starts with it; 0 otherwise (or when the model has no chat template).
pub fn chat_pinned_prefix(model: &crate::engine::Model, tokens: &[Token]) -> usize {
    let render = |text: &str| {
        model
            .tokenize_chat(&[crate::engine::ChatMessage::new("user", text)], true)
            .ok()
    };
    match (render("a"), render("b")) {
        (Some(a), Some(b)) => {
            let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            if tokens.len() >= shared && tokens[..shared] == a[..shared] {
                shared
            } else {
                0
            }
        }
        _ => 0,
    }
}

fn rss() -> u64 {
    process_rss_bytes().unwrap_or(0)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl Session {
    /// Whether the weights are parked.
    pub fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// Parks the current rung now, between answers (an app sent to the background, a
    /// benchmark): the cache is exported, every loaded rung's weights unmapped. The next
    /// answer, or [`Session::resume_weights`], maps them again.
    ///
    /// # Errors
    /// [`SessionError::Engine`] if the cache cannot be exported (nothing is freed then).
    pub fn park_weights(&mut self) -> Result<LeverInfo, SessionError> {
        if self.is_parked() {
            return Err(SessionError::AlreadyParked {
                rung: self.current_rung().to_string(),
            });
        }
        let budget = Budget {
            bytes: self.last_budget.unwrap_or(0),
            pressure: 0.0,
            origin: crate::pressure::BudgetOrigin::Fixed,
        };
        let at = self.current;
        self.park(at, 0, budget)
    }

    /// Maps a parked rung's weights again and re-imports its cache (a no-op when running).
    ///
    /// # Errors
    /// A load failure, or llama.cpp refusing the cache.
    pub fn resume_weights(&mut self) -> Result<(), SessionError> {
        self.unpark()
    }

    /// Leading tokens of the cache that shedding never drops (the system prompt).
    pub fn pinned_tokens(&self) -> usize {
        self.pinned
    }

    /// Bytes of the parked cache held in host memory (0 when running).
    pub fn parked_kv_bytes(&self) -> u64 {
        self.parked.as_ref().map_or(0, |p| p.rung.kv_bytes())
    }

    /// The footprint the policy assigns the session's present state: the current rung's
    /// resident cost (unless parked) plus the KV of `tokens` context tokens, plus what the
    /// standby rungs hold (measured), plus a rung loading in the background for a switch up
    /// (its whole footprint at `tokens`: see `super::prepare`).
    pub fn modelled_now(&self, tokens: u64) -> u64 {
        let costs = self.rung_costs();
        let c = &costs[self.current];
        let weights = if self.is_parked() {
            0
        } else {
            c.resident_bytes()
        };
        weights
            + c.kv_bytes(tokens)
            + self.standby_bytes()
            + self.preparing_bytes(tokens)
            + self.held_bytes()
    }

    /// Raises the current rung's anonymous cost to what the process shows (see
    /// [`super::SessionOptions::observe_footprint`]): the growth of `RssAnon` since the session
    /// started, less what the other loaded rungs measured at load and any parked cache.
    pub(super) fn observe_footprint(&mut self) {
        // A rung loading in the background would be charged to the one decoding.
        if !self.opts.observe_footprint || self.is_parked() || self.is_preparing() {
            return;
        }
        self.join_reaper();
        let Ok(anon) = crate::pressure::process_anon_rss_bytes() else {
            return;
        };
        let others: u64 = (0..self.rungs.len())
            .filter(|&i| i != self.current && self.rungs[i].is_some())
            .map(|i| self.context_bytes[i].unwrap_or(0))
            .sum::<u64>()
            + self.standby_bytes()
            + self.held_bytes();
        let mine = anon
            .saturating_sub(self.anon_base)
            .saturating_sub(others)
            .saturating_sub(self.parked_kv_bytes());
        let slot = &mut self.context_bytes[self.current];
        if slot.is_none_or(|b| mine > b) {
            *slot = Some(mine);
        }
    }

    /// Measures the session now (see [`FootprintSample`]).
    pub fn footprint_sample(&self, at_token: usize, budget_bytes: u64) -> FootprintSample {
        let tokens = self.history.len() + 1;
        FootprintSample {
            at_token,
            rung: self.current_rung().to_string(),
            parked: self.is_parked(),
            context_tokens: tokens,
            measured_bytes: self.measured_footprint(),
            modelled_bytes: self.modelled_now(tokens as u64),
            rss_bytes: rss(),
            peak_rss_bytes: {
                let peak = crate::pressure::process_peak_rss_bytes().unwrap_or(0);
                crate::pressure::reset_peak_rss();
                peak
            },
            budget_bytes,
        }
    }

    /// Tokens of `tokens` that shedding must keep: [`super::SessionOptions::pinned_tokens`]
    /// when set; for a chat, the rendered system prompt and the opening of the first user turn
    /// (the longest token prefix two different one-turn chats share); for raw text, none.
    pub(super) fn pinned_prefix(&mut self, tokens: &[Token], chat: bool) -> usize {
        if let Some(n) = self.opts.pinned_tokens {
            return n.min(tokens.len());
        }
        if !chat {
            return 0;
        }
        let model = std::sync::Arc::clone(self.live().ctx.model());
        chat_pinned_prefix(&model, tokens)
    }

    pub(super) fn lever(
        &self,
        at_token: usize,
        lever: &str,
        tokens: usize,
        t0: Instant,
    ) -> LeverInfo {
        LeverInfo {
            at_token,
            lever: lever.to_string(),
            rung: self.current_rung().to_string(),
            tokens,
            cost_ms: ms(t0),
            parked_ms: 0.0,
            rss_before: 0,
            rss_after: rss(),
            parked_kv_bytes: self.parked_kv_bytes(),
            budget_bytes: 0,
        }
    }

    /// Parks: exports the current rung's cache, frees every loaded rung (unmapping its
    /// weights), and, if the policy parks on a smaller rung, projects the cache there.
    pub(super) fn park(
        &mut self,
        rung: usize,
        at_token: usize,
        budget: Budget,
    ) -> Result<LeverInfo, SessionError> {
        let t0 = Instant::now();
        self.drop_refill();
        self.free_held_models(true);
        let rss_before = rss();
        let from = self.current;
        // Export before anything is freed: if llama.cpp refuses, the session stays as it was.
        let live = self.rungs[from]
            .as_ref()
            .ok_or_else(|| SessionError::UnknownRung(from.to_string()))?;
        let blob = live
            .ctx
            .export_state()
            .map_err(|source| SessionError::Engine {
                rung: live.name().to_string(),
                source,
            })?;
        let cells = live.ctx.n_past();
        let parked = ParkedRung {
            info: live.info.clone(),
            config: live.ctx.config(),
            setup: live.setup,
            blob,
            n_past: cells,
            park_ms: ms(t0),
        };
        for slot in &mut self.rungs {
            *slot = None;
        }
        // Nothing runs while parked: a standby rung would only hold memory.
        for slot in &mut self.standby {
            *slot = None;
        }
        crate::pressure::trim_heap();
        self.parked = Some(Parked {
            rung: parked,
            layout: from,
            since: Instant::now(),
        });
        if rung > from {
            self.move_parked_down(rung)?;
        }
        self.current = rung;
        let mut info = self.lever(at_token, "park", cells, t0);
        info.rss_before = rss_before;
        info.budget_bytes = budget.bytes;
        Ok(info)
    }

    /// Moves a parked cache to rung `to`: projected now if `to` is smaller (Molt), dropped
    /// for a re-prefill at resume (condition C); a larger rung is only noted (see the module
    /// docs).
    pub(super) fn move_parked(
        &mut self,
        to: usize,
        at_token: usize,
        budget: Budget,
    ) -> Result<Option<LeverInfo>, SessionError> {
        let t0 = Instant::now();
        let layout = self.parked.as_ref().map_or(to, |p| p.layout);
        self.current = to;
        if to <= layout {
            return Ok(None);
        }
        let rss_before = rss();
        self.move_parked_down(to)?;
        let cells = self.parked.as_ref().map_or(0, |p| p.rung.n_past);
        let mut info = self.lever(at_token, "relayout", cells, t0);
        info.rss_before = rss_before;
        info.budget_bytes = budget.bytes;
        Ok(Some(info))
    }

    fn move_parked_down(&mut self, to: usize) -> Result<(), SessionError> {
        let Some(p) = self.parked.as_mut() else {
            return Ok(());
        };
        if p.layout == to {
            return Ok(());
        }
        let from = p.layout;
        let blob = if self.opts.strategy == Strategy::Reprefill || p.rung.n_past == 0 {
            Vec::new()
        } else {
            let projector = self.routes.get(from, to)?;
            migrate::project_blob(&p.rung.blob, &projector, self.config.cache_type)
                .map_err(|source| SessionError::Migration {
                    from: self.ladder.rungs[from].name().to_string(),
                    to: self.ladder.rungs[to].name().to_string(),
                    source,
                })?
                .0
        };
        p.rung = ParkedRung {
            info: self.ladder.rungs[to].clone(),
            config: p.rung.config,
            // Chosen anew when it resumes.
            setup: p.rung.setup,
            n_past: if blob.is_empty() { 0 } else { p.rung.n_past },
            blob,
            park_ms: p.rung.park_ms,
        };
        p.layout = to;
        // The parked cache is now the projection of another rung's (or nothing).
        self.projected = super::native::all(p.rung.n_past);
        Ok(())
    }

    /// Drops `n` tokens after the pinned prefix from the parked cache (keys re-rotated to
    /// their new positions on the Rust side: there is no context to do it).
    pub(super) fn shed_parked(
        &mut self,
        n: usize,
        at_token: usize,
        budget: Budget,
    ) -> Result<LeverInfo, SessionError> {
        let t0 = Instant::now();
        let rss_before = rss();
        let pinned = self.pinned.min(self.history.len());
        let n = n.min(self.history.len() - pinned);
        if let Some(p) = self.parked.as_mut()
            && n > 0
            && p.rung.n_past > 0
        {
            let layout = p.layout;
            let rope = routes::binding(&self.ladder.rungs[layout]).rope;
            p.rung.blob =
                shed_blob(&p.rung.blob, pinned, n, &rope).map_err(|e| SessionError::Migration {
                    from: self.ladder.rungs[layout].name().to_string(),
                    to: self.ladder.rungs[layout].name().to_string(),
                    source: MigrationStep::Shed.fail(e),
                })?;
            p.rung.n_past -= n;
            crate::pressure::trim_heap();
        }
        Ok(self.after_shed(pinned, n, at_token, t0, rss_before, budget))
    }

    /// The session's side of a shed of `n` tokens after `pinned`, once the cache (live or
    /// parked) has dropped them: the history, the attention mass read before it, the projected
    /// cells, and the lever's record.
    fn after_shed(
        &mut self,
        pinned: usize,
        n: usize,
        at_token: usize,
        t0: Instant,
        rss_before: u64,
        budget: Budget,
    ) -> LeverInfo {
        self.history.drain(pinned..pinned + n);
        // The attention mass was read over the positions before the shed.
        self.observed = None;
        self.projected = super::native::shed(&self.projected, pinned, n);
        let mut info = self.lever(at_token, "shed", n, t0);
        info.rss_before = rss_before;
        info.budget_bytes = budget.bytes;
        info
    }

    /// Drops `n` tokens after the pinned prefix of the live cache (llama.cpp shifts the later
    /// positions), then decodes `tok`.
    pub(super) fn shed_live(
        &mut self,
        n: usize,
        tok: Token,
        at_token: usize,
        budget: Budget,
    ) -> Result<LeverInfo, SessionError> {
        let t0 = Instant::now();
        let rss_before = rss();
        let pinned = self.pinned.min(self.history.len());
        let n = n.min(self.history.len() - pinned);
        let name = self.current_rung().to_string();
        self.live()
            .ctx
            .shed_and_decode(pinned, n, &[tok])
            .map_err(|source| SessionError::Engine { rung: name, source })?;
        Ok(self.after_shed(pinned, n, at_token, t0, rss_before, budget))
    }

    /// Resumes on rung `to`: projects the parked cache there if its layout differs (or
    /// re-reads the history, for condition C or a dropped cache), maps the weights, imports,
    /// and decodes `tok`.
    pub(super) fn resume(
        &mut self,
        to: usize,
        tok: Token,
        at_token: usize,
        budget: Option<Budget>,
    ) -> Result<LeverInfo, SessionError> {
        let t0 = Instant::now();
        let rss_before = rss();
        let Some(mut p) = self.parked.take() else {
            return Err(SessionError::UnknownRung(to.to_string()));
        };
        let parked_ms = ms(p.since);
        if p.layout != to && p.rung.n_past > 0 {
            if self.opts.strategy == Strategy::Reprefill {
                p.rung.blob.clear();
                p.rung.n_past = 0;
            } else {
                let projector = match self.routes.get(p.layout, to) {
                    Ok(x) => x,
                    Err(e) => {
                        self.parked = Some(p);
                        return Err(e.into());
                    }
                };
                match migrate::project_blob(&p.rung.blob, &projector, self.config.cache_type) {
                    Ok((bytes, _, cells)) => {
                        p.rung.blob = bytes;
                        self.projected = super::native::all(cells);
                    }
                    Err(source) => {
                        let from = self.ladder.rungs[p.layout].name().to_string();
                        self.parked = Some(p);
                        return Err(SessionError::Migration {
                            from,
                            to: self.ladder.rungs[to].name().to_string(),
                            source,
                        });
                    }
                }
            }
        }
        p.rung.info = self.ladder.rungs[to].clone();
        // The budget may have changed while parked; the cache does not depend on the setup.
        p.rung.setup = self.speed_setup(to, 0);
        let cells = p.rung.n_past;
        let mut live = p.rung.resume()?;
        let wrap = |source| SessionError::Engine {
            rung: self.ladder.rungs[to].name().to_string(),
            source,
        };
        if cells == 0 {
            live.ctx.decode(&self.history).map_err(wrap)?;
        }
        live.ctx.decode(&[tok]).map_err(wrap)?;
        self.record_load(to, &live);
        self.rungs[to] = Some(live);
        self.current = to;
        self.stall_ms += parked_ms;
        let mut info = self.lever(at_token, "resume", cells, t0);
        info.parked_ms = parked_ms;
        info.rss_before = rss_before;
        info.budget_bytes = budget.map_or(0, |b| b.bytes);
        Ok(info)
    }

    /// The switch an answer made by parking on one rung and resuming on another: reported as
    /// a switch like any other rung change, so `rungs_used`, `migrations` and the switch
    /// events agree. Its cost is the resume's (which projected the parked cache, mapped the
    /// weights and imported it); the park and any re-layout are their own lever events.
    pub(super) fn parked_switch(&self, from: usize, at_token: usize) -> super::SwitchInfo {
        let resume = self
            .answer_levers
            .iter()
            .rev()
            .find(|l| l.lever == "resume" && l.at_token == at_token);
        super::SwitchInfo {
            at_token,
            from: self.ladder.rungs[from].name().to_string(),
            to: self.current_rung().to_string(),
            method: if self.opts.strategy == Strategy::Reprefill {
                super::SwitchMethod::Reprefill
            } else {
                super::SwitchMethod::Molt
            },
            timings: super::migrate::SwitchTimings {
                cost_ms: resume.map_or(0.0, |l| l.cost_ms),
                cells: resume.map_or(0, |l| l.tokens),
                ..super::migrate::SwitchTimings::default()
            },
            flops_reprefill: 0.0,
            pressure: 0.0,
            budget_bytes: self.last_budget.unwrap_or(0),
            handoff_jsd: None,
            handoff_floor_jsd: None,
            note: Some(
                "parked on one rung, resumed on another (see the park and resume levers)".into(),
            ),
            setup: self.rung_setup(self.current),
        }
    }

    /// Makes the current rung live again if an answer ended parked (cancelled while waiting):
    /// called before the next answer reads its prompt. The pending token, if any, stays
    /// pending; the cache is re-imported as it was.
    pub(super) fn unpark(&mut self) -> Result<(), SessionError> {
        if let Some(p) = self.parked.take() {
            let to = self.current;
            let mut rung = p.rung;
            if p.layout != to {
                // A deferred promotion: resume where the cache is.
                self.current = p.layout;
            }
            rung.info = self.ladder.rungs[self.current].clone();
            rung.setup = self.speed_setup(self.current, 0);
            let empty = rung.n_past == 0;
            let mut live = rung.resume()?;
            if empty && !self.history.is_empty() {
                let name = self.current_rung().to_string();
                live.ctx
                    .decode(&self.history)
                    .map_err(|source| SessionError::Engine { rung: name, source })?;
            }
            let at = self.current;
            self.rungs[at] = Some(live);
        }
        let at = self.current;
        self.ensure_loaded(at)?;
        Ok(())
    }
}
