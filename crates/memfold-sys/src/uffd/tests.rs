//! The userfaultfd wrapper's tests: errors, the device, fills.

use super::*;
use memfold_ids::Gfn;

#[test]
fn errors_name_the_ioctl_the_range_and_the_errno() {
    let e = UffdError::Ioctl {
        ioctl: Ioctl::Continue,
        start: 0x7000,
        len: 0x1000,
        errno: io::Error::from_raw_os_error(libc::EINVAL),
    };
    let s = e.to_string();
    assert!(
        s.starts_with("UFFDIO_CONTINUE at 0x7000 (+0x1000): "),
        "{s}"
    );
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    let io: io::Error = e.into();
    assert_eq!(io.kind(), io::ErrorKind::InvalidInput);
    let m = UffdError::MissingFeatures {
        missing: 0x400,
        available: 0x3ff,
    };
    assert_eq!(
        m.to_string(),
        "userfaultfd features 0x400 missing (kernel has 0x3ff)"
    );
}

/// `/dev/userfaultfd` gives a userfaultfd with the agent's features, as the syscall
/// does (where this process may open the device: root here); a missing device is
/// an error, not a descriptor.
#[test]
fn the_device_gives_a_userfaultfd_like_the_syscall() {
    let e = Uffd::open_device("/nonexistent/userfaultfd").unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    match Uffd::open_device(DEV_USERFAULTFD) {
        Ok(fd) => {
            let u = Uffd::api(
                fd,
                FEATURE_WP_SHMEM | FEATURE_MINOR_SHMEM | FEATURE_MISSING_SHMEM,
            )
            .expect("UFFDIO_API on the device's userfaultfd");
            // Non-blocking: nothing pending reads as None, not a hang.
            assert!(matches!(u.read_raw(), Ok(None)), "{:?}", u.read_raw());
        }
        Err(e) if rustix::process::geteuid().is_root() => {
            panic!("root cannot open {DEV_USERFAULTFD}: {e}")
        }
        Err(e) => crate::testing::skipped(
            "the_device_gives_a_userfaultfd_like_the_syscall",
            &format!("{DEV_USERFAULTFD} (not root): {e}"),
        ),
    }
}

/// Where the kernel lets this process open a userfaultfd, the features it lists
/// include the agent's (which `open` just got).
#[test]
fn available_features_list_what_open_gets() {
    match Uffd::open(AGENT_FEATURES) {
        Ok(_) => {}
        Err(e) if rustix::process::geteuid().is_root() => {
            panic!("root has no userfaultfd with the agent's features: {e}")
        }
        Err(e) => {
            crate::testing::skipped(
                "available_features_list_what_open_gets",
                &format!("no userfaultfd with the agent's features (not root): {e}"),
            );
            return;
        }
    }
    let f = available_features().expect("UFFDIO_API with no features");
    assert_eq!(f & AGENT_FEATURES, AGENT_FEATURES, "{f:#x}");
}

/// Where the kernel lets this process open a userfaultfd (root here), a registered
/// memfd mapping faults to us and is filled by `copy`, and protection round-trips.
#[test]
fn a_registered_memfd_mapping_is_served_by_copy() {
    let u = match Uffd::open(FEATURE_MISSING_SHMEM) {
        Ok(u) => u,
        Err(e) if rustix::process::geteuid().is_root() => {
            panic!("root has no userfaultfd: {e}")
        }
        Err(e) => {
            crate::testing::skipped(
                "a_registered_memfd_mapping_is_served_by_copy",
                &format!("no userfaultfd (not root): {e}"),
            );
            return;
        }
    };
    assert!(matches!(u.read_event(), Ok(None)), "nothing pending");
    let fd = crate::memfd::create("uffd-test").unwrap();
    crate::memfd::set_len(fd.as_fd(), 4096).unwrap();
    // SAFETY: a new shared mapping of our memfd, used only through raw pointers.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            4096,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            &fd,
            0,
        )
    }
    .unwrap();
    let addr = p as u64;
    // SAFETY: the mapping above is ours, and no Rust reference points into it.
    unsafe { u.register(addr, 4096, MODE_MISSING) }.unwrap();
    // No thread waits: fill it ahead of the first touch.
    u.copy(addr, &[5u8; 4096], false).unwrap();
    u.copy(addr, &[6u8; 4096], false).unwrap(); // EEXIST only wakes
                                                // SAFETY: the page is filled: reading it does not fault.
    assert_eq!(unsafe { std::ptr::read_volatile(p as *const u8) }, 5);
    match u.write_protect(addr, 4096, true) {
        Err(UffdError::Ioctl {
            ioctl: Ioctl::WriteProtect,
            start,
            len: 4096,
            ..
        }) => assert_eq!(start, addr),
        other => panic!("write-protect without MODE_WP: {other:?}"),
    }
    // SAFETY: unmaps the mapping made above.
    unsafe { rustix::mm::munmap(p, 4096) }.unwrap();
}

/// A memfd of `pages` pages mapped shared, registered with `mode` on `u`; its address.
fn registered(u: &Uffd, pages: u64, mode: u64) -> (OwnedFd, u64) {
    let fd = crate::memfd::create("uffd-fill-test").unwrap();
    crate::memfd::set_len(fd.as_fd(), pages * 4096).unwrap();
    // SAFETY: a new shared mapping of our memfd, used only through raw pointers.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            (pages * 4096) as usize,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            &fd,
            0,
        )
    }
    .unwrap();
    // SAFETY: the mapping above is ours, and no Rust reference points into it.
    unsafe { u.register(p as u64, pages * 4096, mode) }.unwrap();
    (fd, p as u64)
}

/// The memfd's page `i`, read through the file (never through the registered mapping,
/// whose missing pages would wait for a handler this test does not run).
fn file_page(fd: &OwnedFd, i: u64) -> Vec<u8> {
    let mut b = vec![0xEEu8; 4096];
    crate::memfd::pread_exact(fd.as_fd(), &mut b, i * 4096).unwrap();
    b
}

/// A fill over a range whose middle page is filled already goes on past it: the kernel
/// stops at that page and says `EAGAIN` with the count it filled, which taken for "an
/// event waits" tried the whole range again, met `EEXIST` on its first page and left the
/// rest missing under an `Ok`. Copy (each page its own bytes, from the right offset of
/// the source), zero fill and continue, each with a page present in the middle.
#[test]
fn a_fill_over_a_range_with_a_page_present_fills_every_missing_page() {
    let u = match Uffd::open(FEATURE_MISSING_SHMEM | FEATURE_MINOR_SHMEM) {
        Ok(u) => u,
        Err(e) if rustix::process::geteuid().is_root() => {
            panic!("root has no userfaultfd: {e}")
        }
        Err(e) => {
            crate::testing::skipped(
                "a_fill_over_a_range_with_a_page_present_fills_every_missing_page",
                &format!("no userfaultfd (not root): {e}"),
            );
            return;
        }
    };
    // UFFDIO_COPY: page 1 holds 0x55 first; pages 0, 2, 3 get 1, 3, 4 from the source.
    let (fd, at) = registered(&u, 4, MODE_MISSING);
    u.copy(at + 4096, &[0x55; 4096], false).unwrap();
    let src: Vec<u8> = (0..4u8).flat_map(|i| [i + 1; 4096]).collect();
    u.copy(at, &src, false).unwrap();
    for (i, want) in [1u8, 0x55, 3, 4].into_iter().enumerate() {
        assert_eq!(file_page(&fd, i as u64), vec![want; 4096], "copy, page {i}");
    }
    // UFFDIO_ZEROPAGE (without waking, as the agent's no-copy fills): every page present.
    let (fd, at) = registered(&u, 3, MODE_MISSING);
    u.copy(at + 4096, &[7; 4096], false).unwrap();
    u.zeropage_dontwake(at, 3 * 4096).unwrap();
    let present = crate::memfd::data_runs(fd.as_fd(), Gfn(0), Gfn(3));
    assert_eq!(
        present,
        vec![(Gfn(0), Gfn(3))],
        "zero fill left a page missing"
    );
    assert_eq!(file_page(&fd, 1), vec![7; 4096]);
    // UFFDIO_CONTINUE: pages 0..3 in the file, page 1 mapped first; all mapped after.
    let (fd, at) = registered(&u, 3, MODE_MINOR);
    for i in 0..3u64 {
        rustix::io::pwrite(&fd, &[i as u8 + 9; 4096], i * 4096).unwrap();
    }
    u.cont(at + 4096, 4096, false).unwrap();
    u.cont(at, 3 * 4096, false).unwrap();
    let mapped = crate::pagemap::Pagemap::open()
        .unwrap()
        .read_present(at, 3 * 4096)
        .unwrap();
    assert_eq!(mapped, 3, "continue left a page unmapped");
}
