//! GGUF v2/v3 files: reading, querying, writing.
//!
//! - [`GgufFile`] maps a file read-only and parses its header, every metadata pair (arrays
//!   in full — a Qwen vocabulary is 151,936 strings) and its tensor infos, checking each
//!   tensor's extent against the file so a truncated download is an error here, not a
//!   fault inside llama.cpp. Typed accessors ([`GgufFile::get_u32`], [`GgufFile::get_str`],
//!   …) return [`GgufError::MissingKey`] / [`GgufError::WrongType`] naming the file.
//! - [`Value`] / [`ArrayValue`] are the typed metadata values; [`GgmlType`] the tensor
//!   element types with their block geometry.
//! - [`ModelFacts`] is the geometry llama.cpp will derive (layers, heads, `head_dim`, RoPE
//!   base and [`RopeKind`]), read without loading the model.
//! - [`TokenizerIdentity`] decides whether two files share a tokenizer, and says where they
//!   differ ([`TokenizerMismatch`]).
//! - [`GgufWriter`] writes valid GGUF v3 files atomically (for tests and tiny models).
//! - [`truncate::last_blocks`] cuts a model down to its last k blocks (top-k recompute).
//!
//! Molt carries its own reader rather than `gguf-rs` (which keeps 3 elements of each array
//! by default and copies the file) so that errors are typed, name the file and the offset,
//! and no input — truncated, mutated, or hostile — causes a panic or a huge allocation.

mod error;
mod facts;
mod ggml_type;
mod reader;
mod tokenizer;
pub mod truncate;
mod value;
mod writer;

pub use error::{GgufError, LeadingBytes, Result, Section, WriteError};
pub use facts::{ModelFacts, RopeFacts, RopeKind, RopeScaling, file_type_name, rope_kind};
pub use ggml_type::GgmlType;
pub use reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, FromValue, GGUF_MAGIC, GgufFile, MAX_DIMS, TensorInfo,
};
pub use tokenizer::{
    MismatchReason, SpecialTokens, TokenizerDigest, TokenizerIdentity, TokenizerMismatch,
    compare_files,
};
pub use value::{ArrayValue, Value, ValueType};
pub use writer::GgufWriter;
