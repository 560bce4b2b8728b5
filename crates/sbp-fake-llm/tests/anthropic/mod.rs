//! The fake's Anthropic Messages endpoint over real HTTP: answers, streams in Anthropic's
//! event format, scripted tool use and errors, and the validation the real API does.

use serde_json::{Value, json};

use crate::start;
use crate::support::{anthropic_events, anthropic_user, client, post_garbage, post_messages};

async fn post_json(fake: &sbp_fake_llm::FakeLlm, body: &Value) -> (u16, Value) {
    let response = post_messages(fake, body).await;
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON body"))
}

#[tokio::test]
async fn messages_echo_and_are_recorded() {
    let fake = start().await;
    let body = json!({"model": "claude-test", "max_tokens": 64, "system": "be brief", "messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": [{"type": "text", "text": "answer"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
    ]});
    let (status, reply) = post_json(&fake, &body).await;
    assert_eq!(status, 200);
    assert_eq!(reply["type"], "message");
    assert_eq!(reply["role"], "assistant");
    assert_eq!(reply["model"], "claude-test");
    assert!(
        reply["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("msg_"))
    );
    assert_eq!(
        reply["content"],
        json!([{"type": "text", "text": "echo: hello\nworld"}])
    );
    assert_eq!(reply["stop_reason"], "end_turn");
    assert_eq!(reply["stop_sequence"], Value::Null);
    assert_eq!(
        reply["usage"],
        json!({"input_tokens": 2 + 1 + 1 + 2, "output_tokens": 3})
    );

    // The path without /v1 is the same endpoint, and both land in the one record.
    let response = client()
        .post(format!("http://{}/messages", fake.addr()))
        .header("anthropic-version", "2023-06-01")
        .json(&anthropic_user("again"))
        .send()
        .await
        .expect("request");
    let reply: Value = response.json().await.expect("json");
    assert_eq!(reply["content"][0]["text"], "echo: again");
    assert_eq!(fake.requests(), [body, anthropic_user("again")]);
    assert_eq!(fake.request_headers()[0]["anthropic-version"], "2023-06-01");
}

#[tokio::test]
async fn streams_in_anthropic_event_order() {
    let fake = start().await;
    let mut body = anthropic_user("[[fake:chunks=4]] abcdefgh");
    body["stream"] = json!(true);
    let events = anthropic_events(&fake, &body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let start = &events[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["model"], "claude-test");
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = events
        .iter()
        .filter_map(|(_, d)| d.pointer("/delta/text").and_then(Value::as_str))
        .collect();
    assert_eq!(text, "echo: abcdefgh");
    let delta = &events[8].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], 2);
}

#[tokio::test]
async fn tool_directives_make_tool_use_blocks() {
    let fake = start().await;
    let prompt = r#"weather? [[fake:tool=get_weather:{"city": "Paris"}]] [[fake:tool=clock]]"#;
    let (status, reply) = post_json(&fake, &anthropic_user(prompt)).await;
    assert_eq!(status, 200);
    assert_eq!(reply["stop_reason"], "tool_use");
    let blocks = reply["content"].as_array().expect("content");
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0]["type"], "tool_use");
    assert_eq!(blocks[0]["name"], "get_weather");
    assert_eq!(blocks[0]["input"], json!({"city": "Paris"}));
    assert_eq!(blocks[1]["input"], json!({}));
    assert!(
        blocks[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("toolu_"))
    );
    assert_ne!(blocks[0]["id"], blocks[1]["id"]);

    let mut body = anthropic_user(prompt);
    body["stream"] = json!(true);
    let events = anthropic_events(&fake, &body).await;
    let starts: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, d)| &d["content_block"])
        .collect();
    assert_eq!(starts[0]["type"], "tool_use");
    assert_eq!(starts[0]["name"], "get_weather");
    assert_eq!(starts[0]["input"], json!({}));
    let parts: Vec<&str> = events
        .iter()
        .filter(|(_, d)| d["index"] == 0)
        .filter_map(|(_, d)| d.pointer("/delta/partial_json").and_then(Value::as_str))
        .collect();
    assert!(parts.len() >= 2, "input arrives in pieces: {parts:?}");
    let input: Value = serde_json::from_str(&parts.concat()).expect("parts join to JSON");
    assert_eq!(input, json!({"city": "Paris"}));
    let delta = events
        .iter()
        .find(|(n, _)| n == "message_delta")
        .expect("message_delta");
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn a_tool_result_continues_the_conversation() {
    let fake = start().await;
    let body = json!({"model": "claude-test", "max_tokens": 64,
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "weather? [[fake:tool=get_weather]]"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21C"}]},
        ]},
    ]});
    let (status, reply) = post_json(&fake, &body).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        reply["content"],
        json!([{"type": "text", "text": "tool result: sunny, 21C"}])
    );
    assert_eq!(reply["stop_reason"], "end_turn");
}

/// Scripted errors, streamed or not, answer with the status and the error type the real API
/// uses for it.
#[tokio::test]
async fn errors_use_the_anthropic_envelope() {
    let fake = start().await;
    let by_model = |model: &str| {
        let mut b = anthropic_user("hi");
        b["model"] = json!(model);
        b
    };
    let streamed = |mut b: Value| {
        b["stream"] = json!(true);
        b
    };
    let cases = [
        (
            anthropic_user("[[fake:error=429]] hi"),
            429,
            "rate_limit_error",
        ),
        (by_model("fake-error-529"), 529, "overloaded_error"),
        (
            streamed(anthropic_user("[[fake:error=500]]")),
            500,
            "api_error",
        ),
        (
            streamed(by_model("fake-error-401")),
            401,
            "authentication_error",
        ),
    ];
    for (request, status, kind) in cases {
        assert_eq!(
            post_json(&fake, &request).await,
            (
                status,
                json!({"type": "error", "error": {"type": kind, "message": "fake error"}})
            ),
            "{request}"
        );
    }

    let (status, body) = post_garbage(&fake, "messages").await;
    assert_eq!(status, 400);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

/// Each case: what the real API refuses, and a piece of the message saying why.
#[tokio::test]
async fn invalid_requests_get_400_like_the_real_api() {
    let fake = start().await;
    let mut no_max_tokens = anthropic_user("hi");
    no_max_tokens
        .as_object_mut()
        .map(|o| o.remove("max_tokens"));
    let with =
        |messages: Value| json!({"model": "claude-test", "max_tokens": 8, "messages": messages});
    let with_tools = |tools: Value| {
        let mut b = anthropic_user("hi");
        b["tools"] = tools;
        b
    };
    let cases = [
        (no_max_tokens, "max_tokens"),
        (with(json!([{"role": "system", "content": "x"}])), "role"),
        (
            with(json!([{"role": "assistant", "content": "x"}])),
            "first",
        ),
        (
            with(json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])),
            "alternate",
        ),
        (
            with(json!([
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]},
            ])),
            "toolu_2",
        ),
        (
            with_tools(json!([{"input_schema": {"type": "object"}}])),
            "name",
        ),
        (with_tools(json!([{"name": "f"}])), "input_schema"),
    ];
    for (bad, needle) in cases {
        let (status, body) = post_json(&fake, &bad).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(body["type"], "error", "{bad}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{bad}");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(
            message.contains(needle),
            "{bad}: `{message}` lacks `{needle}`"
        );
    }
    let missing_version = client()
        .post(format!("{}/messages", fake.base_url()))
        .json(&anthropic_user("hi"))
        .send()
        .await
        .expect("request");
    assert_eq!(missing_version.status(), 400);
    assert_eq!(
        fake.requests().len(),
        8,
        "refused requests are recorded too"
    );
}
