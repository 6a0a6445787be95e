//! Sharing at disk read (Satori §4.1; issue 16), memfoldd's side: a block device reports
//! the guest pages each disk read filled ([`memfold_wire::LandedReporter`]) and memfoldd
//! shares them at once, through the real agent (in this process, on memfds), while its
//! rate-limited scan is far too slow to find them. Pages equal in the same way but not
//! reported stay private over the same time: the control.

mod common;

use std::time::{Duration, Instant};

use memfold_core::{EngineConfig, Policy};
use memfold_ids::Gfn;
use memfold_sys::memfd;
use memfold_wire::{LandedReporter, RamFile};
use rand::{rngs::SmallRng, Rng, SeedableRng};

use common::{GuestRam, PAGE};

const PAGES: usize = 2048;
/// The second guest's pages: the agent finds its RAM by size, and both agents run in
/// this one process.
const PAGES_B: usize = 2560;

fn ram_file(ram: &GuestRam) -> RamFile {
    let (dev, ino) = memfd::file_id(ram.memfd()).unwrap();
    RamFile { dev, ino }
}

#[test]
fn reported_disk_reads_are_shared_at_once_and_unreported_twins_wait_for_the_scan() {
    let dir = tempfile::tempdir().unwrap();
    // One page a second: the scan reads a handful of each guest's 2048 pages in this test.
    let socket = common::start_memfoldd(
        dir.path(),
        EngineConfig {
            policy: Policy::sharing_only(),
            rate: 1,
            clock_interval_us: None,
            ..common::fast_engine()
        },
    );
    let mut rng = SmallRng::seed_from_u64(16);
    let (a, b) = common::two_random_guests(&socket, &mut rng, PAGES, PAGES_B);
    // A file of 16 blocks read by both guests into different pages (as page cache is),
    // written through the guests' mappings as the block device writes; and the control:
    // 16 more equal pairs nobody reports.
    let file: Vec<Vec<u8>> = (0..32)
        .map(|_| {
            let mut p = vec![0u8; PAGE];
            rng.fill(&mut p[..]);
            p
        })
        .collect();
    let (in_a, in_b) = (|k: usize| 1500 + 3 * k, |k: usize| 1000 + 5 * k);
    for (k, p) in file.iter().enumerate() {
        a.write(in_a(k), 0, p);
        b.write(in_b(k), 0, p);
    }
    let reporter = LandedReporter::spawn(&socket).unwrap();
    let landed = |f: &dyn Fn(usize) -> usize| (0..16).map(|k| Gfn(f(k) as u32)).collect();
    assert!(reporter.report(ram_file(&a), landed(&in_a)));
    assert!(reporter.report(ram_file(&b), landed(&in_b)));
    let t = Instant::now();
    let s = common::wait_for(&socket, Duration::from_secs(10), "shares at read", |s| {
        s.vms.iter().map(|v| v.read_shares).sum::<u64>() == 32
    });
    let took = t.elapsed();
    for k in 0..16 {
        assert!(a.on_pool(in_a(k)) && b.on_pool(in_b(k)), "block {k} shared");
    }
    assert_eq!(s.vms.iter().map(|v| v.read_landed).sum::<u64>(), 32);
    assert_eq!(s.latency.share_at_read.count, 32, "{:?}", s.latency);
    // Nothing else was shared: the scan did not get to the control pairs.
    std::thread::sleep(Duration::from_millis(500));
    for k in 16..32 {
        assert!(
            !a.on_pool(in_a(k)) && !b.on_pool(in_b(k)),
            "control {k} shared"
        );
    }
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        s.vms.iter().map(|v| v.shares).sum::<u64>(),
        32,
        "{:#?}",
        s.vms
    );
    // The census counts contents, shared or not: 32 blocks held twice, nothing else
    // (every other page is random) — the potential the shares at read took half of.
    let c = memfold_live::query_census(&socket).unwrap();
    assert_eq!(
        (c.pages, c.duplicate_pages),
        ((PAGES + PAGES_B) as u64, 32),
        "{c:?}"
    );
    // Every page still reads what was written.
    let mut got = vec![0u8; PAGE];
    for (k, p) in file.iter().enumerate() {
        a.read(in_a(k), &mut got);
        assert_eq!(&got, p, "a, block {k}");
        b.read(in_b(k), &mut got);
        assert_eq!(&got, p, "b, block {k}");
    }
    eprintln!(
        "32 pages reported, shared in {took:?} (stats polled every 50 ms); landing to mapped p50 {:.0} µs, p99 {:.0} µs",
        s.latency.share_at_read.p50_us, s.latency.share_at_read.p99_us
    );
    // A report naming RAM no guest has, or out of a guest's RAM, changes nothing, and
    // memfoldd goes on answering.
    assert!(reporter.report(RamFile { dev: 1, ino: 1 }, vec![Gfn(1)]));
    assert!(reporter.report(ram_file(&a), vec![Gfn(PAGES as u32 + 5)]));
    std::thread::sleep(Duration::from_millis(300));
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(s.vms.iter().map(|v| v.read_landed).sum::<u64>(), 32);
    assert_eq!(reporter.dropped(), 0);
}
