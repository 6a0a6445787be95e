//! The interposed `sendmsg`: a managed region's memfd reaches no receiver but memfold-blk.

use std::os::fd::{AsRawFd, OwnedFd};

use super::*;

/// Tests that rename this process (`/proc/self/comm`) or depend on its name take turns.
static NAME: Mutex<()> = Mutex::new(());

/// A new memfd and its (device, inode).
fn memfd(name: &str) -> (OwnedFd, (u64, u64)) {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let id = file_id(fd.as_raw_fd()).unwrap();
    (fd, id)
}

/// A connected pair of Unix stream sockets (both ends' peer is this process).
fn pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// Sends one byte and `fd` over `sock` through the interposed `sendmsg`, as QEMU would.
fn send_fd(sock: &OwnedFd, fd: &OwnedFd) -> std::io::Result<()> {
    let byte = [7u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_ptr() as *mut _,
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: all zeroes is a valid msghdr (null pointers, zero lengths).
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = space;
    // SAFETY: the control buffer is `space` bytes, room for one descriptor's header and
    // data, and 8-byte aligned; every pointer outlives the call.
    let n = unsafe {
        let c = libc::CMSG_FIRSTHDR(&hdr);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
        (libc::CMSG_DATA(c) as *mut libc::c_int).write_unaligned(fd.as_raw_fd());
        sendmsg(sock.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL)
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes waiting at `sock`, without waiting.
fn waiting(sock: &OwnedFd) -> usize {
    let mut buf = [0u8; 16];
    rustix::net::recv(sock, &mut buf, rustix::net::RecvFlags::DONTWAIT)
        .map(|(n, _)| n)
        .unwrap_or(0)
}

#[test]
fn a_managed_regions_memfd_reaches_no_other_process() {
    let _turn = NAME.lock().unwrap_or_else(|e| e.into_inner());
    let (ram, id) = memfd("memory-backend-memfd");
    let (other, _) = memfd("not-guest-ram");
    let (a, b) = pair();
    let managed = manage(id, "web");
    let err = send_fd(&a, &ram).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    assert_eq!(waiting(&b), 0, "nothing of a refused send went out");
    // Another descriptor passes, and so does guest RAM no agent manages any more.
    send_fd(&a, &other).unwrap();
    assert_eq!(waiting(&b), 1);
    drop(managed);
    send_fd(&a, &ram).unwrap();
    assert_eq!(waiting(&b), 1);
}

#[test]
fn an_agent_thread_sends_its_own_hello() {
    let (ram, id) = memfd("memory-backend-memfd");
    let (a, b) = pair();
    let _managed = manage(id, "db");
    std::thread::spawn(move || {
        mark_agent_thread();
        send_fd(&a, &ram).unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(waiting(&b), 1);
}

#[test]
fn memfold_blk_may_have_it() {
    let _turn = NAME.lock().unwrap_or_else(|e| e.into_inner());
    let (ram, id) = memfd("memory-backend-memfd");
    let (a, b) = pair();
    let _managed = manage(id, "py");
    // The pair's peer is this process: named as the block device, it is one.
    let was = std::fs::read_to_string("/proc/self/comm").unwrap();
    std::fs::write("/proc/self/comm", ALLOWED_RECEIVER).unwrap();
    let sent = send_fd(&a, &ram);
    std::fs::write("/proc/self/comm", was.trim_end()).unwrap();
    sent.unwrap();
    assert_eq!(waiting(&b), 1);
}
