//! Integration tests of the gateway over loopback with real clients. One binary; a module per area.

mod support;

mod conformance;
mod http_l1;
mod lifecycle;
mod roaming;
mod ws_handshake;
mod ws_tether;
