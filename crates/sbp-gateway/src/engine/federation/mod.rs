//! The federation service (L6): this node's signed manifest, peers' requests authenticated by
//! federation token, bundles served by CID (re-verified before they leave), and bundles fetched
//! by CID from whichever trusted provider has them (the CID recomputed and compared with the one
//! asked for). Off (every method refuses) unless the gateway runs with federation.

mod bundles;
pub mod migration;
mod redeem;
mod registry;
pub mod tracker;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sbp_protocol::federation::Role;
use sbp_store::Store;
use serde_json::{Map, Value};

use super::roaming::Roaming;
use super::tasks::Tasks;
use crate::config::GatewayConfig;
use crate::error::Error;
use crate::federation::auth::{Caller, FedAuth};
use crate::federation::client::PeerClient;
use crate::federation::identity::Identity;
use crate::federation::srv::SrvResolver;
use crate::federation::trust::PeerDirectory;
use crate::federation::trust::TrustedPeer;
use crate::metrics::Metrics;
use tracker::Tracker;

pub use bundles::is_cid;
pub use redeem::{REDEEM_PATH, roaming_sid};

/// The handle; cheap to clone. `None` inside when federation is off.
#[derive(Clone)]
pub struct Federation {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    identity: Arc<Identity>,
    /// The registry, when this node's role includes tracker.
    tracker: Option<Tracker>,
    /// DNS SRV discovery (`--peer-srv`), when configured.
    srv: Option<(SrvResolver, Vec<String>)>,
    directory: Arc<PeerDirectory>,
    auth: FedAuth,
    store: Arc<dyn Store>,
    config: Arc<GatewayConfig>,
    metrics: Arc<Metrics>,
    roaming: Roaming,
}

impl Federation {
    /// Establishes the node's identity (its gateway id recorded in the store at the first start)
    /// when federation is configured.
    pub async fn start(
        config: Arc<GatewayConfig>,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        roaming: Roaming,
        tasks: &Tasks,
    ) -> Result<Self, Error> {
        let Some(fed) = &config.federation else {
            return Ok(Self { inner: None });
        };
        let public_base = config.public_urls.first().map(|u| u.to_string());
        let identity = Arc::new(
            Identity::establish(fed, &config.sbp_version, public_base, store.as_ref()).await?,
        );
        let client = PeerClient::new(fed.allow_http)
            .map_err(|e| Error::internal("starting federation", e))?;
        let directory = Arc::new(PeerDirectory::new(
            client.clone(),
            store.clone(),
            identity.gateway_id().to_owned(),
            fed.peers.clone(),
            fed.trackers.clone(),
            fed.tofu,
        ));
        let auth = FedAuth::new(
            directory.clone(),
            store.clone(),
            identity.gateway_id().to_owned(),
            metrics.clone(),
        );
        roaming.set_issuer(identity.gateway_id());
        let tracker = fed.role.hosts_registry().then(|| {
            Tracker::new(
                identity.clone(),
                store.clone(),
                client.clone(),
                metrics.clone(),
                fed.tracker_max_records,
                fed.tracker_announce_rate,
            )
        });
        let srv = if fed.peer_srv.is_empty() {
            None
        } else {
            let resolver = SrvResolver::new(fed.dns_server)
                .map_err(|e| Error::internal("starting the DNS resolver", e))?;
            Some((resolver, fed.peer_srv.clone()))
        };
        tracing::info!(
            gateway_id = identity.gateway_id(),
            key_id = %identity.key().key_id(),
            role = identity.role().as_str(),
            "federation on"
        );
        let register = !fed.trackers.is_empty() && fed.role.hosts_sessions();
        let hosts_sessions = fed.role.hosts_sessions();
        let handover_lease = fed.handover_lease;
        let this = Self {
            inner: Some(Arc::new(Inner {
                identity,
                tracker,
                srv,
                directory,
                auth,
                store,
                config,
                metrics,
                roaming,
            })),
        };
        if register {
            this.start_registering(tasks);
            this.start_reannouncing(tasks);
        }
        if hosts_sessions {
            // Sessions a crash left half-adopted (adopted, commit unanswered) are settled with
            // their holder: kept when the commit went through, dropped when it did not.
            // Then again every few seconds: a copy whose commit answer was lost is settled even
            // if no surface comes back for it.
            let settle = this.clone();
            let every = (handover_lease / 2).clamp(Duration::from_secs(2), Duration::from_secs(30));
            let stop = tasks.stopping();
            tasks.spawn(async move {
                loop {
                    settle.resolve_all_incoming().await;
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(every) => {}
                    }
                }
            });
        }
        Ok(this)
    }

    /// A tracked task that announces again, before they expire, the bundles announced earlier
    /// that this gateway still serves.
    fn start_reannouncing(&self, tasks: &Tasks) {
        let Some(ttl) = self
            .inner
            .as_ref()
            .and_then(|i| i.config.federation.as_ref())
            .map(|f| f.announce_ttl)
        else {
            return;
        };
        let every = (ttl / 3).clamp(Duration::from_secs(1), Duration::from_secs(600));
        let this = self.clone();
        let stop = tasks.stopping();
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
                this.reannounce(ttl / 2).await;
            }
        });
    }

    /// Announces again the bundles whose records expire within `within` and that are still
    /// stored here (a bundle lives as long as an export refers to it).
    async fn reannounce(&self, within: Duration) {
        let Some(inner) = &self.inner else {
            return;
        };
        let before = Utc::now() + chrono::Duration::from_std(within).unwrap_or_default();
        let due = match inner.store.announcements_expiring_before(before).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "listing announcements to renew");
                return;
            }
        };
        for a in due {
            match inner.store.get_bundle(&a.bundle_cid).await {
                Ok(Some(_)) => {
                    self.announce(&a.bundle_cid).await;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "checking a bundle to renew its record"),
            }
        }
    }

    /// A tracked task that makes this gateway known to its trackers once it listens, retried
    /// every 30 s until every tracker took it, then renewed every 6 hours.
    fn start_registering(&self, tasks: &Tasks) {
        let this = self.clone();
        let stop = tasks.stopping();
        tasks.spawn(async move {
            let mut wait = std::time::Duration::from_millis(50);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(wait) => {}
                }
                let listening = this
                    .inner
                    .as_ref()
                    .is_some_and(|i| i.identity.base_url().is_some());
                wait = if !listening {
                    std::time::Duration::from_millis(50)
                } else if this.register_with_trackers().await {
                    std::time::Duration::from_secs(6 * 3600)
                } else {
                    std::time::Duration::from_secs(30)
                };
            }
        });
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The node's role, when federation is on.
    pub fn role(&self) -> Option<Role> {
        self.inner.as_ref().map(|i| i.identity.role())
    }

    pub fn gateway_id(&self) -> Option<&str> {
        self.inner.as_ref().map(|i| i.identity.gateway_id())
    }

    fn on(&self) -> Result<&Arc<Inner>, Error> {
        self.inner
            .as_ref()
            .ok_or_else(|| Error::NotFound("federation is not enabled on this gateway".into()))
    }

    /// Records the bound listener's base URL (`scheme://addr`) for the manifest's endpoints,
    /// unless a public URL was configured.
    pub fn bound(&self, base: String) {
        if let Some(inner) = &self.inner {
            inner.identity.bound(base);
        }
    }

    /// The signed manifest of `/.well-known/sbp`.
    pub fn manifest(&self) -> Result<Map<String, Value>, Error> {
        Ok(self.on()?.identity.manifest(Utc::now()))
    }

    /// The registry, when this node is a tracker.
    pub fn tracker(&self) -> Result<&Tracker, Error> {
        self.on()?
            .tracker
            .as_ref()
            .ok_or_else(|| Error::NotFound("this node is not a tracker".into()))
    }

    /// Whether exports are announced to the trackers without being asked.
    pub fn announces_every_export(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| {
            i.config
                .federation
                .as_ref()
                .is_some_and(|f| f.announce_exports)
        })
    }

    /// The peers DNS SRV names (`--peer-srv`), in RFC 2782 order, that verify under the trust
    /// rules (an SRV target is a candidate, not trusted by being listed).
    pub(crate) async fn srv_peers(&self) -> Vec<TrustedPeer> {
        let Some(inner) = &self.inner else {
            return Vec::new();
        };
        let Some((resolver, domains)) = &inner.srv else {
            return Vec::new();
        };
        let allow_http = inner
            .config
            .federation
            .as_ref()
            .is_some_and(|f| f.allow_http);
        let mut out: Vec<TrustedPeer> = Vec::new();
        for domain in domains {
            let targets = match resolver.lookup(domain).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(domain, error = %e, "SRV lookup failed");
                    continue;
                }
            };
            for target in targets {
                let url = target.base_url(allow_http);
                match inner.directory.at_url(&url).await {
                    Ok(p) if !out.iter().any(|o| o.gateway_id == p.gateway_id) => out.push(p),
                    Ok(_) => {}
                    Err(e) => tracing::info!(peer = %url, error = %e, "SRV target skipped"),
                }
            }
        }
        out
    }

    /// Checks a peer's federation token for `method path` about `sub`.
    pub async fn authenticate(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        sub: &str,
    ) -> Result<Caller, Error> {
        self.on()?.auth.check(token, method, path, sub).await
    }
}
