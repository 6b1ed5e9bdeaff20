//! A switch up prepared in the background ([`SessionOptions::prepare_up`](super::SessionOptions::prepare_up)).
//!
//! A switch down answers pressure and cannot wait; a switch up answers memory coming back, and
//! nothing is lost by taking it a few tokens later. So when the policy first asks to move up
//! to a rung that is neither loaded nor on standby, the session starts loading it on a thread
//! of its own and keeps decoding on the rung it is on; the switch happens at the first token
//! after the load finished, with the destination already live, and the user's gap at the
//! switch is the transplant alone instead of the load plus the transplant.
//!
//! While the load runs, the process holds both rungs — as the load-first switch does for the
//! length of its load, only spread over more tokens, and only while the budget allows the
//! move up. If the policy stops asking for that rung (the budget fell, or it wants another),
//! the load is waited for and dropped before anything else happens, so no rung the policy no
//! longer counts stays in memory. The process's own footprint reading is skipped meanwhile:
//! it would charge the half-loaded rung to the one decoding.

use std::thread::JoinHandle;
use std::time::Instant;

use super::{LiveRung, Session, SessionError};

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

impl Session {
    /// Whether the switch up to `to` can happen now. `true` when the destination is loaded or
    /// on standby (nothing to wait for), when preparing is off, or when its background load
    /// has finished (it is then live in its slot, and [`Session::take_prepared`] says what it
    /// cost). `false` while the load runs — it is started here the first time — and the
    /// caller stays on its rung for this token. A load that failed is not retried in the
    /// background: the switch then loads on the spot and reports the error as it always did.
    ///
    /// # Errors
    /// A thread that cannot be spawned.
    pub(super) fn promote_ready(&mut self, to: usize) -> Result<bool, SessionError> {
        if !self.opts.prepare_up || self.rungs[to].is_some() || self.standby[to].is_some() {
            self.abandon_prepare();
            return Ok(true);
        }
        match &mut self.preparing {
            Some(p) if p.index == to => {
                if !p.handle.is_finished() {
                    p.tokens += 1;
                    return Ok(false);
                }
            }
            _ => {
                self.abandon_prepare();
                let info = self.ladder.rungs[to].clone();
                let config = self.config;
                let setup = self.speed_setup(to, 0);
                let handle = std::thread::Builder::new()
                    .name(format!("molt-prepare-{}", info.name()))
                    .spawn(move || LiveRung::load_with(&info, config, setup))
                    .map_err(|e| SessionError::Prepare(e.to_string()))?;
                self.preparing = Some(Preparing {
                    index: to,
                    setup,
                    started: Instant::now(),
                    // This token is decoded on the source.
                    tokens: 1,
                    handle,
                });
                return Ok(false);
            }
        }
        let p = self.preparing.take().expect("matched above");
        let ms = p.started.elapsed().as_secs_f64() * 1e3;
        if let Ok(Ok(mut live)) = p.handle.join() {
            self.record_load(to, &live);
            self.arm_hidden_tap(to, &mut live.ctx);
            self.rungs[to] = Some(live);
            self.prepared = Some(Prepared {
                ms,
                tokens: p.tokens,
            });
        }
        Ok(true)
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

    /// Waits for a background load the policy no longer wants and drops what it loaded.
    pub(super) fn abandon_prepare(&mut self) {
        if let Some(p) = self.preparing.take() {
            drop(p.handle.join());
            crate::pressure::trim_heap();
        }
        self.prepared = None;
    }
}
