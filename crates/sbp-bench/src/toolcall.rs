//! L5 TOOL_CALL round trip: a backend calls a tool on an attached surface
//! (`POST /v1/sbp/sessions/{id}/tool_calls`), the gateway sends TOOL_CALL over the surface's
//! WebSocket, the bench's surface answers TOOL_RESULT at once (`result` = `tool_input`), and the
//! HTTP answer comes back. Measured with one session (latency) and with several at once
//! (throughput), next to two floors taken in the same run: `GET /healthz` on the same kind of
//! keep-alive connection, and one WebSocket message round trip against an echo server in this
//! process. Gateway-added = end-to-end − surface hold − HTTP floor − WebSocket floor (see
//! BENCHMARKS.md). The gateway's own `sbp_tool_call_latency_seconds` histogram is read from
//! `/metrics` around each phase.
//!
//! Cross-replica mode (`--bus`): two gateways (replicas A and B) on one PostgreSQL schema and one
//! Redis bus; sessions are created on A or B by turns, surfaces attach to A, and the backend calls
//! B, which relays TOOL_CALL to A and gets TOOL_RESULT back over Redis pub/sub. The floors are
//! then `GET /healthz` on B, the WebSocket echo, and two pub/sub hops on the same Redis; a PING
//! and a call to a session without a surface (B's work before TOOL_CALL leaves it) are measured
//! alongside, for the breakdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, StatusCode, Uri};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use crate::bus::{self, BusFloor, CommandStats, RedisPerCall};
use crate::http::{HttpConn, uri};
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Mem, Stack, Sync};
use crate::stats::{Latencies, Summary};
use crate::tether::{self, Ws};

/// The tool the bench's surfaces declare.
const TOOL: &str = "echo";

#[derive(Debug, Clone)]
pub struct Params {
    /// Measured calls per lane, in each phase.
    pub iterations: usize,
    /// Unmeasured calls per lane before each phase.
    pub warmup: usize,
    /// Concurrent sessions (each with its own surface and HTTP connection) of the throughput phase.
    pub lanes: usize,
    pub sync: Sync,
    /// Cross-replica mode: the replicas' bus (`redis://...`).
    pub bus: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `single` (one gateway) or `cross-replica` (surfaces on replica A, calls through B).
    pub mode: &'static str,
    pub sync: Sync,
    pub iterations: usize,
    pub warmup: usize,
    /// One session, one call at a time; each call is preceded by one `GET /healthz` and one
    /// WebSocket echo round trip, so the floors are measured under the same conditions.
    pub latency: LatencyPhase,
    pub throughput: ThroughputPhase,
    /// The gateway (replica A in cross-replica mode).
    pub gateway_mem_end: Mem,
    /// Replica B.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_mem_end: Option<Mem>,
    /// The Redis server, when it runs on this machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_mem_end: Option<Mem>,
    pub load_before: [f64; 3],
}

#[derive(Debug, Clone, Serialize)]
pub struct LatencyPhase {
    /// Client send -> HTTP response parsed.
    pub end_to_end: Summary,
    /// On the surface: TOOL_CALL received -> TOOL_RESULT written.
    pub surface_hold: Summary,
    /// Per call: end-to-end minus that call's surface hold.
    pub net: Summary,
    /// `GET /healthz` on an identical keep-alive connection (to replica B in cross-replica mode).
    pub healthz: Summary,
    /// One text message (the size of a TOOL_CALL) there and back to an in-process
    /// tokio-tungstenite echo server over loopback.
    pub ws_echo: Summary,
    /// Cross-replica mode: one PING on a multiplexed connection to the bus's Redis.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_ping: Option<Summary>,
    /// Cross-replica mode: two pub/sub hops (publish, a subscriber publishes back, receive) with
    /// a payload the size of a relayed TOOL_CALL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus_relay: Option<Summary>,
    /// Cross-replica mode, for the breakdown (not a floor): a tool call through B to a session
    /// that no surface ever attached, answered 409 once B has read the session from PostgreSQL and
    /// asked Redis for its holder. Everything a relayed call does before TOOL_CALL leaves B.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unattached_call: Option<Summary>,
    /// Quantile by quantile: net − healthz − ws_echo (− bus_relay in cross-replica mode).
    pub gateway_added: Added,
    /// Conservative: net's quantiles minus the floors' medians (all tail charged to the gateway).
    pub gateway_added_vs_floor_medians: Added,
    /// The gateway's own TOOL_CALL sent -> TOOL_RESULT received histogram, over the measured calls.
    pub gateway_metric: MetricHist,
    pub calls: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Gateway CPU over the phase (healthz calls included), per tool call; both replicas in
    /// cross-replica mode.
    pub gateway_cpu_ms_per_call: f64,
    /// Cross-replica mode: the Redis server's CPU per tool call (the floors' commands included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_cpu_ms_per_call: Option<f64>,
    pub cpu: CpuUse,
}

#[derive(Debug, Clone, Serialize)]
pub struct ThroughputPhase {
    pub lanes: usize,
    pub calls: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub seconds: f64,
    pub calls_per_s: f64,
    pub end_to_end: Summary,
    pub surface_hold: Summary,
    pub gateway_metric: MetricHist,
    /// Both replicas in cross-replica mode.
    pub gateway_cpu_ms_per_call: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_cpu_ms_per_call: Option<f64>,
    /// Cross-replica mode: what Redis ran per call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisPerCall>,
    pub cpu: CpuUse,
}

/// Gateway-added time at a few quantiles, milliseconds (may be slightly negative when the floors'
/// noise exceeds the gateway's share).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Added {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Added {
    /// `net` minus each floor, quantile by quantile.
    fn of(net: &Summary, floors: &[[f64; 4]]) -> Self {
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        let at = |i: usize, v: f64| r(floors.iter().fold(v, |acc, f| acc - f[i]));
        Self {
            p50_ms: at(0, net.p50_ms),
            p90_ms: at(1, net.p90_ms),
            p99_ms: at(2, net.p99_ms),
            max_ms: at(3, net.max_ms),
        }
    }
}

fn quantiles(s: &Summary) -> [f64; 4] {
    [s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms]
}

fn medians(s: &Summary) -> [f64; 4] {
    [s.p50_ms; 4]
}

/// A Prometheus histogram's buckets as scraped: (upper bound in seconds, cumulative count).
#[derive(Debug, Clone, Default)]
struct Scrape {
    buckets: Vec<(f64, u64)>,
    count: u64,
    sum_s: f64,
}

/// The histogram over an interval, with the bucket that holds each quantile.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MetricHist {
    pub count: u64,
    pub mean_ms: f64,
    /// (lower, upper] bounds of the bucket holding the median, ms (`None` upper: +Inf).
    pub p50_bucket_ms: (f64, Option<f64>),
    pub p99_bucket_ms: (f64, Option<f64>),
    /// Cumulative counts per upper bound (ms), for the record.
    pub buckets: Vec<(f64, u64)>,
}

impl std::fmt::Display for MetricHist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = |(lo, hi): (f64, Option<f64>)| match hi {
            Some(hi) => format!("({lo}, {hi}] ms"),
            None => format!("> {lo} ms"),
        };
        write!(
            f,
            "n={} mean {:.3} ms; p50 in {}, p99 in {}",
            self.count,
            self.mean_ms,
            b(self.p50_bucket_ms),
            b(self.p99_bucket_ms)
        )
    }
}

impl Scrape {
    fn parse(text: &str) -> Self {
        const NAME: &str = "sbp_tool_call_latency_seconds";
        let mut s = Self::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(NAME) else {
                continue;
            };
            let mut parts = rest.rsplitn(2, ' ');
            let value = parts.next().unwrap_or("");
            let key = parts.next().unwrap_or("");
            if let Some(le) = key
                .strip_prefix("_bucket{le=\"")
                .and_then(|k| k.strip_suffix("\"}"))
            {
                if le != "+Inf"
                    && let (Ok(bound), Ok(n)) = (le.parse::<f64>(), value.parse::<u64>())
                {
                    s.buckets.push((bound, n));
                }
            } else if key == "_count" {
                s.count = value.parse().unwrap_or(0);
            } else if key == "_sum" {
                s.sum_s = value.parse().unwrap_or(0.0);
            }
        }
        s
    }

    /// What was observed between `earlier` and `self`.
    fn since(&self, earlier: &Self) -> MetricHist {
        let count = self.count.saturating_sub(earlier.count);
        let before = |bound: f64| {
            earlier
                .buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map_or(0, |(_, n)| *n)
        };
        let buckets: Vec<(f64, u64)> = self
            .buckets
            .iter()
            .map(|(b, n)| (*b, n.saturating_sub(before(*b))))
            .collect();
        let bucket_of = |q: f64| {
            let rank = (q * count as f64).ceil() as u64;
            let mut lower = 0.0;
            for (b, n) in &buckets {
                if *n >= rank.max(1) {
                    return (lower * 1000.0, Some(b * 1000.0));
                }
                lower = *b;
            }
            (lower * 1000.0, None)
        };
        let sum = (self.sum_s - earlier.sum_s).max(0.0);
        MetricHist {
            count,
            mean_ms: if count > 0 {
                (sum / count as f64 * 1e6).round() / 1000.0
            } else {
                0.0
            },
            p50_bucket_ms: bucket_of(0.50),
            p99_bucket_ms: bucket_of(0.99),
            buckets: buckets.into_iter().map(|(b, n)| (b * 1000.0, n)).collect(),
        }
    }
}

pub async fn run(env: &Env, label: &str, p: &Params) -> anyhow::Result<Report> {
    if p.iterations == 0 || p.lanes == 0 {
        bail!("--iterations and --toolcall-lanes must be positive");
    }
    let load_before = procs::loadavg();
    Stack::measure_on(env, label, p.sync, p.bus.as_deref(), async |stack| {
        measure(stack, p, load_before).await
    })
    .await
}

/// Where each side of a call goes, and whose CPU counts.
struct Topology {
    /// Backend calls, `/healthz` and `/metrics`: the gateway, or replica B.
    http: SocketAddr,
    /// Surfaces attach here: the gateway, or replica A.
    surface: SocketAddr,
    /// Lane `i` creates its session on `create[i % 2]`: A and B by turns (one gateway: itself).
    create: [SocketAddr; 2],
    /// Processes in the CPU figures.
    procs: Vec<(&'static str, u32)>,
    /// Which of them are gateways.
    gateways: &'static [&'static str],
    bus: Option<BusSide>,
}

/// The Redis of a cross-replica run.
struct BusSide {
    url: String,
    prefix: String,
    /// For `INFO`.
    conn: redis::aio::MultiplexedConnection,
    pid: Option<u32>,
}

impl Topology {
    async fn of(stack: &Stack) -> anyhow::Result<Self> {
        let a = &stack.gateway;
        let Some(replica) = &stack.replica else {
            return Ok(Self {
                http: a.addr,
                surface: a.addr,
                create: [a.addr, a.addr],
                procs: vec![("gateway", a.pid)],
                gateways: &["gateway"],
                bus: None,
            });
        };
        let b = &replica.gateway;
        let mut conn = bus::connect(&replica.bus.url).await?;
        let pid = bus::server_pid(&mut conn).await;
        let mut procs = vec![("gateway-a", a.pid), ("gateway-b", b.pid)];
        if let Some(pid) = pid {
            procs.push(("redis", pid));
        }
        Ok(Self {
            http: b.addr,
            surface: a.addr,
            create: [a.addr, b.addr],
            procs,
            gateways: &["gateway-a", "gateway-b"],
            bus: Some(BusSide {
                url: replica.bus.url.clone(),
                prefix: replica.bus.prefix.clone(),
                conn,
                pid,
            }),
        })
    }

    /// CPU milliseconds per call of the gateways, together.
    fn gateway_ms_per_call(&self, cpu: &CpuUse, calls: u64) -> f64 {
        let secs: f64 = self.gateways.iter().map(|g| cpu.cpu_seconds(g)).sum();
        (secs / calls.max(1) as f64 * 1e6).round() / 1000.0
    }

    fn redis_ms_per_call(&self, cpu: &CpuUse, calls: u64) -> Option<f64> {
        self.bus.as_ref()?.pid?;
        Some((cpu.cpu_seconds("redis") / calls.max(1) as f64 * 1e6).round() / 1000.0)
    }
}

async fn scrape(conn: &mut HttpConn) -> anyhow::Result<Scrape> {
    let resp = conn.get(&uri("/metrics")?, None).await?;
    if resp.status != StatusCode::OK {
        bail!("GET /metrics: {}", resp.describe());
    }
    Ok(Scrape::parse(&String::from_utf8_lossy(&resp.body)))
}

/// A surface that answers every TOOL_CALL at once with its own input, and reports how long it
/// held each call (frame received -> answer written).
struct Surface {
    holds: mpsc::UnboundedReceiver<(String, Duration)>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Surface {
    async fn attach(addr: SocketAddr, id: &str, token: &str) -> anyhow::Result<Self> {
        let (mut ws, _) = tokio_tungstenite::connect_async(tether::ws_url(addr, id))
            .await
            .context("surface WebSocket handshake")?;
        let frame = json!({
            "type": "ATTACH_SESSION",
            "session_id": id,
            "session_token": token,
            "surface_context": {"device_type": "mobile", "surface_id": "sbp-bench", "mcp_tools": [TOOL]},
        });
        ws.send(Message::text(frame.to_string())).await?;
        tether::wait_attached(&mut ws).await?;
        let (tx, holds) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve_surface(ws, tx));
        Ok(Self { holds, task })
    }

    /// The hold time the surface recorded for `call_id` (calls of a lane are sequential, so the
    /// next one reported is this call's).
    async fn hold(&mut self, call_id: &str) -> anyhow::Result<Duration> {
        let (id, hold) = tokio::time::timeout(Duration::from_secs(5), self.holds.recv())
            .await
            .context("the surface reported no hold time within 5 s")?
            .context("the surface stopped")?;
        if id != call_id {
            bail!("the surface answered call {id}, the response is for {call_id}");
        }
        Ok(hold)
    }

    fn stop(self) {
        self.task.abort();
    }
}

async fn serve_surface(
    mut ws: Ws,
    holds: mpsc::UnboundedSender<(String, Duration)>,
) -> anyhow::Result<()> {
    while let Some(msg) = ws.next().await {
        let Message::Text(text) = msg? else { continue };
        let received = Instant::now();
        let frame: Value = serde_json::from_str(text.as_str())
            .with_context(|| format!("bad frame {}", text.as_str()))?;
        match frame.get("type").and_then(Value::as_str) {
            Some("TOOL_CALL") => {
                let call_id = frame
                    .get("call_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let reply = json!({
                    "type": "TOOL_RESULT",
                    "call_id": call_id,
                    "result": frame.get("tool_input").cloned().unwrap_or(Value::Null),
                });
                ws.send(Message::text(reply.to_string())).await?;
                // Nobody listening only means the run is over.
                let _ = holds.send((call_id, received.elapsed()));
            }
            Some("PING") => ws.send(Message::text(r#"{"type":"PONG"}"#)).await?,
            _ => {}
        }
    }
    Ok(())
}

/// One backend caller: a session, its attached surface, and a keep-alive HTTP connection.
struct Lane {
    conn: HttpConn,
    path: Uri,
    token: HeaderValue,
    surface: Surface,
    lane: usize,
    sent: u64,
}

/// One finished call: end-to-end and the surface's hold.
struct Call {
    e2e: Duration,
    hold: Duration,
}

impl Lane {
    /// A session created on `top.create[lane % 2]`, its surface on `top.surface`, and calls to
    /// `top.http`.
    async fn open(top: &Topology, lane: usize) -> anyhow::Result<Self> {
        let create = top.create[lane % 2];
        let mut conn = HttpConn::connect(create).await?;
        let (id, token) = tether::create_session(&mut conn).await?;
        if create != top.http {
            conn = HttpConn::connect(top.http).await?;
        }
        let surface = Surface::attach(top.surface, &id, &token).await?;
        Ok(Self {
            conn,
            path: uri(&format!("/v1/sbp/sessions/{id}/tool_calls"))?,
            token: HeaderValue::from_str(&token)?,
            surface,
            lane,
            sent: 0,
        })
    }

    /// One tool call; `Err` is a failed call (transport, non-200, status other than "ok", or a
    /// result that is not the input).
    async fn call(&mut self) -> Result<Call, String> {
        self.sent += 1;
        let input = json!({"lane": self.lane, "n": self.sent, "text": "hello from sbp-bench"});
        let body = json!({"tool_name": TOOL, "tool_input": input, "timeout_ms": 5000});
        let body = Bytes::from(body.to_string());
        let t0 = Instant::now();
        let resp = match self.conn.post(&self.path, Some(&self.token), body).await {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("transport: {e:#}");
                if let Err(e) = self.conn.reconnect().await {
                    return Err(format!("{msg}; reconnecting: {e:#}"));
                }
                return Err(msg);
            }
        };
        if resp.status != StatusCode::OK {
            return Err(resp.describe());
        }
        let v = resp.json().map_err(|e| format!("{e:#}"))?;
        let e2e = t0.elapsed();
        if v.get("status").and_then(Value::as_str) != Some("ok") {
            return Err(format!("status not ok: {v}"));
        }
        if v.get("result") != Some(&input) {
            return Err(format!("result is not the input: {v}"));
        }
        let call_id = v.get("call_id").and_then(Value::as_str).unwrap_or_default();
        let hold = self
            .surface
            .hold(call_id)
            .await
            .map_err(|e| format!("{e:#}"))?;
        Ok(Call { e2e, hold })
    }
}

/// A backend calling a tool of a session that has no surface: the answer (409) comes once the
/// gateway has authorised the call and looked for the surface.
struct Unattached {
    conn: HttpConn,
    path: Uri,
    token: HeaderValue,
    body: Bytes,
}

impl Unattached {
    async fn open(addr: SocketAddr) -> anyhow::Result<Self> {
        let mut conn = HttpConn::connect(addr).await?;
        let (id, token) = tether::create_session(&mut conn).await?;
        let input = json!({"lane": 0, "n": 0, "text": "hello from sbp-bench"});
        let body = json!({"tool_name": TOOL, "tool_input": input, "timeout_ms": 5000});
        Ok(Self {
            conn,
            path: uri(&format!("/v1/sbp/sessions/{id}/tool_calls"))?,
            token: HeaderValue::from_str(&token)?,
            body: Bytes::from(body.to_string()),
        })
    }

    async fn call(&mut self) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let resp = self
            .conn
            .post(&self.path, Some(&self.token), self.body.clone())
            .await?;
        let elapsed = t0.elapsed();
        if resp.status != StatusCode::CONFLICT {
            bail!(
                "a tool call to a session without a surface answered {}, not 409",
                resp.describe()
            );
        }
        Ok(elapsed)
    }
}

/// A client of the in-process WebSocket echo server.
struct EchoFloor {
    ws: Ws,
    server: tokio::task::JoinHandle<()>,
    /// A text the size and shape of a TOOL_CALL frame.
    frame: String,
}

impl EchoFloor {
    async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                return;
            };
            while let Some(Ok(msg)) = ws.next().await {
                if msg.is_text() && ws.send(msg).await.is_err() {
                    return;
                }
            }
        });
        let (ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/echo")).await?;
        let frame = json!({
            "type": "TOOL_CALL",
            "call_id": uuid::Uuid::new_v4(),
            "tool_name": TOOL,
            "tool_input": {"lane": 0, "n": 1, "text": "hello from sbp-bench"},
            "timeout_ms": 5000,
        })
        .to_string();
        Ok(Self { ws, server, frame })
    }

    async fn round_trip(&mut self) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        self.ws.send(Message::text(self.frame.clone())).await?;
        loop {
            match self.ws.next().await {
                Some(Ok(Message::Text(_))) => return Ok(t0.elapsed()),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => bail!("the echo server closed"),
            }
        }
    }

    fn stop(self) {
        self.server.abort();
    }
}

fn sub(a: Duration, b: Duration) -> Duration {
    a.saturating_sub(b)
}

async fn measure(stack: &Stack, p: &Params, load_before: [f64; 3]) -> anyhow::Result<Report> {
    let mut top = Topology::of(stack).await?;
    let mut admin = HttpConn::connect(top.http).await?;

    // Latency: one lane, every call interleaved with one of each floor.
    let mut lane = Lane::open(&top, 0).await?;
    let mut health = HttpConn::connect(top.http).await?;
    let healthz = uri("/healthz")?;
    let mut echo = EchoFloor::start().await?;
    let (mut bus_floor, mut probe) = match &top.bus {
        Some(b) => (
            Some(BusFloor::start(&b.url, &b.prefix).await?),
            Some(Unattached::open(top.http).await?),
        ),
        None => (None, None),
    };
    for _ in 0..p.warmup {
        lane.call().await.map_err(anyhow::Error::msg)?;
        health.get(&healthz, None).await?;
        echo.round_trip().await?;
        if let (Some(f), Some(u)) = (&mut bus_floor, &mut probe) {
            f.ping().await?;
            f.relay_round_trip().await?;
            u.call().await?;
        }
    }
    let before = scrape(&mut admin).await?;
    let cpu0 = CpuSnapshot::take(&top.procs);
    let (mut e2e, mut hold, mut net) = (Latencies::new(), Latencies::new(), Latencies::new());
    let (mut hz, mut ws) = (Latencies::new(), Latencies::new());
    let (mut ping, mut relay, mut unattached) =
        (Latencies::new(), Latencies::new(), Latencies::new());
    let (mut errors, mut first_error) = (0u64, None);
    for _ in 0..p.iterations {
        let t0 = Instant::now();
        let r = health.get(&healthz, None).await?;
        if r.status != StatusCode::OK {
            bail!("GET /healthz: {}", r.describe());
        }
        hz.record(t0.elapsed());
        ws.record(echo.round_trip().await?);
        if let (Some(f), Some(u)) = (&mut bus_floor, &mut probe) {
            ping.record(f.ping().await?);
            relay.record(f.relay_round_trip().await?);
            unattached.record(u.call().await?);
        }
        match lane.call().await {
            Ok(c) => {
                e2e.record(c.e2e);
                hold.record(c.hold);
                net.record(sub(c.e2e, c.hold));
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    let cpu = cpu0.since();
    let after = scrape(&mut admin).await?;
    echo.stop();
    if let Some(f) = bus_floor {
        f.stop();
    }
    lane.surface.stop();
    let calls = e2e.summary().count;
    let (net, hz, ws) = (net.summary(), hz.summary(), ws.summary());
    let (ping, relay, unattached) = match &top.bus {
        Some(_) => (
            Some(ping.summary()),
            Some(relay.summary()),
            Some(unattached.summary()),
        ),
        None => (None, None, None),
    };
    let mut floors = vec![quantiles(&hz), quantiles(&ws)];
    let mut floor_medians = vec![medians(&hz), medians(&ws)];
    if let Some(r) = &relay {
        floors.push(quantiles(r));
        floor_medians.push(medians(r));
    }
    let latency = LatencyPhase {
        end_to_end: e2e.summary(),
        surface_hold: hold.summary(),
        gateway_added: Added::of(&net, &floors),
        gateway_added_vs_floor_medians: Added::of(&net, &floor_medians),
        net,
        healthz: hz,
        ws_echo: ws,
        redis_ping: ping,
        bus_relay: relay,
        unattached_call: unattached,
        gateway_metric: after.since(&before),
        calls,
        errors,
        first_error,
        gateway_cpu_ms_per_call: top.gateway_ms_per_call(&cpu, calls),
        redis_cpu_ms_per_call: top.redis_ms_per_call(&cpu, calls),
        cpu,
    };

    let throughput = throughput(&mut top, p, &mut admin).await?;
    let redis_mem_end = top
        .bus
        .as_ref()
        .and_then(|b| b.pid)
        .and_then(|pid| procs::mem(pid).ok());
    Ok(Report {
        mode: if top.bus.is_some() {
            "cross-replica"
        } else {
            "single"
        },
        sync: p.sync,
        iterations: p.iterations,
        warmup: p.warmup,
        latency,
        throughput,
        gateway_mem_end: procs::mem(stack.gateway.pid)?,
        replica_mem_end: match &stack.replica {
            Some(r) => Some(procs::mem(r.gateway.pid)?),
            None => None,
        },
        redis_mem_end,
        load_before,
    })
}

/// What one throughput lane measured.
struct LaneResult {
    e2e: Latencies,
    hold: Latencies,
    errors: u64,
    first_error: Option<String>,
}

async fn throughput(
    top: &mut Topology,
    p: &Params,
    admin: &mut HttpConn,
) -> anyhow::Result<ThroughputPhase> {
    let mut lanes = Vec::with_capacity(p.lanes);
    for i in 0..p.lanes {
        lanes.push(Lane::open(top, i + 1).await?);
    }
    // Warm-up on every lane; once all are warm the gateway's histogram is scraped, then all lanes
    // start the measured calls together (two barriers, so no measured call precedes the scrape).
    let warm = Arc::new(tokio::sync::Barrier::new(p.lanes + 1));
    let go = Arc::new(tokio::sync::Barrier::new(p.lanes + 1));
    let mut tasks = Vec::with_capacity(p.lanes);
    for mut lane in lanes {
        let (warm, go) = (warm.clone(), go.clone());
        let (warmup, iterations) = (p.warmup, p.iterations);
        tasks.push(tokio::spawn(async move {
            let mut warm_error = None;
            for _ in 0..warmup {
                if let Err(e) = lane.call().await {
                    warm_error.get_or_insert(e);
                }
            }
            warm.wait().await;
            go.wait().await;
            let mut r = LaneResult {
                e2e: Latencies::new(),
                hold: Latencies::new(),
                errors: 0,
                first_error: warm_error.map(|e| format!("warm-up: {e}")),
            };
            for _ in 0..iterations {
                match lane.call().await {
                    Ok(c) => {
                        r.e2e.record(c.e2e);
                        r.hold.record(c.hold);
                    }
                    Err(e) => {
                        r.errors += 1;
                        r.first_error.get_or_insert(e);
                    }
                }
            }
            lane.surface.stop();
            r
        }));
    }
    warm.wait().await;
    let before = scrape(admin).await?;
    let redis_before = match &mut top.bus {
        Some(b) => Some(CommandStats::take(&mut b.conn).await?),
        None => None,
    };
    let cpu0 = CpuSnapshot::take(&top.procs);
    let t0 = Instant::now();
    go.wait().await;
    let (mut e2e, mut hold) = (Latencies::new(), Latencies::new());
    let (mut errors, mut first_error) = (0u64, None);
    for t in tasks {
        let r = t.await.context("a throughput lane panicked")?;
        e2e.merge(&r.e2e);
        hold.merge(&r.hold);
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu = cpu0.since();
    let after = scrape(admin).await?;
    let calls = e2e.summary().count;
    let redis = match (&mut top.bus, redis_before) {
        (Some(b), Some(before)) => Some(
            CommandStats::take(&mut b.conn)
                .await?
                .per_call_since(&before, calls),
        ),
        _ => None,
    };
    Ok(ThroughputPhase {
        lanes: p.lanes,
        calls,
        errors,
        first_error,
        seconds: (seconds * 1000.0).round() / 1000.0,
        calls_per_s: procs::round1(calls as f64 / seconds.max(1e-9)),
        end_to_end: e2e.summary(),
        surface_hold: hold.summary(),
        gateway_metric: after.since(&before),
        gateway_cpu_ms_per_call: top.gateway_ms_per_call(&cpu, calls),
        redis_cpu_ms_per_call: top.redis_ms_per_call(&cpu, calls),
        redis,
        cpu,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP sbp_tool_call_latency_seconds x
# TYPE sbp_tool_call_latency_seconds histogram
sbp_tool_call_latency_seconds_bucket{le=\"0.0005\"} 10
sbp_tool_call_latency_seconds_bucket{le=\"0.001\"} 95
sbp_tool_call_latency_seconds_bucket{le=\"0.0025\"} 100
sbp_tool_call_latency_seconds_bucket{le=\"+Inf\"} 100
sbp_tool_call_latency_seconds_sum 0.07
sbp_tool_call_latency_seconds_count 100
sbp_upstream_latency_seconds_count 7
";

    #[test]
    fn histogram_deltas_give_quantile_buckets() {
        let now = Scrape::parse(TEXT);
        assert_eq!(now.count, 100);
        assert_eq!(now.buckets.len(), 3);
        let h = now.since(&Scrape::default());
        assert_eq!(h.count, 100);
        assert_eq!(h.p50_bucket_ms, (0.5, Some(1.0)));
        assert_eq!(h.p99_bucket_ms, (1.0, Some(2.5)));
        assert!((h.mean_ms - 0.7).abs() < 1e-9, "{h:?}");
        // The 10 calls of the first scrape are not counted again.
        let earlier = Scrape {
            buckets: vec![(0.0005, 10), (0.001, 10), (0.0025, 10)],
            count: 10,
            sum_s: 0.002,
        };
        let d = now.since(&earlier);
        assert_eq!(d.count, 90);
        assert_eq!(d.p50_bucket_ms, (0.5, Some(1.0)));
    }
}
