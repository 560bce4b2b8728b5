//! The `sbp` binary. `sbp serve` runs the gateway; logs go to stderr, the one startup line to stdout.

mod config;
mod serve;

use clap::{Parser, Subcommand};

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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let settings = config::Settings::resolve(*args)?;
            init_logging(&settings.log_format);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(serve::run(settings))
        }
    }
}

fn init_logging(format: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("SBP_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
