//! The processes under test (the fake upstream and the gateway, started from their release
//! binaries and always killed), and what /proc says about them: memory, CPU time per process
//! and per thread, machine load.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
pub use sbp_test_support::procs::pg_exec;
use sbp_test_support::procs::{Listening, spawn_listening, tail};
use serde::Serialize;
use tokio::process::{Child, Command};

use crate::bus::BusKeys;

/// Where the binaries and logs are, and how the gateway is configured.
#[derive(Debug, Clone)]
pub struct Env {
    pub bin_dir: PathBuf,
    pub log_dir: PathBuf,
    pub data_root: PathBuf,
    /// PostgreSQL base URL (`postgres://user@host:port/db`): the gateway stores there, in a fresh
    /// schema per start, instead of in SQLite.
    pub database: Option<String>,
    /// Key file for `--encryption-key`: the gateway seals its stored content.
    pub encryption_key: Option<PathBuf>,
}

impl Env {
    /// What the gateway stores on, for labels: `full` / `normal` (SQLite) or `pg`.
    pub fn storage(&self, sync: Sync) -> &'static str {
        match self.database {
            Some(_) => "pg",
            None => sync.as_str(),
        }
    }
}

/// A started child process that prints `... listening on http://ADDR...` on stdout, or (a peer
/// gateway) one told where to listen, in a process group of its own.
pub struct Service {
    pub name: String,
    pub pid: u32,
    pub addr: SocketAddr,
    pub log: PathBuf,
    child: Child,
    /// Its process group is its own (pgid = pid) and is killed whole: a master's workers, a
    /// launcher's runtime. Cleared once killed.
    group: bool,
}

impl Service {
    async fn spawn(name: &str, cmd: Command, log: PathBuf) -> anyhow::Result<Self> {
        let log_file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let Listening { child, pid, addr } = spawn_listening(name, cmd, log_file, &log).await?;
        Ok(Self {
            name: name.to_owned(),
            pid,
            addr,
            log,
            child,
            group: false,
        })
    }

    /// Starts `cmd`, which listens on `addr` (chosen by the caller) without saying so, with
    /// stdout and stderr to `log`, as the leader of a new process group so that stopping it stops
    /// the processes it starts too. Whether it answers yet is for the caller to check.
    pub fn spawn_group(
        name: &str,
        mut cmd: Command,
        log: PathBuf,
        addr: SocketAddr,
    ) -> anyhow::Result<Self> {
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        let pid = child
            .id()
            .with_context(|| format!("{name} exited at once"))?;
        Ok(Self {
            name: name.to_owned(),
            pid,
            addr,
            log,
            child,
            group: true,
        })
    }

    /// Kills the process (SIGKILL; with its group, every member) and reaps it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if self.group {
            self.group = false;
            // Even when the leader has exited: its workers may live on.
            kill_group(self.pid);
        }
        if self.child.try_wait()?.is_none() {
            self.child
                .start_kill()
                .with_context(|| format!("killing {}", self.name))?;
        }
        self.child.wait().await?;
        Ok(())
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited during the run ({status}); log {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log)
            );
        }
        Ok(())
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // kill_on_drop reaches the leader only; an error path or Ctrl-C must not leave its
        // workers listening.
        if self.group {
            kill_group(self.pid);
        }
    }
}

/// SIGKILL to every process of the group whose leader is `pid` (a group this bench made).
fn kill_group(pid: u32) {
    // `kill` the command: sending a signal from Rust takes `unsafe` or another dependency.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .stderr(std::process::Stdio::null())
        .status();
}

/// SQLite durability of the gateway under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Sync {
    Full,
    Normal,
}

impl Sync {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Normal => "normal",
        }
    }
}

/// A fake upstream and a gateway in front of it, with the gateway's fresh data directory (and,
/// on PostgreSQL, its fresh schema). With a replica bus, a second gateway (replica B) on the same
/// schema and upstream, joined to the first (replica A) through Redis.
pub struct Stack {
    pub fake: Service,
    pub gateway: Service,
    /// Deleted (with the database) on drop.
    data: tempfile::TempDir,
    /// Dropped (with every table in it) on stop, or on drop.
    schema: Option<Schema>,
    /// Replica B, when the stack runs on a bus.
    pub replica: Option<Replica>,
}

/// The second gateway of a two-replica stack, and the bus both replicas joined.
pub struct Replica {
    pub gateway: Service,
    /// Its own data directory (the signing secret is passed, so nothing is shared there).
    _data: tempfile::TempDir,
    pub bus: BusKeys,
}

/// A schema made for one gateway run on PostgreSQL. [`Schema::drop_now`] removes it; dropping
/// the value without that removes it too, from a short-lived thread (an error path or Ctrl-C).
pub struct Schema {
    base: String,
    pub name: String,
    dropped: bool,
}

impl Schema {
    /// Creates `sbp_bench_<pid>_<n>` on `base`.
    pub async fn create(base: &str) -> anyhow::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "sbp_bench_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        pg_exec(base, &format!("CREATE SCHEMA {name}")).await?;
        Ok(Self {
            base: base.to_owned(),
            name,
            dropped: false,
        })
    }

    /// The gateway's `--database`: `base` with the schema as its `search_path`.
    pub fn url(&self) -> String {
        let sep = if self.base.contains('?') { '&' } else { '?' };
        format!("{}{sep}options=-c%20search_path%3D{}", self.base, self.name)
    }

    pub async fn drop_now(mut self) -> anyhow::Result<()> {
        self.dropped = true;
        pg_exec(&self.base, &self.drop_sql()).await
    }

    fn drop_sql(&self) -> String {
        format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (base, sql) = (self.base.clone(), self.drop_sql());
        // Its own thread and runtime: this may run inside the bench's runtime, which cannot be
        // blocked on from here.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(pg_exec(&base, &sql))
        })
        .join();
        if !matches!(done, Ok(Ok(()))) {
            eprintln!("could not drop schema {}; drop it by hand", self.name);
        }
    }
}

/// How a gateway joins the replica bus: the bus, its name on it, and the signing secret every
/// replica shares (each verifies the session tokens the others issued).
struct Joins<'a> {
    bus: &'a BusKeys,
    name: &'a str,
    secret: &'a str,
}

impl Stack {
    /// Starts `sbp-fake-llm` and `sbp serve` pointed at it. `label` names the log files. With
    /// `bus` (a `redis://` URL; `env.database` must be set) it starts two gateways on the same
    /// schema and upstream: replicas `bench-a` and `bench-b` on that bus under a prefix of their
    /// own, sharing one random signing secret.
    pub async fn start(
        env: &Env,
        label: &str,
        sync: Sync,
        bus: Option<&str>,
    ) -> anyhow::Result<Self> {
        if bus.is_some() && env.database.is_none() {
            bail!("a replica bus needs --database postgres://...");
        }
        let fake = start_fake(env, label).await?;
        let data = match data_dir(env) {
            Ok(d) => d,
            Err(e) => {
                let _ = fake.stop().await;
                return Err(e);
            }
        };
        let schema = match &env.database {
            Some(base) => match Schema::create(base).await {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = fake.stop().await;
                    return Err(e);
                }
            },
            None => None,
        };
        let bus = bus.map(BusKeys::new);
        // Two UUIDs: 64 hex characters, over the 32 bytes `--jwt-secret` needs.
        let secret = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let joins = |name| {
            bus.as_ref().map(|bus| Joins {
                bus,
                name,
                secret: &secret,
            })
        };
        let log = format!("{label}-gateway.log");
        let a = spawn_gateway(
            env,
            "gateway",
            &log,
            &fake,
            data.path(),
            sync,
            schema.as_ref(),
            joins("bench-a"),
            &[],
        );
        let gateway = match a.await {
            Ok(g) => g,
            Err(e) => {
                let _ = fake.stop().await;
                return Err(e);
            }
        };
        // B after A: A has migrated the schema, so B starts on a finished one.
        let b = async {
            if bus.is_none() {
                return Ok(None);
            }
            let data = data_dir(env)?;
            let log = format!("{label}-gateway-b.log");
            let b = spawn_gateway(
                env,
                "gateway-b",
                &log,
                &fake,
                data.path(),
                sync,
                schema.as_ref(),
                joins("bench-b"),
                &[],
            );
            Ok::<_, anyhow::Error>(Some((b.await?, data)))
        };
        let replica = match (b.await, bus) {
            (Ok(Some((gateway, _data))), Some(bus)) => Some(Replica {
                gateway,
                _data,
                bus,
            }),
            (Ok(_), _) => None,
            (Err(e), _) => {
                let _ = gateway.stop().await;
                let _ = fake.stop().await;
                return Err(e);
            }
        };
        // The pids are printed so a run can be profiled (`perf record -g -p PID`).
        let storage = match &schema {
            Some(s) => format!("postgres schema {}", s.name),
            None => format!("sqlite, sync {}", sync.as_str()),
        };
        println!(
            "  gateway pid {} on {} ({storage}), fake upstream pid {} on {}",
            gateway.pid, gateway.addr, fake.pid, fake.addr
        );
        if let Some(r) = &replica {
            println!(
                "  replica B: gateway pid {} on {}; bus prefix {}",
                r.gateway.pid, r.gateway.addr, r.bus.prefix
            );
        }
        Ok(Self {
            fake,
            gateway,
            data,
            schema,
            replica,
        })
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        let a = self.gateway.stop().await;
        let (r, keys) = match self.replica {
            Some(r) => (r.gateway.stop().await, Some(r.bus)),
            None => (Ok(()), None),
        };
        let b = self.fake.stop().await;
        // After the gateways are gone, so none of their connections holds a lock on the tables,
        // and none writes a key again.
        let c = match self.schema {
            Some(s) => s.drop_now().await,
            None => Ok(()),
        };
        let k = match keys {
            Some(k) => k.delete_now().await,
            None => Ok(()),
        };
        a.and(r).and(b).and(c).and(k)
    }

    /// Starts the processes, runs `measure` against them and always stops them. A process that died
    /// during the measurement turns the result into an error.
    pub async fn measure_with<T>(
        env: &Env,
        label: &str,
        sync: Sync,
        measure: impl AsyncFnOnce(&Stack) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        Self::measure_on(env, label, sync, None, measure).await
    }

    /// [`Stack::measure_with`] on one gateway, or on two replicas joined by `bus`.
    pub async fn measure_on<T>(
        env: &Env,
        label: &str,
        sync: Sync,
        bus: Option<&str>,
        measure: impl AsyncFnOnce(&Stack) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut stack = Stack::start(env, label, sync, bus).await?;
        let result = measure(&stack).await;
        let alive = stack.check_alive();
        stack.stop().await?;
        alive?;
        result
    }

    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        self.gateway.check_alive()?;
        if let Some(r) = &mut self.replica {
            r.gateway.check_alive()?;
        }
        self.fake.check_alive()
    }

    /// Size in bytes of each file in the gateway's data directory (database, WAL, shared memory).
    pub fn data_files(&self) -> BTreeMap<String, u64> {
        let Ok(dir) = std::fs::read_dir(self.data.path()) else {
            return BTreeMap::new();
        };
        dir.flatten()
            .filter_map(|e| {
                let len = e.metadata().ok()?.len();
                Some((e.file_name().to_string_lossy().into_owned(), len))
            })
            .collect()
    }
}

/// Starts `sbp serve` on `fake`, storing in `data` (SQLite) or `schema` (PostgreSQL); with `joins`,
/// as a replica on the bus; `extra` are further `sbp serve` arguments.
#[allow(clippy::too_many_arguments)]
async fn spawn_gateway(
    env: &Env,
    name: &str,
    log: &str,
    fake: &Service,
    data: &Path,
    sync: Sync,
    schema: Option<&Schema>,
    joins: Option<Joins<'_>>,
    extra: &[&str],
) -> anyhow::Result<Service> {
    let mut cmd = Command::new(binary(env, "sbp")?);
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data)
        .arg("--llm-base-url")
        .arg(format!("http://{}/v1", fake.addr))
        .args(["--sqlite-synchronous", sync.as_str()])
        // Idle surfaces must not be woken by PINGs during a run.
        .args(["--ping-interval", "300"])
        // A benchmark is thousands of requests a second from one loopback address on a handful
        // of sessions: what the rate limits exist to stop. Throughput is measured without them.
        .args(["--rate-limit-ip", "0", "--rate-limit-session", "0"])
        .args(["--rate-limit-key", "0", "--rate-limit-auth-failures", "0"])
        // The bench's own environment must not reconfigure the gateway under test.
        .env_remove("SBP_CONFIG")
        .env_remove("SBP_DATABASE")
        .env_remove("SBP_API_KEYS")
        .env_remove("SBP_STRICT_SBP")
        .env_remove("SBP_JWT_SECRET")
        .env_remove("SBP_BUS")
        .env_remove("SBP_BUS_PREFIX")
        .env_remove("SBP_REPLICA_NAME")
        .env_remove("SBP_REPLICATED")
        .env_remove("SBP_PUBLIC_URLS")
        .env_remove("SBP_ENCRYPTION_KEY")
        .env_remove("SBP_PREVIOUS_ENCRYPTION_KEYS");
    if let Some(key) = &env.encryption_key {
        cmd.arg("--encryption-key").arg(key);
    }
    cmd.args(extra);
    if let Some(schema) = schema {
        cmd.arg("--database").arg(schema.url());
    }
    if let Some(j) = joins {
        cmd.arg("--bus")
            .arg(&j.bus.url)
            .arg("--bus-prefix")
            .arg(&j.bus.prefix)
            .args(["--replica-name", j.name])
            // In the environment rather than on the command line, where `ps` would show it.
            .env("SBP_JWT_SECRET", j.secret);
    }
    Service::spawn(name, cmd, env.log_dir.join(log)).await
}

/// One `sbp serve` in front of an upstream started elsewhere (the peers comparison runs every
/// gateway on the same fake upstream), with its fresh data directory and, on PostgreSQL, its
/// fresh schema.
pub struct Gateway {
    pub service: Service,
    /// Deleted (with the database) on drop.
    _data: tempfile::TempDir,
    schema: Option<Schema>,
}

impl Gateway {
    /// Starts `sbp serve` on `fake`, on SQLite with `sync`, or on PostgreSQL in a fresh schema of
    /// `database`, with `extra` arguments; its log is `{label}-gateway.log`.
    pub async fn start(
        env: &Env,
        label: &str,
        fake: &Service,
        sync: Sync,
        database: Option<&str>,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let data = data_dir(env)?;
        let schema = match database {
            Some(base) => Some(Schema::create(base).await?),
            None => None,
        };
        let log = format!("{label}-gateway.log");
        // A failed start drops the schema (on drop) and the data directory.
        let service = spawn_gateway(
            env,
            "gateway",
            &log,
            fake,
            data.path(),
            sync,
            schema.as_ref(),
            None,
            extra,
        )
        .await?;
        Ok(Self {
            service,
            _data: data,
            schema,
        })
    }

    /// Kills the gateway, then drops its schema.
    pub async fn stop(self) -> anyhow::Result<()> {
        let a = self.service.stop().await;
        let b = match self.schema {
            Some(s) => s.drop_now().await,
            None => Ok(()),
        };
        a.and(b)
    }
}

/// A fresh data directory for one gateway.
fn data_dir(env: &Env) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("sbp-bench-")
        .tempdir_in(&env.data_root)
        .with_context(|| format!("creating a data dir in {}", env.data_root.display()))
}

pub async fn start_fake(env: &Env, label: &str) -> anyhow::Result<Service> {
    let mut cmd = Command::new(binary(env, "sbp-fake-llm")?);
    cmd.args(["--listen", "127.0.0.1:0", "--no-record"]);
    let log = env.log_dir.join(format!("{label}-fake.log"));
    Service::spawn("sbp-fake-llm", cmd, log).await
}

fn binary(env: &Env, name: &str) -> anyhow::Result<PathBuf> {
    let path = env.bin_dir.join(name);
    if !path.is_file() {
        bail!(
            "{} not found; build with `cargo build --release -p sbp-cli -p sbp-fake-llm -p sbp-bench` \
             or pass --bin-dir",
            path.display()
        );
    }
    Ok(path)
}

/// Resident memory of a process, in KiB.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Mem {
    /// VmRSS: resident now.
    pub rss_kib: u64,
    /// VmHWM: the peak resident size since the process started.
    pub hwm_kib: u64,
}

pub fn mem(pid: u32) -> anyhow::Result<Mem> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Ok(Mem {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    })
}

/// Resident memory of a process tree: the sum over its members (the sum of their peaks is an
/// upper bound of the tree's peak), and how many processes it has.
pub fn tree_mem(root: u32) -> anyhow::Result<(Mem, usize)> {
    let pids = tree_pids(root);
    let mut sum = mem(root)?;
    for pid in pids.iter().filter(|p| **p != root) {
        // A member that exited since the listing no longer holds memory.
        if let Ok(m) = mem(*pid) {
            sum.rss_kib += m.rss_kib;
            sum.hwm_kib += m.hwm_kib;
        }
    }
    Ok((sum, pids.len()))
}

/// Samples a process's VmRSS every 50 ms in the background and keeps the largest value seen.
pub struct RssSampler {
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    pub fn start(pid: u32) -> Self {
        let peak = Arc::new(AtomicU64::new(0));
        let p = peak.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                match mem(pid) {
                    Ok(m) => {
                        p.fetch_max(m.rss_kib, Ordering::Relaxed);
                    }
                    Err(_) => return,
                }
            }
        });
        Self { peak, task }
    }

    /// Stops sampling; the largest VmRSS seen, in KiB.
    pub fn finish(self) -> u64 {
        self.task.abort();
        self.peak.load(Ordering::Relaxed)
    }
}

/// CPU time (user + system) of processes and of the machine, to split a run's CPU between them.
#[derive(Debug, Clone)]
pub struct CpuSnapshot {
    at: Instant,
    procs: Vec<(String, u32, u64)>,
    /// Process trees, each counted whole under its root's name.
    trees: Vec<(String, u32, u64)>,
    threads: Vec<BTreeMap<String, u64>>,
    /// Ticks of every process named `postgres` (server, backends, WAL writer, checkpointer...).
    postgres: BTreeMap<u32, u64>,
    machine_busy: u64,
    machine_steal: u64,
    machine_total: u64,
}

/// CPU use over an interval: percent of one core per process (200 % = both cores of a 2-core machine).
#[derive(Debug, Clone, Serialize)]
pub struct CpuUse {
    pub seconds: f64,
    /// Percent of one core, by process.
    pub process_pct: BTreeMap<String, f64>,
    /// Percent of one core, by process and thread name.
    pub thread_pct: BTreeMap<String, BTreeMap<String, f64>>,
    /// Busy share of all cores of the machine, percent (steal included).
    pub machine_busy_pct: f64,
    /// Share of all cores taken by the hypervisor for other guests, percent.
    pub machine_steal_pct: f64,
    /// CPU used by everything else on the machine (other processes, the kernel's own threads),
    /// percent of one core: a sign that the run was disturbed.
    pub others_pct: f64,
}

impl CpuUse {
    /// CPU seconds a process used over the interval.
    pub fn cpu_seconds(&self, process: &str) -> f64 {
        self.process_pct.get(process).copied().unwrap_or(0.0) / 100.0 * self.seconds
    }
}

fn clock_ticks() -> f64 {
    // Linux reports CPU times in USER_HZ, which is 100 on every mainstream architecture.
    100.0
}

/// What the bench reads from a /proc/.../stat line.
#[derive(Debug, PartialEq, Eq)]
struct Stat {
    comm: String,
    ppid: u32,
    /// utime + stime, in ticks.
    ticks: u64,
    /// cutime + cstime: the ticks of children it has reaped, in ticks.
    reaped_ticks: u64,
}

fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_owned();
    let fields: Vec<&str> = text.get(close + 2..)?.split_whitespace().collect();
    // Fields after the comm start at field 3 (state): ppid is field 4, utime, stime, cutime and
    // cstime are fields 14 to 17.
    let num = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some(Stat {
        comm,
        ppid: u32::try_from(num(1)?).ok()?,
        ticks: num(11)? + num(12)?,
        reaped_ticks: num(13).unwrap_or(0) + num(14).unwrap_or(0),
    })
}

/// utime + stime, in ticks, from a /proc/.../stat line.
fn stat_ticks(text: &str) -> Option<(String, u64)> {
    parse_stat(text).map(|s| (s.comm, s.ticks))
}

/// Every process's stat, by pid.
fn all_stats() -> BTreeMap<u32, Stat> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Some(stat) = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|t| parse_stat(&t))
        {
            out.insert(pid, stat);
        }
    }
    out
}

/// `root` and its descendants, from a table of stats.
fn descendants(root: u32, stats: &BTreeMap<u32, Stat>) -> Vec<u32> {
    let mut tree = vec![root];
    let mut i = 0;
    while let Some(&pid) = tree.get(i) {
        tree.extend(
            stats
                .iter()
                .filter(|(_, s)| s.ppid == pid)
                .map(|(child, _)| *child),
        );
        i += 1;
    }
    tree.retain(|pid| stats.contains_key(pid));
    tree
}

/// `root` and its descendants now (a master and its workers, a launcher and its runtime).
pub fn tree_pids(root: u32) -> Vec<u32> {
    descendants(root, &all_stats())
}

/// CPU ticks of a process tree: each live member's own and its reaped children's, so a worker
/// that exits (and is reaped) during a run still counts.
fn tree_ticks(root: u32) -> u64 {
    let stats = all_stats();
    descendants(root, &stats)
        .iter()
        .filter_map(|pid| stats.get(pid))
        .map(|s| s.ticks + s.reaped_ticks)
        .sum()
}

fn proc_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| stat_ticks(&t))
        .map_or(0, |(_, t)| t)
}

/// Ticks per thread name (threads of one name summed: tokio workers, blocking pool...).
fn thread_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for entry in dir.flatten() {
        let path = entry.path().join("stat");
        if let Some((comm, t)) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| stat_ticks(&t))
        {
            *out.entry(comm).or_insert(0) += t;
        }
    }
    out
}

/// Ticks of each process whose name is `name`.
fn ticks_by_name(name: &str) -> BTreeMap<u32, u64> {
    all_stats()
        .into_iter()
        .filter(|(_, s)| s.comm == name)
        .map(|(pid, s)| (pid, s.ticks))
        .collect()
}

/// (busy, steal, total) ticks of all cores.
fn machine_ticks() -> (u64, u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|n| n.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    // idle + iowait
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    let steal = v.get(7).copied().unwrap_or(0);
    (total.saturating_sub(idle), steal, total)
}

impl CpuSnapshot {
    /// Takes a snapshot of the named processes (the bench itself is always included as "bench").
    pub fn take(procs: &[(&str, u32)]) -> Self {
        Self::take_with_trees(procs, &[])
    }

    /// [`CpuSnapshot::take`], and of the named process trees (a root and its descendants, counted
    /// as one; no per-thread figures).
    pub fn take_with_trees(procs: &[(&str, u32)], trees: &[(&str, u32)]) -> Self {
        let trees = trees
            .iter()
            .map(|(n, pid)| ((*n).to_owned(), *pid, tree_ticks(*pid)))
            .collect();
        let mut all: Vec<(String, u32)> =
            procs.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect();
        all.push(("bench".to_owned(), std::process::id()));
        let (machine_busy, machine_steal, machine_total) = machine_ticks();
        Self {
            at: Instant::now(),
            trees,
            threads: all.iter().map(|(_, pid)| thread_ticks(*pid)).collect(),
            postgres: ticks_by_name("postgres"),
            procs: all
                .into_iter()
                .map(|(n, pid)| {
                    let t = proc_ticks(pid);
                    (n, pid, t)
                })
                .collect(),
            machine_busy,
            machine_steal,
            machine_total,
        }
    }

    /// CPU use between `self` and now.
    pub fn since(&self) -> CpuUse {
        let now = Self::take(&[]);
        let secs = now.at.duration_since(self.at).as_secs_f64().max(1e-9);
        let pct = |ticks: u64| ticks as f64 / clock_ticks() / secs * 100.0;
        let mut process_pct = BTreeMap::new();
        let mut thread_pct = BTreeMap::new();
        for ((name, pid, before), threads_before) in self.procs.iter().zip(&self.threads) {
            process_pct.insert(
                name.clone(),
                round1(pct(proc_ticks(*pid).saturating_sub(*before))),
            );
            let mut per = BTreeMap::new();
            for (comm, t) in thread_ticks(*pid) {
                let b = threads_before.get(&comm).copied().unwrap_or(0);
                let v = round1(pct(t.saturating_sub(b)));
                if v > 0.0 {
                    per.insert(comm, v);
                }
            }
            thread_pct.insert(name.clone(), per);
        }
        for (name, root, before) in &self.trees {
            process_pct.insert(
                name.clone(),
                round1(pct(tree_ticks(*root).saturating_sub(*before))),
            );
        }
        // All PostgreSQL processes as one (a backend that started during the interval counts whole),
        // when the machine runs one: with `--database` it does the storage work.
        if !now.postgres.is_empty() {
            let ticks: u64 = now
                .postgres
                .iter()
                .map(|(pid, t)| t.saturating_sub(self.postgres.get(pid).copied().unwrap_or(0)))
                .sum();
            process_pct.insert("postgres".to_owned(), round1(pct(ticks)));
        }
        let busy = now.machine_busy.saturating_sub(self.machine_busy) as f64;
        let steal = now.machine_steal.saturating_sub(self.machine_steal) as f64;
        let total = now.machine_total.saturating_sub(self.machine_total) as f64;
        let share = |v: f64| {
            if total > 0.0 {
                round1(v / total * 100.0)
            } else {
                0.0
            }
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let ours: f64 = process_pct.values().sum();
        // Unrounded, so the difference is not skewed by rounding each share.
        let busy_cores_pct = if total > 0.0 {
            (busy - steal) / total * 100.0 * cores
        } else {
            0.0
        };
        CpuUse {
            seconds: round1(secs),
            process_pct,
            thread_pct,
            others_pct: round1((busy_cores_pct - ours).max(0.0)),
            machine_busy_pct: share(busy),
            machine_steal_pct: share(steal),
        }
    }
}

pub fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// The 1-, 5- and 15-minute load averages.
pub fn loadavg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = text.split_whitespace().filter_map(|n| n.parse().ok());
    [
        it.next().unwrap_or(0.0),
        it.next().unwrap_or(0.0),
        it.next().unwrap_or(0.0),
    ]
}

/// The machine: cores, CPU model, memory, kernel.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub mem_total_kib: u64,
    pub kernel: String,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_total_kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    Machine {
        nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model,
        mem_total_kib,
        kernel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse() {
        let line = "123 (tokio-runtime-w) S 1 2 3 4 5 6 7 8 9 10 250 31 0 0 20 0 1 0";
        assert_eq!(stat_ticks(line), Some(("tokio-runtime-w".into(), 281)));
        let odd = "7 (a) b) R 1 2 3 4 5 6 7 8 9 10 1 2 0";
        assert_eq!(stat_ticks(odd), Some(("a) b".into(), 3)));
    }

    #[test]
    fn stat_lines_give_parent_and_reaped_ticks() {
        let line = "123 (nginx) S 77 2 3 4 5 6 7 8 9 10 250 31 40 2 20 0 1 0";
        let s = parse_stat(line).expect("parses");
        assert_eq!((s.ppid, s.ticks, s.reaped_ticks), (77, 281, 42));
    }

    #[test]
    fn a_tree_is_its_root_and_every_descendant() {
        let stat = |ppid| Stat {
            comm: String::new(),
            ppid,
            ticks: 0,
            reaped_ticks: 0,
        };
        let stats: BTreeMap<u32, Stat> = [
            (1, stat(0)),
            (10, stat(1)),
            (11, stat(10)),
            (12, stat(11)),
            (13, stat(10)),
            (20, stat(1)),
        ]
        .into_iter()
        .collect();
        let mut tree = descendants(10, &stats);
        tree.sort_unstable();
        assert_eq!(tree, vec![10, 11, 12, 13]);
        assert_eq!(descendants(99, &stats), Vec::<u32>::new());
    }

    #[test]
    fn this_process_is_a_tree_of_itself() {
        let me = std::process::id();
        assert!(tree_pids(me).contains(&me));
        let (m, n) = tree_mem(me).expect("own /proc entry");
        assert!(n >= 1 && m.hwm_kib > 0, "{m:?}");
    }
}
