//! Bundles by CID between gateways: serving a stored bundle to a trusted peer (re-verified
//! against its CID first, never served when it does not match), and fetching one from the
//! providers that may have it, in order, until one serves bytes whose recomputed CID is the CID
//! asked for.

use sbp_protocol::bundle::{compute_cid, sealed_bytes_match};
use serde_json::Value;

use super::Federation;
use crate::engine::roaming::{ImportRequest, Imported};
use crate::error::{Error, FedError};
use crate::federation::client::PeerError;
use crate::federation::trust::TrustedPeer;
use crate::metrics::fed;

/// Whether `s` is a bundle CID: 64 lower-case hex digits.
pub fn is_cid(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `bytes` are a bundle whose CID (by the L3 rule) is `cid`.
fn bytes_have_cid(bytes: &[u8], cid: &str) -> Option<Value> {
    if sealed_bytes_match(bytes, cid) {
        return serde_json::from_slice(bytes).ok();
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) if compute_cid(&map) == cid => Some(Value::Object(map)),
        _ => None,
    }
}

/// How one provider's attempt ended.
pub(super) enum Attempt {
    Got(Value),
    NotFound,
    BadBytes,
    /// It answered, but refused this gateway (its token, its trust).
    Refused,
    Unreachable,
}

/// How long an import by CID may look for its bundle, all providers together.
const FETCH_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

impl Federation {
    /// `GET /v1/sbp/bundles/{cid}` for an authenticated peer: the stored bytes, verified.
    pub async fn serve_bundle(&self, cid: &str) -> Result<Vec<u8>, Error> {
        let inner = self.on()?;
        let Some(bytes) = inner.store.get_bundle(cid).await? else {
            inner
                .metrics
                .federation
                .count(fed::BUNDLE_SERVES, "not_found");
            return Err(Error::NotFound(format!("no bundle {cid} here")));
        };
        let verified = {
            let cid = cid.to_owned();
            tokio::task::spawn_blocking(move || {
                let ok = sealed_bytes_match(&bytes, &cid)
                    || matches!(serde_json::from_slice::<Value>(&bytes),
                                Ok(Value::Object(m)) if compute_cid(&m) == cid);
                (ok, bytes)
            })
            .await
            .map_err(|e| Error::internal("verifying a bundle", e))?
        };
        let (ok, bytes) = verified;
        if !ok {
            inner
                .metrics
                .federation
                .count(fed::BUNDLE_SERVES, "corrupt");
            tracing::error!(
                bundle_cid = cid,
                "a stored bundle does not match its CID: not served"
            );
            return Err(FedError::BundleCorrupt(cid.to_owned()).into());
        }
        inner.metrics.federation.count(fed::BUNDLE_SERVES, "served");
        Ok(bytes)
    }

    /// The providers to ask for a bundle, in order: the one the caller named (when trusted),
    /// the static peers that host sessions, then those the trackers name.
    async fn providers(&self, cid: &str, from: Option<&str>) -> Result<Vec<TrustedPeer>, Error> {
        let inner = self.on()?;
        let mut out: Vec<TrustedPeer> = Vec::new();
        // A `from` is only a hint: it is asked when it is a peer this node knows or is configured
        // with (or, with TOFU, may come to trust); a stranger's URL is never fetched.
        if let Some(url) = from
            && (inner.config.federation.as_ref().is_some_and(|f| f.tofu)
                || inner.directory.is_configured_or_known(url))
        {
            match inner.directory.at_url(url).await {
                Ok(p) => out.push(p),
                Err(e) => {
                    tracing::warn!(from = url, error = %e, "the named provider is not trusted");
                }
            }
        }
        for p in inner.directory.configured().await {
            if p.role.hosts_sessions() && !out.iter().any(|o| o.gateway_id == p.gateway_id) {
                out.push(p);
            }
        }
        for p in self.srv_peers().await {
            if p.role.hosts_sessions() && !out.iter().any(|o| o.gateway_id == p.gateway_id) {
                out.push(p);
            }
        }
        for p in self.tracker_providers(cid).await {
            if !out.iter().any(|o| o.gateway_id == p.gateway_id) {
                out.push(p);
            }
        }
        Ok(out)
    }

    pub(super) async fn fetch_from(&self, peer: &TrustedPeer, cid: &str) -> Attempt {
        let cap = self
            .inner
            .as_ref()
            .map(|i| i.config.max_body_bytes)
            .unwrap_or(1 << 20);
        self.fetch_within(peer, cid, cap, crate::federation::client::CALL_TIMEOUT)
            .await
    }

    /// [`Federation::fetch_from`] with its own size cap and time (a handover's bundle).
    pub(super) async fn fetch_within(
        &self,
        peer: &TrustedPeer,
        cid: &str,
        cap: usize,
        timeout: std::time::Duration,
    ) -> Attempt {
        let Ok(inner) = self.on() else {
            return Attempt::Unreachable;
        };
        let Some(template) = &peer.bundle_endpoint else {
            return Attempt::NotFound;
        };
        let url = template.replace("{bundle_cid}", cid);
        let Ok(parsed) = inner.directory.client().check_url(&url) else {
            return Attempt::Unreachable;
        };
        let token = inner
            .identity
            .token(&peer.gateway_id, cid, "GET", parsed.path());
        match inner
            .directory
            .client()
            .get_within(&url, Some(&token), cap, timeout)
            .await
        {
            Ok(a) if a.status == 200 => {
                let bytes = a.body;
                let cid_owned = cid.to_owned();
                match tokio::task::spawn_blocking(move || bytes_have_cid(&bytes, &cid_owned)).await
                {
                    Ok(Some(v)) => Attempt::Got(v),
                    _ => {
                        tracing::warn!(provider = %peer.url, bundle_cid = cid,
                            "a provider served bytes that are not the bundle asked for");
                        Attempt::BadBytes
                    }
                }
            }
            Ok(a) if a.status == 404 => Attempt::NotFound,
            Ok(a) if a.status == 401 || a.status == 403 => {
                tracing::warn!(provider = %peer.url, status = a.status, "a provider refused this gateway");
                Attempt::Refused
            }
            Ok(a) => {
                tracing::warn!(provider = %peer.url, status = a.status, "bundle fetch failed");
                Attempt::Unreachable
            }
            Err(PeerError::TooLarge { .. }) => Attempt::BadBytes,
            Err(e) => {
                tracing::warn!(provider = %peer.url, error = %e, "bundle fetch failed");
                Attempt::Unreachable
            }
        }
    }

    /// The bundle `cid` from the first provider that serves exactly it.
    pub async fn fetch_bundle(&self, cid: &str, from: Option<&str>) -> Result<Value, Error> {
        if !is_cid(cid) {
            return Err(FedError::InvalidCid(cid.to_owned()).into());
        }
        match tokio::time::timeout(FETCH_DEADLINE, self.fetch_bundle_now(cid, from)).await {
            Ok(r) => r,
            Err(_) => Err(FedError::PeerUnreachable(format!(
                "no provider of bundle {cid} answered in time"
            ))
            .into()),
        }
    }

    async fn fetch_bundle_now(&self, cid: &str, from: Option<&str>) -> Result<Value, Error> {
        let inner = self.on()?;
        let (mut bad, mut unreachable, mut answered) = (0, 0, 0);
        for peer in self.providers(cid, from).await? {
            let outcome = self.fetch_from(&peer, cid).await;
            let label = match &outcome {
                Attempt::Got(_) => "ok",
                Attempt::NotFound => "not_found",
                Attempt::BadBytes => "bad_bytes",
                Attempt::Refused => "refused",
                Attempt::Unreachable => "unreachable",
            };
            inner.metrics.federation.count(fed::BUNDLE_FETCHES, label);
            match outcome {
                Attempt::Got(v) => return Ok(v),
                Attempt::BadBytes => {
                    bad += 1;
                    answered += 1;
                }
                Attempt::NotFound | Attempt::Refused => answered += 1,
                Attempt::Unreachable => unreachable += 1,
            }
        }
        // 502 when every provider that answered served bad bytes; 503 when none answered.
        if bad > 0 && bad == answered {
            return Err(FedError::BundleUnavailable(format!(
                "every provider of bundle {cid} served bytes that do not match it"
            ))
            .into());
        }
        if answered == 0 && unreachable > 0 {
            return Err(FedError::PeerUnreachable(format!(
                "no provider of bundle {cid} could be reached"
            ))
            .into());
        }
        Err(Error::NotFound(format!("no provider has bundle {cid}")))
    }

    /// `POST /v1/sbp/sessions/import {"bundle_cid", "from"?}`: fetched, verified, imported as a
    /// new session (like a raw bundle import).
    pub async fn import_by_cid(
        &self,
        cid: &str,
        from: Option<&str>,
        target_agent_id: Option<String>,
    ) -> Result<Imported, Error> {
        let bundle = self.fetch_bundle(cid, from).await?;
        self.on()?
            .roaming
            .import(ImportRequest {
                roaming_token: None,
                bundle: Some(bundle),
                target_agent_id,
                allow_reuse: false,
            })
            .await
    }
}
