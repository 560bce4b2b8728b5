//! `sbp-bench`: starts the fake upstream and the gateway from their release binaries, drives them
//! (throughput, added latency at a fixed rate, tether drain, idle surfaces, roaming, the L5
//! TOOL_CALL round trip, also across two replicas, attach + detach cycles through the client SDK),
//! prints a summary and writes `bench-out/results.json`; `peers` measures sbp beside the floor
//! and other gateways (`bench-out/peers.json`). See BENCHMARKS.md.

mod attach;
mod bus;
mod client;
mod http;
mod idle;
mod latency;
mod peers;
mod procs;
mod roaming;
mod stats;
mod tether;
mod throughput;
mod toolcall;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use serde_json::{Value, json};

use crate::procs::{Env, Sync};

/// Benchmarks the sbp gateway against the fake upstream, both run as separate processes.
#[derive(Debug, Parser)]
#[command(name = "sbp-bench", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    opts: Opts,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every scenario in turn.
    All,
    /// Closed-loop stateful completions: one growing session per connection, then a new session
    /// every --turns-per-session turns.
    Throughput,
    /// Open-loop latency at --rate, straight to the upstream, then through the gateway.
    Latency,
    /// Push --tether-turns turns to a detached session, then time their drain on attach.
    Tether,
    /// Attach --surfaces idle WebSockets and measure the gateway's memory.
    Idle,
    /// L3 roaming: import a sealed bundle of --roaming-messages messages, then --iterations times
    /// export the session and import the fresh roaming token.
    Roaming,
    /// L5 TOOL_CALL round trip: backend `POST .../tool_calls` -> TOOL_CALL to an attached surface
    /// -> TOOL_RESULT -> HTTP answer; --iterations calls with one session, then per session with
    /// --toolcall-lanes sessions at once; next to an HTTP and a WebSocket floor. With --bus:
    /// across two replicas (surfaces on A, calls through B).
    Toolcall,
    /// Attach + detach cycles through the client SDK (`Surface::connect` -> SESSION_ATTACHED ->
    /// `Surface::close`): --attach-sessions sessions, --attach-lanes lanes cycling over them for
    /// --duration (or --iterations cycles per lane), once per --attach-variants; then checks that
    /// every attached session ended suspended and no surface is left.
    Attach,
    /// sbp beside the floor and the gateways users compare it with, one after another under the
    /// same load on one fake upstream: `direct`, `nginx`, `sbp-plain`, `sbp-durable` (and
    /// `sbp-durable-pg`), `litellm`, `portkey`. Closed loop (--connections, --duration 10,
    /// --warmup 2), or with --rate, open loop at that rate. Peers not installed are skipped
    /// (scripts/bench-peers-deps.sh installs them). Not part of `all`.
    Peers(peers::PeersArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Shape {
    Growing,
    Rotating,
    /// Straight to the fake upstream, no gateway: the ceiling the machine allows.
    Direct,
}

#[derive(Debug, Args)]
struct Opts {
    /// Concurrent keep-alive connections of the HTTP scenarios.
    #[arg(long, global = true, default_value_t = 64)]
    connections: usize,
    /// Measured seconds of the throughput, latency and peers runs. [default: 15; peers: 10]
    #[arg(long, global = true)]
    duration: Option<f64>,
    /// Session shapes of the throughput scenario: `growing` (one session per connection for the
    /// whole run), `rotating` (a new session every --turns-per-session turns), `direct` (no
    /// gateway: plain completions straight to the fake upstream, for calibration).
    #[arg(
        long,
        global = true,
        value_enum,
        value_delimiter = ',',
        default_value = "growing,rotating"
    )]
    shapes: Vec<Shape>,
    /// Unmeasured seconds before each measured run.
    #[arg(long, global = true, default_value_t = 2.0)]
    warmup: f64,
    /// Turns per session in the rotating throughput run and the latency run.
    #[arg(long, global = true, default_value_t = 20)]
    turns_per_session: u32,
    /// Requests per second of the open-loop latency run [default: 1000]; given to `peers`, it
    /// runs every target open loop at this rate instead of closed loop.
    #[arg(long, global = true)]
    rate: Option<f64>,
    /// Turns pushed to the tether before the drain.
    #[arg(long, global = true, default_value_t = 20_000)]
    tether_turns: u64,
    /// Idle WebSocket surfaces.
    #[arg(long, global = true, default_value_t = 10_000)]
    surfaces: usize,
    /// Export + import pairs of the roaming scenario [default: 20]; tool calls per session in
    /// each phase of the toolcall scenario [default: 5000]; measured cycles per lane of the attach
    /// scenario [default: as many as fit in --duration].
    #[arg(long, global = true)]
    iterations: Option<usize>,
    /// Concurrent sessions (each with its own surface and HTTP connection) of the toolcall
    /// scenario's throughput phase.
    #[arg(long, global = true, default_value_t = 16)]
    toolcall_lanes: usize,
    /// Sessions of the attach scenario (made with the SDK's `Client::create_session`; lane `i`
    /// cycles over sessions `i`, `i + lanes`, ...).
    #[arg(long, global = true, default_value_t = 1000)]
    attach_sessions: usize,
    /// Concurrent attach + detach lanes of the attach scenario.
    #[arg(long, global = true, default_value_t = 16)]
    attach_lanes: usize,
    /// Variants of the attach scenario, each on a fresh gateway: `plain` (attach, close) and
    /// `tethered` (one turn pushed before each attach, drained by it and ACKed on close).
    #[arg(
        long,
        global = true,
        value_enum,
        value_delimiter = ',',
        default_value = "plain,tethered"
    )]
    attach_variants: Vec<attach::Variant>,
    /// Messages in the roaming scenario's session (as imported from a bundle built by the bench).
    #[arg(long, global = true, default_value_t = 10_000)]
    roaming_messages: usize,
    /// SQLite durability of the gateway (`--sqlite-synchronous`); a list (`full,normal`) runs the
    /// throughput scenario once per mode, the others with the first.
    #[arg(
        long,
        global = true,
        value_enum,
        value_delimiter = ',',
        default_value = "full"
    )]
    sync: Vec<Sync>,
    /// Run the gateway on PostgreSQL instead of SQLite: a base URL such as
    /// `postgres://postgres@127.0.0.1:5432/test` (`--database-url` is the same). `peers` runs its
    /// `sbp-durable-pg` target there, with the rest on SQLite. Each gateway start gets a fresh schema
    /// (`sbp_bench_<pid>_<n>`, passed as the URL's `search_path`), dropped when it stops; --sync
    /// then does not apply (PostgreSQL's own `synchronous_commit` decides durability).
    #[arg(long, global = true, alias = "database-url")]
    database: Option<String>,
    /// The toolcall scenario across two replicas: a Redis URL such as `redis://127.0.0.1:6379`.
    /// Starts a second gateway (replica B) on the same PostgreSQL schema (needs --database) and
    /// upstream; both join this bus under a prefix of their own (`sbp_bench_<pid>_<n>:`, its keys
    /// deleted afterwards) with one random `--jwt-secret`. Sessions are created on A and B by
    /// turns, surfaces attach to A, tool calls go to B.
    #[arg(long, global = true)]
    bus: Option<String>,
    /// Run the gateway with encryption at rest: `--encryption-key FILE` (make one with
    /// `sbp encryption-key generate --out FILE`).
    #[arg(long, global = true)]
    encryption_key: Option<PathBuf>,
    /// Directory of the `sbp` and `sbp-fake-llm` binaries. [default: this binary's directory]
    #[arg(long, global = true)]
    bin_dir: Option<PathBuf>,
    /// Output directory: results.json and the processes' logs.
    #[arg(long, global = true, default_value = "bench-out")]
    out: PathBuf,
    /// Where the gateway's fresh data directories are made. [default: the system temp dir]
    #[arg(long, global = true)]
    data_root: Option<PathBuf>,
    /// Before starting, wait up to this many seconds for the 1-minute load average to fall
    /// below --quiet-load (polling every 30 s).
    #[arg(long, global = true, default_value_t = 0)]
    wait_quiet: u64,
    #[arg(long, global = true, default_value_t = 0.7)]
    quiet_load: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tokio::select! {
        r = run(cli) => r,
        _ = tokio::signal::ctrl_c() => {
            // Returning drops the running scenario, whose child processes are killed on drop.
            anyhow::bail!("interrupted")
        }
    }
}

fn secs(v: f64, name: &str) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v >= 0.0) {
        anyhow::bail!("--{name} must be a non-negative number of seconds");
    }
    Ok(Duration::from_secs_f64(v))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let o = &cli.opts;
    let peers = matches!(cli.command, Command::Peers(_));
    let duration_s = o.duration.unwrap_or(if peers { 10.0 } else { 15.0 });
    let rate = o.rate.unwrap_or(1000.0);
    if o.connections == 0 || rate <= 0.0 || o.turns_per_session == 0 || duration_s <= 0.0 {
        anyhow::bail!("--connections, --rate, --turns-per-session and --duration must be positive");
    }
    if o.bus.is_some() {
        if o.database.is_none() {
            anyhow::bail!(
                "--bus needs --database postgres://...: replicas share one PostgreSQL database"
            );
        }
        if !matches!(cli.command, Command::Toolcall) {
            anyhow::bail!("--bus applies to the toolcall scenario only");
        }
    }
    let duration = secs(duration_s, "duration")?;
    let warmup = secs(o.warmup, "warmup")?;
    let bin_dir = match &o.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this binary has no directory")?
            .to_path_buf(),
    };
    let log_dir = o.out.join("logs");
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let env = Env {
        bin_dir,
        log_dir,
        data_root: o.data_root.clone().unwrap_or_else(std::env::temp_dir),
        database: o.database.clone(),
        encryption_key: o.encryption_key.clone(),
    };
    // The gateway inherits this limit; 10,000 surfaces need 10,000 descriptors on each side.
    let fd_limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    let primary = o.sync.first().copied().unwrap_or(Sync::Full);

    if o.wait_quiet > 0 {
        wait_quiet(o.wait_quiet, o.quiet_load).await;
    }
    let machine = procs::machine();
    let load_at_start = procs::loadavg();
    println!(
        "machine: {} x {}, {} MiB, kernel {}; load {:.2} {:.2} {:.2}",
        machine.nproc,
        machine.cpu_model,
        machine.mem_total_kib / 1024,
        machine.kernel,
        load_at_start[0],
        load_at_start[1],
        load_at_start[2]
    );
    if let Command::Peers(args) = &cli.command {
        let settings = peers::Settings {
            connections: o.connections,
            warmup,
            duration,
            rate: o.rate,
            database: o.database.clone(),
            out: o.out.clone(),
            machine,
            load_at_start,
        };
        return peers::run(&env, args, &settings).await;
    }

    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut results = Results {
        started_unix: started,
        machine,
        load_at_start,
        params: json!({
            "connections": o.connections,
            "duration_s": duration_s,
            "warmup_s": o.warmup,
            "turns_per_session": o.turns_per_session,
            "rate": rate,
            "tether_turns": o.tether_turns,
            "surfaces": o.surfaces,
            "iterations": o.iterations,
            "toolcall_lanes": o.toolcall_lanes,
            "attach_sessions": o.attach_sessions,
            "attach_lanes": o.attach_lanes,
            "attach_variants": o.attach_variants,
            "roaming_messages": o.roaming_messages,
            "sync": o.sync,
            "database": o.database.as_deref().map(without_credentials),
            "bus": o.bus.as_deref().map(without_credentials),
            "fd_limit": fd_limit,
        }),
        storage: if o.database.is_some() {
            "postgres"
        } else {
            "sqlite"
        },
        throughput: Vec::new(),
        latency: None,
        tether: None,
        idle: None,
        roaming: None,
        toolcall: None,
        attach: Vec::new(),
        errors: Vec::new(),
        targets: Vec::new(),
        load_at_end: [0.0; 3],
    };
    let all = matches!(cli.command, Command::All);

    if all || matches!(cli.command, Command::Throughput) {
        for &sync in &o.sync {
            for shape in &o.shapes {
                let tps = match shape {
                    Shape::Growing | Shape::Direct => None,
                    Shape::Rotating => Some(o.turns_per_session),
                };
                let direct = *shape == Shape::Direct;
                if (direct || o.database.is_some()) && sync != primary {
                    // SQLite's durability setting does not matter without the gateway, nor on
                    // PostgreSQL.
                    continue;
                }
                let mode = env.storage(sync);
                let label = match (direct, tps) {
                    (true, _) => "throughput-direct".to_owned(),
                    (false, None) => format!("throughput-{mode}"),
                    (false, Some(n)) => format!("throughput-{mode}-rotate{n}"),
                };
                println!(
                    "\n== {label}: {} connections, {:.0} s",
                    o.connections, duration_s
                );
                let p = throughput::Params {
                    connections: o.connections,
                    warmup,
                    duration,
                    turns_per_session: tps,
                    direct,
                    sync,
                };
                match throughput::run(&env, &label, &p).await {
                    Ok(r) => {
                        print_throughput(&r);
                        results.throughput.push(r);
                    }
                    Err(e) => results.fail(&label, &e),
                }
            }
        }
    }
    if all || matches!(cli.command, Command::Latency) {
        let label = format!("latency-{}", env.storage(primary));
        println!(
            "\n== {label}: open loop at {:.0} req/s over {} connections, {:.0} s",
            rate, o.connections, duration_s
        );
        let p = latency::Params {
            rate,
            warmup,
            duration,
            connections: o.connections,
            turns_per_session: Some(o.turns_per_session),
            sync: primary,
        };
        match latency::run(&env, &label, &p).await {
            Ok(r) => {
                print_latency(&r);
                results.latency = Some(r);
            }
            Err(e) => results.fail(&label, &e),
        }
    }
    if all || matches!(cli.command, Command::Tether) {
        let label = format!("tether-{}", env.storage(primary));
        println!("\n== {label}: {} turns", o.tether_turns);
        let p = tether::Params {
            turns: o.tether_turns,
            connections: o.connections,
            sync: primary,
        };
        match tether::run(&env, &label, &p).await {
            Ok(r) => {
                print_tether(&r);
                results.tether = Some(r);
            }
            Err(e) => results.fail(&label, &e),
        }
    }
    if all || matches!(cli.command, Command::Idle) {
        let label = format!("idle-{}", env.storage(primary));
        println!("\n== {label}: {} idle surfaces", o.surfaces);
        let p = idle::Params {
            surfaces: o.surfaces,
            connections: o.connections,
            settle: Duration::from_secs(2),
            sync: primary,
        };
        match idle::run(&env, &label, &p, fd_limit).await {
            Ok(r) => {
                print_idle(&r);
                results.idle = Some(r);
            }
            Err(e) => results.fail(&label, &e),
        }
    }
    if all || matches!(cli.command, Command::Roaming) {
        let label = format!("roaming-{}", env.storage(primary));
        let iterations = o.iterations.unwrap_or(20);
        println!(
            "\n== {label}: {iterations} x export + import of a {}-message session",
            o.roaming_messages
        );
        let p = roaming::Params {
            messages: o.roaming_messages,
            iterations,
            sync: primary,
        };
        match roaming::run(&env, &label, &p).await {
            Ok(r) => {
                print_roaming(&r);
                results.roaming = Some(r);
            }
            Err(e) => results.fail(&label, &e),
        }
    }
    if all || matches!(cli.command, Command::Toolcall) {
        let label = match o.bus {
            Some(_) => format!("toolcall-{}-replicas", env.storage(primary)),
            None => format!("toolcall-{}", env.storage(primary)),
        };
        let iterations = o.iterations.unwrap_or(5000);
        let p = toolcall::Params {
            iterations,
            // Enough to warm connections, caches and the allocator; not measured.
            warmup: (iterations / 10).clamp(1, 500),
            lanes: o.toolcall_lanes,
            sync: primary,
            bus: o.bus.clone(),
        };
        println!(
            "\n== {label}: {iterations} tool calls on 1 session, then {iterations} on each of {} sessions at once{}",
            p.lanes,
            if p.bus.is_some() {
                " (surfaces on replica A, calls through replica B)"
            } else {
                ""
            }
        );
        match toolcall::run(&env, &label, &p).await {
            Ok(r) => {
                print_toolcall(&r);
                results.toolcall = Some(r);
            }
            Err(e) => results.fail(&label, &e),
        }
    }

    if all || matches!(cli.command, Command::Attach) {
        let stop = match o.iterations {
            Some(n) => attach::Stop::Cycles(n),
            None => attach::Stop::After(duration),
        };
        for &variant in &o.attach_variants {
            let label = format!("attach-{}-{}", variant.as_str(), env.storage(primary));
            let how = match stop {
                attach::Stop::Cycles(n) => format!("{n} cycles per lane"),
                attach::Stop::After(d) => format!("{:.0} s", d.as_secs_f64()),
            };
            println!(
                "\n== {label}: {} lanes over {} sessions, {how}",
                o.attach_lanes, o.attach_sessions
            );
            let p = attach::Params {
                sessions: o.attach_sessions,
                lanes: o.attach_lanes,
                warmup,
                stop,
                variant,
                sync: primary,
            };
            match attach::run(&env, &label, &p).await {
                Ok(r) => {
                    print_attach(&r);
                    results.attach.push(r);
                }
                Err(e) => results.fail(&label, &e),
            }
        }
    }

    results.load_at_end = procs::loadavg();
    results.targets = targets(&results);
    print_targets(&results.targets);
    let path = o.out.join("results.json");
    let text = serde_json::to_string_pretty(&results)?;
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!("\nresults: {}", path.display());
    if !results.errors.is_empty() {
        anyhow::bail!("{} scenario(s) failed", results.errors.len());
    }
    Ok(())
}

async fn wait_quiet(max_secs: u64, threshold: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(max_secs);
    loop {
        let load = procs::loadavg()[0];
        if load < threshold {
            println!("load {load:.2} < {threshold}: starting");
            return;
        }
        if std::time::Instant::now() >= deadline {
            println!("load still {load:.2} after {max_secs} s: starting anyway");
            return;
        }
        println!("load {load:.2} >= {threshold}: waiting 30 s");
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
}

/// `postgres://user:password@host/db` as `postgres://host/db`, for results.json.
fn without_credentials(url: &str) -> String {
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, rest))) => format!("{scheme}://{rest}"),
        _ => url.to_owned(),
    }
}

#[derive(Debug, Serialize)]
struct Results {
    started_unix: u64,
    /// `sqlite` or `postgres`: where the gateway stored.
    storage: &'static str,
    machine: procs::Machine,
    load_at_start: [f64; 3],
    load_at_end: [f64; 3],
    params: Value,
    throughput: Vec<throughput::Report>,
    latency: Option<latency::Report>,
    tether: Option<tether::Report>,
    idle: Option<idle::Report>,
    roaming: Option<roaming::Report>,
    toolcall: Option<toolcall::Report>,
    attach: Vec<attach::Report>,
    errors: Vec<Value>,
    targets: Vec<Target>,
}

impl Results {
    fn fail(&mut self, scenario: &str, e: &anyhow::Error) {
        eprintln!("{scenario} FAILED: {e:#}");
        self.errors
            .push(json!({"scenario": scenario, "error": format!("{e:#}")}));
    }
}

#[derive(Debug, Serialize)]
struct Target {
    name: String,
    target: String,
    measured: String,
    met: bool,
}

fn mib(kib: u64) -> f64 {
    procs::round1(kib as f64 / 1024.0)
}

fn targets(r: &Results) -> Vec<Target> {
    let mut out = Vec::new();
    let gateway_full = |t: &&throughput::Report| t.sync == Sync::Full && t.target == "gateway";
    for t in r.throughput.iter().filter(gateway_full) {
        let shape = match t.turns_per_session {
            None => "one session per connection".to_owned(),
            Some(n) => format!("new session every {n} turns"),
        };
        // Issue 5 holds PostgreSQL to its own bar: durable turns over the network to a server.
        let (storage, bar) = match r.storage {
            "postgres" => ("postgres", 3_000.0),
            _ => ("sync full", 10_000.0),
        };
        out.push(Target {
            name: format!(
                "throughput, {} connections, {shape}, {storage}",
                t.connections
            ),
            target: format!(">= {bar:.0} completions/s"),
            measured: format!(
                "{:.0} completions/s ({} errors)",
                t.completions_per_s, t.errors
            ),
            met: t.completions_per_s >= bar && t.errors == 0,
        });
    }
    if let Some(l) = &r.latency {
        out.push(Target {
            name: format!("added p99 at {:.0} req/s", l.rate),
            target: "<= 1 ms".into(),
            measured: format!(
                "{:.3} ms (direct p99 {:.3}, via gateway {:.3})",
                l.added_p99_ms, l.direct.latency.p99_ms, l.gateway.latency.p99_ms
            ),
            met: l.added_p99_ms <= 1.0 && l.gateway.errors == 0 && l.gateway.dropped == 0,
        });
    }
    for t in r.throughput.iter().filter(gateway_full) {
        let shape = match t.turns_per_session {
            None => "throughput".to_owned(),
            Some(n) => format!("throughput, new session every {n}"),
        };
        out.push(Target {
            name: format!("gateway peak RSS ({shape})"),
            target: "<= 64 MB".into(),
            measured: format!("{:.1} MiB VmHWM", mib(t.gateway_mem_end.hwm_kib)),
            met: t.gateway_mem_end.hwm_kib <= 64 * 1024,
        });
    }
    if let Some(l) = &r.latency {
        out.push(Target {
            name: format!("gateway peak RSS (fixed {:.0} req/s)", l.rate),
            target: "<= 64 MB".into(),
            measured: format!("{:.1} MiB VmHWM", mib(l.gateway_mem_end.hwm_kib)),
            met: l.gateway_mem_end.hwm_kib <= 64 * 1024,
        });
    }
    if let Some(t) = &r.tether {
        out.push(Target {
            name: format!("tether drain, {} turns", t.turns),
            target: ">= 50000 turns/s".into(),
            measured: format!(
                "{:.0} turns/s (in order: {}, complete: {})",
                t.drain_turns_per_s, t.in_order, t.all_contents_once
            ),
            met: t.drain_turns_per_s >= 50_000.0 && t.in_order && t.all_contents_once,
        });
    }
    if let Some(i) = &r.idle {
        out.push(Target {
            name: format!("{} idle attached surfaces", i.surfaces),
            target: "<= 100 MB gateway RSS".into(),
            measured: format!(
                "{:.1} MiB total ({:.1} MiB for the surfaces, {:.1} KiB each; {} attached)",
                mib(i.rss_after_kib),
                mib(i.rss_delta_kib),
                i.per_surface_kib,
                i.attached
            ),
            met: i.rss_after_kib <= 100 * 1024 && i.attached == i.surfaces,
        });
    }
    if let Some(r) = &r.roaming {
        out.push(Target {
            name: format!(
                "roaming export + import, {}-message session",
                r.session_messages
            ),
            target: "<= 200 ms".into(),
            measured: format!(
                "p50 {:.1} ms, p95 {:.1} ms, max {:.1} ms (export p50 {:.1}, import p50 {:.1}; n={})",
                r.pair.p50_ms,
                r.pair.p95_ms,
                r.pair.max_ms,
                r.export.p50_ms,
                r.import.p50_ms,
                r.iterations
            ),
            // Held to p95: nearly every roam must fit, not just the typical one.
            met: r.pair.p95_ms <= 200.0,
        });
    }
    if let Some(t) = r.toolcall.as_ref().filter(|t| t.mode == "cross-replica") {
        let l = &t.latency;
        out.push(Target {
            name: "cross-replica TOOL_CALL round trip p99 (1 session; surface on A, call via B)"
                .into(),
            target: "<= 3 ms (end-to-end - surface hold, and gateway-added)".into(),
            measured: format!(
                "e2e - hold p99 {:.3} ms, gateway-added p99 {:.3} ms (p50 {:.3} / {:.3}; healthz p99 {:.3}, ws echo p99 {:.3}, bus relay p99 {:.3}; {} errors, {} at {} sessions)",
                l.net.p99_ms,
                l.gateway_added.p99_ms,
                l.net.p50_ms,
                l.gateway_added.p50_ms,
                l.healthz.p99_ms,
                l.ws_echo.p99_ms,
                l.bus_relay.map_or(0.0, |s| s.p99_ms),
                l.errors,
                t.throughput.errors,
                t.throughput.lanes
            ),
            met: l.net.p99_ms <= 3.0
                && l.gateway_added.p99_ms <= 3.0
                && l.errors == 0
                && t.throughput.errors == 0,
        });
    } else if let Some(t) = &r.toolcall {
        let l = &t.latency;
        out.push(Target {
            name: "L5 TOOL_CALL round trip, gateway-added p99 (1 session)".into(),
            target: "<= 1 ms".into(),
            measured: format!(
                "{:.3} ms (p50 {:.3}; end-to-end p99 {:.3}, healthz p99 {:.3}, ws echo p99 {:.3}; {} errors, {} at {} sessions)",
                l.gateway_added.p99_ms,
                l.gateway_added.p50_ms,
                l.end_to_end.p99_ms,
                l.healthz.p99_ms,
                l.ws_echo.p99_ms,
                l.errors,
                t.throughput.errors,
                t.throughput.lanes
            ),
            met: l.gateway_added.p99_ms <= 1.0 && l.errors == 0 && t.throughput.errors == 0,
        });
    }
    for a in r
        .attach
        .iter()
        .filter(|a| a.variant == attach::Variant::Plain)
    {
        out.push(Target {
            name: format!(
                "attach + detach through the SDK, {} lanes over {} sessions",
                a.lanes, a.sessions
            ),
            target: ">= 5000 cycles/s".into(),
            measured: format!(
                "{:.0} cycles/s (attach p50 {:.3} ms, cycle p99 {:.3} ms; {} errors; state check {})",
                a.cycles_per_s,
                a.attach.p50_ms,
                a.cycle.p99_ms,
                a.errors,
                if a.check.ok { "ok" } else { "FAILED" }
            ),
            met: a.cycles_per_s >= 5000.0 && a.errors == 0 && a.check.ok,
        });
    }
    out
}

/// "sbp.db 12.0 MiB, sbp.db-wal 3.9 MiB": the database files, without the tiny ones.
fn data_files(files: &std::collections::BTreeMap<String, u64>) -> String {
    let parts: Vec<String> = files
        .iter()
        .filter(|(name, _)| name.contains(".db"))
        .map(|(name, len)| format!("{name} {:.1} MiB", mib(len / 1024)))
        .collect();
    parts.join(", ")
}

fn print_cpu(cpu: &procs::CpuUse) {
    let procs: Vec<String> = cpu
        .process_pct
        .iter()
        .map(|(k, v)| format!("{k} {v:.0}%"))
        .collect();
    println!(
        "  cpu (% of one core): {}, other processes {:.0}%; machine busy {:.0}% (steal {:.1}%)",
        procs.join(", "),
        cpu.others_pct,
        cpu.machine_busy_pct,
        cpu.machine_steal_pct
    );
    for (name, threads) in &cpu.thread_pct {
        if !name.starts_with("gateway") {
            continue;
        }
        let t: Vec<String> = threads
            .iter()
            .map(|(k, v)| format!("{k} {v:.0}%"))
            .collect();
        println!("  {name} threads: {}", t.join(", "));
    }
}

fn print_throughput(r: &throughput::Report) {
    println!(
        "  {:.0} completions/s, {} completions, {} errors, {} sessions",
        r.completions_per_s, r.completions, r.errors, r.sessions_started
    );
    if let Some(e) = &r.first_error {
        println!("  first error: {e}");
    }
    println!("  latency: {}", r.latency);
    if r.target == "gateway" {
        println!(
            "  gateway CPU per completion: {:.3} ms",
            r.gateway_cpu_ms_per_completion
        );
    }
    println!(
        "  gateway RSS: peak {:.1} MiB (VmHWM), {:.1} MiB at end; data {}; sessions verified {} (mismatched {})",
        mib(r.gateway_mem_end.hwm_kib),
        mib(r.gateway_mem_end.rss_kib),
        data_files(&r.data_files),
        r.sessions_verified,
        r.sessions_mismatched
    );
    print_cpu(&r.cpu);
}

fn print_latency(r: &latency::Report) {
    for (name, p) in [("direct ", &r.direct), ("gateway", &r.gateway)] {
        println!(
            "  {name}: {}  [{} ok, {} errors, {} dropped, {:.0} req/s]",
            p.latency, p.ok, p.errors, p.dropped, p.achieved_rate
        );
        println!("           service time {}", p.service);
        println!(
            "           send lag p50 {:.3} ms p99 {:.3} ms; gateway CPU per request {:.3} ms",
            p.send_lag.p50_ms, p.send_lag.p99_ms, p.gateway_cpu_ms_per_completion
        );
        if let Some(e) = &p.first_error {
            println!("  first error: {e}");
        }
    }
    println!(
        "  added: p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms",
        r.added_p50_ms, r.added_p90_ms, r.added_p99_ms
    );
    println!(
        "  gateway RSS: peak {:.1} MiB (VmHWM), {:.1} MiB at end; data {}",
        mib(r.gateway_mem_end.hwm_kib),
        mib(r.gateway_mem_end.rss_kib),
        data_files(&r.data_files)
    );
    print_cpu(&r.gateway.cpu);
}

fn print_tether(r: &tether::Report) {
    println!(
        "  push: {} turns in {:.2} s = {:.0} turns/s; latency {}",
        r.turns, r.push_s, r.push_turns_per_s, r.push_latency
    );
    println!(
        "  drain: {} of {} queued in {:.3} s = {:.0} turns/s (SESSION_ATTACHED after {:.1} ms); in order {}, complete {}, pending after {}",
        r.received,
        r.queued_turns,
        r.drain_s,
        r.drain_turns_per_s,
        r.attached_ms,
        r.in_order,
        r.all_contents_once,
        r.pending_after_drain
    );
    print_cpu(&r.drain_cpu);
}

fn print_idle(r: &idle::Report) {
    println!(
        "  {} sessions in {:.2} s ({:.0}/s); {} of {} attached in {:.2} s ({:.0}/s)",
        r.surfaces,
        r.create_s,
        r.sessions_per_s,
        r.attached,
        r.surfaces,
        r.attach_s,
        r.attaches_per_s
    );
    if let Some(e) = &r.first_error {
        println!("  first error: {e}");
    }
    println!(
        "  gateway RSS: {:.1} MiB at start, {:.1} MiB before attaching, {:.1} MiB attached: +{:.1} MiB, {:.1} KiB per surface",
        mib(r.rss_start_kib),
        mib(r.rss_before_kib),
        mib(r.rss_after_kib),
        mib(r.rss_delta_kib),
        r.per_surface_kib
    );
}

fn print_roaming(r: &roaming::Report) {
    println!(
        "  seed: raw bundle of {} messages, {} bytes canonical, imported in {:.1} ms; session holds {}",
        r.bundle_messages, r.bundle_bytes, r.seed_import_ms, r.session_messages
    );
    println!(
        "  {:<14} {:>9} {:>9} {:>9}",
        "", "p50 ms", "p95 ms", "max ms"
    );
    for (name, e) in [
        ("export", &r.export),
        ("import", &r.import),
        ("export+import", &r.pair),
    ] {
        println!(
            "  {name:<14} {:>9.1} {:>9.1} {:>9.1}",
            e.p50_ms, e.p95_ms, e.max_ms
        );
    }
    println!(
        "  gateway CPU per pair {:.1} ms; RSS peak {:.1} MiB (VmHWM); data {}",
        r.gateway_cpu_ms_per_pair,
        mib(r.gateway_mem_end.hwm_kib),
        data_files(&r.data_files)
    );
    println!(
        "  exported bundle {} bytes canonical (CID verified); consumed token re-imported: {}",
        r.export_bundle_bytes, r.reimport_refused
    );
    print_cpu(&r.cpu);
}

fn print_toolcall(r: &toolcall::Report) {
    let l = &r.latency;
    let cross = r.mode == "cross-replica";
    println!(
        "  1 session: {} calls, {} errors (warm-up {} calls){}",
        l.calls,
        l.errors,
        r.warmup,
        if cross {
            "; surface on replica A, calls through replica B"
        } else {
            ""
        }
    );
    if let Some(e) = &l.first_error {
        println!("  first error: {e}");
    }
    for (name, s) in [
        ("end-to-end  ", Some(&l.end_to_end)),
        ("surface hold", Some(&l.surface_hold)),
        ("e2e - hold  ", Some(&l.net)),
        ("healthz     ", Some(&l.healthz)),
        ("ws echo     ", Some(&l.ws_echo)),
        ("redis PING  ", l.redis_ping.as_ref()),
        ("bus relay   ", l.bus_relay.as_ref()),
        ("no surface  ", l.unattached_call.as_ref()),
    ] {
        if let Some(s) = s {
            println!("  {name} {s}");
        }
    }
    let (quantile_wise, vs_medians) = if cross {
        (
            "gateway-added, cross-replica (quantile-wise)    ",
            "gateway-added, cross-replica (vs floor medians) ",
        )
    } else {
        (
            "gateway-added (quantile-wise)     ",
            "gateway-added (vs floor medians)  ",
        )
    };
    for (name, a) in [
        (quantile_wise, &l.gateway_added),
        (vs_medians, &l.gateway_added_vs_floor_medians),
    ] {
        println!(
            "  {name} p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
            a.p50_ms, a.p90_ms, a.p99_ms, a.max_ms
        );
    }
    println!(
        "  gateway's sbp_tool_call_latency_seconds: {}",
        l.gateway_metric
    );
    println!(
        "  gateway CPU per call (healthz included{}) {:.3} ms{}",
        if cross { ", both replicas" } else { "" },
        l.gateway_cpu_ms_per_call,
        l.redis_cpu_ms_per_call
            .map(|ms| format!("; redis-server {ms:.3} ms (floors included)"))
            .unwrap_or_default()
    );
    print_cpu(&l.cpu);
    let t = &r.throughput;
    println!(
        "  {} sessions: {:.0} calls/s ({} calls in {:.2} s, {} errors); gateway CPU per call {:.3} ms{}",
        t.lanes,
        t.calls_per_s,
        t.calls,
        t.seconds,
        t.errors,
        t.gateway_cpu_ms_per_call,
        t.redis_cpu_ms_per_call
            .map(|ms| format!("; redis-server {ms:.3} ms"))
            .unwrap_or_default()
    );
    if let Some(redis) = &t.redis {
        println!("  redis: {redis}");
    }
    if let Some(e) = &t.first_error {
        println!("  first error: {e}");
    }
    println!("  end-to-end   {}", t.end_to_end);
    println!("  surface hold {}", t.surface_hold);
    println!(
        "  gateway's sbp_tool_call_latency_seconds: {}",
        t.gateway_metric
    );
    print_cpu(&t.cpu);
    match (&r.replica_mem_end, &r.redis_mem_end) {
        (None, _) => println!(
            "  gateway RSS: peak {:.1} MiB (VmHWM)",
            mib(r.gateway_mem_end.hwm_kib)
        ),
        (Some(b), redis) => println!(
            "  RSS peak (VmHWM): replica A {:.1} MiB, replica B {:.1} MiB{}",
            mib(r.gateway_mem_end.hwm_kib),
            mib(b.hwm_kib),
            redis
                .map(|m| format!("; redis-server now {:.1} MiB", mib(m.rss_kib)))
                .unwrap_or_default()
        ),
    }
}

fn print_attach(r: &attach::Report) {
    println!(
        "  {:.0} cycles/s: {} cycles in {:.2} s, {} errors (warm-up {} cycles)",
        r.cycles_per_s, r.cycles, r.seconds, r.errors, r.warmup_cycles
    );
    if let Some(e) = &r.first_error {
        println!("  first error: {e}");
    }
    println!("  attach {}", r.attach);
    println!("  close  {}", r.close);
    println!("  cycle  {}", r.cycle);
    if let Some(d) = &r.drain {
        println!("  drain  {d}");
    }
    if let Some(p) = &r.push {
        println!("  push   {p}");
    }
    println!(
        "  CPU per cycle: gateway {:.3} ms, bench (SDK) {:.3} ms; gateway RSS peak {:.1} MiB (VmHWM), {:.1} MiB sampled{}",
        r.gateway_cpu_ms_per_cycle,
        r.bench_cpu_ms_per_cycle,
        mib(r.gateway_mem_end.hwm_kib),
        mib(r.gateway_rss_peak_sampled_kib),
        // Nothing in the data directory on PostgreSQL.
        match data_files(&r.data_files) {
            d if d.is_empty() => String::new(),
            d => format!("; data {d}"),
        }
    );
    print_cpu(&r.cpu);
    let c = &r.check;
    let by_status: Vec<String> = c
        .sessions_by_status
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!(
        "  check {}: attached surfaces {}, sessions {} ({} attached, {} never), wrong status {}, showing a surface {}, tether pending {} (depth {}); ws connections {} of {} connects; settled in {:.0} ms",
        if c.ok { "ok" } else { "FAILED" },
        c.attached_surfaces,
        by_status.join(", "),
        c.sessions_attached,
        c.sessions_never_attached,
        c.wrong_status,
        c.surface_attached,
        c.tether_pending,
        c.tether_depth,
        c.ws_connections,
        c.connects_attempted,
        c.settle_ms
    );
    for e in &c.examples {
        println!("    {e}");
    }
}

fn print_targets(targets: &[Target]) {
    println!("\n== targets");
    for t in targets {
        println!(
            "  [{}] {}: {} (target {})",
            if t.met { "met " } else { "MISS" },
            t.name,
            t.measured,
            t.target
        );
    }
}
