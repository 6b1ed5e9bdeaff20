//! [`Grammar`]: a llama.cpp GBNF grammar that constrains which tokens may come next, applied
//! to a logits row before Molt's own sampler draws from it ([`super::Sampler`] keeps the
//! sampling itself, so seeds and log-probabilities behave the same with or without one).
//!
//! [`JSON_GRAMMAR`] is llama.cpp's `grammars/json.gbnf` (any JSON object), which OpenAI's
//! `response_format: {"type": "json_object"}` asks for.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

use super::{Model, Token, recent_llama_errors};

/// llama.cpp's `grammars/json.gbnf`: one JSON object, optionally followed by a little
/// whitespace.
pub const JSON_GRAMMAR: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4})
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// Why a grammar could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The grammar text or root name holds a NUL byte.
    #[error("the grammar contains a NUL byte")]
    Nul,
    /// llama.cpp refused to compile it; `detail` is what it logged.
    #[error("llama.cpp could not compile the grammar: {detail}")]
    Compile {
        /// llama.cpp's last error lines.
        detail: String,
    },
}

/// A compiled grammar and its parse state over one answer.
pub struct Grammar {
    ptr: NonNull<llama_cpp_sys_2::llama_sampler>,
    /// The vocabulary the sampler points into; kept alive with it.
    _model: Arc<Model>,
    /// Which tokens the last [`constrain`](Self::constrain) allowed: only those may be
    /// accepted (llama.cpp throws — across the FFI boundary, an abort — on a token its grammar
    /// cannot take).
    allowed: Vec<bool>,
}

// SAFETY: the sampler is owned by this value alone and only used through `&mut self`, so it is
// never touched from two threads at once; llama.cpp's grammar sampler keeps no thread-local
// state. The model it points into is immutable and kept alive by `_model`.
unsafe impl Send for Grammar {}

impl Drop for Grammar {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from llama_sampler_init_grammar and is freed exactly once.
        unsafe { llama_cpp_sys_2::llama_sampler_free(self.ptr.as_ptr()) }
    }
}

impl Grammar {
    /// Compiles `text` (GBNF, start symbol `root`) over `model`'s vocabulary (every rung of a
    /// ladder shares it, so a vocabulary-only model will do).
    ///
    /// # Errors
    /// [`GrammarError::Nul`] or [`GrammarError::Compile`] with llama.cpp's message.
    pub fn new(model: Arc<Model>, text: &str) -> Result<Self, GrammarError> {
        let g = CString::new(text).map_err(|_| GrammarError::Nul)?;
        let root = c"root";
        let _ = recent_llama_errors();
        // SAFETY: the vocabulary outlives the sampler (kept in `_model`); both strings are
        // NUL-terminated and live across the call, which copies what it needs.
        let raw = unsafe {
            llama_cpp_sys_2::llama_sampler_init_grammar(model.vocab(), g.as_ptr(), root.as_ptr())
        };
        let ptr = NonNull::new(raw).ok_or_else(|| GrammarError::Compile {
            detail: recent_llama_errors(),
        })?;
        Ok(Self {
            ptr,
            _model: model,
            allowed: Vec::new(),
        })
    }

    /// Sets to −∞ every logit whose token the grammar cannot take next.
    pub fn constrain(&mut self, logits: &mut [f32]) {
        let mut data: Vec<llama_cpp_sys_2::llama_token_data> = logits
            .iter()
            .enumerate()
            .map(|(i, &logit)| llama_cpp_sys_2::llama_token_data {
                id: Token::try_from(i).unwrap_or(Token::MAX),
                logit,
                p: 0.0,
            })
            .collect();
        let mut array = llama_cpp_sys_2::llama_token_data_array {
            data: data.as_mut_ptr(),
            size: data.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: `array` points at `data`, valid for `size` entries for the whole call; the
        // grammar sampler only rewrites logits in place (it neither resizes nor reorders).
        unsafe { llama_cpp_sys_2::llama_sampler_apply(self.ptr.as_ptr(), &raw mut array) };
        self.allowed.clear();
        self.allowed.resize(logits.len(), false);
        for d in &data {
            if let Ok(i) = usize::try_from(d.id)
                && i < logits.len()
            {
                logits[i] = d.logit;
                self.allowed[i] = d.logit.is_finite();
            }
        }
    }

    /// Advances the parse by `token`. A token the last [`constrain`](Self::constrain) did not
    /// allow is ignored (returns false) rather than handed to llama.cpp.
    pub fn accept(&mut self, token: Token) -> bool {
        let ok = usize::try_from(token)
            .ok()
            .and_then(|i| self.allowed.get(i).copied())
            .unwrap_or(false);
        if ok {
            // SAFETY: `ptr` is a live sampler; the token was allowed by the grammar's last
            // apply, so accepting it cannot make llama.cpp throw.
            unsafe { llama_cpp_sys_2::llama_sampler_accept(self.ptr.as_ptr(), token) };
        }
        ok
    }
}
