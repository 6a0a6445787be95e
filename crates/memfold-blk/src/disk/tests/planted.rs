//! Files planted at the names the device keeps next to an overlay (a read-only review):
//! the stamp was read with `read_to_string` (a link followed, no bound) and the stamp's
//! temporary file and the dirty marker were opened for writing without `O_NONBLOCK`, so a
//! FIFO at one of those names held the device's start for good and a link to `/dev/zero`
//! at the stamp's was read until memory ran out; and a hard link at a name the device
//! writes was emptied (`O_TRUNC`), whatever file it pointed to.

use super::*;

/// A FIFO at `p`.
fn mkfifo(p: &Path) {
    let mode = rustix::fs::Mode::from_raw_mode(0o600);
    rustix::fs::mknodat(rustix::fs::CWD, p, rustix::fs::FileType::Fifo, mode, 0).unwrap();
}

/// `OverlayDisk::open(base, ov)`'s error (`None`: it opened, and was closed), run in a
/// thread: a panic if it does not return within 10 s (an open waiting on a FIFO would
/// hang the test).
fn open_at_once(base: &Path, ov: &Path) -> Option<DiskError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (b, o) = (base.to_path_buf(), ov.to_path_buf());
    std::thread::spawn(move || tx.send(OverlayDisk::open(&b, &o).err()));
    match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(e) => e,
        Err(_) => panic!("the open did not return within 10 s"),
    }
}

/// [`open_at_once`]'s error: a panic if it opened.
fn open_err_at_once(base: &Path, ov: &Path) -> DiskError {
    open_at_once(base, ov).expect("opened")
}

#[test]
fn a_fifo_a_link_or_a_huge_file_at_the_stamp_or_marker_name_is_refused_at_once() {
    let (_d, base, ov, _) = base_and_overlay(27);
    let stamp = stamp_path(&ov);
    let is = |e: &DiskError, stamp_err: bool, want: &str| {
        let kind = match stamp_err {
            true => matches!(e, DiskError::Stamp { .. }),
            false => matches!(e, DiskError::Marker { .. }),
        };
        assert!(kind && e.to_string().contains(want), "{e}");
    };
    mkfifo(&stamp);
    is(&open_err_at_once(&base, &ov), true, "a FIFO");
    std::fs::remove_file(&stamp).unwrap();
    // Not followed: read, it would never end.
    std::os::unix::fs::symlink("/dev/zero", &stamp).unwrap();
    is(&open_err_at_once(&base, &ov), true, "a symbolic link");
    std::fs::remove_file(&stamp).unwrap();
    // Read no further than any stamp can be long.
    std::fs::File::create(&stamp)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    is(&open_err_at_once(&base, &ov), true, "more than 4096 bytes");
    std::fs::remove_file(&stamp).unwrap();
    // The names the device writes (the stamp's temporary file, at the first open; the
    // dirty marker) are made anew: a FIFO there is not waited on, and a hard link there
    // to another file (here the base's bytes stand for it) is not emptied.
    let mut tmp = stamp.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let marker = dirty_path(&ov);
    let _ = std::fs::remove_file(&marker);
    mkfifo(&tmp);
    mkfifo(&marker);
    assert!(open_at_once(&base, &ov).is_none(), "served");
    assert!(stamp.is_file() && !tmp.exists());
    let victim = base.with_file_name("victim");
    std::fs::write(&victim, b"not the device's").unwrap();
    std::fs::remove_file(&stamp).unwrap();
    let _ = std::fs::remove_file(&marker);
    std::fs::hard_link(&victim, &tmp).unwrap();
    std::fs::hard_link(&victim, &marker).unwrap();
    assert!(open_at_once(&base, &ov).is_none(), "served");
    assert_eq!(std::fs::read(&victim).unwrap(), b"not the device's");
    assert!(stamp.is_file());
}
