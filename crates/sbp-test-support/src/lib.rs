//! What the workspace's integration-test suites share, so each suite's `support` module keeps only
//! what is its own. A dev-dependency, except for the bench and the soak suite (feature `procs`).
//!
//! - always: [`WAIT`], polling ([`poll_until_ok`], [`eventually`], [`wait_until`]), the machine's
//!   test services ([`test_database_url`], [`test_pg_tls`], [`test_redis_url`], [`delete_prefix`]) and
//!   [`run_then_clean_up`];
//! - feature `clients`: HTTP helpers (`send`, `response`, `sse_data`, `client`), a raw HTTP/1.1
//!   socket for misbehaving clients (`RawHttp`), a surface's WebSocket (`Ws`, `WsEvent`, over
//!   `wss://` too), and a self-signed certificate with clients that trust it (`TestCert`);
//! - feature `gateway`: `TestGateway`, the real gateway in-process on `127.0.0.1:0` over a SQLite
//!   file in a temp dir, built with the gateway crate's root API only;
//! - feature `dns`: `TestDns`, an authoritative DNS server on loopback (UDP and TCP) with SRV
//!   records a test can replace and A records, for SRV peer discovery;
//! - feature `procs`: release binaries as child processes ([`procs::spawn_listening`]), their
//!   logs, and the PostgreSQL statements that make and drop a schema ([`procs::pg_exec`]).
//!
//! The suites of crates the gateway is built from (sbp-store, sbp-bus, sbp-mcp) use no feature.

use std::time::Duration;

mod services;
mod wait;

#[cfg(feature = "dns")]
mod dns;
#[cfg(feature = "gateway")]
mod gateway;
#[cfg(feature = "clients")]
mod http;
#[cfg(feature = "procs")]
pub mod procs;
#[cfg(feature = "clients")]
mod raw;
#[cfg(feature = "clients")]
mod tls;
#[cfg(feature = "clients")]
mod ws;

pub use services::{
    PgTestTls, delete_prefix, delete_prefix_blocking, run_then_clean_up, test_database_url,
    test_pg_tls, test_redis_url,
};
pub use wait::{eventually, poll_until_ok, wait_until};

#[cfg(feature = "dns")]
pub use dns::{TestDns, TestSrv};
#[cfg(feature = "gateway")]
pub use gateway::{Options, TestGateway, Upstream, config, db_path};
#[cfg(feature = "clients")]
pub use http::{client, response, send, sse_data};
#[cfg(feature = "clients")]
pub use raw::{RawHttp, RawResponse, head};
#[cfg(feature = "clients")]
pub use tls::TestCert;
#[cfg(feature = "clients")]
pub use ws::{Ws, WsEvent};

/// Upper bound on any single expected event (a response, a frame, a state change); a test that
/// needs it has failed.
pub const WAIT: Duration = Duration::from_secs(10);
