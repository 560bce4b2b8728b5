//! The gateway as an MCP client of operator-configured servers (stdio children and streamable HTTP).

use std::{
    collections::HashMap,
    fmt,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use process_wrap::tokio::{CommandWrap, KillOnDrop, ProcessGroup};
use rmcp::{
    RoleClient, ServiceError, ServiceExt,
    model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation},
    service::{Peer, RunningService},
    transport::{
        StreamableHttpClientTransport, TokioChildProcess,
        streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde_json::Value;
use tokio::{io::AsyncBufReadExt, sync::Mutex, task::JoinHandle};

use crate::{ServerConfig, ServerTransport, ToolOutput, ToolSpec};

/// How long `shutdown` waits for one server to close before giving up on it. rmcp's own stdio
/// sequence (close stdin, 3 s, SIGTERM, 3 s, SIGKILL) fits inside.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for a child's last stderr lines after it exited, so they are logged before
/// (not after) the error that explains them.
const STDERR_DRAIN_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a southbound call failed. Tool-level failures are not errors: they come back as
/// `Ok(ToolOutput { is_error: true, .. })`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum McpError {
    #[error("no connected MCP server named {0:?}")]
    UnknownServer(String),
    #[error("MCP server {server:?} has no tool {tool:?}")]
    UnknownTool { server: String, tool: String },
    #[error("tool arguments must be a JSON object")]
    InvalidArguments,
    #[error("call to {server}/{tool} timed out after {timeout:?}")]
    Timeout {
        server: String,
        tool: String,
        timeout: Duration,
    },
    /// The server answered the call with a JSON-RPC error.
    #[error("MCP server {server:?} rejected the call ({code}): {message}")]
    Rpc {
        server: String,
        code: i32,
        message: String,
    },
    /// The connection failed or the server answered something that is not a tool result.
    #[error("MCP server {server:?} failed: {message}")]
    Transport { server: String, message: String },
    #[error("MCP server {0:?} is shut down")]
    Closed(String),
}

/// A set of connected MCP servers. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct Southbound {
    inner: Arc<Inner>,
}

struct Inner {
    /// In configuration order, so `tools()` is stable.
    servers: Vec<Arc<Connection>>,
    by_name: HashMap<String, Arc<Connection>>,
    closed: AtomicBool,
}

struct Connection {
    name: String,
    tools: Vec<ToolSpec>,
    /// Calls go through a clone of the peer, so they never wait on the lock below.
    peer: Peer<RoleClient>,
    running: Mutex<Option<RunningService<RoleClient, ClientConfig>>>,
    /// stdio only: the child's pid, which is also its process group id.
    process_group: Option<u32>,
    stderr_task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for Southbound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Southbound")
            .field(
                "servers",
                &self
                    .inner
                    .servers
                    .iter()
                    .map(|c| (&c.name, c.tools.len()))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("duplicate server name")]
    Duplicate,
    #[error("could not start {command:?}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("initialize failed: {0}")]
    Initialize(String),
    #[error("tools/list failed: {0}")]
    ListTools(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl Southbound {
    /// Connects to every server (initialize + tools/list), concurrently, each bounded by
    /// `connect_timeout`. A server that fails is logged (warn, with the error) and left out; it never
    /// fails the whole call. Later duplicates of a server name are left out the same way.
    pub async fn connect(configs: Vec<ServerConfig>, connect_timeout: Duration) -> Southbound {
        let mut seen = std::collections::HashSet::new();
        let attempts = configs.into_iter().map(|config| {
            let duplicate = !seen.insert(config.name.clone());
            async move {
                let name = config.name.clone();
                let result = if duplicate {
                    Err(ConnectError::Duplicate)
                } else {
                    connect_one(config, connect_timeout).await
                };
                (name, result)
            }
        });
        let results = futures::future::join_all(attempts).await;

        let mut servers = Vec::new();
        for (name, result) in results {
            match result {
                Ok(connection) => {
                    tracing::info!(server = %name, tools = connection.tools.len(), "MCP server connected");
                    servers.push(Arc::new(connection));
                }
                Err(error) => {
                    tracing::warn!(server = %name, %error, "MCP server left out");
                }
            }
        }
        let by_name = servers
            .iter()
            .map(|c| (c.name.clone(), Arc::clone(c)))
            .collect();
        Southbound {
            inner: Arc::new(Inner {
                servers,
                by_name,
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// No servers.
    pub fn empty() -> Southbound {
        Southbound {
            inner: Arc::new(Inner {
                servers: Vec::new(),
                by_name: HashMap::new(),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// Every tool of every connected server, as (server name, spec), as listed at connect time.
    pub fn tools(&self) -> Vec<(String, ToolSpec)> {
        self.inner
            .servers
            .iter()
            .flat_map(|c| c.tools.iter().map(|t| (c.name.clone(), t.clone())))
            .collect()
    }

    /// Names of the connected servers, in configuration order.
    pub fn servers(&self) -> Vec<String> {
        self.inner.servers.iter().map(|c| c.name.clone()).collect()
    }

    /// Calls a tool; the outcome text/JSON for the LLM, or an error. Bounded by `timeout`; on
    /// timeout the server is sent `notifications/cancelled`. `arguments` must be an object (or null).
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<ToolOutput, McpError> {
        let connection = self
            .inner
            .by_name
            .get(server)
            .ok_or_else(|| McpError::UnknownServer(server.to_owned()))?;
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(McpError::Closed(server.to_owned()));
        }
        if !connection.tools.iter().any(|t| t.name == tool) {
            return Err(McpError::UnknownTool {
                server: server.to_owned(),
                tool: tool.to_owned(),
            });
        }
        let mut params = CallToolRequestParams::new(tool.to_owned());
        match arguments {
            Value::Object(arguments) => params = params.with_arguments(arguments),
            Value::Null => {}
            _ => return Err(McpError::InvalidArguments),
        }

        let outcome = tokio::time::timeout(timeout, connection.peer.call_tool(params)).await;
        match outcome {
            Err(_elapsed) => {
                tracing::warn!(server = %server, tool = %tool, ?timeout, "MCP tool call timed out");
                Err(McpError::Timeout {
                    server: server.to_owned(),
                    tool: tool.to_owned(),
                    timeout,
                })
            }
            Ok(Ok(result)) => {
                let output = ToolOutput::from_mcp(result);
                tracing::debug!(server = %server, tool = %tool, is_error = output.is_error, "MCP tool call done");
                Ok(output)
            }
            Ok(Err(error)) => {
                tracing::warn!(server = %server, tool = %tool, %error, "MCP tool call failed");
                Err(self.map_service_error(server, error))
            }
        }
    }

    fn map_service_error(&self, server: &str, error: ServiceError) -> McpError {
        match error {
            ServiceError::McpError(data) => McpError::Rpc {
                server: server.to_owned(),
                code: data.code.0,
                message: data.message.into_owned(),
            },
            ServiceError::TransportClosed if self.inner.closed.load(Ordering::Acquire) => {
                McpError::Closed(server.to_owned())
            }
            other => McpError::Transport {
                server: server.to_owned(),
                message: other.to_string(),
            },
        }
    }

    /// Closes every connection, concurrently. stdio children get the MCP shutdown sequence (stdin
    /// closed, then SIGTERM, then SIGKILL, to their whole process group) and are reaped before this
    /// returns. Calls made afterwards fail with [`McpError::Closed`]. Idempotent.
    pub async fn shutdown(&self) {
        self.inner.closed.store(true, Ordering::Release);
        futures::future::join_all(self.inner.servers.iter().map(|c| c.close())).await;
    }
}

impl Connection {
    async fn close(&self) {
        // Taking the service makes a second shutdown (or a concurrent one) a no-op.
        let Some(mut running) = self.running.lock().await.take() else {
            return;
        };
        match running.close_with_timeout(CLOSE_TIMEOUT).await {
            Ok(Some(reason)) => {
                tracing::info!(server = %self.name, ?reason, "MCP server closed");
            }
            Ok(None) => {
                tracing::warn!(server = %self.name, timeout = ?CLOSE_TIMEOUT, "MCP server did not close in time");
            }
            Err(error) => {
                tracing::warn!(server = %self.name, %error, "MCP server task failed while closing");
            }
        }
        if let Some(pgid) = self.process_group {
            sweep_process_group(&self.name, pgid);
        }
        let stderr_task = self.stderr_task.lock().await.take();
        if let Some(task) = stderr_task {
            drain_stderr(task).await;
        }
    }
}

fn client_config() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("sbp-gateway", env!("CARGO_PKG_VERSION")),
    )
}

async fn drain_stderr(mut task: JoinHandle<()>) {
    if tokio::time::timeout(STDERR_DRAIN_TIMEOUT, &mut task)
        .await
        .is_err()
    {
        // A grandchild that escaped the process group may still hold the pipe open.
        task.abort();
    }
}

async fn connect_one(config: ServerConfig, timeout: Duration) -> Result<Connection, ConnectError> {
    let ServerConfig { name, transport } = config;
    // One deadline for the whole handshake: spawn/dial, initialize and tools/list.
    let deadline = tokio::time::Instant::now() + timeout;
    let mut process_group = None;
    let (transport_running, stderr_task) = match transport {
        ServerTransport::Stdio { command, args, env } => {
            let mut cmd = tokio::process::Command::new(&command);
            cmd.args(&args).envs(env);
            let mut wrapped = CommandWrap::from(cmd);
            // Own process group: shutdown signals reach the server's own children too.
            wrapped.wrap(ProcessGroup::leader());
            // Backstop for a Connection dropped without shutdown() outside a runtime.
            wrapped.wrap(KillOnDrop);
            let (process, stderr) = TokioChildProcess::builder(wrapped)
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|source| ConnectError::Spawn {
                    command: command.clone(),
                    source,
                })?;
            process_group = process.id();
            tracing::debug!(server = %name, pid = process.id(), %command, "MCP server started");
            let stderr_task = stderr.map(|stderr| spawn_stderr_logger(name.clone(), stderr));
            let running = tokio::time::timeout_at(deadline, client_config().serve(process)).await;
            (running, stderr_task)
        }
        ServerTransport::Http { url, bearer } => {
            let mut http_config = StreamableHttpClientTransportConfig::with_uri(url);
            if let Some(token) = bearer {
                http_config = http_config.auth_header(token);
            }
            let transport = StreamableHttpClientTransport::from_config(http_config);
            let running = tokio::time::timeout_at(deadline, client_config().serve(transport)).await;
            (running, None)
        }
    };

    // On failure the transport has been dropped, which kills a child; let its last stderr lines
    // reach the log before the warning that the server was left out.
    let fail = |error: ConnectError, stderr_task: Option<JoinHandle<()>>| async move {
        if let Some(task) = stderr_task {
            drain_stderr(task).await;
        }
        Err(error)
    };
    let running = match transport_running {
        Err(_elapsed) => return fail(ConnectError::Timeout(timeout), stderr_task).await,
        Ok(Err(error)) => {
            return fail(ConnectError::Initialize(error.to_string()), stderr_task).await;
        }
        Ok(Ok(running)) => running,
    };

    let tools = match tokio::time::timeout_at(deadline, running.peer().list_all_tools()).await {
        Ok(Ok(tools)) => tools,
        Ok(Err(error)) => {
            let error = ConnectError::ListTools(error.to_string());
            let _ = running.cancel().await;
            return fail(error, stderr_task).await;
        }
        Err(_elapsed) => {
            let _ = running.cancel().await;
            return fail(ConnectError::Timeout(timeout), stderr_task).await;
        }
    };
    let tools = tools.iter().map(ToolSpec::from_mcp).collect();
    Ok(Connection {
        name,
        tools,
        peer: running.peer().clone(),
        running: Mutex::new(Some(running)),
        process_group,
        stderr_task: Mutex::new(stderr_task),
    })
}

/// Re-logs a child's stderr line by line; ends when the child closes it (exits).
fn spawn_stderr_logger(server: String, stderr: tokio::process::ChildStderr) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    tracing::info!(target: "sbp_mcp::server_stderr", server = %server, %line);
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::debug!(server = %server, %error, "MCP server stderr unreadable");
                    break;
                }
            }
        }
    })
}

/// After a clean exit rmcp has reaped the server but not what it started (the MCP shutdown sequence
/// signals only a server that does not exit). Whatever is left in its process group is killed here.
/// The group id cannot have been reused: the kernel keeps a pid allocated while it names a group.
#[cfg(unix)]
fn sweep_process_group(server: &str, pgid: u32) {
    use nix::{errno::Errno, sys::signal::Signal, unistd::Pid};
    let Ok(raw) = i32::try_from(pgid) else {
        return;
    };
    match nix::sys::signal::killpg(Pid::from_raw(raw), Signal::SIGKILL) {
        Ok(()) => {
            tracing::info!(server = %server, pgid, "killed processes left behind by MCP server")
        }
        Err(Errno::ESRCH) => {}
        Err(error) => {
            tracing::warn!(server = %server, pgid, %error, "could not sweep MCP server's process group")
        }
    }
}

#[cfg(not(unix))]
fn sweep_process_group(_server: &str, _pgid: u32) {}
