//! The `sbp` binary. `sbp serve` runs the gateway; logs go to stderr, the one startup line to stdout.
//! `sbp attach` is a terminal surface for a session of any SBP gateway. `sbp encryption-key` and
//! `sbp store reseal` manage encryption at rest. `sbp openapi` prints the API's OpenAPI document.

mod attach;
mod config;
mod conformance;
mod demo;
mod federation;
mod keys;
mod log_writer;
mod serve;

use clap::{Parser, Subcommand};

/// mimalloc instead of the C library's allocator: a turn allocates and frees many small buffers
/// across threads (request and response bodies, JSON values, tasks), where glibc's malloc spent
/// 15 % of a proxied request's CPU (BENCHMARKS.md, issue 17).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "sbp",
    version,
    about = "State Bridge Protocol gateway: durable, portable agent sessions for every device"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (L1 stateful proxy + L2 tether over WebSocket) on one port.
    Serve(Box<config::ServeArgs>),
    /// Attach this terminal to a session as a surface: see what happened while away, chat, and
    /// answer the agent's tool calls with local tools (clock, system info, files, MCP servers).
    Attach(Box<attach::AttachArgs>),
    /// Tell the protocol's story on the built-in model, with no setup: two federated gateways in
    /// this process, a phone, a watch and a desktop, tether, tools, export, import, fork, handoff,
    /// and the session moving to the second gateway when the phone attaches there.
    Demo(Box<demo::DemoArgs>),
    /// Check any SBP gateway against the protocol, level by level (L1..L6); exit status for CI.
    Conformance(Box<conformance::ConformanceArgs>),
    /// Keys for encryption at rest (`sbp serve --encryption-key FILE`).
    #[command(subcommand)]
    EncryptionKey(keys::KeyCommand),
    /// Maintenance of the gateway's storage.
    #[command(subcommand)]
    Store(keys::StoreCommand),
    /// Federation (L6): the node's identity key.
    #[command(subcommand)]
    Federation(federation::FederationCommand),
    /// Print the HTTP API's OpenAPI 3.1 document (what `GET /openapi.json` serves; the repository
    /// keeps it as docs/openapi.json).
    Openapi,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let settings = config::Settings::resolve(*args)?;
            // Writes what is still queued when `main` returns (also after a panic unwinds).
            let _log = init_serve_logging(&settings.log_format)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let result = runtime.block_on(serve::run(settings));
            // `serve` has already waited its grace; a blocking task still running (a stalled
            // write) must not hold the exit forever.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            result
        }
        Command::Attach(args) => {
            // Warnings only by default: stdout is the conversation, and stderr shares the terminal.
            init_logging_with("text", "warn");
            let code = attach::main(*args);
            if code != 0 {
                std::process::exit(code);
            }
            Ok(())
        }
        Command::Demo(args) => {
            init_logging_with("text", "warn");
            exit_with(demo::main(*args))
        }
        Command::Conformance(args) => {
            init_logging_with("text", "warn");
            exit_with(conformance::main(*args))
        }
        Command::EncryptionKey(keys::KeyCommand::Generate { out }) => keys::generate(out),
        Command::Federation(cmd) => federation::run(cmd),
        Command::Openapi => {
            print!("{}", sbp_gateway::transport::openapi::json());
            Ok(())
        }
        Command::Store(keys::StoreCommand::Reseal(args)) => {
            init_logging_with("text", "warn");
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(keys::reseal(*args))
        }
    }
}

fn exit_with(code: i32) -> anyhow::Result<()> {
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

/// The gateway's logs: lines are formatted on the thread that logs them and written to stderr by
/// a thread of their own, so a request's access line costs no write system call on a runtime
/// worker (7 µs of a proxied request's CPU, BENCHMARKS.md). Never lossy ([`log_writer`]): when
/// that thread falls 16 MiB of lines behind, logging waits, as a direct write would; dropping the
/// guard writes every queued line.
fn init_serve_logging(format: &str) -> anyhow::Result<log_writer::Guard> {
    let (writer, guard) = log_writer::stderr()?;
    init_logging_to(format, "info", writer);
    Ok(guard)
}

/// Logs to stderr, coloured only when stderr is a terminal (and `NO_COLOR` is unset), so a log
/// file or collector gets no escape sequences. `SBP_LOG` (an `EnvFilter`) overrides the level;
/// unless it names `rmcp`, the MCP library stays at `warn`: it logs every request it serves at
/// `info`, which the access log already covers.
fn init_logging_with(format: &str, default_level: &str) {
    init_logging_to(format, default_level, std::io::stderr);
}

fn init_logging_to<W>(format: &str, default_level: &str, writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::EnvFilter;
    let directives = std::env::var("SBP_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default_level.to_owned());
    let directives = match directives.contains("rmcp") {
        true => directives,
        false => format!("{directives},rmcp=warn"),
    };
    let filter = EnvFilter::try_new(&directives).unwrap_or_else(|e| {
        eprintln!("SBP_LOG is not a valid filter ({e}); logging at {default_level}");
        EnvFilter::new(format!("{default_level},rmcp=warn"))
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
