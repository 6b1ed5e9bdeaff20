//! Shedding context from an exported cache: [`shed_stream`] drops the oldest unpinned cells
//! of a [`KvStream`] and moves every later cell down by the same number of positions,
//! re-rotating its cached key.
//!
//! This is what llama.cpp does for a live context with `llama_memory_seq_rm` +
//! `llama_memory_seq_add` (see `engine::Context::shed_and_decode`), done on the KV mirror
//! instead: a parked rung has no context, only its exported state, and shedding is the one
//! lever that can still shrink it. Keys are cached after RoPE, and a rotation by θ(p) followed
//! by one by θ(−n) is a rotation by θ(p − n), so moving a key from position p to p − n is one
//! rotation at position −n — the same arithmetic as llama.cpp's K-shift graph
//! (`ggml_rope_ext` with the shift as position). Values carry no position and are kept as
//! they are.

use ndarray::{Array2, Axis};

use super::error::TransplantError;
use super::rope::{Direction, RopeSpec, rotate};
use crate::kv::{KvError, KvSnapshot, KvStream};

/// What [`shed_stream`] removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShedStats {
    /// Cells removed.
    pub removed: usize,
    /// Cells moved down (and their keys re-rotated).
    pub shifted: usize,
}

/// Why [`shed_blob`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ShedError {
    /// The blob does not parse as one stream, or the result cannot be written back.
    #[error("parked state: {0}")]
    State(#[from] KvError),
    /// The shed itself failed, as for [`shed_stream`].
    #[error(transparent)]
    Shed(#[from] TransplantError),
}

/// [`shed_stream`] on the blob of one parked sequence (what `llama_state_seq_get_data_ext`
/// wrote), returning the blob to import in its place.
///
/// # Errors
/// [`ShedError::State`] if the blob does not parse as one stream or the result cannot be
/// written back; [`ShedError::Shed`] if the shed fails as for [`shed_stream`].
pub fn shed_blob(
    blob: &[u8],
    pinned: usize,
    n: usize,
    rope: &RopeSpec,
) -> Result<Vec<u8>, ShedError> {
    let (seq_id, mut stream) = KvSnapshot::parse_single_stream(blob)?;
    let to_i32 = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
    shed_stream(&mut stream, to_i32(pinned), to_i32(n), rope)?;
    Ok(KvSnapshot::from_single_stream(seq_id, stream).to_bytes()?)
}

/// Removes the cells at positions `pinned .. pinned + n` and moves every cell at or after
/// `pinned + n` down by `n` positions, re-rotating its keys at `rope`'s angles. Cells before
/// `pinned` (the system prompt) are untouched.
///
/// # Errors
/// [`TransplantError::ShapeMismatch`] if a layer's arrays do not have one row per cell;
/// [`TransplantError::NotMultiple`] / [`TransplantError::InvalidRope`] if the key width does
/// not split into `rope`'s heads.
pub fn shed_stream(
    stream: &mut KvStream,
    pinned: i32,
    n: i32,
    rope: &RopeSpec,
) -> Result<ShedStats, TransplantError> {
    let cells = stream.cells.len();
    for l in &stream.layers {
        for (what, rows) in [
            ("shed: K rows vs cells", l.k.nrows()),
            ("shed: V rows vs cells", l.v.nrows()),
        ] {
            if rows != cells {
                return Err(TransplantError::ShapeMismatch {
                    what,
                    expected: cells,
                    actual: rows,
                });
            }
        }
    }
    if n <= 0 {
        return Ok(ShedStats {
            removed: 0,
            shifted: 0,
        });
    }
    let end = pinned.saturating_add(n);
    let keep: Vec<usize> = (0..cells)
        .filter(|&i| {
            let p = stream.cells[i].pos;
            p < pinned || p >= end
        })
        .collect();
    let kept_cells: Vec<_> = keep.iter().map(|&i| stream.cells[i].clone()).collect();
    // Rows (in the kept order) whose position moves.
    let moved: Vec<usize> = kept_cells
        .iter()
        .enumerate()
        .filter(|(_, c)| c.pos >= end)
        .map(|(r, _)| r)
        .collect();
    for layer in &mut stream.layers {
        let mut k = layer.k.select(Axis(0), &keep);
        let v = layer.v.select(Axis(0), &keep);
        if !moved.is_empty() {
            let mut rows: Array2<f32> = k.select(Axis(0), &moved);
            rotate(
                rows.view_mut(),
                &vec![-n; moved.len()],
                rope,
                Direction::Rotate,
            )?;
            for (j, &r) in moved.iter().enumerate() {
                k.row_mut(r).assign(&rows.row(j));
            }
        }
        layer.k = k;
        layer.v = v;
    }
    stream.cells = kept_cells;
    for c in &mut stream.cells {
        if c.pos >= end {
            c.pos -= n;
        }
    }
    Ok(ShedStats {
        removed: cells - keep.len(),
        shifted: moved.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{CacheType, Cell, LayerKv};

    fn stream(positions: &[i32], width: usize) -> KvStream {
        let n = positions.len();
        let k = Array2::from_shape_fn((n, width), |(i, j)| ((i * 7 + j * 3) % 11) as f32 - 5.0);
        let v = Array2::from_shape_fn((n, width), |(i, j)| (i * width + j) as f32);
        KvStream {
            cells: positions
                .iter()
                .map(|&pos| Cell {
                    pos,
                    seq_ids: vec![0],
                    ext: None,
                })
                .collect(),
            v_trans: true,
            n_rot_k: 0,
            n_rot_v: 0,
            has_v: true,
            layers: vec![LayerKv {
                k,
                v,
                k_type: CacheType::F32,
                v_type: CacheType::F32,
            }],
        }
    }

    #[test]
    fn removes_the_range_and_shifts_the_rest() {
        let rope = RopeSpec::neox(4, 10_000.0);
        let original = stream(&[0, 1, 2, 3, 4, 5, 6, 7], 8);
        let mut s = original.clone();
        let stats = shed_stream(&mut s, 2, 3, &rope).expect("sheds");
        assert_eq!(
            stats,
            ShedStats {
                removed: 3,
                shifted: 3
            }
        );
        assert_eq!(s.positions(), vec![0, 1, 2, 3, 4]);
        let l = &s.layers[0];
        // Pinned rows untouched, V rows follow their cells, keys of moved cells re-rotated
        // from positions 5..8 to 2..5: un-rotating at the new position gives the same pre-RoPE
        // key as un-rotating the original at the old one.
        assert_eq!(l.k.row(0), original.layers[0].k.row(0));
        assert_eq!(l.v.row(2), original.layers[0].v.row(5));
        let mut new = l.k.select(Axis(0), &[2, 3, 4]);
        rotate(new.view_mut(), &[2, 3, 4], &rope, Direction::Unrotate).expect("rope");
        let mut old = original.layers[0].k.select(Axis(0), &[5, 6, 7]);
        rotate(old.view_mut(), &[5, 6, 7], &rope, Direction::Unrotate).expect("rope");
        let d = (&new - &old).mapv(f32::abs).fold(0.0f32, |a, &b| a.max(b));
        assert!(d < 1e-4, "pre-RoPE keys moved by {d}");
        // Control: the keys did change (a shed that forgot to rotate would pass the rest).
        assert_ne!(l.k.row(2), original.layers[0].k.row(5));
    }

    #[test]
    fn nothing_to_shed_and_bad_shapes() {
        let rope = RopeSpec::neox(4, 10_000.0);
        let mut s = stream(&[0, 1, 2], 8);
        assert_eq!(shed_stream(&mut s, 1, 0, &rope).expect("ok").removed, 0);
        assert_eq!(s.positions(), vec![0, 1, 2]);
        s.layers[0].v = Array2::zeros((2, 8));
        assert!(matches!(
            shed_stream(&mut s, 1, 1, &rope),
            Err(TransplantError::ShapeMismatch { .. })
        ));
    }
}
