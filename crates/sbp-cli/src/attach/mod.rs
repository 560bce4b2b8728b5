//! `sbp attach`: a terminal surface over the client SDK. It joins a session (or creates one),
//! prints what was tethered while no surface was attached, streams live turns, sends each line
//! typed on stdin as a message over HTTP (the reply arrives over the WebSocket), answers TOOL_CALLs
//! with local tools, and rides out gateway restarts with the SDK's reconnect.
//!
//! With federation (L6) a session may move to another gateway: its messages follow it there (the
//! SDK follows 409 `SBP_SESSION_MOVED`, and one line says where it went), while the WebSocket stays
//! on `--url`, since any federated gateway brings the session back to the surface attaching to it.
//! An attach closed with 1013 (the session could not be handed over just now) is tried again with
//! the reconnect backoff, the first one included.
//!
//! One loop owns stdout: it takes the surface's events, the lines read from stdin (by a thread, so
//! a blocked read never holds up the runtime's shutdown), the outcomes of sent messages and the
//! tool handler's notes, and renders them through [`term::Term`]. Leaving (/quit, Ctrl-C, the end
//! of input) takes [`EXIT_WAIT`] at most, whatever the gateway or the terminal does meanwhile.
//!
//! On a terminal (stdin and stdout both), lines are typed into a line editor ([`editor`]: history,
//! arrow keys) and whatever arrives meanwhile is printed above the line being typed; replies are
//! rendered from Markdown ([`markdown`]). Otherwise stdin is read line by line and the output is
//! plain text, without escape codes.

mod editor;
mod markdown;
mod term;
mod tools;

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use sbp_client::protocol::frames::SessionAttached;
use sbp_client::protocol::{ServerFrame, SurfaceContext};
use sbp_client::types::{ChatOutcome, ChatRequest, NewSession};
use sbp_client::{
    Backoff, Client, DisconnectKind, Event, ReconnectPolicy, SessionClient, Surface, SurfaceConfig,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use editor::{Editor, Screen};
use term::{Style, Term};
use tools::{LocalTools, ToolNote};

/// Exit statuses besides 0 (detached) and 1 (any other failure).
const EXIT_FORBIDDEN: i32 = 3;
const EXIT_NOT_FOUND: i32 = 4;
const EXIT_DISPLACED: i32 = 5;
const EXIT_INTERRUPTED: i32 = 130;

/// After stdin ends, how long to wait for the output of messages already answered over HTTP.
const EOF_GRACE: Duration = Duration::from_secs(3);

/// From leaving (/quit, Ctrl-C, the end of input) to the end of the run: the line editor giving
/// the terminal back and the gateway confirming the DETACH share this one deadline, so that
/// neither an editor thread held up nor a gateway slow to answer keeps the program running.
const EXIT_WAIT: Duration = Duration::from_millis(1500);

/// Then, how long the runtime waits for work on its blocking pool (a read_file call): such calls
/// are short, and the session keeps any tool call left unanswered.
const SHUTDOWN_WAIT: Duration = Duration::from_millis(500);

/// How many times the first attach is tried when the gateway answers 1013 (try again): with the
/// backoff below, about 20 s, longer than a handover lease takes to free a session.
const FIRST_ATTACH_TRIES: u32 = 8;

#[derive(Debug, Args)]
#[command(after_help = "\
Type a message and press Enter: it is sent over HTTP with the session token, and the reply streams
back over the WebSocket. /quit (or end of input) detaches; /help lists the commands. With federation,
messages follow a session that moved to another gateway (one line says where it went).

On a terminal, lines are typed into a line editor (arrow keys, Emacs keys, the up arrow for earlier
lines), what arrives meanwhile is printed above the line being typed, and replies are rendered from
Markdown. With stdin or stdout not a terminal, input is read line by line and output is plain text.

Exit status: 0 detached; 1 error (gateway unreachable, ...); 2 bad arguments; 3 forbidden (wrong
token); 4 session not found; 5 displaced (another surface attached to the session); 130 Ctrl-C.")]
pub struct AttachArgs {
    /// The gateway's base URL.
    #[arg(long, env = "SBP_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Join this session (needs --token). Without it a new session is created and its id and
    /// token are printed, to come back to it later.
    #[arg(long)]
    pub session: Option<String>,
    /// The session's token (SBP_SESSION_TOKEN keeps it out of the process list).
    #[arg(long, env = "SBP_SESSION_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Operator API key, for gateways started with --api-key (sent on HTTP calls).
    #[arg(long, env = "SBP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The device type declared in the SurfaceContext (how replies are adapted).
    #[arg(long, default_value = "desktop")]
    pub device_type: String,
    /// Offer the agent a `read_file` tool for this directory (and nothing outside it).
    #[arg(long, value_name = "DIR")]
    pub allow_dir: Option<PathBuf>,
    /// A local stdio MCP server whose tools the agent may call through this surface (repeatable):
    /// its command line, e.g. --mcp "npx -y @modelcontextprotocol/server-memory".
    #[arg(long = "mcp", value_name = "COMMAND")]
    pub mcp: Vec<String>,
    /// The model named in each message (the gateway's default otherwise).
    #[arg(long)]
    pub model: Option<String>,
}

/// Runs `sbp attach` to the end and returns the process's exit status.
pub fn main(args: AttachArgs) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sbp attach: cannot start the runtime: {e}");
            return 1;
        }
    };
    let code = runtime.block_on(async {
        match run(args).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("sbp attach: {}", describe(&e));
                1
            }
        }
    });
    runtime.shutdown_timeout(SHUTDOWN_WAIT);
    code
}

/// What the UI loop hears besides the surface.
enum Input {
    /// A line typed on stdin; `None` at end of input.
    Line(Option<String>),
    /// Ctrl-C in the line editor (which reads it as a key, not as a signal).
    Interrupt,
    /// A message was answered over HTTP (or failed).
    Sent(Result<(), String>),
    /// The session's HTTP calls now go to this gateway: the session moved there.
    Moved(String),
}

async fn run(args: AttachArgs) -> anyhow::Result<i32> {
    let joining = match (&args.session, &args.token) {
        (Some(id), Some(token)) => Some((id.clone(), token.clone())),
        (None, None) => None,
        (Some(_), None) => anyhow::bail!("--session needs --token (or SBP_SESSION_TOKEN)"),
        (None, Some(_)) => anyhow::bail!("--token needs --session"),
    };
    let client = build_client(&args)?;
    // The local tools first: a bad --allow-dir or --mcp fails before a session is made for nothing.
    let southbound = tools::start_mcp(&args.mcp).await?;
    let (notes_tx, notes) = mpsc::unbounded_channel();
    let outcome = match LocalTools::new(args.allow_dir.as_deref(), southbound.clone(), notes_tx) {
        Ok(tools) => attach(&args, &client, joining, Arc::new(tools), notes).await,
        Err(e) => Err(e),
    };
    southbound.shutdown().await;
    outcome
}

/// Joins or creates the session, attaches, and runs the UI loop until the surface ends.
async fn attach(
    args: &AttachArgs,
    client: &Client,
    joining: Option<(String, String)>,
    tools: Arc<LocalTools>,
    mut notes: mpsc::UnboundedReceiver<ToolNote>,
) -> anyhow::Result<i32> {
    let screen = Screen::default();
    let colour = term::use_colour();
    let stdout_is_terminal = std::io::stdout().is_terminal();
    let mut term = Term::new(screen.clone(), colour).with_markdown(stdout_is_terminal);
    let session = match joining {
        Some((id, token)) => client.session(id, token),
        None => {
            let s = create_session(client, &args.url).await?;
            term.status("+", Style::Good, &format!("created session {}", s.id()));
            term.line(Style::Plain, &format!("  session  {}", s.id()));
            term.line(Style::Plain, &format!("  token    {}", s.token()));
            term.line(
                Style::Dim,
                &format!(
                    "  come back with: sbp attach --url {} --session {} --token {}",
                    args.url,
                    s.id(),
                    s.token()
                ),
            );
            s
        }
    };
    let catalogue = tools.catalogue();

    let context = SurfaceContext {
        device_type: Some(args.device_type.clone()),
        ..SurfaceContext::default()
    };
    let policy = ReconnectPolicy {
        // Someone is watching: come back within a few seconds of the gateway, not 30.
        backoff: Backoff {
            max: Duration::from_secs(5),
            ..Backoff::default()
        },
        ..ReconnectPolicy::default()
    };
    let config = session
        .surface()
        .context(context)
        .tools_arc(tools)
        .reconnect(policy.clone());
    let mut surface = match first_attach(config, &policy.backoff, &mut term).await {
        Ok(s) => s,
        Err(e) => {
            let (code, message) = refusal(&e, &args.url);
            eprintln!("sbp attach: {message}");
            return Ok(code);
        }
    };

    let (input_tx, mut inputs) = mpsc::unbounded_channel();
    let mut line_editor = None;
    if stdout_is_terminal && std::io::stdin().is_terminal() && !dumb_terminal() {
        match Editor::start(&screen, colour, input_tx.clone()) {
            Ok(e) => line_editor = Some(e),
            Err(e) => {
                tracing::warn!(error = %e, "no line editor; reading lines as they come");
                spawn_stdin_reader(input_tx.clone());
            }
        }
    } else {
        spawn_stdin_reader(input_tx.clone());
    }
    let (outbox, sender) = spawn_sender(session.clone(), args.model.clone(), input_tx);

    let mut ui = Ui {
        term,
        url: args.url.clone(),
        catalogue,
        in_flight: 0,
        unshown: 0,
        first: true,
        farewell: None,
    };
    let mut eof_deadline: Option<Instant> = None;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    // Cleared once the Ctrl-C future has completed (it cannot be polled again), including when
    // the handler could not be installed.
    let mut ctrl_c_armed = true;

    let code = loop {
        // After end of input: leave once every message is answered and its output shown (or the
        // grace period for that output ran out).
        if let Some(deadline) = eof_deadline
            && ui.in_flight == 0
            && (ui.unshown <= 0 || Instant::now() >= deadline)
        {
            break None;
        }
        let grace_until = eof_deadline.filter(|_| ui.in_flight == 0);
        let grace = async move {
            match grace_until {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            event = surface.next_event() => match event {
                Some(event) => {
                    if let Some(code) = ui.on_event(event) {
                        break Some(code);
                    }
                }
                None => break Some(1),
            },
            Some(note) = notes.recv() => ui.on_tool(note),
            Some(input) = inputs.recv() => match input {
                Input::Line(None) => {
                    eof_deadline = Some(Instant::now() + EOF_GRACE);
                }
                Input::Line(Some(line)) => match ui.on_line(&line) {
                    Command::Quit => {
                        ui.leaving();
                        break None;
                    }
                    Command::Nothing => {}
                    Command::Send(text) => {
                        if outbox.send(text).is_ok() {
                            ui.in_flight += 1;
                        }
                    }
                },
                Input::Sent(outcome) => {
                    if eof_deadline.is_some() {
                        eof_deadline = Some(Instant::now() + EOF_GRACE);
                    }
                    ui.on_sent(outcome);
                }
                Input::Moved(url) => ui.moved(&url),
                Input::Interrupt => {
                    ui.leaving();
                    break Some(EXIT_INTERRUPTED);
                }
            },
            () = grace => {}
            installed = &mut ctrl_c, if ctrl_c_armed => {
                ctrl_c_armed = false;
                if installed.is_ok() {
                    // The terminal echoed ^C on the current line.
                    ui.term.line(Style::Dim, "");
                    ui.leaving();
                    break Some(EXIT_INTERRUPTED);
                }
            }
        }
    };

    sender.abort();
    let deadline = Instant::now() + EXIT_WAIT;
    // The editor stops while the DETACH goes out: lines printed meanwhile go above its prompt or,
    // once it has stopped, directly.
    let editor_stopped = async {
        if let Some(e) = line_editor {
            e.stop(deadline).await;
        }
    };
    let code = match code {
        // A terminal close: the surface has ended already.
        Some(code) if code != EXIT_INTERRUPTED => {
            editor_stopped.await;
            code
        }
        detach => {
            let detached = tokio::time::timeout_at(deadline, async {
                surface.close().await;
                while let Some(event) = surface.next_event().await {
                    if let Event::Disconnected(d) = &event
                        && d.kind == DisconnectKind::Detached
                    {
                        ui.term.status("○", Style::Dim, "detached");
                        continue;
                    }
                    ui.on_event(event);
                }
            });
            let (detached, ()) = tokio::join!(detached, editor_stopped);
            if detached.is_err() {
                // The surface's task ends with the runtime; the gateway sees the connection go.
                ui.term.status(
                    "○",
                    Style::Warn,
                    "the gateway did not confirm the detach in time: left anyway",
                );
            }
            detach.unwrap_or(0)
        }
    };
    let _ = std::io::stdout().flush();
    if let Some(message) = ui.farewell.take() {
        eprintln!("sbp attach: {message}");
    }
    Ok(code)
}

/// `TERM=dumb`: a terminal that cannot move its cursor, where a line editor would garble.
fn dumb_terminal() -> bool {
    std::env::var_os("TERM").is_some_and(|t| t == "dumb")
}

/// An error and its causes on one line, leaving out causes whose text the line already has
/// (reqwest repeats its own in its message).
fn describe(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

async fn create_session(client: &Client, url: &str) -> anyhow::Result<SessionClient> {
    client
        .create_session(NewSession::default())
        .await
        .map_err(|e| {
            let context = match &e {
                sbp_client::Error::Http(h) if h.is_connect() => {
                    format!("cannot reach the gateway at {url} (is `sbp serve` running?)")
                }
                _ => format!("creating a session on {url}"),
            };
            anyhow::Error::new(e).context(context)
        })
}

fn build_client(args: &AttachArgs) -> anyhow::Result<Client> {
    let mut builder = Client::builder(args.url.clone());
    if let Some(key) = &args.api_key {
        builder = builder.api_key(key.clone());
    }
    // A proxy from the environment has no business between a terminal and a gateway on loopback.
    if is_loopback(&args.url) {
        builder = builder.no_proxy();
    }
    builder
        .build()
        .with_context(|| format!("--url {}", args.url))
}

fn is_loopback(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let host = if let Some(v6) = host.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        host.split(':').next().unwrap_or_default()
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The first attach, tried again with `backoff` while the gateway answers 1013: it is bringing
/// the session over from another gateway that cannot hand it over just now (a turn is running
/// there, or another gateway is taking it at the same moment).
async fn first_attach(
    config: SurfaceConfig,
    backoff: &Backoff,
    term: &mut Term<Screen>,
) -> Result<Surface, sbp_client::Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match Surface::connect(config.clone()).await {
            Err(e) if e.is_try_again() && attempt < FIRST_ATTACH_TRIES => {
                let delay = backoff.delay_with(attempt, rand::random::<f64>());
                term.status(
                    "○",
                    Style::Warn,
                    &format!(
                        "the gateway could not take the session over yet ({e}); trying again in {:.1}s",
                        delay.as_secs_f64()
                    ),
                );
                tokio::time::sleep(delay).await;
            }
            other => return other,
        }
    }
}

/// The exit status and message for a first attach that failed.
fn refusal(e: &sbp_client::Error, url: &str) -> (i32, String) {
    match e {
        sbp_client::Error::Forbidden { detail } => (
            EXIT_FORBIDDEN,
            format!("forbidden: the token is not this session's ({detail})"),
        ),
        sbp_client::Error::SessionNotFound { detail } => {
            (EXIT_NOT_FOUND, format!("session not found ({detail})"))
        }
        other => (1, format!("cannot attach to {url}: {other}")),
    }
}

/// Reads stdin line by line on a thread of its own; `Line(None)` at end of input.
fn spawn_stdin_reader(tx: mpsc::UnboundedSender<Input>) {
    // Not joined: it may sit in a blocking read when the program ends, and exiting ends it.
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(Input::Line(Some(line))).is_err() {
                return;
            }
        }
        let _ = tx.send(Input::Line(None));
    });
}

/// Sends messages one at a time, in the order typed; each outcome comes back as `Input::Sent`.
fn spawn_sender(
    session: SessionClient,
    model: Option<String>,
    done: mpsc::UnboundedSender<Input>,
) -> (mpsc::UnboundedSender<String>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let task = tokio::spawn(async move {
        while let Some(text) = rx.recv().await {
            let mut req = ChatRequest::user(text).resume();
            if let Some(m) = &model {
                req = req.model(m.clone());
            }
            let before = session.base_url();
            let outcome = match session.chat(req).await {
                Ok(ChatOutcome::Reply(_)) => Ok(()),
                Ok(ChatOutcome::ResumeAvailable(_)) => {
                    Err("the session is suspended and was not resumed".to_owned())
                }
                Err(e) => Err(e.to_string()),
            };
            // The SDK followed SBP_SESSION_MOVED: say so once, before the outcome.
            let after = session.base_url();
            if after != before && done.send(Input::Moved(shown_url(&after))).is_err() {
                return;
            }
            if done.send(Input::Sent(outcome)).is_err() {
                return;
            }
        }
    });
    (tx, task)
}

/// A base URL as the user typed it: without the slash the URL type adds to an empty path.
fn shown_url(url: &reqwest::Url) -> String {
    url.as_str().trim_end_matches('/').to_owned()
}

enum Command {
    Send(String),
    Quit,
    Nothing,
}

/// The UI loop's state.
struct Ui {
    term: Term<Screen>,
    url: String,
    catalogue: Vec<(String, String)>,
    /// Messages sent over HTTP and not answered yet.
    in_flight: usize,
    /// Messages answered over HTTP minus turn ends shown, so that the end of input waits for the
    /// output its messages caused. Approximate (a pushed turn's end counts too); a turn end may
    /// arrive before its HTTP answer, so it may go below zero while messages are in flight.
    unshown: i64,
    first: bool,
    /// Why the surface ended for good, for stderr once the terminal is back to normal.
    farewell: Option<String>,
}

impl Ui {
    /// Renders one surface event; `Some(status)` when the surface has ended for good.
    fn on_event(&mut self, event: Event) -> Option<i32> {
        match event {
            Event::Connected {
                attached,
                reconnected,
            } => self.connected(&attached, reconnected),
            Event::Frame(ServerFrame::TurnChunk(c)) => self.term.chunk(&c.chunk_id, &c.delta),
            Event::Frame(ServerFrame::TurnComplete(c)) => {
                self.turn_shown();
                self.term.complete(&c);
            }
            Event::Frame(ServerFrame::TetherTurn(t)) => {
                if t.role == "assistant" {
                    self.turn_shown();
                }
                self.term.tether_turn(&t);
            }
            // TOOL_CALLs are shown by the handler's notes; PINGs are answered by the SDK.
            Event::Frame(_) => {}
            Event::InvalidFrame { error, .. } => {
                tracing::warn!(%error, "unreadable frame from the gateway ignored");
            }
            Event::Reconnecting {
                attempt,
                delay,
                last_error,
            } => {
                let why = last_error.map(|e| format!(": {e}")).unwrap_or_default();
                self.term.status(
                    "○",
                    Style::Warn,
                    &format!(
                        "reconnecting in {:.1}s (attempt {attempt}){why}",
                        delay.as_secs_f64()
                    ),
                );
            }
            Event::Disconnected(d) => {
                self.term.cut_off();
                let detail = d.detail.clone().unwrap_or_else(|| d.reason.clone());
                if d.will_reconnect {
                    let why = if detail.is_empty() {
                        format!("{:?}", d.kind)
                    } else {
                        detail
                    };
                    self.term
                        .status("○", Style::Warn, &format!("connection lost: {why}"));
                    return None;
                }
                let (code, message) = match d.kind {
                    DisconnectKind::Detached => return None,
                    DisconnectKind::Displaced => (
                        EXIT_DISPLACED,
                        "displaced: another surface attached to this session".to_owned(),
                    ),
                    DisconnectKind::Forbidden => (
                        EXIT_FORBIDDEN,
                        format!("forbidden: the token is no longer valid ({detail})"),
                    ),
                    DisconnectKind::SessionNotFound => {
                        (EXIT_NOT_FOUND, format!("session not found ({detail})"))
                    }
                    kind => (1, format!("disconnected for good ({kind:?}): {detail}")),
                };
                self.term.status("✖", Style::Bad, &message);
                self.farewell = Some(message);
                return Some(code);
            }
        }
        None
    }

    fn connected(&mut self, attached: &SessionAttached, reconnected: bool) {
        self.term.attached(attached.queued_turns);
        let queued = match attached.queued_turns {
            0 => String::new(),
            1 => " · 1 turn waiting".to_owned(),
            n => format!(" · {n} turns waiting"),
        };
        if reconnected {
            self.term
                .status("●", Style::Good, &format!("reconnected{queued}"));
            return;
        }
        self.term.status(
            "●",
            Style::Good,
            &format!(
                "connected to {} · session {} · {}{queued}",
                self.url, attached.session_id, attached.device_type
            ),
        );
        if self.first {
            self.first = false;
            let registered = &attached.mcp_tools_registered;
            let tools: Vec<String> = self
                .catalogue
                .iter()
                .filter(|(name, _)| registered.is_empty() || registered.contains(name))
                .map(|(name, origin)| match origin.as_str() {
                    "built-in" => name.clone(),
                    o => format!("{name} ({o})"),
                })
                .collect();
            let tools = if registered.is_empty() {
                "none registered".to_owned()
            } else {
                tools.join(", ")
            };
            self.term.line(Style::Dim, &format!("  tools: {tools}"));
            self.term.line(
                Style::Dim,
                "  Type a message and press Enter. /help lists commands; /quit detaches.",
            );
        }
    }

    fn on_line(&mut self, line: &str) -> Command {
        let text = line.trim();
        match text {
            "" => Command::Nothing,
            "/quit" | "/exit" | "/detach" => Command::Quit,
            "/help" => {
                for help in [
                    "  /quit     detach (the session keeps going; come back with --session/--token)",
                    "  /tools    the tools this surface answers",
                    "  /help     this list",
                    "  anything else is sent as a message",
                ] {
                    self.term.line(Style::Dim, help);
                }
                Command::Nothing
            }
            "/tools" => {
                if self.catalogue.is_empty() {
                    self.term.line(Style::Dim, "  no tools");
                }
                for (name, origin) in self.catalogue.clone() {
                    self.term
                        .line(Style::Dim, &format!("  {name:<16} {origin}"));
                }
                Command::Nothing
            }
            t if t.starts_with('/') && !t.contains(' ') => {
                self.term.status(
                    "?",
                    Style::Warn,
                    &format!("unknown command {t} (try /help)"),
                );
                Command::Nothing
            }
            _ => Command::Send(line.to_owned()),
        }
    }

    /// Leaving before every message was answered: say where the replies go.
    fn leaving(&mut self) {
        if self.in_flight > 0 {
            self.term.line(
                Style::Dim,
                "  messages still being answered: their replies will be waiting when you come back",
            );
        }
    }

    /// The session moved to another gateway: its messages go there from now on.
    fn moved(&mut self, url: &str) {
        self.term
            .status("→", Style::Warn, &format!("the session moved to {url}"));
    }

    fn on_sent(&mut self, outcome: Result<(), String>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        match outcome {
            // The reply itself arrives over the WebSocket (or, if the surface was away, from the
            // tether once it is back): printing the HTTP body as well would show it twice.
            Ok(()) => self.unshown += 1,
            Err(e) => self
                .term
                .status("✖", Style::Bad, &format!("message not answered: {e}")),
        }
        if self.in_flight == 0 {
            self.unshown = self.unshown.max(0);
        }
    }

    fn turn_shown(&mut self) {
        self.unshown -= 1;
        if self.in_flight == 0 {
            self.unshown = self.unshown.max(0);
        }
    }

    fn on_tool(&mut self, note: ToolNote) {
        match note {
            ToolNote::Called { name, input } => self.term.tool_called(&name, &input),
            ToolNote::Finished {
                name,
                outcome,
                elapsed,
            } => self.term.tool_finished(&name, &outcome, elapsed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_urls_skip_proxies() {
        for (url, loopback) in [
            ("http://127.0.0.1:8080", true),
            ("http://localhost:8080/", true),
            ("https://LOCALHOST", true),
            ("http://[::1]:8080/x", true),
            ("http://user:pw@127.0.0.2:1", true),
            ("http://gw.example:8080", false),
            ("https://10.0.0.1", false),
        ] {
            assert_eq!(is_loopback(url), loopback, "{url}");
        }
    }
}
