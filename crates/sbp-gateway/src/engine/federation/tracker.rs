//! The tracker role: an index of which gateway serves which bundle CID, and nothing else. A
//! record is accepted only from the gateway it names: the tracker fetches the manifest at the
//! origin of the record's `bundle_url` (that URL's `/.well-known/sbp`, never the bundle itself)
//! and checks that its `gateway_id`, its bundle endpoint and its key are the record's. Answers are
//! signed with the tracker's manifest key, and hold the gateways' own signed records verbatim.

use std::num::NonZeroU32;
use std::sync::Arc;

use chrono::{Duration, Utc};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sbp_protocol::federation::{
    GatewayVouch, ManifestTrust, ProviderRecord, PublicKey, RegistryAnswer, VerifiedManifest,
    verify_manifest, verify_object,
};
use sbp_store::{PutRecord, RegistryRecordRow, Store, VouchRow};
use serde_json::{Map, Value};

use crate::error::{Error, FedError, RegistryRefusal};
use crate::federation::client::{PeerClient, origin};
use crate::federation::identity::Identity;
use crate::metrics::{Metrics, fed};

/// The largest record accepted (its JSON): a record is a reference, never content.
const MAX_RECORD_BYTES: usize = 2048;
/// The fields a record may have.
const RECORD_FIELDS: [&str; 7] = [
    "gateway_id",
    "bundle_cid",
    "bundle_url",
    "seq",
    "issued_at",
    "expires_at",
    "signature",
];
/// A manifest that failed to admit is not fetched again from the same origin sooner.
const ADMIT_COOLDOWN: std::time::Duration = std::time::Duration::from_secs(30);
/// Origins remembered for the cooldown at most (then the oldest are dropped).
const MAX_COOLDOWNS: usize = 10_000;

/// Providers returned for one CID at most.
const MAX_PROVIDERS: u32 = 50;
/// How long a signed lookup answer is valid.
const ANSWER_VALIDITY: Duration = Duration::minutes(5);
/// How long a vouch stays valid for its readers.
const VOUCH_VALIDITY: Duration = Duration::hours(1);

/// A gateway as this tracker admitted it from its manifest.
#[derive(Clone)]
struct Admitted {
    origin: String,
    bundle_template: Option<String>,
    keys: Vec<PublicKey>,
    vouch: VouchRow,
    /// The manifest's `valid_until` (or an old key's expiry, if sooner): past it, the manifest is
    /// read again.
    until: chrono::DateTime<Utc>,
}

/// What a verified manifest lets this tracker keep of a gateway.
fn admitted_from(v: &VerifiedManifest, origin: &str, now: chrono::DateTime<Utc>) -> Admitted {
    let until = v
        .manifest
        .old_keys
        .iter()
        .map(|k| k.expires_at)
        .filter(|t| *t > now)
        .fold(v.manifest.valid_until, |a, b| a.min(b));
    Admitted {
        origin: origin.to_owned(),
        bundle_template: v.manifest.endpoints.bundle.clone(),
        keys: v.valid_keys.iter().map(|(_, k)| k.clone()).collect(),
        vouch: vouch_row(v, origin, now),
        until,
    }
}

/// The record's `bundle_url` must be the gateway's own bundle endpoint for its CID.
fn check_record_url(a: &Admitted, record: &ProviderRecord) -> Result<(), Error> {
    let endpoint = a
        .bundle_template
        .as_deref()
        .map(|t| t.replace("{bundle_cid}", &record.bundle_cid));
    if endpoint.as_deref() == Some(record.bundle_url.as_str()) {
        Ok(())
    } else {
        Err(refuse(
            RegistryRefusal::NotOwner,
            "bundle_url is not the gateway's own bundle endpoint for this CID",
        ))
    }
}

fn vouch_row(v: &VerifiedManifest, origin: &str, now: chrono::DateTime<Utc>) -> VouchRow {
    VouchRow {
        gateway_id: v.manifest.gateway_id.clone(),
        gateway_url: origin.to_owned(),
        public_key: v.manifest.public_key.clone(),
        key_id: v.manifest.key_id.clone(),
        verified_at: now,
    }
}

/// How an accepted announce changed the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announced {
    Created,
    Replaced,
    Unchanged,
}

pub struct Tracker {
    identity: Arc<Identity>,
    store: Arc<dyn Store>,
    client: PeerClient,
    metrics: Arc<Metrics>,
    max_records: u64,
    rate: Option<DefaultKeyedRateLimiter<String>>,
    /// Gateways admitted from their manifests (bounded; a miss costs one fetch).
    admitted: std::sync::Mutex<std::collections::HashMap<String, Admitted>>,
    /// Origins whose manifest was fetched recently, and when.
    cooldown: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

fn refuse(refusal: RegistryRefusal, message: impl Into<String>) -> Error {
    FedError::Registry {
        refusal,
        message: message.into(),
    }
    .into()
}

impl Tracker {
    pub fn new(
        identity: Arc<Identity>,
        store: Arc<dyn Store>,
        client: PeerClient,
        metrics: Arc<Metrics>,
        max_records: u64,
        rate: Option<crate::ratelimit::Rate>,
    ) -> Self {
        let rate = rate.map(|r| {
            let every = (r.period / r.count.get()).max(std::time::Duration::from_nanos(1));
            let quota = Quota::with_period(every)
                .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
                .allow_burst(r.burst);
            RateLimiter::keyed(quota)
        });
        Self {
            identity,
            store,
            client,
            metrics,
            max_records,
            rate,
            admitted: std::sync::Mutex::new(std::collections::HashMap::new()),
            cooldown: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// Whether the manifest at `origin` may be fetched now (not after a recent failure).
    fn may_fetch(&self, origin: &str) -> bool {
        let map = self.cooldown.lock().unwrap_or_else(|e| e.into_inner());
        map.get(origin)
            .is_none_or(|at| at.elapsed() >= ADMIT_COOLDOWN)
    }

    fn failed(&self, origin: &str) {
        let mut map = self.cooldown.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_COOLDOWNS {
            map.retain(|_, at| at.elapsed() < ADMIT_COOLDOWN);
        }
        if map.len() < MAX_COOLDOWNS {
            map.insert(origin.to_owned(), std::time::Instant::now());
        }
    }

    fn count(&self, outcome: &'static str) {
        self.metrics
            .federation
            .count(fed::TRACKER_ANNOUNCES, outcome);
    }

    /// `POST /v1/sbp/registry`: a gateway's signed record.
    pub async fn announce(&self, record: Map<String, Value>) -> Result<Announced, Error> {
        let result = self.accept(record).await;
        self.count(match &result {
            Ok(Announced::Created) => "created",
            Ok(Announced::Replaced) => "replaced",
            Ok(Announced::Unchanged) => "unchanged",
            Err(Error::Federation(FedError::Registry { refusal, .. })) => match refusal {
                RegistryRefusal::Invalid => "invalid",
                RegistryRefusal::Signature => "bad_signature",
                RegistryRefusal::NotOwner => "not_owner",
                RegistryRefusal::Stale => "stale",
                RegistryRefusal::Quota => "quota",
            },
            Err(_) => "error",
        });
        result
    }

    async fn accept(&self, record: Map<String, Value>) -> Result<Announced, Error> {
        let now = Utc::now();
        let size = serde_json::to_vec(&record)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        if size > MAX_RECORD_BYTES {
            return Err(refuse(
                RegistryRefusal::Invalid,
                format!("a record is at most {MAX_RECORD_BYTES} bytes"),
            ));
        }
        if let Some(extra) = record.keys().find(|k| !RECORD_FIELDS.contains(&k.as_str())) {
            return Err(refuse(
                RegistryRefusal::Invalid,
                format!(
                    "a record has no field `{}`",
                    extra.chars().take(40).collect::<String>()
                ),
            ));
        }
        let parsed = ProviderRecord::read(&record)
            .map_err(|e| refuse(RegistryRefusal::Invalid, format!("invalid record: {e}")))?;
        parsed
            .check(now)
            .map_err(|e| refuse(RegistryRefusal::Invalid, format!("invalid record: {e}")))?;
        if !crate::federation::identity::is_gateway_id(&parsed.gateway_id) {
            return Err(refuse(
                RegistryRefusal::Invalid,
                "gateway_id must be 32 lower-case hex digits",
            ));
        }
        if parsed.seq > i64::MAX as u64 {
            return Err(refuse(RegistryRefusal::Invalid, "seq is out of range"));
        }
        let url = self.client.check_url(&parsed.bundle_url).map_err(|_| {
            refuse(
                RegistryRefusal::Invalid,
                "bundle_url is not a URL this tracker may check (https, or http on loopback)",
            )
        })?;
        let origin = origin(&url);
        let vouch = self.verified_key(&parsed, &origin, &record).await?;
        // Counted only once the record is the gateway's own: no one can spend its budget.
        if let Some(limiter) = &self.rate {
            if limiter.len() > MAX_COOLDOWNS {
                limiter.retain_recent();
            }
            if limiter.check_key(&parsed.gateway_id).is_err() {
                return Err(refuse(
                    RegistryRefusal::Quota,
                    format!("gateway {} announces too fast", parsed.gateway_id),
                ));
            }
        }
        self.store.put_vouch(vouch).await?;
        let row = RegistryRecordRow {
            gateway_id: parsed.gateway_id.clone(),
            bundle_cid: parsed.bundle_cid.clone(),
            bundle_url: parsed.bundle_url.clone(),
            seq: parsed.seq,
            issued_at: parsed.issued_at,
            expires_at: parsed.expires_at,
            record: serde_json::to_string(&record)
                .map_err(|e| Error::internal("storing a record", e))?,
        };
        match self.store.put_record(row, self.max_records, now).await? {
            PutRecord::Inserted => Ok(Announced::Created),
            PutRecord::Replaced => Ok(Announced::Replaced),
            PutRecord::Unchanged => Ok(Announced::Unchanged),
            PutRecord::Stale => Err(refuse(
                RegistryRefusal::Stale,
                format!(
                    "a record with a higher seq than {} is held for this bundle",
                    parsed.seq
                ),
            )),
            PutRecord::QuotaExceeded => Err(refuse(
                RegistryRefusal::Quota,
                format!(
                    "gateway {} holds {} records here already",
                    parsed.gateway_id, self.max_records
                ),
            )),
        }
    }

    /// The announcing gateway's key, verified against its manifest at `origin` (or what this
    /// tracker admitted of it before), with the record's URL and signature checked by it.
    async fn verified_key(
        &self,
        record: &ProviderRecord,
        origin: &str,
        signed: &Map<String, Value>,
    ) -> Result<VouchRow, Error> {
        let now = Utc::now();
        let known = self.admitted_as(&record.gateway_id, origin);
        if let Some(a) = &known {
            check_record_url(a, record)?;
            if a.keys.iter().any(|k| verify_object(signed, k).is_ok()) {
                return Ok(a.vouch.clone());
            }
            // Not the key admitted: a rotation (fetch again, at most once per 30 s) or a forgery.
            if !self.may_fetch(origin) {
                return Err(refuse(
                    RegistryRefusal::Signature,
                    "the record's signature does not verify by the gateway's key",
                ));
            }
        } else if !self.may_fetch(origin) {
            return Err(refuse(
                RegistryRefusal::NotOwner,
                format!("the manifest at {origin} was read moments ago; try again later"),
            ));
        }
        // Whatever the outcome, the next fetch of this origin waits: records that fail cannot
        // make this tracker hammer a server.
        self.failed(origin);
        let verified = self.admit(origin).await?;
        // What the manifest proved is kept, whoever the record claimed to be.
        let admitted = admitted_from(&verified, origin, now);
        self.remember(&verified.manifest.gateway_id, admitted.clone());
        if verified.manifest.gateway_id != record.gateway_id {
            return Err(refuse(
                RegistryRefusal::NotOwner,
                format!(
                    "{origin} is gateway {}, not {}: a gateway announces only itself",
                    verified.manifest.gateway_id, record.gateway_id
                ),
            ));
        }
        check_record_url(&admitted, record)?;
        if !admitted
            .keys
            .iter()
            .any(|k| verify_object(signed, k).is_ok())
        {
            return Err(refuse(
                RegistryRefusal::Signature,
                "the record's signature does not verify by the gateway's key",
            ));
        }
        Ok(admitted.vouch)
    }

    /// What this tracker admitted of `gateway_id` at `origin` (its manifest, read before).
    fn admitted_as(&self, gateway_id: &str, origin: &str) -> Option<Admitted> {
        let map = self.admitted.lock().unwrap_or_else(|e| e.into_inner());
        map.get(gateway_id)
            .filter(|a| a.origin == origin && a.until > Utc::now())
            .cloned()
    }

    fn remember(&self, gateway_id: &str, admitted: Admitted) {
        let mut map = self.admitted.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_COOLDOWNS && !map.contains_key(gateway_id) {
            // Bounded: forgetting one only costs it one more manifest fetch.
            if let Some(k) = map.keys().next().cloned() {
                map.remove(&k);
            }
        }
        map.insert(gateway_id.to_owned(), admitted);
    }

    /// The manifest at `origin`, admitted as what this tracker vouches for: a gateway id known
    /// here must keep its key (or rotate it by a valid `old_signature`); a new one must be
    /// derived from one of the manifest's keys, so no one can take another gateway's id.
    async fn admit(&self, origin: &str) -> Result<VerifiedManifest, Error> {
        let now = Utc::now();
        let manifest = self.client.manifest(origin).await.map_err(|e| {
            refuse(
                RegistryRefusal::NotOwner,
                format!("the manifest at {origin} could not be read: {e}"),
            )
        })?;
        let claimed = manifest
            .get("gateway_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let known = self.store.vouch(&claimed).await?;
        let trust = known
            .as_ref()
            .and_then(|v| PublicKey::from_b64_spki(&v.public_key).ok());
        let verified = match &trust {
            Some(pinned) => verify_manifest(&manifest, ManifestTrust::Pinned(pinned), now),
            None => verify_manifest(&manifest, ManifestTrust::SelfSigned, now),
        }
        .map_err(|e| {
            refuse(
                RegistryRefusal::NotOwner,
                format!("the manifest at {origin} is not gateway {claimed}'s: {e}"),
            )
        })?;
        if trust.is_none() && !crate::federation::trust::id_is_derived(&manifest, &verified) {
            return Err(refuse(
                RegistryRefusal::NotOwner,
                format!("gateway id {claimed} is not derived from the manifest's keys"),
            ));
        }
        if crate::federation::trust::endpoints_origin(&verified.manifest).as_deref() != Some(origin)
        {
            return Err(refuse(
                RegistryRefusal::NotOwner,
                format!("the manifest at {origin} names endpoints elsewhere"),
            ));
        }
        Ok(verified)
    }

    /// `POST /v1/sbp/registry/gateways {"gateway_url"}`: a gateway makes itself known, so that
    /// nodes pinning this tracker may trust its key (nothing but its manifest is read).
    pub async fn register(&self, gateway_url: &str) -> Result<Map<String, Value>, Error> {
        let url = self.client.check_url(gateway_url).map_err(|_| {
            refuse(
                RegistryRefusal::Invalid,
                "gateway_url is not a URL this tracker may check (https, or http on loopback)",
            )
        })?;
        let origin = origin(&url);
        if !self.may_fetch(&origin) {
            // Read moments ago: what it proved then stands.
            let recent = {
                let map = self.admitted.lock().unwrap_or_else(|e| e.into_inner());
                map.values()
                    .find(|a| a.origin == origin)
                    .map(|a| a.vouch.gateway_id.clone())
            };
            let outcome = if recent.is_some() {
                "registered"
            } else {
                "not_registered"
            };
            self.metrics
                .federation
                .count(fed::TRACKER_ANNOUNCES, outcome);
            return match recent {
                Some(id) => self.vouch(&id).await,
                None => Err(refuse(
                    RegistryRefusal::NotOwner,
                    format!("the manifest at {origin} was read moments ago; try again later"),
                )),
            };
        }
        // One fetch per origin per 30 s, whatever its outcome: registering cannot be used to
        // make this tracker hammer a server.
        self.failed(&origin);
        let verified = self.admit(&origin).await;
        self.metrics.federation.count(
            fed::TRACKER_ANNOUNCES,
            if verified.is_ok() {
                "registered"
            } else {
                "not_registered"
            },
        );
        let verified = verified?;
        let row = vouch_row(&verified, &origin, Utc::now());
        self.remember(
            &row.gateway_id,
            admitted_from(&verified, &origin, Utc::now()),
        );
        let gateway_id = row.gateway_id.clone();
        self.store.put_vouch(row).await?;
        self.vouch(&gateway_id).await
    }

    /// `GET /v1/sbp/registry/{cid}`: the unexpired records, in a signed answer.
    pub async fn lookup(&self, cid: &str) -> Result<Map<String, Value>, Error> {
        let now = Utc::now();
        let rows = self.store.records_for(cid, now, MAX_PROVIDERS).await?;
        let providers: Vec<Map<String, Value>> = rows
            .iter()
            .filter_map(|r| serde_json::from_str(&r.record).ok())
            .collect();
        if providers.is_empty() {
            self.metrics
                .federation
                .count(fed::TRACKER_LOOKUPS, "not_found");
            return Err(Error::NotFound(format!(
                "no provider of {cid} is known here"
            )));
        }
        self.metrics.federation.count(fed::TRACKER_LOOKUPS, "found");
        Ok(RegistryAnswer {
            tracker_id: self.identity.gateway_id().to_owned(),
            bundle_cid: cid.to_owned(),
            issued_at: now,
            expires_at: now + ANSWER_VALIDITY,
            providers,
        }
        .to_signed_map(self.identity.key()))
    }

    /// `GET /v1/sbp/registry/gateways/{gateway_id}`: what this tracker verified about a gateway.
    pub async fn vouch(&self, gateway_id: &str) -> Result<Map<String, Value>, Error> {
        let Some(v) = self.store.vouch(gateway_id).await? else {
            return Err(Error::NotFound(format!(
                "gateway {gateway_id} is not known here"
            )));
        };
        let now = Utc::now();
        Ok(GatewayVouch {
            tracker_id: self.identity.gateway_id().to_owned(),
            gateway_id: v.gateway_id,
            gateway_url: v.gateway_url,
            public_key: v.public_key,
            key_id: v.key_id,
            verified_at: v.verified_at,
            expires_at: now + VOUCH_VALIDITY,
        }
        .to_signed_map(self.identity.key()))
    }
}
