//! What a request must be before it is routed: its path decodes to UTF-8, its `Host` is one of
//! this gateway's names (against DNS rebinding) and a browser's `Origin`, when sent, is this
//! gateway's own (against cross-site requests and cross-site WebSocket hijacking).
//!
//! Accepted hosts: `localhost` and `*.localhost` (browsers resolve them to loopback themselves),
//! any IP literal (DNS rebinding needs a name the attacker controls; a browser sends an IP only to
//! the server at that IP), and the host of every `--public-url`; any port, since a proxy or a port
//! forward changes it and rebinding is about the name. A gateway bound to a non-loopback address
//! with no `--public-url` accepts any host (it cannot know the names it is reached by) and says so
//! at start.
//!
//! An `Origin` is accepted when it is the request's own origin (same host, same port), one of
//! the `--public-url` origins (a proxy may rewrite `Host`), or a web app's origin given with
//! `--cors-origin` (`cors.rs` answers its preflights). `null` and every other origin are refused,
//! on every route including the WebSocket upgrade. A request a browser marks
//! `Sec-Fetch-Site: cross-site` without an `Origin` (an `<img>`, a `<script>` of another site) is
//! refused too, unless it is a plain navigation (a link to the page): it could only probe, but
//! refused here it never counts against the rate limits of the user's own address. `/healthz` is
//! exempt from all of it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::Response;
use sbp_protocol::ErrorCode;

use super::errors;
use crate::config::{GatewayConfig, PublicUrl};

pub struct Policy {
    /// `None`: any host is accepted.
    hosts: Option<Vec<String>>,
    public: Vec<PublicUrl>,
    /// Web apps' origins allowed by `--cors-origin`.
    cors: Vec<PublicUrl>,
}

impl Policy {
    pub fn new(config: &GatewayConfig, bound: SocketAddr) -> Self {
        let public = config.public_urls.clone();
        let hosts = if public.is_empty() && !bound.ip().is_loopback() {
            tracing::warn!(
                %bound,
                "listening on a non-loopback address without --public-url: any Host header is \
                 accepted, which leaves browsers on this network open to DNS rebinding; give the \
                 URL clients use with --public-url"
            );
            None
        } else {
            Some(public.iter().map(|u| u.host.clone()).collect())
        };
        Self {
            hosts,
            public,
            cors: config.cors_origins.clone(),
        }
    }

    fn host_allowed(&self, host: &str) -> bool {
        host == "localhost"
            || host.ends_with(".localhost")
            || is_ip_literal(host)
            || self
                .hosts
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| n == host))
    }

    /// `host` is the request's (already accepted) authority, when it named one.
    fn origin_allowed(&self, origin: &str, host: Option<&Target>) -> bool {
        let Ok(origin) = origin.parse::<PublicUrl>() else {
            return false;
        };
        let same_origin = host.is_some_and(|h| {
            h.host == origin.host
                && match h.port {
                    Some(port) => origin.effective_port() == port,
                    // No port in `Host`: the scheme's default one, whichever the scheme was.
                    None => origin.port.is_none(),
                }
        });
        same_origin
            || self
                .public
                .iter()
                .chain(&self.cors)
                .any(|p| p.same_origin(&origin))
    }
}

/// A request's target authority, normalised.
struct Target {
    host: String,
    port: Option<u16>,
}

fn target(req: &Request) -> Result<Option<Target>, String> {
    let authority = match req.uri().authority() {
        Some(a) => a.clone(),
        None => match req.headers().get(header::HOST) {
            None => return Ok(None),
            Some(v) => v
                .to_str()
                .ok()
                .and_then(|s| s.parse::<Authority>().ok())
                .filter(|a| !a.as_str().contains('@'))
                .ok_or_else(|| "the Host header is not a valid host".to_owned())?,
        },
    };
    Ok(Some(Target {
        host: authority.host().trim_end_matches('.').to_ascii_lowercase(),
        port: authority.port_u16(),
    }))
}

fn is_ip_literal(host: &str) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse::<IpAddr>().is_ok()
}

/// Whether `path`, percent-decoded, is UTF-8 (what axum's `Path` needs of each segment).
fn path_is_utf8(path: &str) -> bool {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                decoded.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    std::str::from_utf8(&decoded).is_ok()
}

/// Fetch Metadata (sent by current browsers): the request comes from a page of another site.
fn is_cross_site(headers: &HeaderMap) -> bool {
    headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
}

/// A browser following a link or typing the URL: a `GET` of a top-level page.
fn is_navigation(req: &Request) -> bool {
    let header_is = |name: &str, value: &[u8]| {
        req.headers()
            .get(name)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(value))
    };
    req.method() == axum::http::Method::GET
        && header_is("sec-fetch-mode", b"navigate")
        && !header_is("sec-fetch-dest", b"iframe")
}

fn origin(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or(""))
}

pub async fn enforce(State(policy): State<Arc<Policy>>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    if !path_is_utf8(req.uri().path()) {
        return errors::routing(
            ErrorCode::BadRequest,
            "the request path is not valid UTF-8 once percent-decoded",
        );
    }
    let target = match target(&req) {
        Ok(t) => t,
        Err(message) => return errors::routing(ErrorCode::BadRequest, &message),
    };
    if let Some(t) = &target
        && !policy.host_allowed(&t.host)
    {
        tracing::debug!(host = %t.host, "request for a host that is not this gateway's refused");
        return errors::routing(
            ErrorCode::Forbidden,
            &format!(
                "'{}' is not a name of this gateway (add it with --public-url)",
                t.host
            ),
        );
    }
    match origin(req.headers()) {
        Some(origin) if !policy.origin_allowed(origin, target.as_ref()) => {
            tracing::debug!(origin, "cross-origin request refused");
            return errors::routing(
                ErrorCode::Forbidden,
                "cross-origin requests are refused (list the page's origin with --public-url, or a \
                 web app's with --cors-origin)",
            );
        }
        None if is_cross_site(req.headers()) && !is_navigation(&req) => {
            return errors::routing(ErrorCode::Forbidden, "cross-site requests are refused");
        }
        _ => {}
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(bound: &str, public: &[&str]) -> Policy {
        let config = GatewayConfig {
            public_urls: public
                .iter()
                .map(|u| u.parse().expect("public url"))
                .collect(),
            ..GatewayConfig::default()
        };
        Policy::new(&config, bound.parse().expect("addr"))
    }

    fn t(host: &str, port: Option<u16>) -> Target {
        Target {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn hosts_of_a_loopback_gateway() {
        let p = policy("127.0.0.1:8080", &["https://gw.example.com"]);
        for ok in [
            "localhost",
            "app.localhost",
            "127.0.0.1",
            "10.1.2.3",
            "[::1]",
            "gw.example.com",
        ] {
            assert!(p.host_allowed(ok), "{ok}");
        }
        for refused in [
            "evil.example",
            "gw.example.com.evil",
            "localhost.evil",
            "example.com",
        ] {
            assert!(!p.host_allowed(refused), "{refused}");
        }
    }

    #[test]
    fn a_public_bind_without_names_accepts_any_host_but_names_close_it() {
        assert!(policy("0.0.0.0:8080", &[]).host_allowed("anything.example"));
        assert!(!policy("0.0.0.0:8080", &["http://gw.lan"]).host_allowed("anything.example"));
        assert!(!policy("[::1]:8080", &[]).host_allowed("anything.example"));
    }

    #[test]
    fn origins_must_be_the_request_s_own_or_public() {
        let p = policy("127.0.0.1:8080", &["https://gw.example.com"]);
        let local = t("127.0.0.1", Some(8080));
        assert!(p.origin_allowed("http://127.0.0.1:8080", Some(&local)));
        assert!(!p.origin_allowed("http://127.0.0.1:9999", Some(&local)));
        assert!(!p.origin_allowed("http://localhost:8080", Some(&local)));
        assert!(!p.origin_allowed("https://evil.example", Some(&local)));
        assert!(!p.origin_allowed("null", Some(&local)));
        assert!(!p.origin_allowed("", Some(&local)));
        assert!(!p.origin_allowed("http://127.0.0.1:8080", None));
        // Behind a proxy that keeps the Host: no port means the scheme's default.
        let proxied = t("gw.example.com", None);
        assert!(p.origin_allowed("https://gw.example.com", Some(&proxied)));
        assert!(!p.origin_allowed("https://gw.example.com:8443", Some(&proxied)));
        // A proxy that rewrites the Host: the public origin still passes.
        assert!(p.origin_allowed("https://gw.example.com", Some(&local)));
        assert!(p.origin_allowed("https://gw.example.com:443", Some(&local)));
        assert!(!p.origin_allowed("http://gw.example.com", Some(&local)));
    }

    #[test]
    fn cors_origins_pass_and_others_stay_refused() {
        let config = GatewayConfig {
            cors_origins: ["https://app.example.com", "http://localhost:5173"]
                .iter()
                .map(|o| PublicUrl::parse_origin(o).expect("origin"))
                .collect(),
            ..GatewayConfig::default()
        };
        let p = Policy::new(&config, "127.0.0.1:8080".parse().expect("addr"));
        let local = t("127.0.0.1", Some(8080));
        for ok in [
            "https://app.example.com",
            "https://app.example.com:443",
            "http://localhost:5173",
        ] {
            assert!(p.origin_allowed(ok, Some(&local)), "{ok}");
        }
        for refused in [
            "http://app.example.com",
            "https://app.example.com:8443",
            "https://evil.example.com",
            "http://localhost:5174",
            "null",
        ] {
            assert!(!p.origin_allowed(refused, Some(&local)), "{refused}");
        }
    }

    #[test]
    fn percent_decoded_paths_must_be_utf8() {
        assert!(path_is_utf8("/v1/sessions/abc"));
        assert!(path_is_utf8("/v1/sessions/%C3%A9t%C3%A9"));
        assert!(path_is_utf8("/v1/sessions/100%"));
        assert!(path_is_utf8("/v1/sessions/%zz"));
        assert!(!path_is_utf8("/v1/sessions/%FF"));
        assert!(!path_is_utf8("/v1/sessions/%C3"));
    }
}
