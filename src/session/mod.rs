//! The token loop: prefill, sample, stream, and — between two tokens — decide whether to move
//! to another rung. Everything a user sees (CLI, prompt files, the HTTP service, the
//! benchmark) is a consumer of the [`Event`]s this loop emits.
//!
//! Main types: [`Session`] (a ladder with loaded rungs and one conversation), [`Prompt`],
//! [`GenerateOptions`], [`Event`] and [`Generation`] (the summary of one answer).

mod events;

pub use events::{Event, Generation, StopReason, SwitchInfo};

use crate::engine::{
    ChatMessage, Context, ContextConfig, EngineError, Model, ModelOptions, Sampler, SamplingParams,
    Token, Utf8Stream,
};
use crate::ladder::{Ladder, RungInfo};
use std::time::Instant;

/// Errors from a session.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// llama.cpp failed.
    #[error("rung {rung}: {source}")]
    Engine {
        /// Rung name.
        rung: String,
        /// The engine error.
        source: EngineError,
    },
    /// The prompt does not fit the context window.
    #[error(
        "the prompt is {prompt_tokens} tokens but the context window is {n_ctx} (and {reserve} are kept for the answer); shorten the prompt or raise --n-ctx"
    )]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Context window.
        n_ctx: u32,
        /// Tokens reserved for the answer.
        reserve: usize,
    },
    /// No such rung.
    #[error("no rung named {0:?} in this ladder")]
    UnknownRung(String),
    /// A migration failed; the session stays on the source rung.
    #[error("migration {from} -> {to} failed: {message}")]
    Migration {
        /// Source rung.
        from: String,
        /// Destination rung.
        to: String,
        /// Why.
        message: String,
    },
}

/// What to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text, tokenized as is (no chat template).
    Text(String),
    /// A user turn appended to the session's conversation and rendered with the model's chat
    /// template.
    User(String),
}

/// Per-answer options.
#[derive(Debug, Clone, Copy)]
pub struct GenerateOptions {
    /// Stop after this many generated tokens.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::greedy(),
        }
    }
}

/// A rung with its weights mapped and a context ready.
pub struct LiveRung {
    /// What the ladder knows about the rung.
    pub info: RungInfo,
    /// Its llama.cpp context (which holds the model).
    pub ctx: Context,
}

impl LiveRung {
    /// Maps the rung's weights and creates its context.
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp refuses the file or the context.
    pub fn load(info: &RungInfo, config: ContextConfig) -> Result<Self, SessionError> {
        let wrap = |source| SessionError::Engine {
            rung: info.name().to_string(),
            source,
        };
        let model = Model::load(&info.path, info.name(), ModelOptions::default()).map_err(wrap)?;
        let ctx = Context::new(model, config).map_err(wrap)?;
        Ok(Self {
            info: info.clone(),
            ctx,
        })
    }

    /// The rung's name.
    pub fn name(&self) -> &str {
        self.info.name()
    }

    /// The model.
    pub fn model(&self) -> &Model {
        self.ctx.model()
    }
}

/// A ladder with loaded rungs and one conversation.
pub struct Session {
    ladder: Ladder,
    config: ContextConfig,
    rungs: Vec<Option<LiveRung>>,
    current: usize,
    /// Tokens whose K/V are in the current rung's cache, in order.
    history: Vec<Token>,
    /// The conversation (for chat prompts).
    conversation: Vec<ChatMessage>,
    /// The token sampled last but not yet decoded (carried across answers and migrations).
    pending: Option<Token>,
}

impl Session {
    /// A session on `ladder`, starting on rung `start` (loaded now).
    ///
    /// # Errors
    /// [`SessionError::UnknownRung`] or a load failure.
    pub fn new(ladder: Ladder, config: ContextConfig, start: &str) -> Result<Self, SessionError> {
        let current = ladder
            .rungs
            .iter()
            .position(|r| r.name() == start)
            .ok_or_else(|| SessionError::UnknownRung(start.to_string()))?;
        let mut rungs: Vec<Option<LiveRung>> = (0..ladder.rungs.len()).map(|_| None).collect();
        rungs[current] = Some(LiveRung::load(&ladder.rungs[current], config)?);
        Ok(Self {
            ladder,
            config,
            rungs,
            current,
            history: Vec::new(),
            conversation: Vec::new(),
            pending: None,
        })
    }

    /// The ladder.
    pub fn ladder(&self) -> &Ladder {
        &self.ladder
    }

    /// The current rung's name.
    pub fn current_rung(&self) -> &str {
        self.ladder.rungs[self.current].name()
    }

    /// Index of the current rung.
    pub fn current_index(&self) -> usize {
        self.current
    }

    /// The conversation so far.
    pub fn conversation(&self) -> &[ChatMessage] {
        &self.conversation
    }

    /// The tokens in the current cache.
    pub fn history(&self) -> &[Token] {
        &self.history
    }

    /// The context config shared by every rung.
    pub fn config(&self) -> ContextConfig {
        self.config
    }

    /// Forgets the conversation and the cache (the rungs stay loaded).
    pub fn reset(&mut self) {
        self.conversation.clear();
        self.history.clear();
        self.pending = None;
        if let Some(r) = self.rungs[self.current].as_mut() {
            r.ctx.clear();
        }
    }

    /// Loads a rung if it is not loaded.
    ///
    /// # Errors
    /// A load failure.
    pub fn ensure_loaded(&mut self, index: usize) -> Result<&mut LiveRung, SessionError> {
        if self.rungs[index].is_none() {
            self.rungs[index] = Some(LiveRung::load(&self.ladder.rungs[index], self.config)?);
        }
        self.rungs[index]
            .as_mut()
            .ok_or_else(|| SessionError::UnknownRung(index.to_string()))
    }

    fn live(&mut self) -> &mut LiveRung {
        // The current rung is loaded by construction and by every switch.
        self.rungs[self.current]
            .as_mut()
            .expect("current rung is loaded")
    }

    /// Which rungs are loaded.
    pub fn loaded(&self) -> Vec<bool> {
        self.rungs.iter().map(Option::is_some).collect()
    }

    /// Access to a loaded rung.
    pub fn rung_mut(&mut self, index: usize) -> Option<&mut LiveRung> {
        self.rungs.get_mut(index).and_then(Option::as_mut)
    }

    /// Tokens for a prompt: raw text, or the whole conversation rendered with the chat
    /// template (with the new user turn appended, assistant turn opened).
    fn prompt_tokens(&mut self, prompt: &Prompt) -> Result<Vec<Token>, SessionError> {
        let name = self.current_rung().to_string();
        let wrap = |source| SessionError::Engine {
            rung: name.clone(),
            source,
        };
        match prompt {
            Prompt::Text(t) => {
                let mut v = self.history.clone();
                v.extend(self.live().model().tokenize(t, false).map_err(wrap)?);
                Ok(v)
            }
            Prompt::User(t) => {
                let mut conv = self.conversation.clone();
                conv.push(ChatMessage::new("user", t));
                let text = self
                    .live()
                    .model()
                    .apply_chat_template(&conv, true)
                    .map_err(wrap)?;
                self.conversation = conv;
                self.live().model().tokenize(&text, true).map_err(wrap)
            }
        }
    }

    /// Answers one prompt, streaming [`Event`]s into `sink`.
    ///
    /// The cache is reused for the longest prefix the new prompt shares with what is already
    /// cached (a chat's earlier turns are not re-read).
    ///
    /// # Errors
    /// [`SessionError::PromptTooLong`] before anything is decoded; engine errors otherwise.
    pub fn generate(
        &mut self,
        prompt: &Prompt,
        opts: &GenerateOptions,
        sink: &mut dyn FnMut(&Event),
    ) -> Result<Generation, SessionError> {
        let t0 = Instant::now();
        let tokens = self.prompt_tokens(prompt)?;
        let n_ctx = self.config.n_ctx;
        let reserve = opts.max_tokens.min(16).max(1);
        if tokens.len() + reserve > n_ctx as usize {
            return Err(SessionError::PromptTooLong {
                prompt_tokens: tokens.len(),
                n_ctx,
                reserve,
            });
        }
        let keep = common_prefix(&self.history, &tokens).min(tokens.len().saturating_sub(1));
        let rung_name = self.current_rung().to_string();
        let wrap = |source| SessionError::Engine {
            rung: rung_name.clone(),
            source,
        };
        {
            let live = self.live();
            live.ctx.truncate(keep);
            live.ctx.decode(&tokens[keep..]).map_err(wrap)?;
        }
        self.history = tokens.clone();
        self.pending = None;
        let mut sampler = Sampler::new(opts.sampling);
        let mut stream = Utf8Stream::new();
        let mut out_tokens = Vec::new();
        let mut text = String::new();
        let mut rungs_used = vec![rung_name.clone()];
        let mut last = Instant::now();
        let mut ttft_ms = 0.0;
        sink(&Event::Start {
            rung: rung_name.clone(),
            prompt_tokens: tokens.len(),
            reused_tokens: keep,
        });
        let mut stop = StopReason::Length;
        for i in 0..opts.max_tokens {
            if i > 0 {
                let tok = *out_tokens.last().unwrap_or(&0);
                let name = self.current_rung().to_string();
                if self.history.len() + 1 > n_ctx as usize {
                    stop = StopReason::ContextFull;
                    break;
                }
                self.live()
                    .ctx
                    .decode(&[tok])
                    .map_err(|source| SessionError::Engine { rung: name, source })?;
                self.history.push(tok);
            }
            let tok = {
                let live = self.live();
                sampler.sample(live.ctx.logits())
            };
            let now = Instant::now();
            let latency_ms = now.duration_since(last).as_secs_f64() * 1e3;
            last = now;
            if i == 0 {
                ttft_ms = now.duration_since(t0).as_secs_f64() * 1e3;
            }
            if self.live().model().is_eog(tok) {
                stop = StopReason::Eos;
                break;
            }
            out_tokens.push(tok);
            let piece = stream.push(&self.live().model().token_bytes(tok));
            text.push_str(&piece);
            let rung = self.current_rung().to_string();
            if rungs_used.last() != Some(&rung) {
                rungs_used.push(rung.clone());
            }
            sink(&Event::Token {
                index: i,
                token: tok,
                text: piece,
                rung,
                latency_ms,
            });
        }
        let tail = stream.finish();
        if !tail.is_empty() {
            text.push_str(&tail);
        }
        self.pending = out_tokens.last().copied();
        if let Prompt::User(_) = prompt {
            self.conversation.push(ChatMessage::new("assistant", &text));
        }
        let total_ms = t0.elapsed().as_secs_f64() * 1e3;
        let generation = Generation {
            text,
            tokens: out_tokens,
            prompt_tokens: tokens.len(),
            rungs_used,
            switches: Vec::new(),
            ttft_ms,
            total_ms,
            stop,
            killed: false,
        };
        sink(&Event::Done(generation.summary()));
        Ok(generation)
    }
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
