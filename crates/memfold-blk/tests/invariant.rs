//! The invariant of memfold-blk (`memfold_blk::mem`): guest RAM is reached through QEMU's
//! page tables, so the device's accesses meet memfold's agent exactly as the guest's do.
//!
//! A child process plays QEMU with memfold's agent: a memfd mapped shared ("guest RAM",
//! three pages), registered with userfaultfd for missing and write-protect faults, and a
//! handler thread playing the agent:
//! - page 0 is write-protected (a page under a share check): its handler waits 300 ms,
//!   then unprotects it;
//! - page 1 is a hole (a stashed page): its missing fault is served with `UFFDIO_COPY` of
//!   0xA5 bytes (the decoded blob), which differ from the hole's zeros;
//! - page 2 has a "pool frame" (another memfd) mapped over it, write-protected (a shared
//!   page): its write-protect fault breaks the sharing as the agent does (the frame's
//!   bytes copied into the guest memfd, the memfd mapped back).
//!
//! Two devices are checked against it: [`memfold_blk::mem::RemoteMemory`] (through the
//! child's page tables) must pass all three checks; the mapping vhost-user-backend builds
//! of the same memfd (`GuestMemoryMmap`, what the device must not use) must fail all
//! three — so the test tells the two apart, and a device that wrote the memfd would fail
//! it.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memfold_blk::mem::{RamFile, Region, RemoteMemory, PAGE};
use memfold_blk::remote::Qemu;
use memfold_sys::uffd::{self, Event, Uffd};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};

/// How long the child's handler holds a write-protect fault on page 0.
const HOLD: Duration = Duration::from_millis(300);
const CHILD_ENV: &str = "MEMFOLD_BLK_INVARIANT_CHILD";

/// The child: guest RAM with an agent. Prints `READY <base> <memfd fd>`, then answers
/// `DUMP <page>` with the first and last byte of its own view of that page and `QUIT`.
/// Run only by [`Guest::start`] (ignored otherwise: on its own it would check nothing);
/// it ends in `exit`, never in libtest's summary, so its `READY` is what says it ran.
#[test]
#[ignore = "the child process of the invariant tests, run by them"]
fn child_main() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "run by the invariant tests' Guest::start"
    );
    let page = PAGE as usize;
    let ram = memfold_sys::memfd::create("guest-ram").unwrap();
    memfold_sys::memfd::set_len(ram.as_fd(), 3 * PAGE).unwrap();
    let pool = memfold_sys::memfd::create("pool").unwrap();
    memfold_sys::memfd::set_len(pool.as_fd(), PAGE).unwrap();
    memfold_sys::memfd::pwrite_all(pool.as_fd(), &vec![0x77; page], 0).unwrap();
    let map = |fd: i32, at: *mut libc::c_void, len: usize, off: i64, fixed: bool| {
        // SAFETY: shared mappings of this process's own memfds, over nothing Rust owns
        // (MAP_FIXED only over the guest mapping made here).
        let p = unsafe {
            libc::mmap(
                at,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | if fixed { libc::MAP_FIXED } else { 0 },
                fd,
                off,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as u64
    };
    let base = map(ram.as_raw_fd(), std::ptr::null_mut(), 3 * page, 0, false);
    // Page 0 populated (with 0x33), page 1 a hole, page 2 the pool frame.
    memfold_sys::memfd::pwrite_all(ram.as_fd(), &vec![0x33; page], 0).unwrap();
    map(pool.as_raw_fd(), (base + 2 * PAGE) as *mut _, page, 0, true);
    let u = Arc::new(Uffd::open(uffd::FEATURE_MISSING_SHMEM | uffd::FEATURE_WP_SHMEM).unwrap());
    // SAFETY: the range is this child's own mappings, touched only through raw addresses.
    unsafe { u.register(base, 3 * PAGE, uffd::MODE_MISSING | uffd::MODE_WP) }.unwrap();
    u.write_protect(base, PAGE, true).unwrap();
    u.write_protect(base + 2 * PAGE, PAGE, true).unwrap();
    let h = u.clone();
    let ram_fd = ram.as_raw_fd();
    std::thread::spawn(move || loop {
        let mut p = libc::pollfd {
            fd: h.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, alive across the call.
        unsafe { libc::poll(&mut p, 1, -1) };
        while let Ok(Some(ev)) = h.read_event() {
            let Event::Fault { addr, wp, .. } = ev else {
                continue;
            };
            let pg = (addr - base) / PAGE;
            let at = base + pg * PAGE;
            match (pg, wp) {
                (0, true) => {
                    std::thread::sleep(HOLD);
                    h.write_protect(at, PAGE, false).unwrap();
                }
                (1, false) => h.copy(at, &vec![0xA5; PAGE as usize], false).unwrap(),
                (2, true) => {
                    // The CoW break: the frame's bytes into the guest memfd, mapped back.
                    // SAFETY: reads the pool frame this child mapped at `at`.
                    let frame =
                        unsafe { std::slice::from_raw_parts(at as *const u8, PAGE as usize) }
                            .to_vec();
                    memfold_sys::memfd::pwrite_all(
                        // SAFETY: the guest memfd stays open for the child's life.
                        unsafe { std::os::fd::BorrowedFd::borrow_raw(ram_fd) },
                        &frame,
                        2 * PAGE,
                    )
                    .unwrap();
                    map(ram_fd, at as *mut _, PAGE as usize, 2 * PAGE as i64, true);
                    // SAFETY: as above, the child's own mapping.
                    unsafe { h.register(at, PAGE, uffd::MODE_MISSING | uffd::MODE_WP) }.unwrap();
                    h.wake(at, PAGE).unwrap();
                }
                _ => panic!("unexpected fault at page {pg} (wp {wp})"),
            }
        }
    });
    println!("READY {base:x} {}", ram.as_raw_fd());
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let mut w = line.split_whitespace();
        match w.next() {
            Some("DUMP") => {
                let pg: u64 = w.next().unwrap().parse().unwrap();
                // SAFETY: a page of the child's own guest mapping.
                let b =
                    unsafe { std::slice::from_raw_parts((base + pg * PAGE) as *const u8, page) };
                println!("PAGE {} {}", b[0], b[page - 1]);
            }
            _ => break,
        }
    }
    std::process::exit(0);
}

/// The child, its pipes, and where its guest RAM is.
struct Guest {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    base: u64,
    memfd: i32,
}

impl Guest {
    fn start() -> Guest {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "child_main",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        // Killed and waited for on drop, also if READY never comes.
        let mut g = Guest {
            child,
            stdin,
            stdout,
            base: 0,
            memfd: 0,
        };
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                g.stdout.read_line(&mut line).unwrap() > 0,
                "child ended before READY (did `--exact child_main` match no test?)"
            );
            if let Some((_, r)) = line.trim().split_once("READY ") {
                let (b, fd) = r.split_once(' ').unwrap();
                g.base = u64::from_str_radix(b, 16).unwrap();
                g.memfd = fd.parse().unwrap();
                return g;
            }
        }
    }

    /// First and last byte of the child's own view of page `pg`.
    fn view(&mut self, pg: u64) -> (u8, u8) {
        writeln!(self.stdin, "DUMP {pg}").unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "child ended");
            if let Some((_, r)) = line.trim().split_once("PAGE ") {
                let (a, b) = r.split_once(' ').unwrap();
                return (a.parse().unwrap(), b.parse().unwrap());
            }
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "QUIT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A device's access to guest RAM (guest-physical 0 = the child's page 0).
trait Device {
    fn write(&self, gpa: u64, buf: &[u8]);
    fn read(&self, gpa: u64, buf: &mut [u8]);
}

impl Device for RemoteMemory {
    fn write(&self, gpa: u64, buf: &[u8]) {
        RemoteMemory::write(self, gpa, buf).unwrap()
    }
    fn read(&self, gpa: u64, buf: &mut [u8]) {
        RemoteMemory::read(self, gpa, buf).unwrap()
    }
}

/// The vm-memory view virtio-queue is given (bounce slices, written back on mark_dirty).
struct ViewDevice<'a>(&'a RemoteMemory);

impl Device for ViewDevice<'_> {
    fn write(&self, gpa: u64, buf: &[u8]) {
        let v = self.0.view();
        v.write_slice(buf, GuestAddress(gpa)).unwrap();
        assert!(v.take_error().is_none());
    }
    fn read(&self, gpa: u64, buf: &mut [u8]) {
        let v = self.0.view();
        v.read_slice(buf, GuestAddress(gpa)).unwrap();
        assert!(v.take_error().is_none());
    }
}

impl Device for GuestMemoryMmap<()> {
    fn write(&self, gpa: u64, buf: &[u8]) {
        self.write_slice(buf, GuestAddress(gpa)).unwrap()
    }
    fn read(&self, gpa: u64, buf: &mut [u8]) {
        self.read_slice(buf, GuestAddress(gpa)).unwrap()
    }
}

/// The three checks of the module's doc against `dev`: what failed.
fn check(g: &mut Guest, dev: &dyn Device) -> Vec<String> {
    let mut failed = Vec::new();
    let page = PAGE as usize;
    // 1. A write to a write-protected page waits for the handler, then lands.
    let t = Instant::now();
    dev.write(0, &vec![0x11; page]);
    let took = t.elapsed();
    if took < HOLD * 3 / 4 {
        failed.push(format!(
            "write to a write-protected page did not wait ({took:?})"
        ));
    }
    if g.view(0) != (0x11, 0x11) {
        failed.push(format!(
            "write to page 0 not in the guest's view: {:?}",
            g.view(0)
        ));
    }
    // 2. A read of a hole is served by the missing-fault handler, not zeros.
    let mut b = vec![0u8; page];
    dev.read(PAGE, &mut b);
    if b.iter().any(|&x| x != 0xA5) {
        failed.push(format!(
            "read of a stashed page gave {:#x}.., not the handler's 0xA5",
            b[0]
        ));
    }
    // 3. A write to a shared page (pool frame mapped over it) breaks the sharing and
    // lands in the guest's view.
    dev.write(2 * PAGE, &vec![0x22; page]);
    if g.view(2) != (0x22, 0x22) {
        failed.push(format!(
            "write to a shared page not in the guest's view: {:?}",
            g.view(2)
        ));
    }
    failed
}

#[test]
fn writes_and_reads_go_through_the_guests_page_tables_and_meet_its_userfaultfd() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let mut g = Guest::start();
    let memfd = std::fs::File::open(format!("/proc/{}/fd/{}", g.child.id(), g.memfd)).unwrap();
    let (dev, ino) = memfold_sys::memfd::file_id(memfd.as_fd()).unwrap();
    let qemu = Arc::new(Qemu::open(g.child.id()).unwrap());
    assert_eq!(
        qemu.file_address(dev, ino, 0, 3 * PAGE).unwrap(),
        g.base,
        "the child's guest mapping is found in its maps, around the pool frame"
    );
    let remote = RemoteMemory::new(
        qemu,
        vec![Region {
            gpa: 0,
            len: 3 * PAGE,
            qemu_va: g.base,
            file: RamFile { dev, ino },
            file_off: 0,
        }],
    );
    assert_eq!(check(&mut g, &remote), Vec::<String>::new());
    // Again through the vm-memory view, on a fresh guest.
    drop(g);
    let mut g = Guest::start();
    let memfd = std::fs::File::open(format!("/proc/{}/fd/{}", g.child.id(), g.memfd)).unwrap();
    let (dev, ino) = memfold_sys::memfd::file_id(memfd.as_fd()).unwrap();
    let remote = RemoteMemory::new(
        Arc::new(Qemu::open(g.child.id()).unwrap()),
        vec![Region {
            gpa: 0,
            len: 3 * PAGE,
            qemu_va: g.base,
            file: RamFile { dev, ino },
            file_off: 0,
        }],
    );
    assert_eq!(check(&mut g, &ViewDevice(&remote)), Vec::<String>::new());
}

#[test]
fn the_mapping_vhost_user_backend_builds_fails_the_same_checks() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let mut g = Guest::start();
    let memfd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{}/fd/{}", g.child.id(), g.memfd))
        .unwrap();
    // What vhost-user-backend's set_mem_table makes of the region QEMU sends.
    let mmap = GuestMemoryMmap::<()>::from_ranges_with_files([(
        GuestAddress(0),
        3 * PAGE as usize,
        Some(FileOffset::new(memfd, 0)),
    )])
    .unwrap();
    let failed = check(&mut g, &mmap);
    assert_eq!(
        failed.len(),
        3,
        "every check must catch the memfd mapping: {failed:?}"
    );
}
