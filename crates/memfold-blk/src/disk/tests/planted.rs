//! Files planted at the names the device keeps next to an overlay (a read-only review):
//! the stamp was read with `read_to_string` (a link followed, no bound) and the stamp's
//! temporary file and the dirty marker were opened for writing without `O_NONBLOCK`, so a
//! FIFO at one of those names held the device's start for good and a link to `/dev/zero`
//! at the stamp's was read until memory ran out.

use super::*;

/// A FIFO at `p`.
fn mkfifo(p: &Path) {
    let mode = rustix::fs::Mode::from_raw_mode(0o600);
    rustix::fs::mknodat(rustix::fs::CWD, p, rustix::fs::FileType::Fifo, mode, 0).unwrap();
}

/// The error of `OverlayDisk::open(base, ov)`, run in a thread: a panic if it opens or
/// does not return within 10 s (an open waiting on a FIFO would hang the test).
fn open_err_at_once(base: &Path, ov: &Path) -> DiskError {
    let (tx, rx) = std::sync::mpsc::channel();
    let (b, o) = (base.to_path_buf(), ov.to_path_buf());
    std::thread::spawn(move || tx.send(OverlayDisk::open(&b, &o).err()));
    match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(Some(e)) => e,
        Ok(None) => panic!("opened"),
        Err(_) => panic!("the open did not return within 10 s"),
    }
}

#[test]
fn a_fifo_a_link_or_a_huge_file_at_the_stamp_or_marker_name_is_refused_at_once() {
    let (_d, base, ov, _) = super::across_opens::base_and_overlay(27);
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
    // The stamp's temporary file, written at the first open.
    let mut tmp = stamp.clone().into_os_string();
    tmp.push(".tmp");
    mkfifo(Path::new(&tmp));
    is(&open_err_at_once(&base, &ov), true, "a FIFO");
    std::fs::remove_file(&tmp).unwrap();
    // The dirty marker (the open above left a regular one: it was marked, then refused).
    let marker = dirty_path(&ov);
    std::fs::remove_file(&marker).unwrap();
    mkfifo(&marker);
    is(&open_err_at_once(&base, &ov), false, "a FIFO");
    std::fs::remove_file(&marker).unwrap();
    // With nothing planted it is served.
    OverlayDisk::open(&base, &ov).unwrap();
    assert!(stamp.is_file());
}
