//! The hidden map of selective top-k recompute: an affine map from the source rung's residual
//! stream after one of its blocks to the destination's residual stream entering its block
//! `L_dst − k`, so that the destination's last `k` blocks can be run natively over every cached
//! position (see `crate::engine::PartialForward`) instead of their K/V being projected.
//!
//! Fitted like the KV maps — closed-form ridge with a bias column, λ chosen on held-out windows
//! of the same corpus — and saved as a `.molt-hmap` file bound, like a projector, to the sha256
//! of both rungs' GGUF files. The source layer is chosen by depth proportion
//! ([`source_layer`]): the destination's boundary sits at the fraction `(L_dst − k) / L_dst` of
//! its depth, and the source block whose output sits closest to the same fraction is tapped.
//!
//! File layout: `b"MOLTHMAP"`, `u32` format version, `u64` header length, the JSON
//! [`HiddenHeader`], then the weights `[d_in][d_out]` and the bias `[d_out]` as little-endian
//! f32, whose sha256 the header records.
//!
//! Main items: [`HiddenMap`], [`fit_hidden`], [`source_layer`], [`file_name`].

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2, ArrayView2, Axis};
use serde::{Deserialize, Serialize};

use super::error::{ProjectorError, TransplantError};
use super::projector::RungBinding;
use super::ridge::{Affine, fit_select_lambda};

/// File magic.
pub const MAGIC: [u8; 8] = *b"MOLTHMAP";
/// Format version written and read.
pub const FORMAT_VERSION: u32 = 1;

/// How a hidden map fitted: the numbers to report beside the KV maps'.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HiddenFit {
    /// The ridge λ chosen on held-out windows.
    pub lambda: f64,
    /// Relative RMS on the training rows.
    pub train_rel_rms: f64,
    /// Relative RMS on held-out windows.
    pub held_out_rel_rms: f64,
    /// Rows fitted on (train + held out).
    pub rows: usize,
}

/// The JSON header of a `.molt-hmap` file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HiddenHeader {
    /// Source rung.
    pub src: RungBinding,
    /// Destination rung.
    pub dst: RungBinding,
    /// Destination blocks recomputed.
    pub k: usize,
    /// The source block whose output (`l_out-<src_layer>`) is the map's input.
    pub src_layer: usize,
    /// Source hidden size (`d_in`).
    pub d_in: usize,
    /// Destination hidden size (`d_out`).
    pub d_out: usize,
    /// The fit.
    pub fit: HiddenFit,
    /// Hex sha256 of the data section.
    pub data_sha256: String,
}

/// A fitted hidden map for one route and one `k`.
#[derive(Clone, Debug, PartialEq)]
pub struct HiddenMap {
    /// Source rung.
    pub src: RungBinding,
    /// Destination rung.
    pub dst: RungBinding,
    /// Destination blocks recomputed (`L_dst − k ..`).
    pub k: usize,
    /// The source block whose output is tapped.
    pub src_layer: usize,
    /// The map, `[d_src_embd] → [d_dst_embd]`.
    pub affine: Affine,
    /// How it fitted.
    pub fit: HiddenFit,
}

/// File name of the hidden map of route `src → dst` for `k`.
#[must_use]
pub fn file_name(src: &str, dst: &str, k: usize) -> String {
    format!("{src}-to-{dst}.topk{k}.molt-hmap")
}

/// The destination boundary: the output of block `L_dst − k − 1` enters block `L_dst − k`.
#[must_use]
pub fn dst_boundary_layer(dst_layers: usize, k: usize) -> usize {
    dst_layers - k - 1
}

/// The source block whose output sits at the same depth fraction as the destination's boundary
/// (the input of block `L_dst − k`, i.e. `(L_dst − k) / L_dst` of the way up), never the
/// source's last block (whose `l_out` llama.cpp cuts to the output rows).
#[must_use]
pub fn source_layer(src_layers: usize, dst_layers: usize, k: usize) -> usize {
    let frac = (dst_layers - k) as f64 / dst_layers as f64;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let after = (frac * src_layers as f64).round() as usize;
    after.saturating_sub(1).min(src_layers.saturating_sub(2))
}

fn rows(x: ArrayView2<'_, f32>, ranges: &[Range<usize>]) -> Array2<f32> {
    let idx: Vec<usize> = ranges.iter().flat_map(Clone::clone).collect();
    x.select(Axis(0), &idx)
}

/// Fits the map from `x` (source states, one row per token) to `y` (destination states at the
/// same tokens): ridge with a bias, λ from a grid scaled to the features' energy, chosen on the
/// `held` windows.
///
/// # Errors
/// Shape and solve errors of the ridge fit.
pub fn fit_hidden(
    x: ArrayView2<'_, f32>,
    y: ArrayView2<'_, f32>,
    train: &[Range<usize>],
    held: &[Range<usize>],
) -> Result<(Affine, HiddenFit), TransplantError> {
    let (xt, yt, xv, yv) = (rows(x, train), rows(y, train), rows(x, held), rows(y, held));
    // The residual stream's scale varies by orders of magnitude between models and depths, so
    // the grid is relative to the mean squared feature (times the rows, as XᵀX is).
    let energy = xt.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / xt.ncols().max(1) as f64;
    let lambdas: Vec<f64> = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
        .iter()
        .map(|f| f * energy.max(1e-12))
        .collect();
    let r = fit_select_lambda(xt.view(), yt.view(), xv.view(), yv.view(), &lambdas)?;
    Ok((
        r.affine,
        HiddenFit {
            lambda: r.lambda,
            train_rel_rms: r.train_rel_rms,
            held_out_rel_rms: r.val_rel_rms,
            rows: x.nrows(),
        },
    ))
}

impl HiddenMap {
    /// Maps source states (`[n][d_in]`) to destination states (`[n][d_out]`).
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`] for another width.
    pub fn apply(&self, x: ArrayView2<'_, f32>) -> Result<Array2<f32>, TransplantError> {
        self.affine.apply(x)
    }

    /// The file image.
    ///
    /// # Errors
    /// [`ProjectorError::Transplant`] for an inconsistent map.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ProjectorError> {
        self.affine.check()?;
        let mut data = Vec::with_capacity((self.affine.w.len() + self.affine.b.len()) * 4);
        for v in self.affine.w.iter().chain(self.affine.b.iter()) {
            data.extend_from_slice(&v.to_le_bytes());
        }
        let header = HiddenHeader {
            src: self.src.clone(),
            dst: self.dst.clone(),
            k: self.k,
            src_layer: self.src_layer,
            d_in: self.affine.d_in(),
            d_out: self.affine.d_out(),
            fit: self.fit.clone(),
            data_sha256: super::framed::sha256_hex(&data),
        };
        let json = serde_json::to_vec_pretty(&header).map_err(|e| {
            ProjectorError::Transplant(TransplantError::Unsupported {
                kind: "hidden map",
                reason: e.to_string(),
            })
        })?;
        Ok(super::framed::frame(&MAGIC, FORMAT_VERSION, &json, &data))
    }

    /// Writes the file atomically (a temporary beside it, then renamed).
    ///
    /// # Errors
    /// [`ProjectorError::Io`].
    pub fn save(&self, path: &Path) -> Result<(), ProjectorError> {
        super::framed::write_atomic(path, &self.to_bytes()?)
    }

    /// Reads `path` and checks it binds the GGUF files with these sha256s.
    ///
    /// # Errors
    /// [`ProjectorError::BoundToOtherFiles`], and the format errors of a damaged file.
    pub fn load(path: &Path, src_sha256: &str, dst_sha256: &str) -> Result<Self, ProjectorError> {
        let file = path.to_path_buf();
        let bytes = fs::read(path).map_err(|source| ProjectorError::Io {
            file: file.clone(),
            source,
        })?;
        Self::from_bytes(&bytes, file, src_sha256, dst_sha256)
    }

    /// Parses a file's bytes (see [`HiddenMap::load`]); `file` only labels errors.
    ///
    /// # Errors
    /// As [`HiddenMap::load`], without I/O.
    pub fn from_bytes(
        bytes: &[u8],
        file: PathBuf,
        src_sha256: &str,
        dst_sha256: &str,
    ) -> Result<Self, ProjectorError> {
        let (head, data) = super::framed::unframe(bytes, &MAGIC, FORMAT_VERSION, &file)?;
        let header: HiddenHeader =
            serde_json::from_slice(head).map_err(|source| ProjectorError::Header {
                file: file.clone(),
                source,
            })?;
        if header.src.sha256 != src_sha256 || header.dst.sha256 != dst_sha256 {
            return Err(ProjectorError::BoundToOtherFiles {
                file,
                expected_src_sha256: src_sha256.to_string(),
                found_src_sha256: header.src.sha256.clone(),
                found_src_name: header.src.name.clone(),
                found_src_file: header.src.file.clone(),
                expected_dst_sha256: dst_sha256.to_string(),
                found_dst_sha256: header.dst.sha256.clone(),
                found_dst_name: header.dst.name.clone(),
                found_dst_file: header.dst.file.clone(),
            });
        }
        let n = header
            .d_in
            .checked_mul(header.d_out)
            .and_then(|w| w.checked_add(header.d_out))
            .and_then(|e| e.checked_mul(4))
            .ok_or_else(|| ProjectorError::Invalid {
                file: file.clone(),
                reason: "map size overflows".into(),
            })?;
        if data.len() != n {
            return Err(if data.len() < n {
                super::framed::truncated(&file, "data", n, data.len())
            } else {
                ProjectorError::TrailingBytes {
                    file,
                    extra: (data.len() - n) as u64,
                }
            });
        }
        super::framed::check_sha256(&file, "data", header.data_sha256, data)?;
        if header.k == 0
            || header.k >= header.dst.n_layer
            || header.src_layer + 1 >= header.src.n_layer
        {
            return Err(ProjectorError::Invalid {
                file,
                reason: format!(
                    "k {} / source layer {} do not fit {} → {} layers",
                    header.k, header.src_layer, header.src.n_layer, header.dst.n_layer
                ),
            });
        }
        let floats: Vec<f32> = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (w, b) = floats.split_at(header.d_in * header.d_out);
        let w = Array2::from_shape_vec((header.d_in, header.d_out), w.to_vec()).map_err(|e| {
            ProjectorError::Invalid {
                file: file.clone(),
                reason: e.to_string(),
            }
        })?;
        Ok(Self {
            src: header.src,
            dst: header.dst,
            k: header.k,
            src_layer: header.src_layer,
            affine: Affine {
                w,
                b: Array1::from_vec(b.to_vec()),
            },
            fit: header.fit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transplant::rope::{RopeKind, RopeSpec};

    fn binding(name: &str, n_layer: usize) -> RungBinding {
        RungBinding {
            name: name.into(),
            file: format!("{name}.gguf"),
            sha256: format!("{name:0>64}"),
            n_layer,
            n_kv_heads: 2,
            head_dim: 64,
            rope: RopeSpec {
                kind: RopeKind::Neox,
                head_dim: 64,
                n_rot: 64,
                freq_base: 1e6,
                freq_scale: 1.0,
            },
        }
    }

    #[test]
    fn source_layer_follows_depth() {
        // tier2 (24) ← tier0 (28): block 18 of 24 is 3/4 up; 21 of 28 blocks are below 3/4.
        assert_eq!(source_layer(28, 24, 6), 20);
        assert_eq!(source_layer(28, 24, 2), 25);
        // Same depth: the same boundary as the destination's.
        assert_eq!(source_layer(24, 24, 4), dst_boundary_layer(24, 4));
        // Never the last block.
        assert_eq!(source_layer(4, 4, 1), 2);
        assert!(source_layer(28, 24, 1) <= 26);
    }

    #[test]
    fn file_round_trips_and_refuses_other_bindings() {
        let m = HiddenMap {
            src: binding("a", 4),
            dst: binding("b", 3),
            k: 1,
            src_layer: 2,
            affine: Affine {
                w: Array2::from_shape_fn((3, 2), |(i, j)| (i * 2 + j) as f32),
                b: Array1::from_vec(vec![0.5, -0.5]),
            },
            fit: HiddenFit {
                lambda: 1.0,
                train_rel_rms: 0.1,
                held_out_rel_rms: 0.2,
                rows: 10,
            },
        };
        let bytes = m.to_bytes().unwrap();
        let (s, d) = (m.src.sha256.clone(), m.dst.sha256.clone());
        let back = HiddenMap::from_bytes(&bytes, "x".into(), &s, &d).unwrap();
        assert_eq!(back, m);
        assert!(matches!(
            HiddenMap::from_bytes(&bytes, "x".into(), &d, &s),
            Err(ProjectorError::BoundToOtherFiles { .. })
        ));
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(matches!(
            HiddenMap::from_bytes(&bad, "x".into(), &s, &d),
            Err(ProjectorError::Checksum { .. })
        ));
        assert!(matches!(
            HiddenMap::from_bytes(&bytes[..bytes.len() - 1], "x".into(), &s, &d),
            Err(ProjectorError::Truncated { .. })
        ));
    }

    #[test]
    fn fit_recovers_an_affine_map() {
        let x = Array2::from_shape_fn((64, 3), |(i, j)| ((i * 7 + j * 3) % 11) as f32 - 5.0);
        let y = x.dot(&ndarray::arr2(&[[1.0f32, 0.0], [0.0, 2.0], [1.0, 1.0]])) + 3.0;
        #[allow(clippy::single_range_in_vec_init)]
        let (a, fit) = fit_hidden(x.view(), y.view(), &[0..48], &[48..64]).unwrap();
        assert!(fit.held_out_rel_rms < 1e-3, "{fit:?}");
        assert!((a.b[0] - 3.0).abs() < 1e-2);
    }
}
