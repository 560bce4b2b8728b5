//! Strict mode (`--strict-sbp`, SPEC 6.1): a request with neither `sbp` nor a session token is
//! proxied to the upstream as it is, and nothing is stored.

use futures::StreamExt;
use sbp_protocol::ChatRequest;
use tokio::sync::mpsc;

use super::{ChatOutcome, SseEvent, Turns};
use crate::error::Error;

impl Turns {
    pub(super) async fn passthrough(
        &self,
        request: ChatRequest,
        stream: bool,
    ) -> Result<ChatOutcome, Error> {
        if !stream {
            let body = self
                .inner
                .provider
                .complete_bytes(request)
                .await
                .map_err(Error::Upstream)?;
            return Ok(ChatOutcome::Proxied(body));
        }
        let mut upstream = self
            .inner
            .provider
            .stream(request)
            .await
            .map_err(Error::Upstream)?;
        let (tx, mut events) = mpsc::channel(256);
        self.inner.tasks.spawn(async move {
            while let Some(item) = upstream.next().await {
                let ev = match item {
                    Ok(chunk) => SseEvent::Data(chunk),
                    Err(e) => {
                        let _ = tx.send(SseEvent::Failed(Error::Upstream(e))).await;
                        return;
                    }
                };
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(SseEvent::Done).await;
        });
        let first = events.recv().await.unwrap_or(SseEvent::Done);
        if let SseEvent::Failed(err) = first {
            return Err(err);
        }
        Ok(ChatOutcome::Stream {
            session: None,
            first,
            events,
        })
    }
}
