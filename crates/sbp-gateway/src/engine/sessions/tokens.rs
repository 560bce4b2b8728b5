//! Session token hashes kept in memory, so the hot token checks (ATTACH_SESSION, the backend
//! tool-call endpoint) skip a store read. Exact, not a heuristic: a session's token hash is written
//! once when the session is made and never changes, even when the session moves between gateways
//! (federation keeps its id and token). A deleted session's hash is forgotten here; another
//! replica's copy, and the one of a copy dropped when a move was refused, still matches its
//! token: the attach then finds no session to mark attached, and the other routes read the
//! session itself.

use std::collections::HashMap;
use std::sync::Mutex;

use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use uuid::Uuid;

/// At most this many sessions (48 bytes each in the table, no other allocation: ~0.8 MiB at its
/// largest); when full the cache starts over, which only costs reads.
const CAPACITY: usize = 8192;

#[derive(Debug, Default)]
pub(crate) struct TokenCache {
    /// The SHA-256 of each session's token (the store keeps it hex-encoded).
    hashes: Mutex<HashMap<Uuid, [u8; 32]>>,
}

impl TokenCache {
    /// `Some(matches)` when the session's hash is known, `None` when the store must be asked.
    pub(crate) fn check(&self, id: Uuid, token: &str) -> Option<bool> {
        let known = *self.lock().get(&id)?;
        let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        Some(presented.ct_eq(&known).into())
    }

    /// Remembers a session's stored (hex) token hash; one that does not decode is left out.
    pub(crate) fn remember(&self, id: Uuid, hex_hash: &str) {
        let mut raw = [0u8; 32];
        if hex::decode_to_slice(hex_hash, &mut raw).is_err() {
            return;
        }
        let mut hashes = self.lock();
        if hashes.len() >= CAPACITY && !hashes.contains_key(&id) {
            hashes.clear();
        }
        hashes.insert(id, raw);
    }

    /// Forgets a session's hash (the session was deleted).
    pub(crate) fn forget(&self, id: Uuid) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, [u8; 32]>> {
        self.hashes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{hash_token, new_session_token};

    #[test]
    fn knows_only_what_it_was_told_and_compares_exactly() {
        let cache = TokenCache::default();
        let (id, token) = (Uuid::now_v7(), new_session_token());
        assert_eq!(cache.check(id, &token), None);
        cache.remember(id, &hash_token(&token));
        assert_eq!(cache.check(id, &token), Some(true));
        assert_eq!(cache.check(id, &new_session_token()), Some(false));
        assert_eq!(cache.check(Uuid::now_v7(), &token), None);
    }

    #[test]
    fn stays_bounded() {
        let cache = TokenCache::default();
        let ids: Vec<Uuid> = (0..CAPACITY + 10).map(|_| Uuid::now_v7()).collect();
        let hash = hash_token("t");
        for id in &ids {
            cache.remember(*id, &hash);
        }
        let len = cache.lock().len();
        assert!(len <= CAPACITY, "{len}");
        assert_eq!(cache.check(ids[CAPACITY + 9], "t"), Some(true));
        assert_eq!(cache.check(ids[CAPACITY + 9], "x"), Some(false));
    }

    #[test]
    fn a_hash_that_is_not_hex_sha256_is_not_cached() {
        let cache = TokenCache::default();
        let id = Uuid::now_v7();
        cache.remember(id, "not-a-hash");
        assert_eq!(cache.check(id, "anything"), None);
    }
}
