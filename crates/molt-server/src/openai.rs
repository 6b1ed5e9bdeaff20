//! The OpenAI chat-completions wire format, as far as Molt speaks it, plus Molt's extension.
//!
//! Requests ([`ChatRequest`]) reject unknown fields: a misspelt `max_token` must not silently
//! mean "the default". Fields OpenAI defines but Molt cannot honour (`n > 1`, tools,
//! `response_format: json_schema`) are refused with a message naming them rather than ignored.
//! The sampling fields a chat and a plain completion share (`stop`, `logprobs`, `seed`,
//! penalties, `response_format`) are checked once, by [`SamplingFields::validate`].
//!
//! Responses: [`ChatCompletion`] (non-streaming) and [`ChatChunk`] (one per SSE event). Every
//! chunk may carry a `molt` object ([`MoltEvent`]): a token chunk names the rung that produced
//! it; switches, budget changes, queueing and the final summary arrive as chunks of their own
//! whose only choice has an empty delta — so a client written for OpenAI's own streams (which
//! end with an empty-delta chunk too) reads them without special cases.

use serde::{Deserialize, Serialize};

use super::conversations::{Class, ConversationAsk};
use molt::engine::ChatMessage;
use molt::session::{Prompt, StopReason, Summary, SwitchInfo, TokenLogprobs};

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// Echoed back; any value is accepted (the server serves one ladder).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation; the last message must be the user's.
    pub messages: Vec<MessageIn>,
    /// Stream chunks as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Maximum generated tokens (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Maximum generated tokens.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature, 0..=2 (default 0: greedy, reproducible).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass, (0, 1].
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// A stop string, or up to 4.
    #[serde(default)]
    pub stop: Option<serde_json::Value>,
    /// −2..=2.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// −2..=2.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's repetition penalty (an extension): > 0, 1 = off.
    #[serde(default)]
    pub repeat_penalty: Option<f32>,
    /// `{"type": "text"}` or `{"type": "json_object"}`.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// Return each token's log-probability.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per token, 0..=20 (needs `logprobs: true`).
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// An end-user id; recorded, otherwise unused.
    #[serde(default)]
    pub user: Option<String>,
    /// Molt's own request options.
    #[serde(default)]
    pub molt: Option<MoltRequest>,
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` and no choices, as OpenAI does.
    #[serde(default)]
    pub include_usage: bool,
}

/// The `molt` object of a request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoltRequest {
    /// Switch to a named rung before generated token `at`, whatever the budget says (demos,
    /// tests and benchmarks that need a switch at a known point).
    #[serde(default)]
    pub force_switch: Option<ForceSwitch>,
    /// Continue this kept conversation (an unknown id starts a new one, and the response says
    /// so). Without it, a request continues the kept conversation its messages extend.
    #[serde(default)]
    pub conversation: Option<String>,
    /// `foreground` (default) or `background`: recorded with the conversation.
    #[serde(default)]
    pub class: Option<Class>,
    /// Priority among conversations of a class (higher first); recorded.
    #[serde(default)]
    pub priority: Option<i32>,
}

/// A forced switch.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForceSwitch {
    /// Generated-token index before which to switch.
    pub at: usize,
    /// Destination rung name.
    pub to: String,
}

/// One message of a request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageIn {
    /// `system`, `developer` (treated as system), `user` or `assistant`.
    pub role: String,
    /// Text, or an array of `{"type": "text", "text": ...}` parts.
    pub content: Content,
    /// A participant name; accepted and unused.
    #[serde(default)]
    pub name: Option<String>,
}

/// A message's content.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only text parts are supported.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// Must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: Option<String>,
}

impl Content {
    /// The text, or why the content is not plain text.
    ///
    /// # Errors
    /// A message naming the unsupported part type.
    pub fn text(&self) -> Result<String, String> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => return Err("a text part has no \"text\"".into()),
                        (k, _) => {
                            return Err(format!(
                                "content parts of type {k:?} are not supported (text only)"
                            ));
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// The sampling fields `/v1/chat/completions` and `/v1/completions` share (each request type
/// spells them out itself: serde's `flatten` would disable `deny_unknown_fields`).
#[derive(Debug, Clone, Default)]
pub struct SamplingFields {
    /// A stop string, or up to 4.
    pub stop: Option<serde_json::Value>,
    /// −2..=2: lowers a token's logit once it has appeared in the answer.
    pub presence_penalty: Option<f32>,
    /// −2..=2: lowers a token's logit by this much per appearance in the answer.
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's repetition penalty, > 0 (1 = off).
    pub repeat_penalty: Option<f32>,
    /// `{"type": "text"}` or `{"type": "json_object"}` (`json_schema` is refused).
    pub response_format: Option<serde_json::Value>,
}

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;

/// Most alternatives per token a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The shared sampling fields, checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValidSampling {
    /// Stop strings (none empty).
    pub stop: Vec<String>,
    /// Presence penalty.
    pub presence_penalty: f32,
    /// Frequency penalty.
    pub frequency_penalty: f32,
    /// Repetition penalty (1 = off).
    pub repeat_penalty: f32,
    /// Constrain the answer to one JSON object.
    pub json_object: bool,
}

impl SamplingFields {
    /// Checks the fields; the error is a message for a 400 and the offending parameter.
    ///
    /// # Errors
    /// `(message, param)` for the first problem found.
    pub fn validate(&self) -> Result<ValidSampling, (String, &'static str)> {
        use serde_json::Value;
        let stop = match &self.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => {
                if a.len() > MAX_STOPS {
                    return Err((
                        format!(
                            "stop holds {} strings; at most {MAX_STOPS} are allowed",
                            a.len()
                        ),
                        "stop",
                    ));
                }
                a.iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or((
                        "stop must be a string or an array of strings".to_string(),
                        "stop",
                    ))?
            }
            Some(_) => {
                return Err((
                    "stop must be a string or an array of strings".into(),
                    "stop",
                ));
            }
        };
        if stop.iter().any(String::is_empty) {
            return Err(("stop strings must not be empty".into(), "stop"));
        }
        for (v, name) in [
            (self.presence_penalty, "presence_penalty"),
            (self.frequency_penalty, "frequency_penalty"),
        ] {
            if v.is_some_and(|x| !(-2.0..=2.0).contains(&x)) {
                return Err((format!("{name} must be in -2..=2"), name));
            }
        }
        let repeat_penalty = self.repeat_penalty.unwrap_or(1.0);
        if !(repeat_penalty > 0.0 && repeat_penalty <= 10.0) {
            return Err(("repeat_penalty must be in (0, 10]".into(), "repeat_penalty"));
        }
        let json_object = match &self.response_format {
            None | Some(Value::Null) => false,
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => false,
                Some("json_object") => true,
                Some("json_schema") => {
                    return Err((
                        "response_format json_schema is not supported by this server; use {\"type\": \"json_object\"}".into(),
                        "response_format",
                    ));
                }
                _ => {
                    return Err((
                        "response_format.type must be \"text\" or \"json_object\"".into(),
                        "response_format",
                    ));
                }
            },
        };
        Ok(ValidSampling {
            stop,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repeat_penalty,
            json_object,
        })
    }
}

/// A request's seed as the sampler's, or a fresh random one when the client set none (as
/// OpenAI does: without a seed, two sampled answers differ).
#[must_use]
pub fn sampler_seed(seed: Option<i64>) -> u64 {
    seed.map_or_else(rand::random, |s| u64::from_ne_bytes(s.to_ne_bytes()))
}

/// A request checked and turned into what the engine needs.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// Earlier turns (everything before the last user message; empty for a completion).
    pub history: Vec<ChatMessage>,
    /// What to answer: the last user message, or a completion's prompt.
    pub prompt: Prompt,
    /// Stream as SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Maximum generated tokens, if the client set one.
    pub max_tokens: Option<usize>,
    /// Temperature (0 = greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Seed.
    pub seed: u64,
    /// Forced switch `(at, rung name)`.
    pub force_switch: Option<(usize, String)>,
    /// Stop strings, penalties, response format.
    pub sampling: ValidSampling,
    /// Alternatives per token for log-probabilities (`None`: not asked for).
    pub logprobs: Option<usize>,
    /// The client's end-user id, for the record.
    pub user: Option<String>,
    /// Which conversation it continues, and its class (`molt.conversation`, `class`,
    /// `priority`).
    pub conversation: ConversationAsk,
}

impl ChatRequest {
    /// Checks the request; the error is a message for a 400 and the offending parameter.
    ///
    /// # Errors
    /// `(message, param)` for the first problem found.
    pub fn validate(self) -> Result<ValidRequest, (String, &'static str)> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(("only n = 1 is supported".into(), "n"));
        }
        let sampling = SamplingFields {
            stop: self.stop.clone(),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_penalty: self.repeat_penalty,
            response_format: self.response_format.clone(),
        }
        .validate()?;
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (_, Some(k)) if k > MAX_TOP_LOGPROBS => {
                return Err((
                    format!("top_logprobs must be in 0..={MAX_TOP_LOGPROBS}"),
                    "top_logprobs",
                ));
            }
            (false, Some(_)) => {
                return Err(("top_logprobs needs logprobs: true".into(), "top_logprobs"));
            }
            (true, k) => Some(k.unwrap_or(0) as usize),
            (false, None) => None,
        };
        let temperature = self.temperature.unwrap_or(0.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(("temperature must be in 0..=2".into(), "temperature"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(("top_p must be in (0, 1]".into(), "top_p"));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(a), _) | (None, Some(a)) => {
                if a == 0 {
                    return Err(("max_tokens must be at least 1".into(), "max_tokens"));
                }
                Some(usize::try_from(a).unwrap_or(usize::MAX))
            }
            (None, None) => None,
        };
        if self.messages.is_empty() {
            return Err(("messages must not be empty".into(), "messages"));
        }
        let mut history = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err((
                        format!(
                            "messages[{i}].role {other:?} is not supported (system, developer, user, assistant)"
                        ),
                        "messages",
                    ));
                }
            };
            let text = m
                .content
                .text()
                .map_err(|e| (format!("messages[{i}].content: {e}"), "messages"))?;
            if text.contains('\0') {
                return Err((
                    format!("messages[{i}].content contains a NUL character"),
                    "messages",
                ));
            }
            history.push(ChatMessage::new(role, &text));
        }
        let last = history.pop().filter(|m| m.role == "user").ok_or((
            "the last message must have role \"user\"".to_string(),
            "messages",
        ))?;
        let molt = self.molt.unwrap_or_default();
        let conversation = ConversationAsk {
            id: molt.conversation,
            class: molt.class,
            priority: molt.priority,
        };
        let force_switch = molt.force_switch.map(|f| (f.at, f.to));
        Ok(ValidRequest {
            history,
            prompt: Prompt::User(last.content),
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            max_tokens,
            temperature,
            top_p,
            seed: sampler_seed(self.seed),
            force_switch,
            sampling,
            logprobs,
            user: self.user,
            conversation,
        })
    }
}

/// Token counts, as OpenAI reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// How many prompt tokens came from a kept cache (OpenAI's `cached_tokens`): the rest were
    /// read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// OpenAI's breakdown of the prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens taken from a kept cache (the engine's, or a hibernated conversation's
    /// state file) instead of being read.
    pub cached_tokens: usize,
}

impl Usage {
    /// With `cached` of the prompt tokens taken from a kept cache.
    #[must_use]
    pub fn with_cached(mut self, cached: usize) -> Self {
        self.prompt_tokens_details = Some(PromptTokensDetails {
            cached_tokens: cached,
        });
        self
    }

    /// From a prompt and completion count.
    #[must_use]
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
        }
    }
}

/// OpenAI's `finish_reason` for a stop reason.
#[must_use]
pub fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Eos | StopReason::Cancelled => "stop",
        StopReason::Length | StopReason::ContextFull => "length",
        // Never for Molt; a client of condition A sees its answer cut off.
        StopReason::Killed => "killed",
        // Memory did not come back within the park deadline; the conversation is kept.
        StopReason::ParkDeadline => "park_deadline",
    }
}

/// A switch as it travels on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchWire {
    /// Source rung.
    pub from: String,
    /// Destination rung.
    pub to: String,
    /// `molt` (KV transplant), `reprefill`, or `reprefill-no-projector` (re-read because the
    /// cache could not be carried; `note` says why).
    pub method: String,
    /// Generated-token index before which it happened.
    pub at_token: usize,
    /// Decision to the destination's first logits, ms (weight loading excluded).
    pub cost_ms: f64,
    /// Loading the destination's weights, ms.
    pub load_ms: f64,
    /// Breakdown, ms.
    pub export_ms: f64,
    /// Breakdown, ms.
    pub project_ms: f64,
    /// Breakdown, ms.
    pub import_ms: f64,
    /// Breakdown, ms.
    pub first_decode_ms: f64,
    /// Cache cells carried across.
    pub cells: usize,
    /// FLOPs the switch spent.
    pub flops: f64,
    /// FLOPs a re-prefill would have spent.
    pub flops_reprefill: f64,
    /// `flops_reprefill − flops`.
    pub flops_avoided: f64,
    /// `1 − flops / flops_reprefill`.
    pub flops_avoided_fraction: f64,
    /// Memory pressure at the decision, 0..1.
    pub pressure: f64,
    /// Budget at the decision, MiB (absent for a forced switch).
    pub budget_mib: Option<f64>,
    /// Handoff divergence (JSD, nats), when measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_jsd: Option<f64>,
    /// Why the switch went as it did, when it did not go the usual way (a re-read in place of
    /// a carry, an anchor not used …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Bytes as MiB for the wire (`None` for the "unlimited" sentinel and for 0).
#[must_use]
pub fn mib(bytes: u64) -> Option<f64> {
    #[allow(clippy::cast_precision_loss)]
    (bytes > 0 && bytes < super::budget::UNLIMITED_BYTES).then(|| bytes as f64 / f64::from(1 << 20))
}

impl From<&SwitchInfo> for SwitchWire {
    fn from(s: &SwitchInfo) -> Self {
        Self {
            from: s.from.clone(),
            to: s.to.clone(),
            method: s.method.to_string(),
            at_token: s.at_token,
            cost_ms: s.timings.cost_ms,
            load_ms: s.timings.load_ms,
            export_ms: s.timings.export_ms,
            project_ms: s.timings.project_ms,
            import_ms: s.timings.import_ms,
            first_decode_ms: s.timings.first_decode_ms,
            cells: s.timings.cells,
            flops: s.timings.flops,
            flops_reprefill: s.flops_reprefill,
            flops_avoided: (s.flops_reprefill - s.timings.flops).max(0.0),
            flops_avoided_fraction: s.flops_avoided(),
            pressure: s.pressure,
            budget_mib: mib(s.budget_bytes),
            handoff_jsd: s.handoff_jsd,
            note: s.note.clone(),
        }
    }
}

/// The end-of-answer summary on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryWire {
    /// Generated tokens.
    pub tokens: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Rungs in order of use.
    pub rungs_used: Vec<String>,
    /// Number of migrations.
    pub migrations: usize,
    /// Sum of their costs, ms.
    pub migration_cost_ms: f64,
    /// Each migration.
    pub switches: Vec<SwitchWire>,
    /// Time to first token measured by the engine (from the start of the answer), ms.
    pub ttft_ms: f64,
    /// Whole answer, ms (engine).
    pub total_ms: f64,
    /// Time spent queued before the engine took the request, ms.
    pub queue_ms: f64,
    /// Why it ended.
    pub stop: StopReason,
    /// Whether the answer was lost (always false for Molt).
    pub killed: bool,
    /// Latencies measured where the stream is written (request received → first token
    /// chunk, and the largest gap between two token chunks), ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamTiming>,
    /// The conversation this answer continued or started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<ConversationWire>,
}

/// The conversation an answer belongs to, on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationWire {
    /// Its id (send it back as `molt.conversation` to continue it explicitly).
    pub id: String,
    /// True when this request started it.
    pub new: bool,
    /// Why a new one was started for the id the request named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Latencies measured at the HTTP stream.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StreamTiming {
    /// Request received → first token chunk handed to the connection, ms.
    pub ttft_ms: f64,
    /// Largest gap between two token chunks, ms.
    pub max_gap_ms: f64,
}

impl SummaryWire {
    /// From the session's summary.
    #[must_use]
    pub fn new(s: &Summary, queue_ms: f64) -> Self {
        let switches: Vec<SwitchWire> = s.switches.iter().map(SwitchWire::from).collect();
        Self {
            tokens: s.tokens,
            prompt_tokens: s.prompt_tokens,
            rungs_used: s.rungs_used.clone(),
            migrations: switches.len(),
            // An empty f64 sum is -0.0; adding 0.0 makes it the 0 a reader expects.
            migration_cost_ms: switches.iter().map(|w| w.cost_ms).sum::<f64>() + 0.0,
            switches,
            ttft_ms: s.ttft_ms,
            total_ms: s.total_ms,
            queue_ms,
            stop: s.stop,
            killed: s.killed,
            stream: None,
            conversation: None,
        }
    }
}

/// Molt's extension object on a chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum MoltEvent {
    /// The request waits behind others for the engine.
    Queued {
        /// 1 = next.
        position: usize,
    },
    /// The engine has the request but memory is short: admission is deferred until the
    /// budget holds the smallest rung for this request.
    Deferred {
        /// Why.
        reason: String,
        /// Budget now, MiB.
        budget_mib: Option<f64>,
        /// What the smallest rung needs for this request, MiB.
        need_mib: Option<f64>,
    },
    /// The prompt has been read; generation starts.
    Start {
        /// Rung that read the prompt.
        rung: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Of which were already cached.
        reused_tokens: usize,
        /// Time spent queued, ms.
        queue_ms: f64,
    },
    /// A token chunk: the rung that produced it.
    Token {
        /// The rung.
        rung: String,
        /// Index in the answer.
        index: usize,
        /// Time since the previous token, ms (engine).
        latency_ms: f64,
    },
    /// The budget changed.
    Budget {
        /// New budget, MiB (`None`: unlimited).
        budget_mib: Option<f64>,
        /// Pressure, 0..1.
        pressure: f64,
        /// Where it came from.
        source: String,
    },
    /// The answer moved to another rung between two tokens.
    Switch(SwitchWire),
    /// Generation waits: no rung fits the budget.
    Stall {
        /// Why.
        reason: String,
        /// How long the answer may stay parked before it ends with finish_reason
        /// `park_deadline`, ms.
        #[serde(skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
    },
    /// A pressure lever other than a switch (park, resume, shed) acted on the answer.
    Lever(molt::session::LeverInfo),
    /// The end-of-answer summary.
    Summary(SummaryWire),
}

/// One streamed chunk.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatChunk {
    /// Request id, the same in every chunk.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served ladder.
    pub model: String,
    /// Zero or one choice.
    pub choices: Vec<ChunkChoice>,
    /// Token counts (the usage chunk only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Molt's extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub molt: Option<MoltEvent>,
}

/// A choice's log-probabilities, in OpenAI's shape.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChoiceLogprobs {
    /// One entry per generated token.
    pub content: Vec<TokenLogprob>,
}

/// One token's log-probability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token's text (lossy UTF-8: a token may hold part of a character).
    pub token: String,
    /// Natural log of its probability under the rung that produced it.
    pub logprob: f64,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this step.
    pub top_logprobs: Vec<TopLogprob>,
    /// Molt's extension: the rung that produced the token.
    pub rung: String,
}

/// An alternative at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// Its text.
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f64,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

impl TokenLogprob {
    /// From the session's record of one token.
    #[must_use]
    pub fn new(l: &TokenLogprobs, rung: &str) -> Self {
        Self {
            token: String::from_utf8_lossy(&l.bytes).into_owned(),
            logprob: l.logprob,
            bytes: l.bytes.clone(),
            top_logprobs: l
                .top
                .iter()
                .map(|(_, b, lp)| TopLogprob {
                    token: String::from_utf8_lossy(b).into_owned(),
                    logprob: *lp,
                    bytes: b.clone(),
                })
                .collect(),
            rung: rung.to_string(),
        }
    }
}

/// A chunk's choice.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// What this chunk adds.
    pub delta: Delta,
    /// The log-probabilities of this chunk's token, when asked for.
    pub logprobs: Option<ChoiceLogprobs>,
    /// Set on the last content chunk.
    pub finish_reason: Option<String>,
}

/// What a chunk adds to the message.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Delta {
    /// `assistant`, on the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A non-streamed answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatCompletion {
    /// Request id.
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served ladder.
    pub model: String,
    /// One choice.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
    /// Molt's summary of the answer (rungs, migrations and their costs).
    pub molt: SummaryWire,
}

/// A non-streamed choice.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Choice {
    /// Always 0.
    pub index: u32,
    /// The answer.
    pub message: MessageOut,
    /// Each token's log-probabilities, when asked for.
    pub logprobs: Option<ChoiceLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: String,
}

/// The answer message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessageOut {
    /// Always `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ChatRequest, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn unknown_fields_are_refused_at_every_level() {
        let e = parse(r#"{"messages": [], "max_token": 3}"#).unwrap_err();
        assert!(e.to_string().contains("max_token"), "{e}");
        let e =
            parse(r#"{"messages": [{"role": "user", "content": "x", "colour": 1}]}"#).unwrap_err();
        assert!(e.to_string().contains("colour") || e.is_data(), "{e}");
        let e = parse(r#"{"messages": [], "molt": {"forced": 1}}"#).unwrap_err();
        assert!(e.to_string().contains("forced"), "{e}");
    }

    #[test]
    fn validation_splits_history_from_the_last_user_turn() {
        let r = parse(
            r#"{"model": "m", "messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_tokens": 7, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(r.history, vec![ChatMessage::new("system", "be brief")]);
        assert_eq!(r.prompt, Prompt::User("hi".into()));
        assert_eq!(r.max_tokens, Some(7));
        assert!(r.stream && r.include_usage);
    }

    #[test]
    fn unsupported_parameters_are_named() {
        for (body, param) in [
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#,
                "n",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}"#,
                "stop",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "stop": ""}"#,
                "stop",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}"#,
                "presence_penalty",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {}}}"#,
                "response_format",
            ),
            (
                r#"{"messages": [{"role": "assistant", "content": "x"}]}"#,
                "messages",
            ),
            (r#"{"messages": []}"#, "messages"),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#,
                "max_tokens",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "temperature": 3}"#,
                "temperature",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "text": "u"}]}]}"#,
                "messages",
            ),
        ] {
            let (_, p) = parse(body).unwrap().validate().unwrap_err();
            assert_eq!(p, param, "{body}");
        }
    }

    #[test]
    fn chunk_serialises_like_openai() {
        let c = ChatChunk {
            id: "x".into(),
            object: "chat.completion.chunk".into(),
            created: 1,
            model: "m".into(),
            choices: vec![ChunkChoice {
                index: 0,
                delta: Delta {
                    role: None,
                    content: Some("hi".into()),
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
            molt: Some(MoltEvent::Token {
                rung: "tier0".into(),
                index: 0,
                latency_ms: 1.0,
            }),
        };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], serde_json::Value::Null);
        assert_eq!(v["choices"][0]["delta"]["content"], "hi");
        assert_eq!(v["molt"]["rung"], "tier0");
        assert_eq!(v["molt"]["event"], "token");
        assert!(v.get("usage").is_none());
    }
}
