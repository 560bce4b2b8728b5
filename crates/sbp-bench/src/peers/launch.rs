//! Starting each target of the peers comparison in front of the shared fake upstream: sbp from
//! its release binary, nginx, LiteLLM and Portkey from where scripts/bench-peers-deps.sh put them
//! (or from PATH), each on a free loopback port with a configuration written into a temp dir.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use http::{HeaderMap, HeaderValue};
use sbp_test_support::procs::tail;
use tokio::process::Command;

use super::Peer;
use crate::client::{Client, MODEL, Target};
use crate::procs::{Env, Gateway, Service, Sync};

/// How long a peer may take to answer its first completion: LiteLLM imports for ~10 s on an idle
/// 2-core machine and for close to a minute while it is busy.
const READY_WITHIN: Duration = Duration::from_secs(180);

/// A target ready for load.
pub struct Running {
    pub addr: SocketAddr,
    pub target: Target,
    /// Sent with every request (Portkey's routing headers).
    pub headers: HeaderMap,
    pub process: Process,
    /// What runs, for the report: `nginx version: nginx/1.22.1`, `litellm 1.2.3`...
    pub version: Option<String>,
    /// It stores on PostgreSQL, whose CPU is then reported beside the gateway's.
    pub on_postgres: bool,
}

/// What serves a target.
pub enum Process {
    /// Nothing in between: the load goes straight to the fake upstream.
    None,
    Sbp(Gateway),
    /// A peer gateway and the directory of its configuration.
    Peer(Service, tempfile::TempDir),
}

impl Running {
    /// The root of the gateway's process tree.
    pub fn pid(&self) -> Option<u32> {
        match &self.process {
            Process::None => None,
            Process::Sbp(g) => Some(g.service.pid),
            Process::Peer(s, _) => Some(s.pid),
        }
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        match self.process {
            Process::None => Ok(()),
            Process::Sbp(g) => g.stop().await,
            Process::Peer(s, _dir) => s.stop().await,
        }
    }

    /// Fails if the gateway has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        match &mut self.process {
            Process::None => Ok(()),
            Process::Sbp(g) => g.service.check_alive(),
            Process::Peer(s, _) => s.check_alive(),
        }
    }
}

/// Where the peers were installed and what they run against.
pub struct Context<'a> {
    pub env: &'a Env,
    pub fake: &'a Service,
    /// scripts/bench-peers-deps.sh's install directory.
    pub peers_dir: &'a Path,
    /// PostgreSQL base URL of `sbp-durable-pg`.
    pub database: &'a str,
}

/// What became of starting a target.
pub enum Started {
    Up(Box<Running>),
    /// Not installed here; why, and how to install it.
    Absent(String),
}

/// Starts `peer` and waits until it answers a completion.
pub async fn start(peer: Peer, cx: &Context<'_>) -> anyhow::Result<Started> {
    let started = match peer {
        Peer::Direct => Running {
            addr: cx.fake.addr,
            target: Target::Direct,
            headers: HeaderMap::new(),
            process: Process::None,
            version: None,
            on_postgres: false,
        },
        Peer::SbpPlain => sbp(cx, peer, None, &["--strict-sbp"]).await?,
        Peer::SbpDurable => sbp(cx, peer, None, &[]).await?,
        Peer::SbpDurablePg => sbp(cx, peer, Some(cx.database), &[]).await?,
        Peer::Nginx => match nginx(cx).await? {
            Some(r) => r,
            None => {
                return Ok(Started::Absent(absent(
                    "nginx not found on PATH or in /usr/sbin",
                )));
            }
        },
        Peer::Litellm => match litellm(cx).await? {
            Some(r) => r,
            None => {
                return Ok(Started::Absent(absent(&format!(
                    "litellm not found in {} nor on PATH",
                    cx.peers_dir.join("litellm-venv/bin").display()
                ))));
            }
        },
        Peer::Portkey => match portkey(cx).await? {
            Some(r) => r,
            None => {
                return Ok(Started::Absent(absent(&format!(
                    "@portkey-ai/gateway not installed in {}",
                    cx.peers_dir.join("portkey").display()
                ))));
            }
        },
    };
    let mut running = started;
    if let Err(e) = ready(&mut running).await {
        let _ = running.stop().await;
        return Err(e.context(format!("{} did not become ready", peer.name())));
    }
    Ok(Started::Up(Box::new(running)))
}

fn absent(why: &str) -> String {
    format!("{why} (scripts/bench-peers-deps.sh installs it)")
}

/// Waits until one plain completion through the target is answered 200, at most
/// [`READY_WITHIN`]; fails at once if the process exits.
async fn ready(r: &mut Running) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        r.check_alive()?;
        let attempt = async {
            let mut c = Client::connect_with(r.addr, 0, Target::Direct, &r.headers).await?;
            c.complete().await.map_err(anyhow::Error::msg)
        };
        let last = match attempt.await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            let log = match &r.process {
                Process::Peer(s, _) => format!("; log {}:\n{}", s.log.display(), tail(&s.log)),
                _ => String::new(),
            };
            bail!("no answer within {READY_WITHIN:?}; last: {last:#}{log}");
        }
        // Polling: a peer that is still importing or binding says nothing when it is done.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn sbp(
    cx: &Context<'_>,
    peer: Peer,
    database: Option<&str>,
    extra: &[&str],
) -> anyhow::Result<Running> {
    let label = format!("peers-{}", peer.name());
    let gateway = Gateway::start(cx.env, &label, cx.fake, Sync::Full, database, extra).await?;
    let target = match peer {
        Peer::SbpPlain => Target::Direct,
        _ => Target::Stateful {
            turns_per_session: None,
        },
    };
    let version = version_line(Command::new(cx.env.bin_dir.join("sbp")).arg("--version")).await;
    Ok(Running {
        addr: gateway.service.addr,
        target,
        headers: HeaderMap::new(),
        process: Process::Sbp(gateway),
        version,
        on_postgres: database.is_some(),
    })
}

/// nginx, one worker, as a keep-alive reverse proxy: the floor of a proxy hop.
async fn nginx(cx: &Context<'_>) -> anyhow::Result<Option<Running>> {
    let Some(bin) = on_path("nginx").or_else(|| existing("/usr/sbin/nginx")) else {
        return Ok(None);
    };
    let dir = config_dir("nginx")?;
    // Run as root, nginx's worker switches to `nobody`, which must be able to enter the
    // directory its temp paths are in (nothing secret is in it).
    set_mode(dir.path(), 0o755)?;
    let addr = free_addr()?;
    let conf = dir.path().join("nginx.conf");
    std::fs::write(&conf, nginx_conf(dir.path(), addr, cx.fake.addr))
        .with_context(|| format!("writing {}", conf.display()))?;
    let mut cmd = Command::new(&bin);
    cmd.arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(&conf)
        // Before the configuration is read, nginx opens its compiled-in error log; send that to
        // stderr (our log) instead.
        .args(["-e", "stderr"]);
    let version = version_line(Command::new(&bin).arg("-v")).await;
    let service = Service::spawn_group("nginx", cmd, log(cx, "nginx"), addr)?;
    Ok(Some(Running {
        addr,
        target: Target::Direct,
        headers: HeaderMap::new(),
        process: Process::Peer(service, dir),
        version,
        on_postgres: false,
    }))
}

fn nginx_conf(dir: &Path, listen: SocketAddr, upstream: SocketAddr) -> String {
    let d = dir.display();
    // One worker, so its CPU compares with one gateway process. A benchmark's client keeps its
    // connections for the whole run, so neither side closes them after 1,000 requests (nginx's
    // default): every reconnection would count as an error.
    format!(
        "daemon off;
master_process on;
worker_processes 1;
pid {d}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 1000000000;
    keepalive_timeout 300s;
    upstream fake {{
        server {upstream};
        keepalive 64;
        keepalive_requests 1000000000;
        keepalive_timeout 300s;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
        }}
    }}
}}
"
    )
}

/// LiteLLM's proxy, one worker, a model mapped to the fake upstream.
async fn litellm(cx: &Context<'_>) -> anyhow::Result<Option<Running>> {
    let venv = cx.peers_dir.join("litellm-venv/bin/litellm");
    let Some(bin) = existing(&venv).or_else(|| on_path("litellm")) else {
        return Ok(None);
    };
    let dir = config_dir("litellm")?;
    let addr = free_addr()?;
    let conf = dir.path().join("config.yaml");
    // LiteLLM refuses to start without a master key (it would accept every request), so the
    // requests carry one: the check is part of what it costs.
    let key = format!("sk-bench-{}", uuid::Uuid::new_v4().simple());
    let yaml = format!(
        "model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://{}/v1
      api_key: bench
general_settings:
  master_key: {key}
",
        cx.fake.addr
    );
    std::fs::write(&conf, yaml).with_context(|| format!("writing {}", conf.display()))?;
    let mut cmd = Command::new(&bin);
    cmd.arg("--config")
        .arg(&conf)
        .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
        .args(["--num_workers", "1"])
        // The price list shipped in the package, not one fetched at start.
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_LOG", "ERROR")
        .env_remove("DATABASE_URL")
        .env_remove("LITELLM_MASTER_KEY")
        .current_dir(dir.path());
    let version = bin
        .parent()
        .and_then(|b| b.parent())
        .and_then(|venv| dist_version(venv, "litellm"));
    let service = Service::spawn_group("litellm", cmd, log(cx, "litellm"), addr)?;
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}"))?,
    );
    Ok(Some(Running {
        addr,
        target: Target::Direct,
        headers,
        process: Process::Peer(service, dir),
        version,
        on_postgres: false,
    }))
}

/// Portkey's gateway (node), routed to the fake upstream by its request headers.
async fn portkey(cx: &Context<'_>) -> anyhow::Result<Option<Running>> {
    let pkg_dir = cx
        .peers_dir
        .join("portkey/node_modules/@portkey-ai/gateway");
    let Ok(text) = std::fs::read_to_string(pkg_dir.join("package.json")) else {
        return Ok(None);
    };
    let pkg: serde_json::Value = serde_json::from_str(&text).context("Portkey's package.json")?;
    // The script `npx @portkey-ai/gateway` runs, started by node itself: npx would stay as the
    // parent and add an idle npm process to the tree measured.
    let script = match pkg.get("bin") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(m)) => m
            .values()
            .find_map(|v| v.as_str())
            .context("Portkey's package.json has an empty bin")?
            .to_owned(),
        _ => bail!("Portkey's package.json names no bin script"),
    };
    let Some(node) = on_path("node") else {
        return Ok(None);
    };
    let dir = config_dir("portkey")?;
    let addr = free_addr()?;
    let mut cmd = Command::new(node);
    cmd.arg(pkg_dir.join(script))
        .arg(format!("--port={}", addr.port()))
        // As deployed: without the development console, which keeps every request's log for its
        // live view.
        .arg("--headless")
        .env("NODE_ENV", "production")
        .current_dir(dir.path());
    let mut headers = HeaderMap::new();
    headers.insert("x-portkey-provider", HeaderValue::from_static("openai"));
    headers.insert(
        "x-portkey-custom-host",
        HeaderValue::from_str(&format!("http://{}/v1", cx.fake.addr))?,
    );
    headers.insert("authorization", HeaderValue::from_static("Bearer x"));
    let version = pkg
        .get("version")
        .and_then(|v| v.as_str())
        .map(|v| format!("@portkey-ai/gateway {v}"));
    let service = Service::spawn_group("portkey", cmd, log(cx, "portkey"), addr)?;
    Ok(Some(Running {
        addr,
        target: Target::Direct,
        headers,
        process: Process::Peer(service, dir),
        version,
        on_postgres: false,
    }))
}

fn log(cx: &Context<'_>, name: &str) -> PathBuf {
    cx.env.log_dir.join(format!("peers-{name}.log"))
}

fn config_dir(name: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("sbp-bench-{name}-"))
        .tempdir()
        .context("creating a config dir")
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// A loopback port free now, for a peer that cannot be told to bind port 0 and say which it
/// got. Another process could take it before the peer binds; the peer then fails to start.
fn free_addr() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?)
}

fn existing(path: impl AsRef<Path>) -> Option<PathBuf> {
    let p = path.as_ref();
    p.is_file().then(|| p.to_path_buf())
}

/// `name` in a directory of PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find_map(|d| existing(d.join(name)))
}

/// The first line a `--version`-like command prints (on stdout or stderr).
async fn version_line(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().await.ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .next()
        .map(|l| l.trim().to_owned())
}

/// `package VERSION` from a venv's `package-VERSION.dist-info` directory.
fn dist_version(venv: &Path, package: &str) -> Option<String> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    let prefix = format!("{package}-");
    for python in lib.flatten() {
        let Ok(site) = std::fs::read_dir(python.path().join("site-packages")) else {
            continue;
        };
        for entry in site.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(v) = name
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".dist-info"))
            {
                return Some(format!("{package} {v}"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nginx_conf_keeps_connections_and_drops_the_connection_header() {
        let conf = nginx_conf(
            Path::new("/tmp/x"),
            "127.0.0.1:8001".parse().expect("addr"),
            "127.0.0.1:9001".parse().expect("addr"),
        );
        for line in [
            "worker_processes 1;",
            "access_log off;",
            "server 127.0.0.1:9001;",
            "keepalive 64;",
            "listen 127.0.0.1:8001;",
            "proxy_http_version 1.1;",
            "proxy_set_header Connection \"\";",
            "pid /tmp/x/nginx.pid;",
        ] {
            assert!(conf.contains(line), "{line} missing from\n{conf}");
        }
    }
}
