//! Roaming tokens across gateways (federation): tokens minted here name this gateway as `iss`,
//! and a peer that was handed one of them redeems it here: the token is verified with this
//! gateway's secret and its export consumed, with the same single-use rule as a local import,
//! and the peer learns the bundle CID, which it then fetches by CID.

use std::sync::OnceLock;

use chrono::{Duration, Utc};
use sbp_protocol::token::RoamingClaims;
use sbp_store::{RedeemOutcome, StoreError};
use uuid::Uuid;

use super::{Roaming, token_error};
use crate::error::Error;

/// A peer that redeemed a token may redeem it again this long after (a retry after a lost
/// answer), and gets the same CID.
pub const REDEEM_RETRY_WINDOW: Duration = Duration::minutes(10);

/// What a redeem gives the peer.
pub struct Redeemed {
    pub bundle_cid: String,
    pub export_id: Uuid,
    pub session_id: Uuid,
}

impl Roaming {
    /// The gateway id minted tokens carry as `iss` (set once, when federation starts).
    pub fn set_issuer(&self, gateway_id: &str) {
        let _ = self.inner.issuer.set(gateway_id.to_owned());
    }

    pub(super) fn issuer(&self) -> Option<String> {
        self.inner.issuer.get().cloned()
    }

    /// Verifies a roaming token with this gateway's secrets.
    pub fn verify_roaming_token(&self, raw: &str) -> Result<RoamingClaims, Error> {
        self.verify_token(raw, Utc::now().timestamp())
            .map_err(token_error)
    }

    /// `POST /v1/sbp/federation/tokens/redeem` from peer `by`: the token verified, its export
    /// consumed (410 when it was imported or redeemed already, except a retry by the same peer
    /// within [`REDEEM_RETRY_WINDOW`]).
    pub async fn redeem_for_peer(&self, raw: &str, by: &str) -> Result<Redeemed, Error> {
        let claims = self.verify_roaming_token(raw)?;
        let (export_id, export) = self.token_export(&claims).await?;
        let Some(export) = export else {
            return Err(Error::TokenInvalid(
                "the export this token refers to is not stored on this gateway".into(),
            ));
        };
        let now = Utc::now();
        match self
            .inner
            .store
            .redeem_export(export_id, by, now, now - REDEEM_RETRY_WINDOW)
            .await
        {
            Ok(RedeemOutcome::Redeemed | RedeemOutcome::AlreadyByThisPeer) => Ok(Redeemed {
                bundle_cid: export.bundle_cid,
                export_id,
                session_id: export.session_id,
            }),
            Ok(RedeemOutcome::Consumed) | Err(StoreError::Consumed) => Err(Error::TokenConsumed),
            Err(e) => Err(e.into()),
        }
    }
}

impl Roaming {
    /// A redeem with `allow_reuse` (a fork): the token verified, nothing consumed.
    pub async fn peek_export_for_peer(&self, raw: &str) -> Result<Redeemed, Error> {
        let claims = self.verify_roaming_token(raw)?;
        let (export_id, export) = self.token_export(&claims).await?;
        let export = export.ok_or_else(|| {
            Error::TokenInvalid(
                "the export this token refers to is not stored on this gateway".into(),
            )
        })?;
        Ok(Redeemed {
            bundle_cid: export.bundle_cid,
            export_id,
            session_id: export.session_id,
        })
    }
}

/// Keeps the issuer cell in `Shared`.
pub(super) type Issuer = OnceLock<String>;
