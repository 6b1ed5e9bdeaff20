//! A llama.cpp context holding several independent sequences — one per tenant — decoded
//! together: [`BatchContext`], fed one [`SeqChunk`] per sequence per step.
//!
//! Why one context and not one [`Context`](super::Context) per tenant: a `llama_decode` of
//! one token costs nearly what a decode of several tokens costs on a CPU (the weights are
//! read once per call, and reading them is the bound), so several answers decoded in one call
//! share that cost. llama.cpp's `llama-batched-bench` on a 2-core machine: 54.6 tokens/s for
//! one sequence of the 1.5B rung, 69.5 for four, 104 for eight.
//!
//! The cache is unified (`kv_unified`): the context's `n_ctx` cells are shared by all the
//! sequences, so a short answer does not reserve a whole window. A sequence is identified by
//! a [`SeqId`] below `max_seqs`; [`BatchContext::export_seq`] / [`BatchContext::import_seq`]
//! move one sequence's cache alone (llama.cpp's state-seq API with that id), which is how a
//! tenant is parked or migrated to another rung while the others keep decoding.
//!
//! Scheduling (which chunk of which prompt goes into a step) is the caller's: this type
//! decodes what it is given, in one call, and keeps each sequence's next position and the
//! logits each sequence asked for.

use std::sync::Arc;

use super::{ContextConfig, EngineError, Model, Token, recent_llama_errors};

/// A sequence of a [`BatchContext`] (llama.cpp's `llama_seq_id`, below `max_seqs`).
pub type SeqId = u32;

/// What one sequence contributes to a step: `tokens` at its next positions, and whether the
/// last of them produces logits.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// Tokens to append (a newcomer's prompt chunk, or a running answer's pending token).
    pub tokens: &'a [Token],
    /// Keep the logits after the last token (for sampling the sequence's next token).
    pub logits: bool,
}

/// Positions of a sequence re-read in place in a step ([`BatchContext::step_rereading`]).
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// The first position re-read.
    pub start: usize,
    /// The tokens at `start..`, the sequence's own.
    pub tokens: &'a [Token],
}

/// A context decoding several sequences per `llama_decode`.
pub struct BatchContext {
    ptr: std::ptr::NonNull<llama_cpp_sys_2::llama_context>,
    model: Arc<Model>,
    config: ContextConfig,
    n_vocab: usize,
    /// Per sequence id: `Some(next position)` while in use.
    seqs: Vec<Option<usize>>,
    /// Per sequence id: the output row of its logits in the last step, if it asked for them.
    outputs: Vec<Option<i32>>,
    /// Bytes llama.cpp reported reserving (KV, compute and output buffers).
    reserved_bytes: u64,
}

// SAFETY: a llama_context is used from one thread at a time (all mutation takes &mut self);
// moving it between threads is fine.
unsafe impl Send for BatchContext {}

impl std::fmt::Debug for BatchContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchContext")
            .field("model", &self.model.name())
            .field("seqs", &self.seqs)
            .finish_non_exhaustive()
    }
}

impl Drop for BatchContext {
    fn drop(&mut self) {
        // SAFETY: ptr came from llama_init_from_model and is freed once, before our Arc<Model>
        // (a field) is dropped.
        unsafe { llama_cpp_sys_2::llama_free(self.ptr.as_ptr()) }
    }
}

fn to_i32(what: &'static str, v: usize) -> Result<i32, EngineError> {
    i32::try_from(v).map_err(|_| EngineError::OutOfRange {
        what,
        value: v as u64,
    })
}

impl BatchContext {
    /// A context over `model` with room for `max_seqs` sequences sharing `config.n_ctx`
    /// cells; one step carries at most `config.n_batch` tokens in all.
    ///
    /// # Errors
    /// [`EngineError::ContextFailed`] if llama.cpp cannot allocate it; [`EngineError::OutOfRange`]
    /// for absurd sizes (no sequence, or more threads than an `i32`).
    pub fn new(
        model: Arc<Model>,
        config: ContextConfig,
        max_seqs: u32,
    ) -> Result<Self, EngineError> {
        if max_seqs == 0 {
            return Err(EngineError::OutOfRange {
                what: "sequences per context",
                value: 0,
            });
        }
        // The same parameters as every other context of the ladder, so that a sequence's
        // exported state is interchangeable with a single-sequence context's.
        // One sequence more than the callers get: the one a span is re-read in
        // ([`BatchContext::step_rereading`]), so that a full batch can still re-read.
        let p = super::context::ladder_params(&config, max_seqs + 1)?;
        let (ptr, reserved_bytes) = super::context::init_context(&model, p, config.n_ctx)?;
        let n = max_seqs as usize + 1;
        Ok(Self {
            ptr,
            n_vocab: model.n_vocab(),
            model,
            config,
            seqs: vec![None; n],
            outputs: vec![None; n],
            reserved_bytes,
        })
    }

    /// The model this context runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The configuration it was made with (`n_ctx` is the cells all sequences share).
    pub fn config(&self) -> ContextConfig {
        self.config
    }

    /// How many sequences it can hold.
    pub fn max_seqs(&self) -> usize {
        self.seqs.len() - 1
    }

    /// The sequence a span is re-read in, never handed out by [`BatchContext::add_seq`].
    fn scratch(&self) -> SeqId {
        SeqId::try_from(self.seqs.len() - 1).unwrap_or(SeqId::MAX)
    }

    /// Sequences in use.
    pub fn active(&self) -> usize {
        self.seqs[..self.max_seqs()]
            .iter()
            .filter(|s| s.is_some())
            .count()
    }

    /// Positions held by all sequences together: the cells in use, counting a cell shared by
    /// several sequences ([`BatchContext::share_prefix`]) once for each (an upper bound).
    pub fn cells_used(&self) -> usize {
        self.seqs.iter().flatten().sum()
    }

    /// Bytes llama.cpp reported reserving for this context's buffers (0 if its log did not
    /// say).
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// Takes a free sequence (empty, next position 0); `None` when all are in use.
    pub fn add_seq(&mut self) -> Option<SeqId> {
        let i = self.seqs[..self.max_seqs()]
            .iter()
            .position(Option::is_none)?;
        self.seqs[i] = Some(0);
        self.outputs[i] = None;
        SeqId::try_from(i).ok()
    }

    /// Positions decoded into `seq` (where its next token goes); `None` for a sequence not in
    /// use.
    pub fn n_past(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(seq as usize).copied().flatten()
    }

    fn check(&self, seq: SeqId) -> Result<usize, EngineError> {
        self.n_past(seq).ok_or(EngineError::OutOfRange {
            what: "sequence (not in use)",
            value: u64::from(seq),
        })
    }

    fn mem(&self) -> llama_cpp_sys_2::llama_memory_t {
        // SAFETY: live context; the memory handle lives as long as it.
        unsafe { llama_cpp_sys_2::llama_get_memory(self.ptr.as_ptr()) }
    }

    /// Frees `seq` and its cells (an answer finished or its client left); the others are
    /// untouched. Removing a sequence not in use does nothing.
    pub fn remove_seq(&mut self, seq: SeqId) {
        if self.n_past(seq).is_none() {
            return;
        }
        if let Ok(id) = i32::try_from(seq) {
            // SAFETY: live context; removing every position of one sequence id below
            // n_seq_max is always valid and leaves the other sequences' cells alone.
            unsafe { llama_cpp_sys_2::llama_memory_seq_rm(self.mem(), id, -1, -1) };
        }
        self.seqs[seq as usize] = None;
        self.outputs[seq as usize] = None;
    }

    /// Gives the empty sequence `dst` the first `n` positions of `src` without decoding them:
    /// in the unified cache a shared cell is a second sequence tag on it, not a copy, and it
    /// stays as long as either sequence holds it. For prompts that begin alike (a chat
    /// template's system prompt): a newcomer reads only what differs.
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] when either sequence is not in use, `dst` is not empty, or
    /// `src` holds fewer than `n` positions.
    pub fn share_prefix(&mut self, src: SeqId, dst: SeqId, n: usize) -> Result<(), EngineError> {
        let held = self.check(src)?;
        if self.check(dst)? != 0 || src == dst {
            return Err(EngineError::OutOfRange {
                what: "sequence to share into (must be another, empty one)",
                value: u64::from(dst),
            });
        }
        if n > held {
            return Err(EngineError::OutOfRange {
                what: "shared prefix (longer than the source holds)",
                value: n as u64,
            });
        }
        let (s, d, p1) = (
            to_i32("sequence", src as usize)?,
            to_i32("sequence", dst as usize)?,
            to_i32("position", n)?,
        );
        // SAFETY: live context; both ids are below n_seq_max and in use, and [0, n) is held
        // by `src` (checked above); copying tags cells, it allocates nothing.
        unsafe { llama_cpp_sys_2::llama_memory_seq_cp(self.mem(), s, d, 0, p1) };
        self.seqs[dst as usize] = Some(n);
        Ok(())
    }

    /// Removes positions `[from, n_past)` of `seq` (rewinds it to `from`).
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] for a sequence not in use.
    pub fn truncate(&mut self, seq: SeqId, from: usize) -> Result<(), EngineError> {
        let n_past = self.check(seq)?;
        if from >= n_past {
            return Ok(());
        }
        let (id, p0) = (to_i32("sequence", seq as usize)?, to_i32("position", from)?);
        // SAFETY: live context; removing a position range of one sequence is always valid.
        unsafe { llama_cpp_sys_2::llama_memory_seq_rm(self.mem(), id, p0, -1) };
        self.seqs[seq as usize] = Some(from);
        Ok(())
    }

    /// Decodes every chunk in one `llama_decode`: chunk `k`'s tokens go to its sequence at its
    /// next positions. Afterwards [`BatchContext::logits`] gives, for each chunk that asked,
    /// the distribution after its last token. Logits of earlier steps are gone.
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] for a sequence not in use or named twice, or more tokens
    /// than `n_batch`; [`EngineError::ContextOverflow`] when the cells would not hold them;
    /// [`EngineError::DecodeFailed`] when llama.cpp refuses (nothing is advanced then).
    pub fn step(&mut self, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError> {
        self.step_counted(chunks, 0)
    }

    /// [`BatchContext::step`], with `span`'s positions of its sequence re-read in place in the
    /// same `llama_decode`: its tokens decoded at their own positions, attending to the
    /// sequence's cells before them (and to each other), their new cells replacing the old.
    /// A sequence's chunk in `chunks` attends to the cells the span replaces as they were
    /// (this call computes both); every later step sees the new ones. The span is decoded in
    /// a sequence of its own (one more than [`BatchContext::max_seqs`], never handed out) that
    /// shares the sequence's cells before it (llama.cpp wants a sequence's batch to continue
    /// right after its last cached position), whose new cells are then handed to the
    /// sequence; it is emptied before this returns. `None` is `step`.
    ///
    /// # Errors
    /// As [`BatchContext::step`]; [`EngineError::OutOfRange`] also when the span reaches past
    /// what its sequence holds. On any error the sequence's cells are as they were.
    pub fn step_rereading(
        &mut self,
        chunks: &[SeqChunk<'_>],
        span: Option<SeqSpan<'_>>,
    ) -> Result<(), EngineError> {
        let Some(span) = span.filter(|s| !s.tokens.is_empty()) else {
            return self.step(chunks);
        };
        let held = self.check(span.seq)?;
        let end = span.start + span.tokens.len();
        if end > held {
            return Err(EngineError::OutOfRange {
                what: "re-read span (past what its sequence holds)",
                value: end as u64,
            });
        }
        let (sid, p0, p1) = (
            to_i32("sequence", span.seq as usize)?,
            to_i32("position", span.start)?,
            to_i32("position", end)?,
        );
        let scratch = self.scratch();
        if span.seq == scratch || self.seqs[scratch as usize].is_some() {
            return Err(EngineError::OutOfRange {
                what: "sequence to re-read a span of",
                value: u64::from(span.seq),
            });
        }
        self.outputs[scratch as usize] = None;
        let xid = to_i32("sequence", scratch as usize)?;
        // SAFETY: live context; both ids are below n_seq_max and in use, and [0, start) is
        // held by `span.seq` (checked above); copying tags cells, it allocates nothing.
        unsafe { llama_cpp_sys_2::llama_memory_seq_cp(self.mem(), sid, xid, 0, p0) };
        self.seqs[scratch as usize] = Some(span.start);
        let mut all = chunks.to_vec();
        all.push(SeqChunk {
            seq: scratch,
            tokens: span.tokens,
            logits: false,
        });
        // The scratch's shared cells are not new ones.
        let result = self.step_counted(&all, span.start);
        if result.is_ok() {
            // SAFETY: live context; ids below n_seq_max; the span's positions are held by
            // both sequences (the sequence's old cells, the scratch's new ones).
            unsafe {
                llama_cpp_sys_2::llama_memory_seq_rm(self.mem(), sid, p0, p1);
                llama_cpp_sys_2::llama_memory_seq_cp(self.mem(), xid, sid, p0, p1);
            }
        }
        self.remove_seq(scratch);
        result
    }

    /// [`BatchContext::step`], `shared` of the positions the sequences hold being cells held
    /// by another one too (not counted twice against the window).
    fn step_counted(&mut self, chunks: &[SeqChunk<'_>], shared: usize) -> Result<(), EngineError> {
        self.outputs.iter_mut().for_each(|o| *o = None);
        let mut seen = vec![false; self.seqs.len()];
        for c in chunks {
            self.check(c.seq)?;
            if std::mem::replace(&mut seen[c.seq as usize], true) {
                return Err(EngineError::OutOfRange {
                    what: "sequence (twice in one step)",
                    value: u64::from(c.seq),
                });
            }
        }
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        if n == 0 {
            return Ok(());
        }
        if n > self.config.n_batch.min(self.config.n_ctx) as usize {
            return Err(EngineError::OutOfRange {
                what: "tokens in one step (above n_batch)",
                value: n as u64,
            });
        }
        let needed = self.cells_used().saturating_sub(shared) + n;
        if needed > self.config.n_ctx as usize {
            return Err(EngineError::ContextOverflow {
                needed,
                n_ctx: self.config.n_ctx,
            });
        }
        let n_i32 = to_i32("batch", n)?;
        // SAFETY: allocates a batch for n tokens, one sequence id each; freed below.
        let batch = unsafe { llama_cpp_sys_2::llama_batch_init(n_i32, 0, 1) };
        let mut k = 0usize;
        let mut rows = Vec::with_capacity(chunks.len());
        let filled = (|| {
            for c in chunks {
                let pos0 = self.seqs[c.seq as usize].unwrap_or(0);
                let sid = to_i32("sequence", c.seq as usize)?;
                for (j, &t) in c.tokens.iter().enumerate() {
                    let last = j + 1 == c.tokens.len();
                    let pos = to_i32("position", pos0 + j)?;
                    // SAFETY: k < n entries, as allocated; seq_id[k] points to an array of
                    // one seq id.
                    unsafe {
                        *batch.token.add(k) = t;
                        *batch.pos.add(k) = pos;
                        *batch.n_seq_id.add(k) = 1;
                        *(*batch.seq_id.add(k)) = sid;
                        *batch.logits.add(k) = i8::from(last && c.logits);
                    }
                    if last && c.logits {
                        rows.push((c.seq, to_i32("batch row", k)?));
                    }
                    k += 1;
                }
            }
            Ok::<(), EngineError>(())
        })();
        if let Err(e) = filled {
            // SAFETY: batch from llama_batch_init, freed once.
            unsafe { llama_cpp_sys_2::llama_batch_free(batch) };
            return Err(e);
        }
        let mut b = batch;
        b.n_tokens = n_i32;
        let _ = recent_llama_errors();
        // SAFETY: live context; batch filled above with n entries.
        let rc = unsafe { llama_cpp_sys_2::llama_decode(self.ptr.as_ptr(), b) };
        // SAFETY: batch from llama_batch_init, freed once.
        unsafe { llama_cpp_sys_2::llama_batch_free(batch) };
        if rc != 0 {
            // llama.cpp rolls back the cells of a failed decode; positions stay as they were.
            return Err(EngineError::DecodeFailed {
                code: rc,
                pos: chunks
                    .first()
                    .and_then(|c| self.seqs[c.seq as usize])
                    .map_or(0, |p| i32::try_from(p).unwrap_or(i32::MAX)),
                detail: recent_llama_errors(),
            });
        }
        for c in chunks {
            if let Some(p) = self.seqs[c.seq as usize].as_mut() {
                *p += c.tokens.len();
            }
        }
        for (seq, row) in rows {
            self.outputs[seq as usize] = Some(row);
        }
        Ok(())
    }

    /// The logits `seq` asked for in the last step (`None` if it did not).
    pub fn logits(&self, seq: SeqId) -> Option<&[f32]> {
        let row = (*self.outputs.get(seq as usize)?)?;
        // SAFETY: after a successful decode llama.cpp keeps an n_vocab-float row for every
        // output, and `row` is the batch index of one that asked. The slice borrows self, so
        // no decode can happen while it is alive.
        unsafe {
            let p = llama_cpp_sys_2::llama_get_logits_ith(self.ptr.as_ptr(), row);
            if p.is_null() {
                return None;
            }
            Some(std::slice::from_raw_parts(p, self.n_vocab))
        }
    }

    /// Exports `seq`'s state (cell positions + K/V of every layer) as llama.cpp's blob — the
    /// same format a single-sequence [`Context`](super::Context) exports, so the transplant
    /// path reads it unchanged.
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] for a sequence not in use; [`EngineError::State`] if
    /// llama.cpp writes a different size than it announced.
    pub fn export_seq(&self, seq: SeqId) -> Result<Vec<u8>, EngineError> {
        self.check(seq)?;
        let id = to_i32("sequence", seq as usize)?;
        // SAFETY: live context; size query has no side effects.
        let size =
            unsafe { llama_cpp_sys_2::llama_state_seq_get_size_ext(self.ptr.as_ptr(), id, 0) };
        let mut buf = vec![0u8; size];
        // SAFETY: buf holds exactly `size` bytes, the size llama.cpp just reported, and we pass
        // that capacity.
        let n = unsafe {
            llama_cpp_sys_2::llama_state_seq_get_data_ext(
                self.ptr.as_ptr(),
                buf.as_mut_ptr(),
                size,
                id,
                0,
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

    /// Replaces `seq`'s cache with an exported (possibly projected) state blob; its next
    /// position becomes one past the highest imported one. A sequence not in use is taken.
    ///
    /// # Errors
    /// [`EngineError::OutOfRange`] for an id at or above `max_seqs`; [`EngineError::State`]
    /// when llama.cpp rejects the blob (wrong layout, or no room in the shared cells): the
    /// sequence is then left empty, never half-imported.
    pub fn import_seq(&mut self, seq: SeqId, blob: &[u8]) -> Result<(), EngineError> {
        if seq as usize >= self.seqs.len() {
            return Err(EngineError::OutOfRange {
                what: "sequence",
                value: u64::from(seq),
            });
        }
        let id = to_i32("sequence", seq as usize)?;
        // SAFETY: live context; clearing one sequence id below n_seq_max is always valid.
        unsafe { llama_cpp_sys_2::llama_memory_seq_rm(self.mem(), id, -1, -1) };
        self.seqs[seq as usize] = Some(0);
        self.outputs[seq as usize] = None;
        let _ = recent_llama_errors();
        // SAFETY: blob is valid for blob.len() bytes; llama.cpp validates the layout and
        // returns 0 on failure.
        let n = unsafe {
            llama_cpp_sys_2::llama_state_seq_set_data_ext(
                self.ptr.as_ptr(),
                blob.as_ptr(),
                blob.len(),
                id,
                0,
            )
        };
        if n == 0 {
            // SAFETY: as above.
            unsafe { llama_cpp_sys_2::llama_memory_seq_rm(self.mem(), id, -1, -1) };
            return Err(EngineError::State {
                op: "import",
                detail: recent_llama_errors(),
            });
        }
        // SAFETY: live context; read-only query.
        let max = unsafe { llama_cpp_sys_2::llama_memory_seq_pos_max(self.mem(), id) };
        self.seqs[seq as usize] = Some(usize::try_from(max + 1).unwrap_or(0));
        Ok(())
    }
}
