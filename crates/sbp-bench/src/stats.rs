//! Latency histograms (HdrHistogram, microseconds) and their summaries; exact percentiles of a few
//! samples.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Latencies in microseconds, 1 µs to 10 min, 3 significant digits.
pub struct Latencies(Histogram<u64>);

impl Latencies {
    pub fn new() -> Self {
        // The bounds are constants that satisfy Histogram's preconditions (low >= 1,
        // high >= 2 * low, sigfig <= 5), so this cannot fail.
        match Histogram::new_with_bounds(1, 600_000_000, 3) {
            Ok(h) => Self(h),
            Err(_) => unreachable!("constant histogram bounds are valid"),
        }
    }

    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        self.0.saturating_record(us);
    }

    pub fn merge(&mut self, other: &Self) {
        // Both were made by `new` with the same bounds, so adding cannot fail; should it
        // anyway, the other histogram's values are dropped rather than the run.
        let _ = self.0.add(&other.0);
    }

    pub fn summary(&self) -> Summary {
        let h = &self.0;
        let ms = |us: u64| us as f64 / 1000.0;
        if h.is_empty() {
            return Summary::default();
        }
        Summary {
            count: h.len(),
            mean_ms: h.mean().round() / 1000.0,
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
        }
    }
}

impl Default for Latencies {
    fn default() -> Self {
        Self::new()
    }
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Summary {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  max {:.3} ms  (n={})",
            self.p50_ms, self.p90_ms, self.p99_ms, self.p999_ms, self.max_ms, self.count
        )
    }
}

/// Exact (nearest-rank) percentiles of a few samples, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Exact {
    pub count: usize,
    pub min_ms: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub max_ms: f64,
}

impl Exact {
    pub fn of(samples_ms: &[f64]) -> Self {
        let mut v = samples_ms.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Self::default();
        }
        // Nearest rank: the smallest sample with at least q of the samples at or below it.
        let rank = |q: f64| v[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        Self {
            count: n,
            min_ms: v[0],
            mean_ms: round(v.iter().sum::<f64>() / n as f64),
            p50_ms: rank(0.50),
            p95_ms: rank(0.95),
            max_ms: v[n - 1],
        }
    }
}

impl std::fmt::Display for Exact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.1} ms  p95 {:.1} ms  max {:.1} ms  (min {:.1}, mean {:.1}, n={})",
            self.p50_ms, self.p95_ms, self.max_ms, self.min_ms, self.mean_ms, self.count
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_in_milliseconds() {
        let mut l = Latencies::new();
        for us in 1..=1000u64 {
            l.record(Duration::from_micros(us * 10));
        }
        let s = l.summary();
        assert_eq!(s.count, 1000);
        assert!((s.p50_ms - 5.0).abs() < 0.01, "{s:?}");
        assert!((s.p99_ms - 9.9).abs() < 0.02, "{s:?}");
        assert!((s.max_ms - 10.0).abs() < 0.02, "{s:?}");
    }

    #[test]
    fn exact_percentiles_are_nearest_rank() {
        let samples: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        let e = Exact::of(&samples);
        assert_eq!(e.count, 20);
        assert_eq!(e.p50_ms, 10.0);
        assert_eq!(e.p95_ms, 19.0);
        assert_eq!(e.max_ms, 20.0);
        assert_eq!(e.min_ms, 1.0);
        assert_eq!(e.mean_ms, 10.5);
        assert_eq!(Exact::of(&[7.0]).p95_ms, 7.0);
        assert_eq!(Exact::of(&[]).count, 0);
    }
}
