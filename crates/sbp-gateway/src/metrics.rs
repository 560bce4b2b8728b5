//! Prometheus metrics kept in atomics owned by one gateway (no process-global recorder, so several
//! gateways in one test process keep separate figures). Gauges that live in storage (sessions by
//! status, tether depth) are read when `/metrics` is scraped.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::ratelimit::Limit;

const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.counts[i].fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, bound) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                self.counts[i].load(Relaxed)
            );
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub sessions_created: AtomicU64,
    pub turns_completed: AtomicU64,
    pub turns_failed: AtomicU64,
    pub turns_pushed: AtomicU64,
    pub tether_enqueued: AtomicU64,
    pub tether_delivered: AtomicU64,
    pub ws_connections: AtomicU64,
    /// Surfaces dropped for not reading (write timeout or outbound budget).
    pub ws_slow_consumers: AtomicU64,
    /// Connections closed for sending frames faster than their limit.
    pub ws_frame_floods: AtomicU64,
    pub exports: AtomicU64,
    pub imports: AtomicU64,
    pub handoffs: AtomicU64,
    pub forks: AtomicU64,
    /// Surface tool calls sent (TOOL_CALL frames), and how they ended.
    pub tool_calls: AtomicU64,
    pub tool_call_errors: AtomicU64,
    pub tool_call_timeouts: AtomicU64,
    /// Tools of southbound MCP servers called by the gateway.
    pub server_tool_calls: AtomicU64,
    /// Retention sweeps run, and what they removed.
    pub retention_sweeps: AtomicU64,
    pub retention_exports: AtomicU64,
    pub retention_bundles: AtomicU64,
    pub retention_snapshots: AtomicU64,
    /// Federation rows swept past their own expiry: replay-cache tokens, registry records,
    /// announcements.
    pub retention_jti: AtomicU64,
    pub retention_registry_records: AtomicU64,
    pub retention_announcements: AtomicU64,
    pub upstream_latency: Histogram,
    /// TOOL_CALL sent to TOOL_RESULT received (or timeout / disconnect).
    pub tool_call_latency: Histogram,
    /// Connections over a connection cap: served `/healthz` only, or closed at once.
    pub connections_shed: AtomicU64,
    /// Connections closed by the edge: no request head in time, idle too long, or evicted.
    pub connections_timed_out: AtomicU64,
    /// Requests refused by a rate limit, by limit (`ratelimit::Limit` order).
    pub rate_limited: [AtomicU64; 4],
    /// Federation (L6) counters with labels: bundle fetches and serves, handovers, token
    /// rejections, tracker announces and lookups.
    pub federation: Labelled,
}

/// Counters with one label each, for families whose label values are a small closed set (the
/// engine passes `&'static str`s, so a peer cannot grow the set).
#[derive(Debug, Default)]
pub struct Labelled {
    /// (family name, help, label name, label value) → count.
    counts: std::sync::Mutex<Counts>,
}

type Counts =
    std::collections::BTreeMap<(&'static str, &'static str, &'static str, &'static str), u64>;

/// A labelled counter family: its name, help and label name.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub label: &'static str,
}

/// The federation families (README lists them).
pub mod fed {
    use super::Family;

    pub const BUNDLE_FETCHES: Family = Family {
        name: "sbp_federation_bundle_fetches_total",
        help: "Bundles fetched from peers by CID, by outcome.",
        label: "outcome",
    };
    pub const BUNDLE_SERVES: Family = Family {
        name: "sbp_federation_bundle_serves_total",
        help: "Bundle requests by peers, by outcome.",
        label: "outcome",
    };
    pub const HANDOVERS: Family = Family {
        name: "sbp_federation_handovers_total",
        help: "Session handovers between gateways, by side and outcome.",
        label: "outcome",
    };
    pub const TOKEN_REJECTIONS: Family = Family {
        name: "sbp_federation_token_rejections_total",
        help: "Federation tokens refused, by reason.",
        label: "reason",
    };
    pub const TRACKER_ANNOUNCES: Family = Family {
        name: "sbp_tracker_announces_total",
        help: "Registry announces received by this tracker, by outcome.",
        label: "outcome",
    };
    pub const TRACKER_LOOKUPS: Family = Family {
        name: "sbp_tracker_lookups_total",
        help: "Registry lookups answered by this tracker, by outcome.",
        label: "outcome",
    };
    pub const TRACKER_QUERIES: Family = Family {
        name: "sbp_federation_tracker_queries_total",
        help: "Announces and lookups this gateway made at trackers, by outcome.",
        label: "outcome",
    };
}

impl Labelled {
    pub fn count(&self, family: Family, value: &'static str) {
        // A poisoned lock only means a panic elsewhere while counting: the map is still whole.
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        *counts
            .entry((family.name, family.help, family.label, value))
            .or_insert(0) += 1;
    }

    /// The value counted so far (tests).
    pub fn get(&self, family: Family, value: &str) -> u64 {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .iter()
            .find(|((n, _, _, v), _)| *n == family.name && *v == value)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    }

    fn render(&self, out: &mut String) {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let mut last = "";
        for ((name, help, label, value), n) in counts.iter() {
            if *name != last {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
                last = name;
            }
            let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {n}");
        }
    }
}

impl Metrics {
    pub fn count_rate_limited(&self, limit: Limit) {
        let i = match limit {
            Limit::Address => 0,
            Limit::Session => 1,
            Limit::OperatorKey => 2,
            Limit::AuthFailures => 3,
        };
        self.rate_limited[i].fetch_add(1, Relaxed);
    }
}

/// Figures read from storage and the hub at scrape time.
pub struct LiveGauges {
    pub sessions_by_status: Vec<(&'static str, u64)>,
    pub tether_depth: u64,
    pub attached_surfaces: u64,
}

fn counter(out: &mut String, name: &str, help: &str, v: &AtomicU64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
        v.load(Relaxed)
    );
}

impl Metrics {
    pub fn render(&self, live: &LiveGauges) -> String {
        let mut out = String::with_capacity(4096);
        let _ = writeln!(
            out,
            "# HELP sbp_sessions Sessions by status.\n# TYPE sbp_sessions gauge"
        );
        for (status, n) in &live.sessions_by_status {
            let _ = writeln!(out, "sbp_sessions{{status=\"{status}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP sbp_attached_surfaces Surfaces attached over WebSocket.\n# TYPE sbp_attached_surfaces gauge\nsbp_attached_surfaces {}",
            live.attached_surfaces
        );
        let _ = writeln!(
            out,
            "# HELP sbp_tether_depth Turns waiting in the Tether.\n# TYPE sbp_tether_depth gauge\nsbp_tether_depth {}",
            live.tether_depth
        );
        counter(
            &mut out,
            "sbp_sessions_created_total",
            "Sessions created.",
            &self.sessions_created,
        );
        counter(
            &mut out,
            "sbp_turns_total",
            "LLM turns completed and persisted.",
            &self.turns_completed,
        );
        counter(
            &mut out,
            "sbp_turns_failed_total",
            "LLM turns that failed upstream.",
            &self.turns_failed,
        );
        counter(
            &mut out,
            "sbp_turns_pushed_total",
            "Turns pushed by a backend.",
            &self.turns_pushed,
        );
        counter(
            &mut out,
            "sbp_tool_calls_total",
            "TOOL_CALL frames sent to surfaces.",
            &self.tool_calls,
        );
        counter(
            &mut out,
            "sbp_tool_call_errors_total",
            "Surface tool calls that ended in an error (including timeouts and disconnects).",
            &self.tool_call_errors,
        );
        counter(
            &mut out,
            "sbp_tool_call_timeouts_total",
            "Surface tool calls that timed out.",
            &self.tool_call_timeouts,
        );
        counter(
            &mut out,
            "sbp_server_tool_calls_total",
            "Tools of southbound MCP servers called by the gateway.",
            &self.server_tool_calls,
        );
        counter(
            &mut out,
            "sbp_tether_enqueued_total",
            "Turns written to the Tether.",
            &self.tether_enqueued,
        );
        counter(
            &mut out,
            "sbp_tether_delivered_total",
            "Tethered turns delivered to a surface.",
            &self.tether_delivered,
        );
        counter(
            &mut out,
            "sbp_ws_connections_total",
            "WebSocket connections accepted.",
            &self.ws_connections,
        );
        counter(
            &mut out,
            "sbp_ws_slow_consumers_total",
            "Surfaces dropped for not reading (write timeout or outbound byte budget).",
            &self.ws_slow_consumers,
        );
        counter(
            &mut out,
            "sbp_ws_frame_floods_total",
            "WebSocket connections closed (1008) for sending frames faster than allowed.",
            &self.ws_frame_floods,
        );
        counter(
            &mut out,
            "sbp_retention_sweeps_total",
            "Retention sweeps run.",
            &self.retention_sweeps,
        );
        let _ = writeln!(
            out,
            "# HELP sbp_retention_swept_total Rows removed by retention sweeps.\n# TYPE sbp_retention_swept_total counter"
        );
        for (kind, v) in [
            ("exports", &self.retention_exports),
            ("bundles", &self.retention_bundles),
            ("snapshots", &self.retention_snapshots),
            ("jti", &self.retention_jti),
            ("registry_records", &self.retention_registry_records),
            ("announcements", &self.retention_announcements),
        ] {
            let _ = writeln!(
                out,
                "sbp_retention_swept_total{{kind=\"{kind}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP sbp_rate_limited_total Requests refused by a rate limit.\n# TYPE sbp_rate_limited_total counter"
        );
        let limits = [
            Limit::Address,
            Limit::Session,
            Limit::OperatorKey,
            Limit::AuthFailures,
        ];
        for (limit, n) in limits.iter().zip(&self.rate_limited) {
            let _ = writeln!(
                out,
                "sbp_rate_limited_total{{limit=\"{}\"}} {}",
                limit.as_str(),
                n.load(Relaxed)
            );
        }
        for (name, help, v) in [
            (
                "sbp_exports_total",
                "Sessions exported to a roaming bundle.",
                &self.exports,
            ),
            (
                "sbp_imports_total",
                "Sessions imported from a token or bundle.",
                &self.imports,
            ),
            (
                "sbp_handoffs_total",
                "Sessions handed off to another agent.",
                &self.handoffs,
            ),
            ("sbp_forks_total", "Sessions forked.", &self.forks),
        ] {
            counter(&mut out, name, help, v);
        }
        counter(
            &mut out,
            "sbp_connections_shed_total",
            "Connections over a connection cap (served /healthz only, or closed at once).",
            &self.connections_shed,
        );
        counter(
            &mut out,
            "sbp_connections_timed_out_total",
            "Connections closed for sending no request head in time, idling too long, or to make room.",
            &self.connections_timed_out,
        );
        self.federation.render(&mut out);
        self.upstream_latency.render(
            &mut out,
            "sbp_upstream_latency_seconds",
            "Time from sending a request upstream to its complete reply.",
        );
        self.tool_call_latency.render(
            &mut out,
            "sbp_tool_call_latency_seconds",
            "Time from sending a TOOL_CALL to its TOOL_RESULT (or timeout or disconnect).",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.upstream_latency.observe(Duration::from_micros(700));
        m.upstream_latency.observe(Duration::from_millis(30));
        let text = m.render(&LiveGauges {
            sessions_by_status: vec![("idle", 2)],
            tether_depth: 5,
            attached_surfaces: 1,
        });
        assert!(text.contains("sbp_upstream_latency_seconds_bucket{le=\"0.0005\"} 0"));
        assert!(text.contains("sbp_upstream_latency_seconds_bucket{le=\"0.001\"} 1"));
        assert!(text.contains("sbp_upstream_latency_seconds_bucket{le=\"0.05\"} 2"));
        assert!(text.contains("sbp_upstream_latency_seconds_count 2"));
        assert!(text.contains("sbp_sessions{status=\"idle\"} 2"));
        assert!(text.contains("sbp_tether_depth 5"));
    }
}
