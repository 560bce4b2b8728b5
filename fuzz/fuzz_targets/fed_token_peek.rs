//! Federation tokens: `peek` (and `verify` after it) on any text never panics; any claims signed
//! with any key read back exactly, verify under that key when their lifetime is allowed, and
//! never under another key.
#![no_main]

use libfuzzer_sys::arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use sbp_protocol::federation::{
    Expect, FedClaims, FedTokenError, IdentityKey, MAX_FED_TOKEN_LIFETIME_SECS, peek,
    sign_fed_token,
};

const NOW: i64 = 1_800_000_000;

fn non_empty(u: &mut Unstructured<'_>) -> Option<String> {
    let s = String::arbitrary(u).ok()?;
    (!s.is_empty()).then_some(s)
}

fuzz_target!(|data: &[u8]| {
    let key = IdentityKey::from_seed([7; 32]);
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(unverified) = peek(text) {
            let expect = Expect {
                aud: "aud",
                sub: "sub",
                htm: "GET",
                htu: "/",
            };
            let _ = unverified.clone().verify(&key.public_key(), &expect, NOW);
            let _ = unverified.verify(&key.public_key(), &expect, i64::MIN);
        }
    }

    let mut u = Unstructured::new(data);
    let (Ok(seed), Ok(iat), Ok(life)) = (
        <[u8; 32]>::arbitrary(&mut u),
        i64::arbitrary(&mut u),
        u.int_in_range(-10..=MAX_FED_TOKEN_LIFETIME_SECS + 10),
    ) else {
        return;
    };
    let (Some(iss), Some(aud), Some(sub), Some(htm), Some(htu), Some(jti)) = (
        non_empty(&mut u),
        non_empty(&mut u),
        non_empty(&mut u),
        non_empty(&mut u),
        non_empty(&mut u),
        non_empty(&mut u),
    ) else {
        return;
    };
    let Some(exp) = iat.checked_add(life) else {
        return;
    };
    let claims = FedClaims {
        iss,
        aud,
        sub,
        htm,
        htu,
        iat,
        exp,
        jti,
    };
    let signer = IdentityKey::from_seed(seed);
    let token = sign_fed_token(&claims, &signer);
    let unverified = peek(&token).expect("a signed token parses");
    assert_eq!(unverified.kid, signer.key_id());
    assert_eq!(unverified.claims, claims);
    let expect = Expect {
        aud: &claims.aud,
        sub: &claims.sub,
        htm: &claims.htm,
        htu: &claims.htu,
    };
    let got = unverified
        .clone()
        .verify(&signer.public_key(), &expect, iat);
    if (1..=MAX_FED_TOKEN_LIFETIME_SECS).contains(&life) {
        assert_eq!(got, Ok(claims.clone()));
    } else {
        assert_eq!(got, Err(FedTokenError::Lifetime));
    }
    let other = IdentityKey::from_seed(seed.map(|b| b ^ 1));
    assert_eq!(
        unverified.verify(&other.public_key(), &expect, iat),
        Err(FedTokenError::Signature)
    );
});
