//! `sbp-soak storm`: the gateway under mixed load (chained completions with `Idempotency-Key`,
//! pushed turns, surfaces attaching with `last_seq` and ACKing) is killed with SIGKILL at random
//! moments and started again on the same data, N times; then, after one more kill with the load
//! stopped, every session's transcript and every surface's deliveries are checked against what
//! the gateway acknowledged: 0 lost, 0 duplicated, 0 reordered (see `check.rs`).

mod check;
mod lane;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::procs::{self, Env, GatewaySpec, Proc, Schema};
use crate::rng::Rng;
use check::{Expect, Mark, Part, Tally, check, mark_of, surface_turns};
use lane::{Ctx, Endpoint, Kind, Lane, SessionLog};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backends {
    Sqlite,
    Postgres,
    Both,
}

#[derive(Debug, clap::Args)]
pub struct StormArgs {
    /// The storage the gateway runs on: SQLite (`--sqlite-synchronous full`), PostgreSQL (a
    /// fresh schema of --database), or one after the other.
    #[arg(long, value_enum, default_value = "both")]
    pub backend: Backends,
    /// Kills under load on SQLite.
    #[arg(long, default_value_t = 30)]
    pub kills_sqlite: u32,
    /// Kills under load on PostgreSQL.
    #[arg(long, default_value_t = 15)]
    pub kills_postgres: u32,
    /// Lanes of chained completions, each session created by its first completion.
    #[arg(long, default_value_t = 3)]
    pub completion_lanes: usize,
    /// Lanes whose sessions have a surface attached: pushes and completions mixed.
    #[arg(long, default_value_t = 3)]
    pub surface_lanes: usize,
    /// Items per session before a lane starts a new one (keeps transcripts, and so each
    /// turn's cost, bounded).
    #[arg(long, default_value_t = 150)]
    pub turns_per_session: u32,
    /// Shortest time between a restart and the next kill, in ms.
    #[arg(long, default_value_t = 700)]
    pub min_interval_ms: u64,
    /// Longest time between a restart and the next kill, in ms.
    #[arg(long, default_value_t = 2500)]
    pub max_interval_ms: u64,
    /// Seed of the kill moments and of the load's choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
        }
    }
}

/// Runs the storm on the chosen backends; `Ok(true)` when every one passed.
pub async fn run(
    env: &Env,
    args: &StormArgs,
    database: &str,
    gateway_args: &[String],
) -> anyhow::Result<bool> {
    let backends: &[Backend] = match args.backend {
        Backends::Sqlite => &[Backend::Sqlite],
        Backends::Postgres => &[Backend::Postgres],
        Backends::Both => &[Backend::Sqlite, Backend::Postgres],
    };
    let mut pass = true;
    let mut lines = Vec::new();
    for &backend in backends {
        let kills = match backend {
            Backend::Sqlite => args.kills_sqlite,
            Backend::Postgres => args.kills_postgres,
        };
        println!("storm {}: {kills} kills under load", backend.name());
        match run_backend(env, args, backend, kills, database, gateway_args).await {
            Ok(report) => {
                report.print_details();
                pass &= report.pass();
                lines.push(report.line());
            }
            Err(e) => {
                pass = false;
                lines.push(format!("storm {}: ERROR {e:#}", backend.name()));
            }
        }
    }
    println!();
    for l in lines {
        println!("{l}");
    }
    Ok(pass)
}

struct Report {
    backend: Backend,
    kills: u32,
    seconds: f64,
    sessions: usize,
    completions_acked: usize,
    pushes_acked: usize,
    not_acked: usize,
    retried: usize,
    replayed: usize,
    rate_limited: u64,
    min_acked_between_kills: u64,
    transcript: Tally,
    surface: Tally,
    surface_turns: usize,
    surface_redelivered: usize,
    tether_left: u64,
    anomalies: Vec<String>,
    server_errors: Vec<String>,
    panics: Vec<String>,
}

impl Report {
    fn pass(&self) -> bool {
        self.transcript.clean()
            && self.surface.clean()
            && self.tether_left == 0
            && self.anomalies.is_empty()
            && self.panics.is_empty()
    }

    fn line(&self) -> String {
        let t = &self.transcript;
        let s = &self.surface;
        format!(
            "storm {}: {} kills {} (+1 before the check), {} sessions, turns acknowledged {} \
             (completions {}, pushes {}; retried {}, replayed {}, never acknowledged {}, 429s {}), \
             transcripts: lost {} duplicated {} reordered {} corrupted {}; surfaces: {} turns \
             ({} redelivered) lost {} duplicated {} reordered {} corrupted {}; tether left {}; \
             anomalies {}; 5xx {}; {:.0} s",
            self.backend.name(),
            if self.pass() { "PASS" } else { "FAIL" },
            self.kills,
            self.sessions,
            self.completions_acked + self.pushes_acked,
            self.completions_acked,
            self.pushes_acked,
            self.retried,
            self.replayed,
            self.not_acked,
            self.rate_limited,
            t.lost,
            t.duplicated,
            t.reordered,
            t.corrupted,
            self.surface_turns,
            self.surface_redelivered,
            s.lost,
            s.duplicated,
            s.reordered,
            s.corrupted,
            self.tether_left,
            self.anomalies.len(),
            self.server_errors.len(),
            self.seconds,
        )
    }

    fn print_details(&self) {
        println!(
            "  fewest turns acknowledged between two kills: {}",
            self.min_acked_between_kills
        );
        for (what, list) in [
            ("transcripts", &self.transcript.examples),
            ("surfaces", &self.surface.examples),
            ("anomalies", &self.anomalies),
            ("5xx answers (retried)", &self.server_errors),
            ("panics in the gateway log", &self.panics),
        ] {
            if list.is_empty() {
                continue;
            }
            println!("  {what}:");
            for e in list.iter().take(12) {
                println!("    {e}");
            }
            if list.len() > 12 {
                println!("    ... and {} more", list.len() - 12);
            }
        }
    }
}

async fn run_backend(
    env: &Env,
    args: &StormArgs,
    backend: Backend,
    kills: u32,
    database: &str,
    gateway_args: &[String],
) -> anyhow::Result<Report> {
    let started = Instant::now();
    let label = format!("storm-{}", backend.name());
    let data_dir = env.out_dir.join(format!("{label}-data"));
    if data_dir.exists() {
        std::fs::remove_dir_all(&data_dir)
            .with_context(|| format!("removing {}", data_dir.display()))?;
    }
    std::fs::create_dir_all(&data_dir)?;
    let gateway_log = env.log(&format!("{label}-gateway.log"));
    let _ = std::fs::remove_file(&gateway_log);
    let fake = procs::start_fake(env, &format!("{label}-fake.log")).await?;
    let schema = match backend {
        Backend::Postgres => Some(Schema::create(database).await?),
        Backend::Sqlite => None,
    };
    let spec = GatewaySpec {
        data_dir: data_dir.clone(),
        database: schema.as_ref().map(Schema::url),
        upstream: format!("http://{}/v1", fake.addr),
        soft_nofile: None,
        extra_args: storm_gateway_args(gateway_args),
    };
    let log_name = format!("{label}-gateway.log");
    let gateway = procs::start_gateway(env, &spec, &log_name).await?;
    println!(
        "  gateway pid {} on {}, data {}{}; log {}",
        gateway.pid,
        gateway.addr,
        data_dir.display(),
        schema
            .as_ref()
            .map(|s| format!(", schema {}", s.name))
            .unwrap_or_default(),
        gateway_log.display()
    );
    let result = storm(env, args, backend, kills, &spec, &log_name, gateway).await;
    fake.stop().await;
    if let Some(s) = schema {
        s.drop_now().await?;
    }
    let mut report = result?;
    report.seconds = started.elapsed().as_secs_f64();
    report.panics = procs::panics_in(&gateway_log);
    if report.pass() {
        let _ = std::fs::remove_dir_all(&data_dir);
    }
    Ok(report)
}

async fn storm(
    env: &Env,
    args: &StormArgs,
    backend: Backend,
    kills: u32,
    spec: &GatewaySpec,
    log_name: &str,
    mut gateway: Proc,
) -> anyhow::Result<Report> {
    let salt = match backend {
        Backend::Sqlite => 0x5a,
        Backend::Postgres => 0x9e,
    };
    let mut rng = Rng::new(args.seed ^ salt);
    let mut generation = 0;
    let (live_tx, live_rx) = watch::channel(Some(Endpoint {
        addr: gateway.addr,
        generation,
    }));
    let (stop_tx, stop_rx) = watch::channel(false);
    let acked = Arc::new(AtomicU64::new(0));
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let ctx = Ctx {
        http: http.clone(),
        live: live_rx,
        stop: stop_rx,
        anomalies: Arc::new(Mutex::new(Vec::new())),
        server_errors: Arc::new(Mutex::new(Vec::new())),
        acked: acked.clone(),
        rate_limited: Arc::new(AtomicU64::new(0)),
    };
    let mut lanes = Vec::new();
    for i in 0..args.completion_lanes + args.surface_lanes {
        let surface = i >= args.completion_lanes;
        let lane = Lane {
            name: format!("{}{i}", if surface { "s" } else { "c" }),
            surface,
            turns_per_session: args.turns_per_session.max(1),
            rng: Rng::new(rng.next_u64()),
        };
        lanes.push(tokio::spawn(lane.run(ctx.clone())));
    }

    let mut min_between = u64::MAX;
    let mut last = 0;
    for k in 1..=kills {
        let wait = rng.range(
            args.min_interval_ms,
            args.max_interval_ms.max(args.min_interval_ms),
        );
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let now = acked.load(Ordering::Relaxed);
        min_between = min_between.min(now - last);
        last = now;
        live_tx.send_replace(None);
        gateway.kill9().await.context("a kill under load")?;
        gateway = procs::start_gateway(env, spec, log_name)
            .await
            .with_context(|| format!("restarting after kill {k}"))?;
        generation += 1;
        live_tx.send_replace(Some(Endpoint {
            addr: gateway.addr,
            generation,
        }));
        println!(
            "  kill {k}/{kills} after {wait} ms; {now} turns acknowledged so far; back on {}",
            gateway.addr
        );
    }
    // The load runs a little on the last start, then stops; lanes finish the item in hand.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send_replace(true);
    let mut logs: Vec<SessionLog> = Vec::new();
    for lane in lanes {
        match tokio::time::timeout(Duration::from_secs(180), lane).await {
            Ok(Ok(l)) => logs.extend(l),
            Ok(Err(e)) => bail!("a lane failed: {e}"),
            Err(_) => bail!("a lane did not finish within 180 s of the stop"),
        }
    }
    // What is checked must have survived a kill too.
    live_tx.send_replace(None);
    gateway.kill9().await.context("the kill before the check")?;
    let gateway = procs::start_gateway(env, spec, log_name)
        .await
        .context("restarting for the check")?;
    println!(
        "  load stopped; killed once more; checking on {}",
        gateway.addr
    );
    let anomalies = std::mem::take(
        &mut *ctx
            .anomalies
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?,
    );
    let server_errors = std::mem::take(
        &mut *ctx
            .server_errors
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?,
    );
    let mut report = Report {
        backend,
        kills,
        seconds: 0.0,
        sessions: logs.iter().filter(|l| !l.id.is_empty()).count(),
        completions_acked: 0,
        pushes_acked: 0,
        not_acked: 0,
        retried: 0,
        replayed: 0,
        rate_limited: ctx.rate_limited.load(Ordering::Relaxed),
        min_acked_between_kills: if kills == 0 { 0 } else { min_between },
        transcript: Tally::default(),
        surface: Tally::default(),
        surface_turns: 0,
        surface_redelivered: 0,
        tether_left: 0,
        anomalies,
        server_errors,
        panics: Vec::new(),
    };
    for log in &logs {
        for i in &log.items {
            match (i.acked, i.kind) {
                (true, Kind::Completion) => report.completions_acked += 1,
                (true, Kind::Push) => report.pushes_acked += 1,
                (false, _) => report.not_acked += 1,
            }
            report.retried += usize::from(i.attempts > 1);
            report.replayed += usize::from(i.replayed);
        }
        if log.id.is_empty() {
            continue;
        }
        verify(&http, gateway.addr, log, &mut report).await?;
    }
    gateway.stop().await;
    Ok(report)
}

/// Checks one session: its transcript, and for a surface lane what its surface got (plus a
/// final drain) and that nothing is left in its tether.
async fn verify(
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    log: &SessionLog,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut expected = Vec::new();
    let mut on_surface = Vec::new();
    for i in &log.items {
        let mark = |part| Mark {
            tag: i.tag.clone(),
            part,
        };
        let sent = format!(
            "{} sent {} time{} with one Idempotency-Key{}",
            match i.kind {
                Kind::Completion => "completion",
                Kind::Push => "push",
            },
            i.attempts,
            if i.attempts == 1 { "" } else { "s" },
            if i.replayed {
                ", answered by a replay"
            } else {
                ""
            }
        );
        match i.kind {
            Kind::Completion => {
                let reply = format!("echo: {}", i.text);
                expected.push(Expect {
                    mark: mark(Part::Ask),
                    content: i.text.clone(),
                    acked: i.acked,
                    sent: sent.clone(),
                });
                expected.push(Expect {
                    mark: mark(Part::Reply),
                    content: reply.clone(),
                    acked: i.acked,
                    sent: sent.clone(),
                });
                on_surface.push(Expect {
                    mark: mark(Part::Reply),
                    content: reply,
                    acked: i.acked,
                    sent,
                });
            }
            Kind::Push => {
                let e = Expect {
                    mark: mark(Part::Push),
                    content: i.text.clone(),
                    acked: i.acked,
                    sent,
                };
                expected.push(e.clone());
                on_surface.push(e);
            }
        }
    }
    let found = transcript(http, addr, log).await?;
    report.transcript.add(check(
        &format!("{} transcript", log.name),
        &expected,
        &found,
    ));

    let Some(surface) = &log.surface else {
        return Ok(());
    };
    let mut deliveries = surface.deliveries.clone();
    match lane::final_drain(addr, log).await {
        Ok(more) => deliveries.extend(more),
        Err(e) => report
            .anomalies
            .push(format!("{}: final drain failed: {e}", log.name)),
    }
    let what = format!("{} surface", log.name);
    let (distinct, mut tally) = surface_turns(&what, &deliveries);
    report.surface_turns += distinct.len();
    report.surface_redelivered += deliveries.len() - distinct.len();
    let found: Vec<(Option<Mark>, String)> = distinct
        .iter()
        .map(|(_, text)| (mark_of("assistant", text), text.clone()))
        .collect();
    tally.add(check(&what, &on_surface, &found));
    // A push's answer named its seq: the surface must have had that push at that seq.
    for i in log.items.iter().filter(|i| i.kind == Kind::Push) {
        let Some(seq) = i.push_seq else { continue };
        if let Some((_, text)) = distinct.iter().find(|(s, _)| *s == seq)
            && *text != i.text
        {
            tally.corrupted += 1;
            tally.examples.push(format!(
                "{what}: push {} was answered seq {seq}, which carried {text:?}",
                i.tag
            ));
        }
    }
    report.surface.add(tally);
    let view = get_json(http, addr, &format!("/v1/sessions/{}", log.id), &log.token).await?;
    let left = view["tether_turns_pending"].as_u64().unwrap_or(0);
    if left > 0 {
        report.anomalies.push(format!(
            "{}: {left} turns still in the tether after the final drain",
            log.name
        ));
    }
    report.tether_left += left;
    Ok(())
}

async fn get_json(
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    path: &str,
    token: &str,
) -> anyhow::Result<Value> {
    let resp = http
        .get(format!("http://{addr}{path}"))
        .header("x-session-token", token)
        .send()
        .await
        .with_context(|| format!("GET {path}"))?;
    let status = resp.status();
    let body: Value = resp.json().await.with_context(|| format!("GET {path}"))?;
    if !status.is_success() {
        bail!("GET {path}: {status} {body}");
    }
    Ok(body)
}

/// The whole transcript, page by page: `(mark, text)` per message.
async fn transcript(
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    log: &SessionLog,
) -> anyhow::Result<Vec<(Option<Mark>, String)>> {
    let mut out = Vec::new();
    let mut after: Option<u64> = None;
    loop {
        let mut path = format!("/v1/sessions/{}/messages?limit=1000", log.id);
        if let Some(a) = after {
            path.push_str(&format!("&after={a}"));
        }
        let page = get_json(http, addr, &path, &log.token).await?;
        for m in page["messages"].as_array().into_iter().flatten() {
            let role = m["role"].as_str().unwrap_or_default();
            let text = match &m["content"] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push((mark_of(role, &text), text));
        }
        match (page["has_more"].as_bool(), page["next_after"].as_u64()) {
            (Some(true), Some(next)) => after = Some(next),
            _ => return Ok(out),
        }
    }
}

/// The storm measures durability under as much load as the machine gives, all of it from one
/// loopback address: the per-address and per-session buckets would cap it at a few hundred turns
/// a second, so they are off unless `--gateway-arg` sets them (the lanes still wait out and retry
/// any 429, as a client should).
fn storm_gateway_args(given: &[String]) -> Vec<String> {
    let mut args = Vec::new();
    for flag in ["--rate-limit-ip", "--rate-limit-session"] {
        if !given.iter().any(|a| a.starts_with(flag)) {
            args.extend([flag.to_owned(), "0".to_owned()]);
        }
    }
    args.extend(given.iter().cloned());
    args
}
