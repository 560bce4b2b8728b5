//! L2, tether and resume: the ATTACH_SESSION handshake and its refusals with their close codes,
//! live streaming, the Tether after DETACH and after a dropped connection (with the ACK /
//! `last_seq` extension when the gateway advertises it), 202 for a suspended session (a SPEC
//! SHOULD), tolerance of unknown frames, and what a second surface gets (one surface per session
//! is this gateway's design, not a requirement: the check notes what the gateway does). The
//! Tether's durability across a restart is a MUST no client can observe: its row says so.
//!
//! Surfaces that read live turns declare the `streaming` capability: the seeds let a gateway
//! send a surface without it a complete turn instead of TURN_CHUNKs.

use std::sync::Arc;

use serde_json::{Value, json};

use super::nonce;
use crate::conformance::client::{
    Ctx, Socket, WsEvent, attach, attach_frame, code_text, has_extension, queued, reply_text,
    session_id_of,
};
use crate::conformance::outcome::{
    Outcome, Problem, ensure, fail, not_observable, pass, pass_with, short,
};

/// A surface that asks for live turns as TURN_CHUNKs.
fn streaming(extra: Value) -> Value {
    let mut surface = json!({"ui_capabilities": ["streaming"]});
    if let (Some(s), Value::Object(extra)) = (surface.as_object_mut(), extra) {
        s.extend(extra);
    }
    json!({"surface_context": surface})
}

pub async fn attach_handshake(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: attach").await?;
    let (ws, attached) = attach(&ctx, &s, json!({})).await?;
    ensure(attached["session_id"] == s.id.as_str(), || {
        format!(
            "SESSION_ATTACHED.session_id is {}, expected {}",
            attached["session_id"], s.id
        )
    })?;
    queued(&attached)?;
    let frames = ws.detach().await?;
    ensure(frames.is_empty(), || {
        format!(
            "unexpected frames before the close after DETACH: {}",
            list(&frames)
        )
    })?;
    match attached["sbp_level"].as_str() {
        Some(level) => pass_with(format!("advertises sbp_level {level}")),
        None => pass(),
    }
}

/// Frames, quoted for a reason.
fn list(frames: &[Value]) -> String {
    short(
        &frames
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        200,
    )
}

/// Expects an error frame of type `ty` and then the close `code`.
async fn refused(ws: &mut Socket, ty: &str, code: u16) -> Outcome {
    let (frames, got) = ws.closed(&format!("{ty} and close {code}")).await?;
    refusal(&frames, got, ty, code)?;
    pass()
}

/// A refusal is a `ty` frame before the connection ends, and the close `code`.
fn refusal(frames: &[Value], got: Option<u16>, ty: &str, code: u16) -> Result<(), Problem> {
    ensure(frames.iter().any(|f| f["type"] == ty), || {
        format!(
            "expected a {ty} frame before the close, got {}",
            list(frames)
        )
    })?;
    ensure(got == Some(code), || {
        format!("expected close code {code}, got {}", code_text(got))
    })
}

pub async fn first_frame_must_attach(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: wrong first frame").await?;
    let mut ws = Socket::connect(&ctx, &s.id).await?;
    ws.send(json!({"type": "PONG"})).await?;
    refused(&mut ws, "PROTOCOL_ERROR", 1003).await
}

pub async fn attach_unknown_session(ctx: Arc<Ctx>) -> Outcome {
    let unknown = uuid::Uuid::new_v4().to_string();
    let mut ws = Socket::connect(&ctx, &unknown).await?;
    ws.send(json!({"type": "ATTACH_SESSION", "session_id": unknown,
                   "session_token": "sbp_conformance-no-such-session"}))
        .await?;
    refused(&mut ws, "SESSION_NOT_FOUND", 4004).await
}

pub async fn attach_bad_token(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: guarded surface").await?;
    let mut ws = Socket::connect(&ctx, &s.id).await?;
    ws.send(json!({"type": "ATTACH_SESSION", "session_id": s.id,
                   "session_token": format!("sbp_conformance-wrong-{}", nonce())}))
        .await?;
    refused(&mut ws, "FORBIDDEN", 4003).await
}

pub async fn live_streaming(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: live").await?;
    let (mut ws, _) = attach(&ctx, &s, streaming(json!({}))).await?;
    let resp = ctx
        .chat(
            Some(&s.token),
            &format!("stream this {}", nonce()),
            Value::Null,
        )
        .await?;
    resp.expect(&[200])?;
    let reply = reply_text(&resp)?;
    let (streamed, _) = ws.live_turn().await?;
    ensure(streamed == reply, || {
        format!(
            "the surface got '{}', the HTTP reply was '{}'",
            short(&streamed, 60),
            short(&reply, 60)
        )
    })?;
    pass()
}

/// Reads a TETHER_TURN and checks it is the turn whose text is `text`.
async fn tether_turn(ws: &mut Socket, text: &str) -> Result<Value, Problem> {
    let turn = ws.expect_type("TETHER_TURN").await?;
    first_drained(&turn, text)?;
    Ok(turn)
}

/// The first TETHER_TURN of a drain: the turn whose text is `text`, with a role, at index 0.
fn first_drained(turn: &Value, text: &str) -> Result<(), Problem> {
    ensure(turn["content"] == text, || {
        format!(
            "TETHER_TURN content is {}, expected '{}'",
            short(&turn["content"].to_string(), 80),
            short(text, 80)
        )
    })?;
    ensure(turn["role"].is_string(), || {
        format!("TETHER_TURN without a role: {turn}")
    })?;
    if let Some(i) = turn.get("turn_index").filter(|v| !v.is_null()) {
        ensure(*i == 0, || {
            format!("the first TETHER_TURN of a drain has turn_index {i}, expected 0")
        })?;
    }
    Ok(())
}

/// After a drain, nothing more: any frame is the turn again or something unasked for.
fn drained_once(after: &[Value]) -> Result<(), Problem> {
    ensure(after.is_empty(), || {
        format!("frames after the drain (the turn twice?): {}", list(after))
    })
}

/// Re-attaches with `extra` and expects nothing queued and nothing drained.
async fn nothing_queued(
    ctx: &Ctx,
    s: &crate::conformance::client::Session,
    extra: Value,
) -> Result<(), Problem> {
    let (ws, attached) = attach(ctx, s, extra).await?;
    let n = queued(&attached)?;
    ensure(n == 0, || {
        format!("the re-attach found {n} queued turn(s), expected 0")
    })?;
    let frames = ws.detach().await?;
    ensure(frames.is_empty(), || {
        format!("the re-attach drained frames anyway: {}", list(&frames))
    })
}

pub async fn tether_after_detach(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: tether").await?;
    let (ws, _) = attach(&ctx, &s, json!({})).await?;
    ws.detach().await?;
    // The close ends the connection, not necessarily the gateway's handling of DETACH.
    ctx.wait_status(&s, "suspended").await?;
    let text = ctx
        .produce_turn(&s, &format!("while you were away {}", nonce()))
        .await?;
    let (mut ws, attached) = attach(&ctx, &s, json!({})).await?;
    let n = queued(&attached)?;
    ensure(n == 1, || {
        format!("SESSION_ATTACHED counts {n} queued turns, expected 1")
    })?;
    tether_turn(&mut ws, &text).await?;
    drained_once(&ws.detach().await?)?;
    nothing_queued(&ctx, &s, json!({})).await?;
    pass()
}

pub async fn drop_suspends(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: drop").await?;
    let (ws, _) = attach(&ctx, &s, json!({})).await?;
    ws.drop_tcp();
    ctx.wait_status(&s, "suspended").await?;
    pass()
}

pub async fn drain_after_drop(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: drain after a drop").await?;
    let (ws, attached) = attach(&ctx, &s, json!({"last_seq": 0})).await?;
    // With the ACK extension a turn stays queued until acknowledged, so it may be pushed before
    // the gateway has even noticed the drop; a spec-only gateway is given that time first.
    let ack_mode = has_extension(&attached, "last_seq") && has_extension(&attached, "ack");
    ws.drop_tcp();
    if !ack_mode {
        ctx.wait_status(&s, "suspended").await?;
    }
    let text = ctx
        .produce_turn(&s, &format!("pushed after the drop {}", nonce()))
        .await?;
    let (mut ws, attached) = attach(&ctx, &s, json!({"last_seq": 0})).await?;
    let n = queued(&attached)?;
    ensure(n == 1, || {
        format!("the re-attach counts {n} queued turns, expected 1")
    })?;
    let turn = tether_turn(&mut ws, &text).await?;
    if !ack_mode {
        drained_once(&ws.detach().await?)?;
        nothing_queued(&ctx, &s, json!({})).await?;
        return pass_with(
            "no ack/last_seq extension advertised: waited for suspension, no ACK sent",
        );
    }
    let seq = turn["seq"]
        .as_u64()
        .ok_or_else(|| fail(format!("TETHER_TURN without a seq in ack mode: {turn}")))?;
    ws.send(json!({"type": "ACK", "seq": seq})).await?;
    drained_once(&ws.detach().await?)?;
    // last_seq 0 would resend anything not acknowledged: nothing proves the ACK was kept.
    nothing_queued(&ctx, &s, json!({"last_seq": 0})).await?;
    pass()
}

/// SPEC 6.3: a completion on a suspended session SHOULD get 202 with `resume_available`. A SHOULD:
/// a gateway that answers otherwise is reported as a warning (the check's requirement softens
/// its failures). How to resume explicitly is not defined, so that half is only a note.
pub async fn suspended_returns_202(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: suspend me").await?;
    let (ws, _) = attach(&ctx, &s, json!({})).await?;
    ws.detach().await?;
    ctx.wait_status(&s, "suspended").await?;
    let resp = ctx
        .chat(Some(&s.token), "conformance: are you there?", Value::Null)
        .await?;
    ensure(resp.status == 202, || {
        format!(
            "{}: answered {} where SPEC 6.3 says a suspended session SHOULD get 202 resume_available: {}",
            resp.what,
            resp.status,
            resp.quote()
        )
    })?;
    ensure(
        resp.body.pointer("/sbp/resume_available") == Some(&json!(true)),
        || format!("202 without sbp.resume_available: true: {}", resp.quote()),
    )?;
    ensure(
        resp.body.pointer("/sbp/session_id") == Some(&json!(s.id)),
        || format!("202 names another session: {}", resp.quote()),
    )?;
    let resumed = ctx
        .chat(
            Some(&s.token),
            "conformance: yes, resume",
            json!({"session_id": s.id, "force_new_session": false}),
        )
        .await?;
    let how = match (resumed.status, session_id_of(&resumed)) {
        (200, Ok(id)) if id == s.id => "answered 200 on the same session".to_owned(),
        (status, Ok(id)) => format!("answered {status} naming session {id}"),
        (status, Err(_)) => format!("answered {status}"),
    };
    pass_with(format!(
        "an explicit resume (sbp.session_id, not defined by SPEC) {how}"
    ))
}

pub async fn unknown_frames_ignored(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: forward compatible").await?;
    let (mut ws, _) = attach(&ctx, &s, streaming(json!({}))).await?;
    ws.send(json!({"type": "PONG"})).await?;
    ws.send(json!({"type": "CONFORMANCE_FUTURE_FRAME", "payload": {"x": 1}}))
        .await?;
    let resp = ctx
        .chat(Some(&s.token), "conformance: still there?", Value::Null)
        .await?;
    resp.expect(&[200])?;
    ws.live_turn().await?;
    pass()
}

/// Neither the seeds nor SPEC say what a second surface on the same session does to the first
/// (this gateway closes the first, code 4409): the second must get the next turn; what became of
/// the first is noted, not judged.
pub async fn second_surface_displaces(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: two surfaces").await?;
    let (mut first, _) = attach(&ctx, &s, streaming(json!({"device_type": "mobile"}))).await?;
    let mut second = Socket::connect(&ctx, &s.id).await?;
    second
        .send(attach_frame(
            &s,
            streaming(json!({"device_type": "desktop"})),
        ))
        .await?;
    second.expect_type("SESSION_ATTACHED").await?;
    let resp = ctx
        .chat(Some(&s.token), "conformance: who gets this?", Value::Null)
        .await?;
    resp.expect(&[200])?;
    let reply = reply_text(&resp)?;
    let (streamed, _) = second.live_turn().await?;
    ensure(streamed == reply, || {
        format!(
            "the second surface got '{}', the HTTP reply was '{}'",
            short(&streamed, 60),
            short(&reply, 60)
        )
    })?;
    // The turn has been sent by now: whatever the first surface got is already on its way.
    let fate = loop {
        match first.next_within(FIRST_FATE).await? {
            None => break "stayed open without the turn".to_owned(),
            Some(WsEvent::Closed(code)) => break format!("was closed ({})", code_text(code)),
            Some(WsEvent::Frame(f))
                if f["type"] == "TURN_CHUNK" || f["type"] == "TURN_COMPLETE" =>
            {
                break "stayed attached and got the turn too".to_owned();
            }
            Some(WsEvent::Frame(_)) => {}
        }
    };
    pass_with(format!("the first surface {fate}"))
}

/// How long the first surface is watched once the turn has gone out.
const FIRST_FATE: std::time::Duration = std::time::Duration::from_millis(300);

pub async fn tether_survives_restart(_ctx: Arc<Ctx>) -> Outcome {
    Err(not_observable(
        "not observable from outside: \"the Tether backend MUST survive gateway process restart\" needs the gateway restarted while a turn is queued; verify by hand",
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{drained_once, first_drained, refusal};

    #[test]
    fn a_refusal_needs_its_frame_and_its_close_code() {
        let frame = [json!({"type": "FORBIDDEN", "detail": "no"})];
        assert!(refusal(&frame, Some(4003), "FORBIDDEN", 4003).is_ok());
        let wrong_code = refusal(&frame, Some(1000), "FORBIDDEN", 4003).expect_err("refused");
        assert!(
            wrong_code
                .reason
                .contains("expected close code 4003, got code 1000")
        );
        let no_code = refusal(&frame, None, "FORBIDDEN", 4003).expect_err("refused");
        assert!(no_code.reason.contains("no close code"));
        let no_frame = refusal(&[], Some(4003), "FORBIDDEN", 4003).expect_err("refused");
        assert!(no_frame.reason.contains("expected a FORBIDDEN frame"));
    }

    #[test]
    fn a_drain_delivers_the_turn_once() {
        let turn =
            json!({"type": "TETHER_TURN", "role": "assistant", "content": "hi", "turn_index": 0});
        assert!(first_drained(&turn, "hi").is_ok());
        assert!(first_drained(&turn, "other").is_err());
        let later =
            json!({"type": "TETHER_TURN", "role": "assistant", "content": "hi", "turn_index": 1});
        assert!(first_drained(&later, "hi").is_err());
        let roleless = json!({"type": "TETHER_TURN", "content": "hi"});
        assert!(first_drained(&roleless, "hi").is_err());
        assert!(drained_once(&[]).is_ok());
        let again = drained_once(&[turn]).expect_err("refused");
        assert!(again.reason.contains("the turn twice"), "{}", again.reason);
    }
}
