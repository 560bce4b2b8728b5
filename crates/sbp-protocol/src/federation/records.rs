//! The signed documents nodes exchange besides the manifest: a gateway's provider record for a
//! bundle, a tracker's answer and its vouch for a gateway, and the handover of a session between
//! gateways (envelope, commit) and a redeemed roaming token's answer.
//!
//! Each is a typed struct with `to_signed_map` (the JSON, signed by the writer's key, see
//! [`super::signed`]) and `read` (typed, errors name the field; the signature is the caller's to
//! check with [`super::signed::verify_object`] and the key it trusts for the writer). Times are RFC
//! 3339, written to the second.

use chrono::{DateTime, Duration, Utc};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::fields::{FieldError, Fields, write_time};
use super::keys::{IdentityKey, KeyError, PublicKey};
use super::signed;
pub use crate::bundle::is_cid;

/// The longest a provider record may live (24 h).
pub const MAX_RECORD_LIFETIME_SECS: i64 = 86_400;
/// The longest a tracker's answer may live (5 min).
pub const MAX_ANSWER_LIFETIME_SECS: i64 = 300;
/// The longest a tracker's vouch for a gateway may live (24 h): it is re-fetched, not kept.
pub const MAX_VOUCH_LIFETIME_SECS: i64 = 86_400;
/// The clock difference tolerated between nodes.
const SKEW_SECS: i64 = 60;

/// Why a record was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record field {0}")]
    Field(#[from] FieldError),
    #[error("`bundle_cid` is not 64 lowercase hex characters")]
    InvalidCid,
    /// The answer is for another CID than the one asked.
    #[error("answer is for bundle {got}, not the one asked")]
    OtherCid { got: String },
    #[error("`bundle_url` must be an http(s) URL ending with the bundle CID")]
    BundleUrl,
    #[error("`{field}`: {error}")]
    Key {
        field: &'static str,
        #[source]
        error: KeyError,
    },
    #[error("`key_id` does not match `public_key`")]
    KeyId,
    #[error("`{0}` is in the future")]
    InFuture(&'static str),
    #[error("expired")]
    Expired,
    #[error("lifetime is not within (0, {max_secs}] seconds")]
    Lifetime { max_secs: i64 },
    #[error("addressed to another gateway")]
    NotForUs,
}

fn object(entries: Vec<(&str, Value)>) -> Map<String, Value> {
    entries
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
}

fn signed_with(entries: Vec<(&str, Value)>, key: &IdentityKey) -> Map<String, Value> {
    let mut obj = object(entries);
    signed::sign_object(&mut obj, key);
    obj
}

fn s(text: &str) -> Value {
    Value::from(text)
}

fn uuid(id: &Uuid) -> Value {
    Value::from(id.to_string())
}

/// The freshness every record shares: issued not ahead of `now` (+ skew), not expired, and a
/// lifetime within `(0, max_secs]`.
fn check_times(
    issued_field: &'static str,
    issued_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    max_secs: i64,
    now: DateTime<Utc>,
) -> Result<(), RecordError> {
    if issued_at > now + Duration::seconds(SKEW_SECS) {
        return Err(RecordError::InFuture(issued_field));
    }
    if expires_at <= now {
        return Err(RecordError::Expired);
    }
    let lifetime = expires_at - issued_at;
    if lifetime <= Duration::zero() || lifetime > Duration::seconds(max_secs) {
        return Err(RecordError::Lifetime { max_secs });
    }
    Ok(())
}

/// A gateway's announcement that it serves a bundle, signed by that gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderRecord {
    pub gateway_id: String,
    pub bundle_cid: String,
    /// Where the bundle is fetched (`https://a.example/v1/sbp/bundles/<cid>`); its origin's manifest
    /// must be the announcing gateway's.
    pub bundle_url: String,
    /// Increases per gateway and CID; a lower one never replaces a higher one.
    pub seq: u64,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

impl ProviderRecord {
    pub fn to_signed_map(&self, key: &IdentityKey) -> Map<String, Value> {
        signed_with(
            vec![
                ("gateway_id", s(&self.gateway_id)),
                ("bundle_cid", s(&self.bundle_cid)),
                ("bundle_url", s(&self.bundle_url)),
                ("seq", Value::from(self.seq)),
                ("issued_at", write_time(&self.issued_at)),
                ("expires_at", write_time(&self.expires_at)),
            ],
            key,
        )
    }

    pub fn read(obj: &Map<String, Value>) -> Result<Self, RecordError> {
        let f = Fields::new(obj);
        Ok(Self {
            gateway_id: f.text("gateway_id")?,
            bundle_cid: f.text("bundle_cid")?,
            bundle_url: f.text("bundle_url")?,
            seq: f.u64("seq")?,
            issued_at: f.time("issued_at")?,
            expires_at: f.time("expires_at")?,
        })
    }

    /// `bundle_cid` 64 lowercase hex; `bundle_url` http(s) and ending with `/<cid>`; `issued_at <=
    /// now + 60 s`; `expires_at > now`; a lifetime of at most 24 h.
    pub fn check(&self, now: DateTime<Utc>) -> Result<(), RecordError> {
        if !is_cid(&self.bundle_cid) {
            return Err(RecordError::InvalidCid);
        }
        let scheme_ok = ["https://", "http://"]
            .iter()
            .any(|scheme| self.bundle_url.starts_with(scheme));
        let path_ok = self
            .bundle_url
            .strip_suffix(self.bundle_cid.as_str())
            .is_some_and(|head| head.ends_with('/'));
        if !scheme_ok || !path_ok {
            return Err(RecordError::BundleUrl);
        }
        check_times(
            "issued_at",
            self.issued_at,
            self.expires_at,
            MAX_RECORD_LIFETIME_SECS,
            now,
        )
    }
}

/// A tracker's answer to "who has this bundle", signed by the tracker. The providers are the
/// gateways' own signed records, verbatim: check each with its gateway's key, then
/// [`ProviderRecord::read`] and [`ProviderRecord::check`]. Hints only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryAnswer {
    pub tracker_id: String,
    pub bundle_cid: String,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub providers: Vec<Map<String, Value>>,
}

impl RegistryAnswer {
    pub fn to_signed_map(&self, key: &IdentityKey) -> Map<String, Value> {
        let providers = self.providers.iter().cloned().map(Value::Object).collect();
        signed_with(
            vec![
                ("tracker_id", s(&self.tracker_id)),
                ("bundle_cid", s(&self.bundle_cid)),
                ("issued_at", write_time(&self.issued_at)),
                ("expires_at", write_time(&self.expires_at)),
                ("providers", Value::Array(providers)),
            ],
            key,
        )
    }

    pub fn read(obj: &Map<String, Value>) -> Result<Self, RecordError> {
        let f = Fields::new(obj);
        Ok(Self {
            tracker_id: f.text("tracker_id")?,
            bundle_cid: f.text("bundle_cid")?,
            issued_at: f.time("issued_at")?,
            expires_at: f.time("expires_at")?,
            providers: f
                .objects("providers")?
                .into_iter()
                .map(|p| p.map().clone())
                .collect(),
        })
    }

    /// For the CID that was asked (exactly), fresh: `issued_at <= now + 60 s`, `expires_at > now`,
    /// a lifetime of at most 5 min.
    pub fn check(&self, asked_cid: &str, now: DateTime<Utc>) -> Result<(), RecordError> {
        if self.bundle_cid != asked_cid {
            return Err(RecordError::OtherCid {
                got: self.bundle_cid.clone(),
            });
        }
        check_times(
            "issued_at",
            self.issued_at,
            self.expires_at,
            MAX_ANSWER_LIFETIME_SECS,
            now,
        )
    }
}

/// What a tracker verified about a gateway (its manifest at its URL), signed by the tracker: a node
/// that pins the tracker may trust this key for that gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayVouch {
    pub tracker_id: String,
    pub gateway_id: String,
    pub gateway_url: String,
    /// Standard base64 of the gateway's SPKI DER.
    pub public_key: String,
    pub key_id: String,
    pub verified_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

impl GatewayVouch {
    pub fn to_signed_map(&self, key: &IdentityKey) -> Map<String, Value> {
        signed_with(
            vec![
                ("tracker_id", s(&self.tracker_id)),
                ("gateway_id", s(&self.gateway_id)),
                ("gateway_url", s(&self.gateway_url)),
                ("public_key", s(&self.public_key)),
                ("key_id", s(&self.key_id)),
                ("verified_at", write_time(&self.verified_at)),
                ("expires_at", write_time(&self.expires_at)),
            ],
            key,
        )
    }

    pub fn read(obj: &Map<String, Value>) -> Result<Self, RecordError> {
        let f = Fields::new(obj);
        Ok(Self {
            tracker_id: f.text("tracker_id")?,
            gateway_id: f.text("gateway_id")?,
            gateway_url: f.text("gateway_url")?,
            public_key: f.text("public_key")?,
            key_id: f.text("key_id")?,
            verified_at: f.time("verified_at")?,
            expires_at: f.time("expires_at")?,
        })
    }

    /// The vouched key, read.
    pub fn key(&self) -> Result<PublicKey, RecordError> {
        PublicKey::from_b64_spki(&self.public_key).map_err(|error| RecordError::Key {
            field: "public_key",
            error,
        })
    }

    /// The key is an Ed25519 SPKI whose id is `key_id`; `verified_at <= now + 60 s`; `expires_at >
    /// now`; a lifetime of at most 24 h.
    pub fn check(&self, now: DateTime<Utc>) -> Result<(), RecordError> {
        if self.key()?.key_id() != self.key_id {
            return Err(RecordError::KeyId);
        }
        check_times(
            "verified_at",
            self.verified_at,
            self.expires_at,
            MAX_VOUCH_LIFETIME_SECS,
            now,
        )
    }
}

/// One tether item handed over: its sequence number beside the stored item's JSON, as-is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoverTetherEntry {
    pub seq: u64,
    /// The stored item (role, content, chunk id, ...); a `seq` inside it is replaced by `seq`.
    pub entry: Map<String, Value>,
}

impl HandoverTetherEntry {
    fn to_value(&self) -> Value {
        let mut obj = self.entry.clone();
        obj.insert("seq".into(), Value::from(self.seq));
        Value::Object(obj)
    }

    fn read(f: &Fields<'_>) -> Result<Self, FieldError> {
        let seq = f.u64("seq")?;
        let mut entry = f.map().clone();
        entry.remove("seq");
        Ok(Self { seq, entry })
    }
}

/// The home gateway's grant of a session to the gateway its surface now talks to, signed by the
/// home gateway. It holds what the new holder needs beyond the bundle: the session's token hash,
/// the tether not yet delivered, and the lease within which it must commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoverEnvelope {
    pub session_id: Uuid,
    pub migration_id: Uuid,
    /// Increases with every move of the session; a holder refuses an epoch not above its own.
    pub epoch: u64,
    pub from_gateway: String,
    pub to_gateway: String,
    pub bundle_cid: String,
    pub token_hash: String,
    pub agent_id: Option<String>,
    pub tether: Vec<HandoverTetherEntry>,
    pub next_seq: u64,
    pub lease_expires_at: DateTime<Utc>,
    pub issued_at: DateTime<Utc>,
}

impl HandoverEnvelope {
    pub fn to_signed_map(&self, key: &IdentityKey) -> Map<String, Value> {
        let mut entries = vec![
            ("session_id", uuid(&self.session_id)),
            ("migration_id", uuid(&self.migration_id)),
            ("epoch", Value::from(self.epoch)),
            ("from_gateway", s(&self.from_gateway)),
            ("to_gateway", s(&self.to_gateway)),
            ("bundle_cid", s(&self.bundle_cid)),
            ("token_hash", s(&self.token_hash)),
            (
                "tether",
                Value::Array(
                    self.tether
                        .iter()
                        .map(HandoverTetherEntry::to_value)
                        .collect(),
                ),
            ),
            ("next_seq", Value::from(self.next_seq)),
            ("lease_expires_at", write_time(&self.lease_expires_at)),
            ("issued_at", write_time(&self.issued_at)),
        ];
        if let Some(agent_id) = &self.agent_id {
            entries.push(("agent_id", s(agent_id)));
        }
        signed_with(entries, key)
    }

    /// Reads the envelope; `agent_id` may be absent or `null`.
    pub fn read(obj: &Map<String, Value>) -> Result<Self, RecordError> {
        let f = Fields::new(obj);
        let tether = f
            .objects("tether")?
            .into_iter()
            .map(|item| HandoverTetherEntry::read(&item))
            .collect::<Result<_, FieldError>>()?;
        Ok(Self {
            session_id: f.uuid("session_id")?,
            migration_id: f.uuid("migration_id")?,
            epoch: f.u64("epoch")?,
            from_gateway: f.text("from_gateway")?,
            to_gateway: f.text("to_gateway")?,
            bundle_cid: f.text("bundle_cid")?,
            token_hash: f.text("token_hash")?,
            agent_id: f.optional_text("agent_id")?,
            tether,
            next_seq: f.u64("next_seq")?,
            lease_expires_at: f.time("lease_expires_at")?,
            issued_at: f.time("issued_at")?,
        })
    }

    /// Addressed to `own_gateway_id`, a valid CID, `issued_at <= now + 60 s` and the lease not over.
    /// The epoch and the ids against what the receiver holds are the receiver's to check.
    pub fn check(&self, own_gateway_id: &str, now: DateTime<Utc>) -> Result<(), RecordError> {
        if self.to_gateway != own_gateway_id {
            return Err(RecordError::NotForUs);
        }
        if !is_cid(&self.bundle_cid) {
            return Err(RecordError::InvalidCid);
        }
        if self.issued_at > now + Duration::seconds(SKEW_SECS) {
            return Err(RecordError::InFuture("issued_at"));
        }
        if self.lease_expires_at <= now {
            return Err(RecordError::Expired);
        }
        Ok(())
    }
}

/// The new holder's confirmation that it took the session over, signed by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoverCommit {
    pub session_id: Uuid,
    pub migration_id: Uuid,
    pub epoch: u64,
    /// `"committed"`.
    pub state: String,
}

impl HandoverCommit {
    /// The state a commit carries.
    pub const COMMITTED: &'static str = "committed";

    pub fn to_signed_map(&self, key: &IdentityKey) -> Map<String, Value> {
        signed_with(
            vec![
                ("session_id", uuid(&self.session_id)),
                ("migration_id", uuid(&self.migration_id)),
                ("epoch", Value::from(self.epoch)),
                ("state", s(&self.state)),
            ],
            key,
        )
    }

    pub fn read(obj: &Map<String, Value>) -> Result<Self, RecordError> {
        let f = Fields::new(obj);
        Ok(Self {
            session_id: f.uuid("session_id")?,
            migration_id: f.uuid("migration_id")?,
            epoch: f.u64("epoch")?,
            state: f.text("state")?,
        })
    }
}

/// The minting gateway's answer to a redeemed roaming token: the bundle to fetch, signed by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedeemAnswer {
    pub bundle_cid: String,
    pub export_id: Uuid,
    pub session_id: Uuid,
}

impl RedeemAnswer {
    pub fn to_signed_map(&self, key: &IdentityKey) -> Map<String, Value> {
        signed_with(
            vec![
                ("bundle_cid", s(&self.bundle_cid)),
                ("export_id", uuid(&self.export_id)),
                ("session_id", uuid(&self.session_id)),
            ],
            key,
        )
    }

    /// Reads the answer; `bundle_cid` must be a CID.
    pub fn read(obj: &Map<String, Value>) -> Result<Self, RecordError> {
        let f = Fields::new(obj);
        let bundle_cid = f.text("bundle_cid")?;
        if !is_cid(&bundle_cid) {
            return Err(RecordError::InvalidCid);
        }
        Ok(Self {
            bundle_cid,
            export_id: f.uuid("export_id")?,
            session_id: f.uuid("session_id")?,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use crate::federation::signed::{SignedError, verify_object};
    use serde_json::json;

    const CID: &str = "5f0c3e6b7f1d2a9c8e4b6a1d3f5e7c9b0a2d4f6e8c1b3a5d7f9e0c2b4a6d8f1e";

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn key(n: u8) -> IdentityKey {
        IdentityKey::from_seed([n; 32])
    }

    fn record() -> ProviderRecord {
        ProviderRecord {
            gateway_id: key(1).public_key().derive_gateway_id(),
            bundle_cid: CID.into(),
            bundle_url: format!("https://a.example/sbp/v1/sbp/bundles/{CID}"),
            seq: 7,
            issued_at: now(),
            expires_at: now() + Duration::hours(24),
        }
    }

    /// Through JSON text and back, as received.
    fn received(map: &Map<String, Value>) -> Map<String, Value> {
        serde_json::from_str(&serde_json::to_string(map).unwrap()).unwrap()
    }

    #[test]
    fn provider_record_round_trip() {
        let r = record();
        let map = received(&r.to_signed_map(&key(1)));
        assert_eq!(map["issued_at"], json!("2027-01-15T08:00:00Z"));
        assert_eq!(verify_object(&map, &key(1).public_key()), Ok(()));
        assert_eq!(
            verify_object(&map, &key(2).public_key()),
            Err(SignedError::Invalid("signature"))
        );
        let back = ProviderRecord::read(&map).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.check(now()), Ok(()));
    }

    #[test]
    fn provider_record_check() {
        type Change = fn(&mut ProviderRecord);
        let cases: [(Change, RecordError); 9] = [
            (
                |r| r.bundle_cid = CID.to_uppercase(),
                RecordError::InvalidCid,
            ),
            (|r| r.bundle_cid.truncate(63), RecordError::InvalidCid),
            (
                |r| r.bundle_url = format!("ftp://a/{CID}"),
                RecordError::BundleUrl,
            ),
            (
                |r| r.bundle_url = format!("https://a/x{CID}"),
                RecordError::BundleUrl,
            ),
            (
                |r| r.bundle_url = format!("https://a/{CID}/"),
                RecordError::BundleUrl,
            ),
            (
                |r| r.issued_at = now() + Duration::seconds(61),
                RecordError::InFuture("issued_at"),
            ),
            (|r| r.expires_at = now(), RecordError::Expired),
            (
                |r| r.expires_at = r.issued_at + Duration::seconds(MAX_RECORD_LIFETIME_SECS + 1),
                RecordError::Lifetime {
                    max_secs: MAX_RECORD_LIFETIME_SECS,
                },
            ),
            (
                |r| {
                    r.issued_at = now() + Duration::seconds(30);
                    r.expires_at = now() + Duration::seconds(10);
                },
                RecordError::Lifetime {
                    max_secs: MAX_RECORD_LIFETIME_SECS,
                },
            ),
        ];
        for (i, (change, want)) in cases.into_iter().enumerate() {
            let mut r = record();
            change(&mut r);
            assert_eq!(r.check(now()), Err(want), "case {i}");
        }
        let mut r = record();
        r.bundle_url = format!("http://127.0.0.1:9000/v1/sbp/bundles/{CID}");
        r.issued_at = now() + Duration::seconds(60);
        assert_eq!(r.check(now()), Ok(()));
    }

    #[test]
    fn provider_record_bad_fields_are_named() {
        let map = record().to_signed_map(&key(1));
        for (field, value, reason) in [
            ("seq", json!(-1), "must be a non-negative integer"),
            ("seq", json!("7"), "must be a non-negative integer"),
            ("issued_at", json!(1_800_000_000), "must be a string"),
            (
                "expires_at",
                json!("2027-01-15 08:00:00"),
                "must be an RFC 3339 time",
            ),
            ("gateway_id", json!(""), "must not be empty"),
        ] {
            let mut m = map.clone();
            m.insert(field.into(), value);
            assert_eq!(
                ProviderRecord::read(&m),
                Err(RecordError::Field(FieldError::new(field, reason))),
                "{field}"
            );
        }
        let mut m = map.clone();
        m.remove("bundle_url");
        assert_eq!(
            ProviderRecord::read(&m),
            Err(RecordError::Field(FieldError::new(
                "bundle_url",
                "is missing"
            )))
        );
    }

    fn answer() -> RegistryAnswer {
        RegistryAnswer {
            tracker_id: key(9).public_key().derive_gateway_id(),
            bundle_cid: CID.into(),
            issued_at: now(),
            expires_at: now() + Duration::seconds(300),
            providers: vec![record().to_signed_map(&key(1))],
        }
    }

    #[test]
    fn registry_answer_round_trip_keeps_the_providers_records_verbatim() {
        let a = answer();
        let map = received(&a.to_signed_map(&key(9)));
        assert_eq!(verify_object(&map, &key(9).public_key()), Ok(()));
        let back = RegistryAnswer::read(&map).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.check(CID, now()), Ok(()));
        // Each provider's record still verifies under its own gateway's key.
        assert_eq!(
            verify_object(&back.providers[0], &key(1).public_key()),
            Ok(())
        );
        assert_eq!(ProviderRecord::read(&back.providers[0]).unwrap(), record());
    }

    #[test]
    fn registry_answer_check() {
        let other = "0".repeat(64);
        assert_eq!(
            answer().check(&other, now()),
            Err(RecordError::OtherCid { got: CID.into() })
        );
        let mut a = answer();
        a.expires_at = now() + Duration::seconds(301);
        assert_eq!(
            a.check(CID, now()),
            Err(RecordError::Lifetime {
                max_secs: MAX_ANSWER_LIFETIME_SECS
            })
        );
        let mut a = answer();
        a.issued_at = now() - Duration::seconds(300);
        a.expires_at = now();
        assert_eq!(a.check(CID, now()), Err(RecordError::Expired));
        let mut map = answer().to_signed_map(&key(9));
        map.insert("providers".into(), json!([{"a": 1}, "x"]));
        assert_eq!(
            RegistryAnswer::read(&map),
            Err(RecordError::Field(FieldError::new(
                "providers[1]",
                "must be an object"
            )))
        );
    }

    fn vouch() -> GatewayVouch {
        let g = key(1).public_key();
        GatewayVouch {
            tracker_id: key(9).public_key().derive_gateway_id(),
            gateway_id: g.derive_gateway_id(),
            gateway_url: "https://a.example".into(),
            public_key: g.to_b64_spki(),
            key_id: g.key_id(),
            verified_at: now(),
            expires_at: now() + Duration::hours(1),
        }
    }

    #[test]
    fn gateway_vouch_round_trip_and_check() {
        let v = vouch();
        let map = received(&v.to_signed_map(&key(9)));
        assert_eq!(verify_object(&map, &key(9).public_key()), Ok(()));
        let back = GatewayVouch::read(&map).unwrap();
        assert_eq!(back, v);
        assert_eq!(back.check(now()), Ok(()));
        assert_eq!(back.key().unwrap(), key(1).public_key());

        let mut v = vouch();
        v.key_id = key(2).key_id();
        assert_eq!(v.check(now()), Err(RecordError::KeyId));
        let mut v = vouch();
        v.public_key = "AAAA".into();
        assert!(matches!(
            v.check(now()),
            Err(RecordError::Key {
                field: "public_key",
                ..
            })
        ));
        let mut v = vouch();
        v.expires_at = now();
        assert_eq!(v.check(now()), Err(RecordError::Expired));
        let mut v = vouch();
        v.verified_at = now() + Duration::seconds(61);
        v.expires_at = now() + Duration::hours(1);
        assert_eq!(v.check(now()), Err(RecordError::InFuture("verified_at")));
        let mut v = vouch();
        v.expires_at = now() + Duration::seconds(MAX_VOUCH_LIFETIME_SECS + 1);
        assert_eq!(
            v.check(now()),
            Err(RecordError::Lifetime {
                max_secs: MAX_VOUCH_LIFETIME_SECS
            })
        );
    }

    fn envelope() -> HandoverEnvelope {
        let Value::Object(entry) = json!({
            "role": "assistant", "content": "Hello 東京", "model_used": "m",
            "created_at": "2027-01-15T07:59:00.000Z", "chunk_id": "c1"
        }) else {
            unreachable!()
        };
        HandoverEnvelope {
            session_id: Uuid::from_u128(1),
            migration_id: Uuid::from_u128(2),
            epoch: 3,
            from_gateway: "a".repeat(32),
            to_gateway: "b".repeat(32),
            bundle_cid: CID.into(),
            token_hash: "f".repeat(64),
            agent_id: Some("travel".into()),
            tether: vec![HandoverTetherEntry { seq: 41, entry }],
            next_seq: 42,
            lease_expires_at: now() + Duration::seconds(30),
            issued_at: now(),
        }
    }

    #[test]
    fn handover_envelope_round_trip() {
        let e = envelope();
        let map = received(&e.to_signed_map(&key(1)));
        assert_eq!(map["tether"][0]["seq"], json!(41));
        assert_eq!(map["tether"][0]["content"], json!("Hello 東京"));
        assert_eq!(verify_object(&map, &key(1).public_key()), Ok(()));
        let back = HandoverEnvelope::read(&map).unwrap();
        assert_eq!(back, e);
        assert_eq!(back.check(&"b".repeat(32), now()), Ok(()));

        let mut no_agent = envelope();
        no_agent.agent_id = None;
        let map = no_agent.to_signed_map(&key(1));
        assert!(!map.contains_key("agent_id"));
        assert_eq!(HandoverEnvelope::read(&map).unwrap(), no_agent);
        let mut null_agent = map.clone();
        null_agent.insert("agent_id".into(), Value::Null);
        assert_eq!(HandoverEnvelope::read(&null_agent).unwrap(), no_agent);
    }

    #[test]
    fn handover_envelope_check_and_fields() {
        let e = envelope();
        assert_eq!(e.check(&"a".repeat(32), now()), Err(RecordError::NotForUs));
        assert_eq!(
            e.check(&"b".repeat(32), now() + Duration::seconds(30)),
            Err(RecordError::Expired)
        );
        let mut bad = envelope();
        bad.bundle_cid = "x".into();
        assert_eq!(
            bad.check(&"b".repeat(32), now()),
            Err(RecordError::InvalidCid)
        );

        let map = e.to_signed_map(&key(1));
        let mut m = map.clone();
        m["tether"][0].as_object_mut().unwrap().remove("seq");
        assert_eq!(
            HandoverEnvelope::read(&m),
            Err(RecordError::Field(FieldError::new(
                "tether[0].seq",
                "is missing"
            )))
        );
        let mut m = map.clone();
        m.insert("session_id".into(), json!("not-a-uuid"));
        assert_eq!(
            HandoverEnvelope::read(&m),
            Err(RecordError::Field(FieldError::new(
                "session_id",
                "must be a lower-case hyphenated UUID"
            )))
        );
    }

    #[test]
    fn commit_and_redeem_round_trip() {
        let c = HandoverCommit {
            session_id: Uuid::from_u128(1),
            migration_id: Uuid::from_u128(2),
            epoch: 3,
            state: HandoverCommit::COMMITTED.into(),
        };
        let map = received(&c.to_signed_map(&key(2)));
        assert_eq!(verify_object(&map, &key(2).public_key()), Ok(()));
        assert_eq!(HandoverCommit::read(&map).unwrap(), c);

        let r = RedeemAnswer {
            bundle_cid: CID.into(),
            export_id: Uuid::from_u128(5),
            session_id: Uuid::from_u128(6),
        };
        let map = received(&r.to_signed_map(&key(1)));
        assert_eq!(
            map["export_id"],
            json!("00000000-0000-0000-0000-000000000005")
        );
        assert_eq!(verify_object(&map, &key(1).public_key()), Ok(()));
        assert_eq!(RedeemAnswer::read(&map).unwrap(), r);
        let mut m = map.clone();
        m.insert("bundle_cid".into(), json!(CID.to_uppercase()));
        assert_eq!(RedeemAnswer::read(&m), Err(RecordError::InvalidCid));
    }
}
