//! The engine's typed configuration. The CLI builds it from flags, `SBP_*` variables and a TOML file.

use std::path::PathBuf;
use std::time::Duration;

use crate::ratelimit::RateLimits;

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
    /// How long one WebSocket frame may take to be written before the surface is dropped as not
    /// reading (close 1008; its turns stay in the tether).
    pub ws_write_timeout: Duration,
    /// Bytes of turn traffic that may wait for one WebSocket connection; beyond, the surface is
    /// dropped as a slow consumer.
    pub ws_outbound_budget: usize,
    /// Frames per second a WebSocket client may send, sustained; a flood closes with 1008.
    pub ws_frame_rate: u32,
    /// Frames a WebSocket client may send at once above the sustained rate.
    pub ws_frame_burst: u32,
    pub max_body_bytes: usize,
    /// Bounds on request messages, JSON shape and session transcripts.
    pub limits: crate::limits::Limits,
    /// Memory for recent sessions' transcripts, kept ready to send so a turn reads and sends on
    /// only what it adds (least recently used evicted first); 0 reads every turn's history.
    pub history_cache_bytes: usize,
    /// Operator API keys; when non-empty every HTTP endpoint but /healthz needs one as a Bearer token.
    pub api_keys: Vec<String>,
    /// SPEC 6.1 strict mode: a request with neither `sbp` nor a session token is passed through untracked.
    pub strict_sbp: bool,
    /// Serves the public conformance suite's test-only endpoints, and lets end-to-end tests pause
    /// a handover between adopt and commit (`SBP_TEST_HANDOVER_PAUSE_MS`).
    pub enable_test_hooks: bool,
    /// Session-scoped endpoints stop requiring the session token. Insecure; for conformance runs only.
    pub insecure_no_session_auth: bool,
    /// The gateway's signing secret (>= 32 bytes).
    pub secret: Vec<u8>,
    /// Earlier signing secrets (rotation): what they signed (roaming tokens, the session tokens of
    /// idempotent replays) still verifies; everything new is signed with `secret`.
    pub previous_secrets: Vec<Vec<u8>>,
    /// This process's id among replicas (unique per run): it owns the turns it runs, and other
    /// replicas address it on the bus.
    pub replica_id: String,
    /// How often a replica records that it is alive (in the database, and on the bus).
    pub replica_heartbeat: Duration,
    /// How long after its last heartbeat a replica counts as dead: its running turns are failed
    /// and calls waiting on its surfaces end.
    pub replica_timeout: Duration,
    /// How often the retention sweep runs (zero: never).
    pub retention_interval: Duration,
    /// How long an export is kept after it expired or its single-use token was consumed (then its
    /// bundle too, when no other export refers to it); `None` keeps exports for ever.
    pub export_retention: Option<Duration>,
    /// How long snapshots are kept (each session's latest is always kept); `None`: for ever.
    pub snapshot_retention: Option<Duration>,
    /// Token-bucket limits per client address, session, operator key and failed authentication.
    pub rate_limits: RateLimits,
    /// The URLs browsers and clients reach this gateway by (besides loopback): their hosts are
    /// accepted in `Host`, their origins in `Origin` (`transport/policy.rs`).
    pub public_urls: Vec<PublicUrl>,
    /// Origins of web apps that may call the API from their own pages (`--cors-origin`): their
    /// `Origin` passes the request policy and they get CORS answers (`transport/cors.rs`).
    /// Empty: no CORS, and other origins are refused.
    pub cors_origins: Vec<PublicUrl>,
    /// The connection layer: timeouts, connection caps, TLS (`edge/`).
    pub edge: EdgeConfig,
    /// How long a stop waits for in-flight requests and turns; then turns still running are
    /// failed (their idempotency keys retryable), remaining connections are closed, and `serve`
    /// returns.
    pub shutdown_grace: Duration,
    /// Federation (L6); `None`: off, and nothing of it is served.
    pub federation: Option<FederationConfig>,
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
    /// Bytes of request bodies held in memory at once: a body counts its declared length (the
    /// body limit when it declares none), taken once 64 KiB of it has arrived; one that finds no
    /// room waits within its `body_timeout`, then is answered 503. One body larger than this
    /// takes all of it.
    pub max_inflight_body_bytes: usize,
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
            max_inflight_body_bytes: 8 << 20,
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
    /// The signing secrets that verify: the current one first, then the previous ones.
    pub fn verifying_secrets(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(self.secret.as_slice())
            .chain(self.previous_secrets.iter().map(Vec::as_slice))
    }

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
            ws_write_timeout: Duration::from_secs(10),
            ws_outbound_budget: 8 << 20,
            ws_frame_rate: 100,
            ws_frame_burst: 1000,
            max_body_bytes: 8 << 20,
            limits: crate::limits::Limits::default(),
            history_cache_bytes: 32 << 20,
            api_keys: Vec::new(),
            strict_sbp: false,
            enable_test_hooks: false,
            insecure_no_session_auth: false,
            retention_interval: Duration::from_secs(3600),
            export_retention: Some(Duration::from_secs(7 * 24 * 3600)),
            snapshot_retention: Some(Duration::from_secs(30 * 24 * 3600)),
            secret: Vec::new(),
            previous_secrets: Vec::new(),
            replica_id: run_replica_id("gw"),
            replica_heartbeat: Duration::from_secs(2),
            replica_timeout: Duration::from_secs(10),
            rate_limits: RateLimits::default(),
            public_urls: Vec::new(),
            cors_origins: Vec::new(),
            edge: EdgeConfig::default(),
            shutdown_grace: Duration::from_secs(30),
            federation: None,
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

/// A URL this gateway is reached by (`--public-url`): `http` or `https`, a host, perhaps a port;
/// a path is allowed and ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicUrl {
    /// `http` or `https`.
    pub scheme: String,
    /// Lower case; an IPv6 address in brackets, as in a `Host` header.
    pub host: String,
    /// The port as given, if any.
    pub port: Option<u16>,
}

impl PublicUrl {
    /// The port a browser connects to: the given one or the scheme's default.
    pub fn effective_port(&self) -> u16 {
        self.port
            .unwrap_or(if self.scheme == "https" { 443 } else { 80 })
    }

    /// Whether both are the same origin (scheme, host and port; a default port given or not).
    pub fn same_origin(&self, other: &PublicUrl) -> bool {
        self.scheme == other.scheme
            && self.host == other.host
            && self.effective_port() == other.effective_port()
    }

    /// A web origin as `--cors-origin` takes it: `http(s)://host[:port]`, nothing after. Not `*`
    /// nor `null`: each origin allowed is named.
    pub fn parse_origin(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "CORS origin '{t}' must be a web origin like https://app.example.com[:PORT] \
                 (no path, no wildcard)"
            )
        };
        let rest = t.split_once("://").map_or("", |(_, rest)| rest);
        if rest.is_empty() || rest.trim_end_matches('/').contains(['/', '?', '#']) {
            return Err(bad());
        }
        t.parse().map_err(|_| bad())
    }
}

impl std::str::FromStr for PublicUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("public URL '{s}' must look like https://gateway.example.com[:PORT]");
        let uri: http::Uri = s.trim().parse().map_err(|_| bad())?;
        let scheme = uri
            .scheme_str()
            .map(str::to_ascii_lowercase)
            .ok_or_else(bad)?;
        if scheme != "http" && scheme != "https" {
            return Err(bad());
        }
        let authority = uri.authority().ok_or_else(bad)?;
        if authority.as_str().contains('@') {
            return Err(bad());
        }
        let host = authority.host().trim_end_matches('.').to_ascii_lowercase();
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            scheme,
            host,
            port: authority.port_u16(),
        })
    }
}

impl std::fmt::Display for PublicUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(port) => write!(f, "{}://{}:{port}", self.scheme, self.host),
            None => write!(f, "{}://{}", self.scheme, self.host),
        }
    }
}

/// Federation (L6): on when `GatewayConfig::federation` is `Some`. Built by `sbp serve` from
/// `--role`, `--peer`, `--tracker`, `--peer-srv` and the options beside them.
#[derive(Debug, Clone)]
pub struct FederationConfig {
    pub role: sbp_protocol::federation::Role,
    /// `gateway_name` in the manifest.
    pub gateway_name: String,
    /// The node's Ed25519 identity key: signs the manifest, federation tokens, tracker answers.
    pub key: std::sync::Arc<sbp_protocol::federation::IdentityKey>,
    /// The public key of the first identity key this node had: the gateway id derives from it
    /// (at the first start; then the stored id stays).
    pub first_public_key: sbp_protocol::federation::PublicKey,
    /// Keys rotated away from, with the time each stops verifying: listed in the manifest's
    /// `old_keys`; the newest unexpired one signs `old_signature`. Newest first.
    pub old_keys: Vec<OldIdentityKey>,
    /// Static peers (`--peer URL[#KEY]`).
    pub peers: Vec<PeerSpec>,
    /// Trackers (`--tracker URL[#KEY]`).
    pub trackers: Vec<PeerSpec>,
    /// Domains whose `_sbp._tcp` SRV records name peers (`--peer-srv`).
    pub peer_srv: Vec<String>,
    /// The DNS server SRV lookups ask (`--dns-server`); `None`: the system's.
    pub dns_server: Option<std::net::SocketAddr>,
    /// Trust a peer's key on first use (`--federation-tofu`).
    pub tofu: bool,
    /// Talk plain http to peers that are not on loopback (`--federation-allow-http`).
    pub allow_http: bool,
    /// Announce every export's bundle to the trackers (`--announce-exports`).
    pub announce_exports: bool,
    /// Lifetime of an announced record (≤ 24 h).
    pub announce_ttl: Duration,
    /// Records one gateway may hold at a tracker.
    pub tracker_max_records: u64,
    /// Announces per second one gateway may make at a tracker; `None`: no limit.
    pub tracker_announce_rate: Option<crate::ratelimit::Rate>,
    /// How long a handover lease holds a session for the gateway taking it.
    pub handover_lease: Duration,
}

/// A key this node rotated away from, still verifying until `expires_at`.
#[derive(Debug, Clone)]
pub struct OldIdentityKey {
    pub key: std::sync::Arc<sbp_protocol::federation::IdentityKey>,
    pub expires_at: chrono::DateTime<chrono::Utc>,
}

/// A peer or tracker as configured: its base URL and, when pinned, the `public_key` its manifest
/// must carry (or rotate away from by a valid `old_signature`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    /// `scheme://host[:port][/base]`, without a trailing slash.
    pub url: String,
    pub pin: Option<String>,
}

impl std::str::FromStr for PeerSpec {
    type Err = String;

    /// `URL[#KEY]`: an http(s) URL without query or credentials; KEY the manifest's `public_key`.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (url, pin) = match s.split_once('#') {
            Some((url, key)) => (url, Some(key.trim())),
            None => (s, None),
        };
        let bad = || format!("peer '{s}' must look like https://peer.example.com[#PUBLIC_KEY]");
        let uri: http::Uri = url.trim().parse().map_err(|_| bad())?;
        let scheme = uri
            .scheme_str()
            .map(str::to_ascii_lowercase)
            .ok_or_else(bad)?;
        if scheme != "http" && scheme != "https" {
            return Err(bad());
        }
        let authority = uri.authority().ok_or_else(bad)?;
        if authority.as_str().contains('@') || uri.query().is_some() {
            return Err(bad());
        }
        if let Some(pin) = pin {
            sbp_protocol::federation::PublicKey::from_b64_spki(pin).map_err(|e| {
                format!("peer '{s}': the pinned key is not an Ed25519 public key: {e}")
            })?;
        }
        let path = uri.path().trim_end_matches('/');
        Ok(Self {
            url: format!(
                "{scheme}://{}{path}",
                authority.as_str().to_ascii_lowercase()
            ),
            pin: pin.map(str::to_owned),
        })
    }
}
