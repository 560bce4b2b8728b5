//! Checking a federation token on an incoming peer request: the key only through `iss` → a
//! trusted peer → `kid`; the token bound to this node, this route and this subject; 60 s of clock
//! skew; each `jti` accepted once, remembered in the database (shared by replicas, kept across
//! restarts) until `exp` + skew. Every refusal is counted by reason.

use std::sync::Arc;

use chrono::{TimeZone, Utc};
use sbp_protocol::federation::{
    CLOCK_SKEW_SECS, Expect, FedTokenError, MAX_FED_TOKEN_LIFETIME_SECS, peek,
};
use sbp_store::Store;

use super::trust::{PeerDirectory, TrustError};
use crate::error::{Error, FedError};
use crate::metrics::{Metrics, fed};

/// The gateway a verified token came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub gateway_id: String,
    /// Its manifest's role: only gateways (not trackers) fetch bundles and take sessions.
    pub role: sbp_protocol::federation::Role,
}

pub struct FedAuth {
    directory: Arc<PeerDirectory>,
    store: Arc<dyn Store>,
    own_id: String,
    metrics: Arc<Metrics>,
}

impl FedAuth {
    pub fn new(
        directory: Arc<PeerDirectory>,
        store: Arc<dyn Store>,
        own_id: String,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            directory,
            store,
            own_id,
            metrics,
        }
    }

    fn reject(&self, reason: &'static str, message: impl Into<String>) -> Error {
        self.metrics.federation.count(fed::TOKEN_REJECTIONS, reason);
        FedError::TokenInvalid {
            reason,
            message: message.into(),
        }
        .into()
    }

    /// Verifies `token` (the bearer value) for `method path` about `sub`.
    pub async fn check(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        sub: &str,
    ) -> Result<Caller, Error> {
        let Some(token) = token else {
            return Err(self.reject(
                "missing",
                "a federation token is required (Authorization: Bearer <token>)",
            ));
        };
        let unverified = peek(token).map_err(|e| self.reject(e.reason(), e.to_string()))?;
        // Everything that needs no key first: a token for another node, route or subject, or
        // out of its time, is refused before any peer is looked up (or fetched).
        let c = &unverified.claims;
        let now = Utc::now().timestamp();
        let pre = if c.aud != self.own_id {
            Some(FedTokenError::Aud)
        } else if c.sub != sub {
            Some(FedTokenError::Sub)
        } else if c.htm != method {
            Some(FedTokenError::Htm)
        } else if c.htu != path {
            Some(FedTokenError::Htu)
        } else if c.exp.saturating_sub(c.iat) > MAX_FED_TOKEN_LIFETIME_SECS || c.exp <= c.iat {
            Some(FedTokenError::Lifetime)
        } else if c.iat > now.saturating_add(CLOCK_SKEW_SECS) {
            Some(FedTokenError::IatFuture)
        } else if c.exp <= now.saturating_sub(CLOCK_SKEW_SECS) {
            Some(FedTokenError::Expired)
        } else {
            None
        };
        if let Some(e) = pre {
            return Err(self.reject(e.reason(), e.to_string()));
        }
        if !super::identity::is_gateway_id(&c.iss) {
            return Err(self.reject("malformed", "`iss` is not a gateway id"));
        }
        let iss = c.iss.clone();
        let key = match self.directory.key_for(&iss, &unverified.kid).await {
            Ok(k) => k,
            Err(TrustError::Store(e)) => return Err(Error::internal("checking a peer", e)),
            Err(TrustError::Untrusted(why)) => {
                tracing::info!(iss = %iss, why = %why, "federation token from an untrusted issuer");
                self.metrics
                    .federation
                    .count(fed::TOKEN_REJECTIONS, "untrusted");
                return Err(FedError::Untrusted(format!(
                    "gateway {iss} is not trusted by this node"
                ))
                .into());
            }
            Err(e @ (TrustError::UnknownKid(_) | TrustError::Peer(_))) => {
                tracing::info!(iss = %iss, error = %e, "federation token with a key this node cannot verify");
                return Err(self.reject("unknown_kid", "unknown key id"));
            }
        };
        let expect = Expect {
            aud: &self.own_id,
            sub,
            htm: method,
            htu: path,
        };
        let claims = unverified
            .verify(&key, &expect, now)
            .map_err(|e: FedTokenError| self.reject(e.reason(), e.to_string()))?;
        let role = self
            .directory
            .known(&claims.iss)
            .map(|p| p.role)
            .unwrap_or(sbp_protocol::federation::Role::Tracker);
        if !role.hosts_sessions() {
            self.metrics
                .federation
                .count(fed::TOKEN_REJECTIONS, "not_a_gateway");
            return Err(FedError::Untrusted(format!(
                "{} is not a gateway: only gateways call this",
                claims.iss
            ))
            .into());
        }
        let until = Utc
            .timestamp_opt(claims.exp.saturating_add(CLOCK_SKEW_SECS), 0)
            .single()
            .unwrap_or_else(Utc::now);
        if !self
            .store
            .insert_jti(&claims.iss, &claims.jti, until)
            .await?
        {
            self.metrics
                .federation
                .count(fed::TOKEN_REJECTIONS, "replayed");
            return Err(FedError::TokenReplayed.into());
        }
        Ok(Caller {
            gateway_id: claims.iss,
            role,
        })
    }
}
