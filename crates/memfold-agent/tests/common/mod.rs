//! What the agent's tests share: a test binary plays QEMU (shared memfds named as QEMU
//! names its memory backends, mapped here) and memfoldd (a listener speaking the wire).

#![allow(dead_code)]

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use memfold_agent::{AgentConfig, ClockRBits, FailMode};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{
    AgentReport, BatchId, Conn, FrameId, Gfn, Listener, ToAgent, ToDaemon, PROTOCOL_VERSION,
};

/// The shared mapping of a new memfd of `pages` pages named as QEMU names its memory
/// backends.
pub fn region(pages: usize) -> (OwnedFd, *mut u8) {
    filled_region("memory-backend-memfd", pages, |_| Vec::new())
}

/// Byte `i` of a page `g` unlike any other page (none of its bytes zero).
pub fn distinct_byte(g: usize, i: usize) -> u8 {
    ((g * 131 + i * 7 + (i >> 8) * g) % 251) as u8 + 1
}

/// Page `g` of [`distinct_byte`]s.
pub fn distinct_page(g: usize) -> Vec<u8> {
    (0..PAGE_SIZE).map(|i| distinct_byte(g, i)).collect()
}

/// The shared mapping of a new memfd named `name` of `pages` pages, page g holding
/// `bytes(g)` (written through the file, before any agent registers the mapping; an
/// empty `bytes(g)` leaves page g a hole).
pub fn filled_region(
    name: &str,
    pages: usize,
    bytes: impl Fn(usize) -> Vec<u8>,
) -> (OwnedFd, *mut u8) {
    let fd = memfd::create(name).unwrap();
    memfd::set_len(fd.as_fd(), (pages * PAGE_SIZE) as u64).unwrap();
    for g in 0..pages {
        memfd::pwrite_all(fd.as_fd(), &bytes(g), (g * PAGE_SIZE) as u64).unwrap();
    }
    // SAFETY: a new shared mapping of a memfd this test owns, at an address the kernel
    // picks; never unmapped; touched only through raw pointers.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    (fd, p as *mut u8)
}

/// The process's mappings now.
pub fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// Asks the agent on `c` to page `gfns` out to the kernel's swap in batch `batch`;
/// returns its (paged, resident, refused).
pub fn page_out(c: &Conn, batch: u64, gfns: &[u32]) -> (Vec<Gfn>, Vec<Gfn>, Vec<Gfn>) {
    let gfns = gfns.iter().map(|&g| Gfn(g)).collect();
    let batch = BatchId(batch);
    c.send(&ToAgent::PageOut { batch, gfns }, &[]).unwrap();
    next(c, |m| match m {
        ToDaemon::PageOutDone {
            batch: b,
            paged,
            resident,
            refused,
        } if *b == batch => Some((paged.clone(), resident.clone(), refused.clone())),
        _ => None,
    })
}

/// [`page_out`], with each page answered still in RAM for which `should_leave` holds
/// asked again, up to four more times (batches `1000 * batch + k`): under load the kernel
/// may keep a page it could not isolate from its LRU (seen with memfold-live's
/// `pool_page_out` in CI: 28–30 of 32), which memfoldd asks again at a later round. The
/// pages that left (sorted), those still in RAM at the end, and the first answer's
/// refusals.
pub fn page_out_retrying(
    c: &Conn,
    batch: u64,
    gfns: &[u32],
    should_leave: impl Fn(u32) -> bool,
) -> (Vec<Gfn>, Vec<Gfn>, Vec<Gfn>) {
    let (mut paged, mut resident, refused) = page_out(c, batch, gfns);
    for k in 1..=4 {
        let again: Vec<u32> = resident
            .iter()
            .map(|g| g.0)
            .filter(|&g| should_leave(g))
            .collect();
        if again.is_empty() {
            break;
        }
        resident.retain(|g| !should_leave(g.0));
        let (p, r, _) = page_out(c, 1000 * batch + k, &again);
        paged.extend(p);
        resident.extend(r);
    }
    paged.sort_unstable();
    resident.sort_unstable();
    (paged, resident, refused)
}

/// Listens as memfoldd at `socket` and starts the agent in this process under a VMA
/// budget of `budget` mappings (`MEMFOLD_VMA_BUDGET`).
pub fn start_agent_budget(socket: &Path, budget: usize) -> Listener {
    let listener = Listener::bind(socket).unwrap();
    let cfg = AgentConfig {
        socket: socket.to_path_buf(),
        name: "g".into(),
        ram_bytes: 0,
        vma_budget: Some(budget),
        on_failure: FailMode::Abort,
        clock_rbits: ClockRBits::Userfault,
    };
    std::thread::spawn(move || memfold_agent::run(cfg));
    listener
}

/// The next agent connection on `listener`, its hello read (the welcome is the
/// caller's: [`welcome`]).
pub fn accept_hello(listener: &Listener) -> Conn {
    let c = listener.accept().unwrap();
    c.set_recv_timeout(Duration::from_millis(200)).unwrap();
    next(&c, |m| {
        matches!(m, ToDaemon::AgentHello { .. }).then_some(())
    });
    c
}

/// Welcomes the agent on `c` with `pool` and `store`.
pub fn welcome(c: &Conn, pool: &OwnedFd, store: &OwnedFd) {
    c.send(
        &ToAgent::Welcome {
            version: PROTOCOL_VERSION,
        },
        &[pool.as_fd(), store.as_fd()],
    )
    .unwrap();
}

/// Guest RAM at `ptr`, page `g`, as the guest sees it (a fault served by the agent if
/// need be).
pub fn page_of(ptr: *mut u8, g: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        // SAFETY: inside the mapping.
        .map(|i| unsafe { std::ptr::read_volatile(ptr.add(g * PAGE_SIZE + i)) })
        .collect()
}

/// Writes `bytes` at the start of page `g` as the guest would.
pub fn write(ptr: *mut u8, g: usize, bytes: &[u8]) {
    for (i, &b) in bytes.iter().enumerate() {
        // SAFETY: inside the mapping (bytes is at most a page).
        unsafe { std::ptr::write_volatile(ptr.add(g * PAGE_SIZE + i), b) };
    }
}

/// Receives the next message of `want`'s kind on `c`, skipping others; panics after 10 s.
pub fn next<T>(c: &Conn, want: impl Fn(&ToDaemon) -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        assert!(t.elapsed() < Duration::from_secs(10), "no answer");
        if let Ok(Some((m, _))) = c.recv::<ToDaemon>() {
            if let Some(x) = want(&m) {
                return x;
            }
        }
    }
}

/// Asks the agent on `c` to share `pages` in batch `batch`; returns its (shared,
/// refused, changed).
pub fn share(
    c: &Conn,
    batch: BatchId,
    pages: Vec<(Gfn, FrameId)>,
) -> (Vec<Gfn>, Vec<Gfn>, Vec<Gfn>) {
    c.send(&ToAgent::Share { batch, pages }, &[]).unwrap();
    next(c, |m| match m {
        ToDaemon::ShareDone {
            batch: b,
            shared,
            refused,
            changed,
            ..
        } if *b == batch => Some((shared.clone(), refused.clone(), changed.clone())),
        _ => None,
    })
}

/// Listens as memfoldd at `socket` and starts the agent in this process (it finds every
/// QEMU-named memfd mapped here itself: no RAM size given), aborting on failure.
pub fn start_agent(socket: &Path) -> Listener {
    start_agent_with(socket, ClockRBits::Userfault)
}

/// [`start_agent`] with the clock's R bits taken as `rbits` says.
pub fn start_agent_with(socket: &Path, rbits: ClockRBits) -> Listener {
    let listener = Listener::bind(socket).unwrap();
    spawn_agent(socket, rbits);
    listener
}

/// Starts the agent in this process, as guest `g`, for memfoldd at `socket` (whatever
/// listens there), aborting on failure.
pub fn spawn_agent(socket: &Path, rbits: ClockRBits) {
    let cfg = AgentConfig {
        socket: socket.to_path_buf(),
        name: "g".into(),
        ram_bytes: 0,
        vma_budget: None,
        on_failure: FailMode::Abort,
        clock_rbits: rbits,
    };
    std::thread::spawn(move || memfold_agent::run(cfg));
}

/// Starts the agent in this process on every QEMU-named memfd it maps, as memfoldd at
/// `socket` (in a directory the caller keeps), and welcomes its first region with a pool
/// of `frames` (each a page); returns the connection, the pool and the store.
pub fn agent_with_pool(socket: &Path, frames: &[Vec<u8>]) -> (Conn, OwnedFd, OwnedFd) {
    agent_with_pool_rbits(socket, frames, ClockRBits::Userfault)
}

/// [`agent_with_pool`] with the clock's R bits taken as `rbits` says.
pub fn agent_with_pool_rbits(
    socket: &Path,
    frames: &[Vec<u8>],
    rbits: ClockRBits,
) -> (Conn, OwnedFd, OwnedFd) {
    let listener = start_agent_with(socket, rbits);
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), (frames.len().max(1) * PAGE_SIZE) as u64).unwrap();
    for (i, f) in frames.iter().enumerate() {
        memfd::pwrite_all(pool.as_fd(), f, (i * PAGE_SIZE) as u64).unwrap();
    }
    let store = memfd::create("fake-store").unwrap();
    let c = accept_hello(&listener);
    welcome(&c, &pool, &store);
    (c, pool, store)
}

/// Text-like bytes of frame (and page) `g`: never zero, under 0x80 (so never an [`ink`]
/// byte), different for every `g` under 64.
pub fn text(g: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| b"a page the disk read "[(i * 5 + g * 3) % 21] ^ (g as u8 & 31) | 1)
        .collect()
}

/// The byte a test's writer fills page `g` with (`g` under 128): 0x80 and over, never a
/// [`text`] byte.
pub fn ink(g: usize) -> u8 {
    0x80 | g as u8
}

/// Page `g` as a test's writer writes it: [`ink`] throughout.
pub fn inked(g: usize) -> Vec<u8> {
    vec![ink(g); PAGE_SIZE]
}

/// Guest RAM of `pages` pages, page g holding `bytes(g)`, under an agent (started here, as
/// memfoldd in `dir`) whose pool holds the same bytes, every page shared onto its own
/// frame (g onto frame g) one request at a time; returns the region's memfd and mapping,
/// the connection, the pool and the store.
pub fn shared_page_by_page(
    dir: &Path,
    pages: usize,
    bytes: impl Fn(usize) -> Vec<u8>,
) -> (OwnedFd, *mut u8, Conn, OwnedFd, OwnedFd) {
    let (fd, ptr) = region(pages);
    for g in 0..pages {
        write(ptr, g, &bytes(g));
    }
    let frames: Vec<Vec<u8>> = (0..pages).map(&bytes).collect();
    let (c, pool, store) = agent_with_pool(&dir.join("memfoldd.sock"), &frames);
    for g in 0..pages {
        let (shared, _, _) = share(
            &c,
            BatchId(g as u64 + 1),
            vec![(Gfn(g as u32), FrameId(g as u32))],
        );
        assert_eq!(shared, vec![Gfn(g as u32)]);
    }
    (fd, ptr, c, pool, store)
}

/// The agent's counters after what the test did: the last report it sends (every second)
/// between 1.1 and 3.6 s from now.
pub fn stats_after(c: &Conn) -> AgentReport {
    c.set_recv_timeout(Duration::from_millis(100)).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let mut last = None;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(2500) {
        if let Ok(Some((ToDaemon::AgentStats(r), _))) = c.recv::<ToDaemon>() {
            last = Some(r);
        }
    }
    last.expect("an AgentStats report")
}

/// Asks the agent to watch `gfns` for the free-page discard (issue 17); returns (watched,
/// refused).
pub fn watch(c: &Conn, batch: u64, gfns: &[u32]) -> (Vec<Gfn>, Vec<Gfn>) {
    c.send(
        &ToAgent::Watch {
            batch: BatchId(batch),
            gfns: gfns.iter().map(|&g| Gfn(g)).collect(),
        },
        &[],
    )
    .unwrap();
    next(c, |m| match m {
        ToDaemon::WatchDone {
            batch: b,
            watched,
            refused,
        } if *b == BatchId(batch) => Some((watched.clone(), refused.clone())),
        _ => None,
    })
}

/// One clock scan of pages `0..count` (at most 64) arming `arm`, `wp_only` of them for
/// writes only, in batch `batch`; returns the R and M bits since the last arming (bit g
/// for page g).
pub fn clock_scan(c: &Conn, batch: u64, count: u32, arm: u64, wp_only: u64) -> (u64, u64) {
    clock_scan_zapping(c, batch, count, arm, wp_only, false)
}

/// [`clock_scan`], with `zap_shared`: the PTEs of the pages on pool frames dropped too.
pub fn clock_scan_zapping(
    c: &Conn,
    batch: u64,
    count: u32,
    arm: u64,
    wp_only: u64,
    zap_shared: bool,
) -> (u64, u64) {
    c.send(
        &ToAgent::ClockScan {
            batch: BatchId(batch),
            first: Gfn(0),
            count,
            arm: vec![arm],
            wp_only: vec![wp_only],
            zap_shared,
        },
        &[],
    )
    .unwrap();
    next(c, |m| match m {
        ToDaemon::ClockBits {
            batch: b,
            referenced,
            modified,
            ..
        } if *b == BatchId(batch) => Some((
            referenced.first().copied().unwrap_or(0),
            modified.first().copied().unwrap_or(0),
        )),
        _ => None,
    })
}
