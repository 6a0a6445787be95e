//! A guest (or its QEMU) that breaks the ring's rules gets an error for its queue, in
//! bounded time, and nothing is written outside its buffers (invariant (c) of the
//! device's threat model: no spin, no unbounded allocation, no overflow from what the
//! guest puts in its rings).

use super::*;
use std::time::Duration;

/// Runs `process_queue`; a watchdog aborts the test binary if it has not returned
/// within 5 s (a spin would otherwise hang the suite rather than fail it).
fn run_bounded(r: &mut Rig) -> Result<Served, String> {
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(5));
        if !watch.load(Ordering::Acquire) {
            eprintln!("process_queue did not return within 5 s: the device spins");
            std::process::abort();
        }
    });
    let mem = Arc::new(RemoteMemory::new(
        r.local.mem.qemu().clone(),
        r.local.mem.regions().to_vec(),
    ));
    let res = r.dev.process_queue(&mut r.queue, &mem, false);
    done.store(true, Ordering::Release);
    res.map_err(|e| e.to_string())
}

#[test]
fn an_available_index_past_the_queue_size_is_an_error_not_a_spin() {
    let mut r = rig(false);
    // 17 requests "available" on a queue of 16 (virtio 1.1 §2.6.6 forbids it); before
    // the check, virtio-queue's pop logged it and returned nothing, and the notification
    // check saw requests waiting: the device's thread spun for good.
    r.mock.avail().idx().store(u16::to_le(17));
    let e = run_bounded(&mut r).expect_err("a broken ring must be an error");
    assert!(e.contains("past the device's"), "{e}");
}

#[test]
fn an_available_ring_that_cannot_be_read_is_an_error_not_a_spin() {
    let mut r = rig(false);
    // The ring's index is the last u16 of guest RAM; its entries lie past the end.
    let end = r.local.len as u64;
    r.queue
        .set_avail_ring_address(Some((end - 4) as u32), Some(0));
    r.gm.write_obj(u16::to_le(1), GuestAddress(end - 2))
        .unwrap();
    let res = run_bounded(&mut r);
    assert!(res.is_err(), "{res:?}");
}

#[test]
fn a_status_byte_that_wraps_the_address_space_breaks_the_queue_and_writes_nothing() {
    let mut r = rig(false);
    // Data 64 KiB (128 sectors), then the status byte at `a + len - 1`, which wraps to
    // guest address 0xf000, outside every buffer the guest gave. Overflow checks
    // panicked the device's thread (its lock poisoned); without them the IOERR byte
    // went to 0xf000. No status byte to answer in: not completed, the queue broken.
    let target = 0xf000u64;
    let len = 0x1_0001u32;
    let a = target.wrapping_sub(len as u64 - 1);
    assert!(a.checked_add(len as u64).is_none());
    let before = r.local.bytes()[0x8000..0x20000].to_vec();
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[(0x8000, 16, false), (a, len, true)]);
    assert_eq!(r.run(), Vec::<u32>::new());
    assert!(
        !r.queue.ready(),
        "the queue goes on after an unanswerable request"
    );
    assert!(
        r.local.bytes()[0x8000..0x20000] == before[..],
        "guest RAM changed outside the request's buffers"
    );
    let c = r.dev.counters();
    assert_eq!((c.dropped, c.reads, c.io_errors), (1, 0, 0));
}

/// `VRING_DESC_F_INDIRECT`.
const INDIRECT: u16 = 4;

/// Where [`all_16_entries`] puts the used ring.
const USED: u64 = 0x1000;

/// Moves the queue's used ring to [`USED`], clear of the avail ring: the mock lays it
/// over the avail ring's entries from 8 on (it counts the ring's length in bytes, not
/// entries), which a test using all 16 entries would overwrite.
fn all_16_entries(r: &mut Rig) {
    r.queue.set_used_ring_address(Some(USED as u32), Some(0));
}

/// The used ring's index, and the lengths of its 16 entries.
fn used(r: &Rig) -> (u16, Vec<u32>) {
    let at = |o: u64| r.gm.read_obj::<u32>(GuestAddress(USED + o)).unwrap();
    let idx = r.gm.read_obj::<u16>(GuestAddress(USED + 2)).unwrap();
    (idx, (0..16).map(|i| at(4 + i * 8 + 4)).collect())
}

/// Sixteen chains (the queue's size), each an indirect table of the most descriptors a
/// chain may have: the pass holds one request's bounce buffers at a time, not the sum
/// of them. Before, each descriptor read pinned a buffer until the pass ended (256
/// chains of 65 535 pinned ~1.8 GB). Fails if a request's buffers outlive its answer.
#[test]
fn a_pass_of_large_indirect_chains_holds_one_request_s_bounce_buffers_not_their_sum() {
    const N: u16 = MAX_CHAIN as u16;
    const TABLE: u64 = 0x20000;
    let mut r = rig(false);
    all_16_entries(&mut r);
    r.header(0x8000, 0xff, 0); // an unsupported type: each is answered UNSUPP
    for i in 0..N {
        let (addr, len, flags) = match i {
            0 => (0x8000, 16, NEXT),
            i if i == N - 1 => (STATUS, 1, WRITE),
            _ => (0x8000, 0, NEXT),
        };
        let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, i + 1));
        r.gm.write_obj(d, GuestAddress(TABLE + i as u64 * 16))
            .unwrap();
    }
    // Every head is one descriptor naming that table (a guest may share it).
    let heads: Vec<RawDescriptor> = (0..16)
        .map(|_| SplitDescriptor::new(TABLE, N as u32 * 16, INDIRECT, 0).into())
        .collect();
    r.mock.add_desc_chains(&heads, 0).unwrap();
    let mem = RemoteMemory::new(r.local.mem.qemu().clone(), r.local.mem.regions().to_vec());
    let s = r.dev.process_queue(&mut r.queue, &mem, false).unwrap();
    assert!(!s.pending);
    assert_eq!(used(&r), (16, vec![1; 16]));
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_UNSUPP as u8);
    assert_eq!(r.dev.counters().unsupported, 16);
    let one = N as u64 * 16; // one request's descriptor reads, bytes
    let peak = r.dev.peak_bounce_bytes;
    assert!(
        peak >= one && peak < 2 * one,
        "{peak} bytes of bounce buffers held at once; one request reads {one}"
    );
}

/// A guest vCPU that re-posts the same small read as fast as the device answers,
/// 10 000 times: each call serves at most the queue's size of them and returns, saying
/// requests are left (the backend's lock is let go between calls), holds one request's
/// bounce buffers at a time, and every request is answered. Before, one call served
/// them all while its view's buffers grew with each. The disk's rate (~50 µs a read)
/// makes the device sleep mid-call, so the guest re-posts then even on one vCPU.
#[test]
fn a_guest_that_keeps_re_posting_gets_bounded_calls_and_every_request_answered() {
    const TOTAL: u64 = 10_000;
    let mut r = rig(false);
    all_16_entries(&mut r);
    r.dev.cfg.read_bytes_per_sec = Some(10_000_000);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    // Head 0, posted once.
    r.submit(&[(0x8000, 16, false), (DATA, 512, true), (STATUS, 1, true)]);
    let (gm, avail) = (r.gm, r.mock.avail_addr());
    let guest = std::thread::spawn(move || keep_reposting(gm, avail, TOTAL, || {}));
    let mem = RemoteMemory::new(r.local.mem.qemu().clone(), r.local.mem.regions().to_vec());
    let start = std::time::Instant::now();
    let (mut most, mut calls, mut left) = (0, 0u64, 0u64);
    while r.dev.counters().reads < TOTAL {
        assert!(start.elapsed() < Duration::from_secs(60), "no progress");
        let before = r.dev.counters().reads;
        let s = r.dev.process_queue(&mut r.queue, &mem, false).unwrap();
        most = most.max(r.dev.counters().reads - before);
        calls += 1;
        left += s.pending as u64;
    }
    guest.join().unwrap();
    assert!(
        most <= 16,
        "a call served {most} requests; the queue holds 16"
    );
    assert!(left > 0, "no call of {calls} said requests were left");
    assert_eq!(r.dev.counters().reads, TOTAL);
    assert_eq!(used(&r), (TOTAL as u16, vec![513; 16]), "used ring");
    let peak = r.dev.peak_bounce_bytes;
    assert!(peak <= 128, "{peak} bytes of bounce buffers held at once");
}

/// The backend's half of the bound: a call that stops with requests left kicks the
/// queue itself, so that the event loop (here: kicks alone drive `handle_event`) comes
/// back to them once the lock is let go. The guest re-posts as fast as the device
/// answers and kicks as virtio says (only while the device has notifications on), so
/// requests it posted while they were off get no kick of its. Fails without the
/// device's own kick: requests are left and nothing comes back to them.
#[test]
fn requests_a_bounded_call_leaves_are_kicked_for_and_all_answered() {
    use std::os::fd::{FromRawFd, IntoRawFd};
    use vmm_sys_util::event::{new_event_consumer_and_notifier, EventFlag};
    const TOTAL: u64 = 20_000;
    let mut r = rig(false);
    r.header(0x8000, 0xff, 0);
    r.submit(&[(0x8000, 16, false), (STATUS, 1, true)]); // head 0, posted once
    let vring = BlkVring::new(vm_memory::GuestMemoryAtomic::new(r.gm.clone()), 16).unwrap();
    vring.set_queue_size(16);
    let avail = r.mock.avail_addr();
    vring.set_queue_info(0, avail.0, USED).unwrap();
    vring.set_queue_ready(true);
    vring.set_enabled(true);
    let (kick, guest_kick) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).unwrap();
    // SAFETY: `into_raw_fd` hands over the eventfd it owned; the File owns it now.
    vring.set_kick(Some(unsafe {
        std::fs::File::from_raw_fd(kick.into_raw_fd())
    }));
    r.dev.set_memory(Some(Arc::new(RemoteMemory::new(
        r.local.mem.qemu().clone(),
        r.local.mem.regions().to_vec(),
    ))));
    guest_kick.notify().unwrap();
    let gm = r.gm;
    let guest = std::thread::spawn(move || {
        keep_reposting(gm, avail, TOTAL, || {
            // virtio 1.1 §2.6.13.6: publish the index, then read the device's flags.
            std::sync::atomic::fence(Ordering::SeqCst);
            let flags: u16 = gm.load(GuestAddress(USED), Ordering::Acquire).unwrap();
            if u16::from_le(flags) & 1 == 0 {
                guest_kick.notify().unwrap();
            }
        })
    });
    // vhost-user-backend's loop: consume a kick, handle the event.
    let mut idle = std::time::Instant::now();
    while r.dev.counters().unsupported < TOTAL {
        match vring.read_kick() {
            Ok(_) => {
                r.dev
                    .handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0)
                    .unwrap();
                idle = std::time::Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let n = r.dev.counters().unsupported;
                assert!(
                    idle.elapsed() < Duration::from_secs(5),
                    "{n} of {TOTAL} requests answered, then no kick came"
                );
                std::thread::yield_now();
            }
            Err(e) => panic!("{e}"),
        }
    }
    guest.join().unwrap();
    assert_eq!(used(&r), (TOTAL as u16, vec![1; 16]), "used ring");
}

/// A guest that breaks its ring while the device serves a request: at the first report
/// of a read, the available index is set to `to` in guest RAM (`ram`, at `at`).
struct BreaksTheRing {
    ram: std::fs::File,
    at: u64,
    to: u16,
}

impl LandedSink for BreaksTheRing {
    fn landed(&mut self, _ram: RamFile, _pages: &[Landed]) {
        use std::os::unix::fs::FileExt;
        self.ram
            .write_all_at(&self.to.to_le_bytes(), self.at)
            .unwrap();
    }
}

/// Two reads posted; while the first is served the guest sets its available index 17
/// past the device's (more than the queue holds), so the pass after it fails. The first
/// is in the used ring, so the guest is notified all the same, and the error is still
/// an error. Before, `process_queue` returned the error alone and the backend only
/// logged it: the guest never heard of the read it had been answered, and may wait on
/// it for good. Fails if a failure after a completion skips the notification.
#[test]
fn a_request_completed_before_the_ring_breaks_is_still_notified() {
    use std::os::fd::{FromRawFd, IntoRawFd};
    use vmm_sys_util::event::{new_event_consumer_and_notifier, EventFlag};
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[(0x8000, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    r.submit(&[
        (0x8000, 16, false),
        (DATA + 4096, 4096, true),
        (STATUS - 1, 1, true),
    ]);
    let avail = r.mock.avail_addr();
    r.dev.sink = Box::new(BreaksTheRing {
        ram: std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", r.local._fd.as_raw_fd()))
            .unwrap(),
        at: avail.0 + 2,
        to: 1 + 17,
    });
    let vring = BlkVring::new(vm_memory::GuestMemoryAtomic::new(r.gm.clone()), 16).unwrap();
    vring.set_queue_size(16);
    vring.set_queue_info(0, avail.0, USED).unwrap();
    vring.set_queue_ready(true);
    vring.set_enabled(true);
    let (call, guest_call) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).unwrap();
    // SAFETY: `into_raw_fd` hands over the eventfd it owned; the File owns it now.
    vring.set_call(Some(unsafe {
        std::fs::File::from_raw_fd(guest_call.into_raw_fd())
    }));
    r.dev.set_memory(Some(Arc::new(RemoteMemory::new(
        r.local.mem.qemu().clone(),
        r.local.mem.regions().to_vec(),
    ))));
    r.dev
        .handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0)
        .unwrap();
    let (idx, lens) = used(&r);
    assert_eq!((idx, lens[0]), (1, 4097), "the first read completed");
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    assert!(
        call.consume().is_ok(),
        "the guest was not notified of the read completed before the ring broke"
    );
    assert_eq!(r.dev.counters().reads, 1);
}

/// Writes `descs` (addr, len, writable) at `table` as one chain, each to the next.
fn indirect_table(r: &Rig, table: u64, descs: &[(u64, u32, bool)]) {
    for (i, &(a, len, w)) in descs.iter().enumerate() {
        let last = i + 1 == descs.len();
        let flags = if w { WRITE } else { 0 } | if last { 0 } else { NEXT };
        let d = RawDescriptor::from(SplitDescriptor::new(a, len, flags, i as u16 + 1));
        r.gm.write_obj(d, GuestAddress(table + i as u64 * 16))
            .unwrap();
    }
}

/// An indirect table claiming 65 535 descriptors (the most virtio-queue follows), its
/// entries after the header chained in a cycle: the device stops reading it past
/// `seg_max` data segments and breaks the queue, status byte untouched. Each descriptor read is
/// a 16-byte bounce buffer kept until the request is answered, so the peak counts the
/// descriptors read. Before, all 65 535 were read (each a scan of the windows and an
/// allocation; 256 such chains were ~16.7M reads under the backend's lock).
#[test]
fn a_chain_longer_than_seg_max_breaks_the_queue_unread_past_the_limit() {
    const TABLE: u64 = 0x20000;
    const CYCLE: u16 = 255;
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.gm.write_obj(0xeeu8, GuestAddress(STATUS)).unwrap();
    for i in 0..=CYCLE {
        let d = match i {
            0 => SplitDescriptor::new(0x8000, 16, NEXT, 1),
            i => SplitDescriptor::new(STATUS, 0, NEXT | WRITE, i % CYCLE + 1),
        };
        r.gm.write_obj(RawDescriptor::from(d), GuestAddress(TABLE + i as u64 * 16))
            .unwrap();
    }
    let head = SplitDescriptor::new(TABLE, u16::MAX as u32 * 16, INDIRECT, 0);
    r.mock.add_desc_chains(&[head.into()], 0).unwrap();
    run_bounded(&mut r).unwrap();
    assert_eq!(r.mock.used().idx().load(), 0, "completed");
    assert!(!r.queue.ready());
    assert_eq!(r.status(), 0xee, "status byte written");
    let c = r.dev.counters();
    assert_eq!((c.dropped, c.io_errors, c.reads), (1, 0, 0));
    let peak = r.dev.peak_bounce_bytes;
    // Read up to the limit (the chain is followed), not past it.
    let bound = (MAX_CHAIN as u64 + 8) * 16;
    assert!(
        peak > MAX_CHAIN as u64 * 16 && peak <= bound,
        "{peak} bytes of descriptors read; seg_max allows {bound}"
    );
}

/// The limit is `seg_max` data segments plus header and status, no fewer: a read of
/// exactly `seg_max` segments (scattered, backwards) is served whole; one more segment
/// breaks the queue, its status byte untouched. Fails if the limit is off by one either
/// way.
#[test]
fn a_chain_of_seg_max_segments_is_served_and_one_more_breaks_the_queue() {
    const SEG: u32 = 512;
    let (t1, t2, status2, data2) = (0x20000, 0x21000, 0x3e000, 0x22000);
    let mut r = rig(false);
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.gm.write_obj(0xeeu8, GuestAddress(status2)).unwrap();
    let chain = |data: u64, segs: u64, status: u64| {
        let mut c = vec![(0x8000, 16, false)];
        c.extend((0..segs).rev().map(|i| (data + i * SEG as u64, SEG, true)));
        c.push((status, 1, true));
        c
    };
    let n = SEG_MAX as u64;
    let honest = chain(DATA, n, STATUS);
    assert_eq!(honest.len(), MAX_CHAIN);
    indirect_table(&r, t1, &honest);
    indirect_table(&r, t2, &chain(data2, n + 1, status2));
    let heads: Vec<RawDescriptor> = [(t1, MAX_CHAIN), (t2, MAX_CHAIN + 1)]
        .iter()
        .map(|&(t, k)| SplitDescriptor::new(t, k as u32 * 16, INDIRECT, 0).into())
        .collect();
    r.mock.add_desc_chains(&heads, 0).unwrap();
    assert_eq!(r.run(), vec![SEG_MAX * SEG + 1]);
    assert!(!r.queue.ready());
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(r.gm.read_obj::<u8>(GuestAddress(status2)).unwrap(), 0xee);
    // Segment i (backwards in the chain) holds disk bytes from (n - 1 - i) · 512.
    for i in 0..n {
        let (at, from) = ((DATA + i * 512) as usize, ((n - 1 - i) * 512) as usize);
        assert_eq!(
            &r.local.bytes()[at..at + 512],
            &r.data[from..from + 512],
            "{i}"
        );
    }
    let c = r.dev.counters();
    assert_eq!((c.reads, c.dropped), (1, 1));
}

/// A write of `seg_max` + 1 data segments (129 descriptors) whose last descriptor is a
/// writable status byte holding OK (0) from an earlier request, as Linux's reused
/// per-tag area does: the write must not look done. Before, it was completed with used
/// length 0 and the status byte untouched: a driver reading it saw OK for a write that
/// never reached the disk. Now the queue is broken: nothing completed, the next request
/// waits until the driver resets the device, then is served.
#[test]
fn a_write_too_long_to_answer_is_never_completed_as_if_served() {
    const TABLE: u64 = 0x20000;
    let mut r = rig(true);
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, 0);
    r.gm.write_slice(&[0x5a; 127 * 512], GuestAddress(DATA))
        .unwrap();
    r.gm.write_obj(vb::VIRTIO_BLK_S_OK as u8, GuestAddress(STATUS))
        .unwrap();
    let mut chain = vec![(0x8000, 16, false)];
    chain.extend((0..127).map(|i| (DATA + i * 512, 512, false)));
    chain.push((STATUS, 1, true));
    assert_eq!(chain.len(), MAX_CHAIN + 1);
    indirect_table(&r, TABLE, &chain);
    let head = SplitDescriptor::new(TABLE, chain.len() as u32 * 16, INDIRECT, 0);
    r.mock.add_desc_chains(&[head.into()], 0).unwrap();
    // An honest read after it (head 1), into a buffer of its own.
    r.next_desc = 1;
    let (data2, status2) = (0x30000u64, 0x3e000u64);
    r.header(0x9000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[(0x9000, 16, false), (data2, 512, true), (status2, 1, true)]);
    let disk_sector0 = |r: &Rig| {
        let mut b = vec![0u8; 512];
        r.dev.disk.read(0, &mut b).unwrap();
        b
    };
    assert_eq!(r.run(), Vec::<u32>::new(), "the write was completed");
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8); // as it was: never read
    assert_eq!(disk_sector0(&r), r.data[..512], "sector 0 written");
    assert!(!r.queue.ready());
    // Kicks change nothing until the reset.
    assert_eq!(r.run(), Vec::<u32>::new());
    let c = r.dev.counters();
    assert_eq!((c.dropped, c.writes, c.reads), (1, 0, 0));
    r.reset_queue();
    assert_eq!(r.run(), vec![513]);
    let ok = r.gm.read_obj::<u8>(GuestAddress(status2)).unwrap();
    assert_eq!(ok, vb::VIRTIO_BLK_S_OK as u8);
    assert_eq!(
        &r.local.bytes()[data2 as usize..data2 as usize + 512],
        &r.data[..512]
    );
    assert_eq!(disk_sector0(&r), r.data[..512]);
}

/// A write whose data buffer wraps the address space but whose status byte is a good
/// one: answered IOERR there (it was completed with used length 0, the status byte
/// untouched, OK from before), nothing written to the disk, the queue served on.
#[test]
fn a_write_with_a_wrapping_buffer_gets_ioerr_in_its_status_byte() {
    let mut r = rig(true);
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, 0);
    r.gm.write_obj(vb::VIRTIO_BLK_S_OK as u8, GuestAddress(STATUS))
        .unwrap();
    let a = u64::MAX - 255; // 512 bytes from here wrap
    r.submit(&[(0x8000, 16, false), (a, 512, false), (STATUS, 1, true)]);
    assert_eq!(r.run(), vec![1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_IOERR as u8);
    assert!(r.queue.ready());
    let mut b = vec![0u8; 512];
    r.dev.disk.read(0, &mut b).unwrap();
    assert_eq!(b, r.data[..512]);
    let c = r.dev.counters();
    assert_eq!((c.io_errors, c.dropped, c.writes), (1, 0, 0));
}

/// The guest re-posting head 0 (posted once already) until `total` requests are posted,
/// calling `posted_more` after each batch it posts.
fn keep_reposting(
    gm: &GuestMemoryMmap<()>,
    avail: GuestAddress,
    total: u64,
    mut posted_more: impl FnMut(),
) {
    let mut posted = 1u64;
    while posted < total {
        let Some(p) = repost(gm, avail, posted, total) else {
            // Lets the device's thread run on a runner of one vCPU.
            std::thread::yield_now();
            continue;
        };
        posted = p;
        posted_more();
    }
}

/// The guest re-posting head 0: up to 16 outstanding (slot `p % 16` held a request the
/// device has popped), posted up to `total`; the new count posted, or `None` if none could
/// be.
fn repost(gm: &GuestMemoryMmap<()>, avail: GuestAddress, posted: u64, total: u64) -> Option<u64> {
    let done: u16 = gm
        .load(GuestAddress(USED + 2), Ordering::Acquire)
        .map(u16::from_le)
        .unwrap();
    let mut p = posted;
    while p < total && (p as u16).wrapping_sub(done) < 16 {
        gm.write_obj(u16::to_le(0), GuestAddress(avail.0 + 4 + (p % 16) * 2))
            .unwrap();
        p += 1;
    }
    if p == posted {
        return None;
    }
    gm.store(
        u16::to_le(p as u16),
        GuestAddress(avail.0 + 2),
        Ordering::Release,
    )
    .unwrap();
    Some(p)
}
