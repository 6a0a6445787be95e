//! The child's side of `fail_closed.rs`: a process that plays QEMU, with the agent
//! started in it, guest RAM, and a thread that plays memfoldd; and the ways it makes
//! the agent fail.

use std::os::fd::AsFd;

use memfold_codecs::{page_checksum, Page};
use memfold_wire::PROTOCOL_VERSION;
use memfold_wire::{BatchId, Blob, BlobHome, Conn, Listener, StashPage, ToAgent, ToDaemon};
use rustix::process::{Resource, Rlimit};

use super::*;

/// In a child, its role.
pub(super) fn child_role() -> Option<Failure> {
    let role = std::env::var(ROLE).ok()?;
    [
        Failure::CorruptBlob,
        Failure::CorruptBlobReattach,
        Failure::Panic,
        Failure::LoopError,
        Failure::BypassWrite,
        Failure::SwapEio,
        Failure::CopyEnomem,
    ]
    .into_iter()
    .find(|f| f.name() == role)
}

/// The child: maps guest RAM, lets the agent manage it, makes it fail; never returns
/// (it is stopped, aborted or killed by the parent).
pub(super) fn child(failure: Failure) -> ! {
    // SIGABRT would leave a core file.
    rustix::process::setrlimit(
        Resource::Core,
        Rlimit {
            current: Some(0),
            maximum: Some(0),
        },
    )
    .unwrap();
    if failure == Failure::CopyEnomem {
        // The program's own pages (text, data) resident and locked now, charged outside
        // the cgroup the child moves into: once that is full, the agent's first run of
        // a code path must not wait for a page of text (with the OOM killer off it would
        // wait for good), so the only allocation to fail is the decode's copy — ENOMEM.
        // SAFETY: mlockall takes no pointers.
        assert_eq!(unsafe { libc::mlockall(libc::MCL_CURRENT) }, 0, "mlockall");
    }
    let dir = PathBuf::from(std::env::var_os(DIR).expect("work folder"));
    let socket = dir.join("memfoldd.sock");
    let listener = Listener::bind(&socket).unwrap();
    // memfoldd answers before guest RAM appears: the agent's handshake runs on the thread
    // that serves the fill's first touches.
    let (attached_tx, attached) = std::sync::mpsc::channel();
    std::thread::spawn(move || fake_memfoldd(&listener, failure, attached_tx));

    let fd = memfd::create(RAM_NAME).unwrap();
    memfd::set_len(fd.as_fd(), (PAGES * PAGE_SIZE) as u64).unwrap();
    // SAFETY: a new shared mapping of a memfd this child owns; it is never unmapped, and
    // the fd is leaked with it so that the agent finds it among the descriptors.
    let ram = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGES * PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            0,
        )
    };
    assert_ne!(ram, libc::MAP_FAILED);
    std::mem::forget(fd);
    let ram = ram as *mut u8;
    for g in 0..PAGES {
        for i in 0..PAGE_SIZE {
            // SAFETY: within the mapping, which no Rust reference covers (the agent may
            // already serve its first touches).
            unsafe { ram.add(g * PAGE_SIZE + i).write_volatile(pattern(g, i)) };
        }
    }

    if failure == Failure::Panic {
        // The agent's constructor saw no MEMFOLD_SOCKET (the parent leaves it out): the
        // logger goes in first, then the agent starts as the constructor would.
        tracing::subscriber::set_global_default(PanicOn("stash refused")).unwrap();
        std::env::set_var("MEMFOLD_SOCKET", &socket);
        memfold_agent::start_from_env();
    }
    // Otherwise the constructor started the agent at load; it finds RAM now.

    attached
        .recv_timeout(Duration::from_secs(100))
        .expect("the agent attached and the fake memfoldd did its part");
    match failure {
        Failure::CorruptBlob | Failure::BypassWrite | Failure::SwapEio | Failure::CopyEnomem => {
            if failure == Failure::CopyEnomem {
                fill_memory_cgroup();
            }
            eprintln!("child: the guest touches page {STASHED}");
            // SAFETY: within the mapping; a fault the agent serves (or fails closed on).
            let b = unsafe { ram.add(STASHED * PAGE_SIZE).read_volatile() };
            eprintln!(
                "child: the guest got past page {STASHED}: read {b:#x} (wrote {:#x})",
                pattern(STASHED, 0)
            );
        }
        Failure::LoopError => {
            // The agent has its welcome (the pool among its descriptors): it only polls
            // and serves from here.
            let t = Instant::now();
            while fds_to("/memfd:fake-pool") < 2 {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the agent never got its pool"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            let maximum = rustix::process::getrlimit(Resource::Nofile).maximum;
            rustix::process::setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(0),
                    maximum,
                },
            )
            .unwrap();
            eprintln!("child: RLIMIT_NOFILE is 0");
        }
        Failure::Panic | Failure::CorruptBlobReattach => {}
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// memfoldd as the agent sees it: welcomes it with a pool and a store, and for
/// `CorruptBlob` stashes page [`STASHED`] and then corrupts its blob, for `BypassWrite`
/// stashes it and then writes [`BYPASS`] into guest RAM's memfd at it, for `Panic` asks
/// to stash it with a wrong checksum (the agent refuses, with a warning). Sends on
/// `attached` when done, then holds the connection.
fn fake_memfoldd(listener: &Listener, failure: Failure, attached: std::sync::mpsc::Sender<()>) {
    let conn = listener.accept().unwrap();
    let (hello, mut fds) = conn.recv::<ToDaemon>().unwrap().expect("a hello");
    assert!(matches!(hello, ToDaemon::AgentHello { .. }), "{hello:?}");
    let guest = fds.remove(0);
    let pool = memfd::create("fake-pool").unwrap();
    let store = memfd::create("fake-store").unwrap();
    memfd::set_len(store.as_fd(), PAGE_SIZE as u64).unwrap();
    // A "swap file" whose bytes are this process's memory: readable while the page below
    // is mapped, `EIO` once it is not.
    let swap = File::open("/proc/self/mem").unwrap();
    // SAFETY: a new anonymous page at an address the kernel picks, used only through raw
    // pointers and unmapped below.
    let swapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(swapped, libc::MAP_FAILED);
    conn.send(
        &ToAgent::Welcome {
            version: PROTOCOL_VERSION,
        },
        &[pool.as_fd(), store.as_fd(), swap.as_fd()],
    )
    .unwrap();
    if failure != Failure::LoopError {
        let mut page: Page = [0; PAGE_SIZE];
        memfd::pread_exact(guest.as_fd(), &mut page, (STASHED * PAGE_SIZE) as u64).unwrap();
        memfd::pwrite_all(store.as_fd(), &page, 0).unwrap();
        // SAFETY: the anonymous page mapped above, one page long.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), swapped as *mut u8, PAGE_SIZE) };
        let good = page_checksum(&page);
        let (home, offset) = if failure == Failure::SwapEio {
            (BlobHome::Swap, swapped as u64)
        } else {
            (BlobHome::Store, 0)
        };
        let stash = StashPage {
            gfn: Gfn(STASHED as u32),
            blob: Blob::Raw,
            home,
            offset,
            len: PAGE_SIZE as u32,
            moving: false,
            checksum: if failure == Failure::Panic {
                !good
            } else {
                good
            },
        };
        conn.send(
            &ToAgent::Stash {
                batch: BatchId(1),
                pages: vec![stash],
            },
            &[],
        )
        .unwrap();
        if matches!(
            failure,
            Failure::CorruptBlob
                | Failure::CorruptBlobReattach
                | Failure::BypassWrite
                | Failure::SwapEio
                | Failure::CopyEnomem
        ) {
            let stashed = wait_stash_done(&conn);
            assert_eq!(stashed, [Gfn(STASHED as u32)], "the agent stashed the page");
        }
        match failure {
            // The store, writable by whoever holds it, changes under the agent.
            Failure::CorruptBlob => {
                memfd::pwrite_all(store.as_fd(), &[page[0] ^ 0x5a], 0).unwrap();
            }
            // Corrupted, then this memfoldd is gone (its listener stays: the agent
            // connects again, and brings its stashed pages home first).
            Failure::CorruptBlobReattach => {
                memfd::pwrite_all(store.as_fd(), &[page[0] ^ 0x5a], 0).unwrap();
                attached.send(()).unwrap();
                drop(conn);
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            // Guest RAM's memfd written at the stashed page, not through QEMU's mapping:
            // the hole fills (with zeros but for these bytes), and no fault is raised.
            Failure::BypassWrite => {
                let at = (STASHED * PAGE_SIZE + BYPASS_AT) as u64;
                memfd::pwrite_all(guest.as_fd(), &BYPASS, at).unwrap();
            }
            // The disk fails: the blob is gone from under every read.
            // Replaced, not unmapped, so that no later mapping of this process reuses the
            // address (the agent would read its bytes: a checksum mismatch, not `EIO`): by
            // a page of an empty memfd, which no read reaches (past its end).
            Failure::SwapEio => {
                let gone = memfd::create("fake-swap-gone").unwrap();
                // SAFETY: replaces the anonymous page mapped above, which nothing else uses.
                let r = unsafe {
                    libc::mmap(
                        swapped,
                        PAGE_SIZE,
                        libc::PROT_READ,
                        libc::MAP_SHARED | libc::MAP_FIXED,
                        std::os::fd::AsRawFd::as_raw_fd(&gone),
                        0,
                    )
                };
                assert_eq!(r, swapped);
                std::mem::forget(gone);
                let mut b = [0u8; 1];
                let e = swap.read_exact_at(&mut b, swapped as u64).unwrap_err();
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
            }
            Failure::Panic | Failure::LoopError | Failure::CopyEnomem => {}
        }
    }
    attached.send(()).unwrap();
    loop {
        // Out of memory, receiving would fault on new heap pages: only wait.
        if failure != Failure::CopyEnomem {
            let _ = conn.recv::<ToDaemon>();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Set in a child: the memory cgroup (v1) folder a `CopyEnomem` child joins.
pub(super) const CGROUP: &str = "MEMFOLD_FAIL_CLOSED_CGROUP";

/// The memory cgroup the `CopyEnomem` test makes for its child.
pub(super) fn enomem_cgroup() -> PathBuf {
    PathBuf::from(format!(
        "/sys/fs/cgroup/memory/memfold-fail-closed-{}",
        std::process::id()
    ))
}

/// Moves this whole process into the parent's memory cgroup, then fills the cgroup to its
/// limit with a memfd ballast: from then on no new page can be charged here, and with
/// the cgroup's OOM killer off an allocation outside a page fault fails with `ENOMEM`.
fn fill_memory_cgroup() {
    let dir = PathBuf::from(std::env::var_os(CGROUP).expect("the cgroup folder"));
    // Filled, and kept full, by a thread of its own: memory the cgroup gets back later
    // (the agent's messages in flight when it filled, read since by the fake memfoldd:
    // socket buffers are charged to the sender) is taken again within 200 µs, before the
    // agent's next retry of its copy. The test is of an ENOMEM that lasts (seen in CI:
    // the copy succeeded at its tenth retry, 0.5 s on). The thread exists before the
    // process joins the cgroup: its stack is locked with the rest below.
    // Channels of room made now: a send must not allocate once the cgroup is full.
    let (go_tx, go) = std::sync::mpsc::sync_channel::<()>(1);
    let (full_tx, full) = std::sync::mpsc::sync_channel(1);
    let (started_tx, started) = std::sync::mpsc::sync_channel::<()>(1);
    std::thread::spawn(move || {
        started_tx.send(()).expect("the child waits for the start");
        go.recv().expect("the child joined the cgroup");
        let ballast = memfd::create("ballast").unwrap();
        // Grows the ballast by `step`s to the limit; returns its length.
        let mut len = 0u64;
        let mut fill = move |step: u64| {
            while rustix::fs::fallocate(&ballast, rustix::fs::FallocateFlags::empty(), len, step)
                .is_ok()
            {
                len += step;
            }
            len
        };
        // Big steps, then pages: to the last page the limit allows.
        fill(64 * 1024);
        let _ = full_tx.send(fill(PAGE_SIZE as u64));
        loop {
            std::thread::sleep(Duration::from_micros(200));
            fill(PAGE_SIZE as u64);
        }
    });
    // The thread's start maps its signal stack read-write, then makes its guard page
    // PROT_NONE: maps read in between lists the guard as rw-p, and mlock over it, by
    // then PROT_NONE, fails with ENOMEM (seen in CI; 1 run in 18 here, 0 in 12 since).
    started.recv().expect("the ballast thread started");
    let locked = lock_private_memory();
    std::fs::write(dir.join("cgroup.procs"), "0").unwrap();
    go_tx.send(()).unwrap();
    let len = full.recv().expect("the ballast thread filled the cgroup");
    eprintln!("child: {locked} bytes of heap and stacks locked; the cgroup is full after {len} bytes of ballast");
    // The heap's slack takes an allocation with no charge: without it this thread would
    // wait here for good (seen with GLIBC_TUNABLES unset), and the test fail at its wait.
    let slack = vec![1u8; 4 << 20];
    std::hint::black_box(&slack);
    eprintln!("child: 4 MiB allocated and written on the locked heap");
}

/// Locks (and so faults in) every private anonymous mapping of this process that can be
/// written — the heap, with the slack `GLIBC_TUNABLES` gives it, and every thread's
/// stack — while its pages are still charged outside the cgroup the child joins next.
/// Once that cgroup is full, a thread that faults on a new page waits for memory for
/// good (its OOM killer is off), holding up the pause the test waits for (seen once in
/// 27 runs: the test hung). Returns the bytes locked.
fn lock_private_memory() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut locked = 0;
    for line in maps.lines() {
        // start-end perms offset dev inode [path]
        let f: Vec<&str> = line.split_whitespace().collect();
        let anonymous = f.len() == 5 || f.get(5).is_some_and(|p| p.starts_with('['));
        if !(f[1].starts_with("rw") && f[1].ends_with('p') && f[4] == "0" && anonymous) {
            continue;
        }
        let (start, end) = f[0].split_once('-').unwrap();
        let start = usize::from_str_radix(start, 16).unwrap();
        let len = usize::from_str_radix(end, 16).unwrap() - start;
        // SAFETY: locks a range this process maps; mlock reads no memory through it.
        let r = unsafe { libc::mlock(start as *const libc::c_void, len) };
        assert_eq!(r, 0, "mlock {line}: {}", std::io::Error::last_os_error());
        locked += len;
    }
    locked
}

/// How many of this process's descriptors name a file starting with `name`.
fn fds_to(name: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|p| p.to_string_lossy().starts_with(name))
        .count()
}

/// The pages of the agent's answer to the stash (its reports may come first).
fn wait_stash_done(conn: &Conn) -> Vec<Gfn> {
    conn.set_recv_timeout(Duration::from_secs(60)).unwrap();
    loop {
        match conn.recv::<ToDaemon>().unwrap().expect("an answer").0 {
            ToDaemon::StashDone { stashed, .. } => return stashed,
            _ => continue,
        }
    }
}

/// A logger that prints every event and panics on the first whose message contains its
/// text: a panic injected into whichever thread logs it, the agent's.
struct PanicOn(&'static str);

impl tracing::Subscriber for PanicOn {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0 = format!("{v:?}");
                }
            }
        }
        let mut m = Message(String::new());
        event.record(&mut m);
        eprintln!("{} {}", event.metadata().level(), m.0);
        static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if m.0.contains(self.0) && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            panic!("injected: the logger panics on the agent thread");
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
