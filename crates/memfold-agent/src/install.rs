//! Mapping changes over guest RAM: pool frames mapped over guest pages (a share), and the
//! guest memfd mapped back over a page (the mapping half of a CoW break).
//!
//! A share maps the pool frames at a staging address, registers them with the userfaultfd
//! and write-protects them there, then moves them over the guest pages with `mremap`.
//! With `UFFD_FEATURE_EVENT_REMAP` the moved mapping keeps its registration and its
//! protected PTEs, so no writer ever sees an unprotected shared page; but the mover waits
//! until the agent reads the remap event, so the move runs on a helper thread
//! ([`Remapper`]) while the agent's thread reads events.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc;

use memfold_ids::Gfn;
use memfold_sys::uffd::{self, Event};

use crate::{Agent, PAGE};

/// The helper's errno for a job not run: the region is being unmapped (`unplug.rs`).
/// Neither `mremap` nor `madvise` fails with it.
pub(crate) const GONE: i32 = libc::ENXIO;

/// A mapping change made on the helper thread.
pub(crate) enum Job {
    /// `mremap` `len` bytes from `src` onto `dst`.
    Move {
        /// Source address.
        src: u64,
        /// Bytes.
        len: u64,
        /// Destination address.
        dst: u64,
    },
    /// `MADV_DONTNEED` each (address, bytes) range: private guest pages whose PTEs the
    /// clock drops (the memfd keeps the pages).
    Zap(Vec<(u64, u64)>),
    /// `MADV_DONTNEED` each (address, bytes) range of guest pages mapped onto pool frames,
    /// write-protected (the pool keeps the frames; `Agent::zap_shared`). The kernel's
    /// remove events for these ranges are the agent's own and are dropped, not taken for
    /// QEMU discarding guest RAM.
    ZapFrames(Vec<(u64, u64)>),
}

/// Makes mapping changes on a helper thread: with EVENT_REMAP and EVENT_REMOVE the thread
/// that moves a registered mapping or drops its PTEs waits until the agent reads the
/// event, so the agent's own thread cannot be the one making them.
pub(crate) struct Remapper {
    /// Changes to make.
    tx: mpsc::Sender<Job>,
    /// One errno (native-endian i32, 0 on success) per job done.
    done_r: OwnedFd,
}

impl Remapper {
    /// Starts the helper thread.
    ///
    /// Errors: no pipe, or the thread could not be started.
    pub(crate) fn new() -> io::Result<Remapper> {
        let mut p = [0 as RawFd; 2];
        // SAFETY: pipe2 fills the two fds of the array it is given, which lives across
        // the call.
        if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh fds we own, and nothing else does.
        let (done_r, done_w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("memfold-remap".into())
            .spawn(move || {
                // Its mapping changes are the agent's, made under the gate (`unplug.rs`).
                crate::ram_sends::mark_agent_thread();
                for job in rx {
                    let errno = run_job(&job);
                    // SAFETY: writes 4 bytes from a local.
                    unsafe {
                        libc::write(
                            done_w.as_raw_fd(),
                            &errno as *const i32 as *const libc::c_void,
                            4,
                        )
                    };
                }
            })?;
        Ok(Remapper { tx, done_r })
    }
}

/// Carries out one job; returns 0 or the errno of the first call that failed.
fn run_job(job: &Job) -> i32 {
    let errno = || io::Error::last_os_error().raw_os_error().unwrap_or(-1);
    match *job {
        Job::Move { src, len, dst } => {
            // SAFETY: moves a mapping the agent created onto guest RAM it manages, which
            // no Rust reference points into (see `run`).
            let r = unsafe {
                libc::mremap(
                    src as *mut libc::c_void,
                    len as usize,
                    len as usize,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    dst as *mut libc::c_void,
                )
            };
            if r as u64 == dst {
                0
            } else {
                errno()
            }
        }
        Job::Zap(ref ranges) | Job::ZapFrames(ref ranges) => {
            for &(addr, len) in ranges {
                // SAFETY: drops only the PTEs of guest RAM the agent manages (private
                // pages, or pages on pool frames, write-protected with uffd-wp markers
                // left behind); the memfd or the pool keeps the pages, and the next access
                // is a minor fault (the agent's to serve, or the kernel's).
                if unsafe {
                    libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_DONTNEED)
                } != 0
                {
                    return errno();
                }
            }
            0
        }
    }
}

impl Agent {
    /// Maps pool bytes `[pool_off, pool_off+len)` write-protected over guest address `dst`,
    /// private guest pages backed by guest RAM's memfd. On error nothing has changed at
    /// `dst`, but for one case the kernel leaves: an `ENOMEM` inside the move (its
    /// `vm.max_map_count` check or an allocation), which comes after `mremap` unmapped
    /// `dst`; the VMA budget's 4 096 mappings of headroom (`vmas.rs`) keep the first away.
    /// After a failed move `dst` is checked (`/proc/self/maps`): if the memfd no longer
    /// backs all of it, the agent fails closed — the guest would fault on the hole, or
    /// read whatever QEMU maps there next, while every byte of its RAM is in the memfd.
    /// Faults read meanwhile are kept in `deferred`.
    pub(crate) fn install(&mut self, dst: u64, pool_off: u64, len: u64) -> io::Result<()> {
        let pool = self.pool()?.as_raw_fd();
        // SAFETY: a new mapping at an address the kernel picks.
        let staging = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                pool,
                pool_off as libc::off_t,
            )
        };
        if staging == libc::MAP_FAILED {
            return Err(io::Error::other(format!(
                "mapping pool frames: {}",
                io::Error::last_os_error()
            )));
        }
        let staging = staging as u64;
        // SAFETY: the staging mapping was just created by this function; nothing but this
        // function knows its address.
        let prepared = unsafe { self.uffd.register(staging, len, uffd::MODE_WP) }
            .and_then(|_| self.uffd.write_protect(staging, len, true))
            .map_err(io::Error::from);
        if let Err(e) = prepared {
            // SAFETY: unmaps the staging mapping created above.
            unsafe { libc::munmap(staging as *mut libc::c_void, len as usize) };
            return Err(e);
        }
        let errno = self.helper(Job::Move {
            src: staging,
            len,
            dst,
        });
        if errno == 0 {
            crate::vmas::PROCESS.changed();
            return Ok(());
        }
        // SAFETY: the failed move left the staging mapping in place.
        unsafe { libc::munmap(staging as *mut libc::c_void, len as usize) };
        if errno == GONE || !self.check_still_backed(dst, len, errno) {
            return Err(crate::unplug::gone_error(dst));
        }
        Err(io::Error::other(format!(
            "mremap onto guest RAM at {dst:#x}: {}",
            io::Error::from_raw_os_error(errno)
        )))
    }

    /// After a move onto `dst` failed with `errno`: fails closed unless guest RAM's memfd
    /// still backs all of `[dst, dst + len)` at its own offsets ([`Agent::install`]).
    /// Looked at under the gate; returns false, looking at nothing, if the region is gone
    /// (QEMU unplugging it: a detach, not a hole to fail closed on).
    fn check_still_backed(&self, dst: u64, len: u64, errno: i32) -> bool {
        let gate = self.managed.gate();
        let Some(_held) = gate.enter() else {
            return false;
        };
        let backed = crate::regions::memfd_backs(
            std::os::fd::AsFd::as_fd(&self.memfd),
            dst,
            len,
            dst - self.base,
        );
        if !backed.unwrap_or(false) {
            self.fail_closed(&format!(
                "a move onto guest RAM at {dst:#x} ({len} bytes) failed ({}) after the kernel unmapped it: the guest would fault on the hole or read what is mapped there next",
                io::Error::from_raw_os_error(errno)
            ));
        }
        true
    }

    /// Has the helper thread carry out `job` and returns its errno (0: done; [`GONE`]: not
    /// run, the region is being unmapped by QEMU), reading the
    /// userfaultfd meanwhile (the helper waits for its own events to be read): faults and
    /// discarded ranges are kept in `deferred`, in order, for after the request (or, in
    /// `Agent::zap_shared`, after each chunk). Fails closed if the helper
    /// is gone, since whether the job changed guest RAM's mappings is then unknown.
    pub(crate) fn helper(&mut self, job: Job) -> i32 {
        let what = match &job {
            Job::Move { dst, .. } => format!("a move onto guest RAM at {dst:#x}"),
            Job::Zap(r) => format!("arming the clock over {} runs", r.len()),
            Job::ZapFrames(r) => format!("dropping the PTEs of {} runs on frames", r.len()),
        };
        // Remove events inside these ranges are the job's own.
        let own: Vec<(u64, u64)> = match &job {
            Job::ZapFrames(r) => r.iter().map(|&(a, len)| (a, a + len)).collect(),
            _ => Vec::new(),
        };
        // Under the gate: QEMU unmapping the region waits for the job, and a job after
        // QEMU began to unmap it is not run (`unplug.rs`).
        let gate = self.managed.gate();
        let Some(_held) = gate.enter() else {
            return GONE;
        };
        if self.remapper.tx.send(job).is_err() {
            self.fail_closed(&format!("the remap thread is gone, before {what}"));
        }
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.remapper.done_r.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: polls a valid array of two pollfd that lives across the call.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
            loop {
                match self.uffd.read_event() {
                    // Both in order, handled once the request is done: a discard must
                    // find the pages as the request leaves them (a page being shared is
                    // on its frame by then, and let go), and after earlier faults.
                    // The kernel's report of the job's own zap of shared pages, read
                    // before the job ends (its caller waits for it): not a discard.
                    Ok(Some(Event::Remove { start, end }))
                        if own.iter().any(|&(a, b)| a <= start && end <= b) => {}
                    Ok(Some(ev @ (Event::Fault { .. } | Event::Remove { .. }))) => {
                        self.deferred.push(ev)
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        self.fail_closed(&format!("reading the userfaultfd during {what}: {e}"))
                    }
                }
            }
            if fds[1].revents != 0 {
                let mut errno: i32 = 0;
                let n = loop {
                    // SAFETY: reads 4 bytes into a local.
                    let n = unsafe {
                        libc::read(
                            self.remapper.done_r.as_raw_fd(),
                            &mut errno as *mut i32 as *mut libc::c_void,
                            4,
                        )
                    };
                    if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                        break n;
                    }
                };
                if n != 4 {
                    // The helper is gone without a word: whether pool frames now back
                    // guest pages, unprotected, is unknown.
                    self.fail_closed(&format!("the remap thread ended during {what}"));
                }
                return errno;
            }
        }
    }

    /// Maps the guest memfd's page `gfn` back over its address (replacing the pool
    /// mapping a share installed) and registers it as the rest of guest RAM is.
    /// Does not wake the faulting thread.
    ///
    /// Errors: the mapping or the registration failed.
    pub(crate) fn map_guest_page(&self, gfn: Gfn) -> io::Result<()> {
        self.map_guest_range(gfn, 1)
    }

    /// Maps the guest memfd's pages `[first, first + n)` back over their addresses
    /// (replacing the pool mappings shares installed) and registers them as the rest of
    /// guest RAM is (`Agent::ram_mode`). Does not wake faulting threads.
    ///
    /// Errors: the mapping failed (nothing changed); a failed registration fails closed.
    pub(crate) fn map_guest_range(&self, first: Gfn, n: usize) -> io::Result<()> {
        let addr = self.page_addr(first);
        let len = n as u64 * PAGE;
        // Mapped and registered under the gate, or not at all (`unplug.rs`).
        let gate = self.managed.gate();
        let _held = gate
            .enter()
            .ok_or_else(|| crate::unplug::gone_error(addr))?;
        // SAFETY: replaces the agent-installed pool mappings of these guest pages by the
        // guest memfd pages that now hold the same bytes.
        let r = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.memfd.as_raw_fd(),
                first.offset() as libc::off_t,
            )
        };
        if r as u64 != addr {
            return Err(io::Error::other(format!(
                "CoW break of {first} ({n} pages): mmap: {}",
                io::Error::last_os_error()
            )));
        }
        crate::vmas::PROCESS.changed();
        // SAFETY: the pages are guest RAM again (the guest memfd mapped back over them
        // above), which no Rust reference points into (see `run`).
        if let Err(e) = unsafe { self.uffd.register(addr, len, self.ram_mode()) } {
            // Guest RAM is mapped there now, but no fault reaches the agent: writes would
            // land unseen, under pages it still holds as shared. No way back is safe.
            self.fail_closed(&format!(
                "{first} ({n} pages): guest RAM mapped back over shared pages, but registering it failed: {e}"
            ));
        }
        Ok(())
    }
}
