//! memfoldd against peers that lie — the inverse of Firecracker's malicious-handler test.
//! This test process plays QEMU for one honest guest (its RAM a memfd, the real agent in
//! a thread, as in `live_model`) and, beside it, for attackers that speak the wire
//! themselves: they answer batches that were never theirs, report CoW breaks, refills and
//! decodes of pages they do not have, send clock bits nobody asked for, claim other pids,
//! send garbage, oversized packets, the wrong protocol version, /dev/null or a file on
//! disk for guest RAM, a guest too large to book, and one stops reading. memfoldd must
//! stay up and answer, refuse each offender with a clear message, and the honest guest
//! must read every byte it wrote, while its pages keep being shared, reclaimed and
//! stored.
//!
//! A second test puts a fake memfoldd that never answers at an agent's socket: the agent
//! must keep serving its guest's faults (the handshake runs on the fault thread, bounded).
//! A third's fake memfoldd welcomes the agent, floods it with requests and never reads
//! the answers: the agent must keep serving them too. A fourth hands memfoldd one RAM
//! memfd as two guests.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use memfold_agent::{self as agent, AgentConfig, FailMode};
use memfold_core::{EngineConfig, Policy};
use memfold_live::daemon::{DaemonConfig, DomainRule};
use memfold_live::query_stats;
use memfold_sys::memfd;
use memfold_sys::socket::Seqpacket;
use memfold_wire::{BatchId, Conn, FrameId, Gfn, ToAgent, ToDaemon, PROTOCOL_VERSION};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGE: usize = 4096;

/// Guest RAM as QEMU makes it: a memfd mapped shared. The agent finds it by its size.
struct Ram {
    ptr: *mut u8,
    pages: usize,
}

// SAFETY: the mapping lives until the process exits; one thread uses it at a time.
unsafe impl Send for Ram {}

impl Ram {
    fn new(pages: usize) -> Ram {
        let fd = memfd::create("guest-ram").unwrap();
        memfd::set_len(fd.as_fd(), (pages * PAGE) as u64).unwrap();
        // SAFETY: a new shared mapping of a memfd this test owns; it is never unmapped
        // (the agent thread serves it until the process exits), and the fd is leaked with
        // it so that the agent finds it among our descriptors.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        std::mem::forget(fd);
        Ram {
            ptr: ptr as *mut u8,
            pages,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `pages` pages for the life of the process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.pages * PAGE) }
    }
}

/// Content every mechanism takes: zeros, duplicates, near-duplicates, text, random.
fn fill(g: usize, base: &[u8], rng: &mut SmallRng, out: &mut [u8]) {
    match g % 5 {
        0 => out.fill(0),
        1 => out.copy_from_slice(base),
        2 => {
            out.copy_from_slice(base);
            out[rng.gen_range(0..PAGE)] ^= 1;
        }
        3 => {
            for (i, b) in out.iter_mut().enumerate() {
                *b = b"guest page text "[i % 16];
            }
        }
        _ => rng.fill(out),
    }
}

fn memfoldd(dir: &std::path::Path) -> std::path::PathBuf {
    let socket = dir.join("memfoldd.sock");
    let cfg = DaemonConfig {
        socket: socket.clone(),
        engine: EngineConfig {
            policy: Policy::difference_engine(),
            rate: 0,
            min_scan_interval_us: 100_000,
            max_scan_interval_us: 400_000,
            clock_interval_us: Some(300_000),
            ..EngineConfig::default()
        },
        swap_dir: dir.to_path_buf(),
        swap_capacity: 16 << 20,
        domains: DomainRule::User,
        agent_gid: None,
        never_share: Default::default(),
        claim: memfold_core::ClaimPolicy::Never,
        allowance: 0,
        guest_channels: None,
        tenant_max_bytes: u64::MAX,
    };
    common::start_memfoldd_with(cfg);
    socket
}

/// An attacker's hello with a memfd of `pages` pages of its own.
fn hello(socket: &std::path::Path, name: &str, pid: u32, pages: u64) -> (Conn, ToAgent) {
    let c = Conn::connect(socket).unwrap();
    let ram = memfd::create("attacker-ram").unwrap();
    memfd::set_len(ram.as_fd(), pages * PAGE as u64).unwrap();
    let hello = ToDaemon::AgentHello {
        version: PROTOCOL_VERSION,
        name: name.into(),
        pid,
        ram_bytes: pages * PAGE as u64,
        shared: 0,
        opted_out: false,
    };
    c.send(&hello, &[ram.as_fd()]).unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let (reply, _) = c.recv::<ToAgent>().unwrap().expect("an answer");
    (c, reply)
}

/// A memfd with a page of data, reopened write-only through /proc.
fn write_only_pool() -> std::os::fd::OwnedFd {
    let fd = memfd::create("memfold-pool").unwrap();
    memfd::pwrite_all(fd.as_fd(), &[7u8; PAGE], 0).unwrap();
    let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .into()
}

/// A sparse memfd of 2^32 - 1 pages with data in its last one.
fn huge_pool() -> std::os::fd::OwnedFd {
    let fd = memfd::create("memfold-pool").unwrap();
    let end = (u32::MAX as u64) * PAGE as u64;
    memfd::set_len(fd.as_fd(), end).unwrap();
    memfd::pwrite_all(fd.as_fd(), &[7u8; PAGE], end - PAGE as u64).unwrap();
    fd
}

fn attacks(socket: &std::path::Path) {
    // Answers for batches that are not its own (the honest guest's are among 1..5000),
    // events about pages and frames it does not have, clock bits nobody asked for.
    let (c, welcome) = hello(socket, "liar", 1, 1024);
    assert!(matches!(welcome, ToAgent::Welcome { .. }), "{welcome:?}");
    // For 8 s it answers every batch number memfoldd is about to use — the honest guest's
    // among them; it learns the current numbers from the commands memfoldd sends it — as
    // refused (and now and then as done), so that a memfoldd that matched answers by batch
    // number alone would free frames the honest guest maps, or book shares never made.
    c.set_recv_timeout(Duration::from_millis(1)).unwrap();
    let t = Instant::now();
    let mut cur = 1u64;
    let none = Vec::new;
    let mut rounds = 0u64;
    while t.elapsed() < Duration::from_secs(8) {
        while let Ok(Some((m, _))) = c.recv::<ToAgent>() {
            if let ToAgent::ClockScan { batch, .. }
            | ToAgent::Share { batch, .. }
            | ToAgent::Stash { batch, .. }
            | ToAgent::ReclaimZero { batch, .. } = m
            {
                cur = cur.max(batch.0);
            }
        }
        for b in cur + 1..cur + 64 {
            let batch = BatchId(b);
            let msgs = [
                ToDaemon::ShareDone {
                    batch,
                    shared: none(),
                    changed: none(),
                    refused: none(),
                },
                ToDaemon::StashDone {
                    batch,
                    stashed: none(),
                    changed: none(),
                    refused: none(),
                },
                ToDaemon::ReclaimDone {
                    batch,
                    reclaimed: none(),
                    changed: none(),
                    refused: none(),
                },
            ];
            for m in &msgs {
                let _ = c.send(m, &[]);
            }
        }
        rounds += 1;
        if rounds % 100 == 0 {
            let gfns: Vec<Gfn> = (0..3000).map(Gfn).collect();
            let batch = BatchId(cur + 1);
            let _ = c.send(
                &ToDaemon::ShareDone {
                    batch,
                    shared: gfns.clone(),
                    changed: none(),
                    refused: none(),
                },
                &[],
            );
            let _ = c.send(
                &ToDaemon::ReclaimDone {
                    batch: BatchId(cur + 2),
                    reclaimed: gfns,
                    changed: none(),
                    refused: none(),
                },
                &[],
            );
            let breaks = (0..512).map(|i| (Gfn(i), FrameId(i))).collect();
            let _ = c.send(&ToDaemon::CowBroken { breaks }, &[]);
            let _ = c.send(
                &ToDaemon::Unstashed {
                    gfns: vec![Gfn(u32::MAX), Gfn(5000)],
                },
                &[],
            );
            let _ = c.send(
                &ToDaemon::Refilled {
                    gfns: vec![Gfn(u32::MAX - 1)],
                },
                &[],
            );
            let _ = c.send(
                &ToDaemon::ClockBits {
                    batch: BatchId(u64::MAX),
                    first: Gfn(u32::MAX),
                    count: u32::MAX,
                    referenced: vec![u64::MAX; 4096],
                    modified: vec![],
                },
                &[],
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // Then it stops reading: memfoldd's commands pile up until its sends time out.
    std::mem::forget(c);

    // Pools no memfoldd made, handed back as if after a restart: a write-only reopening of
    // a memfd (memfoldd could write frames but not read them), and a sparse memfd of 2^32
    // pages (its frame table would take all memory). Both refused, memfoldd up.
    for (what, pool) in [("write-only", write_only_pool()), ("huge", huge_pool())] {
        let c = Conn::connect(socket).unwrap();
        let ram = memfd::create("attacker-ram").unwrap();
        memfd::set_len(ram.as_fd(), 64 * PAGE as u64).unwrap();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: format!("pool-{what}"),
            pid: 3,
            ram_bytes: 64 * PAGE as u64,
            shared: 0,
            opted_out: false,
        };
        c.send(&hello, &[ram.as_fd(), pool.as_fd()]).unwrap();
        c.set_recv_timeout(Duration::from_secs(5)).unwrap();
        let (reply, _) = c.recv::<ToAgent>().unwrap().expect("an answer");
        assert!(
            matches!(&reply, ToAgent::Refused { message } if message.contains("pool")),
            "{what} pool: {reply:?}"
        );
    }

    // The wrong protocol version.
    let (_c, reply) = {
        let c = Conn::connect(socket).unwrap();
        c.send(
            &ToDaemon::AgentHello {
                version: PROTOCOL_VERSION + 7,
                name: "old".into(),
                pid: 2,
                ram_bytes: 4096,
                shared: 0,
                opted_out: false,
            },
            &[],
        )
        .unwrap();
        c.set_recv_timeout(Duration::from_secs(5)).unwrap();
        // In words an agent reads (it got a `ToClient::Error` it could not decode).
        let r = c.recv::<ToAgent>().unwrap().expect("an answer").0;
        (c, r)
    };
    assert!(
        matches!(&reply, ToAgent::Refused { message }
            if message.contains(&format!("protocol version {PROTOCOL_VERSION}"))
                && message.contains(&format!("version {}", PROTOCOL_VERSION + 7))),
        "{reply:?}"
    );

    // A file that is not a memfd for guest RAM.
    let c = Conn::connect(socket).unwrap();
    let r = std::fs::File::open("/dev/null").unwrap();
    c.send(
        &ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "devnull".into(),
            pid: 3,
            ram_bytes: 1 << 20,
            shared: 0,
            opted_out: false,
        },
        &[r.as_fd()],
    )
    .unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let reply = c.recv::<ToAgent>().unwrap().expect("an answer").0;
    assert!(
        matches!(&reply, ToAgent::Refused { message } if message.contains("must be memfds")),
        "{reply:?}"
    );

    // A file on disk for guest RAM, of the size it claims: its reads could block (a
    // FUSE mount its peer serves), and memfoldd reads guest RAM on its main thread.
    let c = Conn::connect(socket).unwrap();
    let on_disk = tempfile::tempfile().unwrap();
    on_disk.set_len(1 << 20).unwrap();
    c.send(
        &ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "on-disk".into(),
            pid: 3,
            ram_bytes: 1 << 20,
            shared: 0,
            opted_out: false,
        },
        &[on_disk.as_fd()],
    )
    .unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let reply = c.recv::<ToAgent>().unwrap().expect("an answer").0;
    assert!(
        matches!(&reply, ToAgent::Refused { message } if message.contains("must be memfds")),
        "{reply:?}"
    );

    // A guest too large for memfoldd to book (a sparse memfd of 1 TiB).
    let (_c, reply) = hello(socket, "huge", 4, 1 << 28);
    assert!(
        matches!(&reply, ToAgent::Refused { message } if message.contains("at most")),
        "{reply:?}"
    );

    // RAM larger than its memfd.
    let c = Conn::connect(socket).unwrap();
    let ram = memfd::create("small").unwrap();
    memfd::set_len(ram.as_fd(), 4096).unwrap();
    c.send(
        &ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "short".into(),
            pid: 5,
            ram_bytes: 1 << 30,
            shared: 0,
            opted_out: false,
        },
        &[ram.as_fd()],
    )
    .unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let reply = c.recv::<ToAgent>().unwrap().expect("an answer").0;
    assert!(matches!(reply, ToAgent::Refused { .. }), "{reply:?}");

    // Garbage, and a packet over the largest message.
    for junk in [vec![0xffu8; 100], vec![b'{'; 300 * 1024]] {
        let s = Seqpacket::connect(socket).unwrap();
        let _ = s.send(&junk, &[]);
    }
}

#[test]
fn lying_peers_neither_stop_memfoldd_nor_reach_another_guests_pages() {
    let work = tempfile::tempdir().unwrap();
    let socket = memfoldd(work.path());

    // The honest guest.
    let pages = 3000;
    let mut ram = Ram::new(pages);
    let mut rng = SmallRng::seed_from_u64(14);
    let mut base = vec![0u8; PAGE];
    rng.fill(&mut base[..]);
    let mut model = vec![0u8; pages * PAGE];
    for g in 0..pages {
        fill(g, &base, &mut rng, &mut model[g * PAGE..(g + 1) * PAGE]);
    }
    ram.bytes().copy_from_slice(&model);
    let acfg = AgentConfig {
        socket: socket.clone(),
        name: "honest".into(),
        ram_bytes: (pages * PAGE) as u64,
        vma_budget: None,
        // The agent runs in this test process: pausing would stop the test run for good.
        on_failure: FailMode::Abort,
        clock_rbits: memfold_agent::ClockRBits::Userfault,
    };
    std::thread::spawn(move || agent::run(acfg));
    let t = Instant::now();
    loop {
        let s = query_stats(&socket).unwrap();
        if s.vms
            .iter()
            .any(|v| v.name == "honest" && v.shares > 0 && v.reclaims > 0)
        {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "honest guest never shared: {s:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let sock = socket.clone();
    let attacker = std::thread::spawn(move || attacks(&sock));

    // The honest guest works on while the attacks go on, reading only what it wrote.
    let t = Instant::now();
    let mut ops = 0u64;
    while t.elapsed() < Duration::from_secs(12) || !attacker.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the attacks did not end"
        );
        for _ in 0..200 {
            let g = rng.gen_range(0..pages);
            let bytes = ram.bytes();
            if rng.gen_bool(0.7) {
                assert!(
                    bytes[g * PAGE..(g + 1) * PAGE] == model[g * PAGE..(g + 1) * PAGE],
                    "gfn {g}: the honest guest read bytes it did not write"
                );
            } else {
                let off = rng.gen_range(0..PAGE - 8);
                let v: u64 = rng.gen();
                model[g * PAGE + off..g * PAGE + off + 8].copy_from_slice(&v.to_le_bytes());
                bytes[g * PAGE + off..g * PAGE + off + 8].copy_from_slice(&v.to_le_bytes());
            }
            ops += 1;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    attacker
        .join()
        .expect("every attack got the answer it should");

    // memfoldd is up, answers at once, and still works for the honest guest.
    let t = Instant::now();
    let s = query_stats(&socket).expect("memfoldd answers after the attacks");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "memfoldd was slow to answer: {:?}",
        t.elapsed()
    );
    let honest = s
        .vms
        .iter()
        .find(|v| v.name == "honest")
        .expect("honest guest attached");
    assert!(!honest.detached && honest.shares > 0, "{honest:#?}");
    let liar = s
        .vms
        .iter()
        .find(|v| v.name == "liar")
        .expect("the liar was attached");
    assert_eq!(
        liar.shared_pages + liar.patched_pages + liar.compressed_pages,
        0,
        "{liar:#?}"
    );
    for name in ["old", "devnull", "huge", "short"] {
        assert!(s.vms.iter().all(|v| v.name != name), "{name} was attached");
    }
    let bytes = ram.bytes();
    for g in 0..pages {
        assert!(
            bytes[g * PAGE..(g + 1) * PAGE] == model[g * PAGE..(g + 1) * PAGE],
            "gfn {g}: the honest guest read bytes it did not write"
        );
    }
    eprintln!("{ops} guest ops; honest: {honest:#?}");
}

#[test]
fn a_fake_memfoldd_that_never_answers_does_not_freeze_the_guest() {
    let work = tempfile::tempdir().unwrap();
    let socket = work.path().join("fake.sock");
    let fake = memfold_sys::socket::SeqpacketListener::bind(&socket).unwrap();
    // Accepts and holds connections, never answers.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while let Ok(c) = fake.accept() {
            held.push(c);
        }
    });
    let ram = victim(socket, 1500);
    std::thread::sleep(Duration::from_millis(500));
    // Every first touch is a fault the agent serves; it must not be stuck waiting for the
    // fake memfoldd's welcome.
    guest_runs(ram, "its faults are not served");
}

/// A guest of `pages` zero pages with the real agent in a thread, attaching to whatever
/// listens at `socket`. The agent finds its RAM by its size: each test its own.
fn victim(socket: std::path::PathBuf, pages: usize) -> Ram {
    let ram = Ram::new(pages);
    let acfg = AgentConfig {
        socket,
        name: "victim".into(),
        ram_bytes: (pages * PAGE) as u64,
        vma_budget: None,
        // The agent runs in this test process: pausing would stop the test run for good.
        on_failure: FailMode::Abort,
        clock_rbits: memfold_agent::ClockRBits::Userfault,
    };
    std::thread::spawn(move || agent::run(acfg));
    ram
}

/// The guest writes the first byte of every page of `ram`, three rounds over (each page's
/// last byte still reads 0), in a thread, so that a stuck agent fails the test (bounded)
/// instead of hanging it: it must be done within 20 s, else it is frozen (`why`).
fn guest_runs(mut ram: Ram, why: &str) {
    let guest = std::thread::spawn(move || {
        for round in 1..=3u8 {
            for b in ram.bytes().chunks_mut(PAGE) {
                assert_eq!(b[PAGE - 1], 0);
                b[0] = round;
            }
        }
    });
    let t = Instant::now();
    while !guest.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the guest is frozen: {why}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    guest.join().unwrap();
}

/// One RAM memfd is one guest. A QEMU (this process) hands memfoldd the memfd it attached
/// as `a` again, named `b`: refused, naming `a`; named `a` with another size, or another
/// memfd named `a`: refused. Named `a` again while `a` is attached (an agent connecting
/// again before memfoldd saw its old connection end): the new connection replaces the
/// old one, which memfoldd closes. Either way memfoldd books one guest. Fails without the
/// checks in memfoldd's `attach` (a second guest on `a`'s memory, or a second `a`).
#[test]
fn one_ram_memfd_is_one_guest() {
    let work = tempfile::tempdir().unwrap();
    let socket = memfoldd(work.path());
    let ram = memfd::create("guest-ram").unwrap();
    memfd::set_len(ram.as_fd(), 64 * PAGE as u64).unwrap();
    memfd::pwrite_all(ram.as_fd(), &[5u8; 8 * PAGE], 0).unwrap();
    let other = memfd::create("other-ram").unwrap();
    memfd::set_len(other.as_fd(), 64 * PAGE as u64).unwrap();
    let say_as = |name: &str, fd: std::os::fd::BorrowedFd<'_>, pages: u64, opted_out: bool| {
        let c = Conn::connect(&socket).unwrap();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: name.into(),
            pid: std::process::id(),
            ram_bytes: pages * PAGE as u64,
            shared: 0,
            opted_out,
        };
        c.send(&hello, &[fd]).unwrap();
        c.set_recv_timeout(Duration::from_secs(5)).unwrap();
        let (reply, _) = c.recv::<ToAgent>().unwrap().expect("an answer");
        (c, reply)
    };
    let say_with = |name: &str, fd, pages| say_as(name, fd, pages, false);
    let say = |name: &str| say_with(name, ram.as_fd(), 64);
    let (first, reply) = say("a");
    assert!(matches!(reply, ToAgent::Welcome { .. }), "{reply:?}");
    let (_b, reply) = say("b");
    assert!(
        matches!(&reply, ToAgent::Refused { message } if message.contains("guest \"a\"'s")),
        "{reply:?}"
    );
    let (_c, reply) = say_with("a", ram.as_fd(), 32);
    assert!(
        matches!(&reply, ToAgent::Refused { message } if message.contains("re-attach of")),
        "{reply:?}"
    );
    let (_c, reply) = say_with("a", other.as_fd(), 64);
    assert!(
        matches!(&reply, ToAgent::Refused { message } if message.contains("another RAM memfd")),
        "{reply:?}"
    );
    // It says it is opted out (as an agent that missed an opt-in would): memfoldd knows
    // this guest, and its own record holds.
    let (_second, reply) = say_as("a", ram.as_fd(), 64, true);
    assert!(matches!(reply, ToAgent::Welcome { .. }), "{reply:?}");
    // memfoldd ends the old connection (its reads see the end, not a timeout).
    loop {
        match first.recv::<ToAgent>() {
            Ok(Some(_)) => continue,
            Ok(None) => break,
            Err(e) => panic!("the old connection is still open: {e}"),
        }
    }
    let stats = query_stats(&socket).unwrap();
    let names: Vec<(&str, bool)> = stats
        .vms
        .iter()
        .map(|v| (v.name.as_str(), v.detached))
        .collect();
    assert_eq!(names, [("a", false)], "one guest, attached");
    assert!(
        !stats.vms[0].opted_out,
        "memfoldd's record of the opt-in holds"
    );
}

/// A memfoldd that welcomes the agent, floods it with requests and never reads its
/// answers: the answers wait in the agent (within its bound), whose thread goes on
/// serving the guest's faults. Fails with the agent's blocking send: it stops at its
/// socket's room, and the guest freezes until memfoldd reads.
#[test]
fn a_memfoldd_that_stops_reading_does_not_freeze_the_guest() {
    let work = tempfile::tempdir().unwrap();
    let socket = work.path().join("stalled.sock");
    let fake = memfold_wire::Listener::bind(&socket).unwrap();
    let pages = 1700;
    let ram = victim(socket, pages);
    let c = fake.accept().unwrap();
    c.set_recv_timeout(Duration::from_secs(10)).unwrap();
    let (hello, _) = c.recv::<ToDaemon>().unwrap().expect("a hello");
    assert!(matches!(hello, ToDaemon::AgentHello { .. }), "{hello:?}");
    let (pool, store) = (
        memfd::create("pool").unwrap(),
        memfd::create("store").unwrap(),
    );
    let welcome = ToAgent::Welcome {
        version: PROTOCOL_VERSION,
    };
    c.send(&welcome, &[pool.as_fd(), store.as_fd()]).unwrap();
    // Thousands of requests, each answered; not one answer read, ever.
    let flood = std::thread::spawn(move || {
        for i in 0..4000u64 {
            let ask = ToAgent::ReclaimZero {
                batch: BatchId(i + 1),
                gfns: vec![Gfn((i % pages as u64) as u32)],
            };
            if c.send(&ask, &[]).is_err() {
                break;
            }
        }
        c // held open, unread, for the rest of the test
    });
    std::thread::sleep(Duration::from_secs(2));
    guest_runs(ram, "the agent waits for memfoldd to read");
    drop(flood);
}
