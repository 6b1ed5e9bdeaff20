//! Which cached positions are not the current rung's own, and re-reading them where the next
//! question looks.
//!
//! After a size switch the cache holds projected cells: fluent, but a projected value cannot
//! carry a port number or a name. The switch re-reads natively what the question being
//! answered attends to (selective token recompute); the rest stays projected. A later turn
//! asks about something else, so before it is answered the session does the same again over
//! the cells still projected: the new prompt's last tokens are read with the attention tap
//! armed, the projected positions they attend to most are re-read natively, and the window is
//! read again over them. That is what lets `chat` and the HTTP service build the next answer
//! on the destination's cache instead of re-reading the conversation.
//!
//! Main items: [`Session::refresh_projected`], and the range helpers the bookkeeping uses
//! ([`minus`], [`shed`]).

use std::ops::Range;
use std::time::Instant;

use crate::engine::{Context, EngineError, Model, Span, Token};
use crate::transplant::select::{
    SelectRule, Sentences, TokenRecompute, Unit, covered, select_spans,
};

use super::migrate::SwitchTimings;
use super::{LeverInfo, Session, SessionError};

/// `0..n` without `taken` (any order, may overlap), as ordered disjoint ranges.
#[must_use]
pub fn minus(n: usize, taken: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut t: Vec<Range<usize>> = taken.iter().filter(|r| !r.is_empty()).cloned().collect();
    t.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut at = 0;
    for r in t {
        if r.start > at {
            out.push(at..r.start.min(n));
        }
        at = at.max(r.end);
        if at >= n {
            break;
        }
    }
    if at < n {
        out.push(at..n);
    }
    out.retain(|r| !r.is_empty());
    out
}

/// Every position of a cache of `n` cells (none for an empty one).
#[must_use]
pub fn all(n: usize) -> Vec<Range<usize>> {
    minus(n, &[])
}

/// The ranges after a shed of `n` positions after the first `pinned`: the shed ones are gone,
/// later ones move down by `n`.
#[must_use]
pub fn shed(ranges: &[Range<usize>], pinned: usize, n: usize) -> Vec<Range<usize>> {
    let end = pinned + n;
    let mut out = Vec::new();
    for r in ranges {
        if r.start < pinned {
            out.push(r.start..r.end.min(pinned));
        }
        if r.end > end {
            let s = r.start.max(end);
            out.push(s - n..r.end - n);
        }
    }
    let mut merged: Vec<Range<usize>> = Vec::new();
    for r in out.into_iter().filter(|r| !r.is_empty()) {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

impl Session {
    /// Positions of the current cache whose cells were projected by a switch and not re-read
    /// natively since.
    #[must_use]
    pub fn projected_positions(&self) -> usize {
        covered(&self.projected)
    }

    /// Whether the next answer can be built on the current cache without losing the context's
    /// facts: nothing in it is projected, or the session re-reads the projected cells the next
    /// question attends to ([`SessionOptions::token_recompute`](super::SessionOptions) by
    /// attention).
    #[must_use]
    pub fn cache_is_trustworthy(&self) -> bool {
        self.projected.is_empty()
            || self
                .opts
                .token_recompute
                .is_some_and(|t| t.rule == SelectRule::Attention)
    }

    /// Where the first `n` positions of the history end a sentence, when `setting` re-reads
    /// whole sentences (empty otherwise: nothing to compute).
    pub(super) fn sentences(&self, setting: &TokenRecompute, n: usize) -> Sentences {
        let Some(live) = self.rungs.iter().flatten().next() else {
            return Sentences::default();
        };
        sentences_of(
            live.ctx.model(),
            setting,
            &self.history[..n.min(self.history.len())],
        )
    }

    /// After a new prompt's tokens `tokens[keep..]` were decoded with the attention tap armed
    /// on their last `window`: re-reads natively the projected positions before `keep` that
    /// those tokens attend to most (the share [`TokenRecompute::fraction`] of the projected
    /// ones, widened as at a switch), then reads the window again so that it, and the answer
    /// after it, see the refreshed cells. Returns the lever it pulled, if any.
    ///
    /// # Errors
    /// An engine failure (the cache then holds the prompt as read before the refresh: every
    /// cell valid, the projected ones still projected).
    pub(super) fn refresh_projected(
        &mut self,
        tokens: &[Token],
        keep: usize,
        at_token: usize,
    ) -> Result<Option<LeverInfo>, SessionError> {
        // The caller has cut the projected ranges to the `keep` positions the prompt reuses.
        if covered(&self.projected) == 0 || keep == 0 {
            return Ok(None);
        }
        let Some(setting) = self.opts.token_recompute else {
            return Ok(None);
        };
        let Some(mass) = self.observed.take() else {
            return Ok(None);
        };
        let t0 = Instant::now();
        let text = self.sentences(&setting, keep);
        let name = self.current_rung().to_string();
        let mut projected = std::mem::take(&mut self.projected);
        let done = refresh(
            &mut self.live().ctx,
            &mut projected,
            &mass,
            &setting,
            &text,
            tokens,
            keep,
        );
        self.projected = projected;
        self.observed = Some(mass);
        match done.map_err(|source| SessionError::Engine { rung: name, source })? {
            Some(done) => Ok(Some(self.lever(at_token, "refresh", done, t0))),
            None => Ok(None),
        }
    }
}

/// Where each of `history`'s tokens ends a sentence and which sentence it is in
/// ([`Sentences::of`]), when `setting` re-reads whole sentences
/// (empty otherwise: nothing to compute); `model` gives the tokens' text.
#[must_use]
pub fn sentences_of(model: &Model, setting: &TokenRecompute, history: &[Token]) -> Sentences {
    if setting.unit != Unit::Sentence {
        return Sentences::default();
    }
    let pieces: Vec<Vec<u8>> = history.iter().map(|&t| model.token_bytes(t)).collect();
    Sentences::of(&pieces)
}

/// The positions a Molt switch left projected in a cache of `timings.cells` cells: all but the
/// head and tail it re-read and the `spans` it recomputed.
#[must_use]
pub fn projected_after(timings: &SwitchTimings, mut spans: Vec<Range<usize>>) -> Vec<Range<usize>> {
    let n = timings.cells;
    // The head is native but for what it left for the next token.
    let later = timings.head_anchored..timings.head_anchored + timings.head_later;
    spans.push(0..later.start.min(n));
    spans.push(later.end.min(n)..timings.head.min(n));
    spans.push(n - timings.tail.min(n)..n);
    minus(n, &spans)
}

/// Refreshes projected cells before a prompt is answered on them: `ctx` has just decoded the
/// prompt's `tokens[keep..]` over a cache whose positions in `projected` (cut to the `keep`
/// it reuses) were projected by a switch, and `mass` is the attention its last `window`
/// tokens gave each position. The projected positions they attend to most (the share
/// [`TokenRecompute::fraction`] of the projected ones, widened as at a switch; `text` as
/// [`sentences_of`] gives it) are re-read natively, then the window is read again over
/// them, so it and the answer after it see the refreshed cells; `projected` keeps what is
/// still projected. The positions re-read, `None` when there was nothing to do. Both the
/// session and the batched server refresh through here.
///
/// # Errors
/// An engine failure (the cache then holds the prompt as read before the refresh: every cell
/// valid, the projected ones still projected).
pub fn refresh(
    ctx: &mut Context,
    projected: &mut Vec<Range<usize>>,
    mass: &[f32],
    setting: &TokenRecompute,
    text: &Sentences,
    tokens: &[Token],
    keep: usize,
) -> Result<Option<usize>, EngineError> {
    let n_proj = covered(projected);
    if n_proj == 0 || keep == 0 {
        return Ok(None);
    }
    let mut scores = vec![0.0f32; keep];
    for r in projected.iter() {
        for p in r.clone() {
            scores[p] = mass.get(p).copied().unwrap_or(0.0);
        }
    }
    let lo = projected[0].start;
    #[allow(clippy::cast_precision_loss)]
    let fraction = (setting.fraction * n_proj as f64 / (keep - lo) as f64).min(1.0);
    let chosen = select_spans(
        &scores,
        text,
        lo,
        keep,
        keep,
        &TokenRecompute {
            fraction,
            ..*setting
        },
        keep as u64,
    );
    // Only the projected part of each chosen span needs re-reading.
    let mut ranges: Vec<Range<usize>> = Vec::new();
    for c in &chosen {
        for p in projected.iter() {
            let (s, e) = (c.start.max(p.start), c.end.min(p.end));
            if s < e {
                ranges.push(s..e);
            }
        }
    }
    if ranges.is_empty() {
        return Ok(None);
    }
    let n = tokens.len();
    let w = setting.window.clamp(1, n - keep);
    let spans = Span::of(tokens, &ranges);
    let done = ctx.recompute_spans(&spans)?;
    ctx.truncate(n - w);
    ctx.decode(&tokens[n - w..])?;
    let mut left: Vec<Range<usize>> = Vec::new();
    for p in projected.iter() {
        let inside: Vec<Range<usize>> = ranges
            .iter()
            .filter(|r| r.start < p.end && r.end > p.start)
            .map(|r| r.start - p.start..r.end - p.start)
            .collect();
        left.extend(
            minus(p.len(), &inside)
                .into_iter()
                .map(|r| r.start + p.start..r.end + p.start),
        );
    }
    *projected = left;
    Ok(Some(done))
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one range is a list of ranges here
mod tests {
    use super::*;

    #[test]
    fn minus_leaves_the_gaps() {
        assert_eq!(minus(10, &[]), vec![0..10]);
        assert_eq!(minus(10, &[0..4, 6..7, 9..12]), vec![4..6, 7..9]);
        assert_eq!(minus(10, &[3..5, 0..10]), Vec::<Range<usize>>::new());
        assert_eq!(minus(10, &[2..4, 3..6]), vec![0..2, 6..10]);
    }

    #[test]
    fn a_shed_drops_and_shifts() {
        // pinned 2, shed 3 (positions 2..5): 0..3 keeps 0..2, 4..8 keeps 5..8 -> 2..5.
        assert_eq!(shed(&[0..3, 4..8], 2, 3), vec![0..5]);
        assert_eq!(shed(&[10..12], 2, 3), vec![7..9]);
        assert_eq!(shed(&[2..5], 2, 3), Vec::<Range<usize>>::new());
    }
}
