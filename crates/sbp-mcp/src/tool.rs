//! The two shapes shared by both MCP roles (a tool's description and a call's outcome), and their
//! conversions to and from rmcp's model types.

use std::{borrow::Cow, sync::Arc};

use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool};
use serde_json::{Map, Value, json};

/// A tool as offered to an LLM or an MCP client.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema object for the arguments. Anything that is not an object (say `Null`, when a
    /// surface declared a tool by name only) is offered as [`ToolSpec::passthrough_schema`].
    pub input_schema: Value,
}

impl ToolSpec {
    /// The schema used when none was given: any object.
    pub fn passthrough_schema() -> Value {
        json!({"type": "object", "additionalProperties": true})
    }

    /// The schema as MCP requires it: an object whose `type` is `"object"`.
    pub(crate) fn mcp_input_schema(&self) -> JsonObject {
        match &self.input_schema {
            Value::Object(schema) => {
                let mut schema = schema.clone();
                // MCP requires a top-level object type; a surface that sent only `properties` means that.
                schema
                    .entry("type")
                    .or_insert_with(|| Value::String("object".into()));
                schema
            }
            _ => match Self::passthrough_schema() {
                Value::Object(schema) => schema,
                _ => Map::new(),
            },
        }
    }

    pub(crate) fn to_mcp(&self) -> Tool {
        Tool::new_with_raw(
            self.name.clone(),
            self.description.clone().map(Cow::Owned),
            Arc::new(self.mcp_input_schema()),
        )
    }

    pub(crate) fn from_mcp(tool: &Tool) -> Self {
        ToolSpec {
            name: tool.name.to_string(),
            description: tool.description.as_ref().map(|d| d.to_string()),
            input_schema: Value::Object((*tool.input_schema).clone()),
        }
    }
}

/// The outcome of one tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// The tool ran but failed (MCP `isError`); the LLM should see `text` and may retry differently.
    pub is_error: bool,
    /// The machine-readable result: `structuredContent` if the tool gave one, else its text blocks
    /// joined (a JSON string), else the raw MCP content array (images, resources, ...).
    pub content: Value,
    /// What to show an LLM.
    pub text: String,
}

impl ToolOutput {
    /// A successful plain-text result.
    pub fn text(text: impl Into<String>) -> Self {
        let text = text.into();
        ToolOutput {
            is_error: false,
            content: Value::String(text.clone()),
            text,
        }
    }

    /// A successful structured result; `text` is its compact JSON.
    pub fn json(content: Value) -> Self {
        ToolOutput {
            is_error: false,
            text: content.to_string(),
            content,
        }
    }

    /// A tool-level failure with a message for the LLM.
    pub fn error(message: impl Into<String>) -> Self {
        ToolOutput {
            is_error: true,
            ..ToolOutput::text(message)
        }
    }

    pub(crate) fn from_mcp(result: CallToolResult) -> Self {
        let is_error = result.is_error.unwrap_or(false);
        let texts: Vec<&str> = result
            .content
            .iter()
            .filter_map(|block| block.as_text().map(|t| t.text.as_str()))
            .collect();
        let all_text = !result.content.is_empty() && texts.len() == result.content.len();
        let joined = texts.join("\n");
        let raw_content = || serde_json::to_value(&result.content).unwrap_or(Value::Null);

        let content = match &result.structured_content {
            Some(structured) => structured.clone(),
            None if all_text => Value::String(joined.clone()),
            None => raw_content(),
        };
        let text = if !texts.is_empty() {
            joined
        } else if let Some(structured) = &result.structured_content {
            structured.to_string()
        } else {
            raw_content().to_string()
        };
        ToolOutput {
            is_error,
            content,
            text,
        }
    }

    /// One text block with `text` (or the JSON of `content` if `text` is empty), plus `content` as
    /// `structuredContent` when it is an object (MCP requires structured content to be an object).
    pub(crate) fn to_mcp(&self) -> CallToolResult {
        let text = if self.text.is_empty() && !self.content.is_null() {
            match &self.content {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            }
        } else {
            self.text.clone()
        };
        let blocks = vec![ContentBlock::text(text)];
        let mut result = if self.is_error {
            CallToolResult::error(blocks)
        } else {
            CallToolResult::success(blocks)
        };
        if self.content.is_object() {
            result.structured_content = Some(self.content.clone());
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_schema_becomes_passthrough() {
        let spec = ToolSpec {
            name: "camera".into(),
            description: None,
            input_schema: Value::Null,
        };
        assert_eq!(
            Value::Object(spec.mcp_input_schema()),
            ToolSpec::passthrough_schema()
        );
    }

    #[test]
    fn schema_without_type_gets_object_type() {
        let spec = ToolSpec {
            name: "gps".into(),
            description: None,
            input_schema: json!({"properties": {"precise": {"type": "boolean"}}}),
        };
        assert_eq!(spec.mcp_input_schema()["type"], "object");
    }

    #[test]
    fn outputs_round_trip_through_mcp() {
        for output in [
            ToolOutput::text("hello"),
            ToolOutput::error("no camera permission"),
            ToolOutput {
                is_error: false,
                content: json!({"sum": 5}),
                text: "5".into(),
            },
        ] {
            assert_eq!(ToolOutput::from_mcp(output.to_mcp()), output);
        }
    }

    #[test]
    fn non_text_content_is_kept_raw() {
        let result = CallToolResult::success(vec![ContentBlock::image("aGk=", "image/png")]);
        let output = ToolOutput::from_mcp(result);
        assert!(output.content.is_array());
        assert!(output.text.contains("image/png"));
    }
}
