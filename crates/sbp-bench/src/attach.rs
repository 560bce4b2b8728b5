//! Attach + detach through the client SDK (issue 6): --attach-sessions sessions made with
//! `Client::create_session`, then --attach-lanes lanes at once, each cycling over its own share of
//! them: `Surface::connect` (WebSocket upgrade, ATTACH_SESSION, wait for SESSION_ATTACHED) then
//! `Surface::close` (DETACH, wait for the gateway's close, the SDK's task ends). The `tethered`
//! variant first pushes one turn to the detached session (`SessionClient::push_turn`), and each
//! attach must drain exactly that turn (TETHER_TURN, ACKed on close).
//!
//! Every attach is durable work for the gateway: `mark_attached` (tether on, status -> running) is
//! a store write before SESSION_ATTACHED, and the detach that follows the close is a read and a
//! status write (running -> suspended). Afterwards the gateway must show no surface attached, every
//! session that was attached `suspended` (the others `idle`), and nothing left in the tether.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use http::StatusCode;
use sbp_client::protocol::frames::CLOSE_NORMAL;
use sbp_client::protocol::{ServerFrame, SessionStatus};
use sbp_client::types::{NewSession, PushTurn};
use sbp_client::{
    Client, DisconnectKind, Event, ReconnectPolicy, SessionClient, Surface, SurfaceConfig,
};
use serde::Serialize;

use crate::http::{HttpConn, uri};
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Mem, RssSampler, Stack, Sync};
use crate::stats::{Latencies, Summary};

/// What each attach has waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// Nothing: attach, close.
    Plain,
    /// One turn pushed to the detached session before each attach, drained and ACKed by it.
    Tethered,
}

impl Variant {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Tethered => "tethered",
        }
    }
}

/// When the measured phase ends.
#[derive(Debug, Clone, Copy)]
pub enum Stop {
    /// No lane starts a cycle after this long.
    After(Duration),
    /// Each lane makes this many cycles.
    Cycles(usize),
}

#[derive(Debug, Clone)]
pub struct Params {
    pub sessions: usize,
    pub lanes: usize,
    /// Unmeasured cycling on every lane before the measured phase.
    pub warmup: Duration,
    pub stop: Stop,
    pub variant: Variant,
    pub sync: Sync,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub variant: Variant,
    pub sync: Sync,
    pub sessions: usize,
    pub lanes: usize,
    pub warmup_cycles: u64,
    /// Measured cycles that completed without error.
    pub cycles: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// From the start of the measured phase until the last lane finished.
    pub seconds: f64,
    pub cycles_per_s: f64,
    /// `Surface::connect`: TCP connect, WebSocket upgrade, ATTACH_SESSION -> SESSION_ATTACHED.
    pub attach: Summary,
    /// `Surface::close`: (ACK,) DETACH -> the gateway's close frame -> the SDK's task ended.
    pub close: Summary,
    /// `Surface::connect` called -> `Surface::close` returned (tethered: the drain included, the
    /// push not).
    pub cycle: Summary,
    /// Tethered: SESSION_ATTACHED -> the TETHER_TURN taken from the surface's events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain: Option<Summary>,
    /// Tethered: `POST .../turns` through the SDK, before each attach (outside `cycle`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push: Option<Summary>,
    pub gateway_cpu_ms_per_cycle: f64,
    /// The bench: the SDK's side of every cycle (and its HTTP pushes).
    pub bench_cpu_ms_per_cycle: f64,
    pub cpu: CpuUse,
    /// Largest VmRSS seen by a 50 ms sampler during the measured phase.
    pub gateway_rss_peak_sampled_kib: u64,
    pub gateway_mem_end: Mem,
    pub data_files: BTreeMap<String, u64>,
    pub check: Check,
    pub load_before: [f64; 3],
}

/// The gateway's state once every lane has closed its last surface.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Check {
    /// WebSocket connections the gateway counted (`sbp_ws_connections_total`) over the whole run,
    /// next to the connects the lanes attempted (warm-up included).
    pub ws_connections: u64,
    pub connects_attempted: u64,
    /// `/metrics` once settled.
    pub attached_surfaces: u64,
    pub sessions_by_status: BTreeMap<String, u64>,
    pub tether_depth: u64,
    /// Sessions the lanes attached at least once (`suspended` expected), and never (`idle`).
    pub sessions_attached: usize,
    pub sessions_never_attached: usize,
    /// From each session's view (`GET /v1/sessions/{id}` through the SDK): sessions whose status
    /// is not the expected one, that show a surface attached, and their pending tether turns.
    pub wrong_status: usize,
    pub surface_attached: usize,
    pub tether_pending: u64,
    /// First few mismatches, for the report.
    pub examples: Vec<String>,
    /// After the last close, how long until `/metrics` showed no surface attached and the
    /// expected number of suspended sessions.
    pub settle_ms: f64,
    pub ok: bool,
}

pub async fn run(env: &Env, label: &str, p: &Params) -> anyhow::Result<Report> {
    if p.lanes == 0 || p.sessions < p.lanes {
        bail!(
            "--attach-lanes must be positive and --attach-sessions at least --attach-lanes: lanes \
             sharing a session would displace each other"
        );
    }
    if matches!(p.stop, Stop::Cycles(0)) {
        bail!("--iterations must be positive");
    }
    let load_before = procs::loadavg();
    Stack::measure_with(env, label, p.sync, async |stack| {
        measure(stack, p, load_before).await
    })
    .await
}

/// One lane: its sessions (lane `i` has sessions `i`, `i + lanes`, ...), used in turn.
struct Lane {
    lane: usize,
    sessions: Vec<SessionClient>,
    /// SESSION_ATTACHED received, per session.
    attached: Vec<u64>,
    next: usize,
    variant: Variant,
    connects: u64,
    pushed: u64,
}

/// One cycle's timings.
struct Times {
    attach: Duration,
    close: Duration,
    cycle: Duration,
    drain: Option<Duration>,
    push: Option<Duration>,
}

/// What a lane measured.
#[derive(Default)]
struct LaneResult {
    attach: Latencies,
    close: Latencies,
    cycle: Latencies,
    drain: Latencies,
    push: Latencies,
    cycles: u64,
    warmup_cycles: u64,
    errors: u64,
    first_error: Option<String>,
}

impl LaneResult {
    fn record(&mut self, r: Result<Times, String>) {
        match r {
            Ok(t) => {
                self.cycles += 1;
                self.attach.record(t.attach);
                self.close.record(t.close);
                self.cycle.record(t.cycle);
                if let Some(d) = t.drain {
                    self.drain.record(d);
                }
                if let Some(d) = t.push {
                    self.push.record(d);
                }
            }
            Err(e) => {
                self.errors += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }
}

fn surface_config(session: &SessionClient) -> SurfaceConfig {
    session
        .surface()
        .device_type("desktop")
        // A drop is an error here, not something to hide behind a reconnect.
        .reconnect(ReconnectPolicy::disabled())
}

impl Lane {
    /// attach -> (tethered: drain) -> close, on the lane's next session.
    async fn cycle(&mut self) -> Result<Times, String> {
        let i = self.next;
        self.next = (self.next + 1) % self.sessions.len();
        let session = &self.sessions[i];
        let expected = match self.variant {
            Variant::Plain => None,
            Variant::Tethered => {
                self.pushed += 1;
                let content = format!("lane {} turn {}", self.lane, self.pushed);
                let t = Instant::now();
                session
                    .push_turn(PushTurn::assistant(content.clone()))
                    .await
                    .map_err(|e| format!("push: {e}"))?;
                Some((content, t.elapsed()))
            }
        };
        let config = surface_config(session);
        self.connects += 1;
        let t0 = Instant::now();
        let mut surface = Surface::connect(config)
            .await
            .map_err(|e| format!("attach: {e}"))?;
        let attach = t0.elapsed();
        self.attached[i] += 1;
        let queued = surface.attached().queued_turns;
        let want_queued = u64::from(expected.is_some());
        // From here on an early return drops the surface, which detaches in the background.
        if queued != want_queued {
            return Err(format!(
                "SESSION_ATTACHED announced {queued} queued turns, expected {want_queued}"
            ));
        }
        match surface.next_event().await {
            Some(Event::Connected { .. }) => {}
            other => return Err(format!("first event is not Connected: {other:?}")),
        }
        let drain = match &expected {
            None => None,
            Some((content, _)) => {
                let next = tokio::time::timeout(Duration::from_secs(5), surface.next_event()).await;
                match next {
                    Ok(Some(Event::Frame(ServerFrame::TetherTurn(t))))
                        if t.content.as_deref() == Some(content.as_str()) => {}
                    Ok(other) => {
                        return Err(format!("expected TETHER_TURN {content:?}: {other:?}"));
                    }
                    Err(_) => return Err("no TETHER_TURN within 5 s".into()),
                }
                Some(t0.elapsed().saturating_sub(attach))
            }
        };
        let t1 = Instant::now();
        surface.close().await;
        let close = t1.elapsed();
        let cycle = t0.elapsed();
        // The task has ended: the queue holds what came after, ending with the Disconnected.
        let mut end = None;
        while let Some(event) = surface.next_event().await {
            match event {
                Event::Disconnected(d) => end = Some(d),
                Event::Frame(ServerFrame::Ping) => {}
                other => return Err(format!("unexpected event before the close: {other:?}")),
            }
        }
        match end {
            Some(d) if d.kind == DisconnectKind::Detached && d.code == Some(CLOSE_NORMAL) => {}
            Some(d) => {
                return Err(format!(
                    "close: {:?}, code {:?} ({}) instead of the gateway's 1000",
                    d.kind, d.code, d.reason
                ));
            }
            None => return Err("the surface ended without a Disconnected event".into()),
        }
        Ok(Times {
            attach,
            close,
            cycle,
            drain,
            push: expected.map(|(_, d)| d),
        })
    }
}

/// A gauge or counter from the Prometheus text: the first line whose name (with labels) is `key`.
fn metric(text: &str, key: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == key).then(|| v.parse().ok()).flatten()
    })
}

async fn scrape(conn: &mut HttpConn) -> anyhow::Result<String> {
    let resp = conn.get(&uri("/metrics")?, None).await?;
    if resp.status != StatusCode::OK {
        bail!("GET /metrics: {}", resp.describe());
    }
    Ok(String::from_utf8_lossy(&resp.body).into_owned())
}

async fn create_sessions(client: &Client, n: usize) -> anyhow::Result<Vec<SessionClient>> {
    futures::stream::iter(0..n)
        .map(|_| client.create_session(NewSession::default()))
        .buffered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .map(|r| r.context("POST /v1/sessions through the SDK"))
        .collect()
}

async fn measure(stack: &Stack, p: &Params, load_before: [f64; 3]) -> anyhow::Result<Report> {
    let addr: SocketAddr = stack.gateway.addr;
    let client = Client::builder(format!("http://{addr}"))
        .no_proxy()
        .build()
        .context("SDK client")?;
    let mut admin = HttpConn::connect(addr).await?;
    let ws_before = metric(&scrape(&mut admin).await?, "sbp_ws_connections_total").unwrap_or(0.0);

    let sessions = create_sessions(&client, p.sessions).await?;
    let mut lanes: Vec<Lane> = (0..p.lanes)
        .map(|lane| Lane {
            lane,
            sessions: Vec::new(),
            attached: Vec::new(),
            next: 0,
            variant: p.variant,
            connects: 0,
            pushed: 0,
        })
        .collect();
    for (i, s) in sessions.iter().enumerate() {
        let lane = &mut lanes[i % p.lanes];
        lane.sessions.push(s.clone());
        lane.attached.push(0);
    }

    // Warm-up on every lane; then the CPU snapshot; then all lanes start the measured cycles
    // together (two barriers, so no measured cycle precedes the snapshot).
    let warm = Arc::new(tokio::sync::Barrier::new(p.lanes + 1));
    let go = Arc::new(tokio::sync::Barrier::new(p.lanes + 1));
    let mut tasks = Vec::with_capacity(p.lanes);
    for mut lane in lanes {
        let (warm, go) = (warm.clone(), go.clone());
        let (warmup, stop) = (p.warmup, p.stop);
        tasks.push(tokio::spawn(async move {
            let mut r = LaneResult::default();
            let warm_until = Instant::now() + warmup;
            while Instant::now() < warm_until {
                match lane.cycle().await {
                    Ok(_) => r.warmup_cycles += 1,
                    Err(e) => {
                        r.errors += 1;
                        r.first_error.get_or_insert(format!("warm-up: {e}"));
                    }
                }
            }
            warm.wait().await;
            go.wait().await;
            match stop {
                Stop::After(d) => {
                    let until = Instant::now() + d;
                    while Instant::now() < until {
                        let c = lane.cycle().await;
                        r.record(c);
                    }
                }
                Stop::Cycles(n) => {
                    for _ in 0..n {
                        let c = lane.cycle().await;
                        r.record(c);
                    }
                }
            }
            (lane, r)
        }));
    }
    warm.wait().await;
    let rss = RssSampler::start(stack.gateway.pid);
    let cpu0 = CpuSnapshot::take(&[("gateway", stack.gateway.pid)]);
    let t0 = Instant::now();
    go.wait().await;
    let mut total = LaneResult::default();
    let mut attached_counts = Vec::new();
    let mut connects = 0;
    for t in tasks {
        let (lane, r) = t.await.context("an attach lane panicked")?;
        connects += lane.connects;
        attached_counts.extend(lane.sessions.into_iter().zip(lane.attached));
        total.attach.merge(&r.attach);
        total.close.merge(&r.close);
        total.cycle.merge(&r.cycle);
        total.drain.merge(&r.drain);
        total.push.merge(&r.push);
        total.cycles += r.cycles;
        total.warmup_cycles += r.warmup_cycles;
        total.errors += r.errors;
        if total.first_error.is_none() {
            total.first_error = r.first_error;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu = cpu0.since();
    let rss_peak = rss.finish();

    let check = check(&mut admin, &attached_counts, ws_before, connects).await?;
    let per_cycle = |process: &str| {
        (cpu.cpu_seconds(process) / total.cycles.max(1) as f64 * 1e6).round() / 1000.0
    };
    let tethered = p.variant == Variant::Tethered;
    Ok(Report {
        variant: p.variant,
        sync: p.sync,
        sessions: p.sessions,
        lanes: p.lanes,
        warmup_cycles: total.warmup_cycles,
        cycles: total.cycles,
        errors: total.errors,
        first_error: total.first_error,
        seconds: (seconds * 1000.0).round() / 1000.0,
        cycles_per_s: procs::round1(total.cycles as f64 / seconds.max(1e-9)),
        attach: total.attach.summary(),
        close: total.close.summary(),
        cycle: total.cycle.summary(),
        drain: tethered.then(|| total.drain.summary()),
        push: tethered.then(|| total.push.summary()),
        gateway_cpu_ms_per_cycle: per_cycle("gateway"),
        bench_cpu_ms_per_cycle: per_cycle("bench"),
        cpu,
        gateway_rss_peak_sampled_kib: rss_peak,
        gateway_mem_end: procs::mem(stack.gateway.pid)?,
        data_files: stack.data_files(),
        check,
        load_before,
    })
}

/// Waits (up to 10 s) for the last detaches to land, then checks `/metrics` and every session's
/// view. The gateway closes the socket before it writes the detach, so the last few may lag.
async fn check(
    admin: &mut HttpConn,
    sessions: &[(SessionClient, u64)],
    ws_before: f64,
    connects: u64,
) -> anyhow::Result<Check> {
    let attached = sessions.iter().filter(|(_, n)| *n > 0).count();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(10);
    let text = loop {
        let text = scrape(admin).await?;
        let surfaces = metric(&text, "sbp_attached_surfaces");
        let suspended = metric(&text, "sbp_sessions{status=\"suspended\"}");
        if (surfaces == Some(0.0) && suspended == Some(attached as f64))
            || Instant::now() > deadline
        {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let settle_ms = procs::round1(started.elapsed().as_secs_f64() * 1000.0);
    let gauge = |key: &str| metric(&text, key).map_or(0, |v| v as u64);
    let mut c = Check {
        ws_connections: (metric(&text, "sbp_ws_connections_total").unwrap_or(0.0) - ws_before)
            .max(0.0) as u64,
        connects_attempted: connects,
        attached_surfaces: gauge("sbp_attached_surfaces"),
        tether_depth: gauge("sbp_tether_depth"),
        sessions_attached: attached,
        sessions_never_attached: sessions.len() - attached,
        settle_ms,
        ..Check::default()
    };
    for status in SessionStatus::ALL {
        let key = format!("sbp_sessions{{status=\"{status}\"}}");
        let n = gauge(&key);
        if n > 0 {
            c.sessions_by_status.insert(status.to_string(), n);
        }
    }
    let views = futures::stream::iter(sessions)
        .map(|(s, n)| async move { (s.get().await, *n) })
        .buffered(32)
        .collect::<Vec<_>>()
        .await;
    for (view, n) in views {
        let v = view.context("GET /v1/sessions/{id} through the SDK")?;
        let want = if n > 0 {
            SessionStatus::Suspended
        } else {
            SessionStatus::Idle
        };
        let mut problem = Vec::new();
        if v.status != want {
            c.wrong_status += 1;
            problem.push(format!("status {} (expected {want})", v.status));
        }
        if v.surface_attached {
            c.surface_attached += 1;
            problem.push("a surface attached".to_owned());
        }
        c.tether_pending += v.tether_turns_pending;
        if v.tether_turns_pending > 0 {
            problem.push(format!("{} tether turns pending", v.tether_turns_pending));
        }
        if !problem.is_empty() && c.examples.len() < 5 {
            c.examples.push(format!(
                "{} (attached {n} times): {}",
                v.session_id,
                problem.join(", ")
            ));
        }
    }
    let suspended = c.sessions_by_status.get("suspended").copied().unwrap_or(0);
    c.ok = c.attached_surfaces == 0
        && suspended == attached as u64
        && c.wrong_status == 0
        && c.surface_attached == 0
        && c.tether_pending == 0
        && c.tether_depth == 0
        && c.ws_connections == connects;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_found_by_exact_key() {
        let text = "# HELP sbp_attached_surfaces x\nsbp_attached_surfaces 3\n\
                    sbp_sessions{status=\"idle\"} 2\nsbp_sessions{status=\"suspended\"} 40\n\
                    sbp_ws_connections_total 12345\n";
        assert_eq!(metric(text, "sbp_attached_surfaces"), Some(3.0));
        assert_eq!(
            metric(text, "sbp_sessions{status=\"suspended\"}"),
            Some(40.0)
        );
        assert_eq!(metric(text, "sbp_ws_connections_total"), Some(12345.0));
        assert_eq!(metric(text, "sbp_sessions"), None);
    }
}
