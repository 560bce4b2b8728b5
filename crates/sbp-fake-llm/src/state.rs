//! The fake's shared state: options and the record of received chat requests.
//!
//! The lock is held only to push or copy the record, never across an `.await`.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use http::HeaderMap;
use serde_json::Value;
use tokio::sync::Notify;

/// How the fake behaves as a whole (per-request behaviour comes from the prompt).
#[derive(Clone, Copy, Debug)]
pub struct FakeOptions {
    /// Keep every chat request's body and headers. Benchmarks turn this off so memory stays
    /// flat and no lock is taken per request.
    pub record: bool,
}

impl Default for FakeOptions {
    fn default() -> Self {
        Self { record: true }
    }
}

/// One chat request as it arrived.
#[derive(Clone, Debug)]
struct Recorded {
    body: Value,
    headers: HeaderMap,
}

/// Cheap-to-clone handle to the fake's state.
#[derive(Clone, Debug, Default)]
pub struct FakeState {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    options: FakeOptions,
    log: Mutex<Vec<Recorded>>,
    arrived: Notify,
}

impl FakeState {
    pub fn new(options: FakeOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                options,
                log: Mutex::default(),
                arrived: Notify::new(),
            }),
        }
    }

    pub fn options(&self) -> FakeOptions {
        self.inner.options
    }

    fn log(&self) -> MutexGuard<'_, Vec<Recorded>> {
        // A panic while holding the lock cannot leave a Vec half-pushed, so the data is
        // still good after poisoning.
        self.inner
            .log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a request if recording is on. Called before any scripted delay, so a test can
    /// see a request that hangs.
    pub(crate) fn record(&self, body: Value, headers: &HeaderMap) {
        if !self.inner.options.record {
            return;
        }
        let headers = headers.clone();
        self.log().push(Recorded { body, headers });
        self.inner.arrived.notify_waiters();
    }

    /// Every chat request body received so far, in arrival order.
    pub fn requests(&self) -> Vec<Value> {
        self.log().iter().map(|r| r.body.clone()).collect()
    }

    /// The headers of every chat request received so far, in the same order as
    /// [`requests`](Self::requests).
    pub fn request_headers(&self) -> Vec<HeaderMap> {
        self.log().iter().map(|r| r.headers.clone()).collect()
    }

    /// How many chat requests have been recorded.
    pub fn request_count(&self) -> usize {
        self.log().len()
    }

    /// Forgets every recorded request.
    pub fn clear(&self) {
        self.log().clear();
    }

    /// Waits until at least `n` chat requests have been recorded and returns their bodies.
    /// Never returns when recording is off and fewer have been recorded: wrap it in a timeout.
    pub async fn wait_for_requests(&self, n: usize) -> Vec<Value> {
        loop {
            let arrived = self.inner.arrived.notified();
            tokio::pin!(arrived);
            // Register before checking so a request that lands in between still wakes us.
            arrived.as_mut().enable();
            {
                let log = self.log();
                if log.len() >= n {
                    return log.iter().map(|r| r.body.clone()).collect();
                }
            }
            arrived.await;
        }
    }
}
