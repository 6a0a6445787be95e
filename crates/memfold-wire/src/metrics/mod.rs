//! memfoldd's statistics as a Prometheus exposition (the OpenMetrics text format, built
//! with the `prometheus-client` crate): one snapshot ([`Stats`]) in, the text a scrape of
//! `GET /metrics` returns out.
//!
//! Names and units follow Prometheus' conventions: the base unit in the name (`_bytes`,
//! `_seconds`), counters end in `_total`, a dimension is a label rather than a name.
//! Pages are converted to bytes (4 KiB each). Labels: `vm` (the guest's name as its
//! agent gave it) with `pid` (its QEMU's: a name is unique only within one QEMU, so two
//! tenants' guests named alike are two series), `mechanism` (`share`, `zero`, `patch`, `compress`, `swap`), `state`,
//! `kind`, `class`, `op`, `backing`. The full list, with each metric's meaning, is in
//! docs/operations.md; [`METRICS`] names every family this module writes.
//!
//! The savings by mechanism carry no `vm` label: a shared frame saves memory for every
//! guest that maps it, so the sharing saving belongs to a sharing domain, not a guest.
//! Per guest, `memfold_pages{vm,state}` says how many of its pages each mechanism holds.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::latency::LATENCY_BUCKETS_S;
use crate::stats::{Stats, VmStats};

mod classic;
pub use classic::{prometheus_text, CONTENT_TYPE_TEXT};

/// Bytes in a page.
const PAGE: f64 = 4096.0;

/// The HTTP `Content-Type` of [`Stats::exposition`] (OpenMetrics, what Prometheus asks
/// for first).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every metric family the exposition writes, as a scrape shows its samples' names
/// (counters with `_total`, histograms with `_bucket`/`_sum`/`_count` added to the name
/// given here).
pub const METRICS: [&str; 35] = [
    "memfold_uptime_seconds",
    "memfold_guests",
    "memfold_domains",
    "memfold_host_memory_bytes",
    "memfold_guest_memory_bytes",
    "memfold_pages",
    "memfold_saved_bytes",
    "memfold_store_waste_bytes",
    "memfold_backing_bytes",
    "memfold_backing_booked_bytes",
    "memfold_pool_frames",
    "memfold_reference_frames",
    "memfold_share_table_entries",
    "memfold_host_budget_bytes",
    "memfold_host_used_bytes",
    "memfold_swap_capacity_bytes",
    "memfold_swap_full_total",
    "memfold_blob_write_errors_total",
    "memfold_full_scans_total",
    "memfold_cow_breaks_total",
    "memfold_faults_total",
    "memfold_operations_total",
    "memfold_requests_changed_total",
    "memfold_requests_refused_total",
    "memfold_scanned_pages_total",
    "memfold_nru_pages",
    "memfold_clock_passes_total",
    "memfold_vm_detached",
    "memfold_vm_opted_out",
    "memfold_qemu_mappings",
    "memfold_entitlement_bytes",
    "memfold_balloon_bytes",
    "memfold_cpu_seconds_total",
    "memfold_agent_cpu_seconds_total",
    "memfold_operation_latency_seconds",
];

/// One sample's value.
#[derive(Clone, Copy, Debug)]
enum Value {
    /// A gauge.
    Gauge(f64),
    /// A counter.
    Counter(u64),
    /// A counter of seconds.
    Seconds(f64),
}

/// A label set: (name, value) pairs.
type Labels = Vec<(&'static str, String)>;

/// Stats as a collector: what the registry encodes on a scrape.
#[derive(Debug)]
struct Snapshot(Stats);

/// Writes one family: its descriptor (name without the unit and `_total` suffixes, which
/// the encoder adds), then a sample per row.
fn family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    rows: Vec<(Labels, Value)>,
) -> Result<(), std::fmt::Error> {
    let Some((_, first)) = rows.first() else {
        return Ok(());
    };
    let ty = match first {
        Value::Gauge(_) => MetricType::Gauge,
        Value::Counter(_) | Value::Seconds(_) => MetricType::Counter,
    };
    let mut d = enc.encode_descriptor(name, help, unit.as_ref(), ty)?;
    for (labels, v) in rows {
        let m = d.encode_family(&labels)?;
        match v {
            Value::Gauge(g) => ConstGauge::new(g).encode(m)?,
            Value::Counter(c) => ConstCounter::new(c).encode(m)?,
            Value::Seconds(c) => ConstCounter::new(c).encode(m)?,
        }
    }
    Ok(())
}

/// `v` escaped as a label value (`\\`, `\"`, `\n`): the encoder writes label values as
/// they are, and a guest's name is whatever its agent said.
fn label_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A guest's labels: its name and its QEMU's pid (names are unique only within a QEMU).
fn vm_labels(v: &VmStats) -> Labels {
    vec![("vm", label_value(&v.name)), ("pid", v.pid.to_string())]
}

/// One row per guest of `f`'s value.
fn per_vm(vms: &[VmStats], f: impl Fn(&VmStats) -> Value) -> Vec<(Labels, Value)> {
    vms.iter().map(|v| (vm_labels(v), f(v))).collect()
}

/// One row per guest and value of the second label (`key`), from `f`'s (value, sample)
/// pairs.
fn per_vm_by<const N: usize>(
    vms: &[VmStats],
    key: &'static str,
    f: impl Fn(&VmStats) -> [(&'static str, Value); N],
) -> Vec<(Labels, Value)> {
    vms.iter()
        .flat_map(|v| {
            f(v).into_iter().map(|(k, x)| {
                let mut labels = vm_labels(v);
                labels.push((key, k.to_string()));
                (labels, x)
            })
        })
        .collect()
}

/// One unlabelled sample.
fn one(v: Value) -> Vec<(Labels, Value)> {
    vec![(Vec::new(), v)]
}

fn bytes(pages: impl Into<f64>) -> Value {
    Value::Gauge(pages.into() * PAGE)
}

fn pages(p: u64) -> Value {
    Value::Gauge(p as f64)
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let vms = &s.vms[..];
        let e = &mut enc;
        use Value::{Counter, Gauge, Seconds};
        family(
            e,
            "memfold_uptime",
            "Time since memfoldd started.",
            Some(Unit::Seconds),
            one(Gauge(s.uptime_s)),
        )?;
        family(
            e,
            "memfold_cpu",
            "CPU time (user + system) of the process memfoldd runs in.",
            Some(Unit::Seconds),
            vec![(vec![("process", "memfoldd".to_string())], Seconds(s.cpu_s))],
        )?;
        family(
            e,
            "memfold_agent_cpu",
            "CPU time (user + system) of the agent's threads in the guest's QEMU.",
            Some(Unit::Seconds),
            per_vm(vms, |v| Seconds(v.agent_cpu_s)),
        )?;
        family(
            e,
            "memfold_guests",
            "Guests memfoldd lists (attached or detached).",
            None,
            one(Gauge(vms.len() as f64)),
        )?;
        family(
            e,
            "memfold_domains",
            "Sharing domains, each with a pool of its own.",
            None,
            one(Gauge(s.domains as f64)),
        )?;
        family(
            e,
            "memfold_host_memory",
            "Host memory a guest holds alone: its RAM memfd and its store memfd as allocated (the domains' pools are memfold_backing_bytes{backing=\"pool\"}).",
            Some(Unit::Bytes),
            per_vm(vms, |v| Gauge(v.host_bytes as f64)),
        )?;
        family(
            e,
            "memfold_guest_memory",
            "Guest RAM size.",
            Some(Unit::Bytes),
            per_vm(vms, |v| bytes(v.pages as f64)),
        )?;
        family(
            e,
            "memfold_pages",
            "Guest pages each mechanism holds now, disjoint: shared (onto pool frames, the zero frame included), unmapped (shared without a mapping: identical to a pool frame, punched from guest RAM), zero (reclaimed zero pages), free (free pages the guest reported, discarded), patched, compressed, swapped.",
            None,
            per_vm_by(vms, "state", |v| {
                [
                    ("shared", pages(v.shared_pages)),
                    ("unmapped", pages(v.unmapped_pages)),
                    (
                        "zero",
                        pages(v.zero_reclaimed_pages.saturating_sub(v.free_reclaimed_pages)),
                    ),
                    ("free", pages(v.free_reclaimed_pages)),
                    ("patched", pages(v.patched_pages)),
                    ("compressed", pages(v.compressed_pages)),
                    ("swapped", pages(v.swapped_pages)),
                ]
            }),
        )?;
        let by = &s.saved_by;
        family(
            e,
            "memfold_saved",
            "Host memory saved by mechanism over all guests (the total saved is their sum minus memfold_store_waste_bytes).",
            Some(Unit::Bytes),
            [
                ("share", by.sharing),
                ("zero", by.zero),
                ("free", by.free),
                ("patch", by.patching),
                ("compress", by.compression),
                ("zswap", by.zswap),
                ("swap", by.swap),
            ]
            .into_iter()
            .map(|(m, p)| (vec![("mechanism", m.to_string())], bytes(p as f64)))
            .collect(),
        )?;
        family(
            e,
            "memfold_store_waste",
            "Store memory not covered by live slots (fragmentation).",
            Some(Unit::Bytes),
            one(bytes(by.store_waste as f64)),
        )?;
        let h = &s.held;
        let backing = |f: [u64; 3]| -> Vec<(Labels, Value)> {
            ["pool", "store", "swap"]
                .into_iter()
                .zip(f)
                .map(|(b, x)| (vec![("backing", b.to_string())], Gauge(x as f64)))
                .collect()
        };
        family(
            e,
            "memfold_backing",
            "Bytes the pools, stores and swap files hold (allocated; holes take none).",
            Some(Unit::Bytes),
            backing([h.pool, h.store, h.swap]),
        )?;
        family(
            e,
            "memfold_backing_booked",
            "Bytes of the pools, stores and swap files the books account for (a leak check against memfold_backing_bytes).",
            Some(Unit::Bytes),
            backing([h.pool_booked, h.store_booked, h.swap_booked]),
        )?;
        family(
            e,
            "memfold_pool_frames",
            "Pool frames holding shared content.",
            None,
            one(pages(s.frames)),
        )?;
        family(
            e,
            "memfold_reference_frames",
            "Pool frames held only as patch reference pages.",
            None,
            one(pages(s.reference_frames)),
        )?;
        family(
            e,
            "memfold_share_table_entries",
            "Share-table entries (shared frames and hints).",
            None,
            one(pages(s.table_entries)),
        )?;
        if let Some(b) = s.swap.budget_pages {
            family(
                e,
                "memfold_host_budget",
                "The host memory budget the guests' RAM is swapped down to (--host-budget-mib).",
                Some(Unit::Bytes),
                one(bytes(b as f64)),
            )?;
            family(e, "memfold_host_used", "Host memory the guests' RAM used (memfds, pools, stores) at the last budget check.", Some(Unit::Bytes), one(bytes(s.swap.host_used_pages as f64)))?;
        }
        family(
            e,
            "memfold_swap_capacity",
            "Capacity of the swap files together (0: no budget, no swap).",
            Some(Unit::Bytes),
            one(bytes(s.swap.capacity_pages as f64)),
        )?;
        family(
            e,
            "memfold_swap_full",
            "Swap-outs refused because the swap file was full.",
            None,
            one(Counter(s.swap.full)),
        )?;
        family(
            e,
            "memfold_blob_write_errors",
            "Blobs a store or swap file could not take (the page stayed in guest RAM).",
            None,
            one(Counter(s.blob_write_errors)),
        )?;
        family(
            e,
            "memfold_full_scans",
            "Completed sharing scans over all guests.",
            None,
            one(Counter(s.full_scans)),
        )?;
        family(
            e,
            "memfold_cow_breaks",
            "Copy-on-write breaks: a guest wrote a shared page and got a private copy.",
            None,
            per_vm(vms, |v| Counter(v.cow_breaks)),
        )?;
        family(
            e,
            "memfold_faults",
            "Faults the agent served: write_protect (CoW breaks, writers waiting on a request), missing (first touches, refills, decodes of stored pages), minor (the clock's R/M tracking).",
            None,
            per_vm_by(vms, "kind", |v| {
                [
                    ("write_protect", Counter(v.wp_faults)),
                    ("missing", Counter(v.missing_faults)),
                    ("minor", Counter(v.minor_faults)),
                ]
            }),
        )?;
        family(
            e,
            "memfold_operations",
            "Pages each operation was carried out on: share (of which share_at_read: asked the moment a disk read filled the page), reclaim (zero page), refill (a reclaimed page touched), patch, compress, unstash (a patched or compressed page decoded back), swap_out, swap_in, swap_move (store to swap file), discard (QEMU discarded it), read_landed (pages a disk read filled, as the block device reported them).",
            None,
            per_vm_by(vms, "op", |v| {
                [
                    ("share", Counter(v.shares)),
                    ("share_at_read", Counter(v.read_shares)),
                    ("read_landed", Counter(v.read_landed)),
                    ("reclaim", Counter(v.reclaims)),
                    ("refill", Counter(v.refills)),
                    ("patch", Counter(v.patches)),
                    ("compress", Counter(v.compressions)),
                    ("unstash", Counter(v.unstashes)),
                    ("swap_out", Counter(v.swap_outs)),
                    ("swap_in", Counter(v.swap_ins)),
                    ("swap_move", Counter(v.swap_moves)),
                    ("discard", Counter(v.discards)),
                    ("free_discard", Counter(v.free_discards)),
                    ("free_discard_stored", Counter(v.free_discards_stored)),
                    (
                        "cow_copy_avoided",
                        // `nocopy_breaks` is the agent's word: never an overflow.
                        Counter(
                            v.cow_copies_avoided
                                .saturating_add(v.free_discards_shared)
                                .saturating_add(v.nocopy_breaks),
                        ),
                    ),
                ]
            }),
        )?;
        family(
            e,
            "memfold_requests_changed",
            "Share and stash requests whose page the guest changed before the agent protected it.",
            None,
            per_vm_by(vms, "op", |v| {
                [
                    ("share", Counter(v.share_changed)),
                    ("stash", Counter(v.stash_changed)),
                ]
            }),
        )?;
        family(
            e,
            "memfold_requests_refused",
            "Share and stash requests the agent refused.",
            None,
            per_vm_by(vms, "op", |v| {
                [
                    ("share", Counter(v.share_refused)),
                    ("stash", Counter(v.stash_refused)),
                ]
            }),
        )?;
        family(
            e,
            "memfold_scanned_pages",
            "Pages the sharing scan hashed (hashed), left out as quiet (quiet), or left alone as recently modified, NRU class C1 (hot).",
            None,
            per_vm_by(vms, "result", |v| {
                [
                    ("hashed", Counter(v.scanned_pages)),
                    ("quiet", Counter(v.skipped_pages)),
                    ("hot", Counter(v.hot_skipped)),
                ]
            }),
        )?;
        family(
            e,
            "memfold_nru_pages",
            "Private pages per NRU class in the clock's last full pass (DE 4.2): C1 recently modified ... C4 neither referenced nor modified.",
            None,
            per_vm_by(vms, "class", |v| {
                let n = v.nru_pages;
                [("C1", pages(n[0])), ("C2", pages(n[1])), ("C3", pages(n[2])), ("C4", pages(n[3]))]
            }),
        )?;
        family(
            e,
            "memfold_clock_passes",
            "Full NRU clock passes over the guest.",
            None,
            per_vm(vms, |v| Counter(v.clock_passes)),
        )?;
        let flag = |b: bool| Gauge(if b { 1.0 } else { 0.0 });
        family(
            e,
            "memfold_vm_detached",
            "1 while the guest's agent is disconnected but its QEMU lives.",
            None,
            per_vm(vms, |v| flag(v.detached)),
        )?;
        family(
            e,
            "memfold_vm_opted_out",
            "1 while the operator has the guest opted out (memfold unmerge).",
            None,
            per_vm(vms, |v| flag(v.opted_out)),
        )?;
        family(
            e,
            "memfold_qemu_mappings",
            "Mappings (VMAs) of the guest's QEMU as its agent counts them (an upper bound), and its VMA budget (vm.max_map_count less 4096; shares that need a mapping stop at 7/8 of it: issue 19's wall).",
            None,
            per_vm_by(vms, "kind", |v| {
                [
                    ("counted", Gauge(v.qemu_mappings as f64)),
                    ("budget", Gauge(v.qemu_vma_budget as f64)),
                ]
            }),
        )?;
        family(
            e,
            "memfold_entitlement",
            "Sharing entitlement (Satori 4.2): the guest's part of what sharing saves, sum over its shared pages of (rank - 1) / rank pages.",
            Some(Unit::Bytes),
            per_vm(vms, |v| Gauge(v.entitlement_pages * PAGE)),
        )?;
        let balloons: Vec<(Labels, Value)> = vms
            .iter()
            .flat_map(|v| {
                [
                    ("target", v.balloon_target_bytes),
                    ("actual", v.balloon_actual_bytes),
                ]
                .into_iter()
                .filter_map(move |(kind, b)| {
                    let mut labels = vm_labels(v);
                    labels.push(("kind", kind.to_string()));
                    Some((labels, Gauge(b? as f64)))
                })
            })
            .collect();
        family(
            e,
            "memfold_balloon",
            "Guest memory its balloon leaves it: the target memfoldd set (allowance + claimed entitlement) and the actual; only guests whose balloon memfoldd drives.",
            Some(Unit::Bytes),
            balloons,
        )?;
        if !s.latency_buckets.is_empty() {
            let mut d = e.encode_descriptor(
                "memfold_operation_latency",
                "Latency of the live operations, over all guests: share, reclaim, stash (per page, in the agent), cow_break, fault, track, unstash (fault read to thread woken), patch_encode, compress (per page, in memfoldd), share_at_read (a disk read's report to the page mapped, in memfoldd).",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            for b in &s.latency_buckets {
                let mut prev = 0;
                let mut buckets: Vec<(f64, u64)> = LATENCY_BUCKETS_S
                    .iter()
                    .zip(&b.le)
                    .map(|(&le, &n)| {
                        let here = n.saturating_sub(prev);
                        prev = prev.max(n);
                        (le, here)
                    })
                    .collect();
                buckets.push((f64::MAX, b.count.saturating_sub(prev)));
                d.encode_family(&[("op", b.op.as_str())])?
                    .encode_histogram::<NoLabelSet>(b.sum_s, b.count, &buckets, None)?;
            }
        }
        Ok(())
    }
}

impl Stats {
    /// The exposition of these statistics (OpenMetrics text, served as
    /// [`CONTENT_TYPE`]).
    pub fn exposition(&self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Snapshot(self.clone())));
        let mut out = String::new();
        encode(&mut out, &registry).expect("writing to a String does not fail");
        out
    }
}

#[cfg(test)]
mod tests;
