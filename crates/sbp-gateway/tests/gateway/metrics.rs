//! `/metrics`: Prometheus text a strict reader accepts, whose labelled series move with what the
//! gateway does (HTTP requests by route template and status, upstream calls by model, provider
//! and outcome, WebSocket connections and frames by type, tool calls by outcome, store commits),
//! with `process_*` and `sbp_build_info`; and the Grafana dashboard in `docs/` asks only for
//! metrics the page has.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream, WAIT};
use sbp_test_support::wait_until;

/// One sample line.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A page read strictly.
struct Page {
    /// Every sample name a declared family allows (a histogram's `_bucket`, `_sum`, `_count`).
    names: BTreeSet<String>,
    samples: Vec<Sample>,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && !n.starts_with(|c: char| c.is_ascii_digit())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Reads `text` against the Prometheus text format 0.0.4: `# HELP` / `# TYPE` lines, then samples
/// `name{label="value",...} number` of a declared family, label values quoted with `\\`, `\"`
/// and `\n` escaped, no series twice. Panics at the first line that is not so.
fn read_page(text: &str) -> Page {
    let mut names = BTreeSet::new();
    let mut samples: Vec<Sample> = Vec::new();
    let mut seen = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            assert!(valid_name(name), "HELP of a bad name: {line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("{line}"));
            assert!(valid_name(name), "TYPE of a bad name: {line}");
            match kind {
                "counter" | "gauge" | "untyped" => {
                    names.insert(name.to_owned());
                }
                "histogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
                _ => panic!("unknown type: {line}"),
            }
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "stray line: {line:?}"
        );
        let name_end = line.find(['{', ' ']).unwrap_or_else(|| panic!("{line}"));
        let name = &line[..name_end];
        assert!(
            names.contains(name),
            "sample of an undeclared family: {line}"
        );
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(mut inner) = rest.strip_prefix('{') {
            loop {
                if let Some(after) = inner.strip_prefix('}') {
                    inner = after;
                    break;
                }
                let (key, after) = inner.split_once("=\"").unwrap_or_else(|| panic!("{line}"));
                assert!(valid_name(key), "bad label name: {line}");
                let mut value = String::new();
                let mut chars = after.char_indices();
                let end = loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, '\\')) => value.push('\\'),
                            Some((_, '"')) => value.push('"'),
                            Some((_, 'n')) => value.push('\n'),
                            _ => panic!("bad escape: {line}"),
                        },
                        Some((i, '"')) => break i,
                        Some((_, c)) => value.push(c),
                        None => panic!("unclosed label value: {line}"),
                    }
                };
                assert!(labels.insert(key.to_owned(), value).is_none(), "{line}");
                inner = &after[end + 1..];
                inner = inner.strip_prefix(',').unwrap_or(inner);
            }
            rest = inner;
        }
        let raw = rest.strip_prefix(' ').unwrap_or_else(|| panic!("{line}"));
        let value = match raw {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        assert!(
            seen.insert(format!("{name}{labels:?}")),
            "series twice: {line}"
        );
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    Page { names, samples }
}

/// The sum of the series of `name` whose labels include `labels`.
fn value(page: &Page, name: &str, labels: &[(&str, &str)]) -> f64 {
    page.samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

async fn scrape(gw: &TestGateway) -> (String, Page) {
    let text = gw.metrics_text().await;
    let page = read_page(&text);
    (text, page)
}

fn ask(text: &str) -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn labelled_series_move_with_requests_upstream_calls_frames_and_tools() {
    let mut opts = Options {
        upstream: Upstream::Fake,
        ..Options::default()
    };
    opts.config.tool_timeout = Duration::from_millis(300);
    let gw = TestGateway::with(opts).await;
    let (id, token) = gw.idle_session().await;
    let (mut ws, attached) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"mcp_tools": ["gps"]}}),
        )
        .await;
    assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
    let auth = [("x-session-token", token.as_str())];

    // A tool call the surface answers, then one it leaves to time out.
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("[[fake:tool=surface_gps]]"),
        &auth,
    );
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"fix": 1}}))
        .await;
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    ws.live_turn().await;
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("[[fake:tool=surface_gps]]"),
        &auth,
    );
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    ws.live_turn().await;

    // An upstream failure, a health check, a path no route matches.
    let (s, _, body) = gw
        .post("/v1/chat/completions", ask("[[fake:error=500]] no"), &auth)
        .await;
    assert!(s >= 500, "{s} {body}");
    let failed = s.to_string();
    assert_eq!(gw.get("/healthz", &[]).await.0, 200);
    assert_eq!(gw.get("/no/such/page", &[]).await.0, 404);

    let (text, m) = scrape(&gw).await;
    let http = |method, route, status: &str| {
        value(
            &m,
            "sbp_http_requests_total",
            &[("method", method), ("route", route), ("status", status)],
        )
    };
    assert_eq!(http("GET", "/healthz", "200"), 1.0, "{text}");
    assert_eq!(http("GET", "unmatched", "404"), 1.0, "{text}");
    assert_eq!(http("POST", "/v1/chat/completions", "200"), 2.0, "{text}");
    assert_eq!(http("POST", "/v1/chat/completions", &failed), 1.0, "{text}");
    assert_eq!(http("GET", "/v1/sbp/ws/{id}", "101"), 1.0, "{text}");
    assert!(
        !text.contains(&id),
        "no raw path (nor session id) is a label:\n{text}"
    );
    assert_eq!(
        value(
            &m,
            "sbp_http_request_duration_seconds_count",
            &[("route", "/v1/chat/completions")]
        ),
        3.0,
        "{text}"
    );

    // Two rounds per tool turn; the failure under the model the upstream already answered.
    let upstream = |outcome| {
        value(
            &m,
            "sbp_upstream_requests_total",
            &[
                ("model", "gpt-4o"),
                ("provider", "openai"),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(upstream("ok"), 4.0, "{text}");
    assert_eq!(upstream("server_error"), 1.0, "{text}");
    assert_eq!(
        value(
            &m,
            "sbp_upstream_latency_seconds_count",
            &[("model", "gpt-4o"), ("outcome", "ok")]
        ),
        4.0,
        "{text}"
    );
    assert!(
        value(
            &m,
            "sbp_upstream_time_to_first_token_seconds_count",
            &[("model", "gpt-4o"), ("provider", "openai")]
        ) >= 2.0,
        "streamed to the surface, so timed to the first token:\n{text}"
    );

    let tool = |outcome| {
        value(
            &m,
            "sbp_tool_call_outcomes_total",
            &[("target", "surface"), ("outcome", outcome)],
        )
    };
    assert_eq!(
        (tool("ok"), tool("timeout"), tool("error")),
        (1.0, 1.0, 0.0),
        "{text}"
    );

    let frames = |direction, kind| {
        value(
            &m,
            "sbp_ws_frames_total",
            &[("direction", direction), ("type", kind)],
        )
    };
    assert_eq!(frames("in", "ATTACH_SESSION"), 1.0, "{text}");
    assert_eq!(frames("in", "TOOL_RESULT"), 1.0, "{text}");
    assert_eq!(frames("out", "SESSION_ATTACHED"), 1.0, "{text}");
    assert_eq!(frames("out", "TOOL_CALL"), 2.0, "{text}");
    assert!(frames("out", "TURN_COMPLETE") >= 2.0, "{text}");
    assert_eq!(value(&m, "sbp_ws_connections_total", &[]), 1.0, "{text}");
    assert_eq!(value(&m, "sbp_ws_connections_open", &[]), 1.0, "{text}");

    let commits = |op| value(&m, "sbp_store_commit_seconds_count", &[("op", op)]);
    assert_eq!(commits("create_session"), 1.0, "{text}");
    assert_eq!(commits("begin_turn"), 3.0, "{text}");
    assert_eq!(commits("record_progress"), 4.0, "{text}");
    assert_eq!(commits("finish_turn"), 2.0, "{text}");
    assert_eq!(commits("fail_turn"), 1.0, "{text}");

    for positive in [
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_threads",
        "process_start_time_seconds",
    ] {
        assert!(value(&m, positive, &[]) > 0.0, "{positive}:\n{text}");
    }
    assert!(value(&m, "process_cpu_seconds_total", &[]) >= 0.0, "{text}");
    assert_eq!(
        value(
            &m,
            "sbp_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0,
        "{text}"
    );

    // Every family the dashboard reads has a series by now.
    assert_dashboard_reads_only(&m);

    // The connection closes: open goes back to 0.
    ws.close().await;
    wait_until(
        WAIT,
        "sbp_ws_connections_open back to 0",
        || async { value(&scrape(&gw).await.1, "sbp_ws_connections_open", &[]) },
        |open| *open == 0.0,
    )
    .await;
}

/// The metric names an expression reads (identifiers starting `sbp_` or `process_`).
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut word = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
            continue;
        }
        if word.starts_with("sbp_") || word.starts_with("process_") {
            names.push(std::mem::take(&mut word));
        }
        word.clear();
    }
    names
}

/// The dashboard's panels, as (title, metric names its queries read).
fn dashboard_panels() -> Vec<(String, Vec<String>)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/grafana/sbp-gateway.json"
    );
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}")),
    )
    .unwrap_or_else(|e| panic!("{path} is not JSON: {e}"));
    assert_eq!(dashboard["uid"], "sbp-gateway");
    let panels = dashboard["panels"].as_array().expect("panels");
    panels
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|panel| {
            let title = panel["title"].as_str().expect("a panel title").to_owned();
            let targets = panel["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{title} has no query");
            let mut names = Vec::new();
            for expr in targets.iter().filter_map(|t| t["expr"].as_str()) {
                let used = metric_names(expr);
                assert!(!used.is_empty(), "{title}: no metric in {expr}");
                names.extend(used);
            }
            (title, names)
        })
        .collect()
}

/// Every metric the dashboard reads is on `page`, and the list is on the dashboard.
fn assert_dashboard_reads_only(page: &Page) {
    let mut read = BTreeSet::new();
    for (title, names) in dashboard_panels() {
        for name in names {
            assert!(
                page.names.contains(&name),
                "{title}: {name} is not on /metrics"
            );
            read.insert(name);
        }
    }
    for name in [
        "sbp_http_requests_total",
        "sbp_http_request_duration_seconds_bucket",
        "sbp_upstream_requests_total",
        "sbp_upstream_latency_seconds_bucket",
        "sbp_upstream_time_to_first_token_seconds_bucket",
        "sbp_ws_frames_total",
        "sbp_ws_connections_open",
        "sbp_tool_call_outcomes_total",
        "sbp_tether_depth",
        "sbp_store_commit_seconds_bucket",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "sbp_build_info",
    ] {
        assert!(read.contains(name), "no panel reads {name}");
    }
}

#[test]
fn the_grafana_dashboard_is_json_whose_panels_query_gateway_metrics() {
    let panels = dashboard_panels();
    assert!(panels.len() >= 10, "{panels:?}");
}
