//! The web page at `/`: a chat that streams through the service's own
//! `POST /v1/chat/completions`, each token coloured by the rung that produced it, each switch a
//! marker with its cost, a live chart of the budget and the resident footprint, and controls to
//! cut the budget or replay a trace.
//!
//! The page is three files compiled into the binary (`index.html`, `app.js`, `style.css` beside
//! this module) and loads nothing from anywhere else: the service is meant to run on a laptop
//! or a phone without a network, and a page that fetched a library from a CDN would break there
//! and leak that the service is in use. Its content security policy says the same to the
//! browser: scripts, styles and connections from this origin only.
//!
//! The page's routes sit outside the API key check (see [`Server::serve`](super::Server)): the
//! page holds no data and must load so that a user can type the key it then sends with every
//! API call; the API itself stays behind the key.

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const STYLE_CSS: &str = include_str!("style.css");

/// Scripts, styles, images and connections from this origin only; no inline script, no frames.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page's routes: `/` (also `/index.html`), `/app.js`, `/style.css`.
pub fn router() -> Router {
    Router::new()
        .route("/", get(index))
        .route("/index.html", get(index))
        .route("/app.js", get(app_js))
        .route("/style.css", get(style_css))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // A new binary may ship a new page: the browser asks again rather than run a stale script
    // against a changed API.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    r
}

async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing the page loads may come from another origin: no URL with a scheme (the SVG
    /// namespace, a name rather than a place, apart), no `url(…)` in the styles, no module
    /// imports, and no inline script the policy would block.
    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        const SVG_NS: &str = "http://www.w3.org/2000/svg";
        for (name, text) in [
            ("index.html", INDEX_HTML),
            ("app.js", APP_JS),
            ("style.css", STYLE_CSS),
        ] {
            let text = text.replace(SVG_NS, "");
            for needle in ["://", "url(", "import(", "@import"] {
                assert!(!text.contains(needle), "{name} contains {needle:?}");
            }
        }
        assert!(INDEX_HTML.contains(r#"<script src="app.js""#));
        assert_eq!(INDEX_HTML.matches("<script").count(), 1, "no inline script");
    }
}
