//! The legacy `POST /v1/completions` wire format: a plain prompt continued as text, with the
//! same sampling fields as a chat ([`super::openai::SamplingFields`]). The engine answers it
//! like a chat turn — same queue, same rungs, same switches — with a
//! [`Prompt::Standalone`] instead of a rendered conversation; only the wire shape differs, so
//! the chat's responses and chunks are converted here ([`text_completion`], [`text_chunk`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::openai::{
    ChatChunk, ChatCompletion, ChoiceLogprobs, MAX_TOP_LOGPROBS, MoltRequest, SamplingFields,
    StreamOptions, SummaryWire, Usage, ValidRequest, sampler_seed,
};
use molt::session::Prompt;

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// Echoed back; any value is accepted.
    #[serde(default)]
    pub model: Option<String>,
    /// The text to continue: a string, or an array holding one string.
    pub prompt: Value,
    /// Stream chunks as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Maximum generated tokens.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Sampling temperature, 0..=2 (default 0: greedy).
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
    /// Server-side best-of; only 1 is supported.
    #[serde(default)]
    pub best_of: Option<u32>,
    /// Echo the prompt; only false is supported.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Text after the insertion point; not supported.
    #[serde(default)]
    pub suffix: Option<String>,
    /// Alternatives per token with each token's log-probability, 0..=20.
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// A stop string, or up to 4.
    #[serde(default)]
    pub stop: Option<Value>,
    /// −2..=2.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// −2..=2.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's repetition penalty (an extension): > 0, 1 = off.
    #[serde(default)]
    pub repeat_penalty: Option<f32>,
    /// `{"type": "json_object"}` constrains the continuation to one JSON object (an extension:
    /// OpenAI defines it for chats only).
    #[serde(default)]
    pub response_format: Option<Value>,
    /// An end-user id; recorded, otherwise unused.
    #[serde(default)]
    pub user: Option<String>,
    /// Molt's own request options.
    #[serde(default)]
    pub molt: Option<MoltRequest>,
}

impl CompletionRequest {
    /// Checks the request; the error is a message for a 400 and the offending parameter.
    ///
    /// # Errors
    /// `(message, param)` for the first problem found.
    pub fn validate(self) -> Result<ValidRequest, (String, &'static str)> {
        let prompt = match &self.prompt {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap_or_default().to_string()
            }
            _ => {
                return Err((
                    "prompt must be a string (or an array of one string)".into(),
                    "prompt",
                ));
            }
        };
        if prompt.is_empty() {
            return Err(("prompt must not be empty".into(), "prompt"));
        }
        if prompt.contains('\0') {
            return Err(("prompt contains a NUL character".into(), "prompt"));
        }
        // A text completion belongs to no conversation: naming one (or a class or priority,
        // which are a conversation's) would be silently ignored, so it is refused.
        if let Some(m) = &self.molt
            && (m.conversation.is_some() || m.class.is_some() || m.priority.is_some())
        {
            return Err((
                "molt.conversation, molt.class and molt.priority are for chats (/v1/chat/completions): a text completion belongs to no conversation".into(),
                "molt",
            ));
        }
        for (bad, name, what) in [
            (
                self.n.is_some_and(|n| n != 1),
                "n",
                "only n = 1 is supported",
            ),
            (
                self.best_of.is_some_and(|n| n != 1),
                "best_of",
                "only best_of = 1 is supported",
            ),
            (
                self.echo == Some(true),
                "echo",
                "echo is not supported by this server",
            ),
            (
                self.suffix.as_deref().is_some_and(|s| !s.is_empty()),
                "suffix",
                "suffix is not supported by this server",
            ),
        ] {
            if bad {
                return Err((what.into(), name));
            }
        }
        let sampling = SamplingFields {
            stop: self.stop.clone(),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_penalty: self.repeat_penalty,
            response_format: self.response_format.clone(),
        }
        .validate()?;
        if self.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err((
                format!("logprobs must be in 0..={MAX_TOP_LOGPROBS}"),
                "logprobs",
            ));
        }
        let temperature = self.temperature.unwrap_or(0.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(("temperature must be in 0..=2".into(), "temperature"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(("top_p must be in (0, 1]".into(), "top_p"));
        }
        let max_tokens = match self.max_tokens {
            Some(0) => return Err(("max_tokens must be at least 1".into(), "max_tokens")),
            Some(a) => Some(usize::try_from(a).unwrap_or(usize::MAX)),
            None => None,
        };
        Ok(ValidRequest {
            history: Vec::new(),
            prompt: Prompt::Standalone(prompt),
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            max_tokens,
            temperature,
            top_p,
            seed: sampler_seed(self.seed),
            force_switch: self.molt.and_then(|m| m.force_switch).map(|f| (f.at, f.to)),
            sampling,
            logprobs: self.logprobs.map(|k| k as usize),
            user: self.user,
            conversation: super::conversations::ConversationAsk::default(),
        })
    }
}

/// Log-probabilities in the legacy shape, plus Molt's `rungs` (the rung of each token).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LegacyLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f64>,
    /// Each step's alternatives, text → log-probability.
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    /// Molt's extension: the rung of each token.
    pub rungs: Vec<String>,
}

impl From<&ChoiceLogprobs> for LegacyLogprobs {
    fn from(c: &ChoiceLogprobs) -> Self {
        let mut out = Self::default();
        for t in &c.content {
            out.tokens.push(t.token.clone());
            out.token_logprobs.push(t.logprob);
            out.top_logprobs.push(
                t.top_logprobs
                    .iter()
                    .map(|a| (a.token.clone(), Value::from(a.logprob)))
                    .collect(),
            );
            out.rungs.push(t.rung.clone());
        }
        out
    }
}

/// A non-streamed completion.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextCompletion {
    /// Request id.
    pub id: String,
    /// Always `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served ladder.
    pub model: String,
    /// One choice.
    pub choices: Vec<TextChoice>,
    /// Token counts.
    pub usage: Usage,
    /// Molt's summary of the answer.
    pub molt: SummaryWire,
}

/// A completion's choice (also a streamed chunk's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextChoice {
    /// Always 0.
    pub index: u32,
    /// The text (of this chunk, when streamed).
    pub text: String,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<LegacyLogprobs>,
    /// `stop` or `length` (null on a streamed chunk before the last).
    pub finish_reason: Option<String>,
}

/// A chat answer in the completion shape.
#[must_use]
pub fn text_completion(c: ChatCompletion) -> TextCompletion {
    TextCompletion {
        id: c.id.replacen("chatcmpl-", "cmpl-", 1),
        object: "text_completion".into(),
        created: c.created,
        model: c.model,
        choices: c
            .choices
            .into_iter()
            .map(|ch| TextChoice {
                index: ch.index,
                text: ch.message.content,
                logprobs: ch.logprobs.as_ref().map(LegacyLogprobs::from),
                finish_reason: Some(ch.finish_reason),
            })
            .collect(),
        usage: c.usage,
        molt: c.molt,
    }
}

/// A streamed chat chunk in the completion shape (same fields as a [`TextCompletion`], with
/// `usage` only on the usage chunk and `molt` events as in a chat stream).
#[must_use]
pub fn text_chunk(c: &ChatChunk) -> Value {
    let choices: Vec<TextChoice> = c
        .choices
        .iter()
        .map(|ch| TextChoice {
            index: ch.index,
            text: ch.delta.content.clone().unwrap_or_default(),
            logprobs: ch.logprobs.as_ref().map(LegacyLogprobs::from),
            finish_reason: ch.finish_reason.clone(),
        })
        .collect();
    let mut v = serde_json::json!({
        "id": c.id.replacen("chatcmpl-", "cmpl-", 1),
        "object": "text_completion",
        "created": c.created,
        "model": c.model,
        "choices": choices,
    });
    if let Some(u) = &c.usage {
        v["usage"] = serde_json::to_value(u).unwrap_or_default();
    }
    if let Some(m) = &c.molt {
        v["molt"] = serde_json::to_value(m).unwrap_or_default();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> CompletionRequest {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn a_prompt_becomes_a_standalone_prompt_and_bad_fields_are_named() {
        let r = parse(r#"{"prompt": ["fn main"], "stop": "\n", "logprobs": 2, "seed": 3}"#)
            .validate()
            .unwrap();
        assert_eq!(r.prompt, Prompt::Standalone("fn main".into()));
        assert_eq!(r.sampling.stop, vec!["\n".to_string()]);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.seed, 3);
        for (body, param) in [
            (r#"{"prompt": ""}"#, "prompt"),
            (r#"{"prompt": ["a", "b"]}"#, "prompt"),
            (r#"{"prompt": "a", "echo": true}"#, "echo"),
            (r#"{"prompt": "a", "best_of": 2}"#, "best_of"),
            (r#"{"prompt": "a", "n": 3}"#, "n"),
            (r#"{"prompt": "a", "logprobs": 21}"#, "logprobs"),
            (r#"{"prompt": "a", "stop": [1]}"#, "stop"),
        ] {
            let (_, p) = parse(body).validate().unwrap_err();
            assert_eq!(p, param, "{body}");
        }
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"prompt": "a", "x": 1}"#).is_err());
    }
}
