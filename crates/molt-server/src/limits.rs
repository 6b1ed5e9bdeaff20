//! Request bodies, bounded before a handler sees them: a POST whose `Content-Type` is not
//! `application/json` is refused (415) without reading a byte — every route takes JSON, and a
//! browser sends a `text/plain` or form body from any page without asking first (see
//! `guard`); a `Content-Length` above the limit is refused (413) without reading a byte; and a
//! body that does not arrive in full within the read timeout is refused (408), so a client
//! that announces a large body and sends it slowly (or never) cannot hold a connection and its
//! buffer open indefinitely.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use super::error::ApiError;
use super::worker::Shared;

/// The limits, and the counters a refused chat request is counted in.
#[derive(Clone)]
struct BodyLimits {
    max_bytes: usize,
    timeout: Duration,
    shared: Arc<Shared>,
}

/// Reads every request's body under the limits before the route runs (on the routes `app`
/// has: an unknown path is a 404 whatever its body).
pub fn protect(app: Router, max_bytes: usize, timeout: Duration, shared: Arc<Shared>) -> Router {
    app.route_layer(middleware::from_fn_with_state(
        BodyLimits {
            max_bytes,
            timeout,
            shared,
        },
        read_body,
    ))
}

fn too_large(max_bytes: usize) -> ApiError {
    ApiError::with(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        format!("the request body is larger than the server's limit of {max_bytes} bytes"),
    )
}

/// The `Content-Type` of a POST that is not `application/json` (`None` when it is): what the
/// client sent, for the message.
fn not_json(headers: &HeaderMap) -> Option<String> {
    let Some(v) = headers.get(header::CONTENT_TYPE) else {
        return Some("none".into());
    };
    let text = String::from_utf8_lossy(v.as_bytes());
    let media = text.split(';').next().unwrap_or("").trim();
    if media.eq_ignore_ascii_case("application/json") {
        None
    } else {
        Some(format!("{:?}", media.chars().take(100).collect::<String>()))
    }
}

async fn read_body(State(l): State<BodyLimits>, req: Request, next: Next) -> Response {
    let chat = req.uri().path() == "/v1/chat/completions";
    let refuse = |e: ApiError| {
        // A chat request refused here never reaches its handler, which does the counting.
        if chat {
            let c = &l.shared.counters;
            c.received.fetch_add(1, Ordering::Relaxed);
            c.rejected_invalid.fetch_add(1, Ordering::Relaxed);
        }
        e.into_response()
    };
    if req.method() == Method::POST
        && let Some(got) = not_json(req.headers())
    {
        return refuse(
            ApiError::with(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!(
                    "the request body must be JSON sent with Content-Type: application/json (the request's Content-Type: {got})"
                ),
            )
            .code("unsupported_media_type"),
        );
    }
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if announced.is_some_and(|n| n > l.max_bytes as u64) {
        return refuse(too_large(l.max_bytes));
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(l.timeout, Limited::new(body, l.max_bytes).collect()).await;
    let bytes = match read {
        Err(_) => {
            return refuse(ApiError::with(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request body did not arrive within {:.0} s",
                    l.timeout.as_secs_f64()
                ),
            ));
        }
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return refuse(too_large(l.max_bytes));
        }
        Ok(Err(e)) => {
            return refuse(ApiError::invalid(format!(
                "cannot read the request body: {e}"
            )));
        }
        Ok(Ok(c)) => c.to_bytes(),
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
