//! Guest RAM handed out of QEMU at run time: `sendmsg` with `SCM_RIGHTS`, interposed.
//!
//! A vhost-user back end (virtiofsd, a DPDK switch, SPDK) maps guest RAM from the memfd
//! QEMU sends it and writes it in its own process — outside QEMU's page tables, so
//! outside the agent's write-protection: a write under a shared page goes to the memfd
//! while the guest reads the frame, a write under a reclaimed page is dropped
//! (docs/security.md, "Out of scope"). The agent leaves a guest alone whose command line
//! names such a device (`RamPlan::outside_writers`), but one hot-plugged later
//! (`chardev-add` and `device_add vhost-user-fs-pci`, `netdev_add vhost-user`) gets the
//! memfd while the guest is managed. The only way out for the memfd is a file descriptor
//! sent over a Unix socket, and QEMU sends those with libc's `sendmsg`; the agent, loaded
//! before libc, defines `sendmsg` itself.
//!
//! **Invariant:** while an agent manages a region, that region's memfd leaves the process
//! only from the agent's own threads (to memfoldd, which checks its peers itself) or to a
//! process named `memfold-blk`, which writes guest RAM through QEMU's page tables
//! (`process_vm_writev`). Any other send carrying it fails with `EPERM` before anything is
//! sent, with one log line naming the receiver: the hot-plugged device fails to start
//! (QEMU reports the error), and the guest's data stay whole. `memfold-blk` is told by its
//! process name (`/proc/PID/comm`, readable whatever the peer's user): the receiver is a
//! process the operator connected, and the name is there against an accident, not an
//! attacker — a process that can write QEMU's memory can write guest RAM anyway.
//!
//! Sends carrying no descriptor (nearly all of QEMU's) pass after two loads; so do all
//! sends while no region is managed.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The receiver a managed region's memfd may be sent to: memfold's block device.
const ALLOWED_RECEIVER: &str = "memfold-blk";

/// A managed region: its memfd's (device, inode) and its name, for the log.
struct Region {
    id: (u64, u64),
    name: String,
}

/// Every region an agent of this process manages.
static MANAGED: Mutex<Vec<Region>> = Mutex::new(Vec::new());

/// `MANAGED.len()`, read without the lock on every send.
static HOW_MANY: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread is an agent's: its sends (the hello to memfoldd) pass.
    static AGENT_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as an agent's: the memfds it sends are its own hellos.
pub(crate) fn mark_agent_thread() {
    AGENT_THREAD.with(|a| a.set(true));
}

/// Whether the calling thread is an agent's ([`mark_agent_thread`]).
pub(crate) fn is_agent_thread() -> bool {
    AGENT_THREAD.try_with(Cell::get).unwrap_or(false)
}

/// A region recorded as managed until this is dropped.
pub(crate) struct Managed {
    id: (u64, u64),
}

/// Records the region whose memfd has `id` (device, inode; `memfd::file_id`) as managed,
/// under `name`: from now on its memfd is sent to no one but memfold-blk (the invariant
/// above).
pub(crate) fn manage(id: (u64, u64), name: &str) -> Managed {
    let mut m = MANAGED.lock().unwrap_or_else(|e| e.into_inner());
    m.push(Region {
        id,
        name: name.to_string(),
    });
    HOW_MANY.store(m.len(), Ordering::SeqCst);
    Managed { id }
}

impl Drop for Managed {
    fn drop(&mut self) {
        let mut m = MANAGED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = m.iter().position(|r| r.id == self.id) {
            m.remove(i);
        }
        HOW_MANY.store(m.len(), Ordering::SeqCst);
    }
}

/// libc's `sendmsg`.
type SendMsg = unsafe extern "C" fn(libc::c_int, *const libc::msghdr, libc::c_int) -> isize;

/// libc's `sendmsg`, found once past this library (`RTLD_NEXT`); `None` if not found.
fn next_sendmsg() -> Option<SendMsg> {
    static NEXT: OnceLock<usize> = OnceLock::new();
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name only looks a symbol up.
    let p =
        *NEXT.get_or_init(|| unsafe { libc::dlsym(libc::RTLD_NEXT, c"sendmsg".as_ptr()) } as usize);
    // SAFETY: the symbol libc exports as `sendmsg` has `sendmsg`'s C signature.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, SendMsg>(p) })
}

/// `sendmsg(2)` as libc's, except that a message carrying the memfd of a region an agent
/// manages, sent by a thread not an agent's to a process not memfold-blk, is refused:
/// -1 with `errno` `EPERM`, nothing sent (the invariant above).
///
/// # Safety
///
/// As libc's `sendmsg`: `msg` points to a valid `msghdr` whose buffers are valid for the
/// lengths it gives.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(
    fd: libc::c_int,
    msg: *const libc::msghdr,
    flags: libc::c_int,
) -> isize {
    if HOW_MANY.load(Ordering::SeqCst) > 0
        && !msg.is_null()
        // SAFETY: `msg` is valid (the caller's contract).
        && unsafe { (*msg).msg_controllen } > 0
        && !is_agent_thread()
    {
        // SAFETY: as above.
        if let Err(why) = unsafe { may_send(fd, msg) } {
            tracing::error!("{why}");
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = libc::EPERM };
            return -1;
        }
    }
    match next_sendmsg() {
        // SAFETY: libc's sendmsg with the caller's arguments.
        Some(f) => unsafe { f(fd, msg, flags) },
        // SAFETY: the system call with the caller's arguments, as libc would make it.
        None => unsafe { libc::syscall(libc::SYS_sendmsg, fd, msg, flags) as isize },
    }
}

/// Whether message `msg` may go out on socket `fd`: `Err` with the line to log if it
/// carries a managed region's memfd to a process not memfold-blk.
///
/// # Safety
///
/// `msg` points to a valid `msghdr` whose control buffer is valid for its length.
unsafe fn may_send(fd: libc::c_int, msg: *const libc::msghdr) -> Result<(), String> {
    let mut sent = Vec::new();
    // SAFETY: the CMSG_* walk stays inside the control buffer (the caller's contract;
    // CMSG_NXTHDR returns null past its end), each header's data is read no further than
    // the buffer's end whatever its `cmsg_len` says, and each descriptor unaligned.
    unsafe {
        let end = ((*msg).msg_control as usize).saturating_add((*msg).msg_controllen);
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let bytes = ((*c).cmsg_len as usize)
                    .saturating_sub(libc::CMSG_LEN(0) as usize)
                    .min(end.saturating_sub(data as usize));
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    sent.push(data.add(i).read_unaligned());
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    let region = {
        let m = MANAGED.lock().unwrap_or_else(|e| e.into_inner());
        sent.iter().find_map(|&f| {
            let id = file_id(f)?;
            m.iter().find(|r| r.id == id).map(|r| r.name.clone())
        })
    };
    let Some(region) = region else {
        return Ok(());
    };
    let (pid, comm) = receiver(fd);
    if comm.as_deref() == Some(ALLOWED_RECEIVER) {
        return Ok(());
    }
    Err(format!(
        "refused to send guest RAM of {region} to {} over socket {fd}: a process that maps \
         guest RAM itself (a vhost-user back end such as virtiofsd) writes it outside QEMU's \
         page tables, where memfold's write-protection does not reach, and the guest would \
         lose those writes; only memfold-blk may have it. Run this guest unmanaged to add \
         such a device (docs/security.md)",
        match (pid, comm) {
            (Some(p), Some(c)) => format!("pid {p} ({c})"),
            (Some(p), None) => format!("pid {p}"),
            _ => "a receiver whose process is unknown".to_string(),
        }
    ))
}

/// The (device, inode) of open descriptor `fd`, if it is one.
fn file_id(fd: libc::c_int) -> Option<(u64, u64)> {
    // SAFETY: all zeroes is a valid `stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only into `st`, which it is given whole.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

/// The process at the other end of Unix socket `fd` (SO_PEERCRED) and its name
/// (`/proc/PID/comm`); `None` for what is not known (not a connected Unix socket, a
/// process in another PID namespace: pid 0).
fn receiver(fd: libc::c_int) -> (Option<u32>, Option<String>) {
    // SAFETY: all zeroes is a valid `ucred` (plain integers).
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    let got = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if got != 0 || cred.pid <= 0 {
        return (None, None);
    }
    let pid = cred.pid as u32;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end_matches('\n').to_string());
    (Some(pid), comm)
}

#[cfg(test)]
mod tests;
