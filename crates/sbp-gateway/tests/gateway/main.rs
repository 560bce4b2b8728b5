//! Integration tests of the gateway over loopback with real clients. One binary; a module per area.

mod support;

mod anthropic;
mod architecture;
mod bounded_input;
mod cors;
mod edge;
mod federation_srv;
mod history_cache;
mod http_edge;
mod http_l1;
mod lifecycle;
mod mcp;
mod metrics;
mod openai_compat;
mod openapi;
mod roaming;
mod sessions;
mod surfaces;
mod tls;
mod tools;
mod ws_conformance;
mod ws_handshake;
mod ws_limits;
mod ws_raw;
mod ws_tether;
