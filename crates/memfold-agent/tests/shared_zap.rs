//! Cold shared frames to the kernel's swap (issue 15, `ToAgent::ClockScan::zap_shared`):
//! the agent drops the PTEs of guest pages mapped onto pool frames, so that a frame no
//! guest reads again is mapped by no process and a page-out of the pool (memfoldd's
//! window, as here) takes it. Then the guest reads its shared pages back as they were (the
//! kernel's swap-in, no userfault), a write to one is still a CoW break that leaves the
//! frame's bytes alone, and the agent reports nothing discarded. Needs root (a swap file
//! and zswap for the test's length; both put back).
//!
//! Seen failing with the agent taking its own zap's remove events for QEMU's discards
//! (the shared pages then read as zeros, and were reported discarded), with the zap left
//! out of the clock scan (the frames stay mapped, and nothing leaves RAM), and with the
//! runs unprotected instead of protected before their zap (the write landed in the frame,
//! which every guest sharing it would then read).

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{agent_with_pool_rbits, clock_scan_zapping, page_of, region, share, write};
use memfold_agent::ClockRBits;
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd::pread_exact;
use memfold_sys::pageout::PageOutWindow;
use memfold_sys::testing::zswap_on_one_cpu;
use memfold_wire::{BatchId, FrameId, Gfn, ToDaemon};

const PAGES: usize = 16;

/// Text-like bytes for frame or page `g` (compress well, differ by `g`).
fn text(g: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| b"a shared frame, cold "[(i * 5 + g * 3) % 21] ^ (g as u8 & 7))
        .collect()
}

#[test]
fn zapped_shared_pages_let_their_frames_go_to_zswap_and_read_back_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_zswap) = zswap_on_one_cpu() else {
        return;
    };
    // Pages 0–3 hold frame 0's bytes, 4–7 frame 1's; the rest are their own.
    let frames = [text(100), text(101)];
    let (_fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        let bytes = match g {
            0..4 => frames[0].clone(),
            4..8 => frames[1].clone(),
            _ => text(g),
        };
        write(ptr, g, &bytes);
    }
    let (c, pool, _store) = agent_with_pool_rbits(
        &dir.path().join("memfoldd.sock"),
        &frames,
        ClockRBits::Pagemap,
    );
    let pages: Vec<(Gfn, FrameId)> = (0..8u32).map(|g| (Gfn(g), FrameId(g / 4))).collect();
    let (shared, refused, changed) = share(&c, BatchId(1), pages);
    assert_eq!((shared.len(), refused.len(), changed.len()), (8, 0, 0));
    // The guest reads every shared page: both frames mapped in this process now.
    for g in 0..8 {
        assert_eq!(page_of(ptr, g), frames[g / 4], "page {g}");
    }
    let pool_window = PageOutWindow::new(pool.as_fd(), 2 * PAGE_SIZE as u64).unwrap();
    let (left, r) = pool_window.page_out_list(&[0, 1]);
    r.unwrap();
    assert_eq!(
        left,
        vec![false, false],
        "mapped by the guest: in use, left in RAM"
    );
    // The clock's pass drops the shared pages' PTEs; the guest reads frame 1's page 4
    // again (the kernel maps it back), frame 0's pages stay untouched.
    clock_scan_zapping(&c, 2, PAGES as u32, 0, 0, true);
    assert_eq!(page_of(ptr, 4), frames[1]);
    let (mut left, r) = pool_window.page_out_list(&[0, 1]);
    r.unwrap();
    // Frame 0 asked again should the kernel keep it at once (under load, a page it could
    // not isolate from its LRU), as memfoldd asks at its next round; frame 1 is mapped.
    for _ in 0..4 {
        if left[0] {
            break;
        }
        let (again, r) = pool_window.page_out_list(&[0]);
        r.unwrap();
        left[0] = again[0];
    }
    assert_eq!(
        left,
        vec![true, false],
        "frame 0, mapped nowhere now, left RAM; frame 1, read since, stayed"
    );
    // Every shared page reads as it was (frame 0's through the kernel's swap-in).
    for g in 0..8 {
        assert_eq!(page_of(ptr, g), frames[g / 4], "page {g}");
    }
    // A write to a zapped shared page is still a CoW break: the page takes the write, the
    // frame and its other pages keep their bytes.
    clock_scan_zapping(&c, 3, PAGES as u32, 0, 0, true);
    write(ptr, 2, b"written after the zap");
    let mut two = frames[0].clone();
    two[..21].copy_from_slice(b"written after the zap");
    assert_eq!(page_of(ptr, 2), two);
    let mut f0 = vec![0u8; PAGE_SIZE];
    pread_exact(pool.as_fd(), &mut f0, 0).unwrap();
    assert_eq!(f0, frames[0], "the frame kept its bytes");
    for g in [0, 1, 3] {
        assert_eq!(page_of(ptr, g), frames[0], "page {g}");
    }
    // The agent reports the write as a CoW break, and no page discarded: the zaps' remove
    // events were its own.
    let until = Instant::now() + Duration::from_secs(2);
    let mut broken = Vec::new();
    while Instant::now() < until {
        match c.recv::<ToDaemon>() {
            Ok(Some((ToDaemon::CowBroken { breaks }, _))) => {
                broken.extend(breaks.iter().map(|&(g, f)| (g.0, f.0)))
            }
            Ok(Some((ToDaemon::Discarded { pages }, _))) => {
                panic!("reported discarded: {pages:?}")
            }
            _ => {}
        }
    }
    assert_eq!(broken, vec![(2, 0)]);
}
