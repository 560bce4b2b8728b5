//! A scripted fake LLM upstream speaking OpenAI chat completions and Anthropic Messages, served
//! over real HTTP on loopback, for the gateway's integration tests and benchmarks.
//!
//! `POST /v1/chat/completions` (or `/chat/completions`) answers `echo: <last user text>`, or
//! `tool result: <content>` when the last message is a tool result. The last user message can
//! script the answer with `[[fake:NAME=VALUE]]` directives, which are stripped from the echo:
//!
//! | directive | effect |
//! | --- | --- |
//! | `slow=MS` | wait MS ms before answering (streaming: headers at once, first event after MS) |
//! | `chunk_delay=MS` | wait MS ms between SSE events |
//! | `error=STATUS` | answer STATUS with `{"error":{"message":"fake error","type":"fake","code":STATUS}}` |
//! | `reply=TEXT` | reply TEXT (runs to the first `]]`) instead of the echo |
//! | `chunks=N` | stream the text as exactly N content chunks (default: one per word) |
//! | `tool=NAME` / `tool=NAME:{json}` | answer with tool calls (one per directive) unless the last message is a tool result |
//! | `hang=1` | never answer (until the client gives up or the server shuts down) |
//! | `drop=1` | streaming: two events, then the connection is cut without `[DONE]`; otherwise headers, then a cut body |
//!
//! The model names `fake-error-STATUS` and `fake-slow-MS` do the same as `error=` and `slow=`;
//! any other model name is only echoed back. An unknown directive or bad value gets a 400, so a
//! typo in a test fails loudly. `GET /_fake/requests` lists the recorded bodies (`DELETE`
//! clears them), `GET /healthz` answers 200.
//!
//! ## Anthropic Messages
//!
//! `POST /v1/messages` (or `/messages`) takes the same directives and model names and answers
//! in Anthropic's shapes; its requests go into the same record, in arrival order with the
//! OpenAI ones. The directives are read from the text of the last user message that has text
//! (a string `content`, or its `text` blocks), so a tool loop keeps its prompt's directives as
//! on the OpenAI side. The answer is, in order of precedence: the scripted error, as
//! `{"type":"error","error":{"type":...,"message":"fake error"}}` with the type the real API
//! uses for that status; `tool result: <text>` when the last user message carries
//! `tool_result` blocks (the last one's text), unless `reply=` is given; `tool_use` blocks
//! (ids `toolu_...`, `input` from the directive's JSON object or `{}`, `stop_reason`
//! `tool_use`) for `tool=` directives; else the reply or `echo: <text>`. Streaming sends the
//! real API's events: `message_start`, per block `content_block_start` / `content_block_delta`s
//! (`chunks=N` text deltas, or the tool input JSON in `input_json_delta` pieces) /
//! `content_block_stop`, a `ping` after the first block start, `message_delta` (stop reason and
//! usage), `message_stop`. `drop=1` cuts the stream after two events as on the OpenAI side.
//!
//! Like the real API, the endpoint refuses with a 400 `invalid_request_error` a request without
//! the `anthropic-version` header or `max_tokens`, with a role other than `user`/`assistant`,
//! with turns that do not alternate or start with the assistant, with a `tool_result` that
//! answers no `tool_use` of the message before (or a `tool_use` left unanswered by the next
//! message), with blank text blocks, with `tools` lacking `name` or `input_schema`, or with a
//! `tool=` directive whose arguments are not a JSON object. A translating client's mistakes
//! therefore fail in tests the way they would against Anthropic.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let fake = sbp_fake_llm::FakeLlm::start().await?;
//! let base_url = fake.base_url(); // "http://127.0.0.1:PORT/v1"
//! // ... point the gateway at base_url, drive it ...
//! assert!(fake.requests().iter().all(|body| body.get("sbp").is_none()));
//! fake.shutdown().await
//! # }
//! ```

mod anthropic;
mod directives;
mod script;
mod server;
mod state;

use std::net::{Ipv4Addr, SocketAddr};

use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use http::HeaderMap;
pub use server::serve;
pub use state::{FakeOptions, FakeState};

/// A running fake on `127.0.0.1:<ephemeral port>`. Dropping it starts shutdown; call
/// [`shutdown`](Self::shutdown) to also wait for it to finish.
#[derive(Debug)]
pub struct FakeLlm {
    addr: SocketAddr,
    state: FakeState,
    stop: CancellationToken,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl FakeLlm {
    /// Starts a fake that records every request.
    pub async fn start() -> std::io::Result<Self> {
        Self::start_with(FakeOptions::default()).await
    }

    pub async fn start_with(options: FakeOptions) -> std::io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let state = FakeState::new(options);
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(
            listener,
            state.clone(),
            stop.clone().cancelled_owned(),
        ));
        Ok(Self {
            addr,
            state,
            stop,
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI-style base URL, `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The shared state, e.g. to wait for requests from another task.
    pub fn state(&self) -> &FakeState {
        &self.state
    }

    /// Every chat request body received so far (OpenAI and Anthropic alike), in arrival order.
    /// Bodies that are not JSON are answered with 400 and not recorded.
    pub fn requests(&self) -> Vec<Value> {
        self.state.requests()
    }

    /// The headers of each recorded request, in the same order as [`requests`](Self::requests).
    pub fn request_headers(&self) -> Vec<HeaderMap> {
        self.state.request_headers()
    }

    /// Waits until at least `n` chat requests have been recorded; see
    /// [`FakeState::wait_for_requests`].
    pub async fn wait_for_requests(&self, n: usize) -> Vec<Value> {
        self.state.wait_for_requests(n).await
    }

    /// Forgets every recorded request.
    pub fn clear(&self) {
        self.state.clear();
    }

    /// Stops accepting, ends hanging and slow answers, and waits for the server to finish.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        self.stop.cancel();
        match self.task.take() {
            Some(task) => task.await.map_err(std::io::Error::other)?,
            None => Ok(()),
        }
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
