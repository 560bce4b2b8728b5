//! `sbp-soak exhaust`: the exhaustion scenarios, each against a fresh gateway started with a soft
//! descriptor limit of 1024 (as a service manager gives by default), while `/healthz` is probed
//! on fresh connections every 100 ms and the gateway's resident memory is sampled. Each scenario
//! passes when the gateway stayed responsive (no failed probe, p99 under the threshold), its
//! memory stayed under the bound, and the scenario's own checks held (the attacker's sockets were
//! closed in time, the stuck surface was dropped with its turns kept, ...).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::probe::{HealthProbe, RssSampler};
use crate::procs::{self, Env, GatewaySpec};
use crate::raw::{self, Handshake, WsOpts};
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Thousands of TCP connections that never send a byte.
    Idle,
    /// Request heads trickled a byte per second, never finished.
    Slowloris,
    /// Complete heads, then bodies trickled a byte per second.
    SlowBody,
    /// Surfaces that stop reading while turns are pushed to them.
    StuckSurfaces,
    /// One surface sending frames as fast as it can.
    FrameFlood,
    /// A Content-Length over the limit, then bodies of hundreds of thousands of tiny messages.
    BigBody,
}

#[derive(Debug, clap::Args)]
pub struct ExhaustArgs {
    /// Scenarios to run (repeatable); all when none is given.
    #[arg(long, value_enum)]
    pub only: Vec<Scenario>,
    /// Idle TCP sockets to open.
    #[arg(long, default_value_t = 2000)]
    pub idle_sockets: usize,
    /// Trickling sockets (slowloris and slow-body).
    #[arg(long, default_value_t = 200)]
    pub trickle_sockets: usize,
    /// Seconds the idle and slowloris scenarios watch (the head timeout should be ≤ 10 s).
    #[arg(long, default_value_t = 20)]
    pub window_secs: u64,
    /// Seconds the slow-body scenario watches (the whole-body deadline should be ≤ 60 s); below
    /// 65 its closing check is reported, not judged.
    #[arg(long, default_value_t = 70)]
    pub body_window_secs: u64,
    /// Surfaces that stop reading.
    #[arg(long, default_value_t = 10)]
    pub stuck_surfaces: usize,
    /// Size of each turn pushed to a stuck surface, bytes.
    #[arg(long, default_value_t = 16 * 1024)]
    pub turn_bytes: usize,
    /// Seconds turns are pushed to the stuck surfaces.
    #[arg(long, default_value_t = 30)]
    pub stuck_secs: u64,
    /// Frames the flooding surface sends.
    #[arg(long, default_value_t = 200_000)]
    pub flood_frames: u64,
    /// Big bodies sent at once.
    #[arg(long, default_value_t = 4)]
    pub big_bodies: usize,
    /// Tiny messages in each big body.
    #[arg(long, default_value_t = 240_000)]
    pub big_body_messages: usize,
    /// Largest acceptable /healthz p99 during a scenario, ms.
    #[arg(long, default_value_t = 1000.0)]
    pub max_p99_ms: f64,
    /// Largest acceptable gateway resident memory, MiB.
    #[arg(long, default_value_t = 512.0)]
    pub max_rss_mib: f64,
    /// The gateway's soft RLIMIT_NOFILE at start (it should raise it to the hard limit itself).
    #[arg(long, default_value_t = 1024)]
    pub gateway_nofile: u64,
}

/// One judged statement about a scenario.
struct Check {
    name: String,
    pass: bool,
    detail: String,
}

fn check(name: impl Into<String>, pass: bool, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        pass,
        detail: detail.into(),
    }
}

/// A figure reported beside the checks.
fn note(name: impl Into<String>, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        pass: true,
        detail: format!("(reported) {}", detail.into()),
    }
}

/// The gateway under attack.
struct Target {
    addr: SocketAddr,
    pid: u32,
    http: reqwest::Client,
}

pub async fn run(env: &Env, args: &ExhaustArgs, gateway_args: &[String]) -> anyhow::Result<bool> {
    // The attacker needs more descriptors than the gateway is given.
    let limit = rlimit::increase_nofile_limit(u64::MAX).context("raising RLIMIT_NOFILE")?;
    let need = (args.idle_sockets.max(args.trickle_sockets) + 256) as u64;
    if limit < need {
        bail!("the soak needs {need} file descriptors; the hard limit allows {limit}");
    }
    let all = [
        Scenario::Idle,
        Scenario::Slowloris,
        Scenario::SlowBody,
        Scenario::StuckSurfaces,
        Scenario::FrameFlood,
        Scenario::BigBody,
    ];
    let chosen: Vec<Scenario> = all
        .into_iter()
        .filter(|s| args.only.is_empty() || args.only.contains(s))
        .collect();
    let mut lines = Vec::new();
    let mut pass = true;
    for s in chosen {
        // The name `--only` takes (`stuck-surfaces`).
        let name = clap::ValueEnum::to_possible_value(&s)
            .map_or_else(|| format!("{s:?}"), |v| v.get_name().to_owned());
        println!("exhaust {name}:");
        match scenario(env, args, gateway_args, s, &name).await {
            Ok(checks) => {
                let ok = checks.iter().all(|c| c.pass);
                pass &= ok;
                for c in &checks {
                    println!(
                        "  [{}] {}: {}",
                        if c.pass { "ok" } else { "FAIL" },
                        c.name,
                        c.detail
                    );
                }
                let failed: Vec<&str> = checks
                    .iter()
                    .filter(|c| !c.pass)
                    .map(|c| c.name.as_str())
                    .collect();
                lines.push(if ok {
                    format!("exhaust {name}: PASS")
                } else {
                    format!("exhaust {name}: FAIL ({})", failed.join("; "))
                });
            }
            Err(e) => {
                pass = false;
                println!("  ERROR {e:#}");
                lines.push(format!("exhaust {name}: ERROR {e:#}"));
            }
        }
    }
    println!();
    for l in lines {
        println!("{l}");
    }
    Ok(pass)
}

async fn scenario(
    env: &Env,
    args: &ExhaustArgs,
    gateway_args: &[String],
    s: Scenario,
    name: &str,
) -> anyhow::Result<Vec<Check>> {
    let data_dir = env.out_dir.join(format!("exhaust-{name}-data"));
    let _ = std::fs::remove_dir_all(&data_dir);
    std::fs::create_dir_all(&data_dir)?;
    let log = format!("exhaust-{name}-gateway.log");
    let _ = std::fs::remove_file(env.log(&log));
    let fake = procs::start_fake(env, &format!("exhaust-{name}-fake.log")).await?;
    let spec = GatewaySpec {
        data_dir: data_dir.clone(),
        database: None,
        upstream: format!("http://{}/v1", fake.addr),
        soft_nofile: Some(args.gateway_nofile),
        extra_args: gateway_args.to_vec(),
    };
    let mut gateway = match procs::start_gateway(env, &spec, &log).await {
        Ok(g) => g,
        Err(e) => {
            fake.stop().await;
            return Err(e);
        }
    };
    println!(
        "  gateway pid {} on {} (soft fd limit {} at start); log {}",
        gateway.pid,
        gateway.addr,
        args.gateway_nofile,
        env.log(&log).display()
    );
    let target = Target {
        addr: gateway.addr,
        pid: gateway.pid,
        http: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(120))
            .build()?,
    };
    let probe = HealthProbe::start(target.addr, Duration::from_millis(100));
    let rss = RssSampler::start(target.pid);
    let checks = match s {
        Scenario::Idle => idle(args, &target).await,
        Scenario::Slowloris => trickle(args, &target, false).await,
        Scenario::SlowBody => trickle(args, &target, true).await,
        Scenario::StuckSurfaces => stuck_surfaces(args, &target).await,
        Scenario::FrameFlood => frame_flood(args, &target).await,
        Scenario::BigBody => big_body(args, &target).await,
    };
    let health = probe.finish();
    let (rss_peak, hwm) = rss.finish();
    let alive = gateway.check_alive();
    gateway.stop().await;
    fake.stop().await;
    let mut checks = checks?;
    let peak = rss_peak.max(hwm);
    let mut all = vec![
        check(
            "gateway alive",
            alive.is_ok(),
            alive
                .as_ref()
                .map_or_else(|e| format!("{e:#}"), |()| "yes".into()),
        ),
        check(
            "healthz answered every probe",
            health.failures == 0,
            format!(
                "{} of {} failed{}",
                health.failures,
                health.probes,
                if health.failure_examples.is_empty() {
                    String::new()
                } else {
                    format!(", e.g. {}", health.failure_examples.join(" | "))
                }
            ),
        ),
        check(
            format!("healthz p99 < {} ms", args.max_p99_ms),
            health.p99_ms < args.max_p99_ms && health.probes > 0,
            health.line(),
        ),
        check(
            format!("RSS < {} MiB", args.max_rss_mib),
            peak < args.max_rss_mib,
            format!("peak sampled {rss_peak:.0} MiB, VmHWM {hwm:.0} MiB"),
        ),
    ];
    all.append(&mut checks);
    if all.iter().all(|c| c.pass) {
        let _ = std::fs::remove_dir_all(&data_dir);
    }
    Ok(all)
}

/// Watches `stream` until the peer closes it; the time that took, from `opened`.
fn watch_close(mut stream: TcpStream, opened: Instant, closed: Arc<std::sync::Mutex<Vec<f64>>>) {
    tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        if let Ok(mut v) = closed.lock() {
            v.push(opened.elapsed().as_secs_f64());
        }
        // Dropped here: the descriptor is released at once.
    });
}

/// Opens `n` connections (a few hundred at a time); `(opened, failed to open)`.
async fn open_many(addr: SocketAddr, n: usize) -> (Vec<(TcpStream, Instant)>, usize) {
    let mut out = Vec::with_capacity(n);
    let mut failed = 0;
    let mut left = n;
    while left > 0 {
        let batch = left.min(250);
        left -= batch;
        let tries = (0..batch).map(|_| async move {
            tokio::time::timeout(Duration::from_secs(3), raw::connect(addr, None)).await
        });
        for r in futures::future::join_all(tries).await {
            match r {
                Ok(Ok(s)) => out.push((s, Instant::now())),
                _ => failed += 1,
            }
        }
    }
    (out, failed)
}

fn closed_stats(closed: &std::sync::Mutex<Vec<f64>>) -> (usize, f64) {
    let v = closed.lock().map(|v| v.clone()).unwrap_or_default();
    let last = v.iter().copied().fold(0.0, f64::max);
    (v.len(), last)
}

async fn idle(args: &ExhaustArgs, t: &Target) -> anyhow::Result<Vec<Check>> {
    let (socks, failed) = open_many(t.addr, args.idle_sockets).await;
    let opened = socks.len();
    let closed = Arc::new(std::sync::Mutex::new(Vec::new()));
    for (s, at) in socks {
        watch_close(s, at, closed.clone());
    }
    let fds = peak_fds(t.pid, Duration::from_secs(args.window_secs)).await;
    let (n, last) = closed_stats(&closed);
    let judged = args.window_secs >= 15;
    let within = closed
        .lock()
        .map(|v| v.iter().filter(|s| **s <= 15.0).count())
        .unwrap_or(0);
    let detail = format!(
        "{opened} opened ({failed} could not connect), {n} closed by the gateway within {} s \
         ({within} within 15 s, the last after {last:.1} s); gateway fds peak {fds}",
        args.window_secs
    );
    Ok(vec![if judged {
        check(
            "idle sockets closed by the gateway within 15 s",
            within == opened && opened > 0,
            detail,
        )
    } else {
        note("idle sockets closed by the gateway", detail)
    }])
}

/// Samples the gateway's open descriptors for `d`; the peak.
async fn peak_fds(pid: u32, d: Duration) -> usize {
    let end = Instant::now() + d;
    let mut peak = 0;
    while Instant::now() < end {
        peak = peak.max(procs::open_fds(pid).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    peak
}

/// Slowloris (heads never finished) or slow bodies (a complete head, then a byte per second).
async fn trickle(args: &ExhaustArgs, t: &Target, body: bool) -> anyhow::Result<Vec<Check>> {
    let (socks, failed) = open_many(t.addr, args.trickle_sockets).await;
    let opened = socks.len();
    let closed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let answers = Arc::new(std::sync::Mutex::new(Vec::<u16>::new()));
    let host = t.addr.to_string();
    for (mut s, at) in socks {
        let closed = closed.clone();
        let answers = answers.clone();
        let head = if body {
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
                 Content-Length: 100000\r\n\r\n{{"
            )
        } else {
            format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nX-Slow: ")
        };
        tokio::spawn(async move {
            let (mut rd, mut wr) = s.split();
            let writer = async {
                if wr.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    if wr.write_all(b" ").await.is_err() {
                        return;
                    }
                }
            };
            let reader = async {
                // An answer (408, 413...) may come before the close.
                if let raw::Outcome::Answered(r) = raw::read_response(&mut rd, false).await
                    && let Ok(mut v) = answers.lock()
                {
                    v.push(r.status);
                }
                let mut buf = [0u8; 256];
                while let Ok(n) = rd.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            };
            tokio::select! {
                () = writer => {}
                () = reader => {}
            }
            if let Ok(mut v) = closed.lock() {
                v.push(at.elapsed().as_secs_f64());
            }
        });
    }
    let window = if body {
        args.body_window_secs
    } else {
        args.window_secs
    };
    let fds = peak_fds(t.pid, Duration::from_secs(window)).await;
    let (n, last) = closed_stats(&closed);
    let limit = if body { 65.0 } else { 15.0 };
    let within = closed
        .lock()
        .map(|v| v.iter().filter(|s| **s <= limit).count())
        .unwrap_or(0);
    let mut statuses = answers.lock().map(|v| v.clone()).unwrap_or_default();
    statuses.sort_unstable();
    statuses.dedup();
    let what = if body {
        "trickled bodies"
    } else {
        "trickled heads"
    };
    let detail = format!(
        "{opened} opened ({failed} could not connect), {n} closed by the gateway within {window} s \
         ({within} within {limit:.0} s, the last after {last:.1} s), answers {statuses:?}; \
         gateway fds peak {fds}"
    );
    let name = format!("{what} cut off by the gateway within {limit:.0} s");
    Ok(vec![if window as f64 >= limit {
        check(name, within == opened && opened > 0, detail)
    } else {
        note(name, detail)
    }])
}

async fn new_session(t: &Target) -> anyhow::Result<(String, String)> {
    let v: Value = t
        .http
        .post(format!("http://{}/v1/sessions", t.addr))
        .json(&json!({}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    match (v["session_id"].as_str(), v["session_token"].as_str()) {
        (Some(id), Some(tok)) => Ok((id.to_owned(), tok.to_owned())),
        _ => bail!("POST /v1/sessions answered {v}"),
    }
}

/// A surface attached in ack mode (`last_seq: 0`) over a raw socket.
async fn attach_raw(
    t: &Target,
    id: &str,
    token: &str,
    recv_buffer: Option<u32>,
    rng: &mut Rng,
) -> anyhow::Result<raw::RawWs> {
    let path = format!("/v1/sbp/ws/{id}");
    let opts = WsOpts {
        recv_buffer,
        ..WsOpts::default()
    };
    let mut ws =
        match raw::ws_connect(t.addr, path.as_bytes(), opts, rng, Duration::from_secs(10)).await {
            Handshake::Upgraded(ws) => ws,
            Handshake::Refused(r) => bail!("attach refused: {}", r.describe()),
            Handshake::Failed(o) => bail!("attach failed: {o:?}"),
        };
    let attach =
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token, "last_seq": 0});
    ws.send_text(rng, &attach.to_string()).await?;
    match ws.next_json(rng, Duration::from_secs(10)).await {
        Ok(v) if v["type"] == "SESSION_ATTACHED" => Ok(ws),
        other => bail!("attach answered {other:?}"),
    }
}

/// What one stuck session saw: pushes `(index, seq, live?, sent at)` and when the gateway first
/// reported the surface gone.
#[derive(Default)]
struct Stuck {
    pushes: Vec<(u64, u64, bool, f64)>,
    push_errors: Vec<String>,
    dropped_at: Option<f64>,
}

async fn stuck_surfaces(args: &ExhaustArgs, t: &Target) -> anyhow::Result<Vec<Check>> {
    let mut rng = Rng::new(11);
    let mut sessions = Vec::new();
    let mut sockets = Vec::new();
    for _ in 0..args.stuck_surfaces {
        let (id, token) = new_session(t).await?;
        // A small receive window, so the gateway's writes block soon.
        sockets.push(attach_raw(t, &id, &token, Some(4096), &mut rng).await?);
        sessions.push((id, token));
    }
    let start = Instant::now();
    let end = start + Duration::from_secs(args.stuck_secs);
    let filler = "x".repeat(args.turn_bytes);
    let mut tasks = Vec::new();
    for (id, token) in sessions.clone() {
        let http = t.http.clone();
        let addr = t.addr;
        let filler = filler.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = Stuck::default();
            let mut n = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let mut poll = Instant::now();
            while Instant::now() < end {
                tick.tick().await;
                let at = start.elapsed().as_secs_f64();
                let content = format!("stuck {n} {filler}");
                let r = http
                    .post(format!("http://{addr}/v1/sbp/sessions/{id}/turns"))
                    .header("x-session-token", &token)
                    .json(&json!({"content": content}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => {
                        let v: Value = r.json().await.unwrap_or(Value::Null);
                        let live = v["delivery"] == "live";
                        s.pushes.push((n, v["seq"].as_u64().unwrap_or(0), live, at));
                    }
                    Ok(r) => s.push_errors.push(format!(
                        "{} {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )),
                    Err(e) => s.push_errors.push(e.to_string()),
                }
                n += 1;
                if s.dropped_at.is_none() && poll.elapsed() >= Duration::from_secs(1) {
                    poll = Instant::now();
                    let v: Option<Value> = match http
                        .get(format!("http://{addr}/v1/sessions/{id}"))
                        .header("x-session-token", &token)
                        .send()
                        .await
                    {
                        Ok(r) => r.json().await.ok(),
                        Err(_) => None,
                    };
                    if v.is_some_and(|v| v["surface_attached"] == false) {
                        s.dropped_at = Some(start.elapsed().as_secs_f64());
                    }
                }
            }
            s
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await?);
    }
    let rss_during = procs::mem(t.pid).map_or(0, |m| m.rss_kib) / 1024;
    drop(sockets);
    // Whatever the stuck surfaces never acknowledged must still be in the tether.
    let mut lost = 0usize;
    let mut drain_errors = Vec::new();
    for ((id, token), s) in sessions.iter().zip(&results) {
        match drain_all(t, id, token, &mut rng).await {
            Ok(got) => {
                let mut expected = s.pushes.iter().map(|p| p.0);
                let mut it = got.iter();
                for n in expected.by_ref() {
                    let want = format!("stuck {n} ");
                    if !it.by_ref().any(|c| c.starts_with(&want)) {
                        lost += 1;
                    }
                }
            }
            Err(e) => drain_errors.push(e.to_string()),
        }
    }
    let dropped = results.iter().filter(|s| s.dropped_at.is_some()).count();
    let latest_drop = results
        .iter()
        .filter_map(|s| s.dropped_at)
        .fold(0.0, f64::max);
    // A push answered `live` a second or more after the surface was seen gone was handed to a
    // surface that no longer exists.
    let live_after: usize = results
        .iter()
        .map(|s| match s.dropped_at {
            Some(d) => s.pushes.iter().filter(|p| p.2 && p.3 > d + 1.0).count(),
            None => s.pushes.iter().filter(|p| p.2).count(),
        })
        .sum();
    let pushes: usize = results.iter().map(|s| s.pushes.len()).sum();
    let errors: Vec<&String> = results.iter().flat_map(|s| &s.push_errors).collect();
    Ok(vec![
        check(
            format!("stuck surfaces dropped within {} s", args.stuck_secs),
            dropped == args.stuck_surfaces,
            format!(
                "{dropped} of {} seen detached (the last after {latest_drop:.1} s); RSS at the end \
                 of the pushes {rss_during} MiB",
                args.stuck_surfaces
            ),
        ),
        check(
            "pushes to a stuck surface are tethered, not reported live",
            live_after == 0,
            format!("{live_after} of {pushes} pushes answered `live` while the surface was stuck"),
        ),
        check(
            "every pushed turn kept in the tether",
            lost == 0 && drain_errors.is_empty(),
            format!(
                "{lost} missing from the drain after the stuck surfaces left{}",
                if drain_errors.is_empty() {
                    String::new()
                } else {
                    format!("; drains failed: {drain_errors:?}")
                }
            ),
        ),
        check(
            "pushes answered",
            errors.is_empty(),
            format!(
                "{} failed{}",
                errors.len(),
                errors
                    .first()
                    .map(|e| format!(", e.g. {e}"))
                    .unwrap_or_default()
            ),
        ),
    ])
}

/// Attaches in ack mode and takes every queued turn, acknowledging each; their contents.
async fn drain_all(
    t: &Target,
    id: &str,
    token: &str,
    rng: &mut Rng,
) -> anyhow::Result<Vec<String>> {
    let path = format!("/v1/sbp/ws/{id}");
    let mut ws = match raw::ws_connect(
        t.addr,
        path.as_bytes(),
        WsOpts::default(),
        rng,
        Duration::from_secs(10),
    )
    .await
    {
        Handshake::Upgraded(ws) => ws,
        Handshake::Refused(r) => bail!("drain attach refused: {}", r.describe()),
        Handshake::Failed(o) => bail!("drain attach failed: {o:?}"),
    };
    let attach =
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token, "last_seq": 0});
    ws.send_text(rng, &attach.to_string()).await?;
    let mut queued = None;
    let mut got = Vec::new();
    while queued.is_none_or(|q| (got.len() as u64) < q) {
        let v = ws
            .next_json(rng, Duration::from_secs(15))
            .await
            .map_err(|e| anyhow::anyhow!("after {} turns: {e}", got.len()))?;
        match v["type"].as_str() {
            Some("SESSION_ATTACHED") => queued = v["queued_turns"].as_u64(),
            Some("TETHER_TURN") => {
                got.push(v["content"].as_str().unwrap_or_default().to_owned());
                let ack = json!({"type": "ACK", "seq": v["seq"]});
                ws.send_text(rng, &ack.to_string()).await?;
            }
            _ => {}
        }
    }
    Ok(got)
}

async fn frame_flood(args: &ExhaustArgs, t: &Target) -> anyhow::Result<Vec<Check>> {
    let mut rng = Rng::new(12);
    let (id, token) = new_session(t).await?;
    let ws = attach_raw(t, &id, &token, None, &mut rng).await?;
    let (mut rd, mut wr) = ws.stream.into_split();
    let closed = Arc::new(AtomicBool::new(false));
    let close_code = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let reader = {
        let closed = closed.clone();
        let close_code = close_code.clone();
        tokio::spawn(async move {
            // Reads frames as a RawWs would; only the close matters here.
            let mut buf = Vec::new();
            let mut chunk = vec![0u8; 16 * 1024];
            loop {
                match tokio::time::timeout(Duration::from_secs(60), rd.read(&mut chunk)).await {
                    Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                    Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
                }
                if let Some(code) = find_close(&buf) {
                    close_code.store(u64::from(code), Ordering::Relaxed);
                    break;
                }
                if buf.len() > 1 << 20 {
                    buf.clear();
                }
            }
            closed.store(true, Ordering::Relaxed);
            start.elapsed().as_secs_f64()
        })
    };
    let frame = raw::text_frame(&mut rng, br#"{"type":"ACK","seq":0}"#);
    let batch: Vec<u8> = frame.repeat(1000);
    let mut sent = 0u64;
    while sent < args.flood_frames && !closed.load(Ordering::Relaxed) {
        let n = (args.flood_frames - sent).min(1000);
        let bytes = if n == 1000 {
            &batch[..]
        } else {
            &batch[..frame.len() * n as usize]
        };
        if tokio::time::timeout(Duration::from_secs(30), wr.write_all(bytes))
            .await
            .map_or(true, |r| r.is_err())
        {
            break;
        }
        sent += n;
    }
    let send_secs = start.elapsed().as_secs_f64();
    // The gateway's answer to the flood, if any, comes now.
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while !closed.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let code = close_code.load(Ordering::Relaxed);
    reader.abort();
    Ok(vec![check(
        "a frame flood is closed with 1008",
        code == 1008,
        format!(
            "{sent} of {} frames written in {send_secs:.2} s; close code {}",
            args.flood_frames,
            if code == 0 {
                "none".to_owned()
            } else {
                code.to_string()
            }
        ),
    )])
}

/// The code of the first close frame in server bytes `buf`, when there is one.
fn find_close(buf: &[u8]) -> Option<u16> {
    let mut at = 0;
    while at + 2 <= buf.len() {
        let op = buf[at] & 0x0f;
        let (len, head) = match buf[at + 1] & 0x7f {
            126 if at + 4 <= buf.len() => (
                usize::from(u16::from_be_bytes([buf[at + 2], buf[at + 3]])),
                4,
            ),
            127 if at + 10 <= buf.len() => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&buf[at + 2..at + 10]);
                (usize::try_from(u64::from_be_bytes(b)).ok()?, 10)
            }
            126 | 127 => return None,
            n => (usize::from(n), 2),
        };
        if at + head + len > buf.len() {
            return None;
        }
        if op == raw::OP_CLOSE {
            let p = &buf[at + head..at + head + len];
            return Some(if p.len() >= 2 {
                u16::from_be_bytes([p[0], p[1]])
            } else {
                1005
            });
        }
        at += head + len;
    }
    None
}

async fn big_body(args: &ExhaustArgs, t: &Target) -> anyhow::Result<Vec<Check>> {
    let mut checks = Vec::new();
    // A Content-Length far over the limit, with no body: refused at once, before any read.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: 1073741824\r\n\r\n",
        t.addr
    );
    let started = Instant::now();
    let outcome = raw::exchange(
        t.addr,
        head.into_bytes(),
        false,
        false,
        Duration::from_secs(5),
    )
    .await;
    let secs = started.elapsed().as_secs_f64();
    let (ok, what) = match &outcome {
        raw::Outcome::Answered(r) => (
            r.status == 413 && r.is_envelope() && secs < 2.0,
            format!("{} after {secs:.2} s", r.describe()),
        ),
        other => (false, format!("{other:?} after {secs:.2} s")),
    };
    checks.push(check("a 1 GiB Content-Length gets 413 at once", ok, what));

    // Bodies of many tiny messages, all at once.
    let mut body = String::with_capacity(args.big_body_messages * 32 + 64);
    body.push_str(r#"{"model":"soak-model","messages":["#);
    for i in 0..args.big_body_messages {
        if i > 0 {
            body.push(',');
        }
        body.push_str(r#"{"role":"user","content":"x"}"#);
    }
    body.push_str("]}");
    let mib = body.len() as f64 / (1024.0 * 1024.0);
    let body = Arc::new(body);
    let started = Instant::now();
    let sends = (0..args.big_bodies).map(|_| {
        let body = body.clone();
        let http = t.http.clone();
        let addr = t.addr;
        async move {
            let r = http
                .post(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body.as_str().to_owned())
                .send()
                .await;
            match r {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let text = r.bytes().await.unwrap_or_default();
                    (status, raw::is_envelope(&text), raw::snippet(&text, 120))
                }
                Err(e) => (0, false, e.to_string()),
            }
        }
    });
    let answers = futures::future::join_all(sends).await;
    let secs = started.elapsed().as_secs_f64();
    let refused = answers
        .iter()
        .filter(|(s, env, _)| matches!(s, 413 | 422) && *env)
        .count();
    checks.push(check(
        format!(
            "{} bodies of {} messages ({mib:.1} MiB) refused with 413/422",
            args.big_bodies, args.big_body_messages
        ),
        refused == args.big_bodies,
        format!(
            "answers {:?} in {secs:.1} s",
            answers
                .iter()
                .map(|(s, _, t)| format!("{s} {t}"))
                .collect::<Vec<_>>()
        ),
    ));
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_frames_are_found_after_other_frames() {
        let mut buf = raw::ws_frame(true, 0, raw::OP_TEXT, None, b"hello");
        assert_eq!(find_close(&buf), None);
        let mut close = 1008u16.to_be_bytes().to_vec();
        close.extend_from_slice(b"flood");
        buf.extend(raw::ws_frame(true, 0, raw::OP_CLOSE, None, &close));
        assert_eq!(find_close(&buf), Some(1008));
        assert_eq!(find_close(&buf[..buf.len() - 1]), None);
    }
}
