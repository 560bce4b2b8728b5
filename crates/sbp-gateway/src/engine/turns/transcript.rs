//! The transcript, as pure functions: which part of a request is new (clients resend the whole
//! conversation, or only what is new, and never see the gateway's own tool rounds), and what a
//! turn records as its task.

use sbp_protocol::chat::content_text;
use sbp_protocol::{ChatMessage, PriorMessage};
use serde_json::Value;

use crate::engine::history::History;

/// Longest task label a turn records (the last user message, trimmed).
const MAX_TASK_CHARS: usize = 200;

/// What a turn is about: the text of the last user message among `new`, trimmed and bounded.
pub fn last_task(new: &[ChatMessage]) -> Option<String> {
    new.iter()
        .rev()
        .find(|m| m.role() == Some("user"))
        .and_then(ChatMessage::text)
        .map(|t| truncate_chars(t.trim(), MAX_TASK_CHARS))
        .filter(|t| !t.is_empty())
}

/// Where the new part of `incoming` starts: clients that resend the whole conversation send the
/// stored history as a prefix; clients that send only new messages do not. System prompts already
/// stored at the start are not stored again either. A stored message is parsed only to be compared
/// with one the client sent: a client that sends only what is new costs nothing per stored message.
pub fn new_start(history: &History, incoming: &[ChatMessage]) -> usize {
    if is_prefix(history.messages(), history.len(), incoming) {
        return history.len();
    }
    // A client never saw the gateway's own tool rounds: it resends the transcript without them.
    let seen = history.client_len();
    if seen < history.len() && is_prefix(history.client_view(), seen, incoming) {
        return seen;
    }
    let mut skip = 0;
    for stored in history.messages().take_while(|h| h.role() == "system") {
        match incoming.get(skip) {
            Some(m) if same_message(&stored.parse(), m.as_value()) => skip += 1,
            _ => break,
        }
    }
    skip
}

/// Whether `incoming` starts with the `len` messages of `stored` (none: no).
fn is_prefix<'a>(
    stored: impl IntoIterator<Item = PriorMessage<'a>>,
    len: usize,
    incoming: &[ChatMessage],
) -> bool {
    len > 0
        && incoming.len() >= len
        && stored
            .into_iter()
            .zip(incoming)
            .all(|(h, m)| same_message(&h.parse(), m.as_value()))
}

/// Whether two chat messages say the same thing: role, content (text compared as text), tool calls
/// and tool call id. Vendor extras on stored replies are ignored; absent equals null.
fn same_message(a: &Value, b: &Value) -> bool {
    let field = |v: &Value, k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    if field(a, "role") != field(b, "role") || field(a, "tool_call_id") != field(b, "tool_call_id")
    {
        return false;
    }
    let (ca, cb) = (field(a, "content"), field(b, "content"));
    let content_same = match (content_text(&ca), content_text(&cb)) {
        (Some(x), Some(y)) => x == y,
        _ => ca == cb,
    };
    let calls = |v: &Value| {
        field(v, "tool_calls")
            .as_array()
            .filter(|a| !a.is_empty())
            .cloned()
    };
    content_same && calls(a) == calls(b)
}

pub fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use sbp_store::MessageRecord;
    use serde_json::json;

    /// The new part of `incoming` (as values, to compare with what tests expect).
    fn new_part(history: &[MessageRecord], incoming: &[Value]) -> Vec<Value> {
        let history = {
            let mut h = History::default();
            h.extend_records(history);
            h
        };
        let incoming: Vec<ChatMessage> = incoming
            .iter()
            .cloned()
            .map(ChatMessage::from_value)
            .collect();
        incoming[new_start(&history, &incoming)..]
            .iter()
            .map(|m| m.as_value().clone())
            .collect()
    }

    fn rec(seq: u64, v: Value) -> MessageRecord {
        MessageRecord {
            seq,
            role: v["role"].as_str().unwrap_or("user").to_owned(),
            body: v,
            model_used: None,
            cost_usd: None,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn full_resend_keeps_only_the_new_tail() {
        let history = vec![
            rec(0, json!({"role": "system", "content": "be brief"})),
            rec(1, json!({"role": "user", "content": "hi"})),
            rec(
                2,
                json!({"role": "assistant", "content": "hello", "refusal": null}),
            ),
        ];
        let incoming = vec![
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "again"}),
        ];
        assert_eq!(
            new_part(&history, &incoming),
            vec![json!({"role": "user", "content": "again"})]
        );
    }

    #[test]
    fn new_message_only_clients_and_repeated_text() {
        let history = vec![
            rec(0, json!({"role": "user", "content": "hi"})),
            rec(1, json!({"role": "assistant", "content": "hello"})),
        ];
        let incoming = vec![json!({"role": "user", "content": "hi"})];
        assert_eq!(new_part(&history, &incoming), incoming);
        assert_eq!(new_part(&[], &incoming), incoming);
    }

    #[test]
    fn stored_system_prompt_is_not_duplicated() {
        let history = vec![
            rec(0, json!({"role": "system", "content": "sys"})),
            rec(1, json!({"role": "user", "content": "a"})),
            rec(2, json!({"role": "assistant", "content": "b"})),
        ];
        let incoming = vec![
            json!({"role": "system", "content": "sys"}),
            json!({"role": "user", "content": "c"}),
        ];
        assert_eq!(
            new_part(&history, &incoming),
            vec![json!({"role": "user", "content": "c"})]
        );
    }

    #[test]
    fn gateway_tool_rounds_are_not_expected_back() {
        let history = vec![
            rec(0, json!({"role": "user", "content": "where am I?"})),
            rec(
                1,
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "surface_gps", "arguments": "{}"}}]}),
            ),
            rec(
                2,
                json!({"role": "tool", "tool_call_id": "c1", "content": "{}"}),
            ),
            rec(3, json!({"role": "assistant", "content": "Tokyo"})),
        ];
        let client = vec![
            json!({"role": "user", "content": "where am I?"}),
            json!({"role": "assistant", "content": "Tokyo"}),
            json!({"role": "user", "content": "thanks"}),
        ];
        assert_eq!(
            new_part(&history, &client),
            vec![json!({"role": "user", "content": "thanks"})]
        );
        // A client that resends the rounds too is understood as well.
        let mut full: Vec<Value> = history.iter().map(|h| h.body.clone()).collect();
        full.push(json!({"role": "user", "content": "thanks"}));
        assert_eq!(
            new_part(&history, &full),
            vec![json!({"role": "user", "content": "thanks"})]
        );
    }

    #[test]
    fn tool_calls_must_match() {
        let a = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]});
        let b = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "2"}]});
        assert!(!same_message(&a, &b));
        assert!(same_message(&a, &a));
    }

    #[test]
    fn truncation_is_char_safe() {
        assert_eq!(truncate_chars("日本語テキスト", 3), "日本語…");
        assert_eq!(truncate_chars("short", 10), "short");
    }
}
