//! Open-loop latency at a fixed request rate, first straight to the upstream, then through the
//! gateway: requests have scheduled send times and latency is measured from the scheduled time,
//! so a stall delays (and is charged to) every request scheduled behind it — no coordinated
//! omission.

use std::time::{Duration, Instant};

use http::HeaderMap;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::client::{Client, Target};
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Mem, RssSampler, Stack, Sync};
use crate::stats::{Latencies, Summary};

#[derive(Debug, Clone)]
pub struct Params {
    pub rate: f64,
    pub warmup: Duration,
    pub duration: Duration,
    pub connections: usize,
    pub turns_per_session: Option<u32>,
    pub sync: Sync,
}

/// One open-loop run against one target.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub scheduled: u64,
    pub ok: u64,
    pub errors: u64,
    /// Requests never sent because the backlog outlived the run by more than the run's length
    /// (at least 10 s): the target cannot sustain the rate.
    pub dropped: u64,
    pub first_error: Option<String>,
    pub achieved_rate: f64,
    /// From the scheduled send time to the end of the response: what a client sees.
    pub latency: Summary,
    /// From the actual send to the end of the response.
    pub service: Summary,
    /// How late the load generator sent (actual send minus scheduled time).
    pub send_lag: Summary,
    /// Gateway CPU time per completion in this phase, in milliseconds.
    pub gateway_cpu_ms_per_completion: f64,
    pub cpu: CpuUse,
    /// Stateful: sessions whose stored step_count equals the turns their worker saw answered 200,
    /// checked at the end (a session with failed turns is not checkable).
    pub sessions_verified: u64,
    /// Stateful: sessions whose stored step_count differs (a turn answered but not counted).
    pub sessions_mismatched: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub sync: Sync,
    pub rate: f64,
    pub connections: usize,
    pub turns_per_session: Option<u32>,
    pub duration_s: f64,
    pub direct: Phase,
    pub gateway: Phase,
    pub added_p50_ms: f64,
    pub added_p90_ms: f64,
    pub added_p99_ms: f64,
    pub gateway_peak_rss_sampled_kib: u64,
    pub gateway_mem_end: Mem,
    /// Files of the gateway's data directory at the end (database, WAL), in bytes.
    pub data_files: std::collections::BTreeMap<String, u64>,
    pub load_before: [f64; 3],
}

pub async fn run(env: &Env, label: &str, p: &Params) -> anyhow::Result<Report> {
    let load_before = procs::loadavg();
    Stack::measure_with(env, label, p.sync, async |stack| {
        measure(stack, p, load_before).await
    })
    .await
}

async fn measure(stack: &Stack, p: &Params, load_before: [f64; 3]) -> anyhow::Result<Report> {
    let pids = [("gateway", stack.gateway.pid), ("fake", stack.fake.pid)];
    let snapshot = || CpuSnapshot::take(&pids);
    let none = HeaderMap::new();
    let direct = open_loop(stack.fake.addr, Target::Direct, &none, p, snapshot).await?;
    let rss = RssSampler::start(stack.gateway.pid);
    let target = Target::Stateful {
        turns_per_session: p.turns_per_session,
    };
    let gateway = open_loop(stack.gateway.addr, target, &none, p, snapshot).await?;
    let peak = rss.finish();
    let diff = |a: f64, b: f64| ((a - b) * 1000.0).round() / 1000.0;
    Ok(Report {
        sync: p.sync,
        rate: p.rate,
        connections: p.connections,
        turns_per_session: p.turns_per_session,
        duration_s: p.duration.as_secs_f64(),
        added_p50_ms: diff(gateway.latency.p50_ms, direct.latency.p50_ms),
        added_p90_ms: diff(gateway.latency.p90_ms, direct.latency.p90_ms),
        added_p99_ms: diff(gateway.latency.p99_ms, direct.latency.p99_ms),
        direct,
        gateway,
        gateway_peak_rss_sampled_kib: peak,
        gateway_mem_end: procs::mem(stack.gateway.pid)?,
        data_files: stack.data_files(),
        load_before,
    })
}

#[derive(Debug, Clone, Copy)]
struct Ticket {
    scheduled: Instant,
    measured: bool,
}

struct WorkerResult {
    latency: Latencies,
    service: Latencies,
    lag: Latencies,
    ok: u64,
    errors: u64,
    dropped: u64,
    first_error: Option<String>,
    /// Kept for the end-of-run check of its session.
    client: Client,
}

/// `p.rate` requests a second, scheduled round-robin over `p.connections` workers (each on its
/// own keep-alive connection, stateful ones with a session made beforehand) for
/// `p.warmup + p.duration`; latency counts from each request's scheduled time. `snapshot` takes
/// the CPU snapshot at the measured window's start (its process named `gateway` is charged per
/// completion). At the end each stateful worker checks its session's stored step count.
pub async fn open_loop(
    addr: std::net::SocketAddr,
    target: Target,
    headers: &HeaderMap,
    p: &Params,
    snapshot: impl Fn() -> CpuSnapshot,
) -> anyhow::Result<Phase> {
    let warm = (p.rate * p.warmup.as_secs_f64()).round() as u64;
    let measured = (p.rate * p.duration.as_secs_f64()).round() as u64;
    let rate = p.rate;
    let mut senders = Vec::with_capacity(p.connections);
    let mut tasks = Vec::with_capacity(p.connections);
    // Tickets left after this are dropped, so an overloaded target cannot stretch the run forever.
    let schedule_len = Duration::from_secs_f64((warm + measured) as f64 / rate);
    let give_up_after = schedule_len + p.duration.max(Duration::from_secs(10));
    let give_up = std::sync::Arc::new(std::sync::OnceLock::<Instant>::new());
    for worker in 0..p.connections {
        let mut client = Client::connect_with(addr, worker, target, headers).await?;
        if matches!(target, Target::Stateful { .. }) {
            client.start_session().await?;
        }
        let (tx, mut rx) = mpsc::unbounded_channel::<Ticket>();
        senders.push(tx);
        let give_up = give_up.clone();
        tasks.push(tokio::spawn(async move {
            let mut r = WorkerResult {
                latency: Latencies::new(),
                service: Latencies::new(),
                lag: Latencies::new(),
                ok: 0,
                errors: 0,
                dropped: 0,
                first_error: None,
                client,
            };
            while let Some(ticket) = rx.recv().await {
                let sent = Instant::now();
                if give_up.get().is_some_and(|g| sent > *g) {
                    r.dropped += u64::from(ticket.measured);
                    continue;
                }
                let outcome = r.client.complete().await;
                let done = Instant::now();
                if !ticket.measured {
                    continue;
                }
                match outcome {
                    Ok(()) => {
                        r.ok += 1;
                        r.latency.record(done - ticket.scheduled);
                        r.service.record(done - sent);
                        r.lag
                            .record(sent.saturating_duration_since(ticket.scheduled));
                    }
                    Err(e) => {
                        r.errors += 1;
                        r.first_error.get_or_insert(e);
                    }
                }
            }
            r
        }));
    }

    let start = Instant::now() + Duration::from_millis(20);
    let _ = give_up.set(start + give_up_after);
    let measure_from = start + Duration::from_secs_f64(warm as f64 / rate);
    // The schedule runs on its own OS thread: a precise sleep (nanosleep, ~50 µs slack) instead
    // of the runtime's 1 ms timer wheel, which would add up to 1 ms of send lag to every request.
    let dispatcher = tokio::task::spawn_blocking(move || {
        for i in 0..warm + measured {
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            let worker = (i % senders.len() as u64) as usize;
            // A worker only goes away when it panicked; its tickets are then simply lost.
            let _ = senders[worker].send(Ticket {
                scheduled: at,
                measured: i >= warm,
            });
        }
    });
    tokio::time::sleep_until(measure_from.into()).await;
    let cpu0 = snapshot();
    dispatcher.await?;
    let mut latency = Latencies::new();
    let mut service = Latencies::new();
    let mut lag = Latencies::new();
    let mut ok = 0;
    let mut errors = 0;
    let mut dropped = 0;
    let mut first_error = None;
    let mut clients = Vec::with_capacity(tasks.len());
    for t in tasks {
        let mut r = t.await?;
        latency.merge(&r.latency);
        service.merge(&r.service);
        lag.merge(&r.lag);
        ok += r.ok;
        errors += r.errors;
        dropped += r.dropped;
        if first_error.is_none() {
            first_error = r.first_error.take();
        }
        clients.push(r.client);
    }
    // The CPU window closes when the last answer is in, before the session checks.
    let cpu = cpu0.since();
    let elapsed = measure_from.elapsed().as_secs_f64();
    let (mut verified, mut mismatched) = (0, 0);
    for mut client in clients {
        match client.verify_session().await? {
            Some(true) => verified += 1,
            Some(false) => mismatched += 1,
            None => {}
        }
    }
    Ok(Phase {
        scheduled: measured,
        ok,
        errors,
        dropped,
        first_error,
        achieved_rate: procs::round1(ok as f64 / elapsed.max(1e-9)),
        latency: latency.summary(),
        service: service.summary(),
        send_lag: lag.summary(),
        gateway_cpu_ms_per_completion: crate::throughput::per_completion_ms(
            cpu.cpu_seconds("gateway"),
            ok + errors,
        ),
        cpu,
        sessions_verified: verified,
        sessions_mismatched: mismatched,
    })
}
