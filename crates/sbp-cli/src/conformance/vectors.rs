//! The public suite's vector files (`--vectors <dir>`: `L1-stateful-proxy/*.json` …
//! `L5-mcp-bridge/*.json`), interpreted step by step against the gateway, one result row per file.
//!
//! A file is one HTTP exchange (`request` / `expect`) or a list of `steps`: HTTP steps with
//! `expect` (`status`, `status_oneof`, `headers_include`, `body_contains` with literal values or
//! matchers `{type, format, pattern, not_equal, min}`, `body_excludes`) and `extract` (`${var}`
//! from `$.body.path` or `headers.name`); `websocket` steps (connect, send, `expect_receive` /
//! `expect_receive_sequence`, `expect_close_code`, `expect_after_drain`); and
//! `websocket_continue` steps whose `inject_server_frame` is a TOOL_CALL.
//!
//! What needs more than the public API:
//! - `upstream_body_excludes` is about the request the gateway sends its LLM, which is not
//!   observable from here: the row passes with a note saying it was not checked (our test suite
//!   checks it against its fake upstream).
//! - `/_test/tether` (preloading the Tether) exists only on a gateway started with
//!   `--enable-test-hooks`; the vectors also send no session tokens on session endpoints, so the
//!   gateway must run with `--insecure-no-session-auth`, and `--sbp-version 0.9` for the
//!   handshake vector.
//! - `inject_server_frame`: a gateway sends TOOL_CALL only when something calls a tool, so the
//!   call is made through the backend endpoint `POST /v1/sbp/sessions/{id}/tool_calls`. The gateway
//!   then picks its own UUID `call_id`, not the vector's literal one: the vector's reply (with its
//!   own `call_id`) is sent first and must be discarded silently, then the same reply with the
//!   real `call_id`, whose result must come back to the caller. That endpoint is this gateway's
//!   own (neither the seeds nor SPEC name one), so a gateway answering it 404 / 405 has the row
//!   skipped.
//! - `status_oneof` answered 200: `sbp.model_routed_to` is OPTIONAL (SPEC 6.2) and is required
//!   only when the answer's `model` is another model than the one asked for (a dated name of the
//!   same model is not another).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use reqwest::Method;
use serde_json::{Value, json};

use super::checks::Level;
use super::client::{
    Ctx, QUEUED, Resp, Socket, at, code_text, first_u64, is_uuid, model_substituted,
};
use super::outcome::{Outcome, Problem, ensure, fail, pass, pass_with, short};
use super::pattern::Pattern;

/// One vector file to run.
pub struct VectorFile {
    pub level: Level,
    /// `vector.<dir>/<file stem>`.
    pub id: String,
    pub description: String,
    pub path: PathBuf,
}

/// The vector files of levels up to `max` under `dir`, in level and name order.
pub fn discover(dir: &Path, max: Level) -> Result<Vec<VectorFile>, String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("--vectors {}: {e}", dir.display()))?;
    let mut dirs: Vec<(Level, PathBuf, String)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let level: Level = name.split('-').next()?.parse().ok()?;
            Some((level, e.path(), name))
        })
        .collect();
    if dirs.is_empty() {
        return Err(format!(
            "--vectors {}: no level directories (L1-stateful-proxy, …) in it",
            dir.display()
        ));
    }
    dirs.sort_by(|a, b| (a.0, &a.2).cmp(&(b.0, &b.2)));
    let mut files = Vec::new();
    for (level, path, name) in dirs.into_iter().filter(|d| d.0 <= max) {
        let mut jsons: Vec<PathBuf> = std::fs::read_dir(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        jsons.sort();
        for p in jsons {
            let stem = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let description = std::fs::read_to_string(&p)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .and_then(|v| v["description"].as_str().map(str::to_owned))
                .unwrap_or_default();
            files.push(VectorFile {
                level,
                id: format!("vector.{name}/{stem}"),
                description,
                path: p,
            });
        }
    }
    Ok(files)
}

/// One file's run state: extracted variables, the open socket, and what could not be checked.
struct Run<'a> {
    ctx: &'a Ctx,
    vars: HashMap<String, String>,
    socket: Option<Socket>,
    notes: Vec<String>,
}

/// Runs one vector file.
pub async fn run(ctx: Arc<Ctx>, path: PathBuf) -> Outcome {
    let text = std::fs::read_to_string(&path)
        .map_err(|e| fail(format!("cannot read {}: {e}", path.display())))?;
    let vector: Value = serde_json::from_str(&text)
        .map_err(|e| fail(format!("{} is not JSON: {e}", path.display())))?;
    let steps = match vector["steps"].as_array() {
        Some(s) => s.clone(),
        None => vec![vector.clone()],
    };
    let mut run = Run {
        ctx: &ctx,
        vars: HashMap::new(),
        socket: None,
        notes: Vec::new(),
    };
    for (n, step) in steps.iter().enumerate() {
        let id = step["id"]
            .as_str()
            .map_or_else(|| format!("#{}", n + 1), str::to_owned);
        let done = match step["protocol"].as_str() {
            Some("websocket") => run.ws_step(step).await,
            Some("websocket_continue") => run.continue_step(step).await,
            None | Some("http") => run.http_step(step).await,
            Some(other) => Err(fail(format!("unsupported step protocol '{other}'"))),
        };
        done.map_err(|p| Problem {
            status: p.status,
            reason: format!("step {id}: {}", p.reason),
        })?;
    }
    if run.notes.is_empty() {
        pass()
    } else {
        pass_with(run.notes.join("; "))
    }
}

/// Replaces `${name}` with extracted values, recursively.
fn subst(v: &Value, vars: &HashMap<String, String>) -> Value {
    match v {
        Value::String(s) => {
            let mut out = s.clone();
            for (k, val) in vars {
                out = out.replace(&format!("${{{k}}}"), val);
            }
            Value::String(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| subst(x, vars)).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (k.clone(), subst(x, vars))).collect())
        }
        other => other.clone(),
    }
}

/// Other names of the same field, tried when the vector's name is absent (seeds, spec and
/// reference server spell some differently).
fn aliases(name: &str) -> &'static [&'static str] {
    match name {
        "queued_turns" => &["tether_turns_pending"],
        "tether_turns_pending" => &["queued_turns"],
        "bundle_hash" => &["bundle_cid"],
        "bundle_cid" => &["bundle_hash"],
        "new_session_id" => &["session_id"],
        "new_session_token" => &["session_token"],
        "fork_session_id" => &["new_session_id", "session_id"],
        "origin_export_id" => &["export_id"],
        "from_session_id" => &["source_session_id"],
        _ => &[],
    }
}

/// The value at `$.a.b` / `a.b`, falling back to the last segment's aliases.
fn lookup<'a>(body: &'a Value, path: &str, notes: &mut Vec<String>) -> Option<&'a Value> {
    let path = path.trim_start_matches("$.");
    if let Some(v) = at(body, path) {
        return Some(v);
    }
    let (parent, last) = match path.rsplit_once('.') {
        Some((p, l)) => (at(body, p)?, l),
        None => (body, path),
    };
    aliases(last).iter().find_map(|alt| {
        let v = at(parent, alt)?;
        notes.push(format!("{last} read as {alt}"));
        Some(v)
    })
}

/// Checks one expected value: a literal, or a matcher object.
fn check(name: &str, actual: Option<&Value>, expected: &Value) -> Result<(), Problem> {
    const MATCHER_KEYS: [&str; 5] = ["type", "format", "pattern", "not_equal", "min"];
    let matcher = expected
        .as_object()
        .filter(|o| !o.is_empty() && o.keys().all(|k| MATCHER_KEYS.contains(&k.as_str())));
    let Some(m) = matcher else {
        return ensure(actual == Some(expected), || {
            format!("{name}: expected {expected}, got {}", got(actual))
        });
    };
    let actual = actual.ok_or_else(|| fail(format!("{name}: missing")))?;
    if let Some(ty) = m.get("type").and_then(Value::as_str) {
        let ok = match ty {
            "string" => actual.is_string(),
            "number" => actual.is_number(),
            "integer" => actual.is_i64() || actual.is_u64(),
            "boolean" => actual.is_boolean(),
            "object" => actual.is_object(),
            "array" => actual.is_array(),
            "null" => actual.is_null(),
            _ => true,
        };
        ensure(ok, || {
            format!("{name}: {} is not a {ty}", short(&actual.to_string(), 80))
        })?;
    }
    if m.get("format").and_then(Value::as_str) == Some("uuid") {
        ensure(actual.as_str().is_some_and(is_uuid), || {
            format!("{name}: {actual} is not a UUID")
        })?;
    }
    if let Some(p) = m.get("pattern").and_then(Value::as_str) {
        let pattern = Pattern::parse(p).ok_or_else(|| {
            fail(format!(
                "{name}: pattern '{p}' uses syntax this runner does not support"
            ))
        })?;
        ensure(actual.as_str().is_some_and(|s| pattern.is_match(s)), || {
            format!(
                "{name}: {} does not match {p}",
                short(&actual.to_string(), 80)
            )
        })?;
    }
    if let Some(ne) = m.get("not_equal") {
        ensure(actual != ne, || format!("{name}: must not be {ne}"))?;
    }
    if let Some(min) = m.get("min").and_then(Value::as_f64) {
        ensure(actual.as_f64().is_some_and(|a| a >= min), || {
            format!("{name}: {actual} is below {min}")
        })?;
    }
    Ok(())
}

/// A model may be replaced only if `sbp.model_routed_to` says so; the same model (under a dated
/// name, say) needs no word.
fn routed_named(resp: &Resp, requested: Option<&str>) -> Result<(), Problem> {
    let answered = resp.body.get("model").and_then(Value::as_str);
    let substituted = match (requested, answered) {
        (Some(r), Some(a)) => model_substituted(r, a),
        _ => true,
    };
    if !substituted {
        return Ok(());
    }
    ensure(
        resp.body
            .pointer("/sbp/model_routed_to")
            .is_some_and(Value::is_string),
        || {
            format!(
                "200 answering model {answered:?} for {requested:?} without sbp.model_routed_to: {}",
                resp.quote()
            )
        },
    )
}

fn got(v: Option<&Value>) -> String {
    v.map_or_else(|| "nothing".to_owned(), |v| short(&v.to_string(), 80))
}

impl Run<'_> {
    async fn http_step(&mut self, step: &Value) -> Result<(), Problem> {
        let req = subst(&step["request"], &self.vars);
        let method = req["method"].as_str().unwrap_or("GET");
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| fail(format!("bad method '{method}'")))?;
        let path = req["path"]
            .as_str()
            .ok_or_else(|| fail("the request has no path"))?;
        let mut r = self.ctx.request(method.clone(), path);
        for (k, v) in req["headers"].as_object().into_iter().flatten() {
            r = r.header(k.as_str(), v.as_str().unwrap_or(""));
        }
        if !req["body"].is_null() {
            r = r.json(&req["body"]);
        }
        let resp = self.ctx.send(format!("{method} {path}"), r).await?;
        let expect = subst(&step["expect"], &self.vars);
        self.expect(
            &resp,
            &expect,
            req.pointer("/body/model").and_then(Value::as_str),
        )?;
        for (name, src) in step["extract"].as_object().into_iter().flatten() {
            let src = src.as_str().unwrap_or_default();
            let value = match src.strip_prefix("headers.") {
                Some(h) => resp.header(h),
                None => lookup(&resp.body, src, &mut self.notes)
                    .and_then(Value::as_str)
                    .map(str::to_owned),
            };
            let value = value.ok_or_else(|| {
                fail(format!(
                    "cannot extract {name} from {src}: {}",
                    resp.quote()
                ))
            })?;
            self.vars.insert(name.clone(), value);
        }
        Ok(())
    }

    /// Checks one answer against `expect`; `model` is the model the request asked for.
    fn expect(&mut self, resp: &Resp, expect: &Value, model: Option<&str>) -> Result<(), Problem> {
        if let Some(s) = expect["status"].as_u64() {
            ensure(u64::from(resp.status) == s, || {
                format!(
                    "{}: expected HTTP {s}, got {} {}",
                    resp.what,
                    resp.status,
                    resp.quote()
                )
            })?;
        }
        if let Some(one_of) = expect["status_oneof"].as_array() {
            ensure(
                one_of
                    .iter()
                    .any(|s| s.as_u64() == Some(u64::from(resp.status))),
                || {
                    format!(
                        "{}: expected HTTP one of {one_of:?}, got {} {}",
                        resp.what,
                        resp.status,
                        resp.quote()
                    )
                },
            )?;
            if resp.status == 200 {
                routed_named(resp, model)?;
            }
        }
        for h in expect["headers_include"].as_array().into_iter().flatten() {
            let h = h.as_str().unwrap_or_default();
            ensure(resp.header(h).is_some(), || {
                format!("{}: no {h} header", resp.what)
            })?;
        }
        for (k, v) in expect["body_contains"].as_object().into_iter().flatten() {
            let actual = lookup(&resp.body, k, &mut self.notes);
            check(k, actual, v)?;
        }
        for k in expect["body_excludes"].as_array().into_iter().flatten() {
            let k = k.as_str().unwrap_or_default();
            ensure(at(&resp.body, k.trim_start_matches("$.")).is_none(), || {
                format!("{k} is in the answer and must not be: {}", resp.quote())
            })?;
        }
        if let Some(keys) = expect["upstream_body_excludes"].as_array() {
            let keys: Vec<&str> = keys.iter().filter_map(Value::as_str).collect();
            self.notes.push(format!(
                "not checked: upstream request without {keys:?} (the upstream is not observable here)"
            ));
        }
        Ok(())
    }

    async fn ws_step(&mut self, step: &Value) -> Result<(), Problem> {
        let step = subst(step, &self.vars);
        let target = step["connect"]
            .as_str()
            .ok_or_else(|| fail("the step has no `connect` path"))?;
        let mut ws = Socket::connect_path(self.ctx, target).await?;
        ws.send(step["send"].clone()).await?;
        let mut expected: Vec<Value> = step["expect_receive_sequence"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !step["expect_receive"].is_null() {
            expected.push(step["expect_receive"].clone());
        }
        for want in &expected {
            let ty = want["type"].as_str().unwrap_or("a frame");
            let frame = ws.frame(ty).await?;
            self.frame_matches(&frame, want)?;
        }
        if let Some(code) = step["expect_close_code"].as_u64() {
            let (_, got) = ws.closed(&format!("close {code}")).await?;
            ensure(got.map(u64::from) == Some(code), || {
                format!("expected close code {code}, got {}", code_text(got))
            })?;
        }
        if !step["expect_after_drain"].is_null() {
            // The vector says the queue must be empty after the drain: attach again and look.
            ws.detach().await?;
            let mut again = Socket::connect_path(self.ctx, target).await?;
            again.send(step["send"].clone()).await?;
            let attached = again.expect_type("SESSION_ATTACHED").await?;
            let queued = first_u64(&attached, &QUEUED);
            ensure(queued == Some(0), || {
                format!("after the drain a new attach counts {queued:?} queued turns, expected 0")
            })?;
            ws = again;
        }
        self.socket = Some(ws);
        Ok(())
    }

    fn frame_matches(&mut self, frame: &Value, want: &Value) -> Result<(), Problem> {
        for (k, v) in want.as_object().into_iter().flatten() {
            let actual = lookup(frame, k, &mut self.notes);
            check(&format!("frame field {k}"), actual, v)
                .map_err(|p| fail(format!("{p} (frame {})", short(&frame.to_string(), 160))))?;
        }
        Ok(())
    }

    /// `websocket_continue` with `inject_server_frame`: the TOOL_CALL comes from the backend
    /// endpoint (see the module doc for why the vector's own reply is sent first).
    async fn continue_step(&mut self, step: &Value) -> Result<(), Problem> {
        let step = subst(step, &self.vars);
        let inject = &step["inject_server_frame"];
        ensure(inject["type"] == "TOOL_CALL", || {
            format!("only a TOOL_CALL can be injected, not {}", inject["type"])
        })?;
        let session = self
            .vars
            .get("session_id")
            .cloned()
            .ok_or_else(|| fail("no session_id was extracted before the TOOL_CALL step"))?;
        let token = self.vars.get("session_token").cloned();
        let mut ws = self
            .socket
            .take()
            .ok_or_else(|| fail("no WebSocket step came before this one"))?;
        let body = json!({
            "tool_name": inject["tool_name"],
            "tool_input": inject["tool_input"],
            "timeout_ms": u64::try_from(self.ctx.timeout.as_millis()).unwrap_or(10_000),
        });
        let path = format!("/v1/sbp/sessions/{session}/tool_calls");
        let call = self.ctx.post(&path, token.as_deref(), &body);
        tokio::pin!(call);
        let got = tokio::select! {
            f = ws.expect_type("TOOL_CALL") => f?,
            answer = &mut call => {
                let answer = answer?;
                answer.skip_if_missing(
                    "— backend tool-call endpoint not offered (needed to make the gateway send a TOOL_CALL)",
                )?;
                return Err(fail(format!(
                    "{} answered {} {} before any TOOL_CALL reached the surface",
                    answer.what,
                    answer.status,
                    answer.quote()
                )));
            }
        };
        let surface = async {
            ensure(
                got["tool_name"] == inject["tool_name"]
                    && got["tool_input"] == inject["tool_input"],
                || {
                    format!(
                        "TOOL_CALL {} does not carry the injected tool and input",
                        short(&got.to_string(), 160)
                    )
                },
            )?;
            let call_id = got["call_id"].as_str().unwrap_or_default().to_owned();
            ensure(is_uuid(&call_id), || {
                format!("TOOL_CALL call_id '{call_id}' is not a UUID")
            })?;
            let reply = step["surface_replies"].clone();
            let mut matching = reply.clone();
            matching
                .as_object_mut()
                .ok_or_else(|| {
                    fail(format!(
                        "the vector's surface_replies is not a frame object: {}",
                        short(&reply.to_string(), 80)
                    ))
                })?
                .insert("call_id".into(), Value::String(call_id.clone()));
            ws.send(reply.clone()).await?;
            ws.send(matching).await?;
            Ok::<_, Problem>((call_id, reply))
        };
        let (answer, surfaced) = tokio::join!(call, surface);
        let (call_id, reply) = surfaced?;
        let answer = answer?;
        answer.expect(&[200])?;
        ensure(answer.body["status"] == "ok", || {
            format!("the tool call did not end ok: {}", answer.quote())
        })?;
        ensure(answer.body["call_id"] == call_id.as_str(), || {
            format!(
                "the answer names call {}, not {call_id}",
                answer.body["call_id"]
            )
        })?;
        ensure(answer.body["result"] == reply["result"], || {
            format!(
                "the answer's result {} is not the surface's {}",
                answer.body["result"], reply["result"]
            )
        })?;
        // The result arrived after the reply with the unknown call_id: that one was discarded
        // without closing the socket, which a later step may still use.
        self.socket = Some(ws);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderMap;
    use serde_json::{Value, json};

    use super::routed_named;
    use crate::conformance::client::Resp;

    fn resp(body: Value) -> Resp {
        Resp {
            what: "POST /v1/chat/completions".into(),
            status: 200,
            headers: HeaderMap::new(),
            body,
        }
    }

    #[test]
    fn model_routed_to_is_needed_only_for_another_model() {
        let same = resp(json!({"model": "gpt-4o-2024-08-06"}));
        assert!(routed_named(&same, Some("gpt-4o")).is_ok());
        let other = resp(json!({"model": "claude-3"}));
        assert!(routed_named(&other, Some("gpt-4o")).is_err());
        let named = resp(json!({"model": "claude-3", "sbp": {"model_routed_to": "claude-3"}}));
        assert!(routed_named(&named, Some("gpt-4o")).is_ok());
        assert!(routed_named(&resp(json!({})), Some("gpt-4o")).is_err());
    }
}
