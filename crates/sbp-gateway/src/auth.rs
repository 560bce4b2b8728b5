//! Credentials: session tokens (random, stored only as a SHA-256 hash), constant-time checks, and
//! operator API keys.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Prefix that makes leaked session tokens easy to recognise.
pub const TOKEN_PREFIX: &str = "sbp_";

/// Whether a credential has the shape of a session token (the prefix, then 256 bits in
/// unpadded URL-safe base64): how a session token sent as `Authorization: Bearer` (an OpenAI
/// SDK's `api_key`) is told from anything else sent there.
pub fn looks_like_session_token(s: &str) -> bool {
    s.strip_prefix(TOKEN_PREFIX).is_some_and(|rest| {
        rest.len() == 43
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// A new session token: 256 random bits.
pub fn new_session_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", URL_SAFE_NO_PAD.encode(bytes))
}

/// The token of a session created by a request carrying an Idempotency-Key: a keyed PRF of the key
/// and session id, so a retry of that request can be given the same token again while the store
/// still holds only its hash.
pub fn idempotent_session_token(secret: &[u8], session_id: &uuid::Uuid, key: &str) -> String {
    // HMAC accepts keys of any length, so construction cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    mac.update(b"sbp-session-token\0");
    mac.update(session_id.as_bytes());
    mac.update(b"\0");
    mac.update(key.as_bytes());
    format!(
        "{TOKEN_PREFIX}{}",
        URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    )
}

pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Whether `token` hashes to `stored_hash`, compared in constant time.
pub fn token_matches(token: &str, stored_hash: &str) -> bool {
    let h = hash_token(token);
    h.as_bytes().ct_eq(stored_hash.as_bytes()).into()
}

/// A gateway's proof that it holds a session (federation): HMAC-SHA256 keyed by the session
/// token's stored hash over `parts` (one per line). Only a gateway that keeps the hash can make it,
/// and the gateway asking, which has the surface's token, can check it — before it sends that
/// token anywhere.
pub fn holder_proof(token_hash: &str, parts: &[&str]) -> String {
    let mut mac = <Hmac<Sha256> as hmac::digest::KeyInit>::new_from_slice(token_hash.as_bytes())
        // HMAC takes a key of any length: this cannot fail.
        .unwrap_or_else(|_| <Hmac<Sha256> as hmac::digest::KeyInit>::new(&Default::default()));
    for part in parts {
        mac.update(part.as_bytes());
        mac.update(b"\n");
    }
    hex::encode(mac.finalize().into_bytes())
}

/// Whether `proof` is [`holder_proof`] of `token_hash` over `parts`, compared in constant time.
pub fn holder_proof_matches(proof: &str, token_hash: &str, parts: &[&str]) -> bool {
    let expected = holder_proof(token_hash, parts);
    expected.as_bytes().ct_eq(proof.as_bytes()).into()
}

/// Whether `presented` equals one of the configured keys (each compared in constant time).
pub fn api_key_matches(presented: &str, keys: &[String]) -> bool {
    api_key_index(presented, keys).is_some()
}

/// Which of the configured keys `presented` is; every key is compared, each in constant time.
pub fn api_key_index(presented: &str, keys: &[String]) -> Option<usize> {
    keys.iter().enumerate().fold(None, |found, (i, k)| {
        let eq: bool = k.as_bytes().ct_eq(presented.as_bytes()).into();
        found.or(eq.then_some(i))
    })
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_verifiable() {
        let a = new_session_token();
        let b = new_session_token();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert!(looks_like_session_token(&a));
        assert!(looks_like_session_token(&idempotent_session_token(
            b"k",
            &uuid::Uuid::nil(),
            "key"
        )));
        assert!(!looks_like_session_token("sk-proj-abc"));
        assert!(!looks_like_session_token(&format!("{a}x")));
        assert!(a.len() >= TOKEN_PREFIX.len() + 43);
        assert!(token_matches(&a, &hash_token(&a)));
        assert!(!token_matches(&b, &hash_token(&a)));
    }

    #[test]
    fn idempotent_tokens_depend_on_secret_key_and_session() {
        let id = uuid::Uuid::new_v4();
        let t = idempotent_session_token(b"secret-1", &id, "k");
        assert_eq!(t, idempotent_session_token(b"secret-1", &id, "k"));
        assert_ne!(t, idempotent_session_token(b"secret-2", &id, "k"));
        assert_ne!(t, idempotent_session_token(b"secret-1", &id, "k2"));
        assert_ne!(
            t,
            idempotent_session_token(b"secret-1", &uuid::Uuid::new_v4(), "k")
        );
    }

    #[test]
    fn api_keys() {
        let keys = vec!["alpha".to_owned(), "beta".to_owned()];
        assert!(api_key_matches("beta", &keys));
        assert!(!api_key_matches("gamma", &keys));
        assert!(!api_key_matches("", &keys));
        assert!(!api_key_matches("alpha", &[]));
    }
}
