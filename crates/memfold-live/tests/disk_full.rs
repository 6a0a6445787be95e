//! A fault injected on the live path (issue 14): the guests' swap files live on a file
//! system that fills up (a tmpfs of 128 KiB), so memfoldd's writes of swapped pages fail
//! with ENOSPC part-way through a run under a host budget far below the guest's RAM. This
//! test process plays QEMU (guest RAM a memfd mapping, the real agent in a thread,
//! memfoldd in another). The guest must read every byte it wrote, memfoldd must stay up,
//! swap only what fits and leave the rest in guest RAM, and its books must account for
//! every byte its stores and swap files hold.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{fast_engine, start_agent, start_memfoldd, wait_for, GuestRam, PAGE};
use memfold_core::sim::texty;
use memfold_core::EngineConfig;
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGES: usize = 1792;

/// A tmpfs of `kib` KiB at `dir`, unmounted when dropped.
struct Tmpfs<'a>(&'a Path);

impl<'a> Tmpfs<'a> {
    fn mount(dir: &'a Path, kib: u64) -> Tmpfs<'a> {
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={kib}k,mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .expect("mount runs")
            .success();
        assert!(ok, "mount a tmpfs at {} (needs root)", dir.display());
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.0).status();
    }
}

#[test]
fn a_full_swap_disk_leaves_pages_in_guest_ram_and_loses_nothing() {
    let work = tempfile::tempdir().unwrap();
    let _fs = Tmpfs::mount(work.path(), 128);
    let engine = EngineConfig {
        // Far below the guest's RAM: every cold page is wanted in the swap file, whose
        // disk holds 32 pages.
        host_budget: Some(1 << 20),
        ..fast_engine()
    };
    let socket = start_memfoldd(work.path(), engine);
    let ram = GuestRam::new("disk-full-ram", PAGES);
    let mut rng = SmallRng::seed_from_u64(21);
    let mut want = vec![vec![0u8; PAGE]; PAGES];
    for (g, p) in want.iter_mut().enumerate() {
        if g % 2 == 0 {
            rng.fill(&mut p[..]);
        } else {
            texty(&mut rng, p);
        }
        ram.write(g, 0, p);
    }
    start_agent(&socket, "disk-full", &ram);
    // Swapping starts, then the disk is full: swap-outs keep being wanted for a while.
    wait_for(&socket, Duration::from_secs(30), "a swap-out", |s| {
        s.swap.swapped_pages > 0
    });
    let t = Instant::now();
    let mut page = vec![0u8; PAGE];
    let mut reads = 0u64;
    while t.elapsed() < Duration::from_secs(6) {
        // The guest keeps reading (and so decoding back) some pages meanwhile.
        let g = rng.gen_range(0..PAGES);
        ram.read(g, &mut page);
        assert!(page == want[g], "gfn {g} reads bytes it did not write");
        reads += 1;
        if reads % 64 == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let s = memfold_live::query_stats(&socket).expect("memfoldd is up after ENOSPC");
    assert!(
        s.swap.file_pages * PAGE as u64 <= 128 << 10,
        "more swap than the disk holds: {:?}",
        s.swap
    );
    assert!(
        s.blob_write_errors > 0,
        "no swap-out ever failed: the disk never filled ({:?})",
        s.swap
    );
    assert_eq!(
        s.held.unbooked(),
        0,
        "bytes held past the books: {:?}",
        s.held
    );
    for (g, w) in want.iter().enumerate() {
        ram.read(g, &mut page);
        assert!(page == *w, "gfn {g} reads bytes it did not write");
    }
}
