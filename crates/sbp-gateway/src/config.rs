//! The engine's typed configuration. The CLI builds it from flags, `SBP_*` variables and a TOML file.

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
    pub tool_timeout: Duration,
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
            max_frame_bytes: 1 << 20,
            max_body_bytes: 8 << 20,
            api_keys: Vec::new(),
            strict_sbp: false,
            enable_test_hooks: false,
            insecure_no_session_auth: false,
            secret: Vec::new(),
        }
    }
}
