//! When a pool adopted after a restart may be let go of.
//!
//! A restarted memfoldd adopts each domain's pool from the agents that re-attach with it,
//! and keeps every frame of it until the adoption ends; then the frames no guest's books
//! hold are freed (punched). It may end only once every process that may map the pool
//! has told memfoldd what it maps. **Invariant**: a holder of the pool (a process with a
//! descriptor of it) counts as re-attached only if every guest RAM region it maps is the
//! RAM of an attached guest — not merely one of them. A QEMU has one guest a region
//! (memfold-agent's `regions.rs`: `NAME/ram0`, `NAME/ram1`, …), and each region's agent
//! re-attaches on its own, after writing its stashed pages back; ended when the first
//! region of a multi-region QEMU re-attached, the adoption freed the frames the others
//! still mapped, and their guests read zeros there. A holder whose maps memfoldd cannot
//! read keeps the adoption (so does a RAM region no agent manages: its frames stay until
//! the QEMU exits, memory kept, nothing lost).

/// The memfd name QEMU gives every `memory-backend-memfd` object (memfold-agent's
/// `regions::QEMU_MEMFD_NAME`), as `/proc/PID/maps` shows it.
const QEMU_RAM_MEMFD: &str = "/memfd:memory-backend-memfd";

/// The guest RAM regions process `pid` maps or holds: every shared, writable mapping of
/// a memfd named as QEMU names its RAM, and every descriptor of one, by the memfd's
/// (device, inode), once each. The descriptors count too: a region whose every page is
/// on a pool frame has no mapping of its RAM memfd left (each share moved a pool mapping
/// over it), yet its agent has still to re-attach. `None` if the maps or the descriptors
/// cannot be read or a line cannot be parsed.
pub(crate) fn ram_regions(pid: u32) -> Option<Vec<(u64, u64)>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut out = Vec::new();
    for l in maps.lines() {
        let mut f = l.split_whitespace();
        let (_range, perms, _offset, dev, ino) =
            (f.next(), f.next()?, f.next(), f.next()?, f.next()?);
        let path = f.next().unwrap_or("");
        if !(perms.starts_with("rw") && perms.ends_with('s') && path.starts_with(QEMU_RAM_MEMFD)) {
            continue;
        }
        let (major, minor) = dev.split_once(':')?;
        let dev = libc::makedev(
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        );
        let id = (dev, ino.parse().ok()?);
        if !out.contains(&id) {
            out.push(id);
        }
    }
    use std::os::unix::fs::MetadataExt;
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten() {
        let named = std::fs::read_link(fd.path()).is_ok_and(|t| {
            t.as_os_str()
                .as_encoded_bytes()
                .starts_with(QEMU_RAM_MEMFD.as_bytes())
        });
        // Followed to the file itself; one closed meanwhile is not held.
        let Some(m) = named.then(|| std::fs::metadata(fd.path()).ok()).flatten() else {
            continue;
        };
        let id = (m.dev(), m.ino());
        if !out.contains(&id) {
            out.push(id);
        }
    }
    Some(out)
}

/// Whether every holder in `holders` has re-attached ([module docs](self)): its pid is an
/// attached guest's (`attached_pids`) and every RAM region `regions_of` finds in it is an
/// attached guest's RAM (`attached_rams`, by device and inode).
pub(crate) fn every_holder_reattached(
    holders: &[u32],
    attached_pids: &[u32],
    attached_rams: &[(u64, u64)],
    regions_of: impl Fn(u32) -> Option<Vec<(u64, u64)>>,
) -> bool {
    holders.iter().all(|p| {
        attached_pids.contains(p)
            && regions_of(*p).is_some_and(|r| r.iter().all(|id| attached_rams.contains(id)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd};

    /// A shared mapping of a memfd named as QEMU names its RAM is a region, found by its
    /// memfd's device and inode (as `fstat` gives them); a private one, or a memfd named
    /// otherwise, is not.
    #[test]
    fn ram_regions_are_qemu_s_shared_ram_memfds() {
        let map = |name: &str, flags: i32| {
            let fd = memfold_sys::memfd::create(name).unwrap();
            memfold_sys::memfd::set_len(fd.as_fd(), 4096).unwrap();
            let id = memfold_sys::memfd::file_id(fd.as_fd()).unwrap();
            // SAFETY: a new mapping of a memfd this test owns, left mapped for the test's
            // life (so that its entry stays in the maps); never touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    fd.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            id
        };
        let ram = map("memory-backend-memfd", libc::MAP_SHARED);
        // A region whose every page is on a pool frame: no mapping of its RAM memfd left,
        // only its descriptor (QEMU's and its agent's). Found by the descriptor; missed,
        // the adoption ended before its agent re-attached and freed frames it maps.
        let held_ram = memfold_sys::memfd::create("memory-backend-memfd").unwrap();
        memfold_sys::memfd::set_len(held_ram.as_fd(), 4096).unwrap();
        let held = memfold_sys::memfd::file_id(held_ram.as_fd()).unwrap();
        let private = map("memory-backend-memfd", libc::MAP_PRIVATE);
        let pool = map("memfold-pool", libc::MAP_SHARED);
        let found = ram_regions(std::process::id()).unwrap();
        assert!(found.contains(&ram), "{found:?} lacks {ram:?}");
        assert!(found.contains(&held), "{found:?} lacks the held {held:?}");
        assert!(
            !found.contains(&private) && !found.contains(&pool),
            "{found:?}"
        );
        assert_eq!(ram_regions(u32::MAX), None, "no such process");
    }

    /// A QEMU of two regions has re-attached only once both have. Fails when one region
    /// re-attached counts for the QEMU (the adoption then freed the other's frames).
    #[test]
    fn a_holder_has_re_attached_only_once_every_region_has() {
        let regions = |p: u32| (p == 7).then(|| vec![(1, 10), (1, 11)]);
        assert!(!every_holder_reattached(&[7], &[7], &[(1, 10)], regions));
        assert!(every_holder_reattached(
            &[7],
            &[7],
            &[(1, 10), (1, 11)],
            regions
        ));
        assert!(!every_holder_reattached(
            &[7],
            &[],
            &[(1, 10), (1, 11)],
            regions
        ));
        // Maps that cannot be read keep the adoption.
        assert!(!every_holder_reattached(&[8], &[8], &[], regions));
        assert!(every_holder_reattached(&[], &[], &[], regions));
    }
}
