//! Errors of reading, querying and writing GGUF files.
//!
//! [`GgufError`] covers opening and parsing a file and the typed metadata accessors;
//! [`WriteError`] covers [`crate::gguf::GgufWriter`]. Every variant that concerns a file names
//! it, and every parse error carries the byte offset at which the problem was found, so a
//! report about a bad download says where it went bad.

use std::fmt;
use std::path::PathBuf;

/// The part of the file a truncation or length error was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// Magic, version and the two counts.
    Header,
    /// The metadata key/value pairs.
    Metadata,
    /// The tensor infos (names, shapes, types, offsets).
    TensorInfo,
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Section::Header => "header",
            Section::Metadata => "metadata",
            Section::TensorInfo => "tensor info",
        })
    }
}

/// Shows up to 8 leading bytes as hex and as text, for "not a GGUF file" reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeadingBytes(pub Vec<u8>);

impl fmt::Display for LeadingBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex: Vec<String> = self.0.iter().map(|b| format!("{b:02x}")).collect();
        let text: String = self
            .0
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    char::from(b)
                } else {
                    '.'
                }
            })
            .collect();
        write!(f, "[{}] \"{}\"", hex.join(" "), text)
    }
}

/// An error opening, parsing or querying a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened, stat'ed or mapped.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The path names a directory or a device, not a file (reported in words: mapping one
    /// fails with an OS error that does not say what is wrong).
    #[error("{file} is not a file (a GGUF model is a regular file)")]
    NotAFile {
        /// The path.
        file: PathBuf,
    },

    /// The file does not start with the `GGUF` magic.
    #[error("{file}: not a GGUF file (starts with {first_bytes})")]
    NotGguf {
        /// The file.
        file: PathBuf,
        /// The first bytes of the file (up to 8).
        first_bytes: LeadingBytes,
    },

    /// A GGUF version other than 2 or 3 (version 1 used 32-bit lengths and is obsolete; a
    /// huge version usually means a big-endian file).
    #[error("{file}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion {
        /// The file.
        file: PathBuf,
        /// The version found.
        version: u32,
    },

    /// The file ends in the middle of a structure.
    #[error(
        "{file}: truncated {section} at offset {offset}: reading {what} needs {needed} bytes, \
         {available} left"
    )]
    Truncated {
        /// The file.
        file: PathBuf,
        /// Which part of the file.
        section: Section,
        /// Absolute byte offset of the read.
        offset: u64,
        /// What was being read, e.g. `"value of key 'general.name'"`.
        what: String,
        /// Bytes the read needs.
        needed: u64,
        /// Bytes left in the file.
        available: u64,
    },

    /// A declared string length or element count cannot fit in the rest of the file; caught
    /// before anything is allocated for it.
    #[error(
        "{file}: {section} at offset {offset}: {what} declares length {length}, which needs at \
         least {min_bytes} bytes but only {available} are left"
    )]
    LengthTooLarge {
        /// The file.
        file: PathBuf,
        /// Which part of the file.
        section: Section,
        /// Absolute byte offset of the length field.
        offset: u64,
        /// What the length belongs to.
        what: String,
        /// The declared length (bytes for a string, elements for an array or count).
        length: u64,
        /// The minimum number of bytes that length implies.
        min_bytes: u64,
        /// Bytes left in the file.
        available: u64,
    },

    /// A metadata value type code outside 0..=12, or a nested array.
    #[error("{file}: metadata at offset {offset}: key '{key}' has invalid value type {code}")]
    InvalidValueType {
        /// The file.
        file: PathBuf,
        /// The key.
        key: String,
        /// The code found (9 here means an array of arrays).
        code: u32,
        /// Absolute byte offset of the type code.
        offset: u64,
    },

    /// A string (key, value or tensor name) is not UTF-8.
    #[error("{file}: {section} at offset {offset}: {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// The file.
        file: PathBuf,
        /// Which part of the file.
        section: Section,
        /// Absolute byte offset of the string's bytes.
        offset: u64,
        /// What the string is.
        what: String,
    },

    /// A key appears twice (llama.cpp refuses such files).
    #[error("{file}: duplicate metadata key '{key}'")]
    DuplicateKey {
        /// The file.
        file: PathBuf,
        /// The key.
        key: String,
    },

    /// An empty metadata key.
    #[error("{file}: metadata key #{index} is empty")]
    EmptyKey {
        /// The file.
        file: PathBuf,
        /// Index of the pair.
        index: u64,
    },

    /// `general.alignment` is zero or not a power of two.
    #[error("{file}: general.alignment = {alignment} is not a power of two")]
    BadAlignment {
        /// The file.
        file: PathBuf,
        /// The value found.
        alignment: u64,
    },

    /// A tensor name appears twice.
    #[error("{file}: duplicate tensor name '{tensor}'")]
    DuplicateTensor {
        /// The file.
        file: PathBuf,
        /// The name.
        tensor: String,
    },

    /// A tensor has more than 4 dimensions (`GGML_MAX_DIMS`).
    #[error("{file}: tensor '{tensor}' has {n_dims} dimensions (at most 4)")]
    TooManyDims {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The count found.
        n_dims: u32,
    },

    /// A tensor's ggml type code is unknown or removed.
    #[error("{file}: tensor '{tensor}' has unknown ggml type {code}")]
    UnknownGgmlType {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The code found.
        code: u32,
    },

    /// A tensor's shape is impossible for its type: a row not a multiple of the block size, or
    /// a size that overflows.
    #[error("{file}: tensor '{tensor}' of type {ggml_type} has invalid shape {dims:?}: {reason}")]
    BadShape {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its type.
        ggml_type: crate::gguf::GgmlType,
        /// Its dimensions, innermost first.
        dims: Vec<u64>,
        /// Why it is invalid.
        reason: &'static str,
    },

    /// A tensor's data offset is not a multiple of the file's alignment.
    #[error(
        "{file}: tensor '{tensor}' offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },

    /// A tensor's data extends past the end of the file: usually a truncated download.
    #[error(
        "{file}: tensor '{tensor}' data [{start}, {end}) extends past the end of the file \
         ({file_len} bytes): truncated download?"
    )]
    TruncatedTensorData {
        /// The file.
        file: PathBuf,
        /// The first tensor found cut short.
        tensor: String,
        /// Absolute offset of its first byte.
        start: u64,
        /// Absolute offset one past its last byte.
        end: u64,
        /// The file's length.
        file_len: u64,
    },

    /// A required metadata key is absent.
    #[error("{file}: missing metadata key '{key}'")]
    MissingKey {
        /// The key.
        key: String,
        /// The file.
        file: PathBuf,
    },

    /// A metadata key has a type the accessor cannot convert (or an integer out of range).
    #[error("{file}: metadata key '{key}' is {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the accessor accepts, e.g. `"an integer fitting u32"`.
        expected: &'static str,
        /// What was found, e.g. `"string"` or `"i64 -3"`.
        found: String,
        /// The file.
        file: PathBuf,
    },

    /// Metadata that is present and well-typed but inconsistent (e.g. zero heads).
    #[error("{file}: invalid model metadata: {reason}")]
    InvalidMetadata {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A tensor named by the caller does not exist.
    #[error("{file}: no tensor named '{tensor}'")]
    MissingTensor {
        /// The file.
        file: PathBuf,
        /// The name asked for.
        tensor: String,
    },
}

impl GgufError {
    /// The file the error concerns.
    #[must_use]
    pub fn file(&self) -> &std::path::Path {
        match self {
            GgufError::Io { file, .. }
            | GgufError::NotAFile { file }
            | GgufError::NotGguf { file, .. }
            | GgufError::UnsupportedVersion { file, .. }
            | GgufError::Truncated { file, .. }
            | GgufError::LengthTooLarge { file, .. }
            | GgufError::InvalidValueType { file, .. }
            | GgufError::InvalidUtf8 { file, .. }
            | GgufError::DuplicateKey { file, .. }
            | GgufError::EmptyKey { file, .. }
            | GgufError::BadAlignment { file, .. }
            | GgufError::DuplicateTensor { file, .. }
            | GgufError::TooManyDims { file, .. }
            | GgufError::UnknownGgmlType { file, .. }
            | GgufError::BadShape { file, .. }
            | GgufError::MisalignedTensor { file, .. }
            | GgufError::TruncatedTensorData { file, .. }
            | GgufError::MissingKey { file, .. }
            | GgufError::WrongType { file, .. }
            | GgufError::InvalidMetadata { file, .. }
            | GgufError::MissingTensor { file, .. } => file,
        }
    }
}

/// An error building or writing a GGUF file with [`crate::gguf::GgufWriter`].
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Writing, syncing or renaming failed.
    #[error("{file}: {source}")]
    Io {
        /// The file being written (the `.partial` name while writing).
        file: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A metadata key was added twice.
    #[error("duplicate metadata key '{key}'")]
    DuplicateKey {
        /// The key.
        key: String,
    },

    /// An empty metadata key.
    #[error("empty metadata key")]
    EmptyKey,

    /// `general.alignment` was set to something other than a power-of-two `u32`.
    #[error("general.alignment must be a power-of-two u32, got {found}")]
    BadAlignment {
        /// What was given.
        found: String,
    },

    /// A tensor name was added twice.
    #[error("duplicate tensor name '{tensor}'")]
    DuplicateTensor {
        /// The name.
        tensor: String,
    },

    /// A tensor name of 64 bytes or more (`GGML_MAX_NAME`), which llama.cpp refuses.
    #[error("tensor name '{tensor}' is {len} bytes, llama.cpp allows at most 63")]
    TensorNameTooLong {
        /// The name.
        tensor: String,
        /// Its length in bytes.
        len: usize,
    },

    /// A shape that is empty, has more than 4 dimensions, or does not fit the type.
    #[error("tensor '{tensor}': shape {dims:?} is invalid for {ggml_type}: {reason}")]
    BadShape {
        /// The tensor.
        tensor: String,
        /// The shape given.
        dims: Vec<u64>,
        /// The type given.
        ggml_type: crate::gguf::GgmlType,
        /// Why.
        reason: &'static str,
    },

    /// The data given does not have the size the shape and type imply.
    #[error("tensor '{tensor}': {actual} data bytes given, shape and type need {expected}")]
    SizeMismatch {
        /// The tensor.
        tensor: String,
        /// Bytes the shape implies.
        expected: u64,
        /// Bytes given.
        actual: u64,
    },
}

/// Convenience alias for results of this module.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_bytes_shows_hex_and_text() {
        let s = LeadingBytes(b"PK\x03\x04abc".to_vec()).to_string();
        assert_eq!(s, "[50 4b 03 04 61 62 63] \"PK..abc\"");
    }

    #[test]
    fn wrong_type_names_the_file() {
        let e = GgufError::WrongType {
            key: "k".into(),
            expected: "u32",
            found: "string".into(),
            file: "/m/a.gguf".into(),
        };
        assert_eq!(
            e.to_string(),
            "/m/a.gguf: metadata key 'k' is string, expected u32"
        );
        assert_eq!(e.file(), std::path::Path::new("/m/a.gguf"));
    }
}
