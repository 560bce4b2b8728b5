//! Gateway federation (L6): how this gateway finds and talks to its peers.

pub mod srv;
