//! Operator views of a running memfoldd: `memfold status` (a table, or `--json`) and
//! `memfold top` (full screen, [`top`]). Both read memfoldd's statistics over its socket
//! (`memfold_live::query_stats`), the same request the metrics endpoint makes.
//!
//! Rates (CoW breaks/s, faults/s) are the difference of two samples over memfoldd's own
//! uptime between them: `status` takes two samples `--interval` seconds apart (1 s by
//! default; 0 takes one and shows no rates), `top` one per refresh.

pub mod top;

use std::path::{Path, PathBuf};
use std::time::Duration;

use memfold_wire::{Stats, VmStats};
use serde::Serialize;

/// Bytes in a guest page.
const PAGE: u64 = 4096;
/// Bytes in a MiB.
const MIB: f64 = 1024.0 * 1024.0;

pub use memfold_cli::DEFAULT_SOCKET;

/// Errors of the operator views.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// No memfoldd answered at the socket.
    #[error("no memfoldd at {}: {cause}", socket.display())]
    NoDaemon {
        /// The socket tried.
        socket: PathBuf,
        /// Cause (in the message; not a `source`, so that a cause chain says it once).
        cause: std::io::Error,
    },
    /// The terminal could not be set up, drawn or read.
    #[error("terminal: {0}")]
    Terminal(#[from] std::io::Error),
}

/// memfoldd's statistics from `socket`.
///
/// Errors: [`OpsError::NoDaemon`].
pub fn sample(socket: &Path) -> Result<Stats, OpsError> {
    memfold_live::query_stats(socket).map_err(|cause| OpsError::NoDaemon {
        socket: socket.to_path_buf(),
        cause,
    })
}

/// One guest's line (or the total's) of the views.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Row {
    /// Guest name (`total` for the total).
    pub name: String,
    /// Host memory it holds alone (RAM and store memfds as allocated), bytes; for the total,
    /// every guest's plus the sharing domains' pools.
    pub host_bytes: u64,
    /// Guest RAM, bytes.
    pub guest_bytes: u64,
    /// Pages mapped onto pool frames (the zero frame included).
    pub shared_pages: u64,
    /// Zero pages reclaimed.
    pub zero_pages: u64,
    /// Pages stored as patches.
    pub patched_pages: u64,
    /// Pages stored compressed.
    pub compressed_pages: u64,
    /// Pages in the swap file.
    pub swapped_pages: u64,
    /// Sharing entitlement (Satori §4.2): its part of what sharing saves, bytes.
    pub entitlement_bytes: u64,
    /// What its balloon leaves the guest (`None`: memfoldd drives no balloon), bytes.
    pub balloon_bytes: Option<u64>,
    /// Copy-on-write breaks per second between the two samples (`None`: one sample only,
    /// or the guest is new).
    pub cow_breaks_per_s: Option<f64>,
    /// Faults the agent served per second (write-protect, missing, minor).
    pub faults_per_s: Option<f64>,
    /// `managed`, `detached` (agent gone, QEMU alive) or `opted out`.
    pub state: &'static str,
}

/// Host memory saved by mechanism over all guests, bytes (memfoldd's books).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Saved {
    /// Sharing.
    pub share: i64,
    /// Zero pages reclaimed.
    pub zero: i64,
    /// Free pages the guest reported, discarded (issue 17).
    pub free: i64,
    /// Patching.
    pub patch: i64,
    /// Compression.
    pub compress: i64,
    /// Swap (on disk, no host memory).
    pub swap: i64,
    /// Store fragmentation, subtracted in `total`.
    pub store_waste: i64,
    /// share + zero + free + patch + compress + swap − store_waste.
    pub total: i64,
}

/// What `status` and `top` show.
#[derive(Clone, Debug, Serialize)]
pub struct View {
    /// memfoldd's uptime at the (second) sample, seconds.
    pub uptime_s: f64,
    /// Seconds of memfoldd's clock between the two samples (`None`: one sample).
    pub interval_s: Option<f64>,
    /// The Difference Engine policy by name.
    pub policy: String,
    /// CPU memfoldd's process used between the samples, % of one CPU.
    pub memfoldd_cpu_percent: Option<f64>,
    /// CPU the agents' threads used between the samples, over all guests, % of one CPU.
    pub agents_cpu_percent: Option<f64>,
    /// One row per guest, by name.
    pub vms: Vec<Row>,
    /// The total over guests.
    pub total: Row,
    /// Savings by mechanism.
    pub saved: Saved,
    /// Operation latencies over all guests.
    pub latency: Vec<Latency>,
}

/// One operation's latencies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Latency {
    /// The operation (as the metrics' `op` label).
    pub op: &'static str,
    /// Operations timed.
    pub count: u64,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
}

/// One guest of each QEMU in `vms`: what belongs to a QEMU (its agents' CPU, its balloon)
/// is shown on each of its RAM regions' rows, and counted once in a total.
fn per_qemu(vms: &[VmStats]) -> impl Iterator<Item = &VmStats> {
    let mut seen = std::collections::BTreeSet::new();
    vms.iter().filter(move |v| seen.insert(v.pid))
}

fn faults(v: &VmStats) -> u64 {
    // Counters an agent reports: a wild one must not wrap.
    v.wp_faults
        .saturating_add(v.missing_faults)
        .saturating_add(v.minor_faults)
}

/// The view of `now`, with rates against `prev` (a sample of the same memfoldd taken
/// before; `None` or a later restart: no rates).
pub fn view(prev: Option<&Stats>, now: &Stats) -> View {
    let dt = prev.map(|p| now.uptime_s - p.uptime_s).filter(|&d| d > 0.0);
    let rate = |v: &VmStats, f: fn(&VmStats) -> u64| -> Option<f64> {
        let p = prev?
            .vms
            .iter()
            .find(|w| w.name == v.name && w.pid == v.pid)?;
        Some(f(v).saturating_sub(f(p)) as f64 / dt?)
    };
    let vms: Vec<Row> = now
        .vms
        .iter()
        .map(|v| Row {
            name: v.name.clone(),
            host_bytes: v.host_bytes,
            guest_bytes: v.pages * PAGE,
            shared_pages: v.shared_pages,
            zero_pages: v.zero_reclaimed_pages,
            patched_pages: v.patched_pages,
            compressed_pages: v.compressed_pages,
            swapped_pages: v.swapped_pages,
            entitlement_bytes: (v.entitlement_pages * PAGE as f64) as u64,
            balloon_bytes: v.balloon_actual_bytes,
            cow_breaks_per_s: rate(v, |v| v.cow_breaks),
            faults_per_s: rate(v, faults),
            state: if v.opted_out {
                "opted out"
            } else if v.detached {
                "detached"
            } else {
                "managed"
            },
        })
        .collect();
    let sum = |f: fn(&Row) -> u64| vms.iter().map(f).sum::<u64>();
    let sum_rate = |f: fn(&Row) -> Option<f64>| {
        dt?;
        // + 0.0: an empty sum is -0.0.
        Some(vms.iter().filter_map(f).sum::<f64>() + 0.0)
    };
    let total = Row {
        name: "total".into(),
        host_bytes: sum(|r| r.host_bytes) + now.held.pool,
        guest_bytes: sum(|r| r.guest_bytes),
        shared_pages: sum(|r| r.shared_pages),
        zero_pages: sum(|r| r.zero_pages),
        patched_pages: sum(|r| r.patched_pages),
        compressed_pages: sum(|r| r.compressed_pages),
        swapped_pages: sum(|r| r.swapped_pages),
        entitlement_bytes: sum(|r| r.entitlement_bytes),
        balloon_bytes: per_qemu(&now.vms)
            .map(|v| v.balloon_actual_bytes)
            .sum::<Option<u64>>()
            .filter(|_| !vms.is_empty()),
        cow_breaks_per_s: sum_rate(|r| r.cow_breaks_per_s),
        faults_per_s: sum_rate(|r| r.faults_per_s),
        state: "",
    };
    let cpu_percent = |f: &dyn Fn(&Stats) -> f64| -> Option<f64> {
        Some((f(now) - f(prev?)).max(0.0) / dt? * 100.0)
    };
    let agents = |s: &Stats| per_qemu(&s.vms).map(|v| v.agent_cpu_s).sum::<f64>();
    let b = &now.saved_by;
    let page = PAGE as i64;
    let l = &now.latency;
    View {
        uptime_s: now.uptime_s,
        interval_s: dt,
        policy: now.policy.clone(),
        memfoldd_cpu_percent: cpu_percent(&|s| s.cpu_s),
        agents_cpu_percent: cpu_percent(&agents),
        vms,
        total,
        saved: Saved {
            share: b.sharing * page,
            zero: b.zero * page,
            free: b.free * page,
            patch: b.patching * page,
            compress: b.compression * page,
            swap: b.swap * page,
            store_waste: b.store_waste * page,
            total: now.saved_pages * page,
        },
        latency: [
            ("share", l.share),
            ("cow_break", l.cow_break),
            ("fault", l.fault),
            ("unstash", l.unstash),
            ("patch_encode", l.patch_encode),
            ("compress", l.compress),
        ]
        .into_iter()
        .map(|(op, s)| Latency {
            op,
            count: s.count,
            p50_us: s.p50_us,
            p99_us: s.p99_us,
        })
        .collect(),
    }
}

/// Bytes as MiB with one decimal.
pub fn mib(b: impl Into<f64>) -> String {
    format!("{:.1}", b.into() / MIB)
}

/// A rate, or `-` without one.
pub fn per_s(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{r:.0}"))
}

/// The table's header, one cell per column.
pub const COLUMNS: [&str; 13] = [
    "VM",
    "HOST MiB",
    "GUEST MiB",
    "SHARED",
    "ZERO",
    "PATCHED",
    "COMPR",
    "SWAPPED",
    "ENTITLED MiB",
    "BALLOON MiB",
    "COW/s",
    "FAULTS/s",
    "STATE",
];

/// A row's cells, in [`COLUMNS`]' order.
pub fn cells(r: &Row) -> [String; 13] {
    [
        r.name.clone(),
        mib(r.host_bytes as f64),
        mib(r.guest_bytes as f64),
        r.shared_pages.to_string(),
        r.zero_pages.to_string(),
        r.patched_pages.to_string(),
        r.compressed_pages.to_string(),
        r.swapped_pages.to_string(),
        mib(r.entitlement_bytes as f64),
        r.balloon_bytes.map_or("-".into(), |b| mib(b as f64)),
        per_s(r.cow_breaks_per_s),
        per_s(r.faults_per_s),
        r.state.to_string(),
    ]
}

/// What memfold costs in CPU: memfoldd's and the agents' % of one CPU (`-` without a
/// previous sample).
pub fn cpu_line(v: &View) -> String {
    let pct = |p: Option<f64>| p.map_or("-".into(), |p| format!("{p:.1}%"));
    format!(
        "CPU: memfoldd {}, agents {}",
        pct(v.memfoldd_cpu_percent),
        pct(v.agents_cpu_percent)
    )
}

/// The savings line: by mechanism and in total, MiB.
pub fn saved_line(s: &Saved) -> String {
    format!(
        "saved {} MiB: share {}, zero {}, free {}, patch {}, compress {}, swap {} (store waste {})",
        mib(s.total as f64),
        mib(s.share as f64),
        mib(s.zero as f64),
        mib(s.free as f64),
        mib(s.patch as f64),
        mib(s.compress as f64),
        mib(s.swap as f64),
        mib(s.store_waste as f64)
    )
}

/// The view as a plain text table.
pub fn table(v: &View) -> String {
    let rows: Vec<[String; 13]> = std::iter::once(COLUMNS.map(String::from))
        .chain(v.vms.iter().map(cells))
        .chain(std::iter::once(cells(&v.total)))
        .collect();
    let width = |i: usize| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..COLUMNS.len()).map(width).collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i == 0 || i == COLUMNS.len() - 1 {
                    format!("{c:<w$}", w = widths[i])
                } else {
                    format!("{c:>w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&saved_line(&v.saved));
    out.push('\n');
    out
}

/// `memfold status`'s flags.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// memfoldd's socket.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Seconds between the two samples the rates come from (0: one sample, no rates).
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Print JSON (the view and memfoldd's full statistics) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `memfold status`: a table per guest and the total, or JSON.
///
/// Errors: no memfoldd at the socket.
pub fn status(a: &StatusArgs) -> Result<(), OpsError> {
    let first = sample(&a.socket)?;
    let (prev, now) = if a.interval > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(a.interval));
        let mut now = sample(&a.socket)?;
        // A tenant's statistics are reused for a second (`memfold_live::reused`): with a
        // shorter interval the second sample is the first again, and has no rates.
        let until = std::time::Instant::now() + Duration::from_secs(2);
        while now.uptime_s == first.uptime_s && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
            now = sample(&a.socket)?;
        }
        (Some(first), now)
    } else {
        (None, first)
    };
    let v = view(prev.as_ref(), &now);
    if a.json {
        #[derive(Serialize)]
        struct Out<'a> {
            socket: &'a Path,
            #[serde(flatten)]
            view: &'a View,
            stats: &'a Stats,
        }
        let out = Out {
            socket: &a.socket,
            view: &v,
            stats: &now,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("the view serializes")
        );
    } else {
        println!(
            "memfoldd at {}: up {:.0} s, policy {}, {} guests{}",
            a.socket.display(),
            v.uptime_s,
            v.policy,
            v.vms.len(),
            v.interval_s
                .map_or(String::new(), |d| format!(", rates over {d:.1} s"))
        );
        if let Some(uid) = now.tenant_uid {
            println!("uid {uid}'s view: its own guests only; host-wide figures are an operator's");
        }
        println!("{}", cpu_line(&v));
        print!("{}", table(&v));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_wire::{HeldBytes, SavedBy};

    fn stats(t: f64, cow: u64, faults: u64) -> Stats {
        Stats {
            uptime_s: t,
            saved_pages: 10,
            saved_by: SavedBy {
                sharing: 8,
                zero: 2,
                ..Default::default()
            },
            held: HeldBytes {
                pool: 3 * PAGE,
                ..Default::default()
            },
            vms: vec![
                VmStats {
                    name: "web".into(),
                    pid: 7,
                    pages: 256,
                    host_bytes: 100 * PAGE,
                    shared_pages: 5,
                    cow_breaks: cow,
                    wp_faults: faults,
                    missing_faults: faults,
                    entitlement_pages: 512.0,
                    balloon_actual_bytes: Some(200 << 20),
                    ..Default::default()
                },
                VmStats {
                    name: "db".into(),
                    pid: 8,
                    pages: 256,
                    host_bytes: 50 * PAGE,
                    detached: true,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn what_belongs_to_a_qemu_counts_once_in_the_total_over_its_ram_regions() {
        let region = |name: &str, cpu: f64| VmStats {
            name: name.into(),
            pid: 7,
            agent_cpu_s: cpu,
            balloon_actual_bytes: Some(300 << 20),
            ..Default::default()
        };
        let at = |t: f64, cpu: f64| Stats {
            uptime_s: t,
            vms: vec![region("web/ram0", cpu), region("web/ram1", cpu)],
            ..Default::default()
        };
        let v = view(Some(&at(10.0, 1.0)), &at(12.0, 1.2));
        // 0.2 s of the one QEMU's agent CPU over 2 s: 10%, not 20%; one balloon.
        assert!((v.agents_cpu_percent.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(v.total.balloon_bytes, Some(300 << 20));
    }

    #[test]
    fn rates_come_from_two_samples_over_memfoldds_clock() {
        let a = stats(10.0, 100, 1000);
        let mut b = stats(12.0, 140, 1100);
        b.cpu_s = a.cpu_s + 0.5;
        b.vms[0].agent_cpu_s = a.vms[0].agent_cpu_s + 0.1;
        b.vms[1].agent_cpu_s = a.vms[1].agent_cpu_s + 0.1;
        let v = view(Some(&a), &b);
        // 0.5 s of CPU over 2 s: 25% of a CPU; the agents 0.2 s: 10%.
        assert_eq!(v.memfoldd_cpu_percent, Some(25.0));
        assert!((v.agents_cpu_percent.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(cpu_line(&v), "CPU: memfoldd 25.0%, agents 10.0%");
        assert_eq!(v.interval_s, Some(2.0));
        assert_eq!(v.vms[0].cow_breaks_per_s, Some(20.0));
        assert_eq!(v.vms[0].faults_per_s, Some(100.0));
        assert_eq!(v.vms[1].state, "detached");
        assert_eq!(v.total.cow_breaks_per_s, Some(20.0));
        // Entitlements add up; a balloon total only when every guest's balloon is driven.
        assert_eq!(v.vms[0].entitlement_bytes, 2 << 20);
        assert_eq!(v.total.entitlement_bytes, 2 << 20);
        assert_eq!(
            (v.vms[0].balloon_bytes, v.vms[1].balloon_bytes),
            (Some(200 << 20), None)
        );
        assert_eq!(v.total.balloon_bytes, None);
        let t = table(&v);
        assert!(t.contains("ENTITLED MiB") && t.contains("200.0"), "{t}");
        // The pools count in the total's host memory, not in any guest's.
        assert_eq!(v.total.host_bytes, 153 * PAGE);
        assert_eq!(v.saved.share, 8 * PAGE as i64);
        assert_eq!(v.saved.total, 10 * PAGE as i64);
        // One sample, or a guest of another QEMU under the same name: no rate.
        let one = view(None, &b);
        assert_eq!(cpu_line(&one), "CPU: memfoldd -, agents -");
        assert_eq!(
            per_s(
                view(
                    Some(&a),
                    &Stats {
                        uptime_s: 11.0,
                        vms: vec![],
                        ..a.clone()
                    }
                )
                .total
                .cow_breaks_per_s
            ),
            "0"
        );
        assert_eq!(one.vms[0].cow_breaks_per_s, None);
        assert_eq!(one.total.faults_per_s, None);
        let mut other = a.clone();
        other.vms[0].pid = 9;
        assert_eq!(view(Some(&other), &b).vms[0].cow_breaks_per_s, None);
    }

    #[test]
    fn the_table_has_a_header_every_guest_and_the_total() {
        let v = view(Some(&stats(10.0, 0, 0)), &stats(11.0, 5, 5));
        let t = table(&v);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("VM ") && lines[0].contains("COW/s"),
            "{t}"
        );
        assert!(
            lines[1].starts_with("web ") && lines[1].contains(" 5 "),
            "{t}"
        );
        assert!(
            lines[2].starts_with("db ") && lines[2].ends_with("detached"),
            "{t}"
        );
        assert!(lines[3].starts_with("total "), "{t}");
        assert!(lines[4].starts_with("saved 0.0 MiB: share 0.0"), "{t}");
        // Numbers are right-aligned under their header: each row's faults/s ends where
        // the header's FAULTS/s does.
        let end = lines[0].find("FAULTS/s").unwrap() + "FAULTS/s".len();
        for l in &lines[1..4] {
            assert!(l.len() >= end && !l[..end].ends_with(' '), "{t}");
            assert!(l.len() == end || l[end..].starts_with(' '), "{t}");
        }
    }
}
