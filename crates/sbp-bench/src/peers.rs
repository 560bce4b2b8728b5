//! `sbp-bench peers`: sbp beside the floor and the gateways users compare it with, in one run on
//! one machine state. Every target sits in front of the same fake upstream process and gets the
//! same load, one after another: the closed loop of the throughput scenario, or with --rate the
//! open loop of the latency scenario. Reported per target: requests/s, latency, the gateway's
//! CPU per request and peak RSS (its whole process tree: nginx's master and worker, LiteLLM's
//! and node's children), errors, and ratios against `direct` and `nginx`.

mod launch;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::Args;
use serde::Serialize;

use self::launch::{Running, Started};
use crate::client::Target;
use crate::latency;
use crate::procs::{self, CpuSnapshot, CpuUse, Env, Machine, Service, Sync};
use crate::stats::Summary;
use crate::throughput::{self, Load};

/// A target of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Peer {
    /// Plain completions straight to the fake upstream: the floor.
    Direct,
    /// nginx, one worker, keep-alive reverse proxy.
    Nginx,
    /// `sbp serve --strict-sbp`, plain requests: a proxy hop, nothing stored.
    SbpPlain,
    /// `sbp serve`, SQLite `--sqlite-synchronous full`, one growing session per connection.
    SbpDurable,
    /// The same on PostgreSQL (--database, or the machine's test database), a fresh schema.
    SbpDurablePg,
    /// LiteLLM's proxy, one worker.
    Litellm,
    /// Portkey's gateway (node).
    Portkey,
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Nginx => "nginx",
            Self::SbpPlain => "sbp-plain",
            Self::SbpDurable => "sbp-durable",
            Self::SbpDurablePg => "sbp-durable-pg",
            Self::Litellm => "litellm",
            Self::Portkey => "portkey",
        }
    }
}

/// The targets run when --targets is not given (sbp-durable-pg too when --database is).
const DEFAULT_TARGETS: [Peer; 6] = [
    Peer::Direct,
    Peer::Nginx,
    Peer::SbpPlain,
    Peer::SbpDurable,
    Peer::Litellm,
    Peer::Portkey,
];

/// The machine's PostgreSQL, for `sbp-durable-pg` without --database.
const DEFAULT_DATABASE: &str = "postgres://postgres@127.0.0.1:5432/test";

/// sbp-plain's CPU per request may be at most this many times nginx's (issue 17).
const CPU_VS_NGINX_TARGET: f64 = 2.0;

#[derive(Debug, Args)]
pub struct PeersArgs {
    /// Targets, in this order: direct, nginx, sbp-plain, sbp-durable, sbp-durable-pg, litellm,
    /// portkey. [default: all but sbp-durable-pg, which joins when --database is given; peers
    /// not installed are skipped with a note]
    #[arg(long, value_enum, value_delimiter = ',')]
    targets: Vec<Peer>,
    /// Where scripts/bench-peers-deps.sh installed LiteLLM (`litellm-venv/`) and Portkey
    /// (`portkey/`). [default: --bin-dir/../bench-peers, i.e. target/bench-peers]
    #[arg(long)]
    peers_dir: Option<PathBuf>,
}

/// The global options the comparison uses.
pub struct Settings {
    pub connections: usize,
    pub warmup: Duration,
    pub duration: Duration,
    /// Open loop at this many requests/s instead of closed loop.
    pub rate: Option<f64>,
    pub database: Option<String>,
    pub out: PathBuf,
    pub machine: Machine,
    pub load_at_start: [f64; 3],
}

/// One target's outcome.
#[derive(Debug, Serialize)]
struct Row {
    target: Peer,
    /// `measured`, `skipped` (not installed here) or `failed`.
    status: &'static str,
    /// Why it was skipped or how it failed.
    note: Option<String>,
    version: Option<String>,
    measured: Option<Measured>,
    vs: Option<Ratios>,
}

/// What one target did under the load, over the measured window.
#[derive(Debug, Clone, Serialize)]
struct Measured {
    /// Completions answered 200.
    ok: u64,
    requests_per_s: f64,
    errors: u64,
    first_error: Option<String>,
    /// Open loop: requests never sent because the target fell too far behind.
    dropped: Option<u64>,
    /// Closed loop: from send to the end of the answer; open loop: from the scheduled time.
    latency: Summary,
    /// CPU (user + system) of the gateway's whole process tree per request, in microseconds.
    gateway_cpu_us_per_request: Option<f64>,
    /// The fake upstream's CPU per request (the same process for every target).
    upstream_cpu_us_per_request: f64,
    /// sbp-durable-pg: every PostgreSQL process's CPU per request (the store's share of the
    /// work; other clients of the server count too).
    postgres_cpu_us_per_request: Option<f64>,
    /// VmHWM summed over the gateway's process tree at the end, in KiB.
    gateway_peak_rss_kib: Option<u64>,
    gateway_processes: Option<usize>,
    /// Stateful targets: sessions whose stored step count equals the turns answered 200.
    sessions_verified: u64,
    /// Stateful targets: sessions whose stored step count differs (turns fell behind).
    sessions_mismatched: u64,
    cpu: CpuUse,
}

/// A target against the floor and against nginx.
#[derive(Debug, Clone, Serialize)]
struct Ratios {
    requests_per_s_vs_direct: Option<f64>,
    added_p50_ms_vs_direct: Option<f64>,
    added_p99_ms_vs_direct: Option<f64>,
    added_p999_ms_vs_direct: Option<f64>,
    requests_per_s_vs_nginx: Option<f64>,
    cpu_per_request_vs_nginx: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    started_unix: u64,
    machine: Machine,
    load_at_start: [f64; 3],
    load_at_end: [f64; 3],
    /// `closed-loop` or `fixed-rate`.
    mode: &'static str,
    connections: usize,
    warmup_s: f64,
    duration_s: f64,
    rate: Option<f64>,
    rows: Vec<Row>,
    /// sbp-plain's CPU per request over nginx's, and whether it is within the target.
    cpu_sbp_plain_vs_nginx: Option<Verdict>,
}

#[derive(Debug, Serialize)]
struct Verdict {
    ratio: f64,
    target: f64,
    met: bool,
}

pub async fn run(env: &Env, args: &PeersArgs, s: &Settings) -> anyhow::Result<()> {
    let targets = if args.targets.is_empty() {
        let mut t = DEFAULT_TARGETS.to_vec();
        if s.database.is_some() {
            t.insert(4, Peer::SbpDurablePg);
        }
        t
    } else {
        args.targets.clone()
    };
    let peers_dir = args
        .peers_dir
        .clone()
        .unwrap_or_else(|| env.bin_dir.join("..").join("bench-peers"));
    let database = s.database.as_deref().unwrap_or(DEFAULT_DATABASE);
    let mode = match s.rate {
        Some(r) => format!("open loop at {r:.0} req/s"),
        None => "closed loop".to_owned(),
    };
    println!(
        "peers: {}; {mode}, {} connections, {:.0} s warm-up + {:.0} s measured each",
        names(&targets),
        s.connections,
        s.warmup.as_secs_f64(),
        s.duration.as_secs_f64()
    );
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());

    // One upstream for every target, so each is measured against the same process.
    let mut fake = procs::start_fake(env, "peers").await?;
    println!("  fake upstream pid {} on {}", fake.pid, fake.addr);
    let mut rows = Vec::with_capacity(targets.len());
    for &peer in &targets {
        println!("\n== peers/{}", peer.name());
        let cx = launch::Context {
            env,
            fake: &fake,
            peers_dir: &peers_dir,
            database,
        };
        let row = one(peer, &cx, s).await;
        match (&row.measured, &row.note) {
            (Some(m), _) => print_measured(m),
            (None, Some(note)) => println!("  {}: {note}", row.status),
            (None, None) => {}
        }
        rows.push(row);
        if let Err(e) = fake.check_alive() {
            let _ = fake.stop().await;
            return Err(e);
        }
    }
    fake.stop().await?;

    add_ratios(&mut rows);
    let verdict = cpu_verdict(&rows);
    match s.rate {
        None => print_closed_table(&rows),
        Some(_) => print_rate_table(&rows),
    }
    for r in rows.iter().filter(|r| r.measured.is_none()) {
        println!(
            "  {}: {} ({})",
            r.target.name(),
            r.status,
            r.note.as_deref().unwrap_or("")
        );
    }
    match &verdict {
        Some(v) => println!(
            "\n  [{}] sbp-plain CPU per request <= {CPU_VS_NGINX_TARGET}x nginx's: {:.2}x",
            if v.met { "met " } else { "MISS" },
            v.ratio
        ),
        None => println!("\n  sbp-plain vs nginx CPU: not measured (both targets are needed)"),
    }
    let behind: u64 = rows
        .iter()
        .filter_map(|r| r.measured.as_ref())
        .map(|m| m.sessions_mismatched)
        .sum();
    if behind > 0 {
        println!(
            "  SESSIONS BEHIND: {behind} session(s) whose stored step count differs from the turns answered"
        );
    }

    let report = Report {
        started_unix,
        machine: s.machine.clone(),
        load_at_start: s.load_at_start,
        load_at_end: procs::loadavg(),
        mode: if s.rate.is_some() {
            "fixed-rate"
        } else {
            "closed-loop"
        },
        connections: s.connections,
        warmup_s: s.warmup.as_secs_f64(),
        duration_s: s.duration.as_secs_f64(),
        rate: s.rate,
        rows,
        cpu_sbp_plain_vs_nginx: verdict,
    };
    let path = s.out.join("peers.json");
    let text = serde_json::to_string_pretty(&report)?;
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!("\nresults: {}", path.display());
    let failed = report.rows.iter().filter(|r| r.status == "failed").count();
    if failed > 0 {
        anyhow::bail!("{failed} target(s) failed");
    }
    Ok(())
}

fn names(targets: &[Peer]) -> String {
    let n: Vec<&str> = targets.iter().map(|t| t.name()).collect();
    n.join(", ")
}

/// Starts, measures and stops one target; never fails (a failure is a row).
async fn one(peer: Peer, cx: &launch::Context<'_>, s: &Settings) -> Row {
    let row = |status, note, version, measured| Row {
        target: peer,
        status,
        note,
        version,
        measured,
        vs: None,
    };
    let mut running = match launch::start(peer, cx).await {
        Ok(Started::Up(r)) => *r,
        Ok(Started::Absent(why)) => return row("skipped", Some(why), None, None),
        Err(e) => {
            eprintln!("peers/{} FAILED: {e:#}", peer.name());
            return row("failed", Some(format!("{e:#}")), None, None);
        }
    };
    if let Some(pid) = running.pid() {
        println!(
            "  {} pid {} on {}",
            running.version.as_deref().unwrap_or(peer.name()),
            pid,
            running.addr
        );
    }
    let version = running.version.clone();
    let measured = measure(&running, cx.fake, s).await;
    let alive = running.check_alive();
    let stopped = running.stop().await;
    match measured.and_then(|m| alive.map(|()| m)) {
        Ok(m) => {
            let note = stopped.err().map(|e| format!("stopping: {e:#}"));
            row("measured", note, version, Some(m))
        }
        Err(e) => {
            eprintln!("peers/{} FAILED: {e:#}", peer.name());
            row("failed", Some(format!("{e:#}")), version, None)
        }
    }
}

async fn measure(r: &Running, fake: &Service, s: &Settings) -> anyhow::Result<Measured> {
    let gateway = r.pid();
    let fake_pid = fake.pid;
    let snapshot = || {
        let trees: Vec<(&str, u32)> = gateway.map(|p| ("gateway", p)).into_iter().collect();
        CpuSnapshot::take_with_trees(&[("fake", fake_pid)], &trees)
    };
    let mut m = match s.rate {
        None => {
            let load = Load {
                addr: r.addr,
                target: r.target,
                headers: r.headers.clone(),
                connections: s.connections,
                warmup: s.warmup,
                duration: s.duration,
            };
            let c = throughput::closed_loop(&load, snapshot, None).await?;
            let secs = s.duration.as_secs_f64();
            Measured {
                ok: c.completions,
                requests_per_s: procs::round1(c.completions as f64 / secs),
                errors: c.errors,
                first_error: c.first_error,
                dropped: None,
                latency: c.latency,
                gateway_cpu_us_per_request: None,
                upstream_cpu_us_per_request: 0.0,
                postgres_cpu_us_per_request: None,
                gateway_peak_rss_kib: None,
                gateway_processes: None,
                sessions_verified: c.sessions_verified,
                sessions_mismatched: c.sessions_mismatched,
                cpu: c.cpu,
            }
        }
        Some(rate) => {
            let p = latency::Params {
                rate,
                warmup: s.warmup,
                duration: s.duration,
                connections: s.connections,
                turns_per_session: None,
                sync: Sync::Full,
            };
            let o = latency::open_loop(r.addr, r.target, &r.headers, &p, snapshot).await?;
            Measured {
                ok: o.ok,
                requests_per_s: o.achieved_rate,
                errors: o.errors,
                first_error: o.first_error,
                dropped: Some(o.dropped),
                latency: o.latency,
                gateway_cpu_us_per_request: None,
                upstream_cpu_us_per_request: 0.0,
                postgres_cpu_us_per_request: None,
                gateway_peak_rss_kib: None,
                gateway_processes: None,
                sessions_verified: o.sessions_verified,
                sessions_mismatched: o.sessions_mismatched,
                cpu: o.cpu,
            }
        }
    };
    let requests = m.ok + m.errors;
    m.upstream_cpu_us_per_request = us_per(m.cpu.cpu_seconds("fake"), requests);
    if r.on_postgres {
        m.postgres_cpu_us_per_request = Some(us_per(m.cpu.cpu_seconds("postgres"), requests));
    }
    if let Some(pid) = gateway {
        m.gateway_cpu_us_per_request = Some(us_per(m.cpu.cpu_seconds("gateway"), requests));
        let (mem, n) = procs::tree_mem(pid)?;
        m.gateway_peak_rss_kib = Some(mem.hwm_kib);
        m.gateway_processes = Some(n);
    }
    if matches!(r.target, Target::Stateful { .. }) && m.sessions_verified == 0 {
        // Every session had a failed turn: nothing could be checked, which must not read as
        // "none fell behind".
        println!("  note: no session could be checked (each had a failed turn)");
    }
    Ok(m)
}

/// CPU microseconds per request, to one decimal.
fn us_per(cpu_seconds: f64, requests: u64) -> f64 {
    if requests == 0 {
        return 0.0;
    }
    procs::round1(cpu_seconds * 1e6 / requests as f64)
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| (a / b * 1000.0).round() / 1000.0)
}

fn diff(a: f64, b: f64) -> f64 {
    ((a - b) * 1000.0).round() / 1000.0
}

fn add_ratios(rows: &mut [Row]) {
    let find = |rows: &[Row], p: Peer| {
        rows.iter()
            .find(|r| r.target == p)
            .and_then(|r| r.measured.clone())
    };
    let direct = find(rows, Peer::Direct);
    let nginx = find(rows, Peer::Nginx);
    for r in rows.iter_mut() {
        let Some(m) = &r.measured else { continue };
        let d = direct.as_ref();
        let n = nginx.as_ref();
        r.vs = Some(Ratios {
            requests_per_s_vs_direct: d.and_then(|d| ratio(m.requests_per_s, d.requests_per_s)),
            added_p50_ms_vs_direct: d.map(|d| diff(m.latency.p50_ms, d.latency.p50_ms)),
            added_p99_ms_vs_direct: d.map(|d| diff(m.latency.p99_ms, d.latency.p99_ms)),
            added_p999_ms_vs_direct: d.map(|d| diff(m.latency.p999_ms, d.latency.p999_ms)),
            requests_per_s_vs_nginx: n.and_then(|n| ratio(m.requests_per_s, n.requests_per_s)),
            cpu_per_request_vs_nginx: n
                .and_then(|n| ratio(m.gateway_cpu_us_per_request?, n.gateway_cpu_us_per_request?)),
        });
    }
}

fn cpu_verdict(rows: &[Row]) -> Option<Verdict> {
    let ratio = rows
        .iter()
        .find(|r| r.target == Peer::SbpPlain)?
        .vs
        .as_ref()?
        .cpu_per_request_vs_nginx?;
    Some(Verdict {
        ratio,
        target: CPU_VS_NGINX_TARGET,
        met: ratio <= CPU_VS_NGINX_TARGET,
    })
}

fn print_measured(m: &Measured) {
    println!(
        "  {:.0} req/s ({} ok, {} errors{}); latency {}",
        m.requests_per_s,
        m.ok,
        m.errors,
        m.dropped
            .map(|d| format!(", {d} dropped"))
            .unwrap_or_default(),
        m.latency
    );
    if let Some(e) = &m.first_error {
        println!("  first error: {e}");
    }
    let gateway = match (m.gateway_cpu_us_per_request, m.gateway_peak_rss_kib) {
        (Some(cpu), Some(rss)) => format!(
            "gateway CPU {cpu:.1} µs/req over {} process(es), peak RSS {:.1} MiB; ",
            m.gateway_processes.unwrap_or(1),
            crate::mib(rss)
        ),
        _ => String::new(),
    };
    println!(
        "  {gateway}fake upstream CPU {:.1} µs/req{}",
        m.upstream_cpu_us_per_request,
        m.postgres_cpu_us_per_request
            .map(|us| format!("; PostgreSQL CPU {us:.1} µs/req"))
            .unwrap_or_default()
    );
    if m.sessions_verified + m.sessions_mismatched > 0 {
        println!(
            "  sessions: {} verified, {} behind (stored step count != turns answered)",
            m.sessions_verified, m.sessions_mismatched
        );
    }
    crate::print_cpu(&m.cpu);
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

fn print_closed_table(rows: &[Row]) {
    println!(
        "\n== peers (closed loop)\n  {:<15} {:>8} {:>8} {:>8} {:>10} {:>9} {:>8} {:>6} {:>7} {:>8} {:>8} {:>9}",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "CPU µs/req",
        "fake µs",
        "RSS MiB",
        "procs",
        "errors",
        "×direct",
        "×nginx",
        "CPU×nginx"
    );
    for r in rows {
        let (Some(m), Some(vs)) = (&r.measured, &r.vs) else {
            continue;
        };
        println!(
            "  {:<15} {:>8.0} {:>8.3} {:>8.3} {:>10} {:>9.1} {:>8} {:>6} {:>7} {:>8} {:>8} {:>9}",
            r.target.name(),
            m.requests_per_s,
            m.latency.p50_ms,
            m.latency.p99_ms,
            opt(m.gateway_cpu_us_per_request, 1),
            m.upstream_cpu_us_per_request,
            opt(m.gateway_peak_rss_kib.map(crate::mib), 1),
            m.gateway_processes
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            m.errors,
            opt(vs.requests_per_s_vs_direct, 3),
            opt(vs.requests_per_s_vs_nginx, 3),
            opt(vs.cpu_per_request_vs_nginx, 2),
        );
    }
}

fn print_rate_table(rows: &[Row]) {
    println!(
        "\n== peers (fixed rate)\n  {:<15} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>8} {:>7} {:>8} {:>12}",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "+p99 ms",
        "CPU µs/req",
        "RSS MiB",
        "errors",
        "dropped",
        "sessions",
    );
    for r in rows {
        let (Some(m), Some(vs)) = (&r.measured, &r.vs) else {
            continue;
        };
        let sessions = if m.sessions_verified + m.sessions_mismatched > 0 {
            format!("{} ok/{} bad", m.sessions_verified, m.sessions_mismatched)
        } else {
            "-".to_owned()
        };
        println!(
            "  {:<15} {:>8.0} {:>8.3} {:>8.3} {:>9.3} {:>10} {:>10} {:>8} {:>7} {:>8} {:>12}",
            r.target.name(),
            m.requests_per_s,
            m.latency.p50_ms,
            m.latency.p99_ms,
            m.latency.p999_ms,
            opt(vs.added_p99_ms_vs_direct, 3),
            opt(m.gateway_cpu_us_per_request, 1),
            opt(m.gateway_peak_rss_kib.map(crate::mib), 1),
            m.errors,
            m.dropped.unwrap_or(0),
            sessions,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(rps: f64, p99: f64, cpu: Option<f64>) -> Measured {
        Measured {
            ok: 1,
            requests_per_s: rps,
            errors: 0,
            first_error: None,
            dropped: None,
            latency: Summary {
                p99_ms: p99,
                ..Summary::default()
            },
            gateway_cpu_us_per_request: cpu,
            upstream_cpu_us_per_request: 0.0,
            postgres_cpu_us_per_request: None,
            gateway_peak_rss_kib: None,
            gateway_processes: None,
            sessions_verified: 0,
            sessions_mismatched: 0,
            cpu: CpuSnapshot::take(&[]).since(),
        }
    }

    fn row(target: Peer, m: Option<Measured>) -> Row {
        Row {
            target,
            status: if m.is_some() { "measured" } else { "skipped" },
            note: None,
            version: None,
            measured: m,
            vs: None,
        }
    }

    #[test]
    fn ratios_are_against_direct_and_nginx() {
        let mut rows = vec![
            row(Peer::Direct, Some(measured(10_000.0, 1.0, None))),
            row(Peer::Nginx, Some(measured(8_000.0, 1.5, Some(40.0)))),
            row(Peer::SbpPlain, Some(measured(6_000.0, 2.25, Some(70.0)))),
            row(Peer::Litellm, None),
        ];
        add_ratios(&mut rows);
        let vs = rows[2].vs.clone().expect("ratios");
        assert_eq!(vs.requests_per_s_vs_direct, Some(0.6));
        assert_eq!(vs.requests_per_s_vs_nginx, Some(0.75));
        assert_eq!(vs.cpu_per_request_vs_nginx, Some(1.75));
        assert_eq!(vs.added_p99_ms_vs_direct, Some(1.25));
        assert_eq!(
            rows[0].vs.clone().expect("direct").cpu_per_request_vs_nginx,
            None
        );
        assert!(rows[3].vs.is_none());
        let v = cpu_verdict(&rows).expect("verdict");
        assert!(v.met && v.ratio == 1.75);
    }

    #[test]
    fn no_nginx_no_verdict() {
        let mut rows = vec![row(
            Peer::SbpPlain,
            Some(measured(6_000.0, 2.0, Some(70.0))),
        )];
        add_ratios(&mut rows);
        assert!(cpu_verdict(&rows).is_none());
    }
}
