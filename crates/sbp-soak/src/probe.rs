//! What the soak watches while it attacks: `/healthz` latency, each probe on a fresh connection
//! (a kept-alive one would hide a gateway that no longer accepts), and the gateway's resident
//! memory from /proc.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::procs::mem;
use crate::raw::{self, Outcome};

/// How long one probe may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Default)]
pub struct HealthStats {
    pub probes: usize,
    pub failures: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// The first few failures, described.
    pub failure_examples: Vec<String>,
}

impl HealthStats {
    pub fn line(&self) -> String {
        format!(
            "healthz {} probes, {} failed, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            self.probes, self.failures, self.p50_ms, self.p99_ms, self.max_ms
        )
    }
}

/// One `GET /healthz` on a new connection: its latency, or why it failed.
pub async fn healthz_once(addr: SocketAddr) -> Result<Duration, String> {
    let start = Instant::now();
    let req = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    match raw::exchange(addr, req.into_bytes(), false, false, PROBE_TIMEOUT).await {
        Outcome::Answered(r) if r.status == 200 => Ok(start.elapsed()),
        Outcome::Answered(r) => Err(format!("answered {}", r.describe())),
        Outcome::Closed(why) => Err(format!("closed: {why}")),
        Outcome::Broken(why) => Err(format!("broken: {why}")),
        Outcome::Hang => Err(format!("no answer within {} s", PROBE_TIMEOUT.as_secs())),
    }
}

/// Probes `/healthz` every `interval` (one probe at a time) until finished.
pub struct HealthProbe {
    samples: Arc<Mutex<Vec<Result<Duration, String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HealthProbe {
    pub fn start(addr: SocketAddr, interval: Duration) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let s = samples.clone();
        let task = tokio::spawn(async move {
            loop {
                let next = Instant::now() + interval;
                let r = healthz_once(addr).await;
                if let Ok(mut v) = s.lock() {
                    v.push(r);
                }
                tokio::time::sleep_until(next).await;
            }
        });
        Self { samples, task }
    }

    pub fn finish(self) -> HealthStats {
        self.task.abort();
        let samples = self.samples.lock().map(|v| v.clone()).unwrap_or_default();
        let mut lat: Vec<f64> = Vec::with_capacity(samples.len());
        let mut stats = HealthStats {
            probes: samples.len(),
            ..HealthStats::default()
        };
        for s in samples {
            match s {
                Ok(d) => lat.push(d.as_secs_f64() * 1000.0),
                Err(e) => {
                    stats.failures += 1;
                    // A failed probe counts at the timeout in the percentiles.
                    lat.push(PROBE_TIMEOUT.as_secs_f64() * 1000.0);
                    if stats.failure_examples.len() < 3 {
                        stats.failure_examples.push(e);
                    }
                }
            }
        }
        lat.sort_by(f64::total_cmp);
        stats.p50_ms = percentile(&lat, 0.50);
        stats.p99_ms = percentile(&lat, 0.99);
        stats.max_ms = lat.last().copied().unwrap_or(0.0);
        stats
    }
}

/// The value at quantile `q` of sorted values (nearest rank); 0 when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Samples a process's VmRSS every 100 ms and keeps the largest value seen.
pub struct RssSampler {
    pid: u32,
    peak: Arc<Mutex<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    pub fn start(pid: u32) -> Self {
        let peak = Arc::new(Mutex::new(0));
        let p = peak.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let Some(m) = mem(pid) else { return };
                if let Ok(mut v) = p.lock() {
                    *v = (*v).max(m.rss_kib);
                }
            }
        });
        Self { pid, peak, task }
    }

    /// `(largest VmRSS sampled, VmHWM now)`, in MiB.
    pub fn finish(self) -> (f64, f64) {
        self.task.abort();
        let peak = self.peak.lock().map(|v| *v).unwrap_or(0);
        let hwm = mem(self.pid).map_or(0, |m| m.hwm_kib);
        (peak as f64 / 1024.0, hwm as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
