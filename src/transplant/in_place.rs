//! A precision route's projection applied to the source's state blob itself.
//!
//! On a precision route both rungs are the same model at two precisions: the same layers, the
//! same widths, the same RoPE, and the fitted maps are per-channel (diagonal) or nothing. The
//! general path ([`super::project::project`] between a parse and a serialization) decodes the
//! whole cache into fresh f32 arrays, projects them into more, and encodes a new blob: 80 ms of
//! a 1,024-cell switch on this machine's 2 cores, most of it the conversions and the first
//! touch of ~120 MB of new memory. Here a copy of the blob is rewritten where it lies, a few
//! dozen cells at a time through a small f32 buffer, each layer's K and V on their own task:
//! the same arithmetic in the same order (un-rotate, scale and shift, rotate; F16 rounding as
//! the serializer rounds), so the result is the general path's to the bit. Nothing else is
//! handled here: a projector or blob this does not fit goes the general way.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::error::TransplantError;
use super::map::LayerMap;
use super::projector::Projector;
use super::rope::{Direction, RopeTable};
use crate::kv::{CacheType, KvError, KvSnapshot, KvStream, StreamLayout, TensorSpan};

/// Cells converted at a time: a chunk of f32 rows stays in the core's cache.
const CHUNK: usize = 64;

/// Why a blob could not be projected in place.
#[derive(Debug, thiserror::Error)]
pub enum InPlaceError {
    /// The blob does not read as a single-stream state.
    #[error(transparent)]
    Blob(#[from] KvError),
    /// The projector does not fit the blob's shapes.
    #[error(transparent)]
    Projection(#[from] TransplantError),
}

/// Whether `p` can be applied in place: the same layer count and widths on both sides, each
/// destination layer reading its own source layer through a diagonal or identity map for K
/// and for V, and both rungs rotating keys alike.
#[must_use]
pub fn applies(p: &Projector) -> bool {
    let elementwise = |m: &LayerMap, dim: usize| match m {
        LayerMap::Identity { dim: d } => *d == dim,
        LayerMap::Diagonal { scale, offset } => scale.len() == dim && offset.len() == dim,
        _ => false,
    };
    let dim = p.src.kv_dim();
    p.src.n_layer == p.dst.n_layer
        && dim == p.dst.kv_dim()
        && (!p.sandwich || p.src.rope == p.dst.rope)
        && p.layers.len() == p.dst.n_layer
        && p.layers.iter().enumerate().all(|(l, lp)| {
            lp.src_layers == [l] && elementwise(&lp.k, dim) && elementwise(&lp.v, dim)
        })
}

/// `blob`, a source's F16 state, projected through `p` onto a destination whose cache is
/// `dst_cache`: a copy of the blob with every K and V element rewritten, with its layout and
/// the FLOPs spent. `Ok(None)` when `p` does not [apply](applies) or the blob or destination
/// cache is not F16 throughout (the general path handles those).
///
/// # Errors
/// [`InPlaceError::Blob`] when the blob does not read as a single-stream state,
/// [`InPlaceError::Projection`] when its widths or layer count are not the projector's.
pub fn project(
    blob: &[u8],
    p: &Projector,
    dst_cache: CacheType,
) -> Result<Option<(Vec<u8>, StreamLayout, u64)>, InPlaceError> {
    if !applies(p) || dst_cache != CacheType::F16 {
        return Ok(None);
    }
    let layout = KvSnapshot::single_stream_layout(blob)?;
    let dim = p.src.kv_dim();
    if layout.k.len() != p.layers.len() {
        return Err(TransplantError::ShapeMismatch {
            what: "source layers in the blob vs the projector's",
            expected: p.layers.len(),
            actual: layout.k.len(),
        }
        .into());
    }
    let spans = layout.k.iter().chain(&layout.v);
    if spans.clone().any(|t| t.ty != CacheType::F16) {
        return Ok(None);
    }
    if let Some(t) = spans.clone().find(|t| t.n_embd != dim) {
        return Err(TransplantError::ShapeMismatch {
            what: "blob row width vs the projector's",
            expected: dim,
            actual: t.n_embd,
        }
        .into());
    }
    let mut out = blob.to_vec();
    // Every tensor's bytes as its own slice (they lie in blob order: K of every layer, then V).
    let mut tasks: Vec<(&mut [u8], &TensorSpan, &LayerMap, bool)> = Vec::new();
    let mut rest: &mut [u8] = &mut out;
    let mut at = 0;
    let order = layout
        .k
        .iter()
        .zip(&p.layers)
        .map(|(t, lp)| (t, &lp.k, true))
        .chain(
            layout
                .v
                .iter()
                .zip(&p.layers)
                .map(|(t, lp)| (t, &lp.v, false)),
        );
    for (t, map, is_k) in order {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(t.offset - at);
        let (mine, tail) = tail.split_at_mut(t.len);
        rest = tail;
        at = t.offset + t.len;
        tasks.push((mine, t, map, is_k));
    }
    let positions = &layout.positions;
    // Both rungs rotate keys alike (`applies`): one table turns every layer both ways.
    let table = if p.sandwich {
        Some(RopeTable::new(&p.src.rope, positions)?)
    } else {
        None
    };
    let rope = table.as_ref();
    tasks
        .into_par_iter()
        .try_for_each(|(bytes, t, map, is_k)| {
            let LayerMap::Diagonal { scale, offset } = map else {
                // Identity: the general path's un-rotation and rotation at the same angles
                // give back the same keys; nothing to write.
                return Ok(());
            };
            let (scale, offset) = (scale.to_vec(), offset.to_vec());
            if t.transposed {
                transposed_rows(bytes, positions.len(), &scale, &offset);
                Ok(())
            } else {
                rows(bytes, t.n_embd, &scale, &offset, rope.filter(|_| is_k))
            }
        })?;
    let n = positions.len();
    let rope_flops = if p.sandwich {
        (p.src.rope.flops(n, p.src.n_kv_heads) + p.dst.rope.flops(n, p.dst.n_kv_heads))
            * p.layers.len() as u64
    } else {
        0
    };
    Ok(Some((out, layout, p.map_flops(n) + rope_flops)))
}

/// Rewrites `[cell][dim]` F16 rows: un-rotated at `rope` (keys), scaled and shifted per
/// channel, rotated back.
fn rows(
    bytes: &mut [u8],
    dim: usize,
    scale: &[f32],
    offset: &[f32],
    rope: Option<&RopeTable>,
) -> Result<(), TransplantError> {
    let mut halves = vec![f16::ZERO; CHUNK * dim];
    let mut buf = vec![0f32; CHUNK * dim];
    for (c, chunk) in bytes.chunks_mut(CHUNK * dim * 2).enumerate() {
        let n = chunk.len() / 2;
        decode(chunk, &mut halves[..n], &mut buf[..n]);
        let turn = |buf: &mut [f32], dir| match rope {
            Some(table) => table.apply(buf, dim, c * CHUNK, dir),
            None => Ok(()),
        };
        turn(&mut buf[..n], Direction::Unrotate)?;
        for row in buf[..n].chunks_exact_mut(dim) {
            for ((x, s), o) in row.iter_mut().zip(scale).zip(offset) {
                *x = *x * s + o;
            }
        }
        turn(&mut buf[..n], Direction::Rotate)?;
        encode(&buf[..n], &mut halves[..n], chunk);
    }
    Ok(())
}

/// Rewrites `[dim][cell]` F16 values (a transposed V): channel `j`'s row scaled and shifted
/// by its own factor and offset.
fn transposed_rows(bytes: &mut [u8], n_cells: usize, scale: &[f32], offset: &[f32]) {
    let mut halves = vec![f16::ZERO; n_cells];
    let mut buf = vec![0f32; n_cells];
    for ((row, s), o) in bytes.chunks_mut(n_cells * 2).zip(scale).zip(offset) {
        let n = row.len() / 2;
        decode(row, &mut halves[..n], &mut buf[..n]);
        for x in &mut buf[..n] {
            *x = *x * s + o;
        }
        encode(&buf[..n], &mut halves[..n], row);
    }
}

/// Little-endian F16 `bytes` into `out`, through `halves`.
fn decode(bytes: &[u8], halves: &mut [f16], out: &mut [f32]) {
    for (h, b) in halves.iter_mut().zip(bytes.as_chunks::<2>().0) {
        *h = f16::from_le_bytes(*b);
    }
    halves.convert_to_f32_slice(out);
}

/// `values` as little-endian F16 into `bytes`, through `halves` (round to nearest, as the
/// serializer rounds).
fn encode(values: &[f32], halves: &mut [f16], bytes: &mut [u8]) {
    halves.convert_from_f32_slice(values);
    for (b, h) in bytes.as_chunks_mut::<2>().0.iter_mut().zip(halves.iter()) {
        *b = h.to_le_bytes();
    }
}

/// Writes `head`'s rows of positions below `end` (all for `None`) over the cells of the
/// same positions in `out`, an F16 blob laid out as `layout`, at every layer: how a switch
/// splices the destination's own head into a cache projected in place. Nothing is written
/// when they do not fit.
///
/// # Errors
/// [`TransplantError::ShapeMismatch`] for another layer count or row width, or a position
/// `out` does not hold.
pub fn splice(
    out: &mut [u8],
    layout: &StreamLayout,
    head: &KvStream,
    end: Option<i32>,
) -> Result<(), TransplantError> {
    let mismatch = |what, expected, actual| TransplantError::ShapeMismatch {
        what,
        expected,
        actual,
    };
    if head.layers.len() != layout.k.len() {
        return Err(mismatch(
            "head layers vs the cache's",
            layout.k.len(),
            head.layers.len(),
        ));
    }
    for (l, h) in head.layers.iter().enumerate() {
        if h.k.ncols() != layout.k[l].n_embd || h.v.ncols() != layout.v[l].n_embd {
            return Err(mismatch(
                "head row width vs the cache's",
                layout.k[l].n_embd,
                h.k.ncols(),
            ));
        }
    }
    let n_cells = layout.positions.len();
    let mut cells = Vec::new();
    for (j, c) in head.cells.iter().enumerate() {
        if end.is_some_and(|e| c.pos >= e) {
            continue;
        }
        let Some(i) = layout.positions.iter().position(|&p| p == c.pos) else {
            return Err(mismatch(
                "a head position the cache holds",
                1,
                usize::try_from(c.pos).unwrap_or(0),
            ));
        };
        cells.push((j, i));
    }
    let put = |out: &mut [u8], at: usize, x: f32| {
        out[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
    };
    for (l, h) in head.layers.iter().enumerate() {
        let (k, v) = (&layout.k[l], &layout.v[l]);
        for &(j, i) in &cells {
            for (d, &x) in h.k.row(j).iter().enumerate() {
                put(out, k.offset + (i * k.n_embd + d) * 2, x);
            }
            for (d, &x) in h.v.row(j).iter().enumerate() {
                let at = if v.transposed {
                    v.offset + (d * n_cells + i) * 2
                } else {
                    v.offset + (i * v.n_embd + d) * 2
                };
                put(out, at, x);
            }
        }
    }
    Ok(())
}
