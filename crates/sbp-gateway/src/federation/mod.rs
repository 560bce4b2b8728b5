//! Federation (L6) plumbing that holds no engine state: this node's identity and manifest, the
//! trust placed in peers, the HTTP client that talks to them, the check of incoming federation
//! tokens, and DNS SRV discovery. The engine's `federation` service composes them.

pub mod auth;
pub mod client;
pub mod identity;
pub mod srv;
pub mod trust;
