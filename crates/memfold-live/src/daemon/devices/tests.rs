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

/// Devices (none yet), a socket to connect them on, and two one-page files `one` and
/// `other` in the returned folder; the id is `one`'s.
fn two_files() -> (tempfile::TempDir, Devices, memfold_wire::Listener, DiskId) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("one"), [1u8; 4096]).unwrap();
    std::fs::write(dir.path().join("other"), [2u8; 4096]).unwrap();
    let id = DiskId::of_metadata(&std::fs::metadata(dir.path().join("one")).unwrap());
    let listener = memfold_wire::Listener::bind(&dir.path().join("sock")).unwrap();
    (dir, Devices::default(), listener, id)
}

/// Device `token` says hello serving file `name` of `dir` under `id`; whether it took it.
fn hello_with(
    d: &mut Devices,
    (dir, listener): (&std::path::Path, &memfold_wire::Listener),
    token: u64,
    id: DiskId,
    name: &str,
) -> bool {
    let _c = Conn::connect(&dir.join("sock")).unwrap();
    let me = std::process::id();
    d.hello(
        token,
        listener.accept().unwrap(),
        vec![(id, File::open(dir.join(name)).unwrap())],
        (me, memfold_sys::pidfd::open(me).unwrap()),
    );
    d.by_token[&token].bases.contains_key(&id)
}

/// Two files under one disk id (a hash collision aimed at by one who sets a base's
/// size and mtime): the second device's is not taken, so no candidate of that id is
/// checked through the wrong file — also once the first file's device has gone (its
/// blocks stay indexed). The same file under its id is. Fails without the check, and
/// (the second half) with only connected devices' files compared.
#[test]
fn a_second_file_under_a_disk_id_already_served_is_not_taken() {
    let (dir, mut d, listener, id) = two_files();
    let at = (dir.path(), &listener);
    assert!(hello_with(&mut d, at, 1, id, "one"));
    assert!(
        !hello_with(&mut d, at, 2, id, "other"),
        "a second file taken"
    );
    assert!(
        hello_with(&mut d, at, 3, id, "one"),
        "the same file refused"
    );
    for token in 1..=3 {
        d.gone(token);
    }
    assert!(
        !hello_with(&mut d, at, 4, id, "other"),
        "a second file taken once the first one's devices had gone"
    );
    assert!(hello_with(&mut d, at, 5, id, "one"));
}

/// Past [`MAX_BASE_FILES`] ids, the files of ids no device serves and no frame holds
/// a block of are forgotten, and only those: an id a connected device serves, or one
/// the engine indexes, keeps its file. Fails with either kept set left out.
#[test]
fn only_unused_disk_ids_are_forgotten() {
    let (dir, mut d, listener, id) = two_files();
    let at = (dir.path(), &listener);
    let (indexed, unused) = (DiskId(1), DiskId(2));
    for i in 0..MAX_BASE_FILES as u64 {
        d.base_files.insert(DiskId(i + 1), (0, i));
    }
    d.forget_unused_bases(|| -> [DiskId; 0] { panic!("asked at the bound") });
    assert!(hello_with(&mut d, at, 1, id, "one"));
    d.forget_unused_bases(|| [indexed]);
    assert_eq!(d.base_files.len(), 2, "{:?}", d.base_files.keys());
    assert!(
        d.base_files.contains_key(&indexed),
        "an indexed id forgotten"
    );
    d.gone(1);
    assert!(
        !hello_with(&mut d, at, 2, id, "other"),
        "a served id's file forgotten"
    );
    assert!(
        hello_with(&mut d, at, 3, unused, "other"),
        "an unused id kept"
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
