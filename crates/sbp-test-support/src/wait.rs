//! Polling for state that changes without telling the test (a session's status, a metric, a
//! process going away): never a fixed sleep, always a bounded wait for the condition.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often a condition is checked again.
const POLL: Duration = Duration::from_millis(20);

/// Calls `check` until it answers `Ok`, for at most `within`; after that, the last `Err` (what
/// the state was, for the failure message).
pub async fn poll_until_ok<T, E, F, Fut>(within: Duration, mut check: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        let last = match check().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `check` until it gives a value, for at most `within`; fails the test naming `what`
/// otherwise.
pub async fn eventually<T, F, Fut>(within: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll_until_ok(within, || {
        let next = check();
        async move { next.await.ok_or(()) }
    })
    .await
    .unwrap_or_else(|()| panic!("{what}: not within {within:?}"))
}

/// Fetches a state with `fetch` until `done` holds of it, for at most `within`; returns that
/// state. Fails the test naming `what` and showing the last state otherwise.
pub async fn wait_until<T, F, Fut>(
    within: Duration,
    what: &str,
    mut fetch: F,
    done: impl Fn(&T) -> bool,
) -> T
where
    T: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    let done = &done;
    poll_until_ok(within, || {
        let next = fetch();
        async move {
            let state = next.await;
            if done(&state) { Ok(state) } else { Err(state) }
        }
    })
    .await
    .unwrap_or_else(|last| panic!("timed out waiting for {what}: {last:?}"))
}
