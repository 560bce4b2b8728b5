//! The session lifecycle beyond a session's own routes: listing sessions page by page (newest
//! first, by agent or status) and deleting one with everything that holds its content.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use sbp_protocol::SessionStatus;
use sbp_store::{SessionQuery, SessionRecord, StoreError};
use uuid::Uuid;

use super::{Caller, Sessions};
use crate::error::Error;

/// Sessions in a page when the caller names no `limit`.
pub const DEFAULT_PAGE: u32 = 20;
/// The largest `limit` accepted.
pub const MAX_PAGE: u32 = 100;
/// Longest `agent_id` a filter may name (as long as a session's may be).
const MAX_AGENT_ID_CHARS: usize = 256;
/// Longest cursor accepted; the ones this gateway hands out are about 60 characters.
const MAX_CURSOR: usize = 128;

/// What `GET /v1/sessions` asks for, as the caller sent it ([`Sessions::list`] checks it).
#[derive(Debug, Clone, Default)]
pub struct ListRequest {
    pub agent_id: Option<String>,
    pub status: Option<SessionStatus>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
    pub limit: Option<u32>,
}

/// One page of sessions, newest first.
#[derive(Debug, Clone)]
pub struct SessionPage {
    pub sessions: Vec<SessionRecord>,
    /// Where the next page starts, when there is one.
    pub next_cursor: Option<String>,
}

fn field(param: &str, message: &str) -> Error {
    Error::InvalidField {
        param: param.to_owned(),
        message: message.to_owned(),
    }
}

/// The cursor after `s`: its position in the order, `(created_at, id)`, as URL-safe base64 of
/// `<microseconds since the epoch>.<id>`. Opaque to callers; a keyset position, so a page is the
/// same whatever was created or deleted before it.
fn cursor_after(s: &SessionRecord) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}.{}", s.created_at.timestamp_micros(), s.id))
}

/// The position a cursor names; `None` when it is not one this gateway hands out.
fn position(cursor: &str) -> Option<(DateTime<Utc>, Uuid)> {
    if cursor.len() > MAX_CURSOR {
        return None;
    }
    let raw = URL_SAFE_NO_PAD.decode(cursor).ok()?;
    let text = std::str::from_utf8(&raw).ok()?;
    let (micros, id) = text.split_once('.')?;
    let at = DateTime::from_timestamp_micros(micros.parse().ok()?)?;
    Some((at, sbp_protocol::id::parse_canonical(id)?))
}

impl Sessions {
    /// `GET /v1/sessions`: a page of the sessions stored here, newest first. With operator API
    /// keys configured only an operator may list; a gateway without keys lists to anyone (the
    /// page carries no content: no metadata, no task).
    pub async fn list(&self, caller: &Caller, req: ListRequest) -> Result<SessionPage, Error> {
        if !self.inner.config.api_keys.is_empty() && !caller.operator {
            return Err(Error::Unauthorized(
                "listing sessions needs an operator API key (Authorization: Bearer <key>)".into(),
            ));
        }
        let limit = match req.limit {
            None => DEFAULT_PAGE,
            Some(n) if (1..=MAX_PAGE).contains(&n) => n,
            Some(_) => return Err(field("limit", "`limit` must be 1 to 100")),
        };
        if let Some(agent) = &req.agent_id
            && (agent.is_empty() || agent.chars().count() > MAX_AGENT_ID_CHARS)
        {
            return Err(field(
                "agent_id",
                "`agent_id` must be a string of 1 to 256 characters",
            ));
        }
        let after = match &req.cursor {
            None => None,
            Some(c) => Some(position(c).ok_or_else(|| {
                field(
                    "cursor",
                    "`cursor` must be the `next_cursor` of an earlier page",
                )
            })?),
        };
        // One more than asked tells whether another page follows.
        let mut sessions = self
            .inner
            .store
            .list_sessions(SessionQuery {
                agent_id: req.agent_id,
                status: req.status,
                after,
                limit: limit + 1,
            })
            .await?;
        let more = sessions.len() > limit as usize;
        sessions.truncate(limit as usize);
        let next_cursor = if more {
            sessions.last().map(cursor_after)
        } else {
            None
        };
        Ok(SessionPage {
            sessions,
            next_cursor,
        })
    }

    /// `DELETE /v1/sessions/{id}` (authorised by the caller): erases the session with everything
    /// that holds its content (the store's `delete_session`), then closes its surface wherever it
    /// is attached (4004) and forgets its token here. Under the session's locks, so an attach
    /// racing the deletion either comes before it (and is closed) or finds no session. A turn of
    /// the session still running finds no session when it writes again and fails.
    pub async fn delete(&self, session: &SessionRecord) -> Result<(), Error> {
        let id = session.id;
        let erase = async {
            let erased = self.inner.store.delete_session(id, Utc::now()).await;
            if erased.is_ok() {
                self.inner.replicas.close_deleted(id).await;
            }
            erased
        };
        let erased = self.inner.replicas.locked(id, erase).await.map_err(|e| {
            tracing::warn!(session_id = %id, error = %e, "deleting a session: the replica bus's lock failed");
            Error::Unavailable("the replica bus is unreachable; try again".into())
        })?;
        self.inner.tokens.forget(id);
        self.inner.history.erased(id);
        match erased {
            Ok(()) => {
                tracing::info!(session_id = %id, "session deleted");
                Ok(())
            }
            // Deleted by a request that came first.
            Err(StoreError::NotFound) => Err(Error::session_not_found(id)),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(created_at: DateTime<Utc>) -> SessionRecord {
        SessionRecord {
            id: Uuid::now_v7(),
            agent_id: "a".into(),
            token_hash: String::new(),
            status: SessionStatus::Idle,
            step_count: 0,
            message_count: 0,
            message_bytes: 0,
            last_task: None,
            model: None,
            tether_enabled: false,
            created_at,
            updated_at: created_at,
            metadata: json!({}),
        }
    }

    #[test]
    fn cursors_name_their_position_and_nothing_else_reads_as_one() {
        let at = DateTime::parse_from_rfc3339("2025-03-04T05:06:07.123456Z")
            .expect("literal")
            .with_timezone(&Utc);
        let s = record(at);
        let c = cursor_after(&s);
        assert!(c.len() <= MAX_CURSOR, "{c}");
        assert_eq!(position(&c), Some((at, s.id)));
        let early = record(DateTime::from_timestamp_micros(-5).expect("before 1970"));
        assert_eq!(
            position(&cursor_after(&early)),
            Some((early.created_at, early.id))
        );
        let upper = URL_SAFE_NO_PAD.encode(format!("1.{}", s.id.to_string().to_uppercase()));
        for bad in [
            "",
            "not base64!",
            &URL_SAFE_NO_PAD.encode("12345"),
            &URL_SAFE_NO_PAD.encode(format!("x.{}", s.id)),
            &URL_SAFE_NO_PAD.encode("1.not-a-uuid"),
            &upper,
            &"A".repeat(MAX_CURSOR + 4),
        ] {
            assert_eq!(position(bad), None, "{bad}");
        }
    }
}
