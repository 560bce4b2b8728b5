//! Which peers this node trusts, and with which keys. A peer's key is trusted through a pin in
//! the configuration (`--peer URL#KEY`, `--tracker URL#KEY`), a pinned tracker's signed vouch, or
//! (with `--federation-tofu` only) its first self-signed manifest; a later key change is followed
//! only through a valid `old_signature` by the key already trusted. Keys in tokens, URLs in
//! tokens or requests, and self-signed manifests alone never confer trust.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sbp_protocol::federation::{ManifestTrust, PublicKey, Role, VerifiedManifest, verify_manifest};
use sbp_store::{PeerRecord, PeerSource, Store};

use super::client::{PeerClient, PeerError};
use crate::config::PeerSpec;

/// What [`PeerDirectory::learn`] returns.
pub type Learning<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<TrustedPeer, TrustError>> + Send + 'a>,
>;

/// A peer may be asked for its manifest again (an unknown `kid`) at most this often.
const REFETCH_INTERVAL: Duration = Duration::from_secs(30);
/// How many on-demand fetches are remembered at once (beyond, none is made until some age out).
const MAX_REFETCH_ENTRIES: usize = 10_000;

/// The pin or tracker that admitted a stored key.
fn admitted_by(p: &PeerRecord) -> Option<String> {
    p.old_keys
        .get("admitted_by")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

/// A peer whose manifest verified under the trust rules.
#[derive(Debug, Clone)]
pub struct TrustedPeer {
    pub gateway_id: String,
    /// The origin it was learned at (every endpoint of its manifest lives under it).
    pub url: String,
    pub role: Role,
    /// The current key, then the old keys, each with the time it stops verifying.
    pub keys: Vec<(String, PublicKey, DateTime<Utc>)>,
    pub source: PeerSource,
    /// `endpoints.bundle` (with `{bundle_cid}`), when it serves bundles.
    pub bundle_endpoint: Option<String>,
    /// When what was learned must be checked again (the manifest's or vouch's expiry).
    pub valid_until: DateTime<Utc>,
}

impl TrustedPeer {
    /// The key `kid`, if it still verifies now.
    pub fn key(&self, kid: &str) -> Option<&PublicKey> {
        let now = Utc::now();
        if self.valid_until <= now {
            return None;
        }
        self.keys
            .iter()
            .find(|(id, _, until)| id == kid && *until > now)
            .map(|(_, k, _)| k)
    }

    /// The keys that verify now.
    pub fn live_keys(&self) -> impl Iterator<Item = &PublicKey> {
        let now = Utc::now();
        let fresh = self.valid_until > now;
        self.keys
            .iter()
            .filter(move |(_, _, until)| fresh && *until > now)
            .map(|(_, k, _)| k)
    }

    fn expired(&self) -> bool {
        self.valid_until <= Utc::now()
    }
}

/// The one origin every endpoint of a manifest lives at (ws/wss counted as http/https). A peer is
/// trusted only at the origin its manifest was read from and names: a manifest copied to another
/// server, or one naming someone else's address, is refused.
pub fn endpoints_origin(m: &sbp_protocol::federation::Manifest) -> Option<String> {
    let e = &m.endpoints;
    let mut origins = [&e.ws, &e.export, &e.import, &e.bundle, &e.registry]
        .into_iter()
        .flatten()
        .map(|endpoint| {
            let as_http = endpoint
                .strip_prefix("wss://")
                .map(|r| format!("https://{r}"))
                .or_else(|| {
                    endpoint
                        .strip_prefix("ws://")
                        .map(|r| format!("http://{r}"))
                })
                .unwrap_or_else(|| endpoint.clone());
            reqwest::Url::parse(&as_http.replace(['{', '}'], ""))
                .ok()
                .map(|u| super::client::origin(&u))
        });
    let first = origins.next()??;
    origins
        .all(|o| o.as_deref() == Some(first.as_str()))
        .then_some(first)
}

/// The origin (`scheme://host[:port]`) of a configured or learned base URL.
pub fn origin_of(url: &str) -> Option<String> {
    reqwest::Url::parse(url)
        .ok()
        .map(|u| super::client::origin(&u))
}

/// Whether `gateway_id` is derived from `key` or from an old key the manifest proves it still
/// holds (a valid `old_signature`): no one can claim another gateway's id with their own key.
pub fn id_is_derived(
    obj: &serde_json::Map<String, serde_json::Value>,
    v: &VerifiedManifest,
) -> bool {
    let id = &v.manifest.gateway_id;
    if v.key.derive_gateway_id() == *id {
        return true;
    }
    v.manifest.old_keys.iter().any(|k| {
        PublicKey::from_b64_spki(&k.public_key).is_ok_and(|pk| {
            pk.derive_gateway_id() == *id
                && sbp_protocol::federation::verify_old_signature(obj, &pk).is_ok()
        })
    })
}

fn keys_of(v: &VerifiedManifest) -> Vec<(String, PublicKey, DateTime<Utc>)> {
    let current = (
        v.manifest.key_id.clone(),
        v.key.clone(),
        v.manifest.valid_until,
    );
    std::iter::once(current)
        .chain(v.manifest.old_keys.iter().filter_map(|k| {
            PublicKey::from_b64_spki(&k.public_key)
                .ok()
                .map(|pk| (k.key_id.clone(), pk, k.expires_at))
        }))
        .filter(|(id, _, _)| v.valid_keys.iter().any(|(vid, _)| vid == id))
        .collect()
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
    /// The gateway each URL's manifest named (a peer may be reached under several names).
    aliases: RwLock<HashMap<String, String>>,
    /// When each gateway's (or URL's) manifest was last fetched on demand.
    refetched: Mutex<HashMap<String, Instant>>,
    /// Serialises learning the configured peers on demand: a second caller waits for the first
    /// and finds the peer known, instead of being refused because a fetch is under way.
    learning: tokio::sync::Mutex<()>,
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
        let tracker_urls = trackers
            .iter()
            .map(|t| origin_of(&t.url).unwrap_or_else(|| t.url.clone()))
            .collect();
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
            aliases: RwLock::new(HashMap::new()),
            refetched: Mutex::new(HashMap::new()),
            learning: tokio::sync::Mutex::new(()),
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

    fn alias(&self, origin: &str, gateway_id: &str) {
        let mut aliases = self.aliases.write().unwrap_or_else(|e| e.into_inner());
        if aliases.len() >= MAX_REFETCH_ENTRIES {
            aliases.clear();
        }
        aliases.insert(origin.to_owned(), gateway_id.to_owned());
    }

    /// The known, fresh peer reached at `origin` (its own origin, or a name it was learned under).
    fn at_origin(&self, origin: &str) -> Option<TrustedPeer> {
        let via = {
            let aliases = self.aliases.read().unwrap_or_else(|e| e.into_inner());
            aliases.get(origin).cloned()
        };
        let known = self.known.read().unwrap_or_else(|e| e.into_inner());
        known
            .values()
            .find(|p| p.url == origin || via.as_deref() == Some(p.gateway_id.as_str()))
            .filter(|p| !p.expired())
            .cloned()
    }

    fn remember(&self, peer: &TrustedPeer) {
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        known.insert(peer.gateway_id.clone(), peer.clone());
    }

    /// Whether `key` (a gateway id or URL) may be fetched on demand now; the first time is free.
    fn may_refetch(&self, key: &str) -> bool {
        let mut at = self.refetched.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // Bounded: entries past the interval carry no information.
        if at.len() >= MAX_REFETCH_ENTRIES {
            at.retain(|_, last| now.duration_since(*last) < REFETCH_INTERVAL);
        }
        if at.len() >= MAX_REFETCH_ENTRIES {
            return false;
        }
        match at.get(key) {
            Some(last) if now.duration_since(*last) < REFETCH_INTERVAL => false,
            _ => {
                at.insert(key.to_owned(), now);
                true
            }
        }
    }

    /// The pin configured for the peer at `origin`.
    fn pin_for(&self, origin: &str) -> Option<&str> {
        self.configured
            .iter()
            .find(|p| origin_of(&p.url).as_deref() == Some(origin))
            .and_then(|p| p.pin.as_deref())
    }

    /// Fetches the manifest at `url` and trusts it if a rule allows; remembers the peer (and
    /// stores a key it followed, so a rotation outlives the old key's expiry).
    ///
    /// - A pinned URL: its pin, or a key followed from that pin by rotation; nothing else.
    /// - Otherwise a gateway id this node knows must keep its stored key (or rotate it).
    /// - A new one only with `--federation-tofu`, and only with an id derived from its key.
    ///
    /// In every case the manifest's endpoints must live under the URL it was fetched from.
    pub fn learn<'a>(&'a self, url: &'a str) -> Learning<'a> {
        // Boxed: learning a peer may ask a tracker, and learning a tracker is a `learn` too.
        Box::pin(self.learn_now(url))
    }

    async fn learn_now(&self, url: &str) -> Result<TrustedPeer, TrustError> {
        let url = url.trim_end_matches('/').to_owned();
        let origin =
            origin_of(&url).ok_or_else(|| TrustError::Untrusted(format!("{url} is not a URL")))?;
        let manifest = self.client.manifest(&origin).await?;
        let claimed = manifest
            .get("gateway_id")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let now = Utc::now();
        let untrusted = |why: String| TrustError::Untrusted(why);
        let stored = self.stored(&claimed).await?;
        let pin = self.pin_for(&origin).map(str::to_owned);
        let (verified, source, admitted_by) = if let Some(pin) = pin {
            let mut anchors = vec![pin.clone()];
            if let Some(s) = &stored
                && s.source == PeerSource::Pin
                && admitted_by(s).as_deref() == Some(pin.as_str())
            {
                anchors.push(s.public_key.clone());
            }
            let mut last = None;
            let mut ok = None;
            for anchor in anchors {
                let Ok(k) = PublicKey::from_b64_spki(&anchor) else {
                    continue;
                };
                match verify_manifest(&manifest, ManifestTrust::Pinned(&k), now) {
                    Ok(v) => {
                        ok = Some(v);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            let v = ok.ok_or_else(|| {
                untrusted(format!(
                    "the manifest at {origin} does not verify by its pinned key: {}",
                    last.map(|e| e.to_string()).unwrap_or_default()
                ))
            })?;
            (v, PeerSource::Pin, Some(pin))
        } else if let Some(s) = stored.filter(|s| self.stored_source_applies(s)) {
            let k = PublicKey::from_b64_spki(&s.public_key)
                .map_err(|e| untrusted(format!("stored key of {claimed}: {e}")))?;
            let v = verify_manifest(&manifest, ManifestTrust::Pinned(&k), now).map_err(|e| {
                untrusted(format!(
                    "the manifest at {origin} does not verify by the key known for {claimed}: {e}"
                ))
            })?;
            let by = admitted_by(&s);
            (v, s.source, by)
        } else if self.tofu {
            let v = verify_manifest(&manifest, ManifestTrust::SelfSigned, now)
                .map_err(|e| untrusted(format!("the manifest at {origin} does not verify: {e}")))?;
            if !id_is_derived(&manifest, &v) {
                return Err(untrusted(format!(
                    "{origin} claims gateway id {claimed}, which its keys do not derive"
                )));
            }
            (v, PeerSource::Tofu, None)
        } else if !self.trackers.is_empty() && super::identity::is_gateway_id(&claimed) {
            // A pinned tracker may vouch for it (its key, at its own origin).
            return self.via_trackers(&claimed).await.ok_or_else(|| {
                untrusted(format!(
                    "{origin} is not a trusted peer (no pinned key, no tracker vouches for it, \
                     --federation-tofu is off)"
                ))
            });
        } else {
            return Err(untrusted(format!(
                "{origin} is not a trusted peer (no pinned key; --federation-tofu is off)"
            )));
        };
        if verified.manifest.gateway_id == self.own_id {
            return Err(untrusted(format!("{origin} is this node")));
        }
        let home = endpoints_origin(&verified.manifest)
            .filter(|home| *home == origin)
            .ok_or_else(|| {
                untrusted(format!(
                    "the manifest at {origin} names endpoints elsewhere: a peer is reached where it says it is"
                ))
            })?;
        self.alias(&origin, &verified.manifest.gateway_id);
        let peer = TrustedPeer {
            gateway_id: verified.manifest.gateway_id.clone(),
            url: home,
            role: verified.manifest.role,
            keys: keys_of(&verified),
            source,
            bundle_endpoint: verified.manifest.endpoints.bundle.clone(),
            valid_until: verified.manifest.valid_until,
        };
        self.persist(&peer, &verified, admitted_by.as_deref())
            .await?;
        self.remember(&peer);
        Ok(peer)
    }

    /// Trusts `gateway_id` at `url` with `public_key` because pinned tracker `tracker_id`
    /// vouched for it (until `until`).
    pub async fn learn_vouched(
        &self,
        gateway_id: &str,
        url: &str,
        public_key: &PublicKey,
        tracker_id: &str,
        until: DateTime<Utc>,
    ) -> Result<TrustedPeer, TrustError> {
        let origin =
            origin_of(url).ok_or_else(|| TrustError::Untrusted(format!("{url} is not a URL")))?;
        // A pinned URL is trusted by its pin only (learned through `learn`, never a vouch).
        if self.pin_for(&origin).is_some() {
            return Err(TrustError::Untrusted(format!(
                "{origin} is pinned: a vouch does not replace its pin"
            )));
        }
        let manifest = self.client.manifest(&origin).await?;
        let v = verify_manifest(&manifest, ManifestTrust::Pinned(public_key), Utc::now()).map_err(
            |e| TrustError::Untrusted(format!("the manifest at {origin} does not verify: {e}")),
        )?;
        if v.manifest.gateway_id != gateway_id || gateway_id == self.own_id {
            return Err(TrustError::Untrusted(format!(
                "{origin} is gateway {}, not {gateway_id}",
                v.manifest.gateway_id
            )));
        }
        let home = endpoints_origin(&v.manifest)
            .filter(|home| *home == origin)
            .ok_or_else(|| {
                TrustError::Untrusted(format!(
                    "the manifest at {origin} names endpoints elsewhere"
                ))
            })?;
        self.alias(&origin, gateway_id);
        let peer = TrustedPeer {
            gateway_id: gateway_id.to_owned(),
            url: home,
            role: v.manifest.role,
            keys: keys_of(&v),
            source: PeerSource::Tracker,
            bundle_endpoint: v.manifest.endpoints.bundle.clone(),
            valid_until: v.manifest.valid_until.min(until),
        };
        self.persist(&peer, &v, Some(tracker_id)).await?;
        self.remember(&peer);
        Ok(peer)
    }

    async fn persist(
        &self,
        peer: &TrustedPeer,
        v: &VerifiedManifest,
        admitted_by: Option<&str>,
    ) -> Result<(), TrustError> {
        let now = Utc::now();
        let old_keys: Vec<serde_json::Value> = v
            .manifest
            .old_keys
            .iter()
            .map(|k| {
                serde_json::json!({"key_id": k.key_id, "public_key": k.public_key,
                                   "expires_at": k.expires_at.to_rfc3339()})
            })
            .collect();
        self.store
            .upsert_peer(PeerRecord {
                gateway_id: peer.gateway_id.clone(),
                url: peer.url.clone(),
                public_key: v.manifest.public_key.clone(),
                key_id: v.manifest.key_id.clone(),
                old_keys: serde_json::json!({ "old_keys": old_keys, "admitted_by": admitted_by }),
                source: peer.source,
                verified_at: now,
                updated_at: now,
            })
            .await
            .map_err(|e| TrustError::Store(e.to_string()))
    }

    async fn stored(&self, gateway_id: &str) -> Result<Option<PeerRecord>, TrustError> {
        if gateway_id.is_empty() {
            return Ok(None);
        }
        self.store
            .peer(gateway_id)
            .await
            .map_err(|e| TrustError::Store(e.to_string()))
    }

    /// A stored key counts only while the rule that admitted it still holds.
    fn stored_source_applies(&self, p: &PeerRecord) -> bool {
        match p.source {
            // The pin that admitted it must still be configured (for its URL).
            PeerSource::Pin => origin_of(&p.url)
                .and_then(|o| self.pin_for(&o).map(str::to_owned))
                .is_some_and(|pin| admitted_by(p).as_deref() == Some(pin.as_str())),
            PeerSource::Tofu => self.tofu,
            PeerSource::Tracker => admitted_by(p).is_some_and(|t| self.tracker_ids_contain(&t)),
        }
    }

    fn tracker_ids_contain(&self, tracker_id: &str) -> bool {
        let known = self.known.read().unwrap_or_else(|e| e.into_inner());
        known
            .get(tracker_id)
            .is_some_and(|p| self.trackers.contains(&p.url))
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
            if !tracker.live_keys().any(|k| verify_object(&obj, k).is_ok()) {
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
                .learn_vouched(
                    gateway_id,
                    &vouch.gateway_url,
                    &key,
                    &tracker.gateway_id,
                    vouch.expires_at,
                )
                .await
            {
                Ok(p) => return Some(p),
                Err(e) => tracing::warn!(gateway_id, error = %e, "vouched gateway not verified"),
            }
        }
        None
    }

    /// Whether `url` is a configured peer or tracker, or a peer this node has learned.
    pub fn is_configured_or_known(&self, url: &str) -> bool {
        let Some(origin) = origin_of(url) else {
            return false;
        };
        if self
            .configured
            .iter()
            .any(|s| origin_of(&s.url).as_deref() == Some(origin.as_str()))
        {
            return true;
        }
        self.at_origin(&origin).is_some()
    }

    /// The peer at `url`: known (and still fresh) already, or learned now.
    pub async fn at_url(&self, url: &str) -> Result<TrustedPeer, TrustError> {
        let origin = origin_of(url).unwrap_or_else(|| url.to_owned());
        match self.at_origin(&origin) {
            Some(p) => Ok(p),
            None => self.learn(&origin).await,
        }
    }

    /// The configured peers' URLs (trackers left out: they hold no session).
    pub fn peer_urls(&self) -> Vec<String> {
        self.configured
            .iter()
            .filter(|s| origin_of(&s.url).is_none_or(|o| !self.trackers.contains(&o)))
            .map(|s| s.url.clone())
            .collect()
    }

    /// The configured peers and trackers, learned now when not yet known (failures skipped and
    /// logged).
    pub async fn configured(&self) -> Vec<TrustedPeer> {
        let mut out = Vec::new();
        for spec in &self.configured {
            match self.at_url(&spec.url).await {
                Ok(p) => out.push(p),
                Err(e) => tracing::warn!(peer = %spec.url, error = %e, "peer not usable"),
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
            if peer.expired() || self.may_refetch(iss) {
                let peer = self.learn(&peer.url).await?;
                if let Some(k) = peer.key(kid) {
                    return Ok(k.clone());
                }
            }
            return Err(TrustError::UnknownKid(kid.to_owned()));
        }
        // Not known yet: the configured peers this process has not learned (each URL fetched
        // on demand at most once per 30 s, so unknown issuers cannot make us hammer peers).
        let _learning = self.learning.lock().await;
        if let Some(peer) = self.known(iss) {
            return peer
                .key(kid)
                .cloned()
                .ok_or_else(|| TrustError::UnknownKid(kid.to_owned()));
        }
        let unlearned: Vec<String> = {
            let known = self.known.read().unwrap_or_else(|e| e.into_inner());
            self.configured
                .iter()
                .filter_map(|s| origin_of(&s.url))
                .filter(|o| {
                    let aliases = self.aliases.read().unwrap_or_else(|e| e.into_inner());
                    !known
                        .values()
                        .any(|p| &p.url == o || aliases.get(o) == Some(&p.gateway_id))
                })
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
                && p.source == PeerSource::Tofu
                && self.stored_source_applies(&p)
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
