//! Prometheus metrics of one gateway on `prometheus-client`: a registry per gateway (no
//! process-global recorder, so several gateways in one test process keep separate figures),
//! rendered in the Prometheus text format. Gauges that live in storage (sessions by status, tether
//! depth) are read when `/metrics` is scraped; `process_*` are read from `/proc` then
//! (`process.rs`). Every label takes its values from a closed set (route templates, frame types,
//! outcomes) or, for upstream models, from a capped set (`upstream.rs`), so no client can grow a
//! family without bound.

mod process;
pub mod upstream;

use std::future::Future;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::ratelimit::Limit;
pub use upstream::Observed;

/// Latency buckets (seconds): sub-millisecond store commits up to minute-long streams.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

fn latency() -> Histogram {
    Histogram::new(BUCKETS)
}

/// A family of latency histograms.
pub type Latencies<L> = Family<L, Histogram, fn() -> Histogram>;

fn latencies<L: Clone + std::hash::Hash + Eq>() -> Latencies<L> {
    Family::new_with_constructor(latency as fn() -> Histogram)
}

/// The route label of a request no route matched (its raw path is never a label).
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// Labels of an HTTP request: the route template (`/v1/sessions/{id}`), never the raw path.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub method: &'static str,
    pub route: String,
    pub status: u16,
}

/// Labels of a WebSocket frame: `in` (client to gateway) or `out`, and its protocol type.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FrameLabels {
    pub direction: &'static str,
    pub r#type: &'static str,
}

/// Labels of a tool call's ending: where the tool runs (`surface`, `server`) and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabels {
    pub target: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabel {
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    sbp_version: &'static str,
}

/// Every figure of one gateway. Counters are handles (clones share the value), so a service
/// keeps the `Arc<Metrics>` and counts through its fields.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub sessions_created: Counter,
    pub turns_completed: Counter,
    pub turns_failed: Counter,
    pub turns_pushed: Counter,
    /// Turns whose transcript the history cache held whole, and turns that read (some of) it.
    pub history_cache_hits: Counter,
    pub history_cache_misses: Counter,
    pub tether_enqueued: Counter,
    pub tether_delivered: Counter,
    pub ws_connections: Counter,
    /// WebSocket connections open now (upgraded, not yet closed).
    pub ws_open: Gauge,
    /// WebSocket frames by direction and type.
    pub ws_frames: Family<FrameLabels, Counter>,
    /// Surfaces dropped for not reading (write timeout or outbound budget).
    pub ws_slow_consumers: Counter,
    /// Connections closed for sending frames faster than their limit.
    pub ws_frame_floods: Counter,
    pub exports: Counter,
    pub imports: Counter,
    pub handoffs: Counter,
    pub forks: Counter,
    /// Surface tool calls sent (TOOL_CALL frames), and how they ended.
    pub tool_calls: Counter,
    pub tool_call_errors: Counter,
    pub tool_call_timeouts: Counter,
    /// Tools of southbound MCP servers called by the gateway.
    pub server_tool_calls: Counter,
    /// Every tool call the gateway ran, surface or server, by how it ended.
    pub tool_outcomes: Family<ToolLabels, Counter>,
    /// Retention sweeps run, and what they removed.
    pub retention_sweeps: Counter,
    pub retention_exports: Counter,
    pub retention_bundles: Counter,
    pub retention_snapshots: Counter,
    /// Federation rows swept past their own expiry: replay-cache tokens, registry records,
    /// announcements.
    pub retention_jti: Counter,
    pub retention_registry_records: Counter,
    pub retention_announcements: Counter,
    /// Upstream LLM requests: count, latency and time to first token by model, provider and
    /// outcome (recorded by the [`Observed`] provider around every upstream call).
    pub upstream: upstream::UpstreamMetrics,
    /// TOOL_CALL sent to TOOL_RESULT received (or timeout / disconnect).
    pub tool_call_latency: Histogram,
    /// HTTP requests and their latency (to the response's last byte) by method, route and status.
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_latency: Latencies<HttpLabels>,
    /// Store writes on the turn path, by operation: from the call to its COMMIT returning.
    store_commit: Latencies<OpLabel>,
    /// Connections over a connection cap: served `/healthz` only, or closed at once.
    pub connections_shed: Counter,
    /// Connections closed by the edge: no request head in time, idle too long, or evicted.
    pub connections_timed_out: Counter,
    /// Requests refused by a rate limit, by limit (`ratelimit::Limit` order).
    rate_limited: [Counter; 4],
    /// Federation (L6) counters with labels: bundle fetches and serves, handovers, token
    /// rejections, tracker announces and lookups.
    pub federation: Labelled,
    sessions: Family<StatusLabel, Gauge>,
    tether_depth: Gauge,
    attached_surfaces: Gauge,
    history_cache_sessions: Gauge,
    history_cache_bytes: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Registers a counter (`name` without `_total`: the encoder adds it) and returns its handle.
/// Help texts have no final period: the registry adds one.
fn counter(reg: &mut Registry, name: &str, help: &str) -> Counter {
    let c = Counter::default();
    reg.register(name, help, c.clone());
    c
}

/// Registers a gauge and returns its handle.
fn gauge(reg: &mut Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::default();
    reg.register(name, help, g.clone());
    g
}

/// The closed label sets whose series exist from the start (at 0), so a dashboard's `rate()`
/// sees them before the first event.
const TOOL_OUTCOMES: [(&str, &str); 6] = [
    ("surface", "ok"),
    ("surface", "error"),
    ("surface", "timeout"),
    ("surface", "disconnected"),
    ("server", "ok"),
    ("server", "error"),
];

impl Metrics {
    pub fn new() -> Self {
        let mut reg = Registry::default();
        let r = &mut reg;
        let sessions = Family::<StatusLabel, Gauge>::default();
        r.register("sbp_sessions", "Sessions by status", sessions.clone());
        let attached_surfaces = gauge(
            r,
            "sbp_attached_surfaces",
            "Surfaces attached over WebSocket",
        );
        let tether_depth = gauge(r, "sbp_tether_depth", "Turns waiting in the Tether");
        let sessions_created = counter(r, "sbp_sessions_created", "Sessions created");
        let turns_completed = counter(r, "sbp_turns", "LLM turns completed and persisted");
        let turns_failed = counter(r, "sbp_turns_failed", "LLM turns that failed upstream");
        let turns_pushed = counter(r, "sbp_turns_pushed", "Turns pushed by a backend");
        let history_cache_hits = counter(
            r,
            "sbp_history_cache_hits",
            "Turns whose session transcript the history cache held whole",
        );
        let history_cache_misses = counter(
            r,
            "sbp_history_cache_misses",
            "Turns that read their transcript, or the part the cache lacked, from the store",
        );
        let history_cache_sessions = gauge(
            r,
            "sbp_history_cache_sessions",
            "Session transcripts held by the history cache",
        );
        let history_cache_bytes = gauge(
            r,
            "sbp_history_cache_bytes",
            "Memory the history cache's transcripts keep (its budget is --history-cache-mib)",
        );
        let tool_calls = counter(r, "sbp_tool_calls", "TOOL_CALL frames sent to surfaces");
        let tool_call_errors = counter(
            r,
            "sbp_tool_call_errors",
            "Surface tool calls that ended in an error (including timeouts and disconnects)",
        );
        let tool_call_timeouts = counter(
            r,
            "sbp_tool_call_timeouts",
            "Surface tool calls that timed out",
        );
        let server_tool_calls = counter(
            r,
            "sbp_server_tool_calls",
            "Tools of southbound MCP servers called by the gateway",
        );
        let tool_outcomes = Family::<ToolLabels, Counter>::default();
        for (target, outcome) in TOOL_OUTCOMES {
            tool_outcomes.get_or_create_owned(&ToolLabels { target, outcome });
        }
        r.register(
            "sbp_tool_call_outcomes",
            "Tool calls the gateway ran, by target (surface, server) and outcome",
            tool_outcomes.clone(),
        );
        let tether_enqueued = counter(r, "sbp_tether_enqueued", "Turns written to the Tether");
        let tether_delivered = counter(
            r,
            "sbp_tether_delivered",
            "Tethered turns delivered to a surface",
        );
        let ws_connections = counter(r, "sbp_ws_connections", "WebSocket connections accepted");
        let ws_open = gauge(
            r,
            "sbp_ws_connections_open",
            "WebSocket connections open now",
        );
        let ws_frames = Family::<FrameLabels, Counter>::default();
        r.register(
            "sbp_ws_frames",
            "WebSocket frames by direction (in, out) and protocol type",
            ws_frames.clone(),
        );
        let ws_slow_consumers = counter(
            r,
            "sbp_ws_slow_consumers",
            "Surfaces dropped for not reading (write timeout or outbound byte budget)",
        );
        let ws_frame_floods = counter(
            r,
            "sbp_ws_frame_floods",
            "WebSocket connections closed (1008) for sending frames faster than allowed",
        );
        let retention_sweeps = counter(r, "sbp_retention_sweeps", "Retention sweeps run");
        let swept = Family::<KindLabel, Counter>::default();
        r.register(
            "sbp_retention_swept",
            "Rows removed by retention sweeps",
            swept.clone(),
        );
        let kind = |kind| swept.get_or_create_owned(&KindLabel { kind });
        let rate = Family::<LimitLabel, Counter>::default();
        r.register(
            "sbp_rate_limited",
            "Requests refused by a rate limit",
            rate.clone(),
        );
        let limit = |l: Limit| rate.get_or_create_owned(&LimitLabel { limit: l.as_str() });
        let exports = counter(r, "sbp_exports", "Sessions exported to a roaming bundle");
        let imports = counter(r, "sbp_imports", "Sessions imported from a token or bundle");
        let handoffs = counter(r, "sbp_handoffs", "Sessions handed off to another agent");
        let forks = counter(r, "sbp_forks", "Sessions forked");
        let connections_shed = counter(
            r,
            "sbp_connections_shed",
            "Connections over a connection cap (served /healthz only, or closed at once)",
        );
        let connections_timed_out = counter(
            r,
            "sbp_connections_timed_out",
            "Connections closed for sending no request head in time, idling too long, or to make room",
        );
        let federation = Labelled::register(r);
        let upstream = upstream::UpstreamMetrics::register(r);
        let tool_call_latency = latency();
        r.register(
            "sbp_tool_call_latency_seconds",
            "Time from sending a TOOL_CALL to its TOOL_RESULT (or timeout or disconnect)",
            tool_call_latency.clone(),
        );
        let http_requests = Family::<HttpLabels, Counter>::default();
        r.register(
            "sbp_http_requests",
            "HTTP requests by method, route template and status (a WebSocket counts its upgrade)",
            http_requests.clone(),
        );
        let http_latency = latencies();
        r.register(
            "sbp_http_request_duration_seconds",
            "Time from a request's arrival to its response's last byte, by method, route and status",
            http_latency.clone(),
        );
        let store_commit = latencies();
        r.register(
            "sbp_store_commit_seconds",
            "Store writes on the turn path, from the call to its commit, by operation",
            store_commit.clone(),
        );
        r.register(
            "sbp_build",
            "The gateway's version and the protocol version it speaks (always 1)",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                sbp_version: sbp_protocol::DEFAULT_SBP_VERSION,
            }),
        );
        r.register_collector(Box::new(process::ProcessCollector));
        Self {
            sessions_created,
            turns_completed,
            turns_failed,
            turns_pushed,
            history_cache_hits,
            history_cache_misses,
            tether_enqueued,
            tether_delivered,
            ws_connections,
            ws_open,
            ws_frames,
            ws_slow_consumers,
            ws_frame_floods,
            exports,
            imports,
            handoffs,
            forks,
            tool_calls,
            tool_call_errors,
            tool_call_timeouts,
            server_tool_calls,
            tool_outcomes,
            retention_sweeps,
            retention_exports: kind("exports"),
            retention_bundles: kind("bundles"),
            retention_snapshots: kind("snapshots"),
            retention_jti: kind("jti"),
            retention_registry_records: kind("registry_records"),
            retention_announcements: kind("announcements"),
            upstream,
            tool_call_latency,
            http_requests,
            http_latency,
            store_commit,
            connections_shed,
            connections_timed_out,
            rate_limited: [
                limit(Limit::Address),
                limit(Limit::Session),
                limit(Limit::OperatorKey),
                limit(Limit::AuthFailures),
            ],
            federation,
            sessions,
            tether_depth,
            attached_surfaces,
            history_cache_sessions,
            history_cache_bytes,
            registry: reg,
        }
    }

    pub fn count_rate_limited(&self, limit: Limit) {
        let i = match limit {
            Limit::Address => 0,
            Limit::Session => 1,
            Limit::OperatorKey => 2,
            Limit::AuthFailures => 3,
        };
        self.rate_limited[i].inc();
    }

    /// Counts a tool call's ending.
    pub fn tool_outcome(&self, target: &'static str, outcome: &'static str) {
        self.tool_outcomes
            .get_or_create(&ToolLabels { target, outcome })
            .inc();
    }

    /// Counts a WebSocket frame.
    pub fn ws_frame(&self, direction: &'static str, r#type: &'static str) {
        self.ws_frames
            .get_or_create(&FrameLabels { direction, r#type })
            .inc();
    }

    /// Counts an HTTP request that took `elapsed`.
    pub fn http_request(&self, labels: HttpLabels, elapsed: Duration) {
        self.http_latency
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        self.http_requests.get_or_create(&labels).inc();
    }

    /// Runs a store write and records how long it took to commit (or fail), under `op`.
    pub async fn commit<T>(&self, op: &'static str, write: impl Future<Output = T>) -> T {
        let started = Instant::now();
        let out = write.await;
        self.store_commit
            .get_or_create(&OpLabel { op })
            .observe(started.elapsed().as_secs_f64());
        out
    }

    /// The Prometheus text (format 0.0.4), with the gauges read at scrape time set first.
    pub fn render(&self, live: &LiveGauges) -> String {
        let level = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for (status, n) in &live.sessions_by_status {
            self.sessions
                .get_or_create(&StatusLabel { status })
                .set(level(*n));
        }
        self.tether_depth.set(level(live.tether_depth));
        self.attached_surfaces.set(level(live.attached_surfaces));
        self.history_cache_sessions
            .set(level(live.history_cache.0 as u64));
        self.history_cache_bytes
            .set(level(live.history_cache.1 as u64));
        let mut out = String::with_capacity(16 << 10);
        // Writing to a String cannot fail; a collector's error would leave the text cut short,
        // which a scraper reports as a parse error rather than a wrong figure.
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::error!(error = %e, "encoding /metrics failed");
        }
        out
    }
}

/// Store writes timed as they are awaited: `store.finish_turn(f).timed(&metrics, "finish_turn")`.
pub trait Timed: Future + Sized {
    /// This write, its time to commit (or fail) recorded under `op`.
    fn timed(self, metrics: &Metrics, op: &'static str) -> impl Future<Output = Self::Output> {
        metrics.commit(op, self)
    }
}

impl<F: Future> Timed for F {}

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Counters with one label each, for families whose label values are a small closed set (the
/// engine passes `&'static str`s, so a peer cannot grow the set).
#[derive(Debug)]
pub struct Labelled {
    families: Vec<(&'static str, OneLabel)>,
}

/// Counters with one label, the label's name given with each value.
type OneLabel = Family<[(&'static str, &'static str); 1], Counter>;

/// A labelled counter family: its name, help and label name.
#[derive(Debug, Clone, Copy)]
pub struct LabelledFamily {
    /// The name without `_total` (the encoder adds it).
    pub name: &'static str,
    pub help: &'static str,
    pub label: &'static str,
}

/// The federation families (README lists them, with `_total`).
pub mod fed {
    use super::LabelledFamily as Family;

    pub const BUNDLE_FETCHES: Family = Family {
        name: "sbp_federation_bundle_fetches",
        help: "Bundles fetched from peers by CID, by outcome",
        label: "outcome",
    };
    pub const BUNDLE_SERVES: Family = Family {
        name: "sbp_federation_bundle_serves",
        help: "Bundle requests by peers, by outcome",
        label: "outcome",
    };
    pub const HANDOVERS: Family = Family {
        name: "sbp_federation_handovers",
        help: "Session handovers between gateways, by side and outcome",
        label: "outcome",
    };
    pub const TOKEN_REJECTIONS: Family = Family {
        name: "sbp_federation_token_rejections",
        help: "Federation tokens refused, by reason",
        label: "reason",
    };
    pub const TRACKER_ANNOUNCES: Family = Family {
        name: "sbp_tracker_announces",
        help: "Registry announces received by this tracker, by outcome",
        label: "outcome",
    };
    pub const TRACKER_LOOKUPS: Family = Family {
        name: "sbp_tracker_lookups",
        help: "Registry lookups answered by this tracker, by outcome",
        label: "outcome",
    };
    pub const TRACKER_QUERIES: Family = Family {
        name: "sbp_federation_tracker_queries",
        help: "Announces and lookups this gateway made at trackers, by outcome",
        label: "outcome",
    };

    pub const ALL: [Family; 7] = [
        BUNDLE_FETCHES,
        BUNDLE_SERVES,
        HANDOVERS,
        TOKEN_REJECTIONS,
        TRACKER_ANNOUNCES,
        TRACKER_LOOKUPS,
        TRACKER_QUERIES,
    ];
}

impl Labelled {
    fn register(reg: &mut Registry) -> Self {
        let families = fed::ALL
            .iter()
            .map(|f| {
                let family = Family::default();
                reg.register(f.name, f.help, family.clone());
                (f.name, family)
            })
            .collect();
        Self { families }
    }

    pub fn count(&self, family: LabelledFamily, value: &'static str) {
        if let Some((_, f)) = self.families.iter().find(|(n, _)| *n == family.name) {
            f.get_or_create(&[(family.label, value)]).inc();
        }
    }
}

/// Figures read from storage and the hub at scrape time.
pub struct LiveGauges {
    pub sessions_by_status: Vec<(&'static str, u64)>,
    pub tether_depth: u64,
    pub attached_surfaces: u64,
    /// (sessions, bytes) the history cache holds.
    pub history_cache: (usize, usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &Metrics) -> String {
        m.render(&LiveGauges {
            sessions_by_status: vec![("idle", 2)],
            tether_depth: 5,
            attached_surfaces: 1,
            history_cache: (3, 4096),
        })
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.tool_call_latency.observe(0.0007);
        m.tool_call_latency.observe(0.03);
        let text = text(&m);
        assert!(text.contains("sbp_tool_call_latency_seconds_bucket{le=\"0.0005\"} 0"));
        assert!(text.contains("sbp_tool_call_latency_seconds_bucket{le=\"0.001\"} 1"));
        assert!(text.contains("sbp_tool_call_latency_seconds_bucket{le=\"0.05\"} 2"));
        assert!(text.contains("sbp_tool_call_latency_seconds_count 2"));
        assert!(text.contains("sbp_sessions{status=\"idle\"} 2"));
        assert!(text.contains("sbp_tether_depth 5"));
    }

    #[test]
    fn counters_keep_their_names_and_closed_sets_start_at_zero() {
        let m = Metrics::default();
        m.turns_completed.inc();
        m.count_rate_limited(Limit::Session);
        m.federation.count(fed::HANDOVERS, "committed");
        let text = text(&m);
        for line in [
            "sbp_turns_total 1",
            "sbp_rate_limited_total{limit=\"session\"} 1",
            "sbp_rate_limited_total{limit=\"address\"} 0",
            "sbp_retention_swept_total{kind=\"jti\"} 0",
            "sbp_tool_call_outcomes_total{target=\"surface\",outcome=\"timeout\"} 0",
            "sbp_federation_handovers_total{outcome=\"committed\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        assert!(
            text.contains("sbp_build_info{version=\""),
            "build info:\n{text}"
        );
    }

    #[test]
    fn two_gateways_keep_separate_figures() {
        let (a, b) = (Metrics::default(), Metrics::default());
        a.sessions_created.inc();
        assert!(text(&a).contains("sbp_sessions_created_total 1"));
        assert!(text(&b).contains("sbp_sessions_created_total 0"));
    }
}
