//! Admission of new connections: a cap on all of them and one per client IP, each counting a
//! socket for as long as it is open (a WebSocket surface included), and a small headroom beyond
//! the caps where `/healthz` is still answered, so a load balancer can tell "full" from "dead".

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::conn::Conn;

/// Connections admitted beyond the caps, for `/healthz` only. When they are all taken, the oldest
/// one that has not sent a byte yet makes room (a health check sends its request at once; a
/// socket that sends nothing is what fills a headroom), one of the newcomer's own address first,
/// so a flood from one address makes room among its own sockets rather than a prober's. A socket
/// whose request has arrived but not been read yet (its task not run yet in a burst of accepts)
/// is not silent and keeps its place.
pub(crate) const HEALTH_HEADROOM: usize = 32;

/// Evicted headroom connections whose task has not closed their socket yet. Eviction only asks
/// the task to close it, and in a burst of accepts the accept loop can run far ahead of those
/// tasks: without this bound, every socket of a flood past the caps stays open until its task
/// runs, and the process runs out of file descriptors (seen at a limit of 512 with 1,100 idle
/// sockets on two busy cores). At it, the accept loop waits for those tasks
/// ([`Limits::room_to_evict`]), leaving the flood in the kernel's queue; a newcomer admitted at
/// it anyway is closed at once instead of evicting.
const LEAVING_MAX: usize = HEALTH_HEADROOM;

pub(crate) struct Limits {
    max: usize,
    per_ip: usize,
    counts: Mutex<Counts>,
    /// An evicted connection's socket was closed.
    left: tokio::sync::Notify,
}

#[derive(Default)]
struct Counts {
    total: usize,
    by_ip: HashMap<IpKey, usize>,
    /// The headroom's connections, each with its number.
    health: Vec<(u64, Arc<Conn>)>,
    next_health: u64,
    /// Evicted from the headroom, their socket not closed yet (their [`Slot`] not dropped).
    leaving: usize,
}

/// What admission decided.
pub(crate) enum Admission {
    /// Served normally.
    Normal(Slot),
    /// Over a cap: served for `/healthz` only, then closed.
    HealthOnly(Slot),
    /// Over a cap and no headroom left: closed at once.
    Refused,
}

/// A connection's place under the caps, given back when dropped (with its socket).
pub(crate) struct Slot {
    limits: Arc<Limits>,
    held: Held,
}

enum Held {
    Normal(IpKey),
    Health(u64),
}

/// The unit the per-IP cap counts: an IPv4 address, or an IPv6 /64 (what one subscriber is
/// usually given: counting single IPv6 addresses would not limit anyone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum IpKey {
    V4([u8; 4]),
    V6Prefix([u8; 8]),
}

impl IpKey {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::V4(v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self::V4(v4.octets()),
                None => {
                    let o = v6.octets();
                    Self::V6Prefix([o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]])
                }
            },
        }
    }
}

impl Limits {
    /// `per_ip` 0: no per-IP cap.
    pub fn new(max: usize, per_ip: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            per_ip,
            counts: Mutex::new(Counts::default()),
            left: tokio::sync::Notify::new(),
        })
    }

    /// Resolves once fewer than [`LEAVING_MAX`] evicted sockets are still open, so that admitting
    /// one more connection never leaves more open.
    pub async fn room_to_evict(&self) {
        loop {
            let left = self.left.notified();
            tokio::pin!(left);
            left.as_mut().enable();
            if self.counts().leaving < LEAVING_MAX {
                return;
            }
            left.await;
        }
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        // Counts are updated in single statements: a panic cannot leave them half-changed.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a new connection from `ip` fits under the caps (the caller then builds it as
    /// normal or health-only and calls [`Limits::admit`]).
    pub fn fits(&self, ip: IpAddr) -> bool {
        let key = IpKey::of(ip);
        let c = self.counts();
        c.total < self.max
            && (self.per_ip == 0 || c.by_ip.get(&key).copied().unwrap_or(0) < self.per_ip)
    }

    /// Admits `conn`: under the caps if it still fits, else into the health headroom (evicting
    /// the oldest headroom connection that has sent nothing when it is full), else not at all.
    pub fn admit(self: &Arc<Self>, conn: &Arc<Conn>) -> Admission {
        let key = IpKey::of(conn.peer.ip());
        let mut c = self.counts();
        let from_ip = c.by_ip.get(&key).copied().unwrap_or(0);
        if !conn.health_only && c.total < self.max && (self.per_ip == 0 || from_ip < self.per_ip) {
            c.total += 1;
            *c.by_ip.entry(key).or_insert(0) += 1;
            return Admission::Normal(Slot {
                limits: self.clone(),
                held: Held::Normal(key),
            });
        }
        if c.health.len() >= HEALTH_HEADROOM {
            if c.leaving >= LEAVING_MAX {
                return Admission::Refused;
            }
            // Ordered by: another address than the newcomer's last, then age.
            let victim = c
                .health
                .iter()
                .enumerate()
                .filter_map(|(i, (_, h))| {
                    let since = h.fresh_since()?;
                    let other = IpKey::of(h.peer.ip()) != key;
                    Some(((other, since), i, h))
                })
                .filter(|(_, _, h)| !h.has_unread())
                .min_by_key(|(rank, _, _)| *rank);
            let Some((_, i, _)) = victim else {
                return Admission::Refused;
            };
            let (_, evicted) = c.health.swap_remove(i);
            evicted.evict_if_fresh();
            c.leaving += 1;
        }
        let number = c.next_health;
        c.next_health += 1;
        c.health.push((number, conn.clone()));
        Admission::HealthOnly(Slot {
            limits: self.clone(),
            held: Held::Health(number),
        })
    }

    /// Connections open under the caps, and in the headroom.
    pub fn open(&self) -> (usize, usize) {
        let c = self.counts();
        (c.total, c.health.len())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.limits.counts();
        match self.held {
            Held::Normal(key) => {
                c.total = c.total.saturating_sub(1);
                if let Some(n) = c.by_ip.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        c.by_ip.remove(&key);
                    }
                }
            }
            Held::Health(number) => match c.health.iter().position(|(n, _)| *n == number) {
                Some(i) => {
                    c.health.swap_remove(i);
                }
                // Gone already: it was evicted, and its socket is closed now.
                None => {
                    c.leaving = c.leaving.saturating_sub(1);
                    self.limits.left.notify_waiters();
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use futures::FutureExt as _;

    use super::*;

    fn conn(ip: [u8; 4], health_only: bool) -> Arc<Conn> {
        Arc::new(Conn::new(SocketAddr::from((ip, 1000)), health_only))
    }

    fn normal(limits: &Arc<Limits>, ip: [u8; 4]) -> Option<Slot> {
        match limits.admit(&conn(ip, false)) {
            Admission::Normal(slot) => Some(slot),
            _ => None,
        }
    }

    #[test]
    fn caps_count_open_connections_and_give_back_on_drop() {
        let limits = Limits::new(3, 2);
        let a1 = normal(&limits, [10, 0, 0, 1]).expect("first");
        let _a2 = normal(&limits, [10, 0, 0, 1]).expect("second from the same IP");
        assert!(!limits.fits("10.0.0.1".parse().expect("ip")), "per-IP cap");
        assert!(limits.fits("10.0.0.2".parse().expect("ip")));
        let _b1 = normal(&limits, [10, 0, 0, 2]).expect("another IP");
        assert!(!limits.fits("10.0.0.3".parse().expect("ip")), "global cap");
        assert_eq!(limits.open(), (3, 0));
        drop(a1);
        assert!(limits.fits("10.0.0.1".parse().expect("ip")));
        assert_eq!(limits.open(), (2, 0));
    }

    #[test]
    fn headroom_evicts_the_oldest_silent_connection_and_refuses_when_none_is() {
        let limits = Limits::new(1, 0);
        let _full = normal(&limits, [10, 0, 0, 1]).expect("first");
        let mut held = Vec::new();
        let mut conns = Vec::new();
        for _ in 0..HEALTH_HEADROOM {
            let c = conn([10, 0, 0, 2], true);
            match limits.admit(&c) {
                Admission::HealthOnly(slot) => held.push(slot),
                _ => panic!("headroom left"),
            }
            conns.push(c);
        }
        let newest = conn([10, 0, 0, 2], true);
        match limits.admit(&newest) {
            Admission::HealthOnly(slot) => held.push(slot),
            _ => panic!("room is made"),
        }
        assert!(conns[0].fresh_since().is_none(), "the oldest was evicted");
        assert!(conns[1].fresh_since().is_some());
        assert_eq!(limits.open().1, HEALTH_HEADROOM, "its place was taken over");
        // Connections that are reading a request are not evicted.
        for c in &conns {
            c.request_started();
        }
        let mut slots = Vec::new();
        // The newest (still silent) one can still be replaced, once.
        let c = conn([10, 0, 0, 2], true);
        match limits.admit(&c) {
            Admission::HealthOnly(slot) => slots.push(slot),
            _ => panic!("the silent newest one makes room"),
        }
        c.request_started();
        assert!(matches!(
            limits.admit(&conn([10, 0, 0, 2], true)),
            Admission::Refused
        ));
    }

    fn health(limits: &Arc<Limits>, c: &Arc<Conn>) -> Slot {
        match limits.admit(c) {
            Admission::HealthOnly(slot) => slot,
            _ => panic!("admitted to the headroom"),
        }
    }

    #[test]
    fn a_full_headroom_makes_room_among_the_newcomers_own_address_first() {
        let limits = Limits::new(1, 0);
        let _full = normal(&limits, [10, 0, 0, 1]).expect("first");
        let prober = conn([10, 0, 0, 9], true);
        let mut held = vec![health(&limits, &prober)];
        let mut flood = Vec::new();
        for _ in 1..HEALTH_HEADROOM {
            let c = conn([10, 0, 0, 2], true);
            held.push(health(&limits, &c));
            flood.push(c);
        }
        // The prober's socket is the oldest, but the flood's address evicts its own (each
        // evicted socket closed by its task before the next arrives).
        let mut newcomers: Vec<(Arc<Conn>, Slot)> = Vec::new();
        for _ in 0..3 * HEALTH_HEADROOM {
            let c = conn([10, 0, 0, 2], true);
            let slot = health(&limits, &c);
            newcomers.retain(|(c, _)| c.fresh_since().is_some());
            newcomers.push((c, slot));
        }
        assert!(prober.fresh_since().is_some(), "the prober keeps its place");
        assert!(flood.iter().all(|c| c.fresh_since().is_none()));
        // Another address takes the oldest of all.
        held.push(health(&limits, &conn([10, 0, 0, 3], true)));
        assert!(prober.fresh_since().is_none());
    }

    #[test]
    fn evicted_sockets_not_closed_yet_bound_further_evictions() {
        let limits = Limits::new(1, 0);
        let _full = normal(&limits, [10, 0, 0, 1]).expect("first");
        // The headroom full, then as many evictions whose tasks have not run (slots kept).
        let mut held: Vec<(Arc<Conn>, Slot)> = Vec::new();
        for _ in 0..HEALTH_HEADROOM + LEAVING_MAX {
            let c = conn([10, 0, 0, 2], true);
            let slot = health(&limits, &c);
            held.push((c, slot));
        }
        assert_eq!(
            held.iter()
                .filter(|(c, _)| c.fresh_since().is_none())
                .count(),
            LEAVING_MAX
        );
        // The accept loop waits; a newcomer admitted anyway is closed at once: evicting would
        // leave one more socket open.
        let waiting = limits.room_to_evict();
        let mut waiting = Box::pin(waiting);
        assert!(
            (&mut waiting).now_or_never().is_none(),
            "the accept loop waits"
        );
        let newest = conn([10, 0, 0, 3], true);
        assert!(matches!(limits.admit(&newest), Admission::Refused));
        assert_eq!(limits.open().1, HEALTH_HEADROOM);
        // One evicted socket closed by its task: one eviction is possible again, and only one.
        let i = held
            .iter()
            .position(|(c, _)| c.fresh_since().is_none())
            .expect("an evicted one");
        held.swap_remove(i);
        assert!(
            waiting.now_or_never().is_some(),
            "and goes on once one is closed"
        );
        let again = health(&limits, &conn([10, 0, 0, 3], true));
        assert!(matches!(
            limits.admit(&conn([10, 0, 0, 3], true)),
            Admission::Refused
        ));
        // Every evicted one closed: none is leaving, and a headroom one closing is not counted.
        held.retain(|(c, _)| c.fresh_since().is_some());
        assert_eq!(limits.counts().leaving, 0);
        drop(again);
        assert_eq!(limits.counts().leaving, 0);
        assert_eq!(limits.open().1, HEALTH_HEADROOM - 1);
    }

    #[test]
    fn a_socket_whose_request_waits_unread_is_not_evicted_as_silent() {
        use std::io::Write as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let limits = Limits::new(1, 0);
        let _full = normal(&limits, [10, 0, 0, 1]).expect("first");
        // Real sockets: the oldest has sent its request, which nobody has read.
        let mut clients = Vec::new();
        let mut held = Vec::new();
        let mut conns = Vec::new();
        for i in 0..HEALTH_HEADROOM {
            let mut client = std::net::TcpStream::connect(addr).expect("connect");
            let (server, peer) = listener.accept().expect("accept");
            server.set_nonblocking(true).expect("nonblocking");
            if i == 0 {
                client
                    .write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
                    .expect("write");
                // The bytes are in the server's receive queue before admission looks.
                let mut byte = [0u8; 1];
                while server.peek(&mut byte).map_or(true, |n| n == 0) {
                    std::thread::yield_now();
                }
            }
            let c = Arc::new(Conn::new(peer, true));
            c.peek_through(&server);
            held.push(health(&limits, &c));
            conns.push((c, server));
            clients.push(client);
        }
        assert!(conns[0].0.has_unread());
        assert!(!conns[1].0.has_unread());
        held.push(health(&limits, &conn([127, 0, 0, 1], true)));
        assert!(conns[0].0.fresh_since().is_some(), "the prober is kept");
        assert!(
            conns[1].0.fresh_since().is_none(),
            "the oldest silent one made room"
        );
    }

    #[test]
    fn ipv6_clients_are_counted_per_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().expect("ip");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(IpKey::of(a), IpKey::of(b));
        assert_ne!(IpKey::of(a), IpKey::of(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("ip");
        let v4: IpAddr = "10.0.0.1".parse().expect("ip");
        assert_eq!(IpKey::of(mapped), IpKey::of(v4));
    }
}
