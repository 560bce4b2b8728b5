//! A gateway's side of trackers: announcing the bundles it exports, and asking trackers who
//! provides a CID. Tracker answers are hints: the tracker's signature (by a key this node trusts
//! for it), the CID asked, freshness, and each provider record's own signature (by a key trusted
//! directly or vouched for by that tracker) are checked; whatever fails is dropped.

use chrono::{Duration, Utc};
use sbp_protocol::federation::{ProviderRecord, RegistryAnswer, verify_object};
use serde_json::Value;

use super::Federation;
use crate::federation::client::MAX_REGISTRY_BYTES;
use crate::federation::trust::TrustedPeer;
use crate::metrics::fed;

impl Federation {
    async fn trackers(&self) -> Vec<TrustedPeer> {
        match self.on() {
            Ok(inner) => inner.directory.trackers().await,
            Err(_) => Vec::new(),
        }
    }

    /// Makes this gateway known to every tracker (`POST /v1/sbp/registry/gateways`), so nodes
    /// that pin a tracker may trust this gateway's key. True when every tracker took it.
    pub async fn register_with_trackers(&self) -> bool {
        let Ok(inner) = self.on() else {
            return true;
        };
        let Some(base) = inner.identity.base_url() else {
            return false;
        };
        let body = serde_json::json!({ "gateway_url": base });
        let mut all = true;
        for tracker in self.trackers().await {
            let url = format!("{}/v1/sbp/registry/gateways", tracker.url);
            match inner
                .directory
                .client()
                .post(&url, None, &body, 64 << 10)
                .await
            {
                Ok(a) if a.status == 200 || a.status == 201 => {
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "registered");
                }
                other => {
                    all = false;
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "register_failed");
                    tracing::warn!(tracker = %tracker.url, answer = ?other.map(|a| a.status), "registering with a tracker failed");
                }
            }
        }
        all && !inner.directory.tracker_urls().is_empty()
    }

    /// Announces bundle `cid` to every tracker; the ids of the trackers that accepted it.
    pub async fn announce(&self, cid: &str) -> Vec<String> {
        let Ok(inner) = self.on() else {
            return Vec::new();
        };
        let Some(fed_config) = &inner.config.federation else {
            return Vec::new();
        };
        let Some(base) = inner.identity.base_url() else {
            return Vec::new();
        };
        let now = Utc::now();
        let ttl = Duration::from_std(fed_config.announce_ttl).unwrap_or(Duration::hours(24));
        let now_ms = u64::try_from(now.timestamp_millis()).unwrap_or(0);
        let seq = match inner
            .store
            .next_announcement(cid, now_ms, now + ttl, now)
            .await
        {
            Ok(seq) => seq,
            Err(e) => {
                tracing::error!(error = %e, "recording an announcement");
                return Vec::new();
            }
        };
        let record = ProviderRecord {
            gateway_id: inner.identity.gateway_id().to_owned(),
            bundle_cid: cid.to_owned(),
            bundle_url: format!("{base}/v1/sbp/bundles/{cid}"),
            seq,
            issued_at: now,
            expires_at: now + ttl,
        }
        .to_signed_map(inner.identity.key());
        let body = Value::Object(record);
        let mut accepted = Vec::new();
        for tracker in self.trackers().await {
            let url = format!("{}/v1/sbp/registry", tracker.url);
            match inner
                .directory
                .client()
                .post(&url, None, &body, 64 << 10)
                .await
            {
                Ok(a) if a.status == 200 || a.status == 201 => {
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "announced");
                    accepted.push(tracker.gateway_id.clone());
                }
                Ok(a) => {
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "announce_refused");
                    tracing::warn!(tracker = %tracker.url, status = a.status,
                        body = %String::from_utf8_lossy(&a.body[..a.body.len().min(300)]),
                        "a tracker refused an announce");
                }
                Err(e) => {
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "unreachable");
                    tracing::warn!(tracker = %tracker.url, error = %e, "announce failed");
                }
            }
        }
        accepted
    }

    /// The providers of `cid` the trackers know, verified.
    pub(super) async fn tracker_providers(&self, cid: &str) -> Vec<TrustedPeer> {
        let Ok(inner) = self.on() else {
            return Vec::new();
        };
        let mut out: Vec<TrustedPeer> = Vec::new();
        for tracker in self.trackers().await {
            let url = format!("{}/v1/sbp/registry/{cid}", tracker.url);
            let answer = match inner
                .directory
                .client()
                .get(&url, None, MAX_REGISTRY_BYTES)
                .await
            {
                Ok(a) if a.status == 200 => a,
                Ok(a) => {
                    let outcome = if a.status == 404 {
                        "not_found"
                    } else {
                        "refused"
                    };
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, outcome);
                    continue;
                }
                Err(e) => {
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "unreachable");
                    tracing::warn!(tracker = %tracker.url, error = %e, "tracker lookup failed");
                    continue;
                }
            };
            let Ok(obj) = answer.object(&url) else {
                inner
                    .metrics
                    .federation
                    .count(fed::TRACKER_QUERIES, "bad_answer");
                continue;
            };
            let signed_ok = tracker.live_keys().any(|k| verify_object(&obj, k).is_ok());
            let read = RegistryAnswer::read(&obj);
            let answer = match (signed_ok, read) {
                (true, Ok(a))
                    if a.check(cid, Utc::now()).is_ok() && a.tracker_id == tracker.gateway_id =>
                {
                    a
                }
                _ => {
                    inner
                        .metrics
                        .federation
                        .count(fed::TRACKER_QUERIES, "bad_answer");
                    tracing::warn!(tracker = %tracker.url, bundle_cid = cid,
                        "a tracker answer that does not verify was discarded");
                    continue;
                }
            };
            inner
                .metrics
                .federation
                .count(fed::TRACKER_QUERIES, "found");
            for record in answer.providers {
                match self.provider_of(&record, cid).await {
                    Some(p) if !out.iter().any(|o| o.gateway_id == p.gateway_id) => out.push(p),
                    Some(_) => {}
                    None => tracing::warn!(tracker = %tracker.url, bundle_cid = cid,
                        "a provider record that does not verify was dropped"),
                }
            }
        }
        out
    }

    /// The gateway a provider record names, when the record verifies by a key trusted for it
    /// (already, or through the tracker's signed vouch).
    async fn provider_of(
        &self,
        record: &serde_json::Map<String, Value>,
        cid: &str,
    ) -> Option<TrustedPeer> {
        let inner = self.on().ok()?;
        let parsed = ProviderRecord::read(record).ok()?;
        if parsed.bundle_cid != cid || parsed.check(Utc::now()).is_err() {
            return None;
        }
        if parsed.gateway_id == inner.identity.gateway_id() {
            return None;
        }
        let verifies = |p: &TrustedPeer| p.live_keys().any(|k| verify_object(record, k).is_ok());
        if let Some(p) = inner.directory.known(&parsed.gateway_id) {
            return verifies(&p).then_some(p);
        }
        // Not trusted yet: a pinned tracker may vouch for its key.
        let peer = inner.directory.via_trackers(&parsed.gateway_id).await?;
        verifies(&peer).then_some(peer)
    }
}
