//! Closed-loop throughput: N keep-alive connections, each sending its next stateful completion
//! as soon as the previous one is answered (and so durable), for a fixed time after a warm-up.
//! The loop itself ([`closed_loop`]) also drives the peers comparison.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;
use serde::Serialize;
use tokio::sync::Barrier;

use crate::client::{Client, Target};
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Mem, RssSampler, Stack, Sync};
use crate::stats::{Latencies, Summary};

#[derive(Debug, Clone)]
pub struct Params {
    pub connections: usize,
    pub warmup: Duration,
    pub duration: Duration,
    /// `None`: one growing session per connection; `Some(n)`: a new session every n turns.
    pub turns_per_session: Option<u32>,
    /// Straight to the fake upstream instead (the ceiling of upstream + client on this machine).
    pub direct: bool,
    pub sync: Sync,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `gateway`, or `direct` (straight to the fake upstream, no gateway involved).
    pub target: &'static str,
    pub sync: Sync,
    pub connections: usize,
    pub turns_per_session: Option<u32>,
    pub duration_s: f64,
    pub completions: u64,
    pub completions_per_s: f64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub sessions_started: u64,
    pub latency: Summary,
    /// Gateway CPU time per completion (user + system, all threads), in milliseconds.
    pub gateway_cpu_ms_per_completion: f64,
    /// Sessions whose stored step_count equals the completions the worker saw succeed.
    pub sessions_verified: u64,
    pub sessions_mismatched: u64,
    pub gateway_peak_rss_sampled_kib: u64,
    pub gateway_mem_end: Mem,
    /// Files of the gateway's data directory at the end (database, WAL), in bytes.
    pub data_files: std::collections::BTreeMap<String, u64>,
    pub cpu: CpuUse,
    pub load_before: [f64; 3],
}

struct WorkerResult {
    latencies: Latencies,
    completions: u64,
    errors: u64,
    first_error: Option<String>,
    client: Client,
}

pub async fn run(env: &Env, label: &str, p: &Params) -> anyhow::Result<Report> {
    let load_before = procs::loadavg();
    Stack::measure_with(env, label, p.sync, async |stack| {
        measure(stack, p, load_before).await
    })
    .await
}

async fn measure(stack: &Stack, p: &Params, load_before: [f64; 3]) -> anyhow::Result<Report> {
    let (addr, target) = if p.direct {
        (stack.fake.addr, Target::Direct)
    } else {
        let target = Target::Stateful {
            turns_per_session: p.turns_per_session,
        };
        (stack.gateway.addr, target)
    };
    let load = Load {
        addr,
        target,
        headers: HeaderMap::new(),
        connections: p.connections,
        warmup: p.warmup,
        duration: p.duration,
    };
    let pids = [("gateway", stack.gateway.pid), ("fake", stack.fake.pid)];
    let r = closed_loop(&load, || CpuSnapshot::take(&pids), Some(stack.gateway.pid)).await?;
    let secs = p.duration.as_secs_f64();
    Ok(Report {
        target: if p.direct { "direct" } else { "gateway" },
        sync: p.sync,
        connections: p.connections,
        turns_per_session: p.turns_per_session,
        duration_s: secs,
        completions: r.completions,
        completions_per_s: procs::round1(r.completions as f64 / secs),
        errors: r.errors,
        first_error: r.first_error,
        sessions_started: r.sessions_started,
        latency: r.latency,
        gateway_cpu_ms_per_completion: per_completion_ms(
            r.cpu.cpu_seconds("gateway"),
            r.completions,
        ),
        sessions_verified: r.sessions_verified,
        sessions_mismatched: r.sessions_mismatched,
        gateway_peak_rss_sampled_kib: r.rss_peak_sampled_kib,
        gateway_mem_end: procs::mem(stack.gateway.pid)?,
        data_files: stack.data_files(),
        cpu: r.cpu,
        load_before,
    })
}

/// Where a closed-loop run sends its completions, and how long it runs.
#[derive(Debug, Clone)]
pub struct Load {
    pub addr: SocketAddr,
    pub target: Target,
    /// Sent with every request (a peer gateway's routing headers).
    pub headers: HeaderMap,
    pub connections: usize,
    pub warmup: Duration,
    pub duration: Duration,
}

/// What a closed-loop run saw in its measured window.
#[derive(Debug, Clone)]
pub struct ClosedLoop {
    pub completions: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub sessions_started: u64,
    pub latency: Summary,
    /// Sessions whose stored step_count equals the completions the worker saw succeed.
    pub sessions_verified: u64,
    pub sessions_mismatched: u64,
    /// CPU over the measured window, from `snapshot`'s processes.
    pub cpu: CpuUse,
    /// The largest VmRSS of the sampled process in the window, in KiB (0 without one).
    pub rss_peak_sampled_kib: u64,
}

/// `load.connections` workers, each on its own keep-alive connection (and, stateful, with its
/// first session made before the clock starts), send completions back to back for
/// `load.warmup + load.duration`; a completion counts if it started and ended inside the measured
/// window. `snapshot` takes the CPU snapshot at the window's start; `rss_of` is sampled in it.
/// At the end every stateful worker checks its session's stored step count.
pub async fn closed_loop(
    load: &Load,
    snapshot: impl Fn() -> CpuSnapshot,
    rss_of: Option<u32>,
) -> anyhow::Result<ClosedLoop> {
    let stateful = matches!(load.target, Target::Stateful { .. });
    // Every worker has its connection and first session before the clock starts.
    let ready = Arc::new(Barrier::new(load.connections + 1));
    let mut tasks = Vec::with_capacity(load.connections);
    let start_at = Arc::new(std::sync::OnceLock::<(Instant, Instant)>::new());
    for worker in 0..load.connections {
        let ready = ready.clone();
        let start_at = start_at.clone();
        let (addr, target, headers) = (load.addr, load.target, load.headers.clone());
        tasks.push(tokio::spawn(async move {
            let setup = async {
                let mut c = Client::connect_with(addr, worker, target, &headers).await?;
                if stateful {
                    c.start_session().await?;
                }
                Ok::<_, anyhow::Error>(c)
            }
            .await;
            // Both waits happen even after a failed setup, or the others would wait forever.
            ready.wait().await;
            ready.wait().await;
            let mut client = setup?;
            let (measure_from, end) = *start_at
                .get()
                .ok_or_else(|| anyhow::anyhow!("start time not set"))?;
            let mut latencies = Latencies::new();
            let mut completions = 0;
            let mut errors = 0;
            let mut first_error = None;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let outcome = client.complete().await;
                let t1 = Instant::now();
                if t0 < measure_from || t1 > end {
                    continue;
                }
                match outcome {
                    Ok(()) => {
                        completions += 1;
                        latencies.record(t1 - t0);
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            Ok::<_, anyhow::Error>(WorkerResult {
                latencies,
                completions,
                errors,
                first_error,
                client,
            })
        }));
    }
    ready.wait().await;
    let now = Instant::now();
    let measure_from = now + load.warmup;
    let end = measure_from + load.duration;
    // The workers read the times only after the second barrier.
    let _ = start_at.set((measure_from, end));
    ready.wait().await;
    tokio::time::sleep_until(measure_from.into()).await;
    let rss = rss_of.map(RssSampler::start);
    let cpu0 = snapshot();
    tokio::time::sleep_until(end.into()).await;
    let cpu = cpu0.since();
    let rss_peak_sampled_kib = rss.map_or(0, RssSampler::finish);

    let mut all = Latencies::new();
    let mut out = ClosedLoop {
        completions: 0,
        errors: 0,
        first_error: None,
        sessions_started: 0,
        latency: Summary::default(),
        sessions_verified: 0,
        sessions_mismatched: 0,
        cpu,
        rss_peak_sampled_kib,
    };
    let mut failures = Vec::new();
    for t in tasks {
        match t.await? {
            Ok(mut r) => {
                all.merge(&r.latencies);
                out.completions += r.completions;
                out.errors += r.errors;
                if out.first_error.is_none() {
                    out.first_error = r.first_error.take();
                }
                out.sessions_started += r.client.session.sessions_started;
                match r.client.verify_session().await {
                    Ok(Some(true)) => out.sessions_verified += 1,
                    Ok(Some(false)) => out.sessions_mismatched += 1,
                    Ok(None) => {}
                    Err(e) => failures.push(format!("{e:#}")),
                }
            }
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    if let Some(f) = failures.first() {
        anyhow::bail!("{} worker(s) failed; first: {f}", failures.len());
    }
    out.latency = all.summary();
    Ok(out)
}

/// CPU milliseconds per completion, to three decimals.
pub fn per_completion_ms(cpu_seconds: f64, completions: u64) -> f64 {
    if completions == 0 {
        return 0.0;
    }
    (cpu_seconds * 1000.0 / completions as f64 * 1000.0).round() / 1000.0
}
