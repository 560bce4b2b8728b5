//! Background work of one gateway, tracked: shutdown cancels the token long-lived tasks watch and
//! waits for every task (turns persisting, CTP passes, connections) to end.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TrackedFuture;

#[derive(Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Tasks {
    /// Runs `fut` as a tracked task.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut)
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
}
