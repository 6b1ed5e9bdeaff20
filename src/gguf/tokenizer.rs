//! Tokenizer identity: [`TokenizerIdentity`], [`TokenizerDigest`], [`TokenizerMismatch`].
//!
//! Rungs of a ladder must share one tokenizer exactly — a migrated generation continues
//! with the same token ids on the destination rung. The identity holds everything in a GGUF
//! that decides tokenization (tokenizer model, pre-tokenizer, token strings, token types,
//! merges, special ids, `add_bos`), so [`TokenizerIdentity::compare`] can say *where* two
//! files differ, and a [`TokenizerDigest`] of sha256 sums small enough to record in a
//! manifest. Hashes cover each string length-prefixed, so `["ab", "c"]` and `["a", "bc"]`
//! differ.

use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::gguf::error::{GgufError, Result};
use crate::gguf::reader::GgufFile;
use crate::gguf::value::{ArrayValue, Value};

/// Special token ids a tokenizer declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct SpecialTokens {
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
}

/// sha256 sums of a tokenizer, for manifests and quick equality.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenizerDigest {
    /// `tokenizer.ggml.model`, e.g. `"gpt2"`.
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `"qwen2"`.
    pub pre: Option<String>,
    /// Number of tokens.
    pub n_tokens: usize,
    /// Number of merges (0 for tokenizers without merges).
    pub n_merges: usize,
    /// Hex sha256 of the token strings.
    pub tokens_sha256: String,
    /// Hex sha256 of the token types (of nothing if absent).
    pub token_types_sha256: String,
    /// Hex sha256 of the merges (of nothing if absent).
    pub merges_sha256: String,
    /// Special ids.
    pub special: SpecialTokens,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// Hex sha256 over all of the above: equal iff the tokenizers are (barring collisions).
    pub sha256: String,
}

/// Everything in a GGUF file that decides how text becomes token ids.
#[derive(Debug, Clone)]
pub struct TokenizerIdentity {
    source: PathBuf,
    model: String,
    pre: Option<String>,
    tokens: Vec<String>,
    token_types: Vec<i32>,
    merges: Vec<String>,
    special: SpecialTokens,
    add_bos: Option<bool>,
    digest: TokenizerDigest,
}

impl TokenizerIdentity {
    /// Reads the tokenizer of an opened file (copying the vocabulary and merges).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] without `tokenizer.ggml.model` or `tokenizer.ggml.tokens`;
    /// [`GgufError::WrongType`] if a tokenizer key has the wrong type (token types must be
    /// `i32`, as llama.cpp requires).
    pub fn from_gguf(f: &GgufFile) -> Result<TokenizerIdentity> {
        let model = f.get_str("tokenizer.ggml.model")?.to_owned();
        let pre = f.get_opt::<String>("tokenizer.ggml.pre")?;
        let tokens = f.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let token_types = match f.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => f.get_i32_array("tokenizer.ggml.token_type")?.to_vec(),
        };
        let merges = match f.get("tokenizer.ggml.merges") {
            None => Vec::new(),
            Some(Value::Array(ArrayValue::Strings(m))) => m.clone(),
            Some(_) => f.get_str_array("tokenizer.ggml.merges")?.to_vec(),
        };
        let special = SpecialTokens {
            bos: f.get_opt("tokenizer.ggml.bos_token_id")?,
            eos: f.get_opt("tokenizer.ggml.eos_token_id")?,
            eot: f.get_opt("tokenizer.ggml.eot_token_id")?,
            pad: f.get_opt("tokenizer.ggml.padding_token_id")?,
        };
        let add_bos = f.get_opt("tokenizer.ggml.add_bos_token")?;
        Ok(TokenizerIdentity::new(
            f.path(),
            model,
            pre,
            tokens,
            token_types,
            merges,
            special,
            add_bos,
        ))
    }

    /// Builds an identity from parts (e.g. a tokenizer about to be written).
    #[allow(clippy::too_many_arguments)] // one argument per identity component
    #[must_use]
    pub fn new(
        source: &Path,
        model: String,
        pre: Option<String>,
        tokens: Vec<String>,
        token_types: Vec<i32>,
        merges: Vec<String>,
        special: SpecialTokens,
        add_bos: Option<bool>,
    ) -> TokenizerIdentity {
        let tokens_sha256 = hash_strings(&tokens);
        let merges_sha256 = hash_strings(&merges);
        let mut h = Sha256::new();
        for t in &token_types {
            h.update(t.to_le_bytes());
        }
        let token_types_sha256 = hex::encode(h.finalize());
        let mut all = Sha256::new();
        for part in [
            model.as_str(),
            pre.as_deref().unwrap_or("\u{0}none"),
            &tokens_sha256,
            &token_types_sha256,
            &merges_sha256,
        ] {
            all.update((part.len() as u64).to_le_bytes());
            all.update(part.as_bytes());
        }
        for id in [special.bos, special.eos, special.eot, special.pad] {
            all.update(id.map_or(u64::MAX, u64::from).to_le_bytes());
        }
        all.update([match add_bos {
            None => 2u8,
            Some(b) => u8::from(b),
        }]);
        let digest = TokenizerDigest {
            model: model.clone(),
            pre: pre.clone(),
            n_tokens: tokens.len(),
            n_merges: merges.len(),
            tokens_sha256,
            token_types_sha256,
            merges_sha256,
            special,
            add_bos,
            sha256: hex::encode(all.finalize()),
        };
        TokenizerIdentity {
            source: source.to_path_buf(),
            model,
            pre,
            tokens,
            token_types,
            merges,
            special,
            add_bos,
            digest,
        }
    }

    /// The file this identity was read from.
    #[must_use]
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// `tokenizer.ggml.model`.
    #[must_use]
    pub fn model(&self) -> &str {
        &self.model
    }

    /// `tokenizer.ggml.pre`.
    #[must_use]
    pub fn pre(&self) -> Option<&str> {
        self.pre.as_deref()
    }

    /// Number of tokens.
    #[must_use]
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The token strings.
    #[must_use]
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// The token types (empty if the file has none).
    #[must_use]
    pub fn token_types(&self) -> &[i32] {
        &self.token_types
    }

    /// The merges (empty if the file has none).
    #[must_use]
    pub fn merges(&self) -> &[String] {
        &self.merges
    }

    /// Special ids.
    #[must_use]
    pub fn special(&self) -> SpecialTokens {
        self.special
    }

    /// `tokenizer.ggml.add_bos_token`.
    #[must_use]
    pub fn add_bos(&self) -> Option<bool> {
        self.add_bos
    }

    /// The sha256 digest.
    #[must_use]
    pub fn digest(&self) -> &TokenizerDigest {
        &self.digest
    }

    /// Checks that `other` tokenizes exactly like `self`.
    ///
    /// # Errors
    /// [`TokenizerMismatch`] with the first difference found, in this order: tokenizer
    /// model, pre-tokenizer, vocabulary size, first differing token, token types, first
    /// differing merge, special ids, `add_bos`.
    pub fn compare(&self, other: &TokenizerIdentity) -> Result<(), TokenizerMismatch> {
        let fail = |reason| {
            Err(TokenizerMismatch {
                left: self.source.clone(),
                right: other.source.clone(),
                reason,
            })
        };
        if self.digest.sha256 == other.digest.sha256 {
            return Ok(());
        }
        if self.model != other.model {
            return fail(MismatchReason::Model {
                left: self.model.clone(),
                right: other.model.clone(),
            });
        }
        if self.pre != other.pre {
            return fail(MismatchReason::PreTokenizer {
                left: self.pre.clone(),
                right: other.pre.clone(),
            });
        }
        if self.tokens.len() != other.tokens.len() {
            return fail(MismatchReason::VocabSize {
                left: self.tokens.len(),
                right: other.tokens.len(),
            });
        }
        if let Some((index, (l, r))) = first_difference(&self.tokens, &other.tokens) {
            return fail(MismatchReason::Token {
                index,
                left: l.clone(),
                right: r.clone(),
            });
        }
        if self.token_types.len() != other.token_types.len() {
            return fail(MismatchReason::TokenTypeCount {
                left: self.token_types.len(),
                right: other.token_types.len(),
            });
        }
        if let Some((index, (l, r))) = first_difference(&self.token_types, &other.token_types) {
            return fail(MismatchReason::TokenType {
                index,
                left: *l,
                right: *r,
            });
        }
        let n = self.merges.len().max(other.merges.len());
        if let Some(index) = (0..n).find(|&i| self.merges.get(i) != other.merges.get(i)) {
            return fail(MismatchReason::Merge {
                index,
                left: self.merges.get(index).cloned(),
                right: other.merges.get(index).cloned(),
            });
        }
        let (a, b) = (self.special, other.special);
        for (which, l, r) in [
            ("bos", a.bos, b.bos),
            ("eos", a.eos, b.eos),
            ("eot", a.eot, b.eot),
            ("pad", a.pad, b.pad),
        ] {
            if l != r {
                return fail(MismatchReason::SpecialToken {
                    which,
                    left: l,
                    right: r,
                });
            }
        }
        if self.add_bos != other.add_bos {
            return fail(MismatchReason::AddBos {
                left: self.add_bos,
                right: other.add_bos,
            });
        }
        // Equal components always give equal digests; reaching here means a hash collision.
        Ok(())
    }
}

fn first_difference<'a, T: PartialEq>(a: &'a [T], b: &'a [T]) -> Option<(usize, (&'a T, &'a T))> {
    a.iter().zip(b).enumerate().find(|(_, (x, y))| x != y)
}

fn hash_strings(items: &[String]) -> String {
    let mut h = Sha256::new();
    for s in items {
        h.update((s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Two files do not share a tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} and {} have different tokenizers: {reason}", left.display(), right.display())]
pub struct TokenizerMismatch {
    /// The file of `self` in [`TokenizerIdentity::compare`].
    pub left: PathBuf,
    /// The file of `other`.
    pub right: PathBuf,
    /// The first difference found.
    pub reason: MismatchReason,
}

/// Where two tokenizers differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MismatchReason {
    /// Different `tokenizer.ggml.model`.
    Model {
        /// Left value.
        left: String,
        /// Right value.
        right: String,
    },
    /// Different `tokenizer.ggml.pre`.
    PreTokenizer {
        /// Left value.
        left: Option<String>,
        /// Right value.
        right: Option<String>,
    },
    /// Different number of tokens.
    VocabSize {
        /// Left count.
        left: usize,
        /// Right count.
        right: usize,
    },
    /// Token `index` has a different string.
    Token {
        /// Token id.
        index: usize,
        /// Left string.
        left: String,
        /// Right string.
        right: String,
    },
    /// One file has token types and the other has a different number (or none).
    TokenTypeCount {
        /// Left count.
        left: usize,
        /// Right count.
        right: usize,
    },
    /// Token `index` has a different type.
    TokenType {
        /// Token id.
        index: usize,
        /// Left type.
        left: i32,
        /// Right type.
        right: i32,
    },
    /// Merge `index` differs (or exists on one side only).
    Merge {
        /// Merge rank.
        index: usize,
        /// Left merge, if any.
        left: Option<String>,
        /// Right merge, if any.
        right: Option<String>,
    },
    /// A special token id differs.
    SpecialToken {
        /// `"bos"`, `"eos"`, `"eot"` or `"pad"`.
        which: &'static str,
        /// Left id.
        left: Option<u32>,
        /// Right id.
        right: Option<u32>,
    },
    /// `tokenizer.ggml.add_bos_token` differs.
    AddBos {
        /// Left flag.
        left: Option<bool>,
        /// Right flag.
        right: Option<bool>,
    },
}

struct Quoted<'a>(Option<&'a str>);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(s) => write!(f, "'{}'", s.escape_debug()),
            None => f.write_str("none"),
        }
    }
}

fn opt<T: fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "none".to_owned(), |x| x.to_string())
}

impl fmt::Display for MismatchReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MismatchReason::Model { left, right } => write!(
                f,
                "different tokenizer model ({} vs {})",
                Quoted(Some(left)),
                Quoted(Some(right))
            ),
            MismatchReason::PreTokenizer { left, right } => write!(
                f,
                "different pre-tokenizer ({} vs {})",
                Quoted(left.as_deref()),
                Quoted(right.as_deref())
            ),
            MismatchReason::VocabSize { left, right } => {
                write!(f, "different vocab size ({left} vs {right})")
            }
            MismatchReason::Token { index, left, right } => write!(
                f,
                "token #{index} differs ({} vs {})",
                Quoted(Some(left)),
                Quoted(Some(right))
            ),
            MismatchReason::TokenTypeCount { left, right } => {
                write!(f, "different number of token types ({left} vs {right})")
            }
            MismatchReason::TokenType { index, left, right } => {
                write!(f, "type of token #{index} differs ({left} vs {right})")
            }
            MismatchReason::Merge { index, left, right } => write!(
                f,
                "merges differ at #{index} ({} vs {})",
                Quoted(left.as_deref()),
                Quoted(right.as_deref())
            ),
            MismatchReason::SpecialToken { which, left, right } => write!(
                f,
                "special ids differ: {which} {} vs {}",
                opt(*left),
                opt(*right)
            ),
            MismatchReason::AddBos { left, right } => {
                write!(
                    f,
                    "add_bos_token differs ({} vs {})",
                    opt(*left),
                    opt(*right)
                )
            }
        }
    }
}

/// Reads both files' tokenizers and compares them; a convenience for ladder loading.
///
/// # Errors
/// The outer error if either file's tokenizer cannot be read; the inner one if they differ.
pub fn compare_files(
    a: &GgufFile,
    b: &GgufFile,
) -> Result<Result<(), TokenizerMismatch>, GgufError> {
    let ia = TokenizerIdentity::from_gguf(a)?;
    let ib = TokenizerIdentity::from_gguf(b)?;
    Ok(ia.compare(&ib))
}
