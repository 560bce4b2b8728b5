//! Request bodies of the REST endpoints parsed into the engine's inputs, at the edge: each field
//! checked (type, length, range) with an error naming it, and the names other clients use
//! accepted beside ours.

use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::engine::roaming::{
    ExportRequest, ForkRequest, HandoffRequest, ImportRequest, MAX_AGENT_ID_CHARS,
    MAX_HANDOFF_MESSAGE_CHARS, MAX_LABEL_CHARS, MAX_REASON_CHARS, MIN_EXPORT_TTL_SECS,
};
use crate::engine::tools::{BackendToolCall, MAX_BACKEND_TIMEOUT_MS};
use crate::error::Error;
use sbp_protocol::token;

/// A string of at most `max` characters, or none.
fn optional_text(
    body: &Map<String, Value>,
    key: &str,
    max: usize,
) -> Result<Option<String>, Error> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.chars().count() <= max => Ok(Some(s.clone())),
        Some(_) => Err(Error::invalid(format!(
            "`{key}` must be a string of at most {max} characters"
        ))),
    }
}

fn check_agent_id(key: &str, s: &str) -> Result<(), Error> {
    if s.is_empty() || s.chars().count() > MAX_AGENT_ID_CHARS {
        return Err(Error::invalid(format!(
            "`{key}` must be a string of 1 to {MAX_AGENT_ID_CHARS} characters"
        )));
    }
    Ok(())
}

/// The optional `label` of an export or fork.
pub fn optional_label(body: &Map<String, Value>) -> Result<Option<String>, Error> {
    optional_text(body, "label", MAX_LABEL_CHARS)
}

impl ExportRequest {
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, Error> {
        let ttl_seconds = match body.get("ttl_seconds") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(n) if (MIN_EXPORT_TTL_SECS..=token::MAX_TOKEN_TTL_SECS).contains(&n) => {
                    Some(n)
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "`ttl_seconds` must be an integer in [{MIN_EXPORT_TTL_SECS}, {}]",
                        token::MAX_TOKEN_TTL_SECS
                    )));
                }
            },
        };
        let include_bundle = match body.get("include_bundle") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(Error::invalid("`include_bundle` must be a boolean")),
        };
        Ok(Self {
            ttl_seconds,
            label: optional_label(body)?,
            include_bundle,
        })
    }
}

impl ImportRequest {
    /// Takes the body by value: a raw bundle can be megabytes, and is moved rather than copied.
    pub fn from_body(mut body: Map<String, Value>) -> Result<Self, Error> {
        let roaming_token = match body.get("roaming_token").or_else(|| body.get("token")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.trim().to_owned()),
            Some(_) => return Err(Error::invalid("`roaming_token` must be a string")),
        };
        let bundle = match body.remove("bundle") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v),
            Some(_) => return Err(Error::invalid("`bundle` must be an object")),
        };
        if roaming_token.is_none() && bundle.is_none() {
            return Err(Error::invalid(
                "send a `roaming_token`, a raw `bundle`, or both",
            ));
        }
        let target_agent_id = match body.get("target_agent_id").or_else(|| body.get("agent_id")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                check_agent_id("target_agent_id", s)?;
                Some(s.clone())
            }
            Some(_) => return Err(Error::invalid("`target_agent_id` must be a string")),
        };
        let allow_reuse = match body.get("allow_reuse") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(Error::invalid("`allow_reuse` must be a boolean")),
        };
        Ok(Self {
            roaming_token,
            bundle,
            target_agent_id,
            allow_reuse,
        })
    }
}

/// An import by CID (`{"bundle_cid": "...", "from": "<peer url>"?}`, federation): a body naming
/// a `bundle_cid` and neither a token nor a bundle.
pub struct CidImport {
    pub bundle_cid: String,
    pub from: Option<String>,
    pub target_agent_id: Option<String>,
}

impl CidImport {
    pub fn from_body(body: &Map<String, Value>) -> Result<Option<Self>, Error> {
        let present = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
        if !present("bundle_cid")
            || present("roaming_token")
            || present("token")
            || present("bundle")
        {
            return Ok(None);
        }
        let bundle_cid = match body.get("bundle_cid") {
            Some(Value::String(s)) if crate::engine::federation::is_cid(s) => s.clone(),
            Some(Value::String(s)) => {
                return Err(
                    crate::error::FedError::InvalidCid(s.chars().take(80).collect()).into(),
                );
            }
            _ => return Err(Error::invalid("`bundle_cid` must be a string")),
        };
        let from = match body.get("from") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.len() <= 2048 => Some(s.trim().to_owned()),
            Some(_) => return Err(Error::invalid("`from` must be a peer's URL")),
        };
        let target_agent_id = match body.get("target_agent_id").or_else(|| body.get("agent_id")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                check_agent_id("target_agent_id", s)?;
                Some(s.clone())
            }
            Some(_) => return Err(Error::invalid("`target_agent_id` must be a string")),
        };
        Ok(Some(Self {
            bundle_cid,
            from,
            target_agent_id,
        }))
    }
}

impl ForkRequest {
    /// `label`, and `keep_last` (an integer >= 1).
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, Error> {
        let keep_last = match body.get("keep_last") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => Some(n),
                _ => {
                    return Err(Error::InvalidField {
                        param: "keep_last".to_owned(),
                        message: "`keep_last` must be an integer >= 1".to_owned(),
                    });
                }
            },
        };
        Ok(Self {
            label: optional_label(body)?,
            keep_last,
        })
    }
}

impl HandoffRequest {
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, Error> {
        let to_agent_id = match body
            .get("to_agent_id")
            .or_else(|| body.get("target_agent_id"))
        {
            Some(Value::String(s)) => {
                check_agent_id("to_agent_id", s)?;
                s.clone()
            }
            _ => {
                return Err(Error::invalid("`to_agent_id` (a string) is required"));
            }
        };
        Ok(Self {
            to_agent_id,
            handoff_message: optional_text(body, "handoff_message", MAX_HANDOFF_MESSAGE_CHARS)?,
            reason: optional_text(body, "reason", MAX_REASON_CHARS)?,
        })
    }
}

impl BackendToolCall {
    /// Accepts `tool_name` (or `name` / `tool`), `tool_input` (or `arguments` / `input`, default
    /// `{}`) and `timeout_ms` (1 to 300,000).
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, Error> {
        let tool_name = ["tool_name", "name", "tool"]
            .iter()
            .find_map(|k| body.get(*k))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| Error::invalid("`tool_name` (a non-empty string) is required"))?
            .to_owned();
        let tool_input = ["tool_input", "arguments", "input"]
            .iter()
            .find_map(|k| body.get(*k))
            .cloned()
            .filter(|v| !v.is_null())
            .unwrap_or_else(|| json!({}));
        let timeout = match body.get("timeout_ms") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(ms @ 1..=MAX_BACKEND_TIMEOUT_MS) => Some(Duration::from_millis(ms)),
                _ => {
                    return Err(Error::invalid(format!(
                        "`timeout_ms` must be an integer from 1 to {MAX_BACKEND_TIMEOUT_MS}"
                    )));
                }
            },
        };
        Ok(Self {
            tool_name,
            tool_input,
            timeout,
        })
    }
}
