//! Unit tests of block devices' messages, catch-ups and bases.

use super::*;
use memfold_core::ids::FrameId;

/// Candidates come faster than they are checked: at most [`MAX_WAITING`] wait, the
/// oldest first, the rest counted as dropped. Fails with every candidate queued.
#[test]
fn candidates_waiting_for_their_check_are_bounded() {
    let mut d = Devices::default();
    let candidate = |i: u64| BlockCandidate {
        domain: DomainId(0),
        frame: FrameId(i as u32),
        block: BaseBlock {
            disk: DiskId(1),
            block: i,
        },
    };
    for step in 0..3u64 {
        d.wait_to_check((0..MAX_WAITING as u64).map(|i| candidate(step * 10_000 + i)));
        d.unchecked.drain(..MAX_CHECKS_PER_STEP);
    }
    assert!(d.unchecked.len() <= MAX_WAITING, "{}", d.unchecked.len());
    assert_eq!(
        d.unchecked_dropped,
        2 * MAX_WAITING as u64 - 2 * MAX_CHECKS_PER_STEP as u64
    );
    assert_eq!(d.unchecked.front().map(|c| c.block.block), Some(768));
}

/// A base descriptor of the file its id names is refused unless that file is a
/// regular one: a FIFO is not taken, a file is. Fails with only the id checked.
#[test]
fn a_base_that_is_not_a_regular_file_is_refused() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("base.fifo");
    let path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let file = dir.path().join("base.img");
    std::fs::write(&file, [0u8; PAGE_SIZE]).unwrap();
    // Opened without waiting for a writer.
    let open = |p: &std::path::Path| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(p)
            .unwrap();
        (DiskId::of_metadata(&f.metadata().unwrap()), f.into())
    };
    let ((fifo_id, fifo_fd), (file_id, file_fd)) = (open(&fifo), open(&file));
    let taken = checked_bases(1, &[fifo_id, file_id], vec![fifo_fd, file_fd]);
    let ids: Vec<DiskId> = taken.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, [file_id], "the FIFO was taken as a base");
}

/// Devices with one (connection 1, this process, no base) and the device's end of its
/// connection (a 5 s receive timeout); the folder of its socket is kept by the caller.
fn one_device() -> (tempfile::TempDir, Devices, Conn) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sock");
    let listener = memfold_wire::Listener::bind(&path).unwrap();
    let reader = Conn::connect(&path).unwrap();
    reader.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let me = std::process::id();
    let mut d = Devices::default();
    d.hello(
        1,
        listener.accept().unwrap(),
        Vec::new(),
        (me, memfold_sys::pidfd::open(me).unwrap()),
    );
    (dir, d, reader)
}

/// A catch-up longer than the device's socket holds waits for the device to read:
/// sent in order as room comes, none dropped (news are dropped on a full socket).
/// Fails if a full socket drops the rest, or closes the connection.
#[test]
fn a_catch_up_waits_for_room_and_loses_nothing() {
    let (_dir, mut d, reader) = one_device();
    let dev = d.by_token.get_mut(&1).unwrap();
    let blocks: Vec<BaseBlock> = (0..MAX_CATCH_UP as u64)
        .map(|block| BaseBlock {
            disk: DiskId(3),
            block,
        })
        .collect();
    dev.catch_up = blocks.iter().map(|&b| (DomainId(0), b)).collect();
    dev.send_catch_up(&|_, _| true);
    let left = dev.catch_up.len();
    assert!(
        left > 0,
        "{MAX_CATCH_UP} blocks fit the socket: the test shows nothing"
    );
    let mut told = Vec::new();
    while told.len() < blocks.len() {
        match reader.recv::<ToDevice>() {
            Ok(Some((ToDevice::Held { blocks }, _))) => told.extend(blocks),
            other => panic!(
                "{} of {} blocks told, then {other:?}",
                told.len(),
                blocks.len()
            ),
        }
        let dev = d.by_token.get_mut(&1).unwrap();
        dev.send_catch_up(&|_, _| true);
    }
    let dev = &d.by_token[&1];
    assert!(!dev.closed && dev.catch_up.is_empty() && dev.dropped == 0);
    told.sort_unstable();
    assert_eq!(told, blocks, "each block told once");
}

/// While a catch-up is under way, news join it rather than meet a full socket, and
/// blocks their domain no longer holds are left out as they come — all of a domain
/// gone. Fails with news sent past the catch-up (dropped: its socket is full), or with
/// stale blocks told.
#[test]
fn news_join_a_catch_up_and_stale_blocks_are_left_out() {
    let (_dir, mut d, reader) = one_device();
    let block = |block| BaseBlock {
        disk: DiskId(3),
        block,
    };
    let dev = d.by_token.get_mut(&1).unwrap();
    let (live, gone) = (DomainId(0), DomainId(1));
    dev.catch_up = (0..MAX_CATCH_UP as u64 / 2)
        .map(|k| (if k % 3 == 0 { gone } else { live }, block(k)))
        .collect();
    // Domain 1 is gone; domain 0 holds the even blocks only.
    let held = |d: DomainId, b: BaseBlock| d == live && b.block % 2 == 0;
    // Its socket full: as long as the device does not read.
    loop {
        let before = dev.catch_up.len();
        dev.send_catch_up(&held);
        if dev.catch_up.len() == before {
            break;
        }
    }
    assert!(!dev.catch_up.is_empty(), "the test shows nothing");
    let news: Vec<BaseBlock> = (0..10).map(|i| block((1 << 40) + 2 * i)).collect();
    dev.tell_held(live, &news);
    let mut told = Vec::new();
    while !d.by_token[&1].catch_up.is_empty() || told.is_empty() {
        if let Ok(Some((ToDevice::Held { blocks }, _))) = reader.recv::<ToDevice>() {
            told.extend(blocks);
        }
        d.by_token.get_mut(&1).unwrap().send_catch_up(&held);
    }
    while let Ok(Some((ToDevice::Held { blocks }, _))) = {
        reader.set_recv_timeout(Duration::from_millis(100)).unwrap();
        reader.recv::<ToDevice>()
    } {
        told.extend(blocks);
    }
    assert!(
        told.iter()
            .all(|b| news.contains(b) || (b.block % 2 == 0 && b.block % 3 != 0)),
        "a stale block, or one of a domain gone, told"
    );
    assert!(
        news.iter().all(|b| told.contains(b)),
        "news lost in a catch-up"
    );
    assert_eq!(d.by_token[&1].dropped, 0);
}

/// Two files under one disk id (a hash collision aimed at by one who sets a base's
/// size and mtime): the second device's is not taken, so no candidate of that id is
/// checked through the wrong file. The same file under its id is. Fails without the
/// check.
#[test]
fn a_second_file_under_a_disk_id_already_served_is_not_taken() {
    let dir = tempfile::tempdir().unwrap();
    let (one, other) = (dir.path().join("one"), dir.path().join("other"));
    std::fs::write(&one, [1u8; 4096]).unwrap();
    std::fs::write(&other, [2u8; 4096]).unwrap();
    let id = DiskId::of_metadata(&std::fs::metadata(&one).unwrap());
    let me = std::process::id();
    let path = dir.path().join("sock");
    let listener = memfold_wire::Listener::bind(&path).unwrap();
    let mut d = Devices::default();
    let mut hello = |token, file: &std::path::Path| {
        let _c = Conn::connect(&path).unwrap();
        d.hello(
            token,
            listener.accept().unwrap(),
            vec![(id, File::open(file).unwrap())],
            (me, memfold_sys::pidfd::open(me).unwrap()),
        );
    };
    hello(1, &one);
    hello(2, &other);
    hello(3, &one);
    assert!(d.by_token[&1].bases.contains_key(&id));
    assert!(
        !d.by_token[&2].bases.contains_key(&id),
        "a second file taken"
    );
    assert!(
        d.by_token[&3].bases.contains_key(&id),
        "the same file refused"
    );
}

/// The pid a device connected from, once that process has exited, may name another
/// process holding a guest's RAM: here the pid is this test's, which holds the
/// memfd, and the pidfd a child's that has exited. The look is not believed. Fails
/// with the pidfd unchecked.
#[test]
fn ram_held_under_a_reused_pid_is_not_the_devices() {
    use std::os::unix::fs::MetadataExt;
    let ram = File::from(memfold_sys::memfd::create("ram").unwrap());
    let m = ram.metadata().unwrap();
    let (me, file) = (std::process::id(), (m.dev(), m.ino()));
    let mine = memfold_sys::pidfd::open(me).unwrap();
    assert!(holds_file(me, mine.as_fd(), file), "the holder itself");
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let gone = memfold_sys::pidfd::open(c.id()).unwrap();
    c.wait().unwrap();
    assert!(
        !holds_file(me, gone.as_fd(), file),
        "the pid now names a holder, but the process that connected has exited"
    );
}
