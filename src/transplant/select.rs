//! Which cached positions a size switch re-reads natively (selective token recompute).
//!
//! A projected cache keeps the text fluent but loses what the context said: the destination
//! attends to projected keys and reads projected values, and a value map with a held-out error
//! of 0.75 cannot carry a port number or an identifier. Re-reading a few positions natively on
//! the destination, at their own positions and over the projected cells (CacheBlend's
//! selective recompute), gives those positions the destination's own K/V. Which positions: the
//! ones the source read to answer — its attention from the prompt's last tokens (the question)
//! over the history, as SnapKV and H2O pick by pooled attention mass ([`SelectRule::Attention`]),
//! with neighbours taken so a multi-token fact comes whole. [`SelectRule::Random`] picks as
//! many positions by chance: the control that says whether the attention picks well.
//! [`SelectRule::Residual`] picks the positions the route's maps lose most of (their cells'
//! round trip through the maps, [`residual_scores`]): the ablation that asks whether what
//! the question reads matters more than what the projection damages.
//!
//! Text that repeats itself (templated documents, logs, transcripts, generated code) draws the
//! question's attention to every copy of a sentence; ranked by mass alone the copies fill the
//! read. [`Sentences`] gives each position a key naming its sentence's text, and
//! [`TokenRecompute::distinct`] reads one copy of each.
//!
//! Main items: [`TokenRecompute`] (the setting), [`Sentences`] (the context as a selection
//! sees it), [`select_spans`] (the pure choice), [`residual_scores`].

use std::ops::Range;

use ndarray::ArrayView2;

use super::error::TransplantError;
use super::project::project;
use super::projector::Projector;
use crate::kv::KvStream;

/// How a switch chooses the positions it re-reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SelectRule {
    /// By the attention mass the source's last prompt tokens gave each position.
    Attention,
    /// At random (seeded): the control.
    Random,
    /// By how much of each position's source cells the route's maps lose (the relative error
    /// of a round trip source → destination → source, [`residual_scores`]). An ablation the
    /// recall benchmark measures; a session selects by attention or at random.
    Residual,
}

impl SelectRule {
    /// The rule's name in flags and benchmark arms.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Attention => "attention",
            Self::Random => "random",
            Self::Residual => "residual",
        }
    }
}

impl std::str::FromStr for SelectRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "attention" => Ok(Self::Attention),
            "random" => Ok(Self::Random),
            "residual" => Ok(Self::Residual),
            other => Err(format!(
                "unknown selection rule {other:?} (expected attention, random or residual)"
            )),
        }
    }
}

/// What a chosen position brings with it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Unit {
    /// The position, `neighbours` each side and `follow` after it; `fraction` counts the
    /// chosen positions before they are widened.
    #[default]
    Position,
    /// The whole sentence (or line) around it, up to [`MAX_SENTENCE`] positions: a fact is
    /// stated in a sentence, and the words the question attends to ("the port for the
    /// gateway") may stand before the value or after it. `fraction` is then the share of the
    /// context re-read in all, filled sentence by sentence in order of attention.
    Sentence,
}

impl Unit {
    /// The unit's name in flags and benchmark arms.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Position => "position",
            Self::Sentence => "sentence",
        }
    }
}

impl std::str::FromStr for Unit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "position" => Ok(Self::Position),
            "sentence" => Ok(Self::Sentence),
            other => Err(format!(
                "unknown recompute unit {other:?} (expected position or sentence)"
            )),
        }
    }
}

/// The longest sentence re-read whole; a longer one is re-read around the chosen position
/// (a quarter of this before it, the rest after).
pub const MAX_SENTENCE: usize = 48;

/// Which positions end a sentence or a line, from each token's text: a token holding a line
/// break, or ending in `.`, `!` or `?` when the next token starts with white space (so the
/// point inside `2.41` or `v1.2` does not end one).
#[must_use]
pub fn sentence_ends<S: AsRef<[u8]>>(pieces: &[S]) -> Vec<bool> {
    (0..pieces.len())
        .map(|i| {
            let p = pieces[i].as_ref();
            if p.contains(&b'\n') {
                return true;
            }
            let ends_mark = p
                .iter()
                .rev()
                .find(|b| !b.is_ascii_whitespace())
                .is_some_and(|b| matches!(b, b'.' | b'!' | b'?'));
            let next_space = pieces
                .get(i + 1)
                .is_none_or(|n| n.as_ref().first().is_none_or(u8::is_ascii_whitespace));
            ends_mark && next_space
        })
        .collect()
}

/// A context's sentences as a selection sees them: where each ends ([`sentence_ends`]) and,
/// per position, a key naming its sentence's text ([`Sentences::of`]), so that copies of one
/// sentence share a key. Templated documents, logs and transcripts repeat the same sentence
/// many times, and each copy draws the question's attention again: ranked by mass alone, the
/// copies fill the read and the one sentence that holds the fact is left out
/// ([`TokenRecompute::distinct`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sentences {
    /// Whether each position ends a sentence or a line.
    pub ends: Vec<bool>,
    /// Each position's sentence key (equal for copies of one sentence; empty: unknown, every
    /// sentence distinct).
    pub keys: Vec<u64>,
}

impl Sentences {
    /// Sentence ends and keys from each token's text. A sentence's key is a hash of its bytes
    /// with the white space at either end trimmed, so a copy that opens a paragraph and one
    /// that follows a sentence on the same line are one sentence.
    #[must_use]
    pub fn of<S: AsRef<[u8]>>(pieces: &[S]) -> Self {
        let ends = sentence_ends(pieces);
        let mut keys = vec![0u64; pieces.len()];
        let mut start = 0;
        for i in 0..pieces.len() {
            if ends[i] || i + 1 == pieces.len() {
                let bytes: Vec<u8> = pieces[start..=i]
                    .iter()
                    .flat_map(|p| p.as_ref().iter().copied())
                    .collect();
                let key = fnv1a(bytes.trim_ascii());
                keys[start..=i].fill(key);
                start = i + 1;
            }
        }
        Self { ends, keys }
    }

    /// Ends only: every sentence distinct.
    #[must_use]
    pub fn from_ends(ends: Vec<bool>) -> Self {
        Self {
            ends,
            keys: Vec::new(),
        }
    }

    /// The key of the sentence holding `p` (`None`: unknown).
    fn key(&self, p: usize) -> Option<u64> {
        self.keys.get(p).copied()
    }
}

/// FNV-1a, 64 bits: a stable hash for sentence keys (no seed, so a selection is reproducible).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The sentence around `p` inside `lo .. hi`, by `ends`, capped at [`MAX_SENTENCE`].
fn sentence_around(ends: &[bool], p: usize, lo: usize, hi: usize) -> Range<usize> {
    let end_at = |q: usize| ends.get(q).copied().unwrap_or(false);
    let mut s = p;
    while s > lo && !end_at(s - 1) {
        s -= 1;
    }
    let mut e = p;
    while e < hi && !end_at(e) {
        e += 1;
    }
    let e = (e + 1).min(hi);
    if e - s <= MAX_SENTENCE {
        return s..e;
    }
    let s = s.max(p.saturating_sub(MAX_SENTENCE / 4));
    s..e.min(s + MAX_SENTENCE)
}

/// Selective token recompute at a size switch: re-read `fraction` of the cached positions
/// natively on the destination, chosen by `rule`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenRecompute {
    /// Share of the cached positions re-read (before neighbours are added), in `(0, 1]`.
    pub fraction: f64,
    /// How they are chosen.
    pub rule: SelectRule,
    /// Prompt tokens whose attention is summed ([`SelectRule::Attention`]): the question.
    pub window: usize,
    /// Neighbours taken on each side of a chosen position.
    pub neighbours: usize,
    /// Further positions taken after a chosen one: the question attends most to the words
    /// that name a fact ("the auditor … is"), and the value follows them.
    #[serde(default)]
    pub follow: usize,
    /// What a chosen position brings with it.
    #[serde(default)]
    pub unit: Unit,
    /// At least this many positions are chosen (when the context before the question holds
    /// them), whatever `fraction` gives: a fact is stated in a sentence or two of a few dozen
    /// tokens whatever the context's length, so a share alone re-reads too little of a short
    /// context to bring its fact whole.
    #[serde(default)]
    pub min_positions: usize,
    /// When the positions chosen cover at least this share of the cache between the head and
    /// the tail, all of it is re-read instead (0: never). On a short context the floor and
    /// the question already take most of it: re-reading the rest costs the switch at most
    /// twice as much, leaves a cache wholly native, and spares the refill behind the answer
    /// a re-read of every position again (a server switch at 88 cells re-read 88 positions,
    /// 85 of them twice).
    #[serde(default)]
    pub whole_from: f64,
    /// What the destination holds at the positions not chosen: the source's cells projected,
    /// or nothing until a refill reads them ([`Rest::LeftOut`], a sparse read).
    #[serde(default, skip_serializing_if = "Rest::is_projected")]
    pub rest: Rest,
    /// With [`Unit::Sentence`]: a sentence whose copy is already chosen is not chosen again
    /// (by [`Sentences::keys`]), so repeated boilerplate spends the read once and the rest of
    /// it goes to the sentences that say something new. The destination reads the chosen
    /// sentences sparsely or over projected cells; one native copy of a repeated sentence
    /// tells it what every copy says.
    #[serde(default)]
    pub distinct: bool,
}

/// What a size switch leaves at the cached positions its token recompute does not re-read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rest {
    /// The source's cells, projected onto the destination: every position holds a cell, the
    /// unchosen ones approximate. Fluent, but the ~1,600 projected cells of a ~1,800-token
    /// context drown the few re-read ones: the answer restates the question without its value
    /// (16/24 items recalled where the native destination recalls 21, `results/recall.json`).
    #[default]
    Projected,
    /// Nothing: the destination reads only the head, the chosen sentences and the question,
    /// natively at their own positions (a sparse read, [`crate::engine::Context::decode_sparse`]),
    /// with no projection at all; the positions left out are read by the refill behind the
    /// answer, or before the next prompt is read on the cache.
    LeftOut,
}

impl Rest {
    /// Whether the unchosen positions are projected (the serialised default).
    #[must_use]
    pub fn is_projected(&self) -> bool {
        *self == Self::Projected
    }
}

impl std::str::FromStr for Rest {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "projected" => Ok(Self::Projected),
            "left-out" => Ok(Self::LeftOut),
            other => Err(format!(
                "unknown rest {other:?} (expected projected or left-out)"
            )),
        }
    }
}

impl TokenRecompute {
    /// What a session does at a size switch when nothing is set: whole sentences chosen by
    /// the source's attention from the question, until a tenth of the context before the
    /// question is re-read and at least 64 positions (a short context's fact sentence is as
    /// long as a long one's), and the question always. The recall benchmark's frontier point
    /// (`results/recall.json`, arm `sent-r10-m64`): the position unit with eight followers
    /// (`attn-r05-f8`) lost values that stand before the words the
    /// question names ("port 7319 for the gateway"), and a share alone re-read too little of
    /// a 256-token context; at 1,024 tokens and more the floor is below the share. Nothing
    /// else is projected ([`Rest::LeftOut`]): with the rest projected the
    /// default recalled 16/24 facts at ~1,800 tokens before answer token 1 and 6/24
    /// mid-answer, against the native destination's 21 and 10; read sparsely, 22 and 16 at
    /// 11-13% of a re-prefill's cost (arm `sparse-r10-m64`). A sentence whose copy is already
    /// chosen is not chosen again ([`TokenRecompute::distinct`]): on a context that repeats a
    /// few paragraphs many times, the copies took the whole read and the fact's sentence was
    /// left out (arm `sparse-r10-m64-copies`, `results/recall_kinds.json`).
    #[must_use]
    pub fn default_size() -> Self {
        Self {
            min_positions: 64,
            whole_from: 0.5,
            rest: Rest::LeftOut,
            distinct: true,
            ..Self::sentences(0.10)
        }
    }

    /// Attention-guided recompute of `fraction` of the cache, SnapKV's 32-token window, one
    /// neighbour each side.
    #[must_use]
    pub fn attention(fraction: f64) -> Self {
        Self {
            fraction,
            rule: SelectRule::Attention,
            window: 32,
            neighbours: 1,
            follow: 0,
            unit: Unit::Position,
            min_positions: 0,
            whole_from: 0.0,
            rest: Rest::Projected,
            distinct: false,
        }
    }

    /// Attention-guided recompute of whole sentences until `fraction` of the context before
    /// the question is re-read.
    #[must_use]
    pub fn sentences(fraction: f64) -> Self {
        Self {
            unit: Unit::Sentence,
            ..Self::attention(fraction)
        }
    }
}

/// [`SelectRule::Residual`]'s scores, indexed by position (0 where no cell is cached): for
/// each cached position, the relative squared error of its cells after a round trip through
/// the route's maps — `stream` (the source's exported cache) projected by `forward` onto the
/// destination and by `back` (the reverse route) onto the source again — K and V, averaged
/// over the source's layers. Positions whose cells the maps cannot carry score high.
///
/// # Errors
/// A [`TransplantError`] if the maps do not fit the cache or each other.
pub fn residual_scores(
    stream: &KvStream,
    forward: &Projector,
    back: &Projector,
) -> Result<Vec<f32>, TransplantError> {
    let positions = stream.positions();
    let src: Vec<(ArrayView2<'_, f32>, ArrayView2<'_, f32>)> = stream
        .layers
        .iter()
        .map(|l| (l.k.view(), l.v.view()))
        .collect();
    let (dst, _) = project(forward, &src, &positions)?;
    let dst_views: Vec<_> = dst.iter().map(|(k, v)| (k.view(), v.view())).collect();
    let (again, _) = project(back, &dst_views, &positions)?;
    let n = positions
        .iter()
        .map(|&p| usize::try_from(p).unwrap_or(0) + 1)
        .max()
        .unwrap_or(0);
    let mut scores = vec![0.0f32; n];
    let rel = |a: ArrayView2<'_, f32>, b: &ndarray::Array2<f32>, c: usize| {
        let (mut err, mut norm) = (0.0f32, 0.0f32);
        for (x, y) in a.row(c).iter().zip(b.row(c)) {
            err += (x - y) * (x - y);
            norm += x * x;
        }
        if norm > 0.0 { err / norm } else { 0.0 }
    };
    #[allow(clippy::cast_precision_loss)]
    let layers = src.len().max(1) as f32;
    for (c, &p) in positions.iter().enumerate() {
        let Ok(p) = usize::try_from(p) else { continue };
        let total: f32 = src
            .iter()
            .zip(&again)
            .map(|((k, v), (k2, v2))| rel(*k, k2, c) + rel(*v, v2, c))
            .sum();
        scores[p] = total / (2.0 * layers);
    }
    Ok(scores)
}

/// Spans closer than this are merged (re-reading a gap of two costs less than another span's
/// batch slot, and a fact split by it comes whole).
const MERGE_GAP: usize = 2;
/// Spans beyond this count are merged across their smallest gaps: each span is one scratch
/// sequence of a recompute batch.
const MAX_SPANS: usize = 48;

/// The positions to re-read, as ordered, disjoint ranges inside `lo .. hi` (the cache between
/// the natively re-read head and tail). Positions from `always` on are always re-read: the
/// observation window (the question) and whatever came after it — the window's own mass is
/// mostly its attention to itself, and the question is what the answer reads next. Besides
/// them, `ceil(fraction × (always − lo))` positions are chosen among the earlier ones (a
/// share of the context before the question, so a short context still gets its facts
/// re-read, not only its question): by
/// `scores[p]`, position `p`'s attention mass ([`SelectRule::Attention`]; missing entries
/// count as 0), after a max-pool over each position and its neighbours (SnapKV's clustering),
/// or by chance from `seed` ([`SelectRule::Random`]); each chosen position is widened by
/// `neighbours` each side, then spans closer than two positions are merged. With
/// [`Unit::Sentence`] each chosen position brings its sentence (by `text.ends`, see
/// [`Sentences`]; without them, a [`MAX_SENTENCE`] window) and `fraction` bounds the
/// positions re-read in all; with [`TokenRecompute::distinct`] a sentence whose copy (same
/// [`Sentences::keys`]) is already chosen is passed over.
#[must_use]
pub fn select_spans(
    scores: &[f32],
    text: &Sentences,
    lo: usize,
    hi: usize,
    always: usize,
    setting: &TokenRecompute,
    seed: u64,
) -> Vec<Range<usize>> {
    if hi <= lo || setting.fraction <= 0.0 {
        return Vec::new();
    }
    let always = always.clamp(lo, hi);
    let hi_sel = always;
    let n = hi_sel - lo;
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let want = ((setting.fraction.min(1.0) * n as f64).ceil() as usize)
        .max(setting.min_positions)
        .min(n);
    let score = |p: usize| scores.get(p).copied().unwrap_or(0.0);
    let k = setting.neighbours;
    let end_all = hi;
    let hi = hi_sel;
    let mut order: Vec<usize> = (lo..hi).collect();
    match setting.rule {
        SelectRule::Attention | SelectRule::Residual => {
            let pooled: Vec<f32> = (lo..hi)
                .map(|p| {
                    (p.saturating_sub(k).max(lo)..(p + k + 1).min(hi))
                        .map(score)
                        .fold(f32::MIN, f32::max)
                })
                .collect();
            // Highest pooled mass first; ties keep position order (stable sort).
            order.sort_by(|&a, &b| pooled[b - lo].total_cmp(&pooled[a - lo]));
        }
        SelectRule::Random => {
            use rand::SeedableRng;
            use rand::seq::SliceRandom;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            order.shuffle(&mut rng);
        }
    }
    let mut chosen = vec![false; n];
    match setting.unit {
        Unit::Position => {
            for &p in order.iter().take(want) {
                for q in p.saturating_sub(k).max(lo)..(p + k + 1 + setting.follow).min(hi) {
                    chosen[q - lo] = true;
                }
            }
        }
        Unit::Sentence => {
            let mut taken = 0;
            let mut seen = std::collections::HashSet::new();
            for &p in &order {
                if taken >= want {
                    break;
                }
                if chosen[p - lo] {
                    continue;
                }
                let sentence = sentence_around(&text.ends, p, lo, hi);
                if setting.distinct
                    && let Some(key) = text.key(p)
                    && !seen.insert(key)
                {
                    continue;
                }
                for q in sentence {
                    if !chosen[q - lo] {
                        chosen[q - lo] = true;
                        taken += 1;
                    }
                }
            }
        }
    }
    let mut spans: Vec<Range<usize>> = Vec::new();
    for (i, &c) in chosen.iter().enumerate() {
        if !c || want == 0 {
            continue;
        }
        let p = lo + i;
        match spans.last_mut() {
            Some(last) if p <= last.end + MERGE_GAP => last.end = p + 1,
            _ => spans.push(p..p + 1),
        }
    }
    if always < end_all {
        match spans.last_mut() {
            Some(last) if always <= last.end + MERGE_GAP => last.end = end_all,
            _ => spans.push(always..end_all),
        }
    }
    #[allow(clippy::cast_precision_loss)]
    if setting.whole_from > 0.0
        && covered(&spans) as f64 >= setting.whole_from * (end_all - lo) as f64
    {
        return std::iter::once(lo..end_all).collect();
    }
    while spans.len() > MAX_SPANS {
        let (i, _) = spans
            .windows(2)
            .enumerate()
            .map(|(i, w)| (i, w[1].start - w[0].end))
            .min_by_key(|&(_, gap)| gap)
            .expect("more than one span");
        let next = spans.remove(i + 1);
        spans[i].end = next.end;
    }
    spans
}

/// Positions covered by `spans`.
#[must_use]
pub fn covered(spans: &[Range<usize>]) -> usize {
    spans.iter().map(ExactSizeIterator::len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(fraction: f64, rule: SelectRule) -> TokenRecompute {
        TokenRecompute {
            fraction,
            rule,
            window: 32,
            neighbours: 1,
            follow: 0,
            unit: Unit::Position,
            min_positions: 0,
            whole_from: 0.0,
            rest: Rest::Projected,
            distinct: false,
        }
    }

    #[test]
    fn sentences_end_at_line_breaks_and_stops_before_a_space() {
        let pieces = [
            "The", " port", " is", " 7", "3", "1", "9", ".", " Version", " 2", ".", "4", "1", "\n",
            "Next", "?",
        ];
        let ends = sentence_ends(&pieces);
        let at: Vec<usize> = (0..pieces.len()).filter(|&i| ends[i]).collect();
        // "." after 9 ends (next is " Version"), the one inside "2.41" does not, "\n" does,
        // and the last "?" does (nothing follows).
        assert_eq!(at, vec![7, 13, 15]);
    }

    /// 80 positions in three sentences ending at 9, 29 and 59 (then the question), the
    /// heaviest attention on 20, the next on 45.
    fn three_sentences() -> (Sentences, Vec<f32>) {
        let mut ends = vec![false; 80];
        ends[9] = true;
        ends[29] = true;
        ends[59] = true;
        let mut scores = vec![0.0f32; 80];
        scores[20] = 5.0;
        scores[45] = 1.0;
        (Sentences::from_ends(ends), scores)
    }

    #[test]
    fn a_sentence_comes_whole_and_the_budget_bounds_the_total() {
        // Three sentences: 0..10, 10..30, 30..60; the question attends to position 20, inside
        // the middle one, whose value (position 12) stands before the words it attends to.
        let (ends, scores) = three_sentences();
        let set = TokenRecompute::sentences(0.3);
        let s = select_spans(&scores, &ends, 0, 80, 60, &set, 0);
        assert_eq!(s, vec![10..30, 60..80], "{s:?}");
        // A larger share takes the next sentence too.
        let s = select_spans(
            &scores,
            &ends,
            0,
            80,
            60,
            &TokenRecompute::sentences(0.5),
            0,
        );
        assert_eq!(s, vec![10..80], "{s:?}");
        // Position unit with the same share misses the value before the attended words.
        let s = select_spans(
            &scores,
            &ends,
            0,
            80,
            60,
            &setting(0.01, SelectRule::Attention),
            0,
        );
        assert!(!s.iter().any(|r| r.contains(&12)), "{s:?}");
    }

    #[test]
    fn the_floor_takes_more_than_the_share_of_a_short_context() {
        // Same three sentences; a share of 0.05 (3 positions) would stop after the first
        // sentence it takes, the floor of 40 takes the next sentence by attention too.
        let (ends, scores) = three_sentences();
        let share = TokenRecompute::sentences(0.05);
        let s = select_spans(&scores, &ends, 0, 80, 60, &share, 0);
        assert_eq!(s, vec![10..30, 60..80], "{s:?}");
        let floor = TokenRecompute {
            min_positions: 40,
            ..share
        };
        let s = select_spans(&scores, &ends, 0, 80, 60, &floor, 0);
        assert_eq!(s, vec![10..80], "{s:?}");
        // A floor larger than the context takes all of it, no more.
        let all = TokenRecompute {
            min_positions: 1000,
            ..share
        };
        let s = select_spans(&scores, &ends, 0, 80, 60, &all, 0);
        assert_eq!(s, vec![0..80], "{s:?}");
    }

    #[test]
    fn a_choice_covering_half_the_cache_re_reads_all_of_it() {
        // The floor's choice (10..80, 70 of 80 positions) covers more than half: everything
        // between the head and the tail is re-read; the share's (40 of 80) half exactly; a
        // choice below half is left as it is.
        let (ends, scores) = three_sentences();
        let whole = |min_positions| TokenRecompute {
            min_positions,
            whole_from: 0.5,
            ..TokenRecompute::sentences(0.05)
        };
        assert_eq!(
            select_spans(&scores, &ends, 2, 80, 60, &whole(40), 0),
            vec![2..80]
        );
        assert_eq!(
            select_spans(&scores, &ends, 0, 80, 60, &whole(0), 0),
            vec![0..80],
            "10..30 and 60..80: 40 of 80"
        );
        let short = select_spans(&scores, &ends, 0, 80, 70, &whole(0), 0);
        assert_eq!(short, vec![10..30, 70..80], "30 of 80: below half");
        assert_eq!(TokenRecompute::default_size().whole_from, 0.5);
    }

    #[test]
    fn a_long_sentence_is_cut_around_the_chosen_position() {
        let ends = Sentences::from_ends(vec![false; 300]);
        let mut scores = vec![0.0f32; 300];
        scores[150] = 1.0;
        let s = select_spans(
            &scores,
            &ends,
            0,
            300,
            300,
            &TokenRecompute::sentences(0.01),
            0,
        );
        // 149 is first of the tied pool; a quarter of 48 before it, the rest after.
        assert_eq!(s, vec![137..185], "{s:?}");
    }

    #[test]
    fn follow_takes_the_positions_after_a_chosen_one() {
        let mut scores = vec![0.0f32; 100];
        scores[30] = 1.0;
        let s = select_spans(
            &scores,
            &Sentences::default(),
            0,
            100,
            100,
            &TokenRecompute {
                follow: 5,
                ..setting(0.01, SelectRule::Attention)
            },
            0,
        );
        // The max-pool makes 29, 30 and 31 tie; the first in position order (29) is chosen,
        // with one neighbour before it and one plus five after.
        assert_eq!(s, vec![28..36]);
    }

    #[test]
    fn attention_picks_the_heaviest_positions_with_their_neighbours() {
        let mut scores = vec![0.1f32; 100];
        scores[40] = 5.0;
        scores[70] = 3.0;
        let s = select_spans(
            &scores,
            &Sentences::default(),
            4,
            96,
            96,
            &setting(0.02, SelectRule::Attention),
            0,
        );
        // 2 positions wanted; the pool makes 39..=41 tie with 40, so the heaviest cluster
        // (around 40) is chosen and widened by one neighbour.
        assert!(s.iter().any(|r| r.contains(&40)), "{s:?}");
        assert!(s.iter().all(|r| r.start >= 4 && r.end <= 96));
        let s = select_spans(
            &scores,
            &Sentences::default(),
            4,
            96,
            96,
            &setting(0.1, SelectRule::Attention),
            0,
        );
        assert!(s.iter().any(|r| r.contains(&40)) && s.iter().any(|r| r.contains(&70)));
    }

    #[test]
    fn spans_are_ordered_disjoint_and_bounded() {
        let scores: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32).collect();
        for rule in [SelectRule::Attention, SelectRule::Random] {
            for frac in [0.01, 0.15, 0.5, 1.0] {
                let s = select_spans(
                    &scores,
                    &Sentences::default(),
                    4,
                    480,
                    480,
                    &setting(frac, rule),
                    7,
                );
                assert!(s.len() <= MAX_SPANS);
                assert!(s.windows(2).all(|w| w[0].end + MERGE_GAP < w[1].start));
                assert!(
                    s.iter()
                        .all(|r| r.start >= 4 && r.end <= 480 && !r.is_empty())
                );
                #[allow(clippy::cast_precision_loss)]
                let at_least = (frac * 476.0).ceil() as usize;
                assert!(covered(&s) >= at_least.min(476), "{rule:?} {frac}");
            }
        }
        assert_eq!(
            select_spans(
                &scores,
                &Sentences::default(),
                4,
                480,
                480,
                &setting(1.0, SelectRule::Random),
                1
            ),
            vec![4..480]
        );
    }

    #[test]
    fn the_window_and_what_follows_are_always_reread_within_the_budget() {
        let mut scores = vec![0.0f32; 200];
        scores[50] = 9.0;
        scores[190] = 100.0; // inside the window: ignored as a score
        let s = select_spans(
            &scores,
            &Sentences::default(),
            4,
            200,
            160,
            &setting(0.25, SelectRule::Attention),
            0,
        );
        assert_eq!(s.last(), Some(&(160..200)), "{s:?}");
        assert!(s.iter().any(|r| r.contains(&50)), "{s:?}");
        // A quarter of the 156 positions before the window (39, widened), and the window.
        assert!(
            covered(&s) >= 40 + 39 && covered(&s) <= 40 + 39 * 3,
            "{s:?}"
        );
        // A short context still gets a position chosen before its window.
        let s = select_spans(
            &scores,
            &Sentences::default(),
            4,
            200,
            160,
            &setting(0.005, SelectRule::Attention),
            0,
        );
        assert_eq!(s.len(), 2, "{s:?}");
        assert!(s[0].contains(&50) && s[1] == (160..200), "{s:?}");
    }

    #[test]
    fn nothing_to_choose_is_nothing_chosen() {
        assert!(
            select_spans(
                &[],
                &Sentences::default(),
                10,
                10,
                10,
                &setting(0.2, SelectRule::Attention),
                0
            )
            .is_empty()
        );
        assert!(
            select_spans(
                &[1.0; 8],
                &Sentences::default(),
                0,
                8,
                8,
                &setting(0.0, SelectRule::Attention),
                0
            )
            .is_empty()
        );
    }

    #[test]
    fn random_depends_on_the_seed_only() {
        let a = select_spans(
            &[],
            &Sentences::default(),
            0,
            300,
            300,
            &setting(0.1, SelectRule::Random),
            3,
        );
        let b = select_spans(
            &[],
            &Sentences::default(),
            0,
            300,
            300,
            &setting(0.1, SelectRule::Random),
            3,
        );
        let c = select_spans(
            &[],
            &Sentences::default(),
            0,
            300,
            300,
            &setting(0.1, SelectRule::Random),
            4,
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn copies_of_a_sentence_share_a_key_whatever_white_space_opens_them() {
        let pieces = [
            "Sign", " in", ".", "\n\n", "Port", " 7", "7", "1", "0", ".", " Sign", " in", ".",
            "\n\n", "Sign", " in", ".",
        ];
        let text = Sentences::of(&pieces);
        // Sentences: 0..3, 3..4 (the break), 4..10, 10..13, 13..14, 14..17.
        assert_eq!(text.keys[0], text.keys[12], "{:?}", text.keys);
        assert_eq!(text.keys[0], text.keys[16]);
        assert_eq!(text.keys[3], text.keys[13]);
        assert_ne!(text.keys[0], text.keys[5]);
        assert!(text.keys[4..10].iter().all(|&k| k == text.keys[4]));
    }

    /// A context of one boilerplate sentence (ten positions) repeated ten times, with the
    /// fact's sentence (positions 50..60) standing in for the sixth copy; the question's
    /// attention gives every copy more mass than the fact's sentence.
    fn repeated() -> (Sentences, Vec<f32>) {
        let mut ends = vec![false; 110];
        let mut keys = vec![0u64; 110];
        for s in 0..10 {
            ends[s * 10 + 9] = true;
            keys[s * 10..s * 10 + 10].fill(if s == 5 { 2 } else { 1 });
        }
        let mut scores = vec![0.0f32; 110];
        let mut copy = 2.0f32;
        for s in 0..10 {
            // Later copies a little heavier, as a question's attention leans to recent text.
            copy += 0.01;
            scores[s * 10 + 3] = if s == 5 { 1.0 } else { copy };
        }
        (Sentences { ends, keys }, scores)
    }

    #[test]
    fn distinct_reads_one_copy_of_a_repeated_sentence_and_then_the_fact() {
        let (text, scores) = repeated();
        let by_mass = TokenRecompute::sentences(0.2);
        // Twenty positions by mass alone: the two heaviest copies, not the fact.
        let s = select_spans(&scores, &text, 0, 110, 100, &by_mass, 0);
        assert_eq!(s, vec![80..110], "{s:?}");
        // Distinct: the heaviest copy, then the fact's sentence.
        let distinct = TokenRecompute {
            distinct: true,
            ..by_mass
        };
        let s = select_spans(&scores, &text, 0, 110, 100, &distinct, 0);
        assert_eq!(s, vec![50..60, 90..110], "{s:?}");
        // Without keys every sentence is distinct: as by mass alone.
        let s = select_spans(
            &scores,
            &Sentences::from_ends(text.ends.clone()),
            0,
            110,
            100,
            &distinct,
            0,
        );
        assert_eq!(s, vec![80..110], "{s:?}");
        assert!(TokenRecompute::default_size().distinct);
    }

    #[test]
    fn rules_parse_by_name() {
        assert_eq!("attention".parse::<SelectRule>(), Ok(SelectRule::Attention));
        assert_eq!("random".parse::<SelectRule>(), Ok(SelectRule::Random));
        assert_eq!("residual".parse::<SelectRule>(), Ok(SelectRule::Residual));
        assert!("mass".parse::<SelectRule>().is_err());
        for u in [Unit::Position, Unit::Sentence] {
            assert_eq!(u.name().parse::<Unit>(), Ok(u));
        }
        assert!("paragraph".parse::<Unit>().is_err());
    }
}
