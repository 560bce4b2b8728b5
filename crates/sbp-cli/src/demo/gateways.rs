//! The demo's two gateways, run in this process the way `sbp serve` runs one: a SQLite file of its
//! own, the built-in `sbp/echo` model behind the router, `sbp_gateway::serve` on a listener bound
//! to 127.0.0.1:0. Both get the same signing secret, which is what lets B verify (and import) a
//! roaming token that A signed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sbp_gateway::{Gateway, GatewayConfig};
use sbp_llm::{EchoProvider, Provider, Router};
use sbp_store::sqlite::{SqliteOptions, SqliteStore};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a gateway may take to finish in-flight work once asked to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// One running gateway.
pub struct Instance {
    pub name: &'static str,
    pub addr: SocketAddr,
    pub database: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Instance {
    /// Opens `dir/sbp.db` and serves a gateway on an ephemeral loopback port.
    pub async fn start(name: &'static str, dir: &Path, secret: Vec<u8>) -> anyhow::Result<Self> {
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
            ..GatewayConfig::default()
        };
        let gateway = Gateway::start(config, Arc::new(store), provider)
            .await
            .map_err(|e| anyhow::anyhow!("starting gateway {name}: {e}"))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding 127.0.0.1:0")?;
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

/// A fresh signing secret for both gateways (48 random bytes, like `sbp serve` generates).
pub fn shared_secret() -> Vec<u8> {
    let mut bytes = vec![0u8; 48];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut bytes);
    bytes
}
