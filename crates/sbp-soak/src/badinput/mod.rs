//! `sbp-soak badinput`: thousands of generated malformed HTTP requests across every route and
//! malformed WebSocket sessions, each case derived from (seed, case number) alone so that any
//! failure replays with `--only N`. The gateway must answer every well-framed request without a
//! 5xx, every 4xx with the error envelope, and nothing may hang; WebSocket violations end with a
//! close frame (never 1011); afterwards the gateway still answers `/healthz`, a normal turn, a
//! normal attach, and its log holds no panic.

mod http_cases;
mod values;
mod ws_cases;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use serde_json::{Map, Value, json};

use crate::procs::{self, Env, GatewaySpec};
use crate::raw::{self, Outcome, RawResponse};
use crate::rng::Rng;

#[derive(Debug, clap::Args)]
pub struct BadInputArgs {
    /// Number of cases, HTTP and WebSocket together.
    #[arg(long, default_value_t = 5000)]
    pub cases: u64,
    /// Seed of the generator: case N is the same for the same seed on every run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Cases in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// A case with no conclusive answer within this many seconds is a hang.
    #[arg(long, default_value_t = 10)]
    pub timeout_secs: u64,
    /// Run only these case numbers (repeatable), e.g. to replay a failure.
    #[arg(long)]
    pub only: Vec<u64>,
    /// Print every case and its outcome.
    #[arg(long)]
    pub verbose: bool,
}

/// What the cases work on: live sessions, a sealed bundle and a roaming token made before the
/// run.
pub struct Fixture {
    pub addr: SocketAddr,
    /// `(session id, session token)`.
    pub sessions: Vec<(String, String)>,
    pub bundle: Map<String, Value>,
    pub roaming_token: String,
}

pub struct Case {
    pub index: u64,
    pub family: &'static str,
    pub description: String,
    pub kind: Kind,
}

pub enum Kind {
    Http(HttpCase),
    Ws(ws_cases::WsCase),
}

pub struct HttpCase {
    pub bytes: Vec<u8>,
    /// Half-close after sending (the request is cut short on purpose).
    pub half_close: bool,
    pub head_only: bool,
    /// The bytes are not a well-formed HTTP/1.1 request: the HTTP layer may refuse them with a
    /// bare status or by closing, before the gateway's code runs.
    pub framing_broken: bool,
}

/// Case `index` of a run.
pub fn generate(fx: &Fixture, seed: u64, index: u64) -> Case {
    let mut rng = Rng::for_case(seed, index);
    if rng.chance(14) {
        ws_cases::case(fx, &mut rng, index)
    } else {
        http_cases::case(fx, &mut rng, index)
    }
}

/// How one case went.
struct Verdict {
    /// `Err((kind, detail))` is a failure.
    result: Result<(), (&'static str, String)>,
    /// The bucket it is counted in (status class, close, framing reject...).
    bucket: String,
}

fn judge_http(c: &HttpCase, outcome: &Outcome) -> Verdict {
    let fail = |kind: &'static str, detail: String, bucket: &str| Verdict {
        result: Err((kind, detail)),
        bucket: bucket.into(),
    };
    match outcome {
        Outcome::Answered(r) => judge_response(r, c.head_only, c.framing_broken),
        Outcome::Hang => fail("hang", "no answer in time".into(), "hang"),
        Outcome::Closed(why) | Outcome::Broken(why) if c.framing_broken => Verdict {
            result: Ok(()),
            bucket: format!("framing: connection ended ({})", short(why)),
        },
        Outcome::Closed(why) => fail("closed without an answer", why.clone(), "closed"),
        Outcome::Broken(why) => fail("broken answer", why.clone(), "broken"),
    }
}

fn short(why: &str) -> &str {
    if why.contains("reset") {
        "reset"
    } else if why.contains("closed without") || why.contains("EOF") {
        "EOF"
    } else {
        "other"
    }
}

fn judge_response(r: &RawResponse, head_only: bool, framing_broken: bool) -> Verdict {
    let class = format!("{}xx", r.status / 100);
    if r.status >= 500 {
        return Verdict {
            result: Err(("5xx", r.describe())),
            bucket: format!("{}", r.status),
        };
    }
    // A HEAD answer has no body: its Content-Type says whether the GET's would be the envelope.
    let envelope = if head_only {
        r.header("content-type")
            .is_some_and(|v| v.starts_with(b"application/json"))
    } else {
        r.is_envelope()
    };
    if r.status >= 400 && !envelope {
        if framing_broken {
            return Verdict {
                result: Ok(()),
                bucket: format!("framing: bare {} from the HTTP layer", r.status),
            };
        }
        return Verdict {
            result: Err(("4xx without the envelope", r.describe())),
            bucket: class,
        };
    }
    let bucket = if r.status == 429 { "429".into() } else { class };
    Verdict {
        result: Ok(()),
        bucket,
    }
}

async fn run_case(fx: &Fixture, case: &Case, timeout: Duration) -> Verdict {
    match &case.kind {
        Kind::Http(c) => {
            let outcome =
                raw::exchange(fx.addr, c.bytes.clone(), c.half_close, c.head_only, timeout).await;
            judge_http(c, &outcome)
        }
        Kind::Ws(w) => {
            let mut rng = Rng::for_case(0x5157, case.index);
            let run = ws_cases::run(fx, w, &mut rng, timeout);
            // Every step inside has its own timeout; this one catches a step that has none.
            match tokio::time::timeout(timeout * 3, run).await {
                Err(_) => Verdict {
                    result: Err(("hang", "the WebSocket case did not end".into())),
                    bucket: "ws hang".into(),
                },
                Ok((_, Some(r))) => {
                    let mut v = judge_response(&r, false, false);
                    v.bucket = format!("ws refused {}", v.bucket);
                    v
                }
                Ok((Ok(what), None)) => Verdict {
                    result: Ok(()),
                    bucket: format!("ws {}", ws_bucket(&what)),
                },
                Ok((Err(e), None)) => Verdict {
                    result: Err(e),
                    bucket: "ws failed".into(),
                },
            }
        }
    }
}

fn ws_bucket(what: &str) -> String {
    if let Some(code) = what.strip_prefix("closed Some(") {
        return format!("close {}", code.split(')').next().unwrap_or("?"));
    }
    what.split([' ', ':', '('])
        .next()
        .unwrap_or(what)
        .to_owned()
}

pub async fn run(env: &Env, args: &BadInputArgs, gateway_args: &[String]) -> anyhow::Result<bool> {
    let data_dir = env.out_dir.join("badinput-data");
    let _ = std::fs::remove_dir_all(&data_dir);
    std::fs::create_dir_all(&data_dir)?;
    let gateway_log = env.log("badinput-gateway.log");
    let _ = std::fs::remove_file(&gateway_log);
    let fake = procs::start_fake(env, "badinput-fake.log").await?;
    let spec = GatewaySpec {
        data_dir: data_dir.clone(),
        database: None,
        upstream: format!("http://{}/v1", fake.addr),
        soft_nofile: None,
        extra_args: gateway_args.to_vec(),
    };
    let mut gateway = procs::start_gateway(env, &spec, "badinput-gateway.log").await?;
    println!(
        "badinput: gateway pid {} on {}; log {}",
        gateway.pid,
        gateway.addr,
        gateway_log.display()
    );
    let result = cases(env, args, gateway.addr).await;
    let alive = gateway.check_alive();
    let after = match &alive {
        Ok(()) => after_checks(gateway.addr).await,
        Err(e) => vec![format!("the gateway died: {e:#}")],
    };
    gateway.stop().await;
    fake.stop().await;
    let mut report = result?;
    report.after = after;
    report.panics = procs::panics_in(&gateway_log);
    report.print(env);
    let pass = report.pass();
    if pass {
        let _ = std::fs::remove_dir_all(&data_dir);
    }
    Ok(pass)
}

#[derive(Default)]
struct Report {
    http: u64,
    ws: u64,
    buckets: BTreeMap<String, u64>,
    failures: BTreeMap<&'static str, Vec<(u64, String, String)>>,
    after: Vec<String>,
    panics: Vec<String>,
    seed: u64,
    seconds: f64,
}

impl Report {
    fn failed(&self) -> usize {
        self.failures.values().map(Vec::len).sum()
    }

    fn pass(&self) -> bool {
        self.failed() == 0 && self.after.is_empty() && self.panics.is_empty()
    }

    fn count(&self, prefix: &str) -> u64 {
        self.buckets
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    }

    fn print(&self, env: &Env) {
        println!("  outcomes:");
        for (k, v) in &self.buckets {
            println!("    {k}: {v}");
        }
        for (kind, list) in &self.failures {
            println!("  FAIL {kind}: {} cases, e.g.", list.len());
            for (i, desc, detail) in list.iter().take(5) {
                println!(
                    "    case {i}: {desc}\n      -> {}",
                    raw::snippet(detail.as_bytes(), 300)
                );
            }
        }
        for a in &self.after {
            println!("  FAIL after the run: {a}");
        }
        for p in self.panics.iter().take(5) {
            println!("  FAIL panic in the gateway log: {p}");
        }
        if self.failed() > 0 {
            println!(
                "  every failure is in {}; replay one with `sbp-soak badinput --seed {} --only N`",
                env.log("badinput-failures.jsonl").display(),
                self.seed
            );
        }
        let kinds = |k: &str| self.failures.get(k).map_or(0, Vec::len);
        println!(
            "\nbadinput: {} {} cases ({} HTTP, {} WebSocket) in {:.0} s: 2xx {}, 4xx {} (429: {}), \
             framing rejects {}; 5xx {}, non-envelope 4xx {}, hangs {}, closed without an answer {}; \
             ws: closes {}, 1011 {}, dropped without a close frame {}, close not answered {}, \
             benign closed {}; after the run: {}; panics {}",
            if self.pass() { "PASS" } else { "FAIL" },
            self.http + self.ws,
            self.http,
            self.ws,
            self.seconds,
            self.count("2xx") + self.count("ws refused 2xx"),
            self.count("4xx") + self.count("429") + self.count("ws refused 4xx"),
            self.count("429") + self.count("ws refused 429"),
            self.count("framing"),
            kinds("5xx"),
            kinds("4xx without the envelope"),
            kinds("hang") + kinds("ws hang: no close after a violation"),
            kinds("closed without an answer") + kinds("broken answer"),
            self.count("ws close"),
            kinds("ws closed 1011 (internal error)"),
            kinds("ws dropped without a close frame"),
            kinds("ws close not answered"),
            kinds("ws closed a benign session"),
            if self.after.is_empty() {
                "ok"
            } else {
                "FAILED"
            },
            self.panics.len(),
        );
    }
}

async fn cases(env: &Env, args: &BadInputArgs, addr: SocketAddr) -> anyhow::Result<Report> {
    let started = tokio::time::Instant::now();
    let fx = fixture(addr)
        .await
        .context("preparing sessions and a bundle")?;
    let indices: Vec<u64> = if args.only.is_empty() {
        (0..args.cases).collect()
    } else {
        args.only.clone()
    };
    let timeout = Duration::from_secs(args.timeout_secs);
    let fx = &fx;
    let mut results = futures::stream::iter(indices)
        .map(|i| async move {
            let case = generate(fx, args.seed, i);
            let verdict = run_case(fx, &case, timeout).await;
            (case, verdict)
        })
        .buffer_unordered(args.concurrency.max(1));
    let failures_path = env.log("badinput-failures.jsonl");
    let mut failures_file = std::fs::File::create(&failures_path)
        .with_context(|| format!("creating {}", failures_path.display()))?;
    let mut report = Report {
        seed: args.seed,
        ..Report::default()
    };
    let mut done = 0u64;
    while let Some((case, verdict)) = results.next().await {
        done += 1;
        match case.kind {
            Kind::Http(_) => report.http += 1,
            Kind::Ws(_) => report.ws += 1,
        }
        *report.buckets.entry(verdict.bucket.clone()).or_default() += 1;
        if args.verbose {
            println!(
                "  case {} [{}] {} -> {} {:?}",
                case.index, case.family, case.description, verdict.bucket, verdict.result
            );
        }
        if let Err((kind, detail)) = verdict.result {
            let request = match &case.kind {
                Kind::Http(h) => raw::snippet(&h.bytes, 2000),
                Kind::Ws(w) => format!("{w:?}").chars().take(2000).collect(),
            };
            let line = json!({
                "case": case.index,
                "family": case.family,
                "description": case.description,
                "failure": kind,
                "detail": detail,
                "request": request,
            });
            writeln!(failures_file, "{line}")?;
            report.failures.entry(kind).or_default().push((
                case.index,
                case.description.clone(),
                detail,
            ));
        }
        if done.is_multiple_of(1000) {
            println!("  {done} cases, {} failed so far", report.failed());
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Sessions to aim at (many, so cases in flight rarely displace each other's surfaces), one of
/// them with a turn and exported: its bundle and roaming token.
async fn fixture(addr: SocketAddr) -> anyhow::Result<Fixture> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let base = format!("http://{addr}");
    let mut sessions = Vec::new();
    for _ in 0..24 {
        let v: Value = http
            .post(format!("{base}/v1/sessions"))
            .json(&json!({}))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        match (v["session_id"].as_str(), v["session_token"].as_str()) {
            (Some(id), Some(t)) => sessions.push((id.to_owned(), t.to_owned())),
            _ => bail!("POST /v1/sessions answered {v}"),
        }
    }
    let resp = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "soak-model", "messages": [{"role": "user", "content": "a turn to export"}]}))
        .send()
        .await?
        .error_for_status()?;
    let token = resp
        .headers()
        .get("x-session-token")
        .and_then(|v| v.to_str().ok())
        .context("no X-Session-Token")?
        .to_owned();
    let v: Value = resp.json().await?;
    let id = v["sbp"]["session_id"]
        .as_str()
        .context("no sbp.session_id")?
        .to_owned();
    let export: Value = http
        .post(format!("{base}/v1/sbp/sessions/{id}/export"))
        .header("x-session-token", &token)
        .json(&json!({"ttl_seconds": 3600, "include_bundle": true}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let bundle = match &export["bundle"] {
        Value::Object(m) => m.clone(),
        other => bail!("export without a bundle: {other}"),
    };
    let roaming_token = export["roaming_token"]
        .as_str()
        .context("export without a roaming_token")?
        .to_owned();
    sessions.push((id, token));
    Ok(Fixture {
        addr,
        sessions,
        bundle,
        roaming_token,
    })
}

/// The gateway still works: `/healthz`, a new session's turn, a normal attach. Returns what
/// failed.
async fn after_checks(addr: SocketAddr) -> Vec<String> {
    let mut failed = Vec::new();
    if let Err(e) = crate::probe::healthz_once(addr).await {
        failed.push(format!("/healthz: {e}"));
    }
    let http = match reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
    {
        Ok(h) => h,
        Err(e) => return vec![format!("HTTP client: {e}")],
    };
    let turn = http
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&json!({"model": "soak-model", "messages": [{"role": "user", "content": "still there?"}]}))
        .send()
        .await;
    let (id, token) = match turn {
        Err(e) => {
            failed.push(format!("a normal turn: {e}"));
            return failed;
        }
        Ok(r) => {
            let status = r.status();
            let token = r
                .headers()
                .get("x-session-token")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body: Value = r.json().await.unwrap_or(Value::Null);
            let reply = body["choices"][0]["message"]["content"].as_str();
            if status != 200 || reply != Some("echo: still there?") {
                failed.push(format!("a normal turn: {status} {body}"));
                return failed;
            }
            (
                body["sbp"]["session_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                token.unwrap_or_default(),
            )
        }
    };
    let mut rng = Rng::new(7);
    let path = format!("/v1/sbp/ws/{id}");
    match raw::ws_connect(
        addr,
        path.as_bytes(),
        raw::WsOpts::default(),
        &mut rng,
        Duration::from_secs(10),
    )
    .await
    {
        raw::Handshake::Upgraded(mut ws) => {
            let attach =
                json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
            let ok = ws.send_text(&mut rng, &attach.to_string()).await.is_ok();
            match ws.next_json(&mut rng, Duration::from_secs(10)).await {
                Ok(v) if ok && v["type"] == "SESSION_ATTACHED" => {}
                other => failed.push(format!("a normal attach: {other:?}")),
            }
        }
        raw::Handshake::Refused(r) => failed.push(format!("a normal attach: {}", r.describe())),
        raw::Handshake::Failed(o) => failed.push(format!("a normal attach: {o:?}")),
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Fixture {
        let mut bundle = values::obj(json!({
            "sbp_version": "1.0",
            "session": {"id": "0190b6b2-0000-7000-8000-000000000000", "step_count": 1},
            "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"message_count": 1},
        }));
        sbp_protocol::bundle::seal(&mut bundle);
        Fixture {
            addr: "127.0.0.1:9".parse().expect("addr"),
            sessions: vec![("0190b6b2-0000-7000-8000-000000000001".into(), "tok".into())],
            bundle,
            roaming_token: "a.b.c".into(),
        }
    }

    #[test]
    fn cases_are_reproducible_and_cover_every_family() {
        let fx = fixture();
        let mut families = std::collections::BTreeSet::new();
        for i in 0..150 {
            let a = generate(&fx, 5, i);
            let b = generate(&fx, 5, i);
            assert_eq!(a.description, b.description, "case {i}");
            if let (Kind::Http(x), Kind::Http(y)) = (&a.kind, &b.kind) {
                assert_eq!(x.bytes, y.bytes, "case {i}");
            }
            families.insert(a.family);
        }
        for f in [
            "json", "bytes", "path", "query", "method", "headers", "framing", "bundle", "ws",
        ] {
            assert!(families.contains(f), "no {f} case in 150: {families:?}");
        }
    }

    #[test]
    fn verdicts_follow_the_rules() {
        let resp = |status, body: &str| RawResponse {
            status,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        };
        let envelope = r#"{"error":{"code":"SBP_BAD_REQUEST","message":"x"}}"#;
        assert!(
            judge_response(&resp(400, envelope), false, false)
                .result
                .is_ok()
        );
        assert!(
            judge_response(&resp(400, "plain"), false, false)
                .result
                .is_err()
        );
        assert!(
            judge_response(&resp(400, "plain"), false, true)
                .result
                .is_ok()
        );
        assert!(
            judge_response(&resp(500, envelope), false, true)
                .result
                .is_err()
        );
        let mut head = resp(405, "");
        assert!(judge_response(&head, true, false).result.is_err());
        head.headers
            .push(("Content-Type".into(), b"application/json".to_vec()));
        assert!(judge_response(&head, true, false).result.is_ok());
        let well_framed = HttpCase {
            bytes: Vec::new(),
            half_close: false,
            head_only: false,
            framing_broken: false,
        };
        assert!(
            judge_http(&well_framed, &Outcome::Closed("x".into()))
                .result
                .is_err()
        );
        assert!(judge_http(&well_framed, &Outcome::Hang).result.is_err());
    }
}
