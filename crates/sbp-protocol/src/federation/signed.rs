//! Signed JSON: an object carries its own Ed25519 signature inline.
//!
//! The signed bytes are the object without `signature` and `old_signature`, serialised as the
//! bundle CID is ([`crate::canonical`], Python's `json.dumps(obj, sort_keys=True)`), so a verifier
//! re-canonicalises what it parsed and the sender's key order and whitespace do not matter. The
//! signature is standard base64. `old_signature` is a second signature over the same bytes by a
//! node's previous key, which lets peers that pinned that key follow a rotation.

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use serde_json::{Map, Value};

use super::keys::{IdentityKey, PublicKey};
use crate::canonical::{sorted_entries, write_entries};

/// The field holding the signature by the signer's current key.
pub const SIGNATURE: &str = "signature";
/// The field holding the signature by the signer's previous key (after a rotation).
pub const OLD_SIGNATURE: &str = "old_signature";

/// Standard base64, padding optional on input (written padded).
const B64_STANDARD_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why a signed object did not verify; each names the signature field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignedError {
    #[error("`{0}` is missing")]
    Missing(&'static str),
    #[error("`{0}` is not a string")]
    NotAString(&'static str),
    #[error("`{0}` is not standard base64")]
    Base64(&'static str),
    /// Wrong length, wrong key or altered content.
    #[error("`{0}` does not verify")]
    Invalid(&'static str),
}

/// The bytes a signature covers: the canonical JSON of `obj` without both signature fields.
pub fn signing_bytes(obj: &Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    write_entries(&sorted_entries(obj, &[SIGNATURE, OLD_SIGNATURE]), &mut out);
    out
}

fn set(obj: &mut Map<String, Value>, field: &str, key: &IdentityKey) {
    let signature = key.sign(&signing_bytes(obj));
    obj.insert(field.to_owned(), Value::String(STANDARD.encode(signature)));
}

/// Signs `obj` with `key` and sets `signature` (replacing any).
pub fn sign_object(obj: &mut Map<String, Value>, key: &IdentityKey) {
    set(obj, SIGNATURE, key);
}

/// Sets `old_signature`: the previous key's signature over the same bytes as `signature`.
pub fn add_old_signature(obj: &mut Map<String, Value>, old: &IdentityKey) {
    set(obj, OLD_SIGNATURE, old);
}

fn check(
    obj: &Map<String, Value>,
    field: &'static str,
    key: &PublicKey,
) -> Result<(), SignedError> {
    let text = match obj.get(field) {
        None => return Err(SignedError::Missing(field)),
        Some(Value::String(text)) => text,
        Some(_) => return Err(SignedError::NotAString(field)),
    };
    let signature = B64_STANDARD_LENIENT
        .decode(text)
        .map_err(|_| SignedError::Base64(field))?;
    key.verify(&signing_bytes(obj), &signature)
        .map_err(|_| SignedError::Invalid(field))
}

/// Checks `signature` against `key`.
pub fn verify_object(obj: &Map<String, Value>, key: &PublicKey) -> Result<(), SignedError> {
    check(obj, SIGNATURE, key)
}

/// Checks `old_signature` against `key` (a previous key of the signer).
pub fn verify_old_signature(obj: &Map<String, Value>, key: &PublicKey) -> Result<(), SignedError> {
    check(obj, OLD_SIGNATURE, key)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn key(n: u8) -> IdentityKey {
        IdentityKey::from_seed([n; 32])
    }

    fn object(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(map) => map,
            _ => unreachable!("tests pass objects"),
        }
    }

    #[test]
    fn signing_bytes_are_canonical_without_signatures() {
        let obj = object(json!({
            "b": 1, "a": "東", "signature": "x", "old_signature": "y", "c": {"z": 1.5, "y": null}
        }));
        assert_eq!(
            String::from_utf8(signing_bytes(&obj)).unwrap(),
            r#"{"a": "\u6771", "b": 1, "c": {"y": null, "z": 1.5}}"#
        );
    }

    #[test]
    fn key_order_and_whitespace_of_the_received_text_do_not_matter() {
        let mut obj =
            object(json!({"gateway_id": "g", "seq": 3, "nested": {"b": [1, 2], "a": true}}));
        sign_object(&mut obj, &key(1));
        let signature = obj[SIGNATURE].as_str().unwrap();
        assert_eq!(signature.len(), 88, "64 bytes, standard base64 padded");
        let received = format!(
            "{{ \"signature\" :\"{signature}\",\n  \"nested\":{{\"a\":true,\"b\":[ 1,2 ]}},\"seq\":3,\"gateway_id\" : \"g\"}}"
        );
        let parsed: Map<String, Value> = serde_json::from_str(&received).unwrap();
        assert_eq!(verify_object(&parsed, &key(1).public_key()), Ok(()));
    }

    #[test]
    fn one_changed_value_fails() {
        let mut obj = object(json!({"gateway_id": "g", "seq": 3, "url": "https://a"}));
        sign_object(&mut obj, &key(1));
        for (field, value) in [
            ("seq", json!(4)),
            ("seq", json!("3")),
            ("seq", json!(3.0)),
            ("url", json!("https://b")),
            ("extra", json!(null)),
        ] {
            let mut changed = obj.clone();
            changed.insert(field.into(), value);
            assert_eq!(
                verify_object(&changed, &key(1).public_key()),
                Err(SignedError::Invalid(SIGNATURE)),
                "{field}"
            );
        }
        let mut removed = obj.clone();
        removed.remove("url");
        assert_eq!(
            verify_object(&removed, &key(1).public_key()),
            Err(SignedError::Invalid(SIGNATURE))
        );
        assert_eq!(
            verify_object(&obj, &key(2).public_key()),
            Err(SignedError::Invalid(SIGNATURE))
        );
    }

    #[test]
    fn signature_field_errors_are_distinct() {
        let pk = key(1).public_key();
        let mut obj = object(json!({"a": 1}));
        assert_eq!(
            verify_object(&obj, &pk),
            Err(SignedError::Missing(SIGNATURE))
        );
        obj.insert(SIGNATURE.into(), json!(12));
        assert_eq!(
            verify_object(&obj, &pk),
            Err(SignedError::NotAString(SIGNATURE))
        );
        obj.insert(SIGNATURE.into(), json!("not base64!"));
        assert_eq!(
            verify_object(&obj, &pk),
            Err(SignedError::Base64(SIGNATURE))
        );
        obj.insert(SIGNATURE.into(), json!("AAAA"));
        assert_eq!(
            verify_object(&obj, &pk),
            Err(SignedError::Invalid(SIGNATURE))
        );
        // URL-safe base64 is not the signature's alphabet.
        let mut signed = object(json!({"a": 1}));
        sign_object(&mut signed, &key(1));
        let text = signed[SIGNATURE].as_str().unwrap().to_owned();
        let unpadded = text.trim_end_matches('=').to_owned();
        signed.insert(SIGNATURE.into(), json!(unpadded));
        assert_eq!(verify_object(&signed, &pk), Ok(()));
        if text.contains(['+', '/']) {
            signed.insert(
                SIGNATURE.into(),
                json!(text.replace('+', "-").replace('/', "_")),
            );
            assert_eq!(
                verify_object(&signed, &pk),
                Err(SignedError::Base64(SIGNATURE))
            );
        }
    }

    #[test]
    fn old_signature_covers_the_same_bytes() {
        let (new, old) = (key(1), key(2));
        let mut obj = object(json!({"public_key": "k", "n": 1}));
        sign_object(&mut obj, &new);
        add_old_signature(&mut obj, &old);
        assert_eq!(verify_object(&obj, &new.public_key()), Ok(()));
        assert_eq!(verify_old_signature(&obj, &old.public_key()), Ok(()));
        assert_eq!(
            verify_old_signature(&obj, &new.public_key()),
            Err(SignedError::Invalid(OLD_SIGNATURE))
        );
        // Either signature is checked over the object without both, whatever order they were added.
        let mut other_order = object(json!({"public_key": "k", "n": 1}));
        add_old_signature(&mut other_order, &old);
        sign_object(&mut other_order, &new);
        assert_eq!(other_order, obj);
        let mut unsigned_old = object(json!({"n": 1}));
        sign_object(&mut unsigned_old, &new);
        assert_eq!(
            verify_old_signature(&unsigned_old, &old.public_key()),
            Err(SignedError::Missing(OLD_SIGNATURE))
        );
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e9f64..1e9).prop_map(Value::from),
            "[ -~é東😀\u{0}-\u{1f}]{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 32, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-z_é]{0,6}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_object() -> impl Strategy<Value = Map<String, Value>> {
        prop::collection::btree_map("[a-z_é東]{0,8}", arb_value(), 1..8)
            .prop_map(|m| m.into_iter().collect())
    }

    proptest! {
        #[test]
        fn round_trip_and_any_mutation_fails(
            obj in arb_object(),
            seed in any::<[u8; 32]>(),
            index in any::<prop::sample::Index>(),
            replacement in arb_value(),
        ) {
            let key = IdentityKey::from_seed(seed);
            let mut signed = obj.clone();
            sign_object(&mut signed, &key);
            // Through text and back: what a peer receives.
            let text = serde_json::to_string(&signed).unwrap();
            let received: Map<String, Value> = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(verify_object(&received, &key.public_key()), Ok(()));

            let signed_keys: Vec<String> = obj.keys()
                .filter(|k| *k != SIGNATURE && *k != OLD_SIGNATURE)
                .cloned()
                .collect();
            prop_assume!(!signed_keys.is_empty());
            let field = &signed_keys[index.index(signed_keys.len())];
            prop_assume!(received[field] != replacement);
            let mut mutated = received.clone();
            mutated.insert(field.clone(), replacement);
            prop_assert_eq!(
                verify_object(&mutated, &key.public_key()),
                Err(SignedError::Invalid(SIGNATURE))
            );
        }
    }
}
