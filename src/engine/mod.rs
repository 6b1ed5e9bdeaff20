//! One rung of the ladder as llama.cpp sees it: a memory-mapped [`Model`] and a [`Context`]
//! that decodes tokens, exposes logits and exports / imports a sequence's KV state.
//!
//! Molt talks to llama.cpp through `llama-cpp-sys-2` (the raw half of the `llama-cpp-2`
//! bindings) behind this thin wrapper of its own, rather than through `llama-cpp-2`'s safe
//! types: those keep their raw pointers crate-private and tie a context's lifetime to a borrowed
//! model, while Molt needs the raw pointers (state-seq export, eval taps, quantization) and a
//! rung that owns its model so that it can unmap the weights (parking) and map them again.
//! `llama-cpp-2` still owns the process-wide backend initialisation ([`backend`]).
//!
//! Main types: [`Model`] (an `Arc`-shared, memory-mapped GGUF), [`Context`] (a llama.cpp
//! context with one sequence), [`ContextConfig`] (the fixed knobs every context of a ladder
//! shares), [`Sampler`] with [`SamplingParams`] presets, and [`Utf8Stream`] for detokenized
//! streaming, and [`PartialForward`] (a rung's last k blocks run over hidden states: top-k
//! recompute).

mod batch;
mod chat;
mod context;
mod grammar;
mod logs;
mod model;
pub mod partial;
mod quantize;
mod sampling;
pub mod system;
pub mod tap;
mod text;

pub use batch::{BatchContext, SeqChunk, SeqId, SeqSpan};
pub use context::{Context, ContextConfig, DEFAULT_N_UBATCH, Span};
pub use grammar::{Grammar, GrammarError, JSON_GRAMMAR};
pub use logs::recent_llama_errors;
pub use model::{ChatMessage, Model, ModelOptions};
pub use partial::PartialForward;
pub use quantize::{QuantType, UnknownQuantType, quantize};
pub use sampling::{Sampler, SamplingParams, argmax, log_softmax, sample_by_full_sort, softmax};
pub use tap::AttentionCapture;
pub use text::Utf8Stream;

use std::sync::OnceLock;

/// A token id in the rung's vocabulary (all rungs of a ladder share one vocabulary).
pub type Token = i32;

/// Errors from the llama.cpp layer.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The file could not be loaded as a model; `detail` carries llama.cpp's own last words.
    #[error("llama.cpp could not load {path}: {detail}")]
    LoadFailed {
        /// The model file.
        path: String,
        /// llama.cpp's last error lines, or why Molt refused before calling it.
        detail: String,
    },
    /// A context could not be created (usually: not enough memory for the KV cache).
    #[error("llama.cpp could not create a context (n_ctx {n_ctx}) for {model}: {detail}")]
    ContextFailed {
        /// The model's name.
        model: String,
        /// Requested context size.
        n_ctx: u32,
        /// llama.cpp's last error lines.
        detail: String,
    },
    /// `llama_decode` returned an error code.
    #[error("decode failed with code {code} at position {pos}: {detail}")]
    DecodeFailed {
        /// llama.cpp's return code (1 = no KV slot, 2 = aborted, < 0 = error).
        code: i32,
        /// First position of the failed batch.
        pos: i32,
        /// llama.cpp's last error lines.
        detail: String,
    },
    /// The tokens would not fit in the context window.
    #[error("{needed} tokens do not fit in the context window of {n_ctx}")]
    ContextOverflow {
        /// Positions the request needs.
        needed: usize,
        /// The context's size.
        n_ctx: u32,
    },
    /// Tokenization failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// The model has no usable chat template.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// State export or import was refused by llama.cpp.
    #[error("sequence state {op} failed: {detail}")]
    State {
        /// "export" or "import".
        op: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// Shedding context was refused.
    #[error("cannot shed {n} tokens after {pinned} pinned of {n_past}: {detail}")]
    Shed {
        /// Leading positions kept.
        pinned: usize,
        /// Positions to drop after them.
        n: usize,
        /// Positions in the sequence.
        n_past: usize,
        /// Why.
        detail: String,
    },
    /// Quantization failed.
    #[error("quantizing {src} to {dst} failed (code {code}): {detail}")]
    Quantize {
        /// Source file.
        src: String,
        /// Destination file.
        dst: String,
        /// llama.cpp's return code.
        code: u32,
        /// llama.cpp's last error lines.
        detail: String,
    },
    /// A value did not fit the C type llama.cpp takes.
    #[error("{what} = {value} is out of range for llama.cpp")]
    OutOfRange {
        /// Which value.
        what: &'static str,
        /// The value.
        value: u64,
    },
    /// An I/O error around a model file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

/// The process-wide llama.cpp backend, initialised once (llama.cpp refuses a second init).
///
/// llama.cpp's log output is captured into a small ring buffer (see [`recent_llama_errors`]),
/// so that a failed load can quote llama.cpp's reason instead of printing noise on every run;
/// set `MOLT_LLAMA_LOG=1` to see everything on stderr.
pub fn backend() -> &'static llama_cpp_2::llama_backend::LlamaBackend {
    static BACKEND: OnceLock<llama_cpp_2::llama_backend::LlamaBackend> = OnceLock::new();
    BACKEND.get_or_init(|| {
        logs::install();
        // An error here means another part of the process initialised the backend already,
        // which in this crate only `backend()` does, so the OnceLock rules it out.
        llama_cpp_2::llama_backend::LlamaBackend::init()
            .expect("llama.cpp backend initialised outside molt::engine::backend()")
    })
}
