//! Integration tests: the HTTP providers and the router against the fake upstream over real
//! loopback HTTP, speaking OpenAI chat completions and Anthropic Messages.

mod support;

use std::sync::Arc;
use std::time::Duration;

use sbp_llm::{AnthropicProvider, LlmError, ModelMatch, Provider, Router};
use serde_json::{Value, json};
use support::{anthropic, anthropic_options, body, fake, openai, stream, user};

#[tokio::test]
async fn anthropic_completes_plain_text() {
    let fake = fake().await;
    let provider = anthropic(&fake);
    let request = body(json!({"model": "claude-test", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello   world"},
    ], "temperature": 0.2, "stop": "END"}));
    let c = provider.complete(request).await.expect("completes");
    assert_eq!(c.text(), Some("echo: hello   world"));
    assert_eq!(c.model, "claude-test");
    assert_eq!(c.finish_reason.as_deref(), Some("stop"));
    assert_eq!(c.body["object"], "chat.completion");
    assert!(
        c.body["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("msg_"))
    );
    assert_eq!(
        c.body["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7})
    );

    let sent = &fake.requests()[0];
    assert_eq!(sent["system"], "be brief");
    assert_eq!(
        sent["messages"],
        json!([{"role": "user", "content": [{"type": "text", "text": "hello   world"}]}])
    );
    assert_eq!(sent["max_tokens"], 4096);
    assert_eq!(sent["stream"], false);
    assert_eq!(sent["temperature"], 0.2);
    assert_eq!(sent["stop_sequences"], json!(["END"]));
    let headers = &fake.request_headers()[0];
    assert_eq!(headers["x-api-key"], "sk-ant-test");
    assert_eq!(headers["anthropic-version"], "2023-06-01");
    assert!(headers.get("authorization").is_none());
}

#[tokio::test]
async fn anthropic_streams_plain_text() {
    let fake = fake().await;
    let provider = anthropic(&fake);
    let request = user("claude-test", "[[fake:chunks=3]] abcdefghij");
    let (asm, chunks) = stream(&provider, request).await.expect("streams");
    assert_eq!(asm.content(), "echo: abcdefghij");
    assert_eq!(asm.finish_reason.as_deref(), Some("stop"));
    assert_eq!(asm.model.as_deref(), Some("claude-test"));
    assert!(asm.id.as_deref().is_some_and(|id| id.starts_with("msg_")));
    // The real API reports output tokens once more at the end; the last count wins.
    assert_eq!(
        asm.usage,
        Some(json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}))
    );
    let pieces: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/delta/content"))
        .filter_map(Value::as_str)
        .filter(|p| !p.is_empty())
        .collect();
    assert_eq!(pieces.len(), 3, "{pieces:?}");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(fake.requests()[0]["stream"], true);
}

/// OpenAI-format tools go out as Anthropic tools, the fake's `tool_use` comes back as
/// `tool_calls`, and the follow-up with the call and its result is a valid Anthropic
/// conversation the fake answers.
#[tokio::test]
async fn anthropic_tool_round_trip() {
    let fake = fake().await;
    let provider = anthropic(&fake);
    let parameters =
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather by city", "parameters": parameters}}]);
    let prompt = r#"weather? [[fake:tool=get_weather:{"city":"Paris"}]]"#;
    let first = json!({"model": "claude-test", "tools": tools, "tool_choice": "auto",
        "messages": [{"role": "user", "content": prompt}]});

    let c = provider
        .complete(body(first.clone()))
        .await
        .expect("completes");
    assert_eq!(c.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(c.message["content"], Value::Null);
    let call = &c.message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().expect("string"))
            .expect("arguments are JSON");
    assert_eq!(arguments, json!({"city": "Paris"}));
    let id = call["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("toolu_"), "{id}");

    // The streamed answer assembles to the same message, ids aside.
    let (asm, _) = stream(&provider, body(first.clone()))
        .await
        .expect("streams");
    let mut streamed = asm.message();
    streamed["tool_calls"][0]["id"] = json!(id);
    assert_eq!(streamed, c.message);
    assert_eq!(asm.finish_reason.as_deref(), Some("tool_calls"));

    let mut follow_up = first;
    let messages = follow_up["messages"].as_array_mut().expect("messages");
    messages.push(c.message.clone().into());
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": "sunny, 21C"}));
    let answer = provider
        .complete(body(follow_up.clone()))
        .await
        .expect("completes");
    assert_eq!(answer.text(), Some("tool result: sunny, 21C"));
    assert_eq!(answer.finish_reason.as_deref(), Some("stop"));
    let (asm, _) = stream(&provider, body(follow_up)).await.expect("streams");
    assert_eq!(asm.content(), "tool result: sunny, 21C");

    let recorded = fake.requests();
    assert_eq!(recorded.len(), 4);
    assert_eq!(
        recorded[0]["tools"],
        json!([{"name": "get_weather", "description": "Weather by city", "input_schema": parameters}])
    );
    assert_eq!(recorded[0]["tool_choice"], json!({"type": "auto"}));
    let sent = &recorded[2]["messages"];
    assert_eq!(sent[1]["role"], "assistant");
    assert_eq!(
        sent[1]["content"],
        json!([{"type": "tool_use", "id": id, "name": "get_weather", "input": {"city": "Paris"}}])
    );
    assert_eq!(sent[2]["role"], "user");
    assert_eq!(
        sent[2]["content"],
        json!([{"type": "tool_result", "tool_use_id": id, "content": "sunny, 21C"}])
    );
}

#[tokio::test]
async fn anthropic_error_statuses_carry_the_body() {
    let fake = fake().await;
    let provider = anthropic(&fake);
    let err = provider
        .complete(user("fake-error-429", "hi"))
        .await
        .expect_err("429");
    assert_eq!(
        err,
        LlmError::Status {
            status: 429,
            body: json!({"type": "error", "error": {"type": "rate_limit_error", "message": "fake error"}}),
        }
    );
    let err = stream(&provider, user("claude-test", "[[fake:error=529]]"))
        .await
        .expect_err("529");
    let LlmError::Status { status, body } = err else {
        panic!("expected a status, got {err:?}");
    };
    assert_eq!(status, 529);
    assert_eq!(body["error"]["type"], "overloaded_error");
}

/// What the fake refuses the way the real API would comes back as the 400 it is.
#[tokio::test]
async fn anthropic_validation_errors_are_status_400() {
    let fake = fake().await;
    let provider = anthropic(&fake);
    let cases = [
        // The tool result answers a call the assistant never made.
        json!({"model": "claude-test", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "x"},
        ]}),
        // A conversation that starts with the assistant.
        json!({"model": "claude-test", "messages": [{"role": "assistant", "content": "hello"}]}),
    ];
    for case in cases {
        let err = provider
            .complete(body(case.clone()))
            .await
            .expect_err("400");
        let LlmError::Status { status, body } = err else {
            panic!("expected a status, got {err:?}");
        };
        assert_eq!(status, 400, "{case}");
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}

#[tokio::test]
async fn anthropic_timeouts_and_broken_streams() {
    let fake = fake().await;
    let impatient = AnthropicProvider::new(sbp_llm::AnthropicOptions {
        request_timeout: Duration::from_millis(200),
        stream_idle_timeout: Duration::from_millis(200),
        ..anthropic_options(&fake)
    })
    .expect("provider");
    let err = impatient
        .complete(user("fake-slow-2000", "hi"))
        .await
        .expect_err("too slow");
    assert_eq!(err, LlmError::Timeout);
    let err = stream(
        &impatient,
        user("claude-test", "[[fake:chunk_delay=1000]] a b"),
    )
    .await
    .expect_err("idle stream");
    assert_eq!(err, LlmError::Timeout);

    let err = stream(
        &anthropic(&fake),
        user("claude-test", "[[fake:drop=1]] a b c"),
    )
    .await
    .expect_err("cut stream");
    assert!(matches!(err, LlmError::Protocol(_)), "{err:?}");

    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let nowhere = AnthropicProvider::new(sbp_llm::AnthropicOptions {
        base_url: format!("http://127.0.0.1:{port}/v1"),
        ..anthropic_options(&fake)
    })
    .expect("provider");
    let err = nowhere
        .complete(user("claude-test", "hi"))
        .await
        .expect_err("refused");
    assert!(matches!(err, LlmError::Unreachable(_)), "{err:?}");
}

/// The OpenAI provider shares the transport; its behaviour must not have moved.
#[tokio::test]
async fn openai_completes_streams_and_fails_as_before() {
    let fake = fake().await;
    let provider = openai(&fake);
    let c = provider
        .complete(user("gpt-test", "hi there"))
        .await
        .expect("completes");
    assert_eq!(c.text(), Some("echo: hi there"));
    let (asm, _) = stream(&provider, user("gpt-test", "hi there"))
        .await
        .expect("streams");
    assert_eq!(asm.content(), "echo: hi there");
    assert_eq!(fake.request_headers()[0]["authorization"], "Bearer sk-test");

    let err = provider
        .complete(user("fake-error-503", "x"))
        .await
        .expect_err("503");
    assert!(
        matches!(err, LlmError::Status { status: 503, .. }),
        "{err:?}"
    );
    let err = stream(&provider, user("gpt-test", "[[fake:drop=1]] a b c"))
        .await
        .expect_err("cut");
    assert!(matches!(err, LlmError::Protocol(_)), "{err:?}");
}

/// One fake serves both APIs, so which one a request reached shows in what was recorded.
#[tokio::test]
async fn router_sends_each_model_to_its_upstream() {
    let fake = fake().await;
    let router = Router::new(Arc::new(openai(&fake)))
        .with_route(
            ModelMatch::prefix("anthropic/").stripping_prefix(),
            Arc::new(anthropic(&fake)),
        )
        .with_route(ModelMatch::prefix("claude"), Arc::new(anthropic(&fake)));

    let cases = [
        ("anthropic/claude-x", "claude-x", true),
        ("claude-y", "claude-y", true),
        ("gpt-4o", "gpt-4o", false),
    ];
    for (i, (model, upstream, is_anthropic)) in cases.into_iter().enumerate() {
        assert_eq!(router.route_name(model), upstream);
        let c = router.complete(user(model, "hi")).await.expect("completes");
        assert_eq!(c.text(), Some("echo: hi"), "{model}");
        assert_eq!(c.model, upstream, "{model}");
        let (asm, _) = stream(&router, user(model, "hi")).await.expect("streams");
        assert_eq!(asm.content(), "echo: hi", "{model}");

        let recorded = fake.requests();
        let headers = fake.request_headers();
        for k in [2 * i, 2 * i + 1] {
            assert_eq!(recorded[k]["model"], upstream, "{model}");
            assert_eq!(
                headers[k].contains_key("anthropic-version"),
                is_anthropic,
                "{model}"
            );
            assert_eq!(
                recorded[k].get("max_tokens").is_some(),
                is_anthropic,
                "{model}"
            );
        }
    }
}

/// An upstream on loopback answering every request with `head` (status line and headers, no
/// length: the body ends when the connection does) and then `body`, never closing: only a
/// client that stops reading on its own gets an answer.
async fn endless_upstream(head: &'static str, body: Vec<Vec<u8>>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut request = vec![0u8; 64 << 10];
                let _ = conn.read(&mut request).await;
                if conn.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                for piece in &body {
                    if conn.write_all(piece).await.is_err() {
                        return;
                    }
                }
                // Held open until the client goes.
                while conn.read(&mut request).await.is_ok_and(|n| n > 0) {}
            });
        }
    });
    format!("http://{addr}/v1")
}

fn openai_at(base_url: String) -> sbp_llm::OpenAiProvider {
    sbp_llm::OpenAiProvider::new(sbp_llm::OpenAiOptions {
        base_url,
        api_key: None,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(60),
        stream_idle_timeout: Duration::from_secs(60),
    })
    .expect("provider")
}

/// `mib` pieces of 1 MiB of `fill`, after `start`.
fn oversized(start: &str, fill: u8, mib: usize) -> Vec<Vec<u8>> {
    std::iter::once(start.as_bytes().to_vec())
        .chain(std::iter::repeat_n(vec![fill; 1 << 20], mib))
        .collect()
}

fn protocol_error(r: Result<impl std::fmt::Debug, LlmError>) -> String {
    match r {
        Err(LlmError::Protocol(m)) => m,
        other => panic!("a protocol error, not {other:?}"),
    }
}

/// A whole answer (32 MiB), an error body (1 MiB) and one server-sent event (8 MiB) are each
/// read only up to a bound, so an upstream that sends without end cannot grow the gateway's
/// memory: the call fails (or the error body is cut) instead of waiting for the end or the
/// timeout.
#[tokio::test]
async fn an_upstream_body_without_end_is_cut_at_its_bound() {
    const OK_JSON: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n";
    let answer = r#"{"choices":[{"message":{"role":"assistant","content":""#;
    let url = endless_upstream(OK_JSON, oversized(answer, b'x', 33)).await;
    let provider = openai_at(url);
    let m = protocol_error(provider.complete(user("m", "hi")).await);
    assert!(m.contains("larger than 32 MiB"), "{m}");
    let m = protocol_error(provider.complete_bytes(user("m", "hi")).await);
    assert!(m.contains("larger than 32 MiB"), "{m}");

    // A declared length over the bound is refused before any of the body is waited for.
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n";
    let provider = openai_at(endless_upstream(head, Vec::new()).await);
    let m = protocol_error(provider.complete(user("m", "hi")).await);
    assert!(m.contains("larger than 32 MiB"), "{m}");

    // An error body is cut to what its envelope needs, and the error is still the status.
    let head = "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\n\r\n";
    let provider = openai_at(endless_upstream(head, oversized("down: ", b'e', 2)).await);
    match provider.complete(user("m", "hi")).await {
        Err(LlmError::Status {
            status: 500,
            body: Value::String(text),
        }) => {
            assert_eq!(text.len(), 1 << 20);
            assert!(text.starts_with("down: eee"), "{}", &text[..16]);
        }
        other => panic!("the 500 with its body cut, not {other:?}"),
    }

    // One event that never ends fails the stream.
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n";
    let provider = openai_at(endless_upstream(head, oversized("data: ", b'x', 9)).await);
    let m = protocol_error(stream(&provider, user("m", "hi")).await.map(|_| ()));
    assert!(
        m.contains("a server-sent event larger than 8388608 bytes"),
        "{m}"
    );
}

/// The SSE bound is per event: a stream whose events together pass it is read whole.
#[tokio::test]
async fn a_long_stream_of_bounded_events_is_read_whole() {
    let text = "y".repeat(60 << 10);
    let event = format!(
        "data: {}\r\n\r\n",
        json!({"choices": [{"index": 0, "delta": {"content": text}}]})
    );
    let events = 150;
    let body: Vec<Vec<u8>> = std::iter::repeat_n(event.into_bytes(), events)
        .chain([b"data: [DONE]\n\n".to_vec()])
        .collect();
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n";
    let provider = openai_at(endless_upstream(head, body).await);
    let (asm, chunks) = stream(&provider, user("m", "hi")).await.expect("streams");
    assert_eq!(chunks.len(), events);
    assert_eq!(asm.content().len(), events * (60 << 10));
    assert!(events * (60 << 10) > 8 << 20, "more than the bound in all");
}
