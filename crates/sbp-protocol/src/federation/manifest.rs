//! The `/.well-known/sbp` manifest: who a node is (id, role, key, previous keys), where its
//! federation endpoints are, signed by its key; and the one check of a received manifest against a
//! pinned key (following a rotation through `old_signature`) or against itself alone.

use chrono::{DateTime, Duration, Utc};
use serde_json::{Map, Value};

use super::fields::{FieldError, Fields, write_time};
use super::keys::{IdentityKey, KeyError, PublicKey};
use super::signed::{self, SignedError};

/// The longest a manifest may stay valid ahead of the verifier's clock (7 days).
pub const MAX_MANIFEST_VALIDITY_SECS: i64 = 7 * 86_400;
/// The clock difference tolerated between nodes.
const SKEW_SECS: i64 = 60;

/// What a node does in the federation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Hosts sessions and bundles.
    Gateway,
    /// Keeps the registry of bundle providers.
    Tracker,
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gateway => "gateway",
            Self::Tracker => "tracker",
            Self::Both => "both",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "gateway" => Some(Self::Gateway),
            "tracker" => Some(Self::Tracker),
            "both" => Some(Self::Both),
            _ => None,
        }
    }

    /// Serves sessions, bundles and the WebSocket.
    pub fn hosts_sessions(self) -> bool {
        matches!(self, Self::Gateway | Self::Both)
    }

    /// Serves the registry.
    pub fn hosts_registry(self) -> bool {
        matches!(self, Self::Tracker | Self::Both)
    }
}

/// The URLs (templates with `{session_id}` / `{bundle_cid}`) a node serves, by role.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoints {
    pub ws: Option<String>,
    pub export: Option<String>,
    pub import: Option<String>,
    pub bundle: Option<String>,
    pub registry: Option<String>,
}

impl Endpoints {
    /// The endpoints of `role` under `base_url` (`https://host:8443/prefix`; a trailing `/` is
    /// ignored). The WebSocket URL takes the matching scheme (`https` → `wss`, `http` → `ws`).
    pub fn for_role(role: Role, base_url: &str) -> Self {
        let base = base_url.trim_end_matches('/');
        let ws_base = if let Some(rest) = base.strip_prefix("https://") {
            format!("wss://{rest}")
        } else if let Some(rest) = base.strip_prefix("http://") {
            format!("ws://{rest}")
        } else {
            base.to_owned()
        };
        let sessions = role.hosts_sessions();
        let at = |path: &str| sessions.then(|| format!("{base}{path}"));
        Self {
            ws: sessions.then(|| format!("{ws_base}/v1/sbp/ws/{{session_id}}")),
            export: at("/v1/sbp/sessions/{session_id}/export"),
            import: at("/v1/sbp/sessions/import"),
            bundle: at("/v1/sbp/bundles/{bundle_cid}"),
            registry: role
                .hosts_registry()
                .then(|| format!("{base}/v1/sbp/registry")),
        }
    }

    fn entries(&self) -> [(&'static str, &Option<String>); 5] {
        [
            ("ws", &self.ws),
            ("export", &self.export),
            ("import", &self.import),
            ("bundle", &self.bundle),
            ("registry", &self.registry),
        ]
    }

    /// The object, with only the endpoints present.
    pub fn to_map(&self) -> Map<String, Value> {
        self.entries()
            .into_iter()
            .filter_map(|(name, url)| {
                url.as_ref()
                    .map(|u| (name.to_owned(), Value::from(u.as_str())))
            })
            .collect()
    }

    fn read(f: &Fields<'_>) -> Result<Self, FieldError> {
        Ok(Self {
            ws: f.optional_text("ws")?,
            export: f.optional_text("export")?,
            import: f.optional_text("import")?,
            bundle: f.optional_text("bundle")?,
            registry: f.optional_text("registry")?,
        })
    }
}

/// A previous key, still valid for verifying until `expires_at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OldKey {
    pub key_id: String,
    /// Standard base64 of its SPKI DER, as `Manifest::public_key`.
    pub public_key: String,
    pub expires_at: DateTime<Utc>,
}

/// The manifest's content (the signatures travel in the JSON only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub sbp_version: String,
    pub gateway_id: String,
    pub gateway_name: String,
    pub role: Role,
    pub public_key: String,
    pub key_id: String,
    pub old_keys: Vec<OldKey>,
    pub issued_at: DateTime<Utc>,
    pub valid_until: DateTime<Utc>,
    pub endpoints: Endpoints,
}

/// Why a manifest was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest field {0}")]
    Field(#[from] FieldError),
    #[error("manifest is not a federation manifest (`federation` is not true)")]
    NotFederation,
    #[error("manifest `role` {0:?} is not gateway, tracker or both")]
    Role(String),
    #[error("manifest `{field}`: {error}")]
    Key {
        field: String,
        #[source]
        error: KeyError,
    },
    /// A `key_id` is not the id of the key beside it.
    #[error("manifest `{0}` does not match its public key")]
    KeyId(String),
    #[error("manifest signature: {0}")]
    Signature(#[source] SignedError),
    #[error("manifest expired at {0}")]
    Expired(DateTime<Utc>),
    #[error("manifest valid until {0}, more than 7 days ahead")]
    TooLong(DateTime<Utc>),
    #[error("manifest issued in the future ({0})")]
    IssuedInFuture(DateTime<Utc>),
    /// Signed, but not by the pinned key nor rotated away from it by a valid `old_signature`.
    #[error("manifest is not signed by the trusted key")]
    Untrusted,
}

impl Manifest {
    /// The JSON document with `federation: true`, signed by `key` (`signature`) and, when `old` is
    /// given, `old_signature` by it over the same bytes.
    /// Times are written to the second. `key` must be the key `public_key` names.
    pub fn to_signed_map(
        &self,
        key: &IdentityKey,
        old: Option<&IdentityKey>,
    ) -> Map<String, Value> {
        let old_keys = self
            .old_keys
            .iter()
            .map(|k| {
                let mut m = Map::new();
                m.insert("key_id".into(), Value::from(k.key_id.as_str()));
                m.insert("public_key".into(), Value::from(k.public_key.as_str()));
                m.insert("expires_at".into(), write_time(&k.expires_at));
                Value::Object(m)
            })
            .collect();
        let mut obj = Map::new();
        obj.insert("sbp_version".into(), Value::from(self.sbp_version.as_str()));
        obj.insert("gateway_id".into(), Value::from(self.gateway_id.as_str()));
        obj.insert(
            "gateway_name".into(),
            Value::from(self.gateway_name.as_str()),
        );
        obj.insert("role".into(), Value::from(self.role.as_str()));
        obj.insert("federation".into(), Value::Bool(true));
        obj.insert("public_key".into(), Value::from(self.public_key.as_str()));
        obj.insert("key_id".into(), Value::from(self.key_id.as_str()));
        obj.insert("old_keys".into(), Value::Array(old_keys));
        obj.insert("issued_at".into(), write_time(&self.issued_at));
        obj.insert("valid_until".into(), write_time(&self.valid_until));
        obj.insert("endpoints".into(), Value::Object(self.endpoints.to_map()));
        signed::sign_object(&mut obj, key);
        if let Some(old) = old {
            signed::add_old_signature(&mut obj, old);
        }
        obj
    }

    /// Reads the fields, typed; `federation` must be `true`. Checks no signature (see
    /// [`verify_manifest`]). An absent `old_keys` is read as none.
    pub fn read(obj: &Map<String, Value>) -> Result<Manifest, ManifestError> {
        let f = Fields::new(obj);
        if !f.bool("federation")? {
            return Err(ManifestError::NotFederation);
        }
        let role_text = f.string("role")?;
        let role = Role::parse(&role_text).ok_or(ManifestError::Role(role_text))?;
        let old_keys = match f.get("old_keys") {
            None => Vec::new(),
            Some(_) => f
                .objects("old_keys")?
                .into_iter()
                .map(|k| {
                    Ok(OldKey {
                        key_id: k.text("key_id")?,
                        public_key: k.text("public_key")?,
                        expires_at: k.time("expires_at")?,
                    })
                })
                .collect::<Result<_, FieldError>>()?,
        };
        let endpoints = Endpoints::read(&Fields::nested(
            f.object("endpoints")?,
            "endpoints.".to_owned(),
        ))?;
        Ok(Manifest {
            sbp_version: f.text("sbp_version")?,
            gateway_id: f.text("gateway_id")?,
            gateway_name: f.string("gateway_name")?,
            role,
            public_key: f.text("public_key")?,
            key_id: f.text("key_id")?,
            old_keys,
            issued_at: f.time("issued_at")?,
            valid_until: f.time("valid_until")?,
            endpoints,
        })
    }
}

/// What a received manifest is checked against.
#[derive(Clone, Copy, Debug)]
pub enum ManifestTrust<'a> {
    /// The key pinned for this peer (config, a tracker's vouch, or first use).
    Pinned(&'a PublicKey),
    /// Only its own signature: what the manifest claims, trusted for nothing yet.
    SelfSigned,
}

/// A manifest that passed [`verify_manifest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedManifest {
    pub manifest: Manifest,
    /// The current key (`public_key`).
    pub key: PublicKey,
    /// The current key plus the old keys still unexpired at `now`, by key id: the keys a token's
    /// `kid` may name.
    pub valid_keys: Vec<(String, PublicKey)>,
    /// `Some(pinned key)` when the manifest moved away from the pinned key by a valid `old_signature`.
    pub rotated_from: Option<PublicKey>,
}

fn key_at(field: String, b64: &str) -> Result<PublicKey, ManifestError> {
    PublicKey::from_b64_spki(b64).map_err(|error| ManifestError::Key { field, error })
}

/// Checks a received manifest at `now`: `federation` true, every field typed, `key_id` the id of
/// `public_key`, `signature` valid by `public_key`, `issued_at <= now + 60 s`, `now < valid_until <=
/// now + 7 days + 60 s`. Each old key must be well formed, and counts only while `expires_at > now`.
///
/// Under [`ManifestTrust::Pinned`] the manifest's key must be the pin, or the pin must be one of its
/// unexpired old keys with `old_signature` valid by it (a rotation: `rotated_from` is the pin);
/// anything else is [`ManifestError::Untrusted`].
pub fn verify_manifest(
    obj: &Map<String, Value>,
    trust: ManifestTrust<'_>,
    now: DateTime<Utc>,
) -> Result<VerifiedManifest, ManifestError> {
    let manifest = Manifest::read(obj)?;
    let key = key_at("public_key".into(), &manifest.public_key)?;
    if key.key_id() != manifest.key_id {
        return Err(ManifestError::KeyId("key_id".into()));
    }
    signed::verify_object(obj, &key).map_err(ManifestError::Signature)?;

    let skew = Duration::seconds(SKEW_SECS);
    if manifest.issued_at > now + skew {
        return Err(ManifestError::IssuedInFuture(manifest.issued_at));
    }
    if manifest.valid_until <= now {
        return Err(ManifestError::Expired(manifest.valid_until));
    }
    if manifest.valid_until - now > Duration::seconds(MAX_MANIFEST_VALIDITY_SECS) + skew {
        return Err(ManifestError::TooLong(manifest.valid_until));
    }

    let mut valid_keys = vec![(manifest.key_id.clone(), key.clone())];
    let mut live_old_keys = Vec::new();
    for (i, old) in manifest.old_keys.iter().enumerate() {
        let old_key = key_at(format!("old_keys[{i}].public_key"), &old.public_key)?;
        if old_key.key_id() != old.key_id {
            return Err(ManifestError::KeyId(format!("old_keys[{i}].key_id")));
        }
        // A key past its expiry verifies nothing: not a token, not a rotation.
        if old.expires_at > now {
            valid_keys.push((old.key_id.clone(), old_key.clone()));
            live_old_keys.push(old_key);
        }
    }

    let rotated_from = match trust {
        ManifestTrust::SelfSigned => None,
        ManifestTrust::Pinned(pin) if *pin == key => None,
        ManifestTrust::Pinned(pin) => {
            let listed = live_old_keys.iter().any(|k| k == pin);
            if !listed || signed::verify_old_signature(obj, pin).is_err() {
                return Err(ManifestError::Untrusted);
            }
            Some(pin.clone())
        }
    };
    Ok(VerifiedManifest {
        manifest,
        key,
        valid_keys,
        rotated_from,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn key(n: u8) -> IdentityKey {
        IdentityKey::from_seed([n; 32])
    }

    /// A manifest of `current`, with `old` listed as an old key expiring at `old_expires`.
    fn manifest(current: &IdentityKey, old: Option<(&IdentityKey, DateTime<Utc>)>) -> Manifest {
        let first = old.map_or(current, |(k, _)| k);
        Manifest {
            sbp_version: "1.2".into(),
            gateway_id: first.public_key().derive_gateway_id(),
            gateway_name: "Gateway A".into(),
            role: Role::Both,
            public_key: current.public_key().to_b64_spki(),
            key_id: current.key_id(),
            old_keys: old
                .map(|(k, expires_at)| OldKey {
                    key_id: k.key_id(),
                    public_key: k.public_key().to_b64_spki(),
                    expires_at,
                })
                .into_iter()
                .collect(),
            issued_at: now() - Duration::seconds(10),
            valid_until: now() + Duration::hours(24),
            endpoints: Endpoints::for_role(Role::Both, "https://a.example:8443/sbp"),
        }
    }

    fn resign(obj: &mut Map<String, Value>, key: &IdentityKey) {
        signed::sign_object(obj, key);
    }

    #[test]
    fn role_names() {
        for role in [Role::Gateway, Role::Tracker, Role::Both] {
            assert_eq!(Role::parse(role.as_str()), Some(role));
        }
        assert_eq!(Role::parse("Gateway"), None);
        assert!(Role::Gateway.hosts_sessions() && !Role::Gateway.hosts_registry());
        assert!(!Role::Tracker.hosts_sessions() && Role::Tracker.hosts_registry());
        assert!(Role::Both.hosts_sessions() && Role::Both.hosts_registry());
    }

    #[test]
    fn endpoints_by_role() {
        let both = Endpoints::for_role(Role::Both, "https://h:8443/prefix/");
        assert_eq!(
            both.ws.as_deref(),
            Some("wss://h:8443/prefix/v1/sbp/ws/{session_id}")
        );
        assert_eq!(
            both.export.as_deref(),
            Some("https://h:8443/prefix/v1/sbp/sessions/{session_id}/export")
        );
        assert_eq!(
            both.import.as_deref(),
            Some("https://h:8443/prefix/v1/sbp/sessions/import")
        );
        assert_eq!(
            both.bundle.as_deref(),
            Some("https://h:8443/prefix/v1/sbp/bundles/{bundle_cid}")
        );
        assert_eq!(
            both.registry.as_deref(),
            Some("https://h:8443/prefix/v1/sbp/registry")
        );

        let gateway = Endpoints::for_role(Role::Gateway, "http://127.0.0.1:9000");
        assert_eq!(
            gateway.ws.as_deref(),
            Some("ws://127.0.0.1:9000/v1/sbp/ws/{session_id}")
        );
        assert_eq!(gateway.registry, None);
        assert_eq!(
            gateway.to_map().keys().collect::<Vec<_>>(),
            ["bundle", "export", "import", "ws"]
        );

        let tracker = Endpoints::for_role(Role::Tracker, "https://t");
        assert_eq!(
            tracker,
            Endpoints {
                registry: Some("https://t/v1/sbp/registry".into()),
                ..Endpoints::default()
            }
        );
    }

    #[test]
    fn signed_map_reads_back_and_verifies() {
        let k = key(1);
        let m = manifest(&k, None);
        let obj = k.public_key();
        let map = m.to_signed_map(&k, None);
        assert_eq!(map["federation"], json!(true));
        assert_eq!(map["valid_until"], json!("2027-01-16T08:00:00Z"));
        assert!(!map.contains_key("old_signature"));
        assert_eq!(Manifest::read(&map).unwrap(), m);
        for trust in [ManifestTrust::Pinned(&obj), ManifestTrust::SelfSigned] {
            let v = verify_manifest(&map, trust, now()).unwrap();
            assert_eq!(v.manifest, m);
            assert_eq!(v.key, obj);
            assert_eq!(v.valid_keys, vec![(k.key_id(), obj.clone())]);
            assert_eq!(v.rotated_from, None);
        }
        // Through text, as a peer receives it.
        let text = serde_json::to_string_pretty(&map).unwrap();
        let received: Map<String, Value> = serde_json::from_str(&text).unwrap();
        assert!(verify_manifest(&received, ManifestTrust::Pinned(&obj), now()).is_ok());
    }

    #[test]
    fn unsigned_is_refused() {
        let k = key(1);
        let mut map = manifest(&k, None).to_signed_map(&k, None);
        map.remove("signature");
        assert_eq!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::Signature(SignedError::Missing("signature")))
        );
    }

    #[test]
    fn signature_by_another_key_is_refused() {
        let k = key(1);
        let mut map = manifest(&k, None).to_signed_map(&k, None);
        resign(&mut map, &key(2));
        assert_eq!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::Signature(SignedError::Invalid("signature")))
        );
    }

    #[test]
    fn wrong_key_id_is_refused() {
        let k = key(1);
        let mut m = manifest(&k, None);
        m.key_id = key(2).key_id();
        let map = m.to_signed_map(&k, None);
        assert_eq!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::KeyId("key_id".into()))
        );
    }

    #[test]
    fn expired_is_refused() {
        let k = key(1);
        let mut m = manifest(&k, None);
        m.issued_at = now() - Duration::hours(25);
        m.valid_until = now();
        let map = m.to_signed_map(&k, None);
        assert_eq!(
            verify_manifest(&map, ManifestTrust::Pinned(&k.public_key()), now()),
            Err(ManifestError::Expired(now()))
        );
        assert!(
            verify_manifest(
                &map,
                ManifestTrust::SelfSigned,
                now() - Duration::seconds(1)
            )
            .is_ok()
        );
    }

    #[test]
    fn validity_beyond_seven_days_is_refused() {
        let k = key(1);
        let mut m = manifest(&k, None);
        let limit = now() + Duration::seconds(MAX_MANIFEST_VALIDITY_SECS + SKEW_SECS);
        m.valid_until = limit;
        assert!(
            verify_manifest(&m.to_signed_map(&k, None), ManifestTrust::SelfSigned, now()).is_ok()
        );
        m.valid_until = limit + Duration::seconds(1);
        assert_eq!(
            verify_manifest(&m.to_signed_map(&k, None), ManifestTrust::SelfSigned, now()),
            Err(ManifestError::TooLong(m.valid_until))
        );
    }

    #[test]
    fn issued_in_the_future_is_refused() {
        let k = key(1);
        let mut m = manifest(&k, None);
        m.issued_at = now() + Duration::seconds(60);
        assert!(
            verify_manifest(&m.to_signed_map(&k, None), ManifestTrust::SelfSigned, now()).is_ok()
        );
        m.issued_at = now() + Duration::seconds(61);
        assert_eq!(
            verify_manifest(&m.to_signed_map(&k, None), ManifestTrust::SelfSigned, now()),
            Err(ManifestError::IssuedInFuture(m.issued_at))
        );
    }

    #[test]
    fn federation_false_or_missing_is_refused() {
        let k = key(1);
        let mut map = manifest(&k, None).to_signed_map(&k, None);
        map.insert("federation".into(), json!(false));
        resign(&mut map, &k);
        assert_eq!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::NotFederation)
        );
        map.remove("federation");
        resign(&mut map, &k);
        assert_eq!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::Field(FieldError::new(
                "federation",
                "is missing"
            )))
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let k = key(1);
        let base = manifest(&k, Some((&key(2), now() + Duration::days(1)))).to_signed_map(&k, None);
        for (field, value, want) in [
            (
                "role",
                json!("mirror"),
                ManifestError::Role("mirror".into()),
            ),
            (
                "valid_until",
                json!("tomorrow"),
                FieldError::new("valid_until", "must be an RFC 3339 time").into(),
            ),
            (
                "old_keys",
                json!([{"key_id": "x", "public_key": "y"}]),
                FieldError::new("old_keys[0].expires_at", "is missing").into(),
            ),
            (
                "endpoints",
                json!({"ws": 3}),
                FieldError::new("endpoints.ws", "must be a string").into(),
            ),
            (
                "gateway_id",
                json!(""),
                FieldError::new("gateway_id", "must not be empty").into(),
            ),
        ] {
            let mut map = base.clone();
            map.insert(field.into(), value);
            assert_eq!(Manifest::read(&map), Err(want), "{field}");
        }
        let mut map = base.clone();
        map.insert("public_key".into(), json!("AAAA"));
        assert!(matches!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::Key { field, .. }) if field == "public_key"
        ));
        // An old key whose id is not its key's.
        let mut map = base.clone();
        map["old_keys"][0]["key_id"] = json!(key(3).key_id());
        resign(&mut map, &k);
        assert_eq!(
            verify_manifest(&map, ManifestTrust::SelfSigned, now()),
            Err(ManifestError::KeyId("old_keys[0].key_id".into()))
        );
    }

    #[test]
    fn pinned_key_other_than_the_manifests_is_untrusted() {
        let k = key(1);
        let map = manifest(&k, None).to_signed_map(&k, None);
        assert_eq!(
            verify_manifest(&map, ManifestTrust::Pinned(&key(2).public_key()), now()),
            Err(ManifestError::Untrusted)
        );
    }

    #[test]
    fn rotation_is_followed_through_old_signature() {
        let (old, new) = (key(1), key(2));
        let expires = now() + Duration::days(7);
        let m = manifest(&new, Some((&old, expires)));
        let map = m.to_signed_map(&new, Some(&old));
        let pin = old.public_key();
        let v = verify_manifest(&map, ManifestTrust::Pinned(&pin), now()).unwrap();
        assert_eq!(v.key, new.public_key());
        assert_eq!(v.rotated_from, Some(pin.clone()));
        assert_eq!(
            v.valid_keys,
            vec![
                (new.key_id(), new.public_key()),
                (old.key_id(), pin.clone())
            ]
        );
        // gateway_id stays the first key's.
        assert_eq!(v.manifest.gateway_id, old.public_key().derive_gateway_id());
        // A peer that already pinned the new key sees no rotation.
        let v = verify_manifest(&map, ManifestTrust::Pinned(&new.public_key()), now()).unwrap();
        assert_eq!(v.rotated_from, None);
        // URL-safe form of the old key in old_keys still matches the pin.
        let mut url_safe = m.clone();
        url_safe.old_keys[0].public_key = pin.to_b64_spki().replace('+', "-").replace('/', "_");
        let map = url_safe.to_signed_map(&new, Some(&old));
        assert!(verify_manifest(&map, ManifestTrust::Pinned(&pin), now()).is_ok());
    }

    #[test]
    fn rotation_from_an_expired_old_key_is_refused() {
        let (old, new) = (key(1), key(2));
        let m = manifest(&new, Some((&old, now())));
        let map = m.to_signed_map(&new, Some(&old));
        assert_eq!(
            verify_manifest(&map, ManifestTrust::Pinned(&old.public_key()), now()),
            Err(ManifestError::Untrusted)
        );
        // Self-signed, the expired old key is not among the valid keys.
        let v = verify_manifest(&map, ManifestTrust::SelfSigned, now()).unwrap();
        assert_eq!(v.valid_keys, vec![(new.key_id(), new.public_key())]);
        // One second earlier it was still good.
        let earlier = now() - Duration::seconds(1);
        assert!(verify_manifest(&map, ManifestTrust::Pinned(&old.public_key()), earlier).is_ok());
    }

    #[test]
    fn rotation_without_or_with_a_bad_old_signature_is_refused() {
        let (old, new) = (key(1), key(2));
        let m = manifest(&new, Some((&old, now() + Duration::days(1))));
        let pin = old.public_key();
        let unsigned = m.to_signed_map(&new, None);
        assert_eq!(
            verify_manifest(&unsigned, ManifestTrust::Pinned(&pin), now()),
            Err(ManifestError::Untrusted)
        );
        // old_signature by a third key.
        let wrong = m.to_signed_map(&new, Some(&key(3)));
        assert_eq!(
            verify_manifest(&wrong, ManifestTrust::Pinned(&pin), now()),
            Err(ManifestError::Untrusted)
        );
        // A valid old_signature, but the pinned key is not listed in old_keys.
        let mut unlisted = m.clone();
        unlisted.old_keys.clear();
        let map = unlisted.to_signed_map(&new, Some(&old));
        assert_eq!(
            verify_manifest(&map, ManifestTrust::Pinned(&pin), now()),
            Err(ManifestError::Untrusted)
        );
        // old_signature copied from another document by the old key.
        let mut copied = m.to_signed_map(&new, None);
        let other = manifest(&old, None).to_signed_map(&new, Some(&old));
        copied.insert("old_signature".into(), other["old_signature"].clone());
        assert_eq!(
            verify_manifest(&copied, ManifestTrust::Pinned(&pin), now()),
            Err(ManifestError::Untrusted)
        );
    }
}
