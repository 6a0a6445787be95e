//! The device's tests on virtio-queue's mock queue.

use super::*;
use crate::disk::{OverlayDisk, RawDisk};
use crate::landed::{DiskId, Landed, Source};
use crate::mem::tests::Local;
use crate::mem::RamFile;
use memfold_ids::Gfn;
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};

const WRITE: u16 = 2;
const NEXT: u16 = 1;
/// Where the tests' data buffers start (the rings are below).
const DATA: u64 = 0x10000;
const STATUS: u64 = 0x3f000;

/// A guest: RAM (a memfd the device reaches as "QEMU" = this process), the same RAM
/// as the driver's GuestMemoryMmap, a queue of 16 on it, and the device.
struct Rig {
    local: Local,
    /// Leaked: the mock queue borrows it for the rig's life (one per test).
    gm: &'static GuestMemoryMmap<()>,
    mock: MockSplitQueue<'static, GuestMemoryMmap<()>>,
    next_desc: u16,
    queue: Queue,
    dev: BlkBackend,
    _dir: tempfile::TempDir,
    data: Vec<u8>,
    rec: Recorder,
    /// Requests submitted so far (the mock's ring holds 8, see `submit`).
    submitted: usize,
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7) ^ (i >> 9)) as u8).collect()
}

fn rig(overlay: bool) -> Rig {
    let local = Local::new(64);
    let f = std::fs::File::open(format!("/proc/self/fd/{}", local._fd.as_raw_fd())).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .unwrap();
    let gm: &'static GuestMemoryMmap<()> = Box::leak(Box::new(
        GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            local.len,
            Some(FileOffset::new(f, 0)),
        )])
        .unwrap(),
    ));
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let base = dir.path().join("base.img");
    let data = pattern(1 << 20);
    std::fs::write(&base, &data).unwrap();
    let disk: Box<dyn Disk> = if overlay {
        let ov = dir.path().join("ov.qcow2");
        crate::disk::create_overlay(&base, &ov).unwrap();
        Box::new(OverlayDisk::open(&base, &ov).unwrap())
    } else {
        Box::new(RawDisk::open(&base).unwrap())
    };
    let cfg = BlkConfig {
        socket: "/nonexistent".into(),
        serial: "memfold-data".into(),
        queues: 1,
        expected_qemu: None,
        read_bytes_per_sec: None,
    };
    let mock = MockSplitQueue::new(gm, 16);
    let queue = mock.create_queue::<Queue>().unwrap();
    let rec = Recorder::default();
    let mut dev = BlkBackend::new(cfg, disk, Box::new(rec.clone()));
    // As Linux's driver: every feature offered accepted, `VIRTIO_BLK_F_FLUSH` among them.
    dev.acked_features(dev.features());
    Rig {
        local,
        gm,
        mock,
        next_desc: 0,
        queue,
        dev,
        _dir: dir,
        data,
        rec,
        submitted: 0,
    }
}

impl Rig {
    /// Puts a request header at `at` and submits a chain of (addr, len, writable).
    fn submit(&mut self, descs: &[(u64, u32, bool)]) {
        // Chains are consumed before the next is submitted: reuse the table from 0
        // when it would run past its end. At most 8 requests per rig: the mock's avail
        // ring does not wrap, and virtio-queue 0.18's mock lays the used ring right
        // after 8 of its entries (avail at 256, used at 276 for a queue of 16), so a 9th
        // entry lands on the used ring (measured: the 9th request's head read back as 1).
        assert!(
            self.submitted < 8,
            "a 9th request on one rig: the mock's avail ring would spill onto its used ring"
        );
        self.submitted += 1;
        if self.next_desc as usize + descs.len() > 16 {
            self.next_desc = 0;
        }
        let first = self.next_desc;
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, w))| {
                let last = i + 1 == descs.len();
                let flags = if w { WRITE } else { 0 } | if last { 0 } else { NEXT };
                RawDescriptor::from(SplitDescriptor::new(a, l, flags, first + i as u16 + 1))
            })
            .collect();
        self.mock.add_desc_chains(&raw, first).unwrap();
        self.next_desc += descs.len() as u16;
    }

    fn header(&self, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        self.gm.write_slice(&h, GuestAddress(at)).unwrap();
    }

    /// Runs the device; returns the used lengths of the chains it completed.
    fn run(&mut self) -> Vec<u32> {
        let mem = Arc::new(RemoteMemory::new(
            self.local.mem.qemu().clone(),
            self.local.mem.regions().to_vec(),
        ));
        let before = self.mock.used().idx().load();
        self.dev
            .process_queue(&mut self.queue, &mem, false)
            .unwrap();
        let after = self.mock.used().idx().load();
        (before..after)
            .map(|i| {
                self.mock
                    .used()
                    .ring()
                    .ref_at(i as usize % 16)
                    .unwrap()
                    .load()
                    .len()
            })
            .collect()
    }

    fn status(&self) -> u8 {
        self.gm.read_obj::<u8>(GuestAddress(STATUS)).unwrap()
    }

    /// Submits one discard or write-zeroes request, `kind`, of the ranges `(sector,
    /// sectors, flags)` (`struct virtio_blk_discard_write_zeroes`, at 0x8100 behind its
    /// header at 0x8000) and runs the device; returns the request's status.
    fn ranges(&mut self, kind: u32, ranges: &[(u64, u32, u32)]) -> u8 {
        let mut d = Vec::new();
        for &(sector, n, flags) in ranges {
            d.extend_from_slice(&sector.to_le_bytes());
            d.extend_from_slice(&n.to_le_bytes());
            d.extend_from_slice(&flags.to_le_bytes());
        }
        self.gm.write_slice(&d, GuestAddress(0x8100)).unwrap();
        self.header(0x8000, kind, 0);
        self.submit(&[
            (0x8000, 16, false),
            (0x8100, d.len() as u32, false),
            (STATUS, 1, true),
        ]);
        assert_eq!(self.run(), vec![1]);
        self.status()
    }

    /// The driver's reset of a broken queue, as vhost-user-backend ends it
    /// (`SET_VRING_KICK` marks the queue ready); the ring is the rig's as it was.
    fn reset_queue(&mut self) {
        assert!(!self.queue.ready(), "the queue is not broken");
        self.queue.set_ready(true);
    }
}

/// A sink that keeps every report, shared with the test.
#[derive(Clone, Default)]
struct Recorder(Arc<std::sync::Mutex<Vec<(RamFile, Landed)>>>);

impl LandedSink for Recorder {
    fn landed(&mut self, ram: RamFile, pages: &[Landed]) {
        self.0
            .lock()
            .unwrap()
            .extend(pages.iter().map(|p| (ram, *p)));
    }
}

#[test]
fn a_read_lands_in_guest_ram_with_its_status_and_its_pages_are_reported() {
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 8); // disk byte 4096
    r.submit(&[
        (0x8000, 16, false),
        (DATA, 3 * 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![3 * 4096 + 1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(
        &r.local.bytes()[DATA as usize..DATA as usize + 3 * 4096],
        &r.data[4096..4 * 4096]
    );
    let c = r.dev.counters();
    assert_eq!((c.reads, c.read_bytes, c.landed_base), (1, 3 * 4096, 3));
}

/// A device killed between a request's `add_used` and its notification: the restarted
/// device's first pass on the ring notifies the guest though nothing new waits (it would
/// wait on that request for good), and later empty passes do not.
#[test]
fn the_first_pass_on_a_restarted_ring_notifies_the_guest_with_nothing_to_serve() {
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 8);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    // Completed in the used ring; its notification is what the kill lost.
    assert_eq!(r.run(), vec![4096 + 1]);
    // The new device's ring, started by QEMU at the used index (`SET_VRING_BASE`).
    let mut q = r.mock.create_queue::<Queue>().unwrap();
    q.set_next_avail(1);
    let mem = RemoteMemory::new(r.local.mem.qemu().clone(), r.local.mem.regions().to_vec());
    let s = r.dev.process_queue(&mut q, &mem, true).unwrap();
    assert_eq!((s.notify, s.pending), (true, false), "{s:?}");
    assert_eq!(q.next_used(), 1);
    let s = r.dev.process_queue(&mut q, &mem, false).unwrap();
    assert_eq!(s, Served::default());
}

/// A request over scattered pages (a guest's `O_DIRECT` buffer) reads its descriptors
/// from one window of the table, not one remote read each, and still lands every page
/// where its descriptor says. Fails if the view stops windowing descriptor reads.
#[test]
fn a_chain_s_descriptors_are_read_in_one_window_and_each_page_lands_where_its_descriptor_says() {
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    // 12 data pages, every other page from DATA, backwards: no two adjacent.
    let pages: Vec<u64> = (0..12).rev().map(|i| DATA + 2 * i * 4096).collect();
    let mut chain = vec![(0x8000, 16, false)];
    chain.extend(pages.iter().map(|&p| (p, 4096, true)));
    chain.push((STATUS, 1, true));
    r.submit(&chain);
    assert_eq!(r.run(), vec![12 * 4096 + 1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    for (k, &p) in pages.iter().enumerate() {
        assert_eq!(
            &r.local.bytes()[p as usize..p as usize + 4096],
            &r.data[k * 4096..(k + 1) * 4096],
            "page {k}"
        );
    }
    let reads = r.dev.counters().ring_reads;
    assert!(
        reads < chain.len() as u64 / 2,
        "{reads} ring reads for a chain of {} descriptors",
        chain.len()
    );
}

fn disk_id(r: &Rig) -> DiskId {
    DiskId::of_metadata(&std::fs::metadata(r._dir.path().join("base.img")).unwrap())
}

#[test]
fn landed_pages_are_named_by_file_page_and_base_block_and_partial_pages_are_not() {
    let mut r = rig(false);
    let id = disk_id(&r);
    // 3 pages from disk byte 8192 into a buffer starting mid-page: two whole pages.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16);
    r.submit(&[
        (0x8000, 16, false),
        (DATA + 2048, 3 * 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![3 * 4096 + 1]);
    let got = r.rec.0.lock().unwrap().clone();
    let file = r.local.mem.regions()[0].file;
    // Page DATA/4096 + 1 holds disk bytes 8192+2048.. (not a whole block): not
    // reported; whole pages whose disk offset is unaligned are left out too.
    assert!(got.is_empty(), "{got:?}");
    // Aligned: disk byte 8192 into page DATA: blocks 2, 3.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16);
    r.submit(&[
        (0x8000, 16, false),
        (DATA, 2 * 4096, true),
        (STATUS, 1, true),
    ]);
    r.run();
    let got = r.rec.0.lock().unwrap().clone();
    let g = (DATA / 4096) as u32;
    assert_eq!(
        got,
        vec![
            (
                file,
                Landed {
                    gfn: Gfn(g),
                    source: Source::Base { disk: id, block: 2 }
                }
            ),
            (
                file,
                Landed {
                    gfn: Gfn(g + 1),
                    source: Source::Base { disk: id, block: 3 }
                }
            ),
        ]
    );
}

#[test]
fn malformed_requests_get_ioerr_or_break_the_queue_and_nothing_outside_is_written() {
    let mut r = rig(false);
    let guard = r.local.bytes()[DATA as usize..DATA as usize + 8192].to_vec();
    // Past the end of the 1 MiB disk.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 2047);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(
        &r.local.bytes()[DATA as usize..DATA as usize + 8192],
        &guard[..]
    );
    // Not whole sectors.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[(0x8000, 16, false), (DATA, 1000, true), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    // A short header.
    r.submit(&[(0x8000, 8, false), (DATA, 4096, true), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    // A data buffer outside guest RAM: IOERR, the status still written.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[
        (0x8000, 16, false),
        (1 << 40, 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    // No writable byte at all: not completed, the queue broken until reset.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[(0x8000, 16, false)]);
    assert_eq!(r.run(), Vec::<u32>::new());
    assert!(!r.queue.ready());
    r.reset_queue();
    // A status byte outside guest RAM: the same.
    r.submit(&[(0x8000, 16, false), (1 << 40, 1, true)]);
    assert_eq!(r.run(), Vec::<u32>::new());
    r.reset_queue();
    // A write to the read-only disk.
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, 0);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    // An unknown type.
    r.header(0x8000, 99, 0);
    r.submit(&[(0x8000, 16, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_UNSUPP as u8);
    let c = r.dev.counters();
    // Five answered IOERR, two that broke the queue; the read of zero bytes whose
    // status could not be written counts as a read.
    assert_eq!(
        (c.io_errors, c.dropped, c.unsupported, c.reads, c.read_bytes),
        (5, 2, 1, 1, 0)
    );
    assert_eq!(
        &r.local.bytes()[DATA as usize..DATA as usize + 8192],
        &guard[..]
    );
    assert!(r.rec.0.lock().unwrap().is_empty());
}

#[test]
fn get_id_answers_the_serial_and_the_config_space_says_the_capacity() {
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_GET_ID, 0);
    r.submit(&[(0x8000, 16, false), (DATA, 20, true), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![21]);
    assert_eq!(
        &r.local.bytes()[DATA as usize..DATA as usize + 13],
        b"memfold-data\0"
    );
    let c = r.dev.config_space();
    assert!(
        c.len() >= 60,
        "struct virtio_blk_config, 60 bytes up to its discard fields"
    );
    assert_eq!(
        u64::from_le_bytes(c[..8].try_into().unwrap()),
        (1 << 20) / 512
    );
    assert_ne!(r.dev.features() & 1 << vb::VIRTIO_BLK_F_RO, 0);
    assert_eq!(r.dev.get_config(56, 8).len(), 8);
}

#[test]
fn an_overlay_disk_takes_writes_reads_them_back_as_overlay_and_discards_to_the_base() {
    let mut r = rig(true);
    assert_eq!(r.dev.features() & 1 << vb::VIRTIO_BLK_F_RO, 0);
    r.gm.write_slice(&[0x5a; 4096], GuestAddress(DATA)).unwrap();
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, 8);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    r.header(0x8000, vb::VIRTIO_BLK_T_FLUSH, 0);
    r.submit(&[(0x8000, 16, false), (STATUS, 1, true)]);
    r.run();
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[
        (0x8000, 16, false),
        (DATA + 4096, 2 * 4096, true),
        (STATUS, 1, true),
    ]);
    r.run();
    let b = &r.local.bytes()[DATA as usize + 4096..DATA as usize + 3 * 4096];
    assert_eq!(&b[4096..], &[0x5a; 4096]);
    // The rest of the 64 KiB cluster was copied from the base.
    assert_eq!(&b[..4096], &r.data[..4096]);
    let got: Vec<Source> = r.rec.0.lock().unwrap().iter().map(|x| x.1.source).collect();
    assert_eq!(got, vec![Source::Overlay, Source::Overlay]);
    // Discard the cluster: it reads as the base again, reported as base blocks.
    let discarded = r.ranges(vb::VIRTIO_BLK_T_DISCARD, &[(0, 128, 0)]);
    assert_eq!(discarded, vb::VIRTIO_BLK_S_OK as u8);
    r.rec.0.lock().unwrap().clear();
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 8);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    r.run();
    assert_eq!(
        &r.local.bytes()[DATA as usize..DATA as usize + 4096],
        &r.data[4096..8192]
    );
    let id = disk_id(&r);
    assert_eq!(
        r.rec.0.lock().unwrap()[0].1.source,
        Source::Base { disk: id, block: 1 }
    );
}

mod full_disk;
mod hostile_ring;
mod read_ahead;
mod write_through;
mod write_zeroes;

/// memfoldd and the agent as a fill sees them (Satori §5.2): blocks held, and a fill
/// that maps a "frame" over each asked page still beginning with the nonce. Its frames
/// hold a marker, not the block, so that a test sees the device did not write a page
/// it was told is filled. `answer: false`: memfoldd never answers.
struct FakeFrames {
    ram: std::fs::File,
    held: std::collections::HashSet<memfold_ids::BaseBlock>,
    answer: bool,
    marker: u8,
    reports: Arc<std::sync::Mutex<Vec<Landed>>>,
    /// Every fill's nonce, answered or not.
    nonces: Arc<std::sync::Mutex<Vec<[u64; 2]>>>,
}

impl LandedSink for FakeFrames {
    fn landed(&mut self, _ram: RamFile, pages: &[Landed]) {
        self.reports.lock().unwrap().extend_from_slice(pages);
    }
    fn held(&self, b: memfold_ids::BaseBlock) -> bool {
        self.held.contains(&b)
    }
    fn holds_any(&self) -> bool {
        !self.held.is_empty()
    }
    fn fill(
        &self,
        _ram: RamFile,
        pages: &[(Gfn, memfold_ids::BaseBlock)],
        nonce: [u64; 2],
        wait: std::time::Duration,
    ) -> Vec<Gfn> {
        use std::os::unix::fs::FileExt;
        self.nonces.lock().unwrap().push(nonce);
        if !self.answer {
            // As memfold-wire's reporter: no answer is the whole wait.
            std::thread::sleep(wait);
            return Vec::new();
        }
        let want = super::fill::nonce_bytes(nonce);
        let mut out = Vec::new();
        for &(g, _) in pages {
            let mut head = [0u8; 16];
            self.ram.read_exact_at(&mut head, g.offset()).unwrap();
            if head == want {
                self.ram
                    .write_all_at(&[self.marker; 4096], g.offset())
                    .unwrap();
                out.push(g);
            }
        }
        out
    }
}

fn fake_frames(r: &Local, held: &[u64], id: DiskId, answer: bool) -> FakeFrames {
    FakeFrames {
        ram: std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", r._fd.as_raw_fd()))
            .unwrap(),
        held: held
            .iter()
            .map(|&block| memfold_ids::BaseBlock { disk: id, block })
            .collect(),
        answer,
        marker: 0xee,
        reports: Default::default(),
        nonces: Default::default(),
    }
}

/// Reads blocks 2, 3 and 4 into `DATA` with blocks 2 and 3 held by frames (memfoldd
/// answering), `before` run first on the rig: checks that the two held pages are filled
/// and not written, that block 4 lands as the disk has it and alone is reported, and
/// returns the counters.
fn read_blocks_2_to_4_two_held(r: &mut Rig, before: impl FnOnce(&mut Rig)) -> Counters {
    let id = disk_id(r);
    let fake = fake_frames(&r.local, &[2, 3], id, true);
    let reports = fake.reports.clone();
    r.dev.sink = Box::new(fake);
    before(r);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16); // blocks 2, 3, 4
    r.submit(&[
        (0x8000, 16, false),
        (DATA, 3 * 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![3 * 4096 + 1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    let b = &r.local.bytes()[DATA as usize..];
    assert!(
        b[..8192].iter().all(|&x| x == 0xee),
        "filled pages not written"
    );
    assert_eq!(&b[8192..12288], &r.data[16384..20480], "block 4");
    let got = reports.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "only the page written is reported: {got:?}");
    assert_eq!(got[0].source, Source::Base { disk: id, block: 4 });
    r.dev.counters()
}

/// A read of three blocks, two held: those two pages are filled (and left as the frame
/// holds them: the marker), the third read from the disk and reported; a read of held
/// blocks only never reads the disk.
#[test]
fn reads_of_held_blocks_are_filled_and_the_device_writes_only_the_rest() {
    let mut r = rig(false);
    let c = read_blocks_2_to_4_two_held(&mut r, |_| {});
    assert_eq!((c.fill_asked, c.filled, c.reads_from_frames), (2, 2, 0));
    // Blocks 2, 3 alone: served from frames, no disk read.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16);
    r.submit(&[
        (0x8000, 16, false),
        (DATA + 16384, 2 * 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![2 * 4096 + 1]);
    assert_eq!(r.dev.counters().reads_from_frames, 1);
    assert_eq!(r.dev.counters().read_bytes, 3 * 4096 + 2 * 4096);
}

/// memfoldd not answering: the device reads the disk and writes every page, its nonce
/// overwritten — the guest reads the disk's bytes.
#[test]
fn a_fill_not_answered_leaves_the_disk_to_serve_the_read() {
    let mut r = rig(false);
    let id = disk_id(&r);
    r.dev.sink = Box::new(fake_frames(&r.local, &[2, 3], id, false));
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16);
    r.submit(&[
        (0x8000, 16, false),
        (DATA, 2 * 4096, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![2 * 4096 + 1]);
    assert_eq!(
        &r.local.bytes()[DATA as usize..DATA as usize + 8192],
        &r.data[8192..16384]
    );
    let c = r.dev.counters();
    assert_eq!((c.fill_asked, c.filled), (2, 0));
    // Held off (fill.rs, `Backoff`): the next read asks nothing, so waits for nothing.
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![4096 + 1]);
    assert_eq!(
        r.dev.counters().fill_asked,
        2,
        "a fill asked while held off"
    );
}

/// A disk whose reads fail (EIO), its sources and base those of the disk it wraps.
struct FailingReads(Box<dyn Disk>);

impl Disk for FailingReads {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        self.0.read_only()
    }
    fn can_discard(&self) -> bool {
        false
    }
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<Vec<crate::disk::Extent>, DiskError> {
        Err(DiskError::Io {
            path: "failing".into(),
            op: "read",
            off,
            len: buf.len() as u64,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        })
    }
    fn write(&self, off: u64, buf: &[u8]) -> Result<(), DiskError> {
        self.0.write(off, buf)
    }
    fn flush(&self) -> Result<(), DiskError> {
        self.0.flush()
    }
    fn discard(&mut self, off: u64, len: u64) -> Result<(), DiskError> {
        self.0.discard(off, len)
    }
    fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> Result<(), DiskError> {
        self.0.write_zeroes(off, len, unmap)
    }
    fn sources(&self, off: u64, len: u64) -> Result<Option<Vec<crate::disk::Extent>>, DiskError> {
        self.0.sources(off, len)
    }
    fn base_file(&self) -> Option<(DiskId, std::os::fd::OwnedFd)> {
        self.0.base_file()
    }
}

/// memfoldd slow to answer a fill, then the disk read fails: the guest gets its buffer
/// back with an error, and no page of it may still begin with the nonce, or the late
/// fill would map the block's frame over whatever the guest writes there next.
#[test]
fn a_read_that_fails_after_an_unanswered_fill_leaves_no_nonce_for_a_late_fill() {
    let mut r = rig(false);
    let id = disk_id(&r);
    let fake = fake_frames(&r.local, &[2, 3], id, false);
    let nonces = fake.nonces.clone();
    r.dev.sink = Box::new(fake);
    let base = RawDisk::open(&r._dir.path().join("base.img")).unwrap();
    r.dev.disk = Arc::new(FailingReads(Box::new(base)));
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 16); // blocks 2, 3, 4: two held
    r.submit(&[
        (0x8000, 16, false),
        (DATA, 3 * 4096, true),
        (STATUS, 1, true),
    ]);
    r.run();
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    let asked = nonces.lock().unwrap().clone();
    assert_eq!(asked.len(), 1, "one fill asked");
    let nonce = super::fill::nonce_bytes(asked[0]);
    let b = &r.local.bytes()[DATA as usize..];
    for page in 0..2 {
        assert_ne!(
            &b[page * 4096..page * 4096 + 16],
            &nonce[..],
            "page {page} still begins with the nonce"
        );
    }
}
