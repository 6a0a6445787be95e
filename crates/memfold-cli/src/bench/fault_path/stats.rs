//! Latency summaries (nearest-rank quantiles, µs) and spreads across rounds.

use serde::Serialize;

/// Latencies summarised: µs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Samples.
    pub n: usize,
    /// Median, µs (nearest rank).
    pub p50_us: f64,
    /// 99th percentile, µs (nearest rank).
    pub p99_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
}

/// The nearest-rank `p`-quantile (0 < p ≤ 1) of sorted samples; 0 for none.
fn quantile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises latencies given in ns; all zeros for none.
pub fn summarize(ns: &[u64]) -> Summary {
    let mut s = ns.to_vec();
    s.sort_unstable();
    let mean = if s.is_empty() {
        0.0
    } else {
        s.iter().map(|&x| x as f64).sum::<f64>() / s.len() as f64
    };
    Summary {
        n: s.len(),
        p50_us: quantile(&s, 0.50) as f64 / 1e3,
        p99_us: quantile(&s, 0.99) as f64 / 1e3,
        mean_us: mean / 1e3,
    }
}

/// The spread of one figure across rounds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 for fewer than two values).
    pub sd: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

/// The spread of `xs`; all zeros for none.
pub fn spread(xs: &[f64]) -> Spread {
    if xs.is_empty() {
        return Spread {
            mean: 0.0,
            sd: 0.0,
            min: 0.0,
            max: 0.0,
        };
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let sd = if xs.len() < 2 {
        0.0
    } else {
        (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    };
    Spread {
        mean,
        sd,
        min: xs.iter().copied().fold(f64::INFINITY, f64::min),
        max: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_use_nearest_rank() {
        let ns: Vec<u64> = (1..=100).rev().map(|x| x * 1000).collect();
        let s = summarize(&ns);
        assert_eq!(s.n, 100);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p99_us, 99.0);
        assert!((s.mean_us - 50.5).abs() < 1e-9);
        assert_eq!(summarize(&[7000]).p99_us, 7.0);
        assert_eq!(summarize(&[]).n, 0);
        assert_eq!(summarize(&[1000, 3000]).p50_us, 1.0);
    }

    #[test]
    fn spreads_give_sample_sd_and_range() {
        let s = spread(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert!((s.mean - 5.0).abs() < 1e-12);
        assert!((s.sd - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!((s.min, s.max), (2.0, 9.0));
        assert_eq!(spread(&[3.0]).sd, 0.0);
        assert_eq!(spread(&[]).mean, 0.0);
    }
}
