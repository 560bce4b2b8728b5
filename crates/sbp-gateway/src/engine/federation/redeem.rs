//! Roaming tokens are single-use across the federation: a token minted by a trusted peer (its
//! `iss`) is redeemed at that peer, which verifies and consumes it atomically and answers the
//! bundle CID; the bundle is then fetched by CID from it and imported. Nothing is written here
//! until the bytes verify. The minting side is `Roaming::redeem_for_peer`.

use base64::Engine as _;
use sbp_protocol::ErrorBody;
use sbp_protocol::federation::{RedeemAnswer, verify_object};
use serde_json::{Map, Value, json};

use super::Federation;
use crate::engine::roaming::{ImportRequest, Imported};
use crate::error::{Error, FedError};
use crate::federation::auth::Caller;
use crate::federation::trust::TrustedPeer;
use sbp_protocol::token::RoamingClaims;

/// The path of the redeem route.
pub const REDEEM_PATH: &str = "/v1/sbp/federation/tokens/redeem";

/// The claims of a roaming token, read without verifying it (to bind the federation token to
/// its session, and to date a redeemed export: the minting gateway is what verifies it).
fn unverified_claims(token: &str) -> Option<Map<String, Value>> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    match serde_json::from_slice::<Value>(&bytes).ok()? {
        Value::Object(m) => Some(m),
        _ => None,
    }
}

/// The `sid` claim of a roaming token, unverified.
pub fn roaming_sid(token: &str) -> Option<String> {
    unverified_claims(token)?
        .get("sid")?
        .as_str()
        .map(str::to_owned)
}

impl Federation {
    /// The trusted peer with this gateway id, learning the configured peers when needed.
    async fn trusted_peer(&self, gateway_id: &str) -> Option<TrustedPeer> {
        let inner = self.inner.as_ref()?;
        if let Some(p) = inner.directory.known(gateway_id) {
            return Some(p);
        }
        inner.directory.configured().await;
        if let Some(p) = inner.directory.known(gateway_id) {
            return Some(p);
        }
        inner.directory.via_trackers(gateway_id).await
    }

    /// `POST /v1/sbp/sessions/import` with federation on: a token minted by a trusted peer is
    /// redeemed there; anything else is imported as without federation.
    pub async fn import(&self, req: ImportRequest) -> Result<Imported, Error> {
        let inner = self.on()?;
        let remote = match &req.roaming_token {
            Some(t) => match sbp_protocol::token::peek_iss(t) {
                Some(iss) if iss != inner.identity.gateway_id() => {
                    self.trusted_peer(&iss).await.map(|p| (t.clone(), p))
                }
                _ => None,
            },
            None => None,
        };
        let Some((token, minter)) = remote else {
            return inner.roaming.import(req).await;
        };
        let answer = self.redeem_at(&minter, &token, req.allow_reuse).await?;
        let bundle = self
            .fetch_bundle(&answer.bundle_cid, Some(&minter.url))
            .await?;
        let dated = unverified_claims(&token).unwrap_or_default();
        let time = |k: &str| dated.get(k).and_then(Value::as_i64).unwrap_or(0);
        let claims = RoamingClaims {
            sub: answer.export_id.to_string(),
            sid: answer.session_id.to_string(),
            iat: time("iat"),
            exp: time("exp"),
            iss: Some(minter.gateway_id.clone()),
        };
        inner
            .roaming
            .import_redeemed(claims, bundle, req.target_agent_id, req.allow_reuse)
            .await
    }

    async fn redeem_at(
        &self,
        minter: &TrustedPeer,
        token: &str,
        allow_reuse: bool,
    ) -> Result<RedeemAnswer, Error> {
        let inner = self.on()?;
        let sid = roaming_sid(token)
            .ok_or_else(|| Error::TokenInvalid("the token names no session (`sid`)".into()))?;
        let url = format!("{}{REDEEM_PATH}", minter.url);
        let parsed = inner
            .directory
            .client()
            .check_url(&url)
            .map_err(|e| FedError::PeerUnreachable(e.to_string()))?;
        let bearer = inner
            .identity
            .token(&minter.gateway_id, &sid, "POST", parsed.path());
        let body = json!({ "roaming_token": token, "allow_reuse": allow_reuse });
        let a = inner
            .directory
            .client()
            .post(&url, Some(&bearer), &body, 64 << 10)
            .await
            .map_err(|e| {
                FedError::PeerUnreachable(format!(
                    "the gateway that minted this token ({}) could not be reached: {e}",
                    minter.url
                ))
            })?;
        if a.status != 200 {
            let code = serde_json::from_slice::<ErrorBody>(&a.body)
                .map(|b| b.error.code)
                .unwrap_or_default();
            return Err(match (a.status, code.as_str()) {
                (410, "SBP_TOKEN_EXPIRED") => Error::TokenExpired { expired_at: None },
                (410, _) => Error::TokenConsumed,
                (422, _) => Error::TokenInvalid(format!(
                    "the gateway that minted this token refused it ({code})"
                )),
                (401 | 403, _) => FedError::BundleUnavailable(format!(
                    "the gateway that minted this token refused this gateway ({code})"
                ))
                .into(),
                (s, _) => FedError::PeerUnreachable(format!(
                    "the gateway that minted this token answered HTTP {s} ({code})"
                ))
                .into(),
            });
        }
        let obj = a
            .object(&url)
            .map_err(|e| FedError::PeerUnreachable(e.to_string()))?;
        if !minter.live_keys().any(|k| verify_object(&obj, k).is_ok()) {
            return Err(FedError::PeerUnreachable(
                "the redeem answer is not signed by the minting gateway".into(),
            )
            .into());
        }
        RedeemAnswer::read(&obj)
            .map_err(|e| FedError::PeerUnreachable(format!("invalid redeem answer: {e}")).into())
    }

    /// The minting side: `caller` redeems `token` here (consumed unless `allow_reuse`).
    pub async fn redeem_for(
        &self,
        caller: &Caller,
        token: &str,
        allow_reuse: bool,
    ) -> Result<Map<String, Value>, Error> {
        let inner = self.on()?;
        let redeemed = if allow_reuse {
            inner.roaming.peek_export_for_peer(token).await?
        } else {
            inner
                .roaming
                .redeem_for_peer(token, &caller.gateway_id)
                .await?
        };
        Ok(RedeemAnswer {
            bundle_cid: redeemed.bundle_cid,
            export_id: redeemed.export_id,
            session_id: redeemed.session_id,
        }
        .to_signed_map(inner.identity.key()))
    }
}
