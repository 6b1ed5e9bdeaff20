//! A llama.cpp context over one [`Model`], holding one sequence (id 0) whose KV cache Molt
//! exports and imports through the state-seq API.

use super::tap::{self, AttentionCapture, Tap};
use super::{EngineError, Model, Token, recent_llama_errors};
use crate::kv::CacheType;
use std::sync::Arc;

/// llama.cpp's name for a cache element type. The KV mirror's [`CacheType`] is the one list
/// of cache types, since only the types it can read can be transplanted (quantized caches are
/// Hadamard-rotated by llama.cpp and refused by the mirror).
pub(super) fn ggml_type(t: CacheType) -> llama_cpp_sys_2::ggml_type {
    match t {
        CacheType::F16 => llama_cpp_sys_2::GGML_TYPE_F16,
        CacheType::F32 => llama_cpp_sys_2::GGML_TYPE_F32,
        CacheType::BF16 => llama_cpp_sys_2::GGML_TYPE_BF16,
    }
}

/// Knobs every context of one ladder shares. Flash attention is fixed off for all of them: it
/// flips llama.cpp's V layout and changes greedy text, so mixing it across rungs would make
/// the exported caches incompatible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ContextConfig {
    /// Context window in tokens.
    pub n_ctx: u32,
    /// Maximum tokens per `llama_decode` call (prompt chunks).
    pub n_batch: u32,
    /// Tokens per micro-batch, the unit llama.cpp computes a prompt chunk in (at most
    /// `n_batch`). The compute buffer is reserved for a micro-batch whose every token asks for
    /// logits (n_ubatch × n_vocab floats: 74 MiB at 128 on the Qwen ladder, 297 MiB at 512), so
    /// a larger one buys prefill speed with memory; `bench --speed --tune` measures the trade.
    #[serde(default = "default_n_ubatch")]
    pub n_ubatch: u32,
    /// CPU threads for decoding and prefill.
    pub n_threads: u32,
    /// KV cache element type.
    pub cache_type: CacheType,
    /// Install an attention tap (see [`Context::arm_attention_tap`]); off by default, used by
    /// the benchmark's attention-flatness metric.
    #[serde(default)]
    pub attention_tap: bool,
    /// Install the hidden-state tap (see [`Context::set_hidden_layers`]); off by default, used
    /// by selective top-k recompute. Either tap installs llama.cpp's eval callback, which
    /// costs a name comparison per graph node while nothing is asked for.
    #[serde(default)]
    pub hidden_tap: bool,
}

/// Molt's micro-batch when nothing else is asked: the memory a budget can least spare goes to
/// the KV cache, not to a compute buffer sized for 512-token micro-batches.
pub const DEFAULT_N_UBATCH: u32 = 128;

fn default_n_ubatch() -> u32 {
    DEFAULT_N_UBATCH
}

impl Default for ContextConfig {
    fn default() -> Self {
        let threads =
            std::thread::available_parallelism().map_or(2, |n| u32::try_from(n.get()).unwrap_or(2));
        Self {
            n_ctx: 2048,
            n_batch: 512,
            n_ubatch: DEFAULT_N_UBATCH,
            n_threads: threads,
            cache_type: CacheType::F16,
            attention_tap: false,
            hidden_tap: false,
        }
    }
}

/// A llama.cpp context. The sequence Molt works with is always sequence 0.
pub struct Context {
    ptr: std::ptr::NonNull<llama_cpp_sys_2::llama_context>,
    model: Arc<Model>,
    config: ContextConfig,
    n_vocab: usize,
    /// Number of positions decoded into sequence 0 (the next token goes at this position).
    n_past: usize,
    /// Bytes llama.cpp reported reserving for this context (KV, compute and output buffers).
    reserved_bytes: u64,
    /// The attention tap llama.cpp calls back into, when installed. Declared after `ptr`; the
    /// llama context (the only holder of its address) is freed in `Drop` before it.
    tap: Option<Tap>,
    /// Position of the first row the hidden-state tap holds: rows cover
    /// `hidden_start .. hidden_start + rows`. Anything that changes the cache other than a
    /// decode (import, shed) restarts the rows at `n_past`, so a row is always the state a
    /// decode of this context computed at that position.
    hidden_start: usize,
    /// Cells a recompute read into a hole were moved to their positions after their batch
    /// ([`Context::recompute_spans`]) and llama.cpp re-rotates their keys at the next
    /// `llama_decode`: until then an exported state would carry keys rotated for the wrong
    /// positions, so an export decodes something first ([`Context::export_state`]).
    shift_pending: std::cell::Cell<bool>,
    /// Sequence 0's last logits, kept when [`Context::apply_moves`] decoded in a scratch
    /// sequence (which leaves llama.cpp's output rows empty); dropped at the next decode.
    kept_logits: std::cell::OnceCell<Vec<f32>>,
}

// SAFETY: a llama_context is used from one thread at a time (all mutation takes &mut self);
// moving it between threads is fine.
unsafe impl Send for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("model", &self.model.name())
            .field("n_past", &self.n_past)
            .finish()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: ptr came from llama_init_from_model and is freed once, before our Arc<Model>
        // (a field) is dropped.
        unsafe { llama_cpp_sys_2::llama_free(self.ptr.as_ptr()) }
    }
}

const SEQ: i32 = 0;
/// Scratch sequences one recompute batch may use (each holds one span).
const SCRATCH_SEQS: u32 = 7;

/// A run of consecutive cached positions to recompute natively: the tokens of positions
/// `start .. start + tokens.len()`.
#[derive(Debug, Clone, Copy)]
pub struct Span<'a> {
    /// First position.
    pub start: usize,
    /// The tokens at those positions (the history's own).
    pub tokens: &'a [Token],
}

impl<'a> Span<'a> {
    /// The spans of `history` at `ranges` (positions as indices into it).
    ///
    /// # Panics
    /// When a range reaches past `history`.
    #[must_use]
    pub fn of(history: &'a [Token], ranges: &[std::ops::Range<usize>]) -> Vec<Self> {
        ranges
            .iter()
            .map(|r| Self {
                start: r.start,
                tokens: &history[r.clone()],
            })
            .collect()
    }
}

/// The llama.cpp parameters of every context of a ladder — [`Context`] and
/// [`super::BatchContext`] alike — with `n_seq_max` sequences in one unified cache: the same
/// window, micro-batch, threads, cache type and layout (flash attention off), so a sequence's
/// exported state is interchangeable between them.
///
/// # Errors
/// [`EngineError::OutOfRange`] for more threads than an `i32`.
pub(super) fn ladder_params(
    config: &ContextConfig,
    n_seq_max: u32,
) -> Result<llama_cpp_sys_2::llama_context_params, EngineError> {
    let threads = i32::try_from(config.n_threads).map_err(|_| EngineError::OutOfRange {
        what: "n_threads",
        value: u64::from(config.n_threads),
    })?;
    // SAFETY: plain-data default parameters.
    let mut p = unsafe { llama_cpp_sys_2::llama_context_default_params() };
    p.n_ctx = config.n_ctx;
    p.n_batch = config.n_batch.min(config.n_ctx);
    // The compute buffer is reserved for the worst case of a micro-batch whose every token
    // asks for logits (see `ContextConfig::n_ubatch`); prompts still go in n_batch chunks,
    // which llama.cpp splits into micro-batches.
    p.n_ubatch = config.n_ubatch.clamp(1, p.n_batch.max(1));
    p.n_seq_max = n_seq_max;
    p.kv_unified = true;
    p.n_threads = threads;
    p.n_threads_batch = threads;
    p.flash_attn_type = llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED;
    p.type_k = ggml_type(config.cache_type);
    p.type_v = ggml_type(config.cache_type);
    p.no_perf = true;
    Ok(p)
}

/// Creates the llama.cpp context of `p` over `model`; returns it with the bytes llama.cpp
/// reported reserving for its KV, compute and output buffers (0 if its log did not say).
///
/// # Errors
/// [`EngineError::ContextFailed`] with llama.cpp's own words.
pub(super) fn init_context(
    model: &Model,
    p: llama_cpp_sys_2::llama_context_params,
    n_ctx: u32,
) -> Result<(std::ptr::NonNull<llama_cpp_sys_2::llama_context>, u64), EngineError> {
    let _ = recent_llama_errors();
    let _ = super::logs::take_buffer_sizes();
    // SAFETY: the model pointer is alive (the caller holds it); params by value.
    let raw = unsafe { llama_cpp_sys_2::llama_init_from_model(model.as_ptr(), p) };
    let ptr = std::ptr::NonNull::new(raw).ok_or_else(|| EngineError::ContextFailed {
        model: model.name().to_string(),
        n_ctx,
        detail: recent_llama_errors(),
    })?;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let reserved_bytes = super::logs::take_buffer_sizes()
        .iter()
        .filter(|(what, _)| !what.contains("model") && !what.contains("Mapped"))
        .map(|(_, mib)| (mib * 1_048_576.0) as u64)
        .sum();
    Ok((ptr, reserved_bytes))
}

impl Context {
    /// Creates a context over `model`.
    ///
    /// # Errors
    /// [`EngineError::ContextFailed`] if llama.cpp cannot allocate it; [`EngineError::OutOfRange`]
    /// for absurd sizes.
    pub fn new(model: Arc<Model>, config: ContextConfig) -> Result<Self, EngineError> {
        // Sequence 0 is the conversation; the others are scratch sequences of selective token
        // recompute (see [`Context::recompute_spans`]). One unified cache holds them all, so a
        // scratch sequence shares sequence 0's cells (a copy is a tag, not a copy of data) and
        // sequence 0 keeps the whole window.
        let mut p = ladder_params(&config, SCRATCH_SEQS + 1)?;
        let tap = (config.attention_tap || config.hidden_tap).then(tap::new_tap);
        if let Some(t) = &tap {
            // The callback only ever takes a shared reference to the RefCell (interior
            // mutability), so handing out a pointer derived from `&` is sound; the box keeps
            // the address fixed for the context's lifetime.
            p.cb_eval = Some(tap::callback);
            p.cb_eval_user_data = std::ptr::from_ref(&**t).cast_mut().cast();
        }
        let (ptr, reserved_bytes) = init_context(&model, p, config.n_ctx)?;
        let n_vocab = model.n_vocab();
        Ok(Self {
            ptr,
            model,
            config,
            n_vocab,
            n_past: 0,
            shift_pending: std::cell::Cell::new(false),
            kept_logits: std::cell::OnceCell::new(),
            reserved_bytes,
            tap,
            hidden_start: 0,
        })
    }

    /// Sets the layers whose output (`l_out-<layer>`, the hidden state entering the next
    /// block) every later decode keeps in host memory, one row per decoded position; an empty
    /// slice turns the tap off. Rows kept so far are dropped. Returns `false` when the context
    /// was created without `hidden_tap`.
    pub fn set_hidden_layers(&mut self, layers: &[usize]) -> bool {
        let Some(t) = &self.tap else {
            return false;
        };
        tap::set_hidden_layers(t, layers);
        self.hidden_start = self.n_past;
        true
    }

    /// The layers the hidden-state tap keeps.
    pub fn hidden_layers(&self) -> Vec<usize> {
        self.tap
            .as_ref()
            .map(tap::hidden_layers)
            .unwrap_or_default()
    }

    /// The kept output of `layer` for every position of the sequence, `[n_past][n_embd]` in
    /// position order — or `None` unless the tap has seen every position `0 .. n_past` decoded
    /// by this context (it was set after the first decode, or the cache was imported or shed).
    pub fn hidden_states(&self, layer: usize) -> Option<ndarray::Array2<f32>> {
        let t = self.tap.as_ref()?;
        if self.hidden_start != 0 || tap::hidden_len(t) != self.n_past || self.n_past == 0 {
            return None;
        }
        let (rows, width) = tap::hidden_rows(t, layer)?;
        ndarray::Array2::from_shape_vec((self.n_past, width), rows).ok()
    }

    /// Restarts the hidden-state rows at position `at` (nothing kept before it).
    fn restart_hidden(&mut self, at: usize) {
        if let Some(t) = &self.tap {
            let layers = tap::hidden_layers(t);
            tap::set_hidden_layers(t, &layers);
        }
        self.hidden_start = at;
    }

    /// Arms the attention tap: the next [`Context::decode`] records, per layer and head, the
    /// entropy of the last token's attention weights (read with [`Context::take_attention`]).
    /// Returns `false` when the context was created without `attention_tap`.
    pub fn arm_attention_tap(&mut self) -> bool {
        self.tap.as_ref().map(tap::arm).is_some()
    }

    /// What the armed tap recorded in the decode that followed arming, once.
    pub fn take_attention(&mut self) -> Option<AttentionCapture> {
        self.tap.as_ref().and_then(tap::take)
    }

    /// The model this context runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The configuration it was made with.
    pub fn config(&self) -> ContextConfig {
        self.config
    }

    /// Positions decoded so far in the sequence (where the next token goes).
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Bytes llama.cpp reported reserving for this context's KV, compute and output buffers
    /// (0 if its log did not say). Pages of these buffers count in RSS only once touched, so
    /// this is the ceiling a context can grow to, which is what a budget must hold.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// The context window.
    pub fn n_ctx(&self) -> u32 {
        self.config.n_ctx
    }

    /// Forgets the whole sequence.
    pub fn clear(&mut self) {
        // SAFETY: live context; clearing memory with data=true zeroes the buffers.
        unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_clear(mem, true);
        }
        self.cache_rewritten();
        self.n_past = 0;
        self.restart_hidden(0);
    }

    /// Removes positions `[from, n_past)` from the sequence (rewinds to `from`).
    pub fn truncate(&mut self, from: usize) {
        if from >= self.n_past {
            return;
        }
        let p0 = i32::try_from(from).unwrap_or(i32::MAX);
        // SAFETY: live context; removing a position range of sequence 0 is always valid.
        unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_seq_rm(mem, SEQ, p0, -1);
        }
        self.n_past = from;
        match (&self.tap, from.checked_sub(self.hidden_start)) {
            (Some(t), Some(keep)) => tap::truncate_hidden(t, keep),
            _ => self.restart_hidden(from),
        }
    }

    /// Forgets the cells of `ranges` (positions inside `[0, n_past)`), leaving every other cell
    /// and every position where it is: the sequence has holes there until something decodes
    /// those positions again (a recompute or a refill re-reads them in place). Later tokens
    /// attend only to the cells left.
    pub fn forget(&mut self, ranges: &[std::ops::Range<usize>]) {
        // SAFETY: live context; removing position ranges of sequence 0 is always valid.
        let mem = unsafe { llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr()) };
        for r in ranges {
            let end = r.end.min(self.n_past);
            if r.start >= end {
                continue;
            }
            let p0 = i32::try_from(r.start).unwrap_or(i32::MAX);
            let p1 = i32::try_from(end).unwrap_or(i32::MAX);
            // SAFETY: as above.
            unsafe { llama_cpp_sys_2::llama_memory_seq_rm(mem, SEQ, p0, p1) };
        }
        // The tap's hidden rows no longer describe the cache.
        self.restart_hidden(self.n_past);
    }

    /// Reads `spans` natively in sequence 0 after its last cell, as one text (each token
    /// attending to the cells before it and to the spans' earlier tokens), moves each span to
    /// its own positions, then decodes `then` after the last span: a prefill of only these
    /// parts of a history, read as if the parts between them were not there, and kept where
    /// the history has them. The sequence then ends after `then`, with holes where nothing was
    /// read; the logits are the last token's. The spans must be in order, after the sequence's
    /// last cell, and the last one must hold two tokens or follow the one before it (or the
    /// sequence's last cell) directly: its last token is held back and decoded with `then`
    /// once the spans are in place, which makes llama.cpp re-rotate the moved keys before
    /// anything reads or exports them (a move alone leaves that to the next decode, and a
    /// state exported before it would carry keys rotated for the wrong positions). Returns
    /// the span positions read.
    ///
    /// # Errors
    /// [`EngineError::ContextOverflow`] when the spans are out of order or reach past the
    /// context; [`EngineError::OutOfRange`] when there are none or the last cannot be decoded
    /// after the others; [`EngineError::Shed`] when this cache cannot move positions; a decode
    /// error otherwise.
    pub fn decode_sparse(
        &mut self,
        spans: &[Span<'_>],
        then: &[Token],
    ) -> Result<usize, EngineError> {
        let n_ctx = self.config.n_ctx as usize;
        let spans: Vec<&Span<'_>> = spans.iter().filter(|s| !s.tokens.is_empty()).collect();
        let Some(last) = spans.last() else {
            return Err(EngineError::OutOfRange {
                what: "spans of a sparse read",
                value: 0,
            });
        };
        let mut at = self.n_past;
        let mut ok = true;
        for s in &spans {
            ok &= s.start >= at;
            at = s.start + s.tokens.len();
        }
        let end = at;
        if !ok || end + then.len() > n_ctx {
            return Err(EngineError::ContextOverflow {
                needed: end.max(self.n_past) + then.len(),
                n_ctx: self.config.n_ctx,
            });
        }
        // The held-back token goes right after the last cell the spans leave.
        let before_last = match spans.len() {
            1 => self.n_past,
            n => spans[n - 2].start + spans[n - 2].tokens.len(),
        };
        if last.tokens.len() < 2 && last.start != before_last {
            return Err(EngineError::OutOfRange {
                what: "a sparse read's last span apart from the others with one token",
                value: last.start as u64,
            });
        }
        // SAFETY: live context; read-only query.
        let can = unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_can_shift(mem)
        };
        if !can {
            return Err(EngineError::Shed {
                pinned: self.n_past,
                n: 0,
                n_past: self.n_past,
                detail: "this cache cannot move positions".into(),
            });
        }
        let start = self.n_past;
        let mut all: Vec<Token> = spans
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let read = all.len();
        let held = all.pop().expect("the last span holds a token");
        if !all.is_empty() {
            self.decode_cache_only(&all)?;
        }
        let conv = |v: usize| {
            i32::try_from(v).map_err(|_| EngineError::OutOfRange {
                what: "position",
                value: v as u64,
            })
        };
        // Where each span was read, then moved last first (each moves up, never past the next).
        let mut read_at = start;
        let mut moves = Vec::with_capacity(spans.len());
        for (i, s) in spans.iter().enumerate() {
            let n = s.tokens.len() - usize::from(i + 1 == spans.len());
            moves.push((read_at, read_at + n, s.start - read_at));
            read_at += n;
        }
        // SAFETY: live context; moving position ranges of sequence 0 on a cache that can shift.
        let mem = unsafe { llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr()) };
        for &(p0, p1, delta) in moves.iter().rev() {
            if delta > 0 && p1 > p0 {
                let (p0, p1, d) = (conv(p0)?, conv(p1)?, conv(delta)?);
                // SAFETY: as above.
                unsafe { llama_cpp_sys_2::llama_memory_seq_add(mem, SEQ, p0, p1, d) };
            }
        }
        self.n_past = end - 1;
        self.restart_hidden(end - 1);
        let mut next = Vec::with_capacity(then.len() + 1);
        next.push(held);
        next.extend_from_slice(then);
        self.decode(&next)?;
        Ok(read)
    }

    /// Sheds context: drops the `n` positions after the first `pinned` (the oldest tokens that
    /// are not the pinned system prompt), shifts every later position down by `n` (llama.cpp
    /// re-rotates their cached keys), then decodes `next` at the new end of the sequence.
    ///
    /// llama.cpp applies a position shift lazily, at the next decode; until then the cached
    /// keys are still rotated at the old positions and an exported state would be
    /// inconsistent. Decoding `next` in the same call applies the shift at once, so no caller
    /// can observe that window. `next` must be non-empty (in the token loop it is the token
    /// sampled last and not decoded yet).
    ///
    /// # Errors
    /// [`EngineError::Shed`] if `next` is empty, `pinned + n` exceeds the sequence, or the
    /// cache cannot shift positions (nothing is changed then); a decode error otherwise (the
    /// shed has happened, the sequence ends at `n_past − n`).
    pub fn shed_and_decode(
        &mut self,
        pinned: usize,
        n: usize,
        next: &[Token],
    ) -> Result<(), EngineError> {
        let n_past = self.n_past;
        let refuse = |detail: String| EngineError::Shed {
            pinned,
            n,
            n_past,
            detail,
        };
        if next.is_empty() {
            return Err(refuse("no token to decode after the shift".into()));
        }
        let end = pinned.checked_add(n).filter(|&e| e <= n_past);
        let Some(end) = end else {
            return Err(refuse(
                "the range reaches past the end of the sequence".into(),
            ));
        };
        let conv = |v: usize| {
            i32::try_from(v).map_err(|_| EngineError::OutOfRange {
                what: "position",
                value: v as u64,
            })
        };
        let (p0, p1, delta) = (conv(pinned)?, conv(end)?, conv(n)?);
        if n > 0 {
            // SAFETY: live context; read-only query.
            let can = unsafe {
                let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
                llama_cpp_sys_2::llama_memory_can_shift(mem)
            };
            if !can {
                return Err(refuse("this cache cannot shift positions".into()));
            }
            // SAFETY: live context; removing a position range of sequence 0 and shifting the
            // later positions of sequence 0 by a negative delta are valid on a cache that can
            // shift (checked above).
            let removed = unsafe {
                let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
                let ok = llama_cpp_sys_2::llama_memory_seq_rm(mem, SEQ, p0, p1);
                if ok {
                    llama_cpp_sys_2::llama_memory_seq_add(mem, SEQ, p1, -1, -delta);
                }
                ok
            };
            if !removed {
                return Err(refuse("llama.cpp refused to remove the range".into()));
            }
            self.n_past -= n;
            // Shifted keys, unshifted hidden rows: the rows no longer describe this cache.
            self.restart_hidden(self.n_past);
        }
        self.decode(next)
    }

    /// Sets the threads this context's decodes use from now on (at least one): a context
    /// decoding beside another on the same cores is given its share of them, so that neither
    /// waits on threads the other preempted.
    pub fn set_threads(&mut self, n: u32) {
        let n = i32::try_from(n.max(1)).unwrap_or(i32::MAX);
        // SAFETY: live context; llama.cpp applies the counts to its next decode.
        unsafe { llama_cpp_sys_2::llama_set_n_threads(self.ptr.as_ptr(), n, n) };
    }

    /// Decodes `tokens` at positions `n_past..`, in chunks of `n_batch`, and keeps the logits
    /// of the last token. An empty slice is a no-op.
    ///
    /// # Errors
    /// [`EngineError::ContextOverflow`] when the tokens do not fit, [`EngineError::DecodeFailed`]
    /// when llama.cpp fails.
    pub fn decode(&mut self, tokens: &[Token]) -> Result<(), EngineError> {
        self.decode_inner(tokens, Outputs::Last).map(|_| ())
    }

    /// Decodes `tokens` into the cache only: no logits are computed (llama.cpp skips the
    /// output projection), so [`Context::logits`] is meaningless until the next decode. For
    /// positions whose K/V are wanted and whose next-token distribution is not (the head
    /// re-read of a switch).
    ///
    /// # Errors
    /// As [`Context::decode`].
    pub fn decode_cache_only(&mut self, tokens: &[Token]) -> Result<(), EngineError> {
        self.decode_inner(tokens, Outputs::None).map(|_| ())
    }

    /// Like [`Context::decode`] but keeps the logits of every token, returned row by row
    /// (used to score text and to measure distributions along a sequence).
    ///
    /// # Errors
    /// As [`Context::decode`].
    pub fn decode_all_logits(&mut self, tokens: &[Token]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.decode_inner(tokens, Outputs::All)
    }

    /// Decodes `tokens` like [`Context::decode`], and returns, for every position of the
    /// sequence after it, the attention mass the last `window` tokens give it: their
    /// post-softmax weights summed over query rows, heads and layers (the observation window of
    /// SnapKV). `None` when the context has no tap. The earlier tokens are decoded first without
    /// logits, the window in a decode of its own.
    ///
    /// Positions are read as cell indices, which they are for a sequence written in order into
    /// an empty or truncated cache (the only way Molt fills one before a prompt).
    ///
    /// # Errors
    /// As [`Context::decode`].
    pub fn decode_observed(
        &mut self,
        tokens: &[Token],
        window: usize,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        if self.tap.is_none() || tokens.is_empty() {
            self.decode(tokens)?;
            return Ok(None);
        }
        let w = window.clamp(1, tokens.len());
        let (early, late) = tokens.split_at(tokens.len() - w);
        if !early.is_empty() {
            self.decode_inner(early, Outputs::None)?;
        }
        if let Some(t) = &self.tap {
            tap::arm_mass(t);
        }
        let r = self.decode_inner(late, Outputs::Last);
        let mass = self.tap.as_ref().and_then(tap::take_mass);
        r?;
        #[allow(clippy::cast_possible_truncation)]
        Ok(mass.map(|m| {
            let mut v: Vec<f32> = m.iter().map(|&x| x as f32).collect();
            v.resize(self.n_past, 0.0);
            v
        }))
    }

    /// Recomputes cached positions natively: each span's tokens are decoded again at their own
    /// positions, attending to the cache before them (whatever it holds: imported, projected
    /// cells) and to each other, and their new K/V replace the old cells of sequence 0. Nothing
    /// else changes; `n_past` stays. Up to seven spans go in one `llama_decode`: each is decoded
    /// in a scratch sequence that shares sequence 0's cells before the span (llama.cpp wants a
    /// sequence's batch to continue right after its last cached position), and the new cells
    /// are then handed to sequence 0 in place of the old ones. Spans are taken in position
    /// order, so a later span sees the native cells of the earlier ones once their batch has
    /// run. No logits are computed: decode the next token after it. A span with no cell right
    /// before it (in a hole a sparse read left) is read right after the last cell before it and
    /// moved to its own positions once its batch has run, as [`Context::decode_sparse`] moves
    /// its spans: it attends to the cells before it as if the hole were not there, and its keys
    /// are re-rotated at the next decode (an export before that has it done first).
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] for spans that overlap, are out of order or reach past the
    /// cache; [`EngineError::ContextOverflow`] when the window has no room for a span's cells
    /// beside the cache; [`EngineError::DecodeFailed`] when llama.cpp fails (sequence 0 is then
    /// as it was before that batch).
    pub fn recompute_spans(&mut self, spans: &[Span<'_>]) -> Result<usize, EngineError> {
        let mut end = 0;
        for s in spans {
            if s.start < end || s.start + s.tokens.len() > self.n_past {
                return Err(EngineError::OutOfRange {
                    what: "recompute span start (spans must be ordered, apart, inside the cache)",
                    value: s.start as u64,
                });
            }
            end = s.start + s.tokens.len();
        }
        let chunk = self.config.n_batch.min(self.config.n_ctx).max(1) as usize;
        let room = (self.config.n_ctx as usize).saturating_sub(self.n_past);
        let cap = chunk.min(room);
        if cap == 0 && spans.iter().any(|s| !s.tokens.is_empty()) {
            return Err(EngineError::ContextOverflow {
                needed: self.n_past + 1,
                n_ctx: self.config.n_ctx,
            });
        }
        // Pieces of at most `cap` tokens, grouped into batches of at most SCRATCH_SEQS pieces
        // and `cap` tokens.
        let mut pieces: Vec<(usize, &[Token])> = Vec::new();
        for s in spans {
            for (i, part) in s.tokens.chunks(cap.max(1)).enumerate() {
                pieces.push((s.start + i * cap.max(1), part));
            }
        }
        let mut done = 0;
        let mut group: Vec<(usize, &[Token])> = Vec::new();
        let mut group_tokens = 0;
        for piece in pieces {
            if group.len() == SCRATCH_SEQS as usize || group_tokens + piece.1.len() > cap {
                done += self.recompute_group(&group, &[])?;
                group.clear();
                group_tokens = 0;
            }
            // A later piece of the same span must see the earlier piece's new cells: the
            // earlier piece's batch has to run first.
            if group.last().is_some_and(|(s, t)| s + t.len() == piece.0) {
                done += self.recompute_group(&group, &[])?;
                group.clear();
                group_tokens = 0;
            }
            group_tokens += piece.1.len();
            group.push(piece);
        }
        done += self.recompute_group(&group, &[])?;
        if let Some(t) = &self.tap {
            tap::finish(t);
        }
        // The tap's hidden rows no longer describe the cache at the recomputed positions.
        self.restart_hidden(self.n_past);
        Ok(done)
    }

    /// [`Context::recompute_spans`] and [`Context::decode`] of `tokens` in one `llama_decode`
    /// when they fit in one batch (the spans' tokens and `tokens` together within `n_batch`,
    /// at most seven spans, none reaching into another): what a switch's head re-read and its
    /// first decode cost on CPU is mostly reading the weights once, so one pass does both. The
    /// spans' new cells replace the old ones as with [`Context::recompute_spans`]; `tokens`
    /// are decoded at `n_past..` and the last one's logits kept — they attend to the cells the
    /// spans replace *as they were* (this batch computes both), every later token to the new
    /// ones. When they do not fit, the spans are recomputed first and `tokens` decoded after
    /// (then `tokens` see the new cells). Returns the positions recomputed.
    ///
    /// # Errors
    /// As [`Context::recompute_spans`] and [`Context::decode`]; on a failed batch sequence 0
    /// is as it was before it.
    pub fn recompute_spans_then_decode(
        &mut self,
        spans: &[Span<'_>],
        tokens: &[Token],
    ) -> Result<usize, EngineError> {
        let span_tokens: usize = spans.iter().map(|s| s.tokens.len()).sum();
        let cap = self.config.n_batch.min(self.config.n_ctx).max(1) as usize;
        let room = (self.config.n_ctx as usize).saturating_sub(self.n_past);
        let ordered = spans
            .windows(2)
            .all(|w| w[0].start + w[0].tokens.len() < w[1].start);
        let inside = spans
            .iter()
            .all(|s| s.start + s.tokens.len() <= self.n_past);
        let fits = !tokens.is_empty()
            && span_tokens + tokens.len() <= cap
            && span_tokens + tokens.len() <= room
            && spans.len() <= SCRATCH_SEQS as usize
            && ordered
            && inside;
        if !fits {
            let done = self.recompute_spans(spans)?;
            self.decode(tokens)?;
            return Ok(done);
        }
        let group: Vec<(usize, &[Token])> = spans.iter().map(|s| (s.start, s.tokens)).collect();
        let result = self.recompute_group(&group, tokens);
        if let Some(t) = &self.tap {
            tap::finish(t);
        }
        self.restart_hidden(self.n_past);
        result
    }

    /// One batch of [`Context::recompute_spans`]: piece `i` in scratch sequence `i + 1`, then
    /// `then` decoded in sequence 0 at `n_past..` with the last one's logits (the caller has
    /// checked they fit).
    fn recompute_group(
        &mut self,
        group: &[(usize, &[Token])],
        then: &[Token],
    ) -> Result<usize, EngineError> {
        let n_spans: usize = group.iter().map(|(_, t)| t.len()).sum();
        let n = n_spans + then.len();
        if n == 0 {
            return Ok(0);
        }
        let conv = |v: usize| {
            i32::try_from(v).map_err(|_| EngineError::OutOfRange {
                what: "position",
                value: v as u64,
            })
        };
        let n_i32 = conv(n)?;
        // SAFETY: live context; memory handle for the sequence operations below.
        let mem = unsafe { llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr()) };
        // Where each piece is read: at its own positions when a cell precedes it, else right
        // after the last cell before it (llama.cpp wants a sequence to go on from its last
        // position; a piece in a hole a sparse read left has none before it) and moved to its
        // own positions after the batch, as a sparse read moves its spans.
        let mut read_at = Vec::with_capacity(group.len());
        for (i, &(start, _)) in group.iter().enumerate() {
            let sid = conv(i + 1)?;
            // SAFETY: live context; a scratch sequence id below n_seq_max shares sequence 0's
            // cells of positions [0, start) (unified cache: a tag on the cells); the position
            // query reads them.
            let last = unsafe {
                llama_cpp_sys_2::llama_memory_seq_rm(mem, sid, -1, -1);
                llama_cpp_sys_2::llama_memory_seq_cp(mem, SEQ, sid, 0, conv(start)?);
                llama_cpp_sys_2::llama_memory_seq_pos_max(mem, sid)
            };
            read_at.push(usize::try_from(last + 1).map_or(start, |at| at.min(start)));
        }
        if read_at
            .iter()
            .zip(group)
            .any(|(&at, &(start, _))| at != start)
        {
            // SAFETY: live context; read-only query.
            let can = unsafe { llama_cpp_sys_2::llama_memory_can_shift(mem) };
            if !can {
                return Err(EngineError::Shed {
                    pinned: self.n_past,
                    n: 0,
                    n_past: self.n_past,
                    detail: "this cache cannot move positions (a recompute into a hole)".into(),
                });
            }
        }
        // SAFETY: allocates a batch for n tokens, one sequence id each; freed below.
        let batch = unsafe { llama_cpp_sys_2::llama_batch_init(n_i32, 0, 1) };
        let mut k = 0usize;
        for (i, &(_, tokens)) in group.iter().enumerate() {
            for (j, &t) in tokens.iter().enumerate() {
                // SAFETY: k < n entries; seq_id[k] points to an array of 1 seq id.
                unsafe {
                    *batch.token.add(k) = t;
                    *batch.pos.add(k) = conv(read_at[i] + j)?;
                    *batch.n_seq_id.add(k) = 1;
                    *(*batch.seq_id.add(k)) = conv(i + 1)?;
                    *batch.logits.add(k) = 0;
                }
                k += 1;
            }
        }
        for (j, &t) in then.iter().enumerate() {
            // SAFETY: k < n entries, as above.
            unsafe {
                *batch.token.add(k) = t;
                *batch.pos.add(k) = conv(self.n_past + j)?;
                *batch.n_seq_id.add(k) = 1;
                *(*batch.seq_id.add(k)) = SEQ;
                *batch.logits.add(k) = i8::from(j + 1 == then.len());
            }
            k += 1;
        }
        let mut b = batch;
        b.n_tokens = n_i32;
        let _ = recent_llama_errors();
        // SAFETY: live context; batch filled above.
        let rc = unsafe { llama_cpp_sys_2::llama_decode(self.ptr.as_ptr(), b) };
        // SAFETY: batch from llama_batch_init, freed once.
        unsafe { llama_cpp_sys_2::llama_batch_free(batch) };
        if rc != 0 {
            for i in 0..group.len() {
                // SAFETY: live context; dropping a scratch sequence leaves sequence 0 alone.
                unsafe { llama_cpp_sys_2::llama_memory_seq_rm(mem, conv(i + 1)?, -1, -1) };
            }
            return Err(EngineError::DecodeFailed {
                code: rc,
                pos: conv(group.first().map_or(self.n_past, |g| g.0))?,
                detail: recent_llama_errors(),
            });
        }
        self.cache_rewritten();
        for (i, &(start, tokens)) in group.iter().enumerate() {
            let (sid, p0, p1) = (conv(i + 1)?, conv(start)?, conv(start + tokens.len())?);
            if read_at[i] != start {
                let (a0, a1) = (conv(read_at[i])?, conv(read_at[i] + tokens.len())?);
                // SAFETY: live context on a cache that can shift (checked above); the scratch
                // sequence's cells of [a0, a1) are the ones this batch wrote (the cells it
                // shares with sequence 0 all lie before a0), moved to [p0, p1). Their keys are
                // re-rotated at the next decode.
                unsafe { llama_cpp_sys_2::llama_memory_seq_add(mem, sid, a0, a1, p0 - a0) };
                self.shift_pending.set(true);
            }
            // SAFETY: live context; sequence 0 lets go of its old cells of [p0, p1) (freed, no
            // other sequence holds them), takes the scratch sequence's new cells of the same
            // positions, and the scratch sequence is dropped.
            unsafe {
                llama_cpp_sys_2::llama_memory_seq_rm(mem, SEQ, p0, p1);
                llama_cpp_sys_2::llama_memory_seq_cp(mem, sid, SEQ, p0, p1);
                llama_cpp_sys_2::llama_memory_seq_rm(mem, sid, -1, -1);
            }
        }
        self.n_past += then.len();
        Ok(n_spans)
    }

    fn decode_inner(
        &mut self,
        tokens: &[Token],
        outputs: Outputs,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let result = self.decode_chunks(tokens, outputs);
        if let Some(t) = &self.tap {
            tap::finish(t);
        }
        if result.is_err() {
            // A failed chunk may have left rows for positions the sequence does not hold.
            self.restart_hidden(self.n_past);
        }
        result
    }

    /// Decodes hidden states instead of tokens: row `i` of `embd` (`n_embd` floats) enters the
    /// first block at position `positions[i]`, unscaled (llama.cpp's `inp_embd` path). The
    /// positions must continue the sequence (`positions[0] == n_past`, then consecutive), as
    /// for tokens. This is how the last-k-blocks model of top-k recompute is run.
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] for a width other than the model's `n_embd`, a row count
    /// other than `positions.len()` or positions that do not continue the sequence;
    /// [`EngineError::ContextOverflow`] / [`EngineError::DecodeFailed`] as for tokens.
    pub fn decode_embeddings(
        &mut self,
        embd: ndarray::ArrayView2<'_, f32>,
        positions: &[i32],
    ) -> Result<(), EngineError> {
        let n_embd = self.model.n_embd();
        if embd.ncols() != n_embd {
            return Err(EngineError::OutOfRange {
                what: "embedding width",
                value: embd.ncols() as u64,
            });
        }
        if embd.nrows() != positions.len() {
            return Err(EngineError::OutOfRange {
                what: "embedding rows (one per position)",
                value: embd.nrows() as u64,
            });
        }
        let consecutive = positions
            .iter()
            .enumerate()
            .all(|(i, &p)| usize::try_from(p).ok() == Some(self.n_past + i));
        if !consecutive {
            return Err(EngineError::OutOfRange {
                what: "first embedding position (must continue the sequence)",
                value: positions
                    .first()
                    .map_or(0, |&p| u64::try_from(p).unwrap_or(0)),
            });
        }
        let needed = self.n_past + positions.len();
        if needed > self.config.n_ctx as usize {
            return Err(EngineError::ContextOverflow {
                needed,
                n_ctx: self.config.n_ctx,
            });
        }
        let embd = embd.as_standard_layout();
        let chunk = self.config.n_batch.min(self.config.n_ctx).max(1) as usize;
        let width = i32::try_from(n_embd).map_err(|_| EngineError::OutOfRange {
            what: "n_embd",
            value: n_embd as u64,
        })?;
        for (c, part) in positions.chunks(chunk).enumerate() {
            let n = i32::try_from(part.len()).map_err(|_| EngineError::OutOfRange {
                what: "batch",
                value: part.len() as u64,
            })?;
            let rows = &embd.as_slice().unwrap_or(&[])[c * chunk * n_embd..][..part.len() * n_embd];
            // SAFETY: allocates a batch with an embd array of n × n_embd floats, one sequence
            // id per entry; freed below.
            let batch = unsafe { llama_cpp_sys_2::llama_batch_init(n, width, 1) };
            // SAFETY: batch.embd has room for n × n_embd floats and rows is exactly that long;
            // the other arrays have n entries (i < n) and seq_id[i] points to one seq id.
            unsafe {
                std::ptr::copy_nonoverlapping(rows.as_ptr(), batch.embd, rows.len());
                for (i, &p) in part.iter().enumerate() {
                    *batch.pos.add(i) = p;
                    *batch.n_seq_id.add(i) = 1;
                    *(*batch.seq_id.add(i)) = SEQ;
                    *batch.logits.add(i) = i8::from(i + 1 == part.len());
                }
            }
            let mut b = batch;
            b.n_tokens = n;
            let _ = recent_llama_errors();
            // SAFETY: live context; batch filled above.
            let rc = unsafe { llama_cpp_sys_2::llama_decode(self.ptr.as_ptr(), b) };
            // SAFETY: batch from llama_batch_init, freed once.
            unsafe { llama_cpp_sys_2::llama_batch_free(batch) };
            if rc != 0 {
                return Err(EngineError::DecodeFailed {
                    code: rc,
                    pos: part[0],
                    detail: recent_llama_errors(),
                });
            }
            self.cache_rewritten();
            self.n_past += part.len();
        }
        if let Some(t) = &self.tap {
            tap::finish(t);
        }
        self.restart_hidden(self.n_past);
        Ok(())
    }

    fn decode_chunks(
        &mut self,
        tokens: &[Token],
        outputs: Outputs,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let all = outputs == Outputs::All;
        let needed = self.n_past + tokens.len();
        if needed > self.config.n_ctx as usize {
            return Err(EngineError::ContextOverflow {
                needed,
                n_ctx: self.config.n_ctx,
            });
        }
        let chunk = self.config.n_batch.min(self.config.n_ctx).max(1) as usize;
        let mut rows = Vec::new();
        for part in tokens.chunks(chunk) {
            let n = i32::try_from(part.len()).map_err(|_| EngineError::OutOfRange {
                what: "batch",
                value: part.len() as u64,
            })?;
            // SAFETY: allocates a batch for n tokens, one sequence id each; freed below.
            let batch = unsafe { llama_cpp_sys_2::llama_batch_init(n, 0, 1) };
            let pos0 = i32::try_from(self.n_past).map_err(|_| EngineError::OutOfRange {
                what: "position",
                value: self.n_past as u64,
            })?;
            for (i, &t) in part.iter().enumerate() {
                let last = i + 1 == part.len();
                // SAFETY: batch arrays have room for n entries (i < n) and seq_id[i] points to
                // an array of 1 seq id, as requested from llama_batch_init.
                unsafe {
                    *batch.token.add(i) = t;
                    *batch.pos.add(i) = pos0 + i32::try_from(i).unwrap_or(0);
                    *batch.n_seq_id.add(i) = 1;
                    *(*batch.seq_id.add(i)) = SEQ;
                    *batch.logits.add(i) = i8::from(match outputs {
                        Outputs::All => true,
                        Outputs::Last => last,
                        Outputs::None => false,
                    });
                }
            }
            let mut b = batch;
            b.n_tokens = n;
            let _ = recent_llama_errors();
            // SAFETY: live context; batch filled above.
            let rc = unsafe { llama_cpp_sys_2::llama_decode(self.ptr.as_ptr(), b) };
            if rc != 0 {
                // SAFETY: batch from llama_batch_init, freed once.
                unsafe { llama_cpp_sys_2::llama_batch_free(batch) };
                return Err(EngineError::DecodeFailed {
                    code: rc,
                    pos: pos0,
                    detail: recent_llama_errors(),
                });
            }
            self.cache_rewritten();
            self.n_past += part.len();
            if all {
                for i in 0..part.len() {
                    rows.push(self.logits_at(i32::try_from(i).unwrap_or(0)).to_vec());
                }
            }
            // SAFETY: as above.
            unsafe { llama_cpp_sys_2::llama_batch_free(batch) };
        }
        Ok(rows)
    }

    fn logits_at(&self, i: i32) -> &[f32] {
        // SAFETY: after a successful decode llama.cpp keeps an n_vocab-float row for every
        // output; i = -1 is the last one. The slice borrows self, so no decode can happen while
        // it is alive.
        unsafe {
            let p = llama_cpp_sys_2::llama_get_logits_ith(self.ptr.as_ptr(), i);
            if p.is_null() {
                return &[];
            }
            std::slice::from_raw_parts(p, self.n_vocab)
        }
    }

    /// Logits of the last decoded token (empty before the first decode).
    pub fn logits(&self) -> &[f32] {
        if self.n_past == 0 {
            return &[];
        }
        if let Some(kept) = self.kept_logits.get() {
            return kept;
        }
        self.logits_at(-1)
    }

    /// After a batch ran on sequence 0, or its cells were cleared or replaced: moved keys are
    /// re-rotated (or gone), and the logits [`Context::apply_moves`] kept aside are not the
    /// last ones any more.
    fn cache_rewritten(&mut self) {
        self.shift_pending.set(false);
        self.kept_logits.take();
    }

    /// Has llama.cpp re-rotate the keys of cells a recompute moved ([`Self::shift_pending`]),
    /// which it does at the start of a decode: one token decoded without outputs in an empty
    /// scratch sequence, then dropped. Sequence 0 and `n_past` are untouched; its last logits
    /// are kept aside first ([`Context::logits`] returns them until the next decode).
    fn apply_moves(&self) -> Result<(), EngineError> {
        if !self.shift_pending.get() {
            return Ok(());
        }
        if self.n_past > 0 && self.kept_logits.get().is_none() {
            let row = self.logits_at(-1).to_vec();
            if !row.is_empty() {
                let _ = self.kept_logits.set(row);
            }
        }
        // SAFETY: live context; scratch sequence 1 (below n_seq_max) is emptied, a one-token
        // batch at its position 0 asks for no output, and the sequence is emptied again.
        let rc = unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_seq_rm(mem, 1, -1, -1);
            let batch = llama_cpp_sys_2::llama_batch_init(1, 0, 1);
            *batch.token = 0;
            *batch.pos = 0;
            *batch.n_seq_id = 1;
            *(*batch.seq_id) = 1;
            *batch.logits = 0;
            let mut b = batch;
            b.n_tokens = 1;
            let rc = llama_cpp_sys_2::llama_decode(self.ptr.as_ptr(), b);
            llama_cpp_sys_2::llama_batch_free(batch);
            llama_cpp_sys_2::llama_memory_seq_rm(mem, 1, -1, -1);
            rc
        };
        if rc != 0 {
            return Err(EngineError::State {
                op: "export",
                detail: format!(
                    "moved keys could not be re-rotated before the export (decode {rc}): {}",
                    recent_llama_errors()
                ),
            });
        }
        self.shift_pending.set(false);
        Ok(())
    }

    /// Exports sequence 0's state (cell positions + K/V of every layer) as llama.cpp's blob.
    ///
    /// # Errors
    /// [`EngineError::State`] if llama.cpp writes a different size than it announced.
    pub fn export_state(&self) -> Result<Vec<u8>, EngineError> {
        self.apply_moves()?;
        let flags = 0;
        // SAFETY: live context; size query has no side effects.
        let size =
            unsafe { llama_cpp_sys_2::llama_state_seq_get_size_ext(self.ptr.as_ptr(), SEQ, flags) };
        let mut buf = vec![0u8; size];
        // SAFETY: buf holds exactly `size` bytes, the size llama.cpp just reported, and we pass
        // that capacity.
        let n = unsafe {
            llama_cpp_sys_2::llama_state_seq_get_data_ext(
                self.ptr.as_ptr(),
                buf.as_mut_ptr(),
                size,
                SEQ,
                flags,
            )
        };
        if n != size {
            return Err(EngineError::State {
                op: "export",
                detail: format!("llama.cpp wrote {n} bytes, announced {size}"),
            });
        }
        Ok(buf)
    }

    /// Replaces sequence 0 with an exported (possibly projected) state blob. `n_past` becomes
    /// one past the highest imported position.
    ///
    /// # Errors
    /// [`EngineError::State`] when llama.cpp rejects the blob (wrong layer count, row widths,
    /// or no room in the cache); the sequence is left empty, never half-imported.
    pub fn import_state(&mut self, blob: &[u8]) -> Result<(), EngineError> {
        self.clear();
        if crate::fault::hit(crate::fault::Site::KvImport) {
            return Err(EngineError::State {
                op: "import",
                detail: crate::fault::detail(crate::fault::Site::KvImport),
            });
        }
        let _ = recent_llama_errors();
        // SAFETY: blob is valid for blob.len() bytes; llama.cpp validates the layout and
        // returns 0 on failure.
        let n = unsafe {
            llama_cpp_sys_2::llama_state_seq_set_data_ext(
                self.ptr.as_ptr(),
                blob.as_ptr(),
                blob.len(),
                SEQ,
                0,
            )
        };
        if n == 0 {
            self.clear();
            return Err(EngineError::State {
                op: "import",
                detail: recent_llama_errors(),
            });
        }
        // SAFETY: live context; read-only query.
        let max = unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_seq_pos_max(mem, SEQ)
        };
        self.n_past = usize::try_from(max + 1).unwrap_or(0);
        self.cache_rewritten();
        self.restart_hidden(self.n_past);
        Ok(())
    }

    /// Highest position held in the cache for the sequence (-1 when empty), as llama.cpp sees it.
    pub fn seq_pos_max(&self) -> i32 {
        // SAFETY: live context; read-only query.
        unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_seq_pos_max(mem, SEQ)
        }
    }

    /// Lowest position held in the cache for the sequence (-1 when empty).
    pub fn seq_pos_min(&self) -> i32 {
        // SAFETY: live context; read-only query.
        unsafe {
            let mem = llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr());
            llama_cpp_sys_2::llama_memory_seq_pos_min(mem, SEQ)
        }
    }
}

/// Which tokens of a decode produce logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outputs {
    /// The last token of each chunk (the sequence's next-token distribution).
    Last,
    /// Every token.
    All,
    /// None: the decode only fills the cache.
    None,
}
