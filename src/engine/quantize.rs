//! Requantization through llama.cpp's own quantize API: how tier1 of the shipped ladder is
//! built from tier0 on the user's machine (same weights, lower precision).

use super::{EngineError, backend, recent_llama_errors};
use std::ffi::CString;
use std::path::Path;

/// Target quantization types Molt offers for a precision rung: the ones llama.cpp's quantize
/// API builds from an already-quantized model *without* an importance matrix. The IQ2, IQ1
/// and IQ3_XXS/IQ3_XS types are left out on purpose: llama.cpp refuses them without one
/// ("Missing importance matrix for tensor … in a very low-bit quantization").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QuantType {
    /// 2-bit K-quant (llama.cpp `Q2_K`): the smallest type that still gives coherent text.
    #[serde(rename = "Q2_K")]
    Q2K,
    /// 3-bit K-quant, small variant (`Q3_K_S`): every matrix at 3 bits.
    #[serde(rename = "Q3_K_S")]
    Q3KS,
    /// 3-bit K-quant, medium (`Q3_K_M`): attention V and the first FFN-down layers at 4-5 bits.
    #[serde(rename = "Q3_K_M")]
    Q3KM,
    /// 3-bit K-quant, large (`Q3_K_L`): as `Q3_K_M` with those tensors at 5 bits.
    #[serde(rename = "Q3_K_L")]
    Q3KL,
    /// 3.44-bit i-quant (`IQ3_S`), lattice codebooks; needs no importance matrix.
    #[serde(rename = "IQ3_S")]
    IQ3S,
    /// 3.66-bit i-quant mix (`IQ3_M`): `IQ3_S` with attention and early FFN-down tensors higher.
    #[serde(rename = "IQ3_M")]
    IQ3M,
    /// 4.25-bit i-quant (`IQ4_XS`).
    #[serde(rename = "IQ4_XS")]
    IQ4XS,
    /// 8-bit (`Q8_0`), used for tiny test models whose rows are too short for K-quants.
    #[serde(rename = "Q8_0")]
    Q8_0,
    /// 4-bit legacy quant (`Q4_0`).
    #[serde(rename = "Q4_0")]
    Q4_0,
    /// 4-bit K-quant, small (`Q4_K_S`).
    #[serde(rename = "Q4_K_S")]
    Q4KS,
    /// 4-bit K-quant, medium (`Q4_K_M`).
    #[serde(rename = "Q4_K_M")]
    Q4KM,
    /// 5-bit K-quant, medium (`Q5_K_M`).
    #[serde(rename = "Q5_K_M")]
    Q5KM,
    /// 6-bit K-quant (`Q6_K`).
    #[serde(rename = "Q6_K")]
    Q6K,
}

/// Types llama.cpp refuses to build without an importance matrix, which Molt does not make:
/// named so that asking for one says why it is refused rather than that it does not exist.
pub const NEEDS_IMATRIX: [&str; 8] = [
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "Q2_K_S",
];

impl QuantType {
    /// Every type, in the order the manifest's error message lists them.
    pub const ALL: [Self; 13] = [
        Self::Q2K,
        Self::Q3KS,
        Self::Q3KM,
        Self::Q3KL,
        Self::IQ3S,
        Self::IQ3M,
        Self::IQ4XS,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4KS,
        Self::Q4KM,
        Self::Q5KM,
        Self::Q6K,
    ];

    /// The `general.file_type` (`enum llama_ftype`) a file of this type records.
    #[must_use]
    pub fn file_type(self) -> u32 {
        self.ftype()
    }

    fn ftype(self) -> llama_cpp_sys_2::llama_ftype {
        match self {
            Self::Q4_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_0,
            Self::Q4KS => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_K_S,
            Self::Q4KM => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_K_M,
            Self::Q5KM => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q5_K_M,
            Self::Q6K => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q6_K,
            Self::Q2K => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q2_K,
            Self::Q3KS => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q3_K_S,
            Self::Q3KM => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q3_K_M,
            Self::Q3KL => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q3_K_L,
            Self::IQ3S => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_IQ3_S,
            Self::IQ3M => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_IQ3_M,
            Self::IQ4XS => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_IQ4_XS,
            Self::Q8_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q8_0,
        }
    }

    /// llama.cpp's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q2K => "Q2_K",
            Self::Q3KS => "Q3_K_S",
            Self::Q3KM => "Q3_K_M",
            Self::Q3KL => "Q3_K_L",
            Self::IQ3S => "IQ3_S",
            Self::IQ3M => "IQ3_M",
            Self::IQ4XS => "IQ4_XS",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4KS => "Q4_K_S",
            Self::Q4KM => "Q4_K_M",
            Self::Q5KM => "Q5_K_M",
            Self::Q6K => "Q6_K",
        }
    }
}

/// A quantization type name Molt does not build: a typo, or a type that needs an importance
/// matrix ([`NEEDS_IMATRIX`]), each said as such.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.message())]
pub struct UnknownQuantType {
    /// The name as given.
    pub given: String,
}

impl UnknownQuantType {
    /// Whether the name is a type llama.cpp builds only with an importance matrix.
    #[must_use]
    pub fn needs_imatrix(&self) -> bool {
        NEEDS_IMATRIX
            .iter()
            .any(|n| n.eq_ignore_ascii_case(self.given.trim()))
    }

    fn message(&self) -> String {
        let accepted = QuantType::ALL.map(QuantType::name).join(", ");
        if self.needs_imatrix() {
            format!(
                "quantization type {:?} needs an importance matrix, which Molt does not make; \
                 accepted: {accepted}",
                self.given
            )
        } else {
            format!(
                "unknown quantization type {:?}; accepted: {accepted}",
                self.given
            )
        }
    }
}

impl std::str::FromStr for QuantType {
    type Err = UnknownQuantType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownQuantType { given: s.into() })
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Requantizes `src` into `dst` (allowing requantization of already-quantized tensors).
/// Writes a partial file beside `dst` and puts it in place durably ([`crate::durable`]), so
/// `dst` is never a half-written model.
///
/// # Errors
/// [`EngineError::Quantize`] when llama.cpp fails, [`EngineError::Io`] around the rename.
pub fn quantize(src: &Path, dst: &Path, ty: QuantType, threads: u32) -> Result<(), EngineError> {
    let partial = crate::durable::partial_path(dst);
    let err = |code: u32, detail: String| EngineError::Quantize {
        src: src.display().to_string(),
        dst: dst.display().to_string(),
        code,
        detail,
    };
    let c_src = CString::new(src.as_os_str().as_encoded_bytes())
        .map_err(|_| err(0, "NUL in path".into()))?;
    let c_dst = CString::new(partial.as_os_str().as_encoded_bytes())
        .map_err(|_| err(0, "NUL in path".into()))?;
    backend();
    let _ = recent_llama_errors();
    // SAFETY: plain-data defaults.
    let mut p = unsafe { llama_cpp_sys_2::llama_model_quantize_default_params() };
    p.nthread = i32::try_from(threads).unwrap_or(2);
    p.ftype = ty.ftype();
    p.allow_requantize = true;
    // SAFETY: both paths are valid NUL-terminated strings; p lives for the call.
    let rc = unsafe {
        llama_cpp_sys_2::llama_model_quantize(c_src.as_ptr(), c_dst.as_ptr(), &raw const p)
    };
    if rc != 0 {
        let _ = std::fs::remove_file(&partial);
        return Err(err(rc, recent_llama_errors()));
    }
    crate::durable::commit(&partial, dst).map_err(|source| EngineError::Io {
        path: dst.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_accepted_ones() {
        for t in QuantType::ALL {
            assert_eq!(t.name().parse::<QuantType>(), Ok(t));
            assert_eq!(t.name().to_lowercase().parse::<QuantType>(), Ok(t));
        }
        let e = "IQ3_XXS".parse::<QuantType>().unwrap_err().to_string();
        assert!(
            e.contains("IQ3_XXS") && e.contains("Q3_K_M") && e.contains("IQ3_S"),
            "{e}"
        );
        assert!(e.contains("importance matrix"), "{e}");
        let e = "Q3_K_XL".parse::<QuantType>().unwrap_err();
        assert!(!e.needs_imatrix());
        assert!(
            e.to_string()
                .starts_with("unknown quantization type \"Q3_K_XL\""),
            "{e}"
        );
    }
}
