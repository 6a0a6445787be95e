//! A driver that did not accept `VIRTIO_BLK_F_FLUSH` (SeaBIOS's, some bootloaders') sends
//! no flush and takes every completed write as durable: each write and discard is synced
//! before it completes, and a failed sync answers IOERR. A driver that accepted it gets
//! no sync it did not ask for.

use super::*;
use std::sync::atomic::AtomicUsize;

/// A disk counting its syncs ([`Disk::flush`]), failing them when told to.
struct CountingSyncs {
    disk: Arc<dyn Disk>,
    syncs: Arc<AtomicUsize>,
    fail: bool,
}

impl Disk for CountingSyncs {
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn read_only(&self) -> bool {
        self.disk.read_only()
    }
    fn can_discard(&self) -> bool {
        self.disk.can_discard()
    }
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<Vec<crate::disk::Extent>, DiskError> {
        self.disk.read(off, buf)
    }
    fn write(&self, off: u64, buf: &[u8]) -> Result<(), DiskError> {
        self.disk.write(off, buf)
    }
    fn flush(&self) -> Result<(), DiskError> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        if self.fail {
            return Err(DiskError::Io {
                path: "counting".into(),
                op: "flush",
                off: 0,
                len: 0,
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        self.disk.flush()
    }
    fn discard(&mut self, off: u64, len: u64) -> Result<(), DiskError> {
        Arc::get_mut(&mut self.disk)
            .expect("the rig's disk, held by nothing else")
            .discard(off, len)
    }
    fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> Result<(), DiskError> {
        Arc::get_mut(&mut self.disk)
            .expect("the rig's disk, held by nothing else")
            .write_zeroes(off, len, unmap)
    }
}

/// An overlay rig whose driver accepted the device's features less `VIRTIO_BLK_F_FLUSH`
/// unless `flush`; returns it and its disk's sync count.
fn rig_acking(flush: bool, fail: bool) -> (Rig, Arc<AtomicUsize>) {
    let mut r = rig(true);
    let syncs = Arc::new(AtomicUsize::new(0));
    // The base in the overlay's place a moment (the overlay is locked: not opened twice).
    let base = RawDisk::open(&r._dir.path().join("base.img")).unwrap();
    let disk = std::mem::replace(&mut r.dev.disk, Arc::new(base));
    r.dev.disk = Arc::new(CountingSyncs {
        disk,
        syncs: syncs.clone(),
        fail,
    });
    let mut f = r.dev.features();
    if !flush {
        f &= !(1 << vb::VIRTIO_BLK_F_FLUSH);
    }
    r.dev.acked_features(f);
    (r, syncs)
}

/// One 4 KiB write at disk byte 4096; returns its status.
fn write_4k(r: &mut Rig) -> u8 {
    r.gm.write_slice(&[0x5a; 4096], GuestAddress(DATA)).unwrap();
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, 8);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    r.status()
}

/// One request of `kind` (discard, write-zeroes) over the first 64 KiB cluster; returns
/// its status.
fn drop_cluster(r: &mut Rig, kind: u32) -> u8 {
    r.ranges(kind, &[(0, 128, 0)])
}

/// Without `VIRTIO_BLK_F_FLUSH` accepted, a 4 KiB write is synced once before it
/// completes OK, and a discard and a write-zeroes too. Before, it completed with the data and qcow2 metadata
/// only written to the file (no sync): lost at a host crash though the driver never
/// flushes. Fails if the device ignores the features the driver accepted.
#[test]
fn without_flush_accepted_each_write_discard_and_write_zeroes_is_synced_before_it_completes() {
    let (mut r, syncs) = rig_acking(false, false);
    assert_eq!(write_4k(&mut r), vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(syncs.load(Ordering::SeqCst), 1, "syncs after one write");
    assert_eq!(
        drop_cluster(&mut r, vb::VIRTIO_BLK_T_DISCARD),
        vb::VIRTIO_BLK_S_OK as u8
    );
    assert_eq!(syncs.load(Ordering::SeqCst), 2, "syncs after a discard");
    let zeroes = drop_cluster(&mut r, vb::VIRTIO_BLK_T_WRITE_ZEROES);
    assert_eq!(zeroes, vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(
        syncs.load(Ordering::SeqCst),
        3,
        "syncs after a write-zeroes"
    );
    let c = r.dev.counters();
    assert_eq!(
        (c.writes, c.discards, c.write_zeroes, c.flushes),
        (1, 1, 1, 0)
    );
}

/// With `VIRTIO_BLK_F_FLUSH` accepted the cache is the guest's to flush: no sync.
#[test]
fn with_flush_accepted_a_write_is_not_synced() {
    let (mut r, syncs) = rig_acking(true, false);
    assert_eq!(write_4k(&mut r), vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(
        drop_cluster(&mut r, vb::VIRTIO_BLK_T_DISCARD),
        vb::VIRTIO_BLK_S_OK as u8
    );
    assert_eq!(syncs.load(Ordering::SeqCst), 0);
}

/// A device reset forgets the features: write-through again until they are set.
#[test]
fn after_a_reset_writes_are_synced_until_flush_is_accepted_again() {
    let (mut r, syncs) = rig_acking(true, false);
    r.dev.reset_device();
    assert_eq!(write_4k(&mut r), vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(syncs.load(Ordering::SeqCst), 1);
}

/// The sync failing: the write is answered IOERR, not OK.
#[test]
fn without_flush_accepted_a_write_whose_sync_fails_gets_ioerr() {
    let (mut r, syncs) = rig_acking(false, true);
    assert_eq!(write_4k(&mut r), vb::VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(syncs.load(Ordering::SeqCst), 1);
    let c = r.dev.counters();
    assert_eq!((c.writes, c.io_errors), (0, 1));
}
