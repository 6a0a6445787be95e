//! The sides about the clock's registration: `kernel-minor` (zswap behind the agent's
//! `MISSING | WP | MINOR` registration, each fault answered with `UFFDIO_CONTINUE`),
//! `uffd-rbit` (the clock's R bit today: a zapped resident page, a minor userfault) and
//! `kernel-rbit` (an R bit without userfaultfd: a zapped resident page, an in-kernel
//! minor fault, read back with `PAGEMAP_SCAN`; `async-rbit` the same with the range
//! registered for asynchronous write-protect only, as a userfault-free clock would
//! register it for its M bits, which also turns fault-around off), and the probe of what a userfault-free
//! clock would need from this kernel.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use memfold_core::{Page, PAGE_SIZE};
use memfold_sys::{memfd, uffd};
use serde::Serialize;

use super::sides::{serve_faults, touch, Accessed, HandlerError, Mapping, Raw};
use super::{ClockCost, PAGE};
use memfold_sys::pagemap::{
    Pagemap, PAGE_IS_PRESENT, PAGE_IS_WRITTEN, PM_SCAN_CHECK_WPASYNC, PM_SCAN_WP_MATCHING,
};

/// The agent's registration of guest RAM (`memfold-agent`'s `RAM_MODE`).
const RAM_MODE: u64 = uffd::MODE_MISSING | uffd::MODE_WP | uffd::MODE_MINOR;

/// The agent's answer to a minor fault, for every fault until `stop`: `UFFDIO_CONTINUE`,
/// write-protected after a read (so a later write still shows), as
/// `memfold-agent`'s fault handler does minus its bookkeeping. Any other fault is an
/// error (the pages are all in the memfd: none may be missing). `spin` is work added
/// before each answer (a busy wait), to see how the round trip grows with the
/// handler's work. Returns the faults answered.
fn serve_minor(
    uffd: uffd::Uffd,
    busy_poll: bool,
    spin: Duration,
    stop: &AtomicBool,
) -> Result<u64, HandlerError> {
    serve_faults(&uffd, busy_poll, stop, |ev| {
        let uffd::Event::Fault {
            addr,
            write,
            wp,
            minor,
            ..
        } = ev
        else {
            return Ok(false);
        };
        let at = addr & !(PAGE - 1);
        if !minor {
            uffd.wake(at, PAGE)?;
            return Err(HandlerError::NotMinor {
                page: at,
                kind: if wp { "write-protect" } else { "missing" },
            });
        }
        let t = Instant::now();
        while t.elapsed() < spin {
            std::hint::spin_loop();
        }
        uffd.cont(at, PAGE, !write)?;
        Ok(true)
    })
}

/// The timed accesses with `m` registered as the agent registers guest RAM and a
/// handler thread answering its minor faults.
pub(super) fn minor_access(
    m: &Mapping,
    order: &[u32],
    busy_poll: bool,
    spin: Duration,
) -> Result<Accessed> {
    let u = uffd::Uffd::open(uffd::AGENT_FEATURES)
        .context("a userfaultfd with the agent's features")?;
    // SAFETY: the range is `m`, a shared mapping of a memfd that only raw pointers of
    // this module reach; every fault on it is answered by the handler thread below, which
    // owns the userfaultfd and closes it when it stops (unregistering the range).
    unsafe { u.register(m.base(), m.len as u64, RAM_MODE) }
        .context("registering the mapping MISSING | WP | MINOR")?;
    let stop = AtomicBool::new(false);
    let (lat, cpu, served) = std::thread::scope(|s| {
        let stop_ref = &stop;
        let h = s.spawn(move || serve_minor(u, busy_poll, spin, stop_ref));
        let (lat, cpu) = touch(m, order);
        stop.store(true, Ordering::Relaxed);
        (
            lat,
            cpu,
            h.join().expect("the minor-fault handler panicked"),
        )
    });
    let served = served.context("the minor-fault handler")?;
    ensure!(
        served == order.len() as u64,
        "the handler answered {served} minor faults for {} first accesses",
        order.len()
    );
    Ok((lat, cpu, served))
}

/// The timed accesses with `m` registered as the agent registers guest RAM when its
/// clock reads R bits from the page tables (`MISSING | WP`), and a handler thread that
/// fails on any fault: the pages are in zswap, so none is missing, and without `MINOR`
/// none raises a minor userfault.
pub(super) fn wp_registered_access(
    m: &Mapping,
    order: &[u32],
    busy_poll: bool,
) -> Result<Accessed> {
    let u = uffd::Uffd::open(uffd::AGENT_FEATURES)
        .context("a userfaultfd with the agent's features")?;
    // SAFETY: as in `minor_access`: `m` is reached only through raw pointers of this
    // module, and the handler thread owns the userfaultfd until it stops.
    unsafe { u.register(m.base(), m.len as u64, uffd::MODE_MISSING | uffd::MODE_WP) }
        .context("registering the mapping MISSING | WP")?;
    let stop = AtomicBool::new(false);
    let (lat, cpu, served) = std::thread::scope(|s| {
        let stop_ref = &stop;
        let h = s.spawn(move || {
            serve_faults(&u, busy_poll, stop_ref, |ev| {
                let uffd::Event::Fault {
                    addr, wp, minor, ..
                } = ev
                else {
                    return Ok(false);
                };
                let at = addr & !(PAGE - 1);
                u.wake(at, PAGE)?;
                Err(HandlerError::Unexpected {
                    page: at,
                    kind: if minor {
                        "minor"
                    } else if wp {
                        "write-protect"
                    } else {
                        "missing"
                    },
                })
            })
        });
        let (lat, cpu) = touch(m, order);
        stop.store(true, Ordering::Relaxed);
        (lat, cpu, h.join().expect("the fault handler panicked"))
    });
    let served = served.context("a userfault under MISSING | WP")?;
    ensure!(served == 0, "{served} userfaults under MISSING | WP");
    Ok((lat, cpu, 0))
}

/// A memfd mapping holding `pages`, resident, its PTEs zapped (`MADV_DONTNEED`: the
/// memfd keeps the pages), checked absent by `PAGEMAP_SCAN`; and the zap's ns per page.
fn zapped(pages: &[Box<Page>], pm: &mut Pagemap) -> Result<(OwnedFd, Mapping, f64)> {
    let len = pages.len() * PAGE_SIZE;
    let fd = memfd::create("memfold-bench-rbit").context("memfd")?;
    memfd::set_len(fd.as_fd(), len as u64).context("sizing the memfd")?;
    let m = Mapping::shared(fd.as_fd(), len)?;
    m.fill(pages);
    let t = Instant::now();
    // SAFETY: advice on this mapping of a memfd: it drops the PTEs only, the memfd keeps
    // the pages, so the contents read back the same.
    unsafe { rustix::mm::madvise(m.addr.cast(), len, rustix::mm::Advice::LinuxDontNeed) }
        .context("madvise(MADV_DONTNEED)")?;
    let zap = t.elapsed().as_nanos() as f64 / pages.len() as f64;
    let present = pm
        .scan(m.base(), len as u64, PAGE_IS_PRESENT, 0)
        .context("PAGEMAP_SCAN (Linux 6.7+)")?;
    ensure!(present == 0, "{present} PTEs left after MADV_DONTNEED");
    ensure!(
        m.resident()? == pages.len() as u64,
        "the memfd lost pages to MADV_DONTNEED"
    );
    Ok((fd, m, zap))
}

/// `uffd-rbit`: the clock's R bit today. Resident pages, zapped, registered as the agent
/// registers guest RAM; each first access a minor userfault answered with
/// `UFFDIO_CONTINUE`.
pub(super) fn uffd_rbit_side(
    pages: &[Box<Page>],
    order: &[u32],
    busy_poll: bool,
    spin: Duration,
) -> Result<Raw> {
    let mut pm = Pagemap::open().context("/proc/self/pagemap")?;
    let (_fd, m, _) = zapped(pages, &mut pm)?;
    let (lat, cpu_us, uffd_faults) = minor_access(&m, order, busy_poll, spin)?;
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "uffd-rbit: {bad} pages read back wrong");
    Ok(Raw {
        lat,
        cpu_us,
        uffd_faults,
        ..Raw::default()
    })
}

/// `kernel-rbit`: an R bit without userfaultfd. Resident pages, zapped, no registration:
/// each first access an in-kernel minor fault (or none, where fault-around mapped the
/// page with a neighbour's); then which pages were touched, read back two ways.
/// `async_wp`: first registered for asynchronous write-protect (`async-rbit`), which
/// raises no userfault and maps one page a fault.
pub(super) fn kernel_rbit_side(pages: &[Box<Page>], order: &[u32], async_wp: bool) -> Result<Raw> {
    let mut pm = Pagemap::open().context("/proc/self/pagemap")?;
    let (_fd, m, zap) = zapped(pages, &mut pm)?;
    let _u = if async_wp {
        Some(register_async_wp(&m)?)
    } else {
        None
    };
    let len = m.len as u64;
    let n = pages.len() as f64;
    let t = Instant::now();
    pm.scan(m.base(), len, PAGE_IS_PRESENT, 0)?;
    let scan_empty = t.elapsed().as_nanos() as f64 / n;
    let (lat, cpu_us) = touch(&m, order);
    let t = Instant::now();
    let present = pm.scan(m.base(), len, PAGE_IS_PRESENT, 0)?;
    let scan_full = t.elapsed().as_nanos() as f64 / n;
    let t = Instant::now();
    let read = pm
        .read_present(m.base(), len)
        .context("reading /proc/self/pagemap")?;
    let read_ns = t.elapsed().as_nanos() as f64 / n;
    ensure!(
        present == pages.len() as u64 && read == present,
        "after touching every page: PAGEMAP_SCAN says {present} present, the pagemap file {read}"
    );
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "kernel-rbit: {bad} pages read back wrong");
    Ok(Raw {
        lat,
        cpu_us,
        clock: Some(ClockCost {
            zap_ns_per_page: zap,
            scan_none_ns_per_page: scan_empty,
            scan_all_ns_per_page: scan_full,
            pagemap_read_ns_per_page: read_ns,
        }),
        ..Raw::default()
    })
}

/// A userfaultfd with asynchronous write-protect, `m` registered `WP` with it: no access
/// to `m` ever waits for a handler; while it lives, fault-around is off for `m`.
fn register_async_wp(m: &Mapping) -> Result<uffd::Uffd> {
    let u = uffd::Uffd::open(uffd::FEATURE_WP_ASYNC | uffd::FEATURE_WP_SHMEM)
        .context("a userfaultfd with WP_ASYNC and WP on shmem")?;
    // SAFETY: the range is `m`, a shared mapping of a memfd only raw pointers of this
    // module reach; its write-protect faults are resolved by the kernel (asynchronous
    // write-protect) and it is registered for no other fault, so no access waits.
    unsafe { u.register(m.base(), m.len as u64, uffd::MODE_WP) }
        .context("registering the mapping WP (async)")?;
    Ok(u)
}

/// What a clock without userfaults would need from this kernel, probed.
#[derive(Clone, Debug, Serialize)]
pub struct ClockProbe {
    /// Every userfaultfd feature the kernel has.
    pub uffd_features: u64,
    /// `UFFD_FEATURE_WP_ASYNC` among them.
    pub wp_async: bool,
    /// Pages a read fault on one zapped page of a 64-page memfd mapping left present
    /// (fault-around): plain, under `MADV_RANDOM`, registered async `WP`.
    pub fault_around: [u64; 3],
    /// The M-bit probe: asynchronous write-protect on a memfd mapping, or why not.
    pub mbit: Result<MBit, String>,
}

/// M bits by `UFFD_FEATURE_WP_ASYNC` + `PAGEMAP_SCAN`, measured on a memfd mapping.
#[derive(Clone, Debug, Serialize)]
pub struct MBit {
    /// Pages written after the range was write-protected (every other one).
    pub written: u64,
    /// Pages `PAGEMAP_SCAN` reported `PAGE_IS_WRITTEN`.
    pub seen_written: u64,
    /// Written pages still reported after a `PM_SCAN_WP_MATCHING` scan re-protected them.
    pub seen_after_rearm: u64,
    /// A first write to a write-protected page, median µs (the kernel unprotects it).
    pub write_fault_p50_us: f64,
    /// The re-protecting scan, ns per page of the range.
    pub rearm_scan_ns_per_page: f64,
}

/// Probes this kernel for a userfault-free clock; `pages` sizes the M-bit probe.
pub fn probe(pages: &[Box<Page>]) -> Result<ClockProbe> {
    let uffd_features = uffd::available_features().context("userfaultfd features")?;
    let mut pm = Pagemap::open().context("/proc/self/pagemap")?;
    let mut fault_around = [0u64; 3];
    for (i, how) in fault_around.iter_mut().enumerate() {
        let (_fd, m, _) = zapped(&pages[..64.min(pages.len())], &mut pm)?;
        let _u = if i == 2 {
            Some(register_async_wp(&m)?)
        } else {
            None
        };
        if i == 1 {
            // SAFETY: advice on this mapping; it changes no contents.
            unsafe { rustix::mm::madvise(m.addr.cast(), m.len, rustix::mm::Advice::Random) }
                .context("madvise(MADV_RANDOM)")?;
        }
        // SAFETY: the first byte of page 0 of the mapping, read through a raw pointer.
        std::hint::black_box(unsafe { std::ptr::read_volatile(m.page(0)) });
        *how = pm.scan(m.base(), m.len as u64, PAGE_IS_PRESENT, 0)?;
    }
    let mbit = if uffd_features & uffd::FEATURE_WP_ASYNC == 0 {
        Err("no UFFD_FEATURE_WP_ASYNC".to_string())
    } else {
        mbit(pages, &mut pm).map_err(|e| format!("{e:#}"))
    };
    Ok(ClockProbe {
        uffd_features,
        wp_async: uffd_features & uffd::FEATURE_WP_ASYNC != 0,
        fault_around,
        mbit,
    })
}

/// The M-bit probe: protect a resident memfd mapping with an asynchronous
/// write-protect userfaultfd, write every other page (timed), read the written pages
/// back and re-protect them with `PAGEMAP_SCAN`.
fn mbit(pages: &[Box<Page>], pm: &mut Pagemap) -> Result<MBit> {
    let len = pages.len() * PAGE_SIZE;
    let fd = memfd::create("memfold-bench-mbit").context("memfd")?;
    memfd::set_len(fd.as_fd(), len as u64).context("sizing the memfd")?;
    let m = Mapping::shared(fd.as_fd(), len)?;
    m.fill(pages);
    let u = register_async_wp(&m)?;
    u.write_protect(m.base(), len as u64, true)?;
    let mut lat = Vec::with_capacity(pages.len() / 2);
    for i in (0..pages.len() as u32).step_by(2) {
        let t = Instant::now();
        // SAFETY: the first byte of page `i` of the mapping, written through a raw
        // pointer (no reference covers the mapping); the same value it holds.
        unsafe { std::ptr::write_volatile(m.page(i), pages[i as usize][0]) };
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let seen_written = pm.scan(m.base(), len as u64, PAGE_IS_WRITTEN, 0)?;
    let t = Instant::now();
    pm.scan(
        m.base(),
        len as u64,
        PAGE_IS_WRITTEN,
        PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
    )
    .context("PAGEMAP_SCAN with PM_SCAN_WP_MATCHING")?;
    let rearm = t.elapsed().as_nanos() as f64 / pages.len() as f64;
    let seen_after_rearm = pm.scan(m.base(), len as u64, PAGE_IS_WRITTEN, 0)?;
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "the M-bit probe: {bad} pages read back wrong");
    drop(u);
    Ok(MBit {
        written: lat.len() as u64,
        seen_written,
        seen_after_rearm,
        write_fault_p50_us: super::summarize(&lat).p50_us,
        rearm_scan_ns_per_page: rearm,
    })
}
