//! `sbp demo`: tells the protocol's story on the built-in model, with no setup. Two federated
//! gateways run in this process (A and B, each on its own SQLite file in a fresh temp directory,
//! each pinning the other's identity key), and the client SDK plays a phone, a watch, a desktop
//! and the agent's backend:
//! a question streamed live, turns tethered while offline and drained to a watch within its
//! budget, Markdown to a desktop, the model calling the phone's gps, the session exported,
//! imported into B, forked, handed off and its lineage printed, and, the two gateways being
//! federated, the session moving to B when the phone attaches there. Each step prints what was seen on
//! the wire and checks it; the first step that fails ends the demo with exit status 1. Ctrl-C
//! stops the gateways, removes the directory (unless `--keep`) and exits 130.

mod gateways;
mod out;
mod story;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sbp_client::Client;
use tempfile::TempDir;

use gateways::{Instance, Planned};
use out::{ColorChoice, Out};
use story::{STEPS, Story};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Colour the output: auto (when stdout is a terminal and NO_COLOR is unset), always, never.
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    color: ColorChoice,
    /// Pause between steps, for presenting.
    #[arg(long)]
    slow: bool,
    /// Keep the gateways' data directory (printed at the end) instead of removing it.
    #[arg(long)]
    keep: bool,
}

/// The pause between steps with `--slow`.
const SLOW_PAUSE: Duration = Duration::from_millis(1500);
/// Longest one step may take: every wait inside has its own shorter limit, this is the backstop.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the demo; returns the process exit code.
pub fn main(args: DemoArgs) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sbp demo: cannot start the async runtime: {e}");
            return 1;
        }
    };
    runtime.block_on(run(args))
}

/// The exit status after Ctrl-C, as shells report a process ended by SIGINT (128 + 2).
const INTERRUPTED: i32 = 130;

/// Where the demo was when something failed.
#[derive(Debug, Clone, Copy)]
enum Stage {
    Setup,
    /// A step of the story (1-based).
    Step(usize),
    /// Stopping the gateways or removing their directory, after the story.
    Teardown,
}

/// A failure, and where it happened.
struct Failure {
    stage: Stage,
    error: anyhow::Error,
}

async fn run(args: DemoArgs) -> i32 {
    let mut out = Out::new(args.color.enabled());
    // A fresh directory only this user can read (mode 0700), removed when `dir` is dropped or
    // closed: also on an early return, a failed step or Ctrl-C.
    let mut builder = tempfile::Builder::new();
    builder.prefix("sbp-demo-");
    // tempfile creates directories with the umask's mode (often 0755); the sessions are private.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700));
    let dir = match builder.tempdir() {
        Ok(dir) => dir,
        Err(e) => {
            let error = anyhow::Error::new(e).context(format!(
                "creating a temporary directory in {}",
                std::env::temp_dir().display()
            ));
            return report(
                &mut out,
                Failure {
                    stage: Stage::Setup,
                    error,
                },
            );
        }
    };
    let mut gateways = Vec::new();
    // Ctrl-C is listened for before the story starts (`biased`: its handler is installed on the
    // first poll, ahead of anything the story prints), and it drops the story mid-step: its
    // surfaces detach as they are dropped, and the teardown below still runs. If no handler can
    // be installed (`Err`), that branch is disabled and the story runs on.
    let result = {
        let story = tell(&args, &mut out, dir.path(), &mut gateways);
        tokio::pin!(story);
        tokio::select! {
            biased;
            Ok(()) = tokio::signal::ctrl_c() => None,
            result = &mut story => Some(result),
        }
    };
    let interrupted = result.is_none();
    if interrupted {
        // The story (its own printer, dropped mid-step) may have left a streamed line open.
        out.blank();
        out.bad("interrupted: stopping the gateways");
    }
    let torn_down = teardown(&args, &mut out, dir, &mut gateways).await;
    // Both a failed step and a failed teardown are reported, the step first.
    let mut code = if interrupted { INTERRUPTED } else { 0 };
    if let Some(Err(failure)) = result {
        code = report(&mut out, failure);
    }
    match torn_down {
        Err(error) => {
            code = report(
                &mut out,
                Failure {
                    stage: Stage::Teardown,
                    error,
                },
            );
        }
        Ok(()) if interrupted => {
            out.fact(if args.keep {
                "both gateways stopped"
            } else {
                "both gateways stopped and their data removed"
            });
            eprintln!("sbp demo: interrupted");
        }
        Ok(()) => {}
    }
    code
}

/// Whatever happened, the gateways stop (their in-flight turns persisted) before the files go.
async fn teardown(
    args: &DemoArgs,
    out: &mut Out,
    dir: TempDir,
    gateways: &mut [Instance],
) -> anyhow::Result<()> {
    let mut stopped = Ok(());
    for gw in gateways.iter_mut() {
        if let Err(e) = gw.stop().await {
            stopped = Err(e);
        }
    }
    if args.keep {
        let kept = dir.keep();
        out.fact(&format!("data kept in {}", kept.display()));
        for gw in gateways.iter() {
            out.fact(&format!("gateway {}: {}", gw.name, gw.database.display()));
        }
    } else {
        let path = dir.path().to_owned();
        dir.close()
            .with_context(|| format!("removing {}", path.display()))?;
    }
    stopped
}

/// Prints where the demo failed and why; the exit status.
fn report(out: &mut Out, Failure { stage, error }: Failure) -> i32 {
    let place = match stage {
        Stage::Setup => "setup".to_owned(),
        Stage::Teardown => "teardown".to_owned(),
        Stage::Step(n) => match STEPS.get(n.wrapping_sub(1)) {
            Some(title) => format!("step {n} ({title})"),
            None => format!("step {n}"),
        },
    };
    out.bad(&format!("{place} failed: {error:#}"));
    eprintln!("sbp demo: {place} failed: {error:#}");
    1
}

/// Starts the gateways (pushed to `gateways` as they start, so the caller stops them) and tells
/// the story.
async fn tell(
    args: &DemoArgs,
    out: &mut Out,
    dir: &Path,
    gateways: &mut Vec<Instance>,
) -> Result<(), Failure> {
    let setup = |error| Failure {
        stage: Stage::Setup,
        error,
    };
    let started = Instant::now();
    out.title("sbp demo · the State Bridge Protocol, told on the built-in model sbp/echo");
    out.blank();
    // Both listeners first: each gateway pins the other's URL and key from its start.
    let planned = [Planned::new("A").await, Planned::new("B").await];
    let [Ok(a), Ok(b)] = planned else {
        let error = planned
            .into_iter()
            .find_map(Result::err)
            .unwrap_or_else(|| anyhow::anyhow!("preparing the gateways"));
        return Err(setup(error));
    };
    let federations = [
        a.federation(vec![b.pin().map_err(setup)?]),
        b.federation(vec![a.pin().map_err(setup)?]),
    ];
    let key_ids = [a.key_id(), b.key_id()];
    for (planned, federation) in [a, b].into_iter().zip(federations) {
        let name = planned.name;
        let data = dir.join(name.to_lowercase());
        std::fs::create_dir_all(&data)
            .with_context(|| format!("creating {}", data.display()))
            .map_err(setup)?;
        let gw = Instance::start(planned, federation, &data, gateways::fresh_secret())
            .await
            .map_err(setup)?;
        out.fact(&format!(
            "gateway {name}: {}  (SQLite {})",
            gw.url(),
            gw.database.display()
        ));
        gateways.push(gw);
    }
    out.fact(&format!(
        "federated: each pins the other's Ed25519 identity key (A {}, B {}), so B can redeem \
         a roaming token at A, and a session can move between them",
        key_ids[0], key_ids[1]
    ));
    let client = |gw: &Instance| {
        Client::builder(gw.url())
            .no_proxy()
            .timeout(Duration::from_secs(15))
            .build()
            .context("building the HTTP client")
    };
    let (a, b) = match gateways.as_slice() {
        [a, b] => (client(a).map_err(setup)?, client(b).map_err(setup)?),
        _ => return Err(setup(anyhow::anyhow!("expected two gateways"))),
    };
    let mut story = Story::new(Out::new(args.color.enabled()), a, b);
    let mut result = Ok(());
    for (i, title) in STEPS.iter().enumerate() {
        let n = i + 1;
        if args.slow && n > 1 {
            tokio::time::sleep(SLOW_PAUSE).await;
        }
        story.out().heading(n, STEPS.len(), title);
        let step = tokio::time::timeout(STEP_TIMEOUT, story.step(n, started.elapsed())).await;
        let outcome = match step {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("did not finish within {STEP_TIMEOUT:?}")),
        };
        if let Err(error) = outcome {
            result = Err(Failure {
                stage: Stage::Step(n),
                error,
            });
            break;
        }
    }
    story.close_surfaces().await;
    // A step that failed mid-reply leaves its line open.
    story.out().stream_end();
    result
}
