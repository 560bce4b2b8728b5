//! `sbp serve`: opens storage, builds the upstream provider and runs the gateway until SIGINT/SIGTERM.

use std::io::Write as _;
use std::sync::Arc;

use anyhow::Context;
use sbp_bus::{RedisBus, RedisBusOptions};
use sbp_gateway::{BusLink, EdgeConfig, Gateway, GatewayConfig};
use sbp_llm::{
    AnthropicOptions, AnthropicProvider, EchoProvider, ModelMatch, OpenAiOptions, OpenAiProvider,
    Provider, Router,
};
use sbp_store::postgres::{PostgresOptions, PostgresStore, redacted_url};
use sbp_store::redis_tether::{RedisTetherOptions, TetheredStore, redacted_redis_url};
use sbp_store::seal::Sealer;
use sbp_store::sqlite::{SqliteOptions, SqliteStore, Synchronous};

use crate::config::{Database, Settings, load_keyring, load_secret, private_dir};

/// How long a southbound MCP server may take to start and list its tools.
const MCP_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

pub async fn run(s: Settings) -> anyhow::Result<()> {
    if matches!(&s.database, Database::Sqlite(path) if path.starts_with(&s.data_dir)) {
        private_dir(&s.data_dir)?;
    }
    let secret = load_secret(s.jwt_secret.as_deref(), &s.data_dir)?;
    let sealer = load_keyring(s.encryption_key.as_deref(), &s.previous_encryption_keys)?;
    let (store, storage_label) = open_store(&s, &sealer).await?;
    let (provider, upstream_label): (Arc<dyn Provider>, String) = match &s.llm_base_url {
        Some(url) => {
            let p = OpenAiProvider::new(OpenAiOptions {
                base_url: url.clone(),
                api_key: s.llm_api_key.clone(),
                connect_timeout: s.upstream_connect_timeout,
                request_timeout: s.upstream_timeout,
                stream_idle_timeout: s.upstream_idle_timeout,
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            (Arc::new(p), format!("upstream {url}"))
        }
        None => (
            Arc::new(EchoProvider),
            format!("built-in offline model {}", sbp_llm::ECHO_MODEL),
        ),
    };
    // The built-in model stays reachable beside an upstream, by its exact name: a health check,
    // a conformance run or a demo needs no upstream credit, and `GET /v1/models` lists it.
    let provider: Arc<dyn Provider> = match &s.llm_base_url {
        None => provider,
        Some(_) => Arc::new(Router::new(provider).with_route(
            ModelMatch::exact(sbp_llm::ECHO_MODEL),
            Arc::new(EchoProvider),
        )),
    };
    let (provider, upstream_label) = match &s.anthropic {
        None => (provider, upstream_label),
        Some((url, key, prefixes)) => {
            let anthropic = AnthropicProvider::new(AnthropicOptions {
                base_url: url.clone(),
                api_key: key.clone(),
                connect_timeout: s.upstream_connect_timeout,
                request_timeout: s.upstream_timeout,
                stream_idle_timeout: s.upstream_idle_timeout,
                ..AnthropicOptions::default()
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            let anthropic: Arc<dyn Provider> = Arc::new(anthropic);
            let mut router = Router::new(provider);
            for prefix in prefixes {
                let mut matcher = ModelMatch::prefix(prefix.clone());
                if prefix.ends_with('/') {
                    matcher = matcher.stripping_prefix();
                }
                router.push(matcher, anthropic.clone());
            }
            (
                Arc::new(router) as Arc<dyn Provider>,
                format!(
                    "{upstream_label}; models {} via Anthropic {url}",
                    prefixes.join(", ")
                ),
            )
        }
    };
    if let Some(files) = &s.edge.tls {
        sbp_gateway::check_tls(files).map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?;
    }
    let federation = match &s.federation {
        None => None,
        Some(f) => {
            if s.insecure_no_session_auth {
                anyhow::bail!(
                    "--insecure-no-session-auth cannot be used with federation: a session moves between gateways on its token"
                );
            }
            if s.listen.ip().is_unspecified() && s.public_urls.is_empty() {
                anyhow::bail!(
                    "federation on {} needs --public-url: peers must be told an address they can reach",
                    s.listen
                );
            }
            if s.bus.is_some() && f.key_file.is_none() {
                anyhow::bail!(
                    "replicas with federation need --federation-key FILE: every replica of a deployment signs with the same key"
                );
            }
            Some(crate::federation::load(f, &s.data_dir)?)
        }
    };
    let edge = fit_connections(s.edge.clone(), raise_fd_limit());
    let defaults = GatewayConfig::default();
    let config = GatewayConfig {
        sbp_version: s.sbp_version.clone().unwrap_or(defaults.sbp_version),
        default_model: s.default_model.clone().unwrap_or(defaults.default_model),
        ping_interval: s.ping_interval,
        pong_timeout: s.pong_timeout,
        attach_timeout: s.attach_timeout,
        tool_timeout: s.tool_timeout,
        tool_allowlist: s.tool_allowlist.clone(),
        max_tool_rounds: s.max_tool_rounds,
        ctp: s.ctp.clone(),
        ctp_timeout: s.ctp_timeout,
        max_frame_bytes: s.max_frame_bytes,
        ws_write_timeout: s.ws_write_timeout,
        ws_outbound_budget: s.ws_outbound_budget,
        ws_frame_rate: s.ws_frame_rate,
        ws_frame_burst: s.ws_frame_burst,
        max_body_bytes: s.max_body_bytes,
        limits: s.limits,
        history_cache_bytes: s.history_cache_bytes,
        api_keys: s.api_keys.clone(),
        strict_sbp: s.strict_sbp,
        enable_test_hooks: s.enable_test_hooks,
        insecure_no_session_auth: s.insecure_no_session_auth,
        public_urls: s.public_urls.clone(),
        cors_origins: s.cors_origins.clone(),
        rate_limits: s.rate_limits.clone(),
        secret,
        previous_secrets: s.previous_jwt_secrets.clone(),
        retention_interval: s.retention_interval.unwrap_or_default(),
        export_retention: s.export_retention,
        snapshot_retention: s.snapshot_retention,
        edge,
        shutdown_grace: s.shutdown_grace,
        federation,
        ..defaults
    };
    let config = match &s.bus {
        Some(b) => GatewayConfig {
            replica_id: sbp_gateway::run_replica_id(&b.name),
            replica_heartbeat: b.heartbeat,
            replica_timeout: b.timeout,
            ..config
        },
        None => config,
    };
    let (bus, bus_link) = match &s.bus {
        None => (None, None),
        Some(b) => {
            let label = redacted_redis_url(&b.url);
            let opts = RedisBusOptions {
                prefix: b.prefix.clone(),
                heartbeat: b.heartbeat,
                ttl: b.timeout,
                ..RedisBusOptions::new(b.url.clone(), config.replica_id.clone())
            };
            let (bus, inbox) = RedisBus::connect(opts)
                .await
                .with_context(|| format!("joining the replica bus at {label}"))?;
            let link = BusLink {
                bus: bus.clone(),
                inbox,
            };
            (Some(bus), Some(link))
        }
    };
    if config.insecure_no_session_auth {
        tracing::warn!(
            "--insecure-no-session-auth: session endpoints accept calls without the session token"
        );
    }
    let servers = s
        .mcp_servers
        .iter()
        .map(|line| {
            line.parse::<sbp_mcp::ServerConfig>()
                .map_err(|e| anyhow::anyhow!("--mcp-server '{line}': {e}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let southbound = if servers.is_empty() {
        sbp_mcp::Southbound::empty()
    } else {
        let sb = sbp_mcp::Southbound::connect(servers, MCP_CONNECT_TIMEOUT).await;
        tracing::info!(servers = ?sb.servers(), tools = sb.tools().len(), "southbound MCP servers connected");
        sb
    };
    let replica = bus.as_ref().map(|_| config.replica_id.clone());
    let gateway = Gateway::start_replica(
        config,
        store,
        provider,
        Arc::new(southbound.clone()),
        bus_link,
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let listener = bind(s.listen).with_context(|| format!("binding {}", s.listen))?;
    let addr = listener.local_addr()?;
    let scheme = match &s.edge.tls {
        Some(_) => "https",
        None => "http",
    };
    let hint = if s.llm_base_url.is_none() {
        "; for a real LLM add --llm-base-url http://127.0.0.1:11434/v1 (Ollama; vLLM :8000/v1, llama.cpp :8080/v1) or https://api.openai.com/v1 with --llm-api-key"
    } else {
        ""
    };
    let replica_label = match (&replica, &s.bus) {
        (Some(id), Some(b)) => format!("; replica {id} on bus {}", redacted_redis_url(&b.url)),
        _ => String::new(),
    };
    println!(
        "sbp gateway listening on {scheme}://{addr} (storage {storage_label}{replica_label}; {upstream_label}{hint})"
    );
    std::io::stdout().flush()?;
    sbp_gateway::serve(listener, gateway, shutdown_signal()).await?;
    southbound.shutdown().await;
    if let Some(bus) = bus {
        bus.close().await;
    }
    tracing::info!("gateway stopped");
    Ok(())
}

/// The store `s` names, sealing with `sealer`, wrapped in the Redis tether when one is set; and
/// how the startup line names it.
pub async fn open_store(
    s: &Settings,
    sealer: &Sealer,
) -> anyhow::Result<(Arc<dyn sbp_store::Store>, String)> {
    let (store, storage_label) = match &s.database {
        Database::Sqlite(path) => {
            let opts = SqliteOptions {
                synchronous: if s.sqlite_full_sync {
                    Synchronous::Full
                } else {
                    Synchronous::Normal
                },
                sealer: sealer.clone(),
                ..SqliteOptions::new(path)
            };
            let store = SqliteStore::open(opts)
                .await
                .with_context(|| format!("opening {}", path.display()))?;
            (
                Arc::new(store) as Arc<dyn sbp_store::Store>,
                format!("sqlite://{}", path.display()),
            )
        }
        Database::Postgres(url) => {
            let label = redacted_url(url);
            let opts = PostgresOptions {
                sealer: sealer.clone(),
                ..PostgresOptions::default()
            };
            let store = PostgresStore::open(url, opts)
                .await
                .with_context(|| format!("opening {label}"))?;
            (Arc::new(store) as Arc<dyn sbp_store::Store>, label)
        }
    };
    let storage_label = match sealer.current() {
        Some(id) => format!("{storage_label}, encrypted at rest under key {id}"),
        None => storage_label,
    };
    Ok(match &s.tether {
        None => (store, storage_label),
        Some(t) => {
            let label = redacted_redis_url(&t.url);
            let opts = RedisTetherOptions {
                prefix: t.prefix.clone(),
                mode: t.mode,
                sealer: sealer.clone(),
                ..RedisTetherOptions::default()
            };
            let tethered = TetheredStore::open(store, &t.url, opts)
                .await
                .with_context(|| format!("opening the tether at {label}"))?;
            let mode = format!("{:?}", tethered.mode()).to_lowercase();
            (
                Arc::new(tethered) as Arc<dyn sbp_store::Store>,
                format!("{storage_label}, tether {label} ({mode})"),
            )
        }
    })
}

/// File descriptors kept out of the connection budget: the database, the upstream and MCP
/// clients, Redis, log files.
const FD_RESERVE: u64 = 256;

/// Raises this process's open-files soft limit to its hard limit (every connection is a file
/// descriptor, and so is the upstream connection of each turn it runs); logs both. Returns the
/// soft limit now in force, if the platform has one.
fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let (before, hard) = match rlimit::Resource::NOFILE.get() {
            Ok(limits) => limits,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the open-files limit");
                return None;
            }
        };
        match rlimit::increase_nofile_limit(u64::MAX) {
            Ok(now) => {
                tracing::info!(before, now, hard, "open-files limit");
                Some(now)
            }
            Err(e) => {
                tracing::warn!(error = %e, before, hard, "cannot raise the open-files limit");
                Some(before)
            }
        }
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Lowers the connection cap to what `fds` file descriptors can serve: half of them after a
/// reserve, since a connection running a turn also holds the turn's upstream connection. Without
/// this, connections beyond the limit would make `accept` fail instead of being shed.
fn fit_connections(mut edge: EdgeConfig, fds: Option<u64>) -> EdgeConfig {
    let Some(fds) = fds else {
        return edge;
    };
    let budget = usize::try_from(fds.saturating_sub(FD_RESERVE) / 2)
        .unwrap_or(usize::MAX)
        .max(16);
    if edge.max_connections > budget {
        tracing::warn!(
            configured = edge.max_connections,
            open_files_limit = fds,
            max_connections = budget,
            "--max-connections lowered to fit the open-files limit"
        );
        edge.max_connections = budget;
    }
    edge
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The accept queue asked of the kernel (which caps it at `net.core.somaxconn`, 4096 on current
/// Linux). tokio's `bind` asks for 1,024: a burst of more connections than that overflows the
/// queue, and the kernel then holds the overflow in SYN-ACK retransmission for up to a minute,
/// out of reach of the edge's connection caps and timeouts.
const LISTEN_BACKLOG: u32 = 65_535;

fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    // As tokio's `bind` does: a restart can take the port back while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_fits_the_open_files_limit() {
        let edge = EdgeConfig::default();
        assert_eq!(
            fit_connections(edge.clone(), Some(1024)).max_connections,
            384
        );
        assert_eq!(
            fit_connections(edge.clone(), Some(1 << 20)).max_connections,
            10_000
        );
        assert_eq!(fit_connections(edge.clone(), None).max_connections, 10_000);
        assert_eq!(fit_connections(edge, Some(100)).max_connections, 16);
    }
}
