//! The roaming bundle: its content address (`bundle_cid`), the writer an export uses
//! ([`Envelope`], [`write_messages`]) and a typed reader for import.
//!
//! `bundle_cid` is the hex SHA-256 of the canonical JSON (see [`crate::canonical`]) of the bundle
//! without its digest field. The seeds name that field `bundle_cid`; the Python reference server
//! names it `hash`. Both are excluded from the digest and both are accepted on verification.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use uuid::Uuid;

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

/// Whether `s` is a CID as this gateway writes and accepts one in a path: 64 lowercase hex
/// characters (the hex SHA-256).
pub fn is_cid(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
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
    seal_entries(bundle, None)
}

/// Like [`seal`], for a bundle whose `raw_key` entry (e.g. the messages of a long session) is given
/// as bytes already in canonical form, so they can be produced in pieces and in parallel. The
/// returned bytes hold that entry; the map is sealed without it.
pub fn seal_with_raw(
    bundle: &mut Map<String, Value>,
    raw_key: &str,
    raw_canonical: &[u8],
) -> (String, Vec<u8>) {
    seal_entries(bundle, Some((raw_key, raw_canonical)))
}

enum Slot<'a> {
    Value(&'a Value),
    Raw(&'a [u8]),
}

fn seal_entries(bundle: &mut Map<String, Value>, raw: Option<(&str, &[u8])>) -> (String, Vec<u8>) {
    const KEY: &str = "bundle_cid";
    let raw_len = raw.map_or(0, |(_, r)| r.len());
    let mut out = Vec::with_capacity(4096 + raw_len + raw_len / 8);
    let (insert_at, others) = {
        let mut skip = CID_FIELDS.to_vec();
        if let Some((key, _)) = raw {
            skip.push(key);
        }
        let mut entries: Vec<(&str, Slot<'_>)> = sorted_entries(bundle, &skip)
            .into_iter()
            .map(|(k, v)| (k, Slot::Value(v)))
            .collect();
        if let Some((key, bytes)) = raw {
            let at = entries.partition_point(|(k, _)| *k < key);
            entries.insert(at, (key, Slot::Raw(bytes)));
        }
        let index = entries.partition_point(|(k, _)| *k < KEY);
        let mut insert_at = None;
        out.push(b'{');
        for (i, (key, slot)) in entries.iter().enumerate() {
            if i > 0 {
                out.extend_from_slice(b", ");
            }
            if i == index {
                insert_at = Some(out.len());
            }
            match slot {
                Slot::Value(value) => write_entry(key, value, &mut out),
                Slot::Raw(bytes) => {
                    crate::canonical::write_string(key, &mut out);
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(bytes);
                }
            }
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
    let claimed = claimed_cid(bundle)?;
    matching(claimed, compute_cid(bundle))
}

/// [`verify_cid`] and [`seal`] in one serialisation, for a received bundle that is to be stored:
/// returns the CID and the canonical bytes of the bundle sealed under `bundle_cid` (a `hash` field is
/// replaced by it). On a mismatch the bundle is left sealed with the computed CID; discard it.
pub fn verify_and_seal(bundle: &mut Map<String, Value>) -> Result<(String, Vec<u8>), CidError> {
    let claimed = claimed_cid(bundle)?;
    let (cid, bytes) = seal(bundle);
    matching(claimed, cid).map(|cid| (cid, bytes))
}

/// The digest a bundle claims, lowercase.
fn claimed_cid(bundle: &Map<String, Value>) -> Result<String, CidError> {
    let claimed_field = |name: &str| -> Result<Option<String>, CidError> {
        match bundle.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.to_ascii_lowercase())),
            Some(_) => Err(CidError::NotAString),
        }
    };
    match (claimed_field(CID_FIELDS[0])?, claimed_field(CID_FIELDS[1])?) {
        (None, None) => Err(CidError::Missing),
        (Some(cid), None) | (None, Some(cid)) => Ok(cid),
        (Some(bundle_cid), Some(hash)) if bundle_cid != hash => {
            Err(CidError::Conflicting { bundle_cid, hash })
        }
        (Some(cid), Some(_)) => Ok(cid),
    }
}

fn matching(claimed: String, computed: String) -> Result<String, CidError> {
    if claimed == computed {
        Ok(computed)
    } else {
        Err(CidError::Mismatch { claimed, computed })
    }
}

/// The memory format this gateway understands: `payload` is a JSON object of application-defined
/// keys. Bundles whose memory names another schema import without their memory.
pub const MEMORY_SCHEMA_KV: &str = "urn:sbp:memory:kv:v1";
pub const KNOWN_MEMORY_SCHEMAS: &[&str] = &[MEMORY_SCHEMA_KV];

/// A stored message as an export writes it: the chat message object and the gateway's facts
/// about it, which join it as the keys `role`, `model_used`, `cost_usd` and `created_at`.
#[derive(Debug, Clone, Copy)]
pub struct MessageOut<'a> {
    pub body: &'a Value,
    pub role: &'a str,
    pub model_used: Option<&'a str>,
    pub cost_usd: Option<f64>,
    /// RFC 3339.
    pub created_at: &'a str,
}

/// The canonical bytes of a run of bundle messages (`m1, m2, ...`, without brackets, so runs
/// written in parallel can be joined) and their summed cost when any message has one.
pub fn write_messages<'a>(
    messages: impl ExactSizeIterator<Item = MessageOut<'a>>,
) -> (Vec<u8>, Option<f64>) {
    let mut out = Vec::with_capacity(messages.len() * 512);
    let mut cost: Option<f64> = None;
    for (i, m) in messages.enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        write_message(&m, &mut out);
        if let Some(c) = m.cost_usd {
            cost = Some(cost.unwrap_or(0.0) + c);
        }
    }
    (out, cost)
}

/// One bundle entry, written without building the merged object.
fn write_message(m: &MessageOut<'_>, out: &mut Vec<u8>) {
    let role = Value::String(m.role.to_owned());
    let model_used = json!(m.model_used);
    let cost_usd = json!(m.cost_usd);
    let created_at = Value::String(m.created_at.to_owned());
    let extra = [
        ("cost_usd", &cost_usd),
        ("created_at", &created_at),
        ("model_used", &model_used),
        ("role", &role),
    ];
    match m.body {
        Value::Object(body) => crate::canonical::write_object_with(body, &extra, out),
        other => {
            let mut body = Map::new();
            body.insert("content".to_owned(), other.clone());
            crate::canonical::write_object_with(&body, &extra, out);
        }
    }
}

/// Everything of a bundle but its messages (SPEC 8.2 and the seeds), written with the field
/// names of spec, docs and reference server. Timestamps are RFC 3339.
#[derive(Debug, Clone)]
pub struct Envelope<'a> {
    pub exported_at: &'a str,
    pub label: Option<&'a str>,
    pub session: EnvelopeSession<'a>,
    /// `(schema_id, payload)`; none: an empty document of [`MEMORY_SCHEMA_KV`].
    pub memory: Option<(&'a str, &'a Value)>,
    pub snapshot: Option<EnvelopeSnapshot<'a>>,
    pub message_count: u64,
    pub total_cost_usd: Option<f64>,
    pub export_id: Uuid,
    /// `<software>/<version>` of the exporting gateway.
    pub exported_by: &'a str,
}

/// The exported session, as the envelope's `session` describes it.
#[derive(Debug, Clone)]
pub struct EnvelopeSession<'a> {
    pub id: Uuid,
    pub agent_id: &'a str,
    pub status: &'a str,
    pub last_task: Option<&'a str>,
    pub created_at: &'a str,
    pub step_count: u64,
    pub model: Option<&'a str>,
}

/// The snapshot a bundle carries (`state_snapshot`).
#[derive(Debug, Clone)]
pub struct EnvelopeSnapshot<'a> {
    pub id: Uuid,
    pub kind: &'a str,
    pub step_count: u64,
    pub message_count: u64,
    pub model: Option<&'a str>,
    pub current_task: Option<&'a str>,
    pub created_at: &'a str,
    pub state: &'a Value,
}

impl Envelope<'_> {
    /// The envelope as a JSON object, ready for [`seal_with_raw`] with the messages.
    pub fn to_map(&self) -> Map<String, Value> {
        let memory = match self.memory {
            Some((schema_id, payload)) => json!({ "schema_id": schema_id, "payload": payload }),
            None => json!({ "schema_id": MEMORY_SCHEMA_KV, "payload": {} }),
        };
        let snapshot = self.snapshot.as_ref().map_or(Value::Null, |s| {
            json!({
                "snapshot_id": s.id,
                "kind": s.kind,
                "step": s.step_count,
                "step_count": s.step_count,
                "message_count": s.message_count,
                "model": s.model,
                "current_task": s.current_task,
                "created_at": s.created_at,
                "state": s.state,
            })
        });
        let s = &self.session;
        let body = json!({
            "sbp_version": BUNDLE_FORMAT_VERSION,
            "exported_at": self.exported_at,
            "label": self.label,
            "session": {
                "id": s.id,
                "agent_id": s.agent_id,
                "agent_external_id": s.agent_id,
                "status": s.status,
                "last_task": s.last_task,
                "created_at": s.created_at,
                "step_count": s.step_count,
                "message_count": self.message_count,
                "model": s.model,
            },
            "memory": memory,
            "state_snapshot": snapshot,
            "metadata": {
                "export_id": self.export_id,
                "message_count": self.message_count,
                "total_cost_usd": self.total_cost_usd,
                "exported_by": self.exported_by,
            },
        });
        match body {
            Value::Object(m) => m,
            // `json!` of an object literal is always an object.
            _ => Map::new(),
        }
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
    pub state_snapshot: Option<BundleSnapshot>,
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
    /// A UUID in canonical form ([`crate::id`]).
    pub id: Option<String>,
    /// `agent_external_id`, else `agent_id` (the reference server's name).
    pub agent_id: Option<String>,
    pub status: Option<String>,
    pub last_task: Option<String>,
    /// A timestamp [`crate::time::parse`] reads.
    pub created_at: Option<String>,
    /// At most [`MAX_COUNT`].
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
    pub created_at: Option<DateTime<Utc>>,
}

/// A bundle's `state_snapshot`: ours carry `step_count` / `message_count`, the reference server's
/// `step` and a copy of the `messages`.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleSnapshot {
    pub step_count: u64,
    /// How many of the bundle's messages it covers, when it says (or copies them).
    pub message_count: Option<u64>,
    pub kind: Option<crate::SnapshotKind>,
    pub model: Option<String>,
    pub current_task: Option<String>,
    /// Its `state` object; for a foreign snapshot without one, what it says about itself minus
    /// the copy of the transcript.
    pub state: Value,
}

impl BundleSnapshot {
    /// Reads the object `s` (at `state_snapshot`): its counts are integers of at most
    /// [`MAX_COUNT`], its text fields strings; an unknown `kind` is none.
    pub fn read(s: &Map<String, Value>) -> Result<Self, BundleError> {
        let at = |key: &str| format!("state_snapshot.{key}");
        let step_count = match opt_count(s, "step_count", &at("step_count"))? {
            Some(n) => n,
            None => opt_count(s, "step", &at("step"))?.unwrap_or(0),
        };
        let message_count = match opt_count(s, "message_count", &at("message_count"))? {
            Some(n) => Some(n),
            None => s
                .get("messages")
                .and_then(Value::as_array)
                .map(|m| m.len() as u64),
        };
        opt_time(s, "created_at", &at("created_at"))?;
        let state = match s.get("state") {
            Some(v @ Value::Object(_)) => v.clone(),
            _ => {
                let mut rest = s.clone();
                rest.remove("messages");
                Value::Object(rest)
            }
        };
        Ok(Self {
            step_count,
            message_count,
            kind: opt_string(s, "kind", &at("kind"))?.and_then(|k| crate::SnapshotKind::parse(&k)),
            model: opt_string(s, "model", &at("model"))?,
            current_task: opt_string(s, "current_task", &at("current_task"))?,
            state,
        })
    }
}

/// The largest count a bundle may carry (`step_count`, `message_count`): 2^53, the largest
/// integer every JSON reader holds exactly (JavaScript's), and far enough below the stores'
/// 64-bit integers that a session imported with it can still count on.
pub const MAX_COUNT: u64 = 1 << 53;

/// An optional string field: absent or `null` is `None`, anything else but a string an error.
fn opt_string(
    map: &Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<String>, BundleError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(BundleError::new(path, "must be a string or null")),
    }
}

/// An optional count: a non-negative integer of at most [`MAX_COUNT`].
fn opt_count(map: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u64>, BundleError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= MAX_COUNT => Ok(Some(n)),
            _ => Err(BundleError::new(
                path,
                format!("must be an integer from 0 to {MAX_COUNT} (2^53)"),
            )),
        },
    }
}

/// An optional timestamp ([`crate::time::parse`]).
fn opt_time(
    map: &Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<DateTime<Utc>>, BundleError> {
    match opt_string(map, key, path)? {
        None => Ok(None),
        Some(s) => crate::time::parse(&s)
            .map(Some)
            .ok_or_else(|| BundleError::new(path, "must be an RFC 3339 timestamp")),
    }
}

/// An optional id: a UUID in canonical form ([`crate::id`]).
fn opt_id(map: &Map<String, Value>, key: &str, path: &str) -> Result<Option<String>, BundleError> {
    match opt_string(map, key, path)? {
        None => Ok(None),
        Some(s) if crate::id::parse_canonical(&s).is_some() => Ok(Some(s)),
        Some(_) => Err(BundleError::new(
            path,
            "must be a UUID (lower-case, hyphenated)",
        )),
    }
}

/// The bundle's memory, when it names a schema.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleMemory {
    pub schema_id: String,
    /// `memory.payload` as given (`null` when absent); opaque to the protocol.
    pub payload: Value,
}

/// Reads a bundle, checking the type and range of everything an import keeps (ids are UUIDs,
/// timestamps parse, counts are at most [`MAX_COUNT`], each message fits OpenAI's chat schema):
/// an error names the path. Unknown keys are ignored, `null` is absent, and a memory that names no
/// schema is none (SPEC: import without it). Takes the bundle by value and moves the messages out
/// of it: a bundle can hold megabytes of them.
pub fn parse_bundle(value: Value) -> Result<ParsedBundle, BundleError> {
    let Value::Object(mut top) = value else {
        return Err(BundleError::new("$", "must be an object"));
    };
    let raw_messages = match top.remove("messages") {
        Some(Value::Array(items)) => items,
        Some(_) => return Err(BundleError::new("messages", "must be an array")),
        None => return Err(BundleError::new("messages", "is missing")),
    };
    let messages = raw_messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    parse_envelope(top, messages)
}

/// The rest of [`parse_bundle`], for a caller that parsed the messages itself (e.g. in parallel,
/// with [`parse_message`]): `top` is the bundle without its `messages`.
pub fn parse_envelope(
    mut top: Map<String, Value>,
    messages: Vec<BundleMessage>,
) -> Result<ParsedBundle, BundleError> {
    let session = match top.get("session") {
        Some(Value::Object(s)) => {
            let at = |key: &str| format!("session.{key}");
            let agent_id = match opt_string(s, "agent_external_id", &at("agent_external_id"))? {
                Some(a) => Some(a),
                None => opt_string(s, "agent_id", &at("agent_id"))?,
            };
            opt_time(s, "created_at", &at("created_at"))?;
            opt_count(s, "message_count", &at("message_count"))?;
            BundleSession {
                id: opt_id(s, "id", &at("id"))?,
                agent_id,
                status: opt_string(s, "status", &at("status"))?,
                last_task: opt_string(s, "last_task", &at("last_task"))?,
                created_at: opt_string(s, "created_at", &at("created_at"))?,
                step_count: opt_count(s, "step_count", &at("step_count"))?,
                model: opt_string(s, "model", &at("model"))?,
            }
        }
        Some(_) => return Err(BundleError::new("session", "must be an object")),
        None => return Err(BundleError::new("session", "is missing")),
    };

    let memory = match top.remove("memory") {
        Some(Value::Object(mut m)) => match m.remove("schema_id") {
            Some(Value::String(schema_id)) => Some(BundleMemory {
                schema_id,
                payload: m.remove("payload").unwrap_or(Value::Null),
            }),
            _ => None,
        },
        _ => None,
    };

    let state_snapshot = match top.remove("state_snapshot") {
        None | Some(Value::Null) => None,
        Some(Value::Object(s)) => Some(BundleSnapshot::read(&s)?),
        Some(_) => {
            return Err(BundleError::new(
                "state_snapshot",
                "must be an object or null",
            ));
        }
    };

    let empty = Map::new();
    let metadata = match top.get("metadata") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err(BundleError::new("metadata", "must be an object")),
    };
    let total_cost_usd = match metadata.get("total_cost_usd") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_f64().ok_or_else(|| {
            BundleError::new("metadata.total_cost_usd", "must be a number or null")
        })?),
    };
    opt_time(&top, "exported_at", "exported_at")?;
    Ok(ParsedBundle {
        sbp_version: opt_string(&top, "sbp_version", "sbp_version")?,
        exported_at: opt_string(&top, "exported_at", "exported_at")?,
        label: opt_string(&top, "label", "label")?,
        session,
        messages,
        memory,
        state_snapshot,
        export_id: opt_id(metadata, "export_id", "metadata.export_id")?,
        message_count: opt_count(metadata, "message_count", "metadata.message_count")?,
        total_cost_usd,
    })
}

/// One entry of `messages` (at `index`, for error paths).
pub fn parse_message(index: usize, value: Value) -> Result<BundleMessage, BundleError> {
    let path = |field: &str| {
        if field.is_empty() {
            format!("messages[{index}]")
        } else {
            format!("messages[{index}].{field}")
        }
    };
    let Value::Object(mut map) = value else {
        return Err(BundleError::new(path(""), "must be an object"));
    };
    let model_used = opt_string(&map, "model_used", &path("model_used"))?;
    let cost_usd = match map.get("cost_usd") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64()
                .ok_or_else(|| BundleError::new(path("cost_usd"), "must be a number or null"))?,
        ),
    };
    let created_at = opt_time(&map, "created_at", &path("created_at"))?;
    for key in ["model_used", "cost_usd", "created_at"] {
        map.remove(key);
    }
    // What is left is the chat message the import stores: it must be one a strict upstream takes.
    let body = Value::Object(map);
    crate::schema::check_message(&path(""), &body)
        .map_err(|e| BundleError::new(e.param, e.reason))?;
    let role = body["role"].as_str().unwrap_or_default().to_owned();
    Ok(BundleMessage {
        role,
        body,
        model_used,
        cost_usd,
        created_at,
    })
}

/// A bundle's text split for parsing in pieces (see [`delimit_messages`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Delimited {
    /// Everything but `messages`, parsed.
    pub envelope: Map<String, Value>,
    /// The byte range of each message within the text, not parsed.
    pub messages: Vec<std::ops::Range<usize>>,
}

/// Splits a bundle's text for parsing in pieces, in one pass over the text.
pub fn delimit_messages(text: &str) -> Result<Delimited, BundleError> {
    let skeleton: Skeleton<'_> = serde_json::from_str(text)
        .map_err(|e| BundleError::new("$", format!("is not a bundle object: {e}")))?;
    let items = skeleton
        .messages
        .ok_or_else(|| BundleError::new("messages", "is missing"))?;
    let base = text.as_ptr() as usize;
    let ranges = items
        .iter()
        .map(|raw| {
            // `raw` borrows from `text`, so its address lies within it.
            let start = raw.get().as_ptr() as usize - base;
            start..start + raw.get().len()
        })
        .collect();
    Ok(Delimited {
        envelope: skeleton.envelope,
        messages: ranges,
    })
}

struct Skeleton<'a> {
    envelope: Map<String, Value>,
    messages: Option<Vec<&'a serde_json::value::RawValue>>,
}

impl<'de> serde::Deserialize<'de> for Skeleton<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Skeleton<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a bundle object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut envelope = Map::new();
                let mut messages = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "messages" {
                        messages = Some(map.next_value()?);
                    } else {
                        envelope.insert(key, map.next_value()?);
                    }
                }
                Ok(Skeleton { envelope, messages })
            }
        }
        d.deserialize_map(Fields)
    }
}

/// Whether `bytes` are a bundle as [`seal`] wrote it (`{"bundle_cid": "<cid>", ...}`, canonical) whose
/// digest is `cid`. Checks the bytes as they are, without parsing: what a store kept from a seal
/// verifies in one pass of SHA-256. `false` means "not proven": verify the parsed bundle instead.
pub fn sealed_bytes_match(bytes: &[u8], cid: &str) -> bool {
    let head = format!("{{\"bundle_cid\": \"{cid}\"");
    let Some(rest) = bytes.strip_prefix(head.as_bytes()) else {
        return false;
    };
    let mut hasher = Sha256::new();
    hasher.update(b"{");
    match rest.strip_prefix(b", ") {
        Some(others) => hasher.update(others),
        // The digest was the only entry.
        None => hasher.update(rest),
    }
    hex::encode(hasher.finalize()) == cid
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
    fn is_cid_is_64_lowercase_hex() {
        let cid = compute_cid(&Map::new());
        assert!(is_cid(&cid));
        assert!(!is_cid(&cid.to_uppercase()));
        assert!(!is_cid(&cid[..63]));
        assert!(!is_cid(&format!("{cid}0")));
        assert!(!is_cid(&format!("{}g", &cid[..63])));
        assert!(!is_cid(""));
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
        let parsed = parse_bundle(Value::Object(bundle)).unwrap();
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
        let snapshot = parsed.state_snapshot.as_ref().unwrap();
        assert_eq!((snapshot.step_count, snapshot.message_count), (2, Some(4)));
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
    fn seal_with_raw_equals_seal() {
        let mut whole = rich_bundle();
        let messages = whole["messages"].clone();
        let mut rest = whole.clone();
        rest.remove("messages");
        let raw = to_canonical_bytes(&messages);
        let (cid, bytes) = seal(&mut whole);
        let (raw_cid, raw_bytes) = seal_with_raw(&mut rest, "messages", &raw);
        assert_eq!((raw_cid, raw_bytes), (cid.clone(), bytes.clone()));
        assert!(sealed_bytes_match(&bytes, &cid));
        // The raw entry may sort anywhere, including before `bundle_cid` and last.
        for key in ["a", "zz"] {
            let mut with = rich_bundle();
            with.insert(key.to_owned(), messages.clone());
            let (cid, bytes) = seal(&mut with);
            let mut without = rich_bundle();
            assert_eq!(seal_with_raw(&mut without, key, &raw), (cid, bytes));
        }
    }

    #[test]
    fn write_object_with_merges_sorted() {
        let map = obj(json!({"role": "user", "content": "é", "b": 1}));
        let (model, role) = (json!("m"), json!("assistant"));
        let mut out = Vec::new();
        crate::canonical::write_object_with(
            &map,
            &[("model_used", &model), ("role", &role)],
            &mut out,
        );
        let mut merged = map.clone();
        merged.insert("model_used".into(), model);
        merged.insert("role".into(), role);
        assert_eq!(out, to_canonical_bytes(&Value::Object(merged)));
    }

    #[test]
    fn delimited_messages_parse_like_the_whole() {
        let mut bundle = obj(rich_importable());
        let (_, bytes) = seal(&mut bundle);
        let text = std::str::from_utf8(&bytes).unwrap();
        let Delimited {
            envelope,
            messages: ranges,
        } = delimit_messages(text).unwrap();
        let messages: Vec<BundleMessage> = ranges
            .iter()
            .enumerate()
            .map(|(i, r)| {
                parse_message(i, serde_json::from_str(&text[r.clone()]).unwrap()).unwrap()
            })
            .collect();
        let pieces = parse_envelope(envelope, messages).unwrap();
        let whole = parse_bundle(Value::Object(bundle)).unwrap();
        assert_eq!(pieces, whole);
        assert!(delimit_messages("[1]").is_err());
        assert_eq!(
            delimit_messages(r#"{"session": {}}"#).unwrap_err().path,
            "messages"
        );
        assert!(delimit_messages(r#"{"messages": 3}"#).is_err());
    }

    #[test]
    fn verify_and_seal_agrees_with_verify_cid() {
        // The golden bundle (digest field `hash`) when ../shared is present, else a sealed one.
        let mut golden = golden().unwrap_or_else(|| {
            let mut b = rich_bundle();
            seal(&mut b);
            b
        });
        let expected = verify_cid(&golden);
        let (cid, bytes) = verify_and_seal(&mut golden).unwrap();
        assert_eq!(Ok(cid.clone()), expected);
        assert!(sealed_bytes_match(&bytes, &cid));
        assert!(!golden.contains_key("hash"));
        let mut tampered = rich_bundle();
        seal(&mut tampered);
        tampered.insert("label".into(), json!("changed"));
        assert!(matches!(
            verify_and_seal(&mut tampered),
            Err(CidError::Mismatch { .. })
        ));
        assert_eq!(verify_and_seal(&mut Map::new()), Err(CidError::Missing));
    }

    #[test]
    fn sealed_bytes_verify_without_parsing() {
        let mut bundle = rich_bundle();
        let (cid, bytes) = seal(&mut bundle);
        assert!(sealed_bytes_match(&bytes, &cid));
        // One changed byte anywhere, or another CID, is not proven.
        for at in [1, bytes.len() / 2, bytes.len() - 2] {
            let mut tampered = bytes.clone();
            tampered[at] ^= 0x01;
            assert!(!sealed_bytes_match(&tampered, &cid), "byte {at}");
        }
        assert!(!sealed_bytes_match(&bytes, &"0".repeat(64)));
        // Bytes in another layout (pretty-printed) are not proven either, though the bundle verifies.
        let pretty = serde_json::to_vec_pretty(&Value::Object(bundle.clone())).unwrap();
        assert!(!sealed_bytes_match(&pretty, &cid));
        assert_eq!(verify_cid(&bundle).unwrap(), cid);
        // A bundle whose digest is its only entry.
        let mut empty = Map::new();
        let (cid, bytes) = seal(&mut empty);
        assert_eq!(bytes, format!("{{\"bundle_cid\": \"{cid}\"}}").into_bytes());
        assert!(sealed_bytes_match(&bytes, &cid));
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

    const SESSION_ID: &str = "0192f0c4-8a6e-7c3b-9d2e-5f1a2b3c4d5e";
    const EXPORT_ID: &str = "0192f0c4-8a6e-7c3b-9d2e-5f1a2b3c4d5f";

    /// [`rich_bundle`] with ids an import accepts (its own, "s1" and "e1", only hash).
    fn rich_importable() -> Value {
        let mut bundle = Value::Object(rich_bundle());
        bundle["session"]["id"] = json!(SESSION_ID);
        bundle["metadata"]["export_id"] = json!(EXPORT_ID);
        bundle
    }

    #[test]
    fn rich_bundle_parses() {
        let parsed = parse_bundle(rich_importable()).unwrap();
        assert_eq!(parsed.session.id.as_deref(), Some(SESSION_ID));
        assert_eq!(parsed.export_id.as_deref(), Some(EXPORT_ID));
        assert_eq!(parsed.label.as_deref(), Some("Tokyo — 東京 ✈ 😀"));
        assert_eq!(parsed.session.agent_id.as_deref(), Some("agent-1"));
        assert_eq!(parsed.session.step_count, Some(12));
        assert_eq!(parsed.session.last_task, None);
        let assistant = &parsed.messages[1];
        assert_eq!(assistant.cost_usd, Some(1e-5));
        assert_eq!(
            assistant
                .created_at
                .map(|t| crate::time::iso(&t))
                .as_deref(),
            Some("2026-11-22T09:01:00.000Z")
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
        assert!(parse_bundle(base.clone()).is_ok());
        let hi = json!({"role": "user", "content": "hi"});
        let with = |key: &str, field: &str, v: Value| {
            let mut b = json!({"session": {}, "messages": [hi], "metadata": {}});
            match key {
                "" => b[field] = v,
                _ => b[key][field] = v,
            }
            b
        };
        let snapshot = |field: &str, v: Value| {
            let mut s = json!({"kind": "checkpoint"});
            s[field] = v;
            json!({"session": {}, "messages": [], "state_snapshot": s})
        };
        let cases = [
            (json!([]), "$"),
            (json!({"messages": []}), "session"),
            (json!({"session": [], "messages": []}), "session"),
            (json!({"session": {}}), "messages"),
            (json!({"session": {}, "messages": {}}), "messages"),
            (json!({"session": {}, "messages": [hi, 3]}), "messages[1]"),
            (
                json!({"session": {}, "messages": [hi, {"content": "x"}]}),
                "messages[1].role",
            ),
            (
                json!({"session": {}, "messages": [{"role": "", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"session": {}, "messages": [{"role": "usr", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"session": {}, "messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"session": {}, "messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].tool_call_id",
            ),
            (
                json!({"session": {}, "messages": [{"role": "user", "content": "x", "created_at": "soon"}]}),
                "messages[0].created_at",
            ),
            (
                json!({"session": {}, "messages": [{"role": "user", "content": "x", "cost_usd": "1"}]}),
                "messages[0].cost_usd",
            ),
            (
                json!({"session": {}, "messages": [{"role": "user", "content": "x", "model_used": 1}]}),
                "messages[0].model_used",
            ),
            (
                json!({"session": {}, "messages": [], "state_snapshot": "x"}),
                "state_snapshot",
            ),
            (with("session", "id", json!("s1")), "session.id"),
            (
                with(
                    "session",
                    "id",
                    json!("0192F0C4-8A6E-7C3B-9D2E-5F1A2B3C4D5E"),
                ),
                "session.id",
            ),
            (
                with("session", "step_count", json!(-1)),
                "session.step_count",
            ),
            (
                with("session", "step_count", json!(1.5)),
                "session.step_count",
            ),
            (
                with("session", "step_count", json!("3")),
                "session.step_count",
            ),
            (
                with("session", "step_count", json!(9_223_372_036_854_775_808u64)),
                "session.step_count",
            ),
            (
                with("session", "step_count", json!(9_223_372_036_854_775_807u64)),
                "session.step_count",
            ),
            (
                with("session", "step_count", json!(MAX_COUNT + 1)),
                "session.step_count",
            ),
            (
                with("session", "message_count", json!(-2)),
                "session.message_count",
            ),
            (
                with("session", "created_at", json!("2026-13-01")),
                "session.created_at",
            ),
            (with("session", "agent_id", json!(7)), "session.agent_id"),
            (with("session", "last_task", json!({})), "session.last_task"),
            (with("", "exported_at", json!("now")), "exported_at"),
            (with("", "label", json!(1)), "label"),
            (with("", "metadata", json!([])), "metadata"),
            (
                with("metadata", "export_id", json!("e1")),
                "metadata.export_id",
            ),
            (
                with("metadata", "message_count", json!(1e30)),
                "metadata.message_count",
            ),
            (
                with("metadata", "total_cost_usd", json!("x")),
                "metadata.total_cost_usd",
            ),
            (snapshot("step", json!(u64::MAX)), "state_snapshot.step"),
            (
                snapshot("step_count", json!(-1)),
                "state_snapshot.step_count",
            ),
            (
                snapshot("message_count", json!(0.5)),
                "state_snapshot.message_count",
            ),
            (
                snapshot("created_at", json!("x")),
                "state_snapshot.created_at",
            ),
            (snapshot("model", json!(3)), "state_snapshot.model"),
        ];
        for (value, path) in cases {
            let err = parse_bundle(value.clone()).unwrap_err();
            assert_eq!(err.path, path, "{value}");
            assert!(err.to_string().contains(path));
        }
        // The largest count is read, and so is null for each optional field.
        let most = parse_bundle(with("session", "step_count", json!(MAX_COUNT))).unwrap();
        assert_eq!(most.session.step_count, Some(MAX_COUNT));
        for (key, field) in [("session", "id"), ("session", "step_count"), ("", "label")] {
            assert!(
                parse_bundle(with(key, field, Value::Null)).is_ok(),
                "{field}"
            );
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
            let parsed = parse_bundle(value.clone()).unwrap();
            assert_eq!(parsed.memory, None);
            assert_eq!(parsed.state_snapshot, None);
        }
        let value =
            json!({"session": {}, "messages": [], "memory": {"schema_id": "urn:x"}, "extra": 1});
        let memory = parse_bundle(value.clone()).unwrap().memory.unwrap();
        assert_eq!(
            memory,
            BundleMemory {
                schema_id: "urn:x".into(),
                payload: Value::Null
            }
        );
    }

    #[test]
    fn snapshots_of_both_shapes_are_read() {
        let ours = json!({"snapshot_id": "x", "kind": "post_action", "step": 3, "step_count": 3,
            "message_count": 6, "model": "m", "current_task": "t", "state": {"turn_id": "u"}});
        let s = BundleSnapshot::read(&obj(ours)).expect("valid");
        assert_eq!((s.step_count, s.message_count), (3, Some(6)));
        assert_eq!(s.kind, Some(crate::SnapshotKind::PostAction));
        assert_eq!(s.state, json!({"turn_id": "u"}));
        let reference = json!({"step": 2, "messages": [{"role": "user"}], "note": "n"});
        let s = BundleSnapshot::read(&obj(reference)).expect("valid");
        assert_eq!((s.step_count, s.message_count, s.kind), (2, Some(1), None));
        assert_eq!(s.state, json!({"step": 2, "note": "n"}));
    }
}
