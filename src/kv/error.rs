//! Errors of the KV mirror, each naming where in the blob (byte offset, section, stream, layer,
//! tensor) it went wrong, so a bad blob can be diagnosed from the message alone.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which of a layer's two cache tensors an error or a record belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tensor {
    /// The key cache tensor.
    K,
    /// The value cache tensor.
    V,
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::K => "K",
            Self::V => "V",
        })
    }
}

/// A logical position in a snapshot: section (one per llama.cpp KV cache), stream, layer and
/// tensor. Unknown parts are `None`; all-`None` means the blob header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Loc {
    /// Index of the KV-cache section (0 = base cache; an iSWA model has a second, SWA, one).
    pub section: Option<usize>,
    /// Index of the stream inside the section.
    pub stream: Option<usize>,
    /// Index of the layer inside the stream (cache layer order, not model layer id).
    pub layer: Option<usize>,
    /// The tensor of the layer, when the error concerns one.
    pub tensor: Option<Tensor>,
}

impl Loc {
    pub(crate) const HEADER: Self = Self {
        section: None,
        stream: None,
        layer: None,
        tensor: None,
    };
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::with_capacity(3);
        if let Some(s) = self.section {
            parts.push(format!("section {s}"));
        }
        if let Some(s) = self.stream {
            parts.push(format!("stream {s}"));
        }
        match (self.layer, self.tensor) {
            (Some(l), Some(t)) => parts.push(format!("layer {l} {t}")),
            (Some(l), None) => parts.push(format!("layer {l}")),
            (None, Some(t)) => parts.push(format!("{t}")),
            (None, None) => {}
        }
        if parts.is_empty() {
            f.write_str("blob header")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// Everything that can go wrong reading, checking or writing a per-sequence state blob.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The blob ended before a field or a data block it announces.
    #[error(
        "KV state blob truncated at byte {offset} ({at}) while reading {what}: \
         {needed} bytes needed, {} left of {len}", len.saturating_sub(*offset)
    )]
    Truncated {
        /// Byte offset where the missing field or block starts.
        offset: usize,
        /// Bytes the field or block needs.
        needed: usize,
        /// Total length of the blob.
        len: usize,
        /// The field or block that did not fit.
        what: &'static str,
        /// Where in the snapshot the reader was.
        at: Loc,
    },

    /// The first four bytes are not llama.cpp's sequence-state magic.
    #[error(
        "not a llama.cpp per-sequence state blob: magic {found:#010x} at byte 0, expected \
         {:#010x}",
        super::IO_MAGIC
    )]
    BadMagic {
        /// The value found at byte 0.
        found: u32,
    },

    /// A cache tensor of a type the mirror cannot decode to `f32` (in practice: a quantized cache).
    #[error(
        "KV cache tensor type {ggml_type} ({}){} is not supported: the KV mirror needs an F16, \
         BF16 or F32 KV cache; create the llama.cpp context with type_k/type_v = F16 (or F32) \
         instead of a quantized cache type",
        ggml_type_name(*.ggml_type), where_suffix(*.offset, *.at)
    )]
    UnsupportedCacheType {
        /// The ggml type id found.
        ggml_type: i32,
        /// Byte offset of the type field, when it came from a blob.
        offset: Option<usize>,
        /// Where in the snapshot (layer and tensor) it was found.
        at: Loc,
    },

    /// A K (or row-major V) row size that is not a whole number of elements.
    #[error(
        "row size {row_bytes} bytes at byte {offset} ({at}) is not a multiple of the \
         {elem_bytes}-byte element size of its cache type"
    )]
    RowBytesMismatch {
        /// Byte offset of the row-size field.
        offset: usize,
        /// The row size found.
        row_bytes: u64,
        /// Element size of the declared type.
        elem_bytes: usize,
        /// Where in the snapshot it was found.
        at: Loc,
    },

    /// The element size stored with a transposed V tensor disagrees with its type.
    #[error(
        "element size {found} at byte {offset} ({at}) does not match ggml type {ggml_type} \
         ({}), whose elements are {expected} bytes", ggml_type_name(*.ggml_type)
    )]
    ElementSizeMismatch {
        /// Byte offset of the element-size field.
        offset: usize,
        /// The declared ggml type.
        ggml_type: i32,
        /// The element size found.
        found: u32,
        /// The element size of `ggml_type`.
        expected: usize,
        /// Where in the snapshot it was found.
        at: Loc,
    },

    /// A count in the blob is larger than the rest of the blob could possibly hold; checked
    /// before anything is allocated for it.
    #[error(
        "implausible {what} = {count} at byte {offset} ({at}): at least {min_bytes} bytes would \
         follow, only {remaining} remain (blob truncated or corrupt)"
    )]
    ImplausibleCount {
        /// Byte offset of the count field.
        offset: usize,
        /// The counted thing.
        what: &'static str,
        /// The count found.
        count: u64,
        /// Smallest number of bytes that `count` items need (saturated).
        min_bytes: u64,
        /// Bytes left in the blob after the count field.
        remaining: usize,
        /// Where in the snapshot it was found.
        at: Loc,
    },

    /// The `v_trans` flag is neither 0 nor 1, which llama.cpp never writes: the blob is corrupt
    /// or was parsed with the wrong [`ParseOptions`](super::ParseOptions).
    #[error(
        "v_trans = {value} at byte {offset} ({at}) is neither 0 nor 1: corrupt blob, or wrong \
         ParseOptions (has_cell_ext / has_v)"
    )]
    BadVTrans {
        /// Byte offset of the flag.
        offset: usize,
        /// The value found.
        value: u32,
        /// Where in the snapshot it was found.
        at: Loc,
    },

    /// Bytes after the last complete section that are too few to start another one.
    #[error("{remaining} trailing bytes at byte {offset} after the last KV section")]
    TrailingBytes {
        /// Byte offset of the first trailing byte.
        offset: usize,
        /// Number of trailing bytes.
        remaining: usize,
    },

    /// A stream whose arrays disagree with its cells or with each other; such a stream cannot
    /// be written as a valid blob.
    #[error("inconsistent KV stream ({at}): {detail}")]
    ShapeMismatch {
        /// Where in the snapshot the inconsistency is.
        at: Loc,
        /// What disagrees with what.
        detail: String,
    },

    /// [`single_stream`](super::KvSnapshot::single_stream) on a snapshot that is not exactly one
    /// section with one non-empty stream.
    #[error(
        "expected exactly one KV section with one non-empty stream, found {sections} section(s), \
         {streams} stream(s), {non_empty} non-empty"
    )]
    NotSingleStream {
        /// Number of sections.
        sections: usize,
        /// Number of streams over all sections.
        streams: usize,
        /// Number of non-empty streams over all sections.
        non_empty: usize,
    },

    /// [`overwrite_rows_by_position`](super::KvStream::overwrite_rows_by_position) with rows
    /// that do not fit: a position this stream does not hold, more layers than it has, or rows
    /// of another width.
    #[error("cannot overwrite rows by position: {detail}")]
    RowsDoNotFit {
        /// What does not fit.
        detail: String,
    },
}

/// Human name of a ggml type id, for messages only.
pub(crate) fn ggml_type_name(t: i32) -> &'static str {
    match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        42 => "Q2_0",
        _ => "unknown",
    }
}

fn where_suffix(offset: Option<usize>, at: Loc) -> String {
    match offset {
        Some(o) => format!(" at byte {o} ({at})"),
        None if at == Loc::HEADER => String::new(),
        None => format!(" ({at})"),
    }
}
