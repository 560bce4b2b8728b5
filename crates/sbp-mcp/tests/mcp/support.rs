//! Shared test fixtures: the Python stdio server's config, a scripted `SurfaceToolHost`, and the
//! northbound service served on a real loopback port the way the gateway mounts it.

use std::{collections::HashMap, net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Router,
    extract::{Path, Request},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
};
use sbp_mcp::{
    HostError, McpSession, NorthboundOptions, ServerConfig, SurfaceToolHost, ToolOutput, ToolSpec,
    northbound_service,
};
use serde_json::{Value, json};
use tokio::{sync::Barrier, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub const TOKEN: &str = "test-token";
/// How many calls the `gather` tool waits for before any of them answers.
pub const GATHER: usize = 10;

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub fn fixture_path() -> String {
    format!(
        "{}/tests/fixtures/stdio_server.py",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `name=stdio:[prefix ]python3 '<fixture>'`, through the operator syntax.
pub fn python_server(name: &str, env_prefix: &str) -> ServerConfig {
    format!("{name}=stdio:{env_prefix} python3 '{}'", fixture_path())
        .parse()
        .expect("fixture config line parses")
}

/// Whether a process is still running (a zombie waiting for a reaper counts as gone).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits (bounded) until `pid` is gone; SIGKILL is delivered asynchronously.
pub async fn wait_gone(pid: u32) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        if !process_alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A surface host with scripted sessions.
pub struct TestHost {
    /// Sessions with a surface attached, and its tools.
    attached: HashMap<Uuid, Vec<ToolSpec>>,
    /// Sessions that exist but have no surface attached.
    detached: Vec<Uuid>,
    gather: Barrier,
}

pub struct Sessions {
    pub phone: Uuid,
    pub detached: Uuid,
}

impl TestHost {
    pub fn new() -> (Arc<TestHost>, Sessions) {
        let phone = Uuid::new_v4();
        let detached = Uuid::new_v4();
        let tools = vec![
            ToolSpec {
                name: "echo".into(),
                description: Some("Echo a text.".into()),
                input_schema: json!({
                    "type": "object",
                    "properties": {"text": {"type": "string"}},
                    "required": ["text"]
                }),
            },
            ToolSpec {
                name: "add".into(),
                description: None,
                input_schema: Value::Null,
            },
            ToolSpec {
                name: "camera".into(),
                description: Some("Take a photo.".into()),
                input_schema: Value::Null,
            },
            ToolSpec {
                name: "gather".into(),
                description: Some("Answers once enough calls are in flight.".into()),
                input_schema: Value::Null,
            },
        ];
        let host = TestHost {
            attached: HashMap::from([(phone, tools)]),
            detached: vec![detached],
            gather: Barrier::new(GATHER),
        };
        (Arc::new(host), Sessions { phone, detached })
    }
}

#[async_trait::async_trait]
impl SurfaceToolHost for TestHost {
    async fn list_tools(&self, session: Uuid) -> Result<Vec<ToolSpec>, HostError> {
        if let Some(tools) = self.attached.get(&session) {
            Ok(tools.clone())
        } else if self.detached.contains(&session) {
            Ok(Vec::new())
        } else {
            Err(HostError::NoSurface(format!("unknown session {session}")))
        }
    }

    async fn call_tool(
        &self,
        session: Uuid,
        name: &str,
        arguments: Value,
    ) -> Result<ToolOutput, HostError> {
        let Some(tools) = self.attached.get(&session) else {
            return Err(HostError::NoSurface("no surface is attached".into()));
        };
        if !tools.iter().any(|t| t.name == name) {
            return Err(HostError::UnknownTool(name.to_owned()));
        }
        match name {
            "echo" => Ok(ToolOutput::text(
                arguments["text"].as_str().unwrap_or_default(),
            )),
            "add" => {
                let sum =
                    arguments["a"].as_f64().unwrap_or(0.0) + arguments["b"].as_f64().unwrap_or(0.0);
                Ok(ToolOutput {
                    is_error: false,
                    content: json!({"sum": sum}),
                    text: sum.to_string(),
                })
            }
            "camera" => Ok(ToolOutput::error("camera permission denied by the user")),
            "gather" => {
                self.gather.wait().await;
                Ok(ToolOutput::json(json!({"n": arguments["n"]})))
            }
            other => Err(HostError::Internal(format!("tool {other} is not scripted"))),
        }
    }
}

/// The northbound service on `127.0.0.1:0`, mounted as the gateway would: a route per session
/// behind a middleware that authenticates (bearer `TOKEN`) and inserts `McpSession`.
pub struct TestServer {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl TestServer {
    pub async fn start(host: Arc<dyn SurfaceToolHost>, opts: NorthboundOptions) -> TestServer {
        let shutdown = opts.cancellation.clone();
        let app = Router::new()
            .route_service("/v1/sbp/sessions/{id}/mcp", northbound_service(host, opts))
            .route_layer(middleware::from_fn(authenticate));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("bound address");
        let stop = shutdown.clone();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .expect("test server runs");
        });
        TestServer {
            addr,
            shutdown,
            task,
        }
    }

    pub fn url(&self, session: Uuid) -> String {
        format!("http://{}/v1/sbp/sessions/{session}/mcp", self.addr)
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

async fn authenticate(Path(id): Path<Uuid>, mut request: Request, next: Next) -> Response {
    let authorized = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {TOKEN}"));
    if !authorized {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    request.extensions_mut().insert(McpSession(id));
    next.run(request).await
}

/// Polls `condition` until it holds, for at most `limit`: waiting for an event that has no
/// notification of its own (a process appearing or going away, a background reconnect).
pub async fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let check = || std::future::ready(condition().then_some(()).ok_or(()));
    sbp_test_support::poll_until_ok(limit, check).await.is_ok()
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        let path = std::env::temp_dir().join(format!("sbp-mcp-test-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self, file: &str) -> String {
        self.0.join(file).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The pids the fixture servers started with `SBP_FIXTURE_PIDFILE=<path>` wrote, in start order.
pub fn started_pids(path: &str) -> Vec<u32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| l.parse().expect("a pid per line"))
        .collect()
}

pub fn kill9(pid: u32) {
    use nix::{sys::signal::Signal, unistd::Pid};
    let raw = i32::try_from(pid).expect("pid fits i32");
    nix::sys::signal::kill(Pid::from_raw(raw), Signal::SIGKILL).expect("kill -9");
}

/// Running processes whose command line mentions `needle` (zombies have an empty one).
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .filter(|pid| process_alive(*pid))
        .collect()
}
