//! The HTTP client gateways talk to each other with: https only (plain http to loopback, or with
//! `--federation-allow-http`), redirects never followed, every answer read under a byte cap, every
//! call bounded in time.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Map, Value};

/// The largest manifest read.
pub const MAX_MANIFEST_BYTES: usize = 64 << 10;
/// The largest tracker answer read.
pub const MAX_REGISTRY_BYTES: usize = 1 << 20;
/// How long one call to a peer may take, unless the caller's deadline is sooner.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a call to a peer gave no usable answer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PeerError {
    /// The URL is not one this node may call (plain http off loopback, credentials, a query).
    #[error("refusing to call {0}")]
    Refused(String),
    #[error("{url} is unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url} answered more than {cap} bytes")]
    TooLarge { url: String, cap: usize },
    #[error("{url} did not answer JSON: {reason}")]
    NotJson { url: String, reason: String },
}

/// An answer: its status and body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
    pub retry_after: Option<u64>,
}

impl Answer {
    /// The body as a JSON object.
    pub fn object(&self, url: &str) -> Result<Map<String, Value>, PeerError> {
        match serde_json::from_slice::<Value>(&self.body) {
            Ok(Value::Object(map)) => Ok(map),
            Ok(_) => Err(PeerError::NotJson {
                url: url.to_owned(),
                reason: "not an object".into(),
            }),
            Err(e) => Err(PeerError::NotJson {
                url: url.to_owned(),
                reason: e.to_string(),
            }),
        }
    }
}

#[derive(Clone)]
pub struct PeerClient {
    http: reqwest::Client,
    allow_http: bool,
}

impl PeerClient {
    /// The client; an error only when the TLS stack cannot start (no fallback: a default client
    /// would follow redirects and wait for ever).
    pub fn new(allow_http: bool) -> Result<Self, PeerError> {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(3))
            .timeout(CALL_TIMEOUT)
            .user_agent(concat!("sbp-federation/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| PeerError::Refused(format!("the federation HTTP client: {e}")))?;
        Ok(Self { http, allow_http })
    }

    /// Whether this node may call `url`: https, or http to a loopback address (or anywhere with
    /// `--federation-allow-http`); no credentials in it.
    pub fn check_url(&self, url: &str) -> Result<reqwest::Url, PeerError> {
        let refused = || PeerError::Refused(url.to_owned());
        let parsed = reqwest::Url::parse(url).map_err(|_| refused())?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(refused());
        }
        match parsed.scheme() {
            "https" => Ok(parsed),
            "http" if self.allow_http || is_loopback(&parsed) => Ok(parsed),
            _ => Err(refused()),
        }
    }

    /// `GET url` with an optional bearer token; the body read up to `cap` bytes.
    pub async fn get(
        &self,
        url: &str,
        bearer: Option<&str>,
        cap: usize,
    ) -> Result<Answer, PeerError> {
        self.get_within(url, bearer, cap, CALL_TIMEOUT).await
    }

    /// [`PeerClient::get`] allowed `timeout` (a large bundle within an attach's deadline).
    pub async fn get_within(
        &self,
        url: &str,
        bearer: Option<&str>,
        cap: usize,
        timeout: Duration,
    ) -> Result<Answer, PeerError> {
        let parsed = self.check_url(url)?;
        let mut req = self
            .http
            .get(parsed)
            .timeout(timeout)
            .header("accept", "application/json");
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
        }
        self.send(url, req, cap).await
    }

    /// `POST url` with a JSON body and an optional bearer token.
    pub async fn post(
        &self,
        url: &str,
        bearer: Option<&str>,
        body: &Value,
        cap: usize,
    ) -> Result<Answer, PeerError> {
        self.post_within(url, bearer, body, cap, CALL_TIMEOUT).await
    }

    /// [`PeerClient::post`] allowed `timeout`.
    pub async fn post_within(
        &self,
        url: &str,
        bearer: Option<&str>,
        body: &Value,
        cap: usize,
        timeout: Duration,
    ) -> Result<Answer, PeerError> {
        let parsed = self.check_url(url)?;
        let mut req = self
            .http
            .post(parsed)
            .timeout(timeout)
            .header("accept", "application/json")
            .json(body);
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
        }
        self.send(url, req, cap).await
    }

    async fn send(
        &self,
        url: &str,
        req: reqwest::RequestBuilder,
        cap: usize,
    ) -> Result<Answer, PeerError> {
        let unreachable = |e: reqwest::Error| PeerError::Unreachable {
            url: url.to_owned(),
            reason: e.to_string(),
        };
        let resp = req.send().await.map_err(unreachable)?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        if resp.content_length().is_some_and(|n| n > cap as u64) {
            return Err(PeerError::TooLarge {
                url: url.to_owned(),
                cap,
            });
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(unreachable)?;
            if body.len() + chunk.len() > cap {
                return Err(PeerError::TooLarge {
                    url: url.to_owned(),
                    cap,
                });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Answer {
            status,
            body,
            retry_after,
        })
    }

    /// The manifest at `base` (`GET base/.well-known/sbp`), as a JSON object (not yet verified).
    pub async fn manifest(&self, base: &str) -> Result<Map<String, Value>, PeerError> {
        let url = format!("{}/.well-known/sbp", base.trim_end_matches('/'));
        let answer = self.get(&url, None, MAX_MANIFEST_BYTES).await?;
        if answer.status != 200 {
            return Err(PeerError::Unreachable {
                url,
                reason: format!("HTTP {}", answer.status),
            });
        }
        answer.object(&url)
    }
}

fn is_loopback(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The origin (`scheme://host[:port]`) of a URL.
pub fn origin(url: &reqwest::Url) -> String {
    url.origin().ascii_serialization()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_anywhere_http_only_to_loopback_unless_allowed() {
        let strict = PeerClient::new(false).expect("client");
        assert!(strict.check_url("https://peer.example/x").is_ok());
        assert!(strict.check_url("http://127.0.0.1:9/x").is_ok());
        assert!(strict.check_url("http://[::1]:9/x").is_ok());
        assert!(strict.check_url("http://localhost:9/x").is_ok());
        assert!(strict.check_url("http://10.0.0.5/x").is_err());
        assert!(strict.check_url("http://peer.example/x").is_err());
        assert!(strict.check_url("ftp://peer.example/x").is_err());
        assert!(strict.check_url("https://user:pw@peer.example/x").is_err());
        let lax = PeerClient::new(true).expect("client");
        assert!(lax.check_url("http://10.0.0.5/x").is_ok());
    }
}
