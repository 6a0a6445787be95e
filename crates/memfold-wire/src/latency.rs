//! Latencies of live operations (share, CoW break, fault service, reclaim), for the live
//! analog of DE Table 2.
//!
//! The agent times each operation it carries out with an HDR histogram of nanoseconds and
//! reports it to memfoldd as (value, count) pairs; memfoldd merges the reports of all
//! agents, so percentiles over all guests are exact to the histogram's precision.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Largest latency kept exactly: 60 s in ns (longer ones are clamped).
const MAX_NS: u64 = 60_000_000_000;

/// The upper bounds of the latency buckets memfoldd exports (`le`, seconds; `+Inf` is
/// implied): 1 µs to 1 s in 1–2.5–5 steps, so that a µs-scale fault service and a
/// ms-scale patch encode or swap read both fall inside the range.
pub const LATENCY_BUCKETS_S: [f64; 19] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0,
];

/// One operation's latencies in the exported buckets ([`LATENCY_BUCKETS_S`]): what a
/// Prometheus histogram needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpBuckets {
    /// The operation (`share`, `cow_break`, ... as in [`crate::OpLatencies::OPS`]).
    pub op: String,
    /// Operations timed.
    pub count: u64,
    /// All of them together, seconds (mean × count, to the histogram's precision).
    pub sum_s: f64,
    /// Operations that took at most [`LATENCY_BUCKETS_S`]`[i]`, cumulative (the HDR
    /// histogram's 2 significant digits: a value within 1% above a bound may count in it).
    pub le: Vec<u64>,
}

/// A latency histogram in nanoseconds, 2 significant digits.
#[derive(Clone, Debug)]
pub struct OpLatency {
    hist: Histogram<u64>,
}

impl Default for OpLatency {
    fn default() -> OpLatency {
        OpLatency {
            hist: Histogram::new_with_bounds(1, MAX_NS, 2).expect("valid bounds"),
        }
    }
}

/// Percentiles of one operation, µs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Operations timed.
    pub count: u64,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Longest, µs.
    pub max_us: f64,
    /// All operations together, µs (mean × count, to the histogram's precision): for a
    /// fault, the time the faulting thread waited on the agent's service of it.
    #[serde(default)]
    pub total_us: f64,
}

impl OpLatency {
    /// Records `n` operations that took `each` on average.
    pub fn record(&mut self, each: Duration, n: u64) {
        let ns = (each.as_nanos() as u64).clamp(1, MAX_NS);
        let _ = self.hist.record_n(ns, n);
    }

    /// Records `n` operations done together in `total` (each: `total / n`); none if `n`
    /// is 0.
    pub fn record_batch(&mut self, total: Duration, n: usize) {
        if n > 0 {
            self.record(total / n as u32, n as u64);
        }
    }

    /// The histogram as (ns, count) pairs, for the wire.
    pub fn to_pairs(&self) -> Vec<(u64, u64)> {
        self.hist
            .iter_recorded()
            .map(|v| (v.value_iterated_to(), v.count_at_value()))
            .collect()
    }

    /// A histogram from (ns, count) pairs.
    pub fn from_pairs(pairs: &[(u64, u64)]) -> OpLatency {
        let mut l = OpLatency::default();
        for &(ns, n) in pairs {
            let _ = l.hist.record_n(ns.clamp(1, MAX_NS), n);
        }
        l
    }

    /// Adds another histogram's operations.
    pub fn merge(&mut self, other: &OpLatency) {
        let _ = self.hist.add(&other.hist);
    }

    /// The histogram in the exported buckets ([`LATENCY_BUCKETS_S`]), as operation `op`.
    pub fn buckets(&self, op: &str) -> OpBuckets {
        OpBuckets {
            op: op.to_string(),
            count: self.hist.len(),
            sum_s: self.hist.mean() * self.hist.len() as f64 / 1e9,
            le: LATENCY_BUCKETS_S
                .iter()
                .map(|&b| self.hist.count_between(0, (b * 1e9).round() as u64))
                .collect(),
        }
    }

    /// Count, p50, p99 and max in µs.
    pub fn summary(&self) -> LatencySummary {
        let us = |ns: u64| ns as f64 / 1000.0;
        LatencySummary {
            count: self.hist.len(),
            p50_us: us(self.hist.value_at_quantile(0.5)),
            p99_us: us(self.hist.value_at_quantile(0.99)),
            max_us: us(self.hist.max()),
            total_us: self.hist.mean() * self.hist.len() as f64 / 1000.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip_and_merge_keep_percentiles() {
        let mut a = OpLatency::default();
        for us in 1..=100u64 {
            a.record(Duration::from_micros(us), 1);
        }
        let b = OpLatency::from_pairs(&a.to_pairs());
        assert_eq!(a.summary(), b.summary());
        let s = a.summary();
        assert_eq!(s.count, 100);
        assert!((s.p50_us - 50.0).abs() < 1.0, "{s:?}");
        assert!((s.p99_us - 99.0).abs() < 1.5, "{s:?}");
        // 1 + 2 + … + 100 µs, to 2 significant digits per value.
        assert!((s.total_us - 5050.0).abs() < 5050.0 * 0.01, "{s:?}");
        let mut m = b.clone();
        m.record(Duration::from_millis(10), 100);
        m.merge(&a);
        assert_eq!(m.summary().count, 300);
        assert!(m.summary().p99_us > 9000.0);
    }

    #[test]
    fn buckets_are_cumulative_at_their_bounds_in_seconds() {
        let mut a = OpLatency::default();
        a.record(Duration::from_micros(3), 10); // ≤ 5 µs
        a.record(Duration::from_micros(40), 5); // ≤ 50 µs
        a.record(Duration::from_millis(2), 1); // ≤ 2.5 ms
        a.record(Duration::from_secs(3), 1); // only +Inf
        let b = a.buckets("share");
        assert_eq!(b.op, "share");
        assert_eq!(b.count, 17);
        assert_eq!(b.le.len(), LATENCY_BUCKETS_S.len());
        let at = |s: f64| b.le[LATENCY_BUCKETS_S.iter().position(|&x| x == s).unwrap()];
        assert_eq!(at(2.5e-6), 0);
        assert_eq!(at(5e-6), 10);
        assert_eq!(at(2.5e-5), 10);
        assert_eq!(at(5e-5), 15);
        assert_eq!(at(1e-3), 15);
        assert_eq!(at(2.5e-3), 16);
        assert_eq!(at(1.0), 16);
        assert!(b.le.windows(2).all(|w| w[0] <= w[1]));
        let want = 10.0 * 3e-6 + 5.0 * 40e-6 + 2e-3 + 3.0;
        assert!((b.sum_s - want).abs() < want * 0.01, "{b:?}");
    }
}
