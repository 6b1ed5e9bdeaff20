//! Typed GGUF metadata values.
//!
//! [`Value`] is one metadata value as stored on disk, [`ArrayValue`] a typed array (a
//! vocabulary is `ArrayValue::Strings`, token types `ArrayValue::I32s`), and [`ValueType`]
//! the on-disk type code. Arrays are kept as typed vectors rather than `Vec<Value>` so a
//! 151,936-entry vocabulary costs one `String` per token and nothing more.

use std::fmt;

/// A GGUF metadata value type, by its on-disk code (`enum gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)] // the variants are the GGUF spec's own type names
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The type with on-disk code `code` (0..=12), or `None`.
    #[must_use]
    pub fn from_code(code: u32) -> Option<ValueType> {
        Some(match code {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    /// The on-disk code.
    #[must_use]
    pub fn code(self) -> u32 {
        match self {
            ValueType::U8 => 0,
            ValueType::I8 => 1,
            ValueType::U16 => 2,
            ValueType::I16 => 3,
            ValueType::U32 => 4,
            ValueType::I32 => 5,
            ValueType::F32 => 6,
            ValueType::Bool => 7,
            ValueType::String => 8,
            ValueType::Array => 9,
            ValueType::U64 => 10,
            ValueType::I64 => 11,
            ValueType::F64 => 12,
        }
    }

    /// Encoded size of one scalar of this type, or `None` for strings and arrays, whose size
    /// depends on their content.
    #[must_use]
    pub fn fixed_size(self) -> Option<u64> {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => Some(1),
            ValueType::U16 | ValueType::I16 => Some(2),
            ValueType::U32 | ValueType::I32 | ValueType::F32 => Some(4),
            ValueType::U64 | ValueType::I64 | ValueType::F64 => Some(8),
            ValueType::String | ValueType::Array => None,
        }
    }

    /// The smallest number of bytes one element of this type can occupy on disk (a string is
    /// at least its 8-byte length). Used to reject impossible array lengths before allocating.
    #[must_use]
    pub fn min_encoded_size(self) -> u64 {
        match self {
            // An array element would need a type code and a length: 12 bytes.
            ValueType::Array => 12,
            ValueType::String => 8,
            other => other.fixed_size().unwrap_or(1),
        }
    }

    /// The GGUF spec's lower-case name, e.g. `"u32"`, `"string"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)] // one variant per GGUF type, named for it
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ArrayValue),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: a typed vector of one element type. Nested arrays are not supported
/// (llama.cpp's own `gguf.cpp` rejects them too).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)] // one variant per element type, named for it
pub enum ArrayValue {
    U8s(Vec<u8>),
    I8s(Vec<i8>),
    U16s(Vec<u16>),
    I16s(Vec<i16>),
    U32s(Vec<u32>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
    Bools(Vec<bool>),
    Strings(Vec<String>),
    U64s(Vec<u64>),
    I64s(Vec<i64>),
    F64s(Vec<f64>),
}

impl Value {
    /// The value's type code.
    #[must_use]
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A short description of the type for error messages: `"u32"`, `"array<string>[151936]"`.
    #[must_use]
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array<{}>[{}]", a.element_type(), a.len()),
            other => other.value_type().name().to_owned(),
        }
    }

    /// The value as an `i128` if it is an integer of any width (booleans and floats are not).
    #[must_use]
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The string, if this is a string value.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, if this is an array value.
    #[must_use]
    pub fn as_array(&self) -> Option<&ArrayValue> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl ArrayValue {
    /// The element type.
    #[must_use]
    pub fn element_type(&self) -> ValueType {
        match self {
            ArrayValue::U8s(_) => ValueType::U8,
            ArrayValue::I8s(_) => ValueType::I8,
            ArrayValue::U16s(_) => ValueType::U16,
            ArrayValue::I16s(_) => ValueType::I16,
            ArrayValue::U32s(_) => ValueType::U32,
            ArrayValue::I32s(_) => ValueType::I32,
            ArrayValue::F32s(_) => ValueType::F32,
            ArrayValue::Bools(_) => ValueType::Bool,
            ArrayValue::Strings(_) => ValueType::String,
            ArrayValue::U64s(_) => ValueType::U64,
            ArrayValue::I64s(_) => ValueType::I64,
            ArrayValue::F64s(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            ArrayValue::U8s(v) => v.len(),
            ArrayValue::I8s(v) => v.len(),
            ArrayValue::U16s(v) => v.len(),
            ArrayValue::I16s(v) => v.len(),
            ArrayValue::U32s(v) => v.len(),
            ArrayValue::I32s(v) => v.len(),
            ArrayValue::F32s(v) => v.len(),
            ArrayValue::Bools(v) => v.len(),
            ArrayValue::Strings(v) => v.len(),
            ArrayValue::U64s(v) => v.len(),
            ArrayValue::I64s(v) => v.len(),
            ArrayValue::F64s(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as an `i128`, if the elements are integers and `i` is in range.
    #[must_use]
    pub fn integer_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            ArrayValue::U8s(v) => (*v.get(i)?).into(),
            ArrayValue::I8s(v) => (*v.get(i)?).into(),
            ArrayValue::U16s(v) => (*v.get(i)?).into(),
            ArrayValue::I16s(v) => (*v.get(i)?).into(),
            ArrayValue::U32s(v) => (*v.get(i)?).into(),
            ArrayValue::I32s(v) => (*v.get(i)?).into(),
            ArrayValue::U64s(v) => (*v.get(i)?).into(),
            ArrayValue::I64s(v) => (*v.get(i)?).into(),
            _ => return None,
        })
    }
}

macro_rules! impl_from {
    ($($t:ty => $variant:ident, $avariant:ident;)*) => {
        $(
            impl From<$t> for Value {
                fn from(v: $t) -> Value {
                    Value::$variant(v)
                }
            }
            impl From<Vec<$t>> for ArrayValue {
                fn from(v: Vec<$t>) -> ArrayValue {
                    ArrayValue::$avariant(v)
                }
            }
            impl From<Vec<$t>> for Value {
                fn from(v: Vec<$t>) -> Value {
                    Value::Array(ArrayValue::$avariant(v))
                }
            }
        )*
    };
}

impl_from! {
    u8 => U8, U8s;
    i8 => I8, I8s;
    u16 => U16, U16s;
    i16 => I16, I16s;
    u32 => U32, U32s;
    i32 => I32, I32s;
    f32 => F32, F32s;
    bool => Bool, Bools;
    String => String, Strings;
    u64 => U64, U64s;
    i64 => I64, I64s;
    f64 => F64, F64s;
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::String(v.to_owned())
    }
}

impl From<ArrayValue> for Value {
    fn from(v: ArrayValue) -> Value {
        Value::Array(v)
    }
}
