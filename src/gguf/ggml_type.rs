//! The ggml tensor element types a GGUF file may name, with their block geometry.
//!
//! [`GgmlType`] is the type code stored in each tensor info. Its [`GgmlType::block_size`] and
//! [`GgmlType::type_size`] decide how many bytes a tensor occupies, which is how the reader
//! notices a truncated download before llama.cpp faults on it. The table mirrors
//! `type_traits[]` in the vendored `ggml/src/ggml.c` of `llama-cpp-sys-2` 0.1.161; the block
//! sizes of the quantized types were measured with `sizeof(block_*)` from `ggml-common.h`.

use std::fmt;

/// A ggml tensor element type, by its on-disk code (`enum ggml_type`).
///
/// Codes 4, 5 and 31–33, 36–38 were removed from ggml and are not representable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)] // the variants are ggml's own type names
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    Nvfp4,
    Q1_0,
    Q2_0,
}

/// One row of the type table: code, name, elements per block, bytes per block.
struct Traits {
    ty: GgmlType,
    code: u32,
    name: &'static str,
    block_size: u64,
    type_size: u64,
}

const QK_K: u64 = 256;

/// The type table, in code order. Verified against `ggml.c` `type_traits` (block sizes) and
/// `sizeof(block_*)` in `ggml-common.h` (type sizes) of the pinned llama.cpp.
#[rustfmt::skip]
const TABLE: &[Traits] = &[
    Traits { ty: GgmlType::F32, code: 0, name: "f32", block_size: 1, type_size: 4 },
    Traits { ty: GgmlType::F16, code: 1, name: "f16", block_size: 1, type_size: 2 },
    Traits { ty: GgmlType::Q4_0, code: 2, name: "q4_0", block_size: 32, type_size: 18 },
    Traits { ty: GgmlType::Q4_1, code: 3, name: "q4_1", block_size: 32, type_size: 20 },
    Traits { ty: GgmlType::Q5_0, code: 6, name: "q5_0", block_size: 32, type_size: 22 },
    Traits { ty: GgmlType::Q5_1, code: 7, name: "q5_1", block_size: 32, type_size: 24 },
    Traits { ty: GgmlType::Q8_0, code: 8, name: "q8_0", block_size: 32, type_size: 34 },
    Traits { ty: GgmlType::Q8_1, code: 9, name: "q8_1", block_size: 32, type_size: 36 },
    Traits { ty: GgmlType::Q2K, code: 10, name: "q2_K", block_size: QK_K, type_size: 84 },
    Traits { ty: GgmlType::Q3K, code: 11, name: "q3_K", block_size: QK_K, type_size: 110 },
    Traits { ty: GgmlType::Q4K, code: 12, name: "q4_K", block_size: QK_K, type_size: 144 },
    Traits { ty: GgmlType::Q5K, code: 13, name: "q5_K", block_size: QK_K, type_size: 176 },
    Traits { ty: GgmlType::Q6K, code: 14, name: "q6_K", block_size: QK_K, type_size: 210 },
    Traits { ty: GgmlType::Q8K, code: 15, name: "q8_K", block_size: QK_K, type_size: 292 },
    Traits { ty: GgmlType::Iq2Xxs, code: 16, name: "iq2_xxs", block_size: QK_K, type_size: 66 },
    Traits { ty: GgmlType::Iq2Xs, code: 17, name: "iq2_xs", block_size: QK_K, type_size: 74 },
    Traits { ty: GgmlType::Iq3Xxs, code: 18, name: "iq3_xxs", block_size: QK_K, type_size: 98 },
    Traits { ty: GgmlType::Iq1S, code: 19, name: "iq1_s", block_size: QK_K, type_size: 50 },
    Traits { ty: GgmlType::Iq4Nl, code: 20, name: "iq4_nl", block_size: 32, type_size: 18 },
    Traits { ty: GgmlType::Iq3S, code: 21, name: "iq3_s", block_size: QK_K, type_size: 110 },
    Traits { ty: GgmlType::Iq2S, code: 22, name: "iq2_s", block_size: QK_K, type_size: 82 },
    Traits { ty: GgmlType::Iq4Xs, code: 23, name: "iq4_xs", block_size: QK_K, type_size: 136 },
    Traits { ty: GgmlType::I8, code: 24, name: "i8", block_size: 1, type_size: 1 },
    Traits { ty: GgmlType::I16, code: 25, name: "i16", block_size: 1, type_size: 2 },
    Traits { ty: GgmlType::I32, code: 26, name: "i32", block_size: 1, type_size: 4 },
    Traits { ty: GgmlType::I64, code: 27, name: "i64", block_size: 1, type_size: 8 },
    Traits { ty: GgmlType::F64, code: 28, name: "f64", block_size: 1, type_size: 8 },
    Traits { ty: GgmlType::Iq1M, code: 29, name: "iq1_m", block_size: QK_K, type_size: 56 },
    Traits { ty: GgmlType::Bf16, code: 30, name: "bf16", block_size: 1, type_size: 2 },
    Traits { ty: GgmlType::Tq1_0, code: 34, name: "tq1_0", block_size: QK_K, type_size: 54 },
    Traits { ty: GgmlType::Tq2_0, code: 35, name: "tq2_0", block_size: QK_K, type_size: 66 },
    Traits { ty: GgmlType::Mxfp4, code: 39, name: "mxfp4", block_size: 32, type_size: 17 },
    Traits { ty: GgmlType::Nvfp4, code: 40, name: "nvfp4", block_size: 64, type_size: 36 },
    Traits { ty: GgmlType::Q1_0, code: 41, name: "q1_0", block_size: 128, type_size: 18 },
    Traits { ty: GgmlType::Q2_0, code: 42, name: "q2_0", block_size: 64, type_size: 18 },
];

impl GgmlType {
    /// All known types, in code order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|t| t.ty)
    }

    /// The type with on-disk code `code`, or `None` for an unknown or removed code.
    #[must_use]
    pub fn from_code(code: u32) -> Option<GgmlType> {
        TABLE.iter().find(|t| t.code == code).map(|t| t.ty)
    }

    fn traits(self) -> &'static Traits {
        // Every variant has exactly one row; the test `table_is_complete` holds this.
        TABLE.iter().find(|t| t.ty == self).unwrap_or(&TABLE[0])
    }

    /// The on-disk code (`enum ggml_type` value).
    #[must_use]
    pub fn code(self) -> u32 {
        self.traits().code
    }

    /// ggml's name for the type (`ggml_type_name`), e.g. `"q4_K"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Elements per block (`ggml_blck_size`); a row's length must be a multiple of it.
    #[must_use]
    pub fn block_size(self) -> u64 {
        self.traits().block_size
    }

    /// Bytes per block (`ggml_type_size`).
    #[must_use]
    pub fn type_size(self) -> u64 {
        self.traits().type_size
    }

    /// Whether the type is block-quantized (block size above one).
    #[must_use]
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes occupied by a tensor of this type with dimensions `dims` (innermost first), or
    /// `None` if the first dimension is not a multiple of the block size or the size
    /// overflows `u64`. An empty `dims` is a scalar (one element).
    #[must_use]
    pub fn tensor_bytes(self, dims: &[u64]) -> Option<u64> {
        let ne0 = dims.first().copied().unwrap_or(1);
        let bs = self.block_size();
        if ne0 % bs != 0 {
            return None;
        }
        let mut bytes = (ne0 / bs).checked_mul(self.type_size())?;
        for &d in dims.iter().skip(1) {
            bytes = bytes.checked_mul(d)?;
        }
        Some(bytes)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_complete_and_codes_unique() {
        let mut codes: Vec<u32> = TABLE.iter().map(|t| t.code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), TABLE.len());
        for t in TABLE {
            assert_eq!(t.ty.code(), t.code, "{}", t.name);
            assert_eq!(GgmlType::from_code(t.code), Some(t.ty));
        }
        assert_eq!(GgmlType::from_code(4), None);
        assert_eq!(GgmlType::from_code(31), None);
        assert_eq!(GgmlType::from_code(43), None);
    }

    #[test]
    fn sizes_of_common_types() {
        assert_eq!(
            GgmlType::F32.tensor_bytes(&[896, 151_936]),
            Some(896 * 151_936 * 4)
        );
        // Qwen2.5-0.5B Q4_K_M: blk.0.ffn_down is q6_K [4864, 896]: 3,575,040 bytes
        // (offset 238239232 -> 241814272 in the real file).
        assert_eq!(
            GgmlType::Q6K.tensor_bytes(&[4864, 896]),
            Some(241_814_272 - 238_239_232)
        );
        assert_eq!(
            GgmlType::Q8_0.tensor_bytes(&[896, 128]),
            Some(896 / 32 * 34 * 128)
        );
        assert_eq!(GgmlType::Q4K.tensor_bytes(&[100]), None);
        assert_eq!(GgmlType::F16.tensor_bytes(&[]), Some(2));
        assert_eq!(GgmlType::F32.tensor_bytes(&[u64::MAX, 2]), None);
    }
}
