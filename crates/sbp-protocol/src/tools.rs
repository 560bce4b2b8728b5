//! How a tool call on a surface ends: the surface's result, or a [`ToolFailure`]. One place says
//! what each failure is called on the wire (the TOOL_RESULT error text the LLM and backends see).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The outcome of one TOOL_CALL.
pub type ToolOutcome = Result<Value, ToolFailure>;

/// Why a tool call produced no result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFailure {
    /// The surface did not answer within the call's timeout (SPEC 10.4).
    Timeout,
    /// The surface went away (closed, displaced, its replica died) while the call was in flight.
    Disconnected,
    /// The surface answered with an error.
    Surface(String),
}

impl ToolFailure {
    /// The failure a TOOL_RESULT's error text reports: the texts of the gateway's own endings mean
    /// those endings (a surface whose tool timed out says `timeout`), anything else is the
    /// surface's error.
    pub fn from_message(text: String) -> Self {
        match text.as_str() {
            "timeout" => Self::Timeout,
            "surface disconnected" => Self::Disconnected,
            _ => Self::Surface(text),
        }
    }

    /// The error text a caller sees: `timeout`, `surface disconnected`, or the surface's own.
    pub fn message(&self) -> &str {
        match self {
            Self::Timeout => "timeout",
            Self::Disconnected => "surface disconnected",
            Self::Surface(message) => message,
        }
    }
}

impl std::fmt::Display for ToolFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_texts() {
        assert_eq!(ToolFailure::Timeout.to_string(), "timeout");
        assert_eq!(
            ToolFailure::Disconnected.to_string(),
            "surface disconnected"
        );
        assert_eq!(ToolFailure::Surface("denied".into()).to_string(), "denied");
        for f in [
            ToolFailure::Timeout,
            ToolFailure::Disconnected,
            ToolFailure::Surface("denied".into()),
        ] {
            assert_eq!(ToolFailure::from_message(f.to_string()), f);
        }
    }
}
