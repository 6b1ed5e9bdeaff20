//! A switch up prepared in the background ([`SessionOptions::prepare_up`](super::SessionOptions::prepare_up)).
//!
//! A switch down answers pressure and cannot wait; a switch up answers memory coming back, and
//! nothing is lost by taking it a few tokens later. So when the policy first asks to move up
//! to a rung that is neither loaded nor on standby, the session starts loading it on a thread
//! of its own and keeps decoding on the rung it is on; the switch happens at the first token
//! after the load finished, with the destination already live, and the user's gap at the
//! switch is the transplant alone instead of the load plus the transplant.
//!
//! The rules, checked at every token boundary while the load runs:
//! - **Counted**: the rung being loaded is part of the session's modelled footprint
//!   ([`Session::modelled_now`]) from the moment its load starts, at its full footprint with
//!   the conversation's context (what it holds once the cache is carried, the source still
//!   live). A load starts only when the budget holds the current rung and the destination
//!   together; standby rungs are given up first to make room for it.
//! - **Dropped**: if the budget no longer holds both, or the policy stops asking for that rung,
//!   or the answer ends first, the load is waited for and what it loaded freed before anything
//!   else happens, and a [`PrepareInfo`] says so (`dropped`, with the reason).
//! - **No room for both**: when the budget holds the destination but not the two rungs side by
//!   side, the switch up is taken on the spot, source freed first (as a switch down is), so
//!   the process never holds both: the load's stall is paid, the budget is kept.
//! - **Failed**: a background load that fails leaves the answer on the rung it is on, with a
//!   [`PrepareInfo`] (`failed`, the error); that rung is not tried again during the answer.
//!
//! The process's own footprint reading is skipped while a load runs: it would charge the
//! half-loaded rung to the one decoding.

use std::thread::JoinHandle;
use std::time::Instant;

use super::{Event, LiveRung, PrepareInfo, PrepareState, Session, SessionError};

/// A rung being loaded on a thread of its own.
pub(super) struct Preparing {
    /// The rung.
    index: usize,
    /// The speed setup it is loading with.
    setup: crate::speed::RungSetup,
    /// When the load started.
    started: Instant,
    /// Tokens decoded on the source since.
    tokens: usize,
    handle: JoinHandle<Result<LiveRung, SessionError>>,
}

/// What a prepared switch up reports: how long the destination took to load in the background,
/// and how many tokens the source decoded meanwhile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Prepared {
    /// The background load, ms.
    pub ms: f64,
    /// Tokens decoded on the source while it ran.
    pub tokens: usize,
}

/// Whether a switch up can be taken at this token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Readiness {
    /// Switch now: the destination is live (loaded, on standby, or prepared), or it must be
    /// loaded on the spot (preparing off, or no room for both rungs).
    Now,
    /// Stay on the current rung for this token: the destination is loading, or its background
    /// load failed during this answer.
    Wait,
}

impl Session {
    /// Whether the switch up to `to` can be taken before token `at_token`, under `budget`
    /// (`None`: no budget source, as for a forced switch). Starts the background load the
    /// first time, installs the destination once it has loaded, and applies the rules of the
    /// module docs, reporting into `sink`.
    ///
    /// # Errors
    /// A thread that cannot be spawned.
    pub(super) fn promote_ready(
        &mut self,
        to: usize,
        at_token: usize,
        budget: Option<u64>,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Readiness, SessionError> {
        if !self.opts.prepare_up || self.rungs[to].is_some() || self.standby[to].is_some() {
            self.abandon_prepare(at_token, "the destination is ready without it", sink);
            return Ok(Readiness::Now);
        }
        if self.prepare_failed == Some(to) {
            return Ok(Readiness::Wait);
        }
        let tokens = self.history.len() as u64 + 1;
        let both =
            self.modelled_footprint(self.current, tokens) + self.modelled_footprint(to, tokens);
        if let Some(b) = budget
            && both > b
        {
            let reason = format!(
                "the budget {} MiB no longer holds {} and {} side by side ({} MiB)",
                b >> 20,
                self.current_rung(),
                self.ladder.rungs[to].name(),
                both >> 20
            );
            self.abandon_prepare(at_token, &reason, sink);
            return Ok(Readiness::Now);
        }
        let finished = match &mut self.preparing {
            Some(p) if p.index == to => p.handle.is_finished(),
            _ => {
                self.abandon_prepare(
                    at_token,
                    &format!(
                        "the policy moves to {} instead",
                        self.ladder.rungs[to].name()
                    ),
                    sink,
                );
                self.start_prepare(to, at_token, budget, sink)?;
                return Ok(Readiness::Wait);
            }
        };
        if !finished {
            if let Some(p) = self.preparing.as_mut() {
                p.tokens += 1;
            }
            return Ok(Readiness::Wait);
        }
        let p = self.preparing.take().expect("matched above");
        let ms = p.started.elapsed().as_secs_f64() * 1e3;
        let loaded = p.handle.join().unwrap_or_else(|_| {
            Err(SessionError::Prepare(
                "the background load's thread panicked".into(),
            ))
        });
        match loaded {
            Ok(mut live) => {
                self.record_load(to, &live);
                self.arm_hidden_tap(to, &mut live.ctx);
                self.rungs[to] = Some(live);
                self.prepared = Some(Prepared {
                    ms,
                    tokens: p.tokens,
                });
                Ok(Readiness::Now)
            }
            Err(e) => {
                crate::pressure::trim_heap();
                self.prepare_failed = Some(to);
                sink(&Event::Prepare(PrepareInfo {
                    at_token,
                    state: PrepareState::Failed,
                    from: self.current_rung().to_string(),
                    to: self.ladder.rungs[to].name().to_string(),
                    elapsed_ms: ms,
                    tokens: p.tokens,
                    modelled_bytes: self.modelled_now(tokens),
                    budget_bytes: budget.unwrap_or(0),
                    reason: Some(format!("{e}; the answer stays on {}", self.current_rung())),
                }));
                Ok(Readiness::Wait)
            }
        }
    }

    /// Starts loading rung `to` on a thread of its own, counts it in the footprint, gives up
    /// the standby rungs it needs room from, and says so in `sink`.
    fn start_prepare(
        &mut self,
        to: usize,
        at_token: usize,
        budget: Option<u64>,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<(), SessionError> {
        let info = self.ladder.rungs[to].clone();
        let config = self.config;
        let setup = self.speed_setup(to, 0);
        let known = self.known_context_bytes(to, setup);
        let handle = std::thread::Builder::new()
            .name(format!("molt-prepare-{}", info.name()))
            .spawn(move || LiveRung::load_known(&info, config, setup, known))
            .map_err(|e| SessionError::Prepare(e.to_string()))?;
        self.preparing = Some(Preparing {
            index: to,
            setup,
            started: Instant::now(),
            // This token is decoded on the source.
            tokens: 1,
            handle,
        });
        // Standby rungs are the first thing given up: the rung loading takes their room.
        self.settle_standby(budget);
        let tokens = self.history.len() as u64 + 1;
        sink(&Event::Prepare(PrepareInfo {
            at_token,
            state: PrepareState::Started,
            from: self.current_rung().to_string(),
            to: self.ladder.rungs[to].name().to_string(),
            elapsed_ms: 0.0,
            tokens: 0,
            modelled_bytes: self.modelled_now(tokens),
            budget_bytes: budget.unwrap_or(0),
            reason: None,
        }));
        Ok(())
    }

    /// What the background load of the switch about to happen cost, if it had one.
    pub(super) fn take_prepared(&mut self) -> Option<Prepared> {
        self.prepared.take()
    }

    /// The speed setup of rung `index` if it is the one loading in the background.
    pub(super) fn preparing_setup(&self, index: usize) -> Option<crate::speed::RungSetup> {
        self.preparing
            .as_ref()
            .filter(|p| p.index == index)
            .map(|p| p.setup)
    }

    /// Whether a rung is being loaded in the background.
    pub(super) fn is_preparing(&self) -> bool {
        self.preparing.is_some()
    }

    /// What the rung loading in the background counts in the modelled footprint at `tokens`
    /// of context: its whole footprint, as it will hold once the cache is carried.
    pub(super) fn preparing_bytes(&self, tokens: u64) -> u64 {
        self.preparing
            .as_ref()
            .map_or(0, |p| self.modelled_footprint(p.index, tokens))
    }

    /// Waits for a background load that is no longer wanted and frees what it loaded; says
    /// so in `sink` (with `reason`) if one was running.
    pub(super) fn abandon_prepare(
        &mut self,
        at_token: usize,
        reason: &str,
        sink: &mut dyn FnMut(&Event),
    ) {
        let Some(p) = self.preparing.take() else {
            self.prepared = None;
            return;
        };
        let elapsed_ms = p.started.elapsed().as_secs_f64() * 1e3;
        let tokens = self.history.len() as u64 + 1;
        let modelled_bytes = self.modelled_now(tokens) + self.modelled_footprint(p.index, tokens);
        drop(p.handle.join());
        crate::pressure::trim_heap();
        self.prepared = None;
        sink(&Event::Prepare(PrepareInfo {
            at_token,
            state: PrepareState::Dropped,
            from: self.current_rung().to_string(),
            to: self.ladder.rungs[p.index].name().to_string(),
            elapsed_ms,
            tokens: p.tokens,
            modelled_bytes,
            budget_bytes: self.last_budget.unwrap_or(0),
            reason: Some(reason.to_string()),
        }));
    }
}
