//! Background work of one gateway, tracked: shutdown cancels the token long-lived tasks watch and
//! waits for every task (turns persisting, CTP passes, connections) to end; past a deadline it
//! cancels a second token, which turns watch to fail at once, and stops waiting soon after.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TrackedFuture;
use tracing::Instrument as _;

#[derive(Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    stop: CancellationToken,
    abort: CancellationToken,
}

/// How long aborted tasks get to record their failure before shutdown stops waiting for them.
const ABORT_MARGIN: Duration = Duration::from_secs(3);

impl Tasks {
    /// Runs `fut` as a tracked task.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        // In the span of whoever started it (a request's, with its request id), so what the
        // task logs (an upstream failure) can be matched with the request.
        self.tracker.spawn(fut.in_current_span())
    }

    /// Runs `f` as a tracked task on the blocking pool.
    pub fn blocking<F, R>(&self, f: F) -> tokio::task::JoinHandle<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        self.tracker.spawn_blocking(f)
    }

    /// Tracks a future that already runs on its own task (e.g. an upgraded WebSocket).
    pub fn track<F: Future>(&self, fut: F) -> TrackedFuture<F> {
        self.tracker.track_future(fut)
    }

    /// Cancelled when these tasks are to stop.
    pub fn stopping(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Signals the tasks to stop and waits for all of them.
    pub async fn stop(&self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Cancelled when work in progress (a turn) is to be given up: the shutdown grace is over.
    pub fn aborting(&self) -> CancellationToken {
        self.abort.clone()
    }

    /// Gives up work in progress now (see [`Tasks::aborting`]).
    pub fn abort(&self) {
        self.abort.cancel();
    }

    /// Signals the tasks to stop and waits for them until `deadline`; then aborts the rest and
    /// waits a little more for them to record that. Returns how many tasks were still running
    /// when it gave up (0: all ended).
    pub async fn stop_by(&self, deadline: tokio::time::Instant) -> usize {
        self.stop.cancel();
        self.tracker.close();
        if tokio::time::timeout_at(deadline, self.tracker.wait())
            .await
            .is_ok()
        {
            return 0;
        }
        self.abort.cancel();
        let _ = tokio::time::timeout(ABORT_MARGIN, self.tracker.wait()).await;
        self.tracker.len()
    }
}
