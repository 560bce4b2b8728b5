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
    }
}
