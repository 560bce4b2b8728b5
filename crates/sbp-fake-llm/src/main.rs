//! `sbp-fake-llm`: runs the scripted fake upstream (OpenAI chat completions and Anthropic
//! Messages) as a standalone process, for benchmarks and manual poking. See the library docs
//! for the directive syntax.

use std::io::Write;
use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use sbp_fake_llm::{FakeOptions, FakeState, serve};

/// A scripted fake LLM upstream (OpenAI chat completions and Anthropic Messages).
#[derive(Debug, Parser)]
#[command(name = "sbp-fake-llm", version)]
struct Args {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Do not keep request bodies (for benchmarks: flat memory, no lock per request).
    #[arg(long)]
    no_record: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let state = FakeState::new(FakeOptions {
        record: !args.no_record,
    });

    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "sbp-fake-llm listening on http://{addr}/v1")?;
    stdout.flush()?;
    drop(stdout);

    serve(listener, state, shutdown_signal())
        .await
        .context("serving")
}

/// Completes on SIGINT, or SIGTERM on Unix. If a handler cannot be installed, that signal
/// is simply not waited for.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
