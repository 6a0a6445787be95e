use super::*;
use crate::latency::OpLatency;
use crate::stats::{OpLatencies, SavedBy, SwapStats};
use std::collections::BTreeSet;
use std::time::Duration;

pub(super) fn sample() -> Stats {
    let mut share = OpLatency::default();
    share.record(Duration::from_micros(3), 10);
    share.record(Duration::from_millis(2), 1);
    Stats {
        cpu_s: 2.25,
        saved_by: SavedBy {
            sharing: 100,
            zero: 5,
            free: 4,
            patching: 3,
            compression: 2,
            swap: 1,
            store_waste: 1,
            zswap: 6,
        },
        swap: SwapStats {
            budget_pages: Some(1000),
            host_used_pages: 900,
            ..Default::default()
        },
        latency_buckets: OpLatencies::OPS
            .iter()
            .map(|op| {
                if *op == "share" {
                    share.buckets(op)
                } else {
                    OpLatency::default().buckets(op)
                }
            })
            .collect(),
        vms: vec![
            VmStats {
                name: "web".into(),
                pid: 4242,
                pages: 256,
                host_bytes: 1 << 20,
                shared_pages: 40,
                cow_breaks: 3,
                wp_faults: 7,
                agent_cpu_s: 1.5,
                qemu_mappings: 5_200,
                qemu_vma_budget: 61_434,
                nru_pages: [1, 2, 3, 4],
                entitlement_pages: 30.5,
                balloon_target_bytes: Some(3 << 20),
                balloon_actual_bytes: Some(2 << 20),
                ..Default::default()
            },
            VmStats {
                name: "db \"x\"".into(),
                pid: 7,
                ..Default::default()
            },
        ],
        ..Default::default()
    }
}

/// The names of the samples in `text` (before `{` or the value).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

#[test]
fn exposition_names_labels_and_units() {
    let text = sample().exposition();
    assert!(
        text.contains("memfold_qemu_mappings{vm=\"web\",pid=\"4242\",kind=\"counted\"} 5200.0\n")
            && text.contains(
                "memfold_qemu_mappings{vm=\"web\",pid=\"4242\",kind=\"budget\"} 61434.0\n"
            ),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.contains("# TYPE memfold_host_memory_bytes gauge\n"),
        "{text}"
    );
    assert!(
        text.contains("# UNIT memfold_host_memory_bytes bytes\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_host_memory_bytes{vm=\"web\",pid=\"4242\"} 1048576.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_guest_memory_bytes{vm=\"web\",pid=\"4242\"} 1048576.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_saved_bytes{mechanism=\"share\"} 409600.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_saved_bytes{mechanism=\"swap\"} 4096.0\n")
            && text.contains("memfold_saved_bytes{mechanism=\"zswap\"} 24576.0\n")
            && text.contains("memfold_saved_bytes{mechanism=\"free\"} 16384.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_pages{vm=\"web\",pid=\"4242\",state=\"shared\"} 40.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_entitlement_bytes{vm=\"web\",pid=\"4242\"} 124928.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_balloon_bytes{vm=\"web\",pid=\"4242\",kind=\"target\"} 3145728.0\n")
            && text.contains(
                "memfold_balloon_bytes{vm=\"web\",pid=\"4242\",kind=\"actual\"} 2097152.0\n"
            ),
        "{text}"
    );
    assert!(
        text.contains("# TYPE memfold_cow_breaks counter\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_cow_breaks_total{vm=\"web\",pid=\"4242\"} 3\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_agent_cpu_seconds_total{vm=\"web\",pid=\"4242\"} 1.5\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_cpu_seconds_total{process=\"memfoldd\"} 2.25\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_faults_total{vm=\"web\",pid=\"4242\",kind=\"write_protect\"} 7\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_nru_pages{vm=\"web\",pid=\"4242\",class=\"C4\"} 4.0\n"),
        "{text}"
    );
    assert!(
        text.contains("memfold_host_budget_bytes{} 4096000.0\n"),
        "{text}"
    );
    // A label value is escaped, not cut.
    assert!(
        text.contains("memfold_cow_breaks_total{vm=\"db \\\"x\\\"\",pid=\"7\"} 0\n"),
        "{text}"
    );
    // Every family named in METRICS is written, and nothing else.
    let names = sample_names(&text);
    for m in METRICS {
        let found = if m.ends_with("_seconds") && m.contains("latency") {
            names.contains(&format!("{m}_bucket"))
        } else {
            names.contains(m)
        };
        assert!(found, "{m} missing from {names:?}");
    }
    let strip = |n: &str| {
        let n = n
            .strip_suffix("_bucket")
            .or(n.strip_suffix("_sum"))
            .or(n.strip_suffix("_count"));
        n.map(str::to_string)
    };
    for n in &names {
        let base = if n.starts_with("memfold_operation_latency_seconds") {
            strip(n).unwrap()
        } else {
            n.clone()
        };
        assert!(METRICS.contains(&base.as_str()), "{n} is not in METRICS");
    }
}

#[test]
fn latency_histograms_are_seconds_with_monotone_buckets() {
    let text = sample().exposition();
    assert!(
        text.contains("# TYPE memfold_operation_latency_seconds histogram\n"),
        "{text}"
    );
    let label = |l: &str, k: &str| -> Option<String> {
        let start = l.find(&format!("{k}=\""))? + k.len() + 2;
        Some(l[start..].split('"').next()?.to_string())
    };
    for op in OpLatencies::OPS {
        let mut last = 0u64;
        let mut les = Vec::new();
        for l in text.lines().filter(|l| {
            l.starts_with("memfold_operation_latency_seconds_bucket{")
                && label(l, "op").as_deref() == Some(op)
        }) {
            let le = label(l, "le").unwrap();
            let n: u64 = l.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(n >= last, "{op}: bucket {le} has {n} < {last}");
            last = n;
            les.push(le);
        }
        // The bounds are ours, in seconds, rising, then +Inf.
        assert_eq!(les.len(), LATENCY_BUCKETS_S.len() + 1, "{op}: {les:?}");
        assert_eq!(les.last().unwrap(), "+Inf");
        for (le, want) in les.iter().zip(LATENCY_BUCKETS_S) {
            assert_eq!(le.parse::<f64>().unwrap(), want, "{op}: {les:?}");
        }
        let count = text
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "memfold_operation_latency_seconds_count{{op=\"{op}\"}}"
                ))
            })
            .unwrap();
        assert!(
            count.ends_with(&format!(" {last}")),
            "{op}: +Inf {last} vs {count}"
        );
    }
    // share: 10 at 3 µs, 1 at 2 ms; the sum in seconds.
    let bucket = |le: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("memfold_operation_latency_seconds_bucket{")
                    && label(l, "op").as_deref() == Some("share")
                    && label(l, "le").as_deref() == Some(le)
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    assert_eq!(bucket("0.0000025"), Some(0), "{text}");
    assert_eq!(bucket("0.000005"), Some(10), "{text}");
    assert_eq!(bucket("0.001"), Some(10), "{text}");
    assert_eq!(bucket("0.0025"), Some(11), "{text}");
    let sum: f64 = text
        .lines()
        .find(|l| l.starts_with("memfold_operation_latency_seconds_sum{op=\"share\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!((sum - 0.00203).abs() < 0.00003, "{sum}");
}

/// Two tenants' guests may have one name (names are unique within a QEMU only): each is a
/// series of its own, told apart by its QEMU's pid, in both formats. Fails with `vm`
/// alone (two samples of one label set: Prometheus keeps one).
#[test]
fn guests_of_one_name_in_two_qemus_are_two_series() {
    let mut s = sample();
    s.vms[1].name = "web".into();
    for text in [s.exposition(), prometheus_text(&s.exposition())] {
        let series: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.rsplit_once(' ').unwrap().0)
            .collect();
        let distinct: BTreeSet<&str> = series.iter().copied().collect();
        assert_eq!(distinct.len(), series.len(), "a series twice in {text}");
        assert!(text.contains("memfold_cow_breaks_total{vm=\"web\",pid=\"4242\"} 3\n"));
        assert!(text.contains("memfold_cow_breaks_total{vm=\"web\",pid=\"7\"} 0\n"));
    }
}

/// Counters an agent reports are summed without overflow: a `nocopy_breaks` of
/// `u64::MAX` beside another count gives `u64::MAX`, not a wrapped sum (or a panic with
/// overflow checks); a free count above the zero count gives 0 zero pages. Fails with
/// the plain sum and difference.
#[test]
fn sums_of_reported_counters_saturate() {
    let mut s = sample();
    s.vms[0].nocopy_breaks = u64::MAX;
    s.vms[0].cow_copies_avoided = 1;
    s.vms[0].free_reclaimed_pages = 5;
    s.vms[0].zero_reclaimed_pages = 2;
    let text = std::panic::catch_unwind(|| s.exposition()).expect("no overflow");
    let want = format!(
        "memfold_operations_total{{vm=\"web\",pid=\"4242\",op=\"cow_copy_avoided\"}} {}\n",
        u64::MAX
    );
    assert!(text.contains(&want), "{text}");
    assert!(
        text.contains("memfold_pages{vm=\"web\",pid=\"4242\",state=\"zero\"} 0.0\n"),
        "{text}"
    );
}
