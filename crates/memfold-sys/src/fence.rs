//! The write fence between writers of guest RAM in other processes and the agent.
//!
//! A block device in its own process writes guest RAM through QEMU's page tables
//! (`process_vm_writev`). The kernel pins the target pages first and copies into them
//! after; a page write-protected between the pin and the copy takes the copy without a
//! fault. The agent compares a page under write-protection and then maps a frame over it
//! (a share), or punches it out (a zero page, a stashed page): a copy still to come lands
//! in a page the guest no longer sees, and the guest reads the old bytes. The kernel's
//! KSM refuses such pages by their reference count (`write_protect_page`: "no O_DIRECT
//! or similar I/O is in progress"); userspace cannot see references, so the writers say
//! so themselves, here.
//!
//! The fence is one memfd per QEMU process, named [`FENCE_NAME`], that the agent creates
//! in its constructor (before QEMU's `main`, so before any device can connect) and a
//! device finds among QEMU's descriptors ([`WriteFence::of_process`]). It holds a
//! counter per [`CHUNK`] of QEMU's address space (hashed into [`SLOTS`] slots; two chunks
//! sharing a slot only make the agent more careful). The protocol, a Dekker handshake
//! whose barriers are the system calls and the locked increments:
//! - a writer [`WriteFence::hold`]s the chunks of its target before its copy's system
//!   call and lets go when it has returned (the copy is done);
//! - the agent write-protects a page, then asks [`WriteFence::busy`]; if the page's chunk
//!   is held it leaves the page alone (as a page that changed), else it reads the page.
//!
//! Why nothing is lost: if the agent sees the chunk free, each writer either let go
//! before (its copy is in the page the agent then reads) or holds it after the agent's
//! write-protection, so pins the page after it and faults, waiting for the agent like a
//! vCPU store. A QEMU that writes the fence (a guest escaped into it) only makes its own
//! agent share less, or lose its own guest's writes; the device checks the memfd is
//! sealed against shrinking, so no access to it can fault.
//!
//! A writer whose copy lands after its call returns (QEMU's `aio=native`: the kernel
//! completes the read later, and QEMU reaps it from a ring in its own memory, with no
//! call to hold the fence across) [`WriteFence::close`]s the fence instead, before its
//! first such call: from then on every page is busy, so the agent takes no page again.
//! What it already holds stays safe, since a pin of a page it holds faults.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// The memfd's name (`/proc/PID/fd` shows `/memfd:memfold-fence (deleted)`).
pub const FENCE_NAME: &str = "memfold-fence";

/// Bytes of QEMU's address space one counter covers: 64 KiB (16 pages).
pub const CHUNK: u64 = 1 << 16;

/// Counters (4 bytes each, after a 4 KiB header): 256 KiB of memfd, of which only the
/// slots used are ever allocated.
pub const SLOTS: usize = 1 << 16;

/// The header: the magic at 0, the closed flag at [`CLOSED_AT`].
const HEADER: usize = 4096;
const CLOSED_AT: usize = 8;
/// Bytes one read or write system call transfers at most (Linux's `MAX_RW_COUNT`).
const MAX_TRANSFER: u64 = 0x7fff_f000;
const LEN: usize = HEADER + SLOTS * 4;
const MAGIC: u64 = u64::from_le_bytes(*b"MFFENCE1");

/// One process's write fence, mapped shared (see the module).
#[derive(Debug)]
pub struct WriteFence {
    base: NonNull<u8>,
    _fd: OwnedFd,
}

// SAFETY: the mapping is only accessed through atomics; it lives as long as the value.
unsafe impl Send for WriteFence {}
// SAFETY: as above.
unsafe impl Sync for WriteFence {}

impl Drop for WriteFence {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, LEN bytes; no reference into it outlives self
        // (holds borrow self).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), LEN) };
    }
}

/// Chunks held by one writer for one copy; let go when dropped.
#[derive(Debug)]
pub struct FenceHold<'f> {
    fence: &'f WriteFence,
    slots: Vec<u32>,
}

impl Drop for FenceHold<'_> {
    fn drop(&mut self) {
        for &s in &self.slots {
            // After the copy's system call returned: its bytes are in the page.
            self.fence.slot(s as usize).fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl WriteFence {
    /// The agent's fence: a new sealed memfd (see the module).
    ///
    /// Errors: creating, sizing, mapping or sealing the memfd failed.
    pub fn create() -> io::Result<WriteFence> {
        let fd =
            rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, LEN as u64)?;
        let f = Self::map(fd)?;
        f.magic().store(MAGIC, Ordering::SeqCst);
        rustix::fs::fcntl_add_seals(
            &f._fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )?;
        Ok(f)
    }

    /// The fence of process `pid`, held by `pidfd` (a QEMU whose agent made one), found
    /// among its descriptors; `None` if it has none (no agent: nothing there is shared,
    /// stashed or reclaimed, so no write needs a fence). Needs the access
    /// `process_vm_writev` needs.
    ///
    /// The descriptor is taken with `pidfd_getfd`, never reopened by its `/proc` link:
    /// what is checked is what is mapped, and a QEMU that swaps the descriptor for a FIFO
    /// or a FUSE file between a look and an `open` cannot make the device block.
    ///
    /// Errors: `/proc/PID/fd` cannot be read, a descriptor named as the fence cannot be
    /// taken, or none named so is one (not sealed against shrinking, the wrong size, no
    /// magic).
    pub fn of_process(pidfd: BorrowedFd<'_>, pid: u32) -> io::Result<Option<WriteFence>> {
        let dir = format!("/proc/{pid}/fd");
        let want = format!("/memfd:{FENCE_NAME}");
        let mut refused = None;
        for e in std::fs::read_dir(&dir)? {
            let path = e?.path();
            let Ok(target) = std::fs::read_link(&path) else {
                continue;
            };
            if !target.to_string_lossy().starts_with(&want) {
                continue;
            }
            let Some(n) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let got =
                rustix::process::pidfd_getfd(pidfd, n, rustix::process::PidfdGetfdFlags::empty())
                    .map_err(io::Error::from)
                    .and_then(|fd| Self::checked(fd, &path.display().to_string()));
            match got {
                Ok(f) => return Ok(Some(f)),
                Err(e) => refused = refused.or(Some(e)),
            }
        }
        refused.map_or(Ok(None), Err)
    }

    /// `fd` (named `what` in errors) as a fence, checked: sealed against shrinking (asked
    /// first: only shmem files have seals, and asking makes no round trip to any file
    /// system), the right size, the magic.
    fn checked(fd: OwnedFd, what: &str) -> io::Result<WriteFence> {
        let bad = |why: &str| io::Error::other(format!("{what}: {why}: not memfold's write fence"));
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| bad("no seals"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(bad("not sealed against shrinking"));
        }
        if rustix::fs::fstat(&fd)?.st_size as usize != LEN {
            return Err(bad("wrong size"));
        }
        let f = Self::map(fd)?;
        if f.magic().load(Ordering::SeqCst) != MAGIC {
            return Err(bad("no magic"));
        }
        Ok(f)
    }

    fn map(fd: OwnedFd) -> io::Result<WriteFence> {
        // SAFETY: a new shared mapping of LEN bytes of a memfd at least that long (sized
        // or checked by the callers), at an address the kernel picks.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                LEN,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )?
        };
        Ok(WriteFence {
            base: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap gave null"))?,
            _fd: fd,
        })
    }

    fn magic(&self) -> &AtomicU64 {
        // SAFETY: the header's first 8 bytes, aligned (page-aligned mapping), inside it.
        unsafe { &*self.base.as_ptr().cast::<AtomicU64>() }
    }

    fn closed(&self) -> &AtomicU32 {
        // SAFETY: 4 aligned bytes of the header, inside the mapping.
        unsafe { &*self.base.as_ptr().add(CLOSED_AT).cast::<AtomicU32>() }
    }

    fn slot(&self, s: usize) -> &AtomicU32 {
        debug_assert!(s < SLOTS);
        // SAFETY: slot s < SLOTS is 4-byte aligned inside the mapping after the header.
        unsafe { &*self.base.as_ptr().add(HEADER + 4 * s).cast::<AtomicU32>() }
    }

    /// The slot of chunk `chunk` (address / [`CHUNK`]).
    fn slot_of(chunk: u64) -> usize {
        (chunk.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48) as usize % SLOTS
    }

    /// Holds every chunk of each `(address, length)` range until the hold is dropped: call
    /// before the system call that writes them, drop after it returned.
    pub fn hold(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> FenceHold<'_> {
        let mut slots = Vec::new();
        for (va, len) in ranges {
            if len == 0 {
                continue;
            }
            // No call transfers more (the kernel's MAX_RW_COUNT); a bogus length from a
            // caller holds at most this much and never overflows.
            let len = len.min(MAX_TRANSFER);
            let (first, last) = (va / CHUNK, va.saturating_add(len - 1) / CHUNK);
            for c in first..=last {
                let s = Self::slot_of(c);
                self.slot(s).fetch_add(1, Ordering::SeqCst);
                slots.push(s as u32);
            }
        }
        FenceHold { fence: self, slots }
    }

    /// Closes the fence for good: every page is busy from now on (see the module). Call
    /// before the first call whose copy may land after it returns.
    pub fn close(&self) {
        self.closed().store(1, Ordering::SeqCst);
    }

    /// Whether the fence was closed ([`WriteFence::close`]).
    pub fn is_closed(&self) -> bool {
        self.closed().load(Ordering::SeqCst) != 0
    }

    /// Whether a writer may be copying into the page at `va`: ask after write-protecting
    /// it, before reading it. Always, once the fence is closed.
    pub fn busy(&self, va: u64) -> bool {
        self.is_closed() || self.slot(Self::slot_of(va / CHUNK)).load(Ordering::SeqCst) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_finds_its_own_fence_and_holds_are_seen_through_both_mappings() {
        let agent = WriteFence::create().unwrap();
        let me = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        assert!(
            WriteFence::of_process(me.as_fd(), std::process::id())
                .unwrap()
                .is_some(),
            "a fence is among this process's descriptors"
        );
        // Other tests make fences too: this one's, by its descriptor.
        let device = WriteFence::checked(agent._fd.try_clone().unwrap(), "this").unwrap();
        let va = 0x7f00_0000_0000u64;
        assert!(!agent.busy(va));
        {
            let _h = device.hold([(va + 4096, 3 * CHUNK)]);
            assert!(agent.busy(va) && agent.busy(va + 3 * CHUNK + 4095));
        }
        assert!(!agent.busy(va) && !agent.busy(va + 3 * CHUNK));
        // Sealed: the memfd cannot be shrunk under a device's mapping.
        assert!(rustix::fs::ftruncate(&agent._fd, 0).is_err());
        // Closed by a writer whose copies land later: every page busy, for good.
        assert!(!agent.is_closed());
        device.close();
        assert!(agent.is_closed() && agent.busy(va) && agent.busy(0));
    }

    #[test]
    fn a_bogus_length_holds_at_most_one_call_s_worth_and_never_overflows() {
        let f = WriteFence::create().unwrap();
        let h = f.hold([(u64::MAX - 10, u64::MAX), (0, u64::MAX)]);
        assert!(h.slots.len() <= 1 + (MAX_TRANSFER / CHUNK + 1) as usize);
        assert!(f.busy(0) && f.busy(u64::MAX - 10));
        drop(h);
        assert!(!f.busy(0));
    }

    #[test]
    fn a_memfd_named_as_the_fence_but_not_sealed_or_sized_is_refused() {
        let fake = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fake, LEN as u64).unwrap();
        let e = WriteFence::checked(fake, "fake").unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        let small = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&small, 4096).unwrap();
        rustix::fs::fcntl_add_seals(&small, SealFlags::SHRINK).unwrap();
        let e = WriteFence::checked(small, "small").unwrap_err();
        assert!(e.to_string().contains("wrong size"), "{e}");
        let blank = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&blank, LEN as u64).unwrap();
        rustix::fs::fcntl_add_seals(&blank, SealFlags::SHRINK).unwrap();
        let e = WriteFence::checked(blank, "blank").unwrap_err();
        assert!(e.to_string().contains("no magic"), "{e}");
        // A FIFO (what a hostile QEMU could put where the fence was) is refused without
        // blocking: nothing is opened, and a FIFO has no seals.
        let dir = std::env::temp_dir().join(format!("fence-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &dir,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
            0,
        )
        .unwrap();
        let fifo = rustix::fs::open(
            &dir,
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NONBLOCK,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        let _ = std::fs::remove_file(&dir);
        let e = WriteFence::checked(fifo, "fifo").unwrap_err();
        assert!(e.to_string().contains("no seals"), "{e}");
    }
}
