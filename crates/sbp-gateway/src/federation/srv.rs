//! DNS SRV peer discovery (`--peer-srv DOMAIN`): `_sbp._tcp.DOMAIN` looked up with a maintained
//! stub resolver (hickory), its targets in RFC 2782 order. The targets are candidates only: a
//! caller still verifies each one's manifest under the trust rules before talking to it.

use std::net::{Ipv6Addr, SocketAddr};
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::{Name, RData, Record};
use rand::Rng as _;

/// The service label the gateways publish under: `_sbp._tcp.DOMAIN`.
const SERVICE: &str = "_sbp._tcp";

/// How long one query round may take, and how many rounds: a dead DNS server must not hold an
/// attach for longer than a few seconds.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
const ATTEMPTS: usize = 2;

/// The backstop over the resolver's own timeouts (`ATTEMPTS` × `ATTEMPT_TIMEOUT`, and a little),
/// in case a round outlasts them (several servers in resolv.conf, a fallback to TCP).
const LOOKUP_DEADLINE: Duration = Duration::from_millis(6_500);

/// At most this many targets are kept from one answer (the rest are the least preferred).
pub const MAX_TARGETS: usize = 64;

/// The longest domain name (RFC 1035, in its dotted text form without the final dot) and label.
const MAX_DOMAIN_LEN: usize = 253;
const MAX_LABEL_LEN: usize = 63;

/// Why an SRV lookup gave no answer (an empty answer is not an error: see [`SrvResolver::lookup`]).
#[derive(Debug, thiserror::Error)]
pub enum SrvError {
    /// The domain was refused before any query was sent.
    #[error("`{domain}` is not a domain to look up SRV records under: {reason}")]
    InvalidDomain {
        domain: String,
        reason: &'static str,
    },
    /// The resolver could not be set up (the system's configuration could not be read).
    #[error("the DNS resolver could not be configured")]
    Config(#[source] NetError),
    /// No DNS server answered in time.
    #[error("the DNS lookup of {name} timed out")]
    Timeout { name: String },
    /// The lookup failed otherwise: the transport, or a server error (SERVFAIL, REFUSED, …).
    #[error("the DNS lookup of {name} failed")]
    Lookup {
        name: String,
        #[source]
        source: NetError,
    },
}

/// One SRV target: where a peer gateway may be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrvTarget {
    /// The target's host name, without the trailing dot, lower case.
    pub host: String,
    pub port: u16,
    pub priority: u16,
    pub weight: u16,
}

impl SrvTarget {
    /// The target's base URL: `https://host:port`, or `http://host:port` when `allow_http`
    /// (`--federation-allow-http`). An IPv6 literal is bracketed.
    pub fn base_url(&self, allow_http: bool) -> String {
        let scheme = if allow_http { "http" } else { "https" };
        if self.host.parse::<Ipv6Addr>().is_ok() {
            format!("{scheme}://[{}]:{}", self.host, self.port)
        } else {
            format!("{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// Looks up a domain's `_sbp._tcp` SRV records.
#[derive(Clone)]
pub struct SrvResolver {
    inner: TokioResolver,
}

impl std::fmt::Debug for SrvResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrvResolver").finish_non_exhaustive()
    }
}

impl SrvResolver {
    /// A resolver asking `server` only (UDP, falling back to TCP for a truncated answer), or,
    /// with `None`, the servers of the system's configuration (`/etc/resolv.conf`).
    pub fn new(server: Option<SocketAddr>) -> Result<Self, SrvError> {
        let mut builder = match server {
            Some(addr) => TokioResolver::builder_with_config(
                one_server(addr),
                TokioRuntimeProvider::default(),
            ),
            None => TokioResolver::builder_tokio().map_err(SrvError::Config)?,
        };
        let options = builder.options_mut();
        options.timeout = ATTEMPT_TIMEOUT;
        // hickory's `attempts` counts the retries after the first query (unlike resolv.conf's).
        options.attempts = ATTEMPTS - 1;
        let inner = builder.build().map_err(SrvError::Config)?;
        Ok(Self { inner })
    }

    /// The targets of `_sbp._tcp.{domain}` in RFC 2782 order (priority ascending; within a
    /// priority, weighted random), at most [`MAX_TARGETS`]. A domain without such records
    /// (NXDOMAIN, or no SRV records) has none, and so does one whose only target is `.` (the
    /// service is decidedly not available there). Targets `.` and those on port 0 are never
    /// returned, as there is nothing to connect to.
    pub async fn lookup(&self, domain: &str) -> Result<Vec<SrvTarget>, SrvError> {
        let name = service_name(domain)?;
        let shown = name.to_ascii();
        let answer = tokio::time::timeout(LOOKUP_DEADLINE, self.inner.srv_lookup(name)).await;
        let lookup = match answer {
            Ok(Ok(lookup)) => lookup,
            Ok(Err(e)) if e.is_no_records_found() => return Ok(Vec::new()),
            Ok(Err(NetError::Timeout)) | Err(_) => return Err(SrvError::Timeout { name: shown }),
            Ok(Err(source)) => {
                return Err(SrvError::Lookup {
                    name: shown,
                    source,
                });
            }
        };
        let records = targets(lookup.answers());
        let mut rng = rand::rng();
        let mut ordered = order_rfc2782(records, &mut |total| rng.random_range(0..=total));
        ordered.truncate(MAX_TARGETS);
        Ok(ordered)
    }
}

/// A configuration naming `addr` alone, over UDP and TCP on its port.
fn one_server(addr: SocketAddr) -> ResolverConfig {
    let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
        .into_iter()
        .map(|mut c| {
            c.port = addr.port();
            c
        })
        .collect();
    ResolverConfig::from_name_servers(vec![NameServerConfig::new(addr.ip(), true, connections)])
}

/// Builds the query name `_sbp._tcp.{domain}.` from a domain checked first: at most 253
/// characters, labels of 1 to 63 ASCII letters, digits and hyphens (not at either end), an
/// optional final dot. Anything else is refused before a query is made.
fn service_name(domain: &str) -> Result<Name, SrvError> {
    let invalid = |reason| SrvError::InvalidDomain {
        domain: domain.chars().take(MAX_DOMAIN_LEN + 1).collect(),
        reason,
    };
    let bare = domain.strip_suffix('.').unwrap_or(domain);
    if bare.is_empty() {
        return Err(invalid("it is empty"));
    }
    if bare.len() > MAX_DOMAIN_LEN {
        return Err(invalid("it is longer than 253 characters"));
    }
    for label in bare.split('.') {
        if label.is_empty() {
            return Err(invalid("it has an empty label"));
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(invalid("a label is longer than 63 characters"));
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(invalid(
                "a label has a character other than ASCII letters, digits and hyphens",
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(invalid("a label starts or ends with a hyphen"));
        }
    }
    // The service labels add 10 characters: a domain near the limit makes a name DNS can't carry.
    Name::from_ascii(format!("{SERVICE}.{bare}."))
        .map_err(|_| invalid("with `_sbp._tcp.` in front it is too long for DNS"))
}

/// The SRV records of an answer as targets, less those with nothing to connect to.
fn targets(answers: &[Record]) -> Vec<SrvTarget> {
    answers
        .iter()
        .filter_map(|record| match &record.data {
            RData::SRV(srv) if !srv.target.is_root() && srv.port != 0 => Some(SrvTarget {
                host: host_of(&srv.target),
                port: srv.port,
                priority: srv.priority,
                weight: srv.weight,
            }),
            _ => None,
        })
        .collect()
}

/// A target's name as a host for a URL: no trailing dot, lower case (DNS names are not case
/// sensitive, and peers are compared by URL).
fn host_of(target: &Name) -> String {
    let text = target.to_ascii().to_ascii_lowercase();
    match text.strip_suffix('.') {
        Some(bare) => bare.to_owned(),
        None => text,
    }
}

/// Orders SRV records as RFC 2782 says: by priority, lowest first; within one priority, by
/// repeated weighted selection. Before each selection the remaining records are listed with
/// those of weight 0 first (otherwise in their order here), `pick(sum of their weights)` gives a
/// number in `0..=sum`, and the first record whose running sum of weights reaches it is next. So
/// a weight-0 record is chosen early only when the number is 0, and among weight-0 records alone
/// their order is kept. `pick` is the random source (injectable so tests are deterministic); a
/// number above the sum counts as the sum.
pub fn order_rfc2782(
    mut records: Vec<SrvTarget>,
    pick: &mut dyn FnMut(u32) -> u32,
) -> Vec<SrvTarget> {
    // Stable: equal priorities keep their order, which the weight-0-first arrangement relies on.
    records.sort_by_key(|r| r.priority);
    let mut ordered = Vec::with_capacity(records.len());
    let mut rest = records.into_iter().peekable();
    while let Some(first) = rest.next() {
        let priority = first.priority;
        let mut group = vec![first];
        while let Some(next) = rest.next_if(|r| r.priority == priority) {
            group.push(next);
        }
        // Weight 0 first, the others after, each in their order.
        group.sort_by_key(|r| r.weight != 0);
        while !group.is_empty() {
            let total: u32 = group.iter().map(|r| u32::from(r.weight)).sum();
            let chosen = pick(total).min(total);
            let mut running = 0u32;
            let index = group
                .iter()
                .position(|r| {
                    running += u32::from(r.weight);
                    running >= chosen
                })
                // Unreachable: the last running sum is `total` ≥ `chosen`.
                .unwrap_or(group.len() - 1);
            ordered.push(group.remove(index));
        }
    }
    ordered
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(host: &str, priority: u16, weight: u16) -> SrvTarget {
        SrvTarget {
            host: host.to_owned(),
            port: 443,
            priority,
            weight,
        }
    }

    fn hosts(targets: &[SrvTarget]) -> Vec<&str> {
        targets.iter().map(|t| t.host.as_str()).collect()
    }

    /// A picker answering `script` in turn, recording the totals it was asked about.
    fn scripted(
        script: &[u32],
    ) -> (
        impl FnMut(u32) -> u32,
        std::rc::Rc<std::cell::RefCell<Vec<u32>>>,
    ) {
        let asked = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let seen = asked.clone();
        let mut script = script.iter().copied();
        let picker = move |total| {
            seen.borrow_mut().push(total);
            script
                .next()
                .expect("the picker was asked more often than scripted")
        };
        (picker, asked)
    }

    #[test]
    fn lower_priorities_come_first_whatever_the_weights() {
        let records = vec![
            target("c", 20, 100),
            target("a", 10, 0),
            target("d", 30, 5),
            target("b", 10, 0),
        ];
        let ordered = order_rfc2782(records, &mut |_| 0);
        assert_eq!(hosts(&ordered), ["a", "b", "c", "d"]);
    }

    #[test]
    fn within_a_priority_the_running_sum_decides() {
        // Weights 10, 20, 30 (running sums 10, 30, 60 in this order).
        let records = vec![
            target("w10", 1, 10),
            target("w20", 1, 20),
            target("w30", 1, 30),
        ];
        // 11 is past w10's 10 but within w20's 30: w20. Then w10, w30 with sums 10, 40: 40 → w30.
        // Then w10 alone: any number picks it.
        let (mut picker, asked) = scripted(&[11, 40, 3]);
        let ordered = order_rfc2782(records, &mut picker);
        assert_eq!(hosts(&ordered), ["w20", "w30", "w10"]);
        assert_eq!(*asked.borrow(), [60, 40, 10], "the sum of the weights left");
    }

    #[test]
    fn a_number_equal_to_a_running_sum_picks_that_record() {
        let records = vec![target("a", 0, 10), target("b", 0, 20)];
        let (mut picker, _) = scripted(&[10, 0]);
        assert_eq!(hosts(&order_rfc2782(records, &mut picker)), ["a", "b"]);

        let records = vec![target("a", 0, 10), target("b", 0, 20)];
        let (mut picker, _) = scripted(&[30, 0]);
        assert_eq!(hosts(&order_rfc2782(records, &mut picker)), ["b", "a"]);
    }

    #[test]
    fn zero_weights_are_listed_first_and_chosen_only_on_zero() {
        // As listed: w5, z1, w7, z2. Arranged: z1, z2 (weight 0), then w5, w7: sums 0, 0, 5, 12.
        let records = vec![
            target("w5", 2, 5),
            target("z1", 2, 0),
            target("w7", 2, 7),
            target("z2", 2, 0),
        ];
        // 0 → z1 (the first whose sum reaches 0). Then z2, w5, w7 (0, 5, 12): 1 → w5.
        // Then z2, w7 (0, 7): 7 → w7. Then z2 alone, total 0.
        let (mut picker, asked) = scripted(&[0, 1, 7, 0]);
        let ordered = order_rfc2782(records, &mut picker);
        assert_eq!(hosts(&ordered), ["z1", "w5", "w7", "z2"]);
        assert_eq!(*asked.borrow(), [12, 12, 7, 0]);
    }

    #[test]
    fn only_zero_weights_keep_their_order() {
        let records = vec![target("a", 0, 0), target("b", 0, 0), target("c", 0, 0)];
        let (mut picker, asked) = scripted(&[0, 0, 0]);
        assert_eq!(hosts(&order_rfc2782(records, &mut picker)), ["a", "b", "c"]);
        assert_eq!(*asked.borrow(), [0, 0, 0]);
    }

    #[test]
    fn each_priority_is_ordered_on_its_own() {
        let records = vec![
            target("p2-a", 2, 1),
            target("p1-a", 1, 1),
            target("p2-b", 2, 1),
            target("p1-b", 1, 1),
        ];
        // Priority 1: total 2, pick 2 → p1-b, then p1-a. Priority 2: pick 2 → p2-b, then p2-a.
        let (mut picker, asked) = scripted(&[2, 1, 2, 1]);
        let ordered = order_rfc2782(records, &mut picker);
        assert_eq!(hosts(&ordered), ["p1-b", "p1-a", "p2-b", "p2-a"]);
        assert_eq!(*asked.borrow(), [2, 1, 2, 1]);
    }

    #[test]
    fn a_picker_out_of_range_counts_as_the_sum() {
        let records = vec![target("a", 0, 1), target("b", 0, 1)];
        let ordered = order_rfc2782(records, &mut |_| u32::MAX);
        assert_eq!(hosts(&ordered), ["b", "a"]);
    }

    #[test]
    fn weights_shape_the_first_choice() {
        // Over every number the RFC draws from (0..=sum), each record is chosen first as often as
        // its weight says (weight 0: only on 0).
        let weights = [0u16, 1, 3, 6];
        let total: u32 = weights.iter().map(|&w| u32::from(w)).sum();
        let mut first = std::collections::HashMap::new();
        for n in 0..=total {
            let records = weights
                .iter()
                .map(|&w| target(&format!("w{w}"), 0, w))
                .collect();
            let mut draws = std::iter::once(n).chain(std::iter::repeat(0));
            let ordered = order_rfc2782(records, &mut |_| draws.next().unwrap_or(0));
            *first.entry(ordered[0].host.clone()).or_insert(0u32) += 1;
        }
        assert_eq!(first["w0"], 1);
        assert_eq!(first["w1"], 1);
        assert_eq!(first["w3"], 3);
        assert_eq!(first["w6"], 6);
    }

    #[test]
    fn base_urls_bracket_ipv6_and_choose_the_scheme() {
        let t = SrvTarget {
            host: "gw.example.org".into(),
            port: 8443,
            priority: 0,
            weight: 0,
        };
        assert_eq!(t.base_url(false), "https://gw.example.org:8443");
        assert_eq!(t.base_url(true), "http://gw.example.org:8443");
        let v6 = SrvTarget {
            host: "::1".into(),
            ..t.clone()
        };
        assert_eq!(v6.base_url(false), "https://[::1]:8443");
        let v4 = SrvTarget {
            host: "127.0.0.1".into(),
            ..t
        };
        assert_eq!(v4.base_url(true), "http://127.0.0.1:8443");
    }

    #[test]
    fn domains_are_checked_before_any_query() {
        for ok in [
            "fed.test",
            "fed.test.",
            "a-b.example.org",
            "x",
            &"a".repeat(63),
        ] {
            let name = service_name(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(name.is_fqdn());
            assert!(name.to_ascii().starts_with("_sbp._tcp."), "{name}");
        }
        let long_label = "a".repeat(64);
        let long_domain = vec!["a".repeat(50); 5].join("."); // 254 characters
        for bad in [
            "",
            ".",
            "fed..test",
            ".fed.test",
            "fed test",
            "fed.test/",
            "_sbp.fed.test",
            "fed.tést",
            "-fed.test",
            "fed-.test",
            "fed.test..",
            long_label.as_str(),
            long_domain.as_str(),
        ] {
            assert!(
                matches!(service_name(bad), Err(SrvError::InvalidDomain { .. })),
                "{bad:?} was accepted"
            );
        }
        // Within 253 characters but too long once the service labels are in front.
        let near = vec!["a".repeat(49); 5].join(".");
        assert_eq!(near.len(), 249);
        assert!(matches!(
            service_name(&near),
            Err(SrvError::InvalidDomain { .. })
        ));
    }

    #[test]
    fn a_lookup_can_run_on_a_spawned_task() {
        fn send<T: Send>(_: &T) {}
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let resolver = SrvResolver::new(Some(([127, 0, 0, 1], 9).into())).expect("resolver");
            // Only its type matters here (the random source is not held across an await).
            send(&resolver.lookup("fed.test"));
        });
    }

    #[test]
    fn targets_leave_out_the_root_and_port_zero() {
        use hickory_resolver::proto::rr::rdata::SRV;
        let record = |target: &str, port| {
            Record::from_rdata(
                Name::from_ascii("_sbp._tcp.fed.test.").expect("name"),
                60,
                RData::SRV(SRV::new(
                    1,
                    2,
                    port,
                    Name::from_ascii(target).expect("name"),
                )),
            )
        };
        let got = targets(&[
            record(".", 443),
            record("GW.Fed.Test.", 443),
            record("zero.fed.test.", 0),
        ]);
        assert_eq!(
            got,
            [SrvTarget {
                host: "gw.fed.test".into(),
                port: 443,
                priority: 1,
                weight: 2
            }]
        );
    }
}
