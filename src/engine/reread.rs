//! A native re-read of a history in progress: a context of the rung's own that decodes the
//! history a chunk at a time, between other work (the tokens of an answer), until it has caught
//! up; its state then replaces a cache that was projected. Used by the session's background
//! refill after a switch and by the recall benchmark's refill arms, which must do the same
//! thing to measure it.

use std::sync::Arc;

use super::{Context, ContextConfig, EngineError, Model, Token};

/// A history being re-read natively, `chunk` tokens per [`ReRead::step`].
pub struct ReRead {
    model: Arc<Model>,
    config: ContextConfig,
    chunk: usize,
    /// Created at the first step, so that starting a re-read costs nothing until it runs.
    ctx: Option<Context>,
    /// History tokens decoded so far.
    done: usize,
}

impl std::fmt::Debug for ReRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReRead")
            .field("model", &self.model.name())
            .field("chunk", &self.chunk)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ReRead {
    /// A re-read on `model` with the ladder's `config` (its batch sized to the chunk, no taps),
    /// `chunk` tokens per step (at least 1).
    #[must_use]
    pub fn new(model: Arc<Model>, config: ContextConfig, chunk: usize) -> Self {
        let chunk = chunk.max(1);
        Self {
            model,
            config: ContextConfig {
                n_batch: u32::try_from(chunk).unwrap_or(u32::MAX).max(1),
                attention_tap: false,
                hidden_tap: false,
                ..config
            },
            chunk,
            ctx: None,
            done: 0,
        }
    }

    /// History tokens decoded so far.
    #[must_use]
    pub fn done(&self) -> usize {
        self.done
    }

    /// Decodes the next chunk of `history[..target]` (the re-read must not run ahead of the
    /// live context, which decodes the newest token itself); returns whether it has caught up
    /// with `target`.
    ///
    /// # Errors
    /// The context cannot be created, or a decode fails.
    pub fn step(&mut self, history: &[Token], target: usize) -> Result<bool, EngineError> {
        let target = target.min(history.len());
        let ctx = match self.ctx.as_mut() {
            Some(c) => c,
            None => self
                .ctx
                .insert(Context::new(self.model.clone(), self.config)?),
        };
        let end = (self.done + self.chunk).min(target);
        if end > self.done {
            ctx.decode(&history[self.done..end])?;
            self.done = end;
        }
        Ok(self.done >= target)
    }

    /// The re-read cache's state (llama.cpp's sequence blob, for [`Context::import_state`]);
    /// the re-read's context is freed.
    ///
    /// # Errors
    /// [`EngineError::State`] when nothing was read yet or the export fails.
    pub fn into_state(self) -> Result<Vec<u8>, EngineError> {
        let ctx = self.ctx.ok_or_else(|| EngineError::State {
            op: "export",
            detail: "a re-read that has not started has no state".into(),
        })?;
        ctx.export_state()
    }
}
