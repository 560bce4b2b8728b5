//! Each request on its way from hyper to the router: the client's address for the handlers, a
//! `Content-Length` over the body limit answered 413 before any of the body is read, a deadline
//! for the whole body (408 when it passes), `/healthz` only on a connection admitted beyond the
//! caps, and the connection told when a request starts and when its response is done.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use futures::future::BoxFuture;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use tower::ServiceExt as _;

use super::conn::Conn;
use crate::error::Error;

/// The hyper service of one connection.
#[derive(Clone)]
pub(crate) struct EdgeService {
    pub app: Router,
    pub conn: Arc<Conn>,
    pub max_body: usize,
    pub body_timeout: Duration,
}

impl hyper::service::Service<Request<Incoming>> for EdgeService {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let this = self.clone();
        let started = Started::new(this.conn.clone());
        // A WebSocket over HTTP/2 is an extended CONNECT answered 200, not an upgrade.
        let connect = req.method() == Method::CONNECT;
        Box::pin(async move {
            let resp = this.respond(req).await;
            let status = resp.status();
            if status == StatusCode::SWITCHING_PROTOCOLS || (connect && status.is_success()) {
                this.conn.upgraded();
            }
            Ok(resp.map(|body| Tracked {
                body,
                _started: started,
            }))
        })
    }
}

impl EdgeService {
    async fn respond(&self, mut req: Request<Incoming>) -> Response<Body> {
        req.extensions_mut().insert(ConnectInfo(self.conn.peer));
        if self.conn.health_only && !is_health_check(&req) {
            return closing(
                Error::Unavailable("the gateway is at its connection limit; retry shortly".into())
                    .into_response(),
            );
        }
        if let Some(declared) = content_length(&req)
            && declared > self.max_body as u64
        {
            // Answered without reading the body (nor sending `100 Continue`): the connection
            // is closed after it, since the unread body cannot be told from the next request.
            return closing(
                Error::TooLarge(format!(
                    "request body of {declared} bytes is over the limit of {} bytes",
                    self.max_body
                ))
                .into_response(),
            );
        }
        let timed_out = Arc::new(AtomicBool::new(false));
        let req = req.map(|body| {
            if http_body::Body::is_end_stream(&body) {
                Body::new(body)
            } else {
                Body::new(Deadline {
                    inner: body,
                    sleep: Some(Box::pin(tokio::time::sleep(self.body_timeout))),
                    timed_out: timed_out.clone(),
                })
            }
        });
        let resp = match self.app.clone().oneshot(req).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
        let resp = if timed_out.load(Ordering::Relaxed) {
            closing(
                Error::RequestTimeout(format!(
                    "the request body did not arrive within {} s",
                    self.body_timeout.as_secs_f64()
                ))
                .into_response(),
            )
        } else {
            resp
        };
        if self.conn.health_only {
            closing(resp)
        } else {
            resp
        }
    }
}

fn is_health_check(req: &Request<Incoming>) -> bool {
    req.uri().path() == "/healthz" && matches!(*req.method(), Method::GET | Method::HEAD)
}

fn content_length(req: &Request<Incoming>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `resp` with the connection closed after it.
fn closing(mut resp: Response<Body>) -> Response<Body> {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// A request being served: the connection is busy until the value is dropped, with its response
/// body (sent, or given up) or with the request's future (cancelled).
struct Started(Arc<Conn>);

impl Started {
    fn new(conn: Arc<Conn>) -> Self {
        conn.request_started();
        Self(conn)
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that keeps its request counted until it is sent.
pub(crate) struct Tracked {
    body: Body,
    _started: Started,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The body did not arrive within its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
struct BodyTimeout;

/// A request body with a deadline for all of it: an inactivity timeout would never fire on a body
/// trickled a byte at a time.
struct Deadline {
    inner: Incoming,
    /// `None` once the body is complete.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(sleep) = self.sleep.as_mut()
            && sleep.as_mut().poll(cx).is_ready()
        {
            self.sleep = None;
            self.timed_out.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(Box::new(BodyTimeout))));
        }
        if self.timed_out.load(Ordering::Relaxed) {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.sleep = None;
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
