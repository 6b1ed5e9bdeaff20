//! The SSE side of one streamed answer: [`ChunkStream`] turns the engine's [`Update`]s into
//! `chat.completion.chunk` events and ends with `data: [DONE]`.
//!
//! Its life is an explicit state machine, [`DoneState`] (after mistral.rs): `Running` while
//! updates arrive; `SendingDone` once the answer ended (summary or error sent) and only the
//! `[DONE]` line remains; `Done` after it, when the stream ends. A stream dropped before
//! `Done` — the client hung up — fires its [`CancelGuard`], which stops the answer at the next
//! token and frees the engine for the next request.
//!
//! Time to first token and the largest gap between token chunks are measured here, where the
//! bytes are handed to the connection, and reported in the summary beside the engine's own.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::response::sse;
use futures::Stream;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::openai::{
    ChatChunk, ChoiceLogprobs, ChunkChoice, ConversationWire, Delta, MoltEvent, StreamTiming,
    SummaryWire, SwitchWire, TokenLogprob, Usage, finish_reason, mib,
};
use super::worker::{Shared, Update};
use molt::session::{Event, Generation};

/// Where a stream is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DoneState {
    /// Updates still arrive.
    Running,
    /// The answer ended; `[DONE]` is next.
    SendingDone,
    /// Finished.
    Done,
}

/// Stops the engine's work for a request when dropped while armed: the client has gone.
pub struct CancelGuard {
    shared: Arc<Shared>,
    id: String,
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelGuard {
    /// An armed guard for request `id`.
    #[must_use]
    pub fn new(shared: Arc<Shared>, id: String, flag: Arc<AtomicBool>) -> Self {
        Self {
            shared,
            id,
            flag,
            armed: true,
        }
    }

    /// The request ended normally; dropping no longer cancels.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.shared.cancel(&self.id, &self.flag);
            self.shared
                .recorder
                .service(&self.id, "client_gone", serde_json::Value::Null);
        }
    }
}

/// Builds the chunks of one answer.
#[derive(Debug, Clone)]
pub struct Chunks {
    /// Request id.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name echoed.
    pub model: String,
}

impl Chunks {
    fn chunk(
        &self,
        delta: Option<Delta>,
        finish: Option<&str>,
        molt: Option<MoltEvent>,
    ) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta: delta.unwrap_or_default(),
                logprobs: None,
                finish_reason: finish.map(str::to_string),
            }],
            usage: None,
            molt,
        }
    }

    /// A chunk carrying only a Molt event (its one choice has an empty delta).
    #[must_use]
    pub fn event(&self, molt: MoltEvent) -> ChatChunk {
        self.chunk(None, None, Some(molt))
    }
}

/// The molt event for a session event that is not a token (`None` for tokens, start and done,
/// which the stream shapes itself).
#[must_use]
pub fn molt_event(e: &Event) -> Option<MoltEvent> {
    match e {
        Event::Switch(s) => Some(MoltEvent::Switch(SwitchWire::from(s))),
        Event::Budget {
            bytes,
            pressure,
            source,
        } => Some(MoltEvent::Budget {
            budget_mib: mib(*bytes),
            pressure: *pressure,
            source: source.clone(),
        }),
        Event::Stall {
            reason,
            deadline_ms,
        } => Some(MoltEvent::Stall {
            reason: reason.clone(),
            deadline_ms: *deadline_ms,
        }),
        Event::Lever(l) => Some(MoltEvent::Lever(l.clone())),
        Event::Start { .. }
        | Event::Token { .. }
        | Event::Footprint(_)
        | Event::Prepare(_)
        | Event::Done(_) => None,
    }
}

/// One streamed answer.
pub struct ChunkStream {
    rx: mpsc::UnboundedReceiver<Update>,
    state: DoneState,
    out: VecDeque<sse::Event>,
    chunks: Chunks,
    include_usage: bool,
    guard: CancelGuard,
    received: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    max_gap_ms: f64,
    sent_text: String,
    sent_role: bool,
    queue_ms: f64,
    /// Send chunks in `/v1/completions`' shape (`text_completion`).
    text: bool,
    /// Prompt tokens the answer took from a kept cache (its start event's).
    reused: usize,
    /// The conversation, named in the summary.
    conversation: Option<ConversationWire>,
}

fn data(chunk: &ChatChunk) -> sse::Event {
    sse::Event::default().data(serde_json::to_string(chunk).unwrap_or_default())
}

impl ChunkStream {
    /// A stream for the request `chunks.id`, fed by `rx`.
    #[must_use]
    pub fn new(
        rx: mpsc::UnboundedReceiver<Update>,
        chunks: Chunks,
        include_usage: bool,
        guard: CancelGuard,
        received: Instant,
    ) -> Self {
        Self {
            rx,
            state: DoneState::Running,
            out: VecDeque::new(),
            chunks,
            include_usage,
            guard,
            received,
            first_token: None,
            last_token: None,
            max_gap_ms: 0.0,
            sent_text: String::new(),
            sent_role: false,
            queue_ms: 0.0,
            text: false,
            reused: 0,
            conversation: None,
        }
    }

    /// Names the answer's conversation in its summary chunk.
    pub fn conversation(&mut self, c: Option<ConversationWire>) {
        self.conversation = c;
    }

    /// Sends chunks in `/v1/completions`' shape instead of a chat's.
    pub fn text_completion(&mut self, on: bool) {
        self.text = on;
    }

    /// Starts the stream by telling the client its place in the queue.
    pub fn queued(&mut self, position: usize) {
        let c = self.chunks.event(MoltEvent::Queued { position });
        self.out.push_front(data(&c));
    }

    fn push(&mut self, chunk: &ChatChunk) {
        let event = if self.text {
            sse::Event::default().data(super::completions::text_chunk(chunk).to_string())
        } else {
            data(chunk)
        };
        self.out.push_back(event);
    }

    fn role_delta(&mut self, content: String) -> Delta {
        let role = (!self.sent_role).then(|| "assistant".to_string());
        self.sent_role = true;
        Delta {
            role,
            content: Some(content),
        }
    }

    fn token_seen(&mut self) {
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
        }
        if let Some(prev) = self.last_token {
            self.max_gap_ms = self
                .max_gap_ms
                .max(now.duration_since(prev).as_secs_f64() * 1e3);
        }
        self.last_token = Some(now);
    }

    fn on_update(&mut self, u: Update) {
        match u {
            Update::Deferred {
                reason,
                budget_bytes,
                need_bytes,
            } => {
                let c = self.chunks.event(MoltEvent::Deferred {
                    reason,
                    budget_mib: mib(budget_bytes),
                    need_mib: mib(need_bytes),
                });
                self.push(&c);
            }
            Update::Admitted { queue_ms } => self.queue_ms = queue_ms,
            Update::Session(Event::Start {
                rung,
                prompt_tokens,
                reused_tokens,
            }) => {
                self.reused = reused_tokens;
                let delta = self.role_delta(String::new());
                let c = self.chunks.chunk(
                    Some(delta),
                    None,
                    Some(MoltEvent::Start {
                        rung,
                        prompt_tokens,
                        reused_tokens,
                        queue_ms: self.queue_ms,
                    }),
                );
                self.push(&c);
            }
            Update::Session(Event::Token {
                index,
                text,
                rung,
                latency_ms,
                logprobs,
                ..
            }) => {
                self.token_seen();
                self.sent_text.push_str(&text);
                let delta = self.role_delta(text);
                let mut c = self.chunks.chunk(
                    Some(delta),
                    None,
                    Some(MoltEvent::Token {
                        rung: rung.clone(),
                        index,
                        latency_ms,
                    }),
                );
                if let (Some(l), Some(choice)) = (logprobs, c.choices.first_mut()) {
                    choice.logprobs = Some(ChoiceLogprobs {
                        content: vec![TokenLogprob::new(&l, &rung)],
                    });
                }
                self.push(&c);
            }
            Update::Session(e) => {
                if let Some(m) = molt_event(&e) {
                    let c = self.chunks.event(m);
                    self.push(&c);
                }
            }
            Update::Finished(g) => self.finish(&g),
            Update::Failed(e) => self.fail(&e),
        }
    }

    fn finish(&mut self, g: &Generation) {
        // Bytes the UTF-8 stream held back until the end (an incomplete character).
        if let Some(tail) = g.text.strip_prefix(self.sent_text.as_str())
            && !tail.is_empty()
        {
            let delta = self.role_delta(tail.to_string());
            let c = self.chunks.chunk(Some(delta), None, None);
            self.push(&c);
        }
        let mut summary = SummaryWire::new(&g.summary(), self.queue_ms);
        summary.conversation = self.conversation.take();
        summary.stream = self.first_token.map(|t| StreamTiming {
            ttft_ms: t.duration_since(self.received).as_secs_f64() * 1e3,
            max_gap_ms: self.max_gap_ms,
        });
        self.guard.shared_record_finish(&summary);
        let c = self.chunks.chunk(
            Some(Delta::default()),
            Some(finish_reason(g.stop)),
            Some(MoltEvent::Summary(summary)),
        );
        self.push(&c);
        if self.include_usage {
            let mut u = self.chunks.chunk(None, None, None);
            u.choices.clear();
            u.usage = Some(Usage::new(g.prompt_tokens, g.tokens.len()).with_cached(self.reused));
            self.push(&u);
        }
        self.guard.disarm();
        self.state = DoneState::SendingDone;
    }

    fn fail(&mut self, e: &ApiError) {
        self.out.push_back(sse::Event::default().data(e.body()));
        self.guard.disarm();
        self.state = DoneState::SendingDone;
    }
}

impl CancelGuard {
    fn shared_record_finish(&self, summary: &SummaryWire) {
        if self.shared.recorder.is_on() {
            self.shared.recorder.service(
                &self.id,
                "stream_finished",
                serde_json::to_value(summary.stream).unwrap_or_default(),
            );
        }
    }
}

impl Stream for ChunkStream {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(ev) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(ev)));
            }
            match this.state {
                DoneState::Done => return Poll::Ready(None),
                DoneState::SendingDone => {
                    this.state = DoneState::Done;
                    return Poll::Ready(Some(Ok(sse::Event::default().data("[DONE]"))));
                }
                DoneState::Running => match this.rx.poll_recv(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(u)) => this.on_update(u),
                    Poll::Ready(None) => this.fail(&ApiError::internal(
                        "the engine ended this answer without a result",
                    )),
                },
            }
        }
    }
}
