//! Who may drive the service from a web browser: the `Host` and `Origin` checks.
//!
//! The service is meant to be left running on a laptop, bound to loopback without a key. A
//! browser is then the one program on the machine that acts for someone else: any page the
//! user visits can send requests to `127.0.0.1:PORT`. Two holes follow, both closed here
//! (`docs/server-security.md` says why these rules and not others):
//!
//! - **Cross-site requests.** A page on another site may send a POST without asking first (a
//!   "simple" request: a `text/plain` or form body), and a GET whose answer it cannot read.
//!   Every browser request that a page's script makes carries `Origin`, and modern browsers
//!   send `Sec-Fetch-Site` on every request: an API request whose `Origin` is not the
//!   service's own, or that the browser marks as coming from another site, is refused with a
//!   403 before it is read ([`origins`]). The service sends no CORS headers, so no other origin
//!   is ever allowed to read an answer either. A POST body that is not `application/json` is a
//!   415 (`limits`), which also keeps form and `text/plain` bodies out.
//! - **DNS rebinding.** A page on `evil.example` whose name is re-pointed at `127.0.0.1` is,
//!   to the browser, same-origin with the service: it can send anything and read every answer.
//!   Its requests still say `Host: evil.example:PORT`. Without a key, a request whose `Host`
//!   is not a loopback name or address, nor the address the service is bound to, on the
//!   service's port, is refused with a 403 ([`hosts`]) — the web page included. With a key the
//!   check is off: a rebound page has no key, and a reverse proxy in front of a keyed service
//!   may send any `Host`. `--allow-host NAME` adds names (a proxy in front of an open service).
//!
//! A request with no `Host` (HTTP/1.0) passes the host check: browsers always send one, and
//! what is refused here is what a browser can be made to send. A refusal is a 403 in OpenAI's
//! error shape, `code` `host_not_allowed` or `origin_not_allowed`, its message naming what was
//! refused and why.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// Which `Host` values the service answers.
#[derive(Debug, Clone)]
pub struct HostPolicy {
    /// The address the service is bound to (its port is the one a `Host` must name).
    pub bound: SocketAddr,
    /// Further names, answered on any port (`--allow-host`), lower-case.
    pub extra: Vec<String>,
}

impl HostPolicy {
    /// A policy for a service bound to `bound`, with `extra` names allowed as well.
    #[must_use]
    pub fn new(bound: SocketAddr, extra: &[String]) -> Self {
        Self {
            bound,
            extra: extra
                .iter()
                .map(|h| h.trim().trim_end_matches('.').to_ascii_lowercase())
                .filter(|h| !h.is_empty())
                .collect(),
        }
    }

    /// Whether a `Host` header value (`name[:port]`, `[v6]:port`) names this service.
    #[must_use]
    pub fn allows(&self, host: &str) -> bool {
        let Some((name, port)) = split_authority(host) else {
            return false;
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if self.extra.contains(&name) {
            return true;
        }
        // Without a port the client connected to the scheme's default, 80 for plain HTTP.
        if port.unwrap_or(80) != self.bound.port() {
            return false;
        }
        if name == "localhost" || name.ends_with(".localhost") {
            // RFC 6761: browsers resolve these to loopback themselves, whatever DNS says.
            return true;
        }
        match name.parse::<IpAddr>() {
            Ok(ip) => {
                let ip = ip.to_canonical();
                ip.is_loopback()
                    || ip == self.bound.ip().to_canonical()
                    // Bound to every address: any address the connection could have reached.
                    // An address is never a rebound name, so it cannot be an attacker's page.
                    || self.bound.ip().is_unspecified()
            }
            Err(_) => false,
        }
    }
}

/// `name` and optional port of a `Host` value or of an origin's authority; `None` when it is
/// not one (empty, a bad port, a user part).
fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
    let a = authority.trim();
    if a.is_empty() || a.contains(['@', '/', ' ', '?', '#']) {
        return None;
    }
    let (name, port) = if let Some(rest) = a.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        match after {
            "" => (v6, None),
            p => (v6, Some(p.strip_prefix(':')?)),
        }
    } else {
        match a.rsplit_once(':') {
            // A bare IPv6 address has colons but no brackets: not a valid Host.
            Some((n, _)) if n.contains(':') => return None,
            Some((n, p)) => (n, Some(p)),
            None => (a, None),
        }
    };
    if name.is_empty() {
        return None;
    }
    let port = match port {
        None => None,
        Some(p) => Some(p.parse::<u16>().ok()?),
    };
    Some((name, port))
}

/// Refuses, on every route of `app` (the web page's too), a request whose `Host` the policy
/// does not allow.
pub fn hosts(app: Router, policy: HostPolicy) -> Router {
    app.layer(middleware::from_fn_with_state(Arc::new(policy), check_host))
}

async fn check_host(State(policy): State<Arc<HostPolicy>>, req: Request, next: Next) -> Response {
    // The header, and the authority of an absolute-form target (`GET http://name/ …`).
    let named = req
        .headers()
        .get(header::HOST)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .into_iter()
        .chain(req.uri().authority().map(ToString::to_string));
    for h in named {
        if !policy.allows(&h) {
            return refused_host(&h, &policy).into_response();
        }
    }
    next.run(req).await
}

fn refused_host(host: &str, policy: &HostPolicy) -> ApiError {
    ApiError::with(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        format!(
            "the Host {:?} is not this server's address: with no API key it answers only \
             localhost, loopback addresses and the address it listens on ({}), port {}, so that \
             a web page cannot reach it through DNS rebinding; use one of those, or start it \
             with --allow-host NAME or an API key",
            clip(host),
            policy.bound.ip(),
            policy.bound.port()
        ),
    )
    .code("host_not_allowed")
}

/// Refuses, on every route of `app` (the API, not the web page's own files), a request that a
/// browser sent from another origin: an `Origin` that is not the service's own (`null`
/// included), or `Sec-Fetch-Site` other than `same-origin` or `none`.
pub fn origins(app: Router) -> Router {
    app.layer(middleware::from_fn(check_origin))
}

async fn check_origin(req: Request, next: Next) -> Response {
    match foreign_origin(req.headers()) {
        Some(why) => ApiError::with(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!(
                "{why}: this server answers its API only to its own web page and to programs \
                 that are not browsers, so that a page on another site cannot use it"
            ),
        )
        .code("origin_not_allowed")
        .into_response(),
        None => next.run(req).await,
    }
}

/// Why a request comes from a page of another origin, if it does.
fn foreign_origin(headers: &HeaderMap) -> Option<String> {
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
        let host = headers
            .get(header::HOST)
            .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
        if !same_origin(&origin, host.as_deref()) {
            return Some(format!(
                "the request comes from a page of another origin ({:?})",
                clip(&origin)
            ));
        }
    }
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = String::from_utf8_lossy(site.as_bytes()).to_ascii_lowercase();
        if site != "same-origin" && site != "none" {
            return Some(format!(
                "the browser says the request comes from another site (Sec-Fetch-Site: {:?})",
                clip(&site)
            ));
        }
    }
    None
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a page served under `host` (the
/// request's `Host`): the same name and the same port, a missing port being the scheme's
/// default on both sides.
fn same_origin(origin: &str, host: Option<&str>) -> bool {
    let Some(host) = host else {
        return false;
    };
    let Some((scheme, authority)) = origin.trim().split_once("://") else {
        return false;
    };
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => 80,
        "https" => 443,
        _ => return false,
    };
    let (Some((oname, oport)), Some((hname, hport))) =
        (split_authority(authority), split_authority(host))
    else {
        return false;
    };
    let norm = |n: &str| n.trim_end_matches('.').to_ascii_lowercase();
    norm(oname) == norm(hname) && oport.unwrap_or(default) == hport.unwrap_or(default)
}

/// At most 200 characters of a client's header, for a message.
fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(bound: &str) -> HostPolicy {
        HostPolicy::new(bound.parse().unwrap(), &["proxy.example".to_string()])
    }

    #[test]
    fn loopback_names_and_the_bound_address_on_its_port_are_allowed() {
        let p = policy("127.0.0.1:8088");
        for ok in [
            "127.0.0.1:8088",
            "localhost:8088",
            "LOCALHOST:8088",
            "localhost.:8088",
            "app.localhost:8088",
            "127.0.0.2:8088",
            "[::1]:8088",
            "[::ffff:127.0.0.1]:8088",
            "proxy.example",
            "proxy.example:443",
        ] {
            assert!(p.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:8088",
            "evil.example",
            "127.0.0.1:8089",
            "localhost",
            "localhost.evil.example:8088",
            "10.0.0.5:8088",
            "::1:8088",
            "127.0.0.1:notaport",
            "user@127.0.0.1:8088",
            "",
        ] {
            assert!(!p.allows(bad), "{bad}");
        }
        let lan = policy("192.168.1.7:80");
        assert!(lan.allows("192.168.1.7"));
        assert!(!lan.allows("192.168.1.8"));
        let any = policy("0.0.0.0:8088");
        assert!(any.allows("192.168.1.8:8088"));
        assert!(!any.allows("evil.example:8088"));
    }

    #[test]
    fn only_the_page_s_own_origin_is_same_origin() {
        assert!(same_origin("http://127.0.0.1:8088", Some("127.0.0.1:8088")));
        assert!(same_origin("http://LocalHost:8088", Some("localhost:8088")));
        assert!(same_origin("http://example.com", Some("example.com:80")));
        assert!(same_origin("https://example.com", Some("example.com")));
        assert!(!same_origin("http://evil.example", Some("127.0.0.1:8088")));
        assert!(!same_origin(
            "http://localhost:3000",
            Some("localhost:8088")
        ));
        assert!(!same_origin("null", Some("127.0.0.1:8088")));
        assert!(!same_origin("file://", Some("127.0.0.1:8088")));
        assert!(!same_origin("http://127.0.0.1:8088", None));
    }

    #[test]
    fn sec_fetch_site_marks_cross_site_requests() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:8088".parse().unwrap());
        assert!(foreign_origin(&h).is_none());
        h.insert("sec-fetch-site", "same-origin".parse().unwrap());
        assert!(foreign_origin(&h).is_none());
        h.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert!(foreign_origin(&h).is_some());
        h.insert("sec-fetch-site", "same-site".parse().unwrap());
        assert!(foreign_origin(&h).is_some());
        h.remove("sec-fetch-site");
        h.insert(header::ORIGIN, "http://127.0.0.1:8088".parse().unwrap());
        assert!(foreign_origin(&h).is_none());
        h.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(foreign_origin(&h).unwrap().contains("evil.example"));
    }
}
