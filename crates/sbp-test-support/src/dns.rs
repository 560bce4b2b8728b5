//! A real authoritative DNS server for tests (hickory-server), on loopback UDP and TCP at one
//! port: one zone with SRV records a test can replace while it runs, and A records for targets.
//! Stopped on drop.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_server::Server;
use hickory_server::proto::rr::rdata::{A, NS, SOA, SRV};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordType};
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{AxfrPolicy, Catalog, ZoneHandler, ZoneType};
use tokio::net::{TcpListener, UdpSocket};

/// Every record's TTL: 0, so a resolver caches nothing and sees [`TestDns::set_records`] at once.
const TTL: u32 = 0;
/// The zone's serial (no secondaries, so it never needs to change).
const SERIAL: u32 = 1;
/// How long the server waits for a TCP client's request.
const TCP_TIMEOUT: Duration = Duration::from_secs(5);
/// Tries at binding TCP on the port the kernel gave UDP (another test may hold it over TCP).
const BIND_TRIES: usize = 20;

/// One SRV record.
#[derive(Debug, Clone)]
pub struct TestSrv {
    /// The owner name, absolute: `_sbp._tcp.fed.test.`.
    pub name: String,
    pub priority: u16,
    pub weight: u16,
    pub port: u16,
    /// The target host, absolute (`gw1.fed.test.`), or `.` for "decidedly not available".
    pub target: String,
}

impl TestSrv {
    pub fn new(name: &str, priority: u16, weight: u16, port: u16, target: &str) -> Self {
        Self {
            name: name.to_owned(),
            priority,
            weight,
            port,
            target: target.to_owned(),
        }
    }
}

/// An authoritative server for one zone on `addr` (UDP and TCP). Names in the zone without
/// records answer NXDOMAIN; names outside it are refused.
pub struct TestDns {
    /// The server's address, UDP and TCP alike.
    pub addr: SocketAddr,
    zone: Arc<InMemoryZoneHandler>,
    /// Owns the tasks serving the sockets; dropping it aborts them.
    _server: Server<Catalog>,
}

impl TestDns {
    /// Serves `zone` (absolute, `fed.test.`: its SOA and NS are made up) with `records`.
    pub async fn start(zone: &str, records: Vec<TestSrv>) -> Self {
        let origin = dns_name(zone);
        let mut handler =
            InMemoryZoneHandler::empty(origin.clone(), ZoneType::Primary, AxfrPolicy::Deny);
        let ns = dns_name(&format!("ns.{zone}"));
        let soa = SOA::new(
            ns.clone(),
            dns_name(&format!("admin.{zone}")),
            SERIAL,
            60,
            60,
            60,
            TTL,
        );
        for record in [
            Record::from_rdata(origin.clone(), TTL, RData::SOA(soa)),
            Record::from_rdata(origin.clone(), TTL, RData::NS(NS(ns))),
        ] {
            assert!(
                handler.upsert_mut(record, SERIAL),
                "the zone's SOA and NS are stored"
            );
        }
        for record in &records {
            assert!(
                handler.upsert_mut(srv(record), SERIAL),
                "SRV {record:?} is stored"
            );
        }
        let zone = Arc::new(handler);

        let mut catalog = Catalog::new();
        catalog.upsert(
            LowerName::new(&origin),
            vec![zone.clone() as Arc<dyn ZoneHandler>],
        );
        let mut server = Server::new(catalog);
        let (udp, tcp) = bind_one_port().await;
        let addr = udp.local_addr().expect("the UDP socket's address");
        server.register_socket(udp);
        // 32: the largest response backlog per TCP connection, as hickory's own tests use.
        server.register_listener(tcp, TCP_TIMEOUT, 32);
        Self {
            addr,
            zone,
            _server: server,
        }
    }

    /// Replaces every SRV record of the zone with `records`, as the next query sees them.
    pub async fn set_records(&self, records: Vec<TestSrv>) {
        self.zone
            .records_mut()
            .await
            .retain(|key, _| key.record_type != RecordType::SRV);
        for record in &records {
            assert!(
                self.zone.upsert(srv(record), SERIAL).await,
                "SRV {record:?} is stored"
            );
        }
    }

    /// Adds an A record: `name` (absolute, in the zone) at `ip`.
    pub async fn add_a(&self, name: &str, ip: Ipv4Addr) {
        let record = Record::from_rdata(dns_name(name), TTL, RData::A(A(ip)));
        assert!(self.zone.upsert(record, SERIAL).await, "A {name} is stored");
    }
}

fn dns_name(text: &str) -> Name {
    let name = Name::from_ascii(text).unwrap_or_else(|e| panic!("`{text}` is a DNS name: {e}"));
    assert!(name.is_fqdn(), "`{text}` is absolute (ends with a dot)");
    name
}

fn srv(record: &TestSrv) -> Record {
    let data = SRV::new(
        record.priority,
        record.weight,
        record.port,
        dns_name(&record.target),
    );
    Record::from_rdata(dns_name(&record.name), TTL, RData::SRV(data))
}

/// A UDP socket on `127.0.0.1:0` and a TCP listener on the same port: the kernel picks a free UDP
/// port, which is not always free over TCP, so a collision picks another one.
async fn bind_one_port() -> (UdpSocket, TcpListener) {
    for _ in 0..BIND_TRIES {
        let udp = UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind UDP on loopback");
        let addr = udp.local_addr().expect("the UDP socket's address");
        if let Ok(tcp) = TcpListener::bind(addr).await {
            return (udp, tcp);
        }
    }
    panic!("no loopback port was free over both UDP and TCP in {BIND_TRIES} tries");
}
