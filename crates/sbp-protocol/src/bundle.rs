//! The roaming bundle: its content address (`bundle_cid`) and a lenient typed reader for import.
//!
//! `bundle_cid` is the hex SHA-256 of the canonical JSON (see [`crate::canonical`]) of the bundle
//! without its digest field. The seeds name that field `bundle_cid`; the Python reference server
//! names it `hash`. Both are excluded from the digest and both are accepted on verification.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::canonical::{sorted_entries, write_entries, write_entry};

/// The bundle format version written in `sbp_version` (separate from the wire version).
pub const BUNDLE_FORMAT_VERSION: &str = "1.0";

/// Field names that carry the digest: ours (seeds) and the reference server's.
pub const CID_FIELDS: [&str; 2] = ["bundle_cid", "hash"];

/// Why a bundle's claimed digest was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidError {
    #[error("bundle has no `bundle_cid` or `hash` field")]
    Missing,
    #[error("bundle digest field is not a string")]
    NotAString,
    #[error("bundle_cid {bundle_cid} and hash {hash} disagree")]
    Conflicting { bundle_cid: String, hash: String },
    #[error("bundle digest mismatch: claimed {claimed}, computed {computed}")]
    Mismatch { claimed: String, computed: String },
}

/// Canonical bytes of `bundle` without its top-level digest fields, written without cloning the map.
fn canonical_without_cid(bundle: &Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    write_entries(&sorted_entries(bundle, &CID_FIELDS), &mut out);
    out
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Hex SHA-256 of the canonical bytes of `bundle` minus both [`CID_FIELDS`].
pub fn compute_cid(bundle: &Map<String, Value>) -> String {
    sha256_hex(&canonical_without_cid(bundle))
}

/// Computes the CID, inserts it as `bundle_cid` (dropping any stale `hash`) and returns
/// `(cid, canonical bytes of the sealed bundle)`.
///
/// The bundle is serialised once: the `bundle_cid` entry is spliced into the digest's input at its
/// sorted position, which gives exactly the canonical form of the sealed map.
pub fn seal(bundle: &mut Map<String, Value>) -> (String, Vec<u8>) {
    const KEY: &str = "bundle_cid";
    let mut out = Vec::with_capacity(4096);
    let (insert_at, others) = {
        let entries = sorted_entries(bundle, &CID_FIELDS);
        let index = entries.partition_point(|(k, _)| *k < KEY);
        let mut insert_at = None;
        out.push(b'{');
        for (i, (key, value)) in entries.iter().enumerate() {
            if i > 0 {
                out.extend_from_slice(b", ");
            }
            if i == index {
                insert_at = Some(out.len());
            }
            write_entry(key, value, &mut out);
        }
        out.push(b'}');
        (insert_at, entries.len())
    };
    let cid = sha256_hex(&out);

    let mut entry = Vec::with_capacity(KEY.len() + cid.len() + 10);
    write_entry(KEY, &Value::String(cid.clone()), &mut entry);
    match insert_at {
        Some(at) => {
            entry.extend_from_slice(b", ");
            out.splice(at..at, entry);
        }
        None => {
            // `bundle_cid` sorts last (or alone): it goes before the closing brace.
            let at = out.len() - 1;
            if others > 0 {
                entry.splice(0..0, *b", ");
            }
            out.splice(at..at, entry);
        }
    }

    bundle.remove("hash");
    bundle.insert(KEY.to_owned(), Value::String(cid.clone()));
    (cid, out)
}

/// Checks the claimed digest (`bundle_cid` or `hash`; if both are present they must agree) against a
/// recomputation. Hex is compared case-insensitively. Returns the computed CID (lowercase hex).
pub fn verify_cid(bundle: &Map<String, Value>) -> Result<String, CidError> {
    let claimed_field = |name: &str| -> Result<Option<String>, CidError> {
        match bundle.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.to_ascii_lowercase())),
            Some(_) => Err(CidError::NotAString),
        }
    };
    let claimed = match (claimed_field(CID_FIELDS[0])?, claimed_field(CID_FIELDS[1])?) {
        (None, None) => return Err(CidError::Missing),
        (Some(cid), None) | (None, Some(cid)) => cid,
        (Some(bundle_cid), Some(hash)) if bundle_cid != hash => {
            return Err(CidError::Conflicting { bundle_cid, hash });
        }
        (Some(cid), Some(_)) => cid,
    };
    let computed = compute_cid(bundle);
    if claimed == computed {
        Ok(computed)
    } else {
        Err(CidError::Mismatch { claimed, computed })
    }
}

/// A bundle that cannot be imported, naming the offending path (`messages[3].role`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid bundle: `{path}` {reason}")]
pub struct BundleError {
    pub path: String,
    pub reason: String,
}

impl BundleError {
    fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// The parts of a bundle an importing gateway uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBundle {
    pub sbp_version: Option<String>,
    pub exported_at: Option<String>,
    pub label: Option<String>,
    pub session: BundleSession,
    pub messages: Vec<BundleMessage>,
    /// `None` when absent, `{}` or without a string `schema_id` (the import then skips memory).
    pub memory: Option<BundleMemory>,
    pub state_snapshot: Option<Value>,
    /// `metadata.export_id`.
    pub export_id: Option<String>,
    /// `metadata.message_count`.
    pub message_count: Option<u64>,
    /// `metadata.total_cost_usd`.
    pub total_cost_usd: Option<f64>,
}

/// The bundle's `session` object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BundleSession {
    pub id: Option<String>,
    /// `agent_external_id`, else `agent_id` (the reference server's name).
    pub agent_id: Option<String>,
    pub status: Option<String>,
    pub last_task: Option<String>,
    pub created_at: Option<String>,
    pub step_count: Option<u64>,
    pub model: Option<String>,
}

/// One message of the bundle's history.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleMessage {
    pub role: String,
    /// The chat message object without the gateway keys `model_used`, `cost_usd` and `created_at`.
    pub body: Value,
    pub model_used: Option<String>,
    pub cost_usd: Option<f64>,
    pub created_at: Option<String>,
}

/// The bundle's memory, when it names a schema.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleMemory {
    pub schema_id: String,
    /// `memory.payload` as given (`null` when absent); opaque to the protocol.
    pub payload: Value,
}

/// Gateway bookkeeping keys kept out of [`BundleMessage::body`].
const MESSAGE_GATEWAY_KEYS: [&str; 3] = ["model_used", "cost_usd", "created_at"];

fn opt_str(map: &Map<String, Value>, key: &str) -> Option<String> {
    map.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// Reads a bundle leniently: the structure the import needs is checked, unknown keys are ignored and
/// optional scalars of the wrong type read as `None`.
pub fn parse_bundle(value: &Value) -> Result<ParsedBundle, BundleError> {
    let top = value
        .as_object()
        .ok_or_else(|| BundleError::new("$", "must be an object"))?;

    let session = match top.get("session") {
        Some(Value::Object(s)) => BundleSession {
            id: opt_str(s, "id"),
            agent_id: opt_str(s, "agent_external_id").or_else(|| opt_str(s, "agent_id")),
            status: opt_str(s, "status"),
            last_task: opt_str(s, "last_task"),
            created_at: opt_str(s, "created_at"),
            step_count: s.get("step_count").and_then(Value::as_u64),
            model: opt_str(s, "model"),
        },
        Some(_) => return Err(BundleError::new("session", "must be an object")),
        None => return Err(BundleError::new("session", "is missing")),
    };

    let raw_messages = match top.get("messages") {
        Some(Value::Array(items)) => items,
        Some(_) => return Err(BundleError::new("messages", "must be an array")),
        None => return Err(BundleError::new("messages", "is missing")),
    };
    let messages = raw_messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;

    let memory = top.get("memory").and_then(Value::as_object).and_then(|m| {
        let schema_id = opt_str(m, "schema_id")?;
        let payload = m.get("payload").cloned().unwrap_or(Value::Null);
        Some(BundleMemory { schema_id, payload })
    });

    let state_snapshot = match top.get("state_snapshot") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(_) => {
            return Err(BundleError::new(
                "state_snapshot",
                "must be an object or null",
            ));
        }
    };

    let metadata = top.get("metadata").and_then(Value::as_object);
    Ok(ParsedBundle {
        sbp_version: opt_str(top, "sbp_version"),
        exported_at: opt_str(top, "exported_at"),
        label: opt_str(top, "label"),
        session,
        messages,
        memory,
        state_snapshot,
        export_id: metadata.and_then(|m| opt_str(m, "export_id")),
        message_count: metadata
            .and_then(|m| m.get("message_count"))
            .and_then(Value::as_u64),
        total_cost_usd: metadata
            .and_then(|m| m.get("total_cost_usd"))
            .and_then(Value::as_f64),
    })
}

fn parse_message(index: usize, value: &Value) -> Result<BundleMessage, BundleError> {
    let path = |field: &str| {
        if field.is_empty() {
            format!("messages[{index}]")
        } else {
            format!("messages[{index}].{field}")
        }
    };
    let map = value
        .as_object()
        .ok_or_else(|| BundleError::new(path(""), "must be an object"))?;
    let role = match map.get("role") {
        Some(Value::String(r)) if !r.is_empty() => r.clone(),
        Some(_) => return Err(BundleError::new(path("role"), "must be a non-empty string")),
        None => return Err(BundleError::new(path("role"), "is missing")),
    };
    match map.get("content") {
        None | Some(Value::String(_) | Value::Null | Value::Array(_)) => {}
        Some(_) => {
            return Err(BundleError::new(
                path("content"),
                "must be a string, null or an array",
            ));
        }
    }
    let body: Map<String, Value> = map
        .iter()
        .filter(|(k, _)| !MESSAGE_GATEWAY_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(BundleMessage {
        role,
        body: Value::Object(body),
        model_used: opt_str(map, "model_used"),
        cost_usd: map.get("cost_usd").and_then(Value::as_f64),
        created_at: opt_str(map, "created_at"),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use crate::canonical::to_canonical_bytes;
    use serde_json::json;

    const GOLDEN_CID: &str = "bdce608edc8a1902042ac2a977f612a56dd57e77a99745e86404a150263e52f2";

    fn golden() -> Option<Map<String, Value>> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/interop/reference-bundle.json"
        );
        match std::fs::read(path) {
            Ok(bytes) => match serde_json::from_slice(&bytes).unwrap() {
                Value::Object(map) => Some(map),
                other => panic!("golden bundle is not an object: {other}"),
            },
            Err(err) => {
                println!("golden bundle {path} not available ({err}); skipping");
                None
            }
        }
    }

    fn obj(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    #[test]
    fn golden_bundle_verifies() {
        let Some(bundle) = golden() else { return };
        assert_eq!(compute_cid(&bundle), GOLDEN_CID);
        assert_eq!(verify_cid(&bundle).unwrap(), GOLDEN_CID);
    }

    #[test]
    fn golden_bundle_tampered_is_mismatch() {
        let Some(mut bundle) = golden() else { return };
        let content = bundle["messages"][2]["content"]
            .as_str()
            .unwrap()
            .replace("1500", "1501");
        bundle["messages"][2]["content"] = Value::String(content);
        match verify_cid(&bundle) {
            Err(CidError::Mismatch { claimed, computed }) => {
                assert_eq!(claimed, GOLDEN_CID);
                assert_ne!(computed, GOLDEN_CID);
            }
            other => panic!("expected Mismatch, got {other:?}"),
        }
    }

    #[test]
    fn golden_bundle_renamed_field_verifies() {
        let Some(mut bundle) = golden() else { return };
        let hash = bundle.remove("hash").unwrap();
        bundle.insert("bundle_cid".into(), hash.clone());
        assert_eq!(verify_cid(&bundle).unwrap(), GOLDEN_CID);
        // Both fields, agreeing up to hex case.
        bundle.insert(
            "hash".into(),
            Value::String(GOLDEN_CID.to_ascii_uppercase()),
        );
        assert_eq!(verify_cid(&bundle).unwrap(), GOLDEN_CID);
    }

    #[test]
    fn digest_field_errors() {
        let mut bundle = obj(json!({"session": {}, "messages": []}));
        assert_eq!(verify_cid(&bundle), Err(CidError::Missing));
        bundle.insert("hash".into(), json!(42));
        assert_eq!(verify_cid(&bundle), Err(CidError::NotAString));
        bundle.insert("hash".into(), json!("aa"));
        bundle.insert("bundle_cid".into(), json!("bb"));
        assert_eq!(
            verify_cid(&bundle),
            Err(CidError::Conflicting {
                bundle_cid: "bb".into(),
                hash: "aa".into()
            })
        );
    }

    #[test]
    fn golden_bundle_parses() {
        let Some(bundle) = golden() else { return };
        let parsed = parse_bundle(&Value::Object(bundle)).unwrap();
        assert_eq!(parsed.sbp_version.as_deref(), Some("1.0"));
        assert_eq!(
            parsed.session.id.as_deref(),
            Some("9fa73e98-bf52-46c7-b9d3-1012c43821b1")
        );
        assert_eq!(parsed.session.agent_id.as_deref(), Some("anonymous"));
        assert_eq!(parsed.session.status.as_deref(), Some("active"));
        assert_eq!(parsed.session.step_count, None);
        assert_eq!(parsed.messages.len(), 4);
        assert_eq!(parsed.messages[1].role, "assistant");
        assert_eq!(parsed.messages[1].model_used.as_deref(), Some("gpt-4o"));
        assert_eq!(parsed.messages[1].created_at, None);
        assert_eq!(
            parsed.messages[1].body,
            json!({"role": "assistant", "content": "Fake reply #1 to: Plan a trip to Tokyo — 東京 ✈"})
        );
        assert_eq!(parsed.memory, None);
        assert_eq!(parsed.state_snapshot.as_ref().unwrap()["step"], json!(2));
        assert_eq!(
            parsed.export_id.as_deref(),
            Some("b3c22de3-7743-4946-aaf7-9174af15b659")
        );
        assert_eq!(parsed.message_count, Some(4));
        assert_eq!(parsed.total_cost_usd, None);
    }

    /// A bundle shaped like ours, with the hard parts of canonical JSON.
    fn rich_bundle() -> Map<String, Value> {
        obj(json!({
            "sbp_version": BUNDLE_FORMAT_VERSION,
            "exported_at": "2026-11-22T09:27:34.942080+00:00",
            "label": "Tokyo — 東京 ✈ 😀",
            "session": {"id": "s1", "agent_external_id": "agent-1", "status": "suspended",
                        "last_task": null, "created_at": "2026-11-22T09:00:00+00:00", "step_count": 12},
            "messages": [
                {"role": "user", "content": "Budget: 1500.50 EUR\n\t\"quoted\" \u{7f}", "cost_usd": 0.1},
                {"role": "assistant", "content": null, "model_used": "gpt-4o", "cost_usd": 1e-05,
                 "created_at": "2026-11-22T09:01:00+00:00",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Tōkyō\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 1500.5}"}
            ],
            "memory": {"schema_id": "https://example.org/memory/v1", "payload": {"big": 1e16, "x": [1.5, -0.0]}},
            "state_snapshot": {"step": 2},
            "metadata": {"export_id": "e1", "message_count": 3, "total_cost_usd": 1500.5}
        }))
    }

    #[test]
    fn rich_bundle_matches_python_digest() {
        // sha256(json.dumps(b, sort_keys=True)) computed with python3.11 on this bundle.
        assert_eq!(compute_cid(&rich_bundle()), RICH_CID);
    }

    const RICH_CID: &str = "beb3d23ae09911eb8ad07bee2a7593087ca55ae654653e88a3ff9912b403fb3b";

    #[test]
    fn seal_then_verify_round_trips() {
        let mut bundle = rich_bundle();
        bundle.insert("hash".into(), json!("stale"));
        let (cid, bytes) = seal(&mut bundle);
        assert_eq!(cid, RICH_CID);
        assert!(!bundle.contains_key("hash"));
        assert_eq!(bundle["bundle_cid"], json!(cid));
        assert_eq!(bytes, to_canonical_bytes(&Value::Object(bundle.clone())));
        assert_eq!(verify_cid(&bundle).unwrap(), cid);

        // Through serde_json text, compact and pretty, the CID survives.
        for text in [
            serde_json::to_string(&bundle).unwrap(),
            serde_json::to_string_pretty(&bundle).unwrap(),
        ] {
            let back: Map<String, Value> = serde_json::from_str(&text).unwrap();
            assert_eq!(verify_cid(&back).unwrap(), cid);
        }
        let reparsed: Map<String, Value> = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(verify_cid(&reparsed).unwrap(), cid);
    }

    #[test]
    fn seal_splices_at_every_position() {
        for value in [
            json!({}),
            json!({"a": 1}),
            json!({"z": 1}),
            json!({"a": 1, "z": [2]}),
            json!({"bundle_cid": "x"}),
        ] {
            let mut bundle = obj(value);
            let (cid, bytes) = seal(&mut bundle);
            assert_eq!(
                bytes,
                to_canonical_bytes(&Value::Object(bundle.clone())),
                "{bundle:?}"
            );
            assert_eq!(verify_cid(&bundle).unwrap(), cid);
        }
    }

    #[test]
    fn rich_bundle_parses() {
        let parsed = parse_bundle(&Value::Object(rich_bundle())).unwrap();
        assert_eq!(parsed.label.as_deref(), Some("Tokyo — 東京 ✈ 😀"));
        assert_eq!(parsed.session.agent_id.as_deref(), Some("agent-1"));
        assert_eq!(parsed.session.step_count, Some(12));
        assert_eq!(parsed.session.last_task, None);
        let assistant = &parsed.messages[1];
        assert_eq!(assistant.cost_usd, Some(1e-5));
        assert_eq!(
            assistant.created_at.as_deref(),
            Some("2026-11-22T09:01:00+00:00")
        );
        assert!(assistant.body.get("tool_calls").is_some());
        assert!(assistant.body.get("cost_usd").is_none());
        assert!(assistant.body.get("model_used").is_none());
        let memory = parsed.memory.unwrap();
        assert_eq!(memory.schema_id, "https://example.org/memory/v1");
        assert_eq!(memory.payload["big"], json!(1e16));
        assert_eq!(parsed.total_cost_usd, Some(1500.5));
    }

    #[test]
    fn parse_errors_name_the_path() {
        let base = json!({"session": {}, "messages": [{"role": "user", "content": "hi"}]});
        assert!(parse_bundle(&base).is_ok());
        let cases = [
            (json!([]), "$"),
            (json!({"messages": []}), "session"),
            (json!({"session": [], "messages": []}), "session"),
            (json!({"session": {}}), "messages"),
            (json!({"session": {}, "messages": {}}), "messages"),
            (
                json!({"session": {}, "messages": [{"role": "user"}, 3]}),
                "messages[1]",
            ),
            (
                json!({"session": {}, "messages": [{"role": "user"}, {"content": "x"}]}),
                "messages[1].role",
            ),
            (
                json!({"session": {}, "messages": [{"role": ""}]}),
                "messages[0].role",
            ),
            (
                json!({"session": {}, "messages": [{"role": 1}]}),
                "messages[0].role",
            ),
            (
                json!({"session": {}, "messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"session": {}, "messages": [], "state_snapshot": "x"}),
                "state_snapshot",
            ),
        ];
        for (value, path) in cases {
            let err = parse_bundle(&value).unwrap_err();
            assert_eq!(err.path, path, "{value}");
            assert!(err.to_string().contains(path));
        }
    }

    #[test]
    fn memory_without_schema_is_none() {
        for memory in [
            json!(null),
            json!({}),
            json!({"payload": {}}),
            json!({"schema_id": 3}),
            json!("x"),
        ] {
            let value =
                json!({"session": {}, "messages": [], "memory": memory, "state_snapshot": null});
            let parsed = parse_bundle(&value).unwrap();
            assert_eq!(parsed.memory, None);
            assert_eq!(parsed.state_snapshot, None);
        }
        let value =
            json!({"session": {}, "messages": [], "memory": {"schema_id": "urn:x"}, "extra": 1});
        let memory = parse_bundle(&value).unwrap().memory.unwrap();
        assert_eq!(
            memory,
            BundleMemory {
                schema_id: "urn:x".into(),
                payload: Value::Null
            }
        );
    }
}
