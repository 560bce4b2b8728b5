//! The tools one round of a turn offers the LLM: function name → who runs it, and the OpenAI
//! declarations added after the request's own tools. Names are made in the LLM's function-name
//! alphabet (`surface_<tool>`, `mcp__<server>__<tool>`; the prefixes live in `sbp_llm::tool_names`,
//! shared with `sbp/echo`).

use std::collections::HashMap;

use sbp_protocol::{ChatRequest, ToolDecl};
use serde_json::{Value, json};

/// Longest function name OpenAI and Anthropic accept.
const MAX_FUNCTION_NAME: usize = 64;

/// Who runs a function the LLM may call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolTarget {
    Surface(String),
    Server { server: String, tool: String },
}

impl ToolTarget {
    /// How a snapshot records the target.
    pub fn to_json(&self) -> Value {
        match self {
            Self::Surface(tool) => json!({"surface": tool}),
            Self::Server { server, tool } => json!({"server": server, "tool": tool}),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Catalog {
    targets: HashMap<String, ToolTarget>,
    declarations: Vec<ToolDecl>,
}

impl Catalog {
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    pub fn target(&self, function: &str) -> Option<&ToolTarget> {
        self.targets.get(function)
    }

    /// Adds the gateway's tools to the request's `tools`, after the client's own.
    pub fn offer(&self, req: &mut ChatRequest) {
        if !self.declarations.is_empty() {
            req.add_tools(self.declarations.iter().cloned());
        }
    }

    /// Adds `target` as function `raw_name` (made to fit the alphabet) unless the request already
    /// declares a function of that name (`taken`: the client's tools keep their names).
    pub fn add(
        &mut self,
        raw_name: &str,
        target: ToolTarget,
        description: String,
        schema: Value,
        taken: &[&str],
    ) {
        let function = function_name(raw_name);
        if taken.contains(&function.as_str()) {
            return;
        }
        if self.targets.contains_key(&function) {
            tracing::warn!(
                function,
                "two tools map to one function name; the first is kept"
            );
            return;
        }
        self.declarations
            .push(ToolDecl::function(&function, &description, schema));
        self.targets.insert(function, target);
    }
}

/// A name in the alphabet function names allow (`[A-Za-z0-9_-]`, at most 64 characters).
fn function_name(raw: &str) -> String {
    let mut name: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(MAX_FUNCTION_NAME);
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_names_fit_the_alphabet() {
        assert_eq!(function_name("surface_gps"), "surface_gps");
        assert_eq!(
            function_name("mcp__files__read.file"),
            "mcp__files__read_file"
        );
        assert_eq!(function_name(&"x".repeat(80)).len(), 64);
        assert_eq!(function_name("surface_caméra"), "surface_cam_ra");
    }

    #[test]
    fn the_clients_own_function_names_are_not_taken() {
        let mut catalog = Catalog::default();
        let target = ToolTarget::Surface("gps".into());
        catalog.add(
            "surface_gps",
            target.clone(),
            "d".into(),
            json!({}),
            &["surface_gps"],
        );
        assert!(catalog.is_empty());
        catalog.add(
            "surface_gps",
            target.clone(),
            "d".into(),
            json!({}),
            &["bare"],
        );
        catalog.add(
            "surface_gps",
            ToolTarget::Surface("other".into()),
            "d".into(),
            json!({}),
            &[],
        );
        assert_eq!(
            catalog.target("surface_gps"),
            Some(&target),
            "the first is kept"
        );
        let mut req = ChatRequest::default();
        catalog.offer(&mut req);
        assert_eq!(req.declared_functions(), vec!["surface_gps"]);
        let mut untouched = ChatRequest::default();
        Catalog::default().offer(&mut untouched);
        assert_eq!(untouched.tools, None, "no empty `tools` is added");
    }
}
