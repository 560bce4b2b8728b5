//! Federation tokens: how one node authenticates a request to another. A compact JWS signed with
//! the caller's Ed25519 key (`alg: EdDSA`, `typ: sbp-fed+jwt`, `kid`), whose claims bind it to one
//! callee (`aud`), one resource (`sub`), one request (`htm`, `htu`), a short time and a single use
//! (`jti`, checked against the callee's replay store).
//!
//! Reading is split in two because the key is found from the token itself: [`peek`] parses without
//! trusting anything (the caller then looks `iss` and `kid` up among its trusted peers), and
//! [`Unverified::verify`] checks the signature over the segments as received, then the claims.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Map, Value};

use super::keys::{IdentityKey, PublicKey};

/// The `typ` of every federation token; a roaming token (`JWT`) is not one.
pub const FED_TOKEN_TYP: &str = "sbp-fed+jwt";
/// The longest `exp - iat` accepted.
pub const MAX_FED_TOKEN_LIFETIME_SECS: i64 = 300;
/// Tolerated clock difference, either way.
pub const CLOCK_SKEW_SECS: i64 = 60;

/// The only algorithm accepted.
const ALG: &str = "EdDSA";

/// The claims of a federation token; every one is required.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FedClaims {
    /// The caller's gateway id.
    pub iss: String,
    /// The callee's gateway id.
    pub aud: String,
    /// What the request is for: the bare bundle CID or session id.
    pub sub: String,
    /// The HTTP method.
    pub htm: String,
    /// The request path, without scheme, host or query.
    pub htu: String,
    /// Issued at, Unix seconds.
    pub iat: i64,
    /// Expires at, Unix seconds.
    pub exp: i64,
    /// A unique id: the callee accepts each once.
    pub jti: String,
}

/// Why a federation token was refused.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum FedTokenError {
    #[error("malformed federation token: {0}")]
    Malformed(String),
    #[error("federation token algorithm {0:?} is not EdDSA")]
    Alg(String),
    #[error("federation token `typ` is not {FED_TOKEN_TYP}")]
    Typ,
    #[error("federation token has no `{0}`")]
    MissingClaim(&'static str),
    #[error("federation token signature does not verify")]
    Signature,
    #[error("federation token is for another audience")]
    Aud,
    #[error("federation token is for another subject")]
    Sub,
    #[error("federation token is for another method")]
    Htm,
    #[error("federation token is for another path")]
    Htu,
    #[error("federation token expired")]
    Expired,
    #[error("federation token issued in the future")]
    IatFuture,
    #[error("federation token lifetime is not within 1..=300 seconds")]
    Lifetime,
}

impl FedTokenError {
    /// A short snake_case label, for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Malformed(_) => "malformed",
            Self::Alg(_) => "alg",
            Self::Typ => "typ",
            Self::MissingClaim(_) => "missing_claim",
            Self::Signature => "signature",
            Self::Aud => "aud",
            Self::Sub => "sub",
            Self::Htm => "htm",
            Self::Htu => "htu",
            Self::Expired => "expired",
            Self::IatFuture => "iat_future",
            Self::Lifetime => "lifetime",
        }
    }
}

/// Signs `claims` with `key`: header `{"alg":"EdDSA","kid":<key id>,"typ":"sbp-fed+jwt"}`, compact
/// JSON, base64url without padding, Ed25519 over `header.payload`.
pub fn sign_fed_token(claims: &FedClaims, key: &IdentityKey) -> String {
    let mut header = Map::new();
    header.insert("alg".into(), Value::from(ALG));
    header.insert("kid".into(), Value::from(key.key_id()));
    header.insert("typ".into(), Value::from(FED_TOKEN_TYP));
    let mut payload = Map::new();
    for (name, value) in [
        ("iss", &claims.iss),
        ("aud", &claims.aud),
        ("sub", &claims.sub),
        ("htm", &claims.htm),
        ("htu", &claims.htu),
    ] {
        payload.insert(name.into(), Value::from(value.as_str()));
    }
    payload.insert("iat".into(), Value::from(claims.iat));
    payload.insert("exp".into(), Value::from(claims.exp));
    payload.insert("jti".into(), Value::from(claims.jti.as_str()));

    let mut token = URL_SAFE_NO_PAD.encode(Value::Object(header).to_string());
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(Value::Object(payload).to_string(), &mut token);
    let signature = key.sign(token.as_bytes());
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(signature, &mut token);
    token
}

/// A parsed federation token whose signature is not checked yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unverified {
    /// The key id the signer claims: look it up among the issuer's trusted keys.
    pub kid: String,
    pub claims: FedClaims,
    /// `header.payload` as received: what the signature covers.
    signing_input: String,
    signature: Vec<u8>,
}

fn decode_object(segment: &str, what: &str) -> Result<Map<String, Value>, FedTokenError> {
    let bytes = URL_SAFE_NO_PAD
        .decode(segment)
        .map_err(|_| FedTokenError::Malformed(format!("{what} is not base64url")))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(FedTokenError::Malformed(format!(
            "{what} is not a JSON object"
        ))),
    }
}

/// Parses without trusting: three segments, the header's `alg` exactly `EdDSA` (`none`, HS256 and
/// anything else refused, so a roaming token fails here), `typ` exactly [`FED_TOKEN_TYP`], a `kid`,
/// no `crit`, and every claim present and typed (strings non-empty, `iat`/`exp` integers).
pub fn peek(token: &str) -> Result<Unverified, FedTokenError> {
    let mut parts = token.split('.');
    let (Some(header_seg), Some(payload_seg), Some(signature_seg), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(FedTokenError::Malformed(
            "expected three dot-separated segments".into(),
        ));
    };

    let header = decode_object(header_seg, "header")?;
    match header.get("alg") {
        Some(Value::String(alg)) if alg == ALG => {}
        Some(Value::String(alg)) => return Err(FedTokenError::Alg(alg.clone())),
        Some(other) => return Err(FedTokenError::Alg(other.to_string())),
        None => return Err(FedTokenError::Alg("(missing)".into())),
    }
    if header.get("typ").and_then(Value::as_str) != Some(FED_TOKEN_TYP) {
        return Err(FedTokenError::Typ);
    }
    let kid = match header.get("kid") {
        Some(Value::String(kid)) if !kid.is_empty() => kid.clone(),
        _ => {
            return Err(FedTokenError::Malformed(
                "header has no string `kid`".into(),
            ));
        }
    };
    // No extension is understood, so a token that marks one as critical must be refused (RFC 7515 4.1.11).
    if header.contains_key("crit") {
        return Err(FedTokenError::Malformed(
            "header has `crit`, no extension is supported".into(),
        ));
    }

    let payload = decode_object(payload_seg, "payload")?;
    let string = |name: &'static str| match payload.get(name) {
        None => Err(FedTokenError::MissingClaim(name)),
        Some(Value::String(s)) if s.is_empty() => Err(FedTokenError::MissingClaim(name)),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(FedTokenError::Malformed(format!(
            "`{name}` must be a string"
        ))),
    };
    let integer = |name: &'static str| match payload.get(name) {
        None => Err(FedTokenError::MissingClaim(name)),
        Some(v) => v
            .as_i64()
            .ok_or_else(|| FedTokenError::Malformed(format!("`{name}` must be an integer"))),
    };
    let claims = FedClaims {
        iss: string("iss")?,
        aud: string("aud")?,
        sub: string("sub")?,
        htm: string("htm")?,
        htu: string("htu")?,
        iat: integer("iat")?,
        exp: integer("exp")?,
        jti: string("jti")?,
    };

    let signature = URL_SAFE_NO_PAD
        .decode(signature_seg)
        .map_err(|_| FedTokenError::Malformed("signature is not base64url".into()))?;
    Ok(Unverified {
        kid,
        claims,
        signing_input: token[..header_seg.len() + 1 + payload_seg.len()].to_owned(),
        signature,
    })
}

/// What the callee expects the token to be for.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    /// This node's gateway id.
    pub aud: &'a str,
    /// The bundle CID or session id of the route.
    pub sub: &'a str,
    pub htm: &'a str,
    /// The path as this node serves it (public base path included, no query).
    pub htu: &'a str,
}

impl Unverified {
    /// Signature by `key` (`verify_strict`), then `aud`/`sub`/`htm`/`htu` exactly, `exp - iat` in
    /// 1..=300, `iat <= now + 60`, `exp > now - 60`. The `jti` replay check is the caller's.
    pub fn verify(
        self,
        key: &PublicKey,
        expect: &Expect<'_>,
        now_unix: i64,
    ) -> Result<FedClaims, FedTokenError> {
        key.verify(self.signing_input.as_bytes(), &self.signature)
            .map_err(|_| FedTokenError::Signature)?;
        let c = self.claims;
        if c.aud != expect.aud {
            return Err(FedTokenError::Aud);
        }
        if c.sub != expect.sub {
            return Err(FedTokenError::Sub);
        }
        if c.htm != expect.htm {
            return Err(FedTokenError::Htm);
        }
        if c.htu != expect.htu {
            return Err(FedTokenError::Htu);
        }
        if !c
            .exp
            .checked_sub(c.iat)
            .is_some_and(|life| (1..=MAX_FED_TOKEN_LIFETIME_SECS).contains(&life))
        {
            return Err(FedTokenError::Lifetime);
        }
        if c.iat > now_unix.saturating_add(CLOCK_SKEW_SECS) {
            return Err(FedTokenError::IatFuture);
        }
        if c.exp <= now_unix.saturating_sub(CLOCK_SKEW_SECS) {
            return Err(FedTokenError::Expired);
        }
        Ok(c)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use crate::token::{self, RoamingClaims};
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    const NOW: i64 = 1_800_000_000;
    const CID: &str = "5f0c3e6b7f1d2a9c8e4b6a1d3f5e7c9b0a2d4f6e8c1b3a5d7f9e0c2b4a6d8f1e";

    fn key() -> IdentityKey {
        IdentityKey::from_seed([5; 32])
    }

    fn claims() -> FedClaims {
        FedClaims {
            iss: "a".repeat(32),
            aud: "b".repeat(32),
            sub: CID.into(),
            htm: "GET".into(),
            htu: format!("/v1/sbp/bundles/{CID}"),
            iat: NOW,
            exp: NOW + 120,
            jti: "0190b6b2-5c1e-7d3a-9f00-3c5d2e1f4a01".into(),
        }
    }

    fn expect() -> Expect<'static> {
        Expect {
            aud: "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
            sub: CID,
            htm: "GET",
            htu: "/v1/sbp/bundles/5f0c3e6b7f1d2a9c8e4b6a1d3f5e7c9b0a2d4f6e8c1b3a5d7f9e0c2b4a6d8f1e",
        }
    }

    fn check(token: &str, now: i64) -> Result<FedClaims, FedTokenError> {
        peek(token)?.verify(&key().public_key(), &expect(), now)
    }

    /// A token with arbitrary header and payload JSON, signed by `key()` over what is sent.
    fn forge(header: &str, payload: &str) -> String {
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header),
            URL_SAFE_NO_PAD.encode(payload)
        );
        let signature = key().sign(input.as_bytes());
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature))
    }

    fn header() -> String {
        format!(
            r#"{{"alg":"EdDSA","kid":"{}","typ":"sbp-fed+jwt"}}"#,
            key().key_id()
        )
    }

    /// The claims as JSON, with `f` applied to the map first.
    fn payload(f: impl FnOnce(&mut Map<String, Value>)) -> String {
        let token = sign_fed_token(&claims(), &key());
        let mut map = decode_object(token.split('.').nth(1).unwrap(), "p").unwrap();
        f(&mut map);
        Value::Object(map).to_string()
    }

    #[test]
    fn sign_then_verify() {
        let token = sign_fed_token(&claims(), &key());
        let u = peek(&token).unwrap();
        assert_eq!(u.kid, key().key_id());
        assert_eq!(u.claims, claims());
        assert_eq!(check(&token, NOW), Ok(claims()));
        let head = URL_SAFE_NO_PAD
            .decode(token.split('.').next().unwrap())
            .unwrap();
        assert_eq!(
            String::from_utf8(head).unwrap(),
            format!(
                r#"{{"alg":"EdDSA","kid":"{}","typ":"sbp-fed+jwt"}}"#,
                key().key_id()
            )
        );
        assert!(!token.contains('='));
    }

    #[test]
    fn reasons_are_snake_case_labels() {
        for (e, label) in [
            (FedTokenError::Malformed("x".into()), "malformed"),
            (FedTokenError::Alg("none".into()), "alg"),
            (FedTokenError::Typ, "typ"),
            (FedTokenError::MissingClaim("jti"), "missing_claim"),
            (FedTokenError::Signature, "signature"),
            (FedTokenError::Aud, "aud"),
            (FedTokenError::Sub, "sub"),
            (FedTokenError::Htm, "htm"),
            (FedTokenError::Htu, "htu"),
            (FedTokenError::Expired, "expired"),
            (FedTokenError::IatFuture, "iat_future"),
            (FedTokenError::Lifetime, "lifetime"),
        ] {
            assert_eq!(e.reason(), label);
        }
    }

    #[test]
    fn malformed() {
        let token = sign_fed_token(&claims(), &key());
        let (input, _) = token.rsplit_once('.').unwrap();
        for bad in [
            String::new(),
            "a.b".into(),
            format!("{token}.x"),
            input.into(),
            format!("!!.{}", token.split_once('.').unwrap().1),
            format!("{input}.***"),
            // Padding is not part of the encoding.
            format!("{token}="),
            forge(&header(), "[1, 2]"),
            forge(r#"{"alg":"EdDSA","typ":"sbp-fed+jwt"}"#, &payload(|_| {})),
            forge(
                r#"{"alg":"EdDSA","kid":"","typ":"sbp-fed+jwt"}"#,
                &payload(|_| {}),
            ),
            forge(
                &format!(
                    r#"{{"alg":"EdDSA","kid":"{}","typ":"sbp-fed+jwt","crit":["b64"]}}"#,
                    key().key_id()
                ),
                &payload(|_| {}),
            ),
            forge(
                &header(),
                &payload(|m| {
                    m.insert("iat".into(), Value::from("1800000000"));
                }),
            ),
            forge(
                &header(),
                &payload(|m| {
                    m.insert("exp".into(), Value::from(1.8e9 + 120.5));
                }),
            ),
            forge(
                &header(),
                &payload(|m| {
                    m.insert("aud".into(), Value::from(7));
                }),
            ),
        ] {
            let got = peek(&bad);
            assert!(
                matches!(got, Err(FedTokenError::Malformed(_))),
                "{bad}: {got:?}"
            );
            assert_eq!(got.unwrap_err().reason(), "malformed");
        }
    }

    #[test]
    fn alg_none_with_empty_signature() {
        let none = format!(
            "{}.{}.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none","kid":"k","typ":"sbp-fed+jwt"}"#),
            URL_SAFE_NO_PAD.encode(payload(|_| {}))
        );
        assert_eq!(peek(&none), Err(FedTokenError::Alg("none".into())));
        // Even a correct signature does not make another alg acceptable.
        let forged = forge(
            r#"{"alg":"EdDSA ","kid":"k","typ":"sbp-fed+jwt"}"#,
            &payload(|_| {}),
        );
        assert_eq!(peek(&forged), Err(FedTokenError::Alg("EdDSA ".into())));
        let missing = forge(r#"{"kid":"k","typ":"sbp-fed+jwt"}"#, &payload(|_| {}));
        assert_eq!(peek(&missing), Err(FedTokenError::Alg("(missing)".into())));
        let typed = forge(
            r#"{"alg":["EdDSA"],"kid":"k","typ":"sbp-fed+jwt"}"#,
            &payload(|_| {}),
        );
        assert_eq!(peek(&typed).unwrap_err().reason(), "alg");
    }

    #[test]
    fn hs256_keyed_with_the_public_key_is_refused() {
        let pk = key().public_key();
        let b64 = pk.to_b64_spki();
        let (der, kid) = (pk.spki_der(), key().key_id());
        let secrets: [&[u8]; 4] = [pk.as_bytes(), &der, b64.as_bytes(), kid.as_bytes()];
        for secret in secrets {
            let input = format!(
                "{}.{}",
                URL_SAFE_NO_PAD.encode(format!(
                    r#"{{"alg":"HS256","kid":"{}","typ":"sbp-fed+jwt"}}"#,
                    key().key_id()
                )),
                URL_SAFE_NO_PAD.encode(payload(|_| {}))
            );
            let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
            mac.update(input.as_bytes());
            let token = format!(
                "{input}.{}",
                URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
            );
            assert_eq!(peek(&token), Err(FedTokenError::Alg("HS256".into())));
        }
    }

    #[test]
    fn roaming_token_is_refused_by_peek() {
        let roaming = token::sign(
            &RoamingClaims {
                sub: "e".into(),
                sid: "s".into(),
                iat: NOW,
                exp: NOW + 60,
                iss: Some("a".repeat(32)),
            },
            b"secret",
        );
        assert_eq!(peek(&roaming), Err(FedTokenError::Alg("HS256".into())));
    }

    #[test]
    fn federation_token_is_refused_as_a_roaming_token() {
        let token = sign_fed_token(&claims(), &key());
        for secret in [&b"secret"[..], key().public_key().as_bytes()] {
            assert_eq!(
                token::verify(&token, secret, NOW),
                Err(token::TokenError::UnsupportedAlgorithm("EdDSA".into()))
            );
        }
    }

    #[test]
    fn typ() {
        for typ in [r#""JWT""#, r#""SBP-FED+JWT""#, "null", "1"] {
            let t = forge(
                &format!(r#"{{"alg":"EdDSA","kid":"k","typ":{typ}}}"#),
                &payload(|_| {}),
            );
            assert_eq!(peek(&t), Err(FedTokenError::Typ), "{typ}");
        }
        let t = forge(r#"{"alg":"EdDSA","kid":"k"}"#, &payload(|_| {}));
        assert_eq!(peek(&t), Err(FedTokenError::Typ));
    }

    #[test]
    fn each_missing_claim() {
        for name in ["iss", "aud", "sub", "htm", "htu", "iat", "exp", "jti"] {
            let t = forge(
                &header(),
                &payload(|m| {
                    m.remove(name);
                }),
            );
            assert_eq!(peek(&t), Err(FedTokenError::MissingClaim(name)), "{name}");
            if !matches!(name, "iat" | "exp") {
                let t = forge(
                    &header(),
                    &payload(|m| {
                        m.insert(name.into(), Value::from(""));
                    }),
                );
                assert_eq!(
                    peek(&t),
                    Err(FedTokenError::MissingClaim(name)),
                    "empty {name}"
                );
            }
        }
    }

    #[test]
    fn signature() {
        let token = sign_fed_token(&claims(), &key());
        // Another key.
        let other = sign_fed_token(&claims(), &IdentityKey::from_seed([6; 32]));
        assert_eq!(check(&other, NOW), Err(FedTokenError::Signature));
        // A changed claim under the original signature.
        let (_, rest) = token.split_once('.').unwrap();
        let (_, sig) = rest.split_once('.').unwrap();
        let mut changed = claims();
        changed.sub = "0".repeat(64);
        let resigned = sign_fed_token(&changed, &key());
        let (input, _) = resigned.rsplit_once('.').unwrap();
        assert_eq!(
            check(&format!("{input}.{sig}"), NOW),
            Err(FedTokenError::Signature)
        );
        // The payload re-encoded differently (whitespace): the signature covers the bytes as sent.
        let (head, _) = token.split_once('.').unwrap();
        let spaced = serde_json::to_string_pretty(
            &decode_object(rest.split_once('.').unwrap().0, "p").unwrap(),
        )
        .unwrap();
        assert_eq!(
            check(
                &format!("{head}.{}.{sig}", URL_SAFE_NO_PAD.encode(&spaced)),
                NOW
            ),
            Err(FedTokenError::Signature)
        );
        // Truncated and empty signatures.
        let (input, _) = token.rsplit_once('.').unwrap();
        assert_eq!(
            check(&format!("{input}."), NOW),
            Err(FedTokenError::Signature)
        );
        assert_eq!(
            check(&format!("{input}.AAAA"), NOW),
            Err(FedTokenError::Signature)
        );
        // Forged with a different but valid serialisation and signed over it: accepted.
        let forged = forge(&header(), &spaced);
        assert_eq!(check(&forged, NOW), Ok(claims()));
    }

    #[test]
    fn aud_sub_htm_htu() {
        type Change = fn(&mut FedClaims);
        let cases: [(Change, FedTokenError); 5] = [
            (|c| c.aud = "c".repeat(32), FedTokenError::Aud),
            (|c| c.sub = "0".repeat(64), FedTokenError::Sub),
            (|c| c.htm = "get".into(), FedTokenError::Htm),
            (|c| c.htu.push_str("?x=1"), FedTokenError::Htu),
            (
                |c| c.htu = format!("https://b.example{}", c.htu),
                FedTokenError::Htu,
            ),
        ];
        for (change, want) in cases {
            let mut c = claims();
            change(&mut c);
            assert_eq!(check(&sign_fed_token(&c, &key()), NOW), Err(want));
        }
    }

    #[test]
    fn lifetime() {
        for (iat, exp, ok) in [
            (NOW, NOW + 300, true),
            (NOW, NOW + 1, true),
            (NOW, NOW + 301, false),
            (NOW, NOW, false),
            (NOW, NOW - 1, false),
            (i64::MIN, i64::MAX, false),
        ] {
            let t = sign_fed_token(
                &FedClaims {
                    iat,
                    exp,
                    ..claims()
                },
                &key(),
            );
            let got = check(&t, NOW);
            if ok {
                assert!(got.is_ok(), "{iat} {exp}: {got:?}");
            } else {
                assert_eq!(got, Err(FedTokenError::Lifetime), "{iat} {exp}");
            }
        }
    }

    #[test]
    fn iat_in_the_future() {
        let at = |iat: i64| {
            sign_fed_token(
                &FedClaims {
                    iat,
                    exp: iat + 10,
                    ..claims()
                },
                &key(),
            )
        };
        assert!(check(&at(NOW + 60), NOW).is_ok());
        assert_eq!(check(&at(NOW + 61), NOW), Err(FedTokenError::IatFuture));
    }

    #[test]
    fn expired() {
        let ending = |exp: i64| {
            sign_fed_token(
                &FedClaims {
                    iat: exp - 100,
                    exp,
                    ..claims()
                },
                &key(),
            )
        };
        assert!(check(&ending(NOW - 59), NOW).is_ok());
        assert_eq!(check(&ending(NOW - 60), NOW), Err(FedTokenError::Expired));
        assert_eq!(check(&ending(NOW - 61), NOW), Err(FedTokenError::Expired));
        assert_eq!(
            check(&ending(NOW - 61), i64::MIN),
            Err(FedTokenError::IatFuture)
        );
    }
}
