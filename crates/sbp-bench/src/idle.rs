//! Idle surfaces: N sessions, N attached WebSockets held open doing nothing; the gateway's
//! resident memory before and after says what an idle attached surface costs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::SinkExt;
use serde::Serialize;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use crate::http::HttpConn;
use crate::procs::{self, Env, Mem, Stack, Sync};
use crate::tether::{Ws, attach_frame, create_session, wait_attached, ws_url};

#[derive(Debug, Clone)]
pub struct Params {
    pub surfaces: usize,
    pub connections: usize,
    pub settle: Duration,
    pub sync: Sync,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub sync: Sync,
    pub surfaces: usize,
    pub attached: usize,
    pub attach_failures: usize,
    pub first_error: Option<String>,
    pub create_s: f64,
    pub sessions_per_s: f64,
    pub attach_s: f64,
    pub attaches_per_s: f64,
    /// Right after start.
    pub rss_start_kib: u64,
    /// After the sessions were created, before any WebSocket.
    pub rss_before_kib: u64,
    /// With every surface attached and idle.
    pub rss_after_kib: u64,
    pub rss_delta_kib: u64,
    pub per_surface_kib: f64,
    pub gateway_mem_end: Mem,
    pub bench_rss_kib: u64,
    pub fd_limit: u64,
    pub load_before: [f64; 3],
}

pub async fn run(env: &Env, label: &str, p: &Params, fd_limit: u64) -> anyhow::Result<Report> {
    let load_before = procs::loadavg();
    let needed = p.surfaces as u64 + 200;
    if fd_limit < needed {
        anyhow::bail!(
            "{} surfaces need about {needed} open files, the limit is {fd_limit}: raise it \
             (`ulimit -n {needed}`) or pass a smaller --surfaces",
            p.surfaces
        );
    }
    Stack::measure_with(env, label, p.sync, async |stack| {
        measure(stack, p, load_before, fd_limit).await
    })
    .await
}

async fn measure(
    stack: &Stack,
    p: &Params,
    load_before: [f64; 3],
    fd_limit: u64,
) -> anyhow::Result<Report> {
    let addr = stack.gateway.addr;
    let pid = stack.gateway.pid;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_start = procs::mem(pid)?.rss_kib;

    // Sessions, created over `connections` keep-alive connections.
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..p.connections {
        let next = next.clone();
        let total = p.surfaces;
        tasks.push(tokio::spawn(async move {
            let mut c = HttpConn::connect(addr).await?;
            let mut mine = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                mine.push(create_session(&mut c).await?);
            }
            Ok::<_, anyhow::Error>(mine)
        }));
    }
    let mut sessions = Vec::with_capacity(p.surfaces);
    for t in tasks {
        sessions.extend(t.await??);
    }
    let create_s = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_before = procs::mem(pid)?.rss_kib;

    // Surfaces: attach every session, keep each socket open and idle.
    let started = Instant::now();
    let sessions = Arc::new(sessions);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..p.connections {
        let next = next.clone();
        let sessions = sessions.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine: Vec<Ws> = Vec::new();
            let mut failures = 0usize;
            let mut first_error = None;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((id, token)) = sessions.get(i) else {
                    break;
                };
                match attach(addr, id, token).await {
                    Ok(ws) => mine.push(ws),
                    Err(e) => {
                        failures += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
            }
            (mine, failures, first_error)
        }));
    }
    let mut sockets: Vec<Ws> = Vec::with_capacity(p.surfaces);
    let mut attach_failures = 0;
    let mut first_error = None;
    for t in tasks {
        let (mine, failures, first) = t.await?;
        sockets.extend(mine);
        attach_failures += failures;
        if first_error.is_none() {
            first_error = first;
        }
    }
    let attach_s = started.elapsed().as_secs_f64();
    tokio::time::sleep(p.settle).await;
    let rss_after = procs::mem(pid)?.rss_kib;
    let gateway_mem_end = procs::mem(pid)?;
    let bench_rss_kib = procs::mem(std::process::id())?.rss_kib;
    let attached = sockets.len();
    let delta = rss_after.saturating_sub(rss_before);

    // Dropping the sockets closes them before the gateway is killed.
    drop(sockets);

    Ok(Report {
        sync: p.sync,
        surfaces: p.surfaces,
        attached,
        attach_failures,
        first_error,
        create_s: (create_s * 1000.0).round() / 1000.0,
        sessions_per_s: procs::round1(p.surfaces as f64 / create_s.max(1e-9)),
        attach_s: (attach_s * 1000.0).round() / 1000.0,
        attaches_per_s: procs::round1(attached as f64 / attach_s.max(1e-9)),
        rss_start_kib: rss_start,
        rss_before_kib: rss_before,
        rss_after_kib: rss_after,
        rss_delta_kib: delta,
        per_surface_kib: if attached > 0 {
            procs::round1(delta as f64 / attached as f64)
        } else {
            0.0
        },
        gateway_mem_end,
        bench_rss_kib,
        fd_limit,
        load_before,
    })
}

async fn attach(addr: SocketAddr, id: &str, token: &str) -> anyhow::Result<Ws> {
    // Small buffers: the bench holds thousands of these sockets next to the gateway.
    let config = WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0);
    let (mut ws, _) =
        tokio_tungstenite::connect_async_with_config(ws_url(addr, id), Some(config), true)
            .await
            .context("WebSocket handshake")?;
    ws.send(Message::text(attach_frame(id, token))).await?;
    tokio::time::timeout(Duration::from_secs(30), wait_attached(&mut ws))
        .await
        .context("no SESSION_ATTACHED within 30 s")??;
    Ok(ws)
}
