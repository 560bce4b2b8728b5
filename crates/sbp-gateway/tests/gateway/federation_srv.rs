//! SRV peer discovery against a real authoritative DNS server on loopback: RFC 2782 order, the
//! "." target, NXDOMAIN, records changed while running, a server error, and a DNS server that
//! never answers (an error in bounded time, not a hang); and the test server itself (A records,
//! stopped on drop).

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use sbp_gateway::federation::srv::{SrvError, SrvResolver, SrvTarget};
use sbp_test_support::{TestDns, TestSrv, WAIT};

const SERVICE: &str = "_sbp._tcp.fed.test.";

fn three_peers() -> Vec<TestSrv> {
    vec![
        TestSrv::new(SERVICE, 20, 0, 9443, "c.fed.test."),
        TestSrv::new(SERVICE, 10, 60, 8443, "a.fed.test."),
        TestSrv::new(SERVICE, 10, 40, 8444, "b.fed.test."),
        // The service is decidedly not available under `closed.fed.test`.
        TestSrv::new("_sbp._tcp.closed.fed.test.", 0, 0, 0, "."),
    ]
}

fn target(host: &str, port: u16, priority: u16, weight: u16) -> SrvTarget {
    SrvTarget {
        host: host.to_owned(),
        port,
        priority,
        weight,
    }
}

#[tokio::test]
async fn srv_targets_come_by_priority_then_weighted_order() {
    let dns = TestDns::start("fed.test.", three_peers()).await;
    let resolver = SrvResolver::new(Some(dns.addr)).expect("a resolver for the test server");

    let mut firsts = HashSet::new();
    for _ in 0..50 {
        let got = resolver.lookup("fed.test").await.expect("lookup");
        assert_eq!(got.len(), 3, "{got:?}");
        // Priority 10 before priority 20, whatever the weights.
        assert_eq!(got[2], target("c.fed.test", 9443, 20, 0));
        let mut first_two = got[..2].to_vec();
        first_two.sort_by(|x, y| x.host.cmp(&y.host));
        assert_eq!(
            first_two,
            [
                target("a.fed.test", 8443, 10, 60),
                target("b.fed.test", 8444, 10, 40)
            ]
        );
        firsts.insert(got[0].host.clone());
    }
    // Weighted random, not a fixed order: over 50 lookups each of weight 60 and 40 came first
    // (the chance that one never does is below 1e-11).
    assert_eq!(firsts.len(), 2, "{firsts:?}");

    // A trailing dot is the same domain.
    assert_eq!(resolver.lookup("fed.test.").await.expect("lookup").len(), 3);
}

#[tokio::test]
async fn a_dot_target_and_a_missing_name_have_no_targets() {
    let dns = TestDns::start("fed.test.", three_peers()).await;
    let resolver = SrvResolver::new(Some(dns.addr)).expect("resolver");

    assert_eq!(
        resolver.lookup("closed.fed.test").await.expect("lookup"),
        []
    );
    // NXDOMAIN: nothing at `_sbp._tcp.nothing.fed.test`.
    assert_eq!(
        resolver.lookup("nothing.fed.test").await.expect("lookup"),
        []
    );
}

#[tokio::test]
async fn replaced_records_are_what_the_next_lookup_sees() {
    let dns = TestDns::start("fed.test.", three_peers()).await;
    let resolver = SrvResolver::new(Some(dns.addr)).expect("resolver");
    assert_eq!(resolver.lookup("fed.test").await.expect("lookup").len(), 3);

    dns.set_records(vec![TestSrv::new(SERVICE, 5, 1, 7443, "d.fed.test.")])
        .await;
    assert_eq!(
        resolver.lookup("fed.test").await.expect("lookup"),
        [target("d.fed.test", 7443, 5, 1)]
    );
    assert_eq!(
        resolver.lookup("closed.fed.test").await.expect("lookup"),
        [],
        "the `.` record went with the others (NXDOMAIN now)"
    );

    dns.set_records(Vec::new()).await;
    assert_eq!(resolver.lookup("fed.test").await.expect("lookup"), []);
}

#[tokio::test]
async fn the_test_server_answers_a_records_for_targets() {
    let dns = TestDns::start("fed.test.", three_peers()).await;
    dns.add_a("a.fed.test.", Ipv4Addr::new(127, 0, 0, 1)).await;

    let resolver = plain_resolver(dns.addr);
    let answer = resolver.ipv4_lookup("a.fed.test.").await.expect("A lookup");
    let ips: Vec<Ipv4Addr> = answer
        .answers()
        .iter()
        .filter_map(|r| match &r.data {
            hickory_resolver::proto::rr::RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect();
    assert_eq!(ips, [Ipv4Addr::new(127, 0, 0, 1)]);
}

#[tokio::test]
async fn the_test_server_lets_go_of_its_port_when_dropped() {
    let dns = TestDns::start("fed.test.", three_peers()).await;
    let addr = dns.addr;
    drop(dns);
    // Both sockets are closed once the aborted tasks are gone: the port can be bound again.
    sbp_test_support::eventually(WAIT, "the port is free again", || async move {
        let udp = tokio::net::UdpSocket::bind(addr).await.ok()?;
        let tcp = tokio::net::TcpListener::bind(addr).await.ok()?;
        Some((udp, tcp))
    })
    .await;
}

#[tokio::test]
async fn a_name_outside_the_servers_zone_is_an_error_not_an_empty_answer() {
    let dns = TestDns::start("fed.test.", three_peers()).await;
    let resolver = SrvResolver::new(Some(dns.addr)).expect("resolver");
    // The server is authoritative for `fed.test` only: REFUSED.
    let err = resolver
        .lookup("elsewhere.test")
        .await
        .expect_err("REFUSED is an error");
    assert!(matches!(err, SrvError::Lookup { .. }), "{err:?}");
}

#[tokio::test]
async fn a_dns_server_that_never_answers_is_an_error_within_seven_seconds() {
    // Bound but never read: queries go unanswered (no ICMP refusal to fail fast on), and a TCP
    // connection is accepted by the kernel and then left silent.
    let udp = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = udp.local_addr().expect("addr");
    let _tcp = tokio::net::TcpListener::bind(addr).await.ok();

    let resolver = SrvResolver::new(Some(addr)).expect("resolver");
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(20), resolver.lookup("fed.test"))
        .await
        .expect("the lookup ends on its own");
    let took = started.elapsed();
    assert!(
        matches!(outcome, Err(SrvError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(took < Duration::from_secs(7), "took {took:?}");
    drop(udp);
}

/// A bare hickory resolver asking `addr` only, for the A records (which SRV discovery does not
/// look up itself).
fn plain_resolver(addr: SocketAddr) -> TokioResolver {
    let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
        .into_iter()
        .map(|mut c| {
            c.port = addr.port();
            c
        })
        .collect();
    let config = ResolverConfig::from_name_servers(vec![NameServerConfig::new(
        addr.ip(),
        true,
        connections,
    )]);
    TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
        .build()
        .expect("resolver")
}
