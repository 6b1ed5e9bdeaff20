//! The GGUF writer: [`GgufWriter`] builds a GGUF v3 file from metadata and tensors.
//!
//! It exists so tests and the tiny-model generator can make real files that llama.cpp and
//! the reader both accept. The layout is the one `gguf.cpp` reads: header, key/values,
//! tensor infos, padding to the alignment, then each tensor's data at an aligned offset.
//! A file is written under `NAME.<pid>-<n>.partial`, synced, and renamed into place, so a
//! crash never leaves a half-written file under the final name, and two writers of the same
//! file (parallel tests) never share a partial file.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use crate::gguf::error::WriteError;
use crate::gguf::ggml_type::GgmlType;
use crate::gguf::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::gguf::value::{ArrayValue, Value};

/// `GGML_MAX_NAME`: llama.cpp refuses tensor names of this many bytes or more.
const MAX_NAME: usize = 64;

/// A tensor queued for writing.
#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF v3 file in memory and writes it atomically.
///
/// ```
/// use molt::gguf::{GgmlType, GgufWriter};
/// let mut w = GgufWriter::new();
/// w.add("general.architecture", "qwen2")?;
/// w.add_f32_tensor("output_norm.weight", &[4], &[1.0; 4], GgmlType::F32)?;
/// let bytes = w.to_bytes();
/// assert_eq!(&bytes[..4], b"GGUF");
/// # Ok::<(), molt::gguf::WriteError>(())
/// ```
#[derive(Debug, Clone)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
    alignment: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    /// An empty writer with the default alignment (32).
    #[must_use]
    pub fn new() -> GgufWriter {
        GgufWriter {
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Adds a metadata pair. Keys keep insertion order. Setting `general.alignment` (a
    /// power-of-two `u32`) changes the data alignment.
    ///
    /// # Errors
    /// [`WriteError::EmptyKey`], [`WriteError::DuplicateKey`], or
    /// [`WriteError::BadAlignment`] for a bad `general.alignment`.
    pub fn add(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
    ) -> Result<&mut GgufWriter, WriteError> {
        let key = key.into();
        let value = value.into();
        if key.is_empty() {
            return Err(WriteError::EmptyKey);
        }
        if self.keys.contains(&key) {
            return Err(WriteError::DuplicateKey { key });
        }
        if key == ALIGNMENT_KEY {
            match value {
                Value::U32(a) if a.is_power_of_two() => self.alignment = u64::from(a),
                ref other => {
                    return Err(WriteError::BadAlignment {
                        found: format!("{other:?}"),
                    });
                }
            }
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Queues a tensor with raw data bytes. `dims` are innermost first (`dims[0]` is the row
    /// length); `data` must be exactly the size the shape and type imply.
    ///
    /// # Errors
    /// [`WriteError::DuplicateTensor`], [`WriteError::TensorNameTooLong`],
    /// [`WriteError::BadShape`] (no dimensions, more than 4, or a row length that is not a
    /// multiple of the block size), [`WriteError::SizeMismatch`].
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut GgufWriter, WriteError> {
        let name = name.into();
        if self.names.contains(&name) {
            return Err(WriteError::DuplicateTensor { tensor: name });
        }
        if name.len() >= MAX_NAME {
            let len = name.len();
            return Err(WriteError::TensorNameTooLong { tensor: name, len });
        }
        let bad = |reason| WriteError::BadShape {
            tensor: name.clone(),
            dims: dims.to_vec(),
            ggml_type,
            reason,
        };
        if dims.is_empty() || dims.len() > MAX_DIMS as usize {
            return Err(bad("a tensor has 1 to 4 dimensions"));
        }
        let expected = ggml_type
            .tensor_bytes(dims)
            .ok_or_else(|| bad("row length not a multiple of the block size, or size overflow"))?;
        if expected != data.len() as u64 {
            return Err(WriteError::SizeMismatch {
                tensor: name,
                expected,
                actual: data.len() as u64,
            });
        }
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        Ok(self)
    }

    /// Queues a tensor given as `f32` values, stored as `as_type` (`F32`, `F16` or `BF16`).
    ///
    /// # Errors
    /// As [`GgufWriter::add_tensor`]; [`WriteError::BadShape`] if `as_type` is not one of the
    /// three float types (quantizing is llama.cpp's job).
    pub fn add_f32_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
        as_type: GgmlType,
    ) -> Result<&mut GgufWriter, WriteError> {
        // Plain loops rather than iterator adapters: this runs over millions of weights when
        // tiny models are generated in unoptimised test builds.
        let mut data: Vec<u8> = Vec::with_capacity(values.len() * 4);
        match as_type {
            GgmlType::F32 => {
                for v in values {
                    data.extend_from_slice(&v.to_le_bytes());
                }
            }
            GgmlType::F16 => {
                for &v in values {
                    data.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
            }
            GgmlType::Bf16 => {
                for &v in values {
                    data.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }
            }
            other => {
                return Err(WriteError::BadShape {
                    tensor: name.into(),
                    dims: dims.to_vec(),
                    ggml_type: other,
                    reason: "add_f32_tensor stores only f32, f16 or bf16",
                });
            }
        }
        self.add_tensor(name, dims, as_type, data)
    }

    /// The data alignment in effect.
    #[must_use]
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Writes the complete image to `w`; returns the number of bytes written.
    ///
    /// The last tensor is not followed by padding: llama.cpp only requires each tensor's
    /// `offset + size` to lie within the file, and without trailing padding every byte of
    /// the file is meaningful, so any truncation is detectable.
    ///
    /// # Errors
    /// Any error of `w`.
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<u64> {
        let mut out = Counting { inner: w, n: 0 };
        out.write_all(&GGUF_MAGIC)?;
        out.write_all(&3u32.to_le_bytes())?;
        out.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        out.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (k, v) in &self.metadata {
            write_str(&mut out, k)?;
            write_value(&mut out, v)?;
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            write_str(&mut out, &t.name)?;
            out.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.write_all(&d.to_le_bytes())?;
            }
            out.write_all(&t.ggml_type.code().to_le_bytes())?;
            out.write_all(&offset.to_le_bytes())?;
            offsets.push(offset);
            offset = align(offset + t.data.len() as u64, self.alignment);
        }
        if !self.tensors.is_empty() {
            pad_to(&mut out, self.alignment)?;
        }
        let data_start = out.n;
        for (t, off) in self.tensors.iter().zip(offsets) {
            let target = data_start + off;
            let gap = target - out.n;
            write_zeros(&mut out, gap)?;
            out.write_all(&t.data)?;
        }
        out.flush()?;
        Ok(out.n)
    }

    /// The complete image in memory.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = self.write_to(&mut v);
        v
    }

    /// Writes the file to `path` atomically: to a partial file beside it
    /// (`NAME.<pid>-<n>.partial`), synced, then renamed over `path`. Returns the file size.
    ///
    /// # Errors
    /// [`WriteError::Io`] naming the file that failed; the partial file is removed.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<u64, WriteError> {
        let path = path.as_ref();
        let partial = crate::durable::partial_path(path);
        let result = (|| -> io::Result<u64> {
            let file = File::create(&partial)?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            let n = self.write_to(&mut w)?;
            let file = w.into_inner().map_err(io::IntoInnerError::into_error)?;
            file.sync_all()?;
            Ok(n)
        })();
        let n = match result {
            Ok(n) => n,
            Err(source) => {
                let _ = std::fs::remove_file(&partial);
                return Err(WriteError::Io {
                    file: partial,
                    source,
                });
            }
        };
        crate::durable::commit(&partial, path).map_err(|source| WriteError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        Ok(n)
    }
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// A writer that counts the bytes through it, for padding.
struct Counting<'a, W: Write> {
    inner: &'a mut W,
    n: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn pad_to<W: Write>(out: &mut Counting<'_, W>, alignment: u64) -> io::Result<()> {
    let gap = align(out.n, alignment) - out.n;
    write_zeros(out, gap)
}

fn write_zeros(out: &mut impl Write, n: u64) -> io::Result<()> {
    const ZEROS: [u8; 64] = [0; 64];
    let mut left = n;
    while left > 0 {
        let k = left.min(ZEROS.len() as u64);
        out.write_all(&ZEROS[..k as usize])?;
        left -= k;
    }
    Ok(())
}

fn write_str(out: &mut impl Write, s: &str) -> io::Result<()> {
    out.write_all(&(s.len() as u64).to_le_bytes())?;
    out.write_all(s.as_bytes())
}

fn write_value(out: &mut impl Write, v: &Value) -> io::Result<()> {
    out.write_all(&v.value_type().code().to_le_bytes())?;
    match v {
        Value::U8(x) => out.write_all(&x.to_le_bytes()),
        Value::I8(x) => out.write_all(&x.to_le_bytes()),
        Value::U16(x) => out.write_all(&x.to_le_bytes()),
        Value::I16(x) => out.write_all(&x.to_le_bytes()),
        Value::U32(x) => out.write_all(&x.to_le_bytes()),
        Value::I32(x) => out.write_all(&x.to_le_bytes()),
        Value::F32(x) => out.write_all(&x.to_le_bytes()),
        Value::Bool(x) => out.write_all(&[u8::from(*x)]),
        Value::String(s) => write_str(out, s),
        Value::U64(x) => out.write_all(&x.to_le_bytes()),
        Value::I64(x) => out.write_all(&x.to_le_bytes()),
        Value::F64(x) => out.write_all(&x.to_le_bytes()),
        Value::Array(a) => write_array(out, a),
    }
}

fn write_array(out: &mut impl Write, a: &ArrayValue) -> io::Result<()> {
    out.write_all(&a.element_type().code().to_le_bytes())?;
    out.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {{
            for x in $v {
                out.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        }};
    }
    match a {
        ArrayValue::U8s(v) => out.write_all(v),
        ArrayValue::I8s(v) => each!(v),
        ArrayValue::U16s(v) => each!(v),
        ArrayValue::I16s(v) => each!(v),
        ArrayValue::U32s(v) => each!(v),
        ArrayValue::I32s(v) => each!(v),
        ArrayValue::F32s(v) => each!(v),
        ArrayValue::Bools(v) => {
            let bytes: Vec<u8> = v.iter().map(|&b| u8::from(b)).collect();
            out.write_all(&bytes)
        }
        ArrayValue::Strings(v) => {
            for s in v {
                write_str(out, s)?;
            }
            Ok(())
        }
        ArrayValue::U64s(v) => each!(v),
        ArrayValue::I64s(v) => each!(v),
        ArrayValue::F64s(v) => each!(v),
    }
}
