//! Errors of the transplant module.
//!
//! [`TransplantError`] covers the math (shapes, RoPE specs, ridge solves, fitting);
//! [`ProjectorError`] covers `.molt-proj` files (I/O, corruption, binding to other model
//! files). Every variant carries the typed values a caller needs to report or recover, so no
//! message has to be parsed.

use std::path::PathBuf;

/// Error from the RoPE, ridge, map, projection and fitting code.
#[derive(Debug, thiserror::Error)]
pub enum TransplantError {
    /// Two sizes that must agree do not.
    #[error("shape mismatch in {what}: expected {expected}, got {actual}")]
    ShapeMismatch {
        /// Which quantity disagreed (e.g. "positions vs rows").
        what: &'static str,
        /// The size the operation required.
        expected: usize,
        /// The size it was given.
        actual: usize,
    },
    /// A width is not a multiple of the head size it must be split into.
    #[error("{what}: width {width} is not a positive multiple of {unit}")]
    NotMultiple {
        /// Which quantity was being split.
        what: &'static str,
        /// The width given.
        width: usize,
        /// The unit it must be a multiple of.
        unit: usize,
    },
    /// A RoPE spec that ggml would not accept (odd `n_rot`, `n_rot > head_dim`, ...).
    #[error("invalid RoPE spec (head_dim {head_dim}, n_rot {n_rot}): {reason}")]
    InvalidRope {
        /// The spec's head size.
        head_dim: usize,
        /// The spec's rotated dimension count.
        n_rot: usize,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The regularised normal matrix was not positive definite (λ = 0 on rank-deficient data).
    #[error("ridge normal matrix not positive definite at lambda {lambda} (pivot {pivot})")]
    NotPositiveDefinite {
        /// The λ that was tried.
        lambda: f64,
        /// The Cholesky pivot that failed.
        pivot: usize,
    },
    /// Not enough rows to fit or evaluate.
    #[error("{what}: {rows} rows, need at least {needed}")]
    TooFewRows {
        /// Which data set was short.
        what: &'static str,
        /// Rows given.
        rows: usize,
        /// Rows required.
        needed: usize,
    },
    /// An empty λ grid, or a grid with a negative or non-finite λ.
    #[error("invalid lambda grid: {reason}")]
    InvalidLambda {
        /// Why the grid was refused.
        reason: &'static str,
    },
    /// A layer index outside a rung's layer count.
    #[error("layer {layer} out of range for a rung with {n_layer} layers")]
    LayerOutOfRange {
        /// The index given.
        layer: usize,
        /// The rung's layer count.
        n_layer: usize,
    },
    /// A row range outside the sample set.
    #[error("row range {start}..{end} out of range for {n_rows} rows")]
    RowsOutOfRange {
        /// Range start.
        start: usize,
        /// Range end (exclusive).
        end: usize,
        /// Rows available.
        n_rows: usize,
    },
    /// The requested map kind cannot express this route (e.g. diagonal across head sizes).
    #[error("{kind} map unsupported here: {reason}")]
    Unsupported {
        /// The map kind requested.
        kind: &'static str,
        /// Why it does not apply.
        reason: String,
    },
    /// Input contains NaN or infinity where a fit needs finite numbers.
    #[error("non-finite value in {what}")]
    NonFinite {
        /// Which input had it.
        what: &'static str,
    },
}

/// Error reading, writing or binding a `.molt-proj` projector file.
#[derive(Debug, thiserror::Error)]
pub enum ProjectorError {
    /// The file could not be read or written.
    #[error("projector file {}: {source}", file.display())]
    Io {
        /// The file.
        file: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the `.molt-proj` magic.
    #[error("projector file {}: bad magic {found:02x?} (not a .molt-proj file)", file.display())]
    BadMagic {
        /// The file.
        file: PathBuf,
        /// The first bytes found.
        found: Vec<u8>,
    },
    /// A format version this code does not read.
    #[error("projector file {}: format version {found}, this build reads {supported}", file.display())]
    UnsupportedVersion {
        /// The file.
        file: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this code reads.
        supported: u32,
    },
    /// The file ends before a section it declares.
    #[error("projector file {}: truncated in {section}: need {needed} bytes, have {available}", file.display())]
    Truncated {
        /// The file.
        file: PathBuf,
        /// The section being read.
        section: &'static str,
        /// Bytes the section needs.
        needed: u64,
        /// Bytes left.
        available: u64,
    },
    /// Bytes after the declared end of the data section.
    #[error("projector file {}: {extra} trailing bytes after the data section", file.display())]
    TrailingBytes {
        /// The file.
        file: PathBuf,
        /// How many.
        extra: u64,
    },
    /// A checksum over the header or data section does not match.
    #[error("projector file {}: {section} checksum mismatch (stored {stored}, computed {computed})", file.display())]
    Checksum {
        /// The file.
        file: PathBuf,
        /// "header" or "data".
        section: &'static str,
        /// Hex sha256 stored in the file.
        stored: String,
        /// Hex sha256 of the bytes read.
        computed: String,
    },
    /// The JSON header does not parse.
    #[error("projector file {}: header JSON: {source}", file.display())]
    Header {
        /// The file.
        file: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The header parses but describes an inconsistent projector.
    #[error("projector file {}: invalid: {reason}", file.display())]
    Invalid {
        /// The file.
        file: PathBuf,
        /// What is inconsistent.
        reason: String,
    },
    /// The projector was fitted between other model files than the ones expected.
    #[error(
        "projector file {} is bound to other model files: \
         source expected sha256 {expected_src_sha256}, found {found_src_sha256} ({found_src_name}, {found_src_file}); \
         destination expected sha256 {expected_dst_sha256}, found {found_dst_sha256} ({found_dst_name}, {found_dst_file})",
        file.display()
    )]
    BoundToOtherFiles {
        /// The projector file.
        file: PathBuf,
        /// Source GGUF sha256 the caller expected.
        expected_src_sha256: String,
        /// Source GGUF sha256 recorded in the projector.
        found_src_sha256: String,
        /// Source rung name recorded in the projector.
        found_src_name: String,
        /// Source GGUF file name recorded in the projector.
        found_src_file: String,
        /// Destination GGUF sha256 the caller expected.
        expected_dst_sha256: String,
        /// Destination GGUF sha256 recorded in the projector.
        found_dst_sha256: String,
        /// Destination rung name recorded in the projector.
        found_dst_name: String,
        /// Destination GGUF file name recorded in the projector.
        found_dst_file: String,
    },
    /// An anchor (a rung's native state of the template's opening) of another model file.
    #[error(
        "anchor file {} is bound to other model files: expected sha256 {expected_sha256}, \
         found {found_sha256} ({found_name}, {found_file})",
        file.display()
    )]
    AnchorBoundToOtherFile {
        /// The anchor file.
        file: PathBuf,
        /// GGUF sha256 the caller expected.
        expected_sha256: String,
        /// GGUF sha256 recorded in the anchor.
        found_sha256: String,
        /// Rung name recorded in the anchor.
        found_name: String,
        /// GGUF file name recorded in the anchor.
        found_file: String,
    },
    /// The projector is internally inconsistent before saving.
    #[error("projector invalid: {0}")]
    Transplant(#[from] TransplantError),
}
