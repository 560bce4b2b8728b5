//! A Rust client SDK for State Bridge Protocol gateways, over the public protocol only: the HTTP
//! API ([`Client`], [`SessionClient`]) and a WebSocket surface ([`Surface`]) that reconnects by
//! itself. Frames are the [`sbp_protocol`] crate's types (re-exported as [`protocol`]).
//!
//! # A surface
//!
//! [`Surface::connect`] attaches with a [`SurfaceContext`](protocol::SurfaceContext) and returns
//! once the gateway has answered SESSION_ATTACHED (or with [`Error::Forbidden`] /
//! [`Error::SessionNotFound`]). Its [`Event`]s are, in order: [`Event::Connected`], the server's
//! frames (drained TETHER_TURNs, live TURN_CHUNKs and TURN_COMPLETEs, TOOL_CALLs, PINGs, unknown
//! types), and the connection's state changes ([`Event::Disconnected`], [`Event::Reconnecting`],
//! `Connected` again).
//!
//! Behind it, one task owns the socket and:
//! - answers PING with PONG, and each TOOL_CALL with a TOOL_RESULT from the [`ToolHandler`] (run on
//!   a task per call, so calls overlap and never hold up the event stream; a handler that panics
//!   still answers, with an error). The handler's tools are declared in every ATTACH_SESSION
//!   (`mcp_tools`, and `mcp_tool_schemas` for those with a schema or description);
//! - works in the gateway's *ack mode*: each attach sends `last_seq`, the highest tether seq the
//!   application has taken from [`Surface::next_event`], and every seq taken is ACKed. A turn the
//!   application has not taken is never acknowledged, so a drop loses nothing;
//! - drops repeats: a TETHER_TURN or TURN_COMPLETE whose seq is not above the highest received is
//!   not handed out again (after a reconnect the gateway resends what was not yet acknowledged);
//! - reconnects after a drop with exponential backoff and jitter ([`ReconnectPolicy`]), but not after
//!   a terminal close: 4003 forbidden, 4004 not found, 4409 displaced by another surface, 1003
//!   protocol error (configurable). The last event is then that `Disconnected`.
//!
//! TURN_CHUNKs of a turn cut off by a drop are not completed: after the reconnect the whole turn
//! arrives as a TETHER_TURN. An application that shows chunks as they come should discard the
//! partial text of a turn that had no TURN_COMPLETE when it sees `Disconnected`.
//!
//! ```no_run
//! use sbp_client::protocol::ServerFrame;
//! use sbp_client::{Client, Event, Surface, ToolSpec, Tools};
//! use serde_json::json;
//!
//! # async fn demo() -> Result<(), sbp_client::Error> {
//! let client = Client::new("http://127.0.0.1:8080")?;
//! let session = client.create_session(Default::default()).await?;
//!
//! let tools = Tools::new().tool(
//!     ToolSpec::new("gps").description("Where the device is"),
//!     |_input| async { Ok(json!({"lat": 35.68, "lon": 139.76})) },
//! );
//! let mut surface = Surface::connect(session.surface().device_type("mobile").tools(tools)).await?;
//!
//! // Output arrives over the WebSocket; messages go over HTTP.
//! let reply = session.send_message("Where am I?").await?;
//! println!("HTTP reply: {}", reply.text);
//!
//! while let Some(event) = surface.next_event().await {
//!     match event {
//!         Event::Frame(ServerFrame::TetherTurn(t)) => println!("while you were away: {:?}", t.content),
//!         Event::Frame(ServerFrame::TurnChunk(c)) => print!("{}", c.delta),
//!         Event::Frame(ServerFrame::TurnComplete(_)) => break,
//!         Event::Disconnected(d) if !d.will_reconnect => break,
//!         _ => {}
//!     }
//! }
//! // Persist this to resume without repeats next time: `SurfaceConfig::resume_from`.
//! let _last_seq = surface.last_seq();
//! surface.close().await; // ACK, DETACH, wait for the gateway's close
//! # Ok(())
//! # }
//! ```
//!
//! # The HTTP side
//!
//! [`Client`] (optionally with an operator API key) creates and imports sessions and inspects
//! roaming tokens; [`SessionClient`] (holding the session token, sent as `X-Session-Token`) sends
//! messages, reads the session, its transcript and snapshots, changes its status, pushes turns,
//! calls surface tools from a backend, exports, forks and hands off, and reads the lineage, the
//! exports and the memory. The bodies are [`sbp_protocol::rest`]'s, the types the gateway sends
//! (re-exported in [`types`]). Errors in the gateway's envelope become [`Error::Api`] with the
//! `SBP_*` code.
//!
//! # Federation
//!
//! A session can move to another gateway of a federation (SBP L6): a surface attaching there
//! with its id and token brings it over, so a [`Surface`] never has to follow. HTTP callers do:
//! the gateway the session left answers 409 `SBP_SESSION_MOVED` naming the new holder, and a
//! [`SessionClient`] follows it (at most three moves per call, `http(s)` only) and sends the call
//! again there; [`SessionClient::base_url`] says where it went. An attach closed with 1013 (the
//! session could not be handed over just now) is retried by the reconnect policy
//! ([`Error::is_try_again`] for the first attach).

pub mod error;
pub mod reconnect;
pub mod rest;
pub mod surface;
pub mod tools;
pub mod types;

pub use sbp_protocol as protocol;

pub use error::Error;
pub use reconnect::{Backoff, CLOSE_TRY_AGAIN, ReconnectPolicy};
pub use rest::{Client, ClientBuilder, SessionClient};
pub use surface::{Disconnect, DisconnectKind, Event, Surface, SurfaceConfig};
pub use tools::{ToolHandler, ToolSpec, Tools};
