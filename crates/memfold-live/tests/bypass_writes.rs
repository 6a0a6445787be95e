//! Writes to guest RAM that do not come from a vCPU or QEMU's own stores: `/proc/PID/mem`,
//! `process_vm_writev`, `pwrite` on the RAM memfd and a second mapping of it (what a
//! vhost-user backend or any holder of the memfd has). memfold guards guest RAM through
//! QEMU's mapping of it (userfaultfd on that range); this test pins what each kind of
//! write does to a page in each home, as observed on this kernel:
//!
//! | write | shared | stored | private, armed by the clock | reclaimed zero |
//! |---|---|---|---|---|
//! | `/proc/PID/mem` | refused (EIO) | refused | refused | refused |
//! | `process_vm_writev` | caught (CoW break) | caught (decoded) | caught (minor fault) | caught (refilled) |
//! | `pwrite` to the memfd | invisible, then lost | fails closed | seen by the guest, not the agent | refilled with the write |
//! | second mapping | invisible, then lost | fails closed | seen by the guest, not the agent | refilled with the write |
//!
//! "Fails closed" is tested in a child process (memfold-agent's `tests/fail_closed.rs`):
//! the agent here aborts on failing closed, which would end this test binary, so those
//! writes are not made here. A private page that is mapped writable (no clock armed it)
//! takes a `/proc/PID/mem` write without any fault (the second test). docs/security.md
//! says which of these are in scope.

mod common;

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{fast_engine, start_agent, start_memfoldd, wait_for, GuestRam, PAGE};
use memfold_core::sim::texty;
use memfold_core::Policy;
use memfold_live::query_stats;
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// The bytes every bypass write writes, at [`AT`] of its page.
const BYTES: [u8; 16] = [0xab; 16];
/// Where in the page.
const AT: usize = 64;

/// The writes that bypass the vCPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Write {
    /// `pwrite` to `/proc/self/mem` at the page's address (what a debugger does).
    ProcMem,
    /// `process_vm_writev` into this process at the page's address.
    VmWritev,
    /// `pwrite` to the RAM memfd at the page's offset.
    Pwrite,
    /// A store through a second shared mapping of the RAM memfd.
    SecondMapping,
}

/// Where a page lives when the write comes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Home {
    Shared,
    Stored,
    /// Private, its PTE dropped and write-protected by the clock.
    ArmedPrivate,
    ReclaimedZero,
}

/// What a write does, all of it observed and asserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// The write fails with EIO and nothing changes: the kernel's access to another
    /// mm for /proc/PID/mem may not drop the mmap lock, so it may not wait for a
    /// userfaultfd, and the fault fails (as SIGBUS would) instead of reaching the agent.
    Refused,
    /// A fault the agent serves (CoW break, decode, refill, minor), as for a vCPU's store:
    /// `process_vm_writev` pins the pages with a lock it may drop, so it can wait. The
    /// guest reads the new bytes; a shared page's other sharers keep the old ones.
    Caught,
    /// No fault; the bytes land in the memfd under a shared page, which the guest does not
    /// read (it reads the pool frame): invisible, and lost at the next CoW break, which
    /// copies the frame over them.
    InvisibleThenLost,
    /// No fault; the bytes fill the memfd's hole under a reclaimed zero page, which makes
    /// it exactly the zero page with the write. The guest's next access is a minor fault
    /// (the memfd has the page) that the agent serves as a refill: the page is private
    /// again, and the guest reads the write.
    Refilled,
    /// No fault; the bytes fill the memfd's hole under a stored page, where they cannot be
    /// merged with it (the rest reads as zeros). The guest's next access fails closed:
    /// tested in a child process (memfold-agent's `tests/fail_closed.rs`), not here.
    FailsClosed,
    /// No fault; the guest reads the new bytes (same page cache), but the agent never saw
    /// the write: the clock misses the M bit.
    Unseen,
}

/// The table in the module docs.
fn expected(w: Write, h: Home) -> Outcome {
    use Outcome::*;
    match (w, h) {
        (Write::ProcMem, _) => Refused,
        (Write::VmWritev, _) => Caught,
        (_, Home::Shared) => InvisibleThenLost,
        (_, Home::Stored) => FailsClosed,
        (_, Home::ReclaimedZero) => Refilled,
        (_, Home::ArmedPrivate) => Unseen,
    }
}

/// Writes [`BYTES`] at [`AT`] of page `g` the `w` way (`second`: the second mapping).
fn bypass_write(ram: &GuestRam, second: *mut u8, w: Write, g: usize) -> io::Result<usize> {
    let addr = ram.page_ptr(g) as u64 + AT as u64;
    let off = (g * PAGE + AT) as u64;
    match w {
        Write::ProcMem => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/self/mem")?
            .write_at(&BYTES, addr),
        Write::VmWritev => {
            let local = libc::iovec {
                iov_base: BYTES.as_ptr() as *mut libc::c_void,
                iov_len: BYTES.len(),
            };
            let remote = libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: BYTES.len(),
            };
            // SAFETY: reads BYTES, writes guest RAM of this process, which no Rust
            // reference points into.
            let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }
        Write::Pwrite => ram.fd.write_at(&BYTES, off),
        Write::SecondMapping => {
            for (i, &b) in BYTES.iter().enumerate() {
                // SAFETY: within the second mapping, which spans the memfd.
                unsafe { second.add(off as usize + i).write_volatile(b) };
            }
            Ok(BYTES.len())
        }
    }
}

/// Maps the RAM memfd a second time, shared, outside the agent's userfaultfd: only after
/// the agent found guest RAM (it looks for a mapping of the RAM's size).
fn second_mapping(ram: &GuestRam) -> *mut u8 {
    // SAFETY: a new shared mapping of the memfd at an address the kernel picks; never
    // unmapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            ram.bytes(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&ram.fd),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p as *mut u8
}

/// Faults the agent has served and reported (it reports about once a second).
fn faults(socket: &std::path::Path) -> u64 {
    let s = query_stats(socket).unwrap();
    let v = &s.vms[0];
    v.wp_faults + v.missing_faults + v.minor_faults
}

/// Reads page `g` through guest RAM on another thread (the access may stall).
fn read_async(ram: &Arc<GuestRam>, g: usize) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    let ram = ram.clone();
    std::thread::spawn(move || {
        let mut p = vec![0u8; PAGE];
        ram.read(g, &mut p);
        let _ = tx.send(p);
    });
    rx
}

/// `page` with [`BYTES`] at [`AT`].
fn written(page: &[u8]) -> Vec<u8> {
    let mut p = page.to_vec();
    p[AT..AT + BYTES.len()].copy_from_slice(&BYTES);
    p
}

#[test]
fn each_bypass_write_on_each_page_home_does_what_the_table_says() {
    const WRITES: [Write; 4] = [
        Write::ProcMem,
        Write::VmWritev,
        Write::Pwrite,
        Write::SecondMapping,
    ];
    // In the order of the ranges of guest RAM they start in.
    const HOMES: [Home; 4] = [
        Home::Shared,
        Home::Stored,
        Home::ArmedPrivate,
        Home::ReclaimedZero,
    ];
    // 128 pages for each home: copies of one page, text, random, zeros.
    let dir = tempfile::tempdir().unwrap();
    let socket = start_memfoldd(dir.path(), fast_engine());
    let ram = Arc::new(GuestRam::new("bypass-de-ram", 512));
    let mut rng = SmallRng::seed_from_u64(14);
    let mut template = vec![0u8; PAGE];
    rng.fill(&mut template[..]);
    let mut before = vec![vec![0u8; PAGE]; ram.pages];
    for (g, p) in before.iter_mut().enumerate() {
        match g / 128 {
            0 => p.copy_from_slice(&template),
            1 => texty(&mut rng, p),
            2 => rng.fill(&mut p[..]),
            _ => {}
        }
        ram.write(g, 0, p);
    }
    start_agent(&socket, "bypass-de", &ram);
    // Every page in its home, and the private ones armed by three clock passes since the
    // guest last touched them (it never touches them again until the writes).
    wait_for(
        &socket,
        Duration::from_secs(40),
        "pages in every home",
        |s| {
            let v = &s.vms[0];
            v.shared_pages >= 128
                && v.patched_pages + v.compressed_pages >= 128
                && v.zero_reclaimed_pages >= 128
                && v.clock_passes >= 3
        },
    );
    let second = second_mapping(&ram);

    // Page `k` of each home's range takes write `k`.
    let page = |h: Home, w: Write| {
        let k = WRITES.iter().position(|&x| x == w).unwrap();
        k + 128 * HOMES.iter().position(|&x| x == h).unwrap()
    };
    // Each is in its home, checked without touching it through guest RAM.
    for w in WRITES {
        for h in HOMES {
            let g = page(h, w);
            let (on_pool, data) = (ram.on_pool(g), ram.has_data(g));
            match h {
                Home::Shared => assert!(on_pool && !data, "gfn {g} is not shared"),
                // A hole under a mapping of guest RAM: stored (text) or reclaimed (zeros).
                Home::Stored | Home::ReclaimedZero => assert!(!on_pool && !data, "gfn {g}"),
                Home::ArmedPrivate => assert!(!on_pool && data, "gfn {g} is not private"),
            }
        }
    }

    // The writes. Which of them fault: the ones that do not are done first, and the
    // agent's reports after them must show no fault at all.
    let mut results = Vec::new();
    let quiet = faults(&socket);
    for w in [Write::ProcMem, Write::Pwrite, Write::SecondMapping] {
        for h in HOMES {
            if expected(w, h) == Outcome::FailsClosed {
                continue;
            }
            results.push((w, h, bypass_write(&ram, second, w, page(h, w))));
        }
    }
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        faults(&socket),
        quiet,
        "/proc/PID/mem, pwrite and a second mapping raise no userfaultfd fault"
    );
    for h in HOMES {
        results.push((
            Write::VmWritev,
            h,
            bypass_write(&ram, second, Write::VmWritev, page(h, Write::VmWritev)),
        ));
    }
    let refills = wait_for(
        &socket,
        Duration::from_secs(5),
        "process_vm_writev faults",
        |s| {
            let v = &s.vms[0];
            v.wp_faults + v.missing_faults + v.minor_faults >= quiet + 4
        },
    )
    .vms[0]
        .refills;

    // What the guest reads now.
    for &(w, h, ref r) in &results {
        let g = page(h, w);
        let outcome = expected(w, h);
        eprintln!("{w:?} on a {h:?} page (gfn {g}): {r:?}, expected: {outcome:?}");
        let old = &before[g];
        let mut memfd_now = vec![0u8; PAGE];
        if outcome == Outcome::Refused {
            let e = r.as_ref().expect_err("refused");
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "{w:?} {h:?}: {e}");
            // The memfd is as it was: a hole stays a hole.
            ram.fd.read_at(&mut memfd_now, (g * PAGE) as u64).unwrap();
            assert_eq!(ram.has_data(g), h == Home::ArmedPrivate, "{w:?} {h:?}");
            if h == Home::ArmedPrivate {
                assert!(memfd_now == *old, "{w:?} {h:?}");
            }
        } else {
            assert_eq!(r.as_ref().ok(), Some(&BYTES.len()), "{w:?} {h:?}");
        }
        // On another thread, bounded: an access the agent does not serve would never end.
        let mut now = read_async(&ram, g)
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("{w:?} {h:?}: the guest's access stalls"));
        if outcome != Outcome::Refused {
            // Every write that is not refused is in the memfd, whatever the guest reads.
            // Read after the guest's access: a page caught (decoded, then written) may have
            // gone cold and been stored again since, which the access undoes.
            ram.fd.read_at(&mut memfd_now, (g * PAGE) as u64).unwrap();
            assert_eq!(memfd_now[AT..AT + 16], BYTES, "{w:?} {h:?}");
        }
        match outcome {
            Outcome::Refused | Outcome::InvisibleThenLost => {
                assert!(now == *old, "{w:?} {h:?}: the guest reads the page it had");
            }
            Outcome::Caught | Outcome::Unseen | Outcome::Refilled => {
                assert!(
                    now == written(old),
                    "{w:?} {h:?}: the guest reads the write"
                );
                assert!(!ram.on_pool(g) && ram.has_data(g), "{w:?} {h:?}: private");
            }
            Outcome::FailsClosed => unreachable!("not written here"),
        }
        if outcome == Outcome::InvisibleThenLost {
            assert!(ram.on_pool(g), "{w:?}: still shared");
            // The guest's own write breaks CoW: the frame is copied over the bypass bytes.
            ram.write(g, 1024, &[7u8; 8]);
            ram.read(g, &mut now);
            let mut expect = old.clone();
            expect[1024..1032].fill(7);
            assert!(
                now == expect,
                "{w:?}: the bypass bytes are gone after a CoW break"
            );
        }
    }
    // The other sharers of the template still read it.
    let mut sibling = vec![0u8; PAGE];
    ram.read(100, &mut sibling);
    assert!(sibling == template);

    // A shared page whose PTE is dropped (MADV_DONTNEED) is taken for discarded, as QEMU
    // discards memfd-backed RAM (a punch, then MADV_DONTNEED; the agent's `discard`
    // module): it leaves its frame and reads as zeros — it never stalls, and never reads
    // the frame's bytes through a mapping the agent no longer tracks.
    let g = page(Home::Shared, Write::ProcMem);
    assert!(ram.on_pool(g), "still shared");
    // SAFETY: drops the PTE of one page of guest RAM, which no Rust reference points into.
    let rc = unsafe { libc::madvise(ram.page_ptr(g).cast(), PAGE, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0, "{}", io::Error::last_os_error());
    // The kernel lets madvise return once the agent has *read* the remove event, before
    // the agent has mapped guest RAM back over the frame: a read in between refaults the
    // pool page and sees the frame's bytes — this guest's own bytes, which it gave away
    // (no other guest's), so nothing leaks; the agent's remap ends the window.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ram.on_pool(g) {
        assert!(
            std::time::Instant::now() < deadline,
            "a discarded shared page still on its frame after 5 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let now = read_async(&ram, g)
        .recv_timeout(Duration::from_secs(5))
        .expect("a shared page read after MADV_DONTNEED stalls");
    assert!(
        now.iter().all(|&b| b == 0),
        "a discarded page reads as zeros"
    );
    assert!(!ram.on_pool(g), "a discarded page leaves its frame");
    // A write lands in the guest's own RAM; the frame, and so the other sharers, keep the
    // template.
    ram.write(g, 0, &[9u8; 8]);
    ram.read(g, &mut sibling);
    assert!(sibling[..8] == [9u8; 8] && sibling[8..].iter().all(|&b| b == 0));
    ram.read(100, &mut sibling);
    assert!(sibling == template, "the frame was written through");

    // Each write onto a reclaimed zero page was a refill, as memfoldd was told.
    let written_zero = results
        .iter()
        .filter(|r| expected(r.0, r.1) == Outcome::Refilled)
        .count() as u64;
    assert_eq!(written_zero, 2);
    wait_for(&socket, Duration::from_secs(5), "refills reported", |s| {
        s.vms[0].refills >= refills + written_zero
    });
}

#[test]
fn proc_mem_writes_a_private_page_no_clock_armed_without_a_fault() {
    // Sharing only, no clock: private pages stay mapped writable.
    let dir = tempfile::tempdir().unwrap();
    let engine = memfold_core::EngineConfig {
        clock_interval_us: None,
        policy: Policy::sharing_only(),
        ..fast_engine()
    };
    let socket = start_memfoldd(dir.path(), engine);
    let ram = Arc::new(GuestRam::new("bypass-sharing-ram", 256));
    let mut rng = SmallRng::seed_from_u64(15);
    let mut template = vec![0u8; PAGE];
    rng.fill(&mut template[..]);
    let mut before = vec![vec![0u8; PAGE]; ram.pages];
    for (g, p) in before.iter_mut().enumerate() {
        match g / 64 {
            0 => p.copy_from_slice(&template),
            1 => rng.fill(&mut p[..]),
            _ => {}
        }
        ram.write(g, 0, p);
    }
    start_agent(&socket, "bypass-sharing", &ram);
    wait_for(&socket, Duration::from_secs(20), "shared pages", |s| {
        s.vms[0].shared_pages >= 64
    });
    let quiet = faults(&socket);
    let (shared, private) = (1, 65);
    assert!(ram.on_pool(shared) && !ram.on_pool(private) && ram.has_data(private));
    let no_second = std::ptr::null_mut();
    let e = bypass_write(&ram, no_second, Write::ProcMem, shared).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EIO),
        "a shared page refuses it"
    );
    assert_eq!(
        bypass_write(&ram, no_second, Write::ProcMem, private).unwrap(),
        BYTES.len()
    );
    let mut now = vec![0u8; PAGE];
    ram.read(private, &mut now);
    assert!(now == written(&before[private]));
    ram.read(shared, &mut now);
    assert!(now == template);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(faults(&socket), quiet, "no fault: the PTE was writable");
}
