//! The KV mirror: llama.cpp's per-sequence state blob <-> per-layer K/V arrays.
//!
//! Migrating a generation between rungs of a model ladder means reading one context's KV cache,
//! transforming it (re-rotating K, projecting between models) and writing it into another
//! context. llama.cpp exposes the cache only as an opaque byte blob
//! (`llama_state_seq_get_data_ext` / `llama_state_seq_set_data_ext`), so this module decodes that
//! blob into arrays and encodes arrays back into a blob llama.cpp accepts:
//!
//! - [`KvSnapshot`] — one whole blob: the source sequence id and one [`KvSection`] per KV cache of
//!   the context (a plain model has one; an iSWA model such as Gemma 3 has a base and an SWA one).
//! - [`KvSection`] — the streams of one cache; a stream that holds no cell of the sequence is
//!   `None` (the blob stores only its zero cell count).
//! - [`KvStream`] — the exported cells ([`Cell`]: position, sequence ids, optional [`CellExt`])
//!   and one [`LayerKv`] per cache layer.
//! - [`LayerKv`] — K and V of one layer as `f32` arrays in `[cell][n_embd]` order whatever the
//!   layout in the blob (V is stored transposed, `[dim][cell]`, when flash attention is off),
//!   plus the [`CacheType`] each is stored as.
//! - [`ParseOptions`] — the two facts the blob does not record about itself.
//! - [`KvError`] — every failure, naming the byte offset and section/stream/layer it concerns.
//!
//! Parsing never panics and never allocates more than a small multiple of the input length:
//! every count is checked against the bytes left before anything is reserved for it.
//! [`KvSnapshot::to_bytes`] validates shapes first, so a transformed cache with the wrong shape is
//! an error rather than a blob that llama.cpp would misread. Decoding then encoding an F16, BF16
//! or F32 blob reproduces it byte for byte (the one exception: signalling-NaN payloads in F16/BF16
//! come back quietened, as the `f32` round trip quiets them; llama.cpp never produces them).
//!
//! Layout, as written by the vendored llama.cpp (`llama-cpp-sys-2` 0.1.161:
//! `llama_context::state_seq_get_data`, `llama_kv_cache::state_write{,_meta,_data}`), all
//! little-endian, no padding:
//!
//! ```text
//! u32 magic = 0xaf143cd8, i32 seq_id
//! per KV cache (until the end of the blob):
//!   u32 n_stream
//!   per stream: u32 cell_count            (0 => nothing more for this stream)
//!     cell_count x { i32 pos, u32 n_seq_id, [ext {i32 x, i32 y, i32 tok}], n_seq_id x i32 }
//!     u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
//!     n_layer x K { i32 type, u64 row_bytes, cell_count x row_bytes }
//!     unless the cache has no V (MLA):
//!       v_trans == 0: n_layer x V { i32 type, u64 row_bytes, cell_count x row_bytes }
//!       v_trans == 1: n_layer x V { i32 type, u32 el_bytes, u32 n_embd_v, n_embd_v x cell_count x el }
//! ```
//!
//! Only host blobs are understood: with `LLAMA_STATE_SEQ_FLAGS_ON_DEVICE` llama.cpp keeps the
//! tensor data on the device and the blob does not contain it.

mod blob;
mod error;
#[cfg(test)]
mod tests;

use half::{bf16, f16};
use ndarray::Array2;
use serde::{Deserialize, Serialize};

pub use error::{KvError, Loc, Tensor};

/// Magic number that opens every per-sequence state blob (`io_magic` in `llama-context.cpp`).
pub const IO_MAGIC: u32 = 0xaf14_3cd8;

/// Storage type of a K or V cache tensor that the mirror can decode to `f32`: the one list of
/// cache types, also what a context is created with ([`crate::engine::ContextConfig`]), since
/// only a cache the mirror reads can be transplanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheType {
    /// `GGML_TYPE_F32` (0), 4 bytes per element.
    F32,
    /// `GGML_TYPE_F16` (1), 2 bytes per element; llama.cpp's default cache type.
    #[default]
    F16,
    /// `GGML_TYPE_BF16` (30), 2 bytes per element.
    BF16,
}

impl CacheType {
    /// The ggml type id as it appears in the blob.
    #[must_use]
    pub const fn ggml_type(self) -> i32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::BF16 => 30,
        }
    }

    /// Maps a ggml type id to a supported cache type.
    ///
    /// # Errors
    /// [`KvError::UnsupportedCacheType`] for every other type — quantized caches in particular,
    /// whose blocks (and, in this llama.cpp version, Hadamard rotation) the mirror does not undo.
    pub const fn from_ggml(ggml_type: i32) -> Result<Self, KvError> {
        match ggml_type {
            0 => Ok(Self::F32),
            1 => Ok(Self::F16),
            30 => Ok(Self::BF16),
            _ => Err(KvError::UnsupportedCacheType {
                ggml_type,
                offset: None,
                at: Loc::HEADER,
            }),
        }
    }

    /// Bytes per element (`ggml_type_size`).
    #[must_use]
    pub const fn elem_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// Rounds `x` to the precision of this type, as storing it in a cache and reading it back
    /// would. Useful to compare a transformed cache with what llama.cpp will actually hold.
    #[must_use]
    pub fn quantize(self, x: f32) -> f32 {
        match self {
            Self::F32 => x,
            Self::F16 => f16::from_f32(x).to_f32(),
            Self::BF16 => bf16::from_f32(x).to_f32(),
        }
    }
}

/// The facts a blob does not record about itself; they follow from the model and context that
/// wrote it and must match them, or the parse fails (or, rarely, misreads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParseOptions {
    /// Each cell carries a [`CellExt`] record: llama.cpp's `llama_kv_cache::has_cell_ext()`,
    /// true for M-RoPE models (`n_pos_per_embd > 1`, e.g. Qwen2-VL) and models with per-layer
    /// embeddings (`ple_n_heads > 0`); false for Llama, Qwen2/2.5 and Gemma 3 text models.
    pub has_cell_ext: bool,
    /// The cache stores V tensors. False only for MLA models (DeepSeek-V2/V3 style), whose cache
    /// holds K alone and whose blob has no V records at all.
    pub has_v: bool,
    /// Number of KV sections the blob must hold: 1 for a plain model, 2 for an iSWA model (1 if
    /// exported with `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`). `None` reads sections until the end
    /// of the blob, at least one; then a blob cut exactly between two sections is not detected.
    pub sections: Option<usize>,
}

impl Default for ParseOptions {
    /// The common case: no cell ext, K and V present, any number of sections.
    fn default() -> Self {
        Self {
            has_cell_ext: false,
            has_v: true,
            sections: None,
        }
    }
}

/// Extra per-cell record (`llama_kv_cell_ext`) written when the cache needs it
/// (see [`ParseOptions::has_cell_ext`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CellExt {
    /// M-RoPE 2D spatial position, x.
    pub x: i32,
    /// M-RoPE 2D spatial position, y.
    pub y: i32,
    /// Token id of the cell (`LLAMA_TOKEN_NULL` = -1 for embedding input).
    pub tok: i32,
}

/// One exported KV cell: a token's position and the sequences that share it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Cell {
    /// Position of the token in its sequence.
    pub pos: i32,
    /// Sequences the cell belongs to; exactly one for a per-sequence export, which is also what
    /// llama.cpp's per-sequence import demands.
    pub seq_ids: Vec<i32>,
    /// The cell's ext record, present exactly when the cache has cell ext.
    pub ext: Option<CellExt>,
}

/// K and V of one cache layer for every exported cell.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerKv {
    /// Keys, `[cell][n_embd_k_gqa]`, as cached: already rotated to their positions.
    pub k: Array2<f32>,
    /// Values, `[cell][n_embd_v_gqa]`, whatever the layout in the blob. For a cache without V
    /// ([`KvStream::has_v`] false) this is `[cell][0]`.
    pub v: Array2<f32>,
    /// Storage type of K.
    pub k_type: CacheType,
    /// Storage type of V (for a cache without V: by convention equal to `k_type`, never written).
    pub v_type: CacheType,
}

impl LayerKv {
    /// Width of a K row (`n_embd_k_gqa`).
    #[must_use]
    pub fn n_embd_k(&self) -> usize {
        self.k.ncols()
    }

    /// Width of a V row (`n_embd_v_gqa`; 0 for a cache without V).
    #[must_use]
    pub fn n_embd_v(&self) -> usize {
        self.v.ncols()
    }
}

/// The cells of one stream of one KV cache, and their K/V per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct KvStream {
    /// Exported cells, in blob order (ascending cache slot, which is not necessarily ascending
    /// position).
    pub cells: Vec<Cell>,
    /// V is stored transposed (`[dim][cell]`) in the blob; llama.cpp uses that layout when flash
    /// attention is off. The arrays here are `[cell][dim]` either way; this only decides how
    /// [`KvSnapshot::to_bytes`] writes them, and it must match the importing context.
    pub v_trans: bool,
    /// Hadamard rotation size of K (0 unless the cache is quantized); the importing context
    /// checks it.
    pub n_rot_k: u32,
    /// Hadamard rotation size of V (0 unless the cache is quantized); the importing context
    /// checks it.
    pub n_rot_v: u32,
    /// Whether the cache has V tensors (false only for MLA caches; see [`ParseOptions::has_v`]).
    pub has_v: bool,
    /// One entry per cache layer, in cache order (layers without KV are absent, so index ≠ model
    /// layer id for models that skip some; an iSWA section holds only its own layers).
    pub layers: Vec<LayerKv>,
}

impl KvStream {
    /// Number of cache layers.
    #[must_use]
    pub fn n_layer(&self) -> usize {
        self.layers.len()
    }

    /// Number of cells.
    #[must_use]
    pub fn n_cells(&self) -> usize {
        self.cells.len()
    }

    /// Positions of the cells, in cell order.
    #[must_use]
    pub fn positions(&self) -> Vec<i32> {
        self.cells.iter().map(|c| c.pos).collect()
    }

    /// Drops the cells of positions `end` and later, with their rows at every layer (a
    /// native prefix state cut to the part a switch uses). Returns the cells kept.
    pub fn keep_positions_below(&mut self, end: i32) -> usize {
        let keep: Vec<usize> = (0..self.cells.len())
            .filter(|&i| self.cells[i].pos < end)
            .collect();
        if keep.len() == self.cells.len() {
            return keep.len();
        }
        self.cells = keep.iter().map(|&i| self.cells[i].clone()).collect();
        for l in &mut self.layers {
            l.k = l.k.select(ndarray::Axis(0), &keep);
            l.v = l.v.select(ndarray::Axis(0), &keep);
        }
        keep.len()
    }

    /// Checks that the stream can be written as a valid blob: every layer has one K and one V
    /// row per cell, a cache without V has zero-width V, the cells agree on having an ext record,
    /// and every count fits its field.
    ///
    /// # Errors
    /// [`KvError::ShapeMismatch`] naming the first layer (or cell) that disagrees.
    pub fn validate(&self) -> Result<(), KvError> {
        blob::validate_stream(self)
    }

    /// Overwrites, at layers `first_layer ..` (one per layer of `other`), the K and V rows of
    /// every position `other` holds with `other`'s rows of that position. Rows are matched by
    /// position, so the two streams may hold their cells in any slot order. How a switch
    /// splices the destination's own rows over projected ones (the head re-read, top-k
    /// recompute). Returns the number of positions overwritten.
    ///
    /// # Errors
    /// [`KvError::RowsDoNotFit`] when `other` holds a position this stream does not, has more
    /// layers than fit from `first_layer`, or rows of other widths; nothing is changed then.
    pub fn overwrite_rows_by_position(
        &mut self,
        other: &Self,
        first_layer: usize,
    ) -> Result<usize, KvError> {
        let fail = |detail: String| KvError::RowsDoNotFit { detail };
        if first_layer + other.layers.len() > self.layers.len() {
            return Err(fail(format!(
                "{} layers from layer {first_layer} into a stream of {}",
                other.layers.len(),
                self.layers.len()
            )));
        }
        let row_of: std::collections::HashMap<i32, usize> = self
            .cells
            .iter()
            .enumerate()
            .map(|(i, c)| (c.pos, i))
            .collect();
        let rows: Vec<(usize, usize)> = other
            .cells
            .iter()
            .enumerate()
            .map(|(j, c)| {
                row_of
                    .get(&c.pos)
                    .map(|&i| (j, i))
                    .ok_or_else(|| fail(format!("position {} is not in this stream", c.pos)))
            })
            .collect::<Result<_, _>>()?;
        for (i, l) in other.layers.iter().enumerate() {
            let d = &self.layers[first_layer + i];
            if d.k.ncols() != l.k.ncols() || d.v.ncols() != l.v.ncols() {
                return Err(fail(format!(
                    "layer {} rows are {}/{} wide, this stream's {}/{}",
                    first_layer + i,
                    l.k.ncols(),
                    l.v.ncols(),
                    d.k.ncols(),
                    d.v.ncols()
                )));
            }
        }
        for (i, l) in other.layers.iter().enumerate() {
            let d = &mut self.layers[first_layer + i];
            for &(j, r) in &rows {
                d.k.row_mut(r).assign(&l.k.row(j));
                d.v.row_mut(r).assign(&l.v.row(j));
            }
        }
        Ok(rows.len())
    }

    /// Approximate heap bytes this stream occupies in memory (arrays and cells).
    #[must_use]
    pub fn approx_bytes(&self) -> usize {
        let cells: usize = self
            .cells
            .iter()
            .map(|c| size_of::<Cell>() + c.seq_ids.len() * size_of::<i32>())
            .sum();
        let arrays: usize = self
            .layers
            .iter()
            .map(|l| (l.k.len() + l.v.len()) * size_of::<f32>() + size_of::<LayerKv>())
            .sum();
        size_of::<Self>() + cells + arrays
    }
}

/// The streams of one KV cache.
#[derive(Debug, Clone, PartialEq)]
pub struct KvSection {
    /// One entry per stream of the cache; `None` where the stream holds no cell of the sequence.
    pub streams: Vec<Option<KvStream>>,
}

/// Where one tensor's elements lie in a state blob ([`StreamLayout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSpan {
    /// Element type.
    pub ty: CacheType,
    /// Byte offset of the first element.
    pub offset: usize,
    /// Bytes of elements.
    pub len: usize,
    /// Row width (elements per cell).
    pub n_embd: usize,
    /// Stored `[dim][cell]` (V with flash attention off) rather than `[cell][dim]`.
    pub transposed: bool,
}

/// The layout of a single-stream state blob, nothing decoded: each cell's position (in the
/// blob's cell order) and where each layer's K and V lie. For rewriting a blob's K and V in
/// place ([`KvSnapshot::single_stream_layout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLayout {
    /// Cell positions, in cell order.
    pub positions: Vec<i32>,
    /// K of each layer.
    pub k: Vec<TensorSpan>,
    /// V of each layer.
    pub v: Vec<TensorSpan>,
}

/// A decoded per-sequence state blob.
///
/// Produced from, and turned back into, the bytes of llama.cpp's state-seq API
/// (`llama_state_seq_get_data_ext` / `llama_state_seq_set_data_ext`, host flags).
#[derive(Debug, Clone, PartialEq)]
pub struct KvSnapshot {
    /// Sequence id the blob was exported from (llama.cpp ignores it on import: the destination
    /// sequence is an argument of the import call).
    pub seq_id: i32,
    /// One section per KV cache of the context, in llama.cpp's order (base before SWA).
    pub sections: Vec<KvSection>,
}

impl KvSnapshot {
    /// Decodes a blob.
    ///
    /// # Errors
    /// [`KvError::BadMagic`] if the blob does not start with [`IO_MAGIC`];
    /// [`KvError::Truncated`], [`KvError::ImplausibleCount`], [`KvError::TrailingBytes`] or
    /// [`KvError::BadVTrans`] if it is cut short, corrupt, or `opts` does not match the model;
    /// [`KvError::UnsupportedCacheType`] for a quantized (or otherwise non-float) cache;
    /// [`KvError::RowBytesMismatch`] / [`KvError::ElementSizeMismatch`] if a size field
    /// contradicts its type. Every error names its byte offset.
    pub fn parse(bytes: &[u8], opts: ParseOptions) -> Result<Self, KvError> {
        blob::parse(bytes, opts)
    }

    /// Encodes the snapshot as a blob llama.cpp can import. A `Some` stream with no cells is
    /// written as an empty stream, as llama.cpp would.
    ///
    /// # Errors
    /// [`KvError::ShapeMismatch`] if a stream fails [`KvStream::validate`], naming its section,
    /// stream and layer.
    pub fn to_bytes(&self) -> Result<Vec<u8>, KvError> {
        blob::write(self)
    }

    /// Exact length of [`to_bytes`](Self::to_bytes)' output, without encoding.
    ///
    /// # Errors
    /// As [`to_bytes`](Self::to_bytes).
    pub fn encoded_len(&self) -> Result<usize, KvError> {
        blob::encoded_len(self)
    }

    /// Wraps a single stream as a one-section, one-stream snapshot (the shape a plain,
    /// single-stream context exports).
    #[must_use]
    pub fn from_single_stream(seq_id: i32, stream: KvStream) -> Self {
        Self {
            seq_id,
            sections: vec![KvSection {
                streams: vec![Some(stream)],
            }],
        }
    }

    fn streams(&self) -> impl Iterator<Item = &KvStream> {
        self.sections
            .iter()
            .flat_map(|s| s.streams.iter().flatten())
    }

    /// Total number of cells over all sections and streams (an iSWA blob stores a token in both
    /// its sections, so it counts twice there).
    #[must_use]
    pub fn n_cells(&self) -> usize {
        self.streams().map(KvStream::n_cells).sum()
    }

    /// Positions of all cells, section by section and stream by stream, in blob order.
    #[must_use]
    pub fn positions(&self) -> Vec<i32> {
        self.streams()
            .flat_map(|s| s.cells.iter().map(|c| c.pos))
            .collect()
    }

    fn not_single_stream(&self) -> KvError {
        KvError::NotSingleStream {
            sections: self.sections.len(),
            streams: self.sections.iter().map(|s| s.streams.len()).sum(),
            non_empty: self.streams().count(),
        }
    }

    /// The only stream of a one-section, one-stream snapshot — the common case of a plain model
    /// in a single-stream context.
    ///
    /// # Errors
    /// [`KvError::NotSingleStream`] if there is not exactly one section holding exactly one
    /// stream, or that stream is empty.
    pub fn single_stream(&self) -> Result<&KvStream, KvError> {
        match self.sections.as_slice() {
            [KvSection { streams }] => match streams.as_slice() {
                [Some(s)] => Ok(s),
                _ => Err(self.not_single_stream()),
            },
            _ => Err(self.not_single_stream()),
        }
    }

    /// Reads where the tensors of a plain single-stream blob (one section, one stream, no
    /// cell ext) lie, checking it as [`parse`](Self::parse) does, without decoding them.
    ///
    /// # Errors
    /// As [`parse_single_stream`](Self::parse_single_stream).
    pub fn single_stream_layout(bytes: &[u8]) -> Result<StreamLayout, KvError> {
        blob::single_stream_layout(bytes)
    }

    /// Parses the blob of one sequence of a plain single-stream context (what
    /// `llama_state_seq_get_data_ext` writes) and takes out its only stream, with the sequence
    /// id it was exported from.
    ///
    /// # Errors
    /// A parse error, or [`KvError::NotSingleStream`] as for
    /// [`single_stream`](Self::single_stream).
    pub fn parse_single_stream(bytes: &[u8]) -> Result<(i32, KvStream), KvError> {
        let mut snap = Self::parse(
            bytes,
            ParseOptions {
                sections: Some(1),
                ..ParseOptions::default()
            },
        )?;
        let err = snap.not_single_stream();
        match (snap.sections.pop(), snap.sections.is_empty()) {
            (Some(KvSection { streams }), true) => match <[Option<KvStream>; 1]>::try_from(streams)
            {
                Ok([Some(s)]) => Ok((snap.seq_id, s)),
                _ => Err(err),
            },
            _ => Err(err),
        }
    }

    /// Mutable [`single_stream`](Self::single_stream).
    ///
    /// # Errors
    /// As [`single_stream`](Self::single_stream).
    pub fn single_stream_mut(&mut self) -> Result<&mut KvStream, KvError> {
        let err = self.not_single_stream();
        match self.sections.as_mut_slice() {
            [KvSection { streams }] => match streams.as_mut_slice() {
                [Some(s)] => Ok(s),
                _ => Err(err),
            },
            _ => Err(err),
        }
    }

    /// Approximate heap bytes the decoded snapshot occupies in memory (about twice the blob for
    /// an F16 cache, since values are held as `f32`).
    #[must_use]
    pub fn approx_bytes(&self) -> usize {
        size_of::<Self>()
            + self
                .sections
                .iter()
                .map(|s| {
                    size_of::<KvSection>()
                        + s.streams
                            .iter()
                            .map(|t| {
                                t.as_ref()
                                    .map_or(size_of::<Option<KvStream>>(), KvStream::approx_bytes)
                            })
                            .sum::<usize>()
                })
                .sum::<usize>()
    }
}
