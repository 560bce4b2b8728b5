//! Integration tests of the client SDK against the real gateway, in-process on loopback. One
//! binary; a module per area.

mod support;

mod moves;
mod reconnect;
mod rest;
mod surface;
mod tools;
