//! Which peers this node trusts, and with which keys. A peer's key is trusted through a pin in
//! the configuration (`--peer URL#KEY`, `--tracker URL#KEY`), a pinned tracker's signed vouch, or
//! (with `--federation-tofu` only) its first self-signed manifest; a later key change is followed
//! only through a valid `old_signature` by the key already trusted. Keys in tokens, URLs in
//! tokens or requests, and self-signed manifests alone never confer trust.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::Utc;
use sbp_protocol::federation::{
    ManifestError, ManifestTrust, PublicKey, Role, VerifiedManifest, verify_manifest,
};
use sbp_store::{PeerRecord, PeerSource, Store};

use super::client::{PeerClient, PeerError};
use crate::config::PeerSpec;

/// A peer may be asked for its manifest again (an unknown `kid`) at most this often.
const REFETCH_INTERVAL: Duration = Duration::from_secs(30);

/// A peer whose manifest verified under the trust rules.
#[derive(Debug, Clone)]
pub struct TrustedPeer {
    pub gateway_id: String,
    /// The base URL it was learned at.
    pub url: String,
    pub role: Role,
    /// The current key, then the old keys still verifying.
    pub keys: Vec<(String, PublicKey)>,
    pub source: PeerSource,
    /// `endpoints.bundle` (with `{bundle_cid}`), when it serves bundles.
    pub bundle_endpoint: Option<String>,
}

impl TrustedPeer {
    pub fn key(&self, kid: &str) -> Option<&PublicKey> {
        self.keys.iter().find(|(id, _)| id == kid).map(|(_, k)| k)
    }

    /// The current key's `public_key` string.
    pub fn public_key(&self) -> String {
        self.keys
            .first()
            .map(|(_, k)| k.to_b64_spki())
            .unwrap_or_default()
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrustError {
    /// Not a peer this node trusts (no pin, vouch or TOFU applies, or the key does not match).
    #[error("{0}")]
    Untrusted(String),
    /// A trusted peer, but no key of it has this id (after a refetch, when one was allowed).
    #[error("unknown key id {0}")]
    UnknownKid(String),
    #[error(transparent)]
    Peer(#[from] PeerError),
    #[error("storage: {0}")]
    Store(String),
}

pub struct PeerDirectory {
    client: PeerClient,
    store: Arc<dyn Store>,
    own_id: String,
    /// Static peers and trackers, with their pins.
    configured: Vec<PeerSpec>,
    /// The trackers among them: their signed vouches are a source of trust.
    trackers: Vec<String>,
    tofu: bool,
    known: RwLock<HashMap<String, TrustedPeer>>,
    /// When each gateway's (or URL's) manifest was last fetched on demand.
    refetched: Mutex<HashMap<String, Instant>>,
}

impl PeerDirectory {
    pub fn new(
        client: PeerClient,
        store: Arc<dyn Store>,
        own_id: String,
        peers: Vec<PeerSpec>,
        trackers: Vec<PeerSpec>,
        tofu: bool,
    ) -> Self {
        let tracker_urls = trackers.iter().map(|t| t.url.clone()).collect();
        let mut configured = peers;
        configured.extend(trackers);
        Self {
            client,
            store,
            own_id,
            configured,
            trackers: tracker_urls,
            tofu,
            known: RwLock::new(HashMap::new()),
            refetched: Mutex::new(HashMap::new()),
        }
    }

    pub fn client(&self) -> &PeerClient {
        &self.client
    }

    /// A peer already known by id.
    pub fn known(&self, gateway_id: &str) -> Option<TrustedPeer> {
        let known = self.known.read().unwrap_or_else(|e| e.into_inner());
        known.get(gateway_id).cloned()
    }

    fn remember(&self, peer: &TrustedPeer) {
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        known.insert(peer.gateway_id.clone(), peer.clone());
    }

    /// Whether `key` (a gateway id or URL) may be fetched on demand now; the first time is free.
    fn may_refetch(&self, key: &str) -> bool {
        let mut at = self.refetched.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match at.get(key) {
            Some(last) if now.duration_since(*last) < REFETCH_INTERVAL => false,
            _ => {
                at.insert(key.to_owned(), now);
                true
            }
        }
    }

    fn pin_for(&self, url: &str) -> Option<&str> {
        self.configured
            .iter()
            .find(|p| p.url == url)
            .and_then(|p| p.pin.as_deref())
    }

    /// Fetches the manifest at `url` and trusts it if a rule allows; remembers the peer (and
    /// stores a key it followed, so a rotation outlives the old key's expiry).
    pub async fn learn(&self, url: &str) -> Result<TrustedPeer, TrustError> {
        let url = url.trim_end_matches('/').to_owned();
        let manifest = self.client.manifest(&url).await?;
        let stored = self
            .stored_for_url(&url)
            .await?
            .filter(|p| self.stored_source_applies(p, &url));
        let now = Utc::now();
        let pin = self.pin_for(&url).map(str::to_owned);
        let mut anchors: Vec<(PublicKey, PeerSource)> = Vec::new();
        if let Some(pin) = &pin
            && let Ok(k) = PublicKey::from_b64_spki(pin)
        {
            anchors.push((k, PeerSource::Pin));
        }
        if let Some(s) = &stored
            && let Ok(k) = PublicKey::from_b64_spki(&s.public_key)
        {
            anchors.push((k, s.source));
        }
        let mut last_err: Option<ManifestError> = None;
        let mut verified: Option<(VerifiedManifest, PeerSource)> = None;
        for (anchor, source) in &anchors {
            match verify_manifest(&manifest, ManifestTrust::Pinned(anchor), now) {
                Ok(v) => {
                    verified = Some((v, *source));
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        if verified.is_none() && anchors.is_empty() && self.tofu {
            match verify_manifest(&manifest, ManifestTrust::SelfSigned, now) {
                Ok(v) => verified = Some((v, PeerSource::Tofu)),
                Err(e) => last_err = Some(e),
            }
        }
        let Some((v, source)) = verified else {
            return Err(TrustError::Untrusted(match last_err {
                Some(e) => format!("the manifest at {url} does not verify: {e}"),
                None => {
                    format!("{url} is not a trusted peer (no pinned key; --federation-tofu is off)")
                }
            }));
        };
        if v.manifest.gateway_id == self.own_id {
            return Err(TrustError::Untrusted(format!("{url} is this node")));
        }
        if let Some(s) = &stored
            && s.gateway_id != v.manifest.gateway_id
        {
            return Err(TrustError::Untrusted(format!(
                "{url} now claims gateway id {} (was {})",
                v.manifest.gateway_id, s.gateway_id
            )));
        }
        let peer = TrustedPeer {
            gateway_id: v.manifest.gateway_id.clone(),
            url: url.clone(),
            role: v.manifest.role,
            keys: v.valid_keys.clone(),
            source,
            bundle_endpoint: v.manifest.endpoints.bundle.clone(),
        };
        self.persist(&peer, &v).await?;
        self.remember(&peer);
        Ok(peer)
    }

    /// Trusts `gateway_id` at `url` with `public_key` because a pinned tracker vouched for it.
    pub async fn learn_vouched(
        &self,
        gateway_id: &str,
        url: &str,
        public_key: &PublicKey,
    ) -> Result<TrustedPeer, TrustError> {
        let url = url.trim_end_matches('/').to_owned();
        let manifest = self.client.manifest(&url).await?;
        let v = verify_manifest(&manifest, ManifestTrust::Pinned(public_key), Utc::now()).map_err(
            |e| TrustError::Untrusted(format!("the manifest at {url} does not verify: {e}")),
        )?;
        if v.manifest.gateway_id != gateway_id {
            return Err(TrustError::Untrusted(format!(
                "{url} is gateway {}, not {gateway_id}",
                v.manifest.gateway_id
            )));
        }
        let peer = TrustedPeer {
            gateway_id: gateway_id.to_owned(),
            url,
            role: v.manifest.role,
            keys: v.valid_keys.clone(),
            source: PeerSource::Tracker,
            bundle_endpoint: v.manifest.endpoints.bundle.clone(),
        };
        self.persist(&peer, &v).await?;
        self.remember(&peer);
        Ok(peer)
    }

    async fn persist(&self, peer: &TrustedPeer, v: &VerifiedManifest) -> Result<(), TrustError> {
        let now = Utc::now();
        let old_keys = serde_json::Value::Array(
            v.manifest
                .old_keys
                .iter()
                .map(|k| {
                    serde_json::json!({"key_id": k.key_id, "public_key": k.public_key,
                                       "expires_at": k.expires_at.to_rfc3339()})
                })
                .collect(),
        );
        self.store
            .upsert_peer(PeerRecord {
                gateway_id: peer.gateway_id.clone(),
                url: peer.url.clone(),
                public_key: v.manifest.public_key.clone(),
                key_id: v.manifest.key_id.clone(),
                old_keys,
                source: peer.source,
                verified_at: now,
                updated_at: now,
            })
            .await
            .map_err(|e| TrustError::Store(e.to_string()))
    }

    async fn stored_for_url(&self, url: &str) -> Result<Option<PeerRecord>, TrustError> {
        let peers = self
            .store
            .peers()
            .await
            .map_err(|e| TrustError::Store(e.to_string()))?;
        Ok(peers.into_iter().find(|p| p.url == url))
    }

    /// A stored key counts only while the rule that admitted it still holds.
    fn stored_source_applies(&self, p: &PeerRecord, url: &str) -> bool {
        match p.source {
            PeerSource::Pin => self.pin_for(url).is_some(),
            PeerSource::Tofu => self.tofu,
            PeerSource::Tracker => self.configured_trackers_exist(),
        }
    }

    fn configured_trackers_exist(&self) -> bool {
        !self.trackers.is_empty()
    }

    pub fn tracker_urls(&self) -> &[String] {
        &self.trackers
    }

    /// The configured trackers this node could verify (by their pins).
    pub async fn trackers(&self) -> Vec<TrustedPeer> {
        let mut out = Vec::new();
        for url in &self.trackers {
            match self.at_url(url).await {
                Ok(p) => out.push(p),
                Err(e) => tracing::warn!(tracker = %url, error = %e, "tracker not usable"),
            }
        }
        out
    }

    /// Gateway `gateway_id` as a pinned tracker vouches for it (its signed record of the key it
    /// verified at the gateway's URL), then verified at that URL with that key.
    pub async fn via_trackers(&self, gateway_id: &str) -> Option<TrustedPeer> {
        use sbp_protocol::federation::{GatewayVouch, verify_object};
        if gateway_id == self.own_id {
            return None;
        }
        for tracker in self.trackers().await {
            let url = format!("{}/v1/sbp/registry/gateways/{gateway_id}", tracker.url);
            let Ok(a) = self.client.get(&url, None, 64 << 10).await else {
                continue;
            };
            if a.status != 200 {
                continue;
            }
            let Ok(obj) = a.object(&url) else { continue };
            if !tracker
                .keys
                .iter()
                .any(|(_, k)| verify_object(&obj, k).is_ok())
            {
                tracing::warn!(tracker = %tracker.url, "a vouch not signed by its tracker was ignored");
                continue;
            }
            let Ok(vouch) = GatewayVouch::read(&obj) else {
                continue;
            };
            if vouch.tracker_id != tracker.gateway_id
                || vouch.gateway_id != gateway_id
                || vouch.check(Utc::now()).is_err()
            {
                continue;
            }
            let Ok(key) = vouch.key() else { continue };
            match self
                .learn_vouched(gateway_id, &vouch.gateway_url, &key)
                .await
            {
                Ok(p) => return Some(p),
                Err(e) => tracing::warn!(gateway_id, error = %e, "vouched gateway not verified"),
            }
        }
        None
    }

    /// The peer at `url`: known already, or learned now.
    pub async fn at_url(&self, url: &str) -> Result<TrustedPeer, TrustError> {
        let url = url.trim_end_matches('/');
        let known = {
            let known = self.known.read().unwrap_or_else(|e| e.into_inner());
            known.values().find(|p| p.url == url).cloned()
        };
        match known {
            Some(p) => Ok(p),
            None => self.learn(url).await,
        }
    }

    /// The configured peers and trackers, learned now when not yet known (failures skipped and
    /// logged).
    pub async fn configured(&self) -> Vec<TrustedPeer> {
        let mut out = Vec::new();
        for spec in &self.configured {
            let known = {
                let known = self.known.read().unwrap_or_else(|e| e.into_inner());
                known.values().find(|p| p.url == spec.url).cloned()
            };
            match known {
                Some(p) => out.push(p),
                None => match self.learn(&spec.url).await {
                    Ok(p) => out.push(p),
                    Err(e) => tracing::warn!(peer = %spec.url, error = %e, "peer not usable"),
                },
            }
        }
        out
    }

    /// The key `kid` of trusted gateway `iss`, for checking its token. An unknown gateway is
    /// looked for among the configured peers not yet learned; an unknown kid of a known peer
    /// refetches its manifest (at most once per 30 s per peer; the first time is free).
    pub async fn key_for(&self, iss: &str, kid: &str) -> Result<PublicKey, TrustError> {
        if let Some(peer) = self.known(iss) {
            if let Some(k) = peer.key(kid) {
                return Ok(k.clone());
            }
            if self.may_refetch(iss) {
                let peer = self.learn(&peer.url).await?;
                if let Some(k) = peer.key(kid) {
                    return Ok(k.clone());
                }
            }
            return Err(TrustError::UnknownKid(kid.to_owned()));
        }
        // Not known yet: the configured peers this process has not learned (each URL fetched
        // on demand at most once per 30 s, so unknown issuers cannot make us hammer peers).
        let unlearned: Vec<String> = {
            let known = self.known.read().unwrap_or_else(|e| e.into_inner());
            self.configured
                .iter()
                .filter(|s| !known.values().any(|p| p.url == s.url))
                .map(|s| s.url.clone())
                .collect()
        };
        for url in unlearned {
            if !self.may_refetch(&url) {
                continue;
            }
            if let Err(e) = self.learn(&url).await {
                tracing::debug!(peer = %url, error = %e, "peer not learned");
            }
        }
        // Peers admitted earlier (TOFU, vouched) and stored, whose rule still holds.
        if self.known(iss).is_none() {
            let stored = self
                .store
                .peer(iss)
                .await
                .map_err(|e| TrustError::Store(e.to_string()))?;
            if let Some(p) = stored
                && p.source != PeerSource::Pin
                && self.stored_source_applies(&p, &p.url)
                && self.may_refetch(&p.url)
            {
                let _ = self.learn(&p.url).await;
            }
        }
        // Finally a pinned tracker may vouch for it (asked at most once per 30 s per issuer).
        if self.known(iss).is_none()
            && !self.trackers.is_empty()
            && self.may_refetch(&format!("vouch:{iss}"))
        {
            self.via_trackers(iss).await;
        }
        match self.known(iss) {
            Some(peer) => peer
                .key(kid)
                .cloned()
                .ok_or_else(|| TrustError::UnknownKid(kid.to_owned())),
            None => Err(TrustError::Untrusted(format!(
                "gateway {iss} is not a trusted peer of this node"
            ))),
        }
    }
}
