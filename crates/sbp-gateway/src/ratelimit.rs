//! Rate limits: token buckets (GCRA, from `governor`) keyed by who is asking, a client address, a
//! session, an operator key, and a stricter count of failed authentications per address. The
//! transport applies the address, key and failure limits (`transport/limits.rs`); the engine
//! applies the session limit where a session's caller is authorised (`engine/sessions`).
//!
//! Keyed buckets never grow without bound: a key whose bucket has refilled is indistinguishable
//! from a fresh one and is dropped (`retain_recent`) at most every [`SWEEP_EVERY`], so the table
//! holds only the keys seen within one refill time (burst / rate) of now.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use governor::clock::Clock as _;
use governor::{DefaultKeyedRateLimiter, Quota};

/// How often a limiter drops the keys whose buckets are full again.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Most addresses kept blocked for failed authentications at once; past it, further blocks are
/// not recorded (the address limit still applies) rather than memory growing.
const MAX_BLOCKED: usize = 65_536;

/// A rate: `count` requests per `period`, and at most `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: NonZeroU32,
    pub period: Duration,
    pub burst: NonZeroU32,
}

impl Rate {
    fn quota(self) -> Quota {
        // `period / count` is never zero: count <= u32::MAX and period >= 1 s.
        let every = (self.period / self.count.get()).max(Duration::from_nanos(1));
        Quota::with_period(every)
            .unwrap_or_else(|| Quota::per_second(self.count))
            .allow_burst(self.burst)
    }
}

/// `0` or `off`: no limit. Otherwise `COUNT/UNIT[,BURST]`, UNIT one of `s`, `m`, `h`; BURST
/// defaults to COUNT (one period's worth at once). `200/s,1000`, `30/m`.
pub fn parse_limit(text: &str) -> Result<Option<Rate>, String> {
    let text = text.trim();
    if text == "0" || text.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = || format!("rate limit '{text}' must be COUNT/s|m|h[,BURST] (e.g. 200/s,1000) or 0");
    let (rate, burst) = match text.split_once(',') {
        Some((rate, burst)) => (rate.trim(), Some(burst.trim())),
        None => (text, None),
    };
    let (count, unit) = rate.split_once('/').ok_or_else(bad)?;
    let count: NonZeroU32 = count.trim().parse().map_err(|_| bad())?;
    let period = match unit.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        _ => return Err(bad()),
    };
    let burst = match burst {
        Some(b) => b.parse().map_err(|_| bad())?,
        None => count,
    };
    Ok(Some(Rate {
        count,
        period,
        burst,
    }))
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        parse_limit(s)?.ok_or_else(|| format!("'{s}' is no limit"))
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.period.as_secs() {
            60 => "m",
            3600 => "h",
            _ => "s",
        };
        write!(f, "{}/{unit},{}", self.count, self.burst)
    }
}

/// The limits a gateway applies; `None` turns one off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimits {
    /// Requests per client address (IPv6: per /64), for requests without a valid operator key.
    pub address: Option<Rate>,
    /// Requests per session, counted once the caller is authorised for it.
    pub session: Option<Rate>,
    /// Requests per operator API key (instead of the address limit).
    pub operator_key: Option<Rate>,
    /// Failed authentications (401/403) per client address; past it every request from that
    /// address is refused until the bucket refills.
    pub auth_failures: Option<Rate>,
}

fn rate(count: u32, period_secs: u64, burst: u32) -> Option<Rate> {
    Some(Rate {
        count: NonZeroU32::new(count)?,
        period: Duration::from_secs(period_secs),
        burst: NonZeroU32::new(burst)?,
    })
}

impl Default for RateLimits {
    /// Far above what a surface or a backend does (README, "Rate limits"), low enough that one
    /// client cannot flood the gateway or guess credentials.
    fn default() -> Self {
        Self {
            address: rate(200, 1, 1000),
            session: rate(50, 1, 500),
            operator_key: rate(1000, 1, 5000),
            auth_failures: rate(60, 60, 60),
        }
    }
}

impl RateLimits {
    /// Every limit off (benchmarks).
    pub fn off() -> Self {
        Self {
            address: None,
            session: None,
            operator_key: None,
            auth_failures: None,
        }
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Address,
    Session,
    OperatorKey,
    AuthFailures,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Address => "address",
            Self::Session => "session",
            Self::OperatorKey => "operator_key",
            Self::AuthFailures => "auth_failures",
        }
    }
}

/// Token buckets, one per key.
pub struct Limiter<K: Hash + Eq + Clone> {
    buckets: DefaultKeyedRateLimiter<K>,
    started: Instant,
    /// Milliseconds after `started` of the last sweep.
    swept: AtomicU64,
}

impl<K: Hash + Eq + Clone> Limiter<K> {
    pub fn new(rate: Rate) -> Self {
        Self {
            buckets: DefaultKeyedRateLimiter::keyed(rate.quota()),
            started: Instant::now(),
            swept: AtomicU64::new(0),
        }
    }

    /// Takes one token from `key`'s bucket; `Err(wait)` when it is empty: how long until it holds
    /// one again.
    pub fn check(&self, key: &K) -> Result<(), Duration> {
        self.sweep();
        self.buckets
            .check_key(key)
            .map_err(|not_until| not_until.wait_time_from(self.buckets.clock().now()))
    }

    /// How many keys the limiter holds.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    fn sweep(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.swept.load(Relaxed);
        if now.saturating_sub(last) < SWEEP_EVERY.as_millis() as u64 {
            return;
        }
        // One caller sweeps; the others go on.
        if self
            .swept
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
        {
            self.sweep_now();
        }
    }

    /// Drops the keys whose buckets are full (as if never seen).
    pub fn sweep_now(&self) {
        self.buckets.retain_recent();
        self.buckets.shrink_to_fit();
    }
}

/// Failed authentications per key: a bucket emptied by failures blocks the key (every request,
/// not only failing ones, so a guess that would succeed is refused too) until it holds a token.
pub struct Strikes<K: Hash + Eq + Clone> {
    limiter: Limiter<K>,
    blocked: Mutex<HashMap<K, Instant>>,
}

impl<K: Hash + Eq + Clone> Strikes<K> {
    pub fn new(rate: Rate) -> Self {
        Self {
            limiter: Limiter::new(rate),
            blocked: Mutex::new(HashMap::new()),
        }
    }

    /// `Err(wait)` while `key` is blocked.
    pub fn admit(&self, key: &K) -> Result<(), Duration> {
        let mut blocked = self.lock();
        let Some(until) = blocked.get(key).copied() else {
            return Ok(());
        };
        let now = Instant::now();
        if until <= now {
            blocked.remove(key);
            return Ok(());
        }
        Err(until - now)
    }

    /// Counts a failure; the one that empties the bucket blocks the key.
    pub fn strike(&self, key: &K) {
        let Err(wait) = self.limiter.check(key) else {
            return;
        };
        let now = Instant::now();
        let mut blocked = self.lock();
        if blocked.len() >= MAX_BLOCKED {
            blocked.retain(|_, until| *until > now);
        }
        if blocked.len() < MAX_BLOCKED {
            blocked.insert(key.clone(), now + wait);
        } else {
            tracing::warn!(
                "too many addresses blocked for failed authentications; not blocking more"
            );
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, Instant>> {
        self.blocked.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The key of a client address: IPv4 as is (an IPv4-mapped IPv6 address as its IPv4), IPv6 by
/// its /64, the block one host or one home network is given.
pub fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !(u128::from(u64::MAX))).into()),
        },
    }
}

/// Whole seconds for a `Retry-After` header: rounded up, at least 1.
pub fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_bursts_and_off() {
        assert_eq!(parse_limit("0"), Ok(None));
        assert_eq!(parse_limit("off"), Ok(None));
        let r = parse_limit("200/s,1000").expect("parses").expect("a limit");
        assert_eq!(
            (r.count.get(), r.period, r.burst.get()),
            (200, Duration::from_secs(1), 1000)
        );
        let r = parse_limit(" 30/m ").expect("parses").expect("a limit");
        assert_eq!(
            (r.count.get(), r.period, r.burst.get()),
            (30, Duration::from_secs(60), 30)
        );
        assert_eq!(r.to_string(), "30/m,30");
        for bad in ["", "10", "10/d", "-1/s", "0/s", "10/s,0", "10/s,x", "x/s"] {
            assert!(parse_limit(bad).is_err(), "{bad}");
        }
        let d = RateLimits::default();
        for rate in [d.address, d.session, d.operator_key, d.auth_failures] {
            let rate = rate.expect("every limit is on by default");
            assert_eq!(parse_limit(&rate.to_string()), Ok(Some(rate)));
        }
    }

    #[test]
    fn a_burst_then_refusal_with_the_wait() {
        let limiter = Limiter::new(Rate {
            count: NonZeroU32::MIN,
            period: Duration::from_secs(3600),
            burst: NonZeroU32::new(3).expect("non-zero"),
        });
        for _ in 0..3 {
            assert_eq!(limiter.check(&"a"), Ok(()));
        }
        let wait = limiter.check(&"a").expect_err("over the burst");
        assert!(
            wait > Duration::from_secs(3000) && wait <= Duration::from_secs(3600),
            "{wait:?}"
        );
        assert_eq!(
            limiter.check(&"b"),
            Ok(()),
            "another key has its own bucket"
        );
        assert_eq!(retry_after_secs(wait), wait.as_secs() + 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
    }

    #[test]
    fn refilled_keys_are_swept() {
        let limiter = Limiter::new(Rate {
            count: NonZeroU32::new(1_000_000).expect("non-zero"),
            period: Duration::from_secs(1),
            burst: NonZeroU32::MIN,
        });
        for i in 0..1000u32 {
            assert_eq!(limiter.check(&i), Ok(()));
        }
        assert_eq!(limiter.len(), 1000);
        // What is tested is time passing: a bucket refills in a microsecond.
        std::thread::sleep(Duration::from_millis(5));
        limiter.sweep_now();
        assert_eq!(limiter.len(), 0);
    }

    #[test]
    fn strikes_block_every_request_until_the_bucket_refills() {
        let strikes = Strikes::new(Rate {
            count: NonZeroU32::MIN,
            period: Duration::from_secs(3600),
            burst: NonZeroU32::new(2).expect("non-zero"),
        });
        let ip: IpAddr = [10, 0, 0, 1].into();
        strikes.strike(&ip);
        strikes.strike(&ip);
        assert_eq!(
            strikes.admit(&ip),
            Ok(()),
            "two failures are within the burst"
        );
        strikes.strike(&ip);
        let wait = strikes.admit(&ip).expect_err("the third failure blocks");
        assert!(wait > Duration::from_secs(3000), "{wait:?}");
        assert_eq!(strikes.admit(&[10, 0, 0, 2].into()), Ok(()));
    }

    #[test]
    fn ipv6_is_keyed_by_its_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().expect("ip");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(address_key(a), address_key(b));
        assert_ne!(address_key(a), address_key(c));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().expect("ip");
        assert_eq!(address_key(mapped), IpAddr::from([192, 0, 2, 7]));
    }
}
