//! The Tether in Redis Streams (`sbp serve --tether redis://...`): [`TetheredStore`] wraps any
//! [`Store`] and serves its [`TetherStore`] methods from one stream per session, while the SQL store
//! stays the source of truth for what a turn wrote.
//!
//! # Design: the SQL tether row is an outbox, the stream is the delivery queue
//!
//! `finish_turn` still runs on the wrapped store, so the reply and its tether entry (with its seq,
//! from the session row's counter) are committed in one SQL transaction, as before: the invariant
//! "tether = outbox" holds on the SQL side whatever happens to Redis. After COMMIT the entry is
//! appended to the stream `{prefix}tether:{session}` under the id `<seq>-0`, by a Lua script that
//! keeps the session's highest streamed seq in the hash `{prefix}tether:last` and skips every seq at
//! or below it, so a replayed append is a no-op and a seq, once acknowledged, is never streamed
//! again. Seqs of one session commit in order (the session row is locked while one is handed out),
//! so every append is ordered: the fast path appends the new entry only when it follows the last
//! streamed seq; otherwise (a concurrent turn of the same session, an earlier append that failed)
//! it copies every committed entry above the last streamed seq from SQL, in seq order.
//!
//! Reading the tether (`tether_pending`, `tether_count`) and acknowledging it first does the same
//! copy for that session ("reconcile": one indexed SQL read that normally returns nothing), so an
//! entry committed by a gateway that died before its append, or while Redis was unreachable, is
//! streamed before anyone can miss it; `finish_turn` never fails because of Redis once SQL has
//! committed (the failure is logged and the session retried by the relay task every
//! `relay_interval`). Acks are `XTRIM MINID`, deliveries of surfaces without ACK are `XDEL`, counts
//! are `XLEN`; a depth counter kept by the same scripts answers `tether_depth_total` in handoff mode.
//!
//! What happens to the SQL row after the append is the [`TetherMode`]:
//!
//! - **Mirror**: the row stays until the turn is acknowledged or delivered; acks and removals go to
//!   SQL first, then to the stream. Redis is a delivery index that can always be rebuilt: after
//!   Redis lost its data, the next read of a session streams exactly its unacknowledged entries
//!   again. Durable with any Redis persistence, including none; costs one SQL write per ack.
//! - **Handoff**: the relay deletes the outbox rows of entries that reached the stream (batched,
//!   every `relay_interval`); from then on the entry lives only in Redis, and acks touch only Redis.
//!   Durable only when Redis is: `appendonly yes` with `appendfsync always` (Redis answers an XADD
//!   after it reached the disk).
//! - **Auto** (the default) asks Redis (`CONFIG GET`): handoff with `appendonly yes` +
//!   `appendfsync always`, mirror otherwise (and when `CONFIG` is not allowed).
//!
//! # Durability of a tethered turn (what a Redis crash loses)
//!
//! | Redis persistence | mirror | handoff |
//! |---|---|---|
//! | `appendfsync always` | nothing | nothing |
//! | `appendfsync everysec` | nothing | up to ~1 s of appends, acks and removals on an OS crash or power loss (a Redis process crash alone loses nothing): appends older than the outbox's handoff are gone, acked turns may come back |
//! | no AOF (RDB or none) | nothing | everything handed off since the last snapshot |
//!
//! In mirror mode an ack lost with Redis's memory can come back from SQL only if the SQL ack failed
//! too; an acked turn that Redis forgets never returns, since SQL deleted it first. In every mode,
//! a turn acknowledged to the client (HTTP response, TURN_COMPLETE) is in SQL at that moment; a
//! surface in ACK mode never gets a turn twice across a Redis failure (its `last_seq` on attach
//! acknowledges what it has, and the drain starts after it); a surface without ACK can, in the
//! handoff + everysec column. Seqs come from SQL only, so Redis can never make one reused.
//!
//! With encryption at rest (`RedisTetherOptions::sealer`) an entry's `content` field is sealed
//! like the SQL tether's column (bound to its session); the other fields are metadata.
//!
//! A session that moves to another gateway (L6) takes its tether along: the origin's commit drops
//! the session's stream, and the target's adoption streams the carried entries under their seqs
//! (see the [`crate::HoldStore`] impl).
//!
//! An erased session (`delete_session`) loses its stream right after the SQL erasure; a marker
//! `{prefix}tether:erased:{session}` then stops, for a day, any append that read the session's
//! entries before the erasure (a turn's, the relay's) from streaming them again.
//!
//! Not supported: Redis Cluster (the scripts touch a session's stream and two shared keys). Streams
//! and the `last` hash entry of a session are kept after it empties (an empty stream is ~200 bytes)
//! because the `last` seq is what stops a replayed append.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SecondsFormat, Utc};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamId, StreamRangeReply};
use redis::{Script, Value};
use sbp_protocol::{SessionStatus, SnapshotKind};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::RedeemOutcome;
use crate::seal::{Column, Resealed, Sealer};
use crate::{
    AdoptOutcome, AdoptSession, BeginTurn, BeginTurnOutcome, ExportRecord, FailTurn, FinishTurn,
    FinishTurnOutcome, IdempotencyRecord, IdempotencyStore, Lineage, MemoryRecord, MessageRecord,
    MessageStore, NewBundle, NewExport, NewSession, NewTetherEntry, RoamingStore, SessionQuery,
    SessionRecord, SessionStore, SnapshotRecord, SnapshotStore, Store, StoreError, StoreResult,
    TetherEntry, TetherStore, Timestamp, TurnProgress, TurnProgressOutcome, TurnRecord, TurnStore,
};

/// Outbox rows read from SQL per round trip while reconciling one session.
const RECONCILE_BATCH: u32 = 500;

/// What happens to a tether entry's SQL row once the entry is in its stream (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TetherMode {
    /// Handoff when Redis reports `appendonly yes` and `appendfsync always`, mirror otherwise.
    #[default]
    Auto,
    /// The SQL row is deleted once streamed: Redis owns the entry (needs a durable Redis).
    Handoff,
    /// The SQL row stays until acknowledged or delivered: Redis is a rebuildable delivery queue.
    Mirror,
}

impl std::str::FromStr for TetherMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(TetherMode::Auto),
            "handoff" => Ok(TetherMode::Handoff),
            "mirror" => Ok(TetherMode::Mirror),
            other => Err(format!(
                "tether mode must be auto, handoff or mirror, got '{other}'"
            )),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RedisTetherOptions {
    /// Prefix of every key (`{prefix}tether:{session}`, `{prefix}tether:last`, ...).
    pub prefix: String,
    pub mode: TetherMode,
    /// How often the relay retries failed appends and, in handoff mode, deletes streamed outbox rows.
    pub relay_interval: Duration,
    /// Connect and response timeout of each Redis call: a stuck Redis fails a call rather than a turn.
    pub timeout: Duration,
    /// Encryption at rest: seals each entry's content in its stream (the same keyring as the
    /// wrapped store's).
    pub sealer: Sealer,
}

impl Default for RedisTetherOptions {
    fn default() -> Self {
        RedisTetherOptions {
            prefix: "sbp:".to_owned(),
            mode: TetherMode::Auto,
            relay_interval: Duration::from_millis(500),
            timeout: Duration::from_secs(5),
            sealer: Sealer::off(),
        }
    }
}

/// `redis://user:password@host/...` without its credentials, for logs.
pub fn redacted_redis_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// Appends entries to a session's stream, skipping seqs at or below the session's last streamed
/// one. KEYS: stream, last-hash, depth, erased-marker. ARGV: session, `next` | `all`, then per
/// entry: seq, field count, fields and values. In `next` mode a first seq that does not follow
/// the last one appends nothing and answers `{-1, last}`. A session erased lately (its marker is
/// there) gets nothing: an append that read its entries before the erasure must not bring them
/// back. Answers `{added, last}`.
const APPEND_LUA: &str = r"
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 0} end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if ARGV[2] == 'next' and tonumber(ARGV[3]) > last + 1 then
  return {-1, last}
end
local added = 0
local last_text = nil
local i = 3
while i <= #ARGV do
  local seq = tonumber(ARGV[i])
  local n = tonumber(ARGV[i + 1])
  if seq > last then
    local args = {'XADD', KEYS[1], ARGV[i] .. '-0'}
    for j = i + 2, i + 1 + 2 * n do args[#args + 1] = ARGV[j] end
    local r = redis.pcall(unpack(args))
    -- An error means the stream is already past this id: the entry is there or was acknowledged.
    if not (type(r) == 'table' and r.err) then added = added + 1 end
    last = seq
    last_text = ARGV[i]
  end
  i = i + 2 + 2 * n
end
if last_text then redis.call('HSET', KEYS[2], ARGV[1], last_text) end
if added > 0 then redis.call('INCRBY', KEYS[3], added) end
return {added, last}
";

/// Acknowledges every entry with a seq up to ARGV[1]. KEYS: stream, depth.
const ACK_LUA: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1] .. '-1')
if n > 0 then redis.call('DECRBY', KEYS[2], n) end
return n
";

/// Removes the entries with the ids in ARGV. KEYS: stream, depth.
const REMOVE_LUA: &str = r"
if #ARGV == 0 or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = redis.call('XDEL', KEYS[1], unpack(ARGV))
if n > 0 then redis.call('DECRBY', KEYS[2], n) end
return n
";

/// Forgets a session's stream: its entries, its last streamed seq and their count in the depth.
/// KEYS: stream, last-hash, depth, erased-marker. ARGV: session, then how many seconds the marker
/// that stops later appends stays (the session was erased), or 0 to clear it (the session is
/// here again, or left). Answers how many entries were dropped.
const FORGET_LUA: &str = r"
local n = redis.call('XLEN', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if n > 0 then redis.call('DECRBY', KEYS[3], n) end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[2])
else
  redis.call('DEL', KEYS[4])
end
return n
";

/// How long an erased session's marker stops appends to its stream: far longer than an append
/// that read the session's entries before the erasure can take.
const ERASED_MARKER_SECS: u64 = 86_400;

/// Rewrites a stream with the same ids and new fields (a reseal), only if it still holds exactly
/// the expected ids. KEYS: stream. ARGV: n, the n ids, then per entry: id, field count, fields and
/// values. Answers 1 when rewritten, 0 when the stream changed in between.
const REWRITE_LUA: &str = r"
local n = tonumber(ARGV[1])
local now = redis.call('XRANGE', KEYS[1], '-', '+')
if #now ~= n then return 0 end
for i = 1, n do
  if now[i][1] ~= ARGV[1 + i] then return 0 end
end
redis.call('DEL', KEYS[1])
local j = 2 + n
while j <= #ARGV do
  local k = tonumber(ARGV[j + 1])
  local args = {'XADD', KEYS[1], ARGV[j]}
  for m = j + 2, j + 1 + 2 * k do args[#args + 1] = ARGV[m] end
  redis.call(unpack(args))
  j = j + 2 + 2 * k
end
return 1
";

/// How a reseal names the streams' entries in its report.
const STREAM_COLUMN: &str = "redis tether.content";

/// Times a reseal reads a stream again when it changed while being resealed.
const RESEAL_ATTEMPTS: usize = 5;

/// Work the relay task owes: sessions whose append failed, (handoff mode) outbox rows to delete,
/// and streams of erased sessions still to drop.
#[derive(Default)]
struct Owed {
    unstreamed: HashSet<Uuid>,
    /// Session -> highest seq known to be in its stream, whose outbox rows may go.
    handoff: HashMap<Uuid, u64>,
    erased: HashSet<Uuid>,
}

struct Shared<S: ?Sized> {
    inner: Arc<S>,
    redis: ConnectionManager,
    prefix: String,
    handoff: bool,
    append: Script,
    ack: Script,
    remove: Script,
    forget: Script,
    owed: Mutex<Owed>,
    seal: Sealer,
}

/// Any [`Store`] with its tether in Redis Streams (module docs). One `Arc<dyn Store>` for the engine.
pub struct TetheredStore<S: ?Sized> {
    shared: Arc<Shared<S>>,
    relay: JoinHandle<()>,
}

impl<S: ?Sized> Drop for TetheredStore<S> {
    fn drop(&mut self) {
        // The relay only ever redoes idempotent work, so stopping it mid-round loses nothing.
        self.relay.abort();
    }
}

fn redis_err(e: redis::RedisError) -> StoreError {
    StoreError::Backend(format!("redis: {e}"))
}

impl<S: Store + ?Sized + 'static> TetheredStore<S> {
    /// Connects to Redis, resolves the mode and starts the relay task (needs a tokio runtime).
    pub async fn open(inner: Arc<S>, url: &str, opts: RedisTetherOptions) -> StoreResult<Self> {
        let client = redis::Client::open(url).map_err(redis_err)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.timeout))
            .set_response_timeout(Some(opts.timeout))
            .set_number_of_retries(2);
        let mut redis = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(redis_err)?;
        check_keys(&mut redis, &opts.prefix, &opts.sealer).await?;
        if opts.sealer.is_on() {
            inner.record_sealing_tether(&opts.prefix).await?;
        }
        let (aof, fsync) = persistence(&mut redis).await;
        let handoff = match opts.mode {
            TetherMode::Handoff => {
                if !(aof.as_deref() == Some("yes") && fsync.as_deref() == Some("always")) {
                    tracing::warn!(
                        ?aof,
                        ?fsync,
                        "tether handoff mode on a Redis without appendonly yes + appendfsync always: a Redis crash loses handed-off turns"
                    );
                }
                true
            }
            TetherMode::Mirror => false,
            TetherMode::Auto => aof.as_deref() == Some("yes") && fsync.as_deref() == Some("always"),
        };
        tracing::info!(
            url = %redacted_redis_url(url),
            prefix = %opts.prefix,
            mode = if handoff { "handoff" } else { "mirror" },
            ?aof,
            ?fsync,
            "redis tether open"
        );
        let shared = Arc::new(Shared {
            inner,
            redis,
            prefix: opts.prefix,
            handoff,
            append: Script::new(APPEND_LUA),
            ack: Script::new(ACK_LUA),
            remove: Script::new(REMOVE_LUA),
            forget: Script::new(FORGET_LUA),
            owed: Mutex::new(Owed::default()),
            seal: opts.sealer,
        });
        let relay = tokio::spawn(relay_loop(Arc::downgrade(&shared), opts.relay_interval));
        Ok(TetheredStore { shared, relay })
    }

    /// The wrapped store (its tether table is the outbox).
    pub fn inner(&self) -> &Arc<S> {
        &self.shared.inner
    }

    /// The mode in effect: [`TetherMode::Handoff`] or [`TetherMode::Mirror`], never `Auto`.
    pub fn mode(&self) -> TetherMode {
        if self.shared.handoff {
            TetherMode::Handoff
        } else {
            TetherMode::Mirror
        }
    }

    /// Re-seals the content of every entry in this prefix's streams under the keyring's current
    /// key (plain ones included): a stream is rewritten with the same ids in one script, unless it
    /// changed in between (then read again). An entry that does not open is left as it is and
    /// listed. Run it before the wrapped store's reseal, which makes the database forget the
    /// earlier keys only if this was clean. Returns what it rewrote (as `tether streams`).
    pub async fn reseal_streams(&self) -> StoreResult<Resealed> {
        let sh = &self.shared;
        if !sh.seal.is_on() {
            return Err(StoreError::Backend(
                "a reseal needs an encryption key".to_owned(),
            ));
        }
        let pattern = format!("{}tether:*", sh.prefix);
        let mut cursor = 0u64;
        let mut sessions = Vec::new();
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(500)
                .query_async(&mut sh.redis.clone())
                .await
                .map_err(redis_err)?;
            let tail = format!("{}tether:", sh.prefix);
            sessions.extend(
                keys.iter()
                    .filter_map(|k| k.strip_prefix(&tail))
                    .filter_map(|id| Uuid::parse_str(id).ok()),
            );
            if next == 0 {
                break;
            }
            cursor = next;
        }
        sessions.sort();
        sessions.dedup();
        let mut done = Resealed::default();
        for session in sessions {
            done.merge(sh.reseal_stream(session).await?);
        }
        if done.is_clean() {
            // Every entry is under the current key now: the streams no longer need the others.
            let current = sh
                .seal
                .current()
                .map(|id| id.to_string())
                .unwrap_or_default();
            let key = keys_key(&sh.prefix);
            let ids: Vec<String> = redis::cmd("HKEYS")
                .arg(&key)
                .query_async(&mut sh.redis.clone())
                .await
                .map_err(redis_err)?;
            let earlier: Vec<&String> = ids.iter().filter(|id| **id != current).collect();
            if !earlier.is_empty() {
                let _: i64 = redis::cmd("HDEL")
                    .arg(&key)
                    .arg(&earlier)
                    .query_async(&mut sh.redis.clone())
                    .await
                    .map_err(redis_err)?;
            }
        } else {
            done.kept = Some(crate::seal::Kept::Unopened);
        }
        Ok(done)
    }

    /// One round of the relay (the task runs it every `relay_interval`): streams the sessions whose
    /// append failed and, in handoff mode, deletes outbox rows already streamed. Returns how many
    /// outbox rows were deleted.
    pub async fn relay_once(&self) -> StoreResult<u64> {
        self.shared.relay_once().await
    }
}

/// The hash recording the keys this prefix's streams are (or may be) sealed under: key id -> a
/// check value sealed under it, as the SQL stores' `sealing_keys`.
fn keys_key(prefix: &str) -> String {
    format!("{prefix}tether:keys")
}

/// At open, as the SQL stores do: refuses a keyring (or its absence) that does not fit the keys
/// this prefix's streams record, then records the current key before anything is sealed under it.
async fn check_keys(redis: &mut ConnectionManager, prefix: &str, seal: &Sealer) -> StoreResult<()> {
    let key = keys_key(prefix);
    let recorded: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&key)
        .query_async(redis)
        .await
        .map_err(redis_err)?;
    let mut recorded: Vec<(String, String)> = recorded.into_iter().collect();
    recorded.sort();
    if let Some((id, check)) = seal.check(&recorded)? {
        let _: i64 = redis::cmd("HSETNX")
            .arg(&key)
            .arg(&id)
            .arg(&check)
            .query_async(redis)
            .await
            .map_err(redis_err)?;
        tracing::info!(key_id = %id, "encryption at rest: new key recorded for the redis tether");
    }
    Ok(())
}

/// `CONFIG GET appendonly` and `appendfsync`; `None` where Redis does not say (CONFIG disabled).
async fn persistence(redis: &mut ConnectionManager) -> (Option<String>, Option<String>) {
    let mut get = async |name: &str| -> Option<String> {
        let reply: redis::RedisResult<HashMap<String, String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(redis)
            .await;
        reply.ok().and_then(|mut m| m.remove(name))
    };
    let aof = get("appendonly").await;
    let fsync = get("appendfsync").await;
    (aof, fsync)
}

async fn relay_loop<S: Store + ?Sized + 'static>(
    shared: std::sync::Weak<Shared<S>>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(e) = shared.relay_once().await {
            tracing::warn!(error = %e, "tether relay round failed; retried next round");
        }
    }
}

impl<S: Store + ?Sized> Shared<S> {
    fn stream_key(&self, session: Uuid) -> String {
        format!("{}tether:{session}", self.prefix)
    }

    fn last_key(&self) -> String {
        format!("{}tether:last", self.prefix)
    }

    fn depth_key(&self) -> String {
        format!("{}tether:depth", self.prefix)
    }

    fn erased_key(&self, session: Uuid) -> String {
        format!("{}tether:erased:{session}", self.prefix)
    }

    fn owed(&self) -> std::sync::MutexGuard<'_, Owed> {
        // A panic while holding this lock leaves plain sets behind: still consistent to use.
        self.owed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn note_streamed(&self, session: Uuid, up_to: u64) {
        if self.handoff && up_to > 0 {
            let mut owed = self.owed();
            let at = owed.handoff.entry(session).or_insert(0);
            *at = (*at).max(up_to);
        }
    }

    /// [`TetheredStore::reseal_streams`] for one session's stream.
    async fn reseal_stream(&self, session: Uuid) -> StoreResult<Resealed> {
        let key = self.stream_key(session);
        let row = session.to_string();
        for _ in 0..RESEAL_ATTEMPTS {
            let reply: StreamRangeReply = redis::cmd("XRANGE")
                .arg(&key)
                .arg("-")
                .arg("+")
                .query_async(&mut self.redis.clone())
                .await
                .map_err(redis_err)?;
            let mut changed = 0;
            let mut done = Resealed::default();
            let mut entries = Vec::with_capacity(reply.ids.len());
            for s in &reply.ids {
                let mut fields = Vec::with_capacity(s.map.len());
                for (name, value) in &s.map {
                    let value: String = redis::from_redis_value_ref(value).map_err(|_| {
                        StoreError::Backend(format!("redis tether entry {}: bad {name}", s.id))
                    })?;
                    let value = if name == "content"
                        && self.seal.needs_reseal(Sealer::sealed_by(&value))
                    {
                        match self.seal.open(Column::TetherContent, &row, value.clone()) {
                            Ok(plain) => {
                                changed += 1;
                                self.seal
                                    .seal(Column::TetherContent, &row, &plain)?
                                    .into_owned()
                            }
                            // Left as it is (the rewrite keeps it), and listed.
                            Err(e) => {
                                done.note_unopened(STREAM_COLUMN, format!("{session}/{}", s.id), e);
                                value
                            }
                        }
                    } else {
                        value
                    };
                    fields.push((name.clone(), value));
                }
                entries.push((s.id.clone(), fields));
            }
            if changed == 0 {
                return Ok(done);
            }
            let script = Script::new(REWRITE_LUA);
            let mut call = script.prepare_invoke();
            call.key(&key).arg(entries.len());
            for (id, _) in &entries {
                call.arg(id.as_str());
            }
            for (id, fields) in &entries {
                call.arg(id.as_str()).arg(fields.len());
                for (name, value) in fields {
                    call.arg(name.as_str()).arg(value.as_str());
                }
            }
            let rewritten: i64 = call
                .invoke_async(&mut self.redis.clone())
                .await
                .map_err(redis_err)?;
            if rewritten == 1 {
                done.add_named(STREAM_COLUMN, changed);
                return Ok(done);
            }
        }
        Err(StoreError::Backend(format!(
            "tether stream of session {session} kept changing during the reseal; run it again"
        )))
    }

    /// Runs the append script; `Ok(None)` when `next` found a gap.
    async fn append(
        &self,
        session: Uuid,
        next_only: bool,
        entries: &[(u64, Vec<(&'static str, String)>)],
    ) -> StoreResult<Option<u64>> {
        let mut call = self.append.prepare_invoke();
        call.key(self.stream_key(session))
            .key(self.last_key())
            .key(self.depth_key())
            .key(self.erased_key(session))
            .arg(session.to_string())
            .arg(if next_only { "next" } else { "all" });
        for (seq, fields) in entries {
            call.arg(*seq).arg(fields.len());
            for (name, value) in fields {
                call.arg(*name).arg(value.as_str());
            }
        }
        let (added, last): (i64, u64) = call
            .invoke_async(&mut self.redis.clone())
            .await
            .map_err(redis_err)?;
        Ok((added >= 0).then_some(last))
    }

    /// The session's highest streamed seq (0 when none).
    async fn last_streamed(&self, session: Uuid) -> StoreResult<u64> {
        let last: Option<u64> = redis::cmd("HGET")
            .arg(self.last_key())
            .arg(session.to_string())
            .query_async(&mut self.redis.clone())
            .await
            .map_err(redis_err)?;
        Ok(last.unwrap_or(0))
    }

    /// Streams every committed entry of the session that is not in its stream yet, in seq order.
    async fn reconcile(&self, session: Uuid) -> StoreResult<()> {
        let mut last = self.last_streamed(session).await?;
        // Mirror: the outbox holds every unacknowledged entry; only the tail is new. Handoff: it
        // holds only entries not yet handed off, so read them all and hand off the streamed ones.
        let mut after = if self.handoff { None } else { Some(last) };
        loop {
            let rows = self
                .inner
                .tether_pending(session, after, RECONCILE_BATCH)
                .await?;
            let Some(max) = rows.last().map(|e| e.seq) else {
                return Ok(());
            };
            let fresh: Vec<_> = rows
                .iter()
                .filter(|e| e.seq > last)
                .map(|e| {
                    Ok((
                        e.seq,
                        self.fields(
                            session,
                            &e.role,
                            &e.content,
                            &e.model_used,
                            &e.created_at,
                            e.chunk_id,
                        )?,
                    ))
                })
                .collect::<StoreResult<_>>()?;
            if !fresh.is_empty() {
                tracing::info!(session_id = %session, from = fresh[0].0, to = max, "tether: streaming committed entries");
                // `all` mode never reports a gap.
                last = self.append(session, false, &fresh).await?.unwrap_or(last);
            }
            self.note_streamed(session, max.min(last));
            if rows.len() < RECONCILE_BATCH as usize {
                return Ok(());
            }
            after = Some(max);
        }
    }

    /// Drops everything Redis and the relay hold for the session (its entries, its last streamed
    /// seq, work owed for it): the session left this gateway, or arrives with a tether whose
    /// seqs this gateway's earlier stream of it must not shadow, or (`erased`) was erased, and
    /// then no append may stream anything of it for a while.
    async fn forget(&self, session: Uuid, erased: bool) -> StoreResult<()> {
        {
            let mut owed = self.owed();
            owed.unstreamed.remove(&session);
            owed.handoff.remove(&session);
            owed.erased.remove(&session);
        }
        let _: i64 = self
            .forget
            .key(self.stream_key(session))
            .key(self.last_key())
            .key(self.depth_key())
            .key(self.erased_key(session))
            .arg(session.to_string())
            .arg(if erased { ERASED_MARKER_SECS } else { 0 })
            .invoke_async(&mut self.redis.clone())
            .await
            .map_err(redis_err)?;
        Ok(())
    }

    /// After COMMIT: streams the new entry (or, after a gap, everything missing up to it).
    async fn stream_new(&self, session: Uuid, seq: u64, e: &NewTetherEntry) -> StoreResult<()> {
        let entry = [(
            seq,
            self.fields(
                session,
                &e.role,
                &e.content,
                &e.model_used,
                &e.created_at,
                e.chunk_id,
            )?,
        )];
        match self.append(session, true, &entry).await? {
            Some(last) => {
                self.note_streamed(session, last.min(seq));
                Ok(())
            }
            None => self.reconcile(session).await,
        }
    }

    async fn relay_once(&self) -> StoreResult<u64> {
        let erased: Vec<Uuid> = self.owed().erased.drain().collect();
        let mut first_err = None;
        for session in erased {
            if let Err(e) = self.forget(session, true).await {
                self.owed().erased.insert(session);
                first_err.get_or_insert(e);
            }
        }
        let unstreamed: Vec<Uuid> = self.owed().unstreamed.drain().collect();
        for session in unstreamed {
            if let Err(e) = self.reconcile(session).await {
                self.owed().unstreamed.insert(session);
                first_err.get_or_insert(e);
            }
        }
        let handoff: Vec<(Uuid, u64)> = self.owed().handoff.drain().collect();
        let mut deleted = 0;
        for (session, up_to) in handoff {
            match self.inner.tether_ack(session, up_to).await {
                Ok(n) => deleted += n,
                Err(e) => {
                    self.note_streamed(session, up_to);
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(deleted),
        }
    }
}

impl<S: ?Sized> Shared<S> {
    /// The stream fields of an entry of `session` (its content sealed when encryption is on); an
    /// absent optional field is left out.
    fn fields(
        &self,
        session: Uuid,
        role: &str,
        content: &Option<String>,
        model_used: &Option<String>,
        created_at: &Timestamp,
        chunk_id: Uuid,
    ) -> StoreResult<Vec<(&'static str, String)>> {
        let content = self.seal.seal_opt(
            Column::TetherContent,
            &session.to_string(),
            content.as_deref(),
        )?;
        Ok(fields(
            role,
            content.as_deref(),
            model_used,
            created_at,
            chunk_id,
        ))
    }
}

/// The stream fields of an entry as stored; an absent optional field is left out.
fn fields(
    role: &str,
    content: Option<&str>,
    model_used: &Option<String>,
    created_at: &Timestamp,
    chunk_id: Uuid,
) -> Vec<(&'static str, String)> {
    let mut f = vec![
        ("role", role.to_owned()),
        // Microseconds, like both SQL backends, so a turn reads the same from either path.
        (
            "created_at",
            created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
        ("chunk_id", chunk_id.to_string()),
    ];
    if let Some(c) = content {
        f.push(("content", c.to_owned()));
    }
    if let Some(m) = model_used {
        f.push(("model_used", m.clone()));
    }
    f
}

fn entry_of(seal: &Sealer, session: Uuid, s: &StreamId) -> StoreResult<TetherEntry> {
    let bad = |what: &str| StoreError::Backend(format!("redis tether entry {}: bad {what}", s.id));
    let seq =
        s.id.split_once('-')
            .and_then(|(ms, _)| ms.parse::<u64>().ok())
            .ok_or_else(|| bad("id"))?;
    let text = |name: &str| -> StoreResult<Option<String>> {
        match s.map.get(name) {
            None | Some(Value::Nil) => Ok(None),
            Some(v) => redis::from_redis_value_ref::<String>(v)
                .map(Some)
                .map_err(|_| bad(name)),
        }
    };
    let created_at = text("created_at")?.ok_or_else(|| bad("created_at"))?;
    let created_at = DateTime::parse_from_rfc3339(&created_at)
        .map_err(|_| bad("created_at"))?
        .with_timezone(&Utc);
    let chunk_id = text("chunk_id")?
        .and_then(|c| Uuid::parse_str(&c).ok())
        .ok_or_else(|| bad("chunk_id"))?;
    Ok(TetherEntry {
        session_id: session,
        seq,
        role: text("role")?.ok_or_else(|| bad("role"))?,
        content: seal.open_opt(
            Column::TetherContent,
            &session.to_string(),
            text("content")?,
        )?,
        model_used: text("model_used")?,
        created_at,
        chunk_id,
    })
}

#[async_trait]
impl<S: Store + ?Sized + 'static> TetherStore for TetheredStore<S> {
    async fn tether_pending(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<TetherEntry>> {
        let sh = &self.shared;
        sh.reconcile(session_id).await?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        // Ids are `<seq>-0`: starting at `<after>-1` excludes `after` itself.
        let start = after.map_or_else(|| "-".to_owned(), |a| format!("{a}-1"));
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(sh.stream_key(session_id))
            .arg(start)
            .arg("+")
            .arg("COUNT")
            .arg(limit)
            .query_async(&mut sh.redis.clone())
            .await
            .map_err(redis_err)?;
        reply
            .ids
            .iter()
            .map(|s| entry_of(&sh.seal, session_id, s))
            .collect()
    }

    async fn tether_count(&self, session_id: Uuid) -> StoreResult<u64> {
        let sh = &self.shared;
        sh.reconcile(session_id).await?;
        redis::cmd("XLEN")
            .arg(sh.stream_key(session_id))
            .query_async(&mut sh.redis.clone())
            .await
            .map_err(redis_err)
    }

    async fn tether_issued(&self, session_id: Uuid) -> StoreResult<u64> {
        // The database issues every seq, in either mode.
        self.shared.inner.tether_issued(session_id).await
    }

    async fn tether_ack(&self, session_id: Uuid, up_to: u64) -> StoreResult<u64> {
        let sh = &self.shared;
        if sh.handoff {
            // An acknowledged entry must be in the stream to leave it (and to stop a later append).
            sh.reconcile(session_id).await?;
        } else {
            // The source of truth first: a failure after it can only leave a turn deliverable.
            sh.inner.tether_ack(session_id, up_to).await?;
        }
        sh.ack
            .key(sh.stream_key(session_id))
            .key(sh.depth_key())
            .arg(up_to)
            .invoke_async(&mut sh.redis.clone())
            .await
            .map_err(redis_err)
    }

    async fn tether_remove(&self, session_id: Uuid, seqs: &[u64]) -> StoreResult<u64> {
        let sh = &self.shared;
        if seqs.is_empty() {
            return Ok(0);
        }
        if !sh.handoff {
            sh.inner.tether_remove(session_id, seqs).await?;
        }
        let mut call = sh.remove.prepare_invoke();
        call.key(sh.stream_key(session_id)).key(sh.depth_key());
        for seq in seqs {
            call.arg(format!("{seq}-0"));
        }
        call.invoke_async(&mut sh.redis.clone())
            .await
            .map_err(redis_err)
    }

    async fn tether_depth_total(&self) -> StoreResult<u64> {
        let sh = &self.shared;
        if !sh.handoff {
            return sh.inner.tether_depth_total().await;
        }
        let depth: Option<i64> = redis::cmd("GET")
            .arg(sh.depth_key())
            .query_async(&mut sh.redis.clone())
            .await
            .map_err(redis_err)?;
        Ok(depth.map_or(0, |d| u64::try_from(d).unwrap_or(0)))
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> TurnStore for TetheredStore<S> {
    async fn begin_turn(&self, begin: BeginTurn) -> StoreResult<BeginTurnOutcome> {
        self.shared.inner.begin_turn(begin).await
    }

    async fn finish_turn(&self, finish: FinishTurn) -> StoreResult<FinishTurnOutcome> {
        let sh = &self.shared;
        let session = finish.session_id;
        let entry = finish.tether.clone();
        let out = sh.inner.finish_turn(finish).await?;
        if let (Some(seq), Some(entry)) = (out.tether_seq, entry) {
            // Committed: the turn exists whatever Redis says. A failed append is the relay's (and
            // the next read's) to redo; failing here would report a stored turn as lost.
            if let Err(e) = sh.stream_new(session, seq, &entry).await {
                tracing::warn!(session_id = %session, seq, error = %e, "tether append to redis failed; the relay retries");
                sh.owed().unstreamed.insert(session);
            }
        }
        Ok(out)
    }

    async fn record_progress(&self, progress: TurnProgress) -> StoreResult<TurnProgressOutcome> {
        self.shared.inner.record_progress(progress).await
    }

    async fn fail_turn(&self, fail: FailTurn) -> StoreResult<()> {
        self.shared.inner.fail_turn(fail).await
    }

    async fn recover_interrupted_turns(&self, now: Timestamp) -> StoreResult<Vec<TurnRecord>> {
        self.shared.inner.recover_interrupted_turns(now).await
    }

    async fn replica_heartbeat(&self, replica: &str, now: Timestamp) -> StoreResult<()> {
        self.shared.inner.replica_heartbeat(replica, now).await
    }

    async fn recover_orphaned_turns(
        &self,
        now: Timestamp,
        stale_before: Timestamp,
    ) -> StoreResult<Vec<TurnRecord>> {
        self.shared
            .inner
            .recover_orphaned_turns(now, stale_before)
            .await
    }

    async fn get_turn(&self, turn_id: Uuid) -> StoreResult<Option<TurnRecord>> {
        self.shared.inner.get_turn(turn_id).await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> SessionStore for TetheredStore<S> {
    async fn create_session(&self, session: NewSession) -> StoreResult<()> {
        self.shared.inner.create_session(session).await
    }

    async fn get_session(&self, id: Uuid) -> StoreResult<Option<SessionRecord>> {
        self.shared.inner.get_session(id).await
    }

    async fn find_session_by_token(&self, token_hash: &str) -> StoreResult<Option<SessionRecord>> {
        self.shared.inner.find_session_by_token(token_hash).await
    }

    async fn latest_suspended_for_agent(
        &self,
        agent_id: &str,
    ) -> StoreResult<Option<SessionRecord>> {
        self.shared.inner.latest_suspended_for_agent(agent_id).await
    }

    async fn update_status(
        &self,
        id: Uuid,
        to: SessionStatus,
        now: Timestamp,
    ) -> StoreResult<SessionStatus> {
        self.shared.inner.update_status(id, to, now).await
    }

    async fn mark_attached(&self, id: Uuid, now: Timestamp) -> StoreResult<SessionRecord> {
        // The tether switch stays in SQL: finish_turn reads it inside its own transaction.
        self.shared.inner.mark_attached(id, now).await
    }

    async fn suspend_if_running(&self, id: Uuid, now: Timestamp) -> StoreResult<bool> {
        self.shared.inner.suspend_if_running(id, now).await
    }

    async fn count_sessions_by_status(&self) -> StoreResult<Vec<(SessionStatus, u64)>> {
        self.shared.inner.count_sessions_by_status().await
    }

    async fn list_sessions(&self, query: SessionQuery) -> StoreResult<Vec<SessionRecord>> {
        self.shared.inner.list_sessions(query).await
    }

    /// The SQL erasure, then the session's stream, with a marker that stops an append racing the
    /// erasure (one that read the entries before it) from bringing them back. Redis failing after
    /// the SQL commit is not an error of the erasure: the relay drops the stream later.
    async fn delete_session(&self, id: Uuid, now: Timestamp) -> StoreResult<()> {
        let sh = &self.shared;
        sh.inner.delete_session(id, now).await?;
        if let Err(e) = sh.forget(id, true).await {
            tracing::warn!(session_id = %id, error = %e, "dropping an erased session's tether stream failed; the relay retries");
            sh.owed().erased.insert(id);
        }
        Ok(())
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> MessageStore for TetheredStore<S> {
    async fn list_messages(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<MessageRecord>> {
        self.shared
            .inner
            .list_messages(session_id, after, limit)
            .await
    }

    async fn history(&self, session_id: Uuid) -> StoreResult<Vec<MessageRecord>> {
        self.shared.inner.history(session_id).await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> SnapshotStore for TetheredStore<S> {
    async fn latest_snapshot(
        &self,
        session_id: Uuid,
        kind: Option<SnapshotKind>,
    ) -> StoreResult<Option<SnapshotRecord>> {
        self.shared.inner.latest_snapshot(session_id, kind).await
    }

    async fn get_snapshot(&self, id: Uuid) -> StoreResult<Option<SnapshotRecord>> {
        self.shared.inner.get_snapshot(id).await
    }

    async fn list_snapshots(
        &self,
        session_id: Uuid,
        limit: u32,
    ) -> StoreResult<Vec<SnapshotRecord>> {
        self.shared.inner.list_snapshots(session_id, limit).await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> IdempotencyStore for TetheredStore<S> {
    async fn get_idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>> {
        self.shared.inner.get_idempotency(key).await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> crate::RetentionStore for TetheredStore<S> {
    async fn sweep(&self, sweep: crate::Sweep) -> StoreResult<crate::Swept> {
        self.shared.inner.sweep(sweep).await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> RoamingStore for TetheredStore<S> {
    async fn create_export(&self, export: NewExport, bundle: NewBundle) -> StoreResult<()> {
        self.shared.inner.create_export(export, bundle).await
    }

    async fn get_export(&self, id: Uuid) -> StoreResult<Option<ExportRecord>> {
        self.shared.inner.get_export(id).await
    }

    async fn redeem_export(
        &self,
        id: Uuid,
        by: &str,
        now: Timestamp,
        retry_after: Timestamp,
    ) -> StoreResult<RedeemOutcome> {
        self.shared
            .inner
            .redeem_export(id, by, now, retry_after)
            .await
    }

    async fn get_bundle(&self, cid: &str) -> StoreResult<Option<Vec<u8>>> {
        self.shared.inner.get_bundle(cid).await
    }

    async fn adopt_session(&self, adopt: AdoptSession) -> StoreResult<AdoptOutcome> {
        self.shared.inner.adopt_session(adopt).await
    }

    async fn lineage(&self, session_id: Uuid) -> StoreResult<Lineage> {
        self.shared.inner.lineage(session_id).await
    }

    async fn get_memory(&self, session_id: Uuid) -> StoreResult<Option<MemoryRecord>> {
        self.shared.inner.get_memory(session_id).await
    }

    async fn put_memory(
        &self,
        session_id: Uuid,
        schema_id: String,
        payload: serde_json::Value,
        now: Timestamp,
    ) -> StoreResult<MemoryRecord> {
        self.shared
            .inner
            .put_memory(session_id, schema_id, payload, now)
            .await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> crate::FederationStore for TetheredStore<S> {
    async fn init_identity(
        &self,
        gateway_id: &str,
        first_key_id: &str,
        now: Timestamp,
    ) -> StoreResult<crate::FederationIdentity> {
        self.shared
            .inner
            .init_identity(gateway_id, first_key_id, now)
            .await
    }

    async fn identity(&self) -> StoreResult<Option<crate::FederationIdentity>> {
        self.shared.inner.identity().await
    }

    async fn upsert_peer(&self, peer: crate::PeerRecord) -> StoreResult<()> {
        self.shared.inner.upsert_peer(peer).await
    }

    async fn peer(&self, gateway_id: &str) -> StoreResult<Option<crate::PeerRecord>> {
        self.shared.inner.peer(gateway_id).await
    }

    async fn peers(&self) -> StoreResult<Vec<crate::PeerRecord>> {
        self.shared.inner.peers().await
    }

    async fn insert_jti(
        &self,
        issuer: &str,
        jti: &str,
        expires_at: Timestamp,
    ) -> StoreResult<bool> {
        self.shared.inner.insert_jti(issuer, jti, expires_at).await
    }

    async fn next_announcement(
        &self,
        bundle_cid: &str,
        now_ms: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> StoreResult<u64> {
        self.shared
            .inner
            .next_announcement(bundle_cid, now_ms, expires_at, now)
            .await
    }

    async fn announcements_expiring_before(
        &self,
        before: Timestamp,
    ) -> StoreResult<Vec<crate::Announcement>> {
        self.shared
            .inner
            .announcements_expiring_before(before)
            .await
    }
}

#[async_trait]
impl<S: Store + ?Sized + 'static> crate::RegistryStore for TetheredStore<S> {
    async fn put_record(
        &self,
        record: crate::RegistryRecordRow,
        max_per_gateway: u64,
        now: Timestamp,
    ) -> StoreResult<crate::PutRecord> {
        self.shared
            .inner
            .put_record(record, max_per_gateway, now)
            .await
    }

    async fn records_for(
        &self,
        bundle_cid: &str,
        now: Timestamp,
        limit: u32,
    ) -> StoreResult<Vec<crate::RegistryRecordRow>> {
        self.shared.inner.records_for(bundle_cid, now, limit).await
    }

    async fn count_records(&self, gateway_id: &str, now: Timestamp) -> StoreResult<u64> {
        self.shared.inner.count_records(gateway_id, now).await
    }

    async fn put_vouch(&self, vouch: crate::VouchRow) -> StoreResult<()> {
        self.shared.inner.put_vouch(vouch).await
    }

    async fn vouch(&self, gateway_id: &str) -> StoreResult<Option<crate::VouchRow>> {
        self.shared.inner.vouch(gateway_id).await
    }
}

/// Holds live in SQL; a move also moves the tether, so the session's stream follows it: dropped
/// at the origin once committed, and rebuilt at the target, where `adopt_migrated` writes the
/// carried entries to the outbox under their seqs (as any committed entry) and streams them.
#[async_trait]
impl<S: Store + ?Sized + 'static> crate::HoldStore for TetheredStore<S> {
    async fn hold(&self, session_id: Uuid) -> StoreResult<Option<crate::HoldRow>> {
        self.shared.inner.hold(session_id).await
    }

    async fn lease_handover(&self, req: crate::LeaseRequest) -> StoreResult<crate::HoldRow> {
        self.shared.inner.lease_handover(req).await
    }

    /// A failure to drop the stream after the SQL commit is returned: the commit is idempotent,
    /// so the caller's retry drops it then.
    async fn commit_handover(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<crate::HoldRow> {
        let sh = &self.shared;
        let moved = sh
            .inner
            .commit_handover(session_id, migration_id, by_gateway, now)
            .await?;
        sh.forget(session_id, false).await?;
        Ok(moved)
    }

    async fn expire_leases(&self, now: Timestamp) -> StoreResult<u64> {
        self.shared.inner.expire_leases(now).await
    }

    async fn release_lease(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<bool> {
        self.shared
            .inner
            .release_lease(session_id, migration_id, by_gateway, now)
            .await
    }

    /// After the SQL write (which refuses a session held here, whose stream must stay): an
    /// earlier visit's stream and last seq are dropped, so the carried seqs stream again; then
    /// the carried entries are streamed from what was given, not read back from the outbox (an
    /// earlier visit's handoff still in flight may delete outbox rows of those seqs). When Redis
    /// fails, the relay or the next read streams them from the outbox.
    async fn adopt_migrated(&self, m: crate::AdoptMigrated) -> StoreResult<SessionRecord> {
        let sh = &self.shared;
        let session = m.adopt.session.id;
        let carried = m
            .tether
            .iter()
            .map(|(seq, e)| {
                let fields = sh.fields(
                    session,
                    &e.role,
                    &e.content,
                    &e.model_used,
                    &e.created_at,
                    e.chunk_id,
                )?;
                Ok((*seq, fields))
            })
            .collect::<StoreResult<Vec<_>>>()?;
        let adopted = sh.inner.adopt_migrated(m).await?;
        sh.forget(session, false).await?;
        let highest = carried.iter().map(|(seq, _)| *seq).max();
        if let Some(highest) = highest {
            // `all` mode never reports a gap; the script skips a seq that is out of order.
            let mut sorted = carried;
            sorted.sort_by_key(|(seq, _)| *seq);
            match sh.append(session, false, &sorted).await {
                Ok(last) => sh.note_streamed(session, last.unwrap_or(0).min(highest)),
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "streaming a migrated tether failed; the relay retries");
                    sh.owed().unstreamed.insert(session);
                }
            }
        }
        Ok(adopted)
    }

    async fn finish_incoming(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        ok: bool,
        now: Timestamp,
    ) -> StoreResult<()> {
        let sh = &self.shared;
        sh.inner
            .finish_incoming(session_id, migration_id, ok, now)
            .await?;
        // A failed move deleted the session: its stream goes too (a session still here keeps it).
        if !ok && sh.inner.get_session(session_id).await?.is_none() {
            sh.forget(session_id, false).await?;
        }
        Ok(())
    }

    async fn incoming_holds(&self) -> StoreResult<Vec<crate::HoldRow>> {
        self.shared.inner.incoming_holds().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted_and_modes_parse() {
        assert_eq!(
            redacted_redis_url("redis://u:secret@10.0.0.1:6379/2"),
            "redis://10.0.0.1:6379/2"
        );
        assert_eq!(
            redacted_redis_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!("Mirror".parse(), Ok(TetherMode::Mirror));
        assert_eq!("handoff".parse(), Ok(TetherMode::Handoff));
        assert_eq!("auto".parse(), Ok(TetherMode::Auto));
        assert!("sometimes".parse::<TetherMode>().is_err());
    }
}
