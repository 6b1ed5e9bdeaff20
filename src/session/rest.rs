//! A conversation's cache carried onto a smaller rung between two answers, through the switch:
//! a state file woken under a budget that no longer holds its rung ([`Session::wake`]), and an
//! answer that starts under a budget that no longer holds the rung the last one ended on. The
//! cache is projected as a switch projects it ([`super::switch::carry_cache`]) instead of the
//! conversation being re-read on the smaller rung; the next prompt then re-reads only its new
//! turn (and the projected positions it looks at, see `refresh_projected`).

use std::ops::Range;
use std::time::Instant;

use super::switch::{CachedState, CarryRoute, carry_cache};
use super::{Session, SessionError, Strategy, SwitchInfo, SwitchMethod, migrate};
use crate::engine::Token;
use crate::pressure::Budget;
use crate::routes;

/// A carried cache: the switch's timings, the positions left projected, and a note when the
/// destination's anchor was not used.
type Carried = (migrate::SwitchTimings, Vec<Range<usize>>, Option<String>);

impl Session {
    /// Carries a cache exported on rung `from` onto the current rung — loaded, its context
    /// empty — through the switch; nothing of `from` needs to be loaded. The timings, the
    /// positions left projected, and a note when the destination's anchor was not used.
    ///
    /// # Errors
    /// [`SessionError::Route`] when the route has no usable projector, or
    /// [`SessionError::Migration`] naming the step that failed (the current context is then
    /// cleared).
    pub(super) fn carry_onto_current(
        &mut self,
        from: usize,
        exported: migrate::Exported<'_>,
        tokens: &[Token],
        pending: Option<Token>,
    ) -> Result<Carried, SessionError> {
        let to = self.current;
        let projector = self.routes.get(from, to).map_err(SessionError::Route)?;
        let mut note = None;
        let anchor = self.anchor_for(to, &mut note);
        let kind = routes::route_kind(self.routes.binding(from), self.routes.binding(to));
        let route = CarryRoute {
            kind,
            projector: &projector,
            anchor: anchor.as_deref(),
        };
        let cache = CachedState {
            exported,
            history: tokens,
            observed: None,
            pending,
        };
        let live = self.rungs[to]
            .as_mut()
            .ok_or_else(|| SessionError::UnknownRung(to.to_string()))?;
        match carry_cache(&self.opts, &route, &cache, &mut live.ctx) {
            Ok((timings, projected)) => Ok((timings, projected, note)),
            Err(e) => {
                live.ctx.clear();
                Err(e)
            }
        }
    }

    /// Moves a session about to read a prompt down to rung `to` with its cache carried through
    /// the switch, so that the earlier turns are not re-read there: the cache exported, the
    /// source freed before the destination is mapped (the process never holds both), then
    /// carried ([`Session::carry_onto_current`]). The switch as reported (at token 0), or
    /// `None` when the cache is not carried and the caller re-reads the conversation on `to`:
    /// nothing cached, a re-prefill strategy, a route without a projector, a cache that does not
    /// start at position 0 or does not hold the history. A carry that fails once the source is
    /// gone leaves the session on `to` with nothing cached: the switch is reported as a
    /// re-read, with why.
    ///
    /// # Errors
    /// A failure to load `to` (the conversation's messages are kept; its cache is gone).
    pub(super) fn carry_down_idle(
        &mut self,
        to: usize,
        budget: &Budget,
    ) -> Result<Option<SwitchInfo>, SessionError> {
        let from = self.current;
        let carriable = !self.history.is_empty()
            && to > from
            && self.opts.strategy != Strategy::Reprefill
            && self.parked.is_none()
            && self.fill_due() == 0
            && self.rungs[from]
                .as_ref()
                .is_some_and(|s| s.ctx.seq_pos_min() <= 0 && s.ctx.n_past() == self.history.len())
            && self.routes.get(from, to).is_ok();
        if !carriable {
            return Ok(None);
        }
        let t0 = Instant::now();
        let src = self.rungs[from].take().expect("checked above");
        let from_name = src.name().to_string();
        let from_model = src.model().name().to_string();
        let blob = match src.ctx.export_state() {
            Ok(b) => b,
            Err(_) => {
                self.rungs[from] = Some(src);
                return Ok(None);
            }
        };
        let export_ms = t0.elapsed().as_secs_f64() * 1e3;
        let tokens = std::mem::take(&mut self.history);
        let pending = self.pending.take();
        let earlier = std::mem::take(&mut self.projected);
        // Freed before the destination is mapped: the budget no longer holds the source.
        self.reap(src);
        self.join_reaper();
        let t_load = Instant::now();
        self.move_idle(to)?;
        let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
        let exported = migrate::Exported {
            blob: &blob,
            n_past: tokens.len(),
            from: &from_model,
            export_ms,
        };
        let carried = self.carry_onto_current(from, exported, &tokens, pending);
        let (timings, method, note) = match carried {
            Ok((timings, projected, note)) => {
                // Positions projected on the source stay projected (projected once more).
                let n = tokens.len();
                let all: Vec<Range<usize>> = earlier.into_iter().chain(projected).collect();
                self.projected = super::native::minus(n, &super::native::minus(n, &all));
                self.history = tokens;
                self.pending = pending;
                (timings, SwitchMethod::Molt, note)
            }
            Err(e) => (
                migrate::SwitchTimings::default(),
                self.reread_method(),
                Some(format!(
                    "the cache could not be carried, the conversation is re-read: {e}"
                )),
            ),
        };
        let dst = self.rungs[to].as_ref().expect("moved to the destination");
        let model = dst.model();
        let cells = self.history.len() as u64 + 1;
        let flops_reprefill = migrate::prefill_flops(
            model.n_params(),
            model.n_layer() as u64,
            model.n_embd() as u64,
            cells,
        );
        let between = "between two answers, before the prompt is read";
        Ok(Some(SwitchInfo {
            at_token: 0,
            from: from_name,
            to: dst.name().to_string(),
            method,
            timings: migrate::SwitchTimings { load_ms, ..timings },
            flops_reprefill,
            pressure: budget.pressure,
            budget_bytes: budget.bytes,
            handoff_jsd: None,
            handoff_floor_jsd: None,
            note: Some(note.map_or_else(|| between.to_string(), |n| format!("{between}; {n}"))),
            setup: Some(dst.setup),
        }))
    }
}

/// An idle session moved back up the ladder between two answers
/// ([`Session::promote_idle`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct IdleMove {
    /// The rung it was on.
    pub from: String,
    /// The rung it is on now.
    pub to: String,
    /// Tokens of the conversation read natively on `to`.
    pub tokens: usize,
    /// Time the destination's load took (0 when it was loaded already), ms.
    pub load_ms: f64,
    /// The whole move: load and re-read, ms.
    pub ms: f64,
}

impl Session {
    /// Moves an idle session back up when its budget holds a larger rung again (never above
    /// home): the rung is loaded and the conversation's cache read natively on it, *between*
    /// answers — while the user reads the last answer and types the next message — instead of
    /// at the next answer's start, where the same move made its time to first token the load
    /// plus the whole conversation's re-read (4,092 ms for 241 tokens going back to tier0 in
    /// `chat` after `/budget off`, against 222 ms on tier2 the turn before). The cache is read
    /// natively, not projected up: the conversation is then the large rung's own, as if it had
    /// never left. The rung it leaves is retired as a switch retires it (on standby when the
    /// rules allow). `None` when nothing moves: no budget source, a budget that holds nothing
    /// larger, the home rung already, a parked session, or [`Strategy::Never`].
    ///
    /// # Errors
    /// A failure to load the destination (the session stays where it was, its cache whole) or
    /// to read the conversation on it (the session is then on the destination with nothing
    /// cached: the next answer reads the conversation from its messages; nothing is lost).
    pub fn promote_idle(&mut self) -> Result<Option<IdleMove>, SessionError> {
        if self.current == self.home
            || self.parked.is_some()
            || self.opts.strategy == Strategy::Never
        {
            return Ok(None);
        }
        let Some(b) = self.read_budget(crate::pressure::Tick::default())? else {
            return Ok(None);
        };
        self.last_budget = Some(b.bytes);
        let view = crate::sched::TenantView::new(0, crate::sched::TenantClass::Foreground)
            .with_rung(self.current)
            .with_home(self.home)
            .with_context(self.history.len() as u64, 0);
        let costs = self.rung_costs();
        let Ok(crate::sched::Decision::Promote { to }) =
            crate::sched::decide_one(&view, b.bytes, &costs, &self.opts.policy)
        else {
            return Ok(None);
        };
        let from = self.current;
        let t0 = Instant::now();
        // Standby rungs are below the current one only: a rung above is loaded or not.
        let loaded = self.rungs[to].is_some();
        self.ensure_loaded(to)?;
        let load_ms = if loaded {
            0.0
        } else {
            t0.elapsed().as_secs_f64() * 1e3
        };
        // The rung left is let go first, as the answer-start move does: the budget was asked
        // for the destination with the conversation, not for both rungs.
        self.current = to;
        if !self.opts.research.keep_source
            && let Some(old) = self.rungs[from].take()
        {
            self.retire(from, old);
        }
        self.projected.clear();
        self.drop_refill();
        self.observed = None;
        let tokens = self.history.len();
        let rung = self.ladder.rungs[to].name().to_string();
        let live = self.rungs[to]
            .as_mut()
            .ok_or_else(|| SessionError::UnknownRung(to.to_string()))?;
        live.ctx.clear();
        if let Err(source) = live.ctx.decode(&self.history) {
            live.ctx.clear();
            self.history.clear();
            self.pending = None;
            return Err(SessionError::Engine { rung, source });
        }
        self.settle_standby(Some(b.bytes));
        Ok(Some(IdleMove {
            from: self.ladder.rungs[from].name().to_string(),
            to: rung,
            tokens,
            load_ms,
            ms: t0.elapsed().as_secs_f64() * 1e3,
        }))
    }
}
