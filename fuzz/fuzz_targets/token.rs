//! Roaming tokens: `verify` on any text never panics; any claims signed with any secret verify
//! under that secret before expiry (and as expired at it), and not under another secret.
#![no_main]

use libfuzzer_sys::arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use sbp_protocol::token::{self, MAX_TOKEN_TTL_SECS, RoamingClaims, TokenError};

const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-32b";

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = token::verify(text, SECRET, 1_800_000_000);
        let _ = token::verify(text, b"", i64::MIN);
    }
    let mut u = Unstructured::new(data);
    let (Ok(sub), Ok(sid), Ok(iat), Ok(ttl), Ok(secret)) = (
        String::arbitrary(&mut u),
        String::arbitrary(&mut u),
        i64::arbitrary(&mut u),
        u.int_in_range(1..=MAX_TOKEN_TTL_SECS),
        Vec::<u8>::arbitrary(&mut u),
    ) else {
        return;
    };
    let Some(exp) = iat.checked_add(ttl) else {
        return;
    };
    let claims = RoamingClaims {
        sub,
        sid,
        iat,
        exp,
        iss: None,
    };
    let t = token::sign(&claims, &secret);
    assert_eq!(token::verify(&t, &secret, iat), Ok(claims.clone()));
    assert_eq!(
        token::verify(&t, &secret, exp),
        Err(TokenError::Expired { exp })
    );
    let mut other = secret.clone();
    other.push(1);
    assert_eq!(
        token::verify(&t, &other, iat),
        Err(TokenError::BadSignature)
    );
});
