//! `sbp serve` options: command-line flags, `SBP_*` environment variables and an optional TOML file
//! (`--config`), in that order of precedence, resolved into one typed `Settings`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::Args;
use sbp_gateway::ratelimit::parse_limit;
use sbp_gateway::{CtpRule, EdgeConfig, Limits, PublicUrl, RateLimits, TlsFiles};
use sbp_store::redis_tether::TetherMode;
use sbp_store::seal::{Key, Keyring, Sealer};
use serde::Deserialize;

#[derive(Debug, Args, Default)]
pub struct ServeArgs {
    /// TOML file with any of these options (keys as the long flag names with `_` for `-`).
    #[arg(long, env = "SBP_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on. [default: 127.0.0.1:8080]
    #[arg(long, env = "SBP_LISTEN")]
    pub listen: Option<String>,
    /// Directory for the database file and the generated signing secret. [default: ./sbp-data]
    #[arg(long, env = "SBP_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Storage: `sqlite://PATH`, or `postgres://USER[:PASSWORD]@HOST[:PORT]/DB[?PARAMS]` for
    /// PostgreSQL (schema migrated at start; a dedicated database, or one whose search_path is set
    /// with `?options=-c%20search_path%3DSCHEMA`). TLS as libpq: `sslmode=` `disable`, `prefer`
    /// (the default: TLS when the server offers it, unverified), `require` (TLS, unverified),
    /// `verify-ca` (the chain checked against `sslrootcert`), `verify-full` (the chain and the
    /// host name or IP address); `sslrootcert=PATH` (PEM CAs; also checks the chain under prefer
    /// and require; `system`, the default of verify-full, takes the system's CAs); `sslcert=PATH`
    /// with `sslkey=PATH` (a client certificate; the key 0600). A Unix socket host never uses TLS
    /// (sslmode does not apply there). [default: sqlite://<data-dir>/sbp.db]
    #[arg(long, env = "SBP_DATABASE")]
    pub database: Option<String>,
    /// SQLite durability: `full` (fsync every commit batch) or `normal` (survives a crash of the
    /// process, not of the machine). [default: full]
    #[arg(long, env = "SBP_SQLITE_SYNCHRONOUS")]
    pub sqlite_synchronous: Option<String>,
    /// Keep the Tether in Redis Streams: `redis://[USER:PASSWORD@]HOST[:PORT][/DB]`. Turns are still
    /// committed to the database with their tether entry and then streamed to
    /// `<prefix>tether:<session>`; acknowledgements (ACK, `last_seq`) trim the stream. Without it
    /// the Tether lives in the database. [default: the database]
    #[arg(long, env = "SBP_TETHER")]
    pub tether: Option<String>,
    /// What the database keeps once a turn is in Redis: `mirror` (every unacknowledged turn, so
    /// nothing is lost whatever Redis persists; one more database write per ACK), `handoff` (nothing:
    /// Redis owns the turn, durable only with `appendonly yes` + `appendfsync always`), or `auto`
    /// (handoff when Redis reports exactly that persistence, mirror otherwise). [default: auto]
    #[arg(long, env = "SBP_TETHER_MODE")]
    pub tether_mode: Option<String>,
    /// Prefix of the Tether's Redis keys (to share one Redis between deployments). [default: sbp:]
    #[arg(long, env = "SBP_TETHER_PREFIX")]
    pub tether_prefix: Option<String>,
    /// Connect replicas: `redis://[USER:PASSWORD@]HOST[:PORT][/DB]`. Every replica of one
    /// deployment gets the same `--bus` and `--database postgres://...`; a surface may attach to any
    /// of them and a turn may run on any other (chunks, tool calls and results are routed through
    /// Redis pub/sub; one surface per session across all of them). Needs PostgreSQL. [default: none,
    /// one process]
    #[arg(long, env = "SBP_BUS")]
    pub bus: Option<String>,
    /// Prefix of the bus's Redis keys and channels (one per deployment sharing a Redis). [default: sbp:]
    #[arg(long, env = "SBP_BUS_PREFIX")]
    pub bus_prefix: Option<String>,
    /// This replica's name in logs and on the bus; a random suffix is added per run. [default: gw]
    #[arg(long, env = "SBP_REPLICA_NAME")]
    pub replica_name: Option<String>,
    /// Declares that several processes serve this database. Refused without `--bus`: replicas
    /// without a bus would run turns whose chunks and tool calls cannot reach the surface.
    #[arg(long, env = "SBP_REPLICATED")]
    pub replicated: bool,
    /// Seconds between a replica's heartbeats (database and bus). [default: 2]
    #[arg(long, env = "SBP_REPLICA_HEARTBEAT")]
    pub replica_heartbeat: Option<f64>,
    /// Seconds without a heartbeat after which a replica counts as dead: its running turns are marked
    /// failed and tool calls waiting on its surfaces end. [default: 10]
    #[arg(long, env = "SBP_REPLICA_TIMEOUT")]
    pub replica_timeout: Option<f64>,
    /// How often the retention sweep runs: seconds, or a number with `s`, `m`, `h` or `d`; `0`
    /// turns retention off. [default: 1h]
    #[arg(long, env = "SBP_RETENTION_INTERVAL")]
    pub retention_interval: Option<String>,
    /// How long an export is kept after it expired or its single-use token was consumed (then its
    /// bundle, when no other export refers to it); `0`: for ever. [default: 7d]
    #[arg(long, env = "SBP_EXPORT_RETENTION")]
    pub export_retention: Option<String>,
    /// How long snapshots are kept (each session's latest always stays); `0`: for ever. [default: 30d]
    #[arg(long, env = "SBP_SNAPSHOT_RETENTION")]
    pub snapshot_retention: Option<String>,
    /// Base URL of an OpenAI-compatible upstream, e.g. http://127.0.0.1:11434/v1 (Ollama),
    /// http://127.0.0.1:8000/v1 (vLLM), http://127.0.0.1:8081/v1 (llama.cpp), https://api.openai.com/v1.
    /// Without it turns are answered by the built-in offline model `sbp/echo`.
    #[arg(long, env = "SBP_LLM_BASE_URL")]
    pub llm_base_url: Option<String>,
    /// API key sent upstream as `Authorization: Bearer`.
    #[arg(long, env = "SBP_LLM_API_KEY", hide_env_values = true)]
    pub llm_api_key: Option<String>,
    /// Model used when a request names none. [default: sbp/echo]
    #[arg(long, env = "SBP_DEFAULT_MODEL")]
    pub default_model: Option<String>,
    /// Signing secret (>= 32 bytes). [default: generated at first start and kept in <data-dir>/secret]
    #[arg(long, env = "SBP_JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: Option<String>,
    /// An earlier signing secret, still accepted after a rotation (repeatable; comma-separated in
    /// the environment): roaming tokens it signed verify until they expire, while everything new
    /// is signed with --jwt-secret. Drop it once the longest token lifetime has passed.
    #[arg(
        long = "previous-jwt-secret",
        env = "SBP_PREVIOUS_JWT_SECRETS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub previous_jwt_secret: Vec<String>,
    /// Encrypt session content at rest (messages, tether, task labels, snapshots, memory, bundles,
    /// replayed responses, labels) with the 32-byte key in FILE: 64 hex digits or base64, as
    /// `sbp encryption-key generate` writes. Ids, timestamps, counts, CIDs and model names stay
    /// in the clear. A database holding values sealed under keys not given here is refused at
    /// start, and so is a start without it over one holding sealed values. [default: off]
    #[arg(long, env = "SBP_ENCRYPTION_KEY", value_name = "FILE")]
    pub encryption_key: Option<PathBuf>,
    /// An earlier --encryption-key FILE, still opening what it sealed after a rotation
    /// (repeatable; comma-separated in the environment). New values are sealed under
    /// --encryption-key; `sbp store reseal` rewrites the old ones, after which this can go.
    #[arg(
        long = "previous-encryption-key",
        env = "SBP_PREVIOUS_ENCRYPTION_KEYS",
        value_delimiter = ',',
        value_name = "FILE"
    )]
    pub previous_encryption_key: Vec<PathBuf>,
    /// Seconds between PING frames to attached surfaces. [default: 25]
    #[arg(long, env = "SBP_PING_INTERVAL")]
    pub ping_interval: Option<f64>,
    /// Seconds a surface has to answer a PING. [default: 10]
    #[arg(long, env = "SBP_PONG_TIMEOUT")]
    pub pong_timeout: Option<f64>,
    /// Seconds a new WebSocket has to send ATTACH_SESSION. [default: 10]
    #[arg(long, env = "SBP_ATTACH_TIMEOUT")]
    pub attach_timeout: Option<f64>,
    /// Milliseconds a surface has to answer a TOOL_CALL. [default: 30000]
    #[arg(long, env = "SBP_TOOL_TIMEOUT_MS")]
    pub tool_timeout_ms: Option<u64>,
    /// Surface tools that may be called (repeatable; env: comma-separated). Without it, any tool a
    /// surface declares may be called.
    #[arg(long = "tool-allow", env = "SBP_TOOL_ALLOWLIST", value_delimiter = ',')]
    pub tool_allowlist: Vec<String>,
    /// Tool rounds one turn may run before the model must answer. [default: 8]
    #[arg(long, env = "SBP_MAX_TOOL_ROUNDS")]
    pub max_tool_rounds: Option<u32>,
    /// Contextual Translation Pipeline rule DEVICE_TYPE=MODEL (repeatable; env: comma-separated):
    /// replies to surfaces of that device type ("*" for any that needs adaptation) are rewritten
    /// by a second pass of MODEL, streamed. Without a rule, the deterministic adaptation applies.
    #[arg(long = "ctp", env = "SBP_CTP", value_delimiter = ',')]
    pub ctp: Vec<String>,
    /// Seconds a CTP pass may take before the deterministic adaptation is used. [default: 20]
    #[arg(long, env = "SBP_CTP_TIMEOUT")]
    pub ctp_timeout: Option<f64>,
    /// Anthropic Messages API base URL; models matching --anthropic-models go there.
    /// [default: https://api.anthropic.com/v1 when --anthropic-api-key is set]
    #[arg(long, env = "SBP_ANTHROPIC_BASE_URL")]
    pub anthropic_base_url: Option<String>,
    /// Anthropic API key.
    #[arg(long, env = "ANTHROPIC_API_KEY", hide_env_values = true)]
    pub anthropic_api_key: Option<String>,
    /// Model-name prefixes routed to Anthropic (comma-separated); an `anthropic/` prefix is
    /// stripped before sending. [default: claude,anthropic/]
    #[arg(long, env = "SBP_ANTHROPIC_MODELS", value_delimiter = ',')]
    pub anthropic_models: Vec<String>,
    /// Southbound MCP server whose tools the LLM may use, called by the gateway (repeatable;
    /// env: separated by `;`): `NAME=stdio:COMMAND ARGS...` or `NAME=http://host/mcp`.
    #[arg(long = "mcp-server", env = "SBP_MCP_SERVERS", value_delimiter = ';')]
    pub mcp_servers: Vec<String>,
    /// Protocol version advertised in SESSION_ATTACHED. [default: 1.2]
    #[arg(long, env = "SBP_SBP_VERSION")]
    pub sbp_version: Option<String>,
    /// Seconds to connect to the upstream. [default: 5]
    #[arg(long, env = "SBP_UPSTREAM_CONNECT_TIMEOUT")]
    pub upstream_connect_timeout: Option<f64>,
    /// Seconds for a whole upstream reply (or its first byte when streaming). [default: 120]
    #[arg(long, env = "SBP_UPSTREAM_TIMEOUT")]
    pub upstream_timeout: Option<f64>,
    /// Longest silence in seconds between two streamed upstream chunks. [default: 60]
    #[arg(long, env = "SBP_UPSTREAM_IDLE_TIMEOUT")]
    pub upstream_idle_timeout: Option<f64>,
    /// Largest WebSocket frame in bytes. [default: 1048576]
    #[arg(long, env = "SBP_MAX_FRAME_BYTES")]
    pub max_frame_bytes: Option<usize>,
    /// Seconds one WebSocket frame may take to be written; a surface that does not read is then
    /// dropped (close 1008, its turns stay tethered). [default: 10]
    #[arg(long, env = "SBP_WS_WRITE_TIMEOUT")]
    pub ws_write_timeout: Option<f64>,
    /// Bytes of turn traffic that may wait for one WebSocket surface; beyond, it is dropped as a
    /// slow consumer (close 1008, its turns stay tethered). [default: 8388608]
    #[arg(long, env = "SBP_WS_OUTBOUND_BUDGET")]
    pub ws_outbound_budget: Option<usize>,
    /// Frames per second a WebSocket client may send, sustained; a flood closes with 1008.
    /// [default: 100]
    #[arg(long, env = "SBP_WS_FRAME_RATE")]
    pub ws_frame_rate: Option<u32>,
    /// Frames a WebSocket client may send at once above the sustained rate. [default: 1000]
    #[arg(long, env = "SBP_WS_FRAME_BURST")]
    pub ws_frame_burst: Option<u32>,
    /// Largest HTTP request body in bytes. [default: 8388608]
    #[arg(long, env = "SBP_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Most messages one completion request may carry (413 beyond). [default: 10000]
    #[arg(long, env = "SBP_MAX_REQUEST_MESSAGES")]
    pub max_request_messages: Option<usize>,
    /// Largest message in bytes of JSON, in a request, a push or an imported bundle (413, or 422
    /// in a bundle). [default: 4194304]
    #[arg(long, env = "SBP_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Most messages a session's transcript may hold: a turn that would go past it is refused
    /// with 422 SBP_SESSION_FULL (continue in a fork with `keep_last`). [default: 100000]
    #[arg(long, env = "SBP_MAX_SESSION_MESSAGES")]
    pub max_session_messages: Option<u64>,
    /// Largest transcript in bytes (its messages as stored JSON); past it, as
    /// --max-session-messages. [default: 33554432]
    #[arg(long, env = "SBP_MAX_SESSION_BYTES")]
    pub max_session_bytes: Option<u64>,
    /// Memory in MiB for recent sessions' transcripts, kept ready to send so a turn reads and
    /// re-sends only what it adds; the least recently used are evicted first; 0 turns it off.
    /// [default: 32]
    #[arg(long, env = "SBP_HISTORY_CACHE_MIB")]
    pub history_cache_mib: Option<usize>,
    /// Deepest nesting of objects and arrays in a request body, 8 to 128 (413 beyond).
    /// [default: 64]
    #[arg(long, env = "SBP_MAX_JSON_DEPTH")]
    pub max_json_depth: Option<usize>,
    /// Most JSON objects in one request body (413 beyond): each costs ~0.6 KB parsed, whatever its
    /// size in the body. [default: 32768]
    #[arg(long, env = "SBP_MAX_JSON_OBJECTS")]
    pub max_json_objects: Option<usize>,
    /// Most JSON values (strings and keys, numbers, literals, arrays, objects) in one request body
    /// (413 beyond). [default: 262144]
    #[arg(long, env = "SBP_MAX_JSON_VALUES")]
    pub max_json_values: Option<usize>,
    /// Seconds a connection may take to send a request's headers, counted from its first byte
    /// (or from its accept when it sends nothing); a TLS handshake counts. [default: 10]
    #[arg(long, env = "SBP_HEADER_READ_TIMEOUT")]
    pub header_read_timeout: Option<f64>,
    /// Seconds a request's whole body may take to arrive (a deadline: a body trickled a byte at a
    /// time is cut too); 408 after it. [default: 60]
    #[arg(long, env = "SBP_BODY_TIMEOUT")]
    pub body_timeout: Option<f64>,
    /// Seconds an idle keep-alive connection stays open between two requests. [default: 60]
    #[arg(long, env = "SBP_KEEP_ALIVE_TIMEOUT")]
    pub keep_alive_timeout: Option<f64>,
    /// Connections served at once, WebSocket surfaces included; beyond it a few more are accepted
    /// for /healthz only and the rest closed at once. Lowered at start to fit the open-files limit.
    /// [default: 10000]
    #[arg(long, env = "SBP_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Connections one client IP (an IPv6 /64) may hold at once, WebSocket surfaces included; 0
    /// for no limit (behind a reverse proxy every client has the proxy's address). [default: 1000]
    #[arg(long, env = "SBP_MAX_CONNECTIONS_PER_IP")]
    pub max_connections_per_ip: Option<usize>,
    /// Bytes of request bodies the gateway holds in memory at once (a body counts its declared
    /// Content-Length, or --max-body-bytes without one, once 64 KiB of it has arrived). A body
    /// over 64 KiB waits for its share within --body-timeout, then is answered 503; smaller ones
    /// never wait. Bounds the memory that many large requests at once can take.
    /// [default: 8388608]
    #[arg(long, env = "SBP_MAX_INFLIGHT_BODY_BYTES")]
    pub max_inflight_body_bytes: Option<usize>,
    /// Serve HTTPS and WSS with this PEM certificate chain (with --tls-key). Reloaded when the
    /// file changes and on SIGHUP. [default: plain HTTP]
    #[arg(long, env = "SBP_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "SBP_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Seconds between checks of the TLS files for a change. [default: 10]
    #[arg(long, env = "SBP_TLS_RELOAD_INTERVAL")]
    pub tls_reload_interval: Option<f64>,
    /// Seconds SIGTERM/SIGINT waits for requests and turns in flight; then running turns are
    /// failed (their Idempotency-Keys can be retried) and the process exits. [default: 30]
    #[arg(long, env = "SBP_SHUTDOWN_GRACE")]
    pub shutdown_grace: Option<f64>,
    /// Operator API key (repeatable; env: comma-separated). When set, every HTTP endpoint but
    /// /healthz needs `Authorization: Bearer <key>`.
    #[arg(
        long = "api-key",
        env = "SBP_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// SPEC 6.1 strict mode: requests with neither `sbp` nor a session token are proxied untracked.
    #[arg(long, env = "SBP_STRICT_SBP")]
    pub strict_sbp: bool,
    /// Serve the public conformance suite's test-only endpoints (`/_test/tether`), and honour
    /// `SBP_TEST_HANDOVER_PAUSE_MS` (a pause between adopting a moved session and committing it).
    #[arg(long, env = "SBP_ENABLE_TEST_HOOKS")]
    pub enable_test_hooks: bool,
    /// INSECURE: session-scoped endpoints stop requiring the session token (for conformance runs).
    #[arg(long, env = "SBP_INSECURE_NO_SESSION_AUTH")]
    pub insecure_no_session_auth: bool,
    /// A URL clients and browsers reach this gateway by, e.g. https://gw.example.com (repeatable;
    /// env: comma-separated). Its host is accepted in `Host` besides localhost and IP literals, its
    /// origin in `Origin` besides the request's own. Bound to a non-loopback address without one,
    /// any `Host` is accepted (with a warning at start). [default: none]
    #[arg(long = "public-url", env = "SBP_PUBLIC_URLS", value_delimiter = ',')]
    pub public_urls: Vec<String>,
    /// The origin of a web app allowed to call the API from its pages, e.g.
    /// https://app.example.com (repeatable; env: comma-separated): its `Origin` is accepted,
    /// preflights are answered without credentials, and the session headers are exposed to it.
    /// Other origins stay refused. [default: none, no CORS]
    #[arg(long = "cors-origin", env = "SBP_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    /// Requests per client address (IPv6: per /64) without a valid operator key, as
    /// COUNT/s|m|h[,BURST]; 0 turns it off. [default: 200/s,1000]
    #[arg(long, env = "SBP_RATE_LIMIT_IP")]
    pub rate_limit_ip: Option<String>,
    /// Requests per session, counted once the caller is authorised; 0 turns it off.
    /// [default: 50/s,500]
    #[arg(long, env = "SBP_RATE_LIMIT_SESSION")]
    pub rate_limit_session: Option<String>,
    /// Requests per operator API key (instead of the address limit); 0 turns it off.
    /// [default: 1000/s,5000]
    #[arg(long, env = "SBP_RATE_LIMIT_KEY")]
    pub rate_limit_key: Option<String>,
    /// Failed authentications (401/403) per client address; once used up, every request from
    /// that address is refused until it refills. 0 turns it off. [default: 60/m,60]
    #[arg(long, env = "SBP_RATE_LIMIT_AUTH_FAILURES")]
    pub rate_limit_auth_failures: Option<String>,
    /// Log format: `text` or `json`, on stderr; one access line per request (target
    /// `sbp::access`). Level via SBP_LOG, e.g. SBP_LOG=debug. [default: text]
    #[arg(long, env = "SBP_LOG_FORMAT")]
    pub log_format: Option<String>,
    #[command(flatten)]
    pub federation: crate::federation::FederationArgs,
}

/// The TOML file: the same options, all optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    data_dir: Option<PathBuf>,
    database: Option<String>,
    sqlite_synchronous: Option<String>,
    tether: Option<String>,
    tether_mode: Option<String>,
    tether_prefix: Option<String>,
    bus: Option<String>,
    bus_prefix: Option<String>,
    replica_name: Option<String>,
    replicated: Option<bool>,
    replica_heartbeat: Option<f64>,
    replica_timeout: Option<f64>,
    retention_interval: Option<String>,
    export_retention: Option<String>,
    snapshot_retention: Option<String>,
    llm_base_url: Option<String>,
    llm_api_key: Option<String>,
    default_model: Option<String>,
    jwt_secret: Option<String>,
    previous_jwt_secret: Option<Vec<String>>,
    encryption_key: Option<PathBuf>,
    previous_encryption_key: Option<Vec<PathBuf>>,
    ping_interval: Option<f64>,
    pong_timeout: Option<f64>,
    attach_timeout: Option<f64>,
    tool_timeout_ms: Option<u64>,
    tool_allowlist: Option<Vec<String>>,
    max_tool_rounds: Option<u32>,
    ctp: Option<Vec<String>>,
    /// CTP rules with their own instructions: `[[ctp_rule]]` tables.
    ctp_rule: Option<Vec<CtpRuleFile>>,
    ctp_timeout: Option<f64>,
    anthropic_base_url: Option<String>,
    anthropic_api_key: Option<String>,
    anthropic_models: Option<Vec<String>>,
    mcp_servers: Option<Vec<String>>,
    sbp_version: Option<String>,
    upstream_connect_timeout: Option<f64>,
    upstream_timeout: Option<f64>,
    upstream_idle_timeout: Option<f64>,
    max_frame_bytes: Option<usize>,
    ws_write_timeout: Option<f64>,
    ws_outbound_budget: Option<usize>,
    ws_frame_rate: Option<u32>,
    ws_frame_burst: Option<u32>,
    max_body_bytes: Option<usize>,
    max_request_messages: Option<usize>,
    max_message_bytes: Option<usize>,
    max_session_messages: Option<u64>,
    max_session_bytes: Option<u64>,
    history_cache_mib: Option<usize>,
    max_json_depth: Option<usize>,
    max_json_objects: Option<usize>,
    max_json_values: Option<usize>,
    api_keys: Option<Vec<String>>,
    header_read_timeout: Option<f64>,
    body_timeout: Option<f64>,
    keep_alive_timeout: Option<f64>,
    max_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    max_inflight_body_bytes: Option<usize>,
    shutdown_grace: Option<f64>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_reload_interval: Option<f64>,
    strict_sbp: Option<bool>,
    enable_test_hooks: Option<bool>,
    insecure_no_session_auth: Option<bool>,
    public_urls: Option<Vec<String>>,
    cors_origins: Option<Vec<String>>,
    rate_limit_ip: Option<String>,
    rate_limit_session: Option<String>,
    rate_limit_key: Option<String>,
    rate_limit_auth_failures: Option<String>,
    log_format: Option<String>,
    // Federation (`crate::federation`).
    role: Option<String>,
    peers: Option<Vec<String>>,
    trackers: Option<Vec<String>>,
    peer_srv: Option<Vec<String>>,
    dns_server: Option<String>,
    federation_key: Option<PathBuf>,
    federation_tofu: Option<bool>,
    federation_allow_http: Option<bool>,
    announce_exports: Option<bool>,
    gateway_name: Option<String>,
    announce_ttl: Option<String>,
    tracker_max_records: Option<u64>,
    tracker_announce_rate: Option<String>,
    handover_lease: Option<f64>,
}

/// A `[[ctp_rule]]` table of the TOML file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CtpRuleFile {
    device_type: String,
    model: String,
    prompt: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Database {
    Sqlite(PathBuf),
    /// The URL as given (it may hold a password: never log it, see `redacted_url`).
    Postgres(String),
}

/// Where the Tether lives when not in the database (`--tether`).
#[derive(Debug, Clone)]
pub struct TetherSettings {
    /// The URL as given (it may hold a password: log `redacted_redis_url` of it).
    pub url: String,
    pub mode: TetherMode,
    pub prefix: String,
}

/// The replica bus (`--bus`).
#[derive(Debug, Clone)]
pub struct BusSettings {
    /// The URL as given (it may hold a password: log `redacted_redis_url` of it).
    pub url: String,
    pub prefix: String,
    pub name: String,
    pub heartbeat: Duration,
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub database: Database,
    pub sqlite_full_sync: bool,
    pub tether: Option<TetherSettings>,
    pub bus: Option<BusSettings>,
    pub llm_base_url: Option<String>,
    pub llm_api_key: Option<String>,
    pub default_model: Option<String>,
    pub jwt_secret: Option<String>,
    pub previous_jwt_secrets: Vec<Vec<u8>>,
    /// Encryption at rest: the key files, read by [`load_keyring`] once logging is up (so a
    /// warning about a key file's permissions is seen).
    pub encryption_key: Option<PathBuf>,
    pub previous_encryption_keys: Vec<PathBuf>,
    /// `None`: retention off.
    pub retention_interval: Option<Duration>,
    pub export_retention: Option<Duration>,
    pub snapshot_retention: Option<Duration>,
    pub ping_interval: Duration,
    pub pong_timeout: Duration,
    pub attach_timeout: Duration,
    pub tool_timeout: Duration,
    pub tool_allowlist: Option<Vec<String>>,
    pub max_tool_rounds: u32,
    pub ctp: Vec<CtpRule>,
    pub ctp_timeout: Duration,
    /// (base URL, API key, model prefixes) when Anthropic routing is configured.
    pub anthropic: Option<(String, Option<String>, Vec<String>)>,
    pub mcp_servers: Vec<String>,
    pub sbp_version: Option<String>,
    pub upstream_connect_timeout: Duration,
    pub upstream_timeout: Duration,
    pub upstream_idle_timeout: Duration,
    pub max_frame_bytes: usize,
    pub ws_write_timeout: Duration,
    pub ws_outbound_budget: usize,
    pub ws_frame_rate: u32,
    pub ws_frame_burst: u32,
    pub max_body_bytes: usize,
    pub limits: Limits,
    /// Bytes of the history cache.
    pub history_cache_bytes: usize,
    pub api_keys: Vec<String>,
    /// Timeouts and connection caps (TLS is added by `sbp serve` itself).
    pub edge: EdgeConfig,
    pub shutdown_grace: Duration,
    pub strict_sbp: bool,
    pub enable_test_hooks: bool,
    pub insecure_no_session_auth: bool,
    pub public_urls: Vec<PublicUrl>,
    pub cors_origins: Vec<PublicUrl>,
    pub rate_limits: RateLimits,
    pub log_format: String,
    /// Federation (L6); `None`: off.
    pub federation: Option<crate::federation::FederationSettings>,
}

/// A retention setting: seconds, or a number with `s`, `m`, `h` or `d`; `0` is `None` (off).
fn retention(name: &str, v: Option<String>, default: &str) -> anyhow::Result<Option<Duration>> {
    let text = v.unwrap_or_else(|| default.to_owned());
    let t = text.trim();
    let (number, unit) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&t[..i], c),
        _ => (t, 's'),
    };
    let scale = match unit {
        's' => 1.0,
        'm' => 60.0,
        'h' => 3600.0,
        'd' => 86_400.0,
        _ => bail!("--{name}: unknown unit in {text:?} (use s, m, h or d)"),
    };
    let n: f64 = number
        .trim()
        .parse()
        .with_context(|| format!("--{name}: {text:?} is not a duration"))?;
    let secs = n * scale;
    if !(secs.is_finite() && (0.0..1e10).contains(&secs)) {
        bail!("--{name} must be a duration of 0 or more, got {text:?}");
    }
    Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
}

/// A duration option: seconds, or a number with `s`, `m`, `h` or `d`; `0` is `None`.
pub(crate) fn duration(name: &str, text: &str) -> anyhow::Result<Option<Duration>> {
    retention(name, Some(text.to_owned()), "0")
}

/// An upstream's base URL, checked at start: a value that is not an absolute http(s) URL would
/// otherwise fail only at the first turn, as an upstream error. The value is not repeated in the
/// message (it may hold credentials); the reason is.
fn upstream_url(name: &str, url: String) -> anyhow::Result<String> {
    let why = match reqwest::Url::parse(url.trim()) {
        Err(e) => e.to_string(),
        Ok(u) if !matches!(u.scheme(), "http" | "https") => {
            format!("its scheme is '{}'", u.scheme())
        }
        Ok(u) if u.host_str().is_none_or(str::is_empty) => "it has no host".to_owned(),
        Ok(_) => return Ok(url.trim().to_owned()),
    };
    bail!("--{name} must be an absolute http(s) URL such as http://127.0.0.1:11434/v1 ({why})")
}

fn seconds(name: &str, v: Option<f64>, default: f64) -> anyhow::Result<Duration> {
    let s = v.unwrap_or(default);
    if !(s.is_finite() && s > 0.0 && s < 1e7) {
        bail!("--{name} must be a positive number of seconds, got {s}");
    }
    Ok(Duration::from_secs_f64(s))
}

impl Settings {
    pub fn resolve(args: ServeArgs) -> anyhow::Result<Self> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                toml::from_str::<FileConfig>(&text)
                    .with_context(|| format!("parsing {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let listen_raw = args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:8080".into());
        let listen = listen_raw.parse().with_context(|| {
            format!("--listen: '{listen_raw}' is not an address like 127.0.0.1:8080")
        })?;
        let data_dir = args
            .data_dir
            .or(file.data_dir)
            .unwrap_or_else(|| PathBuf::from("sbp-data"));
        let database = match args.database.or(file.database) {
            None => Database::Sqlite(data_dir.join("sbp.db")),
            Some(url) => parse_database(&url)?,
        };
        let sync = args
            .sqlite_synchronous
            .or(file.sqlite_synchronous)
            .unwrap_or_else(|| "full".into());
        let sqlite_full_sync = match sync.to_ascii_lowercase().as_str() {
            "full" => true,
            "normal" => false,
            other => bail!("--sqlite-synchronous must be full or normal, got '{other}'"),
        };
        let tether = parse_tether(
            args.tether.or(file.tether),
            args.tether_mode.or(file.tether_mode),
            args.tether_prefix.or(file.tether_prefix),
        )?;
        let bus = parse_bus(
            &database,
            args.replicated || file.replicated.unwrap_or(false),
            BusArgs {
                url: args.bus.or(file.bus),
                prefix: args.bus_prefix.or(file.bus_prefix),
                name: args.replica_name.or(file.replica_name),
                heartbeat: args.replica_heartbeat.or(file.replica_heartbeat),
                timeout: args.replica_timeout.or(file.replica_timeout),
            },
        )?;
        let mut api_keys: Vec<String> = args
            .api_keys
            .into_iter()
            .chain(file.api_keys.unwrap_or_default())
            .collect();
        api_keys.retain(|k| !k.trim().is_empty());
        let log_format = args
            .log_format
            .or(file.log_format)
            .unwrap_or_else(|| "text".into());
        if log_format != "text" && log_format != "json" {
            bail!("--log-format must be text or json");
        }
        let max_frame_bytes = args
            .max_frame_bytes
            .or(file.max_frame_bytes)
            .unwrap_or(1 << 20);
        let max_body_bytes = args
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(8 << 20);
        if max_frame_bytes < 1024 || max_body_bytes < 1024 {
            bail!("--max-frame-bytes and --max-body-bytes must be at least 1024");
        }
        let ws_outbound_budget = args
            .ws_outbound_budget
            .or(file.ws_outbound_budget)
            .unwrap_or(8 << 20);
        if ws_outbound_budget < 1024 {
            bail!("--ws-outbound-budget must be at least 1024");
        }
        let ws_frame_rate = args.ws_frame_rate.or(file.ws_frame_rate).unwrap_or(100);
        let ws_frame_burst = args.ws_frame_burst.or(file.ws_frame_burst).unwrap_or(1000);
        if ws_frame_rate == 0 || ws_frame_burst == 0 {
            bail!("--ws-frame-rate and --ws-frame-burst must be at least 1");
        }
        let d = Limits::default();
        let limits = Limits {
            max_request_messages: args
                .max_request_messages
                .or(file.max_request_messages)
                .unwrap_or(d.max_request_messages),
            max_message_bytes: args
                .max_message_bytes
                .or(file.max_message_bytes)
                .unwrap_or(d.max_message_bytes),
            max_session_messages: args
                .max_session_messages
                .or(file.max_session_messages)
                .unwrap_or(d.max_session_messages),
            max_session_bytes: args
                .max_session_bytes
                .or(file.max_session_bytes)
                .unwrap_or(d.max_session_bytes),
            max_json_depth: args
                .max_json_depth
                .or(file.max_json_depth)
                .unwrap_or(d.max_json_depth),
            max_json_objects: args
                .max_json_objects
                .or(file.max_json_objects)
                .unwrap_or(d.max_json_objects),
            max_json_values: args
                .max_json_values
                .or(file.max_json_values)
                .unwrap_or(d.max_json_values),
        };
        check_limits(&limits)?;
        let edge = parse_edge(EdgeArgs {
            header_read_timeout: args.header_read_timeout.or(file.header_read_timeout),
            body_timeout: args.body_timeout.or(file.body_timeout),
            keep_alive_timeout: args.keep_alive_timeout.or(file.keep_alive_timeout),
            max_connections: args.max_connections.or(file.max_connections),
            max_connections_per_ip: args.max_connections_per_ip.or(file.max_connections_per_ip),
            max_inflight_body_bytes: args
                .max_inflight_body_bytes
                .or(file.max_inflight_body_bytes),
            tls_cert: args.tls_cert.or(file.tls_cert),
            tls_key: args.tls_key.or(file.tls_key),
            tls_reload_interval: args.tls_reload_interval.or(file.tls_reload_interval),
        })?;
        let shutdown_grace = seconds(
            "shutdown-grace",
            args.shutdown_grace.or(file.shutdown_grace),
            30.0,
        )?;
        let list = |flag: Vec<String>, file: Option<Vec<String>>| -> Vec<String> {
            let mut v: Vec<String> = flag
                .into_iter()
                .chain(file.unwrap_or_default())
                .map(|s| s.trim().to_owned())
                .collect();
            v.retain(|s| !s.is_empty());
            v
        };
        let allow = list(args.tool_allowlist, file.tool_allowlist);
        let mut ctp = list(args.ctp, file.ctp)
            .iter()
            .map(|r| {
                r.parse::<CtpRule>()
                    .map_err(|e| anyhow::anyhow!("--ctp: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        for rule in file.ctp_rule.unwrap_or_default() {
            if rule.device_type.trim().is_empty() || rule.model.trim().is_empty() {
                bail!("[[ctp_rule]] needs a device_type and a model");
            }
            ctp.push(CtpRule {
                device_type: rule.device_type.trim().to_owned(),
                model: rule.model.trim().to_owned(),
                prompt: rule.prompt.filter(|p| !p.trim().is_empty()),
            });
        }
        let anthropic_key = args
            .anthropic_api_key
            .or(file.anthropic_api_key)
            .filter(|s| !s.is_empty());
        let anthropic_url = args
            .anthropic_base_url
            .or(file.anthropic_base_url)
            .filter(|s| !s.is_empty())
            .map(|u| upstream_url("anthropic-base-url", u))
            .transpose()?;
        let mut anthropic_models = list(args.anthropic_models, file.anthropic_models);
        if anthropic_models.is_empty() {
            anthropic_models = vec!["claude".into(), "anthropic/".into()];
        }
        let anthropic = match (anthropic_url, &anthropic_key) {
            (Some(url), _) => Some((url, anthropic_key.clone(), anthropic_models)),
            (None, Some(_)) => Some((
                "https://api.anthropic.com/v1".to_owned(),
                anthropic_key.clone(),
                anthropic_models,
            )),
            (None, None) => None,
        };
        let public_urls = list(args.public_urls, file.public_urls)
            .iter()
            .map(|u| u.parse().map_err(|e| anyhow::anyhow!("--public-url: {e}")))
            .collect::<anyhow::Result<Vec<PublicUrl>>>()?;
        let cors_origins = list(args.cors_origins, file.cors_origins)
            .iter()
            .map(|o| PublicUrl::parse_origin(o).map_err(|e| anyhow::anyhow!("--cors-origin: {e}")))
            .collect::<anyhow::Result<Vec<PublicUrl>>>()?;
        let defaults = RateLimits::default();
        let limit =
            |name: &str, flag: Option<String>, file: Option<String>, default| match flag.or(file) {
                None => Ok(default),
                Some(text) => parse_limit(&text).map_err(|e| anyhow::anyhow!("--{name}: {e}")),
            };
        let rate_limits = RateLimits {
            address: limit(
                "rate-limit-ip",
                args.rate_limit_ip,
                file.rate_limit_ip,
                defaults.address,
            )?,
            session: limit(
                "rate-limit-session",
                args.rate_limit_session,
                file.rate_limit_session,
                defaults.session,
            )?,
            operator_key: limit(
                "rate-limit-key",
                args.rate_limit_key,
                file.rate_limit_key,
                defaults.operator_key,
            )?,
            auth_failures: limit(
                "rate-limit-auth-failures",
                args.rate_limit_auth_failures,
                file.rate_limit_auth_failures,
                defaults.auth_failures,
            )?,
        };
        let federation = crate::federation::resolve(
            args.federation,
            crate::federation::FederationFile {
                role: file.role,
                peers: file.peers,
                trackers: file.trackers,
                peer_srv: file.peer_srv,
                dns_server: file.dns_server,
                federation_key: file.federation_key,
                federation_tofu: file.federation_tofu,
                federation_allow_http: file.federation_allow_http,
                announce_exports: file.announce_exports,
                gateway_name: file.gateway_name,
                announce_ttl: file.announce_ttl,
                tracker_max_records: file.tracker_max_records,
                tracker_announce_rate: file.tracker_announce_rate,
                handover_lease: file.handover_lease,
            },
        )?;
        let max_tool_rounds = args.max_tool_rounds.or(file.max_tool_rounds).unwrap_or(8);
        if max_tool_rounds > 64 {
            bail!("--max-tool-rounds must be at most 64");
        }
        Ok(Self {
            tool_allowlist: (!allow.is_empty()).then_some(allow),
            max_tool_rounds,
            ctp,
            ctp_timeout: seconds("ctp-timeout", args.ctp_timeout.or(file.ctp_timeout), 20.0)?,
            anthropic,
            mcp_servers: list(args.mcp_servers, file.mcp_servers),
            listen,
            data_dir,
            database,
            sqlite_full_sync,
            tether,
            bus,
            llm_base_url: args
                .llm_base_url
                .or(file.llm_base_url)
                .filter(|s| !s.is_empty())
                .map(|u| upstream_url("llm-base-url", u))
                .transpose()?,
            llm_api_key: args
                .llm_api_key
                .or(file.llm_api_key)
                .filter(|s| !s.is_empty()),
            default_model: args.default_model.or(file.default_model),
            jwt_secret: args.jwt_secret.or(file.jwt_secret),
            encryption_key: args.encryption_key.or(file.encryption_key),
            previous_encryption_keys: if args.previous_encryption_key.is_empty() {
                file.previous_encryption_key.unwrap_or_default()
            } else {
                args.previous_encryption_key
            },
            retention_interval: retention(
                "retention-interval",
                args.retention_interval.or(file.retention_interval),
                "1h",
            )?,
            export_retention: retention(
                "export-retention",
                args.export_retention.or(file.export_retention),
                "7d",
            )?,
            snapshot_retention: retention(
                "snapshot-retention",
                args.snapshot_retention.or(file.snapshot_retention),
                "30d",
            )?,
            previous_jwt_secrets: previous_secrets(if args.previous_jwt_secret.is_empty() {
                file.previous_jwt_secret.unwrap_or_default()
            } else {
                args.previous_jwt_secret
            })?,
            ping_interval: seconds(
                "ping-interval",
                args.ping_interval.or(file.ping_interval),
                25.0,
            )?,
            pong_timeout: seconds(
                "pong-timeout",
                args.pong_timeout.or(file.pong_timeout),
                10.0,
            )?,
            attach_timeout: seconds(
                "attach-timeout",
                args.attach_timeout.or(file.attach_timeout),
                10.0,
            )?,
            tool_timeout: Duration::from_millis(
                args.tool_timeout_ms
                    .or(file.tool_timeout_ms)
                    .unwrap_or(30_000)
                    .max(1),
            ),
            sbp_version: args.sbp_version.or(file.sbp_version),
            upstream_connect_timeout: seconds(
                "upstream-connect-timeout",
                args.upstream_connect_timeout
                    .or(file.upstream_connect_timeout),
                5.0,
            )?,
            upstream_timeout: seconds(
                "upstream-timeout",
                args.upstream_timeout.or(file.upstream_timeout),
                120.0,
            )?,
            upstream_idle_timeout: seconds(
                "upstream-idle-timeout",
                args.upstream_idle_timeout.or(file.upstream_idle_timeout),
                60.0,
            )?,
            max_frame_bytes,
            ws_write_timeout: seconds(
                "ws-write-timeout",
                args.ws_write_timeout.or(file.ws_write_timeout),
                10.0,
            )?,
            ws_outbound_budget,
            ws_frame_rate,
            ws_frame_burst,
            max_body_bytes,
            limits,
            history_cache_bytes: args
                .history_cache_mib
                .or(file.history_cache_mib)
                .unwrap_or(32)
                .checked_mul(1 << 20)
                .ok_or_else(|| anyhow::anyhow!("--history-cache-mib is too large"))?,
            api_keys,
            edge,
            shutdown_grace,
            strict_sbp: args.strict_sbp || file.strict_sbp.unwrap_or(false),
            enable_test_hooks: args.enable_test_hooks || file.enable_test_hooks.unwrap_or(false),
            insecure_no_session_auth: args.insecure_no_session_auth
                || file.insecure_no_session_auth.unwrap_or(false),
            public_urls,
            cors_origins,
            rate_limits,
            log_format,
            federation,
        })
    }
}

/// Limits that leave a gateway able to work: a chat request nests at least 8 levels deep (an image
/// part's URL), and serde_json refuses more than 128; the others must allow something.
fn check_limits(l: &Limits) -> anyhow::Result<()> {
    if !(8..=128).contains(&l.max_json_depth) {
        bail!("--max-json-depth must be from 8 to 128");
    }
    if l.max_request_messages == 0
        || l.max_message_bytes == 0
        || l.max_session_messages < 2
        || l.max_session_bytes == 0
        || l.max_json_objects == 0
        || l.max_json_values == 0
    {
        bail!(
            "--max-request-messages, --max-message-bytes, --max-session-bytes, \
             --max-json-objects and --max-json-values must be at least 1, \
             --max-session-messages at least 2"
        );
    }
    Ok(())
}

fn parse_database(url: &str) -> anyhow::Result<Database> {
    if let Some(rest) = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
    {
        if rest.is_empty() {
            bail!("--database sqlite:// needs a file path, e.g. sqlite://./sbp-data/sbp.db");
        }
        return Ok(Database::Sqlite(PathBuf::from(rest)));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        sbp_store::postgres::TlsParams::from_url(url).map_err(|e| anyhow!("--database: {e}"))?;
        return Ok(Database::Postgres(url.to_owned()));
    }
    // Not the URL itself: a mistyped scheme may come with a password.
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    bail!(
        "--database must look like sqlite://PATH or postgres://USER@HOST/DB, got a URL of scheme '{scheme}'"
    )
}

fn parse_tether(
    url: Option<String>,
    mode: Option<String>,
    prefix: Option<String>,
) -> anyhow::Result<Option<TetherSettings>> {
    let Some(url) = url.filter(|u| !u.trim().is_empty()) else {
        if mode.is_some() || prefix.is_some() {
            bail!("--tether-mode and --tether-prefix need --tether redis://...");
        }
        return Ok(None);
    };
    if !url.starts_with("redis://") {
        bail!("--tether must look like redis://HOST[:PORT][/DB], got '{url}'");
    }
    let mode = match mode {
        None => TetherMode::Auto,
        Some(m) => m
            .parse()
            .map_err(|e| anyhow::anyhow!("--tether-mode: {e}"))?,
    };
    let prefix = prefix.unwrap_or_else(|| "sbp:".to_owned());
    if prefix.is_empty() || prefix.chars().any(|c| c.is_whitespace() || c == '*') {
        bail!("--tether-prefix must be non-empty, without spaces or '*'");
    }
    Ok(Some(TetherSettings { url, mode, prefix }))
}

struct EdgeArgs {
    header_read_timeout: Option<f64>,
    body_timeout: Option<f64>,
    keep_alive_timeout: Option<f64>,
    max_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    max_inflight_body_bytes: Option<usize>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_reload_interval: Option<f64>,
}

/// The connection layer's timeouts, caps and TLS files.
fn parse_edge(a: EdgeArgs) -> anyhow::Result<EdgeConfig> {
    let defaults = EdgeConfig::default();
    let max_connections = a.max_connections.unwrap_or(defaults.max_connections);
    if max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    let max_inflight_body_bytes = a
        .max_inflight_body_bytes
        .unwrap_or(defaults.max_inflight_body_bytes);
    if max_inflight_body_bytes < 1024 {
        bail!("--max-inflight-body-bytes must be at least 1024");
    }
    Ok(EdgeConfig {
        header_read_timeout: seconds(
            "header-read-timeout",
            a.header_read_timeout,
            defaults.header_read_timeout.as_secs_f64(),
        )?,
        body_timeout: seconds(
            "body-timeout",
            a.body_timeout,
            defaults.body_timeout.as_secs_f64(),
        )?,
        keep_alive_timeout: seconds(
            "keep-alive-timeout",
            a.keep_alive_timeout,
            defaults.keep_alive_timeout.as_secs_f64(),
        )?,
        max_connections,
        max_connections_per_ip: a
            .max_connections_per_ip
            .unwrap_or(defaults.max_connections_per_ip),
        max_inflight_body_bytes,
        tls: match (a.tls_cert, a.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
            (None, None) => None,
            _ => bail!("--tls-cert and --tls-key go together"),
        },
        tls_reload_interval: seconds(
            "tls-reload-interval",
            a.tls_reload_interval,
            defaults.tls_reload_interval.as_secs_f64(),
        )?,
    })
}

struct BusArgs {
    url: Option<String>,
    prefix: Option<String>,
    name: Option<String>,
    heartbeat: Option<f64>,
    timeout: Option<f64>,
}

fn parse_bus(
    database: &Database,
    replicated: bool,
    a: BusArgs,
) -> anyhow::Result<Option<BusSettings>> {
    let Some(url) = a.url.filter(|u| !u.trim().is_empty()) else {
        if replicated {
            bail!(
                "--replicated needs --bus redis://...: without a bus, replicas cannot route a turn's \
                 chunks and tool calls to a surface attached to another replica"
            );
        }
        if a.prefix.is_some() || a.name.is_some() {
            bail!("--bus-prefix and --replica-name need --bus redis://...");
        }
        return Ok(None);
    };
    if !url.starts_with("redis://") {
        bail!("--bus must look like redis://HOST[:PORT][/DB], got '{url}'");
    }
    if matches!(database, Database::Sqlite(_)) {
        bail!("--bus needs --database postgres://...: replicas share one PostgreSQL database");
    }
    let prefix = a.prefix.unwrap_or_else(|| "sbp:".to_owned());
    if prefix.is_empty() || prefix.chars().any(|c| c.is_whitespace() || c == '*') {
        bail!("--bus-prefix must be non-empty, without spaces or '*'");
    }
    let name = a.name.unwrap_or_else(|| "gw".to_owned());
    // The run suffix adds 13 characters to the 64 a replica id may have.
    if name.len() > 50 || !sbp_bus::valid_replica_id(&name) {
        bail!("--replica-name must be 1-50 characters of A-Z a-z 0-9 . _ -, got '{name}'");
    }
    let heartbeat = seconds("replica-heartbeat", a.heartbeat, 2.0)?;
    let timeout = seconds("replica-timeout", a.timeout, 10.0)?;
    if timeout < heartbeat * 2 {
        bail!("--replica-timeout must be at least twice --replica-heartbeat");
    }
    Ok(Some(BusSettings {
        url,
        prefix,
        name,
        heartbeat,
        timeout,
    }))
}

/// The signing secret: the configured one (>= 32 bytes), or the one kept in `<data_dir>/secret`,
/// created with 48 random bytes on first start (owner-only permissions). Never logged.
/// The `--previous-jwt-secret` values, each at least 32 bytes like `--jwt-secret`.
/// Largest key file read: a key is 64 characters; anything much longer is not a key file.
const MAX_KEY_FILE: u64 = 1024;

/// The keyring of `--encryption-key` and `--previous-encryption-key` (off without the first).
pub fn load_keyring(current: Option<&Path>, previous: &[PathBuf]) -> anyhow::Result<Sealer> {
    let Some(current) = current else {
        if !previous.is_empty() {
            bail!(
                "--previous-encryption-key needs --encryption-key (the key new values are sealed under)"
            );
        }
        return Ok(Sealer::off());
    };
    let current = load_key("--encryption-key", current)?;
    let previous = previous
        .iter()
        .map(|path| load_key("--previous-encryption-key", path))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let keyring = Keyring::new(current, previous).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Sealer::new(keyring))
}

/// One key file: its permissions checked (a file others may read is used, with a warning: the
/// operator's secret store may mount it so), its size bounded, its text never repeated.
pub fn load_key(flag: &str, path: &Path) -> anyhow::Result<Key> {
    let meta = std::fs::metadata(path).with_context(|| format!("{flag} {}", path.display()))?;
    if !meta.is_file() || meta.len() > MAX_KEY_FILE {
        bail!(
            "{flag} {}: not a key file (a key is 32 bytes as 64 hex digits or base64)",
            path.display()
        );
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:o}"),
                "{flag}: the key file may be read by other users; make it 0600"
            );
        }
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("{flag} {}", path.display()))?;
    Key::from_text(&text).map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))
}

fn previous_secrets(values: Vec<String>) -> anyhow::Result<Vec<Vec<u8>>> {
    values
        .into_iter()
        .map(|s| {
            if s.len() < 32 {
                bail!("--previous-jwt-secret must be at least 32 bytes");
            }
            Ok(s.into_bytes())
        })
        .collect()
}

pub fn load_secret(configured: Option<&str>, data_dir: &Path) -> anyhow::Result<Vec<u8>> {
    use base64::Engine as _;
    if let Some(s) = configured {
        if s.len() < 32 {
            bail!("--jwt-secret must be at least 32 bytes");
        }
        return Ok(s.as_bytes().to_vec());
    }
    let path = data_dir.join("secret");
    if path.exists() {
        private_dir(data_dir)?;
        narrow(&path, 0o600).with_context(|| format!("restricting {}", path.display()))?;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text.trim())
            .with_context(|| format!("{} is not a secret written by sbp", path.display()))?;
        if bytes.len() < 32 {
            bail!("{} holds fewer than 32 bytes", path.display());
        }
        return Ok(bytes);
    }
    private_dir(data_dir)?;
    let mut bytes = vec![0u8; 48];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut bytes);
    let text = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes);
    write_private(&path, text.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    Ok(bytes)
}

/// The data directory, created owner-only (0700), or narrowed to that (logged) when it exists
/// with access for others: it holds the database and the signing secret.
pub fn private_dir(dir: &Path) -> anyhow::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    narrow(dir, 0o700).with_context(|| format!("restricting {}", dir.display()))
}

/// Sets `path`'s mode to `mode` when it grants group or others any access (logged); the owner's
/// bits are left alone otherwise.
pub(crate) fn narrow(path: &Path, mode: u32) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let was = std::fs::metadata(path)?.permissions().mode() & 0o777;
        if was & 0o077 != 0 {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
            tracing::warn!(
                path = %path.display(),
                was = format!("{was:o}"),
                now = format!("{mode:o}"),
                "narrowed the permissions of the gateway's data"
            );
        }
    }
    #[cfg(not(unix))]
    let _ = (path, mode);
    Ok(())
}

pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_durations() {
        let d = |v: &str| retention("x", Some(v.to_owned()), "1h");
        assert_eq!(d("90").expect("s"), Some(Duration::from_secs(90)));
        assert_eq!(d("2m").expect("m"), Some(Duration::from_secs(120)));
        assert_eq!(d("1.5h").expect("h"), Some(Duration::from_secs(5400)));
        assert_eq!(d("7d").expect("d"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(d("0").expect("off"), None);
        assert_eq!(
            retention("x", None, "1h").expect("default"),
            Some(Duration::from_secs(3600))
        );
        for bad in ["", "d", "-1", "3w", "NaN", "1e20d"] {
            assert!(d(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_and_file_and_flag_precedence() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:9999\"\nping_interval = 3\napi_keys = [\"k1\"]\n",
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file.clone()),
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(s.listen.to_string(), "127.0.0.1:9999");
        assert_eq!(s.ping_interval, Duration::from_secs(3));
        assert_eq!(s.api_keys, vec!["k1"]);
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            listen: Some("127.0.0.1:7000".into()),
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(s.listen.to_string(), "127.0.0.1:7000");
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert_eq!(d.listen.to_string(), "127.0.0.1:8080");
        assert!(matches!(d.database, Database::Sqlite(ref p) if p == Path::new("sbp-data/sbp.db")));
    }

    #[test]
    fn tool_ctp_anthropic_and_mcp_options_from_toml_and_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            "tool_allowlist = [\"gps\"]\nmax_tool_rounds = 3\nctp = [\"voice=m1\"]\n\
             mcp_servers = [\"calc=stdio:python3 calc.py\"]\nanthropic_api_key = \"k\"\n\
             [[ctp_rule]]\ndevice_type = \"iot\"\nmodel = \"m2\"\nprompt = \"Be terse.\"\n",
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            ctp: vec!["mobile=m0".into()],
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(s.tool_allowlist, Some(vec!["gps".to_owned()]));
        assert_eq!(s.max_tool_rounds, 3);
        let rules: Vec<(&str, &str, Option<&str>)> = s
            .ctp
            .iter()
            .map(|r| {
                (
                    r.device_type.as_str(),
                    r.model.as_str(),
                    r.prompt.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            rules,
            [
                ("mobile", "m0", None),
                ("voice", "m1", None),
                ("iot", "m2", Some("Be terse."))
            ]
        );
        assert_eq!(s.mcp_servers, vec!["calc=stdio:python3 calc.py"]);
        let (url, key, prefixes) = s.anthropic.expect("anthropic configured by its key");
        assert_eq!(url, "https://api.anthropic.com/v1");
        assert_eq!(key.as_deref(), Some("k"));
        assert_eq!(prefixes, vec!["claude", "anthropic/"]);
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert!(d.anthropic.is_none() && d.ctp.is_empty() && d.tool_allowlist.is_none());
    }

    #[test]
    fn postgres_urls_are_accepted() {
        for url in [
            "postgres://sbp:pw@db.internal:5432/sbp",
            "postgresql://127.0.0.1/test",
        ] {
            let s = Settings::resolve(ServeArgs {
                database: Some(url.into()),
                ..Default::default()
            })
            .expect("resolves");
            assert!(matches!(s.database, Database::Postgres(ref u) if u == url));
        }
    }

    #[test]
    fn postgres_tls_parameters_are_checked_and_passwords_kept_out_of_errors() {
        let resolve = |url: &str| {
            Settings::resolve(ServeArgs {
                database: Some(url.into()),
                ..Default::default()
            })
        };
        let ok = "postgres://u:pw@db/sbp?sslmode=verify-full&sslrootcert=/etc/ca.pem";
        assert!(matches!(
            resolve(ok).expect("resolves").database,
            Database::Postgres(_)
        ));
        for (url, want) in [
            (
                "postgres://u:hunter2@db/sbp?sslmode=strict",
                "sslmode=\"strict\" is not one of",
            ),
            (
                "postgres://u:hunter2@db/sbp?sslmode=verify-ca",
                "needs sslrootcert",
            ),
            ("postgress://u:hunter2@db/sbp", "scheme 'postgress'"),
            (
                "postgres://u:hunter2@%2Ftmp,db/sbp?sslmode=require",
                "mixes Unix sockets and TCP hosts",
            ),
        ] {
            let e = format!("{:#}", resolve(url).expect_err(url));
            assert!(e.contains(want), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn tether_in_redis() {
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert!(d.tether.is_none(), "the database's own tether by default");
        let s = Settings::resolve(ServeArgs {
            tether: Some("redis://:pw@10.0.0.2:6380/1".into()),
            ..Default::default()
        })
        .expect("resolves");
        let t = s.tether.expect("tether configured");
        assert_eq!(
            (t.url.as_str(), t.mode, t.prefix.as_str()),
            ("redis://:pw@10.0.0.2:6380/1", TetherMode::Auto, "sbp:")
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            "tether = \"redis://127.0.0.1\"\ntether_mode = \"mirror\"\ntether_prefix = \"a:\"\n",
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            tether_mode: Some("handoff".into()),
            ..Default::default()
        })
        .expect("resolves");
        let t = s.tether.expect("tether from the file");
        assert_eq!((t.mode, t.prefix.as_str()), (TetherMode::Handoff, "a:"));
        for args in [
            ServeArgs {
                tether: Some("postgres://x".into()),
                ..Default::default()
            },
            ServeArgs {
                tether: Some("redis://x".into()),
                tether_mode: Some("sometimes".into()),
                ..Default::default()
            },
            ServeArgs {
                tether_mode: Some("mirror".into()),
                ..Default::default()
            },
        ] {
            assert!(Settings::resolve(args).is_err());
        }
    }

    #[test]
    fn connection_limits_from_toml_and_flags() {
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert_eq!(
            (
                d.edge.header_read_timeout,
                d.edge.body_timeout,
                d.edge.keep_alive_timeout,
                d.edge.max_connections,
                d.edge.max_connections_per_ip,
                d.shutdown_grace
            ),
            (
                Duration::from_secs(10),
                Duration::from_secs(60),
                Duration::from_secs(60),
                10_000,
                1_000,
                Duration::from_secs(30)
            )
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            "header_read_timeout = 2.5\nmax_connections = 50\nmax_connections_per_ip = 0\n\
             shutdown_grace = 5\nmax_inflight_body_bytes = 4194304\n",
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            keep_alive_timeout: Some(7.0),
            max_connections: Some(60),
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(s.edge.header_read_timeout, Duration::from_millis(2500));
        assert_eq!(s.edge.keep_alive_timeout, Duration::from_secs(7));
        assert_eq!(s.edge.max_connections, 60, "the flag wins over the file");
        assert_eq!(s.edge.max_connections_per_ip, 0);
        assert_eq!(s.edge.max_inflight_body_bytes, 4 << 20);
        assert_eq!(d.edge.max_inflight_body_bytes, 8 << 20);
        assert_eq!(s.shutdown_grace, Duration::from_secs(5));
        assert!(s.edge.tls.is_none());
        let s = Settings::resolve(ServeArgs {
            tls_cert: Some("c.pem".into()),
            tls_key: Some("k.pem".into()),
            ..Default::default()
        })
        .expect("resolves");
        let tls = s.edge.tls.expect("TLS files");
        assert_eq!((tls.cert, tls.key), ("c.pem".into(), "k.pem".into()));
        for args in [
            ServeArgs {
                tls_cert: Some("c.pem".into()),
                ..Default::default()
            },
            ServeArgs {
                max_connections: Some(0),
                ..Default::default()
            },
            ServeArgs {
                max_inflight_body_bytes: Some(1000),
                ..Default::default()
            },
            ServeArgs {
                body_timeout: Some(0.0),
                ..Default::default()
            },
            ServeArgs {
                shutdown_grace: Some(-1.0),
                ..Default::default()
            },
        ] {
            assert!(Settings::resolve(args).is_err());
        }
    }

    #[test]
    fn bad_values_are_refused() {
        for args in [
            ServeArgs {
                database: Some("mysql://x".into()),
                ..Default::default()
            },
            ServeArgs {
                listen: Some("nowhere".into()),
                ..Default::default()
            },
            ServeArgs {
                ping_interval: Some(-1.0),
                ..Default::default()
            },
            ServeArgs {
                sqlite_synchronous: Some("sometimes".into()),
                ..Default::default()
            },
            ServeArgs {
                max_json_depth: Some(200),
                ..Default::default()
            },
            ServeArgs {
                max_session_messages: Some(0),
                ..Default::default()
            },
            ServeArgs {
                max_request_messages: Some(0),
                ..Default::default()
            },
        ] {
            assert!(Settings::resolve(args).is_err());
        }
    }

    #[test]
    fn upstream_urls_must_be_absolute_http() {
        for good in [
            "http://127.0.0.1:11434/v1",
            "https://api.openai.com/v1",
            " http://[::1]:8000/v1 ",
        ] {
            assert_eq!(
                upstream_url("llm-base-url", good.into()).ok().as_deref(),
                Some(good.trim()),
                "{good}"
            );
        }
        for (bad, why) in [
            ("notaurl", "relative URL without a base"),
            ("/v1", "relative URL"),
            ("ftp://host/v1", "scheme is 'ftp'"),
            ("file:///tmp/x", "scheme is 'file'"),
            ("http://", "empty host"),
        ] {
            let err = upstream_url("llm-base-url", bad.into())
                .expect_err(bad)
                .to_string();
            assert!(
                err.starts_with("--llm-base-url must be an absolute http(s) URL")
                    && err.contains(why),
                "{bad}: {err}"
            );
        }
        let args = ServeArgs {
            anthropic_base_url: Some("api.anthropic.com".into()),
            ..Default::default()
        };
        let err = Settings::resolve(args).expect_err("refused").to_string();
        assert!(err.contains("--anthropic-base-url"), "{err}");
    }

    #[test]
    fn public_urls_and_rate_limits() {
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert!(d.public_urls.is_empty());
        assert_eq!(d.rate_limits, RateLimits::default());
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            "public_urls = [\"https://b.example\"]\nrate_limit_session = \"5/m,10\"\n\
             rate_limit_ip = \"1/s\"\n",
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            public_urls: vec!["https://GW.example.com:8443/base".into()],
            rate_limit_ip: Some("0".into()),
            rate_limit_auth_failures: Some("off".into()),
            ..Default::default()
        })
        .expect("resolves");
        let urls: Vec<String> = s.public_urls.iter().map(ToString::to_string).collect();
        assert_eq!(urls, ["https://gw.example.com:8443", "https://b.example"]);
        assert_eq!(s.rate_limits.address, None, "the flag wins over the file");
        assert_eq!(s.rate_limits.auth_failures, None);
        assert_eq!(
            s.rate_limits.session.map(|r| r.to_string()).as_deref(),
            Some("5/m,10")
        );
        assert_eq!(
            s.rate_limits.operator_key,
            RateLimits::default().operator_key
        );
        for args in [
            ServeArgs {
                public_urls: vec!["ftp://x".into()],
                ..Default::default()
            },
            ServeArgs {
                public_urls: vec!["gw.example.com".into()],
                ..Default::default()
            },
            ServeArgs {
                rate_limit_key: Some("fast".into()),
                ..Default::default()
            },
        ] {
            assert!(Settings::resolve(args).is_err());
        }
    }

    #[test]
    fn cors_origins_from_flags_and_file() {
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert!(d.cors_origins.is_empty(), "off by default");
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(&file, "cors_origins = [\"http://localhost:5173\"]\n").expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            cors_origins: vec!["https://App.example.com/".into()],
            ..Default::default()
        })
        .expect("resolves");
        let origins: Vec<String> = s.cors_origins.iter().map(ToString::to_string).collect();
        assert_eq!(
            origins,
            ["https://app.example.com", "http://localhost:5173"]
        );
        for bad in [
            "*",
            "null",
            "app.example.com",
            "ftp://app.example.com",
            "https://app.example.com/path",
            "https://app.example.com/?q",
        ] {
            let args = ServeArgs {
                cors_origins: vec![bad.into()],
                ..Default::default()
            };
            assert!(Settings::resolve(args).is_err(), "{bad}");
        }
    }

    #[test]
    fn secret_is_generated_once_and_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = load_secret(None, dir.path()).expect("created");
        let b = load_secret(None, dir.path()).expect("read back");
        assert_eq!(a, b);
        assert!(a.len() >= 32);
        assert!(load_secret(Some("short"), dir.path()).is_err());
        assert_eq!(
            load_secret(Some(&"x".repeat(32)), dir.path()).expect("ok"),
            vec![b'x'; 32]
        );
    }

    #[test]
    fn websocket_limits_default_and_come_from_file_and_flags() {
        let s = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert_eq!(s.ws_write_timeout, Duration::from_secs(10));
        assert_eq!(
            (s.ws_outbound_budget, s.ws_frame_rate, s.ws_frame_burst),
            (8 << 20, 100, 1000)
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(&file, "ws_frame_rate = 50\nws_outbound_budget = 65536\n").expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            ws_write_timeout: Some(2.5),
            ws_frame_burst: Some(80),
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(s.ws_write_timeout, Duration::from_millis(2500));
        assert_eq!(
            (s.ws_outbound_budget, s.ws_frame_rate, s.ws_frame_burst),
            (65536, 50, 80)
        );
        for args in [
            ServeArgs {
                ws_outbound_budget: Some(10),
                ..Default::default()
            },
            ServeArgs {
                ws_frame_rate: Some(0),
                ..Default::default()
            },
            ServeArgs {
                ws_write_timeout: Some(0.0),
                ..Default::default()
            },
        ] {
            assert!(Settings::resolve(args).is_err());
        }
    }

    #[test]
    fn limits_from_flags_and_toml() {
        let d = Settings::resolve(ServeArgs::default()).expect("resolves");
        assert_eq!(d.limits, Limits::default());
        assert!(d.limits.max_session_messages >= 100_000);
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            "max_session_messages = 500\nmax_session_bytes = 9000\nmax_json_depth = 16\n",
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            max_session_messages: Some(700),
            max_request_messages: Some(50),
            max_message_bytes: Some(2048),
            max_json_objects: Some(99),
            max_json_values: Some(999),
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(
            s.limits,
            Limits {
                max_request_messages: 50,
                max_message_bytes: 2048,
                max_session_messages: 700,
                max_session_bytes: 9000,
                max_json_depth: 16,
                max_json_objects: 99,
                max_json_values: 999,
            }
        );
    }

    /// Key files come from flags or the TOML file; the keyring holds them as current and
    /// previous; lengths other than 32 bytes and a previous key without a current one are refused.
    #[test]
    fn encryption_keys_from_flags_and_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (k1, k2, short) = (
            dir.path().join("k1"),
            dir.path().join("k2"),
            dir.path().join("short"),
        );
        std::fs::write(&k1, "01".repeat(32)).expect("write");
        std::fs::write(&k2, format!("{}\n", Key::generate_text().expect("random"))).expect("write");
        std::fs::write(&short, "01".repeat(16)).expect("write");
        let file = dir.path().join("sbp.toml");
        std::fs::write(
            &file,
            format!(
                "encryption_key = {:?}\nprevious_encryption_key = [{:?}]\n",
                k2.display().to_string(),
                k1.display().to_string()
            ),
        )
        .expect("write");
        let s = Settings::resolve(ServeArgs {
            config: Some(file),
            ..Default::default()
        })
        .expect("resolves");
        assert_eq!(s.encryption_key.as_deref(), Some(k2.as_path()));
        assert_eq!(s.previous_encryption_keys, vec![k1.clone()]);
        let sealer =
            load_keyring(s.encryption_key.as_deref(), &s.previous_encryption_keys).expect("keys");
        let k2_id = load_key("k", &k2).expect("k2").id();
        assert_eq!(sealer.current(), Some(k2_id));

        assert!(!load_keyring(None, &[]).expect("off").is_on());
        let err = load_keyring(None, std::slice::from_ref(&k1)).expect_err("no current");
        assert!(err.to_string().contains("needs --encryption-key"), "{err}");
        let err = load_keyring(Some(&short), &[]).expect_err("16 bytes");
        assert!(err.to_string().contains("32 bytes"), "{err}");
        let err = load_keyring(Some(&dir.path().join("missing")), &[]).expect_err("missing");
        assert!(err.to_string().contains("--encryption-key"), "{err}");
    }
}
