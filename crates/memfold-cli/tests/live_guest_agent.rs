//! An enlightened `tiny` guest, live (issue 17, PV §3.1; docs/enlightened.md): a 3 GiB
//! q35 guest (so RAM lies below 2 GiB and above 4 GiB) runs `memfold-guest`, attached
//! over its virtio-serial port to memfoldd's `--guest-channels` folder. memfoldd asks it
//! for its pages' categories; the test checks
//!
//! - the totals: the category counts memfoldd booked match the guest's own
//!   `/proc/meminfo` sent with the same report (free vs MemFree, page cache vs
//!   Cached + Buffers, anonymous vs AnonPages, slab vs Slab) within 2% of MemTotal each,
//!   and every page of RAM is reported but the few the BIOS keeps;
//! - the frame-to-gfn map, by content: the guest fills a page of its own with a marker
//!   and prints its frame (`/proc/self/pagemap`); the frame is above 4 GiB, and the test
//!   finds the marker at the gfn the reported layout gives, in QEMU's RAM memfd (and not
//!   at the frame's number taken as a gfn); the layout is QEMU's own, asked on
//!   memfoldd's monitor of it.
//!
//! - free pages discarded with that layout; the marker's page, in use, untouched.
//!
//! Bounded: boot under TCG, then at most 120 + 90 + 60 s.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use memfold_core::categories::{RamLayout, FOUR_GIB_PFN};
use memfold_live::query_stats;
use memfold_vm::images;
use memfold_vm::launcher::{agent_env, Accel, Guest, GuestSpec, RamBackend};

mod common;
use common::{agent_lib, ram_memfd};

#[test]
fn an_enlightened_guest_reports_categories_that_match_meminfo_and_frames_that_map_to_gfns() {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let agent = agent_lib();
    let work = tempfile::tempdir().unwrap();
    let common::Enlightened {
        daemon: _daemon,
        socket,
        channels,
        log,
    } = common::memfoldd_enlightened(work.path());
    let nonce = format!(
        "{:016x}",
        (std::process::id() as u64 * 0x9e37_79b9) ^ 0x5eed
    );
    let text = format!("MEMFOLD-MARKER-{nonce}");
    let spec = GuestSpec {
        guest_channel: Some(channels.join("enl.sock")),
        kernel_args: Some(format!("memfold.marker={text}")),
        ..GuestSpec::new("enl", "tiny", 3072, RamBackend::Memfd)
    };
    let env = agent_env(&agent, &socket, &spec);
    let mut g = Guest::start_with_env(&spec, &cache, work.path(), Accel::Tcg, &env).unwrap();
    g.wait_ready(Duration::from_secs(240)).unwrap();
    let serial = g.serial();
    assert!(
        serial.contains("MEMFOLD-GUEST-PORT org.memfold.guest.0"),
        "the guest has no port:\n{serial}"
    );

    // A report reaches memfoldd's statistics.
    let t = Instant::now();
    let (stats, gp) = loop {
        let s = query_stats(&socket).unwrap();
        if let Some(gp) = s.vms.first().and_then(|v| v.guest_pages.clone()) {
            if gp.reports >= 2 && gp.low_pages > 0 {
                break (s, gp);
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no category report: {:#?}\nmemfoldd: {}",
            s.vms,
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("{gp:#?}");
    // Requests before its agent opened the port may go unanswered (channel errors);
    // none answered was refused.
    assert_eq!(gp.refused, 0, "{:?}", gp.last_error);
    assert!(gp.agent.starts_with("memfold-guest"), "{}", gp.agent);
    let pages = stats.vms[0].pages;
    assert_eq!(pages, 3 << 18);
    // QEMU's q35 puts 2 GiB of a 3 GiB guest low and 1 GiB at 4 GiB.
    assert_eq!((gp.low_pages, gp.high_pages), (2 << 18, 1 << 18));
    // ...and memfoldd has it from QEMU itself (its monitor), not from the guest's ranges.
    assert!(
        gp.layout_exact,
        "the layout was inferred, not asked of QEMU\nmemfoldd: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // Totals against the guest's own meminfo (KiB → pages), within 2% of MemTotal.
    let m = gp.meminfo;
    let tol = m.mem_total / 4 / 50;
    let pairs = [
        ("free", gp.free, m.mem_free / 4),
        ("cache", gp.cache, (m.cached + m.buffers) / 4),
        ("anon", gp.anon, m.anon_pages / 4),
        ("slab", gp.slab, m.slab / 4),
    ];
    for (what, got, want) in pairs {
        eprintln!("{what}: {got} pages reported, meminfo {want} pages");
        assert!(
            got.abs_diff(want) <= tol,
            "{what}: {got} pages reported, meminfo says {want} (tolerance {tol})"
        );
    }
    let reported = gp.free + gp.cache + gp.anon + gp.slab + gp.kernel;
    assert_eq!(reported + gp.unknown, pages);
    assert!(
        gp.unknown < 1024,
        "{} pages unreported (the BIOS keeps a few)",
        gp.unknown
    );
    // MemTotal excludes what the kernel reserved at boot; all of that is "kernel".
    assert!(reported * 4 >= m.mem_total && gp.kernel * 4 >= reported * 4 - m.mem_total);

    // The marker: its frame maps to the gfn where QEMU's memfd holds it.
    // The marker process starts in the background before the guest says it is ready, so
    // under load its line can come after the reports: wait for it.
    let t = Instant::now();
    let line = loop {
        let found = g.serial().lines().rev().find_map(|l| {
            l.trim()
                .strip_prefix("MEMFOLD-MARKER pfn=")
                .map(String::from)
        });
        if let Some(line) = found {
            break line;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the guest printed no marker frame in 60 s:\n{}",
            g.serial()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let (pfn, shown) = line.split_once(" text=").expect("pfn=0x… text=…");
    assert_eq!(shown, text);
    let pfn = u64::from_str_radix(pfn.trim_start_matches("0x"), 16).unwrap();
    assert!(
        pfn >= FOUR_GIB_PFN,
        "the marker's frame {pfn:#x} is below 4 GiB: the high mapping is not exercised"
    );
    let layout = RamLayout {
        low: gp.low_pages,
        high: gp.high_pages,
        exact: gp.layout_exact,
    };
    let gfn = layout.gfn(pfn).expect("a frame of RAM");
    let ram = ram_memfd(&g);
    let mut page = vec![0u8; 4096];
    ram.read_exact_at(&mut page, gfn.0 as u64 * 4096).unwrap();
    let want: Vec<u8> = text.bytes().cycle().take(4096).collect();
    assert!(
        page == want,
        "gfn {gfn} of frame {pfn:#x} does not hold the marker"
    );
    eprintln!("marker at frame {pfn:#x} found at gfn {gfn} ({:#x})", gfn.0);
    // Without the layout (frame = gfn) it would be past the RAM.
    assert!(pfn * 4096 >= g.mem_bytes);

    // With QEMU's layout, free pages above 4 GiB may be discarded too (most of this
    // guest's free pages are there: its kernel allocates from the GiB at 4 GiB first).
    // The marker's page, in use above 4 GiB, is not among them, and the guest's agent
    // goes on answering (live_free_discard checks a working guest's bytes).
    let now = || {
        query_stats(&socket)
            .ok()
            .and_then(|s| s.vms.into_iter().next())
    };
    let t = Instant::now();
    let first = loop {
        if let Some(v) = now().filter(|v| v.free_discards > 0) {
            break v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "no free page discarded\nmemfoldd: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    let reports = |v: &memfold_wire::VmStats| v.guest_pages.as_ref().map_or(0, |g| g.reports);
    let t = Instant::now();
    let last = loop {
        let v = now().expect("memfoldd answers");
        if reports(&v) >= reports(&first) + 3 {
            break v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the guest's agent stopped answering after the discards"
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    ram.read_exact_at(&mut page, gfn.0 as u64 * 4096).unwrap();
    assert!(page == want, "the marker's page changed after the discards");
    eprintln!("{} free pages discarded", last.free_discards);
    g.stop();
}
