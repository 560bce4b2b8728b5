//! ws_handshake tests.
