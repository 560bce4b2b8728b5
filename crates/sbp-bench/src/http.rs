//! A minimal HTTP/1.1 keep-alive client: one TCP connection per worker, driven by hyper's
//! connection-level API (no pool, no per-request lookup), so the load generator stays cheap.

use std::net::SocketAddr;

use anyhow::Context;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

pub const SESSION_TOKEN: HeaderName = HeaderName::from_static("x-session-token");
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-session-id");
const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// One keep-alive HTTP/1.1 connection.
pub struct HttpConn {
    addr: SocketAddr,
    host: HeaderValue,
    sender: SendRequest<Full<Bytes>>,
    /// Sent with every request (a peer gateway's routing headers).
    extra: HeaderMap,
}

/// A fully read response.
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Response {
    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!(
                "response ({}) is not JSON: {}",
                self.status,
                snippet(&self.body)
            )
        })
    }

    /// Status and the start of the body, for error messages.
    pub fn describe(&self) -> String {
        format!("{} {}", self.status, snippet(&self.body))
    }
}

/// The first 300 bytes of a body as text.
pub fn snippet(body: &[u8]) -> String {
    let end = body.len().min(300);
    String::from_utf8_lossy(&body[..end]).into_owned()
}

impl HttpConn {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("HTTP/1.1 handshake")?;
        // The connection task ends when `sender` is dropped or the peer closes.
        tokio::spawn(conn);
        let host = HeaderValue::from_str(&addr.to_string())?;
        Ok(Self {
            addr,
            host,
            sender,
            extra: HeaderMap::new(),
        })
    }

    /// Sends `headers` with every request from now on (also after a reconnect).
    pub fn set_extra_headers(&mut self, headers: HeaderMap) {
        self.extra = headers;
    }

    /// Replaces a broken connection with a fresh one to the same address.
    pub async fn reconnect(&mut self) -> anyhow::Result<()> {
        let extra = std::mem::take(&mut self.extra);
        *self = Self::connect(self.addr).await?;
        self.extra = extra;
        Ok(())
    }

    pub async fn post(
        &mut self,
        uri: &Uri,
        token: Option<&HeaderValue>,
        body: Bytes,
    ) -> anyhow::Result<Response> {
        self.request(Method::POST, uri, token, body).await
    }

    pub async fn get(
        &mut self,
        uri: &Uri,
        token: Option<&HeaderValue>,
    ) -> anyhow::Result<Response> {
        self.request(Method::GET, uri, token, Bytes::new()).await
    }

    async fn request(
        &mut self,
        method: Method,
        uri: &Uri,
        token: Option<&HeaderValue>,
        body: Bytes,
    ) -> anyhow::Result<Response> {
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = method;
        *req.uri_mut() = uri.clone();
        let headers = req.headers_mut();
        headers.insert(HOST, self.host.clone());
        headers.insert(CONTENT_TYPE, JSON);
        if let Some(t) = token {
            headers.insert(SESSION_TOKEN, t.clone());
        }
        for (name, value) in &self.extra {
            headers.insert(name, value.clone());
        }
        self.sender.ready().await.context("connection closed")?;
        let resp = self.sender.send_request(req).await?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Response {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

/// Parses a path (always valid for the paths this crate builds).
pub fn uri(path: &str) -> anyhow::Result<Uri> {
    path.parse::<Uri>()
        .with_context(|| format!("bad request path {path}"))
}
