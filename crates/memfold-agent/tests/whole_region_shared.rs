//! A region whose every page is shared is not a region unplugged: once each page is on a
//! pool frame, the region's memfd is mapped nowhere in the process (the frames' mappings
//! replaced it), and the hot-unplug watcher, which looked only for the memfd's own
//! mapping, detached the agent at its second look. Its userfaultfd closed with it, so the
//! pool frames stayed mapped writable with no write-protection: the guest's next write
//! went into the frame every sharer of it reads. Here the "guest" shares all of its 8
//! pages, waits 7 s (two watch periods of 2 s each, and room for a detach to be told on a
//! loaded machine), mapping a file shared each second so that the watcher looks at each
//! period (it looks after such a mapping, else only every 8 s), and writes one page: the
//! agent is still attached (no `RegionUnmapped`), breaks copy-on-write, and the frame
//! keeps its bytes.
//!
//! Seen failing with the watcher's old rule (the memfd's mapping anywhere): the frame was
//! written, and the agent said `RegionUnmapped`.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{inked, page_of, shared_page_by_page, text, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd::pread_exact;
use memfold_wire::ToDaemon;

const PAGES: usize = 8;

#[test]
fn a_region_shared_whole_stays_attached_and_write_protected() {
    let dir = tempfile::tempdir().unwrap();
    let (_fd, ptr, c, pool, _store) = shared_page_by_page(dir.path(), PAGES, text);

    // 7 s: past two watch periods (2 s each), reading what the agent says meanwhile and
    // mapping a file shared each second (the watcher looks after each).
    c.set_recv_timeout(Duration::from_millis(100)).unwrap();
    let t = Instant::now();
    let mut mapped = 0;
    while t.elapsed() < Duration::from_millis(7000) {
        if t.elapsed().as_secs() >= mapped {
            map_a_file_shared();
            mapped += 1;
        }
        match c.recv::<ToDaemon>() {
            Ok(Some((ToDaemon::RegionUnmapped, _))) => {
                panic!("a region shared whole was taken for one unplugged")
            }
            Ok(None) => panic!("the agent's connection ended"),
            _ => {}
        }
    }

    write(ptr, 3, &inked(3));
    for g in 0..PAGES {
        let want = if g == 3 { inked(3) } else { text(g) };
        assert!(page_of(ptr, g) == want, "page {g} differs");
        let mut f = vec![0u8; PAGE_SIZE];
        pread_exact(pool.as_fd(), &mut f, (g * PAGE_SIZE) as u64).unwrap();
        assert!(
            f == text(g),
            "frame {g} was written through the guest's mapping"
        );
    }
    let broken = common::next(&c, |m| match m {
        ToDaemon::CowBroken { breaks } => Some(breaks.clone()),
        _ => None,
    });
    assert_eq!(broken.len(), 1, "one break: {broken:?}");
}

/// Maps a page of a new memfd shared, as QEMU maps a hot-plugged backend (an `mmap` the
/// agent's interposer counts), so that the watcher looks at its next period.
fn map_a_file_shared() {
    common::filled_region("not-guest-ram", 1, |_| Vec::new());
}
