//! A switch up prepared in the background ([`SessionOptions::prepare_up`](super::SessionOptions::prepare_up)).
//!
//! A switch down answers pressure and cannot wait; a switch up answers memory coming back, and
//! nothing is lost by taking it a few tokens later. So when the policy first asks to move up
//! to a rung that is neither loaded nor on standby, the session starts loading it on a thread
//! of its own and keeps decoding on the rung it is on; the switch happens at the first token
//! after the load finished, with the destination already live, and the user's gap at the
//! switch is the transplant alone instead of the load plus the transplant.
//!
//! **Carried in the background.** The transplant itself goes on the same thread: when the
//! load starts, the source's state is exported (a few MB, one copy on the answer's path) and
//! the thread, once the destination has loaded, projects it, imports it and re-reads natively
//! what the switch would (the head, the sentences the question attends to) — or, without a
//! projector, re-reads the history natively. The answer meanwhile goes on on the source. At
//! the switch the destination only decodes the tokens the source wrote since the export, at
//! most [`CATCH_UP_STEP`] per token boundary until it is that close, then the last ones with
//! the sampled token: the user's gap at a switch up is a short batch on the destination, not
//! the projection plus the sentence recompute (3,955 ms was seen in chat under load). A carry
//! that fails leaves the destination empty and the switch is carried at the token, as before,
//! with the reason in its note. Not carried: with the seam measured, the source kept, a tail
//! re-read asked (the tail is the switch's last tokens), or top-k recompute (which needs the
//! source's boundary states at the switch).
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

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::engine::{Span, Token};
use crate::transplant::anchor::Anchor;
use crate::transplant::projector::Projector;

use super::{Event, LiveRung, PrepareInfo, PrepareState, Session, SessionError, migrate};

/// Most tokens the destination of a carried switch up re-reads between two tokens to catch up
/// with the source: each such boundary costs the answer a batch of this many tokens on the
/// destination (~0.4 s for tier0 on a 2-core AVX2 machine, whose prefill runs ~20 tok/s); the
/// switch waits until it is within [`SHADOW_STEP`].
pub const CATCH_UP_STEP: usize = 8;

/// Most tokens a shadow (a switch down prepared ahead, `super::shadow`) is let fall behind
/// the source before it re-reads them, and how close any carried destination gets before its
/// switch: the switch re-reads at most this many with the sampled token, and the user's gap is
/// that short batch.
pub const SHADOW_STEP: usize = 2;

/// The threads of the source and of a background carry decoding beside it, out of `n`: half
/// each, the carry the larger half (one each on 2 cores; both all of them on 1).
fn split_threads(n: u32) -> (u32, u32) {
    if n < 2 {
        (n.max(1), n.max(1))
    } else {
        (n / 2, n - n / 2)
    }
}

/// The threads a background carry decodes on beside the source, out of `n`.
pub(super) fn carry_threads(n: u32) -> u32 {
    split_threads(n).1
}

/// The catch-up step of a carried destination: a shadow's is shorter, as its switch cannot
/// wait.
fn step_for(down: bool) -> usize {
    if down { SHADOW_STEP } else { CATCH_UP_STEP }
}

/// The source's state and what to re-read natively, handed to the loading thread so that it
/// carries the conversation onto the destination once loaded.
struct Carry {
    blob: Vec<u8>,
    n_past: usize,
    from_model: String,
    export_ms: f64,
    /// `None`: re-read the history natively (no projector for the route, or the re-prefill
    /// strategy).
    projector: Option<Arc<Projector>>,
    /// `history[..n_past]`.
    history: Vec<Token>,
    head: usize,
    anchor: Option<Arc<Anchor>>,
    ranges: Vec<Range<usize>>,
    /// Read sparsely ([`migrate::read_sparse`]): no projection, the positions outside the
    /// head and `ranges` left out.
    sparse: bool,
}

/// A conversation carried onto a loaded destination in the background, waiting for the switch.
pub(super) struct Carried {
    /// The destination.
    pub to: usize,
    /// Positions the carried state holds (the source's, when it was exported).
    pub n_past: usize,
    /// Where the carry's time went (projection, import, re-reads), on the loading thread.
    pub timings: migrate::SwitchTimings,
    /// Whether the state was projected (else re-read natively).
    pub projected: bool,
    /// Positions the carry re-read natively besides the head (selective token recompute).
    pub ranges: Vec<Range<usize>>,
    /// The carry's own time on the thread, ms.
    pub ms: f64,
    /// Tokens re-read at earlier boundaries to catch up.
    pub caught_up: usize,
}

impl Carried {
    /// Nothing carried onto `to`: the switch re-reads the whole history there (a shadow whose
    /// carry failed after its source was freed, [`super::shadow`]).
    pub(super) fn empty(to: usize) -> Self {
        Self {
            to,
            n_past: 0,
            timings: migrate::SwitchTimings::default(),
            projected: false,
            ranges: Vec::new(),
            ms: 0.0,
            caught_up: 0,
        }
    }
}

/// What the loading thread hands back: the loaded rung, and the carry's outcome if one was
/// asked (an error leaves the rung's cache empty).
type Loaded = (LiveRung, Option<Result<Carried, String>>);

/// A rung being loaded on a thread of its own.
pub(super) struct Preparing {
    /// The rung.
    index: usize,
    /// The speed setup it is loading with.
    setup: crate::speed::RungSetup,
    /// When the load started.
    started: Instant,
    /// Whether the rung came off standby (not loaded from its file).
    from_standby: bool,
    /// Tokens decoded on the source since.
    tokens: usize,
    /// Set when the load is no longer wanted: the thread skips the carry.
    cancel: Arc<AtomicBool>,
    handle: JoinHandle<Result<Loaded, SessionError>>,
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
    /// module docs, reporting into `sink`. A switch down (`to` below the current rung) is
    /// prepared the same way as a shadow ([`super::shadow`]), its destination taken off
    /// standby, and is ready once caught up within [`SHADOW_STEP`].
    ///
    /// # Errors
    /// A thread that cannot be spawned.
    pub(super) fn prepare_ready(
        &mut self,
        to: usize,
        at_token: usize,
        budget: Option<u64>,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Readiness, SessionError> {
        let carried_here = self.carried.as_ref().is_some_and(|c| c.to == to);
        // A switch down is prepared as a shadow (see `super::shadow`): its destination comes
        // off standby rather than being ready on it.
        let down = to > self.current;
        let on = if down {
            self.opts.prepare_down
        } else {
            self.opts.prepare_up
        };
        if !on
            || (self.rungs[to].is_some() && !carried_here)
            || (!down && self.standby[to].is_some())
        {
            self.abandon_prepare(at_token, "the destination is ready without it", sink);
            return Ok(Readiness::Now);
        }
        if self.prepare_failed == Some(to) {
            return Ok(Readiness::Wait);
        }
        let tokens = self.history.len() as u64 + 1;
        // A carried destination is loaded: it is in the footprint already.
        let both = if carried_here {
            self.modelled_now(tokens)
        } else {
            self.modelled_footprint(self.current, tokens) + self.modelled_footprint(to, tokens)
        };
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
        if carried_here {
            return Ok(self.catch_up(step_for(down)));
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
        self.install_prepared(at_token, budget, sink)
    }

    /// Joins the finished background load of `self.preparing` and installs what it loaded
    /// (and carried); then one boundary of catching up. A failed load is reported into
    /// `sink` and leaves the answer where it is ([`Readiness::Wait`]).
    pub(super) fn install_prepared(
        &mut self,
        at_token: usize,
        budget: Option<u64>,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Readiness, SessionError> {
        let Some(p) = self.preparing.take() else {
            return Ok(Readiness::Now);
        };
        self.source_gets_every_core();
        let to = p.index;
        let down = to > self.current;
        let tokens = self.history.len() as u64 + 1;
        let ms = p.started.elapsed().as_secs_f64() * 1e3;
        let loaded = p.handle.join().unwrap_or_else(|_| {
            Err(SessionError::Prepare(
                "the background load's thread panicked".into(),
            ))
        });
        match loaded {
            Ok((mut live, carry)) => {
                self.record_load(to, &live);
                self.arm_hidden_tap(to, &mut live.ctx);
                self.rungs[to] = Some(live);
                self.prepared = Some(Prepared {
                    ms,
                    tokens: p.tokens,
                });
                match carry {
                    Some(Ok(c)) => {
                        let load_ms = (!p.from_standby).then_some(ms - c.ms);
                        let threads = carry_threads(self.config.n_threads);
                        self.record_carry(to, c.n_past, c.ms, threads, load_ms);
                        self.carried = Some(c);
                        Ok(self.catch_up(step_for(down)))
                    }
                    Some(Err(why)) => {
                        self.carry_note = Some(format!("not carried in the background: {why}"));
                        Ok(Readiness::Now)
                    }
                    None => Ok(Readiness::Now),
                }
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
                    down: to > self.current,
                }));
                Ok(Readiness::Wait)
            }
        }
    }

    /// One boundary of a carried destination catching up with the source: while it is more
    /// than `step` tokens behind, re-read that many (the answer stays on the source for this
    /// token), then re-read to within [`SHADOW_STEP`]; then the switch can be taken, and
    /// re-reads the rest with the sampled token. A failed re-read drops the carried state (the
    /// switch then carries at the token).
    pub(super) fn catch_up(&mut self, step: usize) -> Readiness {
        let Some(c) = self.carried.as_mut() else {
            return Readiness::Now;
        };
        let Some(dst) = self.rungs[c.to].as_mut() else {
            self.carried = None;
            return Readiness::Now;
        };
        let done = dst.ctx.n_past();
        let lag = self.history.len().saturating_sub(done);
        // `step` at a time while far behind, then what it takes to be within SHADOW_STEP: the
        // switch's own batch stays short (a switch up's last batch of up to 9 tokens on a 1.5B
        // rung was ~1 s of the gap on 2 cores); at most SHADOW_STEP + 1 tokens with the
        // sampled one.
        if lag <= SHADOW_STEP {
            return Readiness::Now;
        }
        // To one token short of SHADOW_STEP at most: the source writes one more before the
        // next boundary, where the switch can then be taken.
        let n = step.min(lag + 1 - SHADOW_STEP);
        let end = done + n;
        match dst.ctx.decode(&self.history[done..end]) {
            Ok(()) => {
                c.caught_up += n;
                if let Some(p) = self.prepared.as_mut() {
                    p.tokens += 1;
                }
                Readiness::Wait
            }
            Err(e) => {
                let why = format!("catching up failed: {e}");
                self.drop_carried();
                self.carry_note = Some(format!("not carried in the background: {why}"));
                Readiness::Now
            }
        }
    }

    /// Forgets a carried state, leaving its destination loaded with an empty cache.
    pub(super) fn drop_carried(&mut self) {
        if let Some(c) = self.carried.take()
            && let Some(dst) = self.rungs[c.to].as_mut()
        {
            dst.ctx.clear();
        }
    }

    /// What to hand the loading thread so that it carries the conversation onto rung `to`, or
    /// `None` when the switch must be carried at the token (see the module docs).
    fn carry_for(&mut self, to: usize) -> Option<Carry> {
        if self.opts.research.keep_source
            || self.opts.research.measure_seam
            || self.opts.research.topk_recompute.is_some()
            || self.opts.research.tail_recompute > 0
            || self.opts.strategy == super::Strategy::Never
        {
            return None;
        }
        let from = self.current;
        let (projector, _) = self.resolve_route(from, to);
        let src = self.rungs[from].as_ref()?;
        let n_past = src.ctx.n_past().min(self.history.len());
        if n_past == 0 {
            return None;
        }
        let from_model = src.model().name().to_string();
        let t0 = Instant::now();
        let blob = src.ctx.export_state().ok()?;
        let export_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (head, ranges, anchor) = if projector.is_some() {
            let mut note = None;
            let anchor = self.anchor_for(to, &mut note);
            let ranges = self.recompute_ranges(from, to, n_past);
            (self.opts.head_reread.min(n_past), ranges, anchor)
        } else {
            (0, Vec::new(), None)
        };
        let sparse = projector.is_some() && self.reads_sparse(from, to, &ranges, n_past);
        Some(Carry {
            blob,
            n_past,
            from_model,
            export_ms,
            projector,
            history: self.history[..n_past].to_vec(),
            head,
            anchor,
            ranges,
            sparse,
        })
    }

    /// Starts loading rung `to` on a thread of its own, counts it in the footprint, gives up
    /// the standby rungs it needs room from, and says so in `sink`.
    pub(super) fn start_prepare(
        &mut self,
        to: usize,
        at_token: usize,
        budget: Option<u64>,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<(), SessionError> {
        let info = self.ladder.rungs[to].clone();
        let config = self.config;
        // A shadow's destination is taken off standby when it waits there: the thread maps its
        // pages back instead of loading it.
        let standby = if to > self.current {
            self.standby[to].take()
        } else {
            None
        };
        let from_standby = standby.is_some() || self.rungs[to].is_some();
        // The source stays while the destination loads: the setup is chosen within what the
        // budget leaves beside it (chosen as if it took the source's place, a faster setup's
        // extra memory pushed the pair over the budget it was started under, and the load was
        // dropped at the next token: seen on the real ladder, 2,451 MiB against 2,400).
        let tokens = self.history.len() as u64 + 1;
        let setup = standby.as_ref().map_or_else(
            || self.speed_setup(to, self.modelled_footprint(self.current, tokens)),
            super::StandbyRung::setup,
        );
        let known = self.known_context_bytes(to, setup);
        let carry = self.carry_for(to);
        // While the thread decodes, the source and it split the cores: two contexts each
        // decoding on every core preempt each other's threads at every barrier (the source's
        // gap between two tokens reached 1.4-3.1 s on 2 cores, against ~0.1-0.2 s alone).
        let (source_threads, carry_threads) = split_threads(config.n_threads);
        if carry.is_some()
            && let Some(src) = self.rungs[self.current].as_mut()
        {
            src.ctx.set_threads(source_threads);
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let stop = cancel.clone();
        let handle = std::thread::Builder::new()
            .name(format!("molt-prepare-{}", info.name()))
            .spawn(move || {
                let mut live = match standby {
                    Some(s) => s.activate().0,
                    None => LiveRung::load_known(&info, config, setup, known)?,
                };
                let carried = match carry {
                    Some(c) if !stop.load(Ordering::SeqCst) => {
                        // The carry decodes beside the source: on its share of the cores.
                        live.ctx.set_threads(carry_threads);
                        let r = carry_onto(&mut live, c, to);
                        live.ctx.set_threads(config.n_threads);
                        if r.is_err() {
                            live.ctx.clear();
                        }
                        Some(r)
                    }
                    _ => None,
                };
                Ok((live, carried))
            })
            .map_err(|e| SessionError::Prepare(e.to_string()))?;
        self.preparing = Some(Preparing {
            index: to,
            setup,
            started: Instant::now(),
            from_standby,
            // This token is decoded on the source.
            tokens: 1,
            cancel,
            handle,
        });
        // Standby rungs are the first thing given up: the rung loading takes their room.
        self.settle_standby(budget);
        sink(&self.prepare_news(
            PrepareState::Started,
            to,
            at_token,
            budget.unwrap_or(0),
            None,
        ));
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

    /// Whether a rung is being loaded in the background, or holds a conversation carried there
    /// waiting for the switch (either way a rung besides the current one is in memory).
    pub(super) fn is_preparing(&self) -> bool {
        self.preparing.is_some() || self.carried.is_some()
    }

    /// What the rung loading in the background (or holding a carried conversation) counts in
    /// the modelled footprint at `tokens` of context: its whole footprint, as it will hold
    /// once the switch is taken.
    pub(super) fn preparing_bytes(&self, tokens: u64) -> u64 {
        self.preparing
            .as_ref()
            .map(|p| p.index)
            .or(self.carried.as_ref().map(|c| c.to))
            .map_or(0, |i| self.modelled_footprint(i, tokens))
    }

    /// Says in `sink` that a shadow onto `to` is not started, and why.
    pub(super) fn skip_prepare(
        &self,
        to: usize,
        at_token: usize,
        budget: u64,
        reason: &str,
        sink: &mut dyn FnMut(&Event),
    ) {
        sink(&self.prepare_news(PrepareState::Skipped, to, at_token, budget, Some(reason)));
    }

    /// The event of a preparation onto `to` as it starts (or is not started): nothing
    /// elapsed, the footprint as the session now counts it.
    fn prepare_news(
        &self,
        state: PrepareState,
        to: usize,
        at_token: usize,
        budget_bytes: u64,
        reason: Option<&str>,
    ) -> Event {
        let tokens = self.history.len() as u64 + 1;
        Event::Prepare(PrepareInfo {
            at_token,
            state,
            from: self.current_rung().to_string(),
            to: self.ladder.rungs[to].name().to_string(),
            elapsed_ms: 0.0,
            tokens: 0,
            modelled_bytes: self.modelled_now(tokens),
            budget_bytes,
            reason: reason.map(str::to_string),
            down: to > self.current,
        })
    }

    /// Waits for a background load that is no longer wanted and frees what it loaded; says
    /// so in `sink` (with `reason`) if one was running.
    pub(super) fn abandon_prepare(
        &mut self,
        at_token: usize,
        reason: &str,
        sink: &mut dyn FnMut(&Event),
    ) {
        if let Some(c) = &self.carried {
            let to = c.to;
            let tokens = self.history.len() as u64 + 1;
            let modelled_bytes = self.modelled_now(tokens);
            let elapsed_ms = self.prepared.map_or(0.0, |p| p.ms);
            let waited = self.prepared.map_or(0, |p| p.tokens);
            self.drop_carried();
            self.shelve_uncarried(to);
            sink(&Event::Prepare(PrepareInfo {
                at_token,
                state: PrepareState::Dropped,
                from: self.current_rung().to_string(),
                to: self.ladder.rungs[to].name().to_string(),
                elapsed_ms,
                tokens: waited,
                modelled_bytes,
                budget_bytes: self.last_budget.unwrap_or(0),
                reason: Some(format!("{reason}; the carried state is dropped")),
                down: to > self.current,
            }));
        }
        self.carry_note = None;
        let Some(p) = self.preparing.take() else {
            self.prepared = None;
            return;
        };
        p.cancel.store(true, Ordering::SeqCst);
        self.source_gets_every_core();
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
            down: p.index > self.current,
        }));
    }
}

/// The loading thread's carry: the exported state projected onto `live` with its native
/// re-reads, or the history re-read natively when there is no projector.
fn carry_onto(live: &mut LiveRung, c: Carry, to: usize) -> Result<Carried, String> {
    let t0 = Instant::now();
    let (timings, projected, ranges) = match &c.projector {
        Some(p) => {
            let spans = Span::of(&c.history, &c.ranges);
            let reread = migrate::Reread {
                head: &c.history[..c.head],
                tail: &[],
                anchor: c.anchor.as_deref(),
                spans: &spans,
            };
            let t = if c.sparse {
                migrate::read_sparse(&mut live.ctx, reread, c.n_past, &[], &c.from_model)
            } else {
                migrate::carry_exported(
                    &migrate::Exported {
                        blob: &c.blob,
                        n_past: c.n_past,
                        from: &c.from_model,
                        export_ms: c.export_ms,
                    },
                    &mut live.ctx,
                    p,
                    None,
                    reread,
                )
            }
            .map_err(|e| e.to_string())?;
            (t, true, c.ranges)
        }
        None => {
            live.ctx.clear();
            live.ctx
                .decode(&c.history)
                .map_err(|e| format!("re-reading the history: {e}"))?;
            let t = migrate::SwitchTimings {
                export_ms: c.export_ms,
                first_decode_ms: t0.elapsed().as_secs_f64() * 1e3,
                cells: c.n_past,
                ..migrate::SwitchTimings::default()
            };
            (t, false, Vec::new())
        }
    };
    Ok(Carried {
        to,
        n_past: c.n_past,
        timings,
        projected,
        ranges,
        ms: t0.elapsed().as_secs_f64() * 1e3,
        caught_up: 0,
    })
}

impl Session {
    /// The rung being prepared in the background: loading, or carried and catching up.
    pub(super) fn prepare_target(&self) -> Option<usize> {
        self.preparing
            .as_ref()
            .map(|p| p.index)
            .or(self.carried.as_ref().map(|c| c.to))
    }

    /// Whether the background thread of `self.preparing` is done (true when none runs).
    pub(super) fn prepare_finished(&self) -> bool {
        self.preparing
            .as_ref()
            .is_none_or(|p| p.handle.is_finished())
    }

    /// The current rung decodes on every core again (a background carry ended).
    fn source_gets_every_core(&mut self) {
        let n = self.config.n_threads;
        if let Some(src) = self.rungs[self.current].as_mut() {
            src.ctx.set_threads(n);
        }
    }

    /// Counts a token decoded on the source while the background load runs.
    pub(super) fn prepare_tick(&mut self) {
        if let Some(p) = self.preparing.as_mut() {
            p.tokens += 1;
        }
    }
}
