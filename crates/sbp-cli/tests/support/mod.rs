//! Harness for the end-to-end tests: runs the real `sbp` binary as a child process on
//! 127.0.0.1:0, learns its port from the one stdout line, captures its output, and talks to it
//! with real clients (reqwest over HTTP, tokio-tungstenite over WebSocket). [`Deployment`] runs
//! several of them as replicas of one deployment (one PostgreSQL schema, one Redis bus prefix).

#![allow(dead_code)]

use std::io::{BufRead as _, BufReader, Read as _};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use sbp_test_support::delete_prefix_blocking;
use serde_json::{Value, json};
use tokio::time::Instant;

pub use sbp_test_support::{
    WAIT, Ws, WsEvent, client, eventually, send, test_database_url, test_pg_tls, test_redis_url,
};

/// How long a debug build gets to open its database and print the startup line.
pub const STARTUP: Duration = Duration::from_secs(20);

/// `sbp serve` with a clean environment: no inherited `SBP_*` variable can change what a test
/// sets up, and output is piped so it can be inspected.
pub fn sbp_serve() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sbp"));
    cmd.arg("serve");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("SBP_") {
            cmd.env_remove(key);
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// `sbp serve --listen 127.0.0.1:0 --data-dir DIR EXTRA...`.
///
/// With an upstream and no `--default-model`, turns that name no model go to the fake's `fake`
/// (`sbp/echo`, the documented default, is the built-in model even beside an upstream).
pub fn sbp_serve_in(data_dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = sbp_serve();
    cmd.arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra);
    if extra.contains(&"--llm-base-url") && !extra.contains(&"--default-model") {
        cmd.args(["--default-model", "fake"]);
    }
    cmd
}

/// Text a child wrote to one of its pipes, collected by a reader thread.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<String>>);

impl Captured {
    fn push(&self, text: &str) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_str(text);
    }

    fn get(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A running child process. Dropping it sends SIGKILL and reaps it, so no process outlives a test.
pub struct Proc {
    child: Child,
    stdout: Captured,
    stderr: Captured,
    readers: Vec<JoinHandle<()>>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("spawn the sbp binary");
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        let (stdout, stderr) = (Captured::default(), Captured::default());
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        let sink = stdout.clone();
        let out_reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                sink.push(&line);
                sink.push("\n");
                let _ = tx.send(line);
            }
        });
        let sink = stderr.clone();
        let err_reader = std::thread::spawn(move || {
            let mut err = err;
            let mut buf = [0u8; 8192];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.push(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Self {
            child,
            stdout,
            stderr,
            readers: vec![out_reader, err_reader],
            lines,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, or `None` if stdout closed (the process exited) first.
    pub async fn next_line(&mut self, within: Duration) -> Option<String> {
        match tokio::time::timeout(within, self.lines.recv()).await {
            Ok(line) => line,
            Err(_) => panic!(
                "no stdout line within {within:?}; stderr so far:\n{}",
                self.stderr()
            ),
        }
    }

    pub fn stdout(&self) -> String {
        self.stdout.get()
    }

    pub fn stderr(&self) -> String {
        self.stderr.get()
    }

    /// `kill -9`, then reaps the process.
    pub fn kill9(&mut self) -> ExitStatus {
        // Already exited is fine: the point is that it is not running afterwards.
        let _ = self.child.kill();
        self.child.wait().expect("reap the killed child")
    }

    /// `kill -<name> <pid>` through the real `kill` command (`TERM`, `HUP`, `STOP`, `CONT`).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed: {status}");
    }

    /// `kill -TERM <pid>`.
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// `kill -HUP <pid>`.
    pub fn sighup(&self) {
        self.signal("HUP");
    }

    /// Waits for the process to exit on its own, polling until `within` runs out.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "process {} still running after {within:?}; stderr:\n{}",
                self.pid(),
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// After the process has exited: waits for the readers to reach EOF so the captured output is
    /// complete, and returns (stdout, stderr).
    pub fn output(&mut self) -> (String, String) {
        assert!(
            self.child.try_wait().expect("try_wait").is_some(),
            "output() needs an exited process"
        );
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        (self.stdout(), self.stderr())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running gateway: the process and the address it printed.
pub struct Sbp {
    pub proc: Proc,
    /// `http://127.0.0.1:PORT` (`https://` when it serves TLS).
    pub url: String,
    /// `ws://127.0.0.1:PORT` (`wss://` when it serves TLS).
    pub ws_url: String,
    /// The startup line as printed.
    pub banner: String,
    pub http: reqwest::Client,
}

/// The `http(s)://` URL the gateway's startup line names.
pub fn url_in_banner(banner: &str) -> String {
    banner
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap_or_else(|| panic!("no http(s):// URL in the startup line: {banner}"))
        .to_owned()
}

impl Sbp {
    /// Runs `sbp serve --listen 127.0.0.1:0 --data-dir DIR EXTRA...` and waits for its banner.
    pub async fn start(data_dir: &Path, extra: &[&str]) -> Self {
        Self::spawn(sbp_serve_in(data_dir, extra)).await
    }

    /// Runs `cmd` (which must make the gateway listen on some port) and waits for its banner.
    pub async fn spawn(cmd: Command) -> Self {
        let mut proc = Proc::spawn(cmd);
        let Some(banner) = proc.next_line(STARTUP).await else {
            let status = proc.wait_exit(WAIT).await;
            let (_, err) = proc.output();
            panic!("sbp exited ({status}) before printing its address; stderr:\n{err}");
        };
        let url = url_in_banner(&banner);
        let (tls, rest) = match url.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, &url["http://".len()..]),
        };
        let addr: std::net::SocketAddr = rest
            .parse()
            .unwrap_or_else(|e| panic!("bad address in '{banner}': {e}"));
        assert!(addr.ip().is_loopback(), "{banner}");
        assert_ne!(addr.port(), 0, "the real port is printed: {banner}");
        Self {
            proc,
            ws_url: format!("{}://{addr}", if tls { "wss" } else { "ws" }),
            url,
            banner,
            http: client(),
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        self.http.post(format!("{}{path}", self.url)).json(body)
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.get(format!("{}{path}", self.url))
    }

    /// A completion of the gateway's default model; `token` continues a session. Returns
    /// (status, session token header, body).
    pub async fn chat(&self, token: Option<&str>, messages: Value) -> (u16, Option<String>, Value) {
        let mut req = self.post("/v1/chat/completions", &json!({"messages": messages}));
        if let Some(t) = token {
            req = req.header("x-session-token", t);
        }
        let (status, headers, body) = send(req).await;
        let token = headers
            .get("x-session-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (status, token, body)
    }

    /// `GET /v1/sessions/{id}`, expecting 200.
    pub async fn session(&self, id: &str, token: &str) -> Value {
        let (status, _, body) = send(
            self.get(&format!("/v1/sessions/{id}"))
                .header("x-session-token", token),
        )
        .await;
        assert_eq!(status, 200, "GET session {id}: {body}");
        body
    }

    /// `GET /v1/sessions/{id}/messages` as (role, content) pairs, checking seqs increase.
    pub async fn messages(&self, id: &str, token: &str) -> Vec<(String, String)> {
        let (status, _, body) = send(
            self.get(&format!("/v1/sessions/{id}/messages?limit=1000"))
                .header("x-session-token", token),
        )
        .await;
        assert_eq!(status, 200, "GET messages of {id}: {body}");
        let items = body["messages"].as_array().expect("messages array");
        let seqs: Vec<u64> = items
            .iter()
            .map(|m| m["seq"].as_u64().expect("seq"))
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "message seqs must increase: {seqs:?}"
        );
        items.iter().map(role_content).collect()
    }

    /// `POST /v1/sbp/sessions/{id}/turns`, expecting 201; returns the body.
    pub async fn push(&self, id: &str, token: &str, content: &str) -> Value {
        let (status, _, body) = send(
            self.post(
                &format!("/v1/sbp/sessions/{id}/turns"),
                &json!({"content": content}),
            )
            .header("x-session-token", token),
        )
        .await;
        assert_eq!(status, 201, "push turn: {body}");
        body
    }

    /// Opens the session's WebSocket and sends ATTACH_SESSION; returns the socket and the
    /// SESSION_ATTACHED frame.
    pub async fn attach(&self, id: &str, token: &str) -> (Ws, Value) {
        Ws::attach(&self.ws_url, id, token, json!({})).await
    }

    /// [`Sbp::attach`] declaring `surface_context`.
    pub async fn attach_surface(
        &self,
        id: &str,
        token: &str,
        surface_context: Value,
    ) -> (Ws, Value) {
        let extra = json!({"surface_context": surface_context});
        Ws::attach(&self.ws_url, id, token, extra).await
    }

    /// Opens the session's WebSocket without sending anything.
    pub async fn connect(&self, id: &str) -> Ws {
        Ws::open(&self.ws_url, id).await
    }

    /// The replica id this gateway announced in its startup line (`replica <id> on bus ...`).
    pub fn replica_id(&self) -> String {
        let mut words = self.banner.split_whitespace();
        words
            .by_ref()
            .find(|w| *w == "replica")
            .unwrap_or_else(|| panic!("no replica id in the startup line: {}", self.banner));
        words.next().expect("the id after 'replica'").to_owned()
    }

    /// `GET /metrics` text, expecting 200.
    pub async fn metrics(&self) -> String {
        let resp = tokio::time::timeout(WAIT, self.get("/metrics").send())
            .await
            .expect("metrics within the wait")
            .expect("metrics request");
        assert_eq!(resp.status(), 200);
        resp.text().await.expect("metrics body")
    }
}

/// A chat message as (role, text content); a message without text (only tool calls) gives "".
pub fn role_content(m: &Value) -> (String, String) {
    let content = match &m["content"] {
        Value::Null => "",
        c => c.as_str().expect("text content"),
    };
    (
        m["role"].as_str().expect("role").to_owned(),
        content.to_owned(),
    )
}

/// The assistant text of a completion body.
pub fn reply_text(body: &Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no reply text in {body}"))
        .to_owned()
}

pub fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// Runs SQL with the machine's psql (installed with PostgreSQL by scripts/services.sh).
pub fn psql(url: &str, sql: &str) {
    let out = Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-qc", sql])
        .output()
        .expect("psql runs (scripts/services.sh installs PostgreSQL and its client)");
    assert!(
        out.status.success(),
        "psql {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A name part unique to this process and moment, for schemas and key prefixes (the counter
/// tells apart tests that run at once in one process, as under `cargo test`).
pub fn unique_suffix() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{:x}{:x}{n}", nanos, std::process::id())
}

/// One deployment of replicas: a fresh PostgreSQL schema, a bus prefix of its own on the
/// machine's Redis, one signing secret, and short heartbeats (0.2 s; dead after 1 s) so that
/// failover happens within a test. Dropping it drops the schema and the bus's keys (drop it after
/// its replicas, i.e. declare it before them).
pub struct Deployment {
    base: String,
    schema: String,
    /// `--database` of every replica.
    pub database: String,
    /// `--bus-prefix` of every replica.
    pub prefix: String,
    redis: String,
    secret: String,
    llm_base_url: Option<String>,
    /// `--replica-heartbeat` and `--replica-timeout` of every replica, in seconds.
    heartbeat: (String, String),
    dir: tempfile::TempDir,
}

impl Deployment {
    /// A deployment whose replicas use the upstream at `llm_base_url` (else `sbp/echo`).
    pub fn new(llm_base_url: Option<&str>) -> Self {
        let base = test_database_url();
        let unique = unique_suffix();
        let schema = format!("sbp_rep_{unique}");
        psql(&base, &format!("CREATE SCHEMA {schema}"));
        let database = format!("{base}?options=-c%20search_path%3D{schema}");
        Self {
            base,
            schema,
            database,
            prefix: format!("sbp-test-{unique}:"),
            redis: test_redis_url(),
            secret: format!("replicas-share-this-secret-{unique}"),
            llm_base_url: llm_base_url.map(str::to_owned),
            heartbeat: ("0.2".to_owned(), "1".to_owned()),
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    /// Replicas heartbeat (and reconcile the surface registry) every `every` seconds and count
    /// as dead after `dead_after`: for tests of what must happen before a replica's next pass.
    pub fn with_heartbeat(mut self, every: &str, dead_after: &str) -> Self {
        self.heartbeat = (every.to_owned(), dead_after.to_owned());
        self
    }

    /// The flags of replica `name`.
    pub fn args(&self, name: &str) -> Vec<String> {
        let mut args: Vec<String> = [
            "--database",
            &self.database,
            "--bus",
            &self.redis,
            "--bus-prefix",
            &self.prefix,
            "--replica-name",
            name,
            "--replica-heartbeat",
            &self.heartbeat.0,
            "--replica-timeout",
            &self.heartbeat.1,
            "--jwt-secret",
            &self.secret,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if let Some(url) = &self.llm_base_url {
            args.extend(["--llm-base-url".to_owned(), url.clone()]);
        }
        args
    }

    /// Starts replica `name` and waits for its startup line.
    pub async fn replica(&self, name: &str) -> Sbp {
        let args = self.args(name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let gw = Sbp::start(&self.dir.path().join(name), &args).await;
        assert!(
            gw.banner.contains(&format!("replica {name}-")),
            "{}",
            gw.banner
        );
        gw
    }

    /// Cuts replica process `pid`'s pub/sub connection to Redis (`CLIENT KILL`), as a network blip
    /// would; its bus reconnects by itself. Returns how many connections were cut.
    pub fn cut_subscription(&self, pid: u32) -> usize {
        pubsub_clients(&self.redis, pid)
            .iter()
            .filter(|id| kill_client(&self.redis, id))
            .count()
    }

    /// Keeps cutting replica process `pid`'s pub/sub connection, each time it comes back, until
    /// [`Cutting::stop`]: whatever is published to it meanwhile is lost. (A single cut leaves
    /// only the bus's first reconnect pause, 100 ms, which a slow step can outlast.)
    pub fn keep_cutting_subscription(&self, pid: u32) -> Cutting {
        // The first cut before returning: the connection is down when the caller goes on.
        let first = self.cut_subscription(pid);
        assert!(first > 0, "process {pid} has no pub/sub connection to cut");
        let stop = Arc::new(AtomicBool::new(false));
        let (redis, flag) = (self.redis.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut cut = first;
            while !flag.load(Ordering::Relaxed) {
                // No pause: listing the clients takes a few ms, so the connection is never back
                // for longer than that.
                for id in pubsub_clients(&redis, pid) {
                    // It may have gone by itself meanwhile.
                    if kill_client(&redis, &id) {
                        cut += 1;
                    }
                }
            }
            cut
        });
        Cutting {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        // Best effort and never panicking: this also runs while a failed test unwinds.
        let _ = Command::new("psql")
            .args([
                &self.base,
                "-qc",
                &format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema),
            ])
            .output();
        let _ = delete_prefix_blocking(&self.redis, &self.prefix);
    }
}

/// A subscription being cut by [`Deployment::keep_cutting_subscription`]; dropping it stops the
/// cutting too.
pub struct Cutting {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<usize>>,
}

impl Cutting {
    /// Stops cutting; returns how many times the connection was cut.
    pub fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .map_or(0, |t| t.join().expect("the cutting thread"))
    }
}

impl Drop for Cutting {
    fn drop(&mut self) {
        // Never panicking here: this also runs while a failed test unwinds.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The port of a `redis://host:port` URL (6379 if it has none).
fn redis_port(redis: &str) -> u16 {
    redis
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or(6379)
}

/// Redis client ids of process `pid`'s pub/sub connections (`CLIENT LIST TYPE pubsub`, matched
/// to the process by its local TCP ports).
fn pubsub_clients(redis: &str, pid: u32) -> Vec<String> {
    let ports = tcp_ports_to(pid, redis_port(redis));
    let out = Command::new("redis-cli")
        .args(["-u", redis, "CLIENT", "LIST", "TYPE", "pubsub"])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let field = |name: &str| {
                line.split_whitespace()
                    .find_map(|f| f.strip_prefix(name))
                    .map(str::to_owned)
            };
            let (id, addr) = (field("id=")?, field("addr=")?);
            let port: u16 = addr.rsplit(':').next()?.parse().ok()?;
            ports.contains(&port).then_some(id)
        })
        .collect()
}

/// `CLIENT KILL ID id`; false if Redis had no such client.
fn kill_client(redis: &str, id: &str) -> bool {
    let out = Command::new("redis-cli")
        .args(["-u", redis, "CLIENT", "KILL", "ID", id])
        .output()
        .expect("redis-cli runs");
    // Redis answers 1 if it closed the client, 0 if there was none.
    out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "1"
}

/// Local TCP ports of process `pid`'s connections to `remote_port` (from /proc: its socket fds'
/// inodes, looked up in /proc/net/tcp).
pub fn tcp_ports_to(pid: u32, remote_port: u16) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy().into_owned();
            t.strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(str::to_owned)
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (local, remote, inode) = (cols.get(1)?, cols.get(2)?, cols.get(9)?);
            (port(remote)? == remote_port && inodes.iter().any(|i| i == inode))
                .then(|| port(local))
                .flatten()
        })
        .collect()
}

/// `text` without ANSI colour sequences (the gateway's text logs have them).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte (a letter).
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `sbp SUBCOMMAND ARGS...` with a clean environment (no inherited `SBP_*` variable, so no
/// operator key or config slips in, and no `NO_COLOR`) and piped output.
pub fn sbp_command(subcommand: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sbp"));
    cmd.arg(subcommand).args(args);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("SBP_") {
            cmd.env_remove(key);
        }
    }
    cmd.env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// `sbp conformance ARGS...`, see [`sbp_command`].
pub fn sbp_conformance(args: &[&str]) -> Command {
    sbp_command("conformance", args)
}

/// Runs `cmd` to its end (within `within`); returns (exit code, stdout, stderr).
pub async fn run_to_end(cmd: Command, within: Duration) -> (Option<i32>, String, String) {
    let mut proc = Proc::spawn(cmd);
    let status = proc.wait_exit(within).await;
    let (out, err) = proc.output();
    (status.code(), out, err)
}
