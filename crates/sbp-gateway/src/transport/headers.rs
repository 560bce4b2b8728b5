//! The headers responses carry besides their bodies: the session a request ran in (its id, its
//! agent, and its token when the request created it).

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sbp_store::SessionRecord;
use serde::Serialize;

use crate::error::TurnSession;

/// A new session's 201: its body, with the session's id, agent and token in headers as well.
pub fn created(body: &impl Serialize, session: &SessionRecord, token: &str) -> Response {
    let mut resp = (StatusCode::CREATED, axum::Json(body)).into_response();
    let session = TurnSession {
        id: session.id,
        agent_id: session.agent_id.clone(),
        new_token: Some(token.to_owned()),
    };
    add_headers(resp.headers_mut(), &session_headers(&session));
    resp
}

/// The headers naming the session a turn ran in (and its token, when the turn created it).
pub fn session_headers(s: &TurnSession) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("x-session-id", s.id.to_string()),
        ("x-agent-id", s.agent_id.clone()),
    ];
    if let Some(t) = &s.new_token {
        h.push(("x-session-token", t.clone()));
    }
    h
}

pub fn add_headers(map: &mut HeaderMap, headers: &[(&'static str, String)]) {
    for (name, value) in headers {
        if let Ok(v) = HeaderValue::from_str(value) {
            map.insert(HeaderName::from_static(name), v);
        }
    }
}
