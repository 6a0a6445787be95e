//! What holds from one open of an overlay to the next (a read-only review): the base it
//! was first served over (`stamp.rs`: a base rewritten in place between two runs was
//! served under clusters copied from its old bytes, a mix), and the overlay's lock (two
//! opens at once each cached its metadata and allocated the same clusters).

use super::*;

/// Sets the mtime of `path` to its own plus `secs` seconds: a rewrite within one
/// timestamp tick of the last would leave it unchanged (the stamp's documented limit).
fn bump_mtime(path: &Path, secs: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let m = f.metadata().unwrap().modified().unwrap();
    f.set_modified(m + std::time::Duration::from_secs(secs))
        .unwrap();
}

/// Whether this file system keeps birth times (the stamp tells an overlay made anew at a
/// path from the one stamped by it).
fn has_btime(p: &Path) -> bool {
    std::fs::metadata(p).unwrap().created().is_ok()
}

#[test]
fn a_base_rewritten_in_place_between_two_opens_is_refused_at_the_reopen() {
    let (_d, base, ov, _) = base_and_overlay(21);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    // Cluster 0 allocated; its copy-on-write fills the rest of it from the base.
    o.write(4096, &[0x5a; 4096]).unwrap();
    o.flush().unwrap();
    drop(o);
    // `dd conv=notrunc`: the same inode, the same size, other bytes in cluster 0 and
    // cluster 1.
    overwrite(&base, 8192, &[0xa5; 4096]);
    overwrite(&base, 65536, &[0xa5; 4096]);
    bump_mtime(&base, 1);
    let before = (fingerprint(&base), fingerprint(&ov));
    let e = match OverlayDisk::open(&base, &ov) {
        Err(e) => e,
        Ok(o) => {
            let mut b = vec![0u8; 2 * 65536];
            o.read(0, &mut b).unwrap();
            panic!(
                "reopened over the rewritten base: cluster 0 old ({:#x} at 8192), cluster 1 new ({:#x} at 65536)",
                b[8192], b[65536]
            );
        }
    };
    assert!(matches!(e, DiskError::BaseChangedSinceStamp { .. }), "{e}");
    let msg = e.to_string();
    for want in ["base.img", "ov.qcow2", "mtime", "ov.qcow2.memfold-base"] {
        assert!(msg.contains(want), "{want:?} not in {msg}");
    }
    // The read-only check says so too; neither file was written.
    assert!(matches!(
        check_overlay(&base, &ov),
        Err(DiskError::BaseChangedSinceStamp { .. })
    ));
    assert_eq!(before, (fingerprint(&base), fingerprint(&ov)));
}

/// A reboot may renumber the file systems (btrfs subvolumes, NFS, LVM, disks in probe
/// order): a stamp whose device numbers alone differ still names this base and overlay,
/// and the guest's disk opens. Fails with devices compared (refused as another file).
#[test]
fn a_stamp_whose_device_numbers_alone_changed_still_opens() {
    let (_d, base, ov, _) = base_and_overlay(23);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(4096, &[0x5a; 4096]).unwrap();
    o.flush().unwrap();
    drop(o);
    let path = stamp_path(&ov);
    let renumbered: String = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| match l.split_once(' ') {
            Some((k @ ("base_dev" | "overlay_dev"), v)) => {
                format!("{k} {}\n", v.parse::<u64>().unwrap() + 7)
            }
            _ => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&path, &renumbered).unwrap();
    let o = OverlayDisk::open(&base, &ov).expect("renumbered devices refused");
    let mut b = vec![0u8; 4096];
    o.read(4096, &mut b).unwrap();
    assert_eq!(b, vec![0x5a; 4096]);
}

#[test]
fn an_unchanged_base_reopens_and_the_guest_s_write_reads_back() {
    let (_d, base, ov, data) = base_and_overlay(22);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(4096, &[0x5a; 4096]).unwrap();
    o.flush().unwrap();
    drop(o);
    let stamp = std::fs::read_to_string(stamp_path(&ov)).unwrap();
    for _ in 0..2 {
        let o = OverlayDisk::open(&base, &ov).unwrap();
        let mut b = vec![0u8; 3 * 4096];
        o.read(0, &mut b).unwrap();
        assert_eq!(b[..4096], data[..4096]);
        assert_eq!(b[4096..8192], [0x5a; 4096]);
        assert_eq!(b[8192..], data[8192..3 * 4096]);
        drop(o);
        check_overlay(&base, &ov).unwrap();
    }
    assert_eq!(std::fs::read_to_string(stamp_path(&ov)).unwrap(), stamp);
    // A chmod of the base (its ctime) is no change of its bytes.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o444)).unwrap();
    OverlayDisk::open(&base, &ov).unwrap();
}

#[test]
fn a_restart_after_the_device_saw_its_base_change_is_refused_even_with_nothing_written() {
    let (_d, base, ov, data) = base_and_overlay(23);
    if !has_btime(&ov) {
        eprintln!("skipped: no birth times on this file system");
        return;
    }
    let o = OverlayDisk::open(&base, &ov).unwrap();
    let mut b = vec![0u8; 4096];
    o.read(0, &mut b).unwrap();
    // The guest's page cache now holds the old bytes; the base changes under it.
    overwrite(&base, 0, &data[..1]);
    bump_mtime(&base, 1);
    assert!(matches!(
        o.read(0, &mut b),
        Err(DiskError::BaseChanged { .. })
    ));
    drop(o);
    let e = OverlayDisk::open(&base, &ov)
        .err()
        .expect("a restart served it");
    assert!(matches!(e, DiskError::BaseChangedSinceStamp { .. }), "{e}");
}

#[test]
fn an_overlay_made_anew_over_a_rebuilt_base_is_stamped_afresh() {
    let (d, base, ov, _) = base_and_overlay(24);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(0, &[1u8; 4096]).unwrap();
    drop(o);
    let rebuilt = pattern(1 << 20, 25);
    overwrite(&base, 0, &rebuilt);
    bump_mtime(&base, 1);
    assert!(OverlayDisk::open(&base, &ov).is_err());
    // As memfold-vm's launcher does: the old overlay removed, a new one made at its path
    // (the old stamp left beside it). It holds nothing: nothing can mix.
    std::fs::remove_file(&ov).unwrap();
    qcow2_over(
        base.to_str().unwrap(),
        d.path().join("ov.qcow2").to_str().unwrap(),
        &[],
        None,
    );
    let o = OverlayDisk::open(&base, &ov).unwrap();
    let mut b = vec![0u8; 8192];
    o.read(0, &mut b).unwrap();
    assert_eq!(b, rebuilt[..8192]);
    o.write(0, &[2u8; 4096]).unwrap();
    drop(o);
    OverlayDisk::open(&base, &ov).unwrap();
    // create_overlay over the same path (qemu-img keeps the inode) after another rebuild.
    overwrite(&base, 0, &pattern(1 << 20, 26));
    bump_mtime(&base, 2);
    assert!(OverlayDisk::open(&base, &ov).is_err());
    create_overlay(&base, &ov).unwrap();
    OverlayDisk::open(&base, &ov).unwrap();
}

#[test]
fn a_second_open_of_a_served_overlay_is_refused_as_in_use() {
    let (_d, base, ov, _) = base_and_overlay(27);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    // Both open file descriptions are this process's: an OFD lock (as flock) still
    // conflicts, a POSIX one would not.
    let e = OverlayDisk::open(&base, &ov)
        .err()
        .expect("a second open of a served overlay");
    assert!(matches!(e, DiskError::InUse { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("ov.qcow2") && msg.contains("in use by another process"),
        "{msg}"
    );
    // QEMU's own locks conflict with it: qemu-img refuses the live file.
    let out = std::process::Command::new("qemu-img")
        .arg("info")
        .arg(&ov)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("lock"),
        "qemu-img opened the served overlay: {err}"
    );
    // Closing a duplicate of its descriptor (as imago's checks do) keeps the lock.
    drop(o.cache_handle.try_clone().unwrap());
    assert!(matches!(
        OverlayDisk::open(&base, &ov),
        Err(DiskError::InUse { .. })
    ));
    drop(o);
    OverlayDisk::open(&base, &ov).unwrap();
    qemu_img(&["info", ov.to_str().unwrap()]);
}

#[test]
fn a_create_refused_over_a_served_overlay_keeps_its_stamp() {
    let (_d, base, ov, data) = base_and_overlay(29);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    let stamp = stamp_path(&ov);
    assert!(stamp.is_file());
    // qemu-img's locks conflict with the device's.
    let e = create_overlay(&base, &ov).unwrap_err();
    assert!(e.to_string().contains("qemu-img create"), "{e}");
    assert!(stamp.is_file(), "the served overlay lost its stamp: {e}");
    let mut b = vec![0u8; 4096];
    o.read(0, &mut b).unwrap();
    assert_eq!(b[..], data[..4096]);
}
