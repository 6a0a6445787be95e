//! Two guests of one profile on one base (Satori §4.1's copy-on-write disks; issue 16,
//! "a write to a shared disk block lands only in that guest's overlay"): each guest's
//! writes, discards and write-zeroes change its own overlay and nothing else — the other
//! guest still reads the base's bytes there, reported as base blocks (so their pages may
//! still be shared at read), and the base file is untouched.

use super::*;

#[test]
fn a_write_to_a_shared_block_lands_only_in_that_guests_overlay() {
    let (d, base, ov_a, data) = base_and_overlay(5);
    let ov_b = d.path().join("ov-b.qcow2");
    create_overlay(&base, &ov_b).unwrap();
    let base_before = fingerprint(&base);
    let mut a = OverlayDisk::open(&base, &ov_a).unwrap();
    let b = OverlayDisk::open(&base, &ov_b).unwrap();
    let id = b.base.id();
    // Guest A writes a page of the second cluster, zeroes the third, and discards the
    // fourth after writing it.
    a.write(64 << 10, &[0xa1; 4096]).unwrap();
    a.write_zeroes(128 << 10, 64 << 10, true).unwrap();
    a.write(192 << 10, &[0xa2; 64 << 10]).unwrap();
    a.discard(192 << 10, 64 << 10).unwrap();
    a.flush().unwrap();
    // A reads its own bytes; B the base's, every page named by its base block.
    let mut buf = vec![0u8; 256 << 10];
    a.read(0, &mut buf).unwrap();
    assert_eq!(&buf[64 << 10..(64 << 10) + 4096], &[0xa1; 4096]);
    assert!(buf[128 << 10..192 << 10].iter().all(|&x| x == 0));
    assert!(
        buf[192 << 10..] == data[192 << 10..256 << 10],
        "discarded: the base again"
    );
    let ext = b.read(0, &mut buf).unwrap();
    assert!(
        buf[..] == data[..256 << 10],
        "guest B reads guest A's writes"
    );
    assert_eq!(
        ext,
        vec![Extent {
            off: 0,
            len: 256 << 10,
            source: ExtentSource::Base(id),
        }]
    );
    drop((a, b));
    assert_eq!(fingerprint(&base), base_before, "the base was written");
}
