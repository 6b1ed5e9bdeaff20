//! The session's cost model: what each rung costs the policy (weights, KV per token, the
//! context's measured overhead), and what the process measurably holds. The policy decides on
//! [`Session::rung_costs`]; benchmarks compare it with [`Session::measured_footprint`].

use crate::engine::ContextConfig;
use crate::sched::RungCost;

use super::{Session, StandbyRung};

/// KV bytes per token of a rung: K and V rows of every layer.
fn kv_per_token(info: &crate::ladder::RungInfo, config: ContextConfig) -> u64 {
    let f = &info.facts;
    u64::from(f.n_layer)
        * u64::from(f.kv_dim_k() + f.kv_dim_v())
        * config.cache_type.elem_bytes() as u64
}

/// Before a rung has been loaded, its context cost is estimated as a KV buffer for the whole
/// window plus a compute buffer of one micro-batch of logits (128 × n_vocab floats, what
/// dominates llama.cpp's reservation) and 8 MiB of graph scratch, with a quarter on top; the
/// measurement replaces it at load.
fn compute_estimate(info: &crate::ladder::RungInfo) -> u64 {
    let logits = 128 * info.facts.n_vocab * 4;
    (logits + (8 << 20)) * 5 / 4
}

/// What each rung of `ladder` costs before any is loaded, as the policy models it: the
/// file's tensor bytes, KV per token from the geometry, and the context's estimated overhead
/// (a full window's KV, a compute buffer of one micro-batch of logits).
#[must_use]
pub fn estimated_costs(ladder: &crate::ladder::Ladder, config: ContextConfig) -> Vec<RungCost> {
    ladder
        .rungs
        .iter()
        .map(|r| {
            let kv = kv_per_token(r, config);
            let ctx = kv * u64::from(config.n_ctx) + compute_estimate(r);
            RungCost::new(r.name(), r.facts.total_tensor_bytes.max(1), kv, ctx)
        })
        .collect()
}

impl Session {
    /// What each rung costs, for the policy: weights = the file's tensor bytes (every weight
    /// page is touched by each decode, so a running rung's weights are all resident), KV per
    /// token from the geometry, and the context's measured overhead (an estimate until the
    /// rung has been loaded once).
    ///
    /// A rung loaded with a speed setup above Molt's default (a larger micro-batch, repacked
    /// weights; see [`crate::speed`]) costs that setup's extra memory on top while it is
    /// loaded: its load measurement holds it, or, pinned or not yet measured, the measured
    /// rows' figure. A rung not loaded costs its default: whatever setup it gets at load is
    /// chosen to fit what the budget leaves above that ([`Session::speed_setup`]).
    pub fn rung_costs(&self) -> Vec<RungCost> {
        self.ladder
            .rungs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let kv = kv_per_token(r, self.config);
                // Loaded: what its load measured, but never less than its default cost plus
                // its setup's measured extra (a warm-up token need not touch all of it).
                let ctx = match self.rung_setup(i) {
                    Some(setup) => self.context_bytes[i]
                        .unwrap_or(0)
                        .max(self.base_context_bytes(i) + setup.extra_bytes),
                    None => self.unloaded_context_bytes(i),
                };
                RungCost::new(r.name(), r.facts.total_tensor_bytes.max(1), kv, ctx)
            })
            .collect()
    }

    /// Rung `index`'s context overhead while it is not loaded: at Molt's default setup, unless
    /// its load would be forced to another (`--ubatch`, `MOLT_REPACK`): a forced setup ignores
    /// the budget, so its extra memory must be in the cost the policy compares with the
    /// budget — left out, the policy climbs onto a rung whose load then overshoots, sheds it,
    /// sees it fit again and climbs back, a switch every token (seen with `MOLT_REPACK=1
    /// --ubatch 128` under a constant 1,700 MiB). A measured choice is made within the spare
    /// at load, so it needs no such margin.
    fn unloaded_context_bytes(&self, index: usize) -> u64 {
        let base = self.base_context_bytes(index);
        let setup =
            self.opts
                .speed
                .choose(self.ladder.rungs[index].name(), self.config.n_ubatch, None);
        if setup.source != crate::speed::SetupSource::Forced
            || setup.setting == crate::speed::RungSetup::default_at(self.config.n_ubatch).setting
        {
            return base;
        }
        // What its last load under this very setting measured, if any.
        let measured = if self.measured_setting[index] == Some(setup.setting) {
            self.context_bytes[index].unwrap_or(0)
        } else {
            0
        };
        measured.max(base + setup.extra_bytes)
    }

    /// Rung `index`'s context overhead at Molt's default setup: its last load measurement if
    /// that load had the default's memory; else the last such measurement, or the last one
    /// less its setup's extra; the estimate before it has been loaded.
    fn base_context_bytes(&self, index: usize) -> u64 {
        let r = &self.ladder.rungs[index];
        match self.context_bytes[index] {
            None => {
                kv_per_token(r, self.config) * u64::from(self.config.n_ctx) + compute_estimate(r)
            }
            Some(b) if self.measured_extra[index] == 0 => b,
            Some(b) => self.default_context_bytes[index]
                .unwrap_or_else(|| b.saturating_sub(self.measured_extra[index])),
        }
    }

    /// The speed setup rung `index` is loaded with (live, on standby, or loading in the
    /// background), `None` when it is not loaded.
    pub fn rung_setup(&self, index: usize) -> Option<crate::speed::RungSetup> {
        self.rungs
            .get(index)
            .and_then(Option::as_ref)
            .map(|r| r.setup)
            .or_else(|| self.standby.get(index)?.as_ref().map(StandbyRung::setup))
            .or_else(|| self.preparing_setup(index))
    }

    /// The speed setup rung `index` gets if it is loaded now, beside `held` bytes that stay
    /// (the current rung and the standby rungs, when loading a standby rung; 0 for a rung that
    /// takes the current one's place). The spare the policy chooses within is what the budget
    /// last read leaves above `held` and the rung's footprint at Molt's default setup with a
    /// full window; before any budget has been read, the default.
    pub fn speed_setup(&self, index: usize, held: u64) -> crate::speed::RungSetup {
        let r = &self.ladder.rungs[index];
        let kv = kv_per_token(r, self.config);
        let default_footprint = r.facts.total_tensor_bytes
            + self.base_context_bytes(index)
            + kv * u64::from(self.config.n_ctx);
        let spare = self
            .last_budget
            .map(|b| b.saturating_sub(held.saturating_add(default_footprint)));
        self.opts
            .speed
            .choose(r.name(), self.config.n_ubatch, spare)
    }

    /// Records what a load of rung `index` measured (unless the costs are pinned), with the
    /// extra of the setup it was measured under.
    pub(super) fn record_load(&mut self, index: usize, live: &super::LiveRung) {
        if live.context_bytes > 0 && !self.pinned_costs {
            self.context_bytes[index] = Some(live.context_bytes);
            self.measured_setting[index] = Some(live.setup.setting);
            self.measured_extra[index] = live.setup.extra_bytes;
            if live.setup.extra_bytes == 0 {
                self.default_context_bytes[index] = Some(live.context_bytes);
            }
        }
    }

    /// What a load of rung `index` with `setup` need not measure again: the context overhead
    /// recorded for it (its last load's measurement under the same setting, raised by what
    /// the process showed while it ran), so [`super::LiveRung::load_known`] skips the warm-up
    /// decode. `None` before a load with that setting was measured, and while costs are
    /// pinned (the pinned figure is not a measurement of this process).
    pub(super) fn known_context_bytes(
        &self,
        index: usize,
        setup: crate::speed::RungSetup,
    ) -> Option<u64> {
        if self.pinned_costs || self.measured_setting[index] != Some(setup.setting) {
            return None;
        }
        self.context_bytes[index]
    }

    /// Fixes the context overhead the policy assumes for each rung (as [`RungCost`]'s
    /// `compute_bytes`) instead of measuring it when the rung loads. For benchmarks that replay
    /// one trace in many sessions of one process: the load-time measurement (growth of
    /// `RssAnon`) depends on what the allocator already holds from earlier sessions, so without
    /// pinning the same trace could mean different decisions in different sessions.
    pub fn pin_context_bytes(&mut self, bytes: &[u64]) {
        for (slot, &b) in self.context_bytes.iter_mut().zip(bytes) {
            *slot = Some(b);
        }
        self.measured_extra.iter_mut().for_each(|e| *e = 0);
        for (slot, &b) in self.default_context_bytes.iter_mut().zip(bytes) {
            *slot = Some(b);
        }
        self.pinned_costs = true;
    }

    /// The footprint the policy assigns rung `index` with `tokens` of context.
    pub fn modelled_footprint(&self, index: usize, tokens: u64) -> u64 {
        let c = &self.rung_costs()[index];
        c.resident_bytes() + c.kv_bytes(tokens)
    }

    /// The modelled footprint of every rung at `tokens` of context, by rung name: the
    /// references a relative trace's `frac … of tierN` events resolve against
    /// ([`crate::pressure::Trace::load_with`]).
    pub fn trace_refs(&self, tokens: u64) -> crate::pressure::TraceRefs {
        self.ladder
            .rungs
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name().to_string(), self.modelled_footprint(i, tokens)))
            .collect()
    }

    /// The measured footprint: resident pages of every mapped rung file, standby rungs' included
    /// (from the process's own `smaps`), plus the growth of the process's anonymous memory since the session was
    /// created — repacked weights, KV and compute buffers as far as they have been touched, a
    /// parked cache. If `RssAnon` cannot be read: each loaded rung's load-time measurement
    /// plus the parked cache's bytes. In a process that runs other work besides this session,
    /// the anonymous part includes that work too.
    pub fn measured_footprint(&self) -> u64 {
        let files: Vec<&std::path::Path> = self
            .rungs
            .iter()
            .flatten()
            .map(|r| r.info.path.as_path())
            .chain(self.standby.iter().flatten().map(StandbyRung::path))
            .collect();
        let weights = crate::pressure::resident_bytes_of_mappings(&files).unwrap_or(0);
        match crate::pressure::process_anon_rss_bytes() {
            Ok(anon) => weights + anon.saturating_sub(self.anon_base),
            Err(_) => {
                weights
                    + self
                        .rungs
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.is_some())
                        .map(|(i, _)| self.context_bytes[i].unwrap_or(0))
                        .sum::<u64>()
                    + self.standby_bytes()
                    + self.parked_kv_bytes()
            }
        }
    }
}
