//! The two sides measured: memfold's decode path (a store memfd, a userfaultfd handler
//! doing the agent's work) and the kernel's (a memfd paged out to zswap), and the timed
//! accesses both share.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use memfold_codecs::page_checksum;
use memfold_core::slab::Slab;
use memfold_core::{CompressCodec, Page, PAGE_SIZE};
use memfold_sys::reclaim;
use memfold_sys::{memfd, uffd};

use super::PAGE;

/// A `MAP_SHARED` read-write mapping of a whole memfd, unmapped when dropped.
pub(super) struct Mapping {
    pub(super) addr: *mut u8,
    pub(super) len: usize,
}

impl Mapping {
    pub(super) fn shared(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping> {
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a new mapping at an address the kernel picks: it overlaps nothing of
        // this program; its memory is only reached through raw pointers of this module.
        let addr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .context("mmap of a memfd")?;
        Ok(Mapping {
            addr: addr.cast(),
            len,
        })
    }

    pub(super) fn base(&self) -> u64 {
        self.addr as u64
    }

    /// The first byte of page `i`.
    pub(super) fn page(&self, i: u32) -> *mut u8 {
        debug_assert!((i as usize + 1) * PAGE_SIZE <= self.len);
        // SAFETY: within the mapping (callers pass pages below its length).
        unsafe { self.addr.add(i as usize * PAGE_SIZE) }
    }

    /// Writes `pages` into the mapping, page `i` at page `i`.
    pub(super) fn fill(&self, pages: &[Box<Page>]) {
        for (i, p) in pages.iter().enumerate() {
            // SAFETY: page `i` of the mapping is 4096 writable bytes no reference covers;
            // the source is a distinct heap page.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), self.page(i as u32), PAGE_SIZE) };
        }
    }

    /// How many pages differ from `pages` (every page is present by then: reading them
    /// faults no more).
    pub(super) fn mismatches(&self, pages: &[Box<Page>]) -> u64 {
        pages
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                // SAFETY: page `i` of the mapping, readable, and written by no one while
                // this slice lives (the accesses are over, the handler has stopped).
                let m = unsafe { std::slice::from_raw_parts(self.page(*i as u32), PAGE_SIZE) };
                m != &p[..]
            })
            .count() as u64
    }

    /// Pages of the mapping in memory now (`mincore`).
    pub(super) fn resident(&self) -> Result<u64> {
        let mut v = vec![0u8; self.len / PAGE_SIZE];
        // SAFETY: the range is this mapping; `v` has a byte per page of it.
        let rc = unsafe { libc::mincore(self.addr.cast(), self.len, v.as_mut_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("mincore");
        }
        Ok(v.iter().filter(|&&b| b & 1 != 0).count() as u64)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `shared`, unmapped once; nothing points into it
        // after this.
        let _ = unsafe { rustix::mm::munmap(self.addr.cast(), self.len) };
    }
}

/// CPU time of this process so far (user + system, every thread), µs.
fn cpu_us() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct it is given, which lives across the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    us(u.ru_utime) + us(u.ru_stime)
}

/// Counters of /proc/vmstat, in the order asked.
pub(super) fn vmstat(names: &[&str]) -> Result<Vec<u64>> {
    let text = std::fs::read_to_string("/proc/vmstat").context("/proc/vmstat")?;
    names
        .iter()
        .map(|n| {
            text.lines()
                .find_map(|l| l.strip_prefix(n).and_then(|r| r.strip_prefix(' ')))
                .and_then(|v| v.trim().parse().ok())
                .with_context(|| {
                    format!("/proc/vmstat has no {n} (a kernel without zswap or swap counters)")
                })
        })
        .collect()
}

/// The timed accesses: one volatile byte read of each page in `order`; the latencies, ns,
/// in `order`, and the process's CPU time per access, µs.
pub(super) fn touch(m: &Mapping, order: &[u32]) -> (Vec<u64>, f64) {
    let mut lat = Vec::with_capacity(order.len());
    let mut sink = 0u8;
    let cpu0 = cpu_us();
    for &i in order {
        let p = m.page(i);
        let t = Instant::now();
        // SAFETY: the first byte of a page of the mapping, read through a raw pointer (the
        // memory may be filled by the kernel under us: no reference covers it).
        let b = unsafe { std::ptr::read_volatile(p) };
        lat.push(t.elapsed().as_nanos() as u64);
        sink ^= b;
    }
    let cpu = (cpu_us() - cpu0) as f64 / order.len().max(1) as f64;
    std::hint::black_box(sink);
    (lat, cpu)
}

/// A page's blob in the store.
#[derive(Clone, Copy)]
struct Stored {
    offset: u64,
    len: u32,
    /// Compressed (else the raw page).
    compressed: bool,
    checksum: u64,
}

/// The store: the blobs of `pages` in a memfd laid out by the engine's slab.
pub(super) struct Store {
    fd: OwnedFd,
    index: Vec<Stored>,
    pub(super) blob_bytes: u64,
    compressed: u64,
}

impl Store {
    pub(super) fn build(pages: &[Box<Page>], codec: CompressCodec) -> Result<Store> {
        let fd = memfd::create("memfold-bench-store").context("store memfd")?;
        let mut slab = Slab::new();
        let mut index = Vec::with_capacity(pages.len());
        let mut blob = Vec::with_capacity(2 * PAGE_SIZE);
        let (mut blob_bytes, mut compressed) = (0, 0);
        for p in pages {
            codec
                .compress(p, &mut blob)
                .with_context(|| format!("{} compression", codec.name()))?;
            let fits = blob.len() < PAGE_SIZE;
            let bytes: &[u8] = if fits { &blob } else { &p[..] };
            let slot = slab
                .alloc(bytes.len())
                .context("the slab has no slot for a blob")?;
            memfd::pwrite_all(fd.as_fd(), bytes, slot.offset).context("writing the store")?;
            index.push(Stored {
                offset: slot.offset,
                len: bytes.len() as u32,
                compressed: fits,
                checksum: page_checksum(p),
            });
            blob_bytes += bytes.len() as u64;
            compressed += u64::from(fits);
        }
        Ok(Store {
            fd,
            index,
            blob_bytes,
            compressed,
        })
    }
}

/// Why the fault handler stopped.
#[derive(Debug, thiserror::Error)]
pub(super) enum HandlerError {
    #[error("userfaultfd: {0}")]
    Uffd(#[from] uffd::UffdError),
    #[error("poll on the userfaultfd: {0}")]
    Poll(std::io::Error),
    #[error("reading the blob of page {page}: {source}")]
    Read { page: u64, source: std::io::Error },
    #[error("page {page}: {source}")]
    Decode {
        page: u64,
        source: memfold_codecs::CodecError,
    },
    #[error("page {0}: the decoded page does not match its checksum")]
    Checksum(u64),
    #[error("page {page}: a {kind} fault where only minor faults were expected")]
    NotMinor { page: u64, kind: &'static str },
    #[error("page {page}: a {kind} userfault where none was expected")]
    Unexpected { page: u64, kind: &'static str },
}

/// Sleeps in `poll` until the userfaultfd has an event (or 100 ms pass), as the agent
/// does; not at all if an ioctl queued events meanwhile.
fn wait_readable(uffd: &uffd::Uffd) -> Result<(), HandlerError> {
    let mut fds = [libc::pollfd {
        fd: uffd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let wait = if uffd.has_backlog() { 0 } else { 100 };
    // SAFETY: polls a valid array of one pollfd that lives across the call.
    if unsafe { libc::poll(fds.as_mut_ptr(), 1, wait) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(HandlerError::Poll(e));
        }
    }
    Ok(())
}

/// The agent's work on a missing fault on a stashed page, for every fault until `stop`:
/// read the blob, decompress, check, `UFFDIO_COPY`. Owns the userfaultfd: if it fails,
/// returning closes it, which lets a waiting access go on (it then reads zeros, which
/// the check of the contents reports).
fn serve(
    uffd: uffd::Uffd,
    base: u64,
    store: &Store,
    codec: CompressCodec,
    busy_poll: bool,
    stop: &AtomicBool,
) -> Result<u64, HandlerError> {
    let mut buf = [0u8; PAGE_SIZE];
    let mut page = [0u8; PAGE_SIZE];
    serve_faults(&uffd, busy_poll, stop, |ev| {
        let uffd::Event::Fault { addr, .. } = ev else {
            return Ok(false);
        };
        let at = addr & !(PAGE - 1);
        let i = (at - base) / PAGE;
        let Some(s) = store.index.get(i as usize) else {
            uffd.wake(at, PAGE)?;
            return Ok(false);
        };
        let blob = &mut buf[..s.len as usize];
        memfd::pread_exact(store.fd.as_fd(), blob, s.offset)
            .map_err(|source| HandlerError::Read { page: i, source })?;
        if s.compressed {
            codec
                .decompress(blob, &mut page)
                .map_err(|source| HandlerError::Decode { page: i, source })?;
        } else {
            page.copy_from_slice(blob);
        }
        if page_checksum(&page) != s.checksum {
            return Err(HandlerError::Checksum(i));
        }
        uffd.copy(at, &page, false)?;
        Ok(true)
    })
}

/// A handler thread's loop, as the agent's: until `stop`, wait for the userfaultfd to
/// be readable (or spin, `busy_poll`), then hand each event to `answer`, which returns
/// whether it served a fault. Returns the faults served; the first error ends it.
pub(super) fn serve_faults(
    uffd: &uffd::Uffd,
    busy_poll: bool,
    stop: &AtomicBool,
    mut answer: impl FnMut(uffd::Event) -> Result<bool, HandlerError>,
) -> Result<u64, HandlerError> {
    let mut served = 0;
    while !stop.load(Ordering::Relaxed) {
        if busy_poll {
            std::hint::spin_loop();
        } else {
            wait_readable(uffd)?;
        }
        while let Some(ev) = uffd.read_event()? {
            served += answer(ev)? as u64;
        }
    }
    Ok(served)
}

/// What one measurement of either side gives back before it is labelled.
#[derive(Default)]
pub(super) struct Raw {
    pub(super) lat: Vec<u64>,
    pub(super) cpu_us: f64,
    pub(super) held_bytes: u64,
    pub(super) pages_out: u64,
    pub(super) pages_compressed: u64,
    pub(super) zswap_loads: u64,
    pub(super) disk_reads: u64,
    pub(super) readahead: (u64, u64),
    /// Faults the userfaultfd handler answered (0 without one).
    pub(super) uffd_faults: u64,
    /// `kernel-rbit` only: what reading R bits back costs.
    pub(super) clock: Option<super::ClockCost>,
}

/// memfold's side: store, punch, register, serve, access.
pub(super) fn memfold_side(
    pages: &[Box<Page>],
    order: &[u32],
    codec: CompressCodec,
    busy_poll: bool,
) -> Result<Raw> {
    let len = pages.len() * PAGE_SIZE;
    let store = Store::build(pages, codec)?;
    let held_bytes = memfd::allocated_bytes(store.fd.as_fd());
    let guest = memfd::create("memfold-bench-guest").context("guest memfd")?;
    memfd::set_len(guest.as_fd(), len as u64).context("sizing the guest memfd")?;
    let m = Mapping::shared(guest.as_fd(), len)?;
    m.fill(pages);
    // Stashed: punched out, as memfoldd's stash leaves a page.
    ensure!(
        memfd::punch_hole(guest.as_fd(), 0, len as u64),
        "punching the guest memfd failed"
    );
    ensure!(
        m.resident()? == 0,
        "pages of the guest memfd are still in memory after the punch"
    );
    let u = uffd::Uffd::open(uffd::AGENT_FEATURES)
        .context("memfold's side needs a userfaultfd with the agent's features")?;
    // SAFETY: the range is `m`, a shared mapping of a memfd that only raw pointers of this
    // module reach; every fault on it is served by the handler thread below, which owns
    // the userfaultfd and closes it when it stops (unregistering the range).
    unsafe { u.register(m.base(), len as u64, uffd::MODE_MISSING) }
        .context("registering the guest mapping")?;
    let stop = AtomicBool::new(false);
    let base = m.base();
    let (lat, cpu_us, served) = std::thread::scope(|s| {
        let (store, stop_ref) = (&store, &stop);
        let h = s.spawn(move || serve(u, base, store, codec, busy_poll, stop_ref));
        let (lat, cpu) = touch(&m, order);
        stop.store(true, Ordering::Relaxed);
        let served = h.join().expect("the fault handler panicked");
        (lat, cpu, served)
    });
    let served = served.context("memfold's fault handler")?;
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "memfold's side: {bad} pages read back wrong");
    ensure!(
        served == pages.len() as u64,
        "memfold's side served {served} faults for {} pages",
        pages.len()
    );
    Ok(Raw {
        lat,
        cpu_us,
        held_bytes,
        pages_out: pages.len() as u64,
        pages_compressed: store.compressed,
        uffd_faults: served,
        ..Raw::default()
    })
}

/// The accesses of a side: the latencies, ns, in order; the CPU per access, µs; the
/// faults a userfaultfd handler answered.
pub(super) type Accessed = (Vec<u64>, f64, u64);

/// The kernel's side: write, page out to zswap, access. zswap and the swap file are on.
/// `access` does the timed accesses (plain [`touch`], or with a userfaultfd handler
/// registered first: `kernel-minor`).
pub(super) fn kernel_side(
    pages: &[Box<Page>],
    order: &[u32],
    access: impl FnOnce(&Mapping, &[u32]) -> Result<Accessed>,
) -> Result<Raw> {
    const COUNTERS: [&str; 5] = ["zswpout", "zswpin", "pswpin", "swap_ra", "swap_ra_hit"];
    let len = pages.len() * PAGE_SIZE;
    let guest = memfd::create("memfold-bench-zswap").context("memfd")?;
    memfd::set_len(guest.as_fd(), len as u64).context("sizing the memfd")?;
    let m = Mapping::shared(guest.as_fd(), len)?;
    m.fill(pages);
    let (pool0, _) = reclaim::zswap_pool()?;
    let before = vmstat(&COUNTERS)?;
    // A page still on a per-CPU LRU list is skipped by MADV_PAGEOUT: try again a few times.
    for _ in 0..4 {
        // SAFETY: advice on this mapping; paging out changes no contents.
        unsafe { rustix::mm::madvise(m.addr.cast(), len, rustix::mm::Advice::LinuxPageOut) }
            .context("madvise(MADV_PAGEOUT)")?;
        if m.resident()? == 0 {
            break;
        }
    }
    let pages_out = pages.len() as u64 - m.resident()?;
    let (pool1, _) = reclaim::zswap_pool()?;
    let mid = vmstat(&COUNTERS)?;
    let (lat, cpu_us, uffd_faults) = access(&m, order)?;
    let after = vmstat(&COUNTERS)?;
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "the kernel's side: {bad} pages read back wrong");
    Ok(Raw {
        lat,
        cpu_us,
        held_bytes: pool1.saturating_sub(pool0),
        pages_out,
        pages_compressed: mid[0] - before[0],
        zswap_loads: after[1] - mid[1],
        disk_reads: after[2] - mid[2],
        readahead: (after[3] - mid[3], after[4] - mid[4]),
        uffd_faults,
        ..Raw::default()
    })
}
