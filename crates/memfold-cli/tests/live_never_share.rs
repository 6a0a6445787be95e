//! Never-share for a process, live (issue 17, Satori §4.3; docs/side-channel.md): a
//! `tiny` guest runs three processes that each keep one page of the same text
//! (`memfold.marker`), so memfoldd shares the three pages onto one frame. Later the guest
//! marks the third process never-share (`memfold-guest never-share --pid`,
//! `memfold.nevershare`). The test reads QEMU's RAM memfd at each page's gfn (a shared
//! page is a hole there, a private one holds the text) and requires:
//!
//! - all three shared before the mark (sharing was on and would take the page);
//! - after it, the marked process's page back in guest RAM, holding its text, and booked
//!   as a never-share take-back;
//! - the marked page still private over ten more reports and full scans, while the other
//!   two (taken back with it: partners on its frame) pair again without it.
//!
//! Breaking either half fails it: without the take-back the page stays a hole; without
//! the scan's check it is shared again.
//!
//! Bounded: boot under TCG, then at most 200 s.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use memfold_core::categories::RamLayout;
use memfold_live::query_stats;
use memfold_vm::images;
use memfold_vm::launcher::{agent_env, Accel, Guest, GuestSpec, RamBackend};
use memfold_wire::GuestPages;

mod common;
use common::{agent_lib, ram_memfd};

/// The latest frame each marker process printed (`MEMFOLD-MARKER-PID pid=P pfn=0x…`).
fn markers(serial: &str) -> BTreeMap<u32, u64> {
    let mut m = BTreeMap::new();
    for l in serial.lines() {
        let Some(rest) = l.trim().strip_prefix("MEMFOLD-MARKER-PID pid=") else {
            continue;
        };
        let Some((pid, pfn)) = rest.split_once(" pfn=0x") else {
            continue;
        };
        if let (Ok(pid), Ok(pfn)) = (pid.parse(), u64::from_str_radix(pfn.trim(), 16)) {
            m.insert(pid, pfn);
        }
    }
    m
}

#[test]
fn a_process_marked_never_share_is_taken_back_and_never_shared_again() {
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
        (std::process::id() as u64 * 0x9e37_79b9) ^ 0x7a11
    );
    let text = format!("MEMFOLD-NEVER-SHARE-{nonce}");
    let spec = GuestSpec {
        guest_channel: Some(channels.join("ns.sock")),
        kernel_args: Some(format!("memfold.marker={text} memfold.nevershare=45")),
        ..GuestSpec::new("ns", "tiny", 256, RamBackend::Memfd)
    };
    let env = agent_env(&agent, &socket, &spec);
    let mut g = Guest::start_with_env(&spec, &cache, work.path(), Accel::Tcg, &env).unwrap();
    g.wait_ready(Duration::from_secs(240)).unwrap();
    let memfoldd_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let pages = || -> Option<GuestPages> {
        query_stats(&socket)
            .ok()?
            .vms
            .into_iter()
            .next()?
            .guest_pages
    };
    let want: Vec<u8> = text.bytes().cycle().take(4096).collect();
    let ram = ram_memfd(&g);
    // Whether the page at frame `pfn` is shared: a hole in QEMU's RAM memfd (zeros);
    // private, it holds the text.
    let shared = |pfn: u64, layout: RamLayout| -> bool {
        let gfn = layout.gfn(pfn).expect("a frame of RAM");
        let mut page = vec![0u8; 4096];
        ram.read_exact_at(&mut page, gfn.0 as u64 * 4096).unwrap();
        assert!(
            page == want || page.iter().all(|&b| b == 0),
            "gfn {gfn} (frame {pfn:#x}) holds neither the text nor a hole"
        );
        page != want
    };
    let marked_line = |g: &Guest| {
        g.serial()
            .lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("MEMFOLD-NEVER-SHARE pid=")
                    .map(String::from)
            })
            .map(|p| p.trim().parse::<u32>().expect("a pid"))
    };

    // 1. Before the mark: three marker processes, their pages all shared.
    let t = Instant::now();
    let layout = loop {
        let m = markers(&g.serial());
        let gp = pages();
        if let Some(gp) = gp.as_ref().filter(|gp| gp.low_pages > 0 && m.len() == 3) {
            let layout = RamLayout {
                low: gp.low_pages,
                high: gp.high_pages,
                exact: gp.layout_exact,
            };
            if m.values().all(|&pfn| shared(pfn, layout)) {
                break layout;
            }
        }
        assert!(
            marked_line(&g).is_none(),
            "the guest marked its process before memfoldd shared the three pages: {m:x?} \
             {gp:?}\nmemfoldd: {}",
            memfoldd_log()
        );
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "never shared: {m:x?} {gp:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("{:?}: the three pages are shared", t.elapsed());

    // 2. The mark: the marked process's page comes back; the others stay shared.
    let t = Instant::now();
    let pid = loop {
        if let Some(p) = marked_line(&g) {
            break p;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the guest never marked"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let t = Instant::now();
    let gp = loop {
        let m = markers(&g.serial());
        let gp = pages().expect("reports");
        if !shared(m[&pid], layout) && gp.never_share_takebacks > 0 {
            break gp;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the marked page was not taken back: {gp:?}\nmemfoldd: {}",
            memfoldd_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    eprintln!(
        "{:?} after the mark: taken back ({} pages marked, {} taken back)",
        t.elapsed(),
        gp.never_share,
        gp.never_share_takebacks
    );
    assert!(gp.never_share > 0, "the report carries the marks");

    // 3. And never shared again, over ten more reports (and the scans between them);
    // its partners, taken back with it (left on its frame, their writes would still be
    // CoW breaks), pair again without it.
    let until = gp.reports + 10;
    let t = Instant::now();
    let mut repaired = false;
    loop {
        let m = markers(&g.serial());
        assert!(!shared(m[&pid], layout), "the marked page was shared again");
        repaired |= m
            .iter()
            .filter(|&(&p, _)| p != pid)
            .all(|(_, &pfn)| shared(pfn, layout));
        let gp = pages().expect("reports");
        if gp.reports >= until {
            eprintln!("{gp:#?}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "reports stopped: {gp:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(repaired, "the unmarked processes' pages never paired again");
    let log = memfoldd_log();
    assert!(
        log.contains("never-share taken back"),
        "memfoldd says so:\n{log}"
    );
    g.stop();
}
