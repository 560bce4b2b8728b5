//! Integration tests for sbp-mcp: real child processes and real loopback HTTP, no mocked network.

mod http;
mod reconnect;
mod stdio;
mod support;
