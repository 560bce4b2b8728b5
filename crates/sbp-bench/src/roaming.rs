//! L3 roaming: a session of --roaming-messages messages is made by importing a bundle built and
//! sealed here; then, --iterations times in a row, it is exported (`POST .../export`) and the fresh
//! roaming token imported (`POST /v1/sbp/sessions/import`, single use). Every answer is checked
//! (201, message counts), a consumed token must be refused, and one last export's bundle must verify
//! against its `bundle_cid`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use serde::Serialize;
use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::http::{HttpConn, Response, uri};
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Mem, Stack, Sync};
use crate::stats::Exact;

#[derive(Debug, Clone)]
pub struct Params {
    /// Messages in the seed bundle (the session then holds one more: the import's provenance note).
    pub messages: usize,
    pub iterations: usize,
    pub sync: Sync,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub sync: Sync,
    pub iterations: usize,
    /// Messages in the seed bundle.
    pub bundle_messages: usize,
    /// Messages of the session that is exported (the seed's plus the provenance note).
    pub session_messages: u64,
    /// Canonical bytes of the sealed seed bundle.
    pub bundle_bytes: usize,
    /// Canonical bytes of the session's exported bundle (per message it adds `created_at`,
    /// `model_used`, `cost_usd`).
    pub export_bundle_bytes: usize,
    /// From sending the raw seed bundle to its 201.
    pub seed_import_ms: f64,
    /// Client-side wall time of each request, from sending it to the last byte of the answer.
    pub export: Exact,
    pub import: Exact,
    /// Export plus the import of its token, per iteration.
    pub pair: Exact,
    pub export_ms: Vec<f64>,
    pub import_ms: Vec<f64>,
    /// Status and body of importing an already consumed token again (must not be a 201).
    pub reimport_refused: String,
    /// Gateway CPU over the measured iterations, and per export + import pair.
    pub cpu: CpuUse,
    pub gateway_cpu_ms_per_pair: f64,
    pub gateway_mem_end: Mem,
    pub data_files: BTreeMap<String, u64>,
    pub load_before: [f64; 3],
}

pub async fn run(env: &Env, label: &str, p: &Params) -> anyhow::Result<Report> {
    if p.messages == 0 || p.iterations == 0 {
        bail!("--roaming-messages and --iterations must be positive");
    }
    let load_before = procs::loadavg();
    Stack::measure_with(env, label, p.sync, async |stack| {
        measure(stack, p, load_before).await
    })
    .await
}

/// Words for the messages: mostly ASCII, with accents, CJK, symbols and an emoji (4 UTF-8 bytes,
/// a surrogate pair in canonical JSON), plus quotes and a newline to escape.
const WORDS: &[&str] = &[
    "the",
    "budget",
    "for",
    "Tokyo",
    "東京",
    "trip",
    "is",
    "1500.50",
    "EUR",
    "café",
    "naïve",
    "résumé",
    "✈",
    "flight",
    "hotel",
    "near",
    "Shinjuku",
    "新宿",
    "station",
    "and",
    "a",
    "day",
    "in",
    "Kyoto",
    "京都",
    "😀",
    "\"quoted\"",
    "plan:",
    "Zürich",
    "Straße",
    "→",
    "then",
    "back",
    "with",
    "the",
    "train",
    "at",
    "09:30",
    "please",
    "confirm",
    "ok",
    "—",
    "weather",
    "forecast",
    "says",
    "rain",
    "sunny",
    "temple",
    "dinner",
    "reservation",
    "for",
    "two",
    "at",
    "19:00\n",
];

/// The content of message `i`: 200 to 400 characters, different for every message.
fn content(i: usize) -> String {
    // A small LCG keeps the text deterministic across runs without a dependency.
    let mut state = (i as u64).wrapping_mul(6_364_136_223_846_793_005) ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    let target = 200 + next() % 201;
    let mut text = format!("#{i}: ");
    let mut chars = text.chars().count();
    while chars < target {
        let word = WORDS[next() % WORDS.len()];
        text.push_str(word);
        text.push(' ');
        chars += word.chars().count() + 1;
    }
    text.chars().take(target).collect()
}

fn iso_now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, false)
}

/// The seed bundle, sealed: (bundle, canonical bytes).
fn seed_bundle(messages: usize) -> (Map<String, Value>, Vec<u8>) {
    let now = iso_now();
    let msgs: Vec<Value> = (0..messages)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": content(i)})
        })
        .collect();
    let mut bundle = Map::new();
    bundle.insert("sbp_version".into(), json!("1.0"));
    bundle.insert("exported_at".into(), json!(now));
    bundle.insert("label".into(), Value::Null);
    bundle.insert(
        "session".into(),
        json!({
            "id": Uuid::new_v4(),
            "agent_id": "bench",
            "status": "idle",
            "created_at": now,
            "step_count": messages / 2,
        }),
    );
    bundle.insert("messages".into(), Value::Array(msgs));
    bundle.insert("memory".into(), json!({}));
    bundle.insert("state_snapshot".into(), Value::Null);
    bundle.insert(
        "metadata".into(),
        json!({"export_id": Uuid::new_v4(), "message_count": messages}),
    );
    let (_, bytes) = sbp_protocol::bundle::seal(&mut bundle);
    (bundle, bytes)
}

/// A 201 with a JSON object body, or the status and body as the error.
fn created(what: &str, resp: &Response) -> anyhow::Result<Value> {
    if resp.status != StatusCode::CREATED {
        bail!("{what}: {}", full(resp));
    }
    resp.json().with_context(|| what.to_owned())
}

/// Status and the whole body, so a gateway problem is reported with its exact answer.
fn full(resp: &Response) -> String {
    format!("{} {}", resp.status, String::from_utf8_lossy(&resp.body))
}

fn str_field<'a>(v: &'a Value, key: &str, what: &str) -> anyhow::Result<&'a str> {
    v.get(key)
        .and_then(Value::as_str)
        .with_context(|| format!("{what}: no `{key}` in {v}"))
}

fn u64_field(v: &Value, key: &str, what: &str) -> anyhow::Result<u64> {
    v.get(key)
        .and_then(Value::as_u64)
        .with_context(|| format!("{what}: no `{key}` in {v}"))
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

async fn measure(stack: &Stack, p: &Params, load_before: [f64; 3]) -> anyhow::Result<Report> {
    let mut conn = HttpConn::connect(stack.gateway.addr).await?;
    let import_path = uri("/v1/sbp/sessions/import")?;

    // Seed: the raw bundle, sent as its canonical bytes (valid JSON) inside `{"bundle": ...}`.
    let (_, bundle_bytes) = seed_bundle(p.messages);
    let mut body = Vec::with_capacity(bundle_bytes.len() + 16);
    body.extend_from_slice(br#"{"bundle": "#);
    body.extend_from_slice(&bundle_bytes);
    body.push(b'}');
    let t0 = Instant::now();
    let resp = conn.post(&import_path, None, Bytes::from(body)).await?;
    let seed_import = t0.elapsed();
    let v = created("raw bundle import", &resp)?;
    let restored = u64_field(&v, "messages_restored", "raw bundle import")?;
    if restored != p.messages as u64 {
        bail!(
            "raw bundle import restored {restored} messages, sent {}: {v}",
            p.messages
        );
    }
    let id = str_field(&v, "session_id", "raw bundle import")?.to_owned();
    let token = HeaderValue::from_str(str_field(&v, "session_token", "raw bundle import")?)?;
    let resp = conn
        .get(&uri(&format!("/v1/sessions/{id}"))?, Some(&token))
        .await?;
    if resp.status != StatusCode::OK {
        bail!("GET /v1/sessions/{id}: {}", full(&resp));
    }
    let session_messages = u64_field(&resp.json()?, "message_count", "session view")?;
    let expected = p.messages as u64 + 1;
    if session_messages != expected {
        bail!("the imported session holds {session_messages} messages, expected {expected}");
    }

    let export_path = uri(&format!("/v1/sbp/sessions/{id}/export"))?;
    let export_body = Bytes::from_static(br#"{"ttl_seconds": 3600, "label": "sbp-bench roaming"}"#);
    let mut export_ms = Vec::with_capacity(p.iterations);
    let mut import_ms = Vec::with_capacity(p.iterations);
    let mut last_token = String::new();
    let cpu0 = CpuSnapshot::take(&[("gateway", stack.gateway.pid)]);
    for i in 0..p.iterations {
        let what = format!("iteration {i}: export");
        let t0 = Instant::now();
        let resp = conn
            .post(&export_path, Some(&token), export_body.clone())
            .await?;
        let export = t0.elapsed();
        let v = created(&what, &resp)?;
        let count = u64_field(&v, "message_count", &what)?;
        if count != session_messages {
            bail!("{what}: message_count {count}, expected {session_messages}");
        }
        let roaming_token = str_field(&v, "roaming_token", &what)?.to_owned();

        let what = format!("iteration {i}: import");
        let body =
            serde_json::to_vec(&json!({"roaming_token": roaming_token, "allow_reuse": false}))?;
        let t0 = Instant::now();
        let resp = conn.post(&import_path, None, Bytes::from(body)).await?;
        let import = t0.elapsed();
        let v = created(&what, &resp)?;
        let restored = u64_field(&v, "messages_restored", &what)?;
        if restored != session_messages {
            bail!("{what}: messages_restored {restored}, expected {session_messages}");
        }
        str_field(&v, "session_token", &what)?;
        export_ms.push(ms(export));
        import_ms.push(ms(import));
        last_token = roaming_token;
    }
    let cpu = cpu0.since();

    // Single use: the last token was consumed by its import.
    let body = serde_json::to_vec(&json!({"roaming_token": last_token}))?;
    let resp = conn.post(&import_path, None, Bytes::from(body)).await?;
    if resp.status == StatusCode::CREATED || resp.status.is_server_error() {
        bail!("importing a consumed token again: {}", full(&resp));
    }
    let reimport_refused = resp.describe();

    // One more export, untimed, with the bundle: its CID must verify and it must hold every message.
    let what = "export with include_bundle";
    let body = br#"{"ttl_seconds": 3600, "include_bundle": true}"#;
    let resp = conn
        .post(&export_path, Some(&token), Bytes::from_static(body))
        .await?;
    let v = created(what, &resp)?;
    let cid = str_field(&v, "bundle_cid", what)?;
    let Some(bundle_value @ Value::Object(bundle)) = v.get("bundle") else {
        bail!("{what}: no `bundle` object in the answer");
    };
    let computed = sbp_protocol::bundle::verify_cid(bundle)
        .map_err(|e| anyhow::anyhow!("{what}: the bundle does not verify: {e}"))?;
    if computed != cid {
        bail!("{what}: bundle_cid {cid}, the bundle's own CID {computed}");
    }
    let n = bundle
        .get("messages")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    if n as u64 != session_messages {
        bail!("{what}: {n} messages in the bundle, expected {session_messages}");
    }
    let export_bundle_bytes = sbp_protocol::canonical::to_canonical_bytes(bundle_value).len();

    let pair_ms: Vec<f64> = export_ms
        .iter()
        .zip(&import_ms)
        .map(|(e, i)| ((e + i) * 1e3).round() / 1e3)
        .collect();
    let gateway_cpu_ms_per_pair = cpu.cpu_seconds("gateway") * 1000.0 / p.iterations as f64;
    Ok(Report {
        sync: p.sync,
        iterations: p.iterations,
        bundle_messages: p.messages,
        session_messages,
        bundle_bytes: bundle_bytes.len(),
        export_bundle_bytes,
        seed_import_ms: ms(seed_import),
        export: Exact::of(&export_ms),
        import: Exact::of(&import_ms),
        pair: Exact::of(&pair_ms),
        export_ms,
        import_ms,
        reimport_refused,
        cpu,
        gateway_cpu_ms_per_pair: procs::round1(gateway_cpu_ms_per_pair),
        gateway_mem_end: procs::mem(stack.gateway.pid)?,
        data_files: stack.data_files(),
        load_before,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;

    #[test]
    fn contents_are_200_to_400_chars_and_distinct() {
        let texts: Vec<String> = (0..500).map(content).collect();
        for t in &texts {
            let n = t.chars().count();
            assert!((200..=400).contains(&n), "{n}: {t}");
        }
        let distinct: std::collections::BTreeSet<&String> = texts.iter().collect();
        assert_eq!(distinct.len(), texts.len());
        assert!(texts.iter().any(|t| !t.is_ascii()));
    }

    #[test]
    fn seed_bundle_verifies() {
        let (bundle, bytes) = seed_bundle(10);
        let cid = sbp_protocol::bundle::verify_cid(&bundle).unwrap();
        assert_eq!(bundle["bundle_cid"], json!(cid));
        let back: Map<String, Value> = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(sbp_protocol::bundle::verify_cid(&back).unwrap(), cid);
        assert_eq!(back["messages"].as_array().unwrap().len(), 10);
    }
}
