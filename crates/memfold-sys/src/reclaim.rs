//! The kernel's own memory-saving kit beside KSM, which memfold is measured against
//! (issue 15): zswap (a compressed pool in front of swap), a swap file for it, a memory
//! cgroup whose limit a proactive-reclaim controller lowers (Meta's Senpai/TMO), and the
//! pressure stall information (PSI) that guards it. Settings are saved when taken and
//! written back when dropped; the swap file is switched off and removed when dropped.
//!
//! The memory cgroup ([`MemCgroup`]) is driven on either hierarchy, whichever carries the
//! memory controller on the host ([`MemCgroupRoot::detect`]): cgroup v1
//! (`memory.limit_in_bytes`, `memory.oom_control`) or cgroup v2 (`memory.max`,
//! `memory.reclaim`, `memory.events`, the group's own `memory.pressure`).

use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Errors of the kernel's reclaim kit.
#[derive(Debug, thiserror::Error)]
pub enum ReclaimError {
    /// A file of the kit could not be read or written (not root? not built in?).
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The kernel lacks a piece of the kit.
    #[error("{0}")]
    Unavailable(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ReclaimError + '_ {
    move |source| ReclaimError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read(path: &Path) -> Result<String, ReclaimError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(io(path))
}

fn write(path: &Path, value: &str) -> Result<(), ReclaimError> {
    // One write(2) of the whole value: sysfs and cgroup files take a value per write.
    // O_TRUNC as a shell's `>` (sysfs and cgroupfs ignore it; a plain file standing in
    // for one in tests then holds the last value written). Never created: a file the
    // kernel does not offer is an error.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(io(path))?;
    // One write(2), not write_all: an interrupted write (EINTR: a signal ended the kernel's
    // reclaim for a cgroup limit) is reported, not retried.
    let n = f.write(value.as_bytes()).map_err(io(path))?;
    if n != value.len() {
        return Err(io(path)(std::io::Error::other(format!(
            "short write: {n} of {} bytes",
            value.len()
        ))));
    }
    Ok(())
}

/// The signal [`interrupt`] sends: SIGUSR2, whose handler [`install_interrupt`] makes one
/// that does nothing.
pub const INTERRUPT_SIGNAL: libc::c_int = libc::SIGUSR2;

extern "C" fn on_interrupt(_: libc::c_int) {}

/// Installs a handler for [`INTERRUPT_SIGNAL`] that does nothing, without `SA_RESTART`, so
/// that [`interrupt`] ends the system call a thread is in with `EINTR` (a cgroup limit or
/// `memory.reclaim` write stops its reclaim on a pending signal). Installing it again does
/// no harm. Child processes lose it at exec.
///
/// Errors: sigaction refused.
pub fn install_interrupt() -> Result<(), ReclaimError> {
    // SAFETY: a zeroed sigaction with an empty mask, no flags and a handler that does
    // nothing (async-signal-safe); the old action is not asked for.
    let rc = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_interrupt as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(INTERRUPT_SIGNAL, &sa, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(ReclaimError::Unavailable(format!(
            "sigaction(SIGUSR2): {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// The calling thread, as [`interrupt`] names it.
pub fn this_thread() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() }
}

/// Sends [`INTERRUPT_SIGNAL`] to `thread` of this process (after [`install_interrupt`]):
/// the system call it is in returns `EINTR`.
///
/// # Safety
///
/// `thread` must be a thread of this process that has not ended (a `pthread_t` of an
/// ended thread may name nothing, or another thread).
///
/// Errors: pthread_kill refused.
pub unsafe fn interrupt(thread: libc::pthread_t) -> Result<(), ReclaimError> {
    // SAFETY: the caller vouches that `thread` is alive.
    let rc = unsafe { libc::pthread_kill(thread, INTERRUPT_SIGNAL) };
    if rc != 0 {
        return Err(ReclaimError::Unavailable(format!(
            "pthread_kill: {}",
            std::io::Error::from_raw_os_error(rc)
        )));
    }
    Ok(())
}

/// zswap's parameters folder.
pub const ZSWAP_DIR: &str = "/sys/module/zswap/parameters";

/// zswap under memfold's control: on with a compressor; the previous settings are
/// written back when dropped.
pub struct Zswap {
    dir: PathBuf,
    saved: Vec<(&'static str, String)>,
}

impl Zswap {
    /// Turns zswap on with `compressor` (one of the kernel's crypto compressors: this
    /// kernel offers lzo, lzo-rle and deflate) and a pool of at most `max_pool_percent` of
    /// RAM.
    ///
    /// Errors: no zswap (`CONFIG_ZSWAP`), the compressor refused, not root.
    pub fn enable(compressor: &str, max_pool_percent: u32) -> Result<Zswap, ReclaimError> {
        let dir = PathBuf::from(ZSWAP_DIR);
        if !dir.join("enabled").exists() {
            return Err(ReclaimError::Unavailable(format!(
                "{ZSWAP_DIR} is missing: the host kernel has no zswap (CONFIG_ZSWAP)"
            )));
        }
        let mut saved = Vec::new();
        for name in ["enabled", "compressor", "max_pool_percent"] {
            saved.push((name, read(&dir.join(name))?));
        }
        let z = Zswap { dir, saved };
        write(&z.dir.join("compressor"), compressor).map_err(|e| {
            ReclaimError::Unavailable(format!(
                "zswap refused the compressor {compressor:?} ({e}); /proc/crypto lists what this kernel has"
            ))
        })?;
        write(
            &z.dir.join("max_pool_percent"),
            &max_pool_percent.to_string(),
        )?;
        write(&z.dir.join("enabled"), "Y")?;
        Ok(z)
    }

    /// [`Zswap::enable`] with the first of `compressors` the kernel takes; returns the
    /// guard and the compressor's name.
    ///
    /// Errors: [`ReclaimError::Unavailable`] naming why each was refused (or no zswap);
    /// another error of [`Zswap::enable`] at once.
    pub fn enable_first<S: AsRef<str>>(
        compressors: &[S],
        max_pool_percent: u32,
    ) -> Result<(Zswap, String), ReclaimError> {
        let mut refused = Vec::new();
        for name in compressors.iter().map(AsRef::as_ref) {
            match Zswap::enable(name, max_pool_percent) {
                Ok(z) => return Ok((z, name.to_string())),
                Err(ReclaimError::Unavailable(why)) => refused.push(why),
                Err(e) => return Err(e),
            }
        }
        let names: Vec<&str> = compressors.iter().map(AsRef::as_ref).collect();
        Err(ReclaimError::Unavailable(format!(
            "zswap took none of the compressors {names:?}: {}",
            refused.join("; ")
        )))
    }
}

impl Drop for Zswap {
    fn drop(&mut self) {
        for (name, value) in self.saved.iter().rev() {
            let _ = write(&self.dir.join(name), value);
        }
    }
}

/// The kernel's swap readahead (`vm.page-cluster`) turned off while this lives, put back
/// when dropped. A swap-in of a guest page then brings back that page alone: with the
/// default (3: eight slots) every access to a page memfold paged out decompressed seven
/// untouched neighbours out of zswap, which the engine paged out again (issue 15). Both
/// sides of a comparison that swap through the kernel (memfold's zswap backing, the
/// kernel's kit) run under it: with readahead on, the neighbours sit in the swap cache
/// unmapped, in neither Pss nor the zswap pool, and that side's memory is undercounted.
pub struct SwapReadaheadOff {
    path: PathBuf,
    saved: String,
}

/// Where the kernel's swap readahead is set.
pub const PAGE_CLUSTER: &str = "/proc/sys/vm/page-cluster";

impl SwapReadaheadOff {
    /// Sets `vm.page-cluster` to 0.
    ///
    /// Errors: the file cannot be read or written (not root).
    pub fn new() -> Result<SwapReadaheadOff, ReclaimError> {
        SwapReadaheadOff::at(Path::new(PAGE_CLUSTER))
    }

    /// Sets the value in the file at `path` to 0, keeping the old one to put back.
    fn at(path: &Path) -> Result<SwapReadaheadOff, ReclaimError> {
        let saved = read(path)?;
        write(path, "0")?;
        Ok(SwapReadaheadOff {
            path: path.to_path_buf(),
            saved: saved.trim().to_string(),
        })
    }
}

impl Drop for SwapReadaheadOff {
    fn drop(&mut self) {
        let _ = write(&self.path, &self.saved);
    }
}

/// The host's `vm.page-cluster` now (`None`: unreadable), as a run's JSON records it.
pub fn page_cluster() -> Option<u32> {
    read(Path::new(PAGE_CLUSTER)).ok()?.trim().parse().ok()
}

/// Bytes of RAM the zswap pool takes now (`Zswap:` in /proc/meminfo: the compressed
/// pages' own bytes, host-wide), and the bytes of the pages it holds (`Zswapped:`).
///
/// Errors: /proc/meminfo unreadable or without the lines (kernel < 5.19).
pub fn zswap_pool() -> Result<(u64, u64), ReclaimError> {
    zswap_pool_of(&read(Path::new("/proc/meminfo"))?)
}

/// [`zswap_pool`] from the text of /proc/meminfo.
fn zswap_pool_of(text: &str) -> Result<(u64, u64), ReclaimError> {
    let field = |name: &str| {
        meminfo_bytes(text, name).ok_or_else(|| {
            ReclaimError::Unavailable(format!("/proc/meminfo has no {name} line (kernel ≥ 5.19)"))
        })
    };
    Ok((field("Zswap:")?, field("Zswapped:")?))
}

/// A swap file, on while this lives: switched off and removed when dropped.
pub struct SwapFile {
    path: PathBuf,
    /// Whether `swapon` took it: until then a failed create removes the file.
    on: bool,
}

impl SwapFile {
    /// Creates a swap file of `bytes` at `path` (allocated, not sparse, mode 0600), formats
    /// it with `mkswap` and switches it on.
    ///
    /// Errors: the file cannot be made (disk full), `mkswap` is missing or fails,
    /// `swapon` is refused (not root, a file system that cannot hold swap).
    pub fn create(path: &Path, bytes: u64) -> Result<SwapFile, ReclaimError> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io(path))?;
        // Dropped on any error below: the file is removed (it was never swap).
        let mut s = SwapFile {
            path: path.to_path_buf(),
            on: false,
        };
        // Allocated, not sparse: swapon refuses files with holes.
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, bytes)
            .map_err(|e| io(path)(e.into()))?;
        drop(f);
        let out = std::process::Command::new("mkswap")
            .arg(path)
            .output()
            .map_err(|e| {
                ReclaimError::Unavailable(format!("mkswap (util-linux) cannot run: {e}"))
            })?;
        if !out.status.success() {
            return Err(ReclaimError::Unavailable(format!(
                "mkswap {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| io(path)(e.into()))?;
        // SAFETY: swapon reads the NUL-terminated path it is given, which lives across the call.
        if unsafe { libc::swapon(c.as_ptr(), 0) } != 0 {
            return Err(io(path)(std::io::Error::last_os_error()));
        }
        s.on = true;
        Ok(s)
    }
}

impl Drop for SwapFile {
    /// Switches the file off, then removes it; a file still in use as swap (swapoff
    /// refused: the pages on it had no memory to come back to) is left in place, named
    /// in a warning, rather than unlinked under the kernel. One never switched on (a
    /// failed create) is only removed.
    fn drop(&mut self) {
        let Ok(c) = CString::new(self.path.as_os_str().as_bytes()) else {
            return;
        };
        if !self.on {
            let _ = std::fs::remove_file(&self.path);
            return;
        }
        // SAFETY: as in `create`; swapping the file's pages back in may take a while.
        if unsafe { libc::swapoff(c.as_ptr()) } == 0 {
            let _ = std::fs::remove_file(&self.path);
        } else {
            eprintln!(
                "swapoff {}: {}; the swap file is left in place (swapoff it, then remove it)",
                self.path.display(),
                std::io::Error::last_os_error()
            );
        }
    }
}

mod memcg;
pub use memcg::{CgroupVersion, MemCgroup, MemCgroupRoot, OomState, MEMCG_V1};

/// The `total` of the `some` line of a PSI file (`/proc/pressure/memory`, a v2 group's
/// `memory.pressure`): µs during which some task stalled; `None` if the text has none.
pub fn psi_some_total_us(text: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with("some "))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("total=")))
        .and_then(|v| v.parse().ok())
}

/// Host-wide memory pressure: the total µs some task stalled on memory
/// (`/proc/pressure/memory`, the `some` line's `total`).
///
/// Errors: no PSI (`CONFIG_PSI`, or `psi=0`).
pub fn memory_stall_us() -> Result<u64, ReclaimError> {
    let path = Path::new("/proc/pressure/memory");
    psi_some_total_us(&read(path)?)
        .ok_or_else(|| ReclaimError::Unavailable("/proc/pressure/memory has no some total".into()))
}

/// The host's swap space, bytes: every swap device's size and what is free on them. A
/// page zswap holds takes a swap slot as well, so `free` falls with zswap's pages too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct SwapSpace {
    /// `SwapTotal:` of /proc/meminfo, bytes.
    pub total: u64,
    /// `SwapFree:` of /proc/meminfo, bytes.
    pub free: u64,
}

impl SwapSpace {
    /// From the text of /proc/meminfo; `None` without both lines.
    pub fn parse(meminfo: &str) -> Option<SwapSpace> {
        Some(SwapSpace {
            total: meminfo_bytes(meminfo, "SwapTotal:")?,
            free: meminfo_bytes(meminfo, "SwapFree:")?,
        })
    }

    /// The host's now.
    ///
    /// Errors: /proc/meminfo unreadable or without the lines.
    pub fn now() -> Result<SwapSpace, ReclaimError> {
        let path = Path::new("/proc/meminfo");
        SwapSpace::parse(&read(path)?).ok_or_else(|| {
            ReclaimError::Unavailable("/proc/meminfo has no SwapTotal:/SwapFree: lines".into())
        })
    }
}

/// A `NAME: N kB` line of /proc/meminfo, bytes.
pub(crate) fn meminfo_bytes(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn readahead_is_turned_off_while_the_guard_lives_and_put_back_after() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("page-cluster");
        std::fs::write(&f, "3\n").unwrap();
        let now = || std::fs::read_to_string(&f).unwrap().trim().to_string();
        {
            let _g = super::SwapReadaheadOff::at(&f).unwrap();
            assert_eq!(now(), "0");
        }
        assert_eq!(now(), "3");
        assert!(super::SwapReadaheadOff::at(&dir.path().join("none")).is_err());
    }

    use super::*;

    /// A swap file that `mkswap` refuses (under its 40 KiB least) is an error, and the
    /// file it allocated is gone: it was left behind, allocated, "to swapoff".
    #[test]
    fn a_swap_file_that_fails_to_be_made_is_removed() {
        if std::process::Command::new("mkswap")
            .arg("--version")
            .output()
            .is_err()
        {
            crate::testing::skipped(
                "a_swap_file_that_fails_to_be_made_is_removed",
                "no mkswap (Debian: util-linux)",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.swap");
        assert!(SwapFile::create(&path, 4096).is_err());
        assert!(!path.exists(), "the failed swap file was left");
    }

    #[test]
    fn the_kit_reads_what_this_kernel_reports() {
        // /proc/meminfo and PSI exist on every kernel memfold supports; zswap's lines
        // since 5.19. What their numbers mean is checked on fixed text below.
        zswap_pool().unwrap();
        memory_stall_us().unwrap();
        let swap = SwapSpace::now().unwrap();
        assert!(swap.free <= swap.total);
    }

    #[test]
    fn this_hosts_memory_cgroup_is_driven_on_its_own_version() {
        // The real hierarchy (v1 on this host, v2 elsewhere); needs root to make a group.
        let root = MemCgroupRoot::detect().unwrap();
        let g = match MemCgroup::create_in(&root, &format!("memfold-test-{}", std::process::id())) {
            Ok(g) => g,
            Err(e) if rustix::process::geteuid().is_root() => {
                panic!("root cannot make a memory cgroup: {e}")
            }
            Err(e) => {
                crate::testing::skipped(
                    "this_hosts_memory_cgroup_is_driven_on_its_own_version",
                    &format!("cannot make a memory cgroup (not root): {e}"),
                );
                return;
            }
        };
        let killer_off = g.disable_oom_killer().unwrap();
        assert_eq!(killer_off, root.version == CgroupVersion::V1);
        let oom = g.oom().unwrap();
        assert_eq!(oom.killer_off, killer_off);
        assert!(!oom.under_oom && oom.oom_kills == 0);
        assert_eq!(oom.ooms.is_some(), root.version == CgroupVersion::V2);
        assert!(g.set_limit(64 << 20).unwrap());
        assert_eq!(g.limit().unwrap(), 64 << 20);
        g.unlimit().unwrap();
        assert!(g.limit().unwrap() >= 1 << 62);
        assert_eq!(g.usage().unwrap(), 0, "nothing in the group yet");
        assert_eq!(g.swapped().unwrap(), 0);
        if root.version == CgroupVersion::V2 {
            assert!(g.reclaim(4096).is_ok());
            assert!(g.stall_us().unwrap().is_some());
        }
        let dir = g.dir().to_path_buf();
        drop(g);
        assert!(!dir.exists(), "the group was removed");
    }

    #[test]
    fn an_interrupt_ends_another_threads_system_call_with_eintr() {
        install_interrupt().unwrap();
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into the array it is given.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let [r, w] = fds;
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            tx.send(this_thread()).unwrap();
            let mut buf = [0u8; 1];
            // Blocks: nothing is ever written to the pipe.
            // SAFETY: reads at most one byte into `buf` from the pipe's read end.
            let n = unsafe { libc::read(r, buf.as_mut_ptr().cast(), 1) };
            (n, std::io::Error::last_os_error().raw_os_error())
        });
        let t = rx.recv().unwrap();
        // Until the read has started; the signal is sent again until it ends.
        let mut sent = 0;
        while !reader.is_finished() && sent < 100 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            // SAFETY: the reader thread has not been joined and is still running (checked
            // just before; it ends only when its read does).
            unsafe { interrupt(t).unwrap() };
            sent += 1;
        }
        assert_eq!(reader.join().unwrap(), (-1, Some(libc::EINTR)));
        // SAFETY: the pipe's two descriptors, used by nothing else now.
        unsafe {
            libc::close(r);
            libc::close(w);
        }
    }

    #[test]
    fn psi_and_swap_lines_parse() {
        let psi = "some avg10=0.00 avg60=0.10 avg300=0.02 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=99\n";
        assert_eq!(psi_some_total_us(psi), Some(123_456));
        assert_eq!(psi_some_total_us("full total=3"), None);
        let meminfo = "MemTotal: 100 kB\nSwapTotal:  2048 kB\nSwapFree:   1024 kB\n";
        assert_eq!(
            SwapSpace::parse(meminfo),
            Some(SwapSpace {
                total: 2 << 20,
                free: 1 << 20
            })
        );
        assert_eq!(SwapSpace::parse("SwapTotal: 1 kB"), None);
    }

    /// The pool's own bytes are `Zswap:` and the bytes of the pages it holds
    /// `Zswapped:`, each its own line (one name a prefix of the other but for the
    /// colon), in kB; a kernel without them (before 5.19) is an error.
    #[test]
    fn zswap_lines_parse_to_the_pool_and_what_it_holds() {
        let meminfo = "MemTotal:       16318104 kB\n\
                       SwapTotal:       8388604 kB\n\
                       SwapFree:        8000000 kB\n\
                       Zswap:             12345 kB\n\
                       Zswapped:          67890 kB\n\
                       Dirty:               100 kB\n";
        assert_eq!(
            zswap_pool_of(meminfo).unwrap(),
            (12_345 * 1024, 67_890 * 1024)
        );
        // The order of the lines is the kernel's, not the parser's.
        assert_eq!(
            zswap_pool_of("Zswapped: 2 kB\nZswap: 1 kB\n").unwrap(),
            (1024, 2048)
        );
        assert!(zswap_pool_of("MemTotal: 1 kB\nZswap: 1 kB\n").is_err());
        assert!(zswap_pool_of("MemTotal: 1 kB\n").is_err());
    }
}
