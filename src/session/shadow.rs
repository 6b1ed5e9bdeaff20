//! A switch down prepared ahead: the shadow ([`SessionOptions::prepare_down`]).
//!
//! A switch down answers pressure and cannot wait; what it can do is start before the pressure
//! arrives. Memory rarely goes in one reading: an application launching maps its pages over a
//! second or more, and the budget slides. The session keeps the budget readings of the last
//! [`TREND_WINDOW`]; while the budget slides (two drops or more, each within [`FALL_STALE`] of
//! the next and of the last reading: a single step has happened already and is the policy's to
//! answer), and, at the least-squares slope of the readings since the slide began, the budget
//! would fall below the current rung's footprint within [`SessionOptions::shadow_horizon`], it prepares the switch down ahead: the
//! destination (taken off standby, or loaded) gets the conversation carried onto it on a thread
//! of its own — projected, its head and sentences re-read natively, what the switch would do —
//! while the answer goes on on the source ([`super::prepare`]); then it follows the source,
//! re-reading what the source wrote whenever it is more than [`SHADOW_STEP`] tokens behind.
//! When the switch down comes, the destination re-reads those few tokens with the sampled one
//! and the source is let go: the user's gap is one short batch instead of the projection and
//! the sentence re-reads (5.8-6.9 s on the size routes of the real ladder, measured quiet on a
//! 2-core machine).
//!
//! The rules, at every token boundary the policy stays at:
//! - **Started** when the predicted budget is below the current rung's modelled footprint, the
//!   budget now holds the current rung and the destination side by side (standby rungs are
//!   given up first), and the fall is fast enough for the shadow to be taken when they no
//!   longer fit (see *taken early*). The destination is where the policy would go when the
//!   current rung stops fitting, with a second on it at the fall's pace: the largest rung
//!   below that fits the budget then, beside the current one now, and would be taken early —
//!   a precision rung before the size route — else the smallest rung if it fits beside and
//!   would be taken early ([`Fall::destination`]).
//! - **Not started when it could not finish**: a carry onto a rung runs at the pace measured on
//!   the last carry onto it in this process (in the background, or at a switch scaled to the
//!   background's share of the cores), plus the rung's load unless it is live or on standby.
//!   A rung whose carry would outlast the time the falling budget holds it beside the current
//!   rung is passed over for the next qualifying rung; when none would finish, no shadow
//!   starts ([`PrepareState::Skipped`](super::PrepareState::Skipped), said once per answer):
//!   such a shadow would only halve the answer's speed until dropped (seen on the real ladder
//!   at ~1,400 tokens: tier1 → tier2 dropped after 3.0 s and 21 tokens, then carried at its
//!   token anyway). Before any carry onto a rung is measured, its shadow is tried.
//! - **Counted** at the destination's full footprint from the start, as a switch up prepared is.
//! - **Taken early**: once the budget no longer holds both and the shadow is carried, the switch
//!   down is taken then — before the policy would — if the trend says the current rung stops
//!   fitting within [`SessionOptions::shadow_early`]: a few seconds on the smaller rung instead
//!   of a stall of seconds at the switch. When the current rung would still fit for longer,
//!   the shadow is dropped instead (a slow fall would otherwise move the answer to a worse rung
//!   long before it must), and the switch, when it comes, is carried at its token.
//! - **Dropped** when the trend stops predicting the fall within twice the horizon, when the
//!   budget no longer holds both before the carry finished (or too long before the current
//!   rung stops fitting), when the policy moves elsewhere, or
//!   at the answer's end; the destination goes back to standby when the rules allow it.
//! - **Landed**: a switch down the policy takes to the shadow's destination while its carry
//!   still runs frees the source first (its state went to the thread at the start), then waits
//!   for the carry: the gap is what was left of it, and the budget is kept.
//! - **No move up into a falling budget**: while the trend predicts the budget falls below a
//!   rung's footprint within the horizon, the policy's move up to it waits.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::prepare::{Carried, SHADOW_STEP};
use super::{Event, Session, SessionError};

/// How far back the budget readings that give the trend reach.
pub const TREND_WINDOW: Duration = Duration::from_secs(3);

/// How recent the last drop of the budget must be for the fall to be going on: a budget that
/// has held since is not falling, whatever the slope of the window says.
pub const FALL_STALE: Duration = Duration::from_secs(1);

/// The budget readings of the last [`TREND_WINDOW`].
#[derive(Debug, Default)]
pub(super) struct Trend {
    readings: VecDeque<(Instant, u64)>,
}

impl Trend {
    /// Records a reading taken at `at`.
    pub(super) fn push(&mut self, at: Instant, bytes: u64) {
        self.readings.push_back((at, bytes));
        while self.readings.len() > 2
            && self
                .readings
                .front()
                .is_some_and(|&(t, _)| at.duration_since(t) > TREND_WINDOW)
        {
            self.readings.pop_front();
        }
    }

    /// The budget `horizon` after the last reading at the least-squares slope of the window,
    /// while the budget falls ([`Trend::fall_start`]); `None` when it does not, or the window
    /// holds fewer than two readings apart in time.
    pub(super) fn falls_to(&self, horizon: Duration) -> Option<u64> {
        let (slope, last) = self.slope()?;
        let at = last as f64 + slope * horizon.as_secs_f64();
        // Truncation to whole bytes; a fall past zero is zero.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(at.max(0.0) as u64)
    }

    /// Seconds until the budget, falling at the fall's slope, is below `level`; `None` when
    /// it does not fall.
    pub(super) fn seconds_to(&self, level: u64) -> Option<f64> {
        let (slope, last) = self.slope()?;
        Some(((last as f64 - level as f64) / -slope).max(0.0))
    }

    /// How fast the budget falls, bytes per second; `None` when it does not fall.
    pub(super) fn fall_rate(&self) -> Option<f64> {
        self.slope().map(|(slope, _)| -slope)
    }

    /// Where the fall going on began: the index of the reading before its first drop. A fall
    /// is two drops or more, each within [`FALL_STALE`] of the next and the last within it of
    /// the last reading; `None` when the budget is not falling so. A single step (one
    /// application's memory taken at once) has already happened: the policy answers it at the
    /// next boundary, and the slope of a window that holds it predicts a fall that will not
    /// come. Readings from before the fall would flatten its slope and delay the warning.
    fn fall_start(&self) -> Option<usize> {
        let &(now, _) = self.readings.back()?;
        let mut drops = 0;
        let mut start = None;
        let mut next = now;
        for i in (1..self.readings.len()).rev() {
            let (a, b) = (self.readings[i - 1], self.readings[i]);
            if b.1 >= a.1 {
                continue;
            }
            if next.duration_since(b.0) > FALL_STALE {
                break;
            }
            drops += 1;
            start = Some(i - 1);
            next = b.0;
        }
        start.filter(|_| drops >= 2)
    }

    /// The least-squares slope of the fall going on ([`Trend::fall_start`]), bytes per second,
    /// with the last reading.
    fn slope(&self) -> Option<(f64, u64)> {
        let start = self.fall_start()?;
        let (&(t0, _), &(_, last)) = (self.readings.get(start)?, self.readings.back()?);
        let pts: Vec<(f64, f64)> = self
            .readings
            .iter()
            .skip(start)
            .map(|&(t, b)| (t.duration_since(t0).as_secs_f64(), b as f64))
            .collect();
        let n = pts.len() as f64;
        let mt = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let mb = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let var = pts.iter().map(|p| (p.0 - mt).powi(2)).sum::<f64>();
        if var <= 1e-12 {
            return None;
        }
        let slope = pts.iter().map(|p| (p.0 - mt) * (p.1 - mb)).sum::<f64>() / var;
        (slope < 0.0).then_some((slope, last))
    }

    /// Forgets every reading (a new budget source).
    pub(super) fn clear(&mut self) {
        self.readings.clear();
    }
}

/// What carrying a conversation onto one rung has cost in this process: how long a shadow
/// onto it would take, so that one that could not finish before the budget stops holding it
/// beside the current rung is not started ([`Start::TooSlow`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct CarryPace {
    /// The carry's time per carried cell, ms, on a background carry's share of the cores
    /// (the last carry measured: one in the background as it was, one at a switch scaled
    /// from every core to that share).
    pub ms_per_cell: Option<f64>,
    /// The rung's last load from its file, ms.
    pub load_ms: Option<f64>,
}

/// The budget falling, as the shadow's start reads it: the rung the answer is on, the budget
/// now, and how fast it falls.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fall {
    /// The rung the answer is on.
    pub current: usize,
    /// The budget now, bytes.
    pub budget: u64,
    /// How fast it falls, bytes per second.
    pub rate: f64,
    /// [`SessionOptions::shadow_early`](super::SessionOptions::shadow_early), seconds.
    pub early_s: f64,
}

/// Where the shadow's start goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Start {
    /// Carry the conversation down to this rung.
    To(usize),
    /// No rung below qualifies: nothing to start.
    Nowhere,
    /// The rung the rules choose would not be carried before the budget stops holding it
    /// beside the current rung (`carry_s` against `holds_s`), and no other qualifying rung
    /// would be: starting it would only slow the answer down (the source and the carry split
    /// the cores) until it is dropped.
    TooSlow {
        to: usize,
        carry_s: f64,
        holds_s: f64,
    },
}

impl Fall {
    /// Seconds the budget, falling at the fall's rate, still holds `bytes`.
    fn holds_s(&self, bytes: u64) -> f64 {
        (self.budget as f64 - bytes as f64).max(0.0) / self.rate
    }

    /// The shadow's destination given the rungs' modelled footprints `fps` (the current
    /// rung's included) and `carry_s`, the seconds a carry onto a rung is expected to take
    /// (`None`: nothing measured yet, so it is tried). A rung qualifies when it fits beside the
    /// current rung now and its shadow would be taken early: from holding both to holding the
    /// current rung alone the budget falls by the rung's footprint, which must take no longer
    /// than `early_s` (else the shadow would be dropped then, having only slowed the answer).
    /// The destination is where the policy would go when the current rung stops fitting, with
    /// a second on it at the fall's pace ([`FALL_STALE`]): the largest qualifying rung that
    /// fits the budget then (a precision rung before the size route: it carries in a second or
    /// two and keeps the facts), else the smallest rung if it qualifies. A rung whose carry
    /// would not end while the budget still holds both is passed over for the next that
    /// would; when none would, [`Start::TooSlow`] names the one the rules chose.
    pub(super) fn destination(&self, fps: &[u64], carry_s: impl Fn(usize) -> Option<f64>) -> Start {
        let n = fps.len();
        let Some(&here) = fps.get(self.current) else {
            return Start::Nowhere;
        };
        let beside = |i: usize| here + fps[i] <= self.budget;
        let taken_early = |i: usize| fps[i] as f64 <= self.rate * self.early_s;
        let qualifies = |i: usize| beside(i) && taken_early(i);
        let landing = here as f64 - self.rate * FALL_STALE.as_secs_f64();
        let mut ranked: Vec<usize> = (self.current + 1..n)
            .filter(|&i| fps[i] as f64 <= landing && qualifies(i))
            .collect();
        if n > self.current + 1 && qualifies(n - 1) && !ranked.contains(&(n - 1)) {
            ranked.push(n - 1);
        }
        let in_time = |i: usize| carry_s(i).is_none_or(|c| c <= self.holds_s(here + fps[i]));
        match (ranked.iter().copied().find(|&i| in_time(i)), ranked.first()) {
            (Some(to), _) => Start::To(to),
            (None, Some(&to)) => Start::TooSlow {
                to,
                carry_s: carry_s(to).unwrap_or(0.0),
                holds_s: self.holds_s(here + fps[to]),
            },
            (None, None) => Start::Nowhere,
        }
    }
}

impl Session {
    /// Seconds a shadow onto rung `to` is expected to take with the conversation as it is
    /// now: its load from the file (unless it is live or on standby) and the carry of every
    /// cell at the pace measured last; `None` before any carry onto it was measured.
    pub(super) fn carry_estimate_s(&self, to: usize) -> Option<f64> {
        let pace = self.carry_pace.get(to)?;
        let cells = self.history.len() as f64;
        let load = if self.rungs[to].is_some() || self.standby[to].is_some() {
            0.0
        } else {
            pace.load_ms.unwrap_or(0.0)
        };
        pace.ms_per_cell.map(|ms| (ms * cells + load) / 1e3)
    }

    /// Records what a carry of `cells` cells onto `to` took, `ms` on `threads` threads (the
    /// pace is kept on a background carry's share of the cores), and the load before it,
    /// `load_ms` (`None`: not loaded from the file).
    pub(super) fn record_carry(
        &mut self,
        to: usize,
        cells: usize,
        ms: f64,
        threads: u32,
        load_ms: Option<f64>,
    ) {
        let Some(pace) = self.carry_pace.get_mut(to) else {
            return;
        };
        if cells > 0 && ms > 0.0 {
            let share = super::prepare::carry_threads(self.config.n_threads);
            pace.ms_per_cell =
                Some(ms / cells as f64 * f64::from(threads) / f64::from(share.max(1)));
            self.pace_dirty = true;
        }
        if let Some(l) = load_ms.filter(|&l| l > 0.0) {
            pace.load_ms = Some(l);
            self.pace_dirty = true;
        }
    }

    /// Takes the paces the pace file keeps for this ladder's rung files at this session's
    /// thread count ([`super::SessionOptions::pace_file`]); a file that cannot be used is
    /// said ([`Session::pace_note`]) and replaced by the next measurement.
    pub(super) fn load_pace(&mut self) {
        let Some(path) = self.opts.pace_file.clone() else {
            return;
        };
        match super::pace::PaceFile::load(&path) {
            Ok(Some(f)) => {
                let threads = self.config.n_threads;
                for (i, r) in self.ladder.rungs.iter().enumerate() {
                    if let Some(e) = f.rungs.get(&super::pace::key(&r.sha256, threads)) {
                        self.carry_pace[i] = e.pace();
                    }
                }
            }
            Ok(None) => {}
            Err(why) => self.pace_note = Some(why),
        }
    }

    /// Writes the paces measured since the last write to the pace file, keeping its entries
    /// for other files and thread counts; a write that fails is said ([`Session::pace_note`]).
    pub(super) fn save_pace(&mut self) {
        let Some(path) = self.opts.pace_file.clone().filter(|_| self.pace_dirty) else {
            return;
        };
        self.pace_dirty = false;
        let mut f = super::pace::PaceFile::load(&path)
            .ok()
            .flatten()
            .unwrap_or_default();
        let threads = self.config.n_threads;
        for (r, pace) in self.ladder.rungs.iter().zip(&self.carry_pace) {
            if *pace != CarryPace::default() {
                f.rungs.insert(
                    super::pace::key(&r.sha256, threads),
                    super::pace::PaceEntry::of(*pace),
                );
            }
        }
        if let Err(e) = f.save(&path) {
            self.pace_note = Some(format!(
                "carry pace file {}: not written: {e}",
                path.display()
            ));
        }
    }

    /// Why the pace file ([`super::SessionOptions::pace_file`]) was not read or not written,
    /// if it was not: a file of another processor or format, one that does not parse, or a
    /// directory that cannot be written.
    pub fn pace_note(&self) -> Option<&str> {
        self.pace_note.as_deref()
    }

    /// Whether the trend predicts the budget falls below rung `index`'s footprint within the
    /// horizon (with shadows on): the policy's move up to it then waits.
    pub(super) fn falling_below(&self, index: usize) -> bool {
        let tokens = self.history.len() as u64 + 1;
        self.opts.prepare_down
            && self
                .trend
                .falls_to(self.opts.shadow_horizon)
                .is_some_and(|p| p < self.modelled_footprint(index, tokens))
    }

    /// The shadow's part of a boundary the policy stays at, under `budget`: start it, follow
    /// the source, take the switch early, or drop it (the module docs). Returns the rung to
    /// switch down to now when the switch is taken early.
    ///
    /// # Errors
    /// A thread that cannot be spawned.
    pub(super) fn tend_shadow(
        &mut self,
        at_token: usize,
        budget: u64,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Option<usize>, SessionError> {
        if !self.opts.prepare_down || self.is_parked() {
            return Ok(None);
        }
        let tokens = self.history.len() as u64 + 1;
        let here = self.modelled_footprint(self.current, tokens);
        let horizon = self.opts.shadow_horizon;
        match self.prepare_target() {
            Some(to) if to > self.current => {
                if self.preparing.is_some() && self.prepare_finished() {
                    self.install_prepared(at_token, Some(budget), sink)?;
                    self.shelve_uncarried(to);
                    if self.prepare_target().is_none() {
                        return Ok(None);
                    }
                }
                // Standby rungs are given up before the shadow is.
                self.settle_standby(Some(budget));
                let both = self.modelled_now(tokens);
                if both > budget {
                    let soon = self
                        .trend
                        .seconds_to(here)
                        .is_some_and(|t| t <= self.opts.shadow_early.as_secs_f64());
                    if self.carried.is_some() && soon {
                        self.carry_note = Some(format!(
                            "taken early: the budget {} MiB, falling, no longer holds {} and {} side by side ({} MiB)",
                            budget >> 20,
                            self.current_rung(),
                            self.ladder.rungs[to].name(),
                            both >> 20
                        ));
                        return Ok(Some(to));
                    }
                    let why = format!(
                        "the budget {} MiB no longer holds {} and {} side by side ({} MiB) {}",
                        budget >> 20,
                        self.current_rung(),
                        self.ladder.rungs[to].name(),
                        both >> 20,
                        if self.carried.is_some() {
                            "while the current rung still fits for longer than it is worth moving early"
                        } else {
                            "before the carry finished"
                        }
                    );
                    self.abandon_prepare(at_token, &why, sink);
                    self.shelve_uncarried(to);
                    return Ok(None);
                }
                let falling = self.trend.falls_to(horizon * 2).is_some_and(|p| p < here);
                if !falling {
                    let why = format!(
                        "the budget {} MiB no longer falls toward {}'s footprint ({} MiB)",
                        budget >> 20,
                        self.current_rung(),
                        here >> 20
                    );
                    self.abandon_prepare(at_token, &why, sink);
                    self.shelve_uncarried(to);
                    return Ok(None);
                }
                if self.preparing.is_some() {
                    self.prepare_tick();
                } else {
                    self.catch_up(SHADOW_STEP);
                }
                Ok(None)
            }
            Some(_) => Ok(None),
            None => {
                let n = self.ladder.rungs.len();
                if self.current + 1 >= n {
                    return Ok(None);
                }
                let Some(predicted) = self.trend.falls_to(horizon) else {
                    return Ok(None);
                };
                if predicted >= here {
                    return Ok(None);
                }
                let Some(rate) = self.trend.fall_rate() else {
                    return Ok(None);
                };
                let fps: Vec<u64> = (0..n).map(|i| self.modelled_footprint(i, tokens)).collect();
                let fall = Fall {
                    current: self.current,
                    budget,
                    rate,
                    early_s: self.opts.shadow_early.as_secs_f64(),
                };
                let carry_s = |i: usize| self.carry_estimate_s(i);
                let to = match fall.destination(&fps, carry_s) {
                    Start::To(to) => to,
                    Start::Nowhere => return Ok(None),
                    Start::TooSlow {
                        to,
                        carry_s,
                        holds_s,
                    } => {
                        if self.shadow_skipped != Some(to) {
                            self.shadow_skipped = Some(to);
                            let why = format!(
                                "carrying it would take ~{carry_s:.1} s (measured on earlier carries on this machine) and the budget {} MiB, falling at {:.0} MiB/s, holds {} and {} side by side for ~{holds_s:.1} s; the switch, when it comes, is carried at its token",
                                budget >> 20,
                                rate / f64::from(1u32 << 20),
                                self.current_rung(),
                                self.ladder.rungs[to].name(),
                            );
                            self.skip_prepare(to, at_token, budget, &why, sink);
                        }
                        return Ok(None);
                    }
                };
                if self.prepare_failed == Some(to) || self.rungs[to].is_some() {
                    return Ok(None);
                }
                self.start_prepare(to, at_token, Some(budget), sink)?;
                Ok(None)
            }
        }
    }

    /// Before the switch down the policy takes to `to`: a shadow of `to` whose carry still runs
    /// is waited for with the source freed first; a finished one is installed (the module
    /// docs). If its carry failed with the source gone, the destination re-reads the whole
    /// history at the switch.
    ///
    /// # Errors
    /// The destination failing to load at all, with the source already freed.
    pub(super) fn land_shadow(
        &mut self,
        to: usize,
        at_token: usize,
        budget: Option<u64>,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<(), SessionError> {
        if self.preparing.is_none() || self.prepare_target() != Some(to) {
            return Ok(());
        }
        let from = self.current;
        let freed = if self.prepare_finished() {
            false
        } else if let Some(src) = self.rungs[from].take() {
            drop(src);
            crate::pressure::trim_heap();
            true
        } else {
            false
        };
        self.install_prepared(at_token, budget, sink)?;
        if !freed || self.carried.is_some() {
            return Ok(());
        }
        // The carry (or the load) failed and the source is gone: the history is re-read on the
        // destination at the switch.
        self.ensure_loaded(to)?.ctx.clear();
        self.carried = Some(Carried::empty(to));
        Ok(())
    }

    /// A shadow's destination left loaded without a carried state (its carry failed, or it
    /// was dropped) goes back to standby when the rules allow it, else is freed: nothing but
    /// the current rung is live outside a preparation.
    pub(super) fn shelve_uncarried(&mut self, to: usize) {
        if to != self.current
            && self.carried.is_none()
            && self.preparing.is_none()
            && let Some(live) = self.rungs[to].take()
        {
            self.retire(to, live);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A trend fed `(ms, MiB)` readings.
    fn trend(readings: &[(u64, u64)]) -> Trend {
        let t0 = Instant::now();
        let mut t = Trend::default();
        for &(ms, mib) in readings {
            t.push(t0 + Duration::from_millis(ms), mib * MIB);
        }
        t
    }

    #[test]
    fn a_sliding_budget_falls_at_its_slope() {
        // 20 MiB every 100 ms: 200 MiB/s.
        let t = trend(
            &(0..10)
                .map(|k| (k * 100, 2400 - k * 20))
                .collect::<Vec<_>>(),
        );
        let at = t.falls_to(Duration::from_secs(1)).unwrap();
        assert!((at / MIB).abs_diff(2220 - 200) <= 1, "{}", at / MIB);
        let s = t.seconds_to(2020 * MIB).unwrap();
        assert!((s - 1.0).abs() < 0.01, "{s}");
    }

    #[test]
    fn the_slope_is_the_falls_own_not_diluted_by_the_flat_budget_before_it() {
        // 2.5 s flat, then two drops of 20 MiB 100 ms apart: 200 MiB/s already.
        let mut r: Vec<(u64, u64)> = (0..26).map(|k| (k * 100, 2400)).collect();
        r.extend([(2600, 2380), (2700, 2360)]);
        let t = trend(&r);
        let s = t.seconds_to(2160 * MIB).unwrap();
        assert!((s - 1.0).abs() < 0.01, "{s}");
    }

    #[test]
    fn a_single_step_is_not_a_fall() {
        let t = trend(&[
            (0, 2400),
            (200, 2400),
            (400, 1700),
            (600, 1700),
            (800, 1700),
        ]);
        assert_eq!(t.falls_to(Duration::from_secs(30)), None);
        assert_eq!(t.seconds_to(0), None);
    }

    #[test]
    fn a_slide_that_has_stopped_is_not_a_fall() {
        // Slid for 0.3 s, then held for 1.5 s: the window's slope still falls.
        let mut r: Vec<(u64, u64)> = (0..4).map(|k| (k * 100, 2400 - k * 100)).collect();
        r.extend((1..=15).map(|k| (300 + k * 100, 2100)));
        assert_eq!(trend(&r).falls_to(Duration::from_secs(30)), None);
        // The same slide still going on half a second after its last drop is one.
        r.truncate(9);
        assert!(trend(&r).falls_to(Duration::from_secs(30)).is_some());
    }

    #[test]
    fn a_rising_or_flat_budget_is_not_a_fall() {
        assert_eq!(
            trend(&[(0, 700), (100, 800), (200, 900)]).falls_to(Duration::from_secs(1)),
            None
        );
        assert_eq!(
            trend(&[(0, 700), (100, 700), (200, 700)]).falls_to(Duration::from_secs(1)),
            None
        );
        assert_eq!(trend(&[(0, 700)]).falls_to(Duration::from_secs(1)), None);
    }
    /// The real ladder's footprints at ~128 tokens, MiB: tier0, q3km, tier1, tier2.
    const LADDER: [u64; 4] = [1200, 1020, 860, 570];

    fn fall(budget_mib: u64, rate_mib_s: f64) -> Fall {
        Fall {
            current: 0,
            budget: budget_mib * MIB,
            rate: rate_mib_s * MIB as f64,
            early_s: 5.0,
        }
    }

    fn fps() -> Vec<u64> {
        LADDER.iter().map(|m| m * MIB).collect()
    }

    #[test]
    fn the_shadow_goes_where_the_policy_will_when_the_current_rung_stops_fitting() {
        // 200 MiB/s from 2,400: a second after tier0 stops fitting the budget is 1,000 MiB,
        // which holds tier1; q3km (1,020) would not be taken early (its footprint takes more
        // than 5 s of the fall).
        assert_eq!(
            fall(2400, 200.0).destination(&fps(), |_| None),
            Start::To(2)
        );
        // Twice as fast: a second after tier0 stops fitting, 800 MiB holds tier2 only.
        assert_eq!(
            fall(2400, 400.0).destination(&fps(), |_| None),
            Start::To(3)
        );
        // Slowly: no rung's shadow would be taken early, so none starts.
        assert_eq!(
            fall(2400, 100.0).destination(&fps(), |_| None),
            Start::Nowhere
        );
        // No room beside tier0 for anything but the smallest rung.
        assert_eq!(
            fall(1800, 200.0).destination(&fps(), |_| None),
            Start::To(3)
        );
        assert_eq!(
            fall(1700, 200.0).destination(&fps(), |_| None),
            Start::Nowhere
        );
    }

    #[test]
    fn a_shadow_whose_carry_would_outlast_the_room_for_both_is_not_started() {
        let f = fall(2400, 200.0);
        // tier1 beside tier0 for (2,400 - 2,060) / 200 = 1.7 s; tier2 for 3.15 s.
        let slow = |i: usize| Some(if i == 2 { 10.0 } else { 20.0 });
        match f.destination(&fps(), slow) {
            Start::TooSlow {
                to,
                carry_s,
                holds_s,
            } => {
                assert_eq!(to, 2);
                assert!((carry_s - 10.0).abs() < 1e-9);
                assert!((holds_s - 1.7).abs() < 1e-6, "{holds_s}");
            }
            other => panic!("{other:?}"),
        }
        // A rung that would be carried in time is taken instead of the one the rules chose.
        let quick_small = |i: usize| Some(if i == 2 { 10.0 } else { 3.0 });
        assert_eq!(f.destination(&fps(), quick_small), Start::To(3));
        // In time, or not measured yet: the rules' choice.
        assert_eq!(f.destination(&fps(), |_| Some(1.5)), Start::To(2));
        assert_eq!(f.destination(&fps(), |_| None), Start::To(2));
    }
}
