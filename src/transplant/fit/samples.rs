//! The paired activations a fit reads ([`RouteSamples`]) and their train / held-out split by
//! windows ([`split_windows`]): consecutive tokens are correlated, so a random row split
//! would leak.

use std::ops::Range;

use ndarray::Array2;

use crate::transplant::error::TransplantError;
use crate::transplant::projector::RungBinding;

/// One layer's activations on one rung: pre-RoPE K and V, `[n_rows][kv_dim]` each.
#[derive(Clone, Debug)]
pub struct LayerActivations {
    /// Keys before RoPE (as produced by the K projection, bias included).
    pub k: Array2<f32>,
    /// Values.
    pub v: Array2<f32>,
}

/// Paired activations of the same tokens on the source and destination rungs.
#[derive(Clone, Debug)]
pub struct RouteSamples {
    /// Source rung.
    pub src: RungBinding,
    /// Destination rung.
    pub dst: RungBinding,
    /// One entry per source layer.
    pub src_layers: Vec<LayerActivations>,
    /// One entry per destination layer.
    pub dst_layers: Vec<LayerActivations>,
    /// Position of each row (used to rotate keys for the no-sandwich ablation).
    pub positions: Vec<i32>,
    /// Training row ranges.
    pub train: Vec<Range<usize>>,
    /// Held-out row ranges, disjoint from `train`.
    pub held_out: Vec<Range<usize>>,
}

impl RouteSamples {
    /// Rows per layer.
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.positions.len()
    }

    /// Check shapes against the bindings and that the split is in range and disjoint.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`], [`TransplantError::RowsOutOfRange`],
    /// [`TransplantError::TooFewRows`] (fewer than 2 training or 1 held-out row, or an
    /// overlap, reported as the overlapping row count).
    pub fn validate(&self) -> Result<(), TransplantError> {
        self.src.validate()?;
        self.dst.validate()?;
        let n = self.n_rows();
        for (what, layers, b) in [
            ("source sample layers", &self.src_layers, &self.src),
            ("destination sample layers", &self.dst_layers, &self.dst),
        ] {
            if layers.len() != b.n_layer {
                return Err(TransplantError::ShapeMismatch {
                    what,
                    expected: b.n_layer,
                    actual: layers.len(),
                });
            }
            for l in layers {
                for m in [&l.k, &l.v] {
                    if m.dim() != (n, b.kv_dim()) {
                        let (what, expected, actual) = if m.nrows() == n {
                            ("sample width vs kv_dim", b.kv_dim(), m.ncols())
                        } else {
                            ("sample rows vs positions", n, m.nrows())
                        };
                        return Err(TransplantError::ShapeMismatch {
                            what,
                            expected,
                            actual,
                        });
                    }
                }
            }
        }
        let mut used = vec![0u8; n];
        for (bit, ranges) in [(1u8, &self.train), (2u8, &self.held_out)] {
            for r in ranges {
                if r.start > r.end || r.end > n {
                    return Err(TransplantError::RowsOutOfRange {
                        start: r.start,
                        end: r.end,
                        n_rows: n,
                    });
                }
                for u in &mut used[r.clone()] {
                    *u |= bit;
                }
            }
        }
        let overlap = used.iter().filter(|&&u| u == 3).count();
        if overlap > 0 {
            return Err(TransplantError::TooFewRows {
                what: "disjoint train/held-out rows (rows in both)",
                rows: overlap,
                needed: 0,
            });
        }
        let n_train: usize = self.train.iter().map(ExactSizeIterator::len).sum();
        let n_val: usize = self.held_out.iter().map(ExactSizeIterator::len).sum();
        if n_train < 2 {
            return Err(TransplantError::TooFewRows {
                what: "training rows",
                rows: n_train,
                needed: 2,
            });
        }
        if n_val == 0 {
            return Err(TransplantError::TooFewRows {
                what: "held-out rows",
                rows: 0,
                needed: 1,
            });
        }
        Ok(())
    }
}

/// Training and held-out row ranges.
pub type Split = (Vec<Range<usize>>, Vec<Range<usize>>);

/// Split `0..n_rows` into windows of `window` rows; every `held_out_every`-th window
/// (the last of each group) is held out, the rest train.
///
/// # Errors
/// [`TransplantError::TooFewRows`] if `window` is 0, `held_out_every < 2`, or there are
/// fewer than `held_out_every` windows (so one side would be empty).
pub fn split_windows(
    n_rows: usize,
    window: usize,
    held_out_every: usize,
) -> Result<Split, TransplantError> {
    if window == 0 || held_out_every < 2 {
        return Err(TransplantError::TooFewRows {
            what: "window length / held-out period",
            rows: window.min(held_out_every),
            needed: 2,
        });
    }
    let n_windows = n_rows.div_ceil(window);
    if n_windows < held_out_every {
        return Err(TransplantError::TooFewRows {
            what: "windows for a train/held-out split",
            rows: n_windows,
            needed: held_out_every,
        });
    }
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for w in 0..n_windows {
        let r = w * window..((w + 1) * window).min(n_rows);
        if w % held_out_every == held_out_every - 1 {
            held.push(r);
        } else {
            train.push(r);
        }
    }
    Ok((train, held))
}
