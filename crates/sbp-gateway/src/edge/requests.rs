//! Each request on its way from hyper to the router: the client's address for the handlers, a
//! `Content-Length` over the body limit answered 413 before any of the body is read, a deadline
//! for the whole body (408 when it passes), a share of the memory budget for bodies
//! ([`BodyBudget`], 503 when none frees in time), `/healthz` only on a connection admitted beyond
//! the caps, and the connection told when a request starts and when its response is done.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
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
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};
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
    pub bodies: Arc<BodyBudget>,
}

/// The request bodies the gateway holds in memory at once, counted in KiB. A body takes its share
/// once more than [`FREE_BODY`] of it has arrived, before the rest is read, and the request keeps
/// it until its response is ready (a body is parsed, and its messages stored and sent on, while
/// the handler runs), so many large requests at once wait for each other instead of together
/// taking memory without bound. The share is taken whole (never a part and then the rest, which
/// could leave two bodies each waiting for the other), in the order bodies asked for it. A
/// request answered without its body being read (401, 429, 413) never takes one, and a client
/// cannot hold one by declaring a length and sending nothing.
pub(crate) struct BodyBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
}

/// Bodies up to this size (every ordinary chat turn) never wait for the budget.
const FREE_BODY: u64 = 64 * 1024;

impl BodyBudget {
    pub fn new(bytes: usize) -> Arc<Self> {
        // At most what a semaphore can count (less than `u32::MAX` on 32-bit targets).
        let total_kib = u32::try_from(bytes.div_ceil(1024).clamp(1, Semaphore::MAX_PERMITS))
            .unwrap_or(u32::MAX);
        Arc::new(Self {
            kib: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
        })
    }

    /// Waits, for as long as it takes, for the share of a body of `len` bytes (all of the budget
    /// for one larger than it).
    fn acquire(&self, len: u64) -> BoxFuture<'static, Result<OwnedSemaphorePermit, AcquireError>> {
        let kib = u32::try_from(len.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .min(self.total_kib);
        Box::pin(self.kib.clone().acquire_many_owned(kib))
    }
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
        // What the body may hold: its declared length, or the body limit when it does not say
        // (chunked). Its share of the budget is taken as it arrives (`Budgeted`) and held, in
        // `lazy`, until the response is ready.
        let len = content_length(&req).unwrap_or(self.max_body as u64);
        let timed_out = Arc::new(AtomicBool::new(false));
        let lazy = Arc::new(LazyShare::default());
        let req = req.map(|body| {
            if http_body::Body::is_end_stream(&body) {
                Body::new(body)
            } else {
                let body = Budgeted {
                    inner: body,
                    read: 0,
                    len,
                    bodies: self.bodies.clone(),
                    taking: None,
                    lazy: lazy.clone(),
                };
                Body::new(Deadline::new(body, self.body_timeout, &timed_out))
            }
        });
        let resp = match self.app.clone().oneshot(req).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
        let resp = if timed_out.load(Ordering::Relaxed) && lazy.waiting.load(Ordering::Relaxed) {
            // The deadline passed while the body waited for its share.
            closing(busy(self.body_timeout))
        } else if timed_out.load(Ordering::Relaxed) {
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

/// The 503 of a body that found no room in the budget within `waited`.
fn busy(waited: Duration) -> Response<Body> {
    let mut resp = Error::Unavailable(format!(
        "the gateway is holding as many request bodies in memory as it may, and none finished \
         within {} s; retry shortly",
        waited.as_secs_f64()
    ))
    .into_response();
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
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
struct Deadline<B> {
    inner: B,
    /// `None` once the body is complete.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl<B> Deadline<B> {
    fn new(inner: B, within: Duration, timed_out: &Arc<AtomicBool>) -> Self {
        Self {
            inner,
            sleep: Some(Box::pin(tokio::time::sleep(within))),
            timed_out: timed_out.clone(),
        }
    }
}

impl<B> http_body::Body for Deadline<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
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

/// The share of a body: held from when it was taken until the response is ready.
#[derive(Default)]
struct LazyShare {
    /// Set once, by the body; the request keeps it until its response is ready.
    held: OnceLock<OwnedSemaphorePermit>,
    /// Waiting for the share: the body deadline passing now is answered 503, not 408.
    waiting: AtomicBool,
}

/// A request body counted as it arrives: once past [`FREE_BODY`] it takes its share, before any
/// more of it is read: its declared length, or the body limit when it declared none (how much
/// more will come is unknown). So a small body never waits, and the wait is bounded by the body's
/// deadline.
struct Budgeted {
    inner: Incoming,
    read: u64,
    /// What the body may hold.
    len: u64,
    bodies: Arc<BodyBudget>,
    taking: Option<BoxFuture<'static, Result<OwnedSemaphorePermit, AcquireError>>>,
    lazy: Arc<LazyShare>,
}

impl http_body::Body for Budgeted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let lazy = &this.lazy;
        if this.read > FREE_BODY && lazy.held.get().is_none() {
            let taking = this.taking.get_or_insert_with(|| {
                lazy.waiting.store(true, Ordering::Relaxed);
                this.bodies.acquire(this.len)
            });
            match taking.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                // Only this body sets it, once: the `get` above saw it empty.
                Poll::Ready(Ok(permit)) => drop(lazy.held.set(permit)),
                // The semaphore is never closed: the body ends for the handler.
                Poll::Ready(Err(_)) => return Poll::Ready(None),
            }
            this.taking = None;
            lazy.waiting.store(false, Ordering::Relaxed);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            this.read += data.len() as u64;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
