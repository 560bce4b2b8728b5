//! Roaming tokens: compact JWTs signed with HMAC-SHA256, byte-compatible with the Python reference.
//!
//! The reference writes header and payload with Python's `json.dumps` (spaces after `:` and `,`), so
//! we write the same bytes when signing, and when verifying we MAC the segments exactly as received:
//! re-serialising would break tokens minted by any other implementation.

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::canonical::{write_canonical, write_string};

/// The longest lifetime a token may claim (7 days, spec §8.1).
pub const MAX_TOKEN_TTL_SECS: i64 = 604_800;

/// The header every token we sign carries, as Python's `json.dumps` writes it.
const HEADER_JSON: &[u8] = br#"{"alg": "HS256", "typ": "JWT"}"#;

/// base64url that accepts input with or without `=` padding.
const B64_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// The claims of a roaming token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoamingClaims {
    /// The export id (references the stored bundle).
    pub sub: String,
    /// The source session id.
    pub sid: String,
    /// Issued at, Unix seconds.
    pub iat: i64,
    /// Expires at, Unix seconds.
    pub exp: i64,
    /// The minting gateway's id (federation): which gateway can redeem the token. Absent from the
    /// reference's tokens and ours before federation, which keep their exact bytes.
    pub iss: Option<String>,
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token: {0}")]
    Malformed(String),
    #[error("unsupported token algorithm {0}")]
    UnsupportedAlgorithm(String),
    #[error("bad token signature")]
    BadSignature,
    #[error("invalid token claims: {0}")]
    InvalidClaims(String),
    #[error("token expired at {exp}")]
    Expired { exp: i64 },
}

/// An HMAC-SHA256 keyed with `secret`, built without a fallible constructor.
///
/// HMAC hashes a key longer than the block and zero-pads a shorter one to the block size; doing that
/// here gives the same MAC as `Hmac::new_from_slice` and lets us use the infallible `new`.
fn mac(secret: &[u8]) -> Hmac<Sha256> {
    let mut block = [0u8; 64];
    if secret.len() > block.len() {
        block[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        block[..secret.len()].copy_from_slice(secret);
    }
    <Hmac<Sha256> as hmac::digest::KeyInit>::new(&block.into())
}

/// Signs `claims`: header bytes exactly `{"alg": "HS256", "typ": "JWT"}`, payload
/// `{"sub": "...", "sid": "...", "iat": N, "exp": N}` (Python `json.dumps` style, this key order)
/// with `, "iss": "..."` after `exp` when there is one, base64url without padding, HMAC-SHA256 over
/// `"<header>.<payload>"`.
pub fn sign(claims: &RoamingClaims, secret: &[u8]) -> String {
    let mut payload = Vec::with_capacity(128);
    payload.extend_from_slice(b"{\"sub\": ");
    write_string(&claims.sub, &mut payload);
    payload.extend_from_slice(b", \"sid\": ");
    write_string(&claims.sid, &mut payload);
    payload.extend_from_slice(b", \"iat\": ");
    write_canonical(&Value::from(claims.iat), &mut payload);
    payload.extend_from_slice(b", \"exp\": ");
    write_canonical(&Value::from(claims.exp), &mut payload);
    if let Some(iss) = &claims.iss {
        payload.extend_from_slice(b", \"iss\": ");
        write_string(iss, &mut payload);
    }
    payload.push(b'}');

    let mut token = URL_SAFE_NO_PAD.encode(HEADER_JSON);
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(&payload, &mut token);
    let mut mac = mac(secret);
    mac.update(token.as_bytes());
    let signature = mac.finalize().into_bytes();
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(signature, &mut token);
    token
}

fn decode_json_object(segment: &str, what: &str) -> Result<Map<String, Value>, TokenError> {
    let bytes = B64_LENIENT
        .decode(segment)
        .map_err(|e| TokenError::Malformed(format!("{what} is not base64url: {e}")))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(TokenError::Malformed(format!(
            "{what} is not a JSON object"
        ))),
        Err(e) => Err(TokenError::Malformed(format!("{what} is not JSON: {e}"))),
    }
}

/// Verifies a token: header and algorithm, then the HMAC over the two segments as received (in
/// constant time), then the claims, then expiry (`now_unix >= exp` is expired).
pub fn verify(token: &str, secret: &[u8], now_unix: i64) -> Result<RoamingClaims, TokenError> {
    let mut parts = token.split('.');
    let (Some(header_seg), Some(payload_seg), Some(signature_seg), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed(
            "expected three dot-separated segments".into(),
        ));
    };

    let header = decode_json_object(header_seg, "header")?;
    match header.get("alg") {
        Some(Value::String(alg)) if alg == "HS256" => {}
        Some(Value::String(alg)) => return Err(TokenError::UnsupportedAlgorithm(alg.clone())),
        Some(other) => return Err(TokenError::UnsupportedAlgorithm(other.to_string())),
        None => return Err(TokenError::UnsupportedAlgorithm("(missing)".into())),
    }

    let signature = B64_LENIENT
        .decode(signature_seg)
        .map_err(|e| TokenError::Malformed(format!("signature is not base64url: {e}")))?;
    // The signed input is the received text up to the second dot.
    let signed_len = header_seg.len() + 1 + payload_seg.len();
    let mut mac = mac(secret);
    mac.update(&token.as_bytes()[..signed_len]);
    mac.verify_slice(&signature)
        .map_err(|_| TokenError::BadSignature)?;

    let claims = decode_json_object(payload_seg, "payload")?;
    let string_claim = |name: &str| match claims.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(TokenError::InvalidClaims(format!(
            "`{name}` must be a string"
        ))),
    };
    let int_claim = |name: &str| {
        claims
            .get(name)
            .and_then(Value::as_i64)
            .ok_or_else(|| TokenError::InvalidClaims(format!("`{name}` must be an integer")))
    };
    let sub = string_claim("sub")?;
    let sid = string_claim("sid")?;
    let iat = int_claim("iat")?;
    let exp = int_claim("exp")?;
    let iss = match claims.get("iss") {
        None => None,
        Some(_) => Some(string_claim("iss")?),
    };
    if exp <= iat {
        return Err(TokenError::InvalidClaims(
            "`exp` must be after `iat`".into(),
        ));
    }
    if exp
        .checked_sub(iat)
        .is_none_or(|ttl| ttl > MAX_TOKEN_TTL_SECS)
    {
        return Err(TokenError::InvalidClaims(format!(
            "lifetime exceeds {MAX_TOKEN_TTL_SECS} seconds"
        )));
    }
    if now_unix >= exp {
        return Err(TokenError::Expired { exp });
    }
    Ok(RoamingClaims {
        sub,
        sid,
        iat,
        exp,
        iss,
    })
}

/// The `iss` a token claims, read without verifying anything: only to choose which gateway to ask
/// (the minting one verifies it). `None` when there is none or the token is not readable.
pub fn peek_iss(token: &str) -> Option<String> {
    let payload_seg = token.split('.').nth(1)?;
    match decode_json_object(payload_seg, "payload")
        .ok()?
        .remove("iss")?
    {
        Value::String(iss) => Some(iss),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use base64::engine::general_purpose;
    use proptest::prelude::*;

    const SECRET: &[u8] = b"conformance-test-secret-must-be-32-chars-minimum";
    /// Minted by the Python reference server (shared/interop/README.md).
    const REFERENCE: &str = "eyJhbGciOiAiSFMyNTYiLCAidHlwIjogIkpXVCJ9.eyJzdWIiOiAiYjNjMjJkZTMtNzc0My00OTQ2LWFhZjctOTE3NGFmMTViNjU5IiwgInNpZCI6ICI5ZmE3M2U5OC1iZjUyLTQ2YzctYjlkMy0xMDEyYzQzODIxYjEiLCAiaWF0IjogMTc5NTMzOTY1NCwgImV4cCI6IDE3OTUzNDMyNTR9.YAFC4oY89fIZYM_0a_KaW_IAhGuN-EhAh_NEryls1Ao";
    const REFERENCE_HEADER: &str = "eyJhbGciOiAiSFMyNTYiLCAidHlwIjogIkpXVCJ9";
    const IAT: i64 = 1_795_339_654;
    const EXP: i64 = 1_795_343_254;

    fn reference_claims() -> RoamingClaims {
        RoamingClaims {
            sub: "b3c22de3-7743-4946-aaf7-9174af15b659".into(),
            sid: "9fa73e98-bf52-46c7-b9d3-1012c43821b1".into(),
            iat: IAT,
            exp: EXP,
            iss: None,
        }
    }

    /// A token with arbitrary header and payload JSON, signed with `secret`.
    fn forge(header: &str, payload: &str, secret: &[u8]) -> String {
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header),
            URL_SAFE_NO_PAD.encode(payload)
        );
        let mut m = Hmac::<Sha256>::new_from_slice(secret).unwrap();
        m.update(input.as_bytes());
        format!(
            "{input}.{}",
            URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
        )
    }

    #[test]
    fn reference_token_verifies() {
        assert_eq!(
            verify(REFERENCE, SECRET, IAT + 1).unwrap(),
            reference_claims()
        );
    }

    #[test]
    fn reference_token_expires_at_exp() {
        assert_eq!(
            verify(REFERENCE, SECRET, EXP),
            Err(TokenError::Expired { exp: EXP })
        );
        assert!(verify(REFERENCE, SECRET, EXP - 1).is_ok());
    }

    #[test]
    fn other_secret_is_bad_signature() {
        let other = b"another-secret-that-is-also-32-chars-or-more";
        assert_eq!(
            verify(REFERENCE, other, IAT + 1),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn flipped_payload_char_is_bad_signature() {
        let start = REFERENCE_HEADER.len() + 1 + 10;
        let mut bytes = REFERENCE.as_bytes().to_vec();
        bytes[start] = if bytes[start] == b'A' { b'B' } else { b'A' };
        let token = String::from_utf8(bytes).unwrap();
        assert_eq!(
            verify(&token, SECRET, IAT + 1),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn conformance_tampered_token_is_bad_signature() {
        let token = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJmYWtlIiwic2lkIjoiZmFrZSIsImlhdCI6MTcwMDAwMDAwMCwiZXhwIjo5OTk5OTk5OTk5fQ.invalidsignature";
        assert_eq!(
            verify(token, SECRET, IAT + 1),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn alg_none_is_unsupported() {
        let header = URL_SAFE_NO_PAD.encode(r#"{"alg": "none", "typ": "JWT"}"#);
        let payload = REFERENCE.split('.').nth(1).unwrap();
        for token in [
            format!("{header}.{payload}."),
            format!("{header}.{payload}.c2ln"),
        ] {
            assert_eq!(
                verify(&token, SECRET, IAT + 1),
                Err(TokenError::UnsupportedAlgorithm("none".into()))
            );
        }
        let rs = forge(r#"{"alg": "RS256"}"#, r#"{"sub": "a"}"#, SECRET);
        assert_eq!(
            verify(&rs, SECRET, IAT + 1),
            Err(TokenError::UnsupportedAlgorithm("RS256".into()))
        );
    }

    #[test]
    fn wrong_segment_count_is_malformed() {
        let two = REFERENCE.rsplit_once('.').unwrap().0;
        for token in [two, "", "a", &format!("{REFERENCE}.x")] {
            assert!(
                matches!(
                    verify(token, SECRET, IAT + 1),
                    Err(TokenError::Malformed(_))
                ),
                "{token}"
            );
        }
        assert!(matches!(
            verify("!!.x.y", SECRET, IAT + 1),
            Err(TokenError::Malformed(_))
        ));
    }

    #[test]
    fn sign_reproduces_the_reference_token() {
        let token = sign(&reference_claims(), SECRET);
        assert_eq!(token.split('.').next().unwrap(), REFERENCE_HEADER);
        assert_eq!(token, REFERENCE);
    }

    #[test]
    fn sign_verify_round_trip() {
        let claims = RoamingClaims {
            sub: "export \"東京\" ✈ 😀".into(),
            sid: "s\n1".into(),
            iat: 100,
            exp: 100 + MAX_TOKEN_TTL_SECS,
            iss: None,
        };
        let token = sign(&claims, b"k");
        assert_eq!(verify(&token, b"k", 100).unwrap(), claims);
    }

    #[test]
    fn padded_segments_are_accepted() {
        let mut parts = REFERENCE.split('.').map(str::to_owned).collect::<Vec<_>>();
        for part in &mut parts[1..] {
            while part.len() % 4 != 0 {
                part.push('=');
            }
        }
        // The MAC covers the segments as sent, so a padded payload needs a signature over it.
        let input = format!("{}.{}", parts[0], parts[1]);
        let mut m = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
        m.update(input.as_bytes());
        let sig = general_purpose::URL_SAFE.encode(m.finalize().into_bytes());
        assert!(sig.ends_with('='));
        assert_eq!(
            verify(&format!("{input}.{sig}"), SECRET, IAT + 1).unwrap(),
            reference_claims()
        );
        // Padding the signature alone keeps the reference token valid.
        let padded_sig = format!("{REFERENCE}=");
        assert_eq!(
            verify(&padded_sig, SECRET, IAT + 1).unwrap(),
            reference_claims()
        );
    }

    #[test]
    fn invalid_claims() {
        let cases = [
            r#"{"sub": 1, "sid": "s", "iat": 10, "exp": 20}"#,
            r#"{"sub": "e", "iat": 10, "exp": 20}"#,
            r#"{"sub": "e", "sid": "s", "iat": 10.5, "exp": 20}"#,
            r#"{"sub": "e", "sid": "s", "iat": "10", "exp": 20}"#,
            r#"{"sub": "e", "sid": "s", "iat": 10}"#,
            r#"{"sub": "e", "sid": "s", "iat": 20, "exp": 20}"#,
            r#"{"sub": "e", "sid": "s", "iat": 10, "exp": 604811}"#,
            r#"{"sub": "e", "sid": "s", "iat": -9223372036854775808, "exp": 9223372036854775807}"#,
        ];
        for payload in cases {
            let token = forge(r#"{"alg": "HS256", "typ": "JWT"}"#, payload, SECRET);
            assert!(
                matches!(verify(&token, SECRET, 0), Err(TokenError::InvalidClaims(_))),
                "{payload}: {:?}",
                verify(&token, SECRET, 0)
            );
            // With a wrong secret the signature is what fails, whatever the claims.
            assert_eq!(verify(&token, b"other", 0), Err(TokenError::BadSignature));
        }
        let token = forge(
            r#"{"alg": "HS256"}"#,
            r#"{"sub": "e", "sid": "s", "iat": 10, "exp": 604810}"#,
            SECRET,
        );
        assert!(verify(&token, SECRET, 0).is_ok());
        let token = forge(r#"{"alg": "HS256"}"#, "[1]", SECRET);
        assert!(matches!(
            verify(&token, SECRET, 0),
            Err(TokenError::Malformed(_))
        ));
    }

    #[test]
    fn block_key_matches_hmac_new_from_slice() {
        for len in [0usize, 1, 32, 63, 64, 65, 200] {
            let key: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let mut ours = mac(&key);
            let mut theirs = Hmac::<Sha256>::new_from_slice(&key).unwrap();
            ours.update(b"data");
            theirs.update(b"data");
            assert_eq!(
                ours.finalize().into_bytes(),
                theirs.finalize().into_bytes(),
                "len {len}"
            );
        }
    }

    #[test]
    fn iss_is_written_after_exp_and_read_back() {
        let claims = RoamingClaims {
            iss: Some("0123456789abcdef0123456789abcdef".into()),
            ..reference_claims()
        };
        let token = sign(&claims, SECRET);
        let payload = URL_SAFE_NO_PAD
            .decode(token.split('.').nth(1).unwrap())
            .unwrap();
        assert_eq!(
            String::from_utf8(payload).unwrap(),
            r#"{"sub": "b3c22de3-7743-4946-aaf7-9174af15b659", "sid": "9fa73e98-bf52-46c7-b9d3-1012c43821b1", "iat": 1795339654, "exp": 1795343254, "iss": "0123456789abcdef0123456789abcdef"}"#
        );
        assert_eq!(verify(&token, SECRET, IAT + 1).unwrap(), claims);
        assert_eq!(peek_iss(&token), claims.iss);
        // The reference token has none.
        assert_eq!(peek_iss(REFERENCE), None);
        assert_eq!(verify(REFERENCE, SECRET, IAT + 1).unwrap().iss, None);
    }

    #[test]
    fn iss_must_be_a_string() {
        for iss in ["null", "1", r#"["a"]"#] {
            let payload =
                format!(r#"{{"sub": "e", "sid": "s", "iat": 10, "exp": 20, "iss": {iss}}}"#);
            let token = forge(r#"{"alg": "HS256", "typ": "JWT"}"#, &payload, SECRET);
            assert!(
                matches!(verify(&token, SECRET, 0), Err(TokenError::InvalidClaims(_))),
                "{iss}"
            );
            assert_eq!(peek_iss(&token), None);
        }
    }

    #[test]
    fn peek_iss_reads_without_verifying() {
        let token = forge(
            r#"{"alg": "HS256", "typ": "JWT"}"#,
            r#"{"sub": "e", "sid": "s", "iat": 10, "exp": 20, "iss": "g"}"#,
            b"a secret we do not have",
        );
        assert_eq!(peek_iss(&token), Some("g".into()));
        assert_eq!(verify(&token, SECRET, 0), Err(TokenError::BadSignature));
        for garbage in ["", "a", "a.!!.c", "a.W10.c"] {
            assert_eq!(peek_iss(garbage), None, "{garbage}");
        }
    }

    proptest! {
        #[test]
        fn any_single_byte_change_never_verifies(
            sub in "[ -~é東😀]{0,40}",
            iat in 0i64..4_000_000_000,
            ttl in 1i64..=MAX_TOKEN_TTL_SECS,
            index in any::<prop::sample::Index>(),
            replacement in any::<u8>(),
        ) {
            let claims = RoamingClaims { sub, sid: "sid".into(), iat, exp: iat + ttl, iss: None };
            let token = sign(&claims, SECRET);
            prop_assert_eq!(verify(&token, SECRET, iat).unwrap(), claims);
            let mut bytes = token.clone().into_bytes();
            let i = index.index(bytes.len());
            prop_assume!(bytes[i] != replacement);
            bytes[i] = replacement;
            if let Ok(changed) = String::from_utf8(bytes) {
                prop_assert!(verify(&changed, SECRET, iat).is_err(), "{} verified", changed);
            }
        }
    }
}
