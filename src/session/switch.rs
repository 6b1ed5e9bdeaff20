//! One switch as the session runs it: resolve the route (projector or re-prefill), choose
//! what the destination re-reads natively (head, tail, selective token recompute), carry the
//! state load-first or shed-first, measure the seam when asked, and report a
//! [`SwitchInfo`]. The mechanics of carrying a cache live in [`super::migrate`]; this file
//! holds the session's decisions around them.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::engine::{ContextConfig, Span, Token};
use crate::pressure::Budget;
use crate::transplant::anchor::Anchor;
use crate::transplant::projector::Projector;
use crate::transplant::select::{Rest, select_spans};

use super::error::MigrationStep;
use super::{
    LiveRung, LoadParts, ParkedRung, Session, SessionError, SessionOptions, Strategy, SwitchInfo,
    jsd, migrate,
};
use crate::routes::{self, RouteKind};

/// How a switch carried the conversation's state to the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SwitchMethod {
    /// Molt (condition D): the KV cache projected between two tokens.
    Molt,
    /// Condition C: the destination re-read prompt and generated text.
    Reprefill,
    /// A Molt switch without a usable projector for the route: re-read instead, said in the
    /// switch's note.
    ReprefillNoProjector,
}

impl SwitchMethod {
    /// The name in events and results (`molt`, `reprefill`, `reprefill-no-projector`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Molt => "molt",
            Self::Reprefill => "reprefill",
            Self::ReprefillNoProjector => "reprefill-no-projector",
        }
    }

    /// Whether the destination re-read the whole history (its cache is native).
    #[must_use]
    pub fn is_reprefill(self) -> bool {
        !matches!(self, Self::Molt)
    }
}

impl std::fmt::Display for SwitchMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for SwitchMethod {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// What carrying the state produced, before the session records it as a [`SwitchInfo`].
struct SwitchOutcome {
    from_name: String,
    timings: migrate::SwitchTimings,
    method: SwitchMethod,
    note: Option<String>,
    load_ms: f64,
    seam: Option<SeamReading>,
    /// The spans re-read by selective token recompute.
    spans: Vec<Range<usize>>,
    /// Where the load went, when the destination was loaded at the switch.
    load_parts: Option<LoadParts>,
    /// The destination came off standby.
    from_standby: bool,
    /// The source, when the session may keep it on standby (see [`Session::retire`]).
    retired: Option<LiveRung>,
}

/// A switch's seam as the quality pass measures it.
#[derive(Debug, Clone, Copy)]
struct SeamReading {
    /// JSD of the destination's first distribution against the source's own.
    jsd: f64,
    /// The same for the destination with a native cache of the same history (a re-prefill's
    /// JSD; for a re-prefill switch, `jsd` itself).
    floor: Option<f64>,
}

/// The destination's native next-token distribution after `history` + `last`, read on a
/// scratch context of its model, as a JSD against `reference` (the source's): the floor a
/// re-prefill would have reached at this very switch. `None` if it cannot be measured.
fn native_floor(
    dst: &LiveRung,
    history: &[Token],
    last: Token,
    config: ContextConfig,
    reference: &[f32],
) -> Option<f64> {
    let cfg = ContextConfig {
        attention_tap: false,
        hidden_tap: false,
        ..config
    };
    let mut ctx = crate::engine::Context::new(dst.ctx.model().clone(), cfg).ok()?;
    let mut all = Vec::with_capacity(history.len() + 1);
    all.extend_from_slice(history);
    all.push(last);
    ctx.decode(&all).ok()?;
    Some(jsd(reference, ctx.logits()))
}

/// The inputs of one top-k recompute, gathered from the source before it may be freed.
struct TopkInputs {
    k: usize,
    map: Arc<crate::transplant::hidden::HiddenMap>,
    /// The source's boundary states, `[n_past][n_embd_src]`.
    hidden: ndarray::Array2<f32>,
}

/// The history's first and last tokens a Molt switch re-reads natively
/// ([`SessionOptions::head_reread`](super::SessionOptions::head_reread),
/// [`SessionOptions::tail_recompute`](super::SessionOptions::tail_recompute)), never more than
/// the `n_past` cells the cache holds; the head's anchored part comes from `anchor`. The
/// session's switch and the batched server's build it the same way.
pub(crate) fn reread<'a>(
    opts: &SessionOptions,
    history: &'a [Token],
    n_past: usize,
    anchor: Option<&'a Anchor>,
    spans: &'a [Span<'a>],
) -> migrate::Reread<'a> {
    let avail = n_past.min(history.len());
    let n = opts.research.tail_recompute.min(avail);
    let h = opts.head_reread.min(avail);
    migrate::Reread {
        head: &history[..h],
        tail: &history[history.len() - n..],
        anchor,
        spans,
    }
}

/// The positions a switch over a route of `kind` re-reads natively between the head and the
/// tail (selective token recompute), for a cache of `n_past` cells holding `history`: none
/// unless it is on and the route is a size route (a precision route keeps the context's
/// facts without it). `observed` is the attention mass the prompt's last tokens gave each
/// position when it was read (none: chosen by position); `model` reads sentence ends (none:
/// no sentence ends are known, and a chosen position brings the window around it).
pub fn recompute_ranges(
    opts: &SessionOptions,
    kind: RouteKind,
    history: &[Token],
    observed: Option<&[f32]>,
    model: Option<&crate::engine::Model>,
    n_past: usize,
) -> Vec<Range<usize>> {
    let Some(setting) = opts.token_recompute else {
        return Vec::new();
    };
    if kind != RouteKind::Size {
        return Vec::new();
    }
    let avail = n_past.min(history.len());
    let lo = opts.head_reread.min(avail);
    let hi = avail - opts.research.tail_recompute.min(avail);
    let scores = observed.unwrap_or(&[]);
    // The question (the observation window at the prompt's end) and the answer so far.
    let prompt_end = if scores.is_empty() { hi } else { scores.len() };
    let always = prompt_end.saturating_sub(setting.window);
    let text = model.map_or_else(Default::default, |m| {
        super::native::sentences_of(m, &setting, &history[..avail])
    });
    select_spans(scores, &text, lo, hi, always, &setting, avail as u64)
}

/// Whether a switch over a route of `kind` that re-reads `ranges` of a cache of `n_past` cells
/// reads sparsely ([`migrate::read_sparse`]) rather than projecting: the size route's token
/// recompute leaves the rest out ([`Rest::LeftOut`]), its positions were chosen by the
/// attention of the question being answered (`observed`; chosen by position they would not
/// hold what the next tokens need), they reach the end of the cache before the tail (the
/// question and the answer so far), which a sparse read needs to go on from, and no top-k
/// recompute of a projection is asked for.
pub fn reads_sparse(
    opts: &SessionOptions,
    kind: RouteKind,
    observed: bool,
    ranges: &[Range<usize>],
    n_past: usize,
) -> bool {
    let Some(setting) = opts.token_recompute else {
        return false;
    };
    let tail = opts.research.tail_recompute.min(n_past);
    let Some(last) = ranges.last() else {
        return false;
    };
    // The last piece read holds two tokens or follows the one before it (see
    // `Context::decode_sparse`).
    let last_ok = if tail > 0 {
        tail >= 2 || last.end == n_past - tail
    } else {
        last.len() >= 2
    };
    // Top-k recompute refines a projection: asking for it asks for one.
    setting.rest == Rest::LeftOut
        && opts.research.topk_recompute.is_none()
        && kind == RouteKind::Size
        && observed
        && last.end == n_past - tail
        && last_ok
}

/// A cache exported on one rung, to be carried onto another by [`carry_cache`].
pub struct CachedState<'a> {
    /// The source's exported state and how many cells it holds.
    pub exported: migrate::Exported<'a>,
    /// The tokens those cells hold.
    pub history: &'a [Token],
    /// The attention mass the prompt's last tokens gave each position when it was read (none:
    /// the positions a size route re-reads are chosen by position and sentence).
    pub observed: Option<&'a [f32]>,
    /// The token sampled last and not decoded yet: a tail re-read is decoded with it, then
    /// cut back (none: the tail is not re-read).
    pub pending: Option<Token>,
}

/// The route a cache is carried over: its kind, its projector and the destination's anchor
/// for the head re-read.
pub struct CarryRoute<'a> {
    /// Precision or size.
    pub kind: RouteKind,
    /// The maps.
    pub projector: &'a Projector,
    /// The destination's native state over the chat template's opening, if shipped.
    pub anchor: Option<&'a Anchor>,
}

/// Carries `cache` onto `dst` as a switch carries it — the head re-read natively (its anchored
/// part spliced in), projected, imported, on a size route the positions [`recompute_ranges`]
/// chooses recomputed natively (sentence ends read with `dst`'s model: the rungs share a
/// tokenizer, so whichever rung reads them picks the same positions as the session's switch,
/// which reads them with its source) — and leaves `dst` holding exactly the cache's cells, no
/// token decoded past them. The timings and the positions left projected. A woken state file,
/// an answer starting on a smaller rung, and the batched server's switch and wake all carry
/// through here.
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed (`dst` is then not to be used).
pub fn carry_cache(
    opts: &SessionOptions,
    route: &CarryRoute<'_>,
    cache: &CachedState<'_>,
    dst: &mut crate::engine::Context,
) -> Result<(migrate::SwitchTimings, Vec<Range<usize>>), SessionError> {
    let n_past = cache.exported.n_past;
    let model = Arc::clone(dst.model());
    let ranges = recompute_ranges(
        opts,
        route.kind,
        cache.history,
        cache.observed,
        Some(model.as_ref()),
        n_past,
    );
    let spans = Span::of(cache.history, &ranges);
    let reread = reread(opts, cache.history, n_past, route.anchor, &spans);
    let sparse = reads_sparse(opts, route.kind, cache.observed.is_some(), &ranges, n_past);
    let timings = match cache.pending {
        // Nothing projected: the head, the chosen positions and the tail read natively, the
        // last cell decoded last (the pending token is left to the caller).
        _ if sparse => migrate::read_sparse(dst, reread, n_past, &[], cache.exported.from)?,
        // The tail is decoded with the pending token, then cut back.
        Some(last) if !reread.tail.is_empty() => {
            let t = migrate::transplant_exported(
                &cache.exported,
                dst,
                route.projector,
                None,
                reread,
                last,
            )?;
            dst.truncate(n_past);
            t
        }
        _ => migrate::carry_exported(&cache.exported, dst, route.projector, None, reread)?,
    };
    Ok((timings, super::native::projected_after(&timings, ranges)))
}

impl Session {
    /// The history's first and last tokens a Molt switch re-reads natively
    /// ([`SessionOptions::head_reread`], [`SessionOptions::tail_recompute`]), never more than
    /// the `n_past` cells the cache holds; the head's anchored part comes from `anchor`.
    fn reread<'a>(
        &'a self,
        n_past: usize,
        anchor: Option<&'a Anchor>,
        spans: &'a [Span<'a>],
    ) -> migrate::Reread<'a> {
        reread(&self.opts, &self.history, n_past, anchor, spans)
    }

    /// The positions a switch `from → to` re-reads natively between the head and the tail
    /// (selective token recompute): see [`recompute_ranges`].
    pub(super) fn recompute_ranges(
        &self,
        from: usize,
        to: usize,
        n_past: usize,
    ) -> Vec<Range<usize>> {
        let kind = routes::route_kind(self.routes.binding(from), self.routes.binding(to));
        // Sentence ends come from a rung still in the session's list; during a switch made on
        // the spot both the source and the destination are out of it, so there are usually
        // none (the batched server's switch reads none either, to select as this does).
        let model = self.rungs.iter().flatten().next().map(|l| l.ctx.model());
        recompute_ranges(
            &self.opts,
            kind,
            &self.history,
            self.observed.as_deref(),
            model.map(AsRef::as_ref),
            n_past,
        )
    }

    /// Whether a switch `from → to` re-reading `ranges` of `n_past` cells reads sparsely: see
    /// [`reads_sparse`].
    pub(super) fn reads_sparse(
        &self,
        from: usize,
        to: usize,
        ranges: &[Range<usize>],
        n_past: usize,
    ) -> bool {
        let kind = routes::route_kind(self.routes.binding(from), self.routes.binding(to));
        reads_sparse(&self.opts, kind, self.observed.is_some(), ranges, n_past)
    }

    /// What a sparse read of `ranges` over `n_past` cells reads before its first token, and
    /// what it leaves for after it, in reading order, when it is hurried
    /// ([`SessionOptions::hurry`](super::SessionOptions::hurry)): see
    /// [`super::refill::hurry_split`]. `None`: the whole read before the token.
    fn hurry_split(
        &self,
        ranges: &[Range<usize>],
        n_past: usize,
    ) -> Option<(Range<usize>, Vec<Range<usize>>)> {
        let lo = self.opts.head_reread.min(n_past);
        let scores = self.observed.as_deref().unwrap_or(&[]);
        super::refill::hurry_split(ranges, n_past, lo, self.opts.hurry, scores)
    }

    /// The destination's anchor for a head re-read (none when the head re-read is off or no
    /// anchor is shipped): the conversation's own head when the destination read it on
    /// standby, else the shipped anchor of the template's opening; a damaged or foreign anchor
    /// is not used, and `note` says why (the head is then decoded whole).
    pub(super) fn anchor_for(
        &mut self,
        to: usize,
        note: &mut Option<String>,
    ) -> Option<Arc<Anchor>> {
        if self.opts.head_reread == 0 {
            return None;
        }
        // A standby destination that read this conversation's head covers all of it.
        if let Some(head) = self.standby_head(to) {
            return Some(head);
        }
        self.routes.anchor(to).unwrap_or_else(|e| {
            *note = Some(format!("anchor not used, head decoded: {e}"));
            None
        })
    }

    /// What top-k recompute needs for a switch `from → to` out of `src`, or why it cannot run
    /// (then the switch projects every layer, and the reason goes in the switch's note).
    ///
    /// Only states the source computed itself are used: after a switch the new rung holds an
    /// imported cache whose earlier positions it never decoded, so its tap covers only what
    /// came after, and a later switch out of it projects every layer. Chaining maps through the
    /// rung that did compute them would compound two fits' errors for a second switch inside
    /// one answer, which the benchmark's traces do not produce; the plain projection is the
    /// honest fallback.
    fn topk_inputs(
        &mut self,
        from: usize,
        to: usize,
        src: &crate::engine::Context,
    ) -> Result<Option<TopkInputs>, String> {
        let Some(k) = self.opts.research.topk_recompute else {
            return Ok(None);
        };
        let map = self
            .routes
            .hidden(from, to, k)
            .map_err(|e| format!("top-k recompute off for this switch: {e}"))?;
        let hidden = src.hidden_states(map.src_layer).ok_or_else(|| {
            format!(
                "top-k recompute off for this switch: {} did not compute the boundary state of every cached position itself",
                self.ladder.rungs[from].name()
            )
        })?;
        Ok(Some(TopkInputs { k, map, hidden }))
    }

    fn recompute_for<'a>(&'a self, to: usize, t: &'a TopkInputs) -> migrate::Recompute<'a> {
        let info = &self.ladder.rungs[to];
        migrate::Recompute {
            hidden: t.hidden.view(),
            map: Some(&t.map),
            k: t.k,
            dst_path: &info.path,
            dst_sha256: &info.sha256,
            dst_layers: info.facts.n_layer as usize,
        }
    }

    /// Moves the session to rung `to` between two tokens: `last` is the token sampled on the
    /// current rung but not decoded yet; on return it has been decoded on `to`, whose logits
    /// are ready.
    ///
    /// Moving down to a rung that is not loaded, the source is freed *before* the destination
    /// is loaded (see [`Session::switch_shed_first`]; a standby destination maps its weight
    /// pages back meanwhile, clean pages of its file in the page cache), so the process never
    /// holds both rungs' memory; so is moving up when `budget` does not hold both rungs side
    /// by side. Moving up with room for both, or with the source kept or the seam measured,
    /// the destination is loaded first.
    pub(super) fn switch_to(
        &mut self,
        to: usize,
        last: Token,
        at_token: usize,
        budget: Option<Budget>,
    ) -> Result<SwitchInfo, SessionError> {
        let from = self.current;
        self.hurried.clear();
        let tokens = self.history.len() as u64 + 1;
        let both = self.modelled_footprint(from, tokens) + self.modelled_footprint(to, tokens);
        let no_room_up = to < from && budget.is_some_and(|b| both > b.bytes);
        let shed_first = (to > from || no_room_up)
            && self.rungs[to].is_none()
            && !self.opts.research.keep_source
            && !self.opts.research.measure_seam;
        let SwitchOutcome {
            from_name,
            timings,
            method,
            note,
            load_ms,
            seam,
            spans,
            load_parts,
            from_standby,
            retired,
        } = if let Some(carried) = self.switch_carried(from, to, last)? {
            carried
        } else if shed_first {
            self.switch_shed_first(from, to, last)?
        } else {
            self.switch_load_first(from, to, last)?
        };
        let prepared = self.take_prepared();
        let note = match (self.carry_note.take(), note) {
            (Some(a), Some(b)) => Some(format!("{a}; {b}")),
            (a, b) => a.or(b),
        };
        let note = if shed_first && no_room_up {
            let why = format!(
                "loaded at the switch, source freed first: the budget {} MiB does not hold both rungs ({} MiB)",
                budget.map_or(0, |b| b.bytes >> 20),
                both >> 20
            );
            Some(note.map_or(why.clone(), |n| format!("{n}; {why}")))
        } else {
            note
        };
        let dst = self.rungs[to].as_ref().expect("destination is loaded");
        let n_tokens = self.history.len() as u64 + 1;
        let (n_params, n_layer, n_embd) = (
            dst.model().n_params(),
            dst.model().n_layer() as u64,
            dst.model().n_embd() as u64,
        );
        let flops_reprefill = migrate::prefill_flops(n_params, n_layer, n_embd, n_tokens);
        let flops = if method.is_reprefill() {
            flops_reprefill
        } else {
            migrate::switch_flops(&timings, n_params, n_layer, n_embd, n_tokens - 1)
        };
        let info = SwitchInfo {
            at_token,
            from: from_name,
            to: dst.name().to_string(),
            method,
            timings: migrate::SwitchTimings {
                load_ms,
                flops,
                load_parts,
                from_standby,
                prepared_ms: prepared.map_or(0.0, |p| p.ms),
                prepared_tokens: prepared.map_or(0, |p| p.tokens),
                ..timings
            },
            flops_reprefill,
            pressure: budget.map_or(0.0, |b| b.pressure),
            budget_bytes: budget.map_or(0, |b| b.bytes),
            handoff_jsd: seam.map(|s| s.jsd),
            handoff_floor_jsd: seam.and_then(|s| s.floor),
            note,
            setup: Some(dst.setup),
        };
        // A switch carried at its token shows what a carry onto `to` costs, on every core.
        if timings.carried_ms == 0.0 {
            let cells = self.history.len();
            let threads = self.config.n_threads;
            let load = (load_ms > 0.0 && !from_standby).then_some(load_ms);
            self.record_carry(to, cells, timings.cost_ms, threads, load);
        }
        self.current = to;
        let source_retired = retired.is_some();
        if let Some(src) = retired {
            self.retire(from, src);
        }
        // The standby rungs the budget no longer holds beside the destination go too.
        let standby_before = self.standby_bytes();
        self.settle_standby_in_answer(budget.map(|b| b.bytes));
        let dropped = standby_before.saturating_sub(self.standby_bytes());
        // Down, what the switch let go of is gone before the answer goes on when the budget
        // does not hold it still being freed: the source (a shed-first switch's is already
        // gone) and the standby rungs just dropped, freed on the reaper's thread, and the heap
        // handed back. The token after the switch was shown with a dropped standby rung's
        // ~100 MiB of buffers still held, 3 to 17 MiB over the budget in the conditions
        // benchmark; standby rungs dropped only for being above the destination, which the
        // budget still holds, are left to free while the answer goes on (waiting for them
        // put ~35 ms into the gap of a switch from tier0 to tier1).
        let tokens = self.history.len() as u64 + 1;
        let over = budget.is_some_and(|b| self.modelled_now(tokens) + dropped > b.bytes);
        if to > from && (source_retired || over) {
            self.join_reaper();
            crate::pressure::trim_heap();
        }
        // The models of the rungs let go are held until the answer ends, unless the budget
        // does not hold them.
        if budget.is_some_and(|b| self.modelled_now(tokens) > b.bytes) {
            self.free_held_models(true);
        }
        // What the destination's cache holds that is not its own: absent cells stay absent
        // through a later projection, until something reads them.
        self.holes = (self.holes && !self.projected.is_empty() && method == SwitchMethod::Molt)
            || timings.sparse;
        self.projected = if method == SwitchMethod::Molt {
            super::native::projected_after(&timings, spans)
        } else {
            Vec::new()
        };
        Ok(info)
    }

    /// The switch whose conversation was carried onto `to` in the background
    /// ([`super::prepare`], [`super::shadow`]): the destination re-reads the tokens the source
    /// wrote since the carry, with `last`, in one batch — all the answer waits for — and the
    /// source is let go (a shadow's may be gone already). `Ok(None)` when nothing was carried
    /// for `to` (or the re-read fails with the source still there: the carried state is dropped
    /// and the switch is carried at the token, the reason in its note).
    ///
    /// # Errors
    /// The re-read failing with the source gone, even of the whole history.
    fn switch_carried(
        &mut self,
        from: usize,
        to: usize,
        last: Token,
    ) -> Result<Option<SwitchOutcome>, SessionError> {
        let Some(c) = self.carried.take() else {
            return Ok(None);
        };
        if c.to != to || self.rungs[to].is_none() {
            self.carried = Some(c);
            self.drop_carried();
            return Ok(None);
        }
        let t0 = Instant::now();
        let source_live = self.rungs[from].is_some();
        // Down, the source is let go before the catch-up: it is freed on the reaper's thread
        // while the destination decodes, and joined before the answer goes on, so that the
        // token after the switch is not shown while the source still holds memory the budget
        // no longer has, and its freeing overlaps the decode. A catch-up that fails then
        // re-reads the whole history, as when a shadow's source went first.
        let freed_early = source_live && to > from && !self.opts.research.keep_source;
        if freed_early && let Some(src) = self.rungs[from].take() {
            self.reap_rungs(vec![src]);
        }
        let source_live = source_live && !freed_early;
        let Some(dst) = self.rungs[to].as_mut() else {
            return Ok(None);
        };
        let done = dst.ctx.n_past().min(self.history.len());
        let mut next = self.history[done..].to_vec();
        next.push(last);
        let mut c = c;
        if let Err(e) = dst.ctx.decode(&next) {
            dst.ctx.clear();
            let why = format!("not carried in the background: catching up failed: {e}");
            if source_live {
                self.carry_note = Some(why);
                return Ok(None);
            }
            // The source is gone: the destination re-reads the whole history.
            next = self.history.clone();
            next.push(last);
            dst.ctx
                .decode(&next)
                .map_err(|source| SessionError::Engine {
                    rung: dst.name().to_string(),
                    source,
                })?;
            self.carry_note = Some(why);
            c = super::prepare::Carried::empty(to);
        }
        if freed_early {
            self.join_reaper();
        }
        let cost_ms = t0.elapsed().as_secs_f64() * 1e3;
        let src = self.rungs[from].take();
        let from_name = self.ladder.rungs[from].name().to_string();
        let method = if c.projected {
            SwitchMethod::Molt
        } else {
            self.reread_method()
        };
        let note = format!(
            "{} cells carried in the background in {:.0} ms ({}), {} token(s) caught up at the switch and {} before{}",
            c.n_past,
            c.ms,
            if c.projected {
                "projected with its native re-reads"
            } else {
                "the history re-read natively"
            },
            next.len() - 1,
            c.caught_up,
            if src.is_none() && !freed_early {
                "; the source freed before the carry finished"
            } else {
                ""
            }
        );
        Ok(Some(SwitchOutcome {
            from_name,
            timings: migrate::SwitchTimings {
                cost_ms,
                first_decode_ms: cost_ms,
                carried_ms: c.ms,
                caught_up: c.caught_up + next.len() - 1,
                ..c.timings
            },
            method,
            note: Some(note),
            load_ms: 0.0,
            seam: None,
            spans: c.ranges,
            load_parts: None,
            from_standby: false,
            retired: src.filter(|_| !self.opts.research.keep_source),
        }))
    }

    /// The route's projector, or why there is none (then the switch re-reads, and the note
    /// says so): resolved once, before anything is freed or loaded.
    ///
    /// Two routes switch without a fitted map: a precision route carries its cache as it is
    /// ([`routes::Routes::get`] gives the identity, and the note says so), and a size route
    /// whose switch reads sparsely projects nothing ([`migrate::read_sparse`]), so it stands
    /// on the naive truncated map, which that read never applies. A size route that would
    /// project falls back to a re-prefill.
    pub(super) fn resolve_route(
        &mut self,
        from: usize,
        to: usize,
    ) -> (Option<Arc<Projector>>, Option<String>) {
        if self.opts.strategy == Strategy::Reprefill {
            return (None, None);
        }
        match self.routes.get(from, to) {
            Ok(p) if self.routes.is_unfitted_identity(from, to) => (
                Some(p),
                Some("no fitted map for this precision route: the cache carried as it is".into()),
            ),
            Ok(p) => (Some(p), None),
            Err(routes::RouteError::Missing { .. }) if self.reads_sparse_now(from, to) => {
                let (s, d) = (self.routes.binding(from), self.routes.binding(to));
                (
                    Some(Arc::new(routes::truncate_projector(s, d))),
                    Some("no fitted map for this size route: a sparse native read, nothing projected".into()),
                )
            }
            // Without a usable projector the answer must still survive: fall back to a
            // re-prefill, named as such in the switch event, rather than lose it.
            Err(e) => (None, Some(format!("fell back to a re-prefill: {e}"))),
        }
    }

    /// Whether a switch `from → to` made now, over the current rung's cache, reads sparsely
    /// (the same decision the switch makes once its projector is resolved).
    fn reads_sparse_now(&self, from: usize, to: usize) -> bool {
        let Some(src) = self.rungs[from].as_ref() else {
            return false;
        };
        let n_past = src.ctx.n_past();
        let ranges = self.recompute_ranges(from, to, n_past);
        self.reads_sparse(from, to, &ranges, n_past)
    }

    /// The method a switch reports: a re-read is a fallback when the strategy wanted a
    /// projection.
    pub(super) fn reread_method(&self) -> SwitchMethod {
        if self.opts.strategy == Strategy::Reprefill {
            SwitchMethod::Reprefill
        } else {
            SwitchMethod::ReprefillNoProjector
        }
    }

    /// The load-first switch: map the destination (if needed), carry the state while both are
    /// live, then free the source (or keep it, cleared, with `keep_source`). On failure both
    /// rungs are as they were.
    fn switch_load_first(
        &mut self,
        from: usize,
        to: usize,
        last: Token,
    ) -> Result<SwitchOutcome, SessionError> {
        let was_loaded = self.rungs[to].is_some();
        let from_standby = !was_loaded && self.standby[to].is_some();
        let t_load = Instant::now();
        if !was_loaded && crate::fault::hit(crate::fault::Site::SwitchLoad) {
            return Err(injected_load_failure(&self.ladder.rungs[to]));
        }
        self.ensure_loaded(to)?;
        let load_ms = if was_loaded {
            0.0
        } else {
            t_load.elapsed().as_secs_f64() * 1e3
        };
        let load_parts = match &self.rungs[to] {
            Some(dst) if !was_loaded && !from_standby => Some(dst.parts),
            _ => None,
        };
        let (projector, mut note) = self.resolve_route(from, to);
        // Chosen while the rungs are in place: the sentence boundaries are read with a loaded
        // rung's tokenizer (none in place, the positions would be picked without them).
        let ranges = match (&projector, &self.rungs[from]) {
            (Some(_), Some(src)) => self.recompute_ranges(from, to, src.ctx.n_past()),
            _ => Vec::new(),
        };
        let mut src = self.rungs[from].take().expect("current rung is loaded");
        let mut dst = self.rungs[to].take().expect("destination just loaded");
        let mut read_ranges = ranges.clone();
        let mut hurried = Vec::new();
        let result = match &projector {
            None => migrate::reprefill(&src.ctx, &mut dst.ctx, &self.history, last)
                .map(|t| (t, self.reread_method())),
            Some(p) => {
                let topk = self.topk_inputs(from, to, &src.ctx).unwrap_or_else(|why| {
                    note = Some(why);
                    None
                });
                let anchor = self.anchor_for(to, &mut note);
                let rc = topk.as_ref().map(|t| self.recompute_for(to, t));
                let n_past = src.ctx.n_past();
                let sparse = self.reads_sparse(from, to, &ranges, n_past);
                // Hurried: the newest positions before the token, the rest read after it.
                if let Some((now, later)) =
                    sparse.then(|| self.hurry_split(&ranges, n_past)).flatten()
                {
                    hurried = later;
                    read_ranges = vec![now];
                }
                let spans = Span::of(&self.history, &read_ranges);
                let reread = self.reread(n_past, anchor.as_deref(), &spans);
                if sparse {
                    migrate::read_sparse(&mut dst.ctx, reread, n_past, &[last], src.model().name())
                } else {
                    migrate::transplant_with(&src.ctx, &mut dst.ctx, p, rc.as_ref(), reread, last)
                }
                .map(|t| (t, SwitchMethod::Molt))
            }
        };
        let (timings, method) = match result {
            Ok(r) => r,
            Err(e) => {
                self.rungs[from] = Some(src);
                self.rungs[to] = Some(dst);
                return Err(e);
            }
        };
        let seam = if self.opts.research.measure_seam && src.ctx.decode(&[last]).is_ok() {
            let reference = src.ctx.logits();
            let jsd = jsd(reference, dst.ctx.logits());
            // A re-prefill switch is its own floor.
            let floor = if method == SwitchMethod::Molt {
                native_floor(&dst, &self.history, last, self.config, reference)
            } else {
                Some(jsd)
            };
            src.ctx.truncate(src.ctx.n_past().saturating_sub(1));
            Some(SeamReading { jsd, floor })
        } else {
            None
        };
        let from_name = src.name().to_string();
        self.rungs[to] = Some(dst);
        self.hurried = hurried;
        let retired = if self.opts.research.keep_source {
            src.ctx.clear();
            self.rungs[from] = Some(src);
            None
        } else {
            Some(src)
        };
        Ok(SwitchOutcome {
            from_name,
            timings,
            method,
            note,
            load_ms,
            seam,
            spans: read_ranges,
            load_parts,
            from_standby,
            retired,
        })
    }

    /// The source of a failed switch whose state was not exported (a sparse read needs none),
    /// loaded again with `config` and `setup` and its cache rebuilt by reading the history's
    /// `n_past` tokens: nothing of the answer is lost, only the time of a re-read.
    fn reread_source(
        &self,
        from: usize,
        config: ContextConfig,
        setup: crate::speed::RungSetup,
        n_past: usize,
    ) -> Result<LiveRung, SessionError> {
        let info = &self.ladder.rungs[from];
        let mut live = LiveRung::load_with(info, config, setup)?;
        let n = n_past.min(self.history.len());
        if n > 0 {
            live.ctx
                .decode_cache_only(&self.history[..n])
                .map_err(|source| SessionError::Engine {
                    rung: info.name().to_string(),
                    source,
                })?;
        }
        Ok(live)
    }

    /// The shed-first switch, for moving down under pressure: export the source's sequence
    /// state (a few MB of host memory), free the source — weights unmapped, context and its
    /// buffers released — then map the destination, project and import. The process never
    /// holds both rungs' memory, so the switch itself cannot overshoot the budget it answers:
    /// a standby destination's weight pages are mapped back while the source's are being
    /// unmapped (clean page-cache pages either way; its context is already counted), a
    /// destination loaded at the switch only once the source is gone.
    ///
    /// If the destination cannot be loaded or the state cannot be carried, the source is
    /// mapped again and its exported state re-imported byte for byte, so the session stays
    /// where it was with nothing lost; only if that also fails is the error fatal.
    fn switch_shed_first(
        &mut self,
        from: usize,
        to: usize,
        last: Token,
    ) -> Result<SwitchOutcome, SessionError> {
        // Resolve the projector before anything is freed: a missing one means a re-prefill.
        let (projector, mut note) = self.resolve_route(from, to);
        // Chosen before the source is taken out: the sentence boundaries are read with its
        // tokenizer (with no rung in place they were not, and the positions were picked
        // without them, the facts' sentences cut).
        let ranges = match (&projector, &self.rungs[from]) {
            (Some(_), Some(src)) => self.recompute_ranges(from, to, src.ctx.n_past()),
            _ => Vec::new(),
        };
        let t0 = Instant::now();
        let src = self.rungs[from].take().expect("current rung is loaded");
        let from_name = src.name().to_string();
        let from_model = src.model().name().to_string();
        let n_past = src.ctx.n_past();
        let sparse = projector.is_some() && self.reads_sparse(from, to, &ranges, n_past);
        // A sparse read takes nothing from the source's cache: its state is not exported (it
        // was only for putting the source back on a failure, and the answer waited 8-95 ms
        // for it at ~300-1,600 tokens); on a failure the source reads the history again.
        let blob = if sparse {
            None
        } else {
            match src.ctx.export_state() {
                Ok(b) => Some(b),
                Err(e) => {
                    self.rungs[from] = Some(src);
                    return Err(SessionError::Migration {
                        from: from_name,
                        to: self.ladder.rungs[to].name().to_string(),
                        source: MigrationStep::Export.fail(e),
                    });
                }
            }
        };
        let export_ms = t0.elapsed().as_secs_f64() * 1e3;
        let src_config = src.ctx.config();
        let src_setup = src.setup;
        let topk = match projector {
            Some(_) => self.topk_inputs(from, to, &src.ctx).unwrap_or_else(|why| {
                note = Some(why);
                None
            }),
            None => None,
        };
        // The source is freed on a thread of its own (~50 ms of a core for a 1.5B rung on this
        // VM: its context ~8, the llama.cpp model's tables 35-49, its weights' page-table
        // entries 2-3 with 2 MiB folios) while the projection runs when it needs nothing of
        // the destination ([`migrate::stage`]); a destination that must be loaded is loaded
        // only once the source is gone, so the process never holds both rungs' memory (a
        // standby one maps its pages back meanwhile, below).
        self.reap_rungs(vec![src]);
        // Hurried: the newest positions before the token, the rest read after it.
        let hurried = if sparse {
            self.hurry_split(&ranges, n_past)
        } else {
            None
        };
        let read_ranges = hurried
            .as_ref()
            .map_or_else(|| ranges.clone(), |(now, _)| vec![now.clone()]);
        let stageable =
            !sparse && topk.is_none() && self.standby.get(to).is_some_and(Option::is_some);
        let anchor = match &projector {
            Some(_) => self.anchor_for(to, &mut note),
            None => None,
        };
        let history = self.history.clone();
        let staged_spans = Span::of(&history, &ranges);
        // A standby destination only maps its weight pages back, on a thread of its own while
        // the projection runs here and the source's pages are unmapped on the reaper's: both
        // are clean pages of model files in the page cache, so mapping one while the other is
        // let go takes no memory the system cannot reclaim. What the budget governs apart from
        // the page cache — the source's KV cache and buffers — is freed as before. The
        // destination's import and first decode run while the source is still being freed,
        // and the switch waits for the reaper only after them: the token is shown once the
        // source is gone, as before, and the memory goes back to the system no later. Any
        // other destination is loaded once the source is gone: its context is new memory.
        let injected = crate::fault::hit(crate::fault::Site::SwitchLoad);
        let standby_rung = if injected {
            None
        } else {
            self.standby.get_mut(to).and_then(Option::take)
        };
        let (staged, activate_ms) = std::thread::scope(|scope| {
            // A hot one has its pages mapped already.
            let populating = standby_rung.as_ref().filter(|r| !r.is_hot()).map(|r| {
                let path = r.path().to_path_buf();
                scope.spawn(move || super::rung::populate(&path))
            });
            let staged = match &projector {
                Some(p) if stageable && blob.is_some() => {
                    let reread = reread(
                        &self.opts,
                        &history,
                        n_past,
                        anchor.as_deref(),
                        &staged_spans,
                    );
                    migrate::stage(
                        &migrate::Exported {
                            blob: blob.as_deref().unwrap_or_default(),
                            n_past,
                            from: &from_model,
                            export_ms,
                        },
                        self.ladder.rungs[to].name(),
                        p,
                        self.config.cache_type,
                        reread,
                    )
                }
                _ => Ok(None),
            };
            (staged, populating.map(|h| h.join().unwrap_or(0.0)))
        });
        let standby_dst = standby_rung.map(|r| (r.into_live(), activate_ms.unwrap_or(0.0)));
        if standby_dst.is_none() {
            self.join_reaper();
        }
        let t_load = Instant::now();
        let loaded = if injected {
            Err(injected_load_failure(&self.ladder.rungs[to]))
        } else {
            match standby_dst {
                Some((dst, activate_ms)) => Ok((dst, Some(activate_ms))),
                None => {
                    let setup = self.speed_setup(to, 0);
                    let known = self.known_context_bytes(to, setup);
                    LiveRung::load_known(&self.ladder.rungs[to], self.config, setup, known)
                        .map(|d| (d, None))
                }
            }
        };
        let carried = match loaded {
            Ok((mut dst, activated)) => {
                let from_standby = activated.is_some();
                let load_ms = activated.unwrap_or_else(|| t_load.elapsed().as_secs_f64() * 1e3);
                let load_parts = (!from_standby).then_some(dst.parts);
                if !from_standby {
                    self.record_load(to, &dst);
                    self.arm_hidden_tap(to, &mut dst.ctx);
                }
                let rc = topk.as_ref().map(|t| self.recompute_for(to, t));
                let spans = Span::of(&self.history, &read_ranges);
                // The load is reported apart (both strategies pay it): the switch's own cost
                // is the export plus everything after the load.
                let r = match (&projector, staged) {
                    (_, Err(e)) => Err(e),
                    (_, Ok(Some(st))) => migrate::transplant_staged(
                        st,
                        &from_model,
                        &mut dst.ctx,
                        last,
                        self.opts.head_later,
                    )
                    .map(|t| (t, SwitchMethod::Molt)),
                    (Some(_), Ok(None)) if sparse => migrate::read_sparse(
                        &mut dst.ctx,
                        self.reread(n_past, anchor.as_deref(), &spans),
                        n_past,
                        &[last],
                        &from_model,
                    )
                    .map(|t| (t, SwitchMethod::Molt)),
                    (Some(p), Ok(None)) => migrate::transplant_exported(
                        &migrate::Exported {
                            blob: blob.as_deref().unwrap_or_default(),
                            n_past,
                            from: &from_model,
                            export_ms,
                        },
                        &mut dst.ctx,
                        p,
                        rc.as_ref(),
                        self.reread(n_past, anchor.as_deref(), &spans),
                        last,
                    )
                    .map(|t| (t, SwitchMethod::Molt)),
                    (None, Ok(None)) => {
                        migrate::reprefill_from(&from_model, &mut dst.ctx, &self.history, last).map(
                            |mut t| {
                                t.export_ms = export_ms;
                                t.cost_ms += export_ms;
                                (t, self.reread_method())
                            },
                        )
                    }
                };
                r.map(|(t, m)| (t, m, dst, load_ms, load_parts, from_standby))
            }
            Err(e) => Err(e),
        };
        // The token this switch decoded is not shown while the source still holds memory the
        // budget no longer has.
        self.join_reaper();
        match carried {
            Ok((timings, method, dst, load_ms, load_parts, from_standby)) => {
                self.rungs[to] = Some(dst);
                self.hurried = hurried.map(|(_, later)| later).unwrap_or_default();
                let start = timings.head_anchored;
                self.head_behind =
                    (timings.head_later > 0).then(|| (to, start..start + timings.head_later));
                Ok(SwitchOutcome {
                    from_name,
                    timings,
                    method,
                    note: note.take(),
                    load_ms,
                    seam: None,
                    spans: read_ranges,
                    load_parts,
                    from_standby,
                    retired: None,
                })
            }
            Err(e) => {
                // Put the source back as it was (its first mapping is gone: the reaper was
                // joined above): its exported state is a parked rung; not exported (a sparse
                // read), it reads the history again.
                let restored = match blob {
                    Some(blob) => ParkedRung {
                        info: self.ladder.rungs[from].clone(),
                        config: src_config,
                        setup: src_setup,
                        blob,
                        n_past,
                        park_ms: 0.0,
                    }
                    .resume(),
                    None => self.reread_source(from, src_config, src_setup, n_past),
                };
                match restored {
                    Ok(live) => {
                        self.rungs[from] = Some(live);
                        Err(e)
                    }
                    Err(r) => {
                        // Nothing of the answer's state survives: start the rung afresh so the
                        // session stays usable, and forget the history its cache no longer
                        // holds.
                        self.history.clear();
                        let _ = self.ensure_loaded(from);
                        Err(SessionError::SourceLost {
                            switch: Box::new(e),
                            restore: Box::new(r),
                        })
                    }
                }
            }
        }
    }
}

/// What a destination that will not load looks like when `MOLT_FAULT` says so (see
/// [`crate::fault`]): the error llama.cpp's refusal of the file gives.
fn injected_load_failure(info: &crate::ladder::RungInfo) -> SessionError {
    SessionError::Engine {
        rung: info.name().to_string(),
        source: crate::engine::EngineError::LoadFailed {
            path: info.path.display().to_string(),
            detail: crate::fault::detail(crate::fault::Site::SwitchLoad),
        },
    }
}
