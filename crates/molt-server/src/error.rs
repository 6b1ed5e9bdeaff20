//! Errors of the service: [`ServerError`] for starting and running it, [`ApiError`] for what a
//! client is told — always JSON, `{"error": {"message", "type", "code", "param"}}`, the shape
//! OpenAI clients parse — with an HTTP status, or as an in-band SSE event once a stream has
//! started.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use molt::session::SessionError;

/// Why the service could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding the listening socket failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// A non-loopback address without a key (and without `insecure_no_auth`).
    #[error(
        "refusing to listen on {addr} without an API key: anyone who can reach it could use the engine; give --api-key-file (or --api-key), or --insecure-no-auth to serve it open"
    )]
    InsecureBind {
        /// The address.
        addr: std::net::SocketAddr,
    },
    /// Serving failed.
    #[error("serving: {0}")]
    Serve(std::io::Error),
    /// The engine could not be started (a rung failed to load).
    #[error("starting the engine: {0}")]
    Engine(#[from] SessionError),
    /// The engine thread ended before it was ready.
    #[error("the engine thread ended while starting")]
    EngineGone,
    /// The prompt tokenizer could not be loaded.
    #[error("loading the tokenizer: {0}")]
    Tokenizer(molt::engine::EngineError),
    /// The record file could not be written.
    #[error("record file {path}: {source}")]
    Record {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The state directory cannot be used.
    #[error(transparent)]
    StateDir(#[from] molt::state::StateDirError),
    /// The initial budget setting is invalid.
    #[error("budget: {0}")]
    Budget(String),
}

/// An error as a client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status (for in-band stream errors: the status it would have had).
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, or Molt's
    /// `queue_full` / `insufficient_memory`.
    pub kind: &'static str,
    /// A machine-readable code, e.g. `context_length_exceeded`.
    pub code: Option<&'static str>,
    /// What went wrong, for a person.
    pub message: String,
    /// The request parameter at fault.
    pub param: Option<String>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: Option<&'a str>,
    param: Option<&'a str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            message: message.into(),
            param: None,
        }
    }

    /// Sets the parameter at fault.
    #[must_use]
    pub fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// Sets the code.
    #[must_use]
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Another status and type.
    pub fn with(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            code: None,
            message: message.into(),
            param: None,
        }
    }

    /// A 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    #[must_use]
    pub fn body(&self) -> String {
        serde_json::to_string(&Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                code: self.code,
                param: self.param.as_deref(),
            },
        })
        .unwrap_or_else(|_| {
            r#"{"error":{"message":"unserialisable error","type":"server_error"}}"#.into()
        })
    }

    /// The body as a JSON value (for the record).
    #[must_use]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body()).unwrap_or(serde_json::Value::Null)
    }

    /// The error as the client of a request for `prompt` sees it: a text completion's prompt
    /// is its `prompt` field, where a chat's is `messages`.
    #[must_use]
    pub fn for_prompt(mut self, prompt: &molt::session::Prompt) -> Self {
        if matches!(prompt, molt::session::Prompt::Standalone(_))
            && self.param.as_deref() == Some("messages")
        {
            self.param = Some("prompt".into());
        }
        self
    }

    /// How the engine's error looks to a client.
    #[must_use]
    pub fn from_session(e: &SessionError) -> Self {
        match e {
            SessionError::PromptTooLong { .. } => Self::invalid(e.to_string())
                .code("context_length_exceeded")
                .param("messages"),
            SessionError::BudgetBelowSmallest { .. } => Self::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "insufficient_memory",
                e.to_string(),
            ),
            SessionError::UnknownRung(_) => Self::invalid(e.to_string()).param("molt"),
            _ => Self::internal(e.to_string()),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.kind, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            self.body(),
        )
            .into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}
