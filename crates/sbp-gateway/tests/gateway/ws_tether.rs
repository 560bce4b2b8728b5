//! ws_tether tests.
