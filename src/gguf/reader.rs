//! The GGUF reader: [`GgufFile`] over a read-only memory map, with [`TensorInfo`]s.
//!
//! The whole file is mapped (`memmap2`) and parsed in place: metadata is decoded into owned
//! [`Value`]s (a Qwen vocabulary of 151,936 strings plus ~151k merges decodes in tens of
//! milliseconds), while tensor data is never copied — [`GgufFile::tensor_data`] hands out
//! slices of the map. Parsing is defensive: every length is checked against the bytes left
//! in the file before anything is allocated for it, every tensor's extent is checked against
//! the file length (a truncated download is [`GgufError::TruncatedTensorData`], not a fault
//! inside llama.cpp later), and no input makes it panic.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::gguf::error::{GgufError, LeadingBytes, Result, Section};
use crate::gguf::ggml_type::GgmlType;
use crate::gguf::value::{ArrayValue, Value, ValueType};

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// `GGML_MAX_DIMS`: tensors have at most this many dimensions.
pub const MAX_DIMS: u32 = 4;

/// One tensor's entry in the tensor-info table.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorInfo {
    /// The tensor name, e.g. `"blk.0.attn_q.weight"`.
    pub name: String,
    /// Dimensions, innermost first (`ne[0]` is the row length / input features).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes, from `dims` and the type's block geometry.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dimensions).
    #[must_use]
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The bytes behind a [`GgufFile`]: a read-only map of the file, or an owned buffer.
enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: header, all metadata, tensor infos, and the mapped bytes.
pub struct GgufFile {
    path: PathBuf,
    backing: Backing,
    parsed: Parsed,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.parsed.version)
            .field("file_len", &self.backing.len())
            .field("n_metadata", &self.parsed.metadata.len())
            .field("n_tensors", &self.parsed.tensors.len())
            .finish_non_exhaustive()
    }
}

/// Everything parsed out of the bytes.
struct Parsed {
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Maps the file at `path` read-only and parses it.
    ///
    /// # Errors
    /// [`GgufError::Io`] if the file cannot be opened or mapped; any parse error (bad magic,
    /// unsupported version, truncation, impossible lengths, bad tensor infos) and
    /// [`GgufError::TruncatedTensorData`] if a tensor extends past the end of the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            file: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(GgufError::NotAFile { file: path });
        }
        let len = meta.len();
        let backing = if len == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this process. Molt treats model
            // files as immutable once written (the writer renames complete files into
            // place), so no other process truncates or rewrites them while mapped; that is
            // the one condition under which reading a map would be undefined behaviour.
            Backing::Mapped(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let parsed = parse(&path, &backing)?;
        Ok(GgufFile {
            path,
            backing,
            parsed,
        })
    }

    /// Parses an in-memory GGUF image; `label` stands in for the file name in errors.
    ///
    /// # Errors
    /// As [`GgufFile::open`], except that there is no I/O.
    pub fn from_bytes(label: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        let path = label.into();
        let backing = Backing::Owned(bytes);
        let parsed = parse(&path, &backing)?;
        Ok(GgufFile {
            path,
            backing,
            parsed,
        })
    }

    /// The file's path (or the label given to [`GgufFile::from_bytes`]).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    #[must_use]
    pub fn version(&self) -> u32 {
        self.parsed.version
    }

    /// The file length in bytes.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.backing.len() as u64
    }

    /// The whole file's bytes (the map).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.backing
    }

    /// The data-section alignment (`general.alignment`, default 32).
    #[must_use]
    pub fn alignment(&self) -> u64 {
        self.parsed.alignment
    }

    /// Absolute offset of the data section.
    #[must_use]
    pub fn data_offset(&self) -> u64 {
        self.parsed.data_offset
    }

    /// All metadata pairs, in file order.
    #[must_use]
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.parsed.metadata
    }

    /// The value of `key`, if present.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.parsed
            .key_index
            .get(key)
            .map(|&i| &self.parsed.metadata[i].1)
    }

    /// The value of `key`.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] if absent.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
            file: self.path.clone(),
        })
    }

    /// The value of `key` converted to `T` (see [`FromValue`] for what converts).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] if absent, [`GgufError::WrongType`] if it does not convert.
    pub fn get_as<T: FromValue>(&self, key: &str) -> Result<T> {
        let v = self.require(key)?;
        T::from_value(v).ok_or_else(|| self.wrong_type(key, T::EXPECTED, v))
    }

    /// Like [`GgufFile::get_as`], but an absent key is `Ok(None)`.
    ///
    /// # Errors
    /// [`GgufError::WrongType`] if present and not convertible.
    pub fn get_opt<T: FromValue>(&self, key: &str) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => T::from_value(v)
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, T::EXPECTED, v)),
        }
    }

    /// `key` as a `u32`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_as(key)
    }

    /// `key` as a `u64`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_as(key)
    }

    /// `key` as an `i32`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.get_as(key)
    }

    /// `key` as an `i64`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_as(key)
    }

    /// `key` as an `f32`; `f32` and `f64` values are accepted.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get_as(key)
    }

    /// `key` as an `f64`; `f32` and `f64` values are accepted.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get_as(key)
    }

    /// `key` as a `bool`.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.get_as(key)
    }

    /// `key` as a string.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong_type(key, "string", v))
    }

    /// `key` as an array of any element type.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_array(&self, key: &str) -> Result<&ArrayValue> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.wrong_type(key, "array", v))
    }

    /// `key` as an array of strings (e.g. `tokenizer.ggml.tokens`).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        let v = self.require(key)?;
        match v {
            Value::Array(ArrayValue::Strings(s)) => Ok(s),
            _ => Err(self.wrong_type(key, "array<string>", v)),
        }
    }

    /// `key` as an array of `i32` (e.g. `tokenizer.ggml.token_type`).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        let v = self.require(key)?;
        match v {
            Value::Array(ArrayValue::I32s(s)) => Ok(s),
            _ => Err(self.wrong_type(key, "array<i32>", v)),
        }
    }

    /// `key` as an array of `f32` (e.g. `tokenizer.ggml.scores`).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`], [`GgufError::WrongType`].
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        let v = self.require(key)?;
        match v {
            Value::Array(ArrayValue::F32s(s)) => Ok(s),
            _ => Err(self.wrong_type(key, "array<f32>", v)),
        }
    }

    /// All tensor infos, in file order.
    #[must_use]
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.parsed.tensors
    }

    /// The tensor named `name`, if present.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.parsed
            .tensor_index
            .get(name)
            .map(|&i| &self.parsed.tensors[i])
    }

    /// The tensor named `name`.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`] if absent.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            file: self.path.clone(),
            tensor: name.to_owned(),
        })
    }

    /// The raw bytes of a tensor's data, borrowed from the map. Bounds were checked when the
    /// file was opened; an info from another file yields an empty slice rather than a panic.
    #[must_use]
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = self.parsed.data_offset.saturating_add(info.offset);
        let end = start.saturating_add(info.n_bytes);
        usize::try_from(start)
            .ok()
            .zip(usize::try_from(end).ok())
            .and_then(|(s, e)| self.backing.get(s..e))
            .unwrap_or(&[])
    }

    /// Sum of all tensors' data sizes (without alignment padding).
    #[must_use]
    pub fn total_tensor_bytes(&self) -> u64 {
        self.parsed.tensors.iter().map(|t| t.n_bytes).sum()
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        let found = match found.as_integer() {
            Some(i) => format!("{} {i}", found.type_description()),
            None => found.type_description(),
        };
        GgufError::WrongType {
            key: key.to_owned(),
            expected,
            found,
            file: self.path.clone(),
        }
    }
}

/// Conversion from a metadata [`Value`] for [`GgufFile::get_as`] / [`GgufFile::get_opt`].
///
/// Integer targets accept any integer type whose value fits (GGUF writers disagree on
/// whether a count is `u32`, `i32` or `u64`); float targets accept `f32` and `f64`.
pub trait FromValue: Sized {
    /// What the conversion accepts, for [`GgufError::WrongType`].
    const EXPECTED: &'static str;
    /// The converted value, or `None`.
    fn from_value(v: &Value) -> Option<Self>;
}

macro_rules! int_from_value {
    ($($t:ty => $desc:literal),*) => {
        $(
            impl FromValue for $t {
                const EXPECTED: &'static str = $desc;
                fn from_value(v: &Value) -> Option<$t> {
                    v.as_integer().and_then(|i| <$t>::try_from(i).ok())
                }
            }
        )*
    };
}

int_from_value!(
    u8 => "an integer fitting u8",
    u16 => "an integer fitting u16",
    u32 => "an integer fitting u32",
    u64 => "an integer fitting u64",
    i8 => "an integer fitting i8",
    i16 => "an integer fitting i16",
    i32 => "an integer fitting i32",
    i64 => "an integer fitting i64",
    usize => "an integer fitting usize"
);

impl FromValue for f32 {
    const EXPECTED: &'static str = "f32 or f64";
    #[allow(clippy::cast_possible_truncation)] // f64 metadata narrowed on purpose
    fn from_value(v: &Value) -> Option<f32> {
        match *v {
            Value::F32(x) => Some(x),
            Value::F64(x) => Some(x as f32),
            _ => None,
        }
    }
}

impl FromValue for f64 {
    const EXPECTED: &'static str = "f32 or f64";
    fn from_value(v: &Value) -> Option<f64> {
        match *v {
            Value::F32(x) => Some(f64::from(x)),
            Value::F64(x) => Some(x),
            _ => None,
        }
    }
}

impl FromValue for bool {
    const EXPECTED: &'static str = "bool";
    fn from_value(v: &Value) -> Option<bool> {
        match *v {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
}

impl FromValue for String {
    const EXPECTED: &'static str = "string";
    fn from_value(v: &Value) -> Option<String> {
        v.as_str().map(str::to_owned)
    }
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a Path,
    section: Section,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                file: self.file.to_path_buf(),
                section: self.section,
                offset: self.pos as u64,
                what: what(),
                needed: n,
                available: self.remaining(),
            });
        }
        // n <= remaining <= usize::MAX, so the cast is exact.
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` items of at least `min_size` bytes each can still fit.
    fn check_length(
        &self,
        count: u64,
        min_size: u64,
        at: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let min_bytes = count.saturating_mul(min_size);
        if min_bytes > self.remaining() {
            return Err(GgufError::LengthTooLarge {
                file: self.file.to_path_buf(),
                section: self.section,
                offset: at as u64,
                what: what(),
                length: count,
                min_bytes,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        self.check_length(len, 1, at, what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 {
                file: self.file.to_path_buf(),
                section: self.section,
                offset: start as u64,
                what: what(),
            }),
        }
    }
}

/// Reads `n` fixed-size little-endian scalars.
fn read_fixed<const N: usize, T>(
    c: &mut Cursor<'_>,
    n: u64,
    what: &dyn Fn() -> String,
    conv: fn([u8; N]) -> T,
) -> Result<Vec<T>> {
    let bytes = c.take(n.saturating_mul(N as u64), what)?;
    Ok(bytes
        .chunks_exact(N)
        .map(|ch| {
            let mut a = [0u8; N];
            a.copy_from_slice(ch);
            conv(a)
        })
        .collect())
}

fn read_scalar(
    c: &mut Cursor<'_>,
    ty: ValueType,
    key: &str,
    type_at: usize,
    what: &dyn Fn() -> String,
) -> Result<Value> {
    Ok(match ty {
        ValueType::U8 => Value::U8(c.array::<1>(what)?[0]),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.array::<1>(what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array::<2>(what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array::<2>(what)?)),
        ValueType::U32 => Value::U32(c.u32(what)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array::<4>(what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array::<4>(what)?)),
        // Like llama.cpp, any non-zero byte is true.
        ValueType::Bool => Value::Bool(c.array::<1>(what)?[0] != 0),
        ValueType::String => Value::String(c.string(what)?),
        ValueType::U64 => Value::U64(c.u64(what)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array::<8>(what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array::<8>(what)?)),
        // An array where a scalar must be: an array element of an array.
        ValueType::Array => {
            return Err(GgufError::InvalidValueType {
                file: c.file.to_path_buf(),
                key: key.to_owned(),
                code: ValueType::Array.code(),
                offset: type_at as u64,
            });
        }
    })
}

fn read_value(c: &mut Cursor<'_>, key: &str) -> Result<Value> {
    let file = c.file;
    let invalid = |code, at: usize| GgufError::InvalidValueType {
        file: file.to_path_buf(),
        key: key.to_owned(),
        code,
        offset: at as u64,
    };
    let what = || format!("value of key '{key}'");
    let type_at = c.pos;
    let code = c.u32(&|| format!("type of key '{key}'"))?;
    let ty = ValueType::from_code(code).ok_or_else(|| invalid(code, type_at))?;
    if ty != ValueType::Array {
        return read_scalar(c, ty, key, type_at, &what);
    }
    let elem_at = c.pos;
    let elem_code = c.u32(&what)?;
    let elem = ValueType::from_code(elem_code)
        .filter(|t| *t != ValueType::Array)
        .ok_or_else(|| invalid(elem_code, elem_at))?;
    let len_at = c.pos;
    let n = c.u64(&what)?;
    let what_arr = || format!("array<{elem}> of key '{key}'");
    c.check_length(n, elem.min_encoded_size(), len_at, &what_arr)?;
    let arr = match elem {
        ValueType::U8 => ArrayValue::U8s(read_fixed(c, n, &what_arr, |[b]| b)?),
        ValueType::I8 => ArrayValue::I8s(read_fixed(c, n, &what_arr, i8::from_le_bytes)?),
        ValueType::U16 => ArrayValue::U16s(read_fixed(c, n, &what_arr, u16::from_le_bytes)?),
        ValueType::I16 => ArrayValue::I16s(read_fixed(c, n, &what_arr, i16::from_le_bytes)?),
        ValueType::U32 => ArrayValue::U32s(read_fixed(c, n, &what_arr, u32::from_le_bytes)?),
        ValueType::I32 => ArrayValue::I32s(read_fixed(c, n, &what_arr, i32::from_le_bytes)?),
        ValueType::F32 => ArrayValue::F32s(read_fixed(c, n, &what_arr, f32::from_le_bytes)?),
        ValueType::Bool => ArrayValue::Bools(read_fixed(c, n, &what_arr, |[b]| b != 0)?),
        ValueType::U64 => ArrayValue::U64s(read_fixed(c, n, &what_arr, u64::from_le_bytes)?),
        ValueType::I64 => ArrayValue::I64s(read_fixed(c, n, &what_arr, i64::from_le_bytes)?),
        ValueType::F64 => ArrayValue::F64s(read_fixed(c, n, &what_arr, f64::from_le_bytes)?),
        ValueType::String => {
            // n * 8 <= remaining was checked above, so the capacity is bounded by the file.
            let mut v = Vec::with_capacity(n as usize);
            for i in 0..n {
                v.push(c.string(&|| format!("element {i} of array<string> of key '{key}'"))?);
            }
            ArrayValue::Strings(v)
        }
        ValueType::Array => return Err(invalid(elem_code, elem_at)),
    };
    Ok(Value::Array(arr))
}

fn parse(path: &Path, buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor {
        buf,
        pos: 0,
        file: path,
        section: Section::Header,
    };
    let (version, n_tensors, n_kv) = parse_header(&mut c)?;
    c.section = Section::Metadata;
    let (metadata, key_index) = parse_metadata(&mut c, n_kv)?;
    let alignment = alignment_of(path, &metadata, &key_index)?;
    c.section = Section::TensorInfo;
    let (tensors, tensor_index) = parse_tensor_infos(&mut c, n_tensors, alignment)?;

    // The data section starts at the next multiple of the alignment (alignment <= u32::MAX
    // and pos <= file length, so this cannot overflow).
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    check_tensor_extents(path, &tensors, data_offset, buf.len() as u64)?;
    Ok(Parsed {
        version,
        metadata,
        key_index,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}

/// Magic, version and the two counts.
fn parse_header(c: &mut Cursor<'_>) -> Result<(u32, u64, u64)> {
    let (path, buf) = (c.file, c.buf);
    if buf.len() < 4 || buf[..4] != GGUF_MAGIC {
        if buf.len() < 4 && GGUF_MAGIC.starts_with(buf) {
            // A prefix of the magic (including an empty file) is a truncated GGUF.
            c.take(4, &|| "magic".to_owned())?;
        }
        return Err(GgufError::NotGguf {
            file: path.to_path_buf(),
            first_bytes: LeadingBytes(buf[..buf.len().min(8)].to_vec()),
        });
    }
    c.pos = 4;
    let version = c.u32(&|| "version".to_owned())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            file: path.to_path_buf(),
            version,
        });
    }
    let n_tensors_at = c.pos;
    let n_tensors = c.u64(&|| "tensor count".to_owned())?;
    let n_kv_at = c.pos;
    let n_kv = c.u64(&|| "metadata count".to_owned())?;
    // Smallest encodings: a pair is an 8-byte key length + 1 byte of key + 4-byte type +
    // 1-byte value; a tensor info is an 8-byte name length + 4 (n_dims) + 4 (type) + 8
    // (offset). Counts that cannot fit are refused before any allocation.
    c.check_length(n_kv, 14, n_kv_at, &|| "metadata count".to_owned())?;
    c.check_length(n_tensors, 24, n_tensors_at, &|| "tensor count".to_owned())?;
    Ok((version, n_tensors, n_kv))
}

type Metadata = (Vec<(String, Value)>, HashMap<String, usize>);

fn parse_metadata(c: &mut Cursor<'_>, n_kv: u64) -> Result<Metadata> {
    let path = c.file;
    // n_kv is bounded by the file length (parse_header), so the capacities are too.
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
    let mut key_index: HashMap<String, usize> = HashMap::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&|| format!("key #{i}"))?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey {
                file: path.to_path_buf(),
                index: i,
            });
        }
        if key_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                file: path.to_path_buf(),
                key,
            });
        }
        let value = read_value(c, &key)?;
        key_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }
    Ok((metadata, key_index))
}

/// `general.alignment`, which llama.cpp requires to be a power-of-two `u32`.
fn alignment_of(
    path: &Path,
    metadata: &[(String, Value)],
    key_index: &HashMap<String, usize>,
) -> Result<u64> {
    let alignment = match key_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) => u64::from(*a),
        Some(other) => {
            return Err(GgufError::WrongType {
                key: ALIGNMENT_KEY.to_owned(),
                expected: "u32 (llama.cpp requires exactly u32)",
                found: other.type_description(),
                file: path.to_path_buf(),
            });
        }
    };
    if !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment {
            file: path.to_path_buf(),
            alignment,
        });
    }
    Ok(alignment)
}

type TensorTable = (Vec<TensorInfo>, HashMap<String, usize>);

fn parse_tensor_infos(c: &mut Cursor<'_>, n_tensors: u64, alignment: u64) -> Result<TensorTable> {
    let path = c.file;
    // n_tensors is bounded by the file length (parse_header).
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
    let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let what = || format!("info of tensor '{name}'");
        let n_dims = c.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                file: path.to_path_buf(),
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let code = c.u32(&what)?;
        let offset = c.u64(&what)?;
        let Some(ggml_type) = GgmlType::from_code(code) else {
            return Err(GgufError::UnknownGgmlType {
                file: path.to_path_buf(),
                tensor: name,
                code,
            });
        };
        let n_bytes = checked_tensor_bytes(path, &name, &dims, ggml_type)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                file: path.to_path_buf(),
                tensor: name,
                offset,
                alignment,
            });
        }
        if tensor_index.contains_key(&name) {
            return Err(GgufError::DuplicateTensor {
                file: path.to_path_buf(),
                tensor: name,
            });
        }
        tensor_index.insert(name.clone(), tensors.len());
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
        });
    }
    Ok((tensors, tensor_index))
}

/// The tensor's data size, after llama.cpp's shape checks.
fn checked_tensor_bytes(path: &Path, name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64> {
    let bad_shape = |reason| GgufError::BadShape {
        file: path.to_path_buf(),
        tensor: name.to_owned(),
        ggml_type,
        dims: dims.to_vec(),
        reason,
    };
    // llama.cpp keeps dimensions as int64_t and requires the element count to fit.
    let fits_i64 = dims.iter().all(|&d| i64::try_from(d).is_ok())
        && dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .is_some_and(|n| i64::try_from(n).is_ok());
    if !fits_i64 {
        return Err(bad_shape("element count overflows int64"));
    }
    if !dims
        .first()
        .copied()
        .unwrap_or(1)
        .is_multiple_of(ggml_type.block_size())
    {
        return Err(bad_shape(
            "row length is not a multiple of the type's block size",
        ));
    }
    ggml_type
        .tensor_bytes(dims)
        .ok_or_else(|| bad_shape("byte size overflows"))
}

/// Every tensor's data must lie inside the file: the check that catches truncated downloads.
fn check_tensor_extents(
    path: &Path,
    tensors: &[TensorInfo],
    data_offset: u64,
    file_len: u64,
) -> Result<()> {
    for t in tensors {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        match (start, end) {
            (Some(_), Some(end)) if end <= file_len => {}
            _ => {
                return Err(GgufError::TruncatedTensorData {
                    file: path.to_path_buf(),
                    tensor: t.name.clone(),
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_len,
                });
            }
        }
    }
    Ok(())
}
