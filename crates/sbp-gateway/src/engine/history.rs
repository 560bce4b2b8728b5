//! Recent sessions' transcripts kept in memory as the JSON each message is sent upstream as, so a
//! turn reads, parses and re-serialises only the messages it adds, not the whole history.
//!
//! Coherent without being told: transcripts only grow (a message, once stored at a position,
//! never changes; only erasing the session removes it), and every turn reads its session's record,
//! whose `message_count` and `message_bytes` say how many messages the store holds and how long
//! their JSON is. An entry holding fewer is topped up with the ones after it (another replica, or
//! a backend, appended them); one that does not fit the record (more messages, or the same number
//! with other bytes: a transcript adopted again under its id), or appended out of turn, is
//! dropped. A memory budget bounds the whole: the least recently used sessions are evicted first,
//! and a transcript larger than the budget is not kept.

use std::sync::{Arc, Mutex, MutexGuard};

use hashlink::LinkedHashMap;
use sbp_llm::tool_names::{SERVER_PREFIX, SURFACE_PREFIX};
use sbp_protocol::{MessageView, Prior, PriorMessage};
use sbp_store::MessageRecord;
use serde_json::Value;
use uuid::Uuid;

/// A session's transcript as a turn reads it: each message serialised once, and whether the
/// HTTP client ever saw it (the gateway's own tool rounds it did not).
#[derive(Debug, Clone, Default)]
pub struct History {
    /// The messages, in the chunks a request sends them from.
    messages: Prior,
    /// `hidden[i]`: message `i` is an assistant message calling only gateway tools, or a tool
    /// message answering one of those calls.
    hidden: Vec<bool>,
    /// How many messages are not hidden (asked every turn: counted as they come).
    shown: usize,
    /// The gateway tool-call ids seen so far, for the tool messages answering them.
    gateway_calls: Vec<String>,
    /// The memory the gateway call ids keep alive.
    weight: usize,
}

impl History {
    /// Appends messages as written: (role column, body as its JSON text), in transcript order.
    pub fn extend<'a>(&mut self, messages: impl IntoIterator<Item = (&'a str, &'a str)>) {
        for (role, json) in messages {
            // Only an assistant message's `tool_calls` or a tool message's `tool_call_id` can hide
            // it; the text, serialised from a `Value`, names such a key as it is.
            let hidden = matches!(role, "assistant" | "tool") && json.contains("\"tool_call") && {
                let body = serde_json::from_str(json).unwrap_or(Value::Null);
                self.hides(role, MessageView(&body))
            };
            self.messages.push_json(role, json);
            self.count(hidden);
        }
    }

    /// Appends stored records, in transcript order.
    pub fn extend_records(&mut self, records: &[MessageRecord]) {
        for r in records {
            let hidden = self.hides(&r.role, MessageView(&r.body));
            self.messages.push(&r.role, &r.body);
            self.count(hidden);
        }
    }

    /// Notes the message just pushed as hidden from the HTTP client or shown to it.
    fn count(&mut self, hidden: bool) {
        self.hidden.push(hidden);
        self.shown += usize::from(!hidden);
    }

    /// Whether a message with this role column and body is hidden from the HTTP client; an
    /// assistant message calling only gateway tools has its call ids noted for the answers.
    fn hides(&mut self, role: &str, view: MessageView<'_>) -> bool {
        if role == "assistant" {
            let gateway_only = view.has_tool_calls()
                && view
                    .tool_calls()
                    .all(|c| c.name().is_some_and(is_gateway_function));
            if gateway_only {
                for id in view.tool_calls().filter_map(|c| c.id()) {
                    self.weight += id.len();
                    self.gateway_calls.push(id.to_owned());
                }
            }
            gateway_only
        } else {
            role == "tool"
                && view
                    .tool_call_id()
                    .is_some_and(|id| self.gateway_calls.iter().any(|g| g == id))
        }
    }

    pub fn len(&self) -> usize {
        self.messages.stored_count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The messages, as a request sends them ahead of its own (a clone shares their chunks).
    pub fn prior(&self) -> &Prior {
        &self.messages
    }

    pub fn messages(&self) -> impl Iterator<Item = PriorMessage<'_>> {
        self.messages.stored()
    }

    /// The messages the HTTP client saw, in order.
    pub fn client_view(&self) -> impl Iterator<Item = PriorMessage<'_>> {
        self.messages()
            .zip(&self.hidden)
            .filter(|(_, hidden)| !**hidden)
            .map(|(m, _)| m)
    }

    /// How many messages the HTTP client saw.
    pub fn client_len(&self) -> usize {
        self.shown
    }

    /// The memory the transcript keeps alive: its chunks, the hidden flags, the gateway call ids.
    fn weight(&self) -> usize {
        self.messages.weight() + self.hidden.capacity() + self.weight
    }

    /// The messages' JSON text in bytes: what the store counts as the session's `message_bytes`.
    fn bytes(&self) -> u64 {
        self.messages.stored_bytes() as u64
    }
}

/// Whether a function name is one the gateway offers (its surface and MCP-server tools).
fn is_gateway_function(name: &str) -> bool {
    name.starts_with(SURFACE_PREFIX) || name.starts_with(SERVER_PREFIX)
}

/// What the cache holds of a session the store says has `count` messages: shared with the cache,
/// not copied (a turn appends through [`HistoryCache::extend`], which copies only if another turn
/// still holds the same transcript).
pub enum Cached {
    /// All of them.
    Whole(Arc<History>),
    /// The first `History::len()`; the rest are to be read from the store.
    Prefix(Arc<History>),
    Nothing,
}

/// The transcripts, least recently used first, within `budget` bytes.
#[derive(Debug)]
pub struct HistoryCache {
    budget: usize,
    inner: Mutex<Inner>,
}

/// How many erased sessions are remembered, so that a turn which read a transcript just before
/// its session was erased does not put it back.
const ERASED_REMEMBERED: usize = 1024;

#[derive(Debug, Default)]
struct Inner {
    sessions: LinkedHashMap<Uuid, Arc<History>>,
    weight: usize,
    erased: LinkedHashMap<Uuid, ()>,
}

impl HistoryCache {
    /// A cache of at most `budget` bytes of transcript; 0 keeps nothing.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::default(),
        }
    }

    /// The session's transcript as far as it is held, for a store that holds `count` messages
    /// of `bytes` bytes of JSON.
    pub fn get(&self, id: Uuid, count: u64, bytes: u64) -> Cached {
        let mut inner = self.lock();
        let Some(held) = inner.sessions.to_back(&id) else {
            return Cached::Nothing;
        };
        let held_count = held.len() as u64;
        if held_count == count && held.bytes() == bytes {
            return Cached::Whole(held.clone());
        }
        if held_count < count && held.bytes() < bytes {
            return Cached::Prefix(held.clone());
        }
        // Not what the store holds: not this session's transcript any more.
        inner.remove(id);
        Cached::Nothing
    }

    /// Keeps `history` as the session's whole transcript (a newer one replaces an older).
    pub fn put(&self, id: Uuid, history: Arc<History>) {
        let mut inner = self.lock();
        if history.weight() > self.budget {
            inner.remove(id);
            return;
        }
        if inner.erased.contains_key(&id)
            || inner
                .sessions
                .get(&id)
                .is_some_and(|held| held.len() > history.len())
        {
            return;
        }
        inner.remove(id);
        inner.weight += history.weight();
        inner.sessions.insert(id, history);
        inner.evict(self.budget);
    }

    /// Appends messages the store placed at `first_seq` onwards. When the entry does not end
    /// exactly there (another writer came between), it is dropped: the next turn reads again.
    /// The append runs outside the lock: while a request still holds the transcript's chunks it
    /// copies the last of them, and now and then merges chunks up to the whole transcript, which
    /// would hold every other session's turns meanwhile. The entry is out of the cache during the
    /// append (a read of it then goes to the store) and goes back as [`Self::put`] allows.
    /// Returns the transcript with the messages appended, whether or not the cache kept it.
    pub fn extend<'a>(
        &self,
        id: Uuid,
        first_seq: u64,
        messages: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<Arc<History>> {
        let mut held = {
            let held = self.lock().remove(id)?;
            if held.len() as u64 != first_seq {
                return None;
            }
            held
        };
        Arc::make_mut(&mut held).extend(messages);
        self.put(id, held.clone());
        Some(held)
    }

    /// Drops an erased session's transcript, and keeps it from being put back by a turn that
    /// read it before the erasure.
    pub fn erased(&self, id: Uuid) {
        let mut inner = self.lock();
        inner.remove(id);
        inner.erased.replace(id, ());
        if inner.erased.len() > ERASED_REMEMBERED {
            inner.erased.pop_front();
        }
    }

    /// (sessions held, bytes held)
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.sessions.len(), inner.weight)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Inner {
    fn remove(&mut self, id: Uuid) -> Option<Arc<History>> {
        let h = self.sessions.remove(&id)?;
        self.weight -= h.weight();
        Some(h)
    }

    fn evict(&mut self, budget: usize) {
        while self.weight > budget {
            let Some((_, h)) = self.sessions.pop_front() else {
                break;
            };
            self.weight -= h.weight();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn history(texts: &[&str]) -> History {
        let bodies: Vec<String> = texts
            .iter()
            .map(|t| json!({"role": "user", "content": t}).to_string())
            .collect();
        let mut h = History::default();
        h.extend(bodies.iter().map(|b| ("user", b.as_str())));
        h
    }

    #[test]
    fn a_whole_transcript_a_prefix_or_nothing() {
        let cache = HistoryCache::new(1 << 20);
        let id = Uuid::now_v7();
        assert!(matches!(cache.get(id, 0, 0), Cached::Nothing));
        let h = history(&["a", "b"]);
        let bytes = h.bytes();
        cache.put(id, Arc::new(h));
        assert!(matches!(cache.get(id, 2, bytes), Cached::Whole(h) if h.len() == 2));
        assert!(matches!(cache.get(id, 5, bytes + 90), Cached::Prefix(h) if h.len() == 2));
        // As many messages, other bytes: the transcript was replaced under its id.
        assert!(matches!(cache.get(id, 2, bytes + 1), Cached::Nothing));
        cache.put(id, Arc::new(history(&["a", "b"])));
        // The store holds fewer than the entry: not this transcript any more, and forgotten.
        assert!(matches!(cache.get(id, 1, bytes), Cached::Nothing));
        assert!(matches!(cache.get(id, 2, bytes), Cached::Nothing));
        assert_eq!(cache.usage().1, 0);
    }

    #[test]
    fn appends_only_where_the_entry_ends() {
        let cache = HistoryCache::new(1 << 20);
        let id = Uuid::now_v7();
        cache.put(id, Arc::new(history(&["a"])));
        let reply = json!({"role": "assistant", "content": "b"}).to_string();
        cache.extend(id, 1, [("assistant", reply.as_str())]);
        let whole = history(&["a"]).bytes() + reply.len() as u64;
        let Cached::Whole(h) = cache.get(id, 2, whole) else {
            panic!("appended");
        };
        assert_eq!(
            h.messages().nth(1).map(PriorMessage::json),
            Some(r#"{"content":"b","role":"assistant"}"#)
        );
        // Another writer appended at 2 and 3 meanwhile: this append at 4 drops the entry.
        cache.extend(id, 4, [("assistant", reply.as_str())]);
        assert!(matches!(cache.get(id, 5, whole * 3), Cached::Nothing));
    }

    /// An append while a request still holds the transcript leaves the request's copy as it
    /// was and keeps the cache's weight exact; an append to an erased session brings nothing back.
    #[test]
    fn appends_beside_a_request_holding_the_transcript() {
        let cache = HistoryCache::new(1 << 20);
        let id = Uuid::now_v7();
        cache.put(id, Arc::new(history(&["a", "b"])));
        let Cached::Whole(held) = cache.get(id, 2, history(&["a", "b"]).bytes()) else {
            panic!("held");
        };
        let reply = json!({"role": "assistant", "content": "c"}).to_string();
        cache.extend(id, 2, [("assistant", reply.as_str())]);
        assert_eq!(held.len(), 2, "the request's copy is unchanged");
        let Cached::Whole(now) = cache.get(id, 3, held.bytes() + reply.len() as u64) else {
            panic!("appended");
        };
        assert_eq!(cache.usage(), (1, now.weight()));
        drop(now);
        cache.erased(id);
        cache.extend(id, 3, [("assistant", reply.as_str())]);
        assert_eq!(cache.usage(), (0, 0));
    }

    #[test]
    fn an_erased_session_is_not_put_back() {
        let cache = HistoryCache::new(1 << 20);
        let id = Uuid::now_v7();
        let h = Arc::new(history(&["secret"]));
        cache.put(id, h.clone());
        cache.erased(id);
        // A turn that read the transcript before the erasure puts it back: refused.
        cache.put(id, h.clone());
        assert!(matches!(cache.get(id, 1, h.bytes()), Cached::Nothing));
        assert_eq!(cache.usage(), (0, 0));
    }

    #[test]
    fn evicts_the_least_recently_used_within_the_budget() {
        let big = "x".repeat(1000);
        let one = history(&[&big]);
        let (w, b) = (one.weight(), one.bytes());
        let cache = HistoryCache::new(w * 2 + w / 2);
        let (a, bb, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        cache.put(a, Arc::new(history(&[&big])));
        cache.put(bb, Arc::new(history(&[&big])));
        assert!(
            matches!(cache.get(a, 1, b), Cached::Whole(_)),
            "a used last"
        );
        cache.put(c, Arc::new(history(&[&big])));
        assert!(matches!(cache.get(bb, 1, b), Cached::Nothing), "b evicted");
        assert!(matches!(cache.get(a, 1, b), Cached::Whole(_)));
        assert!(matches!(cache.get(c, 1, b), Cached::Whole(_)));
        assert!(cache.usage().1 <= w * 2 + w / 2);
        // A transcript over the whole budget is not kept.
        let huge = "x".repeat(10_000);
        let over = history(&[&huge]);
        let over_bytes = over.bytes();
        cache.put(a, Arc::new(over));
        assert!(matches!(cache.get(a, 1, over_bytes), Cached::Nothing));
        let none = HistoryCache::new(0);
        none.put(a, Arc::new(history(&["a"])));
        assert_eq!(none.usage(), (0, 0));
    }

    /// Whether the transcript came as written (JSON text) or as read from the store (records),
    /// a round of the gateway's own tools is hidden and the messages around it are not.
    #[test]
    fn the_gateways_tool_rounds_are_hidden_from_the_client_view() {
        let messages = [
            ("user", json!({"role": "user", "content": "where am I?"})),
            (
                "assistant",
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "surface_gps", "arguments": "{}"}}]}),
            ),
            (
                "tool",
                json!({"role": "tool", "tool_call_id": "c1", "content": "{}"}),
            ),
            (
                "assistant",
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}),
            ),
            (
                "tool",
                json!({"role": "tool", "tool_call_id": "c2", "content": "found"}),
            ),
            (
                "assistant",
                json!({"role": "assistant", "content": "Tokyo"}),
            ),
        ];
        let texts: Vec<String> = messages.iter().map(|(_, b)| b.to_string()).collect();
        let mut written = History::default();
        written.extend(
            messages
                .iter()
                .zip(&texts)
                .map(|((r, _), t)| (*r, t.as_str())),
        );
        let records: Vec<MessageRecord> = messages
            .iter()
            .enumerate()
            .map(|(seq, (role, body))| MessageRecord {
                seq: seq as u64,
                role: (*role).into(),
                body: body.clone(),
                model_used: None,
                cost_usd: None,
                created_at: chrono::Utc::now(),
            })
            .collect();
        let mut read = History::default();
        read.extend_records(&records);
        for h in [written, read] {
            assert_eq!(h.len(), 6);
            assert_eq!(h.client_len(), 4);
            let seen: Vec<&str> = h.client_view().map(|m| m.role()).collect();
            assert_eq!(seen, ["user", "assistant", "tool", "assistant"]);
            assert_eq!(
                h.messages().nth(4).map(PriorMessage::json),
                Some(texts[4].as_str())
            );
        }
    }
}
