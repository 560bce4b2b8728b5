//! Writes the seed corpora under `fuzz/corpus/<target>/`: small inputs of every shape the
//! gateway meets, made with the protocol crate's own writers (a bundle as an export seals it, a
//! token as an export signs it) plus a few near-misses. Deterministic: running it again rewrites
//! the same files. `cargo run --manifest-path fuzz/Cargo.toml --example seeds`

use std::path::{Path, PathBuf};

use sbp_protocol::bundle::{self, Envelope, EnvelopeSession, EnvelopeSnapshot, MessageOut};
use sbp_protocol::federation::{FedClaims, IdentityKey, sign_fed_token};
use sbp_protocol::frames::{SessionAttached, TetherTurn, ToolCall, TurnChunk, TurnComplete};
use sbp_protocol::token::{self, RoamingClaims};
use sbp_protocol::{ServerFrame, SurfaceContext};
use serde_json::{Value, json};
use uuid::Uuid;

fn dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

fn write(target: &str, seeds: &[(&str, Vec<u8>)]) -> std::io::Result<()> {
    let d = dir(target);
    std::fs::create_dir_all(&d)?;
    for (i, (name, bytes)) in seeds.iter().enumerate() {
        std::fs::write(d.join(format!("seed-{i:02}-{name}")), bytes)?;
    }
    Ok(())
}

fn text(v: &Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

const SESSION: &str = "0190b6b2-5c1e-7d3a-9f00-3c5d2e1f4a01";
const TOKEN_SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-32b";

fn frames() -> Vec<(&'static str, Vec<u8>)> {
    let ctx = json!({
        "device_type": "mobile",
        "ui_capabilities": ["streaming", "markdown"],
        "max_output_tokens": 60,
        "locale": "fr-FR",
        "mcp_tools": ["gps", {"name": "camera", "input_schema": {"type": "object"}}],
        "mcp_tool_schemas": [{"name": "gps", "description": "where", "input_schema": {"type": "object"}}],
        "vendor": {"x": 1},
    });
    let attached = ServerFrame::SessionAttached(Box::new(SessionAttached {
        session_id: SESSION.into(),
        surface_id: Some("s1".into()),
        device_type: "mobile".into(),
        queued_turns: 2,
        tether_turns_pending: 2,
        mcp_tools_registered: vec!["gps".into()],
        sbp_version: "1.2".into(),
        sbp_level: "L5".into(),
        surface_context: Some(SurfaceContext::from_value(&ctx)),
        extensions: vec!["ack".into(), "last_seq".into()],
        last_seq_reset: false,
    }));
    let server = [
        attached,
        ServerFrame::TetherTurn(TetherTurn {
            turn_index: 0,
            role: "assistant".into(),
            content: Some("Your flight prices dropped.".into()),
            model_used: Some("gpt-4o".into()),
            created_at: "2026-01-02T03:04:05.678Z".into(),
            seq: 7,
            session_id: Some(SESSION.into()),
            chunk_id: Some("c-1".into()),
            turn: None,
        }
        .with_aliases()),
        ServerFrame::TurnChunk(TurnChunk {
            session_id: Some(SESSION.into()),
            step: Some(3),
            model: Some("gpt-4o".into()),
            ..TurnChunk::new("c-2".into(), "Hel".into())
        }),
        ServerFrame::TurnComplete(TurnComplete {
            session_id: Some(SESSION.into()),
            step: Some(3),
            ..TurnComplete::new("c-2".into(), Some(8), None)
        }),
        ServerFrame::ToolCall(ToolCall {
            call_id: "4c1d2e3f-0000-4000-8000-000000000001".into(),
            tool_name: "gps".into(),
            tool_input: json!({"accuracy": "high", "n": [1, 2.5, null]}),
            timeout_ms: Some(5000),
        }),
        ServerFrame::Ping,
        ServerFrame::ProtocolError {
            detail: "Expected ATTACH_SESSION".into(),
        },
    ];
    let mut seeds: Vec<(&str, Vec<u8>)> = vec![
        (
            "attach",
            text(
                &json!({"type": "ATTACH_SESSION", "session_id": SESSION, "session_token": "tok", "surface_context": ctx}),
            ),
        ),
        (
            "attach-surface-alias-last-seq",
            text(
                &json!({"type": "ATTACH_SESSION", "session_id": SESSION, "surface": {"device_type": "iot"}, "last_seq": 3}),
            ),
        ),
        ("ack", text(&json!({"type": "ACK", "seq": 12}))),
        ("detach", text(&json!({"type": "DETACH"}))),
        ("pong", text(&json!({"type": "PONG"}))),
        (
            "tool-result",
            text(
                &json!({"type": "TOOL_RESULT", "call_id": "c", "result": {"lat": 35.68, "lon": 139.76}}),
            ),
        ),
        (
            "tool-error",
            text(&json!({"type": "TOOL_RESULT", "call_id": "c", "error": {"code": 1}})),
        ),
        ("unknown", text(&json!({"type": "HELLO", "x": [1]}))),
        ("ack-negative", br#"{"type":"ACK","seq":-1}"#.to_vec()),
        (
            "last-seq-huge",
            br#"{"type":"ATTACH_SESSION","session_id":"x","last_seq":18446744073709551616}"#
                .to_vec(),
        ),
        ("no-type", br#"{"session_id":"x"}"#.to_vec()),
    ];
    let names = [
        "server-attached",
        "server-tether",
        "server-chunk",
        "server-complete",
        "server-toolcall",
        "server-ping",
        "server-error",
    ];
    for (name, f) in names.iter().zip(server) {
        seeds.push((name, f.to_json().into_bytes()));
    }
    seeds
}

fn chat() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "simple",
            text(&json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Plan a trip to Tokyo"}]})),
        ),
        (
            "tools-and-calls",
            text(&json!({
                "model": "gpt-4o",
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": 200,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
                "tool_choice": "auto",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\":21}"},
                ],
            })),
        ),
        (
            "sbp-namespace",
            text(&json!({
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}],
                "sbp": {"session_id": SESSION, "resume": true, "checkpoint_every": 2, "force_new_session": false, "session_token": "t", "vendor": 1},
                "max_completion_tokens": 30,
                "temperature": 0.2,
            })),
        ),
        ("empty-messages", br#"{"messages":[]}"#.to_vec()),
        ("bad-role", br#"{"messages":[{"role":5}],"stream":"yes"}"#.to_vec()),
        ("null-fields", br#"{"model":null,"messages":[{"role":"user"}],"tools":null,"tool_choice":null,"sbp":null}"#.to_vec()),
    ]
}

/// A bundle exactly as an export writes it: envelope, messages in canonical pieces, sealed.
fn exported_bundle() -> Vec<u8> {
    let bodies = [
        json!({"role": "user", "content": "Plan a trip"}),
        json!({"role": "assistant", "content": "Day 1: Asakusa.", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "{\"ok\":true}"}),
    ];
    let messages = bodies.iter().enumerate().map(|(i, b)| MessageOut {
        body: b,
        role: b["role"].as_str().unwrap_or("user"),
        model_used: (i == 1).then_some("gpt-4o"),
        cost_usd: (i == 1).then_some(0.0012),
        created_at: "2026-01-02T03:04:05.678Z",
    });
    let (raw, cost) = bundle::write_messages(messages);
    let mut raw_list = Vec::with_capacity(raw.len() + 2);
    raw_list.push(b'[');
    raw_list.extend_from_slice(&raw);
    raw_list.push(b']');
    let state = json!({"action": "turn", "n": 1});
    let memory = json!({"trip": "Tokyo"});
    let envelope = Envelope {
        exported_at: "2026-01-02T03:05:00Z",
        label: Some("continue on mobile"),
        session: EnvelopeSession {
            id: Uuid::from_u128(0x0190_b6b2_5c1e_7d3a_9f00_3c5d_2e1f_4a01),
            agent_id: "agent-a",
            status: "suspended",
            last_task: Some("Plan a trip"),
            created_at: "2026-01-02T03:00:00Z",
            step_count: 1,
            model: Some("gpt-4o"),
        },
        memory: Some((bundle::MEMORY_SCHEMA_KV, &memory)),
        snapshot: Some(EnvelopeSnapshot {
            id: Uuid::from_u128(7),
            kind: "post_action",
            step_count: 1,
            message_count: 3,
            model: Some("gpt-4o"),
            current_task: None,
            created_at: "2026-01-02T03:04:06Z",
            state: &state,
        }),
        message_count: 3,
        total_cost_usd: cost,
        export_id: Uuid::from_u128(9),
        exported_by: "sbp/0.1.0",
    };
    let mut map = envelope.to_map();
    let (_, bytes) = bundle::seal_with_raw(&mut map, "messages", &raw_list);
    bytes
}

fn bundles() -> Vec<(&'static str, Vec<u8>)> {
    let exported = exported_bundle();
    // The reference server's shape: its digest under `hash`, a snapshot that copies messages.
    let mut reference = serde_json::from_slice::<Value>(&exported)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    reference.insert(
        "state_snapshot".into(),
        json!({"step": 1, "messages": [{"role": "user", "content": "Plan a trip"}]}),
    );
    reference.insert("memory".into(), json!({}));
    let (cid, _) = bundle::seal(&mut reference);
    reference.remove("bundle_cid");
    reference.insert("hash".into(), Value::String(cid));
    vec![
        ("exported", exported),
        ("reference-shape", text(&Value::Object(reference))),
        ("no-digest", br#"{"session":{"id":"x"},"messages":[{"role":"user","content":"a"}]}"#.to_vec()),
        ("bad-message", br#"{"session":{},"messages":[{"role":""},{"content":{"a":1}}],"bundle_cid":"00"}"#.to_vec()),
        ("big-counts", br#"{"session":{"step_count":9223372036854775808},"messages":[],"metadata":{"message_count":18446744073709551615},"state_snapshot":{"step_count":-1}}"#.to_vec()),
    ]
}

fn canonical() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("floats", br#"[1e16, 1e-05, -0.0, 0.1, 100.0, 1.7976931348623157e308, 5e-324, 123456789.123]"#.to_vec()),
        ("ints", br#"[0, -1, 18446744073709551615, -9223372036854775808, 18446744073709551616]"#.to_vec()),
        ("strings", "{\"b\":\"\\u00e9\\ud83d\\ude00\\u007f\\n\\t\\\"\",\"a\":\"caf\u{e9} \u{1F600}\",\"\":null}".as_bytes().to_vec()),
        ("nested", br#"{"z":{"y":[{"x":true,"w":false}],"v":{}},"a":[[],[[]]]}"#.to_vec()),
        ("float-bits", 0.1f64.to_le_bytes().to_vec()),
        ("bundle", exported_bundle()),
    ]
}

fn tokens() -> Vec<(&'static str, Vec<u8>)> {
    let claims = RoamingClaims {
        sub: "b3c22de3-7743-4946-aaf7-9174af15b659".into(),
        sid: SESSION.into(),
        iat: 1_795_339_654,
        exp: 1_795_343_254,
        iss: None,
    };
    let good = token::sign(&claims, TOKEN_SECRET);
    let mut tampered = good.clone().into_bytes();
    if let Some(b) = tampered.get_mut(40) {
        *b = if *b == b'A' { b'B' } else { b'A' };
    }
    vec![
        ("signed", good.clone().into_bytes()),
        ("tampered", tampered),
        ("two-segments", b"eyJhbGciOiAiSFMyNTYifQ.eyJ9".to_vec()),
        ("alg-none", b"eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0.".to_vec()),
        ("structured", (0u8..64).collect()),
    ]
}

fn fed_tokens() -> Vec<(&'static str, Vec<u8>)> {
    let key = IdentityKey::from_seed([7; 32]);
    let claims = FedClaims {
        iss: "a".repeat(32),
        aud: "b".repeat(32),
        sub: "5f0c3e6b7f1d2a9c8e4b6a1d3f5e7c9b0a2d4f6e8c1b3a5d7f9e0c2b4a6d8f1e".into(),
        htm: "GET".into(),
        htu: "/v1/sbp/bundles/5f0c3e6b7f1d2a9c8e4b6a1d3f5e7c9b0a2d4f6e8c1b3a5d7f9e0c2b4a6d8f1e"
            .into(),
        iat: 1_800_000_000,
        exp: 1_800_000_120,
        jti: SESSION.into(),
    };
    let good = sign_fed_token(&claims, &key);
    let (input, _) = good.rsplit_once('.').unwrap_or((&good, ""));
    let roaming = token::sign(
        &RoamingClaims {
            sub: "b3c22de3-7743-4946-aaf7-9174af15b659".into(),
            sid: SESSION.into(),
            iat: 1_795_339_654,
            exp: 1_795_343_254,
            iss: Some("a".repeat(32)),
        },
        TOKEN_SECRET,
    );
    vec![
        ("signed", good.clone().into_bytes()),
        ("unsigned", format!("{input}.").into_bytes()),
        (
            "alg-none",
            b"eyJhbGciOiJub25lIiwia2lkIjoiayIsInR5cCI6InNicC1mZWQrand0In0.e30.".to_vec(),
        ),
        ("roaming", roaming.into_bytes()),
        ("structured", (0u8..128).collect()),
    ]
}

fn main() -> std::io::Result<()> {
    write("frames", &frames())?;
    write("chat_request", &chat())?;
    write("bundle", &bundles())?;
    write("canonical", &canonical())?;
    write("token", &tokens())?;
    write("fed_token_peek", &fed_tokens())?;
    println!("seed corpora written under {}", dir("").display());
    Ok(())
}
