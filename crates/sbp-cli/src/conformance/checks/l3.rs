//! L3, roaming: export (token and bundle CID), the bundle's content address, token inspection,
//! import and its single use, `allow_reuse` forks, tampered tokens and bundles, fork, handoff and
//! lineage. Response fields are read under the spec's, the HTTP docs' and the reference server's
//! names alike. Fork, handoff and lineage are only RECOMMENDED by the seeds and token inspection
//! is SPEC's alone: a gateway without them (404 / 405) is skipped, not failed.

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Value, json};

use super::nonce;
use crate::conformance::client::{Ctx, Resp, Session, first, first_str, is_uuid};
use crate::conformance::outcome::{
    Outcome, Problem, Status, ensure, fail, pass, pass_with, short, skip,
};

/// A completed export.
struct Exported {
    token: String,
    cid: String,
    /// SPEC's `export_id`; the seeds require only `{roaming_token, bundle_cid, ...}`.
    export_id: Option<String>,
    resp: Resp,
}

/// SKIP for an endpoint the seeds only recommend (or only SPEC names), when it is not there.
fn recommended(resp: &Resp) -> Result<(), Problem> {
    resp.skip_if_missing("— recommended, not implemented")
}

fn is_jwt(t: &str) -> bool {
    let parts: Vec<&str> = t.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

async fn do_export(ctx: &Ctx, s: &Session, extra: Value) -> Result<Exported, Problem> {
    let mut body = json!({"ttl_seconds": 3600, "label": "conformance"});
    if let (Some(b), Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    let resp = ctx
        .post(
            &format!("/v1/sbp/sessions/{}/export", s.id),
            Some(&s.token),
            &body,
        )
        .await?;
    resp.expect(&[200, 201])?;
    let token = first_str(&resp.body, &["roaming_token", "token"]).ok_or_else(|| {
        fail(format!(
            "{}: no roaming_token in {}",
            resp.what,
            resp.quote()
        ))
    })?;
    ensure(is_jwt(&token), || {
        format!("roaming_token is not a compact JWT (three base64url segments): {token}")
    })?;
    let cid = first_str(&resp.body, &["bundle_cid", "bundle_hash", "hash"]).ok_or_else(|| {
        fail(format!(
            "{}: no bundle_cid / bundle_hash in {}",
            resp.what,
            resp.quote()
        ))
    })?;
    ensure(is_hex64(&cid), || {
        format!("bundle_cid '{cid}' is not 64 hex digits")
    })?;
    let export_id = first_str(&resp.body, &["export_id", "origin_export_id"]);
    if let Some(id) = &export_id {
        ensure(is_uuid(id), || {
            format!("export_id '{id}' is not a UUID (SPEC 8.2)")
        })?;
    }
    Ok(Exported {
        token,
        cid,
        export_id,
        resp,
    })
}

/// The session an import, fork or handoff created: id under any of its names, and its token.
fn created(resp: &Resp, ids: &[&str], tokens: &[&str]) -> Result<Session, Problem> {
    let id = first_str(&resp.body, ids).ok_or_else(|| {
        fail(format!(
            "{}: no new session id ({}) in {}",
            resp.what,
            ids.join(" / "),
            resp.quote()
        ))
    })?;
    ensure(is_uuid(&id), || {
        format!("{}: new session id '{id}' is not a UUID", resp.what)
    })?;
    let token = first_str(&resp.body, tokens)
        .or_else(|| resp.header("x-session-token"))
        .ok_or_else(|| {
            fail(format!(
                "{}: no token for the new session ({})",
                resp.what,
                tokens.join(" / ")
            ))
        })?;
    Ok(Session { id, token })
}

const IMPORT_ID: [&str; 3] = ["new_session_id", "session_id", "session.id"];
const IMPORT_TOKEN: [&str; 3] = [
    "new_session_token",
    "session_token",
    "session.session_token",
];

async fn do_import(ctx: &Ctx, body: Value) -> Result<Resp, Problem> {
    ctx.post("/v1/sbp/sessions/import", None, &body).await
}

/// Whether the transcript of `s` holds a user message `text`; `None` when it cannot be read.
async fn holds(ctx: &Ctx, s: &Session, text: &str) -> Result<Option<bool>, Problem> {
    match ctx.transcript(s).await {
        Ok(t) => Ok(Some(t.iter().any(|(r, c)| r == "user" && c == text))),
        Err(p) if p.status == Status::Skip => Ok(None),
        Err(p) => Err(p),
    }
}

pub async fn export(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: export me").await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    if let Some(id) = first_str(&e.resp.body, &["session_id", "source_session_id"]) {
        ensure(id == s.id, || {
            format!("the export names session {id}, not {}", s.id)
        })?;
    }
    pass()
}

/// The exported bundle itself, when the gateway returns it (`include_bundle`).
async fn exported_bundle(
    ctx: &Ctx,
    s: &Session,
) -> Result<(Exported, serde_json::Map<String, Value>), Problem> {
    let e = do_export(ctx, s, json!({"include_bundle": true})).await?;
    match e.resp.body.get("bundle") {
        Some(Value::Object(b)) => {
            let b = b.clone();
            Ok((e, b))
        }
        _ => Err(skip(
            "the export answer carries no bundle (include_bundle: true), so it cannot be checked here",
        )),
    }
}

pub async fn bundle_cid(ctx: Arc<Ctx>) -> Outcome {
    let text = format!("conformance: seal me {}", nonce());
    let (s, _) = ctx.new_session(&text).await?;
    let (e, bundle) = exported_bundle(&ctx, &s).await?;
    for field in ["sbp_version", "session", "messages", "memory", "metadata"] {
        ensure(bundle.contains_key(field), || {
            format!("the bundle has no `{field}`")
        })?;
    }
    ensure(
        bundle.contains_key("bundle_cid") || bundle.contains_key("hash"),
        || "the bundle has no `bundle_cid`".to_owned(),
    )?;
    let computed = sbp_protocol::bundle::verify_cid(&bundle)
        .map_err(|err| fail(format!("the bundle's own digest does not verify: {err}")))?;
    ensure(computed.eq_ignore_ascii_case(&e.cid), || {
        format!(
            "the bundle hashes to {computed}, the export answer says {}",
            e.cid
        )
    })?;
    let has_message = bundle["messages"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m["content"] == text.as_str()));
    ensure(has_message, || {
        "the bundle's messages lack the session's user message".to_owned()
    })?;
    pass()
}

pub async fn token_inspect(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: look before import").await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    let resp = ctx.get(&format!("/v1/sbp/token/{}", e.token), None).await?;
    recommended(&resp)?;
    resp.expect(&[200])?;
    if let (Some(id), Some(want)) = (first_str(&resp.body, &["export_id", "sub"]), &e.export_id) {
        ensure(id == *want, || {
            format!("the token describes export {id}, not {want}")
        })?;
    }
    if let Some(id) = first_str(&resp.body, &["session_id", "source_session_id", "sid"]) {
        ensure(id == s.id, || {
            format!("the token describes session {id}, not {}", s.id)
        })?;
    }
    ensure(
        first(&resp.body, &["imported_at", "import_session_id"]).is_none(),
        || format!("a fresh token is described as imported: {}", resp.quote()),
    )?;
    let imported = do_import(&ctx, json!({"roaming_token": e.token})).await?;
    imported.expect(&[200, 201])?;
    pass()
}

pub async fn import(ctx: Arc<Ctx>) -> Outcome {
    let text = format!("conformance: take me along {}", nonce());
    let (s, _) = ctx.new_session(&text).await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    let resp = do_import(&ctx, json!({"roaming_token": e.token})).await?;
    resp.expect(&[200, 201])?;
    let new = created(&resp, &IMPORT_ID, &IMPORT_TOKEN)?;
    ensure(new.id != s.id, || {
        "the import returned the source session's id".to_owned()
    })?;
    if let Some(n) =
        first(&resp.body, &["messages_restored", "message_count"]).and_then(Value::as_u64)
    {
        ensure(n >= 1, || format!("messages_restored is {n}"))?;
    }
    if let (Some(x), Some(want)) = (
        first_str(&resp.body, &["origin_export_id", "export_id"]),
        &e.export_id,
    ) {
        ensure(x == *want, || {
            format!("the import names export {x}, not {want}")
        })?;
    }
    match holds(&ctx, &new, &text).await? {
        Some(true) => pass(),
        Some(false) => Err(fail(
            "the imported session's transcript lacks the exported user message",
        )),
        None => pass_with("the new session's transcript was not readable here"),
    }
}

pub async fn single_use(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: once only").await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    let first_import = do_import(&ctx, json!({"roaming_token": e.token})).await?;
    first_import.expect(&[200, 201])?;
    let second = do_import(&ctx, json!({"roaming_token": e.token})).await?;
    second.expect_error(&[410], "SBP_TOKEN_CONSUMED")?;
    pass()
}

pub async fn allow_reuse_forks(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: many times").await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    let a = do_import(&ctx, json!({"roaming_token": e.token})).await?;
    a.expect(&[200, 201])?;
    let a = created(&a, &IMPORT_ID, &IMPORT_TOKEN)?;
    let b = do_import(&ctx, json!({"roaming_token": e.token, "allow_reuse": true})).await?;
    b.expect(&[200, 201])?;
    let b = created(&b, &IMPORT_ID, &IMPORT_TOKEN)?;
    ensure(b.id != a.id && b.id != s.id, || {
        format!("allow_reuse gave session {}, not a new one", b.id)
    })?;
    // A fork: every session goes on working, and a turn on one stays out of the others.
    let only = format!("conformance: only on the reused import {}", nonce());
    let r = ctx.chat(Some(&b.token), &only, Value::Null).await?;
    r.expect(&[200])?;
    for (x, what) in [(&a, "the first import"), (&s, "the source session")] {
        let r = ctx
            .chat(Some(&x.token), "conformance: still here", Value::Null)
            .await?;
        r.expect(&[200])
            .map_err(|p| fail(format!("{what} stopped working after the reuse: {p}")))?;
    }
    let mut unread = false;
    for (x, what) in [(&a, "the first import"), (&s, "the source session")] {
        match holds(&ctx, x, &only).await? {
            Some(true) => {
                return Err(fail(format!(
                    "a turn on the reused import appeared in {what}'s transcript"
                )));
            }
            Some(false) => {}
            None => unread = true,
        }
    }
    if unread {
        return pass_with("transcripts not readable here: independence not verified");
    }
    pass()
}

/// `token` with its first character of segment `seg` changed (the first character, because the
/// last one of a base64url segment may carry only padding bits).
fn flip(token: &str, seg: usize) -> String {
    let mut parts: Vec<String> = token.split('.').map(str::to_owned).collect();
    // A segment of a gateway's token may be empty or start with a multi-byte character.
    if let Some(p) = parts.get_mut(seg).filter(|p| p.is_char_boundary(1)) {
        let replacement = if p.starts_with('A') { "B" } else { "A" };
        p.replace_range(..1, replacement);
    }
    parts.join(".")
}

/// `token` with its payload's `sid` claim set to a new UUID (added when absent), signature kept;
/// why not, when the token's payload is not a base64url JSON object.
fn forge(token: &str) -> Result<String, String> {
    let parts: Vec<&str> = token.split('.').collect();
    let [header, payload, signature] = parts[..] else {
        return Err(format!(
            "the roaming token has {} segments, not 3",
            parts.len()
        ));
    };
    let payload = URL_SAFE_NO_PAD
        .decode(payload)
        .map_err(|e| format!("the roaming token's payload is not base64url: {e}"))?;
    let mut claims: Value = serde_json::from_slice(&payload)
        .map_err(|e| format!("the roaming token's payload is not JSON: {e}"))?;
    let object = claims.as_object_mut().ok_or_else(|| {
        format!(
            "the roaming token's payload is JSON but not an object: {}",
            short(&String::from_utf8_lossy(&payload), 80)
        )
    })?;
    object.insert("sid".into(), json!(uuid::Uuid::new_v4().to_string()));
    let forged = serde_json::to_vec(&claims).map_err(|e| e.to_string())?;
    Ok(format!(
        "{header}.{}.{signature}",
        URL_SAFE_NO_PAD.encode(forged)
    ))
}

pub async fn tampered_token(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: do not forge me").await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    let forged = forge(&e.token).map_err(fail)?;
    // A well-formed token signed with some other key (the public suite's own example).
    let foreign = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJmYWtlIiwic2lkIjoiZmFrZSIsImlhdCI6MTcwMDAwMDAwMCwiZXhwIjo5OTk5OTk5OTk5fQ.invalidsignature";
    for (what, bad) in [
        ("a changed signature", flip(&e.token, 2)),
        ("a changed payload", forged),
        ("a foreign signature", foreign.to_owned()),
    ] {
        let resp = do_import(&ctx, json!({"roaming_token": bad})).await?;
        resp.expect_error(&[422], "SBP_TOKEN_INVALID")
            .map_err(|p| fail(format!("{what}: {p}")))?;
    }
    // The refusals consumed nothing: the real token still imports.
    let real = do_import(&ctx, json!({"roaming_token": e.token})).await?;
    real.expect(&[200, 201])?;
    pass()
}

pub async fn tampered_bundle(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: the original words").await?;
    let (_, bundle) = exported_bundle(&ctx, &s).await?;
    let mut tampered = bundle.clone();
    let changed = tampered
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .and_then(|m| m.first_mut())
        .and_then(Value::as_object_mut)
        .map(|m| m.insert("content".into(), json!("conformance: words never said")))
        .is_some();
    ensure(changed, || {
        "the bundle has no message to tamper with".to_owned()
    })?;
    let resp = do_import(&ctx, json!({"bundle": tampered})).await?;
    if resp.error_code() != Some("SBP_TOKEN_INTEGRITY") && matches!(resp.status, 400 | 404 | 405) {
        return Err(skip(format!(
            "the gateway does not import a bundle sent as such ({} {})",
            resp.status,
            resp.quote()
        )));
    }
    resp.expect_error(&[422], "SBP_TOKEN_INTEGRITY")?;
    let intact = do_import(&ctx, json!({"bundle": bundle})).await?;
    intact.expect(&[200, 201]).map_err(|p| {
        fail(format!(
            "the intact bundle was refused too, so the refusal proves nothing: {p}"
        ))
    })?;
    pass()
}

const FORK_ID: [&str; 3] = ["fork_session_id", "new_session_id", "session_id"];
const FORK_TOKEN: [&str; 3] = ["fork_session_token", "new_session_token", "session_token"];

pub async fn fork(ctx: Arc<Ctx>) -> Outcome {
    let text = format!("conformance: shared history {}", nonce());
    let (s, _) = ctx.new_session(&text).await?;
    let resp = ctx
        .post(
            &format!("/v1/sbp/sessions/{}/fork", s.id),
            Some(&s.token),
            &json!({"label": "conformance-fork"}),
        )
        .await?;
    recommended(&resp)?;
    resp.expect(&[200, 201])?;
    let f = created(&resp, &FORK_ID, &FORK_TOKEN)?;
    ensure(f.id != s.id, || {
        "the fork has the origin's session id".to_owned()
    })?;
    if let Some(o) = first_str(&resp.body, &["origin_session_id", "from_session_id"]) {
        ensure(o == s.id, || {
            format!("the fork names origin {o}, not {}", s.id)
        })?;
    }
    if let Some(l) = first_str(&resp.body, &["fork_label", "label"]) {
        ensure(l == "conformance-fork", || format!("fork_label is '{l}'"))?;
    }
    let only = format!("conformance: only on the fork {}", nonce());
    let r = ctx.chat(Some(&f.token), &only, Value::Null).await?;
    r.expect(&[200])?;
    match (holds(&ctx, &f, &text).await?, holds(&ctx, &s, &only).await?) {
        (Some(true), Some(false)) => pass(),
        (Some(false), _) => Err(fail("the fork's transcript lacks the origin's history")),
        (_, Some(true)) => Err(fail(
            "a turn on the fork appeared in the origin's transcript",
        )),
        _ => pass_with("transcripts not readable here: independence not verified"),
    }
}

pub async fn handoff(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: hand me over").await?;
    let agent = format!("conformance-agent-{}", nonce());
    let resp = ctx
        .post(
            &format!("/v1/sbp/sessions/{}/handoff", s.id),
            Some(&s.token),
            &json!({"to_agent_id": agent, "handoff_message": "Please continue.",
                    "reason": "conformance"}),
        )
        .await?;
    recommended(&resp)?;
    resp.expect(&[200, 201])?;
    let id = first_str(
        &resp.body,
        &["new_session_id", "to_session_id", "session_id"],
    )
    .ok_or_else(|| {
        fail(format!(
            "{}: no new session id in {}",
            resp.what,
            resp.quote()
        ))
    })?;
    ensure(is_uuid(&id) && id != s.id, || {
        format!("the handoff's new session id '{id}' is not a new UUID")
    })?;
    if let Some(to) = first_str(&resp.body, &["to_agent_id", "agent_id"]) {
        ensure(to == agent, || {
            format!("the handoff went to agent '{to}', not '{agent}'")
        })?;
    }
    if let Some(from) = first_str(&resp.body, &["from_session_id", "source_session_id"]) {
        ensure(from == s.id, || {
            format!("the handoff names source {from}, not {}", s.id)
        })?;
    }
    let status = ctx.status_of(&s).await?;
    ensure(status == "suspended", || {
        format!("the source session is '{status}' after the handoff, expected 'suspended'")
    })?;
    pass()
}

pub async fn lineage(ctx: Arc<Ctx>) -> Outcome {
    let (s, _) = ctx.new_session("conformance: family tree").await?;
    let e = do_export(&ctx, &s, json!({})).await?;
    let resp = ctx
        .post(
            &format!("/v1/sbp/sessions/{}/fork", s.id),
            Some(&s.token),
            &json!({"label": "conformance-lineage"}),
        )
        .await?;
    recommended(&resp)?;
    resp.expect(&[200, 201])?;
    let f = created(&resp, &FORK_ID, &FORK_TOKEN)?;
    let resp = ctx
        .get(
            &format!("/v1/sbp/sessions/{}/lineage", s.id),
            Some(&s.token),
        )
        .await?;
    recommended(&resp)?;
    resp.expect(&[200])?;
    let listed = |field: &str, id: &str| {
        resp.body
            .get(field)
            .is_some_and(|v| v.is_array() && v.to_string().contains(id))
    };
    // Without an export_id the export is known by its bundle's CID.
    let export = e.export_id.as_deref().unwrap_or(&e.cid);
    ensure(listed("exports", export), || {
        format!(
            "lineage.exports does not list export {export}: {}",
            resp.quote()
        )
    })?;
    ensure(listed("forks", &f.id), || {
        format!(
            "lineage.forks does not list fork {}: {}",
            f.id,
            resp.quote()
        )
    })?;
    pass()
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;

    use super::{flip, forge, is_hex64, is_jwt};

    fn token(payload: &str) -> String {
        format!(
            "eyJhbGciOiJIUzI1NiJ9.{}.c2ln",
            URL_SAFE_NO_PAD.encode(payload)
        )
    }

    #[test]
    fn forging_changes_the_sid_of_an_object_payload() {
        let t = token(r#"{"sub":"x","sid":"y"}"#);
        let forged = forge(&t).expect("an object payload");
        assert_ne!(forged, t);
        assert!(forged.ends_with(".c2ln") && is_jwt(&forged));
    }

    #[test]
    fn a_payload_that_is_not_an_object_is_a_reason_not_a_panic() {
        for payload in ["[1,2]", "\"text\"", "7", "null"] {
            let e = forge(&token(payload)).expect_err("refused");
            assert!(e.contains("not an object"), "{payload}: {e}");
        }
        assert!(forge("a.b").expect_err("refused").contains("2 segments"));
        assert!(forge("a.!!.c").expect_err("refused").contains("base64url"));
        assert!(
            forge(&token("{oops"))
                .expect_err("refused")
                .contains("not JSON")
        );
    }

    #[test]
    fn bad_tokens_and_cids_are_told_apart() {
        assert!(!is_jwt("a.b"));
        assert!(!is_jwt("a..c"));
        assert!(!is_jwt("a.b.c d"));
        assert_ne!(flip("abc.def.ghi", 2), "abc.def.ghi");
        assert_eq!(flip("abc.def.", 2), "abc.def.");
        assert_eq!(flip("abc.def.é", 2), "abc.def.é");
        assert!(is_hex64(&"a".repeat(64)));
        assert!(!is_hex64(&"g".repeat(64)));
        assert!(!is_hex64("abc"));
    }
}
