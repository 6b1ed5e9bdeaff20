//! [`Projector`]: one fitted route from a source rung to a destination rung, and its
//! `.molt-proj` file format.
//!
//! A projector is only meaningful for the exact pair of GGUF files it was fitted on (a
//! requantised file has other activations), so it carries both files' sha256 in
//! [`RungBinding`]s and [`Projector::load`] refuses any other pair with
//! [`ProjectorError::BoundToOtherFiles`].
//!
//! # File layout (version 1, little-endian)
//!
//! | offset | size | content |
//! |---|---|---|
//! | 0 | 8 | magic `MOLTPROJ` |
//! | 8 | 4 | `u32` format version (1) |
//! | 12 | 4 | `u32` flags, 0 |
//! | 16 | 8 | `u64` header length `H` |
//! | 24 | 32 | sha256 of the header bytes |
//! | 56 | `H` | UTF-8 JSON header: route, bindings, kind, sandwich, dtype, layer table with tensor offsets and shapes, fit metadata, data length and data sha256 |
//! | 56 + `H` | `data_len` | tensors, f16 or f32, each at its offset from the data start |
//!
//! Both sections are checksummed so a flipped byte anywhere is an error, never a silently
//! different map; every length and offset is bounds-checked before it is used, so a
//! truncated or hostile file is an error, never a panic or a huge allocation.

use std::fs;
use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::{ProjectorError, TransplantError};
use super::map::{HeadBlock, LayerMap};
use super::ridge::Affine;
use super::rope::RopeSpec;

/// File magic.
pub const MAGIC: [u8; 8] = *b"MOLTPROJ";
/// Format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the JSON header.
const PREFIX_LEN: usize = 8 + 4 + 4 + 8 + 32;

/// Identity and KV geometry of one rung, as recorded when the projector was fitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RungBinding {
    /// Rung name in the ladder manifest (e.g. `tier0`).
    pub name: String,
    /// GGUF file name (for messages; identity is the hash).
    pub file: String,
    /// Lower-case hex sha256 of the GGUF file.
    pub sha256: String,
    /// Transformer layers.
    pub n_layer: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Head size of K and V.
    pub head_dim: usize,
    /// The rung's RoPE.
    pub rope: RopeSpec,
}

impl RungBinding {
    /// Width of one cache row of K (and V): `n_kv_heads * head_dim`.
    #[must_use]
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Check the geometry is usable.
    ///
    /// # Errors
    /// [`TransplantError::InvalidRope`] for a bad RoPE spec or one whose `head_dim` differs
    /// from the binding's, [`TransplantError::Unsupported`] for zero sizes.
    pub fn validate(&self) -> Result<(), TransplantError> {
        self.rope.validate()?;
        if self.rope.head_dim != self.head_dim {
            return Err(TransplantError::InvalidRope {
                head_dim: self.rope.head_dim,
                n_rot: self.rope.n_rot,
                reason: "rope head_dim differs from the rung's head_dim",
            });
        }
        if self.n_layer == 0 || self.n_kv_heads == 0 {
            return Err(TransplantError::Unsupported {
                kind: "rung",
                reason: format!("rung {} has zero layers or kv heads", self.name),
            });
        }
        Ok(())
    }
}

/// Which family of maps a projector uses (recorded for reports and ablations).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProjectorKind {
    /// One dense affine map per layer (size route).
    Dense,
    /// Block-diagonal per-head affine maps.
    PerHead,
    /// Per-channel scale + offset (precision route).
    Diagonal,
    /// Naive baseline: keep the first dimensions of each head.
    Truncate,
    /// Identity maps (a rung onto itself).
    Identity,
}

impl ProjectorKind {
    /// Lower-case name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::PerHead => "per-head",
            Self::Diagonal => "diagonal",
            Self::Truncate => "truncate",
            Self::Identity => "identity",
        }
    }
}

/// How a destination layer's maps were fitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerFit {
    /// λ of the K map (absolute), if it was fitted.
    pub lambda_k: Option<f64>,
    /// λ of the V map (absolute), if it was fitted.
    pub lambda_v: Option<f64>,
    /// K relative RMS on training rows.
    pub k_train_rel_rms: f64,
    /// K relative RMS on held-out rows.
    pub k_held_out_rel_rms: f64,
    /// V relative RMS on training rows.
    pub v_train_rel_rms: f64,
    /// V relative RMS on held-out rows.
    pub v_held_out_rel_rms: f64,
}

/// The maps producing one destination layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerProjection {
    /// Depth remap: the source layer(s) feeding this layer; with several, their K
    /// (pre-RoPE when sandwiched) and V are concatenated in this order as input features.
    pub src_layers: Vec<usize>,
    /// K map.
    pub k: LayerMap,
    /// V map.
    pub v: LayerMap,
    /// Fit metadata, if the maps were fitted.
    pub fit: Option<LayerFit>,
}

/// A route from one rung's KV cache to another's.
#[derive(Clone, Debug, PartialEq)]
pub struct Projector {
    /// Source rung.
    pub src: RungBinding,
    /// Destination rung.
    pub dst: RungBinding,
    /// Map family.
    pub kind: ProjectorKind,
    /// `true`: un-rotate K at the source's angles, map, re-rotate at the destination's.
    /// `false`: map rotated keys directly (the no-sandwich ablation).
    pub sandwich: bool,
    /// One entry per destination layer.
    pub layers: Vec<LayerProjection>,
}

/// Element type of stored tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorDtype {
    /// IEEE half: half the file size; ~3 significant digits, max 65504.
    F16,
    /// IEEE single: exact round trip. Prefer for diagonal maps, whose scales sit near 1
    /// where f16 steps are 1e-3.
    F32,
}

impl TensorDtype {
    fn size(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

impl Projector {
    /// `"src→dst"`.
    #[must_use]
    pub fn route_name(&self) -> String {
        format!("{}→{}", self.src.name, self.dst.name)
    }

    /// FLOPs of the maps (not the rotations) for `n_cells` cells.
    #[must_use]
    pub fn map_flops(&self, n_cells: usize) -> u64 {
        self.layers
            .iter()
            .map(|l| l.k.flops(n_cells) + l.v.flops(n_cells))
            .sum()
    }

    /// Check the projector is consistent with its bindings: one entry per destination
    /// layer, source indices in range, map widths matching the geometry.
    ///
    /// # Errors
    /// [`TransplantError::ShapeMismatch`], [`TransplantError::LayerOutOfRange`] or the
    /// binding/map errors naming the inconsistency.
    pub fn validate(&self) -> Result<(), TransplantError> {
        self.src.validate()?;
        self.dst.validate()?;
        if self.layers.len() != self.dst.n_layer {
            return Err(TransplantError::ShapeMismatch {
                what: "projector layers vs destination n_layer",
                expected: self.dst.n_layer,
                actual: self.layers.len(),
            });
        }
        for l in &self.layers {
            if l.src_layers.is_empty() {
                return Err(TransplantError::TooFewRows {
                    what: "source layers of a destination layer",
                    rows: 0,
                    needed: 1,
                });
            }
            if let Some(&bad) = l.src_layers.iter().find(|&&s| s >= self.src.n_layer) {
                return Err(TransplantError::LayerOutOfRange {
                    layer: bad,
                    n_layer: self.src.n_layer,
                });
            }
            let in_dim = l.src_layers.len() * self.src.kv_dim();
            for (what_in, what_out, m) in [
                ("K map input width", "K map output width", &l.k),
                ("V map input width", "V map output width", &l.v),
            ] {
                m.validate()?;
                if m.in_dim() != in_dim {
                    return Err(TransplantError::ShapeMismatch {
                        what: what_in,
                        expected: in_dim,
                        actual: m.in_dim(),
                    });
                }
                if m.out_dim() != self.dst.kv_dim() {
                    return Err(TransplantError::ShapeMismatch {
                        what: what_out,
                        expected: self.dst.kv_dim(),
                        actual: m.out_dim(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Check the projector was fitted between the files with these hashes.
    ///
    /// # Errors
    /// [`ProjectorError::BoundToOtherFiles`] naming expected and found hashes and the
    /// recorded rung and file names.
    pub fn check_binding(
        &self,
        file: &Path,
        expect_src_sha256: &str,
        expect_dst_sha256: &str,
    ) -> Result<(), ProjectorError> {
        let same = |a: &str, b: &str| a.trim().eq_ignore_ascii_case(b.trim());
        if same(&self.src.sha256, expect_src_sha256) && same(&self.dst.sha256, expect_dst_sha256) {
            return Ok(());
        }
        Err(ProjectorError::BoundToOtherFiles {
            file: file.to_path_buf(),
            expected_src_sha256: expect_src_sha256.to_string(),
            found_src_sha256: self.src.sha256.clone(),
            found_src_name: self.src.name.clone(),
            found_src_file: self.src.file.clone(),
            expected_dst_sha256: expect_dst_sha256.to_string(),
            found_dst_sha256: self.dst.sha256.clone(),
            found_dst_name: self.dst.name.clone(),
            found_dst_file: self.dst.file.clone(),
        })
    }

    /// Encode as `.molt-proj` bytes.
    ///
    /// # Errors
    /// [`ProjectorError::Transplant`] if the projector is inconsistent,
    /// [`ProjectorError::Invalid`] if a value is not finite or overflows f16.
    pub fn to_bytes(&self, dtype: TensorDtype) -> Result<Vec<u8>, ProjectorError> {
        self.validate()?;
        let mut w = TensorWriter {
            data: Vec::new(),
            dtype,
        };
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(LayerHeader {
                    src_layers: l.src_layers.clone(),
                    k: w.map(&l.k, &format!("layer {i} K"))?,
                    v: w.map(&l.v, &format!("layer {i} V"))?,
                    fit: l.fit.clone(),
                })
            })
            .collect::<Result<Vec<_>, ProjectorError>>()?;
        let header = Header {
            format: "molt-proj".into(),
            route: self.route_name(),
            src: self.src.clone(),
            dst: self.dst.clone(),
            kind: self.kind,
            sandwich: self.sandwich,
            dtype,
            layers,
            data_len: w.data.len() as u64,
            data_sha256: hex::encode(Sha256::digest(&w.data)),
        };
        let json = serde_json::to_vec(&header).map_err(|source| ProjectorError::Header {
            file: PathBuf::from("<memory>"),
            source,
        })?;
        let mut out = Vec::with_capacity(PREFIX_LEN + json.len() + w.data.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&Sha256::digest(&json));
        out.extend_from_slice(&json);
        out.extend_from_slice(&w.data);
        Ok(out)
    }

    /// Decode `.molt-proj` bytes; `file` only labels errors. Does not check the binding.
    ///
    /// # Errors
    /// [`ProjectorError::BadMagic`], [`ProjectorError::UnsupportedVersion`],
    /// [`ProjectorError::Truncated`], [`ProjectorError::TrailingBytes`],
    /// [`ProjectorError::Checksum`], [`ProjectorError::Header`], [`ProjectorError::Invalid`].
    pub fn from_bytes(bytes: &[u8], file: &Path) -> Result<Self, ProjectorError> {
        let (header, data) = parse_header(bytes, file)?;
        decode(&header, data, file)
    }

    /// Write to `path` atomically (a temporary file renamed over it).
    ///
    /// # Errors
    /// As [`Projector::to_bytes`], plus [`ProjectorError::Io`].
    pub fn save(&self, path: &Path, dtype: TensorDtype) -> Result<(), ProjectorError> {
        let bytes = self.to_bytes(dtype)?;
        let io = |source| ProjectorError::Io {
            file: path.to_path_buf(),
            source,
        };
        crate::durable::write(path, &bytes).map_err(io)
    }

    /// Read `path` and check it was fitted between the GGUF files with these sha256s.
    ///
    /// # Errors
    /// [`ProjectorError::BoundToOtherFiles`] if the recorded hashes differ (checked right
    /// after the header, before the tensors are decoded), [`ProjectorError::Io`], and every
    /// error of [`Projector::from_bytes`].
    pub fn load(
        path: &Path,
        expect_src_sha256: &str,
        expect_dst_sha256: &str,
    ) -> Result<Self, ProjectorError> {
        let bytes = fs::read(path).map_err(|source| ProjectorError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        let (header, data) = parse_header(&bytes, path)?;
        let bound = Projector {
            src: header.src.clone(),
            dst: header.dst.clone(),
            kind: header.kind,
            sandwich: header.sandwich,
            layers: Vec::new(),
        };
        bound.check_binding(path, expect_src_sha256, expect_dst_sha256)?;
        decode(&header, data, path)
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    format: String,
    route: String,
    src: RungBinding,
    dst: RungBinding,
    kind: ProjectorKind,
    sandwich: bool,
    dtype: TensorDtype,
    layers: Vec<LayerHeader>,
    data_len: u64,
    data_sha256: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerHeader {
    src_layers: Vec<usize>,
    k: MapHeader,
    v: MapHeader,
    fit: Option<LayerFit>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
enum MapHeader {
    Identity {
        dim: usize,
    },
    Dense {
        w: TensorRef,
        b: TensorRef,
    },
    Diagonal {
        scale: TensorRef,
        offset: TensorRef,
    },
    PerHead {
        in_dim: usize,
        out_dim: usize,
        blocks: Vec<BlockHeader>,
    },
    Truncate {
        n_heads_in: usize,
        head_dim_in: usize,
        n_heads_out: usize,
        head_dim_out: usize,
    },
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BlockHeader {
    input_ranges: Vec<(usize, usize)>,
    output_offset: usize,
    w: TensorRef,
    b: TensorRef,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorRef {
    /// Byte offset from the start of the data section.
    offset: u64,
    shape: Vec<usize>,
}

struct TensorWriter {
    data: Vec<u8>,
    dtype: TensorDtype,
}

impl TensorWriter {
    fn put<'a>(
        &mut self,
        values: impl Iterator<Item = &'a f32>,
        shape: Vec<usize>,
        what: &str,
    ) -> Result<TensorRef, ProjectorError> {
        let offset = self.data.len() as u64;
        for &v in values {
            let bad = |why: &str| ProjectorError::Invalid {
                file: PathBuf::from("<memory>"),
                reason: format!("{what}: value {v} {why}"),
            };
            if !v.is_finite() {
                return Err(bad("is not finite"));
            }
            match self.dtype {
                TensorDtype::F32 => self.data.extend_from_slice(&v.to_le_bytes()),
                TensorDtype::F16 => {
                    let h = half::f16::from_f32(v);
                    if !h.is_finite() {
                        return Err(bad("overflows f16; save as f32"));
                    }
                    self.data.extend_from_slice(&h.to_le_bytes());
                }
            }
        }
        Ok(TensorRef { offset, shape })
    }

    fn affine(&mut self, a: &Affine, what: &str) -> Result<(TensorRef, TensorRef), ProjectorError> {
        let w = self.put(a.w.iter(), vec![a.d_in(), a.d_out()], what)?;
        let b = self.put(a.b.iter(), vec![a.d_out()], what)?;
        Ok((w, b))
    }

    fn map(&mut self, m: &LayerMap, what: &str) -> Result<MapHeader, ProjectorError> {
        Ok(match m {
            LayerMap::Identity { dim } => MapHeader::Identity { dim: *dim },
            LayerMap::Affine(a) => {
                let (w, b) = self.affine(a, what)?;
                MapHeader::Dense { w, b }
            }
            LayerMap::Diagonal { scale, offset } => MapHeader::Diagonal {
                scale: self.put(scale.iter(), vec![scale.len()], what)?,
                offset: self.put(offset.iter(), vec![offset.len()], what)?,
            },
            LayerMap::PerHead {
                in_dim,
                out_dim,
                blocks,
            } => MapHeader::PerHead {
                in_dim: *in_dim,
                out_dim: *out_dim,
                blocks: blocks
                    .iter()
                    .map(|blk| {
                        let (w, b) = self.affine(&blk.affine, what)?;
                        Ok(BlockHeader {
                            input_ranges: blk.input_ranges.clone(),
                            output_offset: blk.output_offset,
                            w,
                            b,
                        })
                    })
                    .collect::<Result<_, ProjectorError>>()?,
            },
            LayerMap::Truncate {
                n_heads_in,
                head_dim_in,
                n_heads_out,
                head_dim_out,
            } => MapHeader::Truncate {
                n_heads_in: *n_heads_in,
                head_dim_in: *head_dim_in,
                n_heads_out: *n_heads_out,
                head_dim_out: *head_dim_out,
            },
        })
    }
}

fn take<'a>(
    bytes: &'a [u8],
    at: usize,
    len: usize,
    section: &'static str,
    file: &Path,
) -> Result<&'a [u8], ProjectorError> {
    let available = bytes.len().saturating_sub(at);
    if len > available {
        return Err(ProjectorError::Truncated {
            file: file.to_path_buf(),
            section,
            needed: len as u64,
            available: available as u64,
        });
    }
    Ok(&bytes[at..at + len])
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn parse_header<'a>(bytes: &'a [u8], file: &Path) -> Result<(Header, &'a [u8]), ProjectorError> {
    let magic = take(bytes, 0, 8, "magic", file).map_err(|_| ProjectorError::BadMagic {
        file: file.to_path_buf(),
        found: bytes[..bytes.len().min(8)].to_vec(),
    })?;
    if magic != MAGIC {
        return Err(ProjectorError::BadMagic {
            file: file.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    let version = le_u32(take(bytes, 8, 4, "version", file)?);
    if version != FORMAT_VERSION {
        return Err(ProjectorError::UnsupportedVersion {
            file: file.to_path_buf(),
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let flags = le_u32(take(bytes, 12, 4, "flags", file)?);
    if flags != 0 {
        return Err(ProjectorError::Invalid {
            file: file.to_path_buf(),
            reason: format!("unknown flags {flags:#x}"),
        });
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(take(bytes, 16, 8, "header length", file)?);
    let header_len = u64::from_le_bytes(len8);
    let stored_sha = take(bytes, 24, 32, "header checksum", file)?;
    let available = bytes.len().saturating_sub(PREFIX_LEN) as u64;
    if header_len > available {
        return Err(ProjectorError::Truncated {
            file: file.to_path_buf(),
            section: "header",
            needed: header_len,
            available,
        });
    }
    // header_len <= bytes.len(), so it fits in usize.
    let json = take(bytes, PREFIX_LEN, header_len as usize, "header", file)?;
    let computed = Sha256::digest(json);
    if computed.as_slice() != stored_sha {
        return Err(ProjectorError::Checksum {
            file: file.to_path_buf(),
            section: "header",
            stored: hex::encode(stored_sha),
            computed: hex::encode(computed),
        });
    }
    let header: Header = serde_json::from_slice(json).map_err(|source| ProjectorError::Header {
        file: file.to_path_buf(),
        source,
    })?;
    if header.format != "molt-proj" {
        return Err(ProjectorError::Invalid {
            file: file.to_path_buf(),
            reason: format!("header format {:?}, expected \"molt-proj\"", header.format),
        });
    }
    let data_start = PREFIX_LEN + json.len();
    let rest = (bytes.len() - data_start) as u64;
    if header.data_len > rest {
        return Err(ProjectorError::Truncated {
            file: file.to_path_buf(),
            section: "data",
            needed: header.data_len,
            available: rest,
        });
    }
    if header.data_len < rest {
        return Err(ProjectorError::TrailingBytes {
            file: file.to_path_buf(),
            extra: rest - header.data_len,
        });
    }
    Ok((header, &bytes[data_start..]))
}

struct TensorReader<'a> {
    data: &'a [u8],
    dtype: TensorDtype,
    file: &'a Path,
}

impl TensorReader<'_> {
    fn invalid(&self, reason: String) -> ProjectorError {
        ProjectorError::Invalid {
            file: self.file.to_path_buf(),
            reason,
        }
    }

    fn read(&self, t: &TensorRef, what: &str) -> Result<Vec<f32>, ProjectorError> {
        let count = t
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| self.invalid(format!("{what}: shape {:?} overflows", t.shape)))?;
        let len = count
            .checked_mul(self.dtype.size())
            .ok_or_else(|| self.invalid(format!("{what}: tensor size overflows")))?;
        let start = usize::try_from(t.offset)
            .map_err(|_| self.invalid(format!("{what}: offset overflows")))?;
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| {
                self.invalid(format!(
                    "{what}: tensor at {start}+{len} outside the {}-byte data section",
                    self.data.len()
                ))
            })?;
        let raw = &self.data[start..end];
        Ok(match self.dtype {
            TensorDtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            TensorDtype::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }

    fn vector(&self, t: &TensorRef, what: &str) -> Result<Array1<f32>, ProjectorError> {
        if t.shape.len() != 1 {
            return Err(self.invalid(format!("{what}: expected a vector, shape {:?}", t.shape)));
        }
        Ok(Array1::from(self.read(t, what)?))
    }

    fn matrix(&self, t: &TensorRef, what: &str) -> Result<Array2<f32>, ProjectorError> {
        let [r, c] = t.shape[..] else {
            return Err(self.invalid(format!("{what}: expected a matrix, shape {:?}", t.shape)));
        };
        let v = self.read(t, what)?;
        Array2::from_shape_vec((r, c), v).map_err(|e| self.invalid(format!("{what}: {e}")))
    }

    fn affine(&self, w: &TensorRef, b: &TensorRef, what: &str) -> Result<Affine, ProjectorError> {
        Ok(Affine {
            w: self.matrix(w, what)?,
            b: self.vector(b, what)?,
        })
    }

    fn map(&self, m: &MapHeader, what: &str) -> Result<LayerMap, ProjectorError> {
        Ok(match m {
            MapHeader::Identity { dim } => LayerMap::Identity { dim: *dim },
            MapHeader::Dense { w, b } => LayerMap::Affine(self.affine(w, b, what)?),
            MapHeader::Diagonal { scale, offset } => LayerMap::Diagonal {
                scale: self.vector(scale, what)?,
                offset: self.vector(offset, what)?,
            },
            MapHeader::PerHead {
                in_dim,
                out_dim,
                blocks,
            } => LayerMap::PerHead {
                in_dim: *in_dim,
                out_dim: *out_dim,
                blocks: blocks
                    .iter()
                    .map(|b| {
                        Ok(HeadBlock {
                            input_ranges: b.input_ranges.clone(),
                            output_offset: b.output_offset,
                            affine: self.affine(&b.w, &b.b, what)?,
                        })
                    })
                    .collect::<Result<_, ProjectorError>>()?,
            },
            MapHeader::Truncate {
                n_heads_in,
                head_dim_in,
                n_heads_out,
                head_dim_out,
            } => LayerMap::Truncate {
                n_heads_in: *n_heads_in,
                head_dim_in: *head_dim_in,
                n_heads_out: *n_heads_out,
                head_dim_out: *head_dim_out,
            },
        })
    }
}

fn decode(header: &Header, data: &[u8], file: &Path) -> Result<Projector, ProjectorError> {
    let computed = hex::encode(Sha256::digest(data));
    if !computed.eq_ignore_ascii_case(&header.data_sha256) {
        return Err(ProjectorError::Checksum {
            file: file.to_path_buf(),
            section: "data",
            stored: header.data_sha256.clone(),
            computed,
        });
    }
    let reader = TensorReader {
        data,
        dtype: header.dtype,
        file,
    };
    let layers = header
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            Ok(LayerProjection {
                src_layers: l.src_layers.clone(),
                k: reader.map(&l.k, &format!("layer {i} K"))?,
                v: reader.map(&l.v, &format!("layer {i} V"))?,
                fit: l.fit.clone(),
            })
        })
        .collect::<Result<Vec<_>, ProjectorError>>()?;
    let p = Projector {
        src: header.src.clone(),
        dst: header.dst.clone(),
        kind: header.kind,
        sandwich: header.sandwich,
        layers,
    };
    p.validate().map_err(|e| ProjectorError::Invalid {
        file: file.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests;
