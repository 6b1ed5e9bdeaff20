//! Bearer-key authentication, as OpenAI clients send it: `Authorization: Bearer KEY`.
//!
//! One key per service ([`ApiKey`]), checked on every API route before the handler runs (the
//! web page's own files are served without it, so a user can load the page and type the key
//! its calls then send). The check compares SHA-256 digests of the two keys byte by byte
//! without stopping at the first difference, so neither the time it takes nor its outcome
//! tells a client how much of a guess was right, or how long the key is. The scheme's case
//! does not matter (`bearer KEY` is taken as `Bearer KEY`: HTTP authentication schemes are
//! case-insensitive, RFC 9110 §11.1); the key's does. A refusal is a 401 in OpenAI's error shape with
//! `WWW-Authenticate: Bearer`, so OpenAI client libraries report it as an authentication
//! error.

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::error::ApiError;

/// The service's key, kept only as its digest.
#[derive(Clone)]
pub struct ApiKey {
    digest: [u8; 32],
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

impl ApiKey {
    /// A key. Surrounding whitespace (a key file's final newline) is not part of it.
    ///
    /// # Errors
    /// An empty key, or one with characters a header cannot carry.
    pub fn new(key: &str) -> Result<Self, String> {
        let key = key.trim();
        if key.is_empty() {
            return Err("the API key is empty".into());
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the API key must be printable ASCII without spaces".into());
        }
        Ok(Self {
            digest: Sha256::digest(key.as_bytes()).into(),
        })
    }

    /// True when `presented` is the key, in time that does not depend on where they differ.
    #[must_use]
    pub fn matches(&self, presented: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(presented).into();
        d.iter()
            .zip(&self.digest)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// Wraps every route of `app` with the key check.
pub fn protect(app: Router, key: ApiKey) -> Router {
    app.layer(middleware::from_fn_with_state(key, check))
}

async fn check(State(key): State<ApiKey>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()));
    match presented {
        Some(k) if key.matches(k) => next.run(req).await,
        Some(_) => unauthorized("Incorrect API key provided."),
        None => unauthorized(
            "You didn't provide an API key. Send it as an HTTP header: Authorization: Bearer KEY.",
        ),
    }
}

/// The token of an `Authorization: Bearer TOKEN` value (scheme case-insensitive).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    Some(rest.trim_ascii())
}

fn unauthorized(message: &str) -> Response {
    let mut r = ApiError::with(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        .code("invalid_api_key")
        .into_response();
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_matches_only_itself() {
        let k = ApiKey::new("sk-local-123\n").unwrap();
        assert!(k.matches(b"sk-local-123"));
        assert!(!k.matches(b"sk-local-12"));
        assert!(!k.matches(b"sk-local-1234"));
        assert!(!k.matches(b""));
        assert!(ApiKey::new("  ").is_err());
        assert!(ApiKey::new("a b").is_err());
    }

    #[test]
    fn bearer_tokens_are_read_from_the_header() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bear"), None);
    }
}
