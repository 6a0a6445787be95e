//! Reading ahead (`ahead.rs`): the next waiting read's disk bytes are read while a large
//! read is copied, used only for exactly that read, and never after a write or discard.

use super::*;

/// Data bytes of each read: large enough for the device to look at the next request.
const BIG: u32 = ahead::AHEAD_MIN as u32;

/// Submits a read of `len` bytes at disk byte `off` into guest RAM at `buf`, its
/// header at `hdr` (each request its own: all are read after all are submitted).
fn submit_read(r: &mut Rig, hdr: u64, off: u64, buf: u64, len: u32) {
    r.header(hdr, vb::VIRTIO_BLK_T_IN, off / SECTOR);
    r.submit(&[(hdr, 16, false), (buf, len, true), (STATUS, 1, true)]);
}

fn guest(r: &Rig, at: u64, len: u32) -> &[u8] {
    &r.local.bytes()[at as usize..at as usize + len as usize]
}

/// Reads waiting together: after a large read the next one's bytes are read while it
/// is copied, after a small one not, and each lands exactly as the disk has it. Fails if
/// a read ahead is given to a read of another range (a wrong offset), if the device
/// stops reading ahead, or if it looks past small reads.
#[test]
fn the_next_waiting_read_is_read_ahead_and_lands_as_the_disk_has_it() {
    for overlay in [false, true] {
        let mut r = rig(overlay);
        let (a, b, c, d) = (40 * 4096u64, 3 * 4096u64, 0, 100 * 4096u64);
        submit_read(&mut r, 0x8000, a, DATA, BIG);
        submit_read(&mut r, 0x8100, b, DATA + BIG as u64, BIG);
        // Read ahead too (after a large one), but not looked past: small.
        submit_read(&mut r, 0x8200, c, 0x9000, 4096);
        // Into the first one's buffer, served after it.
        submit_read(&mut r, 0x8300, d, DATA, BIG);
        assert_eq!(r.run(), vec![BIG + 1, BIG + 1, 4096 + 1, BIG + 1]);
        assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
        let data = r.data.clone();
        let disk = |at: u64, len: u32| &data[at as usize..][..len as usize];
        assert!(
            guest(&r, DATA + BIG as u64, BIG) == disk(b, BIG),
            "b, overlay {overlay}"
        );
        assert!(
            guest(&r, 0x9000, 4096) == disk(c, 4096),
            "c, overlay {overlay}"
        );
        assert!(guest(&r, DATA, BIG) == disk(d, BIG), "d, overlay {overlay}");
        let n = r.dev.counters();
        assert_eq!(
            (n.reads, n.read_ahead, n.read_ahead_dropped),
            (4, 2, 0),
            "{n:?}"
        );
        assert_eq!(n.disk_read_bytes, 3 * BIG as u64 + 4096);
        assert!(!r.dev.ahead.is_pending());
        // Reported pages name their base blocks, those read ahead as the others.
        let rec = r.rec.0.lock().unwrap();
        assert_eq!(rec.len(), 3 * BIG as usize / 4096 + 1);
        assert!(rec
            .iter()
            .all(|(_, l)| matches!(l.source, Source::Base { .. })));
    }
}

/// Bytes read ahead of a range a write then changes are dropped: the read after the
/// write gets the written bytes, and after a discard the base's again. Fails if a
/// request other than a read leaves the read ahead for the next read of its range.
#[test]
fn a_write_or_discard_drops_what_was_read_ahead_of_its_range() {
    let mut r = rig(true);
    // One whole overlay cluster (64 KiB): a discard drops only whole ones.
    let off = 16 * 4096u64;
    let new: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    // A read ahead of [off, off + BIG) under way, as one started while a request before
    // the write was copied (a guest that changed a chain it had made available, or a
    // write on another queue).
    let disk = Arc::clone(&r.dev.disk);
    r.dev.ahead.start(&disk, off, BIG as u64);
    drop(disk);
    assert!(r.dev.ahead.is_pending());
    r.gm.write_slice(&new, GuestAddress(DATA)).unwrap();
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, off / SECTOR);
    r.submit(&[(0x8000, 16, false), (DATA, BIG, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    submit_read(&mut r, 0x8100, off, DATA + BIG as u64, BIG);
    assert_eq!(r.run(), vec![BIG + 1]);
    assert!(
        guest(&r, DATA + BIG as u64, BIG) == &new[..],
        "the written bytes"
    );
    assert_eq!(r.dev.counters().read_ahead, 0);
    assert_eq!(r.dev.counters().read_ahead_dropped, 1);

    // The same with a discard: the range reads as the base again.
    let disk = Arc::clone(&r.dev.disk);
    r.dev.ahead.start(&disk, off, BIG as u64);
    drop(disk);
    let range = (off / SECTOR, (BIG as u64 / SECTOR) as u32, 0);
    let discarded = r.ranges(vb::VIRTIO_BLK_T_DISCARD, &[range]);
    assert_eq!(discarded, vb::VIRTIO_BLK_S_OK as u8);
    submit_read(&mut r, 0x8300, off, DATA, BIG);
    assert_eq!(r.run(), vec![BIG + 1]);
    let d = r.data.clone();
    assert!(
        guest(&r, DATA, BIG) == &d[off as usize..][..BIG as usize],
        "the base's bytes"
    );
    let c = r.dev.counters();
    assert_eq!((c.read_ahead, c.read_ahead_dropped), (0, 2), "{c:?}");
}

/// A chain after a large read that is not a read of the disk — a write, another type
/// shaped as a read, a read past the disk's end, a header split over two descriptors —
/// starts no read ahead, and each request is answered as it would be without one.
/// Fails if the look at the next chain skips any of those checks (a read ahead started
/// for one is dropped: `read_ahead_dropped`).
#[test]
fn only_a_read_inside_the_disk_is_read_ahead() {
    let mut r = rig(true);
    submit_read(&mut r, 0x8000, 0, DATA, BIG);
    r.header(0x8100, vb::VIRTIO_BLK_T_OUT, 0);
    r.submit(&[
        (0x8100, 16, false),
        (0x9000, 4096, false),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![BIG + 1, 1]);
    // A type the device does not serve, shaped as a read (a writable 4 KiB buffer).
    submit_read(&mut r, 0x8000, 0, DATA, BIG);
    r.header(0x8100, 99, 0);
    r.submit(&[(0x8100, 16, false), (0x9000, 4096, true), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![BIG + 1, 1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_UNSUPP as u8);
    submit_read(&mut r, 0x8000, 0, DATA, BIG);
    submit_read(
        &mut r,
        0x8100,
        (1 << 20) - 4096,
        DATA + BIG as u64,
        2 * 4096,
    );
    assert_eq!(r.run(), vec![BIG + 1, 1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    submit_read(&mut r, 0x8000, 0, DATA, BIG);
    r.header(0x8100, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[
        (0x8100, 8, false),
        (0x8108, 8, false),
        (DATA + BIG as u64, 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![BIG + 1, 4096 + 1]);
    let c = r.dev.counters();
    assert_eq!(
        (c.read_ahead, c.read_ahead_dropped, c.io_errors),
        (0, 0, 1),
        "{c:?}"
    );
    assert!(!r.dev.ahead.is_pending());
}

/// Reads one at a time (nothing waits behind them): once a read continues the one
/// before it, the range after it is read ahead while the guest takes it — as long as
/// the longer of the two — and a read inside that range is served from it, at its
/// offset in it; a read elsewhere drops it and reads the disk. Fails if a read ahead is
/// used at the wrong offset, if a random read starts one, or if streams are not seen.
#[test]
fn a_sequential_stream_s_next_range_is_read_ahead_and_served_where_it_falls() {
    let mut r = rig(false);
    let data = r.data.clone();
    let p = 4096u64;
    // (disk byte, length, read ahead used so far, dropped so far)
    let steps = [
        (0, 4 * p, 0, 0),  // the stream's first read: nothing guessed
        (4 * p, p, 0, 0),  // continues it: [5p, 9p) guessed (the longer, 4 pages)
        (6 * p, p, 1, 0),  // inside the guess, one page in: served from it (no stream)
        (20 * p, p, 1, 0), // random: no guess before it, none after
        (21 * p, p, 1, 0), // continues it: [22p, 23p) guessed
        (22 * p, p, 2, 0), // served from it; [23p, 24p) guessed
        (50 * p, p, 2, 1), // elsewhere: the guess dropped, read from the disk
    ];
    for (i, &(off, len, used, dropped)) in steps.iter().enumerate() {
        // Each into a fresh page of guest RAM, so a read that landed nothing shows.
        let at = DATA + i as u64 * 4 * p;
        r.gm.write_slice(&vec![0xee; len as usize], GuestAddress(at))
            .unwrap();
        submit_read(&mut r, 0x8000, off, at, len as u32);
        assert_eq!(r.run(), vec![len as u32 + 1], "step {i}");
        assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8, "step {i}");
        assert!(
            guest(&r, at, len as u32) == &data[off as usize..][..len as usize],
            "step {i}: the bytes at disk byte {off}"
        );
        let c = r.dev.counters();
        assert_eq!(
            (c.read_ahead, c.read_ahead_dropped),
            (used, dropped),
            "step {i}"
        );
    }
    // The last read continued nothing: no guess under way.
    assert!(!r.dev.ahead.is_pending());
    // Read from the disk: 8 pages by the reads themselves (all but the two served from
    // guesses), 6 by the three guesses, the dropped one included.
    assert_eq!(r.dev.counters().disk_read_bytes, 14 * p);
}

/// A base rewritten in place after a range of it was read ahead: the read of that
/// range is refused as a read of the changed base is (IOERR), not served the bytes read
/// before the change, and no page of it is reported by base block. Fails if a read ahead
/// is served without checking the base first.
#[test]
fn bytes_read_ahead_of_a_base_that_changed_since_are_not_served() {
    for overlay in [false, true] {
        let mut r = rig(overlay);
        let off = 16 * 4096u64;
        let disk = Arc::clone(&r.dev.disk);
        r.dev.ahead.start(&disk, off, BIG as u64);
        drop(disk);
        // The read ahead's 64 KiB done (checked below: it read without error), past a
        // coarse timestamp tick; then one byte rewritten with its own value (only the
        // times change).
        std::thread::sleep(std::time::Duration::from_millis(300));
        let (at, byte) = (off as usize + 100, r.data[off as usize + 100]);
        use std::os::unix::fs::FileExt;
        let base = std::fs::OpenOptions::new()
            .write(true)
            .open(r._dir.path().join("base.img"))
            .unwrap();
        base.write_all_at(&[byte], at as u64).unwrap();
        r.gm.write_slice(&vec![0xee; BIG as usize], GuestAddress(DATA))
            .unwrap();
        submit_read(&mut r, 0x8000, off, DATA, BIG);
        assert_eq!(r.run(), vec![1], "overlay {overlay}");
        assert_eq!(
            r.status(),
            vb::VIRTIO_BLK_S_IOERR as u8,
            "overlay {overlay}"
        );
        assert!(guest(&r, DATA, BIG).iter().all(|&b| b == 0xee));
        assert!(r.rec.0.lock().unwrap().is_empty(), "overlay {overlay}");
        let c = r.dev.counters();
        assert_eq!((c.read_ahead, c.read_ahead_dropped), (0, 1), "{c:?}");
        // It was read before the change (else its own check refused it: no test).
        assert_eq!(r.dev.ahead.read_bytes, BIG as u64, "overlay {overlay}");
    }
}

/// A read of three blocks read ahead, two of them held by frames: those two are filled
/// and not written, the third is written from the bytes read ahead and reported by its
/// base block. Fails if a read served from a read ahead writes over filled pages or
/// reports them.
#[test]
fn a_read_served_from_a_read_ahead_leaves_the_pages_frames_filled() {
    let mut r = rig(false);
    let c = read_blocks_2_to_4_two_held(&mut r, |r| {
        let disk = Arc::clone(&r.dev.disk);
        r.dev.ahead.start(&disk, 2 * 4096, 3 * 4096);
    });
    assert_eq!(
        (c.filled, c.read_ahead, c.disk_read_bytes),
        (2, 1, 3 * 4096),
        "{c:?}"
    );
}

/// A device with a read rate (each read waits its turn) reads nothing ahead, neither
/// the next waiting read nor a stream's guess, and serves every read as the disk has
/// it. Fails if the rate no longer turns reading ahead off.
#[test]
fn a_device_with_a_read_rate_reads_nothing_ahead() {
    let mut r = rig(false);
    let mut cfg = r.dev.cfg.clone();
    cfg.read_bytes_per_sec = Some(1 << 30);
    let base = RawDisk::open(&r._dir.path().join("base.img")).unwrap();
    r.dev = BlkBackend::new(cfg, Box::new(base), Box::new(r.rec.clone()));
    r.dev.acked_features(r.dev.features());
    submit_read(&mut r, 0x8000, 0, DATA, BIG);
    submit_read(&mut r, 0x8100, BIG as u64, DATA + BIG as u64, BIG);
    assert_eq!(r.run(), vec![BIG + 1, BIG + 1]);
    assert!(guest(&r, DATA, 2 * BIG) == &r.data[..2 * BIG as usize]);
    assert!(!r.dev.ahead.is_pending(), "no guess after the stream");
    let c = r.dev.counters();
    assert_eq!((c.read_ahead, c.read_ahead_dropped), (0, 0), "{c:?}");
}
