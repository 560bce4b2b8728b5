//! [`Bus`] on Redis. Keys, all under the configured prefix:
//!
//! - `bus:<replica>`: the pub/sub channel each replica subscribes to. One publishing connection per
//!   replica, so what a replica sends to another arrives in order.
//! - `alive:<replica>`: set with a TTL, refreshed every heartbeat. A replica whose key expired
//!   (`kill -9`, network partition) is dead: its registry entries no longer count.
//! - `surface:<session>`: the holder, `<replica>|<conn>|<surface JSON>`. Claimed with `SET ... GET`
//!   (so of two racing attaches, the later one learns about the earlier and displaces it); released
//!   and updated by scripts that compare the `<replica>|<conn>|` prefix, so a displaced connection
//!   can never remove or overwrite its successor's entry.
//! - `lock:<session>`: a random token while one replica changes the session's attach state.
//!
//! Pub/sub is at-most-once: a replica that is reconnecting misses what was published meanwhile.
//! The engine is built for that (see the crate docs). Not supported: Redis Cluster (the scripts
//! touch keys they compute).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script};
use sbp_protocol::SurfaceContext;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{Bus, BusError, BusMsg, Holder, SessionLock, valid_replica_id};

/// Messages waiting to be published; beyond this `send` refuses (and the caller degrades).
const OUTBOX: usize = 65_536;
/// Messages received and not yet handled by the engine; the subscriber waits beyond it.
const INBOX: usize = 65_536;
/// Messages published in one pipelined round trip.
const PUBLISH_BATCH: usize = 256;
/// How long a session lock lives if its holder dies while holding it.
const LOCK_TTL_MS: u64 = 10_000;
/// How long `lock` waits for a session lock before giving up: longer than the lock lives, so a
/// waiter outlasts a holder that died with it.
const LOCK_WAIT: Duration = Duration::from_secs(15);

/// Where and who this replica is.
#[derive(Debug, Clone)]
pub struct RedisBusOptions {
    pub url: String,
    /// Prefix of every key and channel (several deployments can share one Redis).
    pub prefix: String,
    /// This replica's id ([`valid_replica_id`]); unique among live replicas.
    pub replica: String,
    /// How often this replica says it is alive.
    pub heartbeat: Duration,
    /// How long after its last heartbeat a replica counts as dead.
    pub ttl: Duration,
    /// Connect and response timeout of Redis commands.
    pub timeout: Duration,
}

impl RedisBusOptions {
    pub fn new(url: impl Into<String>, replica: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: "sbp:".into(),
            replica: replica.into(),
            heartbeat: Duration::from_secs(2),
            ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
        }
    }
}

/// The Redis bus of one replica. Its tasks (subscriber, publisher, heartbeat) run until [`close`].
///
/// [`close`]: RedisBus::close
pub struct RedisBus {
    replica: String,
    prefix: String,
    redis: ConnectionManager,
    out: mpsc::Sender<(String, Vec<u8>)>,
    ttl: Duration,
    claim: Script,
    release: Script,
    update: Script,
    holder: Script,
    unlock: Script,
    stop: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for RedisBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBus")
            .field("replica", &self.replica)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: redis::RedisError) -> BusError {
    BusError::Unavailable(e.to_string())
}

impl RedisBus {
    /// Connects, announces this replica alive and subscribes to its channel; returns the bus and
    /// the messages other replicas send to this one. Fails if another live replica has this id.
    pub async fn connect(
        opts: RedisBusOptions,
    ) -> Result<(Arc<Self>, mpsc::Receiver<BusMsg>), BusError> {
        if !valid_replica_id(&opts.replica) {
            return Err(BusError::Config(format!(
                "replica id '{}' must be 1-64 characters of A-Z a-z 0-9 . _ -",
                opts.replica
            )));
        }
        if opts.ttl <= opts.heartbeat {
            return Err(BusError::Config(
                "the replica timeout must be longer than the heartbeat interval".into(),
            ));
        }
        let client = redis::Client::open(opts.url.as_str())
            .map_err(|e| BusError::Config(format!("bad Redis URL: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.timeout))
            .set_response_timeout(Some(opts.timeout))
            .set_number_of_retries(2);
        let mut redis = ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(unavailable)?;
        let alive_key = format!("{}alive:{}", opts.prefix, opts.replica);
        let ttl_ms = millis(opts.ttl);
        let fresh: Option<String> = redis::cmd("SET")
            .arg(&alive_key)
            .arg("1")
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut redis)
            .await
            .map_err(unavailable)?;
        if fresh.is_none() {
            return Err(BusError::Config(format!(
                "another live replica is using the id '{}' (or one that stopped less than {} ms ago)",
                opts.replica, ttl_ms
            )));
        }
        let stop = CancellationToken::new();
        let (in_tx, in_rx) = mpsc::channel(INBOX);
        let (ready_tx, ready_rx) = oneshot::channel();
        let channel = format!("{}bus:{}", opts.prefix, opts.replica);
        let subscriber = tokio::spawn(subscribe_loop(
            client,
            channel,
            in_tx,
            stop.clone(),
            ready_tx,
        ));
        let failed = match ready_rx.await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some("subscriber stopped".to_owned()),
        };
        if let Some(e) = failed {
            stop.cancel();
            // Give the id back now: nothing heartbeats it, and until it expired the others would
            // count this replica alive and a retry would be refused as a duplicate.
            let _: Result<(), _> = redis.del(&alive_key).await;
            return Err(BusError::Unavailable(e));
        }
        let (out_tx, out_rx) = mpsc::channel(OUTBOX);
        let publisher = tokio::spawn(publish_loop(redis.clone(), out_rx, stop.clone()));
        let heartbeat = tokio::spawn(heartbeat_loop(
            redis.clone(),
            alive_key,
            opts.heartbeat,
            ttl_ms,
            stop.clone(),
        ));
        let bus = Arc::new(Self {
            replica: opts.replica,
            prefix: opts.prefix,
            redis,
            out: out_tx,
            ttl: opts.ttl,
            claim: Script::new(CLAIM),
            release: Script::new(RELEASE),
            update: Script::new(UPDATE),
            holder: Script::new(HOLDER),
            unlock: Script::new(UNLOCK),
            stop,
            tasks: Mutex::new(vec![subscriber, publisher, heartbeat]),
        });
        tracing::info!(replica = %bus.replica, "joined the replica bus");
        Ok((bus, in_rx))
    }

    /// Stops the tasks (what is queued is published first) and withdraws this replica's liveness,
    /// so the others stop routing to it at once.
    pub async fn close(&self) {
        self.stop.cancel();
        let tasks: Vec<_> =
            std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for t in tasks {
            let _ = t.await;
        }
        let mut redis = self.redis.clone();
        let _: Result<(), _> = redis.del(self.alive_key(&self.replica)).await;
    }

    /// How long after its last heartbeat a replica counts as dead.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn alive_key(&self, replica: &str) -> String {
        format!("{}alive:{replica}", self.prefix)
    }

    fn surface_key(&self, session: Uuid) -> String {
        format!("{}surface:{session}", self.prefix)
    }

    fn holder_prefix(&self, conn: u64) -> String {
        format!("{}|{conn}|", self.replica)
    }

    fn holder_value(&self, conn: u64, surface: &SurfaceContext) -> Result<String, BusError> {
        let json = serde_json::to_string(surface)
            .map_err(|e| BusError::Config(format!("surface context: {e}")))?;
        Ok(format!("{}{json}", self.holder_prefix(conn)))
    }
}

impl Drop for RedisBus {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// `<replica>|<conn>|<surface JSON>` back into a holder; `None` for anything else.
/// `<replica>|<conn>|<surface JSON>` split into the holder's id and the (unparsed) rest.
fn holder_id(value: &str) -> Option<(String, u64, Option<&str>)> {
    let mut parts = value.splitn(3, '|');
    let replica = parts.next()?.to_owned();
    let conn = parts.next()?.parse().ok()?;
    Some((replica, conn, parts.next()))
}

fn parse_holder(value: &str) -> Option<Holder> {
    let (replica, conn, surface) = holder_id(value)?;
    let surface = SurfaceContext::from_value(&serde_json::from_str(surface?).ok()?);
    Some(Holder {
        replica,
        conn,
        surface,
    })
}

/// Sets the holder; returns the previous one if its replica is alive. ARGV: value, alive prefix.
const CLAIM: &str = r"
local old = redis.call('SET', KEYS[1], ARGV[1], 'GET')
if not old then return false end
local r = string.match(old, '^([^|]*)|')
if r and redis.call('EXISTS', ARGV[2] .. r) == 1 then return old end
return false
";

/// Deletes the holder if it starts with ARGV[1] (`<replica>|<conn>|`).
const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

/// Replaces the holder with ARGV[2] if it starts with ARGV[1].
const UPDATE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// The holder if its replica is alive. ARGV: alive prefix.
const HOLDER: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return false end
local r = string.match(v, '^([^|]*)|')
if r and redis.call('EXISTS', ARGV[1] .. r) == 1 then return v end
return false
";

const UNLOCK: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

#[async_trait]
impl Bus for RedisBus {
    fn replica(&self) -> &str {
        &self.replica
    }

    fn send(&self, replica: &str, msg: BusMsg) -> bool {
        let Ok(payload) = serde_json::to_vec(&msg) else {
            return false;
        };
        let channel = format!("{}bus:{replica}", self.prefix);
        self.out.try_send((channel, payload)).is_ok()
    }

    async fn claim(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<Option<Holder>, BusError> {
        let value = self.holder_value(conn, surface)?;
        let mut redis = self.redis.clone();
        let old: Option<String> = self
            .claim
            .key(self.surface_key(session))
            .arg(value)
            .arg(format!("{}alive:", self.prefix))
            .invoke_async(&mut redis)
            .await
            .map_err(unavailable)?;
        Ok(old.as_deref().and_then(parse_holder))
    }

    async fn release(&self, session: Uuid, conn: u64) -> Result<bool, BusError> {
        let mut redis = self.redis.clone();
        let n: i64 = self
            .release
            .key(self.surface_key(session))
            .arg(self.holder_prefix(conn))
            .invoke_async(&mut redis)
            .await
            .map_err(unavailable)?;
        Ok(n == 1)
    }

    async fn update(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<bool, BusError> {
        let value = self.holder_value(conn, surface)?;
        let mut redis = self.redis.clone();
        let n: i64 = self
            .update
            .key(self.surface_key(session))
            .arg(self.holder_prefix(conn))
            .arg(value)
            .invoke_async(&mut redis)
            .await
            .map_err(unavailable)?;
        Ok(n == 1)
    }

    async fn holder(&self, session: Uuid) -> Result<Option<Holder>, BusError> {
        let mut redis = self.redis.clone();
        let v: Option<String> = self
            .holder
            .key(self.surface_key(session))
            .arg(format!("{}alive:", self.prefix))
            .invoke_async(&mut redis)
            .await
            .map_err(unavailable)?;
        Ok(v.as_deref().and_then(parse_holder))
    }

    async fn holders(&self, sessions: &[Uuid]) -> Result<Vec<Option<(String, u64)>>, BusError> {
        if sessions.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = sessions.iter().map(|s| self.surface_key(*s)).collect();
        let mut redis = self.redis.clone();
        let values: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut redis)
            .await
            .map_err(unavailable)?;
        // Only who holds each session: the surfaces are not parsed.
        Ok(values
            .into_iter()
            .map(|v| holder_id(&v?).map(|(replica, conn, _)| (replica, conn)))
            .collect())
    }

    async fn reclaim(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<bool, BusError> {
        let value = self.holder_value(conn, surface)?;
        let mut redis = self.redis.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(self.surface_key(session))
            .arg(value)
            .arg("NX")
            .query_async(&mut redis)
            .await
            .map_err(unavailable)?;
        Ok(set.is_some())
    }

    async fn lock(&self, session: Uuid) -> Result<SessionLock, BusError> {
        let key = format!("{}lock:{session}", self.prefix);
        let token = Uuid::new_v4().to_string();
        let deadline = tokio::time::Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(1);
        let mut redis = self.redis.clone();
        loop {
            let got: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(LOCK_TTL_MS)
                .query_async(&mut redis)
                .await
                .map_err(unavailable)?;
            if got.is_some() {
                return Ok(SessionLock { session, token });
            }
            if tokio::time::Instant::now() + pause > deadline {
                return Err(BusError::Unavailable(format!(
                    "the lock of session {session} stayed taken for {} s",
                    LOCK_WAIT.as_secs()
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    async fn unlock(&self, lock: SessionLock) {
        let mut redis = self.redis.clone();
        let res: Result<i64, _> = self
            .unlock
            .key(format!("{}lock:{}", self.prefix, lock.session))
            .arg(&lock.token)
            .invoke_async(&mut redis)
            .await;
        if let Err(e) = res {
            // The lock expires by itself; until then attaches of this session wait.
            tracing::warn!(session_id = %lock.session, error = %e, "releasing a session lock failed");
        }
    }

    async fn alive(&self, replicas: &[String]) -> Result<Vec<bool>, BusError> {
        if replicas.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for r in replicas {
            pipe.exists(self.alive_key(r));
        }
        let mut redis = self.redis.clone();
        pipe.query_async(&mut redis).await.map_err(unavailable)
    }
}

/// Receives this replica's channel into `tx`, reconnecting with backoff. Reports the first
/// subscription's outcome on `ready`.
async fn subscribe_loop(
    client: redis::Client,
    channel: String,
    tx: mpsc::Sender<BusMsg>,
    stop: CancellationToken,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let mut ready = Some(ready);
    let mut pause = Duration::from_millis(100);
    loop {
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = tokio::select! {
            _ = stop.cancelled() => return,
            r = subscribed => r,
        };
        match pubsub {
            Ok(pubsub) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(()));
                } else {
                    tracing::info!(channel, "replica bus subscription restored");
                }
                pause = Duration::from_millis(100);
                let mut messages = pubsub.into_on_message();
                loop {
                    let msg = tokio::select! {
                        _ = stop.cancelled() => return,
                        m = messages.next() => m,
                    };
                    let Some(msg) = msg else { break };
                    match serde_json::from_slice::<BusMsg>(msg.get_payload_bytes()) {
                        Ok(m) => {
                            // Waits while the inbox is full, but not past a close.
                            let sent = tokio::select! {
                                _ = stop.cancelled() => return,
                                r = tx.send(m) => r,
                            };
                            if sent.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "unreadable replica bus message ignored")
                        }
                    }
                }
                tracing::warn!(channel, "replica bus subscription lost; reconnecting");
            }
            Err(e) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(Err(e.to_string()));
                    return;
                }
                tracing::warn!(channel, error = %e, "replica bus subscribe failed; retrying");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// Publishes queued messages, pipelining whatever is waiting, in queue order.
async fn publish_loop(
    mut redis: ConnectionManager,
    mut rx: mpsc::Receiver<(String, Vec<u8>)>,
    stop: CancellationToken,
) {
    let mut batch = Vec::with_capacity(PUBLISH_BATCH);
    loop {
        let n = tokio::select! {
            // Stopping: publish what is already queued, then end.
            _ = stop.cancelled() => {
                rx.close();
                rx.recv_many(&mut batch, PUBLISH_BATCH).await
            }
            n = rx.recv_many(&mut batch, PUBLISH_BATCH) => n,
        };
        if n == 0 {
            return;
        }
        let mut pipe = redis::pipe();
        for (channel, payload) in batch.drain(..) {
            pipe.publish(channel, payload).ignore();
        }
        if let Err(e) = pipe.query_async::<()>(&mut redis).await {
            tracing::warn!(error = %e, messages = n, "publishing on the replica bus failed; messages dropped");
        }
    }
}

/// Keeps this replica's `alive` key from expiring.
async fn heartbeat_loop(
    mut redis: ConnectionManager,
    key: String,
    every: Duration,
    ttl_ms: u64,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let res: Result<(), _> = redis::cmd("SET")
            .arg(&key)
            .arg("1")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut redis)
            .await;
        if let Err(e) = res {
            tracing::warn!(error = %e, "replica heartbeat failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_values_parse() {
        let h = parse_holder(r#"gw-a|42|{"device_type":"mobile","mcp_tools":["gps"]}"#)
            .expect("parses");
        assert_eq!(h.replica, "gw-a");
        assert_eq!(h.conn, 42);
        assert_eq!(h.surface.mcp_tools, vec!["gps".to_owned()]);
        // A surface JSON containing '|' stays whole.
        let h = parse_holder(r#"b|1|{"surface_id":"x|y"}"#).expect("parses");
        assert_eq!(h.surface.surface_id.as_deref(), Some("x|y"));
        assert!(parse_holder("nonsense").is_none());
        assert!(parse_holder("a|notanumber|{}").is_none());
    }
}
