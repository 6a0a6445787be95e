//! The kernel's own memory-saving kit beside KSM, which memfold is measured against
//! (issue 15): zswap (a compressed pool in front of swap), a swap file for it, a memory
//! cgroup whose limit a proactive-reclaim controller lowers (Meta's Senpai/TMO), and the
//! pressure stall information (PSI) that guards it. Settings are saved when taken and
//! written back when dropped; the swap file is switched off and removed when dropped.
//!
//! Only the cgroup v1 memory controller is driven (`memory.limit_in_bytes`), as this
//! host mounts it; a host with the memory controller on cgroup v2 is refused with a
//! message that says so.

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
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io(path))?;
    f.write_all(value.as_bytes()).map_err(io(path))
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

/// Bytes of RAM the zswap pool takes now (`Zswap:` in /proc/meminfo: the compressed
/// pages' own bytes, host-wide), and the bytes of the pages it holds (`Zswapped:`).
///
/// Errors: /proc/meminfo unreadable or without the lines (kernel < 5.19).
pub fn zswap_pool() -> Result<(u64, u64), ReclaimError> {
    let path = Path::new("/proc/meminfo");
    let text = read(path)?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .ok_or_else(|| {
                ReclaimError::Unavailable(format!(
                    "/proc/meminfo has no {name} line (kernel ≥ 5.19)"
                ))
            })
    };
    Ok((field("Zswap:")?, field("Zswapped:")?))
}

/// A swap file, on while this lives: switched off and removed when dropped.
pub struct SwapFile {
    path: PathBuf,
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
        let s = SwapFile {
            path: path.to_path_buf(),
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
        Ok(s)
    }
}

impl Drop for SwapFile {
    /// Switches the file off, then removes it; a file still in use as swap (swapoff
    /// refused: the pages on it had no memory to come back to) is left in place, named
    /// in a warning, rather than unlinked under the kernel.
    fn drop(&mut self) {
        let Ok(c) = CString::new(self.path.as_os_str().as_bytes()) else {
            return;
        };
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

/// The cgroup v1 memory controller's mount.
pub const MEMCG_V1: &str = "/sys/fs/cgroup/memory";

/// A memory cgroup of its own (v1), removed when dropped (its processes must be gone by
/// then; they are moved to the root group first otherwise).
pub struct MemCgroup {
    dir: PathBuf,
}

impl MemCgroup {
    /// Creates memory cgroup `name` under the v1 controller, with no limit yet.
    ///
    /// Errors: the memory controller is not on cgroup v1 here (cgroup v2 hosts are not
    /// driven yet), or the group cannot be made (not root).
    pub fn create(name: &str) -> Result<MemCgroup, ReclaimError> {
        let root = Path::new(MEMCG_V1);
        if !root.join("memory.limit_in_bytes").exists() {
            return Err(ReclaimError::Unavailable(format!(
                "{MEMCG_V1}/memory.limit_in_bytes is missing: the memory controller is not mounted as cgroup v1 here (a cgroup v2 host's memory.max and memory.reclaim are not driven yet)"
            )));
        }
        let dir = root.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(&dir)(e)),
        }
        Ok(MemCgroup { dir })
    }

    /// The file a process writes `0` to, to join the group (before it allocates: "from
    /// birth", so that everything it uses is charged here).
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Memory charged to the group now, bytes.
    ///
    /// Errors: the file cannot be read.
    pub fn usage(&self) -> Result<u64, ReclaimError> {
        let p = self.dir.join("memory.usage_in_bytes");
        read(&p)?
            .parse()
            .map_err(|e| io(&p)(std::io::Error::other(e)))
    }

    /// The limit now, bytes.
    ///
    /// Errors: the file cannot be read.
    pub fn limit(&self) -> Result<u64, ReclaimError> {
        let p = self.dir.join("memory.limit_in_bytes");
        read(&p)?
            .parse()
            .map_err(|e| io(&p)(std::io::Error::other(e)))
    }

    /// Sets the limit, bytes: the kernel reclaims down to it in this thread (zswap
    /// compresses what it swaps out here). Returns false if it could not reclaim that far
    /// (`EBUSY`; the limit is then unchanged).
    ///
    /// Errors: any other failure to write it.
    pub fn set_limit(&self, bytes: u64) -> Result<bool, ReclaimError> {
        let p = self.dir.join("memory.limit_in_bytes");
        match write(&p, &bytes.to_string()) {
            Ok(()) => Ok(true),
            Err(ReclaimError::Io { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Lifts the limit (`-1`: none), so that nothing more is reclaimed from the group.
    ///
    /// Errors: the file cannot be written.
    pub fn unlimit(&self) -> Result<(), ReclaimError> {
        write(&self.dir.join("memory.limit_in_bytes"), "-1")
    }

    /// Pages of the group swapped out now (`swap` of memory.stat), bytes.
    ///
    /// Errors: memory.stat cannot be read.
    pub fn swapped(&self) -> Result<u64, ReclaimError> {
        let text = read(&self.dir.join("memory.stat"))?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix("swap "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0))
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        // Any process left goes back to the root group, so that the group can go.
        if let Ok(pids) = std::fs::read_to_string(self.procs_file()) {
            for pid in pids.lines() {
                let _ = write(&Path::new(MEMCG_V1).join("cgroup.procs"), pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Host-wide memory pressure: the total µs some task stalled on memory
/// (`/proc/pressure/memory`, the `some` line's `total`).
///
/// Errors: no PSI (`CONFIG_PSI`, or `psi=0`).
pub fn memory_stall_us() -> Result<u64, ReclaimError> {
    let path = Path::new("/proc/pressure/memory");
    let text = read(path)?;
    text.lines()
        .find(|l| l.starts_with("some "))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("total=")))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| ReclaimError::Unavailable("/proc/pressure/memory has no some total".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kit_reads_what_this_kernel_reports() {
        // /proc/meminfo and PSI exist on every kernel memfold supports; zswap's lines
        // since 5.19.
        let (pool, stored) = zswap_pool().unwrap();
        assert!(pool <= stored.max(pool));
        memory_stall_us().unwrap();
    }
}
