//! A guest (or its QEMU) that breaks the ring's rules gets an error for its queue, in
//! bounded time, and nothing is written outside its buffers (invariant (c) of the
//! device's threat model: no spin, no unbounded allocation, no overflow from what the
//! guest puts in its rings).

use super::*;
use std::time::Duration;

/// Runs `process_queue`; a watchdog aborts the test binary if it has not returned
/// within 5 s (a spin would otherwise hang the suite rather than fail it).
fn run_bounded(r: &mut Rig) -> Result<bool, String> {
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
fn a_status_byte_that_wraps_the_address_space_drops_the_request_and_writes_nothing() {
    let mut r = rig(false);
    // Data 64 KiB (128 sectors), then the status byte at `a + len - 1`, which wraps to
    // guest address 0xf000, outside every buffer the guest gave. Overflow checks
    // panicked the device's thread (its lock poisoned); without them the IOERR byte
    // went to 0xf000.
    let target = 0xf000u64;
    let len = 0x1_0001u32;
    let a = target.wrapping_sub(len as u64 - 1);
    assert!(a.checked_add(len as u64).is_none());
    let before = r.local.bytes()[0x8000..0x20000].to_vec();
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, 0);
    r.submit(&[(0x8000, 16, false), (a, len, true)]);
    assert_eq!(r.run(), vec![0]);
    assert!(
        r.local.bytes()[0x8000..0x20000] == before[..],
        "guest RAM changed outside the request's buffers"
    );
    let c = r.dev.counters();
    assert_eq!((c.dropped, c.reads), (1, 0));
}
