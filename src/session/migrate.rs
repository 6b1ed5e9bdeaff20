//! One migration between two tokens, as data flows: export the source's sequence state →
//! parse it into per-layer K/V with positions → project every destination layer (depth remap,
//! RoPE sandwich, map; in parallel over layers) → serialize in the destination's layout →
//! import → decode the token sampled last on the destination, whose logits are the first the
//! destination produces.
//!
//! [`transplant`] is Molt's way (condition D); [`reprefill`] is the conventional one
//! (condition C: re-read prompt and generated text on the destination) through the same
//! timing record, so the two are measured by the same clock from the same decision point.
//! Both leave the source untouched: freeing or parking it is the caller's choice.

use std::borrow::Cow;
use std::time::Instant;

use crate::engine::{Context, ContextConfig, PartialForward, Span, Token};
use crate::kv::{CacheType, KvSnapshot, KvStream, LayerKv};
use crate::transplant::anchor::Anchor;
use crate::transplant::hidden::HiddenMap;
use crate::transplant::project::project;
use crate::transplant::projector::Projector;

use super::SessionError;
use super::error::{MigrationCause, MigrationError, MigrationStep};

/// Where the time of one switch went, ms. `cost_ms` is the decision-to-first-logits total.
///
/// Serialized flattened inside [`super::SwitchInfo`], so the field order and the skipped
/// zeros here are the switch record's JSON keys: keep them as they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SwitchTimings {
    /// The whole switch, decision to first logits.
    pub cost_ms: f64,
    /// Loading the destination's weights, paid by every strategy and reported apart from
    /// `cost_ms`. The session fills it; the functions here get a loaded destination and leave
    /// it 0.
    pub load_ms: f64,
    /// Source state export.
    pub export_ms: f64,
    /// Parse + projection + serialization in the destination's layout.
    pub project_ms: f64,
    /// Destination state import.
    pub import_ms: f64,
    /// The destination's first decode (one token for a transplant, the whole context for a
    /// re-prefill).
    pub first_decode_ms: f64,
    /// Selective top-k recompute, inside `cost_ms`: mapping the boundary hidden states, loading
    /// the destination's last-k model, running it over every cached position and exporting
    /// its K/V (0 when the switch projected every layer).
    #[serde(default)]
    pub recompute_ms: f64,
    /// Destination blocks recomputed natively (`None`: all projected).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk: Option<usize>,
    /// Tail recompute: the last positions re-read natively on the destination after the
    /// import, inside `first_decode_ms` (0: every position kept as projected). Not written to
    /// the switch record, whose keys predate it (the arm's options name the tail).
    #[serde(default, skip_serializing)]
    pub tail: usize,
    /// Head re-read: the first positions computed natively on the destination and spliced
    /// over their projected cells (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub head: usize,
    /// Of `head`, the positions taken from the destination's shipped anchor (its native state
    /// of the template's opening) rather than decoded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub head_anchored: usize,
    /// Time of the head re-read (anchor import, decode, export), inside `cost_ms`; 0 when the
    /// head's few unanchored positions were decoded in the switch's first batch
    /// ([`transplant_staged`]: then in `first_decode_ms`, the anchor's rows spliced in
    /// `project_ms`).
    #[serde(default, skip_serializing_if = "is_zero_f")]
    pub head_ms: f64,
    /// Of `head`, the unanchored positions left projected at the switch and read natively
    /// with the next token ([`super::SessionOptions::head_later`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub head_later: usize,
    /// Selective token recompute: positions re-read natively on the destination over the
    /// imported cache, chosen by the source's attention (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub recomputed: usize,
    /// The spans those positions formed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spans: usize,
    /// Time of the selective recompute, inside `first_decode_ms`'s neighbour: after the import,
    /// before the first decode; inside `cost_ms`.
    #[serde(default, skip_serializing_if = "is_zero_f")]
    pub spans_ms: f64,
    /// Cells carried (transplant) or tokens re-read (re-prefill).
    pub cells: usize,
    /// FLOPs the projection spent (0 for a re-prefill, whose cost is `flops_reprefill`). In a
    /// [`super::SwitchInfo`], the switch's own FLOPs ([`switch_flops`]): the projection plus
    /// every position decoded natively on the destination (head, tail, recomputed tokens, the
    /// first decode).
    pub flops: f64,
    /// Where `load_ms` went when the destination was loaded at the switch (`None`: it was
    /// loaded already, or came off standby).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_parts: Option<super::LoadParts>,
    /// The destination came off standby ([`super::StandbyRung`]): `load_ms` is then only the
    /// time its weight pages took to be mapped back in.
    #[serde(default, skip_serializing_if = "is_false")]
    pub from_standby: bool,
    /// A switch up prepared in the background ([`super::SessionOptions::prepare_up`]): how
    /// long the destination took to load while the source went on decoding, ms (0: not
    /// prepared). `load_ms` is then 0: nobody waited for the load.
    #[serde(default, skip_serializing_if = "is_zero_f")]
    pub prepared_ms: f64,
    /// Tokens the source decoded while the destination loaded in the background.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prepared_tokens: usize,
    /// A switch up carried in the background (see `super::prepare`): the time the loading
    /// thread spent projecting, importing and re-reading (`project_ms`, `import_ms`,
    /// `head_ms`, `spans_ms` are its parts) while the source went on answering, ms. `cost_ms`
    /// is then only what the answer waited for: `caught_up` tokens and the sampled one
    /// decoded on the destination.
    #[serde(default, skip_serializing_if = "is_zero_f")]
    pub carried_ms: f64,
    /// Tokens the destination of a carried switch re-read natively to catch up with the
    /// source, which had written them after the carry began.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub caught_up: usize,
    /// A sparse read ([`read_sparse`]): nothing was projected; the destination read the head,
    /// the `recomputed` positions and the tail natively, and the `cells - head - recomputed -
    /// tail` others are absent until something reads them.
    #[serde(default, skip_serializing_if = "is_false")]
    pub sparse: bool,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_false(b: &bool) -> bool {
    !*b
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero_f(x: &f64) -> bool {
    *x == 0.0
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// `dst` emptied after a failed step of a switch from `from`, and the error naming both.
fn cleared(dst: &mut Context, from: &str, source: MigrationError) -> SessionError {
    dst.clear();
    SessionError::Migration {
        from: from.to_string(),
        to: dst.model().name().to_string(),
        source,
    }
}

fn mig(from: &Context, to: &Context, source: MigrationError) -> SessionError {
    SessionError::Migration {
        from: from.model().name().to_string(),
        to: to.model().name().to_string(),
        source,
    }
}

/// Builds the destination's cache from the source's through `projector`, without touching
/// either context: the pure middle of a transplant, exposed for tests and the benchmarks.
///
/// # Errors
/// A [`MigrationError`] at [`MigrationStep::SourceState`] if the blob does not parse,
/// [`MigrationStep::Projection`] if the projector does not fit the cache's shapes, or
/// [`MigrationStep::DestinationState`] if the result cannot be serialized.
pub fn project_blob(
    blob: &[u8],
    projector: &Projector,
    dst_cache: CacheType,
) -> Result<(Vec<u8>, f64, usize), MigrationError> {
    project_blob_with(blob, projector, dst_cache, None, None)
}

/// [`project_blob`], with the destination's last layers taken from `recomputed` (a blob of
/// the last-k model's state, see [`recompute_top`]) instead of being projected, and the rows
/// of the positions in `native_head` (a blob of the destination's own state over the
/// history's first tokens) taken from it at every layer. Rows are matched by position, so
/// the caches may hold their cells in any slot order.
///
/// # Errors
/// As [`project_blob`]; also when `recomputed` does not hold exactly the source's positions,
/// or `native_head` holds a position the source does not or has other shapes.
pub fn project_blob_with(
    blob: &[u8],
    projector: &Projector,
    dst_cache: CacheType,
    recomputed: Option<&[u8]>,
    native_head: Option<&[u8]>,
) -> Result<(Vec<u8>, f64, usize), MigrationError> {
    project_blob_spliced(
        blob,
        projector,
        dst_cache,
        recomputed,
        native_head.map(|h| (h, None)),
    )
    .and_then(
        |(bytes, flops, cells, spliced)| match (native_head, spliced) {
            (Some(_), Err(e)) => Err(e),
            _ => Ok((bytes, flops, cells)),
        },
    )
}

/// A projected state blob, its FLOPs and cells, and whether the native head was spliced in.
pub type Spliced = (Vec<u8>, f64, usize, Result<(), MigrationError>);

/// [`project_blob_with`] whose native head is `(blob, end)`: the blob's rows of positions
/// below `end` (all of them for `None`) are spliced over the projection. A head that does not
/// fit is not an error here: the projection is returned with the splice's error beside it
/// (`Ok(())` when spliced or no head was given), so a caller holding the head's tokens can
/// decode them instead.
///
/// # Errors
/// As [`project_blob_with`], but for the head.
pub(crate) fn project_blob_spliced(
    blob: &[u8],
    projector: &Projector,
    dst_cache: CacheType,
    recomputed: Option<&[u8]>,
    native_head: Option<(&[u8], Option<i32>)>,
) -> Result<Spliced, MigrationError> {
    // A precision route's maps are applied to the blob where it lies (the same bits as below).
    if recomputed.is_none() {
        let done = crate::transplant::in_place::project(blob, projector, dst_cache).map_err(
            |e| match e {
                crate::transplant::in_place::InPlaceError::Blob(e) => {
                    MigrationStep::SourceState.fail(e)
                }
                crate::transplant::in_place::InPlaceError::Projection(e) => {
                    MigrationStep::Projection.fail(e)
                }
            },
        )?;
        if let Some((mut bytes, layout, flops)) = done {
            let spliced = match native_head {
                Some((hb, end)) => {
                    let step = MigrationStep::NativeHeadState;
                    KvSnapshot::parse_single_stream(hb)
                        .map_err(|e| step.fail(e))
                        .and_then(|(_, h)| {
                            crate::transplant::in_place::splice(&mut bytes, &layout, &h, end)
                                .map_err(|e| step.fail(e))
                        })
                }
                None => Ok(()),
            };
            #[allow(clippy::cast_precision_loss)] // FLOP counts far below 2^52
            return Ok((bytes, flops as f64, layout.positions.len(), spliced));
        }
    }
    project_blob_general(blob, projector, dst_cache, recomputed, native_head)
}

/// `project_blob_spliced` the general way, whatever the route: the blob parsed into f32
/// arrays, projected ([`project`]), the recomputed layers and the head spliced in, and a new
/// blob written in the destination's layout. What a precision route projected in place
/// ([`crate::transplant::in_place`]) must equal.
///
/// # Errors
/// As `project_blob_spliced`.
pub fn project_blob_general(
    blob: &[u8],
    projector: &Projector,
    dst_cache: CacheType,
    recomputed: Option<&[u8]>,
    native_head: Option<(&[u8], Option<i32>)>,
) -> Result<Spliced, MigrationError> {
    let (seq_id, stream) =
        KvSnapshot::parse_single_stream(blob).map_err(|e| MigrationStep::SourceState.fail(e))?;
    let positions = stream.positions();
    let views: Vec<_> = stream
        .layers
        .iter()
        .map(|l| (l.k.view(), l.v.view()))
        .collect();
    let (layers, stats) =
        project(projector, &views, &positions).map_err(|e| MigrationStep::Projection.fail(e))?;
    let t = dst_cache;
    let mut out = KvStream {
        cells: stream.cells,
        v_trans: stream.v_trans,
        n_rot_k: 0,
        n_rot_v: 0,
        has_v: true,
        layers: layers
            .into_iter()
            .map(|(k, v)| LayerKv {
                k,
                v,
                k_type: t,
                v_type: t,
            })
            .collect(),
    };
    if let Some(rb) = recomputed {
        // The last-k model's layers replace the destination's last k, every position.
        let step = MigrationStep::RecomputedState;
        let (_, r) = KvSnapshot::parse_single_stream(rb).map_err(|e| step.fail(e))?;
        if r.layers.is_empty() || r.n_cells() != out.n_cells() {
            return Err(step.fail(MigrationCause::RecomputedPositions {
                positions: r.n_cells(),
                layers: r.layers.len(),
                cached: out.n_cells(),
            }));
        }
        let first = out.layers.len().saturating_sub(r.layers.len());
        out.overwrite_rows_by_position(&r, first)
            .map_err(|e| step.fail(e))?;
    }
    let spliced = match native_head {
        Some((hb, end)) => splice_head(&mut out, hb, end),
        None => Ok(()),
    };
    let bytes = KvSnapshot::from_single_stream(seq_id, out)
        .to_bytes()
        .map_err(|e| MigrationStep::DestinationState.fail(e))?;
    #[allow(clippy::cast_precision_loss)] // FLOP counts far below 2^52
    Ok((bytes, stats.flops() as f64, positions.len(), spliced))
}

/// Splices the rows of `head` (a state blob of the destination's own, over the history's first
/// positions) below `end` over `out`'s, at every layer; `out` is unchanged on failure.
/// Exact values: under causal attention a prefix's K/V depend on the prefix alone.
fn splice_head(out: &mut KvStream, head: &[u8], end: Option<i32>) -> Result<(), MigrationError> {
    let step = MigrationStep::NativeHeadState;
    let (_, mut h) = KvSnapshot::parse_single_stream(head).map_err(|e| step.fail(e))?;
    if h.layers.len() != out.layers.len() {
        return Err(step.fail(MigrationCause::HeadLayers {
            layers: h.layers.len(),
            expected: out.layers.len(),
        }));
    }
    if let Some(end) = end {
        h.keep_positions_below(end);
    }
    out.overwrite_rows_by_position(&h, 0)
        .map_err(|e| step.fail(e))?;
    Ok(())
}

/// The history a Molt switch re-reads natively on the destination, at both ends of the cache:
/// `head` (the first tokens: the attention sink and, in a chat, the template's opening —
/// exact under causal attention, and where projection errors cost the most attention mass)
/// and `tail` (the last tokens, nearest the next one). Empty slices: project every position.
/// The part of `head` that `anchor` (the destination's shipped native state of the template's
/// opening) covers is spliced from it instead of decoded.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reread<'a> {
    /// The history's first tokens (positions `0 .. head.len()`).
    pub head: &'a [Token],
    /// The history's last tokens.
    pub tail: &'a [Token],
    /// The destination's anchor, if one is shipped.
    pub anchor: Option<&'a Anchor>,
    /// Positions in between re-read natively after the import (selective token recompute),
    /// ordered and apart, none inside `head` or `tail`.
    pub spans: &'a [Span<'a>],
}

impl Reread<'_> {
    /// Nothing re-read: every position projected.
    pub const NONE: Reread<'static> = Reread {
        head: &[],
        tail: &[],
        anchor: None,
        spans: &[],
    };
}

/// The destination's own state over `head` (positions `0 .. head.len()`), and how many of
/// those positions came from `anchor`: the anchor's state imported and cut to the prefix it
/// shares with `head`, the rest decoded after it with no logits; without a usable anchor (none,
/// other tokens, or a state this context cannot import, e.g. another cache type), the whole
/// head decoded. `dst` is left holding that state (the caller imports over it).
fn native_head_state<'a>(
    dst: &mut Context,
    head: &[Token],
    anchor: Option<&'a Anchor>,
) -> Result<(Cow<'a, [u8]>, usize), MigrationError> {
    let mut covered = anchor.map_or(0, |a| a.covers(head));
    match anchor {
        Some(a) if covered == a.tokens.len() && covered == head.len() => {
            return Ok((Cow::Borrowed(&a.state), covered));
        }
        Some(a) if covered > 0 && dst.import_state(&a.state).is_ok() => dst.truncate(covered),
        // Rewind rather than clear: the head's decode attends only to the cells of the
        // positions it writes, so the old cells' data need not be zeroed (the import after
        // the projection clears the cache anyway).
        _ => {
            covered = 0;
            dst.truncate(0);
        }
    }
    dst.decode_cache_only(&head[covered..])
        .map_err(|e| MigrationStep::HeadReread.fail(e))?;
    let blob = dst
        .export_state()
        .map_err(|e| MigrationStep::HeadExport.fail(e))?;
    Ok((Cow::Owned(blob), covered))
}

/// What selective top-k recompute needs at a switch: the source's boundary hidden states of
/// every cached position, the map into the destination's residual stream, and where the
/// destination's full model lives (its last-k cut is loaded from beside it).
pub struct Recompute<'a> {
    /// The source's `l_out-<map.src_layer>` rows, `[n_past][n_embd_src]` in position order.
    pub hidden: ndarray::ArrayView2<'a, f32>,
    /// Source → destination hidden map (`None`: `hidden` is already the destination's own
    /// boundary state, as in the verification tests).
    pub map: Option<&'a HiddenMap>,
    /// Blocks to recompute.
    pub k: usize,
    /// The destination's GGUF file.
    pub dst_path: &'a std::path::Path,
    /// Its sha256.
    pub dst_sha256: &'a str,
    /// Its block count.
    pub dst_layers: usize,
}

/// Runs the destination's last `k` blocks over the mapped hidden states at positions
/// `0 .. n`, returning the state blob of those `k` layers (see [`PartialForward::run`]).
///
/// # Errors
/// A [`MigrationError`] naming the step that failed: the hidden map, loading the last-k
/// model, or running it.
pub fn recompute_top(r: &Recompute<'_>, config: ContextConfig) -> Result<Vec<u8>, MigrationError> {
    let mapped;
    let hidden = match r.map {
        Some(m) => {
            mapped = m
                .apply(r.hidden)
                .map_err(|e| MigrationStep::HiddenMap.fail(e))?;
            mapped.view()
        }
        None => r.hidden.view(),
    };
    let k = r.k;
    let n = i32::try_from(hidden.nrows()).map_err(|_| {
        MigrationStep::LastKForward { k }.fail(MigrationCause::TooManyPositions(hidden.nrows()))
    })?;
    let positions: Vec<i32> = (0..n).collect();
    let config = ContextConfig {
        n_ctx: config.n_ctx.max(u32::try_from(n).unwrap_or(u32::MAX)),
        ..config
    };
    let mut pf = PartialForward::open(r.dst_path, r.dst_sha256, r.dst_layers, r.k, config)
        .map_err(|e| MigrationStep::LastKModel { k }.fail(e))?;
    pf.run(hidden, &positions)
        .map_err(|e| MigrationStep::LastKForward { k }.fail(e))
}

/// Molt's switch: carry `src`'s cache to `dst` through `projector`, then decode `last` (the
/// token sampled on the source but not yet decoded) on `dst`.
///
/// On success `dst` holds the projected cache plus `last` and its logits are ready; `src` is
/// unchanged. On failure `dst` is left empty and `src` unchanged, so the caller can stay.
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed.
pub fn transplant(
    src: &Context,
    dst: &mut Context,
    projector: &Projector,
    last: Token,
) -> Result<SwitchTimings, SessionError> {
    transplant_with(src, dst, projector, None, Reread::NONE, last)
}

/// [`transplant`] with selective top-k recompute of the destination's last layers and the
/// history's ends re-read natively (see [`transplant_exported`]).
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed.
pub fn transplant_with(
    src: &Context,
    dst: &mut Context,
    projector: &Projector,
    recompute: Option<&Recompute<'_>>,
    reread: Reread<'_>,
    last: Token,
) -> Result<SwitchTimings, SessionError> {
    let t0 = Instant::now();
    let blob = src
        .export_state()
        .map_err(|e| mig(src, dst, MigrationStep::Export.fail(e)))?;
    let export_ms = ms(t0);
    transplant_exported(
        &Exported {
            blob: &blob,
            n_past: src.n_past(),
            from: src.model().name(),
            export_ms,
        },
        dst,
        projector,
        recompute,
        reread,
        last,
    )
}

/// A source's exported sequence state, for a transplant whose source may already be gone (the
/// shed-first switch frees the source before it maps the destination).
pub struct Exported<'a> {
    /// llama.cpp's state blob of the source's sequence.
    pub blob: &'a [u8],
    /// Positions the source held.
    pub n_past: usize,
    /// The source rung's model name (for errors).
    pub from: &'a str,
    /// Time the export took, ms (the first part of `cost_ms`).
    pub export_ms: f64,
}

/// The rest of a transplant once the source's state is exported: [`carry_exported`], then
/// decode `last` on the destination. `reread.tail` — the history's last tokens, empty for
/// none — is re-read natively after the import: their projected cells are dropped and the
/// destination decodes them with `last` in one batch, so the positions nearest the next token
/// carry the destination's own K/V at every layer (tail recompute). A switch that needs
/// nothing of its destination before the import goes through [`stage`] and
/// [`transplant_staged`] (the head's few unanchored positions then decoded in the first
/// batch). On failure `dst` is left empty.
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed.
pub fn transplant_exported(
    src: &Exported<'_>,
    dst: &mut Context,
    projector: &Projector,
    recompute: Option<&Recompute<'_>>,
    reread: Reread<'_>,
    last: Token,
) -> Result<SwitchTimings, SessionError> {
    let tail = reread.tail;
    let to = dst.model().name().to_string();
    if tail.len() > src.n_past {
        let cause = MigrationCause::LongerThanCache {
            asked: tail.len(),
            cached: src.n_past,
        };
        return Err(SessionError::Migration {
            from: src.from.to_string(),
            to,
            source: MigrationStep::TailRecompute.fail(cause),
        });
    }
    if recompute.is_none()
        && let Some(staged) = stage(src, &to, projector, dst.config().cache_type, reread)?
    {
        return transplant_staged(staged, src.from, dst, last, false);
    }
    let t1 = Instant::now();
    let carried = carry_exported(src, dst, projector, recompute, reread)?;
    let t3 = Instant::now();
    let mut next = Vec::with_capacity(tail.len() + 1);
    next.extend_from_slice(tail);
    next.push(last);
    if !tail.is_empty() {
        dst.truncate(src.n_past - tail.len());
    }
    if let Err(e) = dst.decode(&next) {
        dst.clear();
        return Err(SessionError::Migration {
            from: src.from.to_string(),
            to,
            source: MigrationStep::FirstDecode.fail(e),
        });
    }
    Ok(SwitchTimings {
        first_decode_ms: ms(t3),
        tail: tail.len(),
        cost_ms: src.export_ms + ms(t1),
        ..carried
    })
}

/// The most head positions a switch decodes in its first batch rather than before the
/// projection ([`stage`]): the token that batch decodes attends to them as projected, so only
/// a few are left to it (the real ladder's anchors cover all of the head but its first own
/// token).
pub const HEAD_IN_FIRST_BATCH: usize = 4;

/// A Molt switch's projection made before its destination is at hand: the source's state
/// projected in the destination's layout with the anchor's rows of the head spliced in, and
/// the head's positions no anchor covers, left for the first batch. See [`stage`].
pub struct Staged<'h> {
    bytes: Vec<u8>,
    n_past: usize,
    head_rest: Option<Span<'h>>,
    tail: &'h [Token],
    timings: SwitchTimings,
}

/// What [`transplant_exported`] does before the import, for a switch that needs nothing of
/// its destination there: no span to re-read, no top-k recompute (the caller's to check), and
/// at most [`HEAD_IN_FIRST_BATCH`] head positions left once the anchor's are spliced (all
/// the head's when the anchor does not fit this cache). `None` for any other switch: it
/// re-reads the head on the destination before the projection ([`carry_exported`]). A switch
/// down off standby projects this way while its source is freed, and maps the destination's
/// pages only once the source is gone. `to` names the destination in errors.
///
/// # Errors
/// [`SessionError::Migration`] when the state does not parse or the projector does not fit.
pub fn stage<'h>(
    src: &Exported<'_>,
    to: &str,
    projector: &Projector,
    cache_type: CacheType,
    reread: Reread<'h>,
) -> Result<Option<Staged<'h>>, SessionError> {
    let Reread {
        head,
        tail,
        anchor,
        spans,
    } = reread;
    if !spans.is_empty() || tail.len() > src.n_past || head.len() > src.n_past {
        return Ok(None);
    }
    let rest_end = head.len().min(src.n_past - tail.len());
    let covered = anchor.map_or(0, |a| a.covers(head)).min(rest_end);
    if rest_end - covered > HEAD_IN_FIRST_BATCH {
        return Ok(None);
    }
    let t1 = Instant::now();
    let end = i32::try_from(covered).unwrap_or(i32::MAX);
    let (bytes, flops, cells, spliced) = project_blob_spliced(
        src.blob,
        projector,
        cache_type,
        None,
        anchor
            .filter(|_| covered > 0)
            .map(|a| (a.state.as_slice(), Some(end))),
    )
    .map_err(|source| SessionError::Migration {
        from: src.from.to_string(),
        to: to.to_string(),
        source,
    })?;
    // An anchor that does not fit this cache costs the anchor, not the switch.
    let head_anchored = if spliced.is_ok() { covered } else { 0 };
    let project_ms = ms(t1);
    Ok(Some(Staged {
        bytes,
        n_past: src.n_past,
        head_rest: (head_anchored < rest_end).then(|| Span {
            start: head_anchored,
            tokens: &head[head_anchored..rest_end],
        }),
        tail,
        timings: SwitchTimings {
            export_ms: src.export_ms,
            project_ms,
            head: head.len(),
            head_anchored,
            cells,
            flops,
            cost_ms: src.export_ms + project_ms,
            ..SwitchTimings::default()
        },
    }))
}

/// Finishes a [`stage`]d transplant on `dst`: imports the projected state, then decodes the
/// head's unanchored positions (in scratch sequences over the imported cache) with the tail
/// and `last` in one batch — one pass over the weights instead of two; `last` sees those few
/// positions as projected, every later token their native cells. With `head_later`, those
/// positions are not decoded here: they stay projected, and the caller reads them with the
/// next token (`head_later` in the timings says how many, from `head_anchored`). On failure
/// `dst` is left empty. `from` names the source in errors.
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed.
pub fn transplant_staged(
    staged: Staged<'_>,
    from: &str,
    dst: &mut Context,
    last: Token,
    head_later: bool,
) -> Result<SwitchTimings, SessionError> {
    let Staged {
        bytes,
        n_past,
        head_rest,
        tail,
        timings,
    } = staged;
    let fail = |dst: &mut Context, source: MigrationError| cleared(dst, from, source);
    let t2 = Instant::now();
    if let Err(e) = dst.import_state(&bytes) {
        return Err(fail(dst, MigrationStep::Import.fail(e)));
    }
    drop(bytes);
    if dst.n_past() != n_past {
        let cause = MigrationCause::EndsElsewhere {
            imported: dst.n_past(),
            source_end: n_past,
        };
        return Err(fail(dst, MigrationStep::Import.fail(cause)));
    }
    let import_ms = ms(t2);
    let t3 = Instant::now();
    let mut next = Vec::with_capacity(tail.len() + 1);
    next.extend_from_slice(tail);
    next.push(last);
    if !tail.is_empty() {
        dst.truncate(n_past - tail.len());
    }
    let (now, later) = if head_later {
        (None, head_rest.map_or(0, |h| h.tokens.len()))
    } else {
        (head_rest, 0)
    };
    if let Err(e) = dst.recompute_spans_then_decode(now.as_slice(), &next) {
        return Err(fail(dst, MigrationStep::FirstDecode.fail(e)));
    }
    Ok(SwitchTimings {
        import_ms,
        first_decode_ms: ms(t3),
        head_later: later,
        tail: tail.len(),
        cost_ms: timings.cost_ms + ms(t2),
        ..timings
    })
}

/// A transplant up to the destination's first decode: project the exported state
/// (recomputing the destination's last k layers natively when `recompute` is given), import it
/// into `dst`, and re-read natively what `reread` names besides its tail. `reread.head` — the
/// history's first tokens, empty for none — is decoded on the destination first and its own
/// K/V replace the projected rows of those positions at every layer (head re-read);
/// `reread.spans` are recomputed over the imported cache (selective token recompute). `dst`
/// then holds exactly the source's `n_past` positions and no logits: the caller decodes the
/// next tokens on it. This is how a switch up is carried in the background while the source
/// goes on answering ([`super::SessionOptions::prepare_up`]). `reread.tail` is not read here.
/// On failure `dst` is left empty.
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed.
pub fn carry_exported(
    src: &Exported<'_>,
    dst: &mut Context,
    projector: &Projector,
    recompute: Option<&Recompute<'_>>,
    reread: Reread<'_>,
) -> Result<SwitchTimings, SessionError> {
    let Reread {
        head,
        tail: _,
        anchor,
        spans,
    } = reread;
    let fail = |dst: &Context, source: MigrationError| SessionError::Migration {
        from: src.from.to_string(),
        to: dst.model().name().to_string(),
        source,
    };
    if head.len() > src.n_past {
        let cause = MigrationCause::LongerThanCache {
            asked: head.len(),
            cached: src.n_past,
        };
        return Err(fail(dst, MigrationStep::HeadReread.fail(cause)));
    }
    let t1 = Instant::now();
    let (native_head, head_anchored) = if head.is_empty() {
        (None, 0)
    } else {
        match native_head_state(dst, head, anchor) {
            Ok((blob, covered)) => (Some(blob), covered),
            Err(m) => {
                dst.clear();
                return Err(fail(dst, m));
            }
        }
    };
    let head_ms = if native_head.is_some() { ms(t1) } else { 0.0 };
    let tr = Instant::now();
    let recomputed = match recompute {
        Some(r) => Some(recompute_top(r, dst.config()).map_err(|m| fail(dst, m))?),
        None => None,
    };
    let recompute_ms = if recomputed.is_some() { ms(tr) } else { 0.0 };
    let tp = Instant::now();
    let (bytes, flops, cells) = project_blob_with(
        src.blob,
        projector,
        dst.config().cache_type,
        recomputed.as_deref(),
        native_head.as_deref(),
    )
    .map_err(|m| fail(dst, m))?;
    drop(recomputed);
    drop(native_head);
    let project_ms = ms(tp);
    let t2 = Instant::now();
    dst.import_state(&bytes)
        .map_err(|e| fail(dst, MigrationStep::Import.fail(e)))?;
    drop(bytes);
    let import_ms = ms(t2);
    if dst.n_past() != src.n_past {
        let cause = MigrationCause::EndsElsewhere {
            imported: dst.n_past(),
            source_end: src.n_past,
        };
        dst.clear();
        return Err(fail(dst, MigrationStep::Import.fail(cause)));
    }
    let ts = Instant::now();
    let recomputed = match dst.recompute_spans(spans) {
        Ok(n) => n,
        Err(e) => {
            dst.clear();
            return Err(fail(dst, MigrationStep::SelectiveRecompute.fail(e)));
        }
    };
    let spans_ms = if spans.is_empty() { 0.0 } else { ms(ts) };
    Ok(SwitchTimings {
        export_ms: src.export_ms,
        project_ms,
        import_ms,
        recompute_ms,
        topk: recompute.map(|r| r.k),
        head: head.len(),
        head_anchored,
        head_ms,
        recomputed,
        spans: spans.len(),
        spans_ms,
        cost_ms: src.export_ms + ms(t1),
        load_ms: 0.0,
        cells,
        flops,
        ..SwitchTimings::default()
    })
}

/// A size switch with no projection (a sparse read, [`crate::transplant::select::Rest::LeftOut`]):
/// `dst` is cleared and reads natively the head (its anchored part imported from `anchor`),
/// then `reread.spans` and the tail as one text moved to their own positions
/// ([`Context::decode_sparse`]), then `then` (the token sampled last, or nothing for a carry
/// that stops before it). The positions of the `n_past` cells no span covers hold nothing
/// until a refill reads them. `reread.spans` and the tail together must reach `n_past` (the
/// question and the answer so far are always chosen); `from` names the source in errors. On
/// failure `dst` is left empty.
///
/// # Errors
/// [`SessionError::Migration`] naming the step that failed.
pub fn read_sparse(
    dst: &mut Context,
    reread: Reread<'_>,
    n_past: usize,
    then: &[Token],
    from: &str,
) -> Result<SwitchTimings, SessionError> {
    let fail = |dst: &mut Context, source: MigrationError| cleared(dst, from, source);
    let Reread {
        head,
        tail,
        anchor,
        spans,
    } = reread;
    if head.len() + tail.len() > n_past {
        let cause = MigrationCause::LongerThanCache {
            asked: head.len() + tail.len(),
            cached: n_past,
        };
        return Err(fail(dst, MigrationStep::HeadReread.fail(cause)));
    }
    let t1 = Instant::now();
    let covered = anchor.map_or(0, |a| a.covers(head));
    let head_anchored = match anchor {
        Some(a) if covered > 0 && dst.import_state(&a.state).is_ok() => {
            dst.truncate(covered);
            covered
        }
        _ => {
            dst.clear();
            0
        }
    };
    if let Err(e) = dst.decode_cache_only(&head[head_anchored..]) {
        return Err(fail(dst, MigrationStep::HeadReread.fail(e)));
    }
    let head_ms = ms(t1);
    let ts = Instant::now();
    let mut all: Vec<Span<'_>> = spans.to_vec();
    if !tail.is_empty() {
        all.push(Span {
            start: n_past - tail.len(),
            tokens: tail,
        });
    }
    let recomputed = match dst.decode_sparse(&all, then) {
        Ok(n) => n,
        Err(e) => return Err(fail(dst, MigrationStep::SelectiveRecompute.fail(e))),
    };
    if dst.n_past() != n_past + then.len() {
        let cause = MigrationCause::EndsElsewhere {
            imported: dst.n_past(),
            source_end: n_past,
        };
        return Err(fail(dst, MigrationStep::SelectiveRecompute.fail(cause)));
    }
    Ok(SwitchTimings {
        head: head.len(),
        head_anchored,
        head_ms,
        recomputed: recomputed - tail.len(),
        spans: spans.len(),
        spans_ms: ms(ts),
        tail: tail.len(),
        cost_ms: ms(t1),
        cells: n_past,
        sparse: true,
        ..SwitchTimings::default()
    })
}

/// The conventional switch (condition C): clear `dst` and re-read `history` plus `last` on it.
///
/// # Errors
/// [`SessionError::Migration`] if the destination cannot decode them.
pub fn reprefill(
    src: &Context,
    dst: &mut Context,
    history: &[Token],
    last: Token,
) -> Result<SwitchTimings, SessionError> {
    reprefill_from(src.model().name(), dst, history, last)
}

/// [`reprefill`] for a source that may already be gone: `from` names it in errors.
///
/// # Errors
/// [`SessionError::Migration`] if the destination cannot decode them.
pub fn reprefill_from(
    from: &str,
    dst: &mut Context,
    history: &[Token],
    last: Token,
) -> Result<SwitchTimings, SessionError> {
    let t0 = Instant::now();
    dst.clear();
    let mut all = Vec::with_capacity(history.len() + 1);
    all.extend_from_slice(history);
    all.push(last);
    if let Err(e) = dst.decode(&all) {
        dst.clear();
        return Err(SessionError::Migration {
            from: from.to_string(),
            to: dst.model().name().to_string(),
            source: MigrationStep::Reprefill.fail(e),
        });
    }
    let total = ms(t0);
    Ok(SwitchTimings {
        first_decode_ms: total,
        cost_ms: total,
        cells: all.len(),
        ..SwitchTimings::default()
    })
}

/// FLOPs of a forward pass over `n_tokens` on a rung: 2 × parameters per token for the matrix
/// products plus the attention scores (2 × n_layer × n_embd × context per token, summed over
/// the growing context). The standard estimate, used for "FLOPs avoided".
#[must_use]
pub fn prefill_flops(n_params: u64, n_layer: u64, n_embd: u64, n_tokens: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let (p, l, e, n) = (
        n_params as f64,
        n_layer as f64,
        n_embd as f64,
        n_tokens as f64,
    );
    2.0 * p * n + 2.0 * l * e * n * (n + 1.0)
}

/// FLOPs a Molt switch spent, for "FLOPs avoided": its projection (`timings.flops`) plus
/// every position it decoded natively on the destination — the head's unanchored part, the
/// tail, the recomputed tokens and the token sampled last — each a forward pass attending over
/// up to the `n_past` cells carried. A sparse read ([`read_sparse`]) projects nothing: its
/// FLOPs are a prefill of the positions it read.
#[must_use]
pub fn switch_flops(
    timings: &SwitchTimings,
    n_params: u64,
    n_layer: u64,
    n_embd: u64,
    n_past: u64,
) -> f64 {
    let native =
        timings.head.saturating_sub(timings.head_anchored) + timings.tail + timings.recomputed + 1;
    // A sparse read is a prefill of the positions it reads: they attend only to each other.
    if timings.sparse {
        return prefill_flops(n_params, n_layer, n_embd, native as u64);
    }
    #[allow(clippy::cast_precision_loss)]
    let (p, l, e, m, n) = (
        n_params as f64,
        n_layer as f64,
        n_embd as f64,
        native as f64,
        n_past as f64,
    );
    timings.flops + 2.0 * p * m + 2.0 * l * e * m * (n + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transplant::project::identity_projector;
    use crate::transplant::projector::RungBinding;
    use crate::transplant::rope::RopeSpec;

    /// A blob that does not parse fails at the source-state step, carrying the KV mirror's own
    /// typed error rather than a message.
    #[test]
    fn project_blob_names_the_step_and_keeps_the_cause() {
        let b = RungBinding {
            name: "r".into(),
            file: "r.gguf".into(),
            sha256: "00".into(),
            n_layer: 1,
            n_kv_heads: 1,
            head_dim: 4,
            rope: RopeSpec::neox(4, 1e6),
        };
        let e = project_blob(&[1, 2, 3], &identity_projector(&b), CacheType::F16).unwrap_err();
        assert_eq!(e.step, MigrationStep::SourceState);
        assert!(matches!(e.source, MigrationCause::Kv(_)), "{e:?}");
        assert!(e.to_string().starts_with("source state: "), "{e}");
    }
}
