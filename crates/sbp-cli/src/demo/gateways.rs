//! The demo's two gateways, run in this process the way `sbp serve` runs one: a SQLite file of its
//! own, the built-in `sbp/echo` model behind the router, `sbp_gateway::serve` on a listener bound
//! to 127.0.0.1:0. They are federated (SBP L6): each has an Ed25519 identity key made in memory
//! and pins the other's, as `sbp serve --peer URL#KEY` does, so B trusts what A signs (a roaming
//! token A issued, a session A hands over) and a surface attaching to B with a session A holds
//! brings it over. Each has a signing secret of its own: B redeems A's roaming tokens at A.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sbp_gateway::config::{FederationConfig, PeerSpec};
use sbp_gateway::{Gateway, GatewayConfig};
use sbp_llm::{EchoProvider, Provider, Router};
use sbp_protocol::federation::{IdentityKey, Role};
use sbp_store::sqlite::{SqliteOptions, SqliteStore};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a gateway may take to finish in-flight work once asked to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A gateway about to start: its listener (bound first, so each peer's URL is known before
/// either starts) and its identity key.
pub struct Planned {
    pub name: &'static str,
    listener: TcpListener,
    key: Arc<IdentityKey>,
}

impl Planned {
    /// Binds an ephemeral loopback port and makes a fresh identity key in memory.
    pub async fn new(name: &'static str) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding 127.0.0.1:0")?;
        let mut seed: [u8; 32] = rand::random();
        let key = IdentityKey::from_seed(seed);
        // Only the key keeps it.
        seed.fill(0);
        Ok(Self {
            name,
            listener,
            key: Arc::new(key),
        })
    }

    pub fn url(&self) -> anyhow::Result<String> {
        Ok(format!("http://{}", self.listener.local_addr()?))
    }

    /// What a peer pins: this gateway's URL and public key.
    pub fn pin(&self) -> anyhow::Result<PeerSpec> {
        Ok(PeerSpec {
            url: self.url()?,
            pin: Some(self.key.public_key().to_b64_spki()),
        })
    }

    /// The federation of a gateway that pins `peers`, as `sbp serve --role gateway --peer URL#KEY`
    /// builds it (`crate::federation::load`), with the key made here.
    pub fn federation(&self, peers: Vec<PeerSpec>) -> FederationConfig {
        FederationConfig {
            role: Role::Gateway,
            gateway_name: format!("sbp demo gateway {}", self.name),
            key: self.key.clone(),
            first_public_key: self.key.public_key(),
            old_keys: Vec::new(),
            peers,
            trackers: Vec::new(),
            peer_srv: Vec::new(),
            dns_server: None,
            tofu: false,
            // Loopback peers are called over plain http without it.
            allow_http: false,
            announce_exports: false,
            announce_ttl: Duration::from_secs(86_400),
            tracker_max_records: 10_000,
            tracker_announce_rate: None,
            handover_lease: Duration::from_secs(30),
        }
    }

    /// The key id peers know this gateway's key by.
    pub fn key_id(&self) -> String {
        self.key.key_id()
    }
}

/// One running gateway.
pub struct Instance {
    pub name: &'static str,
    pub addr: SocketAddr,
    pub database: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Instance {
    /// Opens `dir/sbp.db` and serves `planned`'s gateway with `federation` on its listener.
    pub async fn start(
        planned: Planned,
        federation: FederationConfig,
        dir: &Path,
        secret: Vec<u8>,
    ) -> anyhow::Result<Self> {
        let Planned { name, listener, .. } = planned;
        let database = dir.join("sbp.db");
        let store = SqliteStore::open(SqliteOptions::new(&database))
            .await
            .with_context(|| format!("opening {}", database.display()))?;
        // The router `sbp serve` builds, with the offline model as its only (default) route.
        let provider: Arc<dyn Provider> = Arc::new(Router::new(Arc::new(EchoProvider)));
        let config = GatewayConfig {
            secret,
            // A call the demo makes is answered at once; a stuck one should fail the step
            // quickly rather than after the default half minute.
            tool_timeout: Duration::from_secs(10),
            federation: Some(federation),
            ..GatewayConfig::default()
        };
        let gateway = Gateway::start(config, Arc::new(store), provider)
            .await
            .map_err(|e| anyhow::anyhow!("starting gateway {name}: {e}"))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(sbp_gateway::serve(listener, gateway, async move {
            // A dropped sender stops the gateway too.
            let _ = stopped.await;
        }));
        Ok(Self {
            name,
            addr,
            database,
            stop: Some(stop),
            task: Some(task),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving, waits for in-flight turns to persist and the store to close.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            // The serve task may have ended by itself; then there is nobody to tell.
            let _ = stop.send(());
        }
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        match tokio::time::timeout(STOP_TIMEOUT, task).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(anyhow::anyhow!("gateway {} failed: {e}", self.name)),
            Ok(Err(e)) => Err(anyhow::anyhow!("gateway {} task failed: {e}", self.name)),
            Err(_) => Err(anyhow::anyhow!(
                "gateway {} did not stop within {STOP_TIMEOUT:?}",
                self.name
            )),
        }
    }
}

/// A fresh signing secret for one gateway (48 random bytes, like `sbp serve` generates).
pub fn fresh_secret() -> Vec<u8> {
    let mut bytes = vec![0u8; 48];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut bytes);
    bytes
}
