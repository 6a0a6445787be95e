//! Write-zeroes (`VIRTIO_BLK_F_WRITE_ZEROES`): a range reads as zeros afterwards, whatever
//! the overlay or the base held there, with or without unmap; flags a request's type does
//! not know are UNSUPP and change nothing; a request with one bad range changes nothing.

use super::*;

/// Reads `len` bytes at disk byte `off` into the data buffer; returns them and the
/// sources the device reported for their pages.
fn read(r: &mut Rig, off: u64, len: u32) -> (Vec<u8>, Vec<Source>) {
    r.rec.0.lock().unwrap().clear();
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, off / 512);
    r.submit(&[(0x8000, 16, false), (DATA, len, true), (STATUS, 1, true)]);
    r.run();
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    let b = r.local.bytes()[DATA as usize..DATA as usize + len as usize].to_vec();
    let got = r.rec.0.lock().unwrap().iter().map(|x| x.1.source).collect();
    (b, got)
}

fn write_5a(r: &mut Rig, off: u64, len: u32) {
    r.gm.write_slice(&vec![0x5a; len as usize], GuestAddress(DATA))
        .unwrap();
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, off / 512);
    r.submit(&[(0x8000, 16, false), (DATA, len, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
}

const UNMAP: u32 = vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;

#[test]
fn an_overlay_offers_write_zeroes_with_unmap_and_a_read_only_disk_does_not() {
    let r = rig(true);
    assert_ne!(r.dev.features() & 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES, 0);
    let c = r.dev.config_space();
    let u32_at = |at: usize| u32::from_le_bytes(c[at..at + 4].try_into().unwrap());
    // The offsets of the virtio spec's layout (1.2 §5.2.4), not the structure's: a field
    // written one off would fail here.
    assert_eq!(
        u32_at(48),
        (MAX_DATA / 512) as u32,
        "max_write_zeroes_sectors"
    );
    assert_eq!(u32_at(52), MAX_DISCARD_SEG, "max_write_zeroes_seg");
    assert_eq!(c[56], 1, "write_zeroes_may_unmap");
    let mut raw = rig(false);
    assert_eq!(raw.dev.features() & 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES, 0);
    // Asked all the same: UNSUPP, the base untouched.
    assert_eq!(
        raw.ranges(vb::VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0)]),
        vb::VIRTIO_BLK_S_UNSUPP as u8
    );
    let want = raw.data[..4096].to_vec();
    assert_eq!(read(&mut raw, 0, 4096).0, want);
}

#[test]
fn write_zeroes_make_written_and_base_ranges_read_as_zeros_with_and_without_unmap() {
    let mut r = rig(true);
    // The base is never zero where the tests zero it.
    assert!(r.data[..256 << 10]
        .chunks(4096)
        .all(|p| p.iter().any(|&b| b != 0)));
    // A written page inside the first cluster.
    write_5a(&mut r, 4096, 4096);
    // Unmap over two whole 64 KiB clusters: the written one and one only the base holds.
    assert_eq!(
        r.ranges(vb::VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 256, UNMAP)]),
        vb::VIRTIO_BLK_S_OK as u8
    );
    let (b, src) = read(&mut r, 0, 128 << 10);
    assert!(b.iter().all(|&x| x == 0), "unmapped range not zeros");
    assert_eq!(src, vec![Source::Zero; 32]);
    // Without unmap (Linux's REQ_NOUNMAP), over clusters only the base holds: a page
    // inside the third cluster, a range across the fourth's end into the fifth, the
    // whole sixth, and one sector at an odd sector of the seventh: zeros exactly there,
    // the base's bytes around them, and no page reported as a base block any more.
    let k = 1024u64;
    let zeroed = [
        (132 * k, 4 * k),
        (252 * k, 8 * k),
        (320 * k, 64 * k),
        (401 * k, 512),
    ];
    let asked: Vec<(u64, u32, u32)> = zeroed
        .iter()
        .map(|&(off, len)| (off / 512, (len / 512) as u32, 0))
        .collect();
    assert_eq!(
        r.ranges(vb::VIRTIO_BLK_T_WRITE_ZEROES, &asked),
        vb::VIRTIO_BLK_S_OK as u8
    );
    let mut want = r.data.clone();
    for &(off, len) in &zeroed {
        want[off as usize..(off + len) as usize].fill(0);
    }
    // Two reads of 160 KiB (the rig's buffer holds 188 KiB, its ring 8 requests).
    for at in [128 * k, 288 * k] {
        let (b, src) = read(&mut r, at, 160 << 10);
        assert!(
            b[..] == want[at as usize..(at + 160 * k) as usize],
            "at {at}: zeros not where asked, or base bytes lost beside them"
        );
        assert!(
            src.iter().all(|s| !matches!(s, Source::Base { .. })),
            "at {at}: {src:?}"
        );
        if at == 288 * k {
            // Pages 8 to 23 of this read: the whole sixth cluster, a zero cluster.
            assert_eq!(src[8..24], [Source::Zero; 16], "the whole sixth cluster");
        }
    }
    // Zeros are not the base again: a discard would have been.
    let c = r.dev.counters();
    assert_eq!((c.write_zeroes, c.discards, c.io_errors), (2, 0, 0));
}

#[test]
fn unknown_flags_are_unsupported_and_change_nothing() {
    let mut r = rig(true);
    // A whole written cluster, which a discard or a write-zeroes would change.
    write_5a(&mut r, 0, 64 << 10);
    // A discard with the unmap flag (write-zeroes' alone), a write-zeroes with a flag
    // it does not know, and one whose unknown flag comes after a range past the disk's
    // end: UNSUPP, the written cluster still there.
    let past_end = (1u64 << 20) / 512;
    for (kind, asked) in [
        (vb::VIRTIO_BLK_T_DISCARD, vec![(0, 128, UNMAP)]),
        (vb::VIRTIO_BLK_T_WRITE_ZEROES, vec![(0, 128, 2)]),
        (
            vb::VIRTIO_BLK_T_WRITE_ZEROES,
            vec![(0, 128, UNMAP | 1 << 31)],
        ),
        (
            vb::VIRTIO_BLK_T_WRITE_ZEROES,
            vec![(past_end, 8, 0), (0, 128, 4)],
        ),
    ] {
        assert_eq!(
            r.ranges(kind, &asked),
            vb::VIRTIO_BLK_S_UNSUPP as u8,
            "type {kind} ranges {asked:?}"
        );
    }
    assert!(read(&mut r, 0, 64 << 10).0 == vec![0x5a; 64 << 10]);
    let c = r.dev.counters();
    assert_eq!((c.unsupported, c.discards, c.write_zeroes), (4, 0, 0));
}

#[test]
fn a_request_with_one_bad_range_changes_nothing() {
    let mut r = rig(true);
    // A whole written cluster: a discard of it would bring the base back, a write-zeroes
    // zeros.
    write_5a(&mut r, 0, 64 << 10);
    let past_end = (1u64 << 20) / 512 - 4;
    for kind in [vb::VIRTIO_BLK_T_WRITE_ZEROES, vb::VIRTIO_BLK_T_DISCARD] {
        assert_eq!(
            r.ranges(kind, &[(0, 128, 0), (past_end, 8, 0)]),
            vb::VIRTIO_BLK_S_IOERR as u8,
            "type {kind}"
        );
        let got = read(&mut r, 0, 64 << 10).0;
        assert!(
            got == vec![0x5a; 64 << 10],
            "type {kind}: the first range applied"
        );
    }
    // Too many ranges: IOERR before any is read.
    let many = vec![(0, 128, 0); MAX_DISCARD_SEG as usize + 1];
    assert_eq!(
        r.ranges(vb::VIRTIO_BLK_T_WRITE_ZEROES, &many),
        vb::VIRTIO_BLK_S_IOERR as u8
    );
    assert!(read(&mut r, 0, 64 << 10).0 == vec![0x5a; 64 << 10]);
}
