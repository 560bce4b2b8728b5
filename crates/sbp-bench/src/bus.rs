//! The Redis side of a two-replica run: the bus prefix each run gets (and removes again), the
//! floors of a cross-replica call measured on the same Redis (a PING round trip, and the two
//! pub/sub hops a relayed call needs: publish -> subscriber -> publish back -> subscriber), and
//! what Redis itself reports (its commands per call, its pid for the CPU figures).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use redis::AsyncCommands;
use redis::aio::{MultiplexedConnection, PubSubStream};
use serde::Serialize;
use serde_json::json;

/// How long one floor round trip may take before the run fails (instead of hanging).
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(5);

/// The bus of one run: its URL and a key prefix no other run uses. The gateways' keys under it
/// (session holders, liveness, locks) are deleted by [`BusKeys::delete_now`], or on drop.
pub struct BusKeys {
    pub url: String,
    /// `sbp_bench_<pid>_<n>:`
    pub prefix: String,
    deleted: bool,
}

impl BusKeys {
    pub fn new(url: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self {
            url: url.to_owned(),
            prefix: format!(
                "sbp_bench_{}_{}:",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            deleted: false,
        }
    }

    pub async fn delete_now(mut self) -> anyhow::Result<()> {
        self.deleted = true;
        delete_prefix(&self.url, &self.prefix).await
    }
}

impl Drop for BusKeys {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let (url, prefix) = (self.url.clone(), self.prefix.clone());
        // Its own thread and runtime, as `Schema`'s drop: this may run inside the bench's runtime.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(delete_prefix(&url, &prefix))
        })
        .join();
        if !matches!(done, Ok(Ok(()))) {
            eprintln!(
                "could not delete the Redis keys {}*; delete them by hand",
                self.prefix
            );
        }
    }
}

pub async fn connect(url: &str) -> anyhow::Result<MultiplexedConnection> {
    let client = redis::Client::open(url).with_context(|| format!("bad Redis URL {url}"))?;
    client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("connecting to {url}"))
}

/// Deletes every key starting with `prefix` (SCAN, so a large Redis is not blocked).
async fn delete_prefix(url: &str, prefix: &str) -> anyhow::Result<()> {
    let mut conn = connect(url).await?;
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let _: u64 = conn.del(keys).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The floors of a cross-replica call on the run's Redis: a PING on a multiplexed connection
/// (what one registry lookup costs at least), and a relay: the bench publishes on `<prefix>floor:a`,
/// a task subscribed there publishes the payload back on `<prefix>floor:b`, where the bench is
/// subscribed. That is the two bus hops of a relayed call (TOOL_CALL to the surface's replica,
/// TOOL_RESULT back), with a payload the size of a relayed TOOL_CALL.
pub struct BusFloor {
    conn: MultiplexedConnection,
    replies: PubSubStream,
    out_channel: String,
    payload: Vec<u8>,
    relay: tokio::task::JoinHandle<()>,
}

impl BusFloor {
    pub async fn start(url: &str, prefix: &str) -> anyhow::Result<Self> {
        let client = redis::Client::open(url).with_context(|| format!("bad Redis URL {url}"))?;
        let (a, b) = (format!("{prefix}floor:a"), format!("{prefix}floor:b"));
        let mut relay_sub = client.get_async_pubsub().await?;
        relay_sub.subscribe(&a).await?;
        let mut relay_out = client.get_multiplexed_async_connection().await?;
        let back = b.clone();
        let relay = tokio::spawn(async move {
            let mut messages = relay_sub.into_on_message();
            while let Some(msg) = messages.next().await {
                let sent: redis::RedisResult<i64> =
                    relay_out.publish(&back, msg.get_payload_bytes()).await;
                if sent.is_err() {
                    return;
                }
            }
        });
        let mut sub = client.get_async_pubsub().await?;
        sub.subscribe(&b).await?;
        // What B publishes for A: a relayed TOOL_CALL, as the engine's bus message looks.
        let payload = json!({
            "kind": "tool_call",
            "session": uuid::Uuid::now_v7(),
            "conn": 1,
            "reply_to": "bench-b-0123456789ab",
            "call": {
                "call_id": uuid::Uuid::new_v4(),
                "tool_name": "echo",
                "tool_input": {"lane": 0, "n": 1, "text": "hello from sbp-bench"},
                "timeout_ms": 5000,
            },
        })
        .to_string()
        .into_bytes();
        Ok(Self {
            conn: client.get_multiplexed_async_connection().await?,
            replies: sub.into_on_message(),
            out_channel: a,
            payload,
            relay,
        })
    }

    /// One PING round trip.
    pub async fn ping(&mut self) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let pong: String = tokio::time::timeout(
            ROUND_TRIP_LIMIT,
            redis::cmd("PING").query_async(&mut self.conn),
        )
        .await
        .context("Redis PING took over 5 s")??;
        if pong != "PONG" {
            bail!("Redis answered PING with {pong:?}");
        }
        Ok(t0.elapsed())
    }

    /// Two pub/sub hops: publish, the relay receives and publishes back, the bench receives.
    pub async fn relay_round_trip(&mut self) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let hop = async {
            let receivers: i64 = self
                .conn
                .publish(&self.out_channel, &self.payload[..])
                .await?;
            if receivers != 1 {
                bail!("the floor relay is not subscribed ({receivers} receivers)");
            }
            self.replies
                .next()
                .await
                .context("the floor's subscription closed")
        };
        tokio::time::timeout(ROUND_TRIP_LIMIT, hop)
            .await
            .context("a pub/sub relay round trip took over 5 s")??;
        Ok(t0.elapsed())
    }

    pub fn stop(self) {
        self.relay.abort();
    }
}

/// Cumulative `calls` and `usec` per command, from `INFO commandstats` (server-wide).
#[derive(Debug, Clone, Default)]
pub struct CommandStats(BTreeMap<String, (u64, u64)>);

impl CommandStats {
    pub async fn take(conn: &mut MultiplexedConnection) -> anyhow::Result<Self> {
        let text: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await?;
        Ok(Self::parse(&text))
    }

    fn parse(text: &str) -> Self {
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let Some((name, fields)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            let field = |key: &str| {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            out.insert(name.to_owned(), (field("calls"), field("usec")));
        }
        Self(out)
    }

    /// Commands run since `earlier`, per tool call (`calls` calls), leaving out the bench's own
    /// `INFO`.
    pub fn per_call_since(&self, earlier: &Self, calls: u64) -> RedisPerCall {
        let n = calls.max(1) as f64;
        let mut commands = BTreeMap::new();
        let mut usec = 0;
        for (name, (c, u)) in &self.0 {
            if name == "info" {
                continue;
            }
            let (c0, u0) = earlier.0.get(name).copied().unwrap_or((0, 0));
            let dc = c.saturating_sub(c0);
            if dc > 0 {
                commands.insert(name.clone(), (dc as f64 / n * 1000.0).round() / 1000.0);
            }
            usec += u.saturating_sub(u0);
        }
        RedisPerCall {
            total: (commands.values().sum::<f64>() * 1000.0).round() / 1000.0,
            commands,
            server_us: (usec as f64 / n * 10.0).round() / 10.0,
        }
    }
}

/// What Redis ran per tool call over a phase. Server-wide counts: the replicas' heartbeats (one
/// `SET` per replica every 2 s) and anything else using this Redis at the time are included.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RedisPerCall {
    /// Commands per call, by name (a script's own commands are counted too: `evalsha` and the
    /// `get` and `exists` it runs).
    pub commands: BTreeMap<String, f64>,
    pub total: f64,
    /// Redis's own time executing them, per call, microseconds (not counting network IO).
    pub server_us: f64,
}

impl std::fmt::Display for RedisPerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .commands
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect();
        write!(
            f,
            "{:.2} commands per call ({}); {:.1} µs of Redis execution per call",
            self.total,
            parts.join(", "),
            self.server_us
        )
    }
}

/// The Redis server's pid (`INFO server`), if it runs on this machine.
pub async fn server_pid(conn: &mut MultiplexedConnection) -> Option<u32> {
    let text: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .ok()?;
    let pid: u32 = text
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))?
        .trim()
        .parse()
        .ok()?;
    // Same machine: the pid names a redis-server here (not a remote server's number).
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    comm.trim().starts_with("redis-server").then_some(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_deltas_per_call() {
        let before = CommandStats::parse(
            "# Commandstats\r\ncmdstat_publish:calls=10,usec=50,usec_per_call=5.00,rejected_calls=0,failed_calls=0\r\ncmdstat_info:calls=3,usec=30,usec_per_call=10.00\r\n",
        );
        let after = CommandStats::parse(
            "# Commandstats\r\ncmdstat_publish:calls=210,usec=1050,usec_per_call=5.00,rejected_calls=0,failed_calls=0\r\ncmdstat_evalsha:calls=100,usec=700,usec_per_call=7.00\r\ncmdstat_info:calls=5,usec=50,usec_per_call=10.00\r\n",
        );
        let d = after.per_call_since(&before, 100);
        assert_eq!(d.commands.get("publish"), Some(&2.0));
        assert_eq!(d.commands.get("evalsha"), Some(&1.0));
        assert_eq!(d.commands.get("info"), None);
        assert_eq!(d.total, 3.0);
        // (1000 + 700) µs over 100 calls; the bench's INFO is not counted.
        assert!((d.server_us - 17.0).abs() < 1e-9, "{d:?}");
    }
}
