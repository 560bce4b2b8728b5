//! The gateway as an MCP client of operator-configured servers (stdio children and streamable HTTP),
//! kept connected: a server that is down is reconnected with a backoff, by calls and in the background.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    process::Stdio,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use process_wrap::tokio::{CommandWrap, KillOnDrop, ProcessGroup};
use rmcp::{
    RoleClient, ServiceError, ServiceExt,
    model::{
        CallToolRequest, CallToolRequestParams, CancelledNotificationParam, ClientCapabilities,
        ClientConfig, ClientRequest, Implementation, RequestId, ServerResult,
    },
    service::{Peer, PeerRequestOptions, RunningService},
    transport::{
        StreamableHttpClientTransport, TokioChildProcess,
        streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde_json::Value;
use tokio::{
    io::AsyncBufReadExt,
    sync::{Notify, watch},
    time::Instant,
};
use tokio_util::{
    sync::CancellationToken,
    task::{AbortOnDropHandle, TaskTracker},
};

use crate::{ServerConfig, ServerTransport, ToolOutput, ToolSpec};

/// The least time between two reconnect attempts of one server. It doubles after every failed
/// attempt, up to [`RECONNECT_BACKOFF_MAX`], and is back to this after a successful one.
pub const RECONNECT_BACKOFF: Duration = Duration::from_secs(2);
/// The longest wait between two reconnect attempts of a server that keeps failing.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(60);

/// How long closing one connection may take before giving up on it. rmcp's own stdio sequence
/// (close stdin, 3 s, SIGTERM, 3 s, SIGKILL) fits inside.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for a child's last stderr lines after it exited, so they are logged before
/// (not after) the error that explains them.
const STDERR_DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the `notifications/cancelled` for a call abandoned by its caller may take to send.
const CANCEL_NOTIFY_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a southbound call failed. Tool-level failures are not errors: they come back as
/// `Ok(ToolOutput { is_error: true, .. })`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum McpError {
    /// No server of this name is configured.
    #[error("no MCP server named {0:?} is configured")]
    UnknownServer(String),
    #[error("MCP server {server:?} has no tool {tool:?}")]
    UnknownTool { server: String, tool: String },
    #[error("tool arguments must be a JSON object")]
    InvalidArguments,
    /// No answer within the call's timeout (which includes waiting for a reconnect).
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
    /// The connection failed during the call, or the server answered something that is not a tool
    /// result. The message says whether the server may have run the call.
    #[error("MCP server {server:?} failed: {message}")]
    Transport { server: String, message: String },
    /// The server is down and could not be reconnected now (the call's own reconnect failed, or a
    /// reconnect was tried less than the backoff ago). Nothing was sent; the server is retried in
    /// the background.
    #[error(
        "MCP server {server:?} is unavailable ({reason}); next reconnect attempt in {retry_in:?}"
    )]
    Unavailable {
        server: String,
        reason: String,
        retry_in: Duration,
    },
    #[error("MCP server {0:?} is shut down")]
    Closed(String),
}

/// The configured MCP servers and their connections. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct Southbound {
    inner: Arc<Inner>,
}

struct Inner {
    /// Every configured server (the first of each name), connected or not, in configuration order,
    /// so `tools()` is stable.
    servers: Vec<Arc<Server>>,
    by_name: HashMap<String, Arc<Server>>,
    shared: Arc<Shared>,
}

/// Dropping the last handle without `shutdown()` still stops the background tasks (and so closes the
/// connections); only `shutdown()` waits for that to finish.
impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.closed.cancel();
    }
}

/// What the background tasks need. They hold this and their `Server`s, never `Inner`, so that they
/// do not keep a dropped `Southbound` alive.
struct Shared {
    /// Cancelled by `shutdown`: stops the supervisor and attempts, and closes every connection.
    closed: CancellationToken,
    /// The supervisor, connection attempts, one task per live connection, and cancellation notices.
    tasks: TaskTracker,
    /// Wakes the supervisor when a server went down (a connection ended, or an attempt failed).
    wake: Notify,
    connect_timeout: Duration,
}

/// One configured server and its current connection, if any.
struct Server {
    config: ServerConfig,
    state: Mutex<ServerState>,
    /// Counts finished connection attempts; calls waiting for an attempt watch it.
    attempts_done: watch::Sender<u64>,
}

#[derive(Default)]
struct ServerState {
    connection: Option<Arc<Connection>>,
    /// An attempt is running; whoever else wants the server waits for it (one child per server).
    connecting: bool,
    /// When the last attempt ended (or started, while it runs); a successful initial connect does
    /// not count.
    last_attempt: Option<Instant>,
    /// Failed attempts since the last success.
    failures: u32,
    last_error: Option<String>,
}

/// One established connection (one child process, or one HTTP session). Its task owns rmcp's
/// `RunningService` and closes it when the connection is retired or shut down.
struct Connection {
    tools: Vec<ToolSpec>,
    /// Calls go through a clone of the peer, so they never wait on anything else.
    peer: Peer<RoleClient>,
    /// Cancelled to retire the connection (a child of `Shared::closed`).
    retire: CancellationToken,
    /// stdio only: the child's pid, which is also its process group id.
    pid: Option<u32>,
    stdio: bool,
}

impl Connection {
    fn is_alive(&self) -> bool {
        !self.retire.is_cancelled() && !self.peer.is_transport_closed()
    }
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
                    .map(|s| (s.name(), s.live().map(|c| c.tools.len())))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnectError {
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
    #[error("shutting down")]
    ShuttingDown,
}

impl Southbound {
    /// Connects to every server (initialize + tools/list), concurrently, each bounded by
    /// `connect_timeout`, and starts the background task that reconnects servers that are down.
    /// A server that fails is logged (warn, with the error) and retried in the background
    /// ([`RECONNECT_BACKOFF`] after this attempt, then backing off); it never fails the whole call.
    /// A later duplicate of a server name is logged and left out for good.
    pub async fn connect(configs: Vec<ServerConfig>, connect_timeout: Duration) -> Southbound {
        let mut seen = HashSet::new();
        let mut servers = Vec::new();
        for config in configs {
            if seen.insert(config.name.clone()) {
                servers.push(Arc::new(Server {
                    config,
                    state: Mutex::default(),
                    attempts_done: watch::channel(0).0,
                }));
            } else {
                tracing::warn!(server = %config.name, "duplicate MCP server name left out");
            }
        }
        let shared = Arc::new(Shared {
            closed: CancellationToken::new(),
            tasks: TaskTracker::new(),
            wake: Notify::new(),
            connect_timeout,
        });

        let initial =
            servers
                .iter()
                .filter_map(|server| match server.begin(&shared, Instant::now(), true) {
                    Begin::Wait(mut done) => Some(async move {
                        let _ = done.changed().await;
                    }),
                    _ => None,
                });
        futures::future::join_all(initial).await;

        shared
            .tasks
            .spawn(supervise(servers.clone(), Arc::clone(&shared)));
        let by_name = servers
            .iter()
            .map(|s| (s.name().to_owned(), Arc::clone(s)))
            .collect();
        Southbound {
            inner: Arc::new(Inner {
                servers,
                by_name,
                shared,
            }),
        }
    }

    /// No servers.
    pub fn empty() -> Southbound {
        Southbound {
            inner: Arc::new(Inner {
                servers: Vec::new(),
                by_name: HashMap::new(),
                shared: Arc::new(Shared {
                    closed: CancellationToken::new(),
                    tasks: TaskTracker::new(),
                    wake: Notify::new(),
                    connect_timeout: Duration::ZERO,
                }),
            }),
        }
    }

    /// Every tool of every server connected now, as (server name, spec), in configuration order,
    /// as each server listed them when it last (re)connected.
    pub fn tools(&self) -> Vec<(String, ToolSpec)> {
        self.inner
            .servers
            .iter()
            .filter_map(|s| s.live().map(|c| (s.name(), c)))
            .flat_map(|(name, c)| {
                c.tools
                    .iter()
                    .map(|t| (name.to_owned(), t.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Names of the servers connected now, in configuration order.
    pub fn servers(&self) -> Vec<String> {
        self.inner
            .servers
            .iter()
            .filter(|s| s.live().is_some())
            .map(|s| s.name().to_owned())
            .collect()
    }

    /// For tests: the pid of a stdio server's current child, if it is connected.
    #[doc(hidden)]
    pub fn child_pid(&self, server: &str) -> Option<u32> {
        self.inner.by_name.get(server)?.live()?.pid
    }

    /// For tests: how many background tasks (supervisor, attempts, connections) are running.
    #[doc(hidden)]
    pub fn background_tasks(&self) -> usize {
        self.inner.shared.tasks.len()
    }

    /// Calls a tool; the outcome text/JSON for the LLM, or an error. Bounded by `timeout`, which
    /// includes waiting for a reconnect; on timeout the server is sent `notifications/cancelled`.
    /// `arguments` must be an object (or null).
    ///
    /// A server that is down is reconnected first (once, unless a reconnect was tried less than the
    /// backoff ago: then [`McpError::Unavailable`] at once). A call is retried, once, on a new
    /// connection only if it never reached the old one; see the crate docs for the exact rule.
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<ToolOutput, McpError> {
        let target = self
            .inner
            .by_name
            .get(server)
            .ok_or_else(|| McpError::UnknownServer(server.to_owned()))?;
        if self.inner.shared.closed.is_cancelled() {
            return Err(McpError::Closed(server.to_owned()));
        }
        let mut params = CallToolRequestParams::new(tool.to_owned());
        match arguments {
            Value::Object(arguments) => params = params.with_arguments(arguments),
            Value::Null => {}
            _ => return Err(McpError::InvalidArguments),
        }
        let call = Call {
            server: target,
            tool,
            timeout,
            deadline: Instant::now() + timeout,
            shared: &self.inner.shared,
        };

        let connection = call.connection().await?;
        let first = call.send(&connection, params.clone()).await;
        let reason = match first {
            Outcome::Done(result) => return result,
            Outcome::Lost(message) => {
                target.retire(&connection, &self.inner.shared);
                return Err(call.lost(message));
            }
            Outcome::NotDelivered(reason) => reason,
        };
        target.retire(&connection, &self.inner.shared);
        tracing::info!(server = %server, tool = %tool, %reason, "MCP server connection was dead before the call reached it; reconnecting to retry it once");
        let connection = call.connection().await?;
        match call.send(&connection, params).await {
            Outcome::Done(result) => result,
            Outcome::NotDelivered(message) | Outcome::Lost(message) => {
                target.retire(&connection, &self.inner.shared);
                Err(call.lost(message))
            }
        }
    }

    /// Stops the background task and closes every connection, concurrently; connection attempts
    /// in progress are abandoned (their children killed). stdio children get the MCP shutdown
    /// sequence (stdin closed, then SIGTERM, then SIGKILL, to their whole process group) and are
    /// reaped before this returns. Calls made afterwards fail with [`McpError::Closed`]. Idempotent.
    pub async fn shutdown(&self) {
        let shared = &self.inner.shared;
        shared.closed.cancel();
        shared.tasks.close();
        shared.tasks.wait().await;
    }
}

/// One call to `server`/`tool`, with its deadline.
struct Call<'a> {
    server: &'a Arc<Server>,
    tool: &'a str,
    timeout: Duration,
    deadline: Instant,
    shared: &'a Arc<Shared>,
}

/// How one attempt to send a call ended.
enum Outcome {
    /// An answer (a result, a tool error, an RPC error) or a failure that says nothing about the
    /// connection (timeout, unexpected response).
    Done(Result<ToolOutput, McpError>),
    /// The connection was dead and the request provably never reached the server.
    NotDelivered(String),
    /// The connection failed after the request was handed to it: the server may have run it.
    Lost(String),
}

impl Call<'_> {
    fn name(&self) -> &str {
        self.server.name()
    }

    fn timed_out(&self) -> McpError {
        tracing::warn!(server = %self.name(), tool = %self.tool, timeout = ?self.timeout, "MCP tool call timed out");
        McpError::Timeout {
            server: self.name().to_owned(),
            tool: self.tool.to_owned(),
            timeout: self.timeout,
        }
    }

    fn closed(&self) -> McpError {
        McpError::Closed(self.name().to_owned())
    }

    fn lost(&self, message: String) -> McpError {
        if self.shared.closed.is_cancelled() {
            return self.closed();
        }
        tracing::warn!(server = %self.name(), tool = %self.tool, error = %message, "MCP tool call failed; the connection will be rebuilt");
        McpError::Transport {
            server: self.name().to_owned(),
            message: format!(
                "connection lost before an answer; the server may have run the call, so it was not retried ({message})"
            ),
        }
    }

    /// A live connection with the tool: the current one, or the outcome of the (single) reconnect
    /// attempt that this call starts or joins.
    async fn connection(&self) -> Result<Arc<Connection>, McpError> {
        let now = Instant::now();
        let connection = match self.server.begin(self.shared, now, false) {
            Begin::Live(connection) => connection,
            Begin::Closed => return Err(self.closed()),
            Begin::NotBefore { at, reason } => {
                return Err(McpError::Unavailable {
                    server: self.name().to_owned(),
                    reason,
                    retry_in: at.saturating_duration_since(now),
                });
            }
            Begin::Wait(mut done) => {
                if tokio::time::timeout_at(self.deadline, done.changed())
                    .await
                    .is_err()
                {
                    return Err(self.timed_out());
                }
                if self.shared.closed.is_cancelled() {
                    return Err(self.closed());
                }
                let mut state = self.server.lock();
                match state.live() {
                    Some(connection) => connection,
                    None => {
                        return Err(McpError::Unavailable {
                            server: self.name().to_owned(),
                            reason: state
                                .last_error
                                .clone()
                                .unwrap_or_else(|| "connection lost".into()),
                            retry_in: state
                                .next_attempt_at()
                                .map_or(Duration::ZERO, |at| at.saturating_duration_since(now)),
                        });
                    }
                }
            }
        };
        if !connection.tools.iter().any(|t| t.name == self.tool) {
            return Err(McpError::UnknownTool {
                server: self.name().to_owned(),
                tool: self.tool.to_owned(),
            });
        }
        Ok(connection)
    }

    /// Sends the call on `connection` and waits for its answer, telling apart a request that never
    /// left (rmcp's service loop had ended, or the child had closed its stdin) from one that did.
    async fn send(&self, connection: &Connection, params: CallToolRequestParams) -> Outcome {
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
        let exchange = async {
            // rmcp's own timeout sends `notifications/cancelled` when it fires.
            let handle = match connection
                .peer
                .send_request_with_option(request, PeerRequestOptions::with_timeout(remaining))
                .await
            {
                Ok(handle) => handle,
                // The service loop is gone: the request was never queued for the transport.
                Err(ServiceError::TransportClosed) => {
                    return Outcome::NotDelivered("connection closed".into());
                }
                Err(other) => return self.answer(Err(other), connection),
            };
            let mut guard = CancelOnDrop {
                peer: &connection.peer,
                id: Some(handle.id.clone()),
                tasks: &self.shared.tasks,
            };
            let result = handle.await_response().await;
            guard.id = None;
            self.answer(result, connection)
        };
        // Backstop for a wedged service loop; dropping `exchange` sends the cancellation.
        match tokio::time::timeout_at(self.deadline, exchange).await {
            Ok(outcome) => outcome,
            Err(_elapsed) => Outcome::Done(Err(self.timed_out())),
        }
    }

    fn answer(
        &self,
        result: Result<ServerResult, ServiceError>,
        connection: &Connection,
    ) -> Outcome {
        let server = self.name().to_owned();
        match result {
            Ok(ServerResult::CallToolResult(result)) => {
                let output = ToolOutput::from_mcp(result);
                tracing::debug!(server = %server, tool = %self.tool, is_error = output.is_error, "MCP tool call done");
                Outcome::Done(Ok(output))
            }
            Ok(_other) => Outcome::Done(Err(McpError::Transport {
                server,
                message: "the answer to tools/call is not a tool result".into(),
            })),
            Err(ServiceError::McpError(data)) => {
                tracing::warn!(server = %server, tool = %self.tool, code = data.code.0, message = %data.message, "MCP tool call rejected");
                Outcome::Done(Err(McpError::Rpc {
                    server,
                    code: data.code.0,
                    message: data.message.into_owned(),
                }))
            }
            Err(ServiceError::Timeout { .. }) => Outcome::Done(Err(self.timed_out())),
            // The request was queued; whether it was written before the connection ended is unknown.
            Err(ServiceError::TransportClosed) => Outcome::Lost("transport closed".into()),
            Err(ServiceError::TransportSend(error)) => {
                let message = error.to_string();
                // Writing to a child's stdin fails only once nobody can read it any more: no
                // complete request line reached the server. An HTTP POST may have reached it.
                let unread = connection.stdio
                    && error
                        .error
                        .downcast_ref::<std::io::Error>()
                        .is_some_and(|e| {
                            matches!(
                                e.kind(),
                                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::NotConnected
                            )
                        });
                if unread {
                    Outcome::NotDelivered(message)
                } else {
                    Outcome::Lost(message)
                }
            }
            Err(other) => {
                tracing::warn!(server = %server, tool = %self.tool, error = %other, "MCP tool call failed");
                Outcome::Done(Err(McpError::Transport {
                    server,
                    message: other.to_string(),
                }))
            }
        }
    }
}

/// Tells the server that a call's caller went away (its future was dropped) before the answer.
struct CancelOnDrop<'a> {
    peer: &'a Peer<RoleClient>,
    id: Option<RequestId>,
    tasks: &'a TaskTracker,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else {
            return;
        };
        // Outside a runtime (it is being torn down) there is nobody left to notify.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let peer = self.peer.clone();
        let reason = "request abandoned by the caller".to_owned();
        self.tasks.spawn_on(
            async move {
                let notice =
                    peer.notify_cancelled(CancelledNotificationParam::new(Some(id), Some(reason)));
                let _ = tokio::time::timeout(CANCEL_NOTIFY_TIMEOUT, notice).await;
            },
            &runtime,
        );
    }
}

/// What asking a server for a connection found.
enum Begin {
    Live(Arc<Connection>),
    /// An attempt is running (maybe just started by this request); it bumps the counter when done.
    Wait(watch::Receiver<u64>),
    /// Down, and the backoff since the last attempt has not elapsed.
    NotBefore {
        at: Instant,
        reason: String,
    },
    Closed,
}

impl Server {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn lock(&self) -> MutexGuard<'_, ServerState> {
        // The state is consistent after every statement, so a panic elsewhere cannot corrupt it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn live(&self) -> Option<Arc<Connection>> {
        self.lock().live()
    }

    /// The live connection, or the attempt to wait for: a running one, or a new one if the backoff
    /// allows. Deciding and marking `connecting` under one lock is what keeps it to one attempt
    /// (one child) per server, whoever asks (calls, the supervisor).
    fn begin(self: &Arc<Self>, shared: &Arc<Shared>, now: Instant, initial: bool) -> Begin {
        if shared.closed.is_cancelled() {
            return Begin::Closed;
        }
        let mut state = self.lock();
        if let Some(connection) = state.live() {
            return Begin::Live(connection);
        }
        if !state.connecting {
            if let Some(at) = state.next_attempt_at().filter(|at| *at > now) {
                return Begin::NotBefore {
                    at,
                    reason: state
                        .last_error
                        .clone()
                        .unwrap_or_else(|| "connection lost".into()),
                };
            }
            state.connecting = true;
            state.last_attempt = Some(now);
            let server = Arc::clone(self);
            shared
                .tasks
                .spawn(server.attempt(Arc::clone(shared), initial));
        }
        Begin::Wait(self.attempts_done.subscribe())
    }

    /// One connection attempt; publishes the new connection or the error.
    async fn attempt(self: Arc<Self>, shared: Arc<Shared>, initial: bool) {
        let result = tokio::select! {
            // Dropping a half-made connection kills its child.
            () = shared.closed.cancelled() => Err(ConnectError::ShuttingDown),
            result = connect_one(&self.config, shared.connect_timeout) => result,
        };
        match result {
            Ok(established) => {
                let connection = Arc::new(Connection {
                    tools: established.tools,
                    peer: established.running.peer().clone(),
                    retire: shared.closed.child_token(),
                    pid: established.pid,
                    stdio: matches!(self.config.transport, ServerTransport::Stdio { .. }),
                });
                tracing::info!(server = %self.name(), tools = connection.tools.len(), pid = connection.pid, "MCP server connected");
                {
                    let mut state = self.lock();
                    state.connection = Some(Arc::clone(&connection));
                    state.connecting = false;
                    state.failures = 0;
                    state.last_error = None;
                    // The initial connect is not a reconnect: a server that dies right after
                    // start is reconnected at once.
                    state.last_attempt = (!initial).then(Instant::now);
                }
                // Published first, so that a connection that ends at once is also forgotten.
                shared.tasks.spawn(run_connection(
                    Arc::clone(&self),
                    Arc::clone(&shared),
                    connection,
                    established.running,
                    established.stderr,
                ));
            }
            Err(ConnectError::ShuttingDown) => {
                self.lock().connecting = false;
            }
            Err(error) => {
                let retry_in = {
                    let mut state = self.lock();
                    state.connecting = false;
                    // The backoff runs from the end of a failed attempt, so that a server that
                    // hangs until the connect timeout is not retried back to back.
                    state.last_attempt = Some(Instant::now());
                    state.failures = state.failures.saturating_add(1);
                    state.last_error = Some(error.to_string());
                    backoff(state.failures)
                };
                tracing::warn!(server = %self.name(), %error, ?retry_in, "MCP server unavailable; retrying in the background");
                shared.wake.notify_one();
            }
        }
        self.attempts_done.send_modify(|n| *n += 1);
    }

    /// Takes `connection` out of service (if it is still the current one) and has its task close it.
    fn retire(&self, connection: &Arc<Connection>, shared: &Shared) {
        connection.retire.cancel();
        self.forget(connection);
        shared.wake.notify_one();
    }

    fn forget(&self, connection: &Arc<Connection>) {
        let mut state = self.lock();
        if state
            .connection
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, connection))
        {
            state.connection = None;
        }
    }
}

impl ServerState {
    /// The connection if it is usable; a dead one is retired and dropped from the state.
    fn live(&mut self) -> Option<Arc<Connection>> {
        let connection = self.connection.as_ref()?;
        if connection.is_alive() {
            return Some(Arc::clone(connection));
        }
        connection.retire.cancel();
        self.connection = None;
        None
    }

    /// When the next attempt may start; `None` means now.
    fn next_attempt_at(&self) -> Option<Instant> {
        self.last_attempt.map(|at| at + backoff(self.failures))
    }
}

/// The least time between an attempt and the next one, after `failures` failed attempts in a row.
fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RECONNECT_BACKOFF
        .saturating_mul(1 << doublings)
        .min(RECONNECT_BACKOFF_MAX)
}

/// The background task: starts an attempt for every server that is down once its backoff has
/// elapsed, and sleeps until the next one is due or a server goes down.
async fn supervise(servers: Vec<Arc<Server>>, shared: Arc<Shared>) {
    loop {
        let now = Instant::now();
        let mut next = None::<Instant>;
        for server in &servers {
            if let Begin::NotBefore { at, .. } = server.begin(&shared, now, false) {
                next = Some(next.map_or(at, |next| next.min(at)));
            }
        }
        // Without a server that is down there is nothing to time; only a wake-up can change that.
        let sleep = next.unwrap_or(now + RECONNECT_BACKOFF_MAX);
        tokio::select! {
            () = shared.closed.cancelled() => return,
            () = shared.wake.notified() => {}
            () = tokio::time::sleep_until(sleep) => {}
        }
    }
}

/// Owns one connection's rmcp service until the connection ends by itself (the child exited, the
/// transport failed for good) or is retired (a failed call, shutdown); then closes it, cleans up,
/// and tells the supervisor.
async fn run_connection(
    server: Arc<Server>,
    shared: Arc<Shared>,
    connection: Arc<Connection>,
    running: RunningService<RoleClient, ClientConfig>,
    stderr: Option<AbortOnDropHandle<()>>,
) {
    let name = server.name();
    let stop = running.cancellation_token();
    let ended = running.waiting();
    tokio::pin!(ended);
    tokio::select! {
        quit = &mut ended => {
            if !connection.retire.is_cancelled() {
                tracing::warn!(server = %name, pid = connection.pid, ?quit, "MCP server connection ended; reconnecting in the background");
            }
        }
        () = connection.retire.cancelled() => {
            stop.cancel();
            match tokio::time::timeout(CLOSE_TIMEOUT, &mut ended).await {
                Ok(Ok(reason)) => tracing::info!(server = %name, pid = connection.pid, ?reason, "MCP server closed"),
                Ok(Err(error)) => tracing::warn!(server = %name, %error, "MCP server task failed while closing"),
                Err(_elapsed) => tracing::warn!(server = %name, timeout = ?CLOSE_TIMEOUT, "MCP server did not close in time"),
            }
        }
    }
    server.retire(&connection, &shared);
    if let Some(pgid) = connection.pid {
        sweep_process_group(name, pgid);
    }
    if let Some(task) = stderr {
        drain_stderr(task).await;
    }
}

fn client_config() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("sbp-gateway", env!("CARGO_PKG_VERSION")),
    )
}

async fn drain_stderr(mut task: AbortOnDropHandle<()>) {
    // On timeout the handle is dropped, which aborts the logger: a grandchild that escaped the
    // process group may still hold the pipe open.
    let _ = tokio::time::timeout(STDERR_DRAIN_TIMEOUT, &mut task).await;
}

/// A connection that answered initialize and tools/list.
struct Established {
    tools: Vec<ToolSpec>,
    running: RunningService<RoleClient, ClientConfig>,
    pid: Option<u32>,
    stderr: Option<AbortOnDropHandle<()>>,
}

async fn connect_one(
    config: &ServerConfig,
    timeout: Duration,
) -> Result<Established, ConnectError> {
    let name = &config.name;
    // One deadline for the whole handshake: spawn/dial, initialize and tools/list.
    let deadline = Instant::now() + timeout;
    let mut pid = None;
    let (transport_running, stderr_task) = match &config.transport {
        ServerTransport::Stdio { command, args, env } => {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(args).envs(env.iter().map(|(k, v)| (k, v)));
            let mut wrapped = CommandWrap::from(cmd);
            // Own process group: shutdown signals reach the server's own children too.
            wrapped.wrap(ProcessGroup::leader());
            // Backstop for a connection dropped without being closed (an abandoned attempt).
            wrapped.wrap(KillOnDrop);
            let (process, stderr) = TokioChildProcess::builder(wrapped)
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|source| ConnectError::Spawn {
                    command: command.clone(),
                    source,
                })?;
            pid = process.id();
            tracing::debug!(server = %name, pid, %command, "MCP server started");
            let stderr_task = stderr.map(|stderr| spawn_stderr_logger(name.clone(), stderr));
            let running = tokio::time::timeout_at(deadline, client_config().serve(process)).await;
            (running, stderr_task)
        }
        ServerTransport::Http { url, bearer } => {
            let mut http_config = StreamableHttpClientTransportConfig::with_uri(url.clone());
            if let Some(token) = bearer {
                http_config = http_config.auth_header(token.clone());
            }
            let transport = StreamableHttpClientTransport::from_config(http_config);
            let running = tokio::time::timeout_at(deadline, client_config().serve(transport)).await;
            (running, None)
        }
    };

    // On failure the transport has been dropped, which kills a child; let its last stderr lines
    // reach the log before the warning that the server is unavailable.
    let fail = |error: ConnectError, stderr_task: Option<AbortOnDropHandle<()>>| async move {
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
    Ok(Established {
        tools: tools.iter().map(ToolSpec::from_mcp).collect(),
        running,
        pid,
        stderr: stderr_task,
    })
}

/// Re-logs a child's stderr line by line; ends when the child closes it (exits).
fn spawn_stderr_logger(
    server: String,
    stderr: tokio::process::ChildStderr,
) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(async move {
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
    }))
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
