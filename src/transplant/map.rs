//! Per-layer maps from source to destination K or V features.
//!
//! [`LayerMap`] is what a projector stores for each destination layer and each of K and V:
//! the identity (a rung onto itself), a dense [`Affine`] (size route), a per-channel
//! diagonal (precision route), a block-diagonal per-head map ([`HeadBlock`]s), or the naive
//! [`LayerMap::Truncate`] baseline that keeps the first dimensions of each head. Every kind
//! reports its widths and its FLOPs so switch cost can be compared against re-prefill.
//!
//! [`per_head_layout`] fixes which input heads feed which output head when head counts
//! differ; the ridge fitter and file loader both go through it so they cannot disagree.

use ndarray::{Array1, Array2, ArrayView2, s};

use super::error::TransplantError;
use super::ridge::Affine;

/// One block of a per-head map: the input columns it reads and where it writes.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadBlock {
    /// Half-open `[start, end)` column ranges of the input, concatenated in order.
    pub input_ranges: Vec<(usize, usize)>,
    /// First output column written; the block writes `affine.d_out()` columns.
    pub output_offset: usize,
    /// The block's map.
    pub affine: Affine,
}

/// Where one per-head block reads and writes, before fitting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSpec {
    /// Input column ranges, as in [`HeadBlock::input_ranges`].
    pub input_ranges: Vec<(usize, usize)>,
    /// First output column.
    pub output_offset: usize,
    /// Output columns.
    pub output_len: usize,
}

/// The block structure of a per-head map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerHeadLayout {
    /// One block per output head.
    pub blocks: Vec<BlockSpec>,
    /// Total input width (all source layers).
    pub in_dim: usize,
}

impl PerHeadLayout {
    /// Total output width.
    #[must_use]
    pub fn out_dim(&self) -> usize {
        self.blocks.iter().map(|b| b.output_len).sum()
    }
}

/// Input heads `[start, end)` that feed output head `h`: those whose share of the unit
/// interval `[g/n_in, (g+1)/n_in)` overlaps `[h/n_out, (h+1)/n_out)`.
#[must_use]
pub fn head_group(h: usize, n_heads_in: usize, n_heads_out: usize) -> (usize, usize) {
    let start = h * n_heads_in / n_heads_out;
    let end = ((h + 1) * n_heads_in).div_ceil(n_heads_out);
    (start, end.max(start + 1).min(n_heads_in))
}

/// Block layout of a per-head map whose input is one or more source layers side by side.
///
/// Output head `h` reads, from every source layer, the input heads of [`head_group`]: equal
/// counts pair head `h` with head `h`; 4 → 2 gives `{2h, 2h+1}`; 2 → 4 gives `h/2`.
///
/// # Errors
/// [`TransplantError::NotMultiple`] if `in_dim` is not a positive multiple of
/// `n_heads_in * head_dim_in`, or any count is zero.
pub fn per_head_layout(
    in_dim: usize,
    n_heads_in: usize,
    head_dim_in: usize,
    n_heads_out: usize,
    head_dim_out: usize,
) -> Result<PerHeadLayout, TransplantError> {
    let layer_width = n_heads_in * head_dim_in;
    if layer_width == 0 || in_dim == 0 || !in_dim.is_multiple_of(layer_width) {
        return Err(TransplantError::NotMultiple {
            what: "per-head input width vs n_heads_in * head_dim_in",
            width: in_dim,
            unit: layer_width,
        });
    }
    if n_heads_out == 0 || head_dim_out == 0 {
        return Err(TransplantError::NotMultiple {
            what: "per-head output heads",
            width: n_heads_out * head_dim_out,
            unit: 1,
        });
    }
    let n_layers = in_dim / layer_width;
    let blocks = (0..n_heads_out)
        .map(|h| {
            let (g0, g1) = head_group(h, n_heads_in, n_heads_out);
            let input_ranges = (0..n_layers)
                .map(|l| {
                    (
                        l * layer_width + g0 * head_dim_in,
                        l * layer_width + g1 * head_dim_in,
                    )
                })
                .collect();
            BlockSpec {
                input_ranges,
                output_offset: h * head_dim_out,
                output_len: head_dim_out,
            }
        })
        .collect();
    Ok(PerHeadLayout { blocks, in_dim })
}

/// A map from one destination layer's source features (K or V of the chosen source
/// layer(s), concatenated) to the destination's features.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerMap {
    /// Pass through unchanged (a rung onto itself).
    Identity {
        /// Width in and out.
        dim: usize,
    },
    /// Dense `x W + b`.
    Affine(Affine),
    /// Per-channel `x ⊙ scale + offset`.
    Diagonal {
        /// Per-channel scale.
        scale: Array1<f32>,
        /// Per-channel offset.
        offset: Array1<f32>,
    },
    /// Block-diagonal: each block maps some input heads to one output head.
    PerHead {
        /// Input width.
        in_dim: usize,
        /// Output width; blocks tile it exactly.
        out_dim: usize,
        /// The blocks, in output order.
        blocks: Vec<HeadBlock>,
    },
    /// Naive baseline: output head `h` copies the first `min(head_dim_in, head_dim_out)`
    /// dimensions of input head `h * n_heads_in / n_heads_out` and zero-pads the rest.
    Truncate {
        /// Input heads.
        n_heads_in: usize,
        /// Input head size.
        head_dim_in: usize,
        /// Output heads.
        n_heads_out: usize,
        /// Output head size.
        head_dim_out: usize,
    },
}

impl LayerMap {
    /// Widens (or narrows) the map's output around `centre`, column by column:
    /// `y'_j = centre_j + alpha_j (y_j − centre_j)`, folded into the map's own weights, so the
    /// result is the same kind of map and applies at the same cost. Used to undo the shrinkage
    /// of a ridge prediction toward its mean (see `FitOptions::restore_spread`).
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] if `alpha` or `centre` is not `out_dim` long;
    /// [`TransplantError::Unsupported`] for the unfitted kinds (identity, truncate).
    pub fn rescale_outputs(
        &mut self,
        alpha: &Array1<f32>,
        centre: &Array1<f32>,
    ) -> Result<(), TransplantError> {
        let out = self.out_dim();
        for (what, n) in [
            ("rescale alpha", alpha.len()),
            ("rescale centre", centre.len()),
        ] {
            if n != out {
                return Err(TransplantError::ShapeMismatch {
                    what,
                    expected: out,
                    actual: n,
                });
            }
        }
        let fold = |a: &mut Affine, first: usize| {
            for j in 0..a.d_out() {
                let (al, c) = (alpha[first + j], centre[first + j]);
                a.w.column_mut(j).mapv_inplace(|w| w * al);
                a.b[j] = al * a.b[j] + (1.0 - al) * c;
            }
        };
        match self {
            Self::Affine(a) => fold(a, 0),
            Self::PerHead { blocks, .. } => {
                for b in blocks {
                    fold(&mut b.affine, b.output_offset);
                }
            }
            Self::Diagonal { scale, offset } => {
                for j in 0..out {
                    scale[j] *= alpha[j];
                    offset[j] = alpha[j] * offset[j] + (1.0 - alpha[j]) * centre[j];
                }
            }
            Self::Identity { .. } | Self::Truncate { .. } => {
                return Err(TransplantError::Unsupported {
                    kind: self.kind_name(),
                    reason: "an unfitted map has no weights to rescale".into(),
                });
            }
        }
        Ok(())
    }

    /// Short kind name for errors and reports.
    #[must_use]
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::Identity { .. } => "identity",
            Self::Affine(_) => "dense",
            Self::Diagonal { .. } => "diagonal",
            Self::PerHead { .. } => "per-head",
            Self::Truncate { .. } => "truncate",
        }
    }

    /// Input width.
    #[must_use]
    pub fn in_dim(&self) -> usize {
        match self {
            Self::Identity { dim } => *dim,
            Self::Affine(a) => a.d_in(),
            Self::Diagonal { scale, .. } => scale.len(),
            Self::PerHead { in_dim, .. } => *in_dim,
            Self::Truncate {
                n_heads_in,
                head_dim_in,
                ..
            } => n_heads_in * head_dim_in,
        }
    }

    /// Output width.
    #[must_use]
    pub fn out_dim(&self) -> usize {
        match self {
            Self::Identity { dim } => *dim,
            Self::Affine(a) => a.d_out(),
            Self::Diagonal { scale, .. } => scale.len(),
            Self::PerHead { out_dim, .. } => *out_dim,
            Self::Truncate {
                n_heads_out,
                head_dim_out,
                ..
            } => n_heads_out * head_dim_out,
        }
    }

    /// FLOPs of applying to `n_rows` rows (2 per multiply-add, 1 per bias add; copies and
    /// zero-padding count as 0).
    #[must_use]
    pub fn flops(&self, n_rows: usize) -> u64 {
        match self {
            Self::Identity { .. } | Self::Truncate { .. } => 0,
            Self::Affine(a) => a.flops(n_rows),
            Self::Diagonal { scale, .. } => (2 * n_rows * scale.len()) as u64,
            Self::PerHead { blocks, .. } => blocks.iter().map(|b| b.affine.flops(n_rows)).sum(),
        }
    }

    /// Check internal consistency: widths agree, per-head blocks read inside the input and
    /// tile the output exactly.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] or [`TransplantError::Unsupported`] naming what
    /// is inconsistent.
    pub fn validate(&self) -> Result<(), TransplantError> {
        match self {
            Self::Identity { .. } => Ok(()),
            Self::Affine(a) => a.check(),
            Self::Diagonal { scale, offset } => {
                if scale.len() == offset.len() {
                    Ok(())
                } else {
                    Err(TransplantError::ShapeMismatch {
                        what: "diagonal offset length",
                        expected: scale.len(),
                        actual: offset.len(),
                    })
                }
            }
            Self::PerHead {
                in_dim,
                out_dim,
                blocks,
            } => validate_blocks(*in_dim, *out_dim, blocks),
            Self::Truncate {
                n_heads_in,
                head_dim_in,
                n_heads_out,
                head_dim_out,
            } => {
                if [n_heads_in, head_dim_in, n_heads_out, head_dim_out].contains(&&0) {
                    Err(TransplantError::Unsupported {
                        kind: "truncate",
                        reason: "zero head count or head size".into(),
                    })
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Apply to rows of `x` (`[n][in_dim]`), giving `[n][out_dim]`.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] if `x` is not `in_dim` wide, or the map is
    /// internally inconsistent (see [`LayerMap::validate`]).
    pub fn apply(&self, x: ArrayView2<'_, f32>) -> Result<Array2<f32>, TransplantError> {
        self.validate()?;
        if x.ncols() != self.in_dim() {
            return Err(TransplantError::ShapeMismatch {
                what: "layer map input width",
                expected: self.in_dim(),
                actual: x.ncols(),
            });
        }
        match self {
            Self::Identity { .. } => Ok(x.to_owned()),
            Self::Affine(a) => a.apply(x),
            Self::Diagonal { scale, offset } => {
                let mut out = &x * scale;
                out += offset;
                Ok(out)
            }
            Self::PerHead {
                out_dim, blocks, ..
            } => {
                let mut out = Array2::<f32>::zeros((x.nrows(), *out_dim));
                for b in blocks {
                    let part = if let [(a, e)] = b.input_ranges[..] {
                        b.affine.apply(x.slice(s![.., a..e]))?
                    } else {
                        let views: Vec<_> = b
                            .input_ranges
                            .iter()
                            .map(|&(a, e)| x.slice(s![.., a..e]))
                            .collect();
                        let gathered =
                            ndarray::concatenate(ndarray::Axis(1), &views).map_err(|_| {
                                TransplantError::ShapeMismatch {
                                    what: "per-head gather",
                                    expected: b.affine.d_in(),
                                    actual: 0,
                                }
                            })?;
                        b.affine.apply(gathered.view())?
                    };
                    out.slice_mut(s![.., b.output_offset..b.output_offset + part.ncols()])
                        .assign(&part);
                }
                Ok(out)
            }
            Self::Truncate {
                n_heads_in,
                head_dim_in,
                n_heads_out,
                head_dim_out,
            } => {
                let keep = (*head_dim_in).min(*head_dim_out);
                let mut out = Array2::<f32>::zeros((x.nrows(), n_heads_out * head_dim_out));
                for h in 0..*n_heads_out {
                    let g = h * n_heads_in / n_heads_out;
                    out.slice_mut(s![.., h * head_dim_out..h * head_dim_out + keep])
                        .assign(&x.slice(s![.., g * head_dim_in..g * head_dim_in + keep]));
                }
                Ok(out)
            }
        }
    }
}

fn validate_blocks(
    in_dim: usize,
    out_dim: usize,
    blocks: &[HeadBlock],
) -> Result<(), TransplantError> {
    let mut covered = vec![false; out_dim];
    for b in blocks {
        b.affine.check()?;
        let mut width = 0;
        for &(a, e) in &b.input_ranges {
            if a >= e || e > in_dim {
                return Err(TransplantError::Unsupported {
                    kind: "per-head",
                    reason: format!("input range {a}..{e} outside 0..{in_dim}"),
                });
            }
            width += e - a;
        }
        if width != b.affine.d_in() {
            return Err(TransplantError::ShapeMismatch {
                what: "per-head block input width",
                expected: b.affine.d_in(),
                actual: width,
            });
        }
        let end = b.output_offset + b.affine.d_out();
        if end > out_dim {
            return Err(TransplantError::Unsupported {
                kind: "per-head",
                reason: format!(
                    "output range {}..{end} outside 0..{out_dim}",
                    b.output_offset
                ),
            });
        }
        for c in &mut covered[b.output_offset..end] {
            if *c {
                return Err(TransplantError::Unsupported {
                    kind: "per-head",
                    reason: "blocks overlap in the output".into(),
                });
            }
            *c = true;
        }
    }
    if covered.iter().all(|&c| c) {
        Ok(())
    } else {
        Err(TransplantError::Unsupported {
            kind: "per-head",
            reason: "blocks leave output columns unwritten".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn head_groups_cover_output_heads() {
        assert_eq!(head_group(1, 2, 2), (1, 2));
        assert_eq!(head_group(1, 4, 2), (2, 4));
        assert_eq!(head_group(3, 2, 4), (1, 2));
        // 3 → 2: output 0 covers [0, 1.5) → heads 0, 1; output 1 covers [1.5, 3) → 1, 2.
        assert_eq!(head_group(0, 3, 2), (0, 2));
        assert_eq!(head_group(1, 3, 2), (1, 3));
    }

    #[test]
    fn layout_spans_every_source_layer() {
        let l = per_head_layout(2 * 2 * 4, 2, 4, 2, 3).unwrap();
        assert_eq!(l.blocks[1].input_ranges, vec![(4, 8), (12, 16)]);
        assert_eq!(l.blocks[1].output_offset, 3);
        assert_eq!(l.out_dim(), 6);
        assert!(per_head_layout(10, 2, 4, 2, 3).is_err());
    }

    #[test]
    fn truncate_keeps_head_prefixes_and_pads() {
        let x = array![[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]];
        let shrink = LayerMap::Truncate {
            n_heads_in: 2,
            head_dim_in: 4,
            n_heads_out: 2,
            head_dim_out: 2,
        };
        assert_eq!(
            shrink.apply(x.view()).unwrap(),
            array![[1.0f32, 2.0, 5.0, 6.0]]
        );
        let grow = LayerMap::Truncate {
            n_heads_in: 2,
            head_dim_in: 4,
            n_heads_out: 1,
            head_dim_out: 6,
        };
        assert_eq!(
            grow.apply(x.view()).unwrap(),
            array![[1.0f32, 2.0, 3.0, 4.0, 0.0, 0.0]]
        );
        assert_eq!(shrink.flops(100), 0);
    }

    #[test]
    fn diagonal_and_flops() {
        let m = LayerMap::Diagonal {
            scale: array![2.0f32, -1.0],
            offset: array![0.5f32, 1.0],
        };
        let y = m.apply(array![[1.0f32, 3.0], [0.0, 0.0]].view()).unwrap();
        assert_eq!(y, array![[2.5f32, -2.0], [0.5, 1.0]]);
        assert_eq!(m.flops(10), 40);
        let dense = LayerMap::Affine(Affine {
            w: Array2::zeros((257, 128)),
            b: Array1::zeros(128),
        });
        assert_eq!(dense.flops(1024), 1024 * 128 * (2 * 257 + 1));
    }

    #[test]
    fn bad_maps_are_errors() {
        let id = LayerMap::Identity { dim: 3 };
        assert!(matches!(
            id.apply(Array2::<f32>::zeros((2, 4)).view()),
            Err(TransplantError::ShapeMismatch {
                expected: 3,
                actual: 4,
                ..
            })
        ));
        let gap = LayerMap::PerHead {
            in_dim: 4,
            out_dim: 4,
            blocks: vec![HeadBlock {
                input_ranges: vec![(0, 2)],
                output_offset: 0,
                affine: Affine::identity(2),
            }],
        };
        assert!(matches!(
            gap.validate(),
            Err(TransplantError::Unsupported { .. })
        ));
        let overlap = LayerMap::PerHead {
            in_dim: 4,
            out_dim: 2,
            blocks: vec![
                HeadBlock {
                    input_ranges: vec![(0, 2)],
                    output_offset: 0,
                    affine: Affine::identity(2),
                },
                HeadBlock {
                    input_ranges: vec![(2, 4)],
                    output_offset: 0,
                    affine: Affine::identity(2),
                },
            ],
        };
        assert!(overlap.validate().is_err());
        let outside = LayerMap::PerHead {
            in_dim: 4,
            out_dim: 2,
            blocks: vec![HeadBlock {
                input_ranges: vec![(3, 5)],
                output_offset: 0,
                affine: Affine::identity(2),
            }],
        };
        assert!(outside.apply(Array2::<f32>::zeros((1, 4)).view()).is_err());
    }
}
