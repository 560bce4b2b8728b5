//! Tether drain: a session whose surface attached once and detached gets N backend-pushed turns
//! (tethered, durable); a surface then attaches and the time from sending ATTACH_SESSION to the
//! last TETHER_TURN gives the drain rate. Count, order (`seq`, `turn_index`) and content are checked.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::http::{HttpConn, uri};
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Mem, Stack, Sync};
use crate::stats::{Latencies, Summary};

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

#[derive(Debug, Clone)]
pub struct Params {
    pub turns: u64,
    pub connections: usize,
    pub sync: Sync,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub sync: Sync,
    pub turns: u64,
    pub push_connections: usize,
    pub push_s: f64,
    pub push_turns_per_s: f64,
    pub push_latency: Summary,
    pub push_errors: u64,
    pub pending_before_attach: u64,
    pub queued_turns: u64,
    pub received: u64,
    /// From sending ATTACH_SESSION to receiving SESSION_ATTACHED.
    pub attached_ms: f64,
    /// From sending ATTACH_SESSION to receiving the last TETHER_TURN.
    pub drain_s: f64,
    pub drain_turns_per_s: f64,
    /// `seq` strictly increasing and `turn_index` 0, 1, 2, ... in arrival order.
    pub in_order: bool,
    /// Every pushed content arrived exactly once.
    pub all_contents_once: bool,
    /// Tether entries still pending a moment after the drain (delivered ones are removed).
    pub pending_after_drain: u64,
    pub drain_cpu: CpuUse,
    pub gateway_mem_end: Mem,
    pub load_before: [f64; 3],
}

pub async fn run(env: &Env, label: &str, p: &Params) -> anyhow::Result<Report> {
    let load_before = procs::loadavg();
    Stack::measure_with(env, label, p.sync, async |stack| {
        measure(stack, p, load_before).await
    })
    .await
}

/// A new idle session: (id, token).
pub async fn create_session(conn: &mut HttpConn) -> anyhow::Result<(String, String)> {
    let resp = conn
        .post(&uri("/v1/sessions")?, None, Bytes::from_static(b"{}"))
        .await?;
    if !resp.status.is_success() {
        bail!("POST /v1/sessions: {}", resp.describe());
    }
    let v = resp.json()?;
    let field = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .with_context(|| format!("POST /v1/sessions: no {k} in {v}"))
    };
    Ok((field("session_id")?, field("session_token")?))
}

pub fn attach_frame(id: &str, token: &str) -> String {
    json!({
        "type": "ATTACH_SESSION",
        "session_id": id,
        "session_token": token,
        "surface_context": {"device_type": "desktop", "surface_id": "sbp-bench"},
    })
    .to_string()
}

/// The fields of a server frame the bench looks at.
#[derive(Debug, Deserialize)]
struct FrameLite<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    queued_turns: Option<u64>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    turn_index: Option<u64>,
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

/// Reads frames until SESSION_ATTACHED; returns its `queued_turns`.
pub async fn wait_attached(ws: &mut Ws) -> anyhow::Result<u64> {
    while let Some(msg) = ws.next().await {
        if let Message::Text(t) = msg? {
            let f: FrameLite<'_> = serde_json::from_str(t.as_str())
                .with_context(|| format!("bad frame {}", t.as_str()))?;
            match f.kind.as_ref() {
                "SESSION_ATTACHED" => return Ok(f.queued_turns.unwrap_or(0)),
                "SESSION_NOT_FOUND" | "FORBIDDEN" | "PROTOCOL_ERROR" => {
                    bail!("attach refused: {}", t.as_str())
                }
                _ => {}
            }
        }
    }
    bail!("connection closed before SESSION_ATTACHED")
}

pub fn ws_url(addr: SocketAddr, id: &str) -> String {
    format!("ws://{addr}/v1/sbp/ws/{id}")
}

async fn session_view(conn: &mut HttpConn, id: &str, token: &HeaderValue) -> anyhow::Result<Value> {
    let resp = conn
        .get(&uri(&format!("/v1/sessions/{id}"))?, Some(token))
        .await?;
    if resp.status != StatusCode::OK {
        bail!("GET /v1/sessions/{id}: {}", resp.describe());
    }
    resp.json()
}

fn pending(view: &Value) -> u64 {
    view.get("tether_turns_pending")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

async fn measure(stack: &Stack, p: &Params, load_before: [f64; 3]) -> anyhow::Result<Report> {
    let addr = stack.gateway.addr;
    let mut conn = HttpConn::connect(addr).await?;
    let (id, token) = create_session(&mut conn).await?;
    let token_hv = HeaderValue::from_str(&token)?;

    // Attach once and detach, so the session has had a surface and the tether is on.
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url(addr, &id)).await?;
    ws.send(Message::text(attach_frame(&id, &token))).await?;
    wait_attached(&mut ws).await?;
    ws.send(Message::text(r#"{"type":"DETACH"}"#)).await?;
    // The gateway answers DETACH by closing; wait for that so the detach is complete.
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = ws.next().await {}
    })
    .await;
    drop(ws);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = session_view(&mut conn, &id, &token_hv).await?;
        let attached = v.get("surface_attached").and_then(Value::as_bool);
        let tether = v.get("tether_enabled").and_then(Value::as_bool);
        if attached == Some(false) && tether == Some(true) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the session did not become detached with the tether on: {v}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Push the turns concurrently.
    let next = Arc::new(AtomicU64::new(0));
    let push_start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..p.connections {
        let next = next.clone();
        let token = token_hv.clone();
        let path = uri(&format!("/v1/sbp/sessions/{id}/turns"))?;
        let total = p.turns;
        tasks.push(tokio::spawn(async move {
            let mut c = HttpConn::connect(addr).await?;
            let mut lat = Latencies::new();
            let mut errors = 0u64;
            let mut first_error: Option<String> = None;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let body = Bytes::from(format!(r#"{{"content":"tether turn {i}"}}"#));
                let t0 = Instant::now();
                match c.post(&path, Some(&token), body).await {
                    Ok(r) if r.status == StatusCode::CREATED => lat.record(t0.elapsed()),
                    Ok(r) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| r.describe());
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                        c.reconnect().await?;
                    }
                }
            }
            Ok::<_, anyhow::Error>((lat, errors, first_error))
        }));
    }
    let mut push_lat = Latencies::new();
    let mut push_errors = 0;
    let mut first_error = None;
    for t in tasks {
        let (lat, errors, first) = t.await??;
        push_lat.merge(&lat);
        push_errors += errors;
        if first_error.is_none() {
            first_error = first;
        }
    }
    let push_s = push_start.elapsed().as_secs_f64();
    if push_errors > 0 {
        bail!(
            "{push_errors} pushes failed; first: {}",
            first_error.unwrap_or_default()
        );
    }
    let pending_before_attach = pending(&session_view(&mut conn, &id, &token_hv).await?);

    // Drain: handshake first, then time ATTACH_SESSION -> last TETHER_TURN.
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url(addr, &id)).await?;
    let cpu0 = CpuSnapshot::take(&[("gateway", stack.gateway.pid)]);
    let t0 = Instant::now();
    ws.send(Message::text(attach_frame(&id, &token))).await?;
    let mut seen = vec![false; usize::try_from(p.turns)?];
    let mut duplicates_or_unknown = 0u64;
    let mut in_order = true;
    let mut last_seq = 0u64;
    let mut received = 0u64;
    let mut queued: Option<u64> = None;
    let mut attached_at = None;
    let mut last_at = None;
    let drain = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(msg) = ws.next().await {
            let Message::Text(t) = msg? else { continue };
            let f: FrameLite<'_> = serde_json::from_str(t.as_str())
                .with_context(|| format!("bad frame {}", t.as_str()))?;
            match f.kind.as_ref() {
                "SESSION_ATTACHED" => {
                    attached_at = Some(Instant::now());
                    let q = f.queued_turns.unwrap_or(0);
                    queued = Some(q);
                    if q == 0 {
                        break;
                    }
                }
                "TETHER_TURN" => {
                    let seq = f.seq.unwrap_or(0);
                    if seq <= last_seq || f.turn_index != Some(received) {
                        in_order = false;
                    }
                    last_seq = seq;
                    received += 1;
                    let n = f
                        .content
                        .as_deref()
                        .and_then(|c| c.strip_prefix("tether turn "))
                        .and_then(|n| n.parse::<usize>().ok());
                    match n.and_then(|n| seen.get_mut(n)) {
                        Some(slot) if !*slot => *slot = true,
                        _ => duplicates_or_unknown += 1,
                    }
                    if Some(received) == queued {
                        last_at = Some(Instant::now());
                        break;
                    }
                }
                "SESSION_NOT_FOUND" | "FORBIDDEN" | "PROTOCOL_ERROR" => {
                    bail!("attach refused: {}", t.as_str())
                }
                _ => {}
            }
        }
        Ok::<_, anyhow::Error>(())
    })
    .await;
    let drain_cpu = cpu0.since();
    match drain {
        Err(_) => bail!("drain did not finish within 300 s ({received} turns received)"),
        Ok(r) => r?,
    }
    let queued_turns = queued.context("no SESSION_ATTACHED")?;
    let end = last_at.or(attached_at).context("drain ended early")?;
    let drain_s = end.duration_since(t0).as_secs_f64();
    let attached_ms = attached_at.map_or(0.0, |a| a.duration_since(t0).as_secs_f64() * 1000.0);

    // Delivered turns leave the tether; give the gateway a moment to record that.
    let mut pending_after_drain = u64::MAX;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        pending_after_drain = pending(&session_view(&mut conn, &id, &token_hv).await?);
        if pending_after_drain == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = ws.close(None).await;

    Ok(Report {
        sync: p.sync,
        turns: p.turns,
        push_connections: p.connections,
        push_s: (push_s * 1000.0).round() / 1000.0,
        push_turns_per_s: procs::round1(p.turns as f64 / push_s),
        push_latency: push_lat.summary(),
        push_errors,
        pending_before_attach,
        queued_turns,
        received,
        attached_ms: procs::round1(attached_ms),
        drain_s: (drain_s * 1000.0).round() / 1000.0,
        drain_turns_per_s: procs::round1(received as f64 / drain_s.max(1e-9)),
        in_order,
        all_contents_once: duplicates_or_unknown == 0 && seen.iter().all(|s| *s),
        pending_after_drain,
        drain_cpu,
        gateway_mem_end: procs::mem(stack.gateway.pid)?,
        load_before,
    })
}
