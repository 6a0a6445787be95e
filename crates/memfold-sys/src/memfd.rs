//! Memfds: creating one, positional reads and writes, freeing and counting its pages,
//! and finding the runs of pages that hold data (not holes).
//!
//! Every call borrows the descriptor ([`BorrowedFd`]): the caller keeps it open for the
//! call, and nothing here closes or takes it. The calls work on any file, but memfold uses
//! them on memfds (guest RAM, the pool, the store) and the swap file.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use memfold_ids::Gfn;
use rustix::fs::{FallocateFlags, MemfdFlags, SeekFrom};

/// Bytes in a page (guest pages, pool frames).
const PAGE: u64 = 4096;

/// Creates a memfd named `name` (shown as `/memfd:NAME` in `/proc/*/fd`), close-on-exec,
/// of size 0.
///
/// Errors: the process is out of descriptors or the host out of memory.
pub fn create(name: &str) -> io::Result<OwnedFd> {
    Ok(rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)?)
}

/// A new, unnamed file in folder `dir`, mode 0600 (`O_TMPFILE`): no other process can open
/// it by name, and nothing is left behind when its last descriptor closes. A swap file.
/// `O_EXCL`: it can never be given a name either (`linkat` refused), so a peer holding a
/// descriptor (a QEMU, the guest's swap file) cannot leave it behind in the folder.
///
/// Errors: the folder is missing or unwritable, or its file system lacks `O_TMPFILE`
/// (then: pick a folder on ext4, xfs, btrfs or tmpfs).
pub fn tmpfile(dir: &std::path::Path) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        dir,
        OFlags::TMPFILE | OFlags::EXCL | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(io::Error::from)
}

/// Whether `fd` is a file in memory (a memfd, or another shmem or hugetlbfs file: those
/// answer `F_GET_SEALS`). Reading one never waits on a device or another process, as a
/// file on a FUSE mount a peer serves could.
pub fn is_memory_file(fd: BorrowedFd<'_>) -> bool {
    rustix::fs::fcntl_get_seals(fd).is_ok()
}

/// Whether `fd` is a memfd open for reading and writing: what a pool handed back by a
/// peer must be before memfoldd adopts it (only memfds take seals; a read-only or
/// write-only descriptor would fail memfoldd's reads or the agents' mappings later).
pub fn is_read_write_memfd(fd: BorrowedFd<'_>) -> bool {
    let rw = rustix::fs::fcntl_getfl(fd)
        .is_ok_and(|f| f & rustix::fs::OFlags::RWMODE == rustix::fs::OFlags::RDWR);
    rw && is_memory_file(fd)
}

/// Sets the size of `fd` to `len` bytes (growing it adds holes, which take no memory).
///
/// Errors: the file cannot be resized (a sealed memfd, a full disk for a file).
pub fn set_len(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    Ok(rustix::fs::ftruncate(fd, len)?)
}

/// The size of `fd`, bytes (holes included).
///
/// Errors: fstat failed.
pub fn size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(rustix::fs::fstat(fd)?.st_size as u64)
}

/// Reads `buf.len()` bytes at `off`; bytes beyond the end of the file read as zeros.
///
/// Errors: the read failed.
pub fn pread_exact(fd: BorrowedFd<'_>, buf: &mut [u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(fd, &mut buf[done..], off + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads `buf.len()` bytes at `off`, all within the file: for a file whose every byte
/// asked must exist (a pool frame), where [`pread_exact`]'s zeros past the end would
/// pass for content.
///
/// Errors: the read failed; the file ends before `off + buf.len()`
/// (`UnexpectedEof`, naming the offset).
pub fn pread_within(fd: BorrowedFd<'_>, buf: &mut [u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(fd, &mut buf[done..], off + done as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the file ends at byte {}, before {}",
                        off + done as u64,
                        off + buf.len() as u64
                    ),
                ))
            }
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes all of `buf` at `off`.
///
/// Errors: the write failed (ENOSPC, ENOMEM), or wrote nothing.
pub fn pwrite_all(fd: BorrowedFd<'_>, buf: &[u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pwrite(fd, &buf[done..], off + done as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "failed to write whole buffer",
                ))
            }
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Frees `len` bytes of `fd` at `off` (a hole: reads as zeros, takes no memory or disk),
/// keeping the file's size. Returns whether the kernel did; failing only keeps the memory.
pub fn punch_hole(fd: BorrowedFd<'_>, off: u64, len: u64) -> bool {
    rustix::fs::fallocate(
        fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        off,
        len,
    )
    .is_ok()
}

/// The (device, inode) of the file `fd` refers to: which memfd or file it is, whoever
/// holds it.
///
/// Errors: fstat failed.
pub fn file_id(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// Writes what was written to `fd` through to its disk (fdatasync).
///
/// Errors: the write-back failed (EIO, ENOSPC).
pub fn sync_data(fd: BorrowedFd<'_>) -> io::Result<()> {
    Ok(rustix::fs::fdatasync(fd)?)
}

/// Drops the page cache of `[off, off+len)` of `fd` (`POSIX_FADV_DONTNEED`): a file
/// read once keeps no host memory. Advice only: a failure changes nothing.
pub fn drop_cache(fd: BorrowedFd<'_>, off: u64, len: u64) {
    let _ = rustix::fs::fadvise(
        fd,
        off,
        std::num::NonZeroU64::new(len),
        rustix::fs::Advice::DontNeed,
    );
}

/// Bytes of memory (or disk) `fd` has allocated: its blocks, holes taking none; 0 if
/// fstat fails.
pub fn allocated_bytes(fd: BorrowedFd<'_>) -> u64 {
    rustix::fs::fstat(fd).map_or(0, |st| st.st_blocks as u64 * 512)
}

/// Bytes of memory (or disk) `fd` has allocated in its first `max_len` bytes. A file no
/// longer than that: its blocks (one fstat); a longer one — grown by a peer that holds it
/// read-write — its data runs there ([`data_runs`]), so that what the peer put past
/// `max_len` is not counted, and the walk is bounded by `max_len`, not by the peer.
pub fn allocated_bytes_within(fd: BorrowedFd<'_>, max_len: u64) -> u64 {
    let all = allocated_bytes(fd);
    if size(fd).is_ok_and(|s| s <= max_len) {
        return all;
    }
    let end = Gfn((max_len / PAGE).min(u64::from(u32::MAX)) as u32);
    let within: u64 = data_runs(fd, Gfn(0), end)
        .iter()
        .map(|&(a, b)| u64::from(b.0 - a.0) * PAGE)
        .sum();
    within.min(all)
}

/// The first run `[a, b)` of pages at or after `from` and before `end` that holds data in
/// `fd` (not a hole; `SEEK_DATA`, then `SEEK_HOLE`); `None` if there is none, or the
/// seek fails. Page `g` is bytes `[g·4096, (g+1)·4096)`; a run that starts or ends inside
/// a page covers the whole page.
pub fn next_data_run(fd: BorrowedFd<'_>, from: Gfn, end: Gfn) -> Option<(Gfn, Gfn)> {
    let end_off = end.offset();
    let data = rustix::fs::seek(fd, SeekFrom::Data(from.offset())).ok()?;
    if data >= end_off {
        return None;
    }
    let hole = rustix::fs::seek(fd, SeekFrom::Hole(data)).map_or(end_off, |h| h.min(end_off));
    let a = (data / PAGE) as u32;
    Some((Gfn(a), Gfn((hole.div_ceil(PAGE) as u32).max(a + 1))))
}

/// All runs of [`next_data_run`] in `[first, end)`, in order.
pub fn data_runs(fd: BorrowedFd<'_>, first: Gfn, end: Gfn) -> Vec<(Gfn, Gfn)> {
    let mut runs = Vec::new();
    let mut from = first;
    while let Some((a, b)) = next_data_run(fd, from, end) {
        runs.push((a, b));
        from = b;
    }
    runs
}

/// Where the kernel's transparent huge page settings are.
pub const THP_SYSFS: &str = "/sys/kernel/mm/transparent_hugepage";

/// Why the host may back a memfd's pages with huge folios (shmem transparent huge
/// pages), read from the settings under `thp` ([`THP_SYSFS`]); `None` if it never does
/// (no THP, `never`, `deny`). A huge folio breaks what memfold does to single pages: a
/// hole punched in one is zeroed, not freed, when the folio cannot split, and a page
/// written into a range of holes allocates the whole folio, zeroed — the holes around it
/// then hold data. `advise` counts: QEMU asks for huge pages on all its RAM
/// (`MADV_HUGEPAGE`), and a memfd mapped so is backed by huge folios at its faults.
pub fn shmem_huge_folios(thp: &std::path::Path) -> Option<String> {
    let chosen = |p: std::path::PathBuf| -> Option<String> {
        let s = std::fs::read_to_string(p).ok()?;
        let (_, rest) = s.split_once('[')?;
        Some(rest.split_once(']')?.0.to_string())
    };
    let global = chosen(thp.join("shmem_enabled")).unwrap_or_else(|| "never".into());
    let huge = |v: &str| matches!(v, "always" | "within_size" | "advise" | "force");
    match global.as_str() {
        "deny" => return None,
        "force" => return Some("shmem_enabled is force".into()),
        _ => {}
    }
    // Each size's setting: (its name, its value, inherit resolved).
    let per_size: Vec<(String, String)> = std::fs::read_dir(thp)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("hugepages-"))
        .filter_map(|e| {
            let v = chosen(e.path().join("shmem_enabled"))?;
            let v = if v == "inherit" { global.clone() } else { v };
            Some((e.file_name().to_string_lossy().into_owned(), v))
        })
        .collect();
    let mut sizes: Vec<String> = per_size
        .iter()
        .filter(|(_, v)| huge(v))
        .map(|(n, v)| format!("{n} {v}"))
        .collect();
    sizes.sort();
    if huge(&global) && per_size.is_empty() {
        // A kernel without per-size settings: the global one is the PMD size's.
        sizes.push(format!("shmem_enabled {global}"));
    }
    (!sizes.is_empty()).then(|| format!("shmem huge pages: {}", sizes.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// A swap file cannot be given a name by whoever holds it: a QEMU with its guest's
    /// swap file would otherwise `linkat` it into the folder, left there for good.
    #[test]
    fn a_tmpfile_cannot_be_linked_into_its_folder() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let f = tmpfile(dir.path()).unwrap();
        let named = dir.path().join("kept");
        let linked = rustix::fs::linkat(
            rustix::fs::CWD,
            format!("/proc/self/fd/{}", f.as_raw_fd()),
            rustix::fs::CWD,
            &named,
            rustix::fs::AtFlags::SYMLINK_FOLLOW,
        );
        assert!(linked.is_err(), "the swap file was linked as {named:?}");
        assert!(!named.exists());
    }

    #[test]
    fn positional_io_holes_and_data_runs() {
        let fd = create("memfold-sys-test").unwrap();
        let fd = fd.as_fd();
        set_len(fd, 16 * PAGE).unwrap();
        assert_eq!(allocated_bytes(fd), 0, "a new memfd is all holes");
        assert!(is_read_write_memfd(fd));
        let file = tempfile::tempfile().unwrap();
        assert!(
            !is_read_write_memfd(file.as_fd()),
            "a plain file is no memfd"
        );
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        let write_only = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        assert!(!is_read_write_memfd(write_only.as_fd()));
        assert_eq!(data_runs(fd, Gfn(0), Gfn(16)), vec![]);
        pwrite_all(fd, &[1u8; 4096 * 2], 2 * PAGE).unwrap();
        pwrite_all(fd, &[2u8; 10], 9 * PAGE + 100).unwrap();
        assert_eq!(allocated_bytes(fd), 3 * PAGE);
        assert_eq!(
            data_runs(fd, Gfn(0), Gfn(16)),
            vec![(Gfn(2), Gfn(4)), (Gfn(9), Gfn(10))]
        );
        assert_eq!(next_data_run(fd, Gfn(3), Gfn(16)), Some((Gfn(3), Gfn(4))));
        assert_eq!(next_data_run(fd, Gfn(0), Gfn(3)), Some((Gfn(2), Gfn(3))));
        assert_eq!(next_data_run(fd, Gfn(10), Gfn(16)), None);
        let mut buf = [9u8; 8];
        pread_exact(fd, &mut buf, 3 * PAGE + 4092).unwrap();
        assert_eq!(buf, [1, 1, 1, 1, 0, 0, 0, 0]);
        let mut tail = [9u8; 8];
        pread_exact(fd, &mut tail, 16 * PAGE - 4).unwrap();
        assert_eq!(tail, [0; 8], "past the end reads as zeros");
        assert!(punch_hole(fd, 2 * PAGE, PAGE));
        assert_eq!(allocated_bytes(fd), 2 * PAGE);
        assert_eq!(
            data_runs(fd, Gfn(0), Gfn(16)),
            vec![(Gfn(3), Gfn(4)), (Gfn(9), Gfn(10))]
        );
        assert_eq!(size(fd).unwrap(), 16 * PAGE);
    }

    /// The settings as this kernel writes them: the chosen value in brackets; a size set
    /// to `inherit` takes the global value; `deny` overrides all.
    #[test]
    fn shmem_huge_folios_are_read_from_the_thp_settings() {
        let d = tempfile::tempdir().unwrap();
        let set = |rel: &str, v: &str| {
            let p = d.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, v).unwrap();
        };
        assert_eq!(shmem_huge_folios(d.path()), None, "no THP at all");
        set(
            "shmem_enabled",
            "[always] within_size advise never deny force\n",
        );
        assert_eq!(
            shmem_huge_folios(d.path()).as_deref(),
            Some("shmem huge pages: shmem_enabled always"),
            "a kernel without per-size settings"
        );
        set(
            "shmem_enabled",
            "always within_size advise [never] deny force\n",
        );
        set(
            "hugepages-2048kB/shmem_enabled",
            "always [inherit] within_size advise never\n",
        );
        set(
            "hugepages-64kB/shmem_enabled",
            "always inherit within_size advise [never]\n",
        );
        assert_eq!(shmem_huge_folios(d.path()), None, "this host's settings");
        set(
            "shmem_enabled",
            "always within_size [advise] never deny force\n",
        );
        assert_eq!(
            shmem_huge_folios(d.path()).as_deref(),
            Some("shmem huge pages: hugepages-2048kB advise"),
            "inherit takes advise"
        );
        set(
            "hugepages-64kB/shmem_enabled",
            "always inherit [within_size] advise never\n",
        );
        set(
            "shmem_enabled",
            "always within_size advise never [deny] force\n",
        );
        assert_eq!(shmem_huge_folios(d.path()), None, "deny overrides");
        set(
            "shmem_enabled",
            "always within_size advise [never] deny force\n",
        );
        assert!(shmem_huge_folios(d.path())
            .unwrap()
            .contains("hugepages-64kB within_size"));
        // The global setting only reaches sizes that inherit it: none here.
        set(
            "hugepages-64kB/shmem_enabled",
            "always inherit within_size advise [never]\n",
        );
        set(
            "hugepages-2048kB/shmem_enabled",
            "always inherit within_size advise [never]\n",
        );
        set(
            "shmem_enabled",
            "always within_size [advise] never deny force\n",
        );
        assert_eq!(shmem_huge_folios(d.path()), None, "no size inherits advise");
    }
}
