//! The engine's typed configuration. The CLI builds it from flags, `SBP_*` variables and a TOML file.

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Advertised in SESSION_ATTACHED.
    pub sbp_version: String,
    pub sbp_level: String,
    /// Used when a request names no model.
    pub default_model: String,
    pub ping_interval: Duration,
    /// How long a surface may take to answer a PING before it is disconnected.
    pub pong_timeout: Duration,
    /// How long a new WebSocket may take to send ATTACH_SESSION.
    pub attach_timeout: Duration,
    /// How long a surface tool call may take before the LLM gets the error result "timeout".
    pub tool_timeout: Duration,
    /// Surface tools that may be called; `None` allows any tool a surface declares.
    pub tool_allowlist: Option<Vec<String>>,
    /// Tool rounds one turn may run before the LLM must answer without gateway tools.
    pub max_tool_rounds: u32,
    /// Contextual Translation Pipeline: a second LLM pass rewriting replies for these device types.
    pub ctp: Vec<CtpRule>,
    /// Longest a CTP pass may take before the deterministic adaptation is used instead.
    pub ctp_timeout: Duration,
    /// Tethered turns rewritten by CTP in one drain (the most recent ones); older ones get the
    /// deterministic adaptation, so a long queue does not cost an LLM call per turn.
    pub ctp_drain_max: usize,
    pub max_frame_bytes: usize,
    pub max_body_bytes: usize,
    /// Operator API keys; when non-empty every HTTP endpoint but /healthz needs one as a Bearer token.
    pub api_keys: Vec<String>,
    /// SPEC 6.1 strict mode: a request with neither `sbp` nor a session token is passed through untracked.
    pub strict_sbp: bool,
    /// Serves the public conformance suite's test-only endpoints.
    pub enable_test_hooks: bool,
    /// Session-scoped endpoints stop requiring the session token. Insecure; for conformance runs only.
    pub insecure_no_session_auth: bool,
    /// The gateway's signing secret (>= 32 bytes).
    pub secret: Vec<u8>,
    /// This process's id among replicas (unique per run): it owns the turns it runs, and other
    /// replicas address it on the bus.
    pub replica_id: String,
    /// How often a replica records that it is alive (in the database, and on the bus).
    pub replica_heartbeat: Duration,
    /// How long after its last heartbeat a replica counts as dead: its running turns are failed
    /// and calls waiting on its surfaces end.
    pub replica_timeout: Duration,
    /// The connection layer: timeouts, connection caps, TLS (`edge/`).
    pub edge: EdgeConfig,
    /// How long a stop waits for in-flight requests and turns; then turns still running are
    /// failed (their idempotency keys retryable), remaining connections are closed, and `serve`
    /// returns.
    pub shutdown_grace: Duration,
}

/// Limits of the connection layer (`edge/`). Each bounds what one client can hold: a socket that
/// sends nothing, a body sent one byte at a time, an idle keep-alive connection, or more sockets
/// than the process has file descriptors for.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// How long a connection may take from its first byte (or from being accepted) to the end of
    /// a request's headers; a TLS handshake counts.
    pub header_read_timeout: Duration,
    /// How long a request's whole body may take to arrive, from the end of its headers (a
    /// deadline, not an inactivity timeout: a body trickled at one byte a second is cut too).
    pub body_timeout: Duration,
    /// How long a keep-alive connection may stay idle between two requests.
    pub keep_alive_timeout: Duration,
    /// Connections served at once (WebSocket surfaces included). Beyond it a few more are accepted
    /// for `/healthz` only, and the rest are closed at once.
    pub max_connections: usize,
    /// Connections one client IP may hold at once (WebSocket surfaces included); 0: no limit.
    pub max_connections_per_ip: usize,
    /// Serve HTTPS and WSS with this certificate chain and key (PEM files), reloaded when the
    /// files change.
    pub tls: Option<TlsFiles>,
    /// How often the TLS files are checked for a change.
    pub tls_reload_interval: Duration,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            keep_alive_timeout: Duration::from_secs(60),
            max_connections: 10_000,
            max_connections_per_ip: 1_000,
            tls: None,
            tls_reload_interval: Duration::from_secs(10),
        }
    }
}

/// The PEM files of a TLS certificate chain and its private key.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl GatewayConfig {
    /// Whether the operator's allowlist lets surfaces' `tool` be called (no allowlist: any).
    pub fn tool_allowed(&self, tool: &str) -> bool {
        self.tool_allowlist
            .as_ref()
            .is_none_or(|list| list.iter().any(|t| t == tool))
    }
}

/// A replica id unique to this run: `name` and a random suffix.
pub fn run_replica_id(name: &str) -> String {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{name}-{}", &suffix[..12])
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            sbp_version: sbp_protocol::DEFAULT_SBP_VERSION.to_owned(),
            sbp_level: sbp_protocol::SBP_LEVEL.to_owned(),
            default_model: sbp_llm::ECHO_MODEL.to_owned(),
            ping_interval: Duration::from_secs(25),
            pong_timeout: Duration::from_secs(10),
            attach_timeout: Duration::from_secs(10),
            tool_timeout: Duration::from_millis(30_000),
            tool_allowlist: None,
            max_tool_rounds: 8,
            ctp: Vec::new(),
            ctp_timeout: Duration::from_secs(20),
            ctp_drain_max: 20,
            max_frame_bytes: 1 << 20,
            max_body_bytes: 8 << 20,
            api_keys: Vec::new(),
            strict_sbp: false,
            enable_test_hooks: false,
            insecure_no_session_auth: false,
            secret: Vec::new(),
            replica_id: run_replica_id("gw"),
            replica_heartbeat: Duration::from_secs(2),
            replica_timeout: Duration::from_secs(10),
            edge: EdgeConfig::default(),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// One CTP rule: replies delivered to surfaces of `device_type` are rewritten by `model`.
#[derive(Debug, Clone, PartialEq)]
pub struct CtpRule {
    /// A well-known device type, or "*" for every surface that needs adaptation.
    pub device_type: String,
    pub model: String,
    /// Replaces the default rewriting instructions.
    pub prompt: Option<String>,
}

impl std::str::FromStr for CtpRule {
    type Err = String;

    /// `device_type=model`, e.g. `iot=gpt-4o-mini`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (device, model) = s
            .split_once('=')
            .ok_or_else(|| format!("CTP rule '{s}' must be DEVICE_TYPE=MODEL"))?;
        let (device, model) = (device.trim(), model.trim());
        if device.is_empty() || model.is_empty() {
            return Err(format!("CTP rule '{s}' must be DEVICE_TYPE=MODEL"));
        }
        Ok(Self {
            device_type: device.to_owned(),
            model: model.to_owned(),
            prompt: None,
        })
    }
}
