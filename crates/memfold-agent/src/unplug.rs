//! QEMU's own changes to guest RAM's mappings (`munmap`, `mmap` with `MAP_FIXED`,
//! `mremap`), interposed: a hot-unplugged region (`object_del`: `qemu_ram_munmap`) is
//! closed to the agent before QEMU unmaps it, so that nothing the agent maps lands on
//! what QEMU puts at that address next (its heap, a thread's stack, a new DIMM).
//!
//! The watcher (`regions.rs`) sees an unplug only 2–10 s later; meanwhile memfoldd's
//! requests and the faults the agent defers would still `mmap(MAP_FIXED)` or `mremap`
//! at `base + gfn * 4096`. So every managed region has a [`Gate`]: a lock and the
//! region's gone flag (the watcher's, which `serve` reads and detaches on).
//!
//! **Invariant:** while an agent manages a region, nothing the agent maps lands in that
//! range after QEMU began to unmap it: QEMU's `munmap`/`mmap(MAP_FIXED)`/`mremap` over
//! the range marks it gone under the gate before it changes anything, and the agent maps
//! only under the gate with gone false ([`Gate::enter`]).
//!
//! Lock order: [`GATES`] is never held while waiting for a gate, and a thread holding a
//! gate (an agent's) never takes [`GATES`] (agent threads pass the interposers without
//! it; `manage` and `Managed`'s drop run with no gate held), so the two cannot deadlock.
//! A QEMU thread's unmap waits at most for one mapping change of the agent. Nothing here
//! allocates while a lock is held: QEMU built with another allocator (jemalloc,
//! tcmalloc) may call `mmap` from inside it.
//!
//! Not covered: a raw `syscall(SYS_munmap, ...)` in QEMU or a library (QEMU's own code
//! calls libc), and a signal handler unmapping guest RAM (none does in QEMU).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::ram_sends::is_agent_thread;
use crate::regions::GoneFlag;

/// A managed region's gate.
pub(crate) struct Gate {
    /// Registry order, for walking [`GATES`] without holding it.
    id: u64,
    /// `[base, end)`: the region's range.
    base: u64,
    end: u64,
    /// Held across each of the agent's mapping changes in the range.
    lock: Mutex<()>,
    /// The region's gone flag (`Watch::add`).
    gone: GoneFlag,
}

impl Gate {
    /// The gate held, if the region is not gone: map into its range only while holding
    /// it (the invariant above). `None`: gone, map nothing.
    pub(crate) fn enter(&self) -> Option<MutexGuard<'_, ()>> {
        let held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        (!self.gone.load(Ordering::SeqCst)).then_some(held)
    }

    /// Marks the region gone once no mapping change of the agent is under way in it.
    fn close(&self) {
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.gone.store(true, Ordering::SeqCst);
    }
}

/// The error of a mapping change refused because the region is gone.
pub(crate) fn gone_error(addr: u64) -> std::io::Error {
    std::io::Error::other(format!(
        "guest RAM at {addr:#x} is being unmapped by QEMU (hot-unplug): nothing mapped there"
    ))
}

/// Most regions managed at once (QEMU's KVM memory slots are fewer).
const MAX_GATES: usize = 512;

/// Every managed region's gate; a fixed table, so nothing allocates under its lock.
static GATES: Mutex<[Option<Arc<Gate>>; MAX_GATES]> = Mutex::new([const { None }; MAX_GATES]);

/// How many of [`GATES`] are taken, read without the lock on every interposed call.
static HOW_MANY: AtomicUsize = AtomicUsize::new(0);

/// The next gate's id.
static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// A region recorded as managed (its gate in [`GATES`]) until this is dropped.
pub(crate) struct Managed(Arc<Gate>);

impl Managed {
    /// The region's gate.
    pub(crate) fn gate(&self) -> Arc<Gate> {
        Arc::clone(&self.0)
    }

    /// Registers the region with `uffd` (`mode`) under its gate, once `/proc/self/maps`
    /// shows guest RAM's `memfd` still backing all of it: QEMU may have unmapped it after
    /// the look that found it and before [`manage`] made its gate (no gate to close
    /// then), and mapped something else there.
    ///
    /// Errors: the region is gone or no longer backed by its memfd (unplugged
    /// meanwhile), `/proc/self/maps` unreadable, the registration's.
    pub(crate) fn register(
        &self,
        uffd: &memfold_sys::uffd::Uffd,
        mode: u64,
        memfd: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<()> {
        let gate = &self.0;
        let (base, len) = (gate.base, gate.end - gate.base);
        let _held = gate.enter().ok_or_else(|| gone_error(base))?;
        if !crate::regions::memfd_backs(memfd, base, len, 0)? {
            return Err(gone_error(base));
        }
        // SAFETY: guest RAM is QEMU's shared memfd mapping (just checked, under the gate:
        // QEMU cannot change it meanwhile), which this process touches only through raw
        // addresses (QEMU's vCPUs and devices), never through Rust references; the agent
        // thread that answers its faults never touches it through the mapping. The range
        // is this region's alone: no other agent registers it (one agent per memfd).
        unsafe { uffd.register(base, len, mode) }?;
        Ok(())
    }
}

/// Records `[base, base + bytes)` as managed, with the region's gone flag.
///
/// Errors: [`MAX_GATES`] regions are managed already.
pub(crate) fn manage(base: u64, bytes: u64, gone: GoneFlag) -> std::io::Result<Managed> {
    let gate = Arc::new(Gate {
        id: NEXT_ID.fetch_add(1, Ordering::SeqCst) as u64,
        base,
        end: base.saturating_add(bytes),
        lock: Mutex::new(()),
        gone,
    });
    let mut g = GATES.lock().unwrap_or_else(|e| e.into_inner());
    let slot = g
        .iter_mut()
        .find(|s| s.is_none())
        .ok_or_else(|| std::io::Error::other(format!("more than {MAX_GATES} guest RAM regions")))?;
    *slot = Some(Arc::clone(&gate));
    HOW_MANY.fetch_add(1, Ordering::SeqCst);
    Ok(Managed(gate))
}

impl Drop for Managed {
    fn drop(&mut self) {
        let taken = {
            let mut g = GATES.lock().unwrap_or_else(|e| e.into_inner());
            let slot = g
                .iter_mut()
                .find(|s| s.as_ref().is_some_and(|x| Arc::ptr_eq(x, &self.0)));
            let taken = slot.and_then(Option::take);
            if taken.is_some() {
                HOW_MANY.fetch_sub(1, Ordering::SeqCst);
            }
            taken
        };
        drop(taken); // freed, if last, outside the lock
    }
}

/// Before QEMU changes the mappings of `[addr, addr + len)`: every managed region it
/// overlaps is marked gone, each under its gate. Agent threads pass (their changes are
/// the agent's own, made under the gate); so does every call while nothing is managed.
fn closing(addr: u64, len: u64) {
    if len == 0 || HOW_MANY.load(Ordering::SeqCst) == 0 || is_agent_thread() {
        return;
    }
    let end = addr.saturating_add(len);
    let mut after = 0;
    loop {
        // The overlapping gate with the least id past `after`: one at a time, so GATES
        // is not held while a gate is waited for.
        let next = {
            let g = GATES.lock().unwrap_or_else(|e| e.into_inner());
            g.iter()
                .flatten()
                .filter(|x| x.id > after && x.base < end && addr < x.end)
                .min_by_key(|x| x.id)
                .cloned()
        };
        let Some(gate) = next else { return };
        gate.close();
        after = gate.id;
    }
}

/// libc's definition of `name`, found once past this library (`RTLD_NEXT`); 0 if none.
/// While it is looked up, a call that comes back here (`dlsym` allocating, an allocator
/// mapping memory) finds 0 and makes the system call itself.
fn next_symbol(cell: &AtomicUsize, name: &std::ffi::CStr) -> usize {
    const UNRESOLVED: usize = usize::MAX;
    thread_local! {
        static RESOLVING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    let p = cell.load(Ordering::Acquire);
    if p != UNRESOLVED {
        return p;
    }
    if RESOLVING.try_with(|r| r.replace(true)).unwrap_or(true) {
        return 0;
    }
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name only looks a symbol up.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    let _ = RESOLVING.try_with(|r| r.set(false));
    cell.store(p, Ordering::Release);
    p
}

/// The next definition of C function `$name` as type `$ty`, if any.
macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static REAL: AtomicUsize = AtomicUsize::new(usize::MAX);
        let p = next_symbol(&REAL, $name);
        // SAFETY: libc's symbol of that name has this C signature.
        (p != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(p) })
    }};
}

type Mmap =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, c_int, libc::off_t) -> *mut c_void;
type Munmap = unsafe extern "C" fn(*mut c_void, usize) -> c_int;
type Mremap = unsafe extern "C" fn(*mut c_void, usize, usize, c_int, ...) -> *mut c_void;

/// Whether `mmap` flags replace what is mapped at the address.
fn replaces(flags: c_int) -> bool {
    flags & libc::MAP_FIXED != 0 && flags & libc::MAP_FIXED_NOREPLACE == 0
}

/// An interposed `mmap`-shaped call (`mmap`, `mmap64`: the same on x86_64).
macro_rules! mmap_like {
    ($name:ident, $sym:literal) => {
        #[doc = concat!("`", stringify!($name), "`; with `MAP_FIXED` over a managed region, ")]
        /// the region is marked gone first (the invariant above). A file mapped shared
        /// is counted for the hot-plug watch (`regions::note_shared_map`).
        ///
        /// # Safety
        /// As libc's.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            off: libc::off_t,
        ) -> *mut c_void {
            if replaces(flags) {
                closing(addr as u64, len as u64);
            }
            let mapped = match real!($sym, Mmap) {
                // SAFETY: the caller's arguments, to libc's call of the same name.
                Some(f) => unsafe { f(addr, len, prot, flags, fd, off) },
                // SAFETY: the system call with the caller's arguments, as libc makes it.
                None => unsafe {
                    libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) as *mut c_void
                },
            };
            // Counted once the mapping exists: a look that saw the count sees the mapping.
            if mapped != libc::MAP_FAILED {
                crate::regions::note_shared_map(fd, flags);
            }
            mapped
        }
    };
}

mmap_like!(mmap, c"mmap");
mmap_like!(mmap64, c"mmap64");

/// `munmap`; over a managed region, the region is marked gone first (the invariant
/// above).
///
/// # Safety
/// As libc's.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    closing(addr as u64, len as u64);
    match real!(c"munmap", Munmap) {
        // SAFETY: the caller's arguments, to libc's munmap.
        Some(f) => unsafe { f(addr, len) },
        // SAFETY: the system call with the caller's arguments, as libc makes it.
        None => unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int },
    }
}

/// `mremap`; over a managed region (the old range, or the new one with
/// `MREMAP_FIXED`), the region is marked gone first (the invariant above).
///
/// C declares it variadic (`new_address` only with `MREMAP_FIXED`); stable Rust cannot
/// define a variadic function, so it takes `new_address` as a fifth argument. On x86_64
/// (System V) a variadic call passes it in the same register (`r8`) as a fixed one, and
/// without `MREMAP_FIXED` it is read for nothing but passing on, where libc ignores it.
///
/// # Safety
/// As libc's.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new_address: *mut c_void,
) -> *mut c_void {
    // The old range whatever the call: moved, shrunk, or grown in place (which covers
    // only free addresses past it, none a managed region's).
    closing(old as u64, old_len as u64);
    if flags & libc::MREMAP_FIXED != 0 {
        closing(new_address as u64, new_len as u64);
    }
    match real!(c"mremap", Mremap) {
        // SAFETY: the caller's arguments, to libc's mremap, called as the variadic
        // function it is.
        Some(f) => unsafe { f(old, old_len, new_len, flags, new_address) },
        // SAFETY: the system call with the caller's arguments, as libc makes it.
        None => unsafe {
            libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_address)
                as *mut c_void
        },
    }
}

impl crate::Agent {
    /// After the region was marked gone: waits until nothing of it (its memfd, a pool
    /// frame) is mapped in its range any more, so that closing the userfaultfd leaves no
    /// frame writable by the guest. QEMU's unmap runs right after it marked the region;
    /// if something is still mapped after [`UNMAP_WAIT`] QEMU changed only part of the
    /// region, which the agent cannot serve or leave: it fails closed.
    pub(crate) fn await_unmapped(&self) {
        let ino = rustix::fs::fstat(&self.memfd)
            .map(|st| st.st_ino)
            .unwrap_or(0);
        let (base, end) = (self.base, self.base + self.ram_bytes);
        let started = std::time::Instant::now();
        while crate::regions::still_mapped(base, end, ino) {
            if started.elapsed() > UNMAP_WAIT {
                self.fail_closed(&format!(
                    "QEMU unmapped or replaced part of guest RAM region {} ({base:#x}..{end:#x}) while pages of it are still mapped",
                    self.cfg.name
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

/// How long [`crate::Agent::await_unmapped`] waits for QEMU's unmap.
const UNMAP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
