//! [`TinyTokenizer`]: a small GPT-2 style byte-level BPE that llama.cpp accepts.
//!
//! The vocabulary is the 256 byte-level symbols of GPT-2's `bytes_to_unicode` mapping, then
//! the tokens produced by BPE merges learnt from a small built-in English/code text, then
//! the three Qwen special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (control
//! type). It is written with `tokenizer.ggml.model = "gpt2"` and `tokenizer.ggml.pre =
//! "qwen2"`, so llama.cpp runs its real BPE code path — pre-tokenizer regex, merge ranks,
//! special-token parsing — on a vocabulary small enough for fast tests. Special ids follow
//! the Qwen2.5 instruct GGUFs: bos = pad = `<|endoftext|>`, eos = `<|im_end|>`,
//! `add_bos_token = false`.
//!
//! [`TinyTokenizer::alt`] learns its merges from a different text (the corpus upper-cased),
//! giving a tokenizer of the same size whose tokens differ from token #256 on: the fixture
//! for "the ladder refuses rungs with different tokenizers".

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::OnceLock;

use crate::gguf::{GgufWriter, SpecialTokens, TokenizerIdentity, WriteError};

/// The built-in training text.
pub const CORPUS: &str = include_str!("corpus.txt");

/// Merged tokens learnt by [`TinyTokenizer::standard`] and [`TinyTokenizer::alt`].
pub const DEFAULT_MERGED_TOKENS: usize = 400;

/// `<|endoftext|>`.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// `<|im_start|>`.
pub const IM_START: &str = "<|im_start|>";
/// `<|im_end|>`.
pub const IM_END: &str = "<|im_end|>";

/// llama.cpp token types (`enum llama_token_type`).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;

/// A ChatML template that llama.cpp's `llama_chat_apply_template` detects as chatml (it
/// looks for `<|im_start|>`) and that renders exactly what the built-in chatml formatter
/// renders: no default system prompt, unlike Qwen2.5's full template.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + \
message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if \
add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A byte-level BPE tokenizer with Qwen-style special tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyTokenizer {
    variant: String,
    tokens: Vec<String>,
    token_types: Vec<i32>,
    merges: Vec<String>,
    ranks: HashMap<(String, String), usize>,
    ids: HashMap<String, u32>,
}

impl TinyTokenizer {
    /// The standard tiny tokenizer: 400 merged tokens learnt from [`CORPUS`]. Trained once
    /// per process and cloned.
    #[must_use]
    pub fn standard() -> TinyTokenizer {
        static STANDARD: OnceLock<TinyTokenizer> = OnceLock::new();
        STANDARD
            .get_or_init(|| TinyTokenizer::train("standard", CORPUS, DEFAULT_MERGED_TOKENS))
            .clone()
    }

    /// The alternative tokenizer: as many merged tokens, learnt from the upper-cased corpus,
    /// so it has the same vocabulary size but different tokens and merges. Trained once per
    /// process and cloned.
    #[must_use]
    pub fn alt() -> TinyTokenizer {
        static ALT: OnceLock<TinyTokenizer> = OnceLock::new();
        ALT.get_or_init(|| {
            TinyTokenizer::train("alt", &CORPUS.to_uppercase(), DEFAULT_MERGED_TOKENS)
        })
        .clone()
    }

    /// Learns up to `n_merged` new tokens from `text` by byte-level BPE and appends the three
    /// special tokens. Ties between equally frequent pairs go to the lexicographically
    /// smallest pair, so training is deterministic. Training stops early if every
    /// pre-token has become a single symbol.
    #[must_use]
    pub fn train(variant: &str, text: &str, n_merged: usize) -> TinyTokenizer {
        let b2u = bytes_to_unicode();
        let mut tokens: Vec<String> = byte_order()
            .iter()
            .map(|&b| b2u[b as usize].to_string())
            .collect();
        let mut ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();

        // Pre-token -> count, each pre-token as its byte-level symbols.
        let mut word_counts: BTreeMap<String, usize> = BTreeMap::new();
        for w in pre_tokenize(text) {
            *word_counts.entry(w.to_owned()).or_default() += 1;
        }
        let mut words: Vec<(Vec<String>, usize)> = word_counts
            .into_iter()
            .map(|(w, n)| (to_symbols(&w, &b2u), n))
            .collect();

        let mut merges = Vec::new();
        let target = tokens.len() + n_merged;
        while tokens.len() < target {
            let mut pairs: BTreeMap<(&str, &str), usize> = BTreeMap::new();
            for (syms, n) in &words {
                for p in syms.windows(2) {
                    *pairs.entry((p[0].as_str(), p[1].as_str())).or_default() += n;
                }
            }
            // Highest count; BTreeMap order makes the first maximum the smallest pair.
            let Some(((a, b), _)) = pairs
                .iter()
                .fold(
                    None,
                    |best: Option<(&(&str, &str), usize)>, (p, &n)| match best {
                        Some((_, bn)) if bn >= n => best,
                        _ => Some((p, n)),
                    },
                )
                .map(|(p, n)| ((p.0.to_owned(), p.1.to_owned()), n))
            else {
                break;
            };
            let joined = format!("{a}{b}");
            for (syms, _) in &mut words {
                merge_pair(syms, &a, &b, &joined);
            }
            merges.push(format!("{a} {b}"));
            // Two different merges can yield the same string; the vocabulary keeps it once
            // (llama.cpp requires unique token texts).
            if !ids.contains_key(&joined) {
                ids.insert(joined.clone(), tokens.len() as u32);
                tokens.push(joined);
            }
        }

        let mut token_types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
        for s in [ENDOFTEXT, IM_START, IM_END] {
            ids.insert(s.to_owned(), tokens.len() as u32);
            tokens.push(s.to_owned());
            token_types.push(TOKEN_TYPE_CONTROL);
        }
        let ranks = merges
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| ((a.to_owned(), b.to_owned()), i))
            })
            .collect();
        TinyTokenizer {
            variant: variant.to_owned(),
            tokens,
            token_types,
            merges,
            ranks,
            ids,
        }
    }

    /// Which variant this is (`"standard"`, `"alt"`, or the name given to `train`).
    #[must_use]
    pub fn variant(&self) -> &str {
        &self.variant
    }

    /// Vocabulary size, special tokens included.
    #[must_use]
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// The token strings (byte-level symbols, then merged tokens, then specials).
    #[must_use]
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// The merges in rank order, as `"a b"`.
    #[must_use]
    pub fn merges(&self) -> &[String] {
        &self.merges
    }

    /// The token types (1 normal, 3 control).
    #[must_use]
    pub fn token_types(&self) -> &[i32] {
        &self.token_types
    }

    /// The id of a token string, if present.
    #[must_use]
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The special ids as written to the GGUF.
    #[must_use]
    pub fn special(&self) -> SpecialTokens {
        SpecialTokens {
            bos: self.token_id(ENDOFTEXT),
            eos: self.token_id(IM_END),
            eot: None,
            pad: self.token_id(ENDOFTEXT),
        }
    }

    /// Tokenizes `text` the way llama.cpp's qwen2 BPE path does for ASCII text: special
    /// tokens are matched literally, the rest is pre-tokenized (an ASCII rendering of the
    /// qwen2 regex) and each pre-token merged by rank. For tests and expectations; the
    /// engine tokenizes with llama.cpp itself.
    #[must_use]
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let b2u = bytes_to_unicode();
        let mut out = Vec::new();
        for (piece, special) in split_special(text) {
            if special {
                out.extend(self.token_id(piece));
                continue;
            }
            for w in pre_tokenize(piece) {
                let mut syms = to_symbols(w, &b2u);
                loop {
                    let best = syms
                        .windows(2)
                        .enumerate()
                        .filter_map(|(i, p)| {
                            self.ranks
                                .get(&(p[0].clone(), p[1].clone()))
                                .map(|&r| (r, i))
                        })
                        .min();
                    let Some((_, i)) = best else { break };
                    let merged = format!("{}{}", syms[i], syms[i + 1]);
                    syms.splice(i..i + 2, [merged]);
                }
                out.extend(syms.iter().filter_map(|s| self.token_id(s)));
            }
        }
        out
    }

    /// The text of token ids (byte-level symbols mapped back to bytes; specials verbatim;
    /// unknown ids skipped). Invalid UTF-8 is replaced.
    #[must_use]
    pub fn decode(&self, ids: &[u32]) -> String {
        let u2b: HashMap<char, u8> = bytes_to_unicode()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.tokens.get(id as usize) else {
                continue;
            };
            if self.token_types[id as usize] == TOKEN_TYPE_CONTROL {
                bytes.extend_from_slice(t.as_bytes());
            } else {
                bytes.extend(t.chars().filter_map(|c| u2b.get(&c).copied()));
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Adds the tokenizer metadata (`tokenizer.*` keys) to a writer.
    ///
    /// # Errors
    /// [`WriteError::DuplicateKey`] if the writer already has one of these keys.
    pub fn add_to(&self, w: &mut GgufWriter) -> Result<(), WriteError> {
        let sp = self.special();
        w.add("tokenizer.ggml.model", "gpt2")?;
        w.add("tokenizer.ggml.pre", "qwen2")?;
        w.add("tokenizer.ggml.tokens", self.tokens.clone())?;
        w.add("tokenizer.ggml.token_type", self.token_types.clone())?;
        w.add("tokenizer.ggml.merges", self.merges.clone())?;
        for (key, id) in [
            ("tokenizer.ggml.eos_token_id", sp.eos),
            ("tokenizer.ggml.padding_token_id", sp.pad),
            ("tokenizer.ggml.bos_token_id", sp.bos),
        ] {
            if let Some(id) = id {
                w.add(key, id)?;
            }
        }
        w.add("tokenizer.ggml.add_bos_token", false)?;
        w.add("tokenizer.chat_template", CHAT_TEMPLATE)?;
        Ok(())
    }

    /// The identity this tokenizer will have once written, for comparing with files.
    #[must_use]
    pub fn identity(&self) -> TokenizerIdentity {
        TokenizerIdentity::new(
            Path::new(&format!("<tiny tokenizer '{}'>", self.variant)),
            "gpt2".to_owned(),
            Some("qwen2".to_owned()),
            self.tokens.clone(),
            self.token_types.clone(),
            self.merges.clone(),
            self.special(),
            Some(false),
        )
    }
}

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the others to U+0100….
#[must_use]
pub fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    table
}

/// The byte order of the first 256 tokens: GPT-2's (printable bytes first), as in Qwen's
/// vocabulary, which starts `!`, `"`, `#`, ….
fn byte_order() -> Vec<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    (0..=255u8)
        .filter(|&b| printable(b))
        .chain((0..=255u8).filter(|&b| !printable(b)))
        .collect()
}

fn to_symbols(word: &str, b2u: &[char; 256]) -> Vec<String> {
    word.bytes().map(|b| b2u[b as usize].to_string()).collect()
}

fn merge_pair(syms: &mut Vec<String>, a: &str, b: &str, merged: &str) {
    let mut i = 0;
    while i + 1 < syms.len() {
        if syms[i] == a && syms[i + 1] == b {
            syms.splice(i..i + 2, [merged.to_owned()]);
        }
        i += 1;
    }
}

/// Splits `text` into `(piece, is_special)` around the three special tokens.
fn split_special(text: &str) -> Vec<(&str, bool)> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let next = [ENDOFTEXT, IM_START, IM_END]
            .iter()
            .filter_map(|s| rest.find(s).map(|i| (i, *s)))
            .min();
        let Some((i, s)) = next else {
            out.push((rest, false));
            break;
        };
        if i > 0 {
            out.push((&rest[..i], false));
        }
        out.push((&rest[i..i + s.len()], true));
        rest = &rest[i + s.len()..];
    }
    out
}

/// Pre-tokenizes like the qwen2 regex
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
/// with `char` classes standing in for the Unicode properties.
#[must_use]
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |i: usize| chars.get(i).map(|&(_, c)| c);
    let byte = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
    let letter = |c: char| c.is_alphabetic();
    let digit = |c: char| c.is_numeric();
    let space = |c: char| c.is_whitespace();
    let newline = |c: char| c == '\r' || c == '\n';
    let other = |c: char| !space(c) && !letter(c) && !digit(c);

    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        let start = i;
        // 1. contractions
        if c == '\'' {
            let rest: String = (1..=2)
                .filter_map(|k| at(i + k))
                .collect::<String>()
                .to_lowercase();
            let len = if rest.starts_with("re") || rest.starts_with("ve") || rest.starts_with("ll")
            {
                Some(3)
            } else if rest.starts_with(['s', 't', 'm', 'd']) {
                Some(2)
            } else {
                None
            };
            if let Some(len) = len {
                i += len;
                out.push(&text[byte(start)..byte(i)]);
                continue;
            }
        }
        // 2. an optional non-letter/non-digit/non-newline, then letters
        let lead = !newline(c) && !letter(c) && !digit(c) && at(i + 1).is_some_and(letter);
        if letter(c) || lead {
            i += 1;
            while at(i).is_some_and(letter) {
                i += 1;
            }
            out.push(&text[byte(start)..byte(i)]);
            continue;
        }
        // 3. one digit
        if digit(c) {
            i += 1;
            out.push(&text[byte(start)..byte(i)]);
            continue;
        }
        // 4. an optional space, punctuation, trailing newlines
        if other(c) || (c == ' ' && at(i + 1).is_some_and(other)) {
            if c == ' ' {
                i += 1;
            }
            while at(i).is_some_and(other) {
                i += 1;
            }
            while at(i).is_some_and(newline) {
                i += 1;
            }
            out.push(&text[byte(start)..byte(i)]);
            continue;
        }
        // 5-7. whitespace
        let mut j = i;
        while at(j).is_some_and(space) {
            j += 1;
        }
        if let Some(last_nl) = (i..j).rev().find(|&k| newline(chars[k].1)) {
            i = last_nl + 1;
        } else if j < n && j - i > 1 {
            i = j - 1;
        } else {
            i = j;
        }
        out.push(&text[byte(start)..byte(i)]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_to_unicode_is_gpt2() {
        let t = bytes_to_unicode();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        let mut all: Vec<char> = t.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn pre_tokenize_matches_qwen2_regex_on_ascii() {
        assert_eq!(pre_tokenize("Hello world"), ["Hello", " world"]);
        assert_eq!(
            pre_tokenize("it's 42!\n\n  x"),
            ["it", "'s", " ", "4", "2", "!\n\n", " ", " x"]
        );
        assert_eq!(
            pre_tokenize("fn main() {\n    x\n}"),
            ["fn", " main", "()", " {\n", "   ", " x", "\n", "}"]
        );
        assert_eq!(pre_tokenize("a  "), ["a", "  "]);
        assert_eq!(pre_tokenize(""), Vec::<&str>::new());
    }

    #[test]
    fn standard_tokenizer_shape() {
        let t = TinyTokenizer::standard();
        assert_eq!(t.n_vocab(), 256 + DEFAULT_MERGED_TOKENS + 3);
        assert!(t.merges().len() >= DEFAULT_MERGED_TOKENS);
        assert_eq!(t.tokens()[0], "!");
        assert_eq!(t.token_id(IM_END), Some(658));
        assert_eq!(t.special().bos, t.token_id(ENDOFTEXT));
        // every merge's parts and result are in the vocabulary
        for m in t.merges() {
            let (a, b) = m.split_once(' ').expect("merge has a space");
            assert!(t.token_id(a).is_some() && t.token_id(b).is_some(), "{m}");
            assert!(t.token_id(&format!("{a}{b}")).is_some(), "{m}");
        }
        let mut uniq = t.tokens().to_vec();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), t.n_vocab());
    }

    #[test]
    fn encode_is_non_trivial_and_round_trips() {
        let t = TinyTokenizer::standard();
        let text = "The robot wrote a new rule in the notebook.";
        let ids = t.encode(text);
        assert!(
            ids.len() < text.len() / 2,
            "{} tokens for {} bytes",
            ids.len(),
            text.len()
        );
        assert_eq!(t.decode(&ids), text);
        let chat = "<|im_start|>user\nhello world<|im_end|>\n";
        let ids = t.encode(chat);
        assert_eq!(ids[0], t.token_id(IM_START).expect("special"));
        assert_eq!(t.decode(&ids), chat);
        let odd = "naïve ünïcode → ok";
        assert_eq!(t.decode(&t.encode(odd)), odd);
    }

    #[test]
    fn training_is_deterministic_and_alt_differs() {
        let again = TinyTokenizer::train("standard", CORPUS, DEFAULT_MERGED_TOKENS);
        assert_eq!(TinyTokenizer::standard(), again);
        let (s, a) = (TinyTokenizer::standard(), TinyTokenizer::alt());
        assert_eq!(s.n_vocab(), a.n_vocab());
        assert_eq!(s.tokens()[..256], a.tokens()[..256]);
        // "ĠĠ" (two spaces) is the first merge of both; the learnt tokens diverge right after
        assert_eq!(s.merges()[0], "Ġ Ġ");
        let first = (256..s.n_vocab()).find(|&i| s.tokens()[i] != a.tokens()[i]);
        assert_eq!(first, Some(257));
    }
}
