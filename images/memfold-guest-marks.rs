//! memfold-guest's never-share marks (issue 17, Satori §4.3; docs/side-channel.md): the
//! `never-share` command keeps them in [`MARKS`], and `serve` resolves them to frames for
//! each answer (a process's present pages from its pagemap, a file's resident pages by
//! mapping it). A module of images/memfold-guest.rs, built with it (no crates).

use std::fs::File;
use std::io::Write;

use super::{read_full, PAGE};

/// The never-share marks, one a line: `pid P START` (START: the process's start time,
/// field 22 of `/proc/P/stat`, so a reused pid is not taken for it) or `path F`.
pub const MARKS: &str = "/run/memfold-guest/never-share";
/// Most pages one mark resolves to (16 GiB of a process's address space, 32 MiB of
/// pagemap read); past it the mark covers the first ones and says so.
pub const MAX_MARK_PAGES: u64 = 1 << 22;
/// The never-share bit of a frame's code (memfold_core::categories::PageInfo).
pub const NEVER_SHARE: u8 = 1 << 6;

/// Process `pid`'s start time (field 22 of `/proc/PID/stat`, clock ticks since boot).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// `memfold-guest never-share ARGS`: adds a mark to [`MARKS`], lists or clears them.
pub fn never_share(args: &[String]) -> Result<(), String> {
    let marks = std::fs::read_to_string(MARKS).unwrap_or_default();
    let line = match (args.first().map(String::as_str), args.get(1)) {
        (Some("--list"), None) => {
            print!("{marks}");
            return Ok(());
        }
        (Some("--clear"), None) => {
            return with_marks_locked(|| match std::fs::remove_file(MARKS) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("{MARKS}: {e}")),
                _ => Ok(()),
            })?;
        }
        (Some("--pid"), Some(p)) => {
            let pid: u32 = p
                .parse()
                .map_err(|_| format!("--pid {p}: not a process id"))?;
            let start = start_time(pid).ok_or(format!("--pid {pid}: no such process"))?;
            format!("pid {pid} {start}")
        }
        (Some("--path"), Some(f)) => {
            let path = std::fs::canonicalize(f).map_err(|e| format!("--path {f}: {e}"))?;
            let meta = std::fs::metadata(&path).map_err(|e| format!("--path {f}: {e}"))?;
            if !meta.is_file() {
                return Err(format!("--path {f}: not a regular file"));
            }
            let path = path.to_str().ok_or(format!("--path {f}: not UTF-8"))?;
            if path.contains('\n') {
                return Err(format!("--path {f}: a newline in its name"));
            }
            format!("path {path}")
        }
        _ => return Err("never-share --pid P | --path F | --list | --clear".into()),
    };
    with_marks_locked(|| {
        let marks = std::fs::read_to_string(MARKS).unwrap_or_default();
        if marks.lines().any(|l| l == line) {
            return Ok(());
        }
        let mut f = File::options()
            .create(true)
            .append(true)
            .open(MARKS)
            .map_err(|e| format!("{MARKS}: {e}"))?;
        f.write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("{MARKS}: {e}"))
    })?
}

/// Present frames of `pagemap` entries for pages `[first, first + count)` of an address
/// space, pushed to `out`; at most `budget` pages read (decremented).
pub fn present_frames(
    pagemap: &File,
    first: u64,
    count: u64,
    budget: &mut u64,
    out: &mut Vec<u64>,
) {
    const N: u64 = 8192;
    let mut buf = vec![0u8; (N * 8) as usize];
    let mut page = first;
    while page < first + count && *budget > 0 {
        let n = N.min(first + count - page).min(*budget);
        let bytes = (n * 8) as usize;
        if read_full(pagemap, &mut buf[..bytes], page * 8).is_err() {
            return; // an address the kernel will not describe ([vsyscall])
        }
        for e in buf[..bytes].chunks_exact(8) {
            let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            let pfn = e & ((1 << 55) - 1);
            if e >> 63 == 1 && pfn != 0 {
                out.push(pfn);
            }
        }
        page += n;
        *budget -= n;
    }
}

/// The frames process `pid` maps now (if it is still the process started at `start`).
pub fn frames_of_pid(pid: u32, start: u64, out: &mut Vec<u64>) -> Result<(), String> {
    if start_time(pid) != Some(start) {
        return Err(format!("pid {pid}: gone"));
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| format!("pid {pid}: maps: {e}"))?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| format!("pid {pid}: pagemap: {e}"))?;
    let mut budget = MAX_MARK_PAGES;
    for l in maps.lines() {
        let mut fields = l.split_whitespace();
        let (Some((a, b)), Some(perms)) =
            (fields.next().and_then(|r| r.split_once('-')), fields.next())
        else {
            continue;
        };
        // Reservations nothing can touch (guard pages, a runtime's reserved heap) hold no
        // pages, and would use up the budget before the stacks at the top.
        if perms.starts_with("---") {
            continue;
        }
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        present_frames(&pagemap, a / PAGE, (b - a) / PAGE, &mut budget, out);
    }
    if budget == 0 {
        return Err(format!(
            "pid {pid}: over {MAX_MARK_PAGES} pages, the first ones marked"
        ));
    }
    Ok(())
}

extern "C" {
    fn mmap(
        addr: *mut std::ffi::c_void,
        len: usize,
        prot: i32,
        flags: i32,
        fd: i32,
        off: i64,
    ) -> *mut std::ffi::c_void;
    fn munmap(addr: *mut std::ffi::c_void, len: usize) -> i32;
    fn mincore(addr: *mut std::ffi::c_void, len: usize, vec: *mut u8) -> i32;
    fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
    fn flock(fd: i32, operation: i32) -> i32;
}

/// `madvise` advice: fault the range in for reading, failing (not SIGBUS) past the end
/// of a file (Linux 5.14).
const MADV_POPULATE_READ: i32 = 22;
const O_NONBLOCK: i32 = 0o4000;
const O_NOFOLLOW: i32 = 0o400000;
const LOCK_EX: i32 = 2;

/// Runs `f` holding an exclusive lock on the marks' folder (a `never-share` adding a
/// mark and `serve` dropping the gone ones do not lose each other's changes).
fn with_marks_locked<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    use std::os::fd::AsRawFd;
    let dir = std::path::Path::new(MARKS).parent().expect("a directory");
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let lock = File::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: flock on a descriptor this function owns; released when it is closed.
    if unsafe { flock(lock.as_raw_fd(), LOCK_EX) } != 0 {
        return Err(format!(
            "{}: flock: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    let out = f();
    drop(lock);
    Ok(out)
}

/// The frames of file `path`'s pages in the guest's page cache now: the file mapped,
/// `mincore` says which pages are resident, a read of each maps it (no I/O: it is
/// resident), and this process's pagemap gives its frame.
pub fn frames_of_path(path: &str, out: &mut Vec<u64>) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    // Not blocking (a FIFO put in the file's place), not through a symlink, and a
    // regular file once open (a mark is checked when made; the path may change after).
    let f = File::options()
        .read(true)
        .custom_flags(O_NONBLOCK | O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!("{path}: gone"),
            _ => format!("{path}: {e}"),
        })?;
    let meta = f.metadata().map_err(|e| format!("{path}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{path}: not a regular file any more"));
    }
    let len = meta.len();
    let pages = len.div_ceil(PAGE).min(MAX_MARK_PAGES);
    if pages == 0 {
        return Ok(());
    }
    let bytes = (pages * PAGE) as usize;
    // SAFETY: a fresh read-only shared mapping of an open file; no Rust reference points
    // into it, and it is unmapped below.
    let base = unsafe {
        mmap(
            std::ptr::null_mut(),
            bytes,
            1, /* PROT_READ */
            1, /* MAP_SHARED */
            f.as_raw_fd(),
            0,
        )
    };
    if base as isize == -1 {
        return Err(format!("{path}: mmap: {}", std::io::Error::last_os_error()));
    }
    let mut resident = vec![0u8; pages as usize];
    // SAFETY: `base` maps `bytes` bytes; `resident` holds one byte a page.
    let r = unsafe { mincore(base, bytes, resident.as_mut_ptr()) };
    let mut result = Ok(());
    if r != 0 {
        result = Err(format!(
            "{path}: mincore: {}",
            std::io::Error::last_os_error()
        ));
    } else {
        let pagemap = File::open("/proc/self/pagemap").map_err(|e| format!("pagemap: {e}"));
        match pagemap {
            Err(e) => result = Err(e),
            Ok(pagemap) => {
                // Each run of resident pages mapped by the kernel (MADV_POPULATE_READ: a
                // page past a file truncated meanwhile is an error, not a SIGBUS), then
                // their frames read from pagemap at once.
                let mut i = 0;
                while i < resident.len() {
                    if resident[i] & 1 == 0 {
                        i += 1;
                        continue;
                    }
                    let mut e = i + 1;
                    while e < resident.len() && resident[e] & 1 == 1 {
                        e += 1;
                    }
                    let addr = base as usize + i * PAGE as usize;
                    let len = (e - i) * PAGE as usize;
                    // SAFETY: a run inside the mapping made above; the kernel only
                    // faults its pages in.
                    let r =
                        unsafe { madvise(addr as *mut std::ffi::c_void, len, MADV_POPULATE_READ) };
                    if r != 0 {
                        result = Err(format!(
                            "{path}: mapping its pages: {}",
                            std::io::Error::last_os_error()
                        ));
                        break;
                    }
                    let mut budget = (e - i) as u64;
                    present_frames(
                        &pagemap,
                        addr as u64 / PAGE,
                        (e - i) as u64,
                        &mut budget,
                        out,
                    );
                    i = e;
                }
            }
        }
    }
    // SAFETY: the mapping made above, not used after.
    unsafe { munmap(base, bytes) };
    if len.div_ceil(PAGE) > MAX_MARK_PAGES && result.is_ok() {
        result = Err(format!(
            "{path}: over {MAX_MARK_PAGES} pages, the first ones marked"
        ));
    }
    result
}

/// The frames every mark in [`MARKS`] names now, sorted, and what went wrong (a mark
/// whose process or file is gone is dropped from the file).
pub fn resolve_marks() -> (Vec<u64>, Vec<String>) {
    let Ok(marks) = std::fs::read_to_string(MARKS) else {
        return (Vec::new(), Vec::new());
    };
    let (mut frames, mut problems, mut gone) = (Vec::new(), Vec::new(), Vec::new());
    for l in marks.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        let r = match (w.as_slice(), l.strip_prefix("path ")) {
            (["pid", p, s], _) => match (p.parse(), s.parse()) {
                (Ok(p), Ok(s)) => frames_of_pid(p, s, &mut frames),
                _ => Err(format!("bad mark {l:?}")),
            },
            (_, Some(path)) if !path.is_empty() => frames_of_path(path, &mut frames),
            _ => Err(format!("bad mark {l:?}")),
        };
        match r {
            Err(e) if e.ends_with(": gone") => gone.push(l),
            Err(e) => problems.push(e),
            Ok(()) => {}
        }
    }
    if !gone.is_empty() {
        // Under the lock, from the file as it is now (a mark added meanwhile stays),
        // written whole elsewhere and renamed over it.
        let dropped = with_marks_locked(|| {
            let now = std::fs::read_to_string(MARKS).unwrap_or_default();
            let kept: String = now
                .lines()
                .filter(|l| !gone.contains(l))
                .map(|l| format!("{l}\n"))
                .collect();
            let tmp = format!("{MARKS}.new");
            std::fs::write(&tmp, kept)
                .and_then(|_| std::fs::rename(&tmp, MARKS))
                .map_err(|e| format!("{MARKS}: {e}"))
        });
        if let Err(e) | Ok(Err(e)) = dropped {
            problems.push(e);
        }
    }
    frames.sort_unstable();
    frames.dedup();
    (frames, problems)
}
