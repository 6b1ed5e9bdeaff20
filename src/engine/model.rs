//! A memory-mapped GGUF model owned by an `Arc`, so contexts keep it alive and dropping the
//! last handle unmaps the weights (the mechanism behind parking).

use super::{EngineError, Token, backend, recent_llama_errors};
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

/// How a model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelOptions {
    /// Memory-map the weights (Molt's default: the page cache holds them, RSS counts only the
    /// pages touched, and unmapping gives them back at once).
    pub mmap: bool,
    /// Let llama.cpp repack weights into its CPU-optimised layouts (`use_extra_bufts`). Off by
    /// default in Molt: a repacked weight is a copy in anonymous memory beside the mapped file,
    /// which roughly doubles what a rung really occupies and makes the mapped pages
    /// meaningless as a footprint. Set `MOLT_REPACK=1` to turn it on (faster prefill on some
    /// CPUs, at that memory cost).
    pub repack: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            mmap: true,
            repack: std::env::var_os("MOLT_REPACK").is_some_and(|v| v != "0"),
        }
    }
}

/// One chat message for the model's chat template.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// "system", "user" or "assistant".
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A loaded llama.cpp model.
pub struct Model {
    ptr: NonNull<llama_cpp_sys_2::llama_model>,
    path: PathBuf,
    name: String,
    /// Whether llama.cpp was asked to repack the weights (see [`ModelOptions::repack`]).
    repack: bool,
}

// SAFETY: a llama_model is immutable after loading; llama.cpp shares one model between
// contexts on different threads, and every method here only reads it.
unsafe impl Send for Model {}
// SAFETY: as above, all access through `&Model` is read-only on the llama.cpp side.
unsafe impl Sync for Model {}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name)
            .field("path", &self.path)
            .finish()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from llama_model_load_from_file and is freed exactly once; every
        // context holds an Arc<Model>, so none outlives this.
        unsafe { llama_cpp_sys_2::llama_model_free(self.ptr.as_ptr()) }
    }
}

impl Model {
    /// Loads a GGUF file. `name` is the rung name used in messages.
    ///
    /// The file is checked by Molt's own GGUF reader first, so a truncated or foreign file is
    /// a clear error here rather than an abort inside llama.cpp.
    ///
    /// # Errors
    /// [`EngineError::LoadFailed`] when the file is missing, is not a complete GGUF, or
    /// llama.cpp refuses it (its reason is quoted).
    pub fn load(path: &Path, name: &str, opts: ModelOptions) -> Result<Arc<Self>, EngineError> {
        Self::load_inner(path, name, opts, false)
    }

    /// Loads only a GGUF file's metadata and vocabulary, no weights: enough to tokenize and
    /// render the chat template (the HTTP service measures prompts with it) for a few MiB,
    /// without keeping any rung's weights mapped. Decoding with such a model is not possible.
    ///
    /// # Errors
    /// As [`Model::load`].
    pub fn load_vocab_only(path: &Path, name: &str) -> Result<Arc<Self>, EngineError> {
        Self::load_inner(path, name, ModelOptions::default(), true)
    }

    fn load_inner(
        path: &Path,
        name: &str,
        opts: ModelOptions,
        vocab_only: bool,
    ) -> Result<Arc<Self>, EngineError> {
        let fail = |detail: String| EngineError::LoadFailed {
            path: path.display().to_string(),
            detail,
        };
        crate::gguf::GgufFile::open(path).map_err(|e| fail(e.to_string()))?;
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| fail("path contains a NUL byte".into()))?;
        backend();
        let _ = recent_llama_errors();
        // SAFETY: plain-data default parameters from llama.cpp.
        let mut params = unsafe { llama_cpp_sys_2::llama_model_default_params() };
        params.load_mode = if opts.mmap {
            llama_cpp_sys_2::LLAMA_LOAD_MODE_MMAP
        } else {
            llama_cpp_sys_2::LLAMA_LOAD_MODE_NONE
        };
        params.n_gpu_layers = 0;
        params.use_extra_bufts = opts.repack;
        params.vocab_only = vocab_only;
        // SAFETY: c_path is a valid NUL-terminated string; params is a valid struct by value.
        let raw = unsafe { llama_cpp_sys_2::llama_model_load_from_file(c_path.as_ptr(), params) };
        let ptr = NonNull::new(raw).ok_or_else(|| fail(recent_llama_errors()))?;
        Ok(Arc::new(Self {
            ptr,
            path: path.to_path_buf(),
            name: name.to_string(),
            repack: opts.repack && !vocab_only,
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut llama_cpp_sys_2::llama_model {
        self.ptr.as_ptr()
    }

    pub(crate) fn vocab(&self) -> *const llama_cpp_sys_2::llama_vocab {
        // SAFETY: the model is alive; the vocab pointer lives as long as the model.
        unsafe { llama_cpp_sys_2::llama_model_get_vocab(self.ptr.as_ptr()) }
    }

    /// The rung name this model was loaded as.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The GGUF file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the model was loaded with llama.cpp's CPU repack (its weights copied into
    /// anonymous memory in the CPU's layouts).
    pub fn repack(&self) -> bool {
        self.repack
    }

    /// Number of transformer layers.
    pub fn n_layer(&self) -> usize {
        // SAFETY: read-only query on a live model.
        usize::try_from(unsafe { llama_cpp_sys_2::llama_model_n_layer(self.as_ptr()) }).unwrap_or(0)
    }

    /// Hidden size.
    pub fn n_embd(&self) -> usize {
        // SAFETY: read-only query on a live model.
        usize::try_from(unsafe { llama_cpp_sys_2::llama_model_n_embd(self.as_ptr()) }).unwrap_or(0)
    }

    /// Vocabulary size (the length of a logits row).
    pub fn n_vocab(&self) -> usize {
        // SAFETY: read-only query on a live vocab.
        usize::try_from(unsafe { llama_cpp_sys_2::llama_vocab_n_tokens(self.vocab()) }).unwrap_or(0)
    }

    /// Training context length.
    pub fn n_ctx_train(&self) -> u32 {
        // SAFETY: read-only query on a live model.
        u32::try_from(unsafe { llama_cpp_sys_2::llama_model_n_ctx_train(self.as_ptr()) })
            .unwrap_or(0)
    }

    /// Number of parameters (for FLOP estimates).
    pub fn n_params(&self) -> u64 {
        // SAFETY: read-only query on a live model.
        unsafe { llama_cpp_sys_2::llama_model_n_params(self.as_ptr()) }
    }

    /// Total bytes of the weight tensors.
    pub fn size_bytes(&self) -> u64 {
        // SAFETY: read-only query on a live model.
        unsafe { llama_cpp_sys_2::llama_model_size(self.as_ptr()) }
    }

    /// True if the model adds BOS when tokenizing with special tokens.
    pub fn adds_bos(&self) -> bool {
        // SAFETY: read-only query on a live vocab.
        unsafe { llama_cpp_sys_2::llama_vocab_get_add_bos(self.vocab()) }
    }

    /// True for end-of-generation tokens (EOS, EOT, `<|im_end|>` …).
    pub fn is_eog(&self, t: Token) -> bool {
        // SAFETY: read-only query on a live vocab; out-of-range ids return false.
        unsafe { llama_cpp_sys_2::llama_vocab_is_eog(self.vocab(), t) }
    }

    /// A metadata value as a string, if present.
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        loop {
            // SAFETY: buf is writable for buf.len() bytes; llama.cpp writes a NUL-terminated
            // string of at most that size and returns the full length (or -1 if absent).
            let n = unsafe {
                llama_cpp_sys_2::llama_model_meta_val_str(
                    self.as_ptr(),
                    key.as_ptr(),
                    buf.as_mut_ptr().cast::<c_char>(),
                    buf.len(),
                )
            };
            let n = usize::try_from(n).ok()?;
            if n < buf.len() {
                buf.truncate(n);
                return String::from_utf8(buf).ok();
            }
            buf.resize(n + 1, 0);
        }
    }

    /// Tokenizes text. `special` parses control tokens such as `<|im_start|>` (used for chat
    /// prompts rendered by the template); `add_bos` follows the model's own setting.
    ///
    /// # Errors
    /// [`EngineError::Tokenize`] if llama.cpp reports a failure.
    pub fn tokenize(&self, text: &str, special: bool) -> Result<Vec<Token>, EngineError> {
        self.tokenize_with(text, self.adds_bos(), special)
    }

    /// Tokenizes text with the BOS choice made by the caller (a piece of a longer prompt must
    /// not get a BOS of its own).
    pub(crate) fn tokenize_with(
        &self,
        text: &str,
        add_bos: bool,
        special: bool,
    ) -> Result<Vec<Token>, EngineError> {
        let len = i32::try_from(text.len())
            .map_err(|_| EngineError::Tokenize("text longer than 2 GiB".into()))?;
        let mut out: Vec<Token> = vec![0; text.len() + 8];
        for _ in 0..2 {
            let cap = i32::try_from(out.len()).unwrap_or(i32::MAX);
            // SAFETY: text is valid for len bytes; out is writable for cap tokens.
            let n = unsafe {
                llama_cpp_sys_2::llama_tokenize(
                    self.vocab(),
                    text.as_ptr().cast::<c_char>(),
                    len,
                    out.as_mut_ptr(),
                    cap,
                    add_bos,
                    special,
                )
            };
            if n >= 0 {
                out.truncate(usize::try_from(n).unwrap_or(0));
                return Ok(out);
            }
            if n == i32::MIN {
                return Err(EngineError::Tokenize("token count overflows i32".into()));
            }
            out.resize(usize::try_from(n.unsigned_abs()).unwrap_or(0), 0);
        }
        Err(EngineError::Tokenize(
            "tokenizer kept asking for more room".into(),
        ))
    }

    /// The bytes a token renders as (special tokens render empty: they are control, not text).
    pub fn token_bytes(&self, t: Token) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        loop {
            let cap = i32::try_from(buf.len()).unwrap_or(i32::MAX);
            // SAFETY: buf is writable for cap bytes; llama.cpp returns the needed size negated
            // when the buffer is too small.
            let n = unsafe {
                llama_cpp_sys_2::llama_token_to_piece(
                    self.vocab(),
                    t,
                    buf.as_mut_ptr().cast::<c_char>(),
                    cap,
                    0,
                    false,
                )
            };
            if n >= 0 {
                buf.truncate(usize::try_from(n).unwrap_or(0));
                return buf;
            }
            buf.resize(usize::try_from(n.unsigned_abs()).unwrap_or(0), 0);
        }
    }

    /// Detokenizes a whole sequence (lossy UTF-8).
    pub fn detokenize(&self, tokens: &[Token]) -> String {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| self.token_bytes(t)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The model's own chat template string, if it ships one.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: returns a pointer into the model's metadata (valid while the model lives) or
        // NULL.
        let p =
            unsafe { llama_cpp_sys_2::llama_model_chat_template(self.as_ptr(), std::ptr::null()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null pointer to a NUL-terminated string owned by the model.
        Some(
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// Renders a conversation with the model's chat template, ending with the assistant's turn
    /// opened when `add_assistant` is set.
    ///
    /// # Errors
    /// [`EngineError::ChatTemplate`] when the model has no template llama.cpp recognises.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<String, EngineError> {
        let tmpl = self.chat_template().ok_or_else(|| {
            EngineError::ChatTemplate(format!("{} ships no chat template", self.name))
        })?;
        let c_tmpl = CString::new(tmpl)
            .map_err(|_| EngineError::ChatTemplate("template contains NUL".into()))?;
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|m| {
                Ok((
                    CString::new(m.role.as_str())
                        .map_err(|_| EngineError::ChatTemplate("role contains NUL".into()))?,
                    CString::new(m.content.as_str())
                        .map_err(|_| EngineError::ChatTemplate("message contains NUL".into()))?,
                ))
            })
            .collect::<Result<_, EngineError>>()?;
        let msgs: Vec<llama_cpp_sys_2::llama_chat_message> = owned
            .iter()
            .map(|(r, c)| llama_cpp_sys_2::llama_chat_message {
                role: r.as_ptr(),
                content: c.as_ptr(),
            })
            .collect();
        let mut buf = vec![
            0u8;
            messages
                .iter()
                .map(|m| m.content.len() + m.role.len())
                .sum::<usize>()
                * 2
                + 256
        ];
        for _ in 0..2 {
            let cap = i32::try_from(buf.len()).unwrap_or(i32::MAX);
            // SAFETY: all pointers in msgs point into `owned`, alive for this call; buf is
            // writable for cap bytes.
            let n = unsafe {
                llama_cpp_sys_2::llama_chat_apply_template(
                    c_tmpl.as_ptr(),
                    msgs.as_ptr(),
                    msgs.len(),
                    add_assistant,
                    buf.as_mut_ptr().cast::<c_char>(),
                    cap,
                )
            };
            let Ok(n) = usize::try_from(n) else {
                return Err(EngineError::ChatTemplate(format!(
                    "llama.cpp does not support {}'s chat template",
                    self.name
                )));
            };
            if n <= buf.len() {
                buf.truncate(n);
                return String::from_utf8(buf).map_err(|_| {
                    EngineError::ChatTemplate("template produced invalid UTF-8".into())
                });
            }
            buf.resize(n, 0);
        }
        Err(EngineError::ChatTemplate(
            "template output kept growing".into(),
        ))
    }
}
