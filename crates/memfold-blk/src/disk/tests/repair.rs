//! The dirty marker and the repair at the next open (`repair.rs`): a host crash between
//! two guest flushes can leave an L2 entry on disk without its refcount, and imago, which
//! checks nothing, would hand that cluster to the next allocating write. These tests need
//! `qemu-img` on `PATH` (scripts/setup.sh installs it): without it the repair fails and so
//! do they.

use std::os::unix::fs::FileExt;

use super::*;

/// qcow2 cluster size of `create_overlay`'s images, bytes.
const CLUSTER: u64 = 65536;
/// The host offset bits of an L1 or L2 entry (bits 9..55).
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

fn be64(b: &[u8], at: u64) -> u64 {
    u64::from_be_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
}

fn be32(b: &[u8], at: u64) -> u32 {
    u32::from_be_bytes(b[at as usize..at as usize + 4].try_into().unwrap())
}

/// What a host crash between two guest flushes can leave in the qcow2 file `ov`: guest
/// cluster `guest` mapped (its L2 entry on disk) to a host cluster whose refcount is 0
/// (its refcount block's write lost). Zeroes that refcount in place; returns the host
/// cluster's index.
fn forget_refcount(ov: &Path, guest: u64) -> u64 {
    let img = std::fs::read(ov).unwrap();
    let cluster_bits = be32(&img, 20);
    assert_eq!(1u64 << cluster_bits, CLUSTER);
    let (l1, refcount_table) = (be64(&img, 40), be64(&img, 48));
    assert_eq!(be32(&img, 96), 4, "refcount_order: 16-bit refcounts");
    // A 64 KiB L2 table maps 8192 clusters: the whole 1 MiB disk is under L1 entry 0.
    let l2 = be64(&img, l1) & OFFSET_MASK;
    let host = (be64(&img, l2 + guest * 8) & OFFSET_MASK) >> cluster_bits;
    assert_ne!(host, 0, "guest cluster {guest} is not allocated");
    // A 64 KiB refcount block counts 32768 clusters: the first one counts them all.
    let refblock = be64(&img, refcount_table) & OFFSET_MASK;
    let at = refblock + host * 2;
    assert_eq!(
        img[at as usize..at as usize + 2],
        [0, 1],
        "refcount of cluster {host}"
    );
    let f = std::fs::OpenOptions::new().write(true).open(ov).unwrap();
    f.write_all_at(&[0, 0], at).unwrap();
    host
}

#[test]
fn a_cluster_a_crash_left_mapped_without_its_refcount_is_repaired_and_not_reused() {
    let (_d, base, ov, _) = base_and_overlay(41);
    let (a, d) = (pattern(CLUSTER as usize, 42), pattern(CLUSTER as usize, 43));
    let o = OverlayDisk::open(&base, &ov).unwrap();
    // A whole cluster: allocated with no copy-on-write.
    o.write(3 * CLUSTER, &a).unwrap();
    o.flush().unwrap();
    // The device dies without a clean close: the marker stays.
    drop(o);
    assert!(dirty_path(&ov).exists());
    let host = forget_refcount(&ov, 3);
    // The reopen repairs it (qemu-img check -r all), then serves it.
    let o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(7 * CLUSTER, &d).unwrap();
    o.flush().unwrap();
    let mut b = vec![0u8; CLUSTER as usize];
    o.read(3 * CLUSTER, &mut b).unwrap();
    assert!(
        b == a,
        "offset A (cluster 3, host cluster {host}) reads {} after a write of D at cluster 7",
        if b == d { "D's bytes" } else { "other bytes" }
    );
    o.read(7 * CLUSTER, &mut b).unwrap();
    assert!(b == d, "offset D does not read D's bytes");
    assert!(dirty_path(&ov).exists(), "made anew by the open");
    drop(o);
    qemu_img(&["check", "-q", ov.to_str().unwrap()]);
}

#[test]
fn a_clean_close_removes_the_marker_and_the_next_open_runs_no_repair() {
    let (_d, base, ov, _) = base_and_overlay(44);
    let marker = dirty_path(&ov);
    assert!(!marker.exists(), "a new overlay has none");
    let mut o = OverlayDisk::open(&base, &ov).unwrap();
    assert!(marker.exists(), "made at the open, before any write");
    let a = pattern(CLUSTER as usize, 45);
    // No guest flush: the close syncs.
    o.write(2 * CLUSTER, &a).unwrap();
    o.close_clean().unwrap();
    assert!(!marker.exists(), "a clean close removes it");
    // With the marker gone a write would be unguarded: refused.
    let e = o
        .write(0, &a[..4096])
        .expect_err("a write after a clean close");
    assert!(e.to_string().contains("closed cleanly"), "{e}");
    drop(o);
    // A repair would fail (no such program): the open runs none.
    let no_qemu_img = Path::new("/nonexistent/qemu-img");
    let o = OverlayDisk::open_repairing_with(&base, &ov, true, &[no_qemu_img.as_os_str()]).unwrap();
    assert!(marker.exists());
    let mut b = vec![0u8; CLUSTER as usize];
    o.read(2 * CLUSTER, &mut b).unwrap();
    assert!(b == a);
}

#[test]
fn a_close_after_a_failed_sync_keeps_the_marker() {
    let (_d, base, ov, _) = base_and_overlay(47);
    let mut o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(0, &[1u8; 4096]).unwrap();
    // As the kernel's EIO on an fsync: latched, so no later sync is believed.
    let _ = o.sync_latch.sync(|| Err(std::io::Error::other("EIO")));
    assert!(matches!(o.close_clean(), Err(DiskError::Io { .. })));
    assert!(dirty_path(&ov).exists(), "kept: the next open repairs");
}

#[test]
fn a_repair_that_leaves_errors_or_cannot_run_refuses_the_open() {
    let (d, base, ov, _) = base_and_overlay(46);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(0, &pattern(CLUSTER as usize, 48)).unwrap();
    o.flush().unwrap();
    drop(o);
    let marker = dirty_path(&ov);
    assert!(marker.exists());

    // No qemu-img to run.
    let missing = d.path().join("no-qemu-img");
    let e = OverlayDisk::open_repairing_with(&base, &ov, true, &[missing.as_os_str()])
        .err()
        .expect("an open whose repair cannot run");
    assert!(matches!(e, DiskError::Unrepaired { .. }), "{e}");
    let msg = e.to_string();
    for want in [
        "ov.qcow2 was not closed cleanly",
        "no-qemu-img check -r all -f qcow2",
        "could not run",
        "No such file",
        "ov.qcow2.memfold-dirty",
        "by hand",
    ] {
        assert!(msg.contains(want), "{want:?} not in: {msg}");
    }
    let by_hand = format!(
        "Run `qemu-img check -r all -f qcow2 {}` by hand",
        ov.display()
    );
    assert!(msg.contains(&by_hand), "{msg}");
    assert!(marker.exists(), "kept until an open succeeds");

    // A qemu-img that finds corruptions it cannot repair (exit status 2, as qemu-img 7.2
    // words it): `sh -c SCRIPT NAME check -r all -f qcow2 OVERLAY`. Not an executable
    // file written here: another test thread forking meanwhile would make its exec fail
    // (ETXTBSY).
    let script = "echo 'ERROR cluster 5 refcount=0 reference=1' >&2; \
                  echo '1 errors were found on the image.'; \
                  echo 'Data may be corrupted, or further writes to the image may corrupt it.'; \
                  exit 2";
    let fake: [&std::ffi::OsStr; 3] = ["sh".as_ref(), "-c".as_ref(), script.as_ref()];
    let fake = [&fake[..], &["fake-qemu-img".as_ref()]].concat();
    let before = fingerprint(&ov);
    let e = OverlayDisk::open_repairing_with(&base, &ov, true, &fake)
        .err()
        .expect("an open whose repair leaves errors");
    assert!(matches!(e, DiskError::Unrepaired { .. }), "{e}");
    let msg = e.to_string();
    for want in [
        "fake-qemu-img check -r all -f qcow2",
        "exit status 2",
        "ERROR cluster 5 refcount=0 reference=1; 1 errors were found on the image.; Data may be corrupted",
        "ov.qcow2.memfold-dirty",
    ] {
        assert!(msg.contains(want), "{want:?} not in: {msg}");
    }
    assert!(marker.exists());
    assert_eq!(fingerprint(&ov), before, "nothing written");
    // Refused before the lock: nothing holds the overlay, and the real qemu-img finds
    // nothing wrong with it, so the next open serves it.
    qemu_img(&["info", ov.to_str().unwrap()]);
    OverlayDisk::open(&base, &ov).unwrap();
}
