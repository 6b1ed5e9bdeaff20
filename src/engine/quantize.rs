//! Requantization through llama.cpp's own quantize API: how tier1 of the shipped ladder is
//! built from tier0 on the user's machine (same weights, lower precision).

use super::{EngineError, backend, recent_llama_errors};
use std::ffi::CString;
use std::path::Path;

/// Target quantization types Molt offers for a precision rung.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum QuantType {
    /// 2-bit K-quant (llama.cpp `Q2_K`): the smallest type that still gives coherent text.
    #[serde(rename = "Q2_K")]
    Q2K,
    /// 3-bit K-quant, small variant (`Q3_K_S`).
    #[serde(rename = "Q3_K_S")]
    Q3KS,
    /// 8-bit (`Q8_0`), used for tiny test models whose rows are too short for K-quants.
    #[serde(rename = "Q8_0")]
    Q8_0,
}

impl QuantType {
    fn ftype(self) -> llama_cpp_sys_2::llama_ftype {
        match self {
            Self::Q2K => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q2_K,
            Self::Q3KS => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q3_K_S,
            Self::Q8_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q8_0,
        }
    }

    /// llama.cpp's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q2K => "Q2_K",
            Self::Q3KS => "Q3_K_S",
            Self::Q8_0 => "Q8_0",
        }
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
