//! Integration tests: the fake LLM over real HTTP on loopback, driven by a real client.

mod anthropic;
mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sbp_fake_llm::{FakeLlm, FakeOptions};
use serde_json::{Value, json};
use support::{client, post, post_garbage, post_json, stream, streaming, user};

async fn start() -> FakeLlm {
    FakeLlm::start().await.expect("fake starts")
}

#[tokio::test]
async fn echoes_the_last_user_message() {
    let fake = start().await;
    assert!(fake.base_url().ends_with("/v1"));
    assert_eq!(
        fake.base_url(),
        format!("http://127.0.0.1:{}/v1", fake.addr().port())
    );
    let body = json!({"model": "gpt-test", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": [{"type": "text", "text": "hello   world"}]},
    ]});
    let (status, reply) = post_json(&fake, &body).await;
    assert_eq!(status, 200);
    assert_eq!(reply["object"], "chat.completion");
    assert_eq!(reply["model"], "gpt-test");
    assert!(reply["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert!(reply["created"].as_u64().expect("created") > 1_600_000_000);
    assert_eq!(reply["choices"][0]["index"], 0);
    assert_eq!(reply["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "echo: hello   world"
    );
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let usage = &reply["usage"];
    assert_eq!(usage["prompt_tokens"], 2 + 2 + 2 + 2);
    assert_eq!(usage["completion_tokens"], 3);
    assert_eq!(usage["total_tokens"], 11);

    // The path without /v1 is the same endpoint.
    let response = client()
        .post(format!("http://{}/chat/completions", fake.addr()))
        .json(&user("again"))
        .send()
        .await
        .expect("request");
    let reply: Value = response.json().await.expect("json");
    assert_eq!(reply["choices"][0]["message"]["content"], "echo: again");

    let health = client()
        .get(format!("http://{}/healthz", fake.addr()))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
    fake.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn records_bodies_and_headers_in_order() {
    let fake = start().await;
    let first = json!({"model": "m", "messages": [{"role": "user", "content": "one"}],
        "sbp": {"session": "should never reach an upstream"}});
    let second = user("two [[fake:reply=x]]");
    for (i, body) in [&first, &second].into_iter().enumerate() {
        let response = client()
            .post(format!("{}/chat/completions", fake.base_url()))
            .header("x-test-index", i.to_string())
            .header("authorization", "Bearer sk-fake")
            .json(body)
            .send()
            .await
            .expect("request");
        assert_eq!(response.status(), 200);
    }

    let recorded = fake.requests();
    assert_eq!(recorded, [first.clone(), second.clone()]);
    assert!(recorded[0].get("sbp").is_some());
    assert!(recorded[1].get("sbp").is_none());
    let headers = fake.request_headers();
    assert_eq!(headers.len(), 2);
    assert_eq!(headers[0]["x-test-index"], "0");
    assert_eq!(headers[1]["x-test-index"], "1");
    assert_eq!(headers[1]["authorization"], "Bearer sk-fake");

    let url = format!("http://{}/_fake/requests", fake.addr());
    let over_http: Value = client()
        .get(&url)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("json");
    assert_eq!(over_http, json!([first, second]));

    fake.clear();
    assert!(fake.requests().is_empty());
    assert!(fake.request_headers().is_empty());
    post(&fake, &user("three")).await;
    assert_eq!(fake.wait_for_requests(1).await.len(), 1);
    let cleared = client().delete(&url).send().await.expect("delete");
    assert_eq!(cleared.status(), 204);
    assert!(fake.requests().is_empty());
}

#[tokio::test]
async fn recording_can_be_turned_off() {
    let fake = FakeLlm::start_with(FakeOptions { record: false })
        .await
        .expect("fake starts");
    let (status, reply) = post_json(&fake, &user("quiet")).await;
    assert_eq!(status, 200);
    assert_eq!(reply["choices"][0]["message"]["content"], "echo: quiet");
    assert!(fake.requests().is_empty());
}

#[tokio::test]
async fn streaming_concatenates_to_the_reply_and_ends_with_done() {
    let fake = start().await;
    let text = "the quick  brown\tfox";
    let (_, whole) = post_json(&fake, &user(text)).await;
    let expected = whole["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_owned();
    assert_eq!(expected, "echo: the quick  brown\tfox");

    let streamed = stream(&fake, &streaming(text)).await;
    assert_eq!(streamed.content_type, "text/event-stream");
    assert!(streamed.done, "stream ends with [DONE]");
    assert_eq!(streamed.error, None);
    assert_eq!(streamed.text(), expected);
    // One chunk per word, spaces kept.
    assert_eq!(
        streamed.contents(),
        ["echo: ", "the ", "quick  ", "brown\t", "fox"]
    );
    let first = &streamed.chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["model"], "test-model");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let ids: Vec<&Value> = streamed.chunks.iter().map(|c| &c["id"]).collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "one id per stream");
    let last = streamed.chunks.last().expect("chunks");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    assert_eq!(streamed.finish_reason().as_deref(), Some("stop"));
    assert!(last.get("usage").is_none(), "no usage unless asked for");
}

#[tokio::test]
async fn chunks_directive_sets_the_chunk_count() {
    let fake = start().await;
    let streamed = stream(&fake, &streaming("[[fake:chunks=3]] abcdefghij")).await;
    assert_eq!(streamed.contents().len(), 3);
    assert_eq!(streamed.text(), "echo: abcdefghij");
    assert!(streamed.done);

    // More chunks than characters still gives exactly N.
    let streamed = stream(&fake, &streaming("[[fake:reply=ab]][[fake:chunks=5]]")).await;
    assert_eq!(streamed.contents().len(), 5);
    assert_eq!(streamed.text(), "ab");

    // Non-streaming ignores it and sends the whole text.
    let (_, reply) = post_json(&fake, &user("[[fake:chunks=3]] abc")).await;
    assert_eq!(reply["choices"][0]["message"]["content"], "echo: abc");
}

#[tokio::test]
async fn include_usage_sends_a_usage_chunk_before_done() {
    let fake = start().await;
    let mut body = streaming("count these words");
    body["stream_options"] = json!({"include_usage": true});
    let streamed = stream(&fake, &body).await;
    assert!(streamed.done);
    let last = streamed.chunks.last().expect("chunks");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["prompt_tokens"], 3);
    assert_eq!(last["usage"]["completion_tokens"], 4);
    assert_eq!(last["usage"]["total_tokens"], 7);
    let before = &streamed.chunks[streamed.chunks.len() - 2];
    assert_eq!(before["choices"][0]["finish_reason"], "stop");
    assert_eq!(before["usage"], Value::Null);
}

#[tokio::test]
async fn reply_directive_replaces_the_echo() {
    let fake = start().await;
    let (_, reply) = post_json(&fake, &user("ignored [[fake:reply=Hello, friend!]]")).await;
    assert_eq!(reply["choices"][0]["message"]["content"], "Hello, friend!");
}

#[tokio::test]
async fn error_directive_and_model_answer_with_that_status() {
    let fake = start().await;
    let (status, body) = post_json(&fake, &user("[[fake:error=429]] hi")).await;
    assert_eq!(status, 429);
    assert_eq!(
        body,
        json!({"error": {"message": "fake error", "type": "requests", "param": null,
            "code": "rate_limit_exceeded"}})
    );

    // Streaming requests get the same plain JSON error, not an event stream.
    let response = post(&fake, &streaming("[[fake:error=500]]")).await;
    assert_eq!(response.status(), 500);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["error"]["type"], "server_error");

    let mut body = user("hi");
    body["model"] = json!("fake-error-503");
    let (status, body) = post_json(&fake, &body).await;
    assert_eq!(status, 503);
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(fake.requests().len(), 3, "errors are recorded too");
}

#[tokio::test]
async fn slow_delays_the_answer() {
    let fake = start().await;
    let delay = Duration::from_millis(300);

    let started = Instant::now();
    let (status, reply) = post_json(&fake, &user("[[fake:slow=300]] wait")).await;
    assert!(started.elapsed() >= delay, "took {:?}", started.elapsed());
    assert_eq!(status, 200);
    assert_eq!(reply["choices"][0]["message"]["content"], "echo: wait");

    let mut body = user("wait");
    body["model"] = json!("fake-slow-300");
    let started = Instant::now();
    let (status, reply) = post_json(&fake, &body).await;
    assert!(started.elapsed() >= delay, "took {:?}", started.elapsed());
    assert_eq!(status, 200);
    assert_eq!(reply["model"], "fake-slow-300");

    let streamed = stream(&fake, &streaming("[[fake:slow=300]] wait")).await;
    let first = streamed.first_event_after.expect("an event");
    assert!(first >= delay, "first event after {first:?}");
    assert_eq!(streamed.text(), "echo: wait");
}

#[tokio::test]
async fn chunk_delay_spaces_out_events() {
    let fake = start().await;
    let started = Instant::now();
    let streamed = stream(&fake, &streaming("[[fake:chunk_delay=60]] a b c")).await;
    // 4 content chunks + finish chunk + [DONE] = 6 events, 5 gaps.
    assert!(
        started.elapsed() >= Duration::from_millis(5 * 60),
        "took {:?}",
        started.elapsed()
    );
    assert!(streamed.done);
    assert_eq!(streamed.text(), "echo: a b c");
}

#[tokio::test]
async fn tool_directives_make_tool_calls() {
    let fake = start().await;
    let prompt = r#"weather? [[fake:tool=get_weather:{"city": "Paris"}]] [[fake:tool=clock]]"#;
    let (status, reply) = post_json(&fake, &user(prompt)).await;
    assert_eq!(status, 200);
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], Value::Null);
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], r#"{"city": "Paris"}"#);
    assert_eq!(calls[1]["function"]["name"], "clock");
    assert_eq!(calls[1]["function"]["arguments"], "{}");
    let id0 = calls[0]["id"].as_str().expect("id");
    let id1 = calls[1]["id"].as_str().expect("id");
    assert!(id0.starts_with("call_") && id1.starts_with("call_"));
    assert_ne!(id0, id1);
}

#[tokio::test]
async fn tool_calls_stream_in_openai_delta_format() {
    let fake = start().await;
    let prompt = r#"[[fake:tool=get_weather:{"city":"Paris","unit":"C"}]][[fake:tool=clock]]"#;
    let streamed = stream(&fake, &streaming(prompt)).await;
    assert!(streamed.done);
    assert_eq!(streamed.finish_reason().as_deref(), Some("tool_calls"));
    assert_eq!(
        streamed.chunks[0]["choices"][0]["delta"]["role"],
        "assistant"
    );

    // Accumulate the deltas the way a client must.
    let mut calls: BTreeMap<u64, (String, String, String)> = BTreeMap::new();
    let mut fragments = 0;
    for chunk in &streamed.chunks {
        let Some(deltas) = chunk["choices"][0]["delta"]["tool_calls"].as_array() else {
            continue;
        };
        for delta in deltas {
            let index = delta["index"]
                .as_u64()
                .expect("every tool delta has an index");
            let entry = calls.entry(index).or_default();
            if let Some(id) = delta["id"].as_str() {
                entry.0 = id.to_owned();
            }
            if let Some(name) = delta["function"]["name"].as_str() {
                entry.1.push_str(name);
            }
            if let Some(args) = delta["function"]["arguments"].as_str() {
                entry.2.push_str(args);
                fragments += 1;
            }
        }
    }
    assert_eq!(calls.len(), 2);
    assert!(calls[&0].0.starts_with("call_"));
    assert_eq!(calls[&0].1, "get_weather");
    assert_eq!(calls[&0].2, r#"{"city":"Paris","unit":"C"}"#);
    assert_eq!(calls[&1].1, "clock");
    assert_eq!(calls[&1].2, "{}");
    assert!(fragments > 2, "arguments arrive in pieces");
    assert!(streamed.contents().iter().all(String::is_empty));
}

#[tokio::test]
async fn a_tool_result_continues_the_conversation() {
    let fake = start().await;
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "weather? [[fake:tool=get_weather]]"},
        {"role": "assistant", "content": null, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]});
    let (status, reply) = post_json(&fake, &body).await;
    assert_eq!(status, 200);
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "tool result: sunny, 21C"
    );
    assert!(reply["choices"][0]["message"].get("tool_calls").is_none());

    let mut body = body;
    body["stream"] = json!(true);
    let streamed = stream(&fake, &body).await;
    assert_eq!(streamed.text(), "tool result: sunny, 21C");
    assert_eq!(streamed.finish_reason().as_deref(), Some("stop"));
}

#[tokio::test]
async fn hang_outlasts_the_client_and_ends_at_shutdown() {
    let fake = start().await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let err = impatient
        .post(format!("{}/chat/completions", fake.base_url()))
        .json(&user("[[fake:hang=1]]"))
        .send()
        .await
        .expect_err("a hanging fake never answers");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(fake.requests().len(), 1, "hanging requests are recorded");

    // A patient client is released when the fake shuts down.
    let url = format!("{}/chat/completions", fake.base_url());
    let patient = tokio::spawn(async move {
        client()
            .post(url)
            .json(&user("[[fake:hang=1]]"))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    fake.wait_for_requests(2).await;
    tokio::time::timeout(Duration::from_secs(5), fake.shutdown())
        .await
        .expect("shutdown does not wait for hanging requests")
        .expect("clean shutdown");
    let outcome = tokio::time::timeout(Duration::from_secs(5), patient)
        .await
        .expect("patient client released")
        .expect("task");
    assert_eq!(outcome.expect("an answer"), 503);
}

#[tokio::test]
async fn drop_cuts_the_stream_after_two_events() {
    let fake = start().await;
    let streamed = stream(&fake, &streaming("[[fake:drop=1]] one two three four")).await;
    assert_eq!(streamed.chunks.len(), 2, "{streamed:?}");
    assert_eq!(streamed.text(), "echo: one ");
    assert!(!streamed.done);
    assert!(streamed.error.is_some(), "the stream ends in an error");

    // Without streaming, the headers arrive and the body is cut.
    let response = post(&fake, &user("[[fake:drop=1]]")).await;
    assert_eq!(response.status(), 200);
    assert!(response.bytes().await.is_err(), "the body never completes");
}

#[tokio::test]
async fn bad_requests_get_400_with_an_openai_error() {
    let fake = start().await;
    let (status, body) = post_garbage(&fake, "chat/completions").await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .expect("message")
            .contains("not valid JSON")
    );
    assert!(
        fake.requests().is_empty(),
        "unparseable bodies are not recorded"
    );

    for bad in [
        json!({"messages": []}),
        json!({"model": "m"}),
        user("[[fake:sloow=10]]"),
        user("[[fake:slow=10"),
    ] {
        let (status, body) = post_json(&fake, &bad).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}

#[test]
fn binary_prints_its_url_and_serves() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sbp-fake-llm"))
        .args(["--listen", "127.0.0.1:0", "--no-record"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("binary starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read line");
    let base_url = line
        .trim_end()
        .strip_prefix("sbp-fake-llm listening on ")
        .expect("banner")
        .to_owned();
    assert!(base_url.starts_with("http://127.0.0.1:") && base_url.ends_with("/v1"));

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let (reply, recorded) = runtime.block_on(async {
        let reply: Value = client()
            .post(format!("{base_url}/chat/completions"))
            .json(&user("from a process"))
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("json");
        let root = base_url.trim_end_matches("/v1");
        let recorded: Value = client()
            .get(format!("{root}/_fake/requests"))
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("json");
        (reply, recorded)
    });
    child.kill().expect("kill the child we started");
    child.wait().expect("reap");
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "echo: from a process"
    );
    assert_eq!(recorded, json!([]), "--no-record keeps nothing");
}
