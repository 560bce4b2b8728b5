//! `sbp-soak`: the soak suite behind RELIABILITY.md, run by `scripts/soak.sh` against the release
//! binaries of the gateway and the fake upstream (never from the test command). Each subcommand
//! prints one summary line per part and exits non-zero when any check failed:
//!
//! - `storm`: kill -9 under mixed load, then 0 lost, 0 duplicated, 0 reordered;
//! - `badinput`: thousands of malformed HTTP requests and WebSocket sessions, then 0 5xx, only
//!   envelope errors, 0 hangs, and a gateway that still works;
//! - `exhaust`: idle and trickling sockets, surfaces that stop reading, frame floods, big
//!   bodies, each while `/healthz` latency and the gateway's memory are watched.

mod badinput;
mod exhaust;
mod probe;
mod procs;
mod raw;
mod rng;
mod storm;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// The gateway's soak suite (see RELIABILITY.md).
#[derive(Debug, Parser)]
#[command(name = "sbp-soak", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where `sbp`, `sbp-fake-llm` are (release builds).
    #[arg(long, global = true, default_value = "target/release")]
    bin_dir: PathBuf,
    /// Logs, data of failed runs and failure reports go here.
    #[arg(long, global = true, default_value = "soak-out")]
    out_dir: PathBuf,
    /// PostgreSQL for the storm's second backend (a fresh schema is made in it and dropped).
    #[arg(
        long,
        global = true,
        env = "SBP_TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database: String,
    /// An argument added to every `sbp serve` the soak starts (repeatable), e.g. a limit.
    #[arg(long = "gateway-arg", global = true, allow_hyphen_values = true)]
    gateway_args: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// kill -9 storm under mixed load, with the loss / duplication / order checker.
    Storm(storm::StormArgs),
    /// Malformed HTTP requests and WebSocket sessions across every route.
    Badinput(badinput::BadInputArgs),
    /// Exhaustion scenarios while /healthz latency and memory are watched.
    Exhaust(exhaust::ExhaustArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("sbp-soak: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<bool> {
    std::fs::create_dir_all(&cli.out_dir)
        .with_context(|| format!("creating {}", cli.out_dir.display()))?;
    let env = procs::Env {
        bin_dir: cli.bin_dir,
        out_dir: cli.out_dir,
    };
    match cli.command {
        Command::Storm(args) => storm::run(&env, &args, &cli.database, &cli.gateway_args).await,
        Command::Badinput(args) => badinput::run(&env, &args, &cli.gateway_args).await,
        Command::Exhaust(args) => exhaust::run(&env, &args, &cli.gateway_args).await,
    }
}
