//! L5, the MCP bridge: declared tools are registered; a backend call through
//! `POST /v1/sbp/sessions/{id}/tool_calls` reaches the surface as TOOL_CALL and its TOOL_RESULT
//! comes back as the HTTP answer; unknown call_ids are discarded; calls multiplex by call_id;
//! undeclared tools are refused; timeouts and disconnects end calls with an error instead of a
//! hang; and (with `sbp/echo`, which calls a tool when asked) the model's own call goes the same
//! way, and a surface dropping on it gives the model an error result instead of a deadlock.
//!
//! The backend endpoint is this gateway's own (neither the seeds nor SPEC name one): a gateway
//! answering it 404 / 405 has those checks skipped. Every request in flight runs in a
//! [`Spawned`] task, aborted when the check ends however it ends.

use std::sync::Arc;

use serde_json::{Value, json};

use super::nonce;
use crate::conformance::client::{
    Ctx, Resp, Session, Socket, Spawned, attach, is_uuid, reply_text,
};
use crate::conformance::outcome::{Outcome, Problem, ensure, fail, pass, pass_with, short, skip};

const TOOL: &str = "conformance_probe";

/// A backend tool call in flight.
type Pending = Spawned<Result<Resp, Problem>>;

/// SKIP when the backend tool-call endpoint is not offered (it is this gateway's own).
fn offered(resp: &Resp) -> Result<(), Problem> {
    resp.skip_if_missing("— backend tool-call endpoint not offered")
}

/// A session with a surface declaring [`TOOL`].
async fn tooled(ctx: &Ctx) -> Result<(Session, Socket, Value), Problem> {
    let (s, _) = ctx.new_session("conformance: a surface with tools").await?;
    let surface = json!({"device_type": "mobile", "mcp_tools": [TOOL],
                         "ui_capabilities": ["streaming"]});
    let (ws, attached) = attach(ctx, &s, json!({"surface_context": surface})).await?;
    Ok((s, ws, attached))
}

/// Starts a backend tool call; the answer comes when the surface answers (or the call ends).
fn call(ctx: &Arc<Ctx>, s: &Session, tool: &str, input: Value, timeout_ms: u64) -> Pending {
    let ctx = ctx.clone();
    let path = format!("/v1/sbp/sessions/{}/tool_calls", s.id);
    let token = s.token.clone();
    let body = json!({"tool_name": tool, "tool_input": input, "timeout_ms": timeout_ms});
    Spawned::spawn(async move { ctx.post(&path, Some(&token), &body).await })
}

/// The call's HTTP answer; SKIP when the endpoint is not offered.
async fn answer(pending: Pending) -> Result<Resp, Problem> {
    let resp = pending.join().await??;
    offered(&resp)?;
    Ok(resp)
}

/// The next frame, which must be a TOOL_CALL; the call's HTTP answer coming first (refused,
/// failed, or no such endpoint) ends the wait with that answer as the reason.
async fn call_frame(ws: &mut Socket, pending: &mut Pending) -> Result<Value, Problem> {
    tokio::select! {
        f = ws.expect_type("TOOL_CALL") => f,
        done = pending.handle() => {
            let resp = done.map_err(|e| fail(format!("the tool call request task failed: {e}")))??;
            offered(&resp)?;
            Err(fail(format!(
                "{} answered {} {} before any TOOL_CALL reached the surface",
                resp.what,
                resp.status,
                resp.quote()
            )))
        }
    }
}

/// The next TOOL_CALL on the socket, checked against what was called; returns its call_id.
async fn tool_call(
    ws: &mut Socket,
    pending: &mut Pending,
    tool: &str,
    input: &Value,
) -> Result<String, Problem> {
    let f = call_frame(ws, pending).await?;
    let id = f["call_id"]
        .as_str()
        .ok_or_else(|| fail(format!("TOOL_CALL without a call_id: {f}")))?
        .to_owned();
    ensure(is_uuid(&id), || {
        format!("TOOL_CALL call_id '{id}' is not a UUID")
    })?;
    ensure(f["tool_name"] == tool, || {
        format!(
            "TOOL_CALL tool_name is {}, expected \"{tool}\"",
            f["tool_name"]
        )
    })?;
    ensure(f["tool_input"] == *input, || {
        format!(
            "TOOL_CALL tool_input is {}, expected {input}",
            f["tool_input"]
        )
    })?;
    Ok(id)
}

/// The call_ids of two calls in flight, which must be two distinct UUIDs.
fn distinct_call_ids(a: &Value, b: &Value) -> Result<(String, String), Problem> {
    let id = |f: &Value| f["call_id"].as_str().unwrap_or_default().to_owned();
    let (ida, idb) = (id(a), id(b));
    ensure(is_uuid(&ida) && is_uuid(&idb) && ida != idb, || {
        format!("two calls in flight got call_ids '{ida}' and '{idb}': expected two distinct UUIDs")
    })?;
    Ok((ida, idb))
}

/// Checks a backend call's HTTP answer carries `result` for `call_id`.
fn answered_ok(resp: &Resp, call_id: &str, result: &Value) -> Result<(), Problem> {
    resp.expect(&[200])?;
    if let Some(st) = resp.body["status"].as_str() {
        ensure(st == "ok", || {
            format!("the call's status is '{st}': {}", resp.quote())
        })?;
    }
    if let Some(id) = resp.body["call_id"].as_str() {
        ensure(id == call_id, || {
            format!("the answer names call {id}, not {call_id}")
        })?;
    }
    ensure(resp.body["result"] == *result, || {
        format!(
            "the HTTP answer's result is {}, the surface sent {result}",
            short(&resp.body["result"].to_string(), 100)
        )
    })
}

/// Whether a call's answer says it failed (any of the forms gateways use), and how.
fn failed_how(resp: &Resp) -> Option<String> {
    if resp.status >= 400 {
        return Some(format!(
            "HTTP {} {}",
            resp.status,
            resp.error_code().unwrap_or("")
        ));
    }
    let status = resp.body["status"].as_str().filter(|s| *s != "ok");
    let error = resp.body["error"].as_str();
    match (status, error) {
        (Some(s), e) => Some(format!(
            "status '{s}'{}",
            e.map(|e| format!(", error '{e}'")).unwrap_or_default()
        )),
        (None, Some(e)) => Some(format!("error '{e}'")),
        (None, None) => None,
    }
}

pub async fn tools_registered(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: declare tools").await?;
    let tools = ["conformance_camera", "conformance_gps"];
    let surface = json!({"device_type": "mobile", "mcp_tools": tools});
    let (ws, attached) = attach(&ctx, &s, json!({"surface_context": surface})).await?;
    let registered = attached["mcp_tools_registered"].as_array().ok_or_else(|| {
        fail(format!(
            "SESSION_ATTACHED has no mcp_tools_registered array: {attached}"
        ))
    })?;
    for t in tools {
        ensure(registered.iter().any(|r| r == t), || {
            format!("mcp_tools_registered {registered:?} lacks \"{t}\" (an operator allowlist?)")
        })?;
    }
    ws.detach().await?;
    pass()
}

pub async fn tool_call_roundtrip(ctx: Arc<Ctx>) -> Outcome {
    let (s, mut ws, _) = tooled(&ctx).await?;
    let n = nonce();
    let input = json!({"nonce": n});
    let mut pending = call(&ctx, &s, TOOL, input.clone(), 10_000);
    let id = tool_call(&mut ws, &mut pending, TOOL, &input).await?;
    let result = json!({"echo": n});
    ws.send(json!({"type": "TOOL_RESULT", "call_id": id, "result": result, "error": null}))
        .await?;
    answered_ok(&answer(pending).await?, &id, &result)?;
    pass()
}

pub async fn unknown_call_id_ignored(ctx: Arc<Ctx>) -> Outcome {
    let (s, mut ws, _) = tooled(&ctx).await?;
    let input = json!({"resolution": "high"});
    let mut pending = call(&ctx, &s, TOOL, input.clone(), 10_000);
    let id = tool_call(&mut ws, &mut pending, TOOL, &input).await?;
    // A reply to a call this gateway never made must be dropped without harm.
    ws.send(
        json!({"type": "TOOL_RESULT", "call_id": format!("conformance-unknown-{}", nonce()),
                   "result": {"wrong": true}}),
    )
    .await?;
    let result = json!({"image": "conformance"});
    ws.send(json!({"type": "TOOL_RESULT", "call_id": id, "result": result}))
        .await?;
    answered_ok(&answer(pending).await?, &id, &result)?;
    pass()
}

pub async fn concurrent_calls(ctx: Arc<Ctx>) -> Outcome {
    let (s, mut ws, _) = tooled(&ctx).await?;
    let inputs = [json!({"n": 1}), json!({"n": 2})];
    let mut first = call(&ctx, &s, TOOL, inputs[0].clone(), 10_000);
    let a = call_frame(&mut ws, &mut first).await?;
    let mut second = call(&ctx, &s, TOOL, inputs[1].clone(), 10_000);
    let b = call_frame(&mut ws, &mut second).await?;
    let (ida, idb) = distinct_call_ids(&a, &b)?;
    // Answered in reverse order: correlation is by call_id, not by position.
    for f in [&b, &a] {
        let result = json!({"got": f["tool_input"]});
        ws.send(json!({"type": "TOOL_RESULT", "call_id": f["call_id"], "result": result}))
            .await?;
    }
    for (pending, input) in [(first, &inputs[0]), (second, &inputs[1])] {
        let resp = answer(pending).await?;
        let id = if a["tool_input"] == *input {
            &ida
        } else {
            &idb
        };
        answered_ok(&resp, id, &json!({"got": input}))?;
    }
    pass()
}

/// One backend call of [`TOOL`] answered by the surface: proves the endpoint is there (SKIP when
/// it is not) and that `input`'s TOOL_CALL was the next frame.
async fn roundtrip(
    ctx: &Arc<Ctx>,
    s: &Session,
    ws: &mut Socket,
    input: Value,
) -> Result<(), Problem> {
    let mut pending = call(ctx, s, TOOL, input.clone(), 10_000);
    let id = tool_call(ws, &mut pending, TOOL, &input).await?;
    ws.send(json!({"type": "TOOL_RESULT", "call_id": id, "result": {"ok": true}}))
        .await?;
    answered_ok(&answer(pending).await?, &id, &json!({"ok": true}))
}

pub async fn undeclared_tool_refused(ctx: Arc<Ctx>) -> Outcome {
    let (s, mut ws, _) = tooled(&ctx).await?;
    // First a declared call, so a 404 below is a refusal and not a missing endpoint.
    roundtrip(&ctx, &s, &mut ws, json!({"before": "refusal"})).await?;
    let resp = call(&ctx, &s, "conformance_undeclared", json!({}), 2_000)
        .join()
        .await??;
    let how = failed_how(&resp).ok_or_else(|| {
        fail(format!(
            "a call of an undeclared tool succeeded: {}",
            resp.quote()
        ))
    })?;
    if resp.status >= 400 {
        resp.expect_error(&[resp.status], "")?;
    }
    // The next frame must be the declared tool's call: the undeclared one never went out.
    roundtrip(&ctx, &s, &mut ws, json!({"after": "refusal"})).await?;
    pass_with(format!("refused with {how}"))
}

pub async fn tool_timeout(ctx: Arc<Ctx>) -> Outcome {
    let (s, mut ws, _) = tooled(&ctx).await?;
    let input = json!({"never": "answered"});
    let started = tokio::time::Instant::now();
    let mut pending = call(&ctx, &s, TOOL, input.clone(), 300);
    tool_call(&mut ws, &mut pending, TOOL, &input).await?;
    let resp = answer(pending).await?;
    let how = failed_how(&resp)
        .ok_or_else(|| fail(format!("an unanswered call did not fail: {}", resp.quote())))?;
    ensure(
        how.to_lowercase().contains("timeout") || matches!(resp.status, 408 | 504),
        || format!("the unanswered call ended with {how}, expected a timeout"),
    )?;
    pass_with(format!(
        "{how} after {} ms (timeout_ms 300)",
        started.elapsed().as_millis()
    ))
}

pub async fn disconnect_fails_calls(ctx: Arc<Ctx>) -> Outcome {
    let (s, mut ws, _) = tooled(&ctx).await?;
    let input = json!({"surface": "going away"});
    // Far longer than the checker waits: only the disconnect can end it in time.
    let mut pending = call(&ctx, &s, TOOL, input.clone(), 120_000);
    tool_call(&mut ws, &mut pending, TOOL, &input).await?;
    ws.drop_tcp();
    let resp = answer(pending).await?;
    let how = failed_how(&resp).ok_or_else(|| {
        fail(format!(
            "the call survived its surface's disconnect: {}",
            resp.quote()
        ))
    })?;
    pass_with(format!("ended with {how}"))
}

/// SKIP unless the model is `sbp/echo`, the one that calls a named tool on request.
fn echo_only(ctx: &Ctx) -> Result<(), Problem> {
    if ctx.model != "sbp/echo" {
        return Err(skip(format!(
            "needs a model that calls a named tool on request; '{}' cannot be told to (run with --model sbp/echo)",
            ctx.model
        )));
    }
    Ok(())
}

/// A completion asking the model for a tool call, in flight.
fn agent_turn(ctx: &Arc<Ctx>, s: &Session, text: String) -> Pending {
    let ctx = ctx.clone();
    let token = s.token.clone();
    Spawned::spawn(async move { ctx.chat(Some(&token), &text, Value::Null).await })
}

/// The model's TOOL_CALL of [`TOOL`] with `input`; its call_id. Text the model streams before
/// calling is fine; a finished turn without a call is not.
async fn model_call(ws: &mut Socket, input: &Value) -> Result<String, Problem> {
    loop {
        let f = ws.frame("the model's TOOL_CALL").await?;
        match f["type"].as_str() {
            Some("TOOL_CALL") => {
                ensure(f["tool_name"] == TOOL && f["tool_input"] == *input, || {
                    format!(
                        "the model's TOOL_CALL is {}, expected {TOOL} with {input}",
                        short(&f.to_string(), 160)
                    )
                })?;
                let id = f["call_id"].as_str().unwrap_or_default().to_owned();
                ensure(is_uuid(&id), || {
                    format!("TOOL_CALL call_id '{id}' is not a UUID")
                })?;
                return Ok(id);
            }
            Some("TURN_CHUNK") => {}
            _ => {
                return Err(fail(format!(
                    "the turn went on without calling the declared tool (was surface_{TOOL} offered to the model?): {}",
                    short(&f.to_string(), 160)
                )));
            }
        }
    }
}

pub async fn agent_tool_call(ctx: Arc<Ctx>) -> Outcome {
    echo_only(&ctx)?;
    let (s, mut ws, _) = tooled(&ctx).await?;
    let n = nonce();
    let input = json!({"nonce": n});
    let text = format!("[call {TOOL} {input}]");
    let chat = agent_turn(&ctx, &s, text);
    let id = model_call(&mut ws, &input).await?;
    let secret = format!("probe-{n}");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": id, "result": {"answer": secret}}))
        .await?;
    let resp = chat.join().await??;
    resp.expect(&[200])?;
    let reply = reply_text(&resp)?;
    ensure(reply.contains(&secret), || {
        format!(
            "the final reply does not carry the tool's result ({secret}): '{}'",
            short(&reply, 120)
        )
    })?;
    pass()
}

/// The seeds: "On timeout or disconnection, gateway MUST return an error tool result to the agent
/// (not deadlock)". `sbp/echo` answers a tool result with "Echo: <name> returned <content>", so
/// the error the gateway gave the model shows in the reply.
pub async fn agent_tool_disconnect(ctx: Arc<Ctx>) -> Outcome {
    echo_only(&ctx)?;
    let (s, mut ws, _) = tooled(&ctx).await?;
    let input = json!({"nonce": nonce()});
    let chat = agent_turn(&ctx, &s, format!("[call {TOOL} {input}]"));
    model_call(&mut ws, &input).await?;
    ws.drop_tcp();
    let resp = chat.join().await??;
    resp.expect(&[200]).map_err(|p| {
        fail(format!(
            "the turn did not survive its surface's disconnect: {p}"
        ))
    })?;
    let reply = reply_text(&resp)?;
    ensure(error_reached_model(&reply), || {
        format!(
            "the final reply shows no error tool result for the dropped call: '{}'",
            short(&reply, 160)
        )
    })?;
    pass_with(format!("the model saw: {}", short(&reply, 80)))
}

/// Whether an echo reply answers a tool result that says the call failed.
fn error_reached_model(reply: &str) -> bool {
    let lower = reply.to_lowercase();
    lower.contains("returned")
        && ["error", "disconnect", "timeout", "cancel", "fail"]
            .iter()
            .any(|w| lower.contains(w))
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderMap;
    use serde_json::{Value, json};

    use super::{answered_ok, distinct_call_ids, error_reached_model, failed_how};
    use crate::conformance::client::Resp;

    fn resp(status: u16, body: Value) -> Resp {
        Resp {
            what: "POST /tool_calls".into(),
            status,
            headers: HeaderMap::new(),
            body,
        }
    }

    const A: &str = "7f1c8a52-2b7e-4a43-9b7c-3d8f2f0e9a11";
    const B: &str = "0b6f7c1e-9d2a-4e55-8a44-52c0d1e3f6a2";

    #[test]
    fn call_ids_must_be_distinct_uuids() {
        let f = |id: &str| json!({"type": "TOOL_CALL", "call_id": id});
        assert!(distinct_call_ids(&f(A), &f(B)).is_ok());
        assert!(distinct_call_ids(&f(A), &f(A)).is_err());
        assert!(distinct_call_ids(&f(A), &f("call-2")).is_err());
        assert!(distinct_call_ids(&f(A), &json!({"type": "TOOL_CALL"})).is_err());
    }

    #[test]
    fn an_answer_must_carry_its_own_calls_result() {
        let result = json!({"got": 1});
        let ok = resp(200, json!({"status": "ok", "call_id": A, "result": result}));
        assert!(answered_ok(&ok, A, &result).is_ok());
        let crossed = answered_ok(&ok, B, &result).expect_err("refused");
        assert!(crossed.reason.contains("names call"), "{}", crossed.reason);
        let other = answered_ok(&ok, A, &json!({"got": 2})).expect_err("refused");
        assert!(
            other.reason.contains("the surface sent"),
            "{}",
            other.reason
        );
        let failed = resp(
            200,
            json!({"status": "timeout", "call_id": A, "error": "timeout"}),
        );
        assert!(answered_ok(&failed, A, &result).is_err());
        assert!(failed_how(&failed).is_some_and(|h| h.contains("timeout")));
        assert!(failed_how(&ok).is_none());
        assert!(failed_how(&resp(503, json!({}))).is_some());
    }

    #[test]
    fn the_model_must_see_an_error_result() {
        assert!(error_reached_model(
            "Echo: surface_conformance_probe returned {\"error\":\"surface disconnected\"}"
        ));
        assert!(!error_reached_model(
            "Echo: surface_conformance_probe returned {\"ok\":true}"
        ));
        assert!(!error_reached_model("Echo: [call conformance_probe]"));
    }
}
