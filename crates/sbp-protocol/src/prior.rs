//! The stored part of a request's transcript: messages kept as the JSON text they are sent
//! upstream as, joined in a few shared chunks. Forwarding a long history then costs a reference
//! count per chunk and one copy of its bytes, nothing per message; a message is parsed only when
//! something reads it.
//!
//! Chunks are immutable once shared: a transcript and its clones (a cache's entry, the requests
//! in flight) share them, and appending writes into the last chunk only while nobody else holds
//! it, else starts a new one. Neighbouring chunks are merged while the newer is at least half as
//! long as the older, so each chunk is more than twice as long as the next: a transcript of `n`
//! bytes has at most about log2(n) chunks whatever its messages' lengths (merging only when the
//! newer is as long as the older let messages that each come shorter than the last keep a chunk
//! each), and a message is copied a logarithmic number of times over the transcript's life.

use std::fmt;
use std::sync::Arc;

use serde_json::Value;

/// Stored messages in transcript order, and the messages placed among them for one request (a
/// surface's system note), which are never part of the shared chunks.
#[derive(Clone, Default)]
pub struct Prior {
    chunks: Vec<Arc<Chunk>>,
    /// Stored messages (inserted ones not counted).
    stored: usize,
    /// The stored messages' JSON text in bytes (commas between them not counted).
    bytes: usize,
    /// (before which stored message, the message) in position order.
    inserted: Vec<(usize, Inserted)>,
}

#[derive(Clone)]
struct Inserted {
    role: Role,
    json: String,
}

#[derive(Default)]
struct Chunk {
    /// The messages' JSON, joined by commas.
    text: String,
    /// Where each message's JSON ends in `text`.
    ends: Vec<usize>,
    roles: Vec<Role>,
}

/// A stored message's role column: the four OpenAI roles without an allocation each.
#[derive(Clone, PartialEq, Eq)]
enum Role {
    System,
    User,
    Assistant,
    Tool,
    Other(Box<str>),
}

impl Role {
    fn new(role: &str) -> Self {
        match role {
            "system" => Self::System,
            "user" => Self::User,
            "assistant" => Self::Assistant,
            "tool" => Self::Tool,
            other => Self::Other(other.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
            Self::Other(r) => r,
        }
    }
}

/// One message of a [`Prior`]: its role (as stored) and its JSON text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorMessage<'a> {
    role: &'a str,
    json: &'a str,
}

impl<'a> PriorMessage<'a> {
    pub fn role(self) -> &'a str {
        self.role
    }

    /// The message's JSON text.
    pub fn json(self) -> &'a str {
        self.json
    }

    /// The message parsed (any JSON; `null` if the text were not, which the writer rules out).
    pub fn parse(self) -> Value {
        serde_json::from_str(self.json).unwrap_or(Value::Null)
    }
}

impl Chunk {
    fn len(&self) -> usize {
        self.ends.len()
    }

    fn message(&self, i: usize) -> PriorMessage<'_> {
        let start = match i {
            0 => 0,
            _ => self.ends[i - 1] + 1,
        };
        PriorMessage {
            role: self.roles[i].as_str(),
            json: &self.text[start..self.ends[i]],
        }
    }

    fn push_json(&mut self, role: Role, json: &str) {
        if !self.text.is_empty() {
            self.text.push(',');
        }
        self.text.push_str(json);
        self.ends.push(self.text.len());
        self.roles.push(role);
    }

    /// Appends `other`'s messages.
    fn append(&mut self, other: &Chunk) {
        #[cfg(test)]
        tests::COPIED.with(|c| c.set(c.get() + other.text.len()));
        let base = if self.text.is_empty() {
            0
        } else {
            self.text.push(',');
            self.text.len()
        };
        self.text.push_str(&other.text);
        self.ends.extend(other.ends.iter().map(|e| e + base));
        self.roles.extend(other.roles.iter().cloned());
    }

    fn weight(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.text.capacity()
            + self.ends.capacity() * std::mem::size_of::<usize>()
            + self.roles.capacity() * std::mem::size_of::<Role>()
    }
}

impl Prior {
    /// Appends a stored message (its role column and body), serialising it once.
    pub fn push(&mut self, role: &str, body: &Value) {
        // Serialising a `Value` cannot fail (its keys are strings); keep `null` if it ever did.
        let json = serde_json::to_string(body).unwrap_or_else(|_| "null".to_owned());
        self.push_json(role, &json);
    }

    /// Appends a stored message given as its compact JSON text (a `Value` serialised: what the
    /// store keeps and counts).
    pub fn push_json(&mut self, role: &str, json: &str) {
        self.bytes += json.len();
        self.stored += 1;
        let shared = self
            .chunks
            .last_mut()
            .is_none_or(|c| Arc::get_mut(c).is_none());
        if shared {
            self.chunks.push(Arc::new(Chunk::default()));
        }
        if let Some(tail) = self.chunks.last_mut().and_then(Arc::get_mut) {
            tail.push_json(Role::new(role), json);
        }
        self.consolidate();
    }

    /// Merges the newest chunks while the newer is at least half as long as the older (in place
    /// when nobody else holds the older one), so that each chunk is more than twice the next.
    fn consolidate(&mut self) {
        while let [.., older, newer] = self.chunks.as_slice() {
            if newer.text.len().saturating_mul(2) < older.text.len() {
                break;
            }
            let newer = self.chunks.pop().unwrap_or_default();
            let Some(older) = self.chunks.last_mut() else {
                break;
            };
            match Arc::get_mut(older) {
                Some(own) => own.append(&newer),
                None => {
                    let mut merged = Chunk::default();
                    merged.text.reserve(older.text.len() + newer.text.len() + 1);
                    merged.append(older);
                    merged.append(&newer);
                    *older = Arc::new(merged);
                }
            }
        }
    }

    /// Places `message` (an object: a system note) before stored message `at` for this request
    /// only; after any placed there already.
    pub fn insert(&mut self, at: usize, role: &str, message: &Value) {
        let at = at.min(self.stored);
        let json = serde_json::to_string(message).unwrap_or_else(|_| "null".to_owned());
        let pos = self.inserted.partition_point(|(p, _)| *p <= at);
        let role = Role::new(role);
        self.inserted.insert(pos, (at, Inserted { role, json }));
    }

    /// Stored and inserted messages.
    pub fn len(&self) -> usize {
        self.stored + self.inserted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stored messages (inserted ones not counted).
    pub fn stored_count(&self) -> usize {
        self.stored
    }

    /// The stored messages' JSON text in bytes.
    pub fn stored_bytes(&self) -> usize {
        self.bytes
    }

    /// The stored messages only, in order.
    pub fn stored(&self) -> impl Iterator<Item = PriorMessage<'_>> {
        self.chunks
            .iter()
            .flat_map(|c| (0..c.len()).map(move |i| c.message(i)))
    }

    /// Every message, inserted ones in place.
    pub fn iter(&self) -> impl Iterator<Item = PriorMessage<'_>> {
        let mut inserted = self.inserted.iter().peekable();
        let mut stored = self.stored();
        // The stored message `stored` yields next.
        let mut next = 0;
        std::iter::from_fn(move || {
            if let Some((_, m)) = inserted.next_if(|(at, _)| *at <= next) {
                return Some(PriorMessage {
                    role: m.role.as_str(),
                    json: &m.json,
                });
            }
            next += 1;
            stored.next()
        })
    }

    /// The messages' JSON joined by commas (what goes between `[` and `]`), appended to `out`.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.reserve(self.json_len());
        let mut first = true;
        let mut sep = |out: &mut Vec<u8>| {
            if !std::mem::take(&mut first) {
                out.push(b',');
            }
        };
        let mut inserted = self.inserted.iter().peekable();
        let mut base = 0;
        for chunk in &self.chunks {
            let end = base + chunk.len();
            // Stored messages of this chunk written so far.
            let mut done = 0;
            while let Some((at, m)) = inserted.next_if(|(at, _)| *at < end) {
                let upto = at - base;
                if upto > done {
                    sep(out);
                    out.extend_from_slice(span(chunk, done, upto).as_bytes());
                    done = upto;
                }
                sep(out);
                out.extend_from_slice(m.json.as_bytes());
            }
            if done < chunk.len() {
                sep(out);
                out.extend_from_slice(span(chunk, done, chunk.len()).as_bytes());
            }
            base = end;
        }
        for (_, m) in inserted {
            sep(out);
            out.extend_from_slice(m.json.as_bytes());
        }
    }

    /// The length of what [`Prior::write_json`] writes.
    pub fn json_len(&self) -> usize {
        let inserted: usize = self.inserted.iter().map(|(_, m)| m.json.len()).sum();
        (self.bytes + inserted + self.len()).saturating_sub(1)
    }

    /// The memory the chunks keep alive (shared with clones; for a cache's memory budget).
    pub fn weight(&self) -> usize {
        self.chunks.iter().map(|c| c.weight()).sum()
    }
}

/// The JSON text of messages `from..to` of `chunk`, commas between them.
fn span(chunk: &Chunk, from: usize, to: usize) -> &str {
    let start = match from {
        0 => 0,
        _ => chunk.ends[from - 1] + 1,
    };
    &chunk.text[start..chunk.ends[to - 1]]
}

impl fmt::Debug for Prior {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prior")
            .field("messages", &self.len())
            .field("chunks", &self.chunks.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PartialEq for Prior {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    std::thread_local! {
        /// The bytes [`Chunk::append`] copied on this thread (each test runs on its own).
        pub(super) static COPIED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn message(i: usize) -> Value {
        json!({"role": if i.is_multiple_of(2) { "user" } else { "assistant" }, "content": format!("m{i} é")})
    }

    fn joined(p: &Prior) -> Value {
        let mut out = b"[".to_vec();
        p.write_json(&mut out);
        out.push(b']');
        assert_eq!(
            out.len(),
            p.json_len() + 2,
            "json_len is what write_json writes"
        );
        serde_json::from_slice(&out).expect("the joined text is a JSON array")
    }

    #[test]
    fn pushed_messages_come_back_in_order_whoever_holds_the_chunks() {
        let mut p = Prior::default();
        let mut held = Vec::new();
        for i in 0..300_usize {
            p.push(
                if i.is_multiple_of(2) {
                    "user"
                } else {
                    "assistant"
                },
                &message(i),
            );
            // A request in flight holds a clone now and then: appends must not change it.
            if i % 7 == 0 {
                held.push((i + 1, p.clone()));
            }
        }
        let all: Vec<Value> = (0..300).map(message).collect();
        assert_eq!(joined(&p), Value::Array(all.clone()));
        assert_eq!(p.iter().map(PriorMessage::parse).collect::<Vec<_>>(), all);
        assert_eq!(p.iter().nth(3).map(PriorMessage::role), Some("assistant"));
        for (n, h) in &held {
            assert_eq!(joined(h), Value::Array(all[..*n].to_vec()));
        }
        assert!(p.chunks.len() <= 12, "{} chunks", p.chunks.len());
        let bytes: usize = all.iter().map(|m| m.to_string().len()).sum();
        assert_eq!(p.stored_bytes(), bytes);
    }

    #[test]
    fn inserted_messages_go_where_they_were_placed_and_stay_out_of_clones() {
        let mut p = Prior::default();
        p.push("system", &json!({"role": "system", "content": "s"}));
        let base = p.clone();
        for i in 0..5 {
            p.push("user", &message(i * 2));
        }
        let note = json!({"role": "system", "content": "note"});
        let mut q = p.clone();
        q.insert(1, "system", &note);
        q.insert(6, "system", &json!({"role": "system", "content": "end"}));
        q.insert(0, "system", &json!({"role": "system", "content": "first"}));
        let got = joined(&q);
        let roles: Vec<&str> = q.iter().map(PriorMessage::role).collect();
        assert_eq!(roles.len(), 9);
        assert_eq!(got[0]["content"], "first");
        assert_eq!(got[1]["content"], "s");
        assert_eq!(got[2], note);
        assert_eq!(got[8]["content"], "end");
        assert_eq!(
            q.iter().map(PriorMessage::parse).collect::<Vec<_>>(),
            got.as_array().cloned().unwrap_or_default()
        );
        assert_eq!(
            joined(&p).as_array().map(Vec::len),
            Some(6),
            "the original has no note"
        );
        assert_eq!(joined(&base).as_array().map(Vec::len), Some(1));
    }

    /// A deterministic pseudo-random sequence (a 64-bit LCG; the high bits are the good ones).
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((self.0 >> 33) as usize) % n.max(1)
        }
    }

    /// What a prior should say: its stored (role, body) in order, and the inserted ones as
    /// (before which stored message, role, body) in insertion order.
    #[derive(Clone, Default)]
    struct Model {
        stored: Vec<(String, Value)>,
        inserted: Vec<(usize, String, Value)>,
    }

    impl Model {
        fn all(&self) -> Vec<(String, Value)> {
            let mut out = Vec::new();
            for i in 0..=self.stored.len() {
                for (at, role, m) in &self.inserted {
                    if *at == i {
                        out.push((role.clone(), m.clone()));
                    }
                }
                if let Some(s) = self.stored.get(i) {
                    out.push(s.clone());
                }
            }
            out
        }
    }

    /// A message of a length and content chosen by `rng`: escapes, non-ASCII, nesting, numbers.
    fn random_message(rng: &mut Lcg, n: usize) -> (String, Value) {
        let role = ["system", "user", "assistant", "tool", "developer"][rng.below(5)];
        let text: String = (0..rng.below(40))
            .map(|_| ['a', 'é', '"', '\\', '\n', '\u{1}', '😀', ',', ']', '日'][rng.below(10)])
            .collect();
        let body = match rng.below(4) {
            0 => json!({"role": role, "content": text}),
            1 => json!({"role": role, "content": null, "n": n, "f": 0.1 + n as f64,
                        "tool_calls": [{"id": format!("c{n}"), "function": {"name": "f", "arguments": "{}"}}]}),
            2 => {
                json!({"role": role, "content": [{"type": "text", "text": text}], "x": {"y": [1, -2, true]}})
            }
            // Messages growing shorter: the chunk order most likely to leave many small chunks.
            _ => json!({"role": role, "content": "x".repeat(200_usize.saturating_sub(n % 200))}),
        };
        (role.to_owned(), body)
    }

    /// Everything a prior says agrees with its model.
    fn check(p: &Prior, model: &Model, what: &str) {
        let all = model.all();
        assert_eq!(p.len(), all.len(), "{what}: len");
        assert_eq!(p.is_empty(), all.is_empty(), "{what}: is_empty");
        assert_eq!(p.stored_count(), model.stored.len(), "{what}: stored_count");
        let bytes: usize = model
            .stored
            .iter()
            .map(|(_, m)| serde_json::to_string(m).map_or(0, |s| s.len()))
            .sum();
        assert_eq!(p.stored_bytes(), bytes, "{what}: stored_bytes");
        let stored: Vec<(String, Value)> = p
            .stored()
            .map(|m| (m.role().to_owned(), m.parse()))
            .collect();
        assert_eq!(stored, model.stored, "{what}: stored()");
        let iterated: Vec<(String, Value)> =
            p.iter().map(|m| (m.role().to_owned(), m.parse())).collect();
        assert_eq!(iterated, all, "{what}: iter()");
        let bodies: Vec<Value> = all.into_iter().map(|(_, m)| m).collect();
        assert_eq!(joined(p), Value::Array(bodies), "{what}: write_json");
        // Written into a buffer that already holds something, it only appends.
        let mut out = b"xyz".to_vec();
        p.write_json(&mut out);
        assert_eq!(&out[..3], b"xyz", "{what}");
        assert_eq!(out.len(), 3 + p.json_len(), "{what}");
    }

    /// Pseudo-random sequences of pushes, clones held (as requests in flight hold them) and
    /// dropped, pushes onto a held clone (a diverging copy) and inserted messages (at 0, within
    /// and between chunks, at the end, several at one place), every prior checked against a
    /// plain list after each step: no message is lost, reordered or changed in anyone's copy.
    #[test]
    fn any_sequence_of_pushes_clones_and_inserts_reads_like_a_plain_list() {
        for seed in 0..20_u64 {
            let mut rng = Lcg(seed);
            let mut main = (Prior::default(), Model::default());
            let mut held: Vec<(Prior, Model)> = Vec::new();
            let steps = 40 + rng.below(120);
            for step in 0..steps {
                let what = format!("seed {seed} step {step}");
                match rng.below(10) {
                    0..=4 => {
                        let (role, body) = random_message(&mut rng, step);
                        main.0.push(&role, &body);
                        main.1.stored.push((role, body));
                    }
                    5 | 6 => held.push(main.clone()),
                    7 if !held.is_empty() => {
                        held.remove(rng.below(held.len()));
                    }
                    8 if !held.is_empty() => {
                        // A held copy goes its own way: the main one must not see it.
                        let i = rng.below(held.len());
                        let (role, body) = random_message(&mut rng, step);
                        held[i].0.push(&role, &body);
                        held[i].1.stored.push((role, body));
                    }
                    _ => {
                        // A request's note, on a copy of its own: 0, the end, or anywhere.
                        let mut copy = main.clone();
                        for _ in 0..=rng.below(3) {
                            let stored = copy.1.stored.len();
                            let at = match rng.below(3) {
                                0 => 0,
                                1 => stored,
                                _ => rng.below(stored + 1),
                            };
                            let note =
                                json!({"role": "system", "content": format!("note {step} é\"")});
                            copy.0.insert(at, "system", &note);
                            copy.1.inserted.push((at, "system".to_owned(), note));
                            check(&copy.0, &copy.1, &format!("{what}: inserted at {at}"));
                        }
                        // A note's copy may be pushed to as well (the note keeps its place).
                        if rng.below(2) == 0 {
                            let (role, body) = random_message(&mut rng, step);
                            copy.0.push(&role, &body);
                            copy.1.stored.push((role, body));
                            check(&copy.0, &copy.1, &format!("{what}: pushed after a note"));
                        }
                        held.push(copy);
                    }
                }
                // A few requests in flight at once (more only slow the test).
                if held.len() > 6 {
                    held.remove(rng.below(held.len()));
                }
                check(&main.0, &main.1, &format!("{what}: main"));
                for (i, (p, m)) in held.iter().enumerate() {
                    check(p, m, &format!("{what}: held {i}"));
                }
            }
        }
    }

    /// The chunk count stays logarithmic in the bytes, and each byte is copied a logarithmic
    /// number of times, whatever the message lengths: the user's message appended while the
    /// turn's request holds the last chunk, the reply after it let go (a turn in the gateway).
    /// Merging only when the newer chunk was as long as the older left messages that come shorter
    /// each turn a chunk each (1,000 turns: 1,000 chunks), and once they stopped shrinking, one
    /// merge after another copied the grown newest chunk into each small older one (~190 times
    /// the transcript's bytes here; ~800 times over 5,000 turns).
    #[test]
    fn chunks_stay_few_and_copies_logarithmic_whatever_the_message_lengths() {
        let shrinking = |i: usize| 1_000 - i;
        let then_flat = |i: usize| 600_usize.saturating_sub(i).max(10);
        let equal = |_: usize| 50;
        let cases: [(&str, &dyn Fn(usize) -> usize); 3] = [
            ("shrinking", &shrinking),
            ("shrinking, then flat", &then_flat),
            ("equal", &equal),
        ];
        for (name, len) in cases {
            COPIED.with(|c| c.set(0));
            let mut p = Prior::default();
            let mut most = 0;
            for i in 0..1_000 {
                let request = p.clone();
                p.push("user", &json!({"content": "u".repeat(len(i))}));
                drop(request);
                p.push("assistant", &json!({"content": "a".repeat(3 * len(i))}));
                most = most.max(p.chunks.len());
            }
            let log2 = (usize::BITS - p.json_len().leading_zeros()) as usize;
            assert!(
                most <= log2 + 1,
                "{name}: {most} chunks for {} bytes",
                p.json_len()
            );
            let copied = COPIED.with(std::cell::Cell::get);
            assert!(
                copied <= 2 * log2 * p.json_len(),
                "{name}: {copied} bytes copied for {}",
                p.json_len()
            );
        }
    }

    #[test]
    fn an_empty_prior_writes_nothing() {
        let p = Prior::default();
        let mut out = Vec::new();
        p.write_json(&mut out);
        assert!(out.is_empty());
        assert_eq!(p.json_len(), 0);
        assert!(p.is_empty());
    }
}
