//! `sbp conformance`: self-certification of any SBP gateway, level by level. The built-in checks
//! (`checks/`, one module per level, derived from the seeds' MUSTs) run one after the other, each
//! in its own session and task with a time limit (with L6, only those that apply to the role the
//! node's federation manifest names: a tracker serves no session); with `--vectors <dir>` the public suite's
//! vector files run instead (`vectors.rs`), one row each. Every wait on the network is bounded:
//! each request and body read by `--timeout` (and the HTTP client's own timeout as a backstop),
//! each check as a whole by its task's limit. The result is a table or JSON on stdout and the exit
//! status: 0 nothing failed, 1 something failed, 2 usage error, gateway unreachable, credentials
//! refused or the model refused.

mod checks;
mod client;
mod outcome;
mod pattern;
mod report;
mod vectors;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use serde_json::Value;
use tokio::time::Instant;

use checks::{Level, Needs};
use client::Ctx;
use outcome::{Outcome, Requirement, Status};
use report::Row;

const EXIT_FAILED: i32 = 1;
const EXIT_USAGE: i32 = 2;

#[derive(clap::Args, Debug)]
#[command(after_help = "\
Levels are cumulative: --level L3 runs the L1, L2 and L3 checks. Each check makes its own session.
--level L6 adds federation, checked from outside with no key: the node's /.well-known/sbp manifest
and, by the role it names, the bundle route's refusals (gateway) or the registry's answers
(tracker); against a tracker-only node it runs only the L6 checks that apply to a tracker.
With --vectors, the public suite's files run instead of the built-in checks; they need a gateway in
the suite's test mode (for this gateway: sbp serve --sbp-version 0.9 --enable-test-hooks
--insecure-no-session-auth).

Each row says how strongly the seeds or SPEC require what it checks (REQ: MUST, SHOULD, MAY). Only a
MUST check can FAIL; a SHOULD or MAY check that differs is a WARN. MANUAL rows are MUSTs no client can
observe (durability across a restart): verify them by hand. The verdict 'conformant at Lx' needs a
full run of the level (no --only) with no failure and no skipped MUST check.

Exit status: 0 no check failed (skips and warnings allowed); 1 a check failed; 2 bad arguments, the
gateway is unreachable, or it refused the credentials or the model.")]
pub struct ConformanceArgs {
    /// The gateway's base URL (http:// or https://; the WebSocket URL is derived from it).
    #[arg(long)]
    pub url: String,
    /// Highest level to check: L1 … L6.
    #[arg(long, default_value = "L5", value_parser = parse_level)]
    pub level: Level,
    /// Run the vector files of this directory (`L1-stateful-proxy/*.json` … `L5-mcp-bridge/*.json`)
    /// instead of the built-in checks.
    #[arg(long)]
    pub vectors: Option<PathBuf>,
    /// Operator API key, for gateways that need one (sent as `Authorization: Bearer`).
    #[arg(long, env = "SBP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model named in completions (`sbp/echo` is this gateway's built-in offline model).
    #[arg(long, default_value = "sbp/echo")]
    pub model: String,
    /// Seconds one check may take.
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    pub timeout: Duration,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Run only the checks whose id contains this text (repeatable; e.g. `l5.`, `drain`).
    #[arg(long)]
    pub only: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
}

fn parse_level(s: &str) -> Result<Level, String> {
    s.parse()
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() && secs <= 3600.0 => {
            Ok(Duration::from_secs_f64(secs))
        }
        _ => Err(format!(
            "'{s}' is not a number of seconds between 0 and 3600"
        )),
    }
}

/// A row to run: a built-in check or a vector file.
struct Planned {
    level: Level,
    id: String,
    title: String,
    requirement: Requirement,
    needs: Needs,
    job: Job,
}

enum Job {
    Check(checks::CheckFn),
    Vector(PathBuf),
}

/// Runs the checks; returns the process exit code.
pub fn main(args: ConformanceArgs) -> i32 {
    let (base, ws_base) = match client::parse_base(&args.url) {
        Ok(b) => b,
        Err(e) => return usage(&e),
    };
    let plan = match plan(&args) {
        Ok(p) => p,
        Err(e) => return usage(&e),
    };
    // The client's own timeout is a backstop: every wait is also bounded where it is made.
    let http = match reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(args.timeout)
        .timeout(args.timeout)
        .build()
    {
        Ok(h) => h,
        Err(e) => return usage(&format!("cannot build the HTTP client: {e}")),
    };
    let ctx = Arc::new(Ctx {
        http,
        base,
        ws_base,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        model: args.model.clone(),
        // Single waits get most of a check's time, so a hang is reported by the step that hung.
        timeout: args.timeout.mul_f64(0.75),
    });
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return usage(&format!("cannot start the async runtime: {e}")),
    };
    runtime.block_on(run(ctx, plan, &args))
}

fn usage(message: &str) -> i32 {
    eprintln!("sbp conformance: {message}");
    EXIT_USAGE
}

fn plan(args: &ConformanceArgs) -> Result<Vec<Planned>, String> {
    let mut planned: Vec<Planned> = match &args.vectors {
        Some(dir) => vectors::discover(dir, args.level)?
            .into_iter()
            .map(|v| Planned {
                level: v.level,
                id: v.id,
                title: v.description,
                requirement: Requirement::Must,
                needs: Needs::Sessions,
                job: Job::Vector(v.path),
            })
            .collect(),
        None => checks::all()
            .into_iter()
            .filter(|c| c.level <= args.level)
            .map(|c| Planned {
                level: c.level,
                id: c.id.to_owned(),
                title: c.title.to_owned(),
                requirement: c.requirement,
                needs: c.needs,
                job: Job::Check(c.run),
            })
            .collect(),
    };
    let only: Vec<&str> = args
        .only
        .iter()
        .flat_map(|o| o.split(','))
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .collect();
    if !only.is_empty() {
        planned.retain(|p| only.iter().any(|o| p.id.contains(o)));
    }
    if planned.is_empty() {
        return Err(format!(
            "nothing to run at level {} with --only {:?}",
            args.level.name(),
            args.only
        ));
    }
    Ok(planned)
}

async fn run(ctx: Arc<Ctx>, mut plan: Vec<Planned>, args: &ConformanceArgs) -> i32 {
    // With federation checks planned, the node's manifest says what it serves: a tracker-only
    // node serves no session, so only the checks of its role run (and it is asked no completion).
    if plan.iter().any(|p| p.level == Level::L6) {
        let role = match discover(&ctx).await {
            Ok(role) => role,
            Err(e) => {
                eprintln!("sbp conformance: {e}");
                return EXIT_USAGE;
            }
        };
        plan.retain(|p| p.needs.applies_to(role));
        if plan.is_empty() {
            let role = role.map_or("plain gateway", |r| r.as_str());
            return usage(&format!(
                "nothing to run against this {role} with --only {:?}",
                args.only
            ));
        }
    }
    if plan.iter().any(|p| p.needs == Needs::Sessions)
        && let Err(e) = preflight(&ctx).await
    {
        eprintln!("sbp conformance: {e}");
        return EXIT_USAGE;
    }
    let started = Instant::now();
    let mut rows = Vec::with_capacity(plan.len());
    for p in plan {
        let task_ctx = ctx.clone();
        let (status, reason, duration) = match p.job {
            Job::Check(f) => limited(f(task_ctx), args.timeout).await,
            Job::Vector(path) => limited(vectors::run(task_ctx, path), args.timeout).await,
        };
        rows.push(Row {
            level: p.level.name(),
            id: p.id,
            title: p.title,
            requirement: p.requirement,
            status: p.requirement.soften(status),
            duration,
            reason,
        });
    }
    // Only a run of every check of the level may certify it.
    let full = args.only.iter().all(|o| o.trim().is_empty());
    let summary = report::summarize(&rows, started.elapsed(), full.then_some(args.level.name()));
    let target = ctx.base.clone();
    match args.format {
        Format::Table => print!(
            "{}",
            report::table(&rows, &summary, &target, report::use_colour())
        ),
        Format::Json => println!(
            "{}",
            report::json(&rows, &summary, &target, args.level.name())
        ),
    }
    let unauthorized = rows
        .iter()
        .filter(|r| {
            r.reason
                .as_deref()
                .is_some_and(|t| t.contains("SBP_UNAUTHORIZED"))
        })
        .count();
    if unauthorized > 0 && ctx.api_key.is_none() {
        eprintln!(
            "sbp conformance: {unauthorized} check(s) got SBP_UNAUTHORIZED: does the gateway need an operator key (--api-key or SBP_API_KEY)?"
        );
    }
    if summary.failed > 0 { EXIT_FAILED } else { 0 }
}

/// The role the node's manifest names; `None` when it has none (federation off: a plain
/// gateway, whose L6 checks then fail or skip saying so). An unreachable node is an error.
async fn discover(ctx: &Ctx) -> Result<Option<sbp_protocol::federation::Role>, String> {
    let resp = checks::l6::fetch_manifest(ctx)
        .await
        .map_err(|p| format!("gateway unreachable at {}: {}", ctx.base, p.reason))?;
    Ok(resp.filter(|r| r.status == 200).and_then(|r| {
        r.body
            .get("role")
            .and_then(serde_json::Value::as_str)
            .and_then(sbp_protocol::federation::Role::parse)
    }))
}

/// Can the checks run at all? The gateway must answer HTTP, accept the credentials given, and
/// answer a completion with the model given.
async fn preflight(ctx: &Ctx) -> Result<(), String> {
    let body = serde_json::json!({
        "model": ctx.model,
        "messages": [{"role": "user", "content": "conformance: preflight"}],
        "sbp": {},
    });
    let req = ctx
        .request(reqwest::Method::POST, "/v1/chat/completions")
        .json(&body);
    let unreachable = || {
        format!(
            "gateway unreachable: {} did not answer within {:.1} s",
            ctx.base,
            ctx.timeout.as_secs_f64()
        )
    };
    // The head and the body under one limit: a gateway may send its head and then stall.
    let answer = tokio::time::timeout(ctx.timeout, async {
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        Ok::<_, reqwest::Error>((status, text))
    })
    .await;
    let (status, text) = match answer {
        Err(_) => return Err(unreachable()),
        Ok(Err(e)) if e.is_timeout() => return Err(unreachable()),
        Ok(Err(e)) => {
            return Err(format!(
                "gateway unreachable at {}: {}",
                ctx.base,
                client::error_chain(&e)
            ));
        }
        Ok(Ok(r)) => r,
    };
    preflight_verdict(status, &text, &ctx.model, ctx.api_key.is_some())
}

/// What the preflight completion's answer means for the run.
fn preflight_verdict(status: u16, text: &str, model: &str, has_key: bool) -> Result<(), String> {
    if status == 200 {
        return Ok(());
    }
    // The gateway's words, made safe for a terminal (no escapes, one line, bounded).
    let message = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| text.to_owned());
    let message = outcome::short(&message, 160);
    let model = outcome::short(model, 80);
    match (status, has_key) {
        (401, false) => Err(format!(
            "the gateway answered 401 ({message}): give its operator key with --api-key or SBP_API_KEY"
        )),
        (401 | 403, true) => Err(format!(
            "the gateway refused the operator key given with --api-key: {status} ({message})"
        )),
        (403, false) => Err(format!(
            "the gateway answered 403 ({message}): does it need an operator key (--api-key)?"
        )),
        (400..=499, _) => Err(format!(
            "the gateway refused model '{model}': pass --model (it answered {status}: {message})"
        )),
        _ => Err(format!(
            "the preflight completion with model '{model}' answered {status} ({message}): is the model served? pass --model"
        )),
    }
}

/// Runs one check on its own task, so neither a panic nor a hang can take the run down.
async fn limited<F>(check: F, limit: Duration) -> (Status, Option<String>, Duration)
where
    F: Future<Output = Outcome> + Send + 'static,
{
    let started = Instant::now();
    let mut task = tokio::spawn(check);
    let result = tokio::time::timeout(limit, &mut task).await;
    let elapsed = started.elapsed();
    match result {
        Ok(Ok(Ok(passed))) => (Status::Pass, passed.note, elapsed),
        Ok(Ok(Err(problem))) => (problem.status, Some(problem.reason), elapsed),
        Ok(Err(join)) => (
            Status::Fail,
            Some(format!("the check itself failed: {join}")),
            elapsed,
        ),
        Err(_) => {
            // Aborting the check's task drops its guards, which abort the tasks it spawned.
            task.abort();
            (
                Status::Fail,
                Some(format!(
                    "did not finish within {:.1} s (--timeout)",
                    limit.as_secs_f64()
                )),
                elapsed,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::preflight_verdict;

    #[test]
    fn preflight_needs_200_and_names_what_was_refused() {
        assert!(preflight_verdict(200, "{}", "m", false).is_ok());
        let e = preflight_verdict(401, r#"{"error":{"message":"no"}}"#, "m", false)
            .expect_err("refused");
        assert!(e.contains("401") && e.contains("--api-key"), "{e}");
        let e = preflight_verdict(401, "", "m", true).expect_err("refused");
        assert!(e.contains("refused the operator key"), "{e}");
        let e = preflight_verdict(
            404,
            r#"{"error":{"message":"unknown model m"}}"#,
            "m",
            false,
        )
        .expect_err("refused");
        assert!(e.contains("refused model 'm': pass --model"), "{e}");
        let e = preflight_verdict(202, "{}", "m", false).expect_err("refused");
        assert!(e.contains("202") && e.contains("--model"), "{e}");
    }

    #[test]
    fn the_gateways_message_is_sanitised() {
        let body = r#"{"error":{"message":"bad \u001b[31mred\u001b[0m\nline"}}"#;
        let e = preflight_verdict(400, body, "m", false).expect_err("refused");
        assert!(!e.chars().any(char::is_control), "{e:?}");
    }
}
