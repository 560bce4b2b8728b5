//! Session token hashes kept in memory, so the hot token checks (ATTACH_SESSION, the backend
//! tool-call endpoint) skip a store read. Exact, not a heuristic: a session's token hash is written
//! once when the session is made and never changes, and sessions are never deleted, so a cached
//! hash is the stored one on every replica.

use std::collections::HashMap;
use std::sync::Mutex;

use uuid::Uuid;

/// At most this many sessions (~1 MiB); when full the cache starts over, which only costs reads.
const CAPACITY: usize = 8192;

#[derive(Debug, Default)]
pub(crate) struct TokenCache {
    hashes: Mutex<HashMap<Uuid, Box<str>>>,
}

impl TokenCache {
    /// `Some(matches)` when the session's hash is known, `None` when the store must be asked.
    pub(crate) fn check(&self, id: Uuid, token: &str) -> Option<bool> {
        let hashes = self.hashes.lock().unwrap_or_else(|p| p.into_inner());
        let hash = hashes.get(&id)?;
        Some(crate::auth::token_matches(token, hash))
    }

    pub(crate) fn remember(&self, id: Uuid, hash: &str) {
        let mut hashes = self.hashes.lock().unwrap_or_else(|p| p.into_inner());
        if hashes.len() >= CAPACITY && !hashes.contains_key(&id) {
            hashes.clear();
        }
        hashes.insert(id, hash.into());
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
        for id in &ids {
            cache.remember(*id, "h");
        }
        let len = cache.hashes.lock().map(|h| h.len()).unwrap_or(0);
        assert!(len <= CAPACITY, "{len}");
        assert_eq!(cache.check(ids[CAPACITY + 9], "x"), Some(false));
    }
}
