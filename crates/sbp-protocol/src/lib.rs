//! SBP wire types shared by the gateway and its clients: WebSocket frames, the SurfaceContext,
//! the chat-completions request, tool-call outcomes, the `sbp` completion namespace, the REST
//! endpoints' bodies, the error envelope, the session lifecycle, Python-compatible canonical JSON,
//! roaming bundles (`bundle_cid`), roaming tokens (HS256 JWT) and the pure part of federation
//! (Ed25519 keys, signed JSON, manifests, federation tokens, signed records). Pure: no IO.

pub mod bundle;
pub mod canonical;
pub mod chat;
pub mod completions;
pub mod error;
pub mod federation;
pub mod frames;
pub mod id;
pub mod json_shape;
pub mod lifecycle;
pub mod prior;
pub mod rest;
pub mod schema;
pub mod surface;
pub mod time;
pub mod token;
pub mod tools;

pub use chat::{ChatMessage, ChatRequest, FunctionCall, InvalidChatRequest, MessageView, ToolDecl};
pub use completions::{SbpRequestOptions, SbpResponseMeta};
pub use error::{ErrorBody, ErrorCode, ErrorDetail, UpstreamError};
pub use frames::{ClientFrame, FrameError, ServerFrame};
pub use lifecycle::{SessionStatus, SnapshotKind};
pub use prior::{Prior, PriorMessage};
pub use surface::{SurfaceContext, ToolSchema};
pub use tools::{ToolFailure, ToolOutcome};

/// The wire protocol version advertised in SESSION_ATTACHED unless configured otherwise (the seeds' v1.2).
pub const DEFAULT_SBP_VERSION: &str = "1.2";
/// The conformance level this implementation advertises.
pub const SBP_LEVEL: &str = "L5";
