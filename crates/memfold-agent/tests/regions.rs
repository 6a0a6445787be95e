//! Several guest RAM regions in one process (issue 20): the agent finds both without being
//! told a size, attaches each as its own guest (`g/ram0`, `g/ram1` in address order) with
//! its own memfd, and a request on one region's connection never reaches memory outside
//! that region: requests for the first gfn past the region's end (and beyond) are refused
//! and change nothing, in either region; a request inside the region is carried out, and
//! the fault it leads to is served and reported on that region's connection only. A
//! region unmapped (hot-unplug) has its agent say so (`ToDaemon::RegionUnmapped`) and
//! detach; the other region's agent goes on.
//!
//! This test binary plays QEMU (two shared `memory-backend-memfd` memfds mapped, as QEMU
//! maps two NUMA nodes' backends) and memfoldd (a listener speaking the wire). One test
//! only: the agent, run in this process, takes every such memfd of the process.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{next, region, share, start_agent};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon, PROTOCOL_VERSION};

/// Region 0, pages (the larger, so the two differ in size too).
const PAGES_A: usize = 64;
/// Region 1, pages.
const PAGES_B: usize = 32;
/// A page of region 1 left zero, which the fake memfoldd asks the agent to reclaim.
const ZERO_B: u32 = 5;

/// Byte `i` of page `g` of region `r` as the "guest" writes it: no page zero.
fn pattern(r: usize, g: usize, i: usize) -> u8 {
    ((r * 7919 + g * 131 + i * 7) % 251) as u8 + 1
}

#[test]
fn two_regions_are_two_guests_and_no_request_reaches_past_its_region() {
    let (fd_a, ptr_a) = region(PAGES_A);
    let (fd_b, ptr_b) = region(PAGES_B);
    for (r, ptr, pages) in [(0, ptr_a, PAGES_A), (1, ptr_b, PAGES_B)] {
        for g in 0..pages {
            if r == 1 && g == ZERO_B as usize {
                continue;
            }
            for i in 0..PAGE_SIZE {
                // SAFETY: inside the mapping made above.
                unsafe { *ptr.add(g * PAGE_SIZE + i) = pattern(r, g, i) };
            }
        }
    }
    // Which is ram0: the lower address.
    let (lo, hi) = if (ptr_a as usize) < (ptr_b as usize) {
        ((fd_a.as_fd(), PAGES_A), (fd_b.as_fd(), PAGES_B))
    } else {
        ((fd_b.as_fd(), PAGES_B), (fd_a.as_fd(), PAGES_A))
    };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("memfoldd.sock");
    // No RAM size given: the agent finds both regions itself.
    let listener = start_agent(&socket);

    // Two hellos, one per region, each with its own memfd and size.
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), 4 * PAGE_SIZE as u64).unwrap();
    let store = memfd::create("fake-store").unwrap();
    let mut conns = Vec::new();
    for _ in 0..2 {
        let c = listener.accept().unwrap();
        c.set_recv_timeout(Duration::from_millis(200)).unwrap();
        let t = Instant::now();
        let (hello, fds) = loop {
            if let Ok(Some(h)) = c.recv::<ToDaemon>() {
                break h;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no hello");
        };
        let ToDaemon::AgentHello {
            name, ram_bytes, ..
        } = hello
        else {
            panic!("{hello:?}")
        };
        let ino = |fd: std::os::fd::BorrowedFd<'_>| rustix::fs::fstat(fd).unwrap().st_ino;
        let (want_fd, want_pages) = if name == "g/ram0" { lo } else { hi };
        assert!(name == "g/ram0" || name == "g/ram1", "{name}");
        assert_eq!(ram_bytes, (want_pages * PAGE_SIZE) as u64, "{name}");
        assert_eq!(ino(fds[0].as_fd()), ino(want_fd), "{name}: its own memfd");
        c.send(
            &ToAgent::Welcome {
                version: PROTOCOL_VERSION,
            },
            &[pool.as_fd(), store.as_fd()],
        )
        .unwrap();
        conns.push((name, c));
    }
    conns.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<&str> = conns.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["g/ram0", "g/ram1"]);
    let b_name = if (ptr_b as usize) > (ptr_a as usize) {
        "g/ram1"
    } else {
        "g/ram0"
    };
    let c_b = &conns.iter().find(|c| c.0 == b_name).unwrap().1;

    // Past region 1's end: its first gfn, the next, and far past. Refused, nothing done.
    let past = [
        Gfn(PAGES_B as u32),
        Gfn(PAGES_B as u32 + 1),
        Gfn(PAGES_A as u32),
    ];
    c_b.send(
        &ToAgent::ReclaimZero {
            batch: BatchId(1),
            gfns: [&past[..], &[Gfn(ZERO_B)]].concat(),
        },
        &[],
    )
    .unwrap();
    let (reclaimed, refused) = next(c_b, |m| match m {
        ToDaemon::ReclaimDone {
            batch: BatchId(1),
            reclaimed,
            refused,
            ..
        } => Some((reclaimed.clone(), refused.clone())),
        _ => None,
    });
    assert_eq!(reclaimed, [Gfn(ZERO_B)], "the zero page inside the region");
    assert_eq!(refused, past, "every gfn past the region's end");
    let (shared, refused, _) = share(
        c_b,
        BatchId(2),
        past.iter().map(|&g| (g, FrameId(0))).collect(),
    );
    assert!(shared.is_empty());
    assert_eq!(refused, past);
    // A page inside the region onto a frame past what the agent's page table packs
    // (2^30: a 4 TiB pool): refused, the agent unharmed.
    let far = vec![(Gfn(1), FrameId(1 << 30)), (Gfn(2), FrameId(u32::MAX))];
    let (shared, refused, _) = share(c_b, BatchId(20), far);
    assert!(shared.is_empty());
    assert_eq!(refused, [Gfn(1), Gfn(2)]);
    c_b.send(
        &ToAgent::TakeBack {
            batch: BatchId(3),
            gfns: past.to_vec(),
        },
        &[],
    )
    .unwrap();
    let refused = next(c_b, |m| match m {
        ToDaemon::TakeBackDone {
            batch: BatchId(3),
            refused,
            ..
        } => Some(refused.clone()),
        _ => None,
    });
    assert_eq!(refused, past);
    // A clock slice starting past the end covers no page.
    c_b.send(
        &ToAgent::ClockScan {
            batch: BatchId(4),
            first: Gfn(PAGES_B as u32),
            count: 64,
            arm: vec![u64::MAX],
            wp_only: vec![],
            zap_shared: false,
        },
        &[],
    )
    .unwrap();
    let count = next(c_b, |m| match m {
        ToDaemon::ClockBits {
            batch: BatchId(4),
            count,
            ..
        } => Some(*count),
        _ => None,
    });
    assert_eq!(count, 0);

    // The reclaimed page is a hole of region 1's memfd only; reading it is a fault served
    // by region 1's agent (zeros) and reported on its connection.
    assert!(memfd::next_data_run(fd_b.as_fd(), Gfn(ZERO_B), Gfn(ZERO_B + 1)).is_none());
    // SAFETY: inside region 1's mapping; the agent serves the fault.
    let v = unsafe { std::ptr::read_volatile(ptr_b.add(ZERO_B as usize * PAGE_SIZE + 9)) };
    assert_eq!(v, 0);
    let refilled = next(c_b, |m| match m {
        ToDaemon::Refilled { gfns } => Some(gfns.clone()),
        _ => None,
    });
    assert_eq!(refilled, [Gfn(ZERO_B)]);

    // Every other byte of both regions is as written, in the memfds and the mappings.
    for (r, fd, ptr, pages) in [(0, &fd_a, ptr_a, PAGES_A), (1, &fd_b, ptr_b, PAGES_B)] {
        let mut page = vec![0u8; PAGE_SIZE];
        for g in 0..pages {
            if r == 1 && g == ZERO_B as usize {
                continue;
            }
            memfd::pread_exact(fd.as_fd(), &mut page, (g * PAGE_SIZE) as u64).unwrap();
            for (i, &b) in page.iter().enumerate() {
                assert_eq!(b, pattern(r, g, i), "region {r} page {g} byte {i} (memfd)");
                // SAFETY: inside the mapping.
                let m = unsafe { std::ptr::read_volatile(ptr.add(g * PAGE_SIZE + i)) };
                assert_eq!(m, b, "region {r} page {g} byte {i} (mapping)");
            }
        }
    }

    // Region 1 unplugged (QEMU's `object_del`: unmapped, its memfd closed): its agent
    // tells memfoldd why it detaches, then its connection ends; region 0's goes on.
    drop(fd_b);
    // SAFETY: region 1's mapping, made above; nothing touches it from here on.
    let unmapped = unsafe { libc::munmap(ptr_b as *mut libc::c_void, PAGES_B * PAGE_SIZE) };
    assert_eq!(unmapped, 0);
    let t = Instant::now();
    loop {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no RegionUnmapped from the unplugged region's agent"
        );
        match c_b.recv::<ToDaemon>() {
            Ok(Some((ToDaemon::RegionUnmapped, _))) => break,
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("the connection ended without a RegionUnmapped"),
        }
    }
    let t = Instant::now();
    while !matches!(c_b.recv::<ToDaemon>(), Ok(None)) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the connection stays"
        );
    }
    let c_a = &conns.iter().find(|c| c.0 != b_name).unwrap().1;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(1) {
        assert!(
            !matches!(
                c_a.recv::<ToDaemon>(),
                Ok(Some((ToDaemon::RegionUnmapped, _))) | Ok(None)
            ),
            "region 0's agent detached too"
        );
    }
}
