//! No-copy-on-write for a device's whole-page writes (`nocopy.rs`, Satori §4.3): a writer
//! in another process declares in the write fence that its call overwrites whole pages
//! (`WriteFence::hold_writing`, as memfold-blk does for every write into guest RAM); the
//! first of them its call faults on breaks every one still on a frame, without a copy.
//!
//! Here guest RAM is shared whole, page by page onto its own frame. A writer process (this
//! test binary again, `child_writer`) writes pages 1, 3, 5, 7 and 9 whole and page 13 from
//! byte 100 on, in one `process_vm_writev`. Then this process's own thread — QEMU's, as
//! far as the agent can tell — declares page 15 whole and writes 8 bytes of it, as a
//! forged declaration would. Every page must read exactly what was written over the
//! frame's bytes, the frames keep theirs, and the agent must have faulted three times
//! (pages 1, 13 and 15), broken five pages without a copy and copied the other two.
//!
//! Seen failing with: no declaration trusted (7 write-protect faults, 0 no-copy breaks);
//! QEMU's own threads trusted (page 15 reads zeros past its 8 bytes); partial pages
//! declared (page 13's first 100 bytes read zeros).

mod common;

use std::os::fd::AsFd;

use common::{ink, page_of, shared_page_by_page, stats_after, text, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::fence::WriteFence;
use memfold_sys::memfd::pread_exact;

const PAGES: usize = 16;
/// Pages the writer process writes whole.
const WHOLE: [usize; 5] = [1, 3, 5, 7, 9];
/// The page it writes from byte [`FROM`] on.
const PARTIAL: usize = 13;
const FROM: usize = 100;
/// The page this process's thread declares whole and writes 8 bytes of.
const FORGED: usize = 15;

/// The writer process: `NOCOPY_TARGET=pid:addr` names this test's guest RAM; it writes
/// as the module says, holding (and declaring in) the target's write fence, in one call.
/// Run only by `a_device_s_whole_page_write_breaks_its_pages_without_a_copy`.
#[test]
#[ignore = "the writer process of the no-copy test, run by it"]
fn child_writer() {
    let target = std::env::var("NOCOPY_TARGET").expect("run by the no-copy test");
    let (pid, base) = target.split_once(':').unwrap();
    let (pid, base): (u32, u64) = (pid.parse().unwrap(), base.parse().unwrap());
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    let fence = WriteFence::of_process(pidfd.as_fd(), pid)
        .unwrap()
        .expect("the agent's fence");
    let mut parts: Vec<(u64, Vec<u8>)> = WHOLE
        .iter()
        .map(|&g| (base + (g * PAGE_SIZE) as u64, vec![ink(g); PAGE_SIZE]))
        .collect();
    parts.push((
        base + (PARTIAL * PAGE_SIZE + FROM) as u64,
        vec![ink(PARTIAL); PAGE_SIZE - FROM],
    ));
    let ranges: Vec<(u64, u64)> = parts.iter().map(|(a, b)| (*a, b.len() as u64)).collect();
    let local: Vec<libc::iovec> = parts
        .iter()
        .map(|(_, b)| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let remote: Vec<libc::iovec> = parts
        .iter()
        .map(|(a, b)| libc::iovec {
            iov_base: *a as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let total: usize = parts.iter().map(|(_, b)| b.len()).sum();
    let _hold = fence.hold_writing(&ranges);
    // SAFETY: local iovecs over this process's buffers, remote ones only addresses in
    // the target; the kernel checks both.
    let n = unsafe {
        libc::process_vm_writev(
            pid as libc::pid_t,
            local.as_ptr(),
            local.len() as libc::c_ulong,
            remote.as_ptr(),
            remote.len() as libc::c_ulong,
            0,
        )
    };
    assert_eq!(n, total as isize, "{}", std::io::Error::last_os_error());
}

#[test]
fn a_device_s_whole_page_write_breaks_its_pages_without_a_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (_fd, ptr, c, pool, _store) = shared_page_by_page(dir.path(), PAGES, text);

    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_writer", "--nocapture"])
        .env(
            "NOCOPY_TARGET",
            format!("{}:{}", std::process::id(), ptr as u64),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the writer: {}",
        String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr)
    );

    // QEMU's own thread, with a declaration the agent must not trust.
    let fence = memfold_agent::fence::write_fence().expect("the fence");
    let forged = ptr as u64 + (FORGED * PAGE_SIZE) as u64;
    {
        let _hold = fence.hold_writing(&[(forged, PAGE_SIZE as u64)]);
        write(ptr, FORGED, &[ink(FORGED); 8]);
    }

    for g in 0..PAGES {
        let mut want = text(g);
        if WHOLE.contains(&g) {
            want = vec![ink(g); PAGE_SIZE];
        } else if g == PARTIAL {
            want[FROM..].fill(ink(g));
        } else if g == FORGED {
            want[..8].fill(ink(g));
        }
        let got = page_of(ptr, g);
        assert!(
            got == want,
            "page {g} differs first at byte {:?}",
            (0..PAGE_SIZE).find(|&i| got[i] != want[i])
        );
        let mut f = vec![0u8; PAGE_SIZE];
        pread_exact(pool.as_fd(), &mut f, (g * PAGE_SIZE) as u64).unwrap();
        assert!(f == text(g), "frame {g} was written");
    }

    let r = stats_after(&c);
    let (wp, nocopy) = (r.wp_faults, r.nocopy_breaks);
    assert_eq!(nocopy, WHOLE.len() as u64, "pages broken without a copy");
    assert_eq!(wp, 3, "write-protect faults: pages 1, 13 and 15");
}
