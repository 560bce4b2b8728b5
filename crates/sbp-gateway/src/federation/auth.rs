//! Checking a federation token on an incoming peer request: the key only through `iss` → a
//! trusted peer → `kid`; the token bound to this node, this route and this subject; 60 s of clock
//! skew; each `jti` accepted once, remembered in the database (shared by replicas, kept across
//! restarts) until `exp` + skew. Every refusal is counted by reason.

use std::sync::Arc;

use chrono::{TimeZone, Utc};
use sbp_protocol::federation::{CLOCK_SKEW_SECS, Expect, FedTokenError, peek};
use sbp_store::Store;

use super::trust::{PeerDirectory, TrustError};
use crate::error::{Error, FedError};
use crate::metrics::{Metrics, fed};

/// The gateway a verified token came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub gateway_id: String,
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
        let iss = unverified.claims.iss.clone();
        let key = match self.directory.key_for(&iss, &unverified.kid).await {
            Ok(k) => k,
            Err(TrustError::UnknownKid(kid)) => {
                return Err(self.reject("unknown_kid", format!("unknown key id {kid}")));
            }
            Err(TrustError::Store(e)) => return Err(Error::internal("checking a peer", e)),
            Err(e @ (TrustError::Untrusted(_) | TrustError::Peer(_))) => {
                self.metrics
                    .federation
                    .count(fed::TOKEN_REJECTIONS, "untrusted");
                return Err(
                    FedError::Untrusted(format!("gateway {iss} is not trusted here: {e}")).into(),
                );
            }
        };
        let expect = Expect {
            aud: &self.own_id,
            sub,
            htm: method,
            htu: path,
        };
        let claims = unverified
            .verify(&key, &expect, Utc::now().timestamp())
            .map_err(|e: FedTokenError| self.reject(e.reason(), e.to_string()))?;
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
        })
    }
}
