//! The processes under test, started from their release binaries: the fake upstream and the
//! gateway (which the storm kills with SIGKILL and starts again on the same data), a fresh
//! PostgreSQL schema per storm, and what /proc says about a process's memory.
//!
//! Spawning and waiting for the address are sbp-test-support's (`procs`), shared with sbp-bench;
//! what is the soak's own is the restart on the data a gateway was killed on.

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, bail};
pub use sbp_test_support::procs::tail;
use sbp_test_support::procs::{Listening, pg_exec, spawn_listening};
use tokio::process::{Child, Command};

/// Where the release binaries are and where logs go.
#[derive(Debug, Clone)]
pub struct Env {
    pub bin_dir: PathBuf,
    pub out_dir: PathBuf,
}

impl Env {
    fn binary(&self, name: &str) -> anyhow::Result<PathBuf> {
        let path = self.bin_dir.join(name);
        if !path.is_file() {
            bail!(
                "{} not found; build with `cargo build --release -p sbp-cli -p sbp-fake-llm -p sbp-soak` \
                 (scripts/soak.sh does) or pass --bin-dir",
                path.display()
            );
        }
        Ok(path)
    }

    pub fn log(&self, name: &str) -> PathBuf {
        self.out_dir.join(name)
    }
}

/// A started child process that printed `... listening on http://ADDR...` on stdout.
pub struct Proc {
    pub name: String,
    pub pid: u32,
    pub addr: SocketAddr,
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    async fn spawn(name: &str, cmd: Command, log: PathBuf) -> anyhow::Result<Self> {
        // Appended: a gateway started again after a kill writes on in the same log.
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let Listening { child, pid, addr } = spawn_listening(name, cmd, log_file, &log).await?;
        Ok(Self {
            name: name.to_owned(),
            pid,
            addr,
            log,
            child,
        })
    }

    /// SIGKILL, then reaps it; fails unless SIGKILL is what ended it (it must not have died
    /// before, on its own).
    pub async fn kill9(mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} had already exited ({status}) before the kill; log {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log)
            );
        }
        // tokio's start_kill is SIGKILL on Unix.
        self.child
            .start_kill()
            .with_context(|| format!("killing {}", self.name))?;
        let status: ExitStatus = self.child.wait().await?;
        if status.signal() != Some(9) {
            bail!("{} ended with {status}, not by SIGKILL", self.name);
        }
        Ok(())
    }

    /// Kills the process and reaps it (teardown).
    pub async fn stop(mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.start_kill();
        }
        let _ = self.child.wait().await;
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); log {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log)
            );
        }
        Ok(())
    }
}

/// Lines of a log that report a panic (a handler or task that panicked is a defect even when the
/// process lives on).
pub fn panics_in(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("panicked at"))
        .map(str::to_owned)
        .collect()
}

pub async fn start_fake(env: &Env, log: &str) -> anyhow::Result<Proc> {
    let mut cmd = Command::new(env.binary("sbp-fake-llm")?);
    cmd.args(["--listen", "127.0.0.1:0", "--no-record"]);
    Proc::spawn("sbp-fake-llm", cmd, env.log(log)).await
}

/// How a gateway is started; the same spec starts it again on the same data after a kill.
#[derive(Debug, Clone)]
pub struct GatewaySpec {
    pub data_dir: PathBuf,
    /// `--database` (PostgreSQL); SQLite in `data_dir` when absent.
    pub database: Option<String>,
    /// The fake upstream's `http://ADDR/v1`.
    pub upstream: String,
    /// The soft RLIMIT_NOFILE the gateway starts with (as a service manager would give it; the
    /// hard limit is left as it is). `None`: inherited from the soak.
    pub soft_nofile: Option<u64>,
    /// Passed on as they are (`--gateway-arg`), e.g. limits a fix introduced.
    pub extra_args: Vec<String>,
}

pub async fn start_gateway(env: &Env, spec: &GatewaySpec, log: &str) -> anyhow::Result<Proc> {
    let sbp = env.binary("sbp")?;
    let mut cmd = match spec.soft_nofile {
        // `exec` keeps the pid, so /proc/PID is the gateway's. No `unsafe` pre_exec needed.
        Some(n) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!("ulimit -Sn {n} && exec \"$0\" \"$@\""))
                .arg(&sbp);
            c
        }
        None => Command::new(&sbp),
    };
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(&spec.data_dir)
        .arg("--llm-base-url")
        .arg(&spec.upstream)
        .args(["--sqlite-synchronous", "full"])
        // The soak's own environment must not reconfigure the gateway under test.
        .env_remove("SBP_CONFIG")
        .env_remove("SBP_DATABASE")
        .env_remove("SBP_API_KEYS")
        .env_remove("SBP_STRICT_SBP")
        .env_remove("SBP_JWT_SECRET")
        .env_remove("SBP_BUS")
        .env_remove("SBP_TETHER")
        .env_remove("SBP_REPLICATED");
    if let Some(db) = &spec.database {
        cmd.arg("--database").arg(db);
    }
    cmd.args(&spec.extra_args);
    Proc::spawn("sbp serve", cmd, env.log(log)).await
}

/// A schema made for one storm on PostgreSQL; [`Schema::drop_now`] removes it (a soak that
/// fails before that leaves it, named, for a look).
pub struct Schema {
    base: String,
    pub name: String,
}

impl Schema {
    /// Creates `sbp_soak_<pid>_<n>` on `base`.
    pub async fn create(base: &str) -> anyhow::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "sbp_soak_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        pg_exec(base, &format!("CREATE SCHEMA {name}")).await?;
        Ok(Self {
            base: base.to_owned(),
            name,
        })
    }

    /// The gateway's `--database`: `base` with the schema as its `search_path`.
    pub fn url(&self) -> String {
        let sep = if self.base.contains('?') { '&' } else { '?' };
        format!("{}{sep}options=-c%20search_path%3D{}", self.base, self.name)
    }

    pub async fn drop_now(self) -> anyhow::Result<()> {
        pg_exec(
            &self.base,
            &format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name),
        )
        .await
    }
}

/// Resident memory of a process, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mem {
    /// VmRSS: resident now.
    pub rss_kib: u64,
    /// VmHWM: the peak resident size since the process started.
    pub hwm_kib: u64,
}

pub fn mem(pid: u32) -> Option<Mem> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Some(Mem {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    })
}

/// Open file descriptors of a process (sockets included).
pub fn open_fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}
