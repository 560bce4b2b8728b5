//! Roaming bundles as an import reads them: `delimit_messages` (its ranges must cut the text at
//! JSON values), `parse_bundle`, and the CID: sealing any object gives bytes that are exactly its
//! canonical form, verify under the CID sealing returned (and the byte fast path agrees, never
//! accepting another CID), and agree with `verify_cid`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sbp_protocol::bundle::{self, BundleSnapshot};
use sbp_protocol::canonical::to_canonical_bytes;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = bundle::delimit_messages(text) {
        for (i, range) in d.messages.iter().enumerate() {
            let piece = text
                .get(range.clone())
                .expect("a message range lies on char boundaries");
            // A range is one JSON value by its syntax; a number beyond f64 (`1e400`) is valid
            // syntax that only the parse into a `Value` refuses, which the import reports.
            let _: &serde_json::value::RawValue =
                serde_json::from_str(piece).expect("a delimited message is one JSON value");
            if let Ok(value) = serde_json::from_str::<Value>(piece) {
                let _ = bundle::parse_message(i, value);
            }
        }
        let _ = bundle::parse_envelope(d.envelope, Vec::new());
    }
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return;
    };
    if let Value::Object(map) = &value {
        let verified = bundle::verify_cid(map);
        let mut sealed = map.clone();
        let (cid, bytes) = bundle::seal(&mut sealed);
        assert_eq!(bytes, to_canonical_bytes(&Value::Object(sealed.clone())));
        // The byte check is a fast path for bundles whose digest is their first key (every
        // bundle a gateway writes); otherwise it may only say "not proven".
        if sealed.keys().next().map(String::as_str) == Some("bundle_cid") {
            assert!(bundle::sealed_bytes_match(&bytes, &cid));
        }
        let other = if cid.starts_with('0') { "1" } else { "0" }.repeat(64);
        assert!(!bundle::sealed_bytes_match(&bytes, &other));
        assert_eq!(bundle::verify_cid(&sealed), Ok(cid.clone()));
        if let Ok(claimed) = &verified {
            assert_eq!(*claimed, cid);
        }
        let mut again = map.clone();
        assert_eq!(
            bundle::verify_and_seal(&mut again).is_ok(),
            verified.is_ok()
        );
        if let Some(snap) = map.get("state_snapshot").and_then(Value::as_object) {
            let _ = BundleSnapshot::read(snap);
        }
    }
    let _ = bundle::parse_bundle(value);
});
