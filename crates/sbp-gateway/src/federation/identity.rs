//! This node's federation identity: its Ed25519 key and the keys it rotated away from, its
//! `gateway_id` (derived from the first key at first start, then read from the store for ever, so
//! a rotation never changes it), and the signed manifest of `/.well-known/sbp`.

use std::sync::{Arc, OnceLock};

use chrono::{DateTime, Duration, Utc};
use sbp_protocol::federation::{
    Endpoints, FedClaims, IdentityKey, Manifest, OldKey, Role, sign_fed_token, sign_object,
};
use serde_json::{Map, Value};

use crate::config::{FederationConfig, OldIdentityKey};
use crate::error::Error;

/// How long a manifest we hand out stays valid (the issue allows up to 7 days; a short validity
/// makes a rotation reach peers that cache it sooner).
const MANIFEST_VALIDITY: Duration = Duration::hours(24);
/// Lifetime of the federation tokens this node mints (at most 5 minutes are allowed).
const TOKEN_LIFETIME_SECS: i64 = 120;

/// A gateway id as this implementation derives them: 32 lower-case hex digits.
pub fn is_gateway_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

pub struct Identity {
    gateway_id: String,
    role: Role,
    name: String,
    sbp_version: String,
    key: Arc<IdentityKey>,
    /// Newest first.
    old_keys: Vec<OldIdentityKey>,
    /// `scheme://host[:port]` this node is reached by: the first `--public-url`, else the bound
    /// address (set once the listener is bound).
    base_url: OnceLock<String>,
}

impl Identity {
    /// The identity for `config`, with the gateway id the store keeps (recorded now on the first
    /// start: derived from the oldest key this node still has).
    pub async fn establish(
        config: &FederationConfig,
        sbp_version: &str,
        public_base: Option<String>,
        store: &dyn sbp_store::FederationStore,
    ) -> Result<Self, Error> {
        let first = &config.first_public_key;
        let stored = store
            .init_identity(&first.derive_gateway_id(), &first.key_id(), Utc::now())
            .await?;
        let base_url = OnceLock::new();
        if let Some(base) = public_base {
            let _ = base_url.set(base);
        }
        Ok(Self {
            gateway_id: stored.gateway_id,
            role: config.role,
            name: config.gateway_name.clone(),
            sbp_version: sbp_version.to_owned(),
            key: config.key.clone(),
            old_keys: config.old_keys.clone(),
            base_url,
        })
    }

    pub fn gateway_id(&self) -> &str {
        &self.gateway_id
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn key(&self) -> &IdentityKey {
        &self.key
    }

    /// Records the address the listener is bound to, when no public URL was configured.
    pub fn bound(&self, base: String) {
        let _ = self.base_url.set(base);
    }

    /// `scheme://host[:port]` of this node, once known.
    pub fn base_url(&self) -> Option<&str> {
        self.base_url.get().map(String::as_str)
    }

    /// The manifest, signed now (`old_signature` by the newest old key still verifying).
    pub fn manifest(&self, now: DateTime<Utc>) -> Map<String, Value> {
        let live: Vec<&OldIdentityKey> = self
            .old_keys
            .iter()
            .filter(|k| k.expires_at > now)
            .collect();
        let base = self.base_url().unwrap_or("http://127.0.0.1");
        let manifest = Manifest {
            sbp_version: self.sbp_version.clone(),
            gateway_id: self.gateway_id.clone(),
            gateway_name: self.name.clone(),
            role: self.role,
            public_key: self.key.public_key().to_b64_spki(),
            key_id: self.key.key_id(),
            old_keys: live
                .iter()
                .map(|k| OldKey {
                    key_id: k.key.key_id(),
                    public_key: k.key.public_key().to_b64_spki(),
                    expires_at: k.expires_at,
                })
                .collect(),
            issued_at: now,
            valid_until: now + MANIFEST_VALIDITY,
            endpoints: Endpoints::for_role(self.role, base),
        };
        manifest.to_signed_map(&self.key, live.first().map(|k| k.key.as_ref()))
    }

    /// Signs `obj` with the current key (`signature`).
    pub fn sign(&self, obj: &mut Map<String, Value>) {
        sign_object(obj, &self.key);
    }

    /// A federation token for calling `method path` on the peer `aud`, about `sub`.
    pub fn token(&self, aud: &str, sub: &str, method: &str, path: &str) -> String {
        let iat = Utc::now().timestamp();
        let claims = FedClaims {
            iss: self.gateway_id.clone(),
            aud: aud.to_owned(),
            sub: sub.to_owned(),
            htm: method.to_owned(),
            htu: path.to_owned(),
            iat,
            exp: iat + TOKEN_LIFETIME_SECS,
            jti: uuid::Uuid::new_v4().simple().to_string(),
        };
        sign_fed_token(&claims, &self.key)
    }
}
