//! The `sbp` namespace of `/v1/chat/completions` (SPEC 6.1 request, 6.2/6.3 response).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Request options. Beyond SPEC 6.1 it accepts `session_id`, `session_token` and `resume`, which the
/// spec's resume flow (6.3) and the reference clients send inside the namespace.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SbpRequestOptions {
    #[serde(default)]
    pub force_new_session: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_retrieval: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token: Option<String>,
    #[serde(default)]
    pub resume: bool,
    /// Resume a suspended session instead of answering 202 (or, for a caller without an `sbp`
    /// object, an error): an extension, also set by the header `X-SBP-Auto-Resume: true`.
    #[serde(default)]
    pub auto_resume: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl SbpRequestOptions {
    /// Parses the namespace; `null` is the same as absent. Errors name the offending field.
    pub fn from_value(v: &Value) -> Result<Option<Self>, String> {
        if v.is_null() {
            return Ok(None);
        }
        if !v.is_object() {
            return Err("`sbp` must be an object".into());
        }
        let opts: Self = serde_json::from_value(v.clone()).map_err(|e| format!("`sbp`: {e}"))?;
        if opts.checkpoint_every == Some(0) {
            return Err("`sbp.checkpoint_every` must be an integer >= 1".into());
        }
        Ok(Some(opts))
    }
}

/// The `sbp` block of a completion response: SPEC 6.2's fields plus `agent_id`, `status` and, for a
/// session created by this request, `session_token`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SbpResponseMeta {
    pub session_id: String,
    #[serde(default)]
    pub snapshot_id: Option<String>,
    #[serde(default)]
    pub resume_available: bool,
    #[serde(default)]
    pub resume_prompt: Option<String>,
    #[serde(default)]
    pub last_checkpoint: Option<String>,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_routed_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn null_is_absent_and_bad_shapes_are_errors() {
        assert_eq!(SbpRequestOptions::from_value(&Value::Null), Ok(None));
        assert!(SbpRequestOptions::from_value(&json!("yes")).is_err());
        assert!(SbpRequestOptions::from_value(&json!({"force_new_session": "yes"})).is_err());
        assert!(SbpRequestOptions::from_value(&json!({"checkpoint_every": 0})).is_err());
        let opts = SbpRequestOptions::from_value(&json!({"force_new_session": true, "x": 1}))
            .expect("valid")
            .expect("present");
        assert!(opts.force_new_session);
        assert_eq!(opts.extra["x"], json!(1));
    }
}
